"""A stop request is honoured in every phase: SIGTERM at random moments from exec onward (an
orchestrator sends it whenever it likes), and the stop fits the shutdown budget."""

from __future__ import annotations

import asyncio
import random
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Self

import msgpack

from cdc_platform.dev.servers import LocalNatsServer, free_port
from cdc_platform.jetstream.connection import connect_nats
from cdc_platform.jetstream.provision import provision
from cdc_platform.settings import NatsSettings, NatsTopology
from cdc_platform_tests.fixtures.bridge import running_bridge, wait_for
from cdc_platform_tests.fixtures.responder import snapshot_responder
from cdc_platform_tests.fixtures.services import (
    CLI,
    bridge_env,
    platform_settings,
    random_name,
    read_subjects,
)

# Python starting and loading the command line (~0.1 s): a SIGTERM before the command's
# handler is installed ends the process by the default action, before it did anything.
INTERPRETER_START = 0.3


class Writes:
    """A writer thread: one transaction every few ms, ids first, first + 1, ..., now and then
    one of 2,000 rows (an in-flight window to drain)."""

    def __init__(self, pg_admin, table: str, first: int = 0) -> None:
        self.pg_admin, self.table = pg_admin, table
        self.first = self.written = first
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._write, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def _write(self) -> None:
        transactions = 0
        while not self._stop.wait(0.005):
            transactions += 1
            size = 2_000 if transactions % 100 == 0 else 1
            self.pg_admin.execute(f"INSERT INTO {self.table} (id) SELECT "
                                  "generate_series(%s::int, %s::int)",
                                  (self.written, self.written + size - 1))
            self.written += size


def _in_flight(log_path: Path) -> int:
    """The in-flight messages of the bridge's last METRICS line (0 before one)."""
    found = re.findall(rb"METRICS .* in_flight=(\d+)", log_path.read_bytes())
    return int(found[-1]) if found else 0


def _delays(count: int, longest: float, chance: random.Random) -> list[float]:
    """``count`` random moments in [0, longest], one in each of ``count`` equal spans (every
    phase of a start gets its turn), shuffled."""
    span = longest / count
    delays = [(i + chance.random()) * span for i in range(count)]
    chance.shuffle(delays)
    return delays


def _stop_at_random_moments(command: list[str], env: dict[str, str], log_path: Path,
                            count: int, budget: float) -> list[tuple[float, int | None, float]]:
    """Start ``command`` ``count`` times, SIGTERM it after a random delay from exec: (delay,
    exit code or None when it did not exit within ``budget`` + 5 s, seconds to exit)."""
    chance = random.Random()
    outcomes = []
    with open(log_path, "ab") as log:
        for delay in _delays(count, 3.0, chance):
            log.write(f"--- SIGTERM after {delay:.3f}s\n".encode())
            log.flush()
            process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
            time.sleep(delay)
            process.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            try:
                code: int | None = process.wait(budget + 5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                code = None
            outcomes.append((round(delay, 3), code, round(time.monotonic() - sent, 2)))
    return outcomes


def _assert_stopped_cleanly(outcomes, budget: float, log_path: Path) -> None:
    late = [(delay, code, took) for delay, code, took in outcomes
            if took > budget or code is None or not (
                code == 0 or (code == -signal.SIGTERM and delay < INTERPRETER_START))]
    assert not late, f"{late} of {outcomes}\n" + log_path.read_text()[-6000:]


async def test_the_bridge_stops_on_sigterm_at_any_moment(cdc_database, pg_admin,
                                                         provisioned_nats, nats_client,
                                                         tmp_path):
    """SIGTERM at random moments of a start under load: exit 0 within CDC_SHUTDOWN_TIMEOUT
    every time, and whatever the slot confirmed was stored (a bridge resuming from the slot
    delivers every row)."""
    table = random_name("stops")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    cdc_database.add_tables(pg_admin, table)
    budget = 5.0
    env = {**bridge_env(cdc_database, provisioned_nats.url), "CDC_SLOT": cdc_database.slot,
           "CDC_PUBLICATION": cdc_database.publication, "CDC_SHUTDOWN_TIMEOUT": f"{budget}s",
           "CDC_STATUS_INTERVAL": "0.5s"}
    log_path = tmp_path / "bridge.log"
    pg_admin.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')",
                     (cdc_database.slot,))
    with Writes(pg_admin, table) as writes:
        outcomes = await asyncio.to_thread(_stop_at_random_moments, [CLI, "bridge"], env,
                                           log_path, 20, budget)
    _assert_stopped_cleanly(outcomes, budget, log_path)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    async with running_bridge(settings):
        messages = await read_subjects(nats_client, "CDC", f"cdc.{table}.>",
                                       expect=writes.written, timeout=60)
    ids = sorted(msgpack.unpackb(m.data)["data"]["id"] for m in messages)
    assert ids == list(range(writes.written))  # nothing lost, nothing twice


