/* cuda_backend: the ops table (backend.h) on one CUDA device.
 *
 * Memory is cudaMalloc'd device memory; every copy, kernel and cuBLAS call
 * goes onto ONE non-blocking stream owned by the backend, so ops run in the
 * order opt.c issues them and nothing else on the device interleaves.
 * Host<->device copies wait for their stream before returning (the host
 * buffer is free to reuse, download_f32 sees every queued op's result).
 *
 * Compute ops only queue work. A launch or cuBLAS error is remembered (the
 * first one) and reported by the next sync / copy / download; errors raised
 * while a kernel runs surface from cudaStreamSynchronize there too.
 *
 * The CUDA runtime's "current device" is per host thread and the engine runs
 * the model on its own thread, so every entry point selects the backend's
 * device first (cheap: the context already exists).
 *
 * GEMM layout trick: cuBLAS is column-major, our matrices are row-major. A
 * row-major [r, c] matrix with row stride ld is the column-major [c, r]
 * matrix with leading dimension ld, i.e. its transpose, for free. So
 *   y[T,out] = x[T,in] . W[out,in]^T      (row-major)
 * is, read column-major,
 *   Y'[out,T] = W'[in,out]^T . X'[in,T]   (Y' = y^T, W' = W^T, X' = x^T)
 * which is one cublasGemmEx(op(A) = T, op(B) = N, m = out, n = T, k = in,
 * A = W lda = in, B = x ldb = x_stride, C = y ldc = out). The bias is added
 * by a small kernel afterwards.
 *
 * The fused `linear` op (cuda_linear.cu) has its own decode kernel and uses
 * cuBLASLt for larger batches. cuBLAS and cuBLASLt share one workspace,
 * allocated here once, so that neither allocates while a CUDA graph is being
 * captured. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cublas_v2.h>

#include "model/cuda/cuda_backend.h"
#include "model/cuda/cuda_internal.cuh"

/* Per-op GPU time (PDSERVE_CUDA_PROFILE=1): a pair of events around every
 * compute op that is not being recorded into a graph, read back at the next
 * wait of the stream, summed per op name and printed when the backend is
 * destroyed. For finding where a step's time goes (run it eagerly). */
#define PROF_PAIRS 8192
#define PROF_NAMES 24
typedef struct cuda_prof {
    int on, open;          /* profiling; a start event is pending */
    int n;                 /* pairs recorded since the last wait */
    cudaEvent_t *a, *b;    /* [PROF_PAIRS] start and end events */
    const char **op;       /* [PROF_PAIRS] the op of each pair */
    const char *names[PROF_NAMES];
    double ms[PROF_NAMES];
    long calls[PROF_NAMES];
    long dropped;
} cuda_prof;

typedef struct cuda_ctx {
    int device;
    cuda_prof prof;
    cudaStream_t stream;
    cublasHandle_t blas;
    cuda_linear_env lin; /* the linear op's cuBLASLt handle and limits */
    void *stage;         /* upload staging: raw checkpoint bytes before conversion */
    size_t stage_bytes;
    float *f32; /* download staging: fp32 copy of a 16-bit buffer */
    size_t f32_bytes;
    void *blas_ws; /* cuBLAS workspace: fixed, so captured graphs never allocate */
    float *attn_work; /* decode attention's per-part results (fixed, like blas_ws) */
    size_t attn_work_floats;
    int *attn_counters;  /* decode attention's per-item part counters (kept zeroed) */
    cuda_kv_pending kvp; /* a kv_write queued here, not yet launched (see cu_kv_write) */
    pd_dtype kvp_dtype;
    int failed;    /* a deferred error is pending */
    char err[256]; /* its message */
    char name[48];
    /* Every live cudaMalloc of this backend and their sum (bytes_allocated):
     * KV sizing counts its own memory from this, since the device's free
     * memory also falls when another process on the GPU allocates. */
    struct cuda_alloc_rec {
        void *p;
        size_t bytes;
    } *allocs;
    int n_allocs, cap_allocs;
    size_t bytes_live;
} cuda_ctx;

static cuda_ctx *ctx_of(pd_backend *be) {
    return (cuda_ctx *)be->ctx;
}

/* Make the backend's device current on the calling thread (and nothing else:
 * for the two ops that deal with a pending kv_write themselves). */
static void cu_enter_keep(cuda_ctx *c) {
    cudaSetDevice(c->device);
}

static void prof_start(cuda_ctx *c);
static void cu_check_launch(cuda_ctx *c, const char *op);

/* Launch a kv_write that cu_kv_write held back. */
static void cu_flush_kv(cuda_ctx *c, pd_dtype dt) {
    cuda_kv_pending *w = &c->kvp;
    if (!w->on) return;
    w->on = 0;
    prof_start(c);
    cuda_kv_write(c->stream, dt, w->k_cache, w->v_cache, w->k, w->v, w->stride, w->slot_mapping, w->T,
                  w->kv_dim);
    cu_check_launch(c, "kv_write");
}

