/* test_cuda_ops: every op of the CUDA backend against the CPU backend (the
 * reference) on the same random inputs.
 *
 * Each case uploads the same host data to both backends, runs the op on
 * both, downloads both results and compares them: the largest absolute
 * difference divided by the largest magnitude of the CPU result must stay
 * under the variant's tolerance (1e-4 for "cuda" = fp32; looser for the
 * 16-bit storage variants, whose inputs are rounded on upload). Covered:
 * GEMM (T = 1, 3, 17, 64, 257; odd in/out; bias or not; strided x), layer
 * norm (affine or not, in place), the four activations, add, embedding
 * (offset, accumulate), gather_rows, kv_write (scattered slots, strided
 * rows), and paged attention (block sizes 1/16/32, head_dim 8/64/80/128,
 * sequences of different lengths mixing decode and prefill, scrambled
 * block tables; prefill-shaped steps of up to 700 new tokens per sequence
 * after cached prefixes, which the 16-bit variants run on the tensor-core
 * kernel, with head_dim 40 for the fallback; decode-only steps; one
 * 2048-token prompt at opt-125m's 12 heads x 64, timed and printed), and
 * the fused linear op against the CPU's ops one at a time (T = 1..300
 * across the single-kernel limit of 8; OPT shapes and odd ones; every
 * combination of layer norm, activation, accumulate and bias; strided x).
 * Plus the error paths: an unknown variant, a missing device, an
 * impossible allocation. Last, timings of the linear op at decode sizes
 * (printed, not asserted) from CUDA graphs, which also checks that the op
 * can be captured.
 *
 * Without a GPU (or without the CUDA build) it prints why and passes: the
 * test carries the ctest label gpu and is meant for the GPU machine. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/pd_common.h"
#include "model/backend.h"
#include "model/sampler.h"
#include "tests/common/testlib.h"

#ifdef PDSERVE_HAVE_CUDA
#include "model/cuda/cuda_backend.h"

static uint64_t rng = 0x2545f4914f6cdd1dull;
static uint32_t urand(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)(rng >> 32);
}
static float frand(float lo, float hi) {
    return lo + (hi - lo) * ((float)urand() / 4294967296.0f);
}
static float *rand_vec(size_t n, float lo, float hi) {
    float *v = malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++)
        v[i] = frand(lo, hi);
    return v;
}

/* The backend under test and the reference, side by side. */
typedef struct pair {
    pd_backend *cpu, *gpu;
    const char *variant;
    double tol;
} pair;

/* Host fp32 data into backend memory (converted to the backend's dtype). */
static void *up_f32(pd_backend *be, const float *h, size_t n) {
    pd_err err;
    void *d = be->alloc(be, (n ? n : 1) * be->elem_size, &err);
    CHECKF(d != NULL, "%s", err.msg);
    pd_view v = {h, PD_F32, 1, (int64_t)n};
    if (d && n) CHECKF(be->upload_view(be, d, &v, &err) == 0, "%s", err.msg);
    return d;
}
static int32_t *up_i32(pd_backend *be, const int32_t *h, size_t n) {
    pd_err err;
    int32_t *d = be->alloc(be, (n ? n : 1) * sizeof(int32_t), &err);
    CHECKF(d != NULL, "%s", err.msg);
    if (d && n) CHECKF(be->copy_h2d(be, d, h, n * sizeof(int32_t), &err) == 0, "%s", err.msg);
    return d;
}
static float *down(pd_backend *be, const void *d, size_t n) {
    pd_err err;
    float *h = calloc(n ? n : 1, sizeof(float));
    CHECKF(be->download_f32(be, h, d, n, &err) == 0, "%s: %s", be->name, err.msg);
    return h;
}

/* Download both results and compare them (see the file comment). */
static void compare(const pair *p, const char *what, const void *dc, const void *dg, size_t n) {
    float *c = down(p->cpu, dc, n), *g = down(p->gpu, dg, n);
    double max_diff = 0, max_ref = 0;
    size_t worst = 0;
    int nan = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(g[i]) != isnan(c[i])) nan = 1;
        const double d = fabs((double)c[i] - g[i]);
        if (d > max_diff) max_diff = d, worst = i;
        if (fabs(c[i]) > max_ref) max_ref = fabs(c[i]);
    }
    const double rel = max_diff / (max_ref > 1e-30 ? max_ref : 1e-30);
    CHECKF(!nan && rel <= p->tol,
           "%s %s: max diff %.3g at %zu (cpu %.7g gpu %.7g), rel %.3g > %.1g", p->variant, what,
           max_diff, worst, n ? c[worst] : 0.0, n ? g[worst] : 0.0, rel, p->tol);
    free(c);
    free(g);
}

static void sync_ok(const pair *p, const char *what) {
    pd_err err;
    CHECKF(p->gpu->sync(p->gpu, &err) == 0, "%s %s: %s", p->variant, what, err.msg);
}

/* ---- GEMM ---- */

static void test_gemm(const pair *p) {
    const int Ts[] = {1, 3, 17, 64, 257};
    const int shapes[][2] = {{1, 1}, {7, 13}, {64, 192}, {80, 257}, {300, 33}};
    int k = 0;
    for (size_t a = 0; a < sizeof Ts / sizeof Ts[0]; a++)
        for (size_t b = 0; b < sizeof shapes / sizeof shapes[0]; b++, k++) {
            const int T = Ts[a], in = shapes[b][0], out = shapes[b][1];
            const int stride = in + (k % 3 == 0 ? 5 : 0), with_bias = k % 2;
            float *x = rand_vec((size_t)T * stride, -1, 1);
            float *w = rand_vec((size_t)out * in, -1, 1);
            float *bias = rand_vec((size_t)out, -1, 1);
            void *xc = up_f32(p->cpu, x, (size_t)T * stride),
                 *xg = up_f32(p->gpu, x, (size_t)T * stride);
            void *wc = up_f32(p->cpu, w, (size_t)out * in),
                 *wg = up_f32(p->gpu, w, (size_t)out * in);
            void *bc = up_f32(p->cpu, bias, out), *bg = up_f32(p->gpu, bias, out);
            pd_err err;
            void *yc = p->cpu->alloc(p->cpu, (size_t)T * out * p->cpu->elem_size, &err);
            void *yg = p->gpu->alloc(p->gpu, (size_t)T * out * p->gpu->elem_size, &err);
            p->cpu->gemm(p->cpu, yc, xc, stride, wc, with_bias ? bc : NULL, T, in, out);
            p->gpu->gemm(p->gpu, yg, xg, stride, wg, with_bias ? bg : NULL, T, in, out);
            sync_ok(p, "gemm");
            char what[96];
            snprintf(what, sizeof what, "gemm T=%d in=%d out=%d stride=%d bias=%d", T, in, out,
                     stride, with_bias);
            compare(p, what, yc, yg, (size_t)T * out);
            void *ptrs[][2] = {{xc, xg}, {wc, wg}, {bc, bg}, {yc, yg}};
            for (int i = 0; i < 4; i++) {
                p->cpu->free(p->cpu, ptrs[i][0]);
                p->gpu->free(p->gpu, ptrs[i][1]);
            }
            free(x), free(w), free(bias);
        }
}

/* ---- layer norm, activation, add ---- */

