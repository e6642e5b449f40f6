# distutils: language = c++
"""Epoll TCP key-value server speaking torch's TCPStore wire protocol.

Invariants:
- One thread runs ``_loop`` with the GIL released; it alone touches the maps and connections.
  Python threads only read the counters and write the wake-up eventfd.
- A request is executed only once all of its bytes are buffered (``_measure`` says how long it
  is), so execution never bounds-checks and a half-received request has no effect.
- A client that breaks the protocol loses its own connection and nothing else: the request is
  not executed, its registrations are dropped and its ``on_close`` actions run.
- ``Waiter`` entries name a connection by (fd, cid, gen) and sit in ``_waiters[key]`` only while
  that wait is pending: each connection knows where its entries are (``WaitKey.pos``), so dropping a
  wait removes them in O(1) each.
- Memory is bounded: a connection is not read while its unsent replies exceed ``max_unsent``; no
  reply is built above ``max_reply``; before its handshake a connection buffers at most 4 bytes
  and lives at most ``handshake_ms``; and when every connection's buffers together exceed
  ``buffer_budget`` the largest holder is disconnected (one log line names it).
- Connection state changes only in ``_set_state``: HANDSHAKE -> (AUTH ->) READY.
"""

cimport cython
from cpython.mem cimport PyMem_RawFree, PyMem_RawMalloc
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdio cimport snprintf
from libc.string cimport memcmp, strerror, strlen
from libcpp cimport bool as cbool
from libcpp.pair cimport pair
from libcpp.string cimport string
from libcpp.unordered_set cimport unordered_set
from libcpp.vector cimport vector

from fastelastic._native.includes.linux cimport (
    EAGAIN, EINTR, EMFILE, ENFILE, EPOLL_CLOEXEC, EPOLL_CTL_ADD, EPOLL_CTL_DEL, EPOLL_CTL_MOD,
    EPOLLERR, EPOLLHUP, EPOLLIN, EPOLLOUT, EPOLLRDHUP, EFD_CLOEXEC, EFD_NONBLOCK, FE_DEBUG,
    IPPROTO_TCP,
    MSG_NOSIGNAL, O_CLOEXEC, O_RDONLY, SOCK_CLOEXEC, SOCK_NONBLOCK, SOL_SOCKET, SO_KEEPALIVE,
    TCP_KEEPCNT, TCP_KEEPIDLE, TCP_KEEPINTVL, TCP_NODELAY, TCP_USER_TIMEOUT, F_DUPFD_CLOEXEC,
    accept4, close, fcntl,
    epoll_create1, epoll_ctl, epoll_event, epoll_wait, errno, eventfd, fe_monotonic_ns,
    fe_nofile_limit, fe_peer_name, fe_sendv, getpid, iovec, open, read, recv, send, setsockopt,
    write,
)
from fastelastic._native.kvtune cimport *
from fastelastic._native.spin cimport spin_again, spin_deadline
from fastelastic._native.wire cimport *

cdef extern from "hmac_sha256.h" nogil:
    void fe_hmac_sha256(const void *key, size_t klen, const void *a, size_t alen,
                        const void *b, size_t blen, unsigned char *out)
    int fe_equal_ct(const unsigned char *a, const unsigned char *b, size_t n)
    int fe_random(void *buf, size_t n)

import logging
import os

_log = logging.getLogger("fastelastic.store")


def hmac_sha256(bytes key, bytes a, bytes b):
    """The server's own HMAC-SHA256(key, a + b) (for tests against Python's hmac)."""
    cdef unsigned char out[32]
    fe_hmac_sha256(<const char *>key, len(key), <const char *>a, len(a), <const char *>b,
                   len(b), out)
    return out[:32]


cdef extern from *:
    """
    #define FE_TAG_WAKE 0xFFFFFFFF00000000ULL
    #define FE_TAG_LISTEN 0xFFFFFFFE00000000ULL
    #define FE_TAG_LOW 0x00000000FFFFFFFFULL
    """
    # epoll data tags: a connection's tag is its fd; these never collide with one.
    const uint64_t TAG_WAKE "FE_TAG_WAKE"
    const uint64_t TAG_LISTEN "FE_TAG_LISTEN"
    const uint64_t TAG_LOW "FE_TAG_LOW"

cdef extern from *:
    """
    #define FE_NO_POS ((size_t)-1)
    """
    const size_t NO_POS "FE_NO_POS"    # WaitKey.pos: this key's Waiter is gone already


cdef int check_rc(int rc) except -1:
    """The one rc check for syscalls made with the GIL: -1 raises OSError for errno (Python
    picks the subclass, e.g. ConnectionResetError); anything else is returned."""
    if rc < 0:
        raise OSError(errno, os.strerror(errno))
    return rc


# ------------------------------------------------------------------------- the command table
# What each command's request looks like on the wire (tcpstore-protocol.md section 2): one entry
# per command byte, read by _measure (how long a request is, which limit each length has) and by
# _gate (extensions need the capability PING). A byte without an entry is a protocol error.

cdef enum:
    SH_UNKNOWN = 0
    SH_FIXED = 1     # ``size`` bytes in all (command byte included)
    SH_BLOBS = 2     # ``nblobs`` length-prefixed blobs (a key, then values), then ``size`` bytes
    SH_MULTI = 3     # a count, then that many keys (``pairs``: key and value blobs)


cdef struct Shape:
    uint8_t kind
    uint8_t nblobs
    uint8_t size
    cbool pairs
    cbool ext        # one of our extensions


cdef Shape SHAPES[256]


cdef void _shape(uint8_t cmd, uint8_t kind, uint8_t nblobs, uint8_t size, bint pairs=False):
    SHAPES[cmd].kind = kind
    SHAPES[cmd].nblobs = nblobs
    SHAPES[cmd].size = size
    SHAPES[cmd].pairs = pairs
    SHAPES[cmd].ext = cmd >= CMD_EXT_WAIT_GET


cdef void _fill_shapes():
    cdef int c
    for c in range(256):
        SHAPES[c].kind = SH_UNKNOWN
        SHAPES[c].ext = c >= CMD_EXT_WAIT_GET
    for c in (CMD_VALIDATE, CMD_PING):
        _shape(c, SH_FIXED, 0, 5)
    _shape(CMD_EXT_AUTH, SH_FIXED, 0, 1 + AUTH_CHALLENGE_LEN)
    for c in (CMD_GETNUMKEYS, CMD_CANCEL_WAIT, CMD_LIST_KEYS):
        _shape(c, SH_FIXED, 0, 1)
    for c in (CMD_SET, CMD_APPEND, CMD_QUEUE_PUSH, CMD_EXT_ON_DISCONNECT_APPEND):
        _shape(c, SH_BLOBS, 2, 0)
    _shape(CMD_COMPARE_SET, SH_BLOBS, 3, 0)
    for c in (CMD_GET, CMD_DELETE_KEY, CMD_QUEUE_POP, CMD_QUEUE_LEN, CMD_EXT_WAIT_GET):
        _shape(c, SH_BLOBS, 1, 0)
    for c in (CMD_ADD, CMD_BARRIER):
        _shape(c, SH_BLOBS, 1, 8)
    for c in (CMD_CHECK, CMD_WAIT, CMD_MULTI_GET, CMD_EXT_TRY_MULTI_GET):
        _shape(c, SH_MULTI, 0, 0)
    _shape(CMD_MULTI_SET, SH_MULTI, 0, 0, True)


_fill_shapes()

# What one connection's state costs the server before any buffer (tests keep it from growing).
CONN_BYTES = sizeof(Conn)


