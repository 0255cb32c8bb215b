"""The publisher's ledger without a server (hypothesis state machine): whatever order of
accepts, writes, cumulative and per-message acks and resends, no message is lost, reordered or
released before it is stored, and the stored position is exactly the last one whose messages
are all stored."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cdc_platform.publishing.ledger import CHUNK_BYTES, Ledger
from cdc_platform.publishing.messages import Held, OutgoingMessage


def _held(index: int, size: int) -> Held:
    subject = f"cdc.t.{index}".encode()
    return (subject, b"NATS/1.0\r\n\r\n", b"", OutgoingMessage(subject.decode(), str(index), b""),
            size)


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ledger = Ledger()
        self.messages: list[Held] = []  # every message accepted, in order
        self.calls: list[tuple[int, int]] = []  # (end index, position) of calls with one
        self.now = 0.0
        self.reported: int | None = None

    def _tick(self) -> float:
        self.now += 0.001
        return self.now

    @rule(sizes=st.lists(st.sampled_from([1, 100, 4096, CHUNK_BYTES // 3, CHUNK_BYTES * 2]),
                         max_size=6),
          position=st.one_of(st.none(), st.integers(min_value=0, max_value=1000)))
    def accept(self, sizes: list[int], position: int | None) -> None:
        start = len(self.messages)
        held = [_held(start + offset, size) for offset, size in enumerate(sizes)]
        self.messages.extend(held)
        reached = self.ledger.accept(held, sum(sizes), max(sizes, default=0), position)
        if position is not None:
            self.calls.append((len(self.messages), position))
        # an empty call with nothing outstanding is stored at once (if it is news)
        assert reached == (position is not None and not sizes
                           and self.ledger.accepted <= self.ledger.stored
                           and (self.reported is None or position > self.reported))
        self._record()

    @precondition(lambda self: self.ledger.queued)
    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        count = data.draw(st.integers(min_value=1, max_value=len(self.ledger.queued)))
        before = self.ledger.sent_end
        taken = self.ledger.take(count, self._tick())
        assert 1 <= len(taken) <= count
        assert sum(h[4] for h in taken[:-1]) < CHUNK_BYTES  # ~1 MB at most, one at least
        assert taken == self.messages[before:before + len(taken)]  # in publish order

    @rule(data=st.data())
    def ack_through(self, data: st.DataObject) -> None:
        end = data.draw(st.integers(min_value=0, max_value=len(self.messages) + 2))
        stored_before = self.ledger.stored
        news = self.ledger.confirm_through(end, self._tick())
        # never past what was written
        assert self.ledger.stored == max(stored_before, min(end, self.ledger.sent_end))
        assert news == (self.ledger.stored > stored_before)
        self._record()

    @rule(data=st.data())
    def ack_one(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(min_value=0, max_value=len(self.messages) + 1))
        self.ledger.confirm_one(index, self._tick())
        self._record()

    @rule()
    def resend(self) -> None:
        unconfirmed = len(self.ledger.sent)
        assert self.ledger.requeue() == unconfirmed
        assert not self.ledger.sent and self.ledger.oldest_write() is None

    def _record(self) -> None:
        position = self.ledger.stored_position
        if position is not None:
            assert self.reported is None or position >= self.reported  # never goes back
            self.reported = position

    @invariant()
    def nothing_lost_or_reordered(self) -> None:
        ledger = self.ledger
        assert 0 <= ledger.stored <= ledger.sent_end <= ledger.accepted == len(self.messages)
        assert list(ledger.sent) + list(ledger.queued) == self.messages[ledger.stored:]
        assert ledger.held == ledger.accepted - ledger.stored
        assert ledger.held_bytes == sum(h[4] for h in self.messages[ledger.stored:])

    @invariant()
    def the_stored_position_is_the_last_fully_stored(self) -> None:
        reached = [position for end, position in self.calls if end <= self.ledger.stored]
        # an empty call made while nothing was outstanding counts at once (end <= stored)
        assert self.ledger.stored_position == (max(reached) if reached else None)


TestLedger = LedgerMachine.TestCase
TestLedger.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
