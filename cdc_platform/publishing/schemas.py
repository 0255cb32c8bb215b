"""Table schemas into the KV bucket ``schemas`` (docs/wire-contract.md "Schemas"): one key per
published table, the wire table name, holding the schema in the payload format. The bridge puts a
table's schema when it sees a new shape; :func:`publish_schemas` puts them all at once (the Dagster
``schemas`` asset, with what ``postgres.catalog.describe_published`` read)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from cdc_platform.jetstream.kv import kv_value, put_value
from cdc_platform.postgres.catalog import TableSchema
from cdc_platform.wire import MessageSigner, SignatureVerifier, decode_any


def schema_entry(schema: TableSchema, encode: Callable[[Any], bytes]) -> tuple[str, bytes]:
    """(key, value) of ``schema`` in the bucket."""
    return schema.wire_name, encode(schema.to_wire())


async def stored_schema(js: JetStreamContext, kv: KeyValue, bucket: str, schema: TableSchema,
                        signer: MessageSigner | None = None) -> dict[str, Any] | None:
    """The KV value stored for ``schema``'s table, when it is of this table (the same
    relation id) and readable, and signed by ``signer``'s key when the platform signs (its
    ``relfilenode`` decides whether the bridge asks for snapshots); None otherwise."""
    verifier = SignatureVerifier([signer.public_key]) if signer is not None else None
    data = await kv_value(js, bucket, schema.wire_name, verifier, kv)
    if data is None:
        return None
    try:
        value = decode_any(data)
    except Exception:  # noqa: BLE001 - not a value of ours: as if there were none
        return None
    if not isinstance(value, dict) or value.get("relation_id") != schema.relation_id:
        return None
    return value


def keeping_storage(schema: TableSchema, stored: dict[str, Any] | None) -> TableSchema:
    """``schema`` with the storage the stored value says consumers hold (docs/wire-contract.md
    "Schemas": ``relfilenode`` moves with schema events, not with the catalog)."""
    storage = stored.get("relfilenode") if stored is not None else None
    if not isinstance(storage, int) or isinstance(storage, bool) or storage <= 0:
        return schema
    return dataclasses.replace(schema, storage=storage)


async def publish_schemas(js: JetStreamContext, bucket: str, schemas: list[TableSchema],
                          encode: Callable[[Any], bytes],
                          signer: MessageSigner | None = None) -> None:
    kv = await js.key_value(bucket)
    for schema in schemas:
        stored = await stored_schema(js, kv, bucket, schema, signer)
        key, value = schema_entry(keeping_storage(schema, stored), encode)
        await put_value(js, kv, bucket, key, value, signer)
