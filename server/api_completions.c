/* api_completions: /v1/completions request parsing and validation, stop
 * strings, logprobs and the response / SSE JSON. See api_completions.h. */
#include "server/api_completions.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/api_json.h"

int api_fail(api_error *e, int status, const char *param, const char *fmt, ...) {
    if (!e) return -1;
    e->status = status;
    snprintf(e->param, sizeof e->param, "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
    return -1;
}

const char *api_error_type(int status) {
    switch (status) {
    case 400:
        return "BadRequestError";
    case 401:
        return "AuthenticationError";
    case 404:
        return "NotFoundError";
    case 405:
        return "MethodNotAllowed";
    case 413:
        return "RequestEntityTooLarge";
    case 501:
        return "NotImplementedError";
    case 502: /* the KV hand-off to or from a peer failed (pdproxy uses the same names) */
        return "BadGatewayError";
    case 503:
        return "ServiceUnavailableError";
    case 504: /* a decode instance waited kv timeout_s for KV that never came */
        return "GatewayTimeoutError";
    default:
        return status >= 500 ? "InternalServerError" : "BadRequestError";
    }
}

static void write_error_object(pd_buf *b, const api_error *e) {
    pd_buf_puts(b, "{\"error\":{\"message\":");
    jb_cstr(b, e->message);
    pd_buf_puts(b, ",\"type\":");
    jb_cstr(b, api_error_type(e->status));
    pd_buf_puts(b, ",\"param\":");
    jb_cstr(b, e->param[0] ? e->param : NULL);
    pd_buf_printf(b, ",\"code\":%d}}", e->status);
}

char *api_error_json(const api_error *e, size_t *len) {
    pd_buf b;
    pd_buf_init(&b);
    write_error_object(&b, e);
    return pd_buf_take(&b, len);
}

char *api_error_sse(const api_error *e, size_t *len) {
    pd_buf b;
    pd_buf_init(&b);
    pd_buf_puts(&b, "data: ");
    write_error_object(&b, e);
    pd_buf_puts(&b, "\n\n");
    return pd_buf_take(&b, len);
}

void api_limits_default(api_limits *l) {
    l->max_logprobs = 20;
    l->max_prompts = 1024;
    l->max_n = 128;
    l->max_stop = 64;
}

/* ---- request parsing ---------------------------------------------------- */

/* Reads an optional field; absent and null both leave the default. */
static cJSON *field(const cJSON *root, const char *name) {
    cJSON *v = cJSON_GetObjectItemCaseSensitive(root, name);
    return v && !cJSON_IsNull(v) ? v : NULL;
}

static int is_int_value(const cJSON *v, double lo, double hi) {
    if (!cJSON_IsNumber(v)) return 0;
    double d = v->valuedouble;
    return isfinite(d) && d == floor(d) && d >= lo && d <= hi;
}

static int get_int(const cJSON *root, const char *name, int *out, api_error *e) {
    cJSON *v = field(root, name);
    if (!v) return 0;
    if (!cJSON_IsNumber(v) || !is_int_value(v, -2147483648.0, 2147483647.0))
        return api_fail(e, 400, name, "%s: Input should be a valid integer that fits in 32 bits",
                        name);
    *out = (int)v->valuedouble;
    return 0;
}

static int get_float(const cJSON *root, const char *name, float *out, api_error *e) {
    cJSON *v = field(root, name);
    if (!v) return 0;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || fabs(v->valuedouble) > 3.0e38)
        return api_fail(e, 400, name, "%s: Input should be a valid finite number", name);
    *out = (float)v->valuedouble;
    return 0;
}

static int get_bool(const cJSON *root, const char *name, bool *out, api_error *e) {
    cJSON *v = field(root, name);
    if (!v) return 0;
    if (!cJSON_IsBool(v))
        return api_fail(e, 400, name, "%s: Input should be a valid boolean", name);
    *out = cJSON_IsTrue(v);
    return 0;
}

