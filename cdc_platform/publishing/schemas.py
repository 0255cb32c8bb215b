"""Table schemas into the KV bucket ``schemas`` (README "Schemas"): one key per published
table, the wire table name, holding the schema in the payload format. The bridge puts a
table's schema when it sees a new shape; :func:`publish_schemas` puts them all at once (the
Dagster ``schemas`` asset)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
from nats.js import JetStreamContext

from cdc_platform.postgres.catalog import TableSchema, published_tables, table_schema


def schema_entry(schema: TableSchema, encode: Callable[[Any], bytes]) -> tuple[str, bytes]:
    """(key, value) of ``schema`` in the bucket."""
    return schema.wire_name, encode(schema.to_wire())


def describe_published(conn: psycopg.Connection, publication: str) -> list[TableSchema]:
    """The schema of every table of ``publication`` (one that vanished meanwhile: left out)."""
    described = [table_schema(conn, publication, schema, table)
                 for schema, table in published_tables(conn, publication)]
    return [schema for schema in described if schema is not None]


async def publish_schemas(js: JetStreamContext, bucket: str, schemas: list[TableSchema],
                          encode: Callable[[Any], bytes]) -> None:
    kv = await js.key_value(bucket)
    for schema in schemas:
        await kv.put(*schema_entry(schema, encode))
