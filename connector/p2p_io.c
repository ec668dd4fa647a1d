/* p2p_io: the KV transfer engine's one I/O thread. It owns the ROUTER, every
 * DEALER and every NCCL communicator, and loops:
 *   send queued ABORTs → start new ops, retry refused ones, enforce deadlines
 *   → poll NCCL transfers → free what ended → zmq_poll (the calls wake it
 *   through an eventfd) → handle requests (p2p_serve.c) and replies
 *   (p2p_client.c).
 * It holds e->mu except while in zmq_poll, so the calls in p2p.c always see a
 * consistent state. Nothing it does blocks: sockets are polled, sends use
 * ZMQ_DONTWAIT, NCCL work is polled, and every wait has a deadline. */
#include "connector/p2p_internal.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void blob_frame_free(void *data, void *hint) {
    (void)data;
    p2p_blob_unref(hint);
}

int p2p_io_send(void *sock, const char *identity, const p2p_buf *msg, p2p_blob *data, pd_err *err) {
    if (identity && zmq_send(sock, identity, strlen(identity), ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0)
        return pd_fail(err, "send to %s: %s", identity, zmq_strerror(errno));
    if (zmq_send(sock, msg->data, msg->len, ZMQ_DONTWAIT | (data ? ZMQ_SNDMORE : 0)) < 0)
        return pd_fail(err, "send: %s", zmq_strerror(errno));
    if (!data) return 0;
    zmq_msg_t m;
    if (data->nbytes == 0) {
        zmq_msg_init_size(&m, 0);
    } else {
        atomic_fetch_add(&data->refs, 1);
        if (zmq_msg_init_data(&m, data->data, data->nbytes, blob_frame_free, data) != 0) {
            p2p_blob_unref(data);
            return pd_fail(err, "zmq frame of %zu bytes: %s", data->nbytes, zmq_strerror(errno));
        }
    }
    if (zmq_msg_send(&m, sock, ZMQ_DONTWAIT) < 0) {
        int en = errno;
        zmq_msg_close(&m); /* releases our reference through blob_frame_free */
        return pd_fail(err, "send of %zu bytes: %s", data->nbytes, zmq_strerror(en));
    }
    return 0;
}

void p2p_queue_abort(p2p_engine *e, const char *peer, const char *id) {
    if (!peer || !peer[0]) return;
    p2p_abort_req *a = calloc(1, sizeof *a);
    if (!a) return;
    snprintf(a->peer, sizeof a->peer, "%s", peer);
    snprintf(a->id, sizeof a->id, "%s", id);
    a->next = e->aborts;
    e->aborts = a;
}

/* Records a failed receive for p2p_take to report, unless the consumer dropped id. */
void p2p_rx_fail(p2p_engine *e, const char *id, const char *peer, const pd_err *why) {
    p2p_rx *rx = e->rx;
    while (rx && strcmp(rx->id, id) != 0)
        rx = rx->next;
    if (rx && rx->state == RX_DROPPED) return;
    if (!rx) {
        rx = calloc(1, sizeof *rx);
        if (!rx) return;
        snprintf(rx->id, sizeof rx->id, "%s", id);
        rx->next = e->rx;
        e->rx = rx;
    }
    e->buffered -= rx->counted;
    rx->counted = 0;
    if (!rx->nop) { /* else its communicator's teardown frees it */
        p2p_nccl_free(rx->dev_buf, NULL);
        rx->dev_buf = NULL;
    }
    if (peer && peer != rx->peer) snprintf(rx->peer, sizeof rx->peer, "%s", peer);
    rx->state = RX_FAILED;
    rx->err = *why;
    e->arrived = true;
    rx->expires = pd_now() + 2 * e->timeout_s;
    e->stats.recvs_failed++;
}

p2p_rx *p2p_rx_lookup(p2p_engine *e, const char *id) {
    p2p_rx *rx = e->rx;
    while (rx && strcmp(rx->id, id) != 0)
        rx = rx->next;
    return rx;
}

p2p_rx_tensor *p2p_rx_tensor_make(const p2p_engine *e, const char *id, const p2p_meta *meta,
                                  zmq_msg_t *frame, void *dev_buf) {
    p2p_rx_tensor *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    snprintf(t->pub.id, sizeof t->pub.id, "%s", id);
    snprintf(t->pub.dtype, sizeof t->pub.dtype, "%s", meta->dtype);
    t->pub.ndim = meta->ndim;
    for (int i = 0; i < meta->ndim; i++)
        t->pub.shape[i] = meta->shape[i];
    t->pub.nbytes = meta->nbytes;
    if (dev_buf) {
        t->pub.data = dev_buf;
        t->pub.on_device = true;
    } else if (meta->nbytes > 0) {
        /* Keep ZMQ's buffer when it is aligned for every element type a tensor
         * carries (8 bytes: ZMQ puts a large frame's bytes 8 bytes off a
         * 16-byte boundary, so asking for 16 copied every frame). Look after
         * the move: a small frame's bytes live inside the zmq_msg_t itself
         * and move with it. */
        zmq_msg_init(&t->msg);
        zmq_msg_move(&t->msg, frame);
        void *p = zmq_msg_data(&t->msg);
        void *own = e->cfg.recv_alloc ? e->cfg.recv_alloc(e->cfg.host_ctx, meta->nbytes) : NULL;
        if (own) { /* else (none to spare) as without the option */
            memcpy(own, p, meta->nbytes);
            zmq_msg_close(&t->msg);
            t->pub.data = own;
            t->pub.from_host_alloc = true;
            t->host_free = e->cfg.host_free;
            t->host_ctx = e->cfg.host_ctx;
        } else if (((uintptr_t)p & 7) == 0) {
            t->has_msg = true;
            t->pub.data = p;
        } else { /* ZMQ may hand out frames at any offset; callers may cast to float */
            t->pub.data = malloc(meta->nbytes);
            if (t->pub.data) memcpy(t->pub.data, p, meta->nbytes);
            zmq_msg_close(&t->msg);
            if (!t->pub.data) {
                free(t);
                return NULL;
            }
        }
    }
    return t;
}

void p2p_rx_ready(p2p_engine *e, p2p_rx *rx, p2p_rx_tensor *t, double t_start) {
    double dt = pd_now() - t_start;
    rx->state = RX_READY;
    rx->tensor = t;
    e->arrived = true;
    rx->meta.nbytes = t->pub.nbytes;
    e->buffered += t->pub.nbytes - rx->counted; /* a reservation becomes the tensor's bytes */
    rx->counted = t->pub.nbytes;
    rx->expires = pd_now() + 2 * e->timeout_s;
    e->stats.recvs_ok++;
    e->stats.bytes_received += t->pub.nbytes;
    e->stats.recv_seconds += dt;
    e->stats.last_recv_ms = dt * 1e3;
    pd_log(PD_LOG_DEBUG,
           "kv p2p %s: received %s from %s: %zu bytes in %.2f ms (buffered %zu of %zu)", e->addr,
           rx->id, rx->peer, t->pub.nbytes, dt * 1e3, e->buffered, e->budget);
}

static const char *kind_name(op_kind k) {
    return k == OP_PUT ? "PUT" : k == OP_GET ? "GET" : "offer";
}

void p2p_op_finish(p2p_engine *e, p2p_op *op, bool ok, const char *fmt, ...) {
    if (op->state == OPS_DONE || op->state == OPS_FAILED) return;
    double dt = pd_now() - op->t_start;
    if (!ok) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(op->err.msg, sizeof op->err.msg, fmt, ap);
        va_end(ap);
    }
    op->state = ok ? OPS_DONE : OPS_FAILED;
    uint64_t n = op->meta.nbytes;
    if (op->kind == OP_PUT && !op->blocking) e->async_bytes -= n;
    if (op->kind == OP_OFFER) e->offer_bytes -= n;
    if (op->kind == OP_GET) {
        e->buffered -= op->reserved;
        op->reserved = 0;
        if (!ok) p2p_rx_fail(e, op->id, op->peer, &op->err);
    } else if (ok) {
        e->stats.sends_ok++;
        e->stats.bytes_sent += n;
        e->stats.send_seconds += dt;
        e->stats.last_send_ms = dt * 1e3;
    } else {
        e->stats.sends_failed++;
    }
    if (!ok && op->sent_any) p2p_queue_abort(e, op->peer, op->id);
    if (ok)
        pd_log(PD_LOG_DEBUG, "kv p2p %s: %s %s %s %s: %" PRIu64 " bytes in %.2f ms (%d retries)",
               e->addr, kind_name(op->kind), op->id, op->kind == OP_GET ? "from" : "to",
               op->peer[0] ? op->peer : "consumer", n, dt * 1e3, op->retries);
    else
        pd_log(op->kind == OP_OFFER ? PD_LOG_DEBUG : PD_LOG_WARN,
               "kv p2p %s: %s %s failed after %.2f ms: %s", e->addr, kind_name(op->kind), op->id,
               dt * 1e3, op->err.msg);
    /* The bytes are not needed any more; only the record may live on. */
    p2p_nccl_op_free(op->nop);
    op->nop = NULL;
    if (op->dev_buf) p2p_nccl_free(op->dev_buf, NULL);
    op->dev_buf = NULL;
    if (!op->blocking) {
        p2p_blob_unref(op->data);
        op->data = NULL;
        if (op->kind == OP_GET || op->forgotten) op->reap = true;
    }
    pthread_cond_broadcast(&e->cv);
}

