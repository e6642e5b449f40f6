# Extern-only declarations of the Linux syscalls fastelastic's native modules use; all nogil.

from libc.stdint cimport int64_t, uint32_t, uint64_t


cdef extern from "compat.h" nogil:
    int FE_DEBUG
    int fe_pidfd_open(int pid, unsigned int flags)
    int fe_pidfd_send_signal(int pidfd, int sig)
    int64_t fe_monotonic_ns()
    int fe_peer_name(int fd, char *buf, size_t n)
    long fe_nofile_limit()


cdef extern from "<errno.h>" nogil:
    int errno
    enum:
        EINTR
        EAGAIN
        EWOULDBLOCK
        EINPROGRESS
        ECONNREFUSED
        ECONNRESET
        EPIPE
        EMFILE
        ENFILE
        ENOBUFS
        ENOMEM
        ESRCH
        ENXIO
        ETIMEDOUT
        ECONNABORTED
        EMSGSIZE


cdef extern from "<unistd.h>" nogil:
    ctypedef long ssize_t
    ctypedef int pid_t
    int close(int fd)
    ssize_t read(int fd, void *buf, size_t count)
    ssize_t write(int fd, const void *buf, size_t count)
    int pipe2(int pipefd[2], int flags)
    pid_t getpid()
    ctypedef unsigned int uid_t
    uid_t getuid()
    uid_t geteuid()


cdef extern from "<fcntl.h>" nogil:
    enum:
        O_RDONLY
        O_WRONLY
        O_RDWR
        O_NONBLOCK
        O_CLOEXEC
        F_GETFL
        F_SETFL
        F_DUPFD_CLOEXEC
    int open(const char *path, int flags, ...)
    int fcntl(int fd, int cmd, ...)


cdef extern from "<sys/stat.h>" nogil:
    int mkfifo(const char *path, unsigned int mode)


cdef extern from "<sys/epoll.h>" nogil:
    ctypedef union epoll_data_t:
        void *ptr
        int fd
        uint32_t u32
        uint64_t u64

    cdef struct epoll_event:
        uint32_t events
        epoll_data_t data

    enum:
        EPOLLIN
        EPOLLOUT
        EPOLLERR
        EPOLLHUP
        EPOLLRDHUP
        EPOLLET
        EPOLL_CTL_ADD
        EPOLL_CTL_MOD
        EPOLL_CTL_DEL
        EPOLL_CLOEXEC

    int epoll_create1(int flags)
    int epoll_ctl(int epfd, int op, int fd, epoll_event *event)
    int epoll_wait(int epfd, epoll_event *events, int maxevents, int timeout)


cdef extern from "<sys/eventfd.h>" nogil:
    enum:
        EFD_CLOEXEC
        EFD_NONBLOCK
    int eventfd(unsigned int initval, int flags)


cdef extern from "<sys/timerfd.h>" nogil:
    enum:
        TFD_CLOEXEC
        TFD_NONBLOCK
        TFD_TIMER_ABSTIME

    cdef struct timespec:
        long tv_sec
        long tv_nsec

    cdef struct itimerspec:
        timespec it_interval
        timespec it_value

    int timerfd_create(int clockid, int flags)
    int timerfd_settime(int fd, int flags, const itimerspec *new_value, itimerspec *old_value)


cdef extern from "<time.h>" nogil:
    enum:
        CLOCK_MONOTONIC


cdef extern from "<poll.h>" nogil:
    cdef struct pollfd:
        int fd
        short events
        short revents
    enum:
        POLLIN
        POLLOUT
        POLLERR
        POLLHUP
        POLLNVAL
    int poll(pollfd *fds, unsigned long nfds, int timeout)


cdef extern from "<signal.h>" nogil:
    enum:
        SIGKILL
        SIGTERM
    int kill(pid_t pid, int sig)


cdef extern from "<sys/wait.h>" nogil:
    ctypedef struct siginfo_t:
        int si_pid
        int si_status
        int si_code
    enum:
        P_PIDFD
        WEXITED
        WNOHANG
        WNOWAIT
        CLD_EXITED
        CLD_KILLED
        CLD_DUMPED
    int waitid(int idtype, unsigned int id, siginfo_t *infop, int options)


