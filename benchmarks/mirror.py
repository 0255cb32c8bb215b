#!/usr/bin/env python
"""The mirror's bootstrap and apply rates, each against ``sqlite3`` bulk ``executemany`` of the
same rows into the same schema, measured in the same run.

    .venv/bin/python benchmarks/mirror.py [--rows 1000000] [--events 200000]

Starts its own PostgreSQL and nats-server in a temp dir, a ``--rows``-row table, the bridge
(in this process), and one snapshot (taken here, not timed). Then:

1. bootstrap: ``cdc-platform mirror --once`` in a child process loads the snapshot into a new
   SQLite file; its own progress line gives rows/s, and the child's peak RSS is read from
   ``getrusage``. Baseline: the same rows (as the snapshot decodes them) inserted with one
   ``executemany`` into the same ``CREATE TABLE`` with the mirror's pragmas.
2. apply: ``--events`` changes (half inserts, half updates, ``--tx-size`` per transaction,
   100 by default) are published
   by the bridge; the bridge stops; a mirror in this process applies them (events/s, from the
   first event to the last commit). Baseline: the same number of rows upserted with
   ``executemany`` (``INSERT OR REPLACE``) in one transaction.

3. read ceiling: the same messages read again by the mirror's pull reader alone (nothing
   applied): how fast this machine's nats-server and client deliver them, the bound on apply.
4. digests (``--digest both``, the default): the apply phase runs on two copies of the
   bootstrapped file, without the digests' upkeep and with it (docs/verification.md item 7:
   <= 10 % slower); ``--digest-runs N`` alternates N of each, each on a fresh copy, and
   prints each pair and the medians (one pair swings by tens of percent on a shared
   machine); ``--digest-together N`` also runs N pairs of mirrors at once, one with and
   one without, in two processes (the same moments of the VM for both). Then ``mirror
   verify``'s recompute of the table's digest from the file
   against a plain ``SELECT *`` of the same table through ``sqlite3`` (target >= 0.5x).

Targets (issue 12): bootstrap >= 0.7 x baseline, apply >= 50K events/s, RSS <= 200 MB.

``--profile-bootstrap FILE`` records the bootstrap child with py-spy (collapsed stacks; install
py-spy to use it). Before the compiled chunk loader (``_speedups/store.pyx``), 1M rows:
``executemany`` ~72 % of the bootstrap, its commits ~7 %, decoding chunks ~17 %, reading ~3 %,
so at most ~0.75 of a bare ``executemany``. The loader binds each value straight from the
chunk's bytes and measures 1.7-2.2x ``executemany`` on the same rows alone; this VM's speed
swings the baseline by a third from run to run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import re
import resource
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import psycopg

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cdc_platform.bridge.runner import CdcBridge
from cdc_platform.consumer.snapshots import latest_meta
from cdc_platform.dev.servers import LocalNatsServer, start_logical_postgres
from cdc_platform.jetstream.connection import connect_nats
from cdc_platform.jetstream.provision import provision
from cdc_platform.mirror.columns import TableShape, quote, to_sqlite
from cdc_platform.mirror.follower import Mirror
from cdc_platform.mirror.snapshots import read_chunks
from cdc_platform.mirror.store import MirrorStore
from cdc_platform.mirror.verify import verify_file
from cdc_platform.postgres.admin import provision_database
from cdc_platform.settings import (
    BridgeSettings,
    MirrorSettings,
    NatsSettings,
    NatsTopology,
    PlatformSettings,
    PostgresSettings,
)
from cdc_platform.snapshot import snapshot_table
from cdc_platform.snapshot.job import SnapshotOptions

TABLE = "bench_rows"


def _settings(pg, nats: LocalNatsServer, password: str, mode: str) -> PlatformSettings:
    return PlatformSettings(
        postgres=PostgresSettings(host=pg.host, port=pg.port, database="postgres",
                                  user="bench_reader", password=password,
                                  publication="bench_pub", slot="bench_slot",
                                  sslmode="disable"),
        nats=NatsSettings(url=nats.url),
        bridge=BridgeSettings(http_port=0, status_interval_seconds=0.5,
                              heartbeat_interval_seconds=1.0, message_mode=mode))


async def _bridge_caught_up(conninfo: str) -> None:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        target = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
        while not conn.execute("SELECT confirmed_flush_lsn >= %s FROM pg_replication_slots "
                               "WHERE slot_name = 'bench_slot'", (target,)).fetchone()[0]:
            await asyncio.sleep(0.2)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--profile", action="store_true", help="cProfile the apply phase")
    parser.add_argument("--profile-bootstrap", type=Path,
                        help="py-spy the bootstrap child into this file (collapsed stacks)")
    parser.add_argument("--tx-size", type=int, default=100,
                        help="changes per source transaction in the apply phase")
    parser.add_argument("--mode", choices=["per-change", "batched"], default="per-change",
                        help="the bridge's message mode for the apply phase")
    parser.add_argument("--digest", choices=["on", "off", "both"], default="both",
                        help="apply with the digests' upkeep, without, or both (same run)")
    parser.add_argument("--digest-runs", type=int, default=1,
                        help="apply phases of each kind, alternating (each on a fresh copy "
                             "of the bootstrapped file): the digests' figures are medians")
    parser.add_argument("--digest-together", type=int, default=0, metavar="N",
                        help="also N runs of two mirrors at once, in two processes started "
                             "together, one keeping the digests and one not: the same "
                             "moments of a shared VM for both (see _side_by_side)")
    parser.add_argument("--save-replay", type=Path,
                        help="keep the bootstrapped database and the apply phase's messages "
                             "in this directory, for benchmarks/mirror_replay.py")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cdc-bench-mirror-"))
    pg = start_logical_postgres(work / "pg", unsafe_no_fsync=True)
    nats = LocalNatsServer(work / "nats")
    nats.start()
    try:
        await _run(args, work, pg, nats)
    finally:
        nats.stop()
        pg.stop("immediate")
        shutil.rmtree(work, ignore_errors=True)  # (~0.7 GB a run with the defaults)


async def _run(args, work: Path, pg, nats: LocalNatsServer) -> None:
    admin_conninfo = pg.superuser_conninfo()
    password = "bench-password"
    with psycopg.connect(admin_conninfo, autocommit=True) as admin:
        admin.execute(f"CREATE TABLE {TABLE} (id bigint PRIMARY KEY, n int, name text, "
                      "amount numeric(12,2), at timestamptz, score float8, flag bool)")
        admin.execute(f"INSERT INTO {TABLE} SELECT g, g % 1000, 'name ' || g, g / 100.0, "
                      "timestamptz '2026-01-01' + g * interval '1 second', g / 7.0, g % 2 = 0 "
                      f"FROM generate_series(1, {args.rows}) g")
        admin.execute(f"VACUUM ANALYZE {TABLE}")
        provision_database(admin, publication="bench_pub", role="bench_reader",
                           tables=[TABLE], role_password=password)
    client = await connect_nats(NatsSettings(url=nats.url))
    await provision(client.jetstream(), NatsTopology())
    settings = _settings(pg, nats, password, args.mode)
    bridge = CdcBridge(settings)
    bridging = asyncio.create_task(bridge.run())
    try:
        await _measure(args, work, settings, bridge, bridging, client, admin_conninfo)
    finally:
        bridge.request_stop()
        await asyncio.wait_for(asyncio.shield(bridging), 30)
        await client.close()


async def _measure(args, work: Path, settings: PlatformSettings, bridge: CdcBridge, bridging,
                   client, admin_conninfo: str) -> None:
    nats_url = settings.nats.url.get_secret_value()
    while bridge.reader is None or not bridge.metrics.value(bridge.metrics.connected):
        await asyncio.sleep(0.1)
    print(f"snapshot of {args.rows:,} rows (not timed) ...", flush=True)
    await snapshot_table(None, settings, TABLE,
                         options=SnapshotOptions(small_table_bytes=1 << 40))

    # 1. bootstrap, in a child process (its peak RSS is the mirror's)
    db = work / "mirror.db"
    env = {**os.environ, "CDC_NATS_URL": nats_url, "CDC_MIRROR_STATUS_INTERVAL": "1000s"}
    command = [str(Path(sys.executable).parent / "cdc-platform"), "mirror", "--tables", TABLE,
               "--sqlite", str(db), "--once"]
    if args.profile_bootstrap:  # py-spy (not a dependency: install it to use this)
        command = ["py-spy", "record", "--format", "raw", "--rate", "250", "--output",
                   str(args.profile_bootstrap), "--", *command]
    started = time.perf_counter()
    child = await asyncio.to_thread(subprocess.run, command, env=env, capture_output=True,
                                    text=True)
    wall = time.perf_counter() - started
    if child.returncode != 0:
        raise SystemExit(child.stdout + child.stderr)
    rss_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    done_line = next(line for line in child.stdout.splitlines() if "; done (" in line)
    mirror_rate = float(re.search(r"([\d,]+) rows/s", done_line).group(1).replace(",", ""))

    js = client.jetstream()
    meta = await latest_meta(js, TABLE)
    shape = TableShape.from_schema(meta.table_schema)
    if args.profile:  # the bootstrap's work, in this process, under cProfile
        import cProfile
        import pstats

        store = MirrorStore(work / "profiled.db")
        store.begin_bootstrap(shape, meta.snapshot_id, meta.lsn)
        profiler = cProfile.Profile()
        profiler.enable()
        columns = tuple(c.name for c in shape.columns)
        with store.chunk_loader(TABLE, columns) as load:
            async for chunk in read_chunks(js, meta, columns=columns, load=load):
                if chunk.loaded is not None:
                    pass
                elif chunk.as_tuples:
                    store.load_tuples(TABLE, columns, chunk.rows, has_nan=chunk.has_nan)
                else:
                    store.load_rows(TABLE, chunk.rows)
        profiler.disable()
        store.close()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
    rows: list[dict] = []
    async for chunk in read_chunks(js, meta):  # (no columns: row maps, as the pure path)
        rows.extend(chunk.rows)
    baseline_db = work / "baseline.db"
    baseline = MirrorStore(baseline_db)  # the same CREATE TABLE and pragmas
    baseline.apply_shape(shape)
    baseline.close()
    names = [c.name for c in shape.columns]
    statement = (f"INSERT INTO {quote(TABLE)} ({', '.join(quote(n) for n in names)}) "
                 f"VALUES ({', '.join('?' * len(names))})")
    values = [tuple(to_sqlite(row[n]) for n in names) for row in rows]
    del rows
    with sqlite3.connect(baseline_db, isolation_level=None) as conn:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        started = time.perf_counter()
        conn.execute("BEGIN")
        conn.executemany(statement, values)
        conn.execute("COMMIT")
        baseline_rate = len(values) / (time.perf_counter() - started)

    # 2. apply
    with psycopg.connect(admin_conninfo, autocommit=True) as admin:
        half = args.events // 2
        base = args.rows + 1
        size = args.tx_size
        for start in range(0, half, size):
            with admin.transaction():
                admin.execute(f"INSERT INTO {TABLE} SELECT g, g %% 1000, 'new ' || g, 1.5, "
                              "now(), 0.25, true FROM generate_series(%s::bigint, %s::bigint) g",
                              (base + start, base + start + size - 1))
        for start in range(0, half, size):
            admin.execute(f"UPDATE {TABLE} SET n = n + 1, name = name || '+' "
                          "WHERE id BETWEEN %s AND %s", (start + 1, start + size))
    await _bridge_caught_up(admin_conninfo)
    bridge.request_stop()
    await asyncio.shield(bridging)
    if args.save_replay:  # the database as bootstrapped, before any event is applied
        args.save_replay.mkdir(parents=True, exist_ok=True)
        _fresh_copy(db, args.save_replay / "mirror.db")
    upkeep = {"on": [True], "off": [False], "both": [False, True]}[args.digest]
    copies = {}
    rates: dict[bool, list[float]] = {digests: [] for digests in upkeep}
    cpus: dict[bool, list[float]] = {digests: [] for digests in upkeep}
    for _ in range(max(1, args.digest_runs)):
        for digests in upkeep:  # (each on its own copy of the bootstrapped file)
            copies[digests] = _fresh_copy(
                db, work / f"apply-digests-{'on' if digests else 'off'}.db")
            mirror, apply_rate, apply_seconds, whole_seconds, cpu_seconds = await _apply(
                args, settings, copies[digests], digests)
            rates[digests].append(apply_rate)
            cpus[digests].append(cpu_seconds / max(1, mirror.applied_events) * 1e6)
    together = [_side_by_side(args, settings, db, work) for _ in range(args.digest_together)]
    kept: list | None = [] if args.save_replay else None
    read_rate, read_cpu = await _read_ceiling(client, kept)
    if args.save_replay:
        with (args.save_replay / "messages.pickle").open("wb") as out:
            pickle.dump({"table": TABLE, "fetch_batch": MirrorSettings().fetch_batch,
                         "messages": kept}, out)
        print(f"replay kept in {args.save_replay} ({len(kept or ())} messages)")
    upserts = [tuple(to_sqlite(v) for v in row) for row in values[:mirror.applied_events]]
    with sqlite3.connect(baseline_db, isolation_level=None) as conn:
        started = time.perf_counter()
        conn.execute("BEGIN")
        conn.executemany(statement.replace("INSERT", "INSERT OR REPLACE"), upserts)
        conn.execute("COMMIT")
        apply_baseline = len(upserts) / (time.perf_counter() - started)

    print(f"bootstrap: mirror {mirror_rate:,.0f} rows/s ({args.rows:,} rows, whole child "
          f"{wall:.1f}s), sqlite3 executemany baseline {baseline_rate:,.0f} rows/s, ratio "
          f"{mirror_rate / baseline_rate:.2f} (target >= 0.70)")
    print(f"bootstrap peak RSS (child): {rss_mb:.0f} MB (target <= 200)")
    print(f"apply ({args.mode}): mirror {apply_rate:,.0f} events/s ({mirror.applied_events:,} events in "
          f"{mirror.applied_transactions:,} transactions, {apply_seconds:.1f}s from the first "
          f"event to the last commit; {whole_seconds:.1f}s with connecting and the final idle "
          f"check), "
          f"sqlite3 executemany upsert baseline {apply_baseline:,.0f} rows/s, ratio "
          f"{apply_rate / apply_baseline:.2f} (target >= 50,000 events/s); mirror CPU "
          f"{cpu_seconds / mirror.applied_events * 1e6:.1f} µs per event over the whole run")
    print(f"read ceiling: the mirror's pull reader alone, reading the same messages and "
          f"dropping them: {read_rate:,.0f} msgs/s, {read_cpu:.1f} µs CPU per message; the "
          f"mirror applies at {apply_rate / read_rate:.2f} of it")
    if len(rates) == 2:
        _digest_figures(rates, cpus)
    if together:
        _side_by_side_figures(together)
    if True in copies:
        _verify_figure(copies[True])


async def _apply(args, settings: PlatformSettings, db: Path, digests: bool):
    """The apply phase on ``db``: (the mirror, events/s, seconds from the first event to
    the last commit, seconds in all, CPU seconds)."""
    mirror = Mirror(settings, [TABLE], db, options=MirrorSettings(
        status_interval_seconds=1000, digests=digests), report=lambda line: None)
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    started = time.perf_counter()
    cpu_started = time.process_time()
    await mirror.run(until_caught_up=True)
    cpu_seconds = time.process_time() - cpu_started  # (this process: the mirror alone now)
    whole_seconds = time.perf_counter() - started
    apply_seconds = mirror.last_commit_at - mirror.first_event_at  # first event -> last commit
    if profiler is not None:
        import pstats

        profiler.disable()
        print(f"apply with digests {'on' if digests else 'off'}:")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    apply_rate = mirror.applied_events / apply_seconds
    print(f"apply, digests {'on' if digests else 'off'}: {apply_rate:,.0f} events/s",
          flush=True)
    return mirror, apply_rate, apply_seconds, whole_seconds, cpu_seconds


def _fresh_copy(db: Path, path: Path) -> Path:
    """``path``, a new copy of the bootstrapped file ``db``."""
    path.unlink(missing_ok=True)
    with sqlite3.connect(db) as source, sqlite3.connect(path) as copy:
        source.backup(copy)
    return path


def _side_by_side(args, settings: PlatformSettings, db: Path, work: Path
                  ) -> dict[bool, tuple[float, float]]:
    """One apply phase by two mirrors at once, each in a child process forked here on its
    own copy of the bootstrapped file, the one keeping the digests and the other not:
    {digests: (events/s, CPU µs an event)}. Alternating runs compare moments seconds apart,
    and another tenant of a shared VM changes its speed by tens of percent from one to the
    next; two at once meet the same moments (each reads the stream with its own consumer;
    they share the cores and nats-server, alike)."""
    children = {}
    for digests in (False, True):
        copy_path = _fresh_copy(db, work / f"together-digests-{'on' if digests else 'off'}.db")
        readable, writable = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its own event loop and NATS connection (asyncio.run)
            os.close(readable)
            try:
                mirror, rate, _, _, cpu = asyncio.run(_apply(args, settings, copy_path,
                                                             digests))
                result = (rate, cpu / max(1, mirror.applied_events) * 1e6)
                os.write(writable, pickle.dumps(result))
            finally:
                os._exit(0)
        os.close(writable)
        children[digests] = (pid, readable)
    results = {}
    for digests, (pid, readable) in children.items():
        with os.fdopen(readable, "rb") as pipe:
            received = pipe.read()
        os.waitpid(pid, 0)
        if not received:
            raise SystemExit(f"the side-by-side mirror with digests {digests} failed")
        results[digests] = pickle.loads(received)
    return results


def _slower(rate_without: float, rate_with: float) -> float:
    """How much slower the digests' side applies, in percent."""
    return 100 * (1 - rate_with / rate_without)