static bool valid_utf8(const char *s, size_t n) {
    const unsigned char *p = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        unsigned c = p[i];
        size_t len;
        unsigned cp, min;
        if (c < 0x80) {
            i++;
            continue;
        }
        if (c >= 0xC2 && c <= 0xDF)
            len = 2, min = 0x80;
        else if (c >= 0xE0 && c <= 0xEF)
            len = 3, min = 0x800;
        else if (c >= 0xF0 && c <= 0xF4)
            len = 4, min = 0x10000;
        else
            return false;
        if (i + len > n) return false;
        cp = c & (0x3F >> (len - 1));
        for (size_t k = 1; k < len; k++) {
            if ((p[i + k] & 0xC0) != 0x80) return false;
            cp = (cp << 6) | (p[i + k] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
        i += len;
    }
    return true;
}

static int ids_from_array(const cJSON *arr, const char *param, int32_t **ids, int *n,
                          api_error *e) {
    int count = cJSON_GetArraySize(arr);
    if (count == 0)
        return api_fail(e, 400, param,
                        "Either prompt or prompt_embeds must be provided and non-empty.");
    *ids = malloc(sizeof(int32_t) * (size_t)count);
    if (!*ids) return api_fail(e, 500, NULL, "out of memory");
    int i = 0;
    for (const cJSON *it = arr->child; it; it = it->next, i++) {
        if (!is_int_value(it, -2147483648.0, 2147483647.0))
            return api_fail(e, 400, param, "%s[%d]: Input should be a valid integer token id",
                            param, i);
        if (it->valuedouble < 0)
            return api_fail(e, 400, param, "%s[%d]: token ids must be >= 0, got %.0f", param, i,
                            it->valuedouble);
        (*ids)[i] = (int32_t)it->valuedouble;
    }
    *n = count;
    return 0;
}

static int prompt_from_string(const cJSON *s, const char *param, api_prompt *p, api_error *e) {
    size_t n = strlen(s->valuestring);
    if (n == 0)
        return api_fail(e, 400, param,
                        "Either prompt or prompt_embeds must be provided and non-empty.");
    if (!valid_utf8(s->valuestring, n))
        return api_fail(e, 400, param, "%s: the text is not valid UTF-8", param);
    p->text = strdup(s->valuestring);
    if (!p->text) return api_fail(e, 500, NULL, "out of memory");
    p->text_len = n;
    return 0;
}

static int parse_prompt(const cJSON *root, const api_limits *lim, completion_request *r,
                        api_error *e) {
    cJSON *v = field(root, "prompt");
    if (!v)
        return api_fail(e, 400, "prompt",
                        "Either prompt or prompt_embeds must be provided and non-empty.");
    if (cJSON_IsString(v)) {
        r->prompts = calloc(1, sizeof(api_prompt));
        if (!r->prompts) return api_fail(e, 500, NULL, "out of memory");
        r->n_prompts = 1;
        return prompt_from_string(v, "prompt", &r->prompts[0], e);
    }
    if (!cJSON_IsArray(v))
        return api_fail(e, 400, "prompt",
                        "prompt: Input should be a string, a list of strings, a list of token "
                        "ids or a list of lists of token ids");
    int count = cJSON_GetArraySize(v);
    if (count == 0)
        return api_fail(e, 400, "prompt",
                        "Either prompt or prompt_embeds must be provided and non-empty.");
    const cJSON *first = v->child;
    if (cJSON_IsNumber(first)) { /* one pre-tokenized prompt */
        r->prompts = calloc(1, sizeof(api_prompt));
        if (!r->prompts) return api_fail(e, 500, NULL, "out of memory");
        r->n_prompts = 1;
        return ids_from_array(v, "prompt", &r->prompts[0].ids, &r->prompts[0].n_ids, e);
    }
    if (count > lim->max_prompts)
        return api_fail(e, 400, "prompt", "prompt: at most %d prompts per request, got %d",
                        lim->max_prompts, count);
    r->prompts = calloc((size_t)count, sizeof(api_prompt));
    if (!r->prompts) return api_fail(e, 500, NULL, "out of memory");
    r->n_prompts = count;
    int i = 0;
    for (const cJSON *it = first; it; it = it->next, i++) {
        char param[40];
        snprintf(param, sizeof param, "prompt[%d]", i);
        if (cJSON_IsString(first) && cJSON_IsString(it)) {
            if (prompt_from_string(it, param, &r->prompts[i], e) != 0) return -1;
        } else if (cJSON_IsArray(first) && cJSON_IsArray(it)) {
            if (ids_from_array(it, param, &r->prompts[i].ids, &r->prompts[i].n_ids, e) != 0)
                return -1;
        } else {
            return api_fail(e, 400, "prompt",
                            "%s: a prompt list must hold only strings or only lists of token ids",
                            param);
        }
    }
    return 0;
}

static int parse_stop(const cJSON *root, const api_limits *lim, completion_request *r,
                      api_error *e) {
    cJSON *v = field(root, "stop");
    if (v) {
        int count = cJSON_IsString(v) ? 1 : cJSON_IsArray(v) ? cJSON_GetArraySize(v) : -1;
        if (count < 0)
            return api_fail(e, 400, "stop", "stop: Input should be a string or a list of strings");
        if (count > lim->max_stop)
            return api_fail(e, 400, "stop", "stop: at most %d stop strings, got %d", lim->max_stop,
                            count);
        r->stop = calloc((size_t)count + 1, sizeof(char *));
        if (!r->stop) return api_fail(e, 500, NULL, "out of memory");
        const cJSON *it = cJSON_IsString(v) ? v : v->child;
        for (int i = 0; i < count; i++, it = it->next) {
            if (!cJSON_IsString(it))
                return api_fail(e, 400, "stop", "stop[%d]: Input should be a valid string", i);
            if (!it->valuestring[0])
                return api_fail(e, 400, "stop", "stop cannot contain an empty string.");
            if (!valid_utf8(it->valuestring, strlen(it->valuestring)))
                return api_fail(e, 400, "stop", "stop[%d]: the text is not valid UTF-8", i);
            r->stop[i] = strdup(it->valuestring);
            if (!r->stop[i]) return api_fail(e, 500, NULL, "out of memory");
            r->n_stop = i + 1;
        }
    }
    v = field(root, "stop_token_ids");
    if (v) {
        if (!cJSON_IsArray(v))
            return api_fail(e, 400, "stop_token_ids",
                            "stop_token_ids: Input should be a list of integers");
        int count = cJSON_GetArraySize(v);
        if (count > lim->max_stop)
            return api_fail(e, 400, "stop_token_ids", "stop_token_ids: at most %d ids, got %d",
                            lim->max_stop, count);
        if (count == 0) return 0;
        r->stop_ids = malloc(sizeof(int32_t) * (size_t)count);
        if (!r->stop_ids) return api_fail(e, 500, NULL, "out of memory");
        int i = 0;
        for (const cJSON *it = v->child; it; it = it->next, i++) {
            if (!is_int_value(it, 0, 2147483647.0))
                return api_fail(e, 400, "stop_token_ids",
                                "stop_token_ids[%d]: Input should be a non-negative integer", i);
            r->stop_ids[i] = (int32_t)it->valuedouble;
        }
        r->n_stop_ids = count;
    }
    return 0;
}

static int parse_sampling(const cJSON *root, completion_request *r, api_error *e) {
    sampling_params *s = &r->sampling;
    memset(s, 0, sizeof *s);
    s->temperature = 1.0f;
    s->top_p = 1.0f;
    s->top_k = 0;
    s->min_p = 0.0f;
    s->repetition_penalty = 1.0f;
    if (get_float(root, "temperature", &s->temperature, e) != 0 ||
        get_float(root, "top_p", &s->top_p, e) != 0 || get_int(root, "top_k", &s->top_k, e) != 0 ||
        get_float(root, "min_p", &s->min_p, e) != 0 ||
        get_float(root, "presence_penalty", &s->presence_penalty, e) != 0 ||
        get_float(root, "frequency_penalty", &s->frequency_penalty, e) != 0 ||
        get_float(root, "repetition_penalty", &s->repetition_penalty, e) != 0)
        return -1;
    if (s->temperature < 0)
        return api_fail(e, 400, "temperature", "temperature must be non-negative, got %g.",
                        s->temperature);
    if (!(s->top_p > 0 && s->top_p <= 1))
        return api_fail(e, 400, "top_p", "top_p must be in (0, 1], got %g.", s->top_p);
    if (s->top_k < -1)
        return api_fail(e, 400, "top_k", "top_k must be 0 (disable), or at least 1, got %d.",
                        s->top_k);
    if (s->top_k == -1) s->top_k = 0;
    if (s->min_p < 0 || s->min_p > 1)
        return api_fail(e, 400, "min_p", "min_p must be in [0, 1], got %g.", s->min_p);
    if (s->presence_penalty < -2 || s->presence_penalty > 2)
        return api_fail(e, 400, "presence_penalty", "presence_penalty must be in [-2, 2], got %g.",
                        s->presence_penalty);
    if (s->frequency_penalty < -2 || s->frequency_penalty > 2)
        return api_fail(e, 400, "frequency_penalty",
                        "frequency_penalty must be in [-2, 2], got %g.", s->frequency_penalty);
    if (!(s->repetition_penalty > 0))
        return api_fail(e, 400, "repetition_penalty",
                        "repetition_penalty must be greater than zero, got %g.",
                        s->repetition_penalty);
    cJSON *seed = field(root, "seed");
    if (seed) {
        /* 2^63 itself is a double, but no int64: the bound is the last double below it. */
        if (!is_int_value(seed, -9223372036854775808.0, 9223372036854774784.0))
            return api_fail(e, 400, "seed", "seed: Input should be a valid 64-bit integer");
        s->has_seed = true;
        s->seed = (uint64_t)(int64_t)seed->valuedouble;
    }
    return 0;
}

static int parse_logprobs(const cJSON *root, const api_limits *lim, completion_request *r,
                          api_error *e) {
    r->logprobs = -1;
    cJSON *v = field(root, "logprobs");
    if (!v) return 0;
    if (!is_int_value(v, -2147483648.0, 2147483647.0))
        return api_fail(e, 400, "logprobs", "`logprobs` must be an integer.");
    int lp = (int)v->valuedouble;
    if (lp < -1) return api_fail(e, 400, "logprobs", "`logprobs` must be a positive value or -1.");
    if (lp == -1 || lp > lim->max_logprobs)
        return api_fail(e, 400, "logprobs",
                        "Requested sample logprobs of %d, which is greater than max allowed: %d",
                        lp, lim->max_logprobs);
    r->logprobs = lp;
    return 0;
}

static int parse_stream(const cJSON *root, completion_request *r, api_error *e) {
    if (get_bool(root, "stream", &r->stream, e) != 0) return -1;
    cJSON *so = field(root, "stream_options");
    if (!so) return 0;
    if (!cJSON_IsObject(so))
        return api_fail(e, 400, "stream_options", "stream_options: Input should be an object");
    if (!r->stream)
        return api_fail(e, 400, "stream_options",
                        "Stream options can only be defined when `stream=True`.");
    r->include_usage = true; /* vLLM's default inside a given stream_options */
    if (get_bool(so, "include_usage", &r->include_usage, e) != 0 ||
        get_bool(so, "continuous_usage_stats", &r->continuous_usage, e) != 0) {
        char inner[sizeof e->message]; /* api_fail writes e->message */
        snprintf(inner, sizeof inner, "%s", e->message);
        return api_fail(e, 400, "stream_options", "stream_options: %s", inner);
    }
    return 0;
}

/* Fields vLLM knows whose effect pdserve does not implement: a request that
 * actually uses one is refused rather than silently answered differently. */
static int reject_unsupported(const cJSON *root, api_error *e) {
    cJSON *v = field(root, "prompt_logprobs");
    if (v) {
        bool stream = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(root, "stream"));
        if (stream)
            return api_fail(e, 400, "prompt_logprobs",
                            "`prompt_logprobs` are not available when `stream=True`.");
        return api_fail(e, 400, "prompt_logprobs", "`prompt_logprobs` is not supported by pdserve");
    }
    v = field(root, "logit_bias");
    if (v && !(cJSON_IsObject(v) && !v->child))
        return api_fail(e, 400, "logit_bias", "logit_bias is not supported by pdserve");
    v = field(root, "use_beam_search");
    if (v && cJSON_IsTrue(v))
        return api_fail(e, 400, "use_beam_search", "beam search is not supported by pdserve");
    v = field(root, "user");
    if (v && !cJSON_IsString(v))
        return api_fail(e, 400, "user", "user: Input should be a valid string");
    return 0;
}