/* The entry of every op: the backend's device, and any held-back kv_write
 * launched first, so every op sees the cache as the ops' order says. */
static void cu_enter(cuda_ctx *c) {
    cudaSetDevice(c->device);
    if (c->kvp.on) cu_flush_kv(c, c->kvp_dtype);
}

/* Remember the first error of a queued op (reported at the next sync). */
static void cu_defer(cuda_ctx *c, const char *op, const char *what) {
    if (c->failed) return;
    c->failed = 1;
    snprintf(c->err, sizeof c->err, "%s: %s", op, what);
}

static bool prof_active(cuda_ctx *c) {
    if (!c->prof.on) return false;
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    return cudaStreamIsCapturing(c->stream, &st) == cudaSuccess && st == cudaStreamCaptureStatusNone;
}

/* The start of a compute op (after cu_enter). */
static void prof_start(cuda_ctx *c) {
    cuda_prof *p = &c->prof;
    if (!prof_active(c)) return;
    if (p->n >= PROF_PAIRS) {
        p->dropped++;
        return;
    }
    cudaEventRecord(p->a[p->n], c->stream);
    p->open = 1;
}

static void prof_end(cuda_ctx *c, const char *op) {
    cuda_prof *p = &c->prof;
    if (!p->open) return;
    p->open = 0;
    cudaEventRecord(p->b[p->n], c->stream);
    p->op[p->n++] = op;
}

/* After a wait of the stream: every pair has completed. */
static void prof_collect(cuda_ctx *c) {
    cuda_prof *p = &c->prof;
    for (int i = 0; i < p->n; i++) {
        float ms = 0;
        if (cudaEventElapsedTime(&ms, p->a[i], p->b[i]) != cudaSuccess) {
            cudaGetLastError();
            continue;
        }
        int k = 0;
        while (k < PROF_NAMES && p->names[k] && strcmp(p->names[k], p->op[i])) k++;
        if (k == PROF_NAMES) continue;
        p->names[k] = p->op[i];
        p->ms[k] += ms;
        p->calls[k]++;
    }
    p->n = 0;
}

static void prof_report(cuda_ctx *c) {
    cuda_prof *p = &c->prof;
    double total = 0;
    for (int k = 0; k < PROF_NAMES && p->names[k]; k++) total += p->ms[k];
    pd_log(PD_LOG_INFO, "cuda profile (%s): %.3f ms of GPU time in compute ops%s", c->name, total,
           p->dropped ? " (some ops not timed: too many between two waits)" : "");
    bool done[PROF_NAMES] = {false};
    for (;;) { /* largest first */
        int best = -1;
        for (int k = 0; k < PROF_NAMES && p->names[k]; k++)
            if (!done[k] && (best < 0 || p->ms[k] > p->ms[best])) best = k;
        if (best < 0) break;
        done[best] = true;
        pd_log(PD_LOG_INFO, "  %-16s %8ld calls %10.3f ms %8.2f us/call %5.1f%%", p->names[best],
               p->calls[best], p->ms[best], 1e3 * p->ms[best] / (double)p->calls[best],
               total > 0 ? 100 * p->ms[best] / total : 0.0);
    }
}

static int prof_init(cuda_ctx *c) {
    cuda_prof *p = &c->prof;
    p->a = (cudaEvent_t *)calloc(PROF_PAIRS, sizeof *p->a);
    p->b = (cudaEvent_t *)calloc(PROF_PAIRS, sizeof *p->b);
    p->op = (const char **)calloc(PROF_PAIRS, sizeof *p->op);
    if (!p->a || !p->b || !p->op) return -1;
    for (int i = 0; i < PROF_PAIRS; i++)
        if (cudaEventCreate(&p->a[i]) != cudaSuccess || cudaEventCreate(&p->b[i]) != cudaSuccess)
            return -1;
    p->on = 1;
    return 0;
}

static void prof_free(cuda_ctx *c) {
    cuda_prof *p = &c->prof;
    if (p->on) prof_report(c);
    for (int i = 0; i < PROF_PAIRS && p->a && p->b; i++) {
        if (p->a[i]) cudaEventDestroy(p->a[i]);
        if (p->b[i]) cudaEventDestroy(p->b[i]);
    }
    free(p->a);
    free(p->b);
    free(p->op);
}

/* After a kernel launch: catch bad launch configurations at once (and end
 * the op's profile interval). */
static void cu_check_launch(cuda_ctx *c, const char *op) {
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) cu_defer(c, op, cudaGetErrorString(e));
    prof_end(c, op);
}

