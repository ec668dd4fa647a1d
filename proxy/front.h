/* front: the proxy's HTTP side on libmicrohttpd, one thread per client
 * connection (a handler blocks while its upstream hops run; a slow client
 * holds only its own thread). Routes: POST /v1/completions and
 * /v1/chat/completions (the three hops, flow.c), GET /v1/models (from a
 * decode instance), /health (the instances it knows, 503 while a role has
 * none) and /metrics (Prometheus). With --api-key, every /v1 path needs
 * `Authorization: Bearer KEY`. The second half of this header is the small
 * interface between front.c and flow.c. */
#ifndef PD_PROXY_FRONT_H
#define PD_PROXY_FRONT_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>

#include "common/pd_common.h"
#include "proxy/discovery.h"
#include "proxy/metrics.h"
#include "proxy/registry.h"
#include "proxy/upstream.h"

typedef struct front_config {
    const char *host; /* NULL: all interfaces */
    int port;         /* 0: any free port */
    const char *api_key;
    const char *upstream_api_key; /* sent to instances; NULL: pass the client's header on */
    double timeout;               /* seconds a client request may take end to end */
    size_t max_body_bytes;
} front_config;

typedef struct front front;

int front_start(const front_config *cfg, registry *reg, upstream_pool *pool, proxy_metrics *pm,
                discovery *disc, front **out, pd_err *err);
int front_port(const front *f);
/* Stop accepting connections; requests in flight continue. */
void front_quiesce(front *f);
int front_active(front *f);
/* Cancel everything in flight, close and free. */
void front_stop(front *f);

/* ---- internal: shared by front.c and flow.c ------------------------------- */

struct MHD_Connection;
struct MHD_Response;

typedef struct front_ctx {
    front_config cfg;
    registry *reg;
    upstream_pool *pool;
    proxy_metrics *pm;
    discovery *disc;
    uint64_t id_salt;
    atomic_ullong next_id;
    atomic_int active;
    atomic_bool draining; /* SIGTERM: new generations get 503, /health says so */
    atomic_bool hard_stop;
} front_ctx;

typedef struct front_reply {
    unsigned status;
    struct MHD_Response *resp;
    bool close; /* drop the connection (the client is gone) */
} front_reply;

/* Takes ownership of body (NULL: empty). */
void front_reply_body(front_reply *r, unsigned status, const char *content_type, char *body,
                      size_t len);
void front_reply_error(front_reply *r, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* POST /v1/completions and /v1/chat/completions. */
void flow_generate(front_ctx *fx, struct MHD_Connection *conn, const char *url, const char *body,
                   size_t len, front_reply *out);
/* GET /v1/models, relayed from a decode (else prefill) instance. */
void flow_models(front_ctx *fx, struct MHD_Connection *conn, front_reply *out);

#endif
