/* cmd_score: `pdserve score` — the model's raw outputs for given token ids,
 * for comparing pdserve with another implementation (scripts/compare-hf.py
 * runs Hugging Face transformers on the same prompts).
 *
 * For every prompt (a list of token ids) it computes
 *   1. the logits at every prompt position. opt_forward returns logits only
 *      for the last new token of each sequence in a step, so the prompt is
 *      fed as one 1-token "sequence" per position, all sharing one block
 *      table: each layer writes every new token's K/V into the cache before
 *      attention reads it (model/opt.c), so position i attends to exactly
 *      positions 0..i — the same numbers a causal prefill gives, in one step
 *      per LOGIT_ROWS_PER_STEP positions;
 *   2. the last position's logits again through an ordinary prefill (in
 *      chunks of --max-num-batched-tokens, as generate and the engine do);
 *   3. --max-tokens greedy tokens from that prefill (argmax, lowest id on a
 *      tie, EOS not special), with the top --top-k (id, logit) pairs of the
 *      logits each greedy token was picked from.
 * The JSON output holds the greedy tokens and top-k lists; --logits writes
 * the float32 rows of 1 and 2 (see LAYOUT below). */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/opt.h"
#include "server/cli.h"
#include "server/commands.h"
#include "server/device_options.h"
#include "server/serve_options.h"

/* Positions per forward step in the all-position pass: bounds the host
 * logits buffer (128 x 50272 floats = 26 MB for OPT's vocabulary). */
#define LOGIT_ROWS_PER_STEP 128
#define MAX_TOP_K 64

#define LAYOUT                                                                                     \
    "float32, native byte order (little-endian on x86-64 and arm64), rows of vocab_size; per "     \
    "prompt in input order: prompt_len rows (positions 0..prompt_len-1, all-position pass) then "  \
    "1 row (last position, chunked prefill)"

typedef struct score_opts {
    const char *input, *output, *logits, *backend, *device, *dtype, *log_level, *prompt_logits;
    int max_tokens, top_k, block_size, chunk, threads, help;
} score_opts;

static const cli_option score_table[] = {
    {"input", CLI_STR, offsetof(score_opts, input), NULL, 1, 0,
     "JSON file: an array of prompts (arrays of token ids), or {\"prompts\": [...]} (required)"},
    {"output", CLI_STR, offsetof(score_opts, output), NULL, 1, 0,
     "JSON file for the greedy tokens, top-k lists and timings (required; - for stdout)"},
    {"logits", CLI_STR, offsetof(score_opts, logits), NULL, 1, 0,
     "binary file for the float32 logits rows (optional; layout in the JSON)"},
    {"prompt-logits", CLI_STR, offsetof(score_opts, prompt_logits), "all", 1, 0,
     "all: logits of every prompt position too; last: only the prefill's last position"},
    {"max-tokens", CLI_INT, offsetof(score_opts, max_tokens), "16", 0, 1000000,
     "greedy tokens after each prompt"},
    {"top-k", CLI_INT, offsetof(score_opts, top_k), "5", 1, MAX_TOP_K,
     "(id, logit) pairs kept per greedy step"},
    {"backend", CLI_STR, offsetof(score_opts, backend), "cpu", 1, 0,
     "cpu, cuda, cuda-fp16 or cuda-bf16 (cuda...:N picks device N)"},
    {"device", CLI_STR, offsetof(score_opts, device), NULL, 1, 0,
     "as serve: cpu, cuda, cuda:N, auto (with --dtype; instead of --backend)"},
    {"dtype", CLI_STR, offsetof(score_opts, dtype), NULL, 1, 0,
     "as serve: auto, float16, bfloat16, float32 (with --device; instead of --backend)"},
    {"block-size", CLI_INT, offsetof(score_opts, block_size), "16", 1, 1024,
     "KV cache block size (tokens)"},
    {"max-num-batched-tokens", CLI_INT, offsetof(score_opts, chunk), "2048", 1, 1 << 20,
     "prefill chunk size (tokens per forward pass)"},
    {"threads", CLI_INT, offsetof(score_opts, threads), "0", 0, 1024,
     "CPU threads (0: one per core)"},
    {"log-level", CLI_STR, offsetof(score_opts, log_level), "warning", 1, 0,
     "debug, info, warning, error"},
    {"help", CLI_BOOL, offsetof(score_opts, help), "false", 1, 0, "show this help"},
};

