# distutils: language = c++
"""Owns the named-pipe watchdog: FIFO reader, deadline index on a timerfd, pidfd kills."""

import logging
import warnings

cimport cython
from cpython.exc cimport PyErr_CheckSignals, PyErr_SetFromErrno
from cython.operator cimport dereference as deref, preincrement as inc
from libc.math cimport isfinite
from libc.stdint cimport int64_t, uint64_t
from libc.stdio cimport snprintf
from libc.stdlib cimport strtol
from libc.string cimport memchr, memset, strrchr, strstr
from libcpp.pair cimport pair
from libcpp.string cimport string
from libcpp.vector cimport vector
from cpython.mem cimport PyMem_RawFree, PyMem_RawMalloc

from fastelastic._native.watchdog_json cimport _parse_request, _ws
from fastelastic._native.includes.linux cimport (
    CLOCK_MONOTONIC, CLOCK_REALTIME, EFD_CLOEXEC, EFD_NONBLOCK, EINTR, EPOLL_CLOEXEC,
    EPOLL_CTL_ADD, EPOLL_CTL_DEL, EPOLLIN, ESRCH, O_CLOEXEC, O_NONBLOCK, O_RDONLY, O_RDWR,
    POLLIN, TFD_CLOEXEC, TFD_NONBLOCK, TFD_TIMER_ABSTIME, clock_gettime, close, epoll_create1,
    epoll_ctl, epoll_event, epoll_wait, errno, eventfd, fe_monotonic_ns, fe_pidfd_open,
    fe_pidfd_send_signal, geteuid, getpid, getuid, uid_t, itimerspec, open, pid_t, poll, pollfd,
    pthread_mutex_destroy,
    pthread_mutex_init, pthread_mutex_lock, pthread_mutex_unlock, read, SCHED_FIFO, SCHED_OTHER,
    sched_get_priority_min, sched_param, sched_setscheduler, timerfd_create, timerfd_settime,
    timespec, write,
)

_log = logging.getLogger("fastelastic.timer")

# Event kinds, re-exported for the Python policy layer.
EV_EXPIRED = WD_EV_EXPIRED
EV_KILLED = WD_EV_KILLED
EV_DEFERRED = WD_EV_DEFERRED
EV_REFUSED = WD_EV_REFUSED
EV_MALFORMED = WD_EV_MALFORMED
EV_EXITED = WD_EV_EXITED
# Results of register().
ADMIT_OK = WD_OK
ADMIT_REFUSED = WD_REFUSED
ADMIT_GONE = WD_GONE
ADMIT_BAD_PID = WD_BAD_PID


cdef int _raise_errno() except -1:
    PyErr_SetFromErrno(OSError)
    return -1


def parse_request(bytes line):
    """Parses one request line as the server does (for tests and tools).

    Returns:
        ``(pid, scope_id, expiration_time, signal)``.

    Raises:
        ValueError: the line is not a valid timer request.
    """
    cdef pid_t pid = 0
    cdef string scope
    cdef double expiration = 0
    cdef int sig = 0
    cdef const char *reason = _parse_request(line, len(line), &pid, &scope, &expiration, &sig)
    if reason != NULL:
        raise ValueError(reason.decode())
    return pid, scope.decode("utf-8", "surrogateescape"), expiration, sig


# --------------------------------------------------------------------------- helpers


cdef inline string _pid_key(pid_t pid) noexcept nogil:
    # big-endian so that every key of one pid is one contiguous range of the ordered map
    cdef string k
    cdef unsigned int u = <unsigned int>pid
    k.push_back(<char>((u >> 24) & 0xFF))
    k.push_back(<char>((u >> 16) & 0xFF))
    k.push_back(<char>((u >> 8) & 0xFF))
    k.push_back(<char>(u & 0xFF))
    return k


