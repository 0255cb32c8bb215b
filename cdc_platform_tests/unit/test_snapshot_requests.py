"""Snapshot requests as the sensor reads them: parsing hostile bodies, which runs in flight
answer a request, and a flood of refusals kept to a few log lines."""

from __future__ import annotations

import json

import pytest

from cdc_platform.snapshot.requests import (
    Pacing,
    RunInFlight,
    parse_request,
    repair_request_refusal,
    summarize,
)


@pytest.mark.parametrize(("subject", "data", "reason"), [
    ("snapshot.request.a.b.c", b"", "not a wire table name"),
    ("snapshot.request.", b"", "not a wire table name"),
    ("snapshot.request.users", b"\xff\xfe garbage", "not JSON"),
    ("snapshot.request.users", b"[1, 2]", "not a JSON object"),
    ("snapshot.request.users", b"{" + b" " * 5000 + b"}", "over the 4,096-byte limit"),
    ("snapshot.request.users", b'{"reply_to": "_INBOX.*"}', "reply_to must be an inbox"),
    # the platform's own subjects: replying there made it overwrite a schema, plant a meta,
    # write into CDC
    ("snapshot.request.users", b'{"reply_to": "$KV.schemas.users"}', "reply_to must be an"),
    ("snapshot.request.users", b'{"reply_to": "init.meta.users"}', "reply_to must be an"),
    ("snapshot.request.users", b'{"reply_to": "cdc.users.insert"}', "reply_to must be an"),
    ("snapshot.request.users", b'{"reply_to": "_INBOX"}', "reply_to must be an"),
    ("snapshot.request.users", b'{"request_id": "' + b"x" * 200 + b'"}', "request_id must"),
    ("snapshot.request.users", b'{"max_age_seconds": true}', "max_age_seconds must"),
    ("snapshot.request.users", b'{"min_lsn": "yesterday"}', "min_lsn must"),
])
def test_hostile_requests_are_refused_with_the_reason(subject, data, reason):
    request = parse_request(subject, data, 7)
    assert request.refused is not None and reason in request.refused


def test_a_refused_request_keeps_what_its_refusal_can_be_sent_with():
    request = parse_request("snapshot.request.users",
                            b'{"reply_to": "_INBOX.1", "request_id": "r1", "min_lsn": 5}', 3)
    assert request.refused and (request.reply_to, request.request_id) == ("_INBOX.1", "r1")


@pytest.mark.parametrize(("reply_to", "kept"), [
    ("_INBOX.x1", True), ("_INBOX.a.b", True), ("_INBOX_team-a.x1", True),
    ("_INBOX_team_a.x1", True),
    ("_INBOXcdc.users", False), ("_INBOX_.x", False), ("x._INBOX.y", False),
    ("_INBOX.>", False), ("_INBOX. x", False)])
def test_replies_go_to_inbox_subjects_only(reply_to, kept):
    from cdc_platform.snapshot.requests import is_reply_subject

    assert is_reply_subject(reply_to) is kept
    request = parse_request("snapshot.request.users", f'{{"reply_to": "{reply_to}"}}'.encode(), 1)
    assert (request.reply_to == reply_to) is kept and (request.refused is None) is kept


def test_only_a_waiting_run_takes_more_requests():
    # a running one may have taken its snapshot before the request came: a joined requester
    # would wait for a later meta that never comes
    assert RunInFlight("users", "k", started=False).joinable
    assert not RunInFlight("users", "k", started=True).joinable


def test_a_flood_of_notes_is_summarized():
    notes = [f"refused {n}" for n in range(1000)]
    assert summarize(notes) == [*notes[:5], "... and 995 more like these"]
    assert summarize(notes[:5]) == notes[:5]