/* Wait for the stream; turn a pending deferred error or a CUDA error into pd_err. */
static int cu_wait(cuda_ctx *c, const char *what, pd_err *err) {
    cudaError_t e = cudaStreamSynchronize(c->stream);
    if (c->prof.on && e == cudaSuccess) prof_collect(c);
    if (c->failed) {
        c->failed = 0;
        return pd_fail(err, "cuda backend: %s (reported at %s)", c->err, what);
    }
    if (e != cudaSuccess) {
        cudaGetLastError(); /* clear it if it is not sticky */
        return pd_fail(err, "cuda backend: %s: %s", what, cudaGetErrorString(e));
    }
    return 0;
}

/* ---- memory ---- */

/* Remember p (bytes) among the live allocations; -1 when the record does
 * not fit in host memory. */
static int cu_track(cuda_ctx *c, void *p, size_t bytes) {
    if (c->n_allocs == c->cap_allocs) {
        int cap = c->cap_allocs ? 2 * c->cap_allocs : 256;
        void *grown = realloc(c->allocs, (size_t)cap * sizeof *c->allocs);
        if (!grown) return -1;
        c->allocs = (cuda_ctx::cuda_alloc_rec *)grown;
        c->cap_allocs = cap;
    }
    c->allocs[c->n_allocs].p = p;
    c->allocs[c->n_allocs].bytes = bytes;
    c->n_allocs++;
    c->bytes_live += bytes;
    return 0;
}

/* cudaFree and forget p. Searched from the end: the buffers freed in a
 * server's life (staging and scratch that grow) are the recent ones. */
static void cu_free_raw(cuda_ctx *c, void *p) {
    for (int i = c->n_allocs - 1; i >= 0; i--)
        if (c->allocs[i].p == p) {
            c->bytes_live -= c->allocs[i].bytes;
            c->allocs[i] = c->allocs[--c->n_allocs];
            break;
        }
    cudaFree(p);
}

static void *cu_alloc_raw(cuda_ctx *c, size_t bytes, pd_err *err) {
    void *p = NULL;
    if (bytes == 0) bytes = 1; /* callers treat NULL as failure */
    cudaError_t e = cudaMalloc(&p, bytes);
    if (e != cudaSuccess) {
        cudaGetLastError();
        size_t free_b = 0, total_b = 0;
        cudaMemGetInfo(&free_b, &total_b);
        pd_fail(err,
                "cuda backend: out of device memory: cannot allocate %zu bytes (%.1f MiB free "
                "of %.1f MiB on device %d): %s",
                bytes, free_b / 1048576.0, total_b / 1048576.0, c->device, cudaGetErrorString(e));
        return NULL;
    }
    if (cu_track(c, p, bytes) != 0) {
        cudaFree(p);
        pd_fail(err, "cuda backend: out of host memory for the allocation records");
        return NULL;
    }
    return p;
}

static void *cu_alloc(pd_backend *be, size_t bytes, pd_err *err) {
    cuda_ctx *c = ctx_of(be);
    cu_enter(c);
    void *p = cu_alloc_raw(c, bytes, err);
    if (!p) return NULL;
    /* Zeroed, as backend.h promises; ordered before any later op on the stream. */
    cudaError_t e = cudaMemsetAsync(p, 0, bytes ? bytes : 1, c->stream);
    if (e != cudaSuccess) {
        cu_free_raw(c, p);
        pd_fail(err, "cuda backend: zeroing %zu bytes: %s", bytes, cudaGetErrorString(e));
        return NULL;
    }
    return p;
}

static void cu_free(pd_backend *be, void *p) {
    if (!p) return;
    cuda_ctx *c = ctx_of(be);
    cu_enter(c);
    cudaStreamSynchronize(c->stream); /* queued ops may still read it */
    cu_free_raw(c, p);
}

static size_t cu_bytes_allocated(pd_backend *be) {
    return ctx_of(be)->bytes_live;
}

static int cu_mem_info(pd_backend *be, size_t *free_bytes, size_t *total_bytes, pd_err *err) {
    cuda_ctx *c = ctx_of(be);
    cu_enter(c);
    cudaError_t e = cudaMemGetInfo(free_bytes, total_bytes);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return pd_fail(err, "cuda backend: cudaMemGetInfo on device %d: %s", c->device,
                       cudaGetErrorString(e));
    }
    return 0;
}

static int cu_copy(pd_backend *be, void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                   const char *what, pd_err *err) {
    cuda_ctx *c = ctx_of(be);
    cu_enter(c);
    if (bytes == 0) return 0;
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, c->stream);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return pd_fail(err, "cuda backend: %s of %zu bytes: %s", what, bytes,
                       cudaGetErrorString(e));
    }
    return cu_wait(c, what, err);
}

static int cu_copy_h2d(pd_backend *be, void *dst, const void *src, size_t bytes, pd_err *err) {
    return cu_copy(be, dst, src, bytes, cudaMemcpyHostToDevice, "copy to device", err);
}

static int cu_copy_d2h(pd_backend *be, void *dst, const void *src, size_t bytes, pd_err *err) {
    return cu_copy(be, dst, src, bytes, cudaMemcpyDeviceToHost, "copy to host", err);
}

