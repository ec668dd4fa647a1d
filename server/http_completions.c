/* http_completions: POST /v1/completions on the engine. A request becomes
 * one engine sequence per prompt x n ("choice"); each choice reads its
 * tokens back, detokenizes them incrementally, applies stop strings (with
 * the streaming hold-back) and ends with vLLM's finish_reason/stop_reason.
 * Non-streaming requests block in the handler; streaming ones block in the
 * response's content-reader callback. Both poll the client's socket every
 * 10 ms and abort their sequences when it is gone. */
#include <microhttpd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/pd_httpd.h"
#include "model/tokenizer.h"
#include "server/api_json.h"
#include "server/http.h"

#define POLL_MS 10
#define READ_BATCH 64

typedef struct choice {
    engine_seq *seq;
    int prompt; /* index into run->prompts */
    int index;  /* the choice index clients see */
    detok_stream *ds;
    pd_buf text; /* output text so far (after stop-string truncation) */
    size_t sent; /* bytes of text already streamed */
    int n_read;  /* tokens consumed from the sequence */
    int32_t last_id;
    int held; /* 1: the newest token is read but waits (could_stop) */
    bool done, final_sent, echo_sent, recorded;
    finish_reason fin;
    stop_reason_kind stop_kind;
    int stop_idx;
    int32_t stop_id;
    lp_list lp;
    int lp_sent;
    int lp_prompt;   /* entries for echoed prompt tokens */
    size_t lp_chars; /* characters covered by logprobs tokens (text_offset) */
    double *times;   /* when each token was read, for inter-token latency */
    int n_times, cap_times;
    double end_time;
} choice;

typedef struct prompt_ids {
    int32_t *ids;
    int n;
    char *echo_text; /* echo: the prompt as text */
    size_t echo_len;
} prompt_ids;

typedef struct comp_run {
    http_ctx *ctx;
    struct MHD_Connection *conn;
    completion_request req;
    prompt_ids *prompts;
    choice *ch;
    int n_ch;
    char id[40];
    completion_meta meta;
    const tokenizer *tok;
    int eos;
    long long prompt_tokens;
    bool counted; /* holds one unit of ctx->active */
    /* streaming */
    pd_buf out;
    size_t out_pos;
    bool stream_done, error_sent;
    bool kv_send; /* a prefill request: its KV goes to a decode instance */
    engine_token tbuf[READ_BATCH];
    int32_t *top_ids;
    float *top_lps;
} comp_run;

static void choice_record(comp_run *r, choice *c) {
    if (c->recorded || !c->seq) return;
    c->recorded = true;
    engine_seq_times t;
    engine_seq_times_get(c->seq, &t);
    double end = c->end_time > 0 ? c->end_time : t.finished > 0 ? t.finished : pd_now();
    finish_reason reason = c->fin == FINISH_NONE ? FINISH_ABORT : c->fin;
    int n_gen = c->n_read;
    double *gaps = NULL;
    int n_gaps = 0;
    if (c->n_times > 1 && (gaps = malloc(sizeof(double) * (size_t)(c->n_times - 1)))) {
        for (int i = 1; i < c->n_times; i++)
            gaps[n_gaps++] = c->times[i] - c->times[i - 1];
    }
    double ttft = t.first_token > 0 && t.arrival > 0 ? t.first_token - t.arrival : -1;
    double tpot = n_gen > 1 && t.first_token > 0 ? (end - t.first_token) / (n_gen - 1) : -1;
    metrics_request mr = {
        .reason = reason,
        .prompt_tokens = r->prompts[c->prompt].n,
        .generation_tokens = n_gen,
        .queue_time = t.scheduled > 0 && t.arrival > 0 ? t.scheduled - t.arrival : -1,
        .ttft = ttft,
        .e2e = t.arrival > 0 ? end - t.arrival : -1,
        .tpot = tpot,
        .itl = gaps,
        .n_itl = n_gaps,
    };
    metrics_observe(r->ctx->met, &mr);
    const char *names[] = {"none", "stop", "length", "abort", "error"};
    pd_log(PD_LOG_INFO,
           "request %s-%d: prompt %d tokens (%d cached, %d from a remote prefill, %d computed), output %d tokens, "
           "ttft %.1f ms, tpot %.2f ms, finish %s",
           r->id, c->index, r->prompts[c->prompt].n, t.n_cached, t.n_remote,
           r->prompts[c->prompt].n - t.n_cached - t.n_remote, n_gen,
           ttft >= 0 ? ttft * 1e3 : 0.0, tpot >= 0 ? tpot * 1e3 : 0.0,
           c->stop_kind == STOP_REASON_STR ? "stop (string)" : names[reason]);
    free(gaps);
}

