# cython: language_level=3, cdivision=True
"""Compiled twin of ``protocol/changes.py``: the row builder, and runs of row changes taken
straight from CopyData into ChangeRecords."""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_SetItem
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE

from cdc_platform._speedups.protocol.pgoutput cimport tuple_at
from cdc_platform._speedups.writer cimport u32, u64

cdef extern from "Python.h":
    object PyLong_FromUnicodeObject(object u, int base)
    object PyFloat_FromString(object s)
    object PyObject_CallOneArg(object callable, object arg)
    Py_ssize_t PyList_GET_SIZE(object o)
    PyObject* PyList_GET_ITEM(object o, Py_ssize_t i)
    bint PyBytes_CheckExact(object o)
    bint PyMemoryView_Check(object o)
    int PyObject_GetBuffer(object o, Py_buffer* view, int flags) except -1
    void PyBuffer_Release(Py_buffer* view)
    int PyBUF_SIMPLE


# -- rows -----------------------------------------------------------------------------------
cdef enum ConvertKind:
    KEEP = 0  # the text is the value
    TO_INT = 1
    TO_FLOAT = 2
    CALL = 3


cdef class RowBuilder:
    """``changes._row_builder``: ``values -> {name: value}`` for the columns at ``indexes``.

    A ``str`` value goes through its column's converter (none for ``passthrough`` ones,
    ``int`` and ``float`` parsed directly); None and bytes pass as they are; anything else
    (UNCHANGED_TOAST) raises ``slow`` (an exception class: a new instance per raise, so no
    traceback accumulates), the caller's cue for its general loop."""

    cdef tuple names
    cdef tuple converters
    cdef tuple indexes
    cdef int* kinds
    cdef Py_ssize_t* positions
    cdef Py_ssize_t count
    cdef Py_ssize_t width
    cdef object slow

    def __cinit__(self):
        self.kinds = NULL
        self.positions = NULL

    def __init__(self, tuple names not None, tuple converters not None,
                 tuple indexes not None, passthrough,
                 object slow):
        cdef Py_ssize_t j
        self.width = len(names)
        if len(converters) != self.width:
            raise ValueError("one converter per column")
        self.count = len(indexes)
        self.names = tuple(names[i] for i in indexes)
        self.converters = tuple(converters[i] for i in indexes)
        self.indexes = indexes
        self.slow = slow
        self.kinds = <int*>PyMem_Malloc(max(self.count, 1) * sizeof(int))
        self.positions = <Py_ssize_t*>PyMem_Malloc(max(self.count, 1) * sizeof(Py_ssize_t))
        if self.kinds == NULL or self.positions == NULL:
            raise MemoryError()
        for j in range(self.count):
            index = indexes[j]
            if not 0 <= index < self.width:
                raise ValueError(f"column index {index} out of range")
            self.positions[j] = index
            convert = self.converters[j]
            if convert in passthrough:
                self.kinds[j] = KEEP
            elif convert is int:
                self.kinds[j] = TO_INT
            elif convert is float:
                self.kinds[j] = TO_FLOAT
            else:
                self.kinds[j] = CALL

    def __dealloc__(self):
        PyMem_Free(self.kinds)
        PyMem_Free(self.positions)

    def __call__(self, tuple values not None):
        return self._build(values)

    cdef dict _build(self, tuple values):
        cdef Py_ssize_t j
        cdef object value
        cdef int kind
        cdef dict row = {}
        if PyTuple_GET_SIZE(values) != self.width:
            raise ValueError(f"expected {self.width} values, got {PyTuple_GET_SIZE(values)}")
        for j in range(self.count):
            value = <object>PyTuple_GET_ITEM(values, self.positions[j])
            if type(value) is str:
                kind = self.kinds[j]
                if kind == TO_INT:
                    value = PyLong_FromUnicodeObject(value, 10)
                elif kind == TO_FLOAT:
                    value = PyFloat_FromString(value)
                elif kind == CALL:
                    value = PyObject_CallOneArg(<object>PyTuple_GET_ITEM(self.converters, j),
                                                value)
            elif value is not None and type(value) is not bytes:
                raise self.slow
            PyDict_SetItem(row, <object>PyTuple_GET_ITEM(self.names, j), value)
        return row


row_builder = RowBuilder  # the name of ``changes.row_builder_python``, which it stands for


# -- runs of row changes: CopyData -> ChangeRecord ------------------------------------------

cdef object _INSERT = "INSERT"
cdef object _UPDATE = "UPDATE"
cdef object _DELETE = "DELETE"
cdef object _KEY_KIND = "K"
cdef object _OLD_KIND = "O"
cdef tuple _NO_COLUMNS = ()


