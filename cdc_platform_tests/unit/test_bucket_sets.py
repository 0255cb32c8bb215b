"""A set of buckets as ``bucket_bitmap`` (``wire.bucket_sets``): the golden vectors' bytes,
repair metas that carry one, and the repair request body that sends one only when the list
does not fit."""

from __future__ import annotations

import base64
import json

import pytest

from cdc_platform.consumer.requests import repair_request_body
from cdc_platform.consumer.snapshots import SnapshotMeta, SnapshotUnusable, repair_refusal
from cdc_platform.snapshot.requests import parse_request
from cdc_platform.wire import (
    META_MAX_LISTED_BUCKETS,
    REQUEST_BODY_MAX_BYTES,
    bucket_bitmap_bytes,
    decode_bucket_bitmap,
    encode_bucket_bitmap,
)
from cdc_platform_tests import golden

VECTORS = json.loads(golden.BUCKET_BITMAPS.read_text())


def test_the_golden_vectors_are_written_and_read_alike():
    assert golden.bucket_bitmap_vectors() == golden.BUCKET_BITMAPS.read_text()
    for vector in VECTORS:
        bits, buckets, text = vector["bits"], vector["buckets"], vector["bucket_bitmap"]
        assert encode_bucket_bitmap(bits, buckets) == text
        assert decode_bucket_bitmap(bits, text) == tuple(buckets)
        assert len(base64.b64decode(text)) == bucket_bitmap_bytes(bits)


def test_bucket_b_is_bit_7_minus_b_mod_8_of_byte_b_div_8():
    # buckets 3 and 9 of 16: 0b00010000, 0b01000000
    assert base64.b64decode(encode_bucket_bitmap(4, [9, 3])) == bytes([0x10, 0x40])
    assert base64.b64decode(encode_bucket_bitmap(0, [0])) == bytes([0x80])
    fourteen = encode_bucket_bitmap(14, range(16384))
    assert len(fourteen) == 2732 and bucket_bitmap_bytes(14) == 2048
    with pytest.raises(ValueError, match="not below 2"):
        encode_bucket_bitmap(4, [16])


def _golden_meta(case: str) -> dict:
    return json.loads(json.loads(golden.path(case, "json").read_text().splitlines()[0])["payload"])


def test_a_repair_meta_of_more_buckets_than_listed_carries_the_bitmap():
    payload = _golden_meta("repair_meta_bitmap")
    assert "buckets" not in payload and list(payload)[-2:] == ["bits", "bucket_bitmap"]
    meta = SnapshotMeta.from_wire(payload)
    assert (meta.is_repair, meta.bits, meta.subject) == (True, 15, "init.repair.users")
    assert meta.buckets == tuple(range(META_MAX_LISTED_BUCKETS + 1))
    assert meta.covers(14, [8191]) and not meta.covers(14, [8192])
    # a refusal names how many it holds, not each of them
    assert repair_refusal(meta, "users", payload["schema_fingerprint"], 14, [8192]) == (
        "repair snapshot repair-20261122T100000Z-0a0b0c0e of users holds 16,385 buckets at "
        "15 bits, not every one asked for at 14 bits")
    listed = _golden_meta("repair_meta")
    assert listed["buckets"] == [3, 9] and "bucket_bitmap" not in listed


@pytest.mark.parametrize("change", [
    {"buckets": [3]},  # both
    {"bucket_bitmap": None},  # not a string
    {"bucket_bitmap": "AAAA"},  # wrong length at 15 bits
    {"bits": 14},  # the same bitmap is of 15 bits
])
def test_a_repair_meta_with_a_malformed_bitmap_is_unusable(change):
    with pytest.raises(SnapshotUnusable, match="malformed snapshot meta"):
        SnapshotMeta.from_wire({**_golden_meta("repair_meta_bitmap"), **change})


def test_a_repair_request_lists_its_buckets_when_they_fit_else_sends_the_bitmap():
    few = json.loads(repair_request_body("r", "_INBOX.x", 14, [5, 900]))
    assert few["buckets"] == [5, 900] and "bucket_bitmap" not in few
    many = list(range(0, 16384, 16))  # 1,024 of 16,384: ~6 KB as a list
    body = repair_request_body("r", "_INBOX.x", 14, many)
    assert len(body) <= REQUEST_BODY_MAX_BYTES and b'"buckets"' not in body
    request = parse_request("snapshot.request.users", body, 1)
    assert (request.refused, request.bits, request.buckets) == (None, 14, tuple(many))
    # past 14 bits a bitmap is over the limit too: the requester refuses to send it
    assert len(repair_request_body("r", "_INBOX.x", 15, range(0, 32768, 16))) > (
        REQUEST_BODY_MAX_BYTES)
