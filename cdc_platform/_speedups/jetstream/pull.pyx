# cython: language_level=3, boundscheck=False, wraparound=False
"""Compiled twin of ``jetstream/pull.py``'s ``sequences``: the two sequence numbers
of a ``$JS.ACK`` reply subject read in place, without splitting it into a list of tokens and
converting two of them (~5K instructions a message, a third of the mirror's reading). The same
answer, or the same error, for any bytes: a token that is not plain digits goes to ``int``."""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE

DEF MAX_DOTS = 16


cdef object _number(bytes reply, const char* chars, Py_ssize_t start, Py_ssize_t stop):
    cdef long long value = 0
    cdef Py_ssize_t index
    cdef char c
    if 0 < stop - start <= 18:
        for index in range(start, stop):
            c = chars[index]
            if c < 48 or c > 57:
                break
            value = value * 10 + (c - 48)
        else:
            return value
    return int(reply[start:stop])  # (not plain digits: what int() says, value or error)


def sequences(bytes reply not None):
    """(stream sequence, consumer sequence): the v1 form has 9 tokens, the v2 form 12."""
    cdef const char* chars = PyBytes_AS_STRING(reply)
    cdef Py_ssize_t size = PyBytes_GET_SIZE(reply)
    cdef Py_ssize_t dots[MAX_DOTS]
    cdef Py_ssize_t count = 0, index, first
    for index in range(size):
        if chars[index] == 46:  # "."
            if count == MAX_DOTS:  # more tokens than either form: the plain way
                tokens = reply.split(b".")
                first = 5 if len(tokens) == 9 else 7
                return int(tokens[first]), int(tokens[first + 1])
            dots[count] = index
            count += 1
    first = 5 if count == 8 else 7
    # token k runs from after dot k-1 to dot k (the last one to the end); checked and read
    # in the order the plain way indexes them, so a bad subject fails the same way
    if first > count:
        raise IndexError("list index out of range")
    stream_seq = _number(reply, chars, dots[first - 1] + 1,
                         dots[first] if first < count else size)
    if first + 1 > count:
        raise IndexError("list index out of range")
    return stream_seq, _number(reply, chars, dots[first] + 1,
                               dots[first + 1] if first + 1 < count else size)
