"""The snapshot driver: one consistent read of a table, many Spark tasks, an exact cutover.

``run_snapshot(spark, settings, "sales/orders")`` (or ``await snapshot_table(...)``) does, in
this order:

1. **Validate**: the table must be in the publication (``resolve_published_table``); anything
   else raises :class:`SnapshotRequestRefused` before any watermark, slot or Spark job.
2. **Dictionary** (``encoding.zstd`` and ``encoding.zstd_dictionary``): a zstd dictionary
   trained on a sample of the table, stored in KV ``zstd_dictionaries``
   (``settings.topology.dictionaries``).
3. **Watermark**: ``pg_logical_emit_message(true, 'cdc_platform.watermark',
   '{"snapshot_id": ..., "table": ...}')`` in its own transaction. The CDC bridge publishes it
   as a marker on ``cdc.cdc-platform.watermark.{snapshot_id}``.
4. **Guard**: a transaction holding ``ACCESS SHARE`` on the table until the end, so no
   ``TRUNCATE``, ``VACUUM FULL``, ``CLUSTER`` or table rewrite (none of them MVCC-safe: an old
   snapshot would see the new, rewritten heap and ctid ranges would no longer match) can run
   while tasks read. Such DDL waits for the snapshot, as it does for ``pg_dump``.
5. **Export**: on a replication connection, ``CREATE_REPLICATION_SLOT <tmp> TEMPORARY LOGICAL
   pgoutput (SNAPSHOT 'export')``. Its ``consistent_point`` is the snapshot ``lsn``: a
   transaction is visible in the snapshot iff its commit record is before it. The connection
   stays open and idle (which keeps the exported snapshot importable) until every task is done;
   closing it drops the temporary slot.
6. **Spark**: ctid block ranges (``plan``), one per partition, ``mapPartitions`` reads and
   publishes (``reader``); tasks return statistics only.
7. **Meta** on ``init.meta.{table}`` once every chunk is acknowledged.

Cutover rule for consumers (also in the meta's ``cutover_rule``)::

    load every chunk of the snapshot (batch_count of them; numbers are not contiguous), then
    read the CDC stream from cdc_start_seq (the watermark marker; any earlier sequence is
    fine too) and apply exactly this table's events with commit_lsn >= lsn, comparing LSNs
    "X/Y" as (X << 32) | Y. Events with commit_lsn < lsn are already in the snapshot.

Why it is exact: the watermark commits before the slot is created, so its commit LSN is below
``lsn`` and the bridge (which publishes in commit order) stores the marker before any event
with ``commit_lsn >= lsn``; PostgreSQL's snapshot builder guarantees that the exported
snapshot sees exactly the transactions whose commit record precedes ``consistent_point``.
``cdc_start_seq`` is null when the bridge had not published the marker within
``watermark_wait_seconds`` (bridge stopped or lagging): look it up later with
``js.get_last_msg(cdc_stream, watermark_subject)``. The bridge must have had its slot before
the watermark was emitted, and the CDC stream must still hold the marker (its ``max_age``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Any

import psycopg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from psycopg import sql

from cdc_platform.errors import (
    ConversionError,
    PayloadTooLarge,
    SnapshotError,
    TableLockWaitError,
)
from cdc_platform.jetstream.connection import connect_nats
from cdc_platform.lsn import format_lsn
from cdc_platform.naming import qualified_name
from cdc_platform.postgres.catalog import TableSchema, resolve_published_table
from cdc_platform.protocol.values import TYPE_CATALOG_QUERY, TypeRegistry
from cdc_platform.replication.connection import SESSION_OPTIONS, ReplicationConnection
from cdc_platform.settings import PlatformSettings, PostgresSettings
from cdc_platform.snapshot import dictionary as dictionaries
from cdc_platform.snapshot.chunks import Chunker, ChunkLayout
from cdc_platform.snapshot.meta import publish_meta, snapshot_meta
from cdc_platform.snapshot.plan import BlockRange, plan_ranges, range_count
from cdc_platform.snapshot.reader import (
    RangeStats,
    TaskFault,
    TaskSpec,
    range_stats,
    run_partition,
)
from cdc_platform.wire import (
    WATERMARK_PREFIX,
    snapshot_meta_subject,
    watermark_subject,
)

log = logging.getLogger(__name__)

_SNAPSHOT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
JOB_GROUP_PREFIX = "cdc-snapshot-"


def new_snapshot_id() -> str:
    """Sortable and unique: ``20261122T113400Z-1a2b3c4d``."""
    return f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{secrets.token_hex(4)}"


@dataclass(frozen=True)
class SnapshotOptions:
    """Tuning knobs; the defaults suit most tables."""

    range_bytes: int = 64 * 1024**2
    ranges_per_core: int = 2
    publish_window: int = 8
    publish_timeout: float = 30.0
    watermark_wait_seconds: float = 10.0  # after the job, how long to wait for the marker
    dictionary_bytes: int = dictionaries.DEFAULT_DICTIONARY_BYTES
    dictionary_sample_rows: int = dictionaries.DEFAULT_SAMPLE_ROWS
    parallelism: int | None = None  # None: spark.sparkContext.defaultParallelism
    # A table up to this size (pg_relation_size) is read by the same range tasks in this
    # process instead of Spark: no JVM or Spark job to start for a small table (seconds).
    small_table_bytes: int = 64 * 1024**2
    local_parallelism: int = 2  # ranges of a small table read at once
    # A task waits this long for its table's lock before the snapshot gives way to a DDL
    # statement queued behind the snapshot's lock, and is taken again (up to lock_retries).
    lock_timeout_ms: int = 5_000
    lock_retries: int = 5


@dataclass(frozen=True)
class SnapshotResult:
    """The figures of a finished snapshot (the meta message holds the same)."""

    snapshot_id: str
    table: str
    lsn: str
    watermark_lsn: str
    watermark_subject: str
    cdc_stream: str
    cdc_start_seq: int | None
    cutover_rule: str
    row_count: int
    batch_count: int
    partitions: int
    bytes_raw: int
    bytes_compressed: int
    format: str
    compression: str | None
    dictionary_id: int | None
    dictionary_key: str | None
    schema_fingerprint: str
    chunk_subject_prefix: str
    meta_subject: str
    meta_seq: int
    duration_seconds: float
    spark_seconds: float  # the Spark job alone (tasks reading and publishing)
    timestamp: int
    sample_ratio_with_dictionary: float | None = None
    sample_ratio_without_dictionary: float | None = None
    ranges: tuple[RangeStats, ...] = field(default=(), repr=False)

    @property
    def compression_ratio(self) -> float:
        return self.bytes_compressed / self.bytes_raw if self.bytes_raw else 1.0


@dataclass(frozen=True)
class _Table:
    schema: TableSchema
    type_rows: tuple[tuple[Any, ...], ...]
    blocks: int
    block_size: int
    estimated_rows: float


# -- catalog ------------------------------------------------------------------------------------
_SIZE_QUERY = """
SELECT current_setting('block_size')::int, c.relkind::text, c.reltuples::float8,
       CASE WHEN c.relkind = 'p' THEN
           (SELECT coalesce(max(pg_relation_size(t.relid)), 0) FROM pg_partition_tree(c.oid) t
            WHERE t.isleaf)
       ELSE pg_relation_size(c.oid) END
