/* test_kv_sizing: the KV-cache block count (server/kv_sizing.c) for each
 * source — --num-gpu-blocks-override, --kv-cache-memory-bytes,
 * --gpu-memory-utilization on a device, the CPU default — against the
 * arithmetic done here, and the one-line errors: a device whose free memory
 * is below the budget at startup, weights above the budget, no room for one
 * sequence of max_model_len. Device figures are made up (an H200-sized
 * device), so it runs without a GPU; tests/cuda/test_cuda_kv_sizing.c checks
 * the same rules against a real device. */
#include <math.h>
#include <string.h>

#include "server/kv_sizing.h"
#include "tests/common/testlib.h"

#define GIB ((size_t)1 << 30)
#define MIB ((size_t)1 << 20)

/* opt-125m in fp16: 12 layers, hidden 768, 16-token blocks. */
static const size_t BLOCK_BYTES = 2 * 12 * 16 * 768 * 2;

static kv_sizing_request request(const kv_device_memory *dev) {
    kv_sizing_request r = {
        .block_bytes = BLOCK_BYTES,
        .block_size = 16,
        .max_model_len = 2048,
        .gpu_memory_utilization = 0.9,
        .dev = dev,
    };
    return r;
}

static void test_device(void) {
    /* 140 GiB device, 0.5 GiB taken by others and our context at start; the
     * weights take 250 MiB and the profiling step 1.25 GiB more. */
    kv_device_memory d = {
        .total = 140 * GIB,
        .free_at_start = 140 * GIB - GIB / 2,
        .weight_bytes = 250 * MIB,
    };
    d.free_after_profile = d.free_at_start - d.weight_bytes - 1280 * MIB;
    kv_sizing_request r = request(&d);
    CHECK(kv_sizing_uses_device(&r));
    kv_sizing s;
    pd_err err = {{0}};
    CHECKF(kv_sizing_compute(&r, &s, &err) == 0, "%s", err.msg);
    /* What this instance uses is the fall in free memory, not the 0.5 GiB
     * other processes held at start. */
    double left = 0.9 * 140.0 * GIB - (double)(d.free_at_start - d.free_after_profile);
    int want = (int)(left / (double)BLOCK_BYTES);
    CHECKF(s.num_blocks == want, "blocks %d, want %d", s.num_blocks, want);
    CHECK(s.bytes == (size_t)want * BLOCK_BYTES && s.tokens == (long)want * 16);
    CHECK(fabs(s.max_concurrency - (double)want * 16 / 2048) < 1e-9);
    /* Everything this instance holds stays within the budget, less than a block short of it. */
    double held = (double)(d.free_at_start - d.free_after_profile) + (double)s.bytes;
    CHECK(held <= 0.9 * 140.0 * GIB && held > 0.9 * 140.0 * GIB - (double)BLOCK_BYTES);

    /* Half the utilization: the KV share falls by exactly half the device. */
    r.gpu_memory_utilization = 0.45;
    kv_sizing half;
    CHECK(kv_sizing_compute(&r, &half, &err) == 0);
    double drop = (double)(s.num_blocks - half.num_blocks) * (double)BLOCK_BYTES;
    CHECKF(fabs(drop - 0.45 * 140.0 * GIB) <= 2.0 * BLOCK_BYTES, "drop %.0f", drop);

    /* Free memory that rose meanwhile (another process freed some): the
     * weights still count. */
    kv_device_memory up = d;
    up.free_after_profile = d.free_at_start + GIB;
    r = request(&up);
    CHECK(kv_sizing_compute(&r, &s, &err) == 0);
    CHECK(s.num_blocks ==
          (int)((0.9 * 140.0 * GIB - (double)d.weight_bytes) / (double)BLOCK_BYTES));

    /* The override and an explicit byte size win over the device budget. */
    r = request(&d);
    r.num_blocks_override = 300;
    r.kv_cache_bytes = 1e9;
    CHECK(!kv_sizing_uses_device(&r));
    CHECK(kv_sizing_compute(&r, &s, &err) == 0 && s.num_blocks == 300);
    r.num_blocks_override = 0;
    CHECK(!kv_sizing_uses_device(&r));
    CHECK(kv_sizing_compute(&r, &s, &err) == 0 && s.num_blocks == (int)(1e9 / BLOCK_BYTES));
}

