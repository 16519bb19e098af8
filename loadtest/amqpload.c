/*
 * amqpload.c - a small epoll load generator and backend that speak just enough AMQP 1.0 to pass
 * through the Lodestone router (SASL PLAIN + AMQP header + Open), then move raw bytes.
 * Compiled at run time by loadtest/bench_proxy.py:  gcc -O2 -o amqpload amqpload.c -lssl -lcrypto
 *
 * The frames themselves are not built here: bench_proxy.py encodes them with Lodestone's own codec
 * and passes them as hex in environment variables, so this file only has to *count* frames:
 *   AMQPLOAD_CLIENT_HELLO  client -> server, sent in one write: SASL header + sasl-init(PLAIN)
 *                          + AMQP header + open  (pipelined, as AMQP 1.0 §5.3.2 allows)
 *   AMQPLOAD_SRV_SASL      server reply to the SASL header: SASL header + sasl-mechanisms
 *   AMQPLOAD_SRV_OUTCOME   server reply to sasl-init: sasl-outcome(ok)
 *   AMQPLOAD_SRV_OPEN      server reply to the client's open: AMQP header + open
 *
 * After the handshake, the first payload byte picks what the backend does (as in a classic
 * netbench): 'E' echo, 'D' stream data down to the client forever, 'U' read and discard.
 *
 *   amqpload server -p PORT [-c cert.pem -k key.pem]       (prints "port N" once listening)
 *   amqpload cps  -t HOST:PORT [-n conc] [-d secs] [-w warmup] [-s] [-r]
 *       one connection = TLS (-s) + handshake + 64-byte echo, then close.  -r: redirect mode, one
 *       connection = TLS + handshake up to the router's Close frame (no backend involved).
 *   amqpload bulk -t HOST:PORT [-n streams] [-d secs] [-w warmup] [-s] -m D|U
 *   amqpload hold -t HOST:PORT -n N [-c connecting] [-s] [-B SOURCE_ADDRESS]
 *       opens N connections (at most -c, default 200, connecting at once), each TLS (-s) +
 *       handshake + the payload byte 'U', then holds them idle: prints one JSON line once every
 *       connection is held or failed, then a second one (how many the far end closed meanwhile)
 *       when its standard input closes, and exits. -B binds every client socket to that
 *       source address first (any client mode): its own ephemeral ports, not 127.0.0.1's.
 * Clients print one JSON line.  TLS clients never resume sessions: every connection is a full
 * handshake (ECDSA P-256 certificates in the benchmark).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define BUF (256 * 1024)
#define MAXFD 65536

typedef struct { unsigned char *p; int n; } bytes;
static bytes HELLO, SRV_SASL, SRV_OUTCOME, SRV_OPEN;
static SSL_CTX *ctx;
static int ep;
static char scratch[BUF], source[BUF];

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void fail(const char *what) { perror(what); exit(2); }

static bytes from_hex_env(const char *name) {
    const char *h = getenv(name);
    bytes b = {0, 0};
    if (!h) return b;
    b.n = (int)strlen(h) / 2;
    b.p = malloc(b.n + 1);
    for (int i = 0; i < b.n; i++) sscanf(h + 2 * i, "%2hhx", &b.p[i]);
    return b;
}

/* A token scanner: the peer's handshake is a fixed sequence of 8-byte headers ('H') and frames
 * ('F', size from the first 4 bytes, AMQP 1.0 §2.3.1). */
typedef struct {
    const char *seq;   /* e.g. "HFHF" */
    int idx;           /* current token */
    int have;          /* bytes of the current token seen */
    unsigned char size_bytes[4];
    uint32_t need;     /* total bytes of the current token once known (0 = unknown yet) */
} scanner;

/* Consume up to n bytes; returns bytes consumed; *done_token set to the index of a token that
 * just completed (or -1). Stops after completing one token so the caller can react. */
static int scan(scanner *s, const unsigned char *p, int n, int *done_token) {
    int used = 0;
    *done_token = -1;
    while (used < n && s->seq[s->idx]) {
        char t = s->seq[s->idx];
        if (t == 'H') s->need = 8;
        else if (s->have < 4) {
            s->size_bytes[s->have++] = p[used++];
            if (s->have == 4) {
                s->need = ((uint32_t)s->size_bytes[0] << 24) | ((uint32_t)s->size_bytes[1] << 16) |
                          ((uint32_t)s->size_bytes[2] << 8) | s->size_bytes[3];
                if (s->need < 8) s->need = 8;
            }
            continue;
        }
        int take = (int)(s->need - s->have);
        if (take > n - used) take = n - used;
        s->have += take;
        used += take;
        if ((uint32_t)s->have >= s->need) {
            *done_token = s->idx;
            s->idx++;
            s->have = 0;
            s->need = 0;
            return used;
        }
    }
    return used;
}

