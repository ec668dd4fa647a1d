/* engine: the inference loop of one instance. See engine.h for the contract.
 *
 * Threads: the engine thread runs engine_loop(); HTTP threads call
 * engine_submit() and the engine_seq_* consumer functions. Shared state:
 *   e->mu guards the inbox (new requests), the stop flag and the stats copy;
 *   each seq's mu guards its published output (tokens, finish, times).
 * Everything else (queues, blocks, samplers) belongs to the engine thread. */
#include "server/engine.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvcache/kvcache.h"
#include "model/opt.h"
#include "server/engine_seq.h"
#include "server/kv_sizing.h"
#include "server/scheduler.h"

void engine_config_default(engine_config *c) {
    memset(c, 0, sizeof *c);
    c->block_size = 16;
    c->max_num_seqs = 256;
    c->max_num_batched_tokens = 2048;
    c->kv_cache_bytes = 0; /* the default of kv_sizing.h: 4e9 on the CPU, a GPU's share */
    c->gpu_memory_utilization = 0.9;
    c->enable_prefix_caching = true;
    c->max_waiting = 4096;
}

void engine_request_params_default(engine_request_params *p) {
    memset(p, 0, sizeof *p);
    sampling_params_default(&p->sampling);
    p->max_tokens = 16;
    p->logprobs = -1;
}

const char *finish_reason_name(finish_reason r) {
    static const char *names[] = {NULL, "stop", "length", "abort", "error"};
    return (r >= FINISH_STOP && r <= FINISH_ERROR) ? names[r] : NULL;
}

struct engine {
    engine_config cfg;
    char *model_dir;
    pd_backend *be;
    opt_model *model;
    opt_kv_storage *kv;
    tokenizer *tok;
    kv_block_pool *pool;
    scheduler *sched;
    kv_connector *conn; /* NULL when colocated */
    /* --async-scheduling and no connector: a step that saves or loads KV is
     * never queued ahead, so with a connector no step is. */
    bool queue_steps;
    int max_model_len;
    int vocab;
    int eos_id;

    pthread_t thread;
    bool thread_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stopping;
    uint64_t kv_arrivals; /* times the connector said received KV is ready (or failed) */
    engine_seq *inbox_head, *inbox_tail; /* linked through seq->next */
    int n_inbox;
    engine_stats stats; /* copy published after each step, under mu */
    engine_stats work;  /* the engine thread's own counters */
    uint64_t request_counter;

    /* Step buffers, owned by the engine thread. */
    float *logits;
    int32_t *ids;         /* tokens made on the device, one per logits row */
    float *sample_params; /* their sampling parameters, 5 per row */
    int32_t *chain;       /* async scheduling: each next-step sequence's row in the step before */
    int logits_rows;
};

/* ---- engine_seq: shared between the engine thread and one consumer ---- */

static void seq_free(engine_seq *s) {
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    sampler_free(s->smp);
    kv_table_free(&s->blocks);
    free(s->tokens);
    free(s->out);
    free(s->top_ids);
    free(s->top_lps);
    free(s->stop_ids);
    free(s);
}

void engine_seq_unref(engine_seq *s) {
    if (atomic_fetch_sub(&s->refs, 1) == 1) seq_free(s);
}

void engine_seq_release(engine_seq *s) {
    if (!s) return;
    engine_seq_abort(s); /* a consumer that lets go no longer wants tokens */
    engine_seq_unref(s);
}

