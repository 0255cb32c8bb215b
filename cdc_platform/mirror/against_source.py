"""``cdc-platform mirror verify --against-source``: ask the platform for a source verification
of each table of a mirror's file (``purpose: verify`` requests) and say what the mirror found
when it met it: ``equal``, ``differ`` (the buckets), ``not_comparable`` (why) or ``repaired``
(docs/verification.md Part 2, item 3).

Only a mirror following the stream can meet a verification: its digest holds at a point of
the stream, and the mirror compares there, in stream order. So this command compares nothing
itself. When a mirror runs on the file (it holds the file's lock, mirror/lock.py), that mirror
meets the verifications, and the command reads their results from the file on read-only
connections (a second writer would fight it for the file). Else the command runs the mirror
itself, the same library on the same file (and then holds the lock), until each verification
is met. A ``differ`` is followed as the mirror's policy says: the command waits for the
buckets to be repaired (``repaired``), or says the table is bootstrapped again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nats.errors import Error as NatsError

from cdc_platform.consumer.requests import SnapshotRequester, SnapshotRequestFailed
from cdc_platform.jetstream.connection import close_nats, connect_nats
from cdc_platform.lsn import parse_lsn
from cdc_platform.mirror import positions
from cdc_platform.mirror.errors import MirrorError
from cdc_platform.mirror.follower import Mirror
from cdc_platform.mirror.lock import MirrorRunning
from cdc_platform.mirror.repair import REPAIR_PREFIX
from cdc_platform.mirror.store import SHADOW_PREFIX
from cdc_platform.mirror.verifications import VERIFICATIONS_TABLE
from cdc_platform.settings import MirrorSettings, PlatformSettings

# how often the file is read for the mirror's results
_POLL_SECONDS = 0.2
_LISTED_BUCKETS = 20  # a line names at most this many differing buckets
MET = ("equal", "differ", "not_comparable", "repaired")

log = logging.getLogger(__name__)


@dataclass
class SourceCheck:
    """One table's verification against the source, as the mirror met it. ``status``: one of
    :data:`MET`, None while (or when, at the end: ``why``) not met; ``settled``: nothing
    more will come of it (a ``differ`` is settled once repaired or given to a bootstrap)."""

    table: str
    verification_id: str
    lsn: str
    status: str | None = None
    bits: int = 0
    buckets: list[int] = field(default_factory=list)
    rows_repaired: int = 0
    why: str | None = None
    settled: bool = False

    def line(self) -> str:
        head = f"{self.table}: "
        tail = f" (verification {self.verification_id} at {self.lsn})"
        if self.status in ("equal", "repaired"):
            repaired = (f"; {len(self.buckets)} of {1 << self.bits} buckets differed and "
                        f"were repaired, {self.rows_repaired} rows replaced"
                        if self.status == "repaired" else "")
            return f"{head}{self.status}{tail}{repaired}"
        if self.status == "differ":
            listed = ", ".join(map(str, self.buckets[:_LISTED_BUCKETS]))
            more = len(self.buckets) - _LISTED_BUCKETS
            return (f"{head}differ{tail}: {len(self.buckets)} of {1 << self.bits} buckets: "
                    f"{listed}{f' and {more} more' if more > 0 else ''}"
                    + (f"; {self.why}" if self.why else ""))
        if self.status == "not_comparable":
            return f"{head}not_comparable{tail}: {self.why}"
        return f"{head}not met{tail}: {self.why}"


def exit_code(checks: Sequence[SourceCheck]) -> int:
    """0: every table equal (or repaired); 1: some differ or are not comparable; 2: some
    verification was not met (an error)."""
    if any(check.status is None for check in checks):
        return 2
    return 0 if all(check.status in ("equal", "repaired") for check in checks) else 1


def mirrored_tables(path: str | Path) -> list[str]:
    """The tables the mirror's file holds (not its shadows)."""
    with positions.reading_file(path) as db:
        return [name for name in positions.table_names(db)
                if not name.startswith((SHADOW_PREFIX, REPAIR_PREFIX))]


