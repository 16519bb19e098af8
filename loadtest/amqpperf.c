/*
 * amqpperf.c - a native AMQP 1.0 load generator on Qpid Proton-C's proactor (Debian 12:
 * libqpid-proton11-dev), so that a broker is measured at its own limit, not at a Python client's.
 * Compiled at run time by loadtest/bench_broker.py:  gcc -O2 -o amqpperf amqpperf.c -lqpid-proton
 *
 *   amqpperf -u HOST:PORT -a ADDRESS -n MESSAGES [-s SIZE] [-d] [-p SENDERS] [-r RECEIVERS]
 *            [-w WINDOW] [-c CREDIT] [-U USER -P PASSWORD] [-b PID[,PID...]] [-t TIMEOUT_S]
 *
 * SENDERS connections each send MESSAGES/SENDERS messages (one data section of SIZE bytes; the
 * header durable with -d) on one link, unsettled, at most WINDOW awaiting the broker's
 * disposition; RECEIVERS connections each consume on one link with CREDIT credit, accept and
 * settle every message and top the credit up at half. Sending starts once every receiver is
 * attached. Like a real client: SASL PLAIN, credit, settlement; no message is pre-settled.
 * The message is encoded once. One thread, one proactor: the generator's own CPU stays far below
 * the broker's.
 *
 * Prints one JSON line: msgs_per_s (first send to last receipt), the broker's CPU per message
 * (utime+stime of the -b processes from /proc over the same interval), this process's CPU per
 * message, and counts. Exit 1 when not every message was accepted and received, or on timeout.
 */
#include <proton/connection.h>
#include <proton/delivery.h>
#include <proton/event.h>
#include <proton/link.h>
#include <proton/message.h>
#include <proton/proactor.h>
#include <proton/sasl.h>
#include <proton/session.h>
#include <proton/terminus.h>
#include <proton/transport.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#define MAX_CONNS 256
#define MAX_PIDS 16

static const char *url = "127.0.0.1:5672", *address = "bench", *user, *password;
static long long n = 10000, per_sender;
static int size = 100, durable, nsend = 1, nrecv = 1, window = 1000, credit = 1000, timeout_s = 300;
static int pids[MAX_PIDS], npids;

static pn_proactor_t *proactor;
static pn_connection_t *senders[MAX_CONNS], *receivers[MAX_CONNS];
static int receivers_ready, closing, failed;
static long long sent, accepted, rejected, received;
static double t_first, t_last, cpu_first;
static double cpu_client_first, cpu_last = -1, cpu_client_last;
static char *msg_buf;
static size_t msg_len;

typedef struct { int sender; long long sent; } conn_ctx;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double broker_cpu(void) {
    double total = 0;
    long tck = sysconf(_SC_CLK_TCK);
    for (int i = 0; i < npids; i++) {
        char path[64], buf[2048];
        snprintf(path, sizeof path, "/proc/%d/stat", pids[i]);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        size_t k = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[k] = 0;
        char *p = strrchr(buf, ')');
        if (!p) continue;
        unsigned long ut = 0, st = 0;
        /* fields after ')': state(3) ... utime is field 14, stime 15 (1-based) */
        int field = 2;
        for (char *q = p + 1; *q && field < 15; q++) {
            if (*q == ' ') {
                field++;
                if (field == 14) ut = strtoul(q + 1, NULL, 10);
                if (field == 15) st = strtoul(q + 1, NULL, 10);
            }
        }
        total += (double)(ut + st) / tck;
    }
    return total;
}

static double client_cpu(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6;
}

static void encode_message(void) {
    pn_message_t *m = pn_message();
    char *body = malloc(size);
    memset(body, 'x', size);
    pn_message_set_durable(m, durable);
    pn_message_set_address(m, address);
    pn_data_t *b = pn_message_body(m);
    pn_data_put_binary(b, pn_bytes(size, body));
    size_t cap = size + 1024;
    msg_buf = malloc(cap);
    msg_len = cap;
    if (pn_message_encode(m, msg_buf, &msg_len) != 0) { fprintf(stderr, "encode failed\n"); exit(2); }
    pn_message_free(m);
    free(body);
}

static int all_done(void) {
    return received >= n && accepted + rejected >= n;
}

static void finish_if_done(void) {
    if (closing || !all_done()) return;
    t_last = t_last ? t_last : now();
    cpu_last = broker_cpu();
    cpu_client_last = client_cpu();
    closing = 1;
    pn_proactor_cancel_timeout(proactor);      /* a pending timeout keeps the proactor active */
    for (int i = 0; i < nsend; i++) pn_connection_wake(senders[i]);
    for (int i = 0; i < nrecv; i++) pn_connection_wake(receivers[i]);
}

