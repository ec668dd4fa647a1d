/* scheduler: continuous batching with chunked prefill, prefix caching and
 * preemption by recompute. See scheduler.h for the policy. */
#include "server/scheduler.h"

#include <stdlib.h>
#include <string.h>

#include "server/engine_seq.h"

/* A plain array of sequences kept in arrival order. */
typedef struct seq_list {
    engine_seq **v;
    int n, cap;
} seq_list;

struct scheduler {
    scheduler_config cfg;
    kv_block_pool *pool;
    kv_connector *conn;
    engine_stats *stats;
    seq_list waiting, running;
    uint64_t next_order;
};

static int list_reserve(seq_list *l, int n) {
    if (n <= l->cap) return 0;
    int cap = l->cap ? l->cap * 2 : 16;
    while (cap < n) cap *= 2;
    engine_seq **v = realloc(l->v, sizeof *v * (size_t)cap);
    if (!v) return -1;
    l->v = v;
    l->cap = cap;
    return 0;
}

/* Insert keeping arrival order (preempted sequences go back to their place). */
static int list_insert_ordered(seq_list *l, engine_seq *s) {
    if (list_reserve(l, l->n + 1) != 0) return -1;
    int i = l->n;
    while (i > 0 && l->v[i - 1]->arrival_order > s->arrival_order) {
        l->v[i] = l->v[i - 1];
        i--;
    }
    l->v[i] = s;
    l->n++;
    return 0;
}

static void list_remove(seq_list *l, engine_seq *s) {
    for (int i = 0; i < l->n; i++) {
        if (l->v[i] == s) {
            memmove(&l->v[i], &l->v[i + 1], sizeof *l->v * (size_t)(l->n - i - 1));
            l->n--;
            return;
        }
    }
}

void sched_batch_free(sched_batch *b) {
    free(b->seqs);
    free(b->steps);
    free(b->finish);
    memset(b, 0, sizeof *b);
}

static int batch_push(sched_batch *b, engine_seq *s, int n_new) {
    if (b->n == b->cap) {
        int cap = b->cap ? b->cap * 2 : 32;
        engine_seq **seqs = realloc(b->seqs, sizeof *seqs * (size_t)cap);
        if (!seqs) return -1;
        b->seqs = seqs;
        opt_seq_step *steps = realloc(b->steps, sizeof *steps * (size_t)cap);
        if (!steps) return -1;
        b->steps = steps;
        finish_reason *fin = realloc(b->finish, sizeof *fin * (size_t)cap);
        if (!fin) return -1;
        b->finish = fin;
        b->cap = cap;
    }
    b->seqs[b->n] = s;
    b->steps[b->n] = (opt_seq_step){s->tokens + s->n_computed, n_new, s->n_computed, s->blocks.ids,
                                    s->blocks.n_blocks, s->n_computed + n_new == s->n_tokens};
    b->n++;
    return 0;
}

int scheduler_create(const scheduler_config *cfg, kv_block_pool *pool, kv_connector *conn, engine_stats *stats,
                     scheduler **out, pd_err *err) {
    scheduler *s = calloc(1, sizeof *s);
    if (!s) return pd_fail(err, "out of memory");
    s->cfg = *cfg;
    s->pool = pool;
    s->conn = conn;
    s->stats = stats;
    *out = s;
    return 0;
}

void scheduler_destroy(scheduler *s) {
    if (!s) return;
    scheduler_abort_all(s);
    free(s->waiting.v);
    free(s->running.v);
    free(s);
}

void scheduler_add(scheduler *s, engine_seq *seq) {
    seq->arrival_order = s->next_order++;
    seq->state = SEQ_WAITING;
    if (list_insert_ordered(&s->waiting, seq) != 0) {
        engine_seq_mark_finished(seq, FINISH_ERROR, "out of memory");
        engine_seq_unref(seq);
    }
}

bool scheduler_has_work(const scheduler *s) { return s->waiting.n > 0 || s->running.n > 0; }

void scheduler_counts(const scheduler *s, int *running, int *waiting) {
    *running = s->running.n;
    *waiting = s->waiting.n;
}

