#!/usr/bin/env python
"""Source verification throughput: ``verify_table`` against ``psql COPY ... > /dev/null``
(docs/verification.md Part 2, item 7, the source figure).

    .venv/bin/python benchmarks/verify.py [--rows 1000000] [--cores 2] [--runs 3] [--profile]
                                          [--phases throughput,bridge] [--backlog 50000]
                                          [--mode per-change] [--verify-nice N]

Starts its own PostgreSQL and nats-server (temp dir), the 9-column table of ``snapshot.py``
(its builder) with ``--rows`` rows, a bridge in this process (the digest waits until the
bridge has stored every transaction below its lsn; the table is idle, so the bridge is too),
and measures in the same run, best of ``--runs``:

* the baseline: ``psql -c "COPY (SELECT <same columns>) TO STDOUT" > /dev/null``;
* ``verify_table`` in this process (``--cores`` range tasks in threads) and as a Spark job on
  ``local[--cores]`` (Spark startup excluded): rows/s of the tasks reading and hashing
  (``digest_seconds``) and of the whole verification, and the ratio to COPY (target >= 0.5);
* with ``--profile``: a cProfile of one range task digesting the whole table in this thread
  (where the time goes);
* the ``bridge`` phase: the bridge's catch-up rate over a backlog of ``--backlog`` changes
  to one table (``cdc.py``'s table and measure: ``cdc-platform bridge`` as a subprocess, from
  its slot becoming active to its ``confirmed_flush_lsn`` passing the backlog's end), (a)
  alone and (b) while ``verify_table`` digests the 9-column table in this process, started
  first (the bridge starts once its tasks are reading), with ``local_parallelism`` ``--cores``
  and 1, alternated (a, b, a, b1) ``--runs`` times (with ``--verify-nice N`` also a, b with
  the verification's threads at nice N); prints b/a against the mean of the a runs beside
  it (target >= 0.9), the cores each process used during the catch-up, the machine's busy
  cores (every user's) and how much of the catch-up the verification's tasks covered.

``--phases throughput,bridge`` picks the phases (both by default).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # snapshot.py's and cdc.py's helpers

import cdc
from snapshot import (
    PASSWORD,
    PUBLICATION,
    ROLE,
    TABLE,
    _provision,
    baseline,
    create_table,
    platform_settings,
    spark_session,
    start_servers,
)

from cdc_platform.bridge.runner import CdcBridge
from cdc_platform.postgres.admin import provision_database
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


def in_process(parallelism: int) -> SnapshotOptions:
    """Tasks in this process's threads, ``parallelism`` ranges read at once."""
    return SnapshotOptions(small_table_bytes=1 << 62, local_parallelism=parallelism)


def busy_cores_counter() -> float:
    """Seconds of CPU every process on this machine used so far (all users: the other
    work sharing the machine shows here too)."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0]
              .split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def start_verification(settings: PlatformSettings, parallelism: int, nice: int) -> Future:
    """``verify_table`` of the 9-column table in a thread of its own, in process; ``nice``:
    that thread's nice value, which the task threads it starts inherit (Linux)."""
    def verify() -> VerificationResult:
        if nice:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        return asyncio.run(verify_table(None, settings, TABLE, options=in_process(parallelism)))

    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(verify)
    finally:
        pool.shutdown(wait=False)  # its thread ends with the verification


def verification_reading(admin: psycopg.Connection, running: Future) -> None:
    """Until a task of the verification in ``running`` is reading its table."""
    while not admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = "
            "'cdc_platform_verify' AND state = 'active' AND query LIKE 'COPY%%'",
    ).fetchone()[0]:
        if running.done():
            running.result()  # its error, else it ended before reading: say so
            raise SystemExit("the verification ended before the bridge started")
        time.sleep(0.01)


