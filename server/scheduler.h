/* scheduler: decides what runs in each engine step (continuous batching).
 *
 * Each step, within max_num_seqs sequences and max_num_batched_tokens tokens:
 *  1. running sequences that are decoding get their one new token, oldest
 *     first; when no KV block is left for one, the newest running sequence
 *     is preempted (its blocks freed, it goes back to the front of the
 *     waiting queue and is recomputed later);
 *  2. running sequences still in prefill get their next prompt chunk;
 *  3. waiting sequences are admitted in arrival order: the longest cached
 *     prefix of full blocks is reused (prefix caching), the rest of the
 *     prompt is scheduled as a chunk that fits the token budget. A request
 *     whose prompt KV comes from a remote prefill waits (without holding up
 *     the others) until it has arrived; then it is admitted with that KV
 *     written into its blocks and only its last prompt token is computed.
 * A sequence asks for logits only in the step that feeds its last pending
 * token. The scheduler owns the waiting and running lists and each
 * sequence's blocks; the engine owns sampling and publishing. */
#ifndef PD_SERVER_SCHEDULER_H
#define PD_SERVER_SCHEDULER_H

#include "kvcache/kvcache.h"
#include "model/opt.h"
#include "server/engine.h"

typedef struct scheduler_config {
    int max_num_seqs;
    int max_num_batched_tokens;
    bool enable_prefix_caching;
    int max_model_len;
} scheduler_config;

typedef struct scheduler scheduler;

/* One step's work: seqs[i] runs steps[i]. */
typedef struct sched_batch {
    int n, cap;
    engine_seq **seqs;
    opt_seq_step *steps;
    finish_reason *finish; /* scratch for the engine: how each finished sequence ended */
} sched_batch;
void sched_batch_free(sched_batch *b);

/* stats: the engine's counters (prefix queries/hits, preemptions) that the
 * scheduler updates. */
/* conn: the KV connector (NULL when colocated); the scheduler writes a
 * remote prefill's KV into the blocks it admits the request with. */
int scheduler_create(const scheduler_config *cfg, kv_block_pool *pool, kv_connector *conn, engine_stats *stats,
                     scheduler **out, pd_err *err);
void scheduler_destroy(scheduler *s);

/* Queue a new sequence (engine takes over the engine's reference). */
void scheduler_add(scheduler *s, engine_seq *seq);
bool scheduler_has_work(const scheduler *s);
void scheduler_counts(const scheduler *s, int *running, int *waiting);
/* Finish sequences whose consumer asked for an abort. */
void scheduler_reap_aborted(scheduler *s);
/* Poll the KV loads of waiting remote-prefill requests: mark the complete
 * ones ready, fail the ones past their deadline. Returns how many are still
 * pending. */
int scheduler_poll_remote(scheduler *s);
/* Build the next step. Returns 0 (batch may be empty), -1 on allocation failure. */
int scheduler_schedule(scheduler *s, sched_batch *b);
/* Async scheduling: the decode step after cur, built before cur's picks
 * are known (each of cur's sequences wants logits). Every sequence of cur
 * still running and not bound to end by length with cur's pick decodes
 * that pick at the next position; chain[k] is its row in cur. Nothing is
 * built (0) while a request waits, or when a sequence's next position
 * needs a block that is not free (no preemption ahead). Returns how many
 * sequences next holds, -1 on allocation failure. */
int scheduler_schedule_next(scheduler *s, const sched_batch *cur, sched_batch *next, int32_t *chain);
/* After the forward pass: n new tokens of seq are in the cache. */
void scheduler_computed(scheduler *s, engine_seq *seq, int n);
/* Finish a sequence: publish the reason, free its blocks, drop the engine's reference. */
void scheduler_finish(scheduler *s, engine_seq *seq, finish_reason r, const char *error);
/* Shutdown: finish everything with FINISH_ABORT. */
void scheduler_abort_all(scheduler *s);

#endif
