# distutils: language = c++
"""Epoll TCP key-value server speaking torch's TCPStore wire protocol: the sockets and the loop.

The protocol (kvproto.pyx) and the state it acts on (kvcore.pyx) have no sockets; this layer
accepts connections, reads their bytes into the protocol, sends the replies it builds, and arms
epoll for what each connection waits for.

Invariants:
- One thread runs ``_loop`` with the GIL released; it alone touches the maps and connections.
  Python threads only read the counters and write the wake-up eventfd.
- A connection's epoll mask follows its state (``_arm``): read unless paused, write while
  replies wait.
- Before its handshake a connection lives at most ``handshake_ms`` (``_expire_handshakes``).
"""

from cpython.mem cimport PyMem_RawFree, PyMem_RawMalloc
from libc.stdint cimport int64_t, uint64_t
from libc.stdio cimport snprintf
from libc.string cimport strerror

from fastelastic._native.includes.linux cimport (
    EAGAIN, EINTR, EMFILE, ENFILE, EPOLL_CLOEXEC, EPOLL_CTL_ADD, EPOLL_CTL_DEL, EPOLL_CTL_MOD,
    EPOLLERR, EPOLLHUP, EPOLLIN, EPOLLOUT, EPOLLRDHUP, EFD_CLOEXEC, EFD_NONBLOCK,
    F_DUPFD_CLOEXEC, F_GETFL, F_SETFL, IPPROTO_TCP, MSG_NOSIGNAL, O_CLOEXEC, O_NONBLOCK,
    O_RDONLY, SOCK_CLOEXEC,
    SOCK_NONBLOCK, SOL_SOCKET, SO_KEEPALIVE, TCP_KEEPCNT, TCP_KEEPIDLE, TCP_KEEPINTVL,
    TCP_NODELAY, TCP_USER_TIMEOUT, accept4, close, epoll_create1, epoll_ctl, epoll_event,
    epoll_wait, errno, eventfd, fcntl, fe_monotonic_ns, fe_nofile_limit, fe_sendv, getpid,
    iovec, open, read, recv, send, setsockopt, write,
)
from fastelastic._native.kvbuf cimport fe_scan
from fastelastic._native.kvcore cimport CONN_READY, Pending, Waiter
from fastelastic._native.kvproto cimport KVProtocol
from fastelastic._native.kvtune cimport *
from fastelastic._native.spin cimport spin_again, spin_deadline

import logging
import os
import warnings


_log = logging.getLogger("fastelastic.store")


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


cdef int check_rc(int rc) except -1:
    """The one rc check for syscalls made with the GIL: -1 raises OSError for errno (Python
    picks the subclass, e.g. ConnectionResetError); anything else is returned."""
    if rc < 0:
        raise OSError(errno, os.strerror(errno))
    return rc


