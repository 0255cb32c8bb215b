# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled twin of :func:`cdc_platform.mirror.chunks.decode_chunk_python` for msgpack
snapshot chunks: the row maps are read straight into tuples in column order (no dict per
row), which is most of a bootstrap's Python time. Same values as ``msgpack.unpackb`` followed
by ``operator.itemgetter(*columns)``; anything else (a row of other columns or in another
order, a type the contract never writes, truncated bytes) raises and the caller takes the pure
path, which gives the real answer or the real error.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.math cimport isnan
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy


cdef class _Reader:
    cdef const uint8_t* buf
    cdef Py_ssize_t pos
    cdef Py_ssize_t end
    cdef bytes data
    cdef bint saw_nan

    def __cinit__(self, bytes data):
        self.data = data
        self.buf = <const uint8_t*>PyBytes_AS_STRING(data)
        self.pos = 0
        self.end = PyBytes_GET_SIZE(data)
        self.saw_nan = False

    cdef inline int need(self, Py_ssize_t n) except -1:
        if n < 0 or self.pos + n > self.end:
            raise ValueError("truncated msgpack")
        return 0

    cdef inline uint64_t big_endian(self, int n) except? 0xFFFFFFFFFFFFFFFF:
        cdef uint64_t value = 0
        cdef int i
        self.need(n)
        for i in range(n):
            value = (value << 8) | self.buf[self.pos + i]
        self.pos += n
        return value

    cdef object value(self):
        cdef uint8_t tag
        cdef uint64_t bits
        cdef uint32_t bits32
        cdef double number
        cdef float number32
        self.need(1)
        tag = self.buf[self.pos]
        self.pos += 1
        if tag <= 0x7f:
            return <long>tag
        if tag >= 0xe0:
            return <long>(<int8_t>tag)
        if 0xa0 <= tag <= 0xbf:
            return self.text(tag & 0x1f)
        if 0x90 <= tag <= 0x9f:
            return self.array(tag & 0x0f)
        if 0x80 <= tag <= 0x8f:
            return self.map(tag & 0x0f)
        if tag == 0xc0:
            return None
        if tag == 0xc2:
            return False
        if tag == 0xc3:
            return True
        if tag == 0xcb:
            bits = self.big_endian(8)
            memcpy(&number, &bits, 8)
            if isnan(number):
                self.saw_nan = True
            return number
        if tag == 0xca:
            bits32 = <uint32_t>self.big_endian(4)
            memcpy(&number32, &bits32, 4)
            if isnan(number32):
                self.saw_nan = True
            return <double>number32
        if tag == 0xcc:
            return <long>self.big_endian(1)
        if tag == 0xcd:
            return <long>self.big_endian(2)
        if tag == 0xce:
            return <long long>self.big_endian(4)
        if tag == 0xcf:
            return <unsigned long long>self.big_endian(8)
        if tag == 0xd0:
            return <long>(<int8_t>self.big_endian(1))
        if tag == 0xd1:
            return <long>(<int16_t>self.big_endian(2))
        if tag == 0xd2:
            return <long>(<int32_t>self.big_endian(4))
        if tag == 0xd3:
            return <long long>(<int64_t>self.big_endian(8))
        if tag == 0xd9:
            return self.text(<Py_ssize_t>self.big_endian(1))
        if tag == 0xda:
            return self.text(<Py_ssize_t>self.big_endian(2))
        if tag == 0xdb:
            return self.text(<Py_ssize_t>self.big_endian(4))
        if tag == 0xc4:
            return self.raw(<Py_ssize_t>self.big_endian(1))
        if tag == 0xc5:
            return self.raw(<Py_ssize_t>self.big_endian(2))
        if tag == 0xc6:
            return self.raw(<Py_ssize_t>self.big_endian(4))
        if tag == 0xdc:
            return self.array(<Py_ssize_t>self.big_endian(2))
        if tag == 0xdd:
            return self.array(<Py_ssize_t>self.big_endian(4))
        if tag == 0xde:
            return self.map(<Py_ssize_t>self.big_endian(2))
        if tag == 0xdf:
            return self.map(<Py_ssize_t>self.big_endian(4))
        raise ValueError(f"msgpack type 0x{tag:02x} is not in the contract")

    cdef object text(self, Py_ssize_t size):
        self.need(size)
        out = PyUnicode_DecodeUTF8(<const char*>self.buf + self.pos, size, NULL)
        self.pos += size
        return out

    cdef object raw(self, Py_ssize_t size):
        self.need(size)
        out = self.data[self.pos:self.pos + size]
        self.pos += size
        return out

    cdef list array(self, Py_ssize_t size):
        cdef list out = []
        cdef Py_ssize_t i
        for i in range(size):
            out.append(self.value())
        return out

    cdef dict map(self, Py_ssize_t size):
        cdef dict out = {}
        cdef Py_ssize_t i
        for i in range(size):
            key = self.value()
            out[key] = self.value()
        return out

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


def decode_chunk(bytes data, tuple columns):
    """A msgpack chunk -> (its fields but ``data``, its rows as tuples in ``columns`` order,
    whether a row value is a float NaN). KeyError: a row of other columns or in another order;
    ValueError: bytes this decoder does not take (the caller decodes them the pure way)."""
    cdef _Reader reader = _Reader(data)
    cdef Py_ssize_t field_count, row_count, width, size, i, j, k
    cdef Py_ssize_t column_count = len(columns)
    cdef list names = [column.encode() for column in columns]
    cdef bytes name
    cdef dict fields = {}
    cdef list rows = None
    cdef tuple row
    if reader.end == 0 or data[0:1] in (b"{", b"["):
        raise ValueError("not msgpack")
    field_count = reader.header(0x80, 0x8f, 0xde, 0xdf)
    for i in range(field_count):
        key = reader.value()
        if key != "data":
            fields[key] = reader.value()
            continue
        row_count = reader.header(0x90, 0x9f, 0xdc, 0xdd)
        rows = []
        for j in range(row_count):
            width = reader.header(0x80, 0x8f, 0xde, 0xdf)
            if width != column_count:
                raise KeyError("a row with other columns")
            row = PyTuple_New(column_count)
            rows.append(row)  # (owned by the list: a half-built tuple is never dropped)
            for k in range(column_count):
                name = names[k]
                size = reader.text_size()
                if size != PyBytes_GET_SIZE(name):
                    raise KeyError("a row with other columns or in another order")
                reader.need(size)
                if memcmp(reader.buf + reader.pos, PyBytes_AS_STRING(name), size) != 0:
                    raise KeyError("a row with other columns or in another order")
                reader.pos += size
                value = reader.value()
                Py_INCREF(value)
                PyTuple_SET_ITEM(row, k, value)
    if reader.pos != reader.end:
        raise ValueError("bytes after the chunk")
    if rows is None:
        raise KeyError("data")
    return fields, rows, reader.saw_nan
