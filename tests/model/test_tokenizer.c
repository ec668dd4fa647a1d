/* test_tokenizer: the GPT-2 byte-level BPE tokenizer against independent
 * references — the ids of the JavaScript package gpt-3-encoder on a committed
 * corpus (tests/model/data/tokenizer_corpus.json, made by
 * scripts/make-tokenizer-fixtures.js), Node's TextDecoder for U+FFFD repair,
 * a naive string-based BPE written here for strings the corpus cannot hold,
 * and round-trip / streaming properties. */
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "common/pd_common.h"
#include "model/tokenizer.h"
#include "tests/common/testlib.h"

#if defined(__SANITIZE_ADDRESS__)
#define SLOWDOWN 10.0
#else
#define SLOWDOWN 1.0
#endif

static const char *GPT2_CONFIG = "{\"bos_token\": \"<|endoftext|>\", \"eos_token\": "
                                 "{\"content\": \"<|endoftext|>\"}, \"add_bos_token\": true}";

static tokenizer *load_builtin(const char *config) {
    size_t vl, ml;
    const char *v = pd_builtin_vocab_json(&vl), *m = pd_builtin_merges_txt(&ml);
    tokenizer *tok = NULL;
    pd_err err = {{0}};
    if (tokenizer_load_mem(v, vl, m, ml, config, &tok, &err) != 0)
        fprintf(stderr, "load failed: %s\n", err.msg);
    return tok;
}

/* Print a string with non-printable bytes escaped, for failure messages. */
static void show(const char *s, size_t n) {
    for (size_t i = 0; i < n && i < 200; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c < 0x7F)
            fputc(c, stderr);
        else
            fprintf(stderr, "\\x%02x", c);
    }
    if (n > 200) fprintf(stderr, "...(%zu bytes)", n);
}

static void show_ids(const char *label, const int32_t *ids, int n) {
    fprintf(stderr, "  %s:", label);
    for (int i = 0; i < n && i < 40; i++)
        fprintf(stderr, " %d", ids[i]);
    fprintf(stderr, n > 40 ? " ...\n" : "\n");
}

static int32_t *encode(const tokenizer *tok, const char *s, size_t n, bool special, int *n_ids) {
    int32_t *ids = NULL;
    pd_err err = {{0}};
    if (tokenizer_encode(tok, s, n, special, &ids, n_ids, &err) != 0) {
        fprintf(stderr, "encode failed: %s\n", err.msg);
        *n_ids = -1;
    }
    return ids;
}

/* The concatenation of the stream outputs for ids[0..n). */
static char *stream_all(const tokenizer *tok, const int32_t *ids, int n, bool skip, size_t *len) {
    detok_stream *ds = detok_stream_create(tok, skip);
    size_t cap = 64, k = 0;
    char *acc = malloc(cap);
    for (int i = 0; i < n; i++) {
        size_t m;
        const char *piece = detok_stream_step(ds, ids[i], &m);
        while (k + m + 1 > cap)
            acc = realloc(acc, cap *= 2);
        memcpy(acc + k, piece, m);
        k += m;
    }
    acc[k] = 0;
    detok_stream_free(ds);
    *len = k;
    return acc;
}

/* ---- the corpus from gpt-3-encoder ------------------------------------------------ */

