"""A function of a C library Python already loaded (SQLite for the mirror's store, libpq for
the COPY reader), found with ``dlsym`` (no headers at build time), inlined into each twin
that calls one."""

from posix.dlfcn cimport dlsym


cdef extern from "<dlfcn.h>":
    void* RTLD_DEFAULT  # (Python.h defines _GNU_SOURCE)


cdef inline void* exported(void* library, const char* name, str library_name,
                           str otherwise) except? NULL:
    """``name`` as ``library`` exports it; NULL when it does not. ImportError (saying
    ``otherwise``: what is done instead) when the process's global scope holds another
    ``name``: another copy of the library loaded ``RTLD_GLOBAL``, whose function the
    extension calling ``library`` would not be, so the two would not share one state."""
    cdef void* found = dlsym(library, name)
    if found == NULL:
        return NULL
    cdef void* in_global_scope = dlsym(RTLD_DEFAULT, name)
    if in_global_scope != NULL and in_global_scope != found:
        raise ImportError(f"{name.decode()} is in the process twice (another {library_name} "
                          f"copy): {otherwise}")
    return found