/* ---- timers ---- */

static void op_deadline(p2p_engine *e, p2p_op *op) {
    double waited = pd_now() - op->t_start;
    const char *peer = op->peer;
    if (op->nop) { /* NCCL may still touch the bytes: abort the communicator first */
        char why[256];
        snprintf(why, sizeof why, "deadline: NCCL transfer of %s with %s not done within %.2f s",
                 op->id, peer[0] ? peer : op->in_peer, waited);
        if (op->kind == OP_OFFER)
            p2p_serve_comm_reset(e, op->in_peer, why);
        else
            p2p_client_comm_reset(e, peer, why);
        return;
    }
    switch (op->state) {
    case OPS_START:
    case OPS_WAIT_RESERVE:
        p2p_op_finish(e, op, false,
                      "deadline: peer %s did not answer PUT %s within %.2f s (is it up?)", peer,
                      op->id, waited);
        break;
    case OPS_BACKOFF:
        if (op->kind == OP_PUT)
            p2p_op_finish(e, op, false,
                          "deadline: peer %s had no room for %s (%" PRIu64
                          " bytes) within %.2f s (%d retries): %s",
                          peer, op->id, op->meta.nbytes, waited, op->retries, op->err.msg);
        else
            p2p_op_finish(
                e, op, false,
                "deadline: no room in kv_buffer_size %zu for %s (%zu bytes) within %.2f s",
                e->budget, op->id, op->want, waited);
        break;
    case OPS_WAIT_COMM:
        p2p_op_finish(e, op, false, "deadline: NCCL communicator with %s not ready within %.2f s",
                      peer, waited);
        break;
    case OPS_WAIT_ACK:
        p2p_op_finish(e, op, false,
                      "deadline: peer %s did not acknowledge the %" PRIu64
                      " bytes of %s within %.2f s",
                      peer, op->meta.nbytes, op->id, waited);
        break;
    case OPS_WAIT_GET:
        p2p_op_finish(e, op, false,
                      "deadline: peer %s did not answer GET %s within %.2f s (is it up?)", peer,
                      op->id, waited);
        break;
    case OPS_OFFERED:
        p2p_op_finish(e, op, false, "deadline: offer %s was not pulled within %.2f s", op->id,
                      waited);
        break;
    default:
        p2p_op_finish(e, op, false, "deadline: %s %s not done within %.2f s", kind_name(op->kind),
                      op->id, waited);
        break;
    }
}

