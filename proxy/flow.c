/* flow: one client request through the three hops of docs/protocol.md.
 *   1. pick a decode instance D (its KV address goes into the prefill body)
 *      and a prefill instance P;
 *   2. POST to P with max_tokens 1 and kv_transfer_params naming D; on a
 *      connect error, a broken connection, a 5xx or an unusable answer,
 *      retry once on another P;
 *   3. POST the original body plus P's kv_transfer_params to D and relay the
 *      answer: a plain body as is, an SSE stream chunk by chunk as it
 *      arrives (an MHD content reader pulling from the upstream transfer).
 * The request ends in finish(): per-instance accounting, /metrics, and one
 * log line. Everything runs in the client connection's thread. */
#include <cjson/cJSON.h>
#include <microhttpd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "proxy/front.h"
#include "common/pd_buf.h"
#include "common/pd_httpd.h"
#include "proxy/rewrite.h"

#define MAX_ANSWER_BYTES (64u << 20)

typedef struct px_req {
    front_ctx *fx;
    struct MHD_Connection *conn;
    char rid[80];
    char path[48];
    const char *hdrs[3];
    int n_hdrs;
    char hdr_rid[100];
    char *hdr_auth;
    double t0, deadline;
    double prefill_s, upstream_s, d_start, ttft;
    int retries, status;
    bool accounted;
    reg_pick p, d;
    bool have_p, have_d, d_failed;
    up_call *call; /* the decode transfer while streaming */
    char last[2];  /* the last two bytes relayed: an SSE event ends with "\n\n" */
    char *tail;    /* our error event after a stream broke */
    size_t tail_len, tail_off;
} px_req;

static bool cancel_check(void *arg) {
    px_req *r = arg;
    return atomic_load(&r->fx->hard_stop) || pd_httpd_client_gone(r->conn);
}

/* Count the request (instances, /metrics, log line) once, as soon as its
 * outcome is known: for a stream that is before its last bytes leave, so a
 * client that saw the end also sees it counted. */
static void account(px_req *r) {
    if (r->accounted) return;
    r->accounted = true;
    double now = pd_now();
    double total = now - r->t0;
    if (r->have_d && r->d_start > 0) {
        double d_s = now - r->d_start;
        registry_release(r->fx->reg, r->d.id, d_s, r->d_failed, now);
        r->upstream_s += d_s;
    } else if (r->have_d && r->d_failed) { /* P could not hand it the KV */
        registry_release(r->fx->reg, r->d.id, -1, true, now);
    } else if (r->have_d) { /* reserved, but the request never got to it */
        registry_unpick(r->fx->reg, r->d.id);
    }
    double overhead = total - r->upstream_s;
    if (overhead < 0) overhead = 0;
    pxm_end(r->fx->pm, r->status, total, r->ttft >= 0 ? r->ttft : -1, r->prefill_s, overhead,
            r->retries);
    pd_log(PD_LOG_INFO,
           "request %s %s P=%s D=%s prefill_ms=%.1f ttft_ms=%.1f total_ms=%.1f "
           "overhead_ms=%.2f retries=%d status=%d",
           r->rid, r->path, r->have_p ? r->p.http : "-", r->have_d ? r->d.http : "-",
           r->prefill_s >= 0 ? r->prefill_s * 1e3 : -1, r->ttft >= 0 ? r->ttft * 1e3 : -1,
           total * 1e3, overhead * 1e3, r->retries, r->status);
}

static void finish(px_req *r) {
    account(r);
    free(r->hdr_auth);
    free(r->tail);
    free(r);
}

