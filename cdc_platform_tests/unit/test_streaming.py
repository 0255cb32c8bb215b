"""Streaming replication protocol framing (CopyData 'w' / 'k' / 'r') and LSN text form."""

from __future__ import annotations

import struct
import time
from datetime import UTC, datetime

import pytest

from cdc_platform.errors import ProtocolError
from cdc_platform.lsn import format_lsn, parse_lsn
from cdc_platform.protocol.pgoutput import Begin, decode_message, timestamp_to_datetime
from cdc_platform.protocol.streaming import (
    XLOGDATA_HEADER_SIZE,
    PrimaryKeepalive,
    XLogData,
    parse_copy_data,
    pg_clock_now,
    standby_status_update,
)

BEGIN = struct.pack(">cQqI", b"B", 0x16B374D848, 818516721719719, 735)


def xlogdata(payload: bytes, start: int = 0x16B374D000, end: int = 0x16B374E000,
             send_time: int = 818516721719800) -> bytes:
    return struct.pack(">cQQq", b"w", start, end, send_time) + payload


# -- XLogData ----------------------------------------------------------------------------------
def test_xlogdata():
    buf = xlogdata(BEGIN)
    message = parse_copy_data(buf)
    assert isinstance(message, XLogData)
    assert (message.wal_start, message.wal_end, message.send_time) == (
        0x16B374D000, 0x16B374E000, 818516721719800)
    assert bytes(message.payload) == BEGIN
    assert decode_message(message.payload) == Begin(0x16B374D848, 818516721719719, 735)


def test_xlogdata_payload_is_a_view_not_a_copy():
    buf = bytearray(xlogdata(BEGIN))
    payload = parse_copy_data(buf).payload
    assert isinstance(payload, memoryview) and payload.obj is buf
    buf[XLOGDATA_HEADER_SIZE] = ord("X")
    assert payload[0] == ord("X")


def test_decode_in_place_with_the_header_offset():
    buf = xlogdata(BEGIN)
    message = parse_copy_data(buf)
    assert message.buffer is buf
    assert decode_message(message.buffer, XLOGDATA_HEADER_SIZE) == Begin(
        0x16B374D848, 818516721719719, 735)


def test_xlogdata_with_empty_payload_parses():
    assert bytes(parse_copy_data(xlogdata(b"")).payload) == b""


def test_truncated_xlogdata():
    with pytest.raises(ProtocolError, match="truncated XLogData message: 24 bytes"):
        parse_copy_data(xlogdata(b"")[:24])


# -- keepalive ---------------------------------------------------------------------------------
@pytest.mark.parametrize("flag,expected", [(0, False), (1, True)])
def test_keepalive(flag, expected):
    buf = struct.pack(">cQqB", b"k", 0x1234, 99, flag)
    assert parse_copy_data(buf) == PrimaryKeepalive(0x1234, 99, expected)
    assert parse_copy_data(memoryview(buf)) == PrimaryKeepalive(0x1234, 99, expected)


@pytest.mark.parametrize("size", [1, 17, 19])
def test_keepalive_of_wrong_size(size):
    buf = (struct.pack(">cQqB", b"k", 1, 2, 0) + b"\x00")[:size]
    with pytest.raises(ProtocolError, match="keepalive message must be 18 bytes"):
        parse_copy_data(buf)


def test_unknown_and_empty_copy_data():
    with pytest.raises(ProtocolError, match=r"unknown replication CopyData message type 'p'"):
        parse_copy_data(b"p" + bytes(17))
    with pytest.raises(ProtocolError, match="empty"):
        parse_copy_data(b"")


# -- standby status update ---------------------------------------------------------------------
def test_standby_status_update_bytes():
    payload = standby_status_update(0x16B374D848, 0x16B374D000, 0x16B374C000,
                                    reply_requested=True, now=818516721719719)
    assert payload == (b"r" + (0x16B374D848).to_bytes(8, "big")
                       + (0x16B374D000).to_bytes(8, "big") + (0x16B374C000).to_bytes(8, "big")
                       + (818516721719719).to_bytes(8, "big") + b"\x01")
    assert len(payload) == 34
    assert standby_status_update(1, 2, 3, now=0)[-1] == 0


def test_standby_status_update_uses_the_postgres_clock():
    before = pg_clock_now()
    (clock,) = struct.unpack_from(">q", standby_status_update(0, 0, 0), 25)
    assert before <= clock <= pg_clock_now()


def test_pg_clock_is_microseconds_since_2000():
    now = timestamp_to_datetime(pg_clock_now()).replace(tzinfo=UTC)
    assert abs((now - datetime.now(UTC)).total_seconds()) < 5
    assert abs(pg_clock_now() / 1e6 + 946_684_800 - time.time()) < 5


@pytest.mark.parametrize("bad", [-1, 2**64, 1.5, "0/1", True, None])
def test_standby_status_update_validates(bad):
    with pytest.raises(ValueError, match="flush_lsn must be an LSN"):
        standby_status_update(0, bad, 0)


# -- LSN text form -----------------------------------------------------------------------------
@pytest.mark.parametrize("text,value", [
    ("16/B374D848", 0x16B374D848),
    ("0/0", 0),
    ("0/15276D8", 0x15276D8),
    ("FFFFFFFF/FFFFFFFF", 2**64 - 1),
    ("1/0", 2**32),
])
def test_lsn_round_trip(text, value):
    assert parse_lsn(text) == value
    assert format_lsn(value) == text


def test_parse_lsn_is_case_insensitive_and_formats_uppercase_unpadded():
    assert parse_lsn("16/b374d848") == 0x16B374D848
    assert parse_lsn("00000016/0000D848") == 0x160000D848
    assert format_lsn(0x160000D848) == "16/D848"


@pytest.mark.parametrize("text", ["", "16", "16/", "/1", "16/B374D848/1", "G/1",
                                  "123456789/0", "0x16/1", "-1/0", "1 /0", "16:B374D848"])
def test_parse_lsn_rejects(text):
    with pytest.raises(ValueError, match="invalid LSN"):
        parse_lsn(text)


def test_parse_lsn_rejects_non_text():
    with pytest.raises(ValueError, match="must be text"):
        parse_lsn(0x16)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [-1, 2**64, 1.0, "16/1", True])
def test_format_lsn_rejects(value):
    with pytest.raises(ValueError):
        format_lsn(value)  # type: ignore[arg-type]
