# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled twin of ``mirror/store.py``'s bulk load of one msgpack snapshot chunk.

The pure path decodes a chunk into Python tuples and hands them to ``sqlite3``'s
``executemany``; here each value goes from the chunk's bytes straight to ``sqlite3_bind_*``
(no Python object per value) on a connection of the loader's own, one SQLite transaction per
chunk. A bootstrap spends most of its time there (issue 12: 2-3x the pure path).

What it binds is what the pure path binds: nil -> NULL, bool -> 0/1, an integer within 64
bits, a float that is not NaN, str (strict UTF-8, as Python decodes it), bin. Anything else
(NaN, an integer past 64 bits, an array or a map, a row of other columns, bytes the contract
never writes) and any SQLite error (a duplicate key, a busy database) hands the whole chunk
back, rolled back, to the pure path, which gives the real answer or the real error.

The SQLite functions are the ones Python's own ``_sqlite3`` uses, found in it with ``dlsym``
(no SQLite headers at build time): two copies of SQLite in one process could drop each other's
POSIX locks on the file and corrupt it (sqlite.org/howtocorrupt.html, 2.2). ``_sqlite3`` binds
a name to the process's global scope first (the executable, ``LD_PRELOAD``, ``RTLD_GLOBAL``
libraries), then to its own libraries: a function found in the global scope at another
address than in ``_sqlite3``'s may be another copy, and then, as when ``_sqlite3`` does not
export them (SQLite linked into it privately), this module does not import and the pure path
loads every chunk.

