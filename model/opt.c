/* opt: the OPT decoder forward pass (see opt.h), written once against the
 * backend ops table. Names follow Hugging Face's modeling_opt.py:
 * embed_tokens, project_in, embed_positions, self_attn_layer_norm (ln_attn
 * here), q/k/v/out_proj, final_layer_norm of a layer (ln_ffn here), fc1,
 * fc2, the decoder's final_layer_norm, project_out, lm_head. */
#include "model/opt.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Device pointers of one decoder layer. qkv_w is q_proj, k_proj and v_proj
 * stacked into one [3h, h] matrix, so one GEMM produces q | k | v per token. */
typedef struct opt_layer_dev {
    void *qkv_w, *qkv_b, *o_w, *o_b;
    void *ln_attn_w, *ln_attn_b;
    void *fc1_w, *fc1_b, *fc2_w, *fc2_b;
    void *ln_ffn_w, *ln_ffn_b;
} opt_layer_dev;

/* Activation scratch for one step, in backend memory; grown on demand. */
typedef struct opt_scratch {
    int cap_tokens, cap_logits, cap_meta;
    void *x;            /* [T, h] residual stream */
    void *a;            /* [T, h] layer-norm output / sub-block output */
    void *qkv;          /* [T, 3h] */
    void *attn;         /* [T, h] attention output before out_proj */
    void *ffn;          /* [T, f] */
    void *emb;          /* [T, w] token embeddings before project_in */
    void *last;         /* [n_logits, max(h, w)] rows that want logits */
    void *last_w;       /* [n_logits, w] after project_out */
    void *logits;       /* [n_logits, V] */
    int32_t *ids[2];    /* [n_logits] greedy picks or draws (device, or host
                         * memory the backend writes where ids_mapped); two,
                         * so that a queued step (opt_forward_queue) writes
                         * one while the host reads the other */
    bool ids_mapped;    /* ids is host_alloc memory (pd_backend.host_mapped) */
    int32_t *ids_dev[2]; /* [cap_logits] device: where ids_mapped, the same
                          * picks again, written by the op that makes them
                          * (pd_linear_fuse.argmax_copy; a copy after the
                          * sample op), so that a chained decode step's
                          * embedding reads them from device memory: a read
                          * of mapped memory crosses PCIe, and a copy node
                          * at the start of the step costs its edge */
    float *sample_dev;  /* [n_logits, 5] sampling parameters (device) */
    void *meta_dev;     /* int32 [cap_meta] */
    int32_t *meta_host; /* host staging for the same (host_alloc) */
    int32_t *ids_host;  /* [cap_logits] host staging of ids (host_alloc) */
} opt_scratch;

/* Decode steps as CUDA graphs: one recording per padded batch size. A
 * recording holds raw pointers (scratch, KV arrays, the metadata buffer), so
 * every graph is dropped when any of them moves. */
#define OPT_GRAPH_SIZES 67 /* 1, 2, 4, then every multiple of 8 up to 512 */
typedef struct opt_graphs {
    bool enabled;
    int max_batch;                    /* largest batch replayed (<= 512) */
    const opt_kv_storage *kv;         /* the storage the recordings write into */
    int max_blocks;                   /* block-table row length in the recordings */
    void *meta_dev;                   /* fixed metadata buffer the recordings read */
    int32_t *meta_host[2];            /* its host staging (host_alloc), by picks buffer */
    size_t meta_cap;                  /* int32 entries of each */
    /* Recordings by size index and variant (NULL: not yet): variant = 2 *
     * picks buffer + whether the tokens are the other buffer's picks (a
     * chained step of opt_forward_queue); plain steps use variant 0. */
    void *exec[OPT_GRAPH_SIZES][4];
    int last_variant[OPT_GRAPH_SIZES]; /* the variant replayed last (opt_model_time_graph) */
    int replays, captures;             /* for logs and tests */
} opt_graphs;

/* Steps queued by opt_forward_queue and not yet handed out by
 * opt_forward_wait, oldest first. Each writes its picks into its own
 * buffer s.ids[buf]; done: already waited for, its picks in picks[buf]. */
typedef struct opt_pending {
    int n_rows, buf;
    bool done;
} opt_pending;
typedef struct opt_ahead {
    opt_pending q[2];
    int head, n;
    int next_buf;       /* the picks buffer the next queued step writes */
    int dev_rows;       /* rows of the newest step's picks in s.ids[next_buf ^ 1]; -1: not there */
    int last_rows;      /* rows of last_picks (the step handed out last); -1: none */
    int cap;            /* rows of picks, last_picks, steps and tokens */
    int32_t *picks[2];  /* host copies by buffer */
    int32_t *last_picks;
    uint64_t chained_on_device, chained_on_host; /* opt_model_chain_stats */
    opt_seq_step *steps; /* a chained step with its tokens filled in */
    int32_t *tokens;
    float *params_host[2]; /* sampling parameters by buffer (host_alloc), cap * 5 */
    void *event[2];        /* recorded after each buffer's step */
} opt_ahead;

struct opt_model {
    opt_config cfg;
    pd_backend *be;
    bool has_final_ln, has_proj;
    void *weights; /* the one allocation every weight pointer points into */
    size_t weight_bytes;
    void *embed_tokens, *embed_positions, *project_in, *project_out;
    void *final_ln_w, *final_ln_b, *lm_head;
    opt_layer_dev *layers;
    opt_scratch s;
    opt_graphs g;
    opt_ahead ahead;
};

static void graphs_drop(opt_model *m);
static void ahead_free(opt_model *m);
static void graphs_free(opt_model *m);

struct opt_kv_storage {
    opt_model *m;
    int num_blocks, block_size;
    void *mem;     /* one allocation: K then V of every layer */
    void **k, **v; /* per layer, [num_blocks * block_size, h] */
};

/* ---- weight upload ---- */

/* Lays weights out in one allocation. The same code runs twice: a sizing
 * pass (base == NULL: only offsets advance) and an upload pass. */
typedef struct weight_placer {
    pd_backend *be;
    char *base;
    size_t off;
    int failed;
    pd_err *err;
} weight_placer;

#define WEIGHT_ALIGN 64

/* Reserve n elements; returns the device pointer (NULL in the sizing pass). */
static void *place_reserve(weight_placer *p, size_t n) {
    void *at = p->base ? p->base + p->off : NULL;
    p->off += (n * p->be->elem_size + WEIGHT_ALIGN - 1) / WEIGHT_ALIGN * WEIGHT_ALIGN;
    return at;
}

static void place_upload(weight_placer *p, void *dst, const pd_view *v) {
    if (!p->base || !v->data || p->failed) return;
    if (p->be->upload_view(p->be, dst, v, p->err) != 0) p->failed = 1;
}

/* Reserve and upload one tensor; absent tensors get NULL. */
static void *place_view(weight_placer *p, const pd_view *v) {
    if (!v->data) return NULL;
    void *dst = place_reserve(p, (size_t)(v->rows * v->cols));
    place_upload(p, dst, v);
    return dst;
}

/* A layer norm's weight and bias: both or neither. A missing bias next to a
 * present weight stays zero (the allocation is zeroed). */
static void place_ln(weight_placer *p, const pd_view *w, const pd_view *b, int h, void **dw,
                     void **db) {
    *dw = *db = NULL;
    if (!w->data) return;
    *dw = place_reserve(p, (size_t)h);
    *db = place_reserve(p, (size_t)h);
    place_upload(p, *dw, w);
    place_upload(p, *db, b);
}

static void place_layer(weight_placer *p, const opt_config *c, const opt_layer_weights *lw,
                        opt_layer_dev *d) {
    const size_t h = (size_t)c->hidden_size, es = p->be->elem_size;
    d->qkv_w = place_reserve(p, 3 * h * h);
    if (p->base) {
        place_upload(p, d->qkv_w, &lw->q_w);
        place_upload(p, (char *)d->qkv_w + h * h * es, &lw->k_w);
        place_upload(p, (char *)d->qkv_w + 2 * h * h * es, &lw->v_w);
    }
    d->qkv_b = NULL;
    if (lw->q_b.data || lw->k_b.data || lw->v_b.data) {
        d->qkv_b = place_reserve(p, 3 * h);
        if (p->base) {
            place_upload(p, d->qkv_b, &lw->q_b);
            place_upload(p, (char *)d->qkv_b + h * es, &lw->k_b);
            place_upload(p, (char *)d->qkv_b + 2 * h * es, &lw->v_b);
        }
    }
    d->o_w = place_view(p, &lw->o_w);
    d->o_b = place_view(p, &lw->o_b);
    place_ln(p, &lw->attn_ln_w, &lw->attn_ln_b, c->hidden_size, &d->ln_attn_w, &d->ln_attn_b);
    d->fc1_w = place_view(p, &lw->fc1_w);
    d->fc1_b = place_view(p, &lw->fc1_b);
    d->fc2_w = place_view(p, &lw->fc2_w);
    d->fc2_b = place_view(p, &lw->fc2_b);
    place_ln(p, &lw->ffn_ln_w, &lw->ffn_ln_b, c->hidden_size, &d->ln_ffn_w, &d->ln_ffn_b);
}

