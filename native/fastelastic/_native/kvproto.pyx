# distutils: language = c++
"""The store's wire protocol (tcpstore-protocol.md), with no sockets: bytes in, replies out.

Invariants:
- A request is executed only once all of its bytes are buffered (``_measure`` says how long it
  is), so execution never bounds-checks and a half-received request has no effect.
- Which requests a connection may send depends on its state alone (``_gate``), checked on a
  request's first byte, before anything of it is buffered.
- A client that breaks the protocol loses its own connection and nothing else: the request is
  not executed, its registrations are dropped and its ``on_close`` actions run.
- Memory is bounded: a connection is not read while its unsent replies exceed ``max_unsent``; no
  reply is built above ``max_reply``; before its handshake a connection buffers at most 4 bytes;
  a connection holds at most ``max_actions`` disconnect actions of ``max_action_bytes`` (the
  one over either closes it), counted in its buffers; and when every connection's buffers
  together exceed ``buffer_budget`` the largest holder is disconnected (one log line names it).
"""

cimport cython
from cpython.mem cimport PyMem_RawFree, PyMem_RawMalloc
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.stdio cimport snprintf
from libc.string cimport memcmp, strlen
from libcpp cimport bool as cbool
from libcpp.pair cimport pair
from libcpp.string cimport string
from libcpp.unordered_set cimport unordered_set
from libcpp.vector cimport vector

from fastelastic._native.kvbuf cimport fe_inbuf, fe_scan
from fastelastic._native.kvcore cimport (
    CONN_AUTH, CONN_HANDSHAKE, CONN_READY, Conn, KeyRef, deref_qsize, pop_front_into, put_value,
)
from fastelastic._native.kvmap cimport fe_entry, fe_kvmap
from fastelastic._native.kvtune cimport *
from fastelastic._native.wire cimport *

cdef extern from "hmac_sha256.h" nogil:
    void fe_hmac_sha256(const void *key, size_t klen, const void *a, size_t alen,
                        const void *b, size_t blen, unsigned char *out)
    int fe_equal_ct(const unsigned char *a, const unsigned char *b, size_t n)
    int fe_random(void *buf, size_t n)

import os


def hmac_sha256(bytes key, bytes a, bytes b):
    """The server's own HMAC-SHA256(key, a + b) (for tests against Python's hmac)."""
    cdef unsigned char out[32]
    fe_hmac_sha256(<const char *>key, len(key), <const char *>a, len(a), <const char *>b,
                   len(b), out)
    return out[:32]


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


cdef extern from *:
    """
    #define PREFETCH_SLOT 16
    #define PREFETCH_ENTRY 8
    static inline bool fe_reserve(std::string &s, size_t n) {
        try { s.reserve(n); return true; } catch (...) { return false; }
    }
    """
    size_t PREFETCH_SLOT
    size_t PREFETCH_ENTRY
    cbool fe_reserve(string &s, size_t n) nogil


cdef class KVProtocol(KVCore):
    """Parses and executes requests for a connection; KVServer feeds it bytes from sockets.

    Args (keyword only): the limits, as KVServer documents them.
    """

    def __init__(self, *, size_t max_key=DEFAULT_MAX_KEY, size_t max_value=DEFAULT_MAX_VALUE,
                 uint64_t max_keys=DEFAULT_MAX_KEYS, size_t max_reply=DEFAULT_MAX_REPLY,
                 size_t max_unsent=DEFAULT_MAX_UNSENT, size_t buffer_budget=DEFAULT_BUFFER_BUDGET,
                 int64_t handshake_ms=DEFAULT_HANDSHAKE_MS, bytes token=b"",
                 uint64_t max_actions=DEFAULT_MAX_ACTIONS,
                 size_t max_action_bytes=DEFAULT_MAX_ACTION_BYTES):
        if max_reply < max_value + 64:
            raise ValueError(f"max_reply ({max_reply}) must exceed max_value ({max_value}): "
                             "a GET of the largest value must fit")
        if buffer_budget < max_reply:
            raise ValueError(f"buffer_budget ({buffer_budget}) must be at least max_reply "
                             f"({max_reply})")
        if handshake_ms <= 0:
            raise ValueError(f"handshake_ms must be positive, got {handshake_ms}")
        if max_actions < 1 or max_action_bytes < ACTION_OVERHEAD:
            raise ValueError(f"max_actions ({max_actions}) must be at least 1 and "
                             f"max_action_bytes ({max_action_bytes}) at least {ACTION_OVERHEAD}")
        self._max_actions = max_actions
        self._max_action_bytes = max_action_bytes
        self._max_key = max_key
        self._max_value = max_value
        self._max_keys = max_keys
        self._max_reply = max_reply
        self._budget.max_unsent = max_unsent
        self._budget.limit = buffer_budget
        self._handshake_ns = handshake_ms * 1000000
        self._token = token

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

    # --------------------------------------------------------------------------------- input

    cdef bint _keep_tail(self, Conn *c, const char *p, size_t n, fe_scan *scan) noexcept nogil:
        """Buffers the first n bytes of a partial request (and how far it was measured) in a new
        c.inb; out of memory or over the budget, closes c and returns False."""
        c.inb = fe_inbuf.holding(p, n, scan[0])
        if c.inb == NULL:
            self._close_conn(c, "out of memory buffering a request")
            return False
        return self._recount(c)

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
        return self._recount(c)

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
        cdef int rc
        cdef bint oom
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
            rc = self._execute(c, p + off)
            oom = fe_take_oom()   # taken on every exit: no flag outlives its request
            if rc < 0:
                return -1
            off += <size_t>m
            if oom or c.oom:      # c.oom: the request woke c itself, and that reply failed
                c.out.truncate(before, self._kv)  # no half reply: the client sees the close
                self._close_conn(c, "out of memory writing a reply")
                return -1
            if c.out.heap() > 0 or c.counted or c.on_close_bytes:
                if not self._recount(c):
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

    # ------------------------------------------------------------------------------- parsing

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

    # ------------------------------------------------------------------------------ commands

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
            put_value(c, e)
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
            put_value(c, e)
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
                put_value(c, e)
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
        """EXT_ON_DISCONNECT_APPEND. A connection holds at most ``max_actions`` of them and
        ``max_action_bytes`` (counted in its buffers against the budget): the one over either
        closes it (it breaks the protocol), which runs those it holds."""
        cdef uint64_t ln, ln2
        cdef size_t cost
        cdef pair[string, string] action
        ln = load_u64(q)
        ln2 = load_u64(q + 8 + ln)
        cost = <size_t>(ln + ln2) + ACTION_OVERHEAD   # each <= max_key, max_value: no wrap
        if c.on_close != NULL and (c.on_close.size() >= self._max_actions
                                   or c.on_close_bytes + cost > self._max_action_bytes):
            self._close_conn(c, "disconnect actions over the per-connection cap "
                             "(max_actions, max_action_bytes)")
            return -1
        action.first.assign(q + 8, ln)
        q += 8 + ln
        action.second.assign(q + 8, ln2)
        if c.on_close == NULL:
            c.on_close = new vector[pair[string, string]]()
            self._arm_keepalive(c)
        c.on_close.push_back(action)
        c.on_close_bytes += cost
        put_u8(c.out.bytes, 0)
        return 0

    cdef void _arm_keepalive(self, Conn *c) noexcept nogil:
        """Socket options for a connection that registered disconnect actions (KVServer)."""
        pass

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
