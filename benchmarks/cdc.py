"""End-to-end CDC benchmark: commit -> stored in JetStream -> LSN confirmed to PostgreSQL.

    .venv/bin/python benchmarks/cdc.py [--rows 200000] [--small-txns 20] [--small-rows 10000]
                                       [--steady-seconds 10] [--modes per-change,batched]
                                       [--signing]

Starts its own PostgreSQL and nats-server (temp dir), a 5-column table in a publication, and
for each workload measures, on WAL already committed (both readers catch up from the same
point):

* the bridge (``cdc-platform bridge`` as a subprocess, so its RSS is its own): time from its
  slot becoming active to its ``confirmed_flush_lsn`` passing the workload's end LSN;
* ``pg_recvlogical`` (pgoutput, same publication, output to /dev/null, ``--endpos``): the
  physical limit of reading the same WAL, in the same run -> the ratio.

With ``--signing`` each mode's catch-ups run twice in the same run, the second time with the
bridge signing every message (``CDC_SIGNING_KEY_SEED``, docs/wire-contract.md "Signatures").

Then the ceiling of per-change mode here: the same per-change messages built in memory and
published by the bridge's publisher to a stream configured like ``CDC``, nothing else
running (nats-server alone; the bridge / ceiling ratio is printed).

Then, with the bridge running, a steady 2K changes/s for ``--steady-seconds``: latency from
each transaction's commit to its message arriving at a JetStream consumer (an upper bound of
commit -> stored), p50/p99. Peak RSS of the bridge process is read from /proc (VmHWM).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # decode.py's captured WAL

from cdc_platform.dev.servers import (
    LocalNatsServer,
    LocalPostgres,
    start_logical_postgres,
)
from cdc_platform.jetstream.connection import connect_nats
from cdc_platform.jetstream.provision import provision
from cdc_platform.lsn import parse_lsn
from cdc_platform.postgres.admin import provision_database
from cdc_platform.settings import NatsSettings, NatsTopology

TABLE = "bench_events"
ROLE, PASSWORD, PUBLICATION = "bench_reader", "bench-password", "bench_pub"


def start_servers(base: Path) -> tuple[LocalPostgres, LocalNatsServer]:
    pg = start_logical_postgres(base / "pg")
    with psycopg.connect(pg.superuser_conninfo(), autocommit=True) as conn:
        create_events_table(conn)
        provision_database(conn, publication=PUBLICATION, role=ROLE, tables=[TABLE],
                           role_password=PASSWORD)
    nats = LocalNatsServer(base / "nats")
    nats.start()

    async def setup() -> None:
        client = await connect_nats(NatsSettings(url=nats.url))
        await provision(client.jetstream(), NatsTopology(cdc={"max_bytes": 8 * 1024**3}))
        await client.close()

    asyncio.run(setup())
    return pg, nats


def create_events_table(conn: psycopg.Connection) -> None:
    conn.execute(f"CREATE TABLE {TABLE} (id int8 PRIMARY KEY, name text, qty int4, "
                 "price numeric(12,2), at timestamptz)")


def insert_rows(conn: psycopg.Connection, first_id: int, count: int) -> None:
    conn.execute(
        f"INSERT INTO {TABLE} SELECT i, 'name-' || i, i %% 1000, i * 0.01, "
        "'2025-01-01'::timestamptz + i * interval '1 second' "
        "FROM generate_series(%s::int8, %s::int8) AS i", (first_id, first_id + count - 1))


def current_lsn(conn: psycopg.Connection) -> int:
    return parse_lsn(conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])


def slot_state(conn: psycopg.Connection, slot: str) -> tuple[bool, int]:
    row = conn.execute("SELECT active, confirmed_flush_lsn::text FROM pg_replication_slots "
                       "WHERE slot_name = %s", (slot,)).fetchone()
    return bool(row[0]), parse_lsn(row[1]) if row and row[1] else 0


def bridge_env(pg: LocalPostgres, nats: LocalNatsServer, slot: str, mode: str,
               seed: Path | None = None, **settings: str) -> dict:
    """The bridge's environment; ``settings`` add ``CDC_*`` variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CDC_", "PG_", "NATS_"))}
    env.update({"CDC_PG_HOST": pg.host, "CDC_PG_PORT": str(pg.port), "CDC_PG_USER": ROLE,
                "CDC_PG_PASSWORD": PASSWORD, "CDC_PG_SSLMODE": "disable",
                "CDC_PUBLICATION": PUBLICATION, "CDC_SLOT": slot, "CDC_NATS_URL": nats.url,
                "CDC_HTTP_PORT": "0", "CDC_MESSAGE_MODE": mode, **settings})
    if seed is not None:
        env["CDC_SIGNING_KEY_SEED"] = str(seed)
    return env


