# cython: language_level=3, cdivision=True
"""Compiled twin of ``wire/digest.py``: a row's canonical bytes written in C into one buffer
and hashed by the bundled SHA-256 (``_speedups/sha256.h``: SHA-NI where the CPU has it), and
hashes added into a ``TableDigest``'s lists directly. The pure module is the definition: the
same bytes, hashes and exception types (``test_digest_twins.py`` compares them on generated
rows)."""

import struct

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.float cimport PyFloat_AS_DOUBLE
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_AsUnsignedLongLong
from cpython.long cimport PyLong_FromUnsignedLongLong
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_XDECREF
from libc.stdint cimport uint64_t
from libc.string cimport memcpy, memset

cdef extern from "../sha256.h":
    uint64_t cdc_sha256_head64(const unsigned char* data, size_t size) nogil

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object unicode, Py_ssize_t* size) except NULL
    PyObject* PyDict_GetItemWithError(object d, object key) except? NULL
    char* PyByteArray_AS_STRING(object o)
    Py_ssize_t PyByteArray_GET_SIZE(object o)
    int Py_EnterRecursiveCall(const char* where) except -1
    void Py_LeaveRecursiveCall()
    Py_ssize_t PySequence_Fast_GET_SIZE(object o)  # a list or a tuple
    PyObject* PySequence_Fast_GET_ITEM(object o, Py_ssize_t i)

cdef unsigned long long _U32_MAX = 0xFFFFFFFF
cdef unsigned long long _NAN_BITS = 0x7FF8000000000000
cdef Py_ssize_t _STACK_VALUES = 64  # columns gathered without an allocation


# -- the canonical bytes, in one buffer (on the stack until it outgrows it) --------------------
cdef int _grow(_Out* out, Py_ssize_t extra) except -1:
    cdef Py_ssize_t capacity = max(out.size + extra, out.capacity * 2)
    cdef char* grown
    if out.data == out.start:
        grown = <char*>PyMem_Malloc(capacity)
        if grown != NULL:
            memcpy(grown, out.data, out.size)
    else:
        grown = <char*>PyMem_Realloc(out.data, capacity)
    if grown == NULL:
        raise MemoryError()
    out.data = grown
    out.capacity = capacity
    return 0


cdef unsigned long long _hash64(const char* data, Py_ssize_t size) noexcept:
    return cdc_sha256_head64(<const unsigned char*>data, size)


cdef int _too_long() except -1:
    raise struct.error("'I' format requires 0 <= number <= 4294967295")


cdef int _put_sized(_Out* out, char tag, const char* data, Py_ssize_t size) except -1:
    """``tag`` + u32 ``size`` + ``data``."""
    if <unsigned long long>size > _U32_MAX:
        _too_long()
    if out.size + 5 + size > out.capacity:
        _grow(out, 5 + size)
    out.data[out.size] = tag
    _u32_at(out.data + out.size + 1, size)
    memcpy(out.data + out.size + 5, data, size)
    out.size += 5 + size
    return 0


cdef int _put_int(_Out* out, object value) except -1:
    cdef int overflow
    cdef long long number = PyLong_AsLongLongAndOverflow(value, &overflow)
    if overflow:
        text = str(value).encode("ascii")  # ValueError past int's digit limit, as pure
        return _put_sized(out, 73, PyBytes_AS_STRING(text), PyBytes_GET_SIZE(text))
    return _put_int64(out, number)


# "00" to "99": two decimal digits a division (half the divisions of one digit a time)
cdef const char* _DIGIT_PAIRS = (b"00010203040506070809101112131415161718192021222324252627282930"
                                 b"31323334353637383940414243444546474849505152535455565758596061"
                                 b"62636465666768697071727374757677787980818283848586878889909192"
                                 b"93949596979899")


cdef unsigned long long _POWERS_OF_TEN[20]  # 10^0 to 10^19: digits counted, no division
_POWERS_OF_TEN[:] = [10 ** exponent for exponent in range(20)]


