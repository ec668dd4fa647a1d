/* test_p2p_nccl: the KV transfer engine over the nccl transport, GPU 0 to
 * GPU 1, two engines in this process. With one GPU, NCCL refuses two ranks
 * on it, unless they seem to be on two hosts: then the test runs the
 * transfers between this process and a child of it, each given its own
 * NCCL_HOSTID, and NCCL joins them through its socket transport (loopback).
 * Without a GPU (or NCCL compiled in) it prints why it skipped and passes.
 * Labelled "gpu" in ctest, so CPU CI can exclude it with -LE gpu. */
#include "connector/p2p.h"
#include "tests/common/testlib.h"

#include <stdio.h>

#ifndef PDSERVE_HAVE_NCCL
int main(void) {
    printf("NCCL not compiled in: skipped\n");
    return 0;
}
#else
#include <cuda_runtime.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "connector/p2p_nccl.h"
#include "model/backend.h"
#include "tests/connector/p2p_test_util.h"

#define MB (1024u * 1024u)

/* A stand-in for the model's backend: only what the transfer engine uses
 * (recording its ready events on a stream of ours, where the test queues
 * the late writes of a buffer). */
typedef struct {
    pd_backend be;
    cudaStream_t stream;
} slow_writer;

static int writer_record(pd_backend *be, void *ev, pd_err *err) {
    cudaError_t rc = cudaEventRecord((cudaEvent_t)ev, ((slow_writer *)be)->stream);
    return rc == cudaSuccess ? 0 : pd_fail(err, "%s", cudaGetErrorString(rc));
}

static int writer_sync(pd_backend *be, pd_err *err) {
    cudaError_t rc = cudaStreamSynchronize(((slow_writer *)be)->stream);
    return rc == cudaSuccess ? 0 : pd_fail(err, "%s", cudaGetErrorString(rc));
}

static void CUDART_CB sleep_300ms(void *arg) {
    (void)arg;
    usleep(300 * 1000);
}

static void writer_init(slow_writer *w, int device) {
    memset(w, 0, sizeof *w);
    cudaSetDevice(device);
    cudaStreamCreateWithFlags(&w->stream, cudaStreamNonBlocking);
    w->be.name = "test writer";
    w->be.device = device;
    w->be.event_record = writer_record;
    w->be.sync = writer_sync;
}

/* Queues, on w's stream, a memset of d to byte that happens 300 ms from now. */
static void write_late(slow_writer *w, void *d, int byte, size_t n) {
    cudaLaunchHostFunc(w->stream, sleep_300ms, NULL);
    cudaMemsetAsync(d, byte, n, w->stream);
}

static bool all_bytes(const void *d, int byte, size_t n) {
    uint8_t *h = malloc(n);
    bool ok = h && cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost) == cudaSuccess;
    for (size_t i = 0; ok && i < n; i++)
        ok = h[i] == (uint8_t)byte;
    free(h);
    return ok;
}

static p2p_engine *mk_with(int device, double budget, double timeout, pd_backend *be) {
    p2p_config cfg = {.kv_ip = "127.0.0.1",
                      .kv_buffer_size = budget,
                      .send_type = P2P_PUT_ASYNC,
                      .transport = P2P_NCCL,
                      .timeout_s = timeout,
                      .fingerprint = "nccl test",
                      .nccl_device = device,
                      .backend = be};
    p2p_engine *e = NULL;
    pd_err err;
    if (p2p_create(&cfg, &e, &err) != 0)
        fprintf(stderr, "p2p_create on GPU %d: %s\n", device, err.msg);
    return e;
}

static p2p_engine *mk(int device, double budget, double timeout) {
    return mk_with(device, budget, timeout, NULL);
}

/* Device memory d (n > 0 bytes) gets id's pattern. */
static bool fill_device(const char *id, void *d, size_t n) {
    uint8_t *h = malloc(n);
    if (!h) return false;
    fill(id, h, n);
    bool ok = cudaMemcpy(d, h, n, cudaMemcpyHostToDevice) == cudaSuccess;
    free(h);
    return ok;
}

/* Whether device memory d (n > 0 bytes) holds id's pattern. */
static bool dev_holds(const void *d, const char *id, size_t n) {
    uint8_t *got = malloc(n), *want = malloc(n);
    bool ok = got && want && cudaMemcpy(got, d, n, cudaMemcpyDeviceToHost) == cudaSuccess;
    if (ok) fill(id, want, n), ok = !memcmp(got, want, n);
    free(got);
    free(want);
    return ok;
}

/* A device buffer on e's GPU holding id's pattern. */
static void *dev_data(p2p_engine *e, const char *id, size_t n) {
    pd_err err;
    void *d = p2p_buffer_alloc(e, n, &err);
    if (d && n) fill_device(id, d, n);
    return d;
}

