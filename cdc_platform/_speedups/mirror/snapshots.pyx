# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled twin of ``mirror/snapshots.py``'s :func:`chunk_tuples` for msgpack
snapshot chunks: the row maps are read straight into tuples in column order (no dict per
row), which is most of a bootstrap's Python time. Same values as ``msgpack.unpackb`` followed
by ``operator.itemgetter(*columns)``; anything else (a row of other columns or in another
order, a type the contract never writes, truncated bytes) raises and the caller takes the pure
path, which gives the real answer or the real error.
"""

from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM

from cdc_platform._speedups.msgpack_reader cimport Reader


def chunk_tuples(bytes data not None, tuple columns not None):
    """A msgpack chunk -> (its fields but ``data``, its rows as tuples in ``columns`` order,
    whether a row value is a float NaN). KeyError: a row of other columns or in another order;
    ValueError: bytes this decoder does not take (the caller decodes them the pure way)."""
    cdef Reader reader = Reader(data)
    cdef Py_ssize_t field_count, row_count, width, i, j, k
    cdef Py_ssize_t column_count = len(columns)
    cdef list names = [column.encode() for column in columns]
    cdef dict fields = {}
    cdef list rows = None
    cdef tuple row
    if reader.end == 0 or data[0:1] in (b"{", b"["):
        raise ValueError("not msgpack")
    field_count = reader.header(0x80, 0x8f, 0xde, 0xdf)
    for i in range(field_count):
        key = reader.value()
        if key != "data":
            fields[key] = reader.value()
            continue
        row_count = reader.header(0x90, 0x9f, 0xdc, 0xdd)
        rows = []
        for j in range(row_count):
            width = reader.header(0x80, 0x8f, 0xde, 0xdf)
            if width != column_count:
                raise KeyError("a row with other columns")
            row = PyTuple_New(column_count)
            rows.append(row)  # (owned by the list: a half-built tuple is never dropped)
            for k in range(column_count):
                if not reader.take_key(names[k]):
                    raise KeyError("a row with other columns or in another order")
                value = reader.value()
                Py_INCREF(value)
                PyTuple_SET_ITEM(row, k, value)
    if reader.pos != reader.end:
        raise ValueError("bytes after the chunk")
    if rows is None:
        raise KeyError("data")
    return fields, rows, reader.saw_nan
