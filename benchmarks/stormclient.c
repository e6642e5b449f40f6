/* The light client of the store benchmark's connection storm: N raw sockets on one epoll.
 *
 * Usage: stormclient PORT N KEY [BARRIER_KEY TOTAL]. Driven by StormClient in _storebench.py
 * over stdin/stdout:
 *   1. creates N non-blocking sockets, each bound to 127.0.0.{2 + i % 16} with
 *      IP_BIND_ADDRESS_NO_PORT, and prints {"ready": N};
 *   2. on a "go" line (anything else, or EOF, ends it) connects all N to 127.0.0.1:PORT in
 *      batches of 256, each sending VALIDATE + PING(nonce) + ADD(KEY, 1) in one write and
 *      reading the 12-byte reply (4-byte PING echo, then the 8-byte ADD result), then prints
 *      {"t0", "t1", "done", "refused", "reset", "closed", "bad_reply", "other", "unfinished"}
 *      (t0, t1: CLOCK_MONOTONIC seconds, as Python's time.monotonic(); t1 = the last reply);
 *      with BARRIER_KEY, each client then WAITs on it, and the one whose ADD returned TOTAL
 *      SETs it first (all clients of all processes meet at one barrier); "t_add" is the last
 *      ADD reply and t1 the last release;
 *   3. on a "close" line (or EOF) closes every socket with SO_LINGER {1, 0}: an RST, so no
 *      TIME_WAIT is left behind for the next storm.
 *
 * It is C so that the clients' CPU stays small next to the server's on a 2-core machine.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#ifndef IP_BIND_ADDRESS_NO_PORT
#define IP_BIND_ADDRESS_NO_PORT 24 /* linux/in.h, Linux >= 4.2 */
#endif

#define MAGIC 0x3C85F7CEu
#define OP_VALIDATE 0x00
#define OP_ADD 0x04
#define OP_PING 0x0d
#define OP_SET 0x01
#define OP_WAIT 0x06
#define REPLY_LEN 12 /* 4-byte PING echo + 8-byte ADD result */
#define REPLY_MAX 13 /* ... + the barrier WAIT's 1-byte release */
#define BATCH 256
#define SOURCE_ADDRS 16
#define LIMIT_S 120.0

enum { ST_IDLE, ST_CONNECTING, ST_READING, ST_FINISHED };
enum { F_DONE, F_REFUSED, F_RESET, F_CLOSED, F_BAD_REPLY, F_OTHER, F_COUNT };

static const char *const count_names[F_COUNT] = {
    "done", "refused", "reset", "closed", "bad_reply", "other"};

struct conn {
    int fd;
    unsigned char state;
    unsigned char got; /* reply bytes received so far, < reply_len */
    unsigned char buf[REPLY_MAX];
};

static struct conn *conns;
static int epfd = -1;
static long counts[F_COUNT];
static long pending; /* connected or connecting, not yet done or failed */
static unsigned char *payload;
static size_t payload_len;
static unsigned char nonce[4];
static size_t reply_len = REPLY_LEN;
static unsigned char *wait_req, *set_wait_req; /* barrier mode: WAIT; SET then WAIT */
static size_t wait_len, set_wait_len;
static uint64_t total; /* barrier mode: the ADD result that releases the barrier */
static double t_add;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The epoll_wait timeout once every client has started: up to 1 s, never past the deadline. */
static int wait_ms(double deadline)
{
    double left = deadline - now();

    return left >= 1.0 ? 1000 : left <= 0.0 ? 0 : (int)(left * 1000.0) + 1;
}

static void die(const char *what)
{
    perror(what);
    exit(1);
}

