/* test_p2p: the KV transfer engine over tcp, with two or three engines in this
 * process on 127.0.0.1. Every delivered tensor is compared byte for byte with
 * a pattern regenerated from its id; the fault cases check the error text,
 * that nothing waits past its deadline, and (through p2p_stats) that buffers
 * are given back. The ASan build checks for leaks and races on memory. */
#include "connector/p2p.h"
#include "tests/common/testlib.h"
#include "tests/connector/p2p_test_util.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#define MB (1024u * 1024u)

/* tcp_streams of the engines mk makes: main runs the transfer tests with
 * one connection a peer and again with several. */
static int streams = 1;

static p2p_engine *mk(double budget, double timeout, const char *fp) {
    p2p_config cfg = {.tcp_streams = streams,
                      .kv_ip = "127.0.0.1",
                      .kv_port = 0,
                      .kv_buffer_size = budget,
                      .send_type = P2P_PUT_ASYNC,
                      .transport = P2P_TCP,
                      .timeout_s = timeout,
                      .fingerprint = fp ? fp : "opt test fp"};
    p2p_engine *e = NULL;
    pd_err err;
    if (p2p_create(&cfg, &e, &err) != 0) fprintf(stderr, "p2p_create: %s\n", err.msg);
    return e;
}

static uint8_t *make_data(const char *id, size_t n) {
    uint8_t *p = malloc(n ? n : 1);
    fill(id, p, n);
    return p;
}

static bool holds(const p2p_tensor *t, const char *id, size_t n) {
    if (!t || t->nbytes != n || strcmp(t->id, id) != 0 || (n && !t->data)) return false;
    uint8_t *want = make_data(id, n);
    bool ok = n == 0 || memcmp(want, t->data, n) == 0;
    free(want);
    return ok;
}

static p2p_stats stats(p2p_engine *e) {
    p2p_stats s;
    p2p_stats_get(e, &s);
    return s;
}

/* Waits for a stats predicate to hold (the I/O thread frees asynchronously). */
#define STATS_WAIT(e, cond, secs)                                                                  \
    do {                                                                                           \
        double end_ = pd_now() + (secs);                                                           \
        p2p_stats s;                                                                               \
        for (;;) {                                                                                 \
            s = stats(e);                                                                          \
            if ((cond) || pd_now() > end_) break;                                                  \
            usleep(1000);                                                                          \
        }                                                                                          \
        CHECKF(cond, "%s (buffered %zu, offered %zu, aborts %llu)", #cond, s.buffered_bytes,       \
               s.offered_bytes, (unsigned long long)s.aborts);                                     \
    } while (0)

static const size_t sizes[] = {0, 1, 1 * MB + 3, 64 * MB};

static void test_put_modes(void) {
    p2p_engine *P = mk(1e9, 10, NULL), *D = mk(1e9, 10, NULL);
    CHECK(P && D);
    if (!P || !D) return;
    pd_err err;
    for (int mode = 0; mode < 3; mode++) {
        for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
            size_t n = sizes[k];
            char id[64];
            snprintf(id, sizeof id, "xfer-m%d-%zu#0", mode, n);
            int64_t shape[4] = {2, (int64_t)k + 1, 3, 5};
            uint8_t *data = make_data(id, n);
            int rc;
            if (mode == 0) {
                rc = p2p_put(P, p2p_address(D), id, "float16", 4, shape, data, n, 0, &err);
                free(data);
            } else if (mode == 1) {
                rc = p2p_put_async(P, p2p_address(D), id, "float16", 4, shape, data, n, 0, &err);
            } else {
                rc = p2p_offer(P, id, "float16", 4, shape, data, n, 0, &err);
                if (rc == 0) rc = p2p_fetch(D, p2p_address(P), id, 0, &err);
            }
            CHECKF(rc == 0, "mode %d size %zu: %s", mode, n, rc ? err.msg : "");
            p2p_tensor *t = NULL;
            rc = take_wait(D, id, 10, &t, &err);
            CHECKF(rc == 1 && holds(t, id, n), "mode %d size %zu: take %d %s", mode, n, rc,
                   rc < 0 ? err.msg : "");
            CHECK(t && t->ndim == 4 && t->shape[0] == 2 && t->shape[1] == (int64_t)k + 1 &&
                  t->shape[3] == 5 && !strcmp(t->dtype, "float16") && !t->on_device);
            CHECK(stats(D).buffered_bytes == n); /* taken but not freed: still counted */
            p2p_tensor_free(D, t);
            CHECK(stats(D).buffered_bytes == 0);
            if (mode > 0) {
                CHECKF(status_wait(P, id, 5, &err) == 1, "mode %d size %zu: status", mode, n);
                p2p_forget_send(P, id);
                CHECK(p2p_send_status(P, id, &err) == -1); /* forgotten */
            }
        }
    }
    /* Small tensors (ZMQ keeps frames up to 33 bytes inside the message struct): hold
     * them all, then check — each must own its bytes, not point at a reused frame. */
    p2p_tensor *small[40] = {0};
    for (int i = 0; i < 40; i++) {
        char id[32];
        snprintf(id, sizeof id, "small%d", i);
        int64_t shape[1] = {i + 1};
        p2p_put_async(P, p2p_address(D), id, "uint8", 1, shape, make_data(id, (size_t)i + 1),
                      (size_t)i + 1, 0, &err);
    }
    int small_bad = 0;
    for (int i = 0; i < 40; i++) {
        char id[32];
        snprintf(id, sizeof id, "small%d", i);
        if (take_wait(D, id, 5, &small[i], &err) != 1) small_bad++;
    }
    for (int i = 0; i < 40; i++) {
        char id[32];
        snprintf(id, sizeof id, "small%d", i);
        if (!holds(small[i], id, (size_t)i + 1)) small_bad++;
        p2p_tensor_free(D, small[i]);
        if (status_wait(P, id, 5, &err) != 1) small_bad++; /* the producer counts it on the ack */
        p2p_forget_send(P, id);
    }
    CHECKF(small_bad == 0, "%d small tensors wrong", small_bad);
    p2p_stats sp = stats(P), sd = stats(D);
    uint64_t total = 0;
    for (size_t k = 0; k < 4; k++)
        total += sizes[k];
    total = total * 3 + 820; /* 1 + 2 + ... + 40 small ones */
    CHECKF(sp.sends_ok == 52 && sp.bytes_sent == total && sp.sends_failed == 0, "sends_ok %llu",
           (unsigned long long)sp.sends_ok);
    CHECKF(sd.recvs_ok == 52 && sd.bytes_received == total && sd.recvs_failed == 0,
           "recvs_ok %llu", (unsigned long long)sd.recvs_ok);
    CHECK(sp.offered_bytes == 0 && sp.send_seconds > 0 && sd.recv_seconds > 0);
    /* The same id again while still being sent is refused; once forgotten it may be reused. */
    p2p_destroy(P);
    p2p_destroy(D);
}

