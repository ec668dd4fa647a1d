/* announce: the discovery announcer of a kv instance. See announce.h.
 * The thread sends, then sleeps on a condition variable so announcer_stop
 * wakes it at once instead of waiting out the interval. */
#include "connector/announce.h"

#include <errno.h>
#include <msgpack.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

struct announcer {
    char *endpoint; /* tcp://proxy_ip:proxy_port */
    char *http_address, *zmq_address;
    bool prefill, decode;
    int interval_ms;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stop;
    void *zctx;
};

int announce_encode(const char *type, const char *http_address, const char *zmq_address, char **buf,
                    size_t *len, pd_err *err) {
    msgpack_sbuffer sb;
    msgpack_sbuffer_init(&sb);
    msgpack_packer pk;
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    const char *kv[6] = {"type", type, "http_address", http_address, "zmq_address", zmq_address};
    int rc = msgpack_pack_map(&pk, 3);
    for (int i = 0; i < 6 && rc == 0; i++) {
        size_t n = strlen(kv[i]);
        rc = msgpack_pack_str(&pk, n);
        if (rc == 0) rc = msgpack_pack_str_body(&pk, kv[i], n);
    }
    if (rc != 0 || !sb.data) {
        msgpack_sbuffer_destroy(&sb);
        return pd_fail(err, "announce: out of memory encoding the message");
    }
    *len = sb.size;
    *buf = msgpack_sbuffer_release(&sb);
    return 0;
}

static void send_one(void *sock, const char *type, const announcer *a) {
    char *buf = NULL;
    size_t len = 0;
    pd_err err;
    if (announce_encode(type, a->http_address, a->zmq_address, &buf, &len, &err) != 0) {
        pd_log(PD_LOG_WARN, "%s", err.msg);
        return;
    }
    /* Never block: with no proxy listening the message is simply dropped
     * once the small queue is full; the next round tries again. */
    if (zmq_send(sock, buf, len, ZMQ_DONTWAIT) < 0 && errno != EAGAIN)
        pd_log(PD_LOG_DEBUG, "announce: send to %s: %s", a->endpoint, zmq_strerror(errno));
    free(buf);
}

static void *announce_main(void *arg) {
    announcer *a = arg;
    void *sock = zmq_socket(a->zctx, ZMQ_DEALER);
    if (!sock) {
        pd_log(PD_LOG_ERROR, "announce: cannot create a ZMQ socket: %s", zmq_strerror(errno));
        return NULL;
    }
    int linger = 0, hwm = 8;
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(sock, ZMQ_SNDHWM, &hwm, sizeof hwm);
    if (zmq_connect(sock, a->endpoint) != 0) {
        pd_log(PD_LOG_ERROR, "announce: cannot connect to %s: %s", a->endpoint,
               zmq_strerror(errno));
        zmq_close(sock);
        return NULL;
    }
    pd_log(PD_LOG_INFO, "announce: %s%s%s http %s kv %s to %s every %d ms", a->prefill ? "P" : "",
           a->prefill && a->decode ? "+" : "", a->decode ? "D" : "", a->http_address,
           a->zmq_address, a->endpoint, a->interval_ms);
    pthread_mutex_lock(&a->mu);
    while (!a->stop) {
        pthread_mutex_unlock(&a->mu);
        if (a->prefill) send_one(sock, "P", a);
        if (a->decode) send_one(sock, "D", a);
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        long long ns = ts.tv_nsec + (long long)a->interval_ms * 1000000LL;
        ts.tv_sec += (time_t)(ns / 1000000000LL);
        ts.tv_nsec = (long)(ns % 1000000000LL);
        pthread_mutex_lock(&a->mu);
        while (!a->stop && pthread_cond_timedwait(&a->cv, &a->mu, &ts) != ETIMEDOUT) {
        }
    }
    pthread_mutex_unlock(&a->mu);
    zmq_close(sock);
    return NULL;
}

static void announcer_free(announcer *a) {
    if (!a) return;
    if (a->zctx) zmq_ctx_term(a->zctx);
    pthread_cond_destroy(&a->cv);
    pthread_mutex_destroy(&a->mu);
    free(a->endpoint);
    free(a->http_address);
    free(a->zmq_address);
    free(a);
}

