# Declarations of the pidfd process monitor (procmon.pyx).

from fastelastic._native.includes.linux cimport pid_t


cdef enum:
    # epoll user data of the wake-up eventfd; every pidfd is tagged with its pid (> 0).
    MON_WAKE_TAG = 0
    # Events fetched per epoll_wait call; more pending exits are fetched by the next call.
    MON_MAX_EVENTS = 64
    # Longest single epoll_wait (its timeout is an int of ms); longer waits loop.
    MON_MAX_WAIT_MS = 86400000


cdef class PidfdMonitor:
    cdef int _epfd
    cdef int _evfd
    cdef pid_t _owner_pid
    cdef dict _fds          # pid -> pidfd
    cdef set _noreap        # pids whose exit status is peeked (WNOWAIT), not reaped
    cdef int _waiters       # threads inside epoll_wait right now
    cdef bint _closing      # close() was called while threads waited; the last one closes

    cdef int _check_open(self) except -1
    cdef object _collect(self, pid_t pid)
    cdef int _forget(self, pid_t pid) except -1
    cdef int _close_fds(self) noexcept
