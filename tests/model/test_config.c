/* test_config: config.json parsing of the real hub configs, defaults, aliases,
 * the writer's round trip, and malformed configs that must fail with a
 * message naming the problem. */
#include <stdlib.h>
#include <string.h>

#include "model/config.h"
#include "tests/common/testlib.h"

/* facebook/opt-125m's config.json as published (values per reference §1.2). */
static const char *hub_125m = "{\n"
                              "  \"_name_or_path\": \"facebook/opt-125m\",\n"
                              "  \"_remove_final_layer_norm\": false,\n"
                              "  \"activation_dropout\": 0.0,\n"
                              "  \"activation_function\": \"relu\",\n"
                              "  \"architectures\": [\"OPTForCausalLM\"],\n"
                              "  \"attention_dropout\": 0.0,\n"
                              "  \"bos_token_id\": 2,\n"
                              "  \"do_layer_norm_before\": true,\n"
                              "  \"dropout\": 0.1,\n"
                              "  \"eos_token_id\": 2,\n"
                              "  \"ffn_dim\": 3072,\n"
                              "  \"hidden_size\": 768,\n"
                              "  \"init_std\": 0.02,\n"
                              "  \"layerdrop\": 0.0,\n"
                              "  \"max_position_embeddings\": 2048,\n"
                              "  \"model_type\": \"opt\",\n"
                              "  \"num_attention_heads\": 12,\n"
                              "  \"num_hidden_layers\": 12,\n"
                              "  \"pad_token_id\": 1,\n"
                              "  \"prefix\": \"</s>\",\n"
                              "  \"torch_dtype\": \"float16\",\n"
                              "  \"transformers_version\": \"4.21.0.dev0\",\n"
                              "  \"use_cache\": true,\n"
                              "  \"vocab_size\": 50272,\n"
                              "  \"word_embed_proj_dim\": 768\n"
                              "}\n";

/* facebook/opt-350m: post-LN, project_in/out (512 vs 1024). */
static const char *hub_350m = "{\n"
                              "  \"_name_or_path\": \"facebook/opt-350m\",\n"
                              "  \"activation_dropout\": 0.0,\n"
                              "  \"activation_function\": \"relu\",\n"
                              "  \"architectures\": [\"OPTForCausalLM\"],\n"
                              "  \"attention_dropout\": 0.0,\n"
                              "  \"bos_token_id\": 2,\n"
                              "  \"do_layer_norm_before\": false,\n"
                              "  \"dropout\": 0.1,\n"
                              "  \"eos_token_id\": 2,\n"
                              "  \"ffn_dim\": 4096,\n"
                              "  \"hidden_size\": 1024,\n"
                              "  \"init_std\": 0.02,\n"
                              "  \"layerdrop\": 0.0,\n"
                              "  \"max_position_embeddings\": 2048,\n"
                              "  \"model_type\": \"opt\",\n"
                              "  \"num_attention_heads\": 16,\n"
                              "  \"num_hidden_layers\": 24,\n"
                              "  \"pad_token_id\": 1,\n"
                              "  \"prefix\": \"</s>\",\n"
                              "  \"torch_dtype\": \"float16\",\n"
                              "  \"transformers_version\": \"4.20.0.dev0\",\n"
                              "  \"use_cache\": true,\n"
                              "  \"vocab_size\": 50272,\n"
                              "  \"word_embed_proj_dim\": 512\n"
                              "}\n";

static int parse(const char *json, opt_config *c, pd_err *e) {
    return opt_config_parse(json, strlen(json), c, e);
}

