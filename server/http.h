/* http: the OpenAI-compatible HTTP front end on libmicrohttpd. One thread
 * per connection (MHD_USE_THREAD_PER_CONNECTION), so a handler may block
 * while its request generates — a slow streaming client only ever holds its
 * own thread. This header is also the small internal interface between the
 * server core (http.c: routing, bodies, auth, errors, shutdown) and the
 * endpoint handlers (http_completions.c, api_misc.c). */
#ifndef PD_SERVER_HTTP_H
#define PD_SERVER_HTTP_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/pd_common.h"
#include "server/api_completions.h"
#include "server/engine.h"
#include "server/metrics.h"

#define PDSERVE_VERSION "0.1.0"

typedef struct http_config {
    const char *host;         /* NULL: all interfaces */
    int port;                 /* 0: any free port */
    const char *api_key;      /* NULL: no authentication */
    const char *const *names; /* served model names; names[0] is reported */
    int n_names;
    const char *model_root; /* the model directory, for /v1/models "root" */
    int max_logprobs;
    size_t max_body_bytes; /* larger POST bodies get 413 */
} http_config;

typedef struct http_server http_server;

/* Start listening; handlers use e and m, which must outlive the server. */
int http_server_start(const http_config *cfg, engine *e, metrics *m, http_server **out,
                      pd_err *err);
int http_server_port(const http_server *s);
/* Stop accepting connections (in-flight requests continue); /health says 503. */
void http_server_quiesce(http_server *s);
/* Requests currently generating. */
int http_server_active(const http_server *s);
/* Make every in-flight request abort its engine sequences now. */
void http_server_abort_all(http_server *s);
/* Close everything and free the server (joins connection threads). */
void http_server_stop(http_server *s);

/* ---- internal: shared by the handlers ------------------------------------ */

struct MHD_Connection;
struct MHD_Response;

typedef struct http_ctx {
    http_config cfg;
    engine *eng;
    metrics *met;
    api_limits limits;
    long long started; /* Unix time the server started (model cards' "created") */
    uint64_t id_salt;
    atomic_uint_fast64_t next_id;
    atomic_int active;
    atomic_int longest_token; /* bytes of the longest vocabulary entry; 0: not known yet */
    atomic_bool draining, hard_stop;
} http_ctx;

/* One request as the handlers see it. */
typedef struct http_request {
    http_ctx *ctx;
    struct MHD_Connection *conn;
    const char *method, *url;
    const char *body;
    size_t body_len;
} http_request;

/* What a handler answers: a status and a response it created (or NULL with
 * close = true to drop the connection, e.g. the client is gone). */
typedef struct http_reply {
    unsigned status;
    struct MHD_Response *resp;
    bool close;
} http_reply;

/* Replies built from a body the function takes ownership of (body may be
 * NULL for an empty one). */
void http_reply_body(http_reply *r, unsigned status, const char *content_type, char *body,
                     size_t len);
void http_reply_error(http_reply *r, const api_error *e);
/* A fresh "cmpl-<32 hex>" id. */
void http_new_completion_id(http_ctx *ctx, char out[40]);
/* 404 unless model is NULL or one of the served names. */
int http_check_model(const http_ctx *ctx, const char *model, api_error *e);

/* Endpoint handlers. */
void api_completions(http_request *rq, http_reply *out);
void api_chat_completions(http_request *rq, http_reply *out);
void api_models(http_request *rq, http_reply *out);
void api_health(http_request *rq, http_reply *out);
void api_version(http_request *rq, http_reply *out);
void api_tokenize(http_request *rq, http_reply *out);
void api_detokenize(http_request *rq, http_reply *out);
void api_metrics(http_request *rq, http_reply *out);

#endif