static void place_all(weight_placer *p, opt_model *m, const opt_weights *w) {
    const opt_config *c = &m->cfg;
    m->embed_tokens = place_view(p, &w->embed_tokens);
    m->embed_positions = place_view(p, &w->embed_positions);
    m->project_in = m->has_proj ? place_view(p, &w->project_in) : NULL;
    m->project_out = m->has_proj ? place_view(p, &w->project_out) : NULL;
    place_ln(p, &w->final_ln_w, &w->final_ln_b, c->hidden_size, &m->final_ln_w, &m->final_ln_b);
    if (!m->has_final_ln) m->final_ln_w = m->final_ln_b = NULL;
    /* Tied (the usual case): share the embedding instead of a second copy. */
    if (w->lm_head.data == w->embed_tokens.data && w->lm_head.dtype == w->embed_tokens.dtype)
        m->lm_head = m->embed_tokens;
    else
        m->lm_head = place_view(p, &w->lm_head);
    for (int l = 0; l < c->num_hidden_layers; l++)
        place_layer(p, c, &w->layers[l], &m->layers[l]);
}

/* ---- shape checks (the binder checks too; this guards hand-built views) ---- */

static int check_view(const pd_view *v, const char *name, int layer, int64_t rows, int64_t cols,
                      bool required, pd_err *err) {
    char full[64];
    if (layer >= 0)
        snprintf(full, sizeof full, "layers.%d.%s", layer, name);
    else
        snprintf(full, sizeof full, "%s", name);
    if (!v->data) return required ? pd_fail(err, "opt model: tensor %s is missing", full) : 0;
    const bool same = v->rows == rows && v->cols == cols;
    const bool vec = rows == 1 && v->rows * v->cols == cols; /* a vector, any 2-d spelling */
    if (!same && !vec)
        return pd_fail(err, "opt model: tensor %s has shape [%lld,%lld], expected [%lld,%lld]",
                       full, (long long)v->rows, (long long)v->cols, (long long)rows,
                       (long long)cols);
    if (v->dtype != PD_F32 && v->dtype != PD_F16 && v->dtype != PD_BF16)
        return pd_fail(err, "opt model: tensor %s has unsupported dtype %d", full, (int)v->dtype);
    return 0;
}

static int check_weights(const opt_model *m, const opt_weights *w, pd_err *err) {
    const opt_config *c = &m->cfg;
    const int64_t V = c->vocab_size, h = c->hidden_size, f = c->ffn_dim;
    const int64_t wd = c->word_embed_proj_dim, P = c->max_position_embeddings + 2;
    const bool bias = c->enable_bias, aff = c->layer_norm_elementwise_affine;
    if (w->num_layers != c->num_hidden_layers)
        return pd_fail(err, "opt model: weights have %d layers, config has %d", w->num_layers,
                       c->num_hidden_layers);
    if (check_view(&w->embed_tokens, "embed_tokens", -1, V, wd, true, err) ||
        check_view(&w->embed_positions, "embed_positions", -1, P, h, true, err) ||
        check_view(&w->lm_head, "lm_head", -1, V, wd, true, err) ||
        check_view(&w->project_in, "project_in", -1, h, wd, m->has_proj, err) ||
        check_view(&w->project_out, "project_out", -1, wd, h, m->has_proj, err) ||
        check_view(&w->final_ln_w, "final_layer_norm.weight", -1, 1, h, m->has_final_ln && aff,
                   err) ||
        check_view(&w->final_ln_b, "final_layer_norm.bias", -1, 1, h, false, err))
        return -1;
    for (int l = 0; l < w->num_layers; l++) {
        const opt_layer_weights *L = &w->layers[l];
        if (check_view(&L->q_w, "q_proj.weight", l, h, h, true, err) ||
            check_view(&L->k_w, "k_proj.weight", l, h, h, true, err) ||
            check_view(&L->v_w, "v_proj.weight", l, h, h, true, err) ||
            check_view(&L->o_w, "out_proj.weight", l, h, h, true, err) ||
            check_view(&L->q_b, "q_proj.bias", l, 1, h, bias, err) ||
            check_view(&L->k_b, "k_proj.bias", l, 1, h, bias, err) ||
            check_view(&L->v_b, "v_proj.bias", l, 1, h, bias, err) ||
            check_view(&L->o_b, "out_proj.bias", l, 1, h, bias, err) ||
            check_view(&L->fc1_w, "fc1.weight", l, f, h, true, err) ||
            check_view(&L->fc1_b, "fc1.bias", l, 1, f, bias, err) ||
            check_view(&L->fc2_w, "fc2.weight", l, h, f, true, err) ||
            check_view(&L->fc2_b, "fc2.bias", l, 1, h, bias, err) ||
            check_view(&L->attn_ln_w, "self_attn_layer_norm.weight", l, 1, h, aff, err) ||
            check_view(&L->attn_ln_b, "self_attn_layer_norm.bias", l, 1, h, false, err) ||
            check_view(&L->ffn_ln_w, "final_layer_norm.weight", l, 1, h, aff, err) ||
            check_view(&L->ffn_ln_b, "final_layer_norm.bias", l, 1, h, false, err))
            return -1;
    }
    return 0;
}

static int check_config(const opt_config *c, pd_err *err) {
    if (c->vocab_size <= 0 || c->hidden_size <= 0 || c->num_hidden_layers <= 0 || c->ffn_dim <= 0 ||
        c->num_attention_heads <= 0 || c->max_position_embeddings <= 0 ||
        c->word_embed_proj_dim <= 0)
        return pd_fail(err, "opt model: config has a non-positive size");
    if (c->hidden_size % c->num_attention_heads != 0)
        return pd_fail(err, "opt model: hidden_size %d is not divisible by num_attention_heads %d",
                       c->hidden_size, c->num_attention_heads);
    if (c->head_dim != c->hidden_size / c->num_attention_heads)
        return pd_fail(err, "opt model: head_dim %d != hidden_size / num_attention_heads",
                       c->head_dim);
    if (c->head_dim > 512)
        return pd_fail(err, "opt model: head_dim %d is larger than supported (512)", c->head_dim);
    return 0;
}

int opt_model_create(const opt_config *cfg, const opt_weights *w, pd_backend *be, opt_model **out,
                     pd_err *err) {
    *out = NULL;
    if (check_config(cfg, err) != 0) return -1;
    opt_model *m = calloc(1, sizeof *m);
    if (!m) return pd_fail(err, "opt model: out of memory");
    m->cfg = *cfg;
    m->be = be;
    /* The same two rules as HF: the final LN exists only for pre-LN models
     * that did not remove it; project_in/out exist when widths differ. */
    m->has_final_ln = cfg->do_layer_norm_before && !cfg->remove_final_layer_norm;
    m->has_proj = cfg->word_embed_proj_dim != cfg->hidden_size;
    m->layers = calloc((size_t)cfg->num_hidden_layers, sizeof *m->layers);
    if (!m->layers) {
        opt_model_free(m);
        return pd_fail(err, "opt model: out of memory");
    }
    if (check_weights(m, w, err) != 0) {
        opt_model_free(m);
        return -1;
    }
    weight_placer sizing = {.be = be, .err = err};
    place_all(&sizing, m, w);
    m->weight_bytes = sizing.off;
    m->weights = be->alloc(be, m->weight_bytes, err);
    if (!m->weights) {
        opt_model_free(m);
        return pd_wrap(err, "opt model: weights (%zu bytes)", sizing.off);
    }
    weight_placer up = {.be = be, .base = m->weights, .err = err};
    place_all(&up, m, w);
    if (up.failed || be->sync(be, err) != 0) {
        opt_model_free(m);
        return pd_wrap(err, "opt model: uploading weights");
    }
    *out = m;
    return 0;
}

