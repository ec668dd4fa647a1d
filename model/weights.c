/* weights: find and check every OPT parameter in a checkpoint (see weights.h).
 *
 * The config decides which tensors must exist (reference table: biases only
 * with enable_bias, LayerNorm parameters only when affine, project_in/out when
 * word_embed_proj_dim != hidden_size, the decoder's final LayerNorm only for
 * pre-LN models that did not remove it). Tensors the config does not imply
 * (decoder.version, a tied lm_head.weight) are ignored. */
#include "model/weights.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int view_dtype(ckpt_dtype t, pd_dtype *out) {
    switch (t) {
    case CKPT_F32:
        *out = PD_F32;
        return 0;
    case CKPT_F16:
        *out = PD_F16;
        return 0;
    case CKPT_BF16:
        *out = PD_BF16;
        return 0;
    default:
        return -1;
    }
}

static void shape_str(const int64_t *shape, int ndim, char *buf, size_t cap) {
    size_t k = 0;
    k += (size_t)snprintf(buf + k, cap - k, "[");
    for (int i = 0; i < ndim && k < cap; i++)
        k += (size_t)snprintf(buf + k, cap - k, i ? ",%lld" : "%lld", (long long)shape[i]);
    if (k < cap) snprintf(buf + k, cap - k, "]");
}

/* Bind one tensor: a matrix [rows, cols], or a vector [cols] when rows == 0. */
static int bind_one(const checkpoint *ck, const char *name, int64_t rows, int64_t cols, pd_view *v,
                    pd_err *err) {
    const ckpt_tensor *t = checkpoint_find(ck, name);
    if (!t) return pd_fail(err, "missing tensor %s (also tried with/without \"model.\")", name);
    int64_t want[2] = {rows, cols};
    const int64_t *wp = rows ? want : want + 1;
    int wn = rows ? 2 : 1;
    int ok = t->ndim == wn;
    for (int i = 0; ok && i < wn; i++)
        ok = t->shape[i] == wp[i];
    if (!ok) {
        char got[128], exp[64];
        shape_str(t->shape, t->ndim, got, sizeof got);
        shape_str(wp, wn, exp, sizeof exp);
        return pd_fail(err, "tensor %s: shape %s where %s was expected", t->name, got, exp);
    }
    if (view_dtype(t->dtype, &v->dtype))
        return pd_fail(err, "tensor %s: dtype %s is not supported (F32, F16 or BF16 expected)",
                       t->name, ckpt_dtype_name(t->dtype));
    v->data = t->data;
    v->rows = rows ? rows : 1;
    v->cols = cols;
    return 0;
}

static int bind_fmt(const checkpoint *ck, int64_t rows, int64_t cols, pd_view *v, pd_err *err,
                    const char *fmt, int layer, const char *part) {
    char name[160];
    snprintf(name, sizeof name, fmt, layer, part);
    return bind_one(ck, name, rows, cols, v, err);
}