static void run_free(comp_run *r) {
    for (int i = 0; i < r->n_ch; i++) {
        choice *c = &r->ch[i];
        if (c->seq) {
            if (!c->done) engine_seq_abort(c->seq);
            choice_record(r, c);
            engine_seq_release(c->seq);
        }
        detok_stream_free(c->ds);
        pd_buf_free(&c->text);
        lp_list_clear(&c->lp);
        free(c->times);
    }
    free(r->ch);
    if (r->prompts)
        for (int i = 0; i < r->req.n_prompts; i++) {
            free(r->prompts[i].ids);
            free(r->prompts[i].echo_text);
        }
    free(r->prompts);
    completion_request_free(&r->req);
    pd_buf_free(&r->out);
    free(r->top_ids);
    free(r->top_lps);
    if (r->counted) atomic_fetch_sub(&r->ctx->active, 1);
    free(r);
}

static char *token_text(const comp_run *r, int32_t id) {
    return tokenizer_decode(r->tok, &id, 1, false, NULL);
}

/* Record the logprobs of one token: the sampled one first, then the top ones. */
static int add_logprobs(comp_run *r, choice *c, const engine_token *t, const int32_t *top_ids,
                        const float *top_lps) {
    int k = r->req.logprobs;
    char *tok = token_text(r, t->id);
    const char *names[ENGINE_MAX_LOGPROBS + 1];
    char *owned[ENGINE_MAX_LOGPROBS + 1];
    double lps[ENGINE_MAX_LOGPROBS + 1];
    names[0] = tok;
    lps[0] = t->logprob;
    for (int i = 0; i < k; i++) {
        owned[i] = token_text(r, top_ids[i]);
        names[i + 1] = owned[i];
        lps[i + 1] = top_lps[i];
    }
    int rc = lp_list_add(&c->lp, tok, c->lp_chars, true, t->logprob, k + 1, names, lps);
    c->lp_chars += utf8_chars(tok ? tok : "", tok ? strlen(tok) : 0);
    for (int i = 0; i < k; i++)
        free(owned[i]);
    free(tok);
    return rc;
}

/* Feed one generated token to a choice. `final_stop`: it is the EOS / stop
 * id that ended the sequence, whose text vLLM does not show. */
static void choice_feed(comp_run *r, choice *c, const engine_token *t, const int32_t *top_ids,
                        const float *top_lps, bool final_stop) {
    c->n_read++;
    c->last_id = t->id;
    if (c->n_times == c->cap_times) {
        int cap = c->cap_times ? 2 * c->cap_times : 64;
        double *tm = realloc(c->times, sizeof(double) * (size_t)cap);
        if (tm) c->times = tm, c->cap_times = cap;
    }
    if (c->n_times < c->cap_times) c->times[c->n_times++] = pd_now();
    if (r->req.logprobs >= 0) add_logprobs(r, c, t, top_ids, top_lps);
    if (final_stop && !r->req.include_stop_str_in_output) return;
    size_t prev = c->text.len, n = 0;
    const char *piece = detok_stream_step(c->ds, t->id, &n);
    if (n) pd_buf_append(&c->text, piece, n);
    /* Like EOS and stop ids (the engine's min_tokens), stop strings count
     * only after min_tokens outputs (vLLM's detokenizer does the same). */
    if (r->req.n_stop == 0 || c->text.len == prev || c->n_read <= r->req.min_tokens) return;
    size_t at = 0;
    int hit = stop_find(c->text.data, c->text.len, prev, r->req.stop, r->req.n_stop, &at);
    if (hit < 0) return;
    size_t keep = at + (r->req.include_stop_str_in_output ? strlen(r->req.stop[hit]) : 0);
    c->text.len = keep;
    c->text.data[keep] = 0;
    c->done = true;
    c->fin = FINISH_STOP;
    c->stop_kind = STOP_REASON_STR;
    c->stop_idx = hit;
    c->end_time = pd_now();
    engine_seq_abort(c->seq);
}

