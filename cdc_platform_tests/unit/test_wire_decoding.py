"""The compiled msgpack decoder (``_speedups/wire/encoding.pyx``, on the shared reader)
against ``msgpack.unpackb``: the same value whenever it answers, and a ValueError or TypeError
(the caller then decodes the pure way) for anything it does not take, truncated or forged
bytes included. Its kept-keys table must never hand back another key than the bytes say."""

from __future__ import annotations

import os

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdc_platform.speedups import compiled_twin
from cdc_platform.wire import decode_payload
from cdc_platform.wire.encoding import without
from cdc_platform_tests.msgpack_values import same as _same
from cdc_platform_tests.msgpack_values import values

ENCODING = compiled_twin("cdc_platform.wire.encoding")
compiled = pytest.mark.skipif(ENCODING is None, reason="the compiled decoder is not built")

keys = st.one_of(st.text(max_size=70), st.integers(-(2**63), 2**64 - 1), st.booleans())
documents = st.recursive(values, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(keys, inner, max_size=6)), max_leaves=20)


def test_the_decoder_is_built():
    if os.environ.get("CDC_PLATFORM_PURE_PYTHON"):
        pytest.skip("pure Python asked for")
    assert ENCODING is not None, "the twin of cdc_platform.wire.encoding is not built: pip install -e ."


@compiled
@settings(max_examples=500, deadline=None)
@given(documents)
def test_the_same_value_as_msgpack(document):
    data = msgpack.packb(document, use_bin_type=True)
    want = msgpack.unpackb(data, raw=False, strict_map_key=False)
    assert _same(ENCODING.decode_msgpack(data), want)
    assert _same(decode_payload(data, "msgpack"), want)


# events and batches of them, whose fields (some of them left unread) hold any value
_FIELDS = ["table", "lsn", "subject", "xid", "data", "é", "x" * 70]
events = st.dictionaries(st.one_of(st.sampled_from(_FIELDS), keys), documents, max_size=8)
payloads = st.one_of(events, st.lists(st.one_of(events, documents), max_size=4), documents)
unread_sets = st.frozensets(st.sampled_from(_FIELDS), min_size=1)


@compiled
@settings(max_examples=500, deadline=None)
@given(payloads, unread_sets)
def test_unread_fields_are_left_out_as_the_pure_path_leaves_them(payload, unread):
    data = msgpack.packb(payload, use_bin_type=True)
    want = without(msgpack.unpackb(data, raw=False, strict_map_key=False), unread)
    assert _same(ENCODING.decode_msgpack(data, unread), want)
    assert _same(decode_payload(data, "msgpack", unread), want)


@compiled
@settings(max_examples=500, deadline=None)
@given(st.one_of(st.binary(max_size=60), payloads.map(lambda p: msgpack.packb(p)[:-1]),
                 payloads.map(lambda p: _corrupt_text(msgpack.packb(p)))), unread_sets)
def test_unread_fields_are_checked_as_the_pure_path_checks_them(data, unread):
    """Bytes the pure decoder refuses anywhere (a cut value, bad UTF-8, a type outside the
    contract) are refused in an unread field too: a payload is one or the other whatever
    the caller reads of it."""
    try:
        want = without(msgpack.unpackb(data, raw=False, strict_map_key=False), unread)
    except Exception:  # noqa: BLE001 - any error: the compiled decoder must refuse too
        with pytest.raises((ValueError, TypeError)):
            ENCODING.decode_msgpack(data, unread)
        return
    try:
        got = ENCODING.decode_msgpack(data, unread)
    except (ValueError, TypeError):
        assert _same(decode_payload(data, "msgpack", unread), want)
        return
    assert _same(got, want)


def _corrupt_text(data: bytes) -> bytes:
    """``data`` with the first byte of its last text of 1 to 31 bytes made 0xff."""
    for position in range(len(data) - 2, -1, -1):
        if 0xa1 <= data[position] <= 0xbf and position + 1 + (data[position] & 0x1f) <= len(data):
            return data[:position + 1] + b"\xff" + data[position + 2:]
    return data