static bool holds(const p2p_tensor *t, const char *id, size_t n) {
    if (!t || t->nbytes != n || strcmp(t->id, id) || (n && (!t->data || !t->on_device)))
        return false;
    return n == 0 || dev_holds(t->data, id, n);
}

/* Device buffers come from the engine's pool and go back to it: sizes
 * from 1 byte to 16 MiB, allocated and freed many times over, each one
 * holding what was written to it. */
static void pool_reuse(void) {
    p2p_engine *P = mk(0, 64 * MB, 1);
    CHECK(P != NULL);
    if (!P) return;
    int bad = 0, reused = 0;
    void *last[4] = {0};
    const size_t sizes[4] = {1, 4096, 1 * MB + 7, 16 * MB};
    for (int round = 0; round < 50; round++)
        for (int k = 0; k < 4; k++) {
            char id[32];
            snprintf(id, sizeof id, "pool%d.%d", round, k);
            void *d = dev_data(P, id, sizes[k]);
            if (!d) {
                bad++;
                continue;
            }
            reused += d == last[k];
            last[k] = d;
            p2p_tensor t = {.nbytes = sizes[k], .data = d, .on_device = true};
            snprintf(t.id, sizeof t.id, "%s", id);
            snprintf(t.dtype, sizeof t.dtype, "uint8");
            bad += !holds(&t, id, sizes[k]);
            p2p_buffer_free(P, d);
        }
    CHECKF(bad == 0, "%d of 200 pooled buffers missing or wrong", bad);
    printf("pool: the same address again in %d of 196 allocations\n", reused);
    p2p_destroy(P);
}

/* A buffer handed over while the caller's queued work still writes it:
 * when the hand-over fails at once (a bad tensor), the engine frees the
 * buffer, but only after that work (the event it records on the backend),
 * so a buffer allocated next, maybe the same memory, is not overwritten by
 * the late write. */
static void free_waits_for_writer(void) {
    slow_writer w;
    writer_init(&w, 0);
    p2p_engine *P = mk_with(0, 64 * MB, 1, &w.be);
    CHECK(P != NULL);
    if (!P) return;
    pd_err err;
    const size_t n = 4 * MB;
    int64_t shape[1] = {(int64_t)n};
    void *a = p2p_buffer_alloc(P, n, &err);
    CHECK(a != NULL);
    write_late(&w, a, 0xAB, n);
    CHECK(p2p_put_async(P, "127.0.0.1:1", "bad", "", 1, shape, a, n, 0, &err) != 0 &&
          strstr(err.msg, "dtype"));
    void *b = p2p_buffer_alloc(P, n, &err);
    CHECK(b != NULL);
    if (b) cudaMemset(b, 0x11, n);
    cudaStreamSynchronize(w.stream);
    CHECKF(b && all_bytes(b, 0x11, n),
           "a buffer allocated after a failed hand-over was overwritten by the late write "
           "(same memory: %s)",
           a == b ? "yes" : "no");
    printf("free after the writer: the next buffer %s the same memory\n", a == b ? "is" : "is not");
    p2p_buffer_free(P, b);
    p2p_destroy(P);
    cudaStreamDestroy(w.stream);
}

/* Two GPUs: a send waits on the GPU for the caller's queued writes of its
 * buffer (the event recorded at p2p_put_async / p2p_offer), so the
 * receiver gets the written bytes, not what was there at the call. */
static void send_waits_for_writer(p2p_engine *D) {
    slow_writer w;
    writer_init(&w, 0);
    p2p_engine *P = mk_with(0, 2e9, 20, &w.be);
    CHECK(P != NULL);
    if (!P) return;
    pd_err err;
    const size_t n = 8 * MB;
    int64_t shape[1] = {(int64_t)n};
    for (int mode = 1; mode < 3; mode++) {
        char id[32];
        snprintf(id, sizeof id, "late%d", mode);
        void *d = p2p_buffer_alloc(P, n, &err);
        CHECK(d != NULL);
        if (!d) break;
        cudaMemset(d, 0x22, n);
        write_late(&w, d, 0x40 + mode, n);
        double t0 = pd_now();
        int rc = mode == 1 ? p2p_put_async(P, p2p_address(D), id, "uint8", 1, shape, d, n, 0, &err)
                           : p2p_offer(P, id, "uint8", 1, shape, d, n, 0, &err);
        if (rc == 0 && mode == 2) rc = p2p_fetch(D, p2p_address(P), id, 0, &err);
        CHECKF(rc == 0 && pd_now() - t0 < 0.2, "mode %d: %s (the call took %.2f s)", mode,
               rc ? err.msg : "ok", pd_now() - t0);
        p2p_tensor *t = NULL;
        rc = take_wait(D, id, 20, &t, &err);
        CHECKF(rc == 1 && t && t->nbytes == n && all_bytes(t->data, 0x40 + mode, n),
               "mode %d: the receiver did not get the late write (take %d)", mode, rc);
        p2p_tensor_free(D, t);
    }
    p2p_destroy(P);
    cudaStreamDestroy(w.stream);
}

