"""The verification driver: a table's digest at the consistent point of an exported snapshot,
published on ``CDC`` after every transaction it covers (docs/verification.md Part 2, item 2).

``run_verification(spark, settings, "sales/orders")`` (or ``await verify_table(...)``) does, in
this order, the steps of a snapshot (:mod:`cdc_platform.snapshot.job`) where they are the same:

1. **Validate**: the table must be in the publication (``describe_table``); anything else
   raises :class:`SnapshotRequestRefused` before any marker, slot or task.
2. **Verify marker**: once the bridge's slot exists (else no slot decodes the marker: at most
   ``CDC_VERIFY_WAIT``, then :class:`BridgeBehindError`), a snapshot's watermark with the
   verification id (``verify-...``; ``emit_carried_watermark``): the bridge publishes it as a
   watermark marker on ``cdc.cdc-platform.watermark.verify-...``. A marker the slot will not
   decode (the slot replaced as it was written) makes the run be taken again under a new id.
3. **Guard and export**: ACCESS SHARE on the table, then a temporary slot exporting a
   snapshot; its consistent point is the digest's ``lsn``: the digest holds exactly the
   transactions whose commit precedes it. The marker committed before the slot was created,
   so it precedes every transaction with ``commit_lsn >= lsn`` in the stream.
4. **Tasks**: the snapshot's block ranges (Spark above ``small_table_bytes``, threads here
   below), each reading its range under the exported snapshot and digesting the rows
   (:mod:`.tasks`) into ``TableDigest(14)`` (or the asked bits, when finer); the driver sums
   them and folds to ``bucket_bits(row_count)`` (or the asked bits; with ``buckets``, those
   buckets only). The tasks give way to the bridge while it is behind
   (:mod:`.yielding`): ``CDC_VERIFY_MAX_YIELD`` in all, shared out over the waves of
   tasks the cores run one after the other.
5. **Wait for the bridge**: until the slot's ``confirmed_flush_lsn >= lsn`` (the bridge
   confirms only what JetStream stored), at most ``CDC_VERIFY_WAIT``; else
   :class:`BridgeBehindError` and nothing is published.
6. **Digest message** on ``cdc.cdc-platform.verify.{table}.{id}``: stored after step 5, it
   follows every transaction below ``lsn`` in stream order. Only if the verify marker is in
   ``CDC`` by then: the slot that confirmed ``lsn`` stored it first if it decoded it, so a
   marker missing then never comes (the slot was lost or replaced since step 2), and the run
   is taken again under a new id rather than publish a digest no mirror can compare.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from cdc_platform.errors import BridgeBehindError, VerificationError, WatermarkNotCarried
from cdc_platform.jetstream.connection import connect_nats
from cdc_platform.lsn import format_lsn, parse_lsn
from cdc_platform.naming import qualified_name
from cdc_platform.replication.connection import SESSION_OPTIONS
from cdc_platform.replication.slots import read_slot
from cdc_platform.settings import PlatformSettings
from cdc_platform.snapshot.export import (
    emit_carried_watermark,
    exported_snapshot,
    marker_seq,
    take_guard,
)
from cdc_platform.snapshot.job import new_snapshot_id, taken_again
from cdc_platform.snapshot.options import SnapshotOptions
from cdc_platform.snapshot.source import describe_table
from cdc_platform.snapshot.tasks import plan_tasks, run_tasks, task_parallelism
from cdc_platform.verify.message import digest_payload, publish_digest
from cdc_platform.verify.tasks import DigestSpec, digest_partition, summed_digest
from cdc_platform.verify.yielding import YieldPolicy
from cdc_platform.wire import VERIFICATION_ID_PREFIX, verify_digest_subject, watermark_subject
from cdc_platform.wire.digest import MAX_BUCKET_BITS, MAX_HELD_BITS, bucket_bits

log = logging.getLogger(__name__)

# a verification id is a watermark id (the bridge's rule) that starts with "verify-"
_VERIFICATION_ID = re.compile(re.escape(VERIFICATION_ID_PREFIX) + r"[A-Za-z0-9_-]{1,57}")
_BRIDGE_POLL_SECONDS = 0.2


def new_verification_id() -> str:
    """Sortable and unique: ``verify-20261122T113400Z-1a2b3c4d``."""
    return VERIFICATION_ID_PREFIX + new_snapshot_id()


@dataclass(frozen=True)
class VerificationResult:
    """The figures of a published verification (the digest message holds the digest)."""

    verification_id: str
    table: str
    lsn: str  # the digest covers exactly the transactions committed below it
    bits: int
    buckets: tuple[int, ...] | None  # the buckets digested, when asked for some
    row_count: int  # rows in the digest (in ``buckets`` only, when asked for some)
    rows_read: int  # rows the tasks read and hashed (the whole table)
    digest_subject: str
    digest_seq: int
    marker_subject: str
    marker_lsn: str  # where the verify marker was emitted (below ``lsn``)
    schema_fingerprint: str
    partitions: int
    spark: bool  # whether the tasks ran as a Spark job (else in this process)
    duration_seconds: float
    digest_seconds: float  # the tasks alone (reading and hashing, and yielding)
    wait_seconds: float  # waiting for the bridge to store every transaction below lsn
    # the tasks' pauses while the bridge was behind, summed over the tasks (tasks running
    # at once pause at once: the verification took about yield_seconds / parallelism longer)
    yield_seconds: float = 0.0

    @property
    def rows_per_second(self) -> float:
        """Rows read and hashed per second of the tasks."""
        return self.rows_read / self.digest_seconds if self.digest_seconds > 0 else 0.0


def _checked_buckets(bits: int | None, buckets: Sequence[int] | None
                     ) -> tuple[int, ...] | None:
    """``buckets`` sorted, or VerificationError when ``bits``/``buckets`` ask for a digest
    that cannot be made or sent (a whole table at more than MAX_BUCKET_BITS would not fit a
    message)."""
    if bits is not None and not 0 <= bits <= MAX_HELD_BITS:
        raise VerificationError(f"bits must be 0..{MAX_HELD_BITS}, not {bits}")
    if buckets is None:
        if bits is not None and bits > MAX_BUCKET_BITS:
            raise VerificationError(f"a whole table is digested at most at {MAX_BUCKET_BITS} "
                                    f"bits, not {bits}: name the buckets wanted")
        return None
    if bits is None:
        raise VerificationError("buckets need bits")
    chosen = tuple(sorted(set(buckets)))
    if not chosen or len(chosen) > 1 << MAX_BUCKET_BITS or not all(
            0 <= bucket < 1 << bits for bucket in chosen):
        raise VerificationError(f"buckets must be 1..{1 << MAX_BUCKET_BITS} bucket numbers "
                                f"below 2^{bits}")
    return chosen


async def verify_table(spark: Any, settings: PlatformSettings, table: str, *,
                       verification_id: str | None = None, bits: int | None = None,
                       buckets: Sequence[int] | None = None,
                       options: SnapshotOptions | None = None) -> VerificationResult:
    """Verify one published table (wire name); see the module doc.

    ``spark``: a SparkSession, a zero-argument callable returning one (called only when the
    table is larger than ``options.small_table_bytes``), or None (always in this process).
    ``bits``: the digest's buckets (default ``bucket_bits(row_count)``); ``buckets``: only
    these buckets at ``bits``. A verification that had to give way to DDL is made again under
    a new id (``...-r1``).
    """
    options = options or SnapshotOptions()
    verification_id = verification_id or new_verification_id()
    if not _VERIFICATION_ID.fullmatch(verification_id):
        raise VerificationError(f"verification id {verification_id!r} must be "
                                f"{VERIFICATION_ID_PREFIX} and 1-57 of [A-Za-z0-9_-]")
    chosen = _checked_buckets(bits, buckets)
    return await taken_again(
        lambda attempt_id: _verify_once(spark, settings, table, attempt_id, bits, chosen,
                                        options),
        verification_id, options.lock_retries, f"verification of {table}")


async def _verify_once(spark: Any, settings: PlatformSettings, table: str,
                       verification_id: str, bits: int | None,
                       buckets: tuple[int, ...] | None,
                       options: SnapshotOptions) -> VerificationResult:
    started = time.monotonic()
    pg = settings.postgres
    conninfo = pg.conninfo(application_name="cdc_platform_verify", options=SESSION_OPTIONS)
    held_bits = max(MAX_BUCKET_BITS, bits or 0)
    try:
        control = psycopg.connect(conninfo, autocommit=True)
    except psycopg.OperationalError as exc:
        raise VerificationError(f"cannot connect to PostgreSQL {pg.describe()}: {exc}") from exc
    with control:
        # refused (unknown or unpublished table): nothing started yet
        described = describe_table(control, pg.publication, table)
        wire_table = described.schema.wire_name
        client = await connect_nats(settings.nats, name=f"cdc-verify-{verification_id}")
        try:
            # 2. the verify marker (in the stream of the bridge's slot); 3. guard and export
            js = client.jetstream()
            cdc_stream = settings.topology.cdc.name
            marker_lsn = await emit_carried_watermark(
                control, js, cdc_stream, pg.slot, verification_id, wire_table,
                wait_seconds=settings.verify.wait_seconds, setting="CDC_VERIFY_WAIT",
                error=BridgeBehindError, before=options.before_watermark)
            described = take_guard(control, pg.publication, table, described)
            async with exported_snapshot(pg, control) as (snapshot_name, lsn):
                spark, ranges = plan_tasks(spark, described, options)
                spec = DigestSpec.of(described, conninfo, snapshot_name, held_bits,
                                     verification_id=verification_id,
                                     lock_timeout_ms=options.lock_timeout_ms,
                                     yield_policy=yield_policy(settings, spark, options,
                                                               len(ranges)))
                log.info("verification %s of %s: lsn %s, %d blocks in %d ranges%s",
                         verification_id,
                         qualified_name(described.schema.schema, described.schema.table),
                         lsn, described.blocks, len(ranges),
                         " (Spark)" if spark is not None else "")
                # 4. the tasks (in this process, threads which a cancellation does not
                # reach: the runner tells them to stop and waits for them, tasks.py)
                digest_started = time.monotonic()
                results = await run_tasks(spark, spec, ranges, options, verification_id,
                                          wire_table, body=digest_partition,
                                          what="verification")
                digest_seconds = time.monotonic() - digest_started
            control.execute("ROLLBACK")  # releases the guard lock
            digest, rows_read = summed_digest(results, held_bits, verification_id)
            yield_seconds = sum(result["yielded"] for result in results)
            final_bits = bucket_bits(rows_read) if bits is None else bits
            folded = digest.folded(final_bits)
            covered = range(1 << final_bits) if buckets is None else buckets
            totals = [folded.totals[bucket] for bucket in covered]
            counts = [folded.counts[bucket] for bucket in covered]
            # 5. every transaction below lsn stored; 6. the digest after them
            wait_started = time.monotonic()
            await wait_for_bridge(control, pg.slot, lsn, settings.verify.wait_seconds)
            wait_seconds = time.monotonic() - wait_started
            if await marker_seq(js, cdc_stream, watermark_subject(verification_id)) is None:
                raise WatermarkNotCarried(
                    f"the verify marker {verification_id} at {marker_lsn} is not in "
                    f"{cdc_stream} though slot {pg.slot} confirmed {lsn}: the slot was lost or "
                    "replaced after the marker; the digest is not published")
            duration = time.monotonic() - started
            payload = digest_payload(
                verification_id=verification_id, table=wire_table, lsn=lsn,
                schema_fingerprint=described.schema.fingerprint, bits=final_bits,
                totals=totals, counts=counts, buckets=buckets, duration=duration)
            digest_seq = await publish_digest(js, payload, settings.encoding.format,
                                              cdc_stream, settings.bridge.signer(),
                                              max_payload=client.max_payload)
        finally:
            await client.close()

    result = VerificationResult(
        verification_id=verification_id, table=wire_table, lsn=lsn, bits=final_bits,
        buckets=buckets, row_count=payload["row_count"], rows_read=rows_read,
        digest_subject=verify_digest_subject(wire_table, verification_id),
        digest_seq=digest_seq, marker_subject=watermark_subject(verification_id),
        marker_lsn=marker_lsn, schema_fingerprint=described.schema.fingerprint,
        partitions=len(ranges), spark=spark is not None, duration_seconds=duration,
        digest_seconds=digest_seconds, wait_seconds=wait_seconds,
        yield_seconds=yield_seconds)
    log.info("verification %s of %s: %d rows at %d bits, lsn %s, digest seq %d, %.1fs "
             "(tasks %.1fs, %.0f rows/s, yielding %.1fs of task time to the bridge; waited "
             "%.1fs for the bridge)", verification_id, wire_table, result.row_count,
             final_bits, lsn, digest_seq, duration, digest_seconds, result.rows_per_second,
             yield_seconds, wait_seconds)
    return result


def yield_policy(settings: PlatformSettings, spark: Any, options: SnapshotOptions,
                 ranges: int) -> YieldPolicy:
    """How the tasks give way to the bridge: each at most its share of
    ``CDC_VERIFY_MAX_YIELD``, the tasks the cores run one after the other (waves) sharing it,
    so the whole verification pauses about that long at most."""
    waves = math.ceil(ranges / max(1, task_parallelism(spark, options)))
    return YieldPolicy(slot=settings.postgres.slot, lag_bytes=settings.verify.yield_lag_bytes,
                       budget_seconds=settings.verify.max_yield_seconds / waves)


async def wait_for_bridge(control: psycopg.Connection, slot: str, lsn: str,
                          wait_seconds: float) -> None:
    """Until slot ``slot`` confirmed ``lsn`` (the bridge confirms only what JetStream stored:
    every transaction committed below ``lsn`` is in the stream), at most ``wait_seconds``;
    :class:`BridgeBehindError` after that."""
    wanted = parse_lsn(lsn)
    deadline = time.monotonic() + wait_seconds
    while True:
        state = read_slot(control, slot)
        confirmed = state.confirmed_flush_lsn if state is not None else None
        if confirmed is not None and confirmed >= wanted:
            return
        if time.monotonic() >= deadline:
            where = ("does not exist" if state is None else
                     f"has confirmed {format_lsn(confirmed) if confirmed else 'nothing'}")
            raise BridgeBehindError(
                f"the bridge is behind: slot {slot} {where}, below the digest's lsn {lsn}, "
                f"after {wait_seconds:g}s (CDC_VERIFY_WAIT); the digest is not published. "
                "Is the bridge running and keeping up?")
        await asyncio.sleep(_BRIDGE_POLL_SECONDS)


def run_verification(spark: Any, settings: PlatformSettings, table: str, *,
                     verification_id: str | None = None, bits: int | None = None,
                     buckets: Sequence[int] | None = None,
                     options: SnapshotOptions | None = None) -> VerificationResult:
    """Blocking :func:`verify_table` for callers without an event loop (Dagster, CLI)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(verify_table(spark, settings, table,
                                        verification_id=verification_id, bits=bits,
                                        buckets=buckets, options=options))
    raise VerificationError("run_verification() called inside an event loop: "
                            "await verify_table(...) instead")
