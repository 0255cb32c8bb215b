#!/usr/bin/env python
"""JetStreamPublisher throughput and latency against nats-py's ``js.publish_async``.

Starts its own nats-server (temp dir, file storage), and for every approach and run recreates
the stream, publishes the same CDC-like messages (msgpack rows of ~226 B, one unique
``Nats-Msg-Id`` each, twelve subjects), waits until JetStream acknowledged all of them and
checks the stream holds exactly that many. Prints msgs/s, the ratio to the baseline measured in
the same run, and CPU (% of one core) of this process and of nats-server.

Then steady traffic: transactions of a few changes at fixed rates (default 2K and 20K
changes/s), measuring publish() call → position stored (p50/p99/max) and the CPU it costs.

    .venv/bin/python benchmarks/publish.py [--messages 200000] [--runs 3] [--rates 2000,20000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgpack
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import NotFoundError

from cdc_platform.dev.servers import LocalNatsServer
from cdc_platform.jetstream.connection import connect_nats
from cdc_platform.publishing import JetStreamPublisher, OutgoingMessage
from cdc_platform.publishing.messages import PublishMode
from cdc_platform.settings import NatsSettings

STREAM = "BENCH"
SUBJECTS = [f"bench.{table}.{op}" for table in ("users", "orders", "items", "accounts")
            for op in ("insert", "update", "delete")]


def change_row(i: int) -> dict:
    """A change event shaped like the bridge's (the payload size matters, not the content)."""
    return {"op": "insert", "schema": "public", "table": "users",
            "lsn": f"0/{0x16B3748 + i * 64:X}", "xid": 700000 + i // 10,
            "ts": 1_760_000_000_000_000 + i, "id": i, "email": f"user{i}@example.com",
            "name": f"User Number {i}",
            "data": {"plan": "pro", "active": True, "score": i * 0.5, "tags": ["a", "b"],
                     "note": "x" * 40}}


@dataclass
class Workload:
    subjects: list[str]
    payloads: list[bytes]

    @classmethod
    def make(cls, count: int) -> Workload:
        return cls([SUBJECTS[i % len(SUBJECTS)] for i in range(count)],
                   [msgpack.packb(change_row(i)) for i in range(count)])

    def msg_ids(self) -> list[str]:
        """Unique per run, so no run is deduplicated against an earlier one."""
        prefix = uuid.uuid4().hex[:10]
        return [f"{prefix}/{i:X}" for i in range(len(self.payloads))]


