"""Mirrors answer verifications (docs/verification.md, item 3) end to end: a real bridge,
real snapshots, the mirror's library and its CLI, source digests published by the platform's
verification run (``verify_table``)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import sqlite3
import subprocess
import threading

import psycopg
import pytest

from cdc_platform.mirror.digests import read_digest, scan_digest
from cdc_platform.mirror.fleet import file_state
from cdc_platform.mirror.follower import Mirror
from cdc_platform.mirror.positions import load_shapes
from cdc_platform.mirror.verifications import VerificationResult
from cdc_platform.mirror.verify import verify_file
from cdc_platform.settings import MirrorSettings
from cdc_platform.verify.job import verify_table
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
from cdc_platform_tests.fixtures.verification import (
    digest_message,
    publish_digest,
    table_digest_now,
)

FAST = MirrorSettings(status_interval_seconds=1.0, snapshot_wait_seconds=120.0)


def _writes(conninfo: str, table: str, stop: threading.Event, seed: int) -> int:
    """Small random transactions on ``table (id, v)`` until ``stop``; how many."""
    rng = random.Random(seed)
    done = 0
    with psycopg.connect(conninfo, autocommit=True) as conn:
        while not stop.is_set():
            key = rng.randrange(1, 400)
            with conn.transaction():
                conn.execute(rng.choice([
                    f"UPDATE {table} SET v = md5(random()::text) WHERE id = %s",
                    f"DELETE FROM {table} WHERE id = %s",
                    (f"INSERT INTO {table} VALUES (%s, 'new') ON CONFLICT (id) DO UPDATE "
                     "SET v = 'again'")]), (key,))
            done += 1
            stop.wait(0.003)
    return done


def _bucket(key: int, bits: int) -> int:
    return bucket_of(RowDigester(["id"]).key_hash({"id": key}), bits)


async def test_verifications_met_equal_under_writes_and_differ_where_a_row_was_removed(
        cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path):
    table = random_name("verified")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, 300) g")
    cdc_database.add_tables(pg_admin, table)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    conninfo = cdc_database.server.superuser_conninfo()
    db = tmp_path / "mirror.db"
    results: list[VerificationResult] = []
    lines: list[str] = []
    async with running_bridge(settings), snapshot_responder(settings):
        await bridge_ready(pg_admin, cdc_database, settings, [table])
        mirror = Mirror(settings, [table], db, options=FAST, report=lines.append,
                        on_verification=lambda _, result: results.append(result))
        stop = asyncio.Event()
        running = asyncio.create_task(mirror.run(stop))
        await mirror_caught_up(mirror, running, nats_client)
        # 1. under concurrent writes: equal
        writing = threading.Event()
        writer = asyncio.create_task(asyncio.to_thread(_writes, conninfo, table, writing, 1))
        await asyncio.sleep(0.3)
        verified = await verify_table(None, settings, table)
        _, first, _ = await digest_message(nats_client, verified)
        await asyncio.sleep(0.3)
        writing.set()
        assert await writer > 20
        await wait_for(lambda: results, timeout=60, what="the first verification met")
        assert (results[0].verification_id, results[0].status, results[0].changed_outside) == (
            first["verification_id"], "equal", []), "\n".join(lines[-20:])
        # 2. hostile digest messages: said, skipped, nothing stops
        await publish_digest(settings, table, "verify-junk", b"\xc1 not msgpack")
        await publish_digest(settings, table, "verify-short",
                             {**first, "verification_id": "verify-short", "totals": b"\x00\x01"})
        await publish_digest(settings, table, "verify-forged",
                             {**first, "verification_id": "verify-forged", "table": "other"})
        await publish_digest(settings, table, "verify-unmet",
                             {**first, "verification_id": "verify-unmet"})
        # 3. a row removed from the mirror's file behind its back: that row's bucket differs
        # (and it is named as changed outside the stream)
        removed = 123
        pg_admin.execute(f"INSERT INTO {table} VALUES ({removed}, 'kept') ON CONFLICT (id) "
                         "DO UPDATE SET v = 'kept'")
        await bridge_caught_up(pg_admin, cdc_database.slot)
        await mirror_caught_up(mirror, running, nats_client)
        with contextlib.closing(sqlite3.connect(db, timeout=30)) as local, local:
            assert local.execute(f'DELETE FROM "{table}" WHERE id = ?', (removed,)).rowcount == 1
        verified = await verify_table(None, settings, table, bits=6)
        _, second, _ = await digest_message(nats_client, verified)
        await wait_for(lambda: any(r.verification_id == second["verification_id"]
                                   for r in results), timeout=60,
                       what="the second verification met")
        assert "last verifications: " + table + " differ" in mirror.status_line(0, 1)
        stop.set()
        await asyncio.wait_for(running, 30)
    by_id = {result.verification_id: result for result in results}
    assert by_id["verify-unmet"].status == "not_comparable"
    assert by_id["verify-unmet"].why == "the marker was not seen"
    assert {"verify-junk", "verify-short", "verify-forged"}.isdisjoint(by_id)
    found = by_id[second["verification_id"]]
    bits = second["bits"]
    assert found.status == "differ"
    assert found.buckets_differing == {_bucket(removed, bits): (
        second["counts"][_bucket(removed, bits)] - 1, second["counts"][_bucket(removed, bits)])}
    assert found.changed_outside == [_bucket(removed, 14)]
    # what the fleet reporter publishes of it (mirror/fleet.py reads the file)
    shown = file_state(db, [table])[1][table]["last_verification"]
    assert shown is not None
    assert (shown["verification_id"], shown["status"], shown["buckets_differing"]) == (
        second["verification_id"], "differ", 1)
    # the kept digest was reset from the rows: the file agrees with itself again
    assert [check.differing for check in verify_file(db)] == [{}]
    with contextlib.closing(sqlite3.connect(db)) as local:
        statuses = local.execute("SELECT verification_id, status FROM "
                                 "_cdc_mirror_verifications").fetchall()
        assert (second["verification_id"], "differ") in statuses
        assert local.execute("SELECT count(*) FROM _cdc_mirror_digest_log").fetchone() == (0,)


_SCHEMA_CHANGES = [
    "ALTER TABLE {t} ADD COLUMN {c} int DEFAULT 5",
    "ALTER TABLE {t} ADD COLUMN {c} text",
    "ALTER TABLE {t} DROP COLUMN IF EXISTS n",
    "ALTER TABLE {t} RENAME COLUMN v TO {c}",
]


def _random_stream(conninfo: str, table: str, transactions: int, seed: int) -> None:
    """Inserts, updates (most leaving the TOASTed ``big`` unchanged), deletes, a TRUNCATE
    now and then, and schema changes."""
    rng = random.Random(seed)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        for number in range(transactions):
            columns = [row[0] for row in conn.execute(
                "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
                "AND NOT attisdropped", (table,))]
            text_column = next((c for c in columns if c not in ("id", "big", "n")
                                and c.startswith(("v", "c"))), None)
            draw = rng.random()
            if draw < 0.03:
                conn.execute(f"TRUNCATE {table}")
            elif draw < 0.1:
                conn.execute(rng.choice(_SCHEMA_CHANGES).format(t=table, c=f"c{number}"))
            else:
                with conn.transaction():
                    for _ in range(rng.randrange(1, 6)):
                        key = rng.randrange(1, 300)
                        choice = rng.random()
                        if choice < 0.4:
                            conn.execute(f"INSERT INTO {table} (id, big) VALUES (%s, "
                                         "repeat(md5(random()::text), 100)) ON CONFLICT (id) "
                                         "DO NOTHING", (key,))
                        elif choice < 0.8 and text_column:  # big stays: unchanged TOAST
                            conn.execute(f'UPDATE {table} SET "{text_column}" = '
                                         "md5(random()::text) WHERE id = %s", (key,))
                        elif choice < 0.9:
                            conn.execute(f"UPDATE {table} SET big = repeat(md5(random()::text),"
                                         " 90) WHERE id = %s", (key,))
                        else:
                            conn.execute(f"DELETE FROM {table} WHERE id = %s", (key,))


def _kept_equals_rows(db) -> dict:
    """Each table whose kept digest differs from its rows' (none: all agree)."""
    with contextlib.closing(sqlite3.connect(db)) as local:
        shapes = load_shapes(local)
        return {table: "differs" for table, shape in shapes.items()
                if read_digest(local, table) is not None
                and read_digest(local, table).differing(scan_digest(local, shape))}


