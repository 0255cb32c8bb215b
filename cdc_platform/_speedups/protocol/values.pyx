# cython: language_level=3, cdivision=True
"""Compiled twin of ``protocol/values.py``: the ``timestamptz`` converter (the common UTC
form written without a Python call; anything else goes to the Python converter)."""

from libc.string cimport memcpy

from cdc_platform._speedups.writer cimport (
    PyUnicode_DATA,
    PyUnicode_GET_LENGTH,
    PyUnicode_IS_COMPACT_ASCII,
    ascii_text,
    date_then_space,
)

cdef object _python_timestamptz = None


def timestamptz(str text not None):
    """``values.timestamptz_python``: ``2025-12-08 13:45:21.5+00`` -> ``2025-12-08T13:45:21.5Z``;
    anything else (BC dates, infinity, other offsets, non-ASCII) the Python converter takes."""
    global _python_timestamptz
    cdef Py_ssize_t size = PyUnicode_GET_LENGTH(text)
    cdef char* chars
    cdef char buffer[64]
    if PyUnicode_IS_COMPACT_ASCII(text) and 14 < size < 64:
        chars = <char*>PyUnicode_DATA(text)
        # "...+00" in UTC: the last three characters become "Z"
        if date_then_space(chars) and chars[size - 3] == 43 and chars[size - 2] == 48 \
                and chars[size - 1] == 48:
            memcpy(buffer, chars, size - 3)
            buffer[10] = 84  # 'T'
            buffer[size - 3] = 90  # 'Z'
            return ascii_text(buffer, size - 2)
    if _python_timestamptz is None:  # (imported on first use: values.py imports this one)
        from cdc_platform.protocol.values import timestamptz_python
        _python_timestamptz = timestamptz_python
    return _python_timestamptz(text)