static void test_layer_norm(const pair *p) {
    const int shapes[][2] = {{1, 1}, {3, 7}, {33, 80}, {5, 768}, {2, 1000}, {17, 4097}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (int mode = 0; mode < 3; mode++) { /* 0: affine, 1: plain, 2: affine in place */
            const int rows = shapes[s][0], dim = shapes[s][1];
            const size_t n = (size_t)rows * dim;
            float *x = rand_vec(n, -3, 5), *w = rand_vec(dim, 0.5f, 1.5f),
                  *b = rand_vec(dim, -1, 1);
            void *xc = up_f32(p->cpu, x, n), *xg = up_f32(p->gpu, x, n);
            void *wc = up_f32(p->cpu, w, dim), *wg = up_f32(p->gpu, w, dim);
            void *bc = up_f32(p->cpu, b, dim), *bg = up_f32(p->gpu, b, dim);
            void *yc = mode == 2 ? xc : up_f32(p->cpu, x, n);
            void *yg = mode == 2 ? xg : up_f32(p->gpu, x, n);
            p->cpu->layer_norm(p->cpu, yc, xc, mode == 1 ? NULL : wc, mode == 1 ? NULL : bc, rows,
                               dim, 1e-5f);
            p->gpu->layer_norm(p->gpu, yg, xg, mode == 1 ? NULL : wg, mode == 1 ? NULL : bg, rows,
                               dim, 1e-5f);
            sync_ok(p, "layer_norm");
            char what[80];
            snprintf(what, sizeof what, "layer_norm rows=%d dim=%d mode=%d", rows, dim, mode);
            compare(p, what, yc, yg, n);
            if (mode != 2) p->cpu->free(p->cpu, yc), p->gpu->free(p->gpu, yg);
            p->cpu->free(p->cpu, xc), p->gpu->free(p->gpu, xg);
            p->cpu->free(p->cpu, wc), p->gpu->free(p->gpu, wg);
            p->cpu->free(p->cpu, bc), p->gpu->free(p->gpu, bg);
            free(x), free(w), free(b);
        }
}

static void test_elementwise(const pair *p) {
    const size_t sizes[] = {1, 1000, 70001};
    const pd_activation acts[] = {PD_ACT_RELU, PD_ACT_GELU, PD_ACT_GELU_NEW, PD_ACT_SILU};
    for (size_t s = 0; s < 3; s++) {
        const size_t n = sizes[s];
        for (int a = 0; a < 4; a++) {
            float *x = rand_vec(n, -4, 4);
            void *xc = up_f32(p->cpu, x, n), *xg = up_f32(p->gpu, x, n);
            p->cpu->activation(p->cpu, xc, n, acts[a]);
            p->gpu->activation(p->gpu, xg, n, acts[a]);
            sync_ok(p, "activation");
            char what[64];
            snprintf(what, sizeof what, "activation %d n=%zu", (int)acts[a], n);
            compare(p, what, xc, xg, n);
            p->cpu->free(p->cpu, xc), p->gpu->free(p->gpu, xg);
            free(x);
        }
        float *x = rand_vec(n, -2, 2), *y = rand_vec(n, -2, 2);
        void *xc = up_f32(p->cpu, x, n), *xg = up_f32(p->gpu, x, n);
        void *yc = up_f32(p->cpu, y, n), *yg = up_f32(p->gpu, y, n);
        p->cpu->add(p->cpu, yc, xc, n);
        p->gpu->add(p->gpu, yg, xg, n);
        char what[64];
        snprintf(what, sizeof what, "add n=%zu", n);
        compare(p, what, yc, yg, n);
        p->cpu->free(p->cpu, xc), p->gpu->free(p->gpu, xg);
        p->cpu->free(p->cpu, yc), p->gpu->free(p->gpu, yg);
        free(x), free(y);
    }
}

/* ---- embedding, gather_rows, kv_write ---- */

static void test_rows(const pair *p) {
    /* embedding: assign then accumulate, with the position table's offset of 2 */
    const int V = 50, dim = 80, rows = 23;
    float *table = rand_vec((size_t)V * dim, -1, 1), *y0 = rand_vec((size_t)rows * dim, -1, 1);
    int32_t idx[23];
    for (int t = 0; t < rows; t++)
        idx[t] = (int32_t)(urand() % (V - 2));
    void *tc = up_f32(p->cpu, table, (size_t)V * dim), *tg = up_f32(p->gpu, table, (size_t)V * dim);
    int32_t *ic = up_i32(p->cpu, idx, rows), *ig = up_i32(p->gpu, idx, rows);
    void *yc = up_f32(p->cpu, y0, (size_t)rows * dim), *yg = up_f32(p->gpu, y0, (size_t)rows * dim);
    p->cpu->embedding(p->cpu, yc, tc, ic, 0, rows, dim, 0);
    p->gpu->embedding(p->gpu, yg, tg, ig, 0, rows, dim, 0);
    compare(p, "embedding", yc, yg, (size_t)rows * dim);
    p->cpu->embedding(p->cpu, yc, tc, ic, 2, rows, dim, 1);
    p->gpu->embedding(p->gpu, yg, tg, ig, 2, rows, dim, 1);
    compare(p, "embedding offset 2 accumulate", yc, yg, (size_t)rows * dim);
    /* embedding_sum: the GPU's one launch against the CPU's two calls
     * (token rows idx, position rows idx2 + 2), the sum rounded once */
    if (p->gpu->embedding_sum) {
        int32_t idx2[23];
        for (int t = 0; t < rows; t++)
            idx2[t] = (int32_t)(urand() % (V - 2));
        int32_t *i2c = up_i32(p->cpu, idx2, rows), *i2g = up_i32(p->gpu, idx2, rows);
        p->cpu->embedding(p->cpu, yc, tc, ic, 0, rows, dim, 0);
        p->cpu->embedding(p->cpu, yc, tc, i2c, 2, rows, dim, 1);
        p->gpu->embedding_sum(p->gpu, yg, tg, ig, tg, i2g, 2, rows, dim);
        compare(p, "embedding_sum", yc, yg, (size_t)rows * dim);
        p->cpu->free(p->cpu, i2c), p->gpu->free(p->gpu, i2g);
    } else {
        CHECK(0 && "the CUDA backend has embedding_sum");
    }

    /* gather_rows: 17 rows of a [V, dim] matrix, with repeats */
    int32_t pick[17];
    for (int i = 0; i < 17; i++)
        pick[i] = (int32_t)(urand() % V);
    int32_t *pc = up_i32(p->cpu, pick, 17), *pg = up_i32(p->gpu, pick, 17);
    p->cpu->gather_rows(p->cpu, yc, tc, pc, 17, dim);
    p->gpu->gather_rows(p->gpu, yg, tg, pg, 17, dim);
    compare(p, "gather_rows", yc, yg, (size_t)17 * dim);

    /* kv_write: 20 tokens' k and v (rows 3*kv_dim apart, as in the fused qkv
     * buffer) into distinct scattered slots of a prefilled cache */
    const int slots = 64, kv_dim = 48, T = 20, stride = 3 * kv_dim;
    float *kc0 = rand_vec((size_t)slots * kv_dim, -1, 1),
          *vc0 = rand_vec((size_t)slots * kv_dim, -1, 1);
    float *qkv = rand_vec((size_t)T * stride, -1, 1);
    int32_t perm[64], slot_map[20];
    for (int i = 0; i < slots; i++)
        perm[i] = i;
    for (int i = slots - 1; i > 0; i--) {
        int j = (int)(urand() % (uint32_t)(i + 1)), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    memcpy(slot_map, perm, sizeof slot_map);
    void *kcc = up_f32(p->cpu, kc0, (size_t)slots * kv_dim),
         *kcg = up_f32(p->gpu, kc0, (size_t)slots * kv_dim);
    void *vcc = up_f32(p->cpu, vc0, (size_t)slots * kv_dim),
         *vcg = up_f32(p->gpu, vc0, (size_t)slots * kv_dim);
    void *qc = up_f32(p->cpu, qkv, (size_t)T * stride),
         *qg = up_f32(p->gpu, qkv, (size_t)T * stride);
    int32_t *sc = up_i32(p->cpu, slot_map, T), *sg = up_i32(p->gpu, slot_map, T);
    pd_step_meta mc = {.n_tokens = T, .slot_mapping = sc}, mg = {.n_tokens = T, .slot_mapping = sg};
    const size_t es_c = p->cpu->elem_size, es_g = p->gpu->elem_size;
    p->cpu->kv_write(p->cpu, kcc, vcc, (char *)qc + kv_dim * es_c, (char *)qc + 2 * kv_dim * es_c,
                     stride, &mc, kv_dim);
    p->gpu->kv_write(p->gpu, kcg, vcg, (char *)qg + kv_dim * es_g, (char *)qg + 2 * kv_dim * es_g,
                     stride, &mg, kv_dim);
    sync_ok(p, "kv_write");
    compare(p, "kv_write k cache", kcc, kcg, (size_t)slots * kv_dim);
    compare(p, "kv_write v cache", vcc, vcg, (size_t)slots * kv_dim);

    void *ptrs[][2] = {{tc, tg},   {ic, ig},   {yc, yg}, {pc, pg},
                       {kcc, kcg}, {vcc, vcg}, {qc, qg}, {sc, sg}};
    for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) {
        p->cpu->free(p->cpu, ptrs[i][0]);
        p->gpu->free(p->gpu, ptrs[i][1]);
    }
    free(table), free(y0), free(kc0), free(vc0), free(qkv);
}

/* ---- paged attention ---- */

/* One sequence of a step: tokens already in the cache, then new tokens. */
typedef struct attn_seq {
    int cached, fresh;
} attn_seq;

/* Mixes a first decode token, a prefill chunk after a cached prefix, a whole
 * prompt, a decode step deep in a sequence, and a one-token prompt. Its
 * longest sequence has 70 new tokens, so 16-bit variants take the
 * tensor-core (flash) kernel for every sequence of the step. */
static const attn_seq attn_mixed[] = {{0, 1}, {12, 5}, {0, 70}, {40, 1}, {0, 1}, {33, 31}};
/* Prefill-shaped: whole prompts and chunks after a prefix (start 5, 64, 333:
 * not tile-aligned, and tile-aligned), partial and exact query tiles (17,
 * 200, 64, 16 and 700 new tokens), and decodes riding along. */
static const attn_seq attn_prefill[] = {{0, 200}, {5, 17},  {0, 1}, {333, 700},
                                        {40, 1},  {64, 64}, {0, 16}};
/* Decode only (one new token each): the context-split decode kernel in every
 * variant; the long contexts cross its 256-position parts. */
static const attn_seq attn_decode[] = {{0, 1},   {40, 1},   {150, 1}, {5, 1},
                                       {254, 1}, {255, 1},  {256, 1}, {1000, 1}};
/* One 2048-token prompt: the speed figure (opt-125m: 12 heads x 64). */
static const attn_seq attn_long[] = {{0, 2048}};
#define NSEQ(a) ((int)(sizeof a / sizeof a[0]))

/* Runs one paged_attention call on both backends and compares the outputs.
 * time_iters > 0 also times that many back-to-back GPU calls between two
 * syncs (the stream is the backend's own, so host time around a full queue
 * is what a layer costs) and prints the figure. */
/* write_new: the step's k and v (the q buffer's k and v thirds) are written
 * with kv_write right before the attention, as opt.c does (the CUDA backend
 * then fuses the write into a pure decode step's attention kernel); the
 * caches are compared too. */
static void attention_case_w(const pair *p, const char *set, const attn_seq *seqs, int n_seqs,
                             int bs, int heads, int hd, int time_iters, int write_new) {
    int T = 0, max_blocks = 0, total_blocks = 0, max_q = 0;
    for (int s = 0; s < n_seqs; s++) {
        const int len = seqs[s].cached + seqs[s].fresh, nb = (len + bs - 1) / bs;
        T += seqs[s].fresh;
        total_blocks += nb;
        if (nb > max_blocks) max_blocks = nb;
        if (seqs[s].fresh > max_q) max_q = seqs[s].fresh;
    }
    const int num_blocks = total_blocks + 3; /* some blocks belong to no one */
    int32_t *perm = malloc(sizeof(int32_t) * (size_t)num_blocks);
    for (int i = 0; i < num_blocks; i++)
        perm[i] = i;
    for (int i = num_blocks - 1; i > 0; i--) { /* scrambled block tables */
        int j = (int)(urand() % (uint32_t)(i + 1)), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)T), *seq = malloc(sizeof(int32_t) * (size_t)T);
    int32_t *tables = malloc(sizeof(int32_t) * (size_t)(n_seqs * max_blocks));
    int32_t *lens = malloc(sizeof(int32_t) * (size_t)n_seqs);
    int32_t *q_start = malloc(sizeof(int32_t) * (size_t)(n_seqs + 1));
    int32_t *slots = malloc(sizeof(int32_t) * (size_t)(T ? T : 1));
    int t = 0, next = 0;
    for (int s = 0; s < n_seqs; s++) {
        const int len = seqs[s].cached + seqs[s].fresh, nb = (len + bs - 1) / bs;
        for (int b = 0; b < max_blocks; b++)
            tables[s * max_blocks + b] = b < nb ? perm[next++] : -1;
        q_start[s] = t;
        for (int j = 0; j < seqs[s].fresh; j++, t++) {
            pos[t] = seqs[s].cached + j;
            seq[t] = s;
            slots[t] = tables[s * max_blocks + pos[t] / bs] * bs + pos[t] % bs;
        }
        lens[s] = len;
    }
    q_start[n_seqs] = T;
    const size_t row = (size_t)heads * hd, cache_n = (size_t)num_blocks * bs * row;
    const int q_stride = 3 * (int)row;
    float *kc = rand_vec(cache_n, -1, 1), *vc = rand_vec(cache_n, -1, 1);
    float *q = rand_vec((size_t)T * q_stride, -2, 2); /* peaky enough to move the max often */
    pd_backend *be[2] = {p->cpu, p->gpu};
    void *dk[2], *dv[2], *dq[2], *dout[2];
    int32_t *dpos[2], *dseq[2], *dtab[2], *dlen[2], *dqs[2], *dslot[2];
    pd_step_meta m[2];
    const float scale = 1.0f / sqrtf((float)hd);
    for (int i = 0; i < 2; i++) {
        pd_err err;
        dk[i] = up_f32(be[i], kc, cache_n);
        dv[i] = up_f32(be[i], vc, cache_n);
        dq[i] = up_f32(be[i], q, (size_t)T * q_stride);
        dout[i] = be[i]->alloc(be[i], (size_t)T * row * be[i]->elem_size, &err);
        dpos[i] = up_i32(be[i], pos, T);
        dseq[i] = up_i32(be[i], seq, T);
        dtab[i] = up_i32(be[i], tables, (size_t)n_seqs * max_blocks);
        dlen[i] = up_i32(be[i], lens, n_seqs);
        dqs[i] = up_i32(be[i], q_start, (size_t)n_seqs + 1);
        dslot[i] = up_i32(be[i], slots, (size_t)T);
        m[i] = (pd_step_meta){.n_tokens = T,
                              .slot_mapping = dslot[i],
                              .n_seqs = n_seqs,
                              .max_blocks = max_blocks,
                              .positions = dpos[i],
                              .token_seq = dseq[i],
                              .block_tables = dtab[i],
                              .seq_lens = dlen[i],
                              .seq_q_start = dqs[i],
                              .max_q_len = max_q};
        if (write_new)
            be[i]->kv_write(be[i], dk[i], dv[i], (char *)dq[i] + row * be[i]->elem_size,
                            (char *)dq[i] + 2 * row * be[i]->elem_size, q_stride, &m[i], (int)row);
        be[i]->paged_attention(be[i], dout[i], dq[i], q_stride, dk[i], dv[i], &m[i], heads, hd, bs,
                               scale);
    }
    sync_ok(p, "paged_attention");
    char what[128];
    snprintf(what, sizeof what, "paged_attention %s%s bs=%d heads=%d head_dim=%d (T=%d)", set,
             write_new ? " after kv_write" : "", bs, heads, hd, T);
    compare(p, what, dout[0], dout[1], (size_t)T * row);
    if (write_new) {
        compare(p, "k cache after kv_write + attention", dk[0], dk[1], cache_n);
        compare(p, "v cache after kv_write + attention", dv[0], dv[1], cache_n);
    }
    if (time_iters < 0) { /* -n: n calls captured into one CUDA graph, as a decode step runs */
        pd_backend *g = p->gpu;
        pd_err err;
        void *graph = NULL;
        const int calls = -time_iters, reps = 10;
        int ok = g->graph_begin(g, &err) == 0;
        for (int k = 0; ok && k < calls; k++) {
            if (write_new)
                g->kv_write(g, dk[1], dv[1], (char *)dq[1] + row * g->elem_size,
                            (char *)dq[1] + 2 * row * g->elem_size, q_stride, &m[1], (int)row);
            g->paged_attention(g, dout[1], dq[1], q_stride, dk[1], dv[1], &m[1], heads, hd, bs,
                               scale);
        }
        ok = ok && g->graph_end(g, &graph, &err) == 0 && g->graph_launch(g, graph, &err) == 0 &&
             g->sync(g, &err) == 0;
        const double t0 = pd_now();
        for (int r = 0; ok && r < reps; r++)
            ok = g->graph_launch(g, graph, &err) == 0;
        ok = ok && g->sync(g, &err) == 0;
        CHECKF(ok, "%s: graph timing: %s", what, err.msg);
        if (ok)
            printf("%s: %s: %.2f us a call in a CUDA graph (mean of %d)\n", p->variant, what,
                   (pd_now() - t0) * 1e6 / (reps * calls), reps * calls);
        if (graph) g->graph_free(g, graph);
    }
    if (time_iters > 0) {
        pd_backend *g = p->gpu;
        const double t0 = pd_now();
        for (int k = 0; k < time_iters; k++)
            g->paged_attention(g, dout[1], dq[1], q_stride, dk[1], dv[1], &m[1], heads, hd, bs,
                               scale);
        sync_ok(p, "paged_attention timing");
        const double ms = (pd_now() - t0) * 1e3 / time_iters;
        printf("%s: %s: %.3f ms per layer, %.2f ms for 12 layers (mean of %d calls)\n", p->variant,
               what, ms, 12 * ms, time_iters);
    }
    for (int i = 0; i < 2; i++) {
        void *ptrs[] = {dk[i],   dv[i],   dq[i],   dout[i], dpos[i],
                        dseq[i], dtab[i], dlen[i], dqs[i],  dslot[i]};
        for (int k = 0; k < 10; k++)
            be[i]->free(be[i], ptrs[k]);
    }
    free(perm), free(pos), free(seq), free(tables), free(lens), free(q_start), free(slots), free(kc),
        free(vc), free(q);
}

