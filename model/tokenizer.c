/* tokenizer: loading a GPT-2 byte-level BPE tokenizer — vocab.json, merges.txt
 * and the special-token settings in tokenizer_config.json /
 * special_tokens_map.json — into the tables encode and decode use
 * (model/tok_bpe.c). See model/tokenizer.h and docs/tokenizer.md. */
#include "model/tokenizer.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/tok_internal.h"
#include "model/tok_text.h"

/* ---- bytes_to_unicode --------------------------------------------------- */

/* GPT-2 shows every byte as a printable character: the 188 bytes that are
 * printable in Latin-1 stand for themselves, the other 68 become U+0100,
 * U+0101, ... in byte order. */
static uint32_t byte_to_char(int b) {
    int n = 0;
    for (int x = 0; x < 256; x++) {
        bool printable = (x >= 0x21 && x <= 0x7E) || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE;
        if (x == b) return printable ? (uint32_t)x : (uint32_t)(256 + n);
        if (!printable) n++;
    }
    return 0;
}

static size_t put_utf8(uint32_t c, char *out) {
    if (c < 0x80) {
        out[0] = (char)c;
        return 1;
    }
    if (c < 0x800) {
        out[0] = (char)(0xC0 | (c >> 6));
        out[1] = (char)(0x80 | (c & 0x3F));
        return 2;
    }
    if (c < 0x10000) {
        out[0] = (char)(0xE0 | (c >> 12));
        out[1] = (char)(0x80 | ((c >> 6) & 0x3F));
        out[2] = (char)(0x80 | (c & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | (c >> 18));
    out[1] = (char)(0x80 | ((c >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((c >> 6) & 0x3F));
    out[3] = (char)(0x80 | (c & 0x3F));
    return 4;
}

/* ---- small growable buffers ---------------------------------------------- */

typedef struct {
    char *p;
    size_t len, cap;
} tbuf;

static int tbuf_put(tbuf *b, const void *data, size_t n) {
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) return -1;
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, data, n);
    b->len += n;
    b->p[b->len] = 0;
    return 0;
}

/* ---- string table (load time only): string -> symbol id ------------------ */

typedef struct {
    tbuf pool;
    size_t *off;
    uint32_t *len;
    int32_t *vocab_id; /* per symbol: its vocab.json id, or -1 */
    size_t count, cap;
    int32_t *slots; /* open addressing, -1 = free */
    size_t mask;
} strtab;

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h;
}

static int strtab_find(const strtab *t, const char *s, size_t n) {
    if (!t->slots) return -1;
    for (size_t h = hash_bytes(s, n) & t->mask;; h = (h + 1) & t->mask) {
        int32_t k = t->slots[h];
        if (k < 0) return -1;
        if (t->len[k] == n && memcmp(t->pool.p + t->off[k], s, n) == 0) return k;
    }
}

static int strtab_grow(strtab *t) {
    size_t cap = t->cap ? t->cap * 2 : 1024;
    size_t *off = realloc(t->off, cap * sizeof *off);
    if (!off) return -1;
    t->off = off;
    uint32_t *len = realloc(t->len, cap * sizeof *len);
    if (!len) return -1;
    t->len = len;
    int32_t *vid = realloc(t->vocab_id, cap * sizeof *vid);
    if (!vid) return -1;
    t->vocab_id = vid;
    /* Keep the hash table at most half full. */
    int32_t *slots = malloc(2 * cap * sizeof *slots);
    if (!slots) return -1;
    memset(slots, 0xFF, 2 * cap * sizeof *slots);
    size_t mask = 2 * cap - 1;
    for (size_t k = 0; k < t->count; k++) {
        size_t h = hash_bytes(t->pool.p + t->off[k], t->len[k]) & mask;
        while (slots[h] >= 0)
            h = (h + 1) & mask;
        slots[h] = (int32_t)k;
    }
    free(t->slots);
    t->slots = slots;
    t->mask = mask;
    t->cap = cap;
    return 0;
}

/* The symbol for string s (added with vocab id -1 if new); -1 when out of memory. */
static int strtab_intern(strtab *t, const char *s, size_t n) {
    int k = strtab_find(t, s, n);
    if (k >= 0) return k;
    if (t->count == t->cap && strtab_grow(t) != 0) return -1;
    size_t at = t->pool.len;
    if (tbuf_put(&t->pool, s, n) != 0) return -1;
    k = (int)t->count++;
    t->off[k] = at;
    t->len[k] = (uint32_t)n;
    t->vocab_id[k] = -1;
    size_t h = hash_bytes(s, n) & t->mask;
    while (t->slots[h] >= 0)
        h = (h + 1) & t->mask;
    t->slots[h] = k;
    return k;
}

static void strtab_free(strtab *t) {
    free(t->pool.p);
    free(t->off);
    free(t->len);
    free(t->vocab_id);
    free(t->slots);
}

/* ---- id tables ------------------------------------------------------------ */

static int ids_ensure(tokenizer *t, int n) {
    if (n > t->ids_cap) {
        int cap = t->ids_cap ? t->ids_cap : 1024;
        while (cap < n)
            cap *= 2;
        int64_t *off = realloc(t->id_off, (size_t)cap * sizeof *off);
        if (!off) return -1;
        t->id_off = off;
        uint32_t *len = realloc(t->id_len, (size_t)cap * sizeof *len);
        if (!len) return -1;
        t->id_len = len;
        bool *sp = realloc(t->id_special, (size_t)cap * sizeof *sp);
        if (!sp) return -1;
        t->id_special = sp;
        for (int i = t->ids_cap; i < cap; i++) {
            off[i] = -1;
            len[i] = 0;
            sp[i] = false;
        }
        t->ids_cap = cap;
    }
    if (n > t->n_ids) t->n_ids = n;
    return 0;
}

static int ids_set_bytes(tokenizer *t, tbuf *pool, int id, const char *bytes, size_t n) {
    if (ids_ensure(t, id + 1) != 0) return -1;
    t->id_off[id] = (int64_t)pool->len;
    t->id_len[id] = (uint32_t)n;
    return tbuf_put(pool, bytes, n);
}

/* The raw bytes a vocab string stands for: each character is mapped back
 * through bytes_to_unicode; a character outside that map (only seen in
 * hand-added tokens) stands for its own UTF-8. */
static int vocab_string_bytes(const int16_t inv[512], const char *s, size_t n, tbuf *out) {
    out->len = 0;
    size_t i = 0;
    while (i < n) {
        int k = tok_utf8_seq_len((const unsigned char *)s + i, n - i);
        if (k <= 0) k = 1; /* strings were checked to be UTF-8 already */
        const unsigned char *u = (const unsigned char *)s + i;
        uint32_t c = u[0];
        if (k == 2) c = ((uint32_t)(u[0] & 0x1F) << 6) | (u[1] & 0x3F);
        if (k >= 3) c = 0x10000; /* never in the byte map */
        if (c < 512 && inv[c] >= 0) {
            char b = (char)inv[c];
            if (tbuf_put(out, &b, 1) != 0) return -1;
        } else if (tbuf_put(out, s + i, (size_t)k) != 0) {
            return -1;
        }
        i += (size_t)k;
    }
    return 0;
}

/* ---- vocab.json ----------------------------------------------------------- */

static int parse_vocab(strtab *st, const char *json, size_t len, pd_err *err) {
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(json, len, &end, 0);
    if (!root) {
        size_t at = end && end >= json ? (size_t)(end - json) : 0;
        return pd_fail(err, "vocab.json: not valid JSON (error near byte %zu of %zu)", at, len);
    }
    int rc = 0;
    if (!cJSON_IsObject(root)) {
        rc = pd_fail(err, "vocab.json: expected an object mapping token strings to ids");
        goto out;
    }
    for (cJSON *it = root->child; it; it = it->next) {
        const char *key = it->string;
        size_t klen = strlen(key);
        if (!cJSON_IsNumber(it)) {
            rc = pd_fail(err, "vocab.json: the id of token \"%.40s\" is not a number", key);
            goto out;
        }
        double d = it->valuedouble;
        if (!(d >= 0 && d < (double)(1 << 24)) || floor(d) != d) {
            rc = pd_fail(err, "vocab.json: token \"%.40s\" has a bad id %g", key, d);
            goto out;
        }
        if (tok_utf8_check((const unsigned char *)key, klen) != klen) {
            rc = pd_fail(err, "vocab.json: token with id %d is not valid UTF-8", (int)d);
            goto out;
        }
        int sym = strtab_intern(st, key, klen);
        if (sym < 0) {
            rc = pd_fail(err, "vocab.json: out of memory");
            goto out;
        }
        st->vocab_id[sym] = (int32_t)d; /* a repeated key keeps its last id, as Python's json */
    }
    if (st->count == 0) rc = pd_fail(err, "vocab.json: no tokens");
out:
    cJSON_Delete(root);
    return rc;
}

/* ---- merges.txt ----------------------------------------------------------- */

static int pair_insert(tokenizer *t, int32_t a, int32_t b, int32_t rank, int32_t merged) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t h = (size_t)((key * 0x9E3779B97F4A7C15ull) >> 32) & t->pair_mask;
    while (t->pairs[h].key != TOK_EMPTY_KEY && t->pairs[h].key != key)
        h = (h + 1) & t->pair_mask;
    /* A repeated rule keeps its later rank: HF builds the ranks with
     * dict(zip(merges, range(...))), where the last duplicate wins. */
    t->pairs[h].key = key;
    t->pairs[h].rank = rank;
    t->pairs[h].merged = merged;
    return 0;
}

