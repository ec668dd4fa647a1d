/* cuda_internal: what the CUDA backend's files share (not a public API):
 * the element types, the dtype dispatch, and the kernel launchers that
 * cuda_backend.cu calls. Every launcher queues work on the given stream and
 * returns at once; launch errors are picked up by the caller with
 * cudaGetLastError (see cuda_backend.cu). */
#ifndef PD_CUDA_INTERNAL_CUH
#define PD_CUDA_INTERNAL_CUH

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

extern "C" {
#include "model/backend.h"
}

/* ---- element types: storage is float, __half or __nv_bfloat16; math is float ---- */

__device__ __forceinline__ float to_f32(float v) {
    return v;
}
__device__ __forceinline__ float to_f32(__half v) {
    return __half2float(v);
}
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) {
    return __bfloat162float(v);
}

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) {
    return v;
}
template <> __device__ __forceinline__ __half from_f32<__half>(float v) {
    return __float2half_rn(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

/* The activations of backend.h, the same formulas as the CPU backend (exact erf GELU). */
__device__ __forceinline__ float act_apply(float v, pd_activation act) {
    switch (act) {
    case PD_ACT_RELU:
        return v > 0.0f ? v : 0.0f;
    case PD_ACT_GELU:
        return 0.5f * v * (1.0f + erff(v * 0.70710678f));
    case PD_ACT_GELU_NEW:
        return 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)));
    case PD_ACT_SILU:
        return v / (1.0f + expf(-v));
    }
    return v;
}

/* Programmatic dependent launch (compute capability >= 9.0). A decode step
 * is a chain of short kernels, each mostly waiting on memory; a kernel
 * launched with the programmatic-serialization attribute (the small-T
 * linear) may start while the one before it is still running, so its
 * weight loads, which depend on nothing earlier, overlap that kernel's
 * tail and the launch gap. The rules that keep this exact:
 *  - pdl_trigger(): the kernel lets the next one start early; any kernel
 *    may call it (it only matters when the next one is PDL-launched);
 *  - pdl_wait(): a PDL-launched kernel calls it, in every block, before it
 *    reads anything an earlier kernel wrote and before it writes anything:
 *    it returns once the previous kernel has finished and its writes are
 *    visible. Since every block waits, "finished" is transitive: the
 *    kernel before that one has finished too.
 * On older GPUs both are no-ops and the host launches normally. */
__device__ __forceinline__ void pdl_trigger(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/* One shared-memory carveout for the kernels of a decode step. An SM
 * changes its split between L1 and shared memory only when it is idle, so
 * a chain of kernels that the driver would give different splits (the
 * linears need little shared memory, the prefetching decode attention
 * 73 KiB a block) cannot overlap under PDL; one preference for all of them
 * (PDSERVE_CUDA_CARVEOUT percent, default 100: the most shared memory; -1:
 * the driver's choice) keeps it. */
static inline cudaError_t cuda_set_carveout(const void *kernel) {
    const char *env = getenv("PDSERVE_CUDA_CARVEOUT");
    const int pct = env && *env ? atoi(env) : 100;
    if (pct < 0 || pct > 100) return cudaSuccess;
    return cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, pct);
}

/* A launch configuration with programmatic stream serialisation when pdl
 * (see pdl_wait); attr is the caller's, it must outlive the launch call. */
static inline cudaLaunchConfig_t cuda_launch_cfg(dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                                                 int pdl, cudaLaunchAttribute *attr) {
    *attr = cudaLaunchAttribute{};
    attr->id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr->val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cfg.attrs = attr;
    cfg.numAttrs = pdl ? 1 : 0;
    return cfg;
}

/* The greedy pick's rule, shared by the argmax op and the LM head's fused
 * pick: a (value, index) best with index n meaning none; (ov, oi) is taken
 * when it is something and the best is nothing, greater, or equal at a
 * lower index. Callers never offer NaN (a NaN value is skipped where it is
 * read), so the order is total and any reduction shape gives one answer. */