typedef struct prompt_list {
    int n;
    int32_t **ids;
    int *len;
} prompt_list;

/* Everything one run owns; freed in one place. */
typedef struct score_state {
    char *model_dir;
    pd_backend *be;
    opt_model *model;
    opt_kv_storage *kv;
    prompt_list prompts;
    int32_t *seq, *blocks;
    opt_seq_step *steps;
    float *rows; /* LOGIT_ROWS_PER_STEP x vocab */
    FILE *logits_file;
    cJSON *out;
} score_state;

static void score_state_free(score_state *s) {
    if (s->logits_file) fclose(s->logits_file);
    cJSON_Delete(s->out);
    free(s->rows);
    free(s->steps);
    free(s->seq);
    free(s->blocks);
    for (int i = 0; i < s->prompts.n; i++)
        free(s->prompts.ids[i]);
    free(s->prompts.ids);
    free(s->prompts.len);
    opt_kv_storage_free(s->kv);
    opt_model_free(s->model);
    pd_backend_destroy(s->be);
    free(s->model_dir);
}

/* Parse the --input file: ids are checked here so a bad one is reported by
 * prompt and position, not as a forward-pass error. */
static int prompts_load(const char *path, int vocab, prompt_list *pl, pd_err *err) {
    char *text = NULL;
    size_t len;
    if (pd_read_file(path, &text, &len, err) != 0) return pd_wrap(err, "--input");
    cJSON *root = cJSON_Parse(text);
    free(text);
    if (!root) return pd_fail(err, "--input %s: not valid JSON", path);
    cJSON *arr = cJSON_IsObject(root) ? cJSON_GetObjectItemCaseSensitive(root, "prompts") : root;
    int rc = 0;
    if (!cJSON_IsArray(arr) || cJSON_GetArraySize(arr) == 0) {
        rc = pd_fail(
            err, "--input %s: expected a non-empty array of prompts or {\"prompts\": [...]}", path);
        goto done;
    }
    pl->n = cJSON_GetArraySize(arr);
    pl->ids = calloc((size_t)pl->n, sizeof *pl->ids);
    pl->len = calloc((size_t)pl->n, sizeof *pl->len);
    if (!pl->ids || !pl->len) {
        pl->n = 0;
        rc = pd_fail(err, "out of memory");
        goto done;
    }
    for (int p = 0; p < pl->n && rc == 0; p++) {
        cJSON *pr = cJSON_GetArrayItem(arr, p);
        int n = cJSON_IsArray(pr) ? cJSON_GetArraySize(pr) : 0;
        if (n == 0) {
            rc = pd_fail(err, "--input %s: prompt %d is not a non-empty array of token ids", path,
                         p);
            break;
        }
        pl->ids[p] = malloc(sizeof(int32_t) * (size_t)n);
        if (!pl->ids[p]) {
            rc = pd_fail(err, "out of memory");
            break;
        }
        pl->len[p] = n;
        for (int t = 0; t < n; t++) {
            cJSON *v = cJSON_GetArrayItem(pr, t);
            double d = cJSON_IsNumber(v) ? v->valuedouble : -1;
            if (!cJSON_IsNumber(v) || d != floor(d) || d < 0 || d >= vocab) {
                char *shown = cJSON_PrintUnformatted(v);
                rc = pd_fail(err, "--input %s: prompt %d token %d is %s, not a token id in [0, %d)",
                             path, p, t, shown ? shown : "?", vocab);
                free(shown);
                break;
            }
            pl->ids[p][t] = (int32_t)d;
        }
    }
done:
    cJSON_Delete(root);
    return rc;
}