/* One GPU: what can be checked without a partner — a consumer that never joins the
 * communicator fails the PUT by its deadline (non-blocking init, then abort), nothing hangs. */
static void single_gpu(void) {
    p2p_engine *P = mk(0, 1e9, 1), *X = mk(0, 1e6, 1);
    CHECK(P && X);
    if (!P || !X) return;
    char dead[64];
    snprintf(dead, sizeof dead, "%s", p2p_address(X));
    p2p_destroy(X);
    pd_err err;
    int64_t s1[1] = {4096};
    void *d = dev_data(P, "dead", 4096);
    CHECK(d != NULL);
    double t0 = pd_now();
    int rc = p2p_put(P, dead, "dead", "uint8", 1, s1, d, 4096, pd_now() + 0.5, &err);
    double dt = pd_now() - t0;
    CHECKF(rc != 0 && dt < 2, "put to a dead peer: rc %d after %.2f s: %s", rc, dt,
           rc ? err.msg : "");
    CHECK(p2p_put_async(P, dead, "dead2", "uint8", 1, s1, dev_data(P, "dead2", 4096), 4096,
                        pd_now() + 0.5, &err) == 0);
    CHECK(status_wait(P, "dead2", 3, &err) == -1);
    p2p_buffer_free(P, d);
    t0 = pd_now();
    p2p_destroy(P);
    CHECKF(pd_now() - t0 < 3, "destroy took %.2f s", pd_now() - t0);
}

/* ---- one GPU, two processes ---- */

/* What the producer sends and the consumer checks, in this order: each way
 * of sending at four sizes, 24 layers in flight at once, two buffers whose
 * bytes are written by work queued after the call (late != 0: every byte
 * must be late), and five the consumer drops mid-transfer (three pushed,
 * two pulled), each followed by one that must still arrive. */
typedef struct {
    char id[32];
    size_t nbytes;
    int mode; /* 0 p2p_put, 1 p2p_put_async, 2 p2p_offer + p2p_fetch */
    int late;
    bool drop; /* the consumer drops it once it has room reserved for it */
} planned_tensor;

static int make_plan(planned_tensor *p) {
    const size_t sizes[] = {1, 4096, 1 * MB + 3, 64 * MB};
    int n = 0;
    for (int mode = 0; mode < 3; mode++)
        for (int k = 0; k < 4; k++, n++) {
            p[n] = (planned_tensor){.nbytes = sizes[k], .mode = mode};
            snprintf(p[n].id, sizeof p[n].id, "m%d-%zu", mode, sizes[k]);
        }
    for (int l = 0; l < 24; l++, n++) {
        p[n] = (planned_tensor){.nbytes = 100000 + (size_t)l * 997, .mode = 1};
        snprintf(p[n].id, sizeof p[n].id, "req#%d", l);
    }
    for (int mode = 1; mode < 3; mode++, n++) {
        p[n] = (planned_tensor){.nbytes = 8 * MB, .mode = mode, .late = 0x40 + mode};
        snprintf(p[n].id, sizeof p[n].id, "late%d", mode);
    }
    /* Dropped while its bytes are on their way (a client gone mid-transfer):
     * the pair's communicator must survive it, so the tensors after it
     * still arrive. */
    for (int k = 0; k < 5; k++, n += 2) { /* three pushed (PUT_ASYNC), two pulled (GET) */
        p[n] = (planned_tensor){
            .nbytes = 8 * MB, .mode = k < 3 ? 1 : 2, .late = 0x50 + k, .drop = true};
        snprintf(p[n].id, sizeof p[n].id, "dropped%d", k);
        p[n + 1] = (planned_tensor){.nbytes = 1 * MB, .mode = 1};
        snprintf(p[n + 1].id, sizeof p[n + 1].id, "after%d", k);
    }
    return n;
}

#define PLAN_MAX 64

/* One line from fd, waiting at most 120 s in all (a hung peer process
 * must not hang the test). */
static bool read_line_within(int fd, char *buf, size_t cap, double seconds) {
    size_t n = 0;
    double end = pd_now() + seconds;
    while (n + 1 < cap) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int left_ms = (int)((end - pd_now()) * 1e3);
        if (left_ms <= 0 || poll(&pfd, 1, left_ms) != 1 || read(fd, buf + n, 1) != 1) return false;
        if (buf[n] == '\n') break;
        n++;
    }
    buf[n] = 0;
    return n > 0;
}

static bool read_line(int fd, char *buf, size_t cap) {
    return read_line_within(fd, buf, cap, 120);
}