static void reply_error(px_req *r, front_reply *out, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void reply_error(px_req *r, front_reply *out, int status, const char *fmt, ...) {
    char msg[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    r->status = status;
    front_reply_error(out, status, "%s", msg);
}

/* Relay an instance's answer (status, content type, body taken over). */
static void relay(px_req *r, front_reply *out, long status, const char *ctype, char *body,
                  size_t len) {
    r->status = (int)status;
    front_reply_body(out, (unsigned)status, ctype && ctype[0] ? ctype : "application/json", body,
                     len);
}

static void add_rid(px_req *r, front_reply *out) {
    if (out->resp) MHD_add_response_header(out->resp, "X-Request-Id", r->rid);
}

static up_call *begin_hop(px_req *r, const char *method, const char *addr, const char *path,
                          const char *body, size_t len) {
    char url[REG_ADDR_MAX + 64];
    snprintf(url, sizeof url, "http://%s%s", addr, path);
    up_request rq = {method, url, body, len, r->hdrs, r->n_hdrs, r->deadline};
    return upstream_begin(r->fx->pool, &rq);
}

/* ---- prefill ---------------------------------------------------------------- */

typedef enum { PF_OK, PF_REPLIED } pf_result;

/* Run the prefill hop (with one retry). PF_OK: *params holds P's
 * kv_transfer_params (NULL when it gave none). PF_REPLIED: out is set. */
static pf_result prefill(px_req *r, const cJSON *root, char **params, front_reply *out) {
    size_t plen = 0;
    char *pbody = rewrite_prefill_body(root, r->d.kv, &plen);
    if (!pbody) {
        reply_error(r, out, 500, "out of memory");
        return PF_REPLIED;
    }
    int tried[2], n_tried = 0, last_status = 503;
    char last_msg[600] = "";
    double p0 = pd_now();
    pf_result res = PF_REPLIED;
    for (int attempt = 0; attempt < 2; attempt++) {
        reg_pick p;
        if (registry_pick(r->fx->reg, ROLE_PREFILL, tried, n_tried, pd_now(), &p) != 0) {
            if (attempt == 0)
                reply_error(r, out, 503, "no prefill instance is available");
            else
                reply_error(r, out, last_status, "%s; no other prefill instance to retry on",
                            last_msg);
            goto done;
        }
        tried[n_tried++] = p.id;
        if (attempt) r->retries++;
        r->p = p;
        r->have_p = true;
        double s0 = pd_now();
        up_call *c = begin_hop(r, "POST", p.http, r->path, pbody, plen);
        if (!c) {
            registry_release(r->fx->reg, p.id, -1, false, pd_now());
            reply_error(r, out, 500, "out of memory");
            goto done;
        }
        char *ans = NULL;
        size_t alen = 0;
        up_result ur = upstream_wait_headers(c, cancel_check, r);
        if (ur == UP_OK) ur = upstream_read_all(c, MAX_ANSWER_BYTES, &ans, &alen, cancel_check, r);
        long st = upstream_status(c);
        char why[300];
        snprintf(why, sizeof why, "%s", upstream_error(c));
        char ctype[128];
        snprintf(ctype, sizeof ctype, "%s", upstream_content_type(c));
        upstream_end(c);
        double now = pd_now();
        r->upstream_s += now - s0;
        if (ur == UP_CANCELLED) {
            registry_release(r->fx->reg, p.id, now - s0, false, now);
            r->status = 499;
            out->close = true;
            free(ans);
            goto done;
        }
        if (ur == UP_TIMEOUT) {
            registry_release(r->fx->reg, p.id, now - s0, true, now);
            reply_error(r, out, 504,
                        "prefill instance %s did not answer within the %.0f s deadline", p.http,
                        r->fx->cfg.timeout);
            free(ans);
            goto done;
        }
        if (ur == UP_OK && st == 200) {
            if (rewrite_prefill_answer(ans, alen, params) == 0) {
                registry_release(r->fx->reg, p.id, now - s0, false, now);
                free(ans);
                res = PF_OK;
                goto done;
            }
            snprintf(last_msg, sizeof last_msg,
                     "prefill instance %s answered 200 without a usable JSON body", p.http);
            last_status = 502;
        } else if (ur == UP_OK && st < 500) { /* the request itself is bad: say so as P did */
            registry_release(r->fx->reg, p.id, now - s0, false, now);
            relay(r, out, st, ctype, ans, alen);
            goto done;
        } else if (ur == UP_OK) {
            /* Keep P's own words in the error. */
            char said[300], param[64];
            const bool has_msg =
                rewrite_error_message(ans, alen, said, sizeof said, param, sizeof param) == 0;
            if (has_msg && st == 502 && !strcmp(param, "kv_transfer_params")) {
                /* P computed the prompt but could not hand its KV to D (D
                 * unreachable, or no room there): D's fault, and another P
                 * would meet the same D. No retry; D is backed off. */
                registry_release(r->fx->reg, p.id, now - s0, false, now);
                r->d_failed = true;
                reply_error(r, out, 502,
                            "prefill instance %s could not hand the KV to decode instance %s: %s",
                            p.http, r->d.http, said);
                free(ans);
                goto done;
            }
            if (has_msg)
                snprintf(last_msg, sizeof last_msg, "prefill instance %s answered HTTP %ld: %s",
                         p.http, st, said);
            else
                snprintf(last_msg, sizeof last_msg, "prefill instance %s answered HTTP %ld", p.http,
                         st);
            last_status = st == 503 ? 503 : 502;
        } else {
            snprintf(last_msg, sizeof last_msg, "prefill instance %s failed: %s (%s)", p.http,
                     up_result_name(ur), why);
            last_status = 502;
        }
        free(ans);
        registry_release(r->fx->reg, p.id, now - s0, true, now);
        pd_log(PD_LOG_WARN, "request %s: %s%s", r->rid, last_msg,
               attempt == 0 ? "; retrying on another prefill instance" : "");
    }
    reply_error(r, out, last_status, "%s (after 2 attempts)", last_msg);
done:
    if (r->have_p) r->prefill_s = pd_now() - p0;
    free(pbody);
    return res;
}

/* ---- streaming relay -------------------------------------------------------- */

static ssize_t copy_tail(px_req *r, char *buf, size_t max) {
    if (r->tail_off >= r->tail_len) {
        account(r);
        return MHD_CONTENT_READER_END_OF_STREAM;
    }
    size_t n = r->tail_len - r->tail_off < max ? r->tail_len - r->tail_off : max;
    memcpy(buf, r->tail + r->tail_off, n);
    r->tail_off += n;
    return (ssize_t)n;
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    px_req *r = cls;
    if (r->tail) return copy_tail(r, buf, max);
    size_t got = 0;
    up_result ur = upstream_read(r->call, buf, max, &got, cancel_check, r);
    if (ur == UP_OK && got) {
        if (r->ttft < 0) r->ttft = pd_now() - r->t0;
        r->last[0] = got >= 2 ? buf[got - 2] : r->last[1];
        r->last[1] = buf[got - 1];
        return (ssize_t)got;
    }
    if (ur == UP_OK) {
        r->status = 200;
        account(r);
        return MHD_CONTENT_READER_END_OF_STREAM;
    }
    if (ur == UP_CANCELLED) {
        r->status = 499;
        account(r);
        return MHD_CONTENT_READER_END_WITH_ERROR;
    }
    /* The stream broke after the 200 went out: tell the client in the
     * stream, as an OpenAI error event, and end it. */
    int code = ur == UP_TIMEOUT ? 504 : 502;
    r->status = code;
    r->d_failed = true;
    char msg[500];
    if (code == 504)
        snprintf(msg, sizeof msg, "decode instance %s did not finish within the %.0f s deadline",
                 r->d.http, r->fx->cfg.timeout);
    else
        snprintf(msg, sizeof msg, "decode instance %s failed midway: %s (%s)", r->d.http,
                 up_result_name(ur), upstream_error(r->call));
    pd_log(PD_LOG_WARN, "request %s: %s", r->rid, msg);
    size_t elen = 0;
    char *ej = rewrite_error_json(code, msg, &elen);
    pd_buf b;
    pd_buf_init(&b);
    if (r->last[0] != '\n' || r->last[1] != '\n') pd_buf_puts(&b, "\n\n");
    pd_buf_puts(&b, "data: ");
    if (ej) pd_buf_append(&b, ej, elen);
    pd_buf_puts(&b, "\n\ndata: [DONE]\n\n");
    free(ej);
    r->tail = pd_buf_take(&b, &r->tail_len);
    if (!r->tail) return MHD_CONTENT_READER_END_WITH_ERROR;
    return copy_tail(r, buf, max);
}

static void stream_free(void *cls) {
    px_req *r = cls;
    upstream_end(r->call);
    r->call = NULL;
    if (r->status == 0) r->status = 499; /* MHD gave up on the client before the end */
    finish(r);
}

/* ---- decode ----------------------------------------------------------------- */

static void decode(px_req *r, const char *body, size_t len, const cJSON *root, const char *params,
                   front_reply *out) {
    size_t dlen = 0;
    char *dbody = rewrite_decode_body(body, len, root, params, &dlen);
    if (!dbody) return reply_error(r, out, 500, "out of memory");
    r->d_start = pd_now();
    up_call *c = begin_hop(r, "POST", r->d.http, r->path, dbody, dlen);
    free(dbody);
    if (!c) return reply_error(r, out, 500, "out of memory");
    up_result ur = upstream_wait_headers(c, cancel_check, r);
    long st = upstream_status(c);
    const char *ctype = upstream_content_type(c);
    if (ur == UP_OK && st == 200 && !strncasecmp(ctype, "text/event-stream", 17)) {
        r->call = c;
        r->last[0] = r->last[1] = '\n';
        out->status = 200;
        out->resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, stream_read, r,
                                                      stream_free);
        if (!out->resp) { /* stream_free never runs: undo here */
            r->call = NULL;
            upstream_end(c);
            return reply_error(r, out, 500, "out of memory");
        }
        MHD_add_response_header(out->resp, "Content-Type", ctype);
        MHD_add_response_header(out->resp, "Cache-Control", "no-cache");
        return;
    }
    char *ans = NULL;
    size_t alen = 0;
    if (ur == UP_OK) ur = upstream_read_all(c, MAX_ANSWER_BYTES, &ans, &alen, cancel_check, r);
    if (ur == UP_OK) r->ttft = pd_now() - r->t0;
    char why[300], ct[128];
    snprintf(why, sizeof why, "%s", upstream_error(c));
    snprintf(ct, sizeof ct, "%s", ctype);
    upstream_end(c);
    if (ur == UP_CANCELLED) {
        r->status = 499;
        out->close = true;
    } else if (ur == UP_TIMEOUT) {
        r->d_failed = true;
        reply_error(r, out, 504, "decode instance %s did not answer within the %.0f s deadline",
                    r->d.http, r->fx->cfg.timeout);
    } else if (ur == UP_TOO_BIG) { /* D answered; the answer is just too big to buffer */
        reply_error(r, out, 502,
                    "decode instance %s answered with more than %u bytes, pdproxy's limit for a "
                    "whole (not streamed) answer; use stream true",
                    r->d.http, MAX_ANSWER_BYTES);
    } else if (ur != UP_OK) {
        r->d_failed = true;
        reply_error(r, out, 502, "decode instance %s failed: %s (%s)", r->d.http,
                    up_result_name(ur), why);
    } else if (st >= 500) {
        char who[REG_ADDR_MAX + 32];
        snprintf(who, sizeof who, "decode instance %s", r->d.http);
        size_t elen = 0;
        char *e = rewrite_upstream_error(ans, alen, (int)st, who, &elen);
        /* 503: D is draining (shutting down) or overloaded; the backoff
         * sends the next requests elsewhere until it is gone from discovery. */
        r->d_failed = st == 500 || st == 502 || st == 503;
        relay(r, out, st, "application/json", e, elen);
    } else {
        relay(r, out, st, ct, ans, alen);
        ans = NULL;
    }
    free(ans);
}

/* ---- entry points ------------------------------------------------------------ */

static px_req *req_new(front_ctx *fx, struct MHD_Connection *conn, const char *url) {
    px_req *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    r->fx = fx;
    r->conn = conn;
    r->t0 = pd_now();
    r->deadline = r->t0 + fx->cfg.timeout;
    r->prefill_s = r->ttft = -1;
    snprintf(r->path, sizeof r->path, "%s", url);
    const char *given = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "X-Request-Id");
    if (given && given[0] && strlen(given) < sizeof r->rid && !strpbrk(given, "\r\n"))
        snprintf(r->rid, sizeof r->rid, "%s", given);
    else
        snprintf(r->rid, sizeof r->rid, "pdproxy-%016llx%08llx",
                 (unsigned long long)(fx->id_salt * 0x9E3779B97F4A7C15ull),
                 (unsigned long long)atomic_fetch_add(&fx->next_id, 1));
    snprintf(r->hdr_rid, sizeof r->hdr_rid, "X-Request-Id: %s", r->rid);
    r->hdrs[r->n_hdrs++] = "Content-Type: application/json";
    r->hdrs[r->n_hdrs++] = r->hdr_rid;
    const char *auth = MHD_lookup_connection_value(conn, MHD_HEADER_KIND, "Authorization");
    if (fx->cfg.upstream_api_key) {
        pd_buf b;
        pd_buf_init(&b);
        pd_buf_printf(&b, "Authorization: Bearer %s", fx->cfg.upstream_api_key);
        r->hdr_auth = pd_buf_take(&b, NULL);
    } else if (auth && !fx->cfg.api_key && !strpbrk(auth, "\r\n")) {
        pd_buf b;
        pd_buf_init(&b);
        pd_buf_printf(&b, "Authorization: %s", auth);
        r->hdr_auth = pd_buf_take(&b, NULL);
    }
    if (r->hdr_auth) r->hdrs[r->n_hdrs++] = r->hdr_auth;
    return r;
}

