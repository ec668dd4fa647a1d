/* test_weights: opt_weights_bind against synthetic checkpoints whose tensor
 * list is written here from the reference table (names, shapes, presence
 * rules), for every config variant, plus missing / mis-shaped / mis-typed
 * tensors that must fail naming the tensor. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/checkpoint.h"
#include "model/weights.h"
#include "tests/common/testlib.h"

#define MAXT 256

typedef struct {
    ckpt_tensor t[MAXT];
    int n;
} tlist;

typedef struct {
    const char *prefix;    /* "model." (re-saved) or "" (hub OPTModel) */
    const char *skip;      /* tensor (without prefix) to leave out */
    const char *bad_shape; /* tensor to store with a transposed / wrong shape */
    const char *bad_dtype; /* tensor to store as I32 */
    int mixed_dtypes;      /* alternate F32 / F16 / BF16 */
    int lm_head;           /* store a separate lm_head.weight */
    int extras;            /* store decoder.version and an unrelated tensor */
} variant;

static void add(tlist *l, const variant *v, const char *name, int64_t rows, int64_t cols) {
    if (v->skip && strcmp(name, v->skip) == 0) return;
    ckpt_tensor *t = &l->t[l->n];
    memset(t, 0, sizeof *t);
    char full[200];
    int top = strncmp(name, "lm_head", 7) == 0 || strcmp(name, "unrelated") == 0;
    snprintf(full, sizeof full, "%s%s", top ? "" : v->prefix, name);
    t->name = strdup(full);
    static const ckpt_dtype cycle[3] = {CKPT_F32, CKPT_F16, CKPT_BF16};
    t->dtype = v->mixed_dtypes ? cycle[l->n % 3] : CKPT_F32;
    if (v->bad_dtype && strcmp(name, v->bad_dtype) == 0) t->dtype = CKPT_I32;
    t->ndim = rows ? 2 : 1;
    t->shape[0] = rows ? rows : cols;
    t->shape[1] = rows ? cols : 0;
    if (v->bad_shape && strcmp(name, v->bad_shape) == 0) {
        if (rows) {
            t->shape[0] = cols, t->shape[1] = rows + 1;
        } else {
            t->shape[0] = cols + 1;
        }
    }
    size_t numel = (size_t)t->shape[0] * (size_t)(t->ndim == 2 ? t->shape[1] : 1);
    t->nbytes = numel * ckpt_dtype_size(t->dtype);
    unsigned char *d = malloc(t->nbytes ? t->nbytes : 1);
    for (size_t i = 0; i < t->nbytes; i++)
        d[i] = (unsigned char)(l->n + i);
    t->data = d;
    l->n++;
}

/* The reference table (§1.3), written out independently of weights.c. */
static void build(tlist *l, const opt_config *c, const variant *v) {
    l->n = 0;
    int64_t V = c->vocab_size, h = c->hidden_size, w = c->word_embed_proj_dim, f = c->ffn_dim;
    add(l, v, "decoder.embed_tokens.weight", V, w);
    add(l, v, "decoder.embed_positions.weight", c->max_position_embeddings + 2, h);
    if (w != h) {
        add(l, v, "decoder.project_in.weight", h, w);
        add(l, v, "decoder.project_out.weight", w, h);
    }
    if (c->do_layer_norm_before && !c->remove_final_layer_norm &&
        c->layer_norm_elementwise_affine) {
        add(l, v, "decoder.final_layer_norm.weight", 0, h);
        add(l, v, "decoder.final_layer_norm.bias", 0, h);
    }
    for (int i = 0; i < c->num_hidden_layers; i++) {
        char n[128];
        const char *proj[4] = {"q_proj", "k_proj", "v_proj", "out_proj"};
        for (int k = 0; k < 4; k++) {
            snprintf(n, sizeof n, "decoder.layers.%d.self_attn.%s.weight", i, proj[k]);
            add(l, v, n, h, h);
            if (c->enable_bias) {
                snprintf(n, sizeof n, "decoder.layers.%d.self_attn.%s.bias", i, proj[k]);
                add(l, v, n, 0, h);
            }
        }
        const char *lns[2] = {"self_attn_layer_norm", "final_layer_norm"};
        for (int k = 0; k < 2 && c->layer_norm_elementwise_affine; k++) {
            snprintf(n, sizeof n, "decoder.layers.%d.%s.weight", i, lns[k]);
            add(l, v, n, 0, h);
            snprintf(n, sizeof n, "decoder.layers.%d.%s.bias", i, lns[k]);
            add(l, v, n, 0, h);
        }
        snprintf(n, sizeof n, "decoder.layers.%d.fc1.weight", i);
        add(l, v, n, f, h);
        snprintf(n, sizeof n, "decoder.layers.%d.fc2.weight", i);
        add(l, v, n, h, f);
        if (c->enable_bias) {
            snprintf(n, sizeof n, "decoder.layers.%d.fc1.bias", i);
            add(l, v, n, 0, f);
            snprintf(n, sizeof n, "decoder.layers.%d.fc2.bias", i);
            add(l, v, n, 0, h);
        }
    }
    if (v->lm_head) add(l, v, "lm_head.weight", V, w);
    if (v->extras) {
        add(l, v, "decoder.version", 0, 1);
        add(l, v, "unrelated", 2, 2);
    }
}