cdef class _Run:
    """One ``take_changes`` call: the transaction's fields and the current relation's
    builders (looked up again only when the relation changes)."""
    cdef dict tables
    cdef object record_type, commit_lsn, xid, commit_ts, unchanged
    cdef unsigned int relation_id
    cdef object relation, name, schema
    cdef RowBuilder builder, key_builder
    cdef unsigned long long wal_end  # of the last message taken

    cdef bint _use_relation(self, unsigned int relation_id) except -1:
        """Switch to ``relation_id``; False when the general path must take its changes."""
        if self.builder is not None and self.relation_id == relation_id:
            return True
        relation = relation_id
        table = self.tables.get(relation)
        if table is None:
            return False
        builder, key_builder = table.build, table.build_key
        if type(builder) is not RowBuilder or type(key_builder) is not RowBuilder:
            return False
        self.relation_id, self.relation = relation_id, relation
        self.name, self.schema = table.table, table.schema
        self.builder, self.key_builder = <RowBuilder>builder, <RowBuilder>key_builder
        return True

    cdef object row_change(self, const unsigned char* buf, Py_ssize_t size,
                           Py_ssize_t ordinal):
        """One XLogData CopyData message -> its ChangeRecord, or None (not a row change
        the compiled path can take, or anything unusual: the general path's job)."""
        cdef unsigned char tag, marker
        cdef Py_ssize_t pos = 31
        cdef object values, new = None, old = None, old_kind = None, operation
        # XLogData: 'w', Int64 wal_start, Int64 wal_end, Int64 send time; then the pgoutput
        # message: tag, Int32 relation oid, a tuple kind byte, TupleData...
        if size < 33 or buf[0] != 119:
            return None
        tag = buf[25]
        if tag != 73 and tag != 85 and tag != 68:  # 'I', 'U', 'D'
            return None
        if not self._use_relation(<unsigned int>u32(buf + 26)):
            return None
        marker = buf[30]
        try:
            if tag == 73:  # Insert: 'N' TupleData
                if marker != 78:
                    return None
                operation = _INSERT
            else:
                if marker == 75 or marker == 79:  # 'K' key / 'O' old row
                    values = tuple_at(buf, size, &pos, self.unchanged)
                    if values is None:
                        return None
                    if marker == 75:
                        old_kind, old = _KEY_KIND, self.key_builder._build(values)
                    else:
                        old_kind, old = _OLD_KIND, self.builder._build(values)
                    if tag == 85:  # Update: then 'N'
                        if pos >= size:
                            return None
                        marker = buf[pos]
                        pos += 1
                elif tag == 68:  # Delete: 'K' or 'O' only
                    return None
                if tag == 85:
                    if marker != 78:
                        return None
                    operation = _UPDATE
                else:
                    operation = _DELETE
            if tag != 68:
                values = tuple_at(buf, size, &pos, self.unchanged)
                if values is None:
                    return None
                new = self.builder._build(values)
            if pos != size:
                return None
        except Exception:  # UTF-8, width, a converter, UNCHANGED_TOAST: the general path
            return None
        self.wal_end = u64(buf + 9)
        return self.record_type(self.name, self.schema, operation, self.relation,
                                u64(buf + 1), self.commit_lsn, self.xid, self.commit_ts,
                                ordinal, new, old, old_kind, _NO_COLUMNS)


def take_changes(list raw not None, Py_ssize_t index, dict tables not None,
                 object record_type, object commit_lsn, object xid, object commit_ts,
                 Py_ssize_t ordinal, list events not None, object unchanged):
    """``TransactionAssembler.feed(wal_start, decode_message(...))`` for a run of row
    changes (``changes.TransactionAssembler.take_changes``): from ``raw[index]`` on, every
    CopyData message (bytes, or a memoryview as psycopg hands it over) that is an XLogData
    ('w') holding a pgoutput Insert, Update or Delete of a relation in ``tables`` whose
    builders are :class:`RowBuilder` objects becomes ``record_type(...)`` (a ChangeRecord)
    appended to ``events``, ordinals counting from ``ordinal``. Stops before the first
    message that is anything else, or whose tuples or rows do not build (unchanged TOAST, a
    value a converter refuses, a wrong width, bad UTF-8): the caller's general path takes
    that one and words its errors.
    Returns ``(next index, next ordinal, highest XLogData wal_end taken or 0)``."""
    cdef Py_ssize_t count = PyList_GET_SIZE(raw)
    cdef Py_buffer view
    cdef object payload, record
    cdef unsigned long long highest = 0
    cdef _Run run = _Run()
    if index < 0:
        raise IndexError(f"take_changes: index {index} < 0")
    run.tables, run.record_type, run.unchanged = tables, record_type, unchanged
    run.commit_lsn, run.xid, run.commit_ts = commit_lsn, xid, commit_ts
    while index < count:
        payload = <object>PyList_GET_ITEM(raw, index)
        if PyBytes_CheckExact(payload):
            record = run.row_change(<const unsigned char*>PyBytes_AS_STRING(payload),
                                    PyBytes_GET_SIZE(payload), ordinal)
        elif PyMemoryView_Check(payload):
            try:  # the buffer protocol, not the view's struct: a released view raises here
                PyObject_GetBuffer(payload, &view, PyBUF_SIMPLE)
            except Exception:
                break
            try:
                record = run.row_change(<const unsigned char*>view.buf, view.len, ordinal)
            finally:
                PyBuffer_Release(&view)
        else:
            break
        if record is None:
            break
        events.append(record)
        ordinal += 1
        if run.wal_end > highest:
            highest = run.wal_end
        index += 1
    return index, ordinal, highest
