/* cmd_bench_kv: `pdserve bench-kv` — how fast the KV transfer engine moves a
 * request's KV over the tcp data plane, against the loopback TCP bandwidth
 * measured in the same run. Two transfer engines in this process (producer
 * and consumer, as a prefill and a decode instance would be) exchange one
 * request's KV in opt-125m shapes: one tensor per layer of
 * [2, tokens, heads, head_dim] fp32 (the CPU backend's KV dtype). */
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "connector/p2p.h"
#include "server/cli.h"
#include "server/commands.h"

typedef struct bench_kv_opts {
    int layers, heads, head_dim, reps, help;
    const char *tokens;
} bench_kv_opts;

static const cli_option bench_kv_table[] = {
    {"tokens", CLI_STR, offsetof(bench_kv_opts, tokens), "512,2048,8192", 1, 0, "prompt lengths to transfer"},
    {"layers", CLI_INT, offsetof(bench_kv_opts, layers), "12", 1, 1000, "layers (opt-125m: 12)"},
    {"heads", CLI_INT, offsetof(bench_kv_opts, heads), "12", 1, 1000, "attention heads (opt-125m: 12)"},
    {"head-dim", CLI_INT, offsetof(bench_kv_opts, head_dim), "64", 1, 1024, "head dimension (opt-125m: 64)"},
    {"reps", CLI_INT, offsetof(bench_kv_opts, reps), "3", 1, 100, "repetitions (best is reported)"},
    {"help", CLI_BOOL, offsetof(bench_kv_opts, help), "false", 1, 0, "show this help"},
};

/* ---- loopback TCP bandwidth: one connection, 1 MiB writes ---- */

typedef struct sink_job {
    int fd;
    size_t total;
} sink_job;

static void *sink(void *arg) {
    sink_job *j = arg;
    char *buf = malloc(1 << 20);
    size_t got = 0;
    while (buf && got < j->total) {
        ssize_t n = recv(j->fd, buf, 1 << 20, 0);
        if (n <= 0) break;
        got += (size_t)n;
    }
    free(buf);
    return NULL;
}

static double loopback_bandwidth(size_t total) {
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof a;
    if (ls < 0 || bind(ls, (struct sockaddr *)&a, sizeof a) != 0 || listen(ls, 1) != 0 ||
        getsockname(ls, (struct sockaddr *)&a, &al) != 0) {
        if (ls >= 0) close(ls);
        return 0;
    }
    int cs = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(cs, (struct sockaddr *)&a, sizeof a) != 0) {
        close(cs);
        close(ls);
        return 0;
    }
    int ss = accept(ls, NULL, NULL);
    sink_job j = {ss, total};
    pthread_t th;
    pthread_create(&th, NULL, sink, &j);
    char *buf = calloc(1, 1 << 20);
    double t0 = pd_now();
    size_t sent = 0;
    while (buf && sent < total) {
        ssize_t n = send(cs, buf, 1 << 20, 0);
        if (n <= 0) break;
        sent += (size_t)n;
    }
    pthread_join(th, NULL);
    double dt = pd_now() - t0;
    free(buf);
    close(cs);
    close(ss);
    close(ls);
    return (double)sent / dt;
}

/* ---- one request's KV through the transfer engine ---- */

