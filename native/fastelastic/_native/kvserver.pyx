# distutils: language = c++
"""Epoll TCP key-value server speaking torch's TCPStore wire protocol.

Invariants:
- One thread runs ``_loop`` with the GIL released; it alone touches the maps and connections.
  Python threads only read the counters and write the wake-up eventfd.
- A request is executed only once all of its bytes are buffered (``_measure`` says how long it
  is), so execution never bounds-checks and a half-received request has no effect.
- A client that breaks the protocol loses its own connection and nothing else: the request is
  not executed, its registrations are dropped and its ``on_close`` actions run.
- ``Waiter`` entries name a connection by (fd, cid, gen); an entry whose connection closed or
  whose wait was cancelled or satisfied no longer matches and is ignored.
"""

cimport cython
from cpython.mem cimport PyMem_RawFree, PyMem_RawMalloc, PyMem_RawRealloc
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memmove
from libcpp cimport bool as cbool
from libcpp.pair cimport pair
from libcpp.string cimport string
from libcpp.unordered_set cimport unordered_set
from libcpp.vector cimport vector

from fastelastic._native.includes.linux cimport (
    EAGAIN, EINTR, EMFILE, ENFILE, EPOLL_CLOEXEC, EPOLL_CTL_ADD, EPOLL_CTL_DEL, EPOLL_CTL_MOD,
    EPOLLERR, EPOLLHUP, EPOLLIN, EPOLLOUT, EPOLLRDHUP, EFD_CLOEXEC, EFD_NONBLOCK, IPPROTO_TCP,
    MSG_NOSIGNAL, O_CLOEXEC, O_RDONLY, SOCK_CLOEXEC, SOCK_NONBLOCK, TCP_NODELAY, accept4, close,
    epoll_create1, epoll_ctl, epoll_event, epoll_wait, errno, eventfd, getpid, open, read, recv,
    send, setsockopt, write,
)
from fastelastic._native.spin cimport spin_again, spin_deadline
from fastelastic._native.wire cimport *

import logging
import os

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

cdef enum:
    RDBUF_SIZE = 256 * 1024
    READ_BUDGET = 4                 # recv calls per readiness event, for fairness
    MAX_EVENTS = 512
    SHRINK_ABOVE = 1 << 20          # give buffers back once they are idle and this large
    DIRECT_READ_ABOVE = 64 * 1024   # a partial request this large is read straight into c.rb


