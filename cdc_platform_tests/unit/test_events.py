"""MessageBuilder: change records -> JetStream messages (pure)."""

from __future__ import annotations

import json

import msgpack
import pytest

from cdc_platform.bridge.events import BuiltBatch, MessageBuilder, relation_fingerprint
from cdc_platform.protocol.changes import (
    ChangeRecord,
    LogicalMessageReceived,
    RelationChanged,
    TransactionCommitted,
)
from cdc_platform.protocol.pgoutput import Relation, RelationColumn
from cdc_platform.wire import WATERMARK_PREFIX


def _build(builder: MessageBuilder, events: list) -> BuiltBatch:
    """``builder.build`` with its schema events filled in as the bridge fills them."""
    built = builder.build(events)
    for slot in built.schema_events:
        built.messages[slot.index] = builder.schema_event(
            slot, {"columns": [{"name": c.name} for c in slot.relation.columns]},
            previous_fingerprint=None, needs_snapshot=False, reason=None)
    return built


def _events(built: BuiltBatch, decode=msgpack.unpackb, *, schema: bool = False) -> list[dict]:
    """Every event of ``built`` (batches unpacked); schema events only with ``schema``."""
    events = []
    for message in built.messages:
        decoded = decode(message.payload)
        events.extend(decoded if isinstance(decoded, list) else [decoded])
    return [e for e in events if schema or e["operation"] != "SCHEMA"]


def _message(content: bytes) -> LogicalMessageReceived:
    return LogicalMessageReceived(lsn=0x1_0000_0010, prefix=WATERMARK_PREFIX, content=content,
                                  transactional=True, commit_lsn=0x1_0000_0100)


def test_a_watermark_becomes_a_marker_message():
    content = json.dumps({"snapshot_id": "20261122T113400Z-1a2b3c4d", "table": "users"})
    built = MessageBuilder("msgpack").build([_message(content.encode())])
    [message] = built.messages
    assert message.subject == "cdc.cdc-platform.watermark.20261122T113400Z-1a2b3c4d"
    assert message.msg_id == "watermark:20261122T113400Z-1a2b3c4d"
    marker = msgpack.unpackb(message.payload)
    assert marker["lsn"] == "1/10" and marker["commit_lsn"] == "1/100"
    assert marker["table"] == "users" and built.watermarks == [marker]


def test_messages_under_the_watermark_prefix_that_are_not_watermarks_are_skipped(caplog):
    """They stay in the WAL: raising would stop the bridge at the same place forever."""
    bad = [b"snap-1:low", b"\xff\x00", b"[1]", b'{"table": "users"}',
           b'{"snapshot_id": 7}', b'{"snapshot_id": "a.b"}', b'{"snapshot_id": "x y"}']
    built = MessageBuilder("msgpack").build([_message(content) for content in bad])
    assert built.messages == [] and built.watermarks == []
    assert caplog.text.count("not a snapshot watermark") == len(bad)


# -- a table altered inside a transaction -----------------------------------------------------
def _relation(*columns: str) -> Relation:
    return Relation(16400, "public", "users", "d",
                    tuple(RelationColumn(name, 23, -1, name == "id") for name in columns))


def _insert(ordinal: int, row: dict) -> ChangeRecord:
    return ChangeRecord(table="users", schema="public", operation="INSERT",
                        relation_id=16400, lsn=0x1_0000_0100 + ordinal,
                        commit_lsn=0x1_0000_0900, xid=77, commit_ts="2026-11-22T10:00:00Z",
                        ordinal=ordinal, new=row, old=None, old_kind=None, unchanged_toast=())


@pytest.mark.parametrize("fmt", ["msgpack", "json"])
@pytest.mark.parametrize("mode", ["per-change", "batched"])
def test_changes_after_an_alter_in_the_same_transaction_carry_the_new_fingerprint(fmt, mode):
    """ALTER TABLE between two inserts of one transaction: PostgreSQL sends a second Relation
    message; the second change must not reuse what was prepared for the first shape."""
    before, after = _relation("id"), _relation("id", "score")
    built = _build(MessageBuilder(fmt, mode), [
        RelationChanged(before, None), _insert(0, {"id": 1}),
        RelationChanged(after, before), _insert(1, {"id": 2, "score": 5}),
        TransactionCommitted(0x1_0000_0900, 0x1_0000_0930, "2026-11-22T10:00:00Z", 77, 2)])
    decode = msgpack.unpackb if fmt == "msgpack" else json.loads
    events = _events(built, decode)
    assert [event["data"] for event in events] == [{"id": 1}, {"id": 2, "score": 5}]
    assert [event["schema_fingerprint"] for event in events] == [
        relation_fingerprint(before), relation_fingerprint(after)]
    assert relation_fingerprint(before) != relation_fingerprint(after)
    # each shape is announced in stream order, before the first change that uses it
    assert [(e["operation"], e["ordinal"]) for e in _events(built, decode, schema=True)] == [
        ("SCHEMA", 0), ("INSERT", 0), ("SCHEMA", 1), ("INSERT", 1)]
    assert [m.subject for m in built.messages if m.subject.endswith(".schema")] == [
        "cdc.users.schema"] * 2
    assert [dict(message.headers)["Cdc-Schema-Fingerprint"] for message in built.messages] \
        == [relation_fingerprint(before)] * 2 + [relation_fingerprint(after)] * 2
    assert built.counts == {("users", "INSERT"): 2}