async def test_the_mirror_stops_on_sigterm_at_any_moment(cdc_database, pg_admin,
                                                         provisioned_nats, tmp_path):
    table = random_name("mstops")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    pg_admin.execute(f"INSERT INTO {table} SELECT generate_series(1, 1000)")
    cdc_database.add_tables(pg_admin, table)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    env = {**bridge_env(cdc_database, provisioned_nats.url)}
    log_path = tmp_path / "mirror.log"
    command = [CLI, "mirror", "--tables", table, "--sqlite", str(tmp_path / "mirror.db")]
    async with running_bridge(settings), snapshot_responder(settings):
        await wait_for(lambda: pg_admin.execute(
            "SELECT 1 FROM pg_replication_slots WHERE slot_name = %s",
            (cdc_database.slot,)).fetchone() is not None, timeout=60)
        with Writes(pg_admin, table, first=1001):
            outcomes = await asyncio.to_thread(_stop_at_random_moments, command, env,
                                               log_path, 12, 5.0)
    _assert_stopped_cleanly(outcomes, 5.0, log_path)


async def test_a_stop_while_nats_holds_messages_fits_the_shutdown_budget(
        cdc_database, pg_admin, tmp_path):
    """NATS gone with messages in flight: the whole stop, from SIGTERM to exit, takes at most
    CDC_SHUTDOWN_TIMEOUT (it took the budget plus up to a status interval and more)."""
    port = free_port()
    nats = LocalNatsServer(tmp_path / "nats", port=port)
    nats.start()
    try:
        client = await connect_nats(NatsSettings(url=nats.url))
        await provision(client.jetstream(), NatsTopology())
        await client.close()
        table = random_name("held")
        pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
        cdc_database.add_tables(pg_admin, table)
        budget = 3.0
        env = {**bridge_env(cdc_database, nats.url), "CDC_SLOT": cdc_database.slot,
               "CDC_PUBLICATION": cdc_database.publication,
               "CDC_SHUTDOWN_TIMEOUT": f"{budget}s", "CDC_STATUS_INTERVAL": "1s",
               "CDC_MAX_IN_FLIGHT": "1000", "CDC_METRICS_LOG_INTERVAL": "0.2s"}
        log_path = tmp_path / "bridge.log"
        with open(log_path, "ab") as log:
            bridge = subprocess.Popen([CLI, "bridge"], env=env, stdout=log,
                                      stderr=subprocess.STDOUT)
        try:
            await wait_for(lambda: b"streaming slot" in log_path.read_bytes(), timeout=60)
            pg_admin.execute(f"INSERT INTO {table} VALUES (0)")  # its schema event, stored
            await wait_for(lambda: b"cdc_events=1 " in log_path.read_bytes(), timeout=60,
                           what="the first change published")
            await asyncio.sleep(0.5)
            nats.stop()
            pg_admin.execute(f"INSERT INTO {table} SELECT generate_series(1, 5000)")
            await wait_for(lambda: _in_flight(log_path) >= 500, timeout=30,
                           what="an in-flight window held")
            await asyncio.sleep(1.3)  # mid status interval
            bridge.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            code = await asyncio.to_thread(bridge.wait, 30)
            took = time.monotonic() - sent
        finally:
            if bridge.poll() is None:
                bridge.kill()
                bridge.wait()
        assert code == 0, log_path.read_text()[-3000:]
        assert took <= budget, (took, log_path.read_text()[-3000:])
    finally:
        nats.stop()
