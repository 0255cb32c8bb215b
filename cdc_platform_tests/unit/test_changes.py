"""TransactionAssembler over whole transactions captured from PostgreSQL 15 (and 18)."""

from __future__ import annotations

import gc
import itertools
import json
import struct
import tracemalloc
from decimal import Decimal
from pathlib import Path
from typing import ClassVar

import pytest

from cdc_platform.errors import ProtocolError
from cdc_platform.lsn import parse_lsn
from cdc_platform.protocol.changes import (
    ChangeRecord,
    LogicalMessageReceived,
    RelationChanged,
    RelationResent,
    TransactionAssembler,
    TransactionCommitted,
    relation_shape,
)
from cdc_platform.protocol.pgoutput import (
    UNCHANGED_TOAST,
    Begin,
    Commit,
    Delete,
    Insert,
    Relation,
    RelationColumn,
    StreamStart,
    Update,
    decode_message,
    timestamp_to_iso,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "pgoutput"


class StandIn:
    """A tiny converter factory with the interface of cdc_platform.protocol.values."""

    BY_OID: ClassVar[dict] = {20: int, 21: int, 23: int, 700: float, 701: float, 1700: Decimal,
              16: lambda text: text == "t"}

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    def for_columns(self, columns):
        self.calls.append(tuple(c.name for c in columns))
        return [self.BY_OID.get(c.type_oid, str) for c in columns]


def messages(scenario: str, version: str = "pg15") -> list[tuple[int, object]]:
    lines = (DATA / version / f"{scenario}.jsonl").read_text().splitlines()[1:]
    rows = [json.loads(line) for line in lines]
    return [(parse_lsn(r["lsn"]), decode_message(bytes.fromhex(r["data"]))) for r in rows]


def assemble(scenario: str, version: str = "pg15", converters=None) -> list:
    assembler = TransactionAssembler(converters or StandIn())
    return [event for lsn, message in messages(scenario, version)
            for event in assembler.feed(lsn, message)]


def records(events) -> list[ChangeRecord]:
    return [e for e in events if isinstance(e, ChangeRecord)]


# -- captured transactions -------------------------------------------------------------------
def test_insert_types():
    events = assemble("insert_types")
    assert [type(e) for e in events] == [RelationChanged, ChangeRecord, TransactionCommitted,
                                         ChangeRecord, TransactionCommitted]
    assert events[0].previous is None and events[0].relation.name == "items"
    ts1 = timestamp_to_iso(848660355446153)
    assert events[1] == ChangeRecord(
        table="items", schema="public", operation="INSERT", relation_id=16385,
        lsn=0x15276D8, commit_lsn=22181880, xid=726, commit_ts=ts1, ordinal=0,
        new={"id": 1, "name": "widget", "qty": 42, "price": Decimal("19.99"), "ratio": 0.5,
             "created": "2025-12-08 13:45:21.719719+00", "payload": "\\xdeadbeef",
             "flag": True, "note": "héllo wörld ✓"},
        old=None, old_kind=None, unchanged_toast=())
    assert events[2] == TransactionCommitted(22181880, 22181928, ts1, 726, 1)
    second = events[3]
    assert second.new == {"id": 2, "name": "", "qty": None, "price": None,
                          "ratio": second.new["ratio"], "created": None, "payload": "\\x",
                          "flag": False, "note": None}
    assert second.new["ratio"] != second.new["ratio"]  # NaN
    assert (second.commit_lsn, second.ordinal, second.xid) == (22182088, 0, 727)
    assert events[4].change_count == 1


def test_update_and_delete_with_default_identity():
    events = records(assemble("update_default"))
    plain, key_change, delete = events
    assert plain.operation == "UPDATE" and plain.new == {"id": 1, "owner": "ann",
                                                         "balance": 150}
    assert (plain.old, plain.old_kind, plain.unchanged_toast) == (None, None, ())
    # 'K' sends every column, the non-key ones as NULL: only the key is kept.
    assert key_change.old == {"id": 2} and key_change.old_kind == "K"
    assert key_change.new == {"id": 10, "owner": "bob", "balance": None}
    assert delete.operation == "DELETE" and delete.new is None
    assert (delete.old, delete.old_kind) == ({"id": 1}, "K")


def test_update_and_delete_with_full_identity():
    update, delete = records(assemble("identity_full"))
    assert update.old_kind == "O" and update.old == {"id": 1, "memo": "first", "amount": 5}
    assert update.new == {"id": 1, "memo": "first", "amount": 6}
    assert delete.old_kind == "O" and delete.old == {"id": 1, "memo": "first", "amount": 6}


def test_truncate_of_two_tables():
    events = assemble("truncate")
    # (the second TRUNCATE is preceded by its table's Relation again: the first one
    # invalidated it)
    assert [type(e) for e in events] == [RelationChanged, RelationChanged, ChangeRecord,
                                         ChangeRecord, TransactionCommitted, RelationResent,
                                         ChangeRecord, TransactionCommitted]
    parents, children = events[2], events[3]
    assert (parents.table, parents.ordinal, children.table, children.ordinal) == (
        "parents", 0, "children", 1)
    for record in (parents, children):
        assert record.operation == "TRUNCATE" and record.cascade and record.restart_identity
        assert (record.new, record.old, record.old_kind) == (None, None, None)
        assert record.commit_lsn == 22323704 and record.lsn == 0x154A1C8
    assert events[4].change_count == 2
    alone = events[6]
    assert (alone.table, alone.ordinal, alone.cascade, alone.restart_identity) == (
        "children", 0, False, False)


def test_logical_messages():
    events = assemble("logical_messages")
    assert [type(e) for e in events] == [RelationChanged, ChangeRecord, LogicalMessageReceived,
                                         TransactionCommitted, LogicalMessageReceived,
                                         ChangeRecord, TransactionCommitted]
    assert events[2] == LogicalMessageReceived(22347944, "cdc_platform.watermark",
                                               b"snap-1:low", True, 22347944)
    assert events[3].change_count == 1  # messages take no ordinal
    assert events[4] == LogicalMessageReceived(22348072, "cdc_platform.heartbeat",
                                               b"\x00\xff", False, None)
    assert events[5].ordinal == 0 and events[5].new == {"id": 2, "body": "n2"}


def test_origin_is_reported_at_commit():
    committed = assemble("origin")[-1]
    assert committed == TransactionCommitted(22376936, 22377008, "2025-01-01T00:00:00.000000Z",
                                             749, 1, "cdc_fixture_origin")


def test_custom_types():
    assembler = TransactionAssembler(StandIn())
    events = [e for lsn, m in messages("custom_types") for e in assembler.feed(lsn, m)]
    assert records(events)[0].new == {"id": 1, "mood": "happy", "at": "(1,-2)",
                                      "tags": '{a,"b c",NULL}'}
    assert {oid: t.name for oid, t in assembler.types.items()} == {16450: "mood",
                                                                   16459: "point2"}


def test_unchanged_toast_is_not_null():
    (update,) = records(assemble("unchanged_toast"))
    assert update.new == {"id": 1, "title": "final"}
    assert "body" not in update.new
    assert update.unchanged_toast == ("body",)


def test_multi_insert_rows_get_distinct_ordinals():
    events = assemble("copy_multi_insert")
    rows = records(events)
    assert len(rows) == 100
    assert [r.ordinal for r in rows] == list(range(100))
    assert len({r.lsn for r in rows}) == 1  # one WAL record
    assert len({(r.commit_lsn, r.ordinal) for r in rows}) == 100
    assert rows[0].new == {"id": 1, "name": "name-0001 x", "qty": 7, "price": Decimal("1.25"),
                           "created": "2025-12-08 13:01:07.000037+00"}
    assert events[-1].change_count == 100


def test_schema_change_is_reported_and_converters_are_rebuilt():
    converters = StandIn()
    assembler = TransactionAssembler(converters)
    stream = messages("schema_change")
    events = [e for lsn, m in stream for e in assembler.feed(lsn, m)]
    changes = [e for e in events if isinstance(e, RelationChanged)]
    assert len(changes) == 2
    assert changes[0].previous is None
    assert changes[1].previous == changes[0].relation
    assert [c.name for c in changes[1].relation.columns] == ["id", "a", "b"]
    assert records(events)[1].new == {"id": 2, "a": "two", "b": 2}
    assert converters.calls == [("id", "a"), ("id", "a", "b")]
    # The same Relation again (pgoutput resends them per session and after the table was
    # invalidated): only a RelationResent, and the converters are asked again (types may
    # have become known since).
    again = next(m for _, m in stream if isinstance(m, Relation) and len(m.columns) == 3)
    assert assembler.feed(0, again) == (RelationResent(again),)
    assert len(converters.calls) == 3
    assert assembler.relation(16482) == again and assembler.relations == {16482: again}


def test_relation_shape_covers_types_keys_and_identity():
    base = Relation(1, "public", "t", "d", (RelationColumn("id", 23, -1, True),))
    assert relation_shape(base) == relation_shape(
        Relation(1, "public", "t", "d", (RelationColumn("id", 23, -1, True),)))
    for other in (
        Relation(1, "public", "t", "f", base.columns),
        Relation(1, "public", "t2", "d", base.columns),
        Relation(1, "s", "t", "d", base.columns),
        Relation(1, "public", "t", "d", (RelationColumn("id", 20, -1, True),)),
        Relation(1, "public", "t", "d", (RelationColumn("id", 23, 8, True),)),
        Relation(1, "public", "t", "d", (RelationColumn("id", 23, -1, False),)),
        Relation(1, "public", "t", "d", (RelationColumn("ID", 23, -1, True),)),
    ):
        assert relation_shape(other) != relation_shape(base)


@pytest.mark.parametrize("scenario", ["insert_types", "update_default", "identity_full",
                                      "truncate", "logical_messages", "origin",
                                      "unchanged_toast", "copy_multi_insert", "schema_change"])
def test_postgres_18_assembles_the_same_changes(scenario):
    def shape(events):  # repr: NaN != NaN
        return [repr((r.table, r.operation, r.ordinal, r.new, r.old, r.old_kind,
                      r.unchanged_toast, r.cascade, r.restart_identity))
                for r in records(events)]
    assert shape(assemble(scenario, "pg18")) == shape(assemble(scenario, "pg15"))


def test_streamed_transactions_are_refused_clearly():
    assembler = TransactionAssembler(StandIn())
    with pytest.raises(ProtocolError, match="streamed in-progress transactions.*proto_version"):
        assembler.feed(0, StreamStart(5, True))


# -- identity across restarts ----------------------------------------------------------------
def test_replay_yields_the_same_identities():
    stream = messages("update_default") + messages("truncate")
    first = [(r.commit_lsn, r.ordinal, r.operation, r.table) for r in records(
        e for a in [TransactionAssembler(StandIn())] for lsn, m in stream
        for e in a.feed(lsn, m))]
    # A restart in the middle of a transaction: the server resends from its Begin.
    assembler = TransactionAssembler(StandIn())
    seen = []
    for lsn, m in stream[:6]:
        seen += assembler.feed(lsn, m)
    assert assembler.in_transaction
    with pytest.raises(ProtocolError, match="call reset"):
        assembler.feed(*stream[4])
    assembler.reset()
    replay_from = max(i for i, (_, m) in enumerate(stream[:6]) if isinstance(m, Begin))
    for lsn, m in stream[replay_from:]:
        seen += assembler.feed(lsn, m)
    again = {(r.commit_lsn, r.ordinal, r.operation, r.table) for r in records(seen)}
    assert again == set(first)


# -- errors ------------------------------------------------------------------------------------
REL = Relation(7, "public", "t", "d", (RelationColumn("id", 23, -1, True),
                                       RelationColumn("v", 25, -1, False)))


def fed(*stream):
    assembler = TransactionAssembler(StandIn())
    for lsn, message in stream:
        events = assembler.feed(lsn, message)
    return assembler, events


def test_change_before_relation():
    with pytest.raises(ProtocolError, match="relation 7 before its Relation message"):
        fed((1, Begin(10, 0, 1)), (2, Insert(7, ("1", "a"))))


def test_change_outside_a_transaction():
    with pytest.raises(ProtocolError, match="outside a transaction"):
        fed((1, REL), (2, Insert(7, ("1", "a"))))
    with pytest.raises(ProtocolError, match="without a Begin"):
        fed((1, Commit(0, 10, 11, 0)))


def test_commit_must_match_begin():
    with pytest.raises(ProtocolError, match="differs from the final LSN 0/A"):
        fed((1, Begin(10, 0, 1)), (2, Commit(0, 12, 13, 0)))


def test_tuple_length_must_match_relation():
    with pytest.raises(ProtocolError, match="tuple of 3 columns for public.t"):
        fed((1, REL), (1, Begin(10, 0, 1)), (2, Insert(7, ("1", "a", "b"))))


def test_a_value_no_converter_accepts_stays_text_and_is_named():
    """No single value may stop the stream: the text as PostgreSQL printed it, and the
    column named in raw_columns (in the new row, the old key and the old row alike)."""
    _, (record,) = fed((1, REL), (1, Begin(10, 0, 1)), (2, Insert(7, ("x1", "a"))))
    assert record.new == {"id": "x1", "v": "a"} and record.raw_columns == ("id",)
    _, (record,) = fed((1, REL), (1, Begin(10, 0, 1)),
                       (2, Update(7, "K", ("x2", None), ("x3", "b"))))
    assert record.old == {"id": "x2"} and record.new["id"] == "x3"
    assert record.raw_columns == ("id",)
    _, (record,) = fed((1, REL), (1, Begin(10, 0, 1)), (2, Delete(7, "O", ("1", "c"))))
    assert record.raw_columns == () and record.old == {"id": 1, "v": "c"}


def test_not_a_message():
    with pytest.raises(ProtocolError, match="not a pgoutput message: str"):
        TransactionAssembler(StandIn()).feed(0, "B")  # type: ignore[arg-type]


def test_binary_values_pass_through_and_key_rows_keep_only_keys():
    _, events = fed((1, REL), (1, Begin(10, 0, 1)),
                    (2, Update(7, "K", (b"\x01", None), (b"\x02", UNCHANGED_TOAST))))
    (record,) = events
    assert record.old == {"id": b"\x01"} and record.new == {"id": b"\x02"}
    assert record.unchanged_toast == ("v",)
    _, events = fed((1, REL), (1, Begin(10, 0, 1)), (2, Delete(7, "K", (None, None))))
    assert events[0].old == {"id": None}


# -- streaming, not buffering ------------------------------------------------------------------
def _insert_stream(relation_id: int, rows: int):
    for i in range(rows):
        text = str(i).encode()
        yield decode_message(struct.pack(">cIcHcI", b"I", relation_id, b"N", 2, b"t", len(text))
                             + text + struct.pack(">cI", b"t", 5) + b"hello")


def test_a_large_transaction_streams_in_bounded_memory():
    assembler = TransactionAssembler(StandIn())
    assembler.feed(1, REL)
    assembler.feed(1, Begin(10, 0, 1))
    gc.collect()
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        for count, message in enumerate(_insert_stream(7, 20_000)):
            (record,) = assembler.feed(2, message)  # each row comes back at once
            assert record.ordinal == count
            if count == 1000:
                early = tracemalloc.get_traced_memory()[0]
        late, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert late - baseline < 64 * 1024, "the assembler keeps rows it has returned"
    assert abs(late - early) < 16 * 1024
    assert peak - baseline < 256 * 1024
    (committed,) = assembler.feed(3, Commit(0, 10, 11, 0))
    assert committed.change_count == 20_000


def test_events_come_back_per_message():
    assembler = TransactionAssembler(StandIn())
    stream = messages("copy_multi_insert")
    outputs = [assembler.feed(lsn, m) for lsn, m in stream]
    assert [len(o) for o in outputs] == [0, 1] + [1] * 100 + [1]
    assert list(itertools.chain.from_iterable(outputs))[-1].change_count == 100


# -- the real converters ---------------------------------------------------------------------
def test_with_the_real_value_converters():
    values = pytest.importorskip(
        "cdc_platform.protocol.values", reason="cdc_platform/protocol/values.py not written yet")
    events = assemble("insert_types", converters=values.TypeRegistry())
    first, second = records(events)
    assert first.new["id"] == 1 and first.new["qty"] == 42 and first.new["name"] == "widget"
    assert first.new["note"] == "héllo wörld ✓"
    assert second.new["name"] == "" and second.new["qty"] is None
    rows = records(assemble("copy_multi_insert", converters=values.TypeRegistry()))
    assert [r.new["id"] for r in rows] == list(range(1, 101))


@pytest.mark.parametrize("implementation", ["compiled", "python"])
def test_unchanged_toast_updates_keep_no_memory(implementation, monkeypatch):
    """Each UNCHANGED_TOAST value sends the row builder to the general loop by an exception;
    one shared exception instance grew its traceback on every raise and kept the frames (and
    every batch they referenced) alive."""
    from cdc_platform.protocol import changes
    from cdc_platform.speedups import PURE_PYTHON

    if implementation == "python":
        monkeypatch.setattr(changes, "row_builder", changes.row_builder_python)
    elif changes.row_builder is changes.row_builder_python:
        if PURE_PYTHON:
            pytest.skip("pure Python asked for")
        pytest.fail("the compiled twin is not built")
    assembler = TransactionAssembler(StandIn())
    assembler.feed(1, REL)
    assembler.feed(1, Begin(10, 0, 1))
    update = Update(7, None, None, ("1", UNCHANGED_TOAST))

    def run(count):
        for _ in range(count):
            (record,) = assembler.feed(2, update)
            assert record.unchanged_toast == ("v",)

    run(100)  # warm caches
    gc.collect()
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        run(20_000)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, f"{grown} bytes kept after 20,000 unchanged-TOAST updates"