static void tlist_free(tlist *l) {
    for (int i = 0; i < l->n; i++) {
        free(l->t[i].name);
        free((void *)l->t[i].data);
    }
    l->n = 0;
}

static opt_config base_config(void) {
    opt_config c;
    memset(&c, 0, sizeof c);
    c.vocab_size = 11;
    c.hidden_size = 8;
    c.num_hidden_layers = 2;
    c.ffn_dim = 12;
    c.num_attention_heads = 2;
    c.head_dim = 4;
    c.max_position_embeddings = 6;
    c.word_embed_proj_dim = 8;
    c.do_layer_norm_before = true;
    c.enable_bias = true;
    c.layer_norm_elementwise_affine = true;
    c.tie_word_embeddings = true;
    return c;
}

static int counter;

/* Write the variant's checkpoint into a fresh dir, open it and bind. On
 * success *ck stays open (caller closes) and the source list is in *l. */
static int bind_variant(const opt_config *c, const variant *v, tlist *l, checkpoint **ck,
                        opt_weights *w, pd_err *e) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/w%d", test_tmpdir(), counter++);
    pd_mkdirs(dir, e);
    build(l, c, v);
    char *path = pd_path_join(dir, "model.safetensors");
    int rc = safetensors_write(path, l->t, l->n, e);
    free(path);
    *ck = NULL;
    if (rc == 0) rc = checkpoint_open(dir, ck, e);
    if (rc == 0) rc = opt_weights_bind(c, *ck, w, e);
    return rc;
}

/* The view must show exactly the stored tensor's bytes. */
static int view_is(const pd_view *v, const checkpoint *ck, const char *name) {
    const ckpt_tensor *t = checkpoint_find(ck, name);
    return t && v->data == t->data;
}

static void check_views(const opt_config *c, const opt_weights *w, const checkpoint *ck) {
    CHECK(w->num_layers == c->num_hidden_layers && w->layers != NULL);
    CHECK(view_is(&w->embed_tokens, ck, "decoder.embed_tokens.weight"));
    CHECK(w->embed_tokens.rows == c->vocab_size && w->embed_tokens.cols == c->word_embed_proj_dim);
    CHECK(w->embed_positions.rows == c->max_position_embeddings + 2 &&
          w->embed_positions.cols == c->hidden_size);
    int proj = c->word_embed_proj_dim != c->hidden_size;
    CHECK((w->project_in.data != NULL) == proj && (w->project_out.data != NULL) == proj);
    if (proj) {
        CHECK(w->project_in.rows == c->hidden_size && w->project_in.cols == c->word_embed_proj_dim);
        CHECK(w->project_out.rows == c->word_embed_proj_dim &&
              w->project_out.cols == c->hidden_size);
    }
    int fln =
        c->do_layer_norm_before && !c->remove_final_layer_norm && c->layer_norm_elementwise_affine;
    CHECK((w->final_ln_w.data != NULL) == fln && (w->final_ln_b.data != NULL) == fln);
    for (int i = 0; i < w->num_layers; i++) {
        const opt_layer_weights *L = &w->layers[i];
        char n[128];
        snprintf(n, sizeof n, "decoder.layers.%d.fc1.weight", i);
        CHECK(view_is(&L->fc1_w, ck, n) && L->fc1_w.rows == c->ffn_dim &&
              L->fc1_w.cols == c->hidden_size);
        snprintf(n, sizeof n, "decoder.layers.%d.fc2.weight", i);
        CHECK(view_is(&L->fc2_w, ck, n) && L->fc2_w.rows == c->hidden_size &&
              L->fc2_w.cols == c->ffn_dim);
        snprintf(n, sizeof n, "decoder.layers.%d.self_attn.v_proj.weight", i);
        CHECK(view_is(&L->v_w, ck, n));
        CHECK((L->q_b.data != NULL) == c->enable_bias && (L->fc2_b.data != NULL) == c->enable_bias);
        if (c->enable_bias) {
            snprintf(n, sizeof n, "decoder.layers.%d.self_attn.out_proj.bias", i);
            CHECK(view_is(&L->o_b, ck, n) && L->o_b.rows == 1 && L->o_b.cols == c->hidden_size);
            CHECK(L->fc1_b.cols == c->ffn_dim);
        }
        int aff = c->layer_norm_elementwise_affine;
        CHECK((L->attn_ln_w.data != NULL) == aff && (L->ffn_ln_b.data != NULL) == aff);
        if (aff) {
            snprintf(n, sizeof n, "decoder.layers.%d.final_layer_norm.weight", i);
            CHECK(view_is(&L->ffn_ln_w, ck, n));
        }
    }
}

