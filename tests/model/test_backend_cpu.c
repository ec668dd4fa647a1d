/* test_backend_cpu: the CPU backend's ops against naive loops written here —
 * GEMM over awkward shapes and thread counts (both the AVX2 and the SSE2
 * kernels), layer norm, activations, fp16/bf16 weight conversion, and the
 * thread pool under many back-to-back runs. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/backend.h"
#include "model/cpu/cpu_pool.h"
#include "tests/common/testlib.h"

static uint64_t rng = 88172645463325252ull;
static float frand(void) { /* uniform in [-1, 1) */
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((rng >> 11) * (1.0 / 9007199254740992.0)) * 2.0f - 1.0f;
}

static void test_gemm(const char *name, int nth) {
    pd_backend *be;
    pd_err err;
    CHECKF(pd_backend_create(name, nth, &be, &err) == 0, "%s", err.msg);
    const int Ts[] = {1, 2, 3, 4, 5, 17, 64};
    const int ins[] = {1, 5, 13, 32, 67, 200};
    const int outs[] = {1, 3, 7, 30, 129};
    int bad = 0, cases = 0;
    for (size_t a = 0; a < sizeof Ts / sizeof *Ts; a++)
        for (size_t b = 0; b < sizeof ins / sizeof *ins; b++)
            for (size_t c = 0; c < sizeof outs / sizeof *outs; c++) {
                const int T = Ts[a], in = ins[b], out = outs[c], xs = in + (int)(c % 2) * 3;
                float *x = malloc(sizeof(float) * T * xs), *w = malloc(sizeof(float) * out * in);
                float *bias = malloc(sizeof(float) * out), *y = malloc(sizeof(float) * T * out);
                for (int i = 0; i < T * xs; i++)
                    x[i] = frand();
                for (int i = 0; i < out * in; i++)
                    w[i] = frand();
                for (int i = 0; i < out; i++)
                    bias[i] = frand();
                const int with_bias = (a + b) % 2;
                be->gemm(be, y, x, xs, w, with_bias ? bias : NULL, T, in, out);
                for (int t = 0; t < T; t++)
                    for (int o = 0; o < out; o++) {
                        double ref = with_bias ? bias[o] : 0.0;
                        for (int i = 0; i < in; i++)
                            ref += (double)x[t * xs + i] * w[o * in + i];
                        if (fabs(ref - y[t * out + o]) > 1e-4 * (1 + sqrt((double)in))) {
                            if (bad < 5)
                                fprintf(stderr, "%s/%d T=%d in=%d out=%d [%d,%d]: %g vs %g\n", name,
                                        nth, T, in, out, t, o, y[t * out + o], ref);
                            bad++;
                        }
                    }
                cases++;
                free(x), free(w), free(bias), free(y);
            }
    CHECKF(bad == 0, "%s with %d threads: %d wrong outputs over %d shapes", name, nth, bad, cases);
    pd_backend_destroy(be);
}

/* Batch invariance: a row's GEMM result is bitwise the same whether it is
 * computed alone, inside a batch of any size (at any position in it), or
 * with another thread count. The serving engine relies on this. */
static void test_gemm_batch_invariance(const char *name) {
    const int in = 200, out = 131, T = 23;
    float *x = malloc(sizeof(float) * T * in), *w = malloc(sizeof(float) * out * in);
    float *bias = malloc(sizeof(float) * out), *y_all = malloc(sizeof(float) * T * out);
    float *y_one = malloc(sizeof(float) * out), *y_part = malloc(sizeof(float) * T * out);
    for (int i = 0; i < T * in; i++) x[i] = frand();
    for (int i = 0; i < out * in; i++) w[i] = frand();
    for (int i = 0; i < out; i++) bias[i] = frand();
    pd_backend *be1, *be3;
    pd_err err;
    CHECKF(pd_backend_create(name, 1, &be1, &err) == 0, "%s", err.msg);
    CHECKF(pd_backend_create(name, 3, &be3, &err) == 0, "%s", err.msg);
    be3->gemm(be3, y_all, x, in, w, bias, T, in, out);
    int differ = 0;
    for (int t = 0; t < T; t++) {
        be1->gemm(be1, y_one, x + (size_t)t * in, in, w, bias, 1, in, out);
        differ += memcmp(y_one, y_all + (size_t)t * out, sizeof(float) * out) != 0;
    }
    /* Sub-batches starting at odd offsets (tile positions change). */
    for (int start = 1; start + 6 <= T; start += 5) {
        be1->gemm(be1, y_part, x + (size_t)start * in, in, w, bias, 6, in, out);
        differ += memcmp(y_part, y_all + (size_t)start * out, sizeof(float) * 6 * out) != 0;
    }
    CHECKF(differ == 0, "%s: %d rows differ bitwise between batch sizes", name, differ);
    pd_backend_destroy(be1);
    pd_backend_destroy(be3);
    free(x), free(w), free(bias), free(y_all), free(y_one), free(y_part);
}