static bool is_ascii_space(char c) {
    return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f';
}

static int parse_merges(tokenizer *t, strtab *st, const char *txt, size_t len, pd_err *err) {
    size_t bad = tok_utf8_check((const unsigned char *)txt, len);
    if (bad != len) return pd_fail(err, "merges.txt: not valid UTF-8 (byte offset %zu)", bad);
    size_t lines = 1;
    for (size_t i = 0; i < len; i++)
        lines += txt[i] == '\n';
    size_t cap = 1024;
    while (cap < 2 * lines)
        cap *= 2;
    t->pairs = malloc(cap * sizeof *t->pairs);
    if (!t->pairs) return pd_fail(err, "merges.txt: out of memory");
    for (size_t i = 0; i < cap; i++)
        t->pairs[i].key = TOK_EMPTY_KEY;
    t->pair_mask = cap - 1;

    tbuf joined = {0};
    int rank = 0, unknown = 0, line_no = 0, rc = 0;
    size_t pos = 0;
    while (pos < len) {
        size_t eol = pos;
        while (eol < len && txt[eol] != '\n')
            eol++;
        line_no++;
        const char *field[3];
        size_t flen[3];
        int nf = 0;
        for (size_t i = pos; i < eol;) {
            if (is_ascii_space(txt[i])) {
                i++;
                continue;
            }
            size_t j = i;
            while (j < eol && !is_ascii_space(txt[j]))
                j++;
            if (nf < 3) {
                field[nf] = txt + i;
                flen[nf] = j - i;
            }
            nf++;
            i = j;
        }
        bool header = line_no == 1 && nf > 0 && field[0][0] == '#';
        if (nf != 0 && !header) {
            if (nf != 2) {
                rc = pd_fail(err, "merges.txt line %d: expected two space-separated tokens, got %d",
                             line_no, nf);
                goto out;
            }
            joined.len = 0;
            if (tbuf_put(&joined, field[0], flen[0]) || tbuf_put(&joined, field[1], flen[1])) {
                rc = pd_fail(err, "merges.txt: out of memory");
                goto out;
            }
            int a = strtab_intern(st, field[0], flen[0]);
            int b = a < 0 ? -1 : strtab_intern(st, field[1], flen[1]);
            int ab = b < 0 ? -1 : strtab_intern(st, joined.p, joined.len);
            if (ab < 0) {
                rc = pd_fail(err, "merges.txt: out of memory");
                goto out;
            }
            if (st->vocab_id[ab] < 0) unknown++;
            pair_insert(t, a, b, rank++, ab);
        }
        pos = eol + 1;
    }
    if (rank == 0) {
        rc = pd_fail(err, "merges.txt: no merge rules (empty or truncated file?)");
        goto out;
    }
    if (unknown)
        pd_log(PD_LOG_WARN, "tokenizer: %d merge results are not in vocab.json; they encode as unk",
               unknown);
out:
    free(joined.p);
    return rc;
}

