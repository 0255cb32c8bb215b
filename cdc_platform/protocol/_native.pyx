# cython: language_level=3, cdivision=True
"""Compiled twins of the hottest pure-Python functions. Optional: see ``native.py``.

Every function here has a pure-Python original with the same results (named in its
docstring); ``cdc_platform_tests/unit/test_native.py`` checks them against each other on
captured and generated inputs. Where an input is unusual (non-ASCII text, a BC date, a
malformed message) these functions either take the same slow path as the original or
return ``None`` so that the caller's Python code produces the precise result or error --
errors are worded in one place only.

* :func:`read_tuple`: pgoutput TupleData -> tuple of column values (``pgoutput._tuple``);
* :class:`RowBuilder`: a tuple of texts -> ``{column: typed value}``
  (``changes._row_builder``);
* :func:`take_changes`: a run of XLogData Inserts/Updates/Deletes -> ChangeRecords
  (``changes.TransactionAssembler.feed``);
* :func:`timestamptz`, :func:`timestamp`, :func:`timetz`: the converters of ``values.py``;
* :func:`packb` and :func:`pack_map`: msgpack, byte for byte what ``msgpack.packb`` writes
  for the types the platform produces (anything else is handed to ``msgpack.packb``);
* :func:`change_message`: a per-change CDC message (``events.MessageBuilder._single``);
* :func:`pack_rows`: snapshot rows packed from COPY fields (``chunks.Chunker``);
* :func:`frame_messages`, :func:`frame_sequence`: NATS ``HPUB`` framing of the publisher.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_Next, PyDict_SetItem
from cpython.float cimport PyFloat_AS_DOUBLE
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_AsUnsignedLongLong
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE, PyTuple_New, PyTuple_SET_ITEM
from libc.string cimport memchr, memcpy

import msgpack

cdef extern from "Python.h":
    object PyUnicode_DecodeUTF8(const char* s, Py_ssize_t size, const char* errors)
    const char* PyUnicode_AsUTF8AndSize(object unicode, Py_ssize_t* size) except NULL
    bint PyUnicode_IS_COMPACT_ASCII(object o)
    Py_ssize_t PyUnicode_GET_LENGTH(object o)
    void* PyUnicode_DATA(object o)
    object PyUnicode_New(Py_ssize_t size, Py_UCS4 maxchar)
    object PyLong_FromUnicodeObject(object u, int base)
    object PyFloat_FromString(object s)
    object PyObject_CallOneArg(object callable, object arg)
    object PyByteArray_FromStringAndSize(const char* s, Py_ssize_t size)
    char* PyByteArray_AS_STRING(object o)
    Py_ssize_t PyByteArray_GET_SIZE(object o)
    bint PyByteArray_Check(object o)
    bint PyLong_Check(object o)
    bint PyUnicode_Check(object o)
    bint PyBytes_Check(object o)
    bint PyFloat_Check(object o)
    bint PyDict_Check(object o)
    bint PyList_Check(object o)
    bint PyTuple_Check(object o)
    Py_ssize_t PyList_GET_SIZE(object o)
    PyObject* PyList_GET_ITEM(object o, Py_ssize_t i)
    Py_ssize_t PyDict_Size(object o)


# -- pgoutput TupleData ---------------------------------------------------------------------
cdef inline Py_ssize_t _u32(const unsigned char* p) noexcept nogil:
    return (<Py_ssize_t>p[0] << 24) | (<Py_ssize_t>p[1] << 16) | (<Py_ssize_t>p[2] << 8) | p[3]


def read_tuple(bytes data, Py_ssize_t pos, object unchanged):
    """``pgoutput._tuple``: TupleData at ``data[pos:]`` -> ``(values, end)``.

    Kinds ``t`` -> str (UTF-8), ``b`` -> bytes, ``n`` -> None, ``u`` -> ``unchanged``.
    ``None`` when the tuple is truncated or has an unknown kind (the caller's Python
    decoder then raises the precise error); invalid UTF-8 raises UnicodeDecodeError."""
    cdef object values = _tuple_at(<const unsigned char*>PyBytes_AS_STRING(data),
                                   PyBytes_GET_SIZE(data), &pos, unchanged)
    if values is None:
        return None
    return values, pos


cdef object _tuple_at(const unsigned char* buf, Py_ssize_t size, Py_ssize_t* position,
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
            length = _u32(buf + pos)
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


# -- rows -----------------------------------------------------------------------------------
cdef enum ConvertKind:
    KEEP = 0  # the text is the value
    TO_INT = 1
    TO_FLOAT = 2
    CALL = 3


cdef class RowBuilder:
    """``changes._row_builder``: ``values -> {name: value}`` for the columns at ``indexes``.

    A ``str`` value goes through its column's converter (none for ``passthrough`` ones,
    ``int`` and ``float`` parsed directly); None and bytes pass as they are; anything else
    (UNCHANGED_TOAST) raises ``slow`` (an exception class: a new instance per raise, so no
    traceback accumulates), the caller's cue for its general loop."""

    cdef tuple names
    cdef tuple converters
    cdef tuple indexes
    cdef int* kinds
    cdef Py_ssize_t* positions
    cdef Py_ssize_t count
    cdef Py_ssize_t width
    cdef object slow

    def __cinit__(self):
        self.kinds = NULL
        self.positions = NULL

    def __init__(self, tuple names, tuple converters, tuple indexes, passthrough,
                 object slow):
        cdef Py_ssize_t j
        self.width = len(names)
        if len(converters) != self.width:
            raise ValueError("one converter per column")
        self.count = len(indexes)
        self.names = tuple(names[i] for i in indexes)
        self.converters = tuple(converters[i] for i in indexes)
        self.indexes = indexes
        self.slow = slow
        self.kinds = <int*>PyMem_Malloc(max(self.count, 1) * sizeof(int))
        self.positions = <Py_ssize_t*>PyMem_Malloc(max(self.count, 1) * sizeof(Py_ssize_t))
        if self.kinds == NULL or self.positions == NULL:
            raise MemoryError()
        for j in range(self.count):
            index = indexes[j]
            if not 0 <= index < self.width:
                raise ValueError(f"column index {index} out of range")
            self.positions[j] = index
            convert = self.converters[j]
            if convert in passthrough:
                self.kinds[j] = KEEP
            elif convert is int:
                self.kinds[j] = TO_INT
            elif convert is float:
                self.kinds[j] = TO_FLOAT
            else:
                self.kinds[j] = CALL

    def __dealloc__(self):
        PyMem_Free(self.kinds)
        PyMem_Free(self.positions)

    def __call__(self, tuple values):
        return self._build(values)

    cdef dict _build(self, tuple values):
        cdef Py_ssize_t j
        cdef object value
        cdef int kind
        cdef dict row = {}
        if PyTuple_GET_SIZE(values) != self.width:
            raise ValueError(f"expected {self.width} values, got {PyTuple_GET_SIZE(values)}")
        for j in range(self.count):
            value = <object>PyTuple_GET_ITEM(values, self.positions[j])
            if type(value) is str:
                kind = self.kinds[j]
                if kind == TO_INT:
                    value = PyLong_FromUnicodeObject(value, 10)
                elif kind == TO_FLOAT:
                    value = PyFloat_FromString(value)
                elif kind == CALL:
                    value = PyObject_CallOneArg(<object>PyTuple_GET_ITEM(self.converters, j),
                                                value)
            elif value is not None and type(value) is not bytes:
                raise self.slow
            PyDict_SetItem(row, <object>PyTuple_GET_ITEM(self.names, j), value)
        return row


