"""Claim checks, the consumer's side (docs/wire-contract.md "Large values (claim check)"): a message
whose ``Cdc-Claim-Check`` header names an object of the Object Store carries its payload there;
:func:`resolve_payload` gives the bytes a consumer decodes, checked against the reference's size and
sha256. The producer's side is ``cdc_platform.publishing.claim_check``."""

from __future__ import annotations

import base64
import hashlib

from nats.js import JetStreamContext
from nats.js.errors import (
    BadObjectMetaError,
    DigestMismatchError,
    InvalidBucketNameError,
    LinkIsABucketError,
    NotFoundError,
)

from cdc_platform.errors import CdcError, PublishError
from cdc_platform.wire import HEADER_CLAIM_CHECK, decode_any

_CHUNK_TIMEOUT_SECONDS = 30.0  # (a TimeoutError past it: NATS away, not a missing object)


class UnresolvableClaimCheck(CdcError):
    """A claim check names an object that is not there, or not whole (or no valid bucket):
    nothing to wait for, since an object is stored before its reference is published."""


async def read_object(js: JetStreamContext, bucket: str, name: str) -> bytes:
    """The bytes of object ``name`` of ``bucket``, its digest checked. Not nats-py's
    ``ObjectStore.get``: that finds the bucket's stream by the chunks' subject, which a
    mirror (the READERS account's ``OBJ_{bucket}``, docs/operations.md "NATS setup") does not
    list."""
    info = await (await js.object_store(bucket)).get_info(name)
    if not info.nuid:
        raise BadObjectMetaError
    if info.is_link():  # the bridge stores none
        raise LinkIsABucketError
    if not info.size:
        return b""
    subscription = await js.subscribe(f"$O.{bucket}.C.{info.nuid}", stream=f"OBJ_{bucket}",
                                      ordered_consumer=True)
    data = bytearray()
    try:
        while True:
            message = await subscription.next_msg(timeout=_CHUNK_TIMEOUT_SECONDS)
            data += message.data
            if message.metadata.num_pending == 0:
                break
    finally:
        await subscription.unsubscribe()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode()
    if digest.rstrip("=") != (info.digest or "").partition("=")[2].rstrip("="):
        raise DigestMismatchError
    return bytes(data)


async def resolve_payload(js: JetStreamContext, data: bytes,
                          headers: dict[str, str] | None) -> bytes:
    """The payload a consumer decodes: ``data`` itself, or the object a claim check names
    (checked against its size and sha256)."""
    reference = (headers or {}).get(HEADER_CLAIM_CHECK)
    if reference is None:
        return data
    bucket, _, name = reference.partition("/")  # (an object name holds "/": an LSN)
    expected = decode_any(data)
    claim = expected.get("claim_check", {}) if isinstance(expected, dict) else {}
    try:
        payload = await read_object(js, bucket, name)
    except (NotFoundError, InvalidBucketNameError, BadObjectMetaError, LinkIsABucketError,
            DigestMismatchError) as exc:  # (none of them NATS being away)
        raise UnresolvableClaimCheck(f"claim check {reference!r} names no stored object "
                                     f"({type(exc).__name__})") from None
    if claim and (len(payload) != claim.get("size")
                  or hashlib.sha256(payload).hexdigest() != claim.get("sha256")):
        raise PublishError(f"object {reference} does not match its claim check "
                           f"({len(payload)} bytes)")
    return payload
