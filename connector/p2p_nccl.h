/* p2p_nccl: the nccl data plane of the KV transfer engine — 2-rank
 * communicators per peer pair, ncclSend/ncclRecv of device buffers on a
 * dedicated stream, and device buffers. Nothing here blocks: communicators are
 * created non-blocking and every operation is polled, so the I/O thread that
 * drives them keeps serving other peers and enforces deadlines (a communicator
 * past its deadline is aborted).
 *
 * Without NCCL compiled in (PDSERVE_HAVE_NCCL undefined), the same calls exist
 * as stubs that fail, and p2p_create refuses transport nccl up front. */
#ifndef P2P_NCCL_H
#define P2P_NCCL_H

#include "common/pd_common.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define P2P_NCCL_UID_BYTES 128

typedef struct p2p_nccl_comm p2p_nccl_comm;
typedef struct p2p_nccl_op p2p_nccl_op;

#ifdef PDSERVE_HAVE_NCCL

/* Checks that the device exists and makes it current on the calling thread. */
int p2p_nccl_use_device(int device, pd_err *err);
int p2p_nccl_unique_id(uint8_t uid[P2P_NCCL_UID_BYTES], pd_err *err);
/* Starts joining the 2-rank communicator named by uid as rank (0 or 1). */
int p2p_nccl_comm_start(const uint8_t uid[P2P_NCCL_UID_BYTES], int rank, int device,
                        int num_channels, p2p_nccl_comm **out, pd_err *err);
/* 1 = ready, 0 = still joining, -1 = failed (err). */
int p2p_nccl_comm_poll(p2p_nccl_comm *c, pd_err *err);
/* Aborts (never waits on a peer) and frees. Ops on it must not be polled afterwards. */
void p2p_nccl_comm_destroy(p2p_nccl_comm *c);
/* Posts a send/recv of nbytes to/from the other rank on the comm's stream. */
int p2p_nccl_send(p2p_nccl_comm *c, const void *dev, size_t nbytes, p2p_nccl_op **out, pd_err *err);
int p2p_nccl_recv(p2p_nccl_comm *c, void *dev, size_t nbytes, p2p_nccl_op **out, pd_err *err);
/* 1 = complete, 0 = in flight, -1 = failed (err). */
int p2p_nccl_op_poll(p2p_nccl_op *op, pd_err *err);
void p2p_nccl_op_free(p2p_nccl_op *op);
void *p2p_nccl_alloc(int device, size_t nbytes, pd_err *err);
void p2p_nccl_free(void *p);

#else

static inline int p2p_nccl_use_device(int device, pd_err *err) {
    (void)device;
    return pd_fail(
        err,
        "transport nccl: pdserve was built without NCCL (PDSERVE_NCCL / CUDA runtime not found)");
}
static inline int p2p_nccl_unique_id(uint8_t uid[P2P_NCCL_UID_BYTES], pd_err *err) {
    (void)uid;
    return p2p_nccl_use_device(0, err);
}
static inline int p2p_nccl_comm_start(const uint8_t uid[P2P_NCCL_UID_BYTES], int rank, int device,
                                      int num_channels, p2p_nccl_comm **out, pd_err *err) {
    (void)uid, (void)rank, (void)num_channels;
    *out = NULL;
    return p2p_nccl_use_device(device, err);
}
static inline int p2p_nccl_comm_poll(p2p_nccl_comm *c, pd_err *err) {
    (void)c;
    return p2p_nccl_use_device(0, err);
}
static inline void p2p_nccl_comm_destroy(p2p_nccl_comm *c) {
    (void)c;
}
static inline int p2p_nccl_send(p2p_nccl_comm *c, const void *dev, size_t nbytes, p2p_nccl_op **out,
                                pd_err *err) {
    (void)c, (void)dev, (void)nbytes;
    *out = NULL;
    return p2p_nccl_use_device(0, err);
}
static inline int p2p_nccl_recv(p2p_nccl_comm *c, void *dev, size_t nbytes, p2p_nccl_op **out,
                                pd_err *err) {
    return p2p_nccl_send(c, dev, nbytes, out, err);
}
static inline int p2p_nccl_op_poll(p2p_nccl_op *op, pd_err *err) {
    (void)op;
    return p2p_nccl_use_device(0, err);
}
static inline void p2p_nccl_op_free(p2p_nccl_op *op) {
    (void)op;
}
static inline void *p2p_nccl_alloc(int device, size_t nbytes, pd_err *err) {
    (void)nbytes;
    p2p_nccl_use_device(device, err);
    return NULL;
}
static inline void p2p_nccl_free(void *p) {
    (void)p;
}

#endif
#endif
