"""The work of one Spark task: read a block range under the exported snapshot, publish chunks.

A task opens its own connection as the platform role with the session settings the value
converters expect (``SESSION_OPTIONS``, the same as the CDC walsender), imports the snapshot::

    BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY;
    SET TRANSACTION SNAPSHOT '<exported name>';
    SET LOCAL synchronize_seqscans = off;          -- physical order from the range start
    SET LOCAL max_parallel_workers_per_gather = 0; -- one ordered scan, no Gather
    COPY (SELECT <published columns> FROM t WHERE <ctid range>) TO STDOUT

and streams the COPY text straight from libpq (``PQgetCopyData`` non-blocking, every complete
row already received taken in one go) into a :class:`~cdc_platform.snapshot.chunks.Chunker`.
Chunks go to JetStream through the platform's one publisher
(:class:`~cdc_platform.publishing.JetStreamPublisher`) with a few outstanding; the task
returns only after every one was acknowledged, and returns only small statistics to the
driver, never rows.

Errors that a retry cannot fix (a row over ``max_payload``, a value that does not convert) are
returned as statistics with ``error`` set, so Spark does not retry them; anything else raises
and Spark retries the task, which republishes identical chunks (see ``chunks``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import psycopg
from psycopg import sql
from psycopg.pq import ExecStatus
from psycopg.pq.abc import PGconn as PGconnType
from psycopg.pq.abc import PGresult as PGresultType

from cdc_platform.errors import (
    ConversionError,
    PayloadTooLarge,
    PublishError,
    SnapshotError,
    TableLockWaitError,
)
from cdc_platform.jetstream.connection import connect_nats
from cdc_platform.postgres.catalog import CatalogColumn
from cdc_platform.protocol.values import TypeRegistry
from cdc_platform.publishing import JetStreamPublisher, OutgoingMessage
from cdc_platform.publishing.claim_check import ClaimChecks
from cdc_platform.settings import NatsSettings
from cdc_platform.snapshot.buckets import BucketFilter, BucketSelection
from cdc_platform.snapshot.chunks import Chunk, Chunker, ChunkLayout
from cdc_platform.snapshot.copy_out import ENDED, WAIT, read_copy_data
from cdc_platform.snapshot.plan import BlockRange
from cdc_platform.wire import HEADER_MSG_ID, MessageSigner

log = logging.getLogger(__name__)

DEFAULT_PUBLISH_WINDOW = 8  # chunks in flight per task (up to max_payload each)
_BLOCK_BYTES = 512 * 1024  # COPY text handed to the chunker at a time, at most
_MIN_BLOCK_BYTES = 64 * 1024  # ... and at least, unless the COPY has ended
# A task whose chunks get no acknowledgement for this many publish timeouts fails (and Spark
# retries it); the publisher resends meanwhile.
_STALLED_TIMEOUTS = 6

# The in-process runner's stop (tasks.py), set in each of its range tasks' context. Once its
# event is set, a snapshot's task stops before it imports the snapshot, before its next COPY
# block and within STOP_CHECK_SECONDS of a wait for acknowledgements (RangeStopped); a
# verification's task between blocks and in a pause (VerificationError, verify/yielding.py).
# Neither error is seen: the runner raises what ended the job. Spark stops its own tasks (their
# job group is cancelled).
RANGE_STOP: ContextVar[threading.Event | None] = ContextVar("cdc_snapshot_range_stop",
                                                            default=None)
STOP_CHECK_SECONDS = 0.05  # a waiting task sees the stop within this


class RangeStopped(Exception):
    """A range task stopped before the end of its range (``RANGE_STOP``)."""


def raise_if_stopped(what: str) -> None:
    """RangeStopped once the runner's stop (``RANGE_STOP``) is set."""
    stop = RANGE_STOP.get()
    if stop is not None and stop.is_set():
        raise RangeStopped(f"{what}: stopped, its job ended")


class InjectedFault(RuntimeError):
    """Test-only: a task attempt failing on purpose (see :class:`TaskFault`)."""