/* Lowest id among the largest logits (as the sampler's greedy path). */
static int32_t argmax(const float *x, int n) {
    int32_t best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* The k largest logits, larger first and lower id first on a tie. */
static void top_k(const float *x, int n, int k, int32_t *ids, float *vals) {
    int have = 0;
    for (int i = 0; i < n; i++) {
        if (have == k && !(x[i] > vals[k - 1])) continue;
        int at = have < k ? have++ : k - 1;
        while (at > 0 && x[i] > vals[at - 1]) {
            ids[at] = ids[at - 1];
            vals[at] = vals[at - 1];
            at--;
        }
        ids[at] = i;
        vals[at] = x[i];
    }
}

static int write_rows(score_state *s, const float *rows, int n_rows, int vocab, pd_err *err) {
    if (!s->logits_file) return 0;
    size_t n = (size_t)n_rows * (size_t)vocab;
    if (fwrite(rows, sizeof(float), n, s->logits_file) != n)
        return pd_fail(err, "--logits: write failed (disk full?)");
    return 0;
}

typedef struct score_times {
    double all_positions, prefill, decode;
    long decode_steps;
} score_times;

static int score_prompt(score_state *s, const score_opts *o, int p, long row0, score_times *tm,
                        pd_err *err) {
    const int V = opt_model_config(s->model)->vocab_size;
    const int n = s->prompts.len[p], n_blocks = opt_kv_num_blocks(s->kv);
    memcpy(s->seq, s->prompts.ids[p], sizeof(int32_t) * (size_t)n);

    /* 1. every position: one 1-token sequence per position, one shared table. */
    double t0 = pd_now();
    if (!strcmp(o->prompt_logits, "all")) {
        for (int a = 0; a < n; a += LOGIT_ROWS_PER_STEP) {
            int c = n - a < LOGIT_ROWS_PER_STEP ? n - a : LOGIT_ROWS_PER_STEP;
            for (int i = 0; i < c; i++)
                s->steps[i] = (opt_seq_step){s->seq + a + i, 1, a + i, s->blocks, n_blocks, true};
            if (opt_forward(s->model, s->kv, s->steps, c, s->rows, err) != 0)
                return pd_wrap(err, "prompt %d, positions %d..%d", p, a, a + c - 1);
            if (write_rows(s, s->rows, c, V, err) != 0) return -1;
        }
    }
    /* 2. the prefill, as generate runs it (it overwrites the same cache slots). */
    double t1 = pd_now();
    for (int done = 0; done < n;) {
        int c = n - done < o->chunk ? n - done : o->chunk;
        opt_seq_step st = {s->seq + done, c, done, s->blocks, n_blocks, done + c == n};
        if (opt_forward(s->model, s->kv, &st, 1, s->rows, err) != 0)
            return pd_wrap(err, "prompt %d, prefill", p);
        done += c;
    }
    if (write_rows(s, s->rows, 1, V, err) != 0) return -1;

    /* 3. greedy decode from the prefill's logits. */
    double t2 = pd_now();
    cJSON *res = cJSON_CreateObject(), *greedy = cJSON_CreateArray();
    cJSON *tids = cJSON_CreateArray(), *tvals = cJSON_CreateArray();
    cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(s->out, "prompts"), res);
    cJSON_AddNumberToObject(res, "prompt_len", n);
    cJSON_AddNumberToObject(res, "logits_row", (double)row0);
    cJSON_AddItemToObject(res, "greedy", greedy);
    cJSON_AddItemToObject(res, "top_ids", tids);
    cJSON_AddItemToObject(res, "top_logits", tvals);
    int32_t ids[MAX_TOP_K];
    float vals[MAX_TOP_K];
    int k = o->top_k < V ? o->top_k : V;
    for (int step = 0; step < o->max_tokens; step++) {
        int32_t tok = argmax(s->rows, V);
        top_k(s->rows, V, k, ids, vals);
        cJSON *ti = cJSON_CreateArray(), *tv = cJSON_CreateArray();
        for (int i = 0; i < k; i++) {
            cJSON_AddItemToArray(ti, cJSON_CreateNumber(ids[i]));
            cJSON_AddItemToArray(tv, cJSON_CreateNumber(vals[i]));
        }
        cJSON_AddItemToArray(tids, ti);
        cJSON_AddItemToArray(tvals, tv);
        cJSON_AddItemToArray(greedy, cJSON_CreateNumber(tok));
        s->seq[n + step] = tok;
        if (step == o->max_tokens - 1) break;
        opt_seq_step st = {s->seq + n + step, 1, n + step, s->blocks, n_blocks, true};
        if (opt_forward(s->model, s->kv, &st, 1, s->rows, err) != 0)
            return pd_wrap(err, "prompt %d, greedy step %d", p, step + 1);
        tm->decode_steps++;
    }
    double t3 = pd_now();
    tm->all_positions += t1 - t0;
    tm->prefill += t2 - t1;
    tm->decode += t3 - t2;
    return 0;
}