_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | None) -> float:
    """user + system CPU time of a live process, from /proc/<pid>/stat."""
    if not pid:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICKS


def slot_pid(conn: psycopg.Connection, slot: str) -> int | None:
    row = conn.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s",
                       (slot,)).fetchone()
    return row[0] if row else None


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


PROFILE_DIR: Path | None = None  # --profile: py-spy flame data per catch-up run
NATS_PID: int | None = None


def run_bridge_catch_up(admin: psycopg.Connection, pg, nats, mode: str, slot: str,
                        end_lsn: int, events: int, log: Path, seed: Path | None, *,
                        env: dict[str, str] | None = None,
                        also_using: dict[str, int | None] | None = None,
                        after_catch_up: Callable[[], None] | None = None,
                        ) -> tuple[float, float, dict[str, float]]:
    """(events/s, peak RSS MB, cores used by each process) of the bridge reaching
    ``end_lsn``; ``env`` adds ``CDC_*`` settings, ``also_using`` more processes whose cores
    to report, ``after_catch_up`` runs while the bridge still runs, once it caught up."""
    command = [str(Path(sys.executable).parent / "cdc-platform"), "bridge"]
    if PROFILE_DIR is not None:
        command = [str(Path(sys.executable).parent / "py-spy"), "record", "--format", "raw",
                   "-r", "200", "-o", str(PROFILE_DIR / f"{slot}.txt"), "--", *command]
    with open(log, "ab") as out:
        process = subprocess.Popen(command,
                                   env=bridge_env(pg, nats, slot, mode, seed, **(env or {})),
                                   stdout=out, stderr=subprocess.STDOUT)
    try:
        while not slot_state(admin, slot)[0]:
            if process.poll() is not None:
                raise SystemExit(f"bridge exited early, see {log}")
            time.sleep(0.005)
        started = time.perf_counter()
        # Who uses the two cores: the bridge, its walsender, nats-server.
        pids = {"bridge": process.pid, "walsender": slot_pid(admin, slot),
                "nats-server": NATS_PID, **(also_using or {})}
        cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        while slot_state(admin, slot)[1] < end_lsn:
            time.sleep(0.005)
        elapsed = time.perf_counter() - started
        cores = {name: (cpu_seconds(pid) - cpu_before[name]) / elapsed
                 for name, pid in pids.items()}
        rss = peak_rss_mb(process.pid) if PROFILE_DIR is None else float("nan")
        if after_catch_up is not None:
            after_catch_up()
    finally:
        process.send_signal(2)  # SIGINT: py-spy writes its profile, the bridge stops cleanly
        process.wait(60)
    return events / elapsed, rss, cores


def run_recvlogical_catch_up(pg: LocalPostgres, slot: str, end_lsn: int, events: int) -> float:
    from cdc_platform.lsn import format_lsn

    command = [str(pg.bin_dir / "pg_recvlogical"), "-h", pg.host, "-p", str(pg.port),
               "-U", ROLE, "-d", "postgres", "--slot", slot, "--start",
               "-o", "proto_version=1", "-o", f"publication_names={PUBLICATION}",
               f"--endpos={format_lsn(end_lsn)}", "-f", "/dev/null", "--no-loop"]
    env = {**os.environ, "PGPASSWORD": PASSWORD}
    started = time.perf_counter()
    subprocess.run(command, env=env, check=True, capture_output=True)
    return events / (time.perf_counter() - started)


def create_slots(admin: psycopg.Connection, *names: str) -> None:
    for name in names:
        admin.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (name,))


def drop_slots(admin: psycopg.Connection, *names: str) -> None:
    for name in names:
        deadline = time.monotonic() + 30
        while slot_state(admin, name)[0] and time.monotonic() < deadline:
            time.sleep(0.05)  # the reader is still disconnecting
        admin.execute("SELECT pg_drop_replication_slot(%s)", (name,))


