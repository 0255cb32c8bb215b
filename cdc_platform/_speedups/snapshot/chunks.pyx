# cython: language_level=3, cdivision=True
"""Compiled twin of ``snapshot/chunks.py``'s msgpack rows: COPY text fields packed straight
into row maps (the same bytes as converting the fields and packing the row map); and the
same fields hashed straight into a table digest (``wire/digest.py``)."""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libc.string cimport memchr, memcpy

from cdc_platform._speedups.wire.digest cimport (
    RowDigester,
    _close,
    _hash64,
    _open,
    _Out,
    _put,
    _put_float,
    _put_sized,
    _put_value,
    _Target,
    _u32_at,
)
from cdc_platform._speedups.writer cimport (
    Buffer,
    PyList_GET_ITEM,
    PyUnicode_AsUTF8AndSize,
    PyUnicode_IS_COMPACT_ASCII,
    date_then_space,
    pack,
    pack_long_long,
    put,
    put_head,
    put_length,
    reserve,
)

cdef extern from "Python.h":
    object PyObject_CallOneArg(object callable, object arg)
    object PyUnicode_DecodeUTF8(const char* data, Py_ssize_t size, const char* errors)
    double PyOS_string_to_double(const char* s, char** endptr,
                                 PyObject* overflow_exception) except? -1.0

# Column kinds of pack_rows; anything else is CALL (the Python converter, then _pack).
ROW_KEEP = 0  # the text is the value
ROW_INT = 1
ROW_FLOAT = 2
ROW_BOOL = 3
ROW_TIMESTAMPTZ = 4
ROW_CALL = 5



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
    return pack_long_long(out, -value if negative else value)


cdef int _pack_ascii_timestamptz(Buffer* out, const char* chars, Py_ssize_t size) except -1:
    """``timestamptz`` of ``2025-12-08 13:45:21.5+00`` packed as ``2025-12-08T13:45:21.5Z``;
    1 when the text is not of that form."""
    cdef Py_ssize_t length = size - 2
    if not (14 < size < 64 and date_then_space(chars) and chars[size - 3] == 43
            and chars[size - 2] == 48 and chars[size - 1] == 48):
        return 1
    put_length(out, length, 0xA0, 32, 0xD9, 0xDA, 0xDB)
    reserve(out, length)
    memcpy(out.data + out.size, chars, size - 3)
    out.data[out.size + 10] = 84  # 'T'
    out.data[out.size + size - 3] = 90  # 'Z'
    out.size += length
    return 0


def pack_rows(list fields not None, Py_ssize_t count, Py_ssize_t width,
              tuple packed_names not None, tuple kinds not None, tuple converters not None,
              object unescape):
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
    cdef double real = 0
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
            put_length(&out, columns, 0x80, 16, 0, 0xDE, 0xDF)
            for column in range(columns):
                name = <object>PyTuple_GET_ITEM(packed_names, column)
                put(&out, PyBytes_AS_STRING(name), PyBytes_GET_SIZE(name))
                field = <object>PyList_GET_ITEM(fields, row * width + column)
                kind = column_kinds[column]
                chars = PyUnicode_AsUTF8AndSize(field, &size)
                if size == 2 and chars[0] == 92 and chars[1] == 78:  # \N
                    put_head(&out, 0xC0, 0, 0)
                    continue
                if memchr(chars, 92, size) != NULL:  # an escape: decode, then convert
                    field = unescape(field)
                    chars = PyUnicode_AsUTF8AndSize(field, &size)
                    if kind != ROW_KEEP:
                        kind = ROW_CALL
                if kind == ROW_KEEP:
                    put_length(&out, size, 0xA0, 32, 0xD9, 0xDA, 0xDB)
                    put(&out, chars, size)
                    continue
                if kind == ROW_INT:
                    if _pack_int_text(&out, chars, size) == 0:
                        continue
                elif kind == ROW_BOOL:
                    put_head(&out, 0xC3 if size == 1 and chars[0] == 116 else 0xC2, 0, 0)
                    continue
                elif kind == ROW_FLOAT:
                    end = NULL
                    real = PyOS_string_to_double(chars, &end, NULL)  # NULL: overflow -> +-inf, as float()
                    if end == chars + size and size > 0:
                        memcpy(&bits, &real, 8)
                        put_head(&out, 0xCB, bits, 8)
                        continue
                elif kind == ROW_TIMESTAMPTZ:
                    if PyUnicode_IS_COMPACT_ASCII(field) and \
                            _pack_ascii_timestamptz(&out, chars, size) == 0:
                        continue
                pack(&out, PyObject_CallOneArg(<object>PyTuple_GET_ITEM(converters, column),
                                                field), 1)
            result.append(PyBytes_FromStringAndSize(out.data, out.size))
        return result
    finally:
        PyMem_Free(out.data)
        PyMem_Free(column_kinds)


