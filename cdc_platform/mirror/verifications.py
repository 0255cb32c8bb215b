"""Source verifications a mirror met (docs/verification.md, "Meeting a verification"): the
results, and the digest deltas logged from a verify marker to its digest message, kept in
the mirror's file beside the rows."""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, field

from cdc_platform.lsn import format_lsn

VERIFICATIONS_TABLE = "_cdc_mirror_verifications"
# (verification, commit LSN of an applied transaction of its table, bucket, Δtotal, Δcount)
LOG_TABLE = "_cdc_mirror_digest_log"


@dataclass
class VerificationResult:
    """What a mirror found when it met a source verification of ``table``. ``status``:
    ``equal``, ``differ`` (``buckets_differing`` at the source's ``bits``, with (mirror
    count, source count)), ``not_comparable`` (``why``); ``changed_outside``: buckets (14
    bits) where the mirror's rows differ from the digest it kept (written behind its back)."""

    verification_id: str
    table: str
    lsn: int
    status: str
    bits: int = 0
    buckets_differing: dict[int, tuple[int, int]] = field(default_factory=dict)
    changed_outside: list[int] = field(default_factory=list)
    why: str | None = None
    at: float = field(default_factory=time.time)

    def line(self) -> str:
        head = f"{self.table}: verification {self.verification_id} at {format_lsn(self.lsn)}: "
        if self.status == "differ":
            listed = ", ".join(str(bucket) for bucket in list(self.buckets_differing)[:20])
            more = len(self.buckets_differing) - 20
            text = (head + f"{len(self.buckets_differing)} of {1 << self.bits} buckets "
                    f"differ: {listed}{f' and {more} more' if more > 0 else ''}")
        elif self.status == "not_comparable":
            text = head + f"not comparable ({self.why})"
        else:
            text = head + self.status
        if self.changed_outside:
            text += (f"; {len(self.changed_outside)} buckets changed behind the mirror's back: "
                     + ", ".join(map(str, self.changed_outside[:20])))
        return text


def create_tables(db: sqlite3.Connection) -> None:
    db.execute(f"CREATE TABLE IF NOT EXISTS {VERIFICATIONS_TABLE} (verification_id TEXT NOT NULL,"
               " wire_table TEXT NOT NULL, lsn TEXT NOT NULL, status TEXT NOT NULL,"
               " bits INTEGER NOT NULL, buckets_differing TEXT NOT NULL,"
               " changed_outside TEXT NOT NULL, why TEXT, rows_repaired INTEGER NOT NULL"
               " DEFAULT 0, at REAL NOT NULL, PRIMARY KEY (verification_id, wire_table))")
    db.execute(f"CREATE TABLE IF NOT EXISTS {LOG_TABLE} (verification_id TEXT NOT NULL,"
               " commit_lsn INTEGER NOT NULL, bucket INTEGER NOT NULL, dtotal INTEGER NOT NULL,"
               " dcount INTEGER NOT NULL)")
    db.execute(f"CREATE INDEX IF NOT EXISTS {LOG_TABLE}_by_id ON {LOG_TABLE} (verification_id)")


def record(db: sqlite3.Connection, result: VerificationResult) -> None:
    db.execute(f"INSERT OR REPLACE INTO {VERIFICATIONS_TABLE} VALUES (?, ?, ?, ?, ?, ?, ?, ?,"
               " 0, ?)",
               (result.verification_id, result.table, format_lsn(result.lsn), result.status,
                result.bits, json.dumps({str(bucket): list(counts) for bucket, counts
                                         in result.buckets_differing.items()}),
                json.dumps(result.changed_outside), result.why, result.at))


def last_verification(db: sqlite3.Connection, table: str) -> str | None:
    """The last source verification ``table`` met, as a phrase (None: none)."""
    try:
        row = db.execute(
            f"SELECT verification_id, lsn, status, buckets_differing, why, at FROM "
            f"{VERIFICATIONS_TABLE} WHERE wire_table = ? ORDER BY at DESC LIMIT 1",
            (table,)).fetchone()
    except sqlite3.OperationalError:  # (a file an older mirror wrote)
        return None
    if row is None:
        return None
    verification_id, lsn, status, differing, why, at = row
    detail = (f" ({len(json.loads(differing))} buckets)" if status == "differ"
              else f" ({why})" if why else "")
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
    return f"{verification_id} at {lsn}: {status}{detail}, {when}"
