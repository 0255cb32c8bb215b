"""A NATS protocol reader that hands the pull reader's messages over without nats-py's parser.

nats-py's parser (``nats.protocol.parser.Parser``) matches each frame with regular expressions,
removes it from the front of a ``bytearray`` (``del buf[:n]``: a move of everything after it,
twice per message) and awaits ``Client._process_msg`` for it. Measured on a mirror reading
200K changes: 9-10 µs of CPU per message for reading alone, 6.5 µs with this reader and less
with its compiled twin (``_speedups/jetstream/frames.pyx``; ``benchmarks/mirror.py``).
:class:`FrameReader` takes the parser's place on a client
(:func:`~cdc_platform.jetstream.nats_internals.swap_parser`: it is fed every chunk read from
the socket) and walks each chunk by offset instead:

- ``MSG``/``HMSG`` frames for a subscription with a sink go to that sink synchronously, a run of
  them at a time (:func:`deliver`);
- ``MSG``/``HMSG`` frames for any other subscription go to nats-py's message handler, as its
  parser would send them;
- every other complete control line (``PING``, ``PONG``, ``+OK``, ``-ERR``, ``INFO``) goes to
  nats-py's own parser, which acts on it exactly as before.

The NATS client protocol (docs.nats.io, "Client Protocol"): ``MSG <subject> <sid> [reply-to]
<#bytes>\\r\\n[payload]\\r\\n`` and ``HMSG <subject> <sid> [reply-to] <#header bytes> <#total
bytes>\\r\\n[headers][payload]\\r\\n``, the header block counted in the total.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nats.errors import ProtocolError

from cdc_platform.jetstream.nats_internals import MessageHandler, Sink, parser_is_idle
from cdc_platform.speedups import compiled_twin

_CRLF = b"\r\n"
# nats-server's default max_control_line; a longer line without CRLF is not a frame we know
MAX_CONTROL_LINE = 4096


class Frame:
    """One parsed ``MSG``/``HMSG`` frame (``end``: the offset after its trailing CRLF)."""

    __slots__ = ("end", "headers", "payload", "reply", "sid", "subject")

    def __init__(self, data: bytes, position: int, line_end: int) -> None:
        """Parse the frame whose control line is ``data[position:line_end]``; ``end`` is
        beyond ``len(data)`` when the rest of it has not arrived."""
        try:
            parts = data[position:line_end].split()
            has_headers = parts[0] == b"HMSG"
            if len(parts) == (6 if has_headers else 5):
                reply = parts[3]
            elif len(parts) == (5 if has_headers else 4):
                reply = b""
            else:
                raise ValueError(len(parts))
            total = int(parts[-1])
            header_size = int(parts[-2]) if has_headers else 0
            self.sid = int(parts[2])
        except (IndexError, ValueError):
            raise ProtocolError("nats: malformed MSG") from None
        if total < 0 or not 0 <= header_size <= total:
            raise ProtocolError("nats: malformed MSG")
        body = line_end + 2
        self.subject, self.reply = parts[1], reply
        self.end = body + total + 2
        self.headers = data[body:body + header_size] if header_size else None
        self.payload = data[body + header_size:body + total]


def is_message(data: bytes, position: int) -> bool:
    return data.startswith(b"MSG ", position) or data.startswith(b"HMSG ", position)


def deliver_python(data: bytes, position: int, sinks: dict[int, Sink]) -> int:
    """Hand the complete ``MSG``/``HMSG`` frames from ``position`` on whose sid has a sink to
    that sink, in order; stop at the end of ``data``, at an incomplete frame or at anything
    else (a frame for another sid, a control line). Returns where it stopped."""
    end = len(data)
    while position < end and is_message(data, position):
        line_end = data.find(_CRLF, position)
        if line_end < 0:
            break
        frame = Frame(data, position, line_end)
        sink = sinks.get(frame.sid)
        if sink is None or frame.end > end:
            break
        sink(frame.subject, frame.reply, frame.payload, frame.headers)
        position = frame.end
    return position


#: :func:`deliver_python`, or its compiled twin (the same frames to the same sinks).
deliver: Callable[[bytes, int, dict[int, Sink]], int] = deliver_python


class FrameReader:
    """Reads the protocol stream of one nats-py client, in place of its parser ``original``;
    ``process_msg``: nats-py's handler of the messages no sink takes."""

    def __init__(self, process_msg: MessageHandler, original: Any,
                 sinks: dict[int, Sink]) -> None:
        self._process_msg = process_msg
        self._original = original  # nats-py's parser: every frame other than MSG/HMSG
        self._sinks = sinks
        self._pending = b""  # the start of a frame not complete yet
        self._chunks: list[bytes] = []  # a large frame's chunks while it arrives
        self._waiting = 0  # bytes the frame in _chunks needs in all (0: none)
        self._have = 0

    def reset(self) -> None:
        """A new connection: nothing carried over (nats-py calls this on reconnect)."""
        self._pending = b""
        self._chunks = []
        self._waiting = self._have = 0
        self._original.reset()

    def __getattr__(self, name: str) -> Any:  # anything else nats-py may read off its parser
        return getattr(self._original, name)

    async def parse(self, data: bytes = b"") -> None:
        original = self._original
        if not parser_is_idle(original):
            # installed while nats-py's parser held part of a frame: it finishes that first
            await original.parse(data)
            return
        if self._waiting:  # a large frame: join its chunks once, when it is whole
            self._chunks.append(data)
            self._have += len(data)
            if self._have < self._waiting:
                return
            data = b"".join(self._chunks)
            self._chunks, self._waiting, self._have = [], 0, 0
        elif self._pending:
            data = self._pending + data
            self._pending = b""
        position, end = 0, len(data)
        while position < end:
            position = deliver(data, position, self._sinks)
            if position >= end:
                break
            line_end = data.find(_CRLF, position)
            if line_end < 0:
                if end - position > MAX_CONTROL_LINE:
                    raise ProtocolError("nats: control line too long")
                break
            if is_message(data, position):
                frame = Frame(data, position, line_end)
                if frame.end > end:  # the rest of it comes with later reads
                    self._chunks, self._have = [data[position:]], end - position
                    self._waiting = frame.end - position
                    return
                position = frame.end
                sink = self._sinks.get(frame.sid)  # (one may have been added meanwhile)
                if sink is not None:
                    sink(frame.subject, frame.reply, frame.payload, frame.headers)
                else:
                    await self._process_msg(frame.sid, frame.subject, frame.reply,
                                            frame.payload, frame.headers)
            else:  # PING, PONG, +OK, -ERR, INFO: nats-py's parser acts on the whole line
                start, position = position, line_end + 2
                await original.parse(data[start:position])
        if position < end:
            self._pending = data[position:]


# The compiled twin (cdc_platform/speedups.py) stands in for these names; mypy checks it
# against them through its stub.
if TYPE_CHECKING:
    from cdc_platform._speedups.jetstream import frames as _twin
else:
    _twin = compiled_twin(__name__)
if _twin is not None:
    deliver = _twin.deliver
