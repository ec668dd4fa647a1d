/* p2p: the peer-to-peer KV transfer engine — moves named tensors (a request's
 * KV, layer by layer) from a producer instance to a consumer instance.
 *
 * Control plane: a libzmq ROUTER bound at kv_ip:kv_port receives requests;
 * one DEALER per peer (identity: our own "ip:port") sends them. Messages are
 * the msgpack maps of docs/kv-transfer.md (HELLO, NEW, PUT, DATA, GET, ABORT).
 * Data plane: tcp (the bytes are a further ZMQ frame of the same exchange,
 * host memory) or nccl (ncclSend/ncclRecv on the pair's communicator, device
 * memory). One I/O thread owns every socket; the calls below hand it work and
 * never touch a socket themselves, so they are safe from any thread.
 *
 * Deadlines are absolute times on pd_now()'s clock; a deadline <= 0 means
 * "now + timeout_s". Nothing here waits past its deadline: a dead or silent
 * peer fails the transfers that involve it, and no other. The engine moves
 * bytes; it does not interpret ids, shapes or dtypes. */
#ifndef P2P_H
#define P2P_H

#include "common/pd_common.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct pd_backend;

typedef enum { P2P_PUT = 0, P2P_PUT_ASYNC = 1, P2P_GET = 2 } p2p_send_type;
typedef enum { P2P_TCP = 0, P2P_NCCL = 1 } p2p_transport;

#define P2P_MAX_STREAMS 16

typedef struct p2p_config {
    const char *kv_ip;     /* bind/advertise address */
    int kv_port;           /* ROUTER bind port (0: pick a free one — for tests) */
    double kv_buffer_size; /* bytes the RECEIVER may hold for tensors not yet taken (also bounds the
                              GET store) */
    p2p_send_type send_type; /* informational here: every engine answers PUT and GET; callers pick
                                the calls */
    p2p_transport transport; /* tcp or nccl (nccl: NCCL compiled in, or p2p_create fails) */
    double timeout_s;        /* default deadline for every wait (0 → 30) */
    int nccl_num_channels;   /* NCCL maxCTAs for the pair communicators (0: NCCL's default) */
    const char *fingerprint; /* model fingerprint; peers must match (first contact) */
    /* nccl: the backend whose queued kernels fill the device buffers handed
     * to p2p_put / p2p_put_async / p2p_offer. Those calls then record an
     * event on its queue (so they must run on the backend's thread) and the
     * transfer waits for it on the GPU: callers need not wait for their
     * kernels. NULL: buffers are ready when handed over. Unused for tcp. */
    struct pd_backend *backend;
    int nccl_device; /* addition: CUDA device ordinal of the nccl transport (default 0) */
    /* Addition (tcp): TCP connections to each peer, tensors spread over them
     * (and as many ZMQ I/O threads), since one stream tops out near a
     * core's copy speed; 0 or 1: one (how vLLM talks). At most
     * P2P_MAX_STREAMS. */
    int tcp_streams;
    /* Addition: where tcp host buffers come from (p2p_buffer_alloc) and go
     * back to (p2p_buffer_free, and the engine once it has sent a
     * p2p_put_async / p2p_offer buffer, from any of its threads); NULL:
     * malloc and free. host_free must take what host_alloc gave. */
    void *(*host_alloc)(void *ctx, size_t nbytes);
    void (*host_free)(void *ctx, void *p);
    void *host_ctx;
    /* Addition (tcp): when set, each received tensor is copied out of ZMQ's
     * frame into a buffer from recv_alloc (host_ctx; freed with host_free),
     * on the I/O thread, so a consumer can hand page-locked memory to a
     * device copy without its own thread copying. It runs on the I/O thread
     * and must not block. NULL, or NULL returned: ZMQ's frame is kept (no
     * copy). The tensor's from_host_alloc says which it got. */
    void *(*recv_alloc)(void *ctx, size_t nbytes);
    /* Addition: called on this transfer engine's I/O thread, with its mutex
     * released, after received tensors became ready to take or failed, so a
     * consumer waiting for them can look at once instead of on a timer. It
     * must not block. NULL: nobody is told. */
    void (*on_arrival)(void *ctx);
    void *arrival_ctx;
} p2p_config;

typedef struct p2p_engine p2p_engine;

typedef struct p2p_tensor { /* a received tensor, owned by the caller after p2p_take */
    char id[128];
    char dtype[16];
    int ndim;
    int64_t shape[8];
    size_t nbytes;
    void *data; /* host memory, 8-byte aligned (tcp), or device memory (nccl); NULL when
                 * nbytes == 0 */
    bool on_device;
    bool from_host_alloc; /* data came from p2p_config.recv_alloc */
} p2p_tensor;

