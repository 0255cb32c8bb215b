"""No payload stops the mirror: random bytes and random maps that look like events (the right
table, operations and LSNs, with wrong fields, types and values) go through the follower's
per-message path on a real SQLite file. Each is refused or makes its table stale; nothing
escapes, and a genuine change still applies afterwards."""

from __future__ import annotations

import random

import msgpack
import pytest

from cdc_platform.jetstream.pull import PulledMessage
from cdc_platform.mirror.columns import TableShape
from cdc_platform.mirror.follower import Mirror, _Following
from cdc_platform.mirror.store import MirrorStore
from cdc_platform.mirror.transactions import TransactionCollector
from cdc_platform.settings import PlatformSettings
from cdc_platform_tests.fixtures.hostile_payloads import SCHEMAS, TABLES, hostile_payload


def _bootstrap(store: MirrorStore, table: str) -> None:
    shape = TableShape.from_schema(SCHEMAS[table])
    store.begin_bootstrap(shape, "snap", 0x100)
    store.load_rows(table, [{"id": 1, "name": "a", "f": 0.0}] if table == "users"
                    else [{"f": -0.0, "raw": b"\x00", "mood": "ok"}])
    store.finish_bootstrap(table, stream_seq=0)


@pytest.mark.parametrize("seed", range(4))
def test_random_payloads_never_stop_the_mirror(tmp_path, seed):
    rng = random.Random(seed)
    store = MirrorStore(tmp_path / "m.db")
    mirror = Mirror(PlatformSettings(), TABLES, tmp_path / "m.db", report=lambda line: None)
    for table in TABLES:
        _bootstrap(store, table)
    lsn = 0x200
    try:
        for seq in range(1, 601):
            lsn += 0x10
            table = rng.choice(TABLES)
            follow = _Following(mirror, None, store, TransactionCollector(TABLES,
                                keep_events=False), TABLES)  # type: ignore[arg-type]
            data = hostile_payload(rng, table, f"0/{lsn:X}")
            follow.payload(PulledMessage(f"cdc.{table}.insert", seq, data, None, b""), data)
            follow.commit()
            follow.abandon()
            for stale in follow.stale:  # what the follower does next: bootstrap it again
                _bootstrap(store, stale)
        # and the store still takes a genuine change of each table
        follow = _Following(mirror, None, store, TransactionCollector(TABLES,
                            keep_events=False), TABLES)  # type: ignore[arg-type]
        genuine = msgpack.packb([{"table": "users", "operation": "INSERT",
                                  "commit_lsn": f"0/{lsn + 0x10:X}", "ordinal": 0,
                                  "data": {"id": 100, "name": "z", "f": -0.0},
                                  "tx_tables": {"users": 1}}])
        follow.payload(PulledMessage("cdc.users.insert.batch", 10_000, genuine, None, b""),
                       genuine)
        follow.commit()
        assert not follow.stale
        assert store._db.execute('SELECT name FROM "users" WHERE id = 100').fetchall() == [
            ("z",)]
    finally:
        store.close()


def _follow(store: MirrorStore, mirror: Mirror, seq: int, *events: dict) -> _Following:
    follow = _Following(mirror, None, store, TransactionCollector(TABLES, keep_events=False),
                        TABLES)  # type: ignore[arg-type]
    for offset, event in enumerate(events):
        data = msgpack.packb(event)
        follow.payload(PulledMessage(f"cdc.{event['table']}.insert", seq + offset, data, None,
                                     b""), data)
    follow.commit()
    return follow


def _insert(table: str, lsn: int, row_id: int, **extra) -> dict:
    return {"table": table, "operation": "INSERT", "commit_lsn": f"0/{lsn:X}", "ordinal": 0,
            "data": {"id": row_id, "name": "x", "f": 1.0}, **extra}


def test_a_transaction_cut_short_before_the_cutover_is_no_gap(tmp_path):
    """An incomplete transaction (forged, or cut short) whose commit LSN precedes the cutover
    of every table it names loses nothing: taken for a gap, it made the table stale, and the
    snapshot it was bootstrapped from again had it after its marker: a loop for ever."""
    store = MirrorStore(tmp_path / "m.db")
    mirror = Mirror(PlatformSettings(), TABLES, tmp_path / "m.db", report=lambda line: None)
    for table in TABLES:
        _bootstrap(store, table)  # (cutover 0/100)
    try:
        follow = _follow(store, mirror, 1,
                         _insert("users", 0x50, 2, tx_tables={"users": 1}),  # whole, before
                         _insert("users", 0x80, 3),  # before the cutover, never completed
                         _insert("users", 0x300, 4, tx_tables={"users": 1}))
        assert not follow.stale
        assert [row[0] for row in store._db.execute('SELECT id FROM "users" ORDER BY id')] \
            == [1, 4]
    finally:
        store.close()


def test_a_table_stale_at_a_change_asks_for_a_snapshot_past_that_transaction(tmp_path):
    """A snapshot whose cutover LSN equals the commit LSN of the change that did not fit
    would apply it again: the table asks for one past it."""
    store = MirrorStore(tmp_path / "m.db")
    mirror = Mirror(PlatformSettings(), TABLES, tmp_path / "m.db", report=lambda line: None)
    for table in TABLES:
        _bootstrap(store, table)
    try:
        forged = _insert("users", 0x200, 2, tx_tables={"users": 1})
        forged["data"] = {"id": 2, "nope": 1}
        follow = _follow(store, mirror, 1, forged)
        assert list(follow.stale) == ["users"]
        state = store.state("users")
        assert state is not None and state.status == "stale" and state.stale_lsn == 0x201
    finally:
        store.close()
