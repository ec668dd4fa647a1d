/* serve_options: `pdserve serve` flags. See serve_options.h. */
#include "server/serve_options.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/cli.h"
#ifdef PDSERVE_HAVE_CUDA
#include "model/cuda/cuda_backend.h"
#endif

#define O(f) offsetof(serve_options, f)

/* Every flag, once. Those after "ignored" are vLLM flags that have no
 * effect here (the reason is in their help); giving one logs it once. */
static const cli_option serve_table[] = {
    {"model", CLI_STR, O(model), NULL, 1, 0, "model directory or hub name (or positional MODEL)"},
    {"host", CLI_STR, O(host), NULL, 1, 0, "address to bind (default: all interfaces)"},
    {"port", CLI_INT, O(port), "8000", 0, 65535, "HTTP port (0: any free port)"},
    {"served-model-name", CLI_STR, O(served_model_name), NULL, 1, 0,
     "name(s) clients use; the first is reported (default: the model argument)"},
    {"api-key", CLI_STR, O(api_key), NULL, 1, 0,
     "require `Authorization: Bearer KEY` on /v1/* (or env VLLM_API_KEY)"},
    {"dtype", CLI_STR, O(dtype), "auto", 1, 0,
     "auto, half, float16, bfloat16, float, float32 (CPU: always float32; CUDA: auto = float32)"},
    {"device", CLI_STR, O(device), "cpu", 1, 0,
     "cpu, cuda (cuda:N for device N), auto (cuda when a GPU is visible, else cpu)"},
    {"max-model-len", CLI_STR, O(max_model_len), "auto", 1, 0,
     "context length: N, 1k (1000), 1K (1024), auto (the model's)"},
    {"block-size", CLI_INT, O(block_size), "16", 1, 256, "tokens per KV-cache block"},
    {"max-num-seqs", CLI_INT, O(max_num_seqs), "256", 1, 65536, "sequences in one engine step"},
    {"max-num-batched-tokens", CLI_INT, O(max_num_batched_tokens), "2048", 1, 1 << 24,
     "tokens in one engine step (long prompts are prefilled in chunks)"},
    {"num-gpu-blocks-override", CLI_INT, O(num_gpu_blocks_override), "0", 0, 1 << 30,
     "exactly this many KV blocks (0: size from the memory budget)"},
    {"kv-cache-memory-bytes", CLI_FLOAT, O(kv_cache_memory_bytes), "0", 0, 1e15,
     "KV-cache budget in bytes (0: the engine default)"},
    {"enable-prefix-caching", CLI_BOOL, O(enable_prefix_caching), "true", 1, 0,
     "reuse KV blocks of shared prompt prefixes (--no-enable-prefix-caching to disable)"},
    {"max-waiting", CLI_INT, O(max_waiting), "4096", 1, 1 << 24,
     "requests allowed to wait; beyond that new ones get 503"},
    {"seed", CLI_U64, O(seed), "0", 1, 0, "base seed for requests without a seed"},
    {"threads", CLI_INT, O(threads), "0", 0, 4096, "CPU threads for the model (0: one per core)"},
    {"max-logprobs", CLI_INT, O(max_logprobs), "20", 0, ENGINE_MAX_LOGPROBS,
     "largest `logprobs` a request may ask for"},
    {"kv-transfer-config", CLI_STR, O(kv_transfer_config), NULL, 1, 0,
     "JSON: disaggregated prefill/decode role (validated; acted on by the connector)"},
    {"shutdown-timeout", CLI_FLOAT, O(shutdown_timeout), "10", 0, 3600,
     "seconds in-flight requests may run after SIGINT/SIGTERM before they are aborted"},
    {"log-level", CLI_STR, O(log_level), "info", 1, 0, "debug, info, warning, error"},
    {"help", CLI_BOOL, O(help), "false", 1, 0, "show this help"},
    /* ignored */
    {"gpu-memory-utilization", CLI_FLOAT, O(gpu_memory_utilization), "0.9", 1e-6, 1,
     "ignored on CPU (use --kv-cache-memory-bytes)"},
    {"enforce-eager", CLI_BOOL, O(enforce_eager), "false", 1, 0, "ignored on CPU (always eager)"},
    {"tensor-parallel-size", CLI_INT, O(tensor_parallel_size), "1", 1, 1, "only 1"},
    {"pipeline-parallel-size", CLI_INT, O(pipeline_parallel_size), "1", 1, 1, "only 1"},
    {"enable-chunked-prefill", CLI_BOOL, O(enable_chunked_prefill), "true", 1, 0,
     "ignored (always on)"},
    {"disable-log-requests", CLI_BOOL, O(disable_log_requests), "false", 1, 0, "ignored"},
    {"enable-log-requests", CLI_BOOL, O(enable_log_requests), "false", 1, 0, "ignored"},
    {"disable-log-stats", CLI_BOOL, O(disable_log_stats), "false", 1, 0, "ignored"},
    {"trust-remote-code", CLI_BOOL, O(trust_remote_code), "false", 1, 0, "ignored (OPT only)"},
    {"disable-fastapi-docs", CLI_BOOL, O(disable_fastapi_docs), "false", 1, 0, "ignored"},
    {"tokenizer", CLI_STR, O(tokenizer), NULL, 1, 0, "ignored (the model's own tokenizer)"},
    {"revision", CLI_STR, O(revision), NULL, 1, 0, "ignored"},
    {"load-format", CLI_STR, O(load_format), NULL, 1, 0, "ignored (auto)"},
    {"download-dir", CLI_STR, O(download_dir), NULL, 1, 0, "ignored (offline)"},
    {"generation-config", CLI_STR, O(generation_config), NULL, 1, 0, "ignored"},
    {"kv-cache-dtype", CLI_STR, O(kv_cache_dtype), NULL, 1, 0, "ignored (auto)"},
    {"swap-space", CLI_FLOAT, O(swap_space), "4", 0, 1e6, "ignored"},
    {"uvicorn-log-level", CLI_STR, O(uvicorn_log_level), NULL, 1, 0, "ignored"},
    {"max-log-len", CLI_INT, O(max_log_len), "0", 0, 1 << 30, "ignored"},
    {"chat-template", CLI_STR, O(chat_template), NULL, 1, 0,
     "ignored (no chat templates: /v1/chat/completions answers 400)"},
};
#define N_SERVE_OPTS ((int)(sizeof serve_table / sizeof serve_table[0]))
/* The ignored flags start here in the table. */
#define FIRST_IGNORED_NAME "gpu-memory-utilization"

