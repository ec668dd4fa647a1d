/* test_engine: the engine and scheduler on the tiny generated model, without
 * HTTP. Checks that a request's output does not depend on what else runs
 * (batch invariance, chunked prefill, preemption, prefix caching), that
 * aborts free their blocks at once, and that the KV pool ends all-free. */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "connector/connector.h"
#include "model/make_model.h"
#include "server/engine.h"
#include "tests/common/testlib.h"

#define N_REQ 64
#define MAX_TOKENS 12

static char model_dir[512];

typedef struct req {
    int32_t prompt[200];
    int n_prompt;
    int32_t out[MAX_TOKENS];
    int n_out;
    finish_reason fr;
} req;

static void make_requests(req *r, int n, unsigned seed, bool shared_prefix) {
    srand(seed);
    for (int i = 0; i < n; i++) {
        r[i].n_prompt = shared_prefix ? 60 + rand() % 90 : 1 + rand() % 150;
        r[i].prompt[0] = 50256;
        for (int k = 1; k < r[i].n_prompt; k++)
            r[i].prompt[k] = shared_prefix && k < 40 ? (int32_t)(1000 + k) : (int32_t)(rand() % 50257);
    }
}

/* Collect a finished sequence's output. */
static void collect(engine_seq *s, req *r) {
    while (engine_seq_finish(s) == FINISH_NONE) engine_seq_wait(s, MAX_TOKENS, 1000);
    engine_token toks[MAX_TOKENS];
    r->n_out = engine_seq_read(s, 0, MAX_TOKENS, toks, NULL, NULL);
    for (int i = 0; i < r->n_out; i++) r->out[i] = toks[i].id;
    r->fr = engine_seq_finish(s);
}

static bool async_scheduling; /* for the engines start() makes */

static engine *start(int num_blocks, int max_batched, bool prefix) {
    engine_config c;
    engine_config_default(&c);
    c.async_scheduling = async_scheduling;
    c.model_dir = model_dir;
    c.num_blocks_override = num_blocks;
    c.max_num_batched_tokens = max_batched;
    c.enable_prefix_caching = prefix;
    engine *e = NULL;
    pd_err err = {{0}};
    CHECKF(engine_create(&c, &e, &err) == 0, "%s", err.msg);
    return e;
}

static void run_all(engine *e, req *r, int n, bool concurrent, float temperature) {
    engine_seq *seqs[N_REQ];
    for (int i = 0; i < n; i++) {
        engine_request_params p;
        engine_request_params_default(&p);
        p.max_tokens = MAX_TOKENS;
        p.ignore_eos = true;
        p.sampling.temperature = temperature;
        p.sampling.has_seed = true;
        p.sampling.seed = 100 + (uint64_t)i;
        pd_err err = {{0}};
        CHECKF(engine_submit(e, r[i].prompt, r[i].n_prompt, &p, "t", &seqs[i], &err) == ENGINE_OK, "%s", err.msg);
        if (!concurrent) {
            collect(seqs[i], &r[i]);
            engine_seq_release(seqs[i]);
        }
    }
    if (concurrent)
        for (int i = 0; i < n; i++) {
            collect(seqs[i], &r[i]);
            engine_seq_release(seqs[i]);
        }
}

static void wait_idle(engine *e, engine_stats *st) {
    for (int i = 0; i < 200; i++) {
        engine_stats_get(e, st);
        if (st->running == 0 && st->waiting == 0) return;
        usleep(10000);
    }
}

static int same_outputs(const req *a, const req *b, int n) {
    int same = 0;
    for (int i = 0; i < n; i++)
        same += a[i].n_out == b[i].n_out && memcmp(a[i].out, b[i].out, sizeof(int32_t) * (size_t)a[i].n_out) == 0;
    return same;
}

/* A decode instance (kv_consumer) holds blocks for a request whose KV is on
 * its way; when a running sequence then needs them and nothing has been
 * written into them, it gets them and no running sequence is preempted.
 * Here the prefill never sends, so the waiting request ends at the transfer
 * deadline with a 504 and its blocks come back. 20 blocks of 16 tokens: the
 * waiting request holds 6 (96 tokens); two local requests grow to 116
 * tokens, 8 blocks each, 16 > the 14 left. */
