"""Pure transaction assembler: decoded pgoutput messages in, change events out. No I/O.

:class:`TransactionAssembler` is fed ``(wal_start, message)`` pairs in stream order -- the
XLogData ``wal_start`` and the decoded pgoutput message -- and returns, per message, the
events it produced (usually zero or one, a TRUNCATE one per relation). Nothing is buffered
across messages, so a transaction of a million rows streams through in bounded memory.

Events:

* :class:`ChangeRecord` per inserted/updated/deleted row and per truncated relation;
* :class:`TransactionCommitted` at each Commit;
* :class:`RelationChanged` when a Relation message brings a table shape the cache did not
  have (first sight of a relation id, or columns / types / keys / replica identity / name
  changed);
* :class:`RelationResent` when a Relation message repeats the cached shape: pgoutput resends
  one per session and after each invalidation of the table (any ALTER, a rewrite, a TRUNCATE,
  an ANALYZE), so it marks where a same-shape rewrite may have happened;
* :class:`LogicalMessageReceived` per ``pg_logical_emit_message`` message.

:meth:`TransactionAssembler.take_changes` is ``feed`` for runs of Inserts, Updates and
Deletes taken straight from the CopyData messages, in one call of the compiled twin
(``_speedups/protocol/changes.pyx``: the replication reader's hot path); it gives the same
records and leaves anything unusual to ``feed``.

Identity of a change across restarts: a transaction is named by its commit LSN (Begin's
``final_lsn``), and ``ordinal`` counts the change records within it from 0 in stream order.
Replaying the same WAL through the same publication yields the same ``(commit_lsn,
ordinal)`` for the same change: Relation/Type/Origin/Message messages, which a replay may
or may not repeat, take no ordinal. (Adding a table to the publication changes which
changes are sent, and so the ordinals of later transactions decoded after that -- as
expected.)

Typed values come from a converter factory (``cdc_platform.protocol.values``) seen only
through :class:`ColumnConverters`: once per Relation message it returns one ``text ->
value`` function per column, cached here per relation. Binary ('b') values pass through as
``bytes``, NULL is ``None``, and unchanged TOAST values are left out of ``new`` and named in
``unchanged_toast`` so that no consumer can mistake them for NULL.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias

from cdc_platform.errors import CdcError, ConversionError, ProtocolError
from cdc_platform.lsn import format_lsn
from cdc_platform.protocol.pgoutput import (
    UNCHANGED_TOAST,
    Begin,
    Commit,
    Delete,
    Insert,
    LogicalMessage,
    Origin,
    PgoutputMessage,
    Relation,
    RelationColumn,
    StreamAbort,
    StreamCommit,
    StreamStart,
    StreamStop,
    Truncate,
    TupleData,
    Type,
    Update,
    timestamp_to_iso,
)
from cdc_platform.protocol.values import TEXT_CONVERTERS
from cdc_platform.speedups import compiled_twin

__all__ = [
    "CachedRelation",
    "ChangeRecord",
    "ColumnConverters",
    "Event",
    "LogicalMessageReceived",
    "RelationChanged",
    "RelationResent",
    "TransactionAssembler",
    "TransactionCommitted",
    "relation_shape",
]

Operation: TypeAlias = Literal["INSERT", "UPDATE", "DELETE", "TRUNCATE"]


class ColumnConverters(Protocol):
    """What the assembler needs from the value converters (``values.TypeRegistry``)."""

    def for_columns(self, columns: Sequence[RelationColumn]) -> list[Callable[[str], Any]]:
        """One ``text -> value`` function per column, in column order."""
        ...


# -- events ----------------------------------------------------------------------------------
# Not frozen: a frozen dataclass's __init__ costs ~6x (object.__setattr__ per field) and
# this one is built once per row. Treat it as read-only.
@dataclass(slots=True)
class ChangeRecord:
    """One row change (or one truncated relation) of a committed transaction."""

    table: str
    schema: str
    operation: Operation
    relation_id: int
    lsn: int  # XLogData wal_start of the message (rows of one multi-insert share it)
    commit_lsn: int  # Begin.final_lsn: names the transaction
    xid: int
    commit_ts: str  # ISO-8601 UTC, e.g. 2025-12-08T13:45:21.719719Z
    ordinal: int  # 0-based position among the transaction's change records
    new: dict[str, Any] | None  # INSERT/UPDATE: column -> value, minus unchanged TOAST
    old: dict[str, Any] | None  # 'K': key columns only; 'O': every column
    old_kind: Literal["K", "O"] | None
    unchanged_toast: tuple[str, ...]  # UPDATE: columns whose value was not sent ('u')
    cascade: bool = False  # TRUNCATE ... CASCADE
    restart_identity: bool = False  # TRUNCATE ... RESTART IDENTITY
    # Columns whose text no converter accepted: their value is the text as PostgreSQL
    # printed it (docs/wire-contract.md "Type mapping"), so one odd value never stops the stream.
    raw_columns: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class TransactionCommitted:
    """The transaction's last event. Confirm ``end_lsn`` once everything before it is
    durably handled downstream."""

    commit_lsn: int
    end_lsn: int
    commit_ts: str
    xid: int
    change_count: int
    origin: str | None = None  # replication origin name, when the Origin message was sent


@dataclass(frozen=True, slots=True)
class RelationChanged:
    """A table shape not seen before: ``previous`` is the cached Relation (None the first
    time this relation id is seen by this assembler)."""

    relation: Relation
    previous: Relation | None


@dataclass(frozen=True, slots=True)
class RelationResent:
    """A Relation message with the shape the cache has: no column changed, but the table's
    definition was invalidated (or a new session began) before the change that follows."""

    relation: Relation


@dataclass(frozen=True, slots=True)
class LogicalMessageReceived:
    """A ``pg_logical_emit_message`` message. ``commit_lsn`` names the enclosing
    transaction for transactional messages; None for non-transactional ones."""

    lsn: int
    prefix: str
    content: bytes
    transactional: bool
    commit_lsn: int | None


Event: TypeAlias = (ChangeRecord | TransactionCommitted | RelationChanged | RelationResent
                    | LogicalMessageReceived)
_NO_EVENTS: tuple[Event, ...] = ()


def relation_shape(relation: Relation) -> tuple[Any, ...]:
    """What makes two Relation messages describe the same table shape: schema, name,
    replica identity and every column's (name, type oid, type modifier, is_key)."""
    return (relation.namespace, relation.name, relation.replica_identity,
            tuple((c.name, c.type_oid, c.type_modifier, c.is_key) for c in relation.columns))


