"""The mirror end to end: a real bridge, real snapshots, `cdc-platform mirror`'s library."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3

import msgpack
import pytest

from cdc_platform.consumer.snapshots import latest_meta
from cdc_platform.fleet import MirroredTable, read_fleet
from cdc_platform.jetstream.connection import connect_nats
from cdc_platform.mirror.errors import MirrorError
from cdc_platform.mirror.follower import Mirror
from cdc_platform.postgres.catalog import published_relation_ids
from cdc_platform.settings import MirrorSettings
from cdc_platform.snapshot import snapshot_table
from cdc_platform.snapshot.options import SnapshotOptions
from cdc_platform.snapshot.requests import SnapshotRequest, answer_requests
from cdc_platform_tests.exactness import (
    bridge_caught_up,
    mirror_caught_up,
    mirror_rows,
    source_rows,
)
from cdc_platform_tests.fixtures.bridge import bridge_ready, running_bridge, wait_for
from cdc_platform_tests.fixtures.hostile_payloads import hostile_payload
from cdc_platform_tests.fixtures.responder import snapshot_responder
from cdc_platform_tests.fixtures.services import platform_settings, random_name

FAST = MirrorSettings(status_interval_seconds=1.0, snapshot_wait_seconds=120.0)


def _published_table(pg_admin, cdc_database, prefix: str, rows: int) -> str:
    """A new table ``(id int PRIMARY KEY, v text)`` of ``rows`` rows, in the publication."""
    table = random_name(prefix)
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, {rows}) g")
    cdc_database.add_tables(pg_admin, table)
    return table


@pytest.mark.every_major
async def test_a_mirror_bootstraps_follows_and_equals_the_source(
        cdc_database, pg_admin, provisioned_nats, tmp_path):
    table = random_name("mirrored")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text, n numeric)")
    pg_admin.execute(f"INSERT INTO {table} SELECT g, 'row ' || g, g * 1.5 "
                     "FROM generate_series(1, 500) g")
    cdc_database.add_tables(pg_admin, table)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    db = tmp_path / "mirror.db"
    lines: list[str] = []
    async with running_bridge(settings), snapshot_responder(settings) as taken:
        await bridge_ready(pg_admin, cdc_database, settings, [table])
        mirror = Mirror(settings, [table], db, options=FAST, report=lines.append)
        await mirror.run(until_caught_up=True)
        assert len(taken) == 1
        pg_admin.execute(f"UPDATE {table} SET v = 'changed' WHERE id <= 10")
        pg_admin.execute(f"DELETE FROM {table} WHERE id > 490")
        pg_admin.execute(f"INSERT INTO {table} VALUES (1000, 'new', 'NaN')")
        pg_admin.execute(f"ALTER TABLE {table} ADD COLUMN flag int DEFAULT 7")
        pg_admin.execute(f"UPDATE {table} SET flag = 8 WHERE id = 1")
        await bridge_caught_up(pg_admin, cdc_database.slot, timeout=60)
        await Mirror(settings, [table], db, options=FAST, report=lines.append).run(
            until_caught_up=True)
    columns = ["id", "v", "n", "flag"]
    assert mirror_rows(db, table, columns) == source_rows(
        cdc_database.server.superuser_conninfo(), table, columns)
    assert any("bootstrap" in line and "500/500 rows" in line for line in lines), lines


async def test_a_table_that_is_not_published_is_a_clear_error(
        cdc_database, pg_admin, provisioned_nats, tmp_path):
    """Said at once, with the published tables listed: live keys of KV `schemas` only (a
    deleted one is not published), read by bounded requests (a bucket being written never
    holds the error back)."""
    settings = platform_settings(cdc_database, provisioned_nats.url)
    listed, deleted = random_name("listed"), random_name("deleted")
    client = await connect_nats(settings.nats, name="cdc-tests-not-published")
    try:
        kv = await client.jetstream().key_value(settings.topology.schemas.bucket)
        await kv.put(listed, b"{}")
        await kv.put(deleted, b"{}")
        await kv.delete(deleted)
        with pytest.raises(MirrorError, match="not published: nope_not_here") as raised:
            await asyncio.wait_for(
                Mirror(settings, ["nope_not_here"], tmp_path / "m.db").run(), 60)
        await kv.purge(listed)
        await kv.purge(deleted)
    finally:
        await client.close()
    published = str(raised.value).split("Published tables: ", 1)[1].split(", ")
    assert listed in published and deleted not in published, published


async def test_mirrors_asking_for_one_table_at_once_share_one_snapshot(
        cdc_database, pg_admin, provisioned_nats, tmp_path):
    table = _published_table(pg_admin, cdc_database, "shared", 300)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    async with running_bridge(settings), snapshot_responder(settings) as taken:
        await bridge_ready(pg_admin, cdc_database, settings, [table])
        mirrors = [Mirror(settings, [table], tmp_path / f"m{i}.db", options=FAST,
                          report=lambda line: None) for i in range(20)]
        await asyncio.gather(*(mirror.run(until_caught_up=True) for mirror in mirrors))
    assert len(taken) == 1  # one snapshot; 19 requests answered with it
    for index in range(20):
        assert mirror_rows(tmp_path / f"m{index}.db", table, ["id", "v"]) == source_rows(
            cdc_database.server.superuser_conninfo(), table, ["id", "v"])


async def test_a_request_that_joined_a_run_in_flight_finds_its_snapshot_in_init(
        cdc_database, pg_admin, provisioned_nats, tmp_path):
    """A request the sensor answers with ``accepted``/``coalesced`` (it joined a run already
    queued or running) gets no ``done``: the mirror finds the snapshot in INIT."""
    table = _published_table(pg_admin, cdc_database, "joined", 200)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    client = await connect_nats(settings.nats, name="cdc-tests-in-flight")
    asked = asyncio.Event()

    async def answer(message) -> None:
        body = json.loads(message.data)
        await client.publish(body["reply_to"], json.dumps({
            "request_id": body["request_id"], "table": table, "status": "accepted",
            "run_key": "earlier-run", "coalesced": True}).encode())
        asked.set()

    await client.subscribe(f"snapshot.request.{table}", cb=answer)
    lines: list[str] = []
    try:
        async with running_bridge(settings):
            await bridge_ready(pg_admin, cdc_database, settings, [table])
            mirror = Mirror(settings, [table], tmp_path / "m.db", options=FAST,
                            report=lines.append)
            following = asyncio.create_task(mirror.run(until_caught_up=True))
            await asyncio.wait_for(asked.wait(), 30)
            await snapshot_table(None, settings, table)  # what the earlier run publishes
            await asyncio.wait_for(following, 60)
    finally:
        await client.close()
    assert mirror_rows(tmp_path / "m.db", table, ["id", "v"]) == source_rows(
        cdc_database.server.superuser_conninfo(), table, ["id", "v"])
    assert any("snapshot request accepted" in line for line in lines), lines


async def test_malformed_messages_on_the_stream_are_refused_and_change_nothing(
        cdc_database, pg_admin, provisioned_nats, tmp_path, caplog):
    """Messages a forger could store on a server without the deploy/ permissions (or a
    broken producer): none reaches the database, each is refused with a log line naming it,
    and the mirror goes on following the genuine changes."""
    table = _published_table(pg_admin, cdc_database, "guarded", 50)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    db = tmp_path / "m.db"
    lines: list[str] = []
    subject = f"cdc.{table}.insert"
    genuine_shape = {"table": table, "operation": "INSERT", "commit_lsn": "0/1", "ordinal": 0}
    forged = [
        b"\xc1 not msgpack",
        b"{not json",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({**genuine_shape, "operation": "EXPLODE", "data": {"id": 1}}),
        msgpack.packb({**genuine_shape, "table": "someone_else", "data": {"id": 1}}),
        msgpack.packb({**genuine_shape, "data": "not a row"}),
        msgpack.packb({**genuine_shape, "commit_lsn": "yesterday", "data": {"id": 1}}),
        msgpack.packb({**genuine_shape, "ordinal": -1, "data": {"id": 1}}),
        msgpack.packb({"table": table}),
    ]
    async with running_bridge(settings), snapshot_responder(settings):
        await bridge_ready(pg_admin, cdc_database, settings, [table])
        await Mirror(settings, [table], db, options=FAST, report=lines.append).run(
            until_caught_up=True)
        client = await connect_nats(settings.nats, name="cdc-tests-forger")
        try:
            for payload in forged:
                await client.jetstream().publish(subject, payload, stream="CDC")
        finally:
            await client.close()
        pg_admin.execute(f"UPDATE {table} SET v = 'after' WHERE id <= 5")
        pg_admin.execute(f"INSERT INTO {table} VALUES (51, 'new')")
        await bridge_caught_up(pg_admin, cdc_database.slot, timeout=60)
        with caplog.at_level(logging.ERROR, logger="cdc_platform.mirror.follower"):
            await Mirror(settings, [table], db, options=FAST, report=lines.append).run(
                until_caught_up=True)
    assert mirror_rows(db, table, ["id", "v"]) == source_rows(
        cdc_database.server.superuser_conninfo(), table, ["id", "v"])
    refusals = [r.getMessage() for r in caplog.records if "refused message" in r.getMessage()]
    assert len(refusals) == len(forged), refusals
    assert all(subject in refusal for refusal in refusals)
    assert not any("bootstrapping again" in line for line in lines), lines


async def test_a_row_missing_from_the_mirror_makes_the_table_bootstrap_again(
        cdc_database, pg_admin, provisioned_nats, tmp_path):
    """Someone deleted a row from the mirror's file by hand: the next UPDATE of it (a batch of
    updates, checked when it is committed) does not fit; the mirror says so and bootstraps
    the table again instead of stopping or diverging."""
    import sqlite3

    table = _published_table(pg_admin, cdc_database, "tampered", 100)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    db = tmp_path / "m.db"
    lines: list[str] = []
    async with running_bridge(settings), snapshot_responder(settings,
                                                            max_age_seconds=0) as taken:
        await bridge_ready(pg_admin, cdc_database, settings, [table])
        await Mirror(settings, [table], db, options=FAST, report=lines.append).run(
            until_caught_up=True)
        with sqlite3.connect(db) as tampering:
            tampering.execute(f"DELETE FROM {table} WHERE id = 50")
        pg_admin.execute(f"UPDATE {table} SET v = 'changed' WHERE id BETWEEN 40 AND 60")
        await bridge_caught_up(pg_admin, cdc_database.slot, timeout=60)
        await Mirror(settings, [table], db, options=FAST, report=lines.append).run(
            until_caught_up=True)
    assert len(taken) == 2
    assert any("does not hold" in line and "bootstrapping again" in line for line in lines), \
        lines
    assert mirror_rows(db, table, ["id", "v"]) == source_rows(
        cdc_database.server.superuser_conninfo(), table, ["id", "v"])


async def test_events_gone_by_retention_make_the_mirror_bootstrap_again(
        cdc_database, pg_admin, tmp_path):
    """A mirror stopped while the stream dropped events it needed says so and bootstraps
    the table again (from a new snapshot) instead of silently diverging."""
    from cdc_platform.dev.servers import LocalNatsServer
    from cdc_platform.jetstream.connection import connect_nats
    from cdc_platform.jetstream.provision import provision
    from cdc_platform.settings import NatsSettings, NatsTopology

    nats = LocalNatsServer(tmp_path / "nats")
    nats.start()
    try:
        client = await connect_nats(NatsSettings(url=nats.url))
        await provision(client.jetstream(), NatsTopology())
        table = _published_table(pg_admin, cdc_database, "retained", 100)
        settings = platform_settings(cdc_database, nats.url)
        db = tmp_path / "mirror.db"
        lines: list[str] = []
        async with running_bridge(settings), snapshot_responder(settings,
                                                                max_age_seconds=0) as taken:
            await bridge_ready(pg_admin, cdc_database, settings, [table])
            await Mirror(settings, [table], db, options=FAST, report=lines.append).run(
                until_caught_up=True)
            pg_admin.execute(f"UPDATE {table} SET v = 'lost' WHERE id <= 50")
            await bridge_caught_up(pg_admin, cdc_database.slot, timeout=60)
            # retention: the stream drops everything up to its last message
            last = (await client.jetstream().stream_info("CDC")).state.last_seq
            await client.jetstream().purge_stream("CDC", seq=last + 1)
            pg_admin.execute(f"UPDATE {table} SET v = 'after' WHERE id > 90")
            await bridge_caught_up(pg_admin, cdc_database.slot, timeout=60)
            await Mirror(settings, [table], db, options=FAST, report=lines.append).run(
                until_caught_up=True)
        await client.close()
    finally:
        nats.stop()
    assert any("no longer holds the events it needs" in line for line in lines), lines
    assert len(taken) == 2
    assert mirror_rows(db, table, ["id", "v"]) == source_rows(
        cdc_database.server.superuser_conninfo(), table, ["id", "v"])


async def _following(mirror: Mirror, stop: asyncio.Event, lines: list[str], nats_client,
                     timeout: float = 90.0) -> asyncio.Task:
    """Start ``mirror`` (reporting to ``lines``) and wait until it bootstrapped every table
    and read the whole stream."""
    task = asyncio.create_task(mirror.run(stop))
    await wait_for(lambda: task.done() or all(
        any(line.startswith(f"bootstrap {table}:") and "; done" in line for line in lines)
        for table in mirror.tables), timeout=timeout)
    await mirror_caught_up(mirror, task, nats_client, timeout=timeout)
    return task


def _change(table: str, lsn: str, **fields) -> dict:
    return {"table": table, "operation": "INSERT", "commit_lsn": lsn, "ordinal": 0,
            "msg_id": f"{lsn}:0", "tx_tables": {table: 1}, **fields}


# What someone allowed to publish into ``cdc.>`` can store, on the victim table's subjects:
# (subject's op, table -> LSN -> (payload, headers), what the mirror does: a line matching)
HOSTILE = {
    "an INSERT naming a column the table lacks": (
        "insert", lambda table, lsn: (_change(table, lsn, data={"id": 1000, "nope": 1}), None),
        "stale", "has no column named nope"),
    "a malformed schema event": (
        "schema", lambda table, lsn: (_change(table, lsn, operation="SCHEMA",
                                              table_schema={"columns": "no"}), None),
        "stale", "not a valid schemas value"),
    "a claim check naming no object": (
        "insert", lambda table, lsn: (_change(table, lsn, data={"id": 1001, "v": "x"},
                                              claim_check={"bucket": "cdc_large",
                                                           "object": "../../etc/passwd"}),
                                      {"Cdc-Claim-Check": "cdc_large/../../etc/passwd"}),
        "refused", "names no stored object"),
    "a commit LSN past int64": (
        "insert", lambda table, lsn: (_change(table, "FFFFFFFF/FFFFFFFF",
                                              data={"id": 1002, "v": "x"}), None),
        "refused", "beyond any PostgreSQL LSN"),
}


@pytest.mark.parametrize("case", HOSTILE)
async def test_a_hostile_message_never_stops_the_mirror(
        case, cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path, caplog):
    """A message published into a running mirror's input that cannot be applied makes its
    table stale, bootstrapped again while the other table follows, or is refused with one
    line; the mirror keeps running, and a restart reads it again without stopping."""
    op, build, outcome, said = HOSTILE[case]
    victim = _published_table(pg_admin, cdc_database, "victim", 30)
    bystander = _published_table(pg_admin, cdc_database, "bystander", 30)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    conninfo = cdc_database.server.superuser_conninfo()
    db = tmp_path / "m.db"
    lines: list[str] = []

    async def changed_and_followed(round_: int) -> None:
        for table in (victim, bystander):
            pg_admin.execute(f"UPDATE {table} SET v = 'round {round_}' WHERE id = {round_}")
        await bridge_caught_up(pg_admin, cdc_database.slot, timeout=60)
        await mirror_caught_up(mirror, task, nats_client, timeout=60)
        for table in (victim, bystander):
            assert mirror_rows(db, table, ["id", "v"]) == source_rows(
                conninfo, table, ["id", "v"]), (round_, table, lines)

    async with running_bridge(settings), snapshot_responder(settings, max_age_seconds=0):
        await bridge_ready(pg_admin, cdc_database, settings, [victim, bystander])
        stop = asyncio.Event()
        mirror = Mirror(settings, [victim, bystander], db, options=FAST, report=lines.append)
        with caplog.at_level(logging.ERROR, logger="cdc_platform.mirror.follower"):
            task = await _following(mirror, stop, lines, nats_client)
            # (a commit LSN past the victim's cutover: the mirror applies it)
            lsn = pg_admin.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0]
            payload, headers = build(victim, lsn)
            attacker = await connect_nats(settings.nats, name="cdc-tests-attacker")
            try:
                await attacker.jetstream().publish(f"cdc.{victim}.{op}", msgpack.packb(payload),
                                                   stream="CDC", headers=headers)
            finally:
                await attacker.close()
            await changed_and_followed(1)
            await changed_and_followed(2)
            stop.set()
            await asyncio.wait_for(task, 30)
            # a restart reads what is after the last commit again: no crash, no loop
            await asyncio.wait_for(Mirror(settings, [victim, bystander], db, options=FAST,
                                          report=lines.append).run(until_caught_up=True), 60)
    refusals = [r.getMessage() for r in caplog.records if "refused message" in r.getMessage()]
    stale = [line for line in lines if "bootstrapping again" in line]
    if outcome == "stale":
        assert len(stale) == 1 and stale[0].startswith(f"{victim}: ") and said in stale[0], \
            (stale, refusals)
    else:
        assert not stale, stale
        assert refusals and all(said in refusal for refusal in refusals), refusals
    for table in (victim, bystander):
        assert mirror_rows(db, table, ["id", "v"]) == source_rows(conninfo, table, ["id", "v"])


async def test_a_keyless_table_changes_the_row_with_the_sign_of_zero_it_names(
        cdc_database, pg_admin, provisioned_nats, tmp_path):
    """REPLICA IDENTITY FULL, no key, rows equal but for 0.0 and -0.0 (and NaN): each UPDATE
    and DELETE changes the row whose values it names, not one SQLite holds equal to it."""
    table = random_name("zeros")
    pg_admin.execute(f"CREATE TABLE {table} (f float8, v text, n int)")
    pg_admin.execute(f"ALTER TABLE {table} REPLICA IDENTITY FULL")
    pg_admin.execute(f"INSERT INTO {table} SELECT f, 'a', g % 3 FROM generate_series(1, 60) g, "
                     "unnest(ARRAY['0', '-0', 'NaN', '0', '-0']::float8[]) f")
    cdc_database.add_tables(pg_admin, table)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    db = tmp_path / "m.db"
    async with running_bridge(settings), snapshot_responder(settings):
        await bridge_ready(pg_admin, cdc_database, settings, [table])
        await Mirror(settings, [table], db, options=FAST, report=lambda line: None).run(
            until_caught_up=True)
        pg_admin.execute(f"UPDATE {table} SET v = 'minus' WHERE f::text = '-0' AND n = 1")
        pg_admin.execute(f"DELETE FROM {table} WHERE ctid IN (SELECT ctid FROM {table} "
                         "WHERE f::text = '0' AND n = 2)")
        pg_admin.execute(f"UPDATE {table} SET v = 'nan' WHERE f = 'NaN' AND n = 0")
        pg_admin.execute(f"INSERT INTO {table} VALUES ('-0', 'a', 2), (0, 'a', 1)")
        pg_admin.execute(f"DELETE FROM {table} WHERE ctid IN (SELECT ctid FROM {table} "
                         "WHERE f::text = '-0' AND n = 0)")
        await bridge_caught_up(pg_admin, cdc_database.slot, timeout=60)
        await Mirror(settings, [table], db, options=FAST, report=lambda line: None).run(
            until_caught_up=True)
    columns = ["f", "v", "n"]
    assert mirror_rows(db, table, columns) == source_rows(
        cdc_database.server.superuser_conninfo(), table, columns)


async def test_a_first_bootstrap_waits_for_a_bridge_that_is_behind(
        cdc_database, pg_admin, provisioned_nats, tmp_path):
    """The snapshot is taken while the bridge is stopped: its watermark marker reaches `CDC`
    only when the bridge runs again. The mirror waits (saying so) instead of exiting."""
    table = _published_table(pg_admin, cdc_database, "behind", 40)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    async with running_bridge(settings):  # the table's schema into KV, then stopped
        await bridge_ready(pg_admin, cdc_database, settings, [table])
    lines: list[str] = []
    db = tmp_path / "m.db"
    async with snapshot_responder(settings, options=SnapshotOptions(
            watermark_wait_seconds=0.2)) as taken:
        mirror = Mirror(settings, [table], db, options=FAST, report=lines.append)
        task = asyncio.create_task(mirror.run(until_caught_up=True))
        await wait_for(lambda: task.done() or any("waiting for the bridge" in line
                                                  for line in lines), timeout=60)
        await asyncio.sleep(3)  # (still waiting, not gone)
        assert not task.done(), lines
        pg_admin.execute(f"UPDATE {table} SET v = 'meanwhile' WHERE id <= 3")
        async with running_bridge(settings):
            await asyncio.wait_for(task, 60)
    assert len(taken) == 1
    assert mirror_rows(db, table, ["id", "v"]) == source_rows(
        cdc_database.server.superuser_conninfo(), table, ["id", "v"])


async def test_a_table_created_again_under_its_name_is_not_bootstrapped_from_the_old_one(
        cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path):
    """A snapshot is reused only for the same table: after DROP TABLE and CREATE TABLE of the
    same name and shape, a recent snapshot of the dropped one is not the new one's."""
    table = _published_table(pg_admin, cdc_database, "again", 10)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    kv = await nats_client.jetstream().key_value(settings.topology.schemas.bucket)

    async def kv_relation_id() -> int:
        return msgpack.unpackb((await kv.get(table)).value)["relation_id"]

    async with running_bridge(settings), snapshot_responder(settings) as taken:
        await bridge_ready(pg_admin, cdc_database, settings, [table])
        await Mirror(settings, [table], tmp_path / "old.db", options=FAST,
                     report=lambda line: None).run(until_caught_up=True)
        old_id = await kv_relation_id()
        pg_admin.execute(f"DROP TABLE {table}")
        pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        pg_admin.execute(f"INSERT INTO {table} SELECT g, 'new ' || g "
                         "FROM generate_series(1, 5) g")
        cdc_database.add_tables(pg_admin, table)
        for _ in range(30):  # (the bridge looks at the publication every 5 s)
            if await kv_relation_id() != old_id:
                break
            await asyncio.sleep(0.5)
        assert await kv_relation_id() != old_id  # the bridge put the new table's schema
        # the request sensor's decision: a new run, not the dropped table's snapshot
        handled = await answer_requests(
            nats_client, [SnapshotRequest(table, 1)], publication=cdc_database.publication,
            published=published_relation_ids(pg_admin, cdc_database.publication),
            reuse_seconds=600, in_flight={})
        assert table in handled.runs, handled.notes
        lines: list[str] = []
        await Mirror(settings, [table], tmp_path / "new.db", options=FAST,
                     report=lines.append).run(until_caught_up=True)
    assert mirror_rows(tmp_path / "new.db", table, ["id", "v"]) == source_rows(
        cdc_database.server.superuser_conninfo(), table, ["id", "v"]), lines
    assert len(taken) == 2


