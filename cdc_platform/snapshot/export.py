"""The PostgreSQL side of a snapshot's exact cutover: the watermark and its marker on `CDC`,
the guard lock, and the exported snapshot every task reads (steps 3-5 of :mod:`.job`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable

import psycopg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from psycopg import sql

from cdc_platform.errors import CdcError, SnapshotError, TableLockWaitError, WatermarkNotCarried
from cdc_platform.lsn import format_lsn, parse_lsn
from cdc_platform.replication.connection import ReplicationConnection
from cdc_platform.replication.slots import SlotState, read_slot
from cdc_platform.settings import PostgresSettings
from cdc_platform.snapshot.source import SourceTable, describe_table
from cdc_platform.wire import WATERMARK_PREFIX, watermark_subject

_SLOT_POLL_SECONDS = 0.2


async def wait_for_slot(control: psycopg.Connection, slot: str, wait_seconds: float, *,
                        setting: str, error: type[CdcError]) -> None:
    """Until slot ``slot`` exists and is not lost, at most ``wait_seconds`` (``setting`` names
    where that comes from); ``error`` after that. A watermark written while it does not (the
    bridge not started yet, or replacing a lost slot) is in no slot's stream: its marker
    never reaches `CDC`. A stopped bridge's slot exists: no wait."""
    deadline = time.monotonic() + wait_seconds
    while (state := read_slot(control, slot)) is None or state.lost:
        if time.monotonic() >= deadline:
            raise error(
                f"the bridge is behind: slot {slot} "
                f"{'does not exist' if state is None else 'is lost'} after {wait_seconds:g}s "
                f"({setting}): a watermark would be in no slot's stream; nothing is read or "
                "published. Is the bridge running?")
        await asyncio.sleep(_SLOT_POLL_SECONDS)


def slot_will_decode(state: SlotState | None, lsn: int) -> bool:
    """Whether the slot ``state`` describes will decode a transaction whose record is at
    ``lsn`` (a watermark's message; its commit comes after it).

    Decoding a slot resumes at its ``confirmed_flush_lsn`` (the bridge starts there, and
    PostgreSQL moves any earlier start up to it): a transaction whose commit record starts
    below it is skipped, one at or above it is decoded (a new slot's confirmed_flush_lsn is
    its consistent point: a slot created after the watermark starts past it). Its
    ``restart_lsn`` is only where WAL reading begins (at or below confirmed_flush_lsn, to
    rebuild the snapshot and the transactions in progress), so it decides nothing here as
    long as that WAL is kept: a lost slot (``wal_status`` lost) decodes nothing again.
    Two-phase decoding changes nothing: the watermark commits directly, never prepared."""
    return (state is not None and not state.lost
            and state.confirmed_flush_lsn is not None and state.confirmed_flush_lsn <= lsn)


async def watermark_carried(control: psycopg.Connection, js: JetStreamContext, stream: str,
                            slot: str, mark_id: str, lsn: str) -> bool:
    """Whether the watermark ``mark_id`` written at ``lsn`` is in `CDC` or will be: the slot
    will decode it, or its marker is stored already. The slot is read first: a slot that
    decoded the watermark confirmed past it only once its marker was stored (the bridge
    acknowledges what JetStream stored), so a marker missing after that never comes."""
    if slot_will_decode(read_slot(control, slot), parse_lsn(lsn)):
        return True
    return await marker_seq(js, stream, watermark_subject(mark_id)) is not None


async def emit_carried_watermark(control: psycopg.Connection, js: JetStreamContext,
                                 stream: str, slot: str, mark_id: str, wire_table: str, *,
                                 wait_seconds: float, setting: str, error: type[CdcError],
                                 before: Callable[[], None] | None = None) -> str:
    """Step 3 where a slot's stream carries it: once the slot exists and is not lost
    (:func:`wait_for_slot`), the watermark (:func:`emit_watermark`), then the check that the
    slot still will decode it (it may have been dropped or replaced in between);
    :class:`WatermarkNotCarried` if not (the run is taken again under a new id). Its LSN.
    ``before`` (tests only) runs between the wait and the watermark."""
    await wait_for_slot(control, slot, wait_seconds, setting=setting, error=error)
    if before is not None:
        before()
    lsn = emit_watermark(control, mark_id, wire_table)
    if not await watermark_carried(control, js, stream, slot, mark_id, lsn):
        raise WatermarkNotCarried(
            f"the watermark {mark_id} at {lsn} is in no slot's stream: slot {slot} was "
            "dropped, lost or replaced as it was written")
    return lsn


