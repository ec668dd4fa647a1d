/* test_cuda_forward: opt_forward on the CUDA backend against the CPU backend
 * on the same generated models (make-model presets "tiny", pre-LN, and
 * "tiny-postln", post-LN with project_in/out), the same prompts and the same
 * scrambled block tables. Each step's logits must agree to 1e-4 of the
 * largest logit in fp32 ("cuda") and 2e-2 with 16-bit storage
 * ("cuda-fp16"):
 *  - a 37-token prefill in one step;
 *  - the same prompt prefilled in chunks of 10, 20 and 7;
 *  - 6 greedy decode steps after that (the CPU's argmax is fed to both);
 *  - one batched step of three sequences at different points: a decode,
 *    a fresh 9-token prompt and a 12-token chunk after a cached prefix;
 * at block sizes 4 and 16 (24 blocks per sequence: 96 and 384 tokens).
 * Then decode graphs on the GPU side: batches of 1..20 sequences (padded to
 * recordings of 1, 2, 4, 8, 16 and 24), replayed three times, must still match the
 * CPU, and the device's greedy picks (opt_forward_ex ids) must equal the
 * argmax of the logits it returned.
 *
 * Without a GPU (or without the CUDA build) it prints why and passes. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/make_model.h"
#include "model/opt.h"
#include "tests/common/testlib.h"

#ifdef PDSERVE_HAVE_CUDA
#include "model/cuda/cuda_backend.h"

/* 24 blocks per sequence; 20 sequences so decode graphs of batch > 8 (the
 * cuBLASLt path of the linear op) are recorded too. */
#define MAX_SEQS 20
#define NUM_BLOCKS (24 * MAX_SEQS)

/* One backend with its model and cache. */
typedef struct side {
    pd_backend *be;
    opt_model *m;
    opt_kv_storage *kv;
} side;

typedef struct rig {
    side cpu, gpu;
    const char *variant;
    double tol;
    int V, bs;
    int32_t tables[MAX_SEQS][NUM_BLOCKS]; /* per sequence, disjoint scrambled blocks */
} rig;

static uint64_t rng = 0x853c49e6748fea9bull;
static uint32_t urand(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (uint32_t)(rng >> 32);
}

static int side_open(side *s, const char *backend, const char *dir, int bs, pd_err *err) {
    memset(s, 0, sizeof *s);
    if (pd_backend_create(backend, 2, &s->be, err) != 0) return -1;
    if (opt_model_load(dir, s->be, &s->m, err) != 0) return -1;
    return opt_kv_storage_create(s->m, NUM_BLOCKS, bs, &s->kv, err);
}

static void side_close(side *s) {
    opt_kv_storage_free(s->kv);
    opt_model_free(s->m);
    pd_backend_destroy(s->be);
}

/* Run the same step on both sides; compare every logits row. Returns the
 * CPU's argmax of the last row (the next greedy token). */
static int32_t step_both(rig *r, const char *what, opt_seq_step *steps, int n) {
    int n_logits = 0;
    for (int i = 0; i < n; i++)
        n_logits += steps[i].want_logits;
    float *lc = calloc((size_t)(n_logits ? n_logits : 1) * r->V, sizeof(float));
    float *lg = calloc((size_t)(n_logits ? n_logits : 1) * r->V, sizeof(float));
    pd_err err;
    CHECKF(opt_forward(r->cpu.m, r->cpu.kv, steps, n, lc, &err) == 0, "cpu %s: %s", what, err.msg);
    CHECKF(opt_forward(r->gpu.m, r->gpu.kv, steps, n, lg, &err) == 0, "%s %s: %s", r->variant, what,
           err.msg);
    int32_t best = 0;
    for (int row = 0; row < n_logits; row++) {
        const float *c = lc + (size_t)row * r->V, *g = lg + (size_t)row * r->V;
        double max_diff = 0, max_ref = 1.0;
        int nan = 0;
        best = 0;
        for (int i = 0; i < r->V; i++) {
            if (isnan(g[i])) nan = 1;
            const double d = fabs((double)c[i] - g[i]);
            if (d > max_diff) max_diff = d;
            if (fabs(c[i]) > max_ref) max_ref = fabs(c[i]);
            if (c[i] > c[best]) best = i;
        }
        CHECKF(!nan && max_diff <= r->tol * max_ref,
               "%s bs=%d %s row %d: max logit diff %.3g (largest logit %.3g, tolerance %.1g)",
               r->variant, r->bs, what, row, max_diff, max_ref, r->tol);
    }
    free(lc);
    free(lg);
    return best;
}

