/* Fallbacks for syscalls and flags that older libc headers lack, and the debug flag default. */
#ifndef FE_COMPAT_H
#define FE_COMPAT_H

#include <sys/syscall.h>
#include <unistd.h>
#include <signal.h>
#include <time.h>
#include <stdint.h>

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

#endif
