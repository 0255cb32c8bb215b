"""The compiled chunk decoder (``_speedups/mirror/snapshots.pyx``) against the pure path
(msgpack, then the row maps' values in column order): the same values, the same NaN flag, and
anything it does not take refused (the caller then decodes the pure way)."""

from __future__ import annotations

import math
import operator
import os

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdc_platform.mirror.snapshots import decode_chunk
from cdc_platform.speedups import compiled_twin
from cdc_platform_tests.msgpack_values import same as _same
from cdc_platform_tests.msgpack_values import values

ROWS = compiled_twin("cdc_platform.mirror.snapshots")
compiled = pytest.mark.skipif(ROWS is None, reason="the compiled decoder is not built")

names = st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=20, unique=True)


def _has_nan(value) -> bool:
    """(a NaN inside an array or map is flagged too: those columns are converted anyway)"""
    if isinstance(value, float):
        return math.isnan(value)
    if isinstance(value, list):
        return any(_has_nan(item) for item in value)
    if isinstance(value, dict):
        return any(_has_nan(item) for item in value.values())
    return False


def test_the_decoder_is_built():
    if os.environ.get("CDC_PLATFORM_PURE_PYTHON"):
        pytest.skip("pure Python asked for")
    assert ROWS is not None, "the twin of cdc_platform.mirror.snapshots is not built: pip install -e ."


@compiled
@settings(max_examples=300, deadline=None)
@given(names.flatmap(lambda columns: st.tuples(
    st.just(tuple(columns)),
    st.lists(st.tuples(*[values] * len(columns)), max_size=6))))
def test_rows_are_the_values_of_the_row_maps_in_column_order(case):
    columns, rows = case
    chunk = {"table": "t", "operation": "snapshot", "chunk": 2000001, "lsn": "1/0",
             "data": [dict(zip(columns, row, strict=True)) for row in rows], "partition": 2}
    data = msgpack.packb(chunk, use_bin_type=True)
    fields, got, has_nan = ROWS.chunk_tuples(data, columns)
    want = [operator.itemgetter(*columns)(r) if len(columns) > 1 else (r[columns[0]],)
            for r in msgpack.unpackb(data)["data"]]
    assert _same([list(r) for r in got], [list(r) for r in want])
    assert fields == {k: v for k, v in chunk.items() if k != "data"}
    assert has_nan == any(_has_nan(value) for row in rows for value in row)
    assert decode_chunk(data, columns).as_tuples


@compiled
def test_what_it_does_not_take_goes_to_the_pure_path():
    columns = ("id", "name")
    good = {"chunk": 5, "data": [{"id": 1, "name": "a"}]}
    other_order = {"chunk": 5, "data": [{"name": "a", "id": 1}]}
    other_columns = {"chunk": 5, "data": [{"id": 1}]}
    for chunk in (other_order, other_columns):
        with pytest.raises(KeyError):
            ROWS.chunk_tuples(msgpack.packb(chunk), columns)
        decoded = decode_chunk(msgpack.packb(chunk), columns)
        assert not decoded.as_tuples and decoded.rows == chunk["data"]
    data = msgpack.packb(good)
    for cut in range(len(data)):  # every truncation: refused, never a wrong row
        with pytest.raises((ValueError, KeyError)):
            ROWS.chunk_tuples(data[:cut], columns)
    ext = msgpack.packb({"chunk": 5, "data": [{"id": msgpack.ExtType(1, b"x"), "name": "a"}]})
    with pytest.raises(ValueError, match="not in the contract"):
        ROWS.chunk_tuples(ext, columns)
    with pytest.raises(ValueError):
        ROWS.chunk_tuples(b'{"chunk": 5, "data": []}', columns)
    assert decode_chunk(b'{"chunk": 5, "data": [{"id": 1, "name": "a"}]}', columns).rows == [
        {"id": 1, "name": "a"}]