static void put_le(unsigned char *p, uint64_t v, int nbytes)
{
    for (int i = 0; i < nbytes; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

/* VALIDATE(magic) + PING(nonce) exactly as torch's client sends them, then ADD(key, 1). */
static void build_payload(const char *key, uint32_t nonce_value)
{
    size_t klen = strlen(key);
    unsigned char *p;

    payload_len = 1 + 4 + 1 + 4 + 1 + 8 + klen + 8;
    payload = malloc(payload_len);
    if (payload == NULL)
        die("malloc");
    p = payload;
    *p++ = OP_VALIDATE;
    put_le(p, MAGIC, 4);
    p += 4;
    *p++ = OP_PING;
    put_le(p, nonce_value, 4);
    memcpy(nonce, p, 4);
    p += 4;
    *p++ = OP_ADD;
    put_le(p, klen, 8);
    p += 8;
    memcpy(p, key, klen);
    p += klen;
    put_le(p, 1, 8);
}

/* Barrier mode: WAIT(bkey), and SET(bkey, "1") + WAIT(bkey) for the client that completes it. */
static void build_barrier(const char *bkey)
{
    size_t klen = strlen(bkey);
    unsigned char *p;

    wait_len = 1 + 8 + 8 + klen;
    set_wait_len = 1 + 8 + klen + 8 + 1 + wait_len;
    wait_req = malloc(wait_len);
    set_wait_req = malloc(set_wait_len);
    if (wait_req == NULL || set_wait_req == NULL)
        die("malloc");
    p = wait_req;
    *p++ = OP_WAIT;
    put_le(p, 1, 8);
    p += 8;
    put_le(p, klen, 8);
    p += 8;
    memcpy(p, bkey, klen);
    p = set_wait_req;
    *p++ = OP_SET;
    put_le(p, klen, 8);
    p += 8;
    memcpy(p, bkey, klen);
    p += klen;
    put_le(p, 1, 8);
    p += 8;
    *p++ = '1';
    memcpy(p, wait_req, wait_len);
    reply_len = REPLY_MAX;
}

static void raise_nofile(void)
{
    struct rlimit rl;

    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
            die("setrlimit(RLIMIT_NOFILE)");
    }
}

/* Reads one line of stdin; returns 1 if it is `word` (surrounding whitespace ignored). */
static int read_word(const char *word)
{
    char line[256];
    char *s, *e;

    if (fgets(line, sizeof line, stdin) == NULL)
        return 0;
    for (s = line; *s == ' ' || *s == '\t' || *s == '\r' || *s == '\n'; s++)
        ;
    for (e = s + strlen(s); e > s && (e[-1] == ' ' || e[-1] == '\t' || e[-1] == '\r' ||
                                      e[-1] == '\n');
         e--)
        ;
    *e = '\0';
    return strcmp(s, word) == 0;
}

static int classify(int err)
{
    return err == ECONNREFUSED ? F_REFUSED : err == ECONNRESET ? F_RESET : F_OTHER;
}

static void finish(struct conn *c, int kind)
{
    counts[kind]++;
    pending--;
    c->state = ST_FINISHED;
    epoll_ctl(epfd, EPOLL_CTL_DEL, c->fd, NULL);
}

/* One write of the whole payload; returns 0, or the errno of a failed (or short) send. */
static int send_payload(int fd)
{
    ssize_t r = send(fd, payload, payload_len, MSG_NOSIGNAL);

    if (r < 0)
        return errno;
    return (size_t)r == payload_len ? 0 : EMSGSIZE;
}

static int watch(struct conn *c, uint32_t i, int op, uint32_t events)
{
    struct epoll_event ev;

    ev.events = events;
    ev.data.u32 = i;
    return epoll_ctl(epfd, op, c->fd, &ev);
}

static void start(uint32_t i, const struct sockaddr_in *server)
{
    struct conn *c = &conns[i];
    int err;

    if (connect(c->fd, (const struct sockaddr *)server, sizeof *server) != 0 &&
        errno != EINPROGRESS) {
        counts[classify(errno)]++;
        c->state = ST_FINISHED;
        return;
    }
    pending++;
    /* On loopback the TCP handshake has usually completed inside connect(): send at once and
     * wait for EPOLLOUT only if it has not (client work kept out of the figure). */
    err = send_payload(c->fd);
    if (err == EAGAIN) {
        c->state = ST_CONNECTING;
        if (watch(c, i, EPOLL_CTL_ADD, EPOLLOUT) != 0)
            die("epoll_ctl");
        return;
    }
    if (err != 0) {
        counts[classify(err)]++;
        pending--;
        c->state = ST_FINISHED;
        return;
    }
    c->state = ST_READING;
    if (watch(c, i, EPOLL_CTL_ADD, EPOLLIN) != 0)
        die("epoll_ctl");
}

static void on_writable(uint32_t i)
{
    struct conn *c = &conns[i];
    int err = 0;
    socklen_t len = sizeof err;

    if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0)
        err = errno;
    if (err != 0) {
        finish(c, classify(err));
        return;
    }
    err = send_payload(c->fd);
    if (err != 0) {
        finish(c, err == ECONNRESET ? F_RESET : F_OTHER);
        return;
    }
    c->state = ST_READING;
    if (watch(c, i, EPOLL_CTL_MOD, EPOLLIN) != 0)
        die("epoll_ctl");
}