/* 32 requests x 12 layers in flight at once, each tensor a distinct size and pattern. */
enum { NREQ = 32, NLAYER = 12 };
static size_t layer_size(int r, int l) {
    return 1000 + (size_t)r * 131 + (size_t)l * 17;
}

static void test_many(int mode) {
    p2p_engine *P = mk(1e9, 10, NULL), *D = mk(1e9, 10, NULL);
    CHECK(P && D);
    if (!P || !D) return;
    pd_err err;
    int fails = 0;
    for (int r = 0; r < NREQ; r++) {
        for (int l = 0; l < NLAYER; l++) {
            char id[64];
            snprintf(id, sizeof id, "req%d#%d", r, l);
            size_t n = layer_size(r, l);
            int64_t shape[1] = {(int64_t)n};
            int rc = mode == 1 ? p2p_put_async(P, p2p_address(D), id, "uint8", 1, shape,
                                               make_data(id, n), n, 0, &err)
                               : p2p_offer(P, id, "uint8", 1, shape, make_data(id, n), n, 0, &err);
            if (rc == 0 && mode == 2) rc = p2p_fetch(D, p2p_address(P), id, 0, &err);
            fails += rc != 0;
        }
    }
    CHECKF(fails == 0, "mode %d: %d submissions failed", mode, fails);
    int bad = 0;
    for (int r = NREQ - 1; r >= 0; r--) { /* take in another order than sent */
        for (int l = 0; l < NLAYER; l++) {
            char id[64];
            snprintf(id, sizeof id, "req%d#%d", r, l);
            p2p_tensor *t = NULL;
            if (take_wait(D, id, 10, &t, &err) != 1 || !holds(t, id, layer_size(r, l)) ||
                t->shape[0] != (int64_t)layer_size(r, l))
                bad++;
            p2p_tensor_free(D, t);
        }
    }
    CHECKF(bad == 0, "mode %d: %d tensors missing or wrong", mode, bad);
    STATS_WAIT(P, s.sends_ok == NREQ * NLAYER && s.offered_bytes == 0, 5);
    CHECK(stats(D).buffered_bytes == 0 && stats(D).recvs_ok == NREQ * NLAYER);
    /* The asking side (P pushes, D pulls) spread the tensors over every connection. */
    const int conns = stats(mode == 1 ? P : D).connections;
    CHECKF(conns == streams, "mode %d: %d connections with tcp_streams %d", mode, conns, streams);
    p2p_destroy(P);
    p2p_destroy(D);
}

/* Blocking PUTs from 8 threads at once into one consumer. */
typedef struct put_job {
    p2p_engine *P;
    const char *peer;
    int thread;
    int fails;
} put_job;

static void *put_thread(void *arg) {
    put_job *j = arg;
    for (int i = 0; i < 24; i++) {
        char id[64];
        snprintf(id, sizeof id, "t%d-%d", j->thread, i);
        size_t n = 5000 + (size_t)i * 7;
        uint8_t *data = make_data(id, n);
        int64_t shape[1] = {(int64_t)n};
        pd_err err;
        if (p2p_put(j->P, j->peer, id, "uint8", 1, shape, data, n, 0, &err) != 0) j->fails++;
        free(data);
    }
    return NULL;
}