__device__ __forceinline__ void cuda_argmax_take(float &v, int &idx, float ov, int oi, int n) {
    if (oi < n && (idx == n || ov > v || (ov == v && oi < idx))) {
        v = ov;
        idx = oi;
    }
}
/* The best over a warp, on every lane. */
__device__ __forceinline__ void cuda_argmax_warp(float &v, int &idx, int n) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        cuda_argmax_take(v, idx, ov, oi, n);
    }
}
/* Store a finished pick (index n, nothing found: a row of NaN, gives 0) at
 * ids[at], and at ids_copy[at] too unless that is NULL. */
__device__ __forceinline__ void cuda_argmax_store(int32_t *ids, int32_t *ids_copy, int at, int idx,
                                                  int n) {
    const int id = idx < n ? idx : 0;
    ids[at] = id;
    if (ids_copy) ids_copy[at] = id;
}

/* Run the statement(s) with T bound to the C++ type of pd_dtype dt. */
#define CUDA_DISPATCH(dt, T, ...)                                                                  \
    switch (dt) {                                                                                  \
    case PD_F32: {                                                                                 \
        typedef float T;                                                                           \
        __VA_ARGS__;                                                                               \
    } break;                                                                                       \
    case PD_F16: {                                                                                 \
        typedef __half T;                                                                          \
        __VA_ARGS__;                                                                               \
    } break;                                                                                       \
    case PD_BF16: {                                                                                \
        typedef __nv_bfloat16 T;                                                                   \
        __VA_ARGS__;                                                                               \
    } break;                                                                                       \
    }

/* A kv_write the backend has not launched yet: a decode step's attention
 * does it itself (see cuda_decode_attn.cu), anything else launches it first. */
typedef struct cuda_kv_pending {
    int on;
    void *k_cache, *v_cache;
    const void *k, *v;
    int stride, T, kv_dim;
    const int32_t *slot_mapping;
} cuda_kv_pending;

/* Max or sum of v over a block of THREADS threads (every thread gets the
 * result), in a fixed order: warp butterflies, then the warps' values in
 * warp order. red: THREADS / 32 floats of shared memory. */
template <int THREADS>
__device__ __forceinline__ float cuda_block_reduce(float v, float *red, bool is_max) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        const float w = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, w) : v + w;
    }
    __syncthreads(); /* red may still be read from a previous reduction */
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float r = red[0];
    for (int i = 1; i < THREADS / 32; i++) r = is_max ? fmaxf(r, red[i]) : r + red[i];
    return r;
}

/* Blocks for a grid-stride loop over n items with `threads` per block. */
static inline unsigned cuda_grid_for(size_t n, unsigned threads) {
    size_t b = (n + threads - 1) / threads;
    return (unsigned)(b > 65536 ? 65536 : (b ? b : 1));
}

/* ---- launchers (cuda_elementwise.cu) ---- */

/* dst[i] = convert(src[i]) for n elements between any two of the three dtypes. */
void cuda_convert(cudaStream_t s, void *dst, pd_dtype dst_t, const void *src, pd_dtype src_t,
                  size_t n);
/* y[t, o] += bias[o] for a [T, out] matrix. */
void cuda_bias_add(cudaStream_t s, pd_dtype dt, void *y, const void *bias, int T, int out);
void cuda_activation(cudaStream_t s, pd_dtype dt, void *x, size_t n, pd_activation act);
void cuda_add(cudaStream_t s, pd_dtype dt, void *y, const void *x, size_t n);
void cuda_embedding(cudaStream_t s, pd_dtype dt, void *y, const void *table, const int32_t *idx,
                    int offset, int rows, int dim, int accumulate);
/* y[t] = a[ia[t]] + b[ib[t] + b_offset], rows of dim elements. */
void cuda_embedding_sum(cudaStream_t s, pd_dtype dt, void *y, const void *a, const int32_t *ia,
                        const void *b, const int32_t *ib, int b_offset, int rows, int dim);
void cuda_gather_rows(cudaStream_t s, pd_dtype dt, void *y, const void *x, const int32_t *rows,
                      int n, int dim);
void cuda_kv_write(cudaStream_t s, pd_dtype dt, void *k_cache, void *v_cache, const void *k,
                   const void *v, int stride, const int32_t *slot_mapping, int T, int kv_dim);

/* ---- launchers (cuda_layernorm.cu, cuda_flash.cu, cuda_attention.cu) ---- */

/* x's rows are x_stride elements apart; y is dense [rows, dim]. pdl: a
 * programmatic dependent launch (see pdl_wait). */
