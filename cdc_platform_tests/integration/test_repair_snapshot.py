"""Repair snapshots (docs/verification.md Part 2, item 4): the snapshot job keeping the rows of
some buckets only, against real PostgreSQL, nats-server, the bridge and local Spark. The rows
a repair publishes are exactly the table's rows (read directly, bucketed in Python by the
digest) in those buckets, for keys PostgreSQL hashes and keys the tasks hash; its meta is on
``init.repair.{table}`` and never touches ``init.meta.{table}``."""

from __future__ import annotations

import asyncio
import os
from collections import Counter

import msgpack
import psycopg
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from cdc_platform.consumer.requests import SnapshotRequester
from cdc_platform.consumer.snapshots import (
    SnapshotMeta,
    SnapshotUnusable,
    latest_repair_meta,
    meta_at,
    repair_meta_at,
    repair_refusal,
)
from cdc_platform.errors import SnapshotError, SnapshotRequestRefused
from cdc_platform.lsn import parse_lsn
from cdc_platform.mirror.snapshots import read_chunks
from cdc_platform.replication.connection import SESSION_OPTIONS
from cdc_platform.settings import BridgeSettings
from cdc_platform.snapshot import SnapshotOptions, snapshot_table
from cdc_platform.snapshot.buckets import BucketSelection
from cdc_platform.snapshot.requests import done_fields
from cdc_platform.snapshot.source import describe_table
from cdc_platform.wire import (
    MessageSigner,
    SignatureVerifier,
    decode_payload,
    repair_meta_subject,
    snapshot_meta_subject,
)
from cdc_platform.wire.digest import RowDigester, bucket_of
from cdc_platform.wire.signing import new_seed
from cdc_platform_tests.fixtures.bridge import (
    bridge_ready,
    flat_events,
    running_bridge,
    slot_confirmed,
    wait_for,
)
from cdc_platform_tests.fixtures.responder import snapshot_responder
from cdc_platform_tests.fixtures.services import random_name
from cdc_platform_tests.fixtures.snapshots import NO_BRIDGE, direct_rows, settings_for

pytestmark = pytest.mark.every_major  # key hashing in SQL is PostgreSQL behaviour

IN_PROCESS = SnapshotOptions(watermark_wait_seconds=0.2)  # no bridge; small tables: no Spark
BITS, BUCKETS = 5, (0, 7, 19, 31)

# name -> (columns with types, primary key, INSERT ... SELECT of ~3,000 rows from n)
TABLES = {
    "int8": ("id int8, note text", ["id"],
             "SELECT n * 7919 - 11000000, 'row ' || n FROM generate_series(1, 3000) n"),
    "text_uuid": ("name text, u uuid, n int", ["name", "u"],
                  ("SELECT 'clé ' || (n % 50) || repeat('✓', n % 3), md5(n::text)::uuid, n "
                   "FROM generate_series(1, 3000) n")),
    "timestamptz": ("at timestamptz, v int", ["at"],
                    ("SELECT CASE n WHEN 1 THEN 'infinity'::timestamptz "
                     "WHEN 2 THEN '0044-03-15 12:00 BC' ELSE timestamptz '2020-01-01 00:00+00' "
                     "+ n * interval '1.000001 second' END, n FROM generate_series(1, 3000) n")),
    # duplicates and NULLs: the key is every column, a NULL column absent from it
    "nokey": ("a int, b text", [],
              ("SELECT n % 1000, CASE WHEN n % 7 = 0 THEN NULL ELSE 'v' || (n % 5) END "
               "FROM generate_series(1, 3000) n")),
}
SELECTED_BY_SQL = {"int8": True, "text_uuid": True, "timestamptz": False, "nokey": False}

_pack = msgpack.Packer(use_bin_type=True, datetime=False).pack


