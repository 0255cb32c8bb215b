"""JetStreamPublisher against a real nats-server: order, completeness, positions, limits, outages.

Every test uses its own stream (random name and subjects). Tests that stop, pause or restart
NATS start their own server, so the shared session server is never disturbed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import signal
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import pytest
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import NotFoundError

from cdc_platform.dev.servers import LocalNatsServer
from cdc_platform.errors import PublishError
from cdc_platform.jetstream.connection import connect_nats
from cdc_platform.publishing import JetStreamPublisher, OutgoingMessage, PublishRejected, framing
from cdc_platform.publishing import publisher as publisher_module
from cdc_platform.settings import NatsSettings
from cdc_platform.wire import MessageSigner, SignatureVerifier
from cdc_platform_tests import golden

MODES = ["fast-batch", "per-message"]


@dataclass
class Stream:
    name: str
    prefix: str   # subjects are "<prefix>.<table>"

    def messages(self, start: int, count: int, size: int = 64) -> list[OutgoingMessage]:
        """Messages with ids ``m<start>`` ... over three subjects, payload naming the id."""
        return [OutgoingMessage(subject=f"{self.prefix}.table{i % 3}", msg_id=f"m{i}",
                                payload=f"{i}:".encode().ljust(size, b"."),
                                headers=(("Cdc-Schema-Fingerprint", f"fp{i % 3}"),))
                for i in range(start, start + count)]


async def create_stream(js, *, batched: bool = True, **config) -> Stream:
    token = secrets.token_hex(4)
    stream = Stream(name=f"T_{token}", prefix=f"t{token}")
    await js.add_stream(StreamConfig(name=stream.name, subjects=[f"{stream.prefix}.>"],
                                     storage=StorageType.FILE, duplicate_window=120,
                                     allow_batched=batched or None, **config))
    return stream


@pytest.fixture
async def js(nats_client):
    return nats_client.jetstream()


@pytest.fixture
async def streams(js) -> AsyncIterator[list[Stream]]:
    """Streams a test creates on the shared server; deleted afterwards."""
    created: list[Stream] = []
    yield created
    for stream in created:
        with contextlib.suppress(NotFoundError):   # some tests delete their stream themselves
            await js.delete_stream(stream.name)


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[LocalNatsServer]:
    """A nats-server of the test's own, to stop, pause and restart."""
    server = LocalNatsServer(tmp_path / "nats")
    server.start()
    yield server
    if server.process is not None and server.process.poll() is None:
        os.kill(server.process.pid, signal.SIGCONT)
    server.stop()


class Stored(NamedTuple):
    seq: int
    msg_id: str
    subject: str
    payload: bytes
    fingerprint: str | None


async def read_stream(js, stream: Stream) -> list[Stored]:
    """Every message of the stream, in stream order."""
    total = (await js.stream_info(stream.name)).state.messages
    stored: list[Stored] = []
    complete = asyncio.Event()

    async def collect(message) -> None:   # a push consumer: far quicker than fetch() here
        stored.append(Stored(message.metadata.sequence.stream, message.headers["Nats-Msg-Id"],
                             message.subject, message.data,
                             message.headers.get("Cdc-Schema-Fingerprint")))
        if len(stored) == total:
            complete.set()

    if total == 0:
        return stored
    subscription = await js.subscribe(
        f"{stream.prefix}.>", stream=stream.name, cb=collect, manual_ack=True,
        config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL))
    try:
        await asyncio.wait_for(complete.wait(), 30)
    finally:
        await subscription.unsubscribe()
    return stored


def assert_exactly(stored: list[Stored], expected: list[OutgoingMessage], *,
                   ordered: bool = True) -> None:
    """The stream holds exactly ``expected`` once each (and in that order if ``ordered``)."""
    ids = [message.msg_id for message in stored]
    assert len(ids) == len(set(ids)), "a message was stored twice"
    if ordered:
        assert ids == [message.msg_id for message in expected]
        assert [message.seq for message in stored] == list(range(1, len(expected) + 1))
        assert [(message.subject, message.payload, message.fingerprint) for message in stored] \
            == [(message.subject, message.payload, dict(message.headers)["Cdc-Schema-Fingerprint"])
                for message in expected]
    else:
        assert sorted(ids) == sorted(message.msg_id for message in expected)


