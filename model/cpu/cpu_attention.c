/* cpu_attention: causal attention of new tokens over the paged KV cache.
 *
 * One task per (token, head). A token at position p attends to positions
 * 0..p of its own sequence; position i lives in slot
 * block_table[i / bs] * bs + i % bs, and the cache row of a slot holds all
 * heads ([slot][head][head_dim]). The softmax is computed online (running
 * max and sum, the accumulator rescaled when the max grows), so no score
 * buffer is needed for any context length; everything is fp32. */
#include <math.h>
#include <string.h>

#include "model/cpu/cpu_internal.h"

typedef float v4f __attribute__((vector_size(16)));

static inline float dot_f32(const float *a, const float *b, int n) {
    v4f s0 = {0}, s1 = {0};
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        v4f a0, a1, b0, b1;
        memcpy(&a0, a + i, 16), memcpy(&a1, a + i + 4, 16);
        memcpy(&b0, b + i, 16), memcpy(&b1, b + i + 4, 16);
        s0 += a0 * b0, s1 += a1 * b1;
    }
    s0 += s1;
    float s = s0[0] + s0[1] + s0[2] + s0[3];
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}

typedef struct attn_job {
    float *out;
    const float *q;
    int q_stride;
    const float *k_cache, *v_cache;
    const pd_step_meta *meta;
    int heads, head_dim, block_size;
    float scale;
} attn_job;

static void attn_task(void *arg, int task) {
    const attn_job *j = arg;
    const int t = task / j->heads, h = task % j->heads, hd = j->head_dim, bs = j->block_size;
    const int pos = j->meta->positions[t];
    const int32_t *table =
        j->meta->block_tables + (size_t)j->meta->token_seq[t] * j->meta->max_blocks;
    const size_t row = (size_t)j->heads * hd; /* one slot of the cache */

    /* HF scales q (after its bias) before the dot products. */
    float q[CPU_MAX_HEAD_DIM], acc[CPU_MAX_HEAD_DIM];
    const float *qt = j->q + (size_t)t * j->q_stride + (size_t)h * hd;
    for (int i = 0; i < hd; i++)
        q[i] = qt[i] * j->scale, acc[i] = 0.0f;

    float max = -INFINITY, sum = 0.0f;
    for (int p = 0; p <= pos; p++) {
        const size_t slot = (size_t)table[p / bs] * bs + (size_t)(p % bs);
        const float *k = j->k_cache + slot * row + (size_t)h * hd;
        const float *v = j->v_cache + slot * row + (size_t)h * hd;
        const float s = dot_f32(q, k, hd);
        if (s > max) { /* rescale what was summed under the old max */
            const float c = expf(max - s);
            sum *= c;
            for (int i = 0; i < hd; i++)
                acc[i] *= c;
            max = s;
        }
        const float e = expf(s - max);
        sum += e;
        for (int i = 0; i < hd; i++)
            acc[i] += e * v[i];
    }
    float *o = j->out + (size_t)t * row + (size_t)h * hd;
    const float inv = 1.0f / sum;
    for (int i = 0; i < hd; i++)
        o[i] = acc[i] * inv;
}

void cpu_paged_attention(pd_backend *be, void *out, const void *q, int q_stride,
                         const void *k_cache, const void *v_cache, const pd_step_meta *meta,
                         int heads, int head_dim, int block_size, float scale) {
    attn_job j = {out, q, q_stride, k_cache, v_cache, meta, heads, head_dim, block_size, scale};
    cpu_pool_run(cpu_ctx_pool(be), meta->n_tokens * heads, attn_task, &j);
}