/* Host staging buffers: page-locked where the backend has it. */
static void *host_alloc(pd_backend *be, size_t bytes) {
    pd_err ignored;
    return be->host_alloc ? be->host_alloc(be, bytes, &ignored) : malloc(bytes);
}
static void host_free(pd_backend *be, void *p) {
    if (be->host_alloc) {
        if (be->host_free) be->host_free(be, p);
    } else {
        free(p);
    }
}

/* The picks' buffer: in host memory where the backend's ops can write
 * there (the step then ends with its ids already on the host), else device
 * memory with ids_host to copy them through. */
static void ids_free(pd_backend *be, opt_scratch *s) {
    for (int b = 0; b < 2; b++) {
        if (s->ids_mapped)
            host_free(be, s->ids[b]);
        else
            be->free(be, s->ids[b]);
        s->ids[b] = NULL;
    }
    host_free(be, s->ids_host);
    s->ids_host = NULL;
    for (int b = 0; b < 2; b++) {
        be->free(be, s->ids_dev[b]);
        s->ids_dev[b] = NULL;
    }
    s->ids_mapped = false;
}
/* Both buffers start as valid ids (zeros): a chained step's embedding may
 * read rows of a buffer that no step wrote yet (its padding rows). */
static int ids_alloc(pd_backend *be, opt_scratch *s, int cap, pd_err *err) {
    const size_t bytes = (size_t)cap * sizeof(int32_t);
    if (be->host_mapped && be->host_alloc) {
        s->ids_mapped = true;
        for (int b = 0; b < 2; b++) {
            s->ids[b] = host_alloc(be, bytes);
            if (!s->ids[b]) return pd_fail(err, "opt forward: out of host memory for %d ids", cap);
            memset(s->ids[b], 0, bytes);
        }
        for (int b = 0; b < 2; b++)
            if (!(s->ids_dev[b] = be->alloc(be, bytes, err))) return -1;
        return 0;
    }
    for (int b = 0; b < 2; b++)
        if (!(s->ids[b] = be->alloc(be, bytes, err))) return -1;
    s->ids_host = host_alloc(be, bytes);
    if (s->ids_host) return 0;
    return pd_fail(err, "opt forward: out of host memory for %d ids", cap);
}

static void scratch_free(pd_backend *be, opt_scratch *s) {
    void **dev[] = {&s->x,    &s->a,      &s->qkv,    &s->attn,     &s->ffn,
                    &s->emb,  &s->last,   &s->last_w, &s->logits,   &s->meta_dev,
                    (void **)&s->sample_dev};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++) {
        be->free(be, *dev[i]);
        *dev[i] = NULL;
    }
    ids_free(be, s);
    host_free(be, s->meta_host);
    s->meta_host = NULL;
    s->cap_tokens = s->cap_logits = s->cap_meta = 0;
}

void opt_model_free(opt_model *m) {
    if (!m) return;
    ahead_free(m);
    graphs_free(m);
    scratch_free(m->be, &m->s);
    if (m->weights) m->be->free(m->be, m->weights);
    free(m->layers);
    free(m);
}

const opt_config *opt_model_config(const opt_model *m) {
    return &m->cfg;
}
size_t opt_model_weight_bytes(const opt_model *m) {
    return m->weight_bytes;
}

/* ---- KV storage ---- */

size_t opt_kv_block_bytes(const opt_model *m, int block_size) {
    return 2 * (size_t)m->cfg.num_hidden_layers * (size_t)block_size * (size_t)m->cfg.hidden_size *
           m->be->elem_size;
}

int opt_kv_storage_create(opt_model *m, int num_blocks, int block_size, opt_kv_storage **out,
                          pd_err *err) {
    *out = NULL;
    if (num_blocks <= 0 || block_size <= 0)
        return pd_fail(err, "kv storage: num_blocks (%d) and block_size (%d) must be positive",
                       num_blocks, block_size);
    const int L = m->cfg.num_hidden_layers;
    opt_kv_storage *kv = calloc(1, sizeof *kv);
    if (!kv) return pd_fail(err, "kv storage: out of memory");
    kv->m = m;
    kv->num_blocks = num_blocks;
    kv->block_size = block_size;
    kv->k = calloc((size_t)L, sizeof *kv->k);
    kv->v = calloc((size_t)L, sizeof *kv->v);
    const size_t per_array =
        (size_t)num_blocks * block_size * m->cfg.hidden_size * m->be->elem_size;
    if (kv->k && kv->v) kv->mem = m->be->alloc(m->be, 2 * (size_t)L * per_array, err);
    if (!kv->mem) {
        opt_kv_storage_free(kv);
        return pd_wrap(err, "kv storage: %d blocks of %d tokens", num_blocks, block_size);
    }
    for (int l = 0; l < L; l++) {
        kv->k[l] = (char *)kv->mem + (2 * (size_t)l) * per_array;
        kv->v[l] = (char *)kv->mem + (2 * (size_t)l + 1) * per_array;
    }
    *out = kv;
    return 0;
}

void opt_kv_storage_free(opt_kv_storage *kv) {
    if (!kv) return;
    if (kv->mem) kv->m->be->free(kv->m->be, kv->mem);
    free(kv->k);
    free(kv->v);
    free(kv);
}

int opt_kv_num_blocks(const opt_kv_storage *kv) {
    return kv->num_blocks;
}
int opt_kv_block_size(const opt_kv_storage *kv) {
    return kv->block_size;
}

void opt_kv_layer(const opt_kv_storage *kv, int layer, void **k, void **v) {
    *k = kv->k[layer];
    *v = kv->v[layer];
}

/* ---- the step ---- */

/* Grow the step buffers to hold T tokens, n_logits logit rows and n_meta
 * int32 metadata entries. */
static int scratch_reserve(opt_model *m, int T, int n_logits, int n_meta, pd_err *err) {
    opt_scratch *s = &m->s;
    if (T > s->cap_tokens || n_logits > s->cap_logits) graphs_drop(m); /* buffers move */
    pd_backend *be = m->be;
    const opt_config *c = &m->cfg;
    const size_t es = be->elem_size, h = (size_t)c->hidden_size;
    const size_t wd = (size_t)c->word_embed_proj_dim;
    if (T > s->cap_tokens) {
        int cap = T > 2 * s->cap_tokens ? T : 2 * s->cap_tokens;
        void **dev[] = {&s->x, &s->a, &s->qkv, &s->attn, &s->ffn, &s->emb};
        size_t width[] = {h, h, 3 * h, h, (size_t)c->ffn_dim, wd};
        for (int i = 0; i < 6; i++) {
            be->free(be, *dev[i]);
            *dev[i] = be->alloc(be, (size_t)cap * width[i] * es, err);
            if (!*dev[i]) {
                scratch_free(be, s);
                return pd_wrap(err, "opt forward: activations for %d tokens", cap);
            }
        }
        s->cap_tokens = cap;
    }
    if (n_logits > s->cap_logits) {
        int cap = n_logits > 2 * s->cap_logits ? n_logits : 2 * s->cap_logits;
        void **dev[] = {&s->last, &s->last_w, &s->logits, (void **)&s->sample_dev};
        size_t bytes[] = {(h > wd ? h : wd) * es, wd * es, (size_t)c->vocab_size * es,
                          5 * sizeof(float)};
        for (int i = 0; i < 4; i++) {
            be->free(be, *dev[i]);
            *dev[i] = be->alloc(be, (size_t)cap * bytes[i], err);
            if (!*dev[i]) {
                scratch_free(be, s);
                return pd_wrap(err, "opt forward: logits for %d rows", cap);
            }
        }
        ids_free(be, s);
        if (ids_alloc(be, s, cap, err) != 0) {
            scratch_free(be, s);
            return pd_wrap(err, "opt forward: ids for %d rows", cap);
        }
        s->cap_logits = cap;
    }
    if (n_meta > s->cap_meta) {
        int cap = n_meta > 2 * s->cap_meta ? n_meta : 2 * s->cap_meta;
        be->free(be, s->meta_dev);
        host_free(be, s->meta_host);
        s->meta_dev = be->alloc(be, (size_t)cap * sizeof(int32_t), err);
        s->meta_host = host_alloc(be, (size_t)cap * sizeof(int32_t));
        if (!s->meta_dev || !s->meta_host) {
            scratch_free(be, s);
            return pd_fail(err, "opt forward: out of memory for step metadata");
        }
        s->cap_meta = cap;
    }
    return 0;
}

