"""MessageBuilder: change records -> JetStream messages (pure)."""

from __future__ import annotations

import json

import msgpack

from cdc_platform.bridge.events import MessageBuilder
from cdc_platform.protocol.changes import LogicalMessageReceived
from cdc_platform.wire import WATERMARK_PREFIX


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