void flow_generate(front_ctx *fx, struct MHD_Connection *conn, const char *url, const char *body,
                   size_t len, front_reply *out) {
    px_req *r = req_new(fx, conn, url);
    if (!r) return front_reply_error(out, 500, "out of memory");
    pxm_begin(fx->pm);
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(body, len, &end, false);
    size_t after_value = root ? (size_t)(body + len - end) : 0; /* bytes past the JSON value */
    char *params = NULL;
    if (!root || !cJSON_IsObject(root)) {
        reply_error(r, out, 400, "the request body is not a JSON object");
    } else if (pd_json_space(end, after_value) < after_value) {
        /* As the instances do: refused here, before P computes (and ships)
         * KV that D would then refuse to take. */
        reply_error(r, out, 400, "the request body has data after its JSON object");
    } else if (registry_pick(fx->reg, ROLE_DECODE, NULL, 0, pd_now(), &r->d) != 0) {
        reply_error(r, out, 503, "no decode instance is available");
    } else {
        r->have_d = true; /* D counts as busy from here, so least-loaded sees it */
        if (prefill(r, root, &params, out) == PF_OK) {
            if (!params)
                pd_log(PD_LOG_DEBUG,
                       "request %s: prefill %s returned no kv_transfer_params; decode computes "
                       "the prompt itself",
                       r->rid, r->p.http);
            decode(r, body, len, root, params, out);
        }
    }
    free(params);
    cJSON_Delete(root);
    add_rid(r, out);
    if (r->call) return; /* streaming: stream_free() finishes the request */
    if (!out->resp && !out->close) out->close = true;
    finish(r);
}

