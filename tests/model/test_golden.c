/* test_golden: pdserve's CPU forward pass and tokenizer against reference
 * data made by Hugging Face transformers (scripts/make-golden.py, run on the
 * GPU machine; see tests/model/data/golden/README.md).
 *
 * For each golden model the test regenerates the same random weights with
 * opt_make_model (checked by hash), then for every prompt: last-position
 * logits within 1e-4 (fp32), 32 greedy tokens identical, and the logits of
 * the 32nd step within 1e-4 — with block size 16 and one-shot prefill, with
 * block size 5 and 7-token prefill chunks, and with all prompts batched into
 * one forward call. It also checks the tokenizer against HF's GPT2Tokenizer. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/make_model.h"
#include "model/opt.h"
#include "model/tokenizer.h"
#include "tests/common/testlib.h"

#define GOLDEN_SEED 1
#define TOL 1e-4f

typedef struct golden {
    int n_prompts, steps, vocab;
    int32_t **prompts;
    int *prompt_len;
    int32_t **greedy;
    float *logits; /* [n_prompts][2][vocab] */
    char hash[32];
} golden;

static int32_t *json_ids(cJSON *arr, int *n) {
    *n = cJSON_GetArraySize(arr);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(*n > 0 ? *n : 1));
    for (int i = 0; i < *n; i++) ids[i] = (int32_t)cJSON_GetArrayItem(arr, i)->valuedouble;
    return ids;
}

static int golden_load(const char *name, golden *g) {
    char rel[256];
    char *text = NULL, *bin = NULL;
    size_t len, blen;
    pd_err err;
    snprintf(rel, sizeof rel, "tests/model/data/golden/%s/golden.json", name);
    if (pd_read_file(test_src_path(rel), &text, &len, &err) != 0) {
        fprintf(stderr, "%s\n", err.msg);
        return -1;
    }
    snprintf(rel, sizeof rel, "tests/model/data/golden/%s/logits.f32", name);
    if (pd_read_file(test_src_path(rel), &bin, &blen, &err) != 0) {
        fprintf(stderr, "%s\n", err.msg);
        free(text);
        return -1;
    }
    cJSON *j = cJSON_Parse(text);
    free(text);
    cJSON *prompts = cJSON_GetObjectItem(j, "prompts"), *greedy = cJSON_GetObjectItem(j, "greedy");
    g->n_prompts = cJSON_GetArraySize(prompts);
    g->steps = cJSON_GetObjectItem(j, "steps")->valueint;
    g->vocab = cJSON_GetObjectItem(j, "vocab_size")->valueint;
    snprintf(g->hash, sizeof g->hash, "%s", cJSON_GetObjectItem(j, "weights_fnv1a64")->valuestring);
    g->prompts = calloc((size_t)g->n_prompts, sizeof *g->prompts);
    g->greedy = calloc((size_t)g->n_prompts, sizeof *g->greedy);
    g->prompt_len = calloc((size_t)g->n_prompts, sizeof(int));
    for (int i = 0; i < g->n_prompts; i++) {
        int n;
        g->prompts[i] = json_ids(cJSON_GetArrayItem(prompts, i), &g->prompt_len[i]);
        g->greedy[i] = json_ids(cJSON_GetArrayItem(greedy, i), &n);
        if (n != g->steps) fprintf(stderr, "golden %s: prompt %d has %d greedy tokens\n", name, i, n);
    }
    cJSON_Delete(j);
    g->logits = (float *)bin;
    if (blen != (size_t)g->n_prompts * 2 * (size_t)g->vocab * sizeof(float)) {
        fprintf(stderr, "golden %s: logits.f32 has %zu bytes\n", name, blen);
        return -1;
    }
    return 0;
}

static void golden_free(golden *g) {
    for (int i = 0; i < g->n_prompts; i++) {
        free(g->prompts[i]);
        free(g->greedy[i]);
    }
    free(g->prompts);
    free(g->greedy);
    free(g->prompt_len);
    free(g->logits);
}

static uint64_t fnv1a64_file(const char *path) {
    char *data;
    size_t len;
    pd_err err;
    if (pd_read_file(path, &data, &len, &err) != 0) return 0;
    uint64_t h = 0xCBF29CE484222325ull;
    for (size_t i = 0; i < len; i++) h = (h ^ (uint8_t)data[i]) * 0x100000001B3ull;
    free(data);
    return h;
}