/* Binds the ROUTER and starts the I/O thread. */
int p2p_create(const p2p_config *cfg, p2p_engine **out, pd_err *err);
/* Clean stop: transfers in flight fail ("engine shut down"), the thread is
 * joined, sockets closed, communicators destroyed, buffers freed. Callers
 * blocked in p2p_put return first. No other call may start once this began. */
void p2p_destroy(p2p_engine *e);
const char *p2p_address(const p2p_engine *e); /* "ip:port" actually bound */

/* Producer side. peer = the consumer's "ip:port" (remote_kv_addr).
 * p2p_put: data (host for tcp, device for nccl) is only read during the call;
 *   blocks until the receiver reserved room and acknowledged the bytes,
 *   retrying "no room" with backoff until the deadline.
 * p2p_put_async: takes data_owned (malloc'd for tcp, p2p_buffer_alloc'd for
 *   nccl) — it belongs to the engine from the call on, even when the call
 *   fails — and returns at once; the outcome is p2p_send_status(id).
 * p2p_offer (GET mode): takes data_owned the same way and keeps it until the
 *   consumer pulls it, aborts it, or the deadline passes; the GET store holds
 *   at most kv_buffer_size bytes (an offer that does not fit fails at once). */
int p2p_put(p2p_engine *e, const char *peer, const char *id, const char *dtype, int ndim,
            const int64_t *shape, const void *data, size_t nbytes, double deadline, pd_err *err);
int p2p_put_async(p2p_engine *e, const char *peer, const char *id, const char *dtype, int ndim,
                  const int64_t *shape, void *data_owned, size_t nbytes, double deadline,
                  pd_err *err);
int p2p_offer(p2p_engine *e, const char *id, const char *dtype, int ndim, const int64_t *shape,
              void *data_owned, size_t nbytes, double deadline, pd_err *err);
/* For a p2p_put_async or p2p_offer id: 0 = in flight (or still offered),
 * 1 = delivered (pulled), -1 = failed (err says why: deadline, peer gone,
 * aborted by peer, ...). An unknown id is -1 ("no send"). The record stays
 * until p2p_forget_send. */
int p2p_send_status(p2p_engine *e, const char *id, pd_err *err);
void p2p_forget_send(p2p_engine *e, const char *id);

/* Consumer side. GET mode: p2p_fetch starts pulling id from peer in the
 * background. PUT modes: tensors arrive by themselves.
 * p2p_take never blocks: 1 = here (*out is the caller's; free it with
 * p2p_tensor_free, which also returns its bytes to the kv_buffer_size budget),
 * 0 = not yet, -1 = failed (err says why; the failure is reported once).
 * p2p_drop: give up on id — free what was received or reserved for it, discard
 * anything that arrives for it later, and tell the producer (ABORT) so it
 * frees its copy at once. */
int p2p_fetch(p2p_engine *e, const char *peer, const char *id, double deadline, pd_err *err);
int p2p_take(p2p_engine *e, const char *id, p2p_tensor **out, pd_err *err);
void p2p_tensor_free(p2p_engine *e, p2p_tensor *t);
void p2p_drop(p2p_engine *e, const char *peer, const char *id);

/* Addition: buffers for p2p_put_async / p2p_offer data_owned — host memory
 * for tcp (from p2p_config.host_alloc where set), device memory for nccl. */
void *p2p_buffer_alloc(p2p_engine *e, size_t nbytes, pd_err *err);
void p2p_buffer_free(p2p_engine *e, void *p);

/* Stats for /metrics. Counters are totals since p2p_create. */
typedef struct p2p_stats {
    uint64_t bytes_sent, bytes_received, sends_ok, sends_failed, recvs_ok, recvs_failed, retries,
        aborts;
    size_t buffered_bytes;             /* receiver: reserved + received + taken-not-freed */
    double send_seconds, recv_seconds; /* summed over successful transfers */
    /* additions */
    size_t
        offered_bytes; /* producer: bytes held in the GET store and by PUT_ASYNC sends in flight */
    double last_send_ms, last_recv_ms; /* the latest successful transfer */
    uint64_t fingerprint_mismatches;   /* peers refused (either side) */
    int connections;                   /* open connections to peers (tcp_streams each, at most) */
    uint64_t comm_resets; /* nccl: pair communicators torn down (each side counts its own) */
} p2p_stats;
void p2p_stats_get(p2p_engine *e, p2p_stats *out);

#endif