class _SlowPath(Exception):
    """A value the row builders do not handle (UNCHANGED_TOAST).

    Always raised as the class, so each raise makes a new instance that dies with its
    handler: re-raising one shared instance kept appending frames to its ``__traceback__``,
    and through them kept every read batch alive (memory grew on each such update)."""


RowBuild = Callable[[TupleData], dict[str, Any]]


def row_builder_python(names: tuple[str, ...], converters: tuple[Callable[[str], Any], ...],
                       indexes: tuple[int, ...], passthrough: Collection[object],
                       slow: type[Exception]) -> RowBuild:
    """``values -> {name: value}`` for the columns at ``indexes``: a text value goes through
    its column's converter (none for those in ``passthrough``), None and bytes pass as they
    are, UNCHANGED_TOAST raises ``slow`` (the caller then takes
    :meth:`TransactionAssembler._row`). ``values`` must have ``len(names)`` items (checked by
    the caller)."""
    columns = tuple((names[index], converters[index], index,
                     converters[index] in passthrough) for index in indexes)

    def build(values: TupleData) -> dict[str, Any]:
        row: dict[str, Any] = {}
        for name, convert, index, keeps_text in columns:
            value = values[index]
            if value.__class__ is str:
                row[name] = value if keeps_text else convert(value)  # type: ignore[arg-type]
            elif value is None or value.__class__ is bytes:
                row[name] = value
            else:
                raise slow
        return row
    return build


