# Spin-then-block waiting, shared by the store's server loop and its client.
#
# A blocked thread is woken by the kernel: on a loopback round trip (or a fast network) the
# wake-up of an idle CPU costs more than the work itself (here about 40 of a 57 µs round trip).
# So a wait first polls without blocking for a short budget, yielding the CPU between polls, and
# only then blocks. A spin that found nothing makes the next SPIN_BACKOFF waits block at once,
# so a quiet or saturated peer costs almost no CPU. A yield that took long means another task
# wanted this CPU (the peer itself, when both share one): spinning would only steal its time,
# so that ends the spin and backs off too.

from libc.stdint cimport int64_t

from fastelastic._native.includes.linux cimport fe_monotonic_ns, sched_yield


cdef enum:
    SPIN_BACKOFF = 8
    SPIN_CONTENDED_NS = 5000    # a yield this long ran another task


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
    """After a poll found nothing: yields and returns True while the deadline is ahead and the
    CPU is not contended, else backs off and returns False (the caller blocks)."""
    cdef int64_t now = fe_monotonic_ns()
    if now < deadline:
        sched_yield()
        if fe_monotonic_ns() - now < SPIN_CONTENDED_NS:
            return True
    s.skip = SPIN_BACKOFF
    return False