@pytest.mark.parametrize(("body", "reason"), [
    (b'{"purpose": "destroy"}', "purpose must be one of"),
    (b'{"bits": 4}', "bits and buckets are for purpose verify or repair"),
    (b'{"purpose": "repair"}', "needs bits"),
    (b'{"purpose": "repair", "bits": 4}', "needs buckets"),
    (b'{"purpose": "verify", "buckets": [1]}', "needs bits"),
    (b'{"purpose": "verify", "bits": 21}', "bits must be an integer 0..20"),
    (b'{"purpose": "verify", "bits": true}', "bits must be an integer"),
    (b'{"purpose": "repair", "bits": 4, "buckets": [16]}', "below 2^4"),
    (b'{"purpose": "repair", "bits": 4, "buckets": []}', "non-empty list"),
    (b'{"purpose": "repair", "bits": 4, "buckets": [false]}', "list of integers"),
    # a bitmap (wire.bucket_sets) instead of the list: exactly one of the two, of its length
    (b'{"purpose": "repair", "bits": 4, "buckets": [3], "bucket_bitmap": "EAA="}',
     "buckets or bucket_bitmap, not both"),
    (b'{"purpose": "repair", "bits": 4}', "needs buckets or bucket_bitmap"),
    (b'{"purpose": "repair", "bits": 4, "bucket_bitmap": "EAAA"}',
     "bucket_bitmap holds 3 bytes, 2 at 4 bits"),
    (b'{"purpose": "repair", "bits": 4, "bucket_bitmap": "AAA="}', "sets no bucket"),
    (b'{"purpose": "repair", "bits": 4, "bucket_bitmap": "EA!="}', "is not base64"),
    (b'{"purpose": "repair", "bits": 4, "bucket_bitmap": "EAB="}', "not canonical"),
    (b'{"purpose": "repair", "bits": 4, "bucket_bitmap": 16}', "must be a base64 string"),
    (b'{"purpose": "repair", "bits": 2, "bucket_bitmap": "gQ=="}', "past the 2^2 buckets"),
    (b'{"purpose": "verify", "bits": 4, "bucket_bitmap": "EAA="}', "is for purpose repair"),
    (b'{"bucket_bitmap": "EAA="}', "are for purpose verify or repair"),
])
def test_a_verify_or_repair_request_names_its_buckets_or_is_refused(body, reason):
    request = parse_request("snapshot.request.users", body, 1)
    assert request.refused is not None and reason in request.refused


def test_a_repair_request_keeps_its_buckets_sorted_once():
    request = parse_request("snapshot.request.users",
                            b'{"purpose": "repair", "bits": 10, "buckets": [900, 3, 900]}', 1)
    assert request.refused is None
    assert (request.purpose, request.bits, request.buckets) == ("repair", 10, (3, 900))
    bitmap = parse_request("snapshot.request.users",
                           b'{"purpose": "repair", "bits": 4, "bucket_bitmap": "EEA="}', 3)
    assert (bitmap.refused, bitmap.bits, bitmap.buckets) == (None, 4, (3, 9))
    verify = parse_request("snapshot.request.users", b'{"purpose": "verify"}', 2)
    assert (verify.refused, verify.purpose, verify.bits, verify.buckets) == (
        None, "verify", None, None)


@pytest.mark.parametrize(("bits", "buckets", "refused"), [
    (4, [0, 1, 2, 3], False),  # a quarter: served
    (4, [0, 1, 2, 3, 4], True),
    (2, [3], False),
    (1, [0], True),  # half the table
    (0, [0], True),  # all of it
    (10, list(range(256)), False),  # (a 4 KB body lists ~620 buckets of 14 bits)
    (10, list(range(257)), True),
])
def test_a_repair_of_more_than_a_quarter_of_the_buckets_is_refused(bits, buckets, refused):
    request = parse_request("snapshot.request.users", json.dumps(
        {"purpose": "repair", "bits": bits, "buckets": buckets}).encode(), 1)
    assert request.refused is None
    reason = repair_request_refusal(request)
    assert (reason is not None) is refused
    if refused:
        assert reason.endswith("more than a quarter of the table: request a full snapshot")


def test_a_tables_repairs_start_the_minimum_interval_apart():
    pacing = Pacing(60.0, repairs_started={"users": 1000.0})
    assert pacing.repair_retry_after("users", 1010.0) == 50.0
    assert pacing.repair_retry_after("users", 1060.0) is None
    assert pacing.repair_retry_after("orders", 1010.0) is None
    assert Pacing(0.0, repairs_started={"users": 1000.0}).repair_retry_after(
        "users", 1000.0) is None
