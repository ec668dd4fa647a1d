/* front: libmicrohttpd server core of the proxy — bodies, routing, auth,
 * /health and /metrics, shutdown. See front.h. */
#include "proxy/front.h"

#include <microhttpd.h>
#include <netdb.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/pd_buf.h"
#include "proxy/rewrite.h"

struct front {
    front_ctx ctx;
    struct MHD_Daemon *daemon;
    int port;
    bool quiesced;
};

typedef struct body_state {
    pd_buf body;
    bool too_large;
} body_state;

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

bool front_client_gone(struct MHD_Connection *conn) {
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci) return false;
    struct pollfd p = {.fd = ci->connect_fd, .events = POLLIN | POLLRDHUP};
    if (poll(&p, 1, 0) <= 0) return false;
    if (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) return true;
    if (p.revents & POLLIN) { /* EOF, or the client pipelined its next request */
        char c;
        return recv(ci->connect_fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
    }
    return false;
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
    pd_buf b;
    pd_buf_init(&b);
    pd_buf_printf(&b, "{\"status\":\"%s\",", np && nd ? "ok" : "unavailable");
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
    front_reply_body(out, np && nd ? 200 : 503, "application/json", body, len);
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

static void dispatch(front *f, struct MHD_Connection *conn, const char *url, const char *method,
                     body_state *bs, front_reply *out) {
    front_ctx *fx = &f->ctx;
    if (!authorized(fx, conn, url)) return front_reply_error(out, 401, "Unauthorized");
    bool get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    bool post = !strcmp(method, "POST");
    bool gen = !strcmp(url, "/v1/completions") || !strcmp(url, "/v1/chat/completions");
    if (gen) {
        if (!post) {
            front_reply_error(out, 405, "Method Not Allowed");
            if (out->resp) MHD_add_response_header(out->resp, "Allow", "POST");
            return;
        }
        if (bs->too_large)
            return front_reply_error(out, 413, "the request body is larger than %zu bytes",
                                     fx->cfg.max_body_bytes);
        if (!is_json_type(MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Content-Type")))
            return front_reply_error(out, 400,
                                     "Unsupported Media Type: Only 'application/json' is allowed");
        if (bs->body.oom) return front_reply_error(out, 500, "out of memory");
        return flow_generate(fx, conn, url, bs->body.data ? bs->body.data : "", bs->body.len, out);
    }
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
    body_state *bs = *con_cls;
    if (!bs) {
        bs = calloc(1, sizeof *bs);
        if (!bs) return MHD_NO;
        pd_buf_init(&bs->body);
        *con_cls = bs;
        return MHD_YES;
    }
    if (*upload_size) {
        if (!bs->too_large && bs->body.len + *upload_size > f->ctx.cfg.max_body_bytes) {
            bs->too_large = true;
            pd_buf_free(&bs->body);
        }
        if (!bs->too_large) pd_buf_append(&bs->body, upload_data, *upload_size);
        *upload_size = 0;
        return MHD_YES;
    }
    atomic_fetch_add(&f->ctx.active, 1);
    front_reply out = {0};
    dispatch(f, conn, url, method, bs, &out);
    atomic_fetch_sub(&f->ctx.active, 1);
    if (out.close || !out.resp) {
        if (out.resp) MHD_destroy_response(out.resp);
        return MHD_NO;
    }
    enum MHD_Result rc = MHD_queue_response(conn, out.status, out.resp);
    MHD_destroy_response(out.resp);
    return rc;
}

static void on_completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                         enum MHD_RequestTerminationCode toe) {
    (void)cls;
    (void)conn;
    (void)toe;
    body_state *bs = *con_cls;
    if (bs) {
        pd_buf_free(&bs->body);
        free(bs);
    }
    *con_cls = NULL;
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    char msg[400];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n && (msg[n - 1] == '\n' || msg[n - 1] == '\r'))
        msg[--n] = 0;
    pd_log(PD_LOG_DEBUG, "libmicrohttpd: %s", msg);
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
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD |
                     MHD_USE_POLL | MHD_USE_ITC | MHD_USE_ERROR_LOG;
    struct addrinfo *ai = NULL;
    if (cfg->host && cfg->host[0]) {
        char port[16];
        snprintf(port, sizeof port, "%d", cfg->port);
        struct addrinfo hints = {
            .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE};
        int rc = getaddrinfo(cfg->host, port, &hints, &ai);
        if (rc != 0) {
            free(f);
            return pd_fail(err, "--host %s: %s", cfg->host, gai_strerror(rc));
        }
        if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    }
    /* The idle timeout must outlast the longest request: a streamed answer
     * can be quiet between tokens. */
    unsigned idle = (unsigned)(cfg->timeout + 30);
    struct MHD_OptionItem opts[] = {
        {MHD_OPTION_NOTIFY_COMPLETED, (intptr_t)on_completed, NULL},
        {MHD_OPTION_EXTERNAL_LOGGER, (intptr_t)on_mhd_log, NULL},
        {MHD_OPTION_CONNECTION_TIMEOUT, (intptr_t)idle, NULL},
        {MHD_OPTION_CONNECTION_LIMIT, 4096, NULL},
        {MHD_OPTION_THREAD_STACK_SIZE, 1 << 20, NULL},
        {MHD_OPTION_LISTENING_ADDRESS_REUSE, 1, NULL},
        {MHD_OPTION_LISTEN_BACKLOG_SIZE, 1024, NULL},
        {ai ? MHD_OPTION_SOCK_ADDR : MHD_OPTION_END, 0, ai ? ai->ai_addr : NULL},
        {MHD_OPTION_END, 0, NULL},
    };
    f->daemon = MHD_start_daemon(flags, (uint16_t)cfg->port, NULL, NULL, on_request, f,
                                 MHD_OPTION_ARRAY, opts, MHD_OPTION_END);
    if (ai) freeaddrinfo(ai);
    if (!f->daemon) {
        free(f);
        return pd_fail(err, "cannot listen on %s:%d (address in use?)",
                       cfg->host ? cfg->host : "0.0.0.0", cfg->port);
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(f->daemon, MHD_DAEMON_INFO_BIND_PORT);
    f->port = di ? di->port : cfg->port;
    *out = f;
    return 0;
}

int front_port(const front *f) {
    return f->port;
}

void front_quiesce(front *f) {
    if (f->quiesced) return;
    MHD_socket fd = MHD_quiesce_daemon(f->daemon);
    if (fd != MHD_INVALID_SOCKET) close(fd);
    f->quiesced = true;
}

int front_active(front *f) {
    return atomic_load(&f->ctx.active) + (int)pxm_in_flight(f->ctx.pm);
}

void front_stop(front *f) {
    if (!f) return;
    atomic_store(&f->ctx.hard_stop, true);
    MHD_stop_daemon(f->daemon);
    free(f);
}
