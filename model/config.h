/* config: the OPT model configuration (Hugging Face `config.json`, model_type
 * "opt") as a plain struct, with parsing, validation and writing. */
#ifndef PD_MODEL_CONFIG_H
#define PD_MODEL_CONFIG_H

#include <stdbool.h>
#include <stddef.h>

#include "common/pd_common.h"

/* Element types the model can store weights and KV in. */
typedef enum { PD_F32 = 0, PD_F16 = 1, PD_BF16 = 2 } pd_dtype;

const char *pd_dtype_name(pd_dtype t);          /* "float32", "float16", "bfloat16" */
int pd_dtype_parse(const char *name, pd_dtype *out); /* accepts those names + "fp16" etc. */
size_t pd_dtype_size(pd_dtype t);

typedef enum { PD_ACT_RELU = 0, PD_ACT_GELU, PD_ACT_GELU_NEW, PD_ACT_SILU } pd_activation;

typedef struct opt_config {
    int vocab_size;
    int hidden_size;             /* h (old configs: d_model) */
    int num_hidden_layers;
    int ffn_dim;
    int num_attention_heads;
    int head_dim;                /* derived: hidden_size / num_attention_heads */
    int max_position_embeddings; /* the position table has this + 2 rows */
    int word_embed_proj_dim;     /* w; == hidden_size unless project_in/out exist */
    bool do_layer_norm_before;   /* true: pre-LN (125m, 1.3b); false: post-LN (350m) */
    bool remove_final_layer_norm;
    bool enable_bias;
    bool layer_norm_elementwise_affine;
    bool tie_word_embeddings;
    pd_activation activation;
    pd_dtype torch_dtype; /* dtype the checkpoint declares */
    int bos_token_id, eos_token_id, pad_token_id;
} opt_config;

/* True when the decoder has a final layer norm (pre-LN and not removed). */
bool opt_config_has_final_ln(const opt_config *c);
/* True when project_in / project_out exist (word_embed_proj_dim != hidden_size). */
bool opt_config_has_projections(const opt_config *c);

/* Parse config.json text. Unknown keys are ignored; a wrong model_type, a
 * missing required field, a wrong type or an unsupported value is an error
 * naming the field. */
int opt_config_parse(const char *json, size_t len, opt_config *cfg, pd_err *err);
/* Load DIR/config.json. */
int opt_config_load(const char *model_dir, opt_config *cfg, pd_err *err);
/* Render as Hugging Face config.json text (caller frees). */
char *opt_config_to_json(const opt_config *cfg);

#endif