def throughput(admin, pg, nats, mode: str, workload: str, txns: int, rows: int,
               next_id: list[int], log: Path, seed: Path | None = None) -> dict:
    signed = "_signed" if seed else ""
    bridge_slot = f"b_{mode.replace('-', '_')}_{workload}{signed}"
    baseline_slot = f"r_{workload}{signed}"
    create_slots(admin, bridge_slot, baseline_slot)
    for _ in range(txns):
        insert_rows(admin, next_id[0], rows)
        next_id[0] += rows
    end_lsn = current_lsn(admin)
    events = txns * rows
    baseline = run_recvlogical_catch_up(pg, baseline_slot, end_lsn, events)
    bridge, rss, cores = run_bridge_catch_up(admin, pg, nats, mode, bridge_slot, end_lsn,
                                             events, log, seed)
    drop_slots(admin, bridge_slot, baseline_slot)
    return {"mode": mode + ("+signed" if seed else ""), "workload": workload, "events": events, "bridge": bridge,
            "pg_recvlogical": baseline, "ratio": bridge / baseline, "rss_mb": rss,
            "cores": cores}


async def steady_latency(admin_conninfo: str, pg, nats, mode: str, seconds: float,
                         next_id: list[int], log: Path) -> dict:
    slot = f"steady_{mode.replace('-', '_')}"
    client = await connect_nats(NatsSettings(url=nats.url))
    latencies: list[float] = []
    suffix = "insert.batch" if mode == "batched" else "insert"

    async def on_message(message) -> None:
        received = time.time()
        payload = msgpack.unpackb(message.data)
        for event in payload if isinstance(payload, list) else [payload]:
            committed = time.mktime(time.strptime(event["commit_ts"][:19],
                                                  "%Y-%m-%dT%H:%M:%S")) - time.timezone
            committed += float("0." + event["commit_ts"][20:-1] or "0")
            latencies.append(received - committed)

    subscription = await client.subscribe(f"cdc.{TABLE}.{suffix}", cb=on_message)
    with psycopg.connect(admin_conninfo, autocommit=True) as admin:
        create_slots(admin, slot)
        command = [str(Path(sys.executable).parent / "cdc-platform"), "bridge"]
        with open(log, "ab") as out:
            process = subprocess.Popen(command, env=bridge_env(pg, nats, slot, mode),
                                       stdout=out, stderr=subprocess.STDOUT)
        while not slot_state(admin, slot)[0]:
            await asyncio.sleep(0.01)
        stop = threading.Event()

        def writer() -> None:  # 20 rows every 10 ms = 2K changes/s
            with psycopg.connect(admin_conninfo, autocommit=True) as conn:
                tick = time.perf_counter()
                while not stop.is_set():
                    insert_rows(conn, next_id[0], 20)
                    next_id[0] += 20
                    tick += 0.01
                    time.sleep(max(0.0, tick - time.perf_counter()))

        thread = threading.Thread(target=writer)
        thread.start()
        await asyncio.sleep(seconds)
        stop.set()
        thread.join()
        await asyncio.sleep(1.0)
        rss = peak_rss_mb(process.pid)
        process.terminate()
        process.wait(60)
        drop_slots(admin, slot)
    await subscription.unsubscribe()
    await client.close()
    ordered = sorted(latencies)
    return {"mode": mode, "events": len(ordered),
            "p50_ms": 1000 * statistics.median(ordered),
            "p99_ms": 1000 * ordered[int(len(ordered) * 0.99) - 1], "rss_mb": rss}


