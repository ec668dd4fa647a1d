/* cmd_model: the model-file subcommands (make-model, tokenize, detokenize)
 * and resolution of the MODEL argument, including the built-in default model. */
#include <cjson/cJSON.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/checkpoint.h"
#include "model/make_model.h"
#include "model/tokenizer.h"
#include "server/cli.h"
#include "server/commands.h"

#define DEFAULT_PRESET "tiny"
#define DEFAULT_SEED 0

/* nftw callback: remove one file or (emptied) directory. */
static int remove_entry(const char *path, const struct stat *st, int type, struct FTW *ftw) {
    (void)st, (void)type, (void)ftw;
    return remove(path);
}

int resolve_model_arg(const char *model, char **dir_out, pd_err *err) {
    if (model) return model_path_resolve(model, dir_out, err);
    const char *home = getenv("PDSERVE_HOME");
    char base[1024];
    if (home && home[0]) snprintf(base, sizeof base, "%s", home);
    else snprintf(base, sizeof base, "%s/.cache/pdserve", getenv("HOME") ? getenv("HOME") : "/tmp");
    char dir[1100], tmp[1200], cfg[1200];
    snprintf(dir, sizeof dir, "%s/models/default-%s-seed%d", base, DEFAULT_PRESET, DEFAULT_SEED);
    snprintf(cfg, sizeof cfg, "%s/config.json", dir);
    if (!pd_file_exists(cfg)) {
        /* Several instances may start at once (prefill + decode): build in a
         * private directory and rename it into place, so nobody sees half a model. */
        pd_log(PD_LOG_INFO, "creating the built-in default model (%s preset) in %s", DEFAULT_PRESET, dir);
        snprintf(tmp, sizeof tmp, "%s.tmp.%ld", dir, (long)getpid());
        if (opt_make_model(tmp, DEFAULT_PRESET, DEFAULT_SEED, PD_F32, err) != 0)
            return pd_wrap(err, "cannot create the default model");
        if (rename(tmp, dir) != 0 && !pd_file_exists(cfg))
            return pd_fail(err, "cannot move the default model into %s", dir);
        if (pd_dir_exists(tmp) && nftw(tmp, remove_entry, 16, FTW_DEPTH | FTW_PHYS) != 0)
            pd_log(PD_LOG_WARN, "could not remove %s", tmp); /* someone else won the race */
    }
    *dir_out = strdup(dir);
    return *dir_out ? 0 : pd_fail(err, "out of memory");
}

typedef struct make_model_opts {
    const char *preset, *dtype;
    uint64_t seed;
    int help;
} make_model_opts;

static const cli_option make_model_table[] = {
    {"preset", CLI_STR, offsetof(make_model_opts, preset), "tiny", 1, 0,
     "model shape: tiny, tiny-postln, opt-125m, opt-350m, opt-1.3b"},
    {"seed", CLI_U64, offsetof(make_model_opts, seed), "0", 1, 0, "seed of the random weights"},
    {"dtype", CLI_STR, offsetof(make_model_opts, dtype), "float32", 1, 0,
     "weight dtype: float32, float16, bfloat16"},
    {"help", CLI_BOOL, offsetof(make_model_opts, help), "false", 1, 0, "show this help"},
};

int cmd_make_model(int argc, char **argv) {
    make_model_opts o;
    char *pos[2];
    int n_pos;
    pd_err err = {{0}};
    int n_table = (int)(sizeof make_model_table / sizeof make_model_table[0]);
    if (cli_parse(make_model_table, n_table, &o, argc, argv, pos, 2, &n_pos, NULL, &err) != 0) {
        fprintf(stderr, "pdserve make-model: %s\n", err.msg);
        return 2;
    }
    if (o.help) {
        cli_print_help("pdserve make-model DIR [options]", make_model_table, n_table);
        return 0;
    }
    if (n_pos != 1) {
        fprintf(stderr, "pdserve make-model: expected exactly one output directory\n");
        return 2;
    }
    pd_dtype dtype;
    if (pd_dtype_parse(o.dtype, &dtype) != 0) {
        fprintf(stderr, "pdserve make-model: --dtype: unknown dtype '%s'\n", o.dtype);
        return 2;
    }
    double t0 = pd_now();
    if (opt_make_model(pos[0], o.preset, o.seed, dtype, &err) != 0) {
        fprintf(stderr, "pdserve make-model: %s\n", err.msg);
        return 1;
    }
    fprintf(stderr, "wrote %s model (%s, seed %llu) to %s in %.2f s\n", o.preset, pd_dtype_name(dtype),
            (unsigned long long)o.seed, pos[0], pd_now() - t0);
    return 0;
}