@dataclass(frozen=True, slots=True)
class TaskFault:
    """Test-only fault injection: the first attempt of ``partition`` fails right after
    ``after_chunks`` of its chunks were acknowledged."""

    partition: int
    after_chunks: int


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """What every task of one snapshot needs. Travels to the executors with the tasks, so it
    holds the connection secrets: run Spark where you would run the platform itself."""

    conninfo: str = field(repr=False)
    nats: NatsSettings
    snapshot_name: str
    select: str  # COPY (SELECT ... WHERE {range}) TO STDOUT, with {range} to fill in
    layout: ChunkLayout
    columns: tuple[CatalogColumn, ...]
    type_rows: tuple[tuple[Any, ...], ...]
    stream: str
    # the Object Store of claim checks (docs/wire-contract.md "Large values")
    large_bucket: str = "cdc_large"
    publish_window: int = DEFAULT_PUBLISH_WINDOW
    publish_timeout: float = 30.0
    fault: TaskFault | None = None
    # How long a task waits for its table's lock (see TableLockWaitError); 0: forever.
    lock_timeout_ms: int = 5_000
    qualified_table: str = ""  # for the LOCK that waits at most lock_timeout_ms
    signing_seed: str | None = field(default=None, repr=False)  # chunks signed with it
    # a repair snapshot whose key PostgreSQL cannot hash: the buckets whose rows the task
    # keeps (when it can, ``select`` selects them already)
    filter_buckets: BucketSelection | None = None

    def copy_command(self, block_range: BlockRange) -> str:
        return self.select.replace("{range}", block_range.predicate().as_string(None))


@dataclass(slots=True)
class RangeStats:
    """What a task returns to the driver."""

    partition: int
    rows: int = 0
    chunks: int = 0
    first_chunk: int | None = None
    bytes_raw: int = 0
    bytes_compressed: int = 0
    splits: int = 0
    duplicates: int = 0  # chunks JetStream already had (a retried attempt)
    seconds: float = 0.0
    attempt: int = 0
    error: str | None = None
    error_kind: str | None = None  # PayloadTooLarge / ConversionError


# -- COPY from libpq --------------------------------------------------------------------------
async def _readable(pgconn: PGconnType) -> None:
    loop = asyncio.get_running_loop()
    future = loop.create_future()
    fileno = pgconn.socket
    def ready() -> None:
        if not future.done():
            future.set_result(None)
    loop.add_reader(fileno, ready)
    try:
        await future
    finally:
        loop.remove_reader(fileno)


def _raise_for(result: PGresultType, what: str) -> None:
    message = (result.error_message or b"").decode(errors="replace").strip()
    raise SnapshotError(f"{what} failed: {message}")


async def copy_blocks(pgconn: PGconnType, command: str, *, block_bytes: int = _BLOCK_BYTES,
                      min_block_bytes: int = _MIN_BLOCK_BYTES) -> AsyncIterator[bytearray]:
    """Run ``COPY ... TO STDOUT`` (text) and yield blocks of complete lines (each ending with
    ``\\n``) of ``min_block_bytes`` to ``block_bytes`` (64 to 512 KiB; the last one may be
    smaller).

    Rows are appended to one ``bytearray`` as they come, every row libpq has received in one
    call (:func:`~cdc_platform.snapshot.copy_out.read_copy_data`; ``PQgetCopyData`` hands
    out one row at a time): joining them later would cost twice as much.
    """
    pgconn.send_query(command.encode())
    while pgconn.flush():
        await asyncio.sleep(0)
    while pgconn.is_busy():
        await _readable(pgconn)
        pgconn.consume_input()
    result = pgconn.get_result()
    if result is None or result.status != ExecStatus.COPY_OUT:
        if result is not None:
            while pgconn.get_result() is not None:
                pass
            _raise_for(result, "COPY")
        raise SnapshotError("COPY returned no result")
    buffer = bytearray()
    while True:
        state = read_copy_data(pgconn, buffer, block_bytes)
        # Hand on a block when it is full, and also when libpq has nothing more right now
        # and the block is worth a call: converting it lets PostgreSQL refill the socket
        # meanwhile, where waiting would leave both sides idle in turn.
        if len(buffer) >= block_bytes or (buffer and (
                state == ENDED or len(buffer) >= min_block_bytes)):
            # PostgreSQL sends one row per CopyData message, but the protocol does not
            # promise it: hand on complete lines only.
            end = buffer.rfind(b"\n") + 1
            if end == len(buffer):
                block, buffer = buffer, bytearray()
                yield block
            elif end:
                block = buffer[:end]
                del buffer[:end]
                yield block
        if state == ENDED:
            break
        if state == WAIT:
            await _readable(pgconn)
    if buffer:
        raise SnapshotError("COPY output ended inside a row")
    while (result := pgconn.get_result()) is not None:
        if result.status != ExecStatus.COMMAND_OK:
            _raise_for(result, "COPY")


