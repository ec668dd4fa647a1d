/* cuda_attention: causal attention of the step's new tokens over the paged
 * KV cache — the GPU twin of model/cpu/cpu_attention.c.
 *
 * Work split: one warp per (token, head); ATTN_WARPS warps per block. Lane l
 * holds the head's dimensions l, l+32, l+64, ... of q (already multiplied by
 * scale, as HF does) and of the output accumulator, in registers, so any
 * head_dim up to 32 * PER_LANE works (64 -> 2 per lane; 80 -> 3 for lanes
 * 0-15, 2 for the others). The warp walks positions 0..positions[t] of the
 * token's sequence in order; position p is read from slot
 * block_table[p / block_size] * block_size + p % block_size. For each
 * position the lanes' partial dot products are summed with an xor butterfly
 * (every lane ends with the same bits, so the branch below is warp-uniform),
 * then the online softmax (running max and sum, accumulator rescaled when the
 * max grows) is updated exactly as on the CPU. All of it is fp32.
 *
 * This is the simple version: one query per warp, positions one at a time,
 * no shared-memory tiling of K/V across the queries of a prefill. Prefills
 * in fp16/bf16 go to the tensor-core kernel of cuda_flash.cu instead (see
 * cuda_paged_attention at the end). */
#include <math.h>

#include "model/cuda/cuda_internal.cuh"

#define ATTN_WARPS 4

template <typename T, int PER_LANE>
__global__ void paged_attention_kernel(T *out, const T *q, int q_stride, const T *k_cache,
                                       const T *v_cache, const int32_t *positions,
                                       const int32_t *token_seq, const int32_t *block_tables,
                                       int max_blocks, int n_tokens, int heads, int head_dim,
                                       int block_size, float scale) {
    const int item = blockIdx.x * ATTN_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (item >= n_tokens * heads) return; /* whole warps leave together */
    const int t = item / heads, h = item % heads;
    const int pos = positions[t];
    const int32_t *table = block_tables + (size_t)token_seq[t] * max_blocks;
    const size_t row = (size_t)heads * head_dim; /* one cache slot: all heads */

    float qr[PER_LANE], acc[PER_LANE];
    const T *qt = q + (size_t)t * q_stride + (size_t)h * head_dim;
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) {
        const int d = lane + 32 * i;
        qr[i] = d < head_dim ? to_f32(qt[d]) * scale : 0.0f;
        acc[i] = 0.0f;
    }

    float max = -INFINITY, sum = 0.0f;
    for (int p = 0; p <= pos; p++) {
        const size_t slot = (size_t)table[p / block_size] * block_size + (size_t)(p % block_size);
        const T *k = k_cache + slot * row + (size_t)h * head_dim;
        const T *v = v_cache + slot * row + (size_t)h * head_dim;
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) {
            const int d = lane + 32 * i;
            if (d < head_dim) s += qr[i] * to_f32(k[d]);
        }
        for (int o = 16; o > 0; o >>= 1)
            s += __shfl_xor_sync(0xffffffffu, s, o);
        if (s > max) { /* rescale what was summed under the old max */
            const float c = expf(max - s);
            sum *= c;
#pragma unroll
            for (int i = 0; i < PER_LANE; i++)
                acc[i] *= c;
            max = s;
        }
        const float e = expf(s - max);
        sum += e;
#pragma unroll
        for (int i = 0; i < PER_LANE; i++) {
            const int d = lane + 32 * i;
            if (d < head_dim) acc[i] += e * to_f32(v[d]);
        }
    }
    T *o = out + (size_t)t * row + (size_t)h * head_dim;
    const float inv = 1.0f / sum;
#pragma unroll
    for (int i = 0; i < PER_LANE; i++) {
        const int d = lane + 32 * i;
        if (d < head_dim) o[d] = from_f32<T>(acc[i] * inv);
    }
}

/* The block version: one thread block of ATTN_THREADS per (token, head),
 * for contexts whose scores fit in shared memory. The positions are split
 * across all the block's threads instead of walked one by one by a single
 * warp, which is what a decode step (few tokens, long contexts) needs:
 *   1. each thread scores its positions p = tid, tid + ATTN_THREADS, ...
 *      (q . k over head_dim, q pre-scaled, fp32) into shared memory;
 *   2. block-wide max, then e_p = exp(s_p - max) in place and their sum;
 *   3. the threads form groups of head_dim lanes; group g accumulates
 *      sum_p e_p v[p][d] over positions p = g, g + groups, ... (coalesced
 *      reads of V rows), the groups' partial sums are added in shared
 *      memory in a fixed order, and the result is divided by the sum.
 * Each (token, head) is computed the same way whatever else is in the step,
 * so results do not depend on the batch. */
