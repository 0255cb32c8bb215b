"""Mirrors repair the buckets a verification finds differing (docs/verification.md Part 2,
item 4) end to end: a real bridge, source digests from ``verify_table``, repair snapshots
served as the sensor serves them, the mirror's library."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading

import psycopg
import pytest

from cdc_platform.dev.servers import start_logical_postgres
from cdc_platform.mirror.follower import Mirror
from cdc_platform.mirror.verifications import VerificationResult
from cdc_platform.mirror.verify import verify_file
from cdc_platform.postgres.admin import provision_database
from cdc_platform.settings import MirrorSettings
from cdc_platform.verify.job import verify_table
from cdc_platform.wire import encoder, resync_msg_id, resync_subject
from cdc_platform.wire.digest import RowDigester, bucket_of
from cdc_platform_tests.exactness import bridge_caught_up, mirror_caught_up
from cdc_platform_tests.fixtures.bridge import bridge_ready, running_bridge, wait_for
from cdc_platform_tests.fixtures.responder import snapshot_responder
from cdc_platform_tests.fixtures.services import (
    CdcDatabase,
    platform_settings,
    random_name,
    secret_for_test,
)
from cdc_platform_tests.fixtures.slots import lose_slot
from cdc_platform_tests.fixtures.verification import digest_message

FAST = MirrorSettings(status_interval_seconds=1.0, snapshot_wait_seconds=120.0)
BITS = 8  # 256 buckets: the damage below touches 7 of them, well under a quarter
ROWS = 3000


def _bucket(key: int) -> int:
    return bucket_of(RowDigester(["id"]).key_hash({"id": key}), BITS)


def _inserts(conninfo: str, table: str, stop: threading.Event) -> int:
    """One-row transactions on ``table`` until ``stop``; how many."""
    done = 0
    with psycopg.connect(conninfo, autocommit=True) as conn:
        while not stop.is_set():
            done += 1
            conn.execute(f"INSERT INTO {table} VALUES (%s, 'x')", (done,))
            stop.wait(0.005)
    return done


def _local_rows(path, table: str) -> dict[int, tuple[int, str]]:
    """id -> (rowid, v) of the mirror's ``table``."""
    with contextlib.closing(sqlite3.connect(path, timeout=30)) as local:
        return {key: (rowid, value) for rowid, key, value in local.execute(
            f'SELECT rowid, id, v FROM "{table}"')}


