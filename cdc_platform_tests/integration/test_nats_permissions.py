"""deploy/nats/nats-server.conf on a real nats-server: PLATFORM holds the streams and the
writers, READERS holds mirrors of them and everyone who reads (docs/operations.md "NATS setup"). The
bridge streams as ``bridge``, a mirror bootstraps and follows as ``consumer`` (and as two
teams) through the mirrors, and no reader can have anything stored where the platform or
another reader would take it for real: every attack of issue 24 item 4 is run here."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig
from pydantic import SecretStr

from cdc_platform.dev.servers import free_port
from cdc_platform.errors import ProvisioningError
from cdc_platform.fleet import read_fleet
from cdc_platform.jetstream.connection import connect_nats
from cdc_platform.jetstream.provision import REQUESTS_DURABLE as DURABLE
from cdc_platform.jetstream.provision import provision, provision_readers
from cdc_platform.mirror.follower import Mirror
from cdc_platform.settings import (
    CdcStreamSettings,
    MirrorSettings,
    NatsSettings,
    NatsTopology,
)
from cdc_platform.snapshot.requests import (
    Reply,
    answer_requests,
    fetch_requests,
    send_replies,
)
from cdc_platform_tests.exactness import bridge_caught_up, mirror_rows, source_rows
from cdc_platform_tests.fixtures.bridge import running_bridge, wait_for
from cdc_platform_tests.fixtures.responder import snapshot_responder
from cdc_platform_tests.fixtures.services import (
    nats_server_from,
    platform_settings,
    random_name,
    secret_for_test,
)

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "nats" / "nats-server.conf"
USERS = ("bridge", "provisioner", "sensor", "fleet", "consumer", "replier", "readers_admin")


MAKE_CERTS = CONFIG.parent / "make-certs.sh"


def bcrypt_for_server(password: str) -> str:
    """The server's environment value for ``password``: its bcrypt hash quoted inside the
    value, as deploy/nats/make-password.sh writes it (cost 4 here: tests connect often)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt
    hashed = crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))
    return '"' + hashed.replace("$2b$", "$2a$", 1) + '"'