static int parse_fields(const cJSON *root, const api_limits *lim, completion_request *r,
                        api_error *e) {
    if (!cJSON_IsObject(root))
        return api_fail(e, 400, NULL, "the request body must be a JSON object");
    cJSON *m = field(root, "model");
    if (m) {
        if (!cJSON_IsString(m)) return api_fail(e, 400, "model", "model: Input should be a string");
        if (m->valuestring[0] && !(r->model = strdup(m->valuestring)))
            return api_fail(e, 500, NULL, "out of memory");
    }
    r->max_tokens = 16;
    r->n = 1;
    r->add_special_tokens = true;
    r->skip_special_tokens = true;
    if (reject_unsupported(root, e) != 0 || parse_prompt(root, lim, r, e) != 0 ||
        get_int(root, "max_tokens", &r->max_tokens, e) != 0 ||
        get_int(root, "min_tokens", &r->min_tokens, e) != 0 || get_int(root, "n", &r->n, e) != 0 ||
        get_bool(root, "echo", &r->echo, e) != 0 ||
        get_bool(root, "ignore_eos", &r->ignore_eos, e) != 0 ||
        get_bool(root, "add_special_tokens", &r->add_special_tokens, e) != 0 ||
        get_bool(root, "skip_special_tokens", &r->skip_special_tokens, e) != 0 ||
        get_bool(root, "include_stop_str_in_output", &r->include_stop_str_in_output, e) != 0 ||
        parse_stream(root, r, e) != 0 || parse_logprobs(root, lim, r, e) != 0 ||
        parse_sampling(root, r, e) != 0 || parse_stop(root, lim, r, e) != 0)
        return -1;
    if (r->max_tokens < 1 && !(r->echo && r->max_tokens == 0))
        return api_fail(e, 400, "max_tokens", "max_tokens must be at least 1, got %d.",
                        r->max_tokens);
    if (r->min_tokens < 0)
        return api_fail(e, 400, "min_tokens",
                        "min_tokens must be greater than or equal to 0, got %d.", r->min_tokens);
    if (r->min_tokens > r->max_tokens)
        return api_fail(e, 400, "min_tokens",
                        "min_tokens must be less than or equal to max_tokens=%d, got %d.",
                        r->max_tokens, r->min_tokens);
    if (r->n < 1) return api_fail(e, 400, "n", "n must be at least 1, got %d.", r->n);
    if (r->n > lim->max_n)
        return api_fail(e, 400, "n", "n must be at most %d, got %d.", lim->max_n, r->n);
    if ((long long)r->n * r->n_prompts > lim->max_prompts)
        return api_fail(e, 400, "n", "prompts x n must be at most %d, got %lld", lim->max_prompts,
                        (long long)r->n * r->n_prompts);
    cJSON *kv = cJSON_GetObjectItemCaseSensitive(root, "kv_transfer_params");
    if (kv && !cJSON_IsNull(kv)) {
        if (!cJSON_IsObject(kv))
            return api_fail(e, 400, "kv_transfer_params",
                            "kv_transfer_params: Input should be an object");
        if (!(r->kv_transfer_params = cJSON_PrintUnformatted(kv)))
            return api_fail(e, 500, NULL, "out of memory");
    }
    return 0;
}