static bool is_stop_id(const completion_request *q, int32_t id) {
    for (int i = 0; i < q->n_stop_ids; i++)
        if (q->stop_ids[i] == id) return true;
    return false;
}

/* A token that may have ended its sequence (EOS, a stop id): its text must
 * not be shown if it did, so it waits until we know. */
static bool could_stop(const comp_run *r, int32_t id) {
    return (!r->req.ignore_eos && id == r->eos) || is_stop_id(&r->req, id);
}

/* Read whatever a choice's sequence published; returns true on progress. */
static bool choice_poll(comp_run *r, choice *c) {
    if (c->done) return false;
    /* The finish state first: when it is set, every token is already published. */
    finish_reason fin = engine_seq_finish(c->seq);
    int avail = engine_seq_wait(c->seq, c->n_read, 0);
    bool progress = false;
    c->held = 0;
    while (!c->done && c->n_read < avail) {
        int want = avail - c->n_read < READ_BATCH ? avail - c->n_read : READ_BATCH;
        int got = engine_seq_read(c->seq, c->n_read, want, r->tbuf, r->top_ids, r->top_lps);
        if (got <= 0) break;
        int k = r->req.logprobs > 0 ? r->req.logprobs : 0;
        for (int i = 0; i < got && !c->done; i++) {
            bool last = c->n_read + 1 == avail;
            if (last && fin == FINISH_NONE && could_stop(r, r->tbuf[i].id)) {
                c->held = 1;
                break;
            }
            choice_feed(r, c, &r->tbuf[i], r->top_ids ? r->top_ids + (size_t)i * k : NULL,
                        r->top_lps ? r->top_lps + (size_t)i * k : NULL, last && fin == FINISH_STOP);
            progress = true;
        }
        if (c->held) break;
    }
    if (!c->done && fin != FINISH_NONE && c->n_read >= avail) {
        c->done = true;
        c->fin = fin;
        if (fin == FINISH_STOP && c->n_read > 0) {
            bool eos = !r->req.ignore_eos && c->last_id == r->eos;
            if (!eos && is_stop_id(&r->req, c->last_id)) {
                c->stop_kind = STOP_REASON_ID;
                c->stop_id = c->last_id;
            }
        }
        progress = true;
    }
    if (c->done) choice_record(r, c);
    return progress;
}

/* One round over all choices; waits up to POLL_MS when nothing moved. */
static bool run_poll(comp_run *r) {
    bool progress = false, all_done = true;
    choice *waiter = NULL;
    for (int i = 0; i < r->n_ch; i++) {
        progress |= choice_poll(r, &r->ch[i]);
        if (!r->ch[i].done) {
            all_done = false;
            if (!waiter) waiter = &r->ch[i];
        }
    }
    if (!progress && waiter) engine_seq_wait(waiter->seq, waiter->n_read + waiter->held, POLL_MS);
    return all_done;
}

static void run_abort_all(comp_run *r) {
    for (int i = 0; i < r->n_ch; i++)
        if (!r->ch[i].done) engine_seq_abort(r->ch[i].seq);
}

static const char *finish_name(const choice *c) {
    switch (c->fin) {
    case FINISH_STOP:
        return "stop";
    case FINISH_LENGTH:
        return "length";
    case FINISH_ABORT:
        return "abort";
    case FINISH_ERROR:
        return "error";
    default:
        return NULL;
    }
}