static void test_corpus(const tokenizer *tok, const cJSON *root) {
    const cJSON *cases = cJSON_GetObjectItem(root, "cases");
    CHECK(cJSON_GetArraySize(cases) >= 2000);
    int mismatches = 0, roundtrip_bad = 0, stream_bad = 0, n_cases = 0;
    for (const cJSON *c = cases ? cases->child : NULL; c; c = c->next) {
        const char *text = cJSON_GetObjectItem(c, "text")->valuestring;
        const cJSON *want = cJSON_GetObjectItem(c, "ids");
        size_t len = strlen(text);
        int n;
        int32_t *ids = encode(tok, text, len, false, &n);
        n_cases++;
        bool same = n == cJSON_GetArraySize(want);
        int i = 0;
        for (const cJSON *w = want->child; same && w; w = w->next, i++)
            same = ids[i] == (int32_t)w->valuedouble;
        if (!same && ++mismatches <= 5) {
            fprintf(stderr, "corpus mismatch for \"");
            show(text, len);
            fprintf(stderr, "\"\n");
            show_ids("ours", ids, n);
            int32_t w32[64];
            int k = 0;
            for (const cJSON *w = want->child; w && k < 64; w = w->next)
                w32[k++] = (int32_t)w->valuedouble;
            show_ids("gpt-3-encoder", w32, k);
        }
        size_t dlen;
        char *back = tokenizer_decode(tok, ids, n, false, &dlen);
        if (!back || dlen != len || memcmp(back, text, len) != 0) {
            if (++roundtrip_bad <= 3) {
                fprintf(stderr, "round trip differs for \"");
                show(text, len);
                fprintf(stderr, "\"\n");
            }
        }
        size_t slen;
        char *streamed = stream_all(tok, ids, n, false, &slen);
        if (slen != len || memcmp(streamed, text, len) != 0) stream_bad++;
        free(streamed);
        free(back);
        free(ids);
    }
    CHECKF(mismatches == 0, "%d of %d corpus cases differ from gpt-3-encoder", mismatches, n_cases);
    CHECKF(roundtrip_bad == 0, "%d cases do not round-trip", roundtrip_bad);
    CHECKF(stream_bad == 0, "%d cases stream to a different text", stream_bad);
}

/* ---- U+FFFD repair and streaming against Node's TextDecoder ----------------------- */

/* The id of the token that is exactly one raw byte. */
static void byte_ids(const tokenizer *tok, int32_t out[256]) {
    for (int b = 0; b < 256; b++)
        out[b] = -1;
    for (int id = 0; id < tokenizer_vocab_size(tok); id++) {
        size_t n;
        const char *s = tokenizer_token_bytes(tok, id, &n);
        if (s && n == 1) out[(unsigned char)s[0]] = id;
    }
}

static void test_decode_cases(const tokenizer *tok, const cJSON *root) {
    int32_t bid[256];
    byte_ids(tok, bid);
    int missing = 0;
    for (int b = 0; b < 256; b++)
        missing += bid[b] < 0;
    CHECKF(missing == 0, "%d bytes have no single-byte token", missing);
    const cJSON *cases = cJSON_GetObjectItem(root, "decode_cases");
    CHECK(cJSON_GetArraySize(cases) >= 100);
    int bad_full = 0, bad_stream = 0;
    for (const cJSON *c = cases ? cases->child : NULL; c; c = c->next) {
        const char *hex = cJSON_GetObjectItem(c, "hex")->valuestring;
        const char *full = cJSON_GetObjectItem(c, "text")->valuestring;
        const char *streamed = cJSON_GetObjectItem(c, "stream")->valuestring;
        int32_t ids[64];
        int n = 0;
        for (size_t i = 0; hex[i] && hex[i + 1] && n < 64; i += 2) {
            unsigned v;
            sscanf(hex + i, "%2x", &v);
            ids[n++] = bid[v];
        }
        size_t len;
        char *got = tokenizer_decode(tok, ids, n, false, &len);
        if (strlen(full) != len || memcmp(got, full, len) != 0) {
            if (++bad_full <= 3) fprintf(stderr, "decode of %s differs from TextDecoder\n", hex);
        }
        char *st = stream_all(tok, ids, n, false, &len);
        if (strlen(streamed) != len || memcmp(st, streamed, len) != 0) {
            if (++bad_stream <= 3) fprintf(stderr, "stream of %s differs from TextDecoder\n", hex);
        }
        free(got);
        free(st);
    }
    CHECKF(bad_full == 0, "%d decode cases differ", bad_full);
    CHECKF(bad_stream == 0, "%d stream cases differ", bad_stream);

    /* The example in the Unicode standard's section on maximal subparts:
     * 61 F1 80 80 E1 80 C2 62 80 63 80 BF 64 -> a, 3 x FFFD, b, FFFD, c, 2 x FFFD, d. */
    const unsigned char ex[] = {0x61, 0xF1, 0x80, 0x80, 0xE1, 0x80, 0xC2,
                                0x62, 0x80, 0x63, 0x80, 0xBF, 0x64};
    int32_t ids[sizeof ex];
    for (size_t i = 0; i < sizeof ex; i++)
        ids[i] = bid[ex[i]];
    char *got = tokenizer_decode(tok, ids, (int)sizeof ex, false, NULL);
    CHECK(got && strcmp(got, "a\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"
                             "b\xEF\xBF\xBD"
                             "c"
                             "\xEF\xBF\xBD\xEF\xBF\xBD"
                             "d") == 0);
    free(got);

    /* An emoji spelled as four byte tokens streams out only when complete. */
    const unsigned char robot[] = {0xF0, 0x9F, 0xA4, 0x96};
    detok_stream *ds = detok_stream_create(tok, false);
    size_t m = 99;
    for (int i = 0; i < 3; i++) {
        detok_stream_step(ds, bid[robot[i]], &m);
        CHECK(m == 0);
    }
    const char *out = detok_stream_step(ds, bid[robot[3]], &m);
    CHECK(m == 4 && memcmp(out, robot, 4) == 0);
    /* An incomplete character at the end is never flushed; a broken one before
     * more text comes out as U+FFFD. */
    detok_stream_step(ds, bid[0xE6], &m);
    CHECK(m == 0);
    out = detok_stream_step(ds, bid['x'], &m);
    CHECK(m == 4 && memcmp(out, "\xEF\xBF\xBDx", 4) == 0);
    detok_stream_free(ds);
}

