"""The table digest (``cdc_platform.wire.digest``, docs/verification.md): the golden vectors in
``data/golden/digest_vectors.json`` still come out byte for byte; the digest is additive and
order-independent; every column and every edge value counts; and every edge value of every
type, stored by the mirror in real SQLite and read back, hashes as it did on the wire."""

from __future__ import annotations

import itertools
import json
import math
import random
import sqlite3
import struct
from typing import Any

import pytest

from cdc_platform.mirror.columns import TableShape
from cdc_platform.mirror.store import MirrorStore
from cdc_platform.mirror.stored_values import (
    StoredRowDigester,
    digest_stored_rows,
    wire_value,
)
from cdc_platform.wire.digest import (
    MAX_BUCKET_BITS,
    ROWS_PER_BUCKET,
    RowDigester,
    TableDigest,
    bucket_bits,
    bucket_of,
    digest_rows,
    key_hash,
    row_bytes,
    row_hash,
    table_digest,
    value_bytes,
)
from cdc_platform.wire.encoding import decode_payload, encoder
from cdc_platform_tests.digest_vectors import PATH

VECTORS = json.loads(PATH.read_text())["tables"]


def _value(written: Any) -> Any:
    """A value of the vectors file -> the wire value (see cdc_platform_tests.digest_vectors)."""
    if isinstance(written, dict):
        return float(written["float"]) if "float" in written else bytes.fromhex(written["bytes"])
    if isinstance(written, list):
        return [_value(item) for item in written]
    return written


def _rows(table: str) -> list[dict[str, Any]]:
    return [{name: _value(value) for name, value in row["values"].items()}
            for row in VECTORS[table]["rows"]]


def _digester(table: str) -> RowDigester:
    vectors = VECTORS[table]
    return RowDigester([c["name"] for c in vectors["columns"]], vectors["primary_key"])


@pytest.mark.parametrize("table", sorted(VECTORS))
def test_the_golden_vectors_come_out_byte_for_byte(table):
    vectors, digester = VECTORS[table], _digester(table)
    digest = TableDigest(vectors["bits"])
    for row, expected in zip(_rows(table), vectors["rows"], strict=True):
        assert digester.row_bytes(row).hex() == expected["row_bytes"]
        assert row_bytes(row).hex() == expected["row_bytes"]
        assert f"{digester.row_hash(row):016x}" == f"{row_hash(row):016x}" == expected["row_hash"]
        key = vectors["primary_key"] or [c["name"] for c in vectors["columns"]]
        assert f"{digester.key_hash(row):016x}" == f"{key_hash(row, key):016x}" \
            == expected["key_hash"]
        assert bucket_of(digester.key_hash(row), vectors["bits"]) == expected["bucket"]
        digest.add(digester.key_hash(row), digester.row_hash(row))
    assert [{"bucket": index, "total": f"{total:016x}", "count": count}
            for index, (total, count) in enumerate(zip(digest.totals, digest.counts))] \
        == vectors["buckets"]


def test_the_vectors_cover_every_edge_of_the_encoding():
    whole = "|".join(row["row_bytes"] for vectors in VECTORS.values()
                     for row in vectors["rows"])
    for value in (math.nan, math.inf, -math.inf, -0.0, 5e-324, True, False,
                  18446744073709551615, -9223372036854775808, "", b"", [], [None],
                  [1, None, 3], [[1, 2], [3, 4]]):
        assert value_bytes(value).hex() in whole, value
    assert len(VECTORS["ledger"]["rows"]) == 5 and VECTORS["ledger"]["buckets"][1]["count"] == 2


def test_the_digest_does_not_depend_on_the_order_of_rows():
    digester = _digester("edges")
    rows = _rows("edges") + _rows("edges")[:2]
    expected = table_digest(rows, digester, 3)
    for order in itertools.permutations(range(len(rows))):
        assert table_digest([rows[i] for i in order], digester, 3) == expected


