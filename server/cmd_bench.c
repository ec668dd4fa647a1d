/* cmd_bench: `pdserve bench-cpu` — measures this machine's memory read
 * bandwidth and vector FLOP rate, then the CPU backend's prefill and batch-1
 * decode speed on a model, and reports each as a fraction of the limit.
 * Decode of one token must read every weight once, so its floor is
 * weight_bytes / bandwidth; prefill is compute bound, so its ceiling is
 * FLOP rate / (2 * params) tokens per second. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/opt.h"
#include "server/cli.h"
#include "server/commands.h"
#include "server/device_options.h"

typedef struct bench_opts {
    int prompt_len, decode_tokens, threads, repeat, enforce_eager, decode_ahead, help;
    const char *backend, *device, *dtype;
    char device_name[24]; /* --device with auto resolved */
} bench_opts;

static const cli_option bench_table[] = {
    {"prompt-len", CLI_INT, offsetof(bench_opts, prompt_len), "512", 1, 1 << 20, "prefill length (tokens)"},
    {"decode-tokens", CLI_INT, offsetof(bench_opts, decode_tokens), "64", 0, 1 << 20, "batch-1 decode steps"},
    {"repeat", CLI_INT, offsetof(bench_opts, repeat), "5", 1, 1000, "timed prefills on a GPU (the best and median are shown)"},
    {"enforce-eager", CLI_BOOL, offsetof(bench_opts, enforce_eager), "false", 1, 0, "GPU: decode without CUDA graphs"},
    {"decode-ahead", CLI_BOOL, offsetof(bench_opts, decode_ahead), "false", 1, 0,
     "GPU: also time decode with each step queued before the previous one is read (opt_forward_queue)"},
    {"threads", CLI_INT, offsetof(bench_opts, threads), "0", 0, 1024, "CPU threads (0: one per core)"},
    {"device", CLI_STR, offsetof(bench_opts, device), "cpu", 1, 0,
     "cpu, cuda (cuda:N for device N), auto (cuda when a GPU is visible, else cpu)"},
    {"dtype", CLI_STR, offsetof(bench_opts, dtype), "auto", 1, 0,
     "auto, half, float16, bfloat16, float, float32 (as for serve)"},
    {"backend", CLI_STR, offsetof(bench_opts, backend), NULL, 1, 0,
     "instead of --device/--dtype, a backend by name: cpu, cuda, cuda-fp16 or cuda-bf16 "
     "(cuda...:N picks device N)"},
    {"help", CLI_BOOL, offsetof(bench_opts, help), "false", 1, 0, "show this help"},
};

typedef float v8f __attribute__((vector_size(32)));

/* The FLOP-rate probe: 8 independent multiply-add chains of 8 lanes, enough
 * to fill the FP pipes. Built twice, like the GEMM kernels: for plain x86-64
 * and for AVX2+FMA, and picked the same way, so the ratio compares our GEMM
 * with what the same instructions can do. */
#define FLOPS_BODY(MADD)                                                                       \
    v8f a[8], m = {1.0000001f, 1.0000001f, 1.0000001f, 1.0000001f, 1.0000001f, 1.0000001f,      \
                   1.0000001f, 1.0000001f};                                                    \
    v8f c = {1e-7f, 1e-7f, 1e-7f, 1e-7f, 1e-7f, 1e-7f, 1e-7f, 1e-7f};                          \
    for (int k = 0; k < 8; k++) a[k] = c * (float)(k + 1);                                     \
    for (long i = 0; i < iters; i++)                                                           \
        for (int k = 0; k < 8; k++) a[k] = MADD(a[k], m, c);                                   \
    double s = 0;                                                                              \
    for (int k = 0; k < 8; k++)                                                                \
        for (int l = 0; l < 8; l++) s += a[k][l];                                              \
    return s;

#define PLAIN_MADD(a, m, c) ((a) * (m) + (c))
static double flops_plain(long iters) { FLOPS_BODY(PLAIN_MADD) }

#if defined(__x86_64__)
#include <immintrin.h>
#define FMA_MADD(a, m, c) ((v8f)_mm256_fmadd_ps((__m256)(a), (__m256)(m), (__m256)(c)))
__attribute__((target("avx2,fma"))) static double flops_fma(long iters) { FLOPS_BODY(FMA_MADD) }
#endif

static double flops_kernel(long iters, const char **isa) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        *isa = "avx2+fma";
        return flops_fma(iters);
    }