static void test_hub_configs(void) {
    opt_config c;
    pd_err e = {{0}};
    CHECKF(parse(hub_125m, &c, &e) == 0, "%s", e.msg);
    CHECK(c.vocab_size == 50272 && c.hidden_size == 768 && c.num_hidden_layers == 12);
    CHECK(c.ffn_dim == 3072 && c.num_attention_heads == 12 && c.head_dim == 64);
    CHECK(c.max_position_embeddings == 2048 && c.word_embed_proj_dim == 768);
    CHECK(c.do_layer_norm_before && !c.remove_final_layer_norm);
    CHECK(c.enable_bias && c.layer_norm_elementwise_affine && c.tie_word_embeddings);
    CHECK(c.activation == PD_ACT_RELU && c.torch_dtype == PD_F16);
    CHECK(c.bos_token_id == 2 && c.eos_token_id == 2 && c.pad_token_id == 1);
    CHECK(opt_config_has_final_ln(&c) && !opt_config_has_projections(&c));

    CHECKF(parse(hub_350m, &c, &e) == 0, "%s", e.msg);
    CHECK(c.hidden_size == 1024 && c.num_hidden_layers == 24 && c.num_attention_heads == 16);
    CHECK(c.head_dim == 64 && c.ffn_dim == 4096 && c.word_embed_proj_dim == 512);
    CHECK(!c.do_layer_norm_before);
    CHECK(!opt_config_has_final_ln(&c) && opt_config_has_projections(&c));
}

static void test_defaults_and_aliases(void) {
    opt_config c;
    pd_err e = {{0}};
    /* Minimal: only the sizes; everything else takes HF's defaults. */
    const char *min = "{\"model_type\":\"opt\",\"vocab_size\":100,\"hidden_size\":32,"
                      "\"num_hidden_layers\":1,\"ffn_dim\":64,\"num_attention_heads\":4,"
                      "\"max_position_embeddings\":16}";
    CHECKF(parse(min, &c, &e) == 0, "%s", e.msg);
    CHECK(c.word_embed_proj_dim == 32 && c.do_layer_norm_before && c.enable_bias);
    CHECK(c.layer_norm_elementwise_affine && c.tie_word_embeddings && !c.remove_final_layer_norm);
    CHECK(c.activation == PD_ACT_RELU && c.torch_dtype == PD_F32);
    CHECK(c.bos_token_id == 2 && c.eos_token_id == 2 && c.pad_token_id == 1);

    /* d_model (transformers 4.19), dtype (>= 4.56), null word_embed_proj_dim, flags off. */
    const char *alt = "{\"model_type\":\"opt\",\"vocab_size\":100,\"d_model\":48,"
                      "\"num_hidden_layers\":3,\"ffn_dim\":64,\"num_attention_heads\":6,"
                      "\"max_position_embeddings\":16,\"word_embed_proj_dim\":null,"
                      "\"dtype\":\"bfloat16\",\"enable_bias\":false,"
                      "\"layer_norm_elementwise_affine\":false,\"tie_word_embeddings\":false,"
                      "\"_remove_final_layer_norm\":true,\"activation_function\":\"gelu_new\","
                      "\"bos_token_id\":5,\"eos_token_id\":[7,8],\"pad_token_id\":null}";
    CHECKF(parse(alt, &c, &e) == 0, "%s", e.msg);
    CHECK(c.hidden_size == 48 && c.head_dim == 8 && c.word_embed_proj_dim == 48);
    CHECK(c.torch_dtype == PD_BF16 && !c.enable_bias && !c.layer_norm_elementwise_affine);
    CHECK(!c.tie_word_embeddings && c.remove_final_layer_norm && !opt_config_has_final_ln(&c));
    CHECK(c.activation == PD_ACT_GELU_NEW);
    CHECK(c.bos_token_id == 5 && c.eos_token_id == 7 && c.pad_token_id == 1);

    const char *acts[] = {"relu", "gelu", "gelu_new", "silu"};
    pd_activation want[] = {PD_ACT_RELU, PD_ACT_GELU, PD_ACT_GELU_NEW, PD_ACT_SILU};
    for (int i = 0; i < 4; i++) {
        char buf[512];
        snprintf(buf, sizeof buf,
                 "{\"model_type\":\"opt\",\"vocab_size\":10,\"hidden_size\":8,"
                 "\"num_hidden_layers\":1,\"ffn_dim\":8,\"num_attention_heads\":2,"
                 "\"max_position_embeddings\":4,\"activation_function\":\"%s\"}",
                 acts[i]);
        CHECKF(parse(buf, &c, &e) == 0 && c.activation == want[i], "%s: %s", acts[i], e.msg);
    }
}

