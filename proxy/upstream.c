/* upstream: libcurl transfers driven by the calling thread. See upstream.h. */
#include "proxy/upstream.h"

#include <curl/curl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/pd_common.h"

/* A streaming body waits in at most about this many bytes (one chunk from
 * curl may overshoot it once); beyond it curl is paused, so a slow client
 * pushes back on the instance through TCP instead of filling our memory. */
#define UP_STREAM_BUFFER (64 * 1024)
#define UP_POOL_MAX_IDLE 512
#define UP_POLL_MS 50

struct up_call {
    upstream_pool *pool;
    up_call *next; /* free list */
    CURLM *multi;  /* holds the connection cache this pair reuses */
    CURL *easy;
    struct curl_slist *hdrs;
    char errbuf[CURL_ERROR_SIZE];
    char ctype[128];
    long status;
    bool added, headers_done, done, paused, collect, too_big;
    CURLcode result;
    double deadline;
    size_t limit;
    char *buf;
    size_t off, len, cap;
};

struct upstream_pool {
    pthread_mutex_t mu;
    up_call *idle;
    int n_idle;
    double connect_timeout;
};

const char *up_result_name(up_result r) {
    static const char *names[] = {"ok",      "connect failed", "connection broken",
                                  "timeout", "cancelled",      "body too large"};
    return (unsigned)r < sizeof names / sizeof names[0] ? names[r] : "?";
}

upstream_pool *upstream_pool_create(double connect_timeout_s) {
    upstream_pool *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    pthread_mutex_init(&p->mu, NULL);
    p->connect_timeout = connect_timeout_s;
    return p;
}

static void call_destroy(up_call *c) {
    if (c->added) curl_multi_remove_handle(c->multi, c->easy);
    if (c->easy) curl_easy_cleanup(c->easy);
    if (c->multi) curl_multi_cleanup(c->multi);
    curl_slist_free_all(c->hdrs);
    free(c->buf);
    free(c);
}

void upstream_pool_free(upstream_pool *p) {
    if (!p) return;
    while (p->idle) {
        up_call *c = p->idle;
        p->idle = c->next;
        call_destroy(c);
    }
    pthread_mutex_destroy(&p->mu);
    free(p);
}

/* ---- curl callbacks ------------------------------------------------------ */

static bool grow(up_call *c, size_t need) {
    if (c->off && c->off == c->len) c->off = c->len = 0;
    if (c->off && c->len + need > c->cap) { /* slide the unread part to the front */
        memmove(c->buf, c->buf + c->off, c->len - c->off);
        c->len -= c->off;
        c->off = 0;
    }
    if (c->len + need + 1 <= c->cap) return true;
    size_t cap = c->cap ? c->cap : 16384;
    while (cap < c->len + need + 1)
        cap *= 2;
    char *b = realloc(c->buf, cap);
    if (!b) return false;
    c->buf = b;
    c->cap = cap;
    return true;
}

static size_t on_body(char *data, size_t size, size_t nmemb, void *ud) {
    up_call *c = ud;
    size_t n = size * nmemb;
    if (c->collect) {
        if (c->len - c->off + n > c->limit) {
            c->too_big = true;
            return 0; /* curl ends the transfer with a write error */
        }
    } else if (c->len > c->off && c->len - c->off + n > UP_STREAM_BUFFER) {
        c->paused = true;
        return CURL_WRITEFUNC_PAUSE; /* curl keeps this chunk and offers it again */
    }
    if (!grow(c, n)) return 0;
    memcpy(c->buf + c->len, data, n);
    c->len += n;
    c->buf[c->len] = 0;
    return n;
}

