/* engine: one inference engine per instance. A single engine thread owns the
 * model, the KV cache and the scheduler; HTTP threads hand requests over with
 * engine_submit() and read tokens back from the request's engine_seq.
 *
 * Life of a request (the loop in engine.c reads in this order):
 *   admit (waiting queue, prefix-cache lookup) -> schedule a step (decodes
 *   first, then prefill chunks, within max_num_seqs / max_num_batched_tokens;
 *   preempt the newest request when blocks run out) -> forward -> sample ->
 *   publish tokens -> finish (EOS / stop ids / max_tokens / max_model_len /
 *   abort) and free blocks.
 *
 * No lock is held across a forward pass: submissions go through a small
 * inbox under a mutex; each engine_seq has its own mutex + condition variable
 * that guards only its published output. */
#ifndef PD_SERVER_ENGINE_H
#define PD_SERVER_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "connector/connector.h"
#include "model/config.h"
#include "model/sampler.h"
#include "model/tokenizer.h"

#define ENGINE_MAX_LOGPROBS 20

typedef struct engine_config {
    const char *model_dir;
    int block_size;             /* tokens per KV block (16) */
    int max_num_seqs;           /* sequences in one step (256) */
    int max_num_batched_tokens; /* tokens in one step (2048) */
    int max_model_len;          /* 0: the model's max_position_embeddings */
    int num_blocks_override;    /* > 0: exactly this many KV blocks (tests) */
    double kv_cache_bytes;      /* > 0: KV budget in bytes; 0: the default (kv_sizing.h) */
    double gpu_memory_utilization; /* devices with mem_info: fraction of memory for everything (0.9) */
    bool enable_prefix_caching;
    uint64_t seed;              /* base seed for requests without one */
    int threads;                /* backend threads (0: one per core) */
    const char *backend;        /* pd_backend_create name: "cpu", "cuda", "cuda-fp16"...; NULL: cpu */
    int max_waiting;            /* waiting-queue bound; beyond it submit says "busy" */
    bool enforce_eager;         /* no decode graphs even where the backend has them */
    bool host_sampling;         /* draw sampled tokens on the host even on a GPU */
    bool async_scheduling;      /* queue the next decode step before reading this one's picks */
    const kv_transfer_config *kv_transfer; /* NULL: colocated; else prefill/decode role */
    int http_port;              /* advertised to the proxy */
} engine_config;

void engine_config_default(engine_config *c);

typedef struct engine engine;

/* Load the model and tokenizer, size the KV cache (server/kv_sizing.h; on a
 * device that reports its memory, after one profiling step of the largest
 * batch the scheduler can issue), start the engine thread. */
int engine_create(const engine_config *cfg, engine **out, pd_err *err);
/* Stop accepting work, abort what is in flight (consumers see FINISH_ABORT),
 * join the engine thread, free everything. */
void engine_destroy(engine *e);

const tokenizer *engine_tokenizer(const engine *e);
const opt_config *engine_model_config(const engine *e);
int engine_max_model_len(const engine *e);
int engine_num_blocks(const engine *e);
int engine_block_size(const engine *e);
/* The KV connector, or NULL for a colocated instance. */
kv_connector *engine_connector(const engine *e);

typedef enum {
    FINISH_NONE = 0, /* still running */
    FINISH_STOP,     /* EOS or a stop token id */
    FINISH_LENGTH,   /* max_tokens or max_model_len */
    FINISH_ABORT,    /* aborted by the consumer or by shutdown */
    FINISH_ERROR     /* failed inside the engine; see engine_seq_error */
} finish_reason;

const char *finish_reason_name(finish_reason r); /* "stop", "length", "abort", "error" */

typedef struct engine_request_params {
    sampling_params sampling;
    int max_tokens;
    int min_tokens;     /* EOS and stop ids are ignored before this many outputs */
    bool ignore_eos;
    const int32_t *stop_token_ids; /* copied at submit */
    int n_stop_token_ids;
    int logprobs;       /* -1: none; 0..ENGINE_MAX_LOGPROBS: chosen token + top-n */
    uint64_t fallback_seed; /* used when sampling.has_seed is false */
    kv_request_params kv;   /* the request's kv_transfer_params (disaggregation) */
} engine_request_params;

void engine_request_params_default(engine_request_params *p);

/* One generated token as published to the consumer. */
typedef struct engine_token {
    int32_t id;
    float logprob; /* log-softmax of the raw logits (vLLM V1 default) */
} engine_token;

typedef struct engine_seq engine_seq;

typedef enum { ENGINE_OK = 0, ENGINE_INVALID = -1, ENGINE_BUSY = -2, ENGINE_STOPPING = -3 } engine_status;

/* Queue a request. The prompt is copied. On success *out is a handle owned
 * by the caller (release it with engine_seq_release). ENGINE_INVALID: the
 * request cannot run (err says why: length, ids); ENGINE_BUSY: the waiting
 * queue is full; ENGINE_STOPPING: shutting down. */
engine_status engine_submit(engine *e, const int32_t *prompt, int n_prompt, const engine_request_params *p,
                            const char *request_id, engine_seq **out, pd_err *err);

/* Wait until more than `known` tokens are published or the sequence
 * finished, at most timeout_ms. Returns the number of published tokens. */
int engine_seq_wait(engine_seq *s, int known, int timeout_ms);
/* Copy published tokens [from, from+max) into buf; returns how many. Top
 * logprobs (when requested) go into top_ids/top_lps as [count][logprobs]. */
int engine_seq_read(engine_seq *s, int from, int max, engine_token *buf, int32_t *top_ids, float *top_lps);
finish_reason engine_seq_finish(engine_seq *s);
const char *engine_seq_error(engine_seq *s); /* message for FINISH_ERROR */
int engine_seq_error_status(engine_seq *s);  /* HTTP status for FINISH_ERROR (500, 504, ...) */
/* After the request finished on a producer: the response's kv_transfer_params
 * (JSON object text) in buf; false when there are none. */
bool engine_seq_kv_transfer_params(engine_seq *s, char *buf, size_t cap);
/* Request an abort (client gone, stop string matched). Blocks are freed
 * within one engine step. Safe to call more than once. */
void engine_seq_abort(engine_seq *s);
void engine_seq_release(engine_seq *s);

/* Timing of a request (pd_now() seconds); 0 when not reached yet. */
typedef struct engine_seq_times {
    double arrival, scheduled, first_token, finished;
    int n_prompt, n_cached; /* prompt tokens, and how many came from the prefix cache */
    int n_remote;           /* prompt tokens whose KV came from a remote prefill */
} engine_seq_times;
void engine_seq_times_get(engine_seq *s, engine_seq_times *t);

/* Counters and gauges for /metrics. */
typedef struct engine_stats {
    int running, waiting;
    double kv_usage; /* 0..1 of KV blocks in use */
    uint64_t prompt_tokens, prompt_tokens_computed, generation_tokens;
    uint64_t prefix_queries, prefix_hits; /* in tokens */
    uint64_t preemptions;
    /* blocks reserved for a request waiting for remote KV, none written yet,
     * given back to a running sequence instead of preempting one */
    uint64_t reservations_returned;
    uint64_t steps, step_tokens;
    uint64_t
        steps_ahead; /* --async-scheduling: steps queued while the one before was still running */
    uint64_t
        steps_chained; /* of those, the ones whose tokens the device read from the step before */
    int free_blocks, total_blocks;
    bool has_connector;
    kv_connector_stats kv; /* KV transfer counters when has_connector */
} engine_stats;
void engine_stats_get(engine *e, engine_stats *out);

#endif
