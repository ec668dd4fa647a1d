/* test_forward: opt_forward over the paged KV cache against a dense
 * reference forward written here from the math of HF OPTForCausalLM (no
 * paging, whole sequence, double accumulation).
 *
 * Models are small and random, built in memory: pre-LN with tied lm_head
 * (F32), post-LN with project_in/out and an untied lm_head (F16 views), and
 * pre-LN with projections, no biases, no LN affine, gelu_new (BF16). The
 * tests cover: prefill at many lengths and block sizes with shuffled block
 * tables, chunked prefill and token-by-token decode against one-shot
 * prefill, several sequences in one batched step against each alone, and
 * the step validation errors. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/opt.h"
#include "tests/common/testlib.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;
static uint32_t urand(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)(rng >> 32);
}
static float frand(void) {
    return (float)urand() / 4294967296.0f * 2.0f - 1.0f;
}

/* ---- a random model, kept as floats (for the reference) and as views ---- */

typedef struct tensor {
    float *f;    /* the values the model holds */
    void *store; /* what the view points at (f itself for F32) */
    pd_view view;
} tensor;

typedef struct test_model {
    opt_config cfg;
    opt_weights w;
    tensor t[256];
    int n;
} test_model;

/* center + k * 2^-10 * scale, |k| < 1024; all within fp16's normal range. */
static float exact_value(float scale_pow2, float center) {
    int k = (int)(frand() * 1023.0f);
    return center + (float)k / 1024.0f * scale_pow2;
}

static pd_view make_tensor(test_model *tm, pd_dtype dt, int rows, int cols, float scale,
                           float center) {
    tensor *t = &tm->t[tm->n++];
    size_t n = (size_t)rows * cols;
    t->f = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        /* Drop the mantissa bits the stored dtype lacks, so the values the
         * reference sees are exactly the ones the model gets. */
        float v = exact_value(scale, center);
        uint32_t u;
        memcpy(&u, &v, 4);
        if (dt == PD_F16) u &= ~0x1fffu;
        if (dt == PD_BF16) u &= ~0xffffu;
        memcpy(&t->f[i], &u, 4);
    }
    if (dt == PD_F32) {
        t->store = t->f;
    } else {
        uint16_t *h = malloc(n * sizeof(uint16_t));
        for (size_t i = 0; i < n; i++) {
            uint32_t u;
            memcpy(&u, &t->f[i], 4);
            if (dt == PD_BF16) {
                h[i] = (uint16_t)(u >> 16); /* exact: low bits are zero */
            } else if ((u & 0x7fffffff) == 0) {
                h[i] = (uint16_t)(u >> 16);
            } else {
                uint32_t e = ((u >> 23) & 0xff) - 127 + 15;
                h[i] = (uint16_t)(((u >> 16) & 0x8000) | (e << 10) | ((u >> 13) & 0x3ff));
            }
        }
        t->store = h;
    }
    t->view = (pd_view){t->store, dt, rows, cols};
    return t->view;
}

/* The float values behind a view. */
static const float *vals(const test_model *tm, pd_view v) {
    for (int i = 0; i < tm->n; i++)
        if (tm->t[i].store == v.data) return tm->t[i].f;
    return NULL;
}

typedef struct model_kind {
    const char *name;
    bool pre_ln, bias, affine, tied;
    int proj_dim; /* word_embed_proj_dim */
    pd_activation act;
    pd_dtype dtype;
} model_kind;