static size_t on_header(char *data, size_t size, size_t nmemb, void *ud) {
    up_call *c = ud;
    size_t n = size * nmemb;
    if (n >= 5 && !strncmp(data, "HTTP/", 5)) { /* a status line starts a header block */
        const char *sp = memchr(data, ' ', n);
        c->status = sp ? strtol(sp + 1, NULL, 10) : 0;
        c->ctype[0] = 0;
    } else if ((n == 2 && data[0] == '\r') || (n == 1 && data[0] == '\n')) {
        if (c->status >= 200) c->headers_done = true; /* 1xx blocks are followed by more */
    } else if (n > 13 && !strncasecmp(data, "Content-Type:", 13)) {
        const char *v = data + 13;
        size_t m = n - 13;
        while (m && (*v == ' ' || *v == '\t'))
            v++, m--;
        while (m && (v[m - 1] == '\r' || v[m - 1] == '\n' || v[m - 1] == ' '))
            m--;
        if (m >= sizeof c->ctype) m = sizeof c->ctype - 1;
        memcpy(c->ctype, v, m);
        c->ctype[m] = 0;
    }
    return n;
}

/* ---- a request ------------------------------------------------------------ */

up_call *upstream_begin(upstream_pool *p, const up_request *rq) {
    pthread_mutex_lock(&p->mu);
    up_call *c = p->idle;
    if (c) {
        p->idle = c->next;
        p->n_idle--;
    }
    pthread_mutex_unlock(&p->mu);
    if (!c) {
        c = calloc(1, sizeof *c);
        if (!c) return NULL;
        c->multi = curl_multi_init();
        c->easy = curl_easy_init();
        if (!c->multi || !c->easy) {
            call_destroy(c);
            return NULL;
        }
        curl_multi_setopt(c->multi, CURLMOPT_MAXCONNECTS, 16L);
    }
    c->pool = p;
    c->next = NULL;
    c->status = 0;
    c->ctype[0] = c->errbuf[0] = 0;
    c->headers_done = c->done = c->paused = c->collect = c->too_big = false;
    c->result = CURLE_OK;
    c->off = c->len = 0;
    c->deadline = rq->deadline;

    CURL *e = c->easy;
    curl_easy_reset(e);
    struct curl_slist *h = NULL;
    for (int i = 0; i < rq->n_headers; i++)
        h = curl_slist_append(h, rq->headers[i]);
    h = curl_slist_append(h, "Expect:"); /* no 100-continue round trip for big bodies */
    c->hdrs = h;
    double left = rq->deadline - pd_now();
    long left_ms = left > 0.001 ? (long)(left * 1000) : 1;
    long conn_ms = (long)(p->connect_timeout * 1000);
    if (conn_ms < 1 || conn_ms > left_ms) conn_ms = left_ms;
    curl_easy_setopt(e, CURLOPT_URL, rq->url);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_ERRORBUFFER, c->errbuf);
    curl_easy_setopt(e, CURLOPT_HTTP_VERSION, (long)CURL_HTTP_VERSION_1_1);
    curl_easy_setopt(e, CURLOPT_TCP_NODELAY, 1L);
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, c->hdrs);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, c);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, c);
    curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, left_ms);
    curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, conn_ms);
    if (!strcmp(rq->method, "POST")) {
        curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)rq->body_len);
        curl_easy_setopt(e, CURLOPT_COPYPOSTFIELDS, rq->body ? rq->body : "");
    } else {
        curl_easy_setopt(e, CURLOPT_HTTPGET, 1L);
    }
    if (curl_multi_add_handle(c->multi, e) != CURLM_OK) {
        snprintf(c->errbuf, sizeof c->errbuf, "curl_multi_add_handle failed");
        c->done = true;
        c->result = CURLE_FAILED_INIT;
        return c;
    }
    c->added = true;
    return c;
}

static void collect_done(up_call *c) {
    int left;
    CURLMsg *m;
    while ((m = curl_multi_info_read(c->multi, &left)))
        if (m->msg == CURLMSG_DONE && m->easy_handle == c->easy) {
            c->done = true;
            c->result = m->data.result;
        }
}

static up_result done_result(const up_call *c) {
    switch (c->result) {
    case CURLE_OK:
        return UP_OK;
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST:
        return UP_CONNECT;
    case CURLE_OPERATION_TIMEDOUT:
        /* Before the deadline a timeout can only be the connect timeout. */
        if (pd_now() >= c->deadline - 0.05) return UP_TIMEOUT;
        return c->status ? UP_BROKEN : UP_CONNECT;
    case CURLE_WRITE_ERROR:
        return c->too_big ? UP_TOO_BIG : UP_BROKEN;
    default:
        return UP_BROKEN;
    }
}