static void choice_view_fill(const comp_run *r, const choice *c, choice_view *v) {
    memset(v, 0, sizeof *v);
    v->index = c->index;
    v->finish_reason = c->done ? finish_name(c) : NULL;
    v->stop_kind = c->stop_kind;
    v->stop_str = c->stop_kind == STOP_REASON_STR ? r->req.stop[c->stop_idx] : NULL;
    v->stop_id = c->stop_id;
    v->logprobs = r->req.logprobs >= 0 ? &c->lp : NULL;
}

static long long completion_tokens(const comp_run *r) {
    long long n = 0;
    for (int i = 0; i < r->n_ch; i++)
        n += r->ch[i].n_read;
    return n;
}

/* ---- setup -------------------------------------------------------------- */

/* Bytes in the longest vocabulary entry (computed once per server). */
static size_t longest_token_bytes(http_ctx *ctx, const tokenizer *tok) {
    int v = atomic_load(&ctx->longest_token);
    if (v > 0) return (size_t)v;
    size_t best = 1;
    int n = tokenizer_vocab_size(tok);
    for (int id = 0; id < n; id++) {
        size_t len = 0;
        if (tokenizer_token_bytes(tok, id, &len) && len > best) best = len;
    }
    atomic_store(&ctx->longest_token, (int)best);
    return best;
}

static int run_prepare(comp_run *r, api_error *e) {
    completion_request *q = &r->req;
    const opt_config *mc = engine_model_config(r->ctx->eng);
    int max_len = engine_max_model_len(r->ctx->eng);
    r->tok = engine_tokenizer(r->ctx->eng);
    r->eos = tokenizer_eos_id(r->tok);
    r->prompts = calloc((size_t)q->n_prompts, sizeof(prompt_ids));
    if (!r->prompts) return api_fail(e, 500, NULL, "out of memory");
    size_t longest = longest_token_bytes(r->ctx, r->tok);
    for (int i = 0; i < q->n_prompts; i++) {
        api_prompt *p = &q->prompts[i];
        prompt_ids *d = &r->prompts[i];
        if (p->text) {
            /* Tokenizing megabytes only to learn they are too long is wasted
             * work (and slow for BPE on long runs): no token is longer than
             * the longest vocabulary entry, which bounds the count from below. */
            size_t at_least = (p->text_len + longest - 1) / longest;
            if (at_least >= (size_t)max_len)
                return api_fail(e, 400, "prompt",
                                "This model's maximum context length is %d tokens. However, your "
                                "request has at least %zu input tokens. Please reduce the length "
                                "of the input messages.",
                                max_len, at_least);
            pd_err err;
            if (tokenizer_encode(r->tok, p->text, p->text_len, q->add_special_tokens, &d->ids,
                                 &d->n, &err) != 0)
                return api_fail(e, 400, "prompt", "%s", err.msg);
        } else {
            d->ids = p->ids; /* take ownership */
            d->n = p->n_ids;
            p->ids = NULL;
        }
        if (completion_check_prompt(d->ids, d->n, mc->vocab_size, q->max_tokens, max_len, e) != 0)
            return -1;
        r->prompt_tokens += d->n;
        if (q->echo) {
            if (p->text) {
                d->echo_text = strdup(p->text);
                d->echo_len = p->text_len;
            } else {
                d->echo_text =
                    tokenizer_decode(r->tok, d->ids, d->n, q->skip_special_tokens, &d->echo_len);
            }
            if (!d->echo_text) return api_fail(e, 500, NULL, "out of memory");
        }
    }
    return 0;
}

static void echo_logprobs(comp_run *r, choice *c) {
    /* Prompt tokens get null logprobs (pdserve computes no prompt logprobs;
     * vLLM fills all but the first). */
    prompt_ids *d = &r->prompts[c->prompt];
    for (int i = 0; i < d->n; i++) {
        char *tok = token_text(r, d->ids[i]);
        lp_list_add(&c->lp, tok, c->lp_chars, false, 0, 0, NULL, NULL);
        c->lp_chars += utf8_chars(tok ? tok : "", tok ? strlen(tok) : 0);
        free(tok);
    }
}

