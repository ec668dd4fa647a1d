/* engine_seq: the request record shared by the engine thread, the scheduler
 * and one consumer (an HTTP handler). Internal to server/engine.c and
 * server/scheduler.c; consumers use only the functions in engine.h. */
#ifndef PD_SERVER_ENGINE_SEQ_H
#define PD_SERVER_ENGINE_SEQ_H

#include <pthread.h>
#include <stdatomic.h>

#include "kvcache/kvcache.h"
#include "server/engine.h"

typedef enum { SEQ_WAITING = 0, SEQ_RUNNING, SEQ_DONE } seq_state;

struct engine_seq {
    /* --- published to the consumer, under mu --- */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_pub;              /* tokens published */
    engine_token *out;      /* [max_tokens] */
    int32_t *top_ids;       /* [max_tokens][logprobs] when logprobs > 0 */
    float *top_lps;
    finish_reason finish;
    char error[512];
    int error_status; /* HTTP status for FINISH_ERROR */
    engine_seq_times times;
    bool kv_saved;          /* producer: KV sent; kv_result is the response's kv_transfer_params */
    kv_save_result kv_result;

    /* --- set by the consumer, read by the engine --- */
    atomic_int abort_requested;
    atomic_int refs; /* consumer handle + engine */

    /* --- engine thread only --- */
    struct engine *engine;
    char id[64];
    engine_request_params params; /* stop_token_ids points at stop_ids */
    int32_t *stop_ids;
    int32_t *tokens;  /* prompt then generated, capacity n_prompt + max_tokens */
    int n_prompt;
    int n_tokens;     /* prompt + generated so far */
    int n_computed;   /* tokens whose KV is in the cache */
    kv_block_table blocks;
    sampler *smp;
    seq_state state;
    kv_load *kv_load;     /* consumer: the remote prefill's KV being received */
    bool kv_ready;        /* kv_load has everything: admit and skip the prompt */
    uint64_t arrival_order; /* for oldest-first scheduling and newest-first preemption */
    struct engine_seq *next; /* inbox link */
};

/* Engine-thread helpers shared with the scheduler. */
void engine_seq_mark_finished(engine_seq *s, finish_reason r, const char *error);
void engine_seq_mark_failed(engine_seq *s, int http_status, const char *error);
void engine_seq_unref(engine_seq *s);

#endif
