/* make_model: generate an OPT model directory (see make_model.h).
 *
 * Determinism: every tensor gets its own stream from a counter-based
 * splitmix64 keyed by (seed, FNV-1a hash of the tensor name); element i is
 * mix(key + (i+1)·golden), independent of chunking or threads. A value is
 * a 24-bit signed integer times a power of two, so the float product is exact
 * and no rounding mode, FMA contraction or libm call can change it; fp16 and
 * bf16 come from our own round-to-nearest-even conversion of that float. */
#include "model/make_model.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/checkpoint.h"
#include "model/safetensors.h"
#include "model/tokenizer.h"

/* GPT-2's "<|endoftext|>", the only special token of the built-in vocabulary. */
#define GPT2_EOT_ID 50256

typedef struct {
    const char *name;
    int hidden, layers, heads, ffn, proj, max_pos;
    bool pre_ln;
} preset_def;

static const preset_def presets[] = {
    {"tiny", 64, 2, 4, 256, 64, 512, true},
    {"tiny-postln", 64, 2, 4, 256, 32, 512, false},
    {"opt-125m", 768, 12, 12, 3072, 768, 2048, true},
    {"opt-350m", 1024, 24, 16, 4096, 512, 2048, false},
    {"opt-1.3b", 2048, 24, 32, 8192, 2048, 2048, true},
};

const char *opt_preset_names(void) {
    return "tiny, tiny-postln, opt-125m, opt-350m, opt-1.3b";
}

int opt_preset_config(const char *preset, opt_config *out, pd_err *err) {
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++) {
        const preset_def *p = &presets[i];
        if (strcmp(preset, p->name) != 0) continue;
        memset(out, 0, sizeof *out);
        out->vocab_size = 50272;
        out->hidden_size = p->hidden;
        out->num_hidden_layers = p->layers;
        out->ffn_dim = p->ffn;
        out->num_attention_heads = p->heads;
        out->head_dim = p->hidden / p->heads;
        out->max_position_embeddings = p->max_pos;
        out->word_embed_proj_dim = p->proj;
        out->do_layer_norm_before = p->pre_ln;
        out->remove_final_layer_norm = false;
        out->enable_bias = true;
        out->layer_norm_elementwise_affine = true;
        out->tie_word_embeddings = true;
        out->activation = PD_ACT_RELU;
        out->torch_dtype = PD_F32;
        out->bos_token_id = out->eos_token_id = out->pad_token_id = GPT2_EOT_ID;
        return 0;
    }
    return pd_fail(err, "unknown model preset \"%s\" (presets: %s)", preset, opt_preset_names());
}

/* ---- value generation ---- */

/* How a tensor's values are drawn: uniform on [center - amp, center + amp)
 * with amp = 2^-amp_log2 (std = amp / sqrt(3)). */
typedef struct {
    int amp_log2;
    int center_one; /* 1: around 1.0 (LayerNorm weights), 0: around 0 */
} value_kind;

/* round(log2(sqrt(n))) in integers: k with 2^(2k-1) <= n < 2^(2k+1). */
static int half_log2(int64_t n) {
    int l = 0;
    while (n >> (l + 1))
        l++;
    return (l + 1) / 2;
}

/* The scales were picked by running greedy decoding on the tiny presets: with
 * the plain 0.02 of OPT's init the current token dominates its own logits and
 * decoding repeats one token. Scaling by fan-in keeps every preset in the same
 * regime: a linear layer's amp is about 2/sqrt(fan_in) (std 1.15/sqrt(fan_in),
 * 0.144 for h = 64, i.e. 0.02 x 7), token embeddings the same in w, and the
 * position table twice that, so outputs move with position and prompt. */
static value_kind vk_linear(int64_t fan_in) {
    return (value_kind){half_log2(fan_in) - 1, 0};
}
static value_kind vk_embed(int64_t width) {
    return (value_kind){half_log2(width) - 1, 0};
}
static value_kind vk_pos(int64_t width) {
    return (value_kind){half_log2(width) - 2, 0};
}
static const value_kind VK_BIAS = {6, 0}; /* ±0.016 */
static const value_kind VK_LN_W = {3, 1}; /* 1 ± 0.125 */
static const value_kind VK_LN_B = {5, 0}; /* ±0.031 */

typedef struct {
    char name[96];
    int ndim;
    int64_t shape[2];
    value_kind kind;
} gen_spec;

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint64_t name_hash(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    return h;
}