# -- a table digest straight from the fields ----------------------------------------------------
cdef int _put_converted(_Out* out, bytes prefix, object value) except -1:
    """The column's name and ``value`` (nothing for NULL) in the canonical bytes."""
    if value is None:
        return 0
    _put(out, PyBytes_AS_STRING(prefix), PyBytes_GET_SIZE(prefix))
    return _put_value(out, value)


cdef bint _canonical_int(const char* chars, Py_ssize_t size) noexcept:
    """Whether the text is what ``str(int(text))`` gives (``-?(0|[1-9][0-9]{0,17})``)."""
    cdef Py_ssize_t i = 1 if size > 0 and chars[0] == 45 else 0  # '-'
    if size - i < 1 or size - i > 18 or chars[i] < 48 or chars[i] > 57:
        return False
    if chars[i] == 48:
        return size - i == 1 and i == 0  # "0"; not "-0", not a leading zero
    while i < size:
        if chars[i] < 48 or chars[i] > 57:
            return False
        i += 1
    return True


cdef int _put_field(_Out* out, bytes prefix, const char* chars, Py_ssize_t size,
                    object field, int kind, object convert, object unescape) except -1:
    """One COPY field's column in the canonical bytes, as ``Chunker.columns_of`` would have
    converted it: the field's UTF-8 ``chars``, and the field itself (None: made from ``chars``
    when a converter needs it); the converter's exception when it refuses the text."""
    cdef char* end
    cdef double real = 0
    cdef char head[5]
    cdef Py_ssize_t i
    if size == 2 and chars[0] == 92 and chars[1] == 78:  # \N
        return 0
    if field is None and (kind == ROW_CALL or memchr(chars, 92, size) != NULL):
        field = PyUnicode_DecodeUTF8(chars, size, NULL)
    if memchr(chars, 92, size) != NULL:  # an escape: decode, then convert
        field = unescape(field)
        return _put_converted(out, prefix, field if kind == ROW_KEEP
                              else PyObject_CallOneArg(convert, field))
    if kind == ROW_KEEP:
        _put(out, PyBytes_AS_STRING(prefix), PyBytes_GET_SIZE(prefix))
        return _put_sized(out, 83, chars, size)  # 'S'
    if kind == ROW_INT:
        if _canonical_int(chars, size):
            _put(out, PyBytes_AS_STRING(prefix), PyBytes_GET_SIZE(prefix))
            return _put_sized(out, 73, chars, size)  # 'I': the text is the decimal
    elif kind == ROW_BOOL:
        _put(out, PyBytes_AS_STRING(prefix), PyBytes_GET_SIZE(prefix))
        return _put(out, b"I\x00\x00\x00\x011" if size == 1 and chars[0] == 116
                    else b"I\x00\x00\x00\x010", 6)
    elif kind == ROW_FLOAT:
        end = NULL
        try:
            real = PyOS_string_to_double(chars, &end, NULL)  # NULL: overflow -> +-inf, as float()
        except ValueError:  # no number at the start: the converter decides
            end = NULL
        if end == chars + size and size > 0:
            _put(out, PyBytes_AS_STRING(prefix), PyBytes_GET_SIZE(prefix))
            return _put_float(out, real)
    elif kind == ROW_TIMESTAMPTZ:
        # ``2025-12-08 13:45:21.5+00`` -> ``2025-12-08T13:45:21.5Z`` (as _pack_ascii_timestamptz)
        if 14 < size < 64 and date_then_space(chars) and chars[size - 3] == 43 \
                and chars[size - 2] == 48 and chars[size - 1] == 48:
            for i in range(size):
                if <unsigned char>chars[i] > 127:
                    break
            else:
                _put(out, PyBytes_AS_STRING(prefix), PyBytes_GET_SIZE(prefix))
                head[0] = 83  # 'S'
                _u32_at(head + 1, size - 2)
                _put(out, head, 5)
                _put(out, chars, size - 3)
                out.data[out.size - (size - 3) + 10] = 84  # 'T'
                return _put(out, b"Z", 1)
    if field is None:
        field = PyUnicode_DecodeUTF8(chars, size, NULL)
    return _put_converted(out, prefix, PyObject_CallOneArg(convert, field))


