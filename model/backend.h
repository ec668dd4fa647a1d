/* backend: the ops table the OPT forward pass is written against.
 *
 * A backend owns one device (the CPU, or later one GPU with one stream) and
 * exposes it as a struct of function pointers. Every pointer the compute ops
 * take is *device memory* obtained from `alloc` (on the CPU that is ordinary
 * host memory; on CUDA it would be a device pointer). Elements are of the
 * backend's compute dtype `dtype` (fp32 on the CPU) unless a parameter says
 * int32. Device pointers may be offset with byte arithmetic
 * (`(char *)p + i * be->elem_size`).
 *
 * Compute ops return nothing: a GPU backend only queues them, so an error
 * (if any) surfaces at the next `sync` or `download_f32`. Copies and
 * allocation can fail at once and report through pd_err.
 *
 * Per-step batch metadata (token ids, positions, slot mapping, block tables)
 * is uploaded once per step as small int32 device arrays (pd_step_meta), so
 * the forward pass never reads device memory back in the middle of a step. */
#ifndef PD_MODEL_BACKEND_H
#define PD_MODEL_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "common/pd_common.h"
#include "model/config.h"
#include "model/weights.h"

/* Where each new token of a step lives. All pointers are device int32 arrays. */
typedef struct pd_step_meta {
    int n_tokens;                /* T: new tokens in this step, all sequences together */
    int n_seqs;                  /* sequences in this step */
    int max_blocks;              /* row length of block_tables */
    const int32_t *token_ids;    /* [T] */
    const int32_t *positions;    /* [T] absolute position of each token in its sequence */
    const int32_t *token_seq;    /* [T] index of the token's sequence in this step */
    const int32_t *slot_mapping; /* [T] block_table[pos / bs] * bs + pos % bs */
    const int32_t *block_tables; /* [n_seqs, max_blocks] physical block ids (-1 padded) */
    const int32_t *seq_lens;     /* [n_seqs] tokens in the cache after this step */
    const int32_t *seq_q_start;  /* [n_seqs + 1] index of each sequence's first new token; last = T */
    int max_q_len;               /* most new tokens of one sequence in this step */
    /* Some sequences of this step share a block table, so one reads K/V that
     * another writes in this same step (pdserve score feeds a prompt as one
     * 1-token sequence per position): every K/V write of the step must land
     * before any attention read, which rules out fusing the two. */
    int shared_tables;
} pd_step_meta;

/* What the optional `linear` op fuses around its GEMM, in this order:
 *   0. embed (emb_a != NULL, only for a backend with linear_embed set): x
 *      is first written as the embedding_sum op writes it, x[t] =
 *      emb_a[emb_ia[t]] + emb_b[emb_ib[t] + emb_b_offset] (x dense:
 *      x_stride == in), and those rows are the input; a decode step's
 *      first kernel then also does the embedding (one launch less);
 *   1. layer_norm: each x row is normalised first (as the layer_norm op,
 *      affine when ln_w != NULL);
 *   2. the GEMM and its bias;
 *   3. activate: act is applied to every result element;
 *   4. accumulate: the result is added to y (a residual connection)
 *      instead of replacing it.
 * The scratch buffers are for backends that do the steps one at a time
 * (the generic composition in model/opt.c uses both); a fused kernel may
 * ignore them. */
typedef struct pd_linear_fuse {
    int layer_norm;
    const void *ln_w, *ln_b; /* [in] each, or both NULL */
    float ln_eps;
    void *ln_out; /* [T, in] scratch for LN(x); needed with layer_norm */
    int activate;
    pd_activation act;
    int accumulate;
    void *acc_tmp; /* [T, out] scratch for the result before it is added; needed with accumulate */
    /* [T]: also each row's argmax of y, the argmax op's rule (the lowest
     * index of the largest value, NaN never picked, 0 for a row of NaN).
     * Only for a backend with linear_argmax set; NULL: none. */
    int32_t *argmax;
    /* [T] device memory: the same ids written here as well (NULL: nowhere
     * else), for an argmax buffer the device reads slowly (mapped host
     * memory) whose ids the next queued step reads on the device. */
    int32_t *argmax_copy;
    const void *emb_a, *emb_b; /* step 0: the token and position tables, or NULL */
    const int32_t *emb_ia, *emb_ib;
    int emb_b_offset;
} pd_linear_fuse;

typedef struct pd_backend pd_backend;