static int transfer_once(p2p_engine *prod, p2p_engine *cons, p2p_send_type st, const bench_kv_opts *o, int tokens,
                         int rep, double *seconds, pd_err *err) {
    const int64_t shape[4] = {2, tokens, o->heads, o->head_dim};
    const size_t nbytes = 2 * (size_t)tokens * o->heads * o->head_dim * sizeof(float);
    char ids[1000][64];
    int L = o->layers > 1000 ? 1000 : o->layers;
    void *layer = malloc(nbytes);
    if (!layer) return pd_fail(err, "out of memory");
    memset(layer, 0x3c, nbytes);
    double t0 = pd_now(), deadline = t0 + 120;
    int rc = 0;
    for (int l = 0; l < L && rc == 0; l++) {
        snprintf(ids[l], sizeof ids[l], "bench-%d-%d-%d-%d#%d", (int)st, tokens, rep, (int)getpid(), l);
        if (st == P2P_PUT) {
            rc = p2p_put(prod, p2p_address(cons), ids[l], "float32", 4, shape, layer, nbytes, deadline, err);
            continue;
        }
        void *copy = malloc(nbytes); /* the engine owns what it sends in the background */
        if (!copy) {
            rc = pd_fail(err, "out of memory");
            break;
        }
        memcpy(copy, layer, nbytes);
        if (st == P2P_PUT_ASYNC) {
            rc = p2p_put_async(prod, p2p_address(cons), ids[l], "float32", 4, shape, copy, nbytes, deadline, err);
        } else {
            rc = p2p_offer(prod, ids[l], "float32", 4, shape, copy, nbytes, deadline, err);
            if (rc == 0) rc = p2p_fetch(cons, p2p_address(prod), ids[l], deadline, err);
        }
        if (rc == 0) p2p_forget_send(prod, ids[l]);
    }
    /* The consumer side: wait until every layer is here (as the decode's engine loop polls). */
    for (int l = 0; l < L && rc == 0; l++) {
        p2p_tensor *t = NULL;
        int got;
        while ((got = p2p_take(cons, ids[l], &t, err)) == 0) {
            if (pd_now() > deadline) {
                got = pd_fail(err, "timed out");
                break;
            }
            usleep(50);
        }
        if (got < 0) rc = -1;
        else p2p_tensor_free(cons, t);
    }
    *seconds = pd_now() - t0;
    free(layer);
    return rc;
}

int cmd_bench_kv(int argc, char **argv) {
    bench_kv_opts o;
    char *pos[1];
    int n_pos;
    pd_err err = {{0}};
    int n_table = (int)(sizeof bench_kv_table / sizeof bench_kv_table[0]);
    if (cli_parse(bench_kv_table, n_table, &o, argc, argv, pos, 1, &n_pos, NULL, &err) != 0 || n_pos) {
        fprintf(stderr, "pdserve bench-kv: %s\n", n_pos ? "takes no positional arguments" : err.msg);
        return 2;
    }
    if (o.help) {
        cli_print_help("pdserve bench-kv [options]", bench_kv_table, n_table);
        return 0;
    }
    int lens[16], n_lens = 0;
    for (const char *p = o.tokens; *p && n_lens < 16;) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 1 || v > (1 << 20)) {
            fprintf(stderr, "pdserve bench-kv: --tokens: bad length list '%s'\n", o.tokens);
            return 2;
        }
        lens[n_lens++] = (int)v;
        p = *end == ',' ? end + 1 : end;
    }
    double loop = 0;
    for (int r = 0; r < 3; r++) {
        double b = loopback_bandwidth((size_t)1 << 31);
        if (b > loop) loop = b;
    }
    printf("loopback TCP (one connection, 1 MiB writes, best of 3 x 2 GiB): %.2f GB/s\n", loop / 1e9);
    printf("%-8s %-10s %12s %12s %12s %10s\n", "tokens", "send_type", "bytes", "best_ms", "GB/s", "of_loopback");
    int rc = 0;
    static const char *names[] = {"PUT", "PUT_ASYNC", "GET"};
    for (int i = 0; i < n_lens && rc == 0; i++) {
        size_t total = 2 * (size_t)lens[i] * o.heads * o.head_dim * sizeof(float) * o.layers;
        for (int st = 0; st < 3 && rc == 0; st++) {
            p2p_config pc = {.kv_ip = "127.0.0.1", .kv_buffer_size = (double)total * 2 + 1e6, .send_type = st,
                             .transport = P2P_TCP, .timeout_s = 120, .fingerprint = "bench-kv"};
            p2p_engine *prod = NULL, *cons = NULL;
            if (p2p_create(&pc, &prod, &err) != 0 || p2p_create(&pc, &cons, &err) != 0) {
                rc = 1;
            } else {
                double best = 1e30;
                for (int r = 0; r < o.reps && rc == 0; r++) {
                    double s;
                    if (transfer_once(prod, cons, (p2p_send_type)st, &o, lens[i], r, &s, &err) != 0) rc = 1;
                    else if (s < best) best = s;
                }
                if (rc == 0)
                    printf("%-8d %-10s %12zu %12.2f %12.2f %9.0f%%\n", lens[i], names[st], total, best * 1e3,
                           total / best / 1e9, 100 * total / best / loop);
            }
            p2p_destroy(cons);
            p2p_destroy(prod);
        }
    }
    if (rc) fprintf(stderr, "pdserve bench-kv: %s\n", err.msg);
    return rc;
}