static void attention_case(const pair *p, const char *set, const attn_seq *seqs, int n_seqs, int bs,
                           int heads, int hd, int time_iters) {
    attention_case_w(p, set, seqs, n_seqs, bs, heads, hd, time_iters, 0);
}

static void test_attention(const pair *p) {
    const int block_sizes[] = {1, 16, 32};
    const int dims[][2] = {{3, 64}, {2, 80}, {4, 8}, {1, 128}}; /* heads, head_dim */
    for (int b = 0; b < 3; b++)
        for (int d = 0; d < 4; d++)
            attention_case(p, "mixed", attn_mixed, NSEQ(attn_mixed), block_sizes[b], dims[d][0],
                           dims[d][1], 0);
    /* head_dim 64, 80, 128 take the flash kernel in 16 bits; 40 (not a
     * multiple of 16) and every fp32 call keep the warp kernel. */
    const int prefill_dims[][2] = {{4, 64}, {3, 80}, {2, 128}, {2, 40}};
    for (int b = 0; b < 3; b++)
        for (int d = 0; d < 4; d++)
            attention_case(p, "prefill", attn_prefill, NSEQ(attn_prefill), block_sizes[b],
                           prefill_dims[d][0], prefill_dims[d][1], 0);
    for (int b = 0; b < 3; b++) {
        attention_case(p, "decode", attn_decode, NSEQ(attn_decode), block_sizes[b], 3, 64, 0);
        attention_case(p, "decode", attn_decode, NSEQ(attn_decode), block_sizes[b], 1, 128, 0);
        attention_case_w(p, "decode", attn_decode, NSEQ(attn_decode), block_sizes[b], 3, 64, 0, 1);
        attention_case_w(p, "mixed", attn_mixed, NSEQ(attn_mixed), block_sizes[b], 2, 64, 0, 1);
    }
    attention_case(p, "prompt", attn_long, NSEQ(attn_long), 16, 12, 64, 20);
    /* A decode step at batch 256 (3,072 items of opt-125m's 12 heads, more
     * than one split-kernel launch used to take): contexts 64..963, some
     * over several 256-position parts; with the fused write, then timed. */
    attn_seq big[256];
    for (int s = 0; s < 256; s++)
        big[s] = (attn_seq){64 + (s * 53) % 900, 1};
    attention_case_w(p, "decode batch 256", big, 256, 16, 12, 64, 0, 1);
    attention_case(p, "decode batch 256", big, 256, 16, 12, 64, 20);
    /* Batch-1 decode of opt-125m (12 heads x 64) at two contexts, the fused
     * write included, timed in a graph (printed, not asserted). */
    const attn_seq one_short[] = {{199, 1}}, one_long[] = {{1999, 1}};
    attention_case_w(p, "decode batch 1", one_short, 1, 16, 12, 64, -64, 1);
    attention_case_w(p, "decode batch 1", one_long, 1, 16, 12, 64, -64, 1);
}