void cuda_layer_norm(cudaStream_t s, pd_dtype dt, void *y, const void *x, int x_stride,
                     const void *w, const void *b, int rows, int dim, float eps, int pdl);

/* Tensor-core attention for prefills (cuda_flash.cu), used by
 * cuda_paged_attention. _fits says, from the host-side arguments only,
 * whether it takes the call: fp16/bf16, head_dim a multiple of 16 up to
 * 128, max_q_len >= 16, 16-byte aligned rows, a device of sm_80 or later. */
bool cuda_flash_attention_fits(pd_dtype dt, const void *out, const void *q, int q_stride,
                               const void *k_cache, const void *v_cache, const pd_step_meta *meta,
                               int heads, int head_dim);
void cuda_flash_attention(cudaStream_t s, pd_dtype dt, void *out, const void *q, int q_stride,
                          const void *k_cache, const void *v_cache, const pd_step_meta *meta,
                          int heads, int head_dim, int block_size, float scale);

/* Largest head_dim the attention kernel takes (16 values per lane of a warp). */
#define CUDA_MAX_HEAD_DIM 512
/* write: a kv_write of this step still to be done (NULL: none), fused into
 * the decode kernel where it can be, else launched first. counters: the
 * decode kernel's per-item part counters (zeroed, and left zeroed). pdl:
 * the decode kernel with the write fused in may be PDL-launched (see
 * pdl_wait), and then loads the cached K and V before it waits. */
void cuda_paged_attention(cudaStream_t s, pd_dtype dt, void *out, const void *q, int q_stride,
                          const void *k_cache, const void *v_cache, const pd_step_meta *meta,
                          int heads, int head_dim, int block_size, float scale, float *work,
                          size_t work_floats, const cuda_kv_pending *write, int *counters, int pdl);

/* ---- launchers (cuda_decode_attn.cu) ---- */


/* Most (token, head) items of one decode-attention call (its counters):
 * 256 sequences of a 64-head model. */
#define CUDA_DECODE_MAX_ITEMS 16384
/* Once per device, before the first cuda_decode_attention. */
cudaError_t cuda_decode_attention_init(void);
/* Floats of work space cuda_decode_attention needs for a step. */
size_t cuda_decode_attention_work(int n_tokens, int heads, int head_dim, int max_ctx);
/* Context-split attention for few-query steps; false (nothing queued) when
 * head_dim > 256 or work is too small, and the caller picks another kernel. */
bool cuda_decode_attention(cudaStream_t s, pd_dtype dt, void *out, const void *q, int q_stride,
                           const void *k_cache, const void *v_cache, const pd_step_meta *m,
                           int heads, int head_dim, int block_size, float scale, float *work,
                           size_t work_floats, const cuda_kv_pending *write, int *counters,
                           int pdl);

/* ---- launchers (cuda_sample.cu) ---- */

/* Scratch of the split argmax (cuda_sample.cu): per-part bests of
 * CUDA_ARGMAX_SPLIT_ROWS rows, and a counter that is zero between calls. */
#define CUDA_ARGMAX_SPLIT_ROWS 8
#define CUDA_ARGMAX_PARTS 16
typedef struct cuda_argmax_scratch {
    float *v;     /* [rows][CUDA_ARGMAX_PARTS] */
    int *i;       /* the same */
    int *counter; /* one */
} cuda_argmax_scratch;

/* ids[r] = index of the largest of row r of x [rows, n] (lowest on ties),
 * and ids_copy[r] too unless it is NULL. A few long rows (the LM head of a
 * decode step) are split over CUDA_ARGMAX_PARTS blocks each when scratch is
 * given (else NULL), the last block merging; pdl: a programmatic dependent
 * launch. */
void cuda_argmax(cudaStream_t s, pd_dtype dt, int32_t *ids, int32_t *ids_copy, const void *x,
                 int rows, int n, const cuda_argmax_scratch *scratch, int pdl);
/* ids[r] = a token drawn from row r of x with params[5 r ..]: temperature,
 * top_p, min_p, top_k, u (see cuda_sample.cu; backend.h's sample op). */
void cuda_sample(cudaStream_t s, pd_dtype dt, int32_t *ids, const void *x, int rows, int n,
                 const float *params);