/* An engine with a KV connector in role, configured as a user writes it
 * (PUT_ASYNC over tcp) and then put on any free port; max_model_len 256
 * (16 blocks: a pool of 20 holds one whole sequence). num_blocks 0: sized
 * as usual. kvc must outlive the engine. NULL on failure (reported). */
static engine *start_kv(const char *role, int timeout_s, int num_blocks, kv_transfer_config *kvc) {
    char js[320];
    snprintf(js, sizeof js,
             "{\"kv_connector\":\"P2pNcclConnector\",\"kv_role\":\"%s\","
             "\"kv_ip\":\"127.0.0.1\",\"kv_connector_extra_config\":"
             "{\"send_type\":\"PUT_ASYNC\",\"timeout_s\":%d}}",
             role, timeout_s);
    pd_err err = {{0}};
    CHECKF(kv_transfer_config_parse(js, kvc, &err) == 0, "%s", err.msg);
    kvc->kv_port = 0;
    engine_config c;
    engine_config_default(&c);
    c.model_dir = model_dir;
    c.num_blocks_override = num_blocks;
    c.max_model_len = 256;
    c.kv_transfer = kvc;
    engine *e = NULL;
    CHECKF(engine_create(&c, &e, &err) == 0, "%s", err.msg);
    return e;
}

static void reservation_returned(void) {
    kv_transfer_config kvc;
    pd_err err = {{0}};
    engine *e = start_kv("kv_consumer", 4, 20, &kvc);
    if (!e) return;

    int32_t prompt[96];
    for (int i = 0; i < 96; i++)
        prompt[i] = i ? 1000 + i : 2;
    engine_request_params p;
    engine_request_params_default(&p);
    p.max_tokens = 100;
    p.ignore_eos = true;
    p.kv.present = p.kv.do_remote_prefill = true;
    snprintf(p.kv.remote_kv_addr, sizeof p.kv.remote_kv_addr, "127.0.0.1:9");
    snprintf(p.kv.remote_request_id, sizeof p.kv.remote_request_id, "never-sent");
    engine_seq *remote = NULL;
    CHECKF(engine_submit(e, prompt, 96, &p, "remote", &remote, &err) == ENGINE_OK, "%s", err.msg);
    engine_stats st;
    for (int i = 0; i < 200; i++) { /* the engine reserves on its next poll */
        engine_stats_get(e, &st);
        if (st.free_blocks == 14) break;
        usleep(10000);
    }
    CHECKF(st.free_blocks == 14, "blocks held for the waiting request: %d of 20 free, expected 14",
           st.free_blocks);

    p.kv.present = p.kv.do_remote_prefill = false;
    engine_seq *local[2];
    for (int i = 0; i < 2; i++)
        CHECKF(engine_submit(e, prompt + 10 * i, 16, &p, "local", &local[i], &err) == ENGINE_OK,
               "%s", err.msg);
    for (int i = 0; i < 2; i++) {
        while (engine_seq_finish(local[i]) == FINISH_NONE)
            engine_seq_wait(local[i], 1 << 30, 1000);
        CHECKF(engine_seq_finish(local[i]) == FINISH_LENGTH &&
                   engine_seq_wait(local[i], 0, 0) == 100,
               "local request %d: %s after %d tokens", i,
               finish_reason_name(engine_seq_finish(local[i])), engine_seq_wait(local[i], 0, 0));
        engine_seq_release(local[i]);
    }
    engine_stats_get(e, &st);
    CHECKF(st.preemptions == 0 && st.reservations_returned >= 1,
           "%llu preemptions, %llu reservations given back: the held blocks should have gone to "
           "the running sequences",
           (unsigned long long)st.preemptions, (unsigned long long)st.reservations_returned);
    while (engine_seq_finish(remote) == FINISH_NONE)
        engine_seq_wait(remote, 1 << 30, 1000);
    CHECKF(engine_seq_finish(remote) == FINISH_ERROR && engine_seq_error_status(remote) == 504,
           "the request whose KV never came: %s, status %d",
           finish_reason_name(engine_seq_finish(remote)), engine_seq_error_status(remote));
    engine_seq_release(remote);
    wait_idle(e, &st);
    CHECKF(st.free_blocks == st.total_blocks, "blocks leaked: %d of %d free", st.free_blocks,
           st.total_blocks);
    engine_destroy(e);
}

