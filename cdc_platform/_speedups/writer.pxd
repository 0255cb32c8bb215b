"""What the compiled twins share, inlined into each (a header, no module of its own): the
byte readers of the PostgreSQL protocol, ASCII text, LSN text, a growable buffer with a
msgpack writer that writes byte for byte what ``msgpack.packb`` writes for the types the
platform produces (anything else goes to ``msgpack.packb`` itself, errors included), and a
growable buffer for code that runs without the GIL."""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_Next
from cpython.float cimport PyFloat_AS_DOUBLE
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_AsUnsignedLongLong
from cpython.mem cimport PyMem_Free, PyMem_Realloc
from cpython.object cimport PyObject
from libc.stdlib cimport realloc
from libc.string cimport memcpy


cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object unicode, Py_ssize_t* size) except NULL
    bint PyUnicode_IS_COMPACT_ASCII(object o)
    Py_ssize_t PyUnicode_GET_LENGTH(object o)
    void* PyUnicode_DATA(object o)
    object PyUnicode_New(Py_ssize_t size, Py_UCS4 maxchar)
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
    Py_ssize_t PySequence_Fast_GET_SIZE(object o)  # a list or a tuple
    PyObject* PySequence_Fast_GET_ITEM(object o, Py_ssize_t i)


# -- PostgreSQL's big-endian integers ---------------------------------------------------------
cdef inline Py_ssize_t u32(const unsigned char* p) noexcept nogil:
    return (<Py_ssize_t>p[0] << 24) | (<Py_ssize_t>p[1] << 16) | (<Py_ssize_t>p[2] << 8) | p[3]


cdef inline unsigned long long u64(const unsigned char* p) noexcept nogil:
    return (<unsigned long long>u32(p) << 32) | <unsigned long long>u32(p + 4)


# -- text ---------------------------------------------------------------------------------------
cdef inline object ascii_text(const char* source, Py_ssize_t size):
    result = PyUnicode_New(size, 127)
    memcpy(PyUnicode_DATA(result), source, size)
    return result


cdef inline bint date_then_space(const char* chars) noexcept nogil:
    """Whether the first space is at index 10 (``YYYY-MM-DD hh:...``): the Python
    converters split at the first space, so the fast paths must not see an earlier one."""
    cdef Py_ssize_t index
    for index in range(10):
        if chars[index] == 32:
            return False
    return chars[10] == 32


cdef inline Py_ssize_t put_hex(char* out, unsigned int value) noexcept:
    """``value`` in uppercase hexadecimal without leading zeros; returns the length."""
    cdef char digits[8]
    cdef Py_ssize_t count = 0, i
    while True:
        digits[count] = b"0123456789ABCDEF"[value & 15]
        count += 1
        value >>= 4
        if value == 0:
            break
    for i in range(count):
        out[i] = digits[count - 1 - i]
    return count


cdef inline Py_ssize_t put_lsn(char* out, unsigned long long lsn) noexcept:
    """``lsn`` as ``format_lsn`` writes it, into ``out`` (17 bytes); returns the length."""
    cdef Py_ssize_t size = put_hex(out, <unsigned int>(lsn >> 32))
    out[size] = 47  # '/'
    size += 1
    return size + put_hex(out + size, <unsigned int>(lsn & 0xFFFFFFFF))


# -- a growable buffer ---------------------------------------------------------------------------
cdef struct Buffer:
    char* data
    Py_ssize_t size
    Py_ssize_t capacity


cdef inline int reserve(Buffer* out, Py_ssize_t extra) except -1:
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


cdef inline int put(Buffer* out, const char* data, Py_ssize_t size) except -1:
    if out.size + size > out.capacity:
        reserve(out, size)
    memcpy(out.data + out.size, data, size)
    out.size += size
    return 0


cdef struct RawBuffer:  # a Buffer for code without the GIL: C's malloc/realloc, free()d
    char* data
    Py_ssize_t size
    Py_ssize_t capacity


cdef inline int raw_put(RawBuffer* out, const char* data, Py_ssize_t size) noexcept nogil:
    """``data`` appended (grown as :func:`reserve` grows a Buffer); -1 when memory runs
    out."""
    cdef char* grown
    cdef Py_ssize_t capacity
    if out.size + size > out.capacity:
        capacity = max(out.capacity * 2, out.size + size)
        grown = <char*>realloc(out.data, capacity)
        if grown == NULL:
            return -1
        out.data, out.capacity = grown, capacity
    memcpy(out.data + out.size, data, size)
    out.size += size
    return 0


cdef inline int put_decimal(Buffer* out, unsigned long long value) except -1:
    cdef char digits[24]
    cdef int start = 24
    while True:
        start -= 1
        digits[start] = 48 + <char>(value % 10)
        value //= 10
        if value == 0:
            break
    return put(out, digits + start, 24 - start)


cdef inline bytes finish(Buffer* out):
    """The buffer's bytes; the buffer is freed."""
    try:
        return PyBytes_FromStringAndSize(out.data, out.size)
    finally:
        PyMem_Free(out.data)
        out.data = NULL


