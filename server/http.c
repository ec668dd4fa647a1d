/* http: pdserve's HTTP server core — routing, the API key check, error
 * replies and shutdown, on the libmicrohttpd plumbing in common/pd_httpd.
 * See http.h. */
#include "server/http.h"

#include <microhttpd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "common/pd_httpd.h"
#include "server/api_json.h"

struct http_server {
    http_ctx ctx;
    pd_httpd httpd;
};

typedef void (*handler_fn)(http_request *, http_reply *);

typedef struct route {
    const char *path, *method;
    handler_fn fn;
} route;

static const route routes[] = {
    {"/v1/completions", "POST", api_completions},
    {"/v1/chat/completions", "POST", api_chat_completions},
    {"/v1/models", "GET", api_models},
    {"/health", "GET", api_health},
    {"/ping", "GET", api_health},
    {"/version", "GET", api_version},
    {"/tokenize", "POST", api_tokenize},
    {"/detokenize", "POST", api_detokenize},
    {"/metrics", "GET", api_metrics},
};
#define N_ROUTES ((int)(sizeof routes / sizeof routes[0]))

/* ---- replies ------------------------------------------------------------ */

void http_reply_body(http_reply *r, unsigned status, const char *content_type, char *body,
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

void http_reply_error(http_reply *r, const api_error *e) {
    size_t len;
    char *body = api_error_json(e, &len);
    http_reply_body(r, (unsigned)e->status, "application/json", body, len);
    if (e->status == 405 && r->resp) MHD_add_response_header(r->resp, "Allow", e->param);
}

static void reply_simple_error(http_reply *r, int status, const char *msg) {
    api_error e;
    api_fail(&e, status, NULL, "%s", msg);
    http_reply_error(r, &e);
}

void http_new_completion_id(http_ctx *ctx, char out[40]) {
    uint64_t n = atomic_fetch_add(&ctx->next_id, 1);
    /* splitmix64 of a per-server salt and a counter: unique and unguessable enough. */
    uint64_t z = ctx->id_salt + n * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    completion_make_id(out, z, n);
}

int http_check_model(const http_ctx *ctx, const char *model, api_error *e) {
    if (!model) return 0;
    for (int i = 0; i < ctx->cfg.n_names; i++)
        if (!strcmp(model, ctx->cfg.names[i])) return 0;
    return api_fail(e, 404, "model", "The model `%s` does not exist.", model);
}

/* ---- auth --------------------------------------------------------------- */

/* Compare in time that depends only on the key's length. */
static bool key_equal(const char *given, size_t given_len, const char *key) {
    size_t n = strlen(key);
    unsigned diff = (unsigned)(given_len != n);
    for (size_t i = 0; i < n; i++)
        diff |= (unsigned char)key[i] ^ (unsigned char)(i < given_len ? given[i] : 0);
    return diff == 0;
}

static bool authorized(const http_ctx *ctx, struct MHD_Connection *conn, const char *url) {
    if (!ctx->cfg.api_key || strncmp(url, "/v1", 3) != 0) return true;
    const char *h = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Authorization");
    if (!h || strncasecmp(h, "Bearer ", 7) != 0) return false;
    h += 7;
    return key_equal(h, strlen(h), ctx->cfg.api_key);
}

/* ---- dispatch ----------------------------------------------------------- */

static bool is_json_type(const char *ct) {
    if (!ct) return false;
    while (*ct == ' ')
        ct++;
    size_t n = strlen("application/json");
    return strncasecmp(ct, "application/json", n) == 0 &&
           (ct[n] == 0 || ct[n] == ';' || ct[n] == ' ');
}

static void dispatch(http_server *s, struct MHD_Connection *conn, const char *url,
                     const char *method, pd_httpd_body *bs, http_reply *out) {
    http_ctx *ctx = &s->ctx;
    if (!strcmp(method, "OPTIONS")) { /* CORS preflight and probes: always allowed */
        http_reply_body(out, 200, NULL, NULL, 0);
        if (out->resp) MHD_add_response_header(out->resp, "Allow", "GET, POST, OPTIONS");
        return;
    }
    if (!authorized(ctx, conn, url)) {
        char *body = strdup("{\"error\":\"Unauthorized\"}"); /* vLLM's exact 401 body */
        http_reply_body(out, 401, "application/json", body, body ? strlen(body) : 0);
        return;
    }
    const route *r = NULL;
    bool path_known = false;
    const char *allowed = NULL;
    const char *m = !strcmp(method, "HEAD") ? "GET" : method;
    for (int i = 0; i < N_ROUTES; i++) {
        if (strcmp(url, routes[i].path)) continue;
        path_known = true;
        allowed = routes[i].method;
        if (!strcmp(m, routes[i].method)) r = &routes[i];
    }
    if (!path_known) return reply_simple_error(out, 404, "Not Found");
    if (!r) {
        api_error e;
        api_fail(&e, 405, allowed, "Method Not Allowed");
        return http_reply_error(out, &e);
    }
    if (bs->too_large) {
        api_error e;
        api_fail(&e, 413, NULL, "the request body is larger than the limit of %zu bytes",
                 ctx->cfg.max_body_bytes);
        return http_reply_error(out, &e);
    }
    if (!strcmp(r->method, "POST") &&
        !is_json_type(MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Type")))
        return reply_simple_error(out, 400,
                                  "Unsupported Media Type: Only 'application/json' is allowed");
    if (bs->body.oom) return reply_simple_error(out, 500, "out of memory");
    http_request rq = {ctx, conn, method, url, bs->body.data ? bs->body.data : "", bs->body.len};
    r->fn(&rq, out);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_size, void **con_cls) {
    (void)version;
    http_server *s = cls;
    pd_httpd_body *bs = NULL;
    int got = pd_httpd_body_read(con_cls, upload_data, upload_size, s->ctx.cfg.max_body_bytes, &bs);
    if (got <= 0) return got == 0 ? MHD_YES : MHD_NO;
    http_reply out = {0};
    dispatch(s, conn, url, method, bs, &out);
    return pd_httpd_send(conn, out.status, out.resp, out.close);
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    (void)cls;
    (void)conn;
    if (toe != MHD_REQUEST_TERMINATED_COMPLETED_OK)
        pd_log(PD_LOG_DEBUG, "http: request ended early (libmicrohttpd code %d)", (int)toe);
    pd_httpd_body_free(con_cls);
}

int http_server_start(const http_config *cfg, engine *e, metrics *m, http_server **out,
                      pd_err *err) {
    http_server *s = calloc(1, sizeof *s);
    if (!s) return pd_fail(err, "out of memory");
    s->ctx.cfg = *cfg;
    s->ctx.eng = e;
    s->ctx.met = m;
    api_limits_default(&s->ctx.limits);
    s->ctx.limits.max_logprobs = cfg->max_logprobs;
    s->ctx.started = (long long)time(NULL);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    s->ctx.id_salt =
        ((uint64_t)ts.tv_sec << 32) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)getpid() << 16);
    atomic_init(&s->ctx.next_id, 1);
    atomic_init(&s->ctx.active, 0);
    atomic_init(&s->ctx.longest_token, 0);
    atomic_init(&s->ctx.draining, false);
    atomic_init(&s->ctx.hard_stop, false);

    if (pd_httpd_start(&s->httpd, cfg->host, cfg->port, 300, on_request, s, on_completed, err)) {
        free(s);
        return -1;
    }
    *out = s;
    return 0;
}

int http_server_port(const http_server *s) {
    return s->httpd.port;
}

void http_server_quiesce(http_server *s) {
    atomic_store(&s->ctx.draining, true);
    pd_httpd_quiesce(&s->httpd);
}

int http_server_active(const http_server *s) {
    return atomic_load(&s->ctx.active);
}

void http_server_abort_all(http_server *s) {
    atomic_store(&s->ctx.hard_stop, true);
}

void http_server_stop(http_server *s) {
    if (!s) return;
    atomic_store(&s->ctx.hard_stop, true);
    pd_httpd_stop(&s->httpd);
    free(s);
}
