"""What other twins use of the digest twin (``mirror/stored_values.pyx``, ``snapshot/
chunks.pyx``): the row digester's C-level hashing of values already gathered, the canonical
bytes writer, and adding hashes into a ``TableDigest``."""

from cpython.mem cimport PyMem_Free
from cpython.object cimport PyObject
from libc.string cimport memcpy


cdef struct _Out:  # a row's canonical bytes: on the stack until they outgrow it
    char* data
    Py_ssize_t size
    Py_ssize_t capacity
    char start[1024]


cdef inline void _open(_Out* out) noexcept:
    out.data = out.start
    out.size = 0
    out.capacity = sizeof(out.start)


cdef inline void _close(_Out* out) noexcept:
    if out.data != out.start:
        PyMem_Free(out.data)
    out.data = out.start


cdef int _grow(_Out* out, Py_ssize_t extra) except -1


cdef inline int _put(_Out* out, const char* data, Py_ssize_t size) except -1:
    if out.size + size > out.capacity:
        _grow(out, size)
    memcpy(out.data + out.size, data, size)
    out.size += size
    return 0


cdef inline void _u32_at(char* at, unsigned long long value) noexcept:
    at[0] = <char>(value >> 24)
    at[1] = <char>(value >> 16)
    at[2] = <char>(value >> 8)
    at[3] = <char>value


cdef int _put_sized(_Out* out, char tag, const char* data, Py_ssize_t size) except -1
cdef int _put_int64(_Out* out, long long number) except -1
cdef int _put_float(_Out* out, double value) except -1
cdef int _put_value(_Out* out, object value) except -1
cdef unsigned long long _hash64(const char* data, Py_ssize_t size) noexcept


cdef class RowDigester:
    cdef readonly tuple columns
    cdef readonly tuple key_columns
    cdef tuple _given  # the columns in the order the digester was made with
    cdef tuple _prefixes  # per sorted column: u32 name length + name
    cdef Py_ssize_t _width
    cdef Py_ssize_t _key_width
    cdef Py_ssize_t* _given_of_sorted  # sorted column -> its position in _given
    cdef Py_ssize_t* _key_sorted  # key column (sorted) -> its sorted position
    cdef bint _key_is_row

    cdef int hash_given(self, PyObject** given, unsigned long long* key_hash,
                        unsigned long long* row_hash) except -1
    cdef int _write(self, _Out* out, PyObject** given, Py_ssize_t* which,
                    Py_ssize_t count) except -1
    cdef int _gather(self, object row, PyObject** given, bint keys_only) except -1
    cdef int _hash_row(self, object row, unsigned long long* key_hash,
                       unsigned long long* row_hash) except -1


cdef class _Target:
    cdef object digest
    cdef list totals
    cdef list counts
    cdef int bits
    cdef bint direct  # a TableDigest whose lists this module updates itself

    cdef int add(self, unsigned long long key_hash, unsigned long long row_hash) except -1
