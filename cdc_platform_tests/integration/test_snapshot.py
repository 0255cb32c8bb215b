"""INIT snapshots end to end: real PostgreSQL, nats-server and local Spark (``local[2,2]``)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import math
import random
import time
import uuid
from collections import Counter
from decimal import Decimal

import msgpack
import nats.errors
import psycopg
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from cdc_platform.bridge.runner import CdcBridge
from cdc_platform.consumer.snapshots import fetch_dictionary
from cdc_platform.errors import SnapshotRequestRefused
from cdc_platform.lsn import parse_lsn
from cdc_platform.replication.slots import read_slot
from cdc_platform.snapshot import SnapshotOptions, snapshot_table
from cdc_platform.snapshot.reader import TaskFault
from cdc_platform.snapshot.tasks import JOB_GROUP_PREFIX
from cdc_platform.wire import decode_payload, encode_json, snapshot_meta_subject
from cdc_platform_tests.fixtures.services import SMALL_MAX_PAYLOAD, platform_settings, random_name
from cdc_platform_tests.fixtures.snapshots import (
    NO_BRIDGE,
    TYPES_COLUMNS,
    Writer,
    apply_event,
    chunk_messages,
    create_types_table,
    decoded_chunks,
    direct_rows,
    settings_for,
    snapshot_data,
)

# also on the newest PostgreSQL (docs/development.md "Tests": make test's second pass)
pytestmark = [pytest.mark.spark, pytest.mark.every_major]
SPARK = SnapshotOptions(small_table_bytes=0)


# -- helpers -----------------------------------------------------------------------------------
async def meta_of(client, result, fmt="msgpack"):
    js = client.jetstream()
    message = await js.get_last_msg("INIT", snapshot_meta_subject(result.table))
    return decode_payload(message.data, fmt)


def by_key(rows, key="id"):
    """``{key: packed row}``: msgpack bytes compare NaN equal to NaN, -0.0 unequal to 0.0,
    int unequal to float, and key order, at C speed."""
    keyed = {row[key]: _pack(row) for row in rows}
    assert len(keyed) == len(rows), "duplicate keys"
    return keyed


_pack = msgpack.Packer(use_bin_type=True, datetime=False).pack


@pytest.fixture(scope="module")
def module_admin(postgres_server):
    with psycopg.connect(postgres_server.superuser_conninfo(), autocommit=True) as conn:
        yield conn


@pytest.fixture(scope="module")
def types_table(module_admin):
    name = random_name("types")
    create_types_table(module_admin, name, 200_000)
    return name


@pytest.fixture(scope="module")
def small_types_table(module_admin):
    name = random_name("types_small")
    create_types_table(module_admin, name, 20_000)
    return name


# -- tests ---------------------------------------------------------------------------------------
async def test_200k_rows_of_every_type_round_trip_exactly(types_table, cdc_database, pg_admin,
                                                          provisioned_nats, nats_client,
                                                          spark_session):
    cdc_database.add_tables(pg_admin, types_table)
    cdc_database.create_slot(pg_admin)  # a stopped bridge's: no bridge runs here
    settings = settings_for(cdc_database, provisioned_nats.url)
    result = await snapshot_table(spark_session, settings, types_table, options=NO_BRIDGE)
    assert result.row_count == 200_000
    assert result.partitions >= 4  # 2 cores x 2
    chunks = await decoded_chunks(nats_client, result)
    assert all(len(c["data"]) <= 10_000 for c in chunks)
    first = chunks[0]
    assert {k: first[k] for k in ("table", "operation", "snapshot_id", "lsn",
                                  "schema_fingerprint")} == {
        "table": types_table, "operation": "snapshot", "snapshot_id": result.snapshot_id,
        "lsn": result.lsn, "schema_fingerprint": result.schema_fingerprint}
    rows = [row for chunk in chunks for row in chunk["data"]]
    assert list(rows[0]) == TYPES_COLUMNS  # every published column, in order

    direct = direct_rows(cdc_database.server.superuser_conninfo(), types_table, TYPES_COLUMNS)
    assert by_key(rows) == by_key(direct)

    # and against Python values computed independently of the converters
    got = {row["id"]: row for row in rows}
    row = got[2]  # i % 10 == 2, i % 50 == 2, i % 40 == 2
    assert row["txt"] == "tab\there\nnew line\\back\\slash\r"
    assert row["f8"] == float("-inf") and row["f4"] == float("-inf")
    assert row["num"] is None and row["flag"] is True
    assert math.isnan(got[50]["f8"]) and math.isnan(got[50]["f4"]) and got[51]["f8"] == math.inf
    assert got[53]["f8"] == 0.0 and math.copysign(1, got[53]["f8"]) == -1.0
    assert got[54]["f8"] == 1e-300
    assert got[40]["num"] == "NaN" and got[41]["num"] == "123456789012345678901234567890.5"
    assert Decimal(got[7]["num"]) == (Decimal(7) / 7).quantize(Decimal("1e-20"))
    assert got[11]["txt"] == "" and got[10]["txt"] is None  # empty string is not NULL
    assert got[14]["txt"] == "\\N"  # a string that looks like COPY's NULL marker
    assert got[13]["txt"] == "unicode ünï ✓ 😀"
    assert got[15]["txt"] == "quote ' and \"double\""
    assert got[7]["u"] == str(uuid.UUID(hex=hashlib.md5(b"7").hexdigest()))
    assert json.loads(got[7]["j"]) == {"i": 7, "nested": [1, "two", None, True]}
    assert got[9]["j"] is None
    assert got[7]["jb"] == '{"f": 1.5, "k": 7, "s": "line\\nbreak", "big": 12345678901234567890}'
    assert json.loads(got[7]["jb"])["big"] == 12345678901234567890
    assert got[7]["arr_i"] == [7, None, -7]
    assert got[7]["arr_t"] == ["a,b", 'quote"d', None, "NULL", "back\\slash", "", "{brace}", "ü"]
    assert got[6]["arr_t"] == []
    assert got[7]["d"] == "2000-01-08" and got[100]["d"] == "infinity"
    assert got[101]["d"] == "-0043-03-15"
    assert got[7]["tz"] == "2020-01-01T00:00:07.000007Z" and got[100]["tz"] == "-infinity"
    assert got[7]["ts"] == "2021-06-01T12:07:00"
    assert got[7]["tm"] == "00:00:07.123456" and got[7]["ttz"] == "13:45:28+02:00"
    assert got[7]["iv"] == "P1Y7M7DT7H7.5S"
    assert got[7]["by"] == bytes.fromhex(hashlib.md5(b"7").hexdigest()) + \
        b"\x00\\\n\t"
    assert got[5]["by"] is None and got[6]["by"] == b""
    assert got[7]["ip"] == "2001:db8::7" and got[8]["ip"] == "10.0.0.8/24"
    assert got[7]["mood"] == "ok" and got[4]["ch"] == "ab   "  # bpchar keeps its padding
    assert got[17]["i4"] is None and got[18]["i4"] == 18 * 7 - 1_000_000

    meta = await meta_of(nats_client, result)
    assert meta["snapshot_id"] == result.snapshot_id and meta["table"] == types_table
    assert meta["row_count"] == 200_000 and meta["batch_count"] == len(chunks)
    assert meta["lsn"] == result.lsn and parse_lsn(meta["watermark_lsn"]) < parse_lsn(meta["lsn"])
    assert meta["cdc_stream"] == "CDC"
    assert meta["watermark_subject"] == f"cdc.cdc-platform.watermark.{result.snapshot_id}"
    assert meta["cdc_start_seq"] is None  # no bridge ran for this test's slot
    assert meta["compression"] is None and meta["format"] == "msgpack"
    assert sum(count for _, _, count in meta["chunks"]) == meta["batch_count"]
    assert meta["partitions"] == result.partitions
    assert "commit_lsn >= " + result.lsn in meta["cutover_rule"]
    # the temporary slot is gone with its connection
    assert pg_admin.execute("SELECT count(*) FROM pg_replication_slots "
                            "WHERE slot_name LIKE 'cdc_snap_%'").fetchone()[0] == 0


async def test_zstd_with_dictionary_round_trips(small_types_table, cdc_database, pg_admin,
                                                provisioned_nats, nats_client, spark_session):
    cdc_database.add_tables(pg_admin, small_types_table)
    cdc_database.create_slot(pg_admin)  # a stopped bridge's: no bridge runs here
    settings = settings_for(cdc_database, provisioned_nats.url, format="json", zstd=True,
                            chunk_rows=2_000)
    result = await snapshot_table(spark_session, settings, small_types_table, options=NO_BRIDGE)
    assert result.compression == "zstd" and result.dictionary_id is not None
    assert result.bytes_compressed < result.bytes_raw / 3
    # measured on sample chunks; for chunks this large a dictionary gains little (see
    # benchmarks/snapshot.py), so only check that both were reported
    assert 0 < result.sample_ratio_with_dictionary < 0.5
    assert 0 < result.sample_ratio_without_dictionary < 0.5
    messages = await chunk_messages(nats_client, result)
    assert {m.headers["Cdc-Zstd-Dict"] for m in messages} == {str(result.dictionary_id)}
    assert {m.headers["Content-Encoding"] for m in messages} == {"zstd"}
    rows = await snapshot_data(nats_client, result, "json")
    direct = direct_rows(cdc_database.server.superuser_conninfo(), small_types_table,
                         TYPES_COLUMNS)
    # JSON: bytes as base64, non-finite floats as the strings PostgreSQL prints
    assert by_key(rows) == by_key(json.loads(encode_json(direct)))
    got = {row["id"]: row for row in rows}
    assert base64.b64decode(got[7]["by"]) == bytes.fromhex(hashlib.md5(b"7").hexdigest()) + \
        b"\x00\\\n\t"
    assert got[50]["f8"] == "NaN" and got[51]["f8"] == "Infinity"
    dictionary = await fetch_dictionary(nats_client.jetstream(), small_types_table,
                                        result.dictionary_id)
    assert dictionary[:4] == b"\x37\xa4\x30\xec"  # zstd dictionary magic
    meta = await meta_of(nats_client, result, "json")
    assert meta["dictionary_id"] == result.dictionary_id
    assert meta["dictionary_key"] == f"{small_types_table}.{result.dictionary_id}"
    assert meta["compression"] == "zstd"


async def test_unpublished_or_missing_table_is_refused_before_any_spark_job(
        cdc_database, pg_admin, provisioned_nats, nats_client, spark_session):
    unpublished = random_name("secret")
    pg_admin.execute(f"CREATE TABLE {unpublished} (id int PRIMARY KEY)")
    settings = settings_for(cdc_database, provisioned_nats.url)
    tracker = spark_session.sparkContext.statusTracker()
    for table, reason in ((unpublished, "is not in publication"),
                          (random_name("missing"), "does not exist"),
                          ("bad.name", "not a valid table name")):
        snapshot_id = random_name("refused").replace("_", "-")
        with pytest.raises(SnapshotRequestRefused, match=reason):
            await snapshot_table(spark_session, settings, table, snapshot_id=snapshot_id,
                                 options=SPARK)
        assert tracker.getJobIdsForGroup(f"{JOB_GROUP_PREFIX}{snapshot_id}") == []
        js = nats_client.jetstream()
        with pytest.raises(NotFoundError):  # no watermark was emitted, nothing was published
            await js.get_last_msg("INIT", snapshot_meta_subject(table))
    assert pg_admin.execute("SELECT count(*) FROM pg_replication_slots "
                            "WHERE slot_name LIKE 'cdc_snap_%'").fetchone()[0] == 0


async def test_table_without_primary_key(cdc_database, pg_admin, provisioned_nats, nats_client,
                                         spark_session):
    table = random_name("nokey")
    pg_admin.execute(f"CREATE TABLE {table} (a int, b text)")
    # duplicates included: only a multiset comparison is meaningful
    pg_admin.execute(f"INSERT INTO {table} SELECT i % 1000, 'v' || (i % 7) "
                     "FROM generate_series(1, 30000) i")
    pg_admin.execute(f"DELETE FROM {table} WHERE a = 5")  # holes in the heap
    cdc_database.add_tables(pg_admin, table)
    cdc_database.create_slot(pg_admin)  # a stopped bridge's: no bridge runs here
    settings = settings_for(cdc_database, provisioned_nats.url, chunk_rows=3_000)
    result = await snapshot_table(spark_session, settings, table, options=NO_BRIDGE)
    rows = await snapshot_data(nats_client, result)
    assert result.row_count == len(rows) == 29_970
    assert Counter((r["a"], r["b"]) for r in rows) == Counter(
        tuple(r) for r in pg_admin.execute(f"SELECT a, b FROM {table}").fetchall())
    assert all(set(r) == {"a", "b"} for r in rows)  # the ctid used for errors is not sent


async def test_empty_table_gets_a_meta_with_no_chunks(cdc_database, pg_admin, provisioned_nats,
                                                     nats_client, spark_session):
    table = random_name("empty")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    cdc_database.add_tables(pg_admin, table)
    cdc_database.create_slot(pg_admin)  # a stopped bridge's: no bridge runs here
    settings = settings_for(cdc_database, provisioned_nats.url, zstd=True)  # no sample: no dict
    result = await snapshot_table(spark_session, settings, table, options=NO_BRIDGE)
    assert (result.row_count, result.batch_count, result.partitions) == (0, 0, 1)
    assert result.dictionary_id is None
    meta = await meta_of(nats_client, result)
    assert (meta["row_count"], meta["batch_count"], meta["chunks"]) == (0, 0, [])


async def test_chunks_fit_max_payload_and_an_oversized_row_is_a_claim_check(
        cdc_database, pg_admin, small_nats, spark_session):
    server, client = small_nats
    assert client.max_payload == SMALL_MAX_PAYLOAD
    table = random_name("wide")
    nokey = random_name("wide_nokey")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, body text)")
    pg_admin.execute(f"CREATE TABLE {nokey} (body text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT i, repeat(md5(i::text), 30) "
                     "FROM generate_series(1, 3000) i")  # ~1 KB rows: 64 KB cuts, not 10K
    cdc_database.add_tables(pg_admin, table, nokey)
    cdc_database.create_slot(pg_admin)  # a stopped bridge's: no bridge runs here
    settings = settings_for(cdc_database, server.url)
    result = await snapshot_table(spark_session, settings, table, options=NO_BRIDGE)
    messages = await chunk_messages(client, result)
    assert result.batch_count >= 3000 * 1000 // SMALL_MAX_PAYLOAD
    assert max(len(m.data) for m in messages) <= SMALL_MAX_PAYLOAD
    rows = await snapshot_data(client, result)
    assert sorted(r["id"] for r in rows) == list(range(1, 3001))

    # one random (incompressible) row of 100 KB
    big = "".join(random.choice("abcdefghijklmnopqrstuvwxyz0123456789")
                  for _ in range(100_000))
    # flows as a claim check (docs/wire-contract.md "Large values"), compressed or not
    pg_admin.execute(f"INSERT INTO {table} VALUES (4242, %s)", (big,))
    zstd = settings_for(cdc_database, server.url, zstd=True, zstd_dictionary=False)
    for flavour in (settings, zstd):
        result = await snapshot_table(spark_session, flavour, table, options=NO_BRIDGE)
        messages = await chunk_messages(client, result)
        claimed = [m for m in messages if "Cdc-Claim-Check" in m.headers]
        assert len(claimed) == 1 and max(len(m.data) for m in messages) <= SMALL_MAX_PAYLOAD
        rows = {r["id"]: r for r in await snapshot_data(client, result)}
        assert len(rows) == 3001 and rows[4242]["body"] == big
    pg_admin.execute(f"INSERT INTO {nokey} VALUES ('small'), (%s)", (big,))
    result = await snapshot_table(spark_session, settings, nokey, options=NO_BRIDGE)
    assert sorted(r["body"] for r in await snapshot_data(client, result)) == sorted(
        ["small", big])


async def test_retried_task_does_not_duplicate_chunks(cdc_database, pg_admin, provisioned_nats,
                                                      nats_client, spark_session):
    table = random_name("retry")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT i, md5(i::text) "
                     "FROM generate_series(1, 40000) i")
    cdc_database.add_tables(pg_admin, table)
    cdc_database.create_slot(pg_admin)  # a stopped bridge's: no bridge runs here
    settings = settings_for(cdc_database, provisioned_nats.url, chunk_rows=1_000)
    result = await snapshot_table(spark_session, settings, table, options=NO_BRIDGE,
                                  fault=TaskFault(partition=0, after_chunks=3))
    first = result.ranges[0]
    assert first.attempt == 1  # the second attempt succeeded
    assert first.duplicates >= 3  # what the first attempt had stored was dropped as duplicates
    assert all(r.attempt == 0 and r.duplicates == 0 for r in result.ranges[1:])
    rows = await snapshot_data(nats_client, result)  # checks count and unique chunk numbers
    assert sorted(r["id"] for r in rows) == list(range(1, 40001))
    info = await nats_client.jetstream().stream_info(
        "INIT", subjects_filter=f"{result.chunk_subject_prefix}>")
    assert sum(info.state.subjects.values()) == result.batch_count


# -- concurrent writes and the cutover ---------------------------------------------------------
async def cdc_events(client, table, start_seq):
    """The table's CDC events from ``start_seq`` (None: from the start) up to the final
    change with id 0 that the test writes last."""
    config = ConsumerConfig(ack_policy=AckPolicy.NONE)
    if start_seq is not None:
        config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
        config.opt_start_seq = start_seq
    subscription = await client.jetstream().pull_subscribe(f"cdc.{table}.>", stream="CDC",
                                                           config=config)
    events = []
    deadline = time.monotonic() + 60
    try:
        while not any(e["data"] and e["data"]["id"] == 0 for e in events[-50:]):
            assert time.monotonic() < deadline, "CDC did not catch up within 60 s"
            with contextlib.suppress(nats.errors.TimeoutError):
                batch = await subscription.fetch(1000, timeout=1.0)
                events += [decode_payload(m.data, "msgpack") for m in batch
                           if not m.subject.endswith(".schema")]
    finally:
        await subscription.unsubscribe()
    return events


def cutover(table_rows, events, snapshot_lsn):
    """The documented rule: apply exactly the events with commit_lsn >= the snapshot lsn."""
    applied = skipped = 0
    for event in events:
        if parse_lsn(event["commit_lsn"]) >= snapshot_lsn:
            apply_event(table_rows, event)
            applied += 1
        else:
            skipped += 1
    return applied, skipped


async def test_concurrent_writes_and_the_cutover_rule_rebuild_the_table(
        cdc_database, pg_admin, provisioned_nats, nats_client, spark_session):
    table = random_name("live")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v int, txt text, "
                     "at timestamptz, tags text[])")
    pg_admin.execute(f"INSERT INTO {table} SELECT i, i % 100, 'r' || i, now(), ARRAY['a'] "
                     "FROM generate_series(1, 100000) i")
    cdc_database.add_tables(pg_admin, table)
    settings = settings_for(cdc_database, provisioned_nats.url)
    bridge = CdcBridge(settings)
    bridge_task = asyncio.create_task(bridge.run())
    writer = Writer(cdc_database.server.superuser_conninfo(), table, 100_001)
    try:
        for _ in range(300):
            if read_slot(pg_admin, cdc_database.slot) is not None:
                break
            await asyncio.sleep(0.1)
        writer.start()
        await asyncio.sleep(0.5)  # writes before the watermark too
        result = await snapshot_table(spark_session, settings, table, options=SPARK)
        await asyncio.sleep(0.5)  # and after the snapshot
        writer.stop.set()
        await asyncio.to_thread(writer.join, 10)
        assert writer.error is None, writer.error
        # a last change, so we know when CDC has caught up
        pg_admin.execute(f"INSERT INTO {table} VALUES (0, 0, 'end', now(), NULL)")
        end_lsn = parse_lsn(pg_admin.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
        assert result.cdc_start_seq is not None, "the bridge published the watermark marker"

        events = await cdc_events(nats_client, table, result.cdc_start_seq)
        # "any earlier sequence is also correct": from the very start of the stream
        all_events = await cdc_events(nats_client, table, None)
    finally:
        writer.stop.set()
        bridge.request_stop()
        await asyncio.wait_for(bridge_task, 60)

    snapshot_rows = await snapshot_data(nats_client, result)
    source = by_key(direct_rows(cdc_database.server.superuser_conninfo(), table,
                                ["id", "v", "txt", "at", "tags"]))
    counts = []
    for stream_events in (events, all_events):
        rebuilt = {row["id"]: row for row in snapshot_rows}
        counts.append(cutover(rebuilt, stream_events, parse_lsn(result.lsn)))
        assert by_key(list(rebuilt.values())) == source
    (applied, skipped), _ = counts
    assert len(all_events) > len(events)  # writes before the watermark were skipped too
    assert writer.transactions > 50 and applied > 20
    assert end_lsn > parse_lsn(result.lsn)
    print(f"cutover: {writer.transactions} writer transactions, {len(events)} events from the "
          f"marker on: {applied} applied, {skipped} skipped (already in the snapshot)")


async def test_a_small_table_is_read_without_spark_and_equals_the_spark_read(
        small_types_table, cdc_database, pg_admin, provisioned_nats, nats_client):
    """Below small_table_bytes the same range tasks run in this process: no Spark session is
    created (the factory is never called) and the rows are the same."""
    cdc_database.add_tables(pg_admin, small_types_table)
    cdc_database.create_slot(pg_admin)  # a stopped bridge's: no bridge runs here
    settings = settings_for(cdc_database, provisioned_nats.url)

    def no_spark():
        raise AssertionError("a small table must not start Spark")

    options = SnapshotOptions(watermark_wait_seconds=0.2)  # the default small_table_bytes
    result = await snapshot_table(no_spark, settings, small_types_table, options=options)
    assert result.row_count == 20_000
    rows = await snapshot_data(nats_client, result)
    direct = direct_rows(cdc_database.server.superuser_conninfo(), small_types_table,
                         TYPES_COLUMNS)
    assert by_key(rows) == by_key(direct)


async def test_a_cancelled_snapshot_read_here_stops_reading_and_publishing(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    """A snapshot of a small table (its range tasks in threads of this process) cancelled in
    the middle: once the cancellation is through, its tasks have stopped. No COPY of the
    table runs, and no more chunks of it are stored than the tasks had under way (before,
    each task read and published its range to the end)."""
    table = random_name("cancelled")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, body text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT g, repeat('x', 200) "
                     f"FROM generate_series(1, 400000) g")  # (~100 MB: seconds to read)
    cdc_database.add_tables(pg_admin, table)
    cdc_database.create_slot(pg_admin)  # a stopped bridge's: no bridge runs here
    settings = settings_for(cdc_database, provisioned_nats.url)
    js = nats_client.jetstream()

    async def chunks_stored() -> int:
        info = await js.stream_info("INIT", subjects_filter=f"init.snap.{table}.>")
        return sum((info.state.subjects or {}).values())

    def copying() -> int:
        return pg_admin.execute("SELECT count(*) FROM pg_stat_activity WHERE query LIKE %s",
                                (f"COPY %{table}%",)).fetchone()[0]

    def no_spark():
        raise AssertionError("a small table must not start Spark")

    snapshot = asyncio.create_task(snapshot_table(
        no_spark, settings, table, options=SnapshotOptions(
            watermark_wait_seconds=0.2, small_table_bytes=256 << 20)))  # (read here)
    for _ in range(600):
        if await chunks_stored() or snapshot.done():
            break
        await asyncio.sleep(0.02)
    if snapshot.done():
        snapshot.result()  # (its error, if it ended with one)
    assert copying() > 0, "the snapshot ended before it could be cancelled"
    at_cancel = await chunks_stored()
    snapshot.cancel()
    with pytest.raises(asyncio.CancelledError):
        await snapshot
    deadline = time.monotonic() + 2  # (a backend exits once it sees its socket closed)
    while copying() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert copying() == 0, "a COPY of the table still runs 2 s after the cancellation"
    await asyncio.sleep(0.5)  # (what the tasks published before they stopped is stored)
    stored = await chunks_stored()
    await asyncio.sleep(1.5)
    assert await chunks_stored() == stored
    # at most what each task had in flight (its publish window) and its block's chunk; before,
    # the tasks published the rest of their ranges: 45 more chunks, against 1 now
    options = SnapshotOptions()
    assert stored - at_cancel <= options.local_parallelism * (options.publish_window + 1)


async def test_a_snapshot_gives_way_to_ddl_its_export_waits_for(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    """A transaction that already wrote runs ALTER TABLE on the table while the snapshot holds
    its guard lock and creates its exporting slot. The slot waits for every transaction
    running (the ALTER's too), the ALTER for the guard: the snapshot gives way and is taken
    again once the DDL is through (before, both waited forever: the schema-change exactness
    suite hung on PostgreSQL 18 with a mirror "waiting for the snapshot")."""
    table = random_name("ddlwait")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT g, 'v' FROM generate_series(1, 10) g")
    cdc_database.add_tables(pg_admin, table)
    cdc_database.create_slot(pg_admin)  # a stopped bridge's: no bridge runs here
    settings = platform_settings(cdc_database, provisioned_nats.url)
    with psycopg.connect(cdc_database.server.superuser_conninfo()) as migration:
        migration.execute(f"UPDATE {table} SET v = 'w' WHERE id = 1")  # (it has an xid)
        snapshot = asyncio.create_task(snapshot_table(
            None, settings, table, options=SnapshotOptions(watermark_wait_seconds=0.2)))

        def exporting_waits() -> bool:
            return pg_admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'walsender' AND "
                "application_name = 'cdc_platform_snapshot' AND wait_event_type = 'Lock'"
            ).fetchone()[0] > 0
        for _ in range(200):
            if exporting_waits() or snapshot.done():
                break
            await asyncio.sleep(0.05)
        assert exporting_waits()

        def alter() -> None:
            migration.execute(f"ALTER TABLE {table} ADD COLUMN w int DEFAULT 7")
            migration.commit()
        altering = asyncio.create_task(asyncio.to_thread(alter))
        try:
            result = await asyncio.wait_for(asyncio.shield(snapshot), 60)
        finally:
            snapshot.cancel()
            with contextlib.suppress(BaseException):
                await snapshot
            await altering
    assert result.snapshot_id.endswith("-r1")  # the second attempt, after the DDL
    rows = sorted((r["id"], r["v"], r["w"]) for r in await snapshot_data(nats_client, result))
    assert rows == [(1, "w", 7), *((i, "v", 7) for i in range(2, 11))]