static void test_threads(void) {
    p2p_engine *P = mk(1e9, 10, NULL), *D = mk(1e9, 10, NULL);
    CHECK(P && D);
    if (!P || !D) return;
    pthread_t th[8];
    put_job jobs[8];
    for (int i = 0; i < 8; i++) {
        jobs[i] = (put_job){P, p2p_address(D), i, 0};
        pthread_create(&th[i], NULL, put_thread, &jobs[i]);
    }
    int fails = 0, bad = 0;
    for (int i = 0; i < 8; i++) {
        pthread_join(th[i], NULL);
        fails += jobs[i].fails;
    }
    CHECKF(fails == 0, "%d blocking PUTs failed", fails);
    for (int t = 0; t < 8; t++) {
        for (int i = 0; i < 24; i++) {
            char id[64];
            snprintf(id, sizeof id, "t%d-%d", t, i);
            p2p_tensor *x = NULL;
            pd_err err;
            if (p2p_take(D, id, &x, &err) != 1 || !holds(x, id, 5000 + (size_t)i * 7))
                bad++; /* PUT returned: here */
            p2p_tensor_free(D, x);
        }
    }
    CHECKF(bad == 0, "%d tensors missing or wrong", bad);
    p2p_destroy(P);
    p2p_destroy(D);
}

/* A receiver with room for one tensor: the second waits (retries) until the first is freed. */
static void test_tiny_budget(void) {
    p2p_engine *P = mk(1e9, 10, NULL), *D = mk(3000, 10, NULL);
    CHECK(P && D);
    if (!P || !D) return;
    pd_err err;
    int64_t shape[1] = {2000};
    CHECK(p2p_put_async(P, p2p_address(D), "a", "uint8", 1, shape, make_data("a", 2000), 2000, 0,
                        &err) == 0);
    CHECK(status_wait(P, "a", 5, &err) == 1);
    CHECK(p2p_put_async(P, p2p_address(D), "b", "uint8", 1, shape, make_data("b", 2000), 2000, 0,
                        &err) == 0);
    usleep(150 * 1000);
    CHECK(p2p_send_status(P, "b", &err) == 0); /* still trying */
    CHECK(stats(P).retries >= 3);
    CHECK(stats(D).buffered_bytes == 2000); /* never more than kv_buffer_size */
    p2p_tensor *t = NULL;
    CHECK(p2p_take(D, "b", &t, &err) == 0);
    CHECK(p2p_take(D, "a", &t, &err) == 1 && holds(t, "a", 2000));
    usleep(50 * 1000);
    CHECK(p2p_send_status(P, "b", &err) == 0); /* taken but not freed still holds the budget */
    p2p_tensor_free(D, t);
    CHECKF(status_wait(P, "b", 5, &err) == 1, "b after a was freed");
    CHECK(take_wait(D, "b", 5, &t, &err) == 1 && holds(t, "b", 2000));
    p2p_tensor_free(D, t);

    CHECK(p2p_put_async(P, p2p_address(D), "c", "uint8", 1, shape, make_data("c", 2000), 2000, 0,
                        &err) == 0);
    CHECK(status_wait(P, "c", 5, &err) == 1);
    /* No room, deadline short: fails by the deadline with the last "no room" reason. */
    uint8_t *d = make_data("d", 2000);
    double t0 = pd_now();
    int rc = p2p_put(P, p2p_address(D), "d", "uint8", 1, shape, d, 2000, pd_now() + 0.3, &err);
    double dt = pd_now() - t0;
    CHECKF(rc != 0 && strstr(err.msg, "no room") && dt < 1.0, "rc %d after %.2f s: %s", rc, dt,
           rc ? err.msg : "");
    free(d);
    CHECK(take_wait(D, "c", 1, &t, &err) == 1);
    p2p_tensor_free(D, t);

    /* Bigger than the whole budget: fails at once with the clear error, no retrying. */
    int64_t big[1] = {5000};
    uint8_t *e = make_data("e", 5000);
    t0 = pd_now();
    uint64_t retries = stats(P).retries;
    rc = p2p_put(P, p2p_address(D), "e", "uint8", 1, big, e, 5000, pd_now() + 5, &err);
    dt = pd_now() - t0;
    CHECKF(
        rc != 0 &&
            strstr(err.msg, "kv_buffer_size 3000 is smaller than one request's KV (5000 bytes") &&
            dt < 0.5,
        "rc %d after %.2f s: %s", rc, dt, rc ? err.msg : "");
    CHECK(stats(P).retries == retries);
    free(e);
    CHECK(p2p_put_async(P, p2p_address(D), "f", "uint8", 1, big, make_data("f", 5000), 5000, 0,
                        &err) == 0);
    rc = status_wait(P, "f", 2, &err);
    CHECKF(rc == -1 && strstr(err.msg, "smaller than one request's KV"), "async: %d %s", rc,
           err.msg);
    STATS_WAIT(P, s.offered_bytes == 0, 1);
    CHECK(stats(D).buffered_bytes == 0);
    /* The consumer says so too: whoever waits for "f" learns it now, not at
     * its deadline. */
    p2p_tensor *never = NULL;
    t0 = pd_now();
    rc = take_wait(D, "f", 2, &never, &err);
    CHECKF(rc == -1 && strstr(err.msg, "smaller than one request's KV") && pd_now() - t0 < 0.5,
           "consumer's take of a refused tensor: %d after %.2f s: %s", rc, pd_now() - t0,
           rc ? err.msg : "");
    CHECK(stats(D).buffered_bytes == 0);

    /* GET mode: the consumer's budget is the limit; too big → clear error, and the producer frees
     * it (ABORT). */
    CHECK(p2p_offer(P, "g", "uint8", 1, big, make_data("g", 5000), 5000, 0, &err) == 0);
    CHECK(p2p_fetch(D, p2p_address(P), "g", 0, &err) == 0);
    rc = take_wait(D, "g", 2, &t, &err);
    CHECKF(rc == -1 &&
               strstr(err.msg, "kv_buffer_size 3000 is smaller than one request's KV (5000 bytes"),
           "get: %d %s", rc, err.msg);
    STATS_WAIT(P, s.offered_bytes == 0 && s.aborts == 1, 1);
    CHECK(p2p_send_status(P, "g", &err) == -1 && strstr(err.msg, "aborted by peer"));
    /* GET of a tensor that fits, with the budget partly held: waits for room. */
    CHECK(p2p_offer(P, "h", "uint8", 1, shape, make_data("h", 2000), 2000, 0, &err) == 0);
    CHECK(p2p_offer(P, "i", "uint8", 1, shape, make_data("i", 2000), 2000, 0, &err) == 0);
    CHECK(p2p_fetch(D, p2p_address(P), "h", 0, &err) == 0);
    CHECK(take_wait(D, "h", 2, &t, &err) == 1 && holds(t, "h", 2000));
    CHECK(p2p_fetch(D, p2p_address(P), "i", 0, &err) == 0);
    p2p_tensor *t2 = NULL;
    CHECK(take_wait(D, "i", 0.15, &t2, &err) == 0);
    p2p_tensor_free(D, t);
    CHECK(take_wait(D, "i", 2, &t2, &err) == 1 && holds(t2, "i", 2000));
    p2p_tensor_free(D, t2);
    CHECK(stats(D).buffered_bytes == 0);
    p2p_destroy(P);
    p2p_destroy(D);
}

