/* registry: instances, expiry, backoff and round robin / least loaded
 * selection. See registry.h. One mutex guards the table; every operation
 * is a short scan of at most REG_MAX_SLOTS slots. */
#include "proxy/registry.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proxy/metrics.h"

typedef struct slot {
    px_role role;
    char http[REG_ADDR_MAX], kv[REG_ADDR_MAX];
    bool live, is_static;
    double expiry;        /* discovered: dead at or after this time */
    double backoff_until; /* avoided until then */
    int in_flight;
    uint64_t requests, errors;
    pxhist latency;
} slot;

struct registry {
    reg_config cfg;
    pthread_mutex_t mu;
    slot *slots;
    int n;
    unsigned rr[2]; /* round robin position per role */
};

const char *px_role_name(px_role role) {
    return role == ROLE_PREFILL ? "prefill" : "decode";
}

registry *registry_create(const reg_config *cfg) {
    registry *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->slots = calloc(REG_MAX_SLOTS, sizeof *r->slots);
    if (!r->slots) {
        free(r);
        return NULL;
    }
    r->cfg = *cfg;
    pthread_mutex_init(&r->mu, NULL);
    return r;
}

void registry_free(registry *r) {
    if (!r) return;
    pthread_mutex_destroy(&r->mu);
    free(r->slots);
    free(r);
}

int registry_check_addr(const char *addr, char out[REG_ADDR_MAX], pd_err *err) {
    if (!addr) return pd_fail(err, "missing address");
    const char *a = addr;
    if (!strncmp(a, "http://", 7)) a += 7;
    size_t n = strlen(a);
    if (n && a[n - 1] == '/') n--;
    if (n == 0 || n >= REG_ADDR_MAX) return pd_fail(err, "address '%.100s' is not host:port", addr);
    memcpy(out, a, n);
    out[n] = 0;
    for (size_t i = 0; i < n; i++)
        if (out[i] <= ' ' || out[i] == '/' || out[i] == '"' || out[i] == '\\' || out[i] == 0x7f)
            return pd_fail(err, "address '%.100s' is not host:port", addr);
    const char *colon = strrchr(out, ':');
    if (!colon || colon == out) return pd_fail(err, "address '%.100s' is not host:port", addr);
    if (out[0] == '[' && colon[-1] != ']')
        return pd_fail(err, "address '%.100s' is not [v6]:port", addr);
    if (out[0] != '[' && memchr(out, ':', (size_t)(colon - out)))
        return pd_fail(err, "address '%.100s': write an IPv6 host as [host]:port", addr);
    char *end = NULL;
    long port = strtol(colon + 1, &end, 10);
    if (end == colon + 1 || *end || port < 1 || port > 65535)
        return pd_fail(err, "address '%.100s' has no valid port", addr);
    return 0;
}

static slot *find(registry *r, px_role role, const char *http) {
    for (int i = 0; i < r->n; i++)
        if (r->slots[i].role == role && !strcmp(r->slots[i].http, http)) return &r->slots[i];
    return NULL;
}

static bool alive(const slot *s, double now) {
    return s->live && (s->is_static || s->expiry > now);
}

/* Take a slot for (role, http): the existing one or a new one. When the
 * table is full, an expired slot that no request holds (a pick holds its
 * id until release, counted in in_flight) is used again, so instances that
 * come and go (new addresses after restarts) never fill it for good. */
static slot *claim(registry *r, px_role role, const char *http, const char *kv) {
    slot *s = find(r, role, http);
    if (!s) {
        if (r->n < REG_MAX_SLOTS) {
            s = &r->slots[r->n++];
        } else {
            for (int i = 0; i < r->n && !s; i++)
                if (!r->slots[i].live && r->slots[i].in_flight == 0) s = &r->slots[i];
            if (!s) return NULL;
        }
        memset(s, 0, sizeof *s);
        s->role = role;
        snprintf(s->http, sizeof s->http, "%s", http);
    }
    snprintf(s->kv, sizeof s->kv, "%s", kv);
    return s;
}