#: :func:`row_builder_python`, or its compiled twin (the same rows, a RowBuilder object).
row_builder: Callable[[tuple[str, ...], tuple[Callable[[str], Any], ...], tuple[int, ...],
                       Collection[object], type[Exception]], RowBuild] = (
    row_builder_python)

_BUILDERS: dict[tuple[Any, ...], RowBuild] = {}


def _row_builder(names: tuple[str, ...], converters: tuple[Callable[[str], Any], ...],
                 indexes: tuple[int, ...]) -> RowBuild:
    """:data:`row_builder` for these columns, cached per shape."""
    make = row_builder
    cache_key = (names, converters, indexes, make)
    key: tuple[Any, ...] | None = cache_key
    try:
        builder = _BUILDERS.get(cache_key)
    except TypeError:  # an unhashable converter: build without caching
        key, builder = None, None
    if builder is None:
        if len(_BUILDERS) > 4096:
            _BUILDERS.clear()
        builder = make(names, converters, indexes, TEXT_CONVERTERS, _SlowPath)
        if key is not None:
            _BUILDERS[key] = builder
    return builder


class CachedRelation:
    """Per-relation cache entry: what the hot path needs, precomputed once (the compiled
    :func:`take_changes` reads ``table``, ``schema``, ``build`` and ``build_key``)."""

    __slots__ = (
        "build",
        "build_key",
        "converters",
        "count",
        "key_indexes",
        "names",
        "relation",
        "schema",
        "table",
    )

    def __init__(self, relation: Relation, converters: Sequence[Callable[[str], Any]]) -> None:
        if len(converters) != len(relation.columns):
            raise CdcError(f"converter factory returned {len(converters)} converters for "
                           f"{len(relation.columns)} columns of {relation.name}")
        self.relation = relation
        # "Namespace (empty string for pg_catalog)"
        self.schema = relation.namespace or "pg_catalog"
        self.table = relation.name
        self.names = tuple(c.name for c in relation.columns)
        self.count = len(self.names)
        self.converters = tuple(converters)
        self.key_indexes = tuple(i for i, c in enumerate(relation.columns) if c.is_key)
        self.build = _row_builder(self.names, self.converters, tuple(range(self.count)))
        self.build_key = _row_builder(self.names, self.converters, self.key_indexes)


