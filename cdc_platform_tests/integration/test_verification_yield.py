"""A verification gives way to CDC (cdc_platform/verify/yielding.py): its tasks pause while the
bridge's slot is more than CDC_VERIFY_YIELD_LAG behind, for at most CDC_VERIFY_MAX_YIELD, and
not at all when no bridge streams the slot or it keeps up. Real PostgreSQL and nats-server; a
bridge held behind is the real replication protocol confirming nothing (``held_slot``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from pathlib import Path

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
    HeldSlot,
    held_slot,
    running_bridge,
    slot_confirmed,
    wait_for,
)
from cdc_platform_tests.fixtures.services import CLI, bridge_env, platform_settings, random_name
from cdc_platform_tests.fixtures.snapshots import LIVE_TABLE_COLUMNS
from cdc_platform_tests.fixtures.verification import (
    buckets_of,
    digest_message,
    table_digest_now,
)

# the slot's position and activity as PostgreSQL reports them: on the newest major too
pytestmark = pytest.mark.every_major

ROWS = 3_000
YIELD_LAG = 64 * 1024  # the test's threshold; its ballast writes ~20x that
# a threshold leaving room for WAL the server writes of its own accord (autovacuum of earlier
# tests' tables: ~210 KB in a CI run) where a test needs the lag under it; 40,000 rows'
# ballast writes ~14x that
WIDE_YIELD_LAG = 1024 * 1024
HOLD_SECONDS = 1.5  # how long the bridge stays behind
NEARLY_SECONDS = 2.5  # how long it stays under the threshold, not caught up


def _table(pg_admin, cdc_database, rows: int = ROWS) -> str:
    table = random_name("yielding")
    pg_admin.execute(f"CREATE TABLE {table} ({LIVE_TABLE_COLUMNS})")
    pg_admin.execute(f"INSERT INTO {table} SELECT i, i % 100, 'r' || i, now(), ARRAY['a'] "
                     f"FROM generate_series(1, {rows}) i")
    cdc_database.add_tables(pg_admin, table)
    return table


def _ballast(pg_admin, table: str) -> None:
    """WAL of the published table, well over YIELD_LAG, that a held slot has not confirmed."""
    pg_admin.execute(f"UPDATE {table} SET txt = txt || repeat('x', 200)")


def _task_copying(pg_admin) -> bool:
    """Whether a verification task's COPY runs (or waits, its socket full)."""
    return pg_admin.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name "
                            "= 'cdc_platform_verify' AND query LIKE 'COPY%%' AND state = "
                            "'active'").fetchone()[0] > 0


def _current_lsn(pg_admin) -> int:
    return parse_lsn(pg_admin.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])


def _task_reading_the_lag(pg_admin) -> bool:
    """Whether a verification task has its connection for the bridge's lag open."""
    return pg_admin.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name "
                            "= 'cdc_platform_verify_lag'").fetchone()[0] > 0


def _settings(cdc_database, provisioned_nats, max_yield: float, yield_lag: int = YIELD_LAG):
    return platform_settings(cdc_database, provisioned_nats.url).model_copy(update={
        "verify": VerifySettings(yield_lag_bytes=yield_lag, max_yield_seconds=max_yield,
                                 wait_seconds=30)})


def _verification_connections(pg_admin) -> int:
    """Connections of a verification's driver and tasks (reading COPY, reading the lag)."""
    return pg_admin.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name "
                            "IN ('cdc_platform_verify', 'cdc_platform_verify_lag')"
                            ).fetchone()[0]


@contextlib.asynccontextmanager
async def _verifying(pg_admin, *args, **kwargs) -> AsyncIterator[asyncio.Task]:
    """``verify_table(*args, **kwargs)`` running as a task; if a failing assertion leaves it
    running, cancelled and its tasks' connections gone before the next test counts them."""
    verifying = asyncio.create_task(verify_table(*args, **kwargs))
    try:
        yield verifying
    finally:
        if not verifying.done():
            verifying.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await verifying
            await wait_for(lambda: _verification_connections(pg_admin) == 0, timeout=10,
                           what="the cancelled verification's tasks to end")


@pytest.mark.parametrize("on_spark", [False, pytest.param(True, marks=pytest.mark.spark)],
                         ids=["in_process", "spark"])