/* Grow a staging buffer to at least bytes. */
static int cu_stage_reserve(pd_backend *be, void **buf, size_t *cap, size_t bytes, pd_err *err) {
    if (*cap >= bytes) return 0;
    cu_free(be, *buf);
    *buf = NULL;
    *cap = 0;
    *buf = cu_alloc_raw(ctx_of(be), bytes, err);
    if (!*buf) return -1;
    *cap = bytes;
    return 0;
}

static int cu_download_f32(pd_backend *be, float *dst, const void *src, size_t n, pd_err *err) {
    cuda_ctx *c = ctx_of(be);
    if (be->dtype == PD_F32) return cu_copy_d2h(be, dst, src, n * sizeof(float), err);
    cu_enter(c);
    if (cu_stage_reserve(be, (void **)&c->f32, &c->f32_bytes, n * sizeof(float), err) != 0)
        return -1;
    cuda_convert(c->stream, c->f32, PD_F32, src, be->dtype, n);
    cu_check_launch(c, "download_f32");
    return cu_copy_d2h(be, dst, c->f32, n * sizeof(float), err);
}

static int cu_upload_view(pd_backend *be, void *dst, const pd_view *v, pd_err *err) {
    cuda_ctx *c = ctx_of(be);
    if (!v->data) return pd_fail(err, "cuda backend: upload of an absent tensor");
    if (v->dtype != PD_F32 && v->dtype != PD_F16 && v->dtype != PD_BF16)
        return pd_fail(err, "cuda backend: unsupported weight dtype %d", (int)v->dtype);
    const size_t n = (size_t)v->rows * (size_t)v->cols;
    const size_t src_bytes = n * pd_dtype_size(v->dtype);
    if (v->dtype == be->dtype) return cu_copy_h2d(be, dst, v->data, src_bytes, err);
    /* Raw bytes to the staging buffer, then one conversion kernel into place. */
    cu_enter(c);
    if (cu_stage_reserve(be, &c->stage, &c->stage_bytes, src_bytes, err) != 0) return -1;
    if (cu_copy_h2d(be, c->stage, v->data, src_bytes, err) != 0) return -1;
    cuda_convert(c->stream, dst, be->dtype, c->stage, v->dtype, n);
    cu_check_launch(c, "upload_view");
    return 0;
}

static int cu_sync(pd_backend *be, pd_err *err) {
    cuda_ctx *c = ctx_of(be);
    cu_enter(c);
    return cu_wait(c, "sync", err);
}

/* ---- compute ---- */

static cudaDataType cu_data_type(pd_dtype t) {
    return t == PD_F16 ? CUDA_R_16F : t == PD_BF16 ? CUDA_R_16BF : CUDA_R_32F;
}

static void cu_gemm(pd_backend *be, void *y, const void *x, int x_stride, const void *w,
                    const void *bias, int T, int in, int out) {
    cuda_ctx *c = ctx_of(be);
    cu_enter(c);
    prof_start(c);
    if (T <= 0 || out <= 0) return;
    const float one = 1.0f, zero = 0.0f;
    const cudaDataType t = cu_data_type(be->dtype);
    /* See the file comment: row-major y = x W^T is column-major y^T = W^T' x^T'. */
    cublasStatus_t st =
        cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, out, T, in, &one, w, t, in, x, t, x_stride,
                     &zero, y, t, out, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS) {
        char msg[96];
        snprintf(msg, sizeof msg, "cublasGemmEx(T=%d, in=%d, out=%d): %s", T, in, out,
                 cublasGetStatusString(st));
        cu_defer(c, "gemm", msg);
        return;
    }
    if (bias) {
        cuda_bias_add(c->stream, be->dtype, y, bias, T, out);
        cu_check_launch(c, "gemm + bias");
    }
    prof_end(c, "gemm");
}

static void cu_layer_norm(pd_backend *be, void *y, const void *x, const void *w, const void *b,
                          int rows, int dim, float eps) {
    cuda_ctx *c = ctx_of(be);
    cu_enter(c);
    prof_start(c);
    cuda_layer_norm(c->stream, be->dtype, y, x, dim, w, b, rows, dim, eps, c->lin.pdl);
    cu_check_launch(c, "layer_norm");
}

static void cu_linear(pd_backend *be, void *y, const void *x, int x_stride, const void *w,
                      const void *bias, int T, int in, int out, const pd_linear_fuse *f) {
    cuda_ctx *c = ctx_of(be);
    cu_enter(c);
    prof_start(c);
    char msg[128];
    if (cuda_linear(&c->lin, be->dtype, y, x, x_stride, w, bias, T, in, out, f, msg, sizeof msg))
        cu_defer(c, "linear", msg);
    else
        cu_check_launch(c, "linear");
}