void scheduler_finish(scheduler *s, engine_seq *seq, finish_reason r, const char *error) {
    if (seq->state == SEQ_DONE) return;
    list_remove(seq->state == SEQ_RUNNING ? &s->running : &s->waiting, seq);
    seq->state = SEQ_DONE;
    kv_table_release(s->pool, &seq->blocks);
    if (seq->kv_load) { /* never applied: the producer is told to drop its copy */
        kv_connector_load_end(s->conn, seq->kv_load);
        seq->kv_load = NULL;
    }
    engine_seq_mark_finished(seq, r, error);
    engine_seq_unref(seq);
}

void scheduler_reap_aborted(scheduler *s) {
    seq_list *lists[2] = {&s->running, &s->waiting};
    for (int k = 0; k < 2; k++)
        for (int i = lists[k]->n - 1; i >= 0; i--)
            if (atomic_load(&lists[k]->v[i]->abort_requested))
                scheduler_finish(s, lists[k]->v[i], FINISH_ABORT, NULL);
}

void scheduler_abort_all(scheduler *s) {
    while (s->running.n) scheduler_finish(s, s->running.v[s->running.n - 1], FINISH_ABORT, "the server is shutting down");
    while (s->waiting.n) scheduler_finish(s, s->waiting.v[s->waiting.n - 1], FINISH_ABORT, "the server is shutting down");
}

/* Free a running sequence's blocks and send it back to wait; it will be
 * recomputed from its tokens (prompt + output so far) when admitted again. */
static void preempt(scheduler *s, engine_seq *seq) {
    list_remove(&s->running, seq);
    kv_table_release(s->pool, &seq->blocks);
    seq->n_computed = 0;
    seq->state = SEQ_WAITING;
    s->stats->preemptions++;
    if (list_insert_ordered(&s->waiting, seq) != 0) {
        seq->state = SEQ_DONE;
        engine_seq_mark_finished(seq, FINISH_ERROR, "out of memory");
        engine_seq_unref(seq);
    }
}

static bool in_batch(const sched_batch *b, const engine_seq *seq) {
    for (int i = 0; i < b->n; i++)
        if (b->seqs[i] == seq) return true;
    return false;
}

/* Give back the blocks of the newest request waiting for remote KV that has
 * had none of it written yet (reserve_for_remote gave them): a running
 * sequence needs them more than a request that cannot run yet, whose
 * prefill may never send. One whose blocks hold received layers keeps them:
 * those layers are not kept anywhere else. Returns whether blocks came free. */
static bool return_reservation(scheduler *s) {
    for (int i = s->waiting.n - 1; i >= 0; i--) {
        engine_seq *seq = s->waiting.v[i];
        if (!seq->kv_load || seq->kv_ready || seq->blocks.n_blocks == 0 ||
            kv_connector_load_wrote_any(seq->kv_load))
            continue;
        pd_log(
            PD_LOG_DEBUG,
            "request %s: its %d blocks, held for KV that has not arrived, go to a running sequence",
            seq->id, seq->blocks.n_blocks);
        kv_table_release(s->pool, &seq->blocks);
        s->stats->reservations_returned++;
        return true;
    }
    return false;
}

/* Make room for a running sequence's next n_new tokens: first from blocks
 * held for remote KV not yet written, then by preempting the newest running
 * sequences not already in this step. Returns false when the sequence itself
 * had to be preempted. */
static bool reserve_running(scheduler *s, sched_batch *b, engine_seq *seq, int n_new) {
    pd_err err;
    while (kv_table_reserve(s->pool, &seq->blocks, seq->n_computed + n_new, &err) != 0) {
        if (return_reservation(s)) continue;
        engine_seq *victim = NULL;
        for (int i = s->running.n - 1; i >= 0 && !victim; i--)
            if (!in_batch(b, s->running.v[i])) victim = s->running.v[i];
        if (!victim) return false; /* cannot happen: seq itself is never in the batch yet */
        preempt(s, victim);
        if (victim == seq) return false;
    }
    return true;
}

/* A request waiting for remote KV gets its blocks while it waits, when they
 * are there to spare, so that each layer goes into the cache as it arrives
 * (vLLM's scheduler, too, allocates before the KV is in). Otherwise the
 * whole prompt's KV is written at admission, after the last layer, and the
 * first token waits for that. Spare means: every running sequence can
 * still grow by one block, so no running sequence is preempted for a
 * request that cannot run yet. In arrival order; the first that does not
 * fit stops the rest. Blocks held this way are released like any other
 * (finish, abort, deadline), and given back early to a running sequence
 * that needs them while nothing has been written into them
 * (return_reservation). */