/* ---- linear: the fused op against the CPU ops one at a time ---- */

enum { LIN_LN = 1, LIN_ACT = 2, LIN_ACC = 4, LIN_BIAS = 8 };

/* What opt.c runs when a backend has no linear op (its helper linear(), restated):
 * the reference, and the unfused timing. */
static void ref_linear(pd_backend *be, void *y, const void *x, int x_stride, const void *w,
                       const void *bias, int T, int in, int out, const pd_linear_fuse *f) {
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

/* One linear call's buffers on one backend. */
typedef struct lin_dev {
    void *x, *w, *bias, *ln_w, *ln_b, *y, *ln_out, *tmp;
} lin_dev;

static void lin_dev_free(pd_backend *be, lin_dev *d) {
    void *ptrs[] = {d->x, d->w, d->bias, d->ln_w, d->ln_b, d->y, d->ln_out, d->tmp};
    for (int i = 0; i < 8; i++)
        be->free(be, ptrs[i]);
}

/* T x [in -> out] with the fusions in `fuse` (LIN_*); ln_plain: the layer
 * norm without affine weights; stride: x's row stride (>= in). */
static void linear_case(const pair *p, int T, int in, int out, int fuse, int ln_plain,
                        pd_activation act, int stride) {
    float *x = rand_vec((size_t)T * stride, -3, 5), *w = rand_vec((size_t)out * in, -1, 1);
    float *bias = rand_vec(out, -1, 1), *lnw = rand_vec(in, 0.5f, 1.5f);
    float *lnb = rand_vec(in, -1, 1), *y0 = rand_vec((size_t)T * out, -2, 2);
    pd_backend *be[2] = {p->cpu, p->gpu};
    lin_dev d[2];
    for (int i = 0; i < 2; i++) {
        pd_err err;
        d[i].x = up_f32(be[i], x, (size_t)T * stride);
        d[i].w = up_f32(be[i], w, (size_t)out * in);
        d[i].bias = up_f32(be[i], bias, out);
        d[i].ln_w = up_f32(be[i], lnw, in);
        d[i].ln_b = up_f32(be[i], lnb, in);
        d[i].y = up_f32(be[i], y0, (size_t)T * out);
        d[i].ln_out = be[i]->alloc(be[i], (size_t)T * in * be[i]->elem_size, &err);
        d[i].tmp = be[i]->alloc(be[i], (size_t)T * out * be[i]->elem_size, &err);
        const pd_linear_fuse f = {.layer_norm = (fuse & LIN_LN) != 0,
                                  .ln_w = ln_plain ? NULL : d[i].ln_w,
                                  .ln_b = ln_plain ? NULL : d[i].ln_b,
                                  .ln_eps = 1e-5f,
                                  .ln_out = d[i].ln_out,
                                  .activate = (fuse & LIN_ACT) != 0,
                                  .act = act,
                                  .accumulate = (fuse & LIN_ACC) != 0,
                                  .acc_tmp = d[i].tmp};
        const void *b = fuse & LIN_BIAS ? d[i].bias : NULL;
        if (i == 0)
            ref_linear(be[0], d[0].y, d[0].x, stride, d[0].w, b, T, in, out, &f);
        else
            be[1]->linear(be[1], d[1].y, d[1].x, stride, d[1].w, b, T, in, out, &f);
    }
    char what[128];
    snprintf(what, sizeof what, "linear T=%d %d->%d stride=%d%s%s%s%s%s", T, in, out, stride,
             fuse & LIN_LN ? (ln_plain ? " ln(plain)" : " ln") : "",
             fuse & LIN_ACT ? (act == PD_ACT_RELU ? " relu" : " gelu") : "",
             fuse & LIN_ACC ? " accumulate" : "", fuse & LIN_BIAS ? " bias" : "", "");
    sync_ok(p, what);
    compare(p, what, d[0].y, d[1].y, (size_t)T * out);
    for (int i = 0; i < 2; i++)
        lin_dev_free(be[i], &d[i]);
    free(x), free(w), free(bias), free(lnw), free(lnb), free(y0);
}

static void test_linear(const pair *p) {
    /* T on both sides of the single-kernel limit (8); OPT-125m's shapes and
     * odd ones (rows that are no multiple of 16 bytes: the scalar paths);
     * a long output (more tile blocks than the grid, as the LM head: the
     * small-T kernel's blocks then do several each). */
    const int Ts[] = {1, 2, 3, 8, 9, 64, 300};
    const int shapes[][2] = {{768, 2304}, {768, 3072}, {3072, 768}, {80, 200},
                             {83, 37},    {5, 9},      {64, 13001}};
    int k = 0;
    for (size_t a = 0; a < sizeof Ts / sizeof Ts[0]; a++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            const int T = Ts[a], in = shapes[s][0], out = shapes[s][1];
            /* Every combination where the case is cheap; else the model's
             * three (qkv: ln+bias, fc1: ln+act+bias, residual: acc+bias)
             * and one more that moves along the combinations. */
            const int small = (double)T * in * out <= 4e6;
            const int model[] = {LIN_LN | LIN_BIAS, LIN_LN | LIN_ACT | LIN_BIAS, LIN_ACC | LIN_BIAS,
                                 0};
            const int n = small ? 16 : 4;
            for (int c = 0; c < n; c++, k++) {
                const int fuse = small ? c : c < 3 ? model[c] : (k * 7) % 16;
                /* x's stride: dense, padded keeping 16-byte rows, or padded off them */
                const int stride = in + (k % 3 == 0 ? 0 : k % 3 == 1 ? 8 : 3);
                const pd_activation act = k % 5 == 4 ? PD_ACT_GELU : PD_ACT_RELU;
                linear_case(p, T, in, out, fuse, k % 4 == 3, act, stride);
            }
        }
}

static void test_linear_heads(const pair *p) {
    /* LM heads of one token (16-bit: the streaming GEMV kernel where the
     * input is a multiple of 256): opt-125m's with its final LN, with a
     * bias and a padded x, a plain LN (not the kernel's), opt-350m's after
     * project_out (no LN), opt-1.3b's input on the fewest outputs that
     * count as a head, and an input no multiple of 256 (not the kernel's). */
    linear_case(p, 1, 768, 50272, LIN_LN, 0, PD_ACT_RELU, 768);
    linear_case(p, 1, 768, 50272, LIN_LN | LIN_BIAS, 0, PD_ACT_RELU, 776);
    linear_case(p, 1, 768, 50272, LIN_LN, 1, PD_ACT_RELU, 768);
    linear_case(p, 1, 512, 50272, 0, 0, PD_ACT_RELU, 512);
    linear_case(p, 1, 2048, 16384, LIN_LN, 0, PD_ACT_RELU, 2048);
    linear_case(p, 1, 1000, 20000, LIN_LN, 0, PD_ACT_RELU, 1000);
}

/* ---- linear with the embedding in front (pd_linear_fuse.emb_a) ----
 * Against the embedding_sum op, then the same linear, on the same GPU:
 * both x (which the fused call writes) and y must be bit-identical. */
static void linear_embed_case(const pair *p, int T, int in, int out, int fuse) {
    pd_backend *g = p->gpu;
    const int vocab = 50, n_pos = 70;
    float *tok = rand_vec((size_t)vocab * in, -1, 1), *pos = rand_vec((size_t)n_pos * in, -1, 1);
    float *w = rand_vec((size_t)out * in, -1, 1), *bias = rand_vec(out, -1, 1);
    float *lnw = rand_vec(in, 0.5f, 1.5f), *lnb = rand_vec(in, -1, 1);
    int32_t *ids = malloc(sizeof(int32_t) * T), *posn = malloc(sizeof(int32_t) * T);
    for (int t = 0; t < T; t++)
        ids[t] = (int32_t)(urand() % vocab), posn[t] = (int32_t)(urand() % (n_pos - 2));
    void *d_tok = up_f32(g, tok, (size_t)vocab * in), *d_pos = up_f32(g, pos, (size_t)n_pos * in);
    void *d_w = up_f32(g, w, (size_t)out * in), *d_bias = up_f32(g, bias, out);
    void *d_lnw = up_f32(g, lnw, in), *d_lnb = up_f32(g, lnb, in);
    int32_t *d_ids = up_i32(g, ids, T), *d_posn = up_i32(g, posn, T);
    pd_err err;
    void *x[2], *y[2], *ln_out = g->alloc(g, (size_t)T * in * g->elem_size, &err);
    for (int i = 0; i < 2; i++) {
        x[i] = g->alloc(g, (size_t)T * in * g->elem_size, &err);
        y[i] = g->alloc(g, (size_t)T * out * g->elem_size, &err);
    }
    pd_linear_fuse f = {.layer_norm = (fuse & LIN_LN) != 0,
                        .ln_w = d_lnw,
                        .ln_b = d_lnb,
                        .ln_eps = 1e-5f,
                        .ln_out = ln_out};
    const void *b = fuse & LIN_BIAS ? d_bias : NULL;
    g->embedding_sum(g, x[0], d_tok, d_ids, d_pos, d_posn, 2, T, in);
    g->linear(g, y[0], x[0], in, d_w, b, T, in, out, &f);
    f.emb_a = d_tok, f.emb_b = d_pos, f.emb_ia = d_ids, f.emb_ib = d_posn, f.emb_b_offset = 2;
    g->linear(g, y[1], x[1], in, d_w, b, T, in, out, &f);
    char what[96];
    snprintf(what, sizeof what, "linear+embedding T=%d %d->%d%s%s", T, in, out,
             fuse & LIN_LN ? " ln" : "", fuse & LIN_BIAS ? " bias" : "");
    sync_ok(p, what);
    float *x0 = down(g, x[0], (size_t)T * in), *x1 = down(g, x[1], (size_t)T * in);
    float *y0 = down(g, y[0], (size_t)T * out), *y1 = down(g, y[1], (size_t)T * out);
    CHECKF(memcmp(x0, x1, sizeof(float) * T * in) == 0, "%s %s: x differs from embedding_sum's",
           p->variant, what);
    CHECKF(memcmp(y0, y1, sizeof(float) * T * out) == 0, "%s %s: y differs from the unfused ops'",
           p->variant, what);
    free(x0), free(x1), free(y0), free(y1);
    void *bufs[] = {d_tok, d_pos, d_w, d_bias, d_lnw, d_lnb, d_ids, d_posn, ln_out,
                    x[0],  x[1],  y[0], y[1]};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        g->free(g, bufs[i]);
    free(tok), free(pos), free(w), free(bias), free(lnw), free(lnb), free(ids), free(posn);
}

static void test_linear_embed(const pair *p) {
    CHECK(p->gpu->linear_embed);
    /* the small-T kernel (16-byte and scalar rows), and the large path */
    const int Ts[] = {1, 3, 8, 9, 40};
    const int shapes[][2] = {{768, 2304}, {80, 200}, {83, 37}};
    for (size_t a = 0; a < sizeof Ts / sizeof Ts[0]; a++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            linear_embed_case(p, Ts[a], shapes[s][0], shapes[s][1], LIN_LN | LIN_BIAS);
            linear_embed_case(p, Ts[a], shapes[s][0], shapes[s][1], LIN_BIAS);
        }
    /* x must be dense: a strided call is refused (at the next sync), not misread */
    pd_backend *g = p->gpu;
    pd_err err;
    void *buf = g->alloc(g, 64 * 64 * g->elem_size, &err);
    int32_t zero[2] = {0, 0};
    int32_t *d_zero = up_i32(g, zero, 2);
    const pd_linear_fuse f = {.emb_a = buf, .emb_b = buf, .emb_ia = d_zero, .emb_ib = d_zero};
    g->linear(g, (char *)buf + 32 * 64 * g->elem_size, buf, 24, buf, NULL, 2, 16, 16, &f);
    CHECK(g->sync(g, &err) != 0 && strstr(err.msg, "dense") != NULL);
    CHECKF(g->sync(g, &err) == 0, "after the refused call: %s", err.msg);
    g->free(g, buf);
    g->free(g, d_zero);
}

/* ---- linear timing (printed, not asserted) ----
 * Decode-sized calls, 64 of them captured into one CUDA graph (which also
 * checks that the op queues nothing a capture refuses), replayed and
 * timed. The weights rotate through enough copies to exceed L2,
 * as a forward pass's layers do, so the GB/s are HBM streaming. The same for
 * the unfused ops (layer_norm, gemm, activation, add) for comparison. */

#define TIME_CALLS 64

typedef struct timed_linear {
    pd_backend *be;
    lin_dev d;
    char *w_copies;
    int n_copies;
    int T, in, out, fuse;
} timed_linear;

static void timed_run(const timed_linear *tl, int fused) {
    const pd_linear_fuse f = {.layer_norm = (tl->fuse & LIN_LN) != 0,
                              .ln_w = tl->d.ln_w,
                              .ln_b = tl->d.ln_b,
                              .ln_eps = 1e-5f,
                              .ln_out = tl->d.ln_out,
                              .activate = (tl->fuse & LIN_ACT) != 0,
                              .act = PD_ACT_RELU,
                              .accumulate = (tl->fuse & LIN_ACC) != 0,
                              .acc_tmp = tl->d.tmp};
    const size_t wbytes = (size_t)tl->in * tl->out * tl->be->elem_size;
    const void *bias = tl->fuse & LIN_BIAS ? tl->d.bias : NULL;
    for (int i = 0; i < TIME_CALLS; i++) {
        const void *w = tl->w_copies + (size_t)(i % tl->n_copies) * wbytes;
        if (fused)
            tl->be->linear(tl->be, tl->d.y, tl->d.x, tl->in, w, bias, tl->T, tl->in, tl->out, &f);
        else
            ref_linear(tl->be, tl->d.y, tl->d.x, tl->in, w, bias, tl->T, tl->in, tl->out, &f);
    }
}

/* Microseconds per call, or -1 when the capture failed (reported). The
 * host clock around replays that fill the stream (the backend's own) and a
 * sync measures the GPU's time for them. */
static double graph_us(const timed_linear *tl, int fused) {
    pd_backend *be = tl->be;
    pd_err err;
    void *graph = NULL;
    const int reps = 10;
    double us = -1;
    if (be->graph_begin(be, &err) != 0) goto out;
    timed_run(tl, fused);
    if (be->graph_end(be, &graph, &err) != 0) goto out;
    if (be->graph_launch(be, graph, &err) != 0 || be->sync(be, &err) != 0) goto out; /* warm-up */
    const double t0 = pd_now();
    for (int r = 0; r < reps; r++)
        if (be->graph_launch(be, graph, &err) != 0) goto out;
    if (be->sync(be, &err) != 0) goto out;
    us = (pd_now() - t0) * 1e6 / (reps * TIME_CALLS);
out:
    if (us < 0) fprintf(stderr, "%s: %s\n", be->name, err.msg);
    be->graph_free(be, graph);
    return us;
}

static void time_linear(const char *variant) {
    pd_backend *be = NULL;
    pd_err err;
    if (pd_backend_create(variant, 0, &be, &err) != 0) return;
    /* OPT-125m's qkv, fc1, fc2, then OPT-1.3b's. */
    const int shapes[][3] = {{768, 2304, LIN_LN | LIN_BIAS},
                             {768, 3072, LIN_LN | LIN_ACT | LIN_BIAS},
                             {3072, 768, LIN_ACC | LIN_BIAS},
                             {2048, 6144, LIN_LN | LIN_BIAS},
                             {2048, 8192, LIN_LN | LIN_ACT | LIN_BIAS},
                             {8192, 2048, LIN_ACC | LIN_BIAS},
                             {768, 50272, LIN_LN}}; /* opt-125m's lm_head with the final LN */
    const int Ts[] = {1, 4, 8};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (size_t a = 0; a < sizeof Ts / sizeof Ts[0]; a++) {
            timed_linear tl = {.be = be,
                               .T = Ts[a],
                               .in = shapes[s][0],
                               .out = shapes[s][1],
                               .fuse = shapes[s][2]};
            const size_t wn = (size_t)tl.in * tl.out, wbytes = wn * be->elem_size;
            tl.n_copies = (int)((256u << 20) / wbytes) + 1; /* > 4x the H200's 60 MB L2 */
            if (tl.n_copies > TIME_CALLS) tl.n_copies = TIME_CALLS;
            float *w = rand_vec(wn, -1, 1), *x = rand_vec((size_t)tl.T * tl.in, -3, 5);
            float *v = rand_vec(tl.out > tl.in ? tl.out : tl.in, 0.5f, 1.5f);
            tl.w_copies = be->alloc(be, wbytes * tl.n_copies, &err);
            CHECKF(tl.w_copies != NULL, "%s", err.msg);
            if (!tl.w_copies) break;
            pd_view wv = {w, PD_F32, tl.out, tl.in};
            for (int c = 0; c < tl.n_copies; c++)
                be->upload_view(be, tl.w_copies + (size_t)c * wbytes, &wv, &err);
            tl.d.x = up_f32(be, x, (size_t)tl.T * tl.in);
            tl.d.bias = up_f32(be, v, tl.out);
            tl.d.ln_w = up_f32(be, v, tl.in);
            tl.d.ln_b = up_f32(be, v, tl.in);
            tl.d.y = be->alloc(be, (size_t)tl.T * tl.out * be->elem_size, &err);
            tl.d.ln_out = be->alloc(be, (size_t)tl.T * tl.in * be->elem_size, &err);
            tl.d.tmp = be->alloc(be, (size_t)tl.T * tl.out * be->elem_size, &err);
            const double fused = graph_us(&tl, 1), plain = graph_us(&tl, 0);
            CHECKF(fused > 0, "%s linear T=%d %d->%d: CUDA graph capture failed", variant, tl.T,
                   tl.in, tl.out);
            printf("%-9s linear T=%d %5d->%-5d %-12s fused %7.2f us %6.0f GB/s | unfused %7.2f us "
                   "%6.0f GB/s\n",
                   variant, tl.T, tl.in, tl.out,
                   tl.fuse == (LIN_LN | LIN_BIAS)             ? "ln+bias"
                   : tl.fuse == (LIN_LN | LIN_ACT | LIN_BIAS) ? "ln+relu+bias"
                   : tl.fuse == LIN_LN                        ? "ln"
                                                              : "acc+bias",
                   fused, wbytes / (fused * 1e3), plain, wbytes / (plain * 1e3));
            CHECKF(be->sync(be, &err) == 0, "%s", err.msg);
            lin_dev_free(be, &tl.d);
            be->free(be, tl.w_copies);
            free(w), free(x), free(v);
        }
    pd_backend_destroy(be);
}

/* ---- errors ---- */

static void test_errors(void) {
    pd_backend *be = NULL;
    pd_err err;
    CHECK(pd_backend_create("cuda-fp8", 0, &be, &err) != 0 && !be);
    CHECKF(strstr(err.msg, "cuda-fp8") != NULL, "%s", err.msg);
    CHECK(pd_backend_create("cuda:999", 0, &be, &err) != 0 && !be);
    CHECKF(strstr(err.msg, "999") && strstr(err.msg, "does not exist"), "%s", err.msg);
    CHECK(pd_backend_create("cuda", 0, &be, &err) == 0);
    if (!be) return;
    const size_t huge = (size_t)1 << 52;
    void *p = be->alloc(be, huge, &err);
    CHECK(p == NULL);
    CHECKF(strstr(err.msg, "out of device memory") && strstr(err.msg, "4503599627370496"), "%s",
           err.msg);
    CHECKF(be->sync(be, &err) == 0, "the backend stays usable after a failed alloc: %s", err.msg);
    pd_backend_destroy(be);
}

/* ---- argmax: every row length and alignment, ties, NaN, -inf ----
 * Values on a coarse grid, so most rows have many-way ties at the top;
 * odd row lengths put rows 1 and 2 off the 16-byte loads' alignment. The
 * host rule: the first non-NaN value, then strictly greater (the lowest
 * index of the maximum); a row of only NaN gives 0. */
static void test_argmax(const pair *p) {
    const int lens[] = {1, 3, 7, 8, 9, 100, 1023, 4097, 50265, 50272};
    pd_backend *g = p->gpu;
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        const int n = lens[li], rows = 5;
        float *h = malloc(sizeof(float) * (size_t)rows * n);
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < n; i++)
                h[(size_t)r * n + i] = (float)(urand() % 17) * 0.25f - 2.0f;
        h[n - 1] = 100.0f;                                   /* row 0: the last wins */
        for (int i = 0; i < n; i++) h[(size_t)2 * n + i] = -INFINITY; /* row 2: all -inf */
        if (n > 2) h[(size_t)2 * n + n / 2] = NAN;
        for (int i = 0; i < n; i++) h[(size_t)3 * n + i] = NAN; /* row 3: all NaN */
        for (int i = 0; i < n; i += 3) h[(size_t)4 * n + i] = NAN; /* row 4: NaN among ties */
        void *dx = up_f32(g, h, (size_t)rows * n);
        pd_err err;
        int32_t *dids = g->alloc(g, sizeof(int32_t) * rows, &err), ids[5];
        g->argmax(g, dids, dx, rows, n);
        CHECKF(g->copy_d2h(g, ids, dids, sizeof ids, &err) == 0, "%s", err.msg);
        float *dv = down(g, dx, (size_t)rows * n); /* the values as the device holds them */
        for (int r = 0; r < rows; r++) {
            const float *row = dv + (size_t)r * n;
            int best = -1;
            for (int i = 0; i < n; i++)
                if (!isnan(row[i]) && (best < 0 || row[i] > row[best])) best = i;
            if (best < 0) best = 0;
            CHECKF(ids[r] == best, "%s argmax n=%d row %d: %d, host %d", p->variant, n, r, ids[r],
                   best);
        }
        g->free(g, dx), g->free(g, dids);
        free(h), free(dv);
    }
}

