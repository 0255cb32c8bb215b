"""A mirror's state in KV `mirrors` (docs/verification.md Part 2, item 5) on a server of one
account, as in the dev stack: published at start, on report_now() and every interval, gone
after the bucket's TTL once the mirror stops; a last state saying it stopped when it stops on
purpose (not when it fails); a table resyncing after a lost slot says so until verified; a
publish that fails is said once and stops nothing. (Through READERS' import with a team's
user: test_nats_permissions.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import signal
import sqlite3
import subprocess
import time

import msgpack
import pytest
from nats.js.errors import NotFoundError

from cdc_platform.jetstream.connection import connect_nats
from cdc_platform.jetstream.provision import (
    mirror_state_bucket_config,
    reader_written_bucket_stream,
)
from cdc_platform.lsn import parse_lsn
from cdc_platform.mirror.errors import MirrorError
from cdc_platform.mirror.follower import Mirror
from cdc_platform.settings import MirrorSettings, MirrorStateBucketSettings, NatsTopology
from cdc_platform.verify.job import verify_table
from cdc_platform.wire import MIRROR_STATE_FIELDS, resync_msg_id, resync_subject
from cdc_platform_tests.fixtures.bridge import bridge_ready, running_bridge, wait_for
from cdc_platform_tests.fixtures.responder import snapshot_responder
from cdc_platform_tests.fixtures.services import (
    CLI,
    bridge_env,
    platform_settings,
    random_name,
)


def _with_state_bucket(settings, bucket: str, ttl: float):
    topology = NatsTopology(mirrors=MirrorStateBucketSettings(bucket=bucket,
                                                              max_age_seconds=ttl))
    return settings.model_copy(update={"topology": topology})


def _verified_before(db_path, table: str) -> None:
    """The verification table another part of the mirror writes, with one result."""
    with contextlib.closing(sqlite3.connect(db_path)) as db, db:
        db.execute("CREATE TABLE _cdc_mirror_verifications (verification_id TEXT, "
                   "wire_table TEXT, lsn TEXT, status TEXT, buckets_differing INTEGER, "
                   "rows_repaired INTEGER, at REAL)")
        db.executemany("INSERT INTO _cdc_mirror_verifications VALUES (?, ?, ?, ?, ?, ?, ?)",
                       [("verify-1", table, "0/10", "differ", 3, 0, 1.7e9),
                        ("verify-1", table, "0/10", "repaired", 3, 12, 1.7e9 + 5)])


async def test_a_mirror_publishes_its_state_and_is_gone_after_the_ttl(
        cdc_database, pg_admin, provisioned_nats, tmp_path):
    table = random_name("fleet")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, 20) g")
    cdc_database.add_tables(pg_admin, table)
    bucket = random_name("mirrors")
    settings = _with_state_bucket(platform_settings(cdc_database, provisioned_nats.url),
                                  bucket, ttl=2.0)
    client = await connect_nats(settings.nats)
    js = client.jetstream()
    await js.add_stream(reader_written_bucket_stream(mirror_state_bucket_config(
        settings.topology)))
    db = tmp_path / "edge.db"
    _verified_before(db, table)
    # a long interval: what is seen after the first publish came from report_now()
    options = MirrorSettings(status_interval_seconds=0.5, state_interval_seconds=600,
                             mirror_id="fleet_test.edge")

    async def state() -> dict | None:
        with contextlib.suppress(NotFoundError):
            return json.loads((await js.get_last_msg(
                f"KV_{bucket}", f"$KV.{bucket}.fleet_test.edge")).data)
        return None

    try:
        async with running_bridge(settings), snapshot_responder(settings):
            await bridge_ready(pg_admin, cdc_database, settings, [table])
            stop = asyncio.Event()
            mirror = Mirror(settings, [table], db, options=options, report=lambda line: None)
            mirror.fleet.report_now()  # (before it runs: nothing to do)
            running = asyncio.create_task(mirror.run(stop))
            await wait_for(state, timeout=30, what="the first state")
            await wait_for(lambda: not mirror.bootstrapping, timeout=60, what="streaming")
            # (as a verification's worker thread may call it)
            await asyncio.to_thread(mirror.fleet.report_now)

            async def streaming() -> bool:
                value = await state()
                return bool(value and value["tables"][table]["status"] == "streaming"
                            and value["consistent_lsn"])

            await wait_for(streaming, timeout=10, what="the state after report_now()")
            value = await state()
            stop.set()
            await running
        assert value is not None
        assert tuple(value) == MIRROR_STATE_FIELDS
        assert value["mirror_id"] == "fleet_test.edge"
        shown = value["tables"][table]
        assert shown["snapshot_id"] and parse_lsn(shown["cutover_lsn"]) > 0
        assert shown["last_verification"] == {
            "verification_id": "verify-1", "lsn": "0/10", "status": "repaired",
            "buckets_differing": 3, "rows_repaired": 12, "at": "2023-11-14T22:13:25Z"}
        # (a snapshot's cutover may be past the stream's last commit: no lag then)
        assert value["lag_bytes"] == max(0, parse_lsn(value["stream_last_lsn"])
                                         - parse_lsn(value["consistent_lsn"]))
        assert value["lag_seconds"] >= 0 and value["pid"] > 0

        # stopped: gone once the TTL has passed
        async def gone() -> bool:
            return await state() is None

        await wait_for(gone, timeout=15, what="the state to expire")
    finally:
        await js.delete_stream(f"KV_{bucket}")
        await client.close()


async def test_a_state_that_cannot_be_published_is_said_once_and_stops_nothing(
        cdc_database, pg_admin, provisioned_nats, tmp_path, caplog):
    table = random_name("unreported")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} VALUES (1, 'a')")
    cdc_database.add_tables(pg_admin, table)
    # no such bucket: neither the import's subject nor the bucket's has anyone behind it
    settings = _with_state_bucket(platform_settings(cdc_database, provisioned_nats.url),
                                  random_name("missing"), ttl=60)
    options = MirrorSettings(status_interval_seconds=0.5, state_interval_seconds=0.05)
    caplog.set_level(logging.WARNING, logger="cdc_platform.mirror.fleet")
    async with running_bridge(settings), snapshot_responder(settings):
        await bridge_ready(pg_admin, cdc_database, settings, [table])
        mirror = Mirror(settings, [table], tmp_path / "m.db", options=options,
                        report=lambda line: None)
        await mirror.run(until_caught_up=True)
    said = [r.getMessage() for r in caplog.records if "publishing its state" in r.getMessage()]
    assert len(said) == 1, said
    assert mirror.fleet.published == 0 and not mirror.bootstrapping


class _StateBucket:
    """A KV `mirrors` of the test's own, read back by mirror id."""

    def __init__(self, js, bucket: str) -> None:
        self.js, self.bucket = js, bucket

    async def state(self, mirror_id: str) -> dict | None:
        with contextlib.suppress(NotFoundError):
            return json.loads((await self.js.get_last_msg(
                f"KV_{self.bucket}", f"$KV.{self.bucket}.{mirror_id}")).data)
        return None