cdef int _put_int64(_Out* out, long long number) except -1:
    """'I', u32 length, the decimal digits of ``number``: written in place, from the last
    digit back, once their count is known (no copy, no size checks per digit)."""
    cdef unsigned long long magnitude = (<unsigned long long>(-(number + 1)) + 1 if number < 0
                                         else <unsigned long long>number)
    cdef int length = 1
    cdef int pair
    cdef char* at
    while length < 20 and magnitude >= _POWERS_OF_TEN[length]:
        length += 1
    if number < 0:
        length += 1
    if out.size + 5 + length > out.capacity:
        _grow(out, 5 + length)
    at = out.data + out.size
    at[0] = 73  # 'I'
    _u32_at(at + 1, length)
    if number < 0:
        at[5] = 45  # '-'
    at += 5 + length
    while magnitude >= 100:
        pair = <int>(magnitude % 100) * 2
        magnitude //= 100
        at -= 2
        at[0], at[1] = _DIGIT_PAIRS[pair], _DIGIT_PAIRS[pair + 1]
    if magnitude >= 10:
        pair = <int>magnitude * 2
        at -= 2
        at[0], at[1] = _DIGIT_PAIRS[pair], _DIGIT_PAIRS[pair + 1]
    else:
        at -= 1
        at[0] = 48 + <char>magnitude
    out.size += 5 + length
    return 0


cdef int _put_float(_Out* out, double value) except -1:
    cdef uint64_t bits = _NAN_BITS
    cdef char packed[9]
    cdef int i
    if value == value:
        memcpy(&bits, &value, 8)
    packed[0] = 70  # 'F'
    for i in range(8):
        packed[1 + i] = <char>(bits >> (56 - 8 * i))
    return _put(out, packed, 9)


cdef int _put_array(_Out* out, object value) except -1:
    cdef Py_ssize_t count = len(value)
    cdef char head[5]
    items = value if type(value) is list or type(value) is tuple else list(value)
    if <unsigned long long>count > _U32_MAX:
        _too_long()
    head[0] = 65  # 'A'
    _u32_at(head + 1, count)
    _put(out, head, 5)
    Py_EnterRecursiveCall(" while writing a digest's nested array")
    try:
        for item in items:
            if item is None:
                _put(out, b"N", 1)
            else:
                _put_value(out, item)
    finally:
        Py_LeaveRecursiveCall()
    return 0


cdef int _put_value(_Out* out, object value) except -1:
    """``value_bytes(value)`` appended: exact types here, subclasses as the pure code."""
    cdef type kind = type(value)
    cdef Py_ssize_t size
    cdef const char* chars
    if kind is str:
        chars = PyUnicode_AsUTF8AndSize(value, &size)
        return _put_sized(out, 83, chars, size)  # 'S'
    if kind is int:
        return _put_int(out, value)
    if kind is float:
        return _put_float(out, PyFloat_AS_DOUBLE(value))
    if kind is bool:
        return _put(out, b"I\x00\x00\x00\x011" if value else b"I\x00\x00\x00\x010", 6)
    if kind is bytes:
        return _put_sized(out, 66, PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value))  # 'B'
    if kind is list or kind is tuple:
        return _put_array(out, value)
    if kind is bytearray:
        return _put_sized(out, 66, PyByteArray_AS_STRING(value), PyByteArray_GET_SIZE(value))
    return _put_subclassed(out, value)


cdef int _put_subclassed(_Out* out, object value) except -1:
    """The pure ``value_bytes`` for a value not of an exact wire type: by isinstance, in its
    order, through the same Python calls."""
    if isinstance(value, int):
        text = str(int(value)).encode("ascii")
        return _put_sized(out, 73, PyBytes_AS_STRING(text), PyBytes_GET_SIZE(text))
    if isinstance(value, float):
        return _put_float(out, PyFloat_AS_DOUBLE(value))
    if isinstance(value, str):
        data = value.encode("utf-8")
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
    elif isinstance(value, (list, tuple)):
        return _put_array(out, value)
    else:
        raise TypeError(f"not a wire value: {type(value).__name__}")
    return _put_sized(out, 83 if isinstance(value, str) else 66, PyBytes_AS_STRING(data),
                      PyBytes_GET_SIZE(data))


