"""The mirror's local store: SQLite tables shaped from the KV schemas, changes applied one whole
PostgreSQL transaction at a time, each SQLite commit recording the stream position with the rows.

No NATS here: the follower (bootstrap, stream) hands this store decoded wire maps. Every write
is one SQLite transaction that also moves the table's position, so a mirror killed at any point
reopens at a consistent (rows, position) pair: nothing lost, nothing applied twice.

Local tables are named by the wire table name (``users``, ``sales/orders``), columns by their
PostgreSQL names. Column types follow the wire type mapping (README "Mirrors"):

=====================================  ===========  ===================================
PostgreSQL                             SQLite type  stored value
=====================================  ===========  ===================================
int2, int4, int8, oid, xid, cid        INTEGER      int
bool                                   INTEGER      0 / 1
xid8                                   (none)       int; above 2^63-1 its decimal text (INTEGER
                                                    affinity would turn that text into a lossy
                                                    real)
float4, float8                         (none)       float, -0.0 included (REAL affinity would
                                                    store -0.0 as 0); NaN as the text ``NaN``
                                                    (SQLite stores a NaN real as NULL)
bytea                                  BLOB         bytes
every other builtin type               TEXT         the wire string (numeric exact, ISO dates,
                                                    json/jsonb text, ...)
arrays                                 TEXT         JSON text of the nested lists (bytes as
                                                    ``\\x`` hex strings, NaN as ``"NaN"``)
domains, enums, extension types        (none)       the wire value as it is (no affinity,
                                                    so nothing is converted)
=====================================  ===========  ===================================
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import json
import math
import operator
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from cdc_platform.errors import CdcError
from cdc_platform.lsn import format_lsn, parse_lsn_cached
from cdc_platform.speedups import compiled_twin
from cdc_platform.wire import SCHEMA_OPERATION, applies

STATE_TABLE = "_cdc_mirror_tables"
# one row: the LSN at which every streaming table equals the source (README "Mirrors")
CONSISTENT_TABLE = "_cdc_mirror_consistent_lsn"
# a table being bootstrapped is loaded and caught up under this prefix, then renamed (wire
# names never hold a space, so no published table is named like this)
SHADOW_PREFIX = "_cdc_bootstrap "

_BOOL_OID = 16
_INTEGER_OIDS = frozenset({20, 21, 23, 26, 28, 29, _BOOL_OID})
_WIDE_INTEGER_OIDS = frozenset({5069})  # xid8: up to 2^64-1, past SQLite's int64
_REAL_OIDS = frozenset({700, 701})
_BLOB_OIDS = frozenset({17})
# Builtin types whose wire value is always a str (values.py): TEXT affinity keeps it as is.
_TEXT_OIDS = frozenset({
    18, 19, 25, 114, 142, 600, 601, 602, 603, 604, 628, 650, 718, 774, 790, 829, 869, 1042,
    1043, 1082, 1083, 1114, 1184, 1186, 1266, 1560, 1562, 1700, 2950, 3220, 3614, 3615, 3802,
    4072, 3904, 3906, 3908, 3910, 3912, 3926, 2205, 2206, 24, 27, 1033, 1790,
})
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1

_twin = compiled_twin(__name__)  # connect, ChunkLoader (cdc_platform/speedups.py)
# A chunk's bytes, and the chunk numbers already loaded -> (its number, rows written), or None
# (nothing written: the caller decodes it); see MirrorStore.chunk_loader
ChunkLoad = Callable[[bytes, set[int]], tuple[int, int] | None]
# a batched UPDATE whose event has no ``old``: its key did not change
_UPDATE_KEEPING_KEY = "UPDATE keeping its key"


class MirrorError(CdcError):
    """The mirror cannot go on as it is: a corrupt database, an unmappable schema."""


class DivergenceError(MirrorError):
    """A change does not fit the mirrored rows (a missing row, a duplicate key, a column or
    a value the table cannot hold): the mirror no longer equals the source and must bootstrap
    that table again."""

    table: str | None = None  # set for a batch flushed at commit (no event names it there)


# What a change's content can make applying it raise (a column the table lacks, a value no
# type maps, a malformed field or schema): the change does not fit; see _from_the_change.
_CHANGE_ERRORS = (KeyError, TypeError, ValueError, AttributeError, OverflowError, IndexError,
                  MirrorError, sqlite3.Error)
# SQLite's result codes a statement's content causes: SQLITE_ERROR (no such column, ...),
# a constraint, a value too big, a datatype mismatch, a parameter out of range. The others
# (busy, I/O, full, corrupt, ...) are the database's, not the change's: raised as they are.
_CHANGE_RESULT_CODES = frozenset({1, 18, 19, 20, 25})


def _from_the_change(exc: Exception, db: sqlite3.Connection) -> bool:
    """Whether ``exc``, raised applying a change, comes from the change itself (not when
    SQLite ended the transaction: a full disk, an I/O error, whatever a later statement
    then says)."""
    if not db.in_transaction:
        return False
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)  # (None: raised by Python's sqlite3)
        return code is None or code & 0xFF in _CHANGE_RESULT_CODES
    return True


def _does_not_fit(table: str, event: Mapping[str, Any] | None, exc: Exception
                  ) -> DivergenceError:
    what = (f"{event.get('operation')} {event.get('msg_id')!s:.80}" if event is not None
            else "a batch of changes")
    error = DivergenceError(f"{table}: {what} cannot be applied "
                            f"({type(exc).__name__}: {exc})")
    error.table = table
    return error


@dataclass
class Applied:
    """What :meth:`MirrorStore.apply_transaction` did."""

    events: int = 0
    stale: dict[str, str] = field(default_factory=dict)  # table -> why it needs a snapshot


class SchemaChange(Enum):
    CREATED = "created"
    ALTERED = "altered"
    UNCHANGED = "unchanged"
    NEEDS_BOOTSTRAP = "needs_bootstrap"  # a change no ALTER can follow (a type change, a key)


def sqlite_type(type_oid: int, data_type: str) -> str:
    """The declared SQLite type of a column (see the module docstring)."""
    if data_type.endswith("[]"):
        return "TEXT"
    if type_oid in _INTEGER_OIDS:
        return "INTEGER"
    if type_oid in _WIDE_INTEGER_OIDS:
        return ""  # an int, or its text past int64: no affinity may touch it
    if type_oid in _REAL_OIDS:
        return ""  # REAL affinity stores -0.0 as the integer 0: its sign would be lost
    if type_oid in _BLOB_OIDS:
        return "BLOB"
    if type_oid in _TEXT_OIDS:
        return "TEXT"
    return ""  # no affinity: stored exactly as the wire value


def _json_value(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray)):
        return "\\x" + bytes(value).hex()
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, float) and math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, list):
        return [_json_value(item) for item in value]
    return value


def to_sqlite(value: Any) -> Any:
    """A wire value -> the value bound to SQLite (see the module docstring)."""
    if value is None or isinstance(value, (str, bytes)):
        return value
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value if _INT64_MIN <= value <= _INT64_MAX else str(value)
    if isinstance(value, float):
        return "NaN" if math.isnan(value) else value
    if isinstance(value, (list, dict)):
        return json.dumps(_json_value(value), separators=(",", ":"), ensure_ascii=False)
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise MirrorError(f"no SQLite mapping for a {type(value).__name__} value")


_AS_IS_OIDS = _INTEGER_OIDS | _BLOB_OIDS | _TEXT_OIDS


def _as_is(column: MirroredColumn) -> bool:
    """Whether the column's wire values are bound to SQLite unconverted (str, int, bytes,
    bool, None): no float (NaN), no array (lists), no unknown type."""
    return column.type_oid in _AS_IS_OIDS


def quote(identifier: str) -> str:
    """An SQLite identifier, quoted (any name PostgreSQL allows)."""
    return '"' + identifier.replace('"', '""') + '"'


def _insert_statement(table: str, names: Sequence[str]) -> str:
    return (f"INSERT INTO {quote(table)} ({', '.join(quote(n) for n in names)}) "
            f"VALUES ({', '.join('?' * len(names))})")


# JSON payloads carry bytea as base64 and non-finite floats as strings (README "Payload
# encoding"): the columns whose values a JSON consumer must turn back, by type oid.
_JSON_BYTES_OIDS = frozenset({17, 1001})  # bytea, bytea[]
_JSON_FLOAT_OIDS = frozenset({700, 701, 1021, 1022})  # float4/8 and their arrays
_NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _from_base64(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_base64(item) for item in value]
    return base64.b64decode(value) if isinstance(value, str) else value


def _from_json_float(value: Any) -> Any:
    if isinstance(value, list):
        return [_from_json_float(item) for item in value]
    return _NON_FINITE[value] if isinstance(value, str) else value


@dataclass(frozen=True)
class MirroredColumn:
    name: str
    sqlite_type: str
    is_primary_key: bool
    type_oid: int = 0
    attnum: int = 0  # the source column's identity, kept by a RENAME (0: not known)


@dataclass(frozen=True)
class TableShape:
    """What the store needs of a KV ``schemas`` value."""

    table: str  # wire name
    fingerprint: str
    columns: tuple[MirroredColumn, ...]

    @classmethod
    def from_schema(cls, schema: Mapping[str, Any]) -> TableShape:
        table = schema.get("table") if isinstance(schema, Mapping) else None
        try:
            primary_key = set(schema.get("primary_key") or ())
            raw_columns = schema["columns"]
            if not isinstance(raw_columns, list) or not raw_columns:
                raise ValueError("no columns")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise MirrorError(f"schema of {table!r} is not a valid schemas value: {exc!r}") \
                from exc
        columns = []
        for position, column in enumerate(raw_columns, start=1):
            try:
                name = column["name"]
                if not isinstance(name, str) or not name:
                    raise ValueError(f"name {name!r}")
                columns.append(MirroredColumn(
                    name, sqlite_type(int(column["type_oid"]), str(column["data_type"])),
                    name in primary_key, int(column["type_oid"]),
                    int(column.get("attnum") or 0)))
            except (KeyError, TypeError, ValueError) as exc:
                shown = column.get("name") if isinstance(column, Mapping) else column
                raise MirrorError(f"schema of {table!r}: column {position} ({shown!r}) cannot "
                                  f"be mapped to SQLite: {exc!r}") from exc
        if len({c.name for c in columns}) != len(columns):
            raise MirrorError(f"schema of {table!r} names a column twice")
        if not primary_key <= {c.name for c in columns}:
            raise MirrorError(f"schema of {table!r}: primary key {sorted(primary_key)} names "
                              "a column it does not have")
        return cls(str(table), str(schema.get("fingerprint")), tuple(columns))

    def to_json_text(self) -> str:
        return json.dumps({"table": self.table, "fingerprint": self.fingerprint,
                           "columns": [[c.name, c.sqlite_type, c.is_primary_key, c.type_oid,
                                        c.attnum] for c in self.columns]})

    @classmethod
    def from_json_text(cls, text: str) -> TableShape:
        try:
            data = json.loads(text)
            return cls(data["table"], data["fingerprint"],
                       tuple(MirroredColumn(*column) for column in data["columns"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise MirrorError(f"unreadable table shape in {STATE_TABLE}: {exc!r}") from exc

    @functools.cached_property
    def key_columns(self) -> list[str]:
        return [c.name for c in self.columns if c.is_primary_key]

    def from_json(self, row: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """A row map of a JSON payload with its bytea and non-finite float values restored
        (a msgpack payload carries them natively)."""
        if row is None:
            return None
        restored = dict(row)
        for column in self.columns:
            value = restored.get(column.name)
            if value is None:
                continue
            if column.type_oid in _JSON_BYTES_OIDS:
                restored[column.name] = _from_base64(value)
            elif column.type_oid in _JSON_FLOAT_OIDS:
                restored[column.name] = _from_json_float(value)
        return restored


def _lsn_or_zero(text: Any) -> int:
    """A schema event's ``min_snapshot_lsn`` (0: absent, as before it existed, or not an
    LSN; the event's ``commit_lsn`` bounds the snapshot then)."""
    try:
        return parse_lsn_cached(text)
    except ValueError:
        return 0