/* ---- special and added tokens ---------------------------------------------- */

/* A token setting is a string or an AddedToken dict {"content": ...}. */
static int token_setting(const cJSON *v, const char *file, const char *name, const char **content,
                         pd_err *err) {
    *content = NULL;
    if (!v || cJSON_IsNull(v)) return 0;
    if (cJSON_IsString(v)) {
        *content = v->valuestring;
        return 0;
    }
    const cJSON *c = cJSON_IsObject(v) ? cJSON_GetObjectItemCaseSensitive(v, "content") : NULL;
    if (!cJSON_IsString(c))
        return pd_fail(err, "%s: %s must be a string or an object with a \"content\" string", file,
                       name);
    *content = c->valuestring;
    return 0;
}

static int added_find(const tokenizer *t, const char *content) {
    for (int i = 0; i < t->n_added; i++)
        if (strcmp(t->added[i].content, content) == 0) return i;
    return -1;
}

/* The id of a token string: an added token first, then vocab.json. */
static int token_id(const tokenizer *t, const strtab *st, const char *content) {
    int a = added_find(t, content);
    if (a >= 0) return t->added[a].id;
    int sym = strtab_find(st, content, strlen(content));
    return sym >= 0 ? st->vocab_id[sym] : -1;
}

static int added_add(tokenizer *t, const char *content, int id, bool special) {
    if (!content[0]) return 0; /* an empty string can never be matched */
    int a = added_find(t, content);
    if (a < 0) {
        tok_added *arr = realloc(t->added, (size_t)(t->n_added + 1) * sizeof *arr);
        if (!arr) return -1;
        t->added = arr;
        char *copy = strdup(content);
        if (!copy) return -1;
        arr[t->n_added].content = copy;
        arr[t->n_added].len = strlen(copy);
        arr[t->n_added].id = id;
        t->n_added++;
    } else {
        id = t->added[a].id; /* the first definition of a string wins */
    }
    if (ids_ensure(t, id + 1) != 0) return -1;
    if (special) t->id_special[id] = true;
    return 0;
}

