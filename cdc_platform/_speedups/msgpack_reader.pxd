"""The shared msgpack reader of the compiled decoders (see ``msgpack_reader.pyx``)."""

from libc.stdint cimport uint8_t, uint64_t


cdef bint valid_utf8(const uint8_t* text, Py_ssize_t size) noexcept nogil


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