/* 2^-k as a float, built from its bits (k small enough to stay normal). */
static float pow2_neg(int k) {
    uint32_t bits = (uint32_t)(127 - k) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static float gen_value(uint64_t key, uint64_t i, float scale, int center_one) {
    uint64_t r = mix64(key + (i + 1) * 0x9E3779B97F4A7C15ull);
    int32_t u = (int32_t)(r >> 40) - (1 << 23); /* uniform on [-2^23, 2^23) */
    float x = (float)u * scale;                 /* exact: 24 bits times a power of two */
    return center_one ? 1.0f + x : x;
}

static uint16_t f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40); /* quiet NaN */
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

static uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000u, exp = (x >> 23) & 0xffu, man = x & 0x7fffffu;
    if (exp == 0xff) return (uint16_t)(sign | 0x7c00u | (man ? 0x200u : 0));
    int e = (int)exp - 127 + 15;
    if (e >= 31) return (uint16_t)(sign | 0x7c00u);
    uint32_t h, rem, half;
    if (e <= 0) { /* fp16 subnormal (or zero): shift the full significand down */
        if (e < -10) return (uint16_t)sign;
        man |= 0x800000u;
        int shift = 14 - e;
        h = man >> shift;
        rem = man & ((1u << shift) - 1);
        half = 1u << (shift - 1);
    } else {
        h = ((uint32_t)e << 10) | (man >> 13);
        rem = man & 0x1fffu;
        half = 0x1000u;
    }
    if (rem > half || (rem == half && (h & 1u))) h++; /* a carry into the exponent is right */
    return (uint16_t)(sign | h);
}

/* Fill n elements starting at element `start` of one tensor's stream. */
static void gen_chunk(const gen_spec *s, uint64_t key, uint64_t start, size_t n, pd_dtype dt,
                      void *out) {
    float scale = pow2_neg(s->kind.amp_log2 + 23);
    for (size_t j = 0; j < n; j++) {
        float v = gen_value(key, start + j, scale, s->kind.center_one);
        if (dt == PD_F32)
            ((float *)out)[j] = v;
        else if (dt == PD_F16)
            ((uint16_t *)out)[j] = f32_to_f16(v);
        else
            ((uint16_t *)out)[j] = f32_to_bf16(v);
    }
}

/* ---- the tensor list ---- */

static void add_spec(gen_spec *list, int *n, const char *name, int64_t rows, int64_t cols,
                     value_kind kind) {
    gen_spec *s = &list[(*n)++];
    snprintf(s->name, sizeof s->name, "%s", name);
    s->ndim = rows ? 2 : 1;
    s->shape[0] = rows ? rows : cols;
    s->shape[1] = rows ? cols : 0;
    s->kind = kind;
}

/* HF OPTForCausalLM names; lm_head is tied, so it is not stored. */
static gen_spec *build_specs(const opt_config *c, int *count) {
    int cap = 6 + 16 * c->num_hidden_layers, n = 0;
    gen_spec *l = calloc((size_t)cap, sizeof *l);
    if (!l) return NULL;
    const int64_t V = c->vocab_size, h = c->hidden_size, w = c->word_embed_proj_dim, f = c->ffn_dim,
                  P = c->max_position_embeddings + 2;
    add_spec(l, &n, "model.decoder.embed_tokens.weight", V, w, vk_embed(w));
    add_spec(l, &n, "model.decoder.embed_positions.weight", P, h, vk_pos(h));
    if (opt_config_has_projections(c)) {
        add_spec(l, &n, "model.decoder.project_in.weight", h, w, vk_linear(w));
        add_spec(l, &n, "model.decoder.project_out.weight", w, h, vk_linear(h));
    }
    if (opt_config_has_final_ln(c)) {
        add_spec(l, &n, "model.decoder.final_layer_norm.weight", 0, h, VK_LN_W);
        add_spec(l, &n, "model.decoder.final_layer_norm.bias", 0, h, VK_LN_B);
    }
    /* Per layer: {part, rows, cols} with 0 = vector, 1 = h, 2 = f. */
    static const struct {
        const char *part;
        int rows, cols;
    } parts[] = {
        {"self_attn.q_proj.weight", 1, 1},
        {"self_attn.q_proj.bias", 0, 1},
        {"self_attn.k_proj.weight", 1, 1},
        {"self_attn.k_proj.bias", 0, 1},
        {"self_attn.v_proj.weight", 1, 1},
        {"self_attn.v_proj.bias", 0, 1},
        {"self_attn.out_proj.weight", 1, 1},
        {"self_attn.out_proj.bias", 0, 1},
        {"self_attn_layer_norm.weight", 0, 1},
        {"self_attn_layer_norm.bias", 0, 1},
        {"fc1.weight", 2, 1},
        {"fc1.bias", 0, 2},
        {"fc2.weight", 1, 2},
        {"fc2.bias", 0, 1},
        {"final_layer_norm.weight", 0, 1},
        {"final_layer_norm.bias", 0, 1},
    };
    const int64_t dim[3] = {0, h, f};
    for (int i = 0; i < c->num_hidden_layers; i++) {
        for (size_t k = 0; k < sizeof parts / sizeof parts[0]; k++) {
            char name[96];
            snprintf(name, sizeof name, "model.decoder.layers.%d.%s", i, parts[k].part);
            int64_t rows = dim[parts[k].rows], cols = dim[parts[k].cols];
            int is_ln = strstr(parts[k].part, "layer_norm") != NULL;
            int is_weight = strstr(parts[k].part, ".weight") != NULL;
            value_kind kind = is_ln       ? (is_weight ? VK_LN_W : VK_LN_B)
                              : is_weight ? vk_linear(cols)
                                          : VK_BIAS;
            add_spec(l, &n, name, rows, cols, kind);
        }
    }
    *count = n;
    return l;
}