class CpuClock:
    """Wall time and CPU of this process and of nats-server between start() and stop()."""

    def __init__(self, server_pid: int) -> None:
        self._pid = server_pid
        self._ticks = os.sysconf("SC_CLK_TCK")

    def _server_cpu(self) -> float:
        with open(f"/proc/{self._pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self._ticks   # utime + stime

    def start(self) -> None:
        self._wall, self._client, self._server = (time.perf_counter(), time.process_time(),
                                                  self._server_cpu())

    def stop(self) -> tuple[float, float, float]:
        wall = time.perf_counter() - self._wall
        return (wall, (time.process_time() - self._client) / wall * 100,
                (self._server_cpu() - self._server) / wall * 100)


# -- approaches: publish everything, return once JetStream acknowledged all of it -------------
async def baseline_publish_async(nc, work: Workload, ids: list[str], chunk: int) -> None:
    """nats-py's own pipelined publish: one future per message, 4000 pending (its sweet spot)."""
    js = nc.jetstream(publish_async_max_pending=4000)
    futures = []
    for subject, payload, msg_id in zip(work.subjects, work.payloads, ids, strict=True):
        futures.append(await js.publish_async(subject, payload, headers={"Nats-Msg-Id": msg_id}))
    await asyncio.wait_for(js.publish_async_completed(), 60)
    failed = [future.exception() for future in futures if future.exception() is not None]
    if failed:
        raise RuntimeError(f"{len(failed)} publishes failed, first: {failed[0]!r}")


def with_publisher(mode: PublishMode) -> Callable[..., Awaitable[None]]:
    async def run(nc, work: Workload, ids: list[str], chunk: int) -> None:
        publisher = JetStreamPublisher(nc, stream=STREAM, mode=mode)
        await publisher.start()
        subjects, payloads = work.subjects, work.payloads
        for start in range(0, len(payloads), chunk):
            end = min(start + chunk, len(payloads))
            # Building the messages is part of the cost the bridge pays, so it is timed.
            await publisher.publish([OutgoingMessage(subjects[i], ids[i], payloads[i])
                                     for i in range(start, end)], position=end)
        if await publisher.flush(timeout=60) != len(payloads):
            raise RuntimeError("not every position was stored")
        await publisher.close()
    return run


APPROACHES: dict[str, Callable[..., Awaitable[None]]] = {
    "baseline js.publish_async": baseline_publish_async,
    "fast-batch": with_publisher("fast-batch"),
    "per-message": with_publisher("per-message"),
}


async def fresh_stream(js) -> None:
    with contextlib.suppress(NotFoundError):
        await js.delete_stream(STREAM)
    await js.add_stream(StreamConfig(name=STREAM, subjects=["bench.>"], storage=StorageType.FILE,
                                     duplicate_window=120, allow_batched=True))


async def throughput(nc, server_pid: int, work: Workload, runs: int, chunk: int) -> None:
    js = nc.jetstream()
    clock = CpuClock(server_pid)
    best: dict[str, tuple[float, float, float]] = {}
    print(f"throughput: {len(work.payloads):,} messages, "
          f"{sum(map(len, work.payloads)) / len(work.payloads):.0f} B payload, "
          f"publish() calls of {chunk}")
    for run in range(runs):
        for name, approach in APPROACHES.items():
            await fresh_stream(js)
            ids = work.msg_ids()
            clock.start()
            await approach(nc, work, ids, chunk)
            wall, client_cpu, server_cpu = clock.stop()
            stored = (await js.stream_info(STREAM)).state.messages
            if stored != len(ids):
                raise RuntimeError(f"{name}: stream holds {stored}, expected {len(ids)}")
            rate = len(ids) / wall
            print(f"  run {run + 1} {name:26s} {rate:9,.0f} msgs/s  client {client_cpu:4.0f} %"
                  f"  server {server_cpu:4.0f} %")
            if name not in best or rate > best[name][0]:
                best[name] = (rate, client_cpu, server_cpu)
    baseline = best["baseline js.publish_async"][0]
    print(f"\nbest of {runs} runs")
    print(f"  {'approach':26s} {'msgs/s':>9s} {'x base':>7s} {'client %':>9s} {'server %':>9s}")
    for name, (rate, client_cpu, server_cpu) in best.items():
        print(f"  {name:26s} {rate:9,.0f} {rate / baseline:6.2f}x {client_cpu:9.0f} "
              f"{server_cpu:9.0f}")


async def steady_latency(nc, server_pid: int, mode: PublishMode | Literal["baseline"],
                         rate: int, seconds: float,
                         transaction: int) -> None:
    """Transactions of ``transaction`` changes at ``rate`` changes/s: publish() → stored."""
    js = nc.jetstream()
    await fresh_stream(js)
    loop = asyncio.get_running_loop()
    published_at: dict[int, float] = {}
    latencies: list[float] = []
    reported = [0]

    def stored(position: int) -> None:
        now = loop.time()
        for done in range(reported[0] + 1, position + 1):
            latencies.append(now - published_at.pop(done))
        reported[0] = position

    count = int(rate * seconds) // transaction
    work = Workload.make(count * transaction)
    ids = work.msg_ids()
    interval = transaction / rate
    clock = CpuClock(server_pid)
    if mode == "baseline":
        js_async = nc.jetstream(publish_async_max_pending=4000)
    else:
        publisher = JetStreamPublisher(nc, stream=STREAM, mode=mode, on_stored=stored)
        await publisher.start()
    clock.start()
    start = loop.time()
    for txn in range(1, count + 1):
        delay = start + txn * interval - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        first = (txn - 1) * transaction
        published_at[txn] = loop.time()
        if mode == "baseline":
            # A transaction is stored when its last future completes.
            futures = [await js_async.publish_async(work.subjects[i], work.payloads[i],
                                                    headers={"Nats-Msg-Id": ids[i]})
                       for i in range(first, first + transaction)]
            started = published_at.pop(txn)

            def transaction_stored(_: asyncio.Future, started: float = started) -> None:
                latencies.append(loop.time() - started)

            asyncio.gather(*futures).add_done_callback(transaction_stored)
        else:
            await publisher.publish([OutgoingMessage(work.subjects[i], ids[i], work.payloads[i])
                                     for i in range(first, first + transaction)], position=txn)
    if mode == "baseline":
        await js_async.publish_async_completed()
        await asyncio.sleep(0.05)
    else:
        await publisher.flush(timeout=30)
        await publisher.close()
    _, client_cpu, server_cpu = clock.stop()
    latencies.sort()
    p50 = statistics.median(latencies) * 1000
    p99 = latencies[int(len(latencies) * 0.99) - 1] * 1000
    print(f"  {mode:12s} {len(latencies):6d} txns  p50 {p50:6.2f} ms  p99 {p99:6.2f} ms  "
          f"max {latencies[-1] * 1000:6.2f} ms  client {client_cpu:3.0f} %  "
          f"server {server_cpu:3.0f} %")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=500, help="messages per publish() call")
    parser.add_argument("--rates", default="2000,20000",
                        help="steady runs: changes per second, comma-separated")
    parser.add_argument("--seconds", type=float, default=5.0, help="steady run: duration")
    parser.add_argument("--transaction", type=int, default=4, help="steady run: changes per txn")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="publish-bench-") as directory:
        server = LocalNatsServer(Path(directory) / "nats")
        server.start()
        try:
            assert server.process is not None
            nc = await connect_nats(NatsSettings(url=server.url), name="publish-benchmark")
            try:
                await throughput(nc, server.process.pid, Workload.make(args.messages),
                                 args.runs, args.chunk)
                for rate in (int(text) for text in args.rates.split(",")):
                    print(f"\nsteady {rate:,} changes/s in transactions of {args.transaction} "
                          f"for {args.seconds:g} s: publish() → position stored")
                    for mode in ("baseline", "fast-batch", "per-message"):
                        await steady_latency(nc, server.process.pid, mode, rate, args.seconds,
                                             args.transaction)
            finally:
                await nc.close()
        finally:
            server.stop()


if __name__ == "__main__":
    asyncio.run(main())
