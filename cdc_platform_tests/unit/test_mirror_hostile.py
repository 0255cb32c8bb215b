"""No payload stops the mirror: random bytes and random maps that look like events (the right
table, operations and LSNs, with wrong fields, types and values) go through the follower's
per-message path on a real SQLite file. Each is refused or makes its table stale; nothing
escapes, and a genuine change still applies afterwards."""

from __future__ import annotations

import json
import math
import random

import msgpack
import pytest

from cdc_platform.jetstream.pull import PulledMessage
from cdc_platform.mirror.columns import TableShape
from cdc_platform.mirror.follower import Mirror, _Following
from cdc_platform.mirror.store import MirrorStore
from cdc_platform.mirror.transactions import TransactionCollector
from cdc_platform.settings import PlatformSettings

TABLES = ("users", "keyless")
SCHEMAS = {
    "users": {"table": "users", "fingerprint": "f1", "primary_key": ["id"], "columns": [
        {"name": "id", "type_oid": 23, "data_type": "integer"},
        {"name": "name", "type_oid": 25, "data_type": "text"},
        {"name": "f", "type_oid": 701, "data_type": "double precision"}]},
    "keyless": {"table": "keyless", "fingerprint": "f2", "primary_key": [], "columns": [
        {"name": "f", "type_oid": 701, "data_type": "double precision"},
        {"name": "raw", "type_oid": 17, "data_type": "bytea"},
        {"name": "mood", "type_oid": 98765, "data_type": "mood"}]},
}
FIELDS = ("table", "operation", "commit_lsn", "ordinal", "msg_id", "data", "old", "old_kind",
          "tx_tables", "table_schema", "needs_snapshot", "commit_ts", "unchanged_toast",
          "cascade", "restart_identity", "raw_columns", "nope")
OPERATIONS = ("INSERT", "UPDATE", "DELETE", "TRUNCATE", "SCHEMA")


def _value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(14 if depth < 3 else 10)
    return [
        lambda: None, lambda: rng.random() < 0.5, lambda: rng.randint(-5, 5),
        lambda: rng.choice([1 << 63, -(1 << 63) - 1, (1 << 64) - 1, 2**31]),
        lambda: rng.choice([0.0, -0.0, math.nan, math.inf, -math.inf, 1.5, 1e308]),
        lambda: rng.choice(["", "x", "NaN", "0/1", "FFFFFFFF/FFFFFFFF", "users", "\x00",
                            "\ud800", "2025-13-45T99:00:00Z", "a" * 3000]),
        lambda: rng.randbytes(rng.randrange(8)),
        lambda: rng.choice(TABLES), lambda: rng.choice(OPERATIONS),
        lambda: msgpack.ExtType(rng.randrange(128), b"\x01"),
        lambda: [_value(rng, depth + 1) for _ in range(rng.randrange(4))],
        lambda: {rng.choice(["id", "name", "f", "raw", "mood", "nope", 7, ""]):
                 _value(rng, depth + 1) for _ in range(rng.randrange(4))},
        lambda: {"users": rng.randint(-1, 3), rng.choice(TABLES): rng.choice([1, "1", None])},
        lambda: rng.choice([SCHEMAS["users"], SCHEMAS["keyless"], {**SCHEMAS["users"],
                            "columns": [{"name": "id"}]}, {"table": "users", "columns": []},
                            {**SCHEMAS["keyless"], "table": "users"}]),
    ][kind]()


def _event(rng: random.Random, table: str, commit_lsn: str) -> dict:
    """A map with the fields a change has, most of them plausible, some of them wrong."""
    event = {"table": table, "operation": rng.choice(OPERATIONS), "commit_lsn": commit_lsn,
             "ordinal": rng.randrange(3), "data": {"id": rng.randrange(5), "name": "n"}}
    for _ in range(rng.randrange(1, 5)):
        event[rng.choice(FIELDS)] = _value(rng)
    return event


def _payload(rng: random.Random, table: str, commit_lsn: str) -> bytes:
    shape = rng.randrange(10)
    if shape == 0:
        return rng.randbytes(rng.randrange(40))
    if shape == 1:
        return b"[" * 100_000  # nested deeper than Python recurses
    events = [_event(rng, table, commit_lsn) for _ in range(rng.randrange(1, 3))]
    value = events if shape == 2 else events[0]
    if shape == 3:
        return json.dumps(value, default=repr).encode()
    try:
        return msgpack.packb(value)
    except (ValueError, TypeError, OverflowError):  # (a lone surrogate, an int past 64 bits)
        return msgpack.packb(repr(value))


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
            data = _payload(rng, table, f"0/{lsn:X}")
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
