/* p2p_serve: the answering side of the KV control plane — our ROUTER, run by
 * the I/O thread. Every request gets a reply {ret, reply_to, tensor_id, ...}:
 *   HELLO  fingerprint check; a peer must pass it before anything else.
 *   NEW    (nccl) join the pair's communicator as rank 1.
 *   PUT    reserve nbytes of kv_buffer_size, or say why not (1: no room now,
 *          2: never — bigger than the whole budget, duplicate, dropped).
 *   DATA   the reserved bytes (tcp: the next frame; nccl: ncclRecv), then ack.
 *   GET    hand out an offered tensor (if it fits the asker's room).
 *   ABORT  free or cancel everything for that tensor id at once. */
#include "connector/p2p_internal.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

static p2p_inpeer *inpeer_find(p2p_engine *e, const char *identity) {
    for (p2p_inpeer *p = e->inpeers; p; p = p->next)
        if (!strcmp(p->identity, identity)) return p;
    return NULL;
}

static p2p_inpeer *inpeer_get(p2p_engine *e, const char *identity) {
    p2p_inpeer *p = inpeer_find(e, identity);
    if (p) return p;
    p = calloc(1, sizeof *p);
    if (!p) return NULL;
    snprintf(p->identity, sizeof p->identity, "%s", identity);
    p->next = e->inpeers;
    e->inpeers = p;
    return p;
}

static void send_reply(p2p_engine *e, const char *identity, const p2p_reply *r, p2p_blob *data) {
    p2p_buf b = {0};
    pd_err err;
    int rc = p2p_reply_encode(r, &b, &err);
    if (rc == 0)
        rc = p2p_io_send(e->router, identity, &b, data, &err); /* EHOSTUNREACH: the peer is gone */
    free(b.data);
    if (rc != 0)
        pd_log(PD_LOG_DEBUG, "kv p2p %s: reply to %s %s for %s not sent: %s", e->addr, identity,
               p2p_cmd_name(r->reply_to), r->tensor_id, err.msg);
}

/* What a reply may say beyond ret and error (p2p_reply's flags). */
enum { REPLY_NEW_COMM = 1, REPLY_DRAINED = 2, REPLY_SENT = 4 };

static void reply_flags(p2p_engine *e, const char *identity, p2p_cmd to, const char *id, int ret,
                        int flags, const char *fmt, ...) __attribute__((format(printf, 7, 8)));
static void reply_flags(p2p_engine *e, const char *identity, p2p_cmd to, const char *id, int ret,
                        int flags, const char *fmt, ...) {
    p2p_reply r;
    memset(&r, 0, sizeof r);
    r.ret = ret;
    r.reply_to = to;
    r.new_comm = flags & REPLY_NEW_COMM;
    r.drained = flags & REPLY_DRAINED;
    r.sent = flags & REPLY_SENT;
    snprintf(r.tensor_id, sizeof r.tensor_id, "%s", id ? id : "");
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(r.error, sizeof r.error, fmt, ap);
        va_end(ap);
    }
    if (ret == P2P_RET_OK) r.error[0] = 0;
    send_reply(e, identity, &r, NULL);
}

/* Most replies say just ret (and an error when ret != 0). */
#define reply(e, identity, to, id, ret, ...) reply_flags(e, identity, to, id, ret, 0, __VA_ARGS__)

/* Gives up on a receive whose bytes can no longer come: NCCL no longer
 * writes into rx->dev_buf (its communicator is destroyed, or no ncclRecv
 * was posted). The producer hears at once (DATA refused, not drained: it
 * tears down its side too), instead of at its deadline; rx fails, or, if
 * the consumer dropped it, becomes a tombstone. */
static void rx_abandon(p2p_engine *e, p2p_rx *rx, const char *why) {
    char who[P2P_ADDR_MAX];
    snprintf(who, sizeof who, "%s", rx->peer);
    reply(e, who, P2P_CMD_DATA, rx->id, P2P_RET_REFUSED, "%s", why);
    p2p_nccl_op_free(rx->nop);
    rx->nop = NULL;
    if (rx->dropped) {
        p2p_rx_tombstone(e, rx, pd_now());
    } else {
        pd_err perr;
        pd_fail(&perr, "%s", why);
        p2p_rx_fail(e, rx->id, who, &perr); /* frees dev_buf */
    }
}

/* Reservations (RX_RESERVED) outlive the communicator: their bytes go over
 * whichever one is up when their DATA comes, usually the one the
 * producer's next NEW builds. */