def emit_watermark(control: psycopg.Connection, snapshot_id: str, wire_table: str) -> str:
    """Step 3: the watermark message, in a transaction of its own (autocommit); its LSN. The
    bridge publishes a marker for it on `CDC`, whose stream sequence the meta names."""
    mark = json.dumps({"snapshot_id": snapshot_id, "table": wire_table})
    row = control.execute("SELECT pg_logical_emit_message(true, %s, %s)::text",
                          (WATERMARK_PREFIX, mark)).fetchone()
    assert row is not None  # (a SELECT of one value)
    return str(row[0])


def take_guard(control: psycopg.Connection, publication: str, table: str,
               described: SourceTable) -> SourceTable:
    """Step 4: ACCESS SHARE on the table until the export is done (``ROLLBACK`` releases
    it), so no DDL changes it under the snapshot; the table described again under the lock."""
    control.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
    control.execute(sql.SQL("LOCK TABLE {} IN ACCESS SHARE MODE").format(
        sql.Identifier(described.schema.schema, described.schema.table)))
    return describe_table(control, publication, table)


@contextlib.asynccontextmanager
async def exported_snapshot(pg: PostgresSettings,
                            guard: psycopg.Connection) -> AsyncIterator[tuple[str, str]]:
    """Step 5: a temporary slot that exports a snapshot: ``(snapshot name, its LSN)`` (the
    slot's consistent point: the cutover). Closing the connection on exit ends the exported
    snapshot and drops the slot. :class:`TableLockWaitError` when the slot waits for a
    transaction that waits for ``guard``'s lock (see :func:`_give_way_to_ddl`)."""
    replication = await ReplicationConnection.connect(
        pg.conninfo(replication=True, application_name="cdc_platform_snapshot"), pg.describe())
    try:
        creating = asyncio.ensure_future(replication.create_logical_slot(
            f"cdc_snap_{secrets.token_hex(8)}", temporary=True, snapshot="export"))
        try:
            await _give_way_to_ddl(creating, guard, replication.backend_pid)
        finally:
            if not creating.done():
                creating.cancel()
                with contextlib.suppress(BaseException):
                    await creating
        created = creating.result()
        if not created.snapshot_name:
            raise SnapshotError("CREATE_REPLICATION_SLOT exported no snapshot")
        yield created.snapshot_name, format_lsn(created.consistent_point)
    finally:
        replication.close()


# whether the slot creation waits, through any chain of waits, for the guard's session
_DEADLOCKED = """WITH RECURSIVE waited(pid) AS (
                     SELECT unnest(pg_blocking_pids(%s))
                     UNION SELECT unnest(pg_blocking_pids(waited.pid)) FROM waited)
                 SELECT pg_backend_pid() IN (SELECT pid FROM waited)"""


async def _give_way_to_ddl(creating: asyncio.Future, guard: psycopg.Connection,
                           walsender_pid: int) -> None:
    """Until the slot is created. Creating it waits for every transaction running; one that
    asked for a lock conflicting with the guard's (ALTER TABLE with a transaction id already)
    waits for the snapshot, which waits for it: PostgreSQL sees no deadlock (one wait is the
    driver's), so it is looked for here, and the snapshot gives way
    (:class:`TableLockWaitError`: taken again once the DDL is through)."""
    while not creating.done():
        await asyncio.wait([creating], timeout=0.25)
        if creating.done():
            return
        row = guard.execute(_DEADLOCKED, (walsender_pid,)).fetchone()
        if row is not None and row[0]:
            with contextlib.suppress(psycopg.Error):  # (gone already: nothing to stop)
                guard.execute("SELECT pg_cancel_backend(%s)", (walsender_pid,))
            raise TableLockWaitError(
                "the exporting slot waits for a transaction that waits for the snapshot's "
                "lock on the table (DDL); the snapshot gives way and is taken again")


async def marker_seq(js: JetStreamContext, stream: str, subject: str) -> int | None:
    try:
        return (await js.get_last_msg(stream, subject)).seq
    except NotFoundError:
        return None


async def wait_for_marker(js: JetStreamContext, stream: str, subject: str,
                          job_done: asyncio.Event, grace: float) -> int | None:
    """Poll for the marker while the job runs and up to ``grace`` seconds after it."""
    deadline: float | None = None
    while True:
        seq = await marker_seq(js, stream, subject)
        if seq is not None:
            return seq
        if job_done.is_set():
            now = time.monotonic()
            deadline = deadline or now + grace
            if now >= deadline:
                return None
        await asyncio.sleep(0.25)