async def publish_in_calls(publisher: JetStreamPublisher, messages: list[OutgoingMessage],
                           *, seed: int = 1, largest: int = 300) -> None:
    """Publish in calls of random size; each call's position = messages published so far."""
    rng = random.Random(seed)
    done = 0
    while done < len(messages):
        count = rng.randint(1, largest)
        await publisher.publish(messages[done:done + count], position=min(done + count,
                                                                          len(messages)))
        done += count


async def watch_positions(js, stream: Stream, publisher: JetStreamPublisher,
                          stop: asyncio.Event) -> int:
    """Whenever a position is reported stored, the stream holds at least that many messages."""
    checks = 0
    while not stop.is_set():
        position = publisher.stored_position
        if position is not None:
            stored = (await js.stream_info(stream.name)).state.messages
            assert stored >= position, f"position {position} reported, stream has {stored}"
            checks += 1
        await asyncio.sleep(0.002)
    return checks


# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
async def test_publishes_50k_in_order_and_completely(nats_client, js, streams, mode):
    stream = await create_stream(js)
    streams.append(stream)
    notified: list[int] = []
    publisher = JetStreamPublisher(nats_client, stream=stream.name, mode=mode,
                                   on_stored=notified.append)
    await publisher.start()
    assert publisher.mode == mode and publisher.stats.wire == "raw-hpub"
    messages = stream.messages(0, 50_000)

    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_positions(js, stream, publisher, stop))
    await publish_in_calls(publisher, messages)
    assert await publisher.flush(timeout=30) == 50_000
    stop.set()
    assert await watcher > 0
    await publisher.close()

    assert_exactly(await read_stream(js, stream), messages)
    assert notified == sorted(set(notified)) and notified[-1] == 50_000
    stats = publisher.stats
    assert stats.messages_published == stats.messages_stored == stats.messages_sent == 50_000
    assert stats.resends == 0 and stats.last_ack_latency is not None
    if mode == "fast-batch":
        assert stats.batches >= 1 and stats.commits >= 1


@pytest.mark.parametrize("mode", MODES)
async def test_in_flight_never_exceeds_the_limits(nats_client, js, streams, mode):
    stream = await create_stream(js)
    streams.append(stream)
    publisher = JetStreamPublisher(nats_client, stream=stream.name, mode=mode,
                                   max_in_flight_messages=500, max_in_flight_bytes=48 * 1024)
    await publisher.start()
    peak = [0, 0]
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], publisher.in_flight_messages)
            peak[1] = max(peak[1], publisher.in_flight_bytes)
            await asyncio.sleep(0)

    sampler = asyncio.create_task(sample())
    messages = stream.messages(0, 10_000, size=100)
    for start in range(0, len(messages), 50):
        await publisher.publish(messages[start:start + 50], position=start + 50)
        assert publisher.in_flight_messages <= 500
        assert publisher.in_flight_bytes <= 48 * 1024
    await publisher.flush(timeout=30)
    stop.set()
    await sampler
    await publisher.close()

    assert 0 < peak[0] <= 500 and 0 < peak[1] <= 48 * 1024
    assert publisher.stats.peak_in_flight_messages <= 500
    assert publisher.stats.peak_in_flight_bytes <= 48 * 1024
    assert_exactly(await read_stream(js, stream), messages)