/* A decode instance (kv_consumer, 20 blocks of 16 tokens) where a plain
 * request cannot get its blocks at first: Q, whose KV never comes, holds 6
 * blocks; P needs 15 of the 14 left. R, behind P, has all its KV here
 * already. Nothing may wait for Q's transfer deadline: P takes Q's blocks
 * (nothing was written into them) and R starts too, both long before Q
 * ends with its 504. (Before, P waited at the head of the queue for Q's
 * deadline, R behind it, and the engine thread spun meanwhile; had R's
 * blocks been the ones P needed, both waited for good.) */
static void ready_remote_not_held_up(void) {
    kv_transfer_config kvc[2];
    pd_err err = {{0}};
    engine *eng[2] = {NULL, NULL}; /* 0: the decode instance, 1: the prefill one */
    engine_seq *pre = NULL, *q = NULL, *plain = NULL, *r = NULL;
    eng[0] = start_kv("kv_consumer", 6, 20, &kvc[0]);
    eng[1] = eng[0] ? start_kv("kv_producer", 6, 0, &kvc[1]) : NULL;
    if (!eng[1]) goto out;
    int32_t prompt[240];
    for (int i = 0; i < 240; i++)
        prompt[i] = i ? 1000 + i : 2;
    engine_request_params p;
    /* R's prefill: its KV goes to the decode instance now. */
    engine_request_params_default(&p);
    p.max_tokens = 1;
    p.kv.present = p.kv.do_remote_decode = true;
    snprintf(p.kv.remote_kv_addr, sizeof p.kv.remote_kv_addr, "%s",
             kv_connector_address(engine_connector(eng[0])));
    CHECKF(engine_submit(eng[1], prompt + 100, 96, &p, "pre", &pre, &err) == ENGINE_OK, "%s",
           err.msg);
    if (!pre) goto out;
    while (engine_seq_finish(pre) == FINISH_NONE)
        engine_seq_wait(pre, 1 << 30, 1000);
    char kvjs[512];
    kv_request_params rkv;
    CHECK(engine_seq_kv_transfer_params(pre, kvjs, sizeof kvjs));
    CHECKF(kv_request_params_parse(kvjs, &rkv, &err) == 0, "%s", err.msg);

    engine_request_params_default(&p);
    p.max_tokens = 4;
    p.ignore_eos = true;
    p.kv.present = p.kv.do_remote_prefill = true;
    snprintf(p.kv.remote_kv_addr, sizeof p.kv.remote_kv_addr, "127.0.0.1:9");
    snprintf(p.kv.remote_request_id, sizeof p.kv.remote_request_id, "never-sent");
    CHECKF(engine_submit(eng[0], prompt, 96, &p, "Q", &q, &err) == ENGINE_OK, "%s", err.msg);
    engine_stats st;
    for (int i = 0; i < 200; i++) { /* the engine reserves Q's blocks on its next poll */
        engine_stats_get(eng[0], &st);
        if (st.free_blocks == 14) break;
        usleep(10000);
    }
    CHECKF(st.free_blocks == 14, "blocks held for Q: %d of 20 free, expected 14", st.free_blocks);
    engine_request_params_default(&p);
    p.max_tokens = 4;
    p.ignore_eos = true;
    CHECKF(engine_submit(eng[0], prompt, 240, &p, "P", &plain, &err) == ENGINE_OK, "%s", err.msg);
    p.kv = rkv;
    CHECKF(engine_submit(eng[0], prompt + 100, 96, &p, "R", &r, &err) == ENGINE_OK, "%s", err.msg);
    if (!q || !plain || !r) goto out;
    const double t0 = pd_now();
    while ((engine_seq_finish(plain) == FINISH_NONE || engine_seq_finish(r) == FINISH_NONE) &&
           pd_now() - t0 < 20) {
        engine_seq_wait(plain, 1 << 30, 100);
        engine_seq_wait(r, 1 << 30, 100);
    }
    CHECKF(engine_seq_finish(plain) == FINISH_LENGTH && engine_seq_finish(r) == FINISH_LENGTH,
           "P: %s, R: %s after %.1f s", finish_reason_name(engine_seq_finish(plain)),
           finish_reason_name(engine_seq_finish(r)), pd_now() - t0);
    CHECKF(engine_seq_finish(q) == FINISH_NONE,
           "P and R should finish before Q's transfer deadline, Q: %s",
           finish_reason_name(engine_seq_finish(q)));
    engine_stats_get(eng[0], &st);
    CHECKF(st.reservations_returned >= 1, "%llu reservations given back (Q's to P expected)",
           (unsigned long long)st.reservations_returned);
    while (engine_seq_finish(q) == FINISH_NONE)
        engine_seq_wait(q, 1 << 30, 1000);
    CHECKF(engine_seq_finish(q) == FINISH_ERROR && engine_seq_error_status(q) == 504,
           "Q: %s, status %d", finish_reason_name(engine_seq_finish(q)),
           engine_seq_error_status(q));
    wait_idle(eng[0], &st);
    CHECKF(st.free_blocks == st.total_blocks, "blocks leaked: %d of %d free", st.free_blocks,
           st.total_blocks);
out:
    if (pre) engine_seq_release(pre);
    if (q) engine_seq_release(q);
    if (plain) engine_seq_release(plain);
    if (r) engine_seq_release(r);
    for (int i = 0; i < 2; i++)
        if (eng[i]) engine_destroy(eng[i]);
}