/* ---- a naive reference BPE (strings, HF's loop, no cleverness) --------------------- */

typedef struct {
    const char *key;
    int val;
} kv;

static int kv_cmp(const void *a, const void *b) {
    return strcmp(((const kv *)a)->key, ((const kv *)b)->key);
}

typedef struct {
    kv *vocab, *ranks; /* sorted for bsearch; ranks are keyed "left right" */
    int n_vocab, n_ranks;
    cJSON *vocab_json;
    char *merges;
} ref_bpe;

static void ref_init(ref_bpe *r) {
    size_t vl, ml;
    const char *v = pd_builtin_vocab_json(&vl), *m = pd_builtin_merges_txt(&ml);
    r->vocab_json = cJSON_ParseWithLength(v, vl);
    r->n_vocab = cJSON_GetArraySize(r->vocab_json);
    r->vocab = malloc((size_t)r->n_vocab * sizeof *r->vocab);
    int k = 0;
    for (cJSON *it = r->vocab_json->child; it; it = it->next)
        r->vocab[k++] = (kv){it->string, (int)it->valuedouble};
    qsort(r->vocab, (size_t)k, sizeof(kv), kv_cmp);
    r->merges = malloc(ml + 1);
    memcpy(r->merges, m, ml);
    r->merges[ml] = 0;
    r->ranks = malloc(60000 * sizeof *r->ranks);
    r->n_ranks = 0;
    char *save, *line = strtok_r(r->merges, "\n", &save); /* skips the #version line below */
    for (line = strtok_r(NULL, "\n", &save); line && r->n_ranks < 60000;
         line = strtok_r(NULL, "\n", &save))
        r->ranks[r->n_ranks] = (kv){line, r->n_ranks}, r->n_ranks++;
    qsort(r->ranks, (size_t)r->n_ranks, sizeof(kv), kv_cmp);
}

static void ref_free(ref_bpe *r) {
    cJSON_Delete(r->vocab_json);
    free(r->vocab);
    free(r->ranks);
    free(r->merges);
}