#define ATTN_THREADS 256

__device__ __forceinline__ float block_reduce(float v, float *red, bool is_max) {
    return cuda_block_reduce<ATTN_THREADS>(v, red, is_max);
}

template <typename T>
__global__ void paged_attention_block_kernel(T *out, const T *q, int q_stride, const T *k_cache,
                                             const T *v_cache, const int32_t *positions,
                                             const int32_t *token_seq, const int32_t *block_tables,
                                             int max_blocks, int heads, int head_dim, int block_size,
                                             float scale) {
    extern __shared__ float smem[]; /* [head_dim] q, [ATTN_THREADS] partial outputs, [ctx] scores */
    __shared__ float red[ATTN_THREADS / 32];
    const int t = blockIdx.x / heads, h = blockIdx.x % heads;
    const int n_ctx = positions[t] + 1;
    const int32_t *table = block_tables + (size_t)token_seq[t] * max_blocks;
    const size_t row = (size_t)heads * head_dim;
    float *qs = smem, *part = smem + head_dim, *scores = part + ATTN_THREADS;
    const T *qt = q + (size_t)t * q_stride + (size_t)h * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += ATTN_THREADS) qs[d] = to_f32(qt[d]) * scale;
    __syncthreads();

    float mx = -INFINITY;
    for (int p = threadIdx.x; p < n_ctx; p += ATTN_THREADS) {
        const size_t slot = (size_t)table[p / block_size] * block_size + (size_t)(p % block_size);
        const T *k = k_cache + slot * row + (size_t)h * head_dim;
        float sc = 0.0f;
        for (int d = 0; d < head_dim; d++) sc += qs[d] * to_f32(k[d]);
        scores[p] = sc;
        mx = fmaxf(mx, sc);
    }
    mx = block_reduce(mx, red, true);
    float sum = 0.0f;
    for (int p = threadIdx.x; p < n_ctx; p += ATTN_THREADS) {
        const float e = expf(scores[p] - mx);
        scores[p] = e;
        sum += e;
    }
    sum = block_reduce(sum, red, false); /* its barriers also publish scores[] */

    const int groups = ATTN_THREADS / head_dim; /* head_dim <= ATTN_THREADS here */
    const int g = threadIdx.x / head_dim, d = threadIdx.x % head_dim;
    float acc = 0.0f;
    if (g < groups) {
        for (int p = g; p < n_ctx; p += groups) {
            const size_t slot = (size_t)table[p / block_size] * block_size + (size_t)(p % block_size);
            acc += scores[p] * to_f32(v_cache[slot * row + (size_t)h * head_dim + d]);
        }
    }
    part[threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.x < head_dim) {
        float o = 0.0f;
        for (int i = 0; i < groups; i++) o += part[i * head_dim + threadIdx.x];
        out[(size_t)t * row + (size_t)h * head_dim + threadIdx.x] = from_f32<T>(o / sum);
    }
}

template <typename T, int PER_LANE>
static void attention_launch(cudaStream_t s, void *out, const void *q, int q_stride,
                             const void *k_cache, const void *v_cache, const pd_step_meta *m,
                             int heads, int head_dim, int block_size, float scale) {
    const int items = m->n_tokens * heads;
    const unsigned blocks = (unsigned)((items + ATTN_WARPS - 1) / ATTN_WARPS);
    paged_attention_kernel<T, PER_LANE><<<blocks, 32 * ATTN_WARPS, 0, s>>>(
        (T *)out, (const T *)q, q_stride, (const T *)k_cache, (const T *)v_cache, m->positions,
        m->token_seq, m->block_tables, m->max_blocks, m->n_tokens, heads, head_dim, block_size,
        scale);
}

/* Registers per lane grow with head_dim, so pick the smallest PER_LANE that fits. */
template <typename T>
static void attention_pick(cudaStream_t s, void *out, const void *q, int q_stride,
                           const void *k_cache, const void *v_cache, const pd_step_meta *m,
                           int heads, int hd, int bs, float scale) {
    if (hd <= 32)
        attention_launch<T, 1>(s, out, q, q_stride, k_cache, v_cache, m, heads, hd, bs, scale);
    else if (hd <= 64)
        attention_launch<T, 2>(s, out, q, q_stride, k_cache, v_cache, m, heads, hd, bs, scale);
    else if (hd <= 96)
        attention_launch<T, 3>(s, out, q, q_stride, k_cache, v_cache, m, heads, hd, bs, scale);
    else if (hd <= 128)
        attention_launch<T, 4>(s, out, q, q_stride, k_cache, v_cache, m, heads, hd, bs, scale);
    else if (hd <= 256)
        attention_launch<T, 8>(s, out, q, q_stride, k_cache, v_cache, m, heads, hd, bs, scale);
    else
        attention_launch<T, 16>(s, out, q, q_stride, k_cache, v_cache, m, heads, hd, bs, scale);
}

