/* serve_options: `pdserve serve` flags. See serve_options.h. */
#include "server/serve_options.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/cli.h"
#include "server/device_options.h"

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
     "auto, half, float16, bfloat16, float, float32 (CPU: always float32; CUDA: auto = bfloat16 "
     "for a bfloat16 checkpoint, else float16)"},
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
    {"gpu-memory-utilization", CLI_FLOAT, O(gpu_memory_utilization), "0.9", 1e-6, 1,
     "CUDA: fraction of the device's memory for weights, activations and KV cache (the KV "
     "cache gets what is left after a profiling step; ignored on CPU)"},
    {"kv-cache-memory-bytes", CLI_FLOAT, O(kv_cache_memory_bytes), "0", 0, 1e15,
     "KV-cache size in bytes (0: CPU 4e9; CUDA from --gpu-memory-utilization)"},
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
    {"enforce-eager", CLI_BOOL, O(enforce_eager), "false", 1, 0,
     "no CUDA graphs for decode steps (the CPU is always eager)"},
    {"async-scheduling", CLI_BOOL, O(async_scheduling), "true", 1, 0,
     "queue the next decode step before reading this one's tokens, so the host's work overlaps the "
     "GPU's (on by default, as in vLLM; --no-async-scheduling runs one step at a time)"},
    {"host-sampling", CLI_BOOL, O(host_sampling), "false", 1, 0,
     "GPU: copy logits to the host and draw there instead of on the GPU"},
    {"help", CLI_BOOL, O(help), "false", 1, 0, "show this help"},
    /* ignored */
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
#define FIRST_IGNORED_NAME "tensor-parallel-size"

/* Flags that only concern the HTTP server; `bench-throughput` (in-process,
 * no HTTP) rejects them. */
static const char *const http_only_names[] = {
    "host", "port", "served-model-name", "api-key", "max-waiting", "max-logprobs",
    "kv-transfer-config", "shutdown-timeout", "disable-log-requests", "enable-log-requests",
    "disable-fastapi-docs", "uvicorn-log-level", "max-log-len", "chat-template"};

static bool is_http_only(const char *name) {
    for (size_t i = 0; i < sizeof http_only_names / sizeof http_only_names[0]; i++)
        if (!strcmp(name, http_only_names[i])) return true;
    return false;
}

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
        n_names = 0; /* given again: the last one counts, as with argparse */
        names[n_names++] = argv[i];
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
        char *config = o->model_arg ? NULL : pd_path_join(names[i], "config.json");
        const bool is_model = config && pd_file_exists(config);
        free(config);
        if (is_model)
            /* "serve --served-model-name x DIR": the names took DIR too, and
             * the built-in model would be served under them. */
            return pd_fail(err,
                           "--served-model-name took '%s' as a name, but it is a model folder: "
                           "put MODEL first (pdserve serve MODEL --served-model-name NAME) or "
                           "give --model",
                           names[i]);
        o->names[i] = names[i];
    }
    o->n_names = n_names;
    if (pd_log_parse_level(o->log_level, &o->log_level_value) != 0)
        return pd_fail(err, "--log-level: expected debug, info, warning or error, got '%s'",
                       o->log_level);
    if (device_flags_check(o->device, o->dtype, o->device_name, sizeof o->device_name, err) != 0)
        return -1;
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
    if (serve_options_given(o, "gpu-memory-utilization") && device_is_cpu(o->device_name))
        pd_log(PD_LOG_WARN, "--gpu-memory-utilization: ignored on the CPU (the KV cache takes "
                            "--kv-cache-memory-bytes, default 4e9)");
}

bool serve_options_given(const serve_options *o, const char *name) {
    for (int i = 0; i < N_SERVE_OPTS && i < 64; i++)
        if (!strcmp(serve_table[i].name, name)) return (o->given_mask >> i) & 1;
    return false;
}

int serve_options_select_backend(serve_options *o, pd_dtype checkpoint, pd_err *err) {
    return device_select_backend(o->device_name, o->dtype, checkpoint, o->backend,
                                 sizeof o->backend, err);
}

int serve_options_parse_engine(int argc, char **argv, serve_options *o, pd_err *err) {
    if (serve_options_parse(argc, argv, o, err) != 0) return -1;
    for (int i = 0; i < N_SERVE_OPTS && i < 64; i++)
        if ((o->given_mask & ((uint64_t)1 << i)) && is_http_only(serve_table[i].name))
            return pd_fail(err, "--%s: not an option here (it only concerns the HTTP server)",
                           serve_table[i].name);
    return 0;
}

void serve_options_print_engine_options(void) {
    cli_option engine_opts[N_SERVE_OPTS];
    int n = 0;
    for (int i = 0; i < N_SERVE_OPTS; i++)
        if (!is_http_only(serve_table[i].name)) engine_opts[n++] = serve_table[i];
    cli_print_options(engine_opts, n);
}

void serve_options_to_engine(const serve_options *o, const char *model_dir, engine_config *c) {
    c->model_dir = model_dir;
    c->block_size = o->block_size;
    c->max_num_seqs = o->max_num_seqs;
    c->max_num_batched_tokens = o->max_num_batched_tokens;
    c->max_model_len = o->max_model_len_value;
    c->num_blocks_override = o->num_gpu_blocks_override;
    c->kv_cache_bytes = o->kv_cache_memory_bytes;
    c->gpu_memory_utilization = o->gpu_memory_utilization;
    c->enable_prefix_caching = o->enable_prefix_caching != 0;
    c->seed = o->seed;
    c->threads = o->threads;
    c->backend = o->backend[0] ? o->backend : NULL; /* NULL: the CPU */
    c->max_waiting = o->max_waiting;
    c->enforce_eager = o->enforce_eager != 0;
    c->async_scheduling = o->async_scheduling != 0;
    c->host_sampling = o->host_sampling != 0;
    c->kv_transfer = o->kv_transfer_config ? &o->kv_cfg : NULL;
    c->http_port = o->port;
}
