"""Schema-change events from the real bridge (README "Schema changes"): each new table shape
is announced on ``cdc.{table}.schema`` in stream order, before the first change that uses it,
with what existing rows read for added columns, and a rewrite says a new snapshot is needed."""

from __future__ import annotations

import pytest

from cdc_platform.replication.slots import read_slot
from cdc_platform_tests.fixtures.services import platform_settings, random_name, read_subjects
from cdc_platform_tests.integration.test_bridge import flat_events, running_bridge, wait_for

# also on the newest PostgreSQL (README "Tests": make test's second pass)
pytestmark = pytest.mark.every_major


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
