"""Changes written to the mirrored tables: INSERTs and keyed UPDATEs batched (consecutive
ones of a table and column set, sent to SQLite together), the other changes one at a time,
snapshot rows loaded. Each batch runs by the compiled twin's ``Statements`` where they take
it, else (and to say what is wrong) by the pure path over converted values.

The positions, the transaction and which events apply are the store's (``store.py``): this
module writes what it is handed, inside the store's transaction.
"""

from __future__ import annotations

import contextlib
import math
import operator
import sqlite3
from collections.abc import (
    Callable,
    Collection,
    Iterable,
    Iterator,
    Mapping,
    MutableSequence,
    Sequence,
)
from dataclasses import dataclass
from typing import Any, Protocol

from cdc_platform.mirror.columns import TableShape, insert_statement, quote, to_sqlite
from cdc_platform.mirror.errors import DivergenceError, MirrorError
from cdc_platform.wire.digest import TableDigest

# What a change's content can make applying it raise (a column the table lacks, a value no
# type maps, a malformed field or schema): the change does not fit; see from_the_change.
CHANGE_ERRORS = (KeyError, TypeError, ValueError, AttributeError, OverflowError, IndexError,
                 MirrorError, sqlite3.Error)
# SQLite's result codes a statement's content causes: SQLITE_ERROR (no such column, ...),
# a constraint, a value too big, a datatype mismatch, a parameter out of range. The others
# (busy, I/O, full, corrupt, ...) are the database's, not the change's: raised as they are.
_CHANGE_RESULT_CODES = frozenset({1, 18, 19, 20, 25})
# a batched UPDATE whose event has no ``old``: its key did not change
_UPDATE_KEEPING_KEY = "UPDATE keeping its key"
_MOST_BATCHED = 1000


def from_the_change(exc: Exception, db: sqlite3.Connection) -> bool:
    """Whether ``exc``, raised applying a change, comes from the change itself (not when
    SQLite ended the transaction: a full disk, an I/O error, whatever a later statement
    then says)."""
    if not db.in_transaction:
        return False
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)  # (None: raised by Python's sqlite3)
        return code is None or code & 0xFF in _CHANGE_RESULT_CODES
    return True


def does_not_fit(table: str, event: Mapping[str, Any] | None, exc: Exception
                 ) -> DivergenceError:
    what = (f"{event.get('operation')} {event.get('msg_id')!s:.80}" if event is not None
            else "a batch of changes")
    error = DivergenceError(f"{table}: {what} cannot be applied "
                            f"({type(exc).__name__}: {exc})")
    error.table = table
    return error


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A batched statement: its SQL; the pure path's values function (INSERT: a row map ->
    values; UPDATE: data, identity -> values); what the twin's ``Statements`` bind (INSERT:
    ``(names,)``, UPDATE: ``(set names, key names, whole_row)``), None when a column always
    needs converting (then only the pure path runs it)."""

    statement: str
    values: Callable[..., tuple]
    compiled: tuple | None


class DigestBuckets(Protocol):
    """A table's bucket digests as a ``TableDigest`` holds them: its lists, or C arrays
    (``RowHashes.kept``) read and written the same way."""

    @property
    def bits(self) -> int: ...

    @property
    def totals(self) -> MutableSequence[int]: ...

    @property
    def counts(self) -> MutableSequence[int]: ...

    def entries(self) -> bytes:
        """The buckets that are not empty, packed as the digests' journal entries."""
        ...

    def load(self, packed: bytes) -> int:
        """Packed journal entries set into their buckets in order; how many."""
        ...


class BucketSums(Protocol):
    """One table's row hashes of a transaction, summed by bucket (``RowHashes.take``)."""

    @property
    def truncated(self) -> bool: ...

    def buckets(self) -> dict[int, tuple[int, int]]: ...

    def apply(self, digest: DigestBuckets) -> bytes: ...