def _more(cpu_without: float, cpu_with: float) -> float:
    """How much more CPU an event the digests' side takes, in percent."""
    return 100 * (cpu_with / cpu_without - 1)


def _side_by_side_figures(runs: list[dict[bool, tuple[float, float]]]) -> None:
    slower = [_slower(run[False][0], run[True][0]) for run in runs]
    more = [_more(run[False][1], run[True][1]) for run in runs]
    print(f"digests, two mirrors at once ({len(runs)} runs): without "
          f"{median(run[False][0] for run in runs):,.0f} events/s, with "
          f"{median(run[True][0] for run in runs):,.0f}: {median(slower):.1f} % slower; CPU "
          f"{median(run[False][1] for run in runs):.2f} µs per event without, "
          f"{median(run[True][1] for run in runs):.2f} with: {median(more):.1f} % more "
          f"(medians; each run: {', '.join(f'{x:.1f}' for x in slower)} % slower, CPU "
          f"{', '.join(f'{x:.1f}' for x in more)} % more)")


def _digest_figures(rates: dict[bool, list[float]], cpus: dict[bool, list[float]]) -> None:
    """The apply with the digests' upkeep against without it: each pair of runs (one
    after the other) and the medians over pairs."""
    slower = [_slower(off, on) for off, on in zip(rates[False], rates[True], strict=True)]
    more = [_more(off, on) for off, on in zip(cpus[False], cpus[True], strict=True)]
    print(f"digests: apply without upkeep {median(rates[False]):,.0f} events/s, with "
          f"{median(rates[True]):,.0f} events/s: {median(slower):.1f} % slower (target <= 10 "
          f"%); mirror CPU {median(cpus[False]):.1f} µs per event without, "
          f"{median(cpus[True]):.1f} with: {median(more):.1f} % more (steadier on a shared "
          "machine)" + (" (medians)" if len(slower) > 1 else ""))
    if len(slower) > 1:
        print(f"digests, each pair of runs: {', '.join(f'{x:.1f}' for x in slower)} % slower; "
              f"CPU {', '.join(f'{x:.1f}' for x in more)} % more")
        # Each side's least disturbed run: what other tenants of a shared VM add to one run
        # (single pairs swing by tens of percent) only ever adds, so the best runs compare the
        # code's own costs (as timeit's best of N does)
        print(f"digests, best runs: {max(rates[False]):,.0f} events/s without, "
              f"{max(rates[True]):,.0f} with: {_slower(max(rates[False]), max(rates[True])):.1f}"
              f" % slower; CPU {min(cpus[False]):.2f} µs per event without, "
              f"{min(cpus[True]):.2f} with: {_more(min(cpus[False]), min(cpus[True])):.1f}"
              " % more")