static void test_model_build(test_model *tm, const model_kind *k) {
    memset(tm, 0, sizeof *tm);
    opt_config *c = &tm->cfg;
    c->vocab_size = 97;
    c->hidden_size = 32;
    c->num_hidden_layers = 2;
    c->ffn_dim = 64;
    c->num_attention_heads = 4;
    c->head_dim = 8;
    c->max_position_embeddings = 64;
    c->word_embed_proj_dim = k->proj_dim;
    c->do_layer_norm_before = k->pre_ln;
    c->remove_final_layer_norm = false;
    c->enable_bias = k->bias;
    c->layer_norm_elementwise_affine = k->affine;
    c->tie_word_embeddings = k->tied;
    c->activation = k->act;
    c->torch_dtype = k->dtype;
    const int V = 97, h = 32, f = 64, wd = k->proj_dim, P = 66;
    const pd_dtype dt = k->dtype;
    opt_weights *w = &tm->w;
    w->embed_tokens = make_tensor(tm, dt, V, wd, 1.0f, 0.0f);
    w->embed_positions = make_tensor(tm, dt, P, h, 0.5f, 0.0f);
    if (wd != h) {
        w->project_in = make_tensor(tm, dt, h, wd, 0.5f, 0.0f);
        w->project_out = make_tensor(tm, dt, wd, h, 0.5f, 0.0f);
    }
    if (k->pre_ln && k->affine) {
        w->final_ln_w = make_tensor(tm, dt, 1, h, 0.25f, 1.0f);
        w->final_ln_b = make_tensor(tm, dt, 1, h, 0.25f, 0.0f);
    }
    w->lm_head = k->tied ? w->embed_tokens : make_tensor(tm, dt, V, wd, 1.0f, 0.0f);
    w->num_layers = 2;
    w->layers = calloc(2, sizeof *w->layers);
    for (int l = 0; l < 2; l++) {
        opt_layer_weights *L = &w->layers[l];
        pd_view *mats[] = {&L->q_w, &L->k_w, &L->v_w, &L->o_w};
        pd_view *vecs[] = {&L->q_b, &L->k_b, &L->v_b, &L->o_b};
        for (int i = 0; i < 4; i++) {
            *mats[i] = make_tensor(tm, dt, h, h, 0.5f, 0.0f);
            if (k->bias) *vecs[i] = make_tensor(tm, dt, 1, h, 0.25f, 0.0f);
        }
        L->fc1_w = make_tensor(tm, dt, f, h, 0.5f, 0.0f);
        L->fc2_w = make_tensor(tm, dt, h, f, 0.25f, 0.0f);
        if (k->bias) {
            L->fc1_b = make_tensor(tm, dt, 1, f, 0.25f, 0.0f);
            L->fc2_b = make_tensor(tm, dt, 1, h, 0.25f, 0.0f);
        }
        if (k->affine) {
            L->attn_ln_w = make_tensor(tm, dt, 1, h, 0.25f, 1.0f);
            L->attn_ln_b = make_tensor(tm, dt, 1, h, 0.25f, 0.0f);
            L->ffn_ln_w = make_tensor(tm, dt, 1, h, 0.25f, 1.0f);
            L->ffn_ln_b = make_tensor(tm, dt, 1, h, 0.25f, 0.0f);
        }
    }
}

static void test_model_free(test_model *tm) {
    for (int i = 0; i < tm->n; i++) {
        if (tm->t[i].store != tm->t[i].f) free(tm->t[i].store);
        free(tm->t[i].f);
    }
    free(tm->w.layers);
}

/* ---- the dense reference (double) ---- */

/* y[n, out] = x[n, in] . W^T + b, W from a view (may be absent -> skip). */
static void ref_linear(const test_model *tm, double *y, const double *x, int n, int in, int out,
                       pd_view w, pd_view b) {
    const float *W = vals(tm, w), *B = b.data ? vals(tm, b) : NULL;
    for (int t = 0; t < n; t++)
        for (int o = 0; o < out; o++) {
            double s = B ? B[o] : 0.0;
            for (int i = 0; i < in; i++)
                s += x[t * in + i] * W[o * in + i];
            y[t * out + o] = s;
        }
}