SQLite runs without the GIL (a lock wait must not stop the thread that holds the lock); a
loader is used by one thread at a time.
"""

import _sqlite3
import secrets
import sqlite3
import threading

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_GetItemWithError, PyDict_Size
from cpython.float cimport PyFloat_AS_DOUBLE
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_XDECREF
from cpython.long cimport (
    PyLong_AsLongLong,
    PyLong_AsLongLongAndOverflow,
    PyLong_AsUnsignedLongLong,
    PyLong_FromUnsignedLongLong,
)
from cpython.mem cimport PyMem_Calloc, PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.unicode cimport PyUnicode_AsUTF8AndSize, PyUnicode_DecodeUTF8
from libc.math cimport isnan
from libc.string cimport memcmp, memcpy, memset, strcmp
from libc.stdint cimport int64_t, uint8_t, uint64_t
from posix.dlfcn cimport RTLD_NOW, dlopen

from cdc_platform._speedups.library cimport exported
from cdc_platform._speedups.mirror.stored_values cimport KEEP, StoredRowDigester
from cdc_platform._speedups.msgpack_reader cimport (
    KIND_BIN,
    KIND_BOOL,
    KIND_FLOAT32,
    KIND_FLOAT64,
    KIND_INT,
    KIND_NIL,
    KIND_STR,
    KIND_UINT,
    Kind,
    Reader,
    float_value,
    valid_utf8,
)
from cdc_platform._speedups.wire.digest cimport (
    RowDigester,
    _close,
    _hash64,
    _open,
    _Out,
    _put,
    _put_float,
    _put_int64,
    _put_sized,
)

cdef extern from "../sha256.h":
    void cdc_sha256_head64_pair(const unsigned char* first, size_t first_size,
                                const unsigned char* second, size_t second_size,
                                uint64_t* first_hash, uint64_t* second_hash) nogil

# The stable SQLite C API (sqlite.org/c3ref), declared here rather than from sqlite3.h.
ctypedef void (*destructor)(void*) noexcept
ctypedef int (*open_v2_f)(const char*, void**, int, const char*) noexcept nogil
ctypedef int (*db_f)(void*) noexcept nogil
ctypedef int (*busy_timeout_f)(void*, int) noexcept nogil
ctypedef int (*exec_f)(void*, const char*, void*, void*, char**) noexcept nogil
ctypedef int (*prepare_v2_f)(void*, const char*, int, void**, const char**) noexcept nogil
ctypedef int (*stmt_f)(void*) noexcept nogil
ctypedef int (*bind_int64_f)(void*, int, long long) noexcept nogil
ctypedef int (*bind_double_f)(void*, int, double) noexcept nogil
ctypedef int (*bind_bytes_f)(void*, int, const char*, int, destructor) noexcept nogil
ctypedef int (*bind_null_f)(void*, int) noexcept nogil
ctypedef const char* (*errmsg_f)(void*) noexcept nogil
ctypedef const char* (*db_filename_f)(void*, const char*) noexcept nogil
ctypedef int (*auto_extension_f)(void (*)() noexcept nogil) noexcept nogil
ctypedef void (*set_rowid_f)(void*, long long) noexcept nogil
ctypedef long long (*rowid_f)(void*) noexcept nogil
ctypedef void (*function_f)(void*, int, void**) noexcept
ctypedef int (*create_function_f)(void*, const char*, int, int, void*, function_f, function_f,
                                  void (*)(void*) noexcept, destructor) noexcept nogil
ctypedef int (*value_int_f)(void*) noexcept nogil
ctypedef long long (*value_int64_f)(void*) noexcept nogil
ctypedef double (*value_double_f)(void*) noexcept nogil
ctypedef const void* (*value_pointer_f)(void*) noexcept nogil
ctypedef void* (*user_data_f)(void*) noexcept nogil
ctypedef void (*result_blob_f)(void*, const void*, int, destructor) noexcept nogil
ctypedef void (*result_error_f)(void*, const char*, int) noexcept nogil
ctypedef long long (*column_int64_f)(void*, int) noexcept nogil
ctypedef const void* (*column_blob_f)(void*, int) noexcept nogil
ctypedef int (*column_int_f)(void*, int) noexcept nogil
ctypedef void (*preupdate_f)(void*, void*, int, const char*, const char*, long long,
                             long long) noexcept
ctypedef void* (*preupdate_hook_f)(void*, preupdate_f, void*) noexcept nogil
ctypedef int (*preupdate_value_f)(void*, int, void**) noexcept nogil

cdef struct SqliteApi:
    open_v2_f open_v2
    db_f close_v2
    busy_timeout_f busy_timeout
    exec_f exec_
    prepare_v2_f prepare_v2
    stmt_f finalize
    stmt_f step
    stmt_f reset
    stmt_f clear_bindings
    stmt_f bind_parameter_count
    bind_int64_f bind_int64
    bind_double_f bind_double
    bind_bytes_f bind_text
    bind_bytes_f bind_blob
    bind_null_f bind_null
    db_f get_autocommit
    errmsg_f errmsg
    db_f changes
    db_filename_f db_filename
    auto_extension_f auto_extension
    auto_extension_f cancel_auto_extension
    set_rowid_f set_last_insert_rowid
    rowid_f last_insert_rowid
    create_function_f create_function_v2
    value_int_f value_type
    value_int64_f value_int64
    value_double_f value_double
    value_pointer_f value_text
    value_pointer_f value_blob
    value_int_f value_bytes
    user_data_f user_data
    result_blob_f result_blob
    result_error_f result_error
    column_int64_f column_int64
    column_blob_f column_blob
    column_int_f column_bytes
    # (NULL: this SQLite is built without SQLITE_ENABLE_PREUPDATE_HOOK)
    preupdate_hook_f preupdate_hook
    preupdate_value_f preupdate_old
    preupdate_value_f preupdate_new

DEF SQLITE_OK = 0
DEF SQLITE_ROW = 100
DEF SQLITE_DONE = 101
DEF SQLITE_OPEN_READWRITE = 0x02
DEF INT_MAX = 2147483647
DEF SQLITE_UTF8 = 1
DEF SQLITE_INTEGER = 1
DEF SQLITE_FLOAT = 2
DEF SQLITE_TEXT = 3
DEF SQLITE_BLOB = 4
DEF SQLITE_NULL = 5

cdef SqliteApi api


cdef void* _symbol(void* library, const char* name, bint required=True) except? NULL:
    cdef void* found = exported(library, name, "SQLite", "the mirror loads snapshots the pure way")
    if found == NULL and required:
        raise ImportError(f"Python's _sqlite3 does not export {name.decode()}: the mirror "
                          "loads snapshots the pure way")
    return found


cdef int _find_sqlite() except -1:
    path = getattr(_sqlite3, "__file__", None)
    if path is None:
        raise ImportError("_sqlite3 is built into Python: no SQLite library to share")
    cdef void* library = dlopen(path.encode(), RTLD_NOW)  # already loaded: the same copy
    if library == NULL:
        raise ImportError(f"cannot dlopen {path}")
    api.open_v2 = <open_v2_f>_symbol(library, b"sqlite3_open_v2")
    api.close_v2 = <db_f>_symbol(library, b"sqlite3_close_v2")
    api.busy_timeout = <busy_timeout_f>_symbol(library, b"sqlite3_busy_timeout")
    api.exec_ = <exec_f>_symbol(library, b"sqlite3_exec")
    api.prepare_v2 = <prepare_v2_f>_symbol(library, b"sqlite3_prepare_v2")
    api.finalize = <stmt_f>_symbol(library, b"sqlite3_finalize")
    api.step = <stmt_f>_symbol(library, b"sqlite3_step")
    api.reset = <stmt_f>_symbol(library, b"sqlite3_reset")
    api.clear_bindings = <stmt_f>_symbol(library, b"sqlite3_clear_bindings")
    api.bind_parameter_count = <stmt_f>_symbol(library, b"sqlite3_bind_parameter_count")
    api.bind_int64 = <bind_int64_f>_symbol(library, b"sqlite3_bind_int64")
    api.bind_double = <bind_double_f>_symbol(library, b"sqlite3_bind_double")
    api.bind_text = <bind_bytes_f>_symbol(library, b"sqlite3_bind_text")
    api.bind_blob = <bind_bytes_f>_symbol(library, b"sqlite3_bind_blob")
    api.bind_null = <bind_null_f>_symbol(library, b"sqlite3_bind_null")
    api.get_autocommit = <db_f>_symbol(library, b"sqlite3_get_autocommit")
    api.errmsg = <errmsg_f>_symbol(library, b"sqlite3_errmsg")
    api.changes = <db_f>_symbol(library, b"sqlite3_changes")
    api.db_filename = <db_filename_f>_symbol(library, b"sqlite3_db_filename")
    api.auto_extension = <auto_extension_f>_symbol(library, b"sqlite3_auto_extension")
    api.cancel_auto_extension = <auto_extension_f>_symbol(library,
                                                          b"sqlite3_cancel_auto_extension")
    api.set_last_insert_rowid = <set_rowid_f>_symbol(library, b"sqlite3_set_last_insert_rowid")
    api.last_insert_rowid = <rowid_f>_symbol(library, b"sqlite3_last_insert_rowid")
    api.create_function_v2 = <create_function_f>_symbol(library,
                                                         b"sqlite3_create_function_v2")
    api.value_type = <value_int_f>_symbol(library, b"sqlite3_value_type")
    api.value_int64 = <value_int64_f>_symbol(library, b"sqlite3_value_int64")
    api.value_double = <value_double_f>_symbol(library, b"sqlite3_value_double")
    api.value_text = <value_pointer_f>_symbol(library, b"sqlite3_value_text")
    api.value_blob = <value_pointer_f>_symbol(library, b"sqlite3_value_blob")
    api.value_bytes = <value_int_f>_symbol(library, b"sqlite3_value_bytes")
    api.user_data = <user_data_f>_symbol(library, b"sqlite3_user_data")
    api.result_blob = <result_blob_f>_symbol(library, b"sqlite3_result_blob")
    api.result_error = <result_error_f>_symbol(library, b"sqlite3_result_error")
    api.column_int64 = <column_int64_f>_symbol(library, b"sqlite3_column_int64")
    api.column_blob = <column_blob_f>_symbol(library, b"sqlite3_column_blob")
    api.column_bytes = <column_int_f>_symbol(library, b"sqlite3_column_bytes")
    api.preupdate_hook = <preupdate_hook_f>_symbol(library, b"sqlite3_preupdate_hook", False)
    api.preupdate_old = <preupdate_value_f>_symbol(library, b"sqlite3_preupdate_old", False)
    api.preupdate_new = <preupdate_value_f>_symbol(library, b"sqlite3_preupdate_new", False)
    return 0


_find_sqlite()


cdef class ChunkLoader:
    """Loads one table's msgpack snapshot chunks into the SQLite file at ``path`` with
    ``statement`` (an INSERT of ``columns`` in that order), on a connection of its own."""

    cdef void* db
    cdef void* statement
    cdef list names  # the columns, UTF-8, in order
    cdef Py_ssize_t width
    cdef bint loading  # (close() must not finalize a statement SQLite is running)
    cdef _RowHashes rows  # the rows' hashes as they are stored (hash_rows), or None

    def __cinit__(self):
        self.db = NULL
        self.statement = NULL
        self.loading = False

    def __init__(self, str path not None, str statement not None, tuple columns not None,
                 double timeout=5.0, int checkpoint_pages=16384):
        if not 0 <= timeout <= 86400:
            raise ValueError(f"timeout {timeout} s")
        if checkpoint_pages < 0:
            raise ValueError(f"checkpoint_pages {checkpoint_pages}")
        self.names = [column.encode() for column in columns]
        self.width = len(columns)
        if api.open_v2(path.encode(), &self.db, SQLITE_OPEN_READWRITE, NULL) != SQLITE_OK:
            self._fail("open")
        api.busy_timeout(self.db, <int>(timeout * 1000))
        # as the store's own connection (WAL is a property of the file)
        if api.exec_(self.db, b"PRAGMA synchronous=NORMAL", NULL, NULL, NULL) != SQLITE_OK:
            self._fail("PRAGMA synchronous")
        # A bootstrap commits a chunk at a time: with SQLite's default (a checkpoint, and its
        # fsyncs, once the WAL holds 1,000 pages) a 1M-row load took ~30 % longer.
        # close() checkpoints what is left.
        if api.exec_(self.db, f"PRAGMA wal_autocheckpoint={checkpoint_pages}".encode(), NULL,
                     NULL, NULL) != SQLITE_OK:
            self._fail("PRAGMA wal_autocheckpoint")
        if api.prepare_v2(self.db, statement.encode(), -1, &self.statement, NULL) != SQLITE_OK:
            self._fail("prepare")
        if api.bind_parameter_count(self.statement) != self.width:
            self.close()
            raise ValueError("the statement does not bind one value per column")

    cdef int _fail(self, str what) except -1:
        message = "out of memory" if self.db == NULL else api.errmsg(self.db).decode(
            errors="replace")
        self.close()
        raise ValueError(f"SQLite {what}: {message}")

    def close(self):
        if self.loading:
            raise ValueError("the loader is loading a chunk")
        if self.rows is not None:
            self.rows._unhook()  # (while the handle is open)
            self.rows = None
        if self.statement != NULL:
            api.finalize(self.statement)
            self.statement = NULL
        if self.db != NULL:
            # the WAL back to nothing, unless readers are in the way (then the store's own
            # checkpoints go on with it): a short wait, errors ignored
            api.busy_timeout(self.db, 100)
            self._execute(b"PRAGMA wal_checkpoint(TRUNCATE)")
            api.close_v2(self.db)
            self.db = NULL

    def __dealloc__(self):
        self.loading = False  # (no load() runs: it holds a reference)
        self.close()

    def hash_rows(self, str table not None, long long table_id, digester not None,
                  hasher not None):
        """Hash each row as it is stored, from SQLite's preupdate hook on the loader's
        handle, as the store's ``Statements.hook_rows`` does (``digester``: the table's
        ``StoredRowDigester`` under ``table_id``; ``hasher``: the digests' ``_RowHasher``):
        :meth:`hashes` gives a loaded chunk's. False: this SQLite has no preupdate hook."""
        cdef _RowHashes rows
        if self.db == NULL:
            raise ValueError("the loader is closed")
        rows = _hooked_rows(self.db, None, hasher)
        if rows is None:
            return False
        rows.follow(table, table_id, digester)
        self.rows = rows
        return True

    def hashes(self):
        """The packed (key hash, row hash) of each row the last chunk loaded, once (with
        :meth:`hash_rows`; else empty)."""
        cdef Py_ssize_t index
        cdef int shift
        cdef _Change* change
        cdef unsigned char packed[16]
        found = []
        if self.rows is None:
            return found
        self.rows._resolve()
        for index in range(self.rows.count):
            change = &self.rows.changes[index]
            for shift in range(8):
                packed[shift] = <unsigned char>(change.key_hash >> (56 - 8 * shift))
                packed[8 + shift] = <unsigned char>(change.row_hash >> (56 - 8 * shift))
            found.append(PyBytes_FromStringAndSize(<char*>packed, 16))
        self.rows.clear()
        return found

    def load(self, bytes data not None, set seen not None):
        """One chunk, in one SQLite transaction: (its ``chunk`` number, rows inserted). None:
        nothing written, the pure path decides: a chunk this loader does not take, one SQLite
        refused (the pure path gives the error), one whose number is in ``seen`` (a chunk
        stored twice, which the pure path skips), one a row of which could not be hashed
        (:meth:`hash_rows`)."""
        if self.db == NULL:
            raise ValueError("the loader is closed")
        if self.loading:
            raise ValueError("the loader is loading a chunk")
        cdef Reader reader = Reader(data)
        cdef Py_ssize_t field_count, i
        cdef Py_ssize_t rows = -1
        cdef dict fields = {}
        if reader.end == 0 or data[0:1] in (b"{", b"[") or _adapters_in_use():
            return None  # JSON; values Python's sqlite3 would adapt
        self.loading = True
        if self.rows is not None:
            self.rows.clear()
        try:
            if not self._execute(b"BEGIN IMMEDIATE"):
                return None
            field_count = reader.header(0x80, 0x8f, 0xde, 0xdf)
            for i in range(field_count):
                key = reader.value()
                if key != "data":
                    fields[key] = reader.value()
                elif rows >= 0 or fields.get("chunk") in seen:
                    # "data" twice (the pure path keeps the last); a chunk already loaded
                    return self._refuse()
                else:
                    rows = self._insert_rows(reader)
                    if rows < 0:
                        return self._refuse()
            number = fields.get("chunk")
            if (reader.pos != reader.end or rows < 0 or type(number) is not int
                    or number in seen or self.rows is not None and self.rows.failed is not None):
                return self._refuse()
            if not self._execute(b"COMMIT"):
                return self._refuse()
            return number, rows
        except (ValueError, KeyError, TypeError):  # what the reader does not take
            return self._refuse()
        except BaseException:
            self._rollback()
            raise
        finally:
            api.clear_bindings(self.statement)  # (they point into ``data``)
            self.loading = False

    cdef bint _execute(self, const char* sql) noexcept:
        cdef int code
        with nogil:  # (BEGIN may wait for a lock; COMMIT may checkpoint)
            code = api.exec_(self.db, sql, NULL, NULL, NULL)
        return code == SQLITE_OK

    cdef object _refuse(self):
        self._rollback()
        return None

    cdef void _rollback(self) noexcept:
        api.reset(self.statement)
        if not api.get_autocommit(self.db):
            self._execute(b"ROLLBACK")
        if self.rows is not None:  # (nothing stored)
            self.rows.count = 0
            self.rows.failed = None

    cdef Py_ssize_t _insert_rows(self, Reader reader) except -2:
        """Every row of the ``data`` array that starts here; -1: one the loader does not take
        (or SQLite refused)."""
        cdef Py_ssize_t row_count = reader.header(0x90, 0x9f, 0xdc, 0xdd)
        cdef Py_ssize_t row, k
        cdef int code
        for row in range(row_count):
            if reader.header(0x80, 0x8f, 0xde, 0xdf) != self.width:
                return -1
            for k in range(self.width):
                if not reader.take_key(<bytes>self.names[k]):
                    return -1
                if not self._bind(reader, <int>(k + 1)):
                    return -1
            if self.rows is not None:  # (the hook hashes with the GIL: held, not taken per row)
                code = api.step(self.statement)
            else:
                with nogil:
                    code = api.step(self.statement)
            if code != SQLITE_DONE:
                return -1
            api.reset(self.statement)
        return row_count

    cdef bint _bind(self, Reader reader, int index) except -1:
        """Bind the value that starts here to parameter ``index``; False: not one of the
        values this loader binds (see the module docstring)."""
        cdef uint64_t arg
        cdef Kind kind = reader.head(&arg)
        cdef double number
        if kind == KIND_STR:
            return self._bind_text(reader, index, <Py_ssize_t>arg)
        elif kind == KIND_INT or kind == KIND_BOOL:
            return api.bind_int64(self.statement, index, <int64_t>arg) == SQLITE_OK
        elif kind == KIND_NIL:
            return api.bind_null(self.statement, index) == SQLITE_OK
        elif kind == KIND_FLOAT64 or kind == KIND_FLOAT32:
            number = float_value(kind, arg)
            return not isnan(number) and api.bind_double(self.statement, index,
                                                         number) == SQLITE_OK
        elif kind == KIND_UINT:
            return arg <= 0x7FFFFFFFFFFFFFFF and api.bind_int64(
                self.statement, index, <long long>arg) == SQLITE_OK
        elif kind == KIND_BIN:
            return self._bind_blob(reader, index, <Py_ssize_t>arg)
        return False  # an array, a map: the pure path converts them

    cdef bint _bind_text(self, Reader reader, int index, Py_ssize_t size) except -1:
        cdef const uint8_t* text
        reader.need(size)
        text = reader.buf + reader.pos
        reader.pos += size
        # SQLITE_STATIC (NULL): the value is read in place, until the next row rebinds it
        return (size <= INT_MAX and valid_utf8(text, size)
                and api.bind_text(self.statement, index, <const char*>text, <int>size,
                                  NULL) == SQLITE_OK)

    cdef bint _bind_blob(self, Reader reader, int index, Py_ssize_t size) except -1:
        reader.need(size)
        reader.pos += size
        return size <= INT_MAX and api.bind_blob(
            self.statement, index, <const char*>(reader.buf + reader.pos - size), <int>size,
            NULL) == SQLITE_OK