def test_remove_undoes_add_in_any_order():
    digester = _digester("ledger")
    rows = _rows("ledger")
    digest = table_digest(rows, digester, 1)
    without_first = table_digest(rows[1:], digester, 1)
    assert digest != without_first
    digest.remove(digester.key_hash(rows[0]), digester.row_hash(rows[0]))
    assert digest == without_first
    for row in random.Random(5).sample(rows[1:], len(rows) - 1):
        digest.remove(digester.key_hash(row), digester.row_hash(row))
    assert digest == TableDigest(1)


def test_an_update_is_remove_then_add_and_lands_where_the_new_row_is_digested():
    digester = _digester("edges")
    before, after = _rows("edges"), _rows("edges")
    after[1]["txt"] = "changed"
    kept = table_digest(before, digester, 2)
    kept.remove(digester.key_hash(before[1]), digester.row_hash(before[1]))
    kept.add(digester.key_hash(after[1]), digester.row_hash(after[1]))
    assert kept == table_digest(after, digester, 2)
    assert kept.differing(table_digest(before, digester, 2)) == [
        bucket_of(digester.key_hash(after[1]), 2)]


@pytest.mark.parametrize("table", ["edges", "names", "ledger"])
def test_a_row_changed_in_any_one_column_changes_its_hash(table):
    digester, rows = _digester(table), _rows(table)
    for row, column in itertools.product(rows, digester.columns):
        others = [other[column] for other in rows
                  if _value_bytes_or_none(other[column]) != _value_bytes_or_none(row[column])]
        for replacement in others:
            changed = {**row, column: replacement}
            assert digester.row_hash(changed) != digester.row_hash(row), (column, replacement)


def _value_bytes_or_none(value: Any) -> bytes | None:
    return None if value is None else value_bytes(value)


@pytest.mark.parametrize(("one", "other"), [
    (None, ""), (None, "null"), ("", "null"), (0.0, -0.0), (math.nan, math.inf),
    (1, "1"), (1, 1.0), (b"", ""), (b"ab", "ab"), ([], None), ([None], []), ([], ""),
    (18446744073709551615, "18446744073709551615"), ("\\xab", b"\xab"), (math.nan, "NaN"),
    ([[1, 2]], [1, 2]), (["a", "b"], ["ab"]), (["ab"], ["a", "b"])])
def test_values_that_are_not_the_same_wire_value_hash_differently(one, other):
    assert row_hash({"c": one, "id": 1}) != row_hash({"c": other, "id": 1})


def test_null_is_an_absent_column_and_every_nan_is_one():
    assert row_hash({"id": 1, "c": None}) == row_hash({"id": 1})
    negative_nan = -math.nan
    assert struct.pack(">d", negative_nan) != struct.pack(">d", math.nan)  # (sign bit set)
    assert value_bytes(negative_nan) == value_bytes(math.nan) == bytes.fromhex(
        "467ff8000000000000")
    assert value_bytes(True) == value_bytes(1) and value_bytes(False) == value_bytes(0)


def test_names_are_ordered_by_their_utf8_bytes():
    assert _digester("names").columns == ("Order Lines", "Zed", "z", "ä", "\uff5e", "\U0001d11e")


def test_buckets_nest_so_a_repair_can_bisect():
    digester = _digester("edges")
    rows = [{**row, "id": number} for number in range(300) for row in _rows("edges")[:1]]
    fine = table_digest(rows, digester, 6)
    for bits in range(7):
        assert fine.folded(bits) == table_digest(rows, digester, bits)
    for row in rows:
        hashed = digester.key_hash(row)
        assert bucket_of(hashed, 6) >> 1 == bucket_of(hashed, 5)
    assert fine.differing(table_digest(rows[1:], digester, 3)) == [
        bucket_of(digester.key_hash(rows[0]), 3)]


def test_bucket_bits_keep_buckets_near_their_target_size():
    assert bucket_bits(0) == bucket_bits(ROWS_PER_BUCKET) == 0
    assert bucket_bits(ROWS_PER_BUCKET + 1) == 1
    assert bucket_bits(1_000_000) == 10
    assert bucket_bits(10**12) == MAX_BUCKET_BITS


