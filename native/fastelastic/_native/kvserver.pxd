# Declarations of the epoll key-value server (see kvserver.pyx).

from libc.stdint cimport int64_t, uint64_t
from libcpp cimport bool as cbool
from libcpp.deque cimport deque
from libcpp.pair cimport pair
from libcpp.string cimport string
from libcpp.unordered_map cimport unordered_map
from libcpp.vector cimport vector

from fastelastic._native.includes.linux cimport epoll_event
from fastelastic._native.spin cimport Spinner


cdef extern from "kvmap.h" nogil:
    cdef cppclass fe_entry:
        size_t vlen
        size_t klen
        char *key()
        char *val()

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


cdef struct KeyRef:
    const char *k           # a key in the request buffer
    size_t n
    uint64_t h              # fe_kvmap.hash(k, n)
    const char *v           # MULTI_SET: its value blob (length, then bytes)


cdef struct Waiter:
    int fd
    uint64_t cid
    uint64_t gen


cdef cppclass Conn:
    int fd
    uint64_t cid
    char *rb                # unparsed input: a request one recv could not complete
    size_t rb_len           # ... its bytes so far (rb[0:rb_len]; PyMem_Raw-allocated)
    size_t rb_cap
    size_t need             # rb must hold this many bytes before a parse can succeed
    size_t scan_off         # a partial multi-key request in rb is measured up to here
    uint64_t scan_i         # ... and this many of its blobs
    string wbuf             # replies not yet accepted by the kernel
    size_t wpos
    cbool validated
    cbool ext               # answered the capability PING: may send CMD_EXT_*
    cbool dirty             # has replies queued by another connection's write
    cbool want_out          # EPOLLOUT armed
    cbool waiting           # a WAIT or BARRIER is pending
    int64_t wait_left       # keys the pending wait still misses
    uint64_t wait_gen       # bumped on every wait and cancel; stale Waiter entries carry an old one
    vector[string] wait_keys
    cbool wait_get          # the pending wait is an EXT_WAIT_GET: answer with the value
    vector[pair[string, string]] on_close


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
    # counters (read from Python without locking; they only ever grow)
    cdef readonly uint64_t ops
    cdef readonly uint64_t accepted
    cdef readonly uint64_t closed
    cdef readonly uint64_t protocol_errors
    cdef readonly int64_t waiting      # connections with a WAIT or BARRIER pending
    cdef object _last_error

    cdef int _wait(self, epoll_event *events, bint may_spin) noexcept nogil
    cdef int _loop(self) except -1 nogil
    cdef void _on_accept(self, int lfd) noexcept nogil
    cdef void _on_readable(self, Conn *c) noexcept nogil
    cdef bint _grow_rb(self, Conn *c, size_t want) noexcept nogil
    cdef int _consume(self, Conn *c, const char *p, size_t n, size_t *used) noexcept nogil
    cdef ssize_t _measure(self, const char *p, size_t n, size_t *need, size_t *scan_off,
                          uint64_t *scan_i) noexcept nogil
    cdef int _execute(self, Conn *c, const char *p) noexcept nogil
    cdef void _flush(self, Conn *c) noexcept nogil
    cdef void _close_conn(self, Conn *c, const char *why) noexcept nogil
    cdef int _bump(self, Conn *c, const string &key, int64_t delta,
                   int64_t *result) noexcept nogil
    cdef void _notify(self, const string &key) noexcept nogil
    cdef void _notify_one(self, const string &key) noexcept nogil
    cdef int _out_of_memory(self, Conn *c) noexcept nogil
    cdef int _missing(self, const string &key) noexcept nogil
    cdef void _register_wait(self, Conn *c, const string &key) noexcept nogil
    cdef void _drop_wait(self, Conn *c) noexcept nogil
    cdef void _finish_wait(self, Conn *c, Waiter w) noexcept nogil
    cdef Conn *_lookup(self, int fd, uint64_t cid) noexcept nogil
