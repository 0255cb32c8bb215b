"""The snapshot driver: one consistent read of a table, many Spark tasks, an exact cutover.
Each step is a function of its own: the table in ``source.py``, watermark, guard and export
in ``export.py``, the tasks in ``tasks.py`` (and ``reader.py``), the meta in ``meta.py``.

``run_snapshot(spark, settings, "sales/orders")`` (or ``await snapshot_table(...)``) does, in
this order:

1. **Validate**: the table must be in the publication (``resolve_published_table``); anything
   else raises :class:`SnapshotRequestRefused` before any watermark, slot or Spark job.
2. **Dictionary** (``encoding.zstd`` and ``encoding.zstd_dictionary``): a zstd dictionary
   trained on a sample of the table, stored in KV ``zstd_dictionaries``
   (``settings.topology.dictionaries``).
3. **Watermark**: once the bridge's slot (``CDC_SLOT``) exists and is not lost (at most
   ``CDC_SLOT_WAIT``, then :class:`SlotMissingError`, nothing published; a stopped bridge's
   slot exists), ``pg_logical_emit_message(true, 'cdc_platform.watermark',
   '{"snapshot_id": ..., "table": ...}')`` in its own transaction; then the slot is read
   again: it must still decode it (``export.slot_will_decode``), else the run is taken
   again under a new id (:class:`WatermarkNotCarried`). The CDC bridge publishes it as a
   marker on ``cdc.cdc-platform.watermark.{snapshot_id}``.
4. **Guard**: a transaction holding ``ACCESS SHARE`` on the table until the end, so no
   ``TRUNCATE``, ``VACUUM FULL``, ``CLUSTER`` or table rewrite (none of them MVCC-safe: an old
   snapshot would see the new, rewritten heap and ctid ranges would no longer match) can run
   while tasks read. Such DDL waits for the snapshot, as it does for ``pg_dump``.
5. **Export**: on a replication connection, ``CREATE_REPLICATION_SLOT <tmp> TEMPORARY LOGICAL
   pgoutput (SNAPSHOT 'export')``. Its ``consistent_point`` is the snapshot ``lsn``: a
   transaction is visible in the snapshot iff its commit record is before it. The connection
   stays open and idle (which keeps the exported snapshot importable) until every task is done;
   closing it drops the temporary slot. Creating the slot waits for every running
   transaction: one whose DDL queued behind the guard (with a transaction id already: it
   wrote before, or on PostgreSQL 18 an ``ADD COLUMN ... DEFAULT``) would wait for it
   forever (PostgreSQL sees no cycle), so the snapshot gives way then, as its tasks do.
6. **Spark**: ctid block ranges (``plan``), one per partition, ``mapPartitions`` reads and
   publishes (``reader``); tasks return statistics only.
7. **Meta** on ``init.meta.{table}`` once every chunk is acknowledged, and once the marker
   is in ``CDC`` or the slot still will decode the watermark (it may have been lost or
   replaced meanwhile: then the run is taken again under a new id, publishing no meta).

A **repair snapshot** (``buckets=(bits, bucket_numbers)``, docs/verification.md Part 2, item
4) is the same job keeping only the rows whose key hash falls in those buckets: selected by
a ``WHERE`` on the key hash when PostgreSQL can compute it (``postgres/key_hash.py``), else by
the tasks after converting the key (``buckets.py``). Its id starts with ``repair-``, its meta
(with ``bits`` and ``buckets``) goes to ``init.repair.{table}``: a full snapshot's
``init.meta.{table}`` is untouched.

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
``js.get_last_msg(cdc_stream, watermark_subject)``. The watermark is written only where the
bridge's slot will decode it (step 3), and the CDC stream must still hold the marker (its
``max_age``).
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import psycopg
from nats.js import JetStreamContext
from psycopg import sql

from cdc_platform.errors import (
    SlotMissingError,
    SnapshotError,
    SnapshotRequestRefused,
    TableLockWaitError,
    WatermarkNotCarried,
)
from cdc_platform.jetstream.connection import connect_nats
from cdc_platform.naming import qualified_name
from cdc_platform.replication.connection import SESSION_OPTIONS
from cdc_platform.settings import (
    DictionaryBucketSettings,
    EncodingSettings,
    PlatformSettings,
)
from cdc_platform.snapshot import dictionary as dictionaries
from cdc_platform.snapshot.buckets import BucketSelection
from cdc_platform.snapshot.export import (
    emit_carried_watermark,
    exported_snapshot,
    take_guard,
    wait_for_marker,
    watermark_carried,
)
from cdc_platform.snapshot.meta import meta_subject, publish_meta, snapshot_meta
from cdc_platform.snapshot.options import SnapshotOptions
from cdc_platform.snapshot.reader import (
    RangeStats,
    TaskFault,
    TaskSpec,
    range_stats,
)
from cdc_platform.snapshot.source import (
    SourceTable,
    chunk_layout,
    copy_select,
    describe_table,
    sample_rows,
    table_converters,
)
from cdc_platform.snapshot.tasks import plan_tasks, raise_task_errors, run_tasks
from cdc_platform.wire import (
    MessageSigner,
    watermark_subject,
)

log = logging.getLogger(__name__)

_SNAPSHOT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
REPAIR_ID_PREFIX = "repair-"
# how many times a run is taken again because its watermark was in no slot's stream (the
# slot replaced as it was written): once is a race, more is something replacing it on purpose
WATERMARK_RETRIES = 2
_T = TypeVar("_T")


def new_snapshot_id() -> str:
    """Sortable and unique: ``20261122T113400Z-1a2b3c4d``."""
    return f"{datetime.now(UTC):%Y%m%dT%H%M%SZ}-{secrets.token_hex(4)}"


def new_repair_id() -> str:
    """A repair snapshot's id says what it is: ``repair-20261122T113400Z-1a2b3c4d``."""
    return REPAIR_ID_PREFIX + new_snapshot_id()


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
    # a repair snapshot's buckets (its meta is on init.repair.{table}); None: a full snapshot
    bits: int | None = None
    buckets: tuple[int, ...] | None = None

    @property
    def compression_ratio(self) -> float:
        return self.bytes_compressed / self.bytes_raw if self.bytes_raw else 1.0