def test_what_is_not_a_wire_value_is_a_clear_error():
    with pytest.raises(TypeError, match="not a wire value: dict"):
        row_hash({"id": 1, "c": {"a": 1}})
    with pytest.raises(ValueError, match="key columns"):
        RowDigester(["id"], ["missing"])
    with pytest.raises(ValueError, match="bits must be 0..20, not 21"):
        TableDigest(21)
    with pytest.raises(ValueError, match="cannot fold 2 bits into 3"):
        TableDigest(2).folded(3)


# the vectors' columns as they are; each a domain over its type; each array an array of a
# domain over its element type (as KV ``schemas`` says them: ``base_type_oid``)
TYPED = ["types", "domains", "arrays of domains"]


@pytest.mark.parametrize("typed", TYPED)
@pytest.mark.parametrize("fmt", ["msgpack", "json"])
@pytest.mark.parametrize("table", sorted(VECTORS))
def test_a_change_events_values_hash_as_the_vectors_say_in_either_format(table, fmt, typed):
    """What a mirror hashes as it applies a change: the event's ``data`` as the wire encodes
    and a consumer decodes it (JSON: bytea and non-finite floats restored by base type)."""
    shape = TableShape.from_schema(_schema(table, typed))
    digester = _digester(table)
    for row, expected in zip(_rows(table), VECTORS[table]["rows"], strict=True):
        data = decode_payload(encoder(fmt)({"data": row}), fmt)["data"]
        if fmt == "json":
            data = shape.from_json(data)
        assert f"{digester.row_hash(data):016x}" == expected["row_hash"]


# -- the mirror's SQLite form ---------------------------------------------------------------------
def _schema(table: str, typed: str = "types") -> dict[str, Any]:
    vectors = VECTORS[table]
    columns = []
    for position, column in enumerate(vectors["columns"], start=1):
        column = {**column, "attnum": position}
        array = column["data_type"].endswith("[]")
        if typed == "domains" or (typed == "arrays of domains" and array):
            # (a domain's oid, and format_type's name of it or of its array)
            column.update(type_oid=900000 + position, base_type_oid=column["type_oid"],
                          data_type=f"domain{position}" + ("[]" if array and typed ==
                                                           "arrays of domains" else ""))
        columns.append(column)
    return {"table": table, "fingerprint": "digest-vectors", "primary_key": vectors["primary_key"],
            "columns": columns}


def _read_back(path: str, table: str, typed: str) -> list[dict[str, Any]]:
    shape = TableShape.from_schema(_schema(table, typed))
    by_name = {column.name: column for column in shape.columns}
    with sqlite3.connect(path) as db:
        cursor = db.execute(f'SELECT * FROM "{table}" ORDER BY rowid')
        names = [d[0] for d in cursor.description]
        return [{name: wire_value(stored, by_name[name]) for name, stored in zip(names, row)}
                for row in cursor]


def test_raw_text_a_converter_did_not_take_comes_back_as_text():
    shape = TableShape.from_schema({"table": "raw", "fingerprint": "f", "primary_key": [],
                                    "columns": [
                                        {"name": "x", "type_oid": 5069, "data_type": "xid8"},
                                        {"name": "a", "type_oid": 1007, "data_type": "int[]"},
                                        {"name": "f", "type_oid": 701, "data_type": "float8"}]})
    xid8, array, float8 = shape.columns
    assert wire_value("\u00b2", xid8) == "\u00b2"  # (a digit to str.isdigit, not to int)
    assert wire_value("18446744073709551615", xid8) == 18446744073709551615
    assert wire_value("{1,2}", array) == "{1,2}" and wire_value("[1,", array) == "[1,"
    assert wire_value("[1,2]", array) == [1, 2]
    assert wire_value("Infinity", float8) == "Infinity"  # (to_sqlite keeps inf a REAL)
    assert math.isnan(wire_value("NaN", float8))


