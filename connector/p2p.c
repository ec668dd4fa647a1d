/* p2p: the KV transfer engine's public calls (see p2p.h). They check their
 * arguments, record the work under e->mu and wake the I/O thread (p2p_io.c),
 * which does every socket operation. Only p2p_put waits, on e->cv, for its op. */
#include "connector/p2p_internal.h"
#include "model/backend.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

/* ---- shared helpers ---- */

p2p_blob *p2p_blob_wrap(void *data, size_t nbytes, bool on_device) {
    p2p_blob *b = calloc(1, sizeof *b);
    if (!b) return NULL;
    b->data = data;
    b->nbytes = nbytes;
    b->on_device = on_device;
    atomic_init(&b->refs, 1);
    return b;
}

void p2p_buffer_release(bool on_device, void *p) {
    if (on_device)
        p2p_nccl_free(p, NULL);
    else
        free(p);
}

/* May run on a ZMQ I/O thread (zero-copy frames), hence the atomic count. */
void p2p_blob_unref(p2p_blob *b) {
    if (!b || atomic_fetch_sub(&b->refs, 1) != 1) return;
    if (!b->borrowed) {
        if (b->release)
            b->release(b->release_ctx, b->data);
        else if (b->on_device)
            p2p_nccl_free(b->data, b->ready);
        else
            free(b->data);
    }
    p2p_nccl_event_destroy(b->ready);
    free(b);
}

/* A buffer the caller handed over (p2p_put_async, p2p_offer) or got from
 * p2p_buffer_alloc, back to where it came from (device memory once the work
 * queued before ready, if any, is done). */
static void owned_release(p2p_engine *e, void *p, void *ready) {
    if (e->cfg.transport == P2P_NCCL)
        p2p_nccl_free(p, ready);
    else if (e->cfg.host_free)
        e->cfg.host_free(e->cfg.host_ctx, p);
    else
        free(p);
}

/* nccl with a backend: an event recorded after the work the caller queued
 * so far (the kernels filling the buffer it hands over), for the transfer
 * to wait on. NULL when there is nothing to wait for, or when no event
 * could be made, in which case the backend's whole queue was waited for. */
static void *ready_event(p2p_engine *e) {
    struct pd_backend *be = e->cfg.backend;
    if (e->cfg.transport != P2P_NCCL || !be) return NULL;
    pd_err err;
    void *ev = NULL;
    if (be->event_record && p2p_nccl_event_create(&ev, &err) == 0 &&
        be->event_record(be, ev, &err) == 0)
        return ev;
    p2p_nccl_event_destroy(ev);
    if (be->sync(be, &err) != 0)
        pd_log(PD_LOG_WARN, "kv p2p %s: waiting for the backend: %s", e->addr, err.msg);
    return NULL;
}

bool p2p_same_peer(const char *a, const char *b) {
    const size_t na = strcspn(a, "/"), nb = strcspn(b, "/");
    return na == nb && !memcmp(a, b, na);
}

void p2p_engine_wake(p2p_engine *e) {
    uint64_t one = 1;
    ssize_t n = write(e->wake_fd, &one, sizeof one);
    (void)n; /* a full counter still wakes the poller */
}

void p2p_op_free(p2p_op *op) {
    if (!op) return;
    p2p_nccl_op_free(op->nop);
    if (op->dev_buf) p2p_nccl_free(op->dev_buf, NULL);
    p2p_blob_unref(op->data);
    free(op);
}

void p2p_rx_tensor_release(p2p_rx_tensor *t) {
    if (!t) return;
    if (t->has_msg)
        zmq_msg_close(&t->msg);
    else if (t->pub.from_host_alloc)
        t->host_free(t->host_ctx, t->pub.data);
    else if (t->pub.data)
        p2p_buffer_release(t->pub.on_device, t->pub.data);
    free(t);
}

void p2p_rx_free(p2p_rx *rx) {
    if (!rx) return;
    p2p_rx_tensor_release(rx->tensor);
    p2p_nccl_op_free(rx->nop);
    if (rx->dev_buf) p2p_nccl_free(rx->dev_buf, NULL);
    free(rx);
}

/* ---- argument checks ---- */

static int check_id(const char *what, const char *s, size_t cap, pd_err *err) {
    if (!s || !s[0]) return pd_fail(err, "%s is empty", what);
    if (strlen(s) >= cap)
        return pd_fail(err, "%s \"%.40s...\" is longer than %zu bytes", what, s, cap - 1);
    return 0;
}