typedef struct conn {
    int fd;
    SSL *ssl;
    int state;
    scanner sc;
    unsigned char *out; int olen, opos, ocap;   /* pending output */
    char mode;                                  /* payload mode E/D/U */
    long long got;
    double t0;
    int want;                                   /* epoll events wanted */
} conn;

static conn *conns[MAXFD];

/* I/O: >0 bytes, 0 EOF, -1 would block (c->want set), -2 error */
static int io_read(conn *c, void *b, int n) {
    if (!c->ssl) {
        int r = (int)read(c->fd, b, n);
        if (r >= 0) return r;
        if (errno == EAGAIN) { c->want = EPOLLIN; return -1; }
        return -2;
    }
    int r = SSL_read(c->ssl, b, n);
    if (r > 0) return r;
    switch (SSL_get_error(c->ssl, r)) {
    case SSL_ERROR_WANT_READ: c->want = EPOLLIN; return -1;
    case SSL_ERROR_WANT_WRITE: c->want = EPOLLOUT; return -1;
    case SSL_ERROR_ZERO_RETURN: return 0;
    default: ERR_clear_error(); return -2;
    }
}

static int io_write(conn *c, const void *b, int n) {
    if (!c->ssl) {
        int r = (int)write(c->fd, b, n);
        if (r >= 0) return r;
        if (errno == EAGAIN) { c->want = EPOLLOUT; return -1; }
        return -2;
    }
    int r = SSL_write(c->ssl, b, n);
    if (r > 0) return r;
    switch (SSL_get_error(c->ssl, r)) {
    case SSL_ERROR_WANT_READ: c->want = EPOLLIN; return -1;
    case SSL_ERROR_WANT_WRITE: c->want = EPOLLOUT; return -1;
    default: ERR_clear_error(); return -2;
    }
}

static void watch(conn *c, int events, int add) {
    struct epoll_event e = {.events = events, .data.fd = c->fd};
    if (epoll_ctl(ep, add ? EPOLL_CTL_ADD : EPOLL_CTL_MOD, c->fd, &e) < 0) fail("epoll_ctl");
}

static void queue_out(conn *c, const void *p, int n) {
    if (c->olen + n > c->ocap) {
        c->ocap = (c->olen + n) * 2;
        c->out = realloc(c->out, c->ocap);
    }
    memcpy(c->out + c->olen, p, n);
    c->olen += n;
}

/* 1 = all flushed, 0 = would block, -1 = error */
static int flush_out(conn *c) {
    while (c->opos < c->olen) {
        int w = io_write(c, c->out + c->opos, c->olen - c->opos);
        if (w == -2) return -1;
        if (w == -1) return 0;
        c->opos += w;
    }
    c->opos = c->olen = 0;
    return 1;
}

static void drop(conn *c) {
    if (c->ssl) { SSL_shutdown(c->ssl); SSL_free(c->ssl); }
    epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    conns[c->fd] = NULL;
    free(c->out);
    free(c);
}