def _verify_figure(db: Path) -> None:
    """``mirror verify``'s scan of the table against ``SELECT *`` of it, best of 3 each."""
    scans, verifies = [], []
    for _ in range(3):
        with sqlite3.connect(db) as conn:
            started = time.perf_counter()
            count = sum(1 for _ in conn.execute(f"SELECT * FROM {quote(TABLE)}"))
            scans.append(time.perf_counter() - started)
        started = time.perf_counter()
        checks = verify_file(db, [TABLE])
        verifies.append(time.perf_counter() - started)
        assert not checks[0].differing and checks[0].why is None, checks[0].line()
    scan_rate, verify_rate = count / min(scans), count / min(verifies)
    print(f"mirror verify: {verify_rate:,.0f} rows/s ({count:,} rows), SELECT * "
          f"{scan_rate:,.0f} rows/s, ratio {verify_rate / scan_rate:.2f} (target >= 0.5)")


async def _read_ceiling(client, kept: list | None = None) -> tuple[float, float]:
    """(messages/s, CPU µs per message) of reading the apply phase's messages again with the
    mirror's pull reader and nothing else: what this machine's nats-server and client
    leave for applying. ``kept``: each message's (subject, stream sequence, payload, raw
    headers, raw ack subject) appended to it."""
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    from cdc_platform.jetstream.pull import PullReader

    js = client.jetstream()
    batch = MirrorSettings().fetch_batch  # as the mirror reads
    info = await js.add_consumer("CDC", ConsumerConfig(
        filter_subject=f"cdc.{TABLE}.>", deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.NONE, inactive_threshold=60.0))
    reader = PullReader(client, "CDC", info.name, batch=batch)
    await reader.start()
    wanted, got = info.num_pending, 0
    started, cpu_started = time.perf_counter(), time.process_time()
    try:
        while got < wanted:
            messages = await reader.fetch(batch, timeout=5.0)
            got += len(messages)
            if kept is not None:
                kept.extend((m.subject, m.stream_seq, m.data, m.raw_headers, m.raw_reply)
                            for m in messages)
    finally:
        await reader.stop()
    cpu = time.process_time() - cpu_started
    return got / (time.perf_counter() - started), cpu / got * 1e6


if __name__ == "__main__":
    asyncio.run(main())