static int ref_lookup(const kv *arr, int n, const char *key) {
    kv probe = {key, 0};
    const kv *hit = bsearch(&probe, arr, (size_t)n, sizeof(kv), kv_cmp);
    return hit ? hit->val : -1;
}

/* GPT-2's byte -> printable character, written directly from its definition. */
static void ref_byte_char(unsigned char b, char out[3]) {
    int n = 0, cp = -1;
    for (int x = 0; x < 256 && cp < 0; x++) {
        bool keep = (x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE);
        if (x == b) cp = keep ? x : 256 + n;
        if (!keep) n++;
    }
    memset(out, 0, 3);
    if (cp < 0x80) {
        out[0] = (char)cp;
    } else {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
    }
}

/* BPE of one pre-token, the textbook way; returns the number of ids. */
static int ref_encode_piece(const ref_bpe *r, const char *s, size_t n, int32_t *out) {
    char **sym = malloc(n * sizeof *sym);
    size_t ns = n;
    for (size_t i = 0; i < n; i++) {
        sym[i] = malloc(3);
        ref_byte_char((unsigned char)s[i], sym[i]);
    }
    char key[512];
    for (;;) {
        int best = -1;
        for (size_t i = 0; i + 1 < ns; i++) {
            snprintf(key, sizeof key, "%s %s", sym[i], sym[i + 1]);
            int rk = ref_lookup(r->ranks, r->n_ranks, key);
            if (rk >= 0 && (best < 0 || rk < best)) best = rk;
        }
        if (best < 0) break;
        size_t w = 0;
        for (size_t i = 0; i < ns;) {
            snprintf(key, sizeof key, "%s %s", sym[i], i + 1 < ns ? sym[i + 1] : "");
            if (i + 1 < ns && ref_lookup(r->ranks, r->n_ranks, key) == best) {
                char *joined = malloc(strlen(sym[i]) + strlen(sym[i + 1]) + 1);
                strcpy(joined, sym[i]);
                strcat(joined, sym[i + 1]);
                free(sym[i]);
                free(sym[i + 1]);
                sym[w++] = joined;
                i += 2;
            } else {
                sym[w++] = sym[i++];
            }
        }
        ns = w;
    }
    for (size_t i = 0; i < ns; i++) {
        out[i] = ref_lookup(r->vocab, r->n_vocab, sym[i]);
        free(sym[i]);
    }
    free(sym);
    return (int)ns;
}

/* ids(text) must equal the concatenated reference BPE of the given pre-tokens. */
static bool matches_pretokens(const tokenizer *tok, const ref_bpe *r, const char *text,
                              const char *const *pieces, bool quiet) {
    int32_t want[256];
    int nw = 0;
    for (int i = 0; pieces[i]; i++)
        nw += ref_encode_piece(r, pieces[i], strlen(pieces[i]), want + nw);
    int n;
    int32_t *got = encode(tok, text, strlen(text), false, &n);
    bool same = n == nw && memcmp(got, want, (size_t)n * sizeof *got) == 0;
    if (!same && !quiet) {
        fprintf(stderr, "pre-token check failed for \"");
        show(text, strlen(text));
        fprintf(stderr, "\"\n");
        show_ids("ours", got, n);
        show_ids("reference", want, nw);
    }
    free(got);
    return same;
}