async def verify_against_source(settings: PlatformSettings, path: str | Path,
                                tables: Sequence[str] = (), *,
                                options: MirrorSettings | None = None, bits: int | None = None,
                                report: Callable[[str], None] | None = None,
                                stop: asyncio.Event | None = None) -> list[SourceCheck] | None:
    """Each of ``tables`` (default: every table of the file) verified against the source as
    the module docstring says, within ``options.snapshot_wait_seconds``. MirrorError: the
    file is not a mirror's, a table is not in it, a request was refused or failed, or the
    mirror this command runs stopped on an error. None: ``stop`` was set first (a stop
    by the event, not by cancelling: every wait here and in its mirror watches it)."""
    options = options or MirrorSettings()
    held = mirrored_tables(path)
    missing = [table for table in tables if table not in held]
    if missing or not held:
        raise MirrorError(f"not mirrored in {path}: {', '.join(missing) or 'any table'}")
    asked = list(dict.fromkeys(tables)) or held
    stop = stop or asyncio.Event()
    # the mirror of the asked tables of the file, unless one runs (MirrorRunning, at once:
    # then that one meets the verifications); not the file's other tables: one no longer
    # published would stop it with "not published"
    mirroring = asyncio.create_task(Mirror(settings, asked, path, options=options).run(stop))
    nc = None
    try:
        nc = await connect_nats(settings.nats, name="cdc-platform-mirror-verify",
                                inbox_prefix=options.inbox_prefix)
        topology = settings.topology
        requester = SnapshotRequester(
            nc, nc.jetstream(), requests_stream=topology.requests.name,
            init_stream=topology.init.name, max_age_seconds=0.0,
            wait_seconds=options.snapshot_wait_seconds,
            status_interval_seconds=options.status_interval_seconds,
            report=report or (lambda line: None), verifier=options.verifier())
        started = time.monotonic()
        try:
            async with asyncio.TaskGroup() as group:
                asking = [group.create_task(requester.request_verification(
                    table, bits, topology.cdc.name, stop)) for table in asked]
        except* (SnapshotRequestFailed, NatsError, TimeoutError) as failed:
            raise MirrorError("; ".join(f"{exc}" if isinstance(exc, SnapshotRequestFailed)
                                        else f"asking for a verification failed: "
                                        f"{type(exc).__name__}: {exc}"
                                        for exc in failed.exceptions)) from None
        checks = []
        for table, task in zip(asked, asking, strict=True):
            done = task.result()
            if done is None:  # (stopped)
                return None
            checks.append(SourceCheck(table, str(done["verification_id"]), str(done["lsn"])))
        await _until_settled(checks, path, mirroring,
                             started + options.snapshot_wait_seconds, stop)
        return None if stop.is_set() else checks
    finally:
        stop.set()
        # (an error of its own was raised while waiting; MirrorRunning: another one ran;
        # anything else it ended on must not take the place of what is being raised)
        try:
            await mirroring
        except MirrorError:
            pass
        except Exception as exc:  # noqa: BLE001 - said, not raised over the caller's outcome
            log.warning("the mirror this command ran ended on %s: %s", type(exc).__name__, exc)
        if nc is not None:
            await close_nats(nc, 5.0)


async def _until_settled(checks: list[SourceCheck], path: str | Path,
                         mirroring: asyncio.Task, deadline: float, stop: asyncio.Event) -> None:
    """Read the mirror's results from the file until every check is settled, ``deadline``
    (monotonic) passes or ``stop`` is set; the mirror this command runs stopping on an error
    is raised."""
    while not stop.is_set():
        if mirroring.done() and not isinstance(mirroring.exception(), MirrorRunning):
            mirroring.result()  # (raises its error; a mirror of ours never ends by itself)
        unsettled = [check for check in checks if not check.settled]
        if unsettled:
            await asyncio.to_thread(_read_results, path, unsettled)
        if all(check.settled for check in checks):
            return
        if time.monotonic() > deadline:
            for check in checks:
                if check.status is None:
                    check.why = ("not met within the wait (CDC_MIRROR_SNAPSHOT_WAIT): is the "
                                 "mirror of this file following the table, and the bridge "
                                 "running?")
                elif not check.settled:
                    check.why = "not repaired within the wait (CDC_MIRROR_SNAPSHOT_WAIT)"
            return
        await asyncio.sleep(_POLL_SECONDS)


def _read_results(path: str | Path, checks: list[SourceCheck]) -> None:
    """Each check as the file holds it now, in one read transaction."""
    with positions.reading_file(path) as db:
        for check in checks:
            try:
                row = db.execute(
                    f"SELECT status, bits, buckets_differing, why, rows_repaired FROM "
                    f"{VERIFICATIONS_TABLE} WHERE verification_id = ? AND wire_table = ?",
                    (check.verification_id, check.table)).fetchone()
            except sqlite3.OperationalError:  # (no verification met in this file yet)
                row = None
            if row is None:
                continue
            status, check.bits, buckets, check.why, check.rows_repaired = row
            check.status = str(status)
            check.buckets = json.loads(buckets)
            if check.status != "differ":
                check.settled = True
                continue
            state = positions.read_state(db, check.table)
            if state is not None and state.status == "streaming" \
                    and state.cutover_lsn < parse_lsn(check.lsn):
                check.why = "its repair is under way"
                continue
            # too many buckets, no key, or a failed repair: the mirror's policy is a new
            # snapshot (taken at the verification's lsn at least: a cutover there is one)
            bootstrapped = state is not None and state.status == "streaming"
            check.why = (f"the table was bootstrapped again (snapshot {state.snapshot_id})"
                         if bootstrapped and state is not None else
                         "the mirror bootstraps the table again"
                         + (f" ({state.reason})" if state is not None and state.reason else ""))
            check.settled = True