@pytest.mark.every_major
async def test_a_mirror_repairs_exactly_the_buckets_a_verification_finds_differing(
        cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path):
    table, other = random_name("repaired"), random_name("flowing")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, {ROWS}) g")
    pg_admin.execute(f"CREATE TABLE {other} (id int PRIMARY KEY, v text)")
    cdc_database.add_tables(pg_admin, table, other)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    conninfo = cdc_database.server.superuser_conninfo()
    db, older = tmp_path / "mirror.db", tmp_path / "older.db"
    results: list[VerificationResult] = []
    lines: list[str] = []
    async with running_bridge(settings), snapshot_responder(settings):
        await bridge_ready(pg_admin, cdc_database, settings, [table, other])
        mirror = Mirror(settings, [table, other], db, options=FAST, report=lines.append,
                        on_verification=lambda _, result: results.append(result))
        stop = asyncio.Event()
        running = asyncio.create_task(mirror.run(stop))
        writing = threading.Event()
        writer = asyncio.create_task(asyncio.to_thread(_inserts, conninfo, other, writing))
        try:
            await mirror_caught_up(mirror, running, nats_client)
            # an older copy of the file, then changes it does not hold
            with contextlib.closing(sqlite3.connect(db, timeout=30)) as live, \
                    contextlib.closing(sqlite3.connect(older)) as copy:
                live.backup(copy)
            pg_admin.execute(f"UPDATE {table} SET v = 'changed' WHERE id IN (40, 41)")
            await bridge_caught_up(pg_admin, cdc_database.slot)
            await mirror_caught_up(mirror, running, nats_client)
            with contextlib.closing(sqlite3.connect(db, timeout=30)) as local, local:
                # the table restored from the older copy (rowids and all)
                local.execute("ATTACH ? AS older", (str(older),))
                local.execute(f'DELETE FROM "{table}"')
                local.execute(f'INSERT INTO "{table}" (rowid, id, v) SELECT rowid, id, v '
                              f'FROM older."{table}"')
            # a change lost on its way: applied, then undone behind the mirror's back
            pg_admin.execute(f"UPDATE {table} SET v = 'lost' WHERE id = 60")
            await bridge_caught_up(pg_admin, cdc_database.slot)
            await mirror_caught_up(mirror, running, nats_client)
            with contextlib.closing(sqlite3.connect(db, timeout=30)) as local, local:
                assert local.execute(f"UPDATE \"{table}\" SET v = 'v60' WHERE id = 60 AND "
                                     "v = 'lost'").rowcount == 1
                # rows deleted, altered and added with plain sqlite3
                local.execute(f'DELETE FROM "{table}" WHERE id IN (10, 20)')
                local.execute(f"UPDATE \"{table}\" SET v = 'altered' WHERE id = 30")
                local.execute(f"INSERT INTO \"{table}\" VALUES (100000, 'added')")
            damaged = {10, 20, 30, 40, 41, 60, 100000}
            buckets = {_bucket(key) for key in damaged}
            before = _local_rows(db, table)

            verified = await verify_table(None, settings, table, bits=BITS)
            _, first, _ = await digest_message(nats_client, verified)
            # changes of rows the mirror lacks, after the digest (so while the repair is
            # under way): made to fit, not a divergence that bootstraps the table again
            pg_admin.execute(f"UPDATE {table} SET v = 'during' WHERE id = 20")
            pg_admin.execute(f"DELETE FROM {table} WHERE id = 10")
            await wait_for(lambda: mirror.rows_repaired, timeout=60, what="the repair")
            found = next(r for r in results if r.verification_id == first["verification_id"])
            assert set(found.buckets_differing) == buckets, "\n".join(lines[-20:])

            # a change of a repaired row after the repair: applied as any other
            pg_admin.execute(f"UPDATE {table} SET v = 'after' WHERE id = 20")
            verified = await verify_table(None, settings, table, bits=BITS)
            _, second, _ = await digest_message(nats_client, verified)
            await wait_for(lambda: any(r.verification_id == second["verification_id"]
                                       for r in results), timeout=60,
                           what="the second verification met")
            again = next(r for r in results if r.verification_id == second["verification_id"])
            assert (again.status, again.changed_outside) == ("equal", []), \
                "\n".join(lines[-20:])
            flowed_during = mirror.applied_events
        finally:
            writing.set()
            inserted = await writer
        await bridge_caught_up(pg_admin, cdc_database.slot)
        await mirror_caught_up(mirror, running, nats_client)
        stop.set()
        await asyncio.wait_for(running, 30)
    after = _local_rows(db, table)
    # every row outside the buckets: the same rowid and value as before the repair
    outside = {key: row for key, row in before.items() if _bucket(key) not in buckets}
    assert {key: after.get(key) for key in outside} == outside
    # the rows of the buckets: the source's
    source = dict(pg_admin.execute(f"SELECT id, v FROM {table}").fetchall())
    assert {key: value for key, (_, value) in after.items()} == source
    assert {key: v for key, (_, v) in after.items() if _bucket(key) in buckets} == {
        key: v for key, v in source.items() if _bucket(key) in buckets}
    with contextlib.closing(sqlite3.connect(db)) as local:
        assert local.execute(
            "SELECT status, rows_repaired FROM _cdc_mirror_verifications WHERE "
            "verification_id = ?", (first["verification_id"],)).fetchone() == (
            "repaired", sum(1 for key in source if _bucket(key) in buckets))
        assert local.execute("SELECT count(*) FROM sqlite_master WHERE name LIKE "
                             "'_cdc_repair %'").fetchone() == (0,)
        # the second table kept flowing throughout, and holds every insert
        assert local.execute(f'SELECT count(*) FROM "{other}"').fetchone() == (inserted,)
    assert flowed_during > 0 and inserted > 20
    assert [check.differing for check in verify_file(db)] == [{}, {}]
    assert not any("bootstrapping again" in line for line in lines), "\n".join(lines)


