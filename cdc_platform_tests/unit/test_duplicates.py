"""What counts as "the same change" when JetStream answers a publish with ``duplicate``
(publishing/duplicates.py; docs/wire-contract.md "Message ids taken by other content")."""

import json
import math

import msgpack
from nats.js.api import RawStreamMsg

from cdc_platform.publishing.duplicates import replacement_id, same_change

HEADER = b"NATS/1.0\r\nNats-Msg-Id: 0/16B3A10:0\r\nCdc-Schema-Fingerprint: 5b98e4b1596518b4\r\n\r\n"
EVENT = {"table": "users", "operation": "UPDATE", "commit_lsn": "0/16B3A10", "ordinal": 0,
         "data": {"id": 1, "score": math.nan, "blob": b"\x00\x01"}}


def stored(payload: bytes, subject: str = "cdc.users.update", **headers: str) -> RawStreamMsg:
    return RawStreamMsg(subject=subject, seq=7, data=payload,
                        headers={"Nats-Msg-Id": "0/16B3A10:0", **headers})


def test_a_resend_is_the_same_change_whatever_its_other_headers():
    payload = msgpack.packb(EVENT)
    assert same_change(b"cdc.users.update", HEADER, payload, stored(payload))
    assert same_change(b"cdc.users.update", HEADER, payload,
                       stored(payload, **{"Cdc-Signature": "another one"}))


def test_an_encoding_difference_alone_is_the_same_change():
    event = {"table": "users", "ordinal": 0, "data": {"id": 1, "score": "NaN"}}
    reordered = json.dumps(dict(reversed(list(event.items())))).encode()
    assert same_change(b"cdc.users.update", HEADER, json.dumps(event).encode(),
                       stored(reordered))
    # another key order, and NaN (never equal to itself) in a value
    nan_elsewhere = msgpack.packb(dict(reversed(list(EVENT.items()))))
    assert nan_elsewhere != msgpack.packb(EVENT)
    assert same_change(b"cdc.users.update", HEADER, msgpack.packb(EVENT), stored(nan_elsewhere))


def test_other_content_subject_or_claim_check_is_a_conflict():
    payload = msgpack.packb(EVENT)
    forged = msgpack.packb({**EVENT, "data": {**EVENT["data"], "id": 2}})
    assert not same_change(b"cdc.users.update", HEADER, payload, stored(forged))
    assert not same_change(b"cdc.users.update", HEADER, payload, stored(b"forged"))
    assert not same_change(b"cdc.users.update", HEADER, payload,
                           stored(payload, subject="cdc.users.delete"))
    assert not same_change(b"cdc.users.update", HEADER, payload,
                           stored(payload, **{"Cdc-Claim-Check": "cdc_large/0/16B3A10:0"}))


def test_a_replacement_id_is_the_id_and_random_hex():
    first, second = replacement_id("0/16B3A10:0"), replacement_id("0/16B3A10:0")
    assert first != second
    assert first.startswith("0/16B3A10:0:conflict:") and len(first.rsplit(":", 1)[1]) == 16