cdef extern from "<sys/socket.h>" nogil:
    ctypedef unsigned int socklen_t
    ctypedef unsigned short sa_family_t

    cdef struct sockaddr:
        sa_family_t sa_family

    cdef struct sockaddr_storage:
        sa_family_t ss_family

    enum:
        AF_INET
        AF_INET6
        AF_UNSPEC
        SOCK_STREAM
        SOCK_NONBLOCK
        SOCK_CLOEXEC
        SOL_SOCKET
        SO_KEEPALIVE
        SO_REUSEADDR
        SO_ERROR
        SO_SNDBUF
        SO_RCVBUF
        MSG_NOSIGNAL
        MSG_DONTWAIT
        SHUT_RDWR

    int socket(int domain, int type, int protocol)
    int bind(int fd, const sockaddr *addr, socklen_t len)
    int listen(int fd, int backlog)
    int accept4(int fd, sockaddr *addr, socklen_t *len, int flags)
    int connect(int fd, const sockaddr *addr, socklen_t len)
    int setsockopt(int fd, int level, int optname, const void *optval, socklen_t optlen)
    int getsockopt(int fd, int level, int optname, void *optval, socklen_t *optlen)
    int getsockname(int fd, sockaddr *addr, socklen_t *len)
    ssize_t send(int fd, const void *buf, size_t n, int flags)
    ssize_t recv(int fd, void *buf, size_t n, int flags)
    int shutdown(int fd, int how)


cdef extern from "<netinet/in.h>" nogil:
    enum:
        IPPROTO_TCP


cdef extern from "<netinet/tcp.h>" nogil:
    enum:
        TCP_NODELAY
        TCP_USER_TIMEOUT
        TCP_KEEPIDLE
        TCP_KEEPINTVL
        TCP_KEEPCNT


cdef extern from "<sys/uio.h>" nogil:
    cdef struct iovec:
        void *iov_base
        size_t iov_len
    ssize_t writev(int fd, const iovec *iov, int iovcnt)


cdef extern from "compat.h" nogil:
    ssize_t fe_sendv(int fd, iovec *iov, int n)   # sendmsg(MSG_NOSIGNAL) of an iovec array


cdef extern from "<sys/prctl.h>" nogil:
    enum:
        PR_SET_PDEATHSIG
        PR_SET_CHILD_SUBREAPER
    int prctl(int option, unsigned long arg2, unsigned long arg3, unsigned long arg4,
              unsigned long arg5)


# procmon: errno values for pidfd/waitid results, and the siginfo/pidfd extras it reads.
cdef extern from "<errno.h>" nogil:
    enum:
        ECHILD
        ENOSYS
        EINVAL


# --- watchdog: wall-clock reads (to convert torch's wall expirations), mutex, /proc parsing
cdef extern from "<time.h>" nogil:
    enum:
        CLOCK_REALTIME
    int clock_gettime(int clockid, timespec *tp)


cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    int pthread_mutex_init(pthread_mutex_t *mutex, const void *attr)
    int pthread_mutex_destroy(pthread_mutex_t *mutex)
    int pthread_mutex_lock(pthread_mutex_t *mutex)
    int pthread_mutex_unlock(pthread_mutex_t *mutex)


cdef extern from "<sys/time.h>" nogil:
    cdef struct timeval:
        long tv_sec
        long tv_usec


cdef extern from "<sys/socket.h>" nogil:
    enum:
        SO_RCVTIMEO
        SO_SNDTIMEO


# --- watchdog: an optional SCHED_FIFO loop thread (dropped to SCHED_OTHER around Python calls)
cdef extern from "<sched.h>" nogil:
    cdef struct sched_param:
        int sched_priority
    enum:
        SCHED_OTHER
        SCHED_FIFO
    int sched_setscheduler(pid_t pid, int policy, const sched_param *param)
    int sched_get_priority_min(int policy)
    int sched_yield()