/* The child: a consumer engine on GPU 0; tells the parent its address,
 * learns the producer's, then takes (or fetches) every planned tensor and
 * checks its bytes. Exit status: 0 when all arrived right. */
static int consumer_main(int rfd, int wfd) {
    p2p_engine *D = mk(0, 2e9, 30);
    if (!D) return 2;
    char line[128];
    int n = snprintf(line, sizeof line, "%s\n", p2p_address(D));
    if (write(wfd, line, (size_t)n) != n || !read_line(rfd, line, sizeof line)) return 3;
    planned_tensor plan[PLAN_MAX];
    int np = make_plan(plan), bad = 0;
    pd_err err;
    for (int i = 0; i < np; i++) {
        const planned_tensor *t = &plan[i];
        if (t->drop) {
            /* Room reserved (the PUT is in, or our GET went out): drop it,
             * whatever stage its bytes are at. */
            if (t->mode == 2 && p2p_fetch(D, line, t->id, 0, &err) != 0) bad++;
            p2p_stats st;
            double end = pd_now() + 10;
            do {
                usleep(200);
                p2p_stats_get(D, &st);
            } while (st.buffered_bytes < t->nbytes && pd_now() < end);
            if (st.buffered_bytes < t->nbytes) {
                fprintf(stderr, "consumer: %s never reserved\n", t->id);
                bad++;
            }
            p2p_drop(D, line, t->id);
            continue;
        }
        if (t->mode == 2 && p2p_fetch(D, line, t->id, 0, &err) != 0) {
            fprintf(stderr, "consumer: fetch %s: %s\n", t->id, err.msg);
            bad++;
            continue;
        }
        p2p_tensor *got = NULL;
        int rc = take_wait(D, t->id, 30, &got, &err);
        bool ok =
            rc == 1 && got && got->on_device &&
            (t->late ? all_bytes(got->data, t->late, t->nbytes) : holds(got, t->id, t->nbytes));
        if (!ok) {
            fprintf(stderr, "consumer: %s (%zu bytes, mode %d%s) %s\n", t->id, t->nbytes, t->mode,
                    t->late ? ", late write" : "",
                    rc < 0 ? err.msg
                    : rc   ? "wrong"
                           : "missing");
            bad++;
        }
        p2p_tensor_free(D, got);
        if (rc == 0) { /* 30 s without it: the rest would wait as long */
            bad += np - i - 1;
            break;
        }
    }
    p2p_stats st;
    double end = pd_now() + 5;
    do { /* the drained reservations go back too */
        usleep(1000);
        p2p_stats_get(D, &st);
    } while (st.buffered_bytes > 0 && pd_now() < end);
    if (st.comm_resets != 0 || st.buffered_bytes != 0) {
        fprintf(stderr, "consumer: %llu communicators torn down, %zu bytes still held\n",
                (unsigned long long)st.comm_resets, st.buffered_bytes);
        bad++;
    }
    printf("consumer: %d of %d tensors arrived right (or were dropped cleanly)\n", np - bad, np);
    n = snprintf(line, sizeof line, "%d\n", bad);
    if (write(wfd, line, (size_t)n) != n) bad++;
    p2p_destroy(D);
    return bad ? 1 : 0;
}

/* Runs this program again as a child that talks over two pipes (their
 * numbers in fds_env), as another NCCL host (host_id), so NCCL lets it have
 * a rank on the same GPU. down: parent to child; up: child to parent. */
static pid_t spawn_self(const char *self, const char *fds_env, const char *host_id, int *down_w,
                        int *up_r) {
    int down[2], up[2];
    CHECK(pipe(down) == 0 && pipe(up) == 0);
    char fds[32];
    snprintf(fds, sizeof fds, "%d,%d", down[0], up[1]);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive a parent killed by a timeout */
        setenv(fds_env, fds, 1);
        setenv("NCCL_HOSTID", host_id, 1);
        execl(self, "test_p2p_nccl (child)", (char *)NULL);
        _exit(127);
    }
    close(down[0]);
    close(up[1]);
    CHECK(pid > 0);
    *down_w = down[1];
    *up_r = up[0];
    return pid;
}

/* The parent: starts the consumer (this program again, with its own
 * NCCL_HOSTID) and sends it the plan from a producer engine whose ready
 * events are recorded on a slow writer's stream. */