def make_certs(directory: Path) -> Path:
    """deploy/nats/make-certs.sh for this host: its CA (what clients trust) is returned."""
    subprocess.run(["sh", str(MAKE_CERTS), str(directory), "localhost", "127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return directory / "ca.pem"


def server_env(tmp_path: Path, port: int, passwords: dict[str, str]) -> dict[str, str]:
    """What the shipped config reads: places, TLS files (made by make-certs.sh), and each
    user's password as a bcrypt hash."""
    tls = tmp_path / "tls"
    make_certs(tls)
    return {**os.environ, "NATS_PORT": str(port),
            "NATS_MONITOR_LISTEN": f"127.0.0.1:{free_port()}",
            "NATS_STORE_DIR": str(tmp_path / "jetstream"),
            "NATS_TLS_CERT": str(tls / "server.pem"), "NATS_TLS_KEY": str(tls / "server-key.pem"),
            **{f"NATS_{user.upper()}_PASSWORD": bcrypt_for_server(password)
               for user, password in passwords.items()}}


@dataclass
class Deployment:
    """A nats-server started from the deploy config, provisioned on both sides."""

    url: str
    ca: Path
    passwords: dict[str, str]

    def nats(self, user: str) -> NatsSettings:
        return NatsSettings(url=self.url, user=user, password=self.passwords[user],
                            tls_ca_file=str(self.ca))

    async def connect(self, user: str, inbox_prefix: str = "_INBOX"):
        """A plain nats-py client as ``user``, and the list its asynchronous errors
        (permissions violations) are appended to."""
        errors: list[Exception] = []

        async def on_error(exc: Exception) -> None:
            errors.append(exc)

        client = await nats.connect(self.url, user=user, password=self.passwords[user],
                                    error_cb=on_error, allow_reconnect=False,
                                    inbox_prefix=inbox_prefix,
                                    tls=self.nats(user).tls_context())
        return client, errors


@contextlib.asynccontextmanager
async def _deployment(tmp_path: Path, teams: tuple[str, ...] = (), *,
                      provisioned: bool = True):
    port = free_port()
    passwords = {user: secret_for_test() for user in (*USERS, *teams)}
    config = tmp_path / "nats-server.conf"
    config.write_text(_with_team_users(CONFIG.read_text(), teams) if teams
                      else CONFIG.read_text())
    env = server_env(tmp_path, port, passwords)
    with nats_server_from(config, port, tmp_path / "nats.log", env):
        deployment = Deployment(f"tls://127.0.0.1:{port}", tmp_path / "tls" / "ca.pem",
                                passwords)
        for user, make in (("provisioner", provision), ("readers_admin", provision_readers)
                           ) if provisioned else ():
            client = await connect_nats(deployment.nats(user))
            await make(client.jetstream(), NatsTopology())
            await client.close()
        yield deployment


@pytest.fixture
async def deployment(tmp_path):
    async with _deployment(tmp_path) as started:
        yield started


def _with_team_users(config: str, teams: tuple[str, ...]) -> str:
    """The deploy config with a READERS user per team (password: ``$NATS_<TEAM>_PASSWORD``),
    each given the config's TEAM_A_PERMISSIONS block (commented out there) uncommented and
    copied for its own name, and its inbox prefix added to the replier's, as its comment
    says to."""
    start = config.index("# TEAM_A_PERMISSIONS = {")
    end = config.index("\n# ", config.index("# }", start))
    commented = config[start:end]
    block = "\n".join(line.removeprefix("#").removeprefix(" ")
                      for line in commented.splitlines()) + "\n"
    config = config.replace(commented, "".join(
        block.replace("team_a", team).replace("TEAM_A", team.upper()) for team in teams))
    users = "".join(f"      {{ user: {team}, password: $NATS_{team.upper()}_PASSWORD, "
                    f"permissions: ${team.upper()}_PERMISSIONS }}\n" for team in teams)
    anchor = "      { user: consumer, "
    assert config.count(anchor) == 1
    config = config.replace(anchor, users + anchor)
    replier = 'publish: { allow: ["_INBOX.>"] }'
    assert config.count(replier) == 1
    prefixes = "".join(f', "_INBOX_{team}.>"' for team in teams)
    return config.replace(replier, f'publish: {{ allow: ["_INBOX.>"{prefixes}] }}')


async def _schema_mirrored(deployment: Deployment, table: str) -> None:
    """Until READERS' mirror of the schemas bucket holds ``table``'s (the bridge publishes it
    as it starts; the mirror follows within moments)."""
    reader, _ = await deployment.connect("consumer")
    kv = await reader.jetstream().key_value("schemas")

    async def mirrored() -> bool:
        with contextlib.suppress(Exception):
            return bool(await kv.get(table))
        return False

    await wait_for(mirrored, timeout=30, what=f"{table}'s schema in READERS")
    await reader.close()


def _as(settings, deployment: Deployment, user: str):
    return settings.model_copy(update={"nats": deployment.nats(user)})


async def _refused(action) -> bool:
    """Whether the server refused ``action`` (a permissions violation: nats-py times out or
    raises; an API error)."""
    try:
        await action()
    except Exception:  # noqa: BLE001 - any refusal will do; the effect is checked too
        return True
    return False


async def _messages(js, stream: str) -> int:
    return (await js.stream_info(stream)).state.messages


async def _mirrored(reader_js, platform_js, stream: str) -> None:
    """Until READERS' mirror of ``stream`` holds what PLATFORM's does."""
    last = (await platform_js.stream_info(stream)).state.last_seq

    async def caught_up() -> bool:
        return (await reader_js.stream_info(stream)).state.last_seq >= last

    await wait_for(caught_up, timeout=20, what=f"the READERS mirror of {stream}")


async def test_a_consumer_reads_everything_through_the_mirrors_and_can_forge_nothing(
        deployment, cdc_database, pg_admin, tmp_path):
    table = random_name("guarded")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, 50) g")
    cdc_database.add_tables(pg_admin, table)
    settings = platform_settings(cdc_database, deployment.url)
    bridge = _as(settings, deployment, "bridge")
    consumer = _as(settings, deployment, "consumer")
    options = MirrorSettings(status_interval_seconds=1.0)

    db = tmp_path / "mirror.db"
    async with running_bridge(bridge), snapshot_responder(
            bridge, replies=deployment.nats("replier")):
        await _schema_mirrored(deployment, table)
        await Mirror(consumer, [table], db, options=options,
                     report=lambda line: None).run(until_caught_up=True)
        pg_admin.execute(f"UPDATE {table} SET v = 'changed' WHERE id <= 5")
        pg_admin.execute(f"DELETE FROM {table} WHERE id > 45")
        # a value over max_payload: a claim check in the object store, written by the bridge
        pg_admin.execute(f"INSERT INTO {table} VALUES (1000, repeat('x', 1500000))")
        await bridge_caught_up(pg_admin, cdc_database.slot, timeout=60)

        # the consumer tries to forge: a DELETE of a row, a chunk, a meta, a schema, a purge
        owner, _ = await deployment.connect("bridge")
        forger, errors = await deployment.connect("consumer")
        js, platform = forger.jetstream(timeout=2.0), owner.jetstream()
        before = await _messages(platform, "CDC")
        assert await _refused(lambda: js.publish(
            f"cdc.{table}.delete", b'{"table": "%s", "operation": "DELETE"}' % table.encode(),
            headers={"Nats-Msg-Id": "0/FFFFFFFF:0"}))
        assert await _refused(lambda: js.publish(f"init.snap.{table}.x.1", b"{}"))
        assert await _refused(lambda: js.publish(f"init.meta.{table}", b"{}"))
        kv = await js.key_value("schemas")
        assert await _refused(lambda: kv.put(table, b'{"table": "forged"}'))
        assert await _refused(lambda: js.purge_stream("CDC"))
        assert await _refused(lambda: js.delete_stream("CDC"))
        assert await _messages(platform, "CDC") == before
        assert await _messages(js, "CDC") == before  # (the mirror: same messages)
        assert any("permissions violation" in str(e).lower() for e in errors), errors
        assert (await kv.get(table)).value != b'{"table": "forged"}'
        await forger.close()
        await owner.close()

        # and it still follows: the changes made above are mirrored
        await Mirror(consumer, [table], db, options=options,
                     report=lambda line: None).run(until_caught_up=True)
    assert mirror_rows(db, table, ["id", "v"]) == source_rows(
        cdc_database.server.superuser_conninfo(), table, ["id", "v"])


async def test_what_a_reader_has_delivered_is_stored_nowhere(deployment):
    """Issue 24 item 4: JetStream publishes a consumer's deliveries as the server, past user
    permissions. A pull request replying to `cdc.users.delete`, a push consumer delivering
    there, a team's own durable doing the same, and Nats-Msg-Ids planted that way so that a
    genuine change later counts as a duplicate (and is lost): in READERS, whose mirrors
    listen on no subject, none of it is stored anywhere."""
    owner, _ = await deployment.connect("bridge")
    platform = owner.jetstream()
    planted = "0/1234ABCD:0"  # a Nats-Msg-Id the bridge will publish later
    for n in range(3):
        await platform.publish("cdc.users.insert", b'{"n": %d}' % n)
    await platform.publish("init.meta.users", b"{}")
    reader, _ = await deployment.connect("consumer")
    js = reader.jetstream(timeout=2.0)
    for stream in ("CDC", "INIT"):
        await _mirrored(js, platform, stream)
    counts = {stream: await _messages(platform, stream) for stream in ("CDC", "INIT")}

    # a request carrying the planted id reaches SNAPSHOT_REQUESTS (requests are the readers'
    # to make) but the stream is PLATFORM's: no reader consumes it, to replay it elsewhere
    await js.publish("snapshot.request.users", b"{}", headers={"Nats-Msg-Id": planted})
    assert await _refused(lambda: js.add_consumer("SNAPSHOT_REQUESTS", ConsumerConfig(
        name="replay", ack_policy=AckPolicy.NONE)))
    # pull deliveries to `cdc.users.delete`, from CDC and INIT
    for stream in ("CDC", "INIT"):
        await js.add_consumer(stream, ConsumerConfig(name=f"pull_{stream}",
                                                     ack_policy=AckPolicy.NONE))
        await reader.publish(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.pull_{stream}",
                             b'{"batch": 10}', reply="cdc.users.delete")
    # push deliveries to `cdc.users.update` and `init.meta.users`
    await js.add_consumer("INIT", ConsumerConfig(
        name="push_cdc", deliver_subject="cdc.users.update", ack_policy=AckPolicy.NONE))
    await js.add_consumer("CDC", ConsumerConfig(
        name="push_init", deliver_subject="init.meta.users", ack_policy=AckPolicy.NONE))
    await reader.flush()
    await asyncio.sleep(1.0)  # (what would be stored is stored by now)
    for stream, count in counts.items():
        assert await _messages(platform, stream) == count, stream
        assert await _messages(js, stream) == count, stream

    # and the genuine change with that id is stored, not dropped as a duplicate
    ack = await platform.publish("cdc.users.insert", b'{"genuine": true}',
                                 headers={"Nats-Msg-Id": planted})
    assert not ack.duplicate
    await reader.close()
    await owner.close()


async def test_a_team_reaches_its_own_durable_and_inbox_and_no_other(cdc_database, pg_admin,
                                                                     tmp_path):
    """The config's per-team template, copied for two teams: each runs its mirror on its own
    durable and inbox prefix (bootstrap, claim checks, follow) through READERS; one team can
    neither delete, read from nor take over the other's durable, nor read the other's
    deliveries, nor have its own durable store anything."""
    table = random_name("teams")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, 50) g")
    cdc_database.add_tables(pg_admin, table)
    async with _deployment(tmp_path, ("team_a", "team_b")) as deployment:
        settings = platform_settings(cdc_database, deployment.url)
        bridge = _as(settings, deployment, "bridge")

        def team_mirror(team: str) -> Mirror:
            return Mirror(_as(settings, deployment, team), [table], tmp_path / f"{team}.db",
                          durable=team, options=MirrorSettings(
                              status_interval_seconds=1.0, inbox_prefix=f"_INBOX_{team}",
                              mirror_id=f"{team}.edge"),
                          report=lambda line: None)

        async with running_bridge(bridge), snapshot_responder(
                bridge, replies=deployment.nats("replier")):
            await _schema_mirrored(deployment, table)
            for team in ("team_a", "team_b"):
                await team_mirror(team).run(until_caught_up=True)
            # each reported its state, under its team's name, through READERS' import
            fleet, _ = await deployment.connect("fleet")
            for team in ("team_a", "team_b"):
                state = json.loads((await fleet.jetstream().get_last_msg(
                    "KV_mirrors", f"$KV.mirrors.{team}.edge")).data)
                assert state["mirror_id"] == f"{team}.edge" and table in state["tables"]
            await fleet.close()
            pg_admin.execute(f"UPDATE {table} SET v = 'changed' WHERE id <= 5")
            pg_admin.execute(f"INSERT INTO {table} VALUES (1000, repeat('x', 1500000))")
            await bridge_caught_up(pg_admin, cdc_database.slot, timeout=60)

            intruder, errors = await deployment.connect("team_b", "_INBOX_team_b")
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
            # another team's deliveries: nothing on `_INBOX.>` nor on team_a's prefix
            for inbox in ("_INBOX.>", "_INBOX_team_a.>"):
                errors.clear()
                await intruder.subscribe(inbox)
                await intruder.flush()
                await wait_for(lambda: errors, timeout=5, what=f"refusing {inbox}")
                assert "permissions violation" in str(errors[0]).lower(), errors
            # its own durable replying into `cdc.>` stores nothing
            owner, _ = await deployment.connect("bridge")
            before = await _messages(owner.jetstream(), "CDC")
            await intruder.publish("$JS.API.CONSUMER.MSG.NEXT.CDC.team_b", b'{"batch": 10}',
                                   reply=f"cdc.{table}.delete")
            await intruder.flush()
            await asyncio.sleep(1.0)
            assert await _messages(owner.jetstream(), "CDC") == before
            await intruder.close()
            await owner.close()
            keeper, _ = await deployment.connect("team_a", "_INBOX_team_a")
            assert (await keeper.jetstream().consumer_info("CDC", "team_a")).name == "team_a"
            await keeper.close()

            # and team_a follows on: the changes above, the claim-checked value included
            await team_mirror("team_a").run(until_caught_up=True)
    assert mirror_rows(tmp_path / "team_a.db", table, ["id", "v"]) == source_rows(
        cdc_database.server.superuser_conninfo(), table, ["id", "v"])


