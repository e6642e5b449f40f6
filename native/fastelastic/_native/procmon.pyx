"""Owns the pidfd worker monitor: one pidfd per process, one epoll set, one wake-up eventfd."""

import warnings

cimport cython
from cpython.exc cimport PyErr_CheckSignals, PyErr_SetFromErrno
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memset

from fastelastic._native.includes.linux cimport (
    CLD_EXITED, ECHILD, EFD_CLOEXEC, EFD_NONBLOCK, EINTR, ENOSYS, EPOLL_CLOEXEC, EPOLL_CTL_ADD,
    EPOLL_CTL_DEL, EPOLLIN, ESRCH, P_PIDFD, PR_SET_PDEATHSIG, SIGKILL, WEXITED, WNOHANG, WNOWAIT,
    close, epoll_create1, epoll_ctl, epoll_event, epoll_wait, errno, eventfd, fe_monotonic_ns,
    fe_pidfd_open, fe_pidfd_send_signal, getpid, kill, pid_t, prctl, read, siginfo_t, waitid,
    write,
)
from fastelastic._native.includes.linux cimport FE_DEBUG


cdef extern from "<unistd.h>" nogil:
    pid_t getppid()


# Debug builds (FASTELASTIC_DEBUG=1) count every fd opened and closed; tests check the balance.
cdef long _dbg_opened = 0
cdef long _dbg_closed = 0


cdef inline void _dbg_count(int opened, int closed) noexcept:
    global _dbg_opened, _dbg_closed
    if FE_DEBUG:
        _dbg_opened += opened
        _dbg_closed += closed


def debug_counters():
    """``(fds opened, fds closed)`` by every monitor so far in a debug build, else None."""
    if FE_DEBUG:
        return (_dbg_opened, _dbg_closed)
    return None


cdef int _raise_errno() except -1:
    PyErr_SetFromErrno(OSError)
    return -1


cdef int _raise_pidfd_errno(pid_t pid) except -1:
    if errno == ENOSYS:
        raise OSError(ENOSYS, "pidfd_open is not available: fastelastic's process monitor "
                      "needs Linux >= 5.4 (pidfd_open and waitid(P_PIDFD))")
    if errno == ESRCH:
        raise ProcessLookupError(ESRCH, f"no process with pid {pid} (already reaped?)")
    return _raise_errno()


def set_pdeathsig(int sig=SIGKILL, int expected_ppid=0):
    """Asks the kernel to send ``sig`` to the calling process when its parent thread exits.

    Meant for a freshly forked child (a ``preexec_fn``). If ``expected_ppid`` is given and the
    parent is already gone (the child was reparented before the call), the calling process
    kills itself with ``sig`` at once, closing the race between fork and prctl.

    Args:
        sig: the signal to receive; ``SIGKILL`` by default.
        expected_ppid: pid of the parent that forked us, or 0 to skip the race check.
    """
    if prctl(PR_SET_PDEATHSIG, <unsigned long>sig, 0, 0, 0) != 0:
        _raise_errno()
    if expected_ppid > 0 and getppid() != expected_ppid:
        kill(getpid(), sig)


