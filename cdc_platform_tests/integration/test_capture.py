"""The capture core on a real server: SlotReader -> typed change records."""

import resource
import time

import pytest

from cdc_platform.protocol.changes import ChangeRecord, TransactionCommitted
from cdc_platform.protocol.pgoutput import UNCHANGED_TOAST
from cdc_platform.replication.reader import SlotReader
from cdc_platform.replication.slots import read_slot
from cdc_platform_tests.fixtures.services import random_name

# also on the newest PostgreSQL (docs/development.md "Tests": make test's second pass)
pytestmark = pytest.mark.every_major


async def collect(reader: SlotReader, *, changes: int, timeout: float = 30.0,
                  confirm: bool = True) -> list:
    """Read until ``changes`` change records arrived and the transaction of the last one
    committed (its Commit may come in a later read than the change); confirm each commit as
    handled."""
    records: list = []
    deadline = time.monotonic() + timeout
    uncommitted = False
    while len(records) < changes or uncommitted:
        if time.monotonic() > deadline:
            raise AssertionError(f"got {len(records)} of {changes} changes")
        batch = await reader.read(timeout=0.2)
        for event in batch.events:
            if type(event) is ChangeRecord:
                records.append(event)
                uncommitted = True
            elif type(event) is TransactionCommitted:
                uncommitted = False
                if confirm:
                    reader.confirm(event.end_lsn)
    return records


@pytest.fixture
def tables(cdc_database, pg_admin):
    default, full = random_name("rid_default"), random_name("rid_full")
    pg_admin.execute(f"CREATE TABLE {default} (id int PRIMARY KEY, v text, big text)")
    pg_admin.execute(f"CREATE TABLE {full} (id int, v text)")
    pg_admin.execute(f"ALTER TABLE {full} REPLICA IDENTITY FULL")
    cdc_database.add_tables(pg_admin, default, full)
    return default, full


async def test_replica_identity_default_and_full(tables, cdc_database, pg_admin):
    default, full = tables
    async with SlotReader(cdc_database.settings()) as reader:
        pg_admin.execute(f"INSERT INTO {default} VALUES (1, 'a', 'x'), (2, 'b', NULL)")
        pg_admin.execute(f"INSERT INTO {full} VALUES (1, 'a')")
        pg_admin.execute(f"UPDATE {default} SET v = 'a2' WHERE id = 1")  # no key change
        pg_admin.execute(f"UPDATE {default} SET id = 20 WHERE id = 2")  # key change: 'K'
        pg_admin.execute(f"UPDATE {full} SET v = 'a2'")  # 'O': the whole old row
        pg_admin.execute(f"DELETE FROM {default} WHERE id = 20")
        pg_admin.execute(f"DELETE FROM {full}")
        records = await collect(reader, changes=8)
    by_op = [(r.table, r.operation, r.old_kind, r.old, r.new) for r in records[3:]]
    assert by_op == [
        (default, "UPDATE", None, None, {"id": 1, "v": "a2", "big": "x"}),
        (default, "UPDATE", "K", {"id": 2}, {"id": 20, "v": "b", "big": None}),
        (full, "UPDATE", "O", {"id": 1, "v": "a"}, {"id": 1, "v": "a2"}),
        (default, "DELETE", "K", {"id": 20}, None),
        (full, "DELETE", "O", {"id": 1, "v": "a2"}, None),
    ]


async def test_unchanged_toast_is_not_null(tables, cdc_database, pg_admin):
    default, _ = tables
    pg_admin.execute(f"ALTER TABLE {default} ALTER COLUMN big SET STORAGE EXTERNAL")
    big = "".join(chr(0x41 + (i * 7919) % 26) for i in range(200_000))
    async with SlotReader(cdc_database.settings()) as reader:
        pg_admin.execute(f"INSERT INTO {default} VALUES (1, 'a', %s)", (big,))
        pg_admin.execute(f"UPDATE {default} SET v = 'b' WHERE id = 1")
        pg_admin.execute(f"UPDATE {default} SET big = NULL WHERE id = 1")
        insert, toast_update, null_update = await collect(reader, changes=3)
    assert insert.new["big"] == big
    assert toast_update.unchanged_toast == ("big",)
    assert "big" not in toast_update.new and toast_update.new["v"] == "b"
    assert null_update.new["big"] is None and null_update.unchanged_toast == ()
    assert UNCHANGED_TOAST not in toast_update.new.values()


