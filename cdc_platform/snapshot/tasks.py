"""Where a snapshot's range tasks run and how: a Spark job (``mapPartitions`` over the block
ranges, on the session of :mod:`.spark_session`), or for a small table the same tasks in
threads of this process (step 6 of :mod:`.job`)."""

from __future__ import annotations

import asyncio
import contextvars
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from cdc_platform.errors import (
    ConversionError,
    PayloadTooLarge,
    SnapshotError,
    TableLockWaitError,
)
from cdc_platform.snapshot.options import SnapshotOptions
from cdc_platform.snapshot.plan import BlockRange, plan_ranges, range_count
from cdc_platform.snapshot.reader import RANGE_STOP, RangeStats, RangeStopped, run_partition
from cdc_platform.snapshot.source import SourceTable

JOB_GROUP_PREFIX = "cdc-snapshot-"


def plan_tasks(spark: Any, described: SourceTable,
               options: SnapshotOptions) -> tuple[Any, list[BlockRange]]:
    """Where the tasks run (a SparkSession, or None: here, for a small table) and the block
    ranges they read."""
    if described.blocks * described.block_size <= options.small_table_bytes:
        spark = None  # the same range tasks, here: no Spark job to start
    elif callable(spark) and not hasattr(spark, "sparkContext"):
        spark = spark()
    count = range_count(described.blocks, described.block_size,
                        task_parallelism(spark, options), range_bytes=options.range_bytes,
                        ranges_per_core=options.ranges_per_core)
    return spark, plan_ranges(described.blocks, count)


def task_parallelism(spark: Any, options: SnapshotOptions) -> int:
    """How many range tasks run at once: on ``spark`` (a SparkSession), or (None) here."""
    return options.parallelism or (
        spark.sparkContext.defaultParallelism if spark is not None
        else options.local_parallelism)


# a ``mapPartitions`` body: (the job's spec, the partition's ranges) -> one dict per range
PartitionBody = Callable[[Any, Iterable[BlockRange]], Iterator[dict[str, Any]]]


async def run_tasks(spark: Any, spec: Any, ranges: list[BlockRange],
                    options: SnapshotOptions, snapshot_id: str, wire_table: str, *,
                    body: PartitionBody = run_partition, what: str = "snapshot") -> list:
    """Every range task's result row (``body``'s; a snapshot's: statistics): a Spark job, or
    (``spark`` None) the same tasks in this process. A failure is one :class:`SnapshotError`
    with the task's own line (:class:`TableLockWaitError` when it gave way to DDL); a
    cancellation cancels the job. ``spec`` is ``body``'s (a :class:`TaskSpec` for
    ``run_partition``) and has the ``layout`` (ChunkLayout) of the job's table; ``what`` names
    the job (``snapshot``, ``verification``)."""
    group = f"{JOB_GROUP_PREFIX}{snapshot_id}"
    executor = ThreadPoolExecutor(1, thread_name_prefix="cdc-snapshot-spark")
    try:
        if spark is None:
            return await _run_here(body, spec, ranges, options.local_parallelism)
        return await asyncio.get_running_loop().run_in_executor(
            executor, _run_spark_job, body, spark, spec, ranges, group, what)
    except asyncio.CancelledError:
        if spark is not None:
            spark.sparkContext.cancelJobGroup(group)
        raise
    except Exception as exc:  # Py4J errors: keep the task's line
        failure = (f"{type(exc).__name__}: {exc}" if spark is None
                   else _spark_failure(exc))
        kind = TableLockWaitError if TableLockWaitError.__name__ in failure else SnapshotError
        raise kind(f"{what} {snapshot_id} of {wire_table}: "
                   f"{'tasks' if spark is None else 'Spark job'} failed: {failure}") from exc
    finally:
        executor.shutdown(wait=False)


def _run_spark_job(body: PartitionBody, spark: Any, spec: Any, ranges: list[BlockRange],
                   group: str, what: str) -> list[dict[str, Any]]:
    context = spark.sparkContext
    context.setJobGroup(group, f"{what} of {spec.layout.table} ({spec.layout.snapshot_id})",
                        interruptOnCancel=True)
    rdd = context.parallelize(ranges, len(ranges))
    return rdd.mapPartitions(partial(body, spec)).collect()


async def _run_here(body: PartitionBody, spec: Any, ranges: list[BlockRange],
                    parallelism: int) -> list[dict[str, Any]]:
    """The Spark tasks' work (``body``) in threads of this process, for small tables: the
    same ranges of the same exported snapshot, so the result is the same. Cancelled, or a
    task raised: the tasks still running stop where they look at ``RANGE_STOP`` (reader.py)
    and are waited for, so that nothing of the job is read or published any more once it
    ended (a job taken again never overlaps with the tasks of the attempt before). A second
    cancellation meanwhile does not cut that wait short; it is raised after it."""
    stop = threading.Event()
    loop = asyncio.get_running_loop()
    executor = ThreadPoolExecutor(max(1, parallelism), thread_name_prefix="cdc-snapshot-task")

    def task(block_range: BlockRange) -> list[dict[str, Any]]:
        if stop.is_set():  # (a thread may take the next range before the loop has heard)
            raise RangeStopped(f"range {block_range.index}: not begun, its job ended")
        RANGE_STOP.set(stop)  # (in this task's own copy of the context)
        return list(body(spec, [block_range]))

    futures = [loop.run_in_executor(executor, contextvars.copy_context().run, task, block_range)
               for block_range in ranges]
    try:
        return [row for rows in await asyncio.gather(*futures) for row in rows]
    except BaseException:
        stop.set()
        for future in futures:  # (their results no longer wanted)
            future.cancel()
        stopping = asyncio.ensure_future(
            asyncio.to_thread(executor.shutdown, wait=True, cancel_futures=True))
        cancelled_again = False
        while not stopping.done():
            try:
                await asyncio.shield(stopping)
            except asyncio.CancelledError:
                cancelled_again = True
        if cancelled_again:
            raise asyncio.CancelledError() from None
        raise
    finally:
        executor.shutdown(wait=False)


def _spark_failure(exc: Exception) -> str:
    """The useful line of a Py4J/PySpark error (the Python exception raised in the task)."""
    text = str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception|Fault|Refused|Large):", line):
            return line
    return lines[0] if lines else type(exc).__name__


def raise_task_errors(stats: Sequence[RangeStats], snapshot_id: str) -> None:
    for kind, error in ((PayloadTooLarge, PayloadTooLarge.__name__),
                        (ConversionError, ConversionError.__name__)):
        failed = [s for s in stats if s.error_kind == error]
        if failed:
            raise kind(f"snapshot {snapshot_id}: {failed[0].error}")
    failed = [s for s in stats if s.error]
    if failed:
        raise SnapshotError(f"snapshot {snapshot_id}: {failed[0].error}")