static int bind_layer(const opt_config *c, const checkpoint *ck, int i, opt_layer_weights *L,
                      pd_err *err) {
    const int64_t h = c->hidden_size, f = c->ffn_dim;
    const char *lf = "decoder.layers.%d.%s";
    struct {
        const char *part;
        int64_t rows, cols;
        pd_view *v;
        int present;
    } items[] = {
        {"self_attn.q_proj.weight", h, h, &L->q_w, 1},
        {"self_attn.q_proj.bias", 0, h, &L->q_b, c->enable_bias},
        {"self_attn.k_proj.weight", h, h, &L->k_w, 1},
        {"self_attn.k_proj.bias", 0, h, &L->k_b, c->enable_bias},
        {"self_attn.v_proj.weight", h, h, &L->v_w, 1},
        {"self_attn.v_proj.bias", 0, h, &L->v_b, c->enable_bias},
        {"self_attn.out_proj.weight", h, h, &L->o_w, 1},
        {"self_attn.out_proj.bias", 0, h, &L->o_b, c->enable_bias},
        {"self_attn_layer_norm.weight", 0, h, &L->attn_ln_w, c->layer_norm_elementwise_affine},
        {"self_attn_layer_norm.bias", 0, h, &L->attn_ln_b, c->layer_norm_elementwise_affine},
        {"fc1.weight", f, h, &L->fc1_w, 1},
        {"fc1.bias", 0, f, &L->fc1_b, c->enable_bias},
        {"fc2.weight", h, f, &L->fc2_w, 1},
        {"fc2.bias", 0, h, &L->fc2_b, c->enable_bias},
        {"final_layer_norm.weight", 0, h, &L->ffn_ln_w, c->layer_norm_elementwise_affine},
        {"final_layer_norm.bias", 0, h, &L->ffn_ln_b, c->layer_norm_elementwise_affine},
    };
    for (size_t k = 0; k < sizeof items / sizeof items[0]; k++)
        if (items[k].present &&
            bind_fmt(ck, items[k].rows, items[k].cols, items[k].v, err, lf, i, items[k].part))
            return -1;
    return 0;
}

int opt_weights_bind(const opt_config *c, const checkpoint *ck, opt_weights *w, pd_err *err) {
    memset(w, 0, sizeof *w);
    const int64_t V = c->vocab_size, h = c->hidden_size, wd = c->word_embed_proj_dim;
    const int64_t P = (int64_t)c->max_position_embeddings + 2; /* OPT's position offset of 2 */
    if (bind_one(ck, "decoder.embed_tokens.weight", V, wd, &w->embed_tokens, err) ||
        bind_one(ck, "decoder.embed_positions.weight", P, h, &w->embed_positions, err))
        return -1;
    if (opt_config_has_projections(c) &&
        (bind_one(ck, "decoder.project_in.weight", h, wd, &w->project_in, err) ||
         bind_one(ck, "decoder.project_out.weight", wd, h, &w->project_out, err)))
        return -1;
    if (opt_config_has_final_ln(c) && c->layer_norm_elementwise_affine &&
        (bind_one(ck, "decoder.final_layer_norm.weight", 0, h, &w->final_ln_w, err) ||
         bind_one(ck, "decoder.final_layer_norm.bias", 0, h, &w->final_ln_b, err)))
        return -1;

    w->lm_head = w->embed_tokens;
    if (!c->tie_word_embeddings) {
        /* lm_head sits beside "model", so no prefix games: look it up as stored. */
        if (checkpoint_find(ck, "lm_head.weight")) {
            if (bind_one(ck, "lm_head.weight", V, wd, &w->lm_head, err)) return -1;
        } else {
            pd_log(PD_LOG_WARN, "tie_word_embeddings is false but there is no lm_head.weight; "
                                "using embed_tokens");
        }
    }

    /* The last layer first: a config that claims more layers than the
     * checkpoint has is told so by name, before a table is sized for it. */
    if (c->num_hidden_layers < 1)
        return pd_fail(err, "config.json has num_hidden_layers %d", c->num_hidden_layers);
    {
        char last[96];
        snprintf(last, sizeof last, "decoder.layers.%d.self_attn.q_proj.weight",
                 c->num_hidden_layers - 1);
        if (!checkpoint_find(ck, last))
            return pd_fail(err,
                           "config.json has num_hidden_layers %d, but the checkpoint has no %s "
                           "(also tried with \"model.\")",
                           c->num_hidden_layers, last);
    }
    w->layers = calloc((size_t)c->num_hidden_layers, sizeof *w->layers);
    if (!w->layers) return pd_fail(err, "out of memory");
    w->num_layers = c->num_hidden_layers;
    for (int i = 0; i < c->num_hidden_layers; i++) {
        if (bind_layer(c, ck, i, &w->layers[i], err)) {
            opt_weights_release(w);
            return -1;
        }
    }
    return 0;
}

void opt_weights_release(opt_weights *w) {
    if (!w) return;
    free(w->layers);
    memset(w, 0, sizeof *w);
}
