"""The shared msgpack reader of the compiled decoders (see ``msgpack_reader.pyx``)."""

from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy


cdef bint valid_utf8(const uint8_t* text, Py_ssize_t size) noexcept nogil


# What a msgpack value is, by its first byte: the one switch over msgpack's tags (classify);
# Reader.head reads a value's tag and number or size, the readers go on by its kind.
cdef enum Kind:
    KIND_INT  # fixints, int 8-64: the number (int64 bits)
    KIND_UINT  # uint 8-64: the number
    KIND_NIL
    KIND_BOOL  # 0 or 1
    KIND_FLOAT32  # its 32 bits
    KIND_FLOAT64  # its 64 bits
    KIND_STR  # its size in bytes (its UTF-8 follows)
    KIND_BIN  # its size in bytes (they follow)
    KIND_ARRAY  # its count of values (they follow)
    KIND_MAP  # its count of entries (they follow, key then value)
    KIND_OTHER  # an extension type, 0xc1: never in the contract


cdef inline Kind classify(uint8_t tag, int* width, uint64_t* immediate) noexcept nogil:
    """The kind of the value whose first byte is ``tag``; ``width``: how many bytes after the
    tag hold its number or size (big-endian; an int's sign-extended from them), 0 when the
    tag itself holds it (then given in ``immediate``), -1 for KIND_OTHER."""
    width[0] = 0
    if tag <= 0x7f or tag >= 0xe0:  # positive, negative fixint
        immediate[0] = <uint64_t><int64_t><int8_t>tag
        return KIND_INT
    if tag < 0xc0:  # the fix forms of str (0xa0-0xbf), array (0x90-), map (0x80-)
        if tag >= 0xa0:
            immediate[0] = tag & 0x1f
            return KIND_STR
        immediate[0] = tag & 0x0f
        return KIND_ARRAY if tag >= 0x90 else KIND_MAP
    if tag == 0xc0:
        immediate[0] = 0
        return KIND_NIL
    if tag == 0xc2 or tag == 0xc3:
        immediate[0] = tag - 0xc2
        return KIND_BOOL
    if 0xcc <= tag <= 0xcf:
        width[0] = 1 << (tag - 0xcc)
        return KIND_UINT
    if 0xd0 <= tag <= 0xd3:
        width[0] = 1 << (tag - 0xd0)
        return KIND_INT
    if 0xd9 <= tag <= 0xdb:
        width[0] = 1 << (tag - 0xd9)
        return KIND_STR
    if 0xc4 <= tag <= 0xc6:
        width[0] = 1 << (tag - 0xc4)
        return KIND_BIN
    if tag == 0xca:
        width[0] = 4
        return KIND_FLOAT32
    if tag == 0xcb:
        width[0] = 8
        return KIND_FLOAT64
    if tag == 0xdc or tag == 0xdd:
        width[0] = 2 << (tag - 0xdc)
        return KIND_ARRAY
    if tag == 0xde or tag == 0xdf:
        width[0] = 2 << (tag - 0xde)
        return KIND_MAP
    width[0] = -1  # (nothing to read: one test of ``width`` leaves the fix forms)
    immediate[0] = 0
    return KIND_OTHER


cdef Kind not_in_the_contract(uint8_t tag) except KIND_OTHER


cdef inline double float_value(Kind kind, uint64_t bits) noexcept nogil:
    """The number of a KIND_FLOAT32 or KIND_FLOAT64 value, from the bits Reader.head gave."""
    cdef double number
    cdef float number32
    cdef uint32_t bits32
    if kind == KIND_FLOAT32:
        bits32 = <uint32_t>bits
        memcpy(&number32, &bits32, 4)
        return number32
    memcpy(&number, &bits, 8)
    return number


cdef class Reader:
    cdef const uint8_t* buf
    cdef Py_ssize_t pos
    cdef Py_ssize_t end
    cdef bytes data
    cdef bint saw_nan  # a float NaN was read
    cdef int depth  # arrays and maps open

    cdef inline int need(self, Py_ssize_t n) except -1:
        if n < 0 or self.pos + n > self.end:
            raise ValueError("truncated msgpack")
        return 0

    cdef uint64_t big_endian(self, int n) except? 0xFFFFFFFFFFFFFFFF

    cdef inline Kind head(self, uint64_t* arg) except KIND_OTHER:
        """Read the tag of the value that starts here and the bytes that hold its number or
        size: its kind (see classify), and in ``arg`` that number (an int as int64 bits, a
        float's bits, a bool's 0 or 1) or size. ValueError for a type the contract never
        writes."""
        cdef int width
        cdef uint8_t tag
        cdef Kind kind
        self.need(1)
        tag = self.buf[self.pos]
        self.pos += 1
        kind = classify(tag, &width, arg)
        if width != 0:
            if width < 0:
                return not_in_the_contract(tag)
            arg[0] = self.big_endian(width)
            if kind == KIND_INT:  # (sign-extended)
                if width == 1:
                    arg[0] = <uint64_t><int64_t><int8_t>arg[0]
                elif width == 2:
                    arg[0] = <uint64_t><int64_t><int16_t>arg[0]
                elif width == 4:
                    arg[0] = <uint64_t><int64_t><int32_t>arg[0]
        return kind

    cdef object value(self)
    cdef object text(self, Py_ssize_t size)
    cdef object raw(self, Py_ssize_t size)
    cdef int enter(self) except -1
    cdef list array(self, Py_ssize_t size)
    cdef dict map(self, Py_ssize_t size, frozenset unread=*)
    cdef object value_without(self, frozenset unread)
    cdef int skip(self) except -1
    cdef object key(self, Py_ssize_t size)
    cdef bint take_key(self, bytes name) except -1
    cdef Py_ssize_t header(self, uint8_t fix_first, uint8_t fix_last, uint8_t tag16,
                           uint8_t tag32) except -1
    cdef Py_ssize_t text_size(self) except -2