static int validate_step(const opt_model *m, const opt_kv_storage *kv, const opt_seq_step *seqs,
                         int n_seqs, bool has_output, int *T_out, int *n_logits_out,
                         int *max_blocks_out, pd_err *err) {
    const opt_config *c = &m->cfg;
    const int bs = kv->block_size;
    long T = 0;
    int n_logits = 0, max_blocks = 1;
    if (kv->m != m) return pd_fail(err, "opt forward: KV storage belongs to another model");
    if (n_seqs < 0) return pd_fail(err, "opt forward: n_seqs %d is negative", n_seqs);
    for (int i = 0; i < n_seqs; i++) {
        const opt_seq_step *s = &seqs[i];
        if (s->n_tokens < 1 || !s->tokens)
            return pd_fail(err, "opt forward: sequence %d has no new tokens", i);
        if (s->start_pos < 0)
            return pd_fail(err, "opt forward: sequence %d has start_pos %d", i, s->start_pos);
        const long end = (long)s->start_pos + s->n_tokens;
        if (end > c->max_position_embeddings)
            return pd_fail(err,
                           "opt forward: sequence %d reaches position %ld, beyond "
                           "max_position_embeddings %d",
                           i, end - 1, c->max_position_embeddings);
        const int need = (int)((end + bs - 1) / bs);
        if (s->n_blocks < need || !s->block_table)
            return pd_fail(err,
                           "opt forward: sequence %d has %d blocks, %d needed for %ld tokens of "
                           "block size %d",
                           i, s->n_blocks, need, end, bs);
        for (int b = 0; b < need; b++)
            if (s->block_table[b] < 0 || s->block_table[b] >= kv->num_blocks)
                return pd_fail(err, "opt forward: sequence %d block_table[%d] = %d not in [0, %d)",
                               i, b, s->block_table[b], kv->num_blocks);
        for (int t = 0; t < s->n_tokens; t++)
            if (s->tokens[t] < 0 || s->tokens[t] >= c->vocab_size)
                return pd_fail(err, "opt forward: sequence %d token %d has id %d not in [0, %d)", i,
                               t, s->tokens[t], c->vocab_size);
        if (need > max_blocks) max_blocks = need;
        T += s->n_tokens;
        n_logits += s->want_logits ? 1 : 0;
    }
    if (T > (1L << 24)) return pd_fail(err, "opt forward: %ld tokens in one step is too many", T);
    if (n_logits > 0 && !has_output)
        return pd_fail(err, "opt forward: logits wanted but no buffer");
    *T_out = (int)T;
    *n_logits_out = n_logits;
    *max_blocks_out = max_blocks;
    return 0;
}

/* Upload step metadata without waiting where the backend can: the host
 * buffer is rewritten only by the next step, after this one's results were
 * read (which waits for everything queued, the copy included). */
static int copy_meta(pd_backend *be, void *dst, const void *src, size_t bytes, pd_err *err) {
    return be->copy_h2d_async ? be->copy_h2d_async(be, dst, src, bytes, err)
                              : be->copy_h2d(be, dst, src, bytes, err);
}

/* Whether two of the step's sequences share one block table (pd_step_meta
 * shared_tables): pointer identity, found with a small open-addressing set
 * so that a 512-sequence step costs 512 probes, not 130k comparisons. */
static int tables_shared(const opt_seq_step *seqs, int n_seqs) {
    enum { SET = 1024 };
    const int32_t *set[SET] = {0};
    if (n_seqs > SET / 2) { /* too many for the set: compare every pair */
        for (int i = 1; i < n_seqs; i++)
            for (int j = 0; j < i; j++)
                if (seqs[i].block_table == seqs[j].block_table) return 1;
        return 0;
    }
    for (int i = 0; i < n_seqs; i++) {
        const int32_t *t = seqs[i].block_table;
        size_t h = ((uintptr_t)t >> 4) * 0x9E3779B97F4A7C15ull >> 54; /* 10 bits */
        while (set[h] && set[h] != t) h = (h + 1) % SET;
        if (set[h] == t) return 1;
        set[h] = t;
    }
    return 0;
}

/* int32 entries of fill_meta's layout for T tokens, S sequences, block-table
 * rows of max_blocks and n_logits logit rows. */
static size_t meta_entries(int T, int S, int max_blocks, int n_logits) {
    return (size_t)4 * T + (size_t)S * max_blocks + 2 * (size_t)S + 1 + (size_t)n_logits;
}

/* The one writer of step metadata, into host buffer h (its device copy at
 * d): the n_seqs sequences, then padding up to n_pad sequences (n_pad >
 * n_seqs only for a graph recording's fixed batch: a padding sequence
 * decodes token 0 at position 0 of block 0, which it only reads, since
 * slot -1 keeps kv_write away, and its output is ignored). Block-table rows
 * are max_blocks wide. Points meta and *logit_rows into d and returns the
 * number of int32 entries written. Layout: token_ids, positions, token_seq,
 * slot_mapping [T each], block_tables [S * max_blocks], seq_lens [S],
 * seq_q_start [S + 1], logit_rows [n_logits] (S = n_pad). */
static size_t fill_meta(int32_t *h, const int32_t *d, const opt_kv_storage *kv,
                        const opt_seq_step *seqs, int n_seqs, int n_pad, int T, int n_logits,
                        int max_blocks, int shared_tables, pd_step_meta *meta,
                        const int32_t **logit_rows) {
    const int S = n_pad, bs = kv->block_size;
    int32_t *ids = h, *pos = h + T, *seq = h + 2 * T, *slot = h + 3 * T;
    int32_t *tables = h + 4 * T, *lens = tables + (size_t)S * max_blocks;
    int32_t *q_start = lens + S, *rows = q_start + S + 1;
    int t = 0, r = 0, max_q = 1;
    for (int i = 0; i < S; i++) {
        int32_t *row = tables + (size_t)i * max_blocks;
        q_start[i] = t;
        if (i >= n_seqs) { /* padding */
            ids[t] = 0, pos[t] = 0, seq[t] = i, slot[t] = -1;
            t++;
            row[0] = 0;
            for (int b = 1; b < max_blocks; b++) row[b] = -1;
            lens[i] = 1;
            rows[r++] = t - 1;
            continue;
        }
        const opt_seq_step *s = &seqs[i];
        if (s->n_tokens > max_q) max_q = s->n_tokens;
        for (int j = 0; j < s->n_tokens; j++, t++) {
            const int p = s->start_pos + j;
            ids[t] = s->tokens[j];
            pos[t] = p;
            seq[t] = i;
            slot[t] = s->block_table[p / bs] * bs + p % bs;
        }
        const int need = (s->start_pos + s->n_tokens + bs - 1) / bs;
        for (int b = 0; b < max_blocks; b++) row[b] = b < need ? s->block_table[b] : -1;
        lens[i] = s->start_pos + s->n_tokens;
        if (s->want_logits) rows[r++] = t - 1;
    }
    q_start[S] = t;
    meta->n_tokens = T;
    meta->n_seqs = S;
    meta->max_blocks = max_blocks;
    meta->token_ids = d;
    meta->positions = d + T;
    meta->token_seq = d + 2 * T;
    meta->slot_mapping = d + 3 * T;
    meta->block_tables = d + 4 * T;
    meta->seq_lens = meta->block_tables + (size_t)S * max_blocks;
    meta->seq_q_start = meta->seq_lens + S;
    meta->max_q_len = max_q;
    meta->shared_tables = shared_tables;
    *logit_rows = meta->seq_q_start + S + 1;
    return meta_entries(T, S, max_blocks, n_logits);
}

#define OPT_LN_EPS 1e-5f

/* y = act(LN(x) . W^T + bias), or y += that, with what f asks for (see
 * pd_linear_fuse in backend.h): one fused op where the backend has it,
 * otherwise the same steps one op at a time, which is what the CPU backend
 * runs (so its results are those of the separate ops, bit for bit). */
static void linear(pd_backend *be, void *y, const void *x, int x_stride, const void *w,
                   const void *bias, int T, int in, int out, const pd_linear_fuse *f) {
    if (be->linear) {
        be->linear(be, y, x, x_stride, w, bias, T, in, out, f);
        return;
    }
    const size_t es = be->elem_size;
    if (f->layer_norm) {
        if (x_stride == in)
            be->layer_norm(be, f->ln_out, x, f->ln_w, f->ln_b, T, in, f->ln_eps);
        else /* layer_norm takes dense rows */
            for (int t = 0; t < T; t++)
                be->layer_norm(be, (char *)f->ln_out + (size_t)t * in * es,
                               (const char *)x + (size_t)t * x_stride * es, f->ln_w, f->ln_b, 1, in,
                               f->ln_eps);
        x = f->ln_out;
        x_stride = in;
    }
    void *dst = f->accumulate ? f->acc_tmp : y;
    be->gemm(be, dst, x, x_stride, w, bias, T, in, out);
    if (f->activate) be->activation(be, dst, (size_t)T * out, f->act);
    if (f->accumulate) be->add(be, y, dst, (size_t)T * out);
}