/* A port nobody listens on: an engine bound it, then went away. */
static void dead_addr(char *buf, size_t cap) {
    p2p_engine *x = mk(1e6, 1, NULL);
    snprintf(buf, cap, "%s", x ? p2p_address(x) : "127.0.0.1:1");
    p2p_destroy(x);
}

static void test_dead_peer(void) {
    char dead[64];
    dead_addr(dead, sizeof dead);
    p2p_engine *P = mk(1e9, 10, NULL);
    CHECK(P != NULL);
    if (!P) return;
    pd_err err;
    int64_t shape[1] = {1000};
    uint8_t *data = make_data("x", 1000);
    double t0 = pd_now();
    int rc = p2p_put(P, dead, "x", "uint8", 1, shape, data, 1000, pd_now() + 0.5, &err);
    double dt = pd_now() - t0;
    CHECKF(rc != 0 && strstr(err.msg, "deadline") && strstr(err.msg, dead) && dt >= 0.45 &&
               dt < 1.0,
           "put: %.2f s: %s", dt, err.msg);
    free(data);
    t0 = pd_now();
    CHECK(p2p_put_async(P, dead, "y", "uint8", 1, shape, make_data("y", 1000), 1000, pd_now() + 0.5,
                        &err) == 0);
    CHECK(stats(P).offered_bytes == 1000);
    rc = status_wait(P, "y", 2, &err);
    dt = pd_now() - t0;
    CHECKF(rc == -1 && strstr(err.msg, "deadline") && dt < 1.0, "async: %d after %.2f s: %s", rc,
           dt, err.msg);
    CHECK(stats(P).offered_bytes == 0 && stats(P).sends_failed == 2);

    /* A consumer pulling from a dead producer fails by its deadline. */
    p2p_engine *D = mk(1e9, 10, NULL);
    t0 = pd_now();
    CHECK(p2p_fetch(D, dead, "z", pd_now() + 0.5, &err) == 0);
    p2p_tensor *t = NULL;
    rc = take_wait(D, "z", 2, &t, &err);
    dt = pd_now() - t0;
    CHECKF(rc == -1 && strstr(err.msg, "deadline") && dt < 1.0, "fetch: %d after %.2f s: %s", rc,
           dt, err.msg);
    CHECK(stats(D).buffered_bytes == 0 && stats(D).recvs_failed == 1);

    /* GET of something never offered: fails at once, "not found". */
    t0 = pd_now();
    CHECK(p2p_fetch(D, p2p_address(P), "nothing", 0, &err) == 0);
    rc = take_wait(D, "nothing", 2, &t, &err);
    CHECKF(rc == -1 && strstr(err.msg, "not found") && pd_now() - t0 < 0.5, "not found: %d %s", rc,
           err.msg);
    /* An offer nobody pulls is freed at its deadline. */
    CHECK(p2p_offer(P, "lonely", "uint8", 1, shape, make_data("lonely", 1000), 1000, pd_now() + 0.2,
                    &err) == 0);
    CHECK(stats(P).offered_bytes == 1000);
    rc = status_wait(P, "lonely", 2, &err);
    CHECKF(rc == -1 && strstr(err.msg, "not pulled"), "offer: %d %s", rc, err.msg);
    CHECK(stats(P).offered_bytes == 0);
    p2p_destroy(D);
    p2p_destroy(P);
}

