/* p2p_internal: the KV transfer engine's state, shared by p2p.c (the calls,
 * which run in any thread) and p2p_io.c (the one I/O thread that owns every
 * socket). One mutex, e->mu, guards everything below except the sockets,
 * which only the I/O thread touches. */
#ifndef P2P_INTERNAL_H
#define P2P_INTERNAL_H

#include "connector/p2p.h"
#include "connector/p2p_msg.h"
#include "connector/p2p_nccl.h"

#include <pthread.h>
#include <stdatomic.h>
#include <zmq.h>

#define P2P_ADDR_MAX 64

/* A tensor's bytes, shared by an op and any ZMQ frame still sending them
 * (zero-copy): freed when the last reference goes. */
typedef struct p2p_blob {
    void *data;
    size_t nbytes;
    bool on_device;
    bool borrowed; /* the caller's memory (blocking PUT over nccl): never freed here */
    /* nccl: the caller's kernels that fill data were queued before this
     * event (p2p_nccl_event_create, recorded on p2p_config.backend), so
     * sends of data, and its freeing, wait for it on the GPU. NULL: data
     * was ready when handed over. Destroyed with the blob. */
    void *ready;
    /* Set for a caller's tcp buffer when p2p_config.host_free is: how it
     * goes back (else p2p_buffer_release). */
    void (*release)(void *ctx, void *p);
    void *release_ctx;
    atomic_int refs;
} p2p_blob;

/* What this side started: a PUT (blocking or async), a GET pull, or an offer. */
typedef enum { OP_PUT, OP_GET, OP_OFFER } op_kind;
typedef enum {
    OPS_START,         /* queued by a call; the I/O thread has not looked yet */
    OPS_WAIT_RESERVE,  /* PUT sent, waiting for {ret} */
    OPS_BACKOFF,       /* refused for lack of room (PUT) or room (GET); retry at retry_at */
    OPS_WAIT_COMM,     /* nccl: reserved, the pair's communicator is not ready yet */
    OPS_WAIT_ACK,      /* DATA sent, waiting for the receiver's ack (and nccl: our send) */
    OPS_WAIT_GET,      /* GET sent, waiting for the reply */
    OPS_RECVING,       /* nccl GET: ncclRecv posted */
    OPS_OFFERED,       /* in the GET store */
    OPS_OFFER_SENDING, /* nccl: ncclSend of an offer posted */
    OPS_DONE,
    OPS_FAILED,
} op_state;

typedef struct p2p_op {
    struct p2p_op *next;
    op_kind kind;
    op_state state;
    bool blocking;          /* a p2p_put caller waits for it and frees it */
    bool sent_any;          /* something reached the peer's queue: ABORT on failure */
    bool acked, local_done; /* nccl PUT: receiver ack and our send, both needed */
    bool ack_refused;       /* nccl PUT: the ack said "dropped, drained": fail once sent */
    bool forgotten;         /* p2p_forget_send came first: free the record when it ends */
    bool dropped;           /* p2p_drop while an ncclRecv was posted: discard when it ends */
    bool reap;              /* unlink and free at the end of this I/O iteration */
    int retries;
    int lane; /* which of the peer's connections (tcp_streams) carries it */
    uint64_t asked_comm_gen; /* nccl: the peer's comm_gen when our PUT or GET went out */
    bool lane_chosen;
    char id[P2P_ID_MAX];
    char peer[P2P_ADDR_MAX];
    p2p_meta meta;
    p2p_blob *data;  /* PUT / offer: the bytes */
    size_t reserved; /* GET: budget held for the reply */
    size_t want;     /* GET: the size the producer said (0: unknown yet) */
    double t_start, deadline, retry_at, backoff;
    p2p_nccl_op *nop;           /* nccl transfer in progress */
    void *dev_buf;              /* nccl GET: device buffer being received into */
    char in_peer[P2P_ADDR_MAX]; /* offer being sent over nccl: to whom */
    pd_err err;
} p2p_op;