cdef inline void _put_value(Conn *c, fe_entry *e) noexcept nogil:
    """A value for c's reply: a large one is streamed from the map (pinned), not copied."""
    if not c.out.put_value(e, STREAM_ABOVE):
        fe_set_oom()


cdef inline void _read_keys(const char *q, uint64_t count, vector[string] &keys) noexcept nogil:
    """Copies the keys of a measured CHECK or WAIT request at q (waits keep their keys)."""
    cdef uint64_t _j, ln
    keys.reserve(count)
    for _j in range(count):
        ln = load_u64(q)
        keys.push_back(string(q + 8, ln))
        q += 8 + ln


cdef inline void _ref_keys(const char *q, uint64_t count, vector[KeyRef] &refs,
                           bint with_values) noexcept nogil:
    """Points at (and hashes) the keys of a measured MULTI_GET, or MULTI_SET with values."""
    cdef uint64_t _j
    cdef KeyRef r
    refs.reserve(count)
    for _j in range(count):
        r.n = load_u64(q)
        r.k = q + 8
        r.h = fe_kvmap.hash(r.k, r.n)
        q += 8 + r.n
        if with_values:
            r.v = q
            q += 8 + load_u64(q)
        refs.push_back(r)


cdef class KVServer:
    """The store's server: an epoll loop over already-listening sockets.

    Args:
        listen_fds: listening TCP sockets (non-blocking); the server owns and closes them.
        max_key: longest key accepted, in bytes (wire bytes, including the client's ``/``).
        max_value: longest value accepted, in bytes.
        max_keys: most keys in one CHECK, WAIT, MULTI_GET or MULTI_SET.
        max_reply: largest reply built for one request (MULTI_GET, LIST_KEYS), in bytes; a
            request whose reply would be larger closes its connection, with a log line.
        max_unsent: a connection whose unsent replies exceed this many bytes is not read
            until they drain to half of it (backpressure on clients that do not read).
        buffer_budget: bytes all connections' buffers may hold together; above it, the
            connection holding the most is closed, with a log line naming it.
        handshake_ms: a connection that has not completed its handshake (VALIDATE, and the
            token proof when there is a token) this long after accept is closed.
        token: a shared secret; when non-empty, every client must prove it knows it
            (HMAC-SHA256 over a per-connection challenge) before any request is served.
        spin_us: how long the loop polls for the next request before it sleeps, in
            microseconds (0: sleep at once); see ``spin.pxd``.
    """

    def __cinit__(self):
        self._epfd = -1
        self._wakefd = -1
        self._spare_fd = -1
        self._rdbuf = NULL

    def __init__(self, listen_fds, *, size_t max_key=DEFAULT_MAX_KEY,
                 size_t max_value=DEFAULT_MAX_VALUE, uint64_t max_keys=DEFAULT_MAX_KEYS,
                 int64_t spin_us=0, size_t max_reply=DEFAULT_MAX_REPLY,
                 size_t max_unsent=DEFAULT_MAX_UNSENT, size_t buffer_budget=DEFAULT_BUFFER_BUDGET,
                 int64_t handshake_ms=DEFAULT_HANDSHAKE_MS, bytes token=b"",
                 int keepalive_s=0):
        cdef epoll_event ev
        cdef int fd, one = 1
        cdef uint64_t i = 0
        if max_reply < max_value + 64:
            raise ValueError(f"max_reply ({max_reply}) must exceed max_value ({max_value}): "
                             "a GET of the largest value must fit")
        if buffer_budget < max_reply:
            raise ValueError(f"buffer_budget ({buffer_budget}) must be at least max_reply "
                             f"({max_reply})")
        if handshake_ms <= 0:
            raise ValueError(f"handshake_ms must be positive, got {handshake_ms}")
        self._owner_pid = getpid()
        self._spin.budget_ns = spin_us * 1000 if spin_us > 0 else 0
        self._max_key = max_key
        self._max_value = max_value
        self._max_keys = max_keys
        self._max_reply = max_reply
        self._budget.max_unsent = max_unsent
        self._budget.limit = buffer_budget
        self._handshake_ns = handshake_ms * 1000000
        if keepalive_s < 0:
            raise ValueError(f"keepalive_s must be 0 (off) or more, got {keepalive_s}")
        self._keepalive_s = keepalive_s
        self._token = token
        self._next_cid = 1
        self._rdbuf = <char *>PyMem_RawMalloc(RDBUF_SIZE)
        if self._rdbuf == NULL:
            raise MemoryError()
        self._rdbuf_cap = RDBUF_SIZE
        self._epfd = check_rc(epoll_create1(EPOLL_CLOEXEC))
        self._wakefd = check_rc(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK))
        ev.events = EPOLLIN
        ev.data.u64 = TAG_WAKE
        check_rc(epoll_ctl(self._epfd, EPOLL_CTL_ADD, self._wakefd, &ev))
        for fd in listen_fds:
            # accepted sockets inherit TCP_NODELAY: no setsockopt per connection
            check_rc(setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)))
            ev.events = EPOLLIN
            ev.data.u64 = TAG_LISTEN | i
            check_rc(epoll_ctl(self._epfd, EPOLL_CTL_ADD, fd, &ev))
            self._listen_fds.push_back(fd)
            i += 1
        # Held in reserve so that at EMFILE we can still accept and close, instead of spinning.
        self._spare_fd = check_rc(open(b"/dev/null", O_RDONLY | O_CLOEXEC))
        self._grow_fd_table()

    cdef void _grow_fd_table(self):
        """Grows this process's fd table now to hold as many connections as RLIMIT_NOFILE
        allows (up to FD_TABLE_RESERVE; 8 bytes a slot), instead of during the first storm.

        The kernel grows the table by doubling as fds are allocated, and in a process with
        more than one thread each growth waits for an RCU grace period inside accept4
        (expand_fdtable). Measured with 19,000 clients connecting at once to a fresh server:
        accept stalled for the first ~100 ms, the 4,096-deep accept queue overflowed (4,000-
        12,000 ListenOverflows) and the storm took 3-11 s of 1 s SYN retransmissions instead
        of 0.5 s. Best effort: a lower limit only means a smaller table."""
        cdef long limit = fe_nofile_limit()
        cdef int fd
        if limit < 0 or limit > FD_TABLE_RESERVE:
            limit = FD_TABLE_RESERVE
        fd = fcntl(self._spare_fd, F_DUPFD_CLOEXEC, <int>limit - 1)
        if fd >= 0:
            close(fd)

    def serve_forever(self):
        """Runs the loop in this thread until :meth:`stop`; the GIL is released throughout."""
        if self._running:
            raise RuntimeError("KVServer is already serving")
        self._running = True
        try:
            with nogil:
                self._loop()
        finally:
            self._running = False

    def stop(self):
        """Asks the loop to return; safe from any thread."""
        cdef uint64_t one = 1
        self._stopping = True
        if self._wakefd >= 0:
            write(self._wakefd, &one, 8)

    @property
    def num_connections(self):
        return self.accepted - self.closed

    @property
    def num_keys(self):
        return self._kv.size()

    @property
    def last_error(self):
        """The reason the most recent misbehaving connection was closed, or None."""
        return None if self._last_why == NULL else self._last_why.decode()

    @property
    def buffered(self):
        """Bytes every connection's buffers hold now (what ``buffer_budget`` bounds)."""
        return self._budget.held

    @property
    def requires_token(self):
        return not self._token.empty()

    def close(self):
        """Closes every fd the server owns. Call after the loop has returned."""
        cdef size_t i
        if self._running:
            raise RuntimeError("stop() the server and wait for serve_forever() to return first")
        if self._owner_pid != getpid():
            return  # a forked child must not close its parent's sockets
        for i in range(self._conns.size()):
            if self._conns[i] != NULL:
                close(self._conns[i].fd)
                self._free_conn(self._conns[i])
                self._conns[i] = NULL
        self._conns.clear()
        self._handshakes.clear()
        self._resume.clear()
        self._budget.held = 0
        for i in range(self._listen_fds.size()):
            close(self._listen_fds[i])
        self._listen_fds.clear()
        for fd in (self._epfd, self._wakefd, self._spare_fd):
            if fd >= 0:
                close(fd)
        self._epfd = self._wakefd = self._spare_fd = -1
        self._kv.clear()
        self._queues.clear()
        self._waiters.clear()

    def __dealloc__(self):
        if self._epfd >= 0 and not self._running:
            self.close()
        if self._rdbuf != NULL:
            PyMem_RawFree(self._rdbuf)
            self._rdbuf = NULL

    # ----------------------------------------------------------------------------- the loop

    cdef int _wait(self, epoll_event *events, bint may_spin) noexcept nogil:
        """epoll_wait() for the next round: polls for up to the spin budget, then blocks."""
        cdef int64_t until = spin_deadline(&self._spin) if may_spin else 0
        cdef int n
        if until:
            n = epoll_wait(self._epfd, events, MAX_EVENTS, 0)
            while n == 0 and spin_again(&self._spin, until):
                n = epoll_wait(self._epfd, events, MAX_EVENTS, 0)
            if n != 0:
                return n
        return epoll_wait(self._epfd, events, MAX_EVENTS, self._timeout_ms())

    cdef int _timeout_ms(self) noexcept nogil:
        """How long the loop may sleep: until the oldest pending handshake expires, or -1."""
        cdef int64_t left
        if self._handshakes.empty():
            return -1
        left = self._handshakes.front().deadline - fe_monotonic_ns()
        return 0 if left <= 0 else <int>((left + 999999) // 1000000)

    cdef void _expire_handshakes(self) noexcept nogil:
        """Closes connections whose handshake deadline passed (O(1) per connection: the queue
        is in accept order, so the first unexpired entry ends the walk)."""
        cdef int64_t now = fe_monotonic_ns()
        cdef Pending p
        cdef Conn *c
        while not self._handshakes.empty():
            p = self._handshakes.front()
            c = self._lookup(p.fd, p.cid)
            if c != NULL and c.state != CONN_READY:
                if p.deadline > now:
                    return
                self._close_conn(c, "no handshake within the time limit")
            self._handshakes.pop_front()

    cdef int _loop(self) except -1 nogil:
        cdef epoll_event events[MAX_EVENTS]
        cdef int n, i, fd
        cdef size_t j
        cdef uint64_t tag, drain
        cdef Conn *c
        cdef Waiter w
        cdef size_t d
        while not self._stopping:
            # Spin only after a round that answered someone: a client waiting on a reply sends
            # its next request right after. After fire-and-forget writes (SET) nobody waits.
            n = self._wait(events, self._replied)
            self._replied = False
            if n < 0:
                if errno == EINTR:
                    continue
                with gil:
                    raise OSError(errno, os.strerror(errno))
            for i in range(n):
                if (i & 63) == 63:
                    # A long round (a connection storm): drain the accept queues every 64
                    # events, so they do not overflow into 1 s SYN retransmissions.
                    for j in range(self._listen_fds.size()):
                        self._on_accept(self._listen_fds[j])
                tag = events[i].data.u64
                if tag == TAG_WAKE:
                    read(self._wakefd, &drain, 8)
                    continue
                if (tag & TAG_LISTEN) == TAG_LISTEN:
                    self._on_accept(self._listen_fds[tag & TAG_LOW])
                    continue
                fd = <int>tag
                c = self._conns[fd] if <size_t>fd < self._conns.size() else NULL
                if c == NULL:
                    continue
                if events[i].events & (EPOLLIN | EPOLLHUP | EPOLLRDHUP | EPOLLERR):
                    if not c.paused:
                        self._on_readable(c)
                    elif events[i].events & (EPOLLHUP | EPOLLERR):
                        self._close_conn(c, NULL)
                    c = self._conns[fd]
                if c != NULL and (events[i].events & EPOLLOUT):
                    self._flush(c)
            # Replies queued for other connections by this round's writes (wake-ups). A flush
            # that fails closes its connection, whose disconnect actions may wake (and queue)
            # more waiters: the list can grow while it is walked.
            d = 0
            while d < self._dirty.size():
                w = self._dirty[d]
                d += 1
                c = self._lookup(w.fd, w.cid)
                if c != NULL:
                    c.dirty = False
                    self._flush(c)
            self._dirty.clear()
            # Connections un-paused this round: run the requests they had already sent.
            d = 0
            while d < self._resume.size():
                w = self._resume[d]
                d += 1
                c = self._lookup(w.fd, w.cid)
                if c != NULL and not c.paused and c.inb != NULL:
                    self._consume_rb(c)
                    c = self._lookup(w.fd, w.cid)
                    if c != NULL:
                        self._flush(c)
            self._resume.clear()
            if not self._handshakes.empty():
                self._expire_handshakes()
            if self._budget.over(self._kv.retired_bytes()):
                self._over_budget(NULL)
        return 0

    cdef Conn *_lookup(self, int fd, uint64_t cid) noexcept nogil:
        cdef Conn *c
        if fd < 0 or <size_t>fd >= self._conns.size():
            return NULL
        c = self._conns[fd]
        if c == NULL or c.cid != cid:
            return NULL
        return c

    cdef void _on_accept(self, int lfd) noexcept nogil:
        cdef int fd, n = 0
        cdef char msg[160]
        cdef epoll_event ev
        cdef Conn *c
        cdef Pending p
        cdef int64_t now = fe_monotonic_ns()
        while n < ACCEPT_BUDGET:
            fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC)
            if fd < 0:
                if errno == EINTR:
                    continue
                if errno == EMFILE or errno == ENFILE:
                    self._refused_fd()
                    if self._spare_fd >= 0:
                        # Shed the oldest pending connection rather than spin on it.
                        close(self._spare_fd)
                        fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC)
                        if fd >= 0:
                            close(fd)
                        self._spare_fd = open(b"/dev/null", O_RDONLY | O_CLOEXEC)
                return
            n += 1
            ev.events = EPOLLIN | EPOLLRDHUP
            ev.data.u64 = <uint64_t>fd
            if epoll_ctl(self._epfd, EPOLL_CTL_ADD, fd, &ev) < 0:
                # ENOMEM or ENOSPC (max_user_watches): this one cannot be served
                snprintf(msg, sizeof(msg), "could not watch a new connection (epoll_ctl: %s); "
                         "closed it", strerror(errno))
                self._log_conn(fd, msg)
                close(fd)
                continue
            c = self._new_conn(fd, ev.events)
            p.fd = fd
            p.cid = c.cid
            p.deadline = now + self._handshake_ns
            self._handshakes.push_back(p)
            self.accepted += 1

    cdef Conn *_new_conn(self, int fd, uint32_t events) noexcept nogil:
        """A fresh connection on fd, in CONN_HANDSHAKE, registered in _conns."""
        cdef Conn *c = new Conn()   # value-initialized: zeros, NULLs and empty buffers
        c.fd = fd
        c.cid = self._next_cid
        self._next_cid += 1
        c.state = CONN_HANDSHAKE
        c.events = events
        if <size_t>fd >= self._conns.size():
            self._conns.resize(<size_t>fd * 2 + 64, NULL)
        self._conns[fd] = c
        return c

    def execute_socketless(self, bytes frames, *, bint handshaken=True):
        """Runs the requests in ``frames`` as one client connection would, with no socket: the
        protocol core (gate, measure, the command's method) on its own, for tests.

        The connection starts after VALIDATE and the capability PING when ``handshaken``,
        else before VALIDATE; it is closed (its disconnect actions run) at the end. Only on a
        server that is not serving. Values of the streamed size and above are not in the
        replies returned.

        Returns:
            ``(replies, unconsumed, closed)``: the reply bytes, the number of trailing bytes
            of an incomplete request, and the server's reason if it closed the connection
            (else None).
        """
        cdef Conn *c
        cdef size_t used = 0
        cdef fe_scan scan
        cdef uint64_t cid
        cdef int fd
        cdef bytes out
        if self._running:
            raise RuntimeError("execute_socketless: the server is serving")
        fd = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        c = self._new_conn(fd, 0)
        cid = c.cid
        if handshaken:
            self._set_state(c, CONN_READY if self._token.empty() else CONN_AUTH)
            c.ext = True
        self._last_why = NULL
        if (self._consume(c, frames, len(frames), &scan, &used) < 0
                or self._lookup(fd, cid) == NULL):
            why = "closed" if self._last_why == NULL else self._last_why.decode("utf-8", "replace")
            return b"", 0, why
        out = c.out.bytes.substr(c.out.pos())
        self._close_conn(c, NULL)
        return out, len(frames) - used, None

    cdef void _refused_fd(self) noexcept nogil:
        """accept() ran out of fds: counted and logged (rate-limited) with the limit."""
        self.refused_fds += 1
        if self.refused_fds <= 10 or self.refused_fds % 1000 == 0:
            with gil:
                _log.error("store: out of file descriptors (RLIMIT_NOFILE %d, %d connections "
                           "open): refused a connection (%d so far). Raise the limit "
                           "(ulimit -n) on the host that runs the store.",
                           fe_nofile_limit(), self.accepted - self.closed, self.refused_fds)

    cdef void _set_state(self, Conn *c, ConnState state) noexcept nogil:
        """The one place a connection's state changes; the handshake only moves forward."""
        if FE_DEBUG and state <= c.state:
            with gil:
                raise AssertionError(f"connection state {c.state} -> {state}")
        c.state = state

    cdef int _arm(self, Conn *c) noexcept nogil:
        """Sets c's epoll mask from its state: read unless paused, write while replies wait.
        Returns -1 (c closed) if epoll_ctl fails."""
        cdef epoll_event ev
        ev.events = (0 if c.paused else EPOLLIN | EPOLLRDHUP) | (EPOLLOUT if c.out.unsent() else 0)
        if ev.events == c.events:
            return 0
        ev.data.u64 = <uint64_t>c.fd
        if epoll_ctl(self._epfd, EPOLL_CTL_MOD, c.fd, &ev) < 0:
            self._close_conn(c, "epoll_ctl failed on the connection")
            return -1
        c.events = ev.events
        return 0

    cdef void _account(self, Conn *c) noexcept nogil:
        """Re-counts c's buffers (heap bytes of its replies and of its partial request)."""
        self._budget.recount(c.counted, c.out.heap() + (c.inb.heap() if c.inb != NULL else 0))

    cdef bint _over_budget(self, Conn *c) noexcept nogil:
        """Brings the buffers back under the budget: first drops idle connections' spare
        capacity, then closes whichever connection holds the most (c included). O(connections),
        run only when the budget is exceeded. Returns True if c (may be NULL) was closed."""
        cdef size_t i, most
        cdef Conn *x
        cdef Conn *worst
        cdef uint64_t cid = c.cid if c != NULL else 0
        cdef int fd = c.fd if c != NULL else -1
        cdef char msg[160]
        for i in range(self._conns.size()):
            x = self._conns[i]
            if x != NULL and x.out.unsent() == 0 and x.out.heap() > 0:
                x.out.reset_if_sent(0)
                self._account(x)
        while self._budget.over(self._kv.retired_bytes()):
            worst = NULL
            most = 0
            for i in range(self._conns.size()):
                x = self._conns[i]
                if x != NULL and x.counted + x.out.unsent() > most:
                    worst, most = x, x.counted + x.out.unsent()
            if worst == NULL:
                break
            self.shed += 1
            snprintf(msg, sizeof(msg), "connection buffers over the budget (%zu MiB): closing the "
                     "connection that holds the most (%zu KiB)", self._budget.limit >> 20,
                     most >> 10)
            self._log_conn(worst.fd, msg)
            self._close_conn(worst, "connection buffers over the budget")
        return c != NULL and self._lookup(fd, cid) == NULL

    cdef void _log_conn(self, int fd, const char *msg) noexcept nogil:
        """One warning naming the client at fd (takes the GIL: only for rare events)."""
        cdef char peer[96]
        fe_peer_name(fd, peer, sizeof(peer))
        with gil:
            _log.warning("store: client %s: %s", peer.decode(errors="replace"),
                         msg.decode(errors="replace"))

    cdef void _on_readable(self, Conn *c) noexcept nogil:
        cdef ssize_t got
        cdef size_t used
        cdef int rounds = 0
        cdef int fd = c.fd
        cdef uint64_t cid = c.cid
        cdef char *buf
        cdef size_t room
        cdef bint direct
        cdef fe_scan scan
        while rounds < READ_BUDGET:
            rounds += 1
            direct = c.inb != NULL and c.inb.size() >= DIRECT_READ_ABOVE
            if direct:
                # A large request is partly here: read straight in behind it (no copy).
                if c.inb.room() < RDBUF_SIZE and not self._reserve_rb(c, c.inb.size() + RDBUF_SIZE):
                    return
                buf, room = c.inb.tail(), c.inb.room()
            else:
                buf, room = self._rdbuf, self._rdbuf_cap
            got = recv(fd, buf, room, 0)
            if got < 0:
                if errno == EINTR:
                    continue
                if errno == EAGAIN:
                    break
                self._close_conn(c, NULL)
                return
            if got == 0:
                self._close_conn(c, NULL)
                return
            if c.inb == NULL:
                # Common case: parse straight from the read buffer; keep only an incomplete tail.
                scan = fe_scan()
                if self._consume(c, self._rdbuf, <size_t>got, &scan, &used) < 0:
                    return
                if used < <size_t>got and not self._keep_tail(c, self._rdbuf + used,
                                                              <size_t>got - used, &scan):
                    return
            else:
                if direct:
                    c.inb.grew(<size_t>got)
                elif not self._reserve_rb(c, c.inb.size() + <size_t>got):
                    return
                else:
                    c.inb.append(self._rdbuf, <size_t>got)   # reserved: cannot fail
                if c.inb.complete():
                    self._consume_rb(c)
            c = self._lookup(fd, cid)
            if c == NULL:
                return
            if c.paused or <size_t>got < room:
                break
        self._flush(c)

    cdef bint _keep_tail(self, Conn *c, const char *p, size_t n, fe_scan *scan) noexcept nogil:
        """Buffers the first n bytes of a partial request (and how far it was measured) in a new
        c.inb; out of memory or over the budget, closes c and returns False."""
        c.inb = fe_inbuf.holding(p, n, scan[0])
        if c.inb == NULL:
            self._close_conn(c, "out of memory buffering a request")
            return False
        self._account(c)
        return not (self._budget.over(self._kv.retired_bytes()) and self._over_budget(c))

    cdef void _consume_rb(self, Conn *c) noexcept nogil:
        """Executes the complete requests buffered in c.inb; keeps only an incomplete tail."""
        cdef size_t used
        if self._consume(c, c.inb.data(), c.inb.size(), &c.inb.scan, &used) < 0:
            return
        c.inb.consume(used)
        if c.inb.size() == 0:   # the buffer lives only while a request is partial
            del c.inb
            c.inb = NULL
            self._account(c)

    cdef bint _reserve_rb(self, Conn *c, size_t want) noexcept nogil:
        """Makes c.inb hold at least want bytes; out of memory or over the budget, closes c and
        returns False."""
        if want <= c.inb.size() + c.inb.room():
            return True
        if not c.inb.reserve(want):
            self._close_conn(c, "out of memory buffering a request")
            return False
        self._account(c)
        return not (self._budget.over(self._kv.retired_bytes()) and self._over_budget(c))

    cdef int _consume(self, Conn *c, const char *p, size_t n, fe_scan *scan,
                      size_t *used) noexcept nogil:
        """Executes every complete request in p[0:n]; returns -1 if the connection was closed.

        ``scan`` carries how far a partial multi-key request at p was already measured, so a
        request that arrives in many reads is scanned once, not once per read; it is left
        saying how many bytes the next parse needs.
        """
        cdef size_t off = 0, before
        cdef ssize_t m
        cdef uint8_t cmd
        scan.need = 0
        while off < n:
            cmd = <uint8_t>p[off]
            if (c.state != CONN_READY or SHAPES[cmd].ext) and self._gate(c, cmd) < 0:
                return -1
            m = self._measure(p + off, n - off, scan)
            if m == 0:
                break
            if m < 0:
                self._close_conn(c, "malformed or over-limit request")
                return -1
            before = c.out.bytes.size()
            if self._execute(c, p + off) < 0:
                return -1
            off += <size_t>m
            if fe_take_oom():
                c.out.truncate(before, self._kv)  # no half reply: the client sees the close
                self._close_conn(c, "out of memory writing a reply")
                return -1
            if c.out.heap() > 0 or c.counted:
                self._account(c)
                if self._budget.over(self._kv.retired_bytes()) and self._over_budget(c):
                    return -1
            if self._budget.should_pause(c.out):
                # Backpressure: the client is not reading its replies; stop reading its requests
                # (the rest stays buffered) until they drain (see _flush).
                c.paused = True
                self.paused += 1
                break
        used[0] = off
        return 0

    cdef int _gate(self, Conn *c, uint8_t cmd) noexcept nogil:
        """Which requests a connection may send in its state; -1 (closed) if not this one.
        Checked on a request's first byte, before anything of it is buffered."""
        if c.state == CONN_HANDSHAKE:
            if cmd != CMD_VALIDATE:
                self._close_conn(c, "first request is not VALIDATE")
                return -1
        elif c.state == CONN_AUTH:
            if cmd != CMD_PING and cmd != CMD_EXT_AUTH:
                self._close_conn(c, "request before the token proof (this store requires a "
                                 "token: --token-file / FASTELASTIC_STORE_TOKEN_FILE)")
                return -1
        if SHAPES[cmd].ext and not c.ext:
            self._close_conn(c, "extension request before the capability PING")
            return -1
        return 0

    # ----------------------------------------------------------------------------- parsing

    @cython.boundscheck(False)
    cdef ssize_t _measure(self, const char *p, size_t n, fe_scan *scan) noexcept nogil:
        """Length of the request at p if all of it is in p[0:n]; 0 if not (scan.need says how
        many bytes must be buffered before it can be); -1 if it is malformed or over a limit."""
        cdef size_t off = 1
        cdef uint64_t count, i, ln, start = 0
        cdef const Shape *sh = &SHAPES[<uint8_t>p[0]]
        cdef size_t lim0 = self._max_key, lim1 = self._max_value
        cdef uint64_t per = 2 if sh.pairs else 1
        if sh.kind == SH_FIXED:
            off = 0   # size is all of it (below)
        elif sh.kind == SH_MULTI:
            if n < 9:
                scan.need = 9
                return 0
            count = load_u64(p + 1)
            if count > self._max_keys:
                return -1
            off = 9
            if scan.off > 0:
                off = scan.off
                start = scan.i
            for i in range(start, count * per):
                if n - off < 8:
                    scan.off = off
                    scan.i = i
                    scan.need = off + 8
                    return 0
                ln = load_u64(p + off)
                if ln > (lim1 if (sh.pairs and (i & 1)) else lim0):
                    return -1
                if n - off - 8 < ln:
                    scan.off = off
                    scan.i = i
                    scan.need = off + 8 + <size_t>ln
                    return 0
                off += 8 + <size_t>ln
            scan.off = 0
            scan.i = 0
            return <ssize_t>off
        elif sh.kind != SH_BLOBS:
            return -1
        for i in range(<uint64_t>sh.nblobs):
            if n - off < 8:
                scan.need = off + 8
                return 0
            ln = load_u64(p + off)
            if ln > (lim0 if i == 0 else lim1):
                return -1
            if n - off - 8 < ln:
                scan.need = off + 8 + ln
                return 0
            off += 8 + <size_t>ln
        off += sh.size   # a fixed request's length; ADD, BARRIER: the int64 after the key
        if n < off:
            scan.need = off
            return 0
        return <ssize_t>off

    # ----------------------------------------------------------------------------- commands

    cdef int _execute(self, Conn *c, const char *p) noexcept nogil:
        """Runs one complete request (one small method per command); returns -1 if it closed
        the connection."""
        cdef uint8_t cmd = <uint8_t>p[0]
        cdef const char *q = p + 1
        self.ops += 1
        if c.state == CONN_HANDSHAKE:   # _gate let only VALIDATE through
            if load_u32(q) != VALIDATE_MAGIC:
                self._close_conn(c, "VALIDATE without the TCPStore magic")
                return -1
            self._set_state(c, CONN_READY if self._token.empty() else CONN_AUTH)
            return 0
        if cmd == CMD_SET or cmd == CMD_APPEND:
            return self._cmd_set(c, cmd, q)
        elif cmd == CMD_GET:
            return self._cmd_get(c, cmd, q)
        elif cmd == CMD_EXT_WAIT_GET:
            return self._cmd_ext_wait_get(c, cmd, q)
        elif cmd == CMD_ADD:
            return self._cmd_add(c, cmd, q)
        elif cmd == CMD_COMPARE_SET:
            return self._cmd_compare_set(c, cmd, q)
        elif cmd == CMD_CHECK or cmd == CMD_WAIT:
            return self._cmd_check(c, cmd, q)
        elif cmd == CMD_MULTI_GET or cmd == CMD_EXT_TRY_MULTI_GET:
            return self._cmd_multi_get(c, cmd, q)
        elif cmd == CMD_MULTI_SET:
            return self._cmd_multi_set(c, cmd, q)
        elif cmd == CMD_GETNUMKEYS:
            return self._cmd_getnumkeys(c, cmd, q)
        elif cmd == CMD_DELETE_KEY:
            return self._cmd_delete_key(c, cmd, q)
        elif cmd == CMD_CANCEL_WAIT:
            return self._cmd_cancel_wait(c, cmd, q)
        elif cmd == CMD_PING:
            return self._cmd_ping(c, cmd, q)
        elif cmd == CMD_EXT_AUTH:
            return self._cmd_ext_auth(c, cmd, q)
        elif cmd == CMD_VALIDATE:
            return self._cmd_validate(c, cmd, q)
        elif cmd == CMD_QUEUE_PUSH:
            return self._cmd_queue_push(c, cmd, q)
        elif cmd == CMD_QUEUE_POP or cmd == CMD_QUEUE_LEN:
            return self._cmd_queue_pop(c, cmd, q)
        elif cmd == CMD_LIST_KEYS:
            return self._cmd_list_keys(c, cmd, q)
        elif cmd == CMD_BARRIER:
            return self._cmd_barrier(c, cmd, q)
        elif cmd == CMD_EXT_ON_DISCONNECT_APPEND:
            return self._cmd_on_disconnect(c, cmd, q)
        return 0

    cdef int _cmd_set(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil:
        """SET, APPEND."""
        cdef uint64_t ln, ln2
        cdef string key
        cdef bint stored
        ln = load_u64(q)
        key.assign(q + 8, ln)
        q += 8 + ln
        ln2 = load_u64(q)
        if cmd == CMD_SET:
            stored = self._kv.set(key, q + 8, ln2)
        else:
            stored = self._kv.append(key, q + 8, ln2)
        if not stored:
            return self._out_of_memory(c)
        self._notify(key)
        return 0

    cdef int _cmd_get(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil:
        """GET."""
        cdef uint64_t ln
        cdef string key
        cdef fe_entry * e
        ln = load_u64(q)
        key.assign(q + 8, ln)
        e = self._kv.find(key)
        if e == NULL:
            put_u64(c.out.bytes, 0)
        else:
            _put_value(c, e)
        return 0

    cdef int _cmd_ext_wait_get(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil:
        """EXT_WAIT_GET."""
        cdef uint64_t ln
        cdef string key
        cdef fe_entry * e
        # torch's get is WAIT then GET: two round trips even for a key that is there.
        ln = load_u64(q)
        key.assign(q + 8, ln)
        e = self._kv.find(key)
        if e != NULL:
            put_u8(c.out.bytes, REPLY_VALUE)
            _put_value(c, e)
        else:
            self._drop_wait(c)
            self._register_wait(c, key)
            c.wait_get = True
            c.waiting = True
            self.waiting += 1
        return 0

    cdef int _cmd_add(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil:
        """ADD."""
        cdef uint64_t ln
        cdef int64_t old
        cdef string key
        ln = load_u64(q)
        key.assign(q + 8, ln)
        if self._bump(c, key, <int64_t>load_u64(q + 8 + ln), &old) < 0:
            return -1
        put_u64(c.out.bytes, <uint64_t>old)
        self._notify(key)
        return 0

    cdef int _cmd_compare_set(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil:
        """COMPARE_SET."""
        cdef uint64_t ln, ln2, ln3
        cdef string key
        cdef fe_entry * e
        cdef uint64_t h
        ln = load_u64(q)
        key.assign(q + 8, ln)
        q += 8 + ln
        ln2 = load_u64(q)
        ln3 = load_u64(q + 8 + ln2)
        h = fe_kvmap.hash(key.data(), key.size())   # once, for the lookup and the write
        e = self._kv.find(key.data(), key.size(), h)
        if e == NULL and ln2 != 0:
            put_blob(c.out.bytes, q + 8, ln2)
        elif e != NULL and not (e.vlen == ln2 and memcmp(e.val(), q + 8, ln2) == 0):
            put_blob(c.out.bytes, e.val(), e.vlen)
            self._notify(key)
        else:
            if not self._kv.set(key.data(), key.size(), h, q + 16 + ln2, ln3):
                return self._out_of_memory(c)
            put_blob(c.out.bytes, q + 16 + ln2, ln3)
            self._notify(key)
        return 0

    cdef int _cmd_check(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil:
        """CHECK, WAIT."""
        cdef uint64_t count, i
        cdef vector[string] keys
        cdef unordered_set[string] seen
        cdef bint found
        count = load_u64(q)
        _read_keys(q + 8, count, keys)
        if cmd == CMD_CHECK:
            found = True
            for i in range(count):
                if self._missing(keys[i]):
                    found = False
                    break
            put_u8(c.out.bytes, REPLY_READY if found else REPLY_NOT_READY)
        else:
            self._drop_wait(c)
            c.wait_gen += 1
            c.wait_left = 0
            for i in range(count):
                # a duplicate key in one WAIT is satisfied by one write
                if self._missing(keys[i]) and seen.insert(keys[i]).second:
                    self._register_wait(c, keys[i])
            if c.wait_left == 0:
                put_u8(c.out.bytes, REPLY_STOP_WAITING)
            else:
                c.waiting = True
                self.waiting += 1
        return 0

    cdef int _cmd_multi_get(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil:
        """MULTI_GET, EXT_TRY_MULTI_GET."""
        cdef uint64_t count, i
        cdef vector[KeyRef] refs
        cdef vector[fe_entry *] found_vals
        cdef fe_entry * e
        cdef size_t total, inline
        count = load_u64(q)
        _ref_keys(q + 8, count, refs, False)
        found_vals.reserve(count)
        total = inline = 0
        # Pipelined lookups (see kvmap.h): slots PREFETCH_SLOT keys ahead, entries
        # PREFETCH_ENTRY ahead, so the misses of many keys overlap.
        for i in range(count):
            if i + PREFETCH_SLOT < count:
                self._kv.prefetch_slot(refs[i + PREFETCH_SLOT].h)
            if i + PREFETCH_ENTRY < count:
                self._kv.prefetch_entry(refs[i + PREFETCH_ENTRY].h)
            e = self._kv.find(refs[i].k, refs[i].n, refs[i].h)
            if e == NULL and cmd == CMD_EXT_TRY_MULTI_GET:
                put_u8(c.out.bytes, 0)
                return 0
            found_vals.push_back(e)
            if e != NULL:
                total += e.vlen
                if e.vlen < STREAM_ABOVE:
                    inline += e.vlen
        total += 8 * count
        inline += 8 * count
        if total > self._max_reply:
            return self._refuse_reply(c, total)
        if cmd == CMD_EXT_TRY_MULTI_GET:
            put_u8(c.out.bytes, 1)
        if not fe_reserve(c.out.bytes, c.out.bytes.size() + inline):
            self._close_conn(c, "out of memory for a MULTI_GET reply")
            return -1
        for i in range(count):
            e = found_vals[i]
            if e == NULL:
                put_u64(c.out.bytes, 0)
            else:
                _put_value(c, e)
        return 0

    cdef int _cmd_multi_set(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil:
        """MULTI_SET."""
        cdef uint64_t count, i
        cdef string key
        cdef vector[KeyRef] refs
        count = load_u64(q)
        _ref_keys(q + 8, count, refs, True)
        for i in range(count):   # pipelined like MULTI_GET's
            if i + PREFETCH_SLOT < count:
                self._kv.prefetch_slot(refs[i + PREFETCH_SLOT].h)
            if i + PREFETCH_ENTRY < count:
                self._kv.prefetch_entry(refs[i + PREFETCH_ENTRY].h)
            if not self._kv.set(refs[i].k, refs[i].n, refs[i].h, refs[i].v + 8,
                                load_u64(refs[i].v)):
                return self._out_of_memory(c)
            if not self._waiters.empty():
                key.assign(refs[i].k, refs[i].n)
                self._notify(key)
        return 0

    cdef int _cmd_getnumkeys(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil:
        """GETNUMKEYS."""
        put_u64(c.out.bytes, self._kv.size())
        return 0

    cdef int _cmd_delete_key(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil:
        """DELETE_KEY."""
        cdef uint64_t ln
        ln = load_u64(q)
        put_u64(c.out.bytes, 1 if self._kv.erase(q + 8, ln) else 0)
        return 0

    cdef int _cmd_cancel_wait(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil:
        """CANCEL_WAIT."""
        self._drop_wait(c)
        put_u8(c.out.bytes, REPLY_WAIT_CANCELED)
        return 0

    cdef int _cmd_ping(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil:
        """PING."""
        cdef uint32_t nonce
        nonce = load_u32(q)
        if nonce == EXT_NONCE:
            c.ext = True
            if c.state == CONN_AUTH:
                return self._challenge(c)
            nonce = ~nonce
        put_u32(c.out.bytes, nonce)
        return 0

    cdef int _cmd_ext_auth(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil:
        """EXT_AUTH."""
        return self._check_proof(c, q)

    cdef int _cmd_validate(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil:
        """VALIDATE."""
        self._close_conn(c, "VALIDATE sent twice")
        return -1

    cdef int _cmd_queue_push(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil:
        """QUEUE_PUSH."""
        cdef uint64_t ln, ln2
        cdef string key
        ln = load_u64(q)
        key.assign(q + 8, ln)
        q += 8 + ln
        ln2 = load_u64(q)
        self._queues[key].push_back(string(q + 8, ln2))
        self._notify_one(key)
        return 0

    cdef int _cmd_queue_pop(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil:
        """QUEUE_POP, QUEUE_LEN."""
        cdef uint64_t ln, count
        cdef string key, val
        ln = load_u64(q)
        key.assign(q + 8, ln)
        qit = self._queues.find(key)
        count = 0 if qit == self._queues.end() else deref_qsize(qit)
        put_u64(c.out.bytes, count)
        if cmd == CMD_QUEUE_POP and count > 0:
            pop_front_into(qit, val)
            put_blob(c.out.bytes, val.data(), val.size())
            if count == 1:
                self._queues.erase(qit)
        return 0

    cdef int _cmd_list_keys(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil:
        """LIST_KEYS."""
        cdef uint64_t i
        cdef fe_entry * e
        cdef size_t total
        total = 8
        for i in range(self._kv.capacity()):
            e = self._kv.at(i)
            if e != NULL:
                total += 8 + e.klen
        if total > self._max_reply:
            return self._refuse_reply(c, total)
        put_u64(c.out.bytes, self._kv.size())
        for i in range(self._kv.capacity()):
            e = self._kv.at(i)
            if e != NULL:
                put_blob(c.out.bytes, e.key(), e.klen)
        return 0

    cdef int _cmd_barrier(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil:
        """BARRIER."""
        cdef uint64_t ln
        cdef int64_t old, ws
        cdef string key
        ln = load_u64(q)
        key.assign(q + 8, ln)
        ws = <int64_t>load_u64(q + 8 + ln)
        if self._bump(c, key, 1, &old) < 0:   # the count is an ordinary key, as torch's
            return -1
        if old >= ws:
            self._notify(key)
            put_u8(c.out.bytes, REPLY_STOP_WAITING)
        else:
            self._drop_wait(c)
            c.wait_gen += 1
            c.wait_left = 0
            self._register_wait(c, key)
            c.waiting = True
            self.waiting += 1
        return 0

    cdef int _cmd_on_disconnect(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil:
        """EXT_ON_DISCONNECT_APPEND."""
        cdef uint64_t ln, ln2
        cdef pair[string, string] action
        ln = load_u64(q)
        action.first.assign(q + 8, ln)
        q += 8 + ln
        ln2 = load_u64(q)
        action.second.assign(q + 8, ln2)
        if c.on_close == NULL:
            c.on_close = new vector[pair[string, string]]()
            self._arm_keepalive(c)
        c.on_close.push_back(action)
        put_u8(c.out.bytes, 0)
        return 0

    cdef void _arm_keepalive(self, Conn *c) noexcept nogil:
        """Ends c within the keep-alive window of its host vanishing (no FIN: power or link
        lost), so that its disconnect actions run. Only connections that registered some: on
        every connection, probes lost in a connect storm (thousands of clients, packets
        dropped by the thousand) would reset live clients that merely wait. Best effort."""
        cdef int s = self._keepalive_s
        cdef int one = 1, idle, intvl = 1, cnt
        cdef unsigned int user_ms
        if s <= 0:
            return
        idle = s // 2 if s >= 2 else 1
        cnt = s - idle if s - idle >= 1 else 1
        user_ms = <unsigned int>s * 1000
        setsockopt(c.fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one))
        setsockopt(c.fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle))
        setsockopt(c.fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof(intvl))
        setsockopt(c.fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt))
        setsockopt(c.fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_ms, sizeof(user_ms))
    cdef int _bump(self, Conn *c, const string &key, int64_t delta, int64_t *result) noexcept nogil:
        """Adds delta to the decimal counter at key (missing is 0; wraps like int64).

        Returns -1, with the connection closed, if the value there is not a decimal integer.
        """
        cdef int64_t old = 0
        cdef string num
        cdef uint64_t h = fe_kvmap.hash(key.data(), key.size())   # once, for find and set
        cdef fe_entry *e = self._kv.find(key.data(), key.size(), h)
        if e != NULL and parse_decimal(e.val(), e.vlen, &old) < 0:
            self._close_conn(c, "ADD or BARRIER on a value that is not a decimal integer")
            return -1
        result[0] = <int64_t>(<uint64_t>old + <uint64_t>delta)
        format_decimal(num, result[0])
        if not self._kv.set(key.data(), key.size(), h, num.data(), num.size()):
            return self._out_of_memory(c)
        return 0

    cdef int _challenge(self, Conn *c) noexcept nogil:
        """Token required: answers the capability PING with a fresh random challenge."""
        if c.challenge == NULL:
            c.challenge = <char *>PyMem_RawMalloc(AUTH_CHALLENGE_LEN)
            if c.challenge == NULL:
                return self._out_of_memory(c)
        if fe_random(c.challenge, AUTH_CHALLENGE_LEN) < 0:
            self._close_conn(c, "no random bytes for a token challenge")
            return -1
        put_u32(c.out.bytes, EXT_AUTH_NONCE)
        fe_append(c.out.bytes, c.challenge, AUTH_CHALLENGE_LEN)
        return 0

    cdef int _check_proof(self, Conn *c, const char *proof) noexcept nogil:
        """EXT_AUTH: the client's HMAC of our challenge under the token; READY if it matches."""
        cdef unsigned char want[32]
        if c.state != CONN_AUTH or c.challenge == NULL:
            self._close_conn(c, "EXT_AUTH without a token challenge")
            return -1
        fe_hmac_sha256(self._token.data(), self._token.size(), AUTH_CONTEXT,
                       strlen(AUTH_CONTEXT), c.challenge, AUTH_CHALLENGE_LEN, want)
        PyMem_RawFree(c.challenge)   # one proof per challenge
        c.challenge = NULL
        if not fe_equal_ct(want, <const unsigned char *>proof, 32):
            self._log_conn(c.fd, "wrong token proof: closing the connection (is its token "
                           "file the same as the server's?)")
            self._close_conn(c, "wrong token proof")
            return -1
        self._set_state(c, CONN_READY)
        put_u8(c.out.bytes, 0)
        return 0

    cdef int _refuse_reply(self, Conn *c, size_t size) noexcept nogil:
        """A reply over max_reply is not built: the client is told by a close and the log."""
        cdef char msg[160]
        snprintf(msg, sizeof(msg), "refused a reply of %zu bytes (max_reply %zu); closing the "
                 "connection", size, self._max_reply)
        self._log_conn(c.fd, msg)
        self._close_conn(c, "reply over max_reply")
        return -1

    cdef int _out_of_memory(self, Conn *c) noexcept nogil:
        """A write the server could not allocate for: the writer's connection is closed."""
        self._close_conn(c, "out of memory storing the request's key or value")
        return -1

    # ----------------------------------------------------------------------------- waiting

    cdef int _missing(self, const string &key) noexcept nogil:
        if self._kv.find(key) != NULL:
            return 0
        qit = self._queues.find(key)
        if qit != self._queues.end() and deref_qsize(qit) > 0:
            return 0
        return 1

    cdef void _register_wait(self, Conn *c, const string &key) noexcept nogil:
        cdef Waiter w
        cdef vector[Waiter] *ws = &self._waiters[key]
        w.fd = c.fd
        w.cid = c.cid
        w.gen = c.wait_gen
        w.slot = c.wait_keys.size()
        c.wait_keys.resize(w.slot + 1)
        c.wait_keys.back().key = key
        c.wait_keys.back().pos = ws.size()
        ws.push_back(w)
        c.wait_left += 1

    cdef void _unlink_wait(self, Conn *c, size_t slot) noexcept nogil:
        """Removes c's Waiter for its slot-th wait key in O(1): the list's last entry moves into
        its place, and that entry's connection is told its new position."""
        cdef size_t pos = c.wait_keys[slot].pos
        cdef vector[Waiter] *ws
        cdef Waiter moved
        cdef Conn *o
        if pos == NO_POS:
            return
        c.wait_keys[slot].pos = NO_POS
        wit = self._waiters.find(c.wait_keys[slot].key)
        if wit == self._waiters.end():
            return
        ws = &deref_waiters(wit)
        moved = ws.back()
        ws.pop_back()
        if pos < ws.size():
            ws[0][pos] = moved
            o = self._lookup(moved.fd, moved.cid)
            if o != NULL:
                o.wait_keys[moved.slot].pos = pos
        if ws.size() == 0:
            self._waiters.erase(wit)

    cdef void _drop_wait(self, Conn *c) noexcept nogil:
        """Forgets c's pending wait and removes its entries, so no wake-up follows a cancel."""
        cdef size_t i
        for i in range(c.wait_keys.size()):
            self._unlink_wait(c, i)
        c.wait_keys.clear()
        c.wait_get = False
        if c.waiting:
            self.waiting -= 1
        c.waiting = False
        c.wait_left = 0
        c.wait_gen += 1

    cdef void _notify(self, const string &key) noexcept nogil:
        cdef vector[Waiter] ws
        cdef size_t i
        cdef Conn *c
        wit = self._waiters.find(key)
        if wit == self._waiters.end():
            return
        ws.swap(deref_waiters(wit))
        self._waiters.erase(wit)
        for i in range(ws.size()):
            c = self._lookup(ws[i].fd, ws[i].cid)
            if c == NULL or not c.waiting or c.wait_gen != ws[i].gen:
                continue
            c.wait_keys[ws[i].slot].pos = NO_POS
            c.wait_left -= 1
            if c.wait_left <= 0:
                self._finish_wait(c, ws[i])

    cdef void _finish_wait(self, Conn *c, Waiter w) noexcept nogil:
        """Answers a satisfied wait, and queues c's reply to be sent this loop round."""
        cdef string key
        if c.wait_get:
            key = c.wait_keys[0].key
            self._drop_wait(c)
            e = self._kv.find(key)
            put_u8(c.out.bytes, REPLY_VALUE)
            if e == NULL:    # woken by a queue push of the same name
                put_u64(c.out.bytes, 0)
            else:
                _put_value(c, e)
        else:
            self._drop_wait(c)
            put_u8(c.out.bytes, REPLY_STOP_WAITING)
        if not c.dirty:
            c.dirty = True
            self._dirty.push_back(w)

    cdef void _notify_one(self, const string &key) noexcept nogil:
        """A queue push satisfies one waiting consumer, not all of them."""
        cdef Conn *c
        cdef Waiter w
        wit = self._waiters.find(key)
        if wit == self._waiters.end():
            return
        w = deref_waiters(wit).front()
        c = self._lookup(w.fd, w.cid)
        if c == NULL or not c.waiting or c.wait_gen != w.gen:
            return   # not reached: only pending waits have entries
        self._unlink_wait(c, w.slot)
        c.wait_left -= 1
        if c.wait_left <= 0:
            self._finish_wait(c, w)

    # ----------------------------------------------------------------------------- output

    cdef void _flush(self, Conn *c) noexcept nogil:
        """Sends what the kernel takes of c's replies; re-arms epoll for the rest."""
        cdef ssize_t sent
        cdef Waiter w
        if c.out.streaming() and not self._flush_streamed(c):
            return
        while not c.out.streaming() and c.out.pending_size() > 0:
            sent = send(c.fd, c.out.pending(), c.out.pending_size(), MSG_NOSIGNAL)
            if sent < 0:
                if errno == EINTR:
                    continue
                if errno == EAGAIN:
                    break
                self._close_conn(c, NULL)
                return
            c.out.sent(<size_t>sent)
            self._replied = True
        c.out.reset_if_sent(SHRINK_ABOVE)
        self._account(c)
        if c.paused and self._budget.may_resume(c.out):
            c.paused = False
            if c.inb != NULL:   # requests it sent before it was paused: run them this round
                w.fd, w.cid = c.fd, c.cid
                self._resume.push_back(w)
        self._arm(c)

    cdef bint _flush_streamed(self, Conn *c) noexcept nogil:
        """Sends c's replies while they include streamed values: one sendmsg gathers the plain
        spans and the values between them. Returns False if c was closed; stops at EAGAIN."""
        cdef iovec iov[MAX_IOV]
        cdef ssize_t sent
        while c.out.streaming():
            sent = fe_sendv(c.fd, iov, c.out.gather(iov, MAX_IOV))
            if sent < 0:
                if errno == EINTR:
                    continue
                if errno == EAGAIN:
                    return True
                self._close_conn(c, NULL)
                return False
            self._replied = True
            c.out.advance(<size_t>sent, self._kv)
        return True

    cdef void _free_conn(self, Conn *c) noexcept nogil:
        """Frees c and what it holds (its fd is closed by the caller): unpins the values it
        was still streaming."""
        c.out.release(self._kv)
        PyMem_RawFree(c.challenge)
        del c.inb
        del c.on_close
        del c

    cdef void _close_conn(self, Conn *c, const char *why) noexcept nogil:
        cdef size_t i
        cdef int fd = c.fd
        cdef vector[pair[string, string]] actions
        cdef char msg[320]
        self._drop_wait(c)
        if c.on_close != NULL:
            actions.swap(c.on_close[0])
        if why != NULL:
            # The GIL only for a logged one: the first ten, then every thousandth.
            self.protocol_errors += 1
            self._last_why = why
            if self.protocol_errors <= 10 or self.protocol_errors % 1000 == 0:
                snprintf(msg, sizeof(msg), "closed its connection: %s (%llu so far)", why,
                         <unsigned long long>self.protocol_errors)
                self._log_conn(fd, msg)
        self._budget.recount(c.counted, 0)
        epoll_ctl(self._epfd, EPOLL_CTL_DEL, fd, NULL)   # no check: close() removes it anyway
        close(fd)
        self._conns[fd] = NULL
        self._free_conn(c)
        self.closed += 1
        # A disconnect is an event others may wait for (a peer that died).
        for i in range(actions.size()):
            # out of memory here loses the action; there is no connection left to tell
            if self._kv.append(actions[i].first, actions[i].second.data(),
                               actions[i].second.size()):
                self._notify(actions[i].first)


# Small C++ iterator helpers: Cython cannot spell ``it->second.size()`` directly.
cdef extern from *:
    """
    #define deref_qsize(it) ((it)->second.size())
    #define deref_waiters(it) ((it)->second)
    #define pop_front_into(it, out) \
        do { (out).swap((it)->second.front()); (it)->second.pop_front(); } while (0)
    #define PREFETCH_SLOT 16
    #define PREFETCH_ENTRY 8
    static inline bool fe_reserve(std::string &s, size_t n) {
        try { s.reserve(n); return true; } catch (...) { return false; }
    }
    """
    size_t deref_qsize(...) nogil
    vector[Waiter] &deref_waiters(...) nogil
    void pop_front_into(...) nogil
    size_t PREFETCH_SLOT
    size_t PREFETCH_ENTRY
    cbool fe_reserve(string &s, size_t n) nogil
