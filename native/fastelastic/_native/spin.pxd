# Spin-then-block waiting, shared by the store's server loop and its client.
#
# A blocked thread is woken by the kernel: on a loopback round trip (or a fast network) the
# wake-up of an idle CPU costs more than the work itself (here about 40 of a 57 µs round trip).
# So a wait first polls without blocking for a short budget, yielding the CPU between polls so
# a peer on the same CPU still runs, and only then blocks. A spin that found nothing makes the
# next SPIN_BACKOFF waits block at once, so a quiet or saturated peer costs almost no CPU.

from libc.stdint cimport int64_t

from fastelastic._native.includes.linux cimport fe_monotonic_ns, sched_yield


cdef enum:
    SPIN_BACKOFF = 8


cdef struct Spinner:
    int64_t budget_ns   # how long a wait may poll before it blocks; 0 never polls
    int skip            # waits left that block at once, after a fruitless spin


cdef inline int64_t spin_deadline(Spinner *s) noexcept nogil:
    """Until when the next wait may poll; 0 if it should block at once."""
    if s.budget_ns <= 0:
        return 0
    if s.skip > 0:
        s.skip -= 1
        return 0
    return fe_monotonic_ns() + s.budget_ns


cdef inline bint spin_again(Spinner *s, int64_t deadline) noexcept nogil:
    """After a poll found nothing: yields and returns True while the deadline is ahead, else
    backs off and returns False (the caller blocks)."""
    if fe_monotonic_ns() < deadline:
        sched_yield()
        return True
    s.skip = SPIN_BACKOFF
    return False
