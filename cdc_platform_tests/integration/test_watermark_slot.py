"""A watermark is written only where the bridge's slot will carry it into `CDC`
(``snapshot/export.py`` ``emit_carried_watermark``): a snapshot or verification started while
the bridge has no slot waits for it, one raced with a slot replacement is taken again under a
new id (or fails clearly, publishing nothing), and a mirror waiting for a marker that can no
longer come asks for a newer snapshot instead of waiting out CDC_MIRROR_SNAPSHOT_WAIT. Real
PostgreSQL, bridge and nats-server."""

from __future__ import annotations

import asyncio
import time

import psycopg
import pytest
from nats.js.errors import NotFoundError

from cdc_platform.errors import WatermarkNotCarried
from cdc_platform.lsn import parse_lsn
from cdc_platform.mirror.follower import Mirror
from cdc_platform.replication.slots import read_slot
from cdc_platform.settings import MirrorSettings
from cdc_platform.snapshot import SnapshotOptions, snapshot_table
from cdc_platform.verify import verify_table
from cdc_platform.wire import verify_digest_subject, watermark_subject
from cdc_platform_tests.exactness import bridge_caught_up, mirror_rows, source_rows
from cdc_platform_tests.fixtures.bridge import bridge_ready, running_bridge, wait_for
from cdc_platform_tests.fixtures.responder import snapshot_responder
from cdc_platform_tests.fixtures.services import platform_settings, random_name
from cdc_platform_tests.fixtures.snapshots import apply_event, snapshot_data
from cdc_platform_tests.fixtures.verification import stored_seq, table_events

# where a slot starts decoding, and what a new one's consistent point is: per major
pytestmark = pytest.mark.every_major

ROWS = 200
IN_PROCESS = SnapshotOptions(watermark_wait_seconds=0.2)  # small tables: no Spark


def _table(pg_admin, cdc_database) -> str:
    table = random_name("marked")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, {ROWS}) g")
    cdc_database.add_tables(pg_admin, table)
    return table


def _dropping_slot(pg_admin, slot: str, times: int):
    """A ``before_watermark`` hook that, the first ``times`` times it runs, drops the bridge's
    slot (ending its walsender first): as a bridge replacing a lost slot, whose new slot is
    created once it reconnects, after the watermark (the bridge shares this event loop, and
    the watermark follows the hook without yielding). Returns the hook and its call count."""
    calls = []

    def drop() -> None:
        calls.append(time.monotonic())
        if len(calls) > times:
            return
        deadline = time.monotonic() + 10
        while True:
            pg_admin.execute("SELECT pg_terminate_backend(active_pid, 5000) "
                             "FROM pg_replication_slots "
                             "WHERE slot_name = %s AND active_pid IS NOT NULL", (slot,))
            try:
                pg_admin.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                return
            except psycopg.errors.ObjectInUse:  # (its walsender not gone yet)
                assert time.monotonic() < deadline, "the slot stayed active"
                time.sleep(0.01)
    return drop, calls


async def _rebuilt(nats_client, table: str, result, start_seq: int) -> dict:
    """The snapshot's rows plus the table's events from ``start_seq`` (its marker's) on with
    ``commit_lsn >= lsn`` (the cutover rule), by key."""
    rows = {row["id"]: row for row in await snapshot_data(nats_client, result)}
    for seq, event in await table_events(nats_client, table):
        if seq >= start_seq and parse_lsn(event["commit_lsn"]) >= parse_lsn(result.lsn):
            apply_event(rows, event)
    return rows


def _source(pg_admin, table: str) -> dict:
    return {id_: {"id": id_, "v": v}
            for id_, v in pg_admin.execute(f"SELECT id, v FROM {table}").fetchall()}


def _writes_after(pg_admin, table: str) -> None:
    pg_admin.execute(f"UPDATE {table} SET v = 'after' WHERE id > {ROWS - 10}")
    pg_admin.execute(f"DELETE FROM {table} WHERE id = 5")
    pg_admin.execute(f"INSERT INTO {table} VALUES (1000, 'new')")


async def test_a_snapshot_requested_while_no_slot_exists_waits_for_the_bridge_and_cuts_over(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    # before: the watermark was written at once, in no slot's stream; the bridge's new slot
    # started past it and the marker never came (mirrors waited an hour for it)
    table = _table(pg_admin, cdc_database)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    snapshotting = asyncio.create_task(snapshot_table(None, settings, table,
                                                      options=IN_PROCESS))
    await wait_for(lambda: snapshotting.done() or pg_admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = "
        "'cdc_platform_snapshot' AND query LIKE '%pg_replication_slots%'").fetchone()[0],
        what="the snapshot looking for the slot")
    pg_admin.execute(f"UPDATE {table} SET v = 'before' WHERE id <= 10")  # in the snapshot
    async with running_bridge(settings):
        result = await asyncio.wait_for(snapshotting, 60)
        _writes_after(pg_admin, table)
        await bridge_caught_up(pg_admin, cdc_database.slot, timeout=60)
    assert result.cdc_start_seq is not None, "the marker is in CDC"
    marker = await nats_client.jetstream().get_last_msg("CDC", result.watermark_subject)
    assert marker.seq == result.cdc_start_seq
    assert await _rebuilt(nats_client, table, result, marker.seq) == _source(pg_admin, table)


