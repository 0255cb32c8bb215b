"""Whole transactions out of the `CDC` events of the tables a consumer follows. Pure: no I/O.

The contract (docs/wire-contract.md "Transactions", published by ``bridge/events.py``): the last
event of each table in a transaction carries ``tx_tables``, a map of every table the transaction
changed to its number of change events. So a consumer that follows any subset of tables knows, from
the events it receives alone and without waiting for the next transaction, when it holds every
change of one: for each followed table the map names, its last event has arrived and it has that
many distinct events.
Schema events (``operation`` ``SCHEMA``) belong to the transaction they arrived in and are
not counted.

Redeliveries are expected (a bridge that crashed mid-transaction republishes the whole
transaction, and past the stream's duplicate window both copies are stored): events are
keyed by ``(ordinal, operation != SCHEMA)`` within their transaction, so a copy adds nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cdc_platform.errors import CdcError
from cdc_platform.lsn import format_lsn, parse_lsn_cached
from cdc_platform.wire import SCHEMA_OPERATION


class StreamGap(CdcError):
    """A transaction's events are missing from the stream (a later transaction began before
    it was complete): the consumer cannot be exact from here and must bootstrap again."""


@dataclass
class Transaction:
    commit_lsn: int
    keep_events: bool = True  # False: only the keys (a consumer applying as events come)
    events: dict[tuple[int, bool], Mapping[str, Any]] = field(default_factory=dict)
    counts: dict[str, set[int]] = field(default_factory=dict)  # table -> change ordinals
    schema_events: set[tuple[str, int]] = field(default_factory=set)  # (table, ordinal)
    tables: dict[str, int] | None = None  # the tx_tables map, once one arrived
    ended: set[str] = field(default_factory=set)  # tables whose last event arrived
    last_seq: int = 0  # the highest stream sequence of its events

    def add(self, event: Mapping[str, Any], seq: int) -> bool:
        """Whether ``event`` is new to the transaction (False: a redelivered copy)."""
        ordinal = int(event["ordinal"])
        if seq > self.last_seq:  # noqa: PLR1730 - (no max() call per event)
            self.last_seq = seq
        table = event["table"]
        if event["operation"] == SCHEMA_OPERATION:  # not counted; sorts before its change
            if (table, ordinal) in self.schema_events:
                return False
            self.schema_events.add((table, ordinal))
            if self.keep_events:
                self.events[(ordinal, False)] = event
            return True
        ordinals = self.counts.get(table)
        if ordinals is None:
            ordinals = self.counts[table] = set()
        elif ordinal in ordinals:
            return False
        ordinals.add(ordinal)
        if self.keep_events:
            self.events[(ordinal, True)] = event
        tx_tables = event.get("tx_tables")
        if tx_tables is not None:
            self.tables = dict(tx_tables)
            self.ended.add(table)
        return True

    def complete_for(self, followed: set[str], held: Mapping[str, int]) -> bool:
        if self.tables is None:
            return False
        for table, count in self.tables.items():
            if (table in followed and (table not in self.ended
                                       or len(self.counts.get(table, ())) != count)
                    and self.commit_lsn >= held.get(table, 0)):
                return False
        return True

    def ordered(self) -> list[Mapping[str, Any]]:
        return [self.events[key] for key in sorted(self.events)]


class TransactionCollector:
    """Feed events in stream order; get back whole transactions, oldest first.

    ``keep_events=False``: the transaction keeps only what completeness needs, and the
    consumer applies each new event as it comes (:meth:`offer` says which are new), so one
    huge transaction does not have to fit in memory.

    ``held``: followed table -> the commit LSN from which it needs transactions (it holds
    every one committed before). Such a table's events of an earlier transaction are not
    waited for: reading starts from the lowest position any table needs, which can be inside
    a transaction a table already holds whole (its events before the start), and no later
    transaction may ever come to show that one is over.
    """

    def __init__(self, followed: Iterable[str], *, keep_events: bool = True,
                 held: Mapping[str, int] | None = None) -> None:
        self.followed = set(followed)
        self.keep_events = keep_events
        self.held = dict(held or {})
        self._open: Transaction | None = None
        self._last_complete = -1

    def add(self, event: Mapping[str, Any], seq: int) -> Transaction | None:
        """The transaction ``event`` completed, if it did."""
        return self.offer(event, seq)[1]

    def offer(self, event: Mapping[str, Any], seq: int) -> tuple[bool, Transaction | None]:
        """(whether ``event`` is new: apply it; the transaction it completed, if it did)."""
        commit_lsn = parse_lsn_cached(event["commit_lsn"])
        if commit_lsn <= self._last_complete:
            return False, None  # a redelivered copy of a transaction already handed out
        current = self._open
        if current is not None and current.commit_lsn != commit_lsn:
            raise StreamGap(
                f"transaction {event['commit_lsn']} began before transaction "
                f"{format_lsn(current.commit_lsn)} was complete (have "
                f"{ {t: len(o) for t, o in current.counts.items()} }, expected "
                f"{current.tables}): events are missing from the stream")
        if current is None:
            current = self._open = Transaction(commit_lsn, self.keep_events)
        fresh = current.add(event, seq)
        if current.tables is not None and current.complete_for(self.followed, self.held):
            self._open = None
            self._last_complete = commit_lsn
            return fresh, current
        return fresh, None

    def reset(self) -> None:
        """Forget the open transaction (its events were rolled back)."""
        self._open = None

    @property
    def pending(self) -> Transaction | None:
        return self._open