static int by_length_desc(const void *a, const void *b) {
    size_t la = ((const tok_added *)a)->len, lb = ((const tok_added *)b)->len;
    return la < lb ? 1 : la > lb ? -1 : 0;
}

static int parse_json_file(const char *text, const char *file, cJSON **out, pd_err *err) {
    *out = NULL;
    if (!text) return 0;
    *out = cJSON_Parse(text);
    if (!*out || !cJSON_IsObject(*out)) {
        cJSON_Delete(*out);
        *out = NULL;
        return pd_fail(err, "%s: not a valid JSON object", file);
    }
    return 0;
}

static int load_specials(tokenizer *t, const strtab *st, tbuf *pool, const char *config_json,
                         const char *map_json, pd_err *err) {
    static const char *cfg_name = "tokenizer_config.json", *map_name = "special_tokens_map.json";
    cJSON *cfg = NULL, *map = NULL;
    int rc = -1;
    if (parse_json_file(config_json, cfg_name, &cfg, err) != 0) goto out;
    if (parse_json_file(map_json, map_name, &map, err) != 0) goto out;

    /* added_tokens_decoder: {"50265": {"content": "...", "special": true}, ...} */
    const cJSON *dec = cJSON_GetObjectItemCaseSensitive(cfg, "added_tokens_decoder");
    for (const cJSON *it = cJSON_IsObject(dec) ? dec->child : NULL; it; it = it->next) {
        char *endp;
        long id = strtol(it->string, &endp, 10);
        const char *content;
        if (!*it->string || *endp || id < 0 || id >= (1 << 24)) {
            pd_fail(err, "%s: added_tokens_decoder key \"%.40s\" is not a token id", cfg_name,
                    it->string);
            goto out;
        }
        if (token_setting(it, cfg_name, "an added_tokens_decoder entry", &content, err) != 0)
            goto out;
        const cJSON *sp = cJSON_GetObjectItemCaseSensitive(it, "special");
        if (!content || !content[0]) continue;
        if (tok_utf8_check((const unsigned char *)content, strlen(content)) != strlen(content)) {
            pd_fail(err, "%s: added token %ld is not valid UTF-8", cfg_name, id);
            goto out;
        }
        /* Added tokens decode to their text as written, not through the byte map. */
        if (ids_set_bytes(t, pool, (int)id, content, strlen(content)) != 0 ||
            added_add(t, content, (int)id, cJSON_IsBool(sp) ? cJSON_IsTrue(sp) : true) != 0)
            goto oom;
    }

    /* Without any setting, fall back to OPT's "</s>" or GPT-2's "<|endoftext|>". */
    const char *fallback = NULL;
    if (strtab_find(st, "</s>", 4) >= 0)
        fallback = "</s>";
    else if (strtab_find(st, "<|endoftext|>", 13) >= 0)
        fallback = "<|endoftext|>";
    static const char *names[4] = {"bos_token", "eos_token", "unk_token", "pad_token"};
    int *slots[4] = {&t->bos, &t->eos, &t->unk, &t->pad};
    const char *bos_content = NULL;
    for (int k = 0; k < 4; k++) {
        const char *content = NULL, *from_map = NULL;
        if (token_setting(cJSON_GetObjectItemCaseSensitive(cfg, names[k]), cfg_name, names[k],
                          &content, err) != 0 ||
            token_setting(cJSON_GetObjectItemCaseSensitive(map, names[k]), map_name, names[k],
                          &from_map, err) != 0)
            goto out;
        if (!content) content = from_map;
        if (!content && k < 3) content = fallback;
        if (!content && !cfg && !map && fallback && strcmp(fallback, "</s>") == 0 &&
            strtab_find(st, "<pad>", 5) >= 0)
            content = "<pad>"; /* OPT's pad token */
        if (!content) continue;
        int id = token_id(t, st, content);
        if (id < 0) {
            pd_log(PD_LOG_WARN, "tokenizer: %s \"%.40s\" is not in the vocabulary; ignored",
                   names[k], content);
            continue;
        }
        *slots[k] = id;
        if (k == 0) bos_content = content;
        if (added_add(t, content, id, true) != 0) goto oom;
    }

    for (int f = 0; f < 2; f++) {
        const cJSON *list =
            cJSON_GetObjectItemCaseSensitive(f ? map : cfg, "additional_special_tokens");
        for (const cJSON *it = cJSON_IsArray(list) ? list->child : NULL; it; it = it->next) {
            const char *content;
            if (token_setting(it, f ? map_name : cfg_name, "additional_special_tokens", &content,
                              err) != 0)
                goto out;
            int id = content ? token_id(t, st, content) : -1;
            if (id >= 0 && added_add(t, content, id, true) != 0) goto oom;
        }
    }

    /* BOS rule: add_bos_token when the config says; otherwise OPT (whose BOS is
     * "</s>") prepends it and GPT-2 does not. */
    const cJSON *ab = cJSON_GetObjectItemCaseSensitive(cfg, "add_bos_token");
    if (cJSON_IsBool(ab))
        t->add_bos = cJSON_IsTrue(ab);
    else
        t->add_bos = bos_content && strcmp(bos_content, "</s>") == 0;

    qsort(t->added, (size_t)t->n_added, sizeof *t->added, by_length_desc);
    for (int i = 0; i < t->n_added; i++)
        t->added_first_byte[(unsigned char)t->added[i].content[0]] = true;
    rc = 0;
    goto out;
oom:
    pd_fail(err, "tokenizer: out of memory");
out:
    cJSON_Delete(cfg);
    cJSON_Delete(map);
    return rc;
}

