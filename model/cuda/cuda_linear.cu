/* cuda_linear: the fused linear op of backend.h,
 *   y (+)= act(LN(x) . W^T + bias)
 * with the layer norm, the activation and the accumulation (a residual add)
 * each optional (pd_linear_fuse).
 *
 * Small T (decode, T <= LIN_MAX_T): ONE kernel does everything. Streaming W
 * is the whole cost there, so the kernel is built around reading W once at
 * close to memory bandwidth:
 *  - A block owns NTILE tiles of 8 output features (8 rows of W) and its 8
 *    warps split the input dimension between them; each warp reads its
 *    share of its tile's 8 rows in 16-byte loads (lane l: row l / 4, 16
 *    bytes at (l % 4) * 16 of each chunk of 64 bytes), and the partial sums
 *    of the warps are added in shared memory at the end, in a fixed order.
 *  - The block first copies the T rows of x into shared memory and, when
 *    asked, normalises them there (two fp32 passes as the layer_norm
 *    kernel, every warp of the block on each row's sums). Every block redoes this: x is at most a few tens of
 *    KiB and sits in L2, which is cheaper than a second launch. The block's
 *    first weight loads are issued before it, so the two latencies overlap.
 *  - fp16/bf16: the products are tensor-core MMAs (m16n8k16) with x as the
 *    16-row operand (tokens 0..7, rows 8..15 zero) and W as the 8-column
 *    one, fp32 accumulation. The MMA's order of k within a 16-wide step does
 *    not matter to a dot product, so each lane feeds it the 8 contiguous
 *    elements of its 16-byte load (2 steps), and reads x with the same
 *    permutation.
 *  - fp32 (and 16-bit shapes whose rows are not 16-byte aligned): the same
 *    tiling with fp32 FMAs; no TF32, so "cuda" stays comparable to the CPU.
 *  - The epilogue adds the bias and applies the activation in fp32, rounds
 *    to the storage type and, when accumulating, adds y and rounds again
 *    (the rounding points of the unfused ops).
 *
 * Larger T (prefill): the layer norm kernel into f->ln_out, then one
 * cublasLtMatmul with the bias (and ReLU) in its epilogue and beta = 1 on y
 * for accumulate. What the epilogue cannot do (an activation other than
 * ReLU, an activation before an accumulation) is done by the element-wise
 * kernels afterwards. If cuBLASLt fails (no algorithm for a shape), cublasGemmEx
 * and the element-wise kernels do it.
 *
 * Nothing here allocates, synchronises or reads device memory on the host,
 * so the op can be captured into a CUDA graph. */
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "model/cuda/cuda_internal.cuh"

#define LIN_WARPS 8
#define LIN_THREADS (LIN_WARPS * 32)
#define LIN_MAX_T 8  /* T handled by the single kernel; the MMA's 8 columns */
#define LIN_UNROLL 4 /* 16-byte weight loads in flight per lane (FMA kernel) */
/* The MMA kernel holds 16 bytes per load where the FMA kernel widens them
 * to floats, so it affords twice as many loads in flight: at T = 1 the
 * bytes in flight, not the arithmetic, set the speed. A warp with more
 * chunks than that (a long input on few outputs: opt-125m's fc2, 3072 ->
 * 768, 12 chunks a warp) takes the LIN_UNROLL_MMA_LONG variant, so that
 * all of its weights are loaded before griddepcontrol.wait rather than
 * a second round after it. */
#define LIN_UNROLL_MMA 8
#define LIN_UNROLL_MMA_LONG 16
/* Two more sizes, chosen so that a linear's blocks fit on an SM beside the
 * previous one's: an SM has 64K registers, and at batch-1 decode fc1's 384
 * blocks sit 3 to an SM while fc2's 96 wait for room. At 80 registers a
 * thread (3 x 20K) and 128 for fc2 (32K) two of fc1's blocks had to retire
 * before an fc2 block could start loading its weights, and likewise qkv's
 * behind fc2. With up to 4 loads in flight at 56 registers (qkv, out_proj,
 * fc1 of opt-125m: 3 chunks a warp) and up to 12 at 88 (fc2: 12), three
 * blocks of one and one of the other use exactly 64K: the next linear's
 * blocks become resident, and load their weights, while the previous
 * linear still runs. ptxas reports no spills at these caps. */
#define LIN_UNROLL_MMA_SHORT 4
#define LIN_UNROLL_MMA_FIT_LONG 12
/* The register cap of each size (launch bounds 3 and 2 an SM for the older
 * two). */
#define LIN_MMA_MAXNREG(U) ((U) <= 4 ? 56 : (U) <= 8 ? 80 : (U) <= 12 ? 88 : 128)

/* One call's arguments, by value to the kernel. */
struct lin_params {
    void *y;
    const void *x, *w, *bias, *ln_w, *ln_b;
    int x_stride, T, in, out;
    int in_pad; /* row length of x in shared memory (see lin_in_pad) */
    float ln_eps;
    int layer_norm, activate, accumulate;
    int vec_x, vec_w; /* x rows / W rows may be read in 16-byte pieces */
    int vec_ln;       /* ln_w, ln_b may be read in 16-byte pieces */
    int n_vblocks;    /* tile blocks (NTILE tiles of 8 rows each) covering out */
    int32_t *argmax;  /* [T] each row's argmax too (MMA kernel only), or NULL */
    int32_t *argmax_copy; /* [T] the same ids again (device memory), or NULL */
    /* The embedding in front (pd_linear_fuse.emb_a): x's rows are made from
     * the tables, and block 0 writes them to x_out (== x). */
    const void *emb_a, *emb_b;
    const int32_t *emb_ia, *emb_ib;
    int emb_b_offset;
    void *x_out;
    float *am_v;      /* [gridDim.x][LIN_MAX_T] per-block bests (see lin_argmax_*) */
    int *am_i, *am_counter;
    pd_activation act;
};

/* Shared-memory row length for x: a multiple of 64 elements past `in`
 * (zero-filled, so the last chunk of a row needs no bounds check) plus 32,
 * so that 16-bit rows start 64 bytes apart modulo 128 and the MMA's x reads
 * (8 rows x 64 bytes per warp) are free of bank conflicts. */
static int lin_in_pad(int in) {
    return (in + 63) / 64 * 64 + 32;
}

__device__ __forceinline__ float lin_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* 16 bytes of storage elements widened to floats (4 or 8). */
__device__ __forceinline__ void lin_widen(const uint4 &v, float *f, float) {
    f[0] = __uint_as_float(v.x), f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z), f[3] = __uint_as_float(v.w);
}
__device__ __forceinline__ void lin_widen(const uint4 &v, float *f, __half) {
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
    for (int i = 0; i < 4; i++) {
        __half2 h;
        memcpy(&h, &u[i], 4);
        const float2 p = __half22float2(h);
        f[2 * i] = p.x, f[2 * i + 1] = p.y;
    }
}
__device__ __forceinline__ void lin_widen(const uint4 &v, float *f, __nv_bfloat16) {
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
    for (int i = 0; i < 4; i++) {
        __nv_bfloat162 h;
        memcpy(&h, &u[i], 4);
        const float2 p = __bfloat1622float2(h);
        f[2 * i] = p.x, f[2 * i + 1] = p.y;
    }
}