async def publish_ceiling(nats, events: int) -> dict:
    """nats-server alone: the per-change messages of ``events`` rows of this table's shape
    (built by the bridge's own code from WAL captured by ``decode.py``'s fixture), published
    from memory by the bridge's publisher to a stream configured like ``CDC``, with nothing
    else running. No bridge can store faster than this: the upper bound of per-change mode
    on this machine."""
    import dataclasses

    from decode import build_copy_data

    from cdc_platform.bridge.events import MessageBuilder
    from cdc_platform.jetstream.provision import stream_config
    from cdc_platform.protocol.changes import TransactionAssembler
    from cdc_platform.protocol.pgoutput import decode_message
    from cdc_platform.protocol.streaming import XLOGDATA_HEADER_SIZE, parse_copy_data
    from cdc_platform.protocol.values import TypeRegistry
    from cdc_platform.publishing import JetStreamPublisher, OutgoingMessage

    preamble, buffers = build_copy_data(events)
    assembler, records = TransactionAssembler(TypeRegistry()), []
    for buffer in [*preamble, *buffers]:
        records.extend(assembler.feed(parse_copy_data(buffer).wal_start,
                                      decode_message(buffer, XLOGDATA_HEADER_SIZE)))
    # (a message without a subject is a schema event's place, which the bridge fills)
    messages = [OutgoingMessage("ceiling." + m.subject, m.msg_id, m.payload, m.headers)
                for m in MessageBuilder("msgpack", "per-change").build(records).messages
                if m.subject]
    client = await connect_nats(NatsSettings(url=nats.url))
    js = client.jetstream()
    await js.add_stream(dataclasses.replace(stream_config(NatsTopology().cdc), name="CEILING",
                                            subjects=["ceiling.>"]))
    publisher = JetStreamPublisher(client, stream="CEILING", mode="fast-batch")
    await publisher.start()
    server_before, started = cpu_seconds(nats.process.pid), time.perf_counter()
    for first in range(0, len(messages), 4096):
        await publisher.publish(messages[first:first + 4096], position=first + 1)
    await publisher.flush(timeout=120)
    elapsed = time.perf_counter() - started
    server_cores = (cpu_seconds(nats.process.pid) - server_before) / elapsed
    stored = (await js.stream_info("CEILING")).state.messages
    await publisher.close()
    await js.delete_stream("CEILING")
    await client.close()
    if stored != len(messages):
        raise SystemExit(f"ceiling run stored {stored} of {len(messages)} messages")
    return {"rate": len(messages) / elapsed, "server_cores": server_cores,
            "payload": sum(len(m.payload) for m in messages) / len(messages)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--small-txns", type=int, default=20)
    parser.add_argument("--small-rows", type=int, default=10_000)
    parser.add_argument("--steady-seconds", type=float, default=10.0)
    parser.add_argument("--modes", default="per-change,batched")
    parser.add_argument("--profile", type=Path, help="write py-spy profiles to this folder")
    parser.add_argument("--signing", action="store_true",
                        help="also run each catch-up with the bridge signing its messages")
    args = parser.parse_args()
    global PROFILE_DIR, NATS_PID
    PROFILE_DIR = args.profile
    base = Path(tempfile.mkdtemp(prefix="cdc-bench-"))
    pg, nats = start_servers(base)
    NATS_PID = nats.process.pid if nats.process else None
    log = base / "bridge.log"
    seeds: list[Path | None] = [None]
    if args.signing:
        from cdc_platform.wire.signing import new_seed

        seeds.append(base / "signing.seed")
        seeds[-1].write_text(new_seed(os.urandom(32)))
    next_id = [1]
    results, latencies, ceiling = [], [], None
    try:
        with psycopg.connect(pg.superuser_conninfo(), autocommit=True) as admin:
            for mode in args.modes.split(","):
                for seed in seeds:
                    results.append(throughput(admin, pg, nats, mode, "1x200k", 1, args.rows,
                                              next_id, log, seed))
                    results.append(throughput(admin, pg, nats, mode, "20x10k",
                                              args.small_txns, args.small_rows, next_id, log,
                                              seed))
        ceiling = (asyncio.run(publish_ceiling(nats, args.rows))
                   if "per-change" in args.modes.split(",") else None)
        for mode in args.modes.split(","):
            latencies.append(asyncio.run(steady_latency(
                pg.superuser_conninfo(), pg, nats, mode, args.steady_seconds, next_id, log)))
    finally:
        nats.stop()
        pg.stop()
    print(f"\nPostgreSQL {pg.version()}, nats-server, {os.cpu_count()} cores, all on this "
          "machine")
    print(f"{'mode':<18} {'workload':<8} {'events':>8} {'bridge ev/s':>12} "
          f"{'pg_recvlogical ev/s':>20} {'ratio':>6} {'peak RSS MB':>12}  "
          "cores used: bridge/walsender/nats")
    for r in results:
        cores = r["cores"]
        print(f"{r['mode']:<18} {r['workload']:<8} {r['events']:>8} {r['bridge']:>12,.0f} "
              f"{r['pg_recvlogical']:>20,.0f} {r['ratio']:>6.2f} {r['rss_mb']:>12.0f}  "
              f"{cores['bridge']:.2f}/{cores['walsender']:.2f}/{cores['nats-server']:.2f}")
    if ceiling is not None:
        best = max((r["bridge"] for r in results if r["mode"] == "per-change"), default=0.0)
        print(f"\nnats-server ingest ceiling (per-change messages of {ceiling['payload']:.0f} B "
              f"published from memory, nothing else running): {ceiling['rate']:,.0f} msg/s, "
              f"nats-server {ceiling['server_cores']:.2f} cores; best per-change bridge / "
              f"ceiling = {best / ceiling['rate']:.2f}")
    print("\nsteady 2K changes/s, commit -> received from JetStream:")
    for r in latencies:
        print(f"{r['mode']:<11} events={r['events']} p50={r['p50_ms']:.1f} ms "
              f"p99={r['p99_ms']:.1f} ms peak RSS={r['rss_mb']:.0f} MB")
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
