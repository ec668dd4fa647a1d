/* test_cuda_kv_sizing: --gpu-memory-utilization on a real device. An engine
 * on the tiny generated model ("cuda-fp16") must take, in all (weights,
 * activations, workspaces, KV cache), its share U of the device's memory
 * within 256 MiB, measured from outside with cudaMemGetInfo; doubling U adds
 * U * total of KV blocks; it must still generate; destroying it must give
 * the memory back. Then the errors: weights above the budget, a budget that
 * is not free because another engine holds memory, and the block override.
 *
 * Without a GPU (or without the CUDA build) it prints why and passes. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "model/make_model.h"
#include "server/engine.h"
#include "tests/common/testlib.h"

#ifdef PDSERVE_HAVE_CUDA
#include "model/backend.h"
#include "model/cuda/cuda_backend.h"

#define MIB (1024.0 * 1024.0)
#define GIB (1024.0 * MIB)

static char model_dir[512];

static engine *start(double util, int override, pd_err *err) {
    engine_config c;
    engine_config_default(&c);
    c.model_dir = model_dir;
    c.backend = "cuda-fp16";
    c.gpu_memory_utilization = util;
    c.num_blocks_override = override;
    engine *e = NULL;
    return engine_create(&c, &e, err) == 0 ? e : NULL;
}

static size_t free_now(pd_backend *probe) {
    size_t f = 0, t = 0;
    pd_err err = {{0}};
    CHECKF(probe->mem_info(probe, &f, &t, &err) == 0, "%s", err.msg);
    return f;
}

static size_t block_bytes(const engine *e) {
    const opt_config *mc = engine_model_config(e);
    return 2 * (size_t)mc->num_hidden_layers * (size_t)engine_block_size(e) *
           (size_t)mc->hidden_size * 2;
}

/* Four greedy requests of 8 tokens each must all come back whole. */
static void generate_some(engine *e) {
    engine_seq *seqs[4];
    int32_t prompt[5] = {2, 100, 200, 300, 400};
    for (int i = 0; i < 4; i++) {
        engine_request_params p;
        engine_request_params_default(&p);
        p.max_tokens = 8;
        p.ignore_eos = true;
        pd_err err = {{0}};
        CHECKF(engine_submit(e, prompt, 5 - i, &p, "t", &seqs[i], &err) == ENGINE_OK, "%s",
               err.msg);
    }
    for (int i = 0; i < 4; i++) {
        while (engine_seq_finish(seqs[i]) == FINISH_NONE)
            engine_seq_wait(seqs[i], 8, 1000);
        CHECK(engine_seq_finish(seqs[i]) == FINISH_LENGTH && engine_seq_wait(seqs[i], 0, 0) == 8);
        engine_seq_release(seqs[i]);
    }
}

int main(void) {
    if (pd_cuda_device_count() == 0) {
        printf("no CUDA device: skipped\n");
        return test_finish();
    }
    snprintf(model_dir, sizeof model_dir, "%s/tiny", test_tmpdir());
    pd_err err = {{0}};
    CHECKF(opt_make_model(model_dir, "tiny", 5, PD_F32, &err) == 0, "%s", err.msg);
    pd_backend *probe = NULL;
    CHECKF(pd_backend_create("cuda", 0, &probe, &err) == 0, "%s", err.msg);
    if (!probe) return test_finish();
    size_t free0 = 0, total = 0;
    CHECK(probe->mem_info(probe, &free0, &total, &err) == 0);
    printf("device: %.1f GiB, %.1f GiB free at start\n", total / GIB, free0 / GIB);

    const double u = 0.1;
    engine *e = start(u, 0, &err);
    CHECKF(e != NULL, "%s", err.msg);
    if (!e) return test_finish();
    double held = (double)free0 - (double)free_now(probe);
    double kv = (double)engine_num_blocks(e) * (double)block_bytes(e);
    printf("U %.2f: engine holds %.3f GiB (budget %.3f GiB), KV %d blocks = %.3f GiB\n", u,
           held / GIB, u * total / GIB, engine_num_blocks(e), kv / GIB);
    CHECKF(fabs(held - u * (double)total) < 256 * MIB, "held %.3f GiB, budget %.3f GiB", held / GIB,
           u * total / GIB);
    CHECK(kv > u * (double)total - 1 * GIB && kv < u * (double)total);
    generate_some(e);

    /* While this engine holds 0.1 of the device, 0.95 more is not free. */
    engine *e2 = start(0.95, 0, &err);
    CHECKF(!e2 && strstr(err.msg, "lower --gpu-memory-utilization"), "%s", err.msg);
    printf("U 0.95 beside it: %s\n", err.msg);
    engine_destroy(e2);
    int blocks_u = engine_num_blocks(e);
    engine_destroy(e);
    double back = (double)free0 - (double)free_now(probe);
    CHECKF(fabs(back) < 64 * MIB, "after destroy %.1f MiB are still held", back / MIB);

    /* Twice the share: U * total more of KV blocks. */
    e = start(2 * u, 0, &err);
    CHECKF(e != NULL, "%s", err.msg);
    if (e) {
        double more = (double)(engine_num_blocks(e) - blocks_u) * (double)block_bytes(e);
        printf("U %.2f: %d blocks (%.3f GiB more)\n", 2 * u, engine_num_blocks(e), more / GIB);
        CHECKF(fabs(more - u * (double)total) < 64 * MIB, "%.3f GiB more, want %.3f", more / GIB,
               u * total / GIB);
        engine_destroy(e);
    }

    /* The weights (a few MiB) above a budget of a few hundred KiB. */
    e = start(1e-6, 0, &err);
    CHECKF(!e && strstr(err.msg, "for weights but --gpu-memory-utilization"), "%s", err.msg);
    printf("U 1e-6: %s\n", err.msg);
    engine_destroy(e);
    /* The override wins, whatever the utilization. */
    e = start(1e-6, 100, &err);
    CHECKF(e && engine_num_blocks(e) == 100, "%s", err.msg);
    engine_destroy(e);
    pd_backend_destroy(probe);
    return test_finish();
}
#else
int main(void) {
    printf("built without the CUDA backend: skipped\n");
    return test_finish();
}
#endif
