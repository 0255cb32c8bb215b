"""Each mirrored table's digest (docs/verification.md, Part 1), kept current as the store
writes rows, in the same SQLite transaction as the rows and positions.

How: every row the store's connection writes into a kept table is hashed as stored (the old
row of an UPDATE or DELETE, the new row of an INSERT or UPDATE) and its ``(key hash, row
hash)`` recorded; :meth:`DigestKeeper.fold` (just before each COMMIT) adds them to the
table's buckets and writes the buckets it touched. So every write of the store's connection
is counted, whichever path makes it (the pure ``executemany``, the compiled ``Statements`` on
the same handle, a row-by-row retry), and the hashes are those of what the file holds (as
``mirror verify`` recomputes them). Another writer of the file (the compiled ``ChunkLoader``,
a person with ``sqlite3``) is not counted, which is what ``mirror verify`` finds. Chunks the
``ChunkLoader`` wrote are added by :meth:`DigestKeeper.add`.

Two ways to record, the same hashes:

- the compiled store's ``Statements.hook_rows``, where SQLite has its preupdate hook
  (``ENABLE_PREUPDATE_HOOK`` in ``PRAGMA compile_options``): the hook hashes each row in C
  from SQLite's values into a log in C memory. SQLite does not tell the hook of a ``ROLLBACK
  TO``: every savepoint of the store's connection is taken through :meth:`DigestKeeper.mark`
  and :meth:`DigestKeeper.undo` (``ChangeWriter.savepoint``).
- otherwise (the pure path, a SQLite without the hook) TEMP triggers on each kept table call
  ``cdc_row_hashes`` with the row's values and record the hashes in a TEMP table, which a
  ``ROLLBACK TO`` takes back by itself.

The buckets a commit touched are appended to the table's journal (one row: they are scattered
over the whole buckets table, whose pages each commit would otherwise rewrite); once it holds
``JOURNAL_ENTRIES`` the journal is compacted into one row of the table's non-empty buckets.
:func:`read_digest` reads the buckets table (which files written before hold) and the journal.
With the hook, the cached digests are C arrays (``RowHashes.kept``) the fold adds into.

A schema change drops the table's triggers (they name its columns) and installs new ones;
one that changes rows' hashes (a column dropped, renamed, or added with a value) recomputes
the table's buckets from its rows.
"""

from __future__ import annotations

import contextlib
import sqlite3
import struct
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

from cdc_platform.mirror.apply import BucketSums, DigestBuckets, RowHashes, Statements
from cdc_platform.mirror.columns import TableShape, quote
from cdc_platform.mirror.errors import DivergenceError
from cdc_platform.mirror.stored_values import StoredRowDigester, digest_stored_rows
from cdc_platform.wire.digest import HASH_BITS, MAX_BUCKET_BITS, TableDigest

# (wire_table, bucket, total, count): non-empty buckets, as written before the journal was
# compacted into itself (read, emptied at a table's next compaction)
DIGESTS_TABLE = "_cdc_mirror_digests"
KEPT_TABLE = "_cdc_mirror_digest_tables"  # the tables whose digests are kept current
# (wire_table, buckets): a table's non-empty buckets (its last compaction), then per commit
# the buckets it touched as they became (packed _ENTRY records, the later row winning)
JOURNAL_TABLE = "_cdc_mirror_digest_journal"
BITS = MAX_BUCKET_BITS  # a mirror keeps 16,384 buckets and folds to what a source sends
# A commit's buckets are scattered over the whole DIGESTS_TABLE (100 changes touched ~60 of its
# pages, each written to the WAL: half the upkeep's cost); appended to the journal they are one
# row. A table's journal is compacted once it holds this many entries (~4.7 MB: read in
# ~50 ms into lists, a few ms into the hook's C arrays; a compaction, ~9 ms, is mostly
# SQLite deleting the journal's rows, where writing 16,384 rows back into DIGESTS_TABLE
# cost ~35 ms).
JOURNAL_ENTRIES = 16 << BITS

