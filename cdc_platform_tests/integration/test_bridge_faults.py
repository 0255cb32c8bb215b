"""The bridge at start and stop under faults, against real servers: NATS unreachable or refusing
our credentials, PostgreSQL unreachable, a wrong password, a missing publication, a stop while
NATS is down; each ends promptly with one clear line, or waits with backoff and stays
stoppable."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time

import msgpack
import pytest
from pydantic import SecretStr

from cdc_platform.bridge.runner import CdcBridge
from cdc_platform.dev.servers import LocalNatsServer, free_port
from cdc_platform.errors import NatsAuthError, ReplicationConfigError
from cdc_platform.jetstream.connection import connect_nats
from cdc_platform.jetstream.provision import provision
from cdc_platform.lsn import parse_lsn
from cdc_platform.settings import NatsSettings, NatsTopology
from cdc_platform_tests.fixtures.bridge import running_bridge, slot_confirmed, wait_for
from cdc_platform_tests.fixtures.services import platform_settings, random_name, read_subjects


async def _run_then_stop(bridge: CdcBridge, after: float) -> float:
    """Seconds from the stop request to the end of ``run()``."""
    task = asyncio.create_task(bridge.run())
    await asyncio.sleep(after)
    assert not task.done(), task.exception() if task.done() else None
    stopped_at = time.monotonic()
    bridge.request_stop()
    await asyncio.wait_for(task, 30)
    return time.monotonic() - stopped_at


async def test_unreachable_nats_is_retried_and_the_bridge_stays_stoppable(
        cdc_database, caplog):
    settings = platform_settings(cdc_database, f"nats://127.0.0.1:{free_port()}")
    caplog.set_level(logging.WARNING)
    took = await _run_then_stop(CdcBridge(settings), after=2.5)
    assert took < 2.0
    assert caplog.text.count("cannot reach NATS at nats://127.0.0.1") >= 2  # one per attempt
    assert "retrying in" in caplog.text


async def test_refused_nats_credentials_are_fatal_at_once(cdc_database, tmp_path):
    server = LocalNatsServer(tmp_path / "nats", user="bridge", password="right-secret")
    server.start()
    try:
        settings = platform_settings(cdc_database, server.url)
        settings = settings.model_copy(update={"nats": NatsSettings(
            url=server.url, user="bridge", password="wrong-secret")})
        started = time.monotonic()
        with pytest.raises(NatsAuthError, match="refused our credentials") as raised:
            await asyncio.wait_for(CdcBridge(settings).run(), 20)
        assert time.monotonic() - started < 10
        assert "wrong-secret" not in str(raised.value)
    finally:
        server.stop()


async def test_unreachable_postgres_at_start_is_retried_and_stoppable(
        cdc_database, provisioned_nats, caplog):
    settings = platform_settings(cdc_database, provisioned_nats.url)
    settings = settings.model_copy(update={"postgres": settings.postgres.model_copy(
        update={"port": free_port()})})
    caplog.set_level(logging.WARNING)
    took = await _run_then_stop(CdcBridge(settings), after=2.0)
    assert took < 3.0
    assert caplog.text.count("PostgreSQL unreachable") >= 2


async def test_wrong_password_is_one_fatal_line(cdc_database, provisioned_nats):
    settings = platform_settings(cdc_database, provisioned_nats.url)
    settings = settings.model_copy(update={"postgres": settings.postgres.model_copy(
        update={"password": SecretStr("not-the-password")})})
    with pytest.raises(ReplicationConfigError, match="password authentication failed") as raised:
        await asyncio.wait_for(CdcBridge(settings).run(), 20)
    assert "not-the-password" not in str(raised.value)


async def test_missing_publication_names_it(cdc_database, provisioned_nats):
    settings = platform_settings(cdc_database, provisioned_nats.url)
    settings = settings.model_copy(update={"postgres": settings.postgres.model_copy(
        update={"publication": "no_such_pub"})})
    with pytest.raises(ReplicationConfigError,
                       match="publication no_such_pub does not exist"):
        await asyncio.wait_for(CdcBridge(settings).run(), 20)


async def test_publication_dropped_while_streaming_surfaces_the_server_error(
        cdc_database, pg_admin, provisioned_nats):
    """PostgreSQL reports a missing publication only once it decodes a change; its message
    (not libpq's later "no COPY in progress") ends the bridge."""
    table = random_name("dropped")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    cdc_database.add_tables(pg_admin, table)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    bridge = CdcBridge(settings)
    task = asyncio.create_task(bridge.run())
    await wait_for(lambda: slot_confirmed(pg_admin, cdc_database.slot) > 0,
                   what="the bridge to stream")
    pg_admin.execute(f"DROP PUBLICATION {cdc_database.publication}")
    pg_admin.execute(f"INSERT INTO {table} VALUES (1)")
    with pytest.raises(ReplicationConfigError, match="does not exist"):
        await asyncio.wait_for(task, 30)


async def test_stop_while_nats_is_down_honours_the_shutdown_timeout(
        cdc_database, pg_admin, tmp_path, caplog):
    nats_server = LocalNatsServer(tmp_path / "nats")
    nats_server.start()
    table = random_name("held")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    cdc_database.add_tables(pg_admin, table)
    try:
        setup = await connect_nats(NatsSettings(url=nats_server.url))
        await provision(setup.jetstream(), NatsTopology())
        await setup.close()
        settings = platform_settings(cdc_database, nats_server.url, shutdown_timeout_seconds=3.0)
        bridge = CdcBridge(settings)
        task = asyncio.create_task(bridge.run())
        await wait_for(lambda: slot_confirmed(pg_admin, cdc_database.slot) > 0,
                       what="the bridge to stream")
        nats_server.stop()
        pg_admin.execute(f"INSERT INTO {table} SELECT generate_series(1, 100)")
        await asyncio.sleep(1.0)
        stopped_at = time.monotonic()
        bridge.request_stop()
        await asyncio.wait_for(task, 30)
        took = time.monotonic() - stopped_at
        assert took < 3.0 + 1.5, f"stop took {took:.1f}s with a 3s shutdown timeout"
        # nothing unstored was confirmed: the rows come after a restart
        nats_server.start()
        async with running_bridge(settings):
            client = await connect_nats(NatsSettings(url=nats_server.url))
            try:
                stored = await read_subjects(client, "CDC", f"cdc.{table}.insert", expect=100)
                assert len(stored) == 100
            finally:
                await client.close()
    finally:
        nats_server.stop()



async def test_a_nats_outage_and_its_end_show_in_the_metrics(cdc_database, tmp_path):
    nats_server = LocalNatsServer(tmp_path / "nats")
    nats_server.start()
    try:
        setup = await connect_nats(NatsSettings(url=nats_server.url))
        await provision(setup.jetstream(), NatsTopology())
        await setup.close()
        async with running_bridge(platform_settings(cdc_database, nats_server.url)) as bridge:
            metrics = bridge.metrics
            await wait_for(lambda: metrics.value(metrics.connected) == 1,
                           what="the bridge to stream")
            assert metrics.value(metrics.nats_connected) == 1
            nats_server.stop()
            await wait_for(lambda: metrics.value(metrics.nats_connected) == 0,
                           what="the outage to show")
            nats_server.start()
            await wait_for(lambda: metrics.value(metrics.nats_connected) == 1,
                           what="the reconnection to show")
            assert metrics.value(metrics.nats_reconnects) == 1
    finally:
        nats_server.stop()

async def test_transactions_are_counted(cdc_database, pg_admin, provisioned_nats):
    table = random_name("counted")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    cdc_database.add_tables(pg_admin, table)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    async with running_bridge(settings) as bridge:
        await wait_for(lambda: slot_confirmed(pg_admin, cdc_database.slot) > 0)
        before = bridge.metrics.value(bridge.metrics.transactions)
        for i in range(5):
            pg_admin.execute(f"INSERT INTO {table} VALUES ({i})")
        await wait_for(lambda: bridge.metrics.value(bridge.metrics.transactions) >= before + 5,
                       what="5 more transactions counted")


def test_cli_start_error_is_one_line(cdc_database, provisioned_nats):
    """`cdc-platform bridge` with a wrong password: exit 2 and one line, no traceback."""
    settings = platform_settings(cdc_database, provisioned_nats.url)
    pg = settings.postgres
    env = {"CDC_PG_HOST": pg.host, "CDC_PG_PORT": str(pg.port), "CDC_PG_DB": pg.database,
           "CDC_PG_USER": pg.user, "CDC_PG_PASSWORD": "not-the-password",
           "CDC_PUBLICATION": pg.publication, "CDC_SLOT": pg.slot,
           "CDC_NATS_URL": provisioned_nats.url, "CDC_HTTP_PORT": "0", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-m", "cdc_platform.cli", "bridge"], env=env,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert errors and "password authentication failed" in errors[-1]
    assert "Traceback" not in result.stderr and "not-the-password" not in result.stderr


async def test_a_newly_published_table_gets_its_schema_before_any_change(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    settings = platform_settings(cdc_database, provisioned_nats.url,
                                 publication_poll_seconds=0.5)
    table = random_name("late")
    async with running_bridge(settings):
        await wait_for(lambda: slot_confirmed(pg_admin, cdc_database.slot) > 0)
        pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, note text)")
        cdc_database.add_tables(pg_admin, table)  # no write to it
        kv = await nats_client.jetstream().key_value("schemas")

        async def published() -> bool:
            try:
                await kv.get(table)
                return True
            except Exception:  # noqa: BLE001 - not there yet
                return False

        await wait_for(published, timeout=15, what=f"the schema of {table} in KV")
    schema = msgpack.unpackb((await kv.get(table)).value)
    assert [c["name"] for c in schema["columns"]] == ["id", "note"]


async def test_batched_mode_after_a_reconnect_inside_a_transaction_sends_each_change_once(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    """The walsender killed while a large transaction streams: the server resends the
    transaction from its start, and the batch left open before the cut must not take the
    resent changes (it did: ordinals 1000..1200 then 0..298 in one batch)."""
    table = random_name("cut")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    cdc_database.add_tables(pg_admin, table)
    settings = platform_settings(cdc_database, provisioned_nats.url, message_mode="batched")
    rows = 300_000
    async with running_bridge(settings) as bridge:
        await wait_for(lambda: slot_confirmed(pg_admin, cdc_database.slot) > 0)
        pg_admin.execute(f"INSERT INTO {table} SELECT generate_series(1, {rows})")
        end = parse_lsn(pg_admin.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
        # cut the walsender once some of the transaction's batches are stored
        await read_subjects(nats_client, "CDC", f"cdc.{table}.insert.batch", expect=1,
                            timeout=60)
        pg_admin.execute("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                         "WHERE slot_name = %s", (cdc_database.slot,))
        await wait_for(lambda: bridge.metrics.value(bridge.metrics.reconnects) >= 1,
                       what="the bridge to reconnect")
        await wait_for(lambda: slot_confirmed(pg_admin, cdc_database.slot) >= end,
                       timeout=90, what="the transaction to be stored and confirmed")
        messages = await _read_batches(nats_client, f"cdc.{table}.insert.batch")
    ordinals = []
    for message in messages:
        batch = [event["ordinal"] for event in msgpack.unpackb(message.data)]
        assert batch == sorted(set(batch)) == list(range(batch[0], batch[-1] + 1)), \
            (message.headers["Nats-Msg-Id"], batch[:3], batch[-3:])
        assert message.headers["Nats-Msg-Id"].endswith(f":{batch[0]}-{batch[-1]}")
        ordinals += batch
    assert sorted(ordinals) == list(range(rows))  # every change once


async def _read_batches(client, subject: str) -> list:
    """Every stored batch on ``subject``, a few at a time (each may be ~1 MB: a large fetch
    overflows the client's pending limits and drops messages)."""
    from nats.js.api import AckPolicy, ConsumerConfig

    js = client.jetstream()
    stored = sum(((await js.stream_info("CDC", subjects_filter=subject)).state.subjects
                  or {}).values())
    subscription = await js.pull_subscribe(subject, stream="CDC",
                                           config=ConsumerConfig(ack_policy=AckPolicy.NONE))
    messages: list = []
    try:
        while len(messages) < stored:
            messages += await subscription.fetch(min(20, stored - len(messages)), timeout=5)
    finally:
        await subscription.unsubscribe()
    return messages
