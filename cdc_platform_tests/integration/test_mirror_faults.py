"""The exactness suite under faults: each fault in its own test, the same assertion (every
mirrored table equals its source; the keyless ledger, written once by every transaction, shows
any transaction applied twice as a duplicate row) and no divergence along the way."""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import signal
import sqlite3
import subprocess
from pathlib import Path

import psycopg
import pytest

from cdc_platform.dev.servers import LocalNatsServer, free_port, start_logical_postgres
from cdc_platform.jetstream.connection import connect_nats
from cdc_platform.jetstream.provision import provision
from cdc_platform.mirror.follower import Mirror
from cdc_platform.mirror.positions import STATE_TABLE
from cdc_platform.postgres.admin import provision_database
from cdc_platform.replication.slots import read_slot
from cdc_platform.settings import MirrorSettings, NatsSettings, NatsTopology
from cdc_platform.snapshot.job import SnapshotOptions
from cdc_platform.snapshot.reader import TaskFault
from cdc_platform_tests.exactness import (
    Workload,
    WorkloadSize,
    bridge_caught_up,
    differences,
    mirror_caught_up,
    reporter,
)
from cdc_platform_tests.fixtures.bridge import running_bridge, wait_for
from cdc_platform_tests.fixtures.responder import snapshot_responder
from cdc_platform_tests.fixtures.services import (
    CLI,
    CdcDatabase,
    bridge_env,
    platform_settings,
    random_name,
)

FAST = MirrorSettings(status_interval_seconds=2.0, snapshot_wait_seconds=300.0)
SMALL = WorkloadSize(transactions=150, initial_rows=200, copy_rows=2_000,
                     big_transaction_rows=20_000, pace_seconds=0.05)


def _no_divergence(lines: list[str]) -> None:
    assert not [line for line in lines if "does not hold" in line or "already mirrored" in line
                or "missing from the stream" in line], lines


async def _exact(workload: Workload, settings, conninfo: str, db: Path, slot_admin, slot: str,
                 nats_client, *, during=None, lines: list[str]) -> Mirror:
    """The workload (a tenth first), a mirror started meanwhile, ``during(progress)`` run
    alongside (the fault), then everything caught up and compared."""
    await asyncio.to_thread(workload.run, conninfo, workload.size.transactions // 10)
    mirror = Mirror(settings, workload.wire_tables(), db, options=FAST, report=reporter(lines))
    stop = asyncio.Event()
    mirroring = asyncio.create_task(mirror.run(stop))
    rest = asyncio.create_task(asyncio.to_thread(workload.run, conninfo,
                                                 workload.size.transactions - workload.done))
    if during is not None:
        await during(workload, mirror)
    await rest
    await bridge_caught_up(slot_admin, slot)
    await mirror_caught_up(mirror, mirroring, nats_client)
    stop.set()
    await asyncio.wait_for(mirroring, 60)
    assert differences(conninfo, workload, db) == {}, "\n".join(lines[-30:])
    _no_divergence(lines)
    return mirror


def _bridge_env(database: CdcDatabase, nats_url: str) -> dict[str, str]:
    return {**bridge_env(database, nats_url), "CDC_SLOT": database.slot,
            "CDC_PUBLICATION": database.publication, "CDC_HEARTBEAT_INTERVAL": "1s",
            "CDC_STATUS_INTERVAL": "0.5s"}




async def test_the_bridge_killed_again_and_again(cdc_database, pg_admin, provisioned_nats,
                                                 nats_client, tmp_path):
    """SIGKILL at random moments, three times: each restart resends from the last
    confirmed commit; the mirror applies each transaction once."""
    workload = Workload(random_name("bkill"), seed=11, size=SMALL)
    cdc_database.add_tables(pg_admin, *workload.create(pg_admin))
    settings = platform_settings(cdc_database, provisioned_nats.url)
    env = _bridge_env(cdc_database, provisioned_nats.url)
    log = open(tmp_path / "bridge.log", "wb")  # noqa: SIM115 - shared by the restarts
    bridges = [subprocess.Popen([CLI, "bridge"], env=env, stdout=log, stderr=subprocess.STDOUT)]
    lines: list[str] = []
    chance = random.Random(3)

    async def kill_three_times(workload: Workload, mirror: Mirror) -> None:
        for _ in range(3):
            await asyncio.sleep(chance.uniform(1.0, 4.0))
            bridges[-1].send_signal(signal.SIGKILL)
            bridges[-1].wait()
            await asyncio.sleep(chance.uniform(0.0, 1.0))
            bridges.append(subprocess.Popen([CLI, "bridge"], env=env, stdout=log,
                                            stderr=subprocess.STDOUT))

    try:
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None, timeout=60)
        async with snapshot_responder(settings):
            await _exact(workload, settings, cdc_database.server.superuser_conninfo(),
                         tmp_path / "mirror.db", pg_admin, cdc_database.slot, nats_client,
                         during=kill_three_times, lines=lines)
    finally:
        bridges[-1].send_signal(signal.SIGTERM)
        bridges[-1].wait(30)
    assert len(bridges) == 4