async def test_a_verification_waits_while_the_bridge_is_behind_and_not_longer(
        cdc_database, pg_admin, provisioned_nats, nats_client, request, on_spark):
    table = _table(pg_admin, cdc_database)
    settings = _settings(cdc_database, provisioned_nats, max_yield=60)
    spark = request.getfixturevalue("spark_session") if on_spark else None
    options = SnapshotOptions(small_table_bytes=0) if on_spark else None
    async with held_slot(settings) as held:
        _ballast(pg_admin, table)
        async with _verifying(pg_admin, spark, settings, table, options=options) as verifying:
            if on_spark:  # Spark's tasks start seconds later: hold from when one reads the lag
                await wait_for(lambda: _task_reading_the_lag(pg_admin), what="a task yielding")
            await asyncio.sleep(HOLD_SECONDS)  # the bridge behind for this long
            held.release()
            result = await asyncio.wait_for(verifying, 60)
    assert result.spark == on_spark
    if on_spark:  # the first two tasks, at once, each from its first block to the release
        assert result.yield_seconds >= HOLD_SECONDS, result
    else:
        # The tasks (reading 3,000 rows: milliseconds) waited for the bridge, and went on
        # within a pause (at most a second) of its catching up. They started at most
        # ``before`` after the verification did (its steps before and after them), so ended
        # after the release.
        before = result.duration_seconds - result.digest_seconds - result.wait_seconds
        assert HOLD_SECONDS - before <= result.digest_seconds < HOLD_SECONDS + 3, result
        assert result.yield_seconds > 0
    # what it computed is the table's digest all the same
    expected = table_digest_now(cdc_database.server.superuser_conninfo(),
                                cdc_database.publication, table).folded(result.bits)
    assert (await digest_message(nats_client, result))[2] == buckets_of(expected)
    assert result.row_count == ROWS