void p2p_serve_comm_reset(p2p_engine *e, const char *identity, const char *why) {
    p2p_inpeer *ip = inpeer_find(e, identity);
    if (!ip || !ip->comm) return;
    e->stats.comm_resets++;
    pd_log(PD_LOG_WARN, "kv p2p %s: NCCL communicator from %s torn down: %s", e->addr, identity,
           why);
    p2p_nccl_comm_destroy(ip->comm); /* first: NCCL stops touching buffers */
    ip->comm = NULL;
    ip->comm_ready = false;
    for (p2p_rx *rx = e->rx; rx; rx = rx->next)
        if (rx->state == RX_RECVING && !strcmp(rx->peer, identity)) rx_abandon(e, rx, why);
    for (p2p_op *op = e->ops; op; op = op->next)
        if (op->kind == OP_OFFER && op->state == OPS_OFFER_SENDING &&
            !strcmp(op->in_peer, identity))
            p2p_op_finish(e, op, false, "%s", why);
}

static void on_hello(p2p_engine *e, p2p_inpeer *ip, const void *data, size_t len) {
    p2p_hello m;
    pd_err err;
    p2p_reply r;
    memset(&r, 0, sizeof r);
    r.reply_to = P2P_CMD_HELLO;
    snprintf(r.fingerprint, sizeof r.fingerprint, "%s", e->fingerprint);
    if (p2p_hello_decode(data, len, &m, &err) != 0) {
        r.ret = P2P_RET_REFUSED;
        snprintf(r.error, sizeof r.error, "malformed HELLO: %.300s", err.msg);
    } else if (strcmp(m.fingerprint, e->fingerprint) != 0) {
        ip->verified = -1;
        snprintf(ip->error, sizeof ip->error,
                 "peer %s has model fingerprint \"%.200s\", we have \"%.200s\"", ip->identity,
                 m.fingerprint, e->fingerprint);
        e->stats.fingerprint_mismatches++;
        pd_log(PD_LOG_ERROR, "kv p2p %s: refusing transfers: %s", e->addr, ip->error);
        r.ret = P2P_RET_REFUSED;
        snprintf(r.error, sizeof r.error, "model fingerprint mismatch");
    } else {
        ip->verified = 1;
        pd_log(PD_LOG_DEBUG, "kv p2p %s: HELLO from %s: fingerprint ok", e->addr, ip->identity);
    }
    send_reply(e, ip->identity, &r, NULL);
}

static void on_new(p2p_engine *e, p2p_inpeer *ip, const void *data, size_t len) {
    p2p_new m;
    pd_err err;
    if (p2p_new_decode(data, len, &m, &err) != 0) {
        reply(e, ip->identity, P2P_CMD_NEW, NULL, P2P_RET_REFUSED, "malformed NEW: %s", err.msg);
        return;
    }
    if (e->cfg.transport != P2P_NCCL) {
        reply(e, ip->identity, P2P_CMD_NEW, NULL, P2P_RET_REFUSED,
              "instance %s uses transport tcp, not nccl", e->addr);
        return;
    }
    if (ip->comm) p2p_serve_comm_reset(e, ip->identity, "the peer started a new NCCL communicator");
    if (p2p_nccl_comm_start(m.unique_id, 1, e->cfg.nccl_device, e->cfg.nccl_num_channels, &ip->comm,
                            &err) != 0) {
        ip->comm = NULL;
        reply(e, ip->identity, P2P_CMD_NEW, NULL, P2P_RET_REFUSED, "%s", err.msg);
        return;
    }
    ip->comm_ready = false;
    ip->comm_deadline = pd_now() + e->timeout_s;
    pd_log(PD_LOG_DEBUG, "kv p2p %s: NEW from %s (NCCL rank 1)", e->addr, ip->identity);
    reply(e, ip->identity, P2P_CMD_NEW, NULL, P2P_RET_OK, NULL);
}

