"""The digest's compiled twins (``_speedups/wire/digest.pyx``, ``_speedups/mirror/
stored_values.pyx``) against the pure code, so that they can never drift: on generated rows of
every kind of wire value and its edges, the bound ``RowDigester`` and the bulk functions give
what the pure module-level functions (never twinned: ``row_bytes``, ``row_hash``,
``key_hash``, built on ``value_bytes``) give, the same bytes, hashes and exception types. Run
both ways (``CDC_PLATFORM_PURE_PYTHON=1`` checks the pure class against the same functions);
and the bundled SHA-256 (``_speedups/sha256.h``), both of its implementations, against
hashlib."""

from __future__ import annotations

import enum
import hashlib
import json
import math
import random
import shutil
import struct
import subprocess
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import cdc_platform
from cdc_platform.mirror.columns import TableShape
from cdc_platform.mirror.stored_values import StoredRowDigester, digest_stored_rows, wire_value
from cdc_platform.wire import digest
from cdc_platform.wire.digest import RowDigester, TableDigest, digest_columns, digest_rows
from cdc_platform_tests.fixtures.twins import pure_copy


class _Number(enum.IntEnum):
    SEVEN = 7


class _Text(str):
    pass


def _outcome(function: Any, *args: Any) -> tuple[Any, type[BaseException] | None]:
    """(result, None) or (None, exception type): what a call did."""
    try:
        return function(*args), None
    except Exception as exc:  # noqa: BLE001 - comparing behaviour
        return None, type(exc)


NEGATIVE_NAN = struct.unpack(">d", b"\xff\xf8\x00\x00\x00\x00\x00\x01")[0]
scalars = st.one_of(
    st.integers(), st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 2**63 - 1, -(2**63), 2**63, 2**64 - 1, -(2**64), 10**40]),
    # (where the compiled writer's decimal digits change count or pair up)
    st.sampled_from([sign * (10**power + step) for power in range(19) for step in (-1, 0, 1)
                     for sign in (1, -1)]),
    st.floats(), st.sampled_from([math.nan, NEGATIVE_NAN, -0.0, 0.0, math.inf, -math.inf,
                                  5e-324, 1.7976931348623157e308]),
    st.text(max_size=12), st.sampled_from(["", "é", "\U0001f600 astral", "NaN", "\\x00"]),
    st.binary(max_size=12), st.sampled_from([b"", b"\x00"]),
    st.booleans(),
    st.binary(max_size=6).map(bytearray), st.binary(max_size=6).map(memoryview))
arrays = st.recursive(
    st.one_of(st.none(), scalars),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.lists(inner, max_size=3).map(tuple)),
    max_leaves=10)
not_wire = st.sampled_from([Decimal("1.5"), {"a": 1}, {1, 2}, object(), _Number.SEVEN,
                            _Text("sub"), complex(1, 2)])
cells = st.one_of(st.none(), scalars, arrays, not_wire)


@st.composite
def tables(draw: Any) -> tuple[list[str], list[str], list[dict[str, Any]]]:
    names = draw(st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=6,
                          unique=True))
    key = draw(st.lists(st.sampled_from(names), unique=True, max_size=len(names)))
    rows = draw(st.lists(st.fixed_dictionaries({name: cells for name in names}), min_size=1,
                         max_size=6))
    return names, key, rows


@settings(max_examples=300, deadline=None)
@given(tables())
@example((["a", "b"], ["a"], [{"a": 2**64 - 1, "b": [[1, None], [], None, ("é", b"")]}]))
@example((["b", "a", "\U0001f600", "é"], [], [{"a": True, "b": 1, "\U0001f600": 1.0,
                                                  "é": -0.0}]))