static void test_layer_norm_and_act(void) {
    pd_backend *be;
    pd_err err;
    CHECK(pd_backend_create("cpu", 2, &be, &err) == 0);
    const int rows = 37, dim = 1000; /* big enough to take the threaded path */
    float *x = malloc(sizeof(float) * rows * dim), *y = malloc(sizeof(float) * rows * dim);
    float w[1000], b[1000];
    for (int i = 0; i < rows * dim; i++)
        x[i] = 3.0f * frand() + 0.5f;
    for (int i = 0; i < dim; i++)
        w[i] = frand(), b[i] = frand();
    for (int affine = 0; affine < 2; affine++) {
        be->layer_norm(be, y, x, affine ? w : NULL, affine ? b : NULL, rows, dim, 1e-5f);
        double maxd = 0;
        for (int r = 0; r < rows; r++) {
            double mean = 0, var = 0;
            for (int i = 0; i < dim; i++)
                mean += x[r * dim + i];
            mean /= dim;
            for (int i = 0; i < dim; i++)
                var += (x[r * dim + i] - mean) * (x[r * dim + i] - mean);
            var /= dim;
            for (int i = 0; i < dim; i++) {
                double ref = (x[r * dim + i] - mean) / sqrt(var + 1e-5);
                if (affine) ref = ref * w[i] + b[i];
                maxd = fmax(maxd, fabs(ref - y[r * dim + i]));
            }
        }
        CHECKF(maxd < 1e-4, "layer norm (affine %d) max diff %g", affine, maxd);
    }
    /* activations, from their definitions */
    const pd_activation acts[] = {PD_ACT_RELU, PD_ACT_GELU, PD_ACT_GELU_NEW, PD_ACT_SILU};
    const size_t n = 50000;
    float *v = malloc(sizeof(float) * n), *src = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++)
        src[i] = 6.0f * frand();
    for (int a = 0; a < 4; a++) {
        memcpy(v, src, sizeof(float) * n);
        be->activation(be, v, n, acts[a]);
        double maxd = 0;
        for (size_t i = 0; i < n; i++) {
            double z = src[i], ref;
            if (acts[a] == PD_ACT_RELU)
                ref = z > 0 ? z : 0;
            else if (acts[a] == PD_ACT_GELU)
                ref = 0.5 * z * (1 + erf(z / sqrt(2.0)));
            else if (acts[a] == PD_ACT_GELU_NEW)
                ref = 0.5 * z * (1 + tanh(sqrt(2.0 / M_PI) * (z + 0.044715 * z * z * z)));
            else
                ref = z / (1 + exp(-z));
            maxd = fmax(maxd, fabs(ref - v[i]));
        }
        CHECKF(maxd < 1e-5, "activation %d max diff %g", a, maxd);
    }
    /* residual add */
    memcpy(v, src, sizeof(float) * n);
    be->add(be, v, src, n);
    int add_ok = 1;
    for (size_t i = 0; i < n; i++)
        add_ok &= v[i] == 2 * src[i];
    CHECK(add_ok);
    free(x), free(y), free(v), free(src);
    pd_backend_destroy(be);
}