static int check_tensor(const char *id, const char *dtype, int ndim, const int64_t *shape,
                        pd_err *err) {
    if (check_id("tensor id", id, P2P_ID_MAX, err) != 0) return -1;
    if (check_id("dtype", dtype, P2P_DTYPE_MAX, err) != 0) return pd_wrap(err, "tensor %s", id);
    if (ndim < 0 || ndim > P2P_NDIM_MAX)
        return pd_fail(err, "tensor %s: ndim %d is outside 0..%d", id, ndim, P2P_NDIM_MAX);
    for (int i = 0; i < ndim; i++)
        if (!shape || shape[i] < 0)
            return pd_fail(err, "tensor %s: shape[%d] is missing or negative", id, i);
    return 0;
}

static double deadline_or_default(const p2p_engine *e, double deadline) {
    return deadline > 0 ? deadline : pd_now() + e->timeout_s;
}

/* A live send record (PUT or offer) with this id, if any. */
static p2p_op *find_send(p2p_engine *e, const char *id) {
    for (p2p_op *op = e->ops; op; op = op->next)
        if (op->kind != OP_GET && !op->reap && !strcmp(op->id, id)) return op;
    return NULL;
}

static p2p_op *op_new(p2p_engine *e, op_kind kind, const char *peer, const char *id,
                      const char *dtype, int ndim, const int64_t *shape, size_t nbytes,
                      double deadline) {
    p2p_op *op = calloc(1, sizeof *op);
    if (!op) return NULL;
    op->kind = kind;
    op->state = kind == OP_OFFER ? OPS_OFFERED : OPS_START;
    snprintf(op->id, sizeof op->id, "%s", id);
    snprintf(op->peer, sizeof op->peer, "%s", peer ? peer : "");
    if (dtype) snprintf(op->meta.dtype, sizeof op->meta.dtype, "%s", dtype);
    op->meta.ndim = ndim;
    for (int i = 0; i < ndim; i++)
        op->meta.shape[i] = shape[i];
    op->meta.nbytes = nbytes;
    op->t_start = pd_now();
    op->deadline = deadline_or_default(e, deadline);
    return op;
}

static void op_push(p2p_engine *e, p2p_op *op) {
    op->next = e->ops;
    e->ops = op;
}

static void op_unlink(p2p_engine *e, p2p_op *op) {
    for (p2p_op **pp = &e->ops; *pp; pp = &(*pp)->next) {
        if (*pp == op) {
            *pp = op->next;
            return;
        }
    }
}

/* ---- create / destroy ---- */

