"""Whole transactions from the events of followed tables (the tx_tables contract)."""

from __future__ import annotations

import pytest

from cdc_platform.mirror.transactions import StreamGap, TransactionCollector


def change(table, commit_lsn, ordinal, tx_tables=None, operation="INSERT"):
    event = {"table": table, "commit_lsn": commit_lsn, "ordinal": ordinal,
             "operation": operation}
    if tx_tables is not None:
        event["tx_tables"] = tx_tables
    return event


def feed(collector, events):
    done = []
    for seq, event in enumerate(events, start=1):
        transaction = collector.add(event, seq)
        if transaction is not None:
            done.append((transaction.commit_lsn, [(e["table"], e["ordinal"], e["operation"])
                                                  for e in transaction.ordered()],
                         transaction.last_seq))
    return done


def test_complete_when_every_followed_table_of_the_transaction_ended():
    tx = {"a": 2, "b": 1, "c": 5}  # c is not followed: its events never arrive
    done = feed(TransactionCollector({"a", "b"}), [
        change("a", "0/10", 0), change("b", "0/10", 2, tx), change("a", "0/10", 3, tx),
        change("a", "0/20", 0, {"a": 1})])
    assert done == [(0x10, [("a", 0, "INSERT"), ("b", 2, "INSERT"), ("a", 3, "INSERT")], 3),
                    (0x20, [("a", 0, "INSERT")], 4)]


def test_not_complete_before_the_last_event_of_a_followed_table():
    collector = TransactionCollector({"a", "b"})
    assert feed(collector, [change("a", "0/10", 0, {"a": 1, "b": 1})]) == []
    assert collector.pending is not None


def test_a_table_holding_the_transaction_already_is_not_waited_for():
    """Reading began after ``a``'s events of 0/10 (``a`` holds every transaction before
    0/11); ``b`` needs it. 0/20 needs both again."""
    tx = {"a": 1, "b": 1}
    collector = TransactionCollector({"a", "b"}, held={"a": 0x11, "b": 0x5})
    done = feed(collector, [change("b", "0/10", 1, tx), change("a", "0/20", 0, tx)])
    assert done == [(0x10, [("b", 1, "INSERT")], 1)]
    assert collector.pending is not None  # 0/20: b's event still to come


def test_redelivered_events_and_transactions_add_nothing():
    tx = {"a": 2}
    done = feed(TransactionCollector({"a"}), [
        change("a", "0/10", 0),                      # first attempt, cut off
        change("a", "0/10", 0), change("a", "0/10", 1, tx),  # the whole transaction again
        change("a", "0/10", 0), change("a", "0/10", 1, tx),  # a third copy, after completion
        change("a", "0/20", 0, {"a": 1})])
    assert [commit for commit, _, _ in done] == [0x10, 0x20]
    assert done[0][1] == [("a", 0, "INSERT"), ("a", 1, "INSERT")]


def test_schema_events_belong_to_their_transaction_before_their_change():
    done = feed(TransactionCollector({"a"}), [
        change("a", "0/10", 0, operation="SCHEMA"), change("a", "0/10", 0, {"a": 1})])
    assert done == [(0x10, [("a", 0, "SCHEMA"), ("a", 0, "INSERT")], 2)]


def test_a_missing_event_is_a_stream_gap():
    with pytest.raises(StreamGap, match="events are missing"):
        feed(TransactionCollector({"a"}), [change("a", "0/10", 1, {"a": 2}),
                                           change("a", "0/20", 0, {"a": 1})])
