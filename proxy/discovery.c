/* discovery: ZMQ ROUTER thread and message decoding. See discovery.h. */
#include "proxy/discovery.h"

#include <errno.h>
#include <msgpack.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

struct discovery {
    registry *reg;
    void *zctx, *sock;
    int port;
    pthread_t thread;
    atomic_bool stop;
    atomic_ullong accepted, rejected;
};

/* A msgpack string (or bin, which some encoders use for str) as C text. */
static int obj_text(const msgpack_object *o, char *out, size_t cap) {
    const char *p;
    size_t n;
    if (o->type == MSGPACK_OBJECT_STR) {
        p = o->via.str.ptr;
        n = o->via.str.size;
    } else if (o->type == MSGPACK_OBJECT_BIN) {
        p = o->via.bin.ptr;
        n = o->via.bin.size;
    } else {
        return -1;
    }
    if (n >= cap || memchr(p, 0, n)) return -1;
    memcpy(out, p, n);
    out[n] = 0;
    return 0;
}

int discovery_decode(const void *buf, size_t len, disc_msg *out, pd_err *err) {
    msgpack_unpacked u;
    msgpack_unpacked_init(&u);
    size_t off = 0;
    int rc = -1;
    if (msgpack_unpack_next(&u, buf, len, &off) != MSGPACK_UNPACK_SUCCESS) {
        pd_fail(err, "not a msgpack value (%zu bytes)", len);
        goto done;
    }
    if (off != len) {
        pd_fail(err, "%zu bytes after the msgpack value", len - off);
        goto done;
    }
    if (u.data.type != MSGPACK_OBJECT_MAP) {
        pd_fail(err, "not a msgpack map");
        goto done;
    }
    char type[8] = "", http[REG_ADDR_MAX] = "", kv[REG_ADDR_MAX] = "";
    bool have[3] = {false, false, false};
    const msgpack_object_map *m = &u.data.via.map;
    for (uint32_t i = 0; i < m->size; i++) {
        char key[32];
        if (obj_text(&m->ptr[i].key, key, sizeof key) != 0) continue; /* odd keys: ignored */
        const msgpack_object *v = &m->ptr[i].val;
        int k = !strcmp(key, "type")           ? 0
                : !strcmp(key, "http_address") ? 1
                : !strcmp(key, "zmq_address")  ? 2
                                               : -1;
        if (k < 0) continue; /* unknown keys: room for later fields */
        char *dst = k == 0 ? type : k == 1 ? http : kv;
        size_t cap = k == 0 ? sizeof type : REG_ADDR_MAX;
        if (obj_text(v, dst, cap) != 0) {
            pd_fail(err, "%s is not a short string", key);
            goto done;
        }
        have[k] = true;
    }
    if (!have[0] || !have[1] || !have[2]) {
        pd_fail(err, "missing %s", !have[0] ? "type" : !have[1] ? "http_address" : "zmq_address");
        goto done;
    }
    if (!strcmp(type, "P"))
        out->role = ROLE_PREFILL;
    else if (!strcmp(type, "D"))
        out->role = ROLE_DECODE;
    else {
        pd_fail(err, "unknown type '%s' (expected P or D)", type);
        goto done;
    }
    if (registry_check_addr(http, out->http, err) != 0) {
        pd_wrap(err, "http_address");
        goto done;
    }
    if (registry_check_addr(kv, out->kv, err) != 0) {
        pd_wrap(err, "zmq_address");
        goto done;
    }
    rc = 0;
done:
    msgpack_unpacked_destroy(&u);
    return rc;
}

static void handle(discovery *d, const void *payload, size_t len) {
    disc_msg m;
    pd_err err;
    if (discovery_decode(payload, len, &m, &err) != 0) {
        atomic_fetch_add(&d->rejected, 1);
        pd_log(PD_LOG_WARN, "discovery: ignored a bad announcement: %s", err.msg);
        return;
    }
    atomic_fetch_add(&d->accepted, 1);
    registry_announce(d->reg, m.role, m.http, m.kv, pd_now());
}

