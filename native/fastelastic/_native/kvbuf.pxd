# A connection's typed buffers and the server's bounds on them (includes/kvbuf.h).

from libc.stdint cimport uint64_t
from libcpp cimport bool as cbool
from libcpp.string cimport string

from fastelastic._native.includes.linux cimport iovec
from fastelastic._native.kvmap cimport fe_entry, fe_kvmap


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
