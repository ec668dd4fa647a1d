/* opt: the OPT decoder (OPTForCausalLM) forward pass over a paged KV cache,
 * written once against the backend ops table (model/backend.h) so the CPU and
 * CUDA backends run the same top-to-bottom code.
 *
 * One call runs a batch of sequences, each contributing any number of new
 * tokens (a prefill chunk, or one decode token) at its own start position. The
 * new tokens' K and V are written into the paged cache through each
 * sequence's block table, and attention reads only from the cache. */
#ifndef PD_MODEL_OPT_H
#define PD_MODEL_OPT_H

#include <stdbool.h>
#include <stdint.h>

#include "model/backend.h"
#include "model/config.h"
#include "model/weights.h"

typedef struct opt_model opt_model;

/* Load config.json + weights from a model directory onto a backend
 * (weights converted to the backend's compute dtype). */
int opt_model_load(const char *model_dir, pd_backend *be, opt_model **out, pd_err *err);
/* Build a model from already-located weights: checks every view's shape
 * against the config and uploads the weights into one backend allocation
 * (q, k and v are fused into one [3h, h] matrix). The views are only read
 * during this call. The backend must outlive the model. */
int opt_model_create(const opt_config *cfg, const opt_weights *w, pd_backend *be, opt_model **out,
                     pd_err *err);
void opt_model_free(opt_model *m);
const opt_config *opt_model_config(const opt_model *m);
/* Bytes the weights occupy on the backend. */
size_t opt_model_weight_bytes(const opt_model *m);

/* Paged KV storage: for every layer, K and V arrays of
 * [num_blocks, block_size, num_heads, head_dim] in backend memory. */
typedef struct opt_kv_storage opt_kv_storage;
size_t opt_kv_block_bytes(const opt_model *m, int block_size); /* K+V, all layers, one block */
int opt_kv_storage_create(opt_model *m, int num_blocks, int block_size, opt_kv_storage **out,
                          pd_err *err);
void opt_kv_storage_free(opt_kv_storage *kv);
int opt_kv_num_blocks(const opt_kv_storage *kv);
int opt_kv_block_size(const opt_kv_storage *kv);
/* Backend pointers to one layer's K and V arrays (for KV transfer). */
void opt_kv_layer(const opt_kv_storage *kv, int layer, void **k, void **v);

/* One sequence's part of a forward step. */
typedef struct opt_seq_step {
    const int32_t *tokens; /* the new tokens */
    int n_tokens;
    int start_pos;              /* position of tokens[0] == tokens already in the cache */
    const int32_t *block_table; /* physical block ids covering start_pos + n_tokens */
    int n_blocks;
    bool want_logits; /* return logits for the last new token */
} opt_seq_step;

/* Run one step. logits receives one row of vocab_size floats per sequence
 * with want_logits, in order (host memory, fp32). */
int opt_forward(opt_model *m, opt_kv_storage *kv, const opt_seq_step *seqs, int n_seqs,
                float *logits, pd_err *err);
/* Like opt_forward; logits may be NULL, and ids (when not NULL) receives a
 * token for each logits row, made on the device where the backend can so
 * that only ids reach the host: the greedy pick, or, with sample_params
 * (host floats, 5 per row: temperature, top_p, min_p, top_k, u — see the
 * sample op in backend.h; only when opt_model_samples_on_device), a draw. */
int opt_forward_ex(opt_model *m, opt_kv_storage *kv, const opt_seq_step *seqs, int n_seqs,
                   float *logits, int32_t *ids, const float *sample_params, pd_err *err);
/* Steps queued ahead (what vLLM calls async scheduling): opt_forward_queue
 * starts a step and returns without its results where the backend can run
 * it while the host goes on (a decode graph on a GPU; elsewhere it runs to
 * the end at once), and opt_forward_wait hands out the picks of the oldest
 * queued step, one per sequence. Every sequence of a queued step wants
 * logits; picks are made on the device where the backend can (greedy, or
 * draws with sample_params as in opt_forward_ex). At most two steps are
 * queued. chain_rows (NULL: none) makes a sequence's one new token the pick
 * of row chain_rows[i] of the newest queued step (-1: its tokens as given;
 * tokens of chained sequences are not read). When every row chains to its
 * own index and both are decode graphs, the device reads those picks itself,
 * so the host queues step N+1 before it has read step N: the host's share
 * of a step then overlaps the device's. Otherwise the earlier step is
 * waited for first, with the same results. opt_forward_ex waits for every
 * queued step first (their picks are still handed out by opt_forward_wait)
 * and ends any chain. */
int opt_forward_queue(opt_model *m, opt_kv_storage *kv, const opt_seq_step *seqs, int n_seqs,
                      const float *sample_params, const int32_t *chain_rows, pd_err *err);
int opt_forward_wait(opt_model *m, int32_t *ids, pd_err *err);
/* Whether the backend draws tokens itself (sample_params of opt_forward_ex). */
bool opt_model_samples_on_device(const opt_model *m);

/* Decode steps (one new token for each of up to max_batch sequences, every
 * one wanting logits) replayed from graphs recorded per padded batch size
 * (1, 2, 4, 8, 16, ... 512) on backends that support them; a no-op
 * elsewhere. Off by default (--enforce-eager keeps it off). */
int opt_model_set_graphs(opt_model *m, bool enable, int max_batch, pd_err *err);
/* Records the decode graph of every padded batch size up to max_batch for
 * storage kv now (a few ms each), as vLLM does at start-up, so no decode
 * step pays for a recording later; queued_variants: also the three that
 * opt_forward_queue replays (async scheduling; where the backend can queue
 * steps), which would otherwise be recorded at their first use, on a live
 * request. *recorded: how many were new. A no-op when graphs are off. */
int opt_model_record_graphs(opt_model *m, opt_kv_storage *kv, bool queued_variants, int *recorded,
                            pd_err *err);
/* Graphs recorded and replayed so far; returns whether graphs are on. */
int opt_model_graph_stats(const opt_model *m, int *captures, int *replays);
/* Chained steps of opt_forward_queue so far: on_device, queued behind the
 * step before with their tokens read on the device (the overlap async
 * scheduling is for); on_host, queued only after waiting for the step
 * before (rows reordered, no graph, ...). Either may be NULL. */
void opt_model_chain_stats(const opt_model *m, uint64_t *on_device, uint64_t *on_host);
/* For benchmarks: replays the decode graph of n_seqs sequences reps times
 * back to back on the last graph step's metadata (so each replay redoes
 * that step: same positions, same KV slots), then waits. *seconds per
 * replay is the device's time for a decode step without the host's share
 * (metadata, launch, reading the ids back). Fails when no graph step of
 * that size has run yet. */
int opt_model_time_graph(opt_model *m, int n_seqs, int reps, double *seconds, pd_err *err);

#endif