# -- the store's own connection ----------------------------------------------------------------
# Python's sqlite3 does not hand out its connection's SQLite handle. SQLite calls every
# registered auto-extension with the handle of each connection it opens
# (sqlite.org/c3ref/auto_extension.html): registered only around the store's own
# sqlite3.connect() and only for the thread making it, the first call is that connection's.
# connect() then proves it (a last-insert rowid set through the handle, read back with SQL on
# the Python connection) before anything runs on it.

cdef extern from "<pthread.h>" nogil:
    ctypedef unsigned long pthread_t
    pthread_t pthread_self()
    int pthread_equal(pthread_t, pthread_t)

cdef void* _captured_handle = NULL
cdef pthread_t _capturing_thread
cdef bint _capturing = False
_capture_lock = threading.Lock()


cdef int _capture_handle(void* db, char** error, const void* routines) noexcept nogil:
    global _captured_handle
    if _capturing and _captured_handle == NULL and pthread_equal(pthread_self(),
                                                                 _capturing_thread):
        _captured_handle = db
    return SQLITE_OK


def connect(str path not None, **options):
    """``(sqlite3.connect(path, **options), its Statements)``; the Statements are None when
    the connection's handle could not be found and proven (the pure path runs)."""
    global _captured_handle, _capturing_thread, _capturing
    cdef void* handle
    if "factory" in options:  # (one that opens another connection first would be taken)
        raise TypeError("connect() takes no factory")
    with _capture_lock:
        _captured_handle = NULL
        _capturing_thread = pthread_self()
        _capturing = True
        api.auto_extension(<void (*)() noexcept nogil>_capture_handle)
        try:
            connection = sqlite3.connect(path, **options)
        finally:
            api.cancel_auto_extension(<void (*)() noexcept nogil>_capture_handle)
            _capturing = False
            handle = _captured_handle
            _captured_handle = NULL
    if handle == NULL:
        return connection, None
    marker = secrets.randbits(62) + 1
    api.set_last_insert_rowid(handle, marker)
    try:
        proven = connection.execute("SELECT last_insert_rowid()").fetchone()[0] == marker
    except BaseException:
        connection.close()
        raise
    api.set_last_insert_rowid(handle, 0)
    if not proven:
        return connection, None
    cdef Statements statements = Statements.__new__(Statements)
    statements.db = handle
    statements.connection = connection
    return connection, statements


cdef class _Prepared:
    cdef void* statement
    cdef int parameters


# Python's sqlite3 passes a value through an adapter registered for its type
# (sqlite3.register_adapter); these bind values as they are, so they step aside then.
_BOUND_TYPES = (int, float, str, bytes, bool, type(None))


cdef bint _adapters_in_use() except -1:
    adapters = sqlite3.adapters
    if not adapters:
        return False
    for kind in _BOUND_TYPES:
        if (kind, sqlite3.PrepareProtocol) in adapters:
            return True
    return False


# Prepared statements kept at most (one per SQL text: a table's column sets); beyond, all are
# finalized and prepared again as needed (schema churn must not grow them without bound).
DEF _MOST_PREPARED = 256


