/* cuda_layernorm: y = (x - mean) / sqrt(var + eps) (* w + b), one block per
 * row; x's rows may be strided (x_stride), y is dense. The GPU twin of
 * ln_rows in model/cpu/cpu_backend.c: the same two passes (mean, then the
 * biased variance about it) in fp32, so the results agree to rounding. Each
 * pass re-reads the row (it is in L1/L2 by then); y may equal x (with
 * x_stride == dim) because each element is written only in the last pass,
 * by the thread that reads it there, after both reductions are complete. */
#include <math.h>

#include "model/cuda/cuda_internal.cuh"

#define LN_THREADS 256

/* Sum of v over the block; every thread gets the total. sh holds 32 floats. */
__device__ float ln_block_sum(float v, float *sh) {
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < (int)(blockDim.x >> 5) ? sh[lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1)
            v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) sh[0] = v;
    }
    __syncthreads();
    const float total = sh[0];
    __syncthreads(); /* sh is reused by the next call */
    return total;
}

template <typename T>
__global__ void layer_norm_kernel(T *y, const T *x, int x_stride, const T *w, const T *b, int dim,
                                  float eps) {
    pdl_trigger(); /* the next (PDL-launched) kernel may start loading its weights */
    pdl_wait();    /* when PDL-launched itself: x is the previous kernel's */
    __shared__ float sh[32];
    const T *xr = x + (size_t)blockIdx.x * x_stride;
    T *yr = y + (size_t)blockIdx.x * dim;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        sum += to_f32(xr[i]);
    const float mean = ln_block_sum(sum, sh) / (float)dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float d = to_f32(xr[i]) - mean;
        ss += d * d;
    }
    const float rstd = 1.0f / sqrtf(ln_block_sum(ss, sh) / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = (to_f32(xr[i]) - mean) * rstd;
        if (w) v = v * to_f32(w[i]) + to_f32(b[i]);
        yr[i] = from_f32<T>(v);
    }
}

void cuda_layer_norm(cudaStream_t s, pd_dtype dt, void *y, const void *x, int x_stride,
                     const void *w, const void *b, int rows, int dim, float eps, int pdl) {
    if (rows <= 0 || dim <= 0) return;
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = cuda_launch_cfg(dim3(rows), dim3(LN_THREADS), 0, s, pdl, &attr);
    CUDA_DISPATCH(dt, E,
                  cudaLaunchKernelEx(&cfg, layer_norm_kernel<E>, (E *)y, (const E *)x, x_stride,
                                     (const E *)w, (const E *)b, dim, eps))
}