async def test_a_task_that_gave_way_waits_until_the_bridge_confirmed_what_was_written_then(
        cdc_database, pg_admin, provisioned_nats):
    """Once yielding, a task waits until the bridge has confirmed the WAL written when it
    began to, not merely until the lag is under CDC_VERIFY_YIELD_LAG: a bridge catching up on
    many transactions confirms as it goes, and a task going on at the limit would take the
    cores back for the rest of the catch-up (before: it went on within a pause, 1 s at
    most, of the bridge confirming the ballast). And it gave way before its COPY, not after
    a first block (up to 4 MiB; the table's COPY text is ~10 MB)."""
    table = _table(pg_admin, cdc_database, rows=40_000)
    settings = _settings(cdc_database, provisioned_nats, max_yield=60,
                         yield_lag=WIDE_YIELD_LAG)
    one_task = SnapshotOptions(local_parallelism=1, ranges_per_core=1)
    async with held_slot(settings) as held:
        _ballast(pg_admin, table)
        ballast_end = _current_lsn(pg_admin)
        # WAL after the ballast, under the limit but over 1/16 of it (where a task goes on
        # all the same)
        pg_admin.execute("SELECT pg_logical_emit_message(false, 'cdc-test', repeat('x', %s))",
                         (WIDE_YIELD_LAG // 4,))
        async with _verifying(pg_admin, None, settings, table, options=one_task) as verifying:
            await wait_for(lambda: _task_reading_the_lag(pg_admin), what="the task yielding")
            assert not _task_copying(pg_admin)  # it gave way before it read a block
            held.release(up_to=ballast_end)  # the bridge has caught up on the ballast
            await wait_for(lambda: slot_confirmed(pg_admin, cdc_database.slot) >= ballast_end,
                           what="the ballast confirmed")
            assert _current_lsn(pg_admin) - ballast_end < WIDE_YIELD_LAG
            await asyncio.sleep(NEARLY_SECONDS)
            assert not verifying.done()
            held.release()
            result = await asyncio.wait_for(verifying, 30)
    assert result.yield_seconds >= NEARLY_SECONDS, result
    assert result.row_count == 40_000


async def test_a_verification_goes_on_once_it_has_yielded_its_most(
        cdc_database, pg_admin, provisioned_nats, caplog):
    table = _table(pg_admin, cdc_database)
    settings = _settings(cdc_database, provisioned_nats, max_yield=1.0)
    one_task = SnapshotOptions(local_parallelism=1, ranges_per_core=1)
    caplog.set_level(logging.INFO, logger="cdc_platform.verify.yielding")
    async with held_slot(settings) as held:
        _ballast(pg_admin, table)
        async with _verifying(pg_admin, None, settings, table, options=one_task) as verifying:
            # while the bridge is still behind, the task gives up yielding and reads on
            await wait_for(lambda: "its share of CDC_VERIFY_MAX_YIELD; going on" in caplog.text,
                           what="the task to go on")
            held.release()  # so that the digest can be published
            result = await asyncio.wait_for(verifying, 30)
    assert result.partitions == 1
    assert 1.0 <= result.yield_seconds < 1.01
    assert result.digest_seconds < 4
    assert "yielding" in caplog.text


async def test_a_cancelled_verification_stops_its_tasks_yielding_at_once(
        cdc_database, pg_admin, provisioned_nats):
    """A verification run cancelled (a Dagster run's cancellation cancels it so) while its
    in-process tasks give way to a bridge far behind: the tasks, threads the cancellation
    does not reach, stop within a pause, not after their share of CDC_VERIFY_MAX_YIELD,
    releasing the exported snapshot they imported (and the step's process, which waits for
    them)."""
    table = _table(pg_admin, cdc_database)
    settings = _settings(cdc_database, provisioned_nats, max_yield=60)
    async with held_slot(settings) as held:
        _ballast(pg_admin, table)
        async with _verifying(pg_admin, None, settings, table) as verifying:
            await wait_for(lambda: _task_reading_the_lag(pg_admin), what="the tasks yielding")
            verifying.cancel()
            with pytest.raises(asyncio.CancelledError):
                await verifying
            cancelled = asyncio.get_running_loop().time()
            await wait_for(lambda: _verification_connections(pg_admin) == 0, timeout=10,
                           what="the tasks to end")
            ended = asyncio.get_running_loop().time() - cancelled
        held.release()
    assert ended < 2.0


@contextlib.asynccontextmanager
async def _cli_yielding(cdc_database, pg_admin, provisioned_nats, **env: str
                        ) -> AsyncIterator[tuple[asyncio.subprocess.Process, str, HeldSlot]]:
    """`cdc-platform verify` of a new table (settings ``env`` besides the test's), started
    with the bridge held behind, once its tasks are yielding: (the process, the table, the
    held slot). Killed if it still runs at the end; the slot released."""
    table = _table(pg_admin, cdc_database)
    settings = _settings(cdc_database, provisioned_nats, max_yield=60)
    env = {**bridge_env(cdc_database, provisioned_nats.url), "CDC_SLOT": cdc_database.slot,
           "CDC_PUBLICATION": cdc_database.publication, "CDC_VERIFY_WAIT": "30",
           "CDC_VERIFY_YIELD_LAG": "64KiB", **env}
    async with held_slot(settings) as held:
        _ballast(pg_admin, table)
        process = await asyncio.create_subprocess_exec(
            CLI, "verify", table, env=env, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        try:
            # yielding: its tasks are reading the bridge's lag, the bridge being behind
            await wait_for(lambda: _task_reading_the_lag(pg_admin), what="the tasks yielding")
            yield process, table, held
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
            held.release()


async def test_an_interrupted_verification_process_ends_without_waiting_out_its_yield(
        cdc_database, pg_admin, provisioned_nats):
    """The process's side of it: SIGINT (what cancelling a Dagster run does to its step
    process; here `cdc-platform verify`) ends it within a pause, where asyncio.run waited
    for the tasks' threads for as long as they yielded."""
    async with _cli_yielding(cdc_database, pg_admin, provisioned_nats,
                             CDC_VERIFY_MAX_YIELD="60") as (process, _, _):
        process.send_signal(signal.SIGINT)
        interrupted = asyncio.get_running_loop().time()
        async with asyncio.timeout(20):
            await process.communicate()
        ended = asyncio.get_running_loop().time() - interrupted
    assert process.returncode != 0 and ended < 2.0, ended
    assert _verification_connections(pg_admin) == 0


def _add_column(conninfo: str, table: str) -> None:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '30s'")
        conn.execute(f"ALTER TABLE {table} ADD COLUMN extra int")


async def test_a_verification_stops_yielding_while_ddl_waits_for_its_table(
        cdc_database, pg_admin, provisioned_nats):
    table = _table(pg_admin, cdc_database)
    settings = _settings(cdc_database, provisioned_nats, max_yield=60)
    one_task = SnapshotOptions(local_parallelism=1, ranges_per_core=1)
    async with held_slot(settings) as held:
        _ballast(pg_admin, table)
        async with _verifying(pg_admin, None, settings, table, options=one_task) as verifying:
            await wait_for(lambda: _task_reading_the_lag(pg_admin), what="the task yielding")
            # an ALTER queues behind the verification's lock (and every later query of the
            # table behind it): the task reads on and lets it through, the bridge still behind
            await asyncio.wait_for(asyncio.to_thread(
                _add_column, cdc_database.server.superuser_conninfo(), table), 20)
            held.release()
            result = await asyncio.wait_for(verifying, 30)
    assert result.row_count == ROWS and result.yield_seconds < 20


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


def _nice_values(pid: int) -> set[int]:
    """The nice value of each thread of process ``pid`` (field 19 of its stat)."""
    return {int(stat.read_text().rsplit(")", 1)[1].split()[16])
            for stat in Path(f"/proc/{pid}/task").glob("*/stat")}


async def test_the_cli_verifies_niced_and_yielding_as_its_settings_say(
        cdc_database, pg_admin, provisioned_nats):
    async with _cli_yielding(cdc_database, pg_admin, provisioned_nats,
                             CDC_VERIFY_NICE="7") as (process, table, held):
        nice = _nice_values(process.pid)
        held.release()
        async with asyncio.timeout(60):
            out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    assert nice == {7}  # every thread, the tasks' included
    assert "yielding" in err.decode() and f"of {table}: {ROWS:,} rows" in out.decode()
