/* cmd_bench_kv: `pdserve bench-kv` — how fast the KV transfer engine moves a
 * request's KV, against the link it runs over, measured in the same run.
 * Two transfer engines in this process (producer and consumer, as a prefill
 * and a decode instance would be) exchange one request's KV in opt-125m
 * shapes: one tensor per layer of [2, tokens, heads, head_dim] in --dtype.
 *
 *   tcp, --device cpu:  host memory to host memory; link = loopback TCP.
 *   tcp, --device cuda: device memory to device memory through the host, as
 *       the connector does it on a GPU (backend copy to a malloc'd buffer,
 *       tcp, backend copy back); the backend's copy speeds are measured too.
 *   nccl: GPU 0 to GPU 1 (ncclSend/ncclRecv), when NCCL is compiled in and
 *       two GPUs are visible; otherwise a line says why it did not run. */
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "connector/p2p.h"
#include "model/backend.h"
#ifdef PDSERVE_HAVE_CUDA
#include "model/cuda/cuda_backend.h"
#endif
#include "server/cli.h"
#include "server/commands.h"
#include "server/device_options.h"
#include "server/serve_options.h"

typedef struct bench_kv_opts {
    int layers, heads, head_dim, reps, recv_copy, streams, help;
    const char *tokens, *dtype, *device, *transport;
} bench_kv_opts;

static const cli_option bench_kv_table[] = {
    {"tokens", CLI_STR, offsetof(bench_kv_opts, tokens), "512,2048,8192", 1, 0,
     "prompt lengths to transfer"},
    {"layers", CLI_INT, offsetof(bench_kv_opts, layers), "12", 1, 1000, "layers (opt-125m: 12)"},
    {"heads", CLI_INT, offsetof(bench_kv_opts, heads), "12", 1, 1000,
     "attention heads (opt-125m: 12)"},
    {"head-dim", CLI_INT, offsetof(bench_kv_opts, head_dim), "64", 1, 1024,
     "head dimension (opt-125m: 64)"},
    {"reps", CLI_INT, offsetof(bench_kv_opts, reps), "3", 1, 100, "repetitions (best is reported)"},
    {"dtype", CLI_STR, offsetof(bench_kv_opts, dtype), "float32", 1, 0,
     "KV element type: float32 (CPU backend), float16 or bfloat16 (cuda-fp16/-bf16)"},
    {"device", CLI_STR, offsetof(bench_kv_opts, device), "cpu", 1, 0,
     "where the KV lives for tcp: cpu, or cuda / cuda:N (staged through host memory)"},
    {"transport", CLI_STR, offsetof(bench_kv_opts, transport), "tcp", 1, 0,
     "tcp, nccl or tcp,nccl (nccl: GPU 0 to GPU 1)"},
    {"recv-copy", CLI_BOOL, offsetof(bench_kv_opts, recv_copy), "false", 1, 0,
     "tcp: the consumer copies each received tensor out of ZMQ's frame on its I/O thread, as "
     "recv_into_pinned does (into ordinary memory here): what that copy costs the transfer"},
    {"streams", CLI_INT, offsetof(bench_kv_opts, streams), "1", 1, P2P_MAX_STREAMS,
     "tcp: connections between the two engines, layers spread over them (tcp_streams)"},
    {"help", CLI_BOOL, offsetof(bench_kv_opts, help), "false", 1, 0, "show this help"},
};

/* ---- loopback TCP bandwidth: one connection, 1 MiB writes ----
 * Measured twice: from and into one 1 MiB buffer on each side, which stays
 * in the CPU's caches (the socket's best case), and cycling through
 * LOOP_COLD_REGION on each side, so every byte comes from and goes to memory
 * as a request's KV does (megabytes a layer, freshly gathered). */

enum { LOOP_WRITE = 1 << 20 };
#define LOOP_COLD_REGION ((size_t)256 << 20)

typedef struct sink_job {
    int fd;
    char *buf; /* region bytes, already faulted in */
    size_t total, region;
} sink_job;