def _insert_events(table: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"table": table, "schema": "public", "operation": "INSERT", "relation_id": 1,
             "commit_lsn": "0/100", "lsn": "0/100", "xid": 7, "ordinal": ordinal,
             "msg_id": f"0/100:{ordinal}", "data": row, "unchanged_toast": [],
             "schema_fingerprint": "digest-vectors"} for ordinal, row in enumerate(rows)]


@pytest.mark.parametrize("typed", TYPED)
@pytest.mark.parametrize("table", sorted(VECTORS))
@pytest.mark.parametrize("how", ["snapshot", "stream"])
def test_every_edge_value_comes_back_from_the_mirrors_sqlite_with_its_hash(table, how, typed,
                                                                           tmp_path):
    path = str(tmp_path / "mirror.db")
    store = MirrorStore(path)
    try:
        shape = TableShape.from_schema(_schema(table, typed))
        store.begin_bootstrap(shape, "digest-vectors", 1)
        if how == "snapshot":
            store.load_rows(table, _rows(table))
            store.finish_bootstrap(table, 0)
        else:
            store.finish_bootstrap(table, 0)
            store.apply_transaction(_insert_events(table, _rows(table)), 1)
    finally:
        store.close()
    digester = _digester(table)
    read = _read_back(path, table, typed)
    assert [f"{digester.row_hash(row):016x}" for row in read] == [
        row["row_hash"] for row in VECTORS[table]["rows"]]
    assert table_digest(read, digester, VECTORS[table]["bits"]) == table_digest(
        _rows(table), digester, VECTORS[table]["bits"])
    # the same from the stored tuples, as `mirror verify` scans them
    shape = TableShape.from_schema(_schema(table, typed))
    stored = StoredRowDigester(shape.columns, VECTORS[table]["primary_key"])
    with sqlite3.connect(path) as db:
        names = ", ".join(f'"{name}"' for name in stored.names)
        scanned = TableDigest(VECTORS[table]["bits"])
        digest_stored_rows(scanned, stored, db.execute(f'SELECT {names} FROM "{table}"'))
    assert scanned == table_digest(_rows(table), digester, VECTORS[table]["bits"])


def test_a_digest_messages_buckets_read_back_as_written():
    from cdc_platform.wire.digest import bucket_digests, pack_totals

    digest = TableDigest(3)
    digest.add(0xFFFF_0000_0000_0000, 2**64 - 1)
    digest.add(0x0000_0000_0000_0001, 5)
    packed = pack_totals(digest.totals)
    assert len(packed) == 64 and packed[-8:] == b"\xff" * 8
    assert bucket_digests(3, packed, digest.counts) == {
        b: (digest.totals[b], digest.counts[b]) for b in range(8)}
    assert bucket_digests(3, pack_totals([7, 9]), [1, 2], [6, 2]) == {6: (7, 1), 2: (9, 2)}
    for bad in ((3, packed[:-1], digest.counts, None), (3, packed, digest.counts[:-1], None),
                (3, pack_totals([1]), [1], [8]), (3, pack_totals([1, 1]), [1, 1], [2, 2]),
                (21, b"", [], [])):
        with pytest.raises(ValueError):
            bucket_digests(*bad)


def test_a_rows_hashes_in_one_call_and_rows_digested_in_bulk_agree_with_each_hash():
    digester = _digester("edges")
    rows = _rows("edges")
    assert [digester.hashes(row) for row in rows] == [
        (digester.key_hash(row), digester.row_hash(row)) for row in rows]
    digest = TableDigest(3)
    assert digest_rows(digest, digester, iter(rows)) == len(rows)
    assert digest == table_digest(rows, digester, 3)


def test_a_digester_refuses_repeated_column_names_and_hashes_values_in_the_given_order():
    with pytest.raises(ValueError, match="repeat"):
        RowDigester(["a", "b", "a"])
    digester = RowDigester(["b", "a"], ["a"])
    assert digester.hashes_of_values(["x", 1]) == digester.hashes({"a": 1, "b": "x"})
    with pytest.raises(ValueError, match="2 values expected, not 1"):
        digester.hashes_of_values([1])
