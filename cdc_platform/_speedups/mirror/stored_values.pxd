"""What a compiled store (``_speedups/mirror/store.pyx``) may use of the stored-values twin:
the hashes of a stored row read back by key, at C level."""

from cdc_platform._speedups.wire.digest cimport RowDigester


cdef class StoredRowDigester:
    cdef readonly tuple columns
    cdef readonly tuple names
    cdef RowDigester _digester
    cdef Py_ssize_t _width
    cdef unsigned char* _kinds  # per column: a Kind (what its stored text may need)

    cdef int hash_stored(self, object stored, unsigned long long* key_hash,
                         unsigned long long* row_hash) except -1