static void *sink(void *arg) {
    sink_job *j = arg;
    char *buf = j->buf;
    size_t got = 0, off = 0;
    while (got < j->total) {
        if (off + LOOP_WRITE > j->region) off = 0;
        ssize_t n = recv(j->fd, buf + off, LOOP_WRITE, 0);
        if (n <= 0) break;
        got += (size_t)n;
        off += (size_t)n;
    }
    return NULL;
}

static double loopback_bandwidth(size_t total, size_t region) {
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
    /* Both sides' pages are faulted in before the clock starts. */
    char *buf = malloc(region), *sink_buf = malloc(region);
    if (!buf || !sink_buf || ss < 0) {
        free(buf);
        free(sink_buf);
        if (ss >= 0) close(ss);
        close(cs);
        close(ls);
        return 0;
    }
    memset(buf, 1, region);
    memset(sink_buf, 0, region);
    sink_job j = {ss, sink_buf, total, region};
    pthread_t th;
    pthread_create(&th, NULL, sink, &j);
    double t0 = pd_now();
    size_t sent = 0, off = 0;
    while (sent < total) {
        if (off + LOOP_WRITE > region) off = 0;
        ssize_t n = send(cs, buf + off, LOOP_WRITE, 0);
        if (n <= 0) break;
        sent += (size_t)n;
        off += (size_t)n;
    }
    pthread_join(th, NULL);
    double dt = pd_now() - t0;
    free(buf);
    free(sink_buf);
    close(cs);
    close(ss);
    close(ls);
    return (double)sent / dt;
}

/* ---- one request's KV through the transfer engine ---- */

typedef struct bench_run {
    const bench_kv_opts *o;
    p2p_transport transport;
    pd_backend *be; /* tcp with --device cuda: KV in device memory on both sides */
    size_t elem;
    const char *dtype;
} bench_run;

/* --recv-copy: where the consumer copies received tensors to. */
static void *recv_copy_alloc(void *ctx, size_t nbytes) {
    (void)ctx;
    return malloc(nbytes ? nbytes : 1);
}
static void recv_copy_free(void *ctx, void *p) {
    (void)ctx;
    free(p);
}

/* Producer-side buffer for one layer, in the memory the send type hands over:
 * the engine owns what it sends in the background (malloc'd for tcp, device
 * memory from p2p_buffer_alloc for nccl). */
static void *layer_buffer(p2p_engine *prod, const bench_run *br, const void *src, size_t nbytes,
                          pd_err *err) {
    void *p = p2p_buffer_alloc(prod, nbytes, err);
    if (!p) return NULL;
    if (br->transport == P2P_NCCL) return p; /* contents do not matter for timing */
    if (br->be) {
        if (br->be->copy_d2h(br->be, p, src, nbytes, err) != 0) {
            p2p_buffer_free(prod, p);
            return NULL;
        }
    } else {
        memcpy(p, src, nbytes);
    }
    return p;
}

