"""The table digest on the source side, against a real PostgreSQL (docs/verification.md):
the edge rows of the golden vectors, written in PostgreSQL and read through the snapshot
reader's COPY and converters, hash exactly as the vectors say; and a key hash computed by SQL
alone equals the digest's, so a source query can select one bucket's rows."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from psycopg import sql

from cdc_platform.postgres.key_hash import bucket_predicate, key_hash_sql, sql_key_kinds
from cdc_platform.replication.connection import SESSION_OPTIONS
from cdc_platform.snapshot.chunks import Chunker, ChunkLayout
from cdc_platform.snapshot.source import copy_select, describe_table, table_converters
from cdc_platform.wire.digest import (
    RowDigester,
    TableDigest,
    bucket_of,
    digest_columns,
    digest_rows,
)
from cdc_platform_tests.digest_vectors import PATH
from cdc_platform_tests.fixtures.services import random_name

# also on the newest PostgreSQL (docs/development.md "Tests": make test's second pass)
pytestmark = pytest.mark.every_major

EDGES = json.loads(PATH.read_text())["tables"]["edges"]


@pytest.fixture
def session(postgres_server):
    """A connection with the session settings the snapshot reader sets (the converters expect
    PostgreSQL's output under them)."""
    with psycopg.connect(postgres_server.superuser_conninfo(), autocommit=True,
                         options=SESSION_OPTIONS) as connection:
        yield connection


def _read(session: psycopg.Connection, publication: str, table: str) -> tuple[Chunker, bytes]:
    """A Chunker as the snapshot reader's tasks make one, and the table's COPY text."""
    described = describe_table(session, publication, table)
    names = tuple(column.name for column in described.schema.columns)
    layout = ChunkLayout(table=described.schema.wire_name, snapshot_id="digest", lsn="0/0",
                         schema_fingerprint=described.schema.fingerprint, columns=names,
                         key_columns=tuple(names.index(n) for n in described.schema.primary_key))
    command = copy_select(described.schema, sample=sql.SQL("ORDER BY 1"))
    with session.cursor().copy(command) as copy:
        text = b"".join(bytes(block) for block in copy)
    return Chunker(layout, table_converters(described), partition=0), text


def _typed_rows(session: psycopg.Connection, publication: str, table: str
                ) -> list[dict[str, Any]]:
    """The table's rows as the snapshot reader's tasks make them (COPY text -> converters)."""
    chunker, text = _read(session, publication, table)
    return chunker.rows(text)


def test_the_snapshot_readers_values_of_the_edge_rows_hash_as_the_vectors_say(
        session, pg_admin, cdc_database):
    table, mood = random_name("digest_edges"), random_name("digest_mood")
    pg_admin.execute(f"CREATE TYPE {mood} AS ENUM ('sad', 'ok', 'happy')")
    types = {column["name"]: (mood if column["data_type"] == "mood" else column["data_type"])
             for column in EDGES["columns"]}
    pg_admin.execute(f"CREATE TABLE {table} ("
                     + ", ".join(f"{name} {kind}" for name, kind in types.items())
                     + ", PRIMARY KEY (id))")
    for row in EDGES["rows"]:
        pg_admin.execute(f"INSERT INTO {table} VALUES ("
                         + ", ".join(f"{row['sql'][name]}::{kind}" for name, kind in types.items())
                         + ")")
    cdc_database.add_tables(pg_admin, table)

    rows = _typed_rows(session, cdc_database.publication, table)

    digester = RowDigester(types, EDGES["primary_key"])
    assert [digester.row_bytes(row).hex() for row in rows] == [
        row["row_bytes"] for row in EDGES["rows"]]
    assert [f"{digester.row_hash(row):016x}" for row in rows] == [
        row["row_hash"] for row in EDGES["rows"]]
    # the same digest without row maps (the source's bulk paths): from the converted
    # columns, from the COPY fields and from the COPY block (hashed straight from the text
    # by the compiled twin)
    chunker, text = _read(session, cdc_database.publication, table)
    lines, fields, escapes = chunker.parse(text)
    by_columns, by_fields, by_block, by_rows = (TableDigest(2) for _ in range(4))
    assert digest_columns(by_columns, digester, chunker.columns_of(fields, escapes),
                          len(lines)) == len(EDGES["rows"])
    assert chunker.digest(by_fields, digester, fields, len(lines), escapes) == len(lines)
    assert chunker.digest_block(by_block, digester, text) == len(lines)
    digest_rows(by_rows, digester, rows)
    assert by_columns == by_rows == by_fields == by_block


def test_a_key_hashed_in_sql_equals_the_digests_key_hash_and_selects_its_bucket(
        session, pg_admin, cdc_database):
    table = random_name("digest_keys")
    pg_admin.execute(f"CREATE TABLE {table} (k_int int8, k_text text, k_uuid uuid, "
                     "k_num numeric, k_bytea bytea, k_bool bool, note text, "
                     "PRIMARY KEY (k_int, k_text, k_uuid, k_num, k_bytea, k_bool))")
    pg_admin.execute(
        f"INSERT INTO {table} SELECT n * 7919 - 500000, 'clé ' || n || repeat('✓', n % 4), "
        "md5(n::text)::uuid, (n::numeric / 8)::numeric(12, 4), decode(md5(n::text), 'hex'), "
        "n % 2 = 0, 'row ' || n FROM generate_series(-150, 150) n")
    cdc_database.add_tables(pg_admin, table)
    described = describe_table(session, cdc_database.publication, table)
    kinds = sql_key_kinds(described.schema.columns, described.schema.primary_key)
    assert kinds == [("k_int", "int"), ("k_text", "text"), ("k_uuid", "text"),
                     ("k_num", "text"), ("k_bytea", "bytea"), ("k_bool", "bool")]
    key_hash = key_hash_sql(kinds)

    rows = _typed_rows(session, cdc_database.publication, table)
    digester = RowDigester([*(name for name, _ in kinds), "note"], [name for name, _ in kinds])
    by_note = {row["note"]: digester.key_hash(row) for row in rows}
    hashed_in_sql = session.execute(sql.SQL("SELECT note, encode({}, 'hex') FROM {}").format(
        key_hash, sql.Identifier(table))).fetchall()
    assert len(hashed_in_sql) == len(by_note) == 301
    assert {note: int(hashed, 16) for note, hashed in hashed_in_sql} == by_note

    for bits in (0, 5, 12, 20):  # the buckets of every 7th row: those rows and their peers
        buckets = sorted({bucket_of(hashed, bits) for hashed in list(by_note.values())[::7]})
        selected = session.execute(sql.SQL("SELECT note FROM {} WHERE {}").format(
            sql.Identifier(table), bucket_predicate(kinds, bits, buckets))).fetchall()
        assert sorted(note for (note,) in selected) == sorted(
            note for note, hashed in by_note.items() if bucket_of(hashed, bits) in buckets)
    quarter = range(3 << 18, 1 << 20)  # the last quarter at 20 bits: one run of buckets
    selected = session.execute(sql.SQL("SELECT note FROM {} WHERE {}").format(
        sql.Identifier(table), bucket_predicate(kinds, 20, quarter))).fetchall()
    assert sorted(note for (note,) in selected) == sorted(
        note for note, hashed in by_note.items() if bucket_of(hashed, 2) == 3)
    for bucket in range(8):  # each bucket alone: every row in exactly one
        selected = session.execute(sql.SQL("SELECT note FROM {} WHERE {}").format(
            sql.Identifier(table), bucket_predicate(kinds, 3, [bucket]))).fetchall()
        assert sorted(note for (note,) in selected) == sorted(
            note for note, hashed in by_note.items() if bucket_of(hashed, 3) == bucket)