@cython.final
cdef class PidfdMonitor:
    """Waits for any of a set of processes to exit, returning the moment one does.

    Invariants: ``_epfd`` and ``_evfd`` are open (>= 0) until ``close()``; every pid in ``_fds``
    has its pidfd registered in ``_epfd`` tagged with the pid; a pid leaves the set when its exit
    is reported or it is removed. Every fd is CLOEXEC. A forked child that inherits the object
    never closes the parent's fds (``_owner_pid``).

    The GIL is released only around ``epoll_wait``; ``wakeup()`` may be called from any thread
    and makes a blocked ``wait()`` return early. ``close()`` while other threads wait marks the
    monitor closing and wakes them; the last one leaving ``epoll_wait`` closes the fds.
    """

    def __cinit__(self):
        self._waiters = 0
        self._closing = False
        self._epfd = -1
        self._evfd = -1
        self._owner_pid = getpid()
        self._fds = {}
        self._noreap = set()
        cdef epoll_event ev
        self._epfd = epoll_create1(EPOLL_CLOEXEC)
        if self._epfd < 0:
            _raise_errno()
        _dbg_count(1, 0)
        self._evfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)
        if self._evfd < 0:
            _raise_errno()
        _dbg_count(1, 0)
        memset(&ev, 0, sizeof(ev))
        ev.events = EPOLLIN
        ev.data.u64 = MON_WAKE_TAG
        if epoll_ctl(self._epfd, EPOLL_CTL_ADD, self._evfd, &ev) != 0:
            _raise_errno()

    def __dealloc__(self):
        if self._epfd >= 0 and self._owner_pid == getpid():
            self._close_fds()
            warnings.warn("unclosed PidfdMonitor", ResourceWarning, stacklevel=1)

    cdef int _check_open(self) except -1:
        if self._epfd < 0 or self._closing:
            raise ValueError("I/O operation on a closed PidfdMonitor")
        return 0

    cdef int _close_fds(self) noexcept:
        for fd in self._fds.values():
            close(<int>fd)
            _dbg_count(0, 1)
        self._fds.clear()
        self._noreap.clear()
        if self._evfd >= 0:
            close(self._evfd)
            _dbg_count(0, 1)
            self._evfd = -1
        if self._epfd >= 0:
            close(self._epfd)
            _dbg_count(0, 1)
            self._epfd = -1
        return 0

    def close(self):
        """Closes every pidfd, the eventfd and the epoll fd. Safe to call twice.

        In a forked child that inherited the monitor the fds are left alone: they belong to the
        parent (the child's copies go away with the child).
        """
        if self._owner_pid != getpid():
            self._epfd = -1
            self._evfd = -1
            self._fds.clear()
            return
        if self._waiters > 0:
            # Threads blocked in wait() would sleep on: closing the eventfd drops its queued
            # readiness from the epoll set. Wake them (the eventfd stays readable, so every
            # waiter wakes) and let the last one out close the fds.
            self._closing = True
            self.wakeup()
            return
        self._close_fds()

    @property
    def closed(self):
        """True once ``close()`` was called."""
        return self._epfd < 0 or self._closing

    def fileno(self):
        """The epoll fd: readable while an exit is pending or a wake-up was requested."""
        self._check_open()
        return self._epfd

    def add(self, pid_t pid, bint reap=True):
        """Starts watching ``pid``.

        Args:
            pid: the process to watch; any process, not only our children.
            reap: for our own children, reap the zombie when its exit is reported (else only
                peek at the status with ``WNOWAIT`` and leave reaping to the owner, e.g.
                ``multiprocessing.Process``).

        Raises:
            ProcessLookupError: ``pid`` does not exist (already reaped).
            OSError: the kernel lacks pidfd support (ENOSYS) or another pidfd failure.
            ValueError: ``pid`` is already watched, or not positive.
        """
        cdef epoll_event ev
        cdef int fd
        self._check_open()
        if pid <= 0:
            raise ValueError(f"pid must be positive, got {pid}")
        if pid in self._fds:
            raise ValueError(f"pid {pid} is already watched")
        fd = fe_pidfd_open(pid, 0)  # pidfd_open always sets O_CLOEXEC on the new fd
        if fd < 0:
            _raise_pidfd_errno(pid)
        _dbg_count(1, 0)
        memset(&ev, 0, sizeof(ev))
        ev.events = EPOLLIN
        ev.data.u64 = <uint64_t>pid
        if epoll_ctl(self._epfd, EPOLL_CTL_ADD, fd, &ev) != 0:
            close(fd)
            _dbg_count(0, 1)
            _raise_errno()
        self._fds[pid] = fd
        if not reap:
            self._noreap.add(pid)

    def remove(self, pid_t pid):
        """Stops watching ``pid`` (no-op if it is not watched)."""
        self._check_open()
        if pid in self._fds:
            self._forget(pid)

    cdef int _forget(self, pid_t pid) except -1:
        cdef int fd = self._fds.pop(pid)
        self._noreap.discard(pid)
        # Closing the fd drops it from the epoll set; the explicit DEL keeps the set exact even
        # if a forked child still holds a duplicate of the fd.
        epoll_ctl(self._epfd, EPOLL_CTL_DEL, fd, NULL)
        close(fd)
        _dbg_count(0, 1)
        return 0

    def pids(self):
        """The watched pids, as a list."""
        return list(self._fds)

    def __len__(self):
        return len(self._fds)

    def __contains__(self, pid):
        return pid in self._fds

    def send_signal(self, pid_t pid, int sig):
        """Sends ``sig`` to a watched ``pid`` through its pidfd (immune to pid reuse).

        Raises:
            KeyError: ``pid`` is not watched.
            ProcessLookupError: the process has already been reaped.
        """
        self._check_open()
        cdef int fd = self._fds[pid]
        if fe_pidfd_send_signal(fd, sig) != 0:
            _raise_pidfd_errno(pid)

    def wakeup(self):
        """Makes a ``wait()`` blocked in another thread return now (thread-safe)."""
        cdef uint64_t one = 1
        if self._evfd >= 0:
            write(self._evfd, &one, sizeof(one))

    cdef object _collect(self, pid_t pid):
        """Reads the exit status of ``pid`` (now exited), forgets it, returns (pid, status)."""
        cdef siginfo_t info
        cdef int fd = self._fds[pid]
        cdef int options = WEXITED | WNOHANG
        cdef object status = None
        if pid in self._noreap:
            options |= WNOWAIT
        memset(&info, 0, sizeof(info))
        if waitid(P_PIDFD, <unsigned int>fd, &info, options) == 0:
            if info.si_pid == 0:
                return None  # not exited after all (spurious readiness); keep watching
            status = info.si_status if info.si_code == CLD_EXITED else -info.si_status
        elif errno != ECHILD:
            _raise_errno()
        # ECHILD: not our child (or already reaped by its owner): status unknown, but it exited.
        self._forget(pid)
        return (pid, status)

    def wait(self, timeout=None):
        """Blocks until a watched process exits, ``wakeup()`` is called or ``timeout`` passes.

        Args:
            timeout: seconds; ``None`` or negative waits forever, 0 only polls.

        Returns:
            A list of ``(pid, returncode)`` for the processes that exited, each reported once
            and then no longer watched. ``returncode`` follows ``subprocess``: the exit code,
            or ``-signal`` when killed by a signal; ``None`` when the process is not our child
            (its status belongs to someone else). An empty list means timeout or wake-up.

        Raises:
            OSError: epoll_wait or waitid failed.
            KeyboardInterrupt: or whatever a Python signal handler raises while waiting.
        """
        # per call, not per object: two threads may wait at once (an agent loop and a close())
        cdef epoll_event events[MON_MAX_EVENTS]
        cdef int64_t deadline = -1
        cdef int64_t now
        cdef int ms = -1
        cdef int n
        cdef int i
        cdef uint64_t drained
        cdef uint64_t tag
        self._check_open()
        # beyond ~30 years a timeout is as good as infinite (and would overflow int64 ns)
        if timeout is not None and 0 <= timeout < 1e9:
            deadline = fe_monotonic_ns() + <int64_t>(float(timeout) * 1e9)
        result = []
        while True:
            if deadline >= 0:
                now = fe_monotonic_ns()
                # round up so a sub-millisecond remainder does not spin with a 0 ms timeout
                ms = 0
                if deadline > now:
                    ms = <int>min((deadline - now + 999999) // 1000000, MON_MAX_WAIT_MS)
            self._waiters += 1
            with nogil:
                n = epoll_wait(self._epfd, events, MON_MAX_EVENTS, ms)
            self._waiters -= 1
            if self._closing:
                if self._waiters == 0:
                    self._close_fds()
                return result
            if n < 0:
                if errno != EINTR:
                    _raise_errno()
                PyErr_CheckSignals()  # raises what a Python signal handler raised
                continue
            woken = False
            for i in range(n):
                tag = events[i].data.u64
                if tag == MON_WAKE_TAG:
                    read(self._evfd, &drained, sizeof(drained))
                    woken = True
                elif <pid_t>tag in self._fds:
                    item = self._collect(<pid_t>tag)
                    if item is not None:
                        result.append(item)
            if result or woken:
                return result
            if n == 0 and (deadline < 0 or fe_monotonic_ns() >= deadline):
                return result  # timed out (a clamped slice that ended early loops again)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self._epfd < 0 else f"watching {len(self._fds)}"
        return f"<PidfdMonitor {state}>"
