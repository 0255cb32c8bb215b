# cython: language_level=3, cdivision=True
"""Compiled twin of ``protocol/pgoutput.py``: reading TupleData."""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM

from cdc_platform._speedups.writer cimport u32

cdef extern from "Python.h":
    object PyUnicode_DecodeUTF8(const char* s, Py_ssize_t size, const char* errors)


def read_tuple(bytes data not None, Py_ssize_t pos, object unchanged):
    """``pgoutput.read_tuple_python``: TupleData at ``data[pos:]`` -> ``(values, end)``.

    Kinds ``t`` -> str (UTF-8), ``b`` -> bytes, ``n`` -> None, ``u`` -> ``unchanged``.
    ``None`` when the tuple is truncated or has an unknown kind (the caller's Python
    decoder then raises the precise error); invalid UTF-8 raises UnicodeDecodeError."""
    cdef object values = tuple_at(<const unsigned char*>PyBytes_AS_STRING(data),
                                  PyBytes_GET_SIZE(data), &pos, unchanged)
    if values is None:
        return None
    return values, pos


cdef object tuple_at(const unsigned char* buf, Py_ssize_t size, Py_ssize_t* position,
                     object unchanged):
    """:func:`read_tuple` on a buffer; ``position`` is advanced past the tuple."""
    cdef Py_ssize_t count, i, length
    cdef Py_ssize_t pos = position[0]
    cdef unsigned char kind
    cdef object value
    if pos < 0 or pos > size - 2:  # not pos + 2 > size: that overflows near the maximum
        return None
    count = (<Py_ssize_t>buf[pos] << 8) | buf[pos + 1]
    pos += 2
    values = PyTuple_New(count)
    for i in range(count):
        if pos >= size:
            return None
        kind = buf[pos]
        pos += 1
        if kind == 116 or kind == 98:  # 't', 'b'
            if pos + 4 > size:
                return None
            length = u32(buf + pos)
            pos += 4
            if length > size - pos:
                return None
            if kind == 116:
                value = PyUnicode_DecodeUTF8(<const char*>buf + pos, length, NULL)
            else:
                value = PyBytes_FromStringAndSize(<const char*>buf + pos, length)
            pos += length
        elif kind == 110:  # 'n'
            value = None
        elif kind == 117:  # 'u'
            value = unchanged
        else:
            return None
        Py_INCREF(value)
        PyTuple_SET_ITEM(values, i, value)
    position[0] = pos
    return values