static SSL_CTX *make_ctx(int server, const char *cert, const char *key) {
    SSL_CTX *x = SSL_CTX_new(server ? TLS_server_method() : TLS_client_method());
    if (!x) fail("SSL_CTX_new");
    SSL_CTX_set_options(x, SSL_OP_IGNORE_UNEXPECTED_EOF);
    SSL_CTX_set_mode(x, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
    if (server) {
        if (SSL_CTX_use_certificate_chain_file(x, cert) != 1 ||
            SSL_CTX_use_PrivateKey_file(x, key, SSL_FILETYPE_PEM) != 1) {
            ERR_print_errors_fp(stderr);
            exit(2);
        }
    } else {
        SSL_CTX_set_verify(x, SSL_VERIFY_NONE, NULL);
        SSL_CTX_set_session_cache_mode(x, SSL_SESS_CACHE_OFF);
        SSL_CTX_set_options(x, SSL_OP_NO_TICKET);
    }
    return x;
}

/* ------------------------------------------------------------------------------- backend */
enum { S_HANDSHAKE = 1, S_PAYLOAD };

static void server_step(conn *c) {
    for (;;) {
        c->want = 0;
        int f = flush_out(c);
        if (f < 0) { drop(c); return; }
        if (f == 0) { watch(c, c->want, 0); return; }
        if (c->state == S_PAYLOAD && c->mode == 'D') {
            int w = io_write(c, source, BUF);
            if (w == -2) { drop(c); return; }
            if (w == -1) { watch(c, c->want | EPOLLRDHUP, 0); return; }
            continue;
        }
        int r = io_read(c, scratch, BUF);
        if (r == 0 || r == -2) { drop(c); return; }
        if (r == -1) { watch(c, c->want, 0); return; }
        int off = 0;
        while (off < r) {
            if (c->state == S_HANDSHAKE) {
                int done;
                off += scan(&c->sc, (unsigned char *)scratch + off, r - off, &done);
                if (done == 0) queue_out(c, SRV_SASL.p, SRV_SASL.n);
                else if (done == 1) queue_out(c, SRV_OUTCOME.p, SRV_OUTCOME.n);
                else if (done == 3) { queue_out(c, SRV_OPEN.p, SRV_OPEN.n); c->state = S_PAYLOAD; }
                continue;
            }
            if (!c->mode) c->mode = scratch[off];
            if (c->mode == 'E') queue_out(c, scratch + off, r - off);
            off = r;   /* 'U' discards; 'D' ignores input */
        }
    }
}

static int run_server(int argc, char **argv) {
    int port = 0, opt, one = 1;
    const char *cert = NULL, *key = NULL;
    while ((opt = getopt(argc, argv, "p:c:k:")) != -1) {
        if (opt == 'p') port = atoi(optarg);
        else if (opt == 'c') cert = optarg;
        else if (opt == 'k') key = optarg;
    }
    if (cert) ctx = make_ctx(1, cert, key);
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    if (bind(ls, (void *)&sa, sizeof sa) < 0) fail("bind");
    if (listen(ls, 4096) < 0) fail("listen");
    socklen_t sl = sizeof sa;
    getsockname(ls, (void *)&sa, &sl);
    printf("port %d\n", ntohs(sa.sin_port));
    fflush(stdout);
    fcntl(ls, F_SETFL, O_NONBLOCK);
    ep = epoll_create1(0);
    struct epoll_event e = {.events = EPOLLIN, .data.fd = ls};
    epoll_ctl(ep, EPOLL_CTL_ADD, ls, &e);
    memset(source, 'd', BUF);
    struct epoll_event evs[256];
    for (;;) {
        int n = epoll_wait(ep, evs, 256, -1);
        for (int i = 0; i < n; i++) {
            int fd = evs[i].data.fd;
            if (fd == ls) {
                int cfd;
                while ((cfd = accept4(ls, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
                    setsockopt(cfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                    conn *c = calloc(1, sizeof *c);
                    c->fd = cfd;
                    c->state = S_HANDSHAKE;
                    c->sc.seq = "HFHF";
                    if (ctx) { c->ssl = SSL_new(ctx); SSL_set_fd(c->ssl, cfd); SSL_set_accept_state(c->ssl); }
                    conns[cfd] = c;
                    watch(c, EPOLLIN, 1);
                }
                continue;
            }
            conn *c = conns[fd];
            if (!c) continue;
            if (c->state == S_PAYLOAD && c->mode == 'D' && (evs[i].events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR))) {
                drop(c);
                continue;
            }
            server_step(c);
        }
    }
}

/* ------------------------------------------------------------------------------- clients */
enum { C_CONNECTING = 1, C_HANDSHAKE, C_ECHO, C_BULK, C_HELD };

static struct sockaddr_in target, source_addr;   /* source_addr: -B, else the kernel's choice */
static int redirect_mode, echo_len = 64, hold_mode;
static long long held_count, held_dropped;
static char bulk_mode = 0;
static double t_measure, t_end;
static long long done_count, errors, bytes_moved;
static float *lat; static long long nlat, caplat;

static conn *client_open(void) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0), one = 1;
    if (fd < 0) fail("socket");
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (source_addr.sin_family) {
        /* the port is then picked at connect(), for the whole 4-tuple (bind() alone would pick
         * one that no socket of any address uses, a slow search once thousands are open) */
        setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof one);
        if (bind(fd, (void *)&source_addr, sizeof source_addr) < 0) fail("bind -B");
    }
    conn *c = calloc(1, sizeof *c);
    c->fd = fd;
    c->t0 = now();
    c->state = C_CONNECTING;
    c->sc.seq = redirect_mode ? "HFFHFF" : "HFFHF";
    conns[fd] = c;
    connect(fd, (void *)&target, sizeof target);  /* errors show up as EPOLLERR */
    watch(c, EPOLLOUT, 1);
    return c;
}

static void client_error(conn *c) {
    if (c->state == C_HELD) { held_count--; held_dropped++; } else errors++;
    drop(c);
}

