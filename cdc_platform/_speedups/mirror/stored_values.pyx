# cython: language_level=3, cdivision=True
"""Compiled twin of ``mirror/stored_values.py``: a stored row's hashes without a row map, the
values ``to_sqlite`` changed turned back in C where that is a check of the text (a REAL
column's ``NaN``, an xid8's digits) and hashed by the digest twin's ``RowDigester``."""

import json
import math

from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_XDECREF
from libc.string cimport memcmp, memcpy, memset

from cdc_platform._speedups.wire.digest cimport _Target

from cdc_platform.mirror.columns import NON_FINITE_FLOATS as _NON_FINITE_FLOATS
from cdc_platform.mirror.columns import REAL_OIDS as _REAL_OIDS
from cdc_platform.mirror.columns import WIDE_INTEGER_OIDS as _WIDE_INTEGER_OIDS

cdef extern from "Python.h":
    bint PyUnicode_IS_COMPACT_ASCII(object o)
    Py_ssize_t PyUnicode_GET_LENGTH(object o)
    void* PyUnicode_DATA(object o)
    PyObject* PySequence_Fast_GET_ITEM(object o, Py_ssize_t i)
    const char* PyUnicode_AsUTF8AndSize(object unicode, Py_ssize_t* size) except NULL
    object PyUnicode_DecodeUTF8(const char* data, Py_ssize_t size, const char* errors)
    object PyLong_FromString(const char* text, char** end, int base)
    double PyOS_string_to_double(const char* text, char** end, PyObject* overflow) except? -1.0

_FLOAT_ARRAYS = frozenset({1021, 1022})
_BYTEA_ARRAY = 1001

cdef Kind _kind_of(column) except *:
    oid = column.base_type_oid
    if oid in _REAL_OIDS:
        return REAL
    if oid in _WIDE_INTEGER_OIDS:
        return WIDE_INTEGER
    if column.holds_arrays:
        if oid in _FLOAT_ARRAYS:
            return FLOAT_ARRAY
        if oid == _BYTEA_ARRAY:
            return BYTEA_ARRAY
        return ARRAY
    return KEEP


cdef bint _ascii_digits(object text) noexcept:
    cdef Py_ssize_t index, size
    cdef const unsigned char* chars
    if not PyUnicode_IS_COMPACT_ASCII(text):
        return False
    size = PyUnicode_GET_LENGTH(text)
    chars = <const unsigned char*>PyUnicode_DATA(text)
    for index in range(size):
        if chars[index] < 48 or chars[index] > 57:
            return False
    return size > 0


# -- the JSON text of an array, read without json.loads where it is plain ---------------------
# ``to_sqlite`` writes arrays as ``json.dumps`` of their nested lists. The reader below takes
# what that writes for most arrays (nested arrays of null, true, false, numbers and strings
# without escapes) and gives up (-1) on anything else, which json.loads then reads: so its
# result is always json.loads's.
cdef int _MAX_DEPTH = 32
cdef int _MAX_INT_DIGITS = 18  # an int of more digits goes through json.loads (its limits)


cdef inline Py_ssize_t _space(const char* text, Py_ssize_t at, Py_ssize_t end) noexcept:
    while at < end and (text[at] == 32 or text[at] == 9 or text[at] == 10 or text[at] == 13):
        at += 1
    return at