int registry_add_static(registry *r, px_role role, const char *http, const char *kv, pd_err *err) {
    char h[REG_ADDR_MAX], k[REG_ADDR_MAX];
    if (registry_check_addr(http, h, err) != 0) return pd_wrap(err, "%s", px_role_name(role));
    if (kv && registry_check_addr(kv, k, err) != 0)
        return pd_wrap(err, "%s %s KV address", px_role_name(role), h);
    if (!kv) { /* the connector's default KV port on the same host */
        snprintf(k, sizeof k, "%.*s:14579", (int)(strrchr(h, ':') - h), h);
    }
    pthread_mutex_lock(&r->mu);
    slot *s = claim(r, role, h, k);
    if (s) {
        s->live = true;
        s->is_static = true;
    }
    pthread_mutex_unlock(&r->mu);
    return s ? 0 : pd_fail(err, "too many instances (at most %d)", REG_MAX_SLOTS);
}

int registry_announce(registry *r, px_role role, const char *http, const char *kv, double now) {
    pthread_mutex_lock(&r->mu);
    slot *s = find(r, role, http);
    bool was_alive = s && alive(s, now);
    bool moved = s && strcmp(s->kv, kv) != 0;
    s = claim(r, role, http, kv);
    int rc = -1;
    if (s) {
        rc = was_alive ? 0 : 1;
        s->live = true;
        if (!s->is_static) s->expiry = now + r->cfg.instance_timeout;
        if (rc == 1) s->backoff_until = 0; /* back from the dead: a fresh start */
    }
    pthread_mutex_unlock(&r->mu);
    if (rc == 1)
        pd_log(PD_LOG_INFO, "discovery: added %s instance http %s kv %s", px_role_name(role), http,
               kv);
    else if (rc == 0 && moved)
        pd_log(PD_LOG_INFO, "discovery: %s instance %s now has kv %s", px_role_name(role), http,
               kv);
    else if (rc < 0)
        pd_log(PD_LOG_WARN, "discovery: table full (%d instances); %s ignored", REG_MAX_SLOTS,
               http);
    return rc;
}

int registry_expire(registry *r, double now) {
    int removed = 0;
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->n; i++) {
        slot *s = &r->slots[i];
        if (!s->live || s->is_static || s->expiry > now) continue;
        s->live = false;
        removed++;
        pd_log(PD_LOG_INFO,
               "discovery: removed %s instance http %s kv %s (no announcement for %.1f s)",
               px_role_name(s->role), s->http, s->kv, r->cfg.instance_timeout);
    }
    pthread_mutex_unlock(&r->mu);
    return removed;
}

static bool excluded(int id, const int *ex, int n) {
    for (int i = 0; i < n; i++)
        if (ex[i] == id) return true;
    return false;
}

int registry_pick(registry *r, px_role role, const int *exclude, int n_exclude, double now,
                  reg_pick *out) {
    pthread_mutex_lock(&r->mu);
    /* Candidates in slot order; those in backoff only when nothing else is left. */
    int best = -1;
    for (int pass = 0; pass < 2 && best < 0; pass++) {
        int cand[REG_MAX_SLOTS], nc = 0;
        for (int i = 0; i < r->n; i++) {
            slot *s = &r->slots[i];
            if (s->role != role || !alive(s, now) || excluded(i, exclude, n_exclude)) continue;
            if (pass == 0 && s->backoff_until > now) continue;
            cand[nc++] = i;
        }
        if (!nc) continue;
        unsigned start = r->rr[role]++ % (unsigned)nc;
        best = cand[start];
        if (r->cfg.least_loaded)
            for (int k = 1; k < nc; k++) {
                int c = cand[(start + (unsigned)k) % (unsigned)nc];
                if (r->slots[c].in_flight < r->slots[best].in_flight) best = c;
            }
    }
    if (best >= 0) {
        slot *s = &r->slots[best];
        s->in_flight++;
        out->id = best;
        snprintf(out->http, sizeof out->http, "%s", s->http);
        snprintf(out->kv, sizeof out->kv, "%s", s->kv);
    }
    pthread_mutex_unlock(&r->mu);
    return best >= 0 ? 0 : -1;
}

void registry_release(registry *r, int id, double seconds, bool failed, double now) {
    pthread_mutex_lock(&r->mu);
    if (id >= 0 && id < r->n) {
        slot *s = &r->slots[id];
        if (s->in_flight > 0) s->in_flight--;
        s->requests++;
        if (seconds >= 0) pxhist_observe(&s->latency, seconds);
        if (failed) {
            s->errors++;
            s->backoff_until = now + r->cfg.failure_backoff;
        }
    }
    pthread_mutex_unlock(&r->mu);
}

