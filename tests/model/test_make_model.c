/* test_make_model: the generated model directory loads through the same path
 * as a real one (config → checkpoint → weights), is deterministic per seed,
 * follows the documented generator (re-implemented here), stores fp16/bf16 as
 * the correctly rounded fp32 values, and ships usable tokenizer files. Preset
 * sizes are checked against the published parameter counts. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/checkpoint.h"
#include "model/make_model.h"
#include "model/tokenizer.h"
#include "model/weights.h"
#include "tests/common/testlib.h"

static char *dir_for(const char *name) {
    char *p = malloc(1024);
    snprintf(p, 1024, "%s/%s", test_tmpdir(), name);
    return p;
}

static char *slurp(const char *dir, const char *file, size_t *len) {
    char *p = pd_path_join(dir, file);
    char *data = NULL;
    pd_err e;
    if (pd_read_file(p, &data, len, &e)) data = NULL;
    free(p);
    return data;
}

static int make(const char *dir, const char *preset, uint64_t seed, pd_dtype dt) {
    pd_err e = {{0}};
    int rc = opt_make_model(dir, preset, seed, dt, &e);
    if (rc) fprintf(stderr, "make %s: %s\n", preset, e.msg);
    return rc;
}

/* Parameter count from the shapes of reference §1.3. */
static long long param_count(const opt_config *c) {
    long long V = c->vocab_size, h = c->hidden_size, w = c->word_embed_proj_dim, f = c->ffn_dim;
    long long n = V * w + (c->max_position_embeddings + 2LL) * h;
    if (w != h) n += 2 * h * w;
    if (c->do_layer_norm_before && !c->remove_final_layer_norm) n += 2 * h;
    n += c->num_hidden_layers * (4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h);
    return n;
}

static void test_presets(void) {
    opt_config c;
    pd_err e = {{0}};
    /* Published sizes (reference §1.2). */
    CHECK(opt_preset_config("opt-125m", &c, &e) == 0 && param_count(&c) == 125239296LL);
    CHECK(c.hidden_size == 768 && c.num_hidden_layers == 12 && c.do_layer_norm_before);
    CHECK(opt_preset_config("opt-350m", &c, &e) == 0 && param_count(&c) == 331196416LL);
    CHECK(!c.do_layer_norm_before && c.word_embed_proj_dim == 512 && !opt_config_has_final_ln(&c));
    CHECK(opt_preset_config("opt-1.3b", &c, &e) == 0 && param_count(&c) == 1315758080LL);
    CHECK(opt_preset_config("tiny", &c, &e) == 0 && c.hidden_size == 64 &&
          c.num_hidden_layers == 2);
    CHECK(c.num_attention_heads == 4 && c.ffn_dim == 256 && c.max_position_embeddings == 512);
    CHECK(opt_config_has_final_ln(&c) && !opt_config_has_projections(&c));
    CHECK(c.bos_token_id == 50256 && c.eos_token_id == 50256 && c.pad_token_id == 50256);
    CHECK(opt_preset_config("tiny-postln", &c, &e) == 0 && c.word_embed_proj_dim == 32);
    CHECK(!c.do_layer_norm_before && opt_config_has_projections(&c) &&
          !opt_config_has_final_ln(&c));
    CHECK(opt_preset_config("opt-175b", &c, &e) == -1);
    CHECKF(strstr(e.msg, "opt-175b") && strstr(e.msg, "tiny-postln"), "%s", e.msg);
}

/* The documented generator, written again from docs/model-files.md. */
static uint64_t ref_mix(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static float ref_value(uint64_t seed, const char *name, uint64_t i, double amp, double center) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (const char *s = name; *s; s++)
        h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    uint64_t key = ref_mix(seed ^ h);
    uint64_t r = ref_mix(key + (i + 1) * 0x9E3779B97F4A7C15ull);
    double u = (double)(int64_t)(r >> 40) - 8388608.0;
    return (float)(center + u / 8388608.0 * amp);
}

