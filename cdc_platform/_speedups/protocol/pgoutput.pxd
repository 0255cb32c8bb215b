cdef object tuple_at(const unsigned char* buf, Py_ssize_t size, Py_ssize_t* position,
                     object unchanged)