/* self_attn with its residual connection: x += out_proj(attention(q, cache))
 * where q | k | v = qkv_proj(x), or qkv_proj(LN(x)) in a pre-LN model
 * (pre_ln: LN is the layer's self_attn_layer_norm, fused into that GEMM).
 * Also writes this step's k and v into the layer's cache. x is [T, h]. */
static void attention_block(opt_model *m, const opt_layer_dev *L, void *k_cache, void *v_cache,
                            int block_size, const pd_step_meta *meta, bool pre_ln, bool embed,
                            void *x) {
    pd_backend *be = m->be;
    const int T = meta->n_tokens, h = m->cfg.hidden_size;
    const int heads = m->cfg.num_attention_heads, hd = m->cfg.head_dim;
    char *qkv = m->s.qkv; /* per token: q | k | v */
    const size_t es = be->elem_size;
    const pd_linear_fuse qkv_proj = {.layer_norm = pre_ln,
                                     .ln_w = L->ln_attn_w,
                                     .ln_b = L->ln_attn_b,
                                     .ln_eps = OPT_LN_EPS,
                                     .ln_out = m->s.a,
                                     /* embed: x is made here (see forward_ops) */
                                     .emb_a = embed ? m->embed_tokens : NULL,
                                     .emb_b = m->embed_positions,
                                     .emb_ia = meta->token_ids,
                                     .emb_ib = meta->positions,
                                     .emb_b_offset = 2};
    linear(be, qkv, x, h, L->qkv_w, L->qkv_b, T, h, 3 * h, &qkv_proj);
    be->kv_write(be, k_cache, v_cache, qkv + h * es, qkv + 2 * h * es, 3 * h, meta, h);
    be->paged_attention(be, m->s.attn, qkv, 3 * h, k_cache, v_cache, meta, heads, hd, block_size,
                        1.0f / sqrtf((float)hd));
    const pd_linear_fuse residual = {.accumulate = 1, .acc_tmp = m->s.a};
    linear(be, x, m->s.attn, h, L->o_w, L->o_b, T, h, h, &residual);
}

/* The feed-forward block with its residual connection:
 * x += fc2(act(fc1(x))), or of LN(x) in a pre-LN model (pre_ln: LN is the
 * layer's final_layer_norm, fused into fc1). x is [T, h]. */
static void ffn_block(opt_model *m, const opt_layer_dev *L, int T, bool pre_ln, void *x) {
    pd_backend *be = m->be;
    const int h = m->cfg.hidden_size, f = m->cfg.ffn_dim;
    const pd_linear_fuse fc1 = {.layer_norm = pre_ln,
                                .ln_w = L->ln_ffn_w,
                                .ln_b = L->ln_ffn_b,
                                .ln_eps = OPT_LN_EPS,
                                .ln_out = m->s.a,
                                .activate = 1,
                                .act = m->cfg.activation};
    linear(be, m->s.ffn, x, h, L->fc1_w, L->fc1_b, T, h, f, &fc1);
    const pd_linear_fuse residual = {.accumulate = 1, .acc_tmp = m->s.a};
    linear(be, x, m->s.ffn, f, L->fc2_w, L->fc2_b, T, f, h, &residual);
}

/* Queue the whole step on the backend (no copies, no syncs: this same code
 * is what a graph capture records): embeddings, every layer, and for the
 * rows that want logits the final LN, project_out, lm_head and, where the
 * backend can, the greedy pick into picks buffer buf (s->ids[buf], and
 * s->ids_dev[buf] where there is one). */
static void forward_ops(opt_model *m, opt_kv_storage *kv, const pd_step_meta *meta, int n_logits,
                        const int32_t *logit_rows, int buf) {
    pd_backend *be = m->be;
    const opt_config *c = &m->cfg;
    const int h = c->hidden_size, wd = c->word_embed_proj_dim, T = meta->n_tokens;
    opt_scratch *s = &m->s;
    int32_t *picks = s->ids[buf];

    /* Embeddings: project_in applies to the token embedding only, before the
     * learned positions (whose table is offset by 2 rows) are added. */
    /* Where the backend fuses it, the first qkv projection makes x itself
     * (pd_linear_fuse.emb_a): one kernel less in a decode step. */
    const bool embed_in_qkv = be->linear && be->linear_embed && !m->has_proj;
    if (embed_in_qkv) {
        /* nothing here: layer 0's attention_block */
    } else if (m->has_proj) {
        be->embedding(be, s->emb, m->embed_tokens, meta->token_ids, 0, T, wd, 0);
        be->gemm(be, s->x, s->emb, wd, m->project_in, NULL, T, wd, h);
        be->embedding(be, s->x, m->embed_positions, meta->positions, 2, T, h, 1);
    } else if (be->embedding_sum) {
        be->embedding_sum(be, s->x, m->embed_tokens, meta->token_ids, m->embed_positions,
                          meta->positions, 2, T, h);
    } else {
        be->embedding(be, s->x, m->embed_tokens, meta->token_ids, 0, T, h, 0);
        be->embedding(be, s->x, m->embed_positions, meta->positions, 2, T, h, 1);
    }

    for (int l = 0; l < c->num_hidden_layers; l++) {
        const opt_layer_dev *L = &m->layers[l];
        void *kc = kv->k[l], *vc = kv->v[l];
        if (c->do_layer_norm_before) { /* pre-LN: x = x + f(LN(x)) */
            attention_block(m, L, kc, vc, kv->block_size, meta, true, embed_in_qkv && l == 0, s->x);
            ffn_block(m, L, T, true, s->x);
        } else { /* post-LN: x = LN(x + f(x)) */
            attention_block(m, L, kc, vc, kv->block_size, meta, false, embed_in_qkv && l == 0,
                            s->x);
            be->layer_norm(be, s->x, s->x, L->ln_attn_w, L->ln_attn_b, T, h, OPT_LN_EPS);
            ffn_block(m, L, T, false, s->x);
            be->layer_norm(be, s->x, s->x, L->ln_ffn_w, L->ln_ffn_b, T, h, OPT_LN_EPS);
        }
    }
    if (n_logits == 0) return;

    /* Everything after the last layer is per row, so only the rows that want
     * logits go through the final LN, project_out and lm_head. When every
     * token wants them (a decode step: then each sequence has one token and
     * the rows are 0..T-1, see fill_meta) x is read in place. */
    const void *last_in = s->x;
    if (n_logits != T) {
        be->gather_rows(be, s->last, s->x, logit_rows, n_logits, h);
        last_in = s->last;
    }
    /* The final LN is fused into the first projection that follows it; a
     * backend that runs it apart writes it to s->last (in place when the
     * rows were gathered there: they are only read again through the LN). */
    const pd_linear_fuse final_ln = {.layer_norm = m->has_final_ln,
                                     .ln_w = m->final_ln_w,
                                     .ln_b = m->final_ln_b,
                                     .ln_eps = OPT_LN_EPS,
                                     .ln_out = s->last};
    /* The greedy pick in the LM head's own kernel where the backend can. */
    const bool pick_in_head = be->argmax && be->linear && be->linear_argmax;
    pd_linear_fuse head = {0}; /* the LM head's fusions, and its input */
    const void *head_in = s->last_w;
    if (m->has_proj) {
        linear(be, s->last_w, last_in, h, m->project_out, NULL, n_logits, h, wd, &final_ln);
    } else { /* wd == h */
        head = final_ln;
        head_in = last_in;
    }
    head.argmax = pick_in_head ? picks : NULL;
    head.argmax_copy = pick_in_head ? s->ids_dev[buf] : NULL;
    linear(be, s->logits, head_in, wd, m->lm_head, NULL, n_logits, wd, c->vocab_size, &head);
    if (be->argmax && !pick_in_head) be->argmax(be, picks, s->logits, n_logits, c->vocab_size);
}