/* ---- the LM head's fused argmax (pd_linear_fuse.argmax) ----
 * The ids must be what the argmax op picks from the very logits the same
 * call wrote, and the logits must be those of the call without the pick.
 * W row out-1 is a copy of row 7 with the same large bias, an exact tie at
 * the top (row 7 must win, the two rows being in different blocks and
 * tile blocks), a NaN bias makes NaN
 * logits (never picked) and a NaN x row a row of NaN (id 0). Outputs from
 * a few hundred rows (one pass of the grid) to the LM head's 50,272. */
static void test_linear_argmax(const pair *p) {
    pd_backend *g = p->gpu;
    if (!g->linear_argmax) return;
    const int shapes[][2] = {{96, 1000}, {64, 13001}, {768, 50272}};
    const int Ts[] = {1, 2, 5, 8, 9};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
        for (size_t ti = 0; ti < sizeof Ts / sizeof Ts[0]; ti++) {
            const int in = shapes[si][0], out = shapes[si][1], T = Ts[ti];
            float *w = rand_vec((size_t)in * out, -1, 1), *x = rand_vec((size_t)T * in, -2, 2);
            float *bias = rand_vec((size_t)out, -0.1f, 0.1f),
                  *lnw = rand_vec((size_t)in, 0.5f, 1.5f);
            float *lnb = rand_vec((size_t)in, -0.2f, 0.2f);
            /* row out-1 copies row 7 (and below gets its bias) */
            memcpy(w + (size_t)(out - 1) * in, w + (size_t)7 * in, sizeof(float) * in);
            for (int k = 0; k < out; k += 97)
                bias[k] = NAN;
            bias[7] = bias[out - 1] = 1000.0f;      /* rows 7 and out-1 tie at the top */
            if (T > 1) x[(size_t)1 * in + 3] = NAN; /* token 1: every logit NaN */
            pd_err err;
            void *dw = up_f32(g, w, (size_t)in * out), *dx = up_f32(g, x, (size_t)T * in);
            void *db = up_f32(g, bias, out), *dlw = up_f32(g, lnw, in), *dlb = up_f32(g, lnb, in);
            void *y1 = g->alloc(g, (size_t)T * out * g->elem_size, &err);
            void *y2 = g->alloc(g, (size_t)T * out * g->elem_size, &err);
            void *ln_out = g->alloc(g, (size_t)T * in * g->elem_size, &err);
            int32_t *d_fused = g->alloc(g, sizeof(int32_t) * T, &err);
            int32_t *d_ref = g->alloc(g, sizeof(int32_t) * T, &err);
            int32_t *d_copy = g->alloc(g, sizeof(int32_t) * T, &err);
            for (int with_ln = 0; with_ln < 2; with_ln++) {
                pd_linear_fuse f = {.layer_norm = with_ln,
                                    .ln_w = dlw,
                                    .ln_b = dlb,
                                    .ln_eps = 1e-5f,
                                    .ln_out = ln_out};
                g->linear(g, y1, dx, in, dw, db, T, in, out, &f);
                f.argmax = d_fused;
                f.argmax_copy = d_copy;
                g->linear(g, y2, dx, in, dw, db, T, in, out, &f);
                g->argmax(g, d_ref, y2, T, out);
                int32_t fused[9], ref[9], copy[9];
                CHECKF(g->copy_d2h(g, copy, d_copy, sizeof(int32_t) * T, &err) == 0, "%s", err.msg);
                CHECKF(g->copy_d2h(g, fused, d_fused, sizeof(int32_t) * T, &err) == 0, "%s",
                       err.msg);
                CHECKF(g->copy_d2h(g, ref, d_ref, sizeof(int32_t) * T, &err) == 0, "%s", err.msg);
                float *a = down(g, y1, (size_t)T * out), *b = down(g, y2, (size_t)T * out);
                size_t differ = 0;
                for (size_t i = 0; i < (size_t)T * out; i++)
                    if (memcmp(&a[i], &b[i], sizeof(float)) != 0) differ++;
                CHECKF(differ == 0, "%s linear+argmax %d->%d T=%d ln=%d: %zu logits changed",
                       p->variant, in, out, T, with_ln, differ);
                for (int t = 0; t < T; t++)
                    CHECKF(copy[t] == fused[t],
                           "%s linear+argmax %d->%d T=%d token %d: copy %d, ids %d", p->variant, in,
                           out, T, t, copy[t], fused[t]);
                for (int t = 0; t < T; t++)
                    CHECKF(fused[t] == ref[t],
                           "%s linear+argmax %d->%d T=%d ln=%d token %d: %d, "
                           "argmax op %d",
                           p->variant, in, out, T, with_ln, t, fused[t], ref[t]);
                for (int t = 0; t < T; t++)
                    if (t != 1)
                        CHECKF(fused[t] == 7,
                               "%s linear+argmax %d->%d T=%d token %d: the tie "
                               "at the top picked %d, not 7",
                               p->variant, in, out, T, t, fused[t]);
                if (T > 1) /* and for T = 1, token 0 is the tie above */
                    CHECKF(fused[1] == 0, "%s: a row of NaN picks %d, not 0", p->variant, fused[1]);
                free(a), free(b);
            }
            void *ptrs[] = {dw, dx, db, dlw, dlb, y1, y2, ln_out, d_fused, d_ref, d_copy};
            for (size_t k = 0; k < sizeof ptrs / sizeof *ptrs; k++)
                g->free(g, ptrs[k]);
            free(w), free(x), free(bias), free(lnw), free(lnb);
        }
}