@compiled
@pytest.mark.parametrize("bad", [
    b"\xa1\x80", b"\xa2\xc3\x28", b"\xa3\xed\xa0\x80", b"\xa2\xc0\xaf",  # bad UTF-8
    b"\xa4\xf4\x90\x80\x80", b"\xa2\xe2\x82", b"\xd9\x01\xff",
    b"\x81\x91\x01\x02",  # a map whose key is an array
    b"\x91\xc1",  # a byte msgpack never writes
])
def test_a_bad_value_in_an_unread_field_is_refused(bad):
    """(the pure decoder refuses it, so the compiled one must: left unread is not unchecked)"""
    data = b"\x82\xa5table\xa1t\xa3lsn" + bad
    with pytest.raises(Exception):  # noqa: B017 - whatever msgpack raises
        msgpack.unpackb(data, raw=False, strict_map_key=False)
    with pytest.raises((ValueError, TypeError)):
        ENCODING.decode_msgpack(data, frozenset({"lsn"}))
    assert ENCODING.decode_msgpack(b"\x82\xa5table\xa1t\xa3lsn\xa20/",
                                   frozenset({"lsn"})) == {"table": "t"}


def test_unread_fields_are_left_out_of_json_too():
    data = b'[{"table": "t", "lsn": "0/1", "data": {"lsn": 1}}, 7]'
    assert decode_payload(data, "json", frozenset({"lsn"})) == [
        {"table": "t", "data": {"lsn": 1}}, 7]


@compiled
def test_kept_keys_are_never_confused():
    # 5,000 names share 512 slots: every collision replaces a kept key, none is misread
    names = [f"column_{number}" for number in range(5000)] + ["é" * 10, "x" * 64, "x" * 65]
    for round_number in range(3):
        for start in range(0, len(names), 7):
            event = {name: round_number for name in names[start:start + 7]}
            decoded = ENCODING.decode_msgpack(msgpack.packb(event))
            assert list(decoded) == list(event) and decoded == event


@compiled
def test_forged_map_sizes_reserve_little_memory():
    """Maps nested 400 deep, each claiming 4 billion entries, in 200 KB: refused, without
    reserving room for what they claim (a gigabyte before the cap)."""
    import tracemalloc

    forged = b"\xdf\xff\xff\xff\xff\xa0" * 400 + b"\xc0" * 200_000
    tracemalloc.start()
    try:
        with pytest.raises(ValueError):
            ENCODING.decode_msgpack(forged)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 << 20


@compiled
def test_kept_values_are_never_confused():
    # 20,000 short texts share 1,024 slots (and differ by a byte, or by length only); kept
    # values are handed out again, never one for another
    texts = [f"v{number}" for number in range(20000)] + ["", "a", "a\x00", "é", "x" * 40,
                                                         "x" * 41, "NaN", "1.50"]
    for round_number in range(2):
        for start in range(0, len(texts), 5):
            values = texts[start:start + 5]
            decoded = ENCODING.decode_msgpack(msgpack.packb({"data": values}))
            assert decoded == {"data": values}, (round_number, values)
    again = ENCODING.decode_msgpack(msgpack.packb(["same text", "same text"]))
    assert again[0] is again[1]  # (kept: the one str, immutable)


@compiled
@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=60) | documents.map(lambda d: msgpack.packb(d)[:-1]))
def test_bytes_it_does_not_take_are_refused_never_misread(data):
    try:
        want = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception:  # noqa: BLE001 - any error: the compiled decoder must refuse too
        with pytest.raises((ValueError, TypeError)):
            ENCODING.decode_msgpack(data)
        return
    try:
        got = ENCODING.decode_msgpack(data)
    except (ValueError, TypeError):  # (an ext type, say): the pure decoder answers
        assert _same(decode_payload(data, "msgpack"), want)
        return
    assert _same(got, want)


@compiled
def test_deep_nesting_is_refused_not_a_crash():
    deep = b"\x91" * 200_000 + b"\x01"
    with pytest.raises(ValueError, match="too deep"):
        ENCODING.decode_msgpack(deep)
    with pytest.raises(ValueError):  # the pure decoder's own error, through decode_payload
        decode_payload(deep, "msgpack")
    with pytest.raises(ValueError, match="too deep"):
        compiled_twin("cdc_platform.mirror.snapshots").chunk_tuples(
            b"\x82\xa5chunk" + deep + b"\xa4data\x90", ("id",))


def test_deep_json_is_a_value_error_too():
    """The mirror refuses ValueErrors as malformed messages; json's RecursionError would
    have stopped it (and the message comes again after a restart)."""
    with pytest.raises(ValueError, match="nested too deep"):
        decode_payload(b"[" * 100_000 + b"]" * 100_000, "json")
    expected: list = []
    for _ in range(49):
        expected = [expected]
    assert decode_payload(b"[" * 50 + b"]" * 50, "json") == expected