#endif
    *isa = "sse2";
    return flops_plain(iters);
}

typedef struct bw_job {
    const float *data;
    size_t n;
    double sum;
    int flops_mode;
    long iters;
    const char *isa;
} bw_job;

static void *bw_worker(void *arg) {
    bw_job *j = arg;
    if (j->flops_mode) {
        j->sum = flops_kernel(j->iters, &j->isa);
        return NULL;
    }
    /* Read-only streaming: 8 independent vector sums. */
    v8f acc[8] = {{0}};
    const v8f *p = (const v8f *)j->data;
    size_t n = j->n / 8;
    for (size_t i = 0; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++) acc[k] += p[i + k];
    double s = 0;
    for (int k = 0; k < 8; k++)
        for (int l = 0; l < 8; l++) s += acc[k][l];
    j->sum = s;
    return NULL;
}

/* Run n_threads workers over the job template; returns seconds. */
static double run_workers(int n_threads, bw_job *jobs) {
    pthread_t th[256];
    double t0 = pd_now();
    for (int t = 0; t < n_threads; t++) pthread_create(&th[t], NULL, bw_worker, &jobs[t]);
    for (int t = 0; t < n_threads; t++) pthread_join(th[t], NULL);
    return pd_now() - t0;
}

static double measure_bandwidth(int n_threads) {
    size_t bytes = (size_t)1 << 30, n = bytes / sizeof(float);
    float *buf = aligned_alloc(64, bytes);
    if (!buf) return 0;
    for (size_t i = 0; i < n; i++) buf[i] = (float)(i & 1023);
    bw_job jobs[256];
    size_t per = (n / (size_t)n_threads) & ~(size_t)31;
    double best = 1e30;
    for (int rep = 0; rep < 5; rep++) {
        for (int t = 0; t < n_threads; t++) jobs[t] = (bw_job){buf + per * (size_t)t, per, 0, 0, 0, NULL};
        double s = run_workers(n_threads, jobs);
        if (s < best) best = s;
    }
    free(buf);
    return (double)per * (size_t)n_threads * sizeof(float) / best;
}

