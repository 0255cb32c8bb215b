"""The replication acknowledgement rules without a server (hypothesis state machine): a model
of a walsender streaming transactions (keepalives between them and inside them, WAL moving on
with unpublished changes) and a caller confirming what it stored. The flush position never
goes back and never reaches the end of a transaction the caller has not confirmed; when
everything is confirmed and the stream is idle, it follows the server."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cdc_platform.replication.feedback import Feedback

START = 0x1000


class FeedbackMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.feedback = Feedback(START)
        self.position = START  # the server's WAL position streamed so far
        self.open_end: int | None = None  # end LSN of the transaction being streamed
        self.received: list[int] = []  # end LSNs of transactions received, in order
        self.confirmed = 0  # how many of them the caller confirmed
        self.flushed = START  # the last flush position reported
        self.idle_positions = [START]  # keepalive positions while nothing was in flight

    @precondition(lambda self: self.open_end is None)
    @rule(length=st.integers(min_value=1, max_value=500))
    def begin(self, length: int) -> None:
        # the transaction's end lies past everything the server has told us so far
        self.open_end = self.position + length
        self.feedback.began()
        self.feedback.received(self.position + 1)

    @precondition(lambda self: self.open_end is not None)
    @rule(ahead=st.integers(min_value=0, max_value=1000))
    def keepalive_inside_a_transaction(self, ahead: int) -> None:
        # may carry a position past the commit being sent (the reason for the rule)
        assert self.open_end is not None
        self.feedback.keepalive(self.open_end - 1 + ahead)

    @precondition(lambda self: self.open_end is not None)
    @rule()
    def commit(self) -> None:
        assert self.open_end is not None
        self.feedback.received(self.open_end)
        self.feedback.committed(self.open_end)
        self.received.append(self.open_end)
        self.position, self.open_end = self.open_end, None

    @precondition(lambda self: self.open_end is None)
    @rule(moved=st.integers(min_value=0, max_value=300))
    def keepalive_between_transactions(self, moved: int) -> None:
        # WAL moved on with changes of unpublished tables: nothing more for us before it
        self.position += moved
        if self.confirmed == len(self.received):
            self.idle_positions.append(self.position)
        self.feedback.keepalive(self.position)

    @precondition(lambda self: self.confirmed < len(self.received))
    @rule(data=st.data())
    def caller_confirms(self, data: st.DataObject) -> None:
        count = data.draw(st.integers(min_value=1, max_value=len(self.received) - self.confirmed))
        self.confirmed += count
        self.feedback.confirm(self.received[self.confirmed - 1])

    @rule()
    def status_update(self) -> None:
        write, flush, apply = self.feedback.status()
        assert flush == apply and write >= flush
        assert flush >= self.flushed  # never goes back
        self.flushed = flush
        self.feedback.reported(flush)
        assert not self.feedback.unreported

    @invariant()
    def nothing_unconfirmed_is_flushed(self) -> None:
        _write, flush, _apply = self.feedback.status()
        unconfirmed = self.received[self.confirmed:]
        if self.open_end is not None:
            unconfirmed.append(self.open_end)
        assert all(flush < end for end in unconfirmed), (flush, unconfirmed)
        confirmed_ends = self.received[:self.confirmed]
        assert flush <= max([*confirmed_ends, *self.idle_positions])

    @invariant()
    def an_idle_stream_follows_the_server(self) -> None:
        if self.open_end is None and self.confirmed == len(self.received):
            assert not self.feedback.in_flight
            _write, flush, _apply = self.feedback.status()
            assert flush == max([*self.received, *self.idle_positions])


TestFeedback = FeedbackMachine.TestCase
TestFeedback.settings = settings(max_examples=300, stateful_step_count=50, deadline=None)


def test_a_keepalive_inside_a_transaction_confirms_nothing() -> None:
    feedback = Feedback(100)
    feedback.began()
    feedback.keepalive(500)  # past the commit being sent
    assert feedback.status()[1] == 100
    feedback.committed(400)
    feedback.keepalive(500)  # received, not confirmed: still nothing
    assert feedback.status()[1] == 100 and feedback.in_flight
    feedback.confirm(400)
    feedback.keepalive(500)
    assert feedback.status()[1] == 500 and not feedback.in_flight
