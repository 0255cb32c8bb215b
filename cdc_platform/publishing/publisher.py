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
    ``{"type":"ack","seq":N,"msgs":M}`` -- "batch messages 1..N were taken, in order" -- every M
    messages, and the commit with a PubAck ``{"stream","seq","batch","count"}``. A message
    dropped as a duplicate is taken silently, so messages are confirmed only at the commit,
    once the stream's sequence moved by the batch's size (see "Duplicates" below). Gap mode
    ``fail`` makes the server refuse every message after one it did not get, so the stream keeps
    publish order even when frames die with a broken connection. One reply per M messages is what
    makes this path fast (measured: about 4x nats-py's ``publish_async``, the server being the
    limit; see ``benchmarks/publish.py``). Batches run one at a time: a batch starts only after
    the previous one's commit PubAck, so a batch can never be stored while an earlier one lost
    its tail.

``per-message``
    The fallback for streams without ``allow_batched``: every message carries its own reply
    subject ``<inbox>.<epoch>.<index>`` and gets its own PubAck on one wildcard subscription.
    Caveat: after a reconnect, nats-py replays its outbound buffer while the frames that were
    in the dead socket are lost, so a resent message can be stored *after* a later one.
    Positions stay correct; stream order may not.

Both frame ``HPUB`` bytes themselves and hand them to nats-py's outbound buffer (private nats-py
APIs, used in ``jetstream/nats_internals.py`` only) through :class:`RawWire`, which checks itself
at start and falls back to the public ``nc.publish`` when the check fails.

Duplicates
    A message JetStream drops as a duplicate of its ``Nats-Msg-Id`` counts as stored only once
    the message stored under that id is read back and found to be the same change (our own
    resend); an id taken by other content is a conflict: an error line, a counter, and the
    change stored again under a random id (:mod:`duplicates`). Per-message PubAcks name the
    stored message; a fast batch tells only that the stream moved less (or more) than its
    size, and then its messages are looked for by id. Sending waits while this runs.

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
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

from cdc_platform.errors import PublishError
from cdc_platform.publishing.channels import (
    FAST_BATCH_MAX_FLOW,
    Channel,
    FastBatchChannel,
    PerMessageChannel,
)
from cdc_platform.publishing.duplicates import DuplicateChecker
from cdc_platform.publishing.framing import (
    PublicWire,
    Wire,
    is_header_text,
    probe_raw_wire,
    subject_matches,
)
from cdc_platform.publishing.ledger import Ledger, RateMeter, Signal
from cdc_platform.publishing.messages import (
    Held,
    OutgoingMessage,
    PublishMode,
    PublishRejected,
    PublishStats,
)
from cdc_platform.speedups import compiled_twin
from cdc_platform.wire import HEADER_SIGNATURE, HEADER_SIGNING_KEY, MessageSigner

log = logging.getLogger(__name__)

_CONNECTION_POLL = 0.05           # how often to look at the connection while something is held
_STREAM_GRACE = 10.0              # how long a missing stream is tolerated right after a reconnect
_MAX_PROTOCOL_RESENDS = 5         # resends after gaps etc. without any progress before giving up
_NO_RESPONDERS_LIMIT = 30.0       # seconds of 503s for an existing stream before giving up
_CACHE_LIMIT = 10_000




def frame_messages(messages: Sequence[OutgoingMessage], subjects: dict[str, bytes],
                   extras: dict[tuple[tuple[str, str], ...], str],
                   max_payload: int) -> tuple[list[Held], int, int] | None:
    """:meth:`JetStreamPublisher._frame_all`'s loop for the common case, or None: a message
    that loop must take (to admit a subject or header set, or to refuse it). The pure code
    leaves every call to that loop; the compiled twin frames what needs nothing admitted."""
    return None


def _signature_lines(signer: MessageSigner, message: OutgoingMessage) -> str:
    signature = signer.signature(message.subject, message.msg_id, dict(message.headers),
                                 message.payload)
    return (f"{HEADER_SIGNATURE}: {signature}\r\n"
            f"{HEADER_SIGNING_KEY}: {signer.public_key}\r\n")