/* Queue the copy of picks buffer buf's rows into its device copy
 * (s.ids_dev, which a chained step after this one reads) where the picks
 * are mapped host memory: for the sample op's draws, which, unlike the LM
 * head's greedy picks, are not written there by the op itself. */
static int picks_to_device(opt_model *m, int buf, int rows, pd_err *err) {
    if (!m->s.ids_mapped) return 0;
    if (m->be->copy_h2d_async(m->be, m->s.ids_dev[buf], m->s.ids[buf],
                              sizeof(int32_t) * (size_t)rows, err) != 0)
        return pd_wrap(err, "opt forward: the draws' device copy");
    return 0;
}

/* Copy the step's results out: logits rows and/or picks (greedy, or drawn
 * on the device with sample_params) from picks buffer buf. */
static int read_outputs(opt_model *m, int n_logits, float *logits, int32_t *ids,
                        const float *sample_params, int buf, pd_err *err) {
    pd_backend *be = m->be;
    const int V = m->cfg.vocab_size;
    if (n_logits == 0) return be->sync(be, err);
    if (ids && sample_params) {
        if (!be->sample) return pd_fail(err, "opt forward: the %s backend cannot sample", be->name);
        if (copy_meta(be, m->s.sample_dev, sample_params, sizeof(float) * 5 * (size_t)n_logits,
                      err) != 0)
            return pd_wrap(err, "opt forward: sampling parameters");
        be->sample(be, m->s.ids[buf], m->s.logits, n_logits, V, m->s.sample_dev);
    }
    if (logits &&
        be->download_f32(be, logits, m->s.logits, (size_t)n_logits * V, err) != 0)
        return pd_wrap(err, "opt forward: logits");
    if (!ids) return 0;
    if (be->argmax || sample_params) {
        const size_t bytes = sizeof(int32_t) * (size_t)n_logits;
        if (m->s.ids_mapped) { /* written in place by the step's last op */
            if (be->sync(be, err) != 0) return pd_wrap(err, "opt forward: sampled ids");
            memcpy(ids, m->s.ids[buf], bytes);
            return 0;
        }
        if (be->copy_d2h(be, m->s.ids_host, m->s.ids[buf], bytes, err) != 0)
            return pd_wrap(err, "opt forward: sampled ids");
        memcpy(ids, m->s.ids_host, bytes);
        return 0;
    }
    /* No device argmax (the CPU): pick from the logits on the host. */
    float *row = logits;
    float *tmp = logits ? NULL : malloc(sizeof(float) * (size_t)V);
    if (!logits && !tmp) return pd_fail(err, "opt forward: out of memory for a logits row");
    for (int r = 0; r < n_logits; r++) {
        if (!logits) {
            if (be->download_f32(be, tmp, (char *)m->s.logits + (size_t)r * V * be->elem_size,
                                 (size_t)V, err) != 0) {
                free(tmp);
                return pd_wrap(err, "opt forward: logits");
            }
            row = tmp;
        } else {
            row = logits + (size_t)r * V;
        }
        int32_t best = 0;
        float bv = -INFINITY;
        bool found = false;
        for (int i = 0; i < V; i++)
            if (row[i] > bv || (!found && row[i] == bv)) {
                bv = row[i];
                best = i;
                found = true;
            }
        ids[r] = best;
    }
    free(tmp);
    return 0;
}

/* ---- decode steps as graphs ---- */

static int graph_size_at(int idx) {
    return idx < 3 ? 1 << idx : 8 * (idx - 2);
}
/* Index of the smallest recorded size >= n. */
static int graph_index_for(int n) {
    if (n <= 4) return n <= 1 ? 0 : n <= 2 ? 1 : 2;
    return 2 + (n + 7) / 8;
}

static void graphs_drop(opt_model *m) {
    opt_graphs *g = &m->g;
    for (int i = 0; i < OPT_GRAPH_SIZES; i++)
        for (int v = 0; v < 4; v++) {
            if (g->exec[i][v]) m->be->graph_free(m->be, g->exec[i][v]);
            g->exec[i][v] = NULL;
        }
    g->kv = NULL;
}

static void graphs_free(opt_model *m) {
    graphs_drop(m);
    m->be->free(m->be, m->g.meta_dev);
    m->g.meta_dev = NULL;
    for (int b = 0; b < 2; b++) {
        host_free(m->be, m->g.meta_host[b]);
        m->g.meta_host[b] = NULL;
    }
    m->g.meta_cap = 0;
}

int opt_model_set_graphs(opt_model *m, bool enable, int max_batch, pd_err *err) {
    pd_backend *be = m->be;
    /* A recording copies its metadata in (copy_h2d_async from host_alloc
     * memory, the one copy a capture may hold). */
    if (enable && !(be->graph_begin && be->graph_end && be->graph_launch && be->graph_free &&
                    be->copy_h2d_async && be->host_alloc)) {
        m->g.enabled = false;
        return 0; /* the backend runs eagerly (the CPU) */
    }
    if (!enable) {
        graphs_free(m);
        m->g.enabled = false;
        return 0;
    }
    if (max_batch < 1 || max_batch > 512)
        return pd_fail(err, "opt graphs: max batch %d not in [1, 512]", max_batch);
    m->g.enabled = true;
    m->g.max_batch = max_batch;
    /* Scratch for the largest recording now, so a small first step does not
     * record pointers that a larger one will move. */
    return scratch_reserve(m, graph_size_at(graph_index_for(max_batch)),
                           graph_size_at(graph_index_for(max_batch)), 1, err);
}

bool opt_model_samples_on_device(const opt_model *m) {
    return m->be->sample != NULL;
}

int opt_model_graph_stats(const opt_model *m, int *captures, int *replays) {
    if (captures) *captures = m->g.captures;
    if (replays) *replays = m->g.replays;
    return m->g.enabled;
}

void opt_model_chain_stats(const opt_model *m, uint64_t *on_device, uint64_t *on_host) {
    if (on_device) *on_device = m->ahead.chained_on_device;
    if (on_host) *on_host = m->ahead.chained_on_host;
}

int opt_model_time_graph(opt_model *m, int n_seqs, int reps, double *seconds, pd_err *err) {
    opt_graphs *g = &m->g;
    if (!g->enabled || n_seqs < 1 || n_seqs > g->max_batch || reps < 1 || g->replays == 0)
        return pd_fail(err, "opt graphs: no decode graph step of batch %d has run", n_seqs);
    const int idx = graph_index_for(n_seqs);
    void *exec = g->exec[idx][g->last_variant[idx]];
    if (!exec) return pd_fail(err, "opt graphs: batch %d has no recording", n_seqs);
    if (m->be->sync(m->be, err) != 0) return -1;
    const double t0 = pd_now();
    for (int r = 0; r < reps; r++)
        if (m->be->graph_launch(m->be, exec, err) != 0) return -1;
    if (m->be->sync(m->be, err) != 0) return -1;
    *seconds = (pd_now() - t0) / reps;
    return 0;
}

/* A pure decode step (one new token per sequence, all wanting logits) that
 * fits a recording. */
static bool graph_step_fits(const opt_model *m, const opt_seq_step *seqs, int n_seqs) {
    if (!m->g.enabled || n_seqs < 1 || n_seqs > m->g.max_batch) return false;
    for (int i = 0; i < n_seqs; i++)
        if (seqs[i].n_tokens != 1 || !seqs[i].want_logits) return false;
    /* A recording is made for sequences with tables of their own (it may
     * fuse each token's kv_write into its attention). */
    return !tables_shared(seqs, n_seqs);
}


/* Ties the recordings to KV storage kv: recordings hold its addresses, so
 * another storage drops them and sizes the metadata buffer afresh. */
static int graphs_attach(opt_model *m, opt_kv_storage *kv, pd_err *err) {
    pd_backend *be = m->be;
    opt_graphs *g = &m->g;
    if (g->kv == kv) return 0;
    graphs_drop(m);
    const int MB = (m->cfg.max_position_embeddings + kv->block_size - 1) / kv->block_size;
    const int B_max = graph_size_at(graph_index_for(g->max_batch));
    const size_t need = meta_entries(B_max, B_max, MB, B_max); /* B tokens, seqs, logit rows */
    if (need > g->meta_cap) {
        be->free(be, g->meta_dev);
        g->meta_dev = be->alloc(be, need * sizeof(int32_t), err);
        for (int b = 0; b < 2; b++) {
            host_free(be, g->meta_host[b]);
            g->meta_host[b] = host_alloc(be, need * sizeof(int32_t));
        }
        g->meta_cap = g->meta_dev && g->meta_host[0] && g->meta_host[1] ? need : 0;
        if (!g->meta_cap) {
            graphs_free(m);
            return pd_fail(err, "opt graphs: out of memory for step metadata");
        }
    }
    g->kv = kv;
    g->max_blocks = MB;
    return 0;
}