_CHANGES = "_cdc_digest_changes"  # TEMP: (table id, sign, hashes) of the open transaction
_HASH_FUNCTION = "cdc_row_hashes"
_SUMS = f"SELECT tid, sign, hashes FROM {_CHANGES} ORDER BY rowid"  # (as made)
_TRUNCATED = 0  # a _CHANGES sign: every bucket of the table to zero
_MASK = (1 << HASH_BITS) - 1
_SHIFT = HASH_BITS - BITS
_pair = struct.Struct(">QQ")
_ENTRY = struct.Struct(">HQq")  # a journal entry: bucket, total, count
_KINDS = ("insert", "update", "delete")

# a bucket's change in one transaction: (total added mod 2^64, rows added)
Deltas = dict[int, tuple[int, int]]


def create_tables(db: sqlite3.Connection) -> None:
    db.execute(f"CREATE TABLE IF NOT EXISTS {DIGESTS_TABLE} (wire_table TEXT NOT NULL,"
               " bucket INTEGER NOT NULL, total INTEGER NOT NULL, count INTEGER NOT NULL,"
               " PRIMARY KEY (wire_table, bucket)) WITHOUT ROWID")
    db.execute(f"CREATE TABLE IF NOT EXISTS {KEPT_TABLE} (wire_table TEXT PRIMARY KEY,"
               " bits INTEGER NOT NULL)")
    db.execute(f"CREATE TABLE IF NOT EXISTS {JOURNAL_TABLE} (wire_table TEXT NOT NULL,"
               " buckets BLOB NOT NULL)")


def has_preupdate_hook(db: sqlite3.Connection) -> bool:
    """Whether ``db``'s SQLite is built with the preupdate hook (Debian's is, SQLite's
    default build and some Pythons' are not)."""
    return any(option == "ENABLE_PREUPDATE_HOOK"
               for (option,) in db.execute("PRAGMA compile_options"))


def read_digest(db: sqlite3.Connection, table: str) -> TableDigest | None:
    """``table``'s stored digest, or None when it is not kept."""
    digest = _ListBuckets(BITS)
    if _read(db, table, digest) is None:
        return None
    return TableDigest(digest.bits, digest.totals, digest.counts)


def _read(db: sqlite3.Connection, table: str, digest: DigestBuckets) -> int | None:
    """``table``'s stored digest read into ``digest`` (empty): the entries of its journal;
    None: not kept."""
    if db.execute(f"SELECT 1 FROM {KEPT_TABLE} WHERE wire_table = ?", (table,)).fetchone() is None:
        return None
    totals, counts = digest.totals, digest.counts
    for bucket, total, count in db.execute(
            f"SELECT bucket, total, count FROM {DIGESTS_TABLE} WHERE wire_table = ?", (table,)):
        totals[bucket], counts[bucket] = total & _MASK, count
    entries = 0
    if db.execute("SELECT 1 FROM sqlite_master WHERE name = ?", (JOURNAL_TABLE,)).fetchone():
        for (packed,) in db.execute(f"SELECT buckets FROM {JOURNAL_TABLE} WHERE wire_table = ?"
                                    " ORDER BY rowid", (table,)):
            entries += digest.load(packed)
    return entries


def scan_digest(db: sqlite3.Connection, shape: TableShape) -> TableDigest:
    """``shape.table``'s digest recomputed from its rows."""
    digest = TableDigest(BITS)
    digester = StoredRowDigester(shape.columns, shape.key_columns)
    names = ", ".join(quote(column.name) for column in shape.columns)
    rows = db.execute(f"SELECT {names} FROM {quote(shape.table)}")
    digest_stored_rows(digest, digester, rows)
    return digest