# -- publishing --------------------------------------------------------------------------------
async def _outgoing(chunk: Chunk, claim_checks: ClaimChecks,
                    max_payload: int) -> OutgoingMessage:
    """The chunk as the publisher takes it; a one-row chunk over max_payload as its claim
    check: its payload into the object store, and the reference in its place (the chunk's
    headers still describe the object)."""
    headers = dict(chunk.headers)
    msg_id = headers.pop(HEADER_MSG_ID)
    message = OutgoingMessage(chunk.subject, msg_id, chunk.payload, tuple(headers.items()))
    if not chunk.oversized:
        return message
    envelope = {"table": chunk.subject.split(".")[2], "operation": "snapshot",
                "snapshot_id": msg_id.rsplit(":", 1)[0], "chunk": chunk.number}
    return await claim_checks.check_in(message, max_payload, envelope=envelope)


async def _stalled_after(seconds: float, waiting: Awaitable[Any]) -> Any:
    """``waiting``, which waits for acknowledgements; PublishError when none came for
    ``seconds``: the task fails and Spark retries it (the publisher itself would resend for
    ever). In this process, RangeStopped within STOP_CHECK_SECONDS of the runner's stop
    (``RANGE_STOP``): a cancelled run does not wait out a stalled NATS."""
    stop = RANGE_STOP.get()
    acknowledged = asyncio.ensure_future(waiting)
    deadline = time.monotonic() + seconds
    try:
        while not acknowledged.done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise PublishError(f"no chunk acknowledged in {seconds:g} s")
            await asyncio.wait({acknowledged},
                               timeout=left if stop is None else min(left, STOP_CHECK_SECONDS))
            if not acknowledged.done():
                raise_if_stopped("a wait for acknowledgements")
        return acknowledged.result()
    finally:
        if not acknowledged.done():
            acknowledged.cancel()


# -- one task ---------------------------------------------------------------------------------
def _attempt_number() -> int:
    try:
        from pyspark import TaskContext
    except ImportError:  # pragma: no cover - outside Spark
        return 0
    context = TaskContext.get()
    return context.attemptNumber() if context is not None else 0


def converters_for(type_rows: Sequence[tuple[Any, ...]],
                   columns: Sequence[CatalogColumn]) -> list:
    """One ``text -> value`` converter per column, from the catalog rows of their types."""
    registry = TypeRegistry()
    registry.add_catalog_rows(type_rows)
    return registry.for_columns(columns)


@contextlib.contextmanager
def imported_snapshot(conninfo: str, snapshot_name: str, *, qualified_table: str = "",
                      lock_timeout_ms: int = 5_000) -> Iterator[psycopg.Connection]:
    """A task's connection in a read-only transaction of the exported snapshot (see the
    module docstring), holding the table's lock (:func:`_lock_table`); committed when the
    block ends, closed in any case."""
    # not ``with``: leaving a failed COPY must not try a ROLLBACK on a busy connection
    conn = psycopg.connect(conninfo, autocommit=True)
    try:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot_name)))
        conn.execute("SET LOCAL synchronize_seqscans = off")
        conn.execute("SET LOCAL max_parallel_workers_per_gather = 0")
        _lock_table(conn, qualified_table, lock_timeout_ms)
        yield conn
        conn.execute("COMMIT")
    finally:
        conn.close()