/* Three instances starting together on one GPU (gpu-disagg.py's case):
 * while this one profiles, the others allocate their KV caches, so the
 * device's free memory falls by far more than this instance allocated.
 * With the backend's own count it is charged its allocations and at most
 * KV_SIZING_UNTRACKED_MAX of the rest; without it, the whole fall. */
static void test_device_concurrent(void) {
    kv_device_memory d = {
        .total = 140 * GIB,
        .free_at_start = 139 * GIB,
        .weight_bytes = 250 * MIB,
        .counts_own = 1,
        .own_at_start = 64 * MIB,
    };
    /* ours: weights + 1 GiB of scratch; the driver: 200 MiB; others: 70 GiB */
    d.own_after_profile = d.own_at_start + d.weight_bytes + GIB;
    d.free_after_profile = d.free_at_start - d.weight_bytes - GIB - 200 * MIB - 70 * GIB;
    CHECKF(kv_sizing_instance_bytes(&d) == d.weight_bytes + GIB + KV_SIZING_UNTRACKED_MAX,
           "charged %zu", kv_sizing_instance_bytes(&d));
    kv_device_memory alone = d; /* no other process: the driver's 200 MiB count in full */
    alone.free_after_profile = d.free_at_start - d.weight_bytes - GIB - 200 * MIB;
    CHECK(kv_sizing_instance_bytes(&alone) == d.weight_bytes + GIB + 200 * MIB);
    kv_sizing_request r = request(&d);
    r.gpu_memory_utilization = 0.25;
    kv_sizing s;
    pd_err err = {{0}};
    CHECKF(kv_sizing_compute(&r, &s, &err) == 0, "%s", err.msg);
    const double left = 0.25 * 140.0 * GIB - (double)kv_sizing_instance_bytes(&d);
    CHECKF(s.num_blocks == (int)(left / (double)BLOCK_BYTES), "blocks %d", s.num_blocks);
    /* A backend that does not count: charged the whole fall, no room left. */
    d.counts_own = 0;
    CHECK(kv_sizing_instance_bytes(&d) == d.free_at_start - d.free_after_profile);
    CHECK(kv_sizing_compute(&r, &s, &err) == -1 && strstr(err.msg, "leaving 0.00 GiB"));
}