static void finished(conn *c) {
    double t = now();
    if (t >= t_measure && t < t_end) {
        done_count++;
        if (nlat < caplat) lat[nlat++] = (float)((t - c->t0) * 1000.0);
    }
    drop(c);
}

static void client_step(conn *c, uint32_t events) {
    static char echo[65536];
    for (;;) {
        c->want = 0;
        int f = flush_out(c);
        if (f < 0) { client_error(c); return; }
        if (f == 0) { watch(c, c->want, 0); return; }
        switch (c->state) {
        case C_CONNECTING: {
            int err = 0; socklen_t l = sizeof err;
            getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &l);
            if (err || (events & (EPOLLERR | EPOLLHUP))) { client_error(c); return; }
            if (ctx) { c->ssl = SSL_new(ctx); SSL_set_fd(c->ssl, c->fd); SSL_set_connect_state(c->ssl); }
            queue_out(c, HELLO.p, HELLO.n);
            c->state = C_HANDSHAKE;
            continue;
        }
        case C_HANDSHAKE: {
            int r = io_read(c, scratch, BUF);
            if (r == 0 || r == -2) { client_error(c); return; }
            if (r == -1) { watch(c, c->want, 0); return; }
            int off = 0, d;
            while (off < r && c->sc.seq[c->sc.idx]) off += scan(&c->sc, (unsigned char *)scratch + off, r - off, &d);
            if (!c->sc.seq[c->sc.idx]) {
                if (redirect_mode) { finished(c); return; }
                if (hold_mode) {
                    char m = 'U';          /* the backend reads and discards: an idle client */
                    queue_out(c, &m, 1);
                    c->state = C_HELD;
                    held_count++;
                    continue;
                }
                if (bulk_mode) {
                    char m = bulk_mode;
                    queue_out(c, &m, 1);
                    c->state = C_BULK;
                } else {
                    memset(echo, 'q', echo_len);
                    echo[0] = 'E';
                    queue_out(c, echo, echo_len);
                    c->state = C_ECHO;
                    c->got = r - off;  /* bytes after the open (none expected) */
                }
            }
            continue;
        }
        case C_ECHO: {
            if (c->got >= echo_len) { finished(c); return; }
            int r = io_read(c, scratch, BUF);
            if (r == 0 || r == -2) { client_error(c); return; }
            if (r == -1) { watch(c, c->want, 0); return; }
            c->got += r;
            continue;
        }
        case C_HELD: {
            int r = io_read(c, scratch, BUF);
            if (r == 0 || r == -2) { client_error(c); return; }
            if (r == -1) { watch(c, c->want, 0); return; }
            continue;
        }
        case C_BULK: {
            int r;
            if (bulk_mode == 'D') {
                r = io_read(c, scratch, BUF);
                if (r == 0 || r == -2) { client_error(c); return; }
                if (r == -1) { watch(c, c->want, 0); return; }
            } else {
                r = io_write(c, source, BUF);
                if (r == -2) { client_error(c); return; }
                if (r == -1) { watch(c, c->want, 0); return; }
            }
            double t = now();
            if (t >= t_measure && t < t_end) bytes_moved += r;
            if (t >= t_end) { watch(c, 0, 0); return; }
            continue;
        }
        }
    }
}

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* hold: n idle connections, at most `connecting` of them not yet held at once */
static int run_hold(int n, int connecting, int tls) {
    hold_mode = 1;
    if (tls) ctx = make_ctx(0, NULL, NULL);
    ep = epoll_create1(0);
    struct epoll_event in = {.events = EPOLLIN, .data.fd = 0};
    epoll_ctl(ep, EPOLL_CTL_ADD, 0, &in);      /* stdin: its end ends the run */
    double t0 = now();
    long long opened = 0;
    int reported = 0;
    struct epoll_event evs[512];
    for (;;) {
        while (opened < n && opened - held_count - held_dropped - errors < connecting) {
            client_open();
            opened++;
        }
        if (!reported && held_count + held_dropped + errors >= n) {
            printf("{\"test\":\"hold\",\"n\":%d,\"tls\":%d,\"held\":%lld,\"errors\":%lld,\"secs\":%.2f}\n",
                   n, tls, held_count, errors, now() - t0);
            fflush(stdout);
            reported = 1;
        }
        int k = epoll_wait(ep, evs, 512, 200);
        for (int i = 0; i < k; i++) {
            int fd = evs[i].data.fd;
            if (fd == 0) {
                char b[64];
                if (read(0, b, sizeof b) <= 0) {
                    printf("{\"test\":\"hold-end\",\"held\":%lld,\"dropped\":%lld}\n", held_count, held_dropped);
                    return 0;
                }
                continue;
            }
            conn *c = conns[fd];
            if (c) client_step(c, evs[i].events);
        }
    }
}