async def read_range(spec: TaskSpec, block_range: BlockRange, *, attempt: int = 0) -> RangeStats:
    """Read, convert, chunk and publish one range; see the module docstring."""
    started = time.monotonic()
    stats = RangeStats(block_range.index, attempt=attempt)
    client = await connect_nats(spec.nats, name=f"cdc-snapshot-{block_range.index}")
    publisher = None
    try:
        js = client.jetstream()
        layout = replace(spec.layout, max_payload=min(spec.layout.max_payload,
                                                      client.max_payload))
        converters = converters_for(spec.type_rows, spec.columns)
        chunker = Chunker(layout, converters, block_range.index)
        keep = (BucketFilter(layout, converters, spec.filter_buckets).keep
                if spec.filter_buckets is not None else None)
        publisher = JetStreamPublisher(
            client, stream=spec.stream, max_in_flight_messages=spec.publish_window,
            max_in_flight_bytes=spec.publish_window * client.max_payload,
            ack_timeout=spec.publish_timeout,
            signer=MessageSigner(spec.signing_seed) if spec.signing_seed else None)
        await publisher.start()
        chunks = _ChunkSender(publisher, ClaimChecks(js, spec.large_bucket, layout.format),
                              client.max_payload, spec.publish_timeout * _STALLED_TIMEOUTS,
                              stats)
        fault = spec.fault if (spec.fault and spec.fault.partition == block_range.index
                               and attempt == 0) else None
        raise_if_stopped(f"range {block_range.index}")  # (before it waits for the table)
        with imported_snapshot(spec.conninfo, spec.snapshot_name,
                               qualified_table=spec.qualified_table,
                               lock_timeout_ms=spec.lock_timeout_ms) as conn:
            async for block in copy_blocks(conn.pgconn, spec.copy_command(block_range)):
                raise_if_stopped(f"range {block_range.index}")
                for chunk in chunker.add(block if keep is None else keep(block)):
                    await chunks.send(chunk, fault)
            for chunk in chunker.finish():
                await chunks.send(chunk, fault)
            await chunks.flush()
        stats.rows = chunker.stats.rows
        stats.chunks = chunker.stats.chunks
        stats.bytes_raw = chunker.stats.bytes_raw
        stats.bytes_compressed = chunker.stats.bytes_compressed
        stats.splits = chunker.stats.splits
        stats.duplicates = publisher.stats.duplicates_checked
    except (PayloadTooLarge, ConversionError) as exc:
        stats.error, stats.error_kind = str(exc), type(exc).__name__
    finally:
        if publisher is not None:
            # on success everything is stored already; after a failure, nothing waits for it
            await publisher.close(timeout=0)
        await client.close()
    stats.seconds = time.monotonic() - started
    return stats


class _ChunkSender:
    """A task's chunks into the one publisher (:mod:`cdc_platform.publishing`): in order, up
    to its in-flight window, each resent with the same ``Nats-Msg-Id`` until JetStream
    acknowledges it (a retried task's chunks are duplicates, checked to be the same)."""

    def __init__(self, publisher: JetStreamPublisher, claim_checks: ClaimChecks,
                 max_payload: int, stall_seconds: float, stats: RangeStats) -> None:
        self._publisher = publisher
        self._claim_checks = claim_checks
        self._max_payload = max_payload
        self._stall_seconds = stall_seconds
        self._stats = stats

    async def send(self, chunk: Chunk, fault: TaskFault | None) -> None:
        stats = self._stats
        if stats.first_chunk is None:
            stats.first_chunk = chunk.number
        message = await _outgoing(chunk, self._claim_checks, self._max_payload)
        await _stalled_after(self._stall_seconds, self._publisher.publish([message]))
        # Let the publisher send it now: converting the next chunk keeps the loop busy for a
        # while, and COPY data is nearly always ready, so nothing else would yield to it.
        await asyncio.sleep(0)
        if fault is not None and self._publisher.stats.messages_published >= fault.after_chunks:
            await self.flush()
            raise InjectedFault(f"test fault: partition {fault.partition} fails after "
                                f"{fault.after_chunks} chunks")

    async def flush(self) -> None:
        await _stalled_after(self._stall_seconds, self._publisher.flush())


def _lock_table(conn: psycopg.Connection, qualified_table: str, lock_timeout_ms: int) -> None:
    """Take the table's ACCESS SHARE lock, waiting at most ``lock_timeout_ms``. The driver
    holds the same lock for the whole snapshot; a DDL statement that queued for it in the
    meantime sits in front of this request, and would wait for the snapshot forever while
    the snapshot waits for it."""
    if not qualified_table:
        return
    conn.execute(sql.SQL("SET LOCAL lock_timeout = {}").format(
        sql.Literal(f"{lock_timeout_ms}ms")))
    try:
        conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS SHARE MODE").format(
            sql.SQL(qualified_table)))
    except psycopg.errors.LockNotAvailable:
        raise TableLockWaitError(
            f"{qualified_table}: a lock request (DDL?) is waiting for the table; the "
            "snapshot gives way and is taken again") from None
    conn.execute("SET LOCAL lock_timeout = 0")


def run_partition(spec: TaskSpec, ranges: Iterable[BlockRange]) -> Iterator[dict[str, Any]]:
    """``mapPartitions`` body: one statistics dict per range (one range per partition)."""
    attempt = _attempt_number()
    for block_range in ranges:
        yield asdict(asyncio.run(read_range(spec, block_range, attempt=attempt)))


def range_stats(rows: Sequence[dict[str, Any]]) -> list[RangeStats]:
    return sorted((RangeStats(**row) for row in rows), key=lambda s: s.partition)
