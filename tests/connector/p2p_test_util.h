/* p2p_test_util: helpers test_p2p.c (tcp) and test_p2p_nccl.c (nccl) share —
 * the byte pattern every tensor must hold, and polling a take or a send
 * until it settles. */
#ifndef PD_TEST_P2P_UTIL_H
#define PD_TEST_P2P_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <unistd.h>

#include "connector/p2p.h"

/* The bytes a tensor must hold: a xorshift stream seeded by its id. */
static inline void fill(const char *id, uint8_t *p, size_t n) {
    uint64_t s = 1469598103934665603ull;
    for (const char *c = id; *c; c++)
        s = (s ^ (uint8_t)*c) * 1099511628211ull;
    for (size_t i = 0; i < n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        p[i] = (uint8_t)s;
    }
}

/* Polls p2p_take until the tensor is here, failed, or `wait` seconds passed. */
static inline int take_wait(p2p_engine *e, const char *id, double wait, p2p_tensor **out,
                            pd_err *err) {
    double end = pd_now() + wait;
    for (;;) {
        int rc = p2p_take(e, id, out, err);
        if (rc != 0 || pd_now() > end) return rc;
        usleep(500);
    }
}

/* Polls p2p_send_status likewise. */
static inline int status_wait(p2p_engine *e, const char *id, double wait, pd_err *err) {
    double end = pd_now() + wait;
    for (;;) {
        int rc = p2p_send_status(e, id, err);
        if (rc != 0 || pd_now() > end) return rc;
        usleep(500);
    }
}

#endif