async def test_a_reader_reports_its_own_mirror_state_and_reads_nobodys(tmp_path):
    """A mirror's state goes through READERS' import `mirror.state.>` into PLATFORM's KV
    `mirrors`, where only `fleet` reads it: a team writes under its own name only, reads no
    state (nor the publishes of others), and reaches no other bucket or stream through it;
    a rollup header cannot purge the others' states; `fleet` reads and writes nothing else."""
    async with _deployment(tmp_path, ("team_a", "team_b")) as deployment:
        fleet, _ = await deployment.connect("fleet")
        states = fleet.jetstream(timeout=2.0)

        async def state(key: str) -> bytes | None:
            with contextlib.suppress(Exception):
                return (await states.get_last_msg("KV_mirrors", f"$KV.mirrors.{key}",
                                                  direct=True)).data
            return None

        for user, key in (("consumer", "edge1"), ("team_a", "team_a.edge1"),
                          ("team_b", "team_b.edge1")):
            writer, _ = await deployment.connect(user, "_INBOX" if user == "consumer"
                                                 else f"_INBOX_{user}")
            ack = await writer.jetstream().publish(f"mirror.state.{key}", b'{"by": "%s"}'
                                                   % user.encode())
            assert ack.stream == "KV_mirrors"
            await writer.close()
            assert await state(key) == b'{"by": "%s"}' % user.encode()

        intruder, errors = await deployment.connect("team_b", "_INBOX_team_b")
        js = intruder.jetstream(timeout=0.5)  # (a refused publish waits for no ack)
        for subject in ("mirror.state.team_a.edge1", "mirror.state.edge1",
                        "$KV.mirrors.team_b.x", "$KV.schemas.users", "cdc.users.insert",
                        "init.meta.users"):
            assert await _refused(lambda subject=subject: js.publish(subject, b"{}")), subject
        # its own key with a rollup header: refused by the bucket, nothing purged
        assert await _refused(lambda: js.publish("mirror.state.team_b.edge1", b"{}",
                                                 headers={"Nats-Rollup": "all"}))
        assert await state("team_a.edge1") == b'{"by": "team_a"}'
        # no reader reads the bucket, nor what others publish into it
        assert await _refused(lambda: js.get_last_msg("KV_mirrors",
                                                      "$KV.mirrors.team_a.edge1"))
        errors.clear()
        await intruder.subscribe("mirror.state.>")
        await intruder.flush()
        await wait_for(lambda: errors, timeout=5, what="refusing mirror.state.>")
        await intruder.close()

        # fleet: reads the keys and values, writes nowhere, not even into its bucket
        keys = (await states.stream_info("KV_mirrors", subjects_filter=">")).state.subjects
        assert set(keys or {}) == {"$KV.mirrors.edge1", "$KV.mirrors.team_a.edge1",
                                   "$KV.mirrors.team_b.edge1"}
        # as mirror_fleet_sensor reads them (none of these values is a mirror's state)
        assert set((await read_fleet(states, "mirrors")).unreadable) == {
            "edge1", "team_a.edge1", "team_b.edge1"}
        refusing = fleet.jetstream(timeout=0.5)
        for subject in ("$KV.mirrors.edge1", "cdc.users.insert", "$KV.schemas.users"):
            assert await _refused(lambda subject=subject: refusing.publish(subject, b"{}"))
        assert await _refused(lambda: refusing.purge_stream("KV_mirrors"))
        assert await _refused(lambda: refusing.stream_info("CDC"))
        assert await state("edge1") == b'{"by": "consumer"}'
        await fleet.close()


