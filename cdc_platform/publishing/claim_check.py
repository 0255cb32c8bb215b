"""Large values: a message over the NATS server's ``max_payload`` travels as a claim check.

The full payload (exactly the bytes that would have been published) is stored in the
JetStream Object Store bucket ``cdc_large`` (``CDC_LARGE_BUCKET``) under the message's id, and
the message published in its place carries the header ``Cdc-Claim-Check: {bucket}/{object}``
and a small payload: the envelope fields of the event (everything but ``data`` and ``old``;
for a batch, those of its first event) plus ``claim_check`` = ``{bucket, object, size,
sha256}``. The object is stored before the reference is published, so stream order and
"acknowledge PostgreSQL only what is stored" hold; a replay stores the same bytes under the
same name again. README "Large values (claim check)" is the contract; :func:`resolve_payload`
is its consumer side.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from collections.abc import Sequence
from operator import itemgetter
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import ObjectMeta, ObjectMetaOptions, ObjectStoreConfig, StorageType
from nats.js.errors import (
    BadObjectMetaError,
    BucketNotFoundError,
    DigestMismatchError,
    InvalidBucketNameError,
    LinkIsABucketError,
    NotFoundError,
)

from cdc_platform.errors import CdcError, PublishError
from cdc_platform.publishing.messages import OutgoingMessage
from cdc_platform.wire import (
    HEADER_CLAIM_CHECK,
    Format,
    decode_any,
    decode_payload,
    encoder,
)

log = logging.getLogger(__name__)

# Room left under max_payload for the headers of a message (Nats-Msg-Id, fingerprint, ...).
HEADER_ALLOWANCE = 1024
_ENVELOPE_DROPPED = ("data", "old")
_PAYLOAD = itemgetter(2)  # OutgoingMessage.payload
_DEFAULT_CHUNK = 128 * 1024  # nats-py's own object chunk size
_CHUNK_TIMEOUT_SECONDS = 30.0  # (a TimeoutError past it: NATS away, not a missing object)


def object_store_config(bucket: str, max_age_seconds: float, replicas: int = 1
                        ) -> ObjectStoreConfig:
    """The bucket lives as long as the CDC events that reference its objects."""
    return ObjectStoreConfig(
        bucket=bucket, storage=StorageType.FILE, replicas=replicas, ttl=max_age_seconds,
        description="cdc_platform: payloads over max_payload (claim checks of CDC events "
                    "and snapshot chunks; object = message id)")


class ClaimChecks:
    """Replaces the messages of a publish call that exceed ``max_payload`` (bridge side)."""

    def __init__(self, js: JetStreamContext, bucket: str, fmt: Format) -> None:
        self._js = js
        self.bucket = bucket
        self._format: Format = fmt
        self._encode = encoder(fmt)
        self._store: Any = None

    @staticmethod
    def oversized(messages: Sequence[OutgoingMessage], max_payload: int) -> bool:
        """Whether any message needs a claim check (a C loop: called per read batch)."""
        return bool(messages) and max(map(len, map(_PAYLOAD, messages))) > (
            max_payload - HEADER_ALLOWANCE)

    async def replace_oversized(self, messages: Sequence[OutgoingMessage],
                                max_payload: int) -> list[OutgoingMessage]:
        limit = max_payload - HEADER_ALLOWANCE
        out: list[OutgoingMessage] = []
        for message in messages:
            out.append(message if len(message.payload) <= limit
                       else await self.check_in(message, max_payload))
        return out

    async def check_in(self, message: OutgoingMessage, max_payload: int,
                       envelope: dict[str, Any] | None = None) -> OutgoingMessage:
        """Store ``message``'s payload; the small message that references it. ``envelope``:
        the reference's fields when the payload cannot be decoded (a compressed chunk)."""
        store = await self._object_store()
        name = message.msg_id
        digest = hashlib.sha256(message.payload).hexdigest()
        # the object's chunks are messages too: each must fit the server's max_payload
        chunk_size = min(_DEFAULT_CHUNK, max_payload - HEADER_ALLOWANCE)
        try:
            await store.put(name, message.payload, meta=ObjectMeta(
                name=name, options=ObjectMetaOptions(max_chunk_size=chunk_size)))
        except Exception as exc:
            raise PublishError(f"could not store the {len(message.payload)}-byte payload of "
                               f"{name} ({message.subject}) in object store {self.bucket}: "
                               f"{exc}") from exc
        if envelope is None:
            envelope = _envelope(decode_payload(message.payload, self._format))
        reference = {**envelope,
                     "claim_check": {"bucket": self.bucket, "object": name,
                                     "size": len(message.payload), "sha256": digest}}
        log.info("%s on %s is %d bytes, over max_payload: stored in object store %s",
                 name, message.subject, len(message.payload), self.bucket)
        return OutgoingMessage(message.subject, message.msg_id, self._encode(reference),
                               (*message.headers, (HEADER_CLAIM_CHECK, f"{self.bucket}/{name}")))

    async def _object_store(self) -> Any:
        if self._store is None:
            try:
                self._store = await self._js.object_store(self.bucket)
            except (BucketNotFoundError, NotFoundError):
                raise PublishError(f"object store bucket {self.bucket} is missing: run "
                                   "`cdc-platform provision`") from None
        return self._store


class UnresolvableClaimCheck(CdcError):
    """A claim check names an object that is not there, or not whole (or no valid bucket):
    nothing to wait for, since an object is stored before its reference is published."""


def _envelope(value: Any) -> dict[str, Any]:
    """An event's fields but its row values (a batch: its first event's)."""
    event = value[0] if isinstance(value, list) and value else value
    if not isinstance(event, dict):
        return {}
    return {key: field for key, field in event.items() if key not in _ENVELOPE_DROPPED}


async def read_object(js: JetStreamContext, bucket: str, name: str) -> bytes:
    """The bytes of object ``name`` of ``bucket``, its digest checked. Not nats-py's
    ``ObjectStore.get``: that finds the bucket's stream by the chunks' subject, which a
    mirror (the READERS account's ``OBJ_{bucket}``, README "NATS setup") does not list."""
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
