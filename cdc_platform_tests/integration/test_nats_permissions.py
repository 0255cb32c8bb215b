"""deploy/nats/nats-server.conf on a real nats-server: the bridge (user ``bridge``) provisions
and streams, a mirror (user ``consumer``) bootstraps and follows, and the consumer can forge
nothing every mirror would apply: no change event, no snapshot chunk or meta, no schema."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import nats
import pytest
from nats.js.api import ConsumerConfig

from cdc_platform.dev.servers import free_port
from cdc_platform.jetstream.connection import connect_nats
from cdc_platform.jetstream.provision import provision
from cdc_platform.mirror.follower import Mirror
from cdc_platform.replication.slots import read_slot
from cdc_platform.settings import MirrorSettings, NatsSettings, NatsTopology
from cdc_platform_tests.exactness import bridge_caught_up, mirror_rows, source_rows
from cdc_platform_tests.fixtures.responder import snapshot_responder
from cdc_platform_tests.fixtures.services import (
    nats_server_from,
    platform_settings,
    random_name,
    secret_for_test,
)
from cdc_platform_tests.integration.test_bridge import running_bridge, wait_for

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "nats" / "nats-server.conf"


@pytest.fixture
def secured_nats(tmp_path):
    """nats-server started from the deploy config; yields (url, bridge password, consumer
    password)."""
    port, monitor = free_port(), free_port()
    passwords = (secret_for_test(), secret_for_test())
    env = {**os.environ, "NATS_PORT": str(port), "NATS_MONITOR_LISTEN": f"127.0.0.1:{monitor}",
           "NATS_STORE_DIR": str(tmp_path / "jetstream"),
           "NATS_BRIDGE_PASSWORD": passwords[0], "NATS_CONSUMER_PASSWORD": passwords[1]}
    with nats_server_from(CONFIG, port, tmp_path / "nats.log", env):
        yield f"nats://127.0.0.1:{port}", *passwords


def _as(settings, user: str, password: str):
    nats_settings = NatsSettings(url=settings.nats.url.get_secret_value(), user=user,
                                 password=password)
    return settings.model_copy(update={"nats": nats_settings})


async def _connect_watched(url: str, user: str, password: str):
    """A plain nats-py client as ``user``, and the list its asynchronous errors (permissions
    violations) are appended to."""
    errors: list[Exception] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    client = await nats.connect(url, user=user, password=password, error_cb=on_error,
                                allow_reconnect=False)
    return client, errors


async def _refused(publish) -> bool:
    """Whether a JetStream publish was refused (the server answers a publish it does not
    permit with a permissions error and no ack: nats-py times out or raises)."""
    try:
        await publish()
    except Exception:  # noqa: BLE001 - any refusal will do; the stream's count is checked
        return True
    return False


async def test_a_consumer_reads_everything_and_can_forge_nothing(
        secured_nats, cdc_database, pg_admin, tmp_path):
    url, bridge_password, consumer_password = secured_nats
    table = random_name("guarded")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, 50) g")
    cdc_database.add_tables(pg_admin, table)
    settings = platform_settings(cdc_database, url)
    bridge = _as(settings, "bridge", bridge_password)
    consumer = _as(settings, "consumer", consumer_password)

    client = await connect_nats(bridge.nats)  # the bridge's user provisions
    await provision(client.jetstream(), NatsTopology())
    await client.close()

    db = tmp_path / "mirror.db"
    async with running_bridge(bridge), snapshot_responder(bridge):
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
        await Mirror(consumer, [table], db, options=MirrorSettings(status_interval_seconds=1.0),
                     report=lambda line: None).run(until_caught_up=True)
        pg_admin.execute(f"UPDATE {table} SET v = 'changed' WHERE id <= 5")
        pg_admin.execute(f"DELETE FROM {table} WHERE id > 45")
        # a value over max_payload: a claim check in the object store, written by the bridge
        pg_admin.execute(f"INSERT INTO {table} VALUES (1000, repeat('x', 1500000))")
        await bridge_caught_up(pg_admin, cdc_database.slot, timeout=60)

        # the consumer tries to forge: a DELETE of a row, a chunk, a meta, a schema
        forger, errors = await _connect_watched(url, "consumer", consumer_password)
        js = forger.jetstream(timeout=2.0)
        before = (await js.stream_info("CDC")).state.messages
        assert await _refused(lambda: js.publish(
            f"cdc.{table}.delete", b'{"table": "%s", "operation": "DELETE"}' % table.encode(),
            headers={"Nats-Msg-Id": "0/FFFFFFFF:0"}))
        assert await _refused(lambda: js.publish(f"init.snap.{table}.x.1", b"{}"))
        assert await _refused(lambda: js.publish(f"init.meta.{table}", b"{}"))
        kv = await js.key_value("schemas")
        assert await _refused(lambda: kv.put(table, b'{"table": "forged"}'))
        assert await _refused(lambda: js.purge_stream("CDC"))
        assert (await js.stream_info("CDC")).state.messages == before
        assert any("permissions violation" in str(e).lower() for e in errors), errors
        assert (await kv.get(table)).value != b'{"table": "forged"}'
        with contextlib.suppress(Exception):
            await forger.close()

        # and it still follows: the changes made above are mirrored
        await Mirror(consumer, [table], db, options=MirrorSettings(status_interval_seconds=1.0),
                     report=lambda line: None).run(until_caught_up=True)
    assert mirror_rows(db, table, ["id", "v"]) == source_rows(
        cdc_database.server.superuser_conninfo(), table, ["id", "v"])


def _with_team_users(config: str, teams: list[str]) -> str:
    """The deploy config with a user per team (password: ``$NATS_<TEAM>_PASSWORD``, from
    the environment, never in the file), each given the config's
    TEAM_A_PERMISSIONS block (commented out there) uncommented and copied for its own
    durable, as its comment says to."""
    commented = config[config.index("# TEAM_A_PERMISSIONS = {"):config.index("\nauthorization {")]
    block = "\n".join(line.removeprefix("#").removeprefix(" ")
                      for line in commented.splitlines()) + "\n"
    config = config.replace(commented, "")
    blocks = "".join(block.replace("team_a", team).replace("TEAM_A", team.upper())
                     for team in teams)
    users = "".join(f"    {{ user: {team}, password: $NATS_{team.upper()}_PASSWORD, "
                    f"permissions: ${team.upper()}_PERMISSIONS }}\n" for team in teams)
    config = config.replace("\nauthorization {", f"{blocks}\nauthorization {{")
    return config.replace("  users: [\n", f"  users: [\n{users}")


async def test_a_team_user_reaches_its_own_durable_and_no_other(cdc_database, pg_admin,
                                                                 tmp_path):
    """The README's remedy for a consumer deleting another's durable, on a real nats-server:
    each team's user (the config's TEAM_A_PERMISSIONS, copied per team) runs its mirror on
    its own durable, bootstrap and claim checks included, and can neither delete, read nor
    take over another team's."""
    port, monitor = free_port(), free_port()
    passwords = {name: secret_for_test() for name in ("bridge", "team_a", "team_b")}
    config = tmp_path / "nats-server.conf"
    config.write_text(_with_team_users(CONFIG.read_text(), ["team_a", "team_b"]))
    env = {**os.environ, "NATS_PORT": str(port), "NATS_MONITOR_LISTEN": f"127.0.0.1:{monitor}",
           "NATS_STORE_DIR": str(tmp_path / "jetstream"),
           "NATS_BRIDGE_PASSWORD": passwords["bridge"], "NATS_CONSUMER_PASSWORD": "unused",
           "NATS_TEAM_A_PASSWORD": passwords["team_a"],
           "NATS_TEAM_B_PASSWORD": passwords["team_b"]}
    table = random_name("teams")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, 50) g")
    cdc_database.add_tables(pg_admin, table)
    with nats_server_from(config, port, tmp_path / "nats.log", env):
        settings = platform_settings(cdc_database, f"nats://127.0.0.1:{port}")
        bridge = _as(settings, "bridge", passwords["bridge"])
        client = await connect_nats(bridge.nats)
        await provision(client.jetstream(), NatsTopology())
        await client.close()
        options = MirrorSettings(status_interval_seconds=1.0)
        async with running_bridge(bridge), snapshot_responder(bridge):
            await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
            for team in ("team_a", "team_b"):
                await Mirror(_as(settings, team, passwords[team]), [table],
                             tmp_path / f"{team}.db", durable=team, options=options,
                             report=lambda line: None).run(until_caught_up=True)
            pg_admin.execute(f"UPDATE {table} SET v = 'changed' WHERE id <= 5")
            pg_admin.execute(f"INSERT INTO {table} VALUES (1000, repeat('x', 1500000))")
            await bridge_caught_up(pg_admin, cdc_database.slot, timeout=60)

            intruder, errors = await _connect_watched(f"nats://127.0.0.1:{port}", "team_b",
                                                      passwords["team_b"])
            js = intruder.jetstream(timeout=2.0)
            assert await _refused(lambda: js.delete_consumer("CDC", "team_a"))
            assert await _refused(lambda: js.consumer_info("CDC", "team_a"))
            assert await _refused(lambda: intruder.request(
                "$JS.API.CONSUMER.MSG.NEXT.CDC.team_a", b'{"batch": 1}', timeout=2.0))
            assert await _refused(lambda: js.add_consumer(
                "CDC", ConsumerConfig(durable_name="team_a", deliver_subject="_INBOX.stolen")))
            assert await _refused(lambda: js.add_consumer(
                "CDC", ConsumerConfig(durable_name="other", filter_subject="cdc.>")))
            assert (await js.consumer_info("CDC", "team_b")).name == "team_b"  # its own
            assert any("permissions violation" in str(e).lower() for e in errors), errors
            with contextlib.suppress(Exception):
                await intruder.close()
            owner = await connect_nats(bridge.nats)
            assert (await owner.jetstream().consumer_info("CDC", "team_a")).name == "team_a"
            await owner.close()

            # and team_a follows on: the changes above, the claim-checked value included
            await Mirror(_as(settings, "team_a", passwords["team_a"]), [table],
                         tmp_path / "team_a.db", durable="team_a", options=options,
                         report=lambda line: None).run(until_caught_up=True)
    assert mirror_rows(tmp_path / "team_a.db", table, ["id", "v"]) == source_rows(
        cdc_database.server.superuser_conninfo(), table, ["id", "v"])


async def test_a_wrong_password_is_refused_clearly(secured_nats):
    from cdc_platform.errors import NatsAuthError

    url, _bridge_password, _consumer_password = secured_nats
    with pytest.raises(NatsAuthError, match="refused our credentials"):
        await connect_nats(NatsSettings(url=url, user="consumer", password="not-it"))


async def test_a_password_starting_with_a_digit_works_quoted_as_the_config_says(tmp_path):
    """nats-server parses an environment value as a config value: "12-..." reads as a date
    and the server does not start; quoted inside the value it is a string again."""
    port, monitor = free_port(), free_port()
    password = "12-34-" + secret_for_test()
    env = {**os.environ, "NATS_PORT": str(port), "NATS_MONITOR_LISTEN": f"127.0.0.1:{monitor}",
           "NATS_STORE_DIR": str(tmp_path / "jetstream"),
           "NATS_BRIDGE_PASSWORD": f'"{password}"', "NATS_CONSUMER_PASSWORD": "unused"}
    with nats_server_from(CONFIG, port, tmp_path / "nats.log", env):
        client = await connect_nats(NatsSettings(url=f"nats://127.0.0.1:{port}", user="bridge",
                                                 password=password))
        await client.close()
