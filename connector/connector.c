/* connector: moves one request's K/V between the paged cache and the
 * transfer engine (connector/p2p.h). See connector.h and
 * docs/disaggregation.md.
 *
 * Payload layout (one tensor per layer, id "<transfer id>#<layer>"):
 *   [2, num_tokens, num_heads, head_dim] in the model's compute dtype —
 *   K rows of every prompt token, then V rows, in token order. Token order
 *   (not block order) is what lets the two sides use different block sizes. */
#include "connector/connector.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "connector/p2p.h"
#include "model/backend.h"

/* Host buffers the tcp data plane sends from. Page-locked where the backend
 * has such memory (up to pinned_limit bytes of it), so copy_d2h is one DMA,
 * and reused, so a request's KV lands in pages that are already mapped
 * rather than freshly faulted in. Sizes are rounded up to powers of two from
 * 64 KiB so buffers of similar requests fit each other. Buffers are taken on
 * the engine thread and given back by the transfer engine from its own
 * threads once sent, hence the lock; a page-locked buffer is only ever
 * freed on the engine thread (the backend's host_free may not run beside
 * its other calls): at destroy, or to make room for another size
 * (pool_evict_pinned). pinned_limit bounds them. Ordinary ones beyond
 * idle_limit are freed when given back. */
typedef struct kv_host_pool {
    pthread_mutex_t mu;
    pd_backend *be;
    void **idle;                       /* buffers (header first) not in use */
    int n_idle, n_total, cap_idle;     /* cap_idle >= n_total: a give-back never grows it */
    size_t idle_bytes, idle_limit;     /* ordinary idle bytes, and their limit */
    size_t pinned_bytes, pinned_limit; /* page-locked capacity, idle or in use */
    size_t pageable_bytes;             /* ordinary capacity, idle or in use */
} kv_host_pool;

/* What precedes each payload; 64 bytes keep the payload 64-byte aligned. */
typedef struct pool_header {
    size_t cap;
    bool pinned; /* from be->host_alloc, else malloc */
    char pad[64 - sizeof(size_t) - sizeof(bool)];
} pool_header;

static void pool_raw_free(kv_host_pool *pl, pool_header *h) {
    if (!h->pinned)
        free(h);
    else if (pl->be->host_free)
        pl->be->host_free(pl->be, h);
}

static size_t pool_cap(size_t nbytes) {
    size_t cap = (size_t)1 << 16;
    while (cap < nbytes)
        cap <<= 1;
    return cap;
}

/* An idle buffer of this capacity, page-locked if there is one (only a
 * page-locked one when pinned_only), or NULL. */
static void *pool_take_idle(kv_host_pool *pl, size_t cap, bool pinned_only) {
    pthread_mutex_lock(&pl->mu);
    int pick = -1;
    for (int i = 0; i < pl->n_idle; i++) {
        const pool_header *h = pl->idle[i];
        if (h->cap != cap || ((pick >= 0 || pinned_only) && !h->pinned)) continue;
        pick = i;
        if (h->pinned) break;
    }
    pool_header *h = NULL;
    if (pick >= 0) {
        h = pl->idle[pick];
        pl->idle[pick] = pl->idle[--pl->n_idle];
        if (!h->pinned) pl->idle_bytes -= cap;
    }
    pthread_mutex_unlock(&pl->mu);
    return h ? h + 1 : NULL;
}

/* A new buffer: page-locked where the backend has such memory within
 * pinned_limit, else an ordinary one, or with pinned_only none (NULL).
 * Engine thread only: the backend's host_alloc may not run beside its other
 * calls. */
static void *pool_new(kv_host_pool *pl, size_t cap, bool pinned_only) {
    pthread_mutex_lock(&pl->mu);
    /* First make room for it in the idle list. */
    if (pl->n_total == pl->cap_idle) {
        int n = pl->cap_idle ? 2 * pl->cap_idle : 16;
        void **grown = realloc(pl->idle, sizeof *grown * (size_t)n);
        if (!grown) {
            pthread_mutex_unlock(&pl->mu);
            return NULL;
        }
        pl->idle = grown;
        pl->cap_idle = n;
    }
    const bool pin = pl->be->host_alloc && pl->pinned_bytes + cap <= pl->pinned_limit;
    if (!pin && pinned_only) {
        pthread_mutex_unlock(&pl->mu);
        return NULL;
    }
    if (pin) pl->pinned_bytes += cap; /* claimed now, given back if the allocation fails */
    pl->n_total++;
    pthread_mutex_unlock(&pl->mu);
    pd_err ignored;
    pool_header *h = pin ? pl->be->host_alloc(pl->be, sizeof *h + cap, &ignored) : NULL;
    const bool pinned = h != NULL;
    if (!pinned && !pinned_only) h = malloc(sizeof *h + cap);
    pthread_mutex_lock(&pl->mu); /* the books: claims that did not come true, ordinary bytes */
    if (pin != pinned) pl->pinned_bytes -= cap;
    if (!h)
        pl->n_total--;
    else if (!pinned)
        pl->pageable_bytes += cap;
    pthread_mutex_unlock(&pl->mu);
    if (!h) return NULL;
    h->cap = cap;
    h->pinned = pinned;
    return h + 1;
}