async def test_random_payloads_published_into_a_running_mirror_never_stop_it(
        cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path):
    """The property test's payloads (random bytes, maps shaped like events with wrong fields)
    through the real path: pulled from `CDC`, on every subject of the table. The mirror keeps
    running and both tables end equal to their sources."""
    import random

    victim = _published_table(pg_admin, cdc_database, "fuzzed", 20)
    bystander = _published_table(pg_admin, cdc_database, "spared", 20)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    conninfo = cdc_database.server.superuser_conninfo()
    db = tmp_path / "m.db"
    lines: list[str] = []
    rng = random.Random(23)
    async with running_bridge(settings), snapshot_responder(settings, max_age_seconds=0):
        await bridge_ready(pg_admin, cdc_database, settings, [victim, bystander])
        stop = asyncio.Event()
        mirror = Mirror(settings, [victim, bystander], db, options=FAST, report=lines.append)
        task = await _following(mirror, stop, lines, nats_client)
        attacker = await connect_nats(settings.nats, name="cdc-tests-fuzzer")
        try:
            for _ in range(200):
                lsn = pg_admin.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0]
                op = rng.choice(["insert", "update", "delete", "truncate", "schema",
                                 "insert.batch"])
                await attacker.jetstream().publish(f"cdc.{victim}.{op}",
                                                   hostile_payload(rng, victim, lsn), stream="CDC")
        finally:
            await attacker.close()
        for table in (victim, bystander):
            pg_admin.execute(f"UPDATE {table} SET v = 'after' WHERE id <= 3")
        await bridge_caught_up(pg_admin, cdc_database.slot, timeout=60)
        await mirror_caught_up(mirror, task, nats_client, timeout=120)
        stop.set()
        await asyncio.wait_for(task, 30)
        await asyncio.wait_for(Mirror(settings, [victim, bystander], db, options=FAST,
                                      report=lines.append).run(until_caught_up=True), 60)
    assert not [line for line in lines if line.startswith(f"{bystander}: ")
                and "bootstrapping again" in line], lines
    for table in (victim, bystander):
        assert mirror_rows(db, table, ["id", "v"]) == source_rows(conninfo, table, ["id", "v"])