void serve_options_help(void) {
    cli_print_help("pdserve serve [MODEL] [options]", serve_table, N_SERVE_OPTS);
}

int serve_parse_max_model_len(const char *text, int *out, pd_err *err) {
    if (!text || !strcmp(text, "auto") || !strcmp(text, "-1")) {
        *out = 0;
        return 0;
    }
    char *end = NULL;
    errno = 0;
    double v = strtod(text, &end);
    if (errno || end == text || !isfinite(v) || v <= 0)
        return pd_fail(err, "--max-model-len: expected a positive length, 1k, 1K or auto, got '%s'",
                       text);
    if (*end == 'k')
        v *= 1000, end++;
    else if (*end == 'K')
        v *= 1024, end++;
    else if (*end == 'm')
        v *= 1000000, end++;
    else if (*end == 'M')
        v *= 1048576, end++;
    if (*end || v != floor(v) || v > 1 << 30)
        return pd_fail(err, "--max-model-len: expected a positive length, 1k, 1K or auto, got '%s'",
                       text);
    *out = (int)v;
    return 0;
}

int kv_transfer_config_validate(const char *json, pd_err *err) {
    kv_transfer_config c;
    return kv_transfer_config_parse(json, &c, err);
}

static const char *dtype_names[] = {"auto", "half",  "float16", "fp16", "bfloat16",
                                    "bf16", "float", "float32", "fp32"};

/* CUDA's auto dtype is float32 for now (exactly comparable with the CPU backend). */
int serve_backend_name(const char *device, const char *dtype, char *out, size_t cap, pd_err *err) {
    const char *dev = device;
    if (!strcmp(dev, "auto")) {
#ifdef PDSERVE_HAVE_CUDA
        dev = pd_cuda_device_count() > 0 ? "cuda" : "cpu";
#else
        dev = "cpu";
#endif
    }
    if (!strcmp(dev, "cpu")) {
        snprintf(out, cap, "cpu");
        return 0;
    }
    if (strncmp(dev, "cuda", 4) != 0 || (dev[4] && dev[4] != ':') || !strcmp(dev, "cuda:") ||
        strlen(dev) > 16)
        return pd_fail(err, "--device: expected auto, cpu, cuda or cuda:N, got '%s'", device);
    const char *suffix = "";
    if (!strcmp(dtype, "half") || !strcmp(dtype, "float16") || !strcmp(dtype, "fp16"))
        suffix = "-fp16";
    else if (!strcmp(dtype, "bfloat16") || !strcmp(dtype, "bf16"))
        suffix = "-bf16";
    snprintf(out, cap, "cuda%s%s", suffix, dev + 4);
    return 0;
}