def bridge_beside_verification(pg, nats, settings: PlatformSettings, args,
                               log: Path) -> None:
    """The bridge's catch-up over ``args.backlog`` changes, alone and beside a running
    verification (module docstring, the bridge phase)."""
    slot = settings.postgres.slot
    cdc.NATS_PID = nats.process.pid if nats.process else None
    # the heartbeat moves the idle slot past a verification's lsn: its wait stays short
    bridge_settings = {"CDC_HEARTBEAT_INTERVAL": "1"}
    runs: list[dict] = []
    next_id = [1]
    with psycopg.connect(pg.superuser_conninfo(), autocommit=True) as admin:
        cdc.create_events_table(admin)
        provision_database(admin, publication=PUBLICATION, role=ROLE,
                           tables=[TABLE, cdc.TABLE], role_password=PASSWORD)
        if admin.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s",
                         (slot,)).fetchone() is None:
            cdc.create_slots(admin, slot)
        # (verification's local_parallelism, its threads' nice value); 0: the bridge alone
        kinds = [(0, 0), (args.cores, 0), (0, 0), (1, 0)]
        if args.verify_nice:
            kinds += [(0, 0), (args.cores, args.verify_nice)]
        for parallelism, nice in [kind for _ in range(args.runs) for kind in kinds]:
            while cdc.slot_state(admin, slot)[0]:  # the last bridge is still leaving
                time.sleep(0.05)
            cdc.insert_rows(admin, next_id[0], args.backlog)
            next_id[0] += args.backlog
            end_lsn = cdc.current_lsn(admin)
            run: dict = {"parallelism": parallelism, "nice": nice}
            verifying = None
            if parallelism:
                verifying = start_verification(settings, parallelism, nice)
                verification_reading(admin, verifying)
            # the machine's busy cores from the bridge's start to its catch-up
            run["busy"], run["started"] = busy_cores_counter(), time.monotonic()

            def caught_up(run=run, verifying=verifying) -> None:
                run["caught_up"] = time.monotonic()
                run["machine"] = (busy_cores_counter() - run["busy"]) / (
                    run["caught_up"] - run["started"])
                if verifying is not None:  # the bridge confirms the verification's lsn
                    run["verification"] = verifying.result()
                    run["verified"] = time.monotonic()

            run["rate"], _, run["cores"] = cdc.run_bridge_catch_up(
                admin, pg, nats, args.mode, slot, end_lsn, args.backlog, log, None,
                env=bridge_settings, also_using={"verify": os.getpid()},
                after_catch_up=caught_up)
            runs.append(run)
            print_bridge_run(run, args.backlog)
    print_bridge_ratios(runs, args)


def kind_label(run: dict) -> str:
    if not run["parallelism"]:
        return "alone"
    return (f"beside verification, parallelism {run['parallelism']}"
            + (f", nice {run['nice']}" if run["nice"] else ""))


def print_bridge_run(run: dict, backlog: int) -> None:
    cores = run["cores"]
    line = (f"  {kind_label(run):44s} {run['rate']:>9,.0f} ev/s | cores bridge "
            f"{cores['bridge']:.2f} walsender {cores['walsender']:.2f} nats "
            f"{cores['nats-server']:.2f} verification (this process) {cores['verify']:.2f}, "
            f"machine busy {run['machine']:.2f}")
    if run["parallelism"]:
        result: VerificationResult = run["verification"]
        # the tasks ended when the verification began waiting for the bridge
        tasks_ended = run["verified"] - result.wait_seconds
        catch_up = backlog / run["rate"]
        covered = min(1.0, max(0.0, (tasks_ended - (run["caught_up"] - catch_up)) / catch_up))
        line += (f" | verification tasks {result.digest_seconds:.2f}s "
                 f"{result.rows_per_second:,.0f} rows/s, covering {covered:.0%} of the catch-up")
    print(line)


def print_bridge_ratios(runs: list[dict], args) -> None:
    """Each b run against the mean of the a runs beside it (the machine's speed drifts)."""
    print(f"\nbridge ({args.mode}, {args.backlog:,} changes) beside a verification of "
          f"{args.rows:,} rows / alone, each against the alone runs beside it (target >= 0.9):")
    by_kind: dict[str, list[float]] = {}
    for index, run in enumerate(runs):
        if run["parallelism"]:
            alone = [runs[i]["rate"] for i in (index - 1, index + 1)
                     if 0 <= i < len(runs) and not runs[i]["parallelism"]]
            by_kind.setdefault(kind_label(run), []).append(run["rate"] / statistics.mean(alone))
    for label, ratios in by_kind.items():
        print(f"  {label}: "
              + ", ".join(f"{ratio:.2f}" for ratio in ratios)
              + f" (median {statistics.median(ratios):.2f})")


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
    parser.add_argument("--phases", default="throughput,bridge",
                        help="comma-separated: throughput (verify_table's rows/s), bridge")
    # small enough that a compiled verification of 1M rows (~3 s) covers the catch-up
    parser.add_argument("--backlog", type=int, default=50_000,
                        help="changes the bridge catches up on in the bridge phase")
    parser.add_argument("--mode", default="per-change", help="the bridge's message mode")
    parser.add_argument("--verify-nice", type=int, default=0,
                        help="bridge phase: also a verification whose threads run at this "
                             "nice value")
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
        phases = args.phases.split(",")
        if "throughput" in phases:
            here = asyncio.run(best_verification(None, settings, in_process(args.cores),
                                                 args.runs))
            report("in-process", here, copy_rate)
            spark, created, warmup = spark_session(args.cores)
            print(f"Spark local[{args.cores}]: session {created:.2f}s, first job "
                  f"{warmup:.2f}s [startup, excluded]")
            try:
                on_spark = asyncio.run(best_verification(
                    spark, settings, SnapshotOptions(small_table_bytes=0), args.runs))
            finally:
                spark.stop()
            report("Spark", on_spark, copy_rate)
        if args.profile:
            profile_task(settings)
        if "bridge" in phases:
            bridge_beside_verification(pg, nats, settings, args, base / "bridge.log")
    finally:
        nats.stop()
        pg.stop("immediate")
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