cdef Py_ssize_t _number(const char* text, Py_ssize_t at, Py_ssize_t end, list out) except -2:
    """A JSON number at ``at`` appended to ``out`` (int or float, as json.loads makes it);
    where it ends, or -1 for what json.loads must read."""
    cdef Py_ssize_t start = at, digits
    cdef bint fraction = False
    cdef char* stop
    cdef char buffer[64]
    if at < end and text[at] == 45:  # '-'
        at += 1
    if at >= end or not 48 <= text[at] <= 57 or (
            text[at] == 48 and at + 1 < end and 48 <= text[at + 1] <= 57):
        return -1  # no digit, or a leading zero
    while at < end and 48 <= text[at] <= 57:
        at += 1
    digits = at - start
    if at < end and text[at] == 46:  # '.'
        fraction = True
        at += 1
        if at >= end or not 48 <= text[at] <= 57:
            return -1
        while at < end and 48 <= text[at] <= 57:
            at += 1
    if at < end and (text[at] == 101 or text[at] == 69):  # 'e', 'E'
        fraction = True
        at += 1
        if at < end and (text[at] == 43 or text[at] == 45):
            at += 1
        if at >= end or not 48 <= text[at] <= 57:
            return -1
        while at < end and 48 <= text[at] <= 57:
            at += 1
    if at - start >= <Py_ssize_t>sizeof(buffer) or (not fraction and digits > _MAX_INT_DIGITS):
        return -1
    memcpy(buffer, text + start, at - start)
    buffer[at - start] = 0
    if fraction:
        out.append(PyOS_string_to_double(buffer, &stop, NULL))  # float(text): inf past range
    else:
        out.append(PyLong_FromString(buffer, &stop, 10))
    return at


cdef Py_ssize_t _array(const char* text, Py_ssize_t at, Py_ssize_t end, list out,
                       int depth) except -2:
    """The array whose ``[`` is at ``at`` appended to ``out``; where it ends, or -1."""
    cdef list items = []
    cdef Py_ssize_t start
    cdef unsigned char c
    if depth > _MAX_DEPTH:
        return -1
    at = _space(text, at + 1, end)
    if at < end and text[at] == 93:  # ']'
        out.append(items)
        return at + 1
    while True:
        if at >= end:
            return -1
        c = <unsigned char>text[at]
        if c == 34:  # '"'
            start = at + 1
            at = start
            while at < end and <unsigned char>text[at] != 34:
                if <unsigned char>text[at] == 92 or <unsigned char>text[at] < 32:
                    return -1  # an escape or a control character
                at += 1
            if at >= end:
                return -1
            items.append(PyUnicode_DecodeUTF8(text + start, at - start, NULL))
            at += 1
        elif c == 91:  # '['
            at = _array(text, at, end, items, depth + 1)
        elif c == 110 and end - at >= 4 and memcmp(text + at, b"null", 4) == 0:
            items.append(None)
            at += 4
        elif c == 116 and end - at >= 4 and memcmp(text + at, b"true", 4) == 0:
            items.append(True)
            at += 4
        elif c == 102 and end - at >= 5 and memcmp(text + at, b"false", 5) == 0:
            items.append(False)
            at += 5
        else:
            at = _number(text, at, end, items)
        if at < 0:
            return -1
        at = _space(text, at, end)
        if at >= end:
            return -1
        if text[at] == 93:  # ']'
            out.append(items)
            return at + 1
        if text[at] != 44:  # ','
            return -1
        at = _space(text, at + 1, end)


cdef object _json_array(object stored):
    """``json.loads(stored)`` of a text starting with ``[``, read here when it is plain; the
    text itself when json.loads refuses it (the pure ``wire_value``)."""
    cdef Py_ssize_t size, at
    cdef const char* text
    cdef list out = []
    try:
        text = PyUnicode_AsUTF8AndSize(stored, &size)
    except UnicodeEncodeError:  # a lone surrogate: json.loads decides
        text = NULL
    if text != NULL:
        at = _array(text, 0, size, out, 0)
        if at >= 0 and _space(text, at, size) == size:
            return out[0]
    try:
        return json.loads(stored)
    except ValueError:
        return stored


cdef object _restored(object stored, Kind kind):
    """The pure ``wire_value`` of the text ``stored`` in a column of ``kind``."""
    if kind == REAL:
        return math.nan if stored == "NaN" else stored
    if kind == WIDE_INTEGER:
        return int(stored) if _ascii_digits(stored) else stored
    if kind == KEEP or not stored.startswith("["):
        return stored
    items = _json_array(stored)
    if items is stored:
        return stored
    if kind == FLOAT_ARRAY:
        return _elements(items, _non_finite)
    if kind == BYTEA_ARRAY:
        return _elements(items, _hex_bytes)
    return items


