#!/usr/bin/env python
"""INIT snapshot throughput: the Spark job against ``psql -c "COPY ... TO STDOUT" > /dev/null``.

    .venv/bin/python benchmarks/snapshot.py [--rows 1000000] [--cores 1,2] [--runs 2]
                                            [--profile]

Starts its own PostgreSQL and nats-server (temp dir), a 9-column ``orders``-like table
(bigint, int, text x2, numeric, timestamptz, bool, float8, int) with ``--rows`` rows, and
measures in the same run:

* the baseline: ``psql -c "COPY (SELECT <same columns>) TO STDOUT" > /dev/null`` (best of
  ``--runs``), rows/s and MB/s of COPY text;
* Spark startup, apart: session creation (JVM) and the first job starting the Python workers
  and importing the library, for each core count;
* the snapshot job with 1 and 2 cores (msgpack, no compression): rows/s and MB/s of COPY text
  over the Spark job alone (``spark_seconds``: tasks reading, converting, publishing and the
  driver waiting for them) and over the whole snapshot (validate, watermark, slot, meta);
* 2 cores with zstd, without and with a dictionary: compressed/raw size;
* zstd ratios by chunk size with and without the dictionary (a dictionary matters for small
  messages, hardly for ~1 MB chunks);
* with ``--profile``: the per-row path in-process (no Spark), time per stage and a cProfile
  of the chunker.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cdc_platform.dev.servers import (
    LocalNatsServer,
    LocalPostgres,
    start_logical_postgres,
)
from cdc_platform.jetstream.connection import connect_nats
from cdc_platform.jetstream.provision import provision
from cdc_platform.postgres.admin import provision_database
from cdc_platform.settings import (
    EncodingSettings,
    NatsSettings,
    NatsTopology,
    PlatformSettings,
    PostgresSettings,
)

TABLE = "bench_orders"
ROLE, PASSWORD, PUBLICATION = "bench_reader", "bench-password", "bench_pub"
COLUMNS = "id, customer_id, status, amount, qty, created_at, note, active, score"


def start_servers(base: Path) -> tuple[LocalPostgres, LocalNatsServer]:
    pg = start_logical_postgres(base / "pg", unsafe_no_fsync=True)
    with psycopg.connect(pg.superuser_conninfo(), autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET shared_buffers = '512MB'")  # the table stays cached
    pg.restart()
    nats = LocalNatsServer(base / "nats")
    nats.start()
    return pg, nats


def create_table(pg: LocalPostgres, rows: int) -> None:
    with psycopg.connect(pg.superuser_conninfo(), autocommit=True) as conn:
        conn.execute(f"""CREATE TABLE {TABLE} (
            id bigint PRIMARY KEY, customer_id int, status text, amount numeric(12,2),
            qty int, created_at timestamptz, note text, active bool, score float8)""")
        conn.execute(f"""
            INSERT INTO {TABLE}
            SELECT i, i % 50000, (ARRAY['new','paid','shipped','done','cancelled'])[1 + i % 5],
                   (i % 100000) / 100.0, 1 + i % 9,
                   timestamptz '2024-01-01 00:00+00' + i * interval '1.5 second',
                   'order note ' || md5(i::text), i % 3 <> 0, i / 7.0
            FROM generate_series(1, {rows}) i""")
        conn.execute(f"VACUUM ANALYZE {TABLE}")
        provision_database(conn, publication=PUBLICATION, role=ROLE, tables=[TABLE],
                           role_password=PASSWORD)


def _psql_copy(pg: LocalPostgres, stdout: int) -> subprocess.CompletedProcess:
    """``psql COPY`` of the table to ``stdout``, in the session settings the snapshot uses."""
    psql = shutil.which("psql") or str(pg.bin_dir / "psql")
    command = [psql, "-h", str(pg.socket_dir), "-p", str(pg.port), "-U", "postgres",
               "-d", "postgres", "-X", "-q", "-c",
               f"COPY (SELECT {COLUMNS} FROM {TABLE}) TO STDOUT"]
    env = {**os.environ, "PGOPTIONS": "-c DateStyle=ISO,YMD -c TimeZone=UTC "
           "-c extra_float_digits=3 -c IntervalStyle=iso_8601 -c bytea_output=hex"}
    return subprocess.run(command, stdout=stdout, check=True, env=env)


def psql_copy(pg: LocalPostgres) -> float:
    """Seconds of one ``psql COPY > /dev/null`` of the table."""
    started = time.perf_counter()
    _psql_copy(pg, subprocess.DEVNULL)
    return time.perf_counter() - started


def baseline(pg: LocalPostgres, runs: int) -> tuple[float, int]:
    """Best seconds of ``psql COPY > /dev/null``, and the COPY text size in bytes."""
    best = min(psql_copy(pg) for _ in range(runs))
    return best, len(_psql_copy(pg, subprocess.PIPE).stdout)


def create_bridge_slot(pg: LocalPostgres) -> None:
    """``bench_slot`` as a stopped bridge leaves it: a snapshot writes its watermark only
    where the bridge's slot will carry it into CDC (no bridge runs here)."""
    with psycopg.connect(pg.superuser_conninfo(), autocommit=True) as conn:
        conn.execute("SELECT pg_create_logical_replication_slot('bench_slot', 'pgoutput')")