# -- runs of row changes: CopyData -> ChangeRecord ------------------------------------------
cdef extern from "Python.h":
    bint PyBytes_CheckExact(object o)
    bint PyMemoryView_Check(object o)
    int PyObject_GetBuffer(object o, Py_buffer* view, int flags) except -1
    void PyBuffer_Release(Py_buffer* view)
    int PyBUF_SIMPLE

cdef object _INSERT = "INSERT"
cdef object _UPDATE = "UPDATE"
cdef object _DELETE = "DELETE"
cdef object _KEY_KIND = "K"
cdef object _OLD_KIND = "O"
cdef tuple _NO_COLUMNS = ()


cdef inline unsigned long long _u64(const unsigned char* p) noexcept nogil:
    return (<unsigned long long>_u32(p) << 32) | <unsigned long long>_u32(p + 4)


cdef class _Run:
    """One ``take_changes`` call: the transaction's fields and the current relation's
    builders (looked up again only when the relation changes)."""
    cdef dict tables
    cdef object record_type, commit_lsn, xid, commit_ts, unchanged
    cdef unsigned int relation_id
    cdef object relation, name, schema
    cdef RowBuilder builder, key_builder
    cdef unsigned long long wal_end  # of the last message taken

    cdef bint _use_relation(self, unsigned int relation_id) except -1:
        """Switch to ``relation_id``; False when the general path must take its changes."""
        if self.builder is not None and self.relation_id == relation_id:
            return True
        relation = relation_id
        table = self.tables.get(relation)
        if table is None:
            return False
        builder, key_builder = table.build, table.build_key
        if type(builder) is not RowBuilder or type(key_builder) is not RowBuilder:
            return False
        self.relation_id, self.relation = relation_id, relation
        self.name, self.schema = table.table, table.schema
        self.builder, self.key_builder = <RowBuilder>builder, <RowBuilder>key_builder
        return True

    cdef object row_change(self, const unsigned char* buf, Py_ssize_t size,
                           Py_ssize_t ordinal):
        """One XLogData CopyData message -> its ChangeRecord, or None (not a row change
        the compiled path can take, or anything unusual: the general path's job)."""
        cdef unsigned char tag, marker
        cdef Py_ssize_t pos = 31
        cdef object values, new = None, old = None, old_kind = None, operation
        # XLogData: 'w', Int64 wal_start, Int64 wal_end, Int64 send time; then the pgoutput
        # message: tag, Int32 relation oid, a tuple kind byte, TupleData...
        if size < 33 or buf[0] != 119:
            return None
        tag = buf[25]
        if tag != 73 and tag != 85 and tag != 68:  # 'I', 'U', 'D'
            return None
        if not self._use_relation(<unsigned int>_u32(buf + 26)):
            return None
        marker = buf[30]
        try:
            if tag == 73:  # Insert: 'N' TupleData
                if marker != 78:
                    return None
                operation = _INSERT
            else:
                if marker == 75 or marker == 79:  # 'K' key / 'O' old row
                    values = _tuple_at(buf, size, &pos, self.unchanged)
                    if values is None:
                        return None
                    if marker == 75:
                        old_kind, old = _KEY_KIND, self.key_builder._build(values)
                    else:
                        old_kind, old = _OLD_KIND, self.builder._build(values)
                    if tag == 85:  # Update: then 'N'
                        if pos >= size:
                            return None
                        marker = buf[pos]
                        pos += 1
                elif tag == 68:  # Delete: 'K' or 'O' only
                    return None
                if tag == 85:
                    if marker != 78:
                        return None
                    operation = _UPDATE
                else:
                    operation = _DELETE
            if tag != 68:
                values = _tuple_at(buf, size, &pos, self.unchanged)
                if values is None:
                    return None
                new = self.builder._build(values)
            if pos != size:
                return None
        except Exception:  # UTF-8, width, a converter, UNCHANGED_TOAST: the general path
            return None
        self.wal_end = _u64(buf + 9)
        return self.record_type(self.name, self.schema, operation, self.relation,
                                _u64(buf + 1), self.commit_lsn, self.xid, self.commit_ts,
                                ordinal, new, old, old_kind, _NO_COLUMNS)