static void reserve_for_remote(scheduler *s) {
    for (int i = 0; i < s->waiting.n; i++) {
        engine_seq *seq = s->waiting.v[i];
        if (!seq->kv_load || seq->kv_ready || seq->blocks.n_blocks > 0) continue;
        const int need = kv_table_blocks_needed(s->pool, &seq->blocks, seq->n_tokens);
        pd_err err;
        if (kv_pool_num_free(s->pool) - need < s->running.n ||
            kv_table_reserve(s->pool, &seq->blocks, seq->n_tokens, &err) != 0)
            break;
    }
}

/* A request whose KV did not come. With kv_load_failure_policy "recompute"
 * it goes on as a colocated request would (its whole prompt computed here,
 * in the waiting queue where it is); with "fail" (vLLM's default) it ends
 * with the error. */
static void remote_load_failed(scheduler *s, engine_seq *seq, int status, const char *why) {
    if (!kv_connector_config(s->conn)->recompute_on_load_failure) {
        pd_log(PD_LOG_ERROR, "request %s: %s", seq->id, why);
        seq->error_status = status;
        scheduler_finish(s, seq, FINISH_ERROR, why);
        return;
    }
    pd_log(PD_LOG_WARN,
           "request %s: %s; computing its prompt here (kv_load_failure_policy recompute)", seq->id,
           why);
    kv_connector_load_end(s->conn, seq->kv_load);
    seq->kv_load = NULL;
    seq->kv_ready = false;
    kv_table_release(s->pool, &seq->blocks); /* layers written so far are not trusted */
    seq->n_computed = 0;
}

int scheduler_poll_remote(scheduler *s) {
    int pending = 0;
    reserve_for_remote(s);
    for (int i = s->waiting.n - 1; i >= 0; i--) {
        engine_seq *seq = s->waiting.v[i];
        if (!seq->kv_load || seq->kv_ready) continue;
        int status = 500;
        pd_err err = {{0}};
        const int32_t *table = seq->blocks.n_blocks > 0 ? seq->blocks.ids : NULL;
        int r = kv_connector_load_poll(s->conn, seq->kv_load, table, &status, &err);
        if (r > 0) {
            seq->kv_ready = true;
        } else if (r < 0) {
            remote_load_failed(s, seq, status, err.msg);
        } else {
            pending++;
        }
    }
    return pending;
}

