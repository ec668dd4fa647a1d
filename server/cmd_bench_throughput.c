/* cmd_bench_throughput: `pdserve bench-throughput` — offline throughput of
 * the engine, in process, like vLLM's benchmarks/benchmark_throughput.py
 * with its random dataset: --num-prompts requests of --input-len random
 * token ids (seeded by --seed) are submitted to the engine at once, each
 * decoding greedily for exactly --output-len tokens (EOS ignored); the
 * command waits for all of them and reports requests/s, output tokens/s,
 * total tokens/s, the elapsed time and the engine's step count. No HTTP,
 * tokenizer or detokenizer is in the loop, so this is the ceiling a server
 * on the same flags can reach.
 *
 * The engine flags are `pdserve serve`'s (serve_options_parse_engine), so a
 * figure measured here is for the same configuration a server would run. */
#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/config.h"
#include "server/cli.h"
#include "server/commands.h"
#include "server/engine.h"
#include "server/serve_options.h"

typedef struct throughput_opts {
    int num_prompts, input_len, output_len, json, top_k;
    float temperature, top_p;
} throughput_opts;

#define T(f) offsetof(throughput_opts, f)
static const cli_option throughput_table[] = {
    {"num-prompts", CLI_INT, T(num_prompts), "256", 1, 1 << 20, "requests, all submitted at once"},
    {"input-len", CLI_INT, T(input_len), "128", 1, 1 << 20,
     "prompt tokens per request (random ids, seeded by --seed)"},
    {"output-len", CLI_INT, T(output_len), "128", 1, 1 << 20,
     "tokens generated per request (EOS ignored)"},
    {"temperature", CLI_FLOAT, T(temperature), "0", 0, 100,
     "0: greedy; vLLM's benchmark_throughput samples at 1.0"},
    {"top-p", CLI_FLOAT, T(top_p), "1", 1e-6, 1, "nucleus sampling (1: off)"},
    {"top-k", CLI_INT, T(top_k), "0", -1, 1 << 20, "top-k sampling (0 or -1: off)"},
    {"json", CLI_BOOL, T(json), "false", 1, 0,
     "print the result as one JSON line on stdout (the readable report goes to stderr)"},
};
#define N_THROUGHPUT_OPTS ((int)(sizeof throughput_table / sizeof throughput_table[0]))

typedef struct throughput_result {
    double elapsed;
    long prompt_tokens, output_tokens;
    engine_stats stats;
    int num_blocks, max_model_len;
} throughput_result;

/* splitmix64: a small, seedable generator, so a seed gives the same prompts
 * on every machine. */