@contextlib.asynccontextmanager
async def _state_bucket(settings):
    client = await connect_nats(settings.nats)
    js = client.jetstream()
    await js.add_stream(reader_written_bucket_stream(mirror_state_bucket_config(
        settings.topology)))
    try:
        yield _StateBucket(js, settings.topology.mirrors.bucket)
    finally:
        await js.delete_stream(f"KV_{settings.topology.mirrors.bucket}")
        await client.close()


def _small_table(cdc_database, pg_admin, prefix: str) -> str:
    table = random_name(prefix)
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, 20) g")
    cdc_database.add_tables(pg_admin, table)
    return table


async def test_a_mirror_that_stops_on_purpose_says_so_and_one_that_fails_does_not(
        cdc_database, pg_admin, provisioned_nats, tmp_path):
    """`--once` (caught up) and SIGTERM end with a last state carrying `stopped_at`, so the
    fleet tells them from a crash (docs: "Mirror state"); a mirror ended by an error says
    nothing of the kind (its state goes with the TTL: gone)."""
    table = _small_table(cdc_database, pg_admin, "stopping")
    bucket = random_name("mirrors")
    settings = _with_state_bucket(platform_settings(cdc_database, provisioned_nats.url),
                                  bucket, ttl=60.0)
    env = {**bridge_env(cdc_database, provisioned_nats.url), "CDC_MIRROR_STATE_BUCKET": bucket,
           "CDC_MIRROR_STATUS_INTERVAL": "0.5s"}
    db = tmp_path / "edge.db"
    command = [CLI, "mirror", "--tables", table, "--sqlite", str(db), "--mirror-id", "edge"]
    async with _state_bucket(settings) as states, running_bridge(settings), \
            snapshot_responder(settings):
        await bridge_ready(pg_admin, cdc_database, settings, [table])
        once = await asyncio.to_thread(subprocess.run, [*command, "--once"], env=env,
                                       capture_output=True, text=True, timeout=120)
        assert once.returncode == 0, once.stdout[-2000:] + once.stderr[-2000:]
        value = await states.state("edge")
        assert value is not None and value["tables"][table]["status"] == "streaming"
        assert value["stopped_at"] >= value["started_at"]
        assert tuple(value) == (*MIRROR_STATE_FIELDS, "stopped_at")

        # running: no stopped_at; SIGTERM: a last state with it
        log_path = tmp_path / "mirror.log"
        with open(log_path, "wb") as output:
            following = subprocess.Popen(command, env=env, stdout=output,
                                         stderr=subprocess.STDOUT)
            try:
                async def running_again() -> bool:
                    state = await states.state("edge")
                    return state is not None and state["pid"] == following.pid

                await wait_for(running_again, timeout=30, what="the running mirror's state")
                assert "stopped_at" not in (await states.state("edge") or {})
                following.send_signal(signal.SIGTERM)
                assert await asyncio.to_thread(following.wait, 30) == 0, log_path.read_text()
            finally:
                if following.poll() is None:
                    following.kill()
        value = await states.state("edge")
        assert value is not None and value["pid"] == following.pid and value["stopped_at"]

        # ended by an error: no stopped_at
        failing = Mirror(settings, [random_name("unpublished")], tmp_path / "other.db",
                         options=MirrorSettings(mirror_id="failing"), report=lambda line: None)
        with pytest.raises(MirrorError, match="not published"):
            await failing.run(until_caught_up=True)
        assert "stopped_at" not in (await states.state("failing") or {})


