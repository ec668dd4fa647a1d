/* cmd_generate: offline generation of one completion, straight through the
 * model API: tokenize -> prefill (in chunks) -> decode loop with the sampler
 * -> incremental detokenization to stdout. Timings go to stderr. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/opt.h"
#include "model/sampler.h"
#include "model/tokenizer.h"
#include "server/cli.h"
#include "server/commands.h"
#include "server/device_options.h"

typedef struct generate_opts {
    const char *prompt;
    int max_tokens, top_k, block_size, threads, chunk, ignore_eos, help;
    float temperature, top_p, min_p, repetition_penalty, presence_penalty, frequency_penalty;
    uint64_t seed;
    const char *log_level, *backend, *device, *dtype;
    char device_name[24]; /* --device with auto resolved */
} generate_opts;

static const cli_option generate_table[] = {
    {"prompt", CLI_STR, offsetof(generate_opts, prompt), NULL, 1, 0, "prompt text (required)"},
    {"max-tokens", CLI_INT, offsetof(generate_opts, max_tokens), "16", 1, 1000000, "tokens to generate"},
    {"temperature", CLI_FLOAT, offsetof(generate_opts, temperature), "0", 0, 100, "0 = greedy"},
    {"top-p", CLI_FLOAT, offsetof(generate_opts, top_p), "1", 1e-9, 1, "nucleus sampling mass"},
    {"top-k", CLI_INT, offsetof(generate_opts, top_k), "0", -1, 1000000, "keep the k most likely (0: off)"},
    {"min-p", CLI_FLOAT, offsetof(generate_opts, min_p), "0", 0, 1, "drop tokens below min_p x max prob"},
    {"repetition-penalty", CLI_FLOAT, offsetof(generate_opts, repetition_penalty), "1", 1e-9, 100,
     "penalty for tokens already seen"},
    {"presence-penalty", CLI_FLOAT, offsetof(generate_opts, presence_penalty), "0", -2, 2, ""},
    {"frequency-penalty", CLI_FLOAT, offsetof(generate_opts, frequency_penalty), "0", -2, 2, ""},
    {"seed", CLI_U64, offsetof(generate_opts, seed), "0", 1, 0, "sampling seed"},
    {"ignore-eos", CLI_BOOL, offsetof(generate_opts, ignore_eos), "false", 1, 0, "do not stop at EOS"},
    {"block-size", CLI_INT, offsetof(generate_opts, block_size), "16", 1, 1024, "KV cache block size (tokens)"},
    {"max-num-batched-tokens", CLI_INT, offsetof(generate_opts, chunk), "2048", 1, 1 << 20,
     "prefill chunk size (tokens per forward pass)"},
    {"threads", CLI_INT, offsetof(generate_opts, threads), "0", 0, 1024, "CPU threads (0: one per core)"},
    {"device", CLI_STR, offsetof(generate_opts, device), "cpu", 1, 0,
     "cpu, cuda (cuda:N for device N), auto (cuda when a GPU is visible, else cpu)"},
    {"dtype", CLI_STR, offsetof(generate_opts, dtype), "auto", 1, 0,
     "auto, half, float16, bfloat16, float, float32 (as for serve)"},
    {"backend", CLI_STR, offsetof(generate_opts, backend), NULL, 1, 0,
     "instead of --device/--dtype, a backend by name: cpu, cuda, cuda-fp16 or cuda-bf16 "
     "(cuda...:N picks device N)"},
    {"log-level", CLI_STR, offsetof(generate_opts, log_level), "info", 1, 0, "debug, info, warning, error"},
    {"help", CLI_BOOL, offsetof(generate_opts, help), "false", 1, 0, "show this help"},
};

/* Everything one generation owns; freed in one place. */
typedef struct gen_state {
    pd_backend *be;
    opt_model *model;
    tokenizer *tok;
    opt_kv_storage *kv;
    sampler *smp;
    detok_stream *detok;
    int32_t *ids, *blocks;
    float *logits;
    char *model_dir;
} gen_state;

static void gen_state_free(gen_state *g) {
    detok_stream_free(g->detok);
    sampler_free(g->smp);
    opt_kv_storage_free(g->kv);
    opt_model_free(g->model);
    pd_backend_destroy(g->be);
    tokenizer_free(g->tok);
    free(g->ids);
    free(g->blocks);
    free(g->logits);
    free(g->model_dir);
}

