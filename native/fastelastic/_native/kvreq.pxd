# Inline-only helpers of the store client (kvclient.pyx): deadlines, and a request's keys and
# values as torch's client puts them on the wire.

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_Check
from libc.stdint cimport int64_t, uint64_t
from libcpp.string cimport string

from fastelastic._native.includes.linux cimport EINTR, errno, fe_monotonic_ns, poll, pollfd
from fastelastic._native.wire cimport put_blob, put_u64


cdef extern from "Python.h":
    const char *PyUnicode_AsUTF8AndSize(object s, Py_ssize_t *size) except NULL


cdef enum:
    _NO_DEADLINE = -1
    # A reply's deadline: the socket is blocking with SO_RCVTIMEO set to the store timeout, so
    # one recv() both waits and reads (two syscalls per round trip instead of four).
    REPLY = -2
    # Acknowledgements (1 byte each) a one-way request may leave unread before it waits for
    # them.
    OWED_MAX = 4096


cdef inline int64_t _deadline(int64_t timeout_ms) noexcept nogil:
    if timeout_ms < 0:
        return _NO_DEADLINE
    return fe_monotonic_ns() + timeout_ms * 1000000


cdef inline int _poll_until(int fd, short events, int64_t deadline) noexcept nogil:
    """Waits for fd; returns 1 ready, 0 deadline passed, -1 error (errno)."""
    cdef pollfd pfd
    cdef int64_t left
    cdef int ms, rc
    pfd.fd = fd
    pfd.events = events
    while True:
        if deadline == _NO_DEADLINE:
            ms = -1
        else:
            left = deadline - fe_monotonic_ns()
            if left <= 0:
                return 0
            ms = <int>((left + 999999) // 1000000)
        rc = poll(&pfd, 1, ms)
        if rc > 0:
            return 1
        if rc == 0:
            if deadline == _NO_DEADLINE:
                continue
            return 0
        if errno == EINTR:
            return -2
        return -1


cdef inline int64_t _timeout_arg(object timeout, int64_t default_ms) except? -2:
    if timeout is None:
        return default_ms
    if hasattr(timeout, "total_seconds"):
        timeout = timeout.total_seconds()
    return <int64_t>(float(timeout) * 1000.0)


cdef inline void _put_key_to(string &out, object key) except *:
    """Appends key as a blob with torch's ``/`` prefix."""
    cdef const char *p
    cdef Py_ssize_t n
    if PyUnicode_Check(key):
        p = PyUnicode_AsUTF8AndSize(key, &n)
    elif isinstance(key, bytes):
        p = PyBytes_AS_STRING(key)
        n = PyBytes_GET_SIZE(key)
    else:
        raise TypeError(f"store keys are str, not {type(key).__name__}")
    put_u64(out, <uint64_t>n + 1)
    out.push_back(c'/')
    out.append(p, <size_t>n)


cdef inline void _put_value_to(string &out, object value) except *:
    cdef const char *p
    cdef Py_ssize_t n
    if isinstance(value, bytes):
        p = PyBytes_AS_STRING(value)
        n = PyBytes_GET_SIZE(value)
    elif PyUnicode_Check(value):
        p = PyUnicode_AsUTF8AndSize(value, &n)
    else:
        value = bytes(value)
        p = PyBytes_AS_STRING(value)
        n = PyBytes_GET_SIZE(value)
    put_blob(out, p, <size_t>n)