static void send_some(pn_link_t *l, conn_ctx *ctx) {
    if (receivers_ready < nrecv) return;
    while (ctx->sent < per_sender && pn_link_credit(l) > 0 && pn_link_unsettled(l) < window) {
        if (!t_first) { t_first = now(); cpu_first = broker_cpu(); cpu_client_first = client_cpu(); }
        long long tag = ++sent;
        pn_delivery(l, pn_dtag((const char *)&tag, sizeof tag));
        pn_link_send(l, msg_buf, msg_len);
        pn_link_advance(l);
        ctx->sent++;
    }
}

static pn_link_t *first_link(pn_connection_t *c) {
    return pn_link_head(c, 0);
}

static void handle(pn_event_t *e) {
    switch (pn_event_type(e)) {
    case PN_CONNECTION_INIT: {
        pn_connection_t *c = pn_event_connection(e);
        conn_ctx *ctx = pn_connection_get_context(c);
        pn_connection_set_container(c, ctx->sender ? "amqpperf-sender" : "amqpperf-receiver");
        if (user) { pn_connection_set_user(c, user); pn_connection_set_password(c, password ? password : ""); }
        pn_connection_open(c);
        pn_session_t *s = pn_session(c);
        pn_session_open(s);
        pn_link_t *l;
        if (ctx->sender) {
            l = pn_sender(s, "amqpperf-sender");
            pn_terminus_set_address(pn_link_target(l), address);
            pn_link_set_snd_settle_mode(l, PN_SND_UNSETTLED);
        } else {
            l = pn_receiver(s, "amqpperf-receiver");
            pn_terminus_set_address(pn_link_source(l), address);
            pn_link_set_rcv_settle_mode(l, PN_RCV_FIRST);
        }
        pn_link_open(l);
        if (!ctx->sender) pn_link_flow(l, credit);
        break;
    }
    case PN_CONNECTION_BOUND: {
        pn_sasl_t *sasl = pn_sasl(pn_event_transport(e));
        pn_sasl_set_allow_insecure_mechs(sasl, 1);
        if (user) pn_sasl_allowed_mechs(sasl, "PLAIN");
        break;
    }
    case PN_LINK_REMOTE_OPEN: {
        pn_link_t *l = pn_event_link(e);
        if (pn_link_is_receiver(l) && ++receivers_ready == nrecv)
            for (int i = 0; i < nsend; i++) pn_connection_wake(senders[i]);
        break;
    }
    case PN_CONNECTION_WAKE: {
        pn_connection_t *c = pn_event_connection(e);
        conn_ctx *ctx = pn_connection_get_context(c);
        if (closing) { pn_connection_close(c); break; }
        pn_link_t *l = first_link(c);
        if (ctx->sender && l) send_some(l, ctx);
        break;
    }
    case PN_LINK_FLOW: {
        pn_link_t *l = pn_event_link(e);
        if (pn_link_is_sender(l)) send_some(l, pn_connection_get_context(pn_event_connection(e)));
        break;
    }
    case PN_DELIVERY: {
        pn_delivery_t *d = pn_event_delivery(e);
        pn_link_t *l = pn_delivery_link(d);
        if (pn_link_is_sender(l)) {
            uint64_t st = pn_delivery_remote_state(d);
            if (st == PN_ACCEPTED) accepted++;
            else if (st) rejected++;
            else break;
            pn_delivery_settle(d);
            send_some(l, pn_connection_get_context(pn_event_connection(e)));
        } else if (pn_delivery_readable(d) && !pn_delivery_partial(d)) {
            static char sink[1 << 16];
            while (pn_link_recv(l, sink, sizeof sink) > 0) {}
            pn_delivery_update(d, PN_ACCEPTED);
            pn_delivery_settle(d);
            if (++received == n) t_last = now();
            if (pn_link_credit(l) < credit / 2) pn_link_flow(l, credit - pn_link_credit(l));
        }
        finish_if_done();
        break;
    }
    case PN_TRANSPORT_CLOSED: {
        pn_condition_t *cond = pn_transport_condition(pn_event_transport(e));
        if (!closing && pn_condition_is_set(cond)) {
            fprintf(stderr, "amqpperf: %s: %s\n", pn_condition_get_name(cond), pn_condition_get_description(cond));
            failed = 1;
        }
        break;
    }
    case PN_CONNECTION_REMOTE_CLOSE:
        pn_connection_close(pn_event_connection(e));
        break;
    case PN_PROACTOR_TIMEOUT:
        fprintf(stderr, "amqpperf: timed out after %d s: sent %lld accepted %lld received %lld\n",
                timeout_s, sent, accepted, received);
        failed = 1;
        closing = 1;
        for (int i = 0; i < nsend; i++) pn_connection_wake(senders[i]);
        for (int i = 0; i < nrecv; i++) pn_connection_wake(receivers[i]);
        break;
    default:
        break;
    }
}