static int router_open(p2p_engine *e, pd_err *err) {
    e->router = zmq_socket(e->zctx, ZMQ_ROUTER);
    if (!e->router) return pd_fail(err, "zmq ROUTER socket: %s", zmq_strerror(errno));
    int zero = 0, one = 1;
    int64_t maxmsg = (int64_t)e->budget + 65536; /* no frame may exceed what we would ever accept */
    zmq_setsockopt(e->router, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(e->router, ZMQ_SNDHWM, &zero, sizeof zero);
    zmq_setsockopt(e->router, ZMQ_RCVHWM, &zero, sizeof zero);
    zmq_setsockopt(e->router, ZMQ_ROUTER_MANDATORY, &one,
                   sizeof one); /* unknown peer → error, not silence */
    zmq_setsockopt(e->router, ZMQ_ROUTER_HANDOVER, &one,
                   sizeof one); /* a restarted peer takes over its identity */
    if (maxmsg > 0) zmq_setsockopt(e->router, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
    char ep[128];
    if (e->cfg.kv_port > 0)
        snprintf(ep, sizeof ep, "tcp://%s:%d", e->kv_ip, e->cfg.kv_port);
    else
        snprintf(ep, sizeof ep, "tcp://%s:*", e->kv_ip);
    if (zmq_bind(e->router, ep) != 0)
        return pd_fail(err, "kv_port: cannot bind %s: %s", ep, zmq_strerror(errno));
    char last[128];
    size_t n = sizeof last;
    if (zmq_getsockopt(e->router, ZMQ_LAST_ENDPOINT, last, &n) != 0)
        return pd_fail(err, "zmq ROUTER endpoint: %s", zmq_strerror(errno));
    const char *colon = strrchr(last, ':');
    int port = colon ? atoi(colon + 1) : 0;
    if (port <= 0) return pd_fail(err, "zmq ROUTER bound to unexpected endpoint %s", last);
    snprintf(e->addr, sizeof e->addr, "%s:%d", e->kv_ip, port);
    return 0;
}

int p2p_create(const p2p_config *cfg, p2p_engine **out, pd_err *err) {
    *out = NULL;
    if (cfg->transport != P2P_TCP && cfg->transport != P2P_NCCL)
        return pd_fail(err, "unknown KV transport %d", cfg->transport);
    if (cfg->send_type < P2P_PUT || cfg->send_type > P2P_GET)
        return pd_fail(err, "unknown send_type %d", cfg->send_type);
    if (cfg->kv_port < 0 || cfg->kv_port > 65535)
        return pd_fail(err, "kv_port %d is outside 0..65535", cfg->kv_port);
    if (!(cfg->kv_buffer_size >= 0) || cfg->kv_buffer_size > 1e15)
        return pd_fail(err, "kv_buffer_size %g is not a byte count", cfg->kv_buffer_size);
    if (cfg->fingerprint && strlen(cfg->fingerprint) >= P2P_FP_MAX)
        return pd_fail(err, "model fingerprint is longer than %d bytes", P2P_FP_MAX - 1);
    /* room for ":65535" and a lane's "/16" in an identity under P2P_ADDR_MAX */
    if (cfg->kv_ip && strlen(cfg->kv_ip) >= P2P_ADDR_MAX - 11)
        return pd_fail(err, "kv_ip \"%s\" is too long", cfg->kv_ip);
    if (!cfg->host_alloc != !cfg->host_free)
        return pd_fail(err, "host_alloc and host_free come together (one of them is missing)");
    if (cfg->recv_alloc && !cfg->host_free) return pd_fail(err, "recv_alloc needs host_free");
    if (cfg->tcp_streams < 0 || cfg->tcp_streams > P2P_MAX_STREAMS)
        return pd_fail(err, "tcp_streams %d is outside 1..%d", cfg->tcp_streams, P2P_MAX_STREAMS);
    if (cfg->transport == P2P_NCCL && p2p_nccl_use_device(cfg->nccl_device, err) != 0) return -1;

    p2p_engine *e = calloc(1, sizeof *e);
    if (!e) return pd_fail(err, "out of memory");
    e->cfg = *cfg;
    e->kv_ip = strdup(cfg->kv_ip && cfg->kv_ip[0] ? cfg->kv_ip : "127.0.0.1");
    e->fingerprint = strdup(cfg->fingerprint ? cfg->fingerprint : "");
    e->cfg.kv_ip = e->kv_ip;
    e->cfg.fingerprint = e->fingerprint;
    e->budget = (size_t)cfg->kv_buffer_size;
    e->timeout_s = cfg->timeout_s > 0 ? cfg->timeout_s : 30.0;
    e->wake_fd = -1;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    if (!e->kv_ip || !e->fingerprint) {
        p2p_destroy(e);
        return pd_fail(err, "out of memory");
    }
    e->lanes = cfg->transport == P2P_TCP && cfg->tcp_streams > 1 ? cfg->tcp_streams : 1;
    /* The pool keeps what the receive budget allows (at least 64 MiB for a
     * sender's layers in flight), so steady traffic maps no new memory. */
    if (cfg->transport == P2P_NCCL &&
        p2p_nccl_mem_create(cfg->nccl_device, e->budget > (64u << 20) ? e->budget : (64u << 20),
                            &e->dev_mem, err) != 0) {
        p2p_destroy(e);
        return -1;
    }
    e->zctx = zmq_ctx_new();
    if (!e->zctx) {
        p2p_destroy(e);
        return pd_fail(err, "zmq context: %s", zmq_strerror(errno));
    }
    /* One ZMQ I/O thread per lane: libzmq spreads connections over them, so
     * the streams are read and written in parallel. */
    if (e->lanes > 1 && zmq_ctx_set(e->zctx, ZMQ_IO_THREADS, e->lanes) != 0) {
        p2p_destroy(e);
        return pd_fail(err, "zmq context: %d I/O threads: %s", e->lanes, zmq_strerror(errno));
    }
    e->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (e->wake_fd < 0) {
        p2p_destroy(e);
        return pd_fail(err, "eventfd: %s", strerror(errno));
    }
    if (router_open(e, err) != 0) {
        p2p_destroy(e);
        return -1;
    }
    if (pthread_create(&e->io_thread, NULL, p2p_io_main, e) != 0) {
        p2p_destroy(e);
        return pd_fail(err, "cannot start the KV I/O thread");
    }
    e->io_started = true;
    pd_log(PD_LOG_DEBUG, "kv p2p %s: up (transport %s, kv_buffer_size %zu, timeout %.1f s)",
           e->addr, cfg->transport == P2P_NCCL ? "nccl" : "tcp", e->budget, e->timeout_s);
    *out = e;
    return 0;
}

void p2p_destroy(p2p_engine *e) {
    if (!e) return;
    if (e->io_started) {
        pthread_mutex_lock(&e->mu);
        e->stopping = true;
        p2p_engine_wake(e);
        pthread_mutex_unlock(&e->mu);
        pthread_join(e->io_thread,
                     NULL); /* it fails every op and closes every socket on its way out */
    }
    pthread_mutex_lock(&e->mu);
    e->stopping = true;
    pthread_cond_broadcast(&e->cv);
    while (e->waiters > 0)
        pthread_cond_wait(&e->cv, &e->mu); /* p2p_put callers collect their ops */
    pthread_mutex_unlock(&e->mu);
    if (e->router) zmq_close(e->router); /* only when the thread never started */
    while (e->ops) {
        p2p_op *op = e->ops;
        e->ops = op->next;
        p2p_op_free(op);
    }
    while (e->rx) {
        p2p_rx *rx = e->rx;
        e->rx = rx->next;
        p2p_rx_free(rx);
    }
    while (e->aborts) {
        p2p_abort_req *a = e->aborts;
        e->aborts = a->next;
        free(a);
    }
    /* Peers' sockets and communicators were closed by the I/O thread. */
    while (e->peers) {
        p2p_peer *p = e->peers;
        e->peers = p->next;
        free(p);
    }
    while (e->inpeers) {
        p2p_inpeer *p = e->inpeers;
        e->inpeers = p->next;
        free(p);
    }
    p2p_nccl_mem_destroy(e->dev_mem); /* after every buffer above went back to it */
    if (e->zctx) zmq_ctx_term(e->zctx);
    if (e->wake_fd >= 0) close(e->wake_fd);
    pthread_cond_destroy(&e->cv);
    pthread_mutex_destroy(&e->mu);
    free(e->kv_ip);
    free(e->fingerprint);
    free(e);
}

const char *p2p_address(const p2p_engine *e) {
    return e->addr;
}

/* ---- producer side ---- */

int p2p_put(p2p_engine *e, const char *peer, const char *id, const char *dtype, int ndim,
            const int64_t *shape, const void *data, size_t nbytes, double deadline, pd_err *err) {
    if (check_id("peer address", peer, P2P_ADDR_MAX, err) != 0 ||
        check_tensor(id, dtype, ndim, shape, err) != 0)
        return -1;
    if (nbytes > 0 && !data) return pd_fail(err, "tensor %s: no data for %zu bytes", id, nbytes);
    bool dev = e->cfg.transport == P2P_NCCL;
    p2p_blob *blob;
    if (dev) {
        /* Device memory is sent in place: the blob only borrows it. */
        void *ready = ready_event(e);
        blob = p2p_blob_wrap((void *)data, nbytes, true);
        if (blob) {
            blob->borrowed = true;
            blob->ready = ready;
        } else {
            p2p_nccl_event_destroy(ready);
        }
    } else {
        /* A copy: ZMQ may still hold the frame after a failed transfer returns. */
        void *copy = malloc(nbytes ? nbytes : 1);
        if (copy && nbytes) memcpy(copy, data, nbytes);
        blob = copy ? p2p_blob_wrap(copy, nbytes, false) : NULL;
        if (!blob) free(copy);
    }
    p2p_op *op = blob ? op_new(e, OP_PUT, peer, id, dtype, ndim, shape, nbytes, deadline) : NULL;
    if (!op) {
        p2p_blob_unref(blob);
        return pd_fail(err, "out of memory for tensor %s (%zu bytes)", id, nbytes);
    }
    op->data = blob;
    op->blocking = true;
    pthread_mutex_lock(&e->mu);
    int rc = 0;
    if (e->stopping) {
        rc = pd_fail(err, "KV transfer engine is shutting down");
    } else if (find_send(e, id)) {
        rc = pd_fail(err, "tensor %s is already being sent", id);
    } else {
        op_push(e, op);
        e->waiters++;
        p2p_engine_wake(e);
        while (op->state != OPS_DONE && op->state != OPS_FAILED)
            pthread_cond_wait(&e->cv, &e->mu);
        op_unlink(e, op);
        e->waiters--;
        pthread_cond_broadcast(&e->cv);
        if (op->state == OPS_FAILED) {
            if (err) *err = op->err;
            rc = -1;
        }
    }
    pthread_mutex_unlock(&e->mu);
    p2p_op_free(op); /* over nccl, the I/O thread made sure NCCL no longer reads data */
    return rc;
}

/* A PUT names its peer; an offer waits for whoever asks. */
static bool peer_ok(op_kind kind, const char *peer, pd_err *err) {
    return kind != OP_PUT || check_id("peer address", peer, P2P_ADDR_MAX, err) == 0;
}

/* A new PUT or OFFER op that owns data_owned (nbytes of it). On any failure
 * the buffer is released, err is set and NULL comes back. */
static p2p_op *op_with_data(p2p_engine *e, op_kind kind, const char *peer, const char *id,
                            const char *dtype, int ndim, const int64_t *shape, void *data_owned,
                            size_t nbytes, double deadline, pd_err *err) {
    bool dev = e->cfg.transport == P2P_NCCL;
    /* First, even on the way out: the caller's kernels may still be
     * writing a device buffer, which must not be reused before they end. */
    void *ready = ready_event(e);
    p2p_blob *blob = NULL;
    if (peer_ok(kind, peer, err) && check_tensor(id, dtype, ndim, shape, err) == 0 &&
        !(nbytes > 0 && !data_owned &&
          pd_fail(err, "tensor %s: no data for %zu bytes", id, nbytes)) &&
        !(blob = p2p_blob_wrap(data_owned, nbytes, dev)))
        pd_fail(err, "out of memory for tensor %s", id);
    if (!blob) {
        owned_release(e, data_owned, ready);
        p2p_nccl_event_destroy(ready);
        return NULL;
    }
    blob->ready = ready;
    if (!dev && e->cfg.host_free) {
        blob->release = e->cfg.host_free;
        blob->release_ctx = e->cfg.host_ctx;
    }
    p2p_op *op = op_new(e, kind, peer, id, dtype, ndim, shape, nbytes, deadline);
    if (!op) {
        p2p_blob_unref(blob);
        pd_fail(err, "out of memory for tensor %s", id);
        return NULL;
    }
    op->data = blob;
    return op;
}

int p2p_put_async(p2p_engine *e, const char *peer, const char *id, const char *dtype, int ndim,
                  const int64_t *shape, void *data_owned, size_t nbytes, double deadline,
                  pd_err *err) {
    p2p_op *op =
        op_with_data(e, OP_PUT, peer, id, dtype, ndim, shape, data_owned, nbytes, deadline, err);
    if (!op) return -1;
    pthread_mutex_lock(&e->mu);
    int rc = 0;
    if (e->stopping)
        rc = pd_fail(err, "KV transfer engine is shutting down");
    else if (find_send(e, id))
        rc = pd_fail(err, "tensor %s is already being sent", id);
    if (rc == 0) {
        op_push(e, op);
        e->async_bytes += nbytes;
        p2p_engine_wake(e);
    }
    pthread_mutex_unlock(&e->mu);
    if (rc != 0) p2p_op_free(op);
    return rc;
}

int p2p_offer(p2p_engine *e, const char *id, const char *dtype, int ndim, const int64_t *shape,
              void *data_owned, size_t nbytes, double deadline, pd_err *err) {
    p2p_op *op =
        op_with_data(e, OP_OFFER, NULL, id, dtype, ndim, shape, data_owned, nbytes, deadline, err);
    if (!op) return -1;
    pthread_mutex_lock(&e->mu);
    int rc = 0;
    if (e->stopping)
        rc = pd_fail(err, "KV transfer engine is shutting down");
    else if (find_send(e, id))
        rc = pd_fail(err, "tensor %s is already offered or being sent", id);
    else if (nbytes > e->budget - (e->offer_bytes < e->budget ? e->offer_bytes : e->budget))
        rc = pd_fail(err,
                     "GET store full: %zu of kv_buffer_size %zu bytes held, tensor %s needs %zu",
                     e->offer_bytes, e->budget, id, nbytes);
    if (rc == 0) {
        op_push(e, op);
        e->offer_bytes += nbytes;
        p2p_engine_wake(e); /* its deadline joins the I/O thread's timers */
        pd_log(PD_LOG_DEBUG, "kv p2p %s: offer %s (%zu bytes) until GET or %.2f s", e->addr, id,
               nbytes, op->deadline - pd_now());
    }
    pthread_mutex_unlock(&e->mu);
    if (rc != 0) p2p_op_free(op);
    return rc;
}

int p2p_send_status(p2p_engine *e, const char *id, pd_err *err) {
    pthread_mutex_lock(&e->mu);
    p2p_op *op = id ? find_send(e, id) : NULL;
    int rc;
    if (!op || op->blocking || op->forgotten)
        rc = pd_fail(err, "no send of tensor %s", id ? id : "(null)");
    else if (op->state == OPS_DONE)
        rc = 1;
    else if (op->state == OPS_FAILED) {
        if (err) *err = op->err;
        rc = -1;
    } else
        rc = 0;
    pthread_mutex_unlock(&e->mu);
    return rc;
}

void p2p_forget_send(p2p_engine *e, const char *id) {
    if (!id) return;
    pthread_mutex_lock(&e->mu);
    p2p_op *op = find_send(e, id);
    if (op && !op->blocking) {
        op->forgotten = true; /* an offer still in the store stays until pulled or expired */
        if (op->state == OPS_DONE || op->state == OPS_FAILED) {
            op_unlink(e, op);
            p2p_op_free(op);
        }
    }
    pthread_mutex_unlock(&e->mu);
}

/* ---- consumer side ---- */

static p2p_rx **rx_find(p2p_engine *e, const char *id) {
    for (p2p_rx **pp = &e->rx; *pp; pp = &(*pp)->next)
        if (!strcmp((*pp)->id, id)) return pp;
    return NULL;
}

int p2p_fetch(p2p_engine *e, const char *peer, const char *id, double deadline, pd_err *err) {
    if (check_id("peer address", peer, P2P_ADDR_MAX, err) != 0 ||
        check_id("tensor id", id, P2P_ID_MAX, err) != 0)
        return -1;
    p2p_op *op = op_new(e, OP_GET, peer, id, NULL, 0, NULL, 0, deadline);
    if (!op) return pd_fail(err, "out of memory");
    pthread_mutex_lock(&e->mu);
    int rc = 0;
    p2p_rx **pp = rx_find(e, id);
    if (e->stopping) {
        rc = pd_fail(err, "KV transfer engine is shutting down");
    } else if (pp && (*pp)->state != RX_DROPPED && (*pp)->state != RX_FAILED) {
        rc = pd_fail(err, "tensor %s is already here or arriving", id);
    } else {
        for (p2p_op *o = e->ops; o; o = o->next)
            if (o->kind == OP_GET && !o->reap && !strcmp(o->id, id))
                rc = pd_fail(err, "tensor %s is already being fetched", id);
    }
    if (rc == 0) {
        if (pp) { /* a fresh fetch replaces an old failure or tombstone */
            p2p_rx *old = *pp;
            *pp = old->next;
            p2p_rx_free(old);
        }
        op_push(e, op);
        p2p_engine_wake(e);
    }
    pthread_mutex_unlock(&e->mu);
    if (rc != 0) p2p_op_free(op);
    return rc;
}

int p2p_take(p2p_engine *e, const char *id, p2p_tensor **out, pd_err *err) {
    *out = NULL;
    if (!id) return pd_fail(err, "tensor id is empty");
    pthread_mutex_lock(&e->mu);
    int rc = 0;
    p2p_rx **pp = rx_find(e, id);
    p2p_rx *rx = pp ? *pp : NULL;
    if (rx && rx->state == RX_READY) {
        *out = &rx->tensor->pub;
        rx->tensor->counted = rx->counted; /* the budget follows the tensor until p2p_tensor_free */
        rx->tensor = NULL;
        *pp = rx->next;
        p2p_rx_free(rx);
        rc = 1;
    } else if (rx && rx->state == RX_FAILED) {
        if (err) *err = rx->err;
        *pp = rx->next;
        p2p_rx_free(rx);
        rc = -1;
    } else if (rx && rx->state == RX_DROPPED) {
        rc = pd_fail(err, "tensor %s was dropped", id);
    }
    pthread_mutex_unlock(&e->mu);
    return rc;
}

void p2p_tensor_free(p2p_engine *e, p2p_tensor *t) {
    if (!t) return;
    p2p_rx_tensor *rt = (p2p_rx_tensor *)t;
    pthread_mutex_lock(&e->mu);
    e->buffered -= rt->counted;
    pthread_mutex_unlock(&e->mu);
    p2p_rx_tensor_release(rt);
}

void p2p_drop(p2p_engine *e, const char *peer, const char *id) {
    if (!id || !id[0] || strlen(id) >= P2P_ID_MAX) return;
    pthread_mutex_lock(&e->mu);
    double now = pd_now();
    bool cancelled = false;
    p2p_rx **pp = rx_find(e, id);
    p2p_rx *rx = pp ? *pp : NULL;
    if (rx && rx->state == RX_RECVING) {
        rx->dropped = true; /* the I/O thread frees it once NCCL is done writing */
        cancelled = true;
    } else if (rx && rx->state == RX_RESERVED && rx->dev_buf) {
        /* nccl: the producer may have posted its ncclSend already; without
         * our ncclRecv the pair's communicator would be lost, with every
         * transfer on it. So the reservation stays to take the bytes and
         * throw them away, until the producer's answer to our ABORT says
         * none are coming (or the reservation's deadline passes). */
        rx->dropped = true;
        cancelled = true;
    } else if (rx) {
        cancelled = rx->state == RX_RESERVED || rx->state == RX_READY;
        p2p_rx_tensor_release(rx->tensor);
        rx->tensor = NULL;
        p2p_rx_tombstone(e, rx, now); /* anything arriving for id from now on is discarded */
    } else if ((rx = calloc(1, sizeof *rx))) {
        snprintf(rx->id, sizeof rx->id, "%s", id);
        rx->next = e->rx;
        e->rx = rx;
        p2p_rx_tombstone(e, rx, now);
    }
    for (p2p_op *op = e->ops; op; op = op->next) {
        if (op->kind != OP_GET || op->reap || strcmp(op->id, id) != 0) continue;
        cancelled = true;
        if (op->state == OPS_RECVING ||
            (e->cfg.transport == P2P_NCCL && op->state == OPS_WAIT_GET)) {
            /* nccl: a GET answered "here it is" comes with an ncclSend; the
             * reply is still taken, and the bytes received and discarded,
             * so the pair's communicator stays usable. */
            op->dropped = true;
        } else {
            e->buffered -= op->reserved;
            op->reserved = 0;
            op->reap = true; /* its late reply finds no op and is discarded */
        }
    }
    if (cancelled) e->stats.aborts++;
    if (peer && peer[0] && strlen(peer) < P2P_ADDR_MAX) {
        p2p_abort_req *a = calloc(1, sizeof *a);
        if (a) {
            snprintf(a->peer, sizeof a->peer, "%s", peer);
            snprintf(a->id, sizeof a->id, "%s", id);
            a->next = e->aborts;
            e->aborts = a;
            p2p_engine_wake(e);
        }
    }
    pd_log(PD_LOG_DEBUG, "kv p2p %s: drop %s (producer %s)", e->addr, id, peer ? peer : "?");
    pthread_mutex_unlock(&e->mu);
}

void *p2p_buffer_alloc(p2p_engine *e, size_t nbytes, pd_err *err) {
    if (e->cfg.transport == P2P_NCCL) return p2p_nccl_alloc(e->dev_mem, nbytes, err);
    void *p = e->cfg.host_alloc ? e->cfg.host_alloc(e->cfg.host_ctx, nbytes)
                                : malloc(nbytes ? nbytes : 1);
    if (!p) pd_fail(err, "out of memory for %zu bytes", nbytes);
    return p;
}

void p2p_buffer_free(p2p_engine *e, void *p) {
    if (p) owned_release(e, p, NULL);
}

void p2p_stats_get(p2p_engine *e, p2p_stats *out) {
    pthread_mutex_lock(&e->mu);
    *out = e->stats;
    out->buffered_bytes = e->buffered;
    out->offered_bytes = e->offer_bytes + e->async_bytes;
    out->connections = 0;
    for (const p2p_peer *p = e->peers; p; p = p->next)
        out->connections += !p->dead;
    pthread_mutex_unlock(&e->mu);
}
