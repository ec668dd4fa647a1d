/* announce: the instance side of discovery (docs/protocol.md, "Discovery").
 * A kv instance with a proxy configured runs one announcer: a thread with a
 * ZMQ DEALER connected to tcp://proxy_ip:proxy_port that sends the msgpack
 * map {"type": "P"|"D", "http_address": "IP:PORT", "zmq_address": "IP:PORT"}
 * at start and every interval (3 s by default); a kv_both instance sends one
 * message of each type. The proxy forgets an instance that stops sending, so
 * stopping the announcer is how an instance leaves. */
#ifndef PD_CONNECTOR_ANNOUNCE_H
#define PD_CONNECTOR_ANNOUNCE_H

#include <stdbool.h>
#include <stddef.h>

#include "common/pd_common.h"
#include "connector/connector.h"

#define ANNOUNCE_DEFAULT_INTERVAL_MS 3000
#define ANNOUNCE_DEFAULT_KV_PORT 14579

typedef struct announce_config {
    const char *proxy_ip;
    int proxy_port;
    bool prefill, decode;     /* send "P", "D" or both (kv_both) */
    const char *http_address; /* "IP:HTTP_PORT" */
    const char *zmq_address;  /* "IP:KV_PORT" */
    int interval_ms;          /* 0: ANNOUNCE_DEFAULT_INTERVAL_MS */
} announce_config;

typedef struct announcer announcer;

/* Start the thread; the strings are copied. */
int announcer_start(const announce_config *cfg, announcer **out, pd_err *err);
/* Stop the thread and close the socket at once (linger 0). NULL is a no-op. */
void announcer_stop(announcer *a);

/* Encode one announcement as a msgpack map into a new buffer (caller frees). */
int announce_encode(const char *type, const char *http_address, const char *zmq_address, char **buf,
                    size_t *len, pd_err *err);

/* For `pdserve serve`: when the parsed --kv-transfer-config names a proxy,
 * announce this instance — as P, D or both by kv_role, at kv_address (the
 * connector's bound "ip:port") and at an HTTP address made of host (--host;
 * NULL or "0.0.0.0": the KV address's host) and http_port (or the config's
 * http_port). *out stays NULL when no proxy is configured. */
int announcer_start_for_instance(const kv_transfer_config *kv, const char *kv_address, const char *host,
                                 int http_port, announcer **out, pd_err *err);

#endif
