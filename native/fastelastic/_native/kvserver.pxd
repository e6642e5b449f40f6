# Declarations of the epoll key-value server (see kvserver.pyx).

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libcpp cimport bool as cbool
from libcpp.deque cimport deque
from libcpp.pair cimport pair
from libcpp.string cimport string
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector

from fastelastic._native.includes.linux cimport epoll_event, iovec
from fastelastic._native.spin cimport Spinner


cdef extern from "kvmap.h" nogil:
    cdef cppclass fe_entry:
        size_t vlen
        size_t klen
        char *key()
        char *val()

    void fe_entry_pin(fe_entry *e)

    cdef cppclass fe_kvmap:
        @staticmethod
        uint64_t hash(const char *k, size_t n)
        size_t size()
        size_t capacity()
        fe_entry *at(size_t i)
        void prefetch_slot(uint64_t h)
        void prefetch_entry(uint64_t h)
        fe_entry *find(const char *k, size_t n, uint64_t h)
        fe_entry *find(const string &k)
        cbool set(const char *k, size_t n, uint64_t h, const char *v, size_t vn)
        cbool set(const string &k, const char *v, size_t vn)
        cbool append(const string &k, const char *v, size_t vn)
        cbool erase(const char *k, size_t n)
        void clear()
        void unpin(fe_entry *e)
        size_t retired_bytes()


cdef extern from "kvbuf.h" nogil:
    cdef cppclass fe_scan:
        fe_scan()
        size_t need
        size_t off
        uint64_t i

    cdef cppclass fe_inbuf:
        fe_scan scan

        @staticmethod
        fe_inbuf *holding(const char *p, size_t n, const fe_scan &scan)
        char *data()
        size_t size()
        size_t heap()
        cbool complete()
        cbool reserve(size_t want)
        cbool append(const char *p, size_t n)
        char *tail()
        size_t room()
        void grew(size_t n)
        void consume(size_t n)

    cdef cppclass fe_outbuf:
        string bytes
        size_t pos()
        size_t unsent()
        cbool streaming()
        size_t heap()
        cbool put_value(fe_entry *e, size_t stream_above)
        const char *pending()
        size_t pending_size()
        void sent(size_t n)
        int gather(iovec *iov, int max)
        void advance(size_t n, fe_kvmap &kv)
        void truncate(size_t size, fe_kvmap &kv)
        void reset_if_sent(size_t keep)
        void release(fe_kvmap &kv)

    cdef cppclass fe_budget:
        size_t max_unsent
        size_t limit
        size_t held
        cbool should_pause(const fe_outbuf &o)
        cbool may_resume(const fe_outbuf &o)
        void recount(size_t &counted, size_t now)
        cbool over(size_t elsewhere)


cdef struct KeyRef:
    const char *k           # a key in the request buffer
    size_t n
    uint64_t h              # fe_kvmap.hash(k, n)
    const char *v           # MULTI_SET: its value blob (length, then bytes)


cdef struct Waiter:
    int fd
    uint64_t cid
    uint64_t gen
    size_t slot             # its index in the connection's wait_keys


cdef struct Pending:        # a connection that has until ``deadline`` to finish its handshake
    int fd
    uint64_t cid
    int64_t deadline        # monotonic ns


cdef enum ConnState:
    CONN_HANDSHAKE = 0      # accepted: the first frame must be VALIDATE
    CONN_AUTH = 1           # validated, the server wants a token: only PING and EXT_AUTH
    CONN_READY = 2          # any request


cdef cppclass WaitKey:
    string key
    size_t pos              # where its Waiter sits in _waiters[key] (NO_POS: gone already)


cdef cppclass Conn:          # 144 bytes: what an idle connection costs the server
    int fd
    uint32_t events         # the epoll mask armed now
    ConnState state         # changed only by KVServer._set_state
    int wait_left           # keys the pending wait still misses (<= max_keys)
    cbool ext               # answered the capability PING: may send CMD_EXT_*
    cbool dirty             # has replies queued by another connection's write
    cbool paused            # unsent replies over max_unsent: not reading until they drain
    cbool waiting           # a WAIT or BARRIER is pending
    cbool wait_get          # the pending wait is an EXT_WAIT_GET: answer with the value
    uint64_t cid
    fe_inbuf *inb           # a request one recv could not complete, or NULL
    fe_outbuf out           # replies not yet accepted by the kernel
    size_t counted          # heap bytes of its buffers counted in KVServer._budget.held
    char *challenge         # CONN_AUTH: the nonce the client must prove the token with
    uint64_t wait_gen       # bumped on every wait and cancel; stale Waiter entries carry an old one
    vector[WaitKey] wait_keys
    vector[pair[string, string]] *on_close   # disconnect actions (EXT_ON_DISCONNECT_APPEND)