# -- the driver ---------------------------------------------------------------------------------
async def snapshot_table(spark: Any, settings: PlatformSettings, table: str, *,
                         snapshot_id: str | None = None,
                         options: SnapshotOptions | None = None,
                         fault: TaskFault | None = None,
                         buckets: tuple[int, Sequence[int]] | None = None) -> SnapshotResult:
    """Snapshot one published table (wire name) into the INIT stream; see the module doc.

    ``spark``: a SparkSession, a zero-argument callable returning one (called only when the
    table is larger than ``options.small_table_bytes``), or None (always in this process).
    ``buckets``: ``(bits, bucket numbers)`` for a repair snapshot of those buckets only
    (:class:`SnapshotRequestRefused` when they are not buckets at ``bits``).
    ``fault`` is for tests only (a task attempt that fails on purpose). A snapshot that had
    to give way to DDL (:class:`TableLockWaitError`) is taken again under a new id.
    """
    options = options or SnapshotOptions()
    selection = None
    if buckets is not None:
        try:
            selection = BucketSelection.of(*buckets)
        except (ValueError, TypeError) as exc:
            raise SnapshotRequestRefused(f"repair snapshot of {table}: {exc}") from None
    snapshot_id = snapshot_id or (new_snapshot_id() if selection is None else new_repair_id())
    if not _SNAPSHOT_ID.fullmatch(snapshot_id):
        raise SnapshotError(f"snapshot id {snapshot_id!r} must match [A-Za-z0-9_-]{{1,64}}")
    return await taken_again(
        lambda attempt_id: _snapshot_once(spark, settings, table, attempt_id, options, fault,
                                          selection),
        snapshot_id, options.lock_retries, f"snapshot of {table}")