/* ---- loading ----------------------------------------------------------------- */

static int load_all(const char *vocab_json, size_t vocab_len, const char *merges, size_t merges_len,
                    const char *config_json, const char *map_json, tokenizer **out, pd_err *err) {
    *out = NULL;
    tokenizer *t = calloc(1, sizeof *t);
    if (!t) return pd_fail(err, "tokenizer: out of memory");
    t->bos = t->eos = t->unk = t->pad = -1;
    strtab st = {0};
    tbuf pool = {0}, scratch = {0};
    int rc = -1;
    if (parse_vocab(&st, vocab_json, vocab_len, err) != 0) goto out;
    t->n_vocab = (int)st.count;

    int16_t inv[512];
    memset(inv, 0xFF, sizeof inv);
    for (int b = 0; b < 256; b++) {
        uint32_t c = byte_to_char(b);
        inv[c] = (int16_t)b;
        char u[4];
        size_t n = put_utf8(c, u);
        if ((t->byte_sym[b] = strtab_intern(&st, u, n)) < 0) goto oom;
    }
    if (parse_merges(t, &st, merges, merges_len, err) != 0) goto out;

    /* Ids -> bytes, in vocab.json order, so a repeated id keeps its last string. */
    for (size_t s = 0; s < st.count; s++) {
        int id = st.vocab_id[s];
        if (id < 0) continue;
        if (vocab_string_bytes(inv, st.pool.p + st.off[s], st.len[s], &scratch) != 0 ||
            ids_set_bytes(t, &pool, id, scratch.p ? scratch.p : "", scratch.len) != 0)
            goto oom;
    }
    if (load_specials(t, &st, &pool, config_json, map_json, err) != 0) goto out;

    t->n_sym = (int)st.count;
    t->sym_vocab = st.vocab_id; /* the tokenizer keeps this array */
    st.vocab_id = NULL;
    t->id_bytes = pool.p ? pool.p : calloc(1, 1);
    pool.p = NULL;
    if (!t->id_bytes) goto oom;
    rc = 0;
    goto out;
oom:
    pd_fail(err, "tokenizer: out of memory");
out:
    strtab_free(&st);
    free(pool.p);
    free(scratch.p);
    if (rc == 0)
        *out = t;
    else
        tokenizer_free(t);
    return rc;
}