/* ---- token choice: argmax and the sample op against model/sampler.c ----
 * For each parameter set and each u of a grid, the device's token must be
 * the one the host sampler's distribution (sampler_probs, on the very
 * logits the device holds) gives to u: the first id whose running
 * probability exceeds u. A u within 1e-4 of a boundary may go either way
 * (fp32 sums on the device, double on the host) and is only counted. */
#define SMP_US 48
static void test_sampling(const pair *p) {
    const int V = 5000;
    const float cfg[][4] = {/* temperature, top_p, min_p, top_k */
                            {1.0f, 1.0f, 0.0f, 0},  {0.7f, 1.0f, 0.0f, 0},  {1.0f, 1.0f, 0.0f, 1},
                            {1.0f, 1.0f, 0.0f, 40}, {1.3f, 0.9f, 0.0f, 0},  {1.0f, 0.5f, 0.05f, 50},
                            {0.0f, 1.0f, 0.0f, 0},  {2.0f, 0.95f, 0.0f, 7}, {1.0f, 1.0f, 0.2f, 0}};
    const int n_cfg = (int)(sizeof cfg / sizeof cfg[0]), rows = n_cfg * SMP_US;
    float *logit_row = rand_vec((size_t)V, -4, 4);
    for (int i = 0; i < 30; i++) logit_row[urand() % V] += 6; /* a head of likely tokens */
    logit_row[17] = logit_row[4000] = 9.5f;                   /* an exact tie at the top */
    float *all = malloc(sizeof(float) * (size_t)rows * V), *params = malloc(sizeof(float) * 5 * rows);
    for (int r = 0; r < rows; r++) memcpy(all + (size_t)r * V, logit_row, sizeof(float) * V);
    for (int c = 0; c < n_cfg; c++)
        for (int k = 0; k < SMP_US; k++) {
            float *q = params + 5 * (c * SMP_US + k);
            q[0] = cfg[c][0], q[1] = cfg[c][1], q[2] = cfg[c][2], q[3] = cfg[c][3];
            q[4] = (k + 0.5f) / SMP_US;
        }
    pd_backend *g = p->gpu;
    pd_err err;
    void *dx = up_f32(g, all, (size_t)rows * V);
    float *dparams = g->alloc(g, sizeof(float) * 5 * rows, &err);
    int32_t *dids = g->alloc(g, sizeof(int32_t) * rows, &err);
    int32_t *ids = malloc(sizeof(int32_t) * rows), *amax = malloc(sizeof(int32_t) * rows);
    CHECK(g->copy_h2d(g, dparams, params, sizeof(float) * 5 * rows, &err) == 0);
    g->argmax(g, dids, dx, rows, V);
    CHECK(g->copy_d2h(g, amax, dids, sizeof(int32_t) * rows, &err) == 0);
    g->sample(g, dids, dx, rows, V, dparams);
    CHECKF(g->copy_d2h(g, ids, dids, sizeof(int32_t) * rows, &err) == 0, "%s", err.msg);
    float *dev_logits = down(g, dx, (size_t)V); /* what the device sampled from */
    float *probs = malloc(sizeof(float) * V), *work = malloc(sizeof(float) * V);
    int near = 0, wrong = 0;
    int host_best = 0;
    for (int i = 1; i < V; i++) if (dev_logits[i] > dev_logits[host_best]) host_best = i;
    CHECKF(amax[0] == host_best, "%s argmax %d, host %d (tie at 17 and 4000: lowest wins)", p->variant,
           amax[0], host_best);
    for (int c = 0; c < n_cfg; c++) {
        sampling_params sp;
        sampling_params_default(&sp);
        sp.temperature = cfg[c][0], sp.top_p = cfg[c][1], sp.min_p = cfg[c][2];
        sp.top_k = (int)cfg[c][3];
        sampler *smp = sampler_create(&sp, V, 1);
        memcpy(work, dev_logits, sizeof(float) * V);
        CHECK(smp && sampler_probs(smp, work, probs) == 0);
        double total = 0;
        for (int i = 0; i < V; i++) total += probs[i];
        for (int k = 0; k < SMP_US; k++) {
            const double u = ((k + 0.5f) / SMP_US) * total;
            double acc = 0, gap = 1e30;
            int want = -1;
            for (int i = 0; i < V; i++) {
                if (probs[i] <= 0) continue;
                acc += probs[i];
                if (fabs(acc - u) < gap) gap = fabs(acc - u);
                if (want < 0 && u < acc) want = i;
            }
            const int got = ids[c * SMP_US + k];
            if (got == want) continue;
            if (gap < 1e-4 * total) near++;
            else wrong++;
            if (wrong > 0 && wrong < 4)
                CHECKF(0, "%s sample cfg %d (t %.2g top_p %.2g min_p %.2g top_k %d) u %.3f: device %d "
                       "(p %.3g), host %d (p %.3g)",
                       p->variant, c, cfg[c][0], cfg[c][1], cfg[c][2], (int)cfg[c][3],
                       (k + 0.5) / SMP_US, got, got >= 0 && got < V ? probs[got] : -1.0, want,
                       want >= 0 ? probs[want] : -1.0);
        }
        sampler_free(smp);
    }
    CHECKF(wrong == 0, "%s sample: %d of %d draws differ from the host distribution", p->variant,
           wrong, rows);
    printf("%s sample: %d draws match the host sampler (%d within 1e-4 of a boundary went the "
           "other way)\n", p->variant, rows - near, near);
    g->free(g, dx);
    g->free(g, dparams);
    g->free(g, dids);
    free(logit_row), free(all), free(params), free(ids), free(amax), free(dev_logits), free(probs),
        free(work);
}