async def test_nats_server_restarted(cdc_database, pg_admin, tmp_path):
    port = free_port()
    nats = LocalNatsServer(tmp_path / "nats", port=port)
    nats.start()
    client = await connect_nats(NatsSettings(url=nats.url))
    await provision(client.jetstream(), NatsTopology())
    workload = Workload(random_name("nrestart"), seed=12, size=SMALL)
    cdc_database.add_tables(pg_admin, *workload.create(pg_admin))
    settings = platform_settings(cdc_database, nats.url)
    lines: list[str] = []

    async def restart_nats(workload: Workload, mirror: Mirror) -> None:
        nonlocal nats
        await wait_for(lambda: mirror.bootstraps >= 4, timeout=120, what="the bootstraps")
        await asyncio.sleep(1.0)
        nats.stop()
        await asyncio.sleep(3.0)
        nats = LocalNatsServer(tmp_path / "nats", port=port)
        nats.start()

    try:
        async with running_bridge(settings), snapshot_responder(settings):
            await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
            await _exact(workload, settings, cdc_database.server.superuser_conninfo(),
                         tmp_path / "mirror.db", pg_admin, cdc_database.slot, client,
                         during=restart_nats, lines=lines)
    finally:
        with contextlib.suppress(Exception):
            await client.close()
        nats.stop()


async def test_postgres_restarted(provisioned_nats, nats_client, tmp_path, server_dir):
    """A private PostgreSQL, restarted mid-workload: the bridge reconnects and resumes from
    its slot; the workload's transactions in flight fail and are not counted."""
    server = start_logical_postgres(server_dir / "pg", unsafe_no_fsync=True)
    try:
        database = CdcDatabase(server=server, publication="pub_restart", role="mirror_reader",
                               password=secrets.token_urlsafe(12), slot="slot_restart")
        with psycopg.connect(server.superuser_conninfo(), autocommit=True) as admin:
            provision_database(admin, publication=database.publication, role=database.role,
                               tables=[], role_password=database.password)
            workload = Workload(random_name("pgrestart"), seed=13, size=SMALL)
            database.add_tables(admin, *workload.create(admin))
        settings = platform_settings(database, provisioned_nats.url)
        conninfo = server.superuser_conninfo()
        lines: list[str] = []

        async def restart_postgres(workload: Workload, mirror: Mirror) -> None:
            await asyncio.sleep(3.0)
            workload.pause.set()
            await asyncio.to_thread(server.restart)
            workload.pause.clear()

        async with running_bridge(settings), snapshot_responder(settings):
            with psycopg.connect(conninfo, autocommit=True) as admin:
                await wait_for(lambda: read_slot(admin, database.slot) is not None)
            await _exact(workload, settings, conninfo, tmp_path / "mirror.db",
                         _Reconnecting(conninfo), database.slot, nats_client,
                         during=restart_postgres, lines=lines)
    finally:
        server.stop("immediate")


class _Reconnecting:
    """A superuser connection for the checks that survives the server's restart."""

    def __init__(self, conninfo: str) -> None:
        self.conninfo = conninfo

    def execute(self, query, params=None):
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            rows = conn.execute(query, params).fetchall()

        class _Result:
            def fetchone(self_inner):
                return rows[0] if rows else None
        return _Result()