async def test_more_than_a_quarter_of_the_buckets_differing_bootstraps_the_table_again(
        cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path):
    table = random_name("rebuilt")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, 300) g")
    cdc_database.add_tables(pg_admin, table)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    db = tmp_path / "mirror.db"
    results: list[VerificationResult] = []
    lines: list[str] = []
    coarse = 2  # 4 buckets: two of them differing is more than a quarter
    damaged = [next(key for key in range(1, 301)
                    if bucket_of(RowDigester(["id"]).key_hash({"id": key}), coarse) == bucket)
               for bucket in (0, 1)]
    async with running_bridge(settings), snapshot_responder(settings):
        await bridge_ready(pg_admin, cdc_database, settings, [table])
        mirror = Mirror(settings, [table], db, options=FAST, report=lines.append,
                        on_verification=lambda _, result: results.append(result))
        stop = asyncio.Event()
        running = asyncio.create_task(mirror.run(stop))
        await mirror_caught_up(mirror, running, nats_client)
        with contextlib.closing(sqlite3.connect(db, timeout=30)) as local, local:
            local.executemany(f'DELETE FROM "{table}" WHERE id = ?', [(k,) for k in damaged])
        verified = await verify_table(None, settings, table, bits=coarse)
        _, first, _ = await digest_message(nats_client, verified)
        await wait_for(lambda: mirror.bootstraps == 2, timeout=60, what="a bootstrap again")
        await mirror_caught_up(mirror, running, nats_client)
        verified = await verify_table(None, settings, table, bits=coarse)
        _, second, _ = await digest_message(nats_client, verified)
        await wait_for(lambda: any(r.verification_id == second["verification_id"]
                                   for r in results), timeout=60, what="the second one met")
        stop.set()
        await asyncio.wait_for(running, 30)
    statuses = {r.verification_id: r.status for r in results}
    assert (statuses[first["verification_id"]], statuses[second["verification_id"]]) == (
        "differ", "equal"), "\n".join(lines[-20:])
    assert mirror.rows_repaired == 0
    assert any("2 of 4 buckets differ (more than 25%); bootstrapping again" in line
               for line in lines), "\n".join(lines)


async def test_more_buckets_than_a_request_lists_are_repaired_up_to_the_quarter(
        cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path):
    # at 14 bits (what resync_sensor asks for), ~1,000 differing buckets are under a quarter
    # but their list is ~6 KB, past the 4 KB request body: the mirror asks with
    # bucket_bitmap, the platform serves it, and the table resyncing after a lost slot is
    # whole again once repaired (past the quarter it is bootstrapped again:
    # test_more_than_a_quarter_of_the_buckets_differing_bootstraps_the_table_again)
    table = random_name("crowded")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, {ROWS}) g")
    cdc_database.add_tables(pg_admin, table)
    settings = platform_settings(cdc_database, provisioned_nats.url)
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
        # the marker as the bridge stores it after replacing a lost slot (the test below
        # has a real bridge do that)
        msg_id = resync_msg_id(cdc_database.slot, 1)
        await nats_client.jetstream().publish(
            resync_subject(cdc_database.slot), encoder("msgpack")({
                "type": "resync", "slot": cdc_database.slot, "lost_after": "0/1",
                "reason": "slot lost", "timestamp": 0, "msg_id": msg_id}),
            headers={"Nats-Msg-Id": msg_id})
        await wait_for(lambda: mirror.resyncing == {table}, what="the table resyncing")
        with contextlib.closing(sqlite3.connect(db, timeout=30)) as local, local:
            local.execute(f'DELETE FROM "{table}" WHERE id % 3 = 0')
        before = _local_rows(db, table)
        verified = await verify_table(None, settings, table, bits=14)
        _, first, _ = await digest_message(nats_client, verified)
        await wait_for(lambda: mirror.rows_repaired, timeout=60, what="the repair")
        again = await verify_table(None, settings, table, bits=14)
        _, second, _ = await digest_message(nats_client, again)
        await wait_for(lambda: any(r.verification_id == second["verification_id"]
                                   for r in results), timeout=60, what="the next verification")
        stop.set()
        await asyncio.wait_for(running, 30)
    statuses = {r.verification_id: r for r in results}
    differing = set(statuses[first["verification_id"]].buckets_differing)
    assert 1 << 14 >> 2 > len(differing) > 900, len(differing)  # a list holds ~620
    assert statuses[second["verification_id"]].status == "equal", "\n".join(lines[-20:])
    assert any(f"requested a repair of {len(differing)} of 16384 buckets" in line
               for line in lines), "\n".join(lines)
    assert mirror.bootstraps == 1 and mirror.resyncing == set()
    after = _local_rows(db, table)
    digester = RowDigester(["id"])
    outside = {key for key in before
               if bucket_of(digester.key_hash({"id": key}), 14) not in differing}
    assert len(outside) > ROWS // 3 and {key: after[key] for key in outside} == {
        key: before[key] for key in outside}  # same rowid, same value
    assert {key: v for key, (_, v) in after.items()} == dict(
        pg_admin.execute(f"SELECT id, v FROM {table}").fetchall())