static void sweep_ops(p2p_engine *e, double now) {
    for (p2p_op *op = e->ops; op; op = op->next) {
        if (op->reap || op->state == OPS_DONE || op->state == OPS_FAILED) continue;
        if (now >= op->deadline)
            op_deadline(e, op);
        else if (op->state == OPS_START || (op->state == OPS_BACKOFF && now >= op->retry_at))
            p2p_client_start(e, op);
    }
}

void p2p_rx_tombstone(p2p_engine *e, p2p_rx *rx, double now) {
    p2p_nccl_free(rx->dev_buf, NULL);
    rx->dev_buf = NULL;
    e->buffered -= rx->counted;
    rx->counted = 0;
    rx->dropped = false;
    rx->state = RX_DROPPED;
    rx->expires = now + 2 * e->timeout_s;
}

static void sweep_rx(p2p_engine *e, double now) {
    for (p2p_rx **pp = &e->rx; *pp;) {
        p2p_rx *rx = *pp;
        if (now < rx->expires ||
            rx->state == RX_RECVING) { /* RECVING: its communicator's deadline rules */
            pp = &rx->next;
            continue;
        }
        if (rx->state == RX_RESERVED && rx->dropped) { /* its bytes never came: fine */
            p2p_rx_tombstone(e, rx, now);
            pp = &rx->next;
            continue;
        }
        if (rx->state == RX_RESERVED) {
            pd_err why;
            pd_fail(&why, "producer %s reserved %s but sent no bytes within %.2f s", rx->peer,
                    rx->id, e->timeout_s);
            pd_log(PD_LOG_WARN, "kv p2p %s: %s", e->addr, why.msg);
            p2p_rx_fail(e, rx->id, rx->peer, &why);
            pp = &rx->next;
            continue;
        }
        if (rx->state == RX_READY)
            pd_log(PD_LOG_WARN,
                   "kv p2p %s: nobody took %s (%" PRIu64 " bytes) within %.0f s: freed", e->addr,
                   rx->id, rx->meta.nbytes, 2 * e->timeout_s);
        e->buffered -= rx->counted;
        *pp = rx->next;
        p2p_rx_free(rx);
    }
}