cdef bint _descends_from(pid_t pid, pid_t ancestor) noexcept nogil:
    """Walks /proc/<pid>/stat parent links up to ``ancestor`` (strictly below it)."""
    cdef char path[64]
    cdef char buf[1024]
    cdef const char *rp
    cdef int fd, _depth
    cdef long ppid
    cdef Py_ssize_t n
    for _depth in range(WD_MAX_DEPTH):
        snprintf(path, sizeof(path), "/proc/%d/stat", <int>pid)
        fd = open(path, O_RDONLY | O_CLOEXEC)
        if fd < 0:
            return False
        n = read(fd, buf, sizeof(buf) - 1)
        close(fd)
        if n <= 0:
            return False
        buf[n] = 0
        # "pid (comm) S ppid ...": comm may itself hold ')' so take the last one
        rp = strrchr(buf, c')')
        if rp == NULL or rp[1] == 0 or rp[2] == 0 or rp[3] == 0:
            return False
        ppid = strtol(rp + 4, NULL, 10)
        if ppid == ancestor:
            return True
        if ppid <= 1:
            return False
        pid = <pid_t>ppid
    return False


cdef bint _same_user(pid_t pid) noexcept nogil:
    """The kernel's kill permission without CAP_KILL: our real or effective uid equals the
    target's real or saved uid (read from the ``Uid:`` line of /proc/<pid>/status)."""
    cdef char path[64]
    cdef char buf[2048]
    cdef const char *p
    cdef char *end
    cdef long ids[3]
    cdef int fd, i
    cdef Py_ssize_t n
    cdef uid_t ruid = getuid(), euid = geteuid()
    snprintf(path, sizeof(path), "/proc/%d/status", <int>pid)
    fd = open(path, O_RDONLY | O_CLOEXEC)
    if fd < 0:
        return False
    n = read(fd, buf, sizeof(buf) - 1)
    close(fd)
    if n <= 0:
        return False
    buf[n] = 0
    p = strstr(buf, "\nUid:")
    if p == NULL:
        return False
    p += 5
    for i in range(3):           # real, effective, saved
        ids[i] = strtol(p, &end, 10)
        if end == p:
            return False
        p = end
    return (<long>ruid == ids[0] or <long>ruid == ids[2]
            or <long>euid == ids[0] or <long>euid == ids[2])


cdef int _set_policy(bint fifo) noexcept nogil:
    """Puts the calling thread (pid 0) on SCHED_FIFO's lowest priority, or back on SCHED_OTHER."""
    cdef sched_param param
    param.sched_priority = sched_get_priority_min(SCHED_FIFO) if fifo else 0
    return sched_setscheduler(0, SCHED_FIFO if fifo else SCHED_OTHER, &param)


cdef inline double _wall_now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_REALTIME, &ts)
    return <double>ts.tv_sec + <double>ts.tv_nsec * 1e-9


# --------------------------------------------------------------------------- the watchdog