def platform_settings(pg: LocalPostgres, nats: LocalNatsServer, **encoding) -> PlatformSettings:
    return PlatformSettings(
        postgres=PostgresSettings(host=pg.host, port=pg.port, database="postgres", user=ROLE,
                                  password=PASSWORD, publication=PUBLICATION,
                                  slot="bench_slot", sslmode="disable"),
        nats=NatsSettings(url=nats.url), encoding=EncodingSettings(**encoding))


def spark_session(cores: int) -> tuple[object, float, float]:
    """(session, seconds to create it, seconds of a first job starting Python workers)."""
    from cdc_platform.snapshot.spark_session import local_spark_session

    started = time.perf_counter()
    spark = local_spark_session(f"bench-snapshot-{cores}", master=f"local[{cores}]")
    created = time.perf_counter() - started
    started = time.perf_counter()
    spark.sparkContext.parallelize(range(cores), cores).map(
        lambda _: __import__("cdc_platform.snapshot.reader").__name__).collect()
    return spark, created, time.perf_counter() - started


def snapshot(spark, settings):
    from cdc_platform.snapshot import SnapshotOptions, run_snapshot

    return run_snapshot(spark, settings, TABLE,
                        options=SnapshotOptions(watermark_wait_seconds=0.0,
                                                        small_table_bytes=0))


async def purge_init(nats: LocalNatsServer) -> None:
    """Runs leave ~160 MB each in INIT: start every run from an empty stream."""
    client = await connect_nats(NatsSettings(url=nats.url))
    try:
        await client.jetstream().purge_stream("INIT")
    finally:
        await client.close()


def dictionary_by_chunk_size(pg: LocalPostgres, settings: PlatformSettings) -> list[tuple]:
    """zstd compressed/raw of sample chunks of several sizes, with and without a dictionary."""
    from cdc_platform.snapshot import dictionary
    from cdc_platform.snapshot.source import (
        chunk_layout,
        describe_table,
        sample_rows,
        table_converters,
    )

    with psycopg.connect(settings.postgres.conninfo(options="-c TimeZone=UTC"),
                         autocommit=True) as conn:
        table = describe_table(conn, PUBLICATION, TABLE)
        layout = chunk_layout(table, settings.encoding, "bench", "0/0", 1 << 20, None,
                              signed=False)
        rows = sample_rows(conn, table, layout, table_converters(table), 20_000)
    trained = dictionary.train(rows, "msgpack", level=3)
    out = []
    for chunk_rows in (1, 10, 100, 1000, 10_000):
        with_dict, without = dictionary.sample_ratios(rows, "msgpack", level=3,
                                                      dictionary=trained.data,
                                                      chunk_rows=chunk_rows)
        out.append((chunk_rows, with_dict, without))
    return out


