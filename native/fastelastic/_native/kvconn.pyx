# distutils: language = c++
"""The store client's connection: handshake, locks, sending, reading replies, deadlines.

The operations (``kvclient.pyx``) build requests and parse replies on top of it.

Invariants:
- ``_lock`` is held from the first byte of a request to the last byte of its reply, so threads
  sharing a client never interleave; it is acquired with the GIL released.
- ``_send_lock`` is held while a request's bytes go out. A fire-and-forget request (SET,
  APPEND, MULTI_SET, QUEUE_PUSH) made while another thread holds ``_lock`` takes only it: it
  has no reply to mix up with the other's, so it never queues behind a blocked WAIT.
- Every user key goes on the wire with torch's ``/`` prefix, so torch clients see the same keys.
- Once a reply could not be read in full the stream is out of step: the client is marked
  broken and every later call raises :class:`~fastelastic.errors.StoreConnectionError`.
- Wait timeouts are the only recoverable timeouts: the client cancels the wait and reads the
  server's acknowledgement, and the connection stays usable (protocol section 4.5).
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals
from cpython.mem cimport PyMem_RawFree, PyMem_RawRealloc
from cpython.pythread cimport (
    NOWAIT_LOCK, WAIT_LOCK, PyThread_acquire_lock, PyThread_allocate_lock, PyThread_free_lock,
    PyThread_release_lock,
)
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memmove

from fastelastic._native.includes.linux cimport (
    EAGAIN, ECONNRESET, EINTR, EMSGSIZE, EPIPE, F_GETFL, F_SETFL, IPPROTO_TCP, MSG_DONTWAIT,
    MSG_NOSIGNAL, O_NONBLOCK, POLLIN,
    SO_RCVTIMEO, SO_SNDTIMEO, SOL_SOCKET, TCP_NODELAY, close, errno, fcntl, fe_monotonic_ns,
    getpid, recv, send, setsockopt, timeval,
)
from fastelastic._native.kvreq cimport *
from fastelastic._native.spin cimport spin_again, spin_deadline
from fastelastic._native.wire cimport *

import os
import warnings

from fastelastic.errors import StoreConnectionError

cdef extern from *:
    """
    /* No reply is this long: a length above it is a broken or hostile server, not a value. */
    #define FE_MAX_IN ((size_t)1 << 40)
    #include <errno.h>
    static inline void fe_set_errno(int e) { errno = e; }
    """
    const size_t MAX_IN "FE_MAX_IN"
    void fe_set_errno(int e) nogil


class HandshakeReset(StoreConnectionError):
    """The server closed or reset the connection during the handshake (it may be shedding
    load, or it closed a handshake that took too long); connecting again may succeed."""


cdef class KVConn:
    """One connection to a TCPStore-protocol server (the mechanics of :class:`KVClient`).

    Args:
        fd: a connected TCP socket; the client owns it from now on.
        peer: ``host:port``, used in error messages.
        timeout: seconds; the default for waits, and the limit on any reply.
        spin_us: how long a request polls for its reply before it sleeps, in microseconds
            (0: sleep at once); see ``spin.pxd``.
    """

    def __cinit__(self, *args, **kwargs):
        self._fd = -1
        self._in = NULL
        self._lock = PyThread_allocate_lock()
        self._send_lock = PyThread_allocate_lock()
        if self._lock == NULL or self._send_lock == NULL:
            raise MemoryError()

    def __init__(self, int fd, str peer, double timeout, *, int64_t spin_us=0,
                 bytes token=b""):
        cdef int one = 1
        cdef uint32_t nonce
        cdef bytes challenge = None
        self._fd = fd
        self._owner_pid = getpid()
        self._peer = peer
        self._broken = False
        self._in_pos = self._in_len = 0
        self._owed = 0
        self._timeout_ms = <int64_t>(timeout * 1000.0)
        self._spin.budget_ns = spin_us * 1000 if spin_us > 0 else 0
        try:
            fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK)
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one))
            self._apply_socket_timeouts()
            self._acquire()
            try:
                self._out.clear()
                put_u8(self._out, CMD_VALIDATE)
                put_u32(self._out, VALIDATE_MAGIC)
                put_u8(self._out, CMD_PING)
                put_u32(self._out, EXT_NONCE)
                self._handshaking = True
                try:
                    self._transact(4, REPLY)
                finally:
                    self._handshaking = False
                nonce = load_u32(self._in + self._in_pos)
                self._in_pos += 4
                if nonce == EXT_AUTH_NONCE:
                    if self._need_intr(AUTH_CHALLENGE_LEN, REPLY) != IO_OK:
                        raise self._fail(IO_CLOSED, "token challenge")
                    challenge = PyBytes_FromStringAndSize(self._in + self._in_pos,
                                                          AUTH_CHALLENGE_LEN)
                    self._in_pos += AUTH_CHALLENGE_LEN
                    if token:
                        self._prove(token, challenge)
            finally:
                PyThread_release_lock(self._lock)
            if nonce == EXT_AUTH_NONCE and not token:
                self.close()
                raise StoreConnectionError(
                    f"the store at {peer} requires a token: give this client the same token file "
                    "as the server (--rdzv-conf token_file=PATH or FASTELASTIC_STORE_TOKEN_FILE)")
            if nonce == <uint32_t>(~(<uint32_t>EXT_NONCE)) or nonce == EXT_AUTH_NONCE:
                self._ext = True
            elif nonce != EXT_NONCE:
                self._broken = True
                raise StoreConnectionError(f"store at {peer} answered the handshake with a wrong "
                                           "nonce; is it a TCPStore?")
        except BaseException:
            # a client that never finished its constructor was never handed to anyone: it
            # closes its socket now, so a caller may retry and nothing is left for __dealloc__
            self._close_fd()
            raise

    cdef int _prove(self, bytes token, bytes challenge) except -1:
        """Answers the server's challenge with HMAC-SHA256(token, context + challenge); the
        token itself never goes on the wire."""
        import hmac   # here, not at import: hashlib loads OpenSSL (~4 MiB) into every process

        cdef bytes proof = hmac.new(token, AUTH_CONTEXT + challenge, "sha256").digest()
        self._out.clear()
        put_u8(self._out, CMD_EXT_AUTH)
        self._out.append(<const char *>proof, 32)
        try:
            self._transact(1, REPLY)
        except StoreConnectionError:
            raise StoreConnectionError(
                f"the store at {self._peer} rejected this client's token proof: its token file "
                "differs from the server's") from None
        self._in_pos += 1
        return 0

    cdef void _close_fd(self) noexcept:
        # only the process that made the client closes its socket (a forked child's copy goes
        # with the child; closing it would not close the parent's connection anyway)
        if self._fd >= 0 and self._owner_pid == getpid():
            close(self._fd)
        self._fd = -1

    def __dealloc__(self):
        if self._fd >= 0 and self._owner_pid == getpid():
            self._close_fd()
            # no source=self: a warning record would keep a reference to an object being freed
            warnings.warn(f"unclosed KVClient to {self._peer}: close() it when done",
                          ResourceWarning, stacklevel=1)
        self._fd = -1
        if self._in != NULL:
            PyMem_RawFree(self._in)
        if self._lock != NULL:
            PyThread_free_lock(self._lock)
        if self._send_lock != NULL:
            PyThread_free_lock(self._send_lock)

    def close(self):
        """Closes the connection (the server sees the client go)."""
        self._acquire()
        self._acquire_send()
        try:
            self._close_fd()
            self._broken = True
        finally:
            PyThread_release_lock(self._send_lock)
            PyThread_release_lock(self._lock)

    @property
    def supports_extensions(self):
        """True when the server is fastelastic's (one-round-trip get, disconnect actions)."""
        return self._ext

    @property
    def timeout_ms(self):
        return self._timeout_ms

    @timeout_ms.setter
    def timeout_ms(self, int64_t value):
        self._timeout_ms = value
        self._apply_socket_timeouts()

    cdef void _apply_socket_timeouts(self) noexcept:
        cdef timeval tv
        cdef int64_t ms = self._timeout_ms if self._timeout_ms > 0 else 1
        if self._fd < 0:
            return
        tv.tv_sec = <long>(ms // 1000)
        tv.tv_usec = <long>((ms % 1000) * 1000)
        setsockopt(self._fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv))
        setsockopt(self._fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv))

    # --------------------------------------------------------------------------- mechanics

    cdef void _acquire(self) noexcept:
        if not PyThread_acquire_lock(self._lock, NOWAIT_LOCK):
            with nogil:
                PyThread_acquire_lock(self._lock, WAIT_LOCK)

    cdef void _acquire_send(self) noexcept:
        if not PyThread_acquire_lock(self._send_lock, NOWAIT_LOCK):
            with nogil:
                PyThread_acquire_lock(self._send_lock, WAIT_LOCK)

    cdef int _send_all(self, int64_t deadline) except? -1 nogil:
        """Sends ``_out`` from ``_out_pos`` on; blocking, bounded by SO_SNDTIMEO."""
        cdef ssize_t n
        while self._out_pos < self._out.size():
            n = send(self._fd, self._out.data() + self._out_pos,
                     self._out.size() - self._out_pos, MSG_NOSIGNAL)
            if n >= 0:
                self._out_pos += <size_t>n
                continue
            if errno == EINTR:
                return IO_INTR
            if errno == EAGAIN:
                return IO_TIMEOUT
            return IO_ERROR
        return IO_OK

    cdef int _need(self, size_t n, int64_t deadline) except? -1 nogil:
        """Buffers until at least n unread reply bytes are at ``_in + _in_pos``."""
        cdef ssize_t got
        cdef size_t cap
        cdef char *grown
        cdef int rc
        if n > MAX_IN:
            fe_set_errno(EMSGSIZE)
            return IO_ERROR
        while self._in_len - self._in_pos < n:
            if self._in_pos > 0 and self._in_pos == self._in_len:
                self._in_pos = self._in_len = 0
            if self._in_pos + n > self._in_cap:
                if self._in_pos > 0:
                    memmove(self._in, self._in + self._in_pos, self._in_len - self._in_pos)
                    self._in_len -= self._in_pos
                    self._in_pos = 0
                if n > self._in_cap:
                    cap = self._in_cap * 2 if self._in_cap else 65536
                    while cap < n:
                        cap *= 2
                    grown = <char *>PyMem_RawRealloc(self._in, cap)
                    if grown == NULL:
                        return IO_ERROR
                    self._in = grown
                    self._in_cap = cap
            if deadline == REPLY:
                got = self._recv_reply()
            else:
                got = recv(self._fd, self._in + self._in_len, self._in_cap - self._in_len,
                           MSG_DONTWAIT)
            if got > 0:
                self._in_len += <size_t>got
                continue
            if got == 0:
                return IO_CLOSED
            if errno == EINTR:
                return IO_INTR
            if errno != EAGAIN:
                return IO_ERROR
            if deadline == REPLY:
                return IO_TIMEOUT
            rc = _poll_until(self._fd, POLLIN, deadline)
            if rc == 0:
                return IO_TIMEOUT
            if rc == -2:
                return IO_INTR
            if rc < 0:
                return IO_ERROR
        return IO_OK

    cdef Py_ssize_t _recv_reply(self) noexcept nogil:
        """recv() into ``_in`` for a reply: polls for up to the spin budget, then blocks."""
        cdef int64_t until = spin_deadline(&self._spin)
        cdef Py_ssize_t got
        cdef char *at = self._in + self._in_len
        cdef size_t room = self._in_cap - self._in_len
        if until:
            got = recv(self._fd, at, room, MSG_DONTWAIT)
            while got < 0 and errno == EAGAIN and spin_again(&self._spin, until):
                got = recv(self._fd, at, room, MSG_DONTWAIT)
            if got >= 0 or errno != EAGAIN:
                return got
        return recv(self._fd, at, room, 0)

    cdef bint _send_now(self) noexcept:
        """Sends what it can of ``_out`` without blocking and with the GIL held; True when
        all of it is out (errors are left to the blocking send, which reports them)."""
        cdef ssize_t k
        while self._out_pos < self._out.size():
            k = send(self._fd, self._out.data() + self._out_pos,
                     self._out.size() - self._out_pos, MSG_NOSIGNAL | MSG_DONTWAIT)
            if k <= 0:
                return False
            self._out_pos += <size_t>k
        return True

    cdef int _transact(self, size_t n, int64_t deadline, bint oneway=False) except -1:
        """Sends ``_out`` and buffers n reply bytes (0 for fire-and-forget requests).

        Only the sending holds ``_send_lock``: once the request is out, a fire-and-forget
        request of another thread may follow it on the wire (see ``_post``).

        The request is first sent without blocking and with the GIL held: it nearly always
        fits the socket buffer, and a send that cannot block is cheaper than handing the GIL
        to the process's other threads and waiting to get it back (with a thousand node
        threads in a process, that wait was most of a node's join). A ``oneway`` request
        (no reply of its own) then returns at once, leaving the acknowledgements owed by
        earlier requests for the next reply to read, up to ``OWED_MAX`` of them."""
        cdef int rc = IO_OK
        cdef bint sending = True
        if self._broken or self._fd < 0:
            raise StoreConnectionError(f"the connection to the store at {self._peer} is closed")
        if fe_take_oom():
            self._out.clear()
            raise MemoryError("out of memory building a store request")
        self._out_pos = 0
        self._reply_by = fe_monotonic_ns() + max(self._timeout_ms, 1) * 1000000
        self._acquire_send()
        try:
            if self._send_now():
                sending = False
                PyThread_release_lock(self._send_lock)
                if (oneway and self._owed <= OWED_MAX) or (n == 0 and self._owed == 0):
                    return 0  # nothing to wait for here: the GIL is kept
            while True:
                with nogil:
                    rc = IO_OK
                    if sending:
                        rc = self._send_all(deadline)
                        if rc == IO_OK:
                            sending = False
                            PyThread_release_lock(self._send_lock)
                    if not sending and self._owed > 0:  # acks owed by earlier requests
                        rc = self._need(self._owed, REPLY)
                        if rc == IO_OK:
                            self._in_pos += self._owed
                            self._owed = 0
                    if rc == IO_OK and not sending and n > 0:
                        rc = self._need(n, deadline)
                if rc != IO_INTR:
                    break
                self._check_signals()
                deadline = self._after_signal(deadline)
        finally:
            if sending:
                PyThread_release_lock(self._send_lock)
        if rc != IO_OK:
            raise self._fail(rc, "request")
        return 0

    cdef inline int64_t _after_signal(self, int64_t deadline) noexcept:
        # SO_RCVTIMEO restarts with every recv, so signals arriving faster than the timeout
        # would keep a lost reply waiting forever: once interrupted, a reply waits (poll)
        # for what is left of the request's own deadline instead.
        return self._reply_by if deadline == REPLY else deadline

    cdef int _check_signals(self) except -1:
        # A signal arrived mid-request: run Python's handlers (Ctrl-C). If one raises, the
        # request is half done and the stream out of step, so the connection is given up.
        try:
            PyErr_CheckSignals()
        except BaseException:
            self._broken = True
            raise
        return 0

    cdef int _need_intr(self, size_t n, int64_t deadline) except -1:
        cdef int rc
        while True:
            with nogil:
                rc = self._need(n, deadline)
            if rc != IO_INTR:
                return rc
            self._check_signals()
            deadline = self._after_signal(deadline)

    cdef object _fail(self, int rc, str what):
        cdef int err = errno
        self._broken = True
        if self._handshaking and (
                rc == IO_CLOSED or (rc == IO_ERROR and err in (ECONNRESET, EPIPE))):
            return HandshakeReset(
                f"store at {self._peer} closed the connection during the handshake "
                f"({'closed' if rc == IO_CLOSED else os.strerror(err)})")
        if rc == IO_TIMEOUT:
            return StoreConnectionError(
                f"store at {self._peer} did not answer a {what} within {self._timeout_ms} ms; "
                "the connection is closed")
        if rc == IO_CLOSED:
            return StoreConnectionError(
                f"store at {self._peer} closed the connection during a {what} "
                "(server gone, or it rejected the request)")
        return StoreConnectionError(
            f"connection to the store at {self._peer} failed during a {what}: "
            f"[Errno {err}] {os.strerror(err)}")

    cdef int _wait_reply(self, int64_t timeout_ms) except -1:
        """After a WAIT or BARRIER: returns 0 when released, 1 on timeout (wait cancelled)."""
        cdef int rc
        cdef bint released
        cdef uint8_t b
        rc = self._need_intr(1, _deadline(timeout_ms))
        if rc == IO_OK:
            b = <uint8_t>self._in[self._in_pos]
            self._in_pos += 1
            if b != REPLY_STOP_WAITING:
                raise self._fail(IO_CLOSED, "wait (unexpected reply)")
            return 0
        if rc != IO_TIMEOUT:
            raise self._fail(rc, "wait")
        self._out.clear()
        put_u8(self._out, CMD_CANCEL_WAIT)
        self._transact(1, REPLY)
        b = <uint8_t>self._in[self._in_pos]
        self._in_pos += 1
        released = b == REPLY_STOP_WAITING  # just before the cancel arrived: the keys are there
        if released:
            rc = self._need_intr(1, REPLY)
            if rc != IO_OK:
                raise self._fail(rc, "cancel_wait")
            b = <uint8_t>self._in[self._in_pos]
            self._in_pos += 1
        if b != REPLY_WAIT_CANCELED:
            raise self._fail(IO_CLOSED, "cancel_wait (unexpected reply)")
        return 0 if released else 1

    cdef void _put_key(self, object key) except *:
        _put_key_to(self._out, key)

    cdef void _put_value(self, object value) except *:
        _put_value_to(self._out, value)

    cdef object _take_blob(self):
        cdef uint64_t n = load_u64(self._in + self._in_pos)
        cdef object b = PyBytes_FromStringAndSize(self._in + self._in_pos + 8, <Py_ssize_t>n)
        self._in_pos += 8 + <size_t>n
        return b

    cdef int64_t _take_i64(self) noexcept:
        cdef uint64_t v = load_u64(self._in + self._in_pos)
        self._in_pos += 8
        return <int64_t>v

    cdef int _need_blobs(self, uint64_t count, size_t skip, int64_t deadline) except? -1 nogil:
        """Buffers ``count`` blobs that start ``skip`` bytes into the unread reply."""
        cdef size_t off = skip
        cdef uint64_t _i, ln
        cdef int rc
        for _i in range(count):
            rc = self._need(off + 8, deadline)
            if rc != IO_OK:
                return rc
            ln = load_u64(self._in + self._in_pos + off)
            if ln > MAX_IN:   # off + 8 + ln must not wrap
                fe_set_errno(EMSGSIZE)
                return IO_ERROR
            rc = self._need(off + 8 + <size_t>ln, deadline)
            if rc != IO_OK:
                return rc
            off += 8 + <size_t>ln
        return IO_OK

    cdef object _read_blobs(self, uint64_t count, int64_t deadline):
        cdef int rc
        while True:
            with nogil:
                rc = self._need_blobs(count, 0, deadline)
            if rc != IO_INTR:
                break
            self._check_signals()
            deadline = self._after_signal(deadline)
        if rc != IO_OK:
            raise self._fail(rc, "read")
        return [self._take_blob() for _ in range(count)]

    cdef int _begin(self, unsigned char cmd) except -1:
        self._acquire()
        self._out.clear()
        put_u8(self._out, cmd)
        return 0

    cdef void _end(self) noexcept:
        PyThread_release_lock(self._lock)

    cdef void _put_keys(self, object keys) except *:
        cdef list ks = list(keys)
        put_u64(self._out, <uint64_t>len(ks))
        for k in ks:
            self._put_key(k)

    cdef int _post(self, string &req) except -1:
        """Sends one whole fire-and-forget request without waiting for the connection.

        Used when another thread holds ``_lock``, typically blocked in a WAIT for minutes: a
        request without a reply may follow any request on the wire, and the server executes
        requests while a wait is pending, so a keep-alive never queues behind a wait. Only
        ``_send_lock`` is taken, so the bytes of two requests never interleave.
        """
        cdef size_t pos = 0
        cdef ssize_t sent
        cdef int err
        if fe_take_oom():
            raise MemoryError("out of memory building a store request")
        self._acquire_send()
        try:
            if self._broken or self._fd < 0:
                raise StoreConnectionError(
                    f"the connection to the store at {self._peer} is closed")
            while pos < req.size():
                sent = send(self._fd, req.data() + pos, req.size() - pos,
                            MSG_NOSIGNAL | MSG_DONTWAIT)  # the GIL kept, as in _transact
                err = errno
                if sent < 0 and err == EAGAIN:
                    with nogil:
                        sent = send(self._fd, req.data() + pos, req.size() - pos, MSG_NOSIGNAL)
                        err = errno
                if sent >= 0:
                    pos += <size_t>sent
                    continue
                if err == EINTR:
                    self._check_signals()
                    continue
                fe_set_errno(err)
                raise self._fail(IO_TIMEOUT if err == EAGAIN else IO_ERROR, "request")
        finally:
            PyThread_release_lock(self._send_lock)
        return 0

    cdef int _send_oneway(self, string &req) except -1:
        """Sends a whole fire-and-forget request: on the connection when it is free, else
        after whatever request holds it (``_post``), never waiting for that one's reply."""
        if not PyThread_acquire_lock(self._lock, NOWAIT_LOCK):
            return self._post(req)
        try:
            self._out.swap(req)
            self._transact(0, REPLY, True)
        finally:
            self._end()
        return 0

    cdef int _fire(self, unsigned char cmd, object key, object value) except -1:
        """A fire-and-forget request of a key and a value (SET, APPEND, QUEUE_PUSH)."""
        cdef string req
        put_u8(req, cmd)
        _put_key_to(req, key)
        _put_value_to(req, value)
        return self._send_oneway(req)
