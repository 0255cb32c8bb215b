"""The pull reader's protocol reader (``jetstream/frames.py``) against nats-py's own parser:
the same frames, cut into reads anywhere, give the same calls in the same order."""

from __future__ import annotations

import asyncio
import functools
import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nats.errors import ProtocolError
from nats.protocol.parser import Parser

from cdc_platform.jetstream import frames
from cdc_platform.jetstream.frames import FrameReader
from cdc_platform.speedups import compiled_twin

OUR_SIDS = (1, 7)
_COMPILED = compiled_twin("cdc_platform.jetstream.frames")
IMPLEMENTATIONS = [pytest.param(frames.deliver_python, id="python"),
                   pytest.param(_COMPILED.deliver if _COMPILED else None, id="compiled",
                                marks=pytest.mark.skipif(_COMPILED is None,
                                                         reason="not compiled"))]


@pytest.fixture(params=IMPLEMENTATIONS)
def deliver(request, monkeypatch):
    """Each implementation of ``deliver`` in turn, as the one the reader uses."""
    monkeypatch.setattr(frames, "deliver", request.param)
    return request.param


class _Recorder:
    """Stands in for nats-py's client: what its parser calls, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes,
                           headers: bytes | None) -> None:
        self.calls.append(("msg", sid, subject, reply, data, headers))

    async def _process_ping(self) -> None:
        self.calls.append(("ping",))

    async def _process_pong(self) -> None:
        self.calls.append(("pong",))

    async def _process_info(self, info: dict[str, Any]) -> None:
        self.calls.append(("info", info))

    async def _process_err(self, message: str) -> None:
        self.calls.append(("err", message))


def _msg(subject: bytes, sid: int, reply: bytes, headers: bytes | None, data: bytes) -> bytes:
    reply_part = b" " + reply if reply else b""
    if headers is None:
        return b"MSG %s %d%s %d\r\n%s\r\n" % (subject, sid, reply_part, len(data), data)
    return b"HMSG %s %d%s %d %d\r\n%s%s\r\n" % (subject, sid, reply_part, len(headers),
                                                len(headers) + len(data), headers, data)


_tokens = st.text("abcXYZ_-09", min_size=1, max_size=8).map(str.encode)
_subjects = st.lists(_tokens, min_size=1, max_size=4).map(b".".join)
# payloads that look like protocol on purpose
_payloads = st.one_of(st.binary(max_size=300),
                      st.sampled_from([b"", b"\r\n", b"MSG a 1 3\r\nabc\r\n", b"PING\r\n"]))
_headers = st.one_of(
    st.none(),
    st.sampled_from([b"NATS/1.0\r\nNats-Msg-Id: 0/1A:3\r\n\r\n",
                     b"NATS/1.0 408 Request Timeout\r\n\r\n", b"NATS/1.0\r\n\r\n"]))
_messages = st.builds(_msg, _subjects, st.sampled_from([1, 2, 7, 9]),
                      st.one_of(st.just(b""), _subjects), _headers, _payloads)
_control = st.sampled_from([b"PING\r\n", b"PONG\r\n", b"+OK\r\n",
                            b"-ERR 'Stale Connection'\r\n",
                            b'INFO {"server_id":"x","max_payload":1048576}\r\n'])
_streams = st.lists(st.one_of(_messages, _messages, _control), max_size=30).map(b"".join)


def _cut(stream: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    return [stream[a:b] for a, b in itertools.pairwise(points)] or [b""]


async def _through_nats_py(chunks: list[bytes]) -> list[tuple[Any, ...]]:
    recorder = _Recorder()
    parser = Parser(recorder)
    for chunk in chunks:
        await parser.parse(chunk)
    return recorder.calls


async def _through_frames(chunks: list[bytes]) -> list[tuple[Any, ...]]:
    recorder = _Recorder()

    def sink_for(sid: int) -> Any:
        def sink(subject: bytes, reply: bytes, data: bytes, headers: bytes | None) -> None:
            recorder.calls.append(("msg", sid, subject, reply, data, headers))
        return sink

    reader = FrameReader(recorder._process_msg, Parser(recorder),
                         {sid: sink_for(sid) for sid in OUR_SIDS})
    for chunk in chunks:
        await reader.parse(chunk)
    return recorder.calls


@pytest.mark.usefixtures("deliver")
@settings(max_examples=400, deadline=None)
@given(_streams, st.lists(st.integers(min_value=0, max_value=20_000), max_size=12))
def test_every_cut_gives_what_nats_py_gives(stream: bytes, cuts: list[int]) -> None:
    chunks = _cut(stream, cuts)
    expected = asyncio.run(_through_nats_py(chunks))
    assert asyncio.run(_through_frames(chunks)) == expected
    assert asyncio.run(_through_frames([stream])) == expected


@pytest.mark.usefixtures("deliver")
def test_a_frame_larger_than_many_reads_arrives_whole() -> None:
    data = bytes(range(256)) * 4096  # 1 MiB
    stream = _msg(b"cdc.t.insert", 1, b"$JS.ACK.CDC.c.1.5.5.0.0", b"NATS/1.0\r\n\r\n", data)
    stream += b"PING\r\n"
    chunks = [stream[i:i + 32768] for i in range(0, len(stream), 32768)]
    calls = asyncio.run(_through_frames(chunks))
    assert calls == [("msg", 1, b"cdc.t.insert", b"$JS.ACK.CDC.c.1.5.5.0.0",
                      data, b"NATS/1.0\r\n\r\n"), ("ping",)]


@pytest.mark.usefixtures("deliver")
def test_installed_while_nats_py_held_half_a_frame() -> None:
    async def run() -> list[tuple[Any, ...]]:
        recorder = _Recorder()
        original = Parser(recorder)
        frame = _msg(b"a", 1, b"", None, b"hello")
        await original.parse(frame[:7])  # nats-py has read half a frame when we take over
        reader = FrameReader(recorder._process_msg, original, {})
        await reader.parse(frame[7:] + b"PONG\r\n")
        await reader.parse(_msg(b"b", 2, b"r", None, b"x"))
        return recorder.calls

    assert asyncio.run(run()) == [("msg", 1, b"a", b"", b"hello", None), ("pong",),
                                  ("msg", 2, b"b", b"r", b"x", None)]


@pytest.mark.parametrize("line", [b"MSG a\r\n", b"HMSG a 1 x 3\r\n", b"MSG a b 3\r\n",
                                  b"NOPE\r\n"])
@pytest.mark.usefixtures("deliver")
def test_malformed_frames_are_protocol_errors(line: bytes) -> None:
    with pytest.raises(ProtocolError):
        asyncio.run(_through_frames([line]))


@pytest.mark.usefixtures("deliver")
def test_a_control_line_without_end_is_refused_past_the_limit() -> None:
    with pytest.raises(ProtocolError):
        asyncio.run(_through_frames([b"MSG " + b"a" * 5000]))


_odd_lines = st.sampled_from([
    b"MSG a 1 3\r\nabc\r\n", b"MSG a\t1\t3\r\nabc\r\n", b"MSG  a  1   3 \r\nabc\r\n",
    b"HMSG a 1 r 0 3\r\nabc\r\n", b"HMSG a 1 12 14\r\nNATS/1.0\r\n\r\nab\r\n",
    b"MSG a 1 +3\r\nabc\r\n", b"MSG a 1 1_0\r\n0123456789\r\n", b"MSG a 1\x0b3\r\nabc\r\n",
    b"MSG a 7 r x 3\r\nabc\r\n", b"MSG a 2 3\r\nabc\r\n", b"MSG a 1 3\rabc\r\n",
    b"PING\r\n", b"HMSG a 1 4 3\r\nabc\r\n"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(_odd_lines, _messages), max_size=8).map(b"".join))
def test_the_compiled_deliver_stops_where_the_pure_one_does_or_earlier(stream: bytes) -> None:
    """Both hand the same frames to the sinks; where the compiled one stops early (an odd
    separator or number), the pure one given that offset goes on exactly as it would have."""
    if _COMPILED is None:
        pytest.skip("not compiled")

    def run(deliver, start: int = 0) -> tuple[int, list[tuple[Any, ...]]]:
        calls: list[tuple[Any, ...]] = []
        try:
            return deliver(stream, start, _recording_sinks(calls)), calls
        except ProtocolError:
            return -1, calls

    pure_end, pure_calls = run(frames.deliver_python)
    compiled_end, compiled_calls = run(_COMPILED.deliver)
    assert compiled_calls == pure_calls[:len(compiled_calls)]
    if compiled_end != pure_end:  # stopped early: the pure path resumes from there
        resumed_end, resumed_calls = run(frames.deliver_python, compiled_end)
        assert compiled_calls + resumed_calls == pure_calls
        assert resumed_end == pure_end


def _recording_sinks(calls: list[tuple[Any, ...]]) -> dict[int, Any]:
    def record(sid: int, *parts: Any) -> None:
        calls.append((sid, *parts))
    return {sid: functools.partial(record, sid) for sid in OUR_SIDS}