/* p2p_config.host_alloc: buffers the engine thread sends from. */
static void *pool_get(void *ctx, size_t nbytes) {
    kv_host_pool *pl = ctx;
    const size_t cap = pool_cap(nbytes);
    void *p = pool_take_idle(pl, cap, false);
    return p ? p : pool_new(pl, cap, false);
}

/* p2p_config.recv_alloc (recv_into_pinned): called on the transfer engine's
 * thread, so it never asks the backend for memory: an idle page-locked
 * buffer (those kv_connector_load_begin set out), else NULL, and the layer
 * stays in ZMQ's frame. Copying it into ordinary memory would cost the
 * receive path a memcpy (and a fresh buffer's page faults) for nothing: the
 * write to the device would still be a pageable copy. */
static void *pool_get_received(void *ctx, size_t nbytes) {
    return pool_take_idle(ctx, pool_cap(nbytes), true);
}

static void pool_put(void *ctx, void *payload) {
    kv_host_pool *pl = ctx;
    if (!payload) return;
    pool_header *h = (pool_header *)payload - 1;
    pthread_mutex_lock(&pl->mu);
    if (h->pinned || pl->idle_bytes + h->cap <= pl->idle_limit) {
        pl->idle[pl->n_idle++] = h; /* room: cap_idle >= n_total */
        if (!h->pinned) pl->idle_bytes += h->cap;
        h = NULL;
    } else { /* over idle_limit: off the books, freed below (any thread may) */
        pl->n_total--;
        pl->pageable_bytes -= h->cap;
    }
    pthread_mutex_unlock(&pl->mu);
    free(h);
}

/* Engine thread: free idle page-locked buffers of other sizes than cap
 * until one of cap fits within pinned_limit, or none is left to free, so
 * that the size of the requests coming now gets the page-locked memory
 * rather than the size of earlier ones. */
static void pool_evict_pinned(kv_host_pool *pl, size_t cap) {
    for (;;) {
        pool_header *victim = NULL;
        pthread_mutex_lock(&pl->mu);
        for (int i = 0; pl->pinned_bytes + cap > pl->pinned_limit && i < pl->n_idle; i++) {
            pool_header *h = pl->idle[i];
            if (!h->pinned || h->cap == cap) continue;
            victim = h;
            pl->idle[i] = pl->idle[--pl->n_idle];
            pl->n_total--;
            pl->pinned_bytes -= h->cap;
            break;
        }
        pthread_mutex_unlock(&pl->mu);
        if (!victim) return;
        pool_raw_free(pl, victim);
    }
}

/* Engine thread, before a load whose layers come as nbytes each
 * (recv_into_pinned): set out idle page-locked buffers of that size for
 * them, up to count in all and within pinned_limit (freeing idle ones of
 * other sizes for room), so that the transfer engine's thread finds
 * page-locked memory without asking the backend. */
static void pool_prepare(kv_host_pool *pl, size_t nbytes, int count) {
    const size_t cap = pool_cap(nbytes);
    int have = 0;
    pthread_mutex_lock(&pl->mu);
    for (int i = 0; i < pl->n_idle; i++) {
        const pool_header *h = pl->idle[i];
        have += h->cap == cap && h->pinned;
    }
    pthread_mutex_unlock(&pl->mu);
    for (; have < count; have++) {
        pool_evict_pinned(pl, cap);
        /* Page-locked or nothing: at the limit (or if host_alloc fails) the
         * rest stay in ZMQ's frames (pool_get_received). */
        void *p = pool_new(pl, cap, true);
        if (!p) return;
        pool_put(pl, p);
    }
}

/* Every buffer must be back (the transfer engine destroyed first). */
static void pool_destroy(kv_host_pool *pl) {
    for (int i = 0; i < pl->n_idle; i++)
        pool_raw_free(pl, pl->idle[i]);
    free(pl->idle);
    pthread_mutex_destroy(&pl->mu);
}

typedef struct {
    void *p;
    size_t cap;
} dev_scratch;