def take_changes(list raw not None, Py_ssize_t index, dict tables not None,
                 object record_type, object commit_lsn, object xid, object commit_ts,
                 Py_ssize_t ordinal, list events not None, object unchanged):
    """``TransactionAssembler.feed(wal_start, decode_message(...))`` for a run of row
    changes (``changes.TransactionAssembler.take_changes``): from ``raw[index]`` on, every
    CopyData message (bytes, or a memoryview as psycopg hands it over) that is an XLogData
    ('w') holding a pgoutput Insert, Update or Delete of a relation in ``tables`` whose
    builders are :class:`RowBuilder` objects becomes ``record_type(...)`` (a ChangeRecord)
    appended to ``events``, ordinals counting from ``ordinal``. Stops before the first
    message that is anything else, or whose tuples or rows do not build (unchanged TOAST, a
    value a converter refuses, a wrong width, bad UTF-8): the caller's general path takes
    that one and words its errors.
    Returns ``(next index, next ordinal, highest XLogData wal_end taken or 0)``."""
    cdef Py_ssize_t count = PyList_GET_SIZE(raw)
    cdef Py_buffer view
    cdef object payload, record
    cdef unsigned long long highest = 0
    cdef _Run run = _Run()
    if index < 0:
        raise IndexError(f"take_changes: index {index} < 0")
    run.tables, run.record_type, run.unchanged = tables, record_type, unchanged
    run.commit_lsn, run.xid, run.commit_ts = commit_lsn, xid, commit_ts
    while index < count:
        payload = <object>PyList_GET_ITEM(raw, index)
        if PyBytes_CheckExact(payload):
            record = run.row_change(<const unsigned char*>PyBytes_AS_STRING(payload),
                                    PyBytes_GET_SIZE(payload), ordinal)
        elif PyMemoryView_Check(payload):
            try:  # the buffer protocol, not the view's struct: a released view raises here
                PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE)
            except Exception:
                break
            try:
                record = run.row_change(<const unsigned char*>view.buf, view.len, ordinal)
            finally:
                PyBuffer_Release(&view)
        else:
            break
        if record is None:
            break
        events.append(record)
        ordinal += 1
        if run.wal_end > highest:
            highest = run.wal_end
        index += 1
    return index, ordinal, highest


# -- temporal converters ------------------------------------------------------------------
cdef inline object _ascii(const char* source, Py_ssize_t size):
    result = PyUnicode_New(size, 127)
    memcpy(PyUnicode_DATA(result), source, size)
    return result


cdef inline bint _date_then_space(const char* chars) noexcept nogil:
    """Whether the first space is at index 10 (``YYYY-MM-DD hh:...``): the Python
    converters split at the first space, so the fast paths must not see an earlier one."""
    cdef Py_ssize_t index
    for index in range(10):
        if chars[index] == 32:
            return False
    return chars[10] == 32


cdef object _values = None


cdef object _python_values():
    """``values.py``, for the unusual inputs (BC dates, infinity, offsets other than UTC,
    non-ASCII): the compiled converters hand those to the Python originals. Imported on
    first use: values.py imports this module."""
    global _values
    if _values is None:
        from cdc_platform.protocol import values
        _values = values
    return _values


def timestamp(str text):
    """``values._timestamp``: ``2025-12-08 13:45:21.5`` -> ``2025-12-08T13:45:21.5``."""
    cdef Py_ssize_t size = PyUnicode_GET_LENGTH(text)
    cdef char* chars
    cdef char buffer[64]
    if PyUnicode_IS_COMPACT_ASCII(text) and 11 < size < 64:
        chars = <char*>PyUnicode_DATA(text)
        if _date_then_space(chars) and chars[size - 1] != 67 and chars[size - 1] != 121:  # ' ', C, y
            memcpy(buffer, chars, size)
            buffer[10] = 84  # 'T'
            return _ascii(buffer, size)
    return _python_values()._timestamp(text)