static void ref_ln(const test_model *tm, double *x, int n, int d, pd_view w, pd_view b) {
    const float *W = w.data ? vals(tm, w) : NULL, *B = b.data ? vals(tm, b) : NULL;
    for (int t = 0; t < n; t++) {
        double *r = x + t * d, mean = 0, var = 0;
        for (int i = 0; i < d; i++)
            mean += r[i];
        mean /= d;
        for (int i = 0; i < d; i++)
            var += (r[i] - mean) * (r[i] - mean);
        var /= d;
        for (int i = 0; i < d; i++) {
            r[i] = (r[i] - mean) / sqrt(var + 1e-5);
            if (W) r[i] = r[i] * W[i] + (B ? B[i] : 0.0);
        }
    }
}

static double ref_act(pd_activation a, double z) {
    switch (a) {
    case PD_ACT_RELU:
        return z > 0 ? z : 0;
    case PD_ACT_GELU:
        return 0.5 * z * (1 + erf(z / sqrt(2.0)));
    case PD_ACT_GELU_NEW:
        return 0.5 * z * (1 + tanh(sqrt(2.0 / M_PI) * (z + 0.044715 * z * z * z)));
    case PD_ACT_SILU:
        return z / (1 + exp(-z));
    }
    return 0;
}

/* out[n, h] = out_proj(causal multi-head attention of in[n, h]). */
static void ref_attention(const test_model *tm, const opt_layer_weights *L, const double *in,
                          double *out, int n) {
    const int h = tm->cfg.hidden_size, H = tm->cfg.num_attention_heads, hd = h / H;
    double *q = malloc(sizeof(double) * n * h), *k = malloc(sizeof(double) * n * h);
    double *v = malloc(sizeof(double) * n * h), *o = malloc(sizeof(double) * n * h);
    double *p = malloc(sizeof(double) * n);
    ref_linear(tm, q, in, n, h, h, L->q_w, L->q_b);
    ref_linear(tm, k, in, n, h, h, L->k_w, L->k_b);
    ref_linear(tm, v, in, n, h, h, L->v_w, L->v_b);
    for (int i = 0; i < n * h; i++)
        q[i] *= 1.0 / sqrt((double)hd);
    for (int t = 0; t < n; t++)
        for (int hh = 0; hh < H; hh++) {
            double mx = -INFINITY, sum = 0;
            for (int j = 0; j <= t; j++) {
                double s = 0;
                for (int i = 0; i < hd; i++)
                    s += q[t * h + hh * hd + i] * k[j * h + hh * hd + i];
                p[j] = s;
                mx = fmax(mx, s);
            }
            for (int j = 0; j <= t; j++)
                sum += (p[j] = exp(p[j] - mx));
            for (int i = 0; i < hd; i++) {
                double acc = 0;
                for (int j = 0; j <= t; j++)
                    acc += p[j] * v[j * h + hh * hd + i];
                o[t * h + hh * hd + i] = acc / sum;
            }
        }
    ref_linear(tm, out, o, n, h, h, L->o_w, L->o_b);
    free(q), free(k), free(v), free(o), free(p);
}

static void ref_ffn(const test_model *tm, const opt_layer_weights *L, const double *in, double *out,
                    int n) {
    const int h = tm->cfg.hidden_size, f = tm->cfg.ffn_dim;
    double *mid = malloc(sizeof(double) * n * f);
    ref_linear(tm, mid, in, n, h, f, L->fc1_w, L->fc1_b);
    for (int i = 0; i < n * f; i++)
        mid[i] = ref_act(tm->cfg.activation, mid[i]);
    ref_linear(tm, out, mid, n, f, h, L->fc2_w, L->fc2_b);
    free(mid);
}