/* The consumer goes away while 16 x 4 MB are on their way (room for 2: the rest are retrying). */
static void test_consumer_dies(void) {
    p2p_engine *P = mk(1e9, 10, NULL), *D = mk(8.5 * MB, 10, NULL);
    CHECK(P && D);
    if (!P || !D) return;
    char daddr[64];
    snprintf(daddr, sizeof daddr, "%s", p2p_address(D));
    pd_err err;
    int64_t shape[1] = {4 * MB};
    for (int i = 0; i < 16; i++) {
        char id[32];
        snprintf(id, sizeof id, "big%d", i);
        CHECK(p2p_put_async(P, daddr, id, "uint8", 1, shape, make_data(id, 4 * MB), 4 * MB,
                            pd_now() + 1.0, &err) == 0);
    }
    usleep(20 * 1000);
    double t0 = pd_now();
    p2p_destroy(D);
    CHECKF(pd_now() - t0 < 1.0, "consumer destroy took %.2f s", pd_now() - t0);
    int done = 0, failed = 0;
    for (int i = 0; i < 16; i++) {
        char id[32];
        snprintf(id, sizeof id, "big%d", i);
        int rc = status_wait(P, id, 3, &err);
        done += rc == 1;
        failed += rc == -1;
    }
    CHECKF(done + failed == 16 && failed > 0, "%d delivered, %d failed", done, failed);
    CHECK(pd_now() - t0 < 2.0);
    CHECK(stats(P).offered_bytes == 0);
    /* The producer is still fine: a new consumer gets a new tensor. */
    p2p_engine *D2 = mk(1e9, 10, NULL);
    uint8_t *data = make_data("after", 100);
    int64_t s100[1] = {100};
    CHECK(p2p_put(P, p2p_address(D2), "after", "uint8", 1, s100, data, 100, 0, &err) == 0);
    free(data);
    p2p_tensor *t = NULL;
    CHECK(p2p_take(D2, "after", &t, &err) == 1 && holds(t, "after", 100));
    p2p_tensor_free(D2, t);
    p2p_destroy(D2);
    p2p_destroy(P);
}

static void test_drop(void) {
    p2p_engine *P = mk(1e9, 10, NULL), *D = mk(1e9, 10, NULL);
    CHECK(P && D);
    if (!P || !D) return;
    pd_err err;
    int64_t shape[1] = {1000};
    /* GET mode: the consumer gives up → the producer frees its offer at once. */
    CHECK(p2p_offer(P, "o1", "uint8", 1, shape, make_data("o1", 1000), 1000, pd_now() + 20, &err) ==
          0);
    CHECK(stats(P).offered_bytes == 1000);
    double t0 = pd_now();
    p2p_drop(D, p2p_address(P), "o1");
    STATS_WAIT(P, s.offered_bytes == 0 && s.aborts == 1, 1);
    CHECKF(pd_now() - t0 < 0.5, "freed after %.2f s", pd_now() - t0);
    CHECK(p2p_send_status(P, "o1", &err) == -1 && strstr(err.msg, "aborted by peer"));
    p2p_forget_send(P, "o1");

    /* PUT mode: a dropped id refuses late data — the sender fails fast, nothing is buffered. */
    p2p_drop(D, p2p_address(P), "late");
    usleep(50 * 1000); /* let the producer see the ABORT first (else it fails its PUT as "aborted by
                          peer") */
    uint8_t *data = make_data("late", 1000);
    t0 = pd_now();
    int rc = p2p_put(P, p2p_address(D), "late", "uint8", 1, shape, data, 1000, pd_now() + 5, &err);
    CHECKF(rc != 0 && strstr(err.msg, "dropped") && pd_now() - t0 < 0.5, "late put: %d %s", rc,
           err.msg);
    free(data);
    CHECK(stats(D).buffered_bytes == 0);
    p2p_tensor *t = NULL;
    CHECK(p2p_take(D, "late", &t, &err) == -1 && strstr(err.msg, "dropped"));

    /* Dropping a received, untaken tensor gives its bytes back. */
    data = make_data("r1", 1000);
    CHECK(p2p_put(P, p2p_address(D), "r1", "uint8", 1, shape, data, 1000, 0, &err) == 0);
    free(data);
    CHECK(stats(D).buffered_bytes == 1000);
    p2p_drop(D, p2p_address(P), "r1");
    CHECK(stats(D).buffered_bytes == 0);
    CHECK(p2p_take(D, "r1", &t, &err) == -1);

    /* Dropping a GET in flight to a dead producer: nothing reported later, budget back. */
    char dead[64];
    dead_addr(dead, sizeof dead);
    CHECK(p2p_fetch(D, dead, "q", pd_now() + 0.3, &err) == 0);
    usleep(20 * 1000);
    p2p_drop(D, dead, "q");
    usleep(400 * 1000);
    CHECK(p2p_take(D, "q", &t, &err) == -1 && strstr(err.msg, "dropped"));
    CHECK(stats(D).buffered_bytes == 0);
    p2p_destroy(P);
    p2p_destroy(D);
}