@cython.no_gc_clear  # (__dealloc__ needs ``prepared``: a store in a reference cycle)
cdef class Statements:
    """INSERTs and UPDATEs of the mirror's batches (``mirror/apply.py``), prepared on the
    SQLite handle of the store's own connection (so in its transaction, its savepoints) and run
    for many rows with the GIL held, as Python's sqlite3 runs them: the twin of
    ``executemany`` over the pure path's converted rows, without making them.

    What it binds is what the pure path binds for a column it does not convert: None, bool as
    0/1, an int within 64 bits, a float that is not NaN, str (UTF-8), bytes. Anything else, a
    row of other columns, a missing key and any SQLite error give -1: nothing more is run, and
    the caller rolls back to its savepoint and runs the pure path, which gives the real answer
    or the real error."""

    cdef void* db
    cdef object connection  # (its handle lives as long as it does)
    cdef dict prepared  # SQL -> _Prepared

    def __cinit__(self):
        self.db = NULL
        self.prepared = {}

    def close(self):
        """Finalize every statement (before the connection closes)."""
        self._finalize_all()
        self.db = NULL
        self.connection = None

    def __dealloc__(self):
        if self.db != NULL:
            self._finalize_all()

    cdef void _finalize_all(self) noexcept:
        for prepared in self.prepared.values():
            api.finalize((<_Prepared>prepared).statement)
        self.prepared.clear()

    cdef _Prepared _prepare(self, str sql, Py_ssize_t parameters):
        """The statement for ``sql`` (prepared once), or None: SQLite refused it or it does
        not bind ``parameters`` values."""
        cdef _Prepared prepared = self.prepared.get(sql)
        cdef void* statement = NULL
        if prepared is None:
            if self.db == NULL:
                raise ValueError("the statements are closed")
            if len(self.prepared) >= _MOST_PREPARED:
                self._finalize_all()
            if api.prepare_v2(self.db, sql.encode(), -1, &statement, NULL) != SQLITE_OK:
                return None
            prepared = _Prepared.__new__(_Prepared)
            prepared.statement = statement
            prepared.parameters = api.bind_parameter_count(statement)
            self.prepared[sql] = prepared
        return prepared if prepared.parameters == parameters else None

    def run_rows(self, str sql not None, rows, tuple names not None,
                 bint whole_row=True):
        """``sql`` run for each row map of ``rows`` with its values in ``names`` order (a row
        of other columns refused unless not ``whole_row``): the rows changed, or -1."""
        cdef Py_ssize_t width = len(names)
        cdef _Prepared prepared = self._prepare(sql, width)
        cdef long long changes = 0
        cdef int changed
        cdef list bound = [None] * width  # (the values bound, alive until stepped)
        if prepared is None or _adapters_in_use():
            return -1
        try:
            for row in rows:
                if (type(row) is not dict or (whole_row and PyDict_Size(row) != width)
                        or not _bind_from(prepared.statement, <dict>row, names, 1, bound)):
                    return _refused(prepared.statement)
                changed = self._step(prepared.statement)
                if changed < 0:
                    return -1
                changes += changed
        finally:
            api.clear_bindings(prepared.statement)  # (they point into the rows' values)
        return changes

    def run_updates(self, str sql not None, list events not None, tuple set_names not None,
                    tuple key_names not None, bint whole_row=True):
        """``sql`` (SET ``set_names`` WHERE ``key_names``) run for each UPDATE event of
        ``events``: SET from its ``data`` (a map of other columns refused unless not
        ``whole_row``), the key from its ``old`` when that is not empty, else from ``data``:
        the rows changed, or -1."""
        cdef Py_ssize_t width = len(set_names)
        cdef _Prepared prepared = self._prepare(sql, width + len(key_names))
        cdef long long changes = 0
        cdef int changed
        cdef list bound = [None] * (width + len(key_names))
        if prepared is None or _adapters_in_use():
            return -1
        try:
            for event in events:
                if type(event) is not dict:
                    return _refused(prepared.statement)
                data = (<dict>event).get("data")
                identity = (<dict>event).get("old")
                if not identity:
                    identity = data
                if (type(data) is not dict or type(identity) is not dict
                        or (whole_row and PyDict_Size(data) != width)
                        or not _bind_from(prepared.statement, <dict>data, set_names, 1, bound)
                        or not _bind_from(prepared.statement, <dict>identity, key_names,
                                          <int>width + 1, bound)):
                    return _refused(prepared.statement)
                changed = self._step(prepared.statement)
                if changed < 0:
                    return -1
                changes += changed
        finally:
            api.clear_bindings(prepared.statement)
        return changes


    def hash_rows(self, str name not None, hasher not None):
        """Register the SQL function ``name(table id, stored values...)`` on the handle: the
        row's packed (key hash, row hash), what ``hasher`` (the digests' ``_RowHasher``)
        gives, worked out here from SQLite's values without Python objects when
        ``hasher.digesters[table id]`` is the compiled ``StoredRowDigester`` and no text
        needs turning back (``wire_value``), else by calling ``hasher``; either way
        ``hasher.called`` is set. False: SQLite refused it (the caller registers
        ``hasher`` itself)."""
        if self.db == NULL:
            raise ValueError("the statements are closed")
        Py_INCREF(hasher)  # (released by SQLite's destructor call: at close, or on failure)
        return api.create_function_v2(self.db, name.encode(), -1, SQLITE_UTF8, <void*>hasher,
                                      _row_hashes, NULL, NULL, _release) == SQLITE_OK

    def sum_hashes(self, str sql not None, int bits):
        """Run ``sql`` (rows of table id, sign, packed (key hash, row hash): the digests'
        changes, in the order made) and sum them by table and bucket at ``bits``: {table id
        (in the order first seen): (truncated, {bucket: (row hashes added mod 2^64, rows
        added)})}; ``truncated``: a sign 0 row (every bucket to zero) came, and the sums are
        of the table's rows after the last one. None: closed, or SQLite refused ``sql``."""
        cdef _Prepared prepared
        cdef _BucketSums sums = None
        cdef long long table_id, sign
        cdef long long last_id = -1
        cdef const unsigned char* packed
        cdef unsigned long long key_hash, row_hash
        cdef int index, code
        if self.db == NULL or not 0 <= bits <= 16:
            return None
        prepared = self._prepare(sql, 0)
        if prepared is None:
            return None
        found = {}
        try:
            while True:
                code = api.step(prepared.statement)
                if code != SQLITE_ROW:
                    break
                table_id = api.column_int64(prepared.statement, 0)
                if table_id != last_id or sums is None:
                    sums = found.get(table_id)
                    if sums is None:
                        sums = found[table_id] = _BucketSums(bits)
                    last_id = table_id
                sign = api.column_int64(prepared.statement, 1)
                if sign == 0:
                    sums.truncate()
                    continue
                packed = <const unsigned char*>api.column_blob(prepared.statement, 2)
                if api.column_bytes(prepared.statement, 2) != 16 or (sign != 1 and sign != -1):
                    raise ValueError(f"not a digest change: table id {table_id}, sign {sign}")
                key_hash = row_hash = 0
                for index in range(8):
                    key_hash = key_hash << 8 | packed[index]
                    row_hash = row_hash << 8 | packed[8 + index]
                sums.add(key_hash, row_hash, sign)
            if code != SQLITE_DONE:
                raise sqlite3.OperationalError(api.errmsg(self.db).decode(errors="replace"))
        finally:
            api.reset(prepared.statement)
        return {table_id: (<_BucketSums>summed).take() for table_id, summed in found.items()}

    def hook_rows(self, hasher not None):
        """The hashes of the rows this connection writes into the tables a ``_RowHashes``
        follows, from SQLite's preupdate hook on the handle (``hasher``: the digests'
        ``_RowHasher``, for the rows whose text ``wire_value`` turns back); None: this SQLite
        has no preupdate hook."""
        if self.db == NULL:
            raise ValueError("the statements are closed")
        return _hooked_rows(self.db, self.connection, hasher)

    cdef int _step(self, void* statement) except -2:
        """Run the bound statement once: the rows it changed, or -1 (refused, reset). An
        error after which SQLite rolled back the whole transaction (a full disk, an I/O
        error) is raised as itself: there is no savepoint left for the pure path to run in."""
        cdef int changed
        cdef bint in_transaction = not api.get_autocommit(self.db)
        if api.step(statement) != SQLITE_DONE:
            _refused(statement)
            if in_transaction and api.get_autocommit(self.db):
                raise sqlite3.OperationalError(api.errmsg(self.db).decode(errors="replace"))
            return -1
        changed = api.changes(self.db)
        api.reset(statement)
        return changed