static void one_gpu_pair(const char *self) {
    int down[2], up[2];
    pid_t pid =
        spawn_self(self, "P2P_NCCL_CONSUMER_FDS", "pdserve-test-consumer", &down[1], &up[0]);
    char peer[128];
    bool started = pid > 0 && read_line(up[0], peer, sizeof peer);
    CHECKF(started, "the consumer process did not start");
    slow_writer w;
    writer_init(&w, 0);
    p2p_engine *P = started ? mk_with(0, 2e9, 30, &w.be) : NULL;
    CHECK(!started || P != NULL);
    if (P) {
        char line[128];
        int n = snprintf(line, sizeof line, "%s\n", p2p_address(P));
        CHECK(write(down[1], line, (size_t)n) == n);
        planned_tensor plan[PLAN_MAX];
        int np = make_plan(plan), failed = 0;
        pd_err err;
        double t0 = pd_now();
        for (int i = 0; i < np; i++) {
            const planned_tensor *t = &plan[i];
            int64_t shape[1] = {(int64_t)t->nbytes};
            void *d =
                t->late ? p2p_buffer_alloc(P, t->nbytes, &err) : dev_data(P, t->id, t->nbytes);
            if (d && t->late) {
                cudaMemset(d, 0x22, t->nbytes);
                write_late(&w, d, t->late, t->nbytes);
            }
            int rc = -1;
            if (!d)
                failed++;
            else if (t->mode == 0) {
                rc = p2p_put(P, peer, t->id, "uint8", 1, shape, d, t->nbytes, 0, &err);
                p2p_buffer_free(P, d);
            } else if (t->mode == 1)
                rc = p2p_put_async(P, peer, t->id, "uint8", 1, shape, d, t->nbytes, 0, &err);
            else
                rc = p2p_offer(P, t->id, "uint8", 1, shape, d, t->nbytes, 0, &err);
            if (d && rc != 0) {
                fprintf(stderr, "producer: %s: %s\n", t->id, err.msg);
                failed++;
            }
        }
        for (int i = 0; i < np; i++) {
            if (plan[i].mode == 0) continue;
            int st = status_wait(P, plan[i].id, 30, &err);
            if (plan[i].drop ? st == 0 : st != 1) {
                fprintf(stderr, "producer: %s %s: %s\n", plan[i].id,
                        plan[i].drop ? "never settled" : "not delivered", err.msg);
                failed++;
            }
        }
        p2p_stats ps;
        p2p_stats_get(P, &ps);
        CHECKF(ps.comm_resets == 0, "producer: %llu communicators torn down",
               (unsigned long long)ps.comm_resets);
        CHECKF(failed == 0, "producer: %d of %d sends failed", failed, np);
        int bad = -1;
        if (read_line(up[0], line, sizeof line)) bad = atoi(line);
        CHECKF(bad == 0, "consumer: %d tensors missing or wrong (-1: no answer)", bad);
        printf("one GPU, two processes over NCCL's socket transport: %d tensors in %.2f s\n", np,
               pd_now() - t0);
        p2p_destroy(P);
    }
    close(down[1]);
    int status = 0;
    if (pid > 0 && !P) kill(pid, SIGKILL); /* it may wait for an address that never comes */
    if (pid > 0) waitpid(pid, &status, 0);
    CHECKF(pid > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
           "consumer process: exit status %d", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    close(up[0]);
    cudaStreamDestroy(w.stream);
}

/* Waits for a test child (killed at once with kill_now) and returns its
 * wait status; one that has not exited within 30 s (a hung teardown, or an
 * exit stuck on an NCCL thread) is killed so that it cannot hang the test. */
static int reap_child(pid_t pid, bool kill_now) {
    int status = 0;
    if (pid <= 0) return -1;
    if (kill_now) kill(pid, SIGKILL);
    for (double end = pd_now() + 30; waitpid(pid, &status, WNOHANG) == 0; usleep(10000)) {
        if (pd_now() > end) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            break;
        }
    }
    return status;
}

/* The join race, on the data plane itself: the two sides of a join do not
 * finish together, and the sender sends once its side is up, so the
 * receiver's first ncclRecv can come while its own side still says "in
 * progress". The child posts its receive right after starting to join,
 * long before the parent has even begun; the receive must wait for the
 * join and then get the bytes (it used to tear the communicator down). */
#define JOIN_BYTES (4 * MB + 5)
#define JOIN_ID "join-race"