class DigestKeeper:
    """The digests of the tables the store writes, on its connection ``db`` (see the module
    docstring); ``enabled`` False: none kept, and none left in the file to go stale.
    ``statements``: the compiled ``Statements`` on ``db``'s handle, if any."""

    def __init__(self, db: sqlite3.Connection, *, enabled: bool = True,
                 statements: Statements | None = None) -> None:
        self._db = db
        self._statements = statements
        self.enabled = enabled
        self._rows: RowHashes | None = None  # the preupdate hook's hashes (else triggers)
        # the triggers' function (it holds no reference back: the connection holds it, and a
        # cycle through the connection would keep its file open until a GC pass)
        self._hasher = _RowHasher()
        self._digesters = self._hasher.digesters  # table id -> its digester
        self._ids: dict[str, int] = {}  # table -> the id its triggers pass
        # every id given (one per shape a table was followed in) -> its table: the changes of
        # the open transaction made before a schema change are still its table's
        self._tables: dict[int, str] = {}
        self._next_id = 1
        # as committed (and folded), cached: in C arrays with the hook (RowHashes.kept)
        self._digests: dict[str, DigestBuckets] = {}
        self._journaled: dict[str, int] = {}  # a cached digest's table -> its journal entries
        create_tables(db)
        if not enabled:
            for bookkeeping in (DIGESTS_TABLE, KEPT_TABLE, JOURNAL_TABLE):
                db.execute(f"DELETE FROM {bookkeeping}")
            return
        # a trigger passes the table id and every column: at most this many columns (the
        # same limit with the hook: a table is kept or not whichever way its rows are hashed)
        self._most_columns = db.getlimit(sqlite3.SQLITE_LIMIT_FUNCTION_ARG) - 1
        if statements is not None and has_preupdate_hook(db):
            self._rows = statements.hook_rows(self._hasher)
        if self._rows is not None:
            return
        db.execute("PRAGMA temp_store=MEMORY")
        db.execute(f"CREATE TEMP TABLE IF NOT EXISTS {_CHANGES} (tid INTEGER NOT NULL,"
                   " sign INTEGER NOT NULL, hashes BLOB)")
        # (the compiled Statements' C function on the same handle hashes most rows without
        # making Python values of them)
        if statements is None or not statements.hash_rows(_HASH_FUNCTION, self._hasher):
            db.create_function(_HASH_FUNCTION, -1, self._hasher)

    # -- following tables ------------------------------------------------------------------
    def follow(self, shape: TableShape, *, created: bool = False, rehash: bool = False,
               table_id: int | None = None) -> None:
        """Keep ``shape.table``'s digest from now on (its triggers for this shape).
        ``created``: the table is new (empty); ``rehash``: its rows' hashes changed, or its
        digest is not kept yet: recompute it from the rows. ``table_id``: the id it had
        (:meth:`reset`: same shape, same id), else a new one."""
        if not self.enabled:
            return
        table = shape.table
        self.unfollow(table)
        physical = [row[1] for row in self._db.execute(f"PRAGMA table_info({quote(table)})")]
        by_name = {column.name: column for column in shape.columns}
        if len(shape.columns) > self._most_columns or sorted(physical) != sorted(by_name):
            self.forget(table)  # (too wide for a trigger's call, or not in this shape)
            return
        if created:
            self._set(table, TableDigest(BITS))
        elif rehash or table not in self._kept():
            self._set(table, scan_digest(self._db, shape))
        if table_id is None:
            table_id = self._next_id
            self._next_id += 1
        self._ids[table], self._tables[table_id] = table_id, table
        # (in the file's column order, which may differ from the source's: the same values)
        digester = StoredRowDigester([by_name[name] for name in physical], shape.key_columns)
        self._digesters[table_id] = digester
        if self._rows is not None:
            self._rows.follow(table, table_id, digester)
            return
        for kind in _KINDS:
            self._create_trigger(table, table_id, kind)

    def unfollow(self, table: str) -> None:
        """``table``'s writes no longer hashed (before an ALTER: its triggers name its
        columns, the hook's digester has them)."""
        if not self.enabled:
            return
        if self._rows is not None:
            self._rows.unfollow(table)
        else:
            for kind in _KINDS:
                self._db.execute(f"DROP TRIGGER IF EXISTS temp.{quote(_trigger(table, kind))}")
        table_id = self._ids.pop(table, None)
        if table_id is not None:
            self._digesters.pop(table_id, None)

    def forget(self, table: str) -> None:
        """``table``'s digest is no longer kept (the table is dropped, or cannot be)."""
        if not self.enabled:
            return
        self.unfollow(table)
        self._drop_changes(table)
        for bookkeeping in (DIGESTS_TABLE, KEPT_TABLE, JOURNAL_TABLE):
            self._db.execute(f"DELETE FROM {bookkeeping} WHERE wire_table = ?", (table,))
        self._digests.pop(table, None)

    def renamed(self, before: str, shape: TableShape) -> None:
        """``before`` (a shadow, unfollowed) is now ``shape.table``: its digest goes with it."""
        if not self.enabled:
            return
        self.fold()
        table = shape.table
        for bookkeeping in (DIGESTS_TABLE, KEPT_TABLE, JOURNAL_TABLE):
            self._db.execute(f"DELETE FROM {bookkeeping} WHERE wire_table = ?", (table,))
            self._db.execute(f"UPDATE {bookkeeping} SET wire_table = ? WHERE wire_table = ?",
                             (table, before))
        self._digests.pop(before, None)
        self._digests.pop(table, None)
        self.follow(shape)

    def truncate(self, table: str) -> None:
        """``DELETE FROM table`` with every bucket to zero, without hashing each row."""
        table_id = self._ids.get(table)
        if table_id is None:
            self._db.execute(f"DELETE FROM {quote(table)}")
            return
        if self._rows is not None:
            self._rows.truncate(table_id)
            with self._unhashed():  # (prepared unhooked, SQLite clears it without a row step)
                self._db.execute(f"DELETE FROM {quote(table)}")
            return
        # without its DELETE trigger (the temp schema rolls back with the transaction too)
        self._db.execute(f"DROP TRIGGER temp.{quote(_trigger(table, 'delete'))}")
        self._db.execute(f"DELETE FROM {quote(table)}")
        self._db.execute(f"INSERT INTO {_CHANGES} VALUES (?, {_TRUNCATED}, NULL)", (table_id,))
        self._hasher.called = True
        self._create_trigger(table, table_id, "delete")

    @property
    def hooked(self) -> bool:
        """Whether rows are hashed from SQLite's preupdate hook (so can a ``ChunkLoader``'s
        on its own connection: :meth:`hashing`)."""
        return self._rows is not None

    def hashing(self, table: str) -> tuple[int, StoredRowDigester, _RowHasher] | None:
        """What hashes ``table``'s rows as another connection of this process stores them
        (``ChunkLoader.hash_rows``): its id, digester, and the Python function for the rows
        whose text ``wire_value`` turns back; None: not kept."""
        table_id = self._ids.get(table)
        if table_id is None:
            return None
        return table_id, self._digesters[table_id], self._hasher

    def hashes(self, table: str, rows: Iterable[Sequence[Any]]) -> tuple[int, list[bytes]]:
        """(``table``'s id, the packed hashes of ``rows`` as stored, in the table's column
        order), for :meth:`add`; no database work (a worker thread may run it)."""
        table_id = self._ids.get(table)
        if table_id is None:
            return 0, []
        hashes = self._digesters[table_id].hashes
        return table_id, [_pair.pack(*hashes(row)) for row in rows]

    @contextlib.contextmanager
    def uncounted_inserts(self, table: str) -> Iterator[None]:
        """(in the open transaction) INSERTs into ``table`` not hashed by its trigger: the
        caller adds their :meth:`hashes` (worked out on a worker thread)."""
        table_id = self._ids.get(table)
        if table_id is None:
            yield
            return
        if self._rows is not None:
            with self._unhashed():
                yield
            return
        self._db.execute(f"DROP TRIGGER temp.{quote(_trigger(table, 'insert'))}")
        yield
        self._create_trigger(table, table_id, "insert")

    def add(self, table_id: int, hashes: list[bytes]) -> None:
        """Rows another connection wrote (the compiled ``ChunkLoader``), hashed by
        :meth:`hashes`: added to their table's digest in the open transaction (nothing when
        the table is no longer followed under that id)."""
        if table_id not in self._digesters:
            return
        if self._rows is not None:
            self._rows.add(table_id, hashes)
            return
        self._db.executemany(f"INSERT INTO {_CHANGES} VALUES (?, 1, ?)",
                             ((table_id, pair) for pair in hashes))
        self._hasher.called = True

    # -- the transaction -------------------------------------------------------------------
    def mark(self) -> int:
        """Where the open transaction's changes are (at a SAVEPOINT), for :meth:`undo`."""
        return self._rows.mark() if self._rows is not None else 0

    def undo(self, mark: int) -> None:
        """After a ``ROLLBACK TO`` the SAVEPOINT at which :meth:`mark` gave ``mark``: the
        changes recorded since are taken back (the hook is not told; a TEMP table goes back
        with the savepoint by itself)."""
        if self._rows is not None:
            self._rows.undo(mark)

    def fold(self, deltas_of: Collection[str] = ()) -> dict[str, Deltas]:
        """Add the open transaction's row changes to the digests and write the buckets they
        touched (call before COMMIT); the bucket deltas of the tables of ``deltas_of`` (those
        a verification logs) it changed."""
        if self._rows is not None:
            taken = self._taken(self._rows)
            tables = [self._tables[table_id] for table_id in taken]
            if len(set(tables)) == len(tables) and not any(
                    table_sums.truncated for table_sums in taken.values()):
                return self._fold_sums(dict(zip(tables, taken.values(), strict=True)),
                                       deltas_of)
            sums = {table_id: (table_sums.truncated, table_sums.buckets())
                    for table_id, table_sums in taken.items()}
        elif self._hasher.called:
            self._hasher.called = False
            sums = self._sums()
            if sums:
                self._db.execute(f"DELETE FROM {_CHANGES}")
        else:
            return {}
        if not sums:
            return {}
        deltas: dict[str, Deltas] = {}
        for table_id, (truncated, buckets) in sums.items():
            table = self._tables[table_id]
            digest = self._digest(table)
            totals, counts = digest.totals, digest.counts
            table_deltas = deltas.setdefault(table, {})
            if truncated:
                for bucket in range(len(counts)):
                    if counts[bucket] or totals[bucket]:
                        total, rows = table_deltas.get(bucket, (0, 0))
                        table_deltas[bucket] = ((total - totals[bucket]) & _MASK,
                                                rows - counts[bucket])
                        totals[bucket], counts[bucket] = 0, 0
            accumulate = bool(table_deltas)
            if not accumulate:  # (most often: the deltas are the sums)
                table_deltas.update(buckets)
            for bucket, (added, count) in buckets.items():
                totals[bucket] = (totals[bucket] + added) & _MASK
                counts[bucket] += count
                if accumulate:
                    total, rows = table_deltas.get(bucket, (0, 0))
                    table_deltas[bucket] = ((total + added) & _MASK, rows + count)
        for table, table_deltas in deltas.items():
            self._write(table, self._digests[table], table_deltas)
        return {table: deltas[table] for table in deltas_of if table in deltas}

    def _fold_sums(self, sums: Mapping[str, BucketSums], deltas_of: Collection[str]
                   ) -> dict[str, Deltas]:
        """(:meth:`fold` most often: each table's changes under one id, none truncated) the
        sums added into the digests and packed into their journal rows in C."""
        deltas = {}
        for table, table_sums in sums.items():
            if table in deltas_of:
                deltas[table] = table_sums.buckets()
            digest = self._digest(table)
            self._journal(table, digest, table_sums.apply(digest))
        return deltas

    def _taken(self, rows: RowHashes) -> dict[int, BucketSums]:
        """The hook's changes summed; a row it could not hash (a text
        ``wire_value`` cannot turn back: the file was written behind the mirror's back) is
        that table's divergence, raised as a failed write of it would be."""
        error = rows.error  # (first: a row it could not hash is not logged)
        if error is None and not len(rows):
            return {}
        if error is not None:
            rows.clear()
            table = self._tables.get(error[0], "?")
            failed = DivergenceError(f"{table}: a row written could not be hashed for its "
                                     f"digest ({error[1]})")
            failed.table = table
            raise failed
        return rows.take(BITS)

    def _sums(self) -> dict[int, tuple[bool, Deltas]]:
        """The open transaction's changes summed by table id (in the order first seen: a
        table's changes under one id all precede those under its next) and bucket: {table id: (truncated, {bucket: (row hashes added mod 2^64, rows
        added)})}, ``truncated``: every bucket went to zero, before the changes summed."""
        if self._statements is not None:
            summed = self._statements.sum_hashes(_SUMS, BITS)
            if summed is not None:
                return summed
        sums: dict[int, tuple[bool, Deltas]] = {}
        for table_id, sign, hashes in self._db.execute(_SUMS):
            if sign == _TRUNCATED:
                sums[table_id] = (True, {})
                continue
            buckets = sums.setdefault(table_id, (False, {}))[1]
            key_hash, row_hash = _pair.unpack(hashes)
            bucket = key_hash >> _SHIFT
            total, count = buckets.get(bucket, (0, 0))
            buckets[bucket] = ((total + sign * row_hash) & _MASK, count + sign)
        return sums

    def reset(self, shapes: Mapping[str, TableShape]) -> None:
        """After a rollback: the committed digests, and triggers for the committed
        ``shapes`` (the temp schema went back with the transaction)."""
        if not self.enabled:
            return
        self._digests.clear()
        self._journaled.clear()
        self._hasher.called = False
        if self._rows is not None:
            self._rows.clear()
        # the committed shapes keep their ids: a ChunkLoader hashing a table on its own
        # connection adds its chunks under the id it was given (a new one would drop them)
        ids = dict(self._ids)
        for table in ids:
            self.unfollow(table)
        for shape in shapes.values():
            if shape.table in self._kept():
                self.follow(shape, table_id=ids.get(shape.table))

    def shift(self, table: str, subtract: TableDigest, add: TableDigest) -> None:
        """``table``'s buckets moved by ``add - subtract`` (reset from a scan of its rows:
        the digest kept at a point, and the one recomputed there)."""
        digest = self._digest(table)
        moved = [bucket for bucket in range(len(digest.counts))
                 if subtract.totals[bucket] != add.totals[bucket]
                 or subtract.counts[bucket] != add.counts[bucket]]
        for bucket in moved:
            digest.totals[bucket] = (digest.totals[bucket] - subtract.totals[bucket]
                                     + add.totals[bucket]) & _MASK
            digest.counts[bucket] += add.counts[bucket] - subtract.counts[bucket]
        self._write(table, digest, moved)

    def digest(self, table: str) -> TableDigest | None:
        """A copy of ``table``'s digest as of the last fold (None: not kept)."""
        if not self.enabled or table not in self._ids:
            return None
        digest = self._digest(table)
        return TableDigest(digest.bits, list(digest.totals), list(digest.counts))

    # -- plumbing --------------------------------------------------------------------------
    @contextlib.contextmanager
    def _unhashed(self) -> Iterator[None]:
        """(the hook) Writes of the connection not hashed meanwhile."""
        assert self._rows is not None
        self._rows.pause()
        try:
            yield
        finally:
            self._rows.resume()

    def _create_trigger(self, table: str, table_id: int, kind: str) -> None:
        """The trigger recording the hashes of the rows a ``kind`` statement changes."""
        names = self._digesters[table_id].names

        def hashes(sign: int, row: str) -> str:
            values = ", ".join(f"{row}.{quote(name)}" for name in names)
            return f"({table_id}, {sign}, {_HASH_FUNCTION}({table_id}, {values}))"
        rows = {"insert": hashes(1, "new"), "delete": hashes(-1, "old"),
                "update": f"{hashes(-1, 'old')}, {hashes(1, 'new')}"}[kind]
        self._db.execute(
            f"CREATE TEMP TRIGGER {quote(_trigger(table, kind))} AFTER {kind.upper()} ON "
            f"main.{quote(table)} BEGIN INSERT INTO {_CHANGES} VALUES {rows}; END")

    def _digest(self, table: str) -> DigestBuckets:
        digest = self._digests.get(table)
        if digest is None:
            digest = self._digests[table] = self._cached()
            self._journaled[table] = _read(self._db, table, digest) or 0
        return digest

    def _cached(self, digest: TableDigest | None = None) -> DigestBuckets:
        """``digest`` (None: an empty one) as this keeper caches it: with the hook in C
        arrays, which the fold adds into and a journal is read into in C."""
        if self._rows is not None:
            return self._rows.kept(BITS, digest)
        if digest is None:
            return _ListBuckets(BITS)
        return _ListBuckets(digest.bits, digest.totals, digest.counts)

    def _kept(self) -> set[str]:
        return {row[0] for row in self._db.execute(f"SELECT wire_table FROM {KEPT_TABLE}")}

    def _drop_changes(self, table: str) -> None:
        """Forget the open transaction's changes of ``table`` (its digest is set anew)."""
        ids = [table_id for table_id, name in self._tables.items() if name == table]
        if self._rows is not None:
            for table_id in ids:
                self._rows.restart(table_id)
        elif ids:
            self._db.execute(f"DELETE FROM {_CHANGES} WHERE tid IN "
                             f"({', '.join('?' * len(ids))})", ids)

    def _set(self, table: str, digest: TableDigest) -> None:
        """``table``'s digest is ``digest`` (from its rows, or empty) from now on."""
        self._drop_changes(table)
        self._db.execute(f"INSERT OR REPLACE INTO {KEPT_TABLE} VALUES (?, ?)", (table, BITS))
        self._digests[table] = cached = self._cached(digest)
        self._store(table, cached)

    def _store(self, table: str, digest: DigestBuckets) -> None:
        """``table``'s non-empty buckets as its only journal row (its rows in DIGESTS_TABLE
        deleted: an empty bucket has no entry to override one)."""
        for bookkeeping in (DIGESTS_TABLE, JOURNAL_TABLE):
            self._db.execute(f"DELETE FROM {bookkeeping} WHERE wire_table = ?", (table,))
        entries = digest.entries()
        if entries:
            self._db.execute(f"INSERT INTO {JOURNAL_TABLE} VALUES (?, ?)", (table, entries))
        self._journaled[table] = len(entries) // _ENTRY.size

    def _write(self, table: str, digest: DigestBuckets, buckets: Collection[int]) -> None:
        """``buckets`` of ``table`` (whose digest is cached) as they are now: into its
        journal, or, when that is full, the journal compacted."""
        totals, counts = digest.totals, digest.counts
        self._journal(table, digest, b"".join(
            [_ENTRY.pack(bucket, totals[bucket], counts[bucket]) for bucket in buckets]))

    def _journal(self, table: str, digest: DigestBuckets, entries: bytes) -> None:
        """Packed ``entries`` (of ``table``'s buckets as they are now) into its journal, or,
        when that is full, the journal compacted."""
        journaled = self._journaled.get(table, 0) + len(entries) // _ENTRY.size
        if journaled > JOURNAL_ENTRIES:
            self._store(table, digest)
            return
        self._db.execute(f"INSERT INTO {JOURNAL_TABLE} VALUES (?, ?)", (table, entries))
        self._journaled[table] = journaled


class _ListBuckets(TableDigest):
    """A digest in its lists (without the hook), read and written as journal entries."""

    def entries(self) -> bytes:
        """The non-empty buckets, packed as journal entries."""
        return b"".join([_ENTRY.pack(bucket, total, count) for bucket, (total, count)
                         in enumerate(zip(self.totals, self.counts, strict=True))
                         if total or count])

    def load(self, packed: bytes) -> int:
        """Packed journal entries set into their buckets in order; how many."""
        totals, counts = self.totals, self.counts
        entries = 0
        for bucket, total, count in _ENTRY.iter_unpack(packed):
            totals[bucket], counts[bucket] = total, count
            entries += 1
        return entries


class _RowHasher:
    """``cdc_row_hashes(table id, stored values...)``: the row's key and row hashes, packed."""

    def __init__(self) -> None:
        self.digesters: dict[int, StoredRowDigester] = {}
        self.called = False  # since the last fold

    def __call__(self, table_id: int, *stored: Any) -> bytes:
        self.called = True
        return _pair.pack(*self.digesters[table_id].hashes(stored))


def _trigger(table: str, kind: str) -> str:
    return f"cdc_digest {kind} {table}"