/* What arrived (or is arriving) for this side to take. */
typedef enum { RX_RESERVED, RX_RECVING, RX_READY, RX_FAILED, RX_DROPPED } rx_state;

/* A received tensor as handed out: the public part first, so p2p_tensor_free
 * can find the rest. */
typedef struct p2p_rx_tensor {
    p2p_tensor pub;
    zmq_msg_t msg; /* the ZMQ frame holding the bytes (tcp, when aligned) */
    bool has_msg;
    void (*host_free)(void *ctx, void *p); /* for pub.from_host_alloc */
    void *host_ctx;
    size_t counted; /* bytes it holds in the kv_buffer_size budget */
} p2p_rx_tensor;

typedef struct p2p_rx {
    struct p2p_rx *next;
    char id[P2P_ID_MAX];
    char peer[P2P_ADDR_MAX]; /* the producer's identity / address */
    rx_state state;
    p2p_meta meta;
    size_t counted;        /* budget bytes held (reserved or received) */
    p2p_rx_tensor *tensor; /* READY */
    void *dev_buf;         /* nccl: reserved device buffer */
    p2p_nccl_op *nop;      /* nccl: ncclRecv in progress */
    double t_start, expires;
    /* p2p_drop while an ncclRecv was posted, or (nccl) while reserved:
     * the bytes are still taken off the communicator, then discarded, so
     * the sender's ncclSend has its partner. */
    bool dropped;
    pd_err err;
} p2p_rx;

/* A peer that talks to our ROUTER, by its identity. */
typedef struct p2p_inpeer {
    struct p2p_inpeer *next;
    char identity[P2P_ADDR_MAX];
    int verified; /* 1: fingerprint matched; -1: mismatch (error says) */
    char error[sizeof(pd_err)];
    p2p_nccl_comm *comm; /* nccl: we are rank 1 */
    bool comm_ready;
    double comm_deadline;
} p2p_inpeer;

/* A connection to a peer: our DEALER to its ROUTER. With tcp_streams > 1
 * a peer has one per lane; lane 0's identity is our address, lane n's is
 * "<our address>/n" (p2p_same_peer). */
typedef struct p2p_peer {
    struct p2p_peer *next;
    char addr[P2P_ADDR_MAX];
    int lane;
    void *dealer;
    bool hello_ok;
    bool dead;           /* closed this iteration; freed at the top of the next */
    double last_used;    /* idle peers are closed (a dead one would be redialled forever) */
    p2p_nccl_comm *comm; /* nccl: we are rank 0 */
    bool comm_ready;
    double comm_deadline;
    uint64_t comm_gen; /* NEWs sent to it so far */
} p2p_peer;

/* An ABORT to send (from p2p_drop or a failed transfer). */
typedef struct p2p_abort_req {
    struct p2p_abort_req *next;
    char peer[P2P_ADDR_MAX];
    char id[P2P_ID_MAX];
} p2p_abort_req;

struct p2p_engine {
    p2p_config cfg;
    char *kv_ip, *fingerprint; /* owned copies of the config strings */
    char addr[P2P_ADDR_MAX];
    size_t budget; /* kv_buffer_size in bytes */
    double timeout_s;

    void *zctx;
    void *router;
    int wake_fd; /* eventfd: calls wake the I/O thread's zmq_poll */
    pthread_t io_thread;
    bool io_started;

    pthread_mutex_t mu;
    pthread_cond_t cv; /* an op finished / a waiter left */
    bool stopping;
    bool arrived; /* a tensor became ready or failed since cfg.on_arrival last ran */
    int waiters; /* callers blocked in p2p_put */

    p2p_op *ops;
    p2p_rx *rx;
    p2p_inpeer *inpeers;
    p2p_peer *peers;
    p2p_abort_req *aborts;
    size_t buffered;      /* receiver budget in use */
    size_t offer_bytes;   /* GET store */
    size_t async_bytes;   /* PUT_ASYNC in flight */
    size_t get_size_hint; /* GET: the size of the last tensor pulled (layers are alike) */
    int lanes;            /* connections per peer (tcp_streams; 1 on nccl) */
    p2p_nccl_mem *dev_mem; /* nccl: where device buffers come from */
    unsigned next_lane;   /* round robin over them, per op */
    p2p_stats stats;
};