static int run_submit(comp_run *r, api_error *e) {
    completion_request *q = &r->req;
    r->n_ch = q->n_prompts * q->n;
    r->ch = calloc((size_t)r->n_ch, sizeof(choice));
    if (!r->ch) return api_fail(e, 500, NULL, "out of memory");
    if (q->logprobs > 0) {
        r->top_ids = malloc(sizeof(int32_t) * READ_BATCH * (size_t)q->logprobs);
        r->top_lps = malloc(sizeof(float) * READ_BATCH * (size_t)q->logprobs);
        if (!r->top_ids || !r->top_lps) return api_fail(e, 500, NULL, "out of memory");
    }
    engine_request_params p;
    engine_request_params_default(&p);
    p.sampling = q->sampling;
    p.max_tokens = q->max_tokens;
    p.min_tokens = q->min_tokens;
    p.ignore_eos = q->ignore_eos;
    p.stop_token_ids = q->stop_ids;
    p.n_stop_token_ids = q->n_stop_ids;
    p.logprobs = q->logprobs;
    pd_err err;
    if (sampling_params_validate(&p.sampling, &err) != 0)
        return api_fail(e, 400, NULL, "%s", err.msg);
    if (kv_request_params_parse(q->kv_transfer_params, &p.kv, &err) != 0)
        return api_fail(e, 400, "kv_transfer_params", "%s", err.msg);
    if (p.kv.present && engine_connector(r->ctx->eng) && (p.kv.do_remote_decode || p.kv.do_remote_prefill) &&
        !p.kv.remote_kv_addr[0])
        return api_fail(e, 400, "kv_transfer_params", "kv_transfer_params.remote_kv_addr is required");
    r->kv_send = p.kv.present && p.kv.do_remote_decode && engine_connector(r->ctx->eng) &&
                 kv_connector_is_producer(engine_connector(r->ctx->eng));
    if (r->kv_send && q->stream)
        /* The decode instance needs this response's kv_transfer_params,
         * which only a whole (not streamed) answer carries. */
        return api_fail(e, 400, "stream",
                        "a prefill request (kv_transfer_params.do_remote_decode) needs stream "
                        "false: its response carries the kv_transfer_params for the decode side");
    if (p.kv.present && r->n_ch > 1 && engine_connector(r->ctx->eng))
        return api_fail(e, 400, "kv_transfer_params",
                        "kv_transfer_params needs a single prompt and n=1 (got %d choices)", r->n_ch);
    for (int i = 0; i < r->n_ch; i++) {
        choice *c = &r->ch[i];
        c->prompt = i / q->n;
        c->index = i;
        pd_buf_init(&c->text);
        c->ds = detok_stream_create(r->tok, q->skip_special_tokens);
        if (!c->ds) return api_fail(e, 500, NULL, "out of memory");
        if (q->echo && q->logprobs >= 0) echo_logprobs(r, c);
        c->lp_prompt = c->lp.n;
        if (q->max_tokens == 0) { /* echo only */
            c->done = true;
            c->fin = FINISH_LENGTH;
            continue;
        }
        /* n > 1 with a seed: each sample gets its own stream, reproducibly. */
        p.fallback_seed = (uint64_t)atomic_fetch_add(&r->ctx->next_id, 1);
        if (q->sampling.has_seed) p.sampling.seed = q->sampling.seed + (uint64_t)(i % q->n);
        char rid[64];
        snprintf(rid, sizeof rid, "%s-%d", r->id, i);
        prompt_ids *d = &r->prompts[c->prompt];
        engine_status st = engine_submit(r->ctx->eng, d->ids, d->n, &p, rid, &c->seq, &err);
        if (st == ENGINE_OK) continue;
        c->seq = NULL;
        if (st == ENGINE_BUSY)
            return api_fail(e, 503, NULL, "the server is busy (waiting queue full); retry later");
        if (st == ENGINE_STOPPING) return api_fail(e, 503, NULL, "the server is shutting down");
        return api_fail(e, 400, "prompt", "%s", err.msg);
    }
    return 0;
}