static int transfer_once(p2p_engine *prod, p2p_engine *cons, p2p_send_type st, const bench_run *br,
                         int tokens, int rep, const void *src, void *dst, double *seconds,
                         pd_err *err) {
    const bench_kv_opts *o = br->o;
    const int64_t shape[4] = {2, tokens, o->heads, o->head_dim};
    const size_t nbytes = 2 * (size_t)tokens * o->heads * o->head_dim * br->elem;
    char ids[1000][64];
    int L = o->layers > 1000 ? 1000 : o->layers;
    double t0 = pd_now(), deadline = t0 + 120;
    int rc = 0;
    /* PUT only borrows its data for the call: host KV goes as it is, nccl
     * sends one device buffer again and again; device KV over tcp is copied
     * to a fresh host buffer per layer, as the connector does. */
    void *put_dev = NULL;
    if (st == P2P_PUT && br->transport == P2P_NCCL &&
        !(put_dev = p2p_buffer_alloc(prod, nbytes, err)))
        return -1;
    for (int l = 0; l < L && rc == 0; l++) {
        snprintf(ids[l], sizeof ids[l], "bench-%d-%d-%d-%d#%d", (int)st, tokens, rep, (int)getpid(),
                 l);
        if (st == P2P_PUT && !br->be) {
            rc = p2p_put(prod, p2p_address(cons), ids[l], br->dtype, 4, shape,
                         put_dev ? put_dev : src, nbytes, deadline, err);
            continue;
        }
        void *data = layer_buffer(prod, br, src, nbytes, err);
        if (!data) {
            rc = -1;
            break;
        }
        if (st == P2P_PUT) {
            rc = p2p_put(prod, p2p_address(cons), ids[l], br->dtype, 4, shape, data, nbytes,
                         deadline, err);
            p2p_buffer_free(prod, data);
            continue;
        }
        if (st == P2P_PUT_ASYNC) {
            rc = p2p_put_async(prod, p2p_address(cons), ids[l], br->dtype, 4, shape, data, nbytes,
                               deadline, err);
        } else {
            rc = p2p_offer(prod, ids[l], br->dtype, 4, shape, data, nbytes, deadline, err);
            if (rc == 0) rc = p2p_fetch(cons, p2p_address(prod), ids[l], deadline, err);
        }
        if (rc == 0) p2p_forget_send(prod, ids[l]);
    }
    if (put_dev) p2p_buffer_free(prod, put_dev);
    /* The consumer side: wait until every layer is here (as the decode's engine
     * loop polls), then put it where the decode's cache is. */
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
        if (got < 0) {
            rc = -1;
            break;
        }
        if (br->be && !t->on_device) rc = br->be->copy_h2d(br->be, dst, t->data, t->nbytes, err);
        p2p_tensor_free(cons, t);
    }
    *seconds = pd_now() - t0;
    return rc;
}

/* Backend copy speed between pageable host memory (what the connector uses)
 * and device memory, best of reps. */
static int staging_bandwidth(pd_backend *be, size_t bytes, int reps, double *d2h, double *h2d,
                             pd_err *err) {
    void *dev = be->alloc(be, bytes, err);
    char *host = dev ? malloc(bytes) : NULL;
    int rc = dev && host ? 0 : -1;
    if (dev && !host) pd_fail(err, "out of memory");
    if (host) memset(host, 1, bytes); /* fault the pages in before timing */
    *d2h = *h2d = 0;
    for (int r = 0; r < reps + 1 && rc == 0; r++) { /* the first round warms up */
        double t0 = pd_now();
        rc = be->copy_d2h(be, host, dev, bytes, err);
        double t1 = pd_now();
        if (rc == 0) rc = be->copy_h2d(be, dev, host, bytes, err);
        if (rc == 0) rc = be->sync(be, err);
        double t2 = pd_now();
        if (r > 0 && bytes / (t1 - t0) > *d2h) *d2h = bytes / (t1 - t0);
        if (r > 0 && bytes / (t2 - t1) > *h2d) *h2d = bytes / (t2 - t1);
    }
    free(host);
    be->free(be, dev);
    return rc;
}

/* The consumer has every layer once p2p_take returned it; the producer may
 * still wait for the last acks. Let them arrive (bounded, untimed) so the
 * next repetition starts idle and shutting down fails no send that made it. */
static void wait_sends_settled(p2p_engine *prod) {
    for (double until = pd_now() + 5; pd_now() < until; usleep(1000)) {
        p2p_stats ps;
        p2p_stats_get(prod, &ps);
        if (ps.offered_bytes == 0) return;
    }
}

static const char *send_type_names[] = {"PUT", "PUT_ASYNC", "GET"};

/* All send types for one length on one transport; prints a table row each.
 * link[0], link[1]: loopback TCP cache-hot and cache-cold (0: not measured). */
