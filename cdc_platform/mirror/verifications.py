"""Source verifications a mirror met (docs/verification.md, "Meeting a verification"): the
results, and the digest deltas logged from a verify marker to its digest message, kept in
the mirror's file beside the rows."""

from __future__ import annotations

import base64
import json
import sqlite3
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cdc_platform.lsn import format_lsn, parse_lsn
from cdc_platform.mirror.digests import BITS, Deltas
from cdc_platform.wire import VERIFICATION_ID_PREFIX
from cdc_platform.wire.digest import ALGORITHM, TableDigest, bucket_digests, pack_totals

VERIFICATIONS_TABLE = "_cdc_mirror_verifications"
# (verification, commit LSN of an applied transaction of its table, bucket, Δtotal, Δcount)
LOG_TABLE = "_cdc_mirror_digest_log"
# a verification whose marker was met and whose digest message was not yet: the table's
# digest at the marker (its deltas since are in LOG_TABLE)
PENDING_TABLE = "_cdc_mirror_verify_pending"
_MASK = (1 << 64) - 1


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
               " differing_counts TEXT NOT NULL, changed_outside TEXT NOT NULL, why TEXT, rows_repaired INTEGER NOT NULL"
               " DEFAULT 0, at REAL NOT NULL, PRIMARY KEY (verification_id, wire_table))")
    db.execute(f"CREATE TABLE IF NOT EXISTS {LOG_TABLE} (verification_id TEXT NOT NULL,"
               " commit_lsn INTEGER NOT NULL, bucket INTEGER NOT NULL, dtotal INTEGER NOT NULL,"
               " dcount INTEGER NOT NULL)")
    db.execute(f"CREATE INDEX IF NOT EXISTS {LOG_TABLE}_by_id ON {LOG_TABLE} (verification_id)")
    db.execute(f"CREATE TABLE IF NOT EXISTS {PENDING_TABLE} (verification_id TEXT NOT NULL,"
               " wire_table TEXT NOT NULL, marker_lsn INTEGER NOT NULL, snapshot_id TEXT,"
               " why TEXT, totals BLOB, counts BLOB, logged INTEGER NOT NULL DEFAULT 0,"
               " PRIMARY KEY (verification_id, wire_table))")


@dataclass
class Pending:
    """A verification met at its marker: ``digest`` the table's there (None when ``why``
    says it cannot be compared), ``snapshot_id`` the table's then (a bootstrap since: not
    comparable), ``logged`` the deltas logged since."""

    verification_id: str
    table: str
    marker_lsn: int
    snapshot_id: str | None
    digest: TableDigest | None
    why: str | None = None
    logged: int = 0


def save_pending(db: sqlite3.Connection, pending: Pending) -> None:
    digest = pending.digest
    db.execute(f"INSERT OR REPLACE INTO {PENDING_TABLE} VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
               (pending.verification_id, pending.table, pending.marker_lsn,
                pending.snapshot_id, pending.why,
                pack_totals(digest.totals) if digest else None,
                struct.pack(f">{len(digest.counts)}q", *digest.counts) if digest else None,
                pending.logged))


def load_pending(db: sqlite3.Connection) -> dict[str, Pending]:
    """The pending verifications, by table (one a table: a newer marker replaces it)."""
    found = {}
    for vid, table, marker_lsn, snapshot_id, why, totals, counts, logged in db.execute(
            f"SELECT * FROM {PENDING_TABLE}"):
        digest = None
        if totals is not None:
            size = len(totals) // 8
            digest = TableDigest(BITS, list(struct.unpack(f">{size}Q", totals)),
                                 list(struct.unpack(f">{size}q", counts)))
        found[table] = Pending(vid, table, marker_lsn, snapshot_id, digest, why, logged)
    return found


def drop_pending(db: sqlite3.Connection, pending: Pending) -> None:
    db.execute(f"DELETE FROM {PENDING_TABLE} WHERE verification_id = ? AND wire_table = ?",
               (pending.verification_id, pending.table))
    drop_log(db, pending)


def drop_log(db: sqlite3.Connection, pending: Pending) -> None:
    db.execute(f"DELETE FROM {LOG_TABLE} WHERE verification_id = ?", (pending.verification_id,))


def log_deltas(db: sqlite3.Connection, pending: Pending, commit_lsn: int,
               deltas: Deltas) -> None:
    """One applied transaction's bucket deltas of ``pending.table``."""
    db.executemany(f"INSERT INTO {LOG_TABLE} VALUES (?, ?, ?, ?, ?)",
                   ((pending.verification_id, commit_lsn, bucket,
                     total - (1 << 64) if total >> 63 else total, count)
                    for bucket, (total, count) in deltas.items()))
    pending.logged += len(deltas)
    db.execute(f"UPDATE {PENDING_TABLE} SET logged = ? WHERE verification_id = ? AND "
               "wire_table = ?", (pending.logged, pending.verification_id, pending.table))