class RowHashes(Protocol):
    """The hashes of the rows a connection writes into the tables it follows, taken from
    SQLite's preupdate hook (``Statements.hook_rows``; mirror/digests.py)."""

    @property
    def error(self) -> tuple[int, str] | None: ...

    def __len__(self) -> int: ...

    def follow(self, table: str, table_id: int, digester: Any) -> None: ...

    def unfollow(self, table: str) -> None: ...

    def mark(self) -> int: ...

    def undo(self, mark: int) -> None: ...

    def truncate(self, table_id: int) -> None: ...

    def restart(self, table_id: int) -> None: ...

    def add(self, table_id: int, hashes: list[bytes]) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def take(self, bits: int) -> dict[int, BucketSums]: ...

    def kept(self, bits: int, digest: TableDigest | None = None) -> DigestBuckets: ...

    def clear(self) -> None: ...


class Statements(Protocol):
    """Prepared INSERT and keyed UPDATE runs on a connection's own SQLite handle, bound
    without sqlite3's per-row work (compiled only: the store's twin's ``connect`` gives them).
    Each returns the rows written, or -1 to leave the batch to the pure path. ``hook_rows``:
    the digests' row hashes from SQLite's preupdate hook on that handle; ``hash_rows`` and
    ``sum_hashes``: the digests' trigger function and the sums of what it recorded, in C on
    that handle, where SQLite has no preupdate hook (mirror/digests.py)."""

    def run_rows(self, sql: str, rows: Iterable[Mapping[str, Any]], names: tuple[str, ...],
                 whole_row: bool = True) -> int: ...

    def run_updates(self, sql: str, events: list[Mapping[str, Any]], set_names: tuple[str, ...],
                    key_names: tuple[str, ...], whole_row: bool = True) -> int: ...

    def hook_rows(self, hasher: Callable[..., bytes]) -> RowHashes | None: ...

    def hash_rows(self, name: str, hasher: Callable[..., bytes]) -> bool: ...

    def sum_hashes(self, sql: str, bits: int
                   ) -> dict[int, tuple[bool, dict[int, tuple[int, int]]]] | None: ...

    def close(self) -> None: ...


class ChangeMarks(Protocol):
    """What records the rows a connection writes (the digests' keeper): told of each
    savepoint and each ``ROLLBACK TO`` one (SQLite's preupdate hook is not)."""

    def mark(self) -> int: ...

    def undo(self, mark: int) -> None: ...