static void test_fingerprint(void) {
    p2p_engine *P = mk(1e9, 10, "opt layers=12 dtype=float32"),
               *D = mk(1e9, 10, "opt layers=24 dtype=float16");
    CHECK(P && D);
    if (!P || !D) return;
    pd_err err;
    int64_t shape[1] = {10};
    uint8_t *data = make_data("fp", 10);
    double t0 = pd_now();
    int rc = p2p_put(P, p2p_address(D), "fp", "uint8", 1, shape, data, 10, pd_now() + 5, &err);
    char want[256];
    snprintf(want, sizeof want,
             "peer %s has model fingerprint \"opt layers=24 dtype=float16\", we have \"opt "
             "layers=12 dtype=float32\"",
             p2p_address(D));
    CHECKF(rc != 0 && strstr(err.msg, want) && pd_now() - t0 < 0.5, "put: %s", err.msg);
    CHECK(stats(P).fingerprint_mismatches == 1);
    STATS_WAIT(D, s.fingerprint_mismatches == 1, 1); /* and the receiver refused it too (logged) */
    CHECK(stats(D).buffered_bytes == 0);
    /* The other direction: the consumer pulling from the mismatched producer. */
    CHECK(p2p_offer(P, "fp2", "uint8", 1, shape, data, 10, 0, &err) == 0);
    CHECK(p2p_fetch(D, p2p_address(P), "fp2", pd_now() + 5, &err) == 0);
    p2p_tensor *t = NULL;
    rc = take_wait(D, "fp2", 2, &t, &err);
    CHECKF(
        rc == -1 &&
            strstr(
                err.msg,
                "has model fingerprint \"opt layers=12 dtype=float32\", we have \"opt layers=24"),
        "fetch: %s", err.msg);
    p2p_destroy(P);
    p2p_destroy(D);
}

/* Destroy with work in flight returns promptly; a caller blocked in p2p_put gets an error. */
static void *blocked_put(void *arg) {
    put_job *j = arg;
    int64_t shape[1] = {100};
    uint8_t *data = make_data("blocked", 100);
    pd_err err;
    j->fails =
        p2p_put(j->P, j->peer, "blocked", "uint8", 1, shape, data, 100, pd_now() + 20, &err) != 0;
    free(data);
    return NULL;
}

static void test_destroy_in_flight(void) {
    char dead[64];
    dead_addr(dead, sizeof dead);
    p2p_engine *P = mk(1e9, 30, NULL), *D = mk(1e9, 30, NULL);
    CHECK(P && D);
    if (!P || !D) return;
    pd_err err;
    int64_t shape[1] = {1 * MB};
    for (int i = 0; i < 32; i++) {
        char id[32];
        snprintf(id, sizeof id, "f%d", i);
        p2p_put_async(P, i % 2 ? dead : p2p_address(D), id, "uint8", 1, shape, make_data(id, MB),
                      MB, 0, &err);
        p2p_offer(P, id, "uint8", 1, shape, make_data(id, MB), MB, 0,
                  &err); /* same id: refused, buffer freed */
    }
    CHECK(p2p_offer(P, "kept", "uint8", 1, shape, make_data("kept", MB), MB, 0, &err) == 0);
    CHECK(p2p_fetch(D, dead, "pull", 0, &err) == 0);
    /* A consumer with room for one 100-byte tensor, already full: the blocked PUT keeps retrying.
     * Its retries show that the caller is inside p2p_put before we destroy (no call may start
     * after). */
    p2p_engine *F = mk(150, 30, NULL);
    int64_t s100[1] = {100};
    CHECK(F && p2p_put_async(P, p2p_address(F), "fill", "uint8", 1, s100, make_data("fill", 100),
                             100, 0, &err) == 0);
    CHECK(status_wait(P, "fill", 5, &err) == 1);
    put_job j = {P, F ? p2p_address(F) : dead, 0, 0};
    uint64_t retries = stats(P).retries;
    pthread_t th;
    pthread_create(&th, NULL, blocked_put, &j);
    STATS_WAIT(P, s.retries > retries + 2, 5);
    double t0 = pd_now();
    p2p_destroy(P);
    pthread_join(th, NULL);
    CHECK(j.fails == 1);
    p2p_destroy(D);
    p2p_destroy(F);
    CHECKF(pd_now() - t0 < 1.0, "destroy took %.2f s", pd_now() - t0);
}

