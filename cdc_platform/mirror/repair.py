"""Targeted repair (docs/verification.md Part 2, item 4): the rows of the buckets a source
verification found differing, replaced from a repair snapshot of those buckets.

How, with the follower (``follower.py``) doing the NATS side: the repair snapshot's chunks
load into a shadow ``REPAIR_PREFIX + table`` (as a bootstrap's do, in short transactions
between the follower's); the shadow then follows the stream from the snapshot's cutover,
given only the events whose key falls in the buckets (:meth:`RepairedBuckets.holds`), while
the table keeps applying every event, tolerantly for those keys (their rows are replaced
anyway, and a table known to differ there is expected to lack a row or hold one too many);
at the first commit where the shadow is consistent with the streaming tables
(``consistency.joining``), the store replaces exactly the rows of those buckets by the
shadow's in one SQLite transaction (``MirrorStore.replace_buckets``).

No NATS and no store here: which buckets are worth repairing, and which rows are in them.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cdc_platform.mirror.columns import TableShape, quote
from cdc_platform.mirror.stored_values import StoredRowDigester
from cdc_platform.mirror.verifications import VerificationResult
from cdc_platform.wire.digest import HASH_BITS, RowDigester

# a table's repair snapshot is loaded and caught up under this prefix (wire names never hold
# a space, so no published table is named like this)
REPAIR_PREFIX = "_cdc_repair "
# More differing buckets than this share of them: a full bootstrap moves about as much as the
# repair would, and replaces the whole table without a scan of its keys.
MOST_REPAIRED_SHARE = 0.25
_KEY_SCAN_BATCH = 10_000


# tables that followed the stream across a resync marker (the bridge lost its slot: changes
# may be missing) and have not been verified since: (wire_table, the marker's lost_after)
RESYNCING_TABLE = "_cdc_mirror_resyncing"


def create_tables(db: sqlite3.Connection) -> None:
    db.execute(f"CREATE TABLE IF NOT EXISTS {RESYNCING_TABLE} (wire_table TEXT PRIMARY KEY,"
               " lost_after TEXT NOT NULL)")


def resyncing(db: sqlite3.Connection) -> set[str]:
    return {row[0] for row in db.execute(f"SELECT wire_table FROM {RESYNCING_TABLE}")}


def set_resyncing(db: sqlite3.Connection, tables: Iterable[str], lost_after: str | None
                  ) -> None:
    """``tables`` resyncing since a marker of ``lost_after``; None: no longer."""
    if lost_after is None:
        db.executemany(f"DELETE FROM {RESYNCING_TABLE} WHERE wire_table = ?",
                       ((table,) for table in tables))
    else:
        db.executemany(f"INSERT OR REPLACE INTO {RESYNCING_TABLE} VALUES (?, ?)",
                       ((table, lost_after) for table in tables))


def repair_shadow_name(table: str) -> str:
    """The local table a repair snapshot of ``table`` is loaded into and caught up in."""
    return REPAIR_PREFIX + table


def why_not_repaired(result: VerificationResult, shape: TableShape) -> str | None:
    """Why the buckets ``result`` found differing are not repaired one by one but by a full
    bootstrap of the table, or None when they are."""
    most = int((1 << result.bits) * MOST_REPAIRED_SHARE)
    if len(result.buckets_differing) > most:
        return (f"{len(result.buckets_differing)} of {1 << result.bits} buckets differ (more "
                f"than {MOST_REPAIRED_SHARE:.0%})")
    if not shape.key_columns:
        return "the table has no primary key to find a bucket's rows by"
    return None


@dataclass
class Repair:
    """One repair under way: ``buckets`` (at ``bits``) of ``table``, found differing by
    ``verification_id`` at ``lsn``; ``loaded``: its shadow streams (it follows the stream)."""

    table: str
    verification_id: str
    lsn: int
    bits: int
    buckets: tuple[int, ...]
    loaded: bool = False

    @property
    def shadow(self) -> str:
        return repair_shadow_name(self.table)


class RepairedBuckets:
    """Whether an event's row is in the repaired ``buckets`` (at ``bits``) of a table keyed
    by ``key_columns``."""

    def __init__(self, shape: TableShape, bits: int, buckets: Iterable[int]) -> None:
        self.shape = shape
        self.bits = bits
        self.buckets = frozenset(buckets)
        self._key = RowDigester(shape.key_columns, shape.key_columns)
        self._shift = HASH_BITS - bits

    def holds(self, event: Mapping[str, Any], *, from_json: bool = False) -> bool:
        """Whether ``event`` changes a row of the buckets: its old key or its new one falls
        in them (a key change moves a row in or out). A TRUNCATE or a schema event changes
        every row."""
        if event.get("operation") not in ("INSERT", "UPDATE", "DELETE"):
            return True
        for row in (event.get("old"), event.get("data")):
            if not isinstance(row, Mapping) or not row:
                continue
            if self._holds_row((self.shape.from_json(row) or {}) if from_json else row):
                return True
        return False

    def _holds_row(self, row: Mapping[str, Any]) -> bool:
        try:
            return self._key.key_hash(row) >> self._shift in self.buckets
        except (KeyError, TypeError, ValueError):
            return False  # (a row without its key: not one of these; applying it says why)


def rowids_in_buckets(db: sqlite3.Connection, shape: TableShape, bits: int,
                      buckets: Iterable[int], *, inside: bool = True) -> list[int]:
    """The rowids of ``shape.table``'s rows whose key falls in ``buckets`` (``inside``
    False: in none of them), by a scan of the key columns hashed as stored."""
    wanted = frozenset(buckets)
    shift = HASH_BITS - bits
    key = [column for column in shape.columns if column.is_primary_key]
    digester = StoredRowDigester(key, [column.name for column in key])
    found: list[int] = []
    cursor = db.execute(f"SELECT rowid, {', '.join(quote(c.name) for c in key)} FROM "
                        f"{quote(shape.table)}")
    while batch := cursor.fetchmany(_KEY_SCAN_BATCH):
        found.extend(row[0] for row in batch
                     if (digester.hashes(row[1:])[0] >> shift in wanted) is inside)
    return found


def fine_buckets(bits: int, buckets: Sequence[int], finest: int) -> list[int]:
    """``buckets`` at ``bits`` as the buckets at ``finest`` bits they are made of."""
    spread = finest - bits
    return [fine for bucket in buckets
            for fine in range(bucket << spread, (bucket + 1) << spread)]