static int score(const score_opts *o, const char *model_arg, score_state *s, pd_err *err) {
    char backend[48];
    snprintf(backend, sizeof backend, "%s", o->backend);
    if (resolve_model_arg(model_arg, &s->model_dir, err) != 0) return -1;
    if (o->device || o->dtype) {
        char dev[24];
        const char *dtype = o->dtype ? o->dtype : "auto";
        if (device_flags_check(o->device ? o->device : "cpu", dtype, dev, sizeof dev, err) != 0 ||
            device_backend_for_model(NULL, dev, dtype, s->model_dir, backend, sizeof backend, err) != 0)
            return -1;
    }
    if (pd_backend_create(backend, o->threads, &s->be, err) != 0) return -1;
    double t_load = pd_now();
    if (opt_model_load(s->model_dir, s->be, &s->model, err) != 0) return -1;
    const opt_config *cfg = opt_model_config(s->model);
    pd_log(PD_LOG_INFO, "loaded %s on %s in %.2f s", s->model_dir, backend, pd_now() - t_load);
    const int V = cfg->vocab_size;
    if (prompts_load(o->input, V, &s->prompts, err) != 0) return -1;

    int longest = 0, max_prompt = 0;
    for (int p = 0; p < s->prompts.n; p++) {
        int total = s->prompts.len[p] + o->max_tokens;
        if (total > cfg->max_position_embeddings)
            return pd_fail(err,
                           "prompt %d (%d tokens) + --max-tokens (%d) exceeds the model's maximum "
                           "length %d",
                           p, s->prompts.len[p], o->max_tokens, cfg->max_position_embeddings);
        if (total > longest) longest = total;
        if (s->prompts.len[p] > max_prompt) max_prompt = s->prompts.len[p];
    }
    /* One cache for all prompts: each starts at position 0 and writes every
     * slot before attention reads it. */
    int bs = o->block_size, n_blocks = (longest + bs - 1) / bs;
    s->blocks = malloc(sizeof(int32_t) * (size_t)n_blocks);
    s->seq = malloc(sizeof(int32_t) * (size_t)longest);
    s->steps = malloc(sizeof(opt_seq_step) * LOGIT_ROWS_PER_STEP);
    s->rows = malloc(sizeof(float) * (size_t)V * LOGIT_ROWS_PER_STEP);
    if (!s->blocks || !s->seq || !s->steps || !s->rows) return pd_fail(err, "out of memory");
    for (int b = 0; b < n_blocks; b++)
        s->blocks[b] = n_blocks - 1 - b; /* any order works */
    if (opt_kv_storage_create(s->model, n_blocks, bs, &s->kv, err) != 0) return -1;
    if (o->logits && !(s->logits_file = fopen(o->logits, "wb")))
        return pd_fail(err, "--logits: cannot create '%s'", o->logits);

    s->out = cJSON_CreateObject();
    cJSON_AddStringToObject(s->out, "model", s->model_dir);
    cJSON_AddStringToObject(s->out, "backend", backend);
    cJSON_AddStringToObject(s->out, "dtype", pd_dtype_name(s->be->dtype));
    cJSON_AddNumberToObject(s->out, "vocab_size", V);
    cJSON_AddNumberToObject(s->out, "max_tokens", o->max_tokens);
    cJSON_AddNumberToObject(s->out, "top_k", o->top_k < V ? o->top_k : V);
    cJSON_AddStringToObject(s->out, "prompt_logits", o->prompt_logits);
    if (o->logits)
        cJSON_AddStringToObject(s->out, "logits_file", o->logits);
    else
        cJSON_AddNullToObject(s->out, "logits_file");
    cJSON_AddStringToObject(s->out, "logits_layout",
                            !strcmp(o->prompt_logits, "all")
                                ? LAYOUT
                                : "float32, native byte order, rows of vocab_size; per prompt in "
                                  "input order: 1 row (last position, chunked prefill)");
    cJSON_AddItemToObject(s->out, "prompts", cJSON_CreateArray());

    score_times tm = {0};
    long row = 0;
    const int all = !strcmp(o->prompt_logits, "all");
    for (int p = 0; p < s->prompts.n; p++) {
        if (score_prompt(s, o, p, row, &tm, err) != 0) return -1;
        row += (all ? s->prompts.len[p] : 0) + 1;
    }
    if (s->logits_file) {
        int bad = fclose(s->logits_file) != 0;
        s->logits_file = NULL;
        if (bad) return pd_fail(err, "--logits: cannot finish writing '%s'", o->logits);
    }
    cJSON *sec = cJSON_AddObjectToObject(s->out, "seconds");
    cJSON_AddNumberToObject(sec, "all_positions", tm.all_positions);
    cJSON_AddNumberToObject(sec, "prefill", tm.prefill);
    cJSON_AddNumberToObject(sec, "decode", tm.decode);
    cJSON_AddNumberToObject(s->out, "decode_steps", (double)tm.decode_steps);
    char *text = cJSON_PrintUnformatted(s->out);
    if (!text) return pd_fail(err, "out of memory");
    int rc = 0;
    if (!strcmp(o->output, "-")) {
        fputs(text, stdout);
        putchar('\n');
    } else {
        rc = pd_write_file(o->output, text, strlen(text), err);
        if (rc != 0) pd_wrap(err, "--output");
    }
    free(text);
    fprintf(stderr,
            "pdserve score: %d prompts on %s: all-position pass %.3f s, prefill %.3f s, "
            "%ld decode steps %.3f s (%.2f ms/step)\n",
            s->prompts.n, backend, tm.all_positions, tm.prefill, tm.decode_steps, tm.decode,
            tm.decode_steps ? tm.decode / (double)tm.decode_steps * 1e3 : 0.0);
    return rc;
}