struct pd_backend {
    const char *name; /* "cpu" */
    pd_dtype dtype;   /* compute/storage dtype of weights, activations and KV */
    size_t elem_size; /* bytes per element of dtype */
    int n_threads;    /* worker threads (CPU), informational elsewhere */
    int device;       /* CUDA device ordinal of a GPU backend; -1 on the CPU */
    void *ctx;        /* backend private state */

    /* --- memory --- */
    /* Device allocation (zeroed). NULL + err on failure. */
    void *(*alloc)(pd_backend *be, size_t bytes, pd_err *err);
    void (*free)(pd_backend *be, void *p); /* NULL is fine */
    int (*copy_h2d)(pd_backend *be, void *dst, const void *src, size_t bytes, pd_err *err);
    int (*copy_d2h)(pd_backend *be, void *dst, const void *src, size_t bytes, pd_err *err);
    /* Copy n compute-dtype elements to host fp32 (waits for queued work). */
    int (*download_f32)(pd_backend *be, float *dst, const void *src, size_t n, pd_err *err);
    /* Copy a host weight view (F32/F16/BF16, rows*cols elements) into device
     * memory, converting to the compute dtype. */
    int (*upload_view)(pd_backend *be, void *dst, const pd_view *src, pd_err *err);
    /* Wait until queued work is done; report any deferred error. */
    int (*sync)(pd_backend *be, pd_err *err);
    /* Free and total memory of the device (all processes' use counted), for
     * sizing the KV cache from a fraction of the device. NULL when the
     * backend's memory is the host's (the CPU backend). */
    int (*mem_info)(pd_backend *be, size_t *free_bytes, size_t *total_bytes, pd_err *err);
    /* Bytes of device memory this backend holds through its allocations
     * (not the driver's own), or NULL where mem_info is NULL. */
    size_t (*bytes_allocated)(pd_backend *be);

    /* --- compute (x, y: [rows, dim] row-major, compute dtype) --- */
    /* y[T,out] = x[T,in] . W[out,in]^T (+ bias[out] when bias != NULL).
     * x's rows are x_stride elements apart (>= in); y is dense. */
    void (*gemm)(pd_backend *be, void *y, const void *x, int x_stride, const void *w,
                 const void *bias, int T, int in, int out);
    /* Optional (NULL: model/opt.c composes layer_norm, gemm, activation and
     * add instead): y[T,out] = gemm(x) with what f fuses around it (see
     * pd_linear_fuse): y (+)= act(LN(x) . W^T + bias). x's rows are x_stride
     * elements apart (>= in); y is dense and must not overlap x or the
     * scratch buffers. */
    void (*linear)(pd_backend *be, void *y, const void *x, int x_stride, const void *w,
                   const void *bias, int T, int in, int out, const pd_linear_fuse *f);
    /* linear honours pd_linear_fuse.argmax (the LM head picks its greedy
     * ids in the same kernel, one launch less a step). */
    int linear_argmax;
    /* linear honours pd_linear_fuse.emb_a (the embedding in the first
     * layer's qkv projection). */
    int linear_embed;
    /* y = (x - mean) / sqrt(var + eps) (* w + b when w != NULL), per row,
     * fp32 reductions. y may equal x. */
    void (*layer_norm)(pd_backend *be, void *y, const void *x, const void *w, const void *b,
                       int rows, int dim, float eps);
    /* x = act(x) in place over n elements. */
    void (*activation)(pd_backend *be, void *x, size_t n, pd_activation act);
    /* y += x over n elements. */
    void (*add)(pd_backend *be, void *y, const void *x, size_t n);
    /* y[t] = table[idx[t] + offset]  (accumulate == 0)
     * y[t] += table[idx[t] + offset] (accumulate != 0); rows of dim elements. */
    void (*embedding)(pd_backend *be, void *y, const void *table, const int32_t *idx, int offset,
                      int rows, int dim, int accumulate);
    /* Optional (NULL: embedding twice, the second accumulating): y[t] =
     * a[ia[t]] + b[ib[t] + b_offset], the sum rounded once, as the two calls
     * do it; one launch where a step would take two. */
    void (*embedding_sum)(pd_backend *be, void *y, const void *a, const int32_t *ia, const void *b,
                          const int32_t *ib, int b_offset, int rows, int dim);
    /* y[i] = x[rows[i]] for i < n (rows: device int32). */
    void (*gather_rows)(pd_backend *be, void *y, const void *x, const int32_t *rows, int n,
                        int dim);
    /* Write each new token's k and v rows ([T, kv_dim], row stride `stride`)
     * into the paged cache at slot_mapping[t]; the cache is [slots, kv_dim]. */
    void (*kv_write)(pd_backend *be, void *k_cache, void *v_cache, const void *k, const void *v,
                     int stride, const pd_step_meta *meta, int kv_dim);
    /* For every new token t and head: softmax over positions 0..positions[t]
     * of (scale * q) . k, then the weighted sum of v, all read from the paged
     * cache through the token's block table. q rows are q_stride apart;
     * out is [T, heads * head_dim]. Softmax in fp32. */
    void (*paged_attention)(pd_backend *be, void *out, const void *q, int q_stride,
                            const void *k_cache, const void *v_cache, const pd_step_meta *meta,
                            int heads, int head_dim, int block_size, float scale);

