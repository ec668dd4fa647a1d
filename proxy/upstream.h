/* upstream: HTTP requests from the proxy to instances, on libcurl. A pool
 * of (multi handle, easy handle) pairs is shared by the connection threads:
 * a request takes a pair, uses it for its hops and gives it back, so the
 * connections each pair keeps open to the instances are reused (keep-alive)
 * by later requests. The caller drives the transfer in its own thread
 * (upstream_wait_headers / upstream_read / upstream_read_all), which lets
 * it check for a vanished client between waits and lets a slow client slow
 * the transfer down: the body is held in a small bounded buffer, and curl is
 * paused while that buffer is full. Ending a transfer early (upstream_end)
 * closes its connection, which is how the instance learns to abort. */
#ifndef PD_PROXY_UPSTREAM_H
#define PD_PROXY_UPSTREAM_H

#include <stdbool.h>
#include <stddef.h>

typedef enum {
    UP_OK = 0,
    UP_CONNECT,   /* could not connect (refused, unreachable, connect timeout) */
    UP_BROKEN,    /* the connection failed midway (reset, closed, bad HTTP) */
    UP_TIMEOUT,   /* the request's deadline passed */
    UP_CANCELLED, /* the cancel callback said stop (client gone) */
    UP_TOO_BIG,   /* a buffered body went over its limit */
} up_result;

typedef bool (*up_cancel_fn)(void *arg);

typedef struct upstream_pool upstream_pool;
typedef struct up_call up_call;

upstream_pool *upstream_pool_create(double connect_timeout_s);
void upstream_pool_free(upstream_pool *p);

/* One request: method "GET" or "POST" (body copied), extra headers as
 * "Name: value" strings, an absolute deadline (pd_now() seconds). */
typedef struct up_request {
    const char *method, *url;
    const char *body;
    size_t body_len;
    const char *const *headers;
    int n_headers;
    double deadline;
} up_request;

up_call *upstream_begin(upstream_pool *p, const up_request *rq);
/* Run until the status line and headers are in (or the transfer ended). */
up_result upstream_wait_headers(up_call *c, up_cancel_fn cancel, void *arg);
long upstream_status(const up_call *c);
const char *upstream_content_type(const up_call *c); /* "" when none */
/* Up to max body bytes into dst; *got = 0 with UP_OK means the body ended. */
up_result upstream_read(up_call *c, char *dst, size_t max, size_t *got, up_cancel_fn cancel,
                        void *arg);
/* The whole (remaining) body, at most limit bytes, into a new NUL-terminated buffer. */
up_result upstream_read_all(up_call *c, size_t limit, char **body, size_t *len, up_cancel_fn cancel,
                            void *arg);
/* libcurl's words for the last failure. */
const char *upstream_error(const up_call *c);
/* Abort the transfer if it is still running and return the handles to the pool. */
void upstream_end(up_call *c);

const char *up_result_name(up_result r);

#endif
