# cython: language_level=3, cdivision=True
"""Compiled twin of ``snapshot/chunks.py``'s msgpack rows: COPY text fields packed straight
into row maps (the same bytes as converting the fields and packing the row map); and the
same fields hashed straight into a table digest (``wire/digest.py``)."""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libc.stdlib cimport free, malloc
from libc.stdint cimport uint64_t
from libc.string cimport memchr, memcmp, memcpy

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
    RawBuffer,
    PyList_GET_ITEM,
    PyUnicode_AsUTF8AndSize,
    PyUnicode_IS_COMPACT_ASCII,
    date_then_space,
    pack,
    pack_long_long,
    put,
    put_head,
    put_length,
    raw_put,
    reserve,
)

cdef extern from "../sha256.h":
    uint64_t cdc_sha256_head64(const unsigned char* data, size_t size) nogil
    void cdc_sha256_head64_pair(const unsigned char* first, size_t first_size,
                                const unsigned char* second, size_t second_size,
                                uint64_t* first_hash, uint64_t* second_hash) nogil

cdef extern from "<locale.h>":
    ctypedef void* locale_t
    int LC_NUMERIC_MASK
    locale_t newlocale(int category_mask, const char* locale, locale_t base)

cdef extern from "<stdlib.h>":
    double strtod_l(const char* text, char** end, locale_t locale) nogil

# floats read as PostgreSQL prints them, whatever locale the process set
cdef locale_t _c_numeric = newlocale(LC_NUMERIC_MASK, b"C", NULL)
if _c_numeric == NULL:
    raise ImportError("no C locale for reading floats")

cdef extern from "Python.h":
    object PyObject_CallOneArg(object callable, object arg)
    object PyUnicode_DecodeUTF8(const char* data, Py_ssize_t size, const char* errors)
    double PyOS_string_to_double(const char* s, char** endptr,
                                 PyObject* overflow_exception) except? -1.0

# Column kinds of pack_rows; anything else is CALL (the Python converter, then _pack). As
# compile-time constants too, for the code that runs without the GIL.
DEF _KEEP = 0
DEF _INT = 1
DEF _FLOAT = 2
DEF _BOOL = 3
DEF _TIMESTAMPTZ = 4
ROW_KEEP = _KEEP  # the text is the value
ROW_INT = _INT
ROW_FLOAT = _FLOAT
ROW_BOOL = _BOOL
ROW_TIMESTAMPTZ = _TIMESTAMPTZ
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


cdef bint _canonical_int(const char* chars, Py_ssize_t size) noexcept nogil:
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


# -- the same, the GIL released ---------------------------------------------------------------
# digest_block hashes a block's rows without the GIL where every field is of a kind written in
# C alone, so that the range tasks of one process hash at once, a core each; a row with a field
# that needs Python (an escape, a converter, a float or an integer not in PostgreSQL's plain
# form) is hashed afterwards by ``_put_field``, with the GIL. Both write the same bytes.
cdef inline int _raw_sized(RawBuffer* out, const char* prefix, Py_ssize_t prefix_size, char tag,
                           const char* data, Py_ssize_t size) noexcept nogil:
    """The column's name, ``tag``, u32 ``size`` and ``data``; 1 for a size past u32 (the GIL
    path raises what the pure code raises), -1 when memory runs out."""
    cdef char head[5]
    if (<unsigned long long>size) >> 32:
        return 1
    head[0] = tag
    head[1] = <char>(size >> 24)
    head[2] = <char>(size >> 16)
    head[3] = <char>(size >> 8)
    head[4] = <char>size
    if raw_put(out, prefix, prefix_size) or raw_put(out, head, 5):
        return -1
    return raw_put(out, data, size)