static int same_config(const opt_config *a, const opt_config *b) {
    return a->vocab_size == b->vocab_size && a->hidden_size == b->hidden_size &&
           a->num_hidden_layers == b->num_hidden_layers && a->ffn_dim == b->ffn_dim &&
           a->num_attention_heads == b->num_attention_heads && a->head_dim == b->head_dim &&
           a->max_position_embeddings == b->max_position_embeddings &&
           a->word_embed_proj_dim == b->word_embed_proj_dim &&
           a->do_layer_norm_before == b->do_layer_norm_before &&
           a->remove_final_layer_norm == b->remove_final_layer_norm &&
           a->enable_bias == b->enable_bias &&
           a->layer_norm_elementwise_affine == b->layer_norm_elementwise_affine &&
           a->tie_word_embeddings == b->tie_word_embeddings && a->activation == b->activation &&
           a->torch_dtype == b->torch_dtype && a->bos_token_id == b->bos_token_id &&
           a->eos_token_id == b->eos_token_id && a->pad_token_id == b->pad_token_id;
}

static void test_round_trip(void) {
    opt_config a, b;
    pd_err e = {{0}};
    CHECK(parse(hub_350m, &a, &e) == 0);
    /* Vary every field away from its default so the writer must carry it. */
    a.enable_bias = false;
    a.layer_norm_elementwise_affine = false;
    a.tie_word_embeddings = false;
    a.remove_final_layer_norm = true;
    a.activation = PD_ACT_SILU;
    a.torch_dtype = PD_BF16;
    a.bos_token_id = 11, a.eos_token_id = 12, a.pad_token_id = 13;
    char *text = opt_config_to_json(&a);
    CHECK(text != NULL);
    CHECKF(text && parse(text, &b, &e) == 0, "%s", e.msg);
    CHECK(same_config(&a, &b));
    CHECK(text && strstr(text, "\"OPTForCausalLM\"") && strstr(text, "\"torch_dtype\""));
    CHECK(text && strstr(text, "\"_remove_final_layer_norm\""));
    free(text);
}

typedef struct {
    const char *what, *json, *needle;
} bad_case;

#define SIZES                                                                                      \
    "\"vocab_size\":100,\"hidden_size\":32,\"num_hidden_layers\":1,\"ffn_dim\":64,"                \
    "\"num_attention_heads\":4,\"max_position_embeddings\":16"

