"""The mirror's snapshot requests when SNAPSHOT_REQUESTS is full (docs/wire-contract.md
"Floods")."""

from __future__ import annotations

import asyncio

from cdc_platform.dev.servers import LocalNatsServer
from cdc_platform.jetstream.connection import close_nats, connect_nats
from cdc_platform.jetstream.provision import REQUESTS_DURABLE, provision
from cdc_platform.mirror.follower import Mirror
from cdc_platform.replication.slots import read_slot
from cdc_platform.settings import MirrorSettings, NatsSettings, NatsTopology
from cdc_platform_tests.exactness import mirror_rows
from cdc_platform_tests.fixtures.bridge import running_bridge, wait_for
from cdc_platform_tests.fixtures.responder import snapshot_responder
from cdc_platform_tests.fixtures.services import platform_settings, random_name


async def test_a_mirror_asks_again_while_the_request_stream_is_full(
        cdc_database, pg_admin, tmp_path):
    """A flood filled the stream, which refuses new requests: the mirror says so and asks
    again until there is room (the sensor acked what it handled), then bootstraps."""
    server = LocalNatsServer(tmp_path / "nats")
    server.start()
    client = None
    try:
        client = await connect_nats(NatsSettings(url=server.url))
        js = client.jetstream()
        topology = NatsTopology()
        topology = topology.model_copy(update={"requests": topology.requests.model_copy(
            update={"max_msgs": 5})})
        await provision(js, topology)
        for number in range(5):
            await js.publish(f"snapshot.request.bogus_{number}", b"")
        table = random_name("asks_again")
        pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
        pg_admin.execute(f"INSERT INTO {table} SELECT generate_series(1, 10)")
        cdc_database.add_tables(pg_admin, table)
        settings = platform_settings(cdc_database, server.url)
        lines: list[str] = []
        async with running_bridge(settings), snapshot_responder(settings):
            await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
            mirror = Mirror(settings, [table], tmp_path / "mirror.db", report=lines.append,
                            options=MirrorSettings(snapshot_wait_seconds=60.0))
            following = asyncio.create_task(mirror.run(until_caught_up=True))
            await wait_for(lambda: following.done() or any(
                "refused the snapshot request (maximum messages exceeded" in line
                for line in lines), what="the refusal reported")
            assert not following.done(), lines
            flood = await js.pull_subscribe_bind(REQUESTS_DURABLE, "SNAPSHOT_REQUESTS")
            for message in await flood.fetch(5):  # as the sensor acks what it handled
                await message.ack_sync()
            await asyncio.wait_for(following, 60)
        assert sorted(mirror_rows(tmp_path / "mirror.db", table, ["id"])) == [
            (n,) for n in range(1, 11)]
    finally:
        if client is not None:
            await close_nats(client, 5)
        server.stop()
