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
typedef struct p2p_nccl_mem p2p_nccl_mem;

#ifdef PDSERVE_HAVE_NCCL

/* Checks that the device exists and makes it current on the calling thread. */
int p2p_nccl_use_device(int device, pd_err *err);
int p2p_nccl_unique_id(uint8_t uid[P2P_NCCL_UID_BYTES], pd_err *err);
/* Starts joining the 2-rank communicator named by uid as rank (0 or 1). */
int p2p_nccl_comm_start(const uint8_t uid[P2P_NCCL_UID_BYTES], int rank, int device,
                        int num_channels, p2p_nccl_comm **out, pd_err *err);
/* The join: 1 = done, 0 = still joining, -1 = failed (err). Transfers
 * may be posted before it is done; they start, in order, once it is. */
int p2p_nccl_comm_poll(p2p_nccl_comm *c, pd_err *err);
/* Aborts (never waits on a peer) and frees. Transfers still on it fail
 * ("NCCL communicator destroyed"); they may still be polled, and must be freed. */
void p2p_nccl_comm_destroy(p2p_nccl_comm *c);
/* Posts a send/recv of nbytes to/from the other rank on the comm's stream.
 * A send with ready_event (NULL: none) starts on the GPU only once the work
 * queued before that event is done, so the caller need not wait for the
 * kernels that write dev; the event must stay alive until the op is freed. */
int p2p_nccl_send(p2p_nccl_comm *c, const void *dev, size_t nbytes, void *ready_event,
                  p2p_nccl_op **out, pd_err *err);
int p2p_nccl_recv(p2p_nccl_comm *c, void *dev, size_t nbytes, p2p_nccl_op **out, pd_err *err);
/* 1 = complete, 0 = in flight, -1 = failed (err). */
int p2p_nccl_op_poll(p2p_nccl_op *op, pd_err *err);
void p2p_nccl_op_free(p2p_nccl_op *op);
/* A CUDA event (cudaEvent_t) for a caller to record after the work that
 * fills a buffer: a CUDA pd_backend's event_record takes it. */
int p2p_nccl_event_create(void **ev, pd_err *err);
void p2p_nccl_event_destroy(void *ev); /* NULL is fine */
/* Device buffers from a memory pool of the engine's own (CUDA's
 * stream-ordered allocator): cudaMalloc and cudaFree wait for the whole
 * GPU, which would stall the model's stream at every KV layer. The pool
 * keeps up to keep_bytes of freed memory for the next buffers. */
int p2p_nccl_mem_create(int device, size_t keep_bytes, p2p_nccl_mem **out, pd_err *err);
void p2p_nccl_mem_destroy(p2p_nccl_mem *m); /* buffers still out are freed as they come back */
/* The buffer is ready for any stream when it returns. */
void *p2p_nccl_alloc(p2p_nccl_mem *m, size_t nbytes, pd_err *err);
/* Gives p back (to its pool) once the work queued before after_event (NULL:
 * none) is done; nothing else may still use p on the GPU. Any thread. */
void p2p_nccl_free(void *p, void *after_event);

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
static inline int p2p_nccl_send(p2p_nccl_comm *c, const void *dev, size_t nbytes, void *ready_event,
                                p2p_nccl_op **out, pd_err *err) {
    (void)c, (void)dev, (void)nbytes, (void)ready_event;
    *out = NULL;
    return p2p_nccl_use_device(0, err);
}
static inline int p2p_nccl_recv(p2p_nccl_comm *c, void *dev, size_t nbytes, p2p_nccl_op **out,
                                pd_err *err) {
    return p2p_nccl_send(c, dev, nbytes, NULL, out, err);
}
static inline int p2p_nccl_op_poll(p2p_nccl_op *op, pd_err *err) {
    (void)op;
    return p2p_nccl_use_device(0, err);
}
static inline void p2p_nccl_op_free(p2p_nccl_op *op) {
    (void)op;
}
static inline int p2p_nccl_event_create(void **ev, pd_err *err) {
    *ev = NULL;
    return p2p_nccl_use_device(0, err);
}
static inline void p2p_nccl_event_destroy(void *ev) {
    (void)ev;
}
static inline int p2p_nccl_mem_create(int device, size_t keep_bytes, p2p_nccl_mem **out,
                                      pd_err *err) {
    (void)keep_bytes;
    *out = NULL;
    return p2p_nccl_use_device(device, err);
}
static inline void p2p_nccl_mem_destroy(p2p_nccl_mem *m) {
    (void)m;
}
static inline void *p2p_nccl_alloc(p2p_nccl_mem *m, size_t nbytes, pd_err *err) {
    (void)m, (void)nbytes;
    p2p_nccl_use_device(0, err);
    return NULL;
}
static inline void p2p_nccl_free(void *p, void *after_event) {
    (void)p, (void)after_event;
}

#endif
#endif