static int bench_length(const bench_run *br, int tokens, const double link[2], pd_err *err) {
    const bench_kv_opts *o = br->o;
    const size_t nbytes = 2 * (size_t)tokens * o->heads * o->head_dim * br->elem;
    const size_t total = nbytes * (size_t)o->layers;
    void *src = NULL, *dst = NULL;
    char *host_src = NULL;
    int rc = 0;
    if (br->be) { /* the prefill's gathered layer and the decode's staging buffer */
        src = br->be->alloc(br->be, nbytes, err);
        dst = src ? br->be->alloc(br->be, nbytes, err) : NULL;
        if (!dst) rc = -1;
    } else if (br->transport == P2P_TCP) {
        host_src = malloc(nbytes ? nbytes : 1);
        if (!host_src)
            rc = pd_fail(err, "out of memory");
        else
            memset(host_src, 0x3c, nbytes);
        src = host_src;
    }
    const char *where = br->transport == P2P_NCCL ? "GPU 0 -> GPU 1"
                        : br->be                  ? "device -> host -> device"
                                                  : "host -> host";
    for (int st = 0; st < 3 && rc == 0; st++) {
        p2p_config pc = {.kv_ip = "127.0.0.1",
                         .kv_buffer_size = (double)total * 2 + 1e6,
                         .send_type = st,
                         .transport = br->transport,
                         .timeout_s = 120,
                         .fingerprint = "bench-kv",
                         .nccl_device = 0,
                         .tcp_streams = br->o->streams};
        p2p_engine *prod = NULL, *cons = NULL;
        if (p2p_create(&pc, &prod, err) != 0) {
            rc = -1;
        } else {
            pc.nccl_device = br->transport == P2P_NCCL ? 1 : 0;
            if (br->o->recv_copy && br->transport == P2P_TCP) {
                pc.host_alloc = pc.recv_alloc = recv_copy_alloc;
                pc.host_free = recv_copy_free;
            }
            if (p2p_create(&pc, &cons, err) != 0) rc = -1;
        }
        double best = 1e30;
        for (int r = 0; r < o->reps && rc == 0; r++) {
            double sec;
            if (transfer_once(prod, cons, (p2p_send_type)st, br, tokens, r, src, dst, &sec, err) !=
                0) {
                rc = -1;
                break;
            }
            if (sec < best) best = sec;
            wait_sends_settled(prod);
        }
        if (rc == 0) {
            char of_link[2][32] = {"-", "-"};
            for (int k = 0; k < 2; k++)
                if (link[k] > 0)
                    snprintf(of_link[k], sizeof of_link[k], "%.0f%%", 100 * total / best / link[k]);
            printf("| %d | %s | %s | %s | %.1f | %.2f | %.2f | %s | %s |\n", tokens,
                   br->transport == P2P_NCCL ? "nccl" : "tcp", where, send_type_names[st],
                   total / 1e6, best * 1e3, total / best / 1e9, of_link[0], of_link[1]);
            fflush(stdout);
        }
        p2p_destroy(cons);
        p2p_destroy(prod);
    }
    if (br->be) {
        br->be->free(br->be, src);
        br->be->free(br->be, dst);
    }
    free(host_src);
    return rc;
}

/* Why the nccl transport cannot run here, or NULL when it can. */
static const char *nccl_unavailable(void) {
#ifndef PDSERVE_HAVE_NCCL
    return "not run (pdserve built without NCCL)";
#elif !defined(PDSERVE_HAVE_CUDA)
    return "not run (pdserve built without the CUDA backend, which counts the GPUs)";
#else
    int n = pd_cuda_device_count();
    if (n == 0) return "not run (no GPU)";
    if (n == 1) return "not run (one GPU)";
    return NULL;
#endif
}

