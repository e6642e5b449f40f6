# Inline-only framing helpers for torch's TCPStore wire protocol (little-endian fields).

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy
from libcpp cimport bool as cbool
from libcpp.string cimport string

# Command codes (tcpstore-protocol.md section 2), and our extensions, which only a peer that
# answered the capability PING (EXT_NONCE) ever sends.
cdef enum:
    CMD_VALIDATE = 0x00
    CMD_SET = 0x01
    CMD_COMPARE_SET = 0x02
    CMD_GET = 0x03
    CMD_ADD = 0x04
    CMD_CHECK = 0x05
    CMD_WAIT = 0x06
    CMD_GETNUMKEYS = 0x07
    CMD_DELETE_KEY = 0x08
    CMD_APPEND = 0x09
    CMD_MULTI_GET = 0x0A
    CMD_MULTI_SET = 0x0B
    CMD_CANCEL_WAIT = 0x0C
    CMD_PING = 0x0D
    CMD_QUEUE_PUSH = 0x0E
    CMD_QUEUE_POP = 0x0F
    CMD_QUEUE_LEN = 0x10
    CMD_LIST_KEYS = 0x11
    CMD_BARRIER = 0x12
    CMD_EXT_WAIT_GET = 0x40
    CMD_EXT_TRY_MULTI_GET = 0x41
    CMD_EXT_ON_DISCONNECT_APPEND = 0x42
    CMD_EXT_AUTH = 0x43

cdef enum:
    VALIDATE_MAGIC = 0x3C85F7CE
    # No Linux pid reaches 2**22, so a torch client never sends this nonce; our server answers
    # it with its bitwise complement, which tells our client that the extensions are there.
    EXT_NONCE = 0x7E57FA57
    REPLY_STOP_WAITING = 0
    REPLY_WAIT_CANCELED = 1
    REPLY_READY = 0
    REPLY_NOT_READY = 1
    REPLY_VALUE = 2          # EXT_WAIT_GET: a blob follows
    # A server that requires a token answers the capability PING with this instead of ~EXT_NONCE,
    # followed by a 32-byte challenge; the client answers EXT_AUTH with
    # HMAC-SHA256(token, AUTH_CONTEXT + challenge), and the server with one 0 byte if it matches.
    EXT_AUTH_NONCE = 0x5EC2E7ED
    AUTH_CHALLENGE_LEN = 32

cdef extern from *:
    """
    #define FE_AUTH_CONTEXT "fastelastic-store-auth-v1"
    """
    const char *AUTH_CONTEXT "FE_AUTH_CONTEXT"   # (without its NUL) prefixes the challenge


cdef inline uint64_t load_u64(const char *p) noexcept nogil:
    cdef uint64_t v
    memcpy(&v, p, 8)
    return v


cdef inline uint32_t load_u32(const char *p) noexcept nogil:
    cdef uint32_t v
    memcpy(&v, p, 4)
    return v


cdef extern from *:
    """
    #include <string>
    /* Appends that never throw: out of memory sets fe_oom (per thread) and drops the bytes, so a
       caller checks once per request instead of every append turning into a Python error.
       static: each extension module has its own flag; whoever sets it takes it back before
       the request (or wake-up reply) that set it is over. */
    static __thread bool fe_oom __attribute__((tls_model("initial-exec"))) = false;
    static inline void fe_append(std::string &s, const char *p, size_t n) noexcept {
        try { s.append(p, n); } catch (...) { fe_oom = true; }
    }
    static inline bool fe_take_oom(void) noexcept { bool o = fe_oom; fe_oom = false; return o; }
    static inline void fe_set_oom(void) noexcept { fe_oom = true; }
    """
    void fe_append(string &s, const char *p, size_t n) noexcept nogil
    cbool fe_take_oom() noexcept nogil
    void fe_set_oom() noexcept nogil


cdef inline void put_u8(string &out, uint8_t v) noexcept nogil:
    fe_append(out, <const char *>&v, 1)


cdef inline void put_u32(string &out, uint32_t v) noexcept nogil:
    fe_append(out, <const char *>&v, 4)


cdef inline void put_u64(string &out, uint64_t v) noexcept nogil:
    fe_append(out, <const char *>&v, 8)


cdef inline void put_blob(string &out, const char *p, size_t n) noexcept nogil:
    cdef uint64_t n64 = n
    fe_append(out, <const char *>&n64, 8)
    fe_append(out, p, n)


cdef inline int parse_decimal(const char *p, size_t n, int64_t *result) noexcept nogil:
    """strtoll-like base-10 parse: leading space, sign, digits, trailing bytes ignored.

    Returns 0 on success, -1 when there are no digits or the number is out of int64 range.
    """
    cdef size_t i = 0
    cdef bint neg = False
    cdef uint64_t acc = 0
    cdef uint64_t limit
    cdef int d
    while i < n and (p[i] == c' ' or (p[i] >= 9 and p[i] <= 13)):
        i += 1
    if i < n and (p[i] == c'+' or p[i] == c'-'):
        neg = p[i] == c'-'
        i += 1
    limit = (<uint64_t>1 << 63) if neg else ((<uint64_t>1 << 63) - 1)
    if i >= n or p[i] < c'0' or p[i] > c'9':
        return -1
    while i < n and p[i] >= c'0' and p[i] <= c'9':
        d = p[i] - c'0'
        if acc > (limit - <uint64_t>d) // 10:
            return -1
        acc = acc * 10 + <uint64_t>d
        i += 1
    result[0] = <int64_t>(0 - acc) if neg else <int64_t>acc
    return 0


cdef inline void format_decimal(string &out, int64_t v) noexcept nogil:
    cdef char buf[24]
    cdef int i = 24
    cdef uint64_t u = (0 - <uint64_t>v) if v < 0 else <uint64_t>v
    while True:
        i -= 1
        buf[i] = <char>(c'0' + <int>(u % 10))
        u //= 10
        if u == 0:
            break
    if v < 0:
        i -= 1
        buf[i] = c'-'
    out.assign(&buf[i], <size_t>(24 - i))
