"""What the catalog says about published tables: which they are, and their schemas.

The schema published to KV ``schemas`` and its fingerprint are computed here from the
catalog, and from pgoutput Relation messages by the bridge; both give the same fingerprint
for the same table shape (the columns pgoutput sends: not dropped, not generated, within the
publication's column list; key flags as pgoutput sets them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import psycopg

from cdc_platform.errors import ConversionError, SnapshotRequestRefused
from cdc_platform.lsn import parse_lsn
from cdc_platform.naming import parse_wire_name, qualified_name, wire_name
from cdc_platform.protocol.values import (
    TYPE_CATALOG_QUERY,
    TypeRegistry,
    identity,
    parse_array,
)
from cdc_platform.wire import Column, schema_fingerprint

_PUBLISHED_TABLES = """
SELECT schemaname, tablename FROM pg_publication_tables
WHERE pubname = %s ORDER BY schemaname, tablename
"""

# Columns as pgoutput sends them. attnames (PG15+) is the publication's column list.
_COLUMNS = """
SELECT a.attname, a.attnum, format_type(a.atttypid, a.atttypmod), NOT a.attnotnull,
       pg_get_expr(d.adbin, d.adrelid), a.atttypid::int, a.atttypmod,
       c.relreplident,
       CASE c.relreplident
         WHEN 'f' THEN true
         WHEN 'n' THEN false
         WHEN 'i' THEN a.attnum = ANY(ri.indkey)
         ELSE a.attnum = ANY(pk.indkey)
       END AS is_key,
       COALESCE(a.attnum = ANY(pk.indkey), false) AS is_primary_key,
       c.oid::int, a.attmissingval::text, ty.typdelim, c.relfilenode::bigint,
       c.xmin::text::bigint, pg_current_wal_insert_lsn()::text
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
JOIN pg_type ty ON ty.oid = a.atttypid
LEFT JOIN pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum
LEFT JOIN pg_index pk ON pk.indrelid = c.oid AND pk.indisprimary
LEFT JOIN pg_index ri ON ri.indrelid = c.oid AND ri.indisreplident
JOIN pg_publication_tables pt
  ON pt.pubname = %(publication)s AND pt.schemaname = n.nspname AND pt.tablename = c.relname
WHERE n.nspname = %(schema)s AND c.relname = %(table)s AND a.attgenerated = ''
  AND (pt.attnames IS NULL OR a.attname = ANY(pt.attnames))
