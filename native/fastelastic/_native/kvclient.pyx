# distutils: language = c++
"""Client for torch's TCPStore wire protocol: the operations, one method each.

Each builds its request, sends it through the connection (``kvconn.pyx``: locks, deadlines,
the invariants) and parses the reply. Keys go on the wire with torch's ``/`` prefix.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.stdint cimport int64_t, uint64_t

from fastelastic._native.kvconn cimport *
from fastelastic._native.kvreq cimport *
from fastelastic._native.wire cimport *

from fastelastic._native.kvconn import HandshakeReset
from fastelastic.errors import QueueEmptyError, StoreError, StoreTimeoutError

__all__ = ["HandshakeReset", "KVClient"]


cdef class KVClient(KVConn):
    """One connection to a TCPStore-protocol server, with torch's store operations (its
    arguments: :class:`~fastelastic._native.kvconn.KVConn`)."""

    # --------------------------------------------------------------------------- operations

    def set(self, key, value):
        """Stores value under key (fire-and-forget, as torch's)."""
        self._fire(CMD_SET, key, value)

    def get(self, key, timeout=None):
        """Returns the value of key, waiting up to ``timeout`` (default: the store timeout)
        for it to be set."""
        cdef int64_t ms = _timeout_arg(timeout, self._timeout_ms)
        if self._ext:
            return self._wait_get(key, ms)
        self._begin(CMD_WAIT)
        try:
            put_u64(self._out, 1)
            self._put_key(key)
            self._transact(0, REPLY)
            if self._wait_reply(ms):
                raise StoreTimeoutError(f"wait timeout after {ms}ms, keys: /{key}")
            self._out.clear()
            put_u8(self._out, CMD_GET)
            self._put_key(key)
            self._transact(0, REPLY)
            return self._read_blobs(1, REPLY)[0]
        finally:
            self._end()

    cdef object _wait_get(self, object key, int64_t ms):
        """One round trip, whether the key is there or comes later (our server only).

        On a timeout the wait is cancelled. The value may have been sent just before the cancel
        arrived: the reply is then the value followed by the cancel's acknowledgement, and the
        value is returned."""
        cdef int rc
        cdef bint cancelled = False
        cdef uint8_t b
        cdef object value = None
        self._begin(CMD_EXT_WAIT_GET)
        try:
            self._put_key(key)
            self._transact(0, REPLY)
            rc = self._need_intr(1, _deadline(ms))
            if rc == IO_TIMEOUT:
                cancelled = True
                self._out.clear()
                put_u8(self._out, CMD_CANCEL_WAIT)
                self._transact(1, REPLY)
            elif rc != IO_OK:
                raise self._fail(rc, "get")
            b = <uint8_t>self._in[self._in_pos]
            self._in_pos += 1
            if b == REPLY_VALUE:
                value = self._read_blobs(1, REPLY)[0]
                if not cancelled:
                    return value
                rc = self._need_intr(1, REPLY)  # then the cancel's acknowledgement
                if rc != IO_OK:
                    raise self._fail(rc, "cancel_wait")
                b = <uint8_t>self._in[self._in_pos]
                self._in_pos += 1
            elif not cancelled:
                raise self._fail(IO_CLOSED, "get (unexpected reply)")
            if b != REPLY_WAIT_CANCELED:
                raise self._fail(IO_CLOSED, "cancel_wait (unexpected reply)")
            if value is None:
                raise StoreTimeoutError(f"wait timeout after {ms}ms, keys: /{key}")
            return value
        finally:
            self._end()

    def add(self, key, int64_t value):
        """Adds value to the integer stored at key (missing counts as 0); returns the sum."""
        self._begin(CMD_ADD)
        try:
            self._put_key(key)
            put_u64(self._out, <uint64_t>value)
            self._transact(8, REPLY)
            return self._take_i64()
        finally:
            self._end()

    def _add_unprefixed(self, bytes key, int64_t value):
        # torch counts workers under the raw key b"init/" (protocol section 6).
        self._begin(CMD_ADD)
        try:
            put_blob(self._out, PyBytes_AS_STRING(key), <size_t>PyBytes_GET_SIZE(key))
            put_u64(self._out, <uint64_t>value)
            self._transact(8, REPLY)
            return self._take_i64()
        finally:
            self._end()

    def compare_set(self, key, expected_value, desired_value):
        """Sets key to desired_value if it holds expected_value; returns the value now held."""
        self._begin(CMD_COMPARE_SET)
        try:
            self._put_key(key)
            self._put_value(expected_value)
            self._put_value(desired_value)
            self._transact(0, REPLY)
            return self._read_blobs(1, REPLY)[0]
        finally:
            self._end()

    def check(self, keys):
        """True if every key in keys is set."""
        self._begin(CMD_CHECK)
        try:
            self._put_keys(keys)
            self._transact(1, REPLY)
            self._in_pos += 1
            return self._in[self._in_pos - 1] == REPLY_READY
        finally:
            self._end()

    def wait(self, keys, timeout=None):
        """Blocks until every key is set, or raises StoreTimeoutError after timeout."""
        cdef int64_t ms = _timeout_arg(timeout, self._timeout_ms)
        keys = list(keys)
        self._begin(CMD_WAIT)
        try:
            self._put_keys(keys)
            self._transact(0, REPLY)
            if self._wait_reply(ms):
                raise StoreTimeoutError(
                    f"wait timeout after {ms}ms, keys: " + ", ".join("/" + k for k in keys))
        finally:
            self._end()

    def num_keys(self):
        """Number of keys in the store (torch's internal ones included)."""
        self._begin(CMD_GETNUMKEYS)
        try:
            self._transact(8, REPLY)
            return self._take_i64()
        finally:
            self._end()

    def delete_key(self, key):
        """Deletes key; True if it existed."""
        self._begin(CMD_DELETE_KEY)
        try:
            self._put_key(key)
            self._transact(8, REPLY)
            return self._take_i64() == 1
        finally:
            self._end()

    def append(self, key, value):
        """Appends value to key's value (creates it when missing)."""
        self._fire(CMD_APPEND, key, value)

    def multi_get(self, keys):
        """Values of every key, in order, waiting up to the store timeout for missing ones."""
        cdef int64_t deadline
        cdef uint64_t n
        keys = list(keys)
        n = <uint64_t>len(keys)
        self._begin(CMD_EXT_TRY_MULTI_GET if self._ext else CMD_WAIT)
        try:
            deadline = REPLY
            self._put_keys(keys)
            if self._ext:
                self._transact(1, deadline)
                self._in_pos += 1
                if self._in[self._in_pos - 1]:
                    return self._read_blobs(n, deadline)
                self._out[0] = <char>CMD_WAIT
            self._transact(0, deadline)
            if self._wait_reply(self._timeout_ms):
                raise StoreTimeoutError(
                    f"wait timeout after {self._timeout_ms}ms, keys: "
                    + ", ".join("/" + k for k in keys))
            self._out[0] = <char>CMD_MULTI_GET
            self._transact(0, deadline)
            return self._read_blobs(n, REPLY)
        finally:
            self._end()

    def multi_set(self, keys, values):
        """Sets every key to the value at the same position."""
        keys = list(keys)
        values = list(values)
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
        cdef string req
        put_u8(req, CMD_MULTI_SET)
        put_u64(req, <uint64_t>len(keys))
        for k, v in zip(keys, values):
            _put_key_to(req, k)
            _put_value_to(req, v)
        self._send_oneway(req)

    def list_keys(self):
        """Every user key (those torch's clients would see), without the wire prefix."""
        cdef int64_t n
        cdef list raw
        self._begin(CMD_LIST_KEYS)
        try:
            self._transact(8, REPLY)
            n = self._take_i64()
            raw = self._read_blobs(<uint64_t>n, REPLY)
        finally:
            self._end()
        return [k[1:].decode("utf-8", "surrogateescape") for k in raw if k.startswith(b"/")]

    def queue_push(self, key, value):
        """Appends value to the queue named key."""
        self._fire(CMD_QUEUE_PUSH, key, value)

    def queue_pop(self, key, bint block=True):
        """Removes and returns the queue's first item; waits for one when block is True."""
        cdef int64_t n
        self._begin(CMD_WAIT if block else CMD_QUEUE_POP)
        try:
            if block:
                put_u64(self._out, 1)
                self._put_key(key)
                self._transact(0, REPLY)
                if self._wait_reply(self._timeout_ms):
                    raise StoreTimeoutError(
                        f"wait timeout after {self._timeout_ms}ms, keys: /{key}")
                self._out.clear()
                put_u8(self._out, CMD_QUEUE_POP)
            self._put_key(key)
            self._transact(8, REPLY)
            n = self._take_i64()
            if n <= 0:
                raise QueueEmptyError("queue is empty")
            return self._read_blobs(1, REPLY)[0]
        finally:
            self._end()

    def queue_len(self, key):
        """Number of items in the queue named key."""
        self._begin(CMD_QUEUE_LEN)
        try:
            self._put_key(key)
            self._transact(8, REPLY)
            return self._take_i64()
        finally:
            self._end()

    def barrier(self, key, int64_t world_size, timeout=None):
        """Blocks until world_size callers have reached the barrier named key."""
        cdef int64_t ms = _timeout_arg(timeout, self._timeout_ms)
        self._begin(CMD_BARRIER)
        try:
            self._put_key(key)
            put_u64(self._out, <uint64_t>world_size)
            self._transact(0, REPLY)
            if self._wait_reply(ms):
                raise StoreTimeoutError(f"barrier timeout after {ms}ms, key: /{key}")
        finally:
            self._end()

    def append_on_disconnect(self, key, value):
        """Asks the server to append value to key when this connection closes, for any reason.

        Only fastelastic's server has this; it is how peers learn of a crash at once.
        """
        if not self._ext:
            raise StoreError(f"the store at {self._peer} does not support disconnect actions "
                             "(it is not a fastelastic server)")
        self._begin(CMD_EXT_ON_DISCONNECT_APPEND)
        try:
            self._put_key(key)
            self._put_value(value)
            self._transact(0, REPLY, True)
            self._owed += 1  # read by the next request: the server runs them in order
        finally:
            self._end()

    def append_on_disconnect_many(self, keys, values):
        """Registers several disconnect actions (as ``append_on_disconnect``): the requests go
        out together, and their acknowledgements are read with the next request's reply."""
        cdef Py_ssize_t i, n
        keys = list(keys)
        values = list(values)
        n = len(keys)
        if n != len(values):
            raise ValueError(f"append_on_disconnect_many got {n} keys but {len(values)} values")
        if not self._ext:
            raise StoreError(f"the store at {self._peer} does not support disconnect actions "
                             "(it is not a fastelastic server)")
        if n == 0:
            return
        self._begin(CMD_EXT_ON_DISCONNECT_APPEND)
        try:
            for i in range(n):
                if i:
                    put_u8(self._out, CMD_EXT_ON_DISCONNECT_APPEND)
                self._put_key(keys[i])
                self._put_value(values[i])
            self._transact(0, REPLY, True)
            self._owed += <size_t>n
        finally:
            self._end()