async def test_a_reader_reaches_no_platform_consumer_lists_none_and_is_bounded(deployment):
    """The snapshot sensor's durable is PLATFORM's: a reader cannot delete it (requests
    would go unanswered). No reader lists consumers (other readers' names), publishes on
    the imported API or the mirrors' deliver subjects, or opens consumers without limit."""
    sensor, _ = await deployment.connect("sensor")
    await fetch_requests(sensor, "SNAPSHOT_REQUESTS", DURABLE, 0, 10)  # (provisioned)
    assert await _refused(lambda: sensor.jetstream(timeout=2.0).add_consumer(
        "SNAPSHOT_REQUESTS", ConsumerConfig(name="other", ack_policy=AckPolicy.NONE)))
    reader, errors = await deployment.connect("consumer")
    js = reader.jetstream(timeout=2.0)
    assert await _refused(lambda: js.delete_consumer("SNAPSHOT_REQUESTS", DURABLE))
    assert (await sensor.jetstream().consumer_info("SNAPSHOT_REQUESTS", DURABLE)).name == DURABLE
    await js.add_consumer("CDC", ConsumerConfig(name="someone", ack_policy=AckPolicy.NONE))
    assert await _refused(lambda: js.consumers_info("CDC"))
    assert await _refused(lambda: reader.request("$JS.API.CONSUMER.NAMES.CDC", b"{}",
                                                 timeout=2.0))
    assert await _refused(lambda: reader.request(
        "$PLATFORM.API.CONSUMER.CREATE.CDC", b'{"stream_name": "CDC", "config": {}}',
        timeout=2.0))
    errors.clear()
    await reader.publish("deliver.PLATFORM.CDC.M.x", b"forged")
    await reader.flush()
    await wait_for(lambda: errors, timeout=5, what="refusing the deliver subject")

    with pytest.raises(Exception, match="maximum consumers limit"):
        for n in range(300):
            await js.add_consumer("CDC", ConsumerConfig(name=f"many{n}",
                                                        ack_policy=AckPolicy.NONE))
    assert (await js.stream_info("CDC")).state.consumer_count == 256
    await reader.close()
    await sensor.close()