static void test_hf_specifics(const tokenizer *tok) {
    ref_bpe r;
    ref_init(&r);
    /* The reference BPE agrees with the tokenizer on plain words (sanity). */
    CHECK(matches_pretokens(tok, &r, "Hello world", (const char *const[]){"Hello", " world", NULL},
                            false));

    /* HF's \s includes U+0085 (JS's does not): in "a \u0085b" the space and
     * U+0085 form a whitespace run followed by "b", so "\s+(?!\S)" takes just
     * the space, then U+0085 alone, then "b". */
    CHECK(matches_pretokens(tok, &r,
                            "a \xC2\x85"
                            "b",
                            (const char *const[]){"a", " ", "\xC2\x85", "b", NULL}, false));
    CHECK(matches_pretokens(tok, &r, "x\xC2\x85\xC2\x85 y",
                            (const char *const[]){"x", "\xC2\x85\xC2\x85", " y", NULL}, false));
    /* U+FEFF is not White_Space for HF (JS says it is): " \uFEFF" is a space
     * plus a non-letter, non-number run: one pre-token " ?[^\s\p{L}\p{N}]+". */
    CHECK(matches_pretokens(tok, &r,
                            " \xEF\xBB\xBF"
                            "b",
                            (const char *const[]){" \xEF\xBB\xBF", "b", NULL}, false));
    /* The JS split would differ in both cases, so the checks above can tell. */
    CHECK(!matches_pretokens(tok, &r,
                             "a \xC2\x85"
                             "b",
                             (const char *const[]){"a", " \xC2\x85", "b", NULL}, true));
    /* Commas inside longer punctuation runs (where gpt-3-encoder's pair keys
     * can collide): the tokenizer must follow the merges exactly. */
    static const char *commas[] = {",,,,", ",,,,,,,,", "\"),",   "'),", "\"],", ",\",",
                                   "),(",  ",-,",      ".,.,.,", ",,",  "(,,)"};
    for (size_t i = 0; i < sizeof commas / sizeof *commas; i++)
        CHECK(matches_pretokens(tok, &r, commas[i], (const char *const[]){commas[i], NULL}, false));
    /* U+0000 is a control character: its own pre-token between letters. */
    int n;
    int32_t *ids = encode(tok, "a\0b", 3, false, &n);
    int32_t want[8];
    int nw = ref_encode_piece(&r, "a", 1, want);
    nw += ref_encode_piece(&r, "\0", 1, want + nw);
    nw += ref_encode_piece(&r, "b", 1, want + nw);
    CHECK(n == nw && memcmp(ids, want, (size_t)n * sizeof *ids) == 0);
    free(ids);
    ref_free(&r);
}

/* ---- special tokens, BOS, bad ids, bad input ------------------------------------------ */

static int vocab_id_of(const char *token) {
    size_t vl;
    const char *v = pd_builtin_vocab_json(&vl);
    cJSON *root = cJSON_ParseWithLength(v, vl);
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(root, token);
    int id = cJSON_IsNumber(it) ? (int)it->valuedouble : -1;
    cJSON_Delete(root);
    return id;
}

static void test_specials(const tokenizer *tok) {
    int eot = vocab_id_of("<|endoftext|>");
    CHECK(eot >= 0);
    CHECK(tokenizer_bos_id(tok) == eot && tokenizer_eos_id(tok) == eot);
    CHECK(tokenizer_is_special(tok, eot));
    CHECK(!tokenizer_is_special(tok, vocab_id_of("Hello")));
    CHECK(tokenizer_vocab_size(tok) == 50257);

    int n1, n2, n3;
    int32_t *plain = encode(tok, "Hello world", 11, false, &n1);
    int32_t *with = encode(tok, "Hello world", 11, true, &n2);
    CHECK(n2 == n1 + 1 && with[0] == eot && memcmp(with + 1, plain, (size_t)n1 * 4) == 0);

    /* "<|endoftext|>" in the text is cut out before the regex, even mid-word. */
    int na, nb;
    int32_t *a = encode(tok, "Hello", 5, false, &na);
    int32_t *b = encode(tok, "world", 5, false, &nb);
    int32_t *mid = encode(tok, "Hello<|endoftext|>world", 23, false, &n3);
    CHECK(n3 == na + 1 + nb && memcmp(mid, a, (size_t)na * 4) == 0 && mid[na] == eot &&
          memcmp(mid + na + 1, b, (size_t)nb * 4) == 0);
    char *s = tokenizer_decode(tok, mid, n3, false, NULL);
    CHECK(s && strcmp(s, "Hello<|endoftext|>world") == 0);
    free(s);
    s = tokenizer_decode(tok, mid, n3, true, NULL);
    CHECK(s && strcmp(s, "Helloworld") == 0);
    free(s);
    size_t sl;
    char *st = stream_all(tok, mid, n3, true, &sl);
    CHECK(strcmp(st, "Helloworld") == 0);
    free(st);
    free(plain);
    free(with);
    free(mid);
    free(a);
    free(b);

    /* Ids outside the vocabulary decode to "". */
    int32_t odd[] = {50257, 50271, -1, 1 << 30, vocab_id_of("Hi"), 999999};
    s = tokenizer_decode(tok, odd, 6, false, &sl);
    CHECK(s && strcmp(s, "Hi") == 0 && sl == 2);
    free(s);
    CHECK(tokenizer_token_bytes(tok, 50257, &sl) == NULL && sl == 0);
    CHECK(tokenizer_token_bytes(tok, -5, NULL) == NULL);

    /* Invalid UTF-8 input is an error, with a message. */
    static const char *bad[] = {"\x80",
                                "abc\xFF",
                                "\xC0\xAF",
                                "\xED\xA0\x80",
                                "\xF4\x90\x80\x80",
                                "ok\xE2\x82",
                                "\xF8\x88\x80\x80\x80",
                                "\xC2"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        int32_t *ids = (int32_t *)1;
        int n = 7;
        pd_err err = {{0}};
        CHECK(tokenizer_encode(tok, bad[i], strlen(bad[i]), false, &ids, &n, &err) == -1);
        CHECK(ids == NULL && n == 0 && strstr(err.msg, "UTF-8") != NULL);
    }
}

