# cython: language_level=3, boundscheck=False, wraparound=False
"""A msgpack reader over one ``bytes`` for the compiled decoders (``encoding.pyx``,
``snapshots.pyx``): the values ``msgpack.unpackb(data, raw=False, strict_map_key=False)``
gives for the types the wire contract writes; ValueError for anything else or truncated bytes
(the callers then decode the pure way, which gives the real answer or the real error)."""

from sys import intern as _intern

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.math cimport isnan
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy

DEF _KEY_SLOTS = 512  # a power of two
DEF _LONGEST_KEPT_KEY = 64
DEF _VALUE_SLOTS = 1024  # a power of two
DEF _LONGEST_KEPT_VALUE = 40
DEF _DEEPEST = 1000
cdef list _kept_keys = [None] * _KEY_SLOTS
cdef list _kept_values = [None] * _VALUE_SLOTS

cdef extern from "Python.h":
    dict _PyDict_NewPresized(Py_ssize_t minused)
    bint PyUnicode_IS_ASCII(object text)
    const void* PyUnicode_DATA(object text)
    Py_ssize_t PyUnicode_GET_LENGTH(object text)


cdef inline uint32_t _slot_hash(const uint8_t* chars, Py_ssize_t size) noexcept:
    """Where a text is kept: a hash of its length and its bytes eight at a time (up to 32 of
    them, then its first, middle and last eight). The callers compare the bytes themselves,
    so two texts in one slot only take turns; a byte at a time cost ~100 instructions a
    text."""
    cdef uint64_t word = 0
    cdef uint64_t mixed = <uint64_t>size * 0x9E3779B97F4A7C15ULL
    cdef Py_ssize_t offset
    if size < 8:
        memcpy(&word, chars, size)
        mixed ^= word * 0xC2B2AE3D27D4EB4FULL
    elif size <= 32:
        offset = 0
        while offset + 8 < size:
            memcpy(&word, chars + offset, 8)
            mixed = (mixed ^ word) * 0xC2B2AE3D27D4EB4FULL
            offset += 8
        memcpy(&word, chars + size - 8, 8)
        mixed = (mixed ^ word) * 0xC2B2AE3D27D4EB4FULL
    else:
        for offset in (0, (size - 8) // 2, size - 8):
            memcpy(&word, chars + offset, 8)
            mixed = (mixed ^ word) * 0xC2B2AE3D27D4EB4FULL
    mixed ^= mixed >> 31
    return <uint32_t>(mixed ^ (mixed >> 32))


cdef inline object _kept_text(list kept, Py_ssize_t slots, const uint8_t* chars, Py_ssize_t size,
                       bint interned):
    """The str of these UTF-8 bytes, from ``kept`` (a table of ``slots`` entries, a power of
    two, indexed by a hash of the bytes) when the one in their slot is it; else decoded (and
    interned if asked) and, if ASCII, kept there in place of the one before. Only ASCII
    strings are kept, so a kept str's characters are its UTF-8 bytes."""
    cdef uint32_t slot = _slot_hash(chars, size) & (slots - 1)
    entry = kept[slot]
    if (entry is not None and PyUnicode_GET_LENGTH(entry) == size
            and memcmp(PyUnicode_DATA(entry), chars, size) == 0):
        return entry
    out = PyUnicode_DecodeUTF8(<const char*>chars, size, NULL)
    if interned:
        out = _intern(out)
    if PyUnicode_IS_ASCII(out):
        kept[slot] = out
    return out


cdef bint valid_utf8(const uint8_t* text, Py_ssize_t size) noexcept nogil:
    """Whether Python's strict UTF-8 decoder takes these bytes: no overlong form, no
    surrogate, nothing past U+10FFFF, no cut sequence."""
    cdef Py_ssize_t i = 0
    cdef uint8_t first, second
    cdef uint64_t eight
    while i < size:
        if i + 8 <= size:  # ASCII, eight bytes at a time
            memcpy(&eight, text + i, 8)
            if eight & 0x8080808080808080ULL == 0:
                i += 8
                continue
        first = text[i]
        if first < 0x80:
            i += 1
        elif first < 0xC2:
            return False
        elif first < 0xE0:
            if i + 1 >= size or text[i + 1] & 0xC0 != 0x80:
                return False
            i += 2
        elif first < 0xF0:
            if i + 2 >= size:
                return False
            second = text[i + 1]
            if second & 0xC0 != 0x80 or text[i + 2] & 0xC0 != 0x80:
                return False
            if (first == 0xE0 and second < 0xA0) or (first == 0xED and second >= 0xA0):
                return False  # overlong; a surrogate
            i += 3
        elif first < 0xF5:
            if i + 3 >= size:
                return False
            second = text[i + 1]
            if (second & 0xC0 != 0x80 or text[i + 2] & 0xC0 != 0x80
                    or text[i + 3] & 0xC0 != 0x80):
                return False
            if (first == 0xF0 and second < 0x90) or (first == 0xF4 and second >= 0x90):
                return False  # overlong; past U+10FFFF
            i += 4
        else:
            return False
    return True


cdef Kind not_in_the_contract(uint8_t tag) except KIND_OTHER:
    """Raise the ValueError for a msgpack type the contract never writes (out of the inlined
    Reader.head: its formatting made head too big for the C compiler to inline)."""
    raise ValueError(f"msgpack type 0x{tag:02x} is not in the contract")


cdef class Reader:
    def __cinit__(self, bytes data):
        self.data = data
        self.buf = <const uint8_t*>PyBytes_AS_STRING(data)
        self.pos = 0
        self.end = PyBytes_GET_SIZE(data)
        self.saw_nan = False
        self.depth = 0

    cdef uint64_t big_endian(self, int n) except? 0xFFFFFFFFFFFFFFFF:
        cdef uint64_t value = 0
        cdef int i
        self.need(n)
        for i in range(n):
            value = (value << 8) | self.buf[self.pos + i]
        self.pos += n
        return value

    cdef object value(self):
        cdef uint64_t arg
        cdef Kind kind = self.head(&arg)
        cdef double number
        if kind == KIND_STR:
            return self.text(<Py_ssize_t>arg)
        elif kind == KIND_INT:
            return <long long><int64_t>arg
        elif kind == KIND_MAP:
            return self.map(<Py_ssize_t>arg)
        elif kind == KIND_ARRAY:
            return self.array(<Py_ssize_t>arg)
        elif kind == KIND_NIL:
            return None
        elif kind == KIND_BOOL:
            return arg != 0
        elif kind == KIND_FLOAT64 or kind == KIND_FLOAT32:
            number = float_value(kind, arg)
            if isnan(number):
                self.saw_nan = True
            return number
        elif kind == KIND_UINT:
            return <unsigned long long>arg
        else:  # (KIND_BIN: head() raised for the rest)
            return self.raw(<Py_ssize_t>arg)

    cdef object text(self, Py_ssize_t size):
        """A str value. Short ASCII ones are kept and handed out again (a str is immutable):
        most of an event's text repeats from the event before (table, operation, subject,
        fingerprint, commit LSN and time)."""
        cdef const uint8_t* chars
        self.need(size)
        chars = self.buf + self.pos
        if size > _LONGEST_KEPT_VALUE:
            out = PyUnicode_DecodeUTF8(<const char*>chars, size, NULL)
        else:
            out = _kept_text(_kept_values, _VALUE_SLOTS, chars, size, False)
        self.pos += size
        return out

    cdef object raw(self, Py_ssize_t size):
        self.need(size)
        out = self.data[self.pos:self.pos + size]
        self.pos += size
        return out

    cdef int enter(self) except -1:
        # a C stack has no recursion check: a forged payload nested a million deep would
        # crash the process (msgpack itself stops at 1024 too)
        self.depth += 1
        if self.depth > _DEEPEST:
            raise ValueError("msgpack nested too deep")
        return 0

    cdef list array(self, Py_ssize_t size):
        cdef list out = []
        cdef Py_ssize_t i
        self.enter()
        for i in range(size):
            out.append(self.value())
        self.depth -= 1
        return out

    cdef dict map(self, Py_ssize_t size, frozenset unread=None):
        """A map; ``unread``: keys whose entries are left out (their values read past with
        skip(), not made)."""
        # sized for its entries at once (an event's 15 would resize a new dict twice), up to
        # 32: maps nested in a forged payload each claiming millions would all be alive at
        # once (a few hundred of them took a gigabyte)
        cdef dict out = _PyDict_NewPresized(min(size, 32, (self.end - self.pos) // 2))
        cdef Py_ssize_t i, key_size
        self.enter()
        for i in range(size):
            key_size = self.text_size()
            key = self.key(key_size) if key_size >= 0 else self.value()
            # (an unhashable key raises TypeError in the test as in the assignment)
            if unread is not None and key in unread:
                self.skip()
            else:
                out[key] = self.value()
        self.depth -= 1
        return out

    cdef object value_without(self, frozenset unread):
        """value(); a map without the entries whose key is in ``unread``."""
        cdef uint64_t arg
        cdef int width
        self.need(1)
        if classify(self.buf[self.pos], &width, &arg) != KIND_MAP:
            return self.value()
        self.head(&arg)
        return self.map(<Py_ssize_t>arg, unread)

    cdef int skip(self) except -1:
        """Read past the value that starts here, refusing what value() refuses: text (checked
        as Python's strict UTF-8 decoder checks it), bytes, arrays and maps are not made; a
        float NaN is noted as value() notes it."""
        cdef uint64_t arg
        cdef Kind kind = self.head(&arg)
        cdef Py_ssize_t size = <Py_ssize_t>arg
        cdef Py_ssize_t i
        if kind == KIND_STR:
            self.need(size)
            if not valid_utf8(self.buf + self.pos, size):
                raise ValueError("text that is not UTF-8")
            self.pos += size
        elif kind == KIND_BIN:
            self.need(size)
            self.pos += size
        elif kind == KIND_ARRAY or kind == KIND_MAP:
            self.enter()
            for i in range(size):
                if kind == KIND_MAP:
                    hash(self.value())  # (a key must be hashable, as in map())
                self.skip()
            self.depth -= 1
        elif kind == KIND_FLOAT64 or kind == KIND_FLOAT32:
            if isnan(float_value(kind, arg)):
                self.saw_nan = True
        return 0

    cdef object key(self, Py_ssize_t size):
        """A str map key: the same few names come in every event and row, so each ASCII one
        is decoded once and kept, interned (its hash cached)."""
        self.need(size)
        if size > _LONGEST_KEPT_KEY:
            return self.text(size)
        text = _kept_text(_kept_keys, _KEY_SLOTS, self.buf + self.pos, size, True)
        self.pos += size
        return text

    cdef bint take_key(self, bytes name) except -1:
        """Whether the str that starts here is ``name`` (UTF-8); read past it if so."""
        cdef Py_ssize_t size = self.text_size()
        if size != PyBytes_GET_SIZE(name):
            return False
        self.need(size)
        if memcmp(self.buf + self.pos, PyBytes_AS_STRING(name), size) != 0:
            return False
        self.pos += size
        return True

    cdef Py_ssize_t header(self, uint8_t fix_first, uint8_t fix_last, uint8_t tag16,
                           uint8_t tag32) except -1:
        """The size of the map or array that starts here."""
        cdef uint8_t tag
        self.need(1)
        tag = self.buf[self.pos]
        self.pos += 1
        if fix_first <= tag <= fix_last:
            return tag & 0x0f
        if tag == tag16:
            return <Py_ssize_t>self.big_endian(2)
        if tag == tag32:
            return <Py_ssize_t>self.big_endian(4)
        raise ValueError("not the map or array the contract says")

    cdef Py_ssize_t text_size(self) except -2:
        """The size of the str that starts here; -1 (nothing read) when it is not a str."""
        cdef uint8_t tag
        self.need(1)
        tag = self.buf[self.pos]
        if 0xa0 <= tag <= 0xbf:
            self.pos += 1
            return tag & 0x1f
        if tag == 0xd9 or tag == 0xda or tag == 0xdb:
            self.pos += 1
            return <Py_ssize_t>self.big_endian(1 if tag == 0xd9 else (2 if tag == 0xda else 4))
        return -1
