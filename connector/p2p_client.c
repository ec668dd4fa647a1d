/* p2p_client: the asking side of the KV control plane, run by the I/O thread.
 * One DEALER per peer (identity: our own address; with tcp_streams n, n of
 * them, "lanes", lane k's identity "<our address>/k" for k > 0), opened on
 * first use with a HELLO (and, for nccl, a NEW) ahead of any request. PUT: PUT → {ret} →
 * DATA + bytes → ack. GET: GET → {ret, meta} + bytes. Replies are matched to
 * ops by (peer, reply_to, tensor_id); a reply nobody waits for is late and
 * dropped. */
#include "connector/p2p_internal.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

static p2p_peer *peer_find(p2p_engine *e, const char *addr, int lane) {
    for (p2p_peer *p = e->peers; p; p = p->next)
        if (!p->dead && p->lane == lane && !strcmp(p->addr, addr)) return p;
    return NULL;
}

static int send_msg(p2p_peer *p, int (*encode)(const void *, p2p_buf *, pd_err *), const void *m,
                    p2p_blob *data, pd_err *err) {
    p2p_buf b;
    if (encode(m, &b, err) != 0) return -1;
    int rc = p2p_io_send(p->dealer, NULL, &b, data, err);
    free(b.data);
    return rc == 0 ? 0 : pd_wrap(err, "kv peer %s", p->addr);
}

/* Typed wrappers so send_msg can take any encoder. */
static int enc_hello(const void *m, p2p_buf *b, pd_err *err) {
    return p2p_hello_encode(m, b, err);
}
static int enc_new(const void *m, p2p_buf *b, pd_err *err) {
    return p2p_new_encode(m, b, err);
}
static int enc_put(const void *m, p2p_buf *b, pd_err *err) {
    return p2p_put_encode(m, b, err);
}
static int enc_data(const void *m, p2p_buf *b, pd_err *err) {
    return p2p_data_encode(m, b, err);
}
static int enc_get(const void *m, p2p_buf *b, pd_err *err) {
    return p2p_get_encode(m, b, err);
}
static int enc_abort(const void *m, p2p_buf *b, pd_err *err) {
    return p2p_abort_encode(m, b, err);
}

/* nccl: make sure a communicator with the peer exists or is being built (we are rank 0). */
static int comm_ensure(p2p_engine *e, p2p_peer *p, pd_err *err) {
    if (e->cfg.transport != P2P_NCCL || p->comm) return 0;
    p2p_new m;
    if (p2p_nccl_unique_id(m.unique_id, err) != 0) return -1;
    if (send_msg(p, enc_new, &m, NULL, err) != 0) return -1;
    if (p2p_nccl_comm_start(m.unique_id, 0, e->cfg.nccl_device, e->cfg.nccl_num_channels, &p->comm,
                            err) != 0)
        return pd_wrap(err, "NCCL communicator with %s", p->addr);
    p->comm_ready = false;
    p->comm_deadline = pd_now() + e->timeout_s;
    p->comm_gen++;
    pd_log(PD_LOG_DEBUG, "kv p2p %s: NEW → %s (NCCL rank 0)", e->addr, p->addr);
    return 0;
}

