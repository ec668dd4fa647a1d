/* front: the proxy's HTTP server core — routing, auth, /health and
 * /metrics, shutdown, on the libmicrohttpd plumbing in common/pd_httpd.
 * See front.h. */
#include "proxy/front.h"

#include <microhttpd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "common/pd_buf.h"
#include "common/pd_httpd.h"
#include "proxy/rewrite.h"

struct front {
    front_ctx ctx;
    pd_httpd httpd;
};

void front_reply_body(front_reply *r, unsigned status, const char *content_type, char *body,
                      size_t len) {
    r->status = status;
    r->resp =
        MHD_create_response_from_buffer(body ? len : 0, body ? body : (char *)"",
                                        body ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_PERSISTENT);
    if (!r->resp) {
        free(body);
        r->close = true;
        return;
    }
    if (content_type) MHD_add_response_header(r->resp, "Content-Type", content_type);
}

void front_reply_error(front_reply *r, int status, const char *fmt, ...) {
    char msg[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    size_t len = 0;
    char *body = rewrite_error_json(status, msg, &len);
    front_reply_body(r, (unsigned)status, "application/json", body, len);
}

/* Compare in time that depends only on the key's length. */
static bool key_equal(const char *given, const char *key) {
    size_t n = strlen(key), g = strlen(given);
    unsigned diff = (unsigned)(g != n);
    for (size_t i = 0; i < n; i++)
        diff |= (unsigned char)key[i] ^ (unsigned char)(i < g ? given[i] : 0);
    return diff == 0;
}

static bool authorized(const front_ctx *fx, struct MHD_Connection *conn, const char *url) {
    if (!fx->cfg.api_key || strncmp(url, "/v1", 3) != 0) return true;
    const char *h = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Authorization");
    if (!h || strncasecmp(h, "Bearer ", 7) != 0) return false;
    return key_equal(h + 7, fx->cfg.api_key);
}

static void do_health(front_ctx *fx, front_reply *out) {
    double now = pd_now();
    int np = registry_live(fx->reg, ROLE_PREFILL, now),
        nd = registry_live(fx->reg, ROLE_DECODE, now);
    const bool draining = atomic_load(&fx->draining), ok = np && nd && !draining;
    pd_buf b;
    pd_buf_init(&b);
    pd_buf_printf(&b, "{\"status\":\"%s\",", draining ? "draining" : ok ? "ok" : "unavailable");
    registry_json(fx->reg, now, &b);
    if (fx->disc) {
        unsigned long long acc, rej;
        discovery_counts(fx->disc, &acc, &rej);
        pd_buf_printf(&b, ",\"discovery\":{\"port\":%d,\"accepted\":%llu,\"rejected\":%llu}",
                      discovery_port(fx->disc), acc, rej);
    }
    pd_buf_puts(&b, "}");
    size_t len = 0;
    char *body = pd_buf_take(&b, &len);
    front_reply_body(out, ok ? 200 : 503, "application/json", body, len);
}

static void do_metrics(front_ctx *fx, front_reply *out) {
    pd_buf b;
    pd_buf_init(&b);
    pxm_render(fx->pm, &b);
    registry_metrics(fx->reg, pd_now(), &b);
    if (fx->disc) {
        unsigned long long acc, rej;
        discovery_counts(fx->disc, &acc, &rej);
        pd_buf_printf(&b,
                      "# HELP pdproxy_discovery_messages_total Announcements received.\n"
                      "# TYPE pdproxy_discovery_messages_total counter\n"
                      "pdproxy_discovery_messages_total{result=\"accepted\"} %llu\n"
                      "pdproxy_discovery_messages_total{result=\"rejected\"} %llu\n",
                      acc, rej);
    }
    size_t len = 0;
    char *body = pd_buf_take(&b, &len);
    front_reply_body(out, 200, "text/plain; version=0.0.4; charset=utf-8", body, len);
}

static bool is_json_type(const char *ct) {
    if (!ct) return false;
    while (*ct == ' ')
        ct++;
    size_t n = strlen("application/json");
    return strncasecmp(ct, "application/json", n) == 0 &&
           (ct[n] == 0 || ct[n] == ';' || ct[n] == ' ');
}

/* The door of a completion request: what it must pass before it goes
 * upstream. false: refused, and out holds the error reply. */
static bool completion_admitted(front_ctx *fx, struct MHD_Connection *conn, const char *url,
                                bool post, const pd_httpd_body *bs, front_reply *out) {
    if (!authorized(fx, conn, url)) {
        front_reply_error(out, 401, "Unauthorized");
    } else if (!post) {
        front_reply_error(out, 405, "Method Not Allowed");
        if (out->resp) MHD_add_response_header(out->resp, "Allow", "POST");
    } else if (bs->too_large) {
        front_reply_error(out, 413, "the request body is larger than %zu bytes",
                          fx->cfg.max_body_bytes);
    } else if (!is_json_type(MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Type"))) {
        front_reply_error(out, 400, "Unsupported Media Type: Only 'application/json' is allowed");
    } else if (bs->body.oom) {
        front_reply_error(out, 500, "out of memory");
    } else if (atomic_load(&fx->draining)) {
        /* A keep-alive client would otherwise be served on and on until
         * the drain's end cut it off; closing sends it elsewhere. */
        front_reply_error(out, 503, "pdproxy is shutting down");
        if (out->resp) MHD_add_response_header(out->resp, "Connection", "close");
    } else {
        return true;
    }
    return false;
}

static void dispatch(front *f, struct MHD_Connection *conn, const char *url, const char *method,
                     pd_httpd_body *bs, front_reply *out) {
    front_ctx *fx = &f->ctx;
    bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    bool gen = !strcmp(url, "/v1/completions") || !strcmp(url, "/v1/chat/completions");
    if (gen) {
        if (completion_admitted(fx, conn, url, !strcmp(method, "POST"), bs, out))
            return flow_generate(fx, conn, url, bs->body.data ? bs->body.data : "", bs->body.len,
                                 out);
        /* Refused at the door, it still counts in pdproxy_requests_total
         * (a dashboard sees a client sending 401s), not in the latency
         * histograms. */
        return pxm_refused(fx->pm, (int)out->status);
    }
    if (!authorized(fx, conn, url)) return front_reply_error(out, 401, "Unauthorized");
    static const char *gets[] = {"/v1/models", "/health", "/ping", "/metrics"};
    for (size_t i = 0; i < sizeof gets / sizeof gets[0]; i++) {
        if (strcmp(url, gets[i])) continue;
        if (!get) {
            front_reply_error(out, 405, "Method Not Allowed");
            if (out->resp) MHD_add_response_header(out->resp, "Allow", "GET");
            return;
        }
        if (i == 0) return flow_models(fx, conn, out);
        if (i == 3) return do_metrics(fx, out);
        return do_health(fx, out);
    }
    front_reply_error(out, 404, "Not Found");
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_size, void **con_cls) {
    (void)version;
    front *f = cls;
    pd_httpd_body *bs = NULL;
    int got = pd_httpd_body_read(con_cls, upload_data, upload_size, f->ctx.cfg.max_body_bytes, &bs);
    if (got <= 0) return got == 0 ? MHD_YES : MHD_NO;
    /* Counted until on_completed, when MHD has written the answer's last
     * byte (a stream's too) or given up: a drain waits for all of it. */
    atomic_fetch_add(&f->ctx.active, 1);
    bs->answering = true;
    front_reply out = {0};
    dispatch(f, conn, url, method, bs, &out);
    return pd_httpd_send(conn, out.status, out.resp, out.close);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    front *f = cls;
    (void)conn;
    (void)toe;
    const pd_httpd_body *bs = con_cls ? *con_cls : NULL;
    if (bs && bs->answering) atomic_fetch_sub(&f->ctx.active, 1);
    pd_httpd_body_free(con_cls);
}

int front_start(const front_config *cfg, registry *reg, upstream_pool *pool, proxy_metrics *pm,
                discovery *disc, front **out, pd_err *err) {
    *out = NULL;
    front *f = calloc(1, sizeof *f);
    if (!f) return pd_fail(err, "out of memory");
    f->ctx.cfg = *cfg;
    f->ctx.reg = reg;
    f->ctx.pool = pool;
    f->ctx.pm = pm;
    f->ctx.disc = disc;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    f->ctx.id_salt =
        ((uint64_t)ts.tv_sec << 32) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 16);
    /* The idle timeout must outlast the longest request: a streamed answer
     * can be quiet between tokens. */
    unsigned idle = (unsigned)(cfg->timeout + 30);
    if (pd_httpd_start(&f->httpd, cfg->host, cfg->port, idle, on_request, f, on_completed, err)) {
        free(f);
        return -1;
    }
    *out = f;
    return 0;
}

int front_port(const front *f) {
    return f->httpd.port;
}

void front_quiesce(front *f) {
    atomic_store(&f->ctx.draining, true);
    pd_httpd_quiesce(&f->httpd);
}

int front_active(front *f) {
    return atomic_load(&f->ctx.active);
}

void front_stop(front *f) {
    if (!f) return;
    atomic_store(&f->ctx.hard_stop, true);
    pd_httpd_stop(&f->httpd);
    free(f);
}