static opt_seq_step seq_step(rig *r, int seq, const int32_t *tokens, int n, int start) {
    opt_seq_step s = {.tokens = tokens,
                      .n_tokens = n,
                      .start_pos = start,
                      .block_table = r->tables[seq],
                      .n_blocks = NUM_BLOCKS / MAX_SEQS,
                      .want_logits = true};
    return s;
}

static void run_scenarios(rig *r) {
    int32_t prompt[64];
    for (int i = 0; i < 64; i++)
        prompt[i] = (int32_t)(urand() % (uint32_t)r->V);

    /* Sequence 0: one-shot prefill. Sequence 1: the same prompt in chunks. */
    opt_seq_step s = seq_step(r, 0, prompt, 37, 0);
    step_both(r, "prefill 37", &s, 1);
    const int chunks[] = {10, 20, 7};
    int at = 0;
    int32_t next = 0;
    for (int c = 0; c < 3; c++) {
        s = seq_step(r, 1, prompt + at, chunks[c], at);
        char what[48];
        snprintf(what, sizeof what, "chunked prefill [%d,%d)", at, at + chunks[c]);
        next = step_both(r, what, &s, 1);
        at += chunks[c];
    }
    /* Decode on sequence 1. */
    for (int k = 0; k < 6; k++, at++) {
        int32_t tok = next;
        s = seq_step(r, 1, &tok, 1, at);
        char what[32];
        snprintf(what, sizeof what, "decode at %d", at);
        next = step_both(r, what, &s, 1);
    }
    /* A batch: decode on 1, a fresh prompt on 2, a chunk after a prefix on 0. */
    int32_t tok = next;
    opt_seq_step batch[3] = {seq_step(r, 1, &tok, 1, at), seq_step(r, 2, prompt + 40, 9, 0),
                             seq_step(r, 0, prompt + 37, 12, 37)};
    step_both(r, "batch of 3", batch, 3);

    /* pdserve score's all-position pass: one 1-token sequence per position,
     * all on one block table, so each position reads K/V that the others
     * write in the same step (sequence 3's table; 20 positions). */
    opt_seq_step per_pos[20];
    for (int i = 0; i < 20; i++)
        per_pos[i] = seq_step(r, 3, prompt + i, 1, i);
    step_both(r, "one sequence per position, shared table", per_pos, 20);
}

/* One decode step of B sequences on both sides, the GPU's logits and picks
 * checked against the CPU's; both sides go on with the CPU's picks. */
static void graph_step_check(rig *r, const char *what, int B, int32_t *tok, int *pos, float *lg) {
    pd_err err;
    opt_seq_step steps[MAX_SEQS];
    for (int q = 0; q < B; q++)
        steps[q] = seq_step(r, q, &tok[q], 1, pos[q]);
    /* The CPU reference first (it does not touch tok), then the GPU with
     * both outputs, whose logits step_both cannot see. */
    float *lc = calloc((size_t)B * r->V, sizeof(float));
    int32_t ids[MAX_SEQS];
    CHECKF(opt_forward(r->cpu.m, r->cpu.kv, steps, B, lc, &err) == 0, "cpu %s: %s", what, err.msg);
    CHECKF(opt_forward_ex(r->gpu.m, r->gpu.kv, steps, B, lg, ids, NULL, &err) == 0, "%s %s: %s",
           r->variant, what, err.msg);
    for (int q = 0; q < B; q++) {
        const float *c = lc + (size_t)q * r->V, *g = lg + (size_t)q * r->V;
        double max_diff = 0, max_ref = 1.0;
        int best_g = 0, best_c = 0;
        for (int i = 0; i < r->V; i++) {
            const double d = fabs((double)c[i] - g[i]);
            if (!(d <= max_diff)) max_diff = d; /* NaN sticks */
            if (fabs(c[i]) > max_ref) max_ref = fabs(c[i]);
            if (g[i] > g[best_g]) best_g = i;
            if (c[i] > c[best_c]) best_c = i;
        }
        CHECKF(max_diff <= r->tol * max_ref, "%s bs=%d %s row %d: max diff %.3g of %.3g", r->variant,
               r->bs, what, q, max_diff, max_ref);
        CHECKF(ids[q] == best_g, "%s %s row %d: device pick %d, argmax of its logits %d", r->variant,
               what, q, ids[q], best_g);
        tok[q] = best_c;
        pos[q]++;
    }
    free(lc);
}

