#!/usr/bin/env python
"""Source verification throughput: ``verify_table`` against ``psql COPY ... > /dev/null``
(docs/verification.md Part 2, item 7, the source figure).

    .venv/bin/python benchmarks/verify.py [--rows 1000000] [--cores 2] [--runs 3] [--profile]
                                          [--phases throughput,bridge] [--backlog 200000]
                                          [--backlog-transactions 200] [--mode per-change]
                                          [--kinds not-yielding,yielding] [--verify-nice N]

Starts its own PostgreSQL and nats-server (temp dir), the 9-column table of ``snapshot.py``
(its builder) with ``--rows`` rows, a bridge in this process (the digest waits until the
bridge has stored every transaction below its lsn; the table is idle, so the bridge is too),
and measures in the same run, ``--runs`` times each, alternated:

* the baseline: ``psql -c "COPY (SELECT <same columns>) TO STDOUT" > /dev/null``, run
  before each verification;
* ``verify_table`` in this process (``--cores`` range tasks in threads) and as a Spark job on
  ``local[--cores]`` (Spark startup excluded): rows/s of the tasks reading and hashing
  (``digest_seconds``) and of the whole verification, and the ratio to the COPY run just
  before it (target >= 0.5): each, their median, and the best against the best;
* with ``--profile``: a cProfile of one range task digesting the whole table in this thread
  (where the time goes);
* the ``bridge`` phase: the bridge's catch-up rate over a backlog of ``--backlog`` changes
  to one table in ``--backlog-transactions`` transactions (the bridge confirms each as it
  stores it, so its lag falls as it catches up; 1: confirmed only at the end)
  (``cdc.py``'s table and measure: ``cdc-platform bridge`` as a subprocess, from
  its slot becoming active to its ``confirmed_flush_lsn`` passing the backlog's end), (a)
  alone and (b) while verifications of the 9-column table run in this process
  (``local_parallelism`` ``--cores``), each started once the one before has read the
  table, from before the bridge starts (once the first one is reading) until it caught up,
  so that one is reading at every moment of the catch-up: (b-) not yielding to the bridge (``CDC_VERIFY_YIELD_LAG=0``, as
  before verifications yielded) and (b+) with the default yielding, alternated
  (a, b-, a, b+) ``--runs`` times (``--kinds`` picks b- and b+; with ``--verify-nice N``
  also a, b- with the verification's threads at nice N), then (c) a verification with the
  bridge idle; prints b/a against the mean of the a runs beside it (target >= 0.9; each,
  median, range), each a against the a runs beside it (the noise floor), the cores each
  process used during the catch-up, the machine's busy cores (every user's) and those of
  other users' processes (the machine's less this benchmark's), each verification's own
  time (whole, its tasks, their yielding), and how long the last one went on after the
  catch-up beside c's whole time. The backlog's WAL must exceed
  ``CDC_VERIFY_YIELD_LAG`` (16 MiB; printed) for b+ to yield.

``--phases throughput,bridge`` picks the phases (both by default).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import resource
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
    psql_copy,
    spark_session,
    start_servers,
)

from cdc_platform.bridge.runner import CdcBridge
from cdc_platform.postgres.admin import provision_database
from cdc_platform.replication.connection import SESSION_OPTIONS
from cdc_platform.settings import BridgeSettings, PlatformSettings, VerifySettings
from cdc_platform.snapshot.options import SnapshotOptions
from cdc_platform.snapshot.plan import BlockRange
from cdc_platform.snapshot.source import describe_table
from cdc_platform.verify import VerificationResult, verify_table
from cdc_platform.verify.tasks import DigestSpec, digest_range
from cdc_platform.wire.digest import MAX_BUCKET_BITS


async def alternated_verifications(spark, settings: PlatformSettings,
                                   options: SnapshotOptions, runs: int, pg, rows: int
                                   ) -> list[tuple[float, VerificationResult]]:
    """``runs`` verifications with a bridge running, each after a ``psql COPY`` of the same
    table (alternated: the shared machine's speed drifts): (the COPY's rows/s, the result)."""
    bridge = CdcBridge(settings)
    bridge_task = asyncio.create_task(bridge.run())
    pairs = []
    postmaster = postmaster_pid(pg)
    try:
        for _ in range(runs):
            server = postgres_cpu_seconds(postmaster)
            psql = resource.getrusage(resource.RUSAGE_CHILDREN)
            copy_seconds = await asyncio.to_thread(psql_copy, pg)
            psql_after = resource.getrusage(resource.RUSAGE_CHILDREN)
            copy_cpu = (postgres_cpu_seconds(postmaster) - server,
                        psql_after.ru_utime + psql_after.ru_stime - psql.ru_utime
                        - psql.ru_stime)
            server, client = postgres_cpu_seconds(postmaster), time.process_time()
            result = await verify_table(spark, settings, TABLE, options=options)
            verify_cpu = (postgres_cpu_seconds(postmaster) - server, time.process_time() - client)
            pairs.append((rows / copy_seconds, result))
            print(f"  CPU seconds, PostgreSQL / client: psql COPY {copy_cpu[0]:.2f} / "
                  f"{copy_cpu[1]:.2f}; verification {verify_cpu[0]:.2f} / "
                  + (f"{verify_cpu[1]:.2f} (this process)" if spark is None
                     else "(Spark's workers, not counted)"))
    finally:
        bridge.request_stop()
        await asyncio.wait_for(bridge_task, 60)
    return pairs



def in_process(parallelism: int) -> SnapshotOptions:
    """Tasks in this process's threads, ``parallelism`` ranges read at once."""
    return SnapshotOptions(small_table_bytes=1 << 62, local_parallelism=parallelism)