static double measure_flops(int n_threads, const char **isa) {
    bw_job jobs[256];
    long iters = 20 * 1000 * 1000;
    double best = 1e30;
    for (int rep = 0; rep < 3; rep++) {
        for (int t = 0; t < n_threads; t++) jobs[t] = (bw_job){NULL, 0, 0, 1, iters, NULL};
        double s = run_workers(n_threads, jobs);
        if (s < best) best = s;
    }
    *isa = jobs[0].isa;
    return (double)n_threads * (double)iters * 8 * 8 * 2 / best;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Device memory bandwidth: the best of 5 device-to-device copies of 1 GiB
 * (each byte read once and written once), the "copy bandwidth" the decode
 * limit is set against; the backend's add kernel where it has no copy. */
static double device_bandwidth(pd_backend *be, pd_err *err) {
    const size_t bytes = (size_t)1 << 30, n = bytes / be->elem_size;
    void *x = be->alloc(be, bytes, err), *y = x ? be->alloc(be, bytes, err) : NULL;
    double best = 1e30, moved = be->copy_d2d ? 2.0 * bytes : 3.0 * bytes;
    for (int rep = 0; y && rep < 6; rep++) {
        double t0 = pd_now();
        if (be->copy_d2d)
            be->copy_d2d(be, y, x, bytes);
        else
            be->add(be, y, x, n);
        if (be->sync(be, err) != 0) break;
        double t = pd_now() - t0;
        if (rep > 0 && t < best) best = t; /* the first is a warm-up */
    }
    be->free(be, y);
    be->free(be, x);
    return best < 1e30 ? moved / best : 0;
}

/* The GPU figures: prefill TTFT (best and median of --repeat runs) and
 * batch-1 greedy decode the way the server runs it (graphs unless
 * --enforce-eager, only the picked id copied back), against the limit of
 * reading every weight once per token at the measured bandwidth. */
static int bench_device(const bench_opts *o, const char *model_arg) {
    pd_err err = {{0}};
    char *dir = NULL;
    pd_backend *be = NULL;
    opt_model *m = NULL;
    opt_kv_storage *kv = NULL;
    int rc = 1;
    const int total = o->prompt_len + o->decode_tokens, bs = 16, n_blocks = (total + bs - 1) / bs + 1;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)total), *table = malloc(sizeof(int32_t) * (size_t)n_blocks);
    double *runs = calloc((size_t)o->repeat, sizeof(double));
    if (!ids || !table || !runs) {
        pd_fail(&err, "out of memory");
        goto fail;
    }
    if (resolve_model_arg(model_arg, &dir, &err) != 0) goto fail;
    char backend[48];
    if (device_backend_for_model(o->backend, o->device_name, o->dtype, dir, backend, sizeof backend, &err) != 0 ||
        pd_backend_create(backend, 1, &be, &err) != 0)
        goto fail;
    if (opt_model_load(dir, be, &m, &err) != 0) goto fail;
    const opt_config *c = opt_model_config(m);
    if (total > c->max_position_embeddings) {
        pd_fail(&err, "--prompt-len + --decode-tokens (%d) exceeds the model's %d positions", total,
                c->max_position_embeddings);
        goto fail;
    }
    if (opt_kv_storage_create(m, n_blocks, bs, &kv, &err) != 0) goto fail;
    if (opt_model_set_graphs(m, !o->enforce_eager, 1, &err) != 0) goto fail;
    for (int i = 0; i < total; i++) ids[i] = (int32_t)((i * 7919u + 13u) % (unsigned)c->vocab_size);
    for (int i = 0; i < n_blocks; i++) table[i] = i;
    const double bw = device_bandwidth(be, &err);
    const double wbytes = (double)opt_model_weight_bytes(m);
    const double positions = (double)(c->max_position_embeddings + 2) * c->hidden_size * be->elem_size;
    const double decode_bytes = wbytes - positions; /* decode reads all but the position table */
    int32_t pick = 0;
    /* Warm-up: library handles, kernel loading, the decode graph's recording. */
    opt_seq_step warm = {ids, o->prompt_len < 16 ? o->prompt_len : 16, 0, table, n_blocks, true};
    if (opt_forward_ex(m, kv, &warm, 1, NULL, &pick, NULL, &err) != 0) goto fail;
    opt_seq_step wd = {ids + warm.n_tokens, 1, warm.n_tokens, table, n_blocks, true};
    if (opt_forward_ex(m, kv, &wd, 1, NULL, &pick, NULL, &err) != 0) goto fail;
    for (int r = 0; r < o->repeat; r++) {
        double t0 = pd_now();
        opt_seq_step st = {ids, o->prompt_len, 0, table, n_blocks, true};
        if (opt_forward_ex(m, kv, &st, 1, NULL, &pick, NULL, &err) != 0) goto fail;
        runs[r] = pd_now() - t0;
    }
    qsort(runs, (size_t)o->repeat, sizeof *runs, cmp_double);
    double t_decode = 0, t_graph = 0;
    int graph_ctx = 0;
    if (o->decode_tokens > 0) {
        double spent = 0;
        for (int s = 0; s < o->decode_tokens; s++) {
            const double t0 = pd_now();
            opt_seq_step d = {ids + o->prompt_len + s, 1, o->prompt_len + s, table, n_blocks, true};
            if (opt_forward_ex(m, kv, &d, 1, NULL, &pick, NULL, &err) != 0) goto fail;
            spent += pd_now() - t0;
            /* Halfway, the device's share of a step: the graph of the step
             * just run replayed back to back (it rewrites that step's KV
             * row with the same values), outside the timed steps. */
            if (s == o->decode_tokens / 2 && !o->enforce_eager) {
                pd_err ignored; /* no graph (eager, or a backend without): no figure */
                if (opt_model_time_graph(m, 1, 200, &t_graph, &ignored) != 0) t_graph = 0;
                graph_ctx = o->prompt_len + s + 1;
            }
        }
        t_decode = spent / o->decode_tokens;
    }
    /* The same decode with every step queued before the host reads the one
     * before it, its token the earlier step's pick read on the device (the
     * model layer's async scheduling, which the server's engine uses by
     * default). It rewrites the KV of the positions above with other
     * tokens. */
    double t_ahead = 0;
    if (o->decode_ahead && o->decode_tokens > 1) {
        const int32_t row0 = 0;
        const double t0 = pd_now();
        opt_seq_step d = {ids + o->prompt_len, 1, o->prompt_len, table, n_blocks, true};
        if (opt_forward_queue(m, kv, &d, 1, NULL, NULL, &err) != 0) goto fail;
        for (int s = 1; s <= o->decode_tokens; s++) {
            if (s < o->decode_tokens) {
                d.start_pos = o->prompt_len + s;
                if (opt_forward_queue(m, kv, &d, 1, NULL, &row0, &err) != 0) goto fail;
            }
            if (opt_forward_wait(m, &pick, &err) != 0) goto fail;
        }
        t_ahead = (pd_now() - t0) / o->decode_tokens;
    }
    int captures = 0, replays = 0;
    const int graphs = opt_model_graph_stats(m, &captures, &replays);
    printf("model: %s (%d layers, hidden %d), %.1f MB of %s weights on %s\n", dir, c->num_hidden_layers,
           c->hidden_size, wbytes / 1e6, pd_dtype_name(be->dtype), be->name);
    printf("device bandwidth (1 GiB device-to-device copy, read + write): %.0f GB/s\n", bw / 1e9);
    printf("prefill: %d tokens, TTFT best %.3f ms, median %.3f ms of %d (%.0f tok/s)\n", o->prompt_len,
           runs[0] * 1e3, runs[o->repeat / 2] * 1e3, o->repeat, o->prompt_len / runs[0]);
    if (o->decode_tokens > 0)
        printf("decode (batch 1, greedy, %s): %.4f ms/token = %.0f tok/s at context %d..%d; limit %.4f ms/token "
               "(%.1f MB at %.0f GB/s) = %.0f%% of the limit\n",
               graphs ? "CUDA graphs" : "eager", t_decode * 1e3, 1 / t_decode, o->prompt_len, total - 1,
               decode_bytes / bw * 1e3, decode_bytes / 1e6, bw / 1e9, 100 * (decode_bytes / bw) / t_decode);
    if (t_ahead > 0) {
        uint64_t on_device = 0, on_host = 0;
        opt_model_chain_stats(m, &on_device, &on_host);
        printf(
            "decode ahead (batch 1, greedy, %s, each step queued before the previous one is read): "
            "%.4f ms/token at context %d..%d; %llu steps chained on the device, %llu after a "
            "wait\n",
            graphs ? "CUDA graphs" : "eager", t_ahead * 1e3, o->prompt_len, total - 1,
            (unsigned long long)on_device, (unsigned long long)on_host);
    }
    if (t_graph > 0)
        printf("decode step at context %d on the device (its graph replayed 200 times back to "
               "back): %.4f ms; the rest of a token's time is the host's (metadata, launch, ids "
               "back)\n",
               graph_ctx, t_graph * 1e3);
    printf("graphs: %s, %d recorded, %d replays\n", graphs ? "on" : "off", captures, replays);
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "pdserve bench-cpu: %s\n", err.msg);
out:
    free(runs);
    free(ids);
    free(table);
    opt_kv_storage_free(kv);
    opt_model_free(m);
    pd_backend_destroy(be);
    free(dir);
    return rc;
}