/* ---- writing ---- */

static uint64_t spec_numel(const gen_spec *s) {
    return s->ndim == 2 ? (uint64_t)s->shape[0] * (uint64_t)s->shape[1] : (uint64_t)s->shape[0];
}

static int write_weights(const char *path, const opt_config *c, uint64_t seed, pd_dtype dt,
                         pd_err *err) {
    int n = 0;
    gen_spec *specs = build_specs(c, &n);
    ckpt_tensor *meta = calloc((size_t)(n > 0 ? n : 1), sizeof *meta);
    const size_t chunk = (size_t)1 << 18;
    void *buf = malloc(chunk * 4);
    char *hdr = NULL;
    size_t hlen = 0;
    FILE *f = NULL;
    int rc = 0;
    if (!specs || !meta || !buf) {
        rc = pd_fail(err, "out of memory");
        goto out;
    }
    ckpt_dtype cdt = dt == PD_F32 ? CKPT_F32 : dt == PD_F16 ? CKPT_F16 : CKPT_BF16;
    for (int i = 0; i < n; i++) {
        meta[i].name = specs[i].name;
        meta[i].dtype = cdt;
        meta[i].ndim = specs[i].ndim;
        meta[i].shape[0] = specs[i].shape[0];
        meta[i].shape[1] = specs[i].shape[1];
        meta[i].nbytes = (size_t)spec_numel(&specs[i]) * pd_dtype_size(dt);
    }
    /* The header is known up front, so the data can follow tensor by tensor. */
    if (safetensors_header(meta, n, &hdr, &hlen, err)) {
        rc = -1;
        goto out;
    }
    f = fopen(path, "wb");
    if (!f) {
        rc = pd_fail(err, "cannot create %s", path);
        goto out;
    }
    int bad = fwrite(hdr, 1, hlen, f) != hlen;
    for (int i = 0; i < n && !bad; i++) {
        uint64_t key = mix64(seed ^ name_hash(specs[i].name));
        uint64_t total = spec_numel(&specs[i]);
        for (uint64_t at = 0; at < total && !bad; at += chunk) {
            size_t m = (size_t)(total - at < chunk ? total - at : chunk);
            gen_chunk(&specs[i], key, at, m, dt, buf);
            bad = fwrite(buf, pd_dtype_size(dt), m, f) != m;
        }
    }
    if (fclose(f) != 0) bad = 1;
    if (bad) rc = pd_fail(err, "cannot write %s (disk full?)", path);
out:
    free(hdr);
    free(buf);
    free(meta);
    free(specs);
    return rc;
}

static int write_json(const char *dir, const char *file, cJSON *obj, pd_err *err) {
    int rc = -1;
    char *text = obj ? cJSON_Print(obj) : NULL;
    char *path = pd_path_join(dir, file);
    if (!text || !path) {
        pd_fail(err, "out of memory");
    } else {
        size_t len = strlen(text);
        text[len] = '\n'; /* replace the terminator: the file ends with a newline */
        rc = pd_write_file(path, text, len + 1, err);
    }
    cJSON_free(text);
    free(path);
    cJSON_Delete(obj);
    return rc;
}

static int write_text(const char *dir, const char *file, const char *data, size_t len,
                      pd_err *err) {
    char *path = pd_path_join(dir, file);
    if (!path) return pd_fail(err, "out of memory");
    int rc = pd_write_file(path, data, len, err);
    free(path);
    return rc;
}