async def _publish_resync_marker(settings, slot: str, lost_after: str) -> None:
    """The marker the bridge stores when it lost its slot (bridge/, "Resync marker")."""
    client = await connect_nats(settings.nats)
    try:
        msg_id = resync_msg_id(slot, parse_lsn(lost_after))
        await client.jetstream().publish(resync_subject(slot), msgpack.packb({
            "type": "resync", "slot": slot, "lost_after": lost_after, "reason": "test",
            "timestamp": int(time.time() * 1000), "msg_id": msg_id}),
            stream=settings.topology.cdc.name, headers={"Nats-Msg-Id": msg_id})
    finally:
        await client.close()


async def test_a_table_resyncing_after_a_lost_slot_says_so_until_verified_equal(
        cdc_database, pg_admin, provisioned_nats, tmp_path):
    """A table that followed the stream across a resync marker is `resyncing` in the
    mirror's state (its changes are made to fit, and it may lack some) until a verification
    after the marker finds it equal; then `streaming` again."""
    table = _small_table(cdc_database, pg_admin, "resyncing")
    bucket = random_name("mirrors")
    settings = _with_state_bucket(platform_settings(cdc_database, provisioned_nats.url),
                                  bucket, ttl=60.0)
    options = MirrorSettings(status_interval_seconds=0.5, state_interval_seconds=0.2,
                             mirror_id="edge")
    async with _state_bucket(settings) as states, running_bridge(settings), \
            snapshot_responder(settings):
        await bridge_ready(pg_admin, cdc_database, settings, [table])
        stop = asyncio.Event()
        mirror = Mirror(settings, [table], tmp_path / "edge.db", options=options,
                        report=lambda line: None)
        running = asyncio.create_task(mirror.run(stop))
        try:
            await wait_for(lambda: not mirror.bootstrapping, timeout=60, what="streaming")

            async def status(wanted: str) -> bool:
                value = await states.state("edge")
                return bool(value and value["tables"][table]["status"] == wanted)

            await wait_for(functools.partial(status, "streaming"), timeout=10,
                           what="streaming shown")
            await _publish_resync_marker(settings, cdc_database.slot, "0/1")
            await wait_for(functools.partial(status, "resyncing"), timeout=20,
                           what="resyncing shown")
            verified = await verify_table(None, settings, table)
            await wait_for(functools.partial(status, "streaming"), timeout=30,
                           what="streaming again once verified")
            value = await states.state("edge")
            assert value is not None
            assert value["tables"][table]["last_verification"]["verification_id"] == \
                verified.verification_id
            assert value["tables"][table]["last_verification"]["status"] == "equal"
        finally:
            stop.set()
            await asyncio.wait_for(running, 30)
