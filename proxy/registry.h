/* registry: the proxy's table of prefill and decode instances and the
 * routing over them. An instance is (role, HTTP address) with a KV address;
 * it is static (from --prefill/--decode, never expires) or discovered (from
 * announcements, dropped --instance-timeout seconds after the last one). An
 * instance whose request failed is skipped for a short backoff while others
 * are available. Each instance keeps its slot (and its metrics) for the life
 * of the proxy, so counts survive an instance leaving and coming back.
 * Every function takes the current time, so tests can drive the clock. */
#ifndef PD_PROXY_REGISTRY_H
#define PD_PROXY_REGISTRY_H

#include <stdbool.h>

#include "common/pd_buf.h"
#include "common/pd_common.h"

typedef enum { ROLE_PREFILL = 0, ROLE_DECODE = 1 } px_role;

#define REG_ADDR_MAX 128
#define REG_MAX_SLOTS 1024

typedef struct reg_config {
    double instance_timeout; /* seconds */
    double failure_backoff;  /* seconds an instance is avoided after a failure */
    bool least_loaded;       /* fewest requests in flight (ties: round robin) */
} reg_config;

typedef struct registry registry;

/* What a pick hands out: the slot id (for release/observe) and addresses. */
typedef struct reg_pick {
    int id;
    char http[REG_ADDR_MAX];
    char kv[REG_ADDR_MAX];
} reg_pick;

registry *registry_create(const reg_config *cfg);
void registry_free(registry *r);
const char *px_role_name(px_role role); /* "prefill" / "decode" */

/* "host:port" or "[v6]:port", port 1..65535, no spaces; an http:// prefix
 * and a trailing '/' are stripped into out. */
int registry_check_addr(const char *addr, char out[REG_ADDR_MAX], pd_err *err);

int registry_add_static(registry *r, px_role role, const char *http, const char *kv, pd_err *err);
/* An announcement: 1 when the instance is new (or back), 0 when refreshed,
 * -1 when the table is full. */
int registry_announce(registry *r, px_role role, const char *http, const char *kv, double now);
/* Drop discovered instances not heard from in time (logs each). Returns how many. */
int registry_expire(registry *r, double now);

/* Choose an instance of the role, not one of exclude[]; counts it in flight.
 * Returns 0, or -1 when the role has no live instance. */
int registry_pick(registry *r, px_role role, const int *exclude, int n_exclude, double now,
                  reg_pick *out);
/* The picked request is over: seconds it took upstream, and whether the
 * instance failed it (then it is avoided for the backoff). */
void registry_release(registry *r, int id, double seconds, bool failed, double now);

/* Undo a pick without counting a request (e.g. a /v1/models lookup). */
void registry_unpick(registry *r, int id);

int registry_live(registry *r, px_role role, double now);
/* Entries not yet removed by a sweep (an expired entry counts until registry_expire drops it). */
int registry_size(registry *r);
/* {"prefill":[{"http_address":..,"zmq_address":..,"static":..,"in_flight":..}],"decode":[..]} */
void registry_json(registry *r, double now, pd_buf *b);
/* Per-instance Prometheus series. */
void registry_metrics(registry *r, double now, pd_buf *b);

#endif