int main(void) {
    snprintf(model_dir, sizeof model_dir, "%s/tiny", test_tmpdir());
    pd_err err = {{0}};
    CHECKF(opt_make_model(model_dir, "tiny", 5, PD_F32, &err) == 0, "%s", err.msg);

    static req alone[N_REQ], together[N_REQ], chunked[N_REQ], tight[N_REQ], sampled_a[N_REQ], sampled_b[N_REQ];
    make_requests(alone, N_REQ, 1, false);
    memcpy(together, alone, sizeof alone);
    memcpy(chunked, alone, sizeof alone);
    memcpy(tight, alone, sizeof alone);

    /* Reference: one request at a time, no prefix caching. */
    engine *e = start(0, 2048, false);
    run_all(e, alone, N_REQ, false, 0);
    for (int i = 0; i < N_REQ; i++) CHECK(alone[i].n_out == MAX_TOKENS && alone[i].fr == FINISH_LENGTH);
    /* 64 concurrent greedy requests: identical outputs. */
    run_all(e, together, N_REQ, true, 0);
    CHECKF(same_outputs(alone, together, N_REQ) == N_REQ, "batch invariance: %d/%d identical",
           same_outputs(alone, together, N_REQ), N_REQ);
    /* Seeded sampling is reproducible among others too. */
    memcpy(sampled_a, alone, sizeof alone);
    memcpy(sampled_b, alone, sizeof alone);
    run_all(e, sampled_a, 16, false, 0.8f);
    run_all(e, sampled_b, 16, true, 0.8f);
    CHECKF(same_outputs(sampled_a, sampled_b, 16) == 16, "seeded sampling: %d/16 identical",
           same_outputs(sampled_a, sampled_b, 16));
    engine_stats st;
    wait_idle(e, &st);
    CHECKF(st.free_blocks == st.total_blocks, "blocks leaked: %d of %d free", st.free_blocks, st.total_blocks);
    engine_destroy(e);

    /* Chunked prefill (8-token budget per step) with prefix caching on. */
    e = start(0, 8, true);
    run_all(e, chunked, N_REQ, true, 0);
    CHECKF(same_outputs(alone, chunked, N_REQ) == N_REQ, "chunked prefill: %d/%d identical",
           same_outputs(alone, chunked, N_REQ), N_REQ);
    engine_destroy(e);

    /* A deliberately tiny KV budget: 40 blocks of 16 = 640 tokens for 64
     * requests of up to 162 tokens forces preemption. */
    e = start(40, 512, true);
    run_all(e, tight, N_REQ, true, 0);
    CHECKF(same_outputs(alone, tight, N_REQ) == N_REQ, "under preemption: %d/%d identical",
           same_outputs(alone, tight, N_REQ), N_REQ);
    wait_idle(e, &st);
    CHECKF(st.preemptions > 0, "expected preemptions with a tiny KV budget, got %llu",
           (unsigned long long)st.preemptions);
    CHECKF(st.free_blocks == st.total_blocks, "blocks leaked after preemption: %d of %d free", st.free_blocks,
           st.total_blocks);
    printf("tiny KV budget: %llu preemptions\n", (unsigned long long)st.preemptions);

    /* Prefix caching: requests sharing a 40-token prefix hit the cache, and
     * their outputs equal runs without caching. */
    static req shared[16], shared_ref[16];
    make_requests(shared, 16, 9, true);
    memcpy(shared_ref, shared, sizeof shared);
    uint64_t hits0 = st.prefix_hits;
    run_all(e, shared, 16, false, 0);
    wait_idle(e, &st);
    CHECKF(st.prefix_hits - hits0 >= 15 * 32, "prefix-cache hits %llu, expected at least %d",
           (unsigned long long)(st.prefix_hits - hits0), 15 * 32);
    engine *ref = start(0, 2048, false);
    run_all(ref, shared_ref, 16, false, 0);
    CHECKF(same_outputs(shared, shared_ref, 16) == 16, "prefix caching changed outputs: %d/16 identical",
           same_outputs(shared, shared_ref, 16));
    engine_destroy(ref);

    /* Abort: a long request aborted right away frees its blocks. */
    engine_request_params p;
    engine_request_params_default(&p);
    p.max_tokens = 300;
    p.ignore_eos = true;
    engine_seq *s = NULL;
    CHECK(engine_submit(e, alone[0].prompt, alone[0].n_prompt, &p, "abort", &s, &err) == ENGINE_OK);
    engine_seq_wait(s, 0, 5000);
    engine_seq_abort(s);
    while (engine_seq_finish(s) == FINISH_NONE) engine_seq_wait(s, 1 << 30, 100);
    CHECK(engine_seq_finish(s) == FINISH_ABORT);
    CHECK(engine_seq_wait(s, 0, 0) < 300);
    engine_seq_release(s);
    wait_idle(e, &st);
    CHECKF(st.free_blocks == st.total_blocks, "blocks leaked after abort: %d of %d free", st.free_blocks,
           st.total_blocks);
    CHECKF(st.steps > 0 && st.steps_ahead == 0, "without --async-scheduling %llu steps went ahead",
           (unsigned long long)st.steps_ahead);

    /* Invalid requests are refused with a reason. */
    int32_t bad[2] = {50256, 60000};
    CHECK(engine_submit(e, bad, 2, &p, "bad", &s, &err) == ENGINE_INVALID && strstr(err.msg, "vocabulary"));
    p.max_tokens = 600;
    CHECK(engine_submit(e, bad, 1, &p, "long", &s, &err) == ENGINE_INVALID && strstr(err.msg, "context length"));
    CHECK(engine_submit(e, bad, 0, &p, "empty", &s, &err) == ENGINE_INVALID);
    engine_destroy(e);

    /* Async scheduling (each decode step queued before the one before it
     * is read; on the CPU the steps still run one after the other, so this
     * checks the scheduling: extra picks of finished sequences dropped,
     * blocks reserved ahead given back): the same outputs as above. */
    async_scheduling = true;
    static req async_all[N_REQ], async_tight[N_REQ];
    memcpy(async_all, alone, sizeof alone);
    memcpy(async_tight, alone, sizeof alone);
    e = start(0, 2048, true);
    run_all(e, async_all, N_REQ, true, 0);
    CHECKF(same_outputs(alone, async_all, N_REQ) == N_REQ, "async scheduling: %d/%d identical",
           same_outputs(alone, async_all, N_REQ), N_REQ);
    /* Requests that end early, by max_tokens or by a stop id, while others
     * go on: each output is the reference's up to its end. */
    engine_seq *seqs[N_REQ];
    for (int i = 0; i < N_REQ; i++) {
        engine_request_params q;
        engine_request_params_default(&q);
        q.ignore_eos = true;
        q.sampling.temperature = 0;
        q.max_tokens = i % 2 ? 1 + i % MAX_TOKENS : MAX_TOKENS;
        int32_t stop = alone[i].out[(i / 2) % MAX_TOKENS];
        if (i % 2 == 0) {
            q.stop_token_ids = &stop;
            q.n_stop_token_ids = 1;
        }
        CHECKF(engine_submit(e, alone[i].prompt, alone[i].n_prompt, &q, "early", &seqs[i], &err) == ENGINE_OK,
               "%s", err.msg);
    }
    for (int i = 0; i < N_REQ; i++) {
        req got;
        collect(seqs[i], &got);
        engine_seq_release(seqs[i]);
        int want = i % 2 ? 1 + i % MAX_TOKENS : MAX_TOKENS;
        if (i % 2 == 0) { /* through the first output equal to the stop id */
            const int32_t stop = alone[i].out[(i / 2) % MAX_TOKENS];
            for (int k = 0; k < MAX_TOKENS; k++)
                if (alone[i].out[k] == stop) {
                    want = k + 1;
                    break;
                }
        }
        CHECKF(got.n_out == want && memcmp(got.out, alone[i].out, sizeof(int32_t) * (size_t)want) == 0 &&
                   got.fr == (i % 2 ? FINISH_LENGTH : FINISH_STOP),
               "async scheduling, request %d: %d tokens (%s), %d expected", i, got.n_out,
               finish_reason_name(got.fr), want);
    }
    /* Aborted while its next step is already queued. */
    p.max_tokens = 300;
    CHECK(engine_submit(e, alone[0].prompt, alone[0].n_prompt, &p, "abort", &s, &err) == ENGINE_OK);
    engine_seq_wait(s, 2, 5000);
    engine_seq_abort(s);
    while (engine_seq_finish(s) == FINISH_NONE) engine_seq_wait(s, 1 << 30, 100);
    CHECK(engine_seq_finish(s) == FINISH_ABORT);
    engine_seq_release(s);
    wait_idle(e, &st);
    CHECKF(st.free_blocks == st.total_blocks, "async scheduling: blocks leaked: %d of %d free", st.free_blocks,
           st.total_blocks);
    /* The outputs above prove nothing unless steps really went ahead. */
    CHECKF(st.steps_ahead > 0 && st.steps_ahead < st.steps,
           "async scheduling: %llu of %llu steps queued ahead", (unsigned long long)st.steps_ahead,
           (unsigned long long)st.steps);
    engine_destroy(e);
    /* And with the tiny KV budget (preemption; blocks for the next step not
     * always free). */
    e = start(40, 512, true);
    run_all(e, async_tight, N_REQ, true, 0);
    CHECKF(same_outputs(alone, async_tight, N_REQ) == N_REQ, "async scheduling under preemption: %d/%d identical",
           same_outputs(alone, async_tight, N_REQ), N_REQ);
    wait_idle(e, &st);
    CHECKF(st.free_blocks == st.total_blocks, "async scheduling: blocks leaked after preemption: %d of %d free",
           st.free_blocks, st.total_blocks);
    engine_destroy(e);
    reservation_returned();
    ready_remote_not_held_up();
    return test_finish();
}
