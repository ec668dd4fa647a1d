/* cuda_sample: token choice on the GPU, so that a greedy decode step sends
 * only the chosen ids (4 bytes a sequence) to the host instead of a row of
 * vocab_size logits.
 *
 * argmax: one block per row; every thread keeps the best (value, index) of
 * its share, visited in increasing index order, then warp shuffles and one
 * warp over the warps' bests keep the larger value and, on equal values,
 * the lower index — the host sampler's greedy rule, so the GPU and host
 * picks agree whenever the logits do. (Max with lowest-index ties is
 * associative and commutative, so the reduction's shape cannot change the
 * answer.) Rows are read in 16-byte loads, several in flight per thread:
 * at batch 1 this is one block reading a 100 KB row, and with one load at a
 * time it took ~20 us of a ~700 us decode step. */
#include "model/cuda/cuda_internal.cuh"

#define ARGMAX_THREADS 1024 /* the final step reduces 32 warps in one warp */
static_assert(ARGMAX_THREADS == 1024, "argmax_kernel reduces exactly 32 warps");

template <typename T>
__global__ void argmax_kernel(int32_t *ids, int32_t *ids_copy, const T *x, int n) {
    __shared__ float warp_v[ARGMAX_THREADS / 32];
    __shared__ int warp_i[ARGMAX_THREADS / 32];
    pdl_trigger();
    const T *row = x + (size_t)blockIdx.x * n;
    float v = -INFINITY;
    int idx = n; /* "none": larger than any real index, so it never wins a tie */
    /* Strictly greater (or the first value seen): a thread's indices rise,
     * so its first maximum is kept; NaN never compares, as on the host. */
#define ARGMAX_VISIT(f, i)                                                                             do {                                                                                                   const float f_ = (f);                                                                              if (f_ > v || (idx == n && f_ == v)) v = f_, idx = (i);                                        } while (0)
    constexpr int VEC = 16 / sizeof(T);
    const int n_vec = ((uintptr_t)row % 16 == 0) ? n / VEC : 0;
    const uint4 *rv = (const uint4 *)row;
#pragma unroll 4
    for (int j = threadIdx.x; j < n_vec; j += ARGMAX_THREADS) {
        const uint4 q = rv[j];
        const T *e = (const T *)&q;
#pragma unroll
        for (int u = 0; u < VEC; u++)
            ARGMAX_VISIT(to_f32(e[u]), j * VEC + u);
    }
    for (int i = n_vec * VEC + threadIdx.x; i < n; i += ARGMAX_THREADS)
        ARGMAX_VISIT(to_f32(row[i]), i);
#undef ARGMAX_VISIT
    cuda_argmax_warp(v, idx, n);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_v[warp] = v, warp_i[warp] = idx;
    __syncthreads();
    if (warp != 0) return;
    v = warp_v[lane], idx = warp_i[lane]; /* ARGMAX_THREADS / 32 == 32 */
    cuda_argmax_warp(v, idx, n);
    if (lane == 0) cuda_argmax_store(ids, ids_copy, blockIdx.x, idx, n);
}

/* The split argmax: block (part, row) finds the best of its slice of the
 * row, publishes it, and the grid's last block merges each row's parts. The
 * rule's order is total (cuda_argmax_take), so the parts may be merged in
 * any order and the result is argmax_kernel's. */