static void cu_activation(pd_backend *be, void *x, size_t n, pd_activation act) {
    cuda_ctx *c = ctx_of(be);
    cu_enter(c);
    prof_start(c);
    cuda_activation(c->stream, be->dtype, x, n, act);
    cu_check_launch(c, "activation");
}

static void cu_add(pd_backend *be, void *y, const void *x, size_t n) {
    cuda_ctx *c = ctx_of(be);
    cu_enter(c);
    prof_start(c);
    cuda_add(c->stream, be->dtype, y, x, n);
    cu_check_launch(c, "add");
}

static void cu_embedding(pd_backend *be, void *y, const void *table, const int32_t *idx, int offset,
                         int rows, int dim, int accumulate) {
    cuda_ctx *c = ctx_of(be);
    cu_enter(c);
    prof_start(c);
    cuda_embedding(c->stream, be->dtype, y, table, idx, offset, rows, dim, accumulate);
    cu_check_launch(c, "embedding");
}

static void cu_embedding_sum(pd_backend *be, void *y, const void *a, const int32_t *ia,
                             const void *b, const int32_t *ib, int b_offset, int rows, int dim) {
    cuda_ctx *c = ctx_of(be);
    cu_enter(c);
    prof_start(c);
    cuda_embedding_sum(c->stream, be->dtype, y, a, ia, b, ib, b_offset, rows, dim);
    cu_check_launch(c, "embedding");
}

static void cu_gather_rows(pd_backend *be, void *y, const void *x, const int32_t *rows, int n,
                           int dim) {
    cuda_ctx *c = ctx_of(be);
    cu_enter(c);
    prof_start(c);
    cuda_gather_rows(c->stream, be->dtype, y, x, rows, n, dim);
    cu_check_launch(c, "gather_rows");
}

/* kv_write is held back one op: when the next op is this layer's attention
 * of a pure decode step, the attention kernel writes the k and v itself (one
 * launch fewer per layer); any other op launches it first (cu_enter). */
static void cu_kv_write(pd_backend *be, void *k_cache, void *v_cache, const void *k, const void *v,
                        int stride, const pd_step_meta *meta, int kv_dim) {
    cuda_ctx *c = ctx_of(be);
    cu_enter(c); /* an earlier one still held: launched now */
    if (meta->n_tokens <= 0 || kv_dim <= 0) return;
    c->kvp = (cuda_kv_pending){1, k_cache, v_cache, k, v, stride, meta->n_tokens, kv_dim,
                               meta->slot_mapping};
    c->kvp_dtype = be->dtype;
}

static void cu_paged_attention(pd_backend *be, void *out, const void *q, int q_stride,
                               const void *k_cache, const void *v_cache, const pd_step_meta *meta,
                               int heads, int head_dim, int block_size, float scale) {
    cuda_ctx *c = ctx_of(be);
    cu_enter_keep(c); /* a held-back kv_write is this call's to do */
    prof_start(c);
    const cuda_kv_pending *write = c->kvp.on ? &c->kvp : NULL;
    if (head_dim > CUDA_MAX_HEAD_DIM || block_size <= 0) {
        if (c->kvp.on) cu_flush_kv(c, be->dtype);
        char msg[96];
        snprintf(msg, sizeof msg, "head_dim %d (max %d) / block_size %d not supported", head_dim,
                 CUDA_MAX_HEAD_DIM, block_size);
        cu_defer(c, "paged_attention", msg);
        return;
    }
    cuda_paged_attention(c->stream, be->dtype, out, q, q_stride, k_cache, v_cache, meta, heads,
                         head_dim, block_size, scale, c->attn_work, c->attn_work_floats, write,
                         c->attn_counters, c->lin.pdl);
    c->kvp.on = 0; /* fused into the kernel, or launched before it */
    cu_check_launch(c, "paged_attention");
}

static void cu_argmax(pd_backend *be, int32_t *ids, const void *x, int rows, int n) {
    cuda_ctx *c = ctx_of(be);
    cu_enter(c);
    prof_start(c);
    const cuda_argmax_scratch scr = cuda_linear_argmax_scratch(&c->lin);
    cuda_argmax(c->stream, be->dtype, ids, NULL, x, rows, n, &scr, c->lin.pdl);
    cu_check_launch(c, "argmax");
}

static void cu_sample(pd_backend *be, int32_t *ids, const void *x, int rows, int n,
                      const float *params) {
    cuda_ctx *c = ctx_of(be);
    cu_enter(c);
    prof_start(c);
    cuda_sample(c->stream, be->dtype, ids, x, rows, n, params);
    cu_check_launch(c, "sample");
}

static int cu_copy_h2d_async(pd_backend *be, void *dst, const void *src, size_t bytes,
                             pd_err *err) {
    cuda_ctx *c = ctx_of(be);
    cu_enter(c);
    if (bytes == 0) return 0;
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, c->stream);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return pd_fail(err, "cuda backend: queued copy to device of %zu bytes: %s", bytes,
                       cudaGetErrorString(e));
    }
    return 0;
}

