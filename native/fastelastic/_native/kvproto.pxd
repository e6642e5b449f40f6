# The store's protocol (see kvproto.pyx): requests in, replies out, no sockets.

from libc.stdint cimport int64_t, uint8_t
from libcpp.string cimport string

from fastelastic._native.kvbuf cimport fe_scan
from fastelastic._native.kvcore cimport Conn, KVCore


cdef class KVProtocol(KVCore):
    cdef bint _keep_tail(self, Conn *c, const char *p, size_t n, fe_scan *scan) noexcept nogil
    cdef void _consume_rb(self, Conn *c) noexcept nogil
    cdef bint _reserve_rb(self, Conn *c, size_t want) noexcept nogil
    cdef int _consume(self, Conn *c, const char *p, size_t n, fe_scan *scan,
                      size_t *used) noexcept nogil
    cdef int _gate(self, Conn *c, uint8_t cmd) noexcept nogil
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
    cdef void _arm_keepalive(self, Conn *c) noexcept nogil
    cdef int _bump(self, Conn *c, const string &key, int64_t delta,
                   int64_t *result) noexcept nogil
    cdef int _challenge(self, Conn *c) noexcept nogil
    cdef int _check_proof(self, Conn *c, const char *proof) noexcept nogil
    cdef int _refuse_reply(self, Conn *c, size_t size) noexcept nogil
    cdef int _out_of_memory(self, Conn *c) noexcept nogil
