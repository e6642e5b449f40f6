# Declarations of the named-pipe watchdog (watchdog.pyx): timer table, deadline index, pidfds.

from libc.stdint cimport int64_t, uint64_t
from libcpp.map cimport map as cmap
from libcpp.pair cimport pair
from libcpp.set cimport set as cset
from libcpp.string cimport string
from libcpp.unordered_map cimport unordered_map
from libcpp.unordered_set cimport unordered_set
from libcpp.vector cimport vector

from fastelastic._native.includes.linux cimport epoll_event, pid_t, pthread_mutex_t


cdef enum:
    # Longest request line accepted: torch's client refuses lines over PIPE_BUF, and only
    # writes up to PIPE_BUF are atomic on a FIFO, so anything longer is interleaved garbage.
    WD_LINE_MAX = 4096
    # One read() drains up to this much; larger than the default 64 KiB pipe buffer, so a
    # read never splits a line that its writer wrote atomically.
    WD_READ_CHUNK = 262144
    WD_MAX_EVENTS = 64
    # Signals above this are not real signals.
    WD_SIG_MAX = 64
    # With realtime, the loop goes SCHED_FIFO this long before the earliest deadline: enough to
    # absorb a late normal-priority wake-up on a busy host.
    WD_RT_WINDOW_NS = 200000000
    # Longest ancestry walk through /proc when deciding whether a pid descends from us.
    WD_MAX_DEPTH = 64
    # epoll user data: the tag sits in the high 32 bits, a pid (for pidfds) in the low 32.
    WD_TAG_FIFO = 1
    WD_TAG_TIMER = 2
    WD_TAG_WAKE = 3
    WD_TAG_PIDFD = 4


cdef enum WdEventKind:
    WD_EV_EXPIRED = 1     # a timer passed its deadline
    WD_EV_KILLED = 2      # the worker was signalled (err = 0, or errno of pidfd_send_signal)
    WD_EV_DEFERRED = 3    # kill left to Python (stack dump first); it calls reap()
    WD_EV_REFUSED = 4     # request for a pid we may not signal
    WD_EV_MALFORMED = 5   # line skipped
    WD_EV_EXITED = 6      # a worker with pending timers exited; its timers were cleared


cdef enum WdAdmit:
    WD_OK = 0
    WD_REFUSED = 1        # alive, but not allow-listed, our descendant or (if asked) our user's
    WD_GONE = 2           # no such process (or it exited while being admitted)
    WD_BAD_PID = 3        # pid <= 0 or our own pid


cdef struct WdTimer:
    pid_t pid
    int sig
    double expiration     # as sent (wall-clock seconds), reported back unchanged
    int64_t deadline_ns   # CLOCK_MONOTONIC, fixed at arrival


cdef struct WdProc:
    int pidfd
    int ntimers
    bint listed           # admitted through the allow-list (not only as a descendant)


cdef struct WdEvent:
    int kind
    pid_t pid
    int sig
    int err
    double expiration
    int64_t deadline_ns
    int64_t fired_ns
    string scope
    string detail


cdef class FifoWatchdog:
    cdef int _fifo_fd
    cdef int _epfd
    cdef int _tfd
    cdef int _evfd
    cdef pid_t _owner_pid
    cdef pthread_mutex_t _mu
    cdef bint _mu_ready
    cdef bint _stop
    cdef bint _drain_stop
    cdef bint _running
    cdef bint _rt                # SCHED_FIFO permitted and asked for
    cdef bint _rt_on             # the loop thread is on SCHED_FIFO now
    cdef bint _allow_descendants
    cdef bint _allow_same_user
    cdef bint _defer_kill
    cdef bint _discarding
    cdef int _heartbeat_ms
    cdef int64_t _armed_ns
    cdef int64_t _last_progress_ns
    cdef uint64_t _request_count
    cdef uint64_t _malformed_count
    cdef char *_buf
    cdef string _partial
    cdef cmap[string, WdTimer] _timers          # key: 4-byte big-endian pid + scope
    cdef cset[pair[int64_t, string]] _deadlines
    cdef unordered_map[pid_t, WdProc] _procs
    cdef unordered_set[pid_t] _allowed
    cdef vector[WdEvent] _events
    cdef epoll_event _evs[WD_MAX_EVENTS]
    cdef object _callback

    cdef int _lock(self) except -1
    cdef void _unlock(self) noexcept nogil
    cdef void _wake(self) noexcept nogil
    cdef void _arm(self) noexcept nogil
    cdef void _on_fifo(self) noexcept nogil
    cdef void _on_data(self, const char *p, size_t n) noexcept nogil
    cdef void _on_line(self, const char *p, size_t n) noexcept nogil
    cdef void _on_exit(self, pid_t pid) noexcept nogil
    cdef int _accept(self, pid_t pid, const string &scope, double expiration, int sig,
                     bint from_wire) noexcept nogil
    cdef int _admit(self, pid_t pid) noexcept nogil
    cdef void _drop_timer(self, const string &key) noexcept nogil
    cdef int _clear_pid(self, pid_t pid) noexcept nogil
    cdef void _fire(self, int64_t now) noexcept nogil
    cdef void _malformed(self, const char *reason, const char *p, size_t n) noexcept nogil
    cdef void _event(self, int kind, pid_t pid, int sig, int err, double expiration,
                     const string &scope) noexcept nogil
    cdef int _step(self, int timeout_ms) except -1 nogil
    cdef int _deliver(self, vector[WdEvent] &evs) except -1
    cdef void _forget_locked(self, pid_t pid) noexcept nogil
    cdef int _close_fds(self) noexcept