async def test_the_mirror_killed_mid_bootstrap_and_mid_stream(
        cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path):
    """`cdc-platform mirror` killed with SIGKILL while loading a snapshot and while applying
    the large transaction; each restart resumes from what the SQLite file holds."""
    size = WorkloadSize(transactions=150, initial_rows=40_000, copy_rows=2_000,
                        big_transaction_rows=60_000, pace_seconds=0.05)
    workload = Workload(random_name("mkill"), seed=14, size=size)
    cdc_database.add_tables(pg_admin, *workload.create(pg_admin))
    settings = platform_settings(cdc_database, provisioned_nats.url)
    env = _bridge_env(cdc_database, provisioned_nats.url)
    env["CDC_MIRROR_STATUS_INTERVAL"] = "1s"
    db = tmp_path / "mirror.db"
    command = [CLI, "mirror", "--tables", ",".join(workload.wire_tables()), "--sqlite", str(db)]
    output = open(tmp_path / "mirror.log", "wb")  # noqa: SIM115 - shared by the restarts
    conninfo = cdc_database.server.superuser_conninfo()

    def state() -> dict[str, tuple[str, int]]:
        if not db.exists():
            return {}
        with contextlib.closing(sqlite3.connect(db)) as local:
            try:
                return {table: (status, seq) for table, status, seq in local.execute(
                    f"SELECT wire_table, status, stream_seq FROM {STATE_TABLE}")}
            except sqlite3.OperationalError:
                return {}

    def loaded_rows(table: str) -> int:
        with contextlib.closing(sqlite3.connect(db)) as local:
            try:
                return local.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0]
            except sqlite3.OperationalError:
                return 0

    async with running_bridge(settings), snapshot_responder(settings):
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
        await asyncio.to_thread(workload.run, conninfo, 10)
        mirror = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
        # 1. killed while a table is half loaded
        await wait_for(lambda: any(status == "bootstrapping" and loaded_rows(table) > 0
                                   for table, (status, _) in state().items()),
                       timeout=120, interval=0.02, what="a bootstrap under way")
        mirror.send_signal(signal.SIGKILL)
        mirror.wait()
        half = {table: status for table, (status, _) in state().items()}
        assert "bootstrapping" in half.values()
        mirror = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
        rest = asyncio.create_task(asyncio.to_thread(workload.run, conninfo,
                                                     size.transactions - workload.done))
        # 2. killed while streaming (inside the large transaction, most likely)
        await wait_for(lambda: len(state()) == 4 and all(
            status == "streaming" for status, _ in state().values()), timeout=180,
            what="every table streaming")
        await wait_for(lambda: workload.done >= workload.size.transactions * 0.45, timeout=120)
        await asyncio.sleep(0.5)
        mirror.send_signal(signal.SIGKILL)
        mirror.wait()
        await rest
        await bridge_caught_up(pg_admin, cdc_database.slot)
        # 3. started again: catch up and exit
        finished = await asyncio.to_thread(subprocess.run, [*command, "--once"], env=env,
                                           stdout=output, stderr=subprocess.STDOUT,
                                           timeout=300)
        assert finished.returncode == 0, (tmp_path / "mirror.log").read_text()[-3000:]
    log_text = (tmp_path / "mirror.log").read_text()
    assert differences(conninfo, workload, db) == {}, log_text[-3000:]
    _no_divergence(log_text.splitlines())
    assert log_text.count("bootstrapping (an interrupted bootstrap)") >= 1


@pytest.mark.spark
async def test_a_snapshot_task_failing_once(cdc_database, pg_admin, provisioned_nats,
                                            nats_client, spark_session, tmp_path):
    """The first attempt of a Spark task fails after publishing a chunk; its retry publishes
    the range again. The mirror reads every chunk once."""
    workload = Workload(random_name("sfail"), seed=15, size=SMALL)
    cdc_database.add_tables(pg_admin, *workload.create(pg_admin))
    settings = platform_settings(cdc_database, provisioned_nats.url)
    lines: list[str] = []
    async with running_bridge(settings), snapshot_responder(
            settings, spark=spark_session, fault=TaskFault(partition=0, after_chunks=1),
            options=SnapshotOptions(small_table_bytes=0)) as taken:
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
        await _exact(workload, settings, cdc_database.server.superuser_conninfo(),
                     tmp_path / "mirror.db", pg_admin, cdc_database.slot, nats_client,
                     lines=lines)
    # the fault happened: a first attempt failed after storing a chunk, its retry stored the
    # range again (dropped as duplicates)
    retried = [r for result in taken for r in result.ranges if r.attempt == 1]
    assert retried and all(r.duplicates >= 1 for r in retried)