struct kv_connector {
    kv_transfer_config cfg;
    opt_model *model;
    opt_kv_storage *kv;
    pd_backend *be;
    p2p_engine *p2p;
    kv_host_pool pool; /* tcp send buffers (outlives p2p) */
    /* recv_into_pinned in effect: a consumer on tcp receives into the pool */
    bool recv_into_pool;
    char fingerprint[256];
    char id_prefix[40]; /* random per process: transfer ids are unique per producer */
    uint64_t counter;   /* engine thread only */
    int layers, kv_dim, block_size;
    /* Backend memory reused by save and load (engine thread only): the slot
     * mapping and one layer's rows. Kept between requests, grown to the
     * largest seen, because on the GPU a free waits for the whole device. */
    dev_scratch slots_buf, rows_buf;
    pthread_mutex_t mu; /* guards stats (read from HTTP threads) */
    kv_connector_stats stats;
};

/* One layer of a load, once taken from the transfer engine. */
typedef struct kv_load_layer {
    bool taken, written; /* written: into the cache; its tensor is freed then */
    p2p_tensor *tensor;
    size_t nbytes;
    int64_t n_sent; /* tokens it covers */
} kv_load_layer;

struct kv_load {
    kv_request_params params;
    char tag[64];
    int n_prompt;
    double started, deadline;
    kv_load_layer *layer; /* one per model layer */
    int n_taken;
    int n_early;   /* layers written by load_poll, as they arrived */
    bool applying; /* in load_apply */
    size_t bytes;  /* written so far */
    bool applied;
};

/* The first non-loopback IPv4 address, or 127.0.0.1. */
static void default_ip(char *out, size_t cap) {
    snprintf(out, cap, "127.0.0.1");
    struct ifaddrs *ifs = NULL;
    if (getifaddrs(&ifs) != 0) return;
    for (struct ifaddrs *i = ifs; i; i = i->ifa_next) {
        if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
        const struct sockaddr_in *a = (const struct sockaddr_in *)i->ifa_addr;
        if ((ntohl(a->sin_addr.s_addr) >> 24) == 127) continue;
        inet_ntop(AF_INET, &a->sin_addr, out, (socklen_t)cap);
        break;
    }
    freeifaddrs(ifs);
}