static void test_malformed(void) {
    const bad_case cases[] = {
        {"not JSON", "{\"model_type\": \"opt\",", "not valid JSON"},
        {"not an object", "[1,2]", "not a JSON object"},
        {"bad model_type", "{\"model_type\":\"llama\"," SIZES "}", "model_type is \"llama\""},
        {"no model_type", "{" SIZES "}", "missing field model_type"},
        {"model_type number", "{\"model_type\":3," SIZES "}", "model_type must be a string"},
        {"missing vocab_size",
         "{\"model_type\":\"opt\",\"hidden_size\":32,\"num_hidden_layers\":1,\"ffn_dim\":64,"
         "\"num_attention_heads\":4,\"max_position_embeddings\":16}",
         "missing field vocab_size"},
        {"missing hidden_size",
         "{\"model_type\":\"opt\",\"vocab_size\":100,\"num_hidden_layers\":1,\"ffn_dim\":64,"
         "\"num_attention_heads\":4,\"max_position_embeddings\":16}",
         "missing field hidden_size"},
        {"hidden_size string",
         "{\"model_type\":\"opt\",\"vocab_size\":100,\"hidden_size\":\"32\",\"num_hidden_layers\":"
         "1,"
         "\"ffn_dim\":64,\"num_attention_heads\":4,\"max_position_embeddings\":16}",
         "hidden_size must be an integer, got a string"},
        {"fractional ffn_dim",
         "{\"model_type\":\"opt\",\"vocab_size\":100,\"hidden_size\":32,\"num_hidden_layers\":1,"
         "\"ffn_dim\":64.5,\"num_attention_heads\":4,\"max_position_embeddings\":16}",
         "ffn_dim must be an integer"},
        {"zero layers",
         "{\"model_type\":\"opt\",\"vocab_size\":100,\"hidden_size\":32,\"num_hidden_layers\":0,"
         "\"ffn_dim\":64,\"num_attention_heads\":4,\"max_position_embeddings\":16}",
         "num_hidden_layers must be positive"},
        {"negative heads",
         "{\"model_type\":\"opt\",\"vocab_size\":100,\"hidden_size\":32,\"num_hidden_layers\":1,"
         "\"ffn_dim\":64,\"num_attention_heads\":-4,\"max_position_embeddings\":16}",
         "num_attention_heads must be positive"},
        {"heads not dividing",
         "{\"model_type\":\"opt\",\"vocab_size\":100,\"hidden_size\":32,\"num_hidden_layers\":1,"
         "\"ffn_dim\":64,\"num_attention_heads\":5,\"max_position_embeddings\":16}",
         "hidden_size 32 is not divisible by num_attention_heads 5"},
        {"bool as string", "{\"model_type\":\"opt\"," SIZES ",\"do_layer_norm_before\":\"true\"}",
         "do_layer_norm_before must be a boolean, got a string"},
        {"enable_bias number", "{\"model_type\":\"opt\"," SIZES ",\"enable_bias\":1}",
         "enable_bias must be a boolean"},
        {"bad activation", "{\"model_type\":\"opt\"," SIZES ",\"activation_function\":\"tanh\"}",
         "activation_function = \"tanh\" is not supported"},
        {"bad dtype", "{\"model_type\":\"opt\"," SIZES ",\"torch_dtype\":\"int8\"}",
         "torch_dtype = \"int8\" is not supported"},
        {"dtype number", "{\"model_type\":\"opt\"," SIZES ",\"dtype\":16}",
         "dtype must be a string"},
        {"eos outside vocab", "{\"model_type\":\"opt\"," SIZES ",\"eos_token_id\":100}",
         "eos_token_id = 100 is outside the vocabulary"},
        {"bad word_embed_proj_dim", "{\"model_type\":\"opt\"," SIZES ",\"word_embed_proj_dim\":0}",
         "word_embed_proj_dim must be positive"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        opt_config c;
        pd_err e = {{0}};
        int rc = parse(cases[i].json, &c, &e);
        CHECKF(rc == -1, "%s: parsed", cases[i].what);
        CHECKF(strstr(e.msg, cases[i].needle) != NULL, "%s: message \"%s\" lacks \"%s\"",
               cases[i].what, e.msg, cases[i].needle);
    }
}

static void test_load(void) {
    opt_config c;
    pd_err e = {{0}};
    char dir[512];
    snprintf(dir, sizeof dir, "%s/cfg", test_tmpdir());
    CHECK(pd_mkdirs(dir, &e) == 0);
    CHECK(opt_config_load(dir, &c, &e) == -1);
    CHECKF(strstr(e.msg, "config.json") != NULL, "%s", e.msg);
    char *path = pd_path_join(dir, "config.json");
    CHECK(pd_write_file(path, hub_125m, strlen(hub_125m), &e) == 0);
    CHECKF(opt_config_load(dir, &c, &e) == 0 && c.hidden_size == 768, "%s", e.msg);
    const char *bad = "{\"model_type\":\"gpt2\"}";
    CHECK(pd_write_file(path, bad, strlen(bad), &e) == 0);
    CHECK(opt_config_load(dir, &c, &e) == -1);
    CHECKF(strstr(e.msg, dir) && strstr(e.msg, "gpt2"), "%s", e.msg);
    free(path);
}

static void test_dtype_helpers(void) {
    pd_dtype t;
    CHECK(pd_dtype_parse("float16", &t) == 0 && t == PD_F16);
    CHECK(pd_dtype_parse("bf16", &t) == 0 && t == PD_BF16);
    CHECK(pd_dtype_parse("fp32", &t) == 0 && t == PD_F32);
    CHECK(pd_dtype_parse("int4", &t) == -1);
    CHECK(pd_dtype_size(PD_F32) == 4 && pd_dtype_size(PD_F16) == 2 && pd_dtype_size(PD_BF16) == 2);
    for (int i = 0; i < 3; i++)
        CHECK(pd_dtype_parse(pd_dtype_name((pd_dtype)i), &t) == 0 && t == (pd_dtype)i);
}

int main(void) {
    test_hub_configs();
    test_defaults_and_aliases();
    test_round_trip();
    test_malformed();
    test_load();
    test_dtype_helpers();
    return test_finish();
}
