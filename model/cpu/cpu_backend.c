/* cpu_backend: the ops table (backend.h) on the host CPU, in fp32.
 *
 * "Device memory" is ordinary heap memory, so copies are memcpy. Weights of
 * any checkpoint dtype are widened to fp32 when uploaded: an fp16 checkpoint
 * takes twice its file size in RAM. Big ops run on a persistent thread pool
 * (cpu_pool); ops on a handful of elements run on the calling thread because
 * waking the pool would cost more than the work. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/cpu/cpu_internal.h"

struct cpu_ctx {
    cpu_pool *pool;
    gemm_rows_fn gemm_kernel;
    const char *isa;
    char name[32];
};

cpu_pool *cpu_ctx_pool(const pd_backend *be) {
    return ((const cpu_ctx *)be->ctx)->pool;
}

/* Element-wise work below this many elements stays on one thread. */
#define CPU_SERIAL_ELEMS 32768

/* ---- memory ---- */

static void *cpu_alloc(pd_backend *be, size_t bytes, pd_err *err) {
    (void)be;
    void *p = calloc(1, bytes ? bytes : 1);
    if (!p) pd_fail(err, "cpu backend: cannot allocate %zu bytes", bytes);
    return p;
}

static void cpu_free(pd_backend *be, void *p) {
    (void)be;
    free(p);
}

static int cpu_copy(pd_backend *be, void *dst, const void *src, size_t bytes, pd_err *err) {
    (void)be, (void)err;
    if (bytes) memcpy(dst, src, bytes);
    return 0;
}

static int cpu_download_f32(pd_backend *be, float *dst, const void *src, size_t n, pd_err *err) {
    return cpu_copy(be, dst, src, n * sizeof(float), err);
}

static int cpu_sync(pd_backend *be, pd_err *err) {
    (void)be, (void)err;
    return 0; /* every op has finished when it returns */
}

/* IEEE half -> float, including subnormals, inf and NaN. */
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalise the mantissa */
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while (!(man & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static int cpu_upload_view(pd_backend *be, void *dst, const pd_view *v, pd_err *err) {
    (void)be;
    if (!v->data) return pd_fail(err, "cpu backend: upload of an absent tensor");
    size_t n = (size_t)v->rows * (size_t)v->cols;
    float *y = dst;
    switch (v->dtype) {
    case PD_F32:
        memcpy(y, v->data, n * sizeof(float));
        return 0;
    /* Checkpoint data need not be 2-byte aligned (safetensors does not
     * promise it): each element is copied out, not read in place. */
    case PD_F16: {
        const unsigned char *h = v->data;
        for (size_t i = 0; i < n; i++) {
            uint16_t x;
            memcpy(&x, h + 2 * i, 2);
            y[i] = half_to_float(x);
        }
        return 0;
    }
    case PD_BF16: {
        const unsigned char *h = v->data;
        for (size_t i = 0; i < n; i++) {
            uint16_t x;
            memcpy(&x, h + 2 * i, 2);
            uint32_t bits = (uint32_t)x << 16;
            memcpy(&y[i], &bits, sizeof bits);
        }
        return 0;
    }
    }
    return pd_fail(err, "cpu backend: unsupported weight dtype %d", (int)v->dtype);
}

/* ---- a parallel loop over [0, n) in contiguous ranges ---- */

typedef void (*range_fn)(void *arg, size_t i0, size_t i1);

typedef struct range_job {
    range_fn fn;
    void *arg;
    size_t n, per_task;
} range_job;

static void range_task(void *arg, int task) {
    const range_job *j = arg;
    size_t i0 = (size_t)task * j->per_task, i1 = i0 + j->per_task;
    j->fn(j->arg, i0, i1 < j->n ? i1 : j->n);
}

/* Run fn over [0, n); cost_per_item ~ elements touched per item. */
static void cpu_parallel_range(pd_backend *be, size_t n, size_t cost_per_item, range_fn fn,
                               void *arg) {
    cpu_pool *pool = cpu_ctx_pool(be);
    int nth = cpu_pool_threads(pool);
    if (n == 0) return;
    if (nth == 1 || n * cost_per_item < CPU_SERIAL_ELEMS || n == 1) {
        fn(arg, 0, n);
        return;
    }
    size_t tasks = (size_t)nth * 4;
    if (tasks > n) tasks = n;
    range_job j = {fn, arg, n, (n + tasks - 1) / tasks};
    cpu_pool_run(pool, (int)((n + j.per_task - 1) / j.per_task), range_task, &j);
}

/* ---- compute ---- */

static void cpu_gemm_op(pd_backend *be, void *y, const void *x, int x_stride, const void *w,
                        const void *bias, int T, int in, int out) {
    cpu_ctx *c = be->ctx;
    cpu_gemm(c->pool, c->gemm_kernel, y, x, x_stride, w, bias, T, in, out);
}

typedef struct ln_job {
    float *y;
    const float *x, *w, *b;
    int dim;
    float eps;
} ln_job;

static void ln_rows(void *arg, size_t r0, size_t r1) {
    const ln_job *j = arg;
    const int d = j->dim;
    for (size_t r = r0; r < r1; r++) {
        const float *x = j->x + r * d;
        float *y = j->y + r * d;
        float sum = 0.0f;
        for (int i = 0; i < d; i++)
            sum += x[i];
        const float mean = sum / d;
        float ss = 0.0f;
        for (int i = 0; i < d; i++)
            ss += (x[i] - mean) * (x[i] - mean);
        const float rstd = 1.0f / sqrtf(ss / d + j->eps); /* biased variance, as torch */
        if (j->w) {
            for (int i = 0; i < d; i++)
                y[i] = (x[i] - mean) * rstd * j->w[i] + j->b[i];
        } else {
            for (int i = 0; i < d; i++)
                y[i] = (x[i] - mean) * rstd;
        }
    }
}

static void cpu_layer_norm(pd_backend *be, void *y, const void *x, const void *w, const void *b,
                           int rows, int dim, float eps) {
    ln_job j = {y, x, w, b, dim, eps};
    cpu_parallel_range(be, (size_t)rows, (size_t)dim * 3, ln_rows, &j);
}

typedef struct act_job {
    float *x;
    pd_activation act;
} act_job;

static void act_range(void *arg, size_t i0, size_t i1) {
    const act_job *j = arg;
    float *x = j->x;
    switch (j->act) {
    case PD_ACT_RELU:
        for (size_t i = i0; i < i1; i++)
            x[i] = x[i] > 0.0f ? x[i] : 0.0f;
        break;
    case PD_ACT_GELU: /* exact: 0.5 x (1 + erf(x / sqrt 2)) */
        for (size_t i = i0; i < i1; i++)
            x[i] = 0.5f * x[i] * (1.0f + erff(x[i] * 0.70710678f));
        break;
    case PD_ACT_GELU_NEW: /* tanh approximation */
        for (size_t i = i0; i < i1; i++) {
            const float v = x[i];
            x[i] = 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)));
        }
        break;
    case PD_ACT_SILU:
        for (size_t i = i0; i < i1; i++)
            x[i] = x[i] / (1.0f + expf(-x[i]));
        break;
    }
}