class ChangeWriter:
    """Writes changes and snapshot rows into the tables of ``shapes`` (table -> its shape,
    the store's own dict: kept up to date by the store) on ``db``; ``statements``: the twin's
    ``Statements`` on that connection, or None (the pure path only). Every savepoint on
    ``db`` is :meth:`savepoint`'s, which tells ``marks``."""

    def __init__(self, db: sqlite3.Connection, statements: Statements | None,
                 shapes: dict[str, TableShape], *,
                 truncate: Callable[[str], None] | None = None,
                 marks: ChangeMarks | None = None) -> None:
        self._db = db
        # empties a table (the digests' keeper: every bucket to zero at once)
        self._truncate = truncate or self._delete_all
        self._marks = marks
        self.statements = statements
        self._shapes = shapes
        # (kind, table, column names of the row) -> _Prepared; kind is "INSERT", "UPDATE" or
        # _UPDATE_KEEPING_KEY
        self._prepared: dict[tuple[str, str, tuple[str, ...]], _Prepared] = {}
        # consecutive inserts (rows) or keyed updates (events) of one table and column set,
        # sent to SQLite together (executemany): the _prepared key they share
        self._batch_key: tuple[str, str, tuple[str, ...]] = ("", "", ())
        self._batched: list[Any] = []

    def shape(self, table: str) -> TableShape:
        shape = self._shapes.get(table)
        if shape is None:
            raise MirrorError(f"{table}: no schema applied in this session")
        return shape

    def forget(self, tables: Collection[str]) -> None:
        """Drop the statements of ``tables`` (their converters know the old types)."""
        self._prepared = {key: value for key, value in self._prepared.items()
                          if key[1] not in tables}

    def reset(self) -> None:
        """After a rollback: nothing batched, nothing prepared (the shapes may go back)."""
        self._batched = []
        self._prepared.clear()

    def batch(self, event: Mapping[str, Any], operation: str, table: str) -> bool:
        """Add an INSERT or UPDATE ``event`` of ``table`` to the batch; False: it is not
        batched (an UPDATE of a table without a key), the caller writes it."""
        data = event["data"]
        if operation == "INSERT":
            batch_key, item = (operation, table, tuple(data)), data
        else:  # (no ``old``: the key did not change); None: a table without a key
            batch_key = ("UPDATE" if event.get("old") else _UPDATE_KEEPING_KEY, table,
                         tuple(data))
            item = event if (batch_key in self._prepared
                             or self._prepare_update(batch_key)) else None
            if item is None:
                return False
        if batch_key != self._batch_key or len(self._batched) >= _MOST_BATCHED:
            self.flush()
            self._batch_key = batch_key
        self._batched.append(item)
        return True

    def flush(self) -> None:
        """Write the batch."""
        if not self._batched:
            return
        batched, self._batched = self._batched, []
        kind, table, _ = self._batch_key
        try:
            try:
                if kind == "INSERT":
                    self.insert_rows(table, batched)
                else:
                    self._update_rows(table, self._prepared[self._batch_key], batched)
            except CHANGE_ERRORS as exc:
                if isinstance(exc, DivergenceError) or not from_the_change(exc, self._db):
                    raise
                raise does_not_fit(table, None, exc) from exc
        except DivergenceError as exc:  # found at commit too: say which table it is
            exc.table = table
            raise

    def write(self, event: Mapping[str, Any]) -> None:
        """One change, now (after :meth:`flush`: the batch goes first)."""
        table, operation = event["table"], event["operation"]
        shape = self.shape(table)
        if operation == "INSERT":
            self.insert_rows(table, [event["data"]])
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
            self._truncate(table)
        else:
            raise MirrorError(f"{table}: unknown operation {operation!r} in {event.get('msg_id')}")

    def force(self, event: Mapping[str, Any]) -> None:
        """A change of a keyed table's row that does not fit (a row under repair the table
        lacks, or holds already): the row made what the change says as far as it can. An
        INSERT replaces a row of its key; an UPDATE replaces the rows of its old and new keys
        by its row when it carries every column, else leaves them (the repair replaces
        them); a DELETE of a row not there is nothing."""
        table, operation = event["table"], event["operation"]
        shape = self.shape(table)
        if operation not in ("INSERT", "UPDATE") or not shape.key_columns:
            return
        data = event["data"]
        if operation == "UPDATE" and {c.name for c in shape.columns} - set(data):
            return
        for identity in (event.get("old"), data):
            if identity:
                try:
                    rowid = self._find_row(shape, identity, event)
                except DivergenceError:
                    continue
                self._db.execute(f"DELETE FROM {quote(table)} WHERE rowid = ?", (rowid,))
        self.insert_rows(table, [data])

    def _delete_all(self, table: str) -> None:
        self._db.execute(f"DELETE FROM {quote(table)}")

    @contextlib.contextmanager
    def savepoint(self, name: str) -> Iterator[Callable[[], None]]:
        """``SAVEPOINT name`` ... ``RELEASE name`` (also when an error leaves); gives the
        function that rolls back to it, taking back what ``marks`` recorded since."""
        self._db.execute(f"SAVEPOINT {name}")
        mark = self._marks.mark() if self._marks is not None else 0

        def rollback() -> None:
            self._db.execute(f"ROLLBACK TO {name}")
            if self._marks is not None:
                self._marks.undo(mark)
        try:
            yield rollback
        finally:
            if self._db.in_transaction:  # (not when SQLite ended it: a full disk, ...)
                self._db.execute(f"RELEASE {name}")

    def insert_rows(self, table: str, rows: Sequence[Mapping[str, Any]]) -> None:
        if not rows:
            return
        names = tuple(rows[0])
        prepared = self._prepared.get(("INSERT", table, names))
        if prepared is None:
            convert, converts = self._row_converter(table, names)
            prepared = self._prepared[("INSERT", table, names)] = _Prepared(
                insert_statement(table, names), convert, None if converts else (names,))
        statement = prepared.statement
        try:
            with self.savepoint("cdc_insert") as rollback:
                try:
                    if prepared.compiled is not None and self.statements is not None:
                        if self.statements.run_rows(statement, rows, *prepared.compiled) >= 0:
                            return
                        rollback()  # (the pure path says what)
                    self._db.executemany(statement, map(prepared.values, rows))
                except (KeyError, OverflowError):
                    # rows of other columns, or an integer beyond 64 bits: undo the rows
                    # before it, then row by row with every value converted
                    rollback()
                    for row in rows:
                        self._db.execute(insert_statement(table, tuple(row)),
                                         [to_sqlite(value) for value in row.values()])
        except sqlite3.IntegrityError as exc:
            raise DivergenceError(f"{table}: an inserted row is already mirrored ({exc})") \
                from exc

    def insert_tuples(self, table: str, columns: tuple[str, ...], rows: list[tuple], *,
                      has_nan: bool) -> None:
        """Snapshot rows as tuples in ``columns`` order, bound as they are unless a column
        needs converting or a value is NaN."""
        convert_values, always = self._values_converter(table, columns)
        statement = insert_statement(table, columns)
        try:
            with self.savepoint("cdc_load") as rollback:
                try:
                    self._db.executemany(
                        statement, map(convert_values, rows) if always or has_nan else rows)
                except OverflowError:  # an integer beyond 64 bits: convert every value
                    rollback()
                    self._db.executemany(statement, ([to_sqlite(v) for v in row]
                                                     for row in rows))
        except sqlite3.IntegrityError as exc:
            raise DivergenceError(f"{table}: a loaded row is already mirrored ({exc})") \
                from exc

    def _update_rows(self, table: str, prepared: _Prepared, events: list) -> None:
        """Keyed UPDATE ``events`` of ``table`` (one column set), by the twin's Statements
        where they take them, else by the pure path."""
        statement = prepared.statement
        with self.savepoint("cdc_update") as rollback:
            if prepared.compiled is not None and self.statements is not None:
                if self.statements.run_updates(statement, events,
                                               *prepared.compiled) == len(events):
                    return
                rollback()  # (the pure path says what)
            batched = [self._update_values(prepared, event) for event in events]
            try:
                changed = self._execute_many_unique(statement, batched)
            except OverflowError:  # an integer beyond 64 bits: every value converted
                rollback()
                batched = [tuple(map(to_sqlite, parameters)) for parameters in batched]
                changed = self._execute_many_unique(statement, batched)
            if changed != len(batched):  # a row the mirror does not hold: find which
                rollback()
                key = self.shape(table).key_columns
                for parameters in batched:
                    if self._execute_unique(statement, parameters) != 1:
                        raise DivergenceError(
                            f"{table}: an UPDATE names a row the mirror does not hold: "
                            f"{dict(zip(key, parameters[-len(key):], strict=True))}")

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
                  if name in by_name and by_name[name].is_float]
        others = [index for index, name in enumerate(names)
                  if index not in floats and (name not in by_name or not by_name[name].bound_as_is)]
        # bool as int: CPython 3.11's sqlite3 binds a bool (not exactly an int) only after a
        # failed adapter lookup that formats and drops an AttributeError, ~3K instructions
        bools = [index for index, name in enumerate(names)
                 if name in by_name and by_name[name].is_bool]

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


def _same_values(stored: Sequence[Any], bound: Sequence[Any]) -> bool:
    """Whether the values read back from SQLite are exactly the values bound: the same type,
    and for floats the same sign of zero too."""
    for have, want in zip(stored, bound, strict=True):
        if type(have) is not type(want) or have != want:
            return False
        if type(have) is float and math.copysign(1.0, have) != math.copysign(1.0, want):
            return False
    return True