def test_the_bound_digester_gives_the_pure_bytes_and_hashes(table):
    names, key, rows = table
    digester = RowDigester(names, key)
    for row in rows:
        expected_bytes = _outcome(digest.row_bytes, row)
        assert _outcome(digester.row_bytes, row) == expected_bytes
        expected_row = _outcome(digest.row_hash, row)
        expected_key = _outcome(digest.key_hash, row, key or names)
        assert _outcome(digester.row_hash, row) == expected_row
        assert _outcome(digester.key_hash, row) == expected_key
        # a key hash reads the key columns alone: a map of those is enough
        keys_only = {name: row[name] for name in (key or names)}
        assert _outcome(digester.key_hash, keys_only) == expected_key
        if expected_row[1] is None and expected_key[1] is None:
            hashes = (expected_key[0], expected_row[0])
            assert digester.hashes(row) == hashes
            assert digester.hashes_of_values([row[name] for name in names]) == hashes
        else:
            failed = _outcome(digester.hashes, row)[1]
            assert failed in (expected_row[1], expected_key[1])
            assert _outcome(digester.hashes_of_values, [row[n] for n in names])[1] is failed


@settings(max_examples=200, deadline=None)
@given(tables(), st.integers(0, 4))
def test_bulk_digests_equal_adding_each_rows_pure_hashes(table, bits):
    names, key, rows = table
    rows = [row for row in rows if _outcome(digest.row_hash, row)[1] is None]
    expected = TableDigest(bits)
    for row in rows:
        expected.add(digest.key_hash(row, key or names), digest.row_hash(row))
    digester = RowDigester(names, key)
    by_rows, by_columns = TableDigest(bits), TableDigest(bits)
    assert digest_rows(by_rows, digester, iter(rows)) == len(rows)
    columns = [[row[name] for row in rows] for name in names]
    assert digest_columns(by_columns, digester, columns, len(rows)) == len(rows)
    assert by_rows == expected == by_columns


def test_a_value_that_is_no_wire_value_stops_the_bulk_digest_with_the_pure_error():
    digester = RowDigester(["a", "b"], ["a"])
    for bad, error in (({"a": 1, "b": Decimal(1)}, TypeError), ({"a": 1}, KeyError)):
        assert _outcome(digest_rows, TableDigest(2), digester, [{"a": 0, "b": 0}, bad]
                        ) == (None, error)
    with pytest.raises(ValueError, match="2 columns expected"):
        digest_columns(TableDigest(0), digester, [[1]], 1)
    with pytest.raises(ValueError, match="every column must hold 2 values"):
        digest_columns(TableDigest(0), digester, [[1, 2], [3]], 2)


def test_a_digest_that_is_not_a_plain_table_digest_is_added_to_through_its_add():
    """The twin writes a TableDigest's lists itself; anything else gets ``add`` calls, as
    the pure code makes."""
    calls = []

    class Recording(TableDigest):
        def add(self, key_hash: int, row_hash: int) -> None:
            calls.append((key_hash, row_hash))
            super().add(key_hash, row_hash)

    digester = RowDigester(["a"])
    recording = Recording(1)
    digest_rows(recording, digester, [{"a": 1}, {"a": "x"}])
    assert calls == [digester.hashes({"a": 1}), digester.hashes({"a": "x"})]
    plain = TableDigest(1)
    digest_rows(plain, digester, [{"a": 1}, {"a": "x"}])
    assert (plain.totals, plain.counts) == (recording.totals, recording.counts)


