"""Schema-change events from the real bridge (docs/wire-contract.md "Schema changes"): each new
table shape is announced on ``cdc.{table}.schema`` in stream order, before the first change that
uses it, with what existing rows read for added columns and each column's identity (a RENAME keeps
it), and every rewrite says a new snapshot is needed. The mirror follows each end to end."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from cdc_platform.mirror.follower import Mirror
from cdc_platform.postgres.catalog import describe_published
from cdc_platform.publishing.schemas import publish_schemas
from cdc_platform.replication.slots import read_slot
from cdc_platform.settings import MirrorSettings
from cdc_platform.wire import decode_any, encoder
from cdc_platform_tests.exactness import bridge_caught_up, mirror_rows, source_rows
from cdc_platform_tests.fixtures.bridge import bridge_ready, flat_events, running_bridge, wait_for
from cdc_platform_tests.fixtures.responder import snapshot_responder
from cdc_platform_tests.fixtures.services import platform_settings, random_name, read_subjects

# also on the newest PostgreSQL (docs/development.md "Tests": make test's second pass)
pytestmark = pytest.mark.every_major

FAST = MirrorSettings(status_interval_seconds=1.0, snapshot_wait_seconds=120.0)


@pytest.mark.parametrize("mode", ["per-change", "batched"])
async def test_each_new_shape_is_announced_before_its_first_change(
        mode, cdc_database, pg_admin, provisioned_nats, nats_client):
    table = random_name("shapes")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} SELECT g, 'old' FROM generate_series(1, 3) g")
    cdc_database.add_tables(pg_admin, table)
    settings = platform_settings(cdc_database, provisioned_nats.url, message_mode=mode)
    async def stored(count: int) -> list:
        return await read_subjects(nats_client, "CDC", f"cdc.{table}.>", expect=count,
                                   schema_events=True)

    # Each step waits until the bridge has published the previous one: what the catalog
    # says about a column is read when the bridge reaches its Relation message.
    async with running_bridge(settings):
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
        pg_admin.execute(f"INSERT INTO {table} VALUES (10, 'a')")
        await stored(2)
        pg_admin.execute(f"ALTER TABLE {table} ADD COLUMN flag int DEFAULT 7, "
                         "ADD COLUMN box_col box DEFAULT '(1,1),(0,0)', "
                         "ADD COLUMN tags text[] DEFAULT '{\"a b\",c}'")
        with pg_admin.transaction():  # the new shape and its first change in one transaction
            pg_admin.execute(f"UPDATE {table} SET v = 'new' WHERE id = 1")
            pg_admin.execute(f"INSERT INTO {table} (id, v) VALUES (11, 'b')")
        await stored(5)
        pg_admin.execute(f"ALTER TABLE {table} DROP COLUMN box_col")
        pg_admin.execute(f"DELETE FROM {table} WHERE id = 2")
        await stored(7)
        pg_admin.execute(f"ALTER TABLE {table} ADD COLUMN r float8 DEFAULT random()")  # rewrite
        pg_admin.execute(f"UPDATE {table} SET v = 'after' WHERE id = 3")
        messages = await stored(9)
    events = flat_events(messages)
    assert [(e["operation"], e.get("data", {}).get("id")) for e in events] == [
        ("SCHEMA", None), ("INSERT", 10),
        ("SCHEMA", None), ("UPDATE", 1), ("INSERT", 11),
        ("SCHEMA", None), ("DELETE", 2),
        ("SCHEMA", None), ("UPDATE", 3)]
    first, added, dropped, rewritten = (e for e in events if e["operation"] == "SCHEMA")
    assert [m.subject for m in messages if m.subject.endswith(".schema")] == \
        [f"cdc.{table}.schema"] * 4
    for event, change in ((first, events[1]), (added, events[3]), (dropped, events[6]),
                          (rewritten, events[8])):
        # the envelope of the change it precedes; its own id
        assert (event["commit_lsn"], event["ordinal"]) == (change["commit_lsn"],
                                                           change["ordinal"])
        assert event["msg_id"] == f"{change['commit_lsn']}:{change['ordinal']}:schema"
        assert event["schema_fingerprint"] == change["schema_fingerprint"]
        assert event["table_schema"]["fingerprint"] == event["schema_fingerprint"]
    assert first["previous_fingerprint"] is None and first["needs_snapshot"] is False
    assert added["previous_fingerprint"] == first["schema_fingerprint"]
    missing = {c["name"]: c["missing_value"] for c in added["table_schema"]["columns"]}
    assert missing == {"id": None, "v": None, "flag": 7, "box_col": "(1,1),(0,0)",
                       "tags": ["a b", "c"]}
    assert added["needs_snapshot"] is False and added["reason"] is None
    assert [c["name"] for c in dropped["table_schema"]["columns"]] == ["id", "v", "flag", "tags"]
    assert dropped["needs_snapshot"] is False
    assert rewritten["needs_snapshot"] is True and "rewritten" in rewritten["reason"]

    # A restarted bridge compares with the last schema event in the stream: an unchanged
    # shape is not announced again.
    async with running_bridge(settings):
        pg_admin.execute(f"UPDATE {table} SET v = 'again' WHERE id = 3")
        messages = await stored(10)
    operations = [e["operation"] for e in flat_events(messages)]
    assert operations.count("SCHEMA") == 4 and operations[-1] == "UPDATE"


async def test_a_column_changed_before_the_bridge_read_its_addition_asks_for_a_snapshot(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    """The bridge reads the catalog when it reaches a Relation message; if the added column
    is gone by then, what existing rows read is unknowable, and the event says so."""
    table = random_name("raced")
    pg_admin.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
    pg_admin.execute(f"INSERT INTO {table} VALUES (1, 'x')")
    cdc_database.add_tables(pg_admin, table)
    settings = platform_settings(cdc_database, provisioned_nats.url)
    async with running_bridge(settings):
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
        pg_admin.execute(f"INSERT INTO {table} VALUES (2, 'y')")
        await read_subjects(nats_client, "CDC", f"cdc.{table}.>", expect=2, schema_events=True)
    # the bridge is down while the column comes and goes
    pg_admin.execute(f"ALTER TABLE {table} ADD COLUMN gone int DEFAULT 5")
    pg_admin.execute(f"INSERT INTO {table} VALUES (3, 'z', 6)")
    pg_admin.execute(f"ALTER TABLE {table} DROP COLUMN gone")
    pg_admin.execute(f"INSERT INTO {table} VALUES (4, 'w')")
    async with running_bridge(settings):
        messages = await read_subjects(nats_client, "CDC", f"cdc.{table}.>", expect=6,
                                       schema_events=True)
    schema_events = [e for e in flat_events(messages) if e["operation"] == "SCHEMA"]
    assert len(schema_events) == 3
    added, dropped = schema_events[1:]
    assert added["needs_snapshot"] is True and "gone" in added["reason"]
    assert dropped["needs_snapshot"] is False


# -- the mirror through schema changes, end to end -------------------------------------------
class _Mirrored:
    """One published table, a mirror of it, and what the stream said about it."""

    def __init__(self, cdc_database, pg_admin, nats, nats_client, tmp_path: Path,
                 table: str) -> None:
        self.cdc_database, self.pg_admin, self.nats_client = cdc_database, pg_admin, nats_client
        self.table = table
        self.db = tmp_path / "mirror.db"
        self.lines: list[str] = []
        self.settings = platform_settings(cdc_database, nats.url)

    async def catch_up(self) -> None:
        """The bridge published the table's schema and confirmed everything written so far;
        the mirror applied all of it."""
        await bridge_ready(self.pg_admin, self.cdc_database, self.settings, [self.table])
        await bridge_caught_up(self.pg_admin, self.cdc_database.slot, timeout=60)
        await Mirror(self.settings, [self.table], self.db, options=FAST,
                     report=self.lines.append).run(until_caught_up=True)

    def assert_equal(self) -> None:
        columns = [row[0] for row in self.pg_admin.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
            "AND NOT attisdropped ORDER BY attnum", (self.table,))]
        conninfo = self.cdc_database.server.superuser_conninfo()
        assert mirror_rows(self.db, self.table, columns) == source_rows(
            conninfo, self.table, columns)

    async def schema_events(self) -> list[dict]:
        messages = await read_subjects(self.nats_client, "CDC", f"cdc.{self.table}.schema",
                                       schema_events=True)
        return flat_events(messages)


def _published(pg_admin, cdc_database, prefix: str, columns: str, rows: str) -> str:
    table = random_name(prefix)
    pg_admin.execute(f"CREATE TABLE {table} ({columns})")
    pg_admin.execute(f"INSERT INTO {table} {rows}")
    cdc_database.add_tables(pg_admin, table)
    return table


@pytest.mark.parametrize("renamed", ["b", "id"])
async def test_a_renamed_column_keeps_its_values_in_the_mirror(
        renamed, cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path):
    """RENAME COLUMN keeps the column's identity (attnum): the mirror renames it in place,
    a key column too, with no new snapshot; it was read as a DROP and an ADD (NULLs)."""
    table = _published(pg_admin, cdc_database, "renamed", "id int PRIMARY KEY, b text",
                       "SELECT g, 'v' || g FROM generate_series(1, 100) g")
    mirrored = _Mirrored(cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path, table)
    async with running_bridge(mirrored.settings), \
            snapshot_responder(mirrored.settings) as taken:
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
        await mirrored.catch_up()
        pg_admin.execute(f"ALTER TABLE {table} RENAME COLUMN {renamed} TO {renamed}_renamed")
        key = "id_renamed" if renamed == "id" else "id"
        pg_admin.execute(f"UPDATE {table} SET b{'_renamed' if renamed == 'b' else ''} = 'new' "
                         f"WHERE {key} = 1")
        await mirrored.catch_up()
        mirrored.assert_equal()
        assert len(taken) == 1, mirrored.lines  # the bootstrap's only
    *_, event = await mirrored.schema_events()
    assert event["needs_snapshot"] is False
    assert [(c["name"], c["attnum"]) for c in event["table_schema"]["columns"]] == [
        ("id_renamed" if renamed == "id" else "id", 1),
        ("b_renamed" if renamed == "b" else "b", 2)]


async def test_a_column_renamed_then_retyped_before_the_bridge_reads_it_asks_for_a_snapshot(
        cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path):
    """The bridge reaches the Relation message of a rename after the column was retyped too
    (varchar(10) -> varchar(20): no rewrite): the catalog cannot say which column the
    renamed one is, so the event asks for a snapshot rather than guess (a DROP and an ADD
    left 98 NULLs)."""
    table = _published(pg_admin, cdc_database, "retyped", "id int PRIMARY KEY, b varchar(10)",
                       "SELECT g, 'v' || g FROM generate_series(1, 100) g")
    mirrored = _Mirrored(cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path, table)
    async with running_bridge(mirrored.settings), \
            snapshot_responder(mirrored.settings) as taken:
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
        await mirrored.catch_up()
        pg_admin.execute(f"UPDATE {table} SET b = 'first' WHERE id = 100")
        await mirrored.catch_up()
    # the bridge is down while the column is renamed, used, retyped and used again
    pg_admin.execute(f"ALTER TABLE {table} RENAME COLUMN b TO c")
    pg_admin.execute(f"UPDATE {table} SET c = 'renamed' WHERE id = 1")
    pg_admin.execute(f"ALTER TABLE {table} ALTER COLUMN c TYPE varchar(20)")
    pg_admin.execute(f"UPDATE {table} SET c = 'retyped' WHERE id = 2")
    async with running_bridge(mirrored.settings), \
            snapshot_responder(mirrored.settings) as taken:
        await mirrored.catch_up()
        mirrored.assert_equal()
        assert len(taken) == 1, mirrored.lines  # the new snapshot
    renamed = next(e for e in await mirrored.schema_events()
                   if "c" in [c["name"] for c in e["table_schema"]["columns"]])
    assert renamed["needs_snapshot"] is True and "c" in renamed["reason"]
    assert renamed["min_snapshot_lsn"] != renamed["commit_lsn"]  # the catalog read's


async def test_a_rewrite_before_the_first_change_since_publication_reaches_the_mirror(
        cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path):
    """``ALTER COLUMN a TYPE bigint USING a*10`` rewrites every row without decoding one: the
    table's storage is known from its publication on, so its next change tells consumers to
    take a new snapshot, also when it is the table's first change since the publication
    (999 of 1,000 rows kept the old value)."""
    table = _published(pg_admin, cdc_database, "rewritten", "id int PRIMARY KEY, a int4",
                       "SELECT g, g FROM generate_series(1, 1000) g")
    mirrored = _Mirrored(cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path, table)
    async with running_bridge(mirrored.settings), \
            snapshot_responder(mirrored.settings) as taken:
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
        await mirrored.catch_up()
        pg_admin.execute(f"ALTER TABLE {table} ALTER COLUMN a TYPE bigint USING a * 10")
        pg_admin.execute(f"UPDATE {table} SET a = -1 WHERE id = 1")
        await mirrored.catch_up()
        mirrored.assert_equal()
        assert len(taken) == 2, mirrored.lines
    [event] = await mirrored.schema_events()
    assert event["needs_snapshot"] is True and "rewritten" in event["reason"]


async def test_a_rewrite_while_the_bridge_is_down_reaches_the_mirror(
        cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path):
    """The storage consumers hold is kept in the table's KV schema: a bridge restarted after
    a rewrite, before the table's first change was ever published, still sees it."""
    table = _published(pg_admin, cdc_database, "rewritten_down", "id int PRIMARY KEY, a int4",
                       "SELECT g, g FROM generate_series(1, 500) g")
    mirrored = _Mirrored(cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path, table)
    async with running_bridge(mirrored.settings), snapshot_responder(mirrored.settings):
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
        await mirrored.catch_up()
    pg_admin.execute(f"ALTER TABLE {table} ALTER COLUMN a TYPE int4 USING a * 10")
    pg_admin.execute(f"UPDATE {table} SET a = -1 WHERE id = 1")
    async with running_bridge(mirrored.settings), \
            snapshot_responder(mirrored.settings) as taken:
        await mirrored.catch_up()
        mirrored.assert_equal()
        assert len(taken) == 1, mirrored.lines
    [event] = await mirrored.schema_events()
    assert event["needs_snapshot"] is True


