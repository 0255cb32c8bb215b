"""A repair snapshot's meta as a consumer reads it (``consumer/snapshots.py``): the golden
repair meta's buckets, which buckets it covers at other bits, what is malformed, and when it
cannot repair a table."""

from __future__ import annotations

import json

import pytest

from cdc_platform.consumer.snapshots import SnapshotMeta, SnapshotUnusable, repair_refusal
from cdc_platform_tests import golden


def _golden_meta(case: str) -> dict:
    return json.loads(json.loads(golden.path(case, "json").read_text().splitlines()[0])["payload"])


REPAIR = _golden_meta("repair_meta")  # buckets 3 and 9 at 4 bits


def test_the_golden_repair_meta_reads_as_a_repair_of_its_buckets():
    meta = SnapshotMeta.from_wire(REPAIR, seq=7)
    assert (meta.is_repair, meta.bits, meta.buckets, meta.seq) == (True, 4, (3, 9), 7)
    assert meta.subject == "init.repair.users"
    full = SnapshotMeta.from_wire(_golden_meta("meta"))
    assert (full.is_repair, full.bits, full.buckets, full.subject) == (
        False, None, None, "init.meta.users")


@pytest.mark.parametrize(("bits", "buckets", "covered"), [
    (4, [3], True), (4, [3, 9], True), (4, [4], False),
    (6, [12, 13, 14, 15, 36], True),  # finer: each inside bucket 3 or 9
    (6, [16], False),
    (3, [1], False),  # coarser: bucket 1 at 3 bits is 2 and 3 at 4 bits; 2 is missing
    (0, [0], False),
])
def test_a_repair_covers_the_buckets_inside_its_own_at_any_bits(bits, buckets, covered):
    assert SnapshotMeta.from_wire(REPAIR).covers(bits, buckets) is covered
    assert SnapshotMeta.from_wire(_golden_meta("meta")).covers(bits, buckets)  # a full one


def test_the_coarser_bucket_is_covered_when_both_halves_are():
    meta = SnapshotMeta.from_wire({**REPAIR, "buckets": [2, 3]})
    assert meta.covers(3, [1]) and not meta.covers(2, [0])


@pytest.mark.parametrize("change", [
    {"bits": 21}, {"bits": "4"}, {"bits": True}, {"buckets": []}, {"buckets": [9, 3]},
    {"buckets": [3, 3]}, {"buckets": [16]}, {"buckets": [-1]}, {"buckets": "3"},
    {"buckets": [3.0]}, {"bits": None},
])
def test_a_repair_meta_with_malformed_buckets_is_unusable(change):
    with pytest.raises(SnapshotUnusable, match="malformed snapshot meta"):
        SnapshotMeta.from_wire({**REPAIR, **change})


def test_a_meta_with_bits_but_no_buckets_is_unusable():
    meta = dict(REPAIR)
    del meta["buckets"]
    with pytest.raises(SnapshotUnusable, match="malformed snapshot meta"):
        SnapshotMeta.from_wire(meta)


def test_a_repair_is_refused_for_another_table_shape_or_buckets():
    meta = SnapshotMeta.from_wire(REPAIR)
    fingerprint = REPAIR["schema_fingerprint"]
    assert repair_refusal(meta, "users", fingerprint, 4, [9]) is None
    assert "is of users, not orders" in repair_refusal(meta, "orders", fingerprint, 4, [9])
    assert "has rows of schema" in repair_refusal(meta, "users", "0" * 16, 4, [9])
    assert "not every one asked for" in repair_refusal(meta, "users", fingerprint, 4, [10])
    full = SnapshotMeta.from_wire(_golden_meta("meta"))
    assert "is not a repair snapshot" in repair_refusal(full, "users", fingerprint, 4, [9])