static void *cu_host_alloc(pd_backend *be, size_t bytes, pd_err *err) {
    cuda_ctx *c = ctx_of(be);
    cu_enter(c);
    void *p = NULL;
    /* Mapped: with unified addressing (checked at create, host_mapped) the
     * kernels may write these pages at their host address. */
    cudaError_t e = cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocMapped);
    if (e != cudaSuccess) {
        cudaGetLastError();
        pd_fail(err, "cuda backend: %zu bytes of page-locked host memory: %s", bytes,
                cudaGetErrorString(e));
        return NULL;
    }
    return p;
}

static void cu_host_free(pd_backend *be, void *p) {
    if (!p) return;
    cu_enter(ctx_of(be));
    cudaFreeHost(p);
}

static void cu_copy_d2d(pd_backend *be, void *dst, const void *src, size_t bytes) {
    cuda_ctx *c = ctx_of(be);
    cu_enter(c);
    if (bytes && cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c->stream) != cudaSuccess)
        cu_defer(c, "copy_d2d", cudaGetErrorString(cudaGetLastError()));
}

/* ---- CUDA graphs ----
 * Capture is thread-local: only the engine thread's launches on our stream
 * are recorded, other threads (HTTP, connector) may use CUDA meanwhile. */

static int cu_graph_begin(pd_backend *be, pd_err *err) {
    cuda_ctx *c = ctx_of(be);
    cu_enter(c);
    if (c->failed) return cu_wait(c, "graph capture start", err);
    cudaError_t e = cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return pd_fail(err, "cuda backend: starting a graph capture: %s", cudaGetErrorString(e));
    }
    return 0;
}

static int cu_graph_end(pd_backend *be, void **out, pd_err *err) {
    cuda_ctx *c = ctx_of(be);
    cu_enter(c);
    *out = NULL;
    cudaGraph_t graph = NULL;
    cudaError_t e = cudaStreamEndCapture(c->stream, &graph);
    if (c->failed) { /* an op failed while recording: the graph is not usable */
        c->failed = 0;
        if (graph) cudaGraphDestroy(graph);
        cudaGetLastError();
        return pd_fail(err, "cuda backend: graph capture: %s", c->err);
    }
    if (e != cudaSuccess) {
        cudaGetLastError();
        if (graph) cudaGraphDestroy(graph);
        return pd_fail(err, "cuda backend: ending a graph capture: %s", cudaGetErrorString(e));
    }
    cudaGraphExec_t exec = NULL;
    e = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return pd_fail(err, "cuda backend: instantiating a graph: %s", cudaGetErrorString(e));
    }
    *out = exec;
    return 0;
}

static int cu_graph_launch(pd_backend *be, void *graph, pd_err *err) {
    cuda_ctx *c = ctx_of(be);
    cu_enter(c);
    cudaError_t e = cudaGraphLaunch((cudaGraphExec_t)graph, c->stream);
    if (e != cudaSuccess) {
        cudaGetLastError();
        return pd_fail(err, "cuda backend: launching a graph: %s", cudaGetErrorString(e));
    }
    return 0;
}

static void cu_graph_free(pd_backend *be, void *graph) {
    if (!graph) return;
    cuda_ctx *c = ctx_of(be);
    cu_enter(c);
    cudaStreamSynchronize(c->stream); /* a replay may still be running */
    cudaGraphExecDestroy((cudaGraphExec_t)graph);
}

/* ---- events ---- */

static int cu_event_create(pd_backend *be, void **ev, pd_err *err) {
    cu_enter(ctx_of(be));
    cudaEvent_t e = NULL;
    cudaError_t r = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    if (r != cudaSuccess) {
        cudaGetLastError();
        return pd_fail(err, "cuda backend: creating an event: %s", cudaGetErrorString(r));
    }
    *ev = e;
    return 0;
}

static int cu_event_record(pd_backend *be, void *ev, pd_err *err) {
    cuda_ctx *c = ctx_of(be);
    cu_enter(c);
    cudaError_t r = cudaEventRecord((cudaEvent_t)ev, c->stream);
    if (r != cudaSuccess) {
        cudaGetLastError();
        return pd_fail(err, "cuda backend: recording an event: %s", cudaGetErrorString(r));
    }
    return 0;
}

/* Like cu_wait, for the work before ev only. */
static int cu_event_wait(pd_backend *be, void *ev, pd_err *err) {
    cuda_ctx *c = ctx_of(be);
    cu_enter(c);
    cudaError_t r = cudaEventSynchronize((cudaEvent_t)ev);
    if (c->failed) {
        c->failed = 0;
        return pd_fail(err, "cuda backend: %s (reported at an event)", c->err);
    }
    if (r != cudaSuccess) {
        cudaGetLastError();
        return pd_fail(err, "cuda backend: waiting for an event: %s", cudaGetErrorString(r));
    }
    return 0;
}