static void on_put(p2p_engine *e, p2p_inpeer *ip, const void *data, size_t len) {
    p2p_put_msg m;
    pd_err err;
    const char *who = ip->identity;
    if (p2p_put_decode(data, len, &m, &err) != 0) {
        reply(e, who, P2P_CMD_PUT, NULL, P2P_RET_REFUSED, "malformed PUT: %s", err.msg);
        return;
    }
    uint64_t n = m.meta.nbytes;
    p2p_rx *rx = p2p_rx_lookup(e, m.tensor_id);
    if (rx && rx->state == RX_DROPPED) {
        reply(e, who, P2P_CMD_PUT, m.tensor_id, P2P_RET_REFUSED, "consumer %s dropped tensor %s",
              e->addr, m.tensor_id);
        return;
    }
    if (rx && rx->state != RX_FAILED) {
        reply(e, who, P2P_CMD_PUT, m.tensor_id, P2P_RET_REFUSED,
              "duplicate tensor_id %s (already reserved or here)", m.tensor_id);
        return;
    }
    if (n > e->budget) {
        /* For good: also fail the id here, so the request waiting for it
         * hears now, not at its deadline. */
        pd_fail(&err,
                "kv_buffer_size %zu is smaller than one request's KV (%" PRIu64
                " bytes for tensor %s)",
                e->budget, n, m.tensor_id);
        p2p_rx_fail(e, m.tensor_id, who, &err);
        reply(e, who, P2P_CMD_PUT, m.tensor_id, P2P_RET_REFUSED, "%s", err.msg);
        return;
    }
    if (n > e->budget - (e->buffered < e->budget ? e->buffered : e->budget)) {
        reply(e, who, P2P_CMD_PUT, m.tensor_id, P2P_RET_RETRY,
              "no room: %zu of kv_buffer_size %zu bytes in use, %s needs %" PRIu64, e->buffered,
              e->budget, m.tensor_id, n);
        return;
    }
    void *dev = NULL;
    if (e->cfg.transport == P2P_NCCL && n > 0) {
        if (!ip->comm) {
            /* We tore our side down (a transfer on it failed) and the
             * sender has not heard: it starts a new one and asks again. */
            reply_flags(e, who, P2P_CMD_PUT, m.tensor_id, P2P_RET_RETRY, REPLY_NEW_COMM,
                        "no NCCL communicator with %s: send NEW", who);
            return;
        }
        dev = p2p_nccl_alloc(e->dev_mem, n, &err);
        if (!dev) {
            reply(e, who, P2P_CMD_PUT, m.tensor_id, P2P_RET_RETRY, "no room on the device: %s",
                  err.msg);
            return;
        }
    }
    if (!rx) {
        rx = calloc(1, sizeof *rx);
        if (!rx) {
            p2p_nccl_free(dev, NULL);
            reply(e, who, P2P_CMD_PUT, m.tensor_id, P2P_RET_RETRY, "out of memory");
            return;
        }
        rx->next = e->rx;
        e->rx = rx;
    }
    snprintf(rx->id, sizeof rx->id, "%s", m.tensor_id);
    snprintf(rx->peer, sizeof rx->peer, "%s", who);
    rx->state = RX_RESERVED;
    rx->meta = m.meta;
    rx->counted = n;
    rx->dev_buf = dev;
    rx->t_start = pd_now();
    rx->expires = rx->t_start + e->timeout_s; /* the bytes must follow within timeout_s */
    e->buffered += n;
    pd_log(PD_LOG_DEBUG,
           "kv p2p %s: PUT %s from %s: reserved %" PRIu64 " bytes (buffered %zu of %zu)", e->addr,
           m.tensor_id, who, n, e->buffered, e->budget);
    reply(e, who, P2P_CMD_PUT, m.tensor_id, P2P_RET_OK, NULL);
}