/* Logits for every position of tokens[0..n): logits[n, V]. */
static void ref_forward(const test_model *tm, const int32_t *tokens, int n, double *logits) {
    const opt_config *c = &tm->cfg;
    const int h = c->hidden_size, wd = c->word_embed_proj_dim, V = c->vocab_size;
    const opt_weights *w = &tm->w;
    double *x = malloc(sizeof(double) * n * h), *a = malloc(sizeof(double) * n * h);
    double *e = malloc(sizeof(double) * n * (wd > h ? wd : h));
    const float *E = vals(tm, w->embed_tokens), *P = vals(tm, w->embed_positions);
    for (int t = 0; t < n; t++)
        for (int i = 0; i < wd; i++)
            e[t * wd + i] = E[tokens[t] * wd + i];
    if (wd != h)
        ref_linear(tm, x, e, n, wd, h, w->project_in, (pd_view){0});
    else
        memcpy(x, e, sizeof(double) * n * h);
    for (int t = 0; t < n; t++)
        for (int i = 0; i < h; i++)
            x[t * h + i] += P[(t + 2) * h + i];
    for (int l = 0; l < c->num_hidden_layers; l++) {
        const opt_layer_weights *L = &w->layers[l];
        if (c->do_layer_norm_before) {
            memcpy(a, x, sizeof(double) * n * h);
            ref_ln(tm, a, n, h, L->attn_ln_w, L->attn_ln_b);
            ref_attention(tm, L, a, e, n);
            for (int i = 0; i < n * h; i++)
                x[i] += e[i];
            memcpy(a, x, sizeof(double) * n * h);
            ref_ln(tm, a, n, h, L->ffn_ln_w, L->ffn_ln_b);
            ref_ffn(tm, L, a, e, n);
            for (int i = 0; i < n * h; i++)
                x[i] += e[i];
        } else {
            ref_attention(tm, L, x, e, n);
            for (int i = 0; i < n * h; i++)
                x[i] += e[i];
            ref_ln(tm, x, n, h, L->attn_ln_w, L->attn_ln_b);
            ref_ffn(tm, L, x, e, n);
            for (int i = 0; i < n * h; i++)
                x[i] += e[i];
            ref_ln(tm, x, n, h, L->ffn_ln_w, L->ffn_ln_b);
        }
    }
    if (c->do_layer_norm_before && !c->remove_final_layer_norm)
        ref_ln(tm, x, n, h, w->final_ln_w, w->final_ln_b);
    const double *head_in = x;
    if (wd != h) {
        ref_linear(tm, e, x, n, h, wd, w->project_out, (pd_view){0});
        head_in = e;
    }
    ref_linear(tm, logits, head_in, n, wd, V, w->lm_head, (pd_view){0});
    free(x), free(a), free(e);
}

/* ---- helpers around opt_forward ---- */

static const model_kind KINDS[] = {
    {"pre-LN f32 tied", true, true, true, true, 32, PD_ACT_RELU, PD_F32},
    {"post-LN f16 proj", false, true, true, false, 16, PD_ACT_RELU, PD_F16},
    {"pre-LN bf16 proj nobias noaffine gelu_new", true, false, false, true, 24, PD_ACT_GELU_NEW,
     PD_BF16},
};

static double max_diff_fd(const float *a, const double *b, int n) {
    double m = 0;
    for (int i = 0; i < n; i++)
        m = fmax(m, fabs(a[i] - b[i]));
    return m;
}
static double max_diff_ff(const float *a, const float *b, int n) {
    double m = 0;
    for (int i = 0; i < n; i++)
        m = fmax(m, fabs(a[i] - b[i]));
    return m;
}

/* A random permutation of 0..n-1: physical blocks in a scattered order. */
static void shuffled(int32_t *ids, int n) {
    for (int i = 0; i < n; i++)
        ids[i] = i;
    for (int i = n - 1; i > 0; i--) {
        int j = (int)(urand() % (uint32_t)(i + 1));
        int32_t t = ids[i];
        ids[i] = ids[j], ids[j] = t;
    }
}

static int run_one(opt_model *m, opt_kv_storage *kv, const int32_t *tokens, int n, int start,
                   const int32_t *table, int n_blocks, float *logits, pd_err *err) {
    opt_seq_step s = {tokens + start, n, start, table, n_blocks, logits != NULL};
    return opt_forward(m, kv, &s, 1, logits, err);
}

