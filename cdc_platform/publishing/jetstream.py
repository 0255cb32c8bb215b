"""Publishing change events to JetStream: in publish order, with bounded memory, losing nothing.

The CDC bridge hands :class:`JetStreamPublisher` lists of :class:`OutgoingMessage` together with
the source position (an LSN) they complete. A position is reported *stored* only once JetStream
has acknowledged every message of that call and of every earlier call, so the bridge may confirm
exactly that LSN to PostgreSQL and nothing beyond it.

Two ways onto the wire; :meth:`JetStreamPublisher.start` picks one ("auto"):

``fast-batch``
    ADR-50 fast-ingest batches (nats-server >= 2.14, stream ``allow_batched: true``). The batch
    control state travels in each message's reply subject
    ``<inbox>.<batch id>.<flow>.fail.<batch seq>.<op>.$FI`` (op 0 start, 1 append, 3 commit with
    an end-of-batch marker that is not stored). The server answers with *cumulative* flow acks
    ``{"type":"ack","seq":N,"msgs":M}`` -- "batch messages 1..N are stored, in order" -- every M
    stored messages, and the commit with a PubAck ``{"stream","seq","batch","count"}``. Gap mode
    ``fail`` makes the server refuse every message after one it did not get, so the stream keeps
    publish order even when frames die with a broken connection. One reply per M messages is what
    makes this path fast (measured: about 4x nats-py's ``publish_async``, the server being the
    limit; see ``benchmarks/publish.py``). Batches run one at a time: a batch starts only after
    the previous one's commit PubAck, so a batch can never be stored while an earlier one lost
    its tail.

``per-message``
    The fallback for streams without ``allow_batched``: every message carries its own reply
    subject ``<inbox>.<epoch>.<index>`` and gets its own PubAck on one wildcard subscription;
    ``"duplicate": true`` counts as stored. Caveat: after a reconnect, nats-py replays its
    outbound buffer while the frames that were in the dead socket are lost, so a resent message
    can be stored *after* a later one. Positions stay correct; stream order may not.

Both frame ``HPUB`` bytes themselves and hand them to nats-py's outbound buffer. Those are private
nats-py APIs, so they are isolated in :class:`_RawWire`, which checks itself at start and falls
back to the public ``nc.publish`` when the check fails.

Failure model
    * A JetStream error reply is fatal: the messages stay held, nothing after them is reported
      stored, and the next ``publish()`` or ``flush()`` raises :class:`PublishRejected` (a
      :class:`PublishError`) naming the message.
    * ``503`` no responders (nothing took the message) is ambiguous: JetStream also answers
      nobody while it shuts down or restarts. The sender asks for the stream: gone, or no longer
      capturing the subject, is fatal as above; otherwise everything unconfirmed is resent after
      a pause, for up to 30 s of 503s without progress.
    * Silence (nothing confirmed for ``ack_timeout`` while acks are owed) and reconnects mean
      "outcome unknown": everything not confirmed is resent with the same ``Nats-Msg-Id``, so
      the stream's duplicate window makes the resend harmless. Dedupe only covers
      ``duplicate_window`` (2 minutes by default): an outage longer than that can store a
      message twice.
    * While NATS is away nothing is sent and nothing is dropped; ``publish()`` blocks once the
      in-flight limits are reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, Protocol

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

from cdc_platform.errors import PublishError
from cdc_platform.protocol.native import NATIVE

log = logging.getLogger(__name__)

PublishMode = Literal["fast-batch", "per-message", "auto"]

# ADR-50 fast-ingest limits and settings (nats-server 2.14+).
_FAST_BATCH_MAX_FLOW = 500        # the server never acks less often than every 500 messages
_FAST_BATCH_MIN_FLOW = 1          # at a trickle every message is acked, like a PubAck
_FAST_BATCH_ACK_INTERVAL = 0.0025 # one flow ack per ~2.5 ms of traffic: bounds the tail's wait
_FAST_BATCH_OUTSTANDING = 4       # flow-ack windows in flight (measured: 4 beats 2, 8 adds little)
_FAST_BATCH_UNKNOWN = 10208       # "batch publish ID unknown": the server abandoned the batch
_FAST_BATCH_REPLAN_FACTOR = 4     # start a new batch once the ideal flow is 4x the current one

_CHUNK_MESSAGES = 250             # frames per write: amortises the flusher, keeps acks flowing
_CHUNK_BYTES = 1024 * 1024
_CONNECTION_POLL = 0.05           # how often to look at the connection while something is held
_STREAM_GRACE = 10.0              # how long a missing stream is tolerated right after a reconnect
_MAX_PROTOCOL_RESENDS = 5         # resends after gaps etc. without any progress before giving up
_NO_RESPONDERS_LIMIT = 30.0       # seconds of 503s for an existing stream before giving up
_CACHE_LIMIT = 10_000


# --------------------------------------------------------------------------------------------
# Public types
# --------------------------------------------------------------------------------------------
class OutgoingMessage(NamedTuple):
    """One JetStream message as the bridge wants it stored. (A named tuple: one is built per
    change, and a frozen dataclass costs three times as much to build.)"""

    subject: str
    msg_id: str          # Nats-Msg-Id header, ASCII
    payload: bytes
    headers: tuple[tuple[str, str], ...] = ()   # extra headers (e.g. Cdc-Schema-Fingerprint)


class PublishRejected(PublishError):
    """JetStream or the NATS server refused a message; says which message and why.

    ``status`` is the HTTP-like code (``503``, ``400``, ``429`` ...) and ``err_code`` JetStream's
    own error code (``10077``, ``10205`` ...) when the reply carried one.
    """

    def __init__(self, description: str, *, subject: str | None = None,
                 msg_id: str | None = None, status: int | None = None,
                 err_code: int | None = None) -> None:
        self.description = description
        self.subject = subject
        self.msg_id = msg_id
        self.status = status
        self.err_code = err_code
        codes = ", ".join(part for part in (
            f"status {status}" if status is not None else "",
            f"err_code {err_code}" if err_code is not None else "") if part)
        where = f" message {msg_id!r} on {subject!r}" if msg_id is not None else ""
        super().__init__(f"JetStream refused{where}: {description}"
                         + (f" ({codes})" if codes else ""))


@dataclass(slots=True)
class PublishStats:
    """Counters for metrics; read them at any time, they are updated in place."""

    mode: str = ""
    wire: str = ""
    messages_published: int = 0      # accepted by publish()
    messages_sent: int = 0           # frames written, resends included
    messages_stored: int = 0         # acknowledged by JetStream, in order
    batches: int = 0                 # fast-ingest batches started
    commits: int = 0                 # fast-ingest end-of-batch commits sent
    resends: int = 0                 # messages written again after an outage, timeout or gap
    recoveries: int = 0              # resend cycles
    last_ack_latency: float | None = None   # seconds from writing a chunk to its last ack
    peak_in_flight_messages: int = 0
    peak_in_flight_bytes: int = 0


# --------------------------------------------------------------------------------------------
# Framing and the one place that touches nats-py internals
# --------------------------------------------------------------------------------------------
# A message as held until it is stored: (subject, header block, payload, message, size). The
# header block ("NATS/1.0\r\nNats-Msg-Id: ...\r\n...\r\n\r\n") is built once at publish()
# so that resends cost no encoding; size = header block + payload, what max_payload limits.
_Held = tuple[bytes, bytes, bytes, OutgoingMessage, int]
# A frame to write: (subject, reply, header block or None for a plain PUB, payload).
_Frame = tuple[bytes, bytes, "bytes | None", bytes]


class _Wire(Protocol):
    name: str

    async def write(self, frames: Sequence[_Frame]) -> None: ...

    async def write_sequence(self, held: list[_Held], reply_prefix: bytes, first_seq: int,
                             reply_suffix: bytes) -> None: ...


def frame_sequence(held: list[_Held], reply_prefix: bytes, first_seq: int,
                   reply_suffix: bytes) -> list[_Frame]:
    """The frames of ``held`` with reply subjects ``reply_prefix + seq + reply_suffix``, seq
    counting up from ``first_seq``: how both channels number their messages."""
    return [(subject, b"%s%d%s" % (reply_prefix, seq, reply_suffix), header, payload)
            for seq, (subject, header, payload, _, _) in enumerate(held, first_seq)]


def protocol_bytes(frames: Sequence[_Frame]) -> bytes:
    """NATS protocol text of ``frames``: ``HPUB`` with a header block, ``PUB`` without."""
    buffer = bytearray()
    for subject, reply, header, payload in frames:
        if header is None:
            buffer += b"PUB %s %s %d\r\n" % (subject, reply, len(payload))
        else:
            header_size = len(header)
            buffer += b"HPUB %s %s %d %d\r\n" % (subject, reply, header_size,
                                                 header_size + len(payload))
            buffer += header
        buffer += payload
        buffer += b"\r\n"
    return bytes(buffer)


class _RawWire:
    """Writes pre-framed ``HPUB``/``PUB`` bytes through nats-py's outbound buffer.

    The only code that uses nats-py internals (``Client._send_command`` and
    ``Client._flush_pending``, nats-py 2.16): framing ourselves skips nats-py's per-message
    header encoding, which costs more than the publish itself. :func:`probe_raw_wire` checks at
    start that the internals still do what we expect, so a nats-py upgrade falls back to
    :class:`_PublicWire` instead of putting garbage on the wire. A run of messages is framed
    by the compiled accelerator when it is built (``frame_sequence`` there; same bytes).
    """

    name = "raw-hpub"

    def __init__(self, nc: NatsClient) -> None:
        self._send_command = nc._send_command
        self._flush_pending = nc._flush_pending

    async def write(self, frames: Sequence[_Frame]) -> None:
        await self._send(protocol_bytes(frames))

    async def write_sequence(self, held: list[_Held], reply_prefix: bytes, first_seq: int,
                             reply_suffix: bytes) -> None:
        if NATIVE is not None:
            await self._send(NATIVE.frame_sequence(held, reply_prefix, first_seq, reply_suffix))
        else:
            await self._send(protocol_bytes(frame_sequence(held, reply_prefix, first_seq,
                                                           reply_suffix)))

    async def _send(self, data: bytes) -> None:
        await self._send_command(data)
        # Kicks nats-py's flusher task; returns at once (it does not wait for the socket).
        await self._flush_pending()


class _PublicWire:
    """The same frames through ``nc.publish``: slower, but only public API."""

    name = "nc.publish"

    def __init__(self, nc: NatsClient) -> None:
        self._nc = nc

    async def write(self, frames: Sequence[_Frame]) -> None:
        for subject, reply, header, payload in frames:
            await self._nc.publish(subject.decode(), payload, reply=reply.decode(),
                                   headers=None if header is None else _parse_headers(header))

    async def write_sequence(self, held: list[_Held], reply_prefix: bytes, first_seq: int,
                             reply_suffix: bytes) -> None:
        await self.write(frame_sequence(held, reply_prefix, first_seq, reply_suffix))


def _parse_headers(block: bytes) -> dict[str, str]:
    """Our own header block back into a dict (only for :class:`_PublicWire`)."""
    lines = block.decode("ascii").split("\r\n")[1:]
    return dict(line.split(": ", 1) for line in lines if line)


async def probe_raw_wire(nc: NatsClient, timeout: float = 2.0) -> _RawWire | None:
    """A :class:`_RawWire` if one framed message round-trips intact through the server."""
    if not (callable(getattr(nc, "_send_command", None))
            and callable(getattr(nc, "_flush_pending", None))):
        log.warning("nats-py has no _send_command/_flush_pending; publishing via nc.publish")
        return None
    subject, reply = nc.new_inbox(), nc.new_inbox()
    subscription = await nc.subscribe(subject)
    try:
        wire = _RawWire(nc)
        await wire.write([(subject.encode(), reply.encode(),
                           b"NATS/1.0\r\nCdc-Wire-Probe: 1\r\n\r\n", b"probe")])
        message = await subscription.next_msg(timeout)
    except (NatsError, TimeoutError, TypeError, AttributeError) as exc:
        log.warning("raw HPUB self-check failed (%r); publishing via nc.publish", exc)
        return None
    finally:
        await subscription.unsubscribe()
    intact = (message.subject == subject and message.reply == reply
              and message.data == b"probe"
              and (message.headers or {}).get("Cdc-Wire-Probe") == "1")
    if not intact:
        log.warning("raw HPUB self-check returned %r; publishing via nc.publish", message)
        return None
    return wire


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, a final ``>`` one or more."""
    pattern_tokens, subject_tokens = pattern.split("."), subject.split(".")
    for position, token in enumerate(pattern_tokens):
        if token == ">":
            return len(subject_tokens) > position
        if position >= len(subject_tokens) or token not in ("*", subject_tokens[position]):
            return False
    return len(pattern_tokens) == len(subject_tokens)