static void on_data(p2p_engine *e, p2p_inpeer *ip, const void *data, size_t len, zmq_msg_t *frame) {
    p2p_data_msg m;
    pd_err err;
    const char *who = ip->identity;
    if (p2p_data_decode(data, len, &m, &err) != 0) {
        reply(e, who, P2P_CMD_DATA, NULL, P2P_RET_REFUSED, "malformed DATA: %s", err.msg);
        if (e->cfg.transport == P2P_NCCL) p2p_serve_comm_reset(e, who, "malformed DATA");
        return;
    }
    p2p_rx *rx = p2p_rx_lookup(e, m.tensor_id);
    if (!rx || rx->state != RX_RESERVED || strcmp(rx->peer, who) != 0) {
        /* Late bytes for a dropped or expired id: discarded (tcp: the frame is closed by the
         * caller). */
        pd_log(PD_LOG_DEBUG, "kv p2p %s: late DATA %s from %s discarded", e->addr, m.tensor_id,
               who);
        reply(e, who, P2P_CMD_DATA, m.tensor_id, P2P_RET_REFUSED,
              "tensor %s is not reserved here (dropped or expired)", m.tensor_id);
        if (e->cfg.transport == P2P_NCCL && m.nbytes > 0)
            p2p_serve_comm_reset(e, who, "DATA without a reservation");
        return;
    }
    if (m.nbytes != rx->meta.nbytes) {
        pd_fail(&err, "producer %s announced %" PRIu64 " bytes for %s, then DATA of %" PRIu64, who,
                rx->meta.nbytes, m.tensor_id, m.nbytes);
        p2p_rx_fail(e, rx->id, who, &err);
        reply(e, who, P2P_CMD_DATA, m.tensor_id, P2P_RET_REFUSED, "%s", err.msg);
        if (e->cfg.transport == P2P_NCCL) p2p_serve_comm_reset(e, who, err.msg);
        return;
    }
    if (e->cfg.transport == P2P_NCCL) {
        rx->state = RX_RECVING;
        if (m.nbytes == 0) return; /* p2p_serve_poll_nccl completes it */
        if (!ip->comm) {
            pd_fail(&err, "no NCCL communicator from %s for DATA %s (torn down here)", who,
                    m.tensor_id);
            rx_abandon(e, rx, err.msg);
            return;
        }
        /* Our side of the join may still be completing (the producer's is
         * done, or it would not send): the receive then waits in the
         * communicator's queue, in order, until it is. */
        if (p2p_nccl_recv(ip->comm, rx->dev_buf, m.nbytes, &rx->nop, &err) != 0) {
            p2p_serve_comm_reset(e, who, err.msg); /* abandons rx, with the others on it */
            if (rx->state == RX_RECVING) rx_abandon(e, rx, err.msg);
        }
        return;
    }
    size_t got = frame ? zmq_msg_size(frame) : 0;
    if (!frame || got != m.nbytes) {
        pd_fail(&err, "producer %s sent %zu bytes for %s, announced %" PRIu64, who, got,
                m.tensor_id, m.nbytes);
        p2p_rx_fail(e, rx->id, who, &err);
        reply(e, who, P2P_CMD_DATA, m.tensor_id, P2P_RET_REFUSED, "%s", err.msg);
        return;
    }
    p2p_rx_tensor *t = p2p_rx_tensor_make(e, rx->id, &rx->meta, frame, NULL);
    if (!t) {
        pd_fail(&err, "out of memory receiving %s", rx->id);
        p2p_rx_fail(e, rx->id, who, &err);
        reply(e, who, P2P_CMD_DATA, m.tensor_id, P2P_RET_REFUSED, "%s", err.msg);
        return;
    }
    p2p_rx_ready(e, rx, t, rx->t_start);
    reply(e, who, P2P_CMD_DATA, m.tensor_id, P2P_RET_OK, NULL);
}

static void on_get(p2p_engine *e, p2p_inpeer *ip, const void *data, size_t len) {
    p2p_get_msg m;
    pd_err err;
    const char *who = ip->identity;
    if (p2p_get_decode(data, len, &m, &err) != 0) {
        reply(e, who, P2P_CMD_GET, NULL, P2P_RET_REFUSED, "malformed GET: %s", err.msg);
        return;
    }
    p2p_op *op = e->ops;
    while (op &&
           !(op->kind == OP_OFFER && op->state == OPS_OFFERED && !strcmp(op->id, m.tensor_id)))
        op = op->next;
    if (!op) {
        reply(e, who, P2P_CMD_GET, m.tensor_id, P2P_RET_RETRY, "not found");
        return;
    }
    p2p_reply r;
    memset(&r, 0, sizeof r);
    r.reply_to = P2P_CMD_GET;
    snprintf(r.tensor_id, sizeof r.tensor_id, "%s", op->id);
    r.has_meta = true;
    r.meta = op->meta;
    bool nccl = e->cfg.transport == P2P_NCCL && op->meta.nbytes > 0;
    if (op->meta.nbytes > m.max_nbytes || (nccl && !ip->comm)) {
        /* The asker reserves exactly nbytes and asks again. With no
         * communicator at all (we tore ours down), its side is stale too:
         * new_comm asks it for a NEW. One still joining is fine: the send
         * waits in its queue for the join, and the asker's receive in its
         * own (a RETRY here cost the first GET of a pair up to 0.1 s). */
        r.ret = P2P_RET_RETRY;
        r.new_comm = nccl && !ip->comm;
        snprintf(r.error, sizeof r.error, "%s", r.new_comm ? "no NCCL communicator" : "no room");
        send_reply(e, who, &r, NULL);
        return;
    }
    r.ret = P2P_RET_OK;
    pd_log(PD_LOG_DEBUG, "kv p2p %s: GET %s from %s: sending %" PRIu64 " bytes", e->addr, op->id,
           who, op->meta.nbytes);
    if (!nccl) {
        /* The frame holds its own reference: finishing (freeing) the offer now is safe. */
        send_reply(e, who, &r, e->cfg.transport == P2P_TCP ? op->data : NULL);
        p2p_op_finish(e, op, true, "ok");
        return;
    }
    send_reply(e, who, &r, NULL);
    snprintf(op->in_peer, sizeof op->in_peer, "%s", who);
    op->state = OPS_OFFER_SENDING;
    if (p2p_nccl_send(ip->comm, op->data->data, op->meta.nbytes, op->data->ready, &op->nop, &err) !=
        0)
        p2p_serve_comm_reset(e, who, err.msg); /* fails op */
}

