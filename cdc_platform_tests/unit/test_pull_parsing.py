"""What the pull reader reads from the protocol: ack subjects (both ADR-15 forms; the compiled
reader against the plain split) and header blocks (a stored message's, a status)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdc_platform.jetstream.pull import _parse_headers, sequences, sequences_python
from cdc_platform.speedups import compiled_twin

SEQUENCES = getattr(compiled_twin("cdc_platform.jetstream.pull"), "sequences", None)


def test_sequences_of_both_ack_subject_forms():
    assert sequences(b"$JS.ACK.CDC.mirror1.1.4711.12.1700000000000000000.3") == (4711, 12)
    assert sequences(b"$JS.ACK.hub.ACCHASH.CDC.mirror1.1.4711.12.1700000000000000000.3.tok") \
        == (4711, 12)


def test_headers_of_a_stored_message_and_of_statuses():
    assert _parse_headers(b"NATS/1.0\r\nNats-Msg-Id: 0/1A:3\r\nContent-Type: a/b\r\n\r\n") == (
        0, "", {"Nats-Msg-Id": "0/1A:3", "Content-Type": "a/b"})
    assert _parse_headers(b"NATS/1.0 408 Request Timeout\r\nNats-Pending-Messages: 5\r\n\r\n") \
        == (408, "Request Timeout", {"Nats-Pending-Messages": "5"})
    assert _parse_headers(b"NATS/1.0 409 Consumer Deleted\r\n\r\n")[:2] == (
        409, "Consumer Deleted")
    assert _parse_headers(b"NATS/1.0 503\r\n\r\n")[:2] == (503, "")


TOKENS = st.one_of(st.integers(0, 2**70).map(str), st.sampled_from(
    ["", "+1", " 1", "1_0", "-3", "x", "007", "٣", "1 ", "CDC", "mirror1"]), st.text(max_size=4))


@pytest.mark.skipif(SEQUENCES is None, reason="the compiled twin is not built")
@settings(max_examples=2000, deadline=None)
@given(st.lists(TOKENS, min_size=1, max_size=20))
def test_the_compiled_sequences_answer_or_fail_as_the_plain_split(tokens):
    reply = ".".join(tokens).encode()
    assert _outcome(SEQUENCES, reply) == _outcome(sequences_python, reply)


def test_sequences_of_real_forms_in_both():
    for function in filter(None, (SEQUENCES, sequences_python)):
        assert function(b"$JS.ACK.S.c.1.18446744073709551615.1.2.3") == (2**64 - 1, 1)


def _outcome(function, reply):
    try:
        return function(reply), None
    except Exception as exc:  # noqa: BLE001 - comparing behaviour
        return None, type(exc)