cdef class KVServer:
    cdef int _epfd
    cdef Spinner _spin
    cdef cbool _replied       # the last loop round sent a reply (see _loop)
    cdef int _wakefd
    cdef vector[int] _listen_fds
    cdef int _spare_fd
    cdef int _owner_pid
    cdef cbool _stopping
    cdef cbool _running
    cdef uint64_t _next_cid
    cdef vector[Conn *] _conns
    cdef vector[Waiter] _dirty
    cdef fe_kvmap _kv
    cdef unordered_map[string, deque[string]] _queues
    cdef unordered_map[string, vector[Waiter]] _waiters
    cdef char *_rdbuf
    cdef size_t _rdbuf_cap
    cdef size_t _max_key
    cdef size_t _max_value
    cdef uint64_t _max_keys
    cdef size_t _max_reply
    cdef fe_budget _budget       # max_unsent, buffer_budget and what all buffers hold
    cdef int64_t _handshake_ns
    cdef int _keepalive_s   # keep-alive window of connections with disconnect actions (0: off)
    cdef void _arm_keepalive(self, Conn *c) noexcept nogil
    cdef deque[Pending] _handshakes   # in accept order, so in deadline order
    cdef vector[Waiter] _resume       # un-paused connections with requests still buffered
    cdef string _token                # empty: no token required
    cdef const char *_last_why
    # counters (read from Python without locking; they only ever grow)
    cdef readonly uint64_t ops
    cdef readonly uint64_t accepted
    cdef readonly uint64_t closed
    cdef readonly uint64_t protocol_errors
    cdef readonly int64_t waiting      # connections with a WAIT or BARRIER pending
    cdef readonly uint64_t refused_fds  # connections dropped at accept: out of fds
    cdef readonly uint64_t shed         # connections closed because buffers went over budget
    cdef readonly uint64_t paused       # times a connection stopped being read (backpressure)

    cdef void _grow_fd_table(self)
    cdef int _wait(self, epoll_event *events, bint may_spin) noexcept nogil
    cdef int _loop(self) except -1 nogil
    cdef int _timeout_ms(self) noexcept nogil
    cdef void _expire_handshakes(self) noexcept nogil
    cdef void _on_accept(self, int lfd) noexcept nogil
    cdef Conn *_new_conn(self, int fd, uint32_t events) noexcept nogil
    cdef void _refused_fd(self) noexcept nogil
    cdef void _set_state(self, Conn *c, ConnState state) noexcept nogil
    cdef int _arm(self, Conn *c) noexcept nogil
    cdef void _account(self, Conn *c) noexcept nogil
    cdef bint _over_budget(self, Conn *c) noexcept nogil
    cdef int _gate(self, Conn *c, uint8_t cmd) noexcept nogil
    cdef bint _keep_tail(self, Conn *c, const char *p, size_t n, fe_scan *scan) noexcept nogil
    cdef void _consume_rb(self, Conn *c) noexcept nogil
    cdef void _log_conn(self, int fd, const char *msg) noexcept nogil
    cdef void _on_readable(self, Conn *c) noexcept nogil
    cdef bint _reserve_rb(self, Conn *c, size_t want) noexcept nogil
    cdef int _consume(self, Conn *c, const char *p, size_t n, fe_scan *scan,
                      size_t *used) noexcept nogil
    cdef ssize_t _measure(self, const char *p, size_t n, fe_scan *scan) noexcept nogil
    cdef int _execute(self, Conn *c, const char *p) noexcept nogil
    cdef int _cmd_set(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil
    cdef int _cmd_get(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil
    cdef int _cmd_ext_wait_get(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil
    cdef int _cmd_add(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil
    cdef int _cmd_compare_set(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil
    cdef int _cmd_check(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil
    cdef int _cmd_multi_get(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil
    cdef int _cmd_multi_set(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil
    cdef int _cmd_getnumkeys(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil
    cdef int _cmd_delete_key(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil
    cdef int _cmd_cancel_wait(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil
    cdef int _cmd_ping(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil
    cdef int _cmd_ext_auth(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil
    cdef int _cmd_validate(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil
    cdef int _cmd_queue_push(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil
    cdef int _cmd_queue_pop(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil
    cdef int _cmd_list_keys(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil
    cdef int _cmd_barrier(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil
    cdef int _cmd_on_disconnect(self, Conn *c, uint8_t cmd, const char *q) noexcept nogil
    cdef void _flush(self, Conn *c) noexcept nogil
    cdef bint _flush_streamed(self, Conn *c) noexcept nogil
    cdef void _free_conn(self, Conn *c) noexcept nogil
    cdef void _close_conn(self, Conn *c, const char *why) noexcept nogil
    cdef int _bump(self, Conn *c, const string &key, int64_t delta,
                   int64_t *result) noexcept nogil
    cdef void _notify(self, const string &key) noexcept nogil
    cdef void _notify_one(self, const string &key) noexcept nogil
    cdef int _refuse_reply(self, Conn *c, size_t size) noexcept nogil
    cdef int _challenge(self, Conn *c) noexcept nogil
    cdef int _check_proof(self, Conn *c, const char *proof) noexcept nogil
    cdef int _out_of_memory(self, Conn *c) noexcept nogil
    cdef int _missing(self, const string &key) noexcept nogil
    cdef void _register_wait(self, Conn *c, const string &key) noexcept nogil
    cdef void _unlink_wait(self, Conn *c, size_t slot) noexcept nogil
    cdef void _drop_wait(self, Conn *c) noexcept nogil
    cdef void _finish_wait(self, Conn *c, Waiter w) noexcept nogil
    cdef Conn *_lookup(self, int fd, uint64_t cid) noexcept nogil