static void check_generator(const checkpoint *ck, uint64_t seed, const char *name, double amp,
                            double center) {
    const ckpt_tensor *t = checkpoint_find(ck, name);
    CHECKF(t != NULL, "%s missing", name);
    if (!t) return;
    const float *v = t->data; /* written by us: 8-byte aligned header, F32 data */
    size_t n = t->nbytes / 4, bad = 0;
    float lo = 1e30f, hi = -1e30f;
    for (size_t i = 0; i < n; i++) {
        float want = ref_value(seed, name, i, amp, center);
        if (memcmp(&v[i], &want, 4) != 0) bad++;
        lo = v[i] < lo ? v[i] : lo;
        hi = v[i] > hi ? v[i] : hi;
    }
    CHECKF(bad == 0, "%s: %zu of %zu values differ from the documented generator", name, bad, n);
    CHECKF(lo >= center - amp && hi < center + amp && hi - lo > amp, "%s: range [%g, %g]", name, lo,
           hi);
}

static void test_tiny_round_trip(void) {
    char *dir = dir_for("tiny");
    double t0 = pd_now();
    CHECK(make(dir, "tiny", 1234, PD_F32) == 0);
    double dt = pd_now() - t0;
    printf("tiny preset written in %.3f s\n", dt);
    CHECK(dt < 5.0);

    opt_config c, want;
    pd_err e = {{0}};
    CHECKF(opt_config_load(dir, &c, &e) == 0, "%s", e.msg);
    CHECK(opt_preset_config("tiny", &want, &e) == 0);
    CHECK(c.hidden_size == want.hidden_size && c.vocab_size == want.vocab_size);
    CHECK(c.torch_dtype == PD_F32 && c.eos_token_id == 50256 && c.tie_word_embeddings);

    checkpoint *ck = NULL;
    CHECKF(checkpoint_open(dir, &ck, &e) == 0, "%s", e.msg);
    if (!ck) return;
    CHECK(strcmp(checkpoint_format(ck), "safetensors") == 0);
    CHECK(checkpoint_count(ck) == 4 + 16 * c.num_hidden_layers);
    size_t total = 0;
    int prefixed = 1;
    for (int i = 0; i < checkpoint_count(ck); i++) {
        const ckpt_tensor *t = checkpoint_get(ck, i);
        prefixed &= strncmp(t->name, "model.decoder.", 14) == 0;
        total += t->nbytes;
    }
    CHECK(prefixed);
    CHECK(total == (size_t)param_count(&c) * 4);
    CHECK(checkpoint_find(ck, "lm_head.weight") == NULL);
    /* Hub-style names are found through the prefix rule. */
    const ckpt_tensor *a = checkpoint_find(ck, "decoder.layers.1.fc2.weight");
    const ckpt_tensor *b = checkpoint_find(ck, "model.decoder.layers.1.fc2.weight");
    CHECK(a && a == b && a->shape[0] == 64 && a->shape[1] == 256);

    opt_weights w;
    CHECKF(opt_weights_bind(&c, ck, &w, &e) == 0, "%s", e.msg);
    CHECK(w.lm_head.data == w.embed_tokens.data); /* tied */
    CHECK(w.embed_tokens.rows == 50272 && w.embed_tokens.cols == 64);
    CHECK(w.embed_positions.rows == 514 && w.final_ln_w.data && !w.project_in.data);
    opt_weights_release(&w);

    /* Scales documented in docs/model-files.md for h = w = 64, f = 256. */
    check_generator(ck, 1234, "model.decoder.embed_tokens.weight", 0.25, 0);
    check_generator(ck, 1234, "model.decoder.embed_positions.weight", 0.5, 0);
    check_generator(ck, 1234, "model.decoder.layers.0.self_attn.q_proj.weight", 0.25, 0);
    check_generator(ck, 1234, "model.decoder.layers.1.fc2.weight", 0.125, 0);
    check_generator(ck, 1234, "model.decoder.layers.0.fc1.bias", 1.0 / 64, 0);
    check_generator(ck, 1234, "model.decoder.layers.1.final_layer_norm.weight", 0.125, 1.0);
    check_generator(ck, 1234, "model.decoder.final_layer_norm.bias", 1.0 / 32, 0);
    checkpoint_close(ck);
    free(dir);
}

static int same_file(const char *d1, const char *d2, const char *file) {
    size_t n1, n2;
    char *a = slurp(d1, file, &n1), *b = slurp(d2, file, &n2);
    int same = a && b && n1 == n2 && memcmp(a, b, n1) == 0;
    free(a);
    free(b);
    return same;
}