def digest_fields(digest, digester, list fields not None, Py_ssize_t count, Py_ssize_t width,
                  tuple kinds not None, tuple converters not None, object unescape):
    """``chunks.Chunker.columns_of`` + ``wire.digest.digest_columns`` fused: ``count`` rows
    of ``width`` COPY text fields each (``\\N`` is NULL; a field with a backslash is
    ``unescape``d first) added to ``digest`` by ``digester`` (the digest twin's, made with the
    first ``len(kinds)`` columns in order), typed by ``kinds`` (ROW_*) and ``converters``;
    the number of rows added. A converter's exception propagates and adds nothing."""
    cdef RowDigester compiled = digester
    cdef _Target target = _Target(digest)
    cdef Py_ssize_t columns = compiled._width
    cdef Py_ssize_t row, index, column, base, size
    cdef const char* chars
    cdef object field
    cdef unsigned long long* hashes
    cdef int* column_kinds
    cdef _Out out
    if len(fields) < count * width or columns > width or len(kinds) != columns \
            or len(converters) != columns:
        raise ValueError("digest_fields: fields, digester, kinds and converters do not agree")
    column_kinds = <int*>PyMem_Malloc(max(columns, 1) * sizeof(int))
    hashes = <unsigned long long*>PyMem_Malloc(max(count, 1) * 2 * sizeof(unsigned long long))
    if column_kinds == NULL or hashes == NULL:
        PyMem_Free(column_kinds)
        PyMem_Free(hashes)
        raise MemoryError()
    _open(&out)
    try:
        for column in range(columns):
            column_kinds[column] = kinds[column]
        for row in range(count):  # every row hashed before any is added: all or nothing
            base = row * width
            if not compiled._key_is_row:
                out.size = 0
                for index in range(compiled._key_width):
                    column = compiled._given_of_sorted[compiled._key_sorted[index]]
                    field = <object>PyList_GET_ITEM(fields, base + column)
                    chars = PyUnicode_AsUTF8AndSize(field, &size)
                    _put_field(&out, <bytes>PyTuple_GET_ITEM(
                        compiled._prefixes, compiled._key_sorted[index]), chars, size, field,
                        column_kinds[column], <object>PyTuple_GET_ITEM(converters, column),
                        unescape)
                hashes[2 * row] = _hash64(out.data, out.size)
            out.size = 0
            for index in range(columns):
                column = compiled._given_of_sorted[index]
                field = <object>PyList_GET_ITEM(fields, base + column)
                chars = PyUnicode_AsUTF8AndSize(field, &size)
                _put_field(&out, <bytes>PyTuple_GET_ITEM(compiled._prefixes, index), chars,
                           size, field, column_kinds[column],
                           <object>PyTuple_GET_ITEM(converters, column), unescape)
            hashes[2 * row + 1] = _hash64(out.data, out.size)
            if compiled._key_is_row:
                hashes[2 * row] = hashes[2 * row + 1]
        for row in range(count):
            target.add(hashes[2 * row], hashes[2 * row + 1])
        return count
    finally:
        _close(&out)
        PyMem_Free(column_kinds)
        PyMem_Free(hashes)