static void on_abort(p2p_engine *e, p2p_inpeer *ip, const void *data, size_t len) {
    p2p_abort_msg m;
    pd_err err;
    const char *who = ip->identity;
    if (p2p_abort_decode(data, len, &m, &err) != 0) {
        reply(e, who, P2P_CMD_ABORT, NULL, P2P_RET_REFUSED, "malformed ABORT: %s", err.msg);
        return;
    }
    bool hit = false, sent = false;
    /* As producer: the consumer gave up — free the offer, stop sending. */
    for (p2p_op *op = e->ops; op; op = op->next) {
        if (op->kind == OP_GET || op->reap || op->state == OPS_DONE || op->state == OPS_FAILED ||
            strcmp(op->id, m.tensor_id))
            continue;
        /* nccl, bytes on their way (the send posted, or done and waiting
         * for the ack): the consumer drains them; let the send finish. */
        if (op->nop || (e->cfg.transport == P2P_NCCL && op->state == OPS_WAIT_ACK)) {
            sent = true;
            continue;
        }
        op->sent_any = false;
        p2p_op_finish(e, op, false, "aborted by peer %s", who);
        hit = true;
    }
    /* As consumer: the producer gave up — free the reservation, and let p2p_take say so. */
    p2p_rx *rx = p2p_rx_lookup(e, m.tensor_id);
    if (rx && rx->state == RX_RESERVED && p2p_same_peer(rx->peer, who)) {
        if (rx->dropped) { /* we dropped it too: no bytes will come to drain */
            p2p_rx_tombstone(e, rx, pd_now());
        } else {
            pd_fail(&err, "producer %s aborted tensor %s", who, m.tensor_id);
            p2p_rx_fail(e, m.tensor_id, who, &err);
        }
        hit = true;
    }
    if (hit) e->stats.aborts++;
    pd_log(PD_LOG_DEBUG, "kv p2p %s: ABORT %s from %s (%s)", e->addr, m.tensor_id, who,
           sent  ? "bytes already sent"
           : hit ? "freed"
                 : "nothing held");
    reply_flags(e, who, P2P_CMD_ABORT, m.tensor_id, P2P_RET_OK, sent ? REPLY_SENT : 0, NULL);
}