/* Records variant v (see opt_graphs.exec) of the decode step of padded
 * batch graph_size_at(idx), whose metadata (laid out for meta_dev's place)
 * is meta, n_meta entries. The recording starts with the metadata's copy
 * from meta_host[buf], so a replay is the host's one call: the step's
 * metadata written there, then the launch. A chained variant's embedding
 * reads its tokens from the other buffer's picks, row for row, in device
 * memory (s.ids_dev where the picks are mapped host memory). */
static int graph_record(opt_model *m, opt_kv_storage *kv, int idx, int v, const pd_step_meta *meta,
                        size_t n_meta, const int32_t *logit_rows, pd_err *err) {
    pd_backend *be = m->be;
    opt_graphs *g = &m->g;
    const int B = graph_size_at(idx), buf = v >> 1;
    pd_step_meta rec = *meta;
    if (v & 1) rec.token_ids = m->s.ids_mapped ? m->s.ids_dev[buf ^ 1] : m->s.ids[buf ^ 1];
    if (be->graph_begin(be, err) != 0) return -1;
    if (copy_meta(be, g->meta_dev, g->meta_host[buf], n_meta * sizeof(int32_t), err) != 0) {
        void *dropped = NULL;
        pd_err ignored;
        if (be->graph_end(be, &dropped, &ignored) == 0) be->graph_free(be, dropped);
        return pd_wrap(err, "opt graphs: recording the metadata copy");
    }
    forward_ops(m, kv, &rec, B, logit_rows, buf);
    if (be->graph_end(be, &g->exec[idx][v], err) != 0) return pd_wrap(err, "opt graphs: batch %d", B);
    g->captures++;
    pd_log(PD_LOG_DEBUG, "opt: recorded the decode step of batch %d as a graph", B);
    return 0;
}

/* Whether this backend can have a step queued behind another: events to
 * wait for one of them, and picks made on the device into host memory the
 * host reads in place, by the LM head's kernel, which also leaves them in
 * device memory for a chained step (pd_linear_fuse.argmax_copy). */
static bool can_queue_steps(const opt_model *m) {
    const pd_backend *be = m->be;
    return be->event_create && be->event_record && be->event_wait && be->argmax && be->linear &&
           be->linear_argmax && m->s.ids_mapped;
}

int opt_model_record_graphs(opt_model *m, opt_kv_storage *kv, bool queued_variants, int *recorded,
                            pd_err *err) {
    opt_graphs *g = &m->g;
    if (recorded) *recorded = 0;
    if (!g->enabled) return 0;
    const int last = graph_index_for(g->max_batch), B_max = graph_size_at(last);
    if (scratch_reserve(m, B_max, B_max, 1, err) != 0 || graphs_attach(m, kv, err) != 0) return -1;
    /* The variants opt_forward_queue replays (second picks buffer, tokens
     * from the other buffer's picks) exist only where steps can be queued. */
    const bool can_queue = queued_variants && can_queue_steps(m);
    for (int idx = 0; idx <= last; idx++) {
        for (int v = 0; v < (can_queue ? 4 : 1); v++) {
            if (g->exec[idx][v]) continue;
            const int B = graph_size_at(idx);
            pd_step_meta meta;
            const int32_t *logit_rows = NULL;
            /* Padding sequences only: the recording depends on the sizes, and
             * nothing runs until a real step's metadata is in place. */
            const size_t n = fill_meta(g->meta_host[v >> 1], (const int32_t *)g->meta_dev, kv, NULL,
                                       0, B, B, B, g->max_blocks, 0, &meta, &logit_rows);
            if (graph_record(m, kv, idx, v, &meta, n, logit_rows, err) != 0) return -1;
            if (recorded) (*recorded)++;
        }
    }
    return 0;
}

/* Queue a decode step through recording variant v (recording it first if
 * needed); its picks land in s.ids[v >> 1]. */
static int graph_launch_step(opt_model *m, opt_kv_storage *kv, const opt_seq_step *seqs, int n_seqs,
                             int v, pd_err *err) {
    pd_backend *be = m->be;
    opt_graphs *g = &m->g;
    const int idx = graph_index_for(n_seqs), B = graph_size_at(idx);
    if (scratch_reserve(m, B, B, 1, err) != 0 || graphs_attach(m, kv, err) != 0) return -1;
    pd_step_meta meta;
    const int32_t *logit_rows = NULL;
    /* shared_tables 0: graph_step_fits let no shared table through */
    /* The recording copies meta_host[buf] to meta_dev as its first node. */
    const size_t n = fill_meta(g->meta_host[v >> 1], (const int32_t *)g->meta_dev, kv, seqs, n_seqs, B,
                               B, B, g->max_blocks, 0, &meta, &logit_rows);
    if (!g->exec[idx][v] && graph_record(m, kv, idx, v, &meta, n, logit_rows, err) != 0) return -1;
    if (be->graph_launch(be, g->exec[idx][v], err) != 0) return -1;
    g->last_variant[idx] = v;
    g->replays++;
    return 0;
}

/* One step, run to the end: through a recording where it fits, else op by
 * op; the device's picks (if any) land in s.ids[buf]. Nothing queued ahead
 * may be in flight (the scratch buffers may move). */
static int forward_sync(opt_model *m, opt_kv_storage *kv, const opt_seq_step *seqs, int n_seqs,
                        float *logits, int32_t *ids, const float *sample_params, int buf, pd_err *err) {
    int T = 0, n_logits = 0, max_blocks = 0;
    if (validate_step(m, kv, seqs, n_seqs, logits || ids, &T, &n_logits, &max_blocks, err) != 0)
        return -1;
    if (T == 0) return 0;
    if (graph_step_fits(m, seqs, n_seqs)) {
        if (graph_launch_step(m, kv, seqs, n_seqs, 2 * buf, err) == 0)
            return read_outputs(m, n_seqs, logits, ids, sample_params, buf, err);
        /* A backend that cannot record this step still runs it eagerly. */
        pd_log(PD_LOG_WARN, "opt: decode graphs turned off: %s", err->msg);
        graphs_free(m);
        m->g.enabled = false;
    }
    const size_t n_meta = meta_entries(T, n_seqs, max_blocks, n_logits);
    if (scratch_reserve(m, T, n_logits, (int)n_meta, err) != 0) return -1;
    pd_step_meta meta;
    const int32_t *logit_rows = NULL;
    const size_t n = fill_meta(m->s.meta_host, (const int32_t *)m->s.meta_dev, kv, seqs, n_seqs, n_seqs, T,
                               n_logits, max_blocks, tables_shared(seqs, n_seqs), &meta,
                               &logit_rows);
    if (copy_meta(m->be, m->s.meta_dev, m->s.meta_host, n * sizeof(int32_t), err) != 0)
        return pd_wrap(err, "opt forward: step metadata");
    forward_ops(m, kv, &meta, n_logits, logit_rows, buf);
    return read_outputs(m, n_logits, logits, ids, sample_params, buf, err);
}

/* ---- steps queued ahead ---- */

/* Wait for one queued step and keep its picks on the host. */
static int pending_finish(opt_model *m, opt_pending *p, pd_err *err) {
    if (p->done) return 0;
    opt_ahead *a = &m->ahead;
    p->done = true; /* whatever the outcome: waited for once */
    if (m->be->event_wait(m->be, a->event[p->buf], err) != 0)
        return pd_wrap(err, "opt forward: a queued step");
    memcpy(a->picks[p->buf], m->s.ids[p->buf], sizeof(int32_t) * (size_t)p->n_rows);
    return 0;
}

static int ahead_drain(opt_model *m, pd_err *err) {
    opt_ahead *a = &m->ahead;
    for (int k = 0; k < a->n; k++)
        if (pending_finish(m, &a->q[(a->head + k) % 2], err) != 0) return -1;
    return 0;
}

static void ahead_free(opt_model *m) {
    opt_ahead *a = &m->ahead;
    pd_err ignored;
    ahead_drain(m, &ignored);
    for (int b = 0; b < 2; b++) {
        free(a->picks[b]);
        host_free(m->be, a->params_host[b]);
        if (a->event[b] && m->be->event_free) m->be->event_free(m->be, a->event[b]);
    }
    free(a->last_picks);
    free(a->steps);
    free(a->tokens);
    memset(a, 0, sizeof *a);
}

