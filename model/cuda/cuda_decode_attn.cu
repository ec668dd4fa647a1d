/* cuda_decode_attn: attention for steps with few queries (decode), split
 * along the context ("flash decoding").
 *
 * A decode step has one query per sequence: batch 1 on a 12-head model is
 * only 12 (token, head) items, far too few blocks to keep an H200's 132 SMs
 * busy while each walks thousands of cached positions. So every item's
 * context is cut into parts of DEC_PART positions, and a thread block does
 * one part (few items) or several of one item in turn (many items: a batch
 * of 256 has blocks enough, and a grid of a block per possible part would
 * be mostly blocks with nothing to do). Per part:
 *   1. each thread scores one position (q . k, q pre-scaled, fp32);
 *   2. the part's max m and sum l of exp(s - m) (block reductions);
 *   3. the part's unnormalised output o = sum_p exp(s_p - m) v_p, with the
 *      threads in groups of head_dim lanes reading V rows coalesced;
 * and the last block of an item to finish (a counter of finished parts per
 * item, counted up with atomicAdd after a __threadfence, and reset by that
 * last block for the next step) merges the item's parts in order:
 *   M = max m_i, out = sum exp(m_i - M) o_i / sum exp(m_i - M) l_i.
 * In a pure decode step the kernel also writes the token's own k and v into
 * the cache first (the block whose part holds the token's position does it,
 * then a barrier): no other token reads them, so kv_write's launch is saved.
 * A context of at most DEC_PART positions has one part, written out directly
 * (the merge skips it). The split depends only on the item's own context
 * length, never on what else is in the step, so results stay independent of
 * the batch; the grid depends only on host-known sizes (the block-table row
 * length bounds every context), so a recorded graph stays valid for any
 * context lengths up to it. */
#include <math.h>

#include "model/cuda/cuda_internal.cuh"

#define DEC_PART 256    /* positions per part (= threads per block) */
#define DEC_THREADS 256
/* Blocks a call aims for: 132 SMs x 8 resident blocks of 256 threads, twice
 * over (see the grid in cuda_decode_attention). */
#define DEC_TARGET_BLOCKS 2048
/* Shared floats for the groups' partial outputs: groups * head_dim, at most
 * DEC_THREADS * 8 (8 = 16-byte loads of 16-bit values). */
#define DEC_ACC (DEC_THREADS * 8)

__device__ __forceinline__ float dec_reduce(float v, float *red, bool is_max) {
    return cuda_block_reduce<DEC_THREADS>(v, red, is_max);
}

/* q . k over head_dim with 16-byte loads when the row allows it. */
template <typename T> __device__ __forceinline__ float dec_dot(const float *qs, const T *k, int hd) {
    float s = 0.0f;
    for (int d = 0; d < hd; d++) s += qs[d] * to_f32(k[d]);
    return s;
}
/* s plus q . k over one 16-byte piece of a 16-bit K row (8 elements, the
 * dims q8[0..7]): the one formula of both the loading and the prefetched
 * path, so the two give the same bits. */
__device__ __forceinline__ float2 dec_pair(uint32_t w, __half) {
    __half2 h;
    memcpy(&h, &w, 4);
    return __half22float2(h);
}
__device__ __forceinline__ float2 dec_pair(uint32_t w, __nv_bfloat16) {
    __nv_bfloat162 h;
    memcpy(&h, &w, 4);
    return __bfloat1622float2(h);
}
template <typename T>
__device__ __forceinline__ float dec_dot8(float s, const float *q8, const uint4 &u) {
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float2 f = dec_pair(w[j], T());
        s += q8[2 * j] * f.x + q8[2 * j + 1] * f.y;
    }
    return s;
}
template <typename T>
__device__ __forceinline__ float dec_dot16(const float *qs, const T *k, int hd) {
    float s = 0.0f;
    if ((hd & 7) == 0) {
        const uint4 *k4 = (const uint4 *)k;
#pragma unroll 4 /* several 16-byte loads in flight */
        for (int c = 0; c < hd / 8; c++)
            s = dec_dot8<T>(s, qs + 8 * c, k4[c]);
        return s;
    }
    for (int d = 0; d < hd; d++)
        s += qs[d] * to_f32(k[d]);
    return s;
}
template <>
__device__ __forceinline__ float dec_dot<__half>(const float *qs, const __half *k, int hd) {
    return dec_dot16<__half>(qs, k, hd);
}
template <>
__device__ __forceinline__ float dec_dot<__nv_bfloat16>(const float *qs, const __nv_bfloat16 *k,
                                                        int hd) {
    return dec_dot16<__nv_bfloat16>(qs, k, hd);
}