static void cu_event_free(pd_backend *be, void *ev) {
    if (!ev) return;
    cu_enter(ctx_of(be));
    cudaEventDestroy((cudaEvent_t)ev);
}

/* ---- lifetime ---- */

static void cu_destroy(pd_backend *be) {
    if (!be) return;
    cuda_ctx *c = ctx_of(be);
    if (c) {
        cu_enter(c);
        if (c->stream) cudaStreamSynchronize(c->stream);
        if (c->prof.on) prof_collect(c);
        prof_free(c);
        if (c->stage) cudaFree(c->stage);
        if (c->f32) cudaFree(c->f32);
        if (c->lin.lt) cublasLtDestroy(c->lin.lt);
        cuda_linear_free(&c->lin);
        if (c->blas) cublasDestroy(c->blas);
        if (c->blas_ws) cudaFree(c->blas_ws);
        if (c->attn_work) cudaFree(c->attn_work);
        if (c->attn_counters) cudaFree(c->attn_counters);
        if (c->stream) cudaStreamDestroy(c->stream);
        free(c->allocs);
        free(c);
    }
    free(be);
}

extern "C" int pd_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return n;
}

/* "cuda", "cuda-fp16", "cuda-bf16", each optionally ":N". */
static int cu_parse_name(const char *name, pd_dtype *dtype, int *device, pd_err *err) {
    const char *colon = strchr(name, ':');
    const size_t base = colon ? (size_t)(colon - name) : strlen(name);
    if (base == 4 && !strncmp(name, "cuda", 4))
        *dtype = PD_F32;
    else if (base == 9 && !strncmp(name, "cuda-fp16", 9))
        *dtype = PD_F16;
    else if (base == 9 && !strncmp(name, "cuda-bf16", 9))
        *dtype = PD_BF16;
    else
        return pd_fail(err,
                       "cuda backend: unknown variant '%s' (cuda, cuda-fp16, cuda-bf16, "
                       "optionally :DEVICE)",
                       name);
    const char *dev = colon ? colon + 1 : getenv("PDSERVE_DEVICE");
    *device = 0;
    if (dev && dev[0]) {
        char *end = NULL;
        long d = strtol(dev, &end, 10);
        if (*end || d < 0 || d > 1024)
            return pd_fail(err, "cuda backend: device '%s' is not a device number%s", dev,
                           colon ? "" : " (from PDSERVE_DEVICE)");
        *device = (int)d;
    }
    return 0;
}

