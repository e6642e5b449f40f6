# Rank assignment mechanics: role-info codec and the prefix sums agent 0 computes.

from libc.stdint cimport int64_t


cdef struct RoleInfo:
    # Index into the role table built while parsing (roles are interned to small ints).
    Py_ssize_t role_id
    int64_t rank
    int64_t local_world_size


cdef int _parse_role_info(bytes data, dict role_ids, list role_names, RoleInfo *out) except -1
cdef int _parse_int(const char *p, Py_ssize_t n, Py_ssize_t *pos, int64_t *out) noexcept
