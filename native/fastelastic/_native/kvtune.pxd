# The store server's tuning constants and default limits, in one place (inline-only).

cdef enum:
    RDBUF_SIZE = 256 * 1024         # the loop's shared read buffer
    READ_BUDGET = 4                 # recv calls per readiness event, for fairness
    MAX_EVENTS = 512                # epoll events per loop round
    ACCEPT_BUDGET = 4096            # connections accepted per listener readiness event
    SHRINK_ABOVE = 1 << 20          # give buffers back once they are idle and this large
    DIRECT_READ_ABOVE = 64 * 1024   # a partial request this large is read straight into c.rb
    STREAM_ABOVE = 64 * 1024        # values this large are sent from the map, not copied
    MAX_IOV = 64                    # iovecs per sendmsg of a streamed reply
    FD_TABLE_RESERVE = 65536        # fd table slots grown at start (see KVServer._grow_fd_table)

# Default limits (KVServer keyword arguments; python -m fastelastic.store flags).
cdef enum:
    DEFAULT_MAX_KEY = 8192                      # bytes in one key
    DEFAULT_MAX_VALUE = 8 * 1024 * 1024         # bytes in one value
    DEFAULT_MAX_KEYS = 131072                   # keys in one multi-key request
    DEFAULT_MAX_UNSENT = 1024 * 1024            # unsent reply bytes above which reading stops
    DEFAULT_HANDSHAKE_MS = 1000                 # VALIDATE (and the token proof) within this
    DEFAULT_MAX_ACTIONS = 65536                 # disconnect actions one connection may hold
    DEFAULT_MAX_ACTION_BYTES = 16 * 1024 * 1024  # and their bytes (ACTION_OVERHEAD each)
    ACTION_OVERHEAD = 64                        # counted per action: its pair of strings

cdef extern from *:
    """
    #define FE_DEFAULT_MAX_REPLY ((size_t)64 << 20)
    #define FE_DEFAULT_BUFFER_BUDGET ((size_t)256 << 20)
    """
    # largest reply built for one request (MULTI_GET, LIST_KEYS); larger ones are refused
    const size_t DEFAULT_MAX_REPLY "FE_DEFAULT_MAX_REPLY"
    # all connections' buffers together; over it, the largest holder is disconnected
    const size_t DEFAULT_BUFFER_BUDGET "FE_DEFAULT_BUFFER_BUDGET"
