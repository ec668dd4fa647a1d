/* cuda_sample: token choice on the GPU, so that a greedy decode step sends
 * only the chosen ids (4 bytes a sequence) to the host instead of a row of
 * vocab_size logits.
 *
 * argmax: one block per row; every thread keeps the best (value, index) of
 * its strided share, then a shared-memory tree keeps the larger value and,
 * on equal values, the lower index — the host sampler's greedy rule, so the
 * GPU and host picks agree whenever the logits do. */
#include "model/cuda/cuda_internal.cuh"

#define ARGMAX_THREADS 1024

template <typename T>
__global__ void argmax_kernel(int32_t *ids, const T *x, int n) {
    __shared__ float best_v[ARGMAX_THREADS];
    __shared__ int best_i[ARGMAX_THREADS];
    const T *row = x + (size_t)blockIdx.x * n;
    float v = -INFINITY;
    int idx = n; /* "none": larger than any real index, so it never wins a tie */
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        /* Strictly greater: a thread visits its indices in increasing order,
         * so its first maximum is kept; NaN never compares, as on the host. */
        const float f = to_f32(row[i]);
        if (f > v || (idx == n && f == v)) {
            v = f;
            idx = i;
        }
    }
    best_v[threadIdx.x] = v;
    best_i[threadIdx.x] = idx;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) {
            const float ov = best_v[threadIdx.x + half];
            const int oi = best_i[threadIdx.x + half];
            const float mv = best_v[threadIdx.x];
            const int mi = best_i[threadIdx.x];
            if (oi < n && (mi == n || ov > mv || (ov == mv && oi < mi))) {
                best_v[threadIdx.x] = ov;
                best_i[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) ids[blockIdx.x] = best_i[0] < n ? best_i[0] : 0;
}

void cuda_argmax(cudaStream_t s, pd_dtype dt, int32_t *ids, const void *x, int rows, int n) {
    if (rows <= 0 || n <= 0) return;
    CUDA_DISPATCH(dt, E, argmax_kernel<E><<<rows, ARGMAX_THREADS, 0, s>>>(ids, (const E *)x, n))
}
