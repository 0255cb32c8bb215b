"""The CDC bridge end to end: real PostgreSQL, real nats-server, the real library."""

import asyncio
import signal
import subprocess

import msgpack
import pytest

from cdc_platform.bridge.runner import CdcBridge
from cdc_platform.dev.servers import LocalNatsServer, free_port
from cdc_platform.jetstream.connection import connect_nats
from cdc_platform.jetstream.provision import provision
from cdc_platform.lsn import parse_lsn
from cdc_platform.replication.slots import read_slot
from cdc_platform.settings import NatsSettings, NatsTopology
from cdc_platform.wire import decode_payload
from cdc_platform_tests.fixtures.bridge import (
    events_of,
    flat_events,
    running_bridge,
    slot_confirmed,
    wait_for,
)
from cdc_platform_tests.fixtures.services import (
    CLI,
    bridge_env,
    platform_settings,
    random_name,
    read_subjects,
)

# also on the newest PostgreSQL (docs/development.md "Tests": make test's second pass)
pytestmark = pytest.mark.every_major


@pytest.fixture
def table(cdc_database, pg_admin):
    name = random_name("orders")
    pg_admin.execute(
        f"CREATE TABLE {name} (id int PRIMARY KEY, item text, qty int, price numeric(10,2), "
        "tags text[], meta jsonb, at timestamptz, big text)")
    cdc_database.add_tables(pg_admin, name)
    return name


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
async def test_mixed_workload_arrives_once_in_order_typed(fmt, table, cdc_database, pg_admin,
                                                          provisioned_nats, nats_client,
                                                          monkeypatch):
    monkeypatch.setenv("CDC_FORMAT", fmt)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    settings = settings.model_copy(update={"encoding": settings.encoding.model_copy(
        update={"format": fmt})})
    other = random_name("other")
    pg_admin.execute(f"CREATE TABLE {other} (k text PRIMARY KEY, v int)")
    cdc_database.add_tables(pg_admin, other)
    async with running_bridge(settings):
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None,
                       what="slot creation")
        pg_admin.execute(
            f"INSERT INTO {table} VALUES (1, 'a', 2, 9.99, ARRAY['x', NULL, 'y,z'], "
            "'{\"k\": [1, 2]}', '2025-01-02 03:04:05.123456+02', NULL)")
        with pg_admin.transaction():
            pg_admin.execute(f"UPDATE {table} SET qty = 3 WHERE id = 1")
            pg_admin.execute(f"INSERT INTO {other} VALUES ('a', 1)")
            pg_admin.execute(f"INSERT INTO {table} (id, item) VALUES (2, '')")
        pg_admin.execute(f"DELETE FROM {table} WHERE id = 2")
        pg_admin.execute(f"TRUNCATE {table}, {other}")
        messages = await read_subjects(nats_client, "CDC", f"cdc.{table}.>", expect=5)
        other_messages = await read_subjects(nats_client, "CDC", f"cdc.{other}.>", expect=2)
    events = events_of(messages, fmt)
    assert [(e["operation"], (e["data"] or {}).get("id")) for e in events] == [
        ("INSERT", 1), ("UPDATE", 1), ("INSERT", 2), ("DELETE", 2), ("TRUNCATE", None)]
    first = events[0]
    assert first["data"]["tags"] == ["x", None, "y,z"]
    assert first["data"]["meta"] == '{"k": [1, 2]}'  # json/jsonb: the exact text
    assert first["data"]["price"] == "9.99"
    assert first["data"]["at"] == "2025-01-02T01:04:05.123456Z"
    assert first["data"]["big"] is None
    assert first["subject"] == f"cdc.{table}.insert" == messages[0].subject
    assert first["table"] == table and first["schema"] == "public"
    assert messages[0].headers["Nats-Msg-Id"] == first["msg_id"]
    assert first["msg_id"] == f"{first['commit_lsn']}:{first['ordinal']}"
    assert events[2]["data"]["item"] == ""  # empty string is not NULL
    # one transaction: shared commit_lsn, ordinals in order across tables
    update, insert_other = events[1], events_of(other_messages, fmt)[0]
    assert update["commit_lsn"] == insert_other["commit_lsn"] == events[2]["commit_lsn"]
    assert (update["ordinal"], insert_other["ordinal"], events[2]["ordinal"]) == (0, 1, 2)
    assert events[4]["commit_lsn"] == events_of(other_messages, fmt)[1]["commit_lsn"]
    # the slot is confirmed up to the last published commit
    last_commit = parse_lsn(events[4]["commit_lsn"])
    assert slot_confirmed(pg_admin, cdc_database.slot) > last_commit
    # the schema is in KV with a fingerprint the events carry
    kv = await nats_client.jetstream().key_value("schemas")
    schema = decode_payload((await kv.get(table)).value, fmt)
    assert schema["schema"] == f"public.{table}"
    assert [c["name"] for c in schema["columns"]][:3] == ["id", "item", "qty"]
    assert schema["primary_key"] == ["id"]
    assert [(c["is_key"], c["is_primary_key"]) for c in schema["columns"]][:2] == [
        (True, True), (False, False)]
    assert schema["fingerprint"] == first["schema_fingerprint"]