static int run_client(const char *kind, int argc, char **argv) {
    int n = 50, opt, tls = 0, connecting = 200;
    double secs = 5, warm = 1;
    while ((opt = getopt(argc, argv, "t:n:d:w:m:c:B:sr")) != -1) {
        switch (opt) {
        case 't': {
            char host[256];
            const char *colon = strrchr(optarg, ':');
            if (!colon) { fprintf(stderr, "bad -t %s\n", optarg); return 2; }
            snprintf(host, sizeof host, "%.*s", (int)(colon - optarg), optarg);
            target.sin_family = AF_INET;
            target.sin_port = htons(atoi(colon + 1));
            if (inet_pton(AF_INET, host, &target.sin_addr) != 1) { fprintf(stderr, "bad host %s\n", host); return 2; }
            break;
        }
        case 'n': n = atoi(optarg); break;
        case 'd': secs = atof(optarg); break;
        case 'w': warm = atof(optarg); break;
        case 'm': bulk_mode = optarg[0]; break;
        case 's': tls = 1; break;
        case 'r': redirect_mode = 1; break;
        case 'c': connecting = atoi(optarg); break;
        case 'B':
            source_addr.sin_family = AF_INET;
            if (inet_pton(AF_INET, optarg, &source_addr.sin_addr) != 1) { fprintf(stderr, "bad -B %s\n", optarg); return 2; }
            break;
        }
    }
    if (!strcmp(kind, "hold")) return run_hold(n, connecting, tls);
    if (!strcmp(kind, "cps")) bulk_mode = 0;
    else if (bulk_mode != 'D' && bulk_mode != 'U') { fprintf(stderr, "bulk needs -m D|U\n"); return 2; }
    if (tls) ctx = make_ctx(0, NULL, NULL);
    memset(source, 'u', BUF);
    caplat = 4000000;
    lat = malloc(sizeof(float) * caplat);
    ep = epoll_create1(0);
    double t0 = now();
    t_measure = t0 + warm;
    t_end = t_measure + secs;
    for (int i = 0; i < n; i++) client_open();
    struct epoll_event evs[512];
    while (now() < t_end) {
        int k = epoll_wait(ep, evs, 512, 50);
        for (int i = 0; i < k; i++) {
            conn *c = conns[evs[i].data.fd];
            if (!c) continue;
            int fd = c->fd;
            client_step(c, evs[i].events);
            if (conns[fd] != c && now() < t_end) client_open();  /* keep n connections busy */
        }
    }
    if (bulk_mode) {
        printf("{\"test\":\"bulk\",\"dir\":\"%c\",\"streams\":%d,\"tls\":%d,\"secs\":%.2f,\"MBps\":%.1f,\"errors\":%lld}\n",
               bulk_mode, n, tls, secs, bytes_moved / secs / 1e6, errors);
    } else {
        double p50 = 0, p99 = 0;
        if (nlat) {
            qsort(lat, nlat, sizeof(float), cmp_float);
            p50 = lat[nlat / 2];
            p99 = lat[(long long)(nlat * 0.99)];
        }
        printf("{\"test\":\"cps\",\"conc\":%d,\"tls\":%d,\"redirect\":%d,\"secs\":%.2f,\"cps\":%.0f,\"count\":%lld,"
               "\"errors\":%lld,\"p50_ms\":%.3f,\"p99_ms\":%.3f}\n",
               n, tls, redirect_mode, secs, done_count / secs, done_count, errors, p50, p99);
    }
    return 0;
}

int main(int argc, char **argv) {
    signal(SIGPIPE, SIG_IGN);
    struct rlimit rl = {MAXFD, MAXFD};
    if (setrlimit(RLIMIT_NOFILE, &rl) < 0) {
        getrlimit(RLIMIT_NOFILE, &rl);
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    HELLO = from_hex_env("AMQPLOAD_CLIENT_HELLO");
    SRV_SASL = from_hex_env("AMQPLOAD_SRV_SASL");
    SRV_OUTCOME = from_hex_env("AMQPLOAD_SRV_OUTCOME");
    SRV_OPEN = from_hex_env("AMQPLOAD_SRV_OPEN");
    if (argc < 2) { fprintf(stderr, "usage: amqpload server|cps|bulk|hold ...\n"); return 2; }
    if (!strcmp(argv[1], "server")) return run_server(argc - 1, argv + 1);
    if (!HELLO.n) { fprintf(stderr, "AMQPLOAD_CLIENT_HELLO is not set\n"); return 2; }
    return run_client(argv[1], argc - 1, argv + 1);
}