int announcer_start(const announce_config *cfg, announcer **out, pd_err *err) {
    *out = NULL;
    if (!cfg->proxy_ip || !cfg->proxy_ip[0] || cfg->proxy_port < 1 || cfg->proxy_port > 65535)
        return pd_fail(err, "announce: proxy address %s:%d is not valid",
                       cfg->proxy_ip ? cfg->proxy_ip : "(none)", cfg->proxy_port);
    if (!cfg->prefill && !cfg->decode) return pd_fail(err, "announce: no role to announce");
    announcer *a = calloc(1, sizeof *a);
    if (!a) return pd_fail(err, "out of memory");
    pthread_mutex_init(&a->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&a->cv, &ca);
    pthread_condattr_destroy(&ca);
    size_t n = strlen(cfg->proxy_ip) + 32;
    a->endpoint = malloc(n);
    a->http_address = strdup(cfg->http_address ? cfg->http_address : "");
    a->zmq_address = strdup(cfg->zmq_address ? cfg->zmq_address : "");
    a->prefill = cfg->prefill;
    a->decode = cfg->decode;
    a->interval_ms = cfg->interval_ms > 0 ? cfg->interval_ms : ANNOUNCE_DEFAULT_INTERVAL_MS;
    a->zctx = zmq_ctx_new();
    if (!a->endpoint || !a->http_address || !a->zmq_address || !a->zctx) {
        announcer_free(a);
        return pd_fail(err, "announce: out of memory or no ZMQ context");
    }
    /* An IPv6 literal needs brackets in a ZMQ endpoint. */
    bool v6 = strchr(cfg->proxy_ip, ':') != NULL;
    snprintf(a->endpoint, n, v6 ? "tcp://[%s]:%d" : "tcp://%s:%d", cfg->proxy_ip, cfg->proxy_port);
    if (pthread_create(&a->thread, NULL, announce_main, a) != 0) {
        announcer_free(a);
        return pd_fail(err, "announce: cannot start the thread");
    }
    *out = a;
    return 0;
}

void announcer_stop(announcer *a) {
    if (!a) return;
    pthread_mutex_lock(&a->mu);
    a->stop = true;
    pthread_cond_signal(&a->cv);
    pthread_mutex_unlock(&a->mu);
    pthread_join(a->thread, NULL);
    announcer_free(a);
}

/* ---- for a connector instance ------------------------------------------ */

static bool specific_host(const char *h) {
    return h && h[0] && strcmp(h, "0.0.0.0") && strcmp(h, "::");
}

int announcer_start_for_instance(const kv_transfer_config *kv, const char *kv_address, const char *host,
                                 int http_port, announcer **out, pd_err *err) {
    *out = NULL;
    if (!kv->proxy_ip[0]) { /* no proxy: nothing to announce */
        if (kv->proxy_port > 0)
            pd_log(PD_LOG_WARN,
                   "kv_connector_extra_config has proxy_port %d but no proxy_ip: "
                   "this instance announces itself to no proxy",
                   kv->proxy_port);
        return 0;
    }
    announce_config c = {
        .proxy_ip = kv->proxy_ip,
        .proxy_port = kv->proxy_port,
        .prefill = kv->role != KV_ROLE_CONSUMER,
        .decode = kv->role != KV_ROLE_PRODUCER,
        .zmq_address = kv_address,
        .interval_ms = (int)(kv->announce_interval_s * 1000),
    };
    /* The HTTP address: a specific --host is where the server listens;
     * otherwise the address the KV side advertises. */
    const char *colon = strrchr(kv_address, ':');
    char http_addr[160], kv_host[128];
    snprintf(kv_host, sizeof kv_host, "%.*s", colon ? (int)(colon - kv_address) : (int)strlen(kv_address),
             kv_address);
    snprintf(http_addr, sizeof http_addr, "%s:%d", specific_host(host) ? host : kv_host,
             kv->http_port ? kv->http_port : http_port);
    c.http_address = http_addr;
    const char *iv = getenv("PDSERVE_ANNOUNCE_INTERVAL_MS"); /* tests shorten the interval */
    if (iv) c.interval_ms = atoi(iv);
    return announcer_start(&c, out, err);
}