@cython.final
cdef class FifoWatchdog:
    """The mechanics of the file-based timer server; policy lives in ``fastelastic.timer``.

    Invariants: every entry of ``_timers`` has exactly one ``(deadline_ns, key)`` in
    ``_deadlines`` and its pid is in ``_procs``, whose pidfd is registered in ``_epfd``; a pid
    enters ``_procs`` only if it is allow-listed, descends from this process (``allow_descendants``)
    or runs as our user (``allow_same_user``: torch's rule), checked after its pidfd was opened
    (so a recycled pid can never be signalled: signals go through the pidfd).
    All tables are guarded by ``_mu``; the loop holds it only between two ``epoll_wait`` calls and
    never while it holds the GIL-taking callback. The timerfd is armed (CLOCK_MONOTONIC, absolute)
    at the earliest deadline, so a timer fires at its deadline, not at the next sweep.

    The FIFO is opened O_RDWR: the server is itself a writer, so writers opening and closing
    never produce EOF (no EOF spin, no blocking open), and clients can write as soon as the
    object exists, before ``run()``.
    """

    def __cinit__(self, path, double max_interval=10.0, bint allow_descendants=True,
                  bint defer_kill=False, bint allow_same_user=False):
        cdef epoll_event ev
        self._fifo_fd = self._epfd = self._tfd = self._evfd = -1
        self._owner_pid = getpid()
        self._mu_ready = False
        self._buf = NULL
        self._allow_descendants = allow_descendants
        self._allow_same_user = allow_same_user
        self._defer_kill = defer_kill
        self._heartbeat_ms = <int>min(max(max_interval * 1000.0, 1.0), 1000.0)
        self._last_progress_ns = fe_monotonic_ns()
        if pthread_mutex_init(&self._mu, NULL) != 0:
            raise MemoryError()
        self._mu_ready = True
        self._buf = <char *>PyMem_RawMalloc(WD_READ_CHUNK)
        if self._buf == NULL:
            raise MemoryError()
        bpath = path.encode() if isinstance(path, str) else bytes(path)
        self._fifo_fd = open(bpath, O_RDWR | O_NONBLOCK | O_CLOEXEC)
        if self._fifo_fd < 0:
            _raise_errno()
        self._epfd = epoll_create1(EPOLL_CLOEXEC)
        if self._epfd < 0:
            _raise_errno()
        self._tfd = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK)
        if self._tfd < 0:
            _raise_errno()
        self._evfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)
        if self._evfd < 0:
            _raise_errno()
        memset(&ev, 0, sizeof(ev))
        ev.events = EPOLLIN
        for fd, tag in ((self._fifo_fd, WD_TAG_FIFO), (self._tfd, WD_TAG_TIMER),
                        (self._evfd, WD_TAG_WAKE)):
            ev.data.u64 = (<uint64_t>tag) << 32
            if epoll_ctl(self._epfd, EPOLL_CTL_ADD, fd, &ev) < 0:
                _raise_errno()

    def __dealloc__(self):
        if self._fifo_fd >= 0 and self._owner_pid == getpid():
            warnings.warn("unclosed FifoWatchdog", ResourceWarning)
        self._close_fds()
        if self._mu_ready:
            pthread_mutex_destroy(&self._mu)
        if self._buf != NULL:
            PyMem_RawFree(self._buf)
            self._buf = NULL

    cdef int _close_fds(self) noexcept:
        cdef pair[pid_t, WdProc] it
        if self._owner_pid != getpid():
            self._fifo_fd = self._epfd = self._tfd = self._evfd = -1
            self._procs.clear()
            return 0
        for it in self._procs:
            close(it.second.pidfd)
        self._procs.clear()
        self._timers.clear()
        self._deadlines.clear()
        for fd in (self._fifo_fd, self._epfd, self._tfd, self._evfd):
            if fd >= 0:
                close(fd)
        self._fifo_fd = self._epfd = self._tfd = self._evfd = -1
        return 0

    def close(self):
        """Closes every fd. The loop must have returned (``stop()`` then join its thread)."""
        if self._running:
            raise RuntimeError("FifoWatchdog.close() while run() is active; stop() it first")
        if self._epfd < 0:
            return
        self._lock()
        self._close_fds()
        self._unlock()

    # ------------------------------------------------------------------ locking, waking

    cdef int _lock(self) except -1:
        if self._epfd < 0:
            raise ValueError("FifoWatchdog is closed")
        with nogil:
            pthread_mutex_lock(&self._mu)
        return 0

    cdef void _unlock(self) noexcept nogil:
        pthread_mutex_unlock(&self._mu)

    cdef void _wake(self) noexcept nogil:
        cdef uint64_t one = 1
        if self._evfd >= 0:
            write(self._evfd, &one, sizeof(one))

    cdef void _arm(self) noexcept nogil:
        cdef itimerspec its
        cdef int64_t target = 0
        if not self._deadlines.empty():
            target = deref(self._deadlines.begin()).first
            if target <= 0:
                target = 1
        if target == self._armed_ns:
            return
        memset(&its, 0, sizeof(its))
        its.it_value.tv_sec = <long>(target // 1000000000)
        its.it_value.tv_nsec = <long>(target % 1000000000)
        timerfd_settime(self._tfd, TFD_TIMER_ABSTIME, &its, NULL)
        self._armed_ns = target

    # ------------------------------------------------------------------ input

    cdef void _on_fifo(self) noexcept nogil:
        cdef Py_ssize_t n
        cdef int rounds = 0
        # bounded: a flood of writers cannot keep us from firing deadlines
        while rounds < 64:
            n = read(self._fifo_fd, self._buf, WD_READ_CHUNK)
            if n <= 0:
                return
            self._on_data(self._buf, <size_t>n)
            rounds += 1

    cdef void _on_data(self, const char *p, size_t n) noexcept nogil:
        cdef const char *e = p + n
        cdef const char *nl
        if n == 0:
            return
        # Every request starts with '{'. A fragment left from an earlier read followed by a
        # new '{' is a writer that stopped mid-line: drop it rather than glue it to this line.
        if p[0] == c'{' and (not self._partial.empty() or self._discarding):
            if not self._partial.empty():
                self._malformed("partial line", self._partial.data(), self._partial.size())
                self._partial.clear()
            self._discarding = False
        while p < e:
            nl = <const char *>memchr(p, c'\n', <size_t>(e - p))
            if nl == NULL:
                if self._discarding:
                    return
                if self._partial.size() + <size_t>(e - p) > WD_LINE_MAX:
                    self._malformed("line longer than PIPE_BUF", p, <size_t>(e - p))
                    self._partial.clear()
                    self._discarding = True
                    return
                self._partial.append(p, <size_t>(e - p))
                return
            if self._discarding:
                self._discarding = False
            elif not self._partial.empty():
                self._partial.append(p, <size_t>(nl - p))
                self._on_line(self._partial.data(), self._partial.size())
                self._partial.clear()
            else:
                self._on_line(p, <size_t>(nl - p))
            p = nl + 1

    cdef void _on_line(self, const char *p, size_t n) noexcept nogil:
        cdef pid_t pid = 0
        cdef string scope
        cdef double expiration = 0
        cdef int sig = 0
        cdef const char *reason
        cdef const char *q
        cdef const char *e = p + n
        if n > WD_LINE_MAX:
            self._malformed("line longer than PIPE_BUF", p, n)
            return
        while p < e:
            if _ws(p, e) == e:
                return
            reason = _parse_request(p, <size_t>(e - p), &pid, &scope, &expiration, &sig)
            if reason == NULL:
                self._accept(pid, scope, expiration, sig, True)
                return
            # Two writers' bytes glued together (one stopped mid-line): salvage the tail
            # from the next '{' so the good request is not lost with the bad one.
            q = <const char *>memchr(p + 1, c'{', <size_t>(e - p - 1)) if e - p > 1 else NULL
            self._malformed(reason, p, <size_t>((q if q != NULL else e) - p))
            p = q if q != NULL else e

    cdef void _malformed(self, const char *reason, const char *p, size_t n) noexcept nogil:
        self._malformed_count += 1
        self._event(WD_EV_MALFORMED, 0, 0, 0, 0.0, string(p, n if n < 200 else 200))
        self._events.back().detail = string(reason)

    cdef void _event(self, int kind, pid_t pid, int sig, int err, double expiration,
                     const string &scope) noexcept nogil:
        cdef WdEvent ev
        ev.kind = kind
        ev.pid = pid
        ev.sig = sig
        ev.err = err
        ev.expiration = expiration
        ev.deadline_ns = ev.fired_ns = fe_monotonic_ns()
        ev.scope = scope
        self._events.push_back(ev)

    # ------------------------------------------------------------------ the timer table

    cdef int _accept(self, pid_t pid, const string &scope, double expiration, int sig,
                     bint from_wire) noexcept nogil:
        cdef string key = _pid_key(pid)
        cdef WdTimer t
        cdef int r
        cdef double delta
        cdef int64_t now
        self._request_count += 1
        key.append(scope)
        if expiration < 0:           # torch's release: negative expiration
            self._drop_timer(key)
            return WD_OK
        if self._procs.find(pid) == self._procs.end():
            r = self._admit(pid)
            if r != WD_OK:
                if from_wire:
                    self._event(WD_EV_REFUSED, pid, sig, r, expiration, scope)
                return r
        # torch sends wall-clock seconds; fix the deadline on CLOCK_MONOTONIC once, on arrival,
        # so a later wall-clock step neither fires nor postpones pending timers.
        now = fe_monotonic_ns()
        delta = expiration - _wall_now()
        if delta <= 0:
            t.deadline_ns = now
        elif delta > 1e9:
            t.deadline_ns = now + <int64_t>1000000000 * <int64_t>1000000000
        else:
            t.deadline_ns = now + <int64_t>(delta * 1e9)
        t.pid = pid
        t.sig = sig
        t.expiration = expiration
        if self._timers.find(key) != self._timers.end():
            self._drop_timer(key)
        self._timers[key] = t
        self._deadlines.insert(pair[int64_t, string](t.deadline_ns, key))
        self._procs[pid].ntimers += 1
        return WD_OK

    cdef int _admit(self, pid_t pid) noexcept nogil:
        cdef int fd
        cdef bint listed
        cdef pollfd pfd
        cdef epoll_event ev
        cdef WdProc proc
        if pid <= 0:
            return WD_BAD_PID
        listed = self._allowed.find(pid) != self._allowed.end()
        if pid == self._owner_pid and not listed:
            return WD_BAD_PID
        fd = fe_pidfd_open(pid, 0)
        if fd < 0:
            return WD_GONE
        if (not listed
                and not (self._allow_descendants and _descends_from(pid, self._owner_pid))
                and not (self._allow_same_user and _same_user(pid))):
            close(fd)
            return WD_REFUSED
        # The checks above looked the pid up again; if the process our pidfd names had
        # exited by then, the pid may have been recycled, so the checks proved nothing.
        pfd.fd = fd
        pfd.events = POLLIN
        pfd.revents = 0
        if poll(&pfd, 1, 0) != 0:
            close(fd)
            return WD_GONE
        memset(&ev, 0, sizeof(ev))
        ev.events = EPOLLIN
        ev.data.u64 = ((<uint64_t>WD_TAG_PIDFD) << 32) | <uint64_t><unsigned int>pid
        if epoll_ctl(self._epfd, EPOLL_CTL_ADD, fd, &ev) < 0:
            close(fd)
            return WD_GONE
        proc.pidfd = fd
        proc.ntimers = 0
        proc.listed = listed
        self._procs[pid] = proc
        return WD_OK

    cdef void _drop_timer(self, const string &key) noexcept nogil:
        it = self._timers.find(key)
        if it == self._timers.end():
            return
        self._deadlines.erase(pair[int64_t, string](deref(it).second.deadline_ns, key))
        pit = self._procs.find(deref(it).second.pid)
        if pit != self._procs.end():
            deref(pit).second.ntimers -= 1
        self._timers.erase(it)

    cdef int _clear_pid(self, pid_t pid) noexcept nogil:
        cdef string prefix = _pid_key(pid)
        cdef vector[string] keys
        it = self._timers.lower_bound(prefix)
        while it != self._timers.end() and deref(it).first.compare(0, 4, prefix) == 0:
            keys.push_back(deref(it).first)
            inc(it)
        for k in keys:
            self._drop_timer(k)
        return <int>keys.size()

    cdef void _on_exit(self, pid_t pid) noexcept nogil:
        cdef int n = self._clear_pid(pid)
        it = self._procs.find(pid)
        if it == self._procs.end():
            return
        epoll_ctl(self._epfd, EPOLL_CTL_DEL, deref(it).second.pidfd, NULL)
        close(deref(it).second.pidfd)
        self._procs.erase(it)
        if n > 0:
            self._event(WD_EV_EXITED, pid, 0, n, 0.0, string())

    cdef void _fire(self, int64_t now) noexcept nogil:
        cdef WdTimer t
        cdef WdEvent ev
        cdef string key
        while not self._deadlines.empty():
            if deref(self._deadlines.begin()).first > now:
                return
            key = deref(self._deadlines.begin()).second
            t = self._timers[key]
            self._drop_timer(key)
            ev.kind = WD_EV_EXPIRED
            ev.pid = t.pid
            ev.sig = t.sig
            ev.err = 0
            ev.expiration = t.expiration
            ev.deadline_ns = t.deadline_ns
            ev.scope = key.substr(4)
            ev.fired_ns = now
            self._events.push_back(ev)
            if t.sig <= 0:
                continue
            # Kill here, without the GIL: taking it first could cost a whole switch interval
            # (5 ms) while the agent's main thread runs Python. Policy hears about it after.
            if self._defer_kill:
                ev.kind = WD_EV_DEFERRED
            else:
                pit = self._procs.find(t.pid)
                ev.kind = WD_EV_KILLED
                ev.err = ESRCH
                if pit != self._procs.end():
                    if fe_pidfd_send_signal(deref(pit).second.pidfd, t.sig) == 0:
                        ev.err = 0
                    else:
                        ev.err = errno
                ev.fired_ns = fe_monotonic_ns()
            self._events.push_back(ev)
            self._clear_pid(t.pid)

    # ------------------------------------------------------------------ the loop

    cdef int _step(self, int timeout_ms) except -1 nogil:
        cdef int n, i
        cdef uint64_t tag, junk
        cdef bint stop
        cdef vector[WdEvent] out
        cdef int64_t front = -1, now
        pthread_mutex_lock(&self._mu)
        if self._stop:
            pthread_mutex_unlock(&self._mu)
            return 1
        self._arm()
        if not self._deadlines.empty():
            front = deref(self._deadlines.begin()).first
        pthread_mutex_unlock(&self._mu)
        if self._rt:
            # Real-time only near a deadline: far from one, floods of requests are read at
            # normal priority (batched by the scheduler) and we wake up once, WD_RT_WINDOW_NS
            # early, to switch, so that the deadline itself is met at SCHED_FIFO.
            now = fe_monotonic_ns()
            if (front >= 0 and front - now <= WD_RT_WINDOW_NS) != self._rt_on:
                self._rt_on = not self._rt_on
                _set_policy(self._rt_on)
            if front >= 0 and not self._rt_on:
                timeout_ms = <int>min(<int64_t>timeout_ms,
                                      (front - now - WD_RT_WINDOW_NS) // 1000000 + 1)
        n = epoll_wait(self._epfd, self._evs, WD_MAX_EVENTS, timeout_ms)
        if n < 0:
            if errno != EINTR:
                with gil:
                    _raise_errno()
            with gil:
                PyErr_CheckSignals()
            n = 0
        pthread_mutex_lock(&self._mu)
        self._last_progress_ns = fe_monotonic_ns()
        for i in range(n):
            tag = self._evs[i].data.u64 >> 32
            if tag == WD_TAG_FIFO:
                self._on_fifo()
            elif tag == WD_TAG_TIMER:
                read(self._tfd, &junk, sizeof(junk))
                self._armed_ns = 0
            elif tag == WD_TAG_WAKE:
                read(self._evfd, &junk, sizeof(junk))
            elif tag == WD_TAG_PIDFD:
                self._on_exit(<pid_t><unsigned int>self._evs[i].data.u64)
        if self._drain_stop:
            self._on_fifo()
            self._stop = True
        self._fire(fe_monotonic_ns())
        stop = self._stop
        out.swap(self._events)
        pthread_mutex_unlock(&self._mu)
        if not out.empty():
            # Python (the policy callback) never runs at real-time priority: drop to
            # SCHED_OTHER before taking the GIL, come back once it is released.
            if self._rt_on:
                _set_policy(False)
            with gil:
                self._deliver(out)
            if self._rt_on:
                _set_policy(True)
        return 1 if stop else 0

    cdef int _deliver(self, vector[WdEvent] &evs) except -1:
        cdef WdEvent *ev
        batch = []
        for i in range(evs.size()):
            ev = &evs[i]
            batch.append((ev.kind, ev.pid, ev.scope.decode("utf-8", "surrogateescape"),
                          ev.expiration, ev.sig, ev.err, ev.deadline_ns, ev.fired_ns,
                          ev.detail.decode("utf-8", "replace")))
        if self._callback is None:
            return 0
        try:
            self._callback(batch)
        except Exception:
            _log.exception("watchdog event callback failed; the watchdog keeps running")
        return 0

    def run(self, callback, bint realtime=False):
        """Runs the loop in the calling thread until ``stop()`` (also with ``drain=True``).

        The GIL is held only while ``callback(events)`` runs; each event is a tuple
        ``(kind, pid, scope_id, expiration_time, signal, err, deadline_ns, fired_ns, detail)``.
        With ``realtime`` (if the process may, see the ``realtime`` property) the thread runs at
        the lowest SCHED_FIFO priority from WD_RT_WINDOW_NS before the earliest deadline until
        it is gone, except while the callback runs (SCHED_OTHER).
        """
        if self._epfd < 0:
            raise ValueError("FifoWatchdog is closed")
        if self._running:
            raise RuntimeError("FifoWatchdog.run() is already active")
        self._callback = callback
        self._running = True
        self._rt = realtime and _set_policy(True) == 0  # permitted? then back to normal
        self._rt_on = False
        if self._rt:
            _set_policy(False)
        elif realtime:
            _log.info("watchdog: SCHED_FIFO not permitted (errno %d); normal priority", errno)
        try:
            with nogil:
                while self._step(self._heartbeat_ms) == 0:
                    pass
        finally:
            if self._rt_on:
                _set_policy(False)
            self._rt = self._rt_on = False
            self._running = False

    def poll_once(self, callback):
        """Reads what is in the FIFO, fires what is due and reports, without blocking."""
        self._callback = callback
        self._lock()
        self._stop = False
        self._unlock()
        with nogil:
            self._step(0)

    def stop(self, bint drain=False):
        """Makes ``run()`` return (after reading what is pending and firing what is due, if
        ``drain``); safe from any thread."""
        self._lock()
        if drain:
            self._drain_stop = True
        else:
            self._stop = True
        self._unlock()
        self._wake()

    # ------------------------------------------------------------------ Python-side API

    def register(self, int pid, scope_id, double expiration_time, int sig):
        """Registers (or, with a negative expiration, releases) one timer; returns ADMIT_*."""
        cdef string scope = scope_id.encode("utf-8", "surrogateescape")
        cdef int r
        if not isfinite(expiration_time):
            raise ValueError(f"expiration_time must be finite, got {expiration_time!r}")
        if sig < -WD_SIG_MAX or sig > WD_SIG_MAX:
            raise ValueError(f"not a signal number: {sig}")
        self._lock()
        r = self._accept(<pid_t>pid, scope, expiration_time, sig, False)
        self._unlock()
        self._wake()
        return r

    def clear_pids(self, pids):
        """Drops every timer of the given pids; returns how many were dropped."""
        cdef int total = 0
        cdef list todo = [int(p) for p in pids]
        self._lock()
        for p in todo:
            total += self._clear_pid(<pid_t>p)
        self._unlock()
        self._wake()
        return total

    def reap(self, int pid, int sig, bint clear=True):
        """Signals an admitted ``pid`` through its pidfd (never by pid number), dropping its
        timers if ``clear``; returns 0 or an errno (ESRCH if not admitted or gone)."""
        cdef int err = ESRCH
        self._lock()
        it = self._procs.find(<pid_t>pid)
        if it != self._procs.end():
            err = 0 if fe_pidfd_send_signal(deref(it).second.pidfd, sig) == 0 else errno
            if clear:
                self._clear_pid(<pid_t>pid)
        self._unlock()
        self._wake()
        return err

    def snapshot(self):
        """Returns the pending timers: ``(pid, scope_id, expiration_time, signal, deadline_ns)``."""
        cdef list out = []
        self._lock()
        try:
            for item in self._timers:
                scope = item.first.substr(4).decode("utf-8", "surrogateescape")
                out.append((item.second.pid, scope, item.second.expiration, item.second.sig,
                            item.second.deadline_ns))
        finally:
            self._unlock()
        return out

    def set_allowed(self, pids):
        """Replaces the allow-list; admitted pids that leave it (and are not descendants) lose
        their timers."""
        cdef list todo = [int(p) for p in pids]
        cdef vector[pid_t] dropped
        self._lock()
        self._allowed.clear()
        for p in todo:
            self._allowed.insert(<pid_t>p)
        for item in self._procs:
            if (item.second.listed and self._allowed.find(item.first) == self._allowed.end()
                    and not (self._allow_descendants
                             and _descends_from(item.first, self._owner_pid))):
                dropped.push_back(item.first)
        for p in dropped:
            self._forget_locked(p)
        self._unlock()
        self._wake()

    cdef void _forget_locked(self, pid_t pid) noexcept nogil:
        self._clear_pid(pid)
        it = self._procs.find(pid)
        if it != self._procs.end():
            epoll_ctl(self._epfd, EPOLL_CTL_DEL, deref(it).second.pidfd, NULL)
            close(deref(it).second.pidfd)
            self._procs.erase(it)

    @property
    def request_count(self):
        """Requests processed (acquire and release, wire and Python) since creation."""
        return self._request_count

    @property
    def malformed_count(self):
        """Lines skipped as malformed since creation."""
        return self._malformed_count

    @property
    def last_progress_ns(self):
        """CLOCK_MONOTONIC time of the loop's last iteration."""
        return self._last_progress_ns

    @property
    def realtime(self):
        """True while ``run()`` may switch its loop to SCHED_FIFO (near deadlines)."""
        return self._rt

    @property
    def running(self):
        """True while ``run()`` is active."""
        return self._running

    def __len__(self):
        return self._timers.size()