async def test_the_kv_schema_is_put_only_once_its_event_is_stored(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    """KV never runs ahead of the stream: a bridge killed between the two (put first) came
    back taking the rewrite's storage for what consumers hold, and the replayed schema
    event lost its ``needs_snapshot`` (the mirror kept NULL in a column added with a
    volatile default). Arrival order on one subscriber tells which was sent first."""
    table = _published(pg_admin, cdc_database, "kv_after", "id int PRIMARY KEY, a int4",
                       "SELECT g, g FROM generate_series(1, 20) g")
    settings = platform_settings(cdc_database, provisioned_nats.url)
    arrived: list[str] = []

    async def record(message) -> None:
        arrived.append(message.subject)

    bucket = settings.topology.schemas.bucket
    await nats_client.subscribe(f"$KV.{bucket}.{table}", cb=record)
    await nats_client.subscribe(f"cdc.{table}.schema", cb=record)
    async with running_bridge(settings):
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
        await wait_for(lambda: f"$KV.{bucket}.{table}" in arrived)  # published at start
        arrived.clear()
        pg_admin.execute(f"ALTER TABLE {table} ADD COLUMN r float8 DEFAULT random()")
        pg_admin.execute(f"UPDATE {table} SET a = -1 WHERE id = 1")
        await wait_for(lambda: len(arrived) >= 2)
    assert arrived == [f"cdc.{table}.schema", f"$KV.{bucket}.{table}"]


async def test_a_rewrite_found_at_a_resent_change_is_announced_where_consumers_see_it(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    """A bridge that stopped after JetStream stored a change but before PostgreSQL heard so
    resends it; the catalog it reads there already shows a rewrite made later in the WAL.
    Consumers hold that change and skip anything at its position, so the rewrite must be
    announced at the table's next Relation message (its first change after the rewrite),
    never at the resent one (where it was: the mirror never took a new snapshot, and kept
    NULL in a column added with a volatile default). The unconfirmed change is made real
    with a copy of the slot taken before it."""
    table = _published(pg_admin, cdc_database, "resent", "id int PRIMARY KEY, a int4",
                       "SELECT g, g FROM generate_series(1, 5) g")
    settings = platform_settings(cdc_database, provisioned_nats.url)
    slot, kept = cdc_database.slot, f"{cdc_database.slot}_kept"
    async with running_bridge(settings):
        await wait_for(lambda: read_slot(pg_admin, slot) is not None)
        pg_admin.execute(f"INSERT INTO {table} VALUES (10, 10)")
        await read_subjects(nats_client, "CDC", f"cdc.{table}.>", expect=1)
        pg_admin.execute("SELECT pg_copy_logical_replication_slot(%s, %s)", (slot, kept))
        pg_admin.execute(f"UPDATE {table} SET a = -2 WHERE id = 2")  # the change resent
        await read_subjects(nats_client, "CDC", f"cdc.{table}.>", expect=2)
    # the slot as it was before the UPDATE was confirmed
    pg_admin.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
    pg_admin.execute("SELECT pg_copy_logical_replication_slot(%s, %s)", (kept, slot))
    pg_admin.execute("SELECT pg_drop_replication_slot(%s)", (kept,))
    with pg_admin.transaction():
        pg_admin.execute(f"ALTER TABLE {table} ADD COLUMN r float8 DEFAULT random()")
        pg_admin.execute(f"UPDATE {table} SET a = -3 WHERE id = 3")
    async with running_bridge(settings):
        messages = await read_subjects(nats_client, "CDC", f"cdc.{table}.>", expect=5,
                                       schema_events=True)
    events = flat_events(messages)
    _resent, after = [e for e in events if e["operation"] == "UPDATE"]
    [rewrite] = [e for e in events if e["operation"] == "SCHEMA" and e["needs_snapshot"]]
    assert (rewrite["commit_lsn"], rewrite["ordinal"]) == (after["commit_lsn"],
                                                           after["ordinal"])
    assert "rewritten" in rewrite["reason"]
    # (the first: the table's shape when the bridge first saw it)
    assert [e["operation"] for e in events] == ["SCHEMA", "INSERT", "UPDATE", "SCHEMA", "UPDATE"]


async def test_republished_schemas_keep_the_storage_consumers_hold(
        cdc_database, pg_admin, provisioned_nats, nats_client):
    """The Dagster ``schemas`` asset writes every schema again from the catalog: the KV
    ``relfilenode`` stays the one consumers hold (a restarted bridge compares with it)."""
    table = _published(pg_admin, cdc_database, "kept", "id int PRIMARY KEY, a int4",
                       "VALUES (1, 1)")
    settings = platform_settings(cdc_database, provisioned_nats.url)
    bucket, encode = settings.topology.schemas.bucket, encoder(settings.encoding.format)
    conninfo = cdc_database.server.superuser_conninfo()
    with psycopg.connect(conninfo) as conn:
        [before] = [s for s in describe_published(conn, cdc_database.publication)
                    if s.wire_name == table]
    await publish_schemas(nats_client.jetstream(), bucket, [before], encode)
    pg_admin.execute(f"ALTER TABLE {table} ALTER COLUMN a TYPE int4 USING a * 10")
    with psycopg.connect(conninfo) as conn:
        [after] = [s for s in describe_published(conn, cdc_database.publication)
                   if s.wire_name == table]
    assert after.storage != before.storage
    await publish_schemas(nats_client.jetstream(), bucket, [after], encode)
    kv = await nats_client.jetstream().key_value(bucket)
    assert decode_any((await kv.get(table)).value)["relfilenode"] == before.storage


async def test_every_rewrite_reaches_the_mirror_whatever_the_types(
        cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path):
    """A same-type rewrite (int4 USING n*10 on an int4 column) sends a Relation message the
    same as before: the storage is compared there too. Two rewrites in a row, two new
    snapshots (the second was missed: no schema event, old values kept)."""
    table = _published(pg_admin, cdc_database, "same_type", "id int PRIMARY KEY, n int4",
                       "SELECT g, g FROM generate_series(1, 300) g")
    mirrored = _Mirrored(cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path, table)
    async with running_bridge(mirrored.settings) as bridge, \
            snapshot_responder(mirrored.settings) as taken:
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
        await mirrored.catch_up()
        pg_admin.execute(f"UPDATE {table} SET n = n WHERE id = 300")
        await mirrored.catch_up()
        for using, key in (("n * 10", 1), ("n + 1", 2)):
            pg_admin.execute(f"ALTER TABLE {table} ALTER COLUMN n TYPE int4 USING {using}")
            pg_admin.execute(f"UPDATE {table} SET n = -1 WHERE id = {key}")
            await mirrored.catch_up()
            mirrored.assert_equal()
        assert len(taken) == 3, mirrored.lines
        # a reconnect publishes the schemas again, with the storage announced last (a
        # restarted bridge reads it there before the table's first schema event)
        pg_admin.execute("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                         "WHERE slot_name = %s", (cdc_database.slot,))
        await wait_for(lambda: bridge.metrics.value(bridge.metrics.reconnects) >= 1,
                       what="the bridge to reconnect")
        pg_admin.execute("SELECT pg_logical_emit_message(true, 'test', 'streaming again')")
        await bridge_caught_up(pg_admin, cdc_database.slot, timeout=60)
        events = await mirrored.schema_events()
        kv = await nats_client.jetstream().key_value(mirrored.settings.topology.schemas.bucket)
        assert decode_any((await kv.get(table)).value)["relfilenode"] == \
            events[-1]["relfilenode"]
    assert [e["needs_snapshot"] for e in events] == [False, True, True]
    assert len({e["relfilenode"] for e in events}) == 3
    assert len({e["schema_fingerprint"] for e in events}) == 1


async def test_a_truncate_is_not_taken_for_a_rewrite(
        cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path):
    """TRUNCATE gives the table new storage, and is an event every consumer applies: from
    there the new storage is the baseline, so a later ADD COLUMN with a constant default
    (its missing value will do) asks for no snapshot."""
    table = _published(pg_admin, cdc_database, "truncated", "id int PRIMARY KEY, v text",
                       "SELECT g, 'v' || g FROM generate_series(1, 50) g")
    mirrored = _Mirrored(cdc_database, pg_admin, provisioned_nats, nats_client, tmp_path, table)
    async with running_bridge(mirrored.settings), \
            snapshot_responder(mirrored.settings) as taken:
        await wait_for(lambda: read_slot(pg_admin, cdc_database.slot) is not None)
        await mirrored.catch_up()
        pg_admin.execute(f"UPDATE {table} SET v = 'x' WHERE id = 1")
        await mirrored.catch_up()
        pg_admin.execute(f"TRUNCATE {table}")
        await mirrored.catch_up()
        pg_admin.execute(f"INSERT INTO {table} SELECT g, 'w' || g FROM generate_series(1, 20) g")
        pg_admin.execute(f"ALTER TABLE {table} ADD COLUMN flag int DEFAULT 7")
        pg_admin.execute(f"INSERT INTO {table} VALUES (100, 'new', 8)")
        await mirrored.catch_up()
        mirrored.assert_equal()
        assert len(taken) == 1, mirrored.lines
    # The bridge reads the catalog after the TRUNCATE that follows the change it reads it
    # for (here: the restarted bridge's first change), and reads them in different batches
    # (at most 4,096 messages each): it reads on until it knows, past a large transaction
    # between the two too (a bound of 50K messages took this TRUNCATE for a rewrite).
    pg_admin.execute(f"UPDATE {table} SET v = 'before' WHERE id = 100")
    pg_admin.execute(f"INSERT INTO {table} SELECT g, 'x', 0 "
                     "FROM generate_series(1000, 80999) g")
    pg_admin.execute(f"TRUNCATE {table}")
    pg_admin.execute(f"INSERT INTO {table} VALUES (1, 'after', 1)")
    async with running_bridge(mirrored.settings), \
            snapshot_responder(mirrored.settings) as taken:
        await mirrored.catch_up()
        mirrored.assert_equal()
        assert taken == [], mirrored.lines
    events = await mirrored.schema_events()
    assert not any(e["needs_snapshot"] for e in events), [e["reason"] for e in events]
