# Declarations of the TCPStore-protocol client (see kvclient.pyx).

from libc.stdint cimport int64_t

from fastelastic._native.kvconn cimport KVConn


cdef class KVClient(KVConn):
    cdef object _wait_get(self, object key, int64_t ms)