/* What a block can read before griddepcontrol.wait, because no earlier
 * kernel of the step writes it (the layer's own parameters), plus the
 * residual it will add, read right after the wait: all of it then travels
 * alongside the weight loads and x's staging instead of as three more
 * memory round trips at the end of the kernel's critical path.
 *  - ln_w, ln_b: this thread's 16 bytes of each (elements threadIdx.x * V
 *    .. + V), when one piece per thread covers the row (ln_vec);
 *  - bias, y_old: the epilogue thread's (see lin_epilogue) bias element
 *    and, when accumulating, the y element it adds. */
struct lin_pre {
    uint4 ln_w, ln_b;
    float bias, y_old;
    bool ln_vec;
};

/* The epilogue thread's output row and token; false when it has none. */
template <int NTILE>
__device__ __forceinline__ bool lin_epi_slot(const lin_params &p, int vb, int *row, int *t) {
    if (threadIdx.x >= NTILE * 64) return false;
    const int tile = threadIdx.x >> 6, e = threadIdx.x & 63;
    *t = e >> 3;
    *row = (vb * NTILE + tile) * 8 + (e & 7);
    return *t < p.T && *row < p.out;
}

/* The epilogue thread's bias element for tile block vb. */
template <typename E, int NTILE>
__device__ __forceinline__ float lin_bias_at(const lin_params &p, int vb) {
    int row, t;
    return p.bias && lin_epi_slot<NTILE>(p, vb, &row, &t) ? to_f32(__ldg((const E *)p.bias + row))
                                                          : 0.0f;
}

/* Before the wait: the layer's own parameters. */
template <typename E, int NTILE>
__device__ __forceinline__ lin_pre lin_prefetch(const lin_params &p) {
    constexpr int V = 16 / sizeof(E);
    lin_pre pre;
    pre.ln_w = pre.ln_b = make_uint4(0, 0, 0, 0);
    pre.bias = pre.y_old = 0.0f;
    pre.ln_vec = p.vec_ln && p.in <= V * (int)blockDim.x;
    const int k = (int)threadIdx.x * V;
    if (pre.ln_vec && k < p.in) {
        pre.ln_w = __ldg((const uint4 *)((const E *)p.ln_w + k));
        pre.ln_b = __ldg((const uint4 *)((const E *)p.ln_b + k));
    }
    pre.bias = lin_bias_at<E, NTILE>(p, blockIdx.x);
    return pre;
}

/* After the wait: the residual this thread's output adds to. */
template <typename E, int NTILE>
__device__ __forceinline__ void lin_load_acc(const lin_params &p, int vb, lin_pre *pre) {
    int row, t;
    if (p.accumulate && lin_epi_slot<NTILE>(p, vb, &row, &t))
        pre->y_old = to_f32(((const E *)p.y)[(size_t)t * p.out + row]);
}

/* 16 bytes of x's row t from element k: loaded, or (emb_a) the two
 * embedding rows' sum, rounded once as the embedding_sum op rounds it; then
 * block 0, x's one writer, stores it for the kernels after this one. Each
 * block stages every piece once, so each piece is stored once. */
template <typename E> __device__ __forceinline__ uint4 lin_x16(const lin_params &p, int t, int k) {
    if (!p.emb_a) return __ldg((const uint4 *)((const E *)p.x + (size_t)t * p.x_stride + k));
    constexpr int V = 16 / sizeof(E);
    const E *ra = (const E *)p.emb_a + (size_t)__ldg(p.emb_ia + t) * p.in;
    const E *rb = (const E *)p.emb_b + (size_t)(__ldg(p.emb_ib + t) + p.emb_b_offset) * p.in;
    float fa[V], fb[V];
    lin_widen(__ldg((const uint4 *)(ra + k)), fa, E());
    lin_widen(__ldg((const uint4 *)(rb + k)), fb, E());
    E sum[V];
#pragma unroll
    for (int j = 0; j < V; j++)
        sum[j] = from_f32<E>(fa[j] + fb[j]);
    uint4 v;
    memcpy(&v, sum, 16);
    if (blockIdx.x == 0) *(uint4 *)((E *)p.x_out + (size_t)t * p.x_stride + k) = v;
    return v;
}

/* The same for one element. */
template <typename E> __device__ __forceinline__ float lin_x1(const lin_params &p, int t, int k) {
    if (!p.emb_a) return to_f32(((const E *)p.x)[(size_t)t * p.x_stride + k]);
    const E *ra = (const E *)p.emb_a + (size_t)p.emb_ia[t] * p.in;
    const E *rb = (const E *)p.emb_b + (size_t)(p.emb_ib[t] + p.emb_b_offset) * p.in;
    const E v = from_f32<E>(to_f32(ra[k]) + to_f32(rb[k]));
    if (blockIdx.x == 0) ((E *)p.x_out)[(size_t)t * p.x_stride + k] = v;
    return to_f32(v);
}

/* x's T rows into shared memory xs ([T, in_pad] of S, zero past `in`), then
 * the layer norm in place when asked. Ends with the block synchronised. */
/* The batch-1 decode case of lin_stage_x (16-bit x kept as it is, one
 * 16-byte piece of the row per thread, the layer norm's parameters
 * prefetched): each thread keeps its piece in registers, so the row's two
 * sums take one barrier each and x is written to shared memory once,
 * already normalised. */
/* v summed over the block's LIN_THREADS threads in cuda_block_reduce's
 * order, without its leading barrier: each call passes its own part[]. */
__device__ __forceinline__ float lin_block_sum(float v, float *part) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = lin_warp_sum(v);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < LIN_WARPS; w++)
        s += part[w];
    return s;
}

template <typename E>
__device__ void lin_stage_ln_row(const lin_params &p, E *xs, const lin_pre &pre) {
    constexpr int V = 16 / sizeof(E);
    __shared__ float part_sum[LIN_WARPS], part_ss[LIN_WARPS];
    const int k0 = (int)threadIdx.x * V;
    const bool mine = k0 < p.in;
    float f[V];
    lin_widen(mine ? lin_x16<E>(p, 0, k0) : make_uint4(0, 0, 0, 0), f, E());
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < V; j++)
        sum += f[j];
    const float mean = lin_block_sum(sum, part_sum) / (float)p.in;
    float ss = 0.0f;
    if (mine)
#pragma unroll
        for (int j = 0; j < V; j++)
            ss += (f[j] - mean) * (f[j] - mean);
    ss = lin_block_sum(ss, part_ss);
    const float rstd = 1.0f / sqrtf(ss / (float)p.in + p.ln_eps);
    float fw[V], fb[V];
    lin_widen(pre.ln_w, fw, E());
    lin_widen(pre.ln_b, fb, E());
    E out[V];
#pragma unroll
    for (int j = 0; j < V; j++)
        out[j] = from_f32<E>((f[j] - mean) * rstd * fw[j] + fb[j]);
    uint4 packed;
    memcpy(&packed, out, 16);
    /* pieces past `in` (up to in_pad) are zero, as the MMA loop expects */
    for (int i = threadIdx.x; i < p.in_pad / V; i += blockDim.x)
        *(uint4 *)(xs + i * V) = i * V < p.in ? packed : make_uint4(0, 0, 0, 0);
    __syncthreads();
}