/* Whole-prompt prefill == reference, for many lengths and block sizes. */
static void test_prefill_vs_reference(opt_model *m, const test_model *tm, const char *name) {
    const int V = tm->cfg.vocab_size, bss[] = {1, 7, 16};
    pd_err err;
    int32_t tokens[64];
    for (int i = 0; i < 64; i++)
        tokens[i] = (int32_t)(urand() % (uint32_t)V);
    double *ref = malloc(sizeof(double) * 64 * V);
    ref_forward(tm, tokens, 60, ref); /* causal: prefix logits are the first rows */
    float *logits = malloc(sizeof(float) * V);
    for (int b = 0; b < 3; b++) {
        const int bs = bss[b];
        opt_kv_storage *kv;
        const int nb = 64 / bs + 8;
        CHECKF(opt_kv_storage_create(m, nb, bs, &kv, &err) == 0, "%s", err.msg);
        int32_t table[80];
        const int lens[] = {1, bs - 1, bs, bs + 1, 3 * bs + 2, 60};
        for (int li = 0; li < 6; li++) {
            const int n = lens[li];
            if (n < 1 || n > 60) continue;
            shuffled(table, nb);
            int rc = run_one(m, kv, tokens, n, 0, table, (n + bs - 1) / bs, logits, &err);
            CHECKF(rc == 0, "%s", err.msg);
            double d = max_diff_fd(logits, ref + (size_t)(n - 1) * V, V);
            CHECKF(d < 1e-4, "%s: prefill len %d block size %d: max diff %g", name, n, bs, d);
        }
        opt_kv_storage_free(kv);
    }
    free(ref);
    free(logits);
}

/* One-shot prefill of every prefix == chunked prefill == token by token. */
static void test_chunked_and_decode(opt_model *m, const test_model *tm, const char *name) {
    const int V = tm->cfg.vocab_size, n = 23, bs = 7, nb = 8;
    pd_err err;
    int32_t tokens[23], table[8];
    for (int i = 0; i < n; i++)
        tokens[i] = (int32_t)(urand() % (uint32_t)V);
    opt_kv_storage *kv;
    CHECK(opt_kv_storage_create(m, nb, bs, &kv, &err) == 0);
    shuffled(table, nb);
    float *oneshot = malloc(sizeof(float) * n * V), *got = malloc(sizeof(float) * V);
    for (int p = 1; p <= n; p++)
        CHECK(run_one(m, kv, tokens, p, 0, table, nb, oneshot + (size_t)(p - 1) * V, &err) == 0);
    const int chunks[] = {1, 2, 5, 8, 23};
    for (int c = 0; c < 5; c++) {
        shuffled(table, nb); /* a fresh layout; stale cache contents must not matter */
        double worst = 0;
        for (int start = 0; start < n; start += chunks[c]) {
            int len = start + chunks[c] > n ? n - start : chunks[c];
            int rc = run_one(m, kv, tokens, len, start, table, nb, got, &err);
            CHECKF(rc == 0, "%s", err.msg);
            worst = fmax(worst, max_diff_ff(got, oneshot + (size_t)(start + len - 1) * V, V));
        }
        CHECKF(worst < 1e-5, "%s: chunk %d vs one-shot prefill: max diff %g", name, chunks[c],
               worst);
    }
    opt_kv_storage_free(kv);
    free(oneshot), free(got);
}