int main(int argc, char **argv) {
    int opt;
    char *pidlist = NULL;
    while ((opt = getopt(argc, argv, "u:a:n:s:dp:r:w:c:U:P:b:t:")) != -1) {
        switch (opt) {
        case 'u': url = optarg; break;
        case 'a': address = optarg; break;
        case 'n': n = atoll(optarg); break;
        case 's': size = atoi(optarg); break;
        case 'd': durable = 1; break;
        case 'p': nsend = atoi(optarg); break;
        case 'r': nrecv = atoi(optarg); break;
        case 'w': window = atoi(optarg); break;
        case 'c': credit = atoi(optarg); break;
        case 'U': user = optarg; break;
        case 'P': password = optarg; break;
        case 'b': pidlist = optarg; break;
        case 't': timeout_s = atoi(optarg); break;
        default: fprintf(stderr, "usage: see the head of amqpperf.c\n"); return 2;
        }
    }
    if (nsend < 1 || nrecv < 1 || nsend > MAX_CONNS || nrecv > MAX_CONNS || n % nsend) {
        fprintf(stderr, "amqpperf: 1..%d senders and receivers; -n a multiple of the senders\n", MAX_CONNS);
        return 2;
    }
    for (char *p = pidlist ? strtok(pidlist, ",") : NULL; p && npids < MAX_PIDS; p = strtok(NULL, ","))
        pids[npids++] = atoi(p);
    per_sender = n / nsend;
    encode_message();
    proactor = pn_proactor();
    for (int i = 0; i < nrecv; i++) {
        conn_ctx *ctx = calloc(1, sizeof *ctx);
        receivers[i] = pn_connection();
        pn_connection_set_context(receivers[i], ctx);
        pn_proactor_connect2(proactor, receivers[i], NULL, url);
    }
    for (int i = 0; i < nsend; i++) {
        conn_ctx *ctx = calloc(1, sizeof *ctx);
        ctx->sender = 1;
        senders[i] = pn_connection();
        pn_connection_set_context(senders[i], ctx);
        pn_proactor_connect2(proactor, senders[i], NULL, url);
    }
    pn_proactor_set_timeout(proactor, (pn_millis_t)timeout_s * 1000);
    for (int running = 1; running;) {
        pn_event_batch_t *batch = pn_proactor_wait(proactor);
        pn_event_t *e;
        while ((e = pn_event_batch_next(batch))) {
            if (pn_event_type(e) == PN_PROACTOR_INACTIVE) running = 0;
            handle(e);
        }
        pn_proactor_done(proactor, batch);
    }
    double secs = (t_last > t_first && t_first) ? t_last - t_first : 0;
    double bcpu = npids ? (cpu_last >= 0 ? cpu_last : broker_cpu()) - cpu_first : 0;
    double ccpu = (cpu_last >= 0 ? cpu_client_last : client_cpu()) - cpu_client_first;
    int ok = !failed && received == n && accepted == n;
    printf("{\"client\":\"native\",\"n\":%lld,\"size\":%d,\"durable\":%s,\"senders\":%d,\"receivers\":%d,"
           "\"secs\":%.3f,\"msgs_per_s\":%.0f,\"broker_cpu_us_per_msg\":%.2f,\"client_cpu_us_per_msg\":%.2f,"
           "\"sent\":%lld,\"accepted\":%lld,\"rejected\":%lld,\"received\":%lld%s}\n",
           n, size, durable ? "true" : "false", nsend, nrecv, secs, secs ? n / secs : 0.0,
           npids && n ? bcpu / n * 1e6 : 0.0, n ? ccpu / n * 1e6 : 0.0, sent, accepted, rejected, received,
           ok ? "" : ",\"error\":\"not every message was accepted and received\"");
    pn_proactor_free(proactor);
    return ok ? 0 : 1;
}