def _elements(items, restore):
    return [_elements(item, restore) if isinstance(item, list) else restore(item)
            for item in items]


def _non_finite(item):
    return _NON_FINITE_FLOATS.get(item, item) if isinstance(item, str) else item


def _hex_bytes(item):
    if isinstance(item, str) and item.startswith("\\x"):
        return bytes.fromhex(item[2:])
    return item


def wire_value(stored, column):
    """The wire value ``stored`` was written from (a value ``to_sqlite`` did not write is
    returned as it is)."""
    if not isinstance(stored, str):
        return stored
    return _restored(stored, _kind_of(column))


cdef class StoredRowDigester:
    """Key and row hashes of rows read from a mirror's SQLite table: ``SELECT`` of
    ``columns`` (in that order) gives tuples whose values ``wire_value`` turns back into the
    wire values the digest is defined over."""

    def __cinit__(self, *args, **kwargs):
        self._kinds = NULL

    def __init__(self, columns, key_columns):
        self.columns = tuple(columns)
        self.names = tuple(column.name for column in self.columns)
        self._digester = RowDigester(self.names, key_columns)
        self._width = len(self.columns)
        PyMem_Free(self._kinds)
        self._kinds = <unsigned char*>PyMem_Malloc(max(1, self._width))
        if self._kinds == NULL:
            raise MemoryError()
        cdef Py_ssize_t index
        for index in range(self._width):
            self._kinds[index] = <unsigned char>_kind_of(self.columns[index])

    def __dealloc__(self):
        PyMem_Free(self._kinds)

    def __reduce__(self):
        return StoredRowDigester, (self.columns, self._digester.key_columns)

    cdef int hash_stored(self, object stored, unsigned long long* key_hash,
                         unsigned long long* row_hash) except -1:
        """The key and row hashes (either pointer NULL: not wanted) of one stored row."""
        cdef PyObject* stack[64]
        cdef PyObject** given = stack
        cdef Py_ssize_t index
        fast = stored if type(stored) is tuple or type(stored) is list else tuple(stored)
        if len(fast) != self._width:
            raise ValueError(f"{self._width} values expected, not {len(fast)}")
        if self._width > 64:
            given = <PyObject**>PyMem_Malloc(self._width * sizeof(PyObject*))
            if given == NULL:
                raise MemoryError()
        memset(given, 0, self._width * sizeof(PyObject*))
        try:
            for index in range(self._width):
                value = <object>PySequence_Fast_GET_ITEM(fast, index)
                if self._kinds[index] != KEEP and isinstance(value, str):
                    value = _restored(value, <Kind>self._kinds[index])
                Py_INCREF(value)
                given[index] = <PyObject*>value
            self._digester.hash_given(given, key_hash, row_hash)
        finally:
            for index in range(self._width):
                Py_XDECREF(given[index])
            if given != stack:
                PyMem_Free(given)
        return 0

    def hashes(self, stored):
        """``(key_hash, row_hash)`` of one stored row (a tuple in ``columns`` order)."""
        cdef unsigned long long key, whole
        self.hash_stored(stored, &key, &whole)
        return key, whole


def digest_stored_rows(digest, digester, rows):
    """Add stored rows (``digester.columns`` order) to ``digest``; the number added."""
    cdef _Target target = _Target(digest)
    cdef StoredRowDigester compiled
    cdef unsigned long long key, whole
    cdef Py_ssize_t added = 0
    if type(digester) is not StoredRowDigester:
        for stored in rows:
            digest.add(*digester.hashes(stored))
            added += 1
        return added
    compiled = digester
    for stored in rows:
        compiled.hash_stored(stored, &key, &whole)
        target.add(key, whole)
        added += 1
    return added