void flow_models(front_ctx *fx, struct MHD_Connection *conn, front_reply *out) {
    px_req *r = req_new(fx, conn, "/v1/models");
    if (!r) return front_reply_error(out, 500, "out of memory");
    reg_pick pk;
    double now = pd_now();
    if (registry_pick(fx->reg, ROLE_DECODE, NULL, 0, now, &pk) != 0 &&
        registry_pick(fx->reg, ROLE_PREFILL, NULL, 0, now, &pk) != 0) {
        front_reply_error(out, 503, "no instance is available");
    } else {
        up_call *c = begin_hop(r, "GET", pk.http, "/v1/models", NULL, 0);
        up_result ur = c ? upstream_wait_headers(c, cancel_check, r) : UP_BROKEN;
        char *ans = NULL;
        size_t alen = 0;
        if (ur == UP_OK) ur = upstream_read_all(c, MAX_ANSWER_BYTES, &ans, &alen, cancel_check, r);
        if (ur == UP_OK) {
            relay(r, out, upstream_status(c), upstream_content_type(c), ans, alen);
            ans = NULL;
        } else if (ur == UP_CANCELLED) {
            out->close = true;
        } else {
            front_reply_error(out, ur == UP_TIMEOUT ? 504 : 502, "instance %s failed: %s (%s)",
                              pk.http, up_result_name(ur), c ? upstream_error(c) : "no memory");
        }
        free(ans);
        upstream_end(c);
        registry_unpick(fx->reg, pk.id);
    }
    free(r->hdr_auth);
    free(r);
}
