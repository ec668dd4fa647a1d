/* announce: the discovery announcer of a kv instance. See announce.h.
 * The thread sends, then sleeps on a condition variable so announcer_stop
 * wakes it at once instead of waiting out the interval. */
#include "connector/announce.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <errno.h>
#include <ifaddrs.h>
#include <msgpack.h>
#include <net/if.h>
#include <netinet/in.h>
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

/* ---- from --kv-transfer-config ------------------------------------------ */

/* A port given as a number or a numeric string; 0 when absent. */
static int json_port(const cJSON *obj, const char *key, int *out, pd_err *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    *out = 0;
    if (!v || cJSON_IsNull(v)) return 0;
    long p = -1;
    if (cJSON_IsNumber(v)) {
        p = (long)v->valuedouble;
        if ((double)p != v->valuedouble) p = -1;
    } else if (cJSON_IsString(v)) {
        char *end = NULL;
        p = strtol(v->valuestring, &end, 10);
        if (end == v->valuestring || *end) p = -1;
    }
    if (p < 1 || p > 65535)
        return pd_fail(err, "--kv-transfer-config: %s must be a port number in [1, 65535]", key);
    *out = (int)p;
    return 0;
}

/* The first non-loopback IPv4 address of this host, else 127.0.0.1. */
static void first_address(char *out, size_t cap) {
    snprintf(out, cap, "127.0.0.1");
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs) != 0) return;
    for (struct ifaddrs *i = ifs; i; i = i->ifa_next) {
        if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || (i->ifa_flags & IFF_LOOPBACK) ||
            !(i->ifa_flags & IFF_UP))
            continue;
        inet_ntop(AF_INET, &((struct sockaddr_in *)i->ifa_addr)->sin_addr, out, (socklen_t)cap);
        break;
    }
    freeifaddrs(ifs);
}

static bool specific_host(const char *h) {
    return h && h[0] && strcmp(h, "0.0.0.0") && strcmp(h, "::");
}

int announcer_start_from_kv_config(const char *kv_json, const char *host, int http_port,
                                   announcer **out, pd_err *err) {
    *out = NULL;
    cJSON *root = cJSON_Parse(kv_json);
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return pd_fail(err, "--kv-transfer-config: not a JSON object");
    }
    int rc = 0;
    const cJSON *extra = cJSON_GetObjectItemCaseSensitive(root, "kv_connector_extra_config");
    const cJSON *pip =
        cJSON_IsObject(extra) ? cJSON_GetObjectItemCaseSensitive(extra, "proxy_ip") : NULL;
    int proxy_port = 0, adv_http = 0, kv_port = 0;
    if (!cJSON_IsObject(extra) || !pip) goto done; /* no proxy: nothing to announce */
    if (!cJSON_IsString(pip) || !pip->valuestring[0]) {
        rc = pd_fail(err, "--kv-transfer-config: proxy_ip must be a non-empty string");
        goto done;
    }
    if (json_port(extra, "proxy_port", &proxy_port, err) != 0 ||
        json_port(extra, "http_port", &adv_http, err) != 0 ||
        json_port(root, "kv_port", &kv_port, err) != 0) {
        rc = -1;
        goto done;
    }
    if (!proxy_port) {
        rc = pd_fail(err, "--kv-transfer-config: proxy_ip is set but proxy_port is missing");
        goto done;
    }
    const cJSON *role = cJSON_GetObjectItemCaseSensitive(root, "kv_role");
    const char *r = cJSON_IsString(role) ? role->valuestring : "";
    announce_config c = {
        .proxy_ip = pip->valuestring,
        .proxy_port = proxy_port,
        .prefill = !strcmp(r, "kv_producer") || !strcmp(r, "kv_both"),
        .decode = !strcmp(r, "kv_consumer") || !strcmp(r, "kv_both"),
    };
    if (!c.prefill && !c.decode) {
        rc = pd_fail(err, "--kv-transfer-config: kv_role '%s' cannot be announced", r);
        goto done;
    }
    /* The advertised addresses: kv_ip when given; the HTTP side prefers a
     * specific --host (that is where the server listens). */
    const cJSON *kvip = cJSON_GetObjectItemCaseSensitive(root, "kv_ip");
    char auto_ip[64], http_addr[128], zmq_addr[128];
    first_address(auto_ip, sizeof auto_ip);
    const char *kv_host = cJSON_IsString(kvip) && kvip->valuestring[0] ? kvip->valuestring
                          : specific_host(host)                        ? host
                                                                       : auto_ip;
    const char *http_host = specific_host(host) ? host : kv_host;
    snprintf(http_addr, sizeof http_addr, "%s:%d", http_host, adv_http ? adv_http : http_port);
    snprintf(zmq_addr, sizeof zmq_addr, "%s:%d", kv_host,
             kv_port ? kv_port : ANNOUNCE_DEFAULT_KV_PORT);
    c.http_address = http_addr;
    c.zmq_address = zmq_addr;
    const char *iv = getenv("PDSERVE_ANNOUNCE_INTERVAL_MS"); /* tests shorten the interval */
    if (iv) c.interval_ms = atoi(iv);
    rc = announcer_start(&c, out, err);
done:
    cJSON_Delete(root);
    return rc;
}