async def test_nats_restart_mid_stream_loses_nothing_and_keeps_order(own_nats):
    """Fast-ingest batches: NATS down for 10 s mid-stream, back on the same port and store."""
    nc = await connect_nats(NatsSettings(url=own_nats.url), name="publisher-restart",
                            reconnect_forever=True)
    try:
        js = nc.jetstream()
        stream = await create_stream(js)
        publisher = JetStreamPublisher(nc, stream=stream.name, mode="fast-batch",
                                       max_in_flight_messages=5_000)
        await publisher.start()
        messages = stream.messages(0, 40_000)
        producer = asyncio.create_task(publish_in_calls(publisher, messages, largest=100))
        while (publisher.stored_position or 0) < 8_000:
            await asyncio.sleep(0.001)

        await asyncio.to_thread(own_nats.stop)
        while nc.is_connected:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)   # acks received before the disconnect may still be queued
        outage_position = publisher.stored_position
        await asyncio.sleep(9.5)
        # Nothing can be stored without a server, and publish() blocks on the full window.
        assert publisher.stored_position == outage_position
        assert not producer.done() and publisher.in_flight_messages <= 5_000
        await asyncio.to_thread(own_nats.start)
        assert (await js.stream_info(stream.name)).state.messages >= outage_position

        await asyncio.wait_for(producer, 60)
        assert await publisher.flush(timeout=60) == 40_000
        await publisher.close()
        assert publisher.stats.recoveries >= 1
        assert publisher.stats.duplicate_conflicts == 0   # resends are no conflicts
        assert_exactly(await read_stream(js, stream), messages)
    finally:
        await nc.close()


async def test_per_message_restart_stores_every_message_once(own_nats):
    """Per-message PubAcks after a short outage: complete and without duplicates."""
    nc = await connect_nats(NatsSettings(url=own_nats.url), name="publisher-restart",
                            reconnect_forever=True)
    try:
        js = nc.jetstream()
        stream = await create_stream(js, batched=False)
        publisher = JetStreamPublisher(nc, stream=stream.name, max_in_flight_messages=5_000)
        await publisher.start()
        assert publisher.mode == "per-message"
        messages = stream.messages(0, 30_000)
        producer = asyncio.create_task(publish_in_calls(publisher, messages, largest=100))
        while (publisher.stored_position or 0) < 5_000:
            await asyncio.sleep(0.001)
        await asyncio.to_thread(own_nats.stop)
        await asyncio.sleep(2)
        await asyncio.to_thread(own_nats.start)
        await asyncio.wait_for(producer, 60)
        assert await publisher.flush(timeout=60) == 30_000
        await publisher.close()
        assert publisher.stats.duplicate_conflicts == 0   # resends are no conflicts
        # Resends after a reconnect may land out of order on this path (see the module doc).
        assert_exactly(await read_stream(js, stream), messages, ordered=False)
    finally:
        await nc.close()


@pytest.mark.parametrize("mode", MODES)
async def test_silent_server_means_resend_with_same_ids(own_nats, mode):
    """No ack within ack_timeout (server paused) → resend; dedupe keeps it exactly-once."""
    nc = await connect_nats(NatsSettings(url=own_nats.url), name="publisher-pause")
    try:
        js = nc.jetstream()
        stream = await create_stream(js)
        # 5,000 in flight stay below nats-py's 2 MB outbound buffer, so the sender is never
        # stuck in a write while the server sleeps, and the ack timeout must act.
        publisher = JetStreamPublisher(nc, stream=stream.name, mode=mode, ack_timeout=0.5,
                                       max_in_flight_messages=5_000)
        await publisher.start()
        messages = stream.messages(0, 30_000)
        producer = asyncio.create_task(publish_in_calls(publisher, messages, largest=100))
        while (publisher.stored_position or 0) < 5_000:
            await asyncio.sleep(0.001)
        os.kill(own_nats.process.pid, signal.SIGSTOP)   # mid-window: frames and acks pending
        try:
            await asyncio.sleep(1.5)
        finally:
            os.kill(own_nats.process.pid, signal.SIGCONT)
        await asyncio.wait_for(producer, 30)
        assert await publisher.flush(timeout=30) == 30_000
        await publisher.close()
        assert publisher.stats.resends > 0, publisher.stats
        assert_exactly(await read_stream(js, stream), messages)
    finally:
        await nc.close()


async def test_auto_mode_follows_the_stream(nats_client, js, streams):
    batched, plain = await create_stream(js), await create_stream(js, batched=False)
    streams.extend([batched, plain])
    for stream, expected in ((batched, "fast-batch"), (plain, "per-message")):
        publisher = JetStreamPublisher(nats_client, stream=stream.name)
        await publisher.start()
        assert publisher.mode == expected
        await publisher.publish(stream.messages(0, 10), position=10)
        assert await publisher.flush(timeout=10) == 10
        await publisher.close()

    with pytest.raises(PublishError, match="allow_batched"):
        await JetStreamPublisher(nats_client, stream=plain.name, mode="fast-batch").start()
    with pytest.raises(PublishError, match="does not exist"):
        await JetStreamPublisher(nats_client, stream="NO_SUCH_STREAM").start()


