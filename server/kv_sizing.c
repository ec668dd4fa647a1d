/* kv_sizing: KV-cache block count from the flags and the measured memory. See kv_sizing.h. */
#include "server/kv_sizing.h"

#include <stdio.h>

#include "kvcache/kvcache.h"

#define GIB 1073741824.0

/* Bytes as GiB, with two decimals below 10 GiB (small models) and one above. */
typedef struct gib_text {
    char s[24];
} gib_text;

static gib_text gib(double bytes) {
    gib_text t;
    double g = bytes / GIB;
    snprintf(t.s, sizeof t.s, g < 10 ? "%.2f GiB" : "%.1f GiB", g);
    return t;
}

bool kv_sizing_uses_device(const kv_sizing_request *r) {
    return r->dev && r->num_blocks_override <= 0 && r->kv_cache_bytes <= 0;
}

int kv_sizing_check_start(double utilization, size_t total, size_t free_now, pd_err *err) {
    double budget = utilization * (double)total;
    if ((double)free_now < budget)
        return pd_fail(err,
                       "--gpu-memory-utilization %.2f asks for %s of the %s device, but only %s "
                       "is free (other processes hold %s): lower --gpu-memory-utilization",
                       utilization, gib(budget).s, gib((double)total).s, gib((double)free_now).s,
                       gib((double)total - (double)free_now).s);
    return 0;
}

int kv_sizing_check_weights(double utilization, size_t total, size_t weight_bytes, pd_err *err) {
    double budget = utilization * (double)total;
    if ((double)weight_bytes > budget)
        return pd_fail(err,
                       "model needs %s for weights but --gpu-memory-utilization %.2f of the %s "
                       "device allows %s",
                       gib((double)weight_bytes).s, utilization, gib((double)total).s,
                       gib(budget).s);
    return 0;
}

size_t kv_sizing_instance_bytes(const kv_device_memory *d) {
    const size_t fall =
        d->free_at_start > d->free_after_profile ? d->free_at_start - d->free_after_profile : 0;
    size_t used = fall;
    if (d->counts_own) {
        const size_t own = d->own_after_profile > d->own_at_start
                               ? d->own_after_profile - d->own_at_start
                               : 0;
        size_t untracked = fall > own ? fall - own : 0;
        if (untracked > KV_SIZING_UNTRACKED_MAX) untracked = KV_SIZING_UNTRACKED_MAX;
        used = own + untracked;
    }
    /* Free memory that rose meanwhile (another process freed some) must
     * not make this instance look smaller than its weights. */
    return used > d->weight_bytes ? used : d->weight_bytes;
}

/* Rule 3 of kv_sizing.h. */
static int blocks_from_device(const kv_sizing_request *r, int need, int *n_blocks, pd_err *err) {
    const kv_device_memory *d = r->dev;
    const double u = r->gpu_memory_utilization;
    if (!(u > 0 && u <= 1)) return pd_fail(err, "--gpu-memory-utilization: %g is not in (0, 1]", u);
    if (kv_sizing_check_weights(u, d->total, d->weight_bytes, err) != 0) return -1;
    const double budget = u * (double)d->total;
    const double used = (double)kv_sizing_instance_bytes(d);
    const double other = used - (double)d->weight_bytes; /* activations, workspaces, staging */
    const double left = budget - used;
    if (left < (double)r->block_bytes * need)
        return pd_fail(err,
                       "--gpu-memory-utilization %.2f of the %s device allows %s; the weights "
                       "take %s and activations and buffers %s, leaving %s for the KV cache, "
                       "less than one sequence of max_model_len %d needs (%d blocks of %d "
                       "tokens, %s): raise --gpu-memory-utilization or lower --max-model-len",
                       u, gib((double)d->total).s, gib(budget).s, gib((double)d->weight_bytes).s,
                       gib(other).s, gib(left > 0 ? left : 0).s, r->max_model_len, need,
                       r->block_size, gib((double)r->block_bytes * need).s);
    *n_blocks = kv_blocks_for_budget((size_t)left, r->block_bytes);
    return 0;
}

int kv_sizing_compute(const kv_sizing_request *r, kv_sizing *out, pd_err *err) {
    if (r->block_bytes == 0 || r->block_size <= 0 || r->max_model_len <= 0)
        return pd_fail(err,
                       "kv sizing: block bytes, block size and max_model_len must be positive");
    const int need = (r->max_model_len + r->block_size - 1) / r->block_size;
    int n = 0;
    char source[64];
    if (r->num_blocks_override > 0) {
        n = r->num_blocks_override;
        snprintf(source, sizeof source, "--num-gpu-blocks-override %d", n);
    } else if (r->kv_cache_bytes > 0) {
        n = kv_blocks_for_budget((size_t)r->kv_cache_bytes, r->block_bytes);
        snprintf(source, sizeof source, "--kv-cache-memory-bytes %.0f", r->kv_cache_bytes);
    } else if (r->dev) {
        if (blocks_from_device(r, need, &n, err) != 0) return -1;
        snprintf(source, sizeof source, "--gpu-memory-utilization %.2f", r->gpu_memory_utilization);
    } else {
        n = kv_blocks_for_budget((size_t)KV_SIZING_CPU_DEFAULT_BYTES, r->block_bytes);
        snprintf(source, sizeof source, "the CPU default of 4e9 bytes");
    }
    if (n < need)
        return pd_fail(err,
                       "the KV cache has %d blocks of %d tokens (from %s), fewer than one "
                       "sequence of --max-model-len %d needs (%d)",
                       n, r->block_size, source, r->max_model_len, need);
    out->num_blocks = n;
    out->bytes = (size_t)n * r->block_bytes;
    out->tokens = (long)n * r->block_size;
    out->max_concurrency = (double)out->tokens / r->max_model_len;
    return 0;
}

void kv_sizing_describe(const kv_sizing *s, int block_size, int max_model_len, char *buf,
                        size_t cap) {
    snprintf(buf, cap,
             "KV cache: %d blocks of %d tokens (%s, %ld tokens; max concurrency %.2fx at "
             "max_model_len %d)",
             s->num_blocks, block_size, gib((double)s->bytes).s, s->tokens, s->max_concurrency,
             max_model_len);
}