cdef bint _plain_float(const char* chars, Py_ssize_t size) noexcept nogil:
    """Whether the text is ``-?[0-9]+(.[0-9]+)?([eE][+-]?[0-9]+)?``, how PostgreSQL prints a
    finite float: strtod and Python's float() read it to the same double (both round
    correctly)."""
    cdef Py_ssize_t i = 1 if size > 0 and chars[0] == 45 else 0  # '-'
    cdef Py_ssize_t digits = i
    while i < size and 48 <= chars[i] <= 57:
        i += 1
    if i == digits:
        return False
    if i < size and chars[i] == 46:  # '.'
        i += 1
        digits = i
        while i < size and 48 <= chars[i] <= 57:
            i += 1
        if i == digits:
            return False
    if i < size and (chars[i] == 101 or chars[i] == 69):  # 'e', 'E'
        i += 1
        if i < size and (chars[i] == 43 or chars[i] == 45):  # '+', '-'
            i += 1
        digits = i
        while i < size and 48 <= chars[i] <= 57:
            i += 1
        if i == digits:
            return False
    return i == size


cdef int _raw_float(RawBuffer* out, const char* prefix, Py_ssize_t prefix_size,
                    const char* chars, Py_ssize_t size) noexcept nogil:
    """A float column as ``_put_field`` writes it, for PostgreSQL's plain forms and
    ``NaN``/``Infinity``/``-Infinity``; 1 for any other text."""
    cdef double value
    cdef unsigned long long bits
    cdef char packed[9]
    cdef int i
    if size == 3 and memcmp(chars, b"NaN", 3) == 0:
        bits = 0x7FF8000000000000
    elif size == 8 and memcmp(chars, b"Infinity", 8) == 0:
        bits = 0x7FF0000000000000
    elif size == 9 and memcmp(chars, b"-Infinity", 9) == 0:
        bits = 0xFFF0000000000000
    elif size < 64 and _plain_float(chars, size):
        value = strtod_l(chars, NULL, _c_numeric)  # it stops at the tab or newline after it
        memcpy(&bits, &value, 8)
    else:
        return 1
    packed[0] = 70  # 'F'
    for i in range(8):
        packed[1 + i] = <char>(bits >> (56 - 8 * i))
    if raw_put(out, prefix, prefix_size):
        return -1
    return raw_put(out, packed, 9)


cdef int _raw_field(RawBuffer* out, const char* prefix, Py_ssize_t prefix_size,
                    const char* chars, Py_ssize_t size, int kind) noexcept nogil:
    """One COPY field's column as ``_put_field`` writes it, for the fields it writes in C
    alone; 1 for a field that needs Python, -1 when memory runs out."""
    cdef Py_ssize_t i
    if size == 2 and chars[0] == 92 and chars[1] == 78:  # \N
        return 0
    if memchr(chars, 92, size) != NULL:  # an escape
        return 1
    if kind == _KEEP:
        return _raw_sized(out, prefix, prefix_size, 83, chars, size)  # 'S'
    if kind == _INT:
        if _canonical_int(chars, size):
            return _raw_sized(out, prefix, prefix_size, 73, chars, size)  # 'I'
        return 1
    if kind == _BOOL:
        if raw_put(out, prefix, prefix_size):
            return -1
        return raw_put(out, b"I\x00\x00\x00\x011" if size == 1 and chars[0] == 116
                        else b"I\x00\x00\x00\x010", 6)
    if kind == _FLOAT:
        return _raw_float(out, prefix, prefix_size, chars, size)
    if kind == _TIMESTAMPTZ:
        # ``2025-12-08 13:45:21.5+00`` -> ``2025-12-08T13:45:21.5Z`` (as _put_field)
        if 14 < size < 64 and date_then_space(chars) and chars[size - 3] == 43 \
                and chars[size - 2] == 48 and chars[size - 1] == 48:
            for i in range(size):
                if <unsigned char>chars[i] > 127:
                    return 1
            if _raw_sized(out, prefix, prefix_size, 83, chars, size - 2):
                return -1
            out.data[out.size - (size - 2) + 10] = 84  # 'T'
            out.data[out.size - 1] = 90  # 'Z'
            return 0
    return 1


