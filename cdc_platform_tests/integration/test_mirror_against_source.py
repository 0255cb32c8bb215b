"""`cdc-platform mirror verify --against-source` (docs/verification.md Part 2, item 3): a
verification asked of the platform (`purpose: verify`, answered here by the test responder
with the platform's `verify_table`), met by the mirror of the file: the one running on it,
or one the command runs until then. A real bridge, real snapshots, the CLI."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import subprocess

import pytest

from cdc_platform.consumer.requests import digest_stored_since
from cdc_platform.mirror.digests import read_digest
from cdc_platform.mirror.follower import Mirror
from cdc_platform.mirror.lock import MirrorRunning, holding, lock_path
from cdc_platform.mirror.verifications import VerificationResult
from cdc_platform.settings import MirrorSettings
from cdc_platform.wire.digest import RowDigester, bucket_of
from cdc_platform_tests.exactness import bridge_caught_up, mirror_caught_up
from cdc_platform_tests.fixtures.bridge import bridge_ready, running_bridge, wait_for
from cdc_platform_tests.fixtures.responder import snapshot_responder
from cdc_platform_tests.fixtures.services import (
    CLI,
    bridge_env,
    platform_settings,
    random_name,
)
from cdc_platform_tests.fixtures.verification import table_digest_now

FAST = MirrorSettings(status_interval_seconds=1.0, snapshot_wait_seconds=120.0)


def _table(cdc_database, pg_admin, prefix: str, rows: int = 300) -> str:
    table = random_name(prefix)
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, {rows}) g")
    cdc_database.add_tables(pg_admin, table)
    return table


async def _against_source(env, db, *options: str) -> subprocess.CompletedProcess:
    return await asyncio.to_thread(
        subprocess.run, [CLI, "mirror", "verify", "--against-source", "--sqlite", str(db),
                         *options], env=env, capture_output=True, text=True, timeout=120)


def _damage(db, table: str, *statements: str) -> None:
    """Rows changed behind the mirror's back."""
    with contextlib.closing(sqlite3.connect(db, timeout=30)) as local, local:
        for statement in statements:
            assert local.execute(statement.format(t=f'"{table}"')).rowcount == 1


def _bucket(key: int, bits: int) -> int:
    return bucket_of(RowDigester(["id"]).key_hash({"id": key}), bits)