def _utf8(name):
    return name.encode("utf-8")


# -- one table shape ---------------------------------------------------------------------------
cdef class RowDigester:
    """Row and key hashes of one table shape: the column order and the name bytes worked out
    once, for the rows of a scan or a stream. A row must hold every column."""

    def __cinit__(self, *args, **kwargs):
        self._given_of_sorted = NULL
        self._key_sorted = NULL

    def __init__(self, columns, key_columns=()):
        given = tuple(columns)
        names = sorted(given, key=_utf8)
        if len(set(names)) != len(names):
            raise ValueError(f"column names repeat: {names}")
        key = set(key_columns) or set(names)
        if not key <= set(names):
            raise ValueError(f"key columns {sorted(key - set(names))} are not columns")
        self.columns = tuple(names)
        self.key_columns = tuple(name for name in names if name in key)
        self._given = given
        self._prefixes = tuple(len(_utf8(name)).to_bytes(4, "big") + _utf8(name)
                               for name in names)
        self._width = len(names)
        self._key_width = len(self.key_columns)
        self._key_is_row = self._key_width == self._width
        PyMem_Free(self._given_of_sorted)
        PyMem_Free(self._key_sorted)
        self._given_of_sorted = <Py_ssize_t*>PyMem_Malloc(max(1, self._width) * sizeof(Py_ssize_t))
        self._key_sorted = <Py_ssize_t*>PyMem_Malloc(max(1, self._key_width) * sizeof(Py_ssize_t))
        if self._given_of_sorted == NULL or self._key_sorted == NULL:
            raise MemoryError()
        position = {name: index for index, name in enumerate(given)}
        cdef Py_ssize_t index, held = 0
        for index in range(self._width):
            self._given_of_sorted[index] = position[names[index]]
            if names[index] in key:
                self._key_sorted[held] = index
                held += 1

    def __dealloc__(self):
        PyMem_Free(self._given_of_sorted)
        PyMem_Free(self._key_sorted)

    def __reduce__(self):
        return RowDigester, (self._given, self.key_columns)

    cdef int _write(self, _Out* out, PyObject** given, Py_ssize_t* which,
                    Py_ssize_t count) except -1:
        """The canonical bytes of the sorted columns ``which[0..count)`` (NULL: every
        column) of the values ``given`` (in the digester's given order)."""
        cdef Py_ssize_t index, column
        cdef PyObject* value
        for index in range(count):
            column = which[index] if which != NULL else index
            value = given[self._given_of_sorted[column]]
            if <object>value is None:
                continue
            prefix = <bytes>PySequence_Fast_GET_ITEM(self._prefixes, column)
            _put(out, PyBytes_AS_STRING(prefix), PyBytes_GET_SIZE(prefix))
            _put_value(out, <object>value)
        return 0

    cdef int hash_given(self, PyObject** given, unsigned long long* key_hash,
                        unsigned long long* row_hash) except -1:
        """The key and row hashes (either pointer NULL: not wanted) of the values
        ``given``, one per column in the order the digester was made with."""
        cdef _Out out
        _open(&out)
        try:
            if key_hash != NULL and not (self._key_is_row and row_hash != NULL):
                self._write(&out, given, self._key_sorted, self._key_width)
                key_hash[0] = _hash64(out.data, out.size)
                out.size = 0
            if row_hash != NULL:
                self._write(&out, given, NULL, self._width)
                row_hash[0] = _hash64(out.data, out.size)
                if key_hash != NULL and self._key_is_row:
                    key_hash[0] = row_hash[0]
        finally:
            _close(&out)
        return 0

    cdef int _gather(self, object row, PyObject** given, bint keys_only) except -1:
        """``given[i]`` = a new reference to ``row[name]`` of the i-th given column, or of the
        key columns only (the others left NULL: a key hash reads no other column, as the
        pure code); KeyError for a missing one, as the pure code."""
        cdef Py_ssize_t index, wanted
        cdef PyObject* found
        cdef bint is_dict = type(row) is dict
        for wanted in range(self._key_width if keys_only else self._width):
            index = (self._given_of_sorted[self._key_sorted[wanted]] if keys_only
                     else wanted)
            name = <object>PySequence_Fast_GET_ITEM(self._given, index)
            if is_dict:
                found = PyDict_GetItemWithError(row, name)
                if found == NULL:
                    raise KeyError(name)
                value = <object>found
            else:
                value = row[name]
            Py_INCREF(value)
            given[index] = <PyObject*>value
        return 0

    cdef int _hash_row(self, object row, unsigned long long* key_hash,
                       unsigned long long* row_hash) except -1:
        cdef PyObject* stack[64]
        cdef PyObject** given = stack
        cdef Py_ssize_t index
        if self._width > _STACK_VALUES:
            given = <PyObject**>PyMem_Malloc(self._width * sizeof(PyObject*))
            if given == NULL:
                raise MemoryError()
        memset(given, 0, self._width * sizeof(PyObject*))
        try:
            self._gather(row, given, row_hash == NULL)
            self.hash_given(given, key_hash, row_hash)
        finally:
            for index in range(self._width):
                Py_XDECREF(given[index])
            if given != stack:
                PyMem_Free(given)
        return 0

    def row_bytes(self, row):
        cdef PyObject* stack[64]
        cdef PyObject** given = stack
        cdef Py_ssize_t index
        cdef _Out out
        if self._width > _STACK_VALUES:
            given = <PyObject**>PyMem_Malloc(self._width * sizeof(PyObject*))
            if given == NULL:
                raise MemoryError()
        memset(given, 0, self._width * sizeof(PyObject*))
        _open(&out)
        try:
            self._gather(row, given, False)
            self._write(&out, given, NULL, self._width)
            return PyBytes_FromStringAndSize(out.data, out.size)
        finally:
            _close(&out)
            for index in range(self._width):
                Py_XDECREF(given[index])
            if given != stack:
                PyMem_Free(given)

    def row_hash(self, row):
        cdef unsigned long long hashed
        self._hash_row(row, NULL, &hashed)
        return PyLong_FromUnsignedLongLong(hashed)

    def key_hash(self, row):
        cdef unsigned long long hashed
        self._hash_row(row, &hashed, NULL)
        return PyLong_FromUnsignedLongLong(hashed)

    def hashes(self, row):
        """``(key_hash, row_hash)``: what a bucket digest adds or removes for the row."""
        cdef unsigned long long key, whole
        self._hash_row(row, &key, &whole)
        return PyLong_FromUnsignedLongLong(key), PyLong_FromUnsignedLongLong(whole)

    def hashes_of_values(self, values):
        """``hashes`` of the row whose values are ``values``, one per column in the order
        the digester was made with (not the sorted ``columns``): no row map needed."""
        cdef unsigned long long key, whole
        fast = _values_of(values, self._width)
        self.hash_given(<PyObject**>_items(fast), &key, &whole)
        return PyLong_FromUnsignedLongLong(key), PyLong_FromUnsignedLongLong(whole)


