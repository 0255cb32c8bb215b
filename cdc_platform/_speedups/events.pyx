# cython: language_level=3, cdivision=True
"""Compiled twin of ``bridge/events.py``'s msgpack writing: LSN text, a change's message, and
a map around fields already packed."""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE

from cdc_platform._speedups.writer cimport (
    Buffer,
    PyLong_Check,
    PyUnicode_IS_COMPACT_ASCII,
    ascii_text,
    finish,
    pack,
    put,
    put_head,
    put_key,
    put_length,
    put_lsn,
)

cdef object _DELETE = "DELETE"


def lsn_text(unsigned long long lsn):
    """``lsn.format_lsn`` for a valid LSN: ``0x16B374D848`` -> ``"16/B374D848"``."""
    cdef char text[17]
    return ascii_text(text, put_lsn(text, lsn))


def pack_map(bytes prefix, Py_ssize_t prefix_items, tuple items):
    """A msgpack map of ``prefix_items`` key/value pairs already packed in ``prefix``,
    followed by ``items`` (key, value, key, value, ...): the bytes of ``msgpack.packb`` of
    the dict with those pairs in that order."""
    cdef Py_ssize_t count = PyTuple_GET_SIZE(items)
    cdef Py_ssize_t i
    cdef Buffer out
    if count % 2:
        raise ValueError("items must alternate keys and values")
    out.capacity = PyBytes_GET_SIZE(prefix) + 64 + 32 * count
    out.data = <char*>PyMem_Malloc(out.capacity)
    if out.data == NULL:
        raise MemoryError()
    out.size = 0
    try:
        put_length(&out, prefix_items + count // 2, 0x80, 16, 0, 0xDE, 0xDF)
        put(&out, PyBytes_AS_STRING(prefix), PyBytes_GET_SIZE(prefix))
        for i in range(count):
            pack(&out, <object>PyTuple_GET_ITEM(items, i), 1)
    except BaseException:
        PyMem_Free(out.data)
        raise
    return finish(&out)


cdef object _TRUNCATE = "TRUNCATE"
cdef object _tuple_new = tuple.__new__


def change_message(record, shared, type message_type):
    """``MessageBuilder._single`` with the compiled writer: ``record`` (a ChangeRecord) and
    its ``_Shared`` -> ``message_type(subject, msg_id, payload, headers)``, the payload the
    bytes of ``pack_map(shared.packed, shared.packed_count, _change_fields(record, msg_id))``
    and ``msg_id`` = ``f"{commit_lsn_text}:{ordinal}"``."""
    cdef object subject = shared.subject, commit_text = shared.commit_lsn_text
    cdef object headers = shared.headers
    cdef Py_ssize_t packed_count = shared.packed_count
    cdef bytes packed = shared.packed
    cdef object operation = record.operation, old = record.old, ordinal = record.ordinal
    cdef object msg_id, data
    cdef Py_ssize_t count, lsn_size
    cdef Buffer out
    cdef char text[17]
    cdef unsigned long long lsn = record.lsn
    cdef bint truncate = operation == _TRUNCATE
    if packed is None or not PyUnicode_IS_COMPACT_ASCII(commit_text) \
            or not PyLong_Check(ordinal):
        raise TypeError("change_message: packed fields, commit LSN text and ordinal expected")
    msg_id = commit_text + ":" + str(ordinal)
    data = old if operation == _DELETE else record.new
    count = packed_count + 5 + (2 if old is not None else 0) + (2 if truncate else 0)
    out.capacity = PyBytes_GET_SIZE(packed) + 512
    out.size = 0
    out.data = <char*>PyMem_Malloc(out.capacity)
    if out.data == NULL:
        raise MemoryError()
    try:
        put_length(&out, count, 0x80, 16, 0, 0xDE, 0xDF)
        put(&out, PyBytes_AS_STRING(packed), PyBytes_GET_SIZE(packed))
        put_key(&out, b"lsn", 3)
        lsn_size = put_lsn(text, lsn)
        put_head(&out, 0xA0 | <unsigned char>lsn_size, 0, 0)
        put(&out, text, lsn_size)
        put_key(&out, b"ordinal", 7)
        pack(&out, ordinal, 1)
        put_key(&out, b"msg_id", 6)
        pack(&out, msg_id, 1)
        put_key(&out, b"data", 4)
        pack(&out, data, 1)
        put_key(&out, b"unchanged_toast", 15)
        pack(&out, record.unchanged_toast, 1)
        if old is not None:
            put_key(&out, b"old", 3)
            pack(&out, old, 1)
            put_key(&out, b"old_kind", 8)
            pack(&out, record.old_kind, 1)
        if truncate:
            put_key(&out, b"cascade", 7)
            pack(&out, record.cascade, 1)
            put_key(&out, b"restart_identity", 16)
            pack(&out, record.restart_identity, 1)
    except BaseException:
        PyMem_Free(out.data)
        raise
    return _tuple_new(message_type, (subject, msg_id, finish(&out), headers))