async def test_a_repair_that_cannot_be_had_gives_way_to_a_full_bootstrap(
        cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path):
    table = random_name("unrepaired")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT g, 'v' || g FROM generate_series(1, 300) g")
    cdc_database.add_tables(pg_admin, table)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    db = tmp_path / "mirror.db"
    results: list[VerificationResult] = []
    lines: list[str] = []

    async def damaged_and_verified(key: int) -> str:
        with contextlib.closing(sqlite3.connect(db, timeout=30)) as local, local:
            local.execute(f'DELETE FROM "{table}" WHERE id = ?', (key,))
        verified = await verify_table(None, settings, table, bits=BITS)
        _, digest, _ = await digest_message(nats_client, verified)
        return digest["verification_id"]

    # the platform serves a table's repairs an hour apart: the second is refused for longer
    # than the mirror waits
    async with running_bridge(settings), snapshot_responder(settings, repair_interval=3600):
        await bridge_ready(pg_admin, cdc_database, settings, [table])
        mirror = Mirror(settings, [table], db, options=MirrorSettings(
            status_interval_seconds=1.0, snapshot_wait_seconds=30.0), report=lines.append,
            on_verification=lambda _, result: results.append(result))
        stop = asyncio.Event()
        running = asyncio.create_task(mirror.run(stop))
        await mirror_caught_up(mirror, running, nats_client)
        await damaged_and_verified(7)
        await wait_for(lambda: mirror.rows_repaired, timeout=60, what="the first repair")
        second = await damaged_and_verified(8)
        await wait_for(lambda: mirror.bootstraps == 2, timeout=60, what="a bootstrap again")
        await mirror_caught_up(mirror, running, nats_client)
        stop.set()
        await asyncio.wait_for(running, 30)
    assert {r.verification_id: r.status for r in results}[second] == "differ"
    assert sum(line.endswith("too soon); bootstrapping again") for line in lines) == 1, \
        "\n".join(lines)
    assert {key: v for key, (_, v) in _local_rows(db, table).items()} == dict(
        pg_admin.execute(f"SELECT id, v FROM {table}").fetchall())
    with contextlib.closing(sqlite3.connect(db)) as local:
        assert local.execute("SELECT count(*) FROM sqlite_master WHERE name LIKE "
                             "'_cdc_repair %'").fetchone() == (0,)