@pytest.mark.parametrize("writer", ["compiled", "python"])
@pytest.mark.parametrize("mode", ["per-change", "batched"])
def test_raw_columns_are_named_in_the_event_and_logged_once(writer, mode, caplog):
    """A value no converter accepted travels as its text; the event says which columns."""
    builder = MessageBuilder("msgpack", mode, compiled=writer == "compiled")
    relation = _relation("id", "score")
    raw = [_insert(0, {"id": 1, "score": "x1"}), _insert(1, {"id": 2, "score": "x2"})]
    for record in raw:
        record.raw_columns = ("score",)
    built = _build(builder, [
        RelationChanged(relation, None), *raw, _insert(2, {"id": 3, "score": 4}),
        TransactionCommitted(0x1_0000_0900, 0x1_0000_0930, "2026-11-22T10:00:00Z", 77, 3)])
    events = _events(built)
    assert [event.get("raw_columns") for event in events] == [["score"], ["score"], None]
    assert events[0]["data"] == {"id": 1, "score": "x1"}
    assert caplog.text.count("no converter accepts") == 1
    assert "public.users" in caplog.text and "{'id': 1}" in caplog.text


def test_a_new_session_drops_the_open_batch_the_server_will_resend():
    """Cut after 1,200 changes of a transaction, the server resends it from the start: what
    was held (500-999) and open (1000-1199) must not be published beside the replay's."""
    builder = MessageBuilder("msgpack", "batched")
    relation = _relation("id")
    first = _build(builder, [RelationChanged(relation, None),
                           *(_insert(o, {"id": o}) for o in range(1200))])
    assert [m.msg_id for m in first.messages] == ["1/900:0:schema", "1/900:0-499"]
    builder.reset()
    again = _build(builder, [RelationChanged(relation, None),
                           *(_insert(o, {"id": o}) for o in range(1500)),
                           TransactionCommitted(0x1_0000_0900, 0x1_0000_0930,
                                                "2026-11-22T10:00:00Z", 77, 1500)])
    assert [m.msg_id for m in again.messages] == [
        "1/900:0:schema", "1/900:0-499", "1/900:500-999", "1/900:1000-1499"]


def _other(ordinal: int) -> ChangeRecord:
    return ChangeRecord(table="orders", schema="public", operation="INSERT",
                        relation_id=16401, lsn=0x1_0000_0100 + ordinal,
                        commit_lsn=0x1_0000_0900, xid=77, commit_ts="2026-11-22T10:00:00Z",
                        ordinal=ordinal, new={"n": ordinal}, old=None, old_kind=None,
                        unchanged_toast=())


@pytest.mark.parametrize("writer", ["compiled", "python"])
@pytest.mark.parametrize("mode", ["per-change", "batched"])
def test_each_tables_last_change_carries_the_transactions_tables(writer, mode):
    """users, orders, users, users, orders: the last users change and the last orders change
    carry tx_tables = {users: 3, orders: 2}; nothing else does; every change is sent once."""

    builder = MessageBuilder("msgpack", mode, batch_max_events=2,
                             compiled=writer == "compiled")
    users = _relation("id")
    orders = Relation(16401, "public", "orders", "d", (RelationColumn("n", 23, -1, True),))
    built = _build(builder, [
        RelationChanged(users, None), RelationChanged(orders, None),
        _insert(0, {"id": 0}), _other(1), _insert(2, {"id": 2}), _insert(3, {"id": 3}),
        _other(4),
        TransactionCommitted(0x1_0000_0900, 0x1_0000_0930, "2026-11-22T10:00:00Z", 77, 5)])
    events = _events(built)
    assert sorted(e["ordinal"] for e in events) == [0, 1, 2, 3, 4]
    marked = {e["ordinal"]: e["tx_tables"] for e in events if "tx_tables" in e}
    assert marked == {3: {"users": 3, "orders": 2}, 4: {"users": 3, "orders": 2}}
    users_order = [e["ordinal"] for e in events if e["table"] == "users"]
    assert users_order == [0, 2, 3]  # a table's changes stay in order
    # both implementations send the same bytes
    other = MessageBuilder("msgpack", mode, batch_max_events=2,
                           compiled=writer != "compiled")
    again = _build(other, [
        RelationChanged(users, None), RelationChanged(orders, None),
        _insert(0, {"id": 0}), _other(1), _insert(2, {"id": 2}), _insert(3, {"id": 3}),
        _other(4),
        TransactionCommitted(0x1_0000_0900, 0x1_0000_0930, "2026-11-22T10:00:00Z", 77, 5)])
    assert [m.payload for m in again.messages] == [m.payload for m in built.messages]


def test_a_transaction_spanning_reads_is_marked_at_its_commit():
    builder = MessageBuilder("msgpack", "per-change")
    first = _build(builder, [RelationChanged(_relation("id"), None), _insert(0, {"id": 0}),
                           _insert(1, {"id": 1})])
    assert [m.msg_id for m in first.messages] == ["1/900:0:schema", "1/900:0"]  # 1 waits
    second = _build(builder, [TransactionCommitted(0x1_0000_0900, 0x1_0000_0930,
                                                 "2026-11-22T10:00:00Z", 77, 2)])
    (last,) = second.messages
    assert msgpack.unpackb(last.payload)["tx_tables"] == {"users": 2}
    assert second.position == 0x1_0000_0930
