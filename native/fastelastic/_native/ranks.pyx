# cython: language_level=3
"""Worker rank assignment: the identical-workers fast path and agent 0's slow-path math.

Invariants: torch 2.13's ``SimpleElasticAgent._assign_worker_ranks`` is the contract. Agent
``i`` publishes ``{"role": r, "rank": i, "local_world_size": n}`` (``json.dumps`` layout) under
``torchelastic/role_info/<i>``; agent 0 reads all of them in group-rank order and writes, for
each ``i``, ``[base_global_rank, global_world_size, base_role_rank, role_world_size]`` (again
``json.dumps`` layout) under ``torchelastic/assigned_ranks/<i>``. Global ranks are prefix sums of
``local_world_size`` in group-rank order, role ranks the same sums restricted to one role.

The codec parses exactly the layout torch emits in C; anything else (escaped role names, extra
spaces, other key order) falls back to ``json.loads``, so the result never depends on the path.
"""

import json

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int64_t
from libc.stdio cimport snprintf
from libc.string cimport memcmp

ROLE_INFO_PREFIX = "torchelastic/role_info/"
ASSIGNED_RANKS_PREFIX = "torchelastic/assigned_ranks/"

cdef object json_dumps = json.dumps
cdef object json_loads = json.loads

cdef const char *_HEAD = b'{"role": "'
cdef const char *_MID_RANK = b'", "rank": '
cdef const char *_MID_LWS = b', "local_world_size": '
cdef Py_ssize_t _HEAD_LEN = 10
cdef Py_ssize_t _MID_RANK_LEN = 11
cdef Py_ssize_t _MID_LWS_LEN = 22


def identical_ranks(int64_t group_rank, int64_t group_world_size, int64_t local_world_size):
    """Fast path: every node runs ``local_world_size`` workers of one role; no store traffic.

    Returns:
        ``(base_global_rank, global_world_size, base_role_rank, role_world_size)``.

    Raises:
        ValueError: a size is not positive or ``group_rank`` is outside the group.
    """
    if group_world_size <= 0 or local_world_size <= 0:
        raise ValueError(
            f"group_world_size ({group_world_size}) and local_world_size ({local_world_size})"
            " must be positive"
        )
    if group_rank < 0 or group_rank >= group_world_size:
        raise ValueError(f"group_rank {group_rank} outside [0, {group_world_size})")
    cdef int64_t world = group_world_size * local_world_size
    cdef int64_t base = group_rank * local_world_size
    return (base, world, base, world)


def encode_role_info(str role, int64_t rank, int64_t local_world_size):
    """Returns the bytes torch's ``_RoleInstanceInfo.serialize`` produces for these fields."""
    return (
        f'{{"role": {json_dumps(role)}, "rank": {rank}, '
        f'"local_world_size": {local_world_size}}}'
    ).encode("utf-8")


cdef int _parse_int(const char *p, Py_ssize_t n, Py_ssize_t *pos, int64_t *out) noexcept:
    """Parses an optionally negative decimal at ``p[pos]``; returns 0 on success, -1 if none."""
    cdef Py_ssize_t i = pos[0]
    cdef bint neg = False
    cdef int64_t v = 0
    cdef Py_ssize_t digits = 0
    if i < n and p[i] == c'-':
        neg = True
        i += 1
    while i < n and c'0' <= p[i] <= c'9' and digits < 18:
        v = v * 10 + (p[i] - c'0')
        i += 1
        digits += 1
    if digits == 0 or (i < n and c'0' <= p[i] <= c'9'):
        return -1
    out[0] = -v if neg else v
    pos[0] = i
    return 0


cdef int _fast_role_info(bytes data, Py_ssize_t *role_start, Py_ssize_t *role_end,
                         int64_t *rank, int64_t *lws) noexcept:
    """Parses torch's exact layout; returns -1 whenever the slow parser must decide."""
    cdef const char *p = PyBytes_AS_STRING(data)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(data)
    cdef Py_ssize_t i
    if n < _HEAD_LEN or memcmp(p, _HEAD, <size_t>_HEAD_LEN) != 0:
        return -1
    i = _HEAD_LEN
    role_start[0] = i
    while i < n and p[i] != c'"':
        if p[i] == c'\\' or <unsigned char>p[i] < 0x20 or <unsigned char>p[i] >= 0x80:
            return -1  # escapes and non-ASCII: let json decide
        i += 1
    role_end[0] = i
    if n - i < _MID_RANK_LEN or memcmp(p + i, _MID_RANK, <size_t>_MID_RANK_LEN) != 0:
        return -1
    i += _MID_RANK_LEN
    if _parse_int(p, n, &i, rank) != 0:
        return -1
    if n - i < _MID_LWS_LEN or memcmp(p + i, _MID_LWS, <size_t>_MID_LWS_LEN) != 0:
        return -1
    i += _MID_LWS_LEN
    if _parse_int(p, n, &i, lws) != 0:
        return -1
    if i != n - 1 or p[i] != c'}':
        return -1
    return 0


