"""What ``_speedups/mirror/stored_values.pyx`` uses of the digest twin: the row digester's
C-level hashing of values already gathered, and adding hashes into a ``TableDigest``."""

from cpython.object cimport PyObject


cdef struct _Out:  # a row's canonical bytes: on the stack until they outgrow it
    char* data
    Py_ssize_t size
    Py_ssize_t capacity
    char start[1024]


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
    cdef int _gather(self, object row, PyObject** given) except -1
    cdef int _hash_row(self, object row, unsigned long long* key_hash,
                       unsigned long long* row_hash) except -1


cdef class _Target:
    cdef object digest
    cdef list totals
    cdef list counts
    cdef int bits
    cdef bint direct  # a TableDigest whose lists this module updates itself

    cdef int add(self, unsigned long long key_hash, unsigned long long row_hash) except -1