@pytest.mark.parametrize("damage", ["chunk deleted", "chunk replaced by garbage"])
async def test_a_snapshot_whose_chunks_cannot_be_used_gives_way_to_a_newer_one(
        damage, cdc_database, pg_admin, provisioned_nats, tmp_path):
    """A snapshot in `INIT` within the reuse window but with a chunk gone (deleted, aged
    out) or unreadable: the mirror says it is unusable and bootstraps the table from a newer
    one it asks for, instead of stopping (and failing again on the same one at each start)."""
    table = _published_table(pg_admin, cdc_database, "unusable", 300)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    init = settings.topology.init.name
    lines: list[str] = []
    client = await connect_nats(settings.nats, name="cdc-tests-damage")
    js = client.jetstream()
    try:
        async with running_bridge(settings), snapshot_responder(settings) as taken:
            await bridge_ready(pg_admin, cdc_database, settings, [table])
            await Mirror(settings, [table], tmp_path / "first.db", options=FAST,
                         report=lines.append).run(until_caught_up=True)
            assert len(taken) == 1
            damaged = taken[0].snapshot_id
            meta = await latest_meta(js, table, init)
            assert meta is not None and meta.snapshot_id == damaged
            chunks = await js.pull_subscribe(f"{meta.chunk_subject_prefix}>", stream=init)
            chunk = (await chunks.fetch(1, timeout=5.0))[0]
            await chunks.unsubscribe()
            await js.delete_msg(init, chunk.metadata.sequence.stream)
            if damage == "chunk replaced by garbage":
                # (a new message id: the stream would take it for the deleted one's retry)
                headers = {key: value for key, value in (chunk.headers or {}).items()
                           if key != "Nats-Msg-Id"}
                await js.publish(chunk.subject, b"not a zstd frame", stream=init,
                                 headers={**headers, "Content-Encoding": "zstd"})
            pg_admin.execute(f"UPDATE {table} SET v = 'after' WHERE id <= 20")
            db = tmp_path / "m.db"
            await Mirror(settings, [table], db, options=FAST, report=lines.append).run(
                until_caught_up=True)
    finally:
        await client.close()
    assert any(line.startswith(f"{table}: snapshot {damaged} is unusable (")
               and line.endswith("asking for a newer one") for line in lines), lines
    assert len(taken) == 2 and taken[1].snapshot_id != damaged
    assert mirror_rows(db, table, ["id", "v"]) == source_rows(
        cdc_database.server.superuser_conninfo(), table, ["id", "v"])