/* Whether two identities are the same peer engine (lanes of one peer
 * differ only after a '/'). */
bool p2p_same_peer(const char *a, const char *b);

/* p2p.c */
p2p_blob *p2p_blob_wrap(void *data, size_t nbytes, bool on_device);
void p2p_blob_unref(p2p_blob *b);
void p2p_engine_wake(p2p_engine *e);
void p2p_op_free(p2p_op *op);
void p2p_rx_free(p2p_rx *rx);
void p2p_buffer_release(bool on_device, void *p);

/* p2p_io.c: the I/O thread and what its two halves share */
void *p2p_io_main(void *arg);
/* Sends [identity][msg][bytes] (identity NULL on a DEALER, data NULL for none);
 * the bytes go zero-copy, holding a reference on data until ZMQ is done. */
int p2p_io_send(void *sock, const char *identity, const p2p_buf *msg, p2p_blob *data, pd_err *err);
/* Ends an op: state, stats, budget, ABORT to the peer when it failed after
 * reaching it, waking p2p_put. Never touches a socket (p2p.c calls it too).
 * An op with an NCCL transfer posted must have had its communicator destroyed first. */
void p2p_op_finish(p2p_engine *e, p2p_op *op, bool ok, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
void p2p_queue_abort(p2p_engine *e, const char *peer, const char *id);
void p2p_rx_fail(p2p_engine *e, const char *id, const char *peer, const pd_err *why);
p2p_rx *p2p_rx_lookup(p2p_engine *e, const char *id);
/* A received tensor around a ZMQ frame (kept when suitably aligned, else
 * copied; copied into recv_alloc memory where that is set) or a
 * device buffer. */
p2p_rx_tensor *p2p_rx_tensor_make(const p2p_engine *e, const char *id, const p2p_meta *meta,
                                  zmq_msg_t *frame, void *dev_buf);
void p2p_rx_tensor_release(p2p_rx_tensor *t);
/* Makes rx READY with t, counting its bytes in the budget, and updates receive stats. */
void p2p_rx_ready(p2p_engine *e, p2p_rx *rx, p2p_rx_tensor *t, double t_start);

/* p2p_client.c: our DEALERs — PUT and GET as the side that asks */
void p2p_client_start(p2p_engine *e, p2p_op *op);
void p2p_client_reply(p2p_engine *e, p2p_peer *peer, zmq_msg_t *frames, int nframes);
void p2p_client_abort(p2p_engine *e, const char *addr, const char *id);
void p2p_client_poll_nccl(p2p_engine *e, double now);
/* Closes connections unused for max(60 s, 2 x timeout_s); the next use redials (and re-HELLOs). */
void p2p_client_close_idle(p2p_engine *e, double now);
/* Fails the ops in flight with peer and closes it (fingerprint mismatch, shutdown). */
void p2p_peer_close(p2p_engine *e, p2p_peer *peer, const char *why);
/* Destroys an op's NCCL communicator (aborting every transfer on it) and fails those ops. */
void p2p_client_comm_reset(p2p_engine *e, const char *addr, const char *why);

/* Makes rx a tombstone: its budget and device buffer (if any) back, and
 * anything arriving for its id within 2 x timeout_s discarded. A received
 * tensor it holds is the caller's to release first. */
void p2p_rx_tombstone(p2p_engine *e, p2p_rx *rx, double now);

/* p2p_serve.c: our ROUTER — answering HELLO, NEW, PUT, DATA, GET, ABORT */
void p2p_serve_request(p2p_engine *e, zmq_msg_t *frames, int nframes);
void p2p_serve_poll_nccl(p2p_engine *e, double now);
void p2p_serve_comm_reset(p2p_engine *e, const char *identity, const char *why);

#endif