def busy_cores_counter() -> float:
    """Seconds of CPU every process on this machine used so far (all users: the other
    work sharing the machine shows here too; not the time the hypervisor stole)."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0]
              .split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:7]) - idle) / os.sysconf("SC_CLK_TCK")


def postmaster_pid(pg) -> int:
    return int((pg.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])


def postgres_cpu_seconds(postmaster: int) -> float:
    """CPU seconds (user + system) PostgreSQL used so far: the postmaster, the backends it
    reaped, its live backends (the walsender, COPY backends)."""
    total = _cpu_of(postmaster, with_reaped=True)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        if int(fields[1]) == postmaster:
            total += _cpu_of(int(stat.parent.name), with_reaped=False)
    return total


def _cpu_of(pid: int, *, with_reaped: bool) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])
    if with_reaped:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / os.sysconf("SC_CLK_TCK")


def insert_backlog(admin: psycopg.Connection, first_id: int, changes: int,
                   transactions: int) -> None:
    """``changes`` inserts into ``cdc.py``'s table in ``transactions`` transactions: the
    bridge confirms each as it stores it, so its lag falls as it catches up."""
    size = -(-changes // transactions)
    for start in range(first_id, first_id + changes, size):
        cdc.insert_rows(admin, start, min(size, first_id + changes - start))


def start_verifications(settings: PlatformSettings, conninfo: str, parallelism: int,
                        nice: int, stop: threading.Event) -> Future:
    """Verifications of the 9-column table in this process, each started as soon as the one
    before has read the table (its exported snapshot's temporary slot is gone; it may still
    wait for the bridge to store its lsn), until ``stop`` is set, so that one is reading at
    every moment: the list of their results. ``nice``: their threads' nice value, which the
    task threads they start inherit (Linux)."""
    def verify() -> VerificationResult:
        if nice:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        return asyncio.run(verify_table(None, settings, TABLE, options=in_process(parallelism)))

    def launch() -> list[VerificationResult]:
        started: list[Future] = []
        with ThreadPoolExecutor(8) as pool, psycopg.connect(conninfo,
                                                             autocommit=True) as watcher:
            while not stop.is_set():
                started.append(pool.submit(verify))
                exported = False
                while not stop.is_set() and not started[-1].done():
                    reading = watcher.execute("SELECT count(*) FROM pg_replication_slots "
                                              "WHERE temporary").fetchone()[0] > 0
                    if exported and not reading:
                        break
                    exported = exported or reading
                    time.sleep(0.1)  # (its queries cost the machine too)
            return [future.result() for future in started]

    launcher = ThreadPoolExecutor(1)
    try:
        return launcher.submit(launch)
    finally:
        launcher.shutdown(wait=False)  # its thread ends with the verifications


def verification_reading(admin: psycopg.Connection, running: Future) -> None:
    """Until a task of a verification of those in ``running`` is reading its table."""
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
    """The bridge's catch-up over ``args.backlog`` changes, alone and beside running
    verifications (module docstring, the bridge phase)."""
    slot = settings.postgres.slot
    cdc.NATS_PID = nats.process.pid if nats.process else None
    # the heartbeat moves the idle slot past a verification's lsn: its wait stays short
    bridge_settings = {"CDC_HEARTBEAT_INTERVAL": "1"}
    not_yielding = settings.model_copy(update={"verify": VerifySettings(yield_lag_bytes=0)})
    runs: list[dict] = []
    alone: list[VerificationResult] = []
    next_id = [1]
    postmaster = postmaster_pid(pg)
    with psycopg.connect(pg.superuser_conninfo(), autocommit=True) as admin:
        cdc.create_events_table(admin)
        provision_database(admin, publication=PUBLICATION, role=ROLE,
                           tables=[TABLE, cdc.TABLE], role_password=PASSWORD)
        if admin.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s",
                         (slot,)).fetchone() is None:
            cdc.create_slots(admin, slot)
        # (verification's threads' nice value, whether it yields); None: the bridge alone
        kinds: list[tuple[int, bool] | None] = []
        for kind in args.kinds.split(","):
            kinds += [None, (0, kind == "yielding")]
        if args.verify_nice:
            kinds += [None, (args.verify_nice, False)]
        for round_ in range(args.runs):
            for kind in kinds:
                while cdc.slot_state(admin, slot)[0]:  # the last bridge is still leaving
                    time.sleep(0.05)
                start_lsn = cdc.current_lsn(admin)
                insert_backlog(admin, next_id[0], args.backlog, args.backlog_transactions)
                next_id[0] += args.backlog
                end_lsn = cdc.current_lsn(admin)
                run: dict = {"kind": kind, "wal": end_lsn - start_lsn}
                stop = threading.Event()
                verifying = None
                if kind is not None:
                    nice, yielding = kind
                    verifying = start_verifications(
                        settings if yielding else not_yielding, pg.superuser_conninfo(),
                        args.cores, nice, stop)
                    verification_reading(admin, verifying)
                # the machine's busy cores from the bridge's start to its catch-up, and
                # those of the processes of others (the VM is shared)
                run["busy"], run["postgres"] = (busy_cores_counter(),
                                                postgres_cpu_seconds(postmaster))
                run["started"] = time.monotonic()

                def caught_up(run=run, verifying=verifying, stop=stop) -> None:
                    run["caught_up"] = time.monotonic()
                    seconds = run["caught_up"] - run["started"]
                    run["machine"] = (busy_cores_counter() - run["busy"]) / seconds
                    run["postgres"] = (postgres_cpu_seconds(postmaster) - run["postgres"]
                                       ) / seconds
                    stop.set()
                    if verifying is not None:  # the bridge confirms the last one's lsn
                        run["verifications"] = verifying.result()
                        run["verified"] = time.monotonic()

                run["rate"], _, run["cores"] = cdc.run_bridge_catch_up(
                    admin, pg, nats, args.mode, slot, end_lsn, args.backlog, log, None,
                    env=bridge_settings, also_using={"verify": os.getpid()},
                    after_catch_up=caught_up)
                cores = run["cores"]
                # what the processes of others used: the machine less this benchmark's
                run["others"] = run["machine"] - run["postgres"] - cores["bridge"] - cores[
                    "nats-server"] - cores["verify"]
                runs.append(run)
                print_bridge_run(run, args.backlog)
            while cdc.slot_state(admin, slot)[0]:
                time.sleep(0.05)
            alone.append(verification_with_idle_bridge(settings, args.cores))
            print(f"  {'verification, the bridge idle':44s} " + verification_times(alone[-1]))
    print_bridge_ratios(runs, alone, args)


def verification_with_idle_bridge(settings: PlatformSettings, cores: int
                                  ) -> VerificationResult:
    """(c): one verification while the bridge (in this process) has nothing to do."""
    async def run() -> VerificationResult:
        bridge = CdcBridge(settings)
        bridge_task = asyncio.create_task(bridge.run())
        try:
            return await verify_table(None, settings, TABLE, options=in_process(cores))
        finally:
            bridge.request_stop()
            await asyncio.wait_for(bridge_task, 60)

    return asyncio.run(run())


def verification_times(result: VerificationResult) -> str:
    return (f"verification {result.duration_seconds:.2f}s, tasks {result.digest_seconds:.2f}s "
            f"(yielding {result.yield_seconds:.2f}s of task time)")


def kind_label(run: dict) -> str:
    if run["kind"] is None:
        return "alone"
    nice, yielding = run["kind"]
    return ("beside verifications, " + ("yielding" if yielding else "not yielding")
            + (f", nice {nice}" if nice else ""))


def print_bridge_run(run: dict, backlog: int) -> None:
    cores = run["cores"]
    line = (f"  {kind_label(run):44s} {run['rate']:>9,.0f} ev/s ({run['wal'] / 1024**2:.0f} MiB"
            f" of WAL) | cores bridge {cores['bridge']:.2f} walsender "
            f"{cores['walsender']:.2f} nats {cores['nats-server']:.2f} verification (this "
            f"process) {cores['verify']:.2f} PostgreSQL but the walsender "
            f"{run['postgres'] - cores['walsender']:.2f}, machine busy {run['machine']:.2f} "
            f"(others' processes {run['others']:.2f})")
    if run["kind"] is not None:
        line += (f" | done {run['verified'] - run['caught_up']:.2f}s after the catch-up: "
                 + "; ".join(map(verification_times, run["verifications"])))
    print(line)


def print_bridge_ratios(runs: list[dict], alone: list[VerificationResult], args) -> None:
    """Each b run against the mean of the a runs beside it (the machine's speed drifts); the
    verifications' own times against c's."""
    print(f"\nbridge ({args.mode}, {args.backlog:,} changes) beside verifications of "
          f"{args.rows:,} rows / alone, each against the alone runs beside it (target >= 0.9):")
    by_kind: dict[str, list[float]] = {}
    after: dict[str, list[float]] = {}
    finished: dict[str, list[int]] = {}
    for index, run in enumerate(runs):
        if run["kind"] is not None:
            beside = [runs[i]["rate"] for i in (index - 1, index + 1)
                      if 0 <= i < len(runs) and runs[i]["kind"] is None]
            by_kind.setdefault(kind_label(run), []).append(
                run["rate"] / statistics.mean(beside))
            after.setdefault(kind_label(run), []).append(run["verified"] - run["caught_up"])
            finished.setdefault(kind_label(run), []).append(len(run["verifications"]))
    for label, ratios in by_kind.items():
        print(f"  {label}: "
              + ", ".join(f"{ratio:.2f}" for ratio in ratios)
              + f" (median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-"
              f"{max(ratios):.2f})")
    # the noise floor: each alone run against the alone runs beside it
    rates = [run["rate"] for run in runs if run["kind"] is None]
    floor = [rate / statistics.mean(rates[max(0, i - 1):i] + rates[i + 1:i + 2])
             for i, rate in enumerate(rates) if len(rates) > 1]
    if floor:
        print("  alone against the alone runs beside it (the noise): "
              + ", ".join(f"{ratio:.2f}" for ratio in floor)
              + f" (median {statistics.median(floor):.2f})")
    print("  others' processes during the runs, cores: "
          + ", ".join(f"{run['others']:.2f}" for run in runs))
    # A digest is published once the bridge stored its lsn, and every verification here
    # began behind the backlog: none ends before the catch-up. What yielding costs is the
    # reading not done meanwhile: how long the last one went on after the catch-up (against
    # a whole verification with the bridge idle), and how many there were.
    print("the last verification done after the catch-up, seconds (a whole one with the "
          "bridge idle: " + ", ".join(f"{result.duration_seconds:.2f}" for result in alone)
          + "), and how many verifications ran:")
    for label, seconds in after.items():
        print(f"  {label}: " + ", ".join(f"{value:.2f}" for value in seconds)
              + " | " + ", ".join(map(str, finished[label])))


def report(label: str, pairs: list[tuple[float, VerificationResult]]) -> None:
    """Each verification against the COPY run just before it, and the best of each."""
    ratios = [result.rows_per_second / copy_rate for copy_rate, result in pairs]
    for copy_rate, result in pairs:
        whole = result.rows_read / result.duration_seconds
        print(f"  {label:11s}: COPY {copy_rate:,.0f} rows/s, tasks "
              f"{result.digest_seconds:.2f}s {result.rows_per_second:,.0f} rows/s, ratio to "
              f"COPY {result.rows_per_second / copy_rate:.2f} | whole verification "
              f"{result.duration_seconds:.2f}s ({whole:,.0f} rows/s; waited "
              f"{result.wait_seconds:.2f}s for the bridge) | {result.partitions} ranges, "
              f"{result.row_count:,} rows at {result.bits} bits")
    best = max(result.rows_per_second for _, result in pairs) / max(
        copy_rate for copy_rate, _ in pairs)
    print(f"  {label:11s}: ratio to the COPY before it {', '.join(f'{r:.2f}' for r in ratios)}"
          f" (median {statistics.median(ratios):.2f}); best / best {best:.2f}")


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
    # its WAL (~170 bytes a change) well over CDC_VERIFY_YIELD_LAG's 16 MiB
    parser.add_argument("--backlog", type=int, default=200_000,
                        help="changes the bridge catches up on in the bridge phase")
    parser.add_argument("--backlog-transactions", type=int, default=200,
                        help="the backlog's transactions (1: one transaction, confirmed "
                             "only at its end)")
    parser.add_argument("--mode", default="per-change", help="the bridge's message mode")
    parser.add_argument("--kinds", default="not-yielding,yielding",
                        help="bridge phase: the verifications beside the bridge, in turn")
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
        copy_seconds, copy_bytes = baseline(pg, 1)
        print(f"{args.rows:,} rows, COPY text {copy_bytes / 1e6:.1f} MB, {os.cpu_count()} CPUs")
        print(f"a first psql COPY > /dev/null: {copy_seconds:.2f}s "
              f"{args.rows / copy_seconds:,.0f} rows/s")
        # an idle slot moves on the bridge's heartbeat: keep the wait for it short
        settings = platform_settings(pg, nats).model_copy(update={"bridge": BridgeSettings(
            http_port=0, heartbeat_interval_seconds=1.0)})
        phases = args.phases.split(",")
        if "throughput" in phases:
            report("in-process", asyncio.run(alternated_verifications(
                None, settings, in_process(args.cores), args.runs, pg, args.rows)))
            spark, created, warmup = spark_session(args.cores)
            print(f"Spark local[{args.cores}]: session {created:.2f}s, first job "
                  f"{warmup:.2f}s [startup, excluded]")
            try:
                report("Spark", asyncio.run(alternated_verifications(
                    spark, settings, SnapshotOptions(small_table_bytes=0), args.runs, pg,
                    args.rows)))
            finally:
                spark.stop()
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