def timestamptz(str text):
    """``values._timestamptz``: ``2025-12-08 13:45:21.5+00`` -> ``2025-12-08T13:45:21.5Z``."""
    cdef Py_ssize_t size = PyUnicode_GET_LENGTH(text)
    cdef char* chars
    cdef char buffer[64]
    if PyUnicode_IS_COMPACT_ASCII(text) and 14 < size < 64:
        chars = <char*>PyUnicode_DATA(text)
        # "...+00" in UTC: the last three characters become "Z"
        if _date_then_space(chars) and chars[size - 3] == 43 and chars[size - 2] == 48 \
                and chars[size - 1] == 48:
            memcpy(buffer, chars, size - 3)
            buffer[10] = 84  # 'T'
            buffer[size - 3] = 90  # 'Z'
            return _ascii(buffer, size - 2)
    return _python_values()._timestamptz(text)


def timetz(str text):
    """``values._timetz``: ``13:45:21+02`` -> ``13:45:21+02:00``."""
    cdef Py_ssize_t size = PyUnicode_GET_LENGTH(text)
    cdef char* chars
    cdef char buffer[64]
    if PyUnicode_IS_COMPACT_ASCII(text) and 3 < size < 60:
        chars = <char*>PyUnicode_DATA(text)
        # "...+02" / "...-03": a whole-hour offset gets its minutes
        if (chars[size - 3] == 43 or chars[size - 3] == 45) and 48 <= chars[size - 2] <= 57 \
                and 48 <= chars[size - 1] <= 57 and chars[size - 4] != 58 \
                and chars[size - 4] != 43 and chars[size - 4] != 45:
            memcpy(buffer, chars, size)
            buffer[size] = 58  # ':'
            buffer[size + 1] = 48
            buffer[size + 2] = 48
            return _ascii(buffer, size + 3)
    return _python_values()._timetz(text)


# -- msgpack ------------------------------------------------------------------------------
cdef struct Buffer:
    char* data
    Py_ssize_t size
    Py_ssize_t capacity


cdef int _reserve(Buffer* out, Py_ssize_t extra) except -1:
    cdef Py_ssize_t wanted = out.size + extra
    cdef Py_ssize_t capacity
    cdef char* grown
    if wanted <= out.capacity:
        return 0
    capacity = max(wanted, out.capacity * 2)
    grown = <char*>PyMem_Realloc(out.data, capacity)
    if grown == NULL:
        raise MemoryError()
    out.data = grown
    out.capacity = capacity
    return 0


cdef inline int _put(Buffer* out, const char* data, Py_ssize_t size) except -1:
    if out.size + size > out.capacity:
        _reserve(out, size)
    memcpy(out.data + out.size, data, size)
    out.size += size
    return 0


cdef inline int _put_head(Buffer* out, unsigned char tag, unsigned long long value,
                          int width) except -1:
    """A tag byte and ``value`` as a big-endian integer of ``width`` bytes."""
    cdef unsigned char head[9]
    cdef int i
    head[0] = tag
    for i in range(width):
        head[width - i] = <unsigned char>(value >> (8 * i))
    return _put(out, <char*>head, width + 1)


cdef int _put_length(Buffer* out, Py_ssize_t size, unsigned char fix, Py_ssize_t fix_limit,
                     unsigned char tag8, unsigned char tag16, unsigned char tag32) except -1:
    if size < fix_limit:
        return _put_head(out, fix | <unsigned char>size, 0, 0)
    if tag8 and size < 256:
        return _put_head(out, tag8, size, 1)
    if size < 65536:
        return _put_head(out, tag16, size, 2)
    if size <= 0xFFFFFFFF:
        return _put_head(out, tag32, size, 4)
    raise ValueError("object too large for msgpack")