/* Several sequences in one step == each alone. */
static void test_batched(opt_model *m, const test_model *tm, const char *name) {
    const int V = tm->cfg.vocab_size, bs = 4, nb = 40;
    pd_err err;
    enum { NS = 5 };
    /* cached tokens before the batched step, new tokens in it */
    const int cached[NS] = {0, 13, 5, 0, 9}, fresh[NS] = {10, 1, 6, 1, 3};
    const bool want[NS] = {true, true, true, true, false};
    int32_t tokens[NS][20], tables[NS][8], perm[40];
    shuffled(perm, nb);
    for (int s = 0; s < NS; s++) {
        for (int i = 0; i < 20; i++)
            tokens[s][i] = (int32_t)(urand() % (uint32_t)V);
        for (int b = 0; b < 8; b++)
            tables[s][b] = perm[s * 8 + b];
    }
    opt_kv_storage *kv_batch, *kv_solo;
    CHECK(opt_kv_storage_create(m, nb, bs, &kv_batch, &err) == 0);
    CHECK(opt_kv_storage_create(m, nb, bs, &kv_solo, &err) == 0);
    for (int s = 0; s < NS; s++)
        if (cached[s] > 0) {
            CHECK(run_one(m, kv_batch, tokens[s], cached[s], 0, tables[s], 8, NULL, &err) == 0);
            CHECK(run_one(m, kv_solo, tokens[s], cached[s], 0, tables[s], 8, NULL, &err) == 0);
        }
    opt_seq_step steps[NS];
    for (int s = 0; s < NS; s++)
        steps[s] =
            (opt_seq_step){tokens[s] + cached[s], fresh[s], cached[s], tables[s], 8, want[s]};
    float *batch = malloc(sizeof(float) * NS * V), *solo = malloc(sizeof(float) * V);
    CHECKF(opt_forward(m, kv_batch, steps, NS, batch, &err) == 0, "%s", err.msg);
    int row = 0;
    for (int s = 0; s < NS; s++) {
        CHECK(run_one(m, kv_solo, tokens[s], fresh[s], cached[s], tables[s], 8,
                      want[s] ? solo : NULL, &err) == 0);
        if (!want[s]) continue;
        double d = max_diff_ff(batch + (size_t)row++ * V, solo, V);
        CHECKF(d < 1e-5, "%s: batched seq %d vs alone: max diff %g", name, s, d);
    }
    /* One more decode token for every sequence, batched again: the KV the
     * batched step wrote (including the sequence without logits) is right. */
    for (int s = 0; s < NS; s++)
        steps[s] = (opt_seq_step){
            tokens[s] + cached[s] + fresh[s], 1, cached[s] + fresh[s], tables[s], 8, true};
    CHECK(opt_forward(m, kv_batch, steps, NS, batch, &err) == 0);
    double *ref = malloc(sizeof(double) * 20 * V);
    for (int s = 0; s < NS; s++) {
        const int n = cached[s] + fresh[s] + 1;
        ref_forward(tm, tokens[s], n, ref);
        double d = max_diff_fd(batch + (size_t)s * V, ref + (size_t)(n - 1) * V, V);
        CHECKF(d < 1e-4, "%s: batched decode seq %d vs reference: max diff %g", name, s, d);
    }
    free(ref);
    free(batch), free(solo);
    opt_kv_storage_free(kv_batch);
    opt_kv_storage_free(kv_solo);
}

/* Steps queued ahead (opt_forward_queue / opt_forward_wait): greedy decode
 * of three sequences with each step chained to the picks of the step before
 * it, queued before that step is waited for, gives the picks of plain
 * steps. The rows are reordered twice (a chain that is not row for row)
 * and one step gives one sequence its token from the host. */