cdef struct _Bucket:  # a bucket's digest (or a transaction's sums in it)
    unsigned long long total  # row hashes, modulo 2^64
    long long count  # rows


cdef extern from *:
    void __builtin_prefetch(const void* address, int write) nogil


cdef class _BucketSums:
    """One table's row hashes summed by bucket (the changes of one transaction)."""

    cdef int bits
    cdef int shift
    cdef _Bucket* sums
    cdef int* touched  # the buckets summed into, in the order first touched
    cdef int touched_count
    cdef unsigned char* seen
    cdef readonly bint truncated  # every bucket went to zero, before the changes summed

    def __cinit__(self, int bits):
        cdef Py_ssize_t size = 1 << bits
        self.bits = bits
        self.shift = 64 - bits
        self.sums = <_Bucket*>PyMem_Malloc(size * sizeof(_Bucket))
        self.touched = <int*>PyMem_Malloc(size * sizeof(int))
        self.seen = <unsigned char*>PyMem_Malloc(size)
        if (self.sums == NULL or self.touched == NULL
                or self.seen == NULL):
            raise MemoryError()
        memset(self.seen, 0, size)
        self.touched_count = 0
        self.truncated = False

    def __dealloc__(self):
        PyMem_Free(self.sums)
        PyMem_Free(self.touched)
        PyMem_Free(self.seen)

    cdef void add(self, unsigned long long key_hash, unsigned long long row_hash,
                  long long sign) noexcept:
        cdef int bucket = <int>(key_hash >> self.shift) if self.shift < 64 else 0
        if not self.seen[bucket]:
            self.seen[bucket] = 1
            self.sums[bucket].total = 0
            self.sums[bucket].count = 0
            self.touched[self.touched_count] = bucket
            self.touched_count += 1
        self.sums[bucket].total += row_hash if sign > 0 else -row_hash  # (modulo 2^64)
        self.sums[bucket].count += sign

    cdef void truncate(self) noexcept:
        self._clear()
        self.truncated = True

    cdef void _clear(self) noexcept:
        cdef int index
        for index in range(self.touched_count):
            self.seen[self.touched[index]] = 0
        self.touched_count = 0

    cdef void reset(self) noexcept:
        self._clear()
        self.truncated = False

    def buckets(self):
        """{bucket: (row hashes added mod 2^64, rows added)}."""
        cdef int index, bucket
        buckets = {}
        for index in range(self.touched_count):
            bucket = self.touched[index]
            buckets[bucket] = (PyLong_FromUnsignedLongLong(self.sums[bucket].total),
                               self.sums[bucket].count)
        return buckets

    def apply(self, _Buckets digest not None):
        """The sums added into ``digest`` (``RowHashes.kept``); the buckets summed, as they
        became, packed as the digests' journal entries (u16 bucket, u64 total, i64 count,
        big-endian: ``digests._ENTRY``)."""
        cdef int index, bucket
        cdef _Bucket* kept
        cdef unsigned char* at
        if digest.bits != self.bits:
            raise ValueError(f"a digest of {self.bits} bits expected, not {digest.bits}")
        packed = PyBytes_FromStringAndSize(NULL, 18 * self.touched_count)
        at = <unsigned char*>PyBytes_AS_STRING(packed)
        for index in range(self.touched_count):  # (scattered buckets: their misses overlap)
            __builtin_prefetch(&digest.of[self.touched[index]], 1)
        for index in range(self.touched_count):
            bucket = self.touched[index]
            kept = &digest.of[bucket]
            kept.total += self.sums[bucket].total
            kept.count += self.sums[bucket].count
            _pack_entry(at, bucket, kept.total, kept.count)
            at += 18
        return packed

    cdef object take(self):
        """(truncated, {bucket: (total, count)}), and nothing summed any more."""
        cdef int index, bucket
        buckets = {}
        for index in range(self.touched_count):
            bucket = self.touched[index]
            buckets[bucket] = (PyLong_FromUnsignedLongLong(self.sums[bucket].total),
                               self.sums[bucket].count)
        taken = (self.truncated, buckets)
        self._clear()
        self.truncated = False
        return taken


cdef inline void _pack_entry(unsigned char* at, int bucket, unsigned long long total,
                             long long count) noexcept:
    """A journal entry (``digests._ENTRY``): u16 bucket, u64 total, i64 count, big-endian."""
    cdef int shift
    at[0], at[1] = <unsigned char>(bucket >> 8), <unsigned char>bucket
    for shift in range(8):
        at[2 + shift] = <unsigned char>(total >> (56 - 8 * shift))
        at[10 + shift] = <unsigned char>(<unsigned long long>count >> (56 - 8 * shift))


cdef class _Buckets:
    """A table's digest kept in C arrays (``_RowHashes.kept``), which ``_BucketSums.apply``
    adds into without a Python int per bucket; ``totals`` and ``counts`` read and write it
    as a ``TableDigest``'s lists."""

    cdef readonly int bits
    cdef Py_ssize_t size
    cdef _Bucket* of

    def __cinit__(self, int bits):
        if not 0 <= bits <= 16:
            raise ValueError(f"bits {bits}")
        self.bits = bits
        self.size = <Py_ssize_t>1 << bits
        self.of = <_Bucket*>PyMem_Calloc(self.size, sizeof(_Bucket))
        if self.of == NULL:
            raise MemoryError()

    def __dealloc__(self):
        PyMem_Free(self.of)

    @property
    def totals(self):
        return _BucketColumn(self, False)

    @property
    def counts(self):
        return _BucketColumn(self, True)

    def load(self, bytes packed not None):
        """Packed journal entries (``digests._ENTRY``) set into their buckets, in order (a
        later one wins); how many there were."""
        cdef Py_ssize_t size = PyBytes_GET_SIZE(packed), count = size // 18, index
        cdef const unsigned char* at = <const unsigned char*>PyBytes_AS_STRING(packed)
        cdef int bucket
        if size % 18:
            raise ValueError(f"journal entries of 18 bytes expected, not {size} bytes")
        for index in range(count):
            bucket = at[0] << 8 | at[1]
            if bucket >= self.size:
                raise ValueError(f"bucket {bucket} of {self.size}")
            self.of[bucket].total = _big_endian(at + 2)
            self.of[bucket].count = <long long>_big_endian(at + 10)
            at += 18
        return count

    def entries(self):
        """The buckets that are not empty packed as journal entries (``digests._ENTRY``),
        in bucket order."""
        cdef int bucket
        cdef Py_ssize_t filled = 0
        cdef unsigned char* at
        for bucket in range(self.size):
            if self.of[bucket].total or self.of[bucket].count:
                filled += 1
        packed = PyBytes_FromStringAndSize(NULL, 18 * filled)
        at = <unsigned char*>PyBytes_AS_STRING(packed)
        for bucket in range(self.size):
            if self.of[bucket].total or self.of[bucket].count:
                _pack_entry(at, bucket, self.of[bucket].total, self.of[bucket].count)
                at += 18
        return packed


cdef class _BucketColumn:
    """A ``_Buckets``' totals (u64) or counts (i64), indexed as a list of ints."""

    cdef _Buckets buckets
    cdef bint counts

    def __cinit__(self, _Buckets buckets not None, bint counts):
        self.buckets = buckets
        self.counts = counts

    def __len__(self):
        return self.buckets.size

    def __getitem__(self, Py_ssize_t bucket):
        if not 0 <= bucket < self.buckets.size:
            raise IndexError(bucket)
        if self.counts:
            return self.buckets.of[bucket].count
        return PyLong_FromUnsignedLongLong(self.buckets.of[bucket].total)

    def __setitem__(self, Py_ssize_t bucket, value):
        if not 0 <= bucket < self.buckets.size:
            raise IndexError(bucket)
        if self.counts:
            self.buckets.of[bucket].count = PyLong_AsLongLong(value)
        else:
            self.buckets.of[bucket].total = PyLong_AsUnsignedLongLong(value)


cdef int _refused(void* statement) noexcept:
    api.reset(statement)
    return -1