/* ---- the fused linear op (cuda_linear.cu) ---- */

/* cuBLASLt algorithms found for one problem shape, kept so that a decode
 * step does not pay for a heuristic query per GEMM. */
#define CUDA_LT_CACHE 64
typedef struct cuda_lt_entry {
    int used;
    int key[12];
    cublasLtMatmulAlgo_t algo;
} cuda_lt_entry;

/* What the linear op needs of the backend, set up once at its creation. */
typedef struct cuda_linear_env {
    cudaStream_t stream;
    cublasHandle_t blas;
    cublasLtHandle_t lt;
    void *workspace; /* shared by cuBLAS and cuBLASLt: both run on `stream`, in order */
    size_t workspace_bytes;
    int sm_count;
    int mma_ok;      /* compute capability >= 8.0: fp16/bf16 tensor-core MMA */
    int pdl;         /* launch the small-T kernels with programmatic dependent launch
                        (compute capability >= 9.0, unless PDSERVE_CUDA_PDL=0) */
    size_t smem_max; /* dynamic shared memory the small-T kernels may ask for */
    int lt_next;     /* next cache slot to replace */
    cuda_lt_entry lt_cache[CUDA_LT_CACHE];
    /* The fused argmax's per-block bests ([am_blocks][8] each; also the split
     * argmax's scratch, cuda_argmax_scratch) and its
     * finished-block counter (kept zeroed); owned here, cuda_linear_free. */
    float *am_v;
    int *am_i, *am_counter;
    int am_blocks;
    /* How the LM head (a small-T call with very many outputs) runs
     * (PDSERVE_CUDA_HEAD, for A/B timing): "gemv" (the default) one token's
     * head as a streaming GEMV with the layer norm and the argmax inside
     * (linear_head_kernel), more tokens as "blas"; "fused" the MMA kernel
     * with the argmax fused, "split" the MMA kernel then the argmax op,
     * "blas" layer norm + cuBLASLt + the argmax op (docs/benchmarks.md
     * has the timings). */
    enum { CUDA_HEAD_FUSED, CUDA_HEAD_SPLIT, CUDA_HEAD_BLAS, CUDA_HEAD_GEMV } head_route;
    /* Tiles a block of the MMA kernel takes at T = 1 (PDSERVE_CUDA_T1_NTILE:
     * 1, the default, 2 or 4; for A/B timing). Fewer, fatter blocks were
     * 6-8 us slower a step (docs/cuda-backend.md, Not done yet); the
     * register sizes (fit_off) are what let the next linear's blocks
     * become resident sooner. */
    int t1_ntile;
    /* PDSERVE_CUDA_LIN_FIT=0: the MMA kernel's two older register sizes
     * only (8 loads in flight at 80 registers, 16 at 128), for A/B timing
     * of the sizes that let consecutive linears share an SM (see
     * lin_size_for in cuda_linear.cu). */
    bool fit_off;
    /* PDSERVE_CUDA_SMALL=0: every linear takes the large (cuBLASLt) path, to
     * see whether HF's near-tie continuations follow cuBLAS's summation. */
    bool small_off;
} cuda_linear_env;

/* The argmax op's split scratch is the fused argmax's: the two never run
 * at once (one stream, and each waits for the kernel before it). */
static inline cuda_argmax_scratch cuda_linear_argmax_scratch(const cuda_linear_env *env) {
    return cuda_argmax_scratch{env->am_v, env->am_i, env->am_counter};
}

/* Lift the kernels' dynamic shared memory limit and allocate the fused
 * argmax's buffers (once, at backend creation; not stream operations,
 * better kept out of graph captures). Fills env->smem_max. */
cudaError_t cuda_linear_init(cuda_linear_env *env, int device);
void cuda_linear_free(cuda_linear_env *env);
/* backend.h `linear` on env->stream. Returns 0, or -1 with a message in msg
 * (a cuBLAS failure); launch errors are left for cudaGetLastError. */
int cuda_linear(cuda_linear_env *env, pd_dtype dt, void *y, const void *x, int x_stride,
                const void *w, const void *bias, int T, int in, int out, const pd_linear_fuse *f,
                char *msg, size_t msg_len);

#endif
