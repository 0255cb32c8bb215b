"""The bridge at the edges: waits on NATS that must keep PostgreSQL answered, a DSN that can
never work, the slot watched from the first moment, counters that add up."""

from __future__ import annotations

import asyncio
import subprocess

import pytest
from psycopg import sql

from cdc_platform.bridge.runner import CdcBridge
from cdc_platform.dev.servers import LocalNatsServer, free_port
from cdc_platform.errors import ReplicationConfigError
from cdc_platform.jetstream.connection import connect_nats
from cdc_platform.jetstream.provision import provision
from cdc_platform.settings import NatsSettings, NatsTopology
from cdc_platform_tests.fixtures.bridge import running_bridge, wait_for
from cdc_platform_tests.fixtures.services import (
    CLI,
    bridge_env,
    platform_settings,
    random_name,
    read_subjects,
)


def _walsender_pid(pg_admin, slot: str) -> int | None:
    row = pg_admin.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s",
                           (slot,)).fetchone()
    return row[0] if row else None


async def test_waiting_on_nats_for_a_schema_keeps_answering_postgres(cdc_database, pg_admin,
                                                                     tmp_path):
    """NATS down at a table's first change after a start: the bridge waits to read the
    table's last schema event, and answers the walsender meanwhile (it timed the bridge out,
    wal_sender_timeout, when that wait sent nothing)."""
    table = random_name("keepalive")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    cdc_database.add_tables(pg_admin, table)
    pg_admin.execute(sql.SQL("ALTER ROLE {} SET wal_sender_timeout = '2s'").format(
        sql.Identifier(cdc_database.role)))
    port = free_port()
    nats = LocalNatsServer(tmp_path / "nats", port=port)
    nats.start()
    try:
        client = await connect_nats(NatsSettings(url=nats.url))
        await provision(client.jetstream(), NatsTopology())
        await client.close()
        settings = platform_settings(cdc_database, nats.url)
        async with running_bridge(settings) as bridge:
            await wait_for(lambda: bridge.metrics.value(bridge.metrics.schema_changes) >= 1,
                           timeout=60, what="the schema published at start")
            walsender = _walsender_pid(pg_admin, cdc_database.slot)
            assert walsender is not None
            nats.stop()
            pg_admin.execute(f"INSERT INTO {table} VALUES (1)")
            await asyncio.sleep(7)  # more than three wal_sender_timeouts
            assert _walsender_pid(pg_admin, cdc_database.slot) == walsender
            assert bridge.metrics.value(bridge.metrics.reconnects) == 0
            nats = LocalNatsServer(tmp_path / "nats", port=port)
            nats.start()
            client = await connect_nats(NatsSettings(url=nats.url))
            messages = await read_subjects(client, "CDC", f"cdc.{table}.>", expect=1,
                                           timeout=60)
            await client.close()
        assert len(messages) == 1
    finally:
        nats.stop()


def test_a_malformed_dsn_is_a_configuration_error(cdc_database, provisioned_nats):
    """``port=abc`` can never connect: one clear line and exit 2 at once (it was retried
    forever as "unreachable")."""
    env = {**bridge_env(cdc_database, provisioned_nats.url), "CDC_SLOT": cdc_database.slot,
           "CDC_PUBLICATION": cdc_database.publication,
           "CDC_PG_DSN": f"host={cdc_database.server.host} port=abc dbname=postgres "
                         f"user={cdc_database.role} password={cdc_database.password}"}
    result = subprocess.run([CLI, "bridge"], env=env, capture_output=True, text=True,
                            timeout=30, check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "CDC_PG_DSN" in result.stderr and "'abc' is not a port number" in result.stderr
    assert cdc_database.password not in result.stderr + result.stdout


async def test_a_dsn_libpq_refuses_is_a_configuration_error(cdc_database, provisioned_nats):
    """What only libpq finds wrong in a DSN (an sslmode it does not know) is not retried
    either."""
    settings = platform_settings(cdc_database, provisioned_nats.url)
    dsn = (f"host={cdc_database.server.host} port={cdc_database.server.port} "
           f"dbname=postgres user={cdc_database.role} sslmode=bogus")
    settings = settings.model_copy(update={"postgres": cdc_database.settings(dsn=dsn)})
    with pytest.raises(ReplicationConfigError, match="sslmode"):
        await asyncio.wait_for(CdcBridge(settings).run(), 20)


async def test_the_slot_is_checked_as_soon_as_it_exists(cdc_database, pg_admin,
                                                        provisioned_nats):
    """The first slot check comes at start, also for a slot the bridge creates: the gauges
    read 0 and nothing was checked for a whole check interval (30 s) when the first check
    ran before the slot was there."""
    settings = platform_settings(cdc_database, provisioned_nats.url,
                                 lag_check_interval_seconds=3600)
    async with running_bridge(settings) as bridge:
        await wait_for(lambda: _walsender_pid(pg_admin, cdc_database.slot) is not None,
                       timeout=60, what="the slot")
        await wait_for(lambda: bridge.metrics.value(bridge.metrics.slot_safe_wal_bytes) != 0,
                       timeout=5, what="the first slot check")


async def test_every_change_is_counted_once(cdc_database, pg_admin, provisioned_nats,
                                            nats_client):
    """``cdc_events_published`` counts each change once, also when a read ends right after
    the first change of a transaction (large rows arrive a few at a time): a read holding
    only that change, held back until the transaction's next message, went uncounted."""
    table = random_name("counted")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, big text)")
    cdc_database.add_tables(pg_admin, table)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    async with running_bridge(settings) as bridge:
        await wait_for(lambda: _walsender_pid(pg_admin, cdc_database.slot) is not None,
                       timeout=60, what="the slot")
        for transaction in range(20):
            first = transaction * 3
            pg_admin.execute(
                f"INSERT INTO {table} SELECT id, (SELECT string_agg(md5(random()::text || id "
                "|| n), '') FROM generate_series(1, 6000) AS n) "
                "FROM generate_series(%s::int, %s::int) AS id", (first, first + 2))
        await read_subjects(nats_client, "CDC", f"cdc.{table}.>", expect=60, timeout=60)
        await wait_for(lambda: bridge.metrics.value(bridge.metrics.events_published) >= 60,
                       timeout=5, what="60 changes counted")
        assert bridge.metrics.value(bridge.metrics.events_published) == 60