int serve_options_parse(int argc, char **argv, serve_options *o, pd_err *err) {
    memset(o, 0, sizeof *o);
    /* --served-model-name takes several values (vLLM nargs="+"): gather them
     * here and hand cli_parse only the first. */
    char **args = malloc(sizeof(char *) * (size_t)(argc + 1));
    if (!args) return pd_fail(err, "out of memory");
    int n_args = 0;
    const char *names[SERVE_MAX_NAMES];
    int n_names = 0;
    for (int i = 0; i < argc; i++) {
        args[n_args++] = argv[i];
        if (strcmp(argv[i], "--served-model-name") && strcmp(argv[i], "--served_model_name"))
            continue;
        if (i + 1 >= argc) break; /* cli_parse reports the missing value */
        args[n_args++] = argv[++i];
        if (n_names < SERVE_MAX_NAMES) names[n_names++] = argv[i];
        while (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) {
            if (n_names == SERVE_MAX_NAMES) {
                free(args);
                return pd_fail(err, "--served-model-name: at most %d names", SERVE_MAX_NAMES);
            }
            names[n_names++] = argv[++i];
        }
    }
    char *pos[2] = {NULL, NULL};
    int n_pos = 0;
    uint64_t mask = 0;
    int rc = cli_parse(serve_table, N_SERVE_OPTS, o, n_args, args, pos, 1, &n_pos, &mask, err);
    free(args);
    if (rc != 0) return -1;
    o->given_mask = mask;
    if (o->help) return 0;
    if (n_pos && o->model) return pd_fail(err, "give MODEL either as an argument or with --model");
    o->model_arg = n_pos ? pos[0] : o->model;
    if (o->served_model_name && n_names == 0) names[n_names++] = o->served_model_name;
    for (int i = 0; i < n_names; i++) {
        if (!names[i][0]) return pd_fail(err, "--served-model-name: empty name");
        o->names[i] = names[i];
    }
    o->n_names = n_names;
    if (pd_log_parse_level(o->log_level, &o->log_level_value) != 0)
        return pd_fail(err, "--log-level: expected debug, info, warning or error, got '%s'",
                       o->log_level);
    int ok = 0;
    for (size_t i = 0; i < sizeof dtype_names / sizeof dtype_names[0]; i++)
        ok |= !strcmp(o->dtype, dtype_names[i]);
    if (!ok)
        return pd_fail(
            err, "--dtype: expected auto, half, float16, bfloat16, float or float32, got '%s'",
            o->dtype);
    if (serve_backend_name(o->device, o->dtype, o->backend, sizeof o->backend, err) != 0) return -1;
    int bs = o->block_size;
    if (bs != 1 && bs != 8 && bs != 16 && bs != 32 && bs != 64 && bs != 128 && bs != 256)
        return pd_fail(err, "--block-size: expected 1, 8, 16, 32, 64, 128 or 256, got %d", bs);
    if (serve_parse_max_model_len(o->max_model_len, &o->max_model_len_value, err) != 0) return -1;
    if (o->kv_transfer_config && kv_transfer_config_parse(o->kv_transfer_config, &o->kv_cfg, err) != 0)
        return -1;
    if (!o->api_key) {
        const char *env = getenv("VLLM_API_KEY");
        if (env && env[0]) o->api_key = env;
    }
    return 0;
}

void serve_options_log_ignored(const serve_options *o) {
    int first = 0;
    while (first < N_SERVE_OPTS && strcmp(serve_table[first].name, FIRST_IGNORED_NAME))
        first++;
    for (int i = first; i < N_SERVE_OPTS && i < 64; i++)
        if (o->given_mask & ((uint64_t)1 << i))
            pd_log(PD_LOG_WARN, "--%s: accepted and ignored (%s)", serve_table[i].name,
                   serve_table[i].help);
    if (!strcmp(o->backend, "cpu") && strcmp(o->dtype, "auto") && strcmp(o->dtype, "float") &&
        strcmp(o->dtype, "float32") && strcmp(o->dtype, "fp32"))
        pd_log(PD_LOG_WARN, "--dtype %s: the CPU backend computes in float32", o->dtype);
}

void serve_options_to_engine(const serve_options *o, const char *model_dir, engine_config *c) {
    c->model_dir = model_dir;
    c->block_size = o->block_size;
    c->max_num_seqs = o->max_num_seqs;
    c->max_num_batched_tokens = o->max_num_batched_tokens;
    c->max_model_len = o->max_model_len_value;
    c->num_blocks_override = o->num_gpu_blocks_override;
    if (o->kv_cache_memory_bytes > 0) c->kv_cache_bytes = o->kv_cache_memory_bytes;
    c->enable_prefix_caching = o->enable_prefix_caching != 0;
    c->seed = o->seed;
    c->threads = o->threads;
    c->backend = o->backend;
    c->max_waiting = o->max_waiting;
    c->kv_transfer = o->kv_transfer_config ? &o->kv_cfg : NULL;
    c->http_port = o->port;
}