static int dtype_known(const char *d) {
    static const char *names[] = {"auto", "half",  "float16", "fp16", "bfloat16",
                                  "bf16", "float", "float32", "fp32"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(d, names[i])) return 1;
    return 0;
}

int cmd_score(int argc, char **argv) {
    score_opts o;
    char *pos[1];
    int n_pos;
    uint64_t given = 0;
    pd_err err = {{0}};
    int n_table = (int)(sizeof score_table / sizeof score_table[0]);
    if (cli_parse(score_table, n_table, &o, argc, argv, pos, 1, &n_pos, &given, &err) != 0) {
        fprintf(stderr, "pdserve score: %s\n", err.msg);
        return 2;
    }
    if (o.help) {
        cli_print_help("pdserve score [MODEL] --input IDS.json --output OUT.json [options]",
                       score_table, n_table);
        printf("\n--logits layout: %s\n", LAYOUT);
        return 0;
    }
    pd_log_level level;
    if (pd_log_parse_level(o.log_level, &level) != 0) {
        fprintf(stderr, "pdserve score: --log-level: unknown level '%s'\n", o.log_level);
        return 2;
    }
    pd_log_set_level(level);
    const char *usage_error = NULL;
    char msg[200];
    int backend_given = 0;
    for (int i = 0; i < n_table && i < 64; i++)
        if (!strcmp(score_table[i].name, "backend")) backend_given = (int)((given >> i) & 1);
    if (!o.input)
        usage_error = "--input is required";
    else if (!o.output)
        usage_error = "--output is required";
    else if (strcmp(o.prompt_logits, "all") && strcmp(o.prompt_logits, "last")) {
        snprintf(msg, sizeof msg, "--prompt-logits: expected all or last, got '%s'",
                 o.prompt_logits);
        usage_error = msg;
    } else if (o.dtype && !dtype_known(o.dtype)) {
        snprintf(msg, sizeof msg,
                 "--dtype: expected auto, half, float16, bfloat16, float or float32, got '%.80s'",
                 o.dtype);
        usage_error = msg;
    } else if (backend_given && (o.device || o.dtype))
        usage_error = "give --backend, or --device and --dtype, not both";
    if (usage_error) {
        fprintf(stderr, "pdserve score: %s\n", usage_error);
        return 2;
    }
    score_state s;
    memset(&s, 0, sizeof s);
    int rc = score(&o, n_pos ? pos[0] : NULL, &s, &err);
    score_state_free(&s);
    if (rc != 0) {
        fprintf(stderr, "pdserve score: %s\n", err.msg);
        return 1;
    }
    return 0;
}
