/* p2p_nccl: the nccl data plane (see p2p_nccl.h) — compiled only when the CUDA
 * runtime and NCCL are found (PDSERVE_HAVE_NCCL).
 *
 * Communicators are non-blocking (ncclConfig_t.blocking = 0): joining one, and
 * the first send/recv on it (which builds the connection), return at once and
 * are polled with ncclCommGetAsyncError, so a peer that never shows up costs a
 * deadline, not a hung thread. NCCL allows one call in progress per
 * communicator, so each communicator keeps a FIFO of posted transfers and
 * launches the next only when the previous call completed; FIFO order is also
 * what keeps our sends lined up with the peer's receives. A transfer is done
 * when the CUDA event recorded after it on the communicator's own stream has
 * fired. All transfers are bytes (ncclInt8); the peer is always rank ^ 1. */
#ifdef PDSERVE_HAVE_NCCL
#include "connector/p2p_nccl.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(sizeof(ncclUniqueId) == P2P_NCCL_UID_BYTES, "ncclUniqueId size");

struct p2p_nccl_op {
    p2p_nccl_comm *c;         /* NULL once the communicator is gone */
    struct p2p_nccl_op *next; /* in c->ops (all of the comm's transfers) */
    bool is_send;
    cudaEvent_t ready; /* send: start after this event on the GPU (NULL: at once) */
    void *buf;
    size_t nbytes;
    bool posted;   /* the NCCL call was made */
    bool launched; /* the NCCL call completed and the event is recorded */
    bool failed;
    char error[sizeof(pd_err)];
    cudaEvent_t ev;
};

struct p2p_nccl_comm {
    ncclComm_t comm;
    cudaStream_t stream;
    int rank, device;
    p2p_nccl_op *ops;       /* every transfer not yet freed, in posting order */
    p2p_nccl_op *enqueuing; /* the call NCCL is still completing (ncclInProgress) */
    bool joined;            /* ncclCommInitRankConfig has completed here */
    bool broken;            /* a transfer failed: nothing more is launched (comm_break) */
    char broken_why[sizeof(pd_err)];
};

static int cuda_fail(pd_err *err, const char *what, cudaError_t rc) {
    return pd_fail(err, "%s: %s", what, cudaGetErrorString(rc));
}

static int nccl_fail(pd_err *err, const char *what, ncclResult_t rc, ncclComm_t comm) {
    const char *last = comm ? ncclGetLastError(comm) : NULL;
    /* The one mistake every first try on one machine makes gets its fix. */
    const char *hint = last && strstr(last, "Duplicate GPU")
                           ? " (NCCL puts one rank on a GPU: give the prefill and decode "
                             "instances different GPUs with --device, or use transport tcp)"
                           : "";
    return pd_fail(err, "%s: %s%s%s%s", what, ncclGetErrorString(rc), last && last[0] ? ": " : "",
                   last ? last : "", hint);
}

int p2p_nccl_use_device(int device, pd_err *err) {
    int n = 0;
    cudaError_t rc = cudaGetDeviceCount(&n);
    if (rc != cudaSuccess) return cuda_fail(err, "transport nccl: no CUDA device", rc);
    if (device < 0 || device >= n)
        return pd_fail(err, "transport nccl: device %d does not exist (%d found)", device, n);
    rc = cudaSetDevice(device);
    return rc == cudaSuccess ? 0 : cuda_fail(err, "cudaSetDevice", rc);
}

int p2p_nccl_unique_id(uint8_t uid[P2P_NCCL_UID_BYTES], pd_err *err) {
    ncclUniqueId id;
    ncclResult_t rc = ncclGetUniqueId(&id);
    if (rc != ncclSuccess) return nccl_fail(err, "ncclGetUniqueId", rc, NULL);
    memcpy(uid, id.internal, P2P_NCCL_UID_BYTES);
    return 0;
}

