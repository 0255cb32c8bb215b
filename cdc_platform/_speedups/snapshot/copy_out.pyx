# cython: language_level=3
"""Compiled twin of ``snapshot/copy_out.py``: CopyData messages gathered in C, the GIL
released, from psycopg's own ``PGconn`` (``pgconn.pgconn_ptr``).

The libpq functions are those of the libpq psycopg itself calls (``psycopg_binary``'s bundled
copy, ``psycopg_c``'s or the ctypes implementation's library), found with ``dlsym`` in the
library psycopg loaded (no libpq headers at build time), as the mirror's store twin finds
SQLite's. When the process's global scope holds another copy of a function (another libpq
loaded ``RTLD_GLOBAL``, which psycopg's extension would call instead), or psycopg's libpq
cannot be found, this module does not import and the pure code reads the COPY."""

import psycopg
from psycopg import pq as _pq

from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE, PyByteArray_Resize
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy
from posix.dlfcn cimport RTLD_NOW, dlopen

from cdc_platform._speedups.library cimport exported
from cdc_platform._speedups.writer cimport RawBuffer, raw_put

cdef extern from "<dlfcn.h>":
    int RTLD_NOLOAD

ctypedef int (*get_copy_data_f)(void* conn, char** buffer, int async_) noexcept nogil
ctypedef int (*consume_input_f)(void* conn) noexcept nogil
ctypedef void (*freemem_f)(void* pointer) noexcept nogil

cdef get_copy_data_f _get_copy_data = NULL
cdef consume_input_f _consume_input = NULL
cdef freemem_f _freemem = NULL

# read_copy_data's answers (copy_out.FILLED, WAIT, ENDED), and its errors
DEF _FILLED = 1
DEF _WAIT = 0
DEF _ENDED = -1
DEF _FAILED = -2  # PQgetCopyData's error
DEF _CONSUME_FAILED = -3  # PQconsumeInput's
DEF _NO_MEMORY = -4


def _libpq_path():
    """The file of the libpq psycopg calls (its extension module links it)."""
    if _pq.__impl__ == "binary":
        import psycopg_binary.pq as extension
        return extension.__file__
    if _pq.__impl__ == "c":
        import psycopg_c.pq as extension
        return extension.__file__
    from psycopg.pq import _pq_ctypes
    return _pq_ctypes.libname


cdef void* _symbol(void* library, const char* name) except NULL:
    cdef void* found = exported(library, name, "libpq", "COPY is read the pure way")
    if found == NULL:
        raise ImportError(f"psycopg's libpq does not export {name.decode()}: COPY is read "
                          "the pure way")
    return found


cdef int _find_libpq() except -1:
    global _get_copy_data, _consume_input, _freemem
    path = _libpq_path()
    # loaded already (RTLD_NOLOAD): dlsym searches it and the libraries it depends on
    cdef void* library = dlopen(str(path).encode(), RTLD_NOW | RTLD_NOLOAD)
    if library == NULL:
        raise ImportError(f"psycopg's libpq ({path}) is not loaded: COPY is read the pure way")
    _get_copy_data = <get_copy_data_f>_symbol(library, b"PQgetCopyData")
    _consume_input = <consume_input_f>_symbol(library, b"PQconsumeInput")
    _freemem = <freemem_f>_symbol(library, b"PQfreemem")
    return 0


_find_libpq()


cdef int _gather(void* conn, RawBuffer* out, Py_ssize_t wanted) noexcept nogil:
    """``read_copy_data``'s loop (its pure code, step for step) into ``out`` until it holds
    ``wanted`` bytes: _FILLED, _WAIT, _ENDED, or an error."""
    cdef char* message = NULL
    cdef int nbytes
    cdef bint consumed = False
    while True:
        nbytes = _get_copy_data(conn, &message, 1)
        if nbytes > 0:
            if raw_put(out, message, nbytes):
                _freemem(message)
                return _NO_MEMORY
            _freemem(message)
            consumed = False
            if out.size >= wanted:
                return _FILLED
        elif nbytes == -1:
            return _ENDED
        elif nbytes < 0:
            return _FAILED
        elif consumed:
            return _WAIT
        else:
            if _consume_input(conn) != 1:
                return _CONSUME_FAILED
            consumed = True


def read_copy_data(pgconn, bytearray buffer not None, Py_ssize_t limit):
    """See ``copy_out.read_copy_data``."""
    pointer = pgconn.pgconn_ptr
    # closed: libpq's answer for no connection, as psycopg's get_copy_data gets it
    cdef void* conn = NULL if pointer is None else <void*><size_t>pointer
    cdef Py_ssize_t held = PyByteArray_GET_SIZE(buffer)
    cdef RawBuffer out  # the messages of one call, before they join ``buffer``
    cdef int state
    out.size = 0
    out.capacity = max(limit - held, 65536)
    out.data = <char*>malloc(out.capacity)
    if out.data == NULL:
        raise MemoryError()
    try:
        with nogil:
            state = _gather(conn, &out, limit - held)
        if out.size:
            PyByteArray_Resize(buffer, held + out.size)
            memcpy(PyByteArray_AS_STRING(buffer) + held, out.data, out.size)
    finally:
        free(out.data)
    if state == _FAILED:
        raise psycopg.OperationalError(
            f"receiving copy data failed: {pgconn.get_error_message()}")
    if state == _CONSUME_FAILED:
        raise psycopg.OperationalError(f"consuming input failed: {pgconn.get_error_message()}")
    if state == _NO_MEMORY:
        raise MemoryError()
    return state