cdef struct _Shape:  # what the GIL-free pass reads of the digester and the columns
    Py_ssize_t columns
    Py_ssize_t key_width
    bint key_is_row
    Py_ssize_t* given_of_sorted
    Py_ssize_t* key_sorted
    const char** prefixes  # per sorted column
    Py_ssize_t* prefix_sizes
    int* kinds  # per given column


cdef inline void _field_starts(const char* line, Py_ssize_t* starts, Py_ssize_t width
                               ) noexcept nogil:
    """Where each field of a checked line starts, and ``starts[width]`` one past its end (as
    after a tab)."""
    cdef Py_ssize_t at = 0, index = 0
    starts[0] = 0
    while line[at] != 10:
        if line[at] == 9:
            index += 1
            starts[index] = at + 1
        at += 1
    starts[width] = at + 1


cdef int _raw_columns(RawBuffer* out, const _Shape* shape, const char* line,
                      const Py_ssize_t* starts, bint key) noexcept nogil:
    """The canonical bytes of a row's key columns (``key``) or of all its columns into
    ``out``: 0, 1 (a field needs Python) or -1 (out of memory)."""
    cdef Py_ssize_t index, sorted_index, column
    cdef int done
    out.size = 0
    for index in range(shape.key_width if key else shape.columns):
        sorted_index = shape.key_sorted[index] if key else index
        column = shape.given_of_sorted[sorted_index]
        done = _raw_field(out, shape.prefixes[sorted_index], shape.prefix_sizes[sorted_index],
                          line + starts[column], starts[column + 1] - starts[column] - 1,
                          shape.kinds[column])
        if done:
            return done
    return 0


cdef int _raw_rows(const char* chars, Py_ssize_t count, Py_ssize_t width,
                   const _Shape* shape, unsigned long long* hashes,
                   Py_ssize_t* later, Py_ssize_t* later_count) noexcept nogil:
    """The GIL-free pass over a block of ``count`` checked lines: each row's key and row
    hashes into ``hashes`` (hashed together: ``cdc_sha256_head64_pair``), or (a field needs
    Python) its index and its line's offset into ``later``; -1 when memory runs out."""
    cdef RawBuffer out, key_out
    cdef Py_ssize_t row, at = 0
    cdef Py_ssize_t* starts = <Py_ssize_t*>malloc((width + 1) * sizeof(Py_ssize_t))
    cdef const char* line
    cdef int done = 0
    out.size = key_out.size = 0
    out.capacity = key_out.capacity = 1024
    out.data = <char*>malloc(out.capacity)
    key_out.data = <char*>malloc(key_out.capacity)
    if starts == NULL or out.data == NULL or key_out.data == NULL:
        free(starts)
        free(out.data)
        free(key_out.data)
        return -1
    later_count[0] = 0
    for row in range(count):
        line = chars + at
        _field_starts(line, starts, width)
        done = 0
        if not shape.key_is_row:
            done = _raw_columns(&key_out, shape, line, starts, True)
        if not done:
            done = _raw_columns(&out, shape, line, starts, False)
        if not done:
            if shape.key_is_row:
                hashes[2 * row + 1] = cdc_sha256_head64(<const unsigned char*>out.data,
                                                        out.size)
                hashes[2 * row] = hashes[2 * row + 1]
            else:
                cdc_sha256_head64_pair(<const unsigned char*>key_out.data, key_out.size,
                                       <const unsigned char*>out.data, out.size,
                                       <uint64_t*>&hashes[2 * row],
                                       <uint64_t*>&hashes[2 * row + 1])
        if done < 0:
            break
        if done:
            later[2 * later_count[0]] = row
            later[2 * later_count[0] + 1] = at
            later_count[0] += 1
            done = 0
        at += starts[width]
    free(starts)
    free(out.data)
    free(key_out.data)
    return done


