/* Fallbacks for syscalls and flags that older libc headers lack, and the debug flag default. */
#ifndef FE_COMPAT_H
#define FE_COMPAT_H

#include <sys/syscall.h>
#include <unistd.h>
#include <signal.h>
#include <time.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>

#ifndef FE_DEBUG
#define FE_DEBUG 0
#endif

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_send_signal
#define SYS_pidfd_send_signal 424
#endif

static inline int fe_pidfd_open(pid_t pid, unsigned int flags) {
    return (int)syscall(SYS_pidfd_open, pid, flags);
}

static inline int fe_pidfd_send_signal(int pidfd, int sig) {
    return (int)syscall(SYS_pidfd_send_signal, pidfd, sig, NULL, 0);
}

/* Monotonic clock in nanoseconds; every deadline in fastelastic is measured on it. */
static inline int64_t fe_monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + (int64_t)ts.tv_nsec;
}

/* "host:port" of a connected socket's peer into buf (for log lines); returns its length. */
static inline int fe_peer_name(int fd, char *buf, size_t n) {
    struct sockaddr_storage ss;
    socklen_t len = sizeof(ss);
    char host[INET6_ADDRSTRLEN] = "?";
    int port = 0;
    if (n == 0) return 0;
    buf[0] = 0;
    if (getpeername(fd, (struct sockaddr *)&ss, &len) != 0)
        return snprintf(buf, n, "(fd %d, peer unknown)", fd);
    if (ss.ss_family == AF_INET) {
        struct sockaddr_in *a = (struct sockaddr_in *)&ss;
        inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
        port = ntohs(a->sin_port);
    } else if (ss.ss_family == AF_INET6) {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
        inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
        port = ntohs(a->sin6_port);
    }
    return snprintf(buf, n, "%s:%d", host, port);
}

/* The soft RLIMIT_NOFILE (for the log line when accept runs out of fds); -1 if unlimited. */
static inline long fe_nofile_limit(void) {
    struct rlimit r;
    if (getrlimit(RLIMIT_NOFILE, &r) != 0) return -1;
    return r.rlim_cur == RLIM_INFINITY ? -1 : (long)r.rlim_cur;
}

/* writev for sockets without SIGPIPE (sendmsg with MSG_NOSIGNAL). */
#include <sys/uio.h>
static inline ssize_t fe_sendv(int fd, struct iovec *iov, int n) {
    struct msghdr m;
    memset(&m, 0, sizeof(m));
    m.msg_iov = iov;
    m.msg_iovlen = (size_t)n;
    return sendmsg(fd, &m, MSG_NOSIGNAL);
}

#endif