static uint64_t next_random(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Everything one run owns; freed in one place. usage_error: the failure
 * was a bad flag value (exit status 2), not a runtime failure (1). */
typedef struct throughput_state {
    char *model_dir;
    engine *eng;
    int32_t *prompts;
    engine_seq **seqs;
    int n_seqs;
    bool usage_error;
} throughput_state;

static void throughput_state_free(throughput_state *st) {
    for (int i = 0; i < st->n_seqs; i++)
        engine_seq_release(st->seqs[i]);
    free(st->seqs);
    engine_destroy(st->eng);
    free(st->prompts);
    free(st->model_dir);
}

static int throughput_run(serve_options *so, const throughput_opts *o, throughput_state *st,
                          throughput_result *r, pd_err *err) {
    if (resolve_model_arg(so->model_arg, &st->model_dir, err) != 0) return -1;
    opt_config mc;
    if (opt_config_load(st->model_dir, &mc, err) != 0) return -1;
    const int max_model_len =
        so->max_model_len_value > 0 ? so->max_model_len_value : mc.max_position_embeddings;
    const long per_request = (long)o->input_len + o->output_len;
    if (per_request > max_model_len) {
        st->usage_error = true;
        return pd_fail(err,
                       "--input-len %d + --output-len %d = %ld tokens exceeds max_model_len %d",
                       o->input_len, o->output_len, per_request, max_model_len);
    }
    if (serve_options_select_backend(so, mc.torch_dtype, err) != 0) return -1;
    engine_config ec;
    engine_config_default(&ec);
    serve_options_to_engine(so, st->model_dir, &ec);
    ec.kv_transfer = NULL;
    if (ec.max_waiting < o->num_prompts) ec.max_waiting = o->num_prompts; /* all wait at first */
    if (engine_create(&ec, &st->eng, err) != 0) return -1;
    r->max_model_len = engine_max_model_len(st->eng);
    r->num_blocks = engine_num_blocks(st->eng);

    const size_t n_ids = (size_t)o->num_prompts * (size_t)o->input_len;
    st->prompts = malloc(sizeof(int32_t) * n_ids);
    st->seqs = calloc((size_t)o->num_prompts, sizeof *st->seqs);
    if (!st->prompts || !st->seqs) return pd_fail(err, "out of memory");
    uint64_t rng = so->seed;
    for (size_t i = 0; i < n_ids; i++)
        st->prompts[i] = (int32_t)(next_random(&rng) % (uint64_t)mc.vocab_size);

    engine_request_params p;
    engine_request_params_default(&p);
    p.max_tokens = o->output_len;
    p.ignore_eos = true;
    p.sampling.temperature = o->temperature;
    p.sampling.top_p = o->top_p;
    p.sampling.top_k = o->top_k;
    double t0 = pd_now();
    for (int i = 0; i < o->num_prompts; i++) {
        char id[32];
        snprintf(id, sizeof id, "bench-%d", i);
        p.fallback_seed = (uint64_t)i + 1;
        engine_status s = engine_submit(st->eng, st->prompts + (size_t)i * o->input_len,
                                        o->input_len, &p, id, &st->seqs[i], err);
        if (s != ENGINE_OK) return pd_wrap(err, "submitting request %d", i);
        st->n_seqs++;
    }
    for (int i = 0; i < o->num_prompts; i++)
        while (engine_seq_finish(st->seqs[i]) == FINISH_NONE)
            engine_seq_wait(st->seqs[i], o->output_len, 1000);
    r->elapsed = pd_now() - t0;
    engine_stats_get(st->eng, &r->stats);

    r->prompt_tokens = (long)n_ids;
    r->output_tokens = 0;
    for (int i = 0; i < o->num_prompts; i++) {
        engine_seq *s = st->seqs[i];
        finish_reason fr = engine_seq_finish(s);
        int n = engine_seq_wait(s, 0, 0);
        if (fr == FINISH_ERROR)
            return pd_fail(err, "request %d failed: %s", i, engine_seq_error(s));
        if (fr != FINISH_LENGTH || n != o->output_len)
            return pd_fail(err, "request %d finished (%s) after %d tokens, not %d", i,
                           finish_reason_name(fr), n, o->output_len);
        r->output_tokens += n;
    }
    return 0;
}

static void throughput_report(const serve_options *so, const throughput_opts *o,
                              const throughput_result *r, FILE *out) {
    const double el = r->elapsed > 0 ? r->elapsed : 1e-9;
    const engine_stats *s = &r->stats;
    fprintf(out,
            "bench-throughput: %d requests of %d prompt + %d output tokens on %s (max_num_seqs %d, "
            "max_num_batched_tokens %d, %d KV blocks of %d tokens)\n",
            o->num_prompts, o->input_len, o->output_len, so->backend, so->max_num_seqs,
            so->max_num_batched_tokens, r->num_blocks, so->block_size);
    fprintf(out, "Throughput: %.2f requests/s, %.2f total tokens/s, %.2f output tokens/s\n",
            o->num_prompts / el, (r->prompt_tokens + r->output_tokens) / el, r->output_tokens / el);
    fprintf(out, "Total num prompt tokens: %ld, total num output tokens: %ld, elapsed %.3f s\n",
            r->prompt_tokens, r->output_tokens, r->elapsed);
    fprintf(
        out,
        "Engine: %llu steps, mean %.3f ms per step (elapsed / steps), %llu tokens through the "
        "model, %llu preemptions, %llu steps queued ahead (%llu with tokens read on the device)\n",
        (unsigned long long)s->steps, s->steps ? 1e3 * r->elapsed / (double)s->steps : 0.0,
        (unsigned long long)s->step_tokens, (unsigned long long)s->preemptions,
        (unsigned long long)s->steps_ahead, (unsigned long long)s->steps_chained);
}

static int throughput_json(const serve_options *so, const throughput_opts *o,
                           const throughput_result *r) {
    const double el = r->elapsed > 0 ? r->elapsed : 1e-9;
    const engine_stats *s = &r->stats;
    cJSON *j = cJSON_CreateObject();
    if (!j) return -1;
    cJSON_AddStringToObject(j, "backend", so->backend);
    cJSON_AddNumberToObject(j, "num_prompts", o->num_prompts);
    cJSON_AddNumberToObject(j, "input_len", o->input_len);
    cJSON_AddNumberToObject(j, "output_len", o->output_len);
    cJSON_AddNumberToObject(j, "max_num_seqs", so->max_num_seqs);
    cJSON_AddNumberToObject(j, "max_num_batched_tokens", so->max_num_batched_tokens);
    cJSON_AddNumberToObject(j, "num_blocks", r->num_blocks);
    cJSON_AddNumberToObject(j, "block_size", so->block_size);
    cJSON_AddNumberToObject(j, "elapsed_s", r->elapsed);
    cJSON_AddNumberToObject(j, "requests_per_s", o->num_prompts / el);
    cJSON_AddNumberToObject(j, "output_tokens_per_s", r->output_tokens / el);
    cJSON_AddNumberToObject(j, "total_tokens_per_s", (r->prompt_tokens + r->output_tokens) / el);
    cJSON_AddNumberToObject(j, "prompt_tokens", (double)r->prompt_tokens);
    cJSON_AddNumberToObject(j, "output_tokens", (double)r->output_tokens);
    cJSON_AddNumberToObject(j, "engine_steps", (double)s->steps);
    cJSON_AddNumberToObject(j, "mean_step_ms",
                            s->steps ? 1e3 * r->elapsed / (double)s->steps : 0.0);
    cJSON_AddNumberToObject(j, "step_tokens", (double)s->step_tokens);
    cJSON_AddNumberToObject(j, "preemptions", (double)s->preemptions);
    char *text = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    if (!text) return -1;
    printf("%s\n", text);
    free(text);
    return 0;
}

int cmd_bench_throughput(int argc, char **argv) {
    pd_err err = {{0}};
    char **mine = malloc(sizeof(char *) * (size_t)(argc + 1));
    char **rest = malloc(sizeof(char *) * (size_t)(argc + 1));
    if (!mine || !rest) {
        free(mine);
        free(rest);
        fprintf(stderr, "pdserve bench-throughput: out of memory\n");
        return 1;
    }
    int n_mine = 0, n_rest = 0, n_pos = 0;
    cli_split(throughput_table, N_THROUGHPUT_OPTS, argc, argv, mine, &n_mine, rest, &n_rest);
    throughput_opts o;
    serve_options so;
    int rc = cli_parse(throughput_table, N_THROUGHPUT_OPTS, &o, n_mine, mine, NULL, 0, &n_pos, NULL,
                       &err);
    if (rc == 0) rc = serve_options_parse_engine(n_rest, rest, &so, &err);
    free(mine);
    free(rest);
    if (rc != 0) {
        fprintf(stderr, "pdserve bench-throughput: %s\n", err.msg);
        return 2;
    }
    if (so.help) {
        cli_print_help("pdserve bench-throughput [MODEL] [options] [engine options]",
                       throughput_table, N_THROUGHPUT_OPTS);
        printf("\nengine options (as for pdserve serve):\n");
        serve_options_print_engine_options();
        return 0;
    }
    pd_log_set_level(so.log_level_value);
    serve_options_log_ignored(&so);
    throughput_state st = {0};
    throughput_result r;
    memset(&r, 0, sizeof r);
    rc = throughput_run(&so, &o, &st, &r, &err);
    bool usage_error = st.usage_error;
    throughput_state_free(&st);
    if (rc != 0) {
        fprintf(stderr, "pdserve bench-throughput: %s\n", err.msg);
        return usage_error || strstr(err.msg, "--max-model-len") ? 2 : 1;
    }
    throughput_report(&so, &o, &r, o.json ? stderr : stdout);
    if (o.json && throughput_json(&so, &o, &r) != 0) {
        fprintf(stderr, "pdserve bench-throughput: out of memory\n");
        return 1;
    }
    return 0;
}