def digest_at(db: sqlite3.Connection, pending: Pending, base: TableDigest,
              lsn: int) -> TableDigest:
    """``base`` (the digest at the marker) plus the logged deltas of the transactions that
    committed below ``lsn``."""
    digest = TableDigest(base.bits, list(base.totals), list(base.counts))
    for bucket, total, count in db.execute(
            f"SELECT bucket, dtotal, dcount FROM {LOG_TABLE} WHERE verification_id = ? AND"
            " commit_lsn < ?", (pending.verification_id, lsn)):
        digest.totals[bucket] = (digest.totals[bucket] + total) & _MASK
        digest.counts[bucket] += count
    return digest


@dataclass
class DigestMessage:
    """A source digest message, checked (docs/verification.md "Digest message")."""

    verification_id: str
    table: str
    lsn: int
    schema_fingerprint: str
    algorithm: str
    bits: int
    buckets: dict[int, tuple[int, int]]  # bucket -> (total, count), those covered


def parse_digest(payload: Any, subject_table: str, subject_id: str) -> DigestMessage:
    """The digest message ``payload`` (a decoded map) that came on the subject of
    ``subject_table`` and ``subject_id``; ValueError or TypeError saying what is wrong
    with it."""
    if not isinstance(payload, Mapping) or payload.get("type") != "digest":
        raise ValueError("not a digest message")
    vid, table = payload.get("verification_id"), payload.get("table")
    if vid != subject_id or not isinstance(vid, str) \
            or not vid.startswith(VERIFICATION_ID_PREFIX):
        raise ValueError(f"verification_id {vid!r:.80} is not its subject's")
    if table != subject_table:
        raise ValueError(f"table {table!r:.80} is not its subject's")
    bits, counts, buckets = payload.get("bits"), payload.get("counts"), payload.get("buckets")
    totals = payload.get("totals")
    if isinstance(totals, str):  # (a JSON payload: base64, as bytea)
        totals = base64.b64decode(totals, validate=True)
    if type(bits) is not int or not isinstance(totals, bytes) or not isinstance(counts, list) \
            or any(type(count) is not int or count < 0 for count in counts) \
            or not (buckets is None or isinstance(buckets, list)
                    and all(type(bucket) is int for bucket in buckets)):
        raise TypeError("bits, totals, counts or buckets are not of their types")
    fingerprint, algorithm = payload.get("schema_fingerprint"), payload.get("algorithm")
    if not isinstance(fingerprint, str) or not isinstance(algorithm, str):
        raise TypeError("schema_fingerprint or algorithm is not a string")
    lsn = parse_lsn(str(payload.get("lsn")))
    covered = (bucket_digests(bits, totals, counts, buckets) if algorithm == ALGORITHM
               and bits <= BITS else {})
    return DigestMessage(vid, table, lsn, fingerprint, algorithm, bits, covered)


def compare(message: DigestMessage, mirror: TableDigest) -> dict[int, tuple[int, int]]:
    """The buckets (at the message's bits) whose digests differ: bucket -> (the mirror's
    count, the source's)."""
    folded = mirror.folded(message.bits)
    return {bucket: (folded.counts[bucket], count)
            for bucket, (total, count) in message.buckets.items()
            if folded.totals[bucket] != total or folded.counts[bucket] != count}


def record(db: sqlite3.Connection, result: VerificationResult) -> None:
    db.execute(f"INSERT OR REPLACE INTO {VERIFICATIONS_TABLE} VALUES (?, ?, ?, ?, ?, ?, ?, ?,"
               " ?, 0, ?)",
               (result.verification_id, result.table, format_lsn(result.lsn), result.status,
                result.bits, json.dumps(list(result.buckets_differing)),
                json.dumps({str(bucket): list(counts) for bucket, counts
                            in result.buckets_differing.items()}),
                json.dumps(result.changed_outside), result.why, result.at))


def recorded(db: sqlite3.Connection, verification_id: str, table: str) -> bool:
    """Whether the mirror met ``verification_id`` of ``table`` already."""
    return db.execute(f"SELECT 1 FROM {VERIFICATIONS_TABLE} WHERE verification_id = ? AND "
                      "wire_table = ?", (verification_id, table)).fetchone() is not None


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