def profile_row_path(pg: LocalPostgres, settings: PlatformSettings, rows: int) -> None:
    """The per-row path in one process, stage by stage, then a cProfile of the chunker."""
    import msgpack
    import zstandard

    from cdc_platform.replication.connection import SESSION_OPTIONS
    from cdc_platform.snapshot.chunks import Chunker
    from cdc_platform.snapshot.plan import BlockRange
    from cdc_platform.snapshot.reader import copy_blocks
    from cdc_platform.snapshot.source import (
        chunk_layout,
        copy_select,
        describe_table,
        table_converters,
    )

    conninfo = settings.postgres.conninfo(options=SESSION_OPTIONS)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        table = describe_table(conn, PUBLICATION, TABLE)
        command = copy_select(table.schema).replace(
            "{range}", BlockRange(0, 0, None).predicate().as_string(None)) \
            .replace(") TO STDOUT", f" LIMIT {rows}) TO STDOUT")

        async def drain():
            return [block async for block in copy_blocks(conn.pgconn, command)]

        started, cpu = time.perf_counter(), time.process_time()
        blocks = asyncio.run(drain())
        t_copy, c_copy = time.perf_counter() - started, time.process_time() - cpu
    layout = chunk_layout(table, settings.encoding, f"bench-{time.time_ns()}", "0/0", 1 << 20,
                          None, signed=False)
    converters = table_converters(table)
    chunker = Chunker(layout, converters, 0)
    n = sum(block.count(b"\n") for block in blocks)
    timings: dict[str, float] = dict.fromkeys(
        ("parse", "convert", "row maps", "msgpack", "zstd"), 0.0)
    packer = msgpack.Packer(use_bin_type=True, datetime=False)
    compressor = zstandard.ZstdCompressor(level=3)
    for block in blocks:
        started = time.perf_counter()
        _lines, fields, _escapes = chunker.parse(block)
        timings["parse"] += time.perf_counter() - started
        started = time.perf_counter()
        width = len(converters)
        columns = [list(map(f, fields[i::width])) for i, f in enumerate(converters)]
        timings["convert"] += time.perf_counter() - started
        started = time.perf_counter()
        data = list(map(chunker._make_row, *columns))
        timings["row maps"] += time.perf_counter() - started
        started = time.perf_counter()
        raw = packer.pack({"data": data})
        timings["msgpack"] += time.perf_counter() - started
        started = time.perf_counter()
        compressor.compress(raw)
        timings["zstd"] += time.perf_counter() - started
    chunker = Chunker(layout, converters, 0)
    started = time.perf_counter()
    for block in blocks:
        chunker.add(block)
    chunker.finish()
    t_chunker = time.perf_counter() - started

    print(f"\nper-row path, {n} rows in one process (µs/row):")
    print(f"  {'COPY drain (wall; Python CPU)':42s} {t_copy / n * 1e6:6.2f} "
          f"({c_copy / n * 1e6:.2f})")
    for label, seconds in timings.items():
        print(f"  {label:42s} {seconds / n * 1e6:6.2f}")
    print(f"  {'Chunker.add, all of the above but zstd':42s} {t_chunker / n * 1e6:6.2f}")
    _lines, fields, _ = Chunker(layout, converters, 0).parse(b"".join(blocks[:20]))
    print("  convert, by column:", ", ".join(
        f"{name} {_per_value(convert, fields[i::len(converters)]):.2f}"
        for i, (name, convert) in enumerate(zip(layout.columns, converters))))
    task_wall, task_cpu, task_rows = one_task(settings, table, layout, converters)
    print(f"  {'one task in-process (no Spark), wall':42s} {task_wall / task_rows * 1e6:6.2f}"
          f"  (CPU of the task process {task_cpu / task_rows * 1e6:.2f}: "
          f"{task_rows / task_cpu:,.0f} rows/s per core if PostgreSQL and NATS had their own)")
    profiler = cProfile.Profile()
    chunker = Chunker(layout, converters, 0)
    profiler.enable()
    for block in blocks:
        chunker.add(block)
    chunker.finish()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(8)
    print("\n".join(line for line in out.getvalue().splitlines()[:24] if line.strip()))


def _per_value(convert, column) -> float:
    started = time.perf_counter()
    list(map(convert, column))
    return (time.perf_counter() - started) / max(len(column), 1) * 1e6