/* acc[j] += w * v_j over one 16-byte piece of a V row. */
template <typename T>
__device__ __forceinline__ void dec_axpy(float *acc, float w, const uint4 &u) {
    constexpr int VEC = 16 / sizeof(T);
    const T *vv = (const T *)&u;
#pragma unroll
    for (int j = 0; j < VEC; j++)
        acc[j] += w * to_f32(vv[j]);
}

/* The prefetching variant (see decode_part_kernel) is built for one shape,
 * a 16-bit head of 64 dims (OPT-125m to -1.3b): 128-byte K and V rows,
 * read as 8 lanes of 16 bytes, so the block's 256 threads form 32 groups.
 * The first part's rows go to shared memory with cp.async (no registers
 * held across the wait, so the block fits beside the kernel before it). */
#define DEC_PRE_HEAD_DIM 64
#define DEC_PRE_PIECES 8      /* 16-byte pieces of a row */
#define DEC_PRE_MAX_ITEMS 128 /* a block per SM or so: batch 1..10 of 12 heads */
/* Shared bytes of the prefetched K and V rows: a part of each. */
#define DEC_PRE_SMEM (2 * DEC_PART * DEC_PRE_HEAD_DIM * 2)
struct dec_pre {
    bool on;   /* this part's rows are in kv: the cached ones copied before
                * the wait, the token's own one staged after it */
    uint4 *kv; /* [DEC_PART] K rows, then [DEC_PART] V rows, 8 pieces each */
};

__device__ __forceinline__ void dec_copy16(uint4 *dst, const void *src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned at = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(at), "l"(src) : "memory");
#else
    *dst = *(const uint4 *)src;