def _is_header_text(text: str) -> bool:
    """ASCII without control characters: anything else would corrupt the header block."""
    return text.isascii() and text.isprintable()


def _status_details(headers: dict[str, str] | None) -> tuple[int | None, str]:
    """``(status, description)`` of a core NATS status reply such as ``NATS/1.0 503``.

    nats-py 2.16 files the line after the status under "Description" (for a 503 that is
    ``"\nNats-Subject: ..."``), so only a clean one-line description is kept.
    """
    headers = headers or {}
    text = str(headers.get("Status") or "")
    status = int(text) if text.isdigit() else None
    if status == 503:
        return status, ("no responders: no JetStream stream captures the subject (stream "
                        "deleted, subjects changed, or JetStream unavailable)")
    description = str(headers.get("Description") or "").strip()
    if not description or "\n" in description:
        description = f"status reply {text}" if text else "empty reply"
    return status, description


def _error_details(error: Any) -> tuple[int | None, int | None, str]:
    """``(status, err_code, description)`` of a JetStream ``ApiError`` JSON object."""
    if not isinstance(error, dict):
        return None, None, str(error)
    return error.get("code"), error.get("err_code"), str(error.get("description", error))


# --------------------------------------------------------------------------------------------
# Bookkeeping (no I/O)
# --------------------------------------------------------------------------------------------
class _Ledger:
    """Every message accepted and not yet stored, in publish order, and the positions.

    Indexes are global: message ``i`` is the ``i``-th message ever accepted. Invariant: messages
    ``[0, stored)`` are stored in JetStream; ``sent`` holds ``[stored, sent_end)``, written in the
    current attempt with unknown outcome; ``queued`` holds the rest, not written (or to be
    written again). Nothing leaves the ledger before JetStream confirmed it.
    """

    def __init__(self) -> None:
        self.queued: deque[_Held] = deque()
        self.sent: deque[_Held] = deque()
        self.stored = 0
        self.accepted = 0
        self.held_bytes = 0
        self.stored_position: int | None = None
        self.last_ack_latency: float | None = None
        self.last_confirmed_at = 0.0                          # when `stored` last advanced
        self.largest = 0                                      # biggest message size accepted
        self._positions: deque[tuple[int, int]] = deque()   # (end index, position) per call
        self._writes: deque[tuple[int, float]] = deque()    # (end index, time) per write
        self._acked_ahead: set[int] = set()                  # per-message acks above `stored`

    @property
    def held(self) -> int:
        return len(self.queued) + len(self.sent)

    @property
    def sent_end(self) -> int:
        return self.stored + len(self.sent)

    def accept(self, messages: list[_Held], size: int, largest: int,
               position: int | None) -> bool:
        """Queue one publish() call; True if that alone made ``position`` stored."""
        self.queued.extend(messages)
        self.accepted += len(messages)
        self.held_bytes += size
        self.largest = max(self.largest, largest)
        if position is None:
            return False
        if self.accepted <= self.stored:   # an empty call with nothing outstanding
            return self._reach(position)
        self._positions.append((self.accepted, position))
        return False

    def _reach(self, position: int) -> bool:
        """``position`` is stored; the reported position never goes back.

        A caller replaying from its last confirmed position (a PostgreSQL reconnect) publishes
        positions lower than ones already queued; messages are stored in order, so the
        highest position reached so far stays true.
        """
        if self.stored_position is None or position > self.stored_position:
            self.stored_position = position
            return True
        return False

    def take(self, count: int, now: float) -> list[_Held]:
        """Move up to ``count`` queued messages (at least one, at most ~1 MB) to ``sent``.

        The caller writes them right away; the time is kept for ack latency and timeouts.
        """
        popleft = self.queued.popleft
        if count * self.largest <= _CHUNK_BYTES:   # the common case: no need to count bytes
            messages = [popleft() for _ in range(count)]
        else:
            messages, size = [], 0
            while len(messages) < count and size < _CHUNK_BYTES:
                held = popleft()
                messages.append(held)
                size += held[4]
        self.sent.extend(messages)
        self._writes.append((self.sent_end, now))
        return messages

    def held_at(self, index: int) -> _Held | None:
        offset = index - self.stored
        if 0 <= offset < len(self.sent):
            return self.sent[offset]
        return None

    def confirm_through(self, end: int, now: float) -> bool:
        """Messages ``[0, end)`` are stored; True if that is news."""
        count = min(end, self.sent_end) - self.stored   # never past what was written
        if count <= 0:
            return False
        popleft, freed = self.sent.popleft, 0
        for _ in range(count):
            freed += popleft()[4]
        self.held_bytes -= freed
        self.stored = end = self.stored + count
        self.last_confirmed_at = now
        writes = self._writes
        while writes and writes[0][0] <= end:
            self.last_ack_latency = now - writes.popleft()[1]
        positions = self._positions
        while positions and positions[0][0] <= end:
            self._reach(positions.popleft()[1])
        return True

    def confirm_one(self, index: int, now: float) -> bool:
        """Message ``index`` is stored (per-message PubAcks arrive in any order)."""
        if index != self.stored:
            if self.stored < index < self.sent_end:
                self._acked_ahead.add(index)
            return False
        end, ahead = index + 1, self._acked_ahead
        while end in ahead:
            ahead.remove(end)
            end += 1
        return self.confirm_through(end, now)

    def requeue(self) -> int:
        """Everything written but unconfirmed goes back to the front of the queue."""
        count = len(self.sent)
        self.queued.extendleft(reversed(self.sent))
        self.sent.clear()
        self._writes.clear()
        self._acked_ahead.clear()
        return count

    def oldest_write(self) -> float | None:
        """When the oldest unconfirmed message was written (None: nothing unconfirmed)."""
        return self._writes[0][1] if self._writes else None

    def silent_since(self) -> float | None:
        """Since when the server owes us an ack without having sent one (None: owes none).

        Measured from the oldest unconfirmed write or the latest confirmation, whichever is
        later: a server working through a backlog is slow, not silent, and resending to it
        would only grow the backlog.
        """
        oldest = self.oldest_write()
        return None if oldest is None else max(oldest, self.last_confirmed_at)