typedef struct tokenize_opts {
    int no_special, help;
} tokenize_opts;

static const cli_option tokenize_table[] = {
    {"no-special", CLI_BOOL, offsetof(tokenize_opts, no_special), "false", 1, 0,
     "do not add special tokens (the BOS OPT prepends); for detokenize: keep special tokens"},
    {"help", CLI_BOOL, offsetof(tokenize_opts, help), "false", 1, 0, "show this help"},
};

/* Shared start of tokenize/detokenize: options, model, tokenizer. */
static int open_tokenizer(const char *name, int argc, char **argv, tokenize_opts *o, tokenizer **tok) {
    char *pos[1];
    int n_pos;
    pd_err err = {{0}};
    int n_table = (int)(sizeof tokenize_table / sizeof tokenize_table[0]);
    if (cli_parse(tokenize_table, n_table, o, argc, argv, pos, 1, &n_pos, NULL, &err) != 0) {
        fprintf(stderr, "pdserve %s: %s\n", name, err.msg);
        return 2;
    }
    if (o->help) {
        char usage[128];
        snprintf(usage, sizeof usage, "pdserve %s [MODEL] [options] < input", name);
        cli_print_help(usage, tokenize_table, n_table);
        return -1;
    }
    char *dir = NULL;
    if (resolve_model_arg(n_pos ? pos[0] : NULL, &dir, &err) != 0 || tokenizer_load(dir, tok, &err) != 0) {
        fprintf(stderr, "pdserve %s: %s\n", name, err.msg);
        free(dir);
        return 1;
    }
    free(dir);
    return 0;
}

static char *read_stdin(size_t *len) {
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap + 1);
    while (buf) {
        size_t got = fread(buf + n, 1, cap - n, stdin);
        n += got;
        if (got == 0) break;
        if (n == cap) {
            char *nb = realloc(buf, cap * 2 + 1);
            if (!nb) {
                free(buf);
                return NULL;
            }
            buf = nb;
            cap *= 2;
        }
    }
    if (buf) buf[n] = 0;
    *len = n;
    return buf;
}

int cmd_tokenize(int argc, char **argv) {
    tokenize_opts o;
    tokenizer *tok = NULL;
    int rc = open_tokenizer("tokenize", argc, argv, &o, &tok);
    if (rc) return rc < 0 ? 0 : rc;
    size_t len;
    char *text = read_stdin(&len);
    int32_t *ids = NULL;
    int n = 0;
    pd_err err = {{0}};
    if (!text || tokenizer_encode(tok, text, len, !o.no_special, &ids, &n, &err) != 0) {
        fprintf(stderr, "pdserve tokenize: %s\n", text ? err.msg : "cannot read stdin");
        rc = 1;
    } else {
        putchar('[');
        for (int i = 0; i < n; i++) printf(i ? ", %d" : "%d", ids[i]);
        printf("]\n");
    }
    free(ids);
    free(text);
    tokenizer_free(tok);
    return rc;
}

int cmd_detokenize(int argc, char **argv) {
    tokenize_opts o;
    tokenizer *tok = NULL;
    int rc = open_tokenizer("detokenize", argc, argv, &o, &tok);
    if (rc) return rc < 0 ? 0 : rc;
    size_t len;
    char *text = read_stdin(&len);
    cJSON *arr = text ? cJSON_ParseWithLength(text, len) : NULL;
    int n = cJSON_IsArray(arr) ? cJSON_GetArraySize(arr) : -1;
    int32_t *ids = n > 0 ? malloc(sizeof(int32_t) * (size_t)n) : NULL;
    if (n < 0 || (n > 0 && !ids)) {
        fprintf(stderr, "pdserve detokenize: expected a JSON array of token ids on stdin\n");
        rc = 1;
    }
    for (int i = 0; rc == 0 && i < n; i++) {
        cJSON *item = cJSON_GetArrayItem(arr, i);
        double v = cJSON_IsNumber(item) ? item->valuedouble : -1;
        if (v < 0 || v > 2147483647.0 || v != (double)(int32_t)v) {
            fprintf(stderr, "pdserve detokenize: element %d is not a token id (a non-negative integer)\n", i);
            rc = 1;
        } else {
            ids[i] = (int32_t)v;
        }
    }
    if (rc == 0) {
        size_t out_len;
        /* Default matches HF decode(skip_special_tokens=True); --no-special keeps them. */
        char *out = tokenizer_decode(tok, ids, n, !o.no_special, &out_len);
        if (out) fwrite(out, 1, out_len, stdout);
        free(out);
    }
    free(ids);
    cJSON_Delete(arr);
    free(text);
    tokenizer_free(tok);
    return rc;
}