#endif
}
__device__ __forceinline__ void dec_copy_wait(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

/* Whether V rows are read in 16-byte pieces (head_dim / VEC lanes a row)
 * rather than one element per lane (head_dim lanes). */
template <typename T> __device__ __forceinline__ bool dec_vec(int head_dim, const T *v_cache) {
    constexpr int VEC = 16 / sizeof(T);
    return head_dim % VEC == 0 && DEC_THREADS % (head_dim / VEC) == 0 &&
           (uintptr_t)v_cache % 16 == 0;
}
/* Lanes that read one V row; the block's threads form DEC_THREADS / lanes groups. */
template <typename T> __device__ __forceinline__ int dec_lanes(int head_dim, const T *v_cache) {
    return dec_vec<T>(head_dim, v_cache) ? head_dim / (16 / (int)sizeof(T)) : head_dim;
}

/* One part's scores, softmax sums and unnormalised output, written to
 * acc_part (per group) and returned as (max, sum) through *mx_out, *sum_out.
 * Ends with a barrier, so acc_part is complete for every thread. */
template <typename T>
__device__ __forceinline__ void
decode_one_part(const float *qs, float *acc_part, float *e, float *red, const T *v_cache,
                const T *k_cache, const int32_t *table, size_t row, int h, int head_dim,
                int block_size, int p0, int p1, const dec_pre &pre, float *mx_out, float *sum_out) {
    const int p = p0 + (int)threadIdx.x;
    float sc = -INFINITY;
    if constexpr (sizeof(T) == 2) {
        if (pre.on && p < p1) { /* the prefetched row (or the new one, staged with them) */
            const uint4 *k4 = pre.kv + (size_t)threadIdx.x * DEC_PRE_PIECES;
            sc = 0.0f;
#pragma unroll
            for (int c = 0; c < DEC_PRE_PIECES; c++)
                sc = dec_dot8<T>(sc, qs + 8 * c, k4[c]);
        }
    }
    if (p < p1 && !pre.on) {
        const size_t slot = (size_t)table[p / block_size] * block_size + (size_t)(p % block_size);
        sc = dec_dot<T>(qs, k_cache + slot * row + (size_t)h * head_dim, head_dim);
    }
    const float mx = dec_reduce(sc, red, true);
    const float ex = p < p1 ? expf(sc - mx) : 0.0f;
    e[threadIdx.x] = ex;
    const float sum = dec_reduce(ex, red, false); /* its barriers also publish e[] */

    /* o = sum e_p v_p. Vectorised (head_dim a multiple of one 16-byte load):
     * head_dim / VEC lanes cover a V row in 16-byte loads and the block's
     * DEC_THREADS / lanes groups take every groups-th position, so a
     * ~200-position part is a handful of loads per thread, several in
     * flight; otherwise groups of head_dim lanes read 1 element each.
     * acc_part[g * head_dim + d]: group g's sum for dim d, added in group
     * order by the caller. */
    constexpr int VEC = 16 / sizeof(T);
    const bool vec = dec_vec<T>(head_dim, v_cache);
    const int lanes = dec_lanes<T>(head_dim, v_cache);
    const int groups = DEC_THREADS / lanes;
    const int g = threadIdx.x / lanes, c = threadIdx.x % lanes;
    if (vec) {
        float acc[VEC];
#pragma unroll
        for (int j = 0; j < VEC; j++) acc[j] = 0.0f;
        auto v_row = [&](int pp) {
            const size_t slot = (size_t)table[pp / block_size] * block_size + (size_t)(pp % block_size);
            return *(const uint4 *)(v_cache + slot * row + (size_t)h * head_dim + c * VEC);
        };
        if (pre.on) { /* the same rows in the same order, from shared memory */
            const uint4 *v4 = pre.kv + (size_t)(DEC_PART + g) * DEC_PRE_PIECES + c;
#pragma unroll 4
            for (int pp = p0 + g; pp < p1; pp += groups, v4 += groups * DEC_PRE_PIECES)
                dec_axpy<T>(acc, e[pp - p0], *v4);
        } else {
#pragma unroll 4
            for (int pp = p0 + g; pp < p1; pp += groups)
                dec_axpy<T>(acc, e[pp - p0], v_row(pp));
        }
#pragma unroll
        for (int j = 0; j < VEC; j++) acc_part[g * head_dim + c * VEC + j] = acc[j];
    } else {
        float acc = 0.0f;
        if (g < groups)
            for (int pp = p0 + g; pp < p1; pp += groups) {
                const size_t slot = (size_t)table[pp / block_size] * block_size + (size_t)(pp % block_size);
                acc += e[pp - p0] * to_f32(v_cache[slot * row + (size_t)h * head_dim + c]);
            }
        acc_part[g * head_dim + c] = acc;
    }
    __syncthreads();
    *mx_out = mx;
    *sum_out = sum;
}

/* The groups' partial outputs added up per dim: Q = DEC_THREADS / head_dim
 * threads on each dim (neighbouring lanes) each add a run of groups/Q in
 * order, then butterfly shuffles add the Q runs (the same total on every
 * lane: each step adds two values, which commutes); one thread per dim
 * when head_dim does not split the block so. Returns the sum, with *dim
 * the dim this thread writes out (-1: none). Every thread must call it. */
__device__ __forceinline__ float dec_group_sum(const float *acc_part, int groups, int head_dim,
                                               int *dim) {
    const int Q = DEC_THREADS / head_dim;
    const bool split =
        DEC_THREADS % head_dim == 0 && Q <= 32 && (Q & (Q - 1)) == 0 && groups % Q == 0;
    float o = 0.0f;
    if (!split) {
        *dim = (int)threadIdx.x < head_dim ? (int)threadIdx.x : -1;
        if (*dim >= 0)
            for (int i = 0; i < groups; i++)
                o += acc_part[i * head_dim + *dim];
        return o;
    }
    const int d = (int)threadIdx.x / Q, j = (int)threadIdx.x % Q, run = groups / Q;
    for (int i = j * run; i < (j + 1) * run; i++)
        o += acc_part[i * head_dim + d];
    for (int w = 1; w < Q; w <<= 1)
        o += __shfl_xor_sync(0xffffffffu, o, w);
    *dim = j == 0 ? d : -1;
    return o;
}

/* Grid (items, slots): block (item, y) does the item's parts y, y + slots,
 * y + 2 slots, ... Many items (a large batch) take one slot, so no block
 * is launched for a part that a short context does not have; few items
 * take a slot per part, spreading one long context over the SMs. Either
 * way the parts, and the merge below, are the same, and so is the result. */
template <typename T, bool PRE>
__global__ void decode_part_kernel(float *part_o, float *part_ml, int *counters, T *out, const T *q,
                                   int q_stride, T *k_cache, T *v_cache, const T *k_new,
                                   const T *v_new, int new_stride, const int32_t *slot_mapping,
                                   const int32_t *positions, const int32_t *token_seq,
                                   const int32_t *block_tables, int max_blocks, int heads,
                                   int head_dim, int block_size, float scale, int n_parts) {
    pdl_trigger(); /* the next (PDL-launched) kernel may start loading its weights */
    extern __shared__ float smem[]; /* [head_dim] q, [DEC_ACC] group sums, [DEC_PART] e */
    __shared__ float red[DEC_THREADS / 32];
    __shared__ int last_part;
    const int item = blockIdx.x, slots = (int)gridDim.y;
    const int t = item / heads, h = item % heads;
    /* The step's metadata was copied in before the step's first kernel, so
     * it may be read before the wait. */
    const int n_ctx = positions[t] + 1;
    if ((int)blockIdx.y * DEC_PART >= n_ctx) return; /* the whole block: this context is shorter */
    const int32_t *table = block_tables + (size_t)token_seq[t] * max_blocks;
    const size_t row = (size_t)heads * head_dim;
    /* PRE (a PDL launch, 16-bit, head_dim 64, this step writes each
     * sequence's one new row itself): every cached row but the token's own
     * was written by earlier steps, so the block's first part of K and V is
     * loaded before the wait, while the qkv projection that feeds q still
     * runs; only q and the new row wait for it. */
    dec_pre pre;
    pre.on = PRE;
    pre.kv = (uint4 *)(smem + head_dim + DEC_ACC + DEC_PART);
    if constexpr (PRE) { /* thread i: position p0 + i's K row and V row */
        const int p = (int)blockIdx.y * DEC_PART + (int)threadIdx.x;
        if (p < n_ctx - 1) {
            const size_t slot =
                (size_t)table[p / block_size] * block_size + (size_t)(p % block_size);
            const size_t at = slot * row + (size_t)h * head_dim;
            uint4 *dst = pre.kv + (size_t)threadIdx.x * DEC_PRE_PIECES;
#pragma unroll
            for (int c = 0; c < DEC_PRE_PIECES; c++) {
                dec_copy16(dst + c, k_cache + at + 8 * c);
                dec_copy16(dst + DEC_PART * DEC_PRE_PIECES + c, v_cache + at + 8 * c);
            }
        }
    }
    /* Thread d < head_dim (head_dim <= DEC_THREADS) owns dim d of q and, if
     * this block does the part holding the token, of its own k and v: all
     * three are loaded together right after the wait, one round trip to L2
     * on the critical path instead of two (q, then k and v). */
    const int d = (int)threadIdx.x, tok_part = (n_ctx - 1) / DEC_PART;
    const bool has_token =
        k_new && tok_part >= (int)blockIdx.y && (tok_part - (int)blockIdx.y) % slots == 0;
    const int32_t tok_slot = has_token ? slot_mapping[t] : -1;
    pdl_wait(); /* q and the new row: written by the kernel before */
    float qd = 0.0f;
    T kd = T(), vd = T();
    if (d < head_dim) {
        qd = to_f32(q[(size_t)t * q_stride + (size_t)h * head_dim + d]);
        if (has_token) {
            kd = k_new[(size_t)t * new_stride + (size_t)h * head_dim + d];
            vd = v_new[(size_t)t * new_stride + (size_t)h * head_dim + d];
        }
    }
    if constexpr (PRE) dec_copy_wait(); /* this thread's copies; the barrier below shares them */
    float *qs = smem, *acc_part = smem + head_dim, *e = acc_part + DEC_ACC;
    if (d < head_dim) qs[d] = qd * scale;
    const int groups = DEC_THREADS / dec_lanes<T>(head_dim, v_cache);
    int done = 0;
    for (int part_i = blockIdx.y; part_i * DEC_PART < n_ctx; part_i += slots) {
        const int p0 = part_i * DEC_PART, p1 = min(n_ctx, p0 + DEC_PART);
        if (has_token && p1 == n_ctx) { /* this part holds the token itself: its k, v first */
            /* With the part prefetched, the new row also goes where its
             * neighbours are (saving the part two reads of it from L2). */
            T *staged = pre.on ? (T *)pre.kv + (size_t)(n_ctx - 1 - p0) * head_dim : NULL;
            if (d < head_dim) {
                if (tok_slot >= 0) {
                    const size_t at = (size_t)tok_slot * row + (size_t)h * head_dim + d;
                    k_cache[at] = kd;
                    v_cache[at] = vd;
                }
                if (staged) {
                    staged[d] = kd;
                    staged[(size_t)DEC_PART * head_dim + d] = vd;
                }
            }
        }
        __syncthreads(); /* q in place; the k, v written above before their reads */
        float mx, sum;
        decode_one_part<T>(qs, acc_part, e, red, v_cache, k_cache, table, row, h, head_dim,
                           block_size, p0, p1, pre, &mx, &sum);
        pre.on = false; /* only the first part was prefetched */
        int dim;
        const float o = dec_group_sum(acc_part, groups, head_dim, &dim);
        if (n_ctx <= DEC_PART) { /* the only part: the output itself */
            if (dim >= 0) out[(size_t)t * row + (size_t)h * head_dim + dim] = from_f32<T>(o / sum);
            return;
        }
        const size_t at = (size_t)item * n_parts + part_i;
        if (dim >= 0) {
            part_o[at * head_dim + dim] = o;
            if (threadIdx.x == 0) {
                part_ml[2 * at] = mx;
                part_ml[2 * at + 1] = sum;
            }
        }
        done++;
        __syncthreads(); /* acc_part and e are reused by the next part */
    }
    /* Publish this block's parts, then count them; the item's last block merges. */
    __threadfence();
    __syncthreads();
    const int used = (n_ctx + DEC_PART - 1) / DEC_PART;
    if (threadIdx.x == 0) {
        last_part = atomicAdd(&counters[item], done) + done == used;
        if (last_part) counters[item] = 0; /* ready for the next step */
    }
    __syncthreads();
    if (!last_part) return;
    __threadfence(); /* the other parts' results, seen through L2 (__ldcg) */
    const float *ml = part_ml + (size_t)item * n_parts * 2;
    float M = -INFINITY;
    for (int i = 0; i < used; i++) M = fmaxf(M, __ldcg(&ml[2 * i]));
    float L = 0.0f;
    for (int i = 0; i < used; i++) L += expf(__ldcg(&ml[2 * i]) - M) * __ldcg(&ml[2 * i + 1]);
    for (int dd = threadIdx.x; dd < head_dim; dd += DEC_THREADS) {
        float o = 0.0f;
        for (int i = 0; i < used; i++)
            o += expf(__ldcg(&ml[2 * i]) - M) *
                 __ldcg(&part_o[((size_t)item * n_parts + i) * head_dim + dd]);
        out[(size_t)t * row + (size_t)h * head_dim + dd] = from_f32<T>(o / L);
    }
}

cudaError_t cuda_decode_attention_init(void) {
    /* The prefetching kernels' shared memory passes the default 48 KiB. */
    const int bytes = (int)(sizeof(float) * (DEC_PRE_HEAD_DIM + DEC_ACC + DEC_PART) + DEC_PRE_SMEM);
    cudaError_t e = cudaFuncSetAttribute(decode_part_kernel<__half, true>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e == cudaSuccess)
        e = cudaFuncSetAttribute(decode_part_kernel<__nv_bfloat16, true>,
                                 cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    const void *kernels[] = {(const void *)decode_part_kernel<float, false>,
                             (const void *)decode_part_kernel<__half, false>,
                             (const void *)decode_part_kernel<__nv_bfloat16, false>,
                             (const void *)decode_part_kernel<__half, true>,
                             (const void *)decode_part_kernel<__nv_bfloat16, true>};
    for (int i = 0; i < 5 && e == cudaSuccess; i++)
        e = cuda_set_carveout(kernels[i]);
    return e;
}

size_t cuda_decode_attention_work(int n_tokens, int heads, int head_dim, int max_ctx) {
    const size_t parts = (size_t)(max_ctx + DEC_PART - 1) / DEC_PART;
    return (size_t)n_tokens * heads * parts * ((size_t)head_dim + 2);
}

template <typename T, bool PRE>
static void decode_launch(cudaStream_t s, dim3 grid, size_t smem, int pdl, float *part_o,
                          float *part_ml, int *counters, void *out, const void *q, int q_stride,
                          const void *k_cache, const void *v_cache, const cuda_kv_pending *write,
                          const pd_step_meta *m, int heads, int head_dim, int block_size,
                          float scale, int n_parts) {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = cuda_launch_cfg(grid, dim3(DEC_THREADS), smem, s, pdl, &attr);
    cudaLaunchKernelEx(&cfg, decode_part_kernel<T, PRE>, part_o, part_ml, counters, (T *)out,
                       (const T *)q, q_stride, (T *)k_cache, (T *)v_cache,
                       write ? (const T *)write->k : (const T *)NULL,
                       write ? (const T *)write->v : (const T *)NULL, write ? write->stride : 0,
                       m->slot_mapping, m->positions, m->token_seq, m->block_tables, m->max_blocks,
                       heads, head_dim, block_size, scale, n_parts); /* errors: cudaGetLastError */
}

/* The prefetching kernel exists for 16-bit types only. */
template <typename T>
static void decode_pick(bool pre, cudaStream_t s, dim3 grid, size_t smem, int pdl, float *part_o,
                        float *part_ml, int *counters, void *out, const void *q, int q_stride,
                        const void *k_cache, const void *v_cache, const cuda_kv_pending *write,
                        const pd_step_meta *m, int heads, int head_dim, int block_size, float scale,
                        int n_parts) {
    if constexpr (sizeof(T) == 2) {
        if (pre) {
            decode_launch<T, true>(s, grid, smem, pdl, part_o, part_ml, counters, out, q, q_stride,
                                   k_cache, v_cache, write, m, heads, head_dim, block_size, scale,
                                   n_parts);
            return;
        }
    }
    (void)pre;
    decode_launch<T, false>(s, grid, smem, pdl, part_o, part_ml, counters, out, q, q_stride,
                            k_cache, v_cache, write, m, heads, head_dim, block_size, scale,
                            n_parts);
}

bool cuda_decode_attention(cudaStream_t s, pd_dtype dt, void *out, const void *q, int q_stride,
                           const void *k_cache, const void *v_cache, const pd_step_meta *m,
                           int heads, int head_dim, int block_size, float scale, float *work,
                           size_t work_floats, const cuda_kv_pending *write, int *counters,
                           int pdl) {
    const int max_ctx = m->max_blocks * block_size;
    if (head_dim > DEC_THREADS || max_ctx <= 0 || !counters ||
        (long)m->n_tokens * heads > CUDA_DECODE_MAX_ITEMS ||
        cuda_decode_attention_work(m->n_tokens, heads, head_dim, max_ctx) > work_floats)
        return false;
    if (write && (write->k_cache != k_cache || write->v_cache != v_cache || write->T != m->n_tokens ||
                  write->kv_dim != heads * head_dim || write->slot_mapping != m->slot_mapping))
        return false; /* not this layer's write (cannot happen from opt.c): launch it apart */
    const int n_parts = (max_ctx + DEC_PART - 1) / DEC_PART;
    const int items = m->n_tokens * heads;
    float *part_o = work, *part_ml = work + (size_t)items * n_parts * head_dim;
    size_t smem = sizeof(float) * ((size_t)head_dim + DEC_ACC + DEC_PART);
    /* Slots per item: a part each while the items alone are too few blocks
     * to fill the device, else fewer (each block then walks several parts;
     * see decode_part_kernel). Depends only on host-known sizes, so a
     * recorded graph keeps it. */
    const int want = (DEC_TARGET_BLOCKS + items - 1) / items;
    const int slots = want < 1 ? 1 : want > n_parts ? n_parts : want;
    const dim3 grid((unsigned)items, (unsigned)slots);
    /* Prefetching takes 64 KiB more shared memory a block, which only pays
     * while the items are few (DEC_PRE_MAX_ITEMS: batch 1..10 of a 12-head
     * model); a large batch keeps the plain kernel and its occupancy.
     * Either gives the same bits. */
    const bool pre = pdl && write && dt != PD_F32 && head_dim == DEC_PRE_HEAD_DIM &&
                     items <= DEC_PRE_MAX_ITEMS && (uintptr_t)k_cache % 16 == 0 &&
                     (uintptr_t)v_cache % 16 == 0;
    if (pre) smem += DEC_PRE_SMEM;
    CUDA_DISPATCH(dt, E,
                  decode_pick<E>(pre, s, grid, smem, pdl && write, part_o, part_ml, counters, out,
                                 q, q_stride, k_cache, v_cache, write, m, heads, head_dim,
                                 block_size, scale, n_parts))
    return true;
}