FROM pg_class c WHERE c.oid = %s
"""


def _describe(conn: psycopg.Connection, publication: str, table: str) -> _Table:
    schema = resolve_published_table(conn, publication, table)
    registry = TypeRegistry()
    type_rows: list[tuple[Any, ...]] = []
    missing = registry.missing_oids(c.type_oid for c in schema.columns)
    while missing:  # arrays of domains of ...: resolve until nothing more is learned
        rows = [tuple(r) for r in conn.execute(TYPE_CATALOG_QUERY, (list(missing),)).fetchall()]
        registry.add_catalog_rows(rows)
        type_rows += rows
        still = registry.missing_oids(c.type_oid for c in schema.columns)
        if not rows or still == missing:
            break
        missing = still
    sized = conn.execute(_SIZE_QUERY, (schema.relation_id,)).fetchone()
    if sized is None:
        raise SnapshotError(f"{schema.wire_name}: the table went away while it was described")
    block_size, _kind, reltuples, size = sized
    return _Table(schema, tuple(type_rows), size // block_size, block_size, reltuples)


def _select(schema: TableSchema, *, sample: sql.Composable | None = None) -> str:
    """``COPY (SELECT <published columns>[, ctid] FROM t ...) TO STDOUT``. Tasks fill in
    ``{range}``; a sample gets its own clause instead."""
    fields: list[sql.Composable] = [sql.Identifier(c.name) for c in schema.columns]
    if not schema.primary_key:
        fields.append(sql.SQL("ctid"))
    target = sql.Identifier(schema.schema, schema.table)
    if sample is None:
        query = sql.SQL("COPY (SELECT {} FROM {} WHERE {{range}}) TO STDOUT").format(
            sql.SQL(", ").join(fields), target)
    else:
        query = sql.SQL("COPY (SELECT {} FROM {} {}) TO STDOUT").format(
            sql.SQL(", ").join(fields), target, sample)
    return query.as_string(None)


def _layout(table: _Table, settings: PlatformSettings, snapshot_id: str, lsn: str,
            max_payload: int, dictionary: dictionaries.TrainedDictionary | None) -> ChunkLayout:
    schema = table.schema
    encoding = settings.encoding
    names = [c.name for c in schema.columns]
    return ChunkLayout(
        table=schema.wire_name, snapshot_id=snapshot_id, lsn=lsn,
        schema_fingerprint=schema.fingerprint, columns=tuple(names),
        key_columns=tuple(names.index(n) for n in schema.primary_key),
        format=encoding.format, chunk_rows=encoding.chunk_rows, max_payload=max_payload,
        zstd_level=encoding.zstd_level if encoding.zstd else None,
        dictionary=dictionary.data if dictionary else None,
        dictionary_id=dictionary.dictionary_id if dictionary else None)


# -- dictionary ---------------------------------------------------------------------------------
def _sample_rows(conn: psycopg.Connection, table: _Table, layout: ChunkLayout,
                 converters: Sequence, wanted: int) -> list[dict[str, Any]]:
    """Up to ``wanted`` typed rows spread over the table (TABLESAMPLE SYSTEM), else its first
    rows."""
    percent = 100.0
    if table.estimated_rows > 0:
        percent = min(100.0, max(0.001, 100.0 * 2 * wanted / table.estimated_rows))
    clause = sql.SQL("TABLESAMPLE SYSTEM ({}) REPEATABLE (0) LIMIT {}").format(
        sql.Literal(percent), sql.Literal(wanted))
    sampler = Chunker(layout, converters, partition=0)
    rows = sampler.rows(_copy_all(conn, _select(table.schema, sample=clause)))
    if len(rows) < wanted // 4:  # small or never analyzed: its first rows
        rows = sampler.rows(_copy_all(conn, _select(table.schema, sample=sql.SQL(
            "LIMIT {}").format(sql.Literal(wanted)))))
    return rows


def _copy_all(conn: psycopg.Connection, command: str) -> bytes:
    with conn.cursor().copy(command) as copy:
        return b"".join(bytes(block) for block in copy)


# -- the watermark marker ------------------------------------------------------------------------
async def _marker_seq(js: JetStreamContext, stream: str, subject: str) -> int | None:
    try:
        return (await js.get_last_msg(stream, subject)).seq
    except NotFoundError:
        return None


async def _wait_for_marker(js: JetStreamContext, stream: str, subject: str,
                           job_done: asyncio.Event, grace: float) -> int | None:
    """Poll for the marker while the job runs and up to ``grace`` seconds after it."""
    deadline: float | None = None
    while True:
        seq = await _marker_seq(js, stream, subject)
        if seq is not None:
            return seq
        if job_done.is_set():
            now = time.monotonic()
            deadline = deadline or now + grace
            if now >= deadline:
                return None
        await asyncio.sleep(0.25)


# -- Spark ------------------------------------------------------------------------------------------
def _run_spark_job(spark: Any, spec: TaskSpec, ranges: list[BlockRange],
                   group: str) -> list[dict[str, Any]]:
    context = spark.sparkContext
    context.setJobGroup(group, f"INIT snapshot of {spec.layout.table} "
                               f"({spec.layout.snapshot_id})", interruptOnCancel=True)
    rdd = context.parallelize(ranges, len(ranges))
    return rdd.mapPartitions(partial(run_partition, spec)).collect()


async def _run_here(spec: TaskSpec, ranges: list[BlockRange],
                    parallelism: int) -> list[dict[str, Any]]:
    """The Spark tasks' work (``run_partition``) in threads of this process, for small tables:
    the same ranges of the same exported snapshot, so the result is the same."""
    limit = asyncio.Semaphore(max(1, parallelism))

    async def one(block_range: BlockRange) -> list[dict[str, Any]]:
        async with limit:
            return await asyncio.to_thread(lambda: list(run_partition(spec, [block_range])))

    return [row for rows in await asyncio.gather(*map(one, ranges)) for row in rows]


def _spark_failure(exc: Exception) -> str:
    """The useful line of a Py4J/PySpark error (the Python exception raised in the task)."""
    text = str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception|Fault|Refused|Large):", line):
            return line
    return lines[0] if lines else type(exc).__name__


# -- the driver -------------------------------------------------------------------------------------
async def snapshot_table(spark: Any, settings: PlatformSettings, table: str, *,
                         snapshot_id: str | None = None,
                         options: SnapshotOptions | None = None,
                         fault: TaskFault | None = None) -> SnapshotResult:
    """Snapshot one published table (wire name) into the INIT stream; see the module doc.

    ``spark``: a SparkSession, a zero-argument callable returning one (called only when the
    table is larger than ``options.small_table_bytes``), or None (always in this process).
    ``fault`` is for tests only (a task attempt that fails on purpose). A snapshot that had
    to give way to DDL (:class:`TableLockWaitError`) is taken again under a new id.
    """
    options = options or SnapshotOptions()
    snapshot_id = snapshot_id or new_snapshot_id()
    if not _SNAPSHOT_ID.fullmatch(snapshot_id):
        raise SnapshotError(f"snapshot id {snapshot_id!r} must match [A-Za-z0-9_-]{{1,64}}")
    attempt = 0
    while True:
        # a new id per attempt: the abandoned one's chunks (no meta) never mix in
        attempt_id = snapshot_id if attempt == 0 else f"{snapshot_id[:58]}-r{attempt}"
        try:
            return await _snapshot_once(spark, settings, table, attempt_id, options, fault)
        except TableLockWaitError as exc:
            attempt += 1
            if attempt > options.lock_retries:
                raise
            log.warning("snapshot %s of %s gave way to DDL (%s); taking it again (attempt %d)",
                        attempt_id, table, exc, attempt + 1)
            await asyncio.sleep(min(10.0, 0.5 * attempt))


async def _snapshot_once(spark: Any, settings: PlatformSettings, table: str, snapshot_id: str,
                         options: SnapshotOptions, fault: TaskFault | None) -> SnapshotResult:
    started = time.monotonic()
    pg = settings.postgres
    cdc_stream = settings.topology.cdc.name
    conninfo = pg.conninfo(application_name="cdc_platform_snapshot", options=SESSION_OPTIONS)

    try:
        control = psycopg.connect(conninfo, autocommit=True)
    except psycopg.OperationalError as exc:
        raise SnapshotError(f"cannot connect to PostgreSQL {pg.describe()}: {exc}") from exc
    with control:
        described = _describe(control, pg.publication, table)  # refusal: nothing started yet
        client = await connect_nats(settings.nats, name=f"cdc-snapshot-{snapshot_id}")
        try:
            js = client.jetstream()
            wire_table = described.schema.wire_name
            # 2. dictionary
            trained, dictionary_key = await _dictionary(control, js, described, settings,
                                                        snapshot_id, client.max_payload,
                                                        options)
            # 3. watermark; 4. guard
            watermark_lsn = _emit_watermark(control, snapshot_id, wire_table)
            described = _take_guard(control, pg.publication, table, described)
            # 5. export
            async with _exported_snapshot(pg) as (snapshot_name, lsn):
                layout = _layout(described, settings, snapshot_id, lsn, client.max_payload,
                                 trained)
                spark, ranges = _plan(spark, described, options)
                spec = TaskSpec(
                    conninfo=conninfo, nats=settings.nats, snapshot_name=snapshot_name,
                    select=_select(described.schema), layout=layout,
                    columns=described.schema.columns, type_rows=described.type_rows,
                    stream=settings.topology.init.name,
                    large_bucket=settings.topology.large.bucket,
                    publish_window=options.publish_window,
                    publish_timeout=options.publish_timeout, fault=fault,
                    lock_timeout_ms=options.lock_timeout_ms,
                    qualified_table=sql.Identifier(
                        described.schema.schema, described.schema.table).as_string(control))
                log.info("snapshot %s of %s: lsn %s, %d blocks in %d ranges", snapshot_id,
                         qualified_name(described.schema.schema, described.schema.table), lsn,
                         described.blocks, len(ranges))
                # 6. the tasks (Spark, or here), while polling for the watermark marker
                job_done = asyncio.Event()
                marker = asyncio.create_task(_wait_for_marker(
                    js, cdc_stream, watermark_subject(snapshot_id), job_done,
                    options.watermark_wait_seconds))
                spark_started = time.monotonic()
                try:
                    rows = await _run_tasks(spark, spec, ranges, options, snapshot_id,
                                            wire_table)
                except BaseException:
                    marker.cancel()
                    raise
                spark_seconds = time.monotonic() - spark_started
            control.execute("ROLLBACK")  # releases the guard lock

            stats = range_stats(rows)
            job_done.set()
            try:
                _raise_task_errors(stats, snapshot_id)
                cdc_start_seq = await marker
            finally:
                marker.cancel()

            # 7. meta
            duration = time.monotonic() - started
            meta = snapshot_meta(
                snapshot_id=snapshot_id, lsn=lsn, watermark_lsn=watermark_lsn,
                cdc_stream=cdc_stream, cdc_start_seq=cdc_start_seq, schema=described.schema,
                stats=stats, partitions=len(ranges), encoding=settings.encoding,
                dictionary_id=trained.dictionary_id if trained else None,
                dictionary_bucket=settings.topology.dictionaries.bucket,
                dictionary_key=dictionary_key, duration=duration)
            meta_seq = await publish_meta(js, meta, settings.encoding.format)
        finally:
            await client.close()

    log.info("snapshot %s of %s: %d rows in %d chunks, %.1fs (Spark %.1fs), cutover lsn %s, "
             "marker seq %s", snapshot_id, wire_table, meta["row_count"], meta["batch_count"],
             duration, spark_seconds, lsn, cdc_start_seq)
    return SnapshotResult(
        snapshot_id=snapshot_id, table=wire_table, lsn=lsn, watermark_lsn=watermark_lsn,
        watermark_subject=meta["watermark_subject"], cdc_stream=cdc_stream,
        cdc_start_seq=cdc_start_seq, cutover_rule=meta["cutover_rule"],
        row_count=meta["row_count"], batch_count=meta["batch_count"], partitions=len(ranges),
        bytes_raw=meta["bytes_raw"], bytes_compressed=meta["bytes_compressed"],
        format=settings.encoding.format, compression=meta["compression"],
        dictionary_id=meta["dictionary_id"], dictionary_key=dictionary_key,
        schema_fingerprint=described.schema.fingerprint,
        chunk_subject_prefix=meta["chunk_subject_prefix"],
        meta_subject=snapshot_meta_subject(wire_table), meta_seq=meta_seq,
        duration_seconds=duration, spark_seconds=spark_seconds, timestamp=meta["timestamp"],
        sample_ratio_with_dictionary=trained.sample_ratio_with if trained else None,
        sample_ratio_without_dictionary=trained.sample_ratio_without if trained else None,
        ranges=tuple(stats))


def _emit_watermark(control: psycopg.Connection, snapshot_id: str, wire_table: str) -> str:
    """Step 3: the watermark message, in a transaction of its own (autocommit); its LSN. The
    bridge publishes a marker for it on `CDC`, whose stream sequence the meta names."""
    mark = json.dumps({"snapshot_id": snapshot_id, "table": wire_table})
    row = control.execute("SELECT pg_logical_emit_message(true, %s, %s)::text",
                          (WATERMARK_PREFIX, mark)).fetchone()
    assert row is not None  # (a SELECT of one value)
    return str(row[0])


def _take_guard(control: psycopg.Connection, publication: str, table: str,
                described: _Table) -> _Table:
    """Step 4: ACCESS SHARE on the table until the export is done (``ROLLBACK`` releases
    it), so no DDL changes it under the snapshot; the table described again under the lock."""
    control.execute("BEGIN ISOLATION LEVEL READ COMMITTED")
    control.execute(sql.SQL("LOCK TABLE {} IN ACCESS SHARE MODE").format(
        sql.Identifier(described.schema.schema, described.schema.table)))
    return _describe(control, publication, table)


@contextlib.asynccontextmanager
async def _exported_snapshot(pg: PostgresSettings) -> AsyncIterator[tuple[str, str]]:
    """Step 5: a temporary slot that exports a snapshot: ``(snapshot name, its LSN)`` (the
    slot's consistent point: the cutover). Closing the connection on exit ends the exported
    snapshot and drops the slot."""
    replication = await ReplicationConnection.connect(
        pg.conninfo(replication=True, application_name="cdc_platform_snapshot"), pg.describe())
    try:
        created = await replication.create_logical_slot(f"cdc_snap_{secrets.token_hex(8)}",
                                                        temporary=True, snapshot="export")
        if not created.snapshot_name:
            raise SnapshotError("CREATE_REPLICATION_SLOT exported no snapshot")
        yield created.snapshot_name, format_lsn(created.consistent_point)
    finally:
        replication.close()


def _plan(spark: Any, described: _Table,
          options: SnapshotOptions) -> tuple[Any, list[BlockRange]]:
    """Where the tasks run (a SparkSession, or None: here, for a small table) and the block
    ranges they read."""
    if described.blocks * described.block_size <= options.small_table_bytes:
        spark = None  # the same range tasks, here: no Spark job to start
    elif callable(spark) and not hasattr(spark, "sparkContext"):
        spark = spark()
    parallelism = options.parallelism or (
        spark.sparkContext.defaultParallelism if spark is not None
        else options.local_parallelism)
    count = range_count(described.blocks, described.block_size, parallelism,
                        range_bytes=options.range_bytes, ranges_per_core=options.ranges_per_core)
    return spark, plan_ranges(described.blocks, count)


async def _dictionary(control: psycopg.Connection, js: JetStreamContext, described: _Table,
                      settings: PlatformSettings, snapshot_id: str, max_payload: int,
                      options: SnapshotOptions
                      ) -> tuple[dictionaries.TrainedDictionary | None, str | None]:
    """(the table's trained zstd dictionary, its KV key), or (None, None) when the encoding
    asks for none or the sample does not train one."""
    encoding = settings.encoding
    if not (encoding.zstd and encoding.zstd_dictionary):
        return None, None
    layout = _layout(described, settings, snapshot_id, "0/0", max_payload, None)
    sample = await asyncio.to_thread(_sample_rows, control, described, layout,
                                     _converters(described), options.dictionary_sample_rows)
    trained = await asyncio.to_thread(
        dictionaries.train, sample, encoding.format, level=encoding.zstd_level,
        dictionary_bytes=options.dictionary_bytes, chunk_rows=encoding.chunk_rows)
    if trained is None:
        return None, None
    key = await dictionaries.publish_dictionary(
        js, described.schema.wire_name, trained, bucket=settings.topology.dictionaries.bucket,
        replicas=settings.topology.dictionaries.replicas)
    return trained, key


async def _run_tasks(spark: Any, spec: TaskSpec, ranges: list[BlockRange],
                     options: SnapshotOptions, snapshot_id: str, wire_table: str) -> list:
    """Every range task's rows of statistics: a Spark job, or (``spark`` None) the same tasks
    in this process. A failure is one :class:`SnapshotError` with the task's own line
    (:class:`TableLockWaitError` when it gave way to DDL); a cancellation cancels the job."""
    group = f"{JOB_GROUP_PREFIX}{snapshot_id}"
    executor = ThreadPoolExecutor(1, thread_name_prefix="cdc-snapshot-spark")
    try:
        if spark is None:
            return await _run_here(spec, ranges, options.local_parallelism)
        return await asyncio.get_running_loop().run_in_executor(
            executor, _run_spark_job, spark, spec, ranges, group)
    except asyncio.CancelledError:
        if spark is not None:
            spark.sparkContext.cancelJobGroup(group)
        raise
    except Exception as exc:  # Py4J errors: keep the task's line
        failure = (f"{type(exc).__name__}: {exc}" if spark is None
                   else _spark_failure(exc))
        kind = TableLockWaitError if TableLockWaitError.__name__ in failure else SnapshotError
        raise kind(f"snapshot {snapshot_id} of {wire_table}: "
                   f"{'tasks' if spark is None else 'Spark job'} failed: {failure}") from exc
    finally:
        executor.shutdown(wait=False)


def _converters(described: _Table) -> list:
    registry = TypeRegistry()
    registry.add_catalog_rows(described.type_rows)
    return registry.for_columns(described.schema.columns)


def _raise_task_errors(stats: Sequence[RangeStats], snapshot_id: str) -> None:
    for kind, error in ((PayloadTooLarge, PayloadTooLarge.__name__),
                        (ConversionError, ConversionError.__name__)):
        failed = [s for s in stats if s.error_kind == error]
        if failed:
            raise kind(f"snapshot {snapshot_id}: {failed[0].error}")
    failed = [s for s in stats if s.error]
    if failed:
        raise SnapshotError(f"snapshot {snapshot_id}: {failed[0].error}")


def run_snapshot(spark: Any, settings: PlatformSettings, table: str, *,
                 snapshot_id: str | None = None, options: SnapshotOptions | None = None,
                 fault: TaskFault | None = None) -> SnapshotResult:
    """Blocking :func:`snapshot_table` for callers without an event loop (Dagster, CLI)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(snapshot_table(spark, settings, table, snapshot_id=snapshot_id,
                                          options=options, fault=fault))
    raise SnapshotError("run_snapshot() called inside an event loop: "
                        "await snapshot_table(...) instead")