int cmd_bench_kv(int argc, char **argv) {
    bench_kv_opts o;
    char *pos[1];
    int n_pos;
    pd_err err = {{0}};
    int n_table = (int)(sizeof bench_kv_table / sizeof bench_kv_table[0]);
    if (cli_parse(bench_kv_table, n_table, &o, argc, argv, pos, 1, &n_pos, NULL, &err) != 0 ||
        n_pos) {
        fprintf(stderr, "pdserve bench-kv: %s\n",
                n_pos ? "takes no positional arguments" : err.msg);
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
    size_t elem;
    if (!strcmp(o.dtype, "float32"))
        elem = 4;
    else if (!strcmp(o.dtype, "float16") || !strcmp(o.dtype, "bfloat16"))
        elem = 2;
    else {
        fprintf(stderr,
                "pdserve bench-kv: --dtype: expected float32, float16 or bfloat16, got '%s'\n",
                o.dtype);
        return 2;
    }
    int want_tcp = 0, want_nccl = 0;
    if (!strcmp(o.transport, "tcp"))
        want_tcp = 1;
    else if (!strcmp(o.transport, "nccl"))
        want_nccl = 1;
    else if (!strcmp(o.transport, "tcp,nccl") || !strcmp(o.transport, "nccl,tcp"))
        want_tcp = want_nccl = 1;
    else {
        fprintf(stderr, "pdserve bench-kv: --transport: expected tcp, nccl or tcp,nccl, got '%s'\n",
                o.transport);
        return 2;
    }
    char backend[48];
    char dev[24];
    if (device_flags_check(o.device, "float32", dev, sizeof dev, &err) != 0 ||
        device_backend_name(dev, PD_F32, backend, sizeof backend, &err) != 0) {
        fprintf(stderr, "pdserve bench-kv: %s\n", err.msg);
        return 2;
    }
    pd_backend *be = NULL;
    if (strcmp(backend, "cpu") != 0 && want_tcp && pd_backend_create(backend, 1, &be, &err) != 0) {
        fprintf(stderr, "pdserve bench-kv: --device %s: %s\n", o.device, err.msg);
        return 1;
    }
    printf("KV of one request: %d layers x [2, tokens, %d, %d] %s; best of %d%s", o.layers, o.heads,
           o.head_dim, o.dtype, o.reps,
           o.recv_copy ? "; the consumer copies each tensor out of ZMQ's frame (--recv-copy)" : "");
    if (o.streams > 1) printf("; tcp over %d connections (--streams)", o.streams);
    printf("\n");
    double loop[2] = {0, 0}; /* cache-hot, cache-cold */
    if (want_tcp) {
        for (int r = 0; r < 3; r++) {
            double hot = loopback_bandwidth((size_t)1 << 31, LOOP_WRITE);
            double cold = loopback_bandwidth((size_t)1 << 31, LOOP_COLD_REGION);
            if (hot > loop[0]) loop[0] = hot;
            if (cold > loop[1]) loop[1] = cold;
        }
        printf("link, tcp: loopback TCP (one connection, 1 MiB writes, best of 3 x 2 GiB): %.2f "
               "GB/s from and into one 1 MiB buffer (cache-hot); %.2f GB/s cycling through "
               "256 MiB on each side (cache-cold, as KV is)\n",
               loop[0] / 1e9, loop[1] / 1e9);
    }
    int rc = 0;
    if (be) {
        double d2h, h2d;
        if (staging_bandwidth(be, (size_t)256 << 20, 3, &d2h, &h2d, &err) != 0)
            rc = 1;
        else
            printf("staging on %s: backend copies with pageable host memory (as the connector), "
                   "best of 3 x 256 MiB: device->host %.2f GB/s, host->device %.2f GB/s\n",
                   backend, d2h / 1e9, h2d / 1e9);
    }
    const char *no_nccl = want_nccl ? nccl_unavailable() : NULL;
    if (no_nccl) printf("nccl: %s\n", no_nccl);
    printf("\n| tokens | transport | path | send_type | MB | best ms | GB/s ");
    printf("| of loopback (hot) | of loopback (cold) |\n");
    printf("|---|---|---|---|---|---|---|---|---|\n");
    const double no_link[2] = {0, 0}; /* nccl's link is measured by scripts/gpu-link-bw.py */
    bench_run tcp = {&o, P2P_TCP, be, elem, o.dtype}, nccl = {&o, P2P_NCCL, NULL, elem, o.dtype};
    for (int i = 0; i < n_lens && rc == 0; i++) {
        if (want_tcp && bench_length(&tcp, lens[i], loop, &err) != 0) rc = 1;
        if (rc == 0 && want_nccl && !no_nccl && bench_length(&nccl, lens[i], no_link, &err) != 0)
            rc = 1;
    }
    pd_backend_destroy(be);
    if (rc) fprintf(stderr, "pdserve bench-kv: %s\n", err.msg);
    return rc;
}