/* The value of the \uXXXX escape at p (6 bytes there), or -1. */
static int u_escape(const char *p, size_t left) {
    if (left < 6 || p[0] != '\\' || p[1] != 'u') return -1;
    int v = 0;
    for (int k = 2; k < 6; k++) {
        char c = p[k];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                       : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

/* Walks a JSON text's escapes, one by one (so "\\u0000", an escaped
 * backslash and then text, is none), for the byte offsets of the first
 * escaped NUL character (cJSON's strings end there, so the rest would
 * vanish quietly) and of the first half of a UTF-16 surrogate pair
 * without its other half (cJSON refuses it; Python's json takes it); -1
 * where there is none. */
static void find_odd_escapes(const char *body, size_t len, long *nul_at, long *lone_at) {
    *nul_at = *lone_at = -1;
    for (size_t i = 0; i + 1 < len && (*nul_at < 0 || *lone_at < 0); i++) {
        if (body[i] != '\\') continue;
        int v = u_escape(body + i, len - i);
        if (v < 0) {
            i++; /* the escaped character */
            continue;
        }
        if (v == 0 && *nul_at < 0) *nul_at = (long)i;
        if (v >= 0xDC00 && v <= 0xDFFF && *lone_at < 0) *lone_at = (long)i;
        if (v >= 0xD800 && v <= 0xDBFF) {
            int low = i + 6 < len ? u_escape(body + i + 6, len - i - 6) : -1;
            if (low >= 0xDC00 && low <= 0xDFFF)
                i += 6;
            else if (*lone_at < 0)
                *lone_at = (long)i;
        }
        i += 5;
    }
}

int completion_request_parse(const char *body, size_t len, const api_limits *lim,
                             completion_request *req, api_error *e) {
    memset(req, 0, sizeof *req);
    long nul_at, lone_at;
    find_odd_escapes(body, len, &nul_at, &lone_at);
    if (nul_at >= 0)
        return api_fail(e, 400, NULL,
                        "the request has a NUL character (\\u0000) in a string, which pdserve "
                        "does not take");
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(body, len, &end, 0);
    if (!root) {
        if (lone_at >= 0)
            return api_fail(e, 400, NULL,
                            "the request body is not valid JSON: the escape %.6s at byte %ld is "
                            "half of a UTF-16 surrogate pair without its other half",
                            body + lone_at, lone_at);
        size_t at = end && end >= body ? (size_t)(end - body) : 0;
        return api_fail(e, 400, NULL, "the request body is not valid JSON (error near byte %zu)",
                        at);
    }
    /* cJSON stops at the end of the first value; anything but whitespace after it is an error. */
    size_t value_end = (size_t)(end - body);
    size_t trail = value_end + pd_json_space(end, len - value_end);
    if (trail < len) {
        cJSON_Delete(root);
        return api_fail(e, 400, NULL,
                        "the request body is not valid JSON (trailing data at byte %zu)", trail);
    }
    int rc = parse_fields(root, lim, req, e);
    cJSON_Delete(root);
    if (rc != 0) completion_request_free(req);
    return rc;
}

void completion_request_free(completion_request *r) {
    for (int i = 0; i < r->n_prompts; i++) {
        free(r->prompts[i].text);
        free(r->prompts[i].ids);
    }
    free(r->prompts);
    for (int i = 0; i < r->n_stop; i++)
        free(r->stop[i]);
    free(r->stop);
    free(r->stop_ids);
    free(r->model);
    cJSON_free(r->kv_transfer_params);
    memset(r, 0, sizeof *r);
}

int completion_check_prompt(const int32_t *ids, int n, int vocab_size, int max_tokens,
                            int max_model_len, api_error *e) {
    if (n <= 0) return api_fail(e, 400, "prompt", "The decoder prompt cannot be empty");
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= vocab_size)
            return api_fail(e, 400, "prompt", "Token id %d is out of vocabulary", ids[i]);
    if (n >= max_model_len)
        return api_fail(e, 400, "prompt",
                        "This model's maximum context length is %d tokens. However, your request "
                        "has %d input tokens. Please reduce the length of the input messages.",
                        max_model_len, n);
    if ((long long)n + max_tokens > max_model_len)
        return api_fail(e, 400, "max_tokens",
                        "'max_tokens' or 'max_completion_tokens' is too large: %d. This model's "
                        "maximum context length is %d tokens and your request has %d input "
                        "tokens (%d > %d - %d).",
                        max_tokens, max_model_len, n, max_tokens, max_model_len, n);
    return 0;
}

/* ---- stop strings ------------------------------------------------------- */

int stop_find(const char *text, size_t len, size_t prev_len, char *const *stop, int n_stop,
              size_t *at) {
    for (int i = 0; i < n_stop; i++) {
        size_t sl = strlen(stop[i]);
        if (sl == 0 || sl > len) continue;
        /* Only a match that ends in the new bytes can be new. */
        size_t from = prev_len + 1 > sl ? prev_len + 1 - sl : 0;
        const char *hit = memmem(text + from, len - from, stop[i], sl);
        if (hit) {
            *at = (size_t)(hit - text);
            return i;
        }
    }
    return -1;
}

size_t utf8_chars(const char *text, size_t len) {
    size_t n = 0;
    for (size_t i = 0; i < len; i++)
        if (((unsigned char)text[i] & 0xC0) != 0x80) n++;
    return n;
}

size_t stop_holdback(const char *text, size_t len, char *const *stop, int n_stop) {
    size_t longest = 0;
    for (int i = 0; i < n_stop; i++) {
        size_t c = utf8_chars(stop[i], strlen(stop[i]));
        if (c > longest) longest = c;
    }
    if (longest <= 1) return 0;
    size_t keep = longest - 1, i = len;
    /* Walk back over `keep` characters. */
    while (i > 0 && keep > 0) {
        i--;
        if (((unsigned char)text[i] & 0xC0) != 0x80) keep--;
    }
    return len - i;
}

size_t utf8_boundary(const char *text, size_t len) {
    /* Look at most 3 bytes back for the start of a trailing sequence. */
    for (size_t back = 1; back <= 4 && back <= len; back++) {
        unsigned char c = (unsigned char)text[len - back];
        if ((c & 0xC0) == 0x80) continue; /* continuation byte */
        size_t need = c < 0x80             ? 1
                      : (c & 0xE0) == 0xC0 ? 2
                      : (c & 0xF0) == 0xE0 ? 3
                      : (c & 0xF8) == 0xF0 ? 4
                                           : 1;
        return back >= need ? len : len - back;
    }
    return len;
}

/* ---- logprobs ----------------------------------------------------------- */

int lp_list_add(lp_list *l, const char *token, size_t text_offset, bool has_logprob, double logprob,
                int n_top, const char *const *top_tokens, const double *top_lps) {
    if (l->n == l->cap) {
        int cap = l->cap ? l->cap * 2 : 16;
        lp_entry *it = realloc(l->items, sizeof(lp_entry) * (size_t)cap);
        if (!it) return -1;
        l->items = it;
        l->cap = cap;
    }
    lp_entry *x = &l->items[l->n];
    memset(x, 0, sizeof *x);
    x->token = strdup(token ? token : "");
    x->has_logprob = has_logprob;
    x->logprob = logprob;
    x->text_offset = text_offset;
    if (!x->token) return -1;
    if (has_logprob && n_top > 0) {
        x->top_tokens = calloc((size_t)n_top, sizeof(char *));
        x->top_lps = malloc(sizeof(double) * (size_t)n_top);
        if (!x->top_tokens || !x->top_lps) {
            free(x->top_tokens);
            free(x->top_lps);
            free(x->token);
            return -1;
        }
        for (int i = 0; i < n_top; i++) {
            x->top_tokens[i] = strdup(top_tokens[i] ? top_tokens[i] : "");
            x->top_lps[i] = top_lps[i];
        }
        x->n_top = n_top;
    }
    l->n++;
    return 0;
}

void lp_list_clear(lp_list *l) {
    for (int i = 0; i < l->n; i++) {
        lp_entry *x = &l->items[i];
        free(x->token);
        for (int k = 0; k < x->n_top; k++)
            free(x->top_tokens[k]);
        free(x->top_tokens);
        free(x->top_lps);
    }
    free(l->items);
    memset(l, 0, sizeof *l);
}

static double lp_clamp(double v) {
    return isnan(v) ? -9999.0 : v < -9999.0 ? -9999.0 : v;
}

void lp_list_write(pd_buf *b, const lp_list *l, int from) {
    pd_buf_puts(b, "{\"text_offset\":[");
    for (int i = from; i < l->n; i++)
        pd_buf_printf(b, "%s%zu", i > from ? "," : "", l->items[i].text_offset);
    pd_buf_puts(b, "],\"token_logprobs\":[");
    for (int i = from; i < l->n; i++) {
        if (i > from) pd_buf_puts(b, ",");
        if (l->items[i].has_logprob)
            jb_num(b, lp_clamp(l->items[i].logprob));
        else
            pd_buf_puts(b, "null");
    }
    pd_buf_puts(b, "],\"tokens\":[");
    for (int i = from; i < l->n; i++) {
        if (i > from) pd_buf_puts(b, ",");
        jb_cstr(b, l->items[i].token);
    }
    pd_buf_puts(b, "],\"top_logprobs\":[");
    for (int i = from; i < l->n; i++) {
        const lp_entry *x = &l->items[i];
        if (i > from) pd_buf_puts(b, ",");
        if (!x->has_logprob) {
            pd_buf_puts(b, "null");
            continue;
        }
        pd_buf_puts(b, "{");
        int written = 0;
        for (int k = 0; k < x->n_top; k++) {
            int dup = 0;
            for (int j = 0; j < k && !dup; j++)
                dup = !strcmp(x->top_tokens[j], x->top_tokens[k]);
            if (dup) continue;
            if (written++) pd_buf_puts(b, ",");
            jb_key(b, x->top_tokens[k]);
            jb_num(b, lp_clamp(x->top_lps[k]));
        }
        pd_buf_puts(b, "}");
    }
    pd_buf_puts(b, "]}");
}

/* ---- responses ---------------------------------------------------------- */

static void write_head(pd_buf *b, const completion_meta *m) {
    pd_buf_puts(b, "{\"id\":");
    jb_cstr(b, m->id);
    pd_buf_puts(b, ",\"object\":\"text_completion\",\"created\":");
    jb_int(b, m->created);
    pd_buf_puts(b, ",\"model\":");
    jb_cstr(b, m->model);
}

static void write_choice(pd_buf *b, const choice_view *c, bool full) {
    pd_buf_printf(b, "{\"index\":%d,\"text\":", c->index);
    jb_str(b, c->text ? c->text : "", c->text ? c->text_len : 0);
    pd_buf_puts(b, ",\"logprobs\":");
    if (c->logprobs)
        lp_list_write(b, c->logprobs, c->lp_from);
    else
        pd_buf_puts(b, "null");
    pd_buf_puts(b, ",\"finish_reason\":");
    jb_cstr(b, c->finish_reason);
    pd_buf_puts(b, ",\"stop_reason\":");
    if (c->stop_kind == STOP_REASON_STR)
        jb_cstr(b, c->stop_str);
    else if (c->stop_kind == STOP_REASON_ID)
        jb_int(b, c->stop_id);
    else
        pd_buf_puts(b, "null");
    if (full)
        pd_buf_puts(b, ",\"prompt_logprobs\":null,\"prompt_token_ids\":null,\"token_ids\":null");
    pd_buf_puts(b, "}");
}

static void write_usage(pd_buf *b, long long p, long long c, bool details) {
    pd_buf_printf(b, "{\"prompt_tokens\":%lld,\"total_tokens\":%lld,\"completion_tokens\":%lld%s}",
                  p, p + c, c, details ? ",\"prompt_tokens_details\":null" : "");
}

char *completion_response_json(const completion_meta *m, const choice_view *choices, int n_choices,
                               long long prompt_tokens, long long completion_tokens,
                               const char *kv_transfer_params, size_t *len) {
    pd_buf b;
    pd_buf_init(&b);
    write_head(&b, m);
    pd_buf_puts(&b, ",\"choices\":[");
    for (int i = 0; i < n_choices; i++) {
        if (i) pd_buf_puts(&b, ",");
        write_choice(&b, &choices[i], true);
    }
    pd_buf_puts(&b, "],\"service_tier\":null,\"system_fingerprint\":null,\"usage\":");
    write_usage(&b, prompt_tokens, completion_tokens, true);
    pd_buf_puts(&b, ",\"kv_transfer_params\":");
    pd_buf_puts(&b, kv_transfer_params ? kv_transfer_params : "null");
    pd_buf_puts(&b, "}");
    return pd_buf_take(&b, len);
}

char *completion_chunk_sse(const completion_meta *m, const choice_view *c, const long long *usage2,
                           size_t *len) {
    pd_buf b;
    pd_buf_init(&b);
    pd_buf_puts(&b, "data: ");
    write_head(&b, m);
    pd_buf_puts(&b, ",\"choices\":[");
    write_choice(&b, c, false);
    pd_buf_puts(&b, "]");
    if (usage2) {
        pd_buf_puts(&b, ",\"usage\":");
        write_usage(&b, usage2[0], usage2[1], false);
    }
    pd_buf_puts(&b, "}\n\n");
    return pd_buf_take(&b, len);
}

char *completion_usage_sse(const completion_meta *m, long long prompt_tokens,
                           long long completion_tokens, size_t *len) {
    pd_buf b;
    pd_buf_init(&b);
    pd_buf_puts(&b, "data: ");
    write_head(&b, m);
    pd_buf_puts(&b, ",\"choices\":[],\"usage\":");
    write_usage(&b, prompt_tokens, completion_tokens, false);
    pd_buf_puts(&b, "}\n\n");
    return pd_buf_take(&b, len);
}

void completion_make_id(char out[40], uint64_t hi, uint64_t lo) {
    snprintf(out, 40, "cmpl-%016llx%016llx", (unsigned long long)hi, (unsigned long long)lo);
}
