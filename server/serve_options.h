/* serve_options: the flags of `pdserve serve`, declared once in a cli_option
 * table, named as `vllm serve` names them. Parsing, the checks that need no
 * model (--kv-transfer-config JSON, --max-model-len "1k"/"1K"/auto) and the
 * mapping onto an engine_config. Flags vLLM has that do not apply to pdserve
 * are accepted and logged once. */
#ifndef PD_SERVER_SERVE_OPTIONS_H
#define PD_SERVER_SERVE_OPTIONS_H

#include <stdbool.h>
#include <stdint.h>

#include "common/pd_common.h"
#include "server/engine.h"

#define SERVE_MAX_NAMES 8

typedef struct serve_options {
    const char *model, *host, *dtype, *max_model_len, *served_model_name, *api_key;
    const char *kv_transfer_config, *log_level, *chat_template, *device;
    int port, block_size, max_num_seqs, max_num_batched_tokens, num_gpu_blocks_override;
    int enable_prefix_caching, enforce_eager, async_scheduling, host_sampling, max_waiting, threads, max_logprobs;
    int tensor_parallel_size, pipeline_parallel_size, help;
    int disable_log_requests, enable_log_requests, trust_remote_code, enable_chunked_prefill;
    int disable_log_stats, disable_fastapi_docs;
    const char *tokenizer, *revision, *load_format, *download_dir, *generation_config;
    const char *kv_cache_dtype, *uvicorn_log_level;
    float gpu_memory_utilization, kv_cache_memory_bytes, swap_space;
    int max_log_len;
    uint64_t seed;
    float shutdown_timeout; /* seconds in-flight requests may take to finish on SIGTERM */
    /* Derived by serve_options_parse: */
    const char *model_arg;              /* positional MODEL or --model; NULL: built-in default */
    const char *names[SERVE_MAX_NAMES]; /* --served-model-name values (nargs +) */
    int n_names;
    int max_model_len_value; /* 0: the model's own limit */
    pd_log_level log_level_value;
    uint64_t given_mask; /* bit i: table entry i was on the command line */
    kv_transfer_config kv_cfg; /* parsed --kv-transfer-config (when given) */
    char device_name[24];      /* --device with auto resolved: "cpu", "cuda", "cuda:N" */
    /* Set by serve_options_select_backend once the checkpoint's dtype is known: */
    char backend[48]; /* pd_backend_create name ("cpu", "cuda-fp16:1"...) */
} serve_options;

/* Parse argv (after "serve"). Returns 0, or -1 with err naming the flag.
 * Sets *help when --help was given. */
int serve_options_parse(int argc, char **argv, serve_options *o, pd_err *err);
void serve_options_help(void);
/* True when the flag (its table name, e.g. "gpu-memory-utilization") was on
 * the command line. */
bool serve_options_given(const serve_options *o, const char *name);
/* Log one line per accepted-but-ignored flag that was given. */
void serve_options_log_ignored(const serve_options *o);
/* Settle o->backend from --device, --dtype and the checkpoint's torch_dtype
 * (see device_options.h); logs the dtype chosen. */
int serve_options_select_backend(serve_options *o, pd_dtype checkpoint, pd_err *err);

/* The engine's flags without the HTTP server's, for in-process commands
 * (bench-throughput): serve_options_parse, then an error naming any
 * HTTP-only flag (--port, --api-key, ...) that was given. */
int serve_options_parse_engine(int argc, char **argv, serve_options *o, pd_err *err);
/* Print the option lines (no usage header) of those engine flags. */
void serve_options_print_engine_options(void);

/* "2048", "1k" (1000), "1K" (1024), "auto" / "-1" (0: the model's limit). */
int serve_parse_max_model_len(const char *text, int *out, pd_err *err);
/* Validate --kv-transfer-config JSON (see kv_transfer_config_parse). */
int kv_transfer_config_validate(const char *json, pd_err *err);

/* Copy the options into c, which the caller set with engine_config_default.
 * c->backend points into o->backend: call serve_options_select_backend first. */
void serve_options_to_engine(const serve_options *o, const char *model_dir, engine_config *c);

#endif
