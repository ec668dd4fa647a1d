/* cuda_elementwise: the CUDA backend's memory-bound kernels, one small kernel
 * per op of backend.h, each the GPU twin of the loop of the same name in
 * model/cpu/cpu_backend.c (tests/cuda/test_cuda_ops.c compares them).
 *
 * Flat ops (convert, activation, add) are grid-stride loops over elements.
 * Row ops (bias_add, embedding, gather_rows, kv_write) give one block per row
 * and let its threads stride over the row's columns, so a row's index (token
 * id, slot, source row) is read once per block from device memory. All math
 * is in fp32; 16-bit storage is widened on load and rounded on store. */
#include "model/cuda/cuda_internal.cuh"

#define EW_THREADS 256

/* ---- convert: weight upload and download_f32 ---- */

template <typename D, typename S> __global__ void convert_kernel(D *dst, const S *src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] = from_f32<D>(to_f32(src[i]));
}

void cuda_convert(cudaStream_t s, void *dst, pd_dtype dst_t, const void *src, pd_dtype src_t,
                  size_t n) {
    if (n == 0) return;
    const unsigned g = cuda_grid_for(n, EW_THREADS);
    CUDA_DISPATCH(dst_t, D,
                  CUDA_DISPATCH(src_t, S,
                                convert_kernel<D, S>
                                <<<g, EW_THREADS, 0, s>>>((D *)dst, (const S *)src, n)))
}

/* ---- bias_add: the bias of y = x W^T + b, after the cuBLAS GEMM ---- */

template <typename T> __global__ void bias_add_kernel(T *y, const T *bias, int out) {
    T *row = y + (size_t)blockIdx.x * out;
    for (int o = threadIdx.x; o < out; o += blockDim.x)
        row[o] = from_f32<T>(to_f32(row[o]) + to_f32(bias[o]));
}

void cuda_bias_add(cudaStream_t s, pd_dtype dt, void *y, const void *bias, int T, int out) {
    if (T <= 0 || out <= 0) return;
    CUDA_DISPATCH(dt, E, bias_add_kernel<E><<<T, EW_THREADS, 0, s>>>((E *)y, (const E *)bias, out))
}

/* ---- activation (act_apply: cuda_internal.cuh) ---- */

template <typename T> __global__ void activation_kernel(T *x, size_t n, pd_activation act) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] = from_f32<T>(act_apply(to_f32(x[i]), act));
}

void cuda_activation(cudaStream_t s, pd_dtype dt, void *x, size_t n, pd_activation act) {
    if (n == 0) return;
    const unsigned g = cuda_grid_for(n, EW_THREADS);
    CUDA_DISPATCH(dt, E, activation_kernel<E><<<g, EW_THREADS, 0, s>>>((E *)x, n, act))
}

/* ---- add: the residual connection y += x ---- */

template <typename T> __global__ void add_kernel(T *y, const T *x, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        y[i] = from_f32<T>(to_f32(y[i]) + to_f32(x[i]));
}

void cuda_add(cudaStream_t s, pd_dtype dt, void *y, const void *x, size_t n) {
    if (n == 0) return;
    const unsigned g = cuda_grid_for(n, EW_THREADS);
    CUDA_DISPATCH(dt, E, add_kernel<E><<<g, EW_THREADS, 0, s>>>((E *)y, (const E *)x, n))
}

/* ---- embedding: y[t] (+)= table[idx[t] + offset] ---- */

template <typename T>
__global__ void embedding_kernel(T *y, const T *table, const int32_t *idx, int offset, int dim,
                                 int accumulate) {
    pdl_trigger(); /* the next (PDL-launched) kernel may start loading its weights */
    const int t = blockIdx.x;
    const T *src = table + (size_t)(idx[t] + offset) * dim;
    T *dst = y + (size_t)t * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = to_f32(src[i]);
        dst[i] = from_f32<T>(accumulate ? to_f32(dst[i]) + v : v);
    }
}

