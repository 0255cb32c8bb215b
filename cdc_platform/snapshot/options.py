"""The snapshot's tuning knobs (one place: the driver, the task planner and Dagster read
them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cdc_platform.snapshot import dictionary as dictionaries


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
    # tests only: runs once the bridge's slot was found, just before each watermark is
    # written (where a test replaces the slot, as a bridge replacing a lost one would)
    before_watermark: Callable[[], None] | None = None