class TransactionAssembler:
    """Turns decoded pgoutput messages into events; see the module docstring.

    Not thread-safe. After a new replication stream starts (reconnect), call
    :meth:`reset`: the server resends from a transaction boundary, and a Begin arriving
    inside an open transaction is otherwise a protocol error.
    """

    def __init__(self, converters: ColumnConverters) -> None:
        self._converters = converters
        self._tables: dict[int, CachedRelation] = {}
        self.types: dict[int, Type] = {}  # Type messages seen, by type oid
        self._dispatch: dict[type, Callable[[int, Any], Sequence[Event]]] = {
            Insert: self._on_insert,
            Update: self._on_update,
            Delete: self._on_delete,
            Begin: self._on_begin,
            Commit: self._on_commit,
            Relation: self._on_relation,
            Truncate: self._on_truncate,
            LogicalMessage: self._on_logical_message,
            Origin: self._on_origin,
            Type: self._on_type,
            StreamStart: self._on_stream,
            StreamStop: self._on_stream,
            StreamCommit: self._on_stream,
            StreamAbort: self._on_stream,
        }
        self.reset()

    # -- public ------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget the open transaction (if any); keep the relation cache."""
        self._in_transaction = False
        self._commit_lsn = 0
        self._xid = 0
        self._commit_ts = ""
        self._ordinal = 0
        self._origin: str | None = None

    @property
    def in_transaction(self) -> bool:
        """Between a Begin and its Commit."""
        return self._in_transaction

    @property
    def relations(self) -> Mapping[int, Relation]:
        """The cached Relation per relation id (a copy)."""
        return {rid: t.relation for rid, t in self._tables.items()}

    def relation(self, relation_id: int) -> Relation | None:
        table = self._tables.get(relation_id)
        return None if table is None else table.relation

    def feed(self, lsn: int, message: PgoutputMessage) -> Sequence[Event]:
        """Events produced by ``message`` (received at XLogData ``wal_start`` ``lsn``)."""
        if message.__class__ is Insert:  # the hot path: _on_insert inlined
            table = self._tables.get(message.relation_id)  # type: ignore[union-attr]
            values = message.new  # type: ignore[union-attr]
            if table is not None and self._in_transaction and len(values) == table.count:
                try:
                    new = table.build(values)
                except (_SlowPath, ValueError, TypeError, ArithmeticError, ConversionError):
                    return self._on_insert(lsn, message)  # type: ignore[arg-type]
                ordinal = self._ordinal
                self._ordinal = ordinal + 1
                return (ChangeRecord(
                    table.table, table.schema, "INSERT", message.relation_id,  # type: ignore
                    lsn, self._commit_lsn, self._xid, self._commit_ts, ordinal, new, None,
                    None, ()),)
        try:
            handler = self._dispatch[message.__class__]
        except KeyError:
            raise ProtocolError(
                f"not a pgoutput message: {type(message).__name__}") from None
        return handler(lsn, message)

    def take_changes(self, raw: list[bytes], index: int, events: list[Event]) -> tuple[int, int]:
        """:meth:`feed` for a run of row changes, straight from CopyData, in one compiled call.

        From ``raw[index]`` on, every XLogData message holding an Insert, Update or Delete
        of a known table is assembled into a ChangeRecord (exactly what ``feed(wal_start,
        decode_message(...))`` returns for it) and appended to ``events``. Stops before the
        first message that is anything else, or that the general path must handle (an
        unchanged TOAST value, an unusual value, an error to report). Returns ``(next
        index, highest XLogData wal_end taken, 0 if none)``; consumes nothing outside a
        transaction, or with the pure code (see :func:`take_changes`)."""
        if not self._in_transaction:
            return index, 0
        index, self._ordinal, wal_end = take_changes(
            raw, index, self._tables, ChangeRecord, self._commit_lsn, self._xid,
            self._commit_ts, self._ordinal, events, UNCHANGED_TOAST)
        return index, wal_end

    # -- transaction boundaries ----------------------------------------------------------------
    def _on_begin(self, lsn: int, message: Begin) -> Sequence[Event]:
        if self._in_transaction:
            raise ProtocolError(
                f"Begin of transaction {message.xid} (commit {format_lsn(message.final_lsn)}) "
                f"inside open transaction {self._xid}; call reset() when a new replication "
                "stream starts")
        self._in_transaction = True
        self._commit_lsn = message.final_lsn
        self._xid = message.xid
        self._commit_ts = timestamp_to_iso(message.commit_ts)
        self._ordinal = 0
        self._origin = None
        return _NO_EVENTS

    def _on_commit(self, lsn: int, message: Commit) -> Sequence[Event]:
        if not self._in_transaction:
            raise ProtocolError(f"Commit {format_lsn(message.commit_lsn)} without a Begin")
        if message.commit_lsn != self._commit_lsn:
            raise ProtocolError(
                f"Commit LSN {format_lsn(message.commit_lsn)} differs from the final LSN "
                f"{format_lsn(self._commit_lsn)} announced by Begin of transaction {self._xid}")
        event = TransactionCommitted(message.commit_lsn, message.end_lsn,
                                     timestamp_to_iso(message.commit_ts), self._xid,
                                     self._ordinal, self._origin)
        self.reset()
        return (event,)

    def _on_origin(self, lsn: int, message: Origin) -> Sequence[Event]:
        self._require_transaction("Origin")
        self._origin = message.name
        return _NO_EVENTS

    def _on_stream(self, lsn: int, message: Any) -> Sequence[Event]:
        raise ProtocolError(
            f"{type(message).__name__}: streamed in-progress transactions (protocol version 2 "
            "with streaming on) are not supported by TransactionAssembler; start replication "
            "with proto_version '1'")

    def _require_transaction(self, what: str) -> None:
        if not self._in_transaction:
            raise ProtocolError(f"{what} message outside a transaction (no Begin)")

    # -- catalog -------------------------------------------------------------------------------
    def _on_relation(self, lsn: int, message: Relation) -> Sequence[Event]:
        cached = self._tables.get(message.relation_id)
        # Converters are rebuilt on every Relation message: types may have become known.
        self._tables[message.relation_id] = CachedRelation(
            message, self._converters.for_columns(message.columns))
        if cached is not None and relation_shape(cached.relation) == relation_shape(message):
            return (RelationResent(message),)
        return (RelationChanged(message, None if cached is None else cached.relation),)

    def _on_type(self, lsn: int, message: Type) -> Sequence[Event]:
        self.types[message.type_oid] = message
        return _NO_EVENTS

    def _table(self, relation_id: int, what: str) -> CachedRelation:
        if not self._in_transaction:
            raise ProtocolError(f"{what} on relation {relation_id} outside a transaction")
        table = self._tables.get(relation_id)
        if table is None:
            raise ProtocolError(f"{what} on relation {relation_id} before its Relation message")
        return table

    # -- rows ----------------------------------------------------------------------------------
    def _row(self, table: CachedRelation, values: TupleData, lsn: int,
             unchanged: list[str] | None, raw: list[str]) -> dict[str, Any]:
        """column -> typed value, the general loop; 'u' columns are left out (and named in
        ``unchanged``); a text no converter accepts stays text (named in ``raw``).
        ``table.build`` (a row builder) is the fast equivalent of the usual case."""
        names = table.names
        if len(values) != len(names):
            raise self._width_error(table, values)
        row: dict[str, Any] = {}
        for name, convert, value in zip(names, table.converters, values):
            if value.__class__ is str:
                try:
                    row[name] = convert(value)  # type: ignore[arg-type]  # (a str: checked)
                except (ValueError, TypeError, ArithmeticError, ConversionError):
                    row[name] = value
                    raw.append(name)
            elif value is None:
                row[name] = None
            elif value is UNCHANGED_TOAST:
                if unchanged is not None:
                    unchanged.append(name)
            else:  # bytes: binary format, passed through
                row[name] = value
        return row

    def _build(self, table: CachedRelation, values: TupleData, lsn: int,
               unchanged: list[str] | None, raw: list[str]) -> dict[str, Any]:
        """Every column: the row builder, else the general loop."""
        if len(values) != table.count:
            raise self._width_error(table, values)
        try:
            return table.build(values)
        except (_SlowPath, ValueError, TypeError, ArithmeticError, ConversionError):
            return self._row(table, values, lsn, unchanged, raw)

    def _build_key(self, table: CachedRelation, values: TupleData, lsn: int,
                   raw: list[str]) -> dict[str, Any]:
        """The 'K' tuple: only the replica identity columns (the others are sent as NULL)."""
        if len(values) != table.count:
            raise self._width_error(table, values)
        try:
            return table.build_key(values)
        except (_SlowPath, ValueError, TypeError, ArithmeticError, ConversionError):
            # 'u' in a key is not sent by PostgreSQL; if it were, the column is left out
            row = self._row(table, values, lsn, None, raw)
            return {table.names[i]: row[table.names[i]] for i in table.key_indexes
                    if table.names[i] in row}

    def _build_old(self, table: CachedRelation, old_kind: str, values: TupleData,
                   lsn: int, raw: list[str]) -> dict[str, Any]:
        """The old part of an Update/Delete: 'K' the key columns, 'O' the whole row."""
        if old_kind == "K":
            return self._build_key(table, values, lsn, raw)
        return self._build(table, values, lsn, None, raw)

    @staticmethod
    def _width_error(table: CachedRelation, values: TupleData) -> ProtocolError:
        return ProtocolError(
            f"tuple of {len(values)} columns for {table.schema}.{table.table}, whose "
            f"Relation message has {table.count}")

    def _on_insert(self, lsn: int, message: Insert) -> Sequence[Event]:
        # The hot path: _table() and _build() inlined.
        table = self._tables.get(message.relation_id)
        if table is None or not self._in_transaction:
            table = self._table(message.relation_id, "Insert")
        values = message.new
        if len(values) != table.count:
            raise self._width_error(table, values)
        unchanged: tuple[str, ...] = ()
        raw: list[str] = []
        try:
            new = table.build(values)
        except (_SlowPath, ValueError, TypeError, ArithmeticError, ConversionError):
            # PostgreSQL sends no 'u' in an Insert; if it did, they are named
            names: list[str] = []
            new = self._row(table, values, lsn, names, raw)
            unchanged = tuple(names)
        ordinal = self._ordinal
        self._ordinal = ordinal + 1
        return (ChangeRecord(
            table.table, table.schema, "INSERT", message.relation_id, lsn, self._commit_lsn,
            self._xid, self._commit_ts, ordinal, new, None, None, unchanged,
            raw_columns=tuple(raw)),)

    def _on_update(self, lsn: int, message: Update) -> Sequence[Event]:
        table = self._table(message.relation_id, "Update")
        unchanged: list[str] = []
        raw: list[str] = []
        new = self._build(table, message.new, lsn, unchanged, raw)
        old_kind = message.old_kind
        old = (None if old_kind is None
               else self._build_old(table, old_kind, message.old, lsn, raw))  # type: ignore[arg-type]  # (old_kind: old is set)
        ordinal = self._ordinal
        self._ordinal = ordinal + 1
        return (ChangeRecord(
            table.table, table.schema, "UPDATE", message.relation_id, lsn, self._commit_lsn,
            self._xid, self._commit_ts, ordinal, new, old, old_kind, tuple(unchanged),
            raw_columns=tuple(dict.fromkeys(raw))),)

    def _on_delete(self, lsn: int, message: Delete) -> Sequence[Event]:
        table = self._table(message.relation_id, "Delete")
        raw: list[str] = []
        old = self._build_old(table, message.old_kind, message.old, lsn, raw)
        ordinal = self._ordinal
        self._ordinal = ordinal + 1
        return (ChangeRecord(
            table.table, table.schema, "DELETE", message.relation_id, lsn, self._commit_lsn,
            self._xid, self._commit_ts, ordinal, None, old, message.old_kind, (),
            raw_columns=tuple(raw)),)

    def _on_truncate(self, lsn: int, message: Truncate) -> Sequence[Event]:
        tables = [self._table(rid, "Truncate") for rid in message.relation_ids]
        records = []
        for relation_id, table in zip(message.relation_ids, tables):
            records.append(ChangeRecord(
                table.table, table.schema, "TRUNCATE", relation_id, lsn, self._commit_lsn,
                self._xid, self._commit_ts, self._ordinal, None, None, None, (),
                message.cascade, message.restart_identity))
            self._ordinal += 1
        return records

    def _on_logical_message(self, lsn: int, message: LogicalMessage) -> Sequence[Event]:
        if message.transactional:
            self._require_transaction("transactional logical decoding")
            commit_lsn: int | None = self._commit_lsn
        else:
            commit_lsn = None
        return (LogicalMessageReceived(message.lsn, message.prefix, message.content,
                                       message.transactional, commit_lsn),)



def take_changes(raw: list[bytes], index: int, tables: dict[int, CachedRelation],
                 record_type: type[ChangeRecord], commit_lsn: int, xid: int, commit_ts: str,
                 ordinal: int, events: list[Event], unchanged: object) -> tuple[int, int, int]:
    """:meth:`TransactionAssembler.take_changes` for the relations in ``tables``, ordinals
    counting from ``ordinal``: ``(next index, next ordinal, highest XLogData wal_end taken or
    0)``. The pure code takes none (``feed`` takes each message); the compiled twin takes the
    runs of row changes whose tables have its RowBuilders."""
    return index, ordinal, 0


# The compiled twin (cdc_platform/speedups.py) stands in for these names; mypy checks it
# against them through its stub.
if TYPE_CHECKING:
    from cdc_platform._speedups.protocol import changes as _twin
else:
    _twin = compiled_twin(__name__)
if _twin is not None:
    row_builder, take_changes = _twin.row_builder, _twin.take_changes