async def test_oversize_message_is_refused_before_sending(nats_client, js, streams):
    stream = await create_stream(js)
    streams.append(stream)
    publisher = JetStreamPublisher(nats_client, stream=stream.name)
    await publisher.start()
    big = OutgoingMessage(f"{stream.prefix}.big", "big-1", b"x" * nats_client.max_payload)
    with pytest.raises(PublishError) as refused:
        await publisher.publish([*stream.messages(0, 3), big], position=1)
    text = str(refused.value)
    assert f"{stream.prefix}.big" in text and "big-1" in text
    header_block = len(b"NATS/1.0\r\nNats-Msg-Id: big-1\r\n\r\n")
    assert f"is {nats_client.max_payload + header_block} bytes" in text
    assert publisher.in_flight_messages == 0          # nothing of the call was queued

    # The publisher is still usable; the refused call left no trace.
    await publisher.publish(stream.messages(0, 3), position=2)
    assert await publisher.flush(timeout=10) == 2
    await publisher.close()
    assert (await js.stream_info(stream.name)).state.messages == 3


async def test_subject_outside_the_stream_is_refused_before_sending(nats_client, js, streams):
    stream = await create_stream(js)
    streams.append(stream)
    publisher = JetStreamPublisher(nats_client, stream=stream.name)
    await publisher.start()
    with pytest.raises(PublishError, match="not captured by stream"):
        await publisher.publish([OutgoingMessage("elsewhere.table", "x-1", b"{}")], position=1)
    with pytest.raises(PublishError, match="Nats-Msg-Id"):
        await publisher.publish([OutgoingMessage(f"{stream.prefix}.a", "bad\r\nid", b"{}")])
    assert publisher.in_flight_messages == 0
    await publisher.close()


@pytest.mark.parametrize("mode", MODES)
async def test_no_responders_fails_and_holds_the_position(nats_client, js, streams, mode):
    """Nothing captures the subject any more (stream deleted) → 503 → PublishRejected."""
    stream = await create_stream(js)
    streams.append(stream)
    publisher = JetStreamPublisher(nats_client, stream=stream.name, mode=mode)
    await publisher.start()
    await publisher.publish(stream.messages(0, 100), position=100)
    assert await publisher.flush(timeout=10) == 100
    await js.delete_stream(stream.name)

    await publisher.publish(stream.messages(100, 100), position=200)
    with pytest.raises(PublishRejected) as rejected:
        await publisher.flush(timeout=10)
    assert rejected.value.status == 503 and rejected.value.msg_id == "m100"
    assert "no longer exists" in str(rejected.value)
    assert publisher.stored_position == 100
    assert publisher.in_flight_messages == 100        # kept, not dropped
    with pytest.raises(PublishRejected):               # and it stays failed
        await publisher.publish(stream.messages(200, 1), position=201)
    await publisher.close()


@pytest.mark.parametrize("mode", MODES)
async def test_jetstream_error_reply_stops_before_the_failed_message(nats_client, js, streams,
                                                                     mode):
    """A stream that refuses message 1001 (max_msgs, discard new): position stays at 900."""
    stream = await create_stream(js, max_msgs=1_000, discard=DiscardPolicy.NEW)
    streams.append(stream)
    publisher = JetStreamPublisher(nats_client, stream=stream.name, mode=mode)
    await publisher.start()
    messages = stream.messages(0, 1_500)
    for call in range(10):   # positions 1..10, 150 messages each; call 7 holds 901..1050
        await publisher.publish(messages[call * 150:(call + 1) * 150], position=call + 1)
    with pytest.raises(PublishRejected) as rejected:
        await publisher.flush(timeout=10)
    assert rejected.value.msg_id == "m1000"
    assert "maximum messages" in rejected.value.description
    assert rejected.value.err_code is not None
    assert publisher.stored_position == 6
    await publisher.close()
    stored = await read_stream(js, stream)
    assert [message.msg_id for message in stored] == [f"m{i}" for i in range(1_000)]