void p2p_serve_request(p2p_engine *e, zmq_msg_t *frames, int n) {
    size_t idlen = n >= 1 ? zmq_msg_size(&frames[0]) : 0;
    if (n < 2 || idlen == 0 || idlen >= P2P_ADDR_MAX ||
        memchr(zmq_msg_data(&frames[0]), 0, idlen)) {
        pd_log(PD_LOG_WARN, "kv p2p %s: message with %d frames / identity of %zu bytes ignored",
               e->addr, n, idlen);
        return;
    }
    char who[P2P_ADDR_MAX];
    memcpy(who, zmq_msg_data(&frames[0]), idlen);
    who[idlen] = 0;
    const void *data = zmq_msg_data(&frames[1]);
    size_t len = zmq_msg_size(&frames[1]);
    p2p_cmd cmd;
    pd_err err;
    if (p2p_msg_cmd(data, len, &cmd, &err) != 0) {
        pd_log(PD_LOG_WARN, "kv p2p %s: message from %s ignored: %s", e->addr, who, err.msg);
        return;
    }
    p2p_inpeer *ip = inpeer_get(e, who);
    if (!ip) return;
    if (cmd != P2P_CMD_HELLO && ip->verified != 1) {
        /* The peer's id for the request is not decoded yet; reply so it fails fast, not at its
         * deadline. */
        char id[P2P_ID_MAX] = "";
        p2p_put_msg pm;
        if (cmd == P2P_CMD_PUT && p2p_put_decode(data, len, &pm, &err) == 0)
            snprintf(id, sizeof id, "%s", pm.tensor_id);
        p2p_get_msg gm;
        if (cmd == P2P_CMD_GET && p2p_get_decode(data, len, &gm, &err) == 0)
            snprintf(id, sizeof id, "%s", gm.tensor_id);
        if (ip->verified < 0)
            reply(e, who, cmd, id, P2P_RET_REFUSED, "%s", ip->error);
        else
            reply(e, who, cmd, id, P2P_RET_REFUSED, "peer %s sent %s before HELLO", who,
                  p2p_cmd_name(cmd));
        return;
    }
    switch (cmd) {
    case P2P_CMD_HELLO:
        on_hello(e, ip, data, len);
        break;
    case P2P_CMD_NEW:
        on_new(e, ip, data, len);
        break;
    case P2P_CMD_PUT:
        on_put(e, ip, data, len);
        break;
    case P2P_CMD_DATA:
        on_data(e, ip, data, len, n >= 3 ? &frames[2] : NULL);
        break;
    case P2P_CMD_GET:
        on_get(e, ip, data, len);
        break;
    case P2P_CMD_ABORT:
        on_abort(e, ip, data, len);
        break;
    default:
        break;
    }
}

void p2p_serve_poll_nccl(p2p_engine *e, double now) {
    if (e->cfg.transport != P2P_NCCL) return;
    pd_err err;
    for (p2p_inpeer *ip = e->inpeers; ip; ip = ip->next) {
        if (!ip->comm || ip->comm_ready) continue;
        int rc = p2p_nccl_comm_poll(ip->comm, &err);
        if (rc == 1) {
            ip->comm_ready = true;
            pd_log(PD_LOG_DEBUG, "kv p2p %s: NCCL communicator from %s ready", e->addr,
                   ip->identity);
        } else if (rc < 0 || now >= ip->comm_deadline) {
            if (rc == 0)
                pd_fail(&err, "NCCL communicator from %s not ready within %.1f s", ip->identity,
                        e->timeout_s);
            p2p_serve_comm_reset(e, ip->identity, err.msg);
        }
    }
    for (p2p_rx *rx = e->rx; rx; rx = rx->next) {
        if (rx->state != RX_RECVING) continue;
        int rc = rx->nop ? p2p_nccl_op_poll(rx->nop, &err) : 1;
        if (rc == 0 && now >= rx->expires)
            rc = -1, pd_fail(&err, "deadline: NCCL receive of %s from %s", rx->id, rx->peer);
        if (rc == 0) continue;
        char who[P2P_ADDR_MAX];
        snprintf(who, sizeof who, "%s", rx->peer);
        if (rc < 0) {
            p2p_serve_comm_reset(e, who, err.msg); /* abandons rx, with the others on it */
            continue;
        }
        p2p_nccl_op_free(rx->nop);
        rx->nop = NULL;
        if (rx->dropped) {
            p2p_rx_tombstone(e, rx, now);
            /* drained: the producer's send is complete, the communicator stays */
            reply_flags(e, who, P2P_CMD_DATA, rx->id, P2P_RET_REFUSED, REPLY_DRAINED,
                        "consumer %s dropped tensor %s", e->addr, rx->id);
            continue;
        }
        p2p_rx_tensor *t = p2p_rx_tensor_make(e, rx->id, &rx->meta, NULL, rx->dev_buf);
        if (!t) {
            pd_fail(&err, "out of memory receiving %s", rx->id);
            p2p_rx_fail(e, rx->id, who, &err); /* frees dev_buf */
            reply(e, who, P2P_CMD_DATA, rx->id, P2P_RET_REFUSED, "%s", err.msg);
            continue;
        }
        rx->dev_buf = NULL;
        p2p_rx_ready(e, rx, t, rx->t_start);
        reply(e, who, P2P_CMD_DATA, rx->id, P2P_RET_OK, NULL);
    }
    for (p2p_op *op = e->ops; op; op = op->next) {
        if (op->kind != OP_OFFER || op->state != OPS_OFFER_SENDING || !op->nop) continue;
        int rc = p2p_nccl_op_poll(op->nop, &err);
        if (rc == 1)
            p2p_op_finish(e, op, true, "ok");
        else if (rc < 0)
            p2p_serve_comm_reset(e, op->in_peer, err.msg);
    }
}