template <typename E, typename S>
__device__ void lin_stage_x(const lin_params &p, S *xs, const lin_pre &pre) {
    if constexpr (sizeof(S) == sizeof(E)) {
        if (p.T == 1 && p.vec_x && pre.ln_vec) {
            lin_stage_ln_row<E>(p, (E *)xs, pre);
            return;
        }
    }
    bool copied = false;
    if constexpr (sizeof(S) == sizeof(E)) {
        if (p.vec_x) { /* 16-byte pieces, no conversion */
            constexpr int V = 16 / sizeof(E);
            const int per_row = p.in_pad / V;
            for (int i = threadIdx.x; i < p.T * per_row; i += blockDim.x) {
                const int t = i / per_row, k = (i - t * per_row) * V;
                uint4 v = make_uint4(0, 0, 0, 0);
                if (k < p.in) v = lin_x16<E>(p, t, k);
                *(uint4 *)(xs + (size_t)t * p.in_pad + k) = v;
            }
            copied = true;
        }
    }
    if (!copied)
        for (int i = threadIdx.x; i < p.T * p.in_pad; i += blockDim.x) {
            const int t = i / p.in_pad, k = i - t * p.in_pad;
            xs[i] = from_f32<S>(k < p.in ? lin_x1<E>(p, t, k) : 0.0f);
        }
    __syncthreads();
    if (!p.layer_norm) return;
    /* Each row's sums are split into LIN_WARPS parts (part j: elements
     * j*32 + lane, then every LIN_WARPS*32), one warp per (row, part), and
     * the parts added in order: all warps work at T = 1, and the order of
     * the additions does not depend on T (a sequence gets the same
     * normalised row whatever else is in the batch). */
    __shared__ float part_sum[LIN_MAX_T * LIN_WARPS], part_ss[LIN_MAX_T * LIN_WARPS];
    __shared__ float row_mean[LIN_MAX_T], row_rstd[LIN_MAX_T];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int step = LIN_WARPS * 32;
    for (int pr = warp; pr < p.T * LIN_WARPS; pr += LIN_WARPS) {
        const S *row = xs + (size_t)(pr / LIN_WARPS) * p.in_pad;
        float sum = 0.0f;
        for (int k = (pr % LIN_WARPS) * 32 + lane; k < p.in; k += step)
            sum += to_f32(row[k]);
        sum = lin_warp_sum(sum);
        if (lane == 0) part_sum[pr] = sum;
    }
    __syncthreads();
    if (threadIdx.x < p.T) {
        float sum = 0.0f;
        for (int j = 0; j < LIN_WARPS; j++)
            sum += part_sum[threadIdx.x * LIN_WARPS + j];
        row_mean[threadIdx.x] = sum / (float)p.in;
    }
    __syncthreads();
    for (int pr = warp; pr < p.T * LIN_WARPS; pr += LIN_WARPS) {
        const S *row = xs + (size_t)(pr / LIN_WARPS) * p.in_pad;
        const float mean = row_mean[pr / LIN_WARPS];
        float ss = 0.0f;
        for (int k = (pr % LIN_WARPS) * 32 + lane; k < p.in; k += step) {
            const float d = to_f32(row[k]) - mean;
            ss += d * d;
        }
        ss = lin_warp_sum(ss);
        if (lane == 0) part_ss[pr] = ss;
    }
    __syncthreads();
    if (threadIdx.x < p.T) {
        float ss = 0.0f;
        for (int j = 0; j < LIN_WARPS; j++)
            ss += part_ss[threadIdx.x * LIN_WARPS + j];
        row_rstd[threadIdx.x] = 1.0f / sqrtf(ss / (float)p.in + p.ln_eps);
    }
    __syncthreads();
    const E *lw = (const E *)p.ln_w, *lb = (const E *)p.ln_b;
    if (pre.ln_vec) { /* the prefetched pieces: elements threadIdx.x * V .. + V */
        constexpr int V = 16 / sizeof(E);
        const int k0 = (int)threadIdx.x * V;
        float fw[V], fb[V];
        lin_widen(pre.ln_w, fw, E());
        lin_widen(pre.ln_b, fb, E());
        for (int t = 0; t < p.T && k0 < p.in; t++) {
            S *row = xs + (size_t)t * p.in_pad + k0;
            const float mean = row_mean[t], rstd = row_rstd[t];
#pragma unroll
            for (int j = 0; j < V; j++)
                row[j] = from_f32<S>((to_f32(row[j]) - mean) * rstd * fw[j] + fb[j]);
        }
    } else {
        for (int t = 0; t < p.T; t++) {
            S *row = xs + (size_t)t * p.in_pad;
            const float mean = row_mean[t], rstd = row_rstd[t];
            for (int k = threadIdx.x; k < p.in; k += blockDim.x) {
                float v = (to_f32(row[k]) - mean) * rstd;
                if (lw) v = v * to_f32(lw[k]) + to_f32(lb[k]);
                row[k] = from_f32<S>(v);
            }
        }
    }
    __syncthreads();
}

/* red[warp][t * 8 + r]: warp's partial sum for token t, row r of its tile.
 * Adds the warps of each tile in order, then bias, activation, accumulate. */
template <typename E, int NTILE>
__device__ void lin_epilogue(const lin_params &p, int vb, const float *red, const lin_pre &pre,
                             float *am_vals = NULL) {
    constexpr int KS = LIN_WARPS / NTILE;
    int row, t;
    if (!lin_epi_slot<NTILE>(p, vb, &row, &t)) return;
    const int tile = threadIdx.x >> 6, e = threadIdx.x & 63;
    float v = 0.0f;
#pragma unroll
    for (int kw = 0; kw < KS; kw++)
        v += red[(tile * KS + kw) * 64 + e];
    if (p.bias) v += pre.bias;
    if (p.activate) v = act_apply(v, p.act);
    E *y = (E *)p.y + (size_t)t * p.out + row;
    /* Round the product to the storage type before the residual is added,
     * as the unfused composition (and Hugging Face's Linear, then add) do:
     * one rounding less would differ from them by an ulp now and then, and
     * at a near tie that is a different greedy token. */
    if (p.accumulate) v = to_f32(from_f32<E>(v)) + pre.y_old;
    const E stored = from_f32<E>(v);
    *y = stored;
    /* The argmax sees the stored value, as the argmax op reading y would. */
    if (am_vals) am_vals[t * 32 + (threadIdx.x >> 6) * 8 + (threadIdx.x & 7)] = to_f32(stored);
}

/* ---- the fused argmax (the LM head) ----
 * The argmax op's rule (cuda_argmax_take), whose order is total: blocks may
 * meet their rows in any order and their bests may be merged in any order,
 * and the result is the argmax op's. */

/* Warp t (< T) folds tile block vb's values of token t (am_vals[t][l], l <
 * NTILE * 8: row (vb * NTILE + l / 8) * 8 + l % 8) into its best (lane 0's). */
template <int NTILE>
__device__ __forceinline__ void lin_am_fold(const lin_params &p, int vb, const float *am_vals,
                                            float &best_v, int &best_i) {
    const int lane = threadIdx.x & 31, t = threadIdx.x >> 5;
    if (t >= p.T) return;
    float v = -INFINITY;
    int idx = p.out;
    const int row = (vb * NTILE + lane / 8) * 8 + lane % 8;
    if (lane < NTILE * 8 && row < p.out) {
        const float f = am_vals[t * 32 + lane];
        if (!isnan(f)) v = f, idx = row;
    }
    cuda_argmax_warp(v, idx, p.out);
    if (lane == 0) cuda_argmax_take(best_v, best_i, v, idx, p.out);
}

/* After the block's last tile block: publish its bests; the last block to
 * finish merges every block's and writes the ids (0 for a row of NaN). */
