# cython: language_level=3, cdivision=True
"""Compiled twin of ``publishing/publisher.py``'s framing loop (``JetStreamPublisher.
_frame_all``): a call's messages checked and their header blocks written."""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.object cimport PyObject
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libc.string cimport memcpy

from cdc_platform._speedups.writer cimport (
    PyBytes_Check,
    PyList_Check,
    PyTuple_Check,
    PyUnicode_Check,
    PyUnicode_DATA,
    PyUnicode_GET_LENGTH,
    PyUnicode_IS_COMPACT_ASCII,
)

cdef extern from "Python.h":
    PyObject* PyDict_GetItemWithError(object d, object key) except? NULL


cdef const char* _MSG_ID_HEADER = b"NATS/1.0\r\nNats-Msg-Id: "


cdef inline bint _printable_ascii(object text) noexcept:
    """``text.isascii() and text.isprintable()`` for a non-empty compact ASCII str."""
    cdef Py_ssize_t index, size
    cdef const unsigned char* chars
    if not PyUnicode_IS_COMPACT_ASCII(text):
        return False
    size = PyUnicode_GET_LENGTH(text)
    chars = <const unsigned char*>PyUnicode_DATA(text)
    if size == 0:
        return False
    for index in range(size):
        if chars[index] < 32 or chars[index] > 126:
            return False
    return True


def frame_messages(messages, dict subjects not None, dict extras not None,
                   Py_ssize_t max_payload):
    """``JetStreamPublisher._frame_all`` for the common case -> ``(held, total, largest)``;
    None when a message needs the Python loop: a subject or header set not yet admitted
    (not in ``subjects`` / ``extras``), a message id that is not printable ASCII, a message
    over ``max_payload``. That loop then admits, or raises with the precise error."""
    cdef list held = []
    cdef Py_ssize_t total = 0, largest = 0, size, id_size, extra_size, header_size
    cdef PyObject* found
    cdef object subject, msg_id, headers, payload, extra, header
    cdef char* out
    if not PyList_Check(messages) and not PyTuple_Check(messages):
        return None  # an iterator: the Python loop must be able to go over it again
    for message in messages:
        if not PyTuple_Check(message) or PyTuple_GET_SIZE(message) != 4:
            return None
        found = PyDict_GetItemWithError(subjects, <object>PyTuple_GET_ITEM(message, 0))
        if found == NULL:
            return None
        subject = <object>found
        msg_id = <object>PyTuple_GET_ITEM(message, 1)
        payload = <object>PyTuple_GET_ITEM(message, 2)
        headers = <object>PyTuple_GET_ITEM(message, 3)
        if not PyUnicode_Check(msg_id) or not _printable_ascii(msg_id) \
                or not PyBytes_Check(payload) or not PyTuple_Check(headers):
            return None
        extra_size = 0
        if PyTuple_GET_SIZE(headers):
            found = PyDict_GetItemWithError(extras, headers)
            if found == NULL or not PyUnicode_Check(<object>found) \
                    or not PyUnicode_IS_COMPACT_ASCII(<object>found):
                return None
            extra = <object>found
            extra_size = PyUnicode_GET_LENGTH(extra)
        id_size = PyUnicode_GET_LENGTH(msg_id)
        # "NATS/1.0\r\nNats-Msg-Id: " id "\r\n" extra "\r\n"
        header_size = 23 + id_size + 2 + extra_size + 2
        size = header_size + PyBytes_GET_SIZE(payload)
        if size > max_payload:
            return None
        header = PyBytes_FromStringAndSize(NULL, header_size)
        out = PyBytes_AS_STRING(header)
        memcpy(out, _MSG_ID_HEADER, 23)
        memcpy(out + 23, PyUnicode_DATA(msg_id), id_size)
        out[23 + id_size] = 13
        out[24 + id_size] = 10
        if extra_size:
            memcpy(out + 25 + id_size, PyUnicode_DATA(extra), extra_size)
        out[header_size - 2] = 13
        out[header_size - 1] = 10
        held.append((subject, header, payload, message, size))
        total += size
        if size > largest:
            largest = size
    return held, total, largest