@pytest.mark.parametrize("mode", MODES)
async def test_replayed_duplicates_count_as_stored(nats_client, js, streams, mode):
    """A source replaying from an earlier position: dedupe stores nothing twice and the
    reported position never goes back."""
    stream = await create_stream(js)
    streams.append(stream)
    notified: list[int] = []
    publisher = JetStreamPublisher(nats_client, stream=stream.name, mode=mode,
                                   on_stored=notified.append)
    await publisher.start()
    await publisher.publish(stream.messages(0, 1_000), position=10)
    assert await publisher.flush(timeout=10) == 10
    await publisher.publish(stream.messages(500, 1_000), position=5)   # 500 already stored
    assert await publisher.flush(timeout=10) == 10
    await publisher.publish([], position=12)   # nothing outstanding: stored at once
    assert publisher.stored_position == 12
    await publisher.close()
    assert notified == [10, 12]
    assert_exactly(await read_stream(js, stream), stream.messages(0, 1_500))
    # each replayed duplicate was read back and found to be this very message
    assert publisher.stats.duplicates_checked >= (500 if mode == "per-message" else 1)
    assert publisher.stats.duplicate_conflicts == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("planted", [[0], [5], [3, 4, 900]], ids=["first", "later", "several"])
async def test_an_id_taken_by_other_content_is_an_alarm_and_the_message_is_stored(
        nats_client, js, streams, mode, planted, caplog):
    """Someone stored other content under ids the publisher is about to use: each such
    duplicate is a conflict (an error line naming id, subject and stored sequence; a count),
    and the message is stored all the same, under its id + ``:conflict:`` + random hex; its
    position is reported only then. A batch's first message, a later one, several."""
    stream = await create_stream(js)
    streams.append(stream)
    messages = stream.messages(0, 1_000)
    for index in planted:
        await js.publish(messages[index].subject, b"forged", stream=stream.name,
                         headers={"Nats-Msg-Id": messages[index].msg_id})
    publisher = JetStreamPublisher(nats_client, stream=stream.name, mode=mode)
    await publisher.start()
    await publish_in_calls(publisher, messages, largest=100)
    assert await publisher.flush(timeout=30) == 1_000
    await publisher.close()

    stored = await read_stream(js, stream)
    assert [message.payload for message in stored[:len(planted)]] == [b"forged"] * len(planted)
    genuine = stored[len(planted):]
    # every message once, the replaced ones under their new ids
    assert sorted(message.payload for message in genuine) == sorted(
        message.payload for message in messages)
    replaced = {message.msg_id.split(":conflict:")[0]: message for message in genuine
                if ":conflict:" in message.msg_id}
    assert sorted(replaced) == sorted(messages[index].msg_id for index in planted)
    for index in planted:
        again = replaced[messages[index].msg_id]
        assert (again.subject, again.payload) == (messages[index].subject,
                                                  messages[index].payload)
        assert len(again.msg_id.split(":conflict:")[1]) == 16
        line = next(record.getMessage() for record in caplog.records
                    if record.levelname == "ERROR" and messages[index].msg_id + " " in
                    record.getMessage())
        assert f"stream seq {planted.index(index) + 1}" in line and messages[index].subject in line
    assert publisher.stats.duplicate_conflicts == len(planted)


@pytest.mark.parametrize("mode", MODES)
async def test_a_signed_change_stored_again_under_its_new_id_is_signed_for_it(
        nats_client, js, streams, mode):
    """The signature binds the id: a change stored again as ``{id}:conflict:...`` carries a
    signature of that id, so a mirror trusting the key applies it (before, the headers of the
    first try were sent again as they were, and the mirror refused the genuine change)."""
    stream = await create_stream(js)
    streams.append(stream)
    messages = stream.messages(0, 20)
    await js.publish(messages[3].subject, b"forged", stream=stream.name,
                     headers={"Nats-Msg-Id": messages[3].msg_id})
    signer = MessageSigner(golden.SIGNING_SEED)
    publisher = JetStreamPublisher(nats_client, stream=stream.name, mode=mode, signer=signer)
    await publisher.start()
    await publisher.publish(messages, position=1)
    assert await publisher.flush(timeout=30) == 1
    await publisher.close()
    assert publisher.stats.duplicate_conflicts == 1
    verifier = SignatureVerifier([signer.public_key])
    replaced = [message for message in await read_stream(js, stream)
                if ":conflict:" in message.msg_id]
    assert len(replaced) == 1
    again = await js.get_msg(stream.name, seq=replaced[0].seq)
    assert again.subject == messages[3].subject and again.data == messages[3].payload
    assert verifier.refusal(again.subject, again.headers, again.data) is None