def one_task(settings: PlatformSettings, table, layout, converters) -> tuple[float, float, int]:
    """One task's work (COPY, convert, chunk, publish, acks) on the whole table, in-process:
    (wall seconds, CPU seconds of this process, rows)."""
    from cdc_platform.replication.connection import SESSION_OPTIONS
    from cdc_platform.snapshot.plan import BlockRange
    from cdc_platform.snapshot.reader import TaskSpec, read_range
    from cdc_platform.snapshot.source import copy_select

    conninfo = settings.postgres.conninfo(options=SESSION_OPTIONS)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        exported = conn.execute("SELECT pg_export_snapshot()").fetchone()[0]
        spec = TaskSpec(conninfo=conninfo, nats=settings.nats, snapshot_name=exported,
                        select=copy_select(table.schema), layout=layout,
                        columns=table.schema.columns, type_rows=table.type_rows,
                        stream="INIT")
        asyncio.run(purge_init_settings(settings))
        wall, cpu = time.perf_counter(), time.process_time()
        stats = asyncio.run(read_range(spec, BlockRange(0, 0, None)))
        return time.perf_counter() - wall, time.process_time() - cpu, stats.rows


async def purge_init_settings(settings: PlatformSettings) -> None:
    client = await connect_nats(settings.nats)
    try:
        await client.jetstream().purge_stream("INIT")
    finally:
        await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--cores", default="1,2")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-snapshot-"))
    pg, nats = start_servers(base)
    try:
        asyncio.run(_provision(nats))
        create_table(pg, args.rows)
        create_bridge_slot(pg)
        copy_seconds, copy_bytes = baseline(pg, max(3, args.runs))  # best of 3 at least
        copy_rate = args.rows / copy_seconds
        mb = copy_bytes / 1e6
        print(f"{args.rows} rows, COPY text {mb:.1f} MB, {os.cpu_count()} CPUs")
        print(f"baseline psql COPY > /dev/null: {copy_seconds:.2f}s  "
              f"{copy_rate:,.0f} rows/s  {mb / copy_seconds:.1f} MB/s")
        settings = platform_settings(pg, nats)
        spark = None
        cores_list = [int(c) for c in args.cores.split(",")]
        for cores in cores_list:
            if spark is not None:
                spark.stop()
            spark, created, warmup = spark_session(cores)
            print(f"\nSpark local[{cores}]: session {created:.2f}s, first job (Python workers, "
                  f"imports) {warmup:.2f}s  [startup, excluded below]")
            runs = [(None, {})]
            if cores == max(cores_list):
                runs += [("zstd", {"zstd": True, "zstd_dictionary": False}),
                         ("zstd+dict", {"zstd": True, "zstd_dictionary": True})]
            for label, encoding in runs:
                best = None
                for _ in range(args.runs):
                    asyncio.run(purge_init(nats))
                    result = snapshot(spark, platform_settings(pg, nats, **encoding))
                    assert result.row_count == args.rows
                    if best is None or result.spark_seconds < best.spark_seconds:
                        best = result
                rate = args.rows / best.spark_seconds
                task_seconds = sum(r.seconds for r in best.ranges)
                print(f"  snapshot {label or 'msgpack':10s}: job {best.spark_seconds:.2f}s "
                      f"{rate:,.0f} rows/s {mb / best.spark_seconds:.1f} MB/s "
                      f"ratio to COPY {rate / copy_rate:.2f} | whole snapshot "
                      f"{best.duration_seconds:.2f}s ({args.rows / best.duration_seconds:,.0f}"
                      f" rows/s) | {best.partitions} ranges, {best.batch_count} chunks, "
                      f"tasks {task_seconds:.1f}s total | payload "
                      f"{best.bytes_compressed / 1e6:.1f} MB of {best.bytes_raw / 1e6:.1f} MB "
                      f"raw ({best.compression_ratio:.3f})")
                if best.sample_ratio_with_dictionary is not None:
                    print(f"    dictionary {best.dictionary_id}: sample ratio with "
                          f"{best.sample_ratio_with_dictionary:.3f}, without "
                          f"{best.sample_ratio_without_dictionary:.3f}")
        if spark is not None:
            spark.stop()
        print("\nzstd level 3, compressed/raw by chunk size (sample of 20K rows):")
        for chunk_rows, with_dict, without in dictionary_by_chunk_size(pg, settings):
            print(f"  {chunk_rows:6d} rows/chunk: without dictionary {without:.3f}, "
                  f"with {with_dict:.3f}")
        if args.profile:
            profile_row_path(pg, settings, min(args.rows, 300_000))
    finally:
        nats.stop()
        pg.stop("immediate")
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


async def _provision(nats: LocalNatsServer) -> None:
    client = await connect_nats(NatsSettings(url=nats.url))
    try:
        await provision(client.jetstream(), NatsTopology())
    finally:
        await client.close()


if __name__ == "__main__":
    main()