async def test_each_platform_user_has_its_own_rights_only(deployment):
    """bridge: writes the streams, changes none; provisioner: the streams' configs only;
    sensor: its durable and the reads answering requests take, writes nothing; replier:
    inbox subjects only, which reach a reader."""
    owner, _ = await deployment.connect("bridge")
    js = owner.jetstream(timeout=2.0)
    await js.publish("cdc.users.insert", b"{}")
    for act in (lambda: js.purge_stream("CDC"), lambda: js.delete_stream("INIT"),
                lambda: js.delete_msg("CDC", 1),
                lambda: _shorten_retention(js, "CDC")):
        assert await _refused(act)
    assert await _messages(js, "CDC") == 1

    for user in ("provisioner", "sensor", "replier"):
        client, _ = await deployment.connect(user)
        for subject in ("cdc.users.insert", "init.meta.users"):
            assert await _refused(partial(client.jetstream(timeout=2.0).publish, subject,
                                          b"{}")), (user, subject)
        await client.close()
    assert await _messages(js, "CDC") == 1

    # the sensor reads and decides a request; the replier's reply reaches the requester
    reader, _ = await deployment.connect("consumer")
    inbox = reader.new_inbox()
    replies = await reader.subscribe(inbox)
    await reader.jetstream().publish("snapshot.request.users",
                                     b'{"request_id": "r1", "reply_to": "%s"}' % inbox.encode())
    sensor, _ = await deployment.connect("sensor")
    requests = await fetch_requests(sensor, "SNAPSHOT_REQUESTS", DURABLE, 0, 10)
    handled = await answer_requests(sensor, requests, published={"users": 1},
                                    publication="cdc_pub", reuse_seconds=600, in_flight={})
    assert list(handled.runs) == ["users"]
    replier, errors = await deployment.connect("replier")
    await send_replies(replier, [(inbox, Reply("accepted", "users", "r1"))])
    assert b'"status": "accepted"' in (await replies.next_msg(timeout=5)).data
    for subject in ("snapshot.request.users", "$JS.API.STREAM.PURGE.CDC", "cdc.users.insert"):
        errors.clear()
        await replier.publish(subject, b"{}")
        await replier.flush()
        await wait_for(lambda: errors, timeout=5, what=f"refusing {subject}")
    for client in (replier, sensor, reader, owner):
        await client.close()


