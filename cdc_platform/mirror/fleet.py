"""A mirror's state in KV ``mirrors`` (docs/verification.md Part 2, item 5): what it
follows, where each table stands, how far behind it is and how its last verification went,
published on ``mirror.state.{mirror id}`` every CDC_MIRROR_STATE_INTERVAL and on
:meth:`MirrorStateReporter.report_now`, so that a fleet of mirrors can be seen (Dagster's
``mirror_fleet``). The bucket's TTL removes a mirror that stops publishing.

The values come from the mirror's file (positions, states, verifications: read on a
connection of their own, committed state only) and from what the follower already knows
(its lag). A publish that fails is said once per outage and never stops the mirror. A
mirror that stops on purpose publishes a last value saying so (``stopped_at``:
:meth:`MirrorStateReporter.publish_stopped`), so that the fleet shows it stopped rather than
gone once the TTL removes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import logging
import os
import re
import socket
import sqlite3
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nats.js import JetStreamContext
from nats.js.errors import NoStreamResponseError

from cdc_platform.lsn import format_lsn
from cdc_platform.mirror.consistency import shadow_name
from cdc_platform.mirror.positions import CONSISTENT_TABLE, STATE_TABLE, reading_file
from cdc_platform.mirror.repair import resyncing as resyncing_tables
from cdc_platform.wire import (
    MirrorStateValue,
    MirrorTableState,
    MirrorVerification,
    in_field_order,
    mirror_state_subject,
)

log = logging.getLogger(__name__)

# Written by the mirror's verification (docs/verification.md Part 2, item 3); absent in a
# file no verification has met.
VERIFICATIONS_TABLE = "_cdc_mirror_verifications"
_TOKEN_CHARACTERS = re.compile(r"[^A-Za-z0-9_-]+")
_PUBLISH_TIMEOUT_SECONDS = 5.0


def default_mirror_id(sqlite_path: str | Path) -> str:
    """``{hostname}-{file stem}`` as one subject token (what a subject or a KV key cannot
    hold becomes ``_``)."""
    text = f"{socket.gethostname().split('.')[0]}-{Path(sqlite_path).stem}"
    return _TOKEN_CHARACTERS.sub("_", text)[:64] or "mirror"


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat().replace("+00:00", "Z")


def _lsn_text(value: Any) -> str | None:
    """An LSN as the contract writes it, from the integer or text a file holds."""
    if isinstance(value, int) and not isinstance(value, bool):
        return format_lsn(value) if value > 0 else None
    return str(value) if value else None


def _count(value: Any) -> int:
    """``buckets_differing`` as a number: a count, or a JSON list of the buckets."""
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            parsed = json.loads(value)
            return parsed if isinstance(parsed, int) else len(parsed) if isinstance(
                parsed, list) else 0
    return 0


def _verification(row: Sequence[Any]) -> MirrorVerification:
    verification_id, _, lsn, status, differing, repaired, at = row
    when = (_iso(at) if isinstance(at, (int, float)) and not isinstance(at, bool)
            else str(at) if at else None)
    return MirrorVerification(
        verification_id=str(verification_id), lsn=_lsn_text(lsn), status=str(status),
        buckets_differing=_count(differing),
        rows_repaired=repaired if isinstance(repaired, int) else 0, at=when)


def file_state(path: str | Path, tables: Sequence[str], waiting: Mapping[str, str] | None = None
               ) -> tuple[int | None, dict[str, MirrorTableState]]:
    """(the consistent LSN, each of ``tables`` as the file holds it), read in one read
    transaction on a connection of its own: what the follower committed, nothing open.
    ``waiting``: the tables the follower holds back (table -> why), whatever the file says."""
    with reading_file(path) as db:
        names = [*tables, *(shadow_name(table) for table in tables)]
        states = {row[0]: row[1:] for row in db.execute(
            f"SELECT wire_table, status, snapshot_id, cutover_lsn, applied_commit_lsn, reason "
            f"FROM {STATE_TABLE} WHERE wire_table IN ({', '.join('?' * len(names))})", names)}
        consistent = db.execute(f"SELECT lsn_int FROM {CONSISTENT_TABLE}").fetchone()
        resyncing: set[str] = set()
        with contextlib.suppress(sqlite3.OperationalError):  # (a file an older mirror wrote)
            resyncing = resyncing_tables(db)
        verified: dict[str, MirrorVerification] = {}
        with contextlib.suppress(sqlite3.OperationalError):  # (no verification table yet)
            for row in db.execute(
                    f"SELECT verification_id, wire_table, lsn, status, buckets_differing, "
                    f"rows_repaired, at FROM {VERIFICATIONS_TABLE} WHERE rowid IN "
                    f"(SELECT max(rowid) FROM {VERIFICATIONS_TABLE} GROUP BY wire_table)"):
                verified[row[1]] = _verification(row)
    shown: dict[str, MirrorTableState] = {}
    for table in tables:
        own = states.get(table)
        # a table whose snapshot is loading or catching up in its shadow is bootstrapping
        status, snapshot_id, cutover, applied, reason = own or (
            ("bootstrapping", *states[shadow_name(table)][1:4], None)
            if shadow_name(table) in states else ("bootstrapping", None, 0, 0, None))
        if status == "streaming" and table in resyncing:
            # streaming, its changes made to fit, until a verification after the bridge's
            # lost slot finds it equal (docs/verification.md "Item 6")
            status = "resyncing"
        if waiting and table in waiting:
            status, reason = "waiting", waiting[table]
        shown[table] = MirrorTableState(
            status=status, snapshot_id=snapshot_id, cutover_lsn=_lsn_text(cutover),
            applied_lsn=_lsn_text(applied), last_verification=verified.get(table),
            reason=reason if status in ("stale", "waiting") else None)
    return (consistent[0] if consistent else None), shown


class MirrorStateReporter:
    """Publishes one mirror's :class:`MirrorStateValue` (see the module docstring)."""

    def __init__(self, mirror_id: str, sqlite_path: str | Path, tables: Sequence[str], *,
                 bucket: str, interval_seconds: float,
                 lag_seconds: Callable[[], float],
                 stream_last_lsn: Callable[[JetStreamContext], Awaitable[int | None]],
                 waiting: Mapping[str, str] | None = None) -> None:
        self.mirror_id = mirror_id
        self.path = Path(sqlite_path)
        self.tables = list(tables)
        self.interval_seconds = interval_seconds
        self._lag_seconds = lag_seconds
        self._stream_last_lsn = stream_last_lsn
        self._waiting = waiting  # (the follower's own mapping, read as it is at each report)
        # READERS' import (deploy/nats); a server of one account (the dev stack) has no
        # import, and the bucket's own subject there
        self.subjects = (mirror_state_subject(mirror_id), f"$KV.{bucket}.{mirror_id}")
        self._subject = self.subjects[0]
        # (made by run(), in its loop: report_now() may come from any thread)
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failing = False
        self._stopping = False
        self.started_at = time.time()
        self.published = 0

    def report_now(self) -> None:
        """Publish the state at once (after a verification, a repair): only wakes the
        reporter, so it costs nothing and may be called at any time, from any thread (before
        the reporter runs or after it stopped: nothing to do, it publishes as it starts)."""
        wake, loop = self._wake, self._loop
        if wake is not None and loop is not None:
            with contextlib.suppress(RuntimeError):  # (its loop closed meanwhile)
                loop.call_soon_threadsafe(wake.set)

    async def run(self, js: JetStreamContext) -> None:
        """Publish every ``interval_seconds`` and on :meth:`report_now`, until cancelled."""
        self._wake, self._loop = asyncio.Event(), asyncio.get_running_loop()
        self._stopping = False  # (a Mirror run again reports again)
        try:
            # (not `while True`: Python 3.11's wait_for can swallow a cancellation that comes
            # as its future completes, such as a publish's reply; stop() ends the loop then)
            while not self._stopping:
                self._wake.clear()
                await self.publish_once(js)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.interval_seconds):
                        await self._wake.wait()
        finally:
            self._wake = self._loop = None

    def stop(self) -> None:
        """End :meth:`run` at its next turn (cancel it too, to end it at once)."""
        self._stopping = True
        self.report_now()

    async def publish_stopped(self, js: JetStreamContext) -> None:
        """Publish the last value, saying the mirror stopped on purpose (after :meth:`run`
        ended: nothing publishes after it). Bounded: NATS away must not hold a stop up."""
        try:
            async with asyncio.timeout(_PUBLISH_TIMEOUT_SECONDS):
                await self.publish_once(js, stopped_at=time.time())
        except TimeoutError:
            log.warning("mirror %s: its last state (stopped) was not published within %.0fs",
                        self.mirror_id, _PUBLISH_TIMEOUT_SECONDS)

    async def publish_once(self, js: JetStreamContext, *, stopped_at: float | None = None
                           ) -> None:
        try:
            value = await self.value(js)
            if stopped_at is not None:
                value["stopped_at"] = _iso(stopped_at)
            body = json.dumps(value, separators=(",", ":")).encode()
            await self._publish(js, body)
        except Exception as exc:  # noqa: BLE001 - NATS away, refused, the file busy: said once
            if not self._failing:
                log.warning("mirror %s: publishing its state on %s failed (%s: %s); trying "
                            "again every %.0fs", self.mirror_id, self._subject,
                            type(exc).__name__, exc, self.interval_seconds)
            self._failing = True
            self._subject = self.subjects[0]  # the import first again, once it is there
            return
        if self._failing:
            log.info("mirror %s: its state is published again", self.mirror_id)
        self._failing = False
        self.published += 1

    async def _publish(self, js: JetStreamContext, body: bytes) -> None:
        try:
            await js.publish(self._subject, body, timeout=_PUBLISH_TIMEOUT_SECONDS)
        except NoStreamResponseError:
            # nothing behind this subject: the other one (import or bucket) may be there
            self._subject = next(s for s in self.subjects if s != self._subject)
            await js.publish(self._subject, body, timeout=_PUBLISH_TIMEOUT_SECONDS)

    async def value(self, js: JetStreamContext) -> MirrorStateValue:
        consistent, tables = await asyncio.to_thread(file_state, self.path, self.tables,
                                                     dict(self._waiting or {}))
        last = await self._stream_last_lsn(js)
        return in_field_order(MirrorStateValue, {  # type: ignore[return-value]
            "mirror_id": self.mirror_id, "host": socket.gethostname(), "pid": os.getpid(),
            "version": _version(), "started_at": _iso(self.started_at),
            "updated_at": _iso(time.time()), "consistent_lsn": _lsn_text(consistent),
            "stream_last_lsn": _lsn_text(last),
            "lag_bytes": max(0, last - consistent) if last and consistent else None,
            "lag_seconds": round(self._lag_seconds(), 3), "tables": tables})


def _version() -> str:
    try:
        return importlib.metadata.version("cdc_platform")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
