"""The digest message on ``cdc.cdc-platform.verify.{table}.{verification_id}`` (stream
``CDC``; docs/verification.md "Digest message"): built in the contract's field order, and
stored with the headers of the platform's other messages of ``CDC`` and ``INIT``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from nats.js import JetStreamContext

from cdc_platform.errors import VerificationError
from cdc_platform.snapshot.chunks import headers_size
from cdc_platform.wire import (
    CONTENT_TYPES,
    HEADER_CONTENT_TYPE,
    HEADER_MSG_ID,
    HEADER_SCHEMA_FINGERPRINT,
    MessageSigner,
    VerificationDigestPayload,
    encoder,
    in_field_order,
    verify_digest_msg_id,
    verify_digest_subject,
    watermark_subject,
)
from cdc_platform.wire.digest import ALGORITHM, pack_totals
from cdc_platform.wire.encoding import Format


def digest_payload(*, verification_id: str, table: str, lsn: str, schema_fingerprint: str,
                   bits: int, totals: Sequence[int], counts: Sequence[int],
                   buckets: Sequence[int] | None, duration: float) -> VerificationDigestPayload:
    """The digest message's payload: ``totals`` and ``counts`` per covered bucket, in the
    order of ``buckets`` (None: every bucket at ``bits``)."""
    fields: dict[str, Any] = {
        "type": "digest", "verification_id": verification_id, "table": table, "lsn": lsn,
        "marker_subject": watermark_subject(verification_id),
        "schema_fingerprint": schema_fingerprint, "algorithm": ALGORITHM, "bits": bits,
        "row_count": sum(counts), "totals": pack_totals(totals), "counts": list(counts),
        "buckets": None if buckets is None else list(buckets),
        "duration_seconds": round(duration, 3),
        "msg_id": verify_digest_msg_id(verification_id),
    }
    return cast(VerificationDigestPayload, in_field_order(VerificationDigestPayload, fields))


def digest_message(payload: VerificationDigestPayload, fmt: Format
                   ) -> tuple[str, dict[str, str], bytes]:
    """``(subject, headers, payload bytes)`` of the digest message, unsigned."""
    subject = verify_digest_subject(payload["table"], payload["verification_id"])
    headers = {HEADER_MSG_ID: payload["msg_id"], HEADER_CONTENT_TYPE: CONTENT_TYPES[fmt],
               HEADER_SCHEMA_FINGERPRINT: payload["schema_fingerprint"]}
    return subject, headers, encoder(fmt)(payload)


async def publish_digest(js: JetStreamContext, payload: VerificationDigestPayload, fmt: Format,
                         stream: str, signer: MessageSigner | None = None, *,
                         max_payload: int) -> int:
    """Store the digest message in ``stream`` (deduplicated by its message id), signed by
    ``signer`` when there is one; its stream sequence. :class:`VerificationError` when it is
    over the server's ``max_payload`` (a digest has no claim check: ~150-270 KB at 14 bits)."""
    subject, headers, data = digest_message(payload, fmt)
    if signer is not None:
        headers = signer.signed_headers(subject, headers, data)
    size = len(data) + headers_size(headers)
    if size > max_payload:
        raise VerificationError(
            f"the digest of {payload['table']} at {payload['bits']} bits is {size:,} bytes, "
            f"over the NATS server's max_payload ({max_payload:,}): verify at fewer bits or "
            "raise max_payload; nothing is published")
    ack = await js.publish(subject, data, headers=headers, stream=stream)
    return ack.seq