# -- msgpack ---------------------------------------------------------------------------------------
cdef inline int put_head(Buffer* out, unsigned char tag, unsigned long long value,
                         int width) except -1:
    """A tag byte and ``value`` as a big-endian integer of ``width`` bytes."""
    cdef unsigned char head[9]
    cdef int i
    head[0] = tag
    for i in range(width):
        head[width - i] = <unsigned char>(value >> (8 * i))
    return put(out, <char*>head, width + 1)


cdef inline int put_length(Buffer* out, Py_ssize_t size, unsigned char fix, Py_ssize_t fix_limit,
                           unsigned char tag8, unsigned char tag16,
                           unsigned char tag32) except -1:
    if size < fix_limit:
        return put_head(out, fix | <unsigned char>size, 0, 0)
    if tag8 and size < 256:
        return put_head(out, tag8, size, 1)
    if size < 65536:
        return put_head(out, tag16, size, 2)
    if size <= 0xFFFFFFFF:
        return put_head(out, tag32, size, 4)
    raise ValueError("object too large for msgpack")


cdef inline int pack_long_long(Buffer* out, long long number) except -1:
    if number < -32:
        if number < -32768:
            if number < -2147483648:
                return put_head(out, 0xD3, <unsigned long long>number, 8)
            return put_head(out, 0xD2, <unsigned long long>number, 4)
        if number < -128:
            return put_head(out, 0xD1, <unsigned long long>number, 2)
        return put_head(out, 0xD0, <unsigned long long>number, 1)
    if number < 128:
        return put_head(out, <unsigned char>number, 0, 0)
    if number < 256:
        return put_head(out, 0xCC, number, 1)
    if number < 65536:
        return put_head(out, 0xCD, number, 2)
    if number < 4294967296:
        return put_head(out, 0xCE, number, 4)
    return put_head(out, 0xCF, number, 8)


cdef inline int pack_fallback(Buffer* out, object obj) except -1:
    """Whatever this writer does not know: msgpack's own packer (and its errors)."""
    from msgpack import packb
    cdef bytes packed = packb(obj)
    return put(out, PyBytes_AS_STRING(packed), PyBytes_GET_SIZE(packed))


cdef inline int pack(Buffer* out, object obj, int depth) except -1:
    """``obj`` as ``msgpack.packb`` writes it, appended to ``out``."""
    cdef long long number
    cdef unsigned long long unsigned_number
    cdef int overflow
    cdef Py_ssize_t size, i
    cdef const char* chars
    cdef double real
    cdef PyObject* key
    cdef PyObject* value
    if depth > 1024:  # msgpack's own limit, so that both refuse the same values
        raise ValueError("recursion limit exceeded.")
    if obj is None:
        return put_head(out, 0xC0, 0, 0)
    if obj is True:
        return put_head(out, 0xC3, 0, 0)
    if obj is False:
        return put_head(out, 0xC2, 0, 0)
    if PyUnicode_Check(obj):
        chars = PyUnicode_AsUTF8AndSize(obj, &size)
        put_length(out, size, 0xA0, 32, 0xD9, 0xDA, 0xDB)
        return put(out, chars, size)
    if PyLong_Check(obj):
        number = PyLong_AsLongLongAndOverflow(obj, &overflow)
        if overflow == 0:
            return pack_long_long(out, number)
        if overflow > 0:
            try:
                unsigned_number = PyLong_AsUnsignedLongLong(obj)
            except OverflowError:
                return pack_fallback(out, obj)  # raises msgpack's error
            return put_head(out, 0xCF, unsigned_number, 8)
        return pack_fallback(out, obj)
    if PyFloat_Check(obj):
        real = PyFloat_AS_DOUBLE(obj)
        memcpy(&unsigned_number, &real, 8)
        return put_head(out, 0xCB, unsigned_number, 8)
    if PyDict_Check(obj):
        size = PyDict_Size(obj)
        put_length(out, size, 0x80, 16, 0, 0xDE, 0xDF)
        i = 0
        while PyDict_Next(obj, &i, &key, &value):
            pack(out, <object>key, depth + 1)
            pack(out, <object>value, depth + 1)
        return 0
    if PyList_Check(obj) or PyTuple_Check(obj):  # both an array
        size = PySequence_Fast_GET_SIZE(obj)
        put_length(out, size, 0x90, 16, 0, 0xDC, 0xDD)
        for i in range(size):
            pack(out, <object>PySequence_Fast_GET_ITEM(obj, i), depth + 1)
        return 0
    if PyBytes_Check(obj):
        size = PyBytes_GET_SIZE(obj)
        put_length(out, size, 0, 0, 0xC4, 0xC5, 0xC6)
        return put(out, PyBytes_AS_STRING(obj), size)
    if PyByteArray_Check(obj):
        size = PyByteArray_GET_SIZE(obj)
        put_length(out, size, 0, 0, 0xC4, 0xC5, 0xC6)
        return put(out, PyByteArray_AS_STRING(obj), size)
    return pack_fallback(out, obj)
