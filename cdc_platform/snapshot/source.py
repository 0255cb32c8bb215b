"""The table a snapshot reads, as PostgreSQL describes it: its published columns, their types,
its size; the ``COPY`` its tasks run; the layout of its chunks; a sample of its rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from cdc_platform.errors import SnapshotError
from cdc_platform.postgres.catalog import TableSchema, resolve_published_table
from cdc_platform.protocol.values import TYPE_CATALOG_QUERY, TypeRegistry
from cdc_platform.settings import EncodingSettings
from cdc_platform.snapshot.chunks import Chunker, ChunkLayout
from cdc_platform.snapshot.dictionary import TrainedDictionary
from cdc_platform.wire.signing import SIGNATURE_HEADERS_BYTES


@dataclass(frozen=True)
class SourceTable:
    """A published table, described: what the snapshot needs of the catalog."""

    schema: TableSchema
    type_rows: tuple[tuple[Any, ...], ...]
    blocks: int
    block_size: int
    estimated_rows: float


_SIZE_QUERY = """
SELECT current_setting('block_size')::int, c.relkind::text, c.reltuples::float8,
       CASE WHEN c.relkind = 'p' THEN
           (SELECT coalesce(max(pg_relation_size(t.relid)), 0) FROM pg_partition_tree(c.oid) t
            WHERE t.isleaf)
       ELSE pg_relation_size(c.oid) END
FROM pg_class c WHERE c.oid = %s
"""


def describe_table(conn: psycopg.Connection, publication: str, table: str) -> SourceTable:
    """The published table ``table`` (wire name), with the catalog rows of its column types
    (for the tasks' converters) and its size; SnapshotRequestRefused when it is not
    published."""
    schema = resolve_published_table(conn, publication, table)
    registry = TypeRegistry()
    type_rows: list[tuple[Any, ...]] = []
    missing = registry.missing_oids(c.type_oid for c in schema.columns)
    while missing:  # arrays of domains of ...: resolve until nothing more is learned
        rows = [tuple(r) for r in conn.execute(TYPE_CATALOG_QUERY, (list(missing),)).fetchall()]
        registry.add_catalog_rows(rows)
        type_rows += rows
        still = registry.missing_oids(c.type_oid for c in schema.columns)
        if not rows or still == missing:
            break
        missing = still
    sized = conn.execute(_SIZE_QUERY, (schema.relation_id,)).fetchone()
    if sized is None:
        raise SnapshotError(f"{schema.wire_name}: the table went away while it was described")
    block_size, _kind, reltuples, size = sized
    return SourceTable(schema, tuple(type_rows), size // block_size, block_size, reltuples)


def copy_select(schema: TableSchema, *, sample: sql.Composable | None = None,
                where: sql.Composable | None = None) -> str:
    """``COPY (SELECT <published columns>[, ctid] FROM t ...) TO STDOUT``. Tasks fill in
    ``{range}``, and-ed with ``where`` when given (a repair snapshot's buckets); a sample gets
    its own clause instead."""
    fields: list[sql.Composable] = [sql.Identifier(c.name) for c in schema.columns]
    if not schema.primary_key:
        fields.append(sql.SQL("ctid"))
    target = sql.Identifier(schema.schema, schema.table)
    if sample is None:
        condition = sql.SQL("{range}") if where is None else sql.SQL(
            "{{range}} AND ({})").format(where)
        query = sql.SQL("COPY (SELECT {} FROM {} WHERE {}) TO STDOUT").format(
            sql.SQL(", ").join(fields), target, condition)
    else:
        query = sql.SQL("COPY (SELECT {} FROM {} {}) TO STDOUT").format(
            sql.SQL(", ").join(fields), target, sample)
    return query.as_string(None)


def chunk_layout(table: SourceTable, encoding: EncodingSettings, snapshot_id: str, lsn: str,
                 max_payload: int, dictionary: TrainedDictionary | None, *,
                 signed: bool) -> ChunkLayout:
    """How ``table``'s chunks are cut and encoded; ``signed`` chunks carry two more headers,
    for which their cut leaves room under ``max_payload``."""
    schema = table.schema
    names = [c.name for c in schema.columns]
    return ChunkLayout(
        table=schema.wire_name, snapshot_id=snapshot_id, lsn=lsn,
        schema_fingerprint=schema.fingerprint, columns=tuple(names),
        key_columns=tuple(names.index(n) for n in schema.primary_key),
        format=encoding.format, chunk_rows=encoding.chunk_rows,
        max_payload=max_payload - (SIGNATURE_HEADERS_BYTES if signed else 0),
        zstd_level=encoding.zstd_level if encoding.zstd else None,
        dictionary=dictionary.data if dictionary else None,
        dictionary_id=dictionary.dictionary_id if dictionary else None)


def sample_rows(conn: psycopg.Connection, table: SourceTable, layout: ChunkLayout,
                converters: Sequence, wanted: int) -> list[dict[str, Any]]:
    """Up to ``wanted`` typed rows spread over the table (TABLESAMPLE SYSTEM), else its first
    rows."""
    percent = 100.0
    if table.estimated_rows > 0:
        percent = min(100.0, max(0.001, 100.0 * 2 * wanted / table.estimated_rows))
    clause = sql.SQL("TABLESAMPLE SYSTEM ({}) REPEATABLE (0) LIMIT {}").format(
        sql.Literal(percent), sql.Literal(wanted))
    sampler = Chunker(layout, converters, partition=0)
    rows = sampler.rows(_copy_all(conn, copy_select(table.schema, sample=clause)))
    if len(rows) < wanted // 4:  # small or never analyzed: its first rows
        rows = sampler.rows(_copy_all(conn, copy_select(table.schema, sample=sql.SQL(
            "LIMIT {}").format(sql.Literal(wanted)))))
    return rows


def _copy_all(conn: psycopg.Connection, command: str) -> bytes:
    with conn.cursor().copy(command) as copy:
        return b"".join(bytes(block) for block in copy)


def table_converters(described: SourceTable) -> list:
    """One ``text -> value`` converter per published column."""
    registry = TypeRegistry()
    registry.add_catalog_rows(described.type_rows)
    return registry.for_columns(described.schema.columns)