async def test_copy_of_10k_rows_yields_10k_messages(table, cdc_database, pg_admin,
                                                    provisioned_nats, nats_client):
    settings = platform_settings(cdc_database, provisioned_nats.url)
    async with running_bridge(settings):
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
        with pg_admin.cursor().copy(f"COPY {table} (id, item) FROM STDIN") as copy:
            for i in range(10_000):
                copy.write_row((i, f"item-{i}"))
        messages = await read_subjects(nats_client, "CDC", f"cdc.{table}.insert", expect=10_000)
    ids = [msgpack.unpackb(m.data)["data"]["id"] for m in messages]
    assert ids == list(range(10_000))
    assert len({m.headers["Nats-Msg-Id"] for m in messages}) == 10_000


async def test_batched_mode(table, cdc_database, pg_admin, provisioned_nats, nats_client):
    settings = platform_settings(cdc_database, provisioned_nats.url, message_mode="batched")
    async with running_bridge(settings):
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
        pg_admin.execute(f"INSERT INTO {table} (id) SELECT generate_series(1, 1200)")
        pg_admin.execute(f"UPDATE {table} SET qty = 1 WHERE id <= 10")
        messages = await read_subjects(nats_client, "CDC", f"cdc.{table}.>", expect=4)
    assert [m.subject for m in messages] == [f"cdc.{table}.insert.batch"] * 3 + [
        f"cdc.{table}.update.batch"]
    batches = [msgpack.unpackb(m.data) for m in messages]
    assert [len(b) for b in batches] == [500, 500, 200, 10]
    assert [e["data"]["id"] for b in batches[:3] for e in b] == list(range(1, 1201))
    first = batches[0]
    assert messages[0].headers["Nats-Msg-Id"] == f"{first[0]['commit_lsn']}:0-499"


