"""Table schemas, the consumer's side (docs/wire-contract.md "Schemas"): the KV bucket ``schemas``
holds each published table's schema under its wire name."""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from cdc_platform.jetstream.kv import kv_value
from cdc_platform.wire import SignatureVerifier, decode_any


async def schema_value(js: JetStreamContext, bucket: str, table: str,
                       verifier: SignatureVerifier | None = None) -> bytes | None:
    """The schema of ``table`` as stored (None: none, or none ``verifier`` accepts)."""
    try:
        return await kv_value(js, bucket, table, verifier)
    except NotFoundError:  # (no such bucket)
        return None


async def schema_relation_id(js: JetStreamContext, bucket: str, table: str,
                             verifier: SignatureVerifier | None = None) -> int | None:
    """The oid of the table ``table`` names in ``bucket`` (None: no readable schema): which
    table the stream follows under that name (one dropped and created again is another)."""
    try:
        relation_id = decode_any(await schema_value(js, bucket, table, verifier) or b"").get(
            "relation_id")
    except (ValueError, TypeError, AttributeError):
        return None
    return relation_id if type(relation_id) is int else None