/* ---- loading from a directory, good and malformed ---------------------------------------- */

static void write_str(const char *dir, const char *name, const char *data, size_t n) {
    char *p = pd_path_join(dir, name);
    pd_err err;
    if (pd_write_file(p, data, n, &err) != 0) fprintf(stderr, "%s\n", err.msg);
    free(p);
}

static void write_cstr(const char *dir, const char *name, const char *s) {
    write_str(dir, name, s, strlen(s));
}

static void remove_file(const char *dir, const char *name) {
    char *p = pd_path_join(dir, name);
    remove(p);
    free(p);
}

static int load_dir_expect_fail(const char *dir, const char *needle) {
    tokenizer *tok = (tokenizer *)1;
    pd_err err = {{0}};
    int rc = tokenizer_load(dir, &tok, &err);
    CHECKF(rc == -1 && tok == NULL && strstr(err.msg, needle) != NULL, "message was: %s", err.msg);
    return rc;
}

static void test_load_files(void) {
    size_t vl, ml;
    const char *v = pd_builtin_vocab_json(&vl), *m = pd_builtin_merges_txt(&ml);
    char dir[512];
    snprintf(dir, sizeof dir, "%s/tok", test_tmpdir());
    pd_err err;
    pd_mkdirs(dir, &err);
    write_str(dir, "vocab.json", v, vl);
    write_str(dir, "merges.txt", m, ml);

    /* GPT-2 files without a config: "<|endoftext|>" is bos/eos, and no BOS is added. */
    tokenizer *tok = NULL;
    CHECK(tokenizer_load(dir, &tok, &err) == 0);
    if (tok) {
        int eot = vocab_id_of("<|endoftext|>"), n;
        CHECK(tokenizer_bos_id(tok) == eot && tokenizer_is_special(tok, eot));
        int32_t *ids = encode(tok, "Hi", 2, true, &n);
        CHECK(n == 1 && ids[0] == vocab_id_of("Hi"));
        free(ids);
        tokenizer_free(tok);
    }

    /* A config with an added token beyond vocab.json and a pad from special_tokens_map. */
    const char *cfg = "{\"add_bos_token\": false, \"bos_token\": {\"__type\": \"AddedToken\", "
                      "\"content\": \"<|endoftext|>\"}, \"added_tokens_decoder\": {\"50257\": "
                      "{\"content\": \"<|extra|>\", \"special\": true}, \"50258\": {\"content\": "
                      "\"ünïcode\", \"special\": false}}}";
    const char *map = "{\"pad_token\": \"<|extra|>\", \"eos_token\": \"<|endoftext|>\"}";
    write_cstr(dir, "tokenizer_config.json", cfg);
    write_cstr(dir, "special_tokens_map.json", map);
    tok = NULL;
    CHECK(tokenizer_load(dir, &tok, &err) == 0);
    if (tok) {
        int n, nx, ny;
        int32_t *ids = encode(tok, "x<|extra|>yünïcode", strlen("x<|extra|>yünïcode"), true, &n);
        int32_t *x = encode(tok, "x", 1, false, &nx), *y = encode(tok, "y", 1, false, &ny);
        CHECK(n == nx + ny + 2 && ids[0] == x[0] && ids[nx] == 50257 && ids[nx + ny + 1] == 50258);
        CHECK(tokenizer_is_special(tok, 50257) && !tokenizer_is_special(tok, 50258));
        char *s = tokenizer_decode(tok, ids, n, false, NULL);
        CHECK(s && strcmp(s, "x<|extra|>yünïcode") == 0);
        free(s);
        s = tokenizer_decode(tok, ids, n, true, NULL);
        CHECK(s && strcmp(s, "xyünïcode") == 0);
        free(s);
        free(ids);
        free(x);
        free(y);
        tokenizer_free(tok);
    }
    remove_file(dir, "tokenizer_config.json");
    remove_file(dir, "special_tokens_map.json");

    /* Malformed or missing files fail with a message naming the file. */
    write_str(dir, "vocab.json", v, vl / 2);
    load_dir_expect_fail(dir, "vocab.json");
    write_cstr(dir, "vocab.json", "{\"a\": \"x\"}");
    load_dir_expect_fail(dir, "vocab.json");
    write_cstr(dir, "vocab.json", "[1, 2]");
    load_dir_expect_fail(dir, "vocab.json");
    write_cstr(dir, "vocab.json", "{\"a\": -3}");
    load_dir_expect_fail(dir, "vocab.json");
    write_str(dir, "vocab.json", v, vl);
    const char *cut = "#version: 0.2\n\xC4\xA0 t\n\xC4\xA0t\n";
    write_cstr(dir, "merges.txt", cut);
    load_dir_expect_fail(dir, "merges.txt line 3");
    /* The built-in merges cut at byte 2000 end in a line with one token. */
    write_str(dir, "merges.txt", m, 2000);
    load_dir_expect_fail(dir, "merges.txt line");
    write_cstr(dir, "merges.txt", "");
    load_dir_expect_fail(dir, "merges.txt");
    write_cstr(dir, "merges.txt", "#version: 0.2\n\xFF \x41\n");
    load_dir_expect_fail(dir, "merges.txt");
    remove_file(dir, "merges.txt");
    load_dir_expect_fail(dir, "merges.txt");
    write_str(dir, "merges.txt", m, ml);
    write_cstr(dir, "tokenizer_config.json", "{\"bos_token\": ");
    load_dir_expect_fail(dir, "tokenizer_config.json");
    write_cstr(dir, "tokenizer_config.json", "{\"bos_token\": 5}");
    load_dir_expect_fail(dir, "bos_token");
    remove_file(dir, "tokenizer_config.json");
    tok = NULL;
    CHECK(tokenizer_load(dir, &tok, &err) == 0);
    tokenizer_free(tok);
}

