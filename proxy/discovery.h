/* discovery: the proxy side of instance discovery (docs/protocol.md). A
 * thread owns a ZMQ ROUTER bound on the discovery port; every message is
 * [identity, ..., payload] with payload the msgpack map
 * {"type": "P"|"D", "http_address": "IP:PORT", "zmq_address": "IP:PORT"}.
 * Good messages register or refresh an instance in the registry; anything
 * else is logged and ignored — a bad message never stops discovery. The
 * thread also expires silent instances. */
#ifndef PD_PROXY_DISCOVERY_H
#define PD_PROXY_DISCOVERY_H

#include <stddef.h>

#include "common/pd_common.h"
#include "proxy/registry.h"

typedef struct disc_msg {
    px_role role;
    char http[REG_ADDR_MAX];
    char kv[REG_ADDR_MAX];
} disc_msg;

/* Decode and validate one payload. */
int discovery_decode(const void *buf, size_t len, disc_msg *out, pd_err *err);

typedef struct discovery discovery;

/* Bind tcp://HOST:PORT (host NULL: all interfaces; port 0: any free port,
 * see discovery_port) and start the thread. */
int discovery_start(registry *reg, const char *host, int port, discovery **out, pd_err *err);
int discovery_port(const discovery *d);
/* Messages accepted and rejected so far (for tests and /health). */
void discovery_counts(discovery *d, unsigned long long *accepted, unsigned long long *rejected);
void discovery_stop(discovery *d);

#endif
