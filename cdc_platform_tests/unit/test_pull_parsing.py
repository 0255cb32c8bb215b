"""What the pull reader reads from the protocol: ack subjects (both ADR-15 forms) and header
blocks (a stored message's, a status)."""

from __future__ import annotations

from cdc_platform.jetstream.pull import _parse_headers, _sequences


def test_sequences_of_both_ack_subject_forms():
    assert _sequences(b"$JS.ACK.CDC.mirror1.1.4711.12.1700000000000000000.3") == (4711, 12)
    assert _sequences(b"$JS.ACK.hub.ACCHASH.CDC.mirror1.1.4711.12.1700000000000000000.3.tok") \
        == (4711, 12)


def test_headers_of_a_stored_message_and_of_statuses():
    assert _parse_headers(b"NATS/1.0\r\nNats-Msg-Id: 0/1A:3\r\nContent-Type: a/b\r\n\r\n") == (
        0, "", {"Nats-Msg-Id": "0/1A:3", "Content-Type": "a/b"})
    assert _parse_headers(b"NATS/1.0 408 Request Timeout\r\nNats-Pending-Messages: 5\r\n\r\n") \
        == (408, "Request Timeout", {"Nats-Pending-Messages": "5"})
    assert _parse_headers(b"NATS/1.0 409 Consumer Deleted\r\n\r\n")[:2] == (
        409, "Consumer Deleted")
    assert _parse_headers(b"NATS/1.0 503\r\n\r\n")[:2] == (503, "")