class _RateMeter:
    """Messages per second offered by the caller; sizes fast-ingest flow acks to the traffic."""

    def __init__(self) -> None:
        self.rate = 0.0
        self._since: float | None = None
        self._count = 0

    def add(self, count: int, now: float) -> None:
        if self._since is None:
            self._since = now
        self._count += count
        elapsed = now - self._since
        if elapsed >= 0.02:
            sample = self._count / elapsed
            # Rise at once (a burst needs big batches now), fall gently (bursts come back).
            self.rate = sample if sample > self.rate else (self.rate + sample) / 2
            self._since, self._count = now, 0


class _Signal:
    """Wakes every task waiting at the moment :meth:`fire` is called (cheap when none waits)."""

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None

    def fire(self) -> None:
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self) -> None:
        if self._event is None:
            self._event = asyncio.Event()
        await self._event.wait()


# --------------------------------------------------------------------------------------------
# The two protocols
# --------------------------------------------------------------------------------------------
class _Host(Protocol):
    """What a channel may do to its publisher."""

    def confirm_through(self, end: int) -> None: ...
    def confirm_one(self, index: int) -> None: ...
    def reject(self, index: int | None, status: int | None, err_code: int | None,
               description: str) -> None: ...
    def no_responders(self, index: int) -> None: ...
    def request_resend(self, reason: str) -> None: ...


class _Channel(Protocol):
    """One wire protocol: writes what may be written, turns replies into confirmations."""

    last_accept: float   # loop time of the latest publish() call

    def reset(self) -> None: ...
    async def pump(self, now: float, flush_target: int) -> bool: ...
    def on_reply(self, subject: str, data: bytes, headers: dict[str, str] | None,
                 stale: bool) -> None: ...
    def deadline(self) -> float | None: ...