cdef inline void _set_events(int epfd, Conn *c, bint out) noexcept nogil:
    cdef epoll_event ev
    ev.events = EPOLLIN | EPOLLRDHUP | (EPOLLOUT if out else 0)
    ev.data.u64 = <uint64_t>c.fd
    epoll_ctl(epfd, EPOLL_CTL_MOD, c.fd, &ev)
    c.want_out = out


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
        spin_us: how long the loop polls for the next request before it sleeps, in
            microseconds (0: sleep at once); see ``spin.pxd``.
    """

    def __cinit__(self):
        self._epfd = -1
        self._wakefd = -1
        self._spare_fd = -1
        self._rdbuf = NULL

    def __init__(self, listen_fds, *, size_t max_key=8192, size_t max_value=8 * 1024 * 1024,
                 uint64_t max_keys=131072, int64_t spin_us=0):
        cdef epoll_event ev
        cdef int fd
        cdef uint64_t i = 0
        self._owner_pid = getpid()
        self._spin.budget_ns = spin_us * 1000 if spin_us > 0 else 0
        self._max_key = max_key
        self._max_value = max_value
        self._max_keys = max_keys
        self._next_cid = 1
        self._last_error = None
        self._rdbuf = <char *>PyMem_RawMalloc(RDBUF_SIZE)
        if self._rdbuf == NULL:
            raise MemoryError()
        self._rdbuf_cap = RDBUF_SIZE
        self._epfd = epoll_create1(EPOLL_CLOEXEC)
        if self._epfd < 0:
            raise OSError(errno, os.strerror(errno))
        self._wakefd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)
        if self._wakefd < 0:
            raise OSError(errno, os.strerror(errno))
        ev.events = EPOLLIN
        ev.data.u64 = TAG_WAKE
        epoll_ctl(self._epfd, EPOLL_CTL_ADD, self._wakefd, &ev)
        for fd in listen_fds:
            ev.events = EPOLLIN
            ev.data.u64 = TAG_LISTEN | i
            if epoll_ctl(self._epfd, EPOLL_CTL_ADD, fd, &ev) < 0:
                raise OSError(errno, os.strerror(errno))
            self._listen_fds.push_back(fd)
            i += 1
        # Held in reserve so that at EMFILE we can still accept and close, instead of spinning.
        self._spare_fd = open(b"/dev/null", O_RDONLY | O_CLOEXEC)

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
        return self._last_error

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
                PyMem_RawFree(self._conns[i].rb)
                del self._conns[i]
                self._conns[i] = NULL
        self._conns.clear()
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
        return epoll_wait(self._epfd, events, MAX_EVENTS, -1)

    cdef int _loop(self) except -1 nogil:
        cdef epoll_event events[MAX_EVENTS]
        cdef int n, i, fd
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
                    self._on_readable(c)
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
        cdef int fd, one = 1
        cdef epoll_event ev
        cdef Conn *c
        while True:
            fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC)
            if fd < 0:
                if errno == EINTR:
                    continue
                if (errno == EMFILE or errno == ENFILE) and self._spare_fd >= 0:
                    # Out of fds: shed the oldest pending connection rather than spin on it.
                    close(self._spare_fd)
                    fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC)
                    if fd >= 0:
                        close(fd)
                    self._spare_fd = open(b"/dev/null", O_RDONLY | O_CLOEXEC)
                    self.protocol_errors += 1
                return
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one))
            c = new Conn()
            c.fd = fd
            c.cid = self._next_cid
            self._next_cid += 1
            c.rb = NULL
            c.rb_len = 0
            c.rb_cap = 0
            c.need = 0
            c.scan_off = 0
            c.scan_i = 0
            c.wpos = 0
            c.validated = False
            c.ext = False
            c.dirty = False
            c.want_out = False
            c.waiting = False
            c.wait_left = 0
            c.wait_gen = 0
            c.wait_get = False
            if <size_t>fd >= self._conns.size():
                self._conns.resize(<size_t>fd * 2 + 64, NULL)
            self._conns[fd] = c
            ev.events = EPOLLIN | EPOLLRDHUP
            ev.data.u64 = <uint64_t>fd
            epoll_ctl(self._epfd, EPOLL_CTL_ADD, fd, &ev)
            self.accepted += 1

    cdef void _on_readable(self, Conn *c) noexcept nogil:
        cdef ssize_t got
        cdef size_t used
        cdef int rounds = 0
        cdef int fd = c.fd
        cdef uint64_t cid = c.cid
        cdef char *buf
        cdef size_t room
        cdef bint direct
        while rounds < READ_BUDGET:
            rounds += 1
            direct = c.rb_len >= DIRECT_READ_ABOVE
            if direct:
                # A large request is partly here: read straight in behind it (no copy), growing
                # the buffer geometrically (realloc of a large block remaps, it does not copy).
                if c.rb_cap - c.rb_len < RDBUF_SIZE and not self._grow_rb(c, c.rb_len + RDBUF_SIZE):
                    return
                buf, room = c.rb + c.rb_len, c.rb_cap - c.rb_len
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
            if c.rb_len == 0:
                # Common case: parse straight from the read buffer; keep only an incomplete tail.
                if self._consume(c, self._rdbuf, <size_t>got, &used) < 0:
                    return
                if used < <size_t>got:
                    # Only what arrived: a length prefix claiming megabytes reserves nothing.
                    if not self._grow_rb(c, <size_t>got - used):
                        return
                    memcpy(c.rb, self._rdbuf + used, <size_t>got - used)
                    c.rb_len = <size_t>got - used
            else:
                if not direct:
                    if not self._grow_rb(c, c.rb_len + <size_t>got):
                        return
                    memcpy(c.rb + c.rb_len, self._rdbuf, <size_t>got)
                c.rb_len += <size_t>got
                if c.rb_len >= c.need:
                    if self._consume(c, c.rb, c.rb_len, &used) < 0:
                        return
                    if used > 0:
                        memmove(c.rb, c.rb + used, c.rb_len - used)
                        c.rb_len -= used
                    if c.rb_len == 0:   # the buffer lives only while a request is partial
                        PyMem_RawFree(c.rb)
                        c.rb = NULL
                        c.rb_cap = 0
            if self._lookup(fd, cid) == NULL:
                return
            if <size_t>got < room:
                break
        self._flush(c)

    cdef bint _grow_rb(self, Conn *c, size_t want) noexcept nogil:
        """Makes c.rb hold at least want bytes; out of memory, closes c and returns False."""
        cdef size_t cap = c.rb_cap * 2
        cdef char *grown
        if want <= c.rb_cap:
            return True
        if cap < want:
            cap = want
        grown = <char *>PyMem_RawRealloc(c.rb, cap)
        if grown == NULL:
            self._close_conn(c, "out of memory buffering a request")
            return False
        c.rb = grown
        c.rb_cap = cap
        return True

    cdef int _consume(self, Conn *c, const char *p, size_t n, size_t *used) noexcept nogil:
        """Executes every complete request in p[0:n]; returns -1 if the connection was closed.

        ``c.scan_off``/``c.scan_i`` carry how far a partial multi-key request at p was already
        measured, so a request that arrives in many reads is scanned once, not once per read.
        """
        cdef size_t off = 0, need = 0
        cdef ssize_t m
        c.need = 0
        while off < n:
            m = self._measure(p + off, n - off, &need, &c.scan_off, &c.scan_i)
            if m == 0:
                c.need = need
                break
            if m < 0:
                self._close_conn(c, "malformed or over-limit request")
                return -1
            if self._execute(c, p + off) < 0:
                return -1
            off += <size_t>m
        used[0] = off
        return 0

    # ----------------------------------------------------------------------------- parsing

    @cython.boundscheck(False)
    cdef ssize_t _measure(self, const char *p, size_t n, size_t *need, size_t *scan_off,
                          uint64_t *scan_i) noexcept nogil:
        """Length of the request at p if all of it is in p[0:n]; 0 if not (need says how many
        bytes must be buffered before it can be); -1 if it is malformed or over a limit."""
        cdef size_t off = 1
        cdef uint64_t count, i, ln, start = 0
        cdef uint8_t cmd = <uint8_t>p[0]
        cdef int nblobs = 0
        cdef size_t lim0 = self._max_key, lim1 = self._max_value
        if cmd == CMD_VALIDATE or cmd == CMD_PING:
            off = 5
        elif cmd == CMD_GETNUMKEYS or cmd == CMD_CANCEL_WAIT or cmd == CMD_LIST_KEYS:
            off = 1
        elif cmd == CMD_SET or cmd == CMD_APPEND or cmd == CMD_QUEUE_PUSH \
                or cmd == CMD_EXT_ON_DISCONNECT_APPEND:
            nblobs = 2
        elif cmd == CMD_COMPARE_SET:
            nblobs = 3
        elif cmd == CMD_GET or cmd == CMD_DELETE_KEY or cmd == CMD_QUEUE_POP \
                or cmd == CMD_QUEUE_LEN or cmd == CMD_EXT_WAIT_GET:
            nblobs = 1
        elif cmd == CMD_ADD or cmd == CMD_BARRIER:
            nblobs = 1
        elif cmd == CMD_CHECK or cmd == CMD_WAIT or cmd == CMD_MULTI_GET \
                or cmd == CMD_MULTI_SET or cmd == CMD_EXT_TRY_MULTI_GET:
            if n < 9:
                need[0] = 9
                return 0
            count = load_u64(p + 1)
            if count > self._max_keys:
                return -1
            off = 9
            if scan_off[0] > 0:
                off = scan_off[0]
                start = scan_i[0]
            for i in range(start, count if cmd != CMD_MULTI_SET else count * 2):
                if n - off < 8:
                    scan_off[0] = off
                    scan_i[0] = i
                    need[0] = off + 8
                    return 0
                ln = load_u64(p + off)
                if ln > (lim1 if (cmd == CMD_MULTI_SET and (i & 1)) else lim0):
                    return -1
                if n - off - 8 < ln:
                    scan_off[0] = off
                    scan_i[0] = i
                    need[0] = off + 8 + <size_t>ln
                    return 0
                off += 8 + <size_t>ln
            scan_off[0] = 0
            scan_i[0] = 0
            return <ssize_t>off
        else:
            return -1
        for i in range(<uint64_t>nblobs):
            if n - off < 8:
                need[0] = off + 8
                return 0
            ln = load_u64(p + off)
            if ln > (lim0 if i == 0 else lim1):
                return -1
            if n - off - 8 < ln:
                need[0] = off + 8 + ln
                return 0
            off += 8 + <size_t>ln
        if cmd == CMD_ADD or cmd == CMD_BARRIER:
            off += 8
        if n < off:
            need[0] = off
            return 0
        return <ssize_t>off

    # ----------------------------------------------------------------------------- commands

    cdef int _execute(self, Conn *c, const char *p) noexcept nogil:
        """Runs one complete request; returns -1 if it closed the connection."""
        cdef uint8_t cmd = <uint8_t>p[0]
        cdef const char *q = p + 1
        cdef uint64_t ln, ln2, ln3, count, i
        cdef int64_t old, ws
        cdef uint32_t nonce
        cdef string key, val
        cdef vector[string] keys
        cdef unordered_set[string] seen
        cdef vector[KeyRef] refs
        cdef vector[fe_entry *] found_vals
        cdef fe_entry *e
        cdef bint stored
        cdef uint64_t h
        cdef size_t total
        cdef bint found
        cdef pair[string, string] action
        self.ops += 1
        if not c.validated:
            if cmd != CMD_VALIDATE or load_u32(q) != VALIDATE_MAGIC:
                self._close_conn(c, "first request is not VALIDATE with the TCPStore magic")
                return -1
            c.validated = True
            return 0
        if cmd == CMD_SET or cmd == CMD_APPEND:
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
        elif cmd == CMD_GET:
            ln = load_u64(q)
            key.assign(q + 8, ln)
            e = self._kv.find(key)
            if e == NULL:
                put_u64(c.wbuf, 0)
            else:
                put_blob(c.wbuf, e.val(), e.vlen)
        elif cmd == CMD_EXT_WAIT_GET:
            # torch's get is WAIT then GET: two round trips even for a key that is there.
            ln = load_u64(q)
            key.assign(q + 8, ln)
            e = self._kv.find(key)
            if e != NULL:
                put_u8(c.wbuf, REPLY_VALUE)
                put_blob(c.wbuf, e.val(), e.vlen)
            else:
                self._drop_wait(c)
                self._register_wait(c, key)
                c.wait_get = True
                c.waiting = True
                self.waiting += 1
        elif cmd == CMD_ADD:
            ln = load_u64(q)
            key.assign(q + 8, ln)
            if self._bump(c, key, <int64_t>load_u64(q + 8 + ln), &old) < 0:
                return -1
            put_u64(c.wbuf, <uint64_t>old)
            self._notify(key)
        elif cmd == CMD_COMPARE_SET:
            ln = load_u64(q)
            key.assign(q + 8, ln)
            q += 8 + ln
            ln2 = load_u64(q)
            ln3 = load_u64(q + 8 + ln2)
            h = fe_kvmap.hash(key.data(), key.size())   # once, for the lookup and the write
            e = self._kv.find(key.data(), key.size(), h)
            if e == NULL and ln2 != 0:
                put_blob(c.wbuf, q + 8, ln2)
            elif e != NULL and not (e.vlen == ln2 and memcmp(e.val(), q + 8, ln2) == 0):
                put_blob(c.wbuf, e.val(), e.vlen)
                self._notify(key)
            else:
                if not self._kv.set(key.data(), key.size(), h, q + 16 + ln2, ln3):
                    return self._out_of_memory(c)
                put_blob(c.wbuf, q + 16 + ln2, ln3)
                self._notify(key)
        elif cmd == CMD_CHECK or cmd == CMD_WAIT:
            count = load_u64(q)
            _read_keys(q + 8, count, keys)
            if cmd == CMD_CHECK:
                found = True
                for i in range(count):
                    if self._missing(keys[i]):
                        found = False
                        break
                put_u8(c.wbuf, REPLY_READY if found else REPLY_NOT_READY)
            else:
                self._drop_wait(c)
                c.wait_gen += 1
                c.wait_left = 0
                for i in range(count):
                    # a duplicate key in one WAIT is satisfied by one write
                    if self._missing(keys[i]) and seen.insert(keys[i]).second:
                        self._register_wait(c, keys[i])
                if c.wait_left == 0:
                    put_u8(c.wbuf, REPLY_STOP_WAITING)
                else:
                    c.waiting = True
                    self.waiting += 1
        elif cmd == CMD_MULTI_GET or cmd == CMD_EXT_TRY_MULTI_GET:
            count = load_u64(q)
            _ref_keys(q + 8, count, refs, False)
            found_vals.reserve(count)
            total = 0
            # Pipelined lookups (see kvmap.h): slots PREFETCH_SLOT keys ahead, entries
            # PREFETCH_ENTRY ahead, so the misses of many keys overlap.
            for i in range(count):
                if i + PREFETCH_SLOT < count:
                    self._kv.prefetch_slot(refs[i + PREFETCH_SLOT].h)
                if i + PREFETCH_ENTRY < count:
                    self._kv.prefetch_entry(refs[i + PREFETCH_ENTRY].h)
                e = self._kv.find(refs[i].k, refs[i].n, refs[i].h)
                if e == NULL and cmd == CMD_EXT_TRY_MULTI_GET:
                    put_u8(c.wbuf, 0)
                    return 0
                found_vals.push_back(e)
                total += 8 + (e.vlen if e != NULL else 0)
            if cmd == CMD_EXT_TRY_MULTI_GET:
                put_u8(c.wbuf, 1)
            if total > MAX_REPLY or not fe_reserve(c.wbuf, c.wbuf.size() + total):
                self._close_conn(c, "MULTI_GET reply too large for memory")
                return -1
            for i in range(count):
                e = found_vals[i]
                if e == NULL:
                    put_u64(c.wbuf, 0)
                else:
                    put_blob(c.wbuf, e.val(), e.vlen)
        elif cmd == CMD_MULTI_SET:
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
        elif cmd == CMD_GETNUMKEYS:
            put_u64(c.wbuf, self._kv.size())
        elif cmd == CMD_DELETE_KEY:
            ln = load_u64(q)
            put_u64(c.wbuf, 1 if self._kv.erase(q + 8, ln) else 0)
        elif cmd == CMD_CANCEL_WAIT:
            self._drop_wait(c)
            put_u8(c.wbuf, REPLY_WAIT_CANCELED)
        elif cmd == CMD_PING:
            nonce = load_u32(q)
            if nonce == EXT_NONCE:
                c.ext = True
                nonce = ~nonce
            put_u32(c.wbuf, nonce)
        elif cmd == CMD_VALIDATE:
            self._close_conn(c, "VALIDATE sent twice")
            return -1
        elif cmd == CMD_QUEUE_PUSH:
            ln = load_u64(q)
            key.assign(q + 8, ln)
            q += 8 + ln
            ln2 = load_u64(q)
            self._queues[key].push_back(string(q + 8, ln2))
            self._notify_one(key)
        elif cmd == CMD_QUEUE_POP or cmd == CMD_QUEUE_LEN:
            ln = load_u64(q)
            key.assign(q + 8, ln)
            qit = self._queues.find(key)
            count = 0 if qit == self._queues.end() else deref_qsize(qit)
            put_u64(c.wbuf, count)
            if cmd == CMD_QUEUE_POP and count > 0:
                pop_front_into(qit, val)
                put_blob(c.wbuf, val.data(), val.size())
                if count == 1:
                    self._queues.erase(qit)
        elif cmd == CMD_LIST_KEYS:
            put_u64(c.wbuf, self._kv.size())
            for i in range(self._kv.capacity()):
                e = self._kv.at(i)
                if e != NULL:
                    put_blob(c.wbuf, e.key(), e.klen)
        elif cmd == CMD_BARRIER:
            ln = load_u64(q)
            key.assign(q + 8, ln)
            ws = <int64_t>load_u64(q + 8 + ln)
            if self._bump(c, key, 1, &old) < 0:   # the count is an ordinary key, as torch's
                return -1
            if old >= ws:
                self._notify(key)
                put_u8(c.wbuf, REPLY_STOP_WAITING)
            else:
                self._drop_wait(c)
                c.wait_gen += 1
                c.wait_left = 0
                self._register_wait(c, key)
                c.waiting = True
                self.waiting += 1
        elif cmd == CMD_EXT_ON_DISCONNECT_APPEND:
            ln = load_u64(q)
            action.first.assign(q + 8, ln)
            q += 8 + ln
            ln2 = load_u64(q)
            action.second.assign(q + 8, ln2)
            c.on_close.push_back(action)
            put_u8(c.wbuf, 0)
        return 0

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
        w.fd = c.fd
        w.cid = c.cid
        w.gen = c.wait_gen
        self._waiters[key].push_back(w)
        c.wait_keys.push_back(key)
        c.wait_left += 1

    cdef void _drop_wait(self, Conn *c) noexcept nogil:
        """Forgets c's pending wait and removes its entries, so no wake-up follows a cancel."""
        cdef size_t i, j
        cdef vector[Waiter] *ws
        for i in range(c.wait_keys.size()):
            wit = self._waiters.find(c.wait_keys[i])
            if wit == self._waiters.end():
                continue
            ws = &deref_waiters(wit)
            j = 0
            while j < ws.size():
                if ws[0][j].cid == c.cid:
                    ws[0][j] = ws.back()
                    ws.pop_back()
                else:
                    j += 1
            if ws.size() == 0:
                self._waiters.erase(wit)
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
            c.wait_left -= 1
            if c.wait_left <= 0:
                self._finish_wait(c, ws[i])

    cdef void _finish_wait(self, Conn *c, Waiter w) noexcept nogil:
        """Answers a satisfied wait, and queues c's reply to be sent this loop round."""
        cdef string key
        if c.wait_get:
            key = c.wait_keys[0]
            self._drop_wait(c)
            e = self._kv.find(key)
            put_u8(c.wbuf, REPLY_VALUE)
            if e == NULL:    # woken by a queue push of the same name
                put_u64(c.wbuf, 0)
            else:
                put_blob(c.wbuf, e.val(), e.vlen)
        else:
            self._drop_wait(c)
            put_u8(c.wbuf, REPLY_STOP_WAITING)
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
        while deref_waiters(wit).size() > 0:
            w = deref_waiters(wit).front()
            deref_waiters(wit).erase(deref_waiters(wit).begin())
            c = self._lookup(w.fd, w.cid)
            if c == NULL or not c.waiting or c.wait_gen != w.gen:
                continue
            c.wait_left -= 1
            if c.wait_left <= 0:
                self._finish_wait(c, w)
            break
        wit = self._waiters.find(key)
        if wit != self._waiters.end() and deref_waiters(wit).size() == 0:
            self._waiters.erase(wit)

    # ----------------------------------------------------------------------------- output

    cdef void _flush(self, Conn *c) noexcept nogil:
        cdef ssize_t sent
        cdef size_t left
        while c.wpos < c.wbuf.size():
            left = c.wbuf.size() - c.wpos
            sent = send(c.fd, c.wbuf.data() + c.wpos, left, MSG_NOSIGNAL)
            if sent < 0:
                if errno == EINTR:
                    continue
                if errno == EAGAIN:
                    if not c.want_out:
                        _set_events(self._epfd, c, True)
                    return
                self._close_conn(c, NULL)
                return
            c.wpos += <size_t>sent
            self._replied = True
        c.wbuf.clear()
        c.wpos = 0
        if c.wbuf.capacity() > SHRINK_ABOVE:
            string().swap(c.wbuf)
        if c.want_out:
            _set_events(self._epfd, c, False)

    cdef void _close_conn(self, Conn *c, const char *why) noexcept nogil:
        cdef size_t i
        cdef int fd = c.fd
        cdef vector[pair[string, string]] actions
        self._drop_wait(c)
        actions.swap(c.on_close)
        epoll_ctl(self._epfd, EPOLL_CTL_DEL, fd, NULL)
        close(fd)
        self._conns[fd] = NULL
        PyMem_RawFree(c.rb)
        del c
        self.closed += 1
        if why != NULL:
            self.protocol_errors += 1
            with gil:
                try:
                    self._last_error = why.decode()
                    if self.protocol_errors <= 10 or self.protocol_errors % 1000 == 0:
                        _log.warning("store: closed a client connection: %s (%d so far)",
                                     self._last_error, self.protocol_errors)
                except BaseException:
                    pass
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
    #define FE_MAX_REPLY ((size_t)1 << 32)
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
    size_t MAX_REPLY "FE_MAX_REPLY"   # largest MULTI_GET reply built (4 GiB)
