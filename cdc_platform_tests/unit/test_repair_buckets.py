"""A repair snapshot's buckets without a server: the SQL PostgreSQL is given to select them
(``postgres/key_hash.py``; ``integration/test_digest_source.py`` runs it), which keys take
that path, and the tasks' filter for the others (``snapshot/buckets.py``)."""

from __future__ import annotations

import pytest

from cdc_platform.postgres.catalog import CatalogColumn, TableSchema
from cdc_platform.postgres.key_hash import (
    bucket_predicate,
    bucket_ranges,
    bucket_sql,
    key_bytes_sql,
    sql_key_kinds,
)
from cdc_platform.protocol.values import TypeRegistry
from cdc_platform.snapshot.buckets import BucketFilter, BucketSelection
from cdc_platform.snapshot.chunks import Chunker, ChunkLayout
from cdc_platform.wire.digest import RowDigester, bucket_of


def _column(name: str, type_oid: int, position: int, key: bool) -> CatalogColumn:
    return CatalogColumn(name=name, position=position, data_type="x", is_nullable=not key,
                         column_default=None, type_oid=type_oid, is_key=key,
                         is_primary_key=key, type_modifier=-1)


def _schema(columns: list[tuple[str, int, bool]]) -> TableSchema:
    return TableSchema(schema="public", table="t", relation_id=1,
                       replica_identity="d" if any(key for _, _, key in columns) else "f",
                       columns=tuple(_column(name, oid, index + 1, key)
                                     for index, (name, oid, key) in enumerate(columns)))


def test_the_key_bytes_expression_writes_the_digests_bytes_column_by_column():
    expression = key_bytes_sql([("id", "int"), ("flag", "bool"), ("b", "bytea"),
                                ("name", "text")]).as_string(None)
    # sorted by the names' UTF-8, each: u32 name length, name, tag, u32 length, value
    assert expression == (
        " E'\\\\000\\\\000\\\\000\\\\001b'::bytea ||  E'B'::bytea || int4send(length(\"b\")) || "
        "\"b\" ||  E'\\\\000\\\\000\\\\000\\\\004flag'::bytea || CASE WHEN \"flag\" THEN  "
        "E'I\\\\000\\\\000\\\\000\\\\0011'::bytea ELSE  E'I\\\\000\\\\000\\\\000\\\\0010'::bytea "
        "END ||  E'\\\\000\\\\000\\\\000\\\\002id'::bytea ||  E'I'::bytea || "
        "int4send(length(convert_to(\"id\"::text, 'UTF8'))) || convert_to(\"id\"::text, "
        "'UTF8') ||  E'\\\\000\\\\000\\\\000\\\\004name'::bytea ||  E'S'::bytea || "
        "int4send(length(convert_to(\"name\"::text, 'UTF8'))) || "
        "convert_to(\"name\"::text, 'UTF8')")


def test_the_bucket_is_the_top_bits_of_the_hashs_first_three_bytes_hashed_once():
    bucket = bucket_sql([("id", "int")], 5).as_string(None)
    assert bucket.startswith("(('x' || left(encode(sha256(")
    assert bucket.endswith("), 'hex'), 6))::bit(24)::int4 >> 19)")
    assert bucket.count("sha256") == 1
    assert bucket_predicate([("id", "int")], 5, [3, 4, 5, 17]).as_string(None) == (
        f"{bucket} <@ '{{[3,6),[17,18)}}'::int4multirange")
    with pytest.raises(ValueError, match="bits must be 0..24"):
        bucket_sql([("id", "int")], 25)


def test_buckets_run_together_into_ranges():
    assert bucket_ranges([]) == []
    assert bucket_ranges([0]) == [(0, 0)]
    assert bucket_ranges([0, 1, 2, 5, 7, 8]) == [(0, 2), (5, 5), (7, 8)]


@pytest.mark.parametrize(("columns", "kinds"), [
    ([("id", 20, True), ("at", 1184, False)], [("id", "int")]),
    ([("a", 23, True), ("b", 25, True), ("c", 2950, True), ("d", 1700, True),
      ("e", 17, True), ("f", 16, True), ("g", 1043, True), ("h", 21, True)],
     [("a", "int"), ("b", "text"), ("c", "text"), ("d", "text"), ("e", "bytea"),
      ("f", "bool"), ("g", "text"), ("h", "int")]),
    ([("id", 20, True), ("at", 1184, True)], None),  # timestamptz: its wire value is not ::text
    ([("c", 1042, True)], None),  # bpchar: ::text drops the padding the wire keeps
    ([("x", 701, True)], None),  # float
    ([("d", 16500, True)], None),  # a domain (its own oid): not known to be one of these
    ([("a", 23, False), ("b", 25, False)], None),  # no primary key: filtered in the task
])
def test_only_keys_whose_wire_value_is_their_text_are_selected_by_sql(columns, kinds):
    schema = _schema(columns)
    assert sql_key_kinds(schema.columns, schema.primary_key) == kinds
    assert (BucketSelection(3, (1,)).sql_predicate(schema) is None) == (kinds is None)


