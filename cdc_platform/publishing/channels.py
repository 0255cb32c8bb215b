"""The two ways onto the wire (module doc of ``publisher``): ADR-50 fast-ingest batches and one
PubAck per message. A channel numbers and writes what the ledger hands it and reads the
replies; the publisher decides when."""

from __future__ import annotations

import json
import logging
import secrets
from typing import Protocol

from cdc_platform.publishing.framing import Wire, error_details, status_details
from cdc_platform.publishing.ledger import CHUNK_MESSAGES, Ledger, RateMeter
from cdc_platform.publishing.messages import PublishStats

log = logging.getLogger(__name__)

# ADR-50 fast-ingest limits and settings (nats-server 2.14+).
FAST_BATCH_MAX_FLOW = 500         # the server never acks less often than every 500 messages
_FAST_BATCH_MIN_FLOW = 1          # at a trickle every message is acked, like a PubAck
_FAST_BATCH_ACK_INTERVAL = 0.0025 # one flow ack per ~2.5 ms of traffic: paces the batch
_FAST_BATCH_OUTSTANDING = 4       # flow-ack windows in flight (measured: 4 beats 2, 8 adds little)
_FAST_BATCH_UNKNOWN = 10208       # "batch publish ID unknown": the server abandoned the batch
_FAST_BATCH_REPLAN_FACTOR = 4     # start a new batch once the ideal flow is 4x the current one


class Host(Protocol):
    """What a channel may do to its publisher."""

    def confirm_through(self, end: int) -> None: ...
    def confirm_one(self, index: int) -> None: ...
    def heard(self) -> None: ...
    def duplicate(self, index: int, seq: int) -> None: ...
    def check_batch(self, first: int, end: int, after_seq: int | None,
                    last_seq: int) -> None: ...
    def reject(self, index: int | None, status: int | None, err_code: int | None,
               description: str) -> None: ...
    def no_responders(self, index: int) -> None: ...
    def request_resend(self, reason: str) -> None: ...


class Channel(Protocol):
    """One wire protocol: writes what may be written, turns replies into confirmations."""

    last_accept: float   # loop time of the latest publish() call

    def reset(self) -> None: ...
    async def pump(self, now: float, flush_target: int) -> bool: ...
    def on_reply(self, subject: str, data: bytes, headers: dict[str, str] | None,
                 stale: bool) -> None: ...
    def deadline(self) -> float | None: ...
    def owed_since(self) -> float | None: ...


