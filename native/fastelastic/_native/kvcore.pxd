# The store server's state (see kvcore.pyx): the types every layer shares and KVCore.

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libcpp cimport bool as cbool
from libcpp.deque cimport deque
from libcpp.pair cimport pair
from libcpp.string cimport string
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector

from fastelastic._native.kvbuf cimport fe_budget, fe_inbuf, fe_outbuf, fe_scan
from fastelastic._native.kvmap cimport fe_entry, fe_kvmap
from fastelastic._native.kvtune cimport STREAM_ABOVE
from fastelastic._native.wire cimport fe_set_oom


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


cdef cppclass Conn:          # 152 bytes: what an idle connection costs the server
    int fd
    uint32_t events         # the epoll mask armed now
    ConnState state         # changed only by KVServer._set_state
    int wait_left           # keys the pending wait still misses (<= max_keys)
    cbool ext               # answered the capability PING: may send CMD_EXT_*
    cbool dirty             # has replies queued by another connection's write
    cbool paused            # unsent replies over max_unsent: not reading until they drain
    cbool waiting           # a WAIT or BARRIER is pending
    cbool wait_get          # the pending wait is an EXT_WAIT_GET: answer with the value
    cbool oom               # a wake-up reply could not be built: closed before more is sent
    uint64_t cid
    fe_inbuf *inb           # a request one recv could not complete, or NULL
    fe_outbuf out           # replies not yet accepted by the kernel
    size_t counted          # heap bytes of its buffers counted in KVServer._budget.held
    char *challenge         # CONN_AUTH: the nonce the client must prove the token with
    uint64_t wait_gen       # bumped on every wait and cancel; stale Waiter entries carry an old one
    vector[WaitKey] wait_keys
    vector[pair[string, string]] *on_close   # disconnect actions (EXT_ON_DISCONNECT_APPEND)
    size_t on_close_bytes   # their key and value bytes, ACTION_OVERHEAD each: in ``counted``


# Small C++ helpers: Cython cannot spell ``it->second.size()`` directly.
cdef extern from *:
    """
    #define deref_qsize(it) ((it)->second.size())
    #define deref_waiters(it) ((it)->second)
    #define pop_front_into(it, out) \\
        do { (out).swap((it)->second.front()); (it)->second.pop_front(); } while (0)
    #define FE_NO_POS ((size_t)-1)
    """
    size_t deref_qsize(...) nogil
    vector[Waiter] &deref_waiters(...) nogil
    void pop_front_into(...) nogil
    const size_t NO_POS "FE_NO_POS"    # WaitKey.pos: this key's Waiter is gone already


cdef class KVCore:
    cdef cbool _running                # a loop is serving (KVServer.serve_forever)
    cdef uint64_t _next_cid
    cdef vector[Conn *] _conns          # by fd
    cdef vector[Waiter] _dirty          # connections with replies queued by others' writes
    cdef fe_kvmap _kv
    cdef unordered_map[string, deque[string]] _queues
    cdef unordered_map[string, vector[Waiter]] _waiters
    cdef size_t _max_key
    cdef size_t _max_value
    cdef uint64_t _max_keys
    cdef size_t _max_reply
    cdef uint64_t _max_actions         # disconnect actions per connection
    cdef size_t _max_action_bytes      # their bytes per connection (Conn.on_close_bytes)
    cdef fe_budget _budget       # max_unsent, buffer_budget and what all buffers hold
    cdef int64_t _handshake_ns
    cdef deque[Pending] _handshakes   # in accept order, so in deadline order
    cdef vector[Waiter] _resume       # un-paused connections with requests still buffered
    cdef string _token                # empty: no token required
    cdef const char *_last_why
    cdef uint64_t _oom_countdown      # testing (fail_wakeup_reply): 0, or wake-ups until one fails
    # counters (read from Python without locking; they only ever grow)
    cdef readonly uint64_t ops
    cdef readonly uint64_t accepted
    cdef readonly uint64_t closed
    cdef readonly uint64_t protocol_errors
    cdef readonly int64_t waiting      # connections with a WAIT or BARRIER pending
    cdef readonly uint64_t refused_fds  # connections dropped at accept: out of fds
    cdef readonly uint64_t shed         # connections closed because buffers went over budget
    cdef readonly uint64_t paused       # times a connection stopped being read (backpressure)

    cdef Conn *_new_conn(self, int fd, uint32_t events) noexcept nogil
    cdef Conn *_lookup(self, int fd, uint64_t cid) noexcept nogil
    cdef void _set_state(self, Conn *c, ConnState state) noexcept nogil
    cdef void _account(self, Conn *c) noexcept nogil
    cdef bint _recount(self, Conn *c) noexcept nogil
    cdef bint _over_budget(self, Conn *c) noexcept nogil
    cdef void _log_conn(self, int fd, const char *msg) noexcept nogil
    cdef void _close_conn(self, Conn *c, const char *why) noexcept nogil
    cdef void _release_fd(self, int fd) noexcept nogil
    cdef void _free_conn(self, Conn *c) noexcept nogil
    cdef void _free_all(self) noexcept nogil
    cdef int _missing(self, const string &key) noexcept nogil
    cdef void _register_wait(self, Conn *c, const string &key) noexcept nogil
    cdef void _unlink_wait(self, Conn *c, size_t slot) noexcept nogil
    cdef void _drop_wait(self, Conn *c) noexcept nogil
    cdef void _notify(self, const string &key) noexcept nogil
    cdef void _finish_wait(self, Conn *c, Waiter w) noexcept nogil
    cdef void _notify_one(self, const string &key) noexcept nogil
    cdef bint _injected_oom(self) noexcept nogil


cdef inline void put_value(Conn *c, fe_entry *e) noexcept nogil:
    """A value for c's reply: a large one is streamed from the map (pinned), not copied."""
    if not c.out.put_value(e, STREAM_ABOVE):
        fe_set_oom()