/* ---- non-streaming ------------------------------------------------------ */

static void reply_full(comp_run *r, http_reply *out) {
    choice_view *views = calloc((size_t)r->n_ch, sizeof(choice_view));
    pd_buf *texts = calloc((size_t)r->n_ch, sizeof(pd_buf));
    if (!views || !texts) {
        free(views);
        free(texts);
        api_error e;
        api_fail(&e, 500, NULL, "out of memory");
        return http_reply_error(out, &e);
    }
    for (int i = 0; i < r->n_ch; i++) {
        choice *c = &r->ch[i];
        if (c->fin == FINISH_ERROR) {
            api_error e;
            const int status = c->seq ? engine_seq_error_status(c->seq) : 500;
            /* A prefill's 502 is always its KV hand-off to the decode side
             * failing; param says so, so a proxy blames the decode
             * instance, not this one (docs/protocol.md). */
            api_fail(&e, status, r->kv_send && status == 502 ? "kv_transfer_params" : NULL,
                     "generation failed: %s", c->seq ? engine_seq_error(c->seq) : "unknown error");
            free(views);
            free(texts);
            return http_reply_error(out, &e);
        }
        choice_view_fill(r, c, &views[i]);
        pd_buf_init(&texts[i]);
        if (r->req.echo)
            pd_buf_append(&texts[i], r->prompts[c->prompt].echo_text,
                          r->prompts[c->prompt].echo_len);
        pd_buf_append(&texts[i], c->text.data ? c->text.data : "", c->text.len);
        views[i].text = texts[i].data;
        views[i].text_len = texts[i].len;
    }
    /* A prefill instance answers with the kv_transfer_params the decode
     * instance needs; otherwise null, as vLLM without a connector. */
    char kv_params[512];
    bool have_kv = r->n_ch == 1 && r->ch[0].seq &&
                   engine_seq_kv_transfer_params(r->ch[0].seq, kv_params, sizeof kv_params);
    size_t len;
    char *body = completion_response_json(&r->meta, views, r->n_ch, r->prompt_tokens,
                                          completion_tokens(r), have_kv ? kv_params : NULL, &len);
    for (int i = 0; i < r->n_ch; i++)
        pd_buf_free(&texts[i]);
    free(views);
    free(texts);
    http_reply_body(out, 200, "application/json", body, len);
}

/* ---- streaming ---------------------------------------------------------- */

/* Append an event (NUL-terminated, as the builders return it) and free it. */
static void emit(comp_run *r, char *event) {
    if (event)
        pd_buf_puts(&r->out, event);
    else
        r->out.oom = true;
    free(event);
}

/* Queue the chunks that are ready: per choice, new text (minus the stop
 * hold-back) and new logprobs; the final chunk carries finish_reason. */
static void stream_collect(comp_run *r) {
    for (int i = 0; i < r->n_ch; i++) {
        choice *c = &r->ch[i];
        if (c->final_sent) continue;
        if (c->fin == FINISH_ERROR && c->done) {
            if (!r->error_sent) {
                api_error e;
                api_fail(&e, engine_seq_error_status(c->seq), NULL, "generation failed: %s",
                         engine_seq_error(c->seq));
                emit(r, api_error_sse(&e, NULL));
                r->error_sent = true;
            }
            c->final_sent = true;
            continue;
        }
        size_t hold = c->done ? 0
                              : stop_holdback(c->text.data ? c->text.data : "", c->text.len,
                                              r->req.stop, r->req.n_stop);
        size_t end = c->text.len - hold;
        if (end < c->sent) end = c->sent;
        /* New logprobs of generated tokens (echoed prompt entries ride along). */
        bool new_lp = c->lp.n > (c->lp_sent > c->lp_prompt ? c->lp_sent : c->lp_prompt);
        if (end == c->sent && !new_lp && !c->done) continue;
        pd_buf t;
        pd_buf_init(&t);
        if (r->req.echo && !c->echo_sent)
            pd_buf_append(&t, r->prompts[c->prompt].echo_text, r->prompts[c->prompt].echo_len);
        if (end > c->sent) pd_buf_append(&t, c->text.data + c->sent, end - c->sent);
        choice_view v;
        choice_view_fill(r, c, &v);
        v.text = t.data;
        v.text_len = t.len;
        v.lp_from = c->lp_sent;
        long long usage[2] = {r->prompt_tokens, completion_tokens(r)};
        emit(r, completion_chunk_sse(&r->meta, &v,
                                     r->req.include_usage && r->req.continuous_usage ? usage : NULL,
                                     NULL));
        pd_buf_free(&t);
        c->echo_sent = true;
        c->sent = end;
        c->lp_sent = c->lp.n;
        if (c->done) c->final_sent = true;
    }
}

