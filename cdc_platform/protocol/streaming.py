"""Pure framing of the streaming replication protocol's CopyData messages. No I/O.

After ``START_REPLICATION`` the connection is in COPY BOTH mode and every CopyData payload
starts with a Byte1 tag (PostgreSQL docs, *Streaming Replication Protocol*):

* server -> client ``'w'`` XLogData: "Int64 The starting point of the WAL data in this
  message. Int64 The current end of WAL on the server. Int64 The server's system clock at
  the time of transmission, as microseconds since midnight on 2000-01-01. Byten A section
  of the WAL data stream." For logical replication the section is one pgoutput message.
* server -> client ``'k'`` Primary keepalive: "Int64 The current end of WAL on the server.
  Int64 The server's system clock ... Byte1 1 means that the client should reply to this
  message as soon as possible, to avoid a timeout disconnect. 0 otherwise."
* client -> server ``'r'`` Standby status update: "Int64 The location of the last WAL byte
  + 1 received and written to disk in the standby. Int64 ... flushed to disk ... Int64 ...
  applied ... Int64 The client's system clock ... Byte1 If 1, the client requests the
  server to reply to this message immediately."
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from cdc_platform.errors import ProtocolError

__all__ = [
    "XLOGDATA_HEADER_SIZE",
    "PrimaryKeepalive",
    "XLogData",
    "parse_copy_data",
    "pg_clock_now",
    "standby_status_update",
]

#: Bytes before the payload of an XLogData message ('w' + three Int64): a pgoutput message
#: can be decoded in place with ``decode_message(copy_data, XLOGDATA_HEADER_SIZE)``.
XLOGDATA_HEADER_SIZE: Final = 25

_XLOGDATA = struct.Struct(">QQq")
_KEEPALIVE = struct.Struct(">QqB")
_STATUS = struct.Struct(">cQQQqB")
_MAX_LSN = 0xFFFF_FFFF_FFFF_FFFF
# Seconds between the Unix epoch and PostgreSQL's epoch (2000-01-01 UTC).
_PG_EPOCH_UNIX: Final = 946_684_800


@dataclass(frozen=True, slots=True)
class XLogData:
    """'w': WAL data -- for logical replication one pgoutput message.

    ``buffer`` is the CopyData message as received, header included, never copied. Fastest
    decode: ``decode_message(x.buffer, XLOGDATA_HEADER_SIZE)`` (no slice, no copy);
    ``x.payload`` is a zero-copy memoryview of the message, ``bytes(x.payload)`` a copy."""

    wal_start: int
    wal_end: int
    send_time: int  # microseconds since 2000-01-01 UTC
    buffer: bytes | bytearray | memoryview

    @property
    def payload(self) -> memoryview:
        """The pgoutput message: a view into ``buffer`` (no copy)."""
        return memoryview(self.buffer)[XLOGDATA_HEADER_SIZE:]


@dataclass(frozen=True, slots=True)
class PrimaryKeepalive:
    """'k': the server's WAL end and clock; ``reply_requested`` asks for a status update
    now (before ``wal_sender_timeout``)."""

    wal_end: int
    send_time: int
    reply_requested: bool


def _slot_setter(name: str) -> Callable[[XLogData, Any], None]:
    """The slot descriptor's setter of a frozen XLogData field (one is built per message:
    the frozen dataclass's __init__ costs several times as much)."""
    setter: Callable[[XLogData, Any], None] = getattr(XLogData, name).__set__
    return setter


_new_object = object.__new__
_set_wal_start = _slot_setter("wal_start")
_set_wal_end = _slot_setter("wal_end")
_set_send_time = _slot_setter("send_time")
_set_buffer = _slot_setter("buffer")
_unpack_xlogdata = _XLOGDATA.unpack_from


def parse_copy_data(buf: bytes | bytearray | memoryview) -> XLogData | PrimaryKeepalive:
    """One CopyData payload of the replication stream -> XLogData or PrimaryKeepalive."""
    try:
        wal_start, wal_end, send_time = _unpack_xlogdata(buf, 1)
    except struct.error:  # shorter than an XLogData header: a keepalive, or an error
        return _parse_short(buf)
    if buf[0] != 0x77:  # 'w'
        return _parse_short(buf)
    # Slot descriptors instead of the frozen dataclass's __init__ (object.__setattr__ per
    # field): half the cost, the same object.
    message = _new_object(XLogData)
    _set_wal_start(message, wal_start)
    _set_wal_end(message, wal_end)
    _set_send_time(message, send_time)
    _set_buffer(message, buf)
    return message


def _parse_short(buf: bytes | bytearray | memoryview) -> PrimaryKeepalive:
    size = len(buf)
    if size == 0:
        raise ProtocolError("empty CopyData message in the replication stream")
    tag = buf[0]
    if tag == 0x77:  # 'w'
        raise ProtocolError(f"truncated XLogData message: {size} bytes, "
                            f"header needs {XLOGDATA_HEADER_SIZE}")
    if tag == 0x6B:  # 'k'
        if size != 1 + _KEEPALIVE.size:
            raise ProtocolError(f"primary keepalive message must be {1 + _KEEPALIVE.size} "
                                f"bytes, got {size}")
        wal_end, send_time, reply = _KEEPALIVE.unpack_from(buf, 1)
        return PrimaryKeepalive(wal_end, send_time, bool(reply))
    raise ProtocolError(f"unknown replication CopyData message type {chr(tag)!r} (0x{tag:02x})")


def pg_clock_now() -> int:
    """The current time as PostgreSQL's clock: microseconds since 2000-01-01 UTC."""
    return time.time_ns() // 1000 - _PG_EPOCH_UNIX * 1_000_000


def standby_status_update(write_lsn: int, flush_lsn: int, apply_lsn: int,
                          reply_requested: bool = False, now: int | None = None) -> bytes:
    """The 'r' CopyData payload reporting the standby's write/flush/apply positions.

    For logical replication ``flush_lsn`` is what the server may treat as confirmed (it
    advances the slot's ``confirmed_flush_lsn``). ``now`` is PostgreSQL clock microseconds
    (default :func:`pg_clock_now`)."""
    for label, lsn in (("write_lsn", write_lsn), ("flush_lsn", flush_lsn),
                       ("apply_lsn", apply_lsn)):
        if isinstance(lsn, bool) or not isinstance(lsn, int) or not 0 <= lsn <= _MAX_LSN:
            raise ValueError(f"{label} must be an LSN int in 0..2**64-1, got {lsn!r}")
    if now is None:
        now = pg_clock_now()
    return _STATUS.pack(b"r", write_lsn, flush_lsn, apply_lsn, now, 1 if reply_requested else 0)