static int generate(const generate_opts *o, const char *model_arg, gen_state *g, pd_err *err) {
    if (resolve_model_arg(model_arg, &g->model_dir, err) != 0) return -1;
    if (tokenizer_load(g->model_dir, &g->tok, err) != 0) return -1;
    char backend[48];
    if (device_backend_for_model(o->backend, o->device_name, o->dtype, g->model_dir, backend,
                                 sizeof backend, err) != 0)
        return -1;
    if (pd_backend_create(backend, o->threads, &g->be, err) != 0) return -1;
    double t_load = pd_now();
    if (opt_model_load(g->model_dir, g->be, &g->model, err) != 0) return -1;
    const opt_config *cfg = opt_model_config(g->model);
    if (tokenizer_check_model_vocab(g->tok, cfg->vocab_size, err) != 0)
        return pd_wrap(err, "%s", g->model_dir);
    pd_log(PD_LOG_INFO, "loaded %s: %d layers, hidden %d, %.1f MB of weights in %.2f s", g->model_dir,
           cfg->num_hidden_layers, cfg->hidden_size, opt_model_weight_bytes(g->model) / 1e6,
           pd_now() - t_load);

    int n_prompt = 0;
    int32_t *prompt = NULL;
    if (tokenizer_encode(g->tok, o->prompt, strlen(o->prompt), true, &prompt, &n_prompt, err) != 0)
        return pd_wrap(err, "--prompt");
    int max_len = cfg->max_position_embeddings;
    if (n_prompt + o->max_tokens > max_len) {
        free(prompt);
        return pd_fail(err, "prompt (%d tokens) + --max-tokens (%d) exceeds the model's maximum length %d",
                       n_prompt, o->max_tokens, max_len);
    }
    int total = n_prompt + o->max_tokens;
    g->ids = realloc(prompt, sizeof(int32_t) * (size_t)total);
    if (!g->ids) {
        free(prompt);
        return pd_fail(err, "out of memory");
    }
    int bs = o->block_size, n_blocks = (total + bs - 1) / bs;
    g->blocks = malloc(sizeof(int32_t) * (size_t)n_blocks);
    g->logits = malloc(sizeof(float) * (size_t)cfg->vocab_size);
    if (!g->blocks || !g->logits) return pd_fail(err, "out of memory");
    for (int i = 0; i < n_blocks; i++) g->blocks[i] = n_blocks - 1 - i; /* any order works */
    if (opt_kv_storage_create(g->model, n_blocks, bs, &g->kv, err) != 0) return -1;

    sampling_params sp;
    sampling_params_default(&sp);
    sp.temperature = o->temperature;
    sp.top_p = o->top_p;
    sp.top_k = o->top_k;
    sp.min_p = o->min_p;
    sp.repetition_penalty = o->repetition_penalty;
    sp.presence_penalty = o->presence_penalty;
    sp.frequency_penalty = o->frequency_penalty;
    sp.has_seed = true;
    sp.seed = o->seed;
    if (sampling_params_validate(&sp, err) != 0) return -1;
    g->smp = sampler_create(&sp, cfg->vocab_size, o->seed);
    g->detok = detok_stream_create(g->tok, true);
    if (!g->smp || !g->detok) return pd_fail(err, "out of memory");
    sampler_add_prompt(g->smp, g->ids, n_prompt);

    /* Prefill in chunks of --max-num-batched-tokens; logits only for the last chunk. */
    double t0 = pd_now();
    for (int done = 0; done < n_prompt;) {
        int n = n_prompt - done < o->chunk ? n_prompt - done : o->chunk;
        opt_seq_step step = {g->ids + done, n, done, g->blocks, n_blocks, done + n == n_prompt};
        if (opt_forward(g->model, g->kv, &step, 1, g->logits, err) != 0) return -1;
        done += n;
    }
    double t1 = pd_now();
    int n_out = 0, eos = tokenizer_eos_id(g->tok);
    const char *finish = "length";
    for (;;) {
        int32_t id = sampler_sample(g->smp, g->logits);
        g->ids[n_prompt + n_out++] = id;
        if (!o->ignore_eos && id == eos) {
            finish = "stop";
            break;
        }
        size_t len;
        const char *piece = detok_stream_step(g->detok, id, &len);
        fwrite(piece, 1, len, stdout);
        fflush(stdout);
        if (n_out == o->max_tokens) break;
        opt_seq_step step = {&g->ids[n_prompt + n_out - 1], 1, n_prompt + n_out - 1, g->blocks, n_blocks, true};
        if (opt_forward(g->model, g->kv, &step, 1, g->logits, err) != 0) return -1;
    }
    double t2 = pd_now();
    putchar('\n');
    fprintf(stderr,
            "prompt: %d tokens in %.3f s (%.1f tok/s); output: %d tokens in %.3f s (%.1f tok/s); "
            "finish_reason: %s\n",
            n_prompt, t1 - t0, n_prompt / (t1 - t0 > 0 ? t1 - t0 : 1e-9), n_out, t2 - t1,
            n_out > 1 ? (n_out - 1) / (t2 - t1 > 0 ? t2 - t1 : 1e-9) : 0.0, finish);
    return 0;
}

int cmd_generate(int argc, char **argv) {
    generate_opts o;
    char *pos[1];
    int n_pos;
    pd_err err = {{0}};
    int n_table = (int)(sizeof generate_table / sizeof generate_table[0]);
    uint64_t given = 0;
    if (cli_parse(generate_table, n_table, &o, argc, argv, pos, 1, &n_pos, &given, &err) != 0 ||
        device_flags_for_command(generate_table, n_table, given, o.backend, o.device, o.dtype,
                                 o.device_name, sizeof o.device_name, &err) != 0) {
        fprintf(stderr, "pdserve generate: %s\n", err.msg);
        return 2;
    }
    if (o.help) {
        cli_print_help("pdserve generate [MODEL] --prompt TEXT [options]", generate_table, n_table);
        return 0;
    }
    pd_log_level level;
    if (pd_log_parse_level(o.log_level, &level) != 0) {
        fprintf(stderr, "pdserve generate: --log-level: unknown level '%s'\n", o.log_level);
        return 2;
    }
    pd_log_set_level(level);
    if (!o.prompt) {
        fprintf(stderr, "pdserve generate: --prompt is required\n");
        return 2;
    }
    gen_state g;
    memset(&g, 0, sizeof g);
    int rc = generate(&o, n_pos ? pos[0] : NULL, &g, &err);
    gen_state_free(&g);
    if (rc != 0) {
        fprintf(stderr, "pdserve generate: %s\n", err.msg);
        return 1;
    }
    return 0;
}