/* OPT's rule without any config: "</s>" is bos/eos/unk, "<pad>" is pad, and BOS
 * is prepended. (A GPT-2 vocabulary with the two tokens added stands in for
 * OPT's re-indexed one.) */
static void test_opt_fallback(void) {
    size_t vl, ml;
    const char *v = pd_builtin_vocab_json(&vl), *m = pd_builtin_merges_txt(&ml);
    const char *extra = "{\"</s>\": 50257, \"<pad>\": 50258, ";
    size_t el = strlen(extra);
    char *vocab = malloc(el + vl);
    memcpy(vocab, extra, el);
    memcpy(vocab + el, v + 1, vl - 1); /* drop the original "{" */
    tokenizer *tok = NULL;
    pd_err err = {{0}};
    CHECKF(tokenizer_load_mem(vocab, el + vl - 1, m, ml, NULL, &tok, &err) == 0, "%s", err.msg);
    free(vocab);
    if (!tok) return;
    CHECK(tokenizer_bos_id(tok) == 50257 && tokenizer_eos_id(tok) == 50257);
    CHECK(tokenizer_is_special(tok, 50257) && tokenizer_is_special(tok, 50258));
    CHECK(tokenizer_vocab_size(tok) == 50259);
    int n;
    int32_t *ids = encode(tok, "Hi</s>", 6, true, &n);
    CHECK(n == 3 && ids[0] == 50257 && ids[1] == vocab_id_of("Hi") && ids[2] == 50257);
    free(ids);
    tokenizer_free(tok);
}