void registry_unpick(registry *r, int id) {
    pthread_mutex_lock(&r->mu);
    if (id >= 0 && id < r->n && r->slots[id].in_flight > 0) r->slots[id].in_flight--;
    pthread_mutex_unlock(&r->mu);
}

int registry_size(registry *r) {
    pthread_mutex_lock(&r->mu);
    int n = 0;
    for (int i = 0; i < r->n; i++) n += r->slots[i].live;
    pthread_mutex_unlock(&r->mu);
    return n;
}

int registry_live(registry *r, px_role role, double now) {
    int n = 0;
    pthread_mutex_lock(&r->mu);
    for (int i = 0; i < r->n; i++)
        if (r->slots[i].role == role && alive(&r->slots[i], now)) n++;
    pthread_mutex_unlock(&r->mu);
    return n;
}

void registry_json(registry *r, double now, pd_buf *b) {
    pthread_mutex_lock(&r->mu);
    for (int role = 0; role < 2; role++) {
        pd_buf_printf(b, "%s\"%s\":[", role ? "," : "", px_role_name((px_role)role));
        int k = 0;
        for (int i = 0; i < r->n; i++) {
            slot *s = &r->slots[i];
            if ((int)s->role != role || !alive(s, now)) continue;
            pd_buf_puts(b, k++ ? ",{\"http_address\":" : "{\"http_address\":");
            pd_buf_json_str(b, s->http);
            pd_buf_puts(b, ",\"zmq_address\":");
            pd_buf_json_str(b, s->kv);
            pd_buf_printf(b, ",\"static\":%s,\"in_flight\":%d,\"backoff\":%s}",
                          s->is_static ? "true" : "false", s->in_flight,
                          s->backoff_until > now ? "true" : "false");
        }
        pd_buf_puts(b, "]");
    }
    pthread_mutex_unlock(&r->mu);
}

void registry_metrics(registry *r, double now, pd_buf *b) {
    pthread_mutex_lock(&r->mu);
    pd_buf_puts(b, "# HELP pdproxy_instances Live instances by role.\n"
                   "# TYPE pdproxy_instances gauge\n");
    for (int role = 0; role < 2; role++) {
        int n = 0;
        for (int i = 0; i < r->n; i++)
            if ((int)r->slots[i].role == role && alive(&r->slots[i], now)) n++;
        pd_buf_printf(b, "pdproxy_instances{role=\"%s\"} %d\n", px_role_name((px_role)role), n);
    }
    static const char *names[3] = {"pdproxy_instance_requests_total",
                                   "pdproxy_instance_errors_total", "pdproxy_instance_in_flight"};
    static const char *helps[3] = {"Requests sent to the instance.",
                                   "Requests the instance failed (connect error, 5xx, timeout).",
                                   "Requests in flight on the instance."};
    for (int m = 0; m < 3; m++) {
        pd_buf_printf(b, "# HELP %s %s\n# TYPE %s %s\n", names[m], helps[m], names[m],
                      m == 2 ? "gauge" : "counter");
        for (int i = 0; i < r->n; i++) {
            slot *s = &r->slots[i];
            unsigned long long v = m == 0   ? s->requests
                                   : m == 1 ? s->errors
                                            : (unsigned long long)s->in_flight;
            pd_buf_printf(b, "%s{role=\"%s\",instance=\"%s\"} %llu\n", names[m],
                          px_role_name(s->role), s->http, v);
        }
    }
    pd_buf_puts(b, "# HELP pdproxy_instance_latency_seconds Time of one hop to the instance "
                   "(prefill: the whole answer; decode: until its last byte).\n"
                   "# TYPE pdproxy_instance_latency_seconds histogram\n");
    for (int i = 0; i < r->n; i++) {
        char lab[REG_ADDR_MAX + 48];
        snprintf(lab, sizeof lab, "role=\"%s\",instance=\"%s\"", px_role_name(r->slots[i].role),
                 r->slots[i].http);
        pxhist_render(b, "pdproxy_instance_latency_seconds", lab, &r->slots[i].latency);
    }
    pthread_mutex_unlock(&r->mu);
}