static void test_queued(opt_model *m, const test_model *tm, const char *name) {
    enum { NS = 3, D = 12 };
    const int V = tm->cfg.vocab_size, bs = 4, nb = NS * 8;
    const int plen[NS] = {5, 9, 3};
    int32_t ref[NS][32], got[NS][32], tables[NS][8], ids[NS], chain[NS];
    int ord[D][NS];
    pd_err err;
    for (int s = 0; s < NS; s++) {
        for (int i = 0; i < plen[s]; i++) ref[s][i] = got[s][i] = (int32_t)(urand() % (uint32_t)V);
        for (int b = 0; b < 8; b++) tables[s][b] = s * 8 + b;
    }
    opt_kv_storage *kv_ref, *kv_q;
    CHECK(opt_kv_storage_create(m, nb, bs, &kv_ref, &err) == 0);
    CHECK(opt_kv_storage_create(m, nb, bs, &kv_q, &err) == 0);
    opt_seq_step st[NS];
    /* Plain steps: pick d of sequence s is ref[s][plen[s] + d]. */
    for (int d = 0; d < D; d++) {
        for (int s = 0; s < NS; s++)
            st[s] = d == 0 ? (opt_seq_step){ref[s], plen[s], 0, tables[s], 8, true}
                           : (opt_seq_step){ref[s] + plen[s] + d - 1, 1, plen[s] + d - 1, tables[s], 8, true};
        CHECKF(opt_forward_ex(m, kv_ref, st, NS, NULL, ids, NULL, &err) == 0, "%s", err.msg);
        for (int s = 0; s < NS; s++) ref[s][plen[s] + d] = ids[s];
    }
    /* Queued: the prefill, then each decode step queued before the one
     * before it is waited for. */
    for (int s = 0; s < NS; s++) {
        ord[0][s] = s;
        st[s] = (opt_seq_step){got[s], plen[s], 0, tables[s], 8, true};
    }
    CHECKF(opt_forward_queue(m, kv_q, st, NS, NULL, NULL, &err) == 0, "%s", err.msg);
    for (int k = 1; k <= D; k++) {
        if (k < D) {
            for (int i = 0; i < NS; i++) /* reversed at steps 4 and 9 */
                ord[k][i] = (k == 4 || k == 9) ? ord[k - 1][NS - 1 - i] : ord[k - 1][i];
            for (int i = 0; i < NS; i++) {
                const int s = ord[k][i], pos = plen[s] + k - 1;
                st[i] = (opt_seq_step){NULL, 1, pos, tables[s], 8, true};
                for (int j = 0; j < NS; j++)
                    if (ord[k - 1][j] == s) chain[i] = j;
                if (k == 6 && s == 1) { /* this one's token from the host */
                    chain[i] = -1;
                    st[i].tokens = &ref[s][pos];
                }
            }
            CHECKF(opt_forward_queue(m, kv_q, st, NS, NULL, chain, &err) == 0, "%s: step %d: %s", name,
                   k, err.msg);
            if (k == 1) { /* two queued: a third is refused */
                CHECK(opt_forward_queue(m, kv_q, st, NS, NULL, chain, &err) != 0);
                CHECK(strstr(err.msg, "two steps") != NULL);
            }
        }
        CHECKF(opt_forward_wait(m, ids, &err) == 0, "%s", err.msg);
        for (int i = 0; i < NS; i++) got[ord[k - 1][i]][plen[ord[k - 1][i]] + k - 1] = ids[i];
    }
    for (int s = 0; s < NS; s++)
        for (int d = 0; d < D; d++)
            CHECKF(got[s][plen[s] + d] == ref[s][plen[s] + d], "%s: queued pick %d of seq %d: %d, plain %d",
                   name, d, s, got[s][plen[s] + d], ref[s][plen[s] + d]);
    /* Misuse is an error, not a crash. */
    CHECK(opt_forward_wait(m, ids, &err) != 0);
    CHECK(strstr(err.msg, "no queued step") != NULL);
    chain[0] = NS; /* the last step had NS rows: out of range */
    chain[1] = chain[2] = -1;
    for (int s = 0; s < NS; s++) st[s] = (opt_seq_step){&ref[s][plen[s] + D - 1], 1, plen[s] + D - 1, tables[s], 8, true};
    CHECK(opt_forward_queue(m, kv_q, st, NS, NULL, chain, &err) != 0);
    CHECK(strstr(err.msg, "chains row") != NULL);
    CHECK(opt_forward_ex(m, kv_q, st, NS, NULL, ids, NULL, &err) == 0);
    chain[0] = 0; /* after a plain step there is no queued step to chain */
    CHECK(opt_forward_queue(m, kv_q, st, NS, NULL, chain, &err) != 0);
    CHECK(strstr(err.msg, "no step before") != NULL);
    st[0].want_logits = false;
    CHECK(opt_forward_queue(m, kv_q, st, NS, NULL, NULL, &err) != 0);
    CHECK(strstr(err.msg, "wants no logits") != NULL);
    opt_kv_storage_free(kv_ref);
    opt_kv_storage_free(kv_q);
}