    /* --- optional (NULL where a backend has no use for them) --- */
    /* ids[r] = the index of the largest of x[r, 0..n) (the lowest such index
     * on ties, like the host sampler's greedy pick); ids: device int32. */
    void (*argmax)(pd_backend *be, int32_t *ids, const void *x, int rows, int n);
    /* ids[r] = a token drawn from row r of x [rows, n] the way model/sampler.c
     * draws without penalties: params (device floats, 5 per row) are
     * temperature (< 1e-5: the argmax), top_p (1: off), min_p (0: off),
     * top_k (<= 0: off) and u, a uniform draw in [0, 1) from the request's
     * RNG; the token is the first id, in id order over the kept tokens, whose
     * running weight exceeds u times their total. */
    void (*sample)(pd_backend *be, int32_t *ids, const void *x, int rows, int n,
                   const float *params);
    /* Queue a host-to-device copy without waiting. src must stay unchanged
     * until the next sync or download (the copy is ordered before later ops). */
    int (*copy_h2d_async)(pd_backend *be, void *dst, const void *src, size_t bytes, pd_err *err);
    /* Optional: page-locked host memory for the small buffers that cross to
     * and from the device every step (step metadata, sampled ids), so their
     * copies are one DMA each rather than a staged copy. NULL: malloc/free. */
    void *(*host_alloc)(pd_backend *be, size_t bytes, pd_err *err);
    void (*host_free)(pd_backend *be, void *p); /* NULL is fine */
    /* host_alloc memory is also the backend's: its ops may write there
     * directly (same address), so a step's picks land in host memory with no
     * copy after the step, only the sync. */
    int host_mapped;
    /* Queue a device-to-device copy (also the bandwidth probe of benchmarks). */
    void (*copy_d2d)(pd_backend *be, void *dst, const void *src, size_t bytes);
    /* Graph capture: between graph_begin and graph_end every compute op is
     * recorded instead of run, and so is copy_h2d_async from host_alloc
     * memory (a replay copies what the source holds then); other copies and
     * syncs are not allowed there. graph_launch replays the recording with
     * the same pointers and sizes. */
    int (*graph_begin)(pd_backend *be, pd_err *err);
    int (*graph_end)(pd_backend *be, void **graph, pd_err *err);
    int (*graph_launch)(pd_backend *be, void *graph, pd_err *err);
    void (*graph_free)(pd_backend *be, void *graph);
    /* Markers in the queue of work, so the host can wait for a part of it
     * while later work stays queued (a step computed while the host reads
     * the one before). NULL where every op has finished when it returns
     * (the CPU). event_record places ev after everything queued so far
     * (never inside a graph capture); event_wait returns once that work is
     * done and reports a deferred error as sync does. On a CUDA backend an
     * event is a cudaEvent_t, and event_record also takes one made
     * elsewhere (the nccl KV transport orders its sends after it). */
    int (*event_create)(pd_backend *be, void **ev, pd_err *err);
    int (*event_record)(pd_backend *be, void *ev, pd_err *err);
    int (*event_wait)(pd_backend *be, void *ev, pd_err *err);
    void (*event_free)(pd_backend *be, void *ev); /* NULL is fine */

    void (*destroy)(pd_backend *be);
};

/* Create a backend by name: "cpu"; "cpu-baseline" (the CPU backend restricted
 * to its portable SSE2 kernels, for testing them); or "cuda" / "cuda-fp16" /
 * "cuda-bf16" (optionally ":DEVICE"; see model/cuda/cuda_backend.h) when
 * pdserve was built with the CUDA backend. n_threads: threads of the CPU
 * backend (the caller's thread included), 0 = one per core (ignored by CUDA). */
int pd_backend_create(const char *name, int n_threads, pd_backend **out, pd_err *err);
void pd_backend_destroy(pd_backend *be);

#endif