async def test_idle_tables_heartbeat_advances_slot(table, cdc_database, pg_admin,
                                                   provisioned_nats):
    settings = platform_settings(cdc_database, provisioned_nats.url,
                                 heartbeat_interval_seconds=0.5)
    async with running_bridge(settings):
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
        start = slot_confirmed(pg_admin, cdc_database.slot)
        # WAL from tables outside the publication only
        unpublished = random_name("noise")
        pg_admin.execute(f"CREATE TABLE {unpublished} AS SELECT generate_series(1, 1000) AS i")
        target = parse_lsn(pg_admin.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
        await wait_for(lambda: slot_confirmed(pg_admin, cdc_database.slot) >= target,
                       timeout=20, what="slot to advance past idle WAL")
    assert slot_confirmed(pg_admin, cdc_database.slot) > start


async def test_changes_made_while_stopped_are_delivered_after_restart(
        table, cdc_database, pg_admin, provisioned_nats, nats_client):
    settings = platform_settings(cdc_database, provisioned_nats.url)
    async with running_bridge(settings):
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
        pg_admin.execute(f"INSERT INTO {table} (id) VALUES (1)")
        await read_subjects(nats_client, "CDC", f"cdc.{table}.>", expect=1)
    # bridge stopped: these changes wait in the slot
    pg_admin.execute(f"INSERT INTO {table} (id) SELECT generate_series(2, 100)")
    async with running_bridge(settings):
        messages = await read_subjects(nats_client, "CDC", f"cdc.{table}.>", expect=100)
    assert [msgpack.unpackb(m.data)["data"]["id"] for m in messages] == list(range(1, 101))


async def test_kill_9_mid_stream_loses_nothing_and_dedupes(table, cdc_database, pg_admin,
                                                           provisioned_nats, nats_client,
                                                           tmp_path):
    env = bridge_env(cdc_database, provisioned_nats.url)
    command = [CLI, "bridge", "--slot", cdc_database.slot, "--pub", cdc_database.publication]
    log = open(tmp_path / "bridge.log", "wb")  # noqa: SIM115 - shared by the restarts
    bridge = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None, timeout=60)
        total = 20_000
        for start in range(0, total, 2_000):
            pg_admin.execute(f"INSERT INTO {table} (id) SELECT generate_series({start}, "
                             f"{start + 1999})")
        # kill it while it is still streaming
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot).confirmed_flush_lsn,
                       timeout=30)
        bridge.send_signal(signal.SIGKILL)
        bridge.wait()
        bridge = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        messages = await read_subjects(nats_client, "CDC", f"cdc.{table}.>", expect=total,
                                       timeout=60)
        await asyncio.sleep(1.0)  # anything extra would show up now
        messages = await read_subjects(nats_client, "CDC", f"cdc.{table}.>")
    finally:
        bridge.send_signal(signal.SIGTERM)
        assert bridge.wait(30) == 0
    ids = [msgpack.unpackb(m.data)["data"]["id"] for m in messages]
    assert sorted(ids) == list(range(total))  # nothing lost, nothing twice
    # the replayed duplicates were checked and found to be the same changes
    assert b"duplicate conflict" not in (tmp_path / "bridge.log").read_bytes()


async def test_nats_down_for_10s_loses_nothing(table, cdc_database, pg_admin, tmp_path):
    port = free_port()
    nats = LocalNatsServer(tmp_path / "nats", port=port)
    nats.start()
    try:
        client = await connect_nats(NatsSettings(url=nats.url))
        await provision(client.jetstream(), NatsTopology())
        settings = platform_settings(cdc_database, nats.url)
        async with running_bridge(settings):
            await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
            pg_admin.execute(f"INSERT INTO {table} (id) SELECT generate_series(1, 1000)")
            await read_subjects(client, "CDC", f"cdc.{table}.>", expect=1000)
            await client.close()
            nats.stop()
            pg_admin.execute(f"INSERT INTO {table} (id) SELECT generate_series(1001, 3000)")
            # heartbeats committed before the insert carry no messages and may still be
            # confirmed in the next status update: take the mark once that has gone out
            await asyncio.sleep(2.0)
            confirmed_during_outage = slot_confirmed(pg_admin, cdc_database.slot)
            await asyncio.sleep(10)
            # nothing new was confirmed while NATS was down
            assert slot_confirmed(pg_admin, cdc_database.slot) == confirmed_during_outage
            nats = LocalNatsServer(tmp_path / "nats", port=port)
            nats.start()
            client = await connect_nats(NatsSettings(url=nats.url))
            pg_admin.execute(f"INSERT INTO {table} (id) SELECT generate_series(3001, 4000)")
            messages = await read_subjects(client, "CDC", f"cdc.{table}.>", expect=4000,
                                           timeout=60)
        await client.close()
    finally:
        nats.stop()
    ids = [msgpack.unpackb(m.data)["data"]["id"] for m in messages]
    assert ids == list(range(1, 4001))


async def test_wrong_credentials_fail_fast_and_clearly(cdc_database, provisioned_nats):
    settings = platform_settings(cdc_database, provisioned_nats.url)
    settings = settings.model_copy(update={"postgres": cdc_database.settings(password="nope")})
    with pytest.raises(Exception, match="password authentication failed"):
        await asyncio.wait_for(CdcBridge(settings).run(), 30)