@pytest.mark.parametrize("pure", [False, True], ids=["compiled", "pure"])
async def test_digests_kept_through_a_random_stream_and_a_sigkill_equal_the_source(
        cdc_database, pg_admin, provisioned_nats, tmp_path, pure):
    table = random_name("kept")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text, n int, big text)")
    pg_admin.execute(f"ALTER TABLE {table} ALTER COLUMN big SET STORAGE EXTERNAL")
    pg_admin.execute(f"INSERT INTO {table} SELECT g, 'v' || g, g, repeat(md5(g::text), 100) "
                     "FROM generate_series(1, 200) g")
    cdc_database.add_tables(pg_admin, table)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    conninfo = cdc_database.server.superuser_conninfo()
    env = {**bridge_env(cdc_database, provisioned_nats.url), "CDC_MIRROR_STATUS_INTERVAL": "1s"}
    if pure:
        env["CDC_PLATFORM_PURE_PYTHON"] = "1"
    else:
        env.pop("CDC_PLATFORM_PURE_PYTHON", None)
    db = tmp_path / "mirror.db"
    command = [CLI, "mirror", "--tables", table, "--sqlite", str(db)]
    log_path = tmp_path / "mirror.log"
    async with running_bridge(settings), snapshot_responder(settings):
        await bridge_ready(pg_admin, cdc_database, settings, [table])
        with open(log_path, "wb") as output:
            mirror = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
            try:
                await wait_for(lambda: "swapped in" in log_path.read_text()
                               or "streaming" in log_path.read_text(), timeout=60,
                               what="the mirror streaming")
                writing = asyncio.create_task(asyncio.to_thread(
                    _random_stream, conninfo, table, 120, 7))
                await asyncio.sleep(1.0)
                mirror.send_signal(signal.SIGKILL)  # mid-stream
                mirror.wait()
                assert _kept_equals_rows(db) == {}  # as the killed mirror left them
                await writing
                await bridge_caught_up(pg_admin, cdc_database.slot)
                finished = await asyncio.to_thread(
                    subprocess.run, [*command, "--once"], env=env, stdout=output,
                    stderr=subprocess.STDOUT, timeout=120)
            finally:
                if mirror.poll() is None:
                    mirror.kill()
        text = log_path.read_text()
        assert finished.returncode == 0, text[-3000:]
    assert _kept_equals_rows(db) == {}, text[-3000:]
    with contextlib.closing(sqlite3.connect(db)) as local:
        kept = read_digest(local, table)
    assert kept is not None
    assert kept.differing(table_digest_now(conninfo, cdc_database.publication, table)) == [], \
        text[-3000:]
    verified = await asyncio.to_thread(
        subprocess.run, [CLI, "mirror", "verify", "--sqlite", str(db)], env=env,
        capture_output=True, text=True, timeout=60, check=False)
    assert verified.returncode == 0 and f"{table}: equal" in verified.stdout, verified
