/* config: parse, check and write the OPT config.json (see config.h).
 *
 * The parser is strict about what it reads (types, ranges, model_type) and
 * silent about what it does not need (dropout, init_std, transformers_version
 * and other training-only or bookkeeping keys). Every error names the field. */
#include "model/config.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *pd_dtype_name(pd_dtype t) {
    switch (t) {
    case PD_F32:
        return "float32";
    case PD_F16:
        return "float16";
    case PD_BF16:
        return "bfloat16";
    }
    return "unknown";
}

int pd_dtype_parse(const char *name, pd_dtype *out) {
    static const struct {
        const char *name;
        pd_dtype t;
    } names[] = {
        {"float32", PD_F32},   {"fp32", PD_F32},  {"f32", PD_F32}, {"float", PD_F32},
        {"float16", PD_F16},   {"fp16", PD_F16},  {"f16", PD_F16}, {"half", PD_F16},
        {"bfloat16", PD_BF16}, {"bf16", PD_BF16},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (strcmp(name, names[i].name) == 0) {
            *out = names[i].t;
            return 0;
        }
    }
    return -1;
}

size_t pd_dtype_size(pd_dtype t) {
    return t == PD_F32 ? 4 : 2;
}

bool opt_config_has_final_ln(const opt_config *c) {
    return c->do_layer_norm_before && !c->remove_final_layer_norm;
}

bool opt_config_has_projections(const opt_config *c) {
    return c->word_embed_proj_dim != c->hidden_size;
}

static const char *json_type_name(const cJSON *v) {
    if (cJSON_IsString(v)) return "a string";
    if (cJSON_IsNumber(v)) return "a number";
    if (cJSON_IsBool(v)) return "a boolean";
    if (cJSON_IsNull(v)) return "null";
    if (cJSON_IsArray(v)) return "an array";
    if (cJSON_IsObject(v)) return "an object";
    return "invalid";
}

/* An integer-valued JSON number within int range. */
static int json_int(const cJSON *v, const char *field, int *out, pd_err *err) {
    if (!cJSON_IsNumber(v))
        return pd_fail(err, "config.json: field %s must be an integer, got %s", field,
                       json_type_name(v));
    double d = v->valuedouble;
    if (d != floor(d) || d < -2147483648.0 || d > 2147483647.0)
        return pd_fail(err, "config.json: field %s must be an integer, got %g", field, d);
    *out = (int)d;
    return 0;
}

/* A required positive integer. */
static int get_size(const cJSON *root, const char *field, int *out, pd_err *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, field);
    if (!v) return pd_fail(err, "config.json: missing field %s", field);
    if (json_int(v, field, out, err)) return -1;
    if (*out <= 0)
        return pd_fail(err, "config.json: field %s must be positive, got %d", field, *out);
    return 0;
}

/* An optional boolean; absent (or null) keeps the default already in *out. */
static int get_bool(const cJSON *root, const char *field, bool *out, pd_err *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, field);
    if (!v || cJSON_IsNull(v)) return 0;
    if (!cJSON_IsBool(v))
        return pd_fail(err, "config.json: field %s must be a boolean, got %s", field,
                       json_type_name(v));
    *out = cJSON_IsTrue(v);
    return 0;
}

/* An optional token id; null keeps the default. A list (allowed for
 * eos_token_id by transformers) contributes its first element. */
static int get_token_id(const cJSON *root, const char *field, int vocab, int *out, pd_err *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, field);
    if (!v || cJSON_IsNull(v)) return 0;
    if (cJSON_IsArray(v)) {
        v = cJSON_GetArrayItem(v, 0);
        if (!v) return pd_fail(err, "config.json: field %s is an empty list", field);
    }
    if (json_int(v, field, out, err)) return -1;
    if (*out < 0 || *out >= vocab)
        return pd_fail(err, "config.json: field %s = %d is outside the vocabulary [0, %d)", field,
                       *out, vocab);
    return 0;
}

static int parse_activation(const cJSON *root, pd_activation *out, pd_err *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, "activation_function");
    *out = PD_ACT_RELU;
    if (!v || cJSON_IsNull(v)) return 0;
    if (!cJSON_IsString(v))
        return pd_fail(err, "config.json: field activation_function must be a string, got %s",
                       json_type_name(v));
    static const struct {
        const char *name;
        pd_activation act;
    } acts[] = {{"relu", PD_ACT_RELU},
                {"gelu", PD_ACT_GELU},
                {"gelu_new", PD_ACT_GELU_NEW},
                {"silu", PD_ACT_SILU},
                {"swish", PD_ACT_SILU}};
    for (size_t i = 0; i < sizeof acts / sizeof acts[0]; i++) {
        if (strcmp(v->valuestring, acts[i].name) == 0) {
            *out = acts[i].act;
            return 0;
        }
    }
    return pd_fail(err,
                   "config.json: field activation_function = \"%s\" is not supported (relu, gelu, "
                   "gelu_new, silu)",
                   v->valuestring);
}