/* How long zmq_poll may sleep: until the next deadline or retry, at most 100 ms,
 * and 1 ms while NCCL transfers are being polled. */
static long poll_timeout_ms(p2p_engine *e, double now) {
    double next = now + 0.1;
    for (p2p_op *op = e->ops; op; op = op->next) {
        if (op->reap || op->state == OPS_DONE || op->state == OPS_FAILED) continue;
        if (op->state == OPS_START) return 0;
        if (op->nop || op->state == OPS_WAIT_COMM) next = now + 0.001;
        if (op->deadline < next) next = op->deadline;
        if (op->state == OPS_BACKOFF && op->retry_at < next) next = op->retry_at;
    }
    for (p2p_rx *rx = e->rx; rx; rx = rx->next) {
        if (rx->nop) next = now + 0.001;
        if (rx->expires > 0 && rx->expires < next) next = rx->expires;
    }
    for (p2p_peer *p = e->peers; p; p = p->next)
        if (p->comm && !p->comm_ready) next = now + 0.001;
    for (p2p_inpeer *p = e->inpeers; p; p = p->next)
        if (p->comm && !p->comm_ready) next = now + 0.001;
    double ms = (next - now) * 1e3;
    return ms <= 0 ? 0 : (long)(ms + 0.999);
}

static void send_aborts(p2p_engine *e) {
    while (e->aborts) {
        p2p_abort_req *a = e->aborts;
        e->aborts = a->next;
        p2p_client_abort(e, a->peer, a->id);
        free(a);
    }
}

static void reap(p2p_engine *e) {
    for (p2p_op **pp = &e->ops; *pp;) {
        p2p_op *op = *pp;
        if (op->reap && !op->blocking) {
            *pp = op->next;
            p2p_op_free(op);
        } else {
            pp = &op->next;
        }
    }
    for (p2p_peer **pp = &e->peers; *pp;) {
        p2p_peer *p = *pp;
        if (p->dead) {
            *pp = p->next;
            free(p);
        } else {
            pp = &p->next;
        }
    }
}

/* Reads one multipart message: up to max frames (more are discarded).
 * 1 = got one, 0 = none waiting, -1 = error. */
static int recv_frames(void *sock, zmq_msg_t *frames, int max, int *n) {
    *n = 0;
    for (;;) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, sock, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            return *n == 0 && errno == EAGAIN ? 0 : (*n > 0 ? 1 : -1);
        }
        bool more = zmq_msg_more(&m);
        if (*n < max) {
            zmq_msg_init(&frames[*n]);
            zmq_msg_move(&frames[*n], &m);
            (*n)++;
        }
        zmq_msg_close(&m);
        if (!more) return 1;
    }
}

static void close_frames(zmq_msg_t *frames, int n) {
    for (int i = 0; i < n; i++)
        zmq_msg_close(&frames[i]);
}

/* Handles up to a batch of messages per socket per turn, so one busy peer cannot starve the rest.
 */
enum { BATCH = 64, MAX_FRAMES = 4 };

static void drain_router(p2p_engine *e) {
    for (int i = 0; i < BATCH && !e->stopping; i++) {
        zmq_msg_t fr[MAX_FRAMES];
        int n;
        if (recv_frames(e->router, fr, MAX_FRAMES, &n) <= 0) return;
        p2p_serve_request(e, fr, n);
        close_frames(fr, n);
    }
}

static void drain_dealer(p2p_engine *e, p2p_peer *p) {
    for (int i = 0; i < BATCH && !p->dead && !e->stopping; i++) {
        zmq_msg_t fr[MAX_FRAMES];
        int n;
        if (recv_frames(p->dealer, fr, MAX_FRAMES, &n) <= 0) return;
        p2p_client_reply(e, p, fr, n);
        close_frames(fr, n);
    }
}

