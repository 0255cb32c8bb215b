"""A mirror meeting source verifications (docs/verification.md, "Meeting a verification"):
at a verify marker of a followed table, the table's digest there (the kept one, and one
recomputed from its rows by a worker thread on a second SQLite connection whose read
transaction sees exactly that state); at the verification's digest message, the mirror's
digest at the message's ``lsn`` (at the marker plus the logged deltas of the transactions
below it), compared bucket by bucket.

No NATS here: the follower hands over the decoded markers and digest messages, in stream
order, between transactions, after committing what it applied before them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import Callable, Mapping
from typing import Any

from cdc_platform.lsn import parse_lsn
from cdc_platform.mirror.columns import quote
from cdc_platform.mirror.digests import BITS, scan_digest
from cdc_platform.mirror.store import MirrorStore
from cdc_platform.mirror.verifications import (
    DigestMessage,
    Pending,
    VerificationResult,
    compare,
    parse_digest,
)
from cdc_platform.wire import VERIFICATION_ID_PREFIX
from cdc_platform.wire.digest import ALGORITHM, TableDigest

log = logging.getLogger(__name__)

# called after each verification a mirror meets (the fleet reporter's hook)
OnVerification = Callable[[str, VerificationResult], None]


class Meetings:
    """The verifications ``store``'s followed tables meet. ``scan``: recompute a table's
    digest from its rows at the marker (finds rows changed behind the mirror's back);
    ``report``: the status lines; ``on_verification``: told each result."""

    def __init__(self, store: MirrorStore, *, scan: bool, report: Callable[[str], None],
                 on_verification: OnVerification | None = None) -> None:
        self.store = store
        self.scan = scan
        self.report = report
        self.on_verification = on_verification
        self._scans: dict[tuple[str, str], asyncio.Future[TableDigest]] = {}

    @staticmethod
    def verify_marker(payload: Any, followed: Mapping[str, str]) -> tuple[str, str, int] | None:
        """(verification id, table, the marker's LSN) of a verify marker of a followed table
        (``followed``: table -> its local table); None for any other marker. ValueError
        for a marker that is not one."""
        if not isinstance(payload, Mapping) or payload.get("type") != "watermark":
            raise ValueError("not a watermark marker")
        vid, table = payload.get("snapshot_id"), payload.get("table")
        if not isinstance(vid, str) or not vid.startswith(VERIFICATION_ID_PREFIX) \
                or not isinstance(table, str) or table not in followed:
            return None
        return vid, table, parse_lsn(str(payload.get("commit_lsn") or payload.get("lsn")))

    def marker(self, vid: str, table: str, marker_lsn: int, *, streaming: bool,
               inside_transaction: bool) -> None:
        """A verify marker of ``table``: every transaction before it is committed."""
        if self.store.verification_recorded(vid, table):
            return  # (met again on a pass over the stream after a restart)
        pending = self.store.pending_verification(table)
        if pending is not None and pending.verification_id == vid:
            return
        why = ("the marker came inside a transaction" if inside_transaction
               else None if streaming else "the table was not streaming at the marker")
        pending = self.store.meet_marker(vid, table, marker_lsn, why=why)
        if pending.why is None and self.scan:
            self._scans[(vid, table)] = self._start_scan(table)

    def _start_scan(self, table: str) -> asyncio.Future[TableDigest]:
        """The table's digest recomputed from its rows as committed now, on a worker
        thread: its read transaction begins here (WAL: it sees this state whatever the
        follower commits next)."""
        shape = self.store.shape(table)
        db = self.store.read_connection()
        try:
            db.execute("BEGIN")
            db.execute(f"SELECT 1 FROM {quote(table)} LIMIT 1").fetchall()  # (the snapshot)
        except sqlite3.Error:
            db.close()
            raise

        def scan() -> TableDigest:
            with contextlib.closing(db):
                return scan_digest(db, shape)
        return asyncio.get_running_loop().run_in_executor(None, scan)

    async def digest(self, payload: Any, table: str, vid: str) -> VerificationResult | None:
        """A digest message of ``table`` (on the subject of ``table`` and ``vid``): compared,
        recorded, reported. ValueError or TypeError: not a digest message (said by the
        caller, and skipped)."""
        message = parse_digest(payload, table, vid)
        if self.store.verification_recorded(vid, table):
            return None
        pending = self.store.pending_verification(table)
        if pending is not None and pending.verification_id != vid:
            pending = None
        scan = self._scans.pop((vid, table), None)
        scanned = await scan if scan is not None else None
        result, reset = self._compare(message, pending, scanned)
        self.store.finish_verification(pending, result, reset)
        self.report(result.line())
        if self.on_verification is not None:
            try:
                self.on_verification(table, result)
            except Exception:  # (a hook's failure stops no mirror)
                log.exception("the on_verification hook failed for %s", table)
        return result

    def _compare(self, message: DigestMessage, pending: Pending | None,
                 scanned: TableDigest | None
                 ) -> tuple[VerificationResult, tuple[TableDigest, TableDigest] | None]:
        result = VerificationResult(message.verification_id, message.table, message.lsn,
                                    "not_comparable", bits=message.bits)
        state = self.store.state(message.table)
        why = None
        if pending is None:
            why = "the marker was not seen"
        elif pending.why is not None or pending.digest is None:
            why = pending.why or "no digest at the marker"
        elif message.algorithm != ALGORITHM:
            why = f"unknown algorithm {message.algorithm!r:.40}"
        elif message.bits > BITS:
            why = f"{message.bits} bits: the mirror keeps {BITS}"
        elif state is None or state.status != "streaming":
            why = "the table is not streaming"
        elif state.snapshot_id != pending.snapshot_id:
            why = "the table was bootstrapped again since the marker"
        elif state.cutover_lsn > message.lsn:
            why = "the table was bootstrapped from a snapshot above the digest's lsn"
        elif state.fingerprint != message.schema_fingerprint:
            why = (f"the schema differs (the mirror's {state.fingerprint}, the digest's "
                   f"{message.schema_fingerprint:.40})")
        if why is not None or pending is None or pending.digest is None:
            result.why = why
            return result, None
        base, reset = pending.digest, None
        if scanned is not None:
            result.changed_outside = base.differing(scanned)
            if result.changed_outside:
                base, reset = scanned, (pending.digest, scanned)
        mirror_digest = self.store.digest_at(pending, base, message.lsn)
        result.buckets_differing = compare(message, mirror_digest)
        result.status = "differ" if result.buckets_differing else "equal"
        return result, reset
