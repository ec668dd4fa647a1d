/* api_completions: the /v1/completions request and response, as vLLM's
 * OpenAI-compatible server defines them — JSON body -> validated request
 * struct, stop-string matching with the streaming hold-back, and the
 * response / SSE chunk / error JSON. Pure functions: no engine, no sockets,
 * no tokenizer, so they can be unit-tested on their own. */
#ifndef PD_SERVER_API_COMPLETIONS_H
#define PD_SERVER_API_COMPLETIONS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/sampler.h"

/* An HTTP error on its way to the client: status, message, OpenAI type and
 * the offending parameter (empty when none). */
typedef struct api_error {
    int status;
    char message[512];
    char param[64];
} api_error;

/* Fill e and return -1 (as pd_fail does). param may be NULL. */
int api_fail(api_error *e, int status, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* "BadRequestError", "NotFoundError", ... for a status. */
const char *api_error_type(int status);
/* {"error":{"message","type","param","code"}} (caller frees). */
char *api_error_json(const api_error *e, size_t *len);

/* One prompt of a request: text (to be tokenized) or token ids. */
typedef struct api_prompt {
    char *text; /* NULL when the prompt came as ids */
    size_t text_len;
    int32_t *ids;
    int n_ids;
} api_prompt;

typedef enum { STOP_REASON_NONE = 0, STOP_REASON_STR, STOP_REASON_ID } stop_reason_kind;

typedef struct completion_request {
    char *model; /* NULL when absent or empty */
    api_prompt *prompts;
    int n_prompts;
    int max_tokens, min_tokens, n;
    int logprobs; /* -1: none */
    bool echo, stream, include_usage, continuous_usage;
    bool ignore_eos, add_special_tokens, skip_special_tokens, include_stop_str_in_output;
    sampling_params sampling;
    char **stop;
    int n_stop;
    int32_t *stop_ids;
    int n_stop_ids;
    char *kv_transfer_params; /* the object as compact JSON; NULL when absent or null */
} completion_request;

typedef struct api_limits {
    int max_logprobs; /* --max-logprobs (20) */
    int max_prompts;  /* prompts in one request */
    int max_n;        /* choices per prompt */
    int max_stop;     /* stop strings / stop ids */
} api_limits;

void api_limits_default(api_limits *l);

/* Parse and validate a body. Every problem is a 400 naming the field, with
 * vLLM's wording where it has one. On failure *req is left empty. */
int completion_request_parse(const char *body, size_t len, const api_limits *lim,
                             completion_request *req, api_error *e);
void completion_request_free(completion_request *req);

/* Per-prompt checks once the prompt is token ids: not empty, every id in
 * [0, vocab_size), and prompt + max_tokens within max_model_len (the
 * message says "maximum context length" with the numbers). */
int completion_check_prompt(const int32_t *ids, int n, int vocab_size, int max_tokens,
                            int max_model_len, api_error *e);

/* Stop strings. text holds the whole output so far (len bytes), of which
 * the first prev_len bytes were already checked. Returns the index of the
 * first stop string (in list order) found in the new tail, and its byte
 * offset in *at; -1 when none matched. */
int stop_find(const char *text, size_t len, size_t prev_len, char *const *stop, int n_stop,
              size_t *at);
/* How many trailing bytes of text must be held back while streaming so a
 * partial stop string is never sent: the last (longest stop, in code points)
 * - 1 characters. */
size_t stop_holdback(const char *text, size_t len, char *const *stop, int n_stop);
/* Length of the longest prefix of text that ends on a UTF-8 character boundary. */
size_t utf8_boundary(const char *text, size_t len);
/* Number of code points in text (for logprobs text_offset, which vLLM counts in characters). */
size_t utf8_chars(const char *text, size_t len);

/* Legacy completions logprobs, accumulated per choice. */
typedef struct lp_entry {
    char *token; /* decoded text of the sampled token */
    double logprob;
    bool has_logprob; /* false for the first echoed prompt token */
    int n_top;
    char **top_tokens;
    double *top_lps;
    size_t text_offset;
} lp_entry;

typedef struct lp_list {
    lp_entry *items;
    int n, cap;
} lp_list;

/* Append one entry; token and top_tokens are copied. n_top may be 0 and
 * has_logprob false (then top_logprobs is null for it). */
int lp_list_add(lp_list *l, const char *token, size_t text_offset, bool has_logprob, double logprob,
                int n_top, const char *const *top_tokens, const double *top_lps);
void lp_list_clear(lp_list *l);
/* Write {"text_offset":[...],"token_logprobs":[...],"tokens":[...],"top_logprobs":[...]}
 * for entries [from, l->n). Logprobs are clamped to >= -9999; tokens that
 * decode alike collapse into one top_logprobs key (first one wins). */
struct pd_buf;
void lp_list_write(struct pd_buf *b, const lp_list *l, int from);

/* What one choice ended up as (non-streaming), or one delta (streaming). */
typedef struct choice_view {
    int index;
    const char *text;
    size_t text_len;
    const lp_list *logprobs;   /* NULL: "logprobs": null */
    int lp_from;               /* first entry of logprobs to write */
    const char *finish_reason; /* NULL while running */
    stop_reason_kind stop_kind;
    const char *stop_str;
    int32_t stop_id;
} choice_view;

typedef struct completion_meta {
    const char *id; /* "cmpl-..." */
    long long created;
    const char *model;
} completion_meta;

/* The non-streaming response body (caller frees). */
char *completion_response_json(const completion_meta *m, const choice_view *choices, int n_choices,
                               long long prompt_tokens, long long completion_tokens,
                               const char *kv_transfer_params, size_t *len);
/* One SSE event `data: {...}\n\n` with one choice; usage (when non-NULL,
 * continuous_usage_stats) is appended to the chunk. Caller frees. */
char *completion_chunk_sse(const completion_meta *m, const choice_view *c, const long long *usage2,
                           size_t *len);
/* The include_usage event: choices [] and the totals. */
char *completion_usage_sse(const completion_meta *m, long long prompt_tokens,
                           long long completion_tokens, size_t *len);
/* data: {"error":{...}}\n\n */
char *api_error_sse(const api_error *e, size_t *len);

/* "cmpl-" + 32 hex digits from a caller-supplied 128-bit value. */
void completion_make_id(char out[40], uint64_t hi, uint64_t lo);

#endif
