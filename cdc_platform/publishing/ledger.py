"""The publisher's bookkeeping: every message accepted and not yet stored, the positions, the
publish rate. No I/O."""

from __future__ import annotations

import asyncio
from collections import deque
from itertools import islice

from cdc_platform.publishing.messages import Held

CHUNK_MESSAGES = 250  # frames per write: amortises the flusher, keeps acks flowing
CHUNK_BYTES = 1024 * 1024


class Ledger:
    """Every message accepted and not yet stored, in publish order, and the positions.

    Indexes are global: message ``i`` is the ``i``-th message ever accepted. Invariant: messages
    ``[0, stored)`` are stored in JetStream; ``sent`` holds ``[stored, sent_end)``, written in the
    current attempt with unknown outcome; ``queued`` holds the rest, not written (or to be
    written again). Nothing leaves the ledger before JetStream confirmed it.
    """

    def __init__(self) -> None:
        self.queued: deque[Held] = deque()
        self.sent: deque[Held] = deque()
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

    def accept(self, messages: list[Held], size: int, largest: int,
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

    def take(self, count: int, now: float) -> list[Held]:
        """Move up to ``count`` queued messages (at least one, at most ~1 MB) to ``sent``;
        ``count`` is at most what is queued.

        The caller writes them right away; the time is kept for ack latency and timeouts.
        """
        popleft = self.queued.popleft
        if count * self.largest <= CHUNK_BYTES:   # the common case: no need to count bytes
            messages = [popleft() for _ in range(count)]
        else:
            messages, size = [], 0
            while len(messages) < count and size < CHUNK_BYTES:
                held = popleft()
                messages.append(held)
                size += held[4]
        self.sent.extend(messages)
        self._writes.append((self.sent_end, now))
        return messages

    def held_at(self, index: int) -> Held | None:
        offset = index - self.stored
        if 0 <= offset < len(self.sent):
            return self.sent[offset]
        return None

    def held_range(self, first: int, end: int) -> list[Held]:
        """The written, unconfirmed messages ``[first, end)`` (those of them still held)."""
        return list(islice(self.sent, max(0, first - self.stored), max(0, end - self.stored)))

    def heard(self, now: float) -> None:
        """The server showed progress without confirming anything (a fast-ingest flow ack):
        it is working, not silent."""
        self.last_confirmed_at = now

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


class RateMeter:
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


class Signal:
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