/* Returns 1 if this connection is now done. */
static int on_readable(uint32_t i)
{
    struct conn *c = &conns[i];
    unsigned char data[64];
    ssize_t r = recv(c->fd, data, sizeof data, 0);
    size_t n;

    if (r < 0) {
        if (errno == EAGAIN || errno == EINTR)
            return 0;
        finish(c, errno == ECONNRESET ? F_RESET : F_OTHER);
        return 0;
    }
    if (r == 0) {
        finish(c, F_CLOSED);
        return 0;
    }
    n = (size_t)r;
    if (c->got + n > reply_len) {
        finish(c, F_BAD_REPLY);
        return 0;
    }
    memcpy(c->buf + c->got, data, n);
    if (c->got < REPLY_LEN && c->got + n >= REPLY_LEN) {
        /* the ADD result is in */
        uint64_t added = 0;
        if (memcmp(c->buf, nonce, 4) != 0) {
            finish(c, F_BAD_REPLY);
            return 0;
        }
        t_add = now();
        if (reply_len > REPLY_LEN) {
            for (int k = 0; k < 8; k++)
                added |= (uint64_t)c->buf[4 + k] << (8 * k);
            const unsigned char *req = added == total ? set_wait_req : wait_req;
            size_t len = added == total ? set_wait_len : wait_len;
            if (send(c->fd, req, len, MSG_NOSIGNAL) != (ssize_t)len) {
                finish(c, F_OTHER);
                return 0;
            }
        }
    }
    c->got = (unsigned char)(c->got + n);
    if (c->got < reply_len)
        return 0;
    if (reply_len > REPLY_LEN && c->buf[REPLY_LEN] != 0) { /* STOP_WAITING */
        finish(c, F_BAD_REPLY);
        return 0;
    }
    finish(c, F_DONE);
    return 1;
}

int main(int argc, char **argv)
{
    struct sockaddr_in server, source;
    struct epoll_event *events;
    long port, n;
    uint32_t i, idx = 0;
    double t0, t1, deadline;
    int one = 1, nev;
    struct linger rst = {1, 0};

    if ((argc != 4 && argc != 6) || (port = strtol(argv[1], NULL, 10)) <= 0 || port > 65535 ||
        (n = strtol(argv[2], NULL, 10)) <= 0 || n > 1000000) {
        fprintf(stderr, "usage: %s PORT N KEY [BARRIER_KEY TOTAL]\n", argv[0]);
        return 2;
    }
    raise_nofile();
    build_payload(argv[3], (uint32_t)getpid() & 0xFFFFFFu);
    if (argc == 6) {
        total = strtoull(argv[5], NULL, 10);
        build_barrier(argv[4]);
    }

    memset(&server, 0, sizeof server);
    server.sin_family = AF_INET;
    server.sin_port = htons((uint16_t)port);
    server.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    memset(&source, 0, sizeof source);
    source.sin_family = AF_INET;

    conns = calloc((size_t)n, sizeof *conns);
    events = calloc((size_t)n, sizeof *events);
    if (conns == NULL || events == NULL)
        die("calloc");
    for (i = 0; i < n; i++) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);

        if (fd < 0)
            die("socket");
        /* Spread the clients over 16 loopback source addresses, the port picked at connect():
         * with one source address, 16,384 connections exhaust the even half of the ephemeral
         * range that connect() prefers, and the kernel's port search (client CPU) dominates. */
        if (setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof one) != 0)
            die("setsockopt(IP_BIND_ADDRESS_NO_PORT)");
        source.sin_addr.s_addr = htonl(INADDR_LOOPBACK + 1 + (i % SOURCE_ADDRS));
        if (bind(fd, (struct sockaddr *)&source, sizeof source) != 0)
            die("bind");
        conns[i].fd = fd;
    }
    epfd = epoll_create1(EPOLL_CLOEXEC);
    if (epfd < 0)
        die("epoll_create1");
    printf("{\"ready\": %ld}\n", n);
    fflush(stdout);
    if (!read_word("go"))
        return 0;

    t0 = t1 = now();
    deadline = t0 + (getenv("STORM_LIMIT_S") ? atof(getenv("STORM_LIMIT_S")) : LIMIT_S);
    while ((idx < n || pending > 0) && now() < deadline) {
        /* Connect in batches, handling replies in between, so early clients are not held
         * back. */
        for (i = idx; i < n && i < idx + BATCH; i++)
            start(i, &server);
        idx = i;
        nev = epoll_wait(epfd, events, (int)n, idx < n ? 0 : wait_ms(deadline));
        if (nev < 0) {
            if (errno == EINTR)
                continue;
            die("epoll_wait");
        }
        for (int k = 0; k < nev; k++) {
            uint32_t j = events[k].data.u32;

            if (conns[j].state == ST_CONNECTING)
                on_writable(j);
            else if (conns[j].state == ST_READING && on_readable(j))
                t1 = now();
        }
    }
    printf("{\"t0\": %.9f, \"t1\": %.9f, \"t_add\": %.9f", t0, t1, t_add);
    for (int k = 0; k < F_COUNT; k++)
        printf(", \"%s\": %ld", count_names[k], counts[k]);
    printf(", \"unfinished\": %ld}\n", pending + (n - (long)idx));
    fflush(stdout);

    read_word("close"); /* "close" or EOF: either way, close */
    for (i = 0; i < n; i++) {
        setsockopt(conns[i].fd, SOL_SOCKET, SO_LINGER, &rst, sizeof rst);
        close(conns[i].fd);
    }
    return 0;
}
