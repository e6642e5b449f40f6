# distutils: language = c++
"""The store server's state: connections, the key-value map, waits, and the buffer budget.

KVCore holds what a request acts on and what a connection owns; KVProtocol (kvproto.pyx) adds
the wire protocol and KVServer (kvserver.pyx) the sockets and the epoll loop, as asyncpg's
coreproto and protocol are layered.

Invariants:
- One thread runs the server's loop with the GIL released; it alone touches the maps and
  connections. Python threads only read the counters.
- A connection is named by (fd, cid): ``_lookup`` returns NULL for a closed one, even if its
  fd number was reused.
- ``Waiter`` entries name a connection by (fd, cid, gen) and sit in ``_waiters[key]`` only while
  that wait is pending: each connection knows where its entries are (``WaitKey.pos``), so
  dropping a wait removes them in O(1) each.
- Closing a connection drops its waits, frees what it holds, then runs its disconnect actions
  (which may wake others): nothing of a closed connection is left behind.
- Connection state changes only in ``_set_state``: HANDSHAKE -> (AUTH ->) READY.
- Out of memory is the error of the connection whose reply could not be built: that reply is
  taken back whole and that connection closed; the writer that woke it and every other
  connection are served on.
"""

from cpython.mem cimport PyMem_RawFree
from libc.stdint cimport uint32_t, uint64_t
from libc.stdio cimport snprintf
from libcpp.pair cimport pair
from libcpp.string cimport string
from libcpp.vector cimport vector

from fastelastic._native.includes.linux cimport FE_DEBUG, close, fe_peer_name
from fastelastic._native.wire cimport (
    REPLY_STOP_WAITING, REPLY_VALUE, fe_take_oom, put_u8, put_u64,
)

import logging

_log = logging.getLogger("fastelastic.store")

# What one connection's state costs the server before any buffer (tests keep it from growing).
CONN_BYTES = sizeof(Conn)


cdef class KVCore:
    """Connections, the map, waits and the buffer budget; no sockets (see the module doc)."""

    def __cinit__(self):
        self._next_cid = 1

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

    # --------------------------------------------------------------------------- connections

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

    cdef Conn *_lookup(self, int fd, uint64_t cid) noexcept nogil:
        cdef Conn *c
        if fd < 0 or <size_t>fd >= self._conns.size():
            return NULL
        c = self._conns[fd]
        if c == NULL or c.cid != cid:
            return NULL
        return c

    cdef void _set_state(self, Conn *c, ConnState state) noexcept nogil:
        """The one place a connection's state changes; the handshake only moves forward."""
        if FE_DEBUG and state <= c.state:
            with gil:
                raise AssertionError(f"connection state {c.state} -> {state}")
        c.state = state

    cdef void _account(self, Conn *c) noexcept nogil:
        """Re-counts c's buffers (heap bytes of its replies, of its partial request and of its
        disconnect actions)."""
        self._budget.recount(c.counted, c.out.heap() + (c.inb.heap() if c.inb != NULL else 0)
                             + c.on_close_bytes)

    cdef bint _recount(self, Conn *c) noexcept nogil:
        """Re-counts c's buffers and keeps all of them under the budget; False if that closed c."""
        self._account(c)
        return not (self._budget.over(self._kv.retired_bytes()) and self._over_budget(c))

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

    cdef void _release_fd(self, int fd) noexcept nogil:
        """Gives a closed connection's fd back (KVServer also takes it out of its epoll set)."""
        close(fd)

    cdef void _free_conn(self, Conn *c) noexcept nogil:
        """Frees c and what it holds (its fd is closed by the caller): unpins the values it
        was still streaming."""
        c.out.release(self._kv)
        PyMem_RawFree(c.challenge)
        del c.inb
        del c.on_close
        del c

    cdef void _free_all(self) noexcept nogil:
        """Frees every connection (closing its fd) and empties the maps."""
        cdef size_t i
        for i in range(self._conns.size()):
            if self._conns[i] != NULL:
                close(self._conns[i].fd)
                self._free_conn(self._conns[i])
                self._conns[i] = NULL
        self._conns.clear()
        self._handshakes.clear()
        self._resume.clear()
        self._dirty.clear()
        self._budget.held = 0
        self._kv.clear()
        self._queues.clear()
        self._waiters.clear()

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
        self._release_fd(fd)
        self._conns[fd] = NULL
        self._free_conn(c)
        self.closed += 1
        # A disconnect is an event others may wait for (a peer that died).
        for i in range(actions.size()):
            # out of memory here loses the action; there is no connection left to tell
            if self._kv.append(actions[i].first, actions[i].second.data(),
                               actions[i].second.size()):
                self._notify(actions[i].first)

    # ------------------------------------------------------------------------------- waiting

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
        """Answers a satisfied wait, and queues c's reply to be sent this loop round.

        Out of memory building it is c's own error, whoever's write woke c: what was appended
        is taken back (c never gets a length without its value) and c is marked ``oom``, to be
        closed before anything more of it is sent (``KVServer._flush``, ``_consume``). The
        out-of-memory flag of a request running now (the writer's) is left as it was, and
        this reply's is cleared here, so it never reaches another connection."""
        cdef string key
        cdef fe_entry *e
        cdef size_t before = c.out.bytes.size()
        cdef bint outer = fe_take_oom()
        cdef bint ok = True
        if c.wait_get:
            key = c.wait_keys[0].key
            self._drop_wait(c)
            e = self._kv.find(key)
            put_u8(c.out.bytes, REPLY_VALUE)
            if e == NULL:    # woken by a queue push of the same name
                put_u64(c.out.bytes, 0)
            else:
                ok = c.out.put_value(e, STREAM_ABOVE)
        else:
            self._drop_wait(c)
            put_u8(c.out.bytes, REPLY_STOP_WAITING)
        if fe_take_oom() or not ok or self._injected_oom():
            c.out.truncate(before, self._kv)
            c.oom = True
        if outer:
            fe_set_oom()
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

    cdef bint _injected_oom(self) noexcept nogil:
        """True for the wake-up reply fail_wakeup_reply() picked (testing; else one compare)."""
        if self._oom_countdown == 0:
            return False
        self._oom_countdown -= 1
        return self._oom_countdown == 0

    def fail_wakeup_reply(self, uint64_t after=0):
        """Testing: the wake-up reply built after ``after`` more of them fails as if the server
        ran out of memory building it (checked once its bytes are appended)."""
        self._oom_countdown = after + 1