async def test_with_no_mirror_running_the_command_runs_it_until_met(
        cdc_database, pg_admin, provisioned_nats, tmp_path):
    """No mirror runs on the file: the command runs it (taking the file's lock) until the
    verification is met: `equal` (exit 0) with changes made since the mirror last ran; after
    a row is deleted behind its back, `differ` (exit 1): the table's one bucket (a table this
    small is digested in 1) is more than a quarter, so the mirror bootstraps it again."""
    table = _table(cdc_database, pg_admin, "offline")
    settings = platform_settings(cdc_database, provisioned_nats.url)
    env = {**bridge_env(cdc_database, provisioned_nats.url), "CDC_MIRROR_SNAPSHOT_WAIT": "120"}
    db = tmp_path / "edge.db"
    async with running_bridge(settings), snapshot_responder(settings):
        await bridge_ready(pg_admin, cdc_database, settings, [table])
        await Mirror(settings, [table], db, options=FAST,
                     report=lambda line: None).run(until_caught_up=True)
        pg_admin.execute(f"UPDATE {table} SET v = 'changed' WHERE id <= 10")
        equal = await _against_source(env, db)
        assert equal.returncode == 0, equal.stdout + equal.stderr[-3000:]
        assert equal.stdout.startswith(f"{table}: equal (verification verify-"), equal.stdout
        with contextlib.closing(sqlite3.connect(db)) as local:  # (its mirror applied them)
            assert local.execute(f'SELECT count(*) FROM "{table}" WHERE v = ?',
                                 ("changed",)).fetchone() == (10,)

        _damage(db, table, "DELETE FROM {t} WHERE id = 7")
        differ = await _against_source(env, db)
        assert differ.returncode == 1, differ.stdout + differ.stderr[-3000:]
        assert f"{table}: differ (verification verify-" in differ.stdout
        assert "1 of 1 buckets: 0; the" in differ.stdout and "bootstrap" in differ.stdout, \
            differ.stdout
        # its mirror stopped with the command: the file is free again
        await Mirror(settings, [table], db, options=FAST,
                     report=lambda line: None).run(until_caught_up=True)
        assert (await _against_source(env, db)).returncode == 0  # bootstrapped: equal
    # stopped while waiting (no platform answers now): exit 130, its mirror stopped with it
    asking = subprocess.Popen([CLI, "mirror", "verify", "--against-source", "--sqlite", str(db)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        await wait_for(lambda: lock_path(db).read_text().strip() == str(asking.pid),
                       timeout=30, what="the command running the file's mirror")
        asking.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(asking.wait, 30) == 130
    finally:
        if asking.poll() is None:
            asking.kill()
    with holding(db):  # (free again)
        pass


async def test_the_running_mirror_meets_it_and_repairs_what_differs_and_a_refusal_is_an_error(
        cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path):
    """A mirror runs on the file (it holds the lock): the command asks, reads the file, and
    prints what that mirror found: two rows altered behind its back differ in their two
    buckets of 64 (`--bits 6`), which the mirror repairs (exit 0, `repaired`, the table
    equal to the source). A request the platform refuses is a clear error (exit 2)."""
    table = _table(cdc_database, pg_admin, "online")
    settings = platform_settings(cdc_database, provisioned_nats.url)
    env = {**bridge_env(cdc_database, provisioned_nats.url), "CDC_MIRROR_SNAPSHOT_WAIT": "120"}
    db = tmp_path / "edge.db"
    met: list[VerificationResult] = []
    async with running_bridge(settings), snapshot_responder(settings):
        await bridge_ready(pg_admin, cdc_database, settings, [table])
        mirror = Mirror(settings, [table], db, options=FAST, report=lambda line: None,
                        on_verification=lambda _, result: met.append(result))
        stop = asyncio.Event()
        running = asyncio.create_task(mirror.run(stop))
        try:
            await mirror_caught_up(mirror, running, nats_client)
            with pytest.raises(MirrorRunning, match=f"pid {os.getpid()}"):  # one a file
                await Mirror(settings, [table], db, options=FAST).run(until_caught_up=True)
            damaged = (40, 41)
            _damage(db, table, *(f"UPDATE {{t}} SET v = 'wrong' WHERE id = {key}"
                                 for key in damaged))
            repaired = await _against_source(env, db, "--bits", "6")
            assert repaired.returncode == 0, repaired.stdout + repaired.stderr[-3000:]
            buckets = sorted({_bucket(key, 6) for key in damaged})
            assert repaired.stdout.startswith(f"{table}: repaired (verification "), \
                repaired.stdout
            assert (f"; {len(buckets)} of 64 buckets differed and were repaired"
                    in repaired.stdout), repaired.stdout
            # met by the running mirror, not by another one in the command
            (result,) = met
            assert result.verification_id in repaired.stdout
            assert sorted(result.buckets_differing) == buckets
            # what a requester whose `done` got lost finds in CDC instead
            js = nats_client.jetstream()
            found = await digest_stored_since(js, table, 0)
            assert found is not None and found["verification_id"] == result.verification_id
            assert found["bits"] == 6 and found["row_count"] == 300
            last = (await js.stream_info("CDC")).state.last_seq
            assert await digest_stored_since(js, table, last) is None
            await bridge_caught_up(pg_admin, cdc_database.slot)
            await mirror_caught_up(mirror, running, nats_client)
            with contextlib.closing(sqlite3.connect(db)) as local:
                kept = read_digest(local, table)
            assert kept is not None and kept.differing(table_digest_now(
                cdc_database.server.superuser_conninfo(), cdc_database.publication,
                table)) == []

            pg_admin.execute(f"ALTER PUBLICATION {cdc_database.publication} DROP TABLE {table}")
            refused = await _against_source(env, db)
            assert refused.returncode == 2, refused.stdout + refused.stderr[-3000:]
            assert f"{table}: verification request refused: " in refused.stderr, \
                refused.stderr[-3000:]
            assert not running.done()  # the running mirror goes on
        finally:
            stop.set()
            await asyncio.wait_for(running, 30)