void engine_seq_abort(engine_seq *s) {
    atomic_store(&s->abort_requested, 1);
    engine *e = s->engine;
    pthread_mutex_lock(&e->mu);
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

int engine_seq_wait(engine_seq *s, int known, int timeout_ms) {
    pthread_mutex_lock(&s->mu);
    if (s->n_pub <= known && s->finish == FINISH_NONE && timeout_ms > 0) {
        struct timespec ts;
        pd_realtime_after_ms(&ts, timeout_ms);
        while (s->n_pub <= known && s->finish == FINISH_NONE)
            if (pthread_cond_timedwait(&s->cv, &s->mu, &ts) != 0) break;
    }
    int n = s->n_pub;
    pthread_mutex_unlock(&s->mu);
    return n;
}

int engine_seq_read(engine_seq *s, int from, int max, engine_token *buf, int32_t *top_ids, float *top_lps) {
    pthread_mutex_lock(&s->mu);
    int n = s->n_pub - from;
    if (n > max) n = max;
    if (n < 0) n = 0;
    if (n > 0) {
        memcpy(buf, s->out + from, sizeof *buf * (size_t)n);
        int k = s->params.logprobs;
        if (k > 0 && top_ids && top_lps) {
            memcpy(top_ids, s->top_ids + (size_t)from * k, sizeof *top_ids * (size_t)n * k);
            memcpy(top_lps, s->top_lps + (size_t)from * k, sizeof *top_lps * (size_t)n * k);
        }
    }
    pthread_mutex_unlock(&s->mu);
    return n;
}

finish_reason engine_seq_finish(engine_seq *s) {
    pthread_mutex_lock(&s->mu);
    finish_reason r = s->finish;
    pthread_mutex_unlock(&s->mu);
    return r;
}

const char *engine_seq_error(engine_seq *s) { return s->error; }

int engine_seq_error_status(engine_seq *s) {
    pthread_mutex_lock(&s->mu);
    int st = s->error_status ? s->error_status : 500;
    pthread_mutex_unlock(&s->mu);
    return st;
}

bool engine_seq_kv_transfer_params(engine_seq *s, char *buf, size_t cap) {
    pthread_mutex_lock(&s->mu);
    bool have = s->kv_saved && s->finish != FINISH_NONE;
    if (have) kv_save_result_json(&s->kv_result, buf, cap);
    pthread_mutex_unlock(&s->mu);
    return have;
}

void engine_seq_times_get(engine_seq *s, engine_seq_times *t) {
    pthread_mutex_lock(&s->mu);
    *t = s->times;
    pthread_mutex_unlock(&s->mu);
}

/* Publish one generated token (engine thread). */
static void seq_publish(engine_seq *s, int32_t id, float logprob, const int32_t *top_ids, const float *top_lps) {
    pthread_mutex_lock(&s->mu);
    int i = s->n_pub;
    s->out[i].id = id;
    s->out[i].logprob = logprob;
    int k = s->params.logprobs;
    if (k > 0) {
        memcpy(s->top_ids + (size_t)i * k, top_ids, sizeof *top_ids * (size_t)k);
        memcpy(s->top_lps + (size_t)i * k, top_lps, sizeof *top_lps * (size_t)k);
    }
    s->n_pub = i + 1;
    if (i == 0) s->times.first_token = pd_now();
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* Mark finished and wake the consumer (engine thread). */
void engine_seq_mark_finished(engine_seq *s, finish_reason r, const char *error) {
    pthread_mutex_lock(&s->mu);
    if (s->finish == FINISH_NONE) {
        s->finish = r;
        if (error) snprintf(s->error, sizeof s->error, "%s", error);
        s->times.finished = pd_now();
    }
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* Finish with an error and the HTTP status it should surface as. */
void engine_seq_mark_failed(engine_seq *s, int http_status, const char *error) {
    pthread_mutex_lock(&s->mu);
    if (s->finish == FINISH_NONE) s->error_status = http_status;
    pthread_mutex_unlock(&s->mu);
    engine_seq_mark_finished(s, FINISH_ERROR, error);
}

/* ---- submission ---- */

engine_status engine_submit(engine *e, const int32_t *prompt, int n_prompt, const engine_request_params *p,
                            const char *request_id, engine_seq **out, pd_err *err) {
    *out = NULL;
    if (n_prompt < 1) return pd_fail(err, "the prompt is empty"), ENGINE_INVALID;
    for (int i = 0; i < n_prompt; i++)
        if (prompt[i] < 0 || prompt[i] >= e->vocab)
            return pd_fail(err, "token id %d is out of vocabulary (vocab size %d)", prompt[i], e->vocab),
                   ENGINE_INVALID;
    if (p->max_tokens < 1) return pd_fail(err, "max_tokens must be at least 1, got %d", p->max_tokens), ENGINE_INVALID;
    if (p->min_tokens < 0 || p->min_tokens > p->max_tokens)
        return pd_fail(err, "min_tokens must be between 0 and max_tokens=%d, got %d", p->max_tokens, p->min_tokens),
               ENGINE_INVALID;
    if (p->logprobs > ENGINE_MAX_LOGPROBS)
        return pd_fail(err, "logprobs must be at most %d, got %d", ENGINE_MAX_LOGPROBS, p->logprobs), ENGINE_INVALID;
    if ((long)n_prompt + p->max_tokens > e->max_model_len)
        return pd_fail(err,
                       "This model's maximum context length is %d tokens. However, you requested %ld tokens "
                       "(%d in the prompt, %d in the completion). Please reduce the length of the prompt or "
                       "completion.",
                       e->max_model_len, (long)n_prompt + p->max_tokens, n_prompt, p->max_tokens),
               ENGINE_INVALID;
    if (sampling_params_validate(&p->sampling, err) != 0) return ENGINE_INVALID;

    engine_seq *s = calloc(1, sizeof *s);
    int cap = n_prompt + p->max_tokens;
    if (!s) return pd_fail(err, "out of memory"), ENGINE_INVALID;
    s->tokens = malloc(sizeof(int32_t) * (size_t)cap);
    s->out = malloc(sizeof(engine_token) * (size_t)p->max_tokens);
    if (p->logprobs > 0) {
        s->top_ids = malloc(sizeof(int32_t) * (size_t)p->max_tokens * p->logprobs);
        s->top_lps = malloc(sizeof(float) * (size_t)p->max_tokens * p->logprobs);
    }
    if (p->n_stop_token_ids > 0) {
        s->stop_ids = malloc(sizeof(int32_t) * (size_t)p->n_stop_token_ids);
        if (s->stop_ids) memcpy(s->stop_ids, p->stop_token_ids, sizeof(int32_t) * (size_t)p->n_stop_token_ids);
    }
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    kv_table_init(&s->blocks);
    if (!s->tokens || !s->out || (p->logprobs > 0 && (!s->top_ids || !s->top_lps)) ||
        (p->n_stop_token_ids > 0 && !s->stop_ids)) {
        seq_free(s);
        return pd_fail(err, "out of memory"), ENGINE_INVALID;
    }
    memcpy(s->tokens, prompt, sizeof(int32_t) * (size_t)n_prompt);
    s->n_prompt = s->n_tokens = n_prompt;
    s->params = *p;
    /* kv_transfer_params this instance cannot act on are ignored: a
     * colocated or misrouted request simply computes its prompt here. */
    if (p->kv.present) {
        bool use = e->conn && ((p->kv.do_remote_decode && kv_connector_is_producer(e->conn)) ||
                               (p->kv.do_remote_prefill && kv_connector_is_consumer(e->conn)));
        if (!use) {
            pd_log(PD_LOG_DEBUG, "request %s: kv_transfer_params not used here (%s); computing the prompt locally",
                   request_id ? request_id : "", e->conn ? kv_role_name(kv_connector_config(e->conn)->role) : "no connector");
            memset(&s->params.kv, 0, sizeof s->params.kv);
        }
    }
    s->params.stop_token_ids = s->stop_ids;
    s->engine = e;
    snprintf(s->id, sizeof s->id, "%s", request_id ? request_id : "");
    s->times.arrival = pd_now();
    s->times.n_prompt = n_prompt;
    atomic_store(&s->refs, 2); /* the caller's handle + the engine's */

    pthread_mutex_lock(&e->mu);
    engine_status st = ENGINE_OK;
    if (e->stopping) {
        st = ENGINE_STOPPING;
        pd_fail(err, "the server is shutting down");
    } else if (e->n_inbox + e->stats.waiting >= e->cfg.max_waiting) {
        st = ENGINE_BUSY;
        pd_fail(err, "the server is busy: %d requests are waiting (--max-waiting)", e->n_inbox + e->stats.waiting);
    } else {
        /* Requests without a seed still get a stream that depends on --seed
         * and on which request this is (the caller's counter, or ours). */
        uint64_t n = p->fallback_seed ? p->fallback_seed : e->request_counter;
        e->request_counter++;
        s->params.fallback_seed = (e->cfg.seed + 1) * 0x9E3779B97F4A7C15ull ^ n;
        if (e->inbox_tail) e->inbox_tail->next = s;
        else e->inbox_head = s;
        e->inbox_tail = s;
        e->n_inbox++;
        pthread_cond_signal(&e->cv);
    }
    pthread_mutex_unlock(&e->mu);
    if (st != ENGINE_OK) {
        seq_free(s);
        return st;
    }
    *out = s;
    return ENGINE_OK;
}

/* ---- the engine thread ---- */

static bool is_stop_id(const engine_seq *s, int32_t id) {
    for (int i = 0; i < s->params.n_stop_token_ids; i++)
        if (s->stop_ids[i] == id) return true;
    return false;
}

/* Append a chosen token and decide whether the sequence finished. Returns
 * the finish reason (FINISH_NONE to continue). */
static finish_reason engine_accept(engine *e, engine_seq *s, int32_t id, float lp, const int32_t *top_ids,
                                   const float *top_lps) {
    const engine_request_params *p = &s->params;
    s->tokens[s->n_tokens++] = id;
    const int n_out = s->n_tokens - s->n_prompt;
    seq_publish(s, id, lp, top_ids, top_lps);
    if (n_out >= p->min_tokens) {
        if (!p->ignore_eos && id == e->eos_id) return FINISH_STOP;
        if (is_stop_id(s, id)) return FINISH_STOP;
    }
    if (n_out >= p->max_tokens || s->n_tokens >= e->max_model_len) return FINISH_LENGTH;
    return FINISH_NONE;
}

/* Sample the next token of a sequence from its logits row. */
static finish_reason engine_sample(engine *e, engine_seq *s, float *row) {
    const engine_request_params *p = &s->params;
    int n_out = s->n_tokens - s->n_prompt;
    if (n_out < p->min_tokens) {
        /* Nothing may stop the request before min_tokens outputs. */
        if (!p->ignore_eos && e->eos_id >= 0) row[e->eos_id] = -INFINITY;
        for (int i = 0; i < p->n_stop_token_ids; i++)
            if (s->stop_ids[i] >= 0 && s->stop_ids[i] < e->vocab) row[s->stop_ids[i]] = -INFINITY;
    }
    float lp = 0;
    int32_t top_ids[ENGINE_MAX_LOGPROBS];
    float top_lps[ENGINE_MAX_LOGPROBS];
    int32_t id = p->logprobs >= 0 ? sampler_sample_logprobs(s->smp, row, p->logprobs, &lp, top_ids, top_lps)
                                  : sampler_sample(s->smp, row);
    if (id < 0) return FINISH_ERROR;
    return engine_accept(e, s, id, lp, top_ids, top_lps);
}

/* The sequence's next token can be made on the device: no logprobs, no
 * penalties and no token masked for min_tokens (the host sampler's extra
 * steps); greedy means the argmax, otherwise the device's draw with the
 * same parameters. Then no logits need to leave the device. */
static bool engine_pick_on_device(const engine *e, const engine_seq *s, bool can_sample) {
    const engine_request_params *p = &s->params;
    if (p->logprobs >= 0 || sampler_has_penalties(s->smp)) return false;
    if (!can_sample && !sampler_is_plain_greedy(s->smp)) return false;
    const bool masks = (!p->ignore_eos && e->eos_id >= 0) || p->n_stop_token_ids > 0;
    return !masks || s->n_tokens - s->n_prompt >= p->min_tokens;
}

/* Take new requests from the inbox into the scheduler's waiting queue. */
static void engine_admit_inbox(engine *e, engine_seq *list) {
    while (list) {
        engine_seq *next = list->next;
        list->next = NULL;
        list->smp = sampler_create(&list->params.sampling, e->vocab, list->params.fallback_seed);
        pd_err err = {{0}};
        if (list->smp && list->params.kv.do_remote_prefill) {
            /* Decode side of a remote prefill: start receiving its KV. A
             * 1-token prompt has nothing to load; the load is ended at once,
             * which tells the producer to drop its copy. */
            if (kv_connector_load_begin(e->conn, &list->params.kv, list->n_prompt, list->id, &list->kv_load, &err) != 0) {
                if (kv_connector_config(e->conn)->recompute_on_load_failure) {
                    pd_log(PD_LOG_WARN,
                           "request %s: %s; computing its prompt here (kv_load_failure_policy "
                           "recompute)",
                           list->id, err.msg);
                    list->kv_load = NULL;
                } else {
                    pd_log(PD_LOG_ERROR, "request %s: %s", list->id, err.msg);
                    engine_seq_mark_failed(list, 502, err.msg);
                    engine_seq_unref(list);
                    list = next;
                    continue;
                }
            }
            if (list->n_prompt == 1) {
                kv_connector_load_end(e->conn, list->kv_load);
                list->kv_load = NULL;
            }
        }
        if (!list->smp) {
            engine_seq_mark_finished(list, FINISH_ERROR, "out of memory");
            engine_seq_unref(list);
        } else {
            sampler_add_prompt(list->smp, list->tokens, list->n_prompt);
            e->work.prompt_tokens += (uint64_t)list->n_prompt;
            scheduler_add(e->sched, list);
        }
        list = next;
    }
}

static void engine_publish_stats(engine *e) {
    engine_stats st = e->work;
    opt_model_chain_stats(e->model, &st.steps_chained, NULL);
    scheduler_counts(e->sched, &st.running, &st.waiting);
    st.total_blocks = kv_pool_num_blocks(e->pool);
    st.free_blocks = kv_pool_num_free(e->pool);
    st.kv_usage = st.total_blocks ? 1.0 - (double)st.free_blocks / st.total_blocks : 0;
    pthread_mutex_lock(&e->mu);
    e->stats = st;
    pthread_mutex_unlock(&e->mu);
}

/* Grow the per-row step outputs (logits, device picks, sampling
 * parameters) together to at least rows rows. */
static int engine_reserve_rows(engine *e, int rows, pd_err *err) {
    if (rows <= e->logits_rows) return 0;
    float *nl = realloc(e->logits, sizeof(float) * (size_t)e->vocab * (size_t)rows);
    if (nl) e->logits = nl;
    int32_t *ni = nl ? realloc(e->ids, sizeof(int32_t) * (size_t)rows) : NULL;
    if (ni) e->ids = ni;
    float *np = ni ? realloc(e->sample_params, sizeof(float) * 5 * (size_t)rows) : NULL;
    if (np) e->sample_params = np;
    int32_t *nc = np ? realloc(e->chain, sizeof(int32_t) * (size_t)rows) : NULL;
    if (nc) e->chain = nc;
    if (!nl || !ni || !np || !nc) return pd_fail(err, "out of memory for the outputs of %d sequences", rows);
    e->logits_rows = rows;
    return 0;
}

/* Whether every pick of step b can be made on the device, so only ids
 * leave it: argmaxes, or draws with per-row parameters (then written to
 * e->sample_params, *device_draw) when any row samples. */
static bool engine_ids_only(engine *e, const sched_batch *b, int rows, bool *device_draw) {
    const bool can_sample = opt_model_samples_on_device(e->model) && !e->cfg.host_sampling;
    bool ids_only = rows > 0, all_greedy = true;
    for (int i = 0; i < b->n && ids_only; i++) {
        if (!b->steps[i].want_logits) continue;
        if (!engine_pick_on_device(e, b->seqs[i], can_sample)) ids_only = false;
        if (!sampler_is_plain_greedy(b->seqs[i]->smp)) all_greedy = false;
    }
    *device_draw = ids_only && !all_greedy;
    if (*device_draw)
        for (int i = 0, r = 0; i < b->n; i++)
            if (b->steps[i].want_logits) sampler_device_params(b->seqs[i]->smp, e->sample_params + 5 * (size_t)r++);
    return ids_only;
}

/* After step b's forward pass: count, ship a producer's KV, take each
 * row's pick (e->ids) or sample it (e->logits), finish what ended. A
 * sequence that finished before its queued step was read (async
 * scheduling: it ended with the step before, or was aborted) has its pick
 * dropped. */
static void engine_step_outputs(engine *e, sched_batch *b, bool ids_only) {
    pd_err err = {{0}};
    e->work.steps++;
    int row = 0;
    for (int i = 0; i < b->n; i++) {
        engine_seq *s = b->seqs[i];
        const opt_seq_step *st = &b->steps[i];
        b->finish[i] = FINISH_NONE;
        if (s->state == SEQ_DONE) {
            row += st->want_logits;
            continue;
        }
        e->work.step_tokens += (uint64_t)st->n_tokens;
        /* Prompt tokens that really ran through the model this step. */
        int prompt_end = st->start_pos + st->n_tokens < s->n_prompt ? st->start_pos + st->n_tokens : s->n_prompt;
        if (prompt_end > st->start_pos) e->work.prompt_tokens_computed += (uint64_t)(prompt_end - st->start_pos);
        scheduler_computed(e->sched, s, st->n_tokens);
        if (s->params.kv.do_remote_decode && !s->kv_saved && s->n_computed >= s->n_prompt) {
            /* Prefill side: the prompt's KV is complete; ship it before the
             * response (with its kv_transfer_params) can go out. */
            kv_save_result res;
            if (kv_connector_save(e->conn, &s->params.kv, s->blocks.ids, s->n_prompt, s->id, &res, &err) != 0) {
                pd_log(PD_LOG_ERROR, "request %s: %s", s->id, err.msg);
                s->error_status = 502;
                scheduler_finish(e->sched, s, FINISH_ERROR, err.msg);
                row += st->want_logits;
                continue;
            }
            pthread_mutex_lock(&s->mu);
            s->kv_result = res;
            s->kv_saved = true;
            pthread_mutex_unlock(&s->mu);
        }
        if (!st->want_logits) continue;
        if (ids_only) {
            sampler_record(s->smp, e->ids[row]);
            b->finish[i] = engine_accept(e, s, e->ids[row++], 0, NULL, NULL);
        } else {
            b->finish[i] = engine_sample(e, s, e->logits + (size_t)row++ * e->vocab);
        }
        e->work.generation_tokens++;
    }
    /* Counters first, then wake the consumers: a client that reads /metrics
     * right after its response must see its own tokens counted. */
    engine_publish_stats(e);
    for (int i = 0; i < b->n; i++)
        if (b->finish[i] != FINISH_NONE)
            scheduler_finish(e->sched, b->seqs[i], b->finish[i],
                             b->finish[i] == FINISH_ERROR ? "out of memory while sampling" : NULL);
}

static void engine_fail_step(engine *e, sched_batch *b, const char *msg) {
    for (int i = 0; i < b->n; i++) scheduler_finish(e->sched, b->seqs[i], FINISH_ERROR, msg);
}

/* Run one scheduled step: forward, sample, finish. */
static void engine_step(engine *e, sched_batch *b) {
    pd_err err = {{0}};
    int rows = 0;
    for (int i = 0; i < b->n; i++) rows += b->steps[i].want_logits;
    if (engine_reserve_rows(e, rows, &err) != 0) {
        engine_fail_step(e, b, err.msg);
        return;
    }
    bool device_draw;
    const bool ids_only = engine_ids_only(e, b, rows, &device_draw);
    if (opt_forward_ex(e->model, e->kv, b->steps, b->n, ids_only ? NULL : e->logits, ids_only ? e->ids : NULL,
                       device_draw ? e->sample_params : NULL, &err) != 0) {
        pd_log(PD_LOG_ERROR, "forward pass failed: %s", err.msg);
        engine_fail_step(e, b, err.msg);
        return;
    }
    engine_step_outputs(e, b, ids_only);
}

/* ---- async scheduling (--async-scheduling) ----
 * A step whose every sequence wants a pick made on the device is queued
 * (opt_forward_queue); while it runs, the decode step after it is built and
 * queued too, its tokens the first step's picks read on the device, and
 * only then is the first step's output read. The host's share of a step
 * then overlaps the device's. A queued step holds a reference on each of
 * its sequences, since one may finish (EOS, stop id, abort) before the
 * step is read. */

enum { QUEUE_NO = 0, QUEUE_OK = 1, QUEUE_FAILED = -1 };

/* Queue step b; QUEUE_NO: it has to run the plain way (engine_step);
 * QUEUE_FAILED: it failed and its sequences were finished. */
static int engine_queue(engine *e, sched_batch *b, const int32_t *chain) {
    pd_err err = {{0}};
    if (b->n == 0) return QUEUE_NO;
    for (int i = 0; i < b->n; i++)
        if (!b->steps[i].want_logits) return QUEUE_NO;
    if (engine_reserve_rows(e, b->n, &err) != 0) return QUEUE_NO;
    bool device_draw;
    if (!engine_ids_only(e, b, b->n, &device_draw)) return QUEUE_NO;
    if (opt_forward_queue(e->model, e->kv, b->steps, b->n, device_draw ? e->sample_params : NULL, chain, &err) !=
        0) {
        pd_log(PD_LOG_ERROR, "forward pass failed: %s", err.msg);
        engine_fail_step(e, b, err.msg);
        return QUEUE_FAILED;
    }
    for (int i = 0; i < b->n; i++) atomic_fetch_add(&b->seqs[i]->refs, 1);
    return QUEUE_OK;
}

/* Read queued step b's picks and act on them; drop its references. */
static void engine_collect(engine *e, sched_batch *b) {
    pd_err err = {{0}};
    if (opt_forward_wait(e->model, e->ids, &err) != 0) {
        pd_log(PD_LOG_ERROR, "forward pass failed: %s", err.msg);
        engine_fail_step(e, b, err.msg);
    } else {
        engine_step_outputs(e, b, true);
    }
    for (int i = 0; i < b->n; i++) engine_seq_unref(b->seqs[i]);
}

/* While step cur runs: build and queue the decode step after it. Not while
 * a request waits in the inbox (it is admitted at the next plain step). */
static bool engine_queue_next(engine *e, const sched_batch *cur, sched_batch *next) {
    pthread_mutex_lock(&e->mu);
    const bool arrivals = e->inbox_head != NULL || e->stopping;
    pthread_mutex_unlock(&e->mu);
    if (arrivals) return false;
    pd_err err = {{0}};
    if (engine_reserve_rows(e, cur->n, &err) != 0) return false;
    if (scheduler_schedule_next(e->sched, cur, next, e->chain) <= 0) return false;
    if (engine_queue(e, next, e->chain) != QUEUE_OK) return false;
    e->work.steps_ahead++;
    return true;
}

static void *engine_loop(void *arg) {
    engine *e = arg;
    sched_batch batch, next;
    memset(&batch, 0, sizeof batch);
    memset(&next, 0, sizeof next);
    bool queued = false; /* batch is queued on the model, its picks not read yet */
    for (;;) {
        pthread_mutex_lock(&e->mu);
        while (!queued && !e->stopping && !e->inbox_head && !scheduler_has_work(e->sched))
            pthread_cond_wait(&e->cv, &e->mu);
        bool stop = e->stopping;
        const uint64_t arrivals_seen = e->kv_arrivals; /* read before polling the connector */
        engine_seq *list = e->inbox_head;
        e->inbox_head = e->inbox_tail = NULL;
        e->n_inbox = 0;
        pthread_mutex_unlock(&e->mu);
        engine_admit_inbox(e, list);
        if (stop) break;
        scheduler_reap_aborted(e->sched);
        int remote_pending = scheduler_poll_remote(e->sched);
        if (!queued) {
            if (scheduler_schedule(e->sched, &batch) != 0) {
                engine_publish_stats(e);
                continue;
            }
            const int q = e->queue_steps ? engine_queue(e, &batch, NULL) : QUEUE_NO;
            if (q == QUEUE_NO && batch.n > 0) engine_step(e, &batch);
            queued = q == QUEUE_OK;
        }
        if (queued) {
            const bool ahead = engine_queue_next(e, &batch, &next);
            engine_collect(e, &batch);
            if (ahead) { /* next is in flight: it becomes the step to read */
                sched_batch t = batch;
                batch = next;
                next = t;
            }
            queued = ahead;
        }
        engine_publish_stats(e);
        if (!queued && batch.n == 0 && (remote_pending > 0 || scheduler_has_work(e->sched))) {
            /* Nothing could run: only requests waiting for remote KV, or for
             * blocks such requests hold. Look again when the connector says
             * more arrived, a new request comes, or in 10 ms at the latest
             * (for the transfer deadline), rather than spin. An arrival
             * since the poll above means no wait at all. */
            pthread_mutex_lock(&e->mu);
            if (!e->inbox_head && !e->stopping && e->kv_arrivals == arrivals_seen) {
                struct timespec ts;
                pd_realtime_after_ms(&ts, 10);
                pthread_cond_timedwait(&e->cv, &e->mu, &ts);
            }
            pthread_mutex_unlock(&e->mu);
        }
    }
    if (queued) engine_collect(e, &batch);
    scheduler_abort_all(e->sched);
    engine_publish_stats(e);
    sched_batch_free(&batch);
    sched_batch_free(&next);
    return NULL;
}

/* ---- creation and teardown ---- */

/* Run the largest step the scheduler can issue once, on temporary KV blocks:
 * max_num_batched_tokens tokens (no sequence beyond max_model_len) spread
 * over as many sequences as max_num_seqs allows, each wanting logits. After
 * it the activation buffers, the GEMM library's workspace and the backend's
 * staging buffers have their steady-state size, so the memory measured next
 * is what serving needs besides the KV cache. (Step metadata grows with the
 * block tables later, a few bytes per block: within the headroom.) */
static int engine_profile_step(engine *e, long *tokens_out, pd_err *err) {
    const engine_config *c = &e->cfg;
    const int bs = c->block_size;
    long T = c->max_num_batched_tokens;
    if (T > (long)c->max_num_seqs * e->max_model_len) T = (long)c->max_num_seqs * e->max_model_len;
    const int n_seqs = c->max_num_seqs < T ? c->max_num_seqs : (int)T;
    *tokens_out = T;
    long n_blocks = 0;
    for (int i = 0; i < n_seqs; i++) {
        long n = T / n_seqs + (i < T % n_seqs);
        n_blocks += (n + bs - 1) / bs;
    }
    opt_seq_step *steps = calloc((size_t)n_seqs, sizeof *steps);
    int32_t *tokens = malloc(sizeof(int32_t) * (size_t)T);
    int32_t *tables = malloc(sizeof(int32_t) * (size_t)n_blocks);
    /* The engine's output buffers, grown to their largest size. */
    const bool grown = engine_reserve_rows(e, n_seqs, err) == 0;
    opt_kv_storage *kv = NULL;
    int rc = -1;
    if (!grown) goto out;
    if (!steps || !tokens || !tables) {
        pd_fail(err, "out of memory");
        goto out;
    }
    for (long t = 0; t < T; t++) tokens[t] = (int32_t)((t * 7919 + 13) % e->vocab);
    for (long b = 0; b < n_blocks; b++) tables[b] = (int32_t)b;
    long t = 0, b = 0;
    for (int i = 0; i < n_seqs; i++) {
        int n = (int)(T / n_seqs + (i < T % n_seqs));
        int nb = (n + bs - 1) / bs;
        steps[i] = (opt_seq_step){tokens + t, n, 0, tables + b, nb, true};
        t += n;
        b += nb;
    }
    if (opt_kv_storage_create(e->model, (int)n_blocks, bs, &kv, err) != 0 ||
        opt_forward(e->model, kv, steps, n_seqs, e->logits, err) != 0) {
        pd_wrap(err, "profiling a step of %ld tokens in %d sequences", T, n_seqs);
        goto out;
    }
    rc = 0;
out:
    opt_kv_storage_free(kv);
    free(steps);
    free(tokens);
    free(tables);
    return rc;
}

/* The connector's transfer thread: received KV is ready to take (or failed).
 * Wakes the engine thread if it is waiting for remote KV. */
static void engine_kv_arrived(void *ctx) {
    engine *e = ctx;
    pthread_mutex_lock(&e->mu);
    e->kv_arrivals++;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

/* Size the KV cache (kv_sizing.h). On a device with mem_info this loads the
 * weights between two measurements and profiles; otherwise it only loads. */
static int engine_load_and_size(engine *e, kv_sizing *ks, pd_err *err) {
    const engine_config *cfg = &e->cfg;
    kv_device_memory dev = {0};
    kv_sizing_request rq = {
        .block_size = cfg->block_size,
        .num_blocks_override = cfg->num_blocks_override,
        .kv_cache_bytes = cfg->kv_cache_bytes,
        .gpu_memory_utilization = cfg->gpu_memory_utilization,
        .dev = e->be->mem_info ? &dev : NULL,
    };
    const bool measure = kv_sizing_uses_device(&rq);
    if (measure) {
        if (e->be->mem_info(e->be, &dev.free_at_start, &dev.total, err) != 0) return -1;
        dev.counts_own = e->be->bytes_allocated != NULL;
        if (dev.counts_own) dev.own_at_start = e->be->bytes_allocated(e->be);
        if (kv_sizing_check_start(cfg->gpu_memory_utilization, dev.total, dev.free_at_start, err) != 0)
            return -1;
    }
    if (opt_model_load(cfg->model_dir, e->be, &e->model, err) != 0)
        return rq.dev ? pd_wrap(err, "loading the weights onto %s", e->be->name) : -1;
    const opt_config *mc = opt_model_config(e->model);
    e->vocab = mc->vocab_size;
    e->max_model_len = cfg->max_model_len > 0 ? cfg->max_model_len : mc->max_position_embeddings;
    if (e->max_model_len > mc->max_position_embeddings)
        return pd_fail(err, "--max-model-len %d is greater than the model's max_position_embeddings %d",
                       e->max_model_len, mc->max_position_embeddings);
    rq.block_bytes = opt_kv_block_bytes(e->model, cfg->block_size);
    rq.max_model_len = e->max_model_len;
    if (measure) {
        dev.weight_bytes = opt_model_weight_bytes(e->model);
        if (kv_sizing_check_weights(cfg->gpu_memory_utilization, dev.total, dev.weight_bytes, err) != 0)
            return -1;
        double t0 = pd_now();
        long profiled = 0;
        if (engine_profile_step(e, &profiled, err) != 0) return -1;
        size_t total = 0;
        if (e->be->mem_info(e->be, &dev.free_after_profile, &total, err) != 0) return -1;
        if (dev.counts_own) dev.own_after_profile = e->be->bytes_allocated(e->be);
        pd_log(PD_LOG_INFO,
               "memory profile: %.2f GiB weights, %.2f GiB in use by this instance after a step of %ld "
               "tokens (%.2f s); %.2f GiB of %.2f GiB free on the device",
               dev.weight_bytes / 1073741824.0, kv_sizing_instance_bytes(&dev) / 1073741824.0,
               profiled, pd_now() - t0, dev.free_after_profile / 1073741824.0,
               dev.total / 1073741824.0);
    }
    return kv_sizing_compute(&rq, ks, err);
}

int engine_create(const engine_config *cfg, engine **out, pd_err *err) {
    *out = NULL;
    engine *e = calloc(1, sizeof *e);
    if (!e) return pd_fail(err, "out of memory");
    e->cfg = *cfg;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    if (tokenizer_load(cfg->model_dir, &e->tok, err) != 0) goto fail;
    if (pd_backend_create(cfg->backend ? cfg->backend : "cpu", cfg->threads, &e->be, err) != 0) goto fail;
    kv_sizing ks;
    if (engine_load_and_size(e, &ks, err) != 0) goto fail;
    const opt_config *mc = opt_model_config(e->model);
    if (tokenizer_check_model_vocab(e->tok, mc->vocab_size, err) != 0) {
        pd_wrap(err, "%s", cfg->model_dir);
        goto fail;
    }
    e->eos_id = tokenizer_eos_id(e->tok) >= 0 ? tokenizer_eos_id(e->tok) : mc->eos_token_id;
    if (e->eos_id >= mc->vocab_size) e->eos_id = -1; /* config's own, out of range: no EOS */
    int bs = cfg->block_size, n_blocks = ks.num_blocks;
    if (kv_pool_create(n_blocks, bs, &e->pool, err) != 0) goto fail;
    if (opt_kv_storage_create(e->model, n_blocks, bs, &e->kv, err) != 0) {
        pd_wrap(err, "allocating the KV cache");
        goto fail;
    }
    char kv_line[160];
    kv_sizing_describe(&ks, bs, e->max_model_len, kv_line, sizeof kv_line);
    pd_log(PD_LOG_INFO, "%s", kv_line);
    if (cfg->kv_transfer &&
        kv_connector_create(cfg->kv_transfer, e->model, e->kv, e->be, cfg->http_port,
                            engine_kv_arrived, e, &e->conn, err) != 0)
        goto fail;
    /* An instance that queues no steps records no variants for them. */
    e->queue_steps = cfg->async_scheduling && !e->conn;
    /* Decode steps of up to max_num_seqs sequences replay recorded graphs
     * (beyond 512 they run eagerly; vLLM's default capture limit is 512 too). */
    const int graph_batch = cfg->max_num_seqs < 512 ? cfg->max_num_seqs : 512;
    if (opt_model_set_graphs(e->model, !cfg->enforce_eager, graph_batch, err) != 0) goto fail;
    if (opt_model_graph_stats(e->model, NULL, NULL)) {
        /* Every padded batch size now, not at its first step: recording
         * costs milliseconds (and cuBLASLt's algorithm choice for each new
         * shape), which would otherwise land on live requests. */
        const double t_rec = pd_now();
        int recorded = 0;
        if (opt_model_record_graphs(e->model, e->kv, e->queue_steps, &recorded, err) != 0) {
            pd_wrap(err, "recording decode graphs (--enforce-eager runs without them)");
            goto fail;
        }
        pd_log(PD_LOG_INFO, "engine: decode steps of up to %d sequences run as CUDA graphs: %d recorded in %.2f s "
               "(--enforce-eager turns this off)", graph_batch, recorded, pd_now() - t_rec);
    }
    scheduler_config sc = {cfg->max_num_seqs, cfg->max_num_batched_tokens, cfg->enable_prefix_caching,
                           e->max_model_len};
    if (scheduler_create(&sc, e->pool, e->conn, &e->work, &e->sched, err) != 0) goto fail;
    const char *async = e->queue_steps          ? "on"
                        : cfg->async_scheduling ? "off (KV connector: steps run one at a time)"
                                                : "off";
    pd_log(PD_LOG_INFO,
           "engine: %s on %s, max_model_len %d, max_num_seqs %d, max_num_batched_tokens %d, "
           "prefix caching %s, async scheduling %s",
           pd_dtype_name(e->be->dtype), e->be->name, e->max_model_len, cfg->max_num_seqs,
           cfg->max_num_batched_tokens, cfg->enable_prefix_caching ? "on" : "off", async);
    engine_publish_stats(e);
    if (pthread_create(&e->thread, NULL, engine_loop, e) != 0) {
        pd_fail(err, "cannot start the engine thread");
        goto fail;
    }
    e->thread_started = true;
    *out = e;
    return 0;
fail:
    engine_destroy(e);
    return -1;
}

void engine_destroy(engine *e) {
    if (!e) return;
    pthread_mutex_lock(&e->mu);
    e->stopping = true;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    if (e->thread_started) pthread_join(e->thread, NULL);
    /* Requests submitted after the loop's last look at the inbox. */
    for (engine_seq *s = e->inbox_head, *next; s; s = next) {
        next = s->next;
        engine_seq_mark_finished(s, FINISH_ABORT, "the server is shutting down");
        engine_seq_unref(s);
    }
    scheduler_destroy(e->sched); /* ends pending KV loads: needs the connector */
    kv_connector_destroy(e->conn);
    kv_pool_destroy(e->pool);
    opt_kv_storage_free(e->kv);
    opt_model_free(e->model);
    pd_backend_destroy(e->be);
    tokenizer_free(e->tok);
    free(e->logits);
    free(e->ids);
    free(e->sample_params);
    free(e->chain);
    pthread_mutex_destroy(&e->mu);
    pthread_cond_destroy(&e->cv);
    free(e);
}

const tokenizer *engine_tokenizer(const engine *e) { return e->tok; }
const opt_config *engine_model_config(const engine *e) { return opt_model_config(e->model); }
int engine_max_model_len(const engine *e) { return e->max_model_len; }
int engine_num_blocks(const engine *e) { return kv_pool_num_blocks(e->pool); }
int engine_block_size(const engine *e) { return e->cfg.block_size; }
kv_connector *engine_connector(const engine *e) { return e->conn; }

void engine_stats_get(engine *e, engine_stats *out) {
    pthread_mutex_lock(&e->mu);
    *out = e->stats;
    out->waiting += e->n_inbox;
    pthread_mutex_unlock(&e->mu);
    out->has_connector = e->conn != NULL;
    if (e->conn) kv_connector_stats_get(e->conn, &out->kv);
}