/* A CPU and a GPU backend, the GPU one created with the environment
 * variable name=value unless name is NULL (the CUDA backend reads its
 * PDSERVE_CUDA_* switches when it is created); false when either could not
 * be made. */
static bool pair_open_with(pair *p, const char *name, const char *value) {
    pd_err err;
    if (name) setenv(name, value, 1);
    CHECKF(pd_backend_create("cpu", 0, &p->cpu, &err) == 0, "%s", err.msg);
    CHECKF(pd_backend_create(p->variant, 0, &p->gpu, &err) == 0, "%s (%s=%s): %s", p->variant,
           name ? name : "defaults", name ? value : "", err.msg);
    if (name) unsetenv(name);
    return p->cpu && p->gpu;
}

static void pair_close(pair *p) {
    pd_backend_destroy(p->gpu);
    pd_backend_destroy(p->cpu);
}

/* The LM head's cases with PDSERVE_CUDA_HEAD=route: every route kept for
 * A/B timing is checked too. */
static void run_head_route(const char *variant, double tol, const char *route) {
    pair p = {.variant = variant, .tol = tol};
    if (pair_open_with(&p, "PDSERVE_CUDA_HEAD", route)) {
        test_linear_heads(&p);
        test_linear_argmax(&p);
    }
    pair_close(&p);
}