async def _shorten_retention(js, stream: str) -> None:
    info = await js.stream_info(stream)
    info.config.max_age = 60.0
    await js.update_stream(info.config)


async def test_provision_makes_each_side_with_its_own_credential(tmp_path):
    """`cdc-platform provision` as `provisioner` (CDC_NATS_*), then `provision --readers` as
    `readers_admin` (CDC_READERS_NATS_*): the mirrors are made, and made once."""
    async with _deployment(tmp_path, provisioned=False) as deployment:
        env = {name: value for name, value in os.environ.items()
               if not name.startswith(("CDC_NATS_", "CDC_READERS_NATS_"))}
        env.update(CDC_NATS_URL=deployment.url, CDC_NATS_USER="provisioner",
                   CDC_NATS_PASSWORD=deployment.passwords["provisioner"],
                   CDC_NATS_TLS_CA=str(deployment.ca),
                   CDC_READERS_NATS_URL=deployment.url, CDC_READERS_NATS_USER="readers_admin",
                   CDC_READERS_NATS_PASSWORD=deployment.passwords["readers_admin"],
                   CDC_READERS_NATS_TLS_CA=str(deployment.ca))

        def run(*args: str) -> str:
            result = subprocess.run([sys.executable, "-m", "cdc_platform.cli", "provision",
                                     *args], env=env, capture_output=True, text=True,
                                    timeout=60, check=False)
            assert result.returncode == 0, result.stderr
            return result.stdout

        assert "created: CDC, INIT, SNAPSHOT_REQUESTS" in run()
        mirrors = ("mirror:CDC, mirror:INIT, mirror:KV_schemas, mirror:KV_zstd_dictionaries, "
                   "mirror:OBJ_cdc_large")
        assert run("--readers").strip() == f"created: {mirrors}"
        assert run("--readers").strip() == f"ok: {mirrors}"
        reader, _ = await deployment.connect("consumer")
        info = await reader.jetstream().stream_info("CDC")
        assert info.mirror is not None and not info.config.subjects
        await reader.close()


