"""What a compiled store (``_speedups/mirror/store.pyx``) may use of the stored-values twin:
the hashes of a stored row at C level, and what each column's stored text may need."""

from cdc_platform._speedups.wire.digest cimport RowDigester


# what a column's stored text may need (the pure ``wire_value``'s branches)
cdef enum Kind:
    KEEP = 0
    REAL = 1
    WIDE_INTEGER = 2
    ARRAY = 3
    FLOAT_ARRAY = 4
    BYTEA_ARRAY = 5


cdef class StoredRowDigester:
    cdef readonly tuple columns
    cdef readonly tuple names
    cdef RowDigester _digester
    cdef Py_ssize_t _width
    cdef unsigned char* _kinds  # per column: a Kind (what its stored text may need)

    cdef int hash_stored(self, object stored, unsigned long long* key_hash,
                         unsigned long long* row_hash) except -1
