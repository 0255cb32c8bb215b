"""The snapshot request path with the least NATS rights (docs/wire-contract.md "Snapshots", "NATS
setup"): the sensor as a user that may make exactly the JetStream calls README lists for it and
publish nothing else, replies (the sensor's and a run's) through a user that may publish inbox
subjects only (``CDC_REPLY_NATS_*``); the sensor with its own user (``CDC_SENSOR_NATS_*``) where its
process holds another."""

from __future__ import annotations

import asyncio
import json
import os
import time

import dagster as dg
import pytest
from dagster_pyspark import LazyPySparkResource

from cdc_platform.dev.servers import free_port
from cdc_platform.jetstream.connection import close_nats, connect_nats
from cdc_platform.jetstream.provision import provision
from cdc_platform.replication.slots import read_slot
from cdc_platform.settings import NatsSettings, NatsTopology
from cdc_platform.snapshot import snapshot_table
from cdc_platform_tests.fixtures.bridge import running_bridge, wait_for
from cdc_platform_tests.fixtures.dagster import dagster_resources, request_sensor_tick
from cdc_platform_tests.fixtures.services import (
    nats_server_from,
    platform_settings,
    random_name,
    read_subjects,
    secret_for_test,
)

# What docs/operations.md "NATS setup" says the sensor needs (stream and durable names: the
# defaults).
SENSOR_PUBLISHES = [
    "$JS.API.CONSUMER.INFO.SNAPSHOT_REQUESTS.cdc_platform_snapshot_requests",
    "$JS.API.CONSUMER.MSG.NEXT.SNAPSHOT_REQUESTS.cdc_platform_snapshot_requests",
    "$JS.ACK.SNAPSHOT_REQUESTS.cdc_platform_snapshot_requests.>",
    "$JS.API.STREAM.MSG.GET.INIT", "$JS.API.STREAM.MSG.GET.CDC", "$JS.API.STREAM.INFO.CDC",
]
USERS = ("admin", "sensor", "replier", "requester")


@pytest.fixture
def least_rights_nats(tmp_path):
    """(url, {user: password}): ``admin`` may do anything (provisioning, the bridge),
    ``sensor`` what README lists, ``replier`` publish inbox subjects only, ``requester``
    publish requests and read its inbox."""
    port = free_port()
    passwords = {user: secret_for_test() for user in USERS}
    env = {**os.environ, **{f"PASSWORD_{user.upper()}": value
                            for user, value in passwords.items()}}
    permissions = {
        "admin": {"publish": [">"], "subscribe": [">"]},
        "sensor": {"publish": SENSOR_PUBLISHES, "subscribe": ["_INBOX.>"]},
        "replier": {"publish": ["_INBOX.>", "_INBOX_*.>"], "subscribe": []},
        "requester": {"publish": ["snapshot.request.>"], "subscribe": ["_INBOX.>"]},
    }
    users = ", ".join(
        f"{{ user: {user}, password: $PASSWORD_{user.upper()}, "
        f"permissions: {json.dumps(permissions[user])} }}" for user in USERS)
    config = tmp_path / "nats.conf"
    config.write_text(f"listen: 127.0.0.1:{port}\n"
                      f'jetstream {{ store_dir: "{tmp_path / "js"}", max_file_store: 1TB }}\n'
                      f"authorization {{ users: [ {users} ] }}\n")
    with nats_server_from(config, port, tmp_path / "nats.log", env):
        yield f"nats://127.0.0.1:{port}", passwords