SHA256_PROGRAM = r"""
#include "sha256.h"
#include <stdio.h>
int main(void) {
    static unsigned char data[1200];
    size_t size, other;
    int portable;
    uint64_t first_hash, second_hash;
    for (size = 0; size < sizeof data; size++)
        data[size] = (unsigned char)(size * 131 + 7);
    for (portable = 0; portable < 2; portable++) {
        cdc_sha256_implementation();
        if (portable)
            cdc_sha256_blocks = cdc_sha256_blocks_portable;
        for (size = 0; size <= 600; size++)
            printf("%zu %016llx\n", size,
                   (unsigned long long)cdc_sha256_head64(data, size));
        for (size = 0; size <= sizeof data; size++) {  /* two at a time, of other lengths */
            other = size * 37 % (sizeof data + 1);
            cdc_sha256_head64_pair(data, size, data + sizeof data - other, other,
                                   &first_hash, &second_hash);
            printf("%zu %016llx %zu %016llx\n", size, (unsigned long long)first_hash,
                   other, (unsigned long long)second_hash);
        }
    }
    printf("%s\n", cdc_sha256_implementation());
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_bundled_sha256_equals_hashlib_for_every_length_across_blocks(tmp_path):
    """Both implementations of ``sha256.h`` (SHA-NI where the CPU has it, and portable C)
    against hashlib for every length 0..600: every padding case, one to ten blocks; and two
    messages hashed at once (``cdc_sha256_head64_pair``: their common blocks together on
    SHA-NI), of every length 0..1200 (past what it pads on its stack) beside another."""
    header_dir = Path(cdc_platform.__file__).parent / "_speedups"
    (tmp_path / "check.c").write_text(SHA256_PROGRAM)
    subprocess.run(["cc", "-O2", "-I", str(header_dir), "-o", str(tmp_path / "check"),
                    str(tmp_path / "check.c")], check=True)
    lines = subprocess.run([str(tmp_path / "check")], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    data = bytes((size * 131 + 7) % 256 for size in range(1200))

    def head(message: bytes) -> str:
        return hashlib.sha256(message).hexdigest()[:16]

    expected = [f"{size} {head(data[:size])}" for size in range(601)]
    pairs = [f"{size} {head(data[:size])} {size * 37 % 1201} "
             f"{head(data[1200 - size * 37 % 1201:])}" for size in range(1201)]
    assert lines[:601] == expected  # the CPU's choice
    assert lines[601:1802] == pairs
    assert lines[1802:2403] == expected  # portable C
    assert lines[2403:3604] == pairs
    assert lines[-1] in ("sha-ni", "portable")


def test_random_rows_of_a_wide_table_hash_as_the_pure_functions():
    """More columns than the twin gathers on its stack (64)."""
    generator = random.Random(25)
    names = [f"c{index:03d}" for index in range(150)]
    digester = RowDigester(list(reversed(names)), names[:3])
    for _ in range(20):
        row = {name: generator.choice([None, generator.random(), "x" * generator.randrange(
            300), generator.getrandbits(80), [1, None]]) for name in names}
        assert digester.row_bytes(row) == digest.row_bytes(row)
        assert digester.hashes(row) == (digest.key_hash(row, names[:3]), digest.row_hash(row))


# -- the mirror's stored rows ------------------------------------------------------------------
PURE_STORED = pure_copy("cdc_platform.mirror.stored_values")
# (name, type oid, data_type[, base type oid: a domain's column]); dmoods: a domain over an
# enum's array (its base type no builtin: an array by the schema's is_array alone)
STORED_COLUMNS = (("id", 20, "bigint"), ("score", 701, "double precision"),
                  ("xid", 5069, "xid8"), ("floats", 1022, "double precision[]"),
                  ("blobs", 1001, "bytea[]"), ("tags", 1009, "text[]"), ("doc", 3802, "jsonb"),
                  ("price", 1700, "numeric"), ("odd", 16384, "mood"), ("data", 17, "bytea"),
                  ("dscore", 16390, "score", 701), ("dxid", 16391, "txid", 5069),
                  ("dints", 16392, "ints", 1007), ("dfloats", 16393, "score[]", 1022),
                  ("dblobs", 16394, "blob[]", 1001), ("dmoods", 16395, "moods", 16396))
json_items = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=6),
              st.sampled_from(["NaN", "Infinity", "\\x00ff", "\\x", "\\xzz", "é😀"])),
    lambda inner: st.lists(inner, max_size=4), max_leaves=12)
stored_texts = st.one_of(
    st.text(max_size=8), st.lists(json_items, max_size=5).map(json.dumps),
    st.lists(json_items, max_size=5).map(lambda items: json.dumps(items, separators=(",", ":"))),
    st.sampled_from([
        "NaN", "Infinity", "", "0", "007", "18446744073709551615", "١٢", "12a", "[", "[]",
        "[1, null, [2.5, \"x\"]]", '["NaN", "Infinity", "-Infinity", 1.5, null]',
        '["\\\\x00ff", "\\\\x", [null, "\\\\xab"], "plain"]', '["\\\\xzz"]',
        '[true, false, 12345678901234567890123, "é\\ud83d\\ude00"]', "[1,", "null",
        "[01]", "[1.]", "[-]", "[1,]", "[NaN]", "[-Infinity]", "[1e999, -1E-999, -0, -0.0]",
        '["a\\"b"]', '["tab\there"]', "[1] x", " [1]", "[1] \n", '[{"a": 1}]', "[ ]",
        "[" * 40 + "]" * 40, "[" * 20 + "1" + "]" * 20, "[123456789012345678]",
        "[1234567890123456789]", "[" + "9" * 5000 + "]", "[\ud800]", '["\ud800"]']))
stored_cells = st.one_of(st.none(), st.integers(), st.floats(), st.binary(max_size=6),
                         stored_texts)


def _stored_shape() -> Any:
    return TableShape.from_schema({
        "table": "t", "fingerprint": "f", "primary_key": ["id", "xid"],
        "columns": [{"name": name, "type_oid": oid, "data_type": data_type, "attnum": n,
                     "base_type_oid": base[0] if base else oid,
                     "is_array": data_type.endswith("[]") or name in ("dints", "dmoods")}
                    for n, (name, oid, data_type, *base) in enumerate(STORED_COLUMNS, start=1)]})


@settings(max_examples=120, deadline=None)
@given(st.lists(st.tuples(*(stored_cells for _ in STORED_COLUMNS)), min_size=1, max_size=5),
       st.sampled_from([[], ["id", "xid"], ["tags"]]), st.integers(0, 3))
def test_stored_rows_hash_as_their_pure_wire_values_do(rows, key, bits):
    columns = _stored_shape().columns
    names = [column.name for column in columns]
    digester = StoredRowDigester(columns, key)
    expected_digest, digested = TableDigest(bits), []
    for stored in rows:
        for column, value in zip(columns, stored, strict=True):
            pure = _outcome(PURE_STORED.wire_value, value, column)
            assert repr(_outcome(wire_value, value, column)) == repr(pure)
        converted = _outcome(lambda s: {c.name: PURE_STORED.wire_value(v, c)
                                        for c, v in zip(columns, s, strict=True)}, stored)
        if converted[1] is not None:
            assert _outcome(digester.hashes, stored)[1] is converted[1]
            continue
        hashed = _outcome(lambda row: (digest.key_hash(row, key or names),
                                       digest.row_hash(row)), converted[0])
        assert _outcome(digester.hashes, stored) == hashed
        if hashed[1] is not None:  # (a lone surrogate in text)
            continue
        expected = hashed[0]
        assert digester.hashes(list(stored)) == expected
        expected_digest.add(*expected)
        digested.append(stored)
    by_rows = TableDigest(bits)
    assert digest_stored_rows(by_rows, digester, iter(digested)) == len(digested)
    assert by_rows == expected_digest


def test_a_stored_row_of_another_width_is_a_clear_error():
    digester = StoredRowDigester(_stored_shape().columns, ["id"])
    with pytest.raises(ValueError, match="16 values expected, not 2"):
        digester.hashes((1, 2))
    with pytest.raises(ValueError, match="16 values expected, not 2"):
        digest_stored_rows(TableDigest(0), digester, [(1, 2)])