int p2p_nccl_comm_start(const uint8_t uid[P2P_NCCL_UID_BYTES], int rank, int device,
                        int num_channels, p2p_nccl_comm **out, pd_err *err) {
    *out = NULL;
    if (p2p_nccl_use_device(device, err) != 0) return -1;
    p2p_nccl_comm *c = calloc(1, sizeof *c);
    if (!c) return pd_fail(err, "out of memory");
    c->rank = rank;
    c->device = device;
    cudaError_t crc = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
    if (crc != cudaSuccess) {
        free(c);
        return cuda_fail(err, "cudaStreamCreate", crc);
    }
    ncclUniqueId id;
    memcpy(id.internal, uid, P2P_NCCL_UID_BYTES);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    if (num_channels > 0) cfg.maxCTAs = num_channels;
    ncclResult_t rc = ncclCommInitRankConfig(&c->comm, 2, id, rank, &cfg);
    if (rc != ncclSuccess && rc != ncclInProgress) {
        cudaStreamDestroy(c->stream);
        free(c);
        return nccl_fail(err, "ncclCommInitRankConfig", rc, NULL);
    }
    *out = c;
    return 0;
}

/* State of the communicator's last call: 1 done, 0 in progress, -1 failed. */
static int comm_state(p2p_nccl_comm *c, pd_err *err) {
    ncclResult_t st;
    ncclResult_t rc = ncclCommGetAsyncError(c->comm, &st);
    if (rc != ncclSuccess) return nccl_fail(err, "ncclCommGetAsyncError", rc, c->comm);
    if (st == ncclInProgress) return 0;
    if (st != ncclSuccess) return nccl_fail(err, "NCCL communicator", st, c->comm);
    return 1;
}

int p2p_nccl_comm_poll(p2p_nccl_comm *c, pd_err *err) {
    /* Once joined, ncclCommGetAsyncError speaks of the last transfer call
     * (ncclInProgress while a first send builds its connection): not the
     * join's business. Transfers report their own errors. */
    if (c->joined) return 1;
    int st = comm_state(c, err);
    if (st == 1) c->joined = true;
    return st;
}

static void op_fail(p2p_nccl_op *op, const char *msg) {
    op->failed = true;
    snprintf(op->error, sizeof op->error, "%s", msg);
}

/* Stops the communicator's queue: the transfer that failed (if any) and
 * every one whose NCCL call was not made yet fail, now and when posted
 * later. Launching the next one instead would let it take the failed
 * one's place, and the peer's receive would pair with the wrong send. The
 * owner tears the communicator down when it sees the failure. */
static void comm_break(p2p_nccl_comm *c, p2p_nccl_op *failed, const char *why) {
    if (!c->broken) {
        c->broken = true;
        snprintf(c->broken_why, sizeof c->broken_why, "%s", why ? why : "NCCL communicator failed");
    }
    if (failed) op_fail(failed, why ? why : c->broken_why);
    for (p2p_nccl_op *op = c->ops; op; op = op->next)
        if (!op->posted) op->posted = true, op_fail(op, c->broken_why);
}

/* op's NCCL call has completed: its event, recorded after it on the
 * stream, tells when the transfer is done. false: the queue stopped. */
static bool mark_launched(p2p_nccl_comm *c, p2p_nccl_op *op) {
    cudaError_t crc = cudaEventRecord(op->ev, c->stream);
    if (crc != cudaSuccess) {
        comm_break(c, op, cudaGetErrorString(crc));
        return false;
    }
    op->launched = true;
    return true;
}