static void *discovery_main(void *arg) {
    discovery *d = arg;
    zmq_msg_t part;
    while (!atomic_load(&d->stop)) {
        zmq_pollitem_t it = {d->sock, 0, ZMQ_POLLIN, 0};
        int n = zmq_poll(&it, 1, 100);
        registry_expire(d->reg, pd_now());
        if (n <= 0) continue;
        /* Read every part; the payload is the last one (a DEALER sends
         * [payload], a REQ [empty, payload]; the ROUTER adds the identity). */
        char *last = NULL;
        size_t last_len = 0;
        int parts = 0;
        for (;;) {
            zmq_msg_init(&part);
            if (zmq_msg_recv(&part, d->sock, ZMQ_DONTWAIT) < 0) {
                zmq_msg_close(&part);
                break;
            }
            parts++;
            free(last);
            last_len = zmq_msg_size(&part);
            last = malloc(last_len ? last_len : 1);
            if (last) memcpy(last, zmq_msg_data(&part), last_len);
            bool more = zmq_msg_more(&part);
            zmq_msg_close(&part);
            if (!more) break;
        }
        if (parts >= 2 && last)
            handle(d, last, last_len);
        else if (parts) {
            atomic_fetch_add(&d->rejected, 1);
            pd_log(PD_LOG_WARN, "discovery: ignored a message without a payload");
        }
        free(last);
    }
    return NULL;
}

int discovery_start(registry *reg, const char *host, int port, discovery **out, pd_err *err) {
    *out = NULL;
    discovery *d = calloc(1, sizeof *d);
    if (!d) return pd_fail(err, "out of memory");
    d->reg = reg;
    d->zctx = zmq_ctx_new();
    d->sock = d->zctx ? zmq_socket(d->zctx, ZMQ_ROUTER) : NULL;
    if (!d->sock) {
        if (d->zctx) zmq_ctx_term(d->zctx);
        free(d);
        return pd_fail(err, "discovery: cannot create a ZMQ socket");
    }
    int linger = 0;
    zmq_setsockopt(d->sock, ZMQ_LINGER, &linger, sizeof linger);
    char ep[160];
    const char *h = host && host[0] ? host : "*";
    bool v6 = strchr(h, ':') != NULL;
    if (port)
        snprintf(ep, sizeof ep, v6 ? "tcp://[%s]:%d" : "tcp://%s:%d", h, port);
    else
        snprintf(ep, sizeof ep, v6 ? "tcp://[%s]:*" : "tcp://%s:*", h);
    if (v6) {
        int on = 1;
        zmq_setsockopt(d->sock, ZMQ_IPV6, &on, sizeof on);
    }
    if (zmq_bind(d->sock, ep) != 0) {
        int e = errno;
        zmq_close(d->sock);
        zmq_ctx_term(d->zctx);
        free(d);
        return pd_fail(err, "discovery: cannot bind %s: %s", ep, zmq_strerror(e));
    }
    char last[160];
    size_t ll = sizeof last;
    d->port = port;
    if (zmq_getsockopt(d->sock, ZMQ_LAST_ENDPOINT, last, &ll) == 0) {
        const char *c = strrchr(last, ':');
        if (c) d->port = atoi(c + 1);
    }
    if (pthread_create(&d->thread, NULL, discovery_main, d) != 0) {
        zmq_close(d->sock);
        zmq_ctx_term(d->zctx);
        free(d);
        return pd_fail(err, "discovery: cannot start the thread");
    }
    *out = d;
    return 0;
}

int discovery_port(const discovery *d) {
    return d->port;
}

void discovery_counts(discovery *d, unsigned long long *accepted, unsigned long long *rejected) {
    *accepted = atomic_load(&d->accepted);
    *rejected = atomic_load(&d->rejected);
}

void discovery_stop(discovery *d) {
    if (!d) return;
    atomic_store(&d->stop, true);
    pthread_join(d->thread, NULL);
    zmq_close(d->sock);
    zmq_ctx_term(d->zctx);
    free(d);
}
