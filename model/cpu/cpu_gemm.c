/* cpu_gemm: fp32 y = x . W^T + b for the CPU backend.
 *
 * W is [out, in] row-major, exactly as PyTorch's nn.Linear stores it, so each
 * output is a dot product of two contiguous rows. Work is split over output
 * rows: a task owns a block of W rows and computes them for every token.
 *  - Decode (T < 4): a matrix-vector product, bound by streaming W from
 *    memory. Tasks are row blocks small enough to balance across threads;
 *    the 1x4 kernel keeps 4 weight streams in flight.
 *  - Prefill (T >= 4): a task's W rows are sized to stay in L2 and are
 *    reused by every 4-token group (4x3 register tile), so W is read from
 *    memory once per call instead of once per token.
 * The kernels are compiled for SSE2 (any x86-64) and for AVX2+FMA, chosen
 * once when the backend is created. */
#include <string.h>

#include "model/cpu/cpu_internal.h"

/* --- SSE2 baseline: 4-lane vectors, separate multiply and add --- */
typedef float v4f __attribute__((vector_size(16)));
#define GK_VEC v4f
#define GK_W 4
#define GK_MADD(a, x, w) ((a) + (x) * (w))
#define GK_NAME(n) sse2_##n
#include "model/cpu/cpu_gemm_kernel.inc"
#undef GK_VEC
#undef GK_W
#undef GK_MADD
#undef GK_NAME

#if defined(__x86_64__)
/* --- AVX2 + FMA: 8-lane vectors, fused multiply-add --- */
#include <immintrin.h>
#pragma GCC push_options
#pragma GCC target("avx2,fma")
typedef float v8f __attribute__((vector_size(32)));
#define GK_VEC v8f
#define GK_W 8
#define GK_MADD(a, x, w) ((v8f)_mm256_fmadd_ps((__m256)(x), (__m256)(w), (__m256)(a)))
#define GK_NAME(n) avx2_##n
#include "model/cpu/cpu_gemm_kernel.inc"
#undef GK_VEC
#undef GK_W
#undef GK_MADD
#undef GK_NAME
#pragma GCC pop_options
#endif

gemm_rows_fn cpu_gemm_pick(bool baseline, const char **isa_name) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (!baseline && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        *isa_name = "avx2";
        return avx2_gemm_rows;
    }
#endif
    (void)baseline;
    *isa_name = "sse2";
    return sse2_gemm_rows;
}

typedef struct gemm_job {
    gemm_args g;
    gemm_rows_fn kernel;
} gemm_job;

static void gemm_task(void *arg, int task) {
    const gemm_job *j = arg;
    int r0 = task * j->g.rows_per_task;
    int r1 = r0 + j->g.rows_per_task;
    if (r1 > j->g.out) r1 = j->g.out;
    j->kernel(&j->g, r0, r1);
}

static int round_up(int v, int m) {
    return (v + m - 1) / m * m;
}

void cpu_gemm(cpu_pool *pool, gemm_rows_fn kernel, float *y, const float *x, int x_stride,
              const float *w, const float *bias, int T, int in, int out) {
    gemm_job j = {.g = {y, x, x_stride, w, bias, T, in, out, 0}, .kernel = kernel};
    const int nth = cpu_pool_threads(pool);
    int rows;
    if (T < 4) {
        /* Several tasks per thread so a slow thread does not hold up the
         * step; multiples of 4 rows for the 1x4 kernel. */
        rows = round_up((out + nth * 8 - 1) / (nth * 8), 4);
        if (rows < 16) rows = 16;
    } else {
        /* A block of W rows that fits comfortably in L2 (~128 KiB), in
         * multiples of 3 rows for the 4x3 kernel, but enough tasks to keep
         * every thread busy. */
        rows = (128 * 1024 / 4) / (in > 0 ? in : 1);
        int per_thread = (out + nth * 3 - 1) / (nth * 3);
        if (rows > per_thread) rows = per_thread;
        rows = round_up(rows < 3 ? 3 : rows, 3);
    }
    j.g.rows_per_task = rows;
    int n_tasks = (out + rows - 1) / rows;
    cpu_pool_run(pool, n_tasks, gemm_task, &j);
}