ORDER BY a.attnum
"""

REPLICA_IDENTITY_NAMES = {"d": "default", "f": "full", "i": "index", "n": "nothing"}


@dataclass(frozen=True, slots=True)
class CatalogColumn(Column):
    """A column as the catalog (or a Relation message) gives it: its wire fields and the type
    modifier, which the fingerprint covers but the wire does not carry."""

    # pg_attribute.atttypmod (-1: none); keyword-only, after the wire fields' defaults
    type_modifier: int = field(kw_only=True)


@dataclass(frozen=True, slots=True)
class TableSchema:
    schema: str
    table: str
    relation_id: int
    replica_identity: str  # d f i n, as in pg_class.relreplident and pgoutput
    columns: tuple[CatalogColumn, ...]
    captured_at: float = field(default_factory=time.time)
    # pg_class.relfilenode: a new one means the table was rewritten (a volatile default, a
    # column type change, VACUUM FULL) or truncated; decoding emits no rewritten row.
    storage: int = 0
    # The catalog read: xmin of the pg_class row read (the transaction that last changed it)
    # and the WAL insert position when it was read (everything it saw committed before it).
    storage_xmin: int = 0
    read_at_lsn: int = 0

    @property
    def wire_name(self) -> str:
        return wire_name(self.schema, self.table)

    @property
    def primary_key(self) -> list[str]:
        return [c.name for c in self.columns if c.is_primary_key]

    @property
    def fingerprint(self) -> str:
        return schema_fingerprint(
            [(c.name, c.type_oid, c.type_modifier, c.is_key) for c in self.columns],
            self.replica_identity)

    def to_wire(self) -> dict[str, Any]:
        """The KV ``schemas`` value (seed fields first, then ours)."""
        return {
            "table": self.wire_name,
            "schema": qualified_name(self.schema, self.table),
            "timestamp": int(self.captured_at),
            "columns": [c.to_wire() for c in self.columns],
            "namespace": self.schema,
            "name": self.table,
            "relation_id": self.relation_id,
            "primary_key": self.primary_key,
            "replica_identity": REPLICA_IDENTITY_NAMES.get(self.replica_identity,
                                                           self.replica_identity),
            "fingerprint": self.fingerprint,
            "relfilenode": self.storage,
        }


def published_tables(conn: psycopg.Connection, publication: str) -> list[tuple[str, str]]:
    return [tuple(row) for row in conn.execute(_PUBLISHED_TABLES, (publication,)).fetchall()]


async def published_tables_async(conn: psycopg.AsyncConnection,
                                 publication: str) -> list[tuple[str, str]]:
    cursor = await conn.execute(_PUBLISHED_TABLES, (publication,))
    return [tuple(row) for row in await cursor.fetchall()]


# A table's oid tells it from one dropped and created again under its name.
_PUBLISHED_RELATIONS = """
SELECT p.schemaname, p.tablename, c.oid::int8 FROM pg_publication_tables p
JOIN pg_namespace n ON n.nspname = p.schemaname
JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = p.tablename
WHERE p.pubname = %s
"""


def published_relation_ids(conn: psycopg.Connection, publication: str) -> dict[str, int]:
    """The tables of ``publication`` (wire names) -> their oids."""
    return {wire_name(schema, table): oid for schema, table, oid in conn.execute(
        _PUBLISHED_RELATIONS, (publication,))}


async def published_relation_ids_async(conn: psycopg.AsyncConnection,
                                       publication: str) -> dict[str, int]:
    cursor = await conn.execute(_PUBLISHED_RELATIONS, (publication,))
    return {wire_name(schema, table): oid for schema, table, oid in await cursor.fetchall()}


def missing_value(text: str | None, delimiter: str, type_oid: int,
                  types: TypeRegistry) -> Any:
    """``attmissingval::text`` (a one-element array of the column's type, printed with the
    type's delimiter) -> the value, converted as the stream converts that column."""
    if text is None:
        return None
    element = parse_array(text, identity, delimiter)[0]
    if element is None:
        return None
    try:
        return types.converter(type_oid)(element)
    except ConversionError:
        return element  # as a refused row value travels: PostgreSQL's text


def _schema_from_rows(schema: str, table: str, rows: list,
                      types: TypeRegistry) -> TableSchema | None:
    if not rows:
        return None
    columns = tuple(CatalogColumn(name, attnum, data_type, nullable, default, type_oid,
                                  bool(is_key), bool(is_pk),
                                  missing_value(missing, delimiter, type_oid, types), attnum,
                                  types.base_type_oid(type_oid), types.is_array(type_oid),
                                  type_modifier=typmod)
                    for (name, attnum, data_type, nullable, default, type_oid, typmod, _,
                         is_key, is_pk, _, missing, delimiter, _, _, _) in rows)
    first = rows[0]
    return TableSchema(schema, table, first[10], first[7], columns,
                       storage=int(first[13] or 0), storage_xmin=int(first[14] or 0),
                       read_at_lsn=parse_lsn(first[15]))


def _type_oids(rows: list) -> list[int]:
    return [row[5] for row in rows]


def load_types(conn: psycopg.Connection, types: TypeRegistry, oids: list[int]) -> None:
    """Teach ``types`` the non-builtin types among ``oids`` (and the element and base types
    they refer to) from the catalog; a type even the catalog does not know stays unknown."""
    missing = types.missing_oids(oids)
    while missing:
        types.add_catalog_rows(conn.execute(TYPE_CATALOG_QUERY, (list(missing),)).fetchall())
        still = types.missing_oids(oids)
        if still == missing:
            return
        missing = still


async def load_types_async(conn: psycopg.AsyncConnection, types: TypeRegistry,
                           oids: list[int]) -> None:
    missing = types.missing_oids(oids)
    while missing:
        cursor = await conn.execute(TYPE_CATALOG_QUERY, (list(missing),))
        types.add_catalog_rows(await cursor.fetchall())
        still = types.missing_oids(oids)
        if still == missing:
            return
        missing = still


def table_schema(conn: psycopg.Connection, publication: str, schema: str,
                 table: str, types: TypeRegistry | None = None) -> TableSchema | None:
    """The table's published shape, or None if it is not in the publication. ``types``
    (default: a registry of its own) learns the columns' non-builtin types: they resolve
    the columns' base types and convert their missing values."""
    rows = conn.execute(_COLUMNS, {"publication": publication, "schema": schema,
                                   "table": table}).fetchall()
    types = types or TypeRegistry()
    load_types(conn, types, _type_oids(rows))
    return _schema_from_rows(schema, table, rows, types)



def describe_published(conn: psycopg.Connection, publication: str) -> list[TableSchema]:
    """The schema of every table of ``publication`` (one that vanished meanwhile: left out)."""
    described = [table_schema(conn, publication, schema, table)
                 for schema, table in published_tables(conn, publication)]
    return [schema for schema in described if schema is not None]


async def table_schema_async(conn: psycopg.AsyncConnection, publication: str, schema: str,
                             table: str, types: TypeRegistry | None = None
                             ) -> TableSchema | None:
    cursor = await conn.execute(_COLUMNS, {"publication": publication, "schema": schema,
                                           "table": table})
    rows = await cursor.fetchall()
    types = types or TypeRegistry()
    await load_types_async(conn, types, _type_oids(rows))
    return _schema_from_rows(schema, table, rows, types)


def resolve_published_table(conn: psycopg.Connection, publication: str,
                            requested: str) -> TableSchema:
    """A wire table name from a request -> its schema, or a clear refusal."""
    try:
        schema, table = parse_wire_name(requested)
    except ValueError:
        raise SnapshotRequestRefused(
            f"{requested!r} is not a valid table name (public tables: users; others: "
            "schema/table, with =XX escapes)") from None
    found = table_schema(conn, publication, schema, table)
    if found is None:
        exists = conn.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_class c JOIN pg_namespace n "
            "ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relname = %s)",
            (schema, table)).fetchone()
        reason = ("is not in publication" if exists and exists[0]
                  else "does not exist; publication is")
        raise SnapshotRequestRefused(
            f"table {qualified_name(schema, table)} {reason} {publication}: refusing to "
            "snapshot it")
    return found