/* Garbage on the wire: the engine answers what it can, ignores the rest, keeps working. */
static void test_garbage(void) {
    p2p_engine *D = mk(1e9, 10, NULL), *P = mk(1e9, 10, NULL);
    CHECK(D && P);
    if (!D || !P) return;
    void *ctx = zmq_ctx_new();
    void *s = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0, tmo = 1000;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(s, ZMQ_RCVTIMEO, &tmo, sizeof tmo);
    zmq_setsockopt(s, ZMQ_ROUTING_ID, "9.9.9.9:9", 9);
    char ep[80];
    snprintf(ep, sizeof ep, "tcp://%s", p2p_address(D));
    zmq_connect(s, ep);
    unsigned seed = 7;
    for (int i = 0; i < 200; i++) {
        uint8_t buf[64];
        size_t n = (size_t)(rand_r(&seed) % 64);
        for (size_t k = 0; k < n; k++)
            buf[k] = (uint8_t)rand_r(&seed);
        if (i % 3 == 0 && n) buf[0] = 0x83; /* a map: decoders go further */
        zmq_send(s, buf, n, i % 5 == 0 ? ZMQ_SNDMORE : 0);
        if (i % 5 == 0) zmq_send(s, "x", 1, 0);
    }
    /* A PUT before HELLO is refused with a reply, not silence. Packed by hand: {"cmd":"PUT",...}.
     */
    const uint8_t put[] = {0x85, 0xa3, 'c',  'm',  'd', 0xa3, 'P',  'U', 'T',  0xa9, 't', 'e', 'n',
                           's',  'o',  'r',  '_',  'i', 'd',  0xa1, 'q', 0xa5, 's',  'h', 'a', 'p',
                           'e',  0x91, 0x01, 0xa5, 'd', 't',  'y',  'p', 'e',  0xa5, 'u', 'i', 'n',
                           't',  '8',  0xa6, 'n',  'b', 'y',  't',  'e', 's',  0x01};
    zmq_send(s, put, sizeof put, 0);
    char reply[512];
    int n = zmq_recv(s, reply, sizeof reply - 1, 0);
    CHECKF(n > 0, "a reply to the PUT before HELLO");
    if (n > 0) {
        reply[n] = 0;
        CHECK(memmem(reply, (size_t)n, "before HELLO", 12) != NULL);
    }
    zmq_close(s);
    zmq_ctx_term(ctx);
    /* Still serving. */
    pd_err err;
    int64_t shape[1] = {64};
    uint8_t *data = make_data("ok", 64);
    CHECK(p2p_put(P, p2p_address(D), "ok", "uint8", 1, shape, data, 64, 0, &err) == 0);
    free(data);
    p2p_tensor *t = NULL;
    CHECK(p2p_take(D, "ok", &t, &err) == 1 && holds(t, "ok", 64));
    p2p_tensor_free(D, t);
    p2p_destroy(P);
    p2p_destroy(D);
}

static void test_config(void) {
    pd_err err;
    p2p_engine *e = NULL;
    p2p_config cfg = {
        .kv_ip = "127.0.0.1", .kv_buffer_size = 1e6, .transport = P2P_NCCL, .fingerprint = "x"};
    int rc = p2p_create(&cfg, &e, &err);
    CHECKF(rc != 0 && strstr(err.msg, "nccl"), "nccl without a GPU: %s", rc ? err.msg : "created");
    if (rc == 0) p2p_destroy(e);
    cfg.transport = P2P_TCP;
    cfg.kv_ip = "256.1.1.1";
    CHECK(p2p_create(&cfg, &e, &err) != 0 && strstr(err.msg, "bind"));
    cfg.kv_ip = "127.0.0.1";
    CHECK(p2p_create(&cfg, &e, &err) == 0 && strncmp(p2p_address(e), "127.0.0.1:", 10) == 0);
    /* The same fixed port twice: the second bind fails, naming kv_port. */
    p2p_config c2 = cfg;
    c2.kv_port = atoi(strchr(p2p_address(e), ':') + 1);
    p2p_engine *e2 = NULL;
    CHECK(p2p_create(&c2, &e2, &err) != 0 && strstr(err.msg, "kv_port"));
    int64_t shape[1] = {1};
    CHECK(p2p_put_async(e, "127.0.0.1:1", "", "uint8", 1, shape, malloc(1), 1, 0, &err) != 0 &&
          strstr(err.msg, "tensor id"));
    char longid[200];
    memset(longid, 'i', sizeof longid - 1);
    longid[sizeof longid - 1] = 0;
    CHECK(p2p_offer(e, longid, "uint8", 1, shape, malloc(1), 1, 0, &err) != 0 &&
          strstr(err.msg, "longer than"));
    p2p_destroy(e);
}