class _Batch:
    """The open fast-ingest batch. ``base`` is the global index of its batch sequence 1."""

    __slots__ = (
        "acked",
        "base",
        "committing",
        "flow",
        "id",
        "last_subject",
        "msgs",
        "reply_prefix",
        "seq",
        "started",
    )

    def __init__(self, batch_id: str, flow: int, base: int, inbox: str) -> None:
        self.id = batch_id
        self.flow = flow
        self.base = base
        self.reply_prefix = f"{inbox}.{batch_id}.{flow}.fail.".encode()
        self.seq = 0           # highest batch sequence written
        self.acked = 0         # highest batch sequence confirmed by a flow ack
        self.msgs = 1          # the server acks every `msgs` stored messages
        self.started = False   # the server answered sequence 1
        self.committing = False
        self.last_subject = b""


class _FastBatchChannel:
    """ADR-50 fast-ingest batches, gap mode ``fail``, one batch at a time.

    A batch opens with its first message alone and waits for the server's first flow ack (it
    tells the ack cadence ``msgs``); after that messages may run up to
    ``acked + msgs * 4`` (the ADR-50 rule). The flow asked for is sized to the traffic (see
    :meth:`_wanted_flow`), so the messages after the last flow ack wait only milliseconds.
    The batch is committed with an end-of-batch marker (op 3: batch seq last+1, empty, not
    stored) when flush() wants it, when the caller has been idle for ``commit_idle``, when the
    oldest unconfirmed message has waited ``commit_max_delay`` (a backstop: the tail after the
    last flow ack is otherwise confirmed only by the commit), or when the traffic grew so much
    that a batch with a larger flow is due. Each of these keeps a batch far below the server's
    10 s inactivity limit.
    """

    def __init__(self, host: _Host, ledger: _Ledger, wire: _Wire, inbox: str,
                 stats: PublishStats, rate: _RateMeter, *, commit_idle: float,
                 commit_max_delay: float, flow: int | None,
                 control_subject: bytes | None = None) -> None:
        self._host, self._ledger, self._wire, self._inbox = host, ledger, wire, inbox
        self._control_subject = control_subject
        self._stats, self._rate = stats, rate
        self._commit_idle, self._commit_max_delay = commit_idle, commit_max_delay
        self._fixed_flow = flow
        self._batch: _Batch | None = None
        self.last_accept = 0.0   # set by the publisher on every publish()

    def reset(self) -> None:
        # Replies to the abandoned batch are ignored from now on; the server drops it after
        # its first gap or 10 s of silence. Its messages are in the ledger's queue again.
        self._batch = None

    def _wanted_flow(self) -> int:
        """The ack cadence for the current traffic: a power of two, 1 to 500.

        Messages after the last flow ack wait for the next one (or the commit), so acks every
        ~2.5 ms of traffic keep that wait short at any rate: flow 4 at 2K msg/s, 500 (the
        server's maximum, fewest acks) from 200K msg/s or whenever a backlog builds up.
        """
        if self._fixed_flow is not None:
            return self._fixed_flow
        wanted = max(self._rate.rate * _FAST_BATCH_ACK_INTERVAL,
                     len(self._ledger.queued) / _FAST_BATCH_OUTSTANDING)
        if wanted >= _FAST_BATCH_MAX_FLOW:
            return _FAST_BATCH_MAX_FLOW
        flow = _FAST_BATCH_MIN_FLOW
        while flow * 2 <= wanted:
            flow *= 2
        return flow

    async def pump(self, now: float, flush_target: int) -> bool:
        ledger, batch = self._ledger, self._batch
        if batch is None:
            if not ledger.queued:
                return False
            # Open a batch with its first message alone: the reply tells us the ack cadence.
            batch = self._batch = _Batch(secrets.token_hex(8), self._wanted_flow(),
                                         ledger.sent_end, self._inbox)
            subject, header, payload, _, _ = ledger.take(1, now)[0]
            batch.seq, batch.last_subject = 1, subject
            self._stats.batches += 1
            self._stats.messages_sent += 1
            await self._wire.write([(subject, batch.reply_prefix + b"1.0.$FI", header, payload)])
            return True
        if batch.committing or not batch.started:
            return False   # waiting for the server
        replan = (self._fixed_flow is None and batch.flow < _FAST_BATCH_MAX_FLOW
                  and self._wanted_flow() >= min(_FAST_BATCH_REPLAN_FACTOR * batch.flow,
                                                 _FAST_BATCH_MAX_FLOW))
        if ledger.queued and not replan:
            room = batch.acked + batch.msgs * _FAST_BATCH_OUTSTANDING - batch.seq
            if room > 0:
                held = ledger.take(min(room, _CHUNK_MESSAGES, len(ledger.queued)), now)
                first_seq = batch.seq + 1
                batch.seq, batch.last_subject = batch.seq + len(held), held[-1][0]
                self._stats.messages_sent += len(held)
                await self._wire.write_sequence(held, batch.reply_prefix, first_seq, b".1.$FI")
                return True
        if self._commit_due(batch, now, flush_target, replan):
            batch.committing = True
            self._stats.commits += 1
            # The marker (never stored) may use any subject of the stream. A dedicated
            # control subject keeps core subscribers of data subjects from seeing it.
            await self._wire.write([(self._control_subject or batch.last_subject,
                                     b"%s%d.3.$FI" % (batch.reply_prefix, batch.seq + 1),
                                     None, b"")])
            return True
        return False

    def _commit_due(self, batch: _Batch, now: float, flush_target: int, replan: bool) -> bool:
        ledger = self._ledger
        if flush_target > ledger.stored and ledger.sent_end >= flush_target:
            return True    # flush() waits for messages that are all written
        if replan:
            return True
        if not ledger.queued and now - self.last_accept >= self._commit_idle:
            return True
        oldest = ledger.oldest_write()
        return oldest is not None and now - oldest >= self._commit_max_delay

    def deadline(self) -> float | None:
        batch = self._batch
        if batch is None or batch.committing or not batch.started:
            return None    # a reply is due; the publisher's ack timeout covers silence
        times = []
        if not self._ledger.queued:
            times.append(self.last_accept + self._commit_idle)
        oldest = self._ledger.oldest_write()
        if oldest is not None:
            times.append(oldest + self._commit_max_delay)
        return min(times) if times else None

    def on_reply(self, subject: str, data: bytes, headers: dict[str, str] | None,
                 stale: bool) -> None:
        # subject = <inbox>.<batch id>.<flow>.fail.<batch seq>.<op>.$FI
        batch = self._batch
        if batch is None or stale:
            return
        tokens = subject[len(self._inbox) + 1:].split(".")
        if tokens[0] != batch.id:
            return   # a batch we gave up on; everything it held has been queued again
        seq = int(tokens[3])
        if (headers and "Status" in headers) or not data:
            # A core NATS status instead of a JetStream reply, e.g. 503: nothing took it.
            status, description = _status_details(headers)
            if status == 503:
                self._host.no_responders(batch.base + seq - 1)
            else:
                self._host.reject(batch.base + seq - 1, status, None, description)
            return
        reply = json.loads(data)
        kind = reply.get("type")
        if kind == "ack":
            # Cumulative: batch messages 1..seq are stored, in order. seq 0 opens the batch.
            batch.started = True
            batch.msgs = max(1, int(reply.get("msgs", 1)))
            acked = int(reply["seq"])
            if acked > batch.acked:
                batch.acked = acked
                self._host.confirm_through(batch.base + acked)
        elif kind == "gap":
            # The server missed a frame of the open batch, so it stores nothing after it.
            self._batch = None
            self._host.request_resend(f"batch {batch.id} reported a gap: {reply}")
        elif kind == "err" or "error" in reply:
            status, err_code, description = _error_details(reply.get("error"))
            if err_code == _FAST_BATCH_UNKNOWN:
                # Abandoned by the server (10 s of silence, e.g. a paused process): nothing is
                # wrong with the messages, so send them again in a new batch.
                self._batch = None
                self._host.request_resend(f"server abandoned batch {batch.id}")
                return
            where = int(reply["seq"]) if kind == "err" else seq
            self._host.reject(batch.base + where - 1, status, err_code, description)
        else:
            # The commit's PubAck: `count` batch messages are stored (duplicates included).
            count = int(reply.get("count", 0))
            self._batch = None
            self._host.confirm_through(batch.base + count)
            if count < batch.seq:
                self._host.request_resend(
                    f"batch {batch.id} committed {count} of {batch.seq} messages")