static void run_ok(const char *what, const opt_config *c, const variant *v) {
    tlist l;
    checkpoint *ck;
    opt_weights w;
    pd_err e = {{0}};
    int rc = bind_variant(c, v, &l, &ck, &w, &e);
    CHECKF(rc == 0, "%s: %s", what, e.msg);
    if (rc == 0) {
        check_views(c, &w, ck);
        const char *lm = v->lm_head && !c->tie_word_embeddings ? "lm_head.weight"
                                                               : "decoder.embed_tokens.weight";
        CHECKF(view_is(&w.lm_head, ck, lm), "%s: lm_head should be %s", what, lm);
        if (v->mixed_dtypes) {
            const ckpt_tensor *t = checkpoint_find(ck, "decoder.embed_positions.weight");
            pd_dtype want = t->dtype == CKPT_F32 ? PD_F32 : t->dtype == CKPT_F16 ? PD_F16 : PD_BF16;
            CHECK(w.embed_positions.dtype == want);
        }
        opt_weights_release(&w);
    }
    checkpoint_close(ck);
    tlist_free(&l);
}

static void run_bad(const char *what, const opt_config *c, const variant *v, const char *needle) {
    tlist l;
    checkpoint *ck;
    opt_weights w;
    pd_err e = {{0}};
    int rc = bind_variant(c, v, &l, &ck, &w, &e);
    CHECKF(rc == -1, "%s: bound", what);
    if (rc == 0) opt_weights_release(&w);
    CHECKF(strstr(e.msg, needle) != NULL, "%s: message \"%s\" lacks \"%s\"", what, e.msg, needle);
    checkpoint_close(ck);
    tlist_free(&l);
}

int main(void) {
    opt_config c = base_config();
    variant v = {.prefix = "model."};
    run_ok("pre-LN, model. prefix", &c, &v);
    variant hub = {.prefix = "", .extras = 1};
    run_ok("hub naming + extras", &c, &hub);
    variant mixed = {.prefix = "model.", .mixed_dtypes = 1};
    run_ok("mixed dtypes", &c, &mixed);

    opt_config post = base_config();
    post.do_layer_norm_before = false;
    post.word_embed_proj_dim = 4;
    run_ok("post-LN with projections", &post, &v);

    opt_config nob = base_config();
    nob.enable_bias = false;
    nob.layer_norm_elementwise_affine = false;
    run_ok("no bias, no affine", &nob, &v);

    opt_config rm = base_config();
    rm.remove_final_layer_norm = true;
    run_ok("final LN removed", &rm, &v);

    variant lm = {.prefix = "model.", .lm_head = 1};
    run_ok("tied, lm_head stored but ignored", &c, &lm);
    opt_config untied = base_config();
    untied.tie_word_embeddings = false;
    run_ok("untied lm_head", &untied, &lm);
    run_ok("untied, no lm_head: falls back", &untied, &v);

    variant miss = {.prefix = "model.", .skip = "decoder.layers.1.fc1.weight"};
    run_bad("missing tensor", &c, &miss, "missing tensor decoder.layers.1.fc1.weight");
    variant missb = {.prefix = "", .skip = "decoder.layers.0.self_attn.k_proj.bias"};
    run_bad("missing bias", &c, &missb, "missing tensor decoder.layers.0.self_attn.k_proj.bias");
    variant missp = {.prefix = "model.", .skip = "decoder.project_in.weight"};
    run_bad("missing project_in", &post, &missp, "missing tensor decoder.project_in.weight");
    variant missf = {.prefix = "model.", .skip = "decoder.final_layer_norm.bias"};
    run_bad("missing final LN", &c, &missf, "missing tensor decoder.final_layer_norm.bias");
    variant shape = {.prefix = "model.", .bad_shape = "decoder.layers.0.fc1.weight"};
    run_bad("wrong shape", &c, &shape,
            "tensor model.decoder.layers.0.fc1.weight: shape [8,13] where [12,8] was expected");
    variant shapev = {.prefix = "", .bad_shape = "decoder.layers.1.fc2.bias"};
    run_bad("wrong vector shape", &c, &shapev,
            "tensor decoder.layers.1.fc2.bias: shape [9] where [8] was expected");
    variant pos = {.prefix = "", .bad_shape = "decoder.embed_positions.weight"};
    run_bad("wrong position table", &c, &pos, "decoder.embed_positions.weight: shape");
    variant lmbad = {.prefix = "model.", .lm_head = 1, .bad_shape = "lm_head.weight"};
    run_bad("wrong lm_head shape", &untied, &lmbad, "tensor lm_head.weight: shape");
    variant dt = {.prefix = "model.", .bad_dtype = "decoder.layers.0.self_attn.q_proj.weight"};
    run_bad("wrong dtype", &c, &dt,
            "tensor model.decoder.layers.0.self_attn.q_proj.weight: dtype I32 is not supported");
    return test_finish();
}