/* cfg.on_arrival: told after a tensor became ready (PUT, GET) or failed,
 * from the I/O thread without the engine's lock (the hook reads p2p_stats,
 * which takes it: a hook called under the lock would hang here). */
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int calls;
    uint64_t recvs_seen; /* recvs_ok + recvs_failed as the last call saw them */
    p2p_engine *e;
} arrival_log;

static void on_arrival(void *ctx) {
    arrival_log *a = ctx;
    p2p_stats s;
    p2p_stats_get(a->e, &s);
    pthread_mutex_lock(&a->mu);
    a->calls++;
    a->recvs_seen = s.recvs_ok + s.recvs_failed;
    pthread_cond_signal(&a->cv);
    pthread_mutex_unlock(&a->mu);
}

/* Waits until the hook saw at least `recvs` receives; false after 5 s. */
static bool arrival_wait(arrival_log *a, uint64_t recvs) {
    double end = pd_now() + 5;
    pthread_mutex_lock(&a->mu);
    while (a->recvs_seen < recvs && pd_now() < end) {
        struct timespec ts;
        pd_realtime_after_ms(&ts, 10);
        pthread_cond_timedwait(&a->cv, &a->mu, &ts);
    }
    bool ok = a->recvs_seen >= recvs;
    pthread_mutex_unlock(&a->mu);
    return ok;
}

static void test_arrival_hook(void) {
    arrival_log a = {.calls = 0};
    pthread_mutex_init(&a.mu, NULL);
    pthread_cond_init(&a.cv, NULL);
    p2p_config cfg = {.kv_ip = "127.0.0.1",
                      .kv_buffer_size = 1e9,
                      .transport = P2P_TCP,
                      .timeout_s = 10,
                      .fingerprint = "opt test fp",
                      .on_arrival = on_arrival,
                      .arrival_ctx = &a};
    p2p_engine *P = mk(1e9, 10, NULL), *D = NULL;
    pd_err err;
    pthread_mutex_lock(&a.mu); /* a.e is read by the hook */
    int rc = p2p_create(&cfg, &D, &err);
    a.e = D;
    pthread_mutex_unlock(&a.mu);
    CHECKF(P && rc == 0, "p2p_create: %s", rc ? err.msg : "");
    if (!P || rc != 0) goto out;
    int64_t shape[1] = {1000};
    p2p_tensor *t = NULL;
    /* PUT_ASYNC: once told, the tensor is there to take (no waiting). */
    CHECK(p2p_put_async(P, p2p_address(D), "hook-put", "uint8", 1, shape,
                        make_data("hook-put", 1000), 1000, 0, &err) == 0);
    CHECK(arrival_wait(&a, 1));
    CHECK(p2p_take(D, "hook-put", &t, &err) == 1 && holds(t, "hook-put", 1000));
    p2p_tensor_free(D, t);
    /* GET: the pulled tensor is announced the same way. */
    CHECK(p2p_offer(P, "hook-get", "uint8", 1, shape, make_data("hook-get", 1000), 1000, 0, &err) ==
          0);
    CHECK(p2p_fetch(D, p2p_address(P), "hook-get", 0, &err) == 0);
    CHECK(arrival_wait(&a, 2));
    t = NULL;
    CHECK(p2p_take(D, "hook-get", &t, &err) == 1 && holds(t, "hook-get", 1000));
    p2p_tensor_free(D, t);
    /* A pull that fails ("not found") is announced too, and take reports it. */
    CHECK(p2p_fetch(D, p2p_address(P), "hook-missing", 0, &err) == 0);
    CHECK(arrival_wait(&a, 3));
    t = NULL;
    CHECK(p2p_take(D, "hook-missing", &t, &err) == -1 && strstr(err.msg, "not found"));
    pthread_mutex_lock(&a.mu);
    CHECKF(a.calls >= 3, "hook called %d times", a.calls);
    pthread_mutex_unlock(&a.mu);
out:
    p2p_destroy(P);
    p2p_destroy(D);
    pthread_cond_destroy(&a.cv);
    pthread_mutex_destroy(&a.mu);
}

/* The tests that move tensors, run with one connection a peer and again
 * with several (streams). */
static void transfer_tests(void) {
    test_put_modes();
    test_many(1);
    test_many(2);
    test_threads();
    test_tiny_budget();
    test_dead_peer();
    test_consumer_dies();
    test_drop();
    test_destroy_in_flight();
    test_arrival_hook();
}

int main(void) {
    pd_log_set_level(PD_LOG_ERROR);
    if (getenv("P2P_TEST_DEBUG")) pd_log_set_level(PD_LOG_DEBUG);
    test_config();
    test_fingerprint();
    test_garbage();
    transfer_tests();
    streams = 3; /* tcp_streams */
    transfer_tests();
    return test_finish();
}