__device__ void lin_am_finish(const lin_params &p, float best_v, int best_i) {
    __shared__ int am_last;
    const int lane = threadIdx.x & 31, t = threadIdx.x >> 5;
    if (t < p.T && lane == 0) {
        p.am_v[blockIdx.x * LIN_MAX_T + t] = best_v;
        p.am_i[blockIdx.x * LIN_MAX_T + t] = best_i;
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        am_last = atomicAdd(p.am_counter, 1) == (int)gridDim.x - 1;
        if (am_last) *p.am_counter = 0; /* ready for the next call */
    }
    __syncthreads();
    if (!am_last || t >= p.T) return;
    __threadfence(); /* the other blocks' bests, through L2 (__ldcg) */
    float v = -INFINITY;
    int idx = p.out;
    for (int b = lane; b < (int)gridDim.x; b += 32)
        cuda_argmax_take(v, idx, __ldcg(&p.am_v[b * LIN_MAX_T + t]),
                         __ldcg(&p.am_i[b * LIN_MAX_T + t]), p.out);
    cuda_argmax_warp(v, idx, p.out);
    if (lane == 0) cuda_argmax_store(p.argmax, p.argmax_copy, t, idx, p.out);
}

/* ---- fp16 / bf16: tensor-core MMA ---- */

/* c += A . B for one m16n8k16 step, A's rows 8..15 zero (a1 = a3 = 0). */
__device__ __forceinline__ void lin_mma(float *c, uint32_t a0, uint32_t a2, uint32_t b0,
                                        uint32_t b1, __half) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
#else
    __trap(); /* the host only picks this kernel on compute capability >= 8.0 */
#endif
}
__device__ __forceinline__ void lin_mma(float *c, uint32_t a0, uint32_t a2, uint32_t b0,
                                        uint32_t b1, __nv_bfloat16) {
#if __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}

/* Lane (g, q) = (lane / 4, lane % 4) of warp (tile, kw). Chunk c covers
 * input elements [32c, 32c + 32) of the tile's 8 rows; the lane loads
 * elements 32c + 8q .. +8 of row g. Its MMA fragments then are (PTX ISA,
 * m16n8k16): A = x, a0/a2 = token g, logical k 2q..2q+1 / 2q+8..2q+9;
 * B = W^T, b0/b1 = row g, the same k; D: c0/c1 = token g, rows 2q, 2q+1.
 * Logical k (2q + {0,1}, 2q + 8 + {0,1}) of step s is physical element
 * 8q + 4s + ({0,1}, {2,3}) of the chunk, for A and B alike. */
template <typename E, int NTILE, int UNROLL>
__global__ void __launch_bounds__(LIN_THREADS) __maxnreg__(LIN_MMA_MAXNREG(UNROLL))
    linear_mma_kernel(lin_params p) {
    constexpr int KS = LIN_WARPS / NTILE; /* warps sharing one tile's k range */
    extern __shared__ uint4 lin_dyn[];
    __shared__ float red[LIN_WARPS * 64];
    E *xs = (E *)lin_dyn;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, q = lane & 3, tile = warp / KS, kw = warp % KS;
    const int n_chunks = (p.in + 31) / 32;
    const int mine = kw < n_chunks ? (n_chunks - kw + KS - 1) / KS : 0; /* chunks kw, kw+KS.. */
    const int kmax = p.in - q * 8; /* in % 8 == 0 here: k < kmax means all 8 are inside */
    /* Tile block vb: this lane's row of W (see the grid in lin_small). */
    int vb = blockIdx.x;
    bool row_ok = false;
    const E *wrow = NULL;
    auto set_tiles = [&](int b) {
        const int row = (b * NTILE + tile) * 8 + g;
        row_ok = row < p.out;
        wrow = (const E *)p.w + (size_t)(row_ok ? row : 0) * p.in + q * 8;
    };
    set_tiles(vb);

    uint4 wv[UNROLL];
    auto load_w = [&](int i0) {
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int k = (kw + KS * (i0 + u)) * 32;
            wv[u] = row_ok && i0 + u < mine && k < kmax ? __ldg((const uint4 *)(wrow + k))
                                                        : make_uint4(0, 0, 0, 0);
        }
    };
    pdl_trigger();
    load_w(0); /* in flight while the previous kernel ends and x is staged */
    lin_pre pre = lin_prefetch<E, NTILE>(p);
    pdl_wait();
    lin_load_acc<E, NTILE>(p, vb, &pre);
    lin_stage_x<E, E>(p, xs, pre);

    const E *xrow = xs + (size_t)g * p.in_pad + q * 8;
    const bool tok_ok = g < p.T;
    __shared__ float am_vals[LIN_MAX_T * 32]; /* the fused argmax's values of one tile block */
    float best_v = -INFINITY;
    int best_i = p.out;
    for (;;) {
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int i0 = 0; i0 < mine; i0 += UNROLL) {
            if (i0) load_w(i0);
#pragma unroll
            for (int u = 0; u < UNROLL; u++) {
                if (i0 + u >= mine) break;
                const int k = (kw + KS * (i0 + u)) * 32;
                const uint4 xv = tok_ok ? *(const uint4 *)(xrow + k) : make_uint4(0, 0, 0, 0);
                lin_mma(c, xv.x, xv.y, wv[u].x, wv[u].y, E());
                lin_mma(c, xv.z, xv.w, wv[u].z, wv[u].w, E());
            }
        }
        red[warp * 64 + lane * 2] = c[0]; /* token g, rows 2q and 2q + 1: index g * 8 + 2q */
        red[warp * 64 + lane * 2 + 1] = c[1];
        __syncthreads();
        lin_epilogue<E, NTILE>(p, vb, red, pre, p.argmax ? am_vals : NULL);
        if (p.argmax) {
            __syncthreads();
            lin_am_fold<NTILE>(p, vb, am_vals, best_v, best_i);
        }
        /* The next tile block, if the grid is smaller than the tiles (the
         * LM head): x stays staged and normalised, only W moves on. */
        vb += gridDim.x;
        if (vb >= p.n_vblocks) {
            if (p.argmax) lin_am_finish(p, best_v, best_i);
            break;
        }
        set_tiles(vb);
        load_w(0);
        pre.bias = lin_bias_at<E, NTILE>(p, vb);
        lin_load_acc<E, NTILE>(p, vb, &pre);
        __syncthreads(); /* red is rewritten only after every epilogue read it */
    }
}

/* ---- fp32 (and unaligned 16-bit rows): CUDA-core FMAs ----
 * The same tiling; a chunk is 4 lanes x V elements (16 bytes of fp32, or 8
 * 16-bit elements). Lanes of one q read the same x, a shared-memory
 * broadcast. x is kept in fp32 in shared memory. */