int scheduler_schedule(scheduler *s, sched_batch *b) {
    b->n = 0;
    int budget = s->cfg.max_num_batched_tokens;
    /* 1 + 2: running sequences, decodes first (one token each), then the
     * ones still prefilling. */
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < s->running.n && budget > 0; i++) {
            engine_seq *seq = s->running.v[i];
            int pending = seq->n_tokens - seq->n_computed;
            if ((pass == 0) != (pending == 1) || in_batch(b, seq)) continue;
            int n_new = pending < budget ? pending : budget;
            int before = s->running.n;
            if (reserve_running(s, b, seq, n_new)) {
                if (batch_push(b, seq, n_new) != 0) return -1;
                budget -= n_new;
            }
            /* A preemption edited the list: rescan (batched sequences are skipped). */
            if (s->running.n != before) i = -1;
        }
    }
    /* 3: admit waiting sequences in arrival order. One still waiting for a
     * remote prefill's KV is passed over without holding up the others.
     * Once one cannot get its blocks, no later one takes new blocks before
     * it (first come, first served), but a remote one whose KV is all in
     * blocks it already holds still starts: nothing else would free them,
     * and the one ahead may be waiting for exactly those. */
    bool blocked = false;
    for (int w = 0; w < s->waiting.n && budget > 0 && s->running.n < s->cfg.max_num_seqs;) {
        engine_seq *seq = s->waiting.v[w];
        if (seq->kv_load && !seq->kv_ready) {
            w++;
            continue;
        }
        if (blocked &&
            !(seq->kv_load && kv_table_blocks_needed(s->pool, &seq->blocks, seq->n_tokens) == 0)) {
            w++;
            continue;
        }
        int cached = 0, n_new;
        pd_err err;
        if (seq->kv_load) {
            /* Remote prefill: blocks for the whole prompt, its first n-1
             * tokens' KV written from what arrived; compute the last one. */
            if (kv_table_reserve(s->pool, &seq->blocks, seq->n_tokens, &err) != 0) {
                blocked = true;
                w++;
                continue;
            }
            if (kv_connector_load_apply(s->conn, seq->kv_load, seq->blocks.ids, seq->n_tokens - 1, &err) != 0) {
                remote_load_failed(s, seq, 500, err.msg);
                continue; /* finished, or at w again as a plain prompt */
            }
            kv_connector_load_end(s->conn, seq->kv_load);
            seq->kv_load = NULL;
            seq->n_computed = seq->n_tokens - 1;
            cached = 0;
            pthread_mutex_lock(&seq->mu);
            seq->times.n_remote = seq->n_computed;
            pthread_mutex_unlock(&seq->mu);
            if (s->cfg.enable_prefix_caching)
                kv_table_publish_full(s->pool, &seq->blocks, seq->tokens, seq->n_computed);
            n_new = 1;
        } else {
            if (s->cfg.enable_prefix_caching && seq->n_computed == 0) {
                /* Leave at least one token to compute so the step yields logits. */
                cached = kv_table_match_prefix(s->pool, &seq->blocks, seq->tokens, seq->n_tokens - 1);
                seq->n_computed = cached;
            }
            int pending = seq->n_tokens - seq->n_computed;
            n_new = pending < budget ? pending : budget;
            /* Blocks held for remote KV not written yet go to a request
             * that can run now (as they do to a running one). */
            int rc;
            while ((rc = kv_table_reserve(s->pool, &seq->blocks, seq->n_computed + n_new, &err)) !=
                       0 &&
                   return_reservation(s)) {
            }
            if (rc != 0) {
                kv_table_release(s->pool, &seq->blocks); /* give back the matched prefix too */
                seq->n_computed = 0;
                blocked = true; /* waits for running sequences to finish */
                w++;
                continue;
            }
            if (s->cfg.enable_prefix_caching) {
                s->stats->prefix_queries += (uint64_t)seq->n_tokens;
                s->stats->prefix_hits += (uint64_t)cached;
            }
        }
        list_remove(&s->waiting, seq);
        seq->state = SEQ_RUNNING;
        if (list_insert_ordered(&s->running, seq) != 0 || batch_push(b, seq, n_new) != 0) return -1;
        pthread_mutex_lock(&seq->mu);
        if (seq->times.scheduled == 0) seq->times.scheduled = pd_now();
        if (seq->times.n_cached == 0) seq->times.n_cached = cached;
        pthread_mutex_unlock(&seq->mu);
        budget -= n_new;
    }
    return 0;
}

int scheduler_schedule_next(scheduler *s, const sched_batch *cur, sched_batch *next, int32_t *chain) {
    next->n = 0;
    if (s->waiting.n > 0) return 0; /* admit it at the next plain step */
    for (int i = 0; i < cur->n; i++) {
        engine_seq *seq = cur->seqs[i];
        const opt_seq_step *st = &cur->steps[i];
        if (seq->state != SEQ_RUNNING || atomic_load(&seq->abort_requested)) continue;
        /* cur's pick goes to position pos; then the sequence holds pos + 1 tokens. */
        const int pos = st->start_pos + st->n_tokens;
        if (pos + 1 - seq->n_prompt >= seq->params.max_tokens || pos + 1 >= s->cfg.max_model_len) continue;
        pd_err err;
        if (kv_table_reserve(s->pool, &seq->blocks, pos + 1, &err) != 0) {
            next->n = 0;
            return 0;
        }
        if (batch_push(next, seq, 1) != 0) return -1;
        /* batch_push took n_computed/n_tokens as they are now (before cur's pick) */
        next->steps[next->n - 1] =
            (opt_seq_step){seq->tokens + pos, 1, pos, seq->blocks.ids, seq->blocks.n_blocks, true};
        chain[next->n - 1] = i;
    }
    return next->n;
}

void scheduler_computed(scheduler *s, engine_seq *seq, int n) {
    seq->n_computed += n;
    if (s->cfg.enable_prefix_caching) kv_table_publish_full(s->pool, &seq->blocks, seq->tokens, seq->n_computed);
}