/* Room for steps of rows rows (realloc keeps the picks of done steps). */
static int ahead_reserve(opt_model *m, int rows, pd_err *err) {
    opt_ahead *a = &m->ahead;
    if (rows <= a->cap) return 0;
    const size_t n = (size_t)rows;
    int32_t *p0 = realloc(a->picks[0], n * sizeof(int32_t));
    if (p0) a->picks[0] = p0;
    int32_t *p1 = p0 ? realloc(a->picks[1], n * sizeof(int32_t)) : NULL;
    if (p1) a->picks[1] = p1;
    int32_t *lp = p1 ? realloc(a->last_picks, n * sizeof(int32_t)) : NULL;
    if (lp) a->last_picks = lp;
    opt_seq_step *st = lp ? realloc(a->steps, n * sizeof *st) : NULL;
    if (st) a->steps = st;
    int32_t *tk = st ? realloc(a->tokens, n * sizeof(int32_t)) : NULL;
    if (tk) a->tokens = tk;
    if (!tk) return pd_fail(err, "opt forward: out of memory for a queued step of %d rows", rows);
    for (int b = 0; b < 2; b++) {
        host_free(m->be, a->params_host[b]);
        a->params_host[b] = host_alloc(m->be, n * 5 * sizeof(float));
        if (!a->params_host[b])
            return pd_fail(err, "opt forward: out of memory for sampling parameters");
    }
    a->cap = rows;
    return 0;
}

/* Whether a step can be queued without waiting: a decode graph, picks the
 * host can read in place once the step's event says so. */
static bool ahead_async(const opt_model *m, const opt_kv_storage *kv, const opt_seq_step *seqs,
                        int n_seqs) {
    if (!can_queue_steps(m) || !graph_step_fits(m, seqs, n_seqs)) return false;
    /* Nothing may move under a step in flight: the recording's buffers are
     * in place already (opt_model_set_graphs reserved them). */
    const int B = graph_size_at(graph_index_for(n_seqs));
    return B <= m->s.cap_tokens && B <= m->s.cap_logits && m->g.kv == kv;
}

int opt_forward_queue(opt_model *m, opt_kv_storage *kv, const opt_seq_step *seqs, int n_seqs,
                      const float *sample_params, const int32_t *chain_rows, pd_err *err) {
    opt_ahead *a = &m->ahead;
    pd_backend *be = m->be;
    if (a->n == 2)
        return pd_fail(err, "opt forward: two steps are queued already; wait for the older first");
    if (n_seqs < 1) return pd_fail(err, "opt forward: a queued step needs a sequence");
    for (int i = 0; i < n_seqs; i++)
        if (!seqs[i].want_logits)
            return pd_fail(err, "opt forward: sequence %d of a queued step wants no logits", i);
    if (sample_params && !be->sample)
        return pd_fail(err, "opt forward: the %s backend cannot sample", be->name);
    const opt_pending *prev = a->n ? &a->q[(a->head + a->n - 1) % 2] : NULL;
    const int prev_rows = prev ? prev->n_rows : a->last_rows;
    bool identity = chain_rows != NULL;
    if (chain_rows) {
        if (prev_rows < 0) return pd_fail(err, "opt forward: a chained step with no step before it");
        for (int i = 0; i < n_seqs; i++) {
            if (chain_rows[i] < -1 || chain_rows[i] >= prev_rows)
                return pd_fail(err, "opt forward: sequence %d chains row %d of a step of %d rows", i,
                               chain_rows[i], prev_rows);
            if (chain_rows[i] >= 0 && seqs[i].n_tokens != 1)
                return pd_fail(err, "opt forward: chained sequence %d has %d new tokens, not 1", i,
                               seqs[i].n_tokens);
            if (chain_rows[i] != i) identity = false;
        }
    }
    if (ahead_reserve(m, n_seqs, err) != 0) return -1;
    /* Chained tokens are read on the device when the rows line up with the
     * step before (its picks still in the other buffer); else that step is
     * waited for and its picks written in as ordinary tokens. */
    const bool device_chain =
        identity && a->dev_rows >= n_seqs && ahead_async(m, kv, seqs, n_seqs);
    const opt_seq_step *run = seqs;
    if (chain_rows) {
        if (!device_chain && ahead_drain(m, err) != 0) return -1;
        if (device_chain)
            a->chained_on_device++;
        else
            a->chained_on_host++;
        const int32_t *from = prev ? a->picks[prev->buf] : a->last_picks;
        for (int i = 0; i < n_seqs; i++) {
            a->steps[i] = seqs[i];
            if (chain_rows[i] < 0) continue;
            /* 0 stands in for validation when the device reads the real one. */
            a->tokens[i] = device_chain ? 0 : from[chain_rows[i]];
            a->steps[i].tokens = &a->tokens[i];
        }
        run = a->steps;
    }
    const int buf = a->next_buf;
    opt_pending *p = &a->q[(a->head + a->n) % 2];
    /* meta_host[buf] and params_host[buf] were last read by the step two
     * before, which has been handed out already. */
    if (ahead_async(m, kv, run, n_seqs)) {
        int T = 0, n_logits = 0, max_blocks = 0;
        if (validate_step(m, kv, run, n_seqs, true, &T, &n_logits, &max_blocks, err) != 0) return -1;
        if (!a->event[buf] && be->event_create(be, &a->event[buf], err) != 0) return -1;
        if (graph_launch_step(m, kv, run, n_seqs, 2 * buf + device_chain, err) != 0) return -1;
        if (sample_params) { /* the copy reads them when it runs: opt's own copy */
            memcpy(a->params_host[buf], sample_params, sizeof(float) * 5 * (size_t)n_seqs);
            if (copy_meta(be, m->s.sample_dev, a->params_host[buf], sizeof(float) * 5 * (size_t)n_seqs,
                          err) != 0)
                return pd_wrap(err, "opt forward: sampling parameters");
            be->sample(be, m->s.ids[buf], m->s.logits, n_seqs, m->cfg.vocab_size, m->s.sample_dev);
            if (picks_to_device(m, buf, n_seqs, err) != 0) return -1;
        }
        if (be->event_record(be, a->event[buf], err) != 0) return -1;
        p->done = false;
    } else {
        if (ahead_drain(m, err) != 0) return -1;
        if (forward_sync(m, kv, run, n_seqs, NULL, a->picks[buf], sample_params, buf, err) != 0 ||
            (sample_params && picks_to_device(m, buf, n_seqs, err) != 0))
            return -1;
        p->done = true;
    }
    p->n_rows = n_seqs;
    p->buf = buf;
    /* Picks made on the device stay in s.ids[buf] for a chained step. */
    a->dev_rows = be->argmax || sample_params ? n_seqs : -1;
    a->next_buf = buf ^ 1;
    a->n++;
    return 0;
}

int opt_forward_wait(opt_model *m, int32_t *ids, pd_err *err) {
    opt_ahead *a = &m->ahead;
    if (a->n == 0) return pd_fail(err, "opt forward: no queued step to wait for");
    opt_pending *p = &a->q[a->head];
    const int rc = pending_finish(m, p, err);
    a->head = (a->head + 1) % 2;
    a->n--;
    if (rc != 0) {
        a->last_rows = -1;
        return -1;
    }
    memcpy(a->last_picks, a->picks[p->buf], sizeof(int32_t) * (size_t)p->n_rows);
    a->last_rows = p->n_rows;
    if (ids) memcpy(ids, a->picks[p->buf], sizeof(int32_t) * (size_t)p->n_rows);
    return 0;
}

int opt_forward_ex(opt_model *m, opt_kv_storage *kv, const opt_seq_step *seqs, int n_seqs,
                   float *logits, int32_t *ids, const float *sample_params, pd_err *err) {
    opt_ahead *a = &m->ahead;
    if (ahead_drain(m, err) != 0) return -1;
    /* Buffer 0 is overwritten, and a chained step after this one has no
     * queued step to chain. */
    a->dev_rows = -1;
    a->last_rows = -1;
    return forward_sync(m, kv, seqs, n_seqs, logits, ids, sample_params, 0, err);
}

int opt_forward(opt_model *m, opt_kv_storage *kv, const opt_seq_step *seqs, int n_seqs,
                float *logits, pd_err *err) {
    return opt_forward_ex(m, kv, seqs, n_seqs, logits, NULL, NULL, err);
}