cdef extern from *:
    """
    #define _cdc_sequence_items(o) PySequence_Fast_ITEMS(o)
    """
    PyObject** _cdc_sequence_items(object o)


cdef inline PyObject** _items(object fast):
    return _cdc_sequence_items(fast)


cdef object _values_of(object values, Py_ssize_t width):
    """``values`` as a list or tuple of ``width`` items (ValueError: another count)."""
    fast = values if type(values) is list or type(values) is tuple else list(values)
    if PySequence_Fast_GET_SIZE(fast) != width:
        raise ValueError(f"{width} values expected, not {PySequence_Fast_GET_SIZE(fast)}")
    return fast


# -- adding into a TableDigest -----------------------------------------------------------------
cdef class _Target:
    """A ``TableDigest`` that hashes are added to: its lists updated here (what ``add``
    does), or, for anything but a plain TableDigest, through its ``add``."""

    def __cinit__(self, digest):
        # imported here: the pure module imports this one at its end
        from cdc_platform.wire.digest import TableDigest
        self.digest = digest
        bits = getattr(digest, "bits", None)
        totals, counts = getattr(digest, "totals", None), getattr(digest, "counts", None)
        self.direct = (type(digest) is TableDigest and type(bits) is int and 0 <= bits <= 64
                       and type(totals) is list and type(counts) is list
                       and len(totals) == len(counts) == 1 << bits)
        if self.direct:
            self.bits, self.totals, self.counts = bits, totals, counts

    cdef int add(self, unsigned long long key_hash, unsigned long long row_hash) except -1:
        cdef Py_ssize_t bucket
        cdef unsigned long long total
        if not self.direct:
            self.digest.add(PyLong_FromUnsignedLongLong(key_hash),
                            PyLong_FromUnsignedLongLong(row_hash))
            return 0
        bucket = 0 if self.bits == 0 else <Py_ssize_t>(key_hash >> (64 - self.bits))
        held = self.totals[bucket]
        try:
            total = PyLong_AsUnsignedLongLong(held) + row_hash  # modulo 2^64
            self.totals[bucket] = PyLong_FromUnsignedLongLong(total)
        except (OverflowError, TypeError):  # not a total add() left: its arithmetic
            self.totals[bucket] = (held + PyLong_FromUnsignedLongLong(row_hash)) & 0xFFFFFFFFFFFFFFFF
        self.counts[bucket] += 1
        return 0