static float max_abs_diff(const float *a, const float *b, int n) {
    float m = 0;
    for (int i = 0; i < n; i++) {
        float d = fabsf(a[i] - b[i]);
        if (!(d <= m)) m = d; /* NaN propagates as a failure */
    }
    return m;
}

static int argmax(const float *x, int n) {
    int best = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* Run every prompt alone: prefill (in chunks of `chunk`), then greedy steps. */
static void check_sequential(opt_model *m, const golden *g, int block_size, int chunk, const char *name) {
    float *logits = malloc(sizeof(float) * (size_t)g->vocab);
    float worst_first = 0, worst_last = 0;
    int greedy_ok = 0;
    for (int p = 0; p < g->n_prompts; p++) {
        int n = g->prompt_len[p], total = n + g->steps;
        int n_blocks = (total + block_size - 1) / block_size;
        int32_t *table = malloc(sizeof(int32_t) * (size_t)n_blocks);
        for (int b = 0; b < n_blocks; b++) table[b] = n_blocks - 1 - b; /* physical order != logical order */
        opt_kv_storage *kv = NULL;
        pd_err err = {{0}};
        CHECKF(opt_kv_storage_create(m, n_blocks, block_size, &kv, &err) == 0, "%s", err.msg);
        int32_t *seq = malloc(sizeof(int32_t) * (size_t)total);
        memcpy(seq, g->prompts[p], sizeof(int32_t) * (size_t)n);
        int ok = 1;
        for (int done = 0; done < n && ok;) {
            int k = n - done < chunk ? n - done : chunk;
            opt_seq_step st = {seq + done, k, done, table, n_blocks, done + k == n};
            ok = opt_forward(m, kv, &st, 1, logits, &err) == 0;
            CHECKF(ok, "%s", err.msg);
            done += k;
        }
        float d0 = max_abs_diff(logits, g->logits + (size_t)(2 * p) * g->vocab, g->vocab);
        if (d0 > worst_first) worst_first = d0;
        CHECKF(d0 <= TOL, "%s bs=%d prompt %d (%d tokens): first logits max abs diff %g", name, block_size, p, n, d0);
        int same = 1;
        for (int s = 0; s < g->steps && ok; s++) {
            int tok = argmax(logits, g->vocab);
            if (tok != g->greedy[p][s]) {
                same = 0;
                fprintf(stderr, "%s bs=%d prompt %d: greedy step %d gives %d, HF %d\n", name, block_size, p, s, tok,
                        g->greedy[p][s]);
                break;
            }
            seq[n + s] = tok;
            if (s == g->steps - 1) break;
            opt_seq_step st = {seq + n + s, 1, n + s, table, n_blocks, true};
            ok = opt_forward(m, kv, &st, 1, logits, &err) == 0;
            CHECKF(ok, "%s", err.msg);
        }
        CHECK(same);
        if (same) {
            greedy_ok++;
            float d1 = max_abs_diff(logits, g->logits + (size_t)(2 * p + 1) * g->vocab, g->vocab);
            if (d1 > worst_last) worst_last = d1;
            CHECKF(d1 <= TOL, "%s bs=%d prompt %d: step-%d logits max abs diff %g", name, block_size, p, g->steps, d1);
        }
        opt_kv_storage_free(kv);
        free(seq);
        free(table);
    }
    printf("%s block_size=%d chunk=%d: %d/%d greedy continuations identical; max abs diff first %.3g, last %.3g\n",
           name, block_size, chunk, greedy_ok, g->n_prompts, worst_first, worst_last);
    free(logits);
}

/* All prompts' prefills in one forward call. */
static void check_batched(opt_model *m, const golden *g, const char *name) {
    const int bs = 16;
    int total_blocks = 0;
    for (int p = 0; p < g->n_prompts; p++) total_blocks += (g->prompt_len[p] + bs - 1) / bs;
    opt_kv_storage *kv = NULL;
    pd_err err = {{0}};
    CHECKF(opt_kv_storage_create(m, total_blocks, bs, &kv, &err) == 0, "%s", err.msg);
    int32_t *tables = malloc(sizeof(int32_t) * (size_t)total_blocks);
    for (int b = 0; b < total_blocks; b++) tables[b] = total_blocks - 1 - b;
    opt_seq_step *steps = calloc((size_t)g->n_prompts, sizeof *steps);
    int used = 0;
    for (int p = 0; p < g->n_prompts; p++) {
        int nb = (g->prompt_len[p] + bs - 1) / bs;
        steps[p] = (opt_seq_step){g->prompts[p], g->prompt_len[p], 0, tables + used, nb, true};
        used += nb;
    }
    float *logits = malloc(sizeof(float) * (size_t)g->vocab * (size_t)g->n_prompts);
    CHECKF(opt_forward(m, kv, steps, g->n_prompts, logits, &err) == 0, "%s", err.msg);
    float worst = 0;
    for (int p = 0; p < g->n_prompts; p++) {
        float d = max_abs_diff(logits + (size_t)p * g->vocab, g->logits + (size_t)(2 * p) * g->vocab, g->vocab);
        if (d > worst) worst = d;
        CHECKF(d <= TOL, "%s batched prompt %d: max abs diff %g", name, p, d);
    }
    printf("%s batched (%d prompts in one step): max abs diff %.3g\n", name, g->n_prompts, worst);
    free(logits);
    free(steps);
    free(tables);
    opt_kv_storage_free(kv);
}

static void check_model(const char *preset) {
    golden g;
    memset(&g, 0, sizeof g);
    CHECKF(golden_load(preset, &g) == 0, "cannot load golden data for %s", preset);
    if (!g.logits) return;
    char dir[512];
    snprintf(dir, sizeof dir, "%s/%s", test_tmpdir(), preset);
    pd_err err = {{0}};
    CHECKF(opt_make_model(dir, preset, GOLDEN_SEED, PD_F32, &err) == 0, "%s", err.msg);
    char path[600], hash[32];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    snprintf(hash, sizeof hash, "%016llx", (unsigned long long)fnv1a64_file(path));
    CHECKF(strcmp(hash, g.hash) == 0, "%s: regenerated weights hash %s, golden data was made from %s", preset, hash,
           g.hash);
    pd_backend *be = NULL;
    opt_model *m = NULL;
    /* PDSERVE_TEST_BACKEND=cuda runs the same comparison on the GPU machine. */
    const char *backend = getenv("PDSERVE_TEST_BACKEND") ? getenv("PDSERVE_TEST_BACKEND") : "cpu";
    CHECKF(pd_backend_create(backend, 0, &be, &err) == 0, "%s", err.msg);
    printf("backend: %s\n", backend);
    CHECKF(opt_model_load(dir, be, &m, &err) == 0, "%s", err.msg);
    if (m) {
        check_sequential(m, &g, 16, 1 << 20, preset);
        check_sequential(m, &g, 5, 7, preset);
        check_batched(m, &g, preset);
    }
    opt_model_free(m);
    pd_backend_destroy(be);
    golden_free(&g);
}

static void check_tokenizer_against_hf(void) {
    char *text = NULL;
    size_t len;
    pd_err err = {{0}};
    CHECKF(pd_read_file(test_src_path("tests/model/data/golden/tokenizer_hf.json"), &text, &len, &err) == 0, "%s",
           err.msg);
    if (!text) return;
    char dir[512];
    snprintf(dir, sizeof dir, "%s/tiny", test_tmpdir());
    tokenizer *tok = NULL;
    CHECKF(tokenizer_load(dir, &tok, &err) == 0, "%s", err.msg);
    cJSON *j = cJSON_Parse(text);
    cJSON *cases = cJSON_GetObjectItem(j, "cases"), *c;
    int n_cases = 0;
    cJSON_ArrayForEach(c, cases) {
        const char *t = cJSON_GetObjectItem(c, "text")->valuestring;
        for (int special = 0; special < 2 && tok; special++) {
            int n_ref, n = 0;
            int32_t *ref = json_ids(cJSON_GetObjectItem(c, special ? "ids" : "ids_no_special"), &n_ref);
            int32_t *ids = NULL;
            CHECKF(tokenizer_encode(tok, t, strlen(t), special, &ids, &n, &err) == 0, "%s", err.msg);
            int same = n == n_ref && (n == 0 || memcmp(ids, ref, sizeof(int32_t) * (size_t)n) == 0);
            CHECKF(same, "tokenizer differs from HF GPT2Tokenizer on \"%s\" (special=%d)", t, special);
            free(ids);
            free(ref);
        }
        n_cases++;
    }
    printf("tokenizer: %d texts compared with HF GPT2Tokenizer\n", n_cases);
    cJSON_Delete(j);
    tokenizer_free(tok);
    free(text);
}

int main(void) {
    check_model("tiny");
    check_model("tiny-postln");
    check_tokenizer_against_hf();
    return test_finish();
}