def digest_block(digest, digester, str text not None, Py_ssize_t width, tuple kinds not None,
                 tuple converters not None, object unescape):
    """``chunks.Chunker.parse`` + ``digest_fields`` fused: the rows of a block of complete
    COPY text lines hashed from the text itself (a field becomes a Python str only for a
    converter); the number of rows added, or None when the block is not ``width`` fields on
    every line ending with a newline (the pure code then parses it and says what is wrong).
    A converter's exception propagates and adds nothing."""
    cdef RowDigester compiled = digester
    cdef _Target target
    cdef Py_ssize_t columns = compiled._width
    cdef Py_ssize_t size, at, count = 0, row, index, column, tabs = 0
    cdef const char* chars = PyUnicode_AsUTF8AndSize(text, &size)
    cdef const char* line
    cdef Py_ssize_t* starts
    cdef unsigned long long* hashes
    cdef int* column_kinds
    cdef _Out out
    if columns > width or len(kinds) != columns or len(converters) != columns:
        raise ValueError("digest_block: digester, kinds and converters do not agree")
    if size == 0:
        return 0
    if chars[size - 1] != 10:
        return None
    for at in range(size):  # every line must hold width fields
        if chars[at] == 9:
            tabs += 1
        elif chars[at] == 10:
            if tabs != width - 1:
                return None
            tabs = 0
            count += 1
    target = _Target(digest)
    starts = <Py_ssize_t*>PyMem_Malloc((width + 1) * sizeof(Py_ssize_t))
    column_kinds = <int*>PyMem_Malloc(max(columns, 1) * sizeof(int))
    hashes = <unsigned long long*>PyMem_Malloc(count * 2 * sizeof(unsigned long long))
    if starts == NULL or column_kinds == NULL or hashes == NULL:
        PyMem_Free(starts)
        PyMem_Free(column_kinds)
        PyMem_Free(hashes)
        raise MemoryError()
    _open(&out)
    try:
        for column in range(columns):
            column_kinds[column] = kinds[column]
        at = 0
        for row in range(count):  # every row hashed before any is added: all or nothing
            line = chars + at
            index = 0
            starts[0] = 0
            while chars[at] != 10:
                if chars[at] == 9:
                    index += 1
                    starts[index] = at + 1 - (line - chars)
                at += 1
            starts[width] = at + 1 - (line - chars)  # (one past the field's end, as a tab)
            at += 1
            if not compiled._key_is_row:
                out.size = 0
                for index in range(compiled._key_width):
                    column = compiled._given_of_sorted[compiled._key_sorted[index]]
                    _put_field(&out, <bytes>PyTuple_GET_ITEM(
                        compiled._prefixes, compiled._key_sorted[index]), line + starts[column],
                        starts[column + 1] - starts[column] - 1, None, column_kinds[column],
                        <object>PyTuple_GET_ITEM(converters, column), unescape)
                hashes[2 * row] = _hash64(out.data, out.size)
            out.size = 0
            for index in range(columns):
                column = compiled._given_of_sorted[index]
                _put_field(&out, <bytes>PyTuple_GET_ITEM(compiled._prefixes, index),
                           line + starts[column], starts[column + 1] - starts[column] - 1,
                           None, column_kinds[column],
                           <object>PyTuple_GET_ITEM(converters, column), unescape)
            hashes[2 * row + 1] = _hash64(out.data, out.size)
            if compiled._key_is_row:
                hashes[2 * row] = hashes[2 * row + 1]
        for row in range(count):
            target.add(hashes[2 * row], hashes[2 * row + 1])
        return count
    finally:
        _close(&out)
        PyMem_Free(starts)
        PyMem_Free(column_kinds)
        PyMem_Free(hashes)