async def taken_again(take: Callable[[str], Awaitable[_T]], first_id: str, retries: int,
                      what: str) -> _T:
    """``take(id)``, taken again under a new id when it gave way to DDL
    (:class:`TableLockWaitError`, up to ``retries`` times) or its watermark is in no slot's
    stream (:class:`WatermarkNotCarried`, up to ``WATERMARK_RETRIES`` times): a new id per
    attempt, so the abandoned one's messages (chunks without a meta, a marker without a
    digest) never mix in."""
    attempt = gave_way = not_carried = 0
    while True:
        attempt_id = first_id if attempt == 0 else f"{first_id[:58]}-r{attempt}"
        try:
            return await take(attempt_id)
        except TableLockWaitError as exc:
            gave_way += 1
            if gave_way > retries:
                raise
            log.warning("%s %s gave way to DDL (%s); taking it again (attempt %d)",
                        what, attempt_id, exc, attempt + 2)
            await asyncio.sleep(min(10.0, 0.5 * gave_way))
        except WatermarkNotCarried as exc:
            not_carried += 1
            if not_carried > WATERMARK_RETRIES:
                raise WatermarkNotCarried(
                    f"{what}: {exc}, {not_carried} times in a row: is something dropping or "
                    "replacing the slot? Given up, publishing no meta or digest") from None
            log.warning("%s %s: %s; taking it again under a new id (attempt %d)",
                        what, attempt_id, exc, attempt + 2)
        attempt += 1


async def _snapshot_once(spark: Any, settings: PlatformSettings, table: str, snapshot_id: str,
                         options: SnapshotOptions, fault: TaskFault | None,
                         selection: BucketSelection | None) -> SnapshotResult:
    started = time.monotonic()
    pg = settings.postgres
    cdc_stream = settings.topology.cdc.name
    conninfo = pg.conninfo(application_name="cdc_platform_snapshot", options=SESSION_OPTIONS)

    try:
        control = psycopg.connect(conninfo, autocommit=True)
    except psycopg.OperationalError as exc:
        raise SnapshotError(f"cannot connect to PostgreSQL {pg.describe()}: {exc}") from exc
    with control:
        # refused (unknown or unpublished table): nothing started yet
        described = describe_table(control, pg.publication, table)
        client = await connect_nats(settings.nats, name=f"cdc-snapshot-{snapshot_id}")
        try:
            js = client.jetstream()
            wire_table = described.schema.wire_name
            signer = settings.bridge.signer()
            # 2. dictionary; none for a repair: training samples the whole table and stores
            # a new KV entry, for a few chunks (a dictionary matters for small messages,
            # hardly for chunks near max_payload)
            trained, dictionary_key = (None, None) if selection else await _dictionary(
                control, js, described, settings.encoding, settings.topology.dictionaries,
                signer, snapshot_id, client.max_payload, options)
            # 3. watermark (where the bridge's slot will carry it); 4. guard
            watermark_lsn = await emit_carried_watermark(
                control, js, cdc_stream, pg.slot, snapshot_id, wire_table,
                wait_seconds=pg.slot_wait_seconds, setting="CDC_SLOT_WAIT",
                error=SlotMissingError, before=options.before_watermark)
            described = take_guard(control, pg.publication, table, described)
            # 5. export
            async with exported_snapshot(pg, control) as (snapshot_name, lsn):
                layout = chunk_layout(described, settings.encoding, snapshot_id, lsn,
                                      client.max_payload, trained,
                                      signed=signer is not None)
                spark, ranges = plan_tasks(spark, described, options)
                in_sql = selection.sql_predicate(described.schema) if selection else None
                spec = TaskSpec(
                    conninfo=conninfo, nats=settings.nats, snapshot_name=snapshot_name,
                    select=copy_select(described.schema, where=in_sql), layout=layout,
                    columns=described.schema.columns, type_rows=described.type_rows,
                    stream=settings.topology.init.name,
                    large_bucket=settings.topology.large.bucket,
                    publish_window=options.publish_window,
                    publish_timeout=options.publish_timeout, fault=fault,
                    lock_timeout_ms=options.lock_timeout_ms,
                    signing_seed=settings.bridge.signing_seed(),
                    filter_buckets=selection if in_sql is None else None,
                    qualified_table=sql.Identifier(
                        described.schema.schema, described.schema.table).as_string(control))
                log.info("snapshot %s of %s: lsn %s, %d blocks in %d ranges", snapshot_id,
                         qualified_name(described.schema.schema, described.schema.table), lsn,
                         described.blocks, len(ranges))
                # 6. the tasks (Spark, or here), while polling for the watermark marker
                job_done = asyncio.Event()
                marker = asyncio.create_task(wait_for_marker(
                    js, cdc_stream, watermark_subject(snapshot_id), job_done,
                    options.watermark_wait_seconds))
                spark_started = time.monotonic()
                try:
                    rows = await run_tasks(spark, spec, ranges, options, snapshot_id,
                                            wire_table)
                except BaseException:
                    marker.cancel()
                    raise
                spark_seconds = time.monotonic() - spark_started
            control.execute("ROLLBACK")  # releases the guard lock

            stats = range_stats(rows)
            job_done.set()
            try:
                raise_task_errors(stats, snapshot_id)
                cdc_start_seq = await marker
            finally:
                marker.cancel()
            if cdc_start_seq is None and not await watermark_carried(
                    control, js, cdc_stream, pg.slot, snapshot_id, watermark_lsn):
                # the slot was lost or replaced since the watermark: no mirror would meet it
                raise WatermarkNotCarried(
                    f"the watermark {snapshot_id} at {watermark_lsn} is in no slot's stream "
                    f"any more: slot {pg.slot} was dropped, lost or replaced before the bridge "
                    "stored its marker")

            # 7. meta
            duration = time.monotonic() - started
            meta = snapshot_meta(
                snapshot_id=snapshot_id, lsn=lsn, watermark_lsn=watermark_lsn,
                cdc_stream=cdc_stream, cdc_start_seq=cdc_start_seq, schema=described.schema,
                stats=stats, partitions=len(ranges), encoding=settings.encoding,
                dictionary_id=trained.dictionary_id if trained else None,
                dictionary_bucket=settings.topology.dictionaries.bucket,
                dictionary_key=dictionary_key, duration=duration, buckets=selection)
            meta_seq = await publish_meta(js, meta, settings.encoding.format, signer,
                                          max_payload=client.max_payload)
        finally:
            await client.close()

    log.info("snapshot %s of %s%s: %d rows in %d chunks, %.1fs (Spark %.1fs), cutover lsn %s, "
             "marker seq %s", snapshot_id, wire_table,
             f" ({len(selection.buckets)} of {1 << selection.bits} buckets, "
             f"{'selected by SQL' if in_sql is not None else 'filtered in the tasks'})"
             if selection else "", meta["row_count"], meta["batch_count"],
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
        meta_subject=meta_subject(meta), meta_seq=meta_seq,
        duration_seconds=duration, spark_seconds=spark_seconds, timestamp=meta["timestamp"],
        sample_ratio_with_dictionary=trained.sample_ratio_with if trained else None,
        sample_ratio_without_dictionary=trained.sample_ratio_without if trained else None,
        ranges=tuple(stats),
        bits=selection.bits if selection else None,
        buckets=selection.buckets if selection else None)