async def test_truncate_of_two_tables_in_one_statement(tables, cdc_database, pg_admin):
    default, full = tables
    async with SlotReader(cdc_database.settings()) as reader:
        pg_admin.execute(f"TRUNCATE {default}, {full} RESTART IDENTITY")
        records = await collect(reader, changes=2)
    assert sorted(r.table for r in records) == sorted([default, full])
    assert all(r.operation == "TRUNCATE" and r.restart_identity for r in records)
    assert records[0].commit_lsn == records[1].commit_lsn
    assert [r.ordinal for r in records] == [0, 1]


async def test_multi_row_copy_rows_share_an_lsn_but_not_an_ordinal(tables, cdc_database,
                                                                    pg_admin):
    default, _ = tables
    async with SlotReader(cdc_database.settings()) as reader:
        with pg_admin.cursor().copy(f"COPY {default} (id, v) FROM STDIN") as copy:
            for i in range(1000):
                copy.write_row((i, str(i)))
        records = await collect(reader, changes=1000)
    assert len({r.lsn for r in records}) < 1000  # multi-insert WAL records
    assert [r.ordinal for r in records] == list(range(1000))
    assert len({(r.commit_lsn, r.ordinal) for r in records}) == 1000


async def test_resume_from_confirmed_lsn_delivers_changes_made_while_stopped(
        tables, cdc_database, pg_admin):
    default, _ = tables
    async with SlotReader(cdc_database.settings()) as reader:
        pg_admin.execute(f"INSERT INTO {default} (id) VALUES (1)")
        await collect(reader, changes=1)
        await reader.send_status()
    for i in range(2, 6):
        pg_admin.execute(f"INSERT INTO {default} (id) VALUES ({i})")  # nobody is reading
    async with SlotReader(cdc_database.settings()) as reader:
        assert reader.start_lsn == read_slot(pg_admin, cdc_database.slot).confirmed_flush_lsn
        records = await collect(reader, changes=4)
    assert [r.new["id"] for r in records] == [2, 3, 4, 5]


async def test_unconfirmed_changes_are_sent_again(tables, cdc_database, pg_admin):
    default, _ = tables
    async with SlotReader(cdc_database.settings()) as reader:
        pg_admin.execute(f"INSERT INTO {default} (id) VALUES (1)")
        await collect(reader, changes=1, confirm=False)
    async with SlotReader(cdc_database.settings()) as reader:
        (again,) = await collect(reader, changes=1)
    assert again.new["id"] == 1


async def test_million_row_transaction_streams_in_bounded_memory(cdc_database, pg_admin):
    table = random_name("million")
    pg_admin.execute(f"CREATE TABLE {table} (id int8 PRIMARY KEY, name text, qty int4, "
                     "price numeric(10,2), at timestamptz)")
    cdc_database.add_tables(pg_admin, table)
    async with SlotReader(cdc_database.settings()) as reader:
        pg_admin.execute(
            f"INSERT INTO {table} SELECT i, 'name-' || i, i % 1000, i * 0.01, "
            "'2025-01-01'::timestamptz + i * interval '1 second' "
            "FROM generate_series(1, 1000000) AS i")
        baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        seen = 0
        last_id = 0
        deadline = time.monotonic() + 240
        while seen < 1_000_000 and time.monotonic() < deadline:
            batch = await reader.read(timeout=0.5)
            for event in batch.events:
                if type(event) is ChangeRecord:
                    seen += 1
                    last_id = event.new["id"]
        peak_growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline) / 1024
    assert seen == 1_000_000 and last_id == 1_000_000
    # the transaction is streamed, never held: growth stays far below its ~100 MB of rows
    assert peak_growth_mb < 60, f"max RSS grew by {peak_growth_mb:.0f} MB"