/* Decode steps through the GPU's recorded graphs. */
static void run_graphs(rig *r) {
    pd_err err;
    CHECKF(opt_model_set_graphs(r->gpu.m, true, MAX_SEQS, &err) == 0, "%s", err.msg);
    CHECK(opt_model_graph_stats(r->gpu.m, NULL, NULL) == 1);
    int32_t prompt[32], tok[MAX_SEQS];
    int pos[MAX_SEQS];
    for (int i = 0; i < 32; i++)
        prompt[i] = (int32_t)(urand() % (uint32_t)r->V);
    for (int q = 0; q < MAX_SEQS; q++) { /* fresh prompts of 5..12 tokens */
        opt_seq_step s = seq_step(r, q, prompt + q, 5 + q % 8, 0);
        tok[q] = step_both(r, "graph prefill", &s, 1);
        pos[q] = 5 + q % 8;
    }
    float *lg = calloc((size_t)MAX_SEQS * r->V, sizeof(float));
    for (int round = 0; round < 3; round++)
        for (int B = 1; B <= MAX_SEQS; B++) {
            char what[48];
            snprintf(what, sizeof what, "graph decode round %d batch %d", round, B);
            graph_step_check(r, what, B, tok, pos, lg);
        }
    int captures = 0, replays = 0;
    opt_model_graph_stats(r->gpu.m, &captures, &replays);
    /* Batches 1..20 pad to the recorded sizes 1, 2, 4, 8, 16 and 24. */
    CHECKF(captures == 6 && replays == 3 * MAX_SEQS,
           "%s: %d recordings (6 expected: 1, 2, 4, 8, 16, 24), %d replays (%d expected)", r->variant,
           captures, replays, 3 * MAX_SEQS);
    /* A prefill step runs eagerly beside the recordings and leaves them valid. */
    opt_seq_step s = seq_step(r, 0, prompt, 3, pos[0]);
    step_both(r, "prefill between graph steps", &s, 1);
    pos[0] += 3;
    opt_seq_step d = seq_step(r, 0, &tok[0], 1, pos[0]);
    step_both(r, "graph decode after a prefill", &d, 1);
    opt_model_graph_stats(r->gpu.m, &captures, &replays);
    CHECKF(captures == 6, "%s: %d recordings after an eager prefill (6 expected)", r->variant,
           captures);
    /* Recorded ahead of use (what the engine does at start-up): dropped,
     * then all six sizes at once, which the next steps replay unchanged. */
    CHECKF(opt_model_set_graphs(r->gpu.m, false, MAX_SEQS, &err) == 0, "%s", err.msg);
    CHECKF(opt_model_set_graphs(r->gpu.m, true, MAX_SEQS, &err) == 0, "%s", err.msg);
    int recorded = -1;
    CHECKF(opt_model_record_graphs(r->gpu.m, r->gpu.kv, false, &recorded, &err) == 0, "%s",
           err.msg);
    CHECKF(recorded == 6, "%s: %d graphs recorded ahead (6 expected)", r->variant, recorded);
    CHECKF(opt_model_record_graphs(r->gpu.m, r->gpu.kv, false, &recorded, &err) == 0 &&
               recorded == 0,
           "%s: a second record_graphs recorded %d", r->variant, recorded);
    int before = 0;
    opt_model_graph_stats(r->gpu.m, &before, NULL);
    for (int B = 1; B <= MAX_SEQS; B += 7) {
        char what[48];
        snprintf(what, sizeof what, "pre-recorded graph decode batch %d", B);
        graph_step_check(r, what, B, tok, pos, lg);
    }
    opt_model_graph_stats(r->gpu.m, &captures, NULL);
    CHECKF(captures == before, "%s: %d recordings during pre-recorded steps", r->variant,
           captures - before);
    free(lg);
}

/* Decode steps queued ahead on the GPU (opt_forward_queue): each step's
 * embedding reads the picks of the step before it on the device, queued
 * before the host has read them; the picks equal those of plain graph
 * steps from the same state (the queued run rewrites the same KV slots in
 * the same order). */
