#!/usr/bin/env python
"""Snapshot request latency on an idle dev stack: request -> ``done`` reply (meta stored),
against the Spark job alone for the same table, measured in the same run.

    .venv/bin/python benchmarks/snapshot_request.py [--rows 10000] [--requests 3]

Starts ``cdc-platform dev`` in a temp dir (its own PostgreSQL, nats-server, Dagster webserver
and daemon with the platform's sensors), creates a ``--rows``-row table in the publication and
waits until CDC streams. Then, ``--requests`` times: a request with ``reply_to`` and
``max_age_seconds: 0`` (a new snapshot each time), timing the ``accepted`` and ``done``
replies. The baseline: the same table snapshotted by ``snapshot_table`` on a local Spark
session (forced through Spark), reporting the Spark job alone (``spark_seconds``), the whole
snapshot, and the session start apart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cdc_platform.jetstream.connection import connect_nats
from cdc_platform.postgres.admin import provision_database
from cdc_platform.settings import NatsSettings, load_settings


def _env_file(state: Path) -> dict[str, str]:
    values = {}
    for line in (state / "dev.env").read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        values[key] = value.strip("'")
    return values


def _superuser_conninfo(state: Path, env: dict[str, str]) -> str:
    secrets = dict(line.split("=", 1) for line in (state / "secrets.env").read_text().split())
    return (f"host={env['CDC_PG_HOST']} port={env['CDC_PG_PORT']} dbname=postgres "
            f"user=postgres password={secrets['PG_SUPERUSER_PASSWORD']} sslmode=disable")


async def _wait_for_cdc(url: str, timeout: float = 300) -> None:
    client = await connect_nats(NatsSettings(url=url))
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = await client.jetstream().stream_info("CDC", subjects_filter="cdc.users.>")
            if info.state.subjects:
                return
            await asyncio.sleep(1)
        raise SystemExit("CDC did not start streaming on the dev stack")
    finally:
        await client.close()


async def _request(url: str, table: str) -> tuple[float, float, dict]:
    """Seconds to the ``accepted`` and to the ``done`` reply, and the ``done`` reply."""
    client = await connect_nats(NatsSettings(url=url))
    inbox = f"bench.replies.{time.monotonic_ns()}"
    replies: asyncio.Queue = asyncio.Queue()

    async def on_reply(message) -> None:
        replies.put_nowait((time.monotonic(), json.loads(message.data)))

    await client.subscribe(inbox, cb=on_reply)
    try:
        started = time.monotonic()
        await client.publish(f"snapshot.request.{table}", json.dumps(
            {"request_id": "bench", "reply_to": inbox, "max_age_seconds": 0}).encode())
        await client.flush()
        accepted = done = None
        while done is None:
            at, reply = await asyncio.wait_for(replies.get(), 300)
            if reply["status"] == "accepted":
                accepted = at - started
            elif reply["status"] == "done":
                done = (at - started, reply)
            else:
                raise SystemExit(f"request failed: {reply}")
        return accepted or float("nan"), done[0], done[1]
    finally:
        await client.close()


def _spark_alone(env: dict[str, str], table: str) -> tuple[float, float, float]:
    """(session start, Spark job alone, whole snapshot) in seconds, through Spark."""
    from cdc_platform.snapshot.job import SnapshotOptions, snapshot_table
    from cdc_platform.snapshot.spark_session import local_spark_session

    os.environ.update(env)
    settings = load_settings()
    started = time.monotonic()
    spark = local_spark_session("bench-snapshot-request", master="local[2]")
    session_seconds = time.monotonic() - started
    try:
        result = asyncio.run(snapshot_table(spark, settings, table, options=SnapshotOptions(
            small_table_bytes=0, watermark_wait_seconds=10)))
        return session_seconds, result.spark_seconds, result.duration_seconds
    finally:
        spark.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the temp dir (its dev.log)")
    args = parser.parse_args()
    state = Path(tempfile.mkdtemp(prefix="cdc-bench-req-")) / "state"
    cli = Path(sys.executable).parent / "cdc-platform"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CDC_", "PG_", "NATS_"))}
    # each request a new snapshot: this times a run, not the reuse that pacing would answer with
    env["CDC_SNAPSHOT_MIN_INTERVAL"] = "0"
    log = open(state.parent / "dev.log", "wb")  # noqa: SIM115 - lives as long as the stack
    stack = subprocess.Popen([str(cli), "dev", "--state-dir", str(state)], env=env, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (state / "dev.env").exists() or b"Press Ctrl-C" not in (
                state.parent / "dev.log").read_bytes():
            if time.monotonic() > deadline or stack.poll() is not None:
                raise SystemExit("the dev stack did not come up: "
                                 + (state.parent / "dev.log").read_text()[-2000:])
            time.sleep(1)
        dev_env = _env_file(state)
        url = dev_env["CDC_NATS_URL"]
        asyncio.run(_wait_for_cdc(url))
        table = "bench_requested"
        with psycopg.connect(_superuser_conninfo(state, dev_env), autocommit=True) as conn:
            conn.execute(f"CREATE TABLE {table} (id bigint PRIMARY KEY, name text, "
                         "amount numeric(12,2), created timestamptz DEFAULT now())")
            conn.execute(f"INSERT INTO {table} (id, name, amount) SELECT i, 'name ' || i, "
                         f"i / 7.0 FROM generate_series(1, {args.rows}) i")
            # as a DBA does: the publication, then the role's grants (cdc_platform/sql/, re-run)
            provision_database(conn, publication=dev_env["CDC_PUBLICATION"],
                               role=dev_env.get("CDC_PG_USER", "bridge_reader"), tables=[table])
        time.sleep(3)  # the idle stack: sensors ticking, nothing running
        latencies = []
        for number in range(args.requests):
            accepted, done, reply = asyncio.run(_request(url, table))
            latencies.append(done)
            print(f"request {number + 1}: accepted after {accepted:.1f}s, done after "
                  f"{done:.1f}s (snapshot {reply['snapshot_id']})", flush=True)
        session, spark_job, whole = _spark_alone(dev_env, table)
        median = statistics.median(latencies)
        print(f"\n{args.rows} rows, {args.requests} requests on an idle dev stack")
        print(f"request -> done: median {median:.1f}s (min {min(latencies):.1f}s, "
              f"max {max(latencies):.1f}s); target <= 10s")
        print(f"baseline, same run: Spark job alone {spark_job:.1f}s, the whole snapshot "
              f"through Spark {whole:.1f}s, plus Spark session start {session:.1f}s")
        print(f"request -> done / (session + whole Spark snapshot): "
              f"{median / (session + whole):.2f}")
    finally:
        stack.send_signal(signal.SIGINT)
        try:
            stack.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(stack.pid, signal.SIGKILL)
        log.close()
        if args.keep:
            print(f"kept {state.parent}")
        else:
            shutil.rmtree(state.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