/* fp16 encoding of a float that is exactly representable (normal or 0). */
static uint16_t f16_bits_exact(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) == 0) return (uint16_t)(u >> 16);
    uint32_t sign = (u >> 16) & 0x8000, e = ((u >> 23) & 0xff) - 127 + 15, m = (u >> 13) & 0x3ff;
    return (uint16_t)(sign | (e << 10) | m);
}

static void test_upload_conversion(void) {
    pd_backend *be;
    pd_err err;
    CHECK(pd_backend_create("cpu", 1, &be, &err) == 0);
    enum { N = 300 };
    float vals[N], got[N];
    uint16_t h[N], bf[N];
    for (int i = 0; i < N; i++) {
        int k = (int)(frand() * 2047); /* k * 2^-10: exact in fp16 */
        vals[i] = (float)k / 1024.0f * (i % 3 == 0 ? 64.0f : 1.0f);
        h[i] = f16_bits_exact(vals[i]);
        uint32_t u;
        memcpy(&u, &vals[i], 4);
        bf[i] = (uint16_t)(u >> 16);
    }
    /* special fp16 values, decoded by hand */
    h[0] = 0x7c00; /* +inf */
    h[1] = 0x0001; /* smallest subnormal 2^-24 */
    h[2] = 0x83ff; /* largest negative subnormal */
    h[3] = 0x8000; /* -0 */
    float *dev = be->alloc(be, sizeof got, &err);
    pd_view v16 = {h, PD_F16, 10, 30};
    CHECK(be->upload_view(be, dev, &v16, &err) == 0);
    CHECK(be->download_f32(be, got, dev, N, &err) == 0);
    int ok = 1;
    for (int i = 4; i < N; i++)
        ok &= got[i] == vals[i];
    CHECK(ok);
    CHECK(isinf(got[0]) && got[0] > 0);
    CHECK(got[1] == ldexpf(1.0f, -24));
    CHECK(got[2] == -1023.0f * ldexpf(1.0f, -24));
    CHECK(got[3] == 0.0f && signbit(got[3]));
    pd_view vb = {bf, PD_BF16, 1, N};
    CHECK(be->upload_view(be, dev, &vb, &err) == 0);
    ok = 1;
    for (int i = 0; i < N; i++) {
        uint32_t u = (uint32_t)bf[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        ok &= dev[i] == f && fabsf(f - vals[i]) <= fabsf(vals[i]) / 128.0f;
    }
    CHECK(ok);
    be->free(be, dev);
    pd_backend_destroy(be);
}

typedef struct pool_sum {
    int *hits;
} pool_sum;
static void pool_mark(void *arg, int task) {
    ((pool_sum *)arg)->hits[task]++;
}

static void test_pool(void) {
    pd_err err;
    for (int nth = 1; nth <= 3; nth++) {
        cpu_pool *p;
        CHECK(cpu_pool_create(nth, &p, &err) == 0);
        int hits[257] = {0};
        pool_sum s = {hits};
        for (int run = 0; run < 2000; run++)
            cpu_pool_run(p, 1 + run % 257, pool_mark, &s);
        int ok = 1;
        for (int t = 0; t < 257; t++) { /* task t runs once in every run with n > t */
            int expect = 0;
            for (int run = 0; run < 2000; run++)
                expect += t < 1 + run % 257;
            ok &= hits[t] == expect;
        }
        CHECKF(ok, "pool with %d threads lost or repeated tasks", nth);
        cpu_pool_destroy(p);
    }
    cpu_pool *p;
    CHECK(cpu_pool_create(0, &p, &err) == -1 && strstr(err.msg, "n_threads"));
    pd_backend *be;
    CHECK(pd_backend_create("tpu", 1, &be, &err) == -1 && strstr(err.msg, "tpu"));
}

int main(void) {
    for (int nth = 1; nth <= 3; nth++) {
        test_gemm("cpu", nth);
        test_gemm("cpu-baseline", nth);
    }
    test_gemm_batch_invariance("cpu");
    test_gemm_batch_invariance("cpu-baseline");
    test_layer_norm_and_act();
    test_upload_conversion();
    test_pool();
    return test_finish();
}