static int join_child_main(int rfd, int wfd) {
    char hex[2 * P2P_NCCL_UID_BYTES + 8];
    uint8_t uid[P2P_NCCL_UID_BYTES];
    if (!read_line(rfd, hex, sizeof hex) || strlen(hex) != 2 * P2P_NCCL_UID_BYTES) return 3;
    for (int i = 0; i < P2P_NCCL_UID_BYTES; i++) {
        unsigned v = 0;
        if (sscanf(hex + 2 * i, "%2x", &v) != 1) return 3;
        uid[i] = (uint8_t)v;
    }
    pd_err err;
    void *buf = NULL;
    p2p_nccl_comm *c = NULL;
    p2p_nccl_op *op = NULL;
    const char *why = "ok";
    int joining = -1, rc = -1;
    if (p2p_nccl_use_device(0, &err) != 0 || cudaMalloc(&buf, JOIN_BYTES) != cudaSuccess ||
        cudaMemset(buf, 0, JOIN_BYTES) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
        why = "no device buffer";
    } else if (p2p_nccl_comm_start(uid, 1, 0, 0, &c, &err) != 0) {
        why = err.msg;
    } else {
        joining = p2p_nccl_comm_poll(c, &err) == 0;
        if (p2p_nccl_recv(c, buf, JOIN_BYTES, &op, &err) != 0) {
            why = err.msg;
        } else {
            /* The parent starts its side only after reading "posted". */
            if (write(wfd, "posted\n", 7) != 7) return 4;
            double end = pd_now() + 60;
            while ((rc = p2p_nccl_op_poll(op, &err)) == 0 && pd_now() < end)
                usleep(200);
            if (rc < 0) why = err.msg;
            if (rc == 0) why = "nothing arrived within 60 s";
        }
    }
    bool right = rc == 1 && dev_holds(buf, JOIN_ID, JOIN_BYTES);
    if (rc == 1 && !right) why = "wrong bytes";
    char line[sizeof(pd_err) + 64];
    int n = snprintf(line, sizeof line, "%s %d %s\n", right ? "right" : "bad", joining, why);
    if (write(wfd, line, (size_t)n) != n) right = false;
    p2p_nccl_op_free(op);
    p2p_nccl_comm_destroy(c);
    cudaFree(buf);
    return right ? 0 : 1;
}

