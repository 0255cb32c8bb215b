"""A mirror's state in KV `mirrors` (docs/verification.md Part 2, item 5) on a server of one
account, as in the dev stack: published at start, on report_now() and every interval, gone
after the bucket's TTL once the mirror stops; a publish that fails is said once and stops
nothing. (Through READERS' import with a team's user: test_nats_permissions.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sqlite3

from nats.js.errors import NotFoundError

from cdc_platform.jetstream.connection import connect_nats
from cdc_platform.jetstream.provision import (
    mirror_state_bucket_config,
    reader_written_bucket_stream,
)
from cdc_platform.lsn import parse_lsn
from cdc_platform.mirror.follower import Mirror
from cdc_platform.settings import MirrorSettings, MirrorStateBucketSettings, NatsTopology
from cdc_platform.wire import MIRROR_STATE_FIELDS
from cdc_platform_tests.fixtures.bridge import bridge_ready, running_bridge, wait_for
from cdc_platform_tests.fixtures.responder import snapshot_responder
from cdc_platform_tests.fixtures.services import platform_settings, random_name


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