def _create(pg_admin, cdc_database, kind: str) -> tuple[str, list[str], list[str]]:
    """A table of ``kind`` (TABLES), published: (name, columns, primary key)."""
    table = random_name(f"repair_{kind}")
    columns, key, rows = TABLES[kind]
    primary = f", PRIMARY KEY ({', '.join(key)})" if key else ""
    pg_admin.execute(f"CREATE TABLE {table} ({columns}{primary})")
    pg_admin.execute(f"INSERT INTO {table} {rows}")
    cdc_database.add_tables(pg_admin, table)
    names = [column.split()[0] for column in columns.split(", ")]
    return table, names, key


def in_buckets(rows, columns, key, bits=BITS, buckets=BUCKETS):
    """The rows whose key hash (the digest's) falls in ``buckets``, as a multiset."""
    digester = RowDigester(columns, key)
    return Counter(_pack(row) for row in rows
                   if bucket_of(digester.key_hash(row), bits) in buckets)


async def loaded_rows(client, meta_payload) -> Counter:
    """The repair's rows as a consumer loads them (the mirror's chunk reader)."""
    rows: Counter = Counter()
    async for chunk in read_chunks(client.jetstream(), SnapshotMeta.from_wire(meta_payload)):
        rows.update(_pack(row) for row in chunk.rows)
    return rows


async def repair_meta(client, table):
    message = await client.jetstream().get_last_msg("INIT", repair_meta_subject(table))
    return message.seq, decode_payload(message.data, "msgpack")


@pytest.mark.parametrize("kind", sorted(TABLES))
async def test_a_repair_snapshot_holds_exactly_the_rows_of_its_buckets(
        kind, cdc_database, pg_admin, provisioned_nats, nats_client):
    table, columns, key = _create(pg_admin, cdc_database, kind)
    cdc_database.create_slot(pg_admin)  # a stopped bridge's: no bridge runs here
    with psycopg.connect(cdc_database.server.superuser_conninfo(), autocommit=True,
                         options=SESSION_OPTIONS) as session:
        schema = describe_table(session, cdc_database.publication, table).schema
    # the path this key takes: PostgreSQL's WHERE, or the tasks' filter
    assert (BucketSelection(BITS, BUCKETS).sql_predicate(schema) is not None) \
        == SELECTED_BY_SQL[kind]
    settings = settings_for(cdc_database, provisioned_nats.url, chunk_rows=100)

    result = await snapshot_table(None, settings, table, options=IN_PROCESS,
                                  buckets=(BITS, list(reversed(BUCKETS))))

    expected = in_buckets(direct_rows(cdc_database.server.superuser_conninfo(), table, columns),
                          columns, key)
    assert 0 < sum(expected.values()) < 3000 // 4
    assert result.snapshot_id.startswith("repair-")
    assert (result.bits, result.buckets, result.row_count) == (
        BITS, BUCKETS, sum(expected.values()))
    assert result.meta_subject == repair_meta_subject(table)
    seq, meta = await repair_meta(nats_client, table)
    assert seq == result.meta_seq
    assert (meta["snapshot_id"], meta["bits"], meta["buckets"], meta["row_count"]) == (
        result.snapshot_id, BITS, list(BUCKETS), result.row_count)
    assert meta["batch_count"] > 1  # chunked like any snapshot
    assert await loaded_rows(nats_client, meta) == expected
    with pytest.raises(NotFoundError):  # a repair writes no full snapshot's meta
        await nats_client.jetstream().get_last_msg("INIT", snapshot_meta_subject(table))


def _apply(rows: dict, event: dict, key: list[str], keep) -> None:
    """A change event onto rows keyed by their key values (the cutover rule, step 3),
    keeping a new row only when ``keep(row)`` (its key is in the repaired buckets)."""
    identity = event.get("old") or event["data"]
    rows.pop(tuple(identity[name] for name in key), None)
    if event["operation"] != "DELETE" and keep(event["data"]):
        rows[tuple(event["data"][name] for name in key)] = event["data"]