class _PerMessageChannel:
    """One PubAck per message; reply subject ``<inbox>.<epoch>.<global index>``.

    The epoch changes on every resend cycle, so an error reply to a frame we already gave up on
    (say a 503 from a server still recovering its streams) is recognised and ignored; its message
    is being resent anyway. Positive acks count whatever their epoch: stored is stored.
    """

    def __init__(self, host: _Host, ledger: _Ledger, wire: _Wire, inbox: str,
                 stats: PublishStats) -> None:
        self._host, self._ledger, self._wire, self._stats = host, ledger, wire, stats
        self._inbox = inbox
        self._prefix_length = len(inbox) + 1
        self._epoch = 0
        self._reply_prefix = f"{inbox}.0.".encode()
        self.last_accept = 0.0

    def reset(self) -> None:
        self._epoch += 1
        self._reply_prefix = f"{self._inbox}.{self._epoch}.".encode()

    async def pump(self, now: float, flush_target: int) -> bool:
        ledger = self._ledger
        if not ledger.queued:
            return False
        first_index = ledger.sent_end
        held = ledger.take(min(_CHUNK_MESSAGES, len(ledger.queued)), now)
        self._stats.messages_sent += len(held)
        await self._wire.write_sequence(held, self._reply_prefix, first_index, b"")
        return True

    def deadline(self) -> float | None:
        return None

    def on_reply(self, subject: str, data: bytes, headers: dict[str, str] | None,
                 stale: bool) -> None:
        epoch, _, index_text = subject[self._prefix_length:].partition(".")
        index = int(index_text)
        # `"error":` cannot occur in a successful PubAck (string values escape their quotes).
        if data and not headers and b'"error":' not in data:
            self._host.confirm_one(index)   # includes "duplicate": true
            return
        if stale or int(epoch) != self._epoch:
            return
        if data and not headers:
            status, err_code, description = _error_details(json.loads(data).get("error"))
        else:
            (status, description), err_code = _status_details(headers), None
            if status == 503:
                self._host.no_responders(index)
                return
        self._host.reject(index, status, err_code, description)