async def test_a_column_sqlite_cannot_name_stops_its_table_only(
        cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path):
    """SQLite's names ignore case: columns ``z`` and ``"Z"`` cannot both be mirrored. From
    the first snapshot, or added mid-stream, the table says so in one line and waits for its
    schema to change (a run until caught up ends on it, one line); the other table goes on;
    once one column is renamed or dropped (and
    the table's next change brings its new schema to KV) the table bootstraps again and
    equals its source."""
    clashing = random_name("clashing")
    pg_admin.execute(f'CREATE TABLE {clashing} (id int PRIMARY KEY, z text, "Z" text)')
    pg_admin.execute(f"INSERT INTO {clashing} SELECT g, 'z' || g, 'Z' || g "
                     "FROM generate_series(1, 5) g")
    cdc_database.add_tables(pg_admin, clashing)
    bystander = _published_table(pg_admin, cdc_database, "bystander", 5)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    conninfo = cdc_database.server.superuser_conninfo()
    db = tmp_path / "m.db"
    lines: list[str] = []

    def equal(table: str, columns: list[str]) -> bool:
        try:
            return task.done() or mirror_rows(db, table, columns) == source_rows(
                conninfo, table, columns)
        except sqlite3.OperationalError:  # (not bootstrapped yet)
            return False

    def bystander_equal() -> bool:
        return equal(bystander, ["id", "v"])

    def said(text: str, after: int = 0) -> bool:
        return task.done() or any(text in line for line in lines[after:])

    async with running_bridge(settings), snapshot_responder(settings, max_age_seconds=0):
        await bridge_ready(pg_admin, cdc_database, settings, [clashing, bystander])
        with pytest.raises(MirrorError, match="columns 'z' and 'Z' differ only in case"):
            await asyncio.wait_for(Mirror(settings, [clashing, bystander], db, options=FAST,
                                          report=lines.append).run(until_caught_up=True), 60)
        stop = asyncio.Event()
        mirror = Mirror(settings, [clashing, bystander], db, options=FAST, report=lines.append)
        task = asyncio.create_task(mirror.run(stop))
        await wait_for(lambda: said("waiting for its schema to change"), timeout=60,
                       what="the clash said")
        await wait_for(bystander_equal, timeout=60, what="the bystander bootstrapped")
        pg_admin.execute(f"UPDATE {bystander} SET v = 'after' WHERE id <= 3")
        await wait_for(bystander_equal, timeout=60, what="the bystander's update")
        assert not task.done(), task.exception()
        assert "differ only in case" in next(line for line in lines if "waiting for" in line)
        shown = await _fleet_table(nats_client, settings, clashing, "waiting")
        assert "differ only in case" in (shown.reason or ""), shown

        pg_admin.execute(f'ALTER TABLE {clashing} RENAME COLUMN "Z" TO z_big')
        # (PostgreSQL sends a table's new shape with its next change: KV has it from then)
        pg_admin.execute(f"UPDATE {clashing} SET z = 'renamed' WHERE id = 1")
        columns = ["id", "z", "z_big"]
        await wait_for(lambda: equal(clashing, columns), timeout=90,
                       what="the renamed table mirrored")

        said_before = len(lines)
        pg_admin.execute(f'ALTER TABLE {clashing} ADD COLUMN "Z_BIG" text DEFAULT \'big\'')
        pg_admin.execute(f"INSERT INTO {clashing} VALUES (6, 'z6', 'Z6', 'BIG')")
        await wait_for(lambda: said("differ only in case", said_before), timeout=60,
                       what="the clash mid-stream said")
        pg_admin.execute(f"UPDATE {bystander} SET v = 'later' WHERE id <= 3")
        await wait_for(bystander_equal, timeout=60, what="the bystander's later update")
        assert not task.done(), task.exception()
        pg_admin.execute(f'ALTER TABLE {clashing} DROP COLUMN "Z_BIG"')
        pg_admin.execute(f"UPDATE {clashing} SET z = 'dropped' WHERE id = 2")
        await wait_for(lambda: equal(clashing, columns), timeout=90,
                       what="the table mirrored again")
        shown = await _fleet_table(nats_client, settings, clashing, "streaming")
        assert shown.reason is None, shown
        stop.set()
        await asyncio.wait_for(task, 30)


async def _fleet_table(nats_client, settings, table: str, *statuses: str) -> MirroredTable:
    """``table`` as the fleet (KV `mirrors`) shows it, once it shows it in one of
    ``statuses``."""
    shown: list[MirroredTable] = []

    async def showing() -> bool:
        fleet = await read_fleet(nats_client.jetstream(), settings.topology.mirrors.bucket)
        shown[:] = [state.tables[table] for state in fleet.states.values()
                    if table in state.tables]
        return bool(shown) and shown[0].status in statuses
    deadline = asyncio.get_running_loop().time() + 30
    while not await showing():
        assert asyncio.get_running_loop().time() < deadline, f"{table} never {statuses}: {shown}"
        await asyncio.sleep(0.2)
    return shown[0]