#define ARGMAX_SPLIT_THREADS 256
template <typename T>
__global__ void argmax_split_kernel(int32_t *ids, int32_t *ids_copy, const T *x, int n,
                                    cuda_argmax_scratch scr) {
    __shared__ float warp_v[ARGMAX_SPLIT_THREADS / 32];
    __shared__ int warp_i[ARGMAX_SPLIT_THREADS / 32];
    __shared__ int last;
    pdl_trigger();
    pdl_wait(); /* x is the previous kernel's */
    const int part = blockIdx.x, r = blockIdx.y;
    const T *row = x + (size_t)r * n;
    constexpr int VEC = 16 / sizeof(T);
    /* Slices of whole 16-byte pieces when the row is aligned, else of elements. */
    const bool vec = (uintptr_t)row % 16 == 0 && n % VEC == 0;
    const int unit = vec ? VEC : 1, units = n / unit;
    const int per = (units + CUDA_ARGMAX_PARTS - 1) / CUDA_ARGMAX_PARTS;
    const int u0 = part * per, u1 = min(units, u0 + per);
    float v = -INFINITY;
    int idx = n;
    for (int u = u0 + threadIdx.x; u < u1; u += ARGMAX_SPLIT_THREADS) {
        if (vec) {
            const uint4 q = ((const uint4 *)row)[u];
            const T *e = (const T *)&q;
#pragma unroll
            for (int k = 0; k < VEC; k++) {
                const float f = to_f32(e[k]);
                if (!isnan(f)) cuda_argmax_take(v, idx, f, u * VEC + k, n); /* NaN: never picked */
            }
        } else {
            const float f = to_f32(row[u]);
            if (!isnan(f)) cuda_argmax_take(v, idx, f, u, n);
        }
    }
    cuda_argmax_warp(v, idx, n);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_v[warp] = v, warp_i[warp] = idx;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < ARGMAX_SPLIT_THREADS / 32; w++)
            cuda_argmax_take(v, idx, warp_v[w], warp_i[w], n);
        scr.v[r * CUDA_ARGMAX_PARTS + part] = v;
        scr.i[r * CUDA_ARGMAX_PARTS + part] = idx;
        __threadfence();
        const int blocks = (int)(gridDim.x * gridDim.y);
        last = atomicAdd(scr.counter, 1) == blocks - 1;
        if (last) *scr.counter = 0; /* ready for the next call */
    }
    __syncthreads();
    if (!last || warp >= (int)gridDim.y) return;
    __threadfence(); /* the other blocks' bests, through L2 (__ldcg) */
    v = -INFINITY, idx = n;
    if (lane < CUDA_ARGMAX_PARTS)
        v = __ldcg(&scr.v[warp * CUDA_ARGMAX_PARTS + lane]),
        idx = __ldcg(&scr.i[warp * CUDA_ARGMAX_PARTS + lane]);
    cuda_argmax_warp(v, idx, n);
    if (lane == 0) cuda_argmax_store(ids, ids_copy, warp, idx, n);
}

void cuda_argmax(cudaStream_t s, pd_dtype dt, int32_t *ids, int32_t *ids_copy, const void *x,
                 int rows, int n, const cuda_argmax_scratch *scratch, int pdl) {
    if (rows <= 0 || n <= 0) return;
    if (scratch && rows <= CUDA_ARGMAX_SPLIT_ROWS && n >= 64 * CUDA_ARGMAX_PARTS) {
        cudaLaunchAttribute attr;
        const cudaLaunchConfig_t cfg = cuda_launch_cfg(
            dim3(CUDA_ARGMAX_PARTS, rows), dim3(ARGMAX_SPLIT_THREADS), 0, s, pdl, &attr);
        CUDA_DISPATCH(dt, E,
                      cudaLaunchKernelEx(&cfg, argmax_split_kernel<E>, ids, ids_copy, (const E *)x,
                                         n, *scratch))
        return;
    }
    CUDA_DISPATCH(dt, E,
                  argmax_kernel<E><<<rows, ARGMAX_THREADS, 0, s>>>(ids, ids_copy, (const E *)x, n))
}

/* ---- sampling: temperature, min_p, top_k, top_p, then one draw ----
 *
 * The host sampler's pipeline (model/sampler.c) on one row per block, with
 * the same rules, so the two draw from the same distribution:
 *   l = logits / temperature; m = max l (a +-inf max: the argmax);
 *   keep l - m >= max(log(min_p), -104);
 *   top_k: keep l >= the k-th largest kept l (ties stay);
 *   w = exp(l - m); top_p: walk the kept tokens from the most likely (ties
 *   by lower id) and keep them through the first at which the running mass
 *   reaches top_p * total;
 *   the token: the first id (in id order) whose running mass exceeds
 *   u * (kept mass), u in [0, 1) drawn by the host from the request's RNG.
 * Thresholds are found by bisection over the ordered bit patterns of the
 * floats (32 steps, exact), each step one block reduction in a fixed order,
 * so a row's result never depends on timing. Thread j owns the contiguous
 * ids [j * chunk, (j + 1) * chunk), which gives id order for the walks. */