async def test_slot_checks_and_observations_keep_their_own_cadence(
        table, cdc_database, pg_admin, provisioned_nats, caplog):
    """Observations (Dagster) every observe_interval; lag checks (and their warnings) only
    every lag_check_interval, however long: one is not capped by the other."""
    settings = platform_settings(cdc_database, provisioned_nats.url,
                                 lag_check_interval_seconds=3600, lag_warn_bytes=1)
    observations = []
    bridge = CdcBridge(settings, observer=observations.append, observe_interval=0.2)
    caplog.set_level("WARNING", logger="cdc_platform.bridge.runner")
    writing = True

    async def write_wal() -> None:  # keeps the slot lagging by more than 1 byte
        while writing:
            await asyncio.to_thread(pg_admin.execute,
                                    "SELECT pg_logical_emit_message(false, 'test-noise', 'x')")
            await asyncio.sleep(0.02)

    writer = asyncio.create_task(write_wal())
    task = asyncio.create_task(bridge.run())
    try:
        await wait_for(lambda: sum(o["lag_bytes"] > 1 for o in observations) >= 5, timeout=20,
                       what="5 observations of a lagging slot")
    finally:
        writing = False
        await writer
        bridge.request_stop()
        await asyncio.wait_for(task, 60)
    assert {"confirmed_lsn", "lag_bytes", "events_per_second"} <= set(observations[-1])
    warnings = [r for r in caplog.records if "lags" in r.getMessage()]
    assert len(warnings) <= 1, [r.getMessage() for r in warnings]  # the one check at start


@pytest.mark.parametrize("mode", ["per-change", "batched"])
async def test_a_consumer_of_one_table_knows_each_transaction_is_whole(
        mode, table, cdc_database, pg_admin, provisioned_nats, nats_client):
    """tx_tables from the real bridge: the mirror's collector, fed only one table's events,
    completes each transaction at its last event, without a later transaction."""
    from cdc_platform.mirror.transactions import TransactionCollector

    other = random_name("other")
    pg_admin.execute(f"CREATE TABLE {other} (k int PRIMARY KEY)")
    cdc_database.add_tables(pg_admin, other)
    settings = platform_settings(cdc_database, provisioned_nats.url, message_mode=mode,
                                 batch_max_events=3)
    async with running_bridge(settings):
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
        with pg_admin.transaction():
            for i in range(7):
                pg_admin.execute(f"INSERT INTO {table} (id, item) VALUES ({i}, 'x')")
                if i % 3 == 0:
                    pg_admin.execute(f"INSERT INTO {other} VALUES ({i})")
        messages = await read_subjects(nats_client, "CDC", f"cdc.{table}.>",
                                       expect=1 + (7 if mode == "per-change" else 3),
                                       schema_events=True)
    events = flat_events(messages)
    assert events[0]["operation"] == "SCHEMA"  # the table's shape, before its first change
    collector = TransactionCollector({table})
    done = [collector.add(event, seq) for seq, event in enumerate(events, start=1)]
    assert [d is not None for d in done] == [False] * 7 + [True]
    assert done[-1].ordered()[-1]["tx_tables"] == {table: 7, other: 3}


async def test_the_http_endpoints_show_no_secret(cdc_database, pg_admin, provisioned_nats):
    """/metrics and /status of a running bridge, whose settings hold the role's password and an
    admin token: neither appears, and the admin action refuses a wrong token."""
    import urllib.error
    import urllib.request

    from cdc_platform_tests.fixtures.services import TEST_SECRETS, secret_for_test

    settings = platform_settings(cdc_database, provisioned_nats.url, http_port=free_port(),
                                 admin_token=secret_for_test())
    async with running_bridge(settings) as bridge:
        await wait_for(lambda: bridge.telemetry is not None)
        base = f"http://127.0.0.1:{bridge.telemetry.port}"

        def get(path: str) -> str:
            with urllib.request.urlopen(base + path, timeout=5) as response:
                return response.read().decode()

        shown = [await asyncio.to_thread(get, path) for path in ("/metrics", "/status")]
        assert "bridge_" in shown[0] and "confirmed_lsn" in shown[1]
        assert not any(secret in page for secret in TEST_SECRETS for page in shown)

        def wrong_token() -> int:
            request = urllib.request.Request(base + "/shutdown", method="POST",
                                             headers={"Authorization": "Bearer not-it"})
            try:
                urllib.request.urlopen(request, timeout=5)
            except urllib.error.HTTPError as refused:
                return refused.code
            return 200

        assert await asyncio.to_thread(wrong_token) in (401, 403)
        assert not bridge.stop_requested.is_set()