/* Shared memory the block kernel needs for a context of n positions. */
static size_t block_smem(int head_dim, int n) {
    return sizeof(float) * ((size_t)head_dim + ATTN_THREADS + (size_t)n);
}

template <typename T>
static void attention_block_launch(cudaStream_t s, void *out, const void *q, int q_stride,
                                   const void *k_cache, const void *v_cache, const pd_step_meta *m,
                                   int heads, int head_dim, int block_size, float scale, size_t smem) {
    paged_attention_block_kernel<T><<<(unsigned)(m->n_tokens * heads), ATTN_THREADS, smem, s>>>(
        (T *)out, (const T *)q, q_stride, (const T *)k_cache, (const T *)v_cache, m->positions,
        m->token_seq, m->block_tables, m->max_blocks, heads, head_dim, block_size, scale);
}

void cuda_paged_attention(cudaStream_t s, pd_dtype dt, void *out, const void *q, int q_stride,
                          const void *k_cache, const void *v_cache, const pd_step_meta *meta,
                          int heads, int head_dim, int block_size, float scale, float *work,
                          size_t work_floats, const cuda_kv_pending *write, int *counters,
                          int pdl) {
    if (meta->n_tokens <= 0 || heads <= 0 || head_dim <= 0) {
        if (write)
            cuda_kv_write(s, dt, write->k_cache, write->v_cache, write->k, write->v, write->stride,
                          write->slot_mapping, write->T, write->kv_dim);
        return;
    }
    /* The longest context a step can have is max_blocks * block_size (the
     * block-table row length), known on the host without reading positions. */
    const int max_ctx = meta->max_blocks * block_size;
    /* A pure decode step (one query per sequence), or few queries of any
     * kind: spread each query's positions over a whole block (the split
     * kernel). At batch 256 the one-warp-per-query kernel below read the KV
     * cache at a fifth of the device's bandwidth, so a decode step takes
     * the split kernel at every batch size. Many queries of a prefill: the
     * flash kernel, or one warp each, which then fills the GPU. */
    const bool decode_step = meta->max_q_len == 1;
    const bool few_queries = decode_step || (long)meta->n_tokens * heads < 2048;
    /* A pure decode step writes its k and v in the attention kernel itself:
     * no token reads another's new row (unless sequences share a table:
     * then the write must come first). */
    const bool fuse_write = write && decode_step && !meta->shared_tables;
    if (fuse_write &&
        cuda_decode_attention(s, dt, out, q, q_stride, k_cache, v_cache, meta, heads, head_dim,
                              block_size, scale, work, work_floats, write, counters, pdl))
        return;
    if (write)
        cuda_kv_write(s, dt, write->k_cache, write->v_cache, write->k, write->v, write->stride,
                      write->slot_mapping, write->T, write->kv_dim);
    /* A prefill (or a chunk of one) in 16 bits: the tensor-core kernel, which
     * shares each K/V tile among 64 queries. fp32 keeps the kernels below,
     * exactly comparable with the CPU; so do decode-only steps. */
    if (cuda_flash_attention_fits(dt, out, q, q_stride, k_cache, v_cache, meta, heads, head_dim)) {
        cuda_flash_attention(s, dt, out, q, q_stride, k_cache, v_cache, meta, heads, head_dim,
                             block_size, scale);
        return;
    }
    const size_t smem = block_smem(head_dim, max_ctx);
    if (few_queries &&
        cuda_decode_attention(s, dt, out, q, q_stride, k_cache, v_cache, meta, heads, head_dim,
                              block_size, scale, work, work_floats, NULL, counters, 0))
        return;
    if (few_queries && head_dim <= ATTN_THREADS && smem <= 48 * 1024) {
        CUDA_DISPATCH(dt, E,
                      attention_block_launch<E>(s, out, q, q_stride, k_cache, v_cache, meta, heads,
                                                head_dim, block_size, scale, smem))
        return;
    }
    CUDA_DISPATCH(dt, E,
                  attention_pick<E>(s, out, q, q_stride, k_cache, v_cache, meta, heads, head_dim,
                                    block_size, scale))
}