cdef class KVServer(KVProtocol):
    """The store's server: an epoll loop over already-listening sockets.

    Each fd it holds has one owner: the listening fds are the caller's until the constructor
    returns (if it raises, the caller still has them and closes them), the server's from then
    on; ``close()`` closes them, and a server collected unclosed closes them and warns
    (ResourceWarning). A forked child never closes its parent's fds.

    Args:
        listen_fds: listening TCP sockets (made non-blocking here); once constructed, the
            server owns and closes them.
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
        max_actions: most disconnect actions (EXT_ON_DISCONNECT_APPEND) one connection may
            hold; the one over it closes that connection (its actions run), with a log line.
        max_action_bytes: most bytes of them per connection (keys, values and 64 per
            action), counted in its buffers against ``buffer_budget``; over it, the same.
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
                 int keepalive_s=0, uint64_t max_actions=DEFAULT_MAX_ACTIONS,
                 size_t max_action_bytes=DEFAULT_MAX_ACTION_BYTES):
        cdef epoll_event ev
        cdef int fd, one = 1
        cdef uint64_t i = 0
        cdef vector[int] owned
        KVProtocol.__init__(self, max_key=max_key, max_value=max_value, max_keys=max_keys,
                            max_reply=max_reply, max_unsent=max_unsent,
                            buffer_budget=buffer_budget, handshake_ms=handshake_ms, token=token,
                            max_actions=max_actions, max_action_bytes=max_action_bytes)
        if keepalive_s < 0:
            raise ValueError(f"keepalive_s must be 0 (off) or more, got {keepalive_s}")
        self._owner_pid = getpid()
        self._spin.budget_ns = spin_us * 1000 if spin_us > 0 else 0
        self._keepalive_s = keepalive_s
        self._rdbuf = <char *>PyMem_RawMalloc(RDBUF_SIZE)
        if self._rdbuf == NULL:
            raise MemoryError()
        self._rdbuf_cap = RDBUF_SIZE
        try:
            self._epfd = check_rc(epoll_create1(EPOLL_CLOEXEC))
            self._wakefd = check_rc(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK))
            ev.events = EPOLLIN
            ev.data.u64 = TAG_WAKE
            check_rc(epoll_ctl(self._epfd, EPOLL_CTL_ADD, self._wakefd, &ev))
            for fd in listen_fds:
                # accepted sockets inherit TCP_NODELAY: no setsockopt per connection
                check_rc(setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)))
                # the loop accepts until EAGAIN: a blocking listener would hang it in accept4
                check_rc(fcntl(fd, F_SETFL, check_rc(fcntl(fd, F_GETFL)) | O_NONBLOCK))
                ev.events = EPOLLIN
                ev.data.u64 = TAG_LISTEN | i
                check_rc(epoll_ctl(self._epfd, EPOLL_CTL_ADD, fd, &ev))
                owned.push_back(fd)
                i += 1
            # Held in reserve so that at EMFILE we can accept and close, instead of spinning.
            self._spare_fd = check_rc(open(b"/dev/null", O_RDONLY | O_CLOEXEC))
        except BaseException:
            self._close_own_fds()   # what it made; the listening fds are still the caller's
            raise
        self._listen_fds.swap(owned)   # the server's from here on
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

    def close(self):
        """Closes every fd the server owns. Call after the loop has returned."""
        cdef size_t i
        if self._running:
            raise RuntimeError("stop() the server and wait for serve_forever() to return first")
        if self._owner_pid != getpid():
            return  # a forked child must not close its parent's sockets
        self._free_all()
        for i in range(self._listen_fds.size()):
            close(self._listen_fds[i])
        self._listen_fds.clear()
        self._close_own_fds()

    cdef void _close_own_fds(self) noexcept:
        """Closes the fds the server made itself (epoll, wake-up, spare)."""
        for fd in (self._epfd, self._wakefd, self._spare_fd):
            if fd >= 0:
                close(fd)
        self._epfd = self._wakefd = self._spare_fd = -1

    def __dealloc__(self):
        # (serve_forever holds a reference while it runs: a collected server is not serving)
        if self._epfd >= 0 and self._owner_pid == getpid():
            self.close()
            warnings.warn("unclosed KVServer: stop() it and close() it once serve_forever() "
                          "returns", ResourceWarning, stacklevel=1)
        if self._rdbuf != NULL:
            PyMem_RawFree(self._rdbuf)
            self._rdbuf = NULL

    # ------------------------------------------------------------------------------ the loop

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

    cdef void _refused_fd(self) noexcept nogil:
        """accept() ran out of fds: counted and logged (rate-limited) with the limit."""
        self.refused_fds += 1
        if self.refused_fds <= 10 or self.refused_fds % 1000 == 0:
            with gil:
                _log.error("store: out of file descriptors (RLIMIT_NOFILE %d, %d connections "
                           "open): refused a connection (%d so far). Raise the limit "
                           "(ulimit -n) on the host that runs the store.",
                           fe_nofile_limit(), self.accepted - self.closed, self.refused_fds)

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

    # --------------------------------------------------------------------------------- input

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

    cdef void _release_fd(self, int fd) noexcept nogil:
        # Out of the epoll set first: close() alone would leave it there while a forked child
        # still holds the file, and its events would name a reused fd number.
        epoll_ctl(self._epfd, EPOLL_CTL_DEL, fd, NULL)
        close(fd)

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

    # -------------------------------------------------------------------------------- output

    cdef void _flush(self, Conn *c) noexcept nogil:
        """Sends what the kernel takes of c's replies; re-arms epoll for the rest."""
        cdef ssize_t sent
        cdef Waiter w
        if c.oom:   # a wake-up reply it could not be given (see KVCore._finish_wait)
            self._close_conn(c, "out of memory writing a reply")
            return
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