static void test_speed(const tokenizer *tok, const cJSON *root) {
    /* About 1 MB of varied text: the corpus strings, repeated. */
    size_t cap = 1 << 20, len = 0;
    char *text = malloc(cap + 65536);
    const cJSON *cases = cJSON_GetObjectItem(root, "cases");
    while (len < cap)
        for (const cJSON *c = cases->child; c && len < cap; c = c->next) {
            const char *t = cJSON_GetObjectItem(c, "text")->valuestring;
            size_t n = strlen(t);
            memcpy(text + len, t, n);
            len += n;
        }
    double t0 = pd_now();
    int n;
    int32_t *ids = encode(tok, text, len, false, &n);
    double dt = pd_now() - t0;
    CHECKF(n > 0 && dt < 1.0 * SLOWDOWN, "encoding %zu bytes took %.3f s", len, dt);
    fprintf(stderr, "encode: %zu bytes -> %d ids in %.3f s\n", len, n, dt);
    free(ids);

    /* One 300 KB word must not be quadratic. */
    len = 300000;
    for (size_t i = 0; i < len; i++)
        text[i] = (char)('a' + (i * 7 + i / 13) % 26);
    t0 = pd_now();
    ids = encode(tok, text, len, false, &n);
    dt = pd_now() - t0;
    CHECKF(n > 0 && dt < 1.0 * SLOWDOWN, "a %zu-byte word took %.3f s", len, dt);
    size_t dl;
    char *back = tokenizer_decode(tok, ids, n, false, &dl);
    CHECK(back && dl == len && memcmp(back, text, len) == 0);
    free(back);
    free(ids);
    free(text);
}

int main(void) {
    tokenizer *tok = load_builtin(GPT2_CONFIG);
    CHECK(tok != NULL);
    if (!tok) return test_finish();
    char *json = NULL;
    size_t jl;
    pd_err err = {{0}};
    cJSON *root = NULL;
    if (pd_read_file(test_src_path("tests/model/data/tokenizer_corpus.json"), &json, &jl, &err) ==
        0)
        root = cJSON_ParseWithLength(json, jl);
    CHECKF(root != NULL, "cannot read the corpus: %s", err.msg);
    if (root) {
        test_corpus(tok, root);
        test_decode_cases(tok, root);
        test_speed(tok, root);
    }
    test_hf_specifics(tok);
    test_specials(tok);
    /* A model whose vocabulary does not reach the tokenizer's EOS (50256)
     * is refused by name, not indexed past at the first request. */
    CHECK(tokenizer_check_model_vocab(tok, 50272, &err) == 0);
    CHECKF(tokenizer_check_model_vocab(tok, 100, &err) != 0 &&
               strstr(err.msg, "id 50256 is outside") && strstr(err.msg, "vocab_size 100"),
           "%s", err.msg);
    test_load_files();
    test_opt_fallback();
    cJSON_Delete(root);
    free(json);
    tokenizer_free(tok);
    return test_finish();
}