extern "C" int pd_backend_cuda_create(const char *name, pd_backend **out, pd_err *err) {
    *out = NULL;
    pd_dtype dtype = PD_F32;
    int device = 0;
    if (cu_parse_name(name, &dtype, &device, err) != 0) return -1;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count == 0) {
        cudaGetLastError();
        return pd_fail(err, "no CUDA device found (%s)",
                       e != cudaSuccess ? cudaGetErrorString(e) : "0 devices visible");
    }
    if (device >= count)
        return pd_fail(err, "cuda backend: device %d does not exist (%d visible)", device, count);
    if ((e = cudaSetDevice(device)) != cudaSuccess)
        return pd_fail(err, "cuda backend: cannot use device %d: %s", device,
                       cudaGetErrorString(e));

    pd_backend *be = (pd_backend *)calloc(1, sizeof *be);
    cuda_ctx *c = (cuda_ctx *)calloc(1, sizeof *c);
    if (!be || !c) {
        free(be);
        free(c);
        return pd_fail(err, "cuda backend: out of memory");
    }
    be->ctx = c;
    c->device = device;
    if ((e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        cu_destroy(be);
        return pd_fail(err, "cuda backend: creating a stream on device %d: %s", device,
                       cudaGetErrorString(e));
    }
    const char *prof = getenv("PDSERVE_CUDA_PROFILE");
    if (prof && !strcmp(prof, "1") && prof_init(c) != 0) {
        cudaGetLastError();
        c->prof.on = 0;
        pd_log(PD_LOG_WARN, "cuda backend: PDSERVE_CUDA_PROFILE: cannot create the timing events");
    }
    cublasStatus_t st = cublasCreate(&c->blas);
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasSetStream(c->blas, c->stream);
    if (st != CUBLAS_STATUS_SUCCESS) {
        c->blas = NULL;
        cu_destroy(be);
        return pd_fail(err, "cuda backend: cuBLAS init on device %d: %s", device,
                       cublasGetStatusString(st));
    }
    /* A workspace of our own: cuBLAS then never allocates inside a graph
     * capture (32 MiB is what NVIDIA suggests for Hopper). */
    const size_t ws_bytes = (size_t)32 << 20;
    if ((e = cudaMalloc(&c->blas_ws, ws_bytes)) != cudaSuccess ||
        cublasSetWorkspace(c->blas, c->blas_ws, ws_bytes) != CUBLAS_STATUS_SUCCESS) {
        cudaGetLastError();
        cu_destroy(be);
        return pd_fail(err, "cuda backend: cuBLAS workspace on device %d: %s", device,
                       cudaGetErrorString(e));
    }
    /* 64 MiB holds the parts of 256 sequences x 32 heads of 64 dims over
     * 2k positions (or 12 heads over 8k); a step beyond that uses the
     * unsplit kernels. */
    c->attn_work_floats = ((size_t)64 << 20) / sizeof(float);
    if ((e = cudaMalloc((void **)&c->attn_work, c->attn_work_floats * sizeof(float))) != cudaSuccess ||
        (e = cudaMalloc((void **)&c->attn_counters, CUDA_DECODE_MAX_ITEMS * sizeof(int))) != cudaSuccess ||
        (e = cudaMemset(c->attn_counters, 0, CUDA_DECODE_MAX_ITEMS * sizeof(int))) != cudaSuccess) {
        cudaGetLastError();
        cu_destroy(be);
        return pd_fail(err, "cuda backend: attention work space on device %d: %s", device,
                       cudaGetErrorString(e));
    }
    /* fp32 mode stays true fp32 (no TF32) so it matches the CPU backend. */
    cublasSetMathMode(c->blas, CUBLAS_DEFAULT_MATH);
    c->lin.stream = c->stream;
    c->lin.blas = c->blas;
    c->lin.workspace = c->blas_ws; /* cuBLASLt shares it: both run on c->stream, in order */
    c->lin.workspace_bytes = ws_bytes;
    if ((st = cublasLtCreate(&c->lin.lt)) != CUBLAS_STATUS_SUCCESS) {
        c->lin.lt = NULL;
        cu_destroy(be);
        return pd_fail(err, "cuda backend: cuBLASLt init on device %d: %s", device,
                       cublasGetStatusString(st));
    }
    if ((e = cuda_linear_init(&c->lin, device)) != cudaSuccess ||
        (e = cuda_decode_attention_init()) != cudaSuccess) {
        cudaGetLastError();
        cu_destroy(be);
        return pd_fail(err, "cuda backend: setting up the kernels on device %d: %s", device,
                       cudaGetErrorString(e));
    }

    cudaDeviceProp prop;
    const char *gpu = cudaGetDeviceProperties(&prop, device) == cudaSuccess ? prop.name : "?";
    snprintf(c->name, sizeof c->name, "cuda:%d(%s)", device, pd_dtype_name(dtype));
    pd_log(PD_LOG_INFO, "cuda backend: device %d (%s), %s storage, fp32 accumulation", device, gpu,
           pd_dtype_name(dtype));
    be->name = c->name;
    be->dtype = dtype;
    be->elem_size = pd_dtype_size(dtype);
    be->n_threads = 1;
    be->device = device;
    be->alloc = cu_alloc;
    be->free = cu_free;
    be->copy_h2d = cu_copy_h2d;
    be->copy_d2h = cu_copy_d2h;
    be->download_f32 = cu_download_f32;
    be->upload_view = cu_upload_view;
    be->sync = cu_sync;
    be->mem_info = cu_mem_info;
    be->bytes_allocated = cu_bytes_allocated;
    be->gemm = cu_gemm;
    be->linear = cu_linear;
    be->linear_argmax = 1;
    /* PDSERVE_CUDA_EMBED=0: the embedding as its own op (for A/B timing). */
    const char *embed = getenv("PDSERVE_CUDA_EMBED");
    be->linear_embed = !(embed && !strcmp(embed, "0"));
    be->layer_norm = cu_layer_norm;
    be->activation = cu_activation;
    be->add = cu_add;
    be->embedding = cu_embedding;
    be->embedding_sum = cu_embedding_sum;
    be->gather_rows = cu_gather_rows;
    be->kv_write = cu_kv_write;
    be->paged_attention = cu_paged_attention;
    be->argmax = cu_argmax;
    be->sample = cu_sample;
    be->copy_h2d_async = cu_copy_h2d_async;
    be->copy_d2d = cu_copy_d2d;
    be->host_alloc = cu_host_alloc;
    be->host_free = cu_host_free;
    int unified = 0; /* mapped host memory then has one address on both sides */
    be->host_mapped =
        cudaDeviceGetAttribute(&unified, cudaDevAttrUnifiedAddressing, device) == cudaSuccess &&
        unified;
    cudaGetLastError();
    be->graph_begin = cu_graph_begin;
    be->graph_end = cu_graph_end;
    be->graph_launch = cu_graph_launch;
    be->graph_free = cu_graph_free;
    be->event_create = cu_event_create;
    be->event_record = cu_event_record;
    be->event_wait = cu_event_wait;
    be->event_free = cu_event_free;
    be->destroy = cu_destroy;
    *out = be;
    return 0;
}
