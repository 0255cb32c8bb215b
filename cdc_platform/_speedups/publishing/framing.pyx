# cython: language_level=3, cdivision=True
"""Compiled twin of ``publishing/framing.py``: a run of held messages framed as NATS
``HPUB``/``PUB`` protocol bytes."""

from cpython.mem cimport PyMem_Free, PyMem_Malloc

from cdc_platform._speedups.writer cimport (
    Buffer,
    PyBytes_AS_STRING,
    PyBytes_Check,
    PyBytes_FromStringAndSize,
    PyBytes_GET_SIZE,
    PyList_GET_ITEM,
    put,
    put_decimal,
)


def sequence_bytes(list held not None, bytes reply_prefix not None,
                   unsigned long long first_seq, bytes reply_suffix not None):
    """The NATS protocol bytes of ``held`` messages (``(subject, header or None, payload,
    ...)``) with reply subjects ``reply_prefix + str(seq) + reply_suffix``, seq counting up
    from ``first_seq``: ``HPUB subject reply header_size total_size\\r\\n header payload
    \\r\\n`` each (``PUB`` without headers). The pure twin is ``publishing.framing.
    sequence_bytes_python``."""
    cdef Buffer out
    cdef Py_ssize_t index, count = len(held), header_size, payload_size
    cdef unsigned long long seq = first_seq
    cdef object item, subject, header, payload
    out.capacity = 4096
    out.size = 0
    out.data = <char*>PyMem_Malloc(out.capacity)
    if out.data == NULL:
        raise MemoryError()
    try:
        for index in range(count):
            item = <object>PyList_GET_ITEM(held, index)
            subject = item[0]
            header = item[1]
            payload = item[2]
            if not PyBytes_Check(subject) or not PyBytes_Check(payload) \
                    or (header is not None and not PyBytes_Check(header)):
                raise TypeError("sequence_bytes: subject, header and payload must be bytes")
            payload_size = PyBytes_GET_SIZE(payload)
            if header is None:
                put(&out, b"PUB ", 4)
            else:
                put(&out, b"HPUB ", 5)
            put(&out, PyBytes_AS_STRING(subject), PyBytes_GET_SIZE(subject))
            put(&out, b" ", 1)
            put(&out, PyBytes_AS_STRING(reply_prefix), PyBytes_GET_SIZE(reply_prefix))
            put_decimal(&out, seq)
            put(&out, PyBytes_AS_STRING(reply_suffix), PyBytes_GET_SIZE(reply_suffix))
            put(&out, b" ", 1)
            if header is None:
                put_decimal(&out, payload_size)
                put(&out, b"\r\n", 2)
            else:
                header_size = PyBytes_GET_SIZE(header)
                put_decimal(&out, header_size)
                put(&out, b" ", 1)
                put_decimal(&out, header_size + payload_size)
                put(&out, b"\r\n", 2)
                put(&out, PyBytes_AS_STRING(header), header_size)
            put(&out, PyBytes_AS_STRING(payload), payload_size)
            put(&out, b"\r\n", 2)
            seq += 1
        return PyBytes_FromStringAndSize(out.data, out.size)
    finally:
        PyMem_Free(out.data)
