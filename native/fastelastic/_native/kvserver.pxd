# Declarations of the epoll key-value server (see kvserver.pyx): the sockets and the loop.

from libc.stdint cimport uint32_t
from libcpp cimport bool as cbool
from libcpp.vector cimport vector

from fastelastic._native.includes.linux cimport epoll_event
from fastelastic._native.kvcore cimport Conn
from fastelastic._native.kvproto cimport KVProtocol
from fastelastic._native.spin cimport Spinner


cdef class KVServer(KVProtocol):
    cdef int _epfd
    cdef Spinner _spin
    cdef cbool _replied       # the last loop round sent a reply (see _loop)
    cdef int _wakefd
    cdef vector[int] _listen_fds
    cdef int _spare_fd
    cdef int _owner_pid
    cdef cbool _stopping
    cdef char *_rdbuf
    cdef size_t _rdbuf_cap
    cdef int _keepalive_s   # keep-alive window of connections with disconnect actions (0: off)

    cdef void _grow_fd_table(self)
    cdef void _close_own_fds(self) noexcept
    cdef int _wait(self, epoll_event *events, bint may_spin) noexcept nogil
    cdef int _loop(self) except -1 nogil
    cdef int _timeout_ms(self) noexcept nogil
    cdef void _expire_handshakes(self) noexcept nogil
    cdef void _on_accept(self, int lfd) noexcept nogil
    cdef void _refused_fd(self) noexcept nogil
    cdef int _arm(self, Conn *c) noexcept nogil
    cdef void _on_readable(self, Conn *c) noexcept nogil
    cdef void _flush(self, Conn *c) noexcept nogil
    cdef bint _flush_streamed(self, Conn *c) noexcept nogil