static void test_device_errors(void) {
    pd_err err = {{0}};
    /* Another process holds 40 GiB: 0.9 of 140 GiB cannot be had. */
    CHECK(kv_sizing_check_start(0.9, 140 * GIB, 100 * GIB, &err) == -1);
    CHECKF(strstr(err.msg, "--gpu-memory-utilization 0.90") && strstr(err.msg, "126.0 GiB") &&
               strstr(err.msg, "100.0 GiB is free") && !strchr(err.msg, '\n'),
           "%s", err.msg);
    CHECK(kv_sizing_check_start(0.7, 140 * GIB, 100 * GIB, &err) == 0);
    /* Weights of 130 GiB above 0.9 * 139.8 GiB. */
    size_t total = (size_t)(139.8 * GIB);
    CHECK(kv_sizing_check_weights(0.9, total, 130 * GIB, &err) == -1);
    CHECKF(!strcmp(err.msg, "model needs 130.0 GiB for weights but --gpu-memory-utilization 0.90 "
                            "of the 139.8 GiB device allows 125.8 GiB"),
           "%s", err.msg);
    CHECK(kv_sizing_check_weights(0.95, total, 130 * GIB, &err) == 0);
    /* kv_sizing_compute checks the weights too. */
    kv_device_memory d = {.total = total, .free_at_start = total, .weight_bytes = 130 * GIB};
    d.free_after_profile = d.free_at_start - d.weight_bytes;
    kv_sizing_request r = request(&d);
    kv_sizing s;
    CHECK(kv_sizing_compute(&r, &s, &err) == -1 && strstr(err.msg, "for weights"));
    /* Weights fit but the activations leave room for 10 blocks, less than
     * one 2048-token sequence (128 blocks, 72 MiB). */
    d.weight_bytes = 100 * GIB;
    d.free_after_profile = d.free_at_start - (size_t)(0.9 * (double)total) + 10 * BLOCK_BYTES;
    r = request(&d);
    CHECK(kv_sizing_compute(&r, &s, &err) == -1);
    CHECKF(strstr(err.msg, "one sequence of max_model_len 2048") && strstr(err.msg, "128 blocks") &&
               strstr(err.msg, "raise --gpu-memory-utilization or lower --max-model-len"),
           "%s", err.msg);
    /* A shorter max_model_len fits in the same room. */
    r.max_model_len = 128;
    CHECKF(kv_sizing_compute(&r, &s, &err) == 0 && s.num_blocks >= 8 && s.num_blocks <= 10,
           "%s (%d blocks)", err.msg, s.num_blocks);
    /* Used memory above the budget: nothing left at all. */
    d.free_after_profile = 0;
    r = request(&d);
    CHECK(kv_sizing_compute(&r, &s, &err) == -1 && strstr(err.msg, "leaving 0.00 GiB"));
}

static void test_host(void) {
    kv_sizing_request r = request(NULL);
    kv_sizing s;
    pd_err err = {{0}};
    CHECK(!kv_sizing_uses_device(&r));
    /* The CPU default: 4e9 bytes, whatever --gpu-memory-utilization says. */
    r.gpu_memory_utilization = 0.1;
    CHECK(kv_sizing_compute(&r, &s, &err) == 0 && s.num_blocks == (int)(4e9 / BLOCK_BYTES));
    r.kv_cache_bytes = 1e8;
    CHECK(kv_sizing_compute(&r, &s, &err) == 0 && s.num_blocks == (int)(1e8 / BLOCK_BYTES));
    /* Too small for one sequence: the error names the source and both counts. */
    r.kv_cache_bytes = 50.0 * BLOCK_BYTES;
    CHECK(kv_sizing_compute(&r, &s, &err) == -1);
    CHECKF(strstr(err.msg, "50 blocks of 16 tokens") &&
               strstr(err.msg, "--kv-cache-memory-bytes") &&
               strstr(err.msg, "--max-model-len 2048 needs (128)"),
           "%s", err.msg);
    r.kv_cache_bytes = 0;
    r.num_blocks_override = 127;
    CHECK(kv_sizing_compute(&r, &s, &err) == -1 &&
          strstr(err.msg, "--num-gpu-blocks-override 127"));
    r.num_blocks_override = 128;
    CHECK(kv_sizing_compute(&r, &s, &err) == 0 && s.num_blocks == 128 && s.max_concurrency == 1.0);
}

static void test_describe(void) {
    kv_sizing s = {.num_blocks = 1000,
                   .bytes = 1000 * BLOCK_BYTES,
                   .tokens = 16000,
                   .max_concurrency = 7.8125};
    char line[200];
    kv_sizing_describe(&s, 16, 2048, line, sizeof line);
    CHECKF(!strcmp(line,
                   "KV cache: 1000 blocks of 16 tokens (0.55 GiB, 16000 tokens; max concurrency "
                   "7.81x at max_model_len 2048)"),
           "%s", line);
}

int main(void) {
    test_device();
    test_device_concurrent();
    test_device_errors();
    test_host();
    test_describe();
    return test_finish();
}