static cJSON *special_tokens(void) {
    cJSON *o = cJSON_CreateObject();
    static const char *keys[] = {"bos_token", "eos_token", "unk_token", "pad_token"};
    for (int i = 0; i < 4; i++)
        cJSON_AddStringToObject(o, keys[i], "<|endoftext|>");
    return o;
}

static int write_tokenizer_files(const char *dir, const opt_config *c, pd_err *err) {
    size_t vlen, mlen;
    const char *vocab = pd_builtin_vocab_json(&vlen);
    const char *merges = pd_builtin_merges_txt(&mlen);
    if (write_text(dir, "vocab.json", vocab, vlen, err) ||
        write_text(dir, "merges.txt", merges, mlen, err))
        return -1;

    cJSON *tc = special_tokens();
    cJSON_AddBoolToObject(tc, "add_bos_token", true);
    cJSON_AddBoolToObject(tc, "add_prefix_space", false);
    cJSON *added = cJSON_AddObjectToObject(tc, "added_tokens_decoder");
    cJSON *eot = cJSON_CreateObject();
    cJSON_AddStringToObject(eot, "content", "<|endoftext|>");
    cJSON_AddBoolToObject(eot, "lstrip", false);
    cJSON_AddBoolToObject(eot, "normalized", true);
    cJSON_AddBoolToObject(eot, "rstrip", false);
    cJSON_AddBoolToObject(eot, "single_word", false);
    cJSON_AddBoolToObject(eot, "special", true);
    char id[16];
    snprintf(id, sizeof id, "%d", GPT2_EOT_ID);
    cJSON_AddItemToObject(added, id, eot);
    cJSON_AddStringToObject(tc, "errors", "replace");
    cJSON_AddNumberToObject(tc, "model_max_length", c->max_position_embeddings);
    cJSON_AddStringToObject(tc, "tokenizer_class", "GPT2Tokenizer");
    if (write_json(dir, "tokenizer_config.json", tc, err)) return -1;
    return write_json(dir, "special_tokens_map.json", special_tokens(), err);
}

static int write_generation_config(const char *dir, const opt_config *c, pd_err *err) {
    cJSON *g = cJSON_CreateObject();
    cJSON_AddBoolToObject(g, "_from_model_config", true);
    cJSON_AddNumberToObject(g, "bos_token_id", c->bos_token_id);
    cJSON_AddNumberToObject(g, "eos_token_id", c->eos_token_id);
    cJSON_AddNumberToObject(g, "pad_token_id", c->pad_token_id);
    return write_json(dir, "generation_config.json", g, err);
}

int opt_make_model(const char *dir, const char *preset, uint64_t seed, pd_dtype dtype,
                   pd_err *err) {
    opt_config c;
    if (opt_preset_config(preset, &c, err)) return -1;
    c.torch_dtype = dtype;
    if (pd_mkdirs(dir, err)) return -1;
    /* Weight files that checkpoint_open would prefer over ours would hide it. */
    static const char *shadowing[] = {"model.safetensors.index.json"};
    for (size_t i = 0; i < sizeof shadowing / sizeof shadowing[0]; i++) {
        char *p = pd_path_join(dir, shadowing[i]);
        int exists = p && pd_file_exists(p);
        free(p);
        if (exists)
            return pd_fail(err,
                           "%s already holds %s, which would be loaded instead of the new "
                           "model.safetensors; remove it or pick another directory",
                           dir, shadowing[i]);
    }
    char *cfg_text = opt_config_to_json(&c);
    if (!cfg_text) return pd_fail(err, "out of memory");
    int rc = write_text(dir, "config.json", cfg_text, strlen(cfg_text), err);
    free(cfg_text);
    if (rc) return -1;

    /* Write under a temporary name so a failed run never leaves a
     * plausible-looking but truncated model.safetensors. */
    char *tmp = pd_path_join(dir, "model.safetensors.partial");
    char *final = pd_path_join(dir, "model.safetensors");
    if (!tmp || !final) {
        rc = pd_fail(err, "out of memory");
    } else {
        rc = write_weights(tmp, &c, seed, dtype, err);
        if (rc == 0 && rename(tmp, final) != 0)
            rc = pd_fail(err, "cannot rename %s to %s", tmp, final);
        if (rc) unlink(tmp);
    }
    free(tmp);
    free(final);
    if (rc) return -1;
    if (write_generation_config(dir, &c, err) || write_tokenizer_files(dir, &c, err)) return -1;
    return 0;
}
