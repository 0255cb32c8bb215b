"""The acknowledgement rules of a logical replication stream, without I/O.

The slot reader tells :class:`Feedback` what arrived (a transaction's Begin and Commit, the
WAL positions received, the server's keepalives) and what the caller has durably handled
(:meth:`Feedback.confirm`); it asks it what a standby status update reports
(:meth:`Feedback.status`). The rules ("Streaming Replication Protocol", standby status update):

* the flush position is only what the caller confirmed: a transaction's end LSN once
  everything of it is stored downstream. PostgreSQL may recycle WAL up to it, so reporting
  more loses changes on a crash;
* except when nothing is in flight (no transaction open, every received one confirmed): then
  the server's keepalive position is reported too, so a slot whose tables are quiet does not
  hold WAL back forever. Between Begin and Commit a keepalive may carry a position past the
  commit being sent, so it is not used then;
* the write position is the highest WAL position received (never below the flush position);
* nothing ever goes back.
"""

from __future__ import annotations


class Feedback:
    """Positions of one replication stream and what a status update reports."""

    __slots__ = ("confirmed_lsn", "in_transaction", "last_commit_end_lsn", "received_lsn",
                 "reported_lsn")

    def __init__(self, start_lsn: int = 0) -> None:
        self.received_lsn = start_lsn  # highest WAL position received
        self.last_commit_end_lsn = start_lsn  # end of the last transaction fully received
        self.confirmed_lsn = start_lsn  # what is reported as flushed
        self.reported_lsn = 0  # the flush position of the last status update sent
        self.in_transaction = False  # between a Begin and its Commit

    def began(self) -> None:
        self.in_transaction = True

    def committed(self, end_lsn: int) -> None:
        """A transaction was received whole (its Commit arrived)."""
        self.last_commit_end_lsn = max(self.last_commit_end_lsn, end_lsn)
        self.in_transaction = False

    def received(self, wal_end: int) -> None:
        self.received_lsn = max(self.received_lsn, wal_end)

    def keepalive(self, wal_end: int) -> None:
        """The server's keepalive (its position ``wal_end``)."""
        if not self.in_transaction and not self.in_flight and wal_end > self.confirmed_lsn:
            # nothing in flight: everything up to the server's position is done
            self.confirmed_lsn = self.last_commit_end_lsn = wal_end

    def confirm(self, lsn: int) -> None:
        """Everything up to ``lsn`` (a commit's end LSN) is durably handled downstream."""
        self.confirmed_lsn = max(self.confirmed_lsn, lsn)

    @property
    def in_flight(self) -> bool:
        """Received transactions not yet confirmed."""
        return self.confirmed_lsn < self.last_commit_end_lsn

    @property
    def unreported(self) -> bool:
        """Whether the confirmed position moved since the last status update."""
        return self.confirmed_lsn > self.reported_lsn

    def status(self) -> tuple[int, int, int]:
        """(write, flush, apply) positions for a standby status update."""
        return max(self.received_lsn, self.confirmed_lsn), self.confirmed_lsn, self.confirmed_lsn

    def reported(self, flush_lsn: int) -> None:
        """A status update reporting ``flush_lsn`` was sent."""
        self.reported_lsn = max(self.reported_lsn, flush_lsn)