cdef bint _bind_from(void* statement, dict row, tuple names, int first,
                    list bound) except -1:
    """Bind ``row``'s values of ``names`` to parameters ``first``, ``first + 1``, ...; False:
    a name ``row`` lacks or a value the pure path must bind (see Statements). Each value is
    also put in ``bound`` (at its parameter's place): text and bytes are bound in place, and a
    later lookup may run Python code that drops them from ``row``."""
    cdef Py_ssize_t k
    cdef PyObject* value
    for k in range(len(names)):
        value = PyDict_GetItemWithError(row, names[k])
        if value == NULL:
            return False
        bound[first - 1 + k] = <object>value
        if not _bind_value(statement, first + <int>k, <object>value):
            return False
    return True


cdef bint _bind_value(void* statement, int index, object value) except -1:
    cdef type kind = type(value)
    cdef const char* utf8
    cdef Py_ssize_t size
    cdef int overflow = 0
    cdef long long integer
    cdef double number
    if value is None:
        return api.bind_null(statement, index) == SQLITE_OK
    if kind is str:
        try:
            utf8 = PyUnicode_AsUTF8AndSize(value, &size)
        except UnicodeEncodeError:  # (a lone surrogate: Python's sqlite3 raises it)
            return False
        # SQLITE_STATIC (NULL): the str holds its UTF-8 until the row is stepped and reset
        return size <= INT_MAX and api.bind_text(statement, index, utf8, <int>size,
                                                 NULL) == SQLITE_OK
    if kind is int:
        integer = PyLong_AsLongLongAndOverflow(value, &overflow)
        return overflow == 0 and api.bind_int64(statement, index, integer) == SQLITE_OK
    if kind is float:
        number = PyFloat_AS_DOUBLE(value)
        return not isnan(number) and api.bind_double(statement, index, number) == SQLITE_OK
    if kind is bool:
        return api.bind_int64(statement, index, 1 if value is True else 0) == SQLITE_OK
    if kind is bytes:
        size = PyBytes_GET_SIZE(value)
        return size <= INT_MAX and api.bind_blob(statement, index, PyBytes_AS_STRING(value),
                                                 <int>size, NULL) == SQLITE_OK
    return False


# -- the digests' trigger function (mirror/digests.py) ------------------------------------------
cdef void _release(void* hasher) noexcept with gil:
    Py_XDECREF(<PyObject*>hasher)


cdef void _row_hashes(void* context, int argc, void** argv) noexcept with gil:
    cdef unsigned char packed[16]
    try:
        if _hash_row(<object>api.user_data(context), argc, argv, packed):
            api.result_blob(context, packed, 16, <destructor>-1)  # (SQLITE_TRANSIENT)
        else:
            result = (<object>api.user_data(context))(*[_python_value(argv[index])
                                                         for index in range(argc)])
            api.result_blob(context, PyBytes_AS_STRING(result), <int>PyBytes_GET_SIZE(result),
                            <destructor>-1)
    except BaseException as exc:  # (the statement fails with it, as with a Python function)
        message = f"{type(exc).__name__}: {exc}".encode(errors="replace")
        api.result_error(context, message, <int>len(message))


cdef bint _hash_row(object hasher, int argc, void** argv, unsigned char* packed) except -1:
    """The row's packed hashes into ``packed``; False: the Python ``hasher`` must do it."""
    cdef unsigned long long key_hash = 0, row_hash = 0
    cdef Py_ssize_t index
    hasher.called = True
    if argc < 1:
        return False
    found = hasher.digesters.get(api.value_int64(argv[0]))
    if type(found) is not StoredRowDigester or argc - 1 != (<StoredRowDigester>found)._width:
        return False
    if not _hash_values(<StoredRowDigester>found, argv + 1, &key_hash, &row_hash):
        return False
    for index in range(8):
        packed[index] = <unsigned char>(key_hash >> (56 - 8 * index))
        packed[8 + index] = <unsigned char>(row_hash >> (56 - 8 * index))
    return True


cdef bint _hash_values(StoredRowDigester stored, void** values, unsigned long long* key_hash,
                       unsigned long long* row_hash) except -1:
    """The hashes of a stored row (``values``: one per column, in ``stored``'s order);
    False: a text ``wire_value`` turns back, or that is not UTF-8 (Python's sqlite3 refuses
    it): Python must hash the row."""
    cdef RowDigester digester = stored._digester
    cdef _Out out
    _open(&out)
    try:
        if not digester._key_is_row:
            if not _write_values(&out, stored, values, digester._key_sorted,
                                 digester._key_width, False):
                return False
            key_hash[0] = _hash64(out.data, out.size)
            out.size = 0
        if not _write_values(&out, stored, values, NULL, digester._width, False):
            return False
        row_hash[0] = _hash64(out.data, out.size)
        if digester._key_is_row:
            key_hash[0] = row_hash[0]
    finally:
        _close(&out)
    return True


cdef inline const char* _text(void* value, bint utf8_file, Py_ssize_t* size) noexcept:
    """A TEXT or BLOB value's bytes (never NULL) and their size. A TEXT of a UTF-8 file is
    read as a blob: its bytes as stored, where ``sqlite3_value_text`` copies a value that
    is not NUL-terminated (most: read from a record, or bound) to add the NUL."""
    cdef const char* data
    if utf8_file or api.value_type(value) != SQLITE_TEXT:
        data = <const char*>api.value_blob(value)
    else:
        data = <const char*>api.value_text(value)
    size[0] = api.value_bytes(value)
    return data if data != NULL else _EMPTY


cdef bint _write_values(_Out* out, StoredRowDigester stored, void** values,
                        Py_ssize_t* which, Py_ssize_t count, bint utf8_file) except -1:
    """The canonical bytes (wire/digest.py) of the sorted columns ``which[0..count)`` (NULL:
    every column) of the stored ``values`` (in the digester's given order): an INTEGER is
    an int, a REAL a float, a TEXT (of a column whose text is its wire value) a str, a BLOB
    bytes, a NULL absent. False: a TEXT that ``wire_value`` turns back or that is not
    UTF-8 (see ``_hash_values``)."""
    cdef RowDigester digester = stored._digester
    cdef Py_ssize_t index, column, given, size
    cdef void* value
    cdef int kind
    cdef const char* data
    cdef PyObject* prefix  # (borrowed from the digester's tuple: no reference counted)
    for index in range(count):
        column = which[index] if which != NULL else index
        given = digester._given_of_sorted[column]
        value = values[given]
        kind = api.value_type(value)
        if kind == SQLITE_NULL:
            continue
        prefix = _borrowed_item(digester._prefixes, column)
        if kind == SQLITE_INTEGER:
            _put(out, _bytes_data(prefix), _bytes_size(prefix))
            _put_int64(out, api.value_int64(value))
        elif kind == SQLITE_FLOAT:
            _put(out, _bytes_data(prefix), _bytes_size(prefix))
            _put_float(out, api.value_double(value))
        else:
            data = _text(value, utf8_file, &size)
            if kind == SQLITE_TEXT and (stored._kinds[given] != KEEP or not valid_utf8(
                    <const uint8_t*>data, size)):
                return False
            _put(out, _bytes_data(prefix), _bytes_size(prefix))
            _put_sized(out, 83 if kind == SQLITE_TEXT else 66,  # 'S', 'B'
                       data, size)
    return True


cdef extern from "Python.h":  # (the macros, on borrowed references)
    PyObject* _borrowed_item "PyTuple_GET_ITEM" (object, Py_ssize_t)
    const char* _bytes_data "PyBytes_AS_STRING" (PyObject*)
    Py_ssize_t _bytes_size "PyBytes_GET_SIZE" (PyObject*)


cdef const char* _EMPTY = ""


cdef object _python_value(void* value):
    """The Python value Python's sqlite3 hands a function for ``value``."""
    cdef int kind = api.value_type(value)
    cdef const char* data
    if kind == SQLITE_INTEGER:
        return api.value_int64(value)
    if kind == SQLITE_FLOAT:
        return api.value_double(value)
    if kind == SQLITE_TEXT:
        data = <const char*>api.value_text(value)
        return PyUnicode_DecodeUTF8(data, api.value_bytes(value), NULL)
    if kind == SQLITE_BLOB:
        data = <const char*>api.value_blob(value)
        return PyBytes_FromStringAndSize(data, api.value_bytes(value))
    return None


