# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled twin of :func:`cdc_platform.jetstream.frames.deliver_python`: the same frames to the
same sinks, without a Python object per token. Anything it does not read exactly as the pure
function would (another separator than space or tab, a number that is not plain digits, a
frame for a sid without a sink, an incomplete frame) ends the run there, and the caller's pure
path takes it from that offset.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.string cimport memcmp

cdef enum:
    MAX_TOKENS = 6


cdef inline Py_ssize_t _digits(const char* buf, Py_ssize_t start, Py_ssize_t stop):
    """The non-negative number buf[start:stop] spells in plain digits; -1 otherwise."""
    cdef Py_ssize_t value = 0
    cdef Py_ssize_t index
    cdef char c
    if stop <= start or stop - start > 15:
        return -1
    for index in range(start, stop):
        c = buf[index]
        if c < 48 or c > 57:
            return -1
        value = value * 10 + (c - 48)
    return value


def deliver(bytes data not None, Py_ssize_t position, dict sinks not None):
    cdef const char* buf = PyBytes_AS_STRING(data)
    cdef Py_ssize_t end = PyBytes_GET_SIZE(data)
    cdef Py_ssize_t starts[MAX_TOKENS]
    cdef Py_ssize_t stops[MAX_TOKENS]
    cdef Py_ssize_t line_end, index, count, sid, total, header_size, body, frame_end
    cdef bint has_headers, in_token
    cdef char c
    cdef object sink, subject, reply, headers, payload
    while position < end:
        if end - position >= 4 and memcmp(buf + position, b"MSG ", 4) == 0:
            has_headers = False
        elif end - position >= 5 and memcmp(buf + position, b"HMSG ", 5) == 0:
            has_headers = True
        else:
            break
        # the control line: tokens separated by spaces or tabs, up to CRLF
        count = 0
        in_token = False
        line_end = -1
        index = position
        while index < end:
            c = buf[index]
            if c == 13:  # \r
                if index + 1 < end and buf[index + 1] == 10:
                    line_end = index
                break
            if c == 32 or c == 9:
                if in_token:
                    stops[count - 1] = index
                    in_token = False
            elif c < 33 or c == 127:
                return position  # other whitespace or control bytes: the pure path decides
            elif not in_token:
                if count == MAX_TOKENS:
                    return position
                starts[count] = index
                count += 1
                in_token = True
            index += 1
        if line_end < 0:
            return position
        if in_token:
            stops[count - 1] = line_end
        if count != (5 if has_headers else 4) and count != (6 if has_headers else 5):
            return position
        sid = _digits(buf, starts[2], stops[2])
        total = _digits(buf, starts[count - 1], stops[count - 1])
        header_size = _digits(buf, starts[count - 2], stops[count - 2]) if has_headers else 0
        if sid < 0 or total < 0 or header_size < 0 or header_size > total:
            return position
        sink = sinks.get(sid)
        if sink is None:
            return position
        body = line_end + 2
        frame_end = body + total + 2
        if frame_end > end:
            return position
        subject = PyBytes_FromStringAndSize(buf + starts[1], stops[1] - starts[1])
        if count == (6 if has_headers else 5):
            reply = PyBytes_FromStringAndSize(buf + starts[3], stops[3] - starts[3])
        else:
            reply = b""
        headers = PyBytes_FromStringAndSize(buf + body, header_size) if header_size else None
        payload = PyBytes_FromStringAndSize(buf + body + header_size, total - header_size)
        sink(subject, reply, payload, headers)
        position = frame_end
    return position