async def _dictionary(control: psycopg.Connection, js: JetStreamContext,
                      described: SourceTable, encoding: EncodingSettings,
                      bucket: DictionaryBucketSettings, signer: MessageSigner | None,
                      snapshot_id: str, max_payload: int, options: SnapshotOptions
                      ) -> tuple[dictionaries.TrainedDictionary | None, str | None]:
    """(the table's trained zstd dictionary, its KV key in ``bucket``), or (None, None) when
    the encoding asks for none or the sample does not train one."""
    if not (encoding.zstd and encoding.zstd_dictionary):
        return None, None
    layout = chunk_layout(described, encoding, snapshot_id, "0/0", max_payload, None,
                          signed=signer is not None)
    sample = await asyncio.to_thread(sample_rows, control, described, layout,
                                     table_converters(described),
                                     options.dictionary_sample_rows)
    trained = await asyncio.to_thread(
        dictionaries.train, sample, encoding.format, level=encoding.zstd_level,
        dictionary_bytes=options.dictionary_bytes, chunk_rows=encoding.chunk_rows)
    if trained is None:
        return None, None
    key = await dictionaries.publish_dictionary(
        js, described.schema.wire_name, trained, bucket=bucket.bucket,
        replicas=bucket.replicas, signer=signer)
    return trained, key


def run_snapshot(spark: Any, settings: PlatformSettings, table: str, *,
                 snapshot_id: str | None = None, options: SnapshotOptions | None = None,
                 fault: TaskFault | None = None,
                 buckets: tuple[int, Sequence[int]] | None = None) -> SnapshotResult:
    """Blocking :func:`snapshot_table` for callers without an event loop (Dagster, CLI)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(snapshot_table(spark, settings, table, snapshot_id=snapshot_id,
                                          options=options, fault=fault, buckets=buckets))
    raise SnapshotError("run_snapshot() called inside an event loop: "
                        "await snapshot_table(...) instead")