def _identities(before: TableShape | None, after: TableShape) -> tuple[dict[str, str], set[str]]:
    """By identity (attnum), where both shapes know it: old name -> new name of each column
    renamed, and the names that now belong to another column (dropped and added again)."""
    if before is None:
        return {}, set()
    names = {c.attnum: c.name for c in after.columns if c.attnum}
    attnums = {c.name: c.attnum for c in after.columns}
    renamed = {c.name: names[c.attnum] for c in before.columns
               if c.attnum in names and names[c.attnum] != c.name}
    replaced = {c.name for c in before.columns if c.attnum and c.name not in renamed
                and attnums.get(c.name, c.attnum) not in (0, c.attnum)}
    return renamed, replaced


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A batched statement of the store: its SQL; the pure path's values function (INSERT: a
    row map -> values; UPDATE: data, identity -> values); what the twin's ``Statements`` bind
    (INSERT: ``(names,)``, UPDATE: ``(set names, key names, whole_row)``), None when a column
    always needs converting (then only the pure path runs it)."""

    statement: str
    values: Callable[..., tuple]
    compiled: tuple | None


@dataclass
class TableState:
    table: str
    fingerprint: str
    status: str  # "bootstrapping" | "streaming" | "stale" (needs a new snapshot: see reason)
    snapshot_id: str | None
    cutover_lsn: int  # apply events with commit_lsn >= this
    applied_commit_lsn: int  # high-water mark: the last applied (commit_lsn, ordinal)
    applied_ordinal: int
    stream_seq: int = 0  # `CDC` holds nothing of this table this mirror lacks up to here
    reason: str | None = None  # why a stale table needs a new snapshot
    stale_lsn: int = 0  # ... one whose cutover LSN is at least this
    touched: bool = False  # changed by the open transaction

    def wants(self, commit_lsn: int, ordinal: int) -> bool:
        """The cutover rule and the high-water mark in one test."""
        return applies(commit_lsn, ordinal, cutover_lsn=self.cutover_lsn,
                       high_water=(self.applied_commit_lsn, self.applied_ordinal))


class MirrorStore:
    """One SQLite database holding mirrored tables and their positions."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        try:
            # (the twin's Statements run batches on this connection's own SQLite handle)
            self._db, self._statements = _connect(self.path)
            self._db.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL mode: a power loss may drop the last commits, never split one, and
            # rows and position travel together, so the mirror re-reads what it lost.
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(
                f"CREATE TABLE IF NOT EXISTS {STATE_TABLE} ("
                " wire_table TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, status TEXT NOT NULL,"
                " snapshot_id TEXT, cutover_lsn INTEGER NOT NULL,"
                " applied_commit_lsn INTEGER NOT NULL, applied_ordinal INTEGER NOT NULL,"
                " stream_seq INTEGER NOT NULL DEFAULT 0, updated_at REAL NOT NULL,"
                " shape TEXT NOT NULL DEFAULT '', reason TEXT,"
                " stale_lsn INTEGER NOT NULL DEFAULT 0)")
            self._db.execute(
                f"CREATE TABLE IF NOT EXISTS {CONSISTENT_TABLE} (id INTEGER PRIMARY KEY"
                " CHECK (id = 1), lsn TEXT, lsn_int INTEGER, updated_at REAL NOT NULL)")
            # the shape each table was last given, as the stream (not today's KV) has it
            shapes = self._load_shapes()
        except (sqlite3.DatabaseError, MirrorError) as exc:
            raise MirrorError(f"{self.path} is not a usable mirror database ({exc}): move it "
                              "away and start the mirror again to rebuild it") from exc
        self._shapes: dict[str, TableShape] = shapes
        # (kind, table, column names of the row) -> _Prepared; kind is "INSERT", "UPDATE" or
        # _UPDATE_KEEPING_KEY
        self._prepared: dict[tuple[str, str, tuple[str, ...]], _Prepared] = {}
        self._states: dict[str, TableState | None] = {}  # committed states, cached
        self._open: Applied | None = None  # the transaction begin() opened
        # consecutive inserts (rows) or keyed updates (parameters) of one table and column
        # set, sent to SQLite together (executemany): ("insert"|"update", table, names)
        self._batch_key: tuple[str, str, tuple[str, ...]] = ("", "", ())
        self._batched: list[Any] = []
        self._open_states: dict[str, TableState] = {}

    def _load_shapes(self) -> dict[str, TableShape]:
        return {table: TableShape.from_json_text(text) for table, text in self._db.execute(
            f"SELECT wire_table, shape FROM {STATE_TABLE} WHERE shape != ''")}

    def close(self) -> None:
        if self._statements is not None:
            self._statements.close()  # (finalized before their connection closes)
        self._db.close()

    # -- state ----------------------------------------------------------------------------------
    def state(self, table: str) -> TableState | None:
        row = self._db.execute(
            f"SELECT wire_table, fingerprint, status, snapshot_id, cutover_lsn,"
            f" applied_commit_lsn, applied_ordinal, stream_seq, reason, stale_lsn"
            f" FROM {STATE_TABLE}"
            " WHERE wire_table = ?", (table,)).fetchone()
        return TableState(*row) if row else None

    def resume_seq(self, tables: Iterable[str]) -> int:
        """The `CDC` sequence to read from so that every streaming table of ``tables`` gets
        every event it lacks (1: from the start)."""
        names = list(tables)
        row = self._db.execute(
            f"SELECT min(stream_seq) FROM {STATE_TABLE} WHERE status = 'streaming' AND "
            f"wire_table IN ({', '.join('?' * len(names))})", names).fetchone()
        return int(row[0] or 0) + 1

    def advance(self, tables: Iterable[str], stream_seq: int) -> None:
        """``stream_seq`` was read for ``tables`` (nothing of theirs up to it is missing)."""
        names = list(tables)
        with self._transaction():
            self._advance(names, stream_seq)

    def _advance(self, names: list[str], stream_seq: int) -> None:
        for name in names:  # the cached states follow (a rollback empties the cache)
            cached = self._states.get(name)
            if cached is not None and cached.status == "streaming":
                cached.stream_seq = max(cached.stream_seq, stream_seq)
        self._db.execute(
            f"UPDATE {STATE_TABLE} SET stream_seq = ? WHERE status = 'streaming' AND "
            f"stream_seq < ? AND wire_table IN ({', '.join('?' * len(names))})",
            [stream_seq, stream_seq, *names])

    def mark_stale(self, table: str, reason: str, at_lsn: int = 0) -> None:
        """``table`` can no longer follow the stream: the next start bootstraps it again,
        from a snapshot whose cutover LSN is at least ``at_lsn``."""
        state = self.state(table)
        if state is None:
            return
        state.status, state.reason, state.stale_lsn = "stale", reason, at_lsn
        with self._transaction():
            self._put_state(state, stream_seq=state.stream_seq)

    def tables(self) -> list[str]:
        return [row[0] for row in self._db.execute(f"SELECT wire_table FROM {STATE_TABLE}")]

    # -- shape ----------------------------------------------------------------------------------
    def _existing_columns(self, table: str) -> list[tuple[str, str, bool]]:
        rows = self._db.execute(f"PRAGMA table_info({quote(table)})").fetchall()
        return [(name, declared, bool(pk)) for _, name, declared, _, _, pk in rows]

    def _create(self, shape: TableShape) -> None:
        columns = ", ".join(f"{quote(c.name)} {c.sqlite_type}".rstrip() for c in shape.columns)
        key = shape.key_columns
        if key:
            columns += f", PRIMARY KEY ({', '.join(quote(name) for name in key)})"
        self._db.execute(f"CREATE TABLE {quote(shape.table)} ({columns})")
        if not key:
            self._create_lookup(shape)

    def _create_lookup(self, shape: TableShape) -> None:
        """Without a key, updates and deletes name a row by its values (REPLICA IDENTITY
        FULL): an index on a few of them spares a full scan per change."""
        lookup = [c.name for c in shape.columns if c.sqlite_type != "BLOB"][:3]
        if lookup:
            self._db.execute(
                f"CREATE INDEX {quote(shape.table + ' (row lookup)')} ON "
                f"{quote(shape.table)} ({', '.join(quote(name) for name in lookup)})")

    def apply_shape(self, shape: TableShape,
                    added_values: Mapping[str, Any] | None = None) -> SchemaChange:
        """Create the table or follow a change of its shape inside the current transaction.

        ``added_values``: what existing rows read for a newly added column (the schema's
        missing value); a column added without one holds NULL in existing rows.
        """
        existing = self._existing_columns(shape.table)
        renamed, replaced = _identities(self._shapes.get(shape.table), shape)
        self._shapes[shape.table] = shape
        self._prepared = {key: value for key, value in self._prepared.items()
                          if key[1] != shape.table}  # (their converters know the types)
        if not existing:
            self._create(shape)
            return SchemaChange.CREATED
        # A renamed column keeps its values: it is compared under its new name. A column
        # whose name another one takes (a renamed one, or a new one: dropped and added again)
        # is dropped.
        physical = existing
        retired = [name for name, _, _ in physical if name not in renamed
                   and (name in renamed.values() or name in replaced)]
        existing = [(renamed.get(name, name), declared, pk) for name, declared, pk in physical
                    if name not in retired]
        wanted = [(c.name, c.sqlite_type, c.is_primary_key) for c in shape.columns]
        if wanted == existing and not renamed:
            return SchemaChange.UNCHANGED
        old = {name: (declared, pk) for name, declared, pk in existing}
        new = {c.name: (c.sqlite_type, c.is_primary_key) for c in shape.columns}
        kept_same = all(new[name] == old[name] for name in old if name in new)
        key_same = ({n for n, (_, pk) in old.items() if pk}
                    == {n for n, (_, pk) in new.items() if pk})
        retired_key = any(pk for name, _, pk in physical if name in retired)
        if not kept_same or not key_same or retired_key:
            return SchemaChange.NEEDS_BOOTSTRAP
        if not shape.key_columns:  # (SQLite drops no indexed column: made again below)
            self._db.execute(f"DROP INDEX IF EXISTS {quote(shape.table + ' (row lookup)')}")
        for name in [*retired, *(name for name in old if name not in new)]:
            self._db.execute(f"ALTER TABLE {quote(shape.table)} DROP COLUMN {quote(name)}")
        self._rename_columns(shape.table, renamed)
        for column in shape.columns:
            if column.name not in old:
                self._db.execute(f"ALTER TABLE {quote(shape.table)} ADD COLUMN "
                                 f"{quote(column.name)} {column.sqlite_type}".rstrip())
                value = (added_values or {}).get(column.name)
                if value is not None:
                    self._db.execute(f"UPDATE {quote(shape.table)} SET {quote(column.name)} = ?",
                                     (to_sqlite(value),))
        if not shape.key_columns:
            self._create_lookup(shape)
        # SQLite appends added columns; a column order that differs from the source's (a
        # column dropped and added under the same name) is still the same set of values.
        return SchemaChange.ALTERED

    def _rename_columns(self, table: str, renamed: Mapping[str, str]) -> None:
        """Rename in place, through names of their own first (``a -> b, b -> a`` works)."""
        steps = {old: f"_cdc_renaming_{index}" for index, old in enumerate(renamed)}
        for old, step in steps.items():
            self._db.execute(f"ALTER TABLE {quote(table)} RENAME COLUMN {quote(old)} TO "
                             f"{quote(step)}")
        for old, step in steps.items():
            self._db.execute(f"ALTER TABLE {quote(table)} RENAME COLUMN {quote(step)} TO "
                             f"{quote(renamed[old])}")

    # -- bootstrap ------------------------------------------------------------------------------
    def begin_bootstrap(self, shape: TableShape, snapshot_id: str, snapshot_lsn: int) -> None:
        """Empty the table (recreated in the snapshot's shape) and mark it bootstrapping."""
        with self._transaction():
            self._db.execute(f"DROP TABLE IF EXISTS {quote(shape.table)}")
            self._shapes.pop(shape.table, None)
            self.apply_shape(shape)
            self._put_state(TableState(shape.table, shape.fingerprint, "bootstrapping",
                                       snapshot_id, snapshot_lsn, 0, -1), stream_seq=0)

    def load_rows(self, table: str, rows: Sequence[Mapping[str, Any]]) -> None:
        """One snapshot chunk's rows, in one transaction."""
        with self._transaction():
            self._insert_rows(table, rows)

    def load_tuples(self, table: str, columns: tuple[str, ...], rows: list[tuple], *,
                    has_nan: bool) -> None:
        """One snapshot chunk's rows as tuples in ``columns`` order, in one transaction.
        Bound as they are unless a column needs converting or a value is NaN."""
        convert_values, always = self._values_converter(table, columns)
        statement = _insert_statement(table, columns)
        with self._transaction():
            try:
                self._db.execute("SAVEPOINT cdc_load")
                try:
                    self._db.executemany(
                        statement, map(convert_values, rows) if always or has_nan else rows)
                except OverflowError:  # an integer beyond 64 bits: convert every value
                    self._db.execute("ROLLBACK TO cdc_load")
                    self._db.executemany(statement, ([to_sqlite(v) for v in row]
                                                     for row in rows))
                finally:
                    self._db.execute("RELEASE cdc_load")
            except sqlite3.IntegrityError as exc:
                raise DivergenceError(f"{table}: a loaded row is already mirrored ({exc})") \
                    from exc

    @contextlib.contextmanager
    def chunk_loader(self, table: str, columns: tuple[str, ...]) -> Iterator[ChunkLoad | None]:
        """The compiled loader of ``table``'s msgpack chunks (rows in ``columns`` order), or
        None (not built, an in-memory database): ``load(chunk bytes, chunk numbers loaded)``
        writes a chunk in one transaction of its own connection and gives (its number, rows),
        or None to leave the chunk to :meth:`load_tuples` / :meth:`load_rows` (the reference:
        a property test holds the two to the same rows). Not inside a transaction of this
        store: the two connections would wait on each other."""
        try:
            file = self._db.execute("PRAGMA database_list").fetchone()[2]  # (main's file)
        except sqlite3.Error:  # (a file name that is not UTF-8)
            file = None
        loader = None
        if _twin is not None and file and not self._db.in_transaction:
            try:
                loader = _twin.ChunkLoader(file, _insert_statement(table, columns), columns)
            except ValueError:
                loader = None  # (no such table, ...: the pure path gives the real error)
        try:
            yield loader.load if loader is not None else None
        finally:
            if loader is not None:
                loader.close()

    def finish_bootstrap(self, table: str, stream_seq: int) -> None:
        """The snapshot is loaded: from now on events at or after its cutover LSN apply."""
        state = self.state(table)
        if state is None or state.status != "bootstrapping":
            raise MirrorError(f"{table}: finish_bootstrap without begin_bootstrap")
        state.status = "streaming"
        with self._transaction():
            self._put_state(state, stream_seq=stream_seq)

    # -- changes --------------------------------------------------------------------------------
    def apply_transaction(self, events: Iterable[Mapping[str, Any]], stream_seq: int,
                          followed: Iterable[str] = ()) -> Applied:
        """Every event of one transaction (of the mirrored tables), in ordinal order, in one
        SQLite transaction with the new positions (see :meth:`begin`)."""
        self.begin()
        try:
            for event in sorted(events, key=lambda e: (e["ordinal"],
                                                       e["operation"] != SCHEMA_OPERATION)):
                self.apply(event)
        except BaseException:
            self.rollback()
            raise
        return self.commit(stream_seq, followed)

    # One transaction applied as its events come (a huge one need not fit in memory):
    # begin(), apply() each new event, commit() once the transaction is whole.
    def begin(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")
        self._open = Applied()
        self._open_states = {}

    def covers(self, event: Mapping[str, Any]) -> bool:
        """Whether the committed positions already cover ``event`` (or its table is not
        streaming): the cutover rule and the high-water mark."""
        state = self._cached_state(event["table"])
        return (state is None or state.status != "streaming"
                or not state.wants(parse_lsn_cached(event["commit_lsn"]), event["ordinal"]))

    def apply(self, event: Mapping[str, Any], *, from_json: bool = False) -> None:
        """One event of the open transaction, unless the positions cover it. A schema event
        alters the table, or marks it stale when no ALTER can follow the change."""
        assert self._open is not None, "apply() outside begin()/commit()"
        try:
            table = event["table"]
            state = self._open_states.get(table)
            if state is None:
                cached = self._cached_state(table)
                if cached is None:
                    return
                state = self._open_states[table] = dataclasses.replace(cached)
            commit_lsn = parse_lsn_cached(event["commit_lsn"])
            if state.status != "streaming" or not state.wants(commit_lsn, event["ordinal"]):
                return
            state.touched = True
            operation = event["operation"]
            if operation == "UPDATE" and not event["data"] and not event.get("old"):
                # every column an unchanged TOAST value: the row stays as it is
                state.applied_commit_lsn, state.applied_ordinal = commit_lsn, event["ordinal"]
                self._open.events += 1
                return
            if operation in ("INSERT", "UPDATE") and not from_json:
                data = event["data"]
                if operation == "INSERT":
                    batch_key, item = (operation, table, tuple(data)), data
                else:  # (no ``old``: the key did not change); None: a table without a key
                    batch_key = ("UPDATE" if event.get("old") else _UPDATE_KEEPING_KEY, table,
                                 tuple(data))
                    item = event if (batch_key in self._prepared
                                     or self._prepare_update(batch_key)) else None
                if item is not None:
                    if batch_key != self._batch_key or len(self._batched) >= 1000:
                        self._flush_batch()
                        self._batch_key = batch_key
                    self._batched.append(item)
                    state.applied_commit_lsn = commit_lsn
                    state.applied_ordinal = event["ordinal"]
                    self._open.events += 1
                    return
            self._flush_batch()
            if operation == SCHEMA_OPERATION:
                # not a change: the high-water mark stays before the change it precedes
                why = self._apply_schema_event(event, from_json)
                if why is None:
                    state.fingerprint = self.shape(table).fingerprint
                else:  # (from a snapshot past its transaction: one at it reads it again)
                    state.status, state.reason = "stale", why
                    state.stale_lsn = max(commit_lsn + 1,
                                          _lsn_or_zero(event.get("min_snapshot_lsn")))
                    self._open.stale[table] = why
                return
            if from_json:
                event = self._restored(event)
            self._apply_event(event)
            state.applied_commit_lsn, state.applied_ordinal = commit_lsn, event["ordinal"]
            self._open.events += 1
        except DivergenceError:
            raise
        except _CHANGE_ERRORS as exc:
            if not _from_the_change(exc, self._db):
                raise
            raise _does_not_fit(event["table"], event, exc) from exc

    @property
    def open_events(self) -> int:
        """Events applied in the open transaction so far."""
        return self._open.events if self._open is not None else 0

    def commit(self, stream_seq: int, followed: Iterable[str] = ()) -> Applied:
        """Commit the open transaction with the new positions: each table's high-water mark,
        and ``stream_seq`` for the tables of ``followed`` (all were read up to it)."""
        assert self._open is not None
        try:
            self._flush_batch()
            for state in self._open_states.values():
                if state.touched:
                    self._put_state(state, stream_seq=max(state.stream_seq, stream_seq))
            names = list(followed)
            if names:
                self._advance(names, stream_seq)
            self._db.execute("COMMIT")
        except BaseException:
            self.rollback()
            raise
        applied, self._open = self._open, None
        for table, state in self._open_states.items():  # the committed values, cached
            if state.touched:
                state.touched = False
                self._states[table] = state
        self._open_states = {}
        return applied

    def _flush_batch(self) -> None:
        if not self._batched:
            return
        batched, self._batched = self._batched, []
        kind, table, _ = self._batch_key
        try:
            try:
                if kind == "INSERT":
                    self._insert_rows(table, batched)
                else:
                    self._update_rows(table, self._prepared[self._batch_key], batched)
            except _CHANGE_ERRORS as exc:
                if isinstance(exc, DivergenceError) or not _from_the_change(exc, self._db):
                    raise
                raise _does_not_fit(table, None, exc) from exc
        except DivergenceError as exc:  # found at commit too: say which table it is
            exc.table = table
            raise

    def _update_rows(self, table: str, prepared: _Prepared, events: list) -> None:
        """Keyed UPDATE ``events`` of ``table`` (one column set), by the twin's Statements
        where they take them, else by the pure path."""
        statement = prepared.statement
        self._db.execute("SAVEPOINT cdc_update")
        try:
            if prepared.compiled is not None and self._statements is not None:
                if self._statements.run_updates(statement, events,
                                                *prepared.compiled) == len(events):
                    return
                self._db.execute("ROLLBACK TO cdc_update")  # (the pure path says what)
            batched = [self._update_values(prepared, event) for event in events]
            try:
                changed = self._execute_many_unique(statement, batched)
            except OverflowError:  # an integer beyond 64 bits: every value converted
                self._db.execute("ROLLBACK TO cdc_update")
                batched = [tuple(map(to_sqlite, parameters)) for parameters in batched]
                changed = self._execute_many_unique(statement, batched)
            if changed != len(batched):  # a row the mirror does not hold: find which
                self._db.execute("ROLLBACK TO cdc_update")
                key = self.shape(table).key_columns
                for parameters in batched:
                    if self._execute_unique(statement, parameters) != 1:
                        raise DivergenceError(
                            f"{table}: an UPDATE names a row the mirror does not hold: "
                            f"{dict(zip(key, parameters[-len(key):], strict=True))}")
        finally:
            self._db.execute("RELEASE cdc_update")

    def _prepare_update(self, batch_key: tuple[str, str, tuple[str, ...]]) -> _Prepared | None:
        """The statement of keyed UPDATEs of ``batch_key`` (SET every column of ``data``
        WHERE key = the old key, or the new one when it did not change); None for a table
        without a key. ``_UPDATE_KEEPING_KEY`` (the key did not change) leaves the key columns
        out of the SET: SQLite then rewrites the row in place instead of moving it (1.7
        against 2.7 µs a row)."""
        kind, table, names = batch_key
        key = tuple(self.shape(table).key_columns)
        if not key:
            return None
        set_names = names
        if kind == _UPDATE_KEEPING_KEY:
            set_names = tuple(name for name in names if name not in key) or names
        sets = ", ".join(f"{quote(name)} = ?" for name in set_names)
        where = " AND ".join(f"{quote(name)} = ?" for name in key)
        whole_row = set_names == names
        set_values, set_converts = self._row_converter(table, set_names, whole_row=whole_row)
        key_values, key_converts = self._row_converter(table, key, whole_row=False)

        def parameters(data: Mapping[str, Any], identity: Mapping[str, Any]) -> tuple:
            return set_values(data) + key_values(identity)
        prepared = self._prepared[batch_key] = _Prepared(
            f"UPDATE {quote(table)} SET {sets} WHERE {where}", parameters,
            None if set_converts or key_converts else (set_names, key, whole_row))
        return prepared

    def _update_values(self, prepared: _Prepared, event: Mapping[str, Any]) -> tuple:
        """The values an UPDATE event binds to ``prepared``."""
        data = event["data"]
        try:
            return prepared.values(data, event.get("old") or data)
        except KeyError as exc:
            raise DivergenceError(f"{event['table']}: {event.get('msg_id')} does not carry "
                                  f"key column {exc.args[0]!r}") from exc

    def rollback(self) -> None:
        self._batched = []
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")
        self._open = None
        self._open_states = {}
        self._states.clear()
        # shapes changed by rolled-back schema events: back to the committed ones
        self._shapes = self._load_shapes()
        self._prepared.clear()

    def _cached_state(self, table: str) -> TableState | None:
        if table not in self._states:
            self._states[table] = self.state(table)
        return self._states[table]

    def _restored(self, event: Mapping[str, Any]) -> Mapping[str, Any]:
        """A JSON payload's event with bytea and non-finite floats restored."""
        shape = self.shape(event["table"])
        restored = dict(event)
        for name in ("data", "old"):
            if restored.get(name) is not None:
                restored[name] = shape.from_json(restored[name])
        return restored

    def _apply_schema_event(self, event: Mapping[str, Any], from_json: bool) -> str | None:
        """Follow a schema event (README "Schema changes"); why a new snapshot is needed
        instead, if it is."""
        if event.get("needs_snapshot"):
            return str(event.get("reason") or "the bridge says a new snapshot is needed")
        table_schema = event["table_schema"]
        shape = TableShape.from_schema(table_schema)
        if shape.table != event["table"]:
            raise MirrorError(f"a schema event of {event['table']} carries the schema of "
                              f"{shape.table!r}")
        before = self._shapes.get(shape.table)
        missing = {c["name"]: c.get("missing_value") for c in table_schema["columns"]}
        if from_json:
            missing = shape.from_json(missing) or {}
        if self.apply_shape(shape, added_values=missing) is SchemaChange.NEEDS_BOOTSTRAP:
            return (f"its shape changed in a way no ALTER follows (a column's type or the key "
                    f"changed: {before.fingerprint if before else '?'} -> "
                    f"{shape.fingerprint})")
        return None

    def _apply_event(self, event: Mapping[str, Any]) -> None:
        table, operation = event["table"], event["operation"]
        shape = self.shape(table)
        if operation == "INSERT":
            self._insert_rows(table, [event["data"]])
        elif operation == "UPDATE":
            data = event["data"]
            identity = event.get("old") or {name: data[name] for name in shape.key_columns}
            names = tuple(data)
            if shape.key_columns:  # one statement; the row must be there
                prepared = (self._prepared.get(("UPDATE", table, names))
                            or self._prepare_update(("UPDATE", table, names)))
                assert prepared is not None  # (None only for a table without a key)
                if self._execute_unique(prepared.statement,
                                        self._update_values(prepared, event)) != 1:
                    self._find_row(shape, identity, event)  # raises, naming the row
            else:
                rowid = self._find_row(shape, identity, event)
                if names:
                    sets = ", ".join(f"{quote(name)} = ?" for name in names)
                    self._db.execute(f"UPDATE {quote(table)} SET {sets} WHERE rowid = ?",
                                     [to_sqlite(data[name]) for name in names] + [rowid])
        elif operation == "DELETE":
            identity = event.get("old") or event["data"]
            rowid = self._find_row(shape, identity, event)
            self._db.execute(f"DELETE FROM {quote(table)} WHERE rowid = ?", (rowid,))
        elif operation == "TRUNCATE":
            self._db.execute(f"DELETE FROM {quote(table)}")
        else:
            raise MirrorError(f"{table}: unknown operation {operation!r} in {event.get('msg_id')}")

    def _execute_many_unique(self, statement: str, parameters: list) -> int:
        """Rows changed by ``statement`` run for each of ``parameters``."""
        try:
            return self._db.executemany(statement, parameters).rowcount
        except sqlite3.IntegrityError as exc:
            raise DivergenceError(f"a changed key is already mirrored ({exc})") from exc

    def _execute_unique(self, statement: str, params: Sequence) -> int:
        """Rows changed; a key change onto a key the mirror holds is a divergence."""
        try:
            try:
                return self._db.execute(statement, params).rowcount
            except OverflowError:  # an integer beyond 64 bits: every value converted
                return self._db.execute(statement, list(map(to_sqlite, params))).rowcount
        except sqlite3.IntegrityError as exc:
            raise DivergenceError(f"a changed key is already mirrored ({exc})") from exc

    def _find_row(self, shape: TableShape, identity: Mapping[str, Any],
                  event: Mapping[str, Any]) -> int:
        """The rowid of the row ``identity`` names: by primary key when the table has one,
        else by every column ``identity`` holds (a REPLICA IDENTITY FULL old row; one of
        identical rows is as good as another)."""
        names = shape.key_columns or list(identity)
        if not names:
            raise DivergenceError(f"{shape.table}: {event['operation']} {event.get('msg_id')} "
                                  "names no row (no values to find it by)")
        try:
            where = " AND ".join(f"{quote(name)} IS ?" for name in names)
            params = [to_sqlite(identity[name]) for name in names]
        except KeyError as exc:
            raise DivergenceError(f"{shape.table}: {event.get('msg_id')} does not carry key "
                                  f"column {exc.args[0]!r}") from exc
        if shape.key_columns:
            row = self._db.execute(f"SELECT rowid FROM {quote(shape.table)} WHERE {where} "
                                   "LIMIT 1", params).fetchone()
        else:
            # SQLite's IS holds 0.0 equal to -0.0 and 1 to 1.0, values the type mapping keeps
            # apart: of the rows it finds (through the lookup index), the first that holds
            # exactly these values
            found = self._db.execute(
                f"SELECT rowid, {', '.join(quote(name) for name in names)} FROM "
                f"{quote(shape.table)} WHERE {where}", params)
            row = next((candidate for candidate in found
                        if _same_values(candidate[1:], params)), None)
            found.close()  # (not read to its end: reset before the row is changed)
        if row is None:
            raise DivergenceError(f"{shape.table}: {event['operation']} {event.get('msg_id')} "
                                  f"names a row the mirror does not hold: "
                                  f"{dict(zip(names, params, strict=True))}")
        return int(row[0])

    def _insert_rows(self, table: str, rows: Sequence[Mapping[str, Any]]) -> None:
        if not rows:
            return
        names = tuple(rows[0])
        prepared = self._prepared.get(("INSERT", table, names))
        if prepared is None:
            convert, converts = self._row_converter(table, names)
            prepared = self._prepared[("INSERT", table, names)] = _Prepared(
                _insert_statement(table, names), convert, None if converts else (names,))
        statement = prepared.statement
        try:
            self._db.execute("SAVEPOINT cdc_insert")
            try:
                if prepared.compiled is not None and self._statements is not None:
                    if self._statements.run_rows(statement, rows, *prepared.compiled) >= 0:
                        return
                    self._db.execute("ROLLBACK TO cdc_insert")  # (the pure path says what)
                self._db.executemany(statement, map(prepared.values, rows))
            except (KeyError, OverflowError):
                # rows of other columns, or an integer beyond 64 bits: undo the rows before
                # it, then row by row with every value converted
                self._db.execute("ROLLBACK TO cdc_insert")
                for row in rows:
                    self._db.execute(_insert_statement(table, tuple(row)),
                                     [to_sqlite(value) for value in row.values()])
            finally:
                self._db.execute("RELEASE cdc_insert")
        except sqlite3.IntegrityError as exc:
            raise DivergenceError(f"{table}: an inserted row is already mirrored ({exc})") \
                from exc

    def _row_converter(self, table: str, names: tuple[str, ...], *, whole_row: bool = True
                       ) -> tuple[Callable[[Mapping], tuple], bool]:
        """(a row map -> values (in ``names`` order) function, whether any column always needs
        converting); a row of other columns raises KeyError (``whole_row=False``: a row may
        hold more columns than ``names``)."""
        convert_values, always = self._values_converter(table, names)
        width = len(names)
        getter = operator.itemgetter(*names)  # values in ``names`` order, whatever the dict's

        def convert(row: Mapping[str, Any]) -> tuple:
            if whole_row and len(row) != width:
                raise KeyError("a row with other columns")
            values = getter(row)
            return convert_values((values,) if width == 1 else values)
        return convert, always

    def _values_converter(self, table: str, names: tuple[str, ...]
                          ) -> tuple[Callable[[tuple], tuple], bool]:
        """(values -> values bound to SQLite, whether any column always needs converting).
        Only what needs it is converted: str, int and bytes go to SQLite as they are (most of
        a row, most of the time), a float only when it is NaN, arrays and unknown types
        always."""
        shape = self._shapes.get(table)
        by_name = {c.name: c for c in shape.columns} if shape else {}
        floats = [index for index, name in enumerate(names)
                  if name in by_name and by_name[name].type_oid in _REAL_OIDS]
        others = [index for index, name in enumerate(names)
                  if index not in floats and (name not in by_name or not _as_is(by_name[name]))]
        # bool as int: CPython 3.11's sqlite3 binds a bool (not exactly an int) only after a
        # failed adapter lookup that formats and drops an AttributeError, ~3K instructions
        bools = [index for index, name in enumerate(names)
                 if name in by_name and by_name[name].type_oid == _BOOL_OID]

        def convert_values(values: tuple) -> tuple:
            has_nan = False
            for index in floats:
                value = values[index]
                if value is not None and value != value:  # noqa: PLR0124 - NaN (SQLite: NULL)
                    has_nan = True
                    break
            if not has_nan and not others and not bools:
                return values
            converted = list(values)
            for index in bools:
                value = converted[index]
                if value is True or value is False:
                    converted[index] = 1 if value else 0
            for index in floats if has_nan else ():
                converted[index] = to_sqlite(converted[index])
            for index in others:
                converted[index] = to_sqlite(converted[index])
            return tuple(converted)
        return convert_values, bool(others)

    def shape(self, table: str) -> TableShape:
        shape = self._shapes.get(table)
        if shape is None:
            raise MirrorError(f"{table}: no schema applied in this session")
        return shape

    # -- shadows and the consistent LSN (see mirror/consistency.py) ----------------------------
    def positions(self, tables: Iterable[str]) -> dict[str, tuple[str, int, int, bool]]:
        """Each of ``tables`` that has a state -> (status, cutover LSN, high-water commit
        LSN, whether the open transaction changed it), as the open transaction has them."""
        found = {}
        for table in tables:
            state = self._open_states.get(table) or self._cached_state(table)
            if state is not None:
                found[table] = (state.status, state.cutover_lsn, state.applied_commit_lsn,
                                state.touched)
        return found

    def record_consistent_lsn(self, lsn: int | None) -> None:
        """Record ``lsn`` (None: not known) in the current transaction, or in one of its own."""
        with self._transaction():
            self._db.execute(
                f"INSERT OR REPLACE INTO {CONSISTENT_TABLE} VALUES (1, ?, ?, ?)",
                (None if lsn is None else format_lsn(lsn), lsn, time.time()))

    @property
    def in_transaction(self) -> bool:
        """Whether a transaction is open (a chunk of a shadow waits for its end)."""
        return self._db.in_transaction

    def swap_in(self, shadows: Mapping[str, str], consistent_lsn: int | None) -> None:
        """Replace each table of ``shadows`` (table -> its shadow) by its caught-up shadow,
        all in one SQLite transaction (a reader sees the old tables or the new ones, never
        a mix), recording ``consistent_lsn``."""
        with self._transaction():
            for table, shadow in shadows.items():
                state, shape = self.state(shadow), self._shapes.get(shadow)
                if state is None or shape is None or state.status != "streaming":
                    raise MirrorError(f"{table}: no caught-up shadow to swap in")
                renamed = dataclasses.replace(shape, table=table)
                self._db.execute(f"DROP TABLE IF EXISTS {quote(table)}")
                self._db.execute(f"DROP INDEX IF EXISTS {quote(shadow + ' (row lookup)')}")
                self._db.execute(f"ALTER TABLE {quote(shadow)} RENAME TO {quote(table)}")
                self._shapes.pop(shadow, None)
                self._shapes[table] = renamed
                if not renamed.key_columns:
                    self._create_lookup(renamed)
                self._db.execute(f"DELETE FROM {STATE_TABLE} WHERE wire_table = ?", (shadow,))
                self._states.pop(shadow, None)
                self._put_state(dataclasses.replace(state, table=table, reason=None,
                                                    stale_lsn=0), stream_seq=state.stream_seq)
            self.record_consistent_lsn(consistent_lsn)
        self._prepared = {key: value for key, value in self._prepared.items()
                          if key[1] not in shadows and key[1] not in shadows.values()}

    # -- plumbing -------------------------------------------------------------------------------
    def _put_state(self, state: TableState, *, stream_seq: int) -> None:
        self._states.pop(state.table, None)
        shape = self._shapes.get(state.table)
        state.stream_seq = stream_seq
        self._db.execute(
            f"INSERT OR REPLACE INTO {STATE_TABLE} VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (state.table, state.fingerprint, state.status, state.snapshot_id,
             state.cutover_lsn, state.applied_commit_lsn, state.applied_ordinal, stream_seq,
             time.time(), shape.to_json_text() if shape else "", state.reason,
             state.stale_lsn))

    def _transaction(self) -> _Transaction:
        return _Transaction(self)


def _same_values(stored: Sequence[Any], bound: Sequence[Any]) -> bool:
    """Whether the values read back from SQLite are exactly the values bound: the same type,
    and for floats the same sign of zero too."""
    for have, want in zip(stored, bound, strict=True):
        if type(have) is not type(want) or have != want:
            return False
        if type(have) is float and math.copysign(1.0, have) != math.copysign(1.0, want):
            return False
    return True


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on any error; nested uses join the outer one."""

    def __init__(self, store: MirrorStore) -> None:
        self._store = store
        self._outer = False

    def __enter__(self) -> None:
        self._outer = not self._store._db.in_transaction
        if self._outer:
            self._store._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind, value, traceback) -> None:
        if not self._outer:
            return
        if kind is None:
            self._store._db.execute("COMMIT")
        else:
            self._store.rollback()


def _connect(path: str) -> tuple[sqlite3.Connection, Any]:
    """The store's connection, and the twin's ``Statements`` on its SQLite handle (None: not
    built, or the handle could not be proven to be this connection's)."""
    options: dict[str, Any] = {"isolation_level": None, "check_same_thread": False}
    if _twin is not None:
        return _twin.connect(path, **options)
    return sqlite3.connect(path, **options), None
