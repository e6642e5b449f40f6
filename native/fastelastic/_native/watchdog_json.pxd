# Inline-only reader of torch's timer request line for watchdog.pyx (no runtime import):
# {"version": 1, "pid": P, "scope_id": S, "expiration_time": T, "signal": N}

from libc.math cimport isfinite, pow
from libc.stdint cimport uint64_t
from libc.string cimport memchr, memcmp
from libcpp.string cimport string

from fastelastic._native.includes.linux cimport pid_t

cdef inline bint _isdigit(char c) noexcept nogil:
    return c'0' <= c <= c'9'


cdef inline const char *_ws(const char *p, const char *e) noexcept nogil:
    while p < e and (p[0] == c' ' or p[0] == c'\t' or p[0] == c'\n' or p[0] == c'\r'):
        p += 1
    return p


cdef inline int _hex4(const char *p, const char *e, unsigned int *out) noexcept nogil:
    cdef int i, d
    out[0] = 0
    for i in range(4):
        d = (-1 if p + i >= e else p[i] - c'0' if _isdigit(p[i]) else
             ((p[i] | 0x20) - c'a' + 10 if c'a' <= (p[i] | 0x20) <= c'f' else -1))
        if d < 0:
            return -1
        out[0] = (out[0] << 4) | <unsigned int>d
    return 0


cdef inline void _put_utf8(string *out, unsigned int cp) noexcept nogil:
    cdef int n = 0 if cp < 0x80 else (1 if cp < 0x800 else (2 if cp < 0x10000 else 3))
    # the lead byte: ASCII as is, else the C0/E0/F0 marker with the top bits
    out.push_back(<char>(cp if n == 0 else ((0xFF00 >> (n + 1)) & 0xFF) | (cp >> (6 * n))))
    while n > 0:
        n -= 1
        out.push_back(<char>(0x80 | ((cp >> (6 * n)) & 0x3F)))


cdef inline const char *_str(const char *p, const char *e, string *out) noexcept nogil:
    """Reads a JSON string starting at its opening quote; returns the end or NULL."""
    cdef unsigned char c
    cdef unsigned int cp, lo
    cdef const char *esc
    cdef const char *esc_in = b'"\\/bfnrt'     # JSON's one-letter escapes ...
    cdef const char *esc_out = b'"\\/\b\f\n\r\t'  # ... and what they stand for
    p += 1
    while p < e:
        c = <unsigned char>p[0]
        if c == c'"':
            return p + 1
        if c < 0x20:
            return NULL
        if c != c'\\':
            out.push_back(<char>c)
            p += 1
            continue
        p += 1
        c = <unsigned char>p[0] if p < e else 0
        esc = <const char *>memchr(esc_in, c, 8) if c != 0 else NULL
        if esc != NULL:
            out.push_back(esc_out[esc - esc_in])
        elif c == c'u':
            if _hex4(p + 1, e, &cp) < 0:
                return NULL
            p += 4
            # a high surrogate followed by an escaped low one is one astral code point
            if (0xD800 <= cp < 0xDC00 and e - p >= 7 and p[1] == c'\\' and p[2] == c'u'
                    and _hex4(p + 3, e, &lo) == 0 and 0xDC00 <= lo < 0xE000):
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00)
                p += 6
            _put_utf8(out, cp)
        else:
            return NULL
        p += 1
    return NULL


cdef inline const char *_digits(const char *p, const char *e, uint64_t *m, int *nd, int *dexp,
                                bint frac) noexcept nogil:
    # keeps 19 significant digits in m; further integer digits only raise the exponent
    if p >= e or not _isdigit(p[0]):
        return NULL
    while p < e and _isdigit(p[0]):
        if nd[0] < 19:
            m[0] = m[0] * 10 + <uint64_t>(p[0] - c'0')
            nd[0] += <int>(m[0] != 0)
            dexp[0] -= <int>frac
        elif not frac:
            dexp[0] += 1
        p += 1
    return p