static p2p_peer *peer_get(p2p_engine *e, const char *addr, int lane, pd_err *err) {
    p2p_peer *p = peer_find(e, addr, lane);
    if (p) {
        p->last_used = pd_now();
        return p;
    }
    p = calloc(1, sizeof *p);
    if (!p) {
        pd_fail(err, "out of memory");
        return NULL;
    }
    snprintf(p->addr, sizeof p->addr, "%s", addr);
    p->lane = lane;
    p->last_used = pd_now();
    p->dealer = zmq_socket(e->zctx, ZMQ_DEALER);
    if (!p->dealer) {
        pd_fail(err, "zmq DEALER socket: %s", zmq_strerror(errno));
        free(p);
        return NULL;
    }
    int zero = 0;
    int64_t maxmsg = (int64_t)e->budget + 65536;
    char identity[P2P_ADDR_MAX + 8];
    if (lane == 0)
        snprintf(identity, sizeof identity, "%s", e->addr);
    else
        snprintf(identity, sizeof identity, "%s/%d", e->addr, lane);
    zmq_setsockopt(p->dealer, ZMQ_ROUTING_ID, identity, strlen(identity));
    zmq_setsockopt(p->dealer, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(p->dealer, ZMQ_SNDHWM, &zero, sizeof zero);
    zmq_setsockopt(p->dealer, ZMQ_RCVHWM, &zero, sizeof zero);
    if (maxmsg > 0) zmq_setsockopt(p->dealer, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
    char ep[P2P_ADDR_MAX + 8];
    snprintf(ep, sizeof ep, "tcp://%s", addr);
    p2p_hello h;
    snprintf(h.fingerprint, sizeof h.fingerprint, "%s", e->fingerprint);
    if (zmq_connect(p->dealer, ep) != 0) {
        pd_fail(err, "cannot connect to kv peer %s: %s", addr, zmq_strerror(errno));
    } else if (send_msg(p, enc_hello, &h, NULL, err) == 0) {
        p->next = e->peers;
        e->peers = p;
        pd_log(PD_LOG_DEBUG, "kv p2p %s: HELLO → %s (connection %d)", e->addr, addr, lane);
        return p;
    }
    if (p->comm) p2p_nccl_comm_destroy(p->comm);
    zmq_close(p->dealer);
    free(p);
    return NULL;
}

/* lane < 0: on any of the peer's connections; an op not started yet has
 * no lane and counts for every one. */
static bool in_flight_with(const p2p_op *op, const char *addr, int lane) {
    return op->kind != OP_OFFER && !op->reap && op->state != OPS_DONE && op->state != OPS_FAILED &&
           (lane < 0 || !op->lane_chosen || op->lane == lane) && !strcmp(op->peer, addr);
}

void p2p_peer_close(p2p_engine *e, p2p_peer *p, const char *why) {
    if (p->comm) p2p_nccl_comm_destroy(p->comm); /* first: NCCL stops touching buffers */
    p->comm = NULL;
    for (p2p_op *op = e->ops; op; op = op->next) {
        if (!in_flight_with(op, p->addr, p->lane)) continue;
        op->sent_any = false;
        p2p_op_finish(e, op, false, "%s", why);
    }
    zmq_close(p->dealer);
    p->dealer = NULL;
    p->dead = true;
}

void p2p_client_close_idle(p2p_engine *e, double now) {
    double idle = e->timeout_s * 2 > 60 ? e->timeout_s * 2 : 60;
    for (p2p_peer *p = e->peers; p; p = p->next) {
        if (p->dead || now - p->last_used < idle) continue;
        bool busy = false;
        for (p2p_op *op = e->ops; op && !busy; op = op->next)
            busy = in_flight_with(op, p->addr, p->lane);
        if (busy) continue;
        pd_log(PD_LOG_DEBUG, "kv p2p %s: closing idle connection to %s", e->addr, p->addr);
        p2p_peer_close(e, p, "idle");
    }
}

void p2p_client_comm_reset(p2p_engine *e, const char *addr, const char *why) {
    p2p_peer *p = peer_find(e, addr, 0); /* nccl: one connection a peer */
    if (!p || !p->comm) return;
    e->stats.comm_resets++;
    pd_log(PD_LOG_WARN, "kv p2p %s: NCCL communicator with %s torn down: %s", e->addr, addr, why);
    p2p_nccl_comm_destroy(p->comm);
    p->comm = NULL;
    p->comm_ready = false;
    for (p2p_op *op = e->ops; op; op = op->next) {
        if (!in_flight_with(op, addr, -1)) continue;
        if (op->nop || op->state == OPS_WAIT_COMM || op->state == OPS_WAIT_ACK ||
            op->state == OPS_RECVING)
            p2p_op_finish(e, op, false, "%s", why);
    }
}

static p2p_op *find_op(p2p_engine *e, op_kind kind, const char *addr, const char *id,
                       op_state state) {
    for (p2p_op *op = e->ops; op; op = op->next)
        if (op->kind == kind && op->state == state && !op->reap && !strcmp(op->peer, addr) &&
            !strcmp(op->id, id))
            return op;
    return NULL;
}

static void backoff(p2p_engine *e, p2p_op *op) {
    op->backoff = op->backoff > 0 ? op->backoff * 2 : 0.002;
    if (op->backoff > 0.1) op->backoff = 0.1;
    op->retry_at = pd_now() + op->backoff;
    op->state = OPS_BACKOFF;
    op->retries++;
    e->stats.retries++;
}

static size_t room(const p2p_engine *e) {
    return e->buffered < e->budget ? e->budget - e->buffered : 0;
}

void p2p_client_start(p2p_engine *e, p2p_op *op) {
    pd_err err;
    if (!op->lane_chosen) { /* kept across retries: a PUT's DATA follows its PUT */
        op->lane = (int)(e->next_lane++ % (unsigned)e->lanes);
        op->lane_chosen = true;
    }
    p2p_peer *p = peer_get(e, op->peer, op->lane, &err);
    if (!p) {
        p2p_op_finish(e, op, false, "%s", err.msg);
        return;
    }
    /* nccl: the communicator the bytes will take is started (NEW) ahead of
     * the first PUT or GET; a peer used only for ABORTs never needs one. */
    if (comm_ensure(e, p, &err) != 0) {
        p2p_op_finish(e, op, false, "%s", err.msg);
        return;
    }
    if (op->kind == OP_PUT) {
        p2p_put_msg m;
        snprintf(m.tensor_id, sizeof m.tensor_id, "%s", op->id);
        m.meta = op->meta;
        if (send_msg(p, enc_put, &m, NULL, &err) != 0) {
            p2p_op_finish(e, op, false, "%s", err.msg);
            return;
        }
        op->sent_any = true;
        op->state = OPS_WAIT_RESERVE;
        op->asked_comm_gen = p->comm_gen;
        pd_log(PD_LOG_DEBUG, "kv p2p %s: PUT %s → %s (%" PRIu64 " bytes, attempt %d)", e->addr,
               op->id, p->addr, op->meta.nbytes, op->retries + 1);
        return;
    }
    /* GET: hold room for the reply first. Until the producer told us the size, guess the
     * last tensor's (a model's layers are alike); a wrong guess costs one round trip. */
    size_t free_room = room(e);
    if (op->want > free_room) {
        backoff(e, op);
        return;
    }
    size_t r = op->want ? op->want : (e->get_size_hint < free_room ? e->get_size_hint : free_room);
    e->buffered += r;
    op->reserved = r;
    p2p_get_msg m;
    snprintf(m.tensor_id, sizeof m.tensor_id, "%s", op->id);
    m.max_nbytes = r;
    if (send_msg(p, enc_get, &m, NULL, &err) != 0) {
        p2p_op_finish(e, op, false, "%s", err.msg);
        return;
    }
    op->sent_any = true;
    op->state = OPS_WAIT_GET;
    op->asked_comm_gen = p->comm_gen;
    pd_log(PD_LOG_DEBUG, "kv p2p %s: GET %s → %s (room %zu, attempt %d)", e->addr, op->id, p->addr,
           r, op->retries + 1);
}

void p2p_client_abort(p2p_engine *e, const char *addr, const char *id) {
    pd_err err;
    p2p_peer *p = peer_get(e, addr, 0, &err); /* the producer matches the peer, not the lane */
    p2p_abort_msg m;
    snprintf(m.tensor_id, sizeof m.tensor_id, "%s", id);
    if (!p || send_msg(p, enc_abort, &m, NULL, &err) != 0) {
        pd_log(PD_LOG_WARN, "kv p2p %s: ABORT %s → %s not sent: %s", e->addr, id, addr, err.msg);
        return;
    }
    pd_log(PD_LOG_DEBUG, "kv p2p %s: ABORT %s → %s", e->addr, id, addr);
}

/* After {ret: 0} to a PUT: send the bytes (tcp: a further frame; nccl: DATA, then ncclSend). */
static void begin_data(p2p_engine *e, p2p_peer *p, p2p_op *op) {
    pd_err err;
    p2p_data_msg m;
    snprintf(m.tensor_id, sizeof m.tensor_id, "%s", op->id);
    m.nbytes = op->meta.nbytes;
    if (e->cfg.transport == P2P_TCP) {
        if (send_msg(p, enc_data, &m, op->data, &err) != 0) {
            p2p_op_finish(e, op, false, "%s", err.msg);
            return;
        }
        op->state = OPS_WAIT_ACK;
        return;
    }
    if (comm_ensure(e, p, &err) != 0) {
        p2p_op_finish(e, op, false, "%s", err.msg);
        return;
    }
    if (!p->comm_ready) {
        op->state = OPS_WAIT_COMM;
        return;
    }
    /* Same thread, same order: our DATA messages and ncclSends on this comm line up with the
     * receiver's ncclRecvs, which it posts in the order the DATA messages arrive. */
    if (send_msg(p, enc_data, &m, NULL, &err) != 0) {
        p2p_op_finish(e, op, false, "%s", err.msg);
        return;
    }
    op->state = OPS_WAIT_ACK;
    if (op->meta.nbytes == 0) {
        op->local_done = true;
    } else if (p2p_nccl_send(p->comm, op->data->data, op->meta.nbytes, op->data->ready, &op->nop,
                             &err) != 0) {
        p2p_client_comm_reset(e, p->addr, err.msg);
        p2p_op_finish(e, op, false, "%s", err.msg);
    }
}

/* The peer answered op's PUT or GET with new_comm: it has no communicator
 * with us (it tore its side down), so ours is stale. Unless a NEW already
 * went out after op's ask (the peer has that one by our next), replace
 * ours, then ask again. -1: no new one could be started; op is finished. */
static int replace_stale_comm(p2p_engine *e, p2p_peer *p, p2p_op *op) {
    if (e->cfg.transport != P2P_NCCL || (p->comm && op->asked_comm_gen < p->comm_gen)) return 0;
    pd_err err;
    p2p_client_comm_reset(e, p->addr, "the peer has no communicator with us");
    if (comm_ensure(e, p, &err) == 0) return 0;
    p2p_op_finish(e, op, false, "%s", err.msg);
    return -1;
}

static void on_hello(p2p_engine *e, p2p_peer *p, const p2p_reply *r) {
    if (r->ret == P2P_RET_OK && (!r->fingerprint[0] || !strcmp(r->fingerprint, e->fingerprint))) {
        p->hello_ok = true;
        pd_log(PD_LOG_DEBUG, "kv p2p %s: HELLO ok from %s", e->addr, p->addr);
        return;
    }
    char msg[sizeof(pd_err)];
    if (r->fingerprint[0])
        snprintf(msg, sizeof msg, "peer %s has model fingerprint \"%.200s\", we have \"%.200s\"",
                 p->addr, r->fingerprint, e->fingerprint);
    else
        snprintf(msg, sizeof msg, "peer %s refused HELLO: %s", p->addr, r->error);
    e->stats.fingerprint_mismatches++;
    pd_log(PD_LOG_ERROR, "kv p2p %s: %s", e->addr, msg);
    p2p_peer_close(e, p, msg);
}

static void on_get_ok(p2p_engine *e, p2p_peer *p, p2p_op *op, const p2p_reply *r, zmq_msg_t *frames,
                      int n) {
    if (!r->has_meta || !r->meta.dtype[0]) {
        p2p_op_finish(e, op, false, "peer %s answered GET %s without shape/dtype/nbytes", p->addr,
                      op->id);
        /* Its ncclSend, of a size we were not told, has no receive here. */
        if (e->cfg.transport == P2P_NCCL)
            p2p_client_comm_reset(e, p->addr, "GET answered without its size");
        return;
    }
    if (r->meta.nbytes > op->reserved) {
        p2p_op_finish(e, op, false,
                      "peer %s sent %" PRIu64 " bytes for %s, more than the %zu reserved", p->addr,
                      r->meta.nbytes, op->id, op->reserved);
        if (e->cfg.transport == P2P_NCCL)
            p2p_client_comm_reset(e, p->addr, "GET reply larger than reserved");
        return;
    }
    op->meta = r->meta;
    e->get_size_hint = r->meta.nbytes;
    if (e->cfg.transport == P2P_NCCL) {
        pd_err err;
        op->state = OPS_RECVING;
        if (r->meta.nbytes > 0 && op->asked_comm_gen != p->comm_gen) {
            /* Its ncclSend went over the communicator we had when we asked,
             * since replaced (the producer drops it on our NEW): nothing
             * comes on the new one. Fail now rather than at the deadline. */
            p2p_op_finish(e, op, false, "NCCL communicator with %s replaced while GET %s was out",
                          p->addr, op->id);
            return;
        }
        if (r->meta.nbytes > 0) {
            op->dev_buf = p2p_nccl_alloc(e->dev_mem, r->meta.nbytes, &err);
            /* Our side of the join may still be completing: the receive
             * then waits in the communicator's queue until it is. */
            if (!op->dev_buf || !p->comm ||
                p2p_nccl_recv(p->comm, op->dev_buf, r->meta.nbytes, &op->nop, &err) != 0) {
                if (op->dev_buf && !p->comm)
                    pd_fail(&err, "no NCCL communicator with %s for GET %s", p->addr, op->id);
                p2p_client_comm_reset(e, p->addr,
                                      err.msg); /* the producer's ncclSend has no partner now */
                p2p_op_finish(e, op, false, "%s", err.msg);
            }
        }
        return; /* p2p_client_poll_nccl finishes it */
    }
    size_t got = n >= 2 ? zmq_msg_size(&frames[1]) : 0;
    if (n < 2 || got != r->meta.nbytes) {
        p2p_op_finish(e, op, false, "peer %s sent %zu bytes for %s, announced %" PRIu64, p->addr,
                      got, op->id, r->meta.nbytes);
        return;
    }
    p2p_rx_tensor *t = p2p_rx_tensor_make(e, op->id, &r->meta, &frames[1], NULL);
    p2p_rx *rx = t ? calloc(1, sizeof *rx) : NULL;
    if (!rx) {
        p2p_rx_tensor_release(t);
        p2p_op_finish(e, op, false, "out of memory receiving %s", op->id);
        return;
    }
    snprintf(rx->id, sizeof rx->id, "%s", op->id);
    snprintf(rx->peer, sizeof rx->peer, "%s", p->addr);
    rx->meta = r->meta;
    rx->counted = op->reserved; /* the reservation moves to the tensor */
    op->reserved = 0;
    rx->next = e->rx;
    e->rx = rx;
    p2p_rx_ready(e, rx, t, op->t_start);
    p2p_op_finish(e, op, true, "ok");
}

static void on_get(p2p_engine *e, p2p_peer *p, const p2p_reply *r, zmq_msg_t *frames, int n) {
    p2p_op *op = find_op(e, OP_GET, p->addr, r->tensor_id, OPS_WAIT_GET);
    if (!op) {
        pd_log(PD_LOG_DEBUG, "kv p2p %s: late GET reply for %s from %s discarded", e->addr,
               r->tensor_id, p->addr);
        if (r->ret == P2P_RET_OK && r->meta.nbytes > 0 && e->cfg.transport == P2P_NCCL)
            p2p_client_comm_reset(e, p->addr, "a late GET reply's ncclSend has no receiver");
        return;
    }
    if (op->dropped && r->ret != P2P_RET_OK) { /* dropped, and no bytes come: done */
        op->sent_any = false;
        p2p_op_finish(e, op, false, "dropped");
        return;
    }
    if (r->ret == P2P_RET_RETRY && r->new_comm && replace_stale_comm(e, p, op) != 0) return;
    if (r->ret == P2P_RET_OK) {
        on_get_ok(e, p, op, r, frames, n); /* dropped: received, then discarded */
    } else if (r->ret == P2P_RET_RETRY &&
               r->has_meta) { /* no room for its size: reserve exactly that, retry */
        e->buffered -= op->reserved;
        op->reserved = 0;
        op->want = r->meta.nbytes;
        e->get_size_hint = op->want;
        if (op->want > e->budget)
            p2p_op_finish(
                e, op, false,
                "kv_buffer_size %zu is smaller than one request's KV (%zu bytes for tensor %s)",
                e->budget, op->want, op->id); /* sent_any: the ABORT frees it on the producer */
        else
            backoff(e, op);
    } else if (r->ret == P2P_RET_RETRY) {
        op->sent_any = false;
        p2p_op_finish(e, op, false, "peer %s has no tensor %s (%s)", p->addr, op->id,
                      r->error[0] ? r->error : "not found");
    } else {
        p2p_op_finish(e, op, false, "peer %s refused GET %s: %s", p->addr, op->id, r->error);
    }
}

void p2p_client_reply(p2p_engine *e, p2p_peer *p, zmq_msg_t *frames, int n) {
    p2p_reply r;
    pd_err err;
    p->last_used = pd_now();
    if (n < 1 ||
        p2p_reply_decode(zmq_msg_data(&frames[0]), zmq_msg_size(&frames[0]), &r, &err) != 0) {
        pd_log(PD_LOG_WARN, "kv p2p %s: bad reply from %s: %s", e->addr, p->addr,
               n < 1 ? "no frames" : err.msg);
        return;
    }
    p2p_op *op;
    switch (r.reply_to) {
    case P2P_CMD_HELLO:
        on_hello(e, p, &r);
        break;
    case P2P_CMD_NEW:
        if (r.ret != P2P_RET_OK) {
            char why[sizeof(pd_err)];
            snprintf(why, sizeof why, "peer %s refused NEW (NCCL): %.300s", p->addr, r.error);
            p2p_client_comm_reset(e, p->addr, why);
        }
        break;
    case P2P_CMD_PUT:
        op = find_op(e, OP_PUT, p->addr, r.tensor_id, OPS_WAIT_RESERVE);
        if (!op) {
            pd_log(PD_LOG_DEBUG, "kv p2p %s: late PUT reply for %s from %s", e->addr, r.tensor_id,
                   p->addr);
        } else if (r.ret == P2P_RET_OK) {
            begin_data(e, p, op);
        } else if (r.ret == P2P_RET_RETRY) {
            snprintf(op->err.msg, sizeof op->err.msg, "%s", r.error);
            if (r.new_comm && replace_stale_comm(e, p, op) != 0) break;
            backoff(e, op);
        } else {
            p2p_op_finish(e, op, false, "peer %s refused %s: %s", p->addr, op->id, r.error);
        }
        break;
    case P2P_CMD_DATA:
        op = find_op(e, OP_PUT, p->addr, r.tensor_id, OPS_WAIT_ACK);
        if (!op) break;
        if (r.ret == P2P_RET_OK) {
            op->acked = true;
            if (e->cfg.transport == P2P_TCP || op->local_done) p2p_op_finish(e, op, true, "ok");
        } else {
            char why[sizeof(pd_err)];
            snprintf(why, sizeof why, "peer %s rejected the bytes of %s: %.250s", p->addr, op->id,
                     r.error);
            if (r.drained && op->nop) {
                /* It took them off the communicator: our send completes,
                 * and the op fails then, with the pair kept. */
                op->acked = op->ack_refused = true;
                op->sent_any = false; /* it dropped the tensor itself: no ABORT */
                snprintf(op->err.msg, sizeof op->err.msg, "%s", why);
                break;
            }
            if (op->nop) p2p_client_comm_reset(e, p->addr, why); /* also fails op */
            op->sent_any = op->sent_any && !r.drained;
            p2p_op_finish(e, op, false, "%s", why);
        }
        break;
    case P2P_CMD_GET:
        on_get(e, p, &r, frames, n);
        break;
    case P2P_CMD_ABORT: {
        /* Our drop of a tensor we had reserved room for (nccl): if its
         * bytes are not on their way, nothing will come to drain. */
        p2p_rx *rx = r.sent ? NULL : p2p_rx_lookup(e, r.tensor_id);
        if (rx && rx->state == RX_RESERVED && rx->dropped && p2p_same_peer(rx->peer, p->addr))
            p2p_rx_tombstone(e, rx, pd_now());
        break;
    }
    default:
        break;
    }
}

void p2p_client_poll_nccl(p2p_engine *e, double now) {
    if (e->cfg.transport != P2P_NCCL) return;
    pd_err err;
    for (p2p_peer *p = e->peers; p; p = p->next) {
        if (p->dead || !p->comm || p->comm_ready) continue;
        int rc = p2p_nccl_comm_poll(p->comm, &err);
        if (rc == 1) {
            p->comm_ready = true;
            pd_log(PD_LOG_DEBUG, "kv p2p %s: NCCL communicator with %s ready", e->addr, p->addr);
        } else if (rc < 0 || now >= p->comm_deadline) {
            if (rc == 0)
                pd_fail(&err, "NCCL communicator with %s not ready within %.1f s", p->addr,
                        e->timeout_s);
            p2p_client_comm_reset(e, p->addr, err.msg);
        }
    }
    for (p2p_op *op = e->ops; op; op = op->next) {
        if (op->reap || op->kind == OP_OFFER || op->state == OPS_DONE || op->state == OPS_FAILED)
            continue;
        p2p_peer *p = peer_find(e, op->peer, 0);
        if (op->state == OPS_WAIT_COMM && p && p->comm_ready) begin_data(e, p, op);
        if (!op->nop && !(op->state == OPS_RECVING && op->meta.nbytes == 0)) continue;
        int rc = op->nop ? p2p_nccl_op_poll(op->nop, &err) : 1;
        if (rc == 0) continue;
        if (rc < 0) {
            p2p_client_comm_reset(e, op->peer, err.msg);
            p2p_op_finish(e, op, false, "%s", err.msg);
            continue;
        }
        p2p_nccl_op_free(op->nop);
        op->nop = NULL;
        if (op->kind == OP_PUT) {
            op->local_done = true;
            if (op->acked && op->ack_refused)
                p2p_op_finish(e, op, false, "%s", op->err.msg);
            else if (op->acked)
                p2p_op_finish(e, op, true, "ok");
            continue;
        }
        /* GET received into op->dev_buf. */
        p2p_rx_tensor *t =
            op->dropped ? NULL : p2p_rx_tensor_make(e, op->id, &op->meta, NULL, op->dev_buf);
        p2p_rx *rx = t ? calloc(1, sizeof *rx) : NULL;
        if (!rx) {
            free(t);
            p2p_op_finish(e, op, true, "ok"); /* dropped (or no memory): finish frees dev_buf */
            continue;
        }
        op->dev_buf = NULL;
        snprintf(rx->id, sizeof rx->id, "%s", op->id);
        snprintf(rx->peer, sizeof rx->peer, "%s", op->peer);
        rx->meta = op->meta;
        rx->counted = op->reserved;
        op->reserved = 0;
        rx->next = e->rx;
        e->rx = rx;
        p2p_rx_ready(e, rx, t, op->t_start);
        p2p_op_finish(e, op, true, "ok");
    }
}
