"""The PostgreSQL side of a snapshot's exact cutover: the watermark and its marker on `CDC`,
the guard lock, and the exported snapshot every task reads (steps 3-5 of :mod:`.job`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator

import psycopg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from psycopg import sql

from cdc_platform.errors import SnapshotError, TableLockWaitError
from cdc_platform.lsn import format_lsn
from cdc_platform.replication.connection import ReplicationConnection
from cdc_platform.settings import PostgresSettings
from cdc_platform.snapshot.source import SourceTable, describe_table
from cdc_platform.wire import WATERMARK_PREFIX


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
