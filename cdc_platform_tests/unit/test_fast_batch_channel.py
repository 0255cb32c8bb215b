"""The ADR-50 fast-ingest channel without a server (hypothesis state machine): a model of
nats-server's batch rules (gap mode ``fail``, cumulative flow acks, the commit's PubAck,
dedupe by message id) under random traffic, frames lost in transit, replies lost, timeouts and
batches the server abandons. Whatever happens, the stream holds the messages in publish order
with none twice, the publisher never counts a message stored that the stream does not hold
(duplicates are checked: what the commit shows was dropped is looked up in the stream), and
once the faults stop everything is stored."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cdc_platform.publishing.channels import FastBatchChannel
from cdc_platform.publishing.framing import frame_sequence
from cdc_platform.publishing.ledger import Ledger, RateMeter
from cdc_platform.publishing.messages import Held, OutgoingMessage, PublishStats

INBOX = "_INBOX.test"
UNKNOWN_BATCH = 10208


def _run(coroutine: Any) -> Any:
    """Drive a coroutine that never really waits (the fake wire returns at once)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    raise AssertionError("the channel waited on something")


class _Wire:
    """Frames written, in transit until the test delivers them to the server (or loses them)."""

    name = "test"

    def __init__(self) -> None:
        self.in_transit: list[tuple[bytes, bytes, bytes | None, bytes]] = []

    async def write(self, frames: Any) -> None:
        self.in_transit.extend(frames)

    async def write_sequence(self, held: list[Held], reply_prefix: bytes, first_seq: int,
                             reply_suffix: bytes) -> None:
        self.in_transit.extend(frame_sequence(held, reply_prefix, first_seq, reply_suffix))


class _Server:
    """nats-server's side of ADR-50 fast ingest, as the channel relies on it."""

    def __init__(self) -> None:
        self.stream: list[bytes] = []  # payload = message id
        self.batches: dict[str, dict[str, int]] = {}
        self.dead: set[str] = set()
        self.replies: list[tuple[str, bytes]] = []
        self.abandon_next = False

    def receive(self, reply: bytes, payload: bytes) -> None:
        reply_text = reply.decode()
        batch_id, flow, _mode, seq_text, op = reply_text[len(INBOX) + 1:].split(".")[:5]
        seq = int(seq_text)
        if batch_id in self.dead:
            return
        state = self.batches.setdefault(batch_id, {"next": 1, "count": 0})
        if self.abandon_next:
            self.abandon_next = False
            self.dead.add(batch_id)
            self.replies.append((reply_text, json.dumps(
                {"type": "err", "seq": seq, "error": {"code": 400, "err_code": UNKNOWN_BATCH,
                                                      "description": "batch unknown"}}).encode()))
            return
        if seq != state["next"]:  # gap mode fail: nothing after a missing frame
            self.dead.add(batch_id)
            self.replies.append((reply_text, json.dumps(
                {"type": "gap", "last_seq": state["next"] - 1, "seq": seq}).encode()))
            return
        if op == "3":  # the commit marker: not stored
            self.dead.add(batch_id)
            self.replies.append((reply_text, json.dumps(
                {"stream": "T", "seq": len(self.stream), "batch": batch_id,
                 "count": state["count"]}).encode()))
            return
        if seq == 1 and payload in self.stream:
            # A batch whose first message is a duplicate ends there: a PubAck naming it.
            self.dead.add(batch_id)
            self.replies.append((reply_text, json.dumps(
                {"stream": "T", "seq": self.stream.index(payload) + 1, "duplicate": True,
                 "batch": batch_id, "count": 1}).encode()))
            return
        state["next"] += 1
        state["count"] += 1
        if payload not in self.stream:  # Nats-Msg-Id dedupe
            self.stream.append(payload)
        flow_size = int(flow)
        if seq == 1 or seq % flow_size == 0:
            self.replies.append((reply_text, json.dumps(
                {"type": "ack", "seq": seq, "msgs": flow_size}).encode()))


class FastBatchMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.ledger = Ledger()
        self.wire = _Wire()
        self.server = _Server()
        self.published: list[bytes] = []
        self.channel = FastBatchChannel(
            self, self.ledger, self.wire, INBOX, PublishStats(), RateMeter(),
            commit_idle=0.01, commit_max_delay=0.05, flow=None, last_seq=0)

    # -- the publisher's side (Host) ---------------------------------------------------------
    def confirm_through(self, end: int) -> None:
        self.ledger.confirm_through(end, self.now)

    def confirm_one(self, index: int) -> None:
        self.ledger.confirm_one(index, self.now)

    def heard(self) -> None:
        pass

    def duplicate(self, index: int, seq: int) -> None:
        # what the publisher's check finds: the stream holds this message under its id
        held = self.ledger.held_at(index)
        assert held is not None and self.server.stream[seq - 1] == held[2]
        self.ledger.confirm_one(index, self.now)

    def check_batch(self, first: int, end: int, after_seq: int | None, last_seq: int) -> None:
        for held in self.ledger.held_range(first, end):
            assert held[2] in self.server.stream
        self.ledger.confirm_through(end, self.now)

    def reject(self, index: int | None, status: int | None, err_code: int | None,
               description: str) -> None:
        raise AssertionError(f"rejected {index}: {status} {err_code} {description}")

    def no_responders(self, index: int) -> None:
        raise AssertionError("no responders")

    def request_resend(self, reason: str) -> None:
        self._resend()

    def _resend(self) -> None:  # what the publisher does: everything unconfirmed again
        self.ledger.requeue()
        self.channel.reset()

    # -- traffic and faults ------------------------------------------------------------------
    @rule(count=st.integers(min_value=1, max_value=40))
    def publish(self, count: int) -> None:
        held = []
        for _ in range(count):
            message_id = str(len(self.published)).encode()
            self.published.append(message_id)
            held.append((b"t.x", b"NATS/1.0\r\n\r\n", message_id,
                         OutgoingMessage("t.x", message_id.decode(), message_id), 20))
        self.ledger.accept(held, 20 * count, 20, len(self.published))
        self.channel.last_accept = self.now

    @rule(flush=st.booleans(), later=st.floats(min_value=0, max_value=0.1))
    def pump(self, flush: bool, later: float) -> None:
        self.now += later
        _run(self.channel.pump(self.now, self.ledger.accepted if flush else 0))

    @precondition(lambda self: self.wire.in_transit)
    @rule(count=st.integers(min_value=1, max_value=50))
    def transmit(self, count: int) -> None:
        frames, self.wire.in_transit = (self.wire.in_transit[:count],
                                        self.wire.in_transit[count:])
        for _subject, reply, _header, payload in frames:
            self.server.receive(reply, payload)

    @precondition(lambda self: self.server.replies)
    @rule(count=st.integers(min_value=1, max_value=20), lose=st.booleans())
    def reply(self, count: int, lose: bool) -> None:
        replies, self.server.replies = (self.server.replies[:count],
                                        self.server.replies[count:])
        if not lose:
            for subject, data in replies:
                self.channel.on_reply(subject, data, None, False)

    @precondition(lambda self: self.wire.in_transit)
    @rule(count=st.integers(min_value=1, max_value=5))
    def lose_frames(self, count: int) -> None:
        del self.wire.in_transit[:count]

    @rule()
    def timeout(self) -> None:  # the ack timeout or a reconnect: outcome unknown
        self._resend()

    @rule()
    def server_abandons_the_batch(self) -> None:
        self.server.abandon_next = True

    # -- what must always hold ---------------------------------------------------------------
    @invariant()
    def the_stream_keeps_publish_order_without_duplicates(self) -> None:
        stream = self.server.stream
        assert stream == self.published[:len(stream)]

    @invariant()
    def nothing_counts_as_stored_that_is_not(self) -> None:
        assert self.ledger.stored <= len(self.server.stream)

    def teardown(self) -> None:
        """The faults stop: pumping, transmitting and replying store everything."""
        self.server.abandon_next = False
        for _ in range(10_000):
            if self.ledger.stored == self.ledger.accepted:
                break
            self.now += 0.02
            _run(self.channel.pump(self.now, self.ledger.accepted))
            frames, self.wire.in_transit = self.wire.in_transit, []
            for _subject, reply, _header, payload in frames:
                self.server.receive(reply, payload)
            replies, self.server.replies = self.server.replies, []
            for subject, data in replies:
                self.channel.on_reply(subject, data, None, False)
            if not frames and not replies and (self.ledger.sent
                                                or self.channel.owed_since() is not None):
                self._resend()  # silence while a reply is owed: the publisher's ack timeout
        assert self.ledger.stored == self.ledger.accepted
        assert self.server.stream == self.published


TestFastBatchChannel = FastBatchMachine.TestCase
TestFastBatchChannel.settings = settings(max_examples=200, stateful_step_count=50,
                                         deadline=None)