# -- the digests' row hashes from SQLite's preupdate hook (mirror/digests.py) -------------------
# SQLite calls the hook before each row an INSERT, UPDATE or DELETE of the connection writes,
# with the old and new values (sqlite.org/c3ref/preupdate_hook.html): no trigger program, no
# TEMP table. It is not told of a ROLLBACK TO: the changes are a log the store's savepoints
# mark and undo (``mark``, ``undo``), and a ROLLBACK empties (``clear``).
DEF SQLITE_DELETE = 9
DEF SQLITE_INSERT = 18
DEF _TRUNCATED = 0  # a change's sign: every bucket of the table to zero
DEF _RESTARTED = 2  # a change's sign: the table's changes logged before are not summed


# Where a change's hash is (its ``key_at`` or ``row_at``): its canonical bytes at that offset
# of the log's ``pending`` bytes, hashed by ``_resolve``; or one of these.
DEF _KNOWN = -1  # the hash is set
DEF _KEY_IS_ROW = -2  # (key_at) the table's key is the whole row: its key hash is its row hash
DEF _KEY_OF_CHANGE = -3  # (key_at) the key's bytes are those of change ``key_size``'s key
# The pending bytes hashed once they reach this much (a transaction of a million rows does not
# hold each one's bytes until its commit): ~3,000 rows of the benchmark's 9 columns.
DEF _PENDING_BYTES = 1 << 20


cdef struct _Change:
    long long table_id
    long long sign  # +1 a row added, -1 a row taken away, or _TRUNCATED, _RESTARTED
    unsigned long long key_hash
    unsigned long long row_hash
    Py_ssize_t key_at  # (see _KNOWN)
    Py_ssize_t key_size
    Py_ssize_t row_at
    Py_ssize_t row_size


cdef struct _HashQueue:  # a message waiting for another to be hashed with (_resolve)
    const char* data  # NULL: none waits
    Py_ssize_t size
    unsigned long long* hash


cdef inline void _queue_hash(_HashQueue* queue, const char* data, Py_ssize_t size,
                             unsigned long long* hash) noexcept:
    """``data``'s hash into ``hash``: at once with the message waiting, else it waits."""
    if queue.data == NULL:
        queue.data, queue.size, queue.hash = data, size, hash
        return
    cdc_sha256_head64_pair(<const unsigned char*>queue.data, queue.size,
                           <const unsigned char*>data, size, <uint64_t*>queue.hash,
                           <uint64_t*>hash)
    queue.data = NULL


cdef class _Followed:
    """A table whose written rows are hashed: its id and digester, room for its values."""

    cdef bytes name
    cdef long long table_id
    cdef object digester  # the compiled StoredRowDigester (else the Python hasher hashes)
    cdef Py_ssize_t width
    cdef void** values

    def __dealloc__(self):
        PyMem_Free(self.values)


cdef void _preupdate(void* rows, void* db, int operation, const char* database,
                     const char* table, long long old_rowid, long long new_rowid
                     ) noexcept with gil:
    (<_RowHashes>rows)._changed(db, operation, database, table)


cdef _RowHashes _hooked_rows(void* db, object connection, object hasher):
    """A :class:`_RowHashes` on ``db``'s preupdate hook (``connection``: the Python
    connection owning the handle, None for a ChunkLoader's own); None: this SQLite has no
    preupdate hook."""
    cdef _RowHashes rows
    if api.preupdate_hook == NULL or api.preupdate_old == NULL or api.preupdate_new == NULL:
        return None
    rows = _RowHashes.__new__(_RowHashes)
    rows.db = db
    rows.connection = connection
    rows.hasher = hasher
    rows.utf8_file = _utf8_file(db)
    rows.resume()
    return rows


cdef bint _utf8_file(void* db) except -1:
    """Whether the file of ``db``'s main database holds its text as UTF-8 (SQLite's default;
    a file made elsewhere may be UTF-16)."""
    cdef void* statement = NULL
    cdef bint utf8 = False
    if api.prepare_v2(db, b"PRAGMA main.encoding", -1, &statement, NULL) != SQLITE_OK:
        return False
    if api.step(statement) == SQLITE_ROW and api.column_bytes(statement, 0) == 5:
        utf8 = memcmp(api.column_blob(statement, 0), b"UTF-8", 5) == 0
    api.finalize(statement)
    return utf8