static int parse_dtype(const cJSON *root, pd_dtype *out, pd_err *err) {
    /* transformers >= 4.56 writes "dtype"; older versions "torch_dtype". */
    const char *field = "dtype";
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, field);
    if (!v || cJSON_IsNull(v)) {
        field = "torch_dtype";
        v = cJSON_GetObjectItemCaseSensitive(root, field);
    }
    *out = PD_F32;
    if (!v || cJSON_IsNull(v)) return 0;
    if (!cJSON_IsString(v))
        return pd_fail(err, "config.json: field %s must be a string, got %s", field,
                       json_type_name(v));
    const char *s = v->valuestring;
    if (strncmp(s, "torch.", 6) == 0) s += 6;
    if (strcmp(s, "float32") != 0 && strcmp(s, "float16") != 0 && strcmp(s, "bfloat16") != 0)
        return pd_fail(
            err, "config.json: field %s = \"%s\" is not supported (float32, float16, bfloat16)",
            field, v->valuestring);
    return pd_dtype_parse(s, out);
}

static int parse_root(const cJSON *root, opt_config *c, pd_err *err) {
    if (!cJSON_IsObject(root)) return pd_fail(err, "config.json: not a JSON object");

    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    if (!mt) return pd_fail(err, "config.json: missing field model_type (expected \"opt\")");
    if (!cJSON_IsString(mt))
        return pd_fail(err, "config.json: field model_type must be a string, got %s",
                       json_type_name(mt));
    if (strcmp(mt->valuestring, "opt") != 0)
        return pd_fail(err, "config.json: model_type is \"%s\", only \"opt\" is supported",
                       mt->valuestring);

    if (get_size(root, "vocab_size", &c->vocab_size, err)) return -1;
    /* Very old OPT configs (transformers 4.19) call the width d_model. */
    const char *hfield = cJSON_GetObjectItemCaseSensitive(root, "hidden_size") ? "hidden_size"
                         : cJSON_GetObjectItemCaseSensitive(root, "d_model")   ? "d_model"
                                                                               : "hidden_size";
    if (get_size(root, hfield, &c->hidden_size, err)) return -1;
    if (get_size(root, "num_hidden_layers", &c->num_hidden_layers, err)) return -1;
    if (get_size(root, "ffn_dim", &c->ffn_dim, err)) return -1;
    if (get_size(root, "num_attention_heads", &c->num_attention_heads, err)) return -1;
    if (get_size(root, "max_position_embeddings", &c->max_position_embeddings, err)) return -1;
    if (c->hidden_size % c->num_attention_heads != 0)
        return pd_fail(err,
                       "config.json: hidden_size %d is not divisible by num_attention_heads %d",
                       c->hidden_size, c->num_attention_heads);
    c->head_dim = c->hidden_size / c->num_attention_heads;
    if (c->max_position_embeddings > 0x7fffffff - 2)
        return pd_fail(err, "config.json: field max_position_embeddings is too large");

    c->word_embed_proj_dim = c->hidden_size;
    const cJSON *wp = cJSON_GetObjectItemCaseSensitive(root, "word_embed_proj_dim");
    if (wp && !cJSON_IsNull(wp)) {
        if (json_int(wp, "word_embed_proj_dim", &c->word_embed_proj_dim, err)) return -1;
        if (c->word_embed_proj_dim <= 0)
            return pd_fail(err, "config.json: field word_embed_proj_dim must be positive, got %d",
                           c->word_embed_proj_dim);
    }

    c->do_layer_norm_before = true;
    c->remove_final_layer_norm = false;
    c->enable_bias = true;
    c->layer_norm_elementwise_affine = true;
    c->tie_word_embeddings = true;
    if (get_bool(root, "do_layer_norm_before", &c->do_layer_norm_before, err) ||
        get_bool(root, "_remove_final_layer_norm", &c->remove_final_layer_norm, err) ||
        get_bool(root, "enable_bias", &c->enable_bias, err) ||
        get_bool(root, "layer_norm_elementwise_affine", &c->layer_norm_elementwise_affine, err) ||
        get_bool(root, "tie_word_embeddings", &c->tie_word_embeddings, err))
        return -1;

    if (parse_activation(root, &c->activation, err)) return -1;
    if (parse_dtype(root, &c->torch_dtype, err)) return -1;

    c->bos_token_id = 2;
    c->eos_token_id = 2;
    c->pad_token_id = 1;
    if (get_token_id(root, "bos_token_id", c->vocab_size, &c->bos_token_id, err) ||
        get_token_id(root, "eos_token_id", c->vocab_size, &c->eos_token_id, err) ||
        get_token_id(root, "pad_token_id", c->vocab_size, &c->pad_token_id, err))
        return -1;
    return 0;
}

