# Declarations of the store client's connection (see kvconn.pyx).

from libc.stdint cimport int64_t, uint64_t
from libcpp cimport bool as cbool
from libcpp.string cimport string
from cpython.pythread cimport PyThread_type_lock

from fastelastic._native.spin cimport Spinner


cdef enum:
    IO_OK = 0
    IO_TIMEOUT = 1
    IO_CLOSED = 2
    IO_ERROR = 3
    IO_INTR = 4


cdef class KVConn:
    cdef int _fd
    cdef int _owner_pid
    cdef PyThread_type_lock _lock
    cdef PyThread_type_lock _send_lock  # held while a request's bytes are sent
    cdef string _out          # the request being built
    cdef size_t _out_pos      # how much of it the kernel has taken
    cdef char *_in            # response bytes; [_in_pos, _in_len) not yet consumed
    cdef size_t _in_pos
    cdef size_t _in_len
    cdef size_t _in_cap
    cdef int64_t _timeout_ms
    cdef int64_t _reply_by    # monotonic ns: the current request's reply deadline
    cdef Spinner _spin
    cdef cbool _ext
    cdef cbool _broken
    cdef size_t _owed         # acknowledgements of disconnect actions not read yet
    cdef cbool _handshaking   # a reset now raises HandshakeReset (retryable)
    cdef object _peer         # "host:port", for error messages

    cdef void _close_fd(self) noexcept
    cdef void _acquire(self) noexcept
    cdef void _acquire_send(self) noexcept
    cdef int _post(self, string &req) except -1
    cdef int _send_oneway(self, string &req) except -1
    cdef void _end(self) noexcept
    cdef int _begin(self, unsigned char cmd) except -1
    cdef int _fire(self, unsigned char cmd, object key, object value) except -1
    cdef void _put_keys(self, object keys) except *
    cdef int _need_blobs(self, uint64_t count, size_t skip, int64_t deadline) except? -1 nogil
    cdef object _read_blobs(self, uint64_t count, int64_t deadline)
    cdef int _send_all(self, int64_t deadline) except? -1 nogil
    cdef int _need(self, size_t n, int64_t deadline) except? -1 nogil
    cdef Py_ssize_t _recv_reply(self) noexcept nogil
    cdef void _apply_socket_timeouts(self) noexcept
    cdef int _prove(self, bytes token, bytes challenge) except -1
    cdef int _check_signals(self) except -1
    cdef int _need_intr(self, size_t n, int64_t deadline) except -1
    cdef int64_t _after_signal(self, int64_t deadline) noexcept
    cdef bint _send_now(self) noexcept
    cdef int _transact(self, size_t n, int64_t deadline, bint oneway=*) except -1
    cdef int _wait_reply(self, int64_t timeout_ms) except -1
    cdef object _fail(self, int rc, str what)
    cdef void _put_key(self, object key) except *
    cdef void _put_value(self, object value) except *
    cdef object _take_blob(self)
    cdef int64_t _take_i64(self) noexcept