@pytest.mark.parametrize(("bits", "buckets", "error"), [
    (21, (1,), "bits must be 0..20"),
    (-1, (0,), "bits must be"),
    (3, (), "non-empty"),
    (3, (8,), r"below 2\^3"),
    (3, (-1,), r"below 2\^3"),
    (3, (2, 1), "sorted and distinct"),
    (3, (1, 1), "sorted and distinct"),
])
def test_a_selection_must_name_buckets_at_its_bits(bits, buckets, error):
    with pytest.raises(ValueError, match=error):
        BucketSelection(bits, buckets)


def test_of_sorts_the_buckets_and_drops_repeats():
    assert BucketSelection.of(4, [9, 2, 9, 0]) == BucketSelection(4, (0, 2, 9))


def _rows_of(layout, converters, text):
    return Chunker(layout, converters, 0).rows(text)


@pytest.mark.parametrize("with_key", [True, False])
def test_the_tasks_filter_keeps_the_lines_whose_converted_key_falls_in_the_buckets(with_key):
    """A timestamptz key (converted by the snapshot's converter before hashing) and, without
    a primary key, every column with NULLs, escapes and the ctid the COPY adds."""
    names = ("at", "note")
    converters = TypeRegistry().for_columns(
        [type("Column", (), {"type_oid": oid}) for oid in (1184, 25)])
    layout = ChunkLayout(table="t", snapshot_id="repair-x", lsn="0/1", schema_fingerprint="f",
                         columns=names, key_columns=(0,) if with_key else ())
    lines = []
    for n in range(400):
        at = "infinity" if n == 0 else f"2020-01-01 00:{n // 60:02d}:{n % 60:02d}.5+00"
        note = "\\N" if n % 5 == 0 else f"tab\\there {n % 9}"
        lines.append(f"{at}\t{note}" + ("" if with_key else f"\t(0,{n})"))
    text = "".join(line + "\n" for line in lines)
    rows = _rows_of(layout, converters, text)
    digester = RowDigester(names, ["at"] if with_key else names)
    bits = 4
    buckets = sorted({bucket_of(digester.key_hash(row), bits) for row in rows[::50]})
    wanted = [line for line, row in zip(lines, rows, strict=True)
              if bucket_of(digester.key_hash(row), bits) in buckets]
    assert 0 < len(wanted) < len(lines)

    kept = BucketFilter(layout, converters, BucketSelection(bits, tuple(buckets))).keep(
        text.encode())

    assert kept == "".join(line + "\n" for line in wanted)
    assert BucketFilter(layout, converters, BucketSelection(bits, (15,))).keep(b"") == ""


def test_requests_at_several_bits_unite_at_the_finest():
    united = BucketSelection.union([(4, [3]), (6, [5, 13]), (5, [31])])
    assert united == BucketSelection(6, (5, 12, 13, 14, 15, 62, 63))
    assert united.share == 7 / 64
    assert BucketSelection.union([(2, [1])]) == BucketSelection(2, (1,))


@pytest.mark.parametrize(("selection", "text"), [
    (BucketSelection(6, (5, 12, 13, 14, 15, 62, 63)), "6:5,12-15,62-63"),
    (BucketSelection(0, (0,)), "0:0"),
    (BucketSelection(14, tuple(range(4096))), "14:0-4095"),
    (BucketSelection(14, tuple(range(0, 16384, 4))), "14:" + ",".join(
        str(b) for b in range(0, 16384, 4))),
])
def test_a_selection_reads_back_from_its_text(selection, text):
    assert selection.to_text() == text
    assert BucketSelection.from_text(text) == selection


@pytest.mark.parametrize("text", ["", "6", "6:", "6:x", "6:-1", "6:5,3", "6:64", "x:1",
                                  "6:3-1"])
def test_text_that_is_no_selection_is_refused(text):
    with pytest.raises(ValueError):
        BucketSelection.from_text(text)