def digest_rows(digest, digester, rows):
    """Add ``rows`` to ``digest``; the number of rows added."""
    cdef _Target target = _Target(digest)
    cdef RowDigester compiled
    cdef unsigned long long key, whole
    cdef Py_ssize_t added = 0
    if type(digester) is not RowDigester:
        for row in rows:
            digest.add(*digester.hashes(row))
            added += 1
        return added
    compiled = digester
    for row in rows:
        compiled._hash_row(row, &key, &whole)
        target.add(key, whole)
        added += 1
    return added


def digest_columns(digest, digester, columns, count):
    """Add ``count`` rows given column by column to ``digest``; the number added."""
    cdef _Target target = _Target(digest)
    cdef RowDigester compiled = digester
    cdef unsigned long long key, whole
    cdef Py_ssize_t width = compiled._width, row, index
    cdef PyObject* stack[64]
    cdef PyObject** given = stack
    if len(columns) != width:
        raise ValueError(f"{width} columns expected, not {len(columns)}")
    fast = [column if type(column) is list or type(column) is tuple else list(column)
            for column in columns]
    if any(len(column) != count for column in fast):
        raise ValueError(f"every column must hold {count} values")
    if width > _STACK_VALUES:
        given = <PyObject**>PyMem_Malloc(width * sizeof(PyObject*))
        if given == NULL:
            raise MemoryError()
    memset(given, 0, width * sizeof(PyObject*))
    try:
        for row in range(count):
            for index in range(width):
                given[index] = PySequence_Fast_GET_ITEM(
                    <object>PySequence_Fast_GET_ITEM(fast, index), row)
                Py_INCREF(<object>given[index])
            compiled.hash_given(given, &key, &whole)
            for index in range(width):
                Py_XDECREF(given[index])
                given[index] = NULL
            target.add(key, whole)
    finally:
        for index in range(width):
            Py_XDECREF(given[index])
        if given != stack:
            PyMem_Free(given)
    return count
