"""The protocol-level pull reader (jetstream/pull.py) against a real nats-server: every message
once and in order, statuses, a deleted consumer, a reconnect, big messages, and the path where
nats-py delivers the messages itself."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig

from cdc_platform.dev.servers import LocalNatsServer
from cdc_platform.jetstream.connection import close_nats, connect_nats
from cdc_platform.jetstream.pull import _SINKS_ATTRIBUTE, PullConsumerGone, PullReader
from cdc_platform.settings import NatsSettings


@pytest.fixture
async def nats_server(tmp_path):
    server = LocalNatsServer(tmp_path / "nats", max_payload=64 * 1024)
    server.start()
    yield server
    server.stop()


async def _setup(server: LocalNatsServer, count: int, size: int = 10):
    client = await connect_nats(NatsSettings(url=server.url))
    js = client.jetstream()
    await js.add_stream(StreamConfig(name="EV", subjects=["ev.>"]))
    for number in range(count):
        # every third message is on a subject the consumer does not want
        subject = "ev.skip" if number % 3 == 2 else f"ev.keep.{number}"
        await js.publish(subject, number.to_bytes(4, "big") * (size // 4),
                         headers={"Nats-Msg-Id": f"m{number}", "X-Number": str(number)})
    info = await js.add_consumer("EV", ConsumerConfig(
        filter_subjects=["ev.keep.>"], ack_policy=AckPolicy.NONE,
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=1))
    return client, js, info.name


async def _read_all(reader: PullReader, wanted: int, limit: int = 50) -> list:
    got: list = []
    deadline = time.monotonic() + 30
    while len(got) < wanted and time.monotonic() < deadline:
        got.extend(await reader.fetch(limit, timeout=1.0))
    return got


async def test_every_message_once_in_stream_order_with_its_headers(nats_server):
    client, js, consumer = await _setup(nats_server, 300)
    reader = PullReader(client, "EV", consumer, batch=7)  # many requests, open and ending
    await reader.start()
    try:
        got = await _read_all(reader, 200)
        assert [m.stream_seq for m in got] == [n + 1 for n in range(300) if n % 3 != 2]
        assert all(m.subject == f"ev.keep.{m.stream_seq - 1}" for m in got)
        assert all(m.headers["X-Number"] == str(m.stream_seq - 1) for m in got)
        assert all(m.data[:4] == (m.stream_seq - 1).to_bytes(4, "big") for m in got)
        started = time.monotonic()
        assert await reader.fetch(50, timeout=0.5) == []  # idle: empty after the timeout
        assert 0.4 < time.monotonic() - started < 3
        # a message stored while a request waits arrives without another request
        waiting = asyncio.ensure_future(reader.fetch(50, timeout=5.0))
        await asyncio.sleep(0.3)
        await js.publish("ev.keep.late", b"late")
        late = await waiting
        assert [m.data for m in late] == [b"late"]
        info = await js.consumer_info("EV", consumer)
        assert reader.unread(info.delivered.consumer_seq) == 0
    finally:
        await reader.stop()
        await close_nats(client, 5)


async def test_messages_the_server_delivered_but_the_caller_has_not_had_count_as_unread(
        nats_server):
    client, js, consumer = await _setup(nats_server, 30)
    reader = PullReader(client, "EV", consumer, batch=100)
    await reader.start()
    try:
        first = await reader.fetch(5, timeout=2.0)
        await asyncio.sleep(0.3)  # the rest of the open request arrives meanwhile
        info = await js.consumer_info("EV", consumer)
        assert info.num_pending == 0
        assert reader.unread(info.delivered.consumer_seq) == 20 - len(first)
        assert reader.unread(info.delivered.consumer_seq + 2) == 22 - len(first)
    finally:
        await reader.stop()
        await close_nats(client, 5)


async def test_messages_near_max_payload_all_arrive(nats_server):
    client, _js, consumer = await _setup(nats_server, 60, size=60 * 1024)
    reader = PullReader(client, "EV", consumer, batch=512, max_bytes=100 * 1024)
    await reader.start()
    try:
        assert reader.max_bytes >= 2 * 64 * 1024  # one message always fits a request
        got = await _read_all(reader, 40)
        assert [m.stream_seq for m in got] == [n + 1 for n in range(60) if n % 3 != 2]
        assert all(len(m.data) == 60 * 1024 for m in got)
    finally:
        await reader.stop()
        await close_nats(client, 5)


async def test_a_deleted_consumer_ends_the_reader(nats_server):
    client, js, consumer = await _setup(nats_server, 3)
    reader = PullReader(client, "EV", consumer, batch=10)
    await reader.start()
    try:
        await _read_all(reader, 2)
        await reader.fetch(10, timeout=0.3)  # a request is open
        await js.delete_consumer("EV", consumer)
        with pytest.raises(PullConsumerGone, match="409 Consumer Deleted|503"):
            for _ in range(10):
                await reader.fetch(10, timeout=1.0)
    finally:
        await reader.stop()
        await close_nats(client, 5)


async def test_a_reconnect_ends_the_reader(tmp_path):
    server = LocalNatsServer(tmp_path / "nats")
    server.start()
    client, _js, consumer = await _setup(server, 3)
    reader = PullReader(client, "EV", consumer, batch=10)
    await reader.start()
    try:
        await _read_all(reader, 2)
        server.stop()
        server.start()
        with pytest.raises(PullConsumerGone, match="reconnected|closed|ended"):
            for _ in range(20):
                await reader.fetch(10, timeout=1.0)
    finally:
        await reader.stop()
        await close_nats(client, 5)
        server.stop()


async def test_without_the_hook_nats_py_delivers_the_same_messages(nats_server):
    client, _js, consumer = await _setup(nats_server, 90)
    reader = PullReader(client, "EV", consumer, batch=16)
    await reader.start()
    getattr(client, _SINKS_ATTRIBUTE).pop(reader._sid)  # as if nats-py no longer called it
    try:
        got = await _read_all(reader, 60)
        assert [m.stream_seq for m in got] == [n + 1 for n in range(90) if n % 3 != 2]
        assert all(m.headers["X-Number"] == str(m.stream_seq - 1) for m in got)
        assert await reader.fetch(10, timeout=0.3) == []  # statuses end requests here too
    finally:
        await reader.stop()
        await close_nats(client, 5)