@pytest.mark.parametrize("mode", MODES)
async def test_an_id_taken_while_the_publisher_runs_is_an_alarm_too(nats_client, js, streams,
                                                                     mode):
    """Other content stored between two calls under the id of a message of the next call,
    with one more foreign message (a fast batch then moves the stream by one more than its
    size and is looked up in the stream by id): the same alarm, every message stored."""
    stream = await create_stream(js)
    streams.append(stream)
    messages = stream.messages(0, 20)
    publisher = JetStreamPublisher(nats_client, stream=stream.name, mode=mode)
    await publisher.start()
    await publisher.publish(messages[:10], position=10)
    assert await publisher.flush(timeout=10) == 10
    await js.publish(messages[12].subject, b"forged", headers={"Nats-Msg-Id": "m12"})
    await js.publish(messages[0].subject, b"foreign", headers={"Nats-Msg-Id": "x1"})
    await publisher.publish(messages[10:], position=20)
    assert await publisher.flush(timeout=10) == 20
    await publisher.close()

    stored = await read_stream(js, stream)
    assert [message.payload for message in stored[10:12]] == [b"forged", b"foreign"]
    genuine = [message for message in stored if message.payload not in (b"forged", b"foreign")]
    assert sorted(message.payload for message in genuine) == sorted(
        message.payload for message in messages)
    assert [message.msg_id.split(":conflict:")[0] for message in genuine
            if ":conflict:" in message.msg_id] == ["m12"]
    assert publisher.stats.duplicate_conflicts == 1


async def test_fast_batch_tail_is_committed_when_the_caller_goes_idle(nats_client, js, streams):
    """No flush(): the messages after the last flow ack are committed once the caller idles."""
    stream = await create_stream(js)
    streams.append(stream)
    # Flow 500: no flow ack covers three messages, only the commit can.
    publisher = JetStreamPublisher(nats_client, stream=stream.name, mode="fast-batch", flow=500)
    await publisher.start()
    loop = asyncio.get_running_loop()
    for round_ in range(3):
        started = loop.time()
        await publisher.publish(stream.messages(round_ * 3, 3), position=round_ + 1)
        while publisher.stored_position != round_ + 1:
            await asyncio.sleep(0.001)
            assert loop.time() - started < 1.0, "the batch tail was held back"
    assert publisher.stats.commits >= 3
    await publisher.close()


async def test_public_api_wire_when_the_raw_wire_is_unavailable(nats_client, js, streams,
                                                              monkeypatch):
    """If nats-py's internals change, publishing goes through nc.publish, still in order."""
    async def no_raw_wire(nc, timeout=2.0):
        return None

    monkeypatch.setattr(publisher_module, "probe_raw_wire", no_raw_wire)
    stream = await create_stream(js)
    streams.append(stream)
    publisher = JetStreamPublisher(nats_client, stream=stream.name)
    await publisher.start()
    assert publisher.stats.wire == "nc.publish"
    messages = stream.messages(0, 5_000)
    await publish_in_calls(publisher, messages)
    assert await publisher.flush(timeout=10) == 5_000
    await publisher.close()
    assert_exactly(await read_stream(js, stream), messages)


def test_subject_matching_follows_nats_wildcards():
    matches = framing.subject_matches
    assert matches("cdc.>", "cdc.public.users") and matches("cdc.*.users", "cdc.public.users")
    assert not matches("cdc.>", "cdc") and not matches("cdc.*", "cdc.public.users")
    assert matches("cdc", "cdc") and not matches("cdc", "cdcx")