@cython.no_gc_clear  # (__dealloc__ takes the hook back from the connection)
cdef class _RowHashes:
    """The hashes of the rows the connection writes into the followed tables, logged in the
    order written until :meth:`take` sums them (see ``Statements.hook_rows``).

    The hook writes a row's canonical bytes and hashes them later (``_resolve``), two
    messages at a time: SHA-256's rounds of one message wait on each other, and two keep
    the CPU's SHA unit busy (``cdc_sha256_head64_pair``). An UPDATE that keeps its key hashes
    it once (the new key's bytes equal to the old's)."""

    cdef void* db
    cdef object connection  # (the handle lives as long as it does; None: a ChunkLoader's)
    cdef object hasher  # the digests' _RowHasher: rows whose text wire_value turns back
    cdef dict followed  # table name (UTF-8) -> _Followed
    cdef _Followed last  # (the table of the last row: most rows follow one of their table)
    cdef list spare  # a few _BucketSums a take gave, used again (one is ~340 KB to allocate)
    cdef _Change* changes
    cdef Py_ssize_t count
    cdef Py_ssize_t capacity
    cdef bint hooked
    cdef object failed  # (table id, what) of the first row that could not be hashed
    cdef Py_ssize_t failed_at  # (the changes logged before it)
    cdef bint utf8_file
    cdef _Out pending  # canonical bytes of the changes from ``resolved`` on, to hash
    cdef Py_ssize_t resolved  # the changes before it have their hashes
    cdef Py_ssize_t last_key  # the last change whose key's bytes are pending, or -1

    def __cinit__(self):
        self.followed = {}
        self.spare = []
        self.changes = NULL
        self.count = self.capacity = 0
        self.hooked = False
        _open(&self.pending)
        self.resolved = 0
        self.last_key = -1

    def __dealloc__(self):
        self._unhook()
        PyMem_Free(self.changes)
        _close(&self.pending)

    def __len__(self):
        return self.count

    def follow(self, str table not None, long long table_id, digester not None):
        """Hash the rows written into ``table`` (``digester``: a ``StoredRowDigester`` of
        its columns in the file's order) under ``table_id`` from now on."""
        cdef _Followed followed = _Followed.__new__(_Followed)
        followed.name = table.encode()
        followed.table_id = table_id
        followed.digester = digester
        followed.width = len(digester.names)
        followed.values = <void**>PyMem_Malloc(max(1, followed.width) * sizeof(void*))
        if followed.values == NULL:
            raise MemoryError()
        self.followed[followed.name] = followed
        self.last = None

    def unfollow(self, str table not None):
        self.followed.pop(table.encode(), None)
        self.last = None

    def mark(self):
        """Where the log is (before a SAVEPOINT): :meth:`undo` goes back to it."""
        return self.count

    def undo(self, Py_ssize_t mark):
        """The changes logged since :meth:`mark` gave ``mark`` are gone (a ROLLBACK TO)."""
        if 0 <= mark <= self.count:  # (a failed row logs nothing: count may be the mark)
            self.count = mark
            self.resolved = min(self.resolved, mark)
            if self.last_key >= mark:
                self.last_key = -1
            if self.failed is not None and self.failed_at >= mark:
                self.failed = None

    def truncate(self, long long table_id):
        """Every bucket of the table goes to zero here (its rows deleted, not hashed)."""
        self._log(table_id, _TRUNCATED, 0, 0)

    def restart(self, long long table_id):
        """The table's changes logged so far are not summed (its digest is set anew)."""
        self._log(table_id, _RESTARTED, 0, 0)

    def add(self, long long table_id, list hashes not None):
        """Rows another connection wrote, hashed elsewhere: packed (key hash, row hash)."""
        cdef const unsigned char* packed
        for pair in hashes:
            if type(pair) is not bytes or PyBytes_GET_SIZE(pair) != 16:
                raise ValueError("not a packed (key hash, row hash)")
            packed = <const unsigned char*>PyBytes_AS_STRING(pair)
            self._log(table_id, 1, _big_endian(packed), _big_endian(packed + 8))

    def pause(self):
        """Nothing is hashed until :meth:`resume` (a table emptied or loaded uncounted)."""
        self._unhook()

    def resume(self):
        if not self.hooked:
            api.preupdate_hook(self.db, _preupdate, <void*>self)
            self.hooked = True

    @property
    def error(self):
        """(table id, what) of the first row since the last take that could not be hashed,
        or None."""
        return self.failed

    def take(self, int bits):
        """The changes summed by table id (in the order first logged) and bucket at
        ``bits``: {table id: its sums (``truncated``, ``buckets()``, ``apply()``), until the
        next take}; the log is emptied."""
        cdef Py_ssize_t index
        cdef _Change* change
        cdef long long last_id = -1
        cdef _BucketSums sums = None
        if not 0 <= bits <= 16:
            raise ValueError(f"bits {bits}")
        self._resolve()
        spare = [sums for sums in self.spare if (<_BucketSums>sums).bits == bits]
        by_table = {}
        for index in range(self.count):
            change = &self.changes[index]
            if change.table_id != last_id or sums is None:
                sums = by_table.get(change.table_id)
                if sums is None:
                    sums = by_table[change.table_id] = spare.pop() if spare else _BucketSums(bits)
                    sums.reset()
                last_id = change.table_id
            if change.sign == _TRUNCATED:
                sums.truncate()
            elif change.sign == _RESTARTED:
                sums.reset()
            else:
                sums.add(change.key_hash, change.row_hash, change.sign)
        self._forget()
        self.spare = list(by_table.values())[:4]  # (the caller is done with them by the next)
        return {table_id: summed for table_id, summed in by_table.items()
                if (<_BucketSums>summed).touched_count or (<_BucketSums>summed).truncated}

    def kept(self, int bits, digest=None):
        """A digest of ``bits`` in C arrays, for ``_BucketSums.apply``: empty, or a copy of
        the ``TableDigest`` ``digest``."""
        cdef _Buckets buckets = _Buckets(bits)
        cdef Py_ssize_t bucket
        if digest is None:
            return buckets
        totals, counts = digest.totals, digest.counts
        if len(totals) != buckets.size or len(counts) != buckets.size:
            raise ValueError(f"{buckets.size} buckets expected at {buckets.bits} bits")
        for bucket in range(buckets.size):
            buckets.of[bucket].total = PyLong_AsUnsignedLongLong(totals[bucket])
            buckets.of[bucket].count = PyLong_AsLongLong(counts[bucket])
        return buckets

    def clear(self):
        """Nothing logged (the transaction rolled back)."""
        self._forget()

    cdef void _forget(self) noexcept:
        self.count = self.resolved = 0
        self.pending.size = 0
        self.last_key = -1
        self.failed = None

    cdef int _resolve(self) except -1:
        """The hashes of the changes logged with their bytes pending, two at a time."""
        cdef Py_ssize_t index
        cdef _Change* change
        cdef _HashQueue queue
        queue.data = NULL
        for index in range(self.resolved, self.count):
            change = &self.changes[index]
            if change.key_at >= 0:
                _queue_hash(&queue, self.pending.data + change.key_at, change.key_size,
                            &change.key_hash)
            if change.row_at >= 0:
                _queue_hash(&queue, self.pending.data + change.row_at, change.row_size,
                            &change.row_hash)
        if queue.data != NULL:
            queue.hash[0] = _hash64(queue.data, queue.size)
        for index in range(self.resolved, self.count):  # (in order: a key of an earlier one)
            change = &self.changes[index]
            if change.key_at == _KEY_IS_ROW:
                change.key_hash = change.row_hash
            elif change.key_at == _KEY_OF_CHANGE:
                change.key_hash = self.changes[change.key_size].key_hash
            change.key_at = change.row_at = _KNOWN
        self.resolved = self.count
        self.pending.size = 0
        self.last_key = -1
        return 0

    cdef void _changed(self, void* db, int operation, const char* database,
                       const char* table) noexcept:
        cdef _Followed followed = self.last
        try:
            if strcmp(database, b"main") != 0:
                return
            if followed is None or strcmp(table, followed.name) != 0:
                followed = self.followed.get(<bytes>table)
                if followed is None:
                    return
                self.last = followed
            if operation != SQLITE_INSERT:
                self._hash(db, followed, api.preupdate_old, -1)
            if operation != SQLITE_DELETE:
                self._hash(db, followed, api.preupdate_new, 1)
        except BaseException as exc:  # (SQLite goes on: the fold raises it)
            if self.failed is None:
                self.failed = (followed.table_id if followed is not None else 0,
                               f"{type(exc).__name__}: {exc}")
                self.failed_at = self.count

    cdef int _hash(self, void* db, _Followed followed, preupdate_value_f read,
                   long long sign) except -1:
        cdef Py_ssize_t index
        cdef const unsigned char* packed
        cdef _Change change
        for index in range(followed.width):
            if read(db, <int>index, &followed.values[index]) != SQLITE_OK:
                raise sqlite3.OperationalError(f"{followed.name.decode(errors='replace')} "
                                               f"has no column {index}")
        change.table_id, change.sign = followed.table_id, sign
        if type(followed.digester) is StoredRowDigester and self._write_pending(
                <StoredRowDigester>followed.digester, followed.values, &change):
            self._append(&change)
            if change.key_at >= 0:
                self.last_key = self.count - 1
            if self.pending.size >= _PENDING_BYTES:
                self._resolve()
            return 0
        pair = self.hasher(followed.table_id, *[_python_value(followed.values[index])
                                                for index in range(followed.width)])
        if type(pair) is not bytes or PyBytes_GET_SIZE(pair) != 16:
            raise TypeError(f"the row hasher gave {type(pair).__name__}, not 16 bytes")
        packed = <const unsigned char*>PyBytes_AS_STRING(pair)
        self._log(followed.table_id, sign, _big_endian(packed), _big_endian(packed + 8))
        return 0

    cdef bint _write_pending(self, StoredRowDigester stored, void** values,
                             _Change* change) except -1:
        """The stored row's key and row bytes (``values``: one per column, in ``stored``'s
        order) appended to the pending bytes, where ``change`` says; False (nothing
        appended): a text ``wire_value`` turns back, or that is not UTF-8 (Python's sqlite3
        refuses it): Python must hash the row."""
        cdef RowDigester digester = stored._digester
        cdef Py_ssize_t start = self.pending.size
        cdef _Change* last
        change.key_at = _KEY_IS_ROW
        if not digester._key_is_row:
            if not _write_values(&self.pending, stored, values, digester._key_sorted,
                                 digester._key_width, self.utf8_file):
                self.pending.size = start
                return False
            change.key_at, change.key_size = start, self.pending.size - start
            if self.last_key >= 0:  # (equal bytes, equal hash, whatever the table)
                last = &self.changes[self.last_key]
                if last.key_size == change.key_size and memcmp(
                        self.pending.data + last.key_at, self.pending.data + start,
                        change.key_size) == 0:
                    self.pending.size = start
                    change.key_at, change.key_size = _KEY_OF_CHANGE, self.last_key
        change.row_at = self.pending.size
        if not _write_values(&self.pending, stored, values, NULL, digester._width,
                             self.utf8_file):
            self.pending.size = start
            return False
        change.row_size = self.pending.size - change.row_at
        return True

    cdef int _log(self, long long table_id, long long sign, unsigned long long key_hash,
                  unsigned long long row_hash) except -1:
        """A change whose hashes are known."""
        cdef _Change change
        change.table_id, change.sign = table_id, sign
        change.key_hash, change.row_hash = key_hash, row_hash
        change.key_at = change.row_at = _KNOWN
        return self._append(&change)

    cdef int _append(self, _Change* change) except -1:
        cdef _Change* grown
        cdef Py_ssize_t capacity
        if self.count == self.capacity:
            capacity = max(1024, 2 * self.capacity)
            grown = <_Change*>PyMem_Realloc(self.changes, capacity * sizeof(_Change))
            if grown == NULL:
                raise MemoryError()
            self.changes, self.capacity = grown, capacity
        self.changes[self.count] = change[0]
        self.count += 1
        return 0

    cdef void _unhook(self) noexcept:
        """The hook off the connection, unless it is closed (the hook went with it) or
        another hook took its place."""
        cdef void* previous
        if not self.hooked:
            return
        self.hooked = False
        if self.connection is not None:  # (None: a ChunkLoader's handle, unhooked at close)
            try:
                self.connection.total_changes  # (raises once the connection is closed)
            except BaseException:
                return
        previous = api.preupdate_hook(self.db, NULL, NULL)
        if previous != NULL and previous != <void*>self:
            api.preupdate_hook(self.db, _preupdate, previous)


cdef inline unsigned long long _big_endian(const unsigned char* packed) noexcept:
    cdef unsigned long long value = 0
    cdef int index
    for index in range(8):
        value = value << 8 | packed[index]
    return value
