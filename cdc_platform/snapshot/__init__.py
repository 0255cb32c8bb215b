"""INIT snapshots: one consistent read of a table by many Spark tasks, chunked into the INIT
stream, with an exact cutover to CDC. Start at :mod:`cdc_platform.snapshot.job`."""

from cdc_platform.snapshot.job import (
    SnapshotOptions,
    SnapshotResult,
    new_snapshot_id,
    run_snapshot,
    snapshot_table,
)

__all__ = ["SnapshotOptions", "SnapshotResult", "new_snapshot_id", "run_snapshot",
           "snapshot_table"]