class _DuplicateCheck(NamedTuple):
    """Held messages from ledger index ``first`` on, confirmed once checked."""

    first: int
    held: list[Held]
    stored_seq: int     # one duplicate: the stream sequence that holds its id
    window: tuple[int | None, int] | None = None   # a batch: the sequences (after, last] it moved


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
                 commit_max_delay: float = 0.002,
                 flow: int | None = None,
                 on_stored: Callable[[int], None] | None = None,
                 control_subject: str | None = None,
                 signer: MessageSigner | None = None) -> None:
        """
        ``max_in_flight_*`` bound what is held (queued or awaiting an ack); a single call larger
        than the bound is still accepted, alone. ``ack_timeout``: how long the server may owe
        an ack without confirming anything before the unconfirmed messages count as unknown
        and are resent (doubling, up to 16x, while resends bring no ack).
        ``commit_idle`` / ``commit_max_delay``: when a fast-ingest batch is committed (see
        :class:`FastBatchChannel`); ``flow`` fixes the flow-ack cadence instead of sizing it
        to the traffic. ``on_stored(position)`` is called, synchronously, each time
        :attr:`stored_position` advances. ``control_subject``: the subject of fast-ingest
        commit markers (captured by the stream, never stored); default: the batch's last
        message subject. ``signer``: every message gets its signature headers
        (docs/wire-contract.md "Signatures").
        """
        if mode not in ("fast-batch", "per-message", "auto"):
            raise ValueError(f"unknown publish mode {mode!r}")
        if max_in_flight_messages < 1 or max_in_flight_bytes < 1:
            raise ValueError("in-flight limits must be positive")
        if flow is not None and not 1 <= flow <= FAST_BATCH_MAX_FLOW:
            raise ValueError(f"flow must be between 1 and {FAST_BATCH_MAX_FLOW}")
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
        self._signer = signer

        self.stats = PublishStats()
        self.mode: Literal["fast-batch", "per-message"] | None = None
        self._ledger = Ledger()
        self._rate = RateMeter()
        self._channel: Channel | None = None
        self._subscription: Any = None
        self._task: asyncio.Task[None] | None = None
        self._js = nc.jetstream(timeout=2.0)

        self._stream_subjects: list[str] = []
        self._subjects: dict[str, bytes] = {}          # admitted subject -> encoded
        self._extra_headers: dict[tuple[tuple[str, str], ...], str] = {}   # -> header lines
        self._notified_position: int | None = None

        self._wake = asyncio.Event()      # the sender has something to look at
        self._room = Signal()            # held messages dropped below what publish() waits for
        self._room_wanted = (0, 0)
        self._stored = Signal()          # stored reached what a flush() waits for
        self._flush_target = 0            # highest target of any flush(): commit up to here
        self._flush_waiting: list[int] = []   # targets of the flush() calls now waiting
        self._publish_lock = asyncio.Lock()
        self._generation = 0              # nc.stats["reconnects"] the in-flight frames belong to
        self._resend_reason: str | None = None
        self._resends_without_progress = 0   # suspicious resends since progress
        self._timeouts_without_progress = 0  # ack-timeout resends since progress
        self._unanswered: OutgoingMessage | None = None   # got a 503, not yet looked into
        self._unanswered_since: float | None = None       # first 503 since the last progress
        self._duplicates = DuplicateChecker(self._js, stream, self.stats, signer)
        self._checks: list[_DuplicateCheck] = []
        self._checked_indexes: set[int] = set()
        self._check_task: asyncio.Task[None] | None = None
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

        wire: Wire = await probe_raw_wire(self._nc) or PublicWire(self._nc)
        inbox = self._nc.new_inbox()
        if self.mode == "fast-batch":
            self._channel = FastBatchChannel(
                self, self._ledger, wire, inbox, self.stats, self._rate,
                commit_idle=self._commit_idle, commit_max_delay=self._commit_max_delay,
                flow=self._flow,
                control_subject=self._control_subject.encode() if self._control_subject
                else None, last_seq=info.state.last_seq)
        else:
            self._channel = PerMessageChannel(self, self._ledger, wire, inbox, self.stats)
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
            for task in (self._task, self._check_task):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            if self._subscription is not None and not self._nc.is_closed:
                with contextlib.suppress(NatsError):
                    await self._subscription.unsubscribe()

    def connection_changed(self) -> None:
        """Tell the publisher NATS disconnected or reconnected (optional, it also polls)."""
        self._wake.set()

    # -- framing -----------------------------------------------------------------------------
    def _frame_all(self, messages: Sequence[OutgoingMessage]) -> tuple[list[Held], int, int]:
        """Validate and encode a call's messages: (held, total size, largest size).

        Raises before anything of the call is queued.
        """
        max_payload = self._nc.max_payload
        subjects, extras, signer = self._subjects, self._extra_headers, self._signer
        # the same loop compiled (None: something to admit or refuse); it does not sign
        if signer is None:
            framed = frame_messages(messages, subjects, extras, max_payload)
            if framed is not None:
                return framed
        held: list[Held] = []
        total = largest = 0
        # The hot loop of the publisher: kept free of calls where a builtin will do.
        for message in messages:
            subject = subjects.get(message.subject) or self._admit_subject(message.subject)
            msg_id = message.msg_id
            if not msg_id or not (msg_id.isascii() and msg_id.isprintable()):
                raise PublishError(f"Nats-Msg-Id {msg_id!r} of a message on {message.subject!r} "
                                   "must be non-empty printable ASCII")
            extra = (extras.get(message.headers) or self._encode_headers(message)
                     if message.headers else "")
            if signer is not None:
                extra += _signature_lines(signer, message)
            header = f"NATS/1.0\r\nNats-Msg-Id: {msg_id}\r\n{extra}\r\n".encode()
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
            if not (name and is_header_text(name) and ":" not in name and " " not in name
                    and is_header_text(value)):
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
                if self._check_task is not None:
                    # Duplicates first: a fast batch must not confirm past one, and nothing
                    # is resent while one is looked into.
                    await self._sleep_until(None)
                    continue
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
                if silent_since is None:  # the messages are confirmed; a reply may be owed
                    silent_since = channel.owed_since()
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

    def heard(self) -> None:
        self._ledger.heard(asyncio.get_running_loop().time())

    # -- duplicates (duplicates.py) ----------------------------------------------------------
    def duplicate(self, index: int, seq: int) -> None:
        held = self._ledger.held_at(index)
        if held is not None and index not in self._checked_indexes:
            self._checked_indexes.add(index)
            self._check(_DuplicateCheck(index, [held], seq))

    def check_batch(self, first: int, end: int, after_seq: int | None, last_seq: int) -> None:
        held = self._ledger.held_range(first, end)
        if held:
            self._check(_DuplicateCheck(first, held, last_seq, (after_seq, last_seq)))

    def _check(self, check: _DuplicateCheck) -> None:
        self._checks.append(check)
        if self._check_task is None:
            self._check_task = asyncio.create_task(self._check_duplicates(),
                                                   name=f"duplicate-check:{self._stream}")

    async def _check_duplicates(self) -> None:
        """Settle every queued duplicate, then confirm what is still held as it was."""
        try:
            while self._checks and self._failure is None:
                check = self._checks.pop(0)
                if check.window is None:
                    await self._duplicates.settle(check.held[0], check.stored_seq)
                else:
                    await self._duplicates.settle_batch(check.held, *check.window)
                self._checked_indexes.discard(check.first)
                if self._ledger.held_at(check.first) is check.held[0]:   # not resent meanwhile
                    if check.window is None:
                        self.confirm_one(check.first)
                    else:
                        self.confirm_through(check.first + len(check.held))
        except (NatsError, TimeoutError, OSError) as exc:
            # what could not be checked is sent again, and checked again when it is a duplicate
            self.request_resend(f"could not check a duplicate: {exc!r}")
        except PublishError as exc:
            self._fail(exc)
        except Exception as exc:  # noqa: BLE001 - a bug or an unforeseen reply: stop, say so
            error = PublishError(f"checking a duplicate on {self._stream!r} failed: {exc!r}")
            error.__cause__ = exc
            self._fail(error)
        finally:
            self._checks.clear()
            self._checked_indexes.clear()
            self._check_task = None
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


# The compiled twin (cdc_platform/speedups.py) stands in for these names; mypy checks it
# against them through its stub.
if TYPE_CHECKING:
    from cdc_platform._speedups.publishing import publisher as _twin
else:
    _twin = compiled_twin(__name__)
if _twin is not None:
    frame_messages = _twin.frame_messages