static void test_determinism(void) {
    char *a = dir_for("seed-a"), *b = dir_for("seed-b"), *c = dir_for("seed-c");
    CHECK(make(a, "tiny-postln", 7, PD_F32) == 0);
    CHECK(make(b, "tiny-postln", 7, PD_F32) == 0);
    CHECK(make(c, "tiny-postln", 8, PD_F32) == 0);
    CHECK(same_file(a, b, "model.safetensors"));
    CHECK(!same_file(a, c, "model.safetensors"));
    CHECK(same_file(a, c, "config.json"));
    /* Rewriting a directory replaces its files. */
    CHECK(make(a, "tiny-postln", 8, PD_F32) == 0);
    CHECK(same_file(a, c, "model.safetensors"));

    opt_config cfg;
    checkpoint *ck = NULL;
    opt_weights w;
    pd_err e = {{0}};
    CHECK(opt_config_load(c, &cfg, &e) == 0 && checkpoint_open(c, &ck, &e) == 0);
    CHECKF(ck && opt_weights_bind(&cfg, ck, &w, &e) == 0, "%s", e.msg);
    if (ck) {
        CHECK(w.project_in.rows == 64 && w.project_in.cols == 32);
        CHECK(w.project_out.rows == 32 && w.project_out.cols == 64);
        CHECK(w.final_ln_w.data == NULL && w.embed_tokens.cols == 32);
        opt_weights_release(&w);
        checkpoint_close(ck);
    }
    free(a);
    free(b);
    free(c);
}

static double f16_to_double(uint16_t h) {
    int s = h >> 15, ex = (h >> 10) & 31, m = h & 1023;
    double v = ex == 0 ? ldexp(m, -24) : ldexp(1024 + m, ex - 25);
    return s ? -v : v;
}