class _Batch:
    """The open fast-ingest batch. ``base`` is the global index of its batch sequence 1."""

    __slots__ = (
        "acked",
        "base",
        "committed_at",
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
        self.committed_at = 0.0  # when the commit marker was written
        self.last_subject = b""


class FastBatchChannel:
    """ADR-50 fast-ingest batches, gap mode ``fail``, one batch at a time.

    A batch opens with its first message alone and waits for the server's first flow ack (it
    tells the ack cadence ``msgs``); after that messages may run up to
    ``acked + msgs * 4`` (the ADR-50 rule). The flow asked for is sized to the traffic (see
    :meth:`_wanted_flow`). Flow acks pace the batch but confirm nothing: the server takes a
    message it drops as a duplicate silently, and only the commit's PubAck shows how far the
    stream moved. So batches are short: one is committed with an end-of-batch marker (op 3:
    batch seq last+1, empty, not stored) as soon as nothing is queued and the server took
    every message written, when flush() wants it, when the caller has been idle for
    ``commit_idle``, when its first unconfirmed message has waited ``commit_max_delay``, or
    when the traffic grew so much that a batch with a larger flow is due. Each of these keeps
    a batch far below the server's 10 s inactivity limit.
    """

    def __init__(self, host: Host, ledger: Ledger, wire: Wire, inbox: str,
                 stats: PublishStats, rate: RateMeter, *, commit_idle: float,
                 commit_max_delay: float, flow: int | None,
                 control_subject: bytes | None = None, last_seq: int | None = None) -> None:
        """``last_seq``: the stream's last sequence before our first batch (None: unknown)."""
        self._host, self._ledger, self._wire, self._inbox = host, ledger, wire, inbox
        # The stream sequence of our last committed message: a batch of n messages that
        # moves the stream from here by other than n had messages dropped as duplicates.
        self._stream_seq = last_seq
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

        The window runs up to four flows past the last flow ack, and a batch is committed
        early once every message written was acked, so acks every ~2.5 ms of traffic keep
        both going at any rate: flow 4 at 2K msg/s, 500 (the server's maximum, fewest acks)
        from 200K msg/s or whenever a backlog builds up.
        """
        if self._fixed_flow is not None:
            return self._fixed_flow
        wanted = max(self._rate.rate * _FAST_BATCH_ACK_INTERVAL,
                     len(self._ledger.queued) / _FAST_BATCH_OUTSTANDING)
        if wanted >= FAST_BATCH_MAX_FLOW:
            return FAST_BATCH_MAX_FLOW
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
        replan = (self._fixed_flow is None and batch.flow < FAST_BATCH_MAX_FLOW
                  and self._wanted_flow() >= min(_FAST_BATCH_REPLAN_FACTOR * batch.flow,
                                                 FAST_BATCH_MAX_FLOW))
        if ledger.queued and not replan:
            room = batch.acked + batch.msgs * _FAST_BATCH_OUTSTANDING - batch.seq
            if room > 0:
                held = ledger.take(min(room, CHUNK_MESSAGES, len(ledger.queued)), now)
                first_seq = batch.seq + 1
                batch.seq, batch.last_subject = batch.seq + len(held), held[-1][0]
                self._stats.messages_sent += len(held)
                await self._wire.write_sequence(held, batch.reply_prefix, first_seq, b".1.$FI")
                return True
        if self._commit_due(batch, now, flush_target, replan):
            batch.committing, batch.committed_at = True, now
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
        if not ledger.queued and (batch.acked == batch.seq
                                  or now - self.last_accept >= self._commit_idle):
            return True   # (every message written was taken: its position waits on this)
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

    def owed_since(self) -> float | None:
        """Since when the server owes the commit's PubAck: a lost PubAck (a slow consumer's
        dropped reply) must end in a resend, not a batch waiting forever."""
        batch = self._batch
        return batch.committed_at if batch is not None and batch.committing else None

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
            status, description = status_details(headers)
            if status == 503:
                self._host.no_responders(batch.base + seq - 1)
            else:
                self._host.reject(batch.base + seq - 1, status, None, description)
            return
        reply = json.loads(data)
        kind = reply.get("type")
        if kind == "ack":
            # Cumulative: batch messages 1..seq were taken, in order (seq 0 opens the batch).
            # Not confirmed yet: one of them may have been dropped as a duplicate, which
            # only the commit's PubAck can show.
            batch.started = True
            batch.msgs = max(1, int(reply.get("msgs", 1)))
            acked = int(reply["seq"])
            if acked > batch.acked:
                batch.acked = acked
                self._host.heard()
        elif kind == "gap":
            # The server missed a frame of the open batch, so it stores nothing after it.
            self._batch = None
            self._host.request_resend(f"batch {batch.id} reported a gap: {reply}")
        elif kind == "err" or "error" in reply:
            status, err_code, description = error_details(reply.get("error"))
            if err_code == _FAST_BATCH_UNKNOWN:
                # Abandoned by the server (10 s of silence, e.g. a paused process): nothing is
                # wrong with the messages, so send them again in a new batch.
                self._batch = None
                self._host.request_resend(f"server abandoned batch {batch.id}")
                return
            where = int(reply["seq"]) if kind == "err" else seq
            self._host.reject(batch.base + where - 1, status, err_code, description)
        else:
            # The commit's PubAck: `count` batch messages were taken, duplicates included;
            # `seq` is the stream sequence of the last one stored.
            count, last_seq = int(reply.get("count", 0)), int(reply.get("seq", 0))
            self._batch = None
            if reply.get("duplicate"):
                # The batch's first message, sent alone, was a duplicate: the batch ended
                # there, and the PubAck names the message that holds its id.
                self._host.duplicate(batch.base, last_seq)
                return
            after_seq, end = self._stream_seq, batch.base + count
            self._stream_seq = last_seq
            if after_seq is not None and last_seq - after_seq == count:
                self._host.confirm_through(end)
            else:   # fewer stored than taken (duplicates), messages not ours in between, or
                # a stream purged or made anew
                self._host.check_batch(batch.base, end, after_seq, last_seq)
            if count < batch.seq:
                self._host.request_resend(
                    f"batch {batch.id} committed {count} of {batch.seq} messages")


class PerMessageChannel:
    """One PubAck per message; reply subject ``<inbox>.<epoch>.<global index>``.

    The epoch changes on every resend cycle, so an error reply to a frame we already gave up on
    (say a 503 from a server still recovering its streams) is recognised and ignored; its message
    is being resent anyway. Positive acks count whatever their epoch: stored is stored.
    """

    def __init__(self, host: Host, ledger: Ledger, wire: Wire, inbox: str,
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
        held = ledger.take(min(CHUNK_MESSAGES, len(ledger.queued)), now)
        self._stats.messages_sent += len(held)
        await self._wire.write_sequence(held, self._reply_prefix, first_index, b"")
        return True

    def owed_since(self) -> float | None:
        return None   # every reply is owed for a message the ledger holds

    def deadline(self) -> float | None:
        return None

    def on_reply(self, subject: str, data: bytes, headers: dict[str, str] | None,
                 stale: bool) -> None:
        epoch, _, index_text = subject[self._prefix_length:].partition(".")
        index = int(index_text)
        # `"error":` cannot occur in a successful PubAck (string values escape their quotes).
        if data and not headers and b'"error":' not in data:
            if b'"duplicate"' in data:   # (a cheap test first: this is the hot path)
                reply = json.loads(data)
                if reply.get("duplicate"):   # names the stored message that holds the id
                    self._host.duplicate(index, int(reply["seq"]))
                    return
            self._host.confirm_one(index)
            return
        if stale or int(epoch) != self._epoch:
            return
        if data and not headers:
            status, err_code, description = error_details(json.loads(data).get("error"))
        else:
            (status, description), err_code = status_details(headers), None
            if status == 503:
                self._host.no_responders(index)
                return
        self._host.reject(index, status, err_code, description)

