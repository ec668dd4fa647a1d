/* weights: the OPT parameter set, located and checked in a checkpoint.
 * Every tensor the config implies is looked up (with or without the "model."
 * prefix), checked for shape and dtype (F32/F16/BF16), and exposed as a typed
 * host view into the checkpoint's memory. lm_head falls back to embed_tokens
 * when tied or absent. Nothing is copied here; backends convert on upload. */
#ifndef PD_MODEL_WEIGHTS_H
#define PD_MODEL_WEIGHTS_H

#include <stdint.h>

#include "model/checkpoint.h"
#include "model/config.h"

/* A view of one tensor: rows x cols (a vector has rows == 1). data == NULL
 * means absent (e.g. no bias when enable_bias is false). */
typedef struct pd_view {
    const void *data;
    pd_dtype dtype;
    int64_t rows, cols;
} pd_view;

typedef struct opt_layer_weights {
    pd_view q_w, q_b, k_w, k_b, v_w, v_b, o_w, o_b; /* [h,h] and [h] */
    pd_view attn_ln_w, attn_ln_b;                    /* self_attn_layer_norm [h] */
    pd_view fc1_w, fc1_b;                            /* [f,h], [f] */
    pd_view fc2_w, fc2_b;                            /* [h,f], [h] */
    pd_view ffn_ln_w, ffn_ln_b;                      /* the layer's final_layer_norm [h] */
} opt_layer_weights;

typedef struct opt_weights {
    pd_view embed_tokens;       /* [V, w] */
    pd_view embed_positions;    /* [P+2, h] */
    pd_view project_in;         /* [h, w] or absent */
    pd_view project_out;        /* [w, h] or absent */
    pd_view final_ln_w, final_ln_b; /* decoder.final_layer_norm [h] or absent */
    pd_view lm_head;            /* [V, w]; == embed_tokens when tied */
    int num_layers;
    opt_layer_weights *layers;  /* owned: num_layers entries */
} opt_weights;

/* Locate and check every tensor. Errors name the tensor and what was wrong
 * (missing, shape [a,b] where [c,d] was expected, dtype). */
int opt_weights_bind(const opt_config *cfg, const checkpoint *ckpt, opt_weights *w, pd_err *err);
void opt_weights_release(opt_weights *w);

#endif