static void join_race(const char *self) {
    int down[2], up[2];
    pid_t pid = spawn_self(self, "P2P_NCCL_JOIN_FDS", "pdserve-test-join", &down[1], &up[0]);
    pd_err err;
    uint8_t uid[P2P_NCCL_UID_BYTES];
    char line[sizeof(pd_err) + 64];
    bool sent = false;
    p2p_nccl_comm *c = NULL;
    void *buf = NULL;
    bool have_uid = pid > 0 && p2p_nccl_unique_id(uid, &err) == 0;
    CHECKF(pid <= 0 || have_uid, "join race: ncclGetUniqueId: %s", err.msg);
    bool answered = false;
    if (have_uid) {
        char hex[2 * P2P_NCCL_UID_BYTES + 2];
        for (int i = 0; i < P2P_NCCL_UID_BYTES; i++)
            snprintf(hex + 2 * i, 3, "%02x", uid[i]);
        strcat(hex, "\n");
        bool posted = write(down[1], hex, strlen(hex)) == (ssize_t)strlen(hex) &&
                      read_line(up[0], line, sizeof line) && !strcmp(line, "posted");
        CHECKF(posted, "the joining process did not post its receive");
        const char *setup = !posted                                       ? NULL
                            : cudaMalloc(&buf, JOIN_BYTES) != cudaSuccess ? "cudaMalloc"
                            : !fill_device(JOIN_ID, buf, JOIN_BYTES)      ? "filling the buffer"
                            : p2p_nccl_comm_start(uid, 0, 0, 0, &c, &err) != 0 ? err.msg
                                                                               : "";
        CHECKF(!setup || !setup[0], "join race: sender set-up failed: %s", setup);
        if (setup && !setup[0]) {
            int rc = 0;
            double end = pd_now() + 60;
            while ((rc = p2p_nccl_comm_poll(c, &err)) == 0 && pd_now() < end)
                usleep(200);
            p2p_nccl_op *op = NULL;
            if (rc == 1 && p2p_nccl_send(c, buf, JOIN_BYTES, NULL, &op, &err) == 0) {
                while ((rc = p2p_nccl_op_poll(op, &err)) == 0 && pd_now() < end)
                    usleep(200);
                sent = rc == 1;
            }
            CHECKF(sent, "join race: the send failed: %s", rc < 0 ? err.msg : "timed out");
            p2p_nccl_op_free(op);
            answered = read_line(up[0], line, sizeof line);
            CHECKF(answered && !strncmp(line, "right", 5), "join race: receiver says '%s'",
                   answered ? line : "(nothing)");
            /* "right 1 ok": the receive really was posted before the join
             * was done; otherwise this test proves nothing about the race. */
            CHECKF(!answered || !strncmp(line, "right 1 ", 8),
                   "join race: the receiver was not still joining when it posted: '%s'", line);
            if (answered) printf("join race: receiver answered '%s'\n", line);
        }
    }
    close(down[1]);
    /* Without an answer it may wait for bytes that never come. */
    int status = reap_child(pid, !answered);
    CHECKF(pid > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
           "joining process: exit status %d", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    close(up[0]);
    p2p_nccl_comm_destroy(c);
    cudaFree(buf);
}

/* A peer that never joins (its process died before its side started):
 * the receive queued behind the join must neither start nor hang, and
 * tearing the communicator down at the engine's join deadline must come
 * back at once and fail the queued receive. The child does it all alone:
 * it makes the id, so the bootstrap root waiting for rank 0 is its own. */
static int never_child_main(int wfd) {
    pd_err err;
    uint8_t uid[P2P_NCCL_UID_BYTES];
    void *buf = NULL;
    p2p_nccl_comm *c = NULL;
    p2p_nccl_op *op = NULL;
    const char *why = "ok";
    int still = 0, rc = 0;
    double destroy_s = -1;
    if (p2p_nccl_use_device(0, &err) != 0 || cudaMalloc(&buf, 4096) != cudaSuccess) {
        why = "no device buffer";
    } else if (p2p_nccl_unique_id(uid, &err) != 0 ||
               p2p_nccl_comm_start(uid, 1, 0, 0, &c, &err) != 0 ||
               p2p_nccl_recv(c, buf, 4096, &op, &err) != 0) {
        why = err.msg;
    } else {
        /* 1.5 s of polling, as the engine's I/O thread would: both stay "in progress". */
        for (double end = pd_now() + 1.5; pd_now() < end; usleep(1000)) {
            if (p2p_nccl_comm_poll(c, &err) != 0 || (rc = p2p_nccl_op_poll(op, &err)) != 0) break;
            still++;
        }
        if (p2p_nccl_comm_poll(c, &err) != 0 || rc != 0)
            why = "the join or the receive ended alone";
        double t0 = pd_now();
        p2p_nccl_comm_destroy(c);
        c = NULL;
        destroy_s = pd_now() - t0;
        rc = p2p_nccl_op_poll(op, &err);
        if (!strcmp(why, "ok") && (rc != -1 || !strstr(err.msg, "destroyed")))
            why = rc == -1 ? err.msg : "the queued receive did not fail";
    }
    char line[sizeof(pd_err) + 64];
    int n = snprintf(line, sizeof line, "%s %.3f %d %s\n", strcmp(why, "ok") ? "bad" : "done",
                     destroy_s, still, why);
    bool told = write(wfd, line, (size_t)n) == n;
    p2p_nccl_op_free(op);
    p2p_nccl_comm_destroy(c);
    cudaFree(buf);
    return told && !strcmp(why, "ok") ? 0 : 1;
}

static void join_never(const char *self) {
    int down, up;
    pid_t pid = spawn_self(self, "P2P_NCCL_NEVER_FDS", "pdserve-test-never", &down, &up);
    close(down);
    char line[sizeof(pd_err) + 64];
    /* Set-up plus 1.5 s of polling; a teardown that hangs is the failure to catch. */
    bool answered = pid > 0 && read_line_within(up, line, sizeof line, 45);
    double destroy_s = -1;
    if (answered) sscanf(line, "%*s %lf", &destroy_s);
    CHECKF(answered && !strncmp(line, "done ", 5),
           "join never completes: the joining process says '%s'",
           answered ? line : "nothing within 45 s (hung?)");
    CHECKF(!answered || (destroy_s >= 0 && destroy_s < 5),
           "join never completes: tearing the communicator down took %.2f s", destroy_s);
    if (answered) printf("join never completes: '%s'\n", line);
    int status = reap_child(pid, !answered);
    CHECKF(pid > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0,
           "join never completes: exit status %d", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    close(up);
}

int main(void) {
    int n = 0;
    if (getenv("P2P_TEST_DEBUG")) pd_log_set_level(PD_LOG_DEBUG);
    const char *consumer_fds = getenv("P2P_NCCL_CONSUMER_FDS");
    int rfd = -1, wfd = -1;
    if (consumer_fds && sscanf(consumer_fds, "%d,%d", &rfd, &wfd) == 2)
        return consumer_main(rfd, wfd);
    const char *join_fds = getenv("P2P_NCCL_JOIN_FDS");
    if (join_fds && sscanf(join_fds, "%d,%d", &rfd, &wfd) == 2) return join_child_main(rfd, wfd);
    const char *never_fds = getenv("P2P_NCCL_NEVER_FDS");
    if (never_fds && sscanf(never_fds, "%d,%d", &rfd, &wfd) == 2) return never_child_main(wfd);
    if (cudaGetDeviceCount(&n) != cudaSuccess || n < 1) {
        printf("no GPU: skipped\n");
        return 0;
    }
    pool_reuse();
    free_waits_for_writer();
    join_never("/proc/self/exe");
    if (n < 2) {
        /* Before this process's first NCCL call, which reads them: the
         * consumer child gets another host id, and loopback carries it. */
        setenv("NCCL_HOSTID", "pdserve-test-producer", 1);
        setenv("NCCL_SOCKET_IFNAME", "lo", 1);
        single_gpu();
        join_race("/proc/self/exe");
        one_gpu_pair("/proc/self/exe");
        printf("1 CUDA device: transfers ran between two processes (two NCCL hosts on one GPU)\n");
        return test_finish();
    }
    p2p_engine *P = mk(0, 2e9, 20), *D = mk(1, 2e9, 20);
    CHECK(P && D);
    if (!P || !D) return test_finish();
    pd_err err;
    const size_t sizes[] = {1, 4096, 1 * MB + 3, 64 * MB};
    for (int mode = 0; mode < 3; mode++) {
        for (int k = 0; k < 4; k++) {
            size_t nb = sizes[k];
            char id[64];
            snprintf(id, sizeof id, "nccl-m%d-%zu#3", mode, nb);
            int64_t shape[2] = {2, (int64_t)nb};
            void *d = dev_data(P, id, nb);
            double t0 = pd_now();
            int rc;
            if (mode == 0) {
                rc = p2p_put(P, p2p_address(D), id, "uint8", 2, shape, d, nb, 0, &err);
                p2p_buffer_free(P, d);
            } else if (mode == 1) {
                rc = p2p_put_async(P, p2p_address(D), id, "uint8", 2, shape, d, nb, 0, &err);
            } else {
                rc = p2p_offer(P, id, "uint8", 2, shape, d, nb, 0, &err);
                if (rc == 0) rc = p2p_fetch(D, p2p_address(P), id, 0, &err);
            }
            CHECKF(rc == 0, "mode %d size %zu: %s", mode, nb, rc ? err.msg : "");
            p2p_tensor *t = NULL;
            rc = take_wait(D, id, 20, &t, &err);
            double dt = pd_now() - t0;
            CHECKF(rc == 1 && holds(t, id, nb), "mode %d size %zu: take %d %s", mode, nb, rc,
                   rc < 0 ? err.msg : "");
            CHECK(t && t->ndim == 2 && t->shape[1] == (int64_t)nb && !strcmp(t->dtype, "uint8"));
            printf("mode %d: %zu bytes in %.2f ms\n", mode, nb, dt * 1e3);
            p2p_tensor_free(D, t);
            if (mode > 0) CHECK(status_wait(P, id, 5, &err) == 1);
        }
    }
    /* Many in flight at once, in order on one communicator. */
    int bad = 0;
    for (int r = 0; r < 8; r++)
        for (int l = 0; l < 12; l++) {
            char id[32];
            snprintf(id, sizeof id, "r%d#%d", r, l);
            size_t nb = 10000 + (size_t)r * 1000 + (size_t)l;
            int64_t shape[1] = {(int64_t)nb};
            if (p2p_put_async(P, p2p_address(D), id, "uint8", 1, shape, dev_data(P, id, nb), nb, 0,
                              &err) != 0)
                bad++;
        }
    for (int r = 0; r < 8; r++)
        for (int l = 0; l < 12; l++) {
            char id[32];
            snprintf(id, sizeof id, "r%d#%d", r, l);
            p2p_tensor *t = NULL;
            if (take_wait(D, id, 20, &t, &err) != 1 ||
                !holds(t, id, 10000 + (size_t)r * 1000 + (size_t)l))
                bad++;
            p2p_tensor_free(D, t);
        }
    CHECKF(bad == 0, "%d of 96 concurrent tensors missing or wrong", bad);
    send_waits_for_writer(D);
    /* Drop of an offer frees it on the producer. */
    int64_t s1[1] = {4096};
    CHECK(p2p_offer(P, "dropme", "uint8", 1, s1, dev_data(P, "dropme", 4096), 4096, 0, &err) == 0);
    p2p_drop(D, p2p_address(P), "dropme");
    CHECK(status_wait(P, "dropme", 2, &err) == -1 && strstr(err.msg, "aborted"));
    /* A dead consumer: the PUT fails by its deadline. */
    p2p_engine *X = mk(1, 1e6, 1);
    char dead[64];
    snprintf(dead, sizeof dead, "%s", X ? p2p_address(X) : "127.0.0.1:1");
    p2p_destroy(X);
    void *d = dev_data(P, "dead", 4096);
    double t0 = pd_now();
    CHECK(p2p_put(P, dead, "dead", "uint8", 1, s1, d, 4096, pd_now() + 1, &err) != 0 &&
          pd_now() - t0 < 3);
    p2p_buffer_free(P, d);
    p2p_stats sp, sd;
    p2p_stats_get(P, &sp);
    p2p_stats_get(D, &sd);
    printf("sent %llu bytes in %llu transfers; received %llu bytes; buffered %zu\n",
           (unsigned long long)sp.bytes_sent, (unsigned long long)sp.sends_ok,
           (unsigned long long)sd.bytes_received, sd.buffered_bytes);
    CHECK(sd.buffered_bytes == 0);
    t0 = pd_now();
    p2p_destroy(P);
    p2p_destroy(D);
    CHECKF(pd_now() - t0 < 5, "destroy took %.2f s", pd_now() - t0);
    return test_finish();
}
#endif