async def _table_events(js, table) -> list[dict]:
    """Every change event of ``table`` in CDC, in stream order."""
    subscription = await js.pull_subscribe(f"cdc.{table}.>", stream="CDC", config=ConsumerConfig(
        ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL))
    messages = []
    try:
        while (await subscription.consumer_info()).num_pending:
            messages += await subscription.fetch(100, timeout=5.0)
    finally:
        await subscription.unsubscribe()
    return [event for event in flat_events(messages) if event["operation"] != "SCHEMA"]


async def test_a_repair_follows_the_cutover_rule_and_leaves_the_full_snapshots_meta(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    """With the bridge: the repair's marker is in CDC, and its rows plus the events with
    commit_lsn >= lsn (those of its buckets) are the table's rows of those buckets at the
    end; the full snapshot taken before stays the last message on init.meta.{table}."""
    table, columns, key = _create(pg_admin, cdc_database, "int8")
    settings = settings_for(cdc_database, provisioned_nats.url)
    async with running_bridge(settings):
        await bridge_ready(pg_admin, cdc_database, settings, [table])
        full = await snapshot_table(None, settings, table, options=NO_BRIDGE)
        pg_admin.execute(f"UPDATE {table} SET note = 'before' WHERE id % 3 = 0")
        repair = await snapshot_table(None, settings, table, options=IN_PROCESS,
                                      buckets=(BITS, BUCKETS))
        pg_admin.execute(f"UPDATE {table} SET note = 'after' WHERE id % 5 = 0")
        pg_admin.execute(f"UPDATE {table} SET id = -id WHERE id % 11 = 0")
        pg_admin.execute(f"DELETE FROM {table} WHERE id % 13 = 0")
        pg_admin.execute(f"INSERT INTO {table} SELECT n, 'new' FROM generate_series(1, 300) n")
        end = parse_lsn(pg_admin.execute("SELECT pg_current_wal_lsn()::text").fetchone()[0])
        await wait_for(lambda: slot_confirmed(pg_admin, cdc_database.slot) >= end,
                       what="the bridge to store every change")
    assert repair.cdc_start_seq is not None  # the bridge published its marker
    js = nats_client.jetstream()
    _, meta = await repair_meta(nats_client, table)
    digester = RowDigester(columns, key)

    def keep(row: dict) -> bool:
        return bucket_of(digester.key_hash(row), BITS) in BUCKETS

    repaired = {}
    async for chunk in read_chunks(js, SnapshotMeta.from_wire(meta)):
        repaired.update({(row["id"],): row for row in chunk.rows})
    applied = 0
    for event in await _table_events(js, table):
        if parse_lsn(event["commit_lsn"]) >= parse_lsn(repair.lsn):  # else: in the snapshot
            _apply(repaired, event, key, keep)
            applied += 1
    assert applied > 1000
    final = direct_rows(cdc_database.server.superuser_conninfo(), table, columns)
    assert Counter(map(_pack, repaired.values())) == in_buckets(final, columns, key)
    full_meta = await js.get_last_msg("INIT", snapshot_meta_subject(table))
    assert full_meta.seq == full.meta_seq  # the repair left init.meta.{table} alone


@pytest.mark.spark
@pytest.mark.parametrize("kind", ["text_uuid", "timestamptz"])
async def test_spark_and_in_process_repairs_agree(kind, cdc_database, pg_admin, provisioned_nats,
                                                  nats_client, spark_session):
    table, columns, key = _create(pg_admin, cdc_database, kind)
    cdc_database.create_slot(pg_admin)  # a stopped bridge's: no bridge runs here
    settings = settings_for(cdc_database, provisioned_nats.url, chunk_rows=100)
    here = await snapshot_table(None, settings, table, options=IN_PROCESS,
                                buckets=(BITS, BUCKETS))
    _, here_meta = await repair_meta(nats_client, table)
    spark = await snapshot_table(spark_session, settings, table, options=NO_BRIDGE,
                                 buckets=(BITS, BUCKETS))
    _, spark_meta = await repair_meta(nats_client, table)
    assert spark_meta["snapshot_id"] == spark.snapshot_id != here.snapshot_id
    assert spark.row_count == here.row_count > 0
    assert await loaded_rows(nats_client, spark_meta) == await loaded_rows(
        nats_client, here_meta) == in_buckets(
        direct_rows(cdc_database.server.superuser_conninfo(), table, columns), columns, key)


async def test_a_consumer_reads_a_repair_with_the_checks_of_a_full_snapshot(
        cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path):
    """Signed and compressed like every snapshot (zstd, without the table's dictionary: one
    is not trained for a repair): its meta (named by the done reply) and chunks verify; a
    done reply naming the wrong kind of meta is refused both ways; an unsigned copy of the
    meta, or one stored where full snapshots' metas are, is not read as a repair."""
    seed_file = tmp_path / "signing.seed"
    seed_file.write_text(new_seed(os.urandom(32)))
    verifier = SignatureVerifier([MessageSigner(seed_file.read_text()).public_key])
    table, columns, key = _create(pg_admin, cdc_database, "timestamptz")
    cdc_database.create_slot(pg_admin)  # a stopped bridge's: no bridge runs here
    settings = settings_for(cdc_database, provisioned_nats.url, chunk_rows=100, zstd=True,
                            zstd_dictionary=True)
    settings = settings.model_copy(update={"bridge": BridgeSettings(
        http_port=0, signing_key_seed=str(seed_file))})
    full = await snapshot_table(None, settings, table, options=IN_PROCESS)
    repair = await snapshot_table(None, settings, table, options=IN_PROCESS,
                                  buckets=(BITS, BUCKETS))
    js = nats_client.jetstream()
    assert full.dictionary_id is not None and repair.dictionary_id is None
    assert repair.compression == "zstd" and repair.bytes_compressed < repair.bytes_raw

    meta = await repair_meta_at(js, "INIT", done_fields(repair), verifier)
    assert meta is not None and (meta.snapshot_id, meta.bits, meta.buckets) == (
        repair.snapshot_id, BITS, BUCKETS)
    assert repair_refusal(meta, table, repair.schema_fingerprint, BITS, BUCKETS[1:]) is None
    assert (await latest_repair_meta(js, table, verifier=verifier)).seq == meta.seq
    loaded: Counter = Counter()
    async for chunk in read_chunks(js, meta, verifier=verifier):
        loaded.update(_pack(row) for row in chunk.rows)
    assert loaded == in_buckets(
        direct_rows(cdc_database.server.superuser_conninfo(), table, columns), columns, key)
    with pytest.raises(SnapshotUnusable, match="not a full snapshot's"):
        await meta_at(js, "INIT", done_fields(repair), verifier)
    with pytest.raises(SnapshotUnusable, match="not a repair snapshot's"):
        await repair_meta_at(js, "INIT", done_fields(full), verifier)

    genuine = await js.get_last_msg("INIT", repair_meta_subject(table))
    forged = await js.publish(repair_meta_subject(table), genuine.data,
                              headers={"Nats-Msg-Id": "forged-repair-meta"})
    assert await latest_repair_meta(js, table, verifier=verifier) is None  # unsigned
    assert (await latest_repair_meta(js, table)).seq == forged.seq  # (what it is without)
    misplaced = await js.publish(snapshot_meta_subject(table), genuine.data,
                                 headers={"Nats-Msg-Id": "misplaced-repair-meta"})
    with pytest.raises(SnapshotUnusable, match="not init.repair"):
        await meta_at(js, "INIT", {"meta_seq": misplaced.seq})


async def test_a_requester_asks_for_a_repair_and_asks_again_when_told_to(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    """The consumer's requester: purpose repair, done names the repair's meta, which loads;
    refused for now (a repair of the table ran moments ago) it asks again after retry_after
    and gets the second one."""
    table, columns, key = _create(pg_admin, cdc_database, "int8")
    cdc_database.create_slot(pg_admin)  # a stopped bridge's: no bridge runs here
    settings = settings_for(cdc_database, provisioned_nats.url)
    js = nats_client.jetstream()
    reports: list[str] = []
    requester = SnapshotRequester(
        nats_client, js, requests_stream=settings.topology.requests.name,
        init_stream="INIT", max_age_seconds=0, wait_seconds=60,
        status_interval_seconds=60, report=reports.append)
    stop = asyncio.Event()
    async with snapshot_responder(settings, options=IN_PROCESS, repair_interval=3.0) as taken:
        first = await requester.request_repair(table, BITS, BUCKETS[:2], stop)
        second = await requester.request_repair(table, BITS - 1, [BUCKETS[2] >> 1], stop)
    assert [result.snapshot_id for result in taken] == [
        first["snapshot_id"], second["snapshot_id"]]
    # refused at first (the table was repaired moments before), then asked again
    assert [line for line in reports if "too soon; asking again in" in line]
    rows = direct_rows(cdc_database.server.superuser_conninfo(), table, columns)
    for done, bits, buckets in ((first, BITS, BUCKETS[:2]),
                                (second, BITS - 1, (BUCKETS[2] >> 1,))):
        assert done["meta_subject"] == repair_meta_subject(table)
        meta = await repair_meta_at(js, "INIT", done)
        assert (meta.bits, meta.buckets) == (bits, buckets)
        loaded: Counter = Counter()
        async for chunk in read_chunks(js, meta):
            loaded.update(_pack(row) for row in chunk.rows)
        assert loaded == in_buckets(rows, columns, key, bits, buckets)


async def test_a_repair_of_more_buckets_than_a_meta_lists_carries_them_as_a_bitmap(
        cdc_database, pg_admin, provisioned_nats, nats_client, small_nats):
    # a union at 20 bits may hold 262,144 buckets: ~1.3 MB as a list, over max_payload; as
    # a bitmap 175 KB: under 1 MB, over a 64 KB server's limit, which fails in one line
    table, columns, key = _create(pg_admin, cdc_database, "int8")
    cdc_database.create_slot(pg_admin)  # a stopped bridge's: no bridge runs here
    many = (20, tuple(range(20_000)))  # past META_MAX_LISTED_BUCKETS (16,384)
    settings = settings_for(cdc_database, provisioned_nats.url)
    await snapshot_table(None, settings, table, options=IN_PROCESS, buckets=many)
    _, payload = await repair_meta(nats_client, table)
    assert "buckets" not in payload and len(payload["bucket_bitmap"]) == 174_764
    meta = SnapshotMeta.from_wire(payload)
    assert (meta.bits, meta.buckets) == many
    expected = in_buckets(direct_rows(cdc_database.server.superuser_conninfo(), table, columns),
                          columns, key, *many)
    assert await loaded_rows(nats_client, payload) == expected and expected

    server, client = small_nats
    with pytest.raises(SnapshotError, match=(
            rf"the meta of snapshot repair-\S+ of {table} is 17\d,\d{{3}} bytes, over the "
            r"NATS server's max_payload \(65,536\)")):
        await snapshot_table(None, settings_for(cdc_database, server.url), table,
                             options=IN_PROCESS, buckets=many)
    with pytest.raises(NotFoundError):
        await client.jetstream().get_last_msg("INIT", repair_meta_subject(table))


@pytest.mark.parametrize("buckets", [(3, [8]), (3, []), (21, [1]), (3, [-1])])
async def test_buckets_that_are_not_buckets_are_refused_before_anything_starts(
        buckets, cdc_database, pg_admin, provisioned_nats, nats_client):
    table, _, _ = _create(pg_admin, cdc_database, "int8")
    settings = settings_for(cdc_database, provisioned_nats.url)
    with pytest.raises(SnapshotRequestRefused, match=f"repair snapshot of {table}"):
        await snapshot_table(None, settings, table, options=IN_PROCESS, buckets=buckets)
    with pytest.raises(NotFoundError):
        await nats_client.jetstream().get_last_msg("INIT", repair_meta_subject(table))
    slots = pg_admin.execute("SELECT count(*) FROM pg_replication_slots "
                             "WHERE slot_name LIKE 'cdc_snap_%'").fetchone()[0]
    assert slots == 0  # no snapshot slot was made
