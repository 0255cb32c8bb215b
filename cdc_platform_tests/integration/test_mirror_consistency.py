"""Consistency across tables: a reader of the mirror's file never sees a state the source never
had (a transfer between two tables never half there), through the first bootstrap and a
re-bootstrap of one table; and a table's re-bootstrap does not hold up the others."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sqlite3
import threading
import time

import msgpack
import psycopg

from cdc_platform.mirror.columns import TableShape, quote
from cdc_platform.mirror.consistency import shadow_name
from cdc_platform.mirror.follower import Mirror
from cdc_platform.mirror.positions import CONSISTENT_TABLE
from cdc_platform.mirror.status import status_lines
from cdc_platform.mirror.store import MirrorStore
from cdc_platform.replication.slots import read_slot
from cdc_platform.settings import MirrorSettings, NatsSettings, PlatformSettings
from cdc_platform_tests.exactness import (
    ACCOUNTS,
    BALANCE,
    InvariantReader,
    bridge_caught_up,
    mirror_caught_up,
    mirror_rows,
    mirror_statuses,
    reporter,
    source_rows,
)
from cdc_platform_tests.fixtures.bridge import running_bridge, wait_for
from cdc_platform_tests.fixtures.mirror_events import event, schema
from cdc_platform_tests.fixtures.responder import snapshot_responder
from cdc_platform_tests.fixtures.services import platform_settings, random_name

FAST = MirrorSettings(status_interval_seconds=1.0, snapshot_wait_seconds=120.0)


def _transfers(conninfo: str, tables: list[str], stop: threading.Event) -> None:
    """Moves money between the two tables, one transfer per transaction, until ``stop``."""
    rng = random.Random(23)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        while not stop.is_set():
            amount = rng.randint(1, 50)
            source, target = rng.sample(tables, 2)
            with conn.transaction():
                conn.execute(f"UPDATE {source} SET balance = balance - %s WHERE id = %s",
                             (amount, rng.randint(1, ACCOUNTS)))
                conn.execute(f"UPDATE {target} SET balance = balance + %s WHERE id = %s",
                             (amount, rng.randint(1, ACCOUNTS)))
            time.sleep(0.003)


async def test_a_reader_never_sees_a_transfer_half_done_through_bootstraps(
        cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path):
    """Two tables snapshotted at different points (the first bootstrap), then one of them
    bootstrapped again (a type change no ALTER follows) while transfers between them go on:
    a reader checking the sum never sees it broken, and both end equal to the source."""
    tables = [random_name("accounts_a"), random_name("accounts_b")]
    for table in tables:
        pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, balance int, tag int)")
        pg_admin.execute(f"INSERT INTO {table} SELECT g, {BALANCE}, 0 "
                         f"FROM generate_series(1, {ACCOUNTS}) g")
    cdc_database.add_tables(pg_admin, *tables)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    conninfo = cdc_database.server.superuser_conninfo()
    db = tmp_path / "mirror.db"
    lines: list[str] = []
    reader = InvariantReader(db, tables, 2 * ACCOUNTS * BALANCE)
    stop_transfers, stop_mirror = threading.Event(), asyncio.Event()
    async with running_bridge(settings), snapshot_responder(settings, max_age_seconds=0):
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
        transfers = asyncio.create_task(asyncio.to_thread(_transfers, conninfo, tables,
                                                          stop_transfers))
        reader.start()
        mirror = Mirror(settings, tables, db, options=FAST, report=reporter(lines))
        following = asyncio.create_task(mirror.run(stop_mirror))

        def streaming() -> bool:
            if following.done():
                following.result()
            with contextlib.closing(sqlite3.connect(db)) as local:
                statuses = mirror_statuses(local)
            return statuses == {table: "streaming" for table in tables}
        await wait_for(streaming, timeout=60, what="both tables streaming")
        # a type change the mirror cannot follow: that table is bootstrapped again
        pg_admin.execute(f"ALTER TABLE {tables[0]} ALTER COLUMN tag TYPE text")
        pg_admin.execute(f"UPDATE {tables[0]} SET tag = 'x' WHERE id = 1")
        await wait_for(lambda: mirror.bootstraps >= 3 and streaming(), timeout=60,
                       what="the table bootstrapped again and streaming")
        await asyncio.sleep(1.0)
        stop_transfers.set()
        await transfers
        await bridge_caught_up(pg_admin, cdc_database.slot)
        await mirror_caught_up(mirror, following, nats_client)
        reader.stop.set()
        reader.join()
        stop_mirror.set()
        await following
    assert reader.broken == [], (reader.broken[:10], lines)
    assert reader.checks > 100, reader.checks
    for table in tables:
        assert mirror_rows(db, table, ["id", "balance", "tag"]) == source_rows(
            conninfo, table, ["id", "balance", "tag"])
    with contextlib.closing(sqlite3.connect(db)) as local:
        recorded = local.execute(f"SELECT lsn FROM {CONSISTENT_TABLE}").fetchone()[0]
    assert recorded is not None
    assert status_lines(db)[-1] == f"consistent lsn (every streaming table): {recorded}"


async def test_other_tables_go_on_while_one_table_bootstraps_again(
        cdc_database, pg_admin, provisioned_nats, tmp_path):
    """While a large table waits for and loads a new snapshot, a small table's changes keep
    reaching the file within a second."""
    bulk, ticker = random_name("bulk"), random_name("ticker")
    pg_admin.execute(f"CREATE TABLE {bulk} (id int PRIMARY KEY, k int, v text)")
    pg_admin.execute(f"INSERT INTO {bulk} SELECT g, g, repeat('v', 200) || g "
                     "FROM generate_series(1, 600000) g")
    pg_admin.execute(f"CREATE TABLE {ticker} (id int PRIMARY KEY, n int)")
    pg_admin.execute(f"INSERT INTO {ticker} VALUES (1, 0)")
    cdc_database.add_tables(pg_admin, bulk, ticker)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    conninfo = cdc_database.server.superuser_conninfo()
    db = tmp_path / "mirror.db"
    lines: list[str] = []
    written: dict[int, float] = {}  # ticker value -> when it was committed
    stop_ticking, stop_mirror = threading.Event(), asyncio.Event()

    def tick() -> None:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            n = 0
            while not stop_ticking.is_set():
                n += 1
                conn.execute(f"UPDATE {ticker} SET n = %s WHERE id = 1", (n,))
                written[n] = time.monotonic()
                time.sleep(0.02)

    async with running_bridge(settings), snapshot_responder(settings, max_age_seconds=0):
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
        mirror = Mirror(settings, [bulk, ticker], db, options=FAST, report=reporter(lines))
        following = asyncio.create_task(mirror.run(stop_mirror))
        await wait_for(lambda: mirror.bootstraps >= 2 and mirror.position > 0, timeout=90,
                       what="both tables bootstrapped")
        ticking = asyncio.create_task(asyncio.to_thread(tick))
        await asyncio.sleep(1.0)
        # a row gone from the file: the next change of it makes the table bootstrap again
        with contextlib.closing(sqlite3.connect(db, timeout=30)) as tampering:
            tampering.execute(f"DELETE FROM {quote(bulk)} WHERE id = 1")
            tampering.commit()
        pg_admin.execute(f"UPDATE {bulk} SET k = -1 WHERE id = 1")
        worst = 0.0
        with contextlib.closing(sqlite3.connect(db)) as local:
            while mirror.bootstraps < 3 or mirror_statuses(local) != {bulk: "streaming",
                                                                ticker: "streaming"}:
                assert not following.done(), lines
                shown = local.execute(f"SELECT n FROM {quote(ticker)}").fetchone()[0]
                newer = written.get(shown + 1)  # the first change the file does not show
                if newer is not None:
                    worst = max(worst, time.monotonic() - newer)
                await asyncio.sleep(0.05)
        stop_ticking.set()
        await ticking
        stop_mirror.set()
        await following
    assert any(f"{bulk}: " in line and "bootstrapping again" in line for line in lines), lines
    assert worst < 1.0, f"the ticker lagged {worst:.2f}s while {bulk} bootstrapped again"
    with contextlib.closing(sqlite3.connect(db)) as local:
        assert local.execute(f"SELECT count(*), min(k) FROM {quote(bulk)}").fetchone() == (
            600_000, -1)


async def test_a_pass_that_starts_inside_a_transaction_a_table_already_holds_completes_it(
        provisioned_nats, nats_client, tmp_path):
    """A transaction changed ``a`` then ``b`` while the mirror followed only ``a``: ``a``
    committed it whole at ``a``'s event, its position in the middle of the transaction. Then
    ``b``'s shadow was loaded, and the next pass, from just after ``a``'s position, reads only
    ``b``'s part. ``a`` holds the transaction already: nothing of ``a``'s must be waited for,
    even when nothing else is ever written (before, the pass waited for it forever, the
    shadow never swapped in: the exactness suite's mirror hung at "0 events behind")."""
    a, b = random_name("held"), random_name("joining")
    settings = PlatformSettings(nats=NatsSettings(url=provisioned_nats.url))
    js = nats_client.jetstream()
    kv = await js.key_value("schemas")
    for table in (a, b):
        await kv.put(table, json.dumps(schema(table)).encode())
    first = event("UPDATE", "0/200", 0, table=a, data={"id": 1, "name": "5"},
                  tx_tables={a: 1, b: 1})
    second = event("UPDATE", "0/200", 1, table=b, data={"id": 1, "name": "15"},
                   tx_tables={a: 1, b: 1})
    db = tmp_path / "mirror.db"
    store = MirrorStore(db)
    try:
        store.begin_bootstrap(TableShape.from_schema(schema(a)), "snap-a", 0x100)
        store.load_rows(a, [{"id": 1, "name": "10"}])
        store.finish_bootstrap(a, stream_seq=0)
        a_seq = (await js.publish(f"cdc.{a}.update", msgpack.packb(first), stream="CDC")).seq
        store.begin()  # what a pass following only ``a`` committed
        store.apply(first)
        store.commit(a_seq, [a])
        await js.publish(f"cdc.{b}.update", msgpack.packb(second), stream="CDC")
        # b's snapshot came after the transaction (it holds its change)
        shadow = shadow_name(b)
        store.begin_bootstrap(TableShape.from_schema(schema(shadow)), "snap-b", 0x300)
        store.load_rows(shadow, [{"id": 1, "name": "15"}])
        store.finish_bootstrap(shadow, stream_seq=(await js.stream_info("CDC")).state.last_seq)
    finally:
        store.close()
    lines: list[str] = []
    mirror = Mirror(settings, [a, b], db, options=FAST, report=lines.append)
    try:
        await asyncio.wait_for(mirror.run(until_caught_up=True), 30)
    except TimeoutError:
        raise AssertionError(f"the mirror never caught up: {lines[-2:]}") from None
    assert not mirror.bootstrapping, lines
    with contextlib.closing(sqlite3.connect(db)) as local:
        assert mirror_statuses(local) == {a: "streaming", b: "streaming"}
        assert [local.execute(f"SELECT id, name FROM {quote(table)}").fetchall()
                for table in (a, b)] == [[(1, "5")], [(1, "15")]]


async def test_a_change_of_another_table_proves_where_idle_tables_meet(
        cdc_database, pg_admin, provisioned_nats, tmp_path):
    """Two tables nobody writes, snapshotted at different points: the stream's last message,
    a change of a table the mirror does not follow, shows that both are at its LSN, so the
    second is swapped in with a known consistent LSN instead of after the idle wait."""
    tables = [random_name("idle_a"), random_name("idle_b")]
    other = random_name("elsewhere")
    for table in [*tables, other]:
        pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v int)")
        pg_admin.execute(f"INSERT INTO {table} SELECT g, g FROM generate_series(1, 100) g")
    cdc_database.add_tables(pg_admin, *tables, other)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    db = tmp_path / "mirror.db"
    lines: list[str] = []
    async with running_bridge(settings), snapshot_responder(settings, max_age_seconds=0):
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
        mirror = Mirror(settings, tables, db, options=FAST, report=reporter(lines))
        following = asyncio.create_task(mirror.run(until_caught_up=True))

        def both_loaded() -> bool:
            if following.done():
                following.result()
            with contextlib.closing(sqlite3.connect(db)) as local:
                return mirror.bootstraps == 2 and len(mirror_statuses(local)) == 2
        await wait_for(both_loaded, timeout=60, interval=0.02, what="both snapshots loaded")
        pg_admin.execute(f"UPDATE {other} SET v = 0 WHERE id = 1")
        await asyncio.wait_for(following, 60)
    assert not any("not known" in line for line in lines), lines
    with contextlib.closing(sqlite3.connect(db)) as local:
        assert local.execute(f"SELECT lsn FROM {CONSISTENT_TABLE}").fetchone()[0] is not None
    conninfo = cdc_database.server.superuser_conninfo()
    for table in tables:
        assert mirror_rows(db, table, ["id", "v"]) == source_rows(conninfo, table, ["id", "v"])