cdef inline const char *_num(const char *p, const char *e, double *out,
                             bint *integral) noexcept nogil:
    """Reads a JSON number (strict grammar, locale independent); returns the end or NULL."""
    cdef uint64_t m = 0, ex = 0
    cdef int nd = 0, dexp = 0, junk = 0
    cdef double esign = 1.0
    cdef bint neg = p < e and p[0] == c'-'
    integral[0] = True
    p += <int>neg
    if p < e and p[0] == c'0':  # JSON has no leading zeros
        p += 1
    else:
        p = _digits(p, e, &m, &nd, &dexp, False)
    if p != NULL and p < e and p[0] == c'.':
        integral[0] = False
        p = _digits(p + 1, e, &m, &nd, &dexp, True)
    if p != NULL and p < e and (p[0] | 0x20) == c'e':
        integral[0] = False
        p += 1
        if p < e and (p[0] == c'+' or p[0] == c'-'):
            esign = -1.0 if p[0] == c'-' else 1.0
            p += 1
        p = _digits(p, e, &ex, &junk, &junk, False)
    if p == NULL:
        return NULL
    out[0] = (-1.0 if neg else 1.0) * <double>m * pow(
        10.0, <double>dexp + esign * <double>(ex if ex < 100000 else 100000))
    return p


cdef inline const char *_skip(const char *p, const char *e) noexcept nogil:
    """Skips the scalar value of a key we do not know; returns the end or NULL."""
    cdef string tmp
    cdef double d
    cdef bint integral
    if p < e and p[0] == c'"':
        return _str(p, e, &tmp)
    if e - p >= 4 and (memcmp(p, b"true", 4) == 0 or memcmp(p, b"null", 4) == 0):
        return p + 4
    if e - p >= 5 and memcmp(p, b"false", 5) == 0:
        return p + 5
    return _num(p, e, &d, &integral)


cdef inline const char *_parse_request(const char *p, size_t n, pid_t *pid, string *scope,
                                       double *expiration, int *sig) noexcept nogil:
    """Parses one request line; returns NULL on success, else a static reason."""
    cdef const char *e = p + n
    cdef string key
    cdef double v
    cdef bint integral
    cdef int have = 0
    p = _ws(p, e)
    if p >= e or p[0] != c'{':
        return "not a JSON object"
    p = _ws(p + 1, e)
    while True:  # '{}' lacks the required keys anyway
        key.clear()
        p = _str(p, e, &key) if p < e and p[0] == c'"' else NULL
        if p == NULL:
            return "expected a key"
        p = _ws(p, e)
        if p >= e or p[0] != c':':
            return "expected ':'"
        p = _ws(p + 1, e)
        if key == b"pid":
            p = _num(p, e, &v, &integral)
            if p == NULL or not integral or v < 0 or v > 2147483647.0:
                return "bad pid"
            pid[0] = <pid_t>v
            have |= 1
        elif key == b"scope_id":
            scope.clear()
            p = _str(p, e, scope) if p < e and p[0] == c'"' else NULL
            if p == NULL:
                return "bad scope_id"
            have |= 2
        elif key == b"expiration_time":
            p = _num(p, e, expiration, &integral)
            if p == NULL or not isfinite(expiration[0]):
                return "bad expiration_time"
            have |= 4
        elif key == b"signal":
            p = _num(p, e, &v, &integral)
            if p == NULL or not integral or v < -64 or v > 64:  # not a signal number
                return "bad signal"
            sig[0] = <int>v
            have |= 8
        else:
            p = _skip(p, e)
            if p == NULL:
                return "bad value"
        p = _ws(p, e)
        if p < e and p[0] == c'}':
            break
        if p >= e or p[0] != c',':
            return "expected ',' or '}'"
        p = _ws(p + 1, e)
    if _ws(p + 1, e) != e:
        return "data after the object"
    if have != 15:
        return "missing pid, scope_id, expiration_time or signal"
    return NULL