# --------------------------------------------------------------------------------------------
# The publisher
# --------------------------------------------------------------------------------------------
class JetStreamPublisher:
    """Publishes messages to one stream in order and tells which positions are stored.

    One task (the sender) does all writing, so frames leave in publish order; replies arrive
    on one wildcard subscription. Use one publisher per stream and connection, from one
    producer (concurrent publish() calls are serialised in arrival order).

    The connection is watched by polling ``nc.is_connected`` and ``nc.stats["reconnects"]``;
    an owner that has nats-py's disconnected/reconnected callbacks may call
    :meth:`connection_changed` from them to react at once.
    """

    def __init__(self, nc: NatsClient, *, stream: str, mode: PublishMode = "auto",
                 max_in_flight_messages: int = 20_000,
                 max_in_flight_bytes: int = 64 * 1024 * 1024,
                 ack_timeout: float = 5.0,
                 commit_idle: float = 0.01,
                 commit_max_delay: float = 0.05,
                 flow: int | None = None,
                 on_stored: Callable[[int], None] | None = None,
                 control_subject: str | None = None) -> None:
        """
        ``max_in_flight_*`` bound what is held (queued or awaiting an ack); a single call larger
        than the bound is still accepted, alone. ``ack_timeout``: how long the server may owe
        an ack without confirming anything before the unconfirmed messages count as unknown
        and are resent (doubling, up to 16x, while resends bring no ack).
        ``commit_idle`` / ``commit_max_delay``: when a fast-ingest batch is committed (see
        :class:`_FastBatchChannel`); ``flow`` fixes the flow-ack cadence instead of sizing it
        to the traffic. ``on_stored(position)`` is called, synchronously, each time
        :attr:`stored_position` advances. ``control_subject``: the subject of fast-ingest
        commit markers (captured by the stream, never stored); default: the batch's last
        message subject.
        """
        if mode not in ("fast-batch", "per-message", "auto"):
            raise ValueError(f"unknown publish mode {mode!r}")
        if max_in_flight_messages < 1 or max_in_flight_bytes < 1:
            raise ValueError("in-flight limits must be positive")
        if flow is not None and not 1 <= flow <= _FAST_BATCH_MAX_FLOW:
            raise ValueError(f"flow must be between 1 and {_FAST_BATCH_MAX_FLOW}")
        self._nc = nc
        self._stream = stream
        self._requested_mode = mode
        self._max_messages = max_in_flight_messages
        self._max_bytes = max_in_flight_bytes
        self._ack_timeout = ack_timeout
        self._commit_idle = commit_idle
        self._commit_max_delay = commit_max_delay
        self._flow = flow
        self._control_subject = control_subject
        self._on_stored = on_stored

        self.stats = PublishStats()
        self.mode: Literal["fast-batch", "per-message"] | None = None
        self._ledger = _Ledger()
        self._rate = _RateMeter()
        self._channel: _Channel | None = None
        self._subscription: Any = None
        self._task: asyncio.Task[None] | None = None
        self._js = nc.jetstream(timeout=2.0)

        self._stream_subjects: list[str] = []
        self._subjects: dict[str, bytes] = {}          # admitted subject -> encoded
        self._extra_headers: dict[tuple[tuple[str, str], ...], str] = {}   # -> header lines
        self._notified_position: int | None = None

        self._wake = asyncio.Event()      # the sender has something to look at
        self._room = _Signal()            # held messages dropped below what publish() waits for
        self._room_wanted = (0, 0)
        self._stored = _Signal()          # stored reached what a flush() waits for
        self._flush_target = 0            # highest target of any flush(): commit up to here
        self._flush_waiting: list[int] = []   # targets of the flush() calls now waiting
        self._publish_lock = asyncio.Lock()
        self._generation = 0              # nc.stats["reconnects"] the in-flight frames belong to
        self._resend_reason: str | None = None
        self._resends_without_progress = 0   # suspicious resends since progress
        self._timeouts_without_progress = 0  # ack-timeout resends since progress
        self._unanswered: OutgoingMessage | None = None   # got a 503, not yet looked into
        self._unanswered_since: float | None = None       # first 503 since the last progress
        self._failure: PublishError | None = None
        self._accepting = True
        self._stopping = False

    # -- public API --------------------------------------------------------------------------
    @property
    def stored_position(self) -> int | None:
        """The highest position whose messages, and all before them, JetStream has stored."""
        return self._ledger.stored_position

    @property
    def in_flight_messages(self) -> int:
        """Messages accepted and not yet stored (queued or awaiting an ack)."""
        return self._ledger.held

    @property
    def in_flight_bytes(self) -> int:
        return self._ledger.held_bytes

    @property
    def failure(self) -> PublishError | None:
        """The error that stopped the publisher, if any."""
        return self._failure

    async def start(self) -> None:
        """Read the stream, pick the mode, check the wire, subscribe for replies, start sending.

        "auto" uses fast-ingest batches when the stream allows them (``allow_batched``) and
        per-message PubAcks otherwise.
        """
        if self._task is not None:
            return
        try:
            info = await self._js.stream_info(self._stream)
        except NotFoundError:
            raise PublishError(f"JetStream stream {self._stream!r} does not exist") from None
        except (NatsError, TimeoutError) as exc:
            raise PublishError(f"cannot read JetStream stream {self._stream!r}: {exc!r}") from exc
        if info.config.no_ack:
            raise PublishError(f"stream {self._stream!r} has no_ack set: it never confirms a "
                               "message, so nothing could ever be reported stored")
        batched = bool(info.config.allow_batched)
        if self._requested_mode == "fast-batch" and not batched:
            raise PublishError(f"stream {self._stream!r} does not allow fast-ingest batches "
                               "(allow_batched); use mode 'per-message' or 'auto'")
        requested = self._requested_mode
        self.mode = (("fast-batch" if batched else "per-message") if requested == "auto"
                     else requested)
        self._stream_subjects = list(info.config.subjects or [self._stream])

        wire: _Wire = await probe_raw_wire(self._nc) or _PublicWire(self._nc)
        inbox = self._nc.new_inbox()
        if self.mode == "fast-batch":
            self._channel = _FastBatchChannel(
                self, self._ledger, wire, inbox, self.stats, self._rate,
                commit_idle=self._commit_idle, commit_max_delay=self._commit_max_delay,
                flow=self._flow,
                control_subject=self._control_subject.encode() if self._control_subject
                else None)
        else:
            self._channel = _PerMessageChannel(self, self._ledger, wire, inbox, self.stats)
        # Per-message acks can briefly outnumber the window (resends); never drop one.
        self._subscription = await self._nc.subscribe(
            inbox + ".>", cb=self._on_reply_message,
            pending_msgs_limit=4 * self._max_messages + 10_000,
            pending_bytes_limit=256 * 1024 * 1024)
        self._generation = self._nc.stats["reconnects"]
        self.stats.mode, self.stats.wire = self.mode, wire.name
        self._task = asyncio.create_task(self._run(), name=f"jetstream-publisher:{self._stream}")
        log.info("publishing to JetStream stream %s: %s mode, %s wire", self._stream, self.mode,
                 wire.name)

    @property
    def max_payload(self) -> int:
        """The connected server's limit on headers + payload of one message."""
        return self._nc.max_payload

    async def publish(self, messages: Sequence[OutgoingMessage],
                      position: int | None = None) -> None:
        """Queue ``messages`` in order; ``position`` is reported stored once they all are.

        Returns once the messages are queued, which waits while the in-flight limits are
        reached (also while NATS is away). Raises :class:`PublishError` for a message that
        can never be published (too large, bad subject or header) before queueing any of the
        call, and the publisher's failure if it has one. A ``position`` lower than an earlier
        one (a replay after a source reconnect) is fine: :attr:`stored_position` never goes
        back.
        """
        self._raise_if_unusable()
        held, size, largest = self._frame_all(messages)
        count = len(held)
        ledger = self._ledger
        async with self._publish_lock:
            while ledger.held and (ledger.held + count > self._max_messages
                                   or ledger.held_bytes + size > self._max_bytes):
                self._raise_if_unusable()
                self._room_wanted = (self._max_messages - count, self._max_bytes - size)
                await self._room.wait()
            self._raise_if_unusable()
            now = asyncio.get_running_loop().time()
            self._rate.add(count, now)
            assert self._channel is not None
            self._channel.last_accept = now
            if ledger.accept(held, size, largest, position):
                self._notify_stored()
            stats = self.stats
            stats.messages_published += count
            stats.peak_in_flight_messages = max(stats.peak_in_flight_messages, ledger.held)
            stats.peak_in_flight_bytes = max(stats.peak_in_flight_bytes, ledger.held_bytes)
        self._wake.set()

    async def flush(self, timeout: float | None = None) -> int | None:
        """Commit any open batch and wait until everything published so far is stored.

        Returns :attr:`stored_position`. Raises :class:`PublishError` if the publisher failed
        and ``TimeoutError`` if ``timeout`` passed first (nothing is lost: it keeps trying).
        """
        if self._task is None:
            raise PublishError("JetStreamPublisher.start() was not called")
        ledger = self._ledger
        target = ledger.accepted
        self._flush_target = max(self._flush_target, target)
        self._wake.set()
        self._flush_waiting.append(target)
        try:
            async with asyncio.timeout(timeout):
                while ledger.stored < target:
                    if self._failure is not None:
                        raise self._failure
                    await self._stored.wait()
        finally:
            self._flush_waiting.remove(target)
        return ledger.stored_position

    async def close(self, timeout: float | None = None) -> None:
        """Flush (bounded by ``timeout``, default twice the ack timeout), then stop.

        Does not raise when something could not be stored -- that was reported by publish()
        or flush(), and :attr:`stored_position` says what is safe; it logs it instead.
        """
        if not self._accepting:
            return
        self._accepting = False
        try:
            if self._task is not None and self._failure is None:
                await self.flush(timeout if timeout is not None else 2 * self._ack_timeout)
        except (PublishError, TimeoutError) as exc:
            log.warning("closing the publisher for %s with %d messages not stored (stored "
                        "position %s): %s", self._stream, self._ledger.held,
                        self.stored_position, exc)
        finally:
            self._stopping = True
            self._wake.set()
            if self._task is not None:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            if self._subscription is not None and not self._nc.is_closed:
                with contextlib.suppress(NatsError):
                    await self._subscription.unsubscribe()

    def connection_changed(self) -> None:
        """Tell the publisher NATS disconnected or reconnected (optional, it also polls)."""
        self._wake.set()

    # -- framing -----------------------------------------------------------------------------
    def _frame_all(self, messages: Sequence[OutgoingMessage]) -> tuple[list[_Held], int, int]:
        """Validate and encode a call's messages: (held, total size, largest size).

        Raises before anything of the call is queued.
        """
        max_payload = self._nc.max_payload
        subjects, extras = self._subjects, self._extra_headers
        if NATIVE is not None:  # the same loop compiled; None: something to admit or refuse
            framed = NATIVE.frame_messages(messages, subjects, extras, max_payload)
            if framed is not None:
                return framed
        held: list[_Held] = []
        total = largest = 0
        # The hot loop of the publisher: kept free of calls where a builtin will do.
        for message in messages:
            subject = subjects.get(message.subject) or self._admit_subject(message.subject)
            msg_id = message.msg_id
            if not msg_id or not (msg_id.isascii() and msg_id.isprintable()):
                raise PublishError(f"Nats-Msg-Id {msg_id!r} of a message on {message.subject!r} "
                                   "must be non-empty printable ASCII")
            if message.headers:
                extra = extras.get(message.headers) or self._encode_headers(message)
                header = f"NATS/1.0\r\nNats-Msg-Id: {msg_id}\r\n{extra}\r\n".encode()
            else:
                header = f"NATS/1.0\r\nNats-Msg-Id: {msg_id}\r\n\r\n".encode()
            payload = message.payload
            size = len(header) + len(payload)
            if size > max_payload:
                raise PublishError(
                    f"message {msg_id!r} on {message.subject!r} is {size} bytes (payload "
                    f"{len(payload)} + headers {len(header)}), above the NATS server's "
                    f"max_payload of {max_payload} bytes")
            held.append((subject, header, payload, message, size))
            total += size
            largest = max(largest, size)
        return held, total, largest

    def _admit_subject(self, subject: str) -> bytes:
        """Check a subject once: publishable, and captured by our stream (not another one)."""
        tokens = subject.split(".")
        if not (subject.isascii() and subject.isprintable()) or " " in subject \
                or any(token in ("", "*", ">") for token in tokens):
            raise PublishError(f"subject {subject!r} is not a valid NATS publish subject")
        if not any(subject_matches(pattern, subject) for pattern in self._stream_subjects):
            raise PublishError(f"subject {subject!r} is not captured by stream {self._stream!r} "
                               f"(its subjects: {', '.join(self._stream_subjects)})")
        if len(self._subjects) >= _CACHE_LIMIT:
            self._subjects.clear()
        encoded = self._subjects[subject] = subject.encode()
        return encoded

    def _encode_headers(self, message: OutgoingMessage) -> str:
        lines = []
        for name, value in message.headers:
            if not (name and _is_header_text(name) and ":" not in name and " " not in name
                    and _is_header_text(value)):
                raise PublishError(f"header {name!r}: {value!r} of message {message.msg_id!r} "
                                   "is not a valid NATS header (printable ASCII, no ':' in "
                                   "the name)")
            if name.lower() == "nats-msg-id":
                raise PublishError("set the message id with OutgoingMessage.msg_id, not a header")
            lines.append(f"{name}: {value}\r\n")
        encoded = "".join(lines)
        if len(self._extra_headers) >= _CACHE_LIMIT:
            self._extra_headers.clear()
        self._extra_headers[message.headers] = encoded
        return encoded

    # -- the sender --------------------------------------------------------------------------
    async def _run(self) -> None:
        """The only task that writes to NATS, hence the one that keeps frames in order."""
        loop = asyncio.get_running_loop()
        channel = self._channel
        assert channel is not None
        nc = self._nc
        try:
            while not self._stopping and self._failure is None:
                self._wake.clear()
                if nc.is_closed:
                    self._fail(PublishError(
                        f"the NATS connection is closed; {self._ledger.held} messages for "
                        f"stream {self._stream!r} were not stored"))
                    return
                if not nc.is_connected or nc.stats["reconnects"] != self._generation:
                    await self._recover()
                    continue
                if self._resend_reason is not None:
                    self._restart(self._resend_reason, suspicious=True)
                    continue
                if self._unanswered is not None:
                    await self._look_into_no_responders()
                    continue
                now = loop.time()
                silent_since = self._ledger.silent_since()
                ack_timeout = self._current_ack_timeout()
                if silent_since is not None and now - silent_since >= ack_timeout:
                    self._timeouts_without_progress += 1
                    self._restart(f"no acknowledgement within {ack_timeout:g} s")
                    continue
                try:
                    wrote = await channel.pump(now, self._flush_target)
                except (NatsError, OSError):
                    if nc.is_connected:
                        raise
                    continue   # the connection broke mid-write; _recover() resends
                if wrote:
                    await asyncio.sleep(0)   # let the reader deliver acks, producers queue
                    continue
                await self._sleep_until(self._next_deadline(now, silent_since, ack_timeout))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug or an unforeseen reply: stop, say so, keep messages
            error = PublishError(f"the JetStream publisher for {self._stream!r} stopped: {exc!r}")
            error.__cause__ = exc
            self._fail(error)

    def _current_ack_timeout(self) -> float:
        """``ack_timeout``, doubled for every resend that brought no ack (at most 16x).

        A server that is alive but silent (paused, overloaded) would otherwise be sent the
        whole window again every ``ack_timeout``.
        """
        return self._ack_timeout * 2 ** min(self._timeouts_without_progress, 4)

    def _next_deadline(self, now: float, silent_since: float | None,
                       ack_timeout: float) -> float | None:
        assert self._channel is not None
        deadlines = [self._channel.deadline()]
        if silent_since is not None:
            deadlines.append(silent_since + ack_timeout)
        if self._ledger.held:
            deadlines.append(now + _CONNECTION_POLL)   # notice a lost connection soon
        present = [deadline for deadline in deadlines if deadline is not None]
        return min(present) if present else None

    async def _sleep_until(self, deadline: float | None) -> None:
        try:
            async with asyncio.timeout_at(deadline):
                await self._wake.wait()
        except TimeoutError:
            pass

    async def _recover(self) -> None:
        """Wait for NATS and the stream, then resend everything unconfirmed, in order."""
        nc = self._nc
        if not nc.is_connected:
            log.warning("NATS connection lost; holding %d messages for stream %s until it is "
                        "back", self._ledger.held, self._stream)
        while not nc.is_connected:
            if nc.is_closed or self._stopping:
                return
            await asyncio.sleep(_CONNECTION_POLL)
        generation = nc.stats["reconnects"]
        # A restarted server may take a moment to recover its streams; resending before that
        # would earn 503s. A stream still missing after the grace period was deleted.
        loop = asyncio.get_running_loop()
        give_up = loop.time() + _STREAM_GRACE
        while not self._stopping:
            try:
                await self._js.stream_info(self._stream)
                break
            except NotFoundError:
                if loop.time() >= give_up:
                    self._fail(PublishError(f"stream {self._stream!r} no longer exists; "
                                            f"{self._ledger.held} messages were not stored"))
                    return
            except (NatsError, TimeoutError, OSError) as exc:
                log.debug("stream %s not reachable yet: %r", self._stream, exc)
            if not nc.is_connected:
                return   # lost again; the sender loop comes back here
            await asyncio.sleep(0.1)
        self._generation = generation
        self._restart("NATS reconnected")

    async def _look_into_no_responders(self) -> None:
        """Nothing took a message (503): is the stream gone, or is JetStream just restarting?"""
        message, self._unanswered = self._unanswered, None
        assert message is not None
        loop = asyncio.get_running_loop()
        if self._unanswered_since is None:
            self._unanswered_since = loop.time()
        waited = loop.time() - self._unanswered_since

        def refuse(description: str) -> None:
            self._fail(PublishRejected(description, subject=message.subject,
                                       msg_id=message.msg_id, status=503))

        try:
            info = await self._js.stream_info(self._stream)
        except NotFoundError:
            refuse(f"no responders: stream {self._stream!r} no longer exists")
            return
        except (NatsError, TimeoutError, OSError) as exc:
            log.debug("stream %s not reachable after a 503: %r", self._stream, exc)
        else:
            self._stream_subjects = list(info.config.subjects or [self._stream])
            self._subjects.clear()   # admit subjects against the current config from now on
            if not any(subject_matches(pattern, message.subject)
                       for pattern in self._stream_subjects):
                refuse(f"no responders: stream {self._stream!r} no longer captures the subject")
                return
        if waited >= _NO_RESPONDERS_LIMIT:
            refuse(f"no responders for {waited:.0f} s although stream {self._stream!r} exists")
            return
        # JetStream shutting down or starting up. Pause (the connection may be about to go,
        # and then _recover() takes over), then send everything unconfirmed again.
        await asyncio.sleep(min(0.1 + waited / 4, 2.0))
        if self._nc.is_connected and self._nc.stats["reconnects"] == self._generation:
            self._restart("503 no responders while the stream exists")

    def _restart(self, reason: str, *, suspicious: bool = False) -> None:
        """Give up on every unconfirmed frame and send it again, same Nats-Msg-Id, in order.

        Outages and silence explain themselves and may last; ``suspicious`` resends (a gap,
        an abandoned batch, a short commit) should not repeat without progress.
        """
        assert self._channel is not None
        self._resend_reason = None
        count = self._ledger.requeue()
        self._channel.reset()
        if suspicious:
            # If they do repeat, something is wrong with the messages, and looping forever
            # would hide it.
            self._resends_without_progress += 1
            if self._resends_without_progress > _MAX_PROTOCOL_RESENDS:
                self._fail(PublishError(
                    f"stream {self._stream!r} made no progress after "
                    f"{_MAX_PROTOCOL_RESENDS} resends; last reason: {reason}"))
                return
        self.stats.recoveries += 1
        self.stats.resends += count
        if count:
            log.warning("resending %d unconfirmed messages to stream %s with the same "
                        "Nats-Msg-Id: %s", count, self._stream, reason)

    # -- replies (called from the subscription's task) ---------------------------------------
    async def _on_reply_message(self, message: Msg) -> None:
        # Replies are processed after a failure too: an ack for messages before the failed
        # one is still true (a fast batch's commit PubAck follows its error).
        channel = self._channel
        if channel is None:
            return
        # After a reconnect and before _recover() ran, error replies may concern frames the
        # new server never saw in order (nats-py replays its buffer); _recover() resends them.
        stale = self._nc.stats["reconnects"] != self._generation
        try:
            channel.on_reply(message.subject, message.data, message.headers, stale)
        except Exception as exc:  # noqa: BLE001 - we no longer know what is stored: stop, say so
            error = PublishError(f"unexpected JetStream reply on {message.subject}: "
                                 f"{message.data[:300]!r}")
            error.__cause__ = exc
            self._fail(error)
        self._wake.set()

    def confirm_through(self, end: int) -> None:
        if self._ledger.confirm_through(end, asyncio.get_running_loop().time()):
            self._progress()

    def confirm_one(self, index: int) -> None:
        if self._ledger.confirm_one(index, asyncio.get_running_loop().time()):
            self._progress()

    def reject(self, index: int | None, status: int | None, err_code: int | None,
               description: str) -> None:
        held = self._ledger.held_at(index) if index is not None else None
        message = held[3] if held is not None else None
        self._fail(PublishRejected(
            description, subject=message.subject if message else None,
            msg_id=message.msg_id if message else None, status=status, err_code=err_code))

    def no_responders(self, index: int) -> None:
        if self._unanswered is None:
            held = self._ledger.held_at(index)
            if held is not None:
                self._unanswered = held[3]
                self._wake.set()

    def request_resend(self, reason: str) -> None:
        self._resend_reason = reason
        self._wake.set()

    # -- state changes -----------------------------------------------------------------------
    def _progress(self) -> None:
        # Wake the sender before the producer: asyncio resumes tasks in wake-up order, and the
        # window that just opened should be refilled before the producer frames more messages.
        self._wake.set()
        ledger, stats = self._ledger, self.stats
        previous = stats.messages_stored
        stats.messages_stored = ledger.stored
        stats.last_ack_latency = ledger.last_ack_latency
        if ledger.stored > previous:
            self._resends_without_progress = self._timeouts_without_progress = 0
            self._unanswered_since = None
        wanted_messages, wanted_bytes = self._room_wanted
        if ledger.held == 0 or (ledger.held <= wanted_messages
                                and ledger.held_bytes <= wanted_bytes):
            self._room.fire()
        if self._flush_waiting and ledger.stored >= min(self._flush_waiting):
            self._stored.fire()
        self._notify_stored()

    def _notify_stored(self) -> None:
        position = self._ledger.stored_position
        if self._on_stored is not None and position is not None \
                and position != self._notified_position:
            self._notified_position = position
            try:
                self._on_stored(position)
            except Exception as exc:  # noqa: BLE001 - the caller's callback: report it, stop
                error = PublishError(f"on_stored callback failed at position {position}")
                error.__cause__ = exc
                self._fail(error)

    def _fail(self, error: PublishError) -> None:
        if self._failure is not None:
            return
        self._failure = error
        log.error("JetStream publisher for %s stopped with %d messages not stored (stored "
                  "position %s): %s", self._stream, self._ledger.held, self.stored_position,
                  error)
        self._room.fire()
        self._stored.fire()
        self._wake.set()

    def _raise_if_unusable(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._task is None:
            raise PublishError("JetStreamPublisher.start() was not called")
        if not self._accepting:
            raise PublishError("the JetStreamPublisher is closed")