static void test_validation(opt_model *m) {
    pd_err err;
    opt_kv_storage *kv;
    CHECK(opt_kv_storage_create(m, 4, 8, &kv, &err) == 0);
    CHECK(opt_kv_block_bytes(m, 8) == 2 * 2 * 8 * 32 * sizeof(float));
    CHECK(opt_kv_num_blocks(kv) == 4 && opt_kv_block_size(kv) == 8);
    int32_t toks[70] = {0}, table[9] = {0, 1, 2, 3, 0, 0, 0, 0, 0};
    float logits[97];
    opt_seq_step s = {toks, 9, 0, table, 1, true};
    CHECK(opt_forward(m, kv, &s, 1, logits, &err) == -1 && strstr(err.msg, "blocks"));
    s.n_blocks = 2;
    table[1] = 4;
    CHECK(opt_forward(m, kv, &s, 1, logits, &err) == -1 && strstr(err.msg, "block_table[1]"));
    table[1] = 1;
    toks[3] = 97;
    CHECK(opt_forward(m, kv, &s, 1, logits, &err) == -1 && strstr(err.msg, "id 97"));
    toks[3] = -1;
    CHECK(opt_forward(m, kv, &s, 1, logits, &err) == -1 && strstr(err.msg, "id -1"));
    toks[3] = 5;
    s = (opt_seq_step){toks, 2, 63, table, 9, true}; /* positions 63, 64: past 64 */
    CHECK(opt_forward(m, kv, &s, 1, logits, &err) == -1 &&
          strstr(err.msg, "max_position_embeddings"));
    s = (opt_seq_step){toks, 3, 0, table, 1, true};
    CHECK(opt_forward(m, kv, &s, 1, NULL, &err) == -1 && strstr(err.msg, "logits"));
    s.n_tokens = 0;
    CHECK(opt_forward(m, kv, &s, 1, logits, &err) == -1 && strstr(err.msg, "no new tokens"));
    CHECK(opt_forward(m, kv, &s, 0, logits, &err) == 0); /* an empty step is fine */
    opt_kv_storage_free(kv);
}

static void test_bad_weights(pd_backend *be) {
    test_model tm;
    test_model_build(&tm, &KINDS[0]);
    pd_err err;
    opt_model *m;
    tm.w.layers[1].fc1_w.rows = 63;
    CHECK(opt_model_create(&tm.cfg, &tm.w, be, &m, &err) == -1 &&
          strstr(err.msg, "layers.1.fc1.weight") && strstr(err.msg, "[63,32]"));
    tm.w.layers[1].fc1_w.rows = 64;
    tm.w.layers[0].q_b.data = NULL;
    CHECK(opt_model_create(&tm.cfg, &tm.w, be, &m, &err) == -1 &&
          strstr(err.msg, "layers.0.q_proj.bias") && strstr(err.msg, "missing"));
    test_model_free(&tm);
}

int main(void) {
    pd_err err;
    const int threads[] = {2, 3, 1};
    for (size_t k = 0; k < sizeof KINDS / sizeof *KINDS; k++) {
        pd_backend *be;
        CHECKF(pd_backend_create("cpu", threads[k], &be, &err) == 0, "%s", err.msg);
        test_model tm;
        test_model_build(&tm, &KINDS[k]);
        opt_model *m;
        int rc = opt_model_create(&tm.cfg, &tm.w, be, &m, &err);
        CHECKF(rc == 0, "%s: %s", KINDS[k].name, err.msg);
        if (rc == 0) {
            test_prefill_vs_reference(m, &tm, KINDS[k].name);
            test_chunked_and_decode(m, &tm, KINDS[k].name);
            test_batched(m, &tm, KINDS[k].name);
            test_queued(m, &tm, KINDS[k].name);
            if (k == 0) test_validation(m);
            opt_model_free(m);
        }
        if (k == 0) test_bad_weights(be);
        test_model_free(&tm);
        pd_backend_destroy(be);
    }
    return test_finish();
}
