#!/usr/bin/env python
"""Source verification throughput: ``verify_table`` against ``psql COPY ... > /dev/null``
(docs/verification.md Part 2, item 7, the source figure).

    .venv/bin/python benchmarks/verify.py [--rows 1000000] [--cores 2] [--runs 3] [--profile]

Starts its own PostgreSQL and nats-server (temp dir), the 9-column table of ``snapshot.py``
(its builder) with ``--rows`` rows, a bridge in this process (the digest waits until the
bridge has stored every transaction below its lsn; the table is idle, so the bridge is too),
and measures in the same run, best of ``--runs``:

* the baseline: ``psql -c "COPY (SELECT <same columns>) TO STDOUT" > /dev/null``;
* ``verify_table`` in this process (``--cores`` range tasks in threads) and as a Spark job on
  ``local[--cores]`` (Spark startup excluded): rows/s of the tasks reading and hashing
  (``digest_seconds``) and of the whole verification, and the ratio to COPY (target >= 0.5);
* with ``--profile``: a cProfile of one range task digesting the whole table in this thread
  (where the time goes).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # snapshot.py's table and servers

from snapshot import (
    TABLE,
    _provision,
    baseline,
    create_table,
    platform_settings,
    spark_session,
    start_servers,
)

from cdc_platform.bridge.runner import CdcBridge
from cdc_platform.replication.connection import SESSION_OPTIONS
from cdc_platform.settings import BridgeSettings, PlatformSettings
from cdc_platform.snapshot.options import SnapshotOptions
from cdc_platform.snapshot.plan import BlockRange
from cdc_platform.snapshot.source import describe_table
from cdc_platform.verify import VerificationResult, verify_table
from cdc_platform.verify.tasks import DigestSpec, digest_range
from cdc_platform.wire.digest import MAX_BUCKET_BITS


async def best_verification(spark, settings: PlatformSettings, options: SnapshotOptions,
                            runs: int) -> VerificationResult:
    """The run with the shortest tasks, of ``runs`` verifications with a bridge running."""
    bridge = CdcBridge(settings)
    bridge_task = asyncio.create_task(bridge.run())
    try:
        results = [await verify_table(spark, settings, TABLE, options=options)
                   for _ in range(runs)]
    finally:
        bridge.request_stop()
        await asyncio.wait_for(bridge_task, 60)
    return min(results, key=lambda result: result.digest_seconds)


def report(label: str, result: VerificationResult, copy_rate: float) -> None:
    whole = result.rows_read / result.duration_seconds
    print(f"  {label:11s}: tasks {result.digest_seconds:.2f}s {result.rows_per_second:,.0f} "
          f"rows/s, ratio to COPY {result.rows_per_second / copy_rate:.2f} | whole "
          f"verification {result.duration_seconds:.2f}s ({whole:,.0f} rows/s; waited "
          f"{result.wait_seconds:.2f}s for the bridge) | {result.partitions} ranges, "
          f"{result.row_count:,} rows at {result.bits} bits")


def profile_task(settings: PlatformSettings) -> None:
    """cProfile of one range task digesting the whole table, in this thread."""
    conninfo = settings.postgres.conninfo(options=SESSION_OPTIONS)
    with psycopg.connect(conninfo) as holder:  # holds the snapshot the task imports
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        snapshot_name = holder.execute("SELECT pg_export_snapshot()").fetchone()[0]
        spec = DigestSpec.of(describe_table(holder, settings.postgres.publication, TABLE),
                             conninfo, snapshot_name, MAX_BUCKET_BITS)
        profiler = cProfile.Profile()
        started = time.perf_counter()
        result = profiler.runcall(asyncio.run, digest_range(spec, BlockRange(0, 0, None)))
        seconds = time.perf_counter() - started
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
    print(f"\none range task, this thread, under cProfile: {result['rows'] / seconds:,.0f} "
          "rows/s; by own time:")
    print("\n".join(line for line in out.getvalue().splitlines()[4:] if line.strip()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-verify-"))
    pg, nats = start_servers(base)
    try:
        asyncio.run(_provision(nats))
        create_table(pg, args.rows)
        copy_seconds, copy_bytes = baseline(pg, max(3, args.runs))
        copy_rate = args.rows / copy_seconds
        print(f"{args.rows:,} rows, COPY text {copy_bytes / 1e6:.1f} MB, {os.cpu_count()} CPUs")
        print(f"baseline psql COPY > /dev/null: {copy_seconds:.2f}s {copy_rate:,.0f} rows/s")
        # an idle slot moves on the bridge's heartbeat: keep the wait for it short
        settings = platform_settings(pg, nats).model_copy(update={"bridge": BridgeSettings(
            http_port=0, heartbeat_interval_seconds=1.0)})
        here = asyncio.run(best_verification(None, settings, SnapshotOptions(
            small_table_bytes=1 << 62, local_parallelism=args.cores), args.runs))
        report("in-process", here, copy_rate)
        spark, created, warmup = spark_session(args.cores)
        print(f"Spark local[{args.cores}]: session {created:.2f}s, first job {warmup:.2f}s "
              "[startup, excluded]")
        try:
            on_spark = asyncio.run(best_verification(
                spark, settings, SnapshotOptions(small_table_bytes=0), args.runs))
        finally:
            spark.stop()
        report("Spark", on_spark, copy_rate)
        if args.profile:
            profile_task(settings)
    finally:
        nats.stop()
        pg.stop("immediate")
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