template <typename E, int NTILE>
__global__ void __launch_bounds__(LIN_THREADS) linear_simt_kernel(lin_params p) {
    constexpr int KS = LIN_WARPS / NTILE;
    constexpr int V = 16 / sizeof(E), CW = 4 * V;
    extern __shared__ uint4 lin_dyn[];
    __shared__ float red[LIN_WARPS * 64];
    float *xs = (float *)lin_dyn;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, q = lane & 3, tile = warp / KS, kw = warp % KS;
    const int row = (blockIdx.x * NTILE + tile) * 8 + g;
    const int n_chunks = (p.in + CW - 1) / CW;
    const int mine = kw < n_chunks ? (n_chunks - kw + KS - 1) / KS : 0;
    const bool row_ok = row < p.out;
    const E *wrow = (const E *)p.w + (size_t)(row_ok ? row : 0) * p.in + q * V;
    const int kmax = p.in - q * V;

    float wf[LIN_UNROLL][V];
    auto load_w = [&](int i0) {
#pragma unroll
        for (int u = 0; u < LIN_UNROLL; u++) {
            const int k = (kw + KS * (i0 + u)) * CW;
            const bool ok = row_ok && i0 + u < mine;
            if (p.vec_w) {
                const uint4 v =
                    ok && k < kmax ? __ldg((const uint4 *)(wrow + k)) : make_uint4(0, 0, 0, 0);
                lin_widen(v, wf[u], E());
            } else {
#pragma unroll
                for (int j = 0; j < V; j++)
                    wf[u][j] = ok && k + j < kmax ? to_f32(wrow[k + j]) : 0.0f;
            }
        }
    };
    pdl_trigger();
    load_w(0);
    lin_pre pre = lin_prefetch<E, NTILE>(p);
    pdl_wait();
    lin_load_acc<E, NTILE>(p, blockIdx.x, &pre);
    lin_stage_x<E, float>(p, xs, pre);

    float acc[LIN_MAX_T];
#pragma unroll
    for (int t = 0; t < LIN_MAX_T; t++)
        acc[t] = 0.0f;
    const float *xcol = xs + q * V;
    for (int i0 = 0; i0 < mine; i0 += LIN_UNROLL) {
        if (i0) load_w(i0);
#pragma unroll
        for (int u = 0; u < LIN_UNROLL; u++) {
            if (i0 + u >= mine) break;
            const int k = (kw + KS * (i0 + u)) * CW;
#pragma unroll
            for (int t = 0; t < LIN_MAX_T; t++) {
                if (t >= p.T) break;
                const float4 *xr = (const float4 *)(xcol + (size_t)t * p.in_pad + k);
                float s = acc[t];
#pragma unroll
                for (int j = 0; j < V / 4; j++) {
                    const float4 xv = xr[j];
                    s = fmaf(wf[u][4 * j], xv.x, s);
                    s = fmaf(wf[u][4 * j + 1], xv.y, s);
                    s = fmaf(wf[u][4 * j + 2], xv.z, s);
                    s = fmaf(wf[u][4 * j + 3], xv.w, s);
                }
                acc[t] = s;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < LIN_MAX_T; t++) {
        acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], 1);
        acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], 2);
        if (t < p.T && (t & 3) == q) red[warp * 64 + t * 8 + g] = acc[t];
    }
    __syncthreads();
    lin_epilogue<E, NTILE>(p, blockIdx.x, red, pre);
}

/* ---- host side ---- */

/* ---- the LM head of one token (batch-1 decode): a streaming GEMV ----
 * 768 -> 50,272 is 73.6 MiB of weights for 2 KiB of input: the tile
 * kernels above spend their time on shared-memory traffic and
 * per-tile-block barriers there, and layer norm + cuBLASLt + the argmax
 * op is three launches. Here each warp owns whole rows of W: lane l reads
 * the 16-byte pieces l, l + 32, .. of a row (CPL of them), so a
 * warp's loads of one row are 512 contiguous bytes, and it keeps
 * head_rows(CPL) rows in flight; the next group's loads are issued before this
 * group's sums are reduced. Each block normalises x once into shared
 * memory (lin_stage_ln_row, the small-T kernels' own layer norm), each
 * warp keeps its best (value, row) by the argmax rule, and the last block
 * to finish merges the blocks' bests (lin_am_finish). Products are fp32
 * FMAs in a fixed order (per lane over its pieces, then a butterfly), the
 * sum rounded to the storage type before the argmax sees it, as the
 * argmax op reading y would. */
/* Blocks an SM holds (the launch bounds): 2 leave the rows in flight and
 * the widened pieces their registers without spilling. */
#define HEAD_BLOCKS_PER_SM 2
/* Rows a warp has in flight: ~12 pieces (48 registers) a lane, at least
 * one row. The kernel's template argument and lin_head's grid both use it. */
__host__ __device__ constexpr int head_rows(int cpl) {
    return cpl >= 12 ? 1 : 12 / cpl;
}

template <typename E, int CPL>
__global__ void __launch_bounds__(LIN_THREADS, HEAD_BLOCKS_PER_SM)
    linear_head_kernel(lin_params p) {
    constexpr int R = head_rows(CPL), V = 8;
    extern __shared__ uint4 lin_dyn[];
    __shared__ float warp_v[LIN_WARPS];
    __shared__ int warp_i[LIN_WARPS];
    E *xs = (E *)lin_dyn;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int groups = (p.out + R - 1) / R, stride = (int)gridDim.x * LIN_WARPS;
    const E *w = (const E *)p.w;
    uint4 wv[R][CPL];
    auto load = [&](int grp, int r0, int r1) {
#pragma unroll
        for (int r = r0; r < r1; r++) {
            const int row = grp * R + r;
            const E *wr = w + (size_t)(row < p.out ? row : 0) * p.in + lane * V;
#pragma unroll
            for (int c = 0; c < CPL; c++)
                wv[r][c] =
                    row < p.out ? __ldg((const uint4 *)(wr + c * 32 * V)) : make_uint4(0, 0, 0, 0);
        }
    };
    int grp = (int)blockIdx.x * LIN_WARPS + warp;
    pdl_trigger();
    /* Only a group's first row before the wait: all of them would be ~19
     * MiB read while the last layer's fc2, still running, reads its own. */
    if (grp < groups) load(grp, 0, 1);
    const lin_pre pre = lin_prefetch<E, 1>(p);
    pdl_wait();
    if (grp < groups) load(grp, 1, R);
    if (p.layer_norm) {
        lin_stage_ln_row<E>(p, xs, pre);
    } else {
        for (int i = threadIdx.x; i < p.in / V; i += blockDim.x)
            *(uint4 *)(xs + i * V) = __ldg((const uint4 *)((const E *)p.x + i * V));
        __syncthreads();
    }
    float best_v = -INFINITY;
    int best_i = p.out;
    for (; grp < groups; grp += stride) {
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; r++)
            acc[r] = 0.0f;
#pragma unroll
        for (int c = 0; c < CPL; c++) {
            float xf[V];
            lin_widen(*(const uint4 *)(xs + (c * 32 + lane) * V), xf, E());
#pragma unroll
            for (int r = 0; r < R; r++) {
                float wf[V];
                lin_widen(wv[r][c], wf, E());
#pragma unroll
                for (int j = 0; j < V; j++)
                    acc[r] = fmaf(wf[j], xf[j], acc[r]);
            }
        }
        if (grp + stride < groups) load(grp + stride, 0, R);
#pragma unroll
        for (int r = 0; r < R; r++) {
            const int row = grp * R + r;
            if (row >= p.out) break;
            float v = lin_warp_sum(acc[r]);
            if (p.bias) v += to_f32(__ldg((const E *)p.bias + row));
            const E stored = from_f32<E>(v);
            if (lane == r % 32) ((E *)p.y)[row] = stored;
            const float f = to_f32(stored);
            if (!isnan(f)) cuda_argmax_take(best_v, best_i, f, row, p.out);
        }
    }
    if (!p.argmax) return;
    if (lane == 0) warp_v[warp] = best_v, warp_i[warp] = best_i;
    __syncthreads();
    if (warp == 0) {
        float v = lane < LIN_WARPS ? warp_v[lane] : -INFINITY;
        int idx = lane < LIN_WARPS ? warp_i[lane] : p.out;
        cuda_argmax_warp(v, idx, p.out);
        best_v = v, best_i = idx;
    }
    lin_am_finish(p, best_v, best_i);
}