/* Launches posted transfers in order, one NCCL call in progress at a time. */
static void comm_pump(p2p_nccl_comm *c) {
    pd_err err;
    if (c->broken) {
        comm_break(c, NULL, NULL);
        return;
    }
    /* Transfers may be posted while the join is still completing here: the
     * peer finishes first and its DATA or GET answer arrives while our side
     * still says in progress. They wait, in order, for it. */
    int joined = p2p_nccl_comm_poll(c, &err);
    if (joined == 0) return;
    if (joined < 0) {
        comm_break(c, NULL, err.msg);
        return;
    }
    if (c->enqueuing) {
        int st = comm_state(c, &err);
        if (st == 0) return;
        p2p_nccl_op *op = c->enqueuing;
        c->enqueuing = NULL;
        if (st < 0) {
            comm_break(c, op, err.msg);
            return;
        }
        if (!mark_launched(c, op)) return;
    }
    for (p2p_nccl_op *op = c->ops; op; op = op->next) {
        if (op->posted) continue;
        op->posted = true;
        int peer = c->rank ^ 1;
        if (op->ready) {
            /* The buffer's writer queued its kernels elsewhere: order the
             * send after them on the GPU, not by waiting here. */
            cudaError_t crc = cudaStreamWaitEvent(c->stream, op->ready, 0);
            if (crc != cudaSuccess) {
                comm_break(c, op, cudaGetErrorString(crc));
                return;
            }
        }
        ncclResult_t rc = op->is_send
                              ? ncclSend(op->buf, op->nbytes, ncclInt8, peer, c->comm, c->stream)
                              : ncclRecv(op->buf, op->nbytes, ncclInt8, peer, c->comm, c->stream);
        if (rc == ncclInProgress) {
            c->enqueuing = op;
            return;
        }
        if (rc != ncclSuccess) {
            nccl_fail(&err, op->is_send ? "ncclSend" : "ncclRecv", rc, c->comm);
            comm_break(c, op, err.msg);
            return;
        }
        if (!mark_launched(c, op)) return;
    }
}

static int post(p2p_nccl_comm *c, bool is_send, void *buf, size_t nbytes, void *ready,
                p2p_nccl_op **out, pd_err *err) {
    *out = NULL;
    p2p_nccl_op *op = calloc(1, sizeof *op);
    if (!op) return pd_fail(err, "out of memory");
    cudaError_t crc = cudaEventCreateWithFlags(&op->ev, cudaEventDisableTiming);
    if (crc != cudaSuccess) {
        free(op);
        return cuda_fail(err, "cudaEventCreate", crc);
    }
    op->c = c;
    op->is_send = is_send;
    op->ready = (cudaEvent_t)ready;
    op->buf = buf;
    op->nbytes = nbytes;
    p2p_nccl_op **pp = &c->ops;
    while (*pp)
        pp = &(*pp)->next;
    *pp = op;
    comm_pump(c);
    *out = op;
    return 0;
}

int p2p_nccl_send(p2p_nccl_comm *c, const void *dev, size_t nbytes, void *ready_event,
                  p2p_nccl_op **out, pd_err *err) {
    return post(c, true, (void *)dev, nbytes, ready_event, out, err);
}

int p2p_nccl_recv(p2p_nccl_comm *c, void *dev, size_t nbytes, p2p_nccl_op **out, pd_err *err) {
    return post(c, false, dev, nbytes, NULL, out, err);
}

int p2p_nccl_op_poll(p2p_nccl_op *op, pd_err *err) {
    if (!op->c && !op->failed) op_fail(op, "NCCL communicator destroyed");
    if (op->c) comm_pump(op->c);
    if (op->failed) return pd_fail(err, "%s", op->error);
    if (!op->launched) return 0;
    cudaError_t crc = cudaEventQuery(op->ev);
    if (crc == cudaErrorNotReady) {
        /* Still running: an asynchronous NCCL error (peer gone) would show here. */
        if (op->c && comm_state(op->c, err) < 0) return -1;
        return 0;
    }
    if (crc != cudaSuccess) return cuda_fail(err, "NCCL transfer", crc);
    return 1;
}

void p2p_nccl_op_free(p2p_nccl_op *op) {
    if (!op) return;
    if (op->c) {
        for (p2p_nccl_op **pp = &op->c->ops; *pp; pp = &(*pp)->next) {
            if (*pp == op) {
                *pp = op->next;
                break;
            }
        }
        if (op->c->enqueuing == op) op->c->enqueuing = NULL;
    }
    cudaEventDestroy(op->ev);
    free(op);
}

