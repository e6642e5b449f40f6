# The store's key-value map (includes/kvmap.h): open addressing, pinned entries.

from libc.stdint cimport uint64_t
from libcpp cimport bool as cbool
from libcpp.string cimport string


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
