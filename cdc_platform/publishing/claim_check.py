"""Large values: a message over the NATS server's ``max_payload`` travels as a claim check.

The full payload (exactly the bytes that would have been published) is stored in the
JetStream Object Store bucket ``cdc_large`` (``CDC_LARGE_BUCKET``) under the message's id, and
the message published in its place carries the header ``Cdc-Claim-Check: {bucket}/{object}``
and a small payload: the envelope fields of the event (everything but ``data`` and ``old``;
for a batch, those of its first event) plus ``claim_check`` = ``{bucket, object, size,
sha256}``. The object is stored before the reference is published, so stream order and
"acknowledge PostgreSQL only what is stored" hold; a replay stores the same bytes under the
same name again. docs/wire-contract.md "Large values (claim check)" is the contract;
``cdc_platform.consumer.claim_checks`` is its consumer side.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from operator import itemgetter
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import ObjectMeta, ObjectMetaOptions
from nats.js.errors import (
    BucketNotFoundError,
    NotFoundError,
)

from cdc_platform.errors import PublishError
from cdc_platform.publishing.messages import OutgoingMessage
from cdc_platform.wire import (
    HEADER_CLAIM_CHECK,
    Format,
    decode_payload,
    encoder,
)

log = logging.getLogger(__name__)

# Room left under max_payload for the headers of a message (Nats-Msg-Id, fingerprint, ...).
HEADER_ALLOWANCE = 1024
_ENVELOPE_DROPPED = ("data", "old")
_PAYLOAD = itemgetter(2)  # OutgoingMessage.payload
_DEFAULT_CHUNK = 128 * 1024  # nats-py's own object chunk size


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


def _envelope(value: Any) -> dict[str, Any]:
    """An event's fields but its row values (a batch: its first event's)."""
    event = value[0] if isinstance(value, list) and value else value
    if not isinstance(event, dict):
        return {}
    return {key: field for key, field in event.items() if key not in _ENVELOPE_DROPPED}