cdef int _parse_role_info(bytes data, dict role_ids, list role_names, RoleInfo *out) except -1:
    cdef Py_ssize_t rs = 0, re = 0
    cdef int64_t rank = 0, lws = 0
    cdef object role
    if _fast_role_info(data, &rs, &re, &rank, &lws) == 0:
        role = PyBytes_FromStringAndSize(PyBytes_AS_STRING(data) + rs, re - rs).decode("ascii")
    else:
        try:
            fields = json_loads(data.decode("utf-8"))
            role = fields["role"]
            rank_obj = fields["rank"]
            lws_obj = fields["local_world_size"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"malformed role info {data[:200]!r}: {e}") from None
        if (not isinstance(role, str) or type(rank_obj) is not int
                or type(lws_obj) is not int):
            raise ValueError(f"malformed role info {data[:200]!r}: wrong field types")
        rank = rank_obj
        lws = lws_obj
    if lws <= 0:
        raise ValueError(f"role info {data[:200]!r}: local_world_size must be positive")
    role_id = role_ids.get(role)
    if role_id is None:
        role_id = len(role_names)
        role_ids[role] = role_id
        role_names.append(role)
    out.role_id = role_id
    out.rank = rank
    out.local_world_size = lws
    return 0


@cython.boundscheck(False)
@cython.wraparound(False)
def assign_from_role_infos(list role_infos):
    """Agent 0's computation: one assignment per agent, in group-rank order.

    Args:
        role_infos: the values of ``torchelastic/role_info/<i>`` for ``i`` in
            ``range(group_world_size)`` (bytes, as ``multi_get`` returns them).

    Returns:
        A list of bytes, element ``i`` being the value for ``torchelastic/assigned_ranks/<i>``:
        ``[base_global_rank, global_world_size, base_role_rank, role_world_size]``.

    Raises:
        ValueError: an entry is not a role info.
        TypeError: an entry is not bytes.
    """
    cdef Py_ssize_t n = len(role_infos)
    cdef Py_ssize_t i
    cdef RoleInfo *infos = NULL
    cdef int64_t *role_sizes = NULL
    cdef int64_t *role_next = NULL
    cdef int64_t global_size = 0, base = 0
    cdef dict role_ids = {}
    cdef list role_names = []
    cdef list out = [None] * n
    cdef char buf[96]
    cdef int k
    if n == 0:
        return out
    infos = <RoleInfo *>PyMem_Malloc(<size_t>n * sizeof(RoleInfo))
    if infos == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            item = role_infos[i]
            if type(item) is not bytes:
                if isinstance(item, (bytearray, memoryview)):
                    item = bytes(item)
                else:
                    raise TypeError(f"role info {i} must be bytes, got {type(item).__name__}")
            _parse_role_info(<bytes>item, role_ids, role_names, &infos[i])
        role_sizes = <int64_t *>PyMem_Malloc(<size_t>len(role_names) * 2 * sizeof(int64_t))
        if role_sizes == NULL:
            raise MemoryError()
        role_next = role_sizes + len(role_names)
        for i in range(len(role_names)):
            role_sizes[i] = 0
            role_next[i] = 0
        for i in range(n):
            role_sizes[infos[i].role_id] += infos[i].local_world_size
            global_size += infos[i].local_world_size
        for i in range(n):
            k = snprintf(buf, sizeof(buf), b"[%lld, %lld, %lld, %lld]",
                         <long long>base, <long long>global_size,
                         <long long>role_next[infos[i].role_id],
                         <long long>role_sizes[infos[i].role_id])
            out[i] = PyBytes_FromStringAndSize(buf, k)
            base += infos[i].local_world_size
            role_next[infos[i].role_id] += infos[i].local_world_size
    finally:
        PyMem_Free(infos)
        PyMem_Free(role_sizes)
    return out


def decode_assignment(data):
    """Parses one ``torchelastic/assigned_ranks/<i>`` value.

    Returns:
        ``(base_global_rank, global_world_size, base_role_rank, role_world_size)``.

    Raises:
        ValueError: ``data`` is not four integers in a JSON list.
    """
    cdef bytes b = data if type(data) is bytes else bytes(data)
    cdef const char *p = PyBytes_AS_STRING(b)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(b)
    cdef Py_ssize_t i = 1
    cdef int64_t v[4]
    cdef int j
    if n > 2 and p[0] == c'[' and p[n - 1] == c']':
        for j in range(4):
            if _parse_int(p, n, &i, &v[j]) != 0:
                break
            if j < 3:
                if n - i < 2 or p[i] != c',' or p[i + 1] != c' ':
                    break
                i += 2
        else:
            if i == n - 1:
                return (v[0], v[1], v[2], v[3])
    try:
        vals = json_loads(b.decode("utf-8"))
    except ValueError as e:
        raise ValueError(f"malformed rank assignment {b[:200]!r}: {e}") from None
    if (not isinstance(vals, list) or len(vals) != 4
            or any(type(x) is not int for x in vals)):
        raise ValueError(f"malformed rank assignment {b[:200]!r}: need 4 integers")
    return tuple(vals)
