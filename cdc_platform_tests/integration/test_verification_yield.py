"""A verification gives way to CDC (cdc_platform/verify/yielding.py): its tasks pause while the
bridge's slot is more than CDC_VERIFY_YIELD_LAG behind, for at most CDC_VERIFY_MAX_YIELD, and
not at all when no bridge streams the slot or it keeps up. Real PostgreSQL and nats-server; a
bridge held behind is the real replication protocol confirming nothing (``held_slot``)."""

from __future__ import annotations

import asyncio
import logging

import psycopg
import pytest

from cdc_platform.lsn import parse_lsn
from cdc_platform.replication.connection import SESSION_OPTIONS
from cdc_platform.settings import VerifySettings
from cdc_platform.snapshot import SnapshotOptions
from cdc_platform.snapshot.plan import BlockRange
from cdc_platform.snapshot.source import describe_table
from cdc_platform.verify import verify_table
from cdc_platform.verify.tasks import DigestSpec, digest_range
from cdc_platform.verify.yielding import YieldPolicy
from cdc_platform.wire.digest import MAX_BUCKET_BITS
from cdc_platform_tests.fixtures.bridge import (
    held_slot,
    running_bridge,
    slot_confirmed,
    wait_for,
)
from cdc_platform_tests.fixtures.services import platform_settings, random_name
from cdc_platform_tests.fixtures.snapshots import LIVE_TABLE_COLUMNS
from cdc_platform_tests.fixtures.verification import (
    buckets_of,
    digest_message,
    table_digest_now,
)

# the slot's position and activity as PostgreSQL reports them: on the newest major too
pytestmark = pytest.mark.every_major

ROWS = 3_000
YIELD_LAG = 64 * 1024  # the test's threshold; its ballast writes ~10x that
HOLD_SECONDS = 1.5  # how long the bridge stays behind


def _table(pg_admin, cdc_database) -> str:
    table = random_name("yielding")
    pg_admin.execute(f"CREATE TABLE {table} ({LIVE_TABLE_COLUMNS})")
    pg_admin.execute(f"INSERT INTO {table} SELECT i, i % 100, 'r' || i, now(), ARRAY['a'] "
                     f"FROM generate_series(1, {ROWS}) i")
    cdc_database.add_tables(pg_admin, table)
    return table


def _ballast(pg_admin, table: str) -> None:
    """WAL of the published table, well over YIELD_LAG, that a held slot has not confirmed."""
    pg_admin.execute(f"UPDATE {table} SET txt = txt || repeat('x', 200)")


def _settings(cdc_database, provisioned_nats, max_yield: float):
    return platform_settings(cdc_database, provisioned_nats.url).model_copy(update={
        "verify": VerifySettings(yield_lag_bytes=YIELD_LAG, max_yield_seconds=max_yield,
                                 wait_seconds=30)})


async def test_a_verification_waits_while_the_bridge_is_behind_and_not_longer(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    table = _table(pg_admin, cdc_database)
    settings = _settings(cdc_database, provisioned_nats, max_yield=60)
    async with held_slot(settings) as held:
        _ballast(pg_admin, table)
        verifying = asyncio.create_task(verify_table(None, settings, table))
        await asyncio.sleep(HOLD_SECONDS)  # the bridge behind for this long
        held.release()
        result = await asyncio.wait_for(verifying, 30)
    # The tasks (reading 3,000 rows: milliseconds) waited for the bridge, and went on within
    # a pause (at most a second) of its catching up. They started at most ``before`` after
    # the verification did (its steps before and after them), so ended after the release.
    before = result.duration_seconds - result.digest_seconds - result.wait_seconds
    assert HOLD_SECONDS - before <= result.digest_seconds < HOLD_SECONDS + 3, result
    assert result.yield_seconds > 0
    # what it computed is the table's digest all the same
    expected = table_digest_now(cdc_database.server.superuser_conninfo(),
                                cdc_database.publication, table).folded(result.bits)
    assert (await digest_message(nats_client, result))[2] == buckets_of(expected)
    assert result.row_count == ROWS


async def test_a_verification_goes_on_once_it_has_yielded_its_most(
        cdc_database, pg_admin, provisioned_nats, caplog):
    table = _table(pg_admin, cdc_database)
    settings = _settings(cdc_database, provisioned_nats, max_yield=1.0)
    one_task = SnapshotOptions(local_parallelism=1, ranges_per_core=1)
    caplog.set_level(logging.INFO, logger="cdc_platform.verify.yielding")
    async with held_slot(settings) as held:
        _ballast(pg_admin, table)
        verifying = asyncio.create_task(verify_table(None, settings, table, options=one_task))
        # while the bridge is still behind, the task gives up yielding and reads on
        await wait_for(lambda: "its share of CDC_VERIFY_MAX_YIELD; going on" in caplog.text,
                       what="the task to go on")
        held.release()  # so that the digest can be published
        result = await asyncio.wait_for(verifying, 30)
    assert result.partitions == 1
    assert 1.0 <= result.yield_seconds < 1.01
    assert result.digest_seconds < 4
    assert "yielding" in caplog.text


async def test_no_bridge_streaming_the_slot_or_none_behind_means_no_waiting(
        cdc_database, pg_admin, provisioned_nats):
    table = _table(pg_admin, cdc_database)
    settings = _settings(cdc_database, provisioned_nats, max_yield=60)
    # the slot exists, far behind, but no bridge streams it: yielding would help nobody
    pg_admin.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')",
                     (cdc_database.slot,))
    _ballast(pg_admin, table)
    conninfo = settings.postgres.conninfo(options=SESSION_OPTIONS)
    with psycopg.connect(conninfo) as holder:  # holds the snapshot the task imports
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        snapshot_name = holder.execute("SELECT pg_export_snapshot()").fetchone()[0]
        lag = holder.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), "
                             "confirmed_flush_lsn) FROM pg_replication_slots "
                             "WHERE slot_name = %s", (cdc_database.slot,)).fetchone()[0]
        assert lag > YIELD_LAG
        spec = DigestSpec.of(describe_table(holder, settings.postgres.publication, table),
                             conninfo, snapshot_name, MAX_BUCKET_BITS,
                             yield_policy=YieldPolicy(cdc_database.slot, YIELD_LAG, 60))
        alone = await digest_range(spec, BlockRange(0, 0, None))
    assert alone["rows"] == ROWS and alone["yielded"] == 0
    # a bridge streaming it, caught up: no waiting either
    async with running_bridge(settings):
        end = parse_lsn(pg_admin.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
        await wait_for(lambda: slot_confirmed(pg_admin, cdc_database.slot) >= end,
                       what="the bridge to catch up")
        result = await verify_table(None, settings, table)
    assert result.yield_seconds == 0 and result.row_count == ROWS