static double bf16_to_double(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* h must be the nearest 16-bit value to x, ties to an even mantissa. */
static int is_rne(uint16_t h, float x, double (*dec)(uint16_t)) {
    double d = dec(h), err = fabs(d - (double)x);
    for (int step = -1; step <= 1; step += 2) {
        uint16_t nb = (uint16_t)(h + step);
        if ((nb & 0x7fff) == 0x7fff || ((h & 0x7fff) == 0 && step < 0)) continue;
        double en = fabs(dec(nb) - (double)x);
        if (en < err || (en == err && (h & 1))) return 0;
    }
    return 1;
}

static void test_half_variants(void) {
    char *d32 = dir_for("h32"), *d16 = dir_for("h16"), *dbf = dir_for("hbf");
    CHECK(make(d32, "tiny", 99, PD_F32) == 0);
    CHECK(make(d16, "tiny", 99, PD_F16) == 0);
    CHECK(make(dbf, "tiny", 99, PD_BF16) == 0);
    opt_config c;
    pd_err e = {{0}};
    checkpoint *k32 = NULL, *k16 = NULL, *kbf = NULL;
    CHECK(checkpoint_open(d32, &k32, &e) == 0);
    CHECK(checkpoint_open(d16, &k16, &e) == 0);
    CHECK(checkpoint_open(dbf, &kbf, &e) == 0);
    CHECK(opt_config_load(d16, &c, &e) == 0 && c.torch_dtype == PD_F16);
    opt_weights w;
    CHECKF(k16 && opt_weights_bind(&c, k16, &w, &e) == 0, "%s", e.msg);
    if (k16) {
        CHECK(w.embed_tokens.dtype == PD_F16 && w.layers[1].fc1_b.dtype == PD_F16);
        opt_weights_release(&w);
    }
    CHECK(opt_config_load(dbf, &c, &e) == 0 && c.torch_dtype == PD_BF16);
    CHECKF(kbf && opt_weights_bind(&c, kbf, &w, &e) == 0, "%s", e.msg);
    if (kbf) {
        CHECK(w.embed_positions.dtype == PD_BF16);
        opt_weights_release(&w);
    }
    if (k32 && k16 && kbf) {
        size_t bad16 = 0, badbf = 0, n = 0;
        for (int i = 0; i < checkpoint_count(k32); i++) {
            const ckpt_tensor *t = checkpoint_get(k32, i);
            const ckpt_tensor *h = checkpoint_find(k16, t->name),
                              *b = checkpoint_find(kbf, t->name);
            if (!h || !b || h->nbytes * 2 != t->nbytes || b->nbytes * 2 != t->nbytes) {
                bad16++;
                continue;
            }
            const float *x = t->data;
            const uint16_t *hv = h->data, *bv = b->data;
            for (size_t j = 0; j < t->nbytes / 4; j++, n++) {
                bad16 += !is_rne(hv[j], x[j], f16_to_double);
                badbf += !is_rne(bv[j], x[j], bf16_to_double);
            }
        }
        CHECKF(bad16 == 0 && badbf == 0 && n > 3000000, "%zu fp16 / %zu bf16 of %zu not RNE", bad16,
               badbf, n);
    }
    checkpoint_close(k32);
    checkpoint_close(k16);
    checkpoint_close(kbf);
    free(d32);
    free(d16);
    free(dbf);
}

static cJSON *load_json(const char *dir, const char *file) {
    size_t n;
    char *t = slurp(dir, file, &n);
    cJSON *j = t ? cJSON_ParseWithLength(t, n) : NULL;
    free(t);
    return j;
}

static void test_side_files(void) {
    char *dir = dir_for("tiny-files");
    CHECK(make(dir, "tiny", 1, PD_F32) == 0);
    size_t vlen, blen, mlen, bmlen;
    char *vocab = slurp(dir, "vocab.json", &vlen);
    char *merges = slurp(dir, "merges.txt", &mlen);
    const char *bv = pd_builtin_vocab_json(&blen), *bm = pd_builtin_merges_txt(&bmlen);
    CHECK(vocab && vlen == blen && memcmp(vocab, bv, blen) == 0);
    CHECK(merges && mlen == bmlen && memcmp(merges, bm, bmlen) == 0);
    /* The ids written into the configs are the vocabulary's <|endoftext|>. */
    cJSON *vj = vocab ? cJSON_ParseWithLength(vocab, vlen) : NULL;
    const cJSON *eot = cJSON_GetObjectItemCaseSensitive(vj, "<|endoftext|>");
    int eot_id = cJSON_IsNumber(eot) ? eot->valueint : -1;
    opt_config c;
    pd_err e = {{0}};
    CHECK(opt_config_load(dir, &c, &e) == 0);
    CHECKF(eot_id >= 0 && c.bos_token_id == eot_id && c.eos_token_id == eot_id &&
               c.pad_token_id == eot_id,
           "eot %d", eot_id);
    CHECK(cJSON_GetArraySize(vj) <= c.vocab_size);
    cJSON_Delete(vj);
    free(vocab);
    free(merges);

    cJSON *tc = load_json(dir, "tokenizer_config.json");
    CHECK(tc != NULL);
    const char *keys[] = {"bos_token", "eos_token", "unk_token", "pad_token"};
    for (int i = 0; i < 4; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(tc, keys[i]);
        CHECKF(cJSON_IsString(v) && strcmp(v->valuestring, "<|endoftext|>") == 0, "%s", keys[i]);
    }
    CHECK(cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(tc, "add_bos_token")));
    CHECK(cJSON_IsFalse(cJSON_GetObjectItemCaseSensitive(tc, "add_prefix_space")));
    const cJSON *ml = cJSON_GetObjectItemCaseSensitive(tc, "model_max_length");
    CHECK(cJSON_IsNumber(ml) && ml->valueint == c.max_position_embeddings);
    const cJSON *cls = cJSON_GetObjectItemCaseSensitive(tc, "tokenizer_class");
    CHECK(cJSON_IsString(cls) && strcmp(cls->valuestring, "GPT2Tokenizer") == 0);
    cJSON_Delete(tc);

    cJSON *st = load_json(dir, "special_tokens_map.json");
    const cJSON *eos = cJSON_GetObjectItemCaseSensitive(st, "eos_token");
    CHECK(cJSON_IsString(eos) && strcmp(eos->valuestring, "<|endoftext|>") == 0);
    cJSON_Delete(st);
    cJSON *gc = load_json(dir, "generation_config.json");
    const cJSON *geos = cJSON_GetObjectItemCaseSensitive(gc, "eos_token_id");
    CHECK(cJSON_IsNumber(geos) && geos->valueint == eot_id);
    cJSON_Delete(gc);

    /* An index left in the directory would shadow the new file: refused. */
    char *idx = pd_path_join(dir, "model.safetensors.index.json");
    CHECK(pd_write_file(idx, "{}", 2, &e) == 0);
    CHECK(opt_make_model(dir, "tiny", 1, PD_F32, &e) == -1);
    CHECKF(strstr(e.msg, "model.safetensors.index.json"), "%s", e.msg);
    free(idx);
    CHECK(opt_make_model(dir, "huge", 1, PD_F32, &e) == -1 && strstr(e.msg, "huge"));
    free(dir);
}

int main(void) {
    test_presets();
    test_tiny_round_trip();
    test_determinism();
    test_half_variants();
    test_side_files();
    return test_finish();
}
