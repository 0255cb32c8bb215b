"""The mirror's local store: SQLite tables shaped from the KV schemas, changes applied one whole
PostgreSQL transaction at a time, each SQLite commit recording the stream position with the rows.

No NATS here: the follower (bootstrap, stream) hands this store decoded wire maps. Every write
is one SQLite transaction that also moves the table's position, so a mirror killed at any point
reopens at a consistent (rows, position) pair: nothing lost, nothing applied twice.

Which events apply, the transactions and the positions are here; the column types and table
shapes are in ``columns.py``, the bookkeeping tables in ``positions.py``, creating and altering
the mirrored tables in ``tables.py``, writing the changes in ``apply.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sqlite3
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from cdc_platform.lsn import parse_lsn_cached
from cdc_platform.mirror import positions, repair, verifications
from cdc_platform.mirror.apply import (
    CHANGE_ERRORS,
    ChangeWriter,
    Statements,
    does_not_fit,
    from_the_change,
)
from cdc_platform.mirror.columns import TableShape, insert_statement, quote, to_sqlite
from cdc_platform.mirror.digests import Deltas, DigestKeeper, scan_digest
from cdc_platform.mirror.errors import DivergenceError, MirrorError
from cdc_platform.mirror.positions import TableState, lsn_or_zero
from cdc_platform.mirror.tables import SchemaChange, create_lookup, drop_lookup, follow_shape
from cdc_platform.speedups import compiled_twin
from cdc_platform.wire import SCHEMA_OPERATION
from cdc_platform.wire.digest import TableDigest

# a table being bootstrapped is loaded and caught up under this prefix, then renamed (wire
# names never hold a space, so no published table is named like this)
SHADOW_PREFIX = "_cdc_bootstrap "

# A chunk's bytes, and the chunk numbers already loaded -> (its number, rows written), or None
# (nothing written: the caller decodes it); see MirrorStore.chunk_loader
ChunkLoad = Callable[[bytes, set[int]], tuple[int, int] | None]


@dataclass
class Applied:
    """What :meth:`MirrorStore.apply_transaction` did."""

    events: int = 0
    stale: dict[str, str] = field(default_factory=dict)  # table -> why it needs a snapshot


class MirrorStore:
    """One SQLite database holding mirrored tables and their positions, and (``digests``)
    each table's digest kept current (mirror/digests.py)."""

    def __init__(self, path: str | Path, *, digests: bool = True) -> None:
        self.path = str(path)
        try:
            # (the twin's Statements run batches on this connection's own SQLite handle)
            self._db, statements = _connect(self.path)
            self._db.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL mode: a power loss may drop the last commits, never split one, and
            # rows and position travel together, so the mirror re-reads what it lost.
            self._db.execute("PRAGMA synchronous=NORMAL")
            positions.create_tables(self._db)
            verifications.create_tables(self._db)
            repair.create_tables(self._db)
            # the shape each table was last given, as the stream (not today's KV) has it
            shapes = positions.load_shapes(self._db)
            self._digests = DigestKeeper(self._db, enabled=digests, statements=statements)
        except (sqlite3.DatabaseError, MirrorError) as exc:
            raise MirrorError(f"{self.path} is not a usable mirror database ({exc}): move it "
                              "away and start the mirror again to rebuild it") from exc
        # (one dict, the writer's too: changed in place, never replaced)
        self._shapes: dict[str, TableShape] = shapes
        self._writer = ChangeWriter(self._db, statements, self._shapes,
                                    truncate=self._digests.truncate, marks=self._digests)
        self._states: dict[str, TableState | None] = {}  # committed states, cached
        self._open: Applied | None = None  # the transaction begin() opened
        self._open_states: dict[str, TableState] = {}
        with self._transaction():  # (a table whose digest is not kept yet: computed now)
            for shape in shapes.values():
                self._digests.follow(shape)
        # table -> the verification whose deltas its applied transactions log
        self._logging = {table: pending for table, pending
                         in verifications.load_pending(self._db).items() if pending.why is None}
        self.most_logged = 1_000_000  # deltas a verification logs at most

    def close(self) -> None:
        if self._writer.statements is not None:
            self._writer.statements.close()  # (finalized before their connection closes)
        self._db.close()

    # -- state ----------------------------------------------------------------------------------
    def state(self, table: str) -> TableState | None:
        return positions.read_state(self._db, table)

    def resume_seq(self, tables: Iterable[str]) -> int:
        """The `CDC` sequence to read from so that every streaming table of ``tables`` gets
        every event it lacks (1: from the start)."""
        return positions.resume_seq(self._db, list(tables))

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
        positions.advance(self._db, names, stream_seq)

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
        return positions.table_names(self._db)

    # -- shape ----------------------------------------------------------------------------------
    def apply_shape(self, shape: TableShape,
                    added_values: Mapping[str, Any] | None = None) -> SchemaChange:
        """Create the table or follow a change of its shape inside the current transaction.

        ``added_values``: what existing rows read for a newly added column (the schema's
        missing value); a column added without one holds NULL in existing rows.
        """
        before = self._shapes.get(shape.table)
        self._shapes[shape.table] = shape
        self._writer.forget({shape.table})
        self._digests.unfollow(shape.table)  # (its triggers name the columns an ALTER changes)
        change = follow_shape(self._db, before, shape, added_values)
        if change is not SchemaChange.NEEDS_BOOTSTRAP:
            self._digests.follow(shape, created=change is SchemaChange.CREATED,
                                 rehash=change is SchemaChange.ALTERED
                                 and rehashes(before, shape, added_values)
                                 or reads_back_otherwise(before, shape))
        return change

    def shape(self, table: str) -> TableShape:
        return self._writer.shape(table)

    # -- digests --------------------------------------------------------------------------------
    @property
    def keeps_digests(self) -> bool:
        return self._digests.enabled

    def digest(self, table: str) -> TableDigest | None:
        """A copy of ``table``'s digest as committed (None: not kept)."""
        return self._digests.digest(table)

    def meet_marker(self, verification_id: str, table: str, marker_lsn: int, *,
                    why: str | None = None) -> verifications.Pending:
        """A verify marker of ``table`` (between transactions, all before it committed): its
        digest here, and its transactions' deltas logged from now on (docs/verification.md
        "Meeting a verification"); ``why``: why it cannot be compared, if known already."""
        state = self.state(table)
        if why is None:
            if state is None or state.status != "streaming":
                why = "the table was not streaming at the marker"
            elif state.cutover_lsn > marker_lsn or state.applied_commit_lsn >= marker_lsn:
                why = "the mirror was past the marker (it met it again after a restart)"
            elif self.digest(table) is None:
                why = "the mirror keeps no digest of the table (CDC_MIRROR_DIGESTS=off)"
        pending = verifications.Pending(verification_id, table, marker_lsn,
                                        state.snapshot_id if state else None,
                                        None if why else self.digest(table), why)
        with self._transaction():
            earlier = self._logging.pop(table, None)
            if earlier is not None:
                verifications.drop_pending(self._db, earlier)
            verifications.save_pending(self._db, pending)
        if why is None:
            self._logging[table] = pending
        return pending

    def pending_verification(self, table: str) -> verifications.Pending | None:
        """The verification of ``table`` met at its marker, still logging (its digest
        message not yet met)."""
        return self._logging.get(table) or verifications.load_pending(self._db).get(table)

    @property
    def logging(self) -> bool:
        """Whether a verification logs deltas (the follower then commits each transaction
        on its own: a log row names its transaction's commit LSN)."""
        return bool(self._logging)

    def finish_verification(self, pending: verifications.Pending | None,
                            result: verifications.VerificationResult,
                            reset: tuple[TableDigest, TableDigest] | None = None) -> None:
        """Record ``result`` and drop ``pending`` and its log; ``reset``: (the digest kept
        at the marker, the one recomputed from the rows there): the kept buckets moved by the
        difference."""
        with self._transaction():
            if reset is not None:
                self._digests.shift(result.table, *reset)
            verifications.record(self._db, result)
            if pending is not None:
                verifications.drop_pending(self._db, pending)
        if pending is not None and self._logging.get(pending.table) is pending:
            del self._logging[pending.table]

    def verification_recorded(self, verification_id: str, table: str) -> bool:
        return verifications.recorded(self._db, verification_id, table)

    def digest_at(self, pending: verifications.Pending, base: TableDigest,
                  lsn: int) -> TableDigest:
        """``base`` (``pending``'s table's digest at its marker) plus the logged deltas of
        the transactions below ``lsn``."""
        return verifications.digest_at(self._db, pending, base, lsn)

    def log_digest_deltas(self, table: str, commit_lsn: int, deltas: Deltas) -> None:
        """(in the open transaction) ``table``'s deltas of the transaction ``commit_lsn``."""
        pending = self._logging.get(table)
        if pending is None:
            return
        if pending.logged + len(deltas) > self.most_logged:
            pending.why = (f"its log passed CDC_MIRROR_VERIFY_LOG_ROWS ({self.most_logged} "
                           "deltas)")
            pending.digest = None
            verifications.save_pending(self._db, pending)
            verifications.drop_log(self._db, pending)
            del self._logging[table]
            return
        verifications.log_deltas(self._db, pending, commit_lsn, deltas)

    def read_connection(self) -> sqlite3.Connection:
        """A second connection to the file (a verification's scan, on another thread)."""
        return sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)

    def loaded_hashes(self, table: str, rows: Iterable[Sequence[Any]]
                      ) -> tuple[int, list[bytes]]:
        """The hashes of rows (wire values in the table's column order) the compiled
        ``ChunkLoader`` wrote into ``table``, for :meth:`digest_loaded`. No database work:
        a worker thread may run it while the follower goes on."""
        if not self._digests.enabled:
            return 0, []
        return self._digests.hashes(table, ([to_sqlite(value) for value in row]
                                            for row in rows))

    def digest_loaded(self, hashes: tuple[int, list[bytes]]) -> None:
        """:meth:`loaded_hashes` into the table's digest (a bootstrap interrupted between
        the chunk and this begins again)."""
        if hashes[1]:
            with self._transaction():
                self._digests.add(*hashes)

    # -- bootstrap ------------------------------------------------------------------------------
    def begin_bootstrap(self, shape: TableShape, snapshot_id: str, snapshot_lsn: int) -> None:
        """Empty the table (recreated in the snapshot's shape) and mark it bootstrapping."""
        with self._transaction():
            self._digests.forget(shape.table)
            self._db.execute(f"DROP TABLE IF EXISTS {quote(shape.table)}")
            self._shapes.pop(shape.table, None)
            self.apply_shape(shape)
            self._put_state(TableState(shape.table, shape.fingerprint, "bootstrapping",
                                       snapshot_id, snapshot_lsn, 0, -1), stream_seq=0)

    def load_rows(self, table: str, rows: Sequence[Mapping[str, Any]], *,
                  hashes: tuple[int, list[bytes]] | None = None) -> None:
        """One snapshot chunk's rows, in one transaction. ``hashes``: their
        :meth:`loaded_hashes` (then added as they are, not worked out row by row here)."""
        with self._transaction(), self._counted(table, hashes):
            self._writer.insert_rows(table, rows)

    def load_tuples(self, table: str, columns: tuple[str, ...], rows: list[tuple], *,
                    has_nan: bool, hashes: tuple[int, list[bytes]] | None = None) -> None:
        """One snapshot chunk's rows as tuples in ``columns`` order, in one transaction.
        Bound as they are unless a column needs converting or a value is NaN. ``hashes``:
        as :meth:`load_rows`."""
        with self._transaction(), self._counted(table, hashes):
            self._writer.insert_tuples(table, columns, rows, has_nan=has_nan)

    @contextlib.contextmanager
    def _counted(self, table: str, hashes: tuple[int, list[bytes]] | None) -> Iterator[None]:
        if hashes is None or not self._digests.enabled:
            yield
            return
        with self._digests.uncounted_inserts(table):
            yield
        self._digests.add(*hashes)

    @property
    def loads_digested(self) -> bool:
        """Whether a chunk :meth:`chunk_loader` loads is in the table's digest when ``load``
        returns (hashed as the loader stores it); else the caller adds it
        (:meth:`loaded_hashes`, :meth:`digest_loaded`)."""
        return self._digests.hooked

    @contextlib.contextmanager
    def chunk_loader(self, table: str, columns: tuple[str, ...]) -> Iterator[ChunkLoad | None]:
        """The compiled loader of ``table``'s msgpack chunks (rows in ``columns`` order), or
        None (not built, an in-memory database): ``load(chunk bytes, chunk numbers loaded)``
        writes a chunk in one transaction of its own connection and gives (its number, rows),
        or None to leave the chunk to :meth:`load_tuples` / :meth:`load_rows` (the reference:
        a property test holds the two to the same rows). Not inside a transaction of this
        store: the two connections would wait on each other. A loaded chunk's rows are added
        to the table's digest as :attr:`loads_digested` says."""
        try:
            file = self._db.execute("PRAGMA database_list").fetchone()[2]  # (main's file)
        except sqlite3.Error:  # (a file name that is not UTF-8)
            file = None
        loader = None
        if ChunkLoader is not None and file and not self._db.in_transaction:
            try:
                loader = ChunkLoader(file, insert_statement(table, columns), columns)
            except ValueError:
                loader = None  # (no such table, ...: the pure path gives the real error)
        hashing = self._digests.hashing(table) if self.loads_digested else None
        if loader is None or hashing is None or not loader.hash_rows(table, *hashing):
            try:
                yield loader.load if loader is not None else None
            finally:
                if loader is not None:
                    loader.close()
            return
        hashes_of = loader.hashes

        def load(data: bytes, seen: set[int]) -> tuple[int, int] | None:
            taken = loader.load(data, seen)
            if taken is not None:  # (a bootstrap interrupted before this begins again)
                self.digest_loaded((hashing[0], hashes_of()))
            return taken
        try:
            yield load
        finally:
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
    def apply_transaction(self, events: Sequence[Mapping[str, Any]], stream_seq: int,
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
        return self.commit(stream_seq, followed, max(
            (parse_lsn_cached(event["commit_lsn"]) for event in events), default=0))

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

    def apply(self, event: Mapping[str, Any], *, from_json: bool = False,
              tolerant: bool = False) -> None:
        """One event of the open transaction, unless the positions cover it. A schema event
        alters the table, or marks it stale when no ALTER can follow the change.
        ``tolerant``: a change of a row under repair (mirror/repair.py), whose rows are
        replaced anyway: one that does not fit is made to (:meth:`ChangeWriter.force`)
        instead of raising :class:`DivergenceError`."""
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
            if (operation in ("INSERT", "UPDATE") and not from_json and not tolerant
                    and self._writer.batch(event, operation, table)):
                state.applied_commit_lsn = commit_lsn
                state.applied_ordinal = event["ordinal"]
                self._open.events += 1
                return
            self._writer.flush()
            if operation == SCHEMA_OPERATION:
                # not a change: the high-water mark stays before the change it precedes
                why = self._apply_schema_event(event, from_json)
                if why is None:
                    state.fingerprint = self.shape(table).fingerprint
                else:  # (from a snapshot past its transaction: one at it reads it again)
                    state.status, state.reason = "stale", why
                    state.stale_lsn = max(commit_lsn + 1,
                                          lsn_or_zero(event.get("min_snapshot_lsn")))
                    self._open.stale[table] = why
                return
            if from_json:
                event = self._restored(event)
            if tolerant:
                self._write_tolerantly(event)
            else:
                self._writer.write(event)
            state.applied_commit_lsn, state.applied_ordinal = commit_lsn, event["ordinal"]
            self._open.events += 1
        except DivergenceError:
            raise
        except CHANGE_ERRORS as exc:
            if not from_the_change(exc, self._db):
                raise
            raise does_not_fit(event["table"], event, exc) from exc

    def _write_tolerantly(self, event: Mapping[str, Any]) -> None:
        """``event`` written as it is where it fits, else forced (in a savepoint: what the
        failed write did, its digest changes too, goes back first)."""
        with self._writer.savepoint("cdc_tolerant") as rollback:
            try:
                self._writer.write(event)
            except CHANGE_ERRORS as exc:
                if not isinstance(exc, DivergenceError) and not from_the_change(exc, self._db):
                    raise
                rollback()
                self._writer.force(event)

    @property
    def open_events(self) -> int:
        """Events applied in the open transaction so far."""
        return self._open.events if self._open is not None else 0

    def commit(self, stream_seq: int, followed: Iterable[str] = (), commit_lsn: int = 0
               ) -> Applied:
        """Commit the open transaction with the new positions: each table's high-water mark,
        and ``stream_seq`` for the tables of ``followed`` (all were read up to it).
        ``commit_lsn``: of its last transaction (the one, while verifications log)."""
        assert self._open is not None
        try:
            self._writer.flush()
            for state in self._open_states.values():
                if state.touched:
                    self._put_state(state, stream_seq=max(state.stream_seq, stream_seq))
            names = list(followed)
            if names:
                self._advance(names, stream_seq)
            deltas = self._digests.fold(self._logging.keys())
            for table, table_deltas in deltas.items():
                self.log_digest_deltas(table, commit_lsn, table_deltas)
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

    def rollback(self) -> None:
        self._writer.reset()
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")
        self._open = None
        self._open_states = {}
        self._states.clear()
        # shapes changed by rolled-back schema events: back to the committed ones
        committed = positions.load_shapes(self._db)
        self._shapes.clear()
        self._shapes.update(committed)
        self._digests.reset(committed)
        self._logging = verifications.load_pending(self._db)
        self._logging = {table: pending for table, pending in self._logging.items()
                         if pending.why is None}

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
        """Follow a schema event (docs/wire-contract.md "Schema changes"); why a new snapshot is
        needed instead, if it is."""
        if event.get("needs_snapshot"):
            return str(event.get("reason") or "the bridge says a new snapshot is needed")
        table_schema = event["table_schema"]
        shape = TableShape.from_schema(table_schema)
        if shape.table != event["table"]:
            raise MirrorError(f"a schema event of {event['table']} carries the schema of "
                              f"{shape.table!r}")
        before = self._shapes.get(shape.table)
        missing = {c.name: c.column.missing_value for c in shape.columns}
        if from_json:
            missing = shape.from_json(missing) or {}
        if self.apply_shape(shape, added_values=missing) is SchemaChange.NEEDS_BOOTSTRAP:
            return (f"its shape changed in a way no ALTER follows (a column's type or the key "
                    f"changed: {before.fingerprint if before else '?'} -> "
                    f"{shape.fingerprint})")
        return None

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
            positions.record_consistent_lsn(self._db, lsn)

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
                self._digests.forget(table)
                self._digests.unfollow(shadow)
                self._db.execute(f"DROP TABLE IF EXISTS {quote(table)}")
                drop_lookup(self._db, shadow)
                self._db.execute(f"ALTER TABLE {quote(shadow)} RENAME TO {quote(table)}")
                self._digests.renamed(shadow, renamed)
                self._shapes.pop(shadow, None)
                self._shapes[table] = renamed
                if not renamed.key_columns:
                    create_lookup(self._db, renamed)
                positions.delete_state(self._db, shadow)
                self._states.pop(shadow, None)
                self._put_state(dataclasses.replace(state, table=table, reason=None,
                                                    stale_lsn=0), stream_seq=state.stream_seq)
            self.record_consistent_lsn(consistent_lsn)
        self._writer.forget({*shadows, *shadows.values()})

    # -- repair (mirror/repair.py) --------------------------------------------------------------
    def replace_buckets(self, table: str, shadow: str, bits: int, buckets: Sequence[int],
                        verification_id: str, consistent_lsn: int | None) -> tuple[int, int]:
        """In one SQLite transaction: delete ``table``'s rows whose key falls in ``buckets``
        (at ``bits``), insert the caught-up ``shadow``'s rows of those buckets, set those
        buckets' digests from what was inserted, drop the shadow, record the verification
        ``verification_id`` ``repaired`` and ``consistent_lsn``. Rows outside the buckets
        are not written. (rows deleted, rows inserted)."""
        with self._transaction():
            state, shape = self.state(shadow), self._shapes.get(shadow)
            if state is None or shape is None or state.status != "streaming":
                raise MirrorError(f"{table}: no caught-up repair shadow")
            target = self.shape(table)
            doomed = repair.rowids_in_buckets(self._db, target, bits, buckets)
            self._db.executemany(f"DELETE FROM {quote(table)} WHERE rowid = ?",
                                 ((rowid,) for rowid in doomed))
            # (rows a key change moved out of the buckets while the shadow followed)
            self._db.executemany(f"DELETE FROM {quote(shadow)} WHERE rowid = ?", (
                (rowid,) for rowid in repair.rowids_in_buckets(self._db, shape, bits, buckets,
                                                               inside=False)))
            target = self._learn_base_types(target, shape)
            names = ", ".join(quote(column.name) for column in target.columns)
            inserted = self._db.execute(f"INSERT INTO {quote(table)} ({names}) SELECT {names} "
                                        f"FROM {quote(shadow)}").rowcount
            self._digests.fold()
            kept = self._digests.digest(table)
            if kept is not None:
                # the buckets' digests are what was inserted, whatever they were before (a
                # digest kept without a scan may not have matched the damaged rows)
                wanted = TableDigest(kept.bits, list(kept.totals), list(kept.counts))
                inserted_digest = scan_digest(self._db, shape)
                for bucket in repair.fine_buckets(bits, buckets, kept.bits):
                    wanted.totals[bucket] = inserted_digest.totals[bucket]
                    wanted.counts[bucket] = inserted_digest.counts[bucket]
                self._digests.shift(table, kept, wanted)
            self._drop_shadow(shadow)
            verifications.record_repair(self._db, verification_id, table, inserted)
            self.record_consistent_lsn(consistent_lsn)
        self._writer.forget({table, shadow})
        return len(doomed), inserted

    def _learn_base_types(self, kept: TableShape, snapshot: TableShape) -> TableShape:
        """``kept`` with the base types of ``snapshot``'s columns (the same fingerprint's)
        where it kept none, and their ``is_array`` where it kept none, recorded with the
        table. A file shaped before base types (or ``is_array``) were kept reads a domain's
        values as its type's: its rows holding a NaN, an xid8 past 2^63 or an array differ
        from the source's, so a repair of their buckets comes, and from it the table reads
        them as its base type's. The rows outside the buckets hash
        the same either way (else they would differ too), so their digests stand."""
        shape = kept.learning_base_types(snapshot)
        if shape is kept:
            return kept
        self._shapes[kept.table] = shape
        self._writer.forget({kept.table})
        self._digests.follow(shape)  # (the rows the repair inserts hashed by the base types)
        state = self.state(kept.table)
        if state is not None:
            self._put_state(state, stream_seq=state.stream_seq)
        return shape

    def resyncing(self) -> set[str]:
        """The tables that may miss changes a lost slot took (mirror/repair.py)."""
        return repair.resyncing(self._db)

    def set_resyncing(self, tables: Iterable[str], lost_after: str | None) -> None:
        """``tables`` may miss changes from ``lost_after`` on (None: verified since)."""
        with self._transaction():
            repair.set_resyncing(self._db, tables, lost_after)

    def drop_shadow(self, shadow: str) -> None:
        """Drop a shadow and its state (a repair given up)."""
        with self._transaction():
            self._drop_shadow(shadow)
        self._writer.forget({shadow})

    def _drop_shadow(self, shadow: str) -> None:
        self._digests.forget(shadow)
        self._db.execute(f"DROP TABLE IF EXISTS {quote(shadow)}")
        self._shapes.pop(shadow, None)
        positions.delete_state(self._db, shadow)
        self._states.pop(shadow, None)

    # -- plumbing -------------------------------------------------------------------------------
    def _put_state(self, state: TableState, *, stream_seq: int) -> None:
        self._states.pop(state.table, None)
        state.stream_seq = stream_seq
        positions.put_state(self._db, state, self._shapes.get(state.table))

    def _transaction(self) -> _Transaction:
        return _Transaction(self)


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
            self._store._digests.fold()
            self._store._db.execute("COMMIT")
        else:
            self._store.rollback()


def rehashes(before: TableShape | None, after: TableShape,
             added_values: Mapping[str, Any] | None) -> bool:
    """Whether following ``before`` -> ``after`` (an ALTER) changes rows' hashes: a column
    dropped, renamed or dropped and added again (its values go or move), or one added with
    a value (docs/verification.md "Names in the bytes"). Not known (no ``before``): yes."""
    if before is None:
        return True
    now = {column.name: column.attnum for column in after.columns}
    for column in before.columns:
        attnum = now.get(column.name)
        if attnum is None or column.attnum and attnum not in (0, column.attnum):
            return True
    return any((added_values or {}).get(name) is not None
               for name in now.keys() - {column.name for column in before.columns})


def reads_back_otherwise(before: TableShape | None, after: TableShape) -> bool:
    """Whether ``after`` turns the stored values of a column ``before`` has too back into
    other wire values (``stored_values.wire_value``): its base type or whether it holds
    arrays differ, as when a shape kept before those were learns them. Its rows hash
    otherwise from then on."""
    if before is None:
        return False
    kept = {column.name: column for column in before.columns}
    return any((kept[column.name].base_type_oid, kept[column.name].holds_arrays)
               != (column.base_type_oid, column.holds_arrays)
               for column in after.columns if column.name in kept)


class LoadsChunks(Protocol):
    """A compiled loader of one table's msgpack chunks (see :meth:`MirrorStore.chunk_loader`)."""

    def load(self, data: bytes, seen: set[int]) -> tuple[int, int] | None: ...

    def hash_rows(self, table: str, table_id: int, digester: Any,
                  hasher: Callable[..., bytes]) -> bool: ...

    def hashes(self) -> list[bytes]: ...

    def close(self) -> None: ...


def connect(path: str, **options: Any) -> tuple[sqlite3.Connection, Statements | None]:
    """A connection to ``path``, and ``Statements`` on its SQLite handle: None here (the
    compiled twin's when built, unless the handle could not be proven to be this
    connection's)."""
    return sqlite3.connect(path, **options), None


#: ``ChunkLoader(file, insert statement, columns)``: compiled only (None: not built).
ChunkLoader: Callable[[str, str, tuple[str, ...]], LoadsChunks] | None = None


def _connect(path: str) -> tuple[sqlite3.Connection, Statements | None]:
    """The store's connection (autocommit: the store opens its transactions) and the
    twin's ``Statements`` on its handle, if any."""
    return connect(path, isolation_level=None, check_same_thread=False)


if TYPE_CHECKING:
    from cdc_platform._speedups.mirror import store as _twin
else:
    _twin = compiled_twin(__name__)
if _twin is not None:
    connect, ChunkLoader = _twin.connect, _twin.ChunkLoader