async def test_the_sensor_and_runs_answer_with_least_rights(
        least_rights_nats, cdc_database, pg_admin, monkeypatch, tmp_path):
    from cdc_platform.definitions import build_definitions
    from cdc_platform.defs.snapshots.assets import init_snapshot

    url, passwords = least_rights_nats
    admin = NatsSettings(url=url, user="admin", password=passwords["admin"])
    client = await connect_nats(admin)
    requester = await connect_nats(NatsSettings(url=url, user="requester",
                                                password=passwords["requester"]))
    try:
        await provision(client.jetstream(), NatsTopology())
        snapped, asked, doomed = (random_name(n) for n in ("snapped", "asked", "doomed"))
        for table in (snapped, asked, doomed):
            pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
        cdc_database.add_tables(pg_admin, snapped, asked, doomed)
        settings = platform_settings(cdc_database, url).model_copy(update={"nats": admin})
        async with running_bridge(settings):
            await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
            taken = await snapshot_table(None, settings, snapped)
            # its cutover point: the watermark marker, stored by the bridge
            await read_subjects(client, "CDC", taken.watermark_subject, expect=1)

        for name, value in {
                "CDC_PG_HOST": cdc_database.server.host,
                "CDC_PG_PORT": str(cdc_database.server.port), "CDC_PG_DB": "postgres",
                "CDC_PG_USER": cdc_database.role, "CDC_PG_PASSWORD": cdc_database.password,
                "CDC_PG_SSLMODE": "disable", "CDC_PUBLICATION": cdc_database.publication,
                # the sensor's process holds another user's credential (compose: the code
                # location hosts the runs, as `bridge`); the sensor connects as its own
                "CDC_SLOT": cdc_database.slot, "CDC_NATS_URL": url,
                "CDC_NATS_USER": "requester", "CDC_NATS_PASSWORD": passwords["requester"],
                "CDC_SENSOR_NATS_USER": "sensor", "CDC_SENSOR_NATS_PASSWORD": passwords["sensor"],
                "CDC_REPLY_NATS_USER": "replier",
                "CDC_REPLY_NATS_PASSWORD": passwords["replier"],
                "DAGSTER_HOME": str(tmp_path)}.items():
            monkeypatch.setenv(name, value)

        inbox = requester.new_inbox()
        replies: list[dict] = []

        async def collect(message):
            replies.append(json.loads(message.data))

        async def wait_replies(count: int) -> dict[str, dict]:
            deadline = time.monotonic() + 20
            while len(replies) < count:
                assert time.monotonic() < deadline, replies
                await asyncio.sleep(0.05)
            return {reply["request_id"]: reply for reply in replies}

        await requester.subscribe(inbox, cb=collect)
        for request_id, table in (("r1", snapped), ("r2", asked), ("r3", doomed),
                                  ("r4", "no_such_table")):
            await requester.publish(f"snapshot.request.{table}", json.dumps(
                {"request_id": request_id, "reply_to": inbox}).encode())
        await requester.flush()
        defs = build_definitions()
        with dg.instance_for_test() as instance:
            result = await asyncio.to_thread(request_sensor_tick(defs, instance), None)
            by_id = await wait_replies(4)
            assert by_id["r1"]["status"] == "done" and by_id["r1"]["reused"] is True
            assert by_id["r1"]["snapshot_id"] == taken.snapshot_id
            marker = await client.jetstream().get_last_msg("CDC", taken.watermark_subject)
            assert by_id["r1"]["cdc_start_seq"] == marker.seq
            assert by_id["r2"]["status"] == by_id["r3"]["status"] == "accepted"
            assert by_id["r4"]["status"] == "refused"
            assert {r.partition_key for r in result.run_requests} == {asked, doomed}
            # a run answers through the reply connection too
            monkeypatch.setenv("CDC_NATS_USER", "sensor")
            monkeypatch.setenv("CDC_NATS_PASSWORD", passwords["sensor"])
            run = next(r for r in result.run_requests if r.partition_key == doomed)
            instance.add_dynamic_partitions("published_tables", [doomed])
            pg_admin.execute(f"ALTER PUBLICATION {cdc_database.publication} "
                             f"DROP TABLE {doomed}")
            outcome = await asyncio.to_thread(
                dg.materialize, [init_snapshot], partition_key=doomed, instance=instance,
                tags=run.tags, raise_on_error=False,
                resources={**dagster_resources(), "pyspark": LazyPySparkResource(spark_config={})})
            assert not outcome.success
            failed = (await wait_replies(5))["r3"]
            assert failed["status"] == "failed" and "not in publication" in failed["reason"]
    finally:
        await close_nats(requester, 5)
        await close_nats(client, 5)