typedef bool (*ready_fn)(const up_call *c);

/* Drive the transfer until ready(c), the end of the transfer, or cancel. */
static up_result run_until(up_call *c, ready_fn ready, up_cancel_fn cancel, void *arg) {
    for (;;) {
        int running = 0;
        if (!c->done) {
            curl_multi_perform(c->multi, &running);
            collect_done(c);
        }
        if (ready(c) || c->done) return UP_OK;
        if (cancel && cancel(arg)) return UP_CANCELLED;
        curl_multi_poll(c->multi, NULL, 0, UP_POLL_MS, NULL);
    }
}

static bool headers_in(const up_call *c) {
    return c->headers_done;
}
static bool has_data(const up_call *c) {
    return c->len > c->off;
}
static bool finished(const up_call *c) {
    return c->done;
}

up_result upstream_wait_headers(up_call *c, up_cancel_fn cancel, void *arg) {
    up_result r = run_until(c, headers_in, cancel, arg);
    if (r != UP_OK) return r;
    if (c->headers_done) return UP_OK;
    r = done_result(c);
    return r == UP_OK ? UP_BROKEN : r; /* ended without a response */
}

long upstream_status(const up_call *c) {
    return c->status;
}

const char *upstream_content_type(const up_call *c) {
    return c->ctype;
}

const char *upstream_error(const up_call *c) {
    if (c->errbuf[0]) return c->errbuf;
    return c->result != CURLE_OK ? curl_easy_strerror(c->result) : "no error";
}

static void resume(up_call *c) {
    if (!c->paused) return;
    c->paused = false;
    curl_easy_pause(c->easy, CURLPAUSE_CONT); /* may call on_body (and pause) again */
}

up_result upstream_read(up_call *c, char *dst, size_t max, size_t *got, up_cancel_fn cancel,
                        void *arg) {
    *got = 0;
    for (;;) {
        if (c->len > c->off) {
            size_t n = c->len - c->off < max ? c->len - c->off : max;
            memcpy(dst, c->buf + c->off, n);
            c->off += n;
            *got = n;
            resume(c);
            return UP_OK;
        }
        if (c->done) return done_result(c);
        up_result r = run_until(c, has_data, cancel, arg);
        if (r != UP_OK) return r;
    }
}

up_result upstream_read_all(up_call *c, size_t limit, char **body, size_t *len, up_cancel_fn cancel,
                            void *arg) {
    *body = NULL;
    *len = 0;
    c->collect = true;
    c->limit = limit;
    resume(c);
    up_result r = run_until(c, finished, cancel, arg);
    if (r != UP_OK) return r;
    r = done_result(c);
    if (r != UP_OK) return r;
    size_t n = c->len - c->off;
    char *b = malloc(n + 1);
    if (!b) return UP_BROKEN;
    if (n) memcpy(b, c->buf + c->off, n);
    b[n] = 0;
    c->off = c->len;
    *body = b;
    *len = n;
    return UP_OK;
}

void upstream_end(up_call *c) {
    if (!c) return;
    upstream_pool *p = c->pool;
    /* Removing an unfinished transfer closes its connection: the instance
     * sees the disconnect and aborts the request. */
    if (c->added) curl_multi_remove_handle(c->multi, c->easy);
    c->added = false;
    curl_slist_free_all(c->hdrs);
    c->hdrs = NULL;
    if (c->cap > 4 * UP_STREAM_BUFFER) { /* do not keep a big body's buffer around */
        free(c->buf);
        c->buf = NULL;
        c->cap = 0;
    }
    c->off = c->len = 0;
    pthread_mutex_lock(&p->mu);
    bool keep = p->n_idle < UP_POOL_MAX_IDLE;
    if (keep) {
        c->next = p->idle;
        p->idle = c;
        p->n_idle++;
    }
    pthread_mutex_unlock(&p->mu);
    if (!keep) call_destroy(c);
}