void p2p_nccl_comm_destroy(p2p_nccl_comm *c) {
    if (!c) return;
    /* Abort, not finalize: it never waits for the peer, and it stops transfers in flight. */
    ncclCommAbort(c->comm);
    cudaStreamSynchronize(c->stream);
    cudaStreamDestroy(c->stream);
    for (p2p_nccl_op *op = c->ops; op; op = op->next) {
        op->c = NULL;
        if (!op->launched && !op->failed) op_fail(op, "NCCL communicator destroyed");
    }
    free(c);
}

int p2p_nccl_event_create(void **ev, pd_err *err) {
    cudaEvent_t e = NULL;
    cudaError_t crc = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    *ev = crc == cudaSuccess ? e : NULL;
    return crc == cudaSuccess ? 0 : cuda_fail(err, "cudaEventCreate", crc);
}

void p2p_nccl_event_destroy(void *ev) {
    if (ev) cudaEventDestroy((cudaEvent_t)ev); /* CUDA keeps it until pending waits are done */
}

struct p2p_nccl_mem {
    cudaMemPool_t pool;
    int device;
};

/* Makes device current on this thread and returns the one to go back to. */
static int enter_device(int device) {
    int prev = -1;
    cudaGetDevice(&prev);
    if (prev != device) cudaSetDevice(device);
    return prev;
}

static void leave_device(int prev, int device) {
    if (prev >= 0 && prev != device) cudaSetDevice(prev);
}

int p2p_nccl_mem_create(int device, size_t keep_bytes, p2p_nccl_mem **out, pd_err *err) {
    *out = NULL;
    p2p_nccl_mem *m = calloc(1, sizeof *m);
    if (!m) return pd_fail(err, "out of memory");
    m->device = device;
    struct cudaMemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    cudaError_t crc = cudaMemPoolCreate(&m->pool, &props);
    if (crc != cudaSuccess) {
        free(m);
        return cuda_fail(err, "transport nccl: cudaMemPoolCreate", crc);
    }
    /* Without a threshold the pool hands freed memory back to the driver at
     * every synchronization, and each layer's buffer would be mapped anew. */
    uint64_t keep = keep_bytes;
    cudaMemPoolSetAttribute(m->pool, cudaMemPoolAttrReleaseThreshold, &keep);
    *out = m;
    return 0;
}

void p2p_nccl_mem_destroy(p2p_nccl_mem *m) {
    if (!m) return;
    cudaMemPoolDestroy(m->pool);
    free(m);
}

/* Allocation and freeing are ordered on the calling thread's per-thread
 * default stream, which nothing else of ours uses; the sync after an
 * allocation is what makes the buffer usable from every other stream (it
 * also waits for a reused block's earlier free, see p2p_nccl_free). */
void *p2p_nccl_alloc(p2p_nccl_mem *m, size_t nbytes, pd_err *err) {
    int prev = enter_device(m->device);
    void *p = NULL;
    cudaError_t crc =
        cudaMallocFromPoolAsync(&p, nbytes ? nbytes : 1, m->pool, cudaStreamPerThread);
    if (crc == cudaSuccess) crc = cudaStreamSynchronize(cudaStreamPerThread);
    leave_device(prev, m->device);
    if (crc != cudaSuccess) {
        cudaGetLastError();
        cuda_fail(err, "transport nccl: device buffer", crc);
        if (p) cudaFreeAsync(p, cudaStreamPerThread);
        return NULL;
    }
    return p;
}

void p2p_nccl_free(void *p, void *after_event) {
    if (!p) return;
    struct cudaPointerAttributes attr;
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
        cudaGetLastError();
        return;
    }
    int prev = enter_device(attr.device);
    if (after_event) cudaStreamWaitEvent(cudaStreamPerThread, (cudaEvent_t)after_event, 0);
    cudaFreeAsync(p, cudaStreamPerThread);
    leave_device(prev, attr.device);
}

#endif