static void stream_finish(comp_run *r) {
    if (r->req.include_usage && !r->error_sent) {
        emit(r, completion_usage_sse(&r->meta, r->prompt_tokens, completion_tokens(r), NULL));
    }
    pd_buf_puts(&r->out, "data: [DONE]\n\n");
    r->stream_done = true;
}

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    comp_run *r = cls;
    while (r->out_pos == r->out.len) {
        if (r->stream_done) return MHD_CONTENT_READER_END_OF_STREAM;
        r->out.len = r->out_pos = 0;
        if (pd_httpd_client_gone(r->conn)) {
            run_abort_all(r);
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        if (atomic_load(&r->ctx->hard_stop)) run_abort_all(r);
        bool all_done = run_poll(r);
        stream_collect(r);
        if (all_done) stream_finish(r);
        if (r->out.oom) return MHD_CONTENT_READER_END_WITH_ERROR;
    }
    size_t n = r->out.len - r->out_pos < max ? r->out.len - r->out_pos : max;
    memcpy(buf, r->out.data + r->out_pos, n);
    r->out_pos += n;
    return (ssize_t)n;
}

static void stream_free(void *cls) {
    run_free(cls);
}

/* ---- handler ------------------------------------------------------------ */

void api_completions(http_request *rq, http_reply *out) {
    http_ctx *ctx = rq->ctx;
    api_error e;
    comp_run *r = calloc(1, sizeof *r);
    if (!r) {
        api_fail(&e, 500, NULL, "out of memory");
        return http_reply_error(out, &e);
    }
    r->ctx = ctx;
    r->conn = rq->conn;
    pd_buf_init(&r->out);
    atomic_fetch_add(&ctx->active, 1);
    r->counted = true;
    http_new_completion_id(ctx, r->id);
    r->meta.id = r->id;
    r->meta.created = (long long)time(NULL);
    r->meta.model = ctx->cfg.names[0];
    if (atomic_load(&ctx->draining)) {
        api_fail(&e, 503, NULL, "the server is shutting down");
        goto fail;
    }
    if (completion_request_parse(rq->body, rq->body_len, &ctx->limits, &r->req, &e) != 0 ||
        http_check_model(ctx, r->req.model, &e) != 0 || run_prepare(r, &e) != 0 ||
        run_submit(r, &e) != 0)
        goto fail;
    if (r->req.stream) {
        out->status = 200;
        out->resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16 * 1024, stream_read, r,
                                                      stream_free);
        if (!out->resp) {
            api_fail(&e, 500, NULL, "out of memory");
            goto fail;
        }
        MHD_add_response_header(out->resp, "Content-Type", "text/event-stream; charset=utf-8");
        MHD_add_response_header(out->resp, "Cache-Control", "no-cache");
        return;
    }
    for (;;) {
        if (atomic_load(&ctx->hard_stop)) run_abort_all(r);
        if (run_poll(r)) break;
        if (pd_httpd_client_gone(rq->conn)) {
            run_abort_all(r);
            run_free(r);
            out->close = true;
            return;
        }
    }
    reply_full(r, out);
    run_free(r);
    return;
fail:
    run_free(r);
    http_reply_error(out, &e);
}