async def test_mirrors_that_do_not_fit_readers_storage_are_refused_clearly(tmp_path):
    """READERS' mirrors reserve their origins' max_bytes against READERS' own limit (20 GB
    in the shipped config): provisioning says which limit, not only the server's."""
    topology = NatsTopology(cdc=CdcStreamSettings(max_bytes=15 * 1024**3))
    async with _deployment(tmp_path, provisioned=False) as deployment:
        client = await connect_nats(deployment.nats("provisioner"))
        await provision(client.jetstream(), topology)
        await client.close()
        client = await connect_nats(deployment.nats("readers_admin"))
        with pytest.raises(ProvisioningError, match="READERS account's jetstream max_file"):
            await provision_readers(client.jetstream(), topology)
        await client.close()


async def test_only_tls_clients_with_a_users_password_get_in(deployment, tmp_path):
    """The shipped config: TLS on the client port (certificates from make-certs.sh, trusted
    with CDC_NATS_TLS_CA), passwords known to the server only as bcrypt hashes."""
    from cdc_platform.errors import NatsAuthError

    client = await connect_nats(deployment.nats("consumer"))  # (TLS, the hash matched)
    await client.close()
    with pytest.raises(NatsAuthError, match="refused our credentials"):
        await connect_nats(deployment.nats("consumer").model_copy(
            update={"password": SecretStr("not-it")}))
    # the server tells every client it requires TLS before anything else is said
    host, port = deployment.url.removeprefix("tls://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    info = json.loads((await reader.readline()).removeprefix(b"INFO "))
    writer.close()
    assert info["tls_required"] is True
    log = (tmp_path / "nats.log").read_text()
    assert "TLS required for client connections" in log
    assert "Plaintext passwords detected" not in log


async def test_a_password_starting_with_a_digit_works_quoted_as_the_config_says(tmp_path):
    """nats-server parses an environment value as a config value: "12-..." reads as a date
    and the server does not start; quoted inside the value it is a string again."""
    port = free_port()
    password = "12-34-" + secret_for_test()
    env = {**server_env(tmp_path, port, {user: "unused" for user in USERS}),
           "NATS_BRIDGE_PASSWORD": f'"{password}"'}
    with nats_server_from(CONFIG, port, tmp_path / "nats.log", env):
        client = await connect_nats(NatsSettings(
            url=f"tls://127.0.0.1:{port}", user="bridge", password=password,
            tls_ca_file=str(tmp_path / "tls" / "ca.pem")))
        await client.close()