int tokenizer_load_mem(const char *vocab_json, size_t vocab_len, const char *merges,
                       size_t merges_len, const char *config_json, tokenizer **out, pd_err *err) {
    return load_all(vocab_json, vocab_len, merges, merges_len, config_json, NULL, out, err);
}

/* Read DIR/NAME into *data; a missing optional file leaves *data NULL. */
static int read_model_file(const char *dir, const char *name, bool required, char **data,
                           size_t *len, pd_err *err) {
    *data = NULL;
    *len = 0;
    char *path = pd_path_join(dir, name);
    if (!path) return pd_fail(err, "tokenizer: out of memory");
    int rc = 0;
    if (required || pd_file_exists(path)) rc = pd_read_file(path, data, len, err);
    free(path);
    return rc;
}

int tokenizer_load(const char *model_dir, tokenizer **out, pd_err *err) {
    *out = NULL;
    char *vocab = NULL, *merges = NULL, *cfg = NULL, *map = NULL;
    size_t vlen, mlen, clen, slen;
    int rc = -1;
    if (read_model_file(model_dir, "vocab.json", true, &vocab, &vlen, err) == 0 &&
        read_model_file(model_dir, "merges.txt", true, &merges, &mlen, err) == 0 &&
        read_model_file(model_dir, "tokenizer_config.json", false, &cfg, &clen, err) == 0 &&
        read_model_file(model_dir, "special_tokens_map.json", false, &map, &slen, err) == 0)
        rc = load_all(vocab, vlen, merges, mlen, cfg, map, out, err);
    if (rc != 0) pd_wrap(err, "tokenizer in %s", model_dir);
    free(vocab);
    free(merges);
    free(cfg);
    free(map);
    return rc;
}

void tokenizer_free(tokenizer *t) {
    if (!t) return;
    free(t->id_off);
    free(t->id_len);
    free(t->id_bytes);
    free(t->id_special);
    free(t->sym_vocab);
    free(t->pairs);
    for (int i = 0; i < t->n_added; i++)
        free(t->added[i].content);
    free(t->added);
    free(t);
}

int tokenizer_vocab_size(const tokenizer *t) {
    return t->n_vocab;
}
int tokenizer_bos_id(const tokenizer *t) {
    return t->bos;
}
int tokenizer_eos_id(const tokenizer *t) {
    return t->eos;
}

int tokenizer_check_model_vocab(const tokenizer *t, int vocab_size, pd_err *err) {
    const int ids[2] = {t->bos, t->eos};
    const char *names[2] = {"BOS", "EOS"};
    for (int i = 0; i < 2; i++)
        if (ids[i] >= vocab_size)
            return pd_fail(err,
                           "the tokenizer's %s id %d is outside the model's vocabulary "
                           "(vocab_size %d in config.json): tokenizer files and model do not match",
                           names[i], ids[i], vocab_size);
    return 0;
}

bool tokenizer_is_special(const tokenizer *t, int id) {
    return id >= 0 && id < t->n_ids && t->id_special[id];
}

const char *tokenizer_token_bytes(const tokenizer *t, int id, size_t *len) {
    if (id < 0 || id >= t->n_ids || t->id_off[id] < 0) {
        if (len) *len = 0;
        return NULL;
    }
    if (len) *len = t->id_len[id];
    return t->id_bytes + t->id_off[id];
}