/* The linear's cases with PDSERVE_CUDA_LIN_FIT=0: the small-T kernel's
 * older register sizes, kept for A/B timing, are checked like the default. */
static void run_lin_fit_off(const char *variant, double tol) {
    pair p = {.variant = variant, .tol = tol};
    if (pair_open_with(&p, "PDSERVE_CUDA_LIN_FIT", "0")) {
        test_linear(&p);
        test_linear_embed(&p);
    }
    pair_close(&p);
}

static void run_variant(const char *variant, double tol) {
    pair p = {.variant = variant, .tol = tol};
    if (pair_open_with(&p, NULL, NULL)) {
        test_gemm(&p);
        test_linear(&p);
        test_linear_heads(&p);
        test_linear_embed(&p);
        test_layer_norm(&p);
        test_elementwise(&p);
        test_rows(&p);
        test_attention(&p);
        test_argmax(&p);
        test_linear_argmax(&p);
        test_sampling(&p);
    }
    pair_close(&p);
}
#endif

int main(void) {
#ifndef PDSERVE_HAVE_CUDA
    printf("built without the CUDA backend: skipped\n");
    return 0;
#else
    if (pd_cuda_device_count() == 0) {
        printf("no GPU: skipped\n");
        return 0;
    }
    test_errors();
    run_variant("cuda", 1e-4);
    /* 16-bit storage rounds every input and output: ~3 (fp16) and ~2 (bf16)
     * significant digits against the fp32 reference. */
    run_variant("cuda-fp16", 1e-2);
    run_variant("cuda-bf16", 4e-2);
    const char *routes[] = {"gemv", "blas", "fused", "split"};
    for (int r = 0; r < 4; r++) {
        run_head_route("cuda-fp16", 1e-2, routes[r]);
        run_head_route("cuda-bf16", 4e-2, routes[r]);
    }
    run_lin_fit_off("cuda-fp16", 1e-2);
    run_lin_fit_off("cuda-bf16", 4e-2);
    time_linear("cuda");
    time_linear("cuda-fp16");
    time_linear("cuda-bf16");
    return test_finish();
#endif
}