@pytest.mark.every_major
async def test_after_a_lost_slot_a_mirror_is_made_equal_by_verification_and_repair(
        server_dir, provisioned_nats, nats_client, tmp_path):
    server = start_logical_postgres(server_dir / "pg", unsafe_no_fsync=True)
    try:
        admin = psycopg.connect(server.superuser_conninfo(), autocommit=True)
        for setting in ("max_slot_wal_keep_size = '1MB'", "max_wal_size = '32MB'",
                        "min_wal_size = '32MB'"):
            admin.execute(f"ALTER SYSTEM SET {setting}")
        admin.execute("SELECT pg_reload_conf()")
        table, filler = random_name("resynced"), random_name("filler")
        admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        admin.execute(f"INSERT INTO {table} SELECT g, repeat('v', 40) || g "
                      f"FROM generate_series(1, {ROWS}) g")
        admin.execute(f"CREATE TABLE {filler} (id bigserial PRIMARY KEY, note text)")
        database = CdcDatabase(server=server, publication=random_name("pub"),
                               role=random_name("reader"), password=secret_for_test(),
                               slot=random_name("slot"))
        provision_database(admin, publication=database.publication, role=database.role,
                           tables=[table], role_password=database.password)
        settings = platform_settings(database, provisioned_nats.url, on_slot_lost="resync")
        db = tmp_path / "mirror.db"
        results: list[VerificationResult] = []
        lines: list[str] = []
        stop = asyncio.Event()
        async with snapshot_responder(settings):
            async with running_bridge(settings):
                await bridge_ready(admin, database, settings, [table])
                mirror = Mirror(settings, [table], db, options=FAST, report=lines.append,
                                on_verification=lambda _, result: results.append(result))
                running = asyncio.create_task(mirror.run(stop))
                await mirror_caught_up(mirror, running, nats_client)
            bootstrap_bytes = mirror.init_bytes
            # the bridge away: changes its lost slot takes with it
            admin.execute(f"UPDATE {table} SET v = 'lost' WHERE id <= 6")
            admin.execute(f"DELETE FROM {table} WHERE id BETWEEN 21 AND 23")
            admin.execute(f"INSERT INTO {table} SELECT g, 'lost' FROM generate_series("
                          f"{ROWS + 1}, {ROWS + 3}) g")
            lose_slot(admin, database.slot, filler)
            async with running_bridge(settings) as bridge:
                await wait_for(lambda: bridge.metrics.status()["slot_resyncs"] == 1,
                               timeout=60, what="the resync")
                # after the marker, changes of rows the mirror lacks or holds wrongly are
                # made to fit instead of bootstrapping the table again
                admin.execute(f"UPDATE {table} SET v = 'after' WHERE id IN (1, {ROWS + 1})")
                admin.execute(f"DELETE FROM {table} WHERE id = {ROWS + 2}")
                await bridge_caught_up(admin, database.slot)
                await mirror_caught_up(mirror, running, nats_client)
                assert mirror.resyncing == {table}, "\n".join(lines[-20:])
                source = dict(admin.execute(f"SELECT id, v FROM {table}").fetchall())
                held = {key: v for key, (_, v) in _local_rows(db, table).items()}
                wrong = {key for key in {*source, *held} if source.get(key) != held.get(key)}
                assert len(wrong) >= 9
                # the platform verifies every table after a resync (resync_sensor)
                repair_from = mirror.init_bytes
                verified = await verify_table(None, settings, table, bits=BITS)
                _, first, _ = await digest_message(nats_client, verified)
                await wait_for(lambda: mirror.rows_repaired, timeout=60, what="the repair")
                found = next(r for r in results
                             if r.verification_id == first["verification_id"])
                assert set(found.buckets_differing) == {_bucket(key) for key in wrong}
                repair_bytes = mirror.init_bytes - repair_from
                verified = await verify_table(None, settings, table, bits=BITS)
                _, second, _ = await digest_message(nats_client, verified)
                await wait_for(lambda: any(r.verification_id == second["verification_id"]
                                           for r in results), timeout=60,
                               what="the second verification met")
                again = next(r for r in results
                             if r.verification_id == second["verification_id"])
                assert again.status == "equal", "\n".join(lines[-20:])
                assert mirror.resyncing == set()
            stop.set()
            await asyncio.wait_for(running, 30)
        assert {key: v for key, (_, v) in _local_rows(db, table).items()} == dict(
            admin.execute(f"SELECT id, v FROM {table}").fetchall())
        assert not any("bootstrapping again" in line for line in lines), "\n".join(lines)
        # a repair of the buckets moves a small share of what a bootstrap did
        assert 0 < repair_bytes < bootstrap_bytes / 5, (repair_bytes, bootstrap_bytes)
        admin.close()
    finally:
        server.stop()
