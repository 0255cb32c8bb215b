#!/usr/bin/env python
"""Repair snapshot against a full snapshot of the same table, same run (docs/verification.md
Part 2, item 4 and item 7's last row): seconds and bytes.

    .venv/bin/python benchmarks/repair.py [--rows 1000000] [--percent 1] [--runs 2]

Starts its own PostgreSQL and nats-server (temp dir), the 9-column table of ``snapshot.py``
with ``--rows`` rows twice: keyed by ``id`` bigint (the repair selects its buckets by a
``WHERE`` on the key hash computed in PostgreSQL) and by ``created_at`` timestamptz (the
tasks read every row and keep those whose converted key falls in the buckets). For each:
a full snapshot and a repair snapshot of ``--percent`` % of the table's buckets (at
``bucket_bits(rows)`` bits, spread over the key space), tasks in this process (no Spark,
msgpack, no compression), best of ``--runs`` each; seconds of the whole snapshot, rows and
chunk bytes (what a mirror reads from ``INIT``).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # snapshot.py's servers

from snapshot import purge_init, start_servers

from cdc_platform.dev.servers import LocalNatsServer, LocalPostgres
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
from cdc_platform.snapshot import SnapshotOptions, SnapshotResult, snapshot_table
from cdc_platform.wire.digest import bucket_bits

ROLE, PASSWORD, PUBLICATION = "bench_reader", "bench-password", "bench_pub"
# table -> its key: selected in SQL (bigint) or filtered in the tasks (timestamptz)
TABLES = {"bench_by_id": "id", "bench_by_time": "created_at"}


def create_tables(pg: LocalPostgres, rows: int) -> None:
    with psycopg.connect(pg.superuser_conninfo(), autocommit=True) as conn:
        for table, key in TABLES.items():
            conn.execute(f"""CREATE TABLE {table} (
                id bigint, customer_id int, status text, amount numeric(12,2), qty int,
                created_at timestamptz, note text, active bool, score float8,
                PRIMARY KEY ({key}))""")
            conn.execute(f"""
                INSERT INTO {table}
                SELECT i, i % 50000, (ARRAY['new','paid','shipped','done','cancelled'])[1 + i % 5],
                       (i % 100000) / 100.0, 1 + i % 9,
                       timestamptz '2024-01-01 00:00+00' + i * interval '1.5 second',
                       'order note ' || md5(i::text), i % 3 <> 0, i / 7.0
                FROM generate_series(1, {rows}) i""")
            conn.execute(f"VACUUM ANALYZE {table}")
        provision_database(conn, publication=PUBLICATION, role=ROLE, tables=list(TABLES),
                           role_password=PASSWORD)
        # as a stopped bridge leaves it: a snapshot writes its watermark only where the
        # bridge's slot will carry it into CDC (no bridge runs here)
        conn.execute("SELECT pg_create_logical_replication_slot('bench_slot', 'pgoutput')")


async def provision_nats(nats: LocalNatsServer) -> None:
    client = await connect_nats(NatsSettings(url=nats.url))
    try:
        await provision(client.jetstream(), NatsTopology())
    finally:
        await client.close()


def best_of(runs: int, nats: LocalNatsServer, settings: PlatformSettings, table: str,
            buckets: tuple[int, list[int]] | None) -> SnapshotResult:
    options = SnapshotOptions(watermark_wait_seconds=0.0)
    best = None
    for _ in range(runs):
        asyncio.run(purge_init(nats))
        result = asyncio.run(snapshot_table(None, settings, table, options=options,
                                            buckets=buckets))
        if best is None or result.duration_seconds < best.duration_seconds:
            best = result
    assert best is not None
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--percent", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-repair-"))
    pg, nats = start_servers(base)
    try:
        asyncio.run(provision_nats(nats))
        started = time.perf_counter()
        create_tables(pg, args.rows)
        print(f"{args.rows:,} rows per table (created in {time.perf_counter() - started:.0f}s)")
        settings = PlatformSettings(
            postgres=PostgresSettings(host=pg.host, port=pg.port, database="postgres",
                                      user=ROLE, password=PASSWORD, publication=PUBLICATION,
                                      slot="bench_slot", sslmode="disable"),
            nats=NatsSettings(url=nats.url), encoding=EncodingSettings())
        bits = bucket_bits(args.rows)
        count = max(1, round((1 << bits) * args.percent / 100))
        buckets = sorted(random.Random(0).sample(range(1 << bits), count))
        print(f"repair: {count} of {1 << bits} buckets ({args.percent:g} %) at {bits} bits; "
              f"in-process tasks, msgpack, no compression, best of {args.runs}")
        for table, key in TABLES.items():
            full = best_of(args.runs, nats, settings, table, None)
            repair = best_of(args.runs, nats, settings, table, (bits, buckets))
            print(f"\n{table} (key {key}):")
            for label, result in (("full", full), ("repair", repair)):
                print(f"  {label:6s}: {result.duration_seconds:7.2f}s  {result.row_count:>9,} "
                      f"rows  {result.bytes_compressed / 1e6:8.1f} MB in "
                      f"{result.batch_count} chunks")
            print(f"  repair/full: {repair.duration_seconds / full.duration_seconds:.3f} of "
                  f"the seconds, {repair.bytes_compressed / full.bytes_compressed:.4f} of the "
                  f"bytes, {repair.row_count / full.row_count:.4f} of the rows")
    finally:
        nats.stop()
        pg.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
