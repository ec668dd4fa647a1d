/* kv_sizing: how many KV-cache blocks an engine gets. Only arithmetic and
 * messages live here (engine.c measures the device), so every rule can be
 * unit-tested without a GPU.
 *
 * Precedence, as in vLLM:
 *   1. --num-gpu-blocks-override N: exactly N blocks;
 *   2. --kv-cache-memory-bytes B: B bytes of blocks;
 *   3. on a device that reports its memory (CUDA), --gpu-memory-utilization U:
 *        blocks = (U * total - memory this process uses after loading the
 *                  weights and running the largest step once) / block bytes;
 *      "memory this process uses" is what its backend allocated meanwhile
 *      (weights, scratch, staging: the backend counts them) plus whatever
 *      else the device's free memory fell by since the backend was
 *      created (the driver's own: module code, graph executables), but at
 *      most KV_SIZING_UNTRACKED_MAX of that: a larger fall is another
 *      process allocating at the same time (instances of a 1P1D pair
 *      starting together on one GPU), which must not count against U.
 *      A backend that does not count its allocations is charged the whole
 *      fall;
 *   4. on the CPU, a fixed 4e9 bytes (vLLM's VLLM_CPU_KVCACHE_SPACE default).
 * Whatever the source, the cache must hold one sequence of max_model_len. */
#ifndef PD_SERVER_KV_SIZING_H
#define PD_SERVER_KV_SIZING_H

#include <stdbool.h>
#include <stddef.h>

#include "common/pd_common.h"

#define KV_SIZING_CPU_DEFAULT_BYTES 4e9

/* What engine.c measured on a device with mem_info. */
typedef struct kv_device_memory {
    size_t total;              /* the device's memory */
    size_t free_at_start;      /* free once the backend existed, before the weights */
    size_t free_after_profile; /* free after the weights and the profiling step */
    size_t weight_bytes;       /* the weights' share (for the messages) */
    int counts_own;            /* the backend counts its allocations: the two below */
    size_t own_at_start;       /* bytes it held when free_at_start was read */
    size_t own_after_profile;  /* and when free_after_profile was */
} kv_device_memory;

/* Driver allocations beyond the backend's own that one instance is
 * charged at most (rule 3). */
#define KV_SIZING_UNTRACKED_MAX ((size_t)1 << 30)

/* Memory this instance uses after the profile (rule 3), at least the weights. */
size_t kv_sizing_instance_bytes(const kv_device_memory *d);

typedef struct kv_sizing_request {
    size_t block_bytes; /* K+V of all layers for one block (opt_kv_block_bytes) */
    int block_size;     /* tokens per block */
    int max_model_len;
    int num_blocks_override;       /* > 0: exactly this many */
    double kv_cache_bytes;         /* > 0: this many bytes */
    double gpu_memory_utilization; /* fraction of dev->total, (0, 1] */
    /* NULL: host memory (the CPU backend), sized by kv_cache_bytes or the
     * default; else the device figures, used when 1 and 2 are not given. */
    const kv_device_memory *dev;
} kv_sizing_request;

typedef struct kv_sizing {
    int num_blocks;
    size_t bytes;           /* num_blocks * block_bytes */
    long tokens;            /* num_blocks * block_size */
    double max_concurrency; /* tokens / max_model_len: sequences of full length at once */
} kv_sizing;

/* True when the request is sized from device memory (rule 3): the engine
 * must then measure free_at_start, load, profile and measure again. */
bool kv_sizing_uses_device(const kv_sizing_request *r);

/* Before the weights are loaded: the budget U * total must be free now, else
 * another process holds what this one was promised (lower U). */
int kv_sizing_check_start(double utilization, size_t total, size_t free_now, pd_err *err);
/* After the weights are loaded, before profiling: they must fit U * total. */
int kv_sizing_check_weights(double utilization, size_t total, size_t weight_bytes, pd_err *err);

/* The block count for r; an error when it cannot hold one sequence of
 * max_model_len (or the device budget leaves nothing for the cache). */
int kv_sizing_compute(const kv_sizing_request *r, kv_sizing *out, pd_err *err);

/* "KV cache: N blocks of B tokens (X GiB, Y tokens; max concurrency Z at
 * max_model_len M)" into buf. */
void kv_sizing_describe(const kv_sizing *s, int block_size, int max_model_len, char *buf,
                        size_t cap);

#endif