cdef int _pack(Buffer* out, object obj, int depth) except -1:
    cdef long long number
    cdef unsigned long long unsigned_number
    cdef int overflow
    cdef Py_ssize_t size, i
    cdef const char* chars
    cdef double real
    cdef PyObject* key
    cdef PyObject* value
    if depth > 500:
        return _pack_fallback(out, obj)
    if obj is None:
        return _put_head(out, 0xC0, 0, 0)
    if obj is True:
        return _put_head(out, 0xC3, 0, 0)
    if obj is False:
        return _put_head(out, 0xC2, 0, 0)
    if PyUnicode_Check(obj):
        chars = PyUnicode_AsUTF8AndSize(obj, &size)
        _put_length(out, size, 0xA0, 32, 0xD9, 0xDA, 0xDB)
        return _put(out, chars, size)
    if PyLong_Check(obj):
        number = PyLong_AsLongLongAndOverflow(obj, &overflow)
        if overflow == 0:
            return _pack_long_long(out, number)
        if overflow > 0:
            try:
                unsigned_number = PyLong_AsUnsignedLongLong(obj)
            except OverflowError:
                return _pack_fallback(out, obj)  # raises msgpack's error
            return _put_head(out, 0xCF, unsigned_number, 8)
        return _pack_fallback(out, obj)
    if PyFloat_Check(obj):
        real = PyFloat_AS_DOUBLE(obj)
        memcpy(&unsigned_number, &real, 8)
        return _put_head(out, 0xCB, unsigned_number, 8)
    if PyDict_Check(obj):
        size = PyDict_Size(obj)
        _put_length(out, size, 0x80, 16, 0, 0xDE, 0xDF)
        i = 0
        while PyDict_Next(obj, &i, &key, &value):
            _pack(out, <object>key, depth + 1)
            _pack(out, <object>value, depth + 1)
        return 0
    if PyList_Check(obj):
        size = PyList_GET_SIZE(obj)
        _put_length(out, size, 0x90, 16, 0, 0xDC, 0xDD)
        for i in range(size):
            _pack(out, <object>PyList_GET_ITEM(obj, i), depth + 1)
        return 0
    if PyTuple_Check(obj):
        size = PyTuple_GET_SIZE(obj)
        _put_length(out, size, 0x90, 16, 0, 0xDC, 0xDD)
        for i in range(size):
            _pack(out, <object>PyTuple_GET_ITEM(obj, i), depth + 1)
        return 0
    if PyBytes_Check(obj):
        size = PyBytes_GET_SIZE(obj)
        _put_length(out, size, 0, 0, 0xC4, 0xC5, 0xC6)
        return _put(out, PyBytes_AS_STRING(obj), size)
    if PyByteArray_Check(obj):
        size = PyByteArray_GET_SIZE(obj)
        _put_length(out, size, 0, 0, 0xC4, 0xC5, 0xC6)
        return _put(out, PyByteArray_AS_STRING(obj), size)
    return _pack_fallback(out, obj)


cdef int _pack_fallback(Buffer* out, object obj) except -1:
    """Whatever this writer does not know: msgpack's own packer (and its errors)."""
    cdef bytes packed = msgpack.packb(obj)
    return _put(out, PyBytes_AS_STRING(packed), PyBytes_GET_SIZE(packed))


cdef bytes _finish(Buffer* out):
    try:
        return PyBytes_FromStringAndSize(out.data, out.size)
    finally:
        PyMem_Free(out.data)
        out.data = NULL


def packb(obj):
    """``msgpack.packb(obj)``, the same bytes."""
    cdef Buffer out
    out.data = <char*>PyMem_Malloc(256)
    if out.data == NULL:
        raise MemoryError()
    out.size = 0
    out.capacity = 256
    try:
        _pack(&out, obj, 0)
    except BaseException:
        PyMem_Free(out.data)
        raise
    return _finish(&out)


