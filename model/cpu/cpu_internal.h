/* cpu_internal: what the CPU backend's files share (not a public API). */
#ifndef PD_CPU_INTERNAL_H
#define PD_CPU_INTERNAL_H

#include <stdbool.h>

#include "model/backend.h"
#include "model/cpu/cpu_pool.h"

/* Largest head_dim the CPU attention kernel takes (it keeps one head's q and
 * output accumulator on the stack). */
#define CPU_MAX_HEAD_DIM 512

/* Create the CPU backend. baseline: use the SSE2 kernels even when the CPU
 * has AVX2 (for tests of that code path). */
int cpu_backend_create(int n_threads, bool baseline, pd_backend **out, pd_err *err);

/* The backend's private state (pd_backend.ctx). */
typedef struct cpu_ctx cpu_ctx;
cpu_pool *cpu_ctx_pool(const pd_backend *be);

void cpu_paged_attention(pd_backend *be, void *out, const void *q, int q_stride,
                         const void *k_cache, const void *v_cache, const pd_step_meta *meta,
                         int heads, int head_dim, int block_size, float scale);

/* One GEMM call, y[T,out] = x[T,in] . W[out,in]^T + bias, split into tasks
 * of rows_per_task output rows. */
typedef struct gemm_args {
    float *y;
    const float *x;
    int x_stride;
    const float *w;
    const float *bias;
    int T, in, out;
    int rows_per_task;
} gemm_args;

/* A GEMM implementation for one instruction set. */
typedef void (*gemm_rows_fn)(const gemm_args *g, int r0, int r1);

/* The best kernel this CPU runs ("avx2" or "sse2"); baseline forces sse2. */
gemm_rows_fn cpu_gemm_pick(bool baseline, const char **isa_name);
void cpu_gemm(cpu_pool *pool, gemm_rows_fn kernel, float *y, const float *x, int x_stride,
              const float *w, const float *bias, int T, int in, int out);

#endif