#define SMP_THREADS 1024

/* Float -> unsigned with the same order (for bisection over floats). */
__device__ __forceinline__ uint32_t order_key(float f) {
    const uint32_t b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

/* Fixed-order block reductions (every thread gets the result). */
__device__ float smp_sum(float v, float *red) {
    return cuda_block_reduce<SMP_THREADS>(v, red, false);
}
__device__ float smp_max(float v, float *red) {
    return cuda_block_reduce<SMP_THREADS>(v, red, true);
}
__device__ int smp_min_int(int v, int *red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    int r = red[0];
    for (int i = 1; i < SMP_THREADS / 32; i++) r = min(r, red[i]);
    return r;
}

/* Exclusive prefix of per-thread values over thread order. */
__device__ float smp_exclusive_scan(float v, float *scan) {
    __syncthreads();
    scan[threadIdx.x] = v;
    __syncthreads();
    if (threadIdx.x == 0) { /* 1,024 adds: negligible next to the row's reads */
        float acc = 0.0f;
        for (int i = 0; i < SMP_THREADS; i++) {
            const float x = scan[i];
            scan[i] = acc;
            acc += x;
        }
    }
    __syncthreads();
    return scan[threadIdx.x];
}

template <typename T>
__global__ void sample_kernel(int32_t *ids, const T *x, int n, const float *params) {
    __shared__ float redf[SMP_THREADS / 32];
    __shared__ int redi[SMP_THREADS / 32];
    __shared__ float scan[SMP_THREADS];
    const T *row = x + (size_t)blockIdx.x * n;
    const float *p = params + 5 * (size_t)blockIdx.x;
    const float temp = p[0], top_p = p[1], min_p = p[2], u = p[4];
    const int top_k = (int)p[3];
    const int chunk = (n + SMP_THREADS - 1) / SMP_THREADS;
    const int lo = min(n, (int)threadIdx.x * chunk), hi = min(n, lo + chunk);
    const bool greedy = temp < 1e-5f;

    /* Max of the scaled logits, and the lowest id holding it (the argmax). */
    float m = -INFINITY;
    for (int i = lo; i < hi; i++) {
        const float l = greedy ? to_f32(row[i]) : to_f32(row[i]) / temp;
        if (l > m) m = l;
    }
    m = smp_max(m, redf);
    if (greedy || m == INFINITY || m == -INFINITY) {
        int first = n;
        for (int i = lo; i < hi && first == n; i++) {
            const float l = greedy ? to_f32(row[i]) : to_f32(row[i]) / temp;
            if (l == m) first = i;
        }
        first = smp_min_int(first, redi);
        if (threadIdx.x == 0) ids[blockIdx.x] = first < n ? first : 0;
        return;
    }
    float floor_l = min_p > 0.0f ? logf(min_p) : -INFINITY;
    if (floor_l < -104.0f) floor_l = -104.0f;
    /* The kept set is (l - m >= floor_l) && key(l) >= k_min && (top_p rule). */
    uint32_t k_min = 0;
#define SMP_L(i) (to_f32(row[i]) / temp)
#define SMP_BASE(l) ((l) - m >= floor_l)
    float cnt = 0.0f;
    for (int i = lo; i < hi; i++) cnt += SMP_BASE(SMP_L(i)) ? 1.0f : 0.0f;
    cnt = smp_sum(cnt, redf); /* exact: integers below 2^24 */
    if (top_k >= 1 && (float)top_k < cnt) {
        /* The largest key K with count(key >= K) >= top_k is the k-th largest. */
        uint32_t a = 0, b = order_key(m) + 1u; /* count(>= a) >= k > count(>= b) */
        while (b - a > 1u) {
            const uint32_t mid = a + (b - a) / 2u;
            float c = 0.0f;
            for (int i = lo; i < hi; i++) {
                const float l = SMP_L(i);
                c += (SMP_BASE(l) && order_key(l) >= mid) ? 1.0f : 0.0f;
            }
            if (smp_sum(c, redf) >= (float)top_k) a = mid;
            else b = mid;
        }
        k_min = a;
    }
#define SMP_KEPT(l) (SMP_BASE(l) && order_key(l) >= k_min)
    float total = 0.0f;
    for (int i = lo; i < hi; i++) {
        const float l = SMP_L(i);
        if (SMP_KEPT(l)) total += expf(l - m);
    }
    total = smp_sum(total, redf);
    /* top_p: the last kept token in (logit desc, id asc) order is the one
     * whose logit is the largest L with mass(l >= L) >= target; among equal
     * logits, ids in ascending order until the mass is reached. */
    uint32_t p_key = 0;
    int p_last_tied = n; /* tokens with key == p_key are kept when id <= this */
    if (top_p < 1.0f) {
        const float target = top_p * total;
        uint32_t a = k_min, b = order_key(m) + 1u; /* mass(>= a) >= target > mass(>= b) */
        while (b - a > 1u) {
            const uint32_t mid = a + (b - a) / 2u;
            float s = 0.0f;
            for (int i = lo; i < hi; i++) {
                const float l = SMP_L(i);
                if (SMP_KEPT(l) && order_key(l) >= mid) s += expf(l - m);
            }
            if (smp_sum(s, redf) >= target) a = mid;
            else b = mid;
        }
        p_key = a;
        /* Mass strictly above, then the tied ones in id order. */
        float above = 0.0f, tied = 0.0f;
        for (int i = lo; i < hi; i++) {
            const float l = SMP_L(i);
            if (!SMP_KEPT(l)) continue;
            const uint32_t k = order_key(l);
            if (k > p_key) above += expf(l - m);
            else if (k == p_key) tied += expf(l - m);
        }
        above = smp_sum(above, redf);
        const float base = smp_exclusive_scan(tied, scan);
        int cross = n;
        if (tied > 0.0f && above + base < target && above + base + tied >= target) {
            float acc = above + base;
            for (int i = lo; i < hi; i++) {
                const float l = SMP_L(i);
                if (!SMP_KEPT(l) || order_key(l) != p_key) continue;
                acc += expf(l - m);
                if (acc >= target) {
                    cross = i;
                    break;
                }
            }
        }
        cross = smp_min_int(cross, redi);
        p_last_tied = cross; /* n: rounding kept every tie */
    }
#define SMP_FINAL(i, l)                                                                           \
    (SMP_KEPT(l) && (top_p >= 1.0f || order_key(l) > p_key ||                                      \
                     (order_key(l) == p_key && (i) <= p_last_tied)))
    float mine = 0.0f;
    int last_kept = -1;
    for (int i = lo; i < hi; i++) {
        const float l = SMP_L(i);
        if (SMP_FINAL(i, l)) {
            mine += expf(l - m);
            last_kept = i;
        }
    }
    const float kept_total = smp_sum(mine, redf);
    const float draw = u * kept_total;
    const float base = smp_exclusive_scan(mine, scan);
    int pick = n;
    if (mine > 0.0f && draw < base + mine && draw >= base) {
        float acc = base;
        for (int i = lo; i < hi; i++) {
            const float l = SMP_L(i);
            if (!SMP_FINAL(i, l)) continue;
            acc += expf(l - m);
            if (draw < acc) {
                pick = i;
                break;
            }
        }
        if (pick == n) pick = last_kept; /* rounding between the scan and the walk */
    }
    pick = smp_min_int(pick, redi);
    if (pick == n) { /* u * total rounded past the end: the last kept token */
        const int neg_last = smp_min_int(last_kept >= 0 ? -last_kept : 1, redi);
        pick = neg_last <= 0 ? -neg_last : 0;
    }
    if (threadIdx.x == 0) ids[blockIdx.x] = pick;
#undef SMP_L
#undef SMP_BASE
#undef SMP_KEPT
#undef SMP_FINAL
}

void cuda_sample(cudaStream_t s, pd_dtype dt, int32_t *ids, const void *x, int rows, int n,
                 const float *params) {
    if (rows <= 0 || n <= 0) return;
    CUDA_DISPATCH(dt, E,
                  sample_kernel<E><<<rows, SMP_THREADS, 0, s>>>(ids, (const E *)x, n, params))
}
