"""A row's key hash and bucket (docs/verification.md Part 1) computed by PostgreSQL itself, so
that a query reads the rows of some buckets only (a repair snapshot's ``WHERE``).

Possible for key columns whose wire value PostgreSQL writes as it is: integers (``I`` +
``x::text``), text, varchar, uuid and numeric (``S`` + ``convert_to(x::text, 'UTF8')``), bytea
(``B`` + the bytes) and bool (``I`` + ``'0'``/``'1'``), taken by their own type oid (a domain
over one of them is not: its oid is the domain's). Every other key is hashed after conversion,
in the task (``snapshot/buckets.py``). ``test_digest_source.py`` proves the expression equal
to ``wire.digest.RowDigester.key_hash`` on PostgreSQL 15 and 18.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from psycopg import sql

from cdc_platform.postgres.catalog import CatalogColumn

# type oid -> how the digest writes its value: "int" (I + ::text), "text" (S + ::text),
# "bytea" (B + the bytes), "bool" (I + 0/1)
SQL_KEY_KINDS: Mapping[int, str] = {
    20: "int", 21: "int", 23: "int",  # int8, int2, int4
    25: "text", 1043: "text", 2950: "text", 1700: "text",  # text, varchar, uuid, numeric
    17: "bytea",
    16: "bool",
}
# the bucket comes from the top bits of the hash's first three bytes
MAX_SQL_BITS = 24


def sql_key_kinds(columns: Sequence[CatalogColumn], key: Sequence[str]
                  ) -> list[tuple[str, str]] | None:
    """``(name, kind)`` of each key column for :func:`key_bytes_sql`, or None when a key
    column's wire value is not what SQL can write (or there is no key: a table without a
    primary key hashes every column, NULLs included, and is filtered in the task)."""
    if not key:
        return None
    by_name = {column.name: column for column in columns}
    kinds = [(name, SQL_KEY_KINDS.get(by_name[name].type_oid)) for name in key]
    if any(kind is None for _, kind in kinds):
        return None
    return [(name, kind) for name, kind in kinds if kind is not None]


def key_bytes_sql(columns: Iterable[tuple[str, str]]) -> sql.Composable:
    """The canonical key bytes (row bytes of the key columns) as an SQL expression;
    ``columns``: ``(name, kind)`` as :func:`sql_key_kinds` gives them (none NULL: a primary
    key)."""
    parts: list[sql.Composable] = []
    for name, kind in sorted(columns, key=lambda column: column[0].encode()):
        encoded_name = name.encode()
        parts.append(sql.Literal(len(encoded_name).to_bytes(4, "big") + encoded_name))
        column = sql.Identifier(name)
        if kind == "bool":
            parts.append(sql.SQL("CASE WHEN {} THEN {} ELSE {} END").format(
                column, sql.Literal(b"I\x00\x00\x00\x011"), sql.Literal(b"I\x00\x00\x00\x010")))
            continue
        value = column if kind == "bytea" else sql.SQL("convert_to({}::text, 'UTF8')").format(
            column)
        tag = {"bytea": b"B", "int": b"I"}.get(kind, b"S")
        parts.append(sql.SQL("{} || int4send(length({})) || {}").format(
            sql.Literal(tag), value, value))
    return sql.SQL(" || ").join(parts)


def key_hash_sql(columns: Iterable[tuple[str, str]]) -> sql.Composable:
    """The key hash as 8 bytes (bytea): the first 8 bytes of SHA-256 of the key bytes."""
    return sql.SQL("substr(sha256({}), 1, 8)").format(key_bytes_sql(columns))


def bucket_sql(columns: Iterable[tuple[str, str]], bits: int) -> sql.Composable:
    """The row's bucket at ``bits`` (at most :data:`MAX_SQL_BITS`) as an int4: the top bits
    of the key hash, SHA-256 computed once per row."""
    if not 0 <= bits <= MAX_SQL_BITS:
        raise ValueError(f"bits must be 0..{MAX_SQL_BITS}, not {bits}")
    return sql.SQL("(('x' || left(encode(sha256({}), 'hex'), 6))::bit(24)::int4 >> {})").format(
        key_bytes_sql(columns), sql.Literal(MAX_SQL_BITS - bits))


def bucket_ranges(buckets: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted distinct ``buckets`` as runs of consecutive numbers ``(first, last)``."""
    ranges: list[tuple[int, int]] = []
    for bucket in buckets:
        if ranges and bucket == ranges[-1][1] + 1:
            ranges[-1] = (ranges[-1][0], bucket)
        else:
            ranges.append((bucket, bucket))
    return ranges


def bucket_predicate(columns: Iterable[tuple[str, str]], bits: int,
                     buckets: Iterable[int]) -> sql.Composable:
    """``WHERE`` condition: the row's key falls in one of ``buckets`` (sorted, distinct) at
    ``bits``. Their runs as one int4multirange constant (PostgreSQL 14+): its size grows with
    the runs, not the buckets (a quarter of the table at 20 bits is 262,144 buckets), and a
    row's look-up is a binary search."""
    ranges = ",".join(f"[{first},{last + 1})" for first, last in bucket_ranges(buckets))
    return sql.SQL("{} <@ {}::int4multirange").format(
        bucket_sql(columns, bits), sql.Literal(f"{{{ranges}}}"))