async def test_a_snapshot_taken_while_the_bridge_is_stopped_cuts_over_once_it_runs_again(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    # its slot exists: no wait, published with cdc_start_seq null, the marker comes later
    table = _table(pg_admin, cdc_database)
    cdc_database.create_slot(pg_admin)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    started = time.monotonic()
    result = await snapshot_table(None, settings, table, options=IN_PROCESS)
    assert time.monotonic() - started < settings.postgres.slot_wait_seconds
    assert result.cdc_start_seq is None and result.snapshot_id.count("-r") == 0
    _writes_after(pg_admin, table)
    async with running_bridge(settings):
        await bridge_caught_up(pg_admin, cdc_database.slot, timeout=60)
    marker = await nats_client.jetstream().get_last_msg("CDC", result.watermark_subject)
    assert await _rebuilt(nats_client, table, result, marker.seq) == _source(pg_admin, table)


async def test_a_snapshot_whose_slot_is_replaced_as_it_marks_is_marked_again(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    table = _table(pg_admin, cdc_database)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    drop, calls = _dropping_slot(pg_admin, cdc_database.slot, times=1)
    async with running_bridge(settings):
        await bridge_ready(pg_admin, cdc_database, settings, [table])
        result = await snapshot_table(
            None, settings, table, snapshot_id=f"snap-{table}",
            options=SnapshotOptions(before_watermark=drop))
        _writes_after(pg_admin, table)
        await bridge_caught_up(pg_admin, cdc_database.slot, timeout=60)
    assert len(calls) == 2
    assert result.snapshot_id == f"snap-{table}-r1"  # the first watermark was in no stream
    assert await stored_seq(nats_client, watermark_subject(f"snap-{table}")) is None
    assert result.cdc_start_seq == await stored_seq(nats_client, result.watermark_subject)
    assert await _rebuilt(nats_client, table, result, result.cdc_start_seq) == _source(
        pg_admin, table)


async def test_a_snapshot_whose_slot_is_replaced_after_its_watermark_is_taken_again(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    # the bridge is stopped; its slot is replaced after the watermark was checked, before the
    # bridge stored the marker (as a slot lost and replaced meanwhile): the check before the
    # meta finds it. Before: published, with a marker the new slot never carries
    table = _table(pg_admin, cdc_database)
    cdc_database.create_slot(pg_admin)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    calls = []

    def replace() -> None:
        pg_admin.execute("SELECT pg_drop_replication_slot(%s)", (cdc_database.slot,))
        cdc_database.create_slot(pg_admin)

    def replace_after_the_watermark() -> None:  # at the snapshot's next wait, after the check
        calls.append(time.monotonic())
        if len(calls) == 1:
            asyncio.get_running_loop().call_soon(replace)
    result = await snapshot_table(
        None, settings, table, snapshot_id=f"snap-{table}",
        options=SnapshotOptions(watermark_wait_seconds=0.2,
                                before_watermark=replace_after_the_watermark))
    assert len(calls) == 2 and result.snapshot_id == f"snap-{table}-r1"
    _writes_after(pg_admin, table)
    async with running_bridge(settings):
        await bridge_caught_up(pg_admin, cdc_database.slot, timeout=60)
    assert await stored_seq(nats_client, watermark_subject(f"snap-{table}")) is None
    marker_seq = await stored_seq(nats_client, result.watermark_subject)
    assert marker_seq is not None
    assert await _rebuilt(nats_client, table, result, marker_seq) == _source(pg_admin, table)


async def test_a_snapshot_whose_slot_is_replaced_at_every_mark_fails_clearly_publishing_nothing(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    table = _table(pg_admin, cdc_database)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    drop, calls = _dropping_slot(pg_admin, cdc_database.slot, times=100)
    async with running_bridge(settings):
        await bridge_ready(pg_admin, cdc_database, settings, [table])
        with pytest.raises(WatermarkNotCarried, match=(
                rf"snapshot of {table}: the watermark snap-{table}-r2 at \S+ is in no slot's "
                r"stream: .* 3 times in a row: is something dropping or replacing the slot\? "
                "Given up, publishing no meta or digest")) as raised:
            await snapshot_table(None, settings, table, snapshot_id=f"snap-{table}",
                                 options=SnapshotOptions(before_watermark=drop))
    assert "\n" not in str(raised.value) and len(calls) == 3
    for subject in (f"init.meta.{table}", f"init.snap.{table}.>"):
        with pytest.raises(NotFoundError):
            await nats_client.jetstream().get_last_msg("INIT", subject)
    for mark_id in (f"snap-{table}", f"snap-{table}-r1", f"snap-{table}-r2"):
        assert await stored_seq(nats_client, watermark_subject(mark_id)) is None


async def test_a_verification_whose_slot_is_replaced_as_it_marks_is_made_again(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    # before: only the wait for the slot; the marker written as it was replaced was in no
    # stream, and the digest published after it was "not comparable" for every mirror
    table = _table(pg_admin, cdc_database)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    drop, calls = _dropping_slot(pg_admin, cdc_database.slot, times=1)
    verification_id = f"verify-{table}"
    async with running_bridge(settings):
        await bridge_ready(pg_admin, cdc_database, settings, [table])
        result = await verify_table(None, settings, table, verification_id=verification_id,
                                    options=SnapshotOptions(before_watermark=drop))
    assert len(calls) == 2 and result.verification_id == f"{verification_id}-r1"
    assert await stored_seq(nats_client, watermark_subject(verification_id)) is None
    marker_seq = await stored_seq(nats_client, result.marker_subject)
    assert marker_seq is not None and marker_seq < result.digest_seq


async def test_a_verification_whose_slot_is_replaced_after_its_marker_is_made_again(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    # the slot replaced after the marker was checked (the bridge stopped, starting on the
    # new slot): the new slot confirms the digest's lsn, but never carried the marker. Before:
    # the digest was published, not comparable for every mirror
    table = _table(pg_admin, cdc_database)
    cdc_database.create_slot(pg_admin)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    calls, replaced = [], asyncio.Event()

    def replace() -> None:
        pg_admin.execute("SELECT pg_drop_replication_slot(%s)", (cdc_database.slot,))
        cdc_database.create_slot(pg_admin)
        replaced.set()

    def replace_after_the_marker() -> None:  # at the verification's next wait, after the check
        calls.append(time.monotonic())
        if len(calls) == 1:
            asyncio.get_running_loop().call_soon(replace)
    verification_id = f"verify-{table}"
    verifying = asyncio.create_task(verify_table(
        None, settings, table, verification_id=verification_id,
        options=SnapshotOptions(before_watermark=replace_after_the_marker)))
    await asyncio.wait_for(replaced.wait(), 30)
    async with running_bridge(settings):
        result = await asyncio.wait_for(verifying, 60)
    assert len(calls) == 2 and result.verification_id == f"{verification_id}-r1"
    assert await stored_seq(nats_client, watermark_subject(verification_id)) is None
    assert await stored_seq(nats_client, verify_digest_subject(table, verification_id)) is None
    marker_seq = await stored_seq(nats_client, result.marker_subject)
    assert marker_seq is not None and marker_seq < result.digest_seq


async def test_a_mirror_waiting_for_a_marker_no_slot_will_carry_asks_for_a_newer_snapshot(
        cdc_database, pg_admin, provisioned_nats, tmp_path):
    # a snapshot taken while the bridge is stopped; its slot is lost before the bridge comes
    # back and replaced by one starting past the watermark. Before: the mirror waited out
    # CDC_MIRROR_SNAPSHOT_WAIT (an hour by default) for that marker, then stopped
    table = _table(pg_admin, cdc_database)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    async with running_bridge(settings):
        await bridge_ready(pg_admin, cdc_database, settings, [table])  # (schemas in KV)
    lines: list[str] = []
    options = MirrorSettings(status_interval_seconds=0.5, snapshot_wait_seconds=120.0)
    db = tmp_path / "mirror.db"
    async with snapshot_responder(settings, options=IN_PROCESS) as taken:
        mirror = Mirror(settings, [table], db, options=options, report=lines.append)
        following = asyncio.create_task(mirror.run(until_caught_up=True))
        await wait_for(lambda: following.done() or any(
            "waiting for the bridge to publish the watermark marker" in line for line in lines),
            what="the mirror waiting for the marker")
        first = taken[0]
        pg_admin.execute("SELECT pg_drop_replication_slot(%s)", (cdc_database.slot,))
        async with running_bridge(settings):
            await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None,
                           what="the bridge's new slot")
            pg_admin.execute(f"UPDATE {table} SET v = 'past the cutover' WHERE id = 1")
            await asyncio.wait_for(following, 60)
    assert len(taken) == 2 and taken[1].cdc_start_seq is not None
    assert any(f"snapshot {first.snapshot_id} is unusable" in line and "never will be" in line
               for line in lines), lines
    columns = ["id", "v"]
    assert mirror_rows(db, table, columns) == source_rows(
        cdc_database.server.superuser_conninfo(), table, columns)
