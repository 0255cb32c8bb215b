# cython: language_level=3, cdivision=True
"""Compiled twin of ``bridge/events.py``'s msgpack writing: LSN text, and a change's map
written around the fields it shares with its transaction's other changes, already packed.

(The field names of a change live in ``events.py`` only: a fused writer of the whole
message, with the names as C literals, measured no faster end to end and was dropped.)"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE

from cdc_platform._speedups.writer cimport (
    Buffer,
    ascii_text,
    finish,
    pack,
    put,
    put_length,
    put_lsn,
)


def lsn_text(unsigned long long lsn):
    """``lsn.format_lsn`` for a valid LSN: ``0x16B374D848`` -> ``"16/B374D848"``."""
    cdef char text[17]
    return ascii_text(text, put_lsn(text, lsn))


def pack_map(bytes prefix not None, Py_ssize_t prefix_items, tuple items not None):
    """A msgpack map of ``prefix_items`` key/value pairs already packed in ``prefix``,
    followed by ``items`` (key, value, key, value, ...): the bytes of ``msgpack.packb`` of
    the dict with those pairs in that order."""
    cdef Py_ssize_t count = PyTuple_GET_SIZE(items)
    cdef Py_ssize_t i
    cdef Buffer out
    if count % 2:
        raise ValueError("items must alternate keys and values")
    out.capacity = PyBytes_GET_SIZE(prefix) + 64 + 32 * count
    out.data = <char*>PyMem_Malloc(out.capacity)
    if out.data == NULL:
        raise MemoryError()
    out.size = 0
    try:
        put_length(&out, prefix_items + count // 2, 0x80, 16, 0, 0xDE, 0xDF)
        put(&out, PyBytes_AS_STRING(prefix), PyBytes_GET_SIZE(prefix))
        for i in range(count):
            pack(&out, <object>PyTuple_GET_ITEM(items, i), 1)
    except BaseException:
        PyMem_Free(out.data)
        raise
    return finish(&out)