def pack_map(bytes prefix, Py_ssize_t prefix_items, tuple items):
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
        _put_length(&out, prefix_items + count // 2, 0x80, 16, 0, 0xDE, 0xDF)
        _put(&out, PyBytes_AS_STRING(prefix), PyBytes_GET_SIZE(prefix))
        for i in range(count):
            _pack(&out, <object>PyTuple_GET_ITEM(items, i), 1)
    except BaseException:
        PyMem_Free(out.data)
        raise
    return _finish(&out)


# -- LSN text ---------------------------------------------------------------------------------
cdef const char* _HEX = b"0123456789ABCDEF"


cdef Py_ssize_t _put_hex(char* out, unsigned int value) noexcept:
    """``value`` in uppercase hexadecimal without leading zeros; returns the length."""
    cdef char digits[8]
    cdef Py_ssize_t count = 0, i
    while True:
        digits[count] = _HEX[value & 15]
        count += 1
        value >>= 4
        if value == 0:
            break
    for i in range(count):
        out[i] = digits[count - 1 - i]
    return count


cdef Py_ssize_t _put_lsn(char* out, unsigned long long lsn) noexcept:
    """``lsn`` as ``format_lsn`` writes it, into ``out`` (17 bytes); returns the length."""
    cdef Py_ssize_t size = _put_hex(out, <unsigned int>(lsn >> 32))
    out[size] = 47  # '/'
    size += 1
    return size + _put_hex(out + size, <unsigned int>(lsn & 0xFFFFFFFF))


def lsn_text(unsigned long long lsn):
    """``lsn.format_lsn`` for a valid LSN: ``0x16B374D848`` -> ``"16/B374D848"``."""
    cdef char text[17]
    return _ascii(text, _put_lsn(text, lsn))


# -- CDC events -----------------------------------------------------------------------------
cdef object _TRUNCATE = "TRUNCATE"
cdef object _tuple_new = tuple.__new__


cdef inline int _put_key(Buffer* out, const char* name, Py_ssize_t size) except -1:
    _put_head(out, 0xA0 | <unsigned char>size, 0, 0)  # a fixstr: every key is < 32 bytes
    return _put(out, name, size)


def change_message(record, shared_fields, type message_type):
    """``MessageBuilder._single`` with the compiled writer: ``record`` (a ChangeRecord) and
    its ``_Shared`` -> ``message_type(subject, msg_id, payload, headers)``, the payload the
    bytes of ``pack_map(shared.packed, shared.packed_count, _change_fields(record, msg_id))``
    and ``msg_id`` = ``f"{commit_lsn_text}:{ordinal}"``."""
    if not isinstance(shared_fields, tuple):  # a NamedTuple: a tuple subclass
        raise TypeError("change_message: a _Shared tuple expected")
    cdef tuple shared = <tuple>shared_fields
    cdef object subject = shared[0], commit_text = shared[1], headers = shared[2]
    cdef Py_ssize_t packed_count = shared[4]
    cdef bytes packed = shared[5]
    cdef object operation = record.operation, old = record.old, ordinal = record.ordinal
    cdef object msg_id, data
    cdef Py_ssize_t count, lsn_size
    cdef Buffer out
    cdef char text[17]
    cdef unsigned long long lsn = record.lsn
    cdef bint truncate = operation == _TRUNCATE
    if packed is None or not PyUnicode_IS_COMPACT_ASCII(commit_text) \
            or not PyLong_Check(ordinal):
        raise TypeError("change_message: packed fields, commit LSN text and ordinal expected")
    msg_id = commit_text + ":" + str(ordinal)
    data = old if operation == _DELETE else record.new
    count = packed_count + 5 + (2 if old is not None else 0) + (2 if truncate else 0)
    out.capacity = PyBytes_GET_SIZE(packed) + 512
    out.size = 0
    out.data = <char*>PyMem_Malloc(out.capacity)
    if out.data == NULL:
        raise MemoryError()
    try:
        _put_length(&out, count, 0x80, 16, 0, 0xDE, 0xDF)
        _put(&out, PyBytes_AS_STRING(packed), PyBytes_GET_SIZE(packed))
        _put_key(&out, b"lsn", 3)
        lsn_size = _put_lsn(text, lsn)
        _put_head(&out, 0xA0 | <unsigned char>lsn_size, 0, 0)
        _put(&out, text, lsn_size)
        _put_key(&out, b"ordinal", 7)
        _pack(&out, ordinal, 1)
        _put_key(&out, b"msg_id", 6)
        _pack(&out, msg_id, 1)
        _put_key(&out, b"data", 4)
        _pack(&out, data, 1)
        _put_key(&out, b"unchanged_toast", 15)
        _pack(&out, record.unchanged_toast, 1)
        if old is not None:
            _put_key(&out, b"old", 3)
            _pack(&out, old, 1)
            _put_key(&out, b"old_kind", 8)
            _pack(&out, record.old_kind, 1)
        if truncate:
            _put_key(&out, b"cascade", 7)
            _pack(&out, record.cascade, 1)
            _put_key(&out, b"restart_identity", 16)
            _pack(&out, record.restart_identity, 1)
    except BaseException:
        PyMem_Free(out.data)
        raise
    return _tuple_new(message_type, (subject, msg_id, _finish(&out), headers))


# -- snapshot rows: COPY text fields -> packed row maps ------------------------------------
# Column kinds of pack_rows; anything else is CALL (the Python converter, then _pack).
ROW_KEEP = 0  # the text is the value
ROW_INT = 1
ROW_FLOAT = 2
ROW_BOOL = 3
ROW_TIMESTAMPTZ = 4
ROW_CALL = 5

cdef extern from "Python.h":
    double PyOS_string_to_double(const char* s, char** endptr, PyObject* overflow_exception) except? -1.0


cdef int _pack_int_text(Buffer* out, const char* chars, Py_ssize_t size) except -1:
    """An ``int8``/``int4``/``int2`` as PostgreSQL prints it (``-?[0-9]{1,18}``) packed
    without a Python int; 1 when the text is anything else (the caller converts it)."""
    cdef long long value = 0
    cdef Py_ssize_t i = 0
    cdef bint negative = size > 0 and chars[0] == 45  # '-'
    if negative:
        i = 1
    if size - i < 1 or size - i > 18:
        return 1
    while i < size:
        if chars[i] < 48 or chars[i] > 57:
            return 1
        value = value * 10 + (chars[i] - 48)
        i += 1
    return _pack_long_long(out, -value if negative else value)


cdef int _pack_long_long(Buffer* out, long long number) except -1:
    if number < -32:
        if number < -32768:
            if number < -2147483648:
                return _put_head(out, 0xD3, <unsigned long long>number, 8)
            return _put_head(out, 0xD2, <unsigned long long>number, 4)
        if number < -128:
            return _put_head(out, 0xD1, <unsigned long long>number, 2)
        return _put_head(out, 0xD0, <unsigned long long>number, 1)
    if number < 128:
        return _put_head(out, <unsigned char>number, 0, 0)
    if number < 256:
        return _put_head(out, 0xCC, number, 1)
    if number < 65536:
        return _put_head(out, 0xCD, number, 2)
    if number < 4294967296:
        return _put_head(out, 0xCE, number, 4)
    return _put_head(out, 0xCF, number, 8)


cdef int _pack_ascii_timestamptz(Buffer* out, const char* chars, Py_ssize_t size) except -1:
    """``timestamptz`` of ``2025-12-08 13:45:21.5+00`` packed as ``2025-12-08T13:45:21.5Z``;
    1 when the text is not of that form."""
    cdef Py_ssize_t length = size - 2
    if not (14 < size < 64 and _date_then_space(chars) and chars[size - 3] == 43
            and chars[size - 2] == 48 and chars[size - 1] == 48):
        return 1
    _put_length(out, length, 0xA0, 32, 0xD9, 0xDA, 0xDB)
    _reserve(out, length)
    memcpy(out.data + out.size, chars, size - 3)
    out.data[out.size + 10] = 84  # 'T'
    out.data[out.size + size - 3] = 90  # 'Z'
    out.size += length
    return 0


def pack_rows(list fields, Py_ssize_t count, Py_ssize_t width, tuple packed_names,
              tuple kinds, tuple converters, object unescape):
    """``chunks.Chunker.rows_of`` + ``msgpack.packb`` of each row map, fused: ``count``
    rows of ``width`` COPY text fields each (``\\N`` is NULL; a field with a backslash is
    ``unescape``d first) -> one ``bytes`` per row, the msgpack map ``{name: value}`` of the
    first ``len(packed_names)`` fields (already packed names), typed by ``kinds`` (ROW_*)
    and ``converters``. Conversion errors propagate as the converter raised them."""
    cdef Py_ssize_t columns = PyTuple_GET_SIZE(packed_names)
    cdef Py_ssize_t row, column, size
    cdef int kind
    cdef object field, name
    cdef const char* chars
    cdef Buffer out
    cdef double real
    cdef unsigned long long bits
    cdef char* end
    cdef list result = []
    cdef int* column_kinds
    if len(fields) < count * width or columns > width or len(kinds) != columns \
            or len(converters) != columns:
        raise ValueError("pack_rows: fields, names, kinds and converters do not agree")
    column_kinds = <int*>PyMem_Malloc(max(columns, 1) * sizeof(int))
    if column_kinds == NULL:
        raise MemoryError()
    out.capacity = 256
    out.data = <char*>PyMem_Malloc(out.capacity)
    if out.data == NULL:
        PyMem_Free(column_kinds)
        raise MemoryError()
    try:
        for column in range(columns):
            column_kinds[column] = kinds[column]
        for row in range(count):
            out.size = 0
            _put_length(&out, columns, 0x80, 16, 0, 0xDE, 0xDF)
            for column in range(columns):
                name = <object>PyTuple_GET_ITEM(packed_names, column)
                _put(&out, PyBytes_AS_STRING(name), PyBytes_GET_SIZE(name))
                field = <object>PyList_GET_ITEM(fields, row * width + column)
                kind = column_kinds[column]
                chars = PyUnicode_AsUTF8AndSize(field, &size)
                if size == 2 and chars[0] == 92 and chars[1] == 78:  # \N
                    _put_head(&out, 0xC0, 0, 0)
                    continue
                if memchr(chars, 92, size) != NULL:  # an escape: decode, then convert
                    field = unescape(field)
                    chars = PyUnicode_AsUTF8AndSize(field, &size)
                    if kind != ROW_KEEP:
                        kind = ROW_CALL
                if kind == ROW_KEEP:
                    _put_length(&out, size, 0xA0, 32, 0xD9, 0xDA, 0xDB)
                    _put(&out, chars, size)
                    continue
                if kind == ROW_INT:
                    if _pack_int_text(&out, chars, size) == 0:
                        continue
                elif kind == ROW_BOOL:
                    _put_head(&out, 0xC3 if size == 1 and chars[0] == 116 else 0xC2, 0, 0)
                    continue
                elif kind == ROW_FLOAT:
                    end = NULL
                    real = PyOS_string_to_double(chars, &end, NULL)  # NULL: overflow -> +-inf, as float()
                    if end == chars + size and size > 0:
                        memcpy(&bits, &real, 8)
                        _put_head(&out, 0xCB, bits, 8)
                        continue
                elif kind == ROW_TIMESTAMPTZ:
                    if PyUnicode_IS_COMPACT_ASCII(field) and \
                            _pack_ascii_timestamptz(&out, chars, size) == 0:
                        continue
                _pack(&out, PyObject_CallOneArg(<object>PyTuple_GET_ITEM(converters, column),
                                                field), 1)
            result.append(PyBytes_FromStringAndSize(out.data, out.size))
        return result
    finally:
        PyMem_Free(out.data)
        PyMem_Free(column_kinds)


# -- NATS framing ----------------------------------------------------------------------------
cdef extern from "Python.h":
    PyObject* PyDict_GetItemWithError(object d, object key) except? NULL


cdef const char* _MSG_ID_HEADER = b"NATS/1.0\r\nNats-Msg-Id: "


cdef inline bint _printable_ascii(object text) noexcept:
    """``text.isascii() and text.isprintable()`` for a non-empty compact ASCII str."""
    cdef Py_ssize_t index, size
    cdef const unsigned char* chars
    if not PyUnicode_IS_COMPACT_ASCII(text):
        return False
    size = PyUnicode_GET_LENGTH(text)
    chars = <const unsigned char*>PyUnicode_DATA(text)
    if size == 0:
        return False
    for index in range(size):
        if chars[index] < 32 or chars[index] > 126:
            return False
    return True


def frame_messages(messages, dict subjects, dict extras, Py_ssize_t max_payload):
    """``JetStreamPublisher._frame_all`` for the common case -> ``(held, total, largest)``;
    None when a message needs the Python loop: a subject or header set not yet admitted
    (not in ``subjects`` / ``extras``), a message id that is not printable ASCII, a message
    over ``max_payload``. That loop then admits, or raises with the precise error."""
    cdef list held = []
    cdef Py_ssize_t total = 0, largest = 0, size, id_size, extra_size, header_size
    cdef PyObject* found
    cdef object subject, msg_id, headers, payload, extra, header
    cdef char* out
    if not PyList_Check(messages) and not PyTuple_Check(messages):
        return None  # an iterator: the Python loop must be able to go over it again
    for message in messages:
        if not PyTuple_Check(message) or PyTuple_GET_SIZE(message) != 4:
            return None
        found = PyDict_GetItemWithError(subjects, <object>PyTuple_GET_ITEM(message, 0))
        if found == NULL:
            return None
        subject = <object>found
        msg_id = <object>PyTuple_GET_ITEM(message, 1)
        payload = <object>PyTuple_GET_ITEM(message, 2)
        headers = <object>PyTuple_GET_ITEM(message, 3)
        if not PyUnicode_Check(msg_id) or not _printable_ascii(msg_id) \
                or not PyBytes_Check(payload) or not PyTuple_Check(headers):
            return None
        extra_size = 0
        if PyTuple_GET_SIZE(headers):
            found = PyDict_GetItemWithError(extras, headers)
            if found == NULL or not PyUnicode_Check(<object>found) \
                    or not PyUnicode_IS_COMPACT_ASCII(<object>found):
                return None
            extra = <object>found
            extra_size = PyUnicode_GET_LENGTH(extra)
        id_size = PyUnicode_GET_LENGTH(msg_id)
        # "NATS/1.0\r\nNats-Msg-Id: " id "\r\n" extra "\r\n"
        header_size = 23 + id_size + 2 + extra_size + 2
        size = header_size + PyBytes_GET_SIZE(payload)
        if size > max_payload:
            return None
        header = PyBytes_FromStringAndSize(NULL, header_size)
        out = PyBytes_AS_STRING(header)
        memcpy(out, _MSG_ID_HEADER, 23)
        memcpy(out + 23, PyUnicode_DATA(msg_id), id_size)
        out[23 + id_size] = 13
        out[24 + id_size] = 10
        if extra_size:
            memcpy(out + 25 + id_size, PyUnicode_DATA(extra), extra_size)
        out[header_size - 2] = 13
        out[header_size - 1] = 10
        held.append((subject, header, payload, message, size))
        total += size
        if size > largest:
            largest = size
    return held, total, largest


cdef inline int _put_decimal(Buffer* out, unsigned long long value) except -1:
    cdef char digits[24]
    cdef int start = 24
    while True:
        start -= 1
        digits[start] = 48 + <char>(value % 10)
        value //= 10
        if value == 0:
            break
    return _put(out, digits + start, 24 - start)


def frame_sequence(list held not None, bytes reply_prefix not None,
                   unsigned long long first_seq, bytes reply_suffix not None):
    """The NATS protocol bytes of ``held`` messages (``(subject, header or None, payload,
    ...)``) with reply subjects ``reply_prefix + str(seq) + reply_suffix``, seq counting up
    from ``first_seq``: ``HPUB subject reply header_size total_size\\r\\n header payload
    \\r\\n`` each (``PUB`` without headers). The pure twin is ``publishing.framing.
    frame_sequence``."""
    cdef Buffer out
    cdef Py_ssize_t index, count = len(held), header_size, payload_size
    cdef unsigned long long seq = first_seq
    cdef object item, subject, header, payload
    out.capacity = 4096
    out.size = 0
    out.data = <char*>PyMem_Malloc(out.capacity)
    if out.data == NULL:
        raise MemoryError()
    try:
        for index in range(count):
            item = <object>PyList_GET_ITEM(held, index)
            subject = item[0]
            header = item[1]
            payload = item[2]
            if not PyBytes_Check(subject) or not PyBytes_Check(payload) \
                    or (header is not None and not PyBytes_Check(header)):
                raise TypeError("frame_sequence: subject, header and payload must be bytes")
            payload_size = PyBytes_GET_SIZE(payload)
            if header is None:
                _put(&out, b"PUB ", 4)
            else:
                _put(&out, b"HPUB ", 5)
            _put(&out, PyBytes_AS_STRING(subject), PyBytes_GET_SIZE(subject))
            _put(&out, b" ", 1)
            _put(&out, PyBytes_AS_STRING(reply_prefix), PyBytes_GET_SIZE(reply_prefix))
            _put_decimal(&out, seq)
            _put(&out, PyBytes_AS_STRING(reply_suffix), PyBytes_GET_SIZE(reply_suffix))
            _put(&out, b" ", 1)
            if header is None:
                _put_decimal(&out, payload_size)
                _put(&out, b"\r\n", 2)
            else:
                header_size = PyBytes_GET_SIZE(header)
                _put_decimal(&out, header_size)
                _put(&out, b" ", 1)
                _put_decimal(&out, header_size + payload_size)
                _put(&out, b"\r\n", 2)
                _put(&out, PyBytes_AS_STRING(header), header_size)
            _put(&out, PyBytes_AS_STRING(payload), payload_size)
            _put(&out, b"\r\n", 2)
            seq += 1
        return PyBytes_FromStringAndSize(out.data, out.size)
    finally:
        PyMem_Free(out.data)