def digest_block(digest, digester, str text not None, Py_ssize_t width, tuple kinds not None,
                 tuple converters not None, object unescape):
    """``chunks.Chunker.parse`` + ``digest_fields`` fused: the rows of a block of complete
    COPY text lines hashed from the text itself (a field becomes a Python str only for a
    converter; rows whose fields C writes alone are hashed with the GIL released); the number
    of rows added, or None when the block is not ``width`` fields on every line ending with a
    newline (the pure code then parses it and says what is wrong). A converter's exception
    propagates and adds nothing."""
    cdef RowDigester compiled = digester
    cdef _Target target
    cdef _Shape shape
    cdef Py_ssize_t columns = compiled._width
    cdef Py_ssize_t size, at, count = 0, row, index, column, tabs = 0, later_count = 0
    cdef const char* chars = PyUnicode_AsUTF8AndSize(text, &size)
    cdef const char* line
    cdef Py_ssize_t* starts
    cdef Py_ssize_t* later
    cdef unsigned long long* hashes
    cdef int* column_kinds
    cdef bint malformed = False
    cdef int failed
    cdef _Out out
    if columns > width or len(kinds) != columns or len(converters) != columns:
        raise ValueError("digest_block: digester, kinds and converters do not agree")
    if size == 0:
        return 0
    if chars[size - 1] != 10:
        return None
    with nogil:
        for at in range(size):  # every line must hold width fields
            if chars[at] == 9:
                tabs += 1
            elif chars[at] == 10:
                if tabs != width - 1:
                    malformed = True
                    break
                tabs = 0
                count += 1
    if malformed:
        return None
    target = _Target(digest)
    starts = <Py_ssize_t*>PyMem_Malloc((width + 1) * sizeof(Py_ssize_t))
    column_kinds = <int*>PyMem_Malloc(max(columns, 1) * sizeof(int))
    hashes = <unsigned long long*>PyMem_Malloc(count * 2 * sizeof(unsigned long long))
    later = <Py_ssize_t*>PyMem_Malloc(count * 2 * sizeof(Py_ssize_t))
    shape.prefixes = <const char**>PyMem_Malloc(max(columns, 1) * sizeof(char*))
    shape.prefix_sizes = <Py_ssize_t*>PyMem_Malloc(max(columns, 1) * sizeof(Py_ssize_t))
    _open(&out)
    try:
        if starts == NULL or column_kinds == NULL or hashes == NULL or later == NULL \
                or shape.prefixes == NULL or shape.prefix_sizes == NULL:
            raise MemoryError()
        for column in range(columns):
            column_kinds[column] = kinds[column]
            prefix = <bytes>PyTuple_GET_ITEM(compiled._prefixes, column)
            shape.prefixes[column] = PyBytes_AS_STRING(prefix)
            shape.prefix_sizes[column] = PyBytes_GET_SIZE(prefix)
        shape.columns = columns
        shape.key_width = compiled._key_width
        shape.key_is_row = compiled._key_is_row
        shape.given_of_sorted = compiled._given_of_sorted
        shape.key_sorted = compiled._key_sorted
        shape.kinds = column_kinds
        with nogil:  # every row hashed before any is added: all or nothing
            failed = _raw_rows(chars, count, width, &shape, hashes, later, &later_count)
        if failed:
            raise MemoryError()
        for index in range(later_count):  # the rows with a field that needs Python
            row = later[2 * index]
            line = chars + later[2 * index + 1]
            _field_starts(line, starts, width)
            if not compiled._key_is_row:
                out.size = 0
                for at in range(compiled._key_width):
                    column = compiled._given_of_sorted[compiled._key_sorted[at]]
                    _put_field(&out, <bytes>PyTuple_GET_ITEM(
                        compiled._prefixes, compiled._key_sorted[at]), line + starts[column],
                        starts[column + 1] - starts[column] - 1, None, column_kinds[column],
                        <object>PyTuple_GET_ITEM(converters, column), unescape)
                hashes[2 * row] = _hash64(out.data, out.size)
            out.size = 0
            for at in range(columns):
                column = compiled._given_of_sorted[at]
                _put_field(&out, <bytes>PyTuple_GET_ITEM(compiled._prefixes, at),
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
        PyMem_Free(later)
        PyMem_Free(shape.prefixes)
        PyMem_Free(shape.prefix_sizes)