/* On the way out: abort communicators first (NCCL stops touching buffers), then fail every op. */
static void shutdown_all(p2p_engine *e) {
    e->stopping = true; /* also when the loop broke on an error: calls fail from now on */
    for (p2p_peer *p = e->peers; p; p = p->next)
        if (p->comm) p2p_client_comm_reset(e, p->addr, "KV transfer engine shut down");
    for (p2p_inpeer *p = e->inpeers; p; p = p->next)
        if (p->comm) p2p_serve_comm_reset(e, p->identity, "KV transfer engine shut down");
    for (p2p_op *op = e->ops; op; op = op->next) {
        op->sent_any = false; /* no ABORTs now: the sockets are closing */
        p2p_op_finish(e, op, false, "KV transfer engine shut down");
    }
    for (p2p_peer *p = e->peers; p; p = p->next)
        if (!p->dead) p2p_peer_close(e, p, "KV transfer engine shut down");
    zmq_close(e->router);
    e->router = NULL;
    while (e->aborts) {
        p2p_abort_req *a = e->aborts;
        e->aborts = a->next;
        free(a);
    }
}

void *p2p_io_main(void *arg) {
    p2p_engine *e = arg;
    if (e->cfg.transport == P2P_NCCL) {
        pd_err err;
        if (p2p_nccl_use_device(e->cfg.nccl_device, &err) != 0)
            pd_log(PD_LOG_ERROR, "kv p2p %s: %s", e->addr, err.msg);
    }
    zmq_pollitem_t *items = NULL;
    p2p_peer **owners = NULL;
    size_t cap = 0;
    pthread_mutex_lock(&e->mu);
    while (!e->stopping) {
        double now = pd_now();
        send_aborts(e);
        sweep_ops(e, now);
        sweep_rx(e, now);
        p2p_client_poll_nccl(e, now);
        p2p_serve_poll_nccl(e, now);
        send_aborts(e);
        p2p_client_close_idle(e, now);
        reap(e);

        size_t n = 2;
        for (p2p_peer *p = e->peers; p; p = p->next)
            n++;
        if (n > cap) {
            size_t ncap = n * 2;
            zmq_pollitem_t *ni = realloc(items, ncap * sizeof *ni);
            if (ni) items = ni;
            p2p_peer **no = ni ? realloc(owners, ncap * sizeof *no) : NULL;
            if (no) owners = no;
            if (!ni || !no) {
                pd_log(PD_LOG_ERROR, "kv p2p %s: out of memory in the I/O loop", e->addr);
                break;
            }
            cap = ncap;
        }
        items[0] = (zmq_pollitem_t){.socket = NULL, .fd = e->wake_fd, .events = ZMQ_POLLIN};
        items[1] = (zmq_pollitem_t){.socket = e->router, .events = ZMQ_POLLIN};
        size_t k = 2;
        for (p2p_peer *p = e->peers; p; p = p->next) {
            owners[k] = p;
            items[k++] = (zmq_pollitem_t){.socket = p->dealer, .events = ZMQ_POLLIN};
        }
        long timeout = poll_timeout_ms(e, pd_now());
        const bool tell = e->arrived && e->cfg.on_arrival;
        e->arrived = false;
        pthread_mutex_unlock(&e->mu);
        /* Outside the lock: the callee may take its own (p2p calls made
         * under that lock then cannot deadlock with this thread). */
        if (tell) e->cfg.on_arrival(e->cfg.arrival_ctx);
        int rc = zmq_poll(items, (int)k, timeout);
        pthread_mutex_lock(&e->mu);
        if (rc < 0) {
            if (errno == EINTR) continue;
            pd_log(PD_LOG_ERROR, "kv p2p %s: zmq_poll: %s", e->addr, zmq_strerror(errno));
            break;
        }
        if (items[0].revents & ZMQ_POLLIN) {
            uint64_t v;
            ssize_t r = read(e->wake_fd, &v, sizeof v);
            (void)r;
        }
        if (items[1].revents & ZMQ_POLLIN) drain_router(e);
        /* Peers are only freed in reap(), so owners[] stays valid through this turn. */
        for (size_t i = 2; i < k; i++)
            if ((items[i].revents & ZMQ_POLLIN) && !owners[i]->dead) drain_dealer(e, owners[i]);
    }
    shutdown_all(e);
    reap(e);
    pthread_mutex_unlock(&e->mu);
    free(items);
    free(owners);
    return NULL;
}