int kv_connector_create(const kv_transfer_config *cfg, opt_model *model, opt_kv_storage *kv,
                        pd_backend *be, int http_port, void (*on_kv_arrival)(void *ctx), void *ctx,
                        kv_connector **out, pd_err *err) {
    (void)http_port;
    *out = NULL;
    kv_connector *c = calloc(1, sizeof *c);
    if (!c) return pd_fail(err, "out of memory");
    c->cfg = *cfg;
    if (!c->cfg.kv_ip[0]) default_ip(c->cfg.kv_ip, sizeof c->cfg.kv_ip);
    c->model = model;
    c->kv = kv;
    c->be = be;
    pthread_mutex_init(&c->mu, NULL);
    pthread_mutex_init(&c->pool.mu, NULL);
    c->pool.be = be;
    /* Send buffers kept for reuse, and page-locked memory in all: a few long
     * prompts' KV of a small model in flight, without pinning much of the
     * host (what is over the limits is ordinary memory, freed once sent). */
    c->pool.idle_limit = (size_t)1 << 30;
    /* mem_pool_size_gb 0 (a config not from kv_transfer_config_parse): 1 GiB */
    c->pool.pinned_limit =
        (size_t)((c->cfg.mem_pool_size_gb > 0 ? c->cfg.mem_pool_size_gb : 1) * (double)(1u << 30));
    /* Only page-locked memory is worth a copy out of ZMQ's frame: from
     * ordinary memory the write to the cache is the same pageable copy. */
    c->recv_into_pool = cfg->recv_into_pinned && cfg->role != KV_ROLE_PRODUCER &&
                        cfg->transport == KV_TRANSPORT_TCP && be->host_alloc;
    const opt_config *mc = opt_model_config(model);
    c->layers = mc->num_hidden_layers;
    c->kv_dim = mc->hidden_size;
    c->block_size = opt_kv_block_size(kv);
    if (cfg->transport == KV_TRANSPORT_NCCL && be->device < 0) {
        kv_connector_destroy(c);
        return pd_fail(err,
                       "kv_transfer_config transport \"nccl\" sends KV from GPU memory, but "
                       "this instance's KV cache is on the %s (use --device cuda, or transport "
                       "\"tcp\")",
                       be->name);
    }
    /* What both sides must agree on for the bytes to mean the same thing. */
    snprintf(c->fingerprint, sizeof c->fingerprint,
             "opt layers=%d hidden=%d heads=%d head_dim=%d vocab=%d dtype=%s layout=token-major-kv-v1",
             mc->num_hidden_layers, mc->hidden_size, mc->num_attention_heads, mc->head_dim, mc->vocab_size,
             pd_dtype_name(be->dtype));
    unsigned seed = (unsigned)getpid() ^ (unsigned)(pd_now() * 1e6);
    snprintf(c->id_prefix, sizeof c->id_prefix, "xfer-%08x%04x", (unsigned)rand_r(&seed), (unsigned)getpid() & 0xffff);
    p2p_config pc = {
        .kv_ip = c->cfg.kv_ip,
        .kv_port = c->cfg.kv_port,
        .kv_buffer_size = c->cfg.kv_buffer_size,
        .send_type = (p2p_send_type)c->cfg.send_type,
        .transport = c->cfg.transport == KV_TRANSPORT_NCCL ? P2P_NCCL : P2P_TCP,
        .timeout_s = c->cfg.timeout_s,
        .nccl_num_channels = c->cfg.nccl_num_channels,
        .nccl_device = be->device >= 0 ? be->device : 0, /* the GPU the KV cache lives on */
        .tcp_streams = c->cfg.tcp_streams,
        .fingerprint = c->fingerprint,
        .backend = be,
        .host_alloc = pool_get,
        .host_free = pool_put,
        .host_ctx = &c->pool,
        .recv_alloc = c->recv_into_pool ? pool_get_received : NULL,
        .on_arrival = on_kv_arrival,
        .arrival_ctx = ctx,
    };
    if (p2p_create(&pc, &c->p2p, err) != 0) {
        pd_wrap(err, "kv connector");
        kv_connector_destroy(c);
        return -1;
    }
    const char *transport = cfg->transport == KV_TRANSPORT_NCCL ? "nccl" : "tcp";
    char streams[48] = "";
    if (cfg->tcp_streams > 1 && cfg->transport == KV_TRANSPORT_TCP)
        snprintf(streams, sizeof streams, " over %d connections a peer", cfg->tcp_streams);
    pd_log(PD_LOG_INFO,
           "kv connector: %s on %s (send_type %s, transport %s%s, kv_buffer_size %.3g bytes, "
           "timeout %.0f s%s)",
           kv_role_name(cfg->role), p2p_address(c->p2p), kv_send_type_name(cfg->send_type),
           transport, streams, cfg->kv_buffer_size, cfg->timeout_s,
           c->recv_into_pool ? ", receiving into page-locked memory" : "");
    if (cfg->tcp_streams > 1 && cfg->transport != KV_TRANSPORT_TCP)
        pd_log(PD_LOG_WARN, "kv connector: tcp_streams is ignored with transport nccl");
    if (cfg->recv_into_pinned && !c->recv_into_pool) {
        if (cfg->role == KV_ROLE_PRODUCER || cfg->transport != KV_TRANSPORT_TCP)
            pd_log(PD_LOG_WARN,
                   "kv connector: recv_into_pinned is ignored on a %s with transport %s (it is for "
                   "a consumer's KV arriving over tcp)",
                   kv_role_name(cfg->role), transport);
        else
            pd_log(PD_LOG_WARN,
                   "kv connector: recv_into_pinned is ignored: this backend has no page-locked "
                   "memory (received KV stays where ZMQ put it)");
    }
    *out = c;
    return 0;
}