int cmd_bench_cpu(int argc, char **argv) {
    bench_opts o;
    char *pos[1];
    int n_pos;
    pd_err err = {{0}};
    int n_table = (int)(sizeof bench_table / sizeof bench_table[0]);
    uint64_t given = 0;
    if (cli_parse(bench_table, n_table, &o, argc, argv, pos, 1, &n_pos, &given, &err) != 0 ||
        device_flags_for_command(bench_table, n_table, given, o.backend, o.device, o.dtype,
                                 o.device_name, sizeof o.device_name, &err) != 0) {
        fprintf(stderr, "pdserve bench-cpu: %s\n", err.msg);
        return 2;
    }
    if (o.help) {
        cli_print_help("pdserve bench-cpu [MODEL] [options]", bench_table, n_table);
        return 0;
    }
    const bool on_cpu = o.backend ? !strncmp(o.backend, "cpu", 3) : !strncmp(o.device_name, "cpu", 3);
    if (!on_cpu) return bench_device(&o, n_pos ? pos[0] : NULL);
    if (o.decode_tokens < 1) {
        fprintf(stderr, "pdserve bench-cpu: --decode-tokens must be at least 1 on the CPU\n");
        return 2;
    }
    int n_threads = o.threads > 0 ? o.threads : pd_num_cpus();
    if (n_threads > 256) n_threads = 256;
    double bw = measure_bandwidth(n_threads);
    const char *isa = "";
    double peak = measure_flops(n_threads, &isa);
    printf("machine: %d threads, memory read bandwidth %.2f GB/s, %s FLOP rate %.1f GFLOP/s\n", n_threads,
           bw / 1e9, isa, peak / 1e9);

    char *dir = NULL;
    pd_backend *be = NULL;
    opt_model *m = NULL;
    opt_kv_storage *kv = NULL;
    int rc = 1;
    int total = o.prompt_len + o.decode_tokens, bs = 16, n_blocks = (total + bs - 1) / bs;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)total), *table = malloc(sizeof(int32_t) * (size_t)n_blocks);
    float *logits = NULL;
    if (!ids || !table) goto out;
    if (resolve_model_arg(n_pos ? pos[0] : NULL, &dir, &err) != 0) goto fail;
    char backend[48];
    if (device_backend_for_model(o.backend, o.device_name, o.dtype, dir, backend, sizeof backend,
                                 &err) != 0 ||
        pd_backend_create(backend, n_threads, &be, &err) != 0)
        goto fail;
    if (opt_model_load(dir, be, &m, &err) != 0) goto fail;
    const opt_config *c = opt_model_config(m);
    if (total > c->max_position_embeddings) {
        pd_fail(&err, "--prompt-len + --decode-tokens (%d) exceeds the model's %d positions", total,
                c->max_position_embeddings);
        goto fail;
    }
    if (opt_kv_storage_create(m, n_blocks, bs, &kv, &err) != 0) goto fail;
    logits = malloc(sizeof(float) * (size_t)c->vocab_size);
    if (!logits) goto out;
    for (int i = 0; i < total; i++) ids[i] = (int32_t)((i * 7919u + 13u) % (unsigned)c->vocab_size);
    for (int i = 0; i < n_blocks; i++) table[i] = i;
    double wbytes = (double)opt_model_weight_bytes(m);
    /* Prefill multiplies every decoder-layer weight once per token (the
     * embedding tables are only gathered from) and runs the LM head once,
     * for the last token; decode reads every weight but the position table. */
    double embed = (double)c->vocab_size * c->word_embed_proj_dim;
    double positions = (double)(c->max_position_embeddings + 2) * c->hidden_size;
    double layer_params = wbytes / be->elem_size - embed - positions;
    double decode_bytes = wbytes - positions * be->elem_size;
    /* Warm-up (first kernel launches, library handles, page faults), not timed:
     * a short prefill and one decode step over the same blocks, overwritten below. */
    opt_seq_step warm = {ids, 16 < o.prompt_len ? 16 : o.prompt_len, 0, table, n_blocks, true};
    if (opt_forward(m, kv, &warm, 1, logits, &err) != 0) goto fail;
    double t0 = pd_now();
    opt_seq_step st = {ids, o.prompt_len, 0, table, n_blocks, true};
    if (opt_forward(m, kv, &st, 1, logits, &err) != 0) goto fail;
    double t_prefill = pd_now() - t0;
    t0 = pd_now();
    for (int s = 0; s < o.decode_tokens; s++) {
        opt_seq_step d = {ids + o.prompt_len + s, 1, o.prompt_len + s, table, n_blocks, true};
        if (opt_forward(m, kv, &d, 1, logits, &err) != 0) goto fail;
    }
    double t_decode = (pd_now() - t0) / o.decode_tokens;
    double prefill_tps = o.prompt_len / t_prefill;
    double attn_flops = 2.0 * 2 * c->num_hidden_layers * c->hidden_size * (o.prompt_len / 2.0);
    double prefill_flops = (o.prompt_len * (2 * layer_params + attn_flops) + 2 * embed) / t_prefill;
    printf("model: %s (%d layers, hidden %d), %.1f MB of %s weights on %s\n", dir, c->num_hidden_layers,
           c->hidden_size, wbytes / 1e6, pd_dtype_name(be->dtype), be->name);
    printf("prefill: %d tokens in %.3f s = %.1f tok/s, %.1f GFLOP/s = %.0f%% of the measured FLOP rate\n",
           o.prompt_len, t_prefill, prefill_tps, prefill_flops / 1e9, 100 * prefill_flops / peak);
    printf("decode (batch 1): %.2f ms/token = %.1f tok/s, weights read at %.2f GB/s = %.0f%% of the measured "
           "bandwidth (floor %.2f ms/token)\n",
           t_decode * 1e3, 1 / t_decode, decode_bytes / t_decode / 1e9, 100 * decode_bytes / t_decode / bw,
           decode_bytes / bw * 1e3);
    rc = 0;
    goto out;
fail:
    fprintf(stderr, "pdserve bench-cpu: %s\n", err.msg);
out:
    free(logits);
    free(ids);
    free(table);
    opt_kv_storage_free(kv);
    opt_model_free(m);
    pd_backend_destroy(be);
    free(dir);
    return rc;
}