static void cpu_activation(pd_backend *be, void *x, size_t n, pd_activation act) {
    act_job j = {x, act};
    cpu_parallel_range(be, n, act == PD_ACT_RELU ? 1 : 8, act_range, &j);
}

typedef struct add_job {
    float *y;
    const float *x;
} add_job;

static void add_range(void *arg, size_t i0, size_t i1) {
    const add_job *j = arg;
    for (size_t i = i0; i < i1; i++)
        j->y[i] += j->x[i];
}

static void cpu_add(pd_backend *be, void *y, const void *x, size_t n) {
    add_job j = {y, x};
    cpu_parallel_range(be, n, 1, add_range, &j);
}

static void cpu_embedding(pd_backend *be, void *y, const void *table, const int32_t *idx,
                          int offset, int rows, int dim, int accumulate) {
    (void)be;
    float *out = y;
    const float *tab = table;
    for (int t = 0; t < rows; t++) {
        const float *src = tab + (size_t)(idx[t] + offset) * dim;
        float *dst = out + (size_t)t * dim;
        if (accumulate) {
            for (int i = 0; i < dim; i++)
                dst[i] += src[i];
        } else {
            memcpy(dst, src, (size_t)dim * sizeof(float));
        }
    }
}

static void cpu_gather_rows(pd_backend *be, void *y, const void *x, const int32_t *rows, int n,
                            int dim) {
    (void)be;
    for (int i = 0; i < n; i++)
        memmove((float *)y + (size_t)i * dim, (const float *)x + (size_t)rows[i] * dim,
                (size_t)dim * sizeof(float));
}

static void cpu_kv_write(pd_backend *be, void *k_cache, void *v_cache, const void *k, const void *v,
                         int stride, const pd_step_meta *meta, int kv_dim) {
    (void)be;
    const size_t row = (size_t)kv_dim * sizeof(float);
    for (int t = 0; t < meta->n_tokens; t++) {
        const size_t slot = (size_t)meta->slot_mapping[t];
        memcpy((float *)k_cache + slot * kv_dim, (const float *)k + (size_t)t * stride, row);
        memcpy((float *)v_cache + slot * kv_dim, (const float *)v + (size_t)t * stride, row);
    }
}

static void cpu_destroy(pd_backend *be) {
    if (!be) return;
    cpu_ctx *c = be->ctx;
    if (c) cpu_pool_destroy(c->pool);
    free(c);
    free(be);
}

int cpu_backend_create(int n_threads, bool baseline, pd_backend **out, pd_err *err) {
    *out = NULL;
    if (n_threads <= 0) n_threads = pd_num_cpus();
    pd_backend *be = calloc(1, sizeof *be);
    cpu_ctx *c = calloc(1, sizeof *c);
    if (!be || !c) {
        free(be);
        free(c);
        return pd_fail(err, "cpu backend: out of memory");
    }
    be->ctx = c;
    if (cpu_pool_create(n_threads, &c->pool, err) != 0) {
        cpu_destroy(be);
        return -1;
    }
    c->gemm_kernel = cpu_gemm_pick(baseline, &c->isa);
    snprintf(c->name, sizeof c->name, "cpu(%s)", c->isa);
    be->name = c->name;
    be->dtype = PD_F32;
    be->elem_size = sizeof(float);
    be->n_threads = n_threads;
    be->device = -1;
    be->alloc = cpu_alloc;
    be->free = cpu_free;
    be->copy_h2d = cpu_copy;
    be->copy_d2h = cpu_copy;
    be->download_f32 = cpu_download_f32;
    be->upload_view = cpu_upload_view;
    be->sync = cpu_sync;
    be->gemm = cpu_gemm_op;
    /* No fused linear: opt.c composes it from the ops below, so every result
     * keeps the one reduction order those ops guarantee. */
    be->linear = NULL;
    be->layer_norm = cpu_layer_norm;
    be->activation = cpu_activation;
    be->add = cpu_add;
    be->embedding = cpu_embedding;
    be->gather_rows = cpu_gather_rows;
    be->kv_write = cpu_kv_write;
    be->paged_attention = cpu_paged_attention;
    be->destroy = cpu_destroy;
    *out = be;
    return 0;
}
