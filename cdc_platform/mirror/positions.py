"""Where each mirrored table stands, kept in the mirror's own bookkeeping tables beside the
rows: its status, its cutover LSN, its high-water mark (the last applied commit LSN and
ordinal), the `CDC` sequence read for it, the shape the stream last gave it; and the LSN at
which every streaming table equals the source (docs/mirror.md).

Written inside the transaction that writes the rows, so the two always agree.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cdc_platform.lsn import format_lsn, parse_lsn_cached
from cdc_platform.mirror.columns import TableShape
from cdc_platform.mirror.errors import MirrorError
from cdc_platform.wire import applies

STATE_TABLE = "_cdc_mirror_tables"
# one row: the LSN at which every streaming table equals the source (docs/mirror.md)
CONSISTENT_TABLE = "_cdc_mirror_consistent_lsn"


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


@contextlib.contextmanager
def reading_file(path: str | Path) -> Iterator[sqlite3.Connection]:
    """The mirror's file ``path`` opened read-only (a running mirror may hold it), in one
    read transaction: what it shows agrees with itself. MirrorError: no such file, or not a
    mirror database."""
    if not Path(path).is_file():
        raise MirrorError(f"{path}: no such file")
    uri = f"{Path(path).resolve().as_uri()}?mode=ro"
    try:
        with contextlib.closing(sqlite3.connect(uri, uri=True)) as db:
            db.execute("BEGIN")
            yield db
    except sqlite3.DatabaseError as exc:
        raise MirrorError(f"{path} is not a mirror database ({exc})") from exc


def lsn_or_zero(text: Any) -> int:
    """A schema event's ``min_snapshot_lsn`` (0: absent, as before it existed, or not an
    LSN; the event's ``commit_lsn`` bounds the snapshot then)."""
    try:
        return parse_lsn_cached(text)
    except ValueError:
        return 0


def create_tables(db: sqlite3.Connection) -> None:
    """The bookkeeping tables, unless the database has them."""
    db.execute(
        f"CREATE TABLE IF NOT EXISTS {STATE_TABLE} ("
        " wire_table TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, status TEXT NOT NULL,"
        " snapshot_id TEXT, cutover_lsn INTEGER NOT NULL,"
        " applied_commit_lsn INTEGER NOT NULL, applied_ordinal INTEGER NOT NULL,"
        " stream_seq INTEGER NOT NULL DEFAULT 0, updated_at REAL NOT NULL,"
        " shape TEXT NOT NULL DEFAULT '', reason TEXT,"
        " stale_lsn INTEGER NOT NULL DEFAULT 0)")
    db.execute(
        f"CREATE TABLE IF NOT EXISTS {CONSISTENT_TABLE} (id INTEGER PRIMARY KEY"
        " CHECK (id = 1), lsn TEXT, lsn_int INTEGER, updated_at REAL NOT NULL)")


def load_shapes(db: sqlite3.Connection) -> dict[str, TableShape]:
    """The shape each table was last given, as the stream (not today's KV) has it."""
    shapes = {}
    for table, text in db.execute(f"SELECT wire_table, shape FROM {STATE_TABLE} "
                                  "WHERE shape != ''"):
        try:
            shapes[table] = TableShape.from_json_text(text)
        except (ValueError, KeyError, TypeError) as exc:
            raise MirrorError(f"unreadable table shape in {STATE_TABLE}: {exc!r}") from exc
    return shapes


def read_state(db: sqlite3.Connection, table: str) -> TableState | None:
    row = db.execute(
        f"SELECT wire_table, fingerprint, status, snapshot_id, cutover_lsn,"
        f" applied_commit_lsn, applied_ordinal, stream_seq, reason, stale_lsn"
        f" FROM {STATE_TABLE}"
        " WHERE wire_table = ?", (table,)).fetchone()
    return TableState(*row) if row else None


def table_names(db: sqlite3.Connection) -> list[str]:
    return [row[0] for row in db.execute(f"SELECT wire_table FROM {STATE_TABLE}")]


def resume_seq(db: sqlite3.Connection, names: Sequence[str]) -> int:
    """The `CDC` sequence to read from so that every streaming table of ``names`` gets every
    event it lacks (1: from the start)."""
    row = db.execute(
        f"SELECT min(stream_seq) FROM {STATE_TABLE} WHERE status = 'streaming' AND "
        f"wire_table IN ({', '.join('?' * len(names))})", list(names)).fetchone()
    return int(row[0] or 0) + 1


def advance(db: sqlite3.Connection, names: Sequence[str], stream_seq: int) -> None:
    """``stream_seq`` was read for the streaming tables of ``names``."""
    db.execute(
        f"UPDATE {STATE_TABLE} SET stream_seq = ? WHERE status = 'streaming' AND "
        f"stream_seq < ? AND wire_table IN ({', '.join('?' * len(names))})",
        [stream_seq, stream_seq, *names])


def put_state(db: sqlite3.Connection, state: TableState, shape: TableShape | None) -> None:
    """Record ``state`` (its ``stream_seq`` included) with ``shape``."""
    db.execute(
        f"INSERT OR REPLACE INTO {STATE_TABLE} VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (state.table, state.fingerprint, state.status, state.snapshot_id,
         state.cutover_lsn, state.applied_commit_lsn, state.applied_ordinal, state.stream_seq,
         time.time(), shape.to_json_text() if shape else "", state.reason, state.stale_lsn))


def delete_state(db: sqlite3.Connection, table: str) -> None:
    db.execute(f"DELETE FROM {STATE_TABLE} WHERE wire_table = ?", (table,))


def record_consistent_lsn(db: sqlite3.Connection, lsn: int | None) -> None:
    """Record ``lsn`` (None: not known)."""
    db.execute(f"INSERT OR REPLACE INTO {CONSISTENT_TABLE} VALUES (1, ?, ?, ?)",
               (None if lsn is None else format_lsn(lsn), lsn, time.time()))