void cuda_embedding(cudaStream_t s, pd_dtype dt, void *y, const void *table, const int32_t *idx,
                    int offset, int rows, int dim, int accumulate) {
    if (rows <= 0 || dim <= 0) return;
    CUDA_DISPATCH(dt, E,
                  embedding_kernel<E><<<rows, EW_THREADS, 0, s>>>((E *)y, (const E *)table, idx,
                                                                  offset, dim, accumulate))
}

/* ---- embedding_sum: y[t] = a[ia[t]] + b[ib[t] + b_offset] ---- */

/* The token and position embeddings of a step in one launch (the first of
 * a step, so the next kernel's weight loads start at once). */
template <typename T>
__global__ void embedding_sum_kernel(T *y, const T *a, const int32_t *ia, const T *b,
                                     const int32_t *ib, int b_offset, int dim) {
    pdl_trigger();
    const int t = blockIdx.x;
    const T *ra = a + (size_t)ia[t] * dim, *rb = b + (size_t)(ib[t] + b_offset) * dim;
    T *dst = y + (size_t)t * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        dst[i] = from_f32<T>(to_f32(ra[i]) + to_f32(rb[i]));
}

void cuda_embedding_sum(cudaStream_t s, pd_dtype dt, void *y, const void *a, const int32_t *ia,
                        const void *b, const int32_t *ib, int b_offset, int rows, int dim) {
    if (rows <= 0 || dim <= 0) return;
    CUDA_DISPATCH(dt, E,
                  embedding_sum_kernel<E><<<rows, EW_THREADS, 0, s>>>(
                      (E *)y, (const E *)a, ia, (const E *)b, ib, b_offset, dim))
}

/* ---- gather_rows: y[i] = x[rows[i]] (y and x must not overlap) ---- */

template <typename T>
__global__ void gather_rows_kernel(T *y, const T *x, const int32_t *rows, int dim) {
    pdl_trigger(); /* the next (PDL-launched) kernel may start loading its weights */
    const T *src = x + (size_t)rows[blockIdx.x] * dim;
    T *dst = y + (size_t)blockIdx.x * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        dst[i] = src[i];
}

void cuda_gather_rows(cudaStream_t s, pd_dtype dt, void *y, const void *x, const int32_t *rows,
                      int n, int dim) {
    if (n <= 0 || dim <= 0) return;
    CUDA_DISPATCH(dt, E,
                  gather_rows_kernel<E><<<n, EW_THREADS, 0, s>>>((E *)y, (const E *)x, rows, dim))
}

/* ---- kv_write: each new token's k and v row into its cache slot ----
 * A negative slot (padding, as in vLLM) is skipped. */

template <typename T>
__global__ void kv_write_kernel(T *k_cache, T *v_cache, const T *k, const T *v, int stride,
                                const int32_t *slot_mapping, int kv_dim) {
    const int t = blockIdx.x;
    const int32_t slot = slot_mapping[t];
    if (slot < 0) return;
    const T *ks = k + (size_t)t * stride, *vs = v + (size_t)t * stride;
    T *kd = k_cache + (size_t)slot * kv_dim, *vd = v_cache + (size_t)slot * kv_dim;
    for (int i = threadIdx.x; i < kv_dim; i += blockDim.x) {
        kd[i] = ks[i];
        vd[i] = vs[i];
    }
}

void cuda_kv_write(cudaStream_t s, pd_dtype dt, void *k_cache, void *v_cache, const void *k,
                   const void *v, int stride, const int32_t *slot_mapping, int T, int kv_dim) {
    if (T <= 0 || kv_dim <= 0) return;
    CUDA_DISPATCH(dt, E,
                  kv_write_kernel<E>
                  <<<T, EW_THREADS, 0, s>>>((E *)k_cache, (E *)v_cache, (const E *)k, (const E *)v,
                                            stride, slot_mapping, kv_dim))
}