/* The instance for CPL pieces a lane (in = CPL * 256 16-bit elements). */
#define LIN_HEAD_MAX_CPL 8
template <typename E> static void *lin_head_kernel_for(int cpl) {
    void *const kernels[LIN_HEAD_MAX_CPL] = {
        (void *)linear_head_kernel<E, 1>, (void *)linear_head_kernel<E, 2>,
        (void *)linear_head_kernel<E, 3>, (void *)linear_head_kernel<E, 4>,
        (void *)linear_head_kernel<E, 5>, (void *)linear_head_kernel<E, 6>,
        (void *)linear_head_kernel<E, 7>, (void *)linear_head_kernel<E, 8>};
    return cpl >= 1 && cpl <= LIN_HEAD_MAX_CPL ? kernels[cpl - 1] : NULL;
}

/* The MMA kernel's sizes (loads in flight a lane), smallest first; a call
 * takes lin_size_for's index into it. */
static const int lin_unrolls[] = {LIN_UNROLL_MMA_SHORT, LIN_UNROLL_MMA, LIN_UNROLL_MMA_FIT_LONG,
                                  LIN_UNROLL_MMA_LONG};
#define LIN_SIZES ((int)(sizeof lin_unrolls / sizeof *lin_unrolls))
#define LIN_SIZE_LOOP 1 /* LIN_UNROLL_MMA: also the size that loops */

/* For chunks_per_warp chunks a warp: the smallest size that loads them all
 * before griddepcontrol.wait, else 8 loads in a loop. fit_off: the two
 * older sizes only. Any size gives the same result (the chunks are added
 * in the same order); only how much is loaded before the wait differs. */
static int lin_size_for(int chunks_per_warp, bool fit_off) {
    for (int i = 0; i < LIN_SIZES; i++) {
        const int u = lin_unrolls[i];
        const bool fit_size = u == LIN_UNROLL_MMA_SHORT || u == LIN_UNROLL_MMA_FIT_LONG;
        if (chunks_per_warp <= u && !(fit_off && fit_size)) return i;
    }
    return LIN_SIZE_LOOP;
}

template <typename E, int NTILE> static void *lin_kernel(bool mma, int size) {
    if constexpr (sizeof(E) == 2) {
        void *const sizes[LIN_SIZES] = {
            (void *)linear_mma_kernel<E, NTILE, LIN_UNROLL_MMA_SHORT>,
            (void *)linear_mma_kernel<E, NTILE, LIN_UNROLL_MMA>,
            (void *)linear_mma_kernel<E, NTILE, LIN_UNROLL_MMA_FIT_LONG>,
            (void *)linear_mma_kernel<E, NTILE, LIN_UNROLL_MMA_LONG>};
        if (mma) return sizes[size];
    }
    (void)size;
    return (void *)linear_simt_kernel<E, NTILE>;
}

static void *lin_kernel_for(pd_dtype dt, bool mma, int ntile, int size) {
    CUDA_DISPATCH(dt, E,
                  return ntile == 4   ? lin_kernel<E, 4>(mma, size)
                         : ntile == 2 ? lin_kernel<E, 2>(mma, size)
                                      : lin_kernel<E, 1>(mma, size))
    return NULL;
}