int opt_config_parse(const char *json, size_t len, opt_config *cfg, pd_err *err) {
    memset(cfg, 0, sizeof *cfg);
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root) return pd_fail(err, "config.json: not valid JSON");
    opt_config c;
    memset(&c, 0, sizeof c);
    int rc = parse_root(root, &c, err);
    cJSON_Delete(root);
    if (rc == 0) *cfg = c;
    return rc;
}

int opt_config_load(const char *model_dir, opt_config *cfg, pd_err *err) {
    char *path = pd_path_join(model_dir, "config.json");
    if (!path) return pd_fail(err, "out of memory");
    char *text = NULL;
    size_t len = 0;
    int rc = pd_read_file(path, &text, &len, err);
    if (rc == 0) {
        rc = opt_config_parse(text, len, cfg, err);
        /* Name the file, since "config.json" alone does not say which model. */
        if (rc) pd_wrap(err, "%s", model_dir);
    }
    free(text);
    free(path);
    return rc;
}

static const char *activation_name(pd_activation a) {
    switch (a) {
    case PD_ACT_RELU:
        return "relu";
    case PD_ACT_GELU:
        return "gelu";
    case PD_ACT_GELU_NEW:
        return "gelu_new";
    case PD_ACT_SILU:
        return "silu";
    }
    return "relu";
}

char *opt_config_to_json(const opt_config *c) {
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    /* Keys in the order transformers writes them (alphabetical), training-only
     * fields with the values the hub configs carry. */
    cJSON_AddBoolToObject(o, "_remove_final_layer_norm", c->remove_final_layer_norm);
    cJSON_AddNumberToObject(o, "activation_dropout", 0.0);
    cJSON_AddStringToObject(o, "activation_function", activation_name(c->activation));
    cJSON *arch = cJSON_AddArrayToObject(o, "architectures");
    if (arch) cJSON_AddItemToArray(arch, cJSON_CreateString("OPTForCausalLM"));
    cJSON_AddNumberToObject(o, "attention_dropout", 0.0);
    cJSON_AddNumberToObject(o, "bos_token_id", c->bos_token_id);
    cJSON_AddBoolToObject(o, "do_layer_norm_before", c->do_layer_norm_before);
    cJSON_AddNumberToObject(o, "dropout", 0.1);
    cJSON_AddBoolToObject(o, "enable_bias", c->enable_bias);
    cJSON_AddNumberToObject(o, "eos_token_id", c->eos_token_id);
    cJSON_AddNumberToObject(o, "ffn_dim", c->ffn_dim);
    cJSON_AddNumberToObject(o, "hidden_size", c->hidden_size);
    cJSON_AddNumberToObject(o, "init_std", 0.02);
    cJSON_AddBoolToObject(o, "layer_norm_elementwise_affine", c->layer_norm_elementwise_affine);
    cJSON_AddNumberToObject(o, "layerdrop", 0.0);
    cJSON_AddNumberToObject(o, "max_position_embeddings", c->max_position_embeddings);
    cJSON_AddStringToObject(o, "model_type", "opt");
    cJSON_AddNumberToObject(o, "num_attention_heads", c->num_attention_heads);
    cJSON_AddNumberToObject(o, "num_hidden_layers", c->num_hidden_layers);
    cJSON_AddNumberToObject(o, "pad_token_id", c->pad_token_id);
    cJSON_AddBoolToObject(o, "tie_word_embeddings", c->tie_word_embeddings);
    cJSON_AddStringToObject(o, "torch_dtype", pd_dtype_name(c->torch_dtype));
    cJSON_AddBoolToObject(o, "use_cache", true);
    cJSON_AddNumberToObject(o, "vocab_size", c->vocab_size);
    cJSON_AddNumberToObject(o, "word_embed_proj_dim", c->word_embed_proj_dim);
    char *text = cJSON_Print(o);
    cJSON_Delete(o);
    if (!text) return NULL;
    /* cJSON allocates with malloc by default; hand back a copy with a final
     * newline so the caller can free() it and the file ends like HF's. */
    size_t n = strlen(text);
    char *out = malloc(n + 2);
    if (out) {
        memcpy(out, text, n);
        out[n] = '\n';
        out[n + 1] = 0;
    }
    cJSON_free(text);
    return out;
}