static void run_queued(rig *r) {
    enum { D = 24 };
    pd_err err;
    const int Bs[] = {1, 3, 9};
    int32_t tok[MAX_SEQS], pos[MAX_SEQS];
    for (int q = 0; q < MAX_SEQS; q++) { /* fresh prompts of 4 tokens */
        int32_t prompt[4];
        for (int i = 0; i < 4; i++) prompt[i] = (int32_t)(urand() % (uint32_t)r->V);
        opt_seq_step s = seq_step(r, q, prompt, 4, 0);
        CHECKF(opt_forward_ex(r->gpu.m, r->gpu.kv, &s, 1, NULL, &tok[q], NULL, &err) == 0, "%s", err.msg);
        pos[q] = 4;
    }
    /* The engine under --async-scheduling records the queued variants at
     * start-up (three more of each size), so no queued step records one. */
    int recorded = -1, before = 0, after = 0;
    if (opt_model_graph_stats(r->gpu.m, NULL, NULL)) {
        CHECKF(opt_model_record_graphs(r->gpu.m, r->gpu.kv, true, &recorded, &err) == 0, "%s",
               err.msg);
        CHECKF(recorded == 18, "%s: %d queued variants recorded ahead (18 expected)", r->variant,
               recorded);
    }
    opt_model_graph_stats(r->gpu.m, &before, NULL);
    for (size_t bi = 0; bi < sizeof Bs / sizeof Bs[0]; bi++) {
        const int B = Bs[bi];
        int32_t plain[D][MAX_SEQS], queued[D][MAX_SEQS], cur[MAX_SEQS], chain[MAX_SEQS];
        opt_seq_step st[MAX_SEQS];
        memcpy(cur, tok, sizeof cur);
        for (int d = 0; d < D; d++) {
            for (int q = 0; q < B; q++) st[q] = seq_step(r, q, &cur[q], 1, pos[q] + d);
            CHECKF(opt_forward_ex(r->gpu.m, r->gpu.kv, st, B, NULL, plain[d], NULL, &err) == 0, "%s",
                   err.msg);
            memcpy(cur, plain[d], sizeof(int32_t) * (size_t)B);
        }
        for (int q = 0; q < B; q++) {
            st[q] = seq_step(r, q, &tok[q], 1, pos[q]);
            chain[q] = q;
        }
        CHECKF(opt_forward_queue(r->gpu.m, r->gpu.kv, st, B, NULL, NULL, &err) == 0, "%s", err.msg);
        for (int d = 1; d <= D; d++) {
            if (d < D) {
                for (int q = 0; q < B; q++) st[q] = seq_step(r, q, NULL, 1, pos[q] + d);
                CHECKF(opt_forward_queue(r->gpu.m, r->gpu.kv, st, B, NULL, chain, &err) == 0, "%s",
                       err.msg);
            }
            CHECKF(opt_forward_wait(r->gpu.m, queued[d - 1], &err) == 0, "%s", err.msg);
        }
        int differ = 0;
        for (int d = 0; d < D; d++)
            for (int q = 0; q < B; q++) differ += plain[d][q] != queued[d][q];
        CHECKF(differ == 0, "%s: batch %d: %d of %d queued picks differ from plain steps", r->variant, B,
               differ, D * B);
    }
    opt_model_graph_stats(r->gpu.m, &after, NULL);
    CHECKF(recorded < 0 || after == before, "%s: queued steps recorded %d graphs after all",
           r->variant, after - before);
}

static void run_model(const char *dir, const char *variant, double tol, int bs) {
    rig *r = calloc(1, sizeof *r);
    r->variant = variant;
    r->tol = tol;
    r->bs = bs;
    /* Disjoint block ranges per sequence, scrambled. */
    int32_t perm[NUM_BLOCKS];
    for (int i = 0; i < NUM_BLOCKS; i++)
        perm[i] = i;
    for (int i = NUM_BLOCKS - 1; i > 0; i--) {
        int j = (int)(urand() % (uint32_t)(i + 1)), t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    for (int q = 0; q < MAX_SEQS; q++)
        for (int b = 0; b < NUM_BLOCKS / MAX_SEQS; b++)
            r->tables[q][b] = perm[q * (NUM_BLOCKS / MAX_SEQS) + b];
    pd_err err;
    int ok = side_open(&r->cpu, "cpu", dir, bs, &err) == 0;
    CHECKF(ok, "cpu: %s", err.msg);
    if (ok) {
        ok = side_open(&r->gpu, variant, dir, bs, &err) == 0;
        CHECKF(ok, "%s: %s", variant, err.msg);
    }
    if (ok) {
        r->V = opt_model_config(r->cpu.m)->vocab_size;
        run_scenarios(r);
        run_graphs(r);
        run_queued(r);
    }
    side_close(&r->gpu);
    side_close(&r->cpu);
    free(r);
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
    const char *presets[] = {"tiny", "tiny-postln"};
    for (int p = 0; p < 2; p++) {
        char dir[512];
        snprintf(dir, sizeof dir, "%s/%s", test_tmpdir(), presets[p]);
        pd_err err;
        int ok = opt_make_model(dir, presets[p], 7, PD_F32, &err) == 0;
        CHECKF(ok, "make-model %s: %s", presets[p], err.msg);
        if (!ok) continue;
        const int block_sizes[] = {16, 4};
        for (int b = 0; b < 2; b++) {
            run_model(dir, "cuda", 1e-4, block_sizes[b]);
            run_model(dir, "cuda-fp16", 2e-2, block_sizes[b]);
        }
    }
    return test_finish();
#endif
}