cudaError_t cuda_linear_init(cuda_linear_env *env, int device) {
    int optin = 0, major = 0;
    cudaError_t e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(&env->sm_count, cudaDevAttrMultiProcessorCount, device);
    if (e == cudaSuccess)
        e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    if (e != cudaSuccess) return e;
    env->mma_ok = major >= 8;
    const char *pdl = getenv("PDSERVE_CUDA_PDL");
    env->pdl = major >= 9 && !(pdl && strcmp(pdl, "0") == 0);
    const char *head = getenv("PDSERVE_CUDA_HEAD");
    env->head_route = head && !strcmp(head, "fused")   ? cuda_linear_env::CUDA_HEAD_FUSED
                      : head && !strcmp(head, "split") ? cuda_linear_env::CUDA_HEAD_SPLIT
                      : head && !strcmp(head, "blas")  ? cuda_linear_env::CUDA_HEAD_BLAS
                                                       : cuda_linear_env::CUDA_HEAD_GEMV;
    const char *t1 = getenv("PDSERVE_CUDA_T1_NTILE");
    env->t1_ntile = t1 && (!strcmp(t1, "2") || !strcmp(t1, "4")) ? atoi(t1) : 1;
    const char *fit = getenv("PDSERVE_CUDA_LIN_FIT");
    env->fit_off = fit && !strcmp(fit, "0");
    const char *small = getenv("PDSERVE_CUDA_SMALL");
    env->small_off = small && !strcmp(small, "0");
    /* The kernels' static shared memory (the partial sums) comes off the top. */
    env->smem_max = (size_t)optin > 4096 ? (size_t)optin - 4096 : 0;
    /* The grid of the MMA kernel is at most 3 blocks an SM (lin_small). */
    env->am_blocks = 3 * env->sm_count;
    /* Also the split argmax's scratch (cuda_argmax): at least its rows x parts. */
    size_t am_n = (size_t)LIN_MAX_T * env->am_blocks;
    if (am_n < CUDA_ARGMAX_SPLIT_ROWS * CUDA_ARGMAX_PARTS)
        am_n = CUDA_ARGMAX_SPLIT_ROWS * CUDA_ARGMAX_PARTS;
    e = cudaMalloc((void **)&env->am_v, sizeof(float) * am_n);
    if (e == cudaSuccess) e = cudaMalloc((void **)&env->am_i, sizeof(int) * am_n);
    if (e == cudaSuccess) e = cudaMalloc((void **)&env->am_counter, sizeof(int));
    if (e == cudaSuccess) e = cudaMemset(env->am_counter, 0, sizeof(int));
    if (e != cudaSuccess) return e;
    const pd_dtype dts[] = {PD_F32, PD_F16, PD_BF16};
    for (int d = 0; d < 3; d++)
        for (int mma = 0; mma < 2; mma++)
            for (int ntile = 1; ntile <= 4; ntile *= 2)
                for (int size = 0; size < LIN_SIZES; size++) {
                    void *k = lin_kernel_for(dts[d], mma, ntile, size);
                    e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)env->smem_max);
                    if (e == cudaSuccess) e = cuda_set_carveout(k);
                    if (e != cudaSuccess) return e;
                }
    for (int cpl = 1; cpl <= LIN_HEAD_MAX_CPL; cpl++) {
        e = cuda_set_carveout(lin_head_kernel_for<__half>(cpl));
        if (e == cudaSuccess) e = cuda_set_carveout(lin_head_kernel_for<__nv_bfloat16>(cpl));
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

void cuda_linear_free(cuda_linear_env *env) {
    if (env->am_v) cudaFree(env->am_v);
    if (env->am_i) cudaFree(env->am_i);
    if (env->am_counter) cudaFree(env->am_counter);
    env->am_v = NULL, env->am_i = NULL, env->am_counter = NULL;
}

static int lin_aligned16(const void *p) {
    return ((uintptr_t)p & 15) == 0;
}

/* Outputs from which a call counts as an LM head (head_route). */
#define LIN_HEAD_OUT 16384

/* The single-kernel path; false when the call does not fit it. */
static bool lin_small(cuda_linear_env *env, pd_dtype dt, const lin_params &base) {
    lin_params p = base;
    if (p.T > LIN_MAX_T || env->small_off) return false;
    const bool lm_head = p.out >= LIN_HEAD_OUT;
    /* the GEMV route's calls other than lin_head's take cuBLASLt too */
    if (lm_head && (env->head_route == cuda_linear_env::CUDA_HEAD_BLAS ||
                    env->head_route == cuda_linear_env::CUDA_HEAD_GEMV))
        return false;
    const size_t es = pd_dtype_size(dt);
    const bool w_vec = lin_aligned16(p.w) && (p.in * es) % 16 == 0;
    const bool mma = dt != PD_F32 && env->mma_ok && w_vec;
    p.in_pad = lin_in_pad(p.in);
    const size_t smem = (size_t)p.T * p.in_pad * (mma ? es : sizeof(float));
    if (smem > env->smem_max) return false;
    p.vec_w = w_vec;
    p.vec_ln = p.layer_norm && p.ln_w && p.ln_b && lin_aligned16(p.ln_w) && lin_aligned16(p.ln_b) &&
               (p.in * es) % 16 == 0;
    /* 16-byte x copies only where shared memory keeps the storage type. */
    p.vec_x = (mma || dt == PD_F32) && lin_aligned16(p.x) && (p.x_stride * es) % 16 == 0 &&
              (p.in * es) % 16 == 0 &&
              (!p.emb_a || (lin_aligned16(p.emb_a) && lin_aligned16(p.emb_b)));
    /* More tiles per block share one copy of x (less L2 traffic as T
     * grows), fewer give more blocks (better spread over the SMs). */
    int ntile = p.T <= 2 ? 1 : p.T <= 4 ? 2 : 4;
    if (p.T == 1) ntile = env->t1_ntile;
    /* Very many outputs (the LM head: 50,272) leave blocks enough at 4
     * tiles, and each block's fixed cost (staging and normalising x) is
     * then paid a quarter as often. */
    if ((p.out + 7) / 8 >= 32 * env->sm_count) ntile = 4;
    while (ntile > 1 && (p.out + 8 * ntile - 1) / (8 * ntile) < env->sm_count)
        ntile /= 2;
    p.n_vblocks = (p.out + 8 * ntile - 1) / (8 * ntile);
    /* The MMA kernel loops over tile blocks, so a grid of what fits on the
     * device at once (its launch bounds) does a long output (the LM head:
     * 1,571 tile blocks) in one pass, each block staging and normalising x
     * once instead of once per tile block. */
    const int chunks_per_warp = ((p.in + 31) / 32 + LIN_WARPS / ntile - 1) / (LIN_WARPS / ntile);
    const int size = lin_size_for(chunks_per_warp, env->fit_off);
    const int resident =
        mma ? (lin_unrolls[size] > LIN_UNROLL_MMA ? 2 : 3) * env->sm_count : p.n_vblocks;
    const unsigned blocks = (unsigned)(p.n_vblocks < resident ? p.n_vblocks : resident);
    /* The argmax rides in the MMA kernel; the FMA kernel's rows get the
     * argmax op after it. */
    int32_t *argmax_after = NULL, *argmax_copy_after = NULL;
    if (p.argmax && (!mma || (int)blocks > env->am_blocks ||
                     (lm_head && env->head_route == cuda_linear_env::CUDA_HEAD_SPLIT))) {
        argmax_after = p.argmax, argmax_copy_after = p.argmax_copy;
        p.argmax = NULL, p.argmax_copy = NULL;
    }
    p.am_v = env->am_v, p.am_i = env->am_i, p.am_counter = env->am_counter;
    void *k = lin_kernel_for(dt, mma, ntile, size);
    void *args[] = {&p};
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg =
        cuda_launch_cfg(dim3(blocks), dim3(LIN_THREADS), smem, env->stream, env->pdl, &attr);
    cudaLaunchKernelExC(&cfg, k, args); /* errors: cudaGetLastError */
    if (argmax_after) {
        const cuda_argmax_scratch scr = cuda_linear_argmax_scratch(env);
        cuda_argmax(env->stream, dt, argmax_after, argmax_copy_after, p.y, p.T, p.out, &scr,
                    env->pdl);
    }
    return true;
}

/* The LM head of one token, 16-bit (linear_head_kernel); false when the
 * call is not one it takes (then lin_small or cuBLASLt does). */
static bool lin_head(cuda_linear_env *env, pd_dtype dt, const lin_params &base) {
    lin_params p = base;
    if (env->head_route != cuda_linear_env::CUDA_HEAD_GEMV || env->small_off || p.T != 1 ||
        p.out < LIN_HEAD_OUT || dt == PD_F32 || p.activate || p.accumulate || p.emb_a)
        return false;
    const int cpl = p.in / 256; /* 16-byte pieces of a row a lane reads */
    if (p.in % 256 || cpl > LIN_HEAD_MAX_CPL || !lin_aligned16(p.w) || !lin_aligned16(p.x) ||
        (p.bias && !lin_aligned16(p.bias)))
        return false;
    p.in_pad = lin_in_pad(p.in);
    p.vec_x = p.vec_w = 1;
    if (p.layer_norm) { /* lin_stage_ln_row: one 16-byte piece of the row a thread */
        p.vec_ln = p.ln_w && p.ln_b && lin_aligned16(p.ln_w) && lin_aligned16(p.ln_b);
        if (!p.vec_ln || p.in > 8 * LIN_THREADS) return false;
    }
    const int rows = head_rows(cpl);
    const int groups = (p.out + rows - 1) / rows;
    int blocks = (groups + LIN_WARPS - 1) / LIN_WARPS;
    if (blocks > HEAD_BLOCKS_PER_SM * env->sm_count) blocks = HEAD_BLOCKS_PER_SM * env->sm_count;
    if (blocks > env->am_blocks) blocks = env->am_blocks; /* lin_am_finish's scratch */
    p.am_v = env->am_v, p.am_i = env->am_i, p.am_counter = env->am_counter;
    void *k =
        dt == PD_F16 ? lin_head_kernel_for<__half>(cpl) : lin_head_kernel_for<__nv_bfloat16>(cpl);
    void *args[] = {&p};
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = cuda_launch_cfg(
        dim3(blocks), dim3(LIN_THREADS), (size_t)p.in_pad * 2, env->stream, env->pdl, &attr);
    cudaLaunchKernelExC(&cfg, k, args); /* errors: cudaGetLastError */
    return true;
}

/* ---- large T: layer norm, then cuBLASLt (or cublasGemmEx) ---- */

static cudaDataType lin_cuda_type(pd_dtype t) {
    return t == PD_F16 ? CUDA_R_16F : t == PD_BF16 ? CUDA_R_16BF : CUDA_R_32F;
}

/* Largest power of two (<= 256) dividing the address and the row pitch:
 * what cuBLASLt may assume of a matrix. */
static uint32_t lin_alignment(const void *p, size_t pitch_bytes) {
    const uintptr_t a = (uintptr_t)p | pitch_bytes;
    uint32_t al = 256;
    while (al > 1 && (a & (al - 1)))
        al >>= 1;
    return al;
}

/* y(+)= x W^T (+ bias, relu per epi) through cuBLASLt. Returns the status;
 * CUBLAS_STATUS_NOT_SUPPORTED when no algorithm takes the problem. Nothing
 * is queued unless it returns success. */
static cublasStatus_t lin_lt(cuda_linear_env *env, pd_dtype dt, void *y, const void *x, int ldx,
                             const void *w, const void *bias, int T, int in, int out,
                             cublasLtEpilogue_t epi, int beta_one) {
    const size_t es = pd_dtype_size(dt);
    const uint32_t al_a = lin_alignment(w, in * es), al_b = lin_alignment(x, (size_t)ldx * es);
    const uint32_t al_c = lin_alignment(y, out * es);
    const int key[12] = {(int)dt,  T,         in,        out,       ldx,          (int)epi,
                         beta_one, (int)al_a, (int)al_b, (int)al_c, bias != NULL, 1};
    const cudaDataType t = lin_cuda_type(dt);
    cublasLtMatmulDesc_t op = NULL;
    cublasLtMatrixLayout_t la = NULL, lb = NULL, lc = NULL;
    cublasLtMatmulPreference_t pref = NULL;
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    /* Column-major view (see cuda_backend.cu): y^T[out,T] = (W^T)^T[out,in] . x^T[in,T]. */
    cublasStatus_t st = cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi);
    if (st == CUBLAS_STATUS_SUCCESS && bias)
        st = cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                            sizeof bias);
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatrixLayoutCreate(&la, t, in, out, in);
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatrixLayoutCreate(&lb, t, in, T, ldx);
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatrixLayoutCreate(&lc, t, out, T, out);

    cuda_lt_entry *hit = NULL;
    for (int i = 0; i < CUDA_LT_CACHE && st == CUBLAS_STATUS_SUCCESS; i++)
        if (env->lt_cache[i].used && !memcmp(env->lt_cache[i].key, key, sizeof key)) {
            hit = &env->lt_cache[i];
            break;
        }
    if (st == CUBLAS_STATUS_SUCCESS && !hit) {
        const uint64_t ws = env->workspace_bytes;
        st = cublasLtMatmulPreferenceCreate(&pref);
        const cublasLtMatmulPreferenceAttributes_t which[] = {
            CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
            CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
        const uint32_t values[] = {al_a, al_b, al_c, al_c};
        if (st == CUBLAS_STATUS_SUCCESS)
            st = cublasLtMatmulPreferenceSetAttribute(
                pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
        for (int i = 0; i < 4 && st == CUBLAS_STATUS_SUCCESS; i++)
            st = cublasLtMatmulPreferenceSetAttribute(pref, which[i], &values[i], sizeof values[i]);
        cublasLtMatmulHeuristicResult_t res;
        int n = 0;
        if (st == CUBLAS_STATUS_SUCCESS)
            st = cublasLtMatmulAlgoGetHeuristic(env->lt, op, la, lb, lc, lc, pref, 1, &res, &n);
        if (st == CUBLAS_STATUS_SUCCESS && n < 1) st = CUBLAS_STATUS_NOT_SUPPORTED;
        if (st == CUBLAS_STATUS_SUCCESS) {
            hit = &env->lt_cache[env->lt_next];
            env->lt_next = (env->lt_next + 1) % CUDA_LT_CACHE;
            hit->used = 1;
            memcpy(hit->key, key, sizeof key);
            hit->algo = res.algo;
        }
    }
    if (st == CUBLAS_STATUS_SUCCESS) {
        const float alpha = 1.0f, beta = beta_one ? 1.0f : 0.0f;
        st = cublasLtMatmul(env->lt, op, &alpha, w, la, x, lb, &beta, y, lc, y, lc, &hit->algo,
                            env->workspace, env->workspace_bytes, env->stream);
    }
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
    return st;
}

/* The same product through cublasGemmEx, the bias by the bias kernel:
 * for shapes cuBLASLt has no algorithm for. */
static cublasStatus_t lin_gemm_ex(cuda_linear_env *env, pd_dtype dt, void *y, const void *x,
                                  int ldx, const void *w, const void *bias, int T, int in, int out,
                                  int beta_one) {
    const float one = 1.0f, beta = beta_one ? 1.0f : 0.0f;
    const cudaDataType t = lin_cuda_type(dt);
    cublasStatus_t st =
        cublasGemmEx(env->blas, CUBLAS_OP_T, CUBLAS_OP_N, out, T, in, &one, w, t, in, x, t, ldx,
                     &beta, y, t, out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st == CUBLAS_STATUS_SUCCESS && bias) cuda_bias_add(env->stream, dt, y, bias, T, out);
    return st;
}

int cuda_linear(cuda_linear_env *env, pd_dtype dt, void *y, const void *x, int x_stride,
                const void *w, const void *bias, int T, int in, int out, const pd_linear_fuse *f,
                char *msg, size_t msg_len) {
    if (T <= 0 || out <= 0 || in <= 0) return 0;
    if (f->emb_a && x_stride != in) {
        snprintf(msg, msg_len, "linear with the embedding fused: x must be dense (stride %d, in %d)",
                 x_stride, in);
        return -1;
    }
    lin_params p;
    memset(&p, 0, sizeof p);
    p.y = y, p.x = x, p.w = w, p.bias = bias;
    p.x_stride = x_stride, p.T = T, p.in = in, p.out = out;
    p.layer_norm = f->layer_norm, p.ln_w = f->ln_w, p.ln_b = f->ln_b, p.ln_eps = f->ln_eps;
    p.activate = f->activate, p.act = f->act, p.accumulate = f->accumulate;
    p.argmax = f->argmax, p.argmax_copy = f->argmax_copy;
    p.emb_a = f->emb_a, p.emb_b = f->emb_b, p.emb_ia = f->emb_ia, p.emb_ib = f->emb_ib;
    p.emb_b_offset = f->emb_b_offset;
    p.x_out = const_cast<void *>(x); /* written only with emb_a (backend.h) */
    if (lin_head(env, dt, p) || lin_small(env, dt, p)) return 0;

    if (f->emb_a) /* the embedding op first, into x */
        cuda_embedding_sum(env->stream, dt, p.x_out, f->emb_a, f->emb_ia, f->emb_b, f->emb_ib,
                           f->emb_b_offset, T, in);

    if (f->layer_norm) {
        cuda_layer_norm(env->stream, dt, f->ln_out, x, x_stride, f->ln_w, f->ln_b, T, in,
                        f->ln_eps, env->pdl);
        x = f->ln_out;
        x_stride = in;
    }
    /* An activation must see the product before y is added, and a 16-bit
     * product is rounded before it is added (see lin_epilogue): then the
     * product goes to acc_tmp and is added afterwards. */
    const bool via_tmp = f->accumulate && (f->activate || dt != PD_F32);
    void *dst = via_tmp ? f->acc_tmp : y;
    const bool relu_in_epi = f->activate && f->act == PD_ACT_RELU;
    const int beta_one = f->accumulate && !via_tmp;
    const cublasLtEpilogue_t epi =
        bias ? (relu_in_epi ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_BIAS)
             : (relu_in_epi ? CUBLASLT_EPILOGUE_RELU : CUBLASLT_EPILOGUE_DEFAULT);
    bool act_done = relu_in_epi;
    cublasStatus_t st = lin_lt(env, dt, dst, x, x_stride, w, bias, T, in, out, epi, beta_one);
    if (st != CUBLAS_STATUS_SUCCESS) { /* nothing was queued: do it the plain way */
        st = lin_gemm_ex(env, dt, dst, x, x_stride, w, bias, T, in, out, beta_one);
        act_done = false;
    }
    if (st != CUBLAS_STATUS_SUCCESS) {
        snprintf(msg, msg_len, "cuBLASLt matmul (T=%d, in=%d, out=%d): %s", T, in, out,
                 cublasGetStatusString(st));
        return -1;
    }
    if (f->activate && !act_done) cuda_activation(env->stream, dt, dst, (size_t)T * out, f->act);
    if (via_tmp) cuda_add(env->stream, dt, y, dst, (size_t)T * out);
    if (f->argmax) {
        const cuda_argmax_scratch scr = cuda_linear_argmax_scratch(env);
        cuda_argmax(env->stream, dt, f->argmax, f->argmax_copy, y, T, out, &scr, env->pdl);
    }
    return 0;
}