void kv_connector_destroy(kv_connector *c) {
    if (!c) return;
    p2p_destroy(c->p2p); /* first: it gives back every send buffer */
    pool_destroy(&c->pool);
    if (c->slots_buf.p) c->be->free(c->be, c->slots_buf.p);
    if (c->rows_buf.p) c->be->free(c->be, c->rows_buf.p);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

const kv_transfer_config *kv_connector_config(const kv_connector *c) { return &c->cfg; }
const char *kv_connector_address(const kv_connector *c) { return p2p_address(c->p2p); }
bool kv_connector_is_producer(const kv_connector *c) { return c->cfg.role != KV_ROLE_CONSUMER; }
bool kv_connector_is_consumer(const kv_connector *c) { return c->cfg.role != KV_ROLE_PRODUCER; }

void kv_connector_stats_get(kv_connector *c, kv_connector_stats *out) {
    pthread_mutex_lock(&c->mu);
    *out = c->stats;
    pthread_mutex_unlock(&c->mu);
    p2p_stats ps;
    p2p_stats_get(c->p2p, &ps);
    out->sends_ok = ps.sends_ok;
    out->sends_failed = ps.sends_failed;
    out->recvs_ok = ps.recvs_ok;
    out->recvs_failed = ps.recvs_failed;
    out->retries = ps.retries;
    out->aborts = ps.aborts;
    out->bytes_sent = ps.bytes_sent;
    out->bytes_received = ps.bytes_received;
    out->buffered_bytes = ps.buffered_bytes + ps.offered_bytes;
    out->connections = ps.connections;
    out->comm_resets = ps.comm_resets;
    pthread_mutex_lock(&c->pool.mu);
    out->host_pool_pinned_bytes = c->pool.pinned_bytes;
    out->host_pool_pageable_bytes = c->pool.pageable_bytes;
    pthread_mutex_unlock(&c->pool.mu);
}

static void stats_add(kv_connector *c, bool save, bool ok, double seconds) {
    pthread_mutex_lock(&c->mu);
    if (save) {
        if (ok) c->stats.saves_ok++, c->stats.save_seconds += seconds;
        else c->stats.saves_failed++;
    } else {
        if (ok) c->stats.loads_ok++, c->stats.load_seconds += seconds;
        else c->stats.loads_failed++;
    }
    pthread_mutex_unlock(&c->mu);
}

/* s's memory with room for need bytes. Every user waits for the backend's
 * stream before returning, so what was there is no longer read. */
static void *scratch_reserve(kv_connector *c, dev_scratch *s, size_t need, pd_err *err) {
    if (need == 0) need = 1;
    if (s->cap >= need) return s->p;
    if (s->p) c->be->free(c->be, s->p);
    s->cap = 0;
    if (!(s->p = c->be->alloc(c->be, need, err))) return NULL;
    s->cap = need;
    return s->p;
}

/* The cache slot of each of the first n tokens, in the connector's scratch. */
static int32_t *slots_upload(kv_connector *c, const int32_t *table, int n, pd_err *err) {
    int32_t *host = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    if (!host) return pd_fail(err, "out of memory"), NULL;
    for (int t = 0; t < n; t++) host[t] = table[t / c->block_size] * c->block_size + t % c->block_size;
    int32_t *dev = scratch_reserve(c, &c->slots_buf, sizeof(int32_t) * (size_t)n, err);
    if (dev && c->be->copy_h2d(c->be, dev, host, sizeof(int32_t) * (size_t)n, err) != 0) dev = NULL;
    free(host);
    return dev;
}

static void tensor_id(char *out, size_t cap, const char *transfer_id, int layer) {
    snprintf(out, cap, "%s#%d", transfer_id, layer);
}

/* One layer's K and V rows as one contiguous tensor, ready for the transfer
 * engine. Over nccl the rows are gathered straight into a device buffer of
 * the engine's, sent in place GPU to GPU after the gathers queued on the
 * backend's stream (the engine records an event there when it is handed the
 * buffer). Over tcp they are gathered into the device scratch `dev` and
 * copied down into a host buffer (the copy waits for the gathers). The
 * buffer is the caller's until handed to p2p. */
static void *stage_layer(kv_connector *c, int layer, const int32_t *slots, int n_tokens, void *dev,
                         size_t nbytes, pd_err *err) {
    const bool in_place = c->cfg.transport == KV_TRANSPORT_NCCL;
    const size_t row = (size_t)c->kv_dim * c->be->elem_size;
    void *dst = in_place ? p2p_buffer_alloc(c->p2p, nbytes, err) : dev;
    if (!dst) return NULL;
    void *k, *v;
    opt_kv_layer(c->kv, layer, &k, &v);
    c->be->gather_rows(c->be, dst, k, slots, n_tokens, c->kv_dim);
    c->be->gather_rows(c->be, (char *)dst + (size_t)n_tokens * row, v, slots, n_tokens, c->kv_dim);
    if (in_place) return dst;
    void *host = p2p_buffer_alloc(c->p2p, nbytes, err);
    if (host && c->be->copy_d2h(c->be, host, dev, nbytes, err) != 0) {
        p2p_buffer_free(c->p2p, host);
        host = NULL;
    }
    return host;
}

/* Hand one staged layer to the transfer engine the configured way. The
 * buffer is gone after this call, whatever it returns. */
static int send_layer(kv_connector *c, const kv_request_params *params, const char *transfer_id,
                      int layer, const int64_t *shape, void *buf, size_t nbytes, double deadline,
                      pd_err *err) {
    char id[160];
    tensor_id(id, sizeof id, transfer_id, layer);
    const char *dtype = pd_dtype_name(c->be->dtype);
    int rc = 0;
    switch (c->cfg.send_type) {
    case KV_SEND_PUT: /* p2p_put only reads buf during the call */
        rc = p2p_put(c->p2p, params->remote_kv_addr, id, dtype, 4, shape, buf, nbytes, deadline,
                     err);
        p2p_buffer_free(c->p2p, buf);
        return rc;
    case KV_SEND_PUT_ASYNC: /* the send thread owns buf from here */
        rc = p2p_put_async(c->p2p, params->remote_kv_addr, id, dtype, 4, shape, buf, nbytes,
                           deadline, err);
        break;
    case KV_SEND_GET: /* kept until the consumer pulls it (or the deadline) */
        rc = p2p_offer(c->p2p, id, dtype, 4, shape, buf, nbytes, deadline, err);
        break;
    }
    /* Outcomes of background sends are counted by the transfer engine
     * (kv_sends_total); nobody asks for them by id, so drop the record. */
    if (rc == 0) p2p_forget_send(c->p2p, id);
    return rc;
}

int kv_connector_save(kv_connector *c, const kv_request_params *params, const int32_t *block_table, int n_tokens,
                      const char *request_tag, kv_save_result *out, pd_err *err) {
    double t0 = pd_now();
    memset(out, 0, sizeof *out);
    snprintf(out->kv_addr, sizeof out->kv_addr, "%s", p2p_address(c->p2p));
    snprintf(out->transfer_id, sizeof out->transfer_id, "%s-%llu", c->id_prefix, (unsigned long long)++c->counter);
    out->num_tokens = n_tokens;
    const opt_config *mc = opt_model_config(c->model);
    const size_t row = (size_t)c->kv_dim * c->be->elem_size;
    const size_t nbytes = 2 * (size_t)n_tokens * row;
    const int64_t shape[4] = {2, n_tokens, mc->num_attention_heads, mc->head_dim};
    const bool in_place = c->cfg.transport == KV_TRANSPORT_NCCL;
    double deadline = t0 + c->cfg.timeout_s;
    int32_t *slots = slots_upload(c, block_table, n_tokens, err);
    /* tcp: one device scratch the layers are gathered into in turn, then
     * copied down, so at most one layer's copy is in flight here. nccl:
     * each layer gathered into its own send buffer; the transfer engine
     * orders its send after the gathers on the GPU (an event on the
     * backend's queue), so nothing here waits for the device. */
    void *dev = slots && !in_place ? scratch_reserve(c, &c->rows_buf, nbytes, err) : NULL;
    int rc = slots && (in_place || dev) ? 0 : -1;
    /* The decode side computes the last prompt token itself and takes the
     * KV of the ones before: a 1-token prompt has none to take (it drops
     * the transfer at once), so nothing is sent. Over nccl a drop that met
     * bytes already on their way would cost the pair's communicator. */
    const int send_layers = n_tokens >= 2 ? c->layers : 0;
    for (int l = 0; l < send_layers && rc == 0; l++) {
        void *buf = stage_layer(c, l, slots, n_tokens, dev, nbytes, err);
        rc = buf ? send_layer(c, params, out->transfer_id, l, shape, buf, nbytes, deadline, err)
                 : -1;
    }
    double dt = pd_now() - t0;
    stats_add(c, true, rc == 0, dt);
    if (rc != 0) return pd_wrap(err, "sending KV of %s to %s", request_tag, params->remote_kv_addr);
    pd_log(PD_LOG_DEBUG,
           "kv save %s: %d tokens x %d layers = %zu bytes as %s to %s (%s over %s) in %.2f ms",
           request_tag, n_tokens, send_layers, nbytes * (size_t)send_layers, out->transfer_id,
           params->remote_kv_addr, kv_send_type_name(c->cfg.send_type), in_place ? "nccl" : "tcp",
           dt * 1e3);
    return 0;
}

int kv_connector_load_begin(kv_connector *c, const kv_request_params *params, int n_prompt, const char *request_tag,
                            kv_load **out, pd_err *err) {
    *out = NULL;
    kv_load *l = calloc(1, sizeof *l);
    if (l) l->layer = calloc((size_t)c->layers, sizeof *l->layer);
    if (!l || !l->layer) {
        free(l);
        return pd_fail(err, "out of memory");
    }
    l->params = *params;
    l->n_prompt = n_prompt;
    /* recv_into_pinned: page-locked buffers for this prompt's layers, set
     * out here because the transfer engine's thread may not allocate them.
     * Layers that arrived before (PUT sends before the decode instance sees
     * the request) stayed in ZMQ's frames; the next request of this size
     * finds these. With requests in flight, some of the buffers are in use,
     * and the pool grows to what they hold at once (up to pinned_limit). */
    if (c->recv_into_pool)
        pool_prepare(&c->pool, 2 * (size_t)n_prompt * (size_t)c->kv_dim * c->be->elem_size,
                     c->layers);
    snprintf(l->tag, sizeof l->tag, "%s", request_tag ? request_tag : "");
    l->started = pd_now();
    l->deadline = l->started + c->cfg.timeout_s;
    if (c->cfg.send_type == KV_SEND_GET) {
        for (int i = 0; i < c->layers; i++) {
            char id[160];
            tensor_id(id, sizeof id, params->remote_request_id, i);
            if (p2p_fetch(c->p2p, params->remote_kv_addr, id, l->deadline, err) != 0) {
                kv_connector_load_end(c, l);
                return pd_wrap(err, "pulling KV %s from %s", params->remote_request_id, params->remote_kv_addr);
            }
        }
    }
    pd_log(PD_LOG_DEBUG, "kv load %s: waiting for %s from %s (%d prompt tokens, %s)", l->tag,
           params->remote_request_id, params->remote_kv_addr, n_prompt, kv_send_type_name(c->cfg.send_type));
    *out = l;
    return 0;
}

/* A received tensor in a page-locked buffer of the host pool: the backend
 * can queue its copy to the device (DMA) instead of copying it now. */
static bool pinned_payload(const p2p_tensor *t) {
    return t->from_host_alloc && ((const pool_header *)t->data - 1)->pinned;
}

/* Write every taken, not yet written layer's first n_tokens tokens into the
 * cache at block_table, then free those tensors (after the sync nothing
 * reads them). Returns how many layers it wrote, or -1. Host bytes (tcp) go
 * through one backend buffer, reused layer by layer: copy_h2d waits for the
 * stream, so the kv_write before it has read the buffer by then; a queued
 * copy from page-locked memory (recv_into_pinned) is ordered after it on the
 * same stream. Device bytes (nccl) are read where they arrived. */
static int write_layers(kv_connector *c, kv_load *l, const int32_t *block_table, int n_tokens,
                        pd_err *err) {
    size_t stage_bytes = 0;
    int todo = 0;
    for (int i = 0; i < c->layers; i++) {
        const kv_load_layer *ly = &l->layer[i];
        if (!ly->taken || ly->written) continue;
        todo++;
        if (!ly->tensor->on_device && ly->nbytes > stage_bytes) stage_bytes = ly->nbytes;
    }
    if (todo == 0 || n_tokens <= 0) return 0;
    const size_t row = (size_t)c->kv_dim * c->be->elem_size;
    int32_t *slots = slots_upload(c, block_table, n_tokens, err);
    if (!slots) return -1;
    pd_step_meta meta;
    memset(&meta, 0, sizeof meta);
    meta.n_tokens = n_tokens;
    meta.slot_mapping = slots;
    void *stage = stage_bytes ? scratch_reserve(c, &c->rows_buf, stage_bytes, err) : NULL;
    int rc = stage_bytes && !stage ? -1 : 0, wrote = 0, queued = 0;
    for (int i = 0; i < c->layers && rc == 0; i++) {
        kv_load_layer *ly = &l->layer[i];
        if (!ly->taken || ly->written) continue;
        void *src = ly->tensor->data;
        if (!ly->tensor->on_device) {
            const bool dma = c->be->copy_h2d_async && pinned_payload(ly->tensor);
            rc = dma ? c->be->copy_h2d_async(c->be, stage, src, ly->nbytes, err)
                     : c->be->copy_h2d(c->be, stage, src, ly->nbytes, err);
            if (rc != 0) break;
            queued += dma;
            src = stage;
        }
        void *k, *v;
        opt_kv_layer(c->kv, i, &k, &v);
        c->be->kv_write(c->be, k, v, src, (char *)src + (size_t)ly->n_sent * row, c->kv_dim, &meta,
                        c->kv_dim);
        ly->written = true;
        l->bytes += ly->nbytes;
        wrote++;
    }
    pthread_mutex_lock(&c->mu);
    c->stats.layers_written += (uint64_t)wrote;
    c->stats.layers_written_from_pinned += (uint64_t)queued;
    if (!l->applying) c->stats.layers_written_on_arrival += (uint64_t)wrote;
    pthread_mutex_unlock(&c->mu);
    pd_err sync_err = {{0}};
    if (c->be->sync(c->be, &sync_err) != 0 && rc == 0) { /* the first error is the one to report */
        rc = -1;
        if (err) *err = sync_err;
    }
    for (int i = 0; i < c->layers; i++) {
        kv_load_layer *ly = &l->layer[i];
        if (ly->written && ly->tensor) {
            p2p_tensor_free(c->p2p, ly->tensor);
            ly->tensor = NULL;
        }
    }
    return rc == 0 ? wrote : -1;
}

int kv_connector_load_poll(kv_connector *c, kv_load *l, const int32_t *block_table,
                           int *http_status, pd_err *err) {
    const opt_config *mc = opt_model_config(c->model);
    *http_status = 500;
    for (int i = 0; i < c->layers; i++) {
        kv_load_layer *ly = &l->layer[i];
        if (ly->taken) continue;
        char id[160];
        tensor_id(id, sizeof id, l->params.remote_request_id, i);
        int got = p2p_take(c->p2p, id, &ly->tensor, err);
        if (got < 0) {
            stats_add(c, false, false, 0);
            return pd_wrap(err, "KV %s from %s", l->params.remote_request_id, l->params.remote_kv_addr);
        }
        if (got == 0) continue;
        ly->taken = true; /* load_end frees it, whatever happens next */
        const p2p_tensor *t = ly->tensor;
        bool shape_ok = t->ndim == 4 && t->shape[0] == 2 && t->shape[2] == mc->num_attention_heads &&
                        t->shape[3] == mc->head_dim && !strcmp(t->dtype, pd_dtype_name(c->be->dtype)) &&
                        t->nbytes == (size_t)t->shape[1] * 2 * c->kv_dim * c->be->elem_size;
        if (!shape_ok) {
            stats_add(c, false, false, 0);
            return pd_fail(err, "KV %s from %s has shape/dtype that does not fit this model", id,
                           l->params.remote_kv_addr);
        }
        if (t->shape[1] < l->n_prompt - 1) {
            stats_add(c, false, false, 0);
            return pd_fail(err, "KV %s from %s covers %lld tokens, but this prompt has %d (was it tokenized the same way?)",
                           id, l->params.remote_kv_addr, (long long)t->shape[1], l->n_prompt);
        }
        ly->nbytes = t->nbytes;
        ly->n_sent = t->shape[1];
        l->n_taken++;
    }
    if (block_table) { /* the request has its blocks: write what arrived now */
        int wrote = write_layers(c, l, block_table, l->n_prompt - 1, err);
        if (wrote < 0) {
            stats_add(c, false, false, 0);
            return pd_wrap(err, "writing received KV %s into the cache",
                           l->params.remote_request_id);
        }
        l->n_early += wrote;
    }
    if (l->n_taken == c->layers) return 1;
    if (pd_now() > l->deadline) {
        *http_status = 504;
        stats_add(c, false, false, 0);
        return pd_fail(err, "timed out after %.0f s waiting for KV %s from %s (%d of %d layers arrived)", c->cfg.timeout_s,
                       l->params.remote_request_id, l->params.remote_kv_addr, l->n_taken, c->layers);
    }
    return 0;
}

bool kv_connector_load_wrote_any(const kv_load *l) {
    return l->n_early > 0;
}

int kv_connector_load_apply(kv_connector *c, kv_load *l, const int32_t *block_table, int n_tokens, pd_err *err) {
    double t0 = pd_now();
    if (n_tokens <= 0) {
        l->applied = true;
        return 0;
    }
    if (l->n_early > 0 && n_tokens != l->n_prompt - 1)
        return pd_fail(err, "KV %s: %d tokens to write, but %d were written as they arrived",
                       l->params.remote_request_id, n_tokens, l->n_prompt - 1);
    l->applying = true;
    if (write_layers(c, l, block_table, n_tokens, err) < 0)
        return pd_wrap(err, "writing received KV into the cache");
    l->applied = true;
    double now = pd_now();
    stats_add(c, false, true, now - l->started);
    pd_log(PD_LOG_DEBUG,
           "kv load %s: %s from %s: %zu bytes, %d tokens written into the cache (waited %.2f ms, "
           "wrote in %.2f ms; "
           "%d of %d layers written as they arrived)",
           l->tag, l->params.remote_request_id, l->params.remote_kv_addr, l->bytes, n_tokens,
           (t0 - l->started) * 1e3, (now - t0) * 1e3, l->n_early, c->layers);
    return 0;
}

void kv_connector_load_end(kv_connector *c, kv_load *l) {
    if (!l) return;
    for (int i = 0; i < c->layers; i++) {
        kv_load_layer *ly = &l->layer[i];
        if (ly->taken) {
            p2p_tensor_free(c->p2p, ly->tensor); /* NULL once written */
        } else if (!l->applied) {
            /* Tell the producer to drop what it still holds for this layer. */
            char id[160];
            tensor_id(id, sizeof id, l->params.remote_request_id, i);
            p2p_drop(c->p2p, l->params.remote_kv_addr, id);
        }
    }
    free(l->layer);
    free(l);
}
