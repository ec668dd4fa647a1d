/* tok_bpe: the running half of the tokenizer — encode (added tokens, then the
 * pre-tokenizer, then byte-level BPE by merge rank), decode with U+FFFD repair,
 * and the streaming detokenizer. Tables come from model/tokenizer.c. */
#include <stdlib.h>
#include <string.h>

#include "model/tok_internal.h"
#include "model/tok_text.h"
#include "model/tokenizer.h"

/* Scratch space for BPE on one pre-token, grown to the longest one seen. The
 * symbols form a linked list over byte positions: a merge keeps the left
 * position and unlinks the right one, so positions never move. */
typedef struct {
    int32_t *sym, *next, *prev;
    uint32_t *round, *merged; /* positions taken in this round; those merged */
    size_t cap;
    uint64_t *heap; /* (rank << 32) | position, smallest first */
    size_t heap_len, heap_cap;
} bpe_work;

static int work_reserve(bpe_work *w, size_t n) {
    if (n <= w->cap) return 0;
    size_t cap = w->cap ? w->cap : 64;
    while (cap < n)
        cap *= 2;
    int32_t *a = realloc(w->sym, cap * sizeof *a);
    if (!a) return -1;
    w->sym = a;
    if (!(a = realloc(w->next, cap * sizeof *a))) return -1;
    w->next = a;
    if (!(a = realloc(w->prev, cap * sizeof *a))) return -1;
    w->prev = a;
    uint32_t *u = realloc(w->round, cap * sizeof *u);
    if (!u) return -1;
    w->round = u;
    if (!(u = realloc(w->merged, cap * sizeof *u))) return -1;
    w->merged = u;
    w->cap = cap;
    return 0;
}

static void work_free(bpe_work *w) {
    free(w->sym);
    free(w->next);
    free(w->prev);
    free(w->round);
    free(w->merged);
    free(w->heap);
}

static int heap_push(bpe_work *w, uint64_t v) {
    if (w->heap_len == w->heap_cap) {
        size_t cap = w->heap_cap ? w->heap_cap * 2 : 128;
        uint64_t *h = realloc(w->heap, cap * sizeof *h);
        if (!h) return -1;
        w->heap = h;
        w->heap_cap = cap;
    }
    size_t i = w->heap_len++;
    while (i > 0 && w->heap[(i - 1) / 2] > v) {
        w->heap[i] = w->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    w->heap[i] = v;
    return 0;
}

static uint64_t heap_pop(bpe_work *w) {
    uint64_t top = w->heap[0], last = w->heap[--w->heap_len];
    size_t i = 0, n = w->heap_len;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && w->heap[c + 1] < w->heap[c]) c++;
        if (w->heap[c] >= last) break;
        w->heap[i] = w->heap[c];
        i = c;
    }
    if (n) w->heap[i] = last;
    return top;
}

/* Queue the pair that starts at position p, if it is a merge rule. */
static int push_pair(const tokenizer *t, bpe_work *w, int32_t p) {
    if (p < 0 || w->next[p] < 0) return 0;
    int32_t q = w->next[p];
    const tok_pair_slot *r = tok_pair_find(t, w->sym[p], w->sym[q]);
    return r ? heap_push(w, ((uint64_t)(uint32_t)r->rank << 32) | (uint32_t)p) : 0;
}

/* Run BPE over the n bytes of one pre-token, leaving the surviving symbols
 * linked from position 0.
 *
 * This is HF's loop — take the lowest-ranked adjacent pair, merge every
 * non-overlapping occurrence left to right, repeat — done with a heap so a
 * very long pre-token costs O(n log n) instead of O(n^2). All queued entries
 * of the lowest rank are taken together as one round, in position order, and
 * the pairs the round creates are queued only after it, so a new pair can
 * never cut into the round (just as HF rescans only after a full pass).
 * Entries made stale by earlier merges are recognised and dropped: the pair
 * at that position no longer has that rank. */
static int bpe_run(const tokenizer *t, bpe_work *w, const unsigned char *s, size_t n) {
    if (work_reserve(w, n) != 0) return -1;
    w->heap_len = 0;
    for (size_t i = 0; i < n; i++) {
        w->sym[i] = t->byte_sym[s[i]];
        w->next[i] = i + 1 < n ? (int32_t)(i + 1) : -1;
        w->prev[i] = (int32_t)i - 1;
    }
    for (size_t i = 0; i + 1 < n; i++)
        if (push_pair(t, w, (int32_t)i) != 0) return -1;
    while (w->heap_len) {
        uint64_t first = heap_pop(w);
        uint32_t rank = (uint32_t)(first >> 32);
        size_t nr = 0, nm = 0;
        w->round[nr++] = (uint32_t)first;
        /* Equal entries (the same pair queued twice) pop one after another. */
        for (uint64_t last = first; w->heap_len && (uint32_t)(w->heap[0] >> 32) == rank;) {
            uint64_t v = heap_pop(w);
            if (v != last && nr < w->cap) w->round[nr++] = (uint32_t)v;
            last = v;
        }
        for (size_t k = 0; k < nr; k++) {
            int32_t p = (int32_t)w->round[k], q = w->next[p];
            if (w->prev[p] == -2 || q < 0) continue; /* p was unlinked, or is last */
            const tok_pair_slot *r = tok_pair_find(t, w->sym[p], w->sym[q]);
            if (!r || (uint32_t)r->rank != rank) continue; /* stale entry */
            w->sym[p] = r->merged;
            w->next[p] = w->next[q];
            if (w->next[q] >= 0) w->prev[w->next[q]] = p;
            w->prev[q] = -2;
            w->merged[nm++] = (uint32_t)p;
        }
        for (size_t k = 0; k < nm; k++) {
            int32_t p = (int32_t)w->merged[k];
            if (push_pair(t, w, w->prev[p]) != 0 || push_pair(t, w, p) != 0) return -1;
        }
    }
    return 0;
}

/* Encode one stretch of text that holds no added token. */
static int encode_chunk(const tokenizer *t, bpe_work *w, const char *s, size_t n, int32_t *out,
                        int *n_out, pd_err *err) {
    size_t pos = 0;
    while (pos < n) {
        size_t end = tok_pretok_next(s, n, pos);
        const unsigned char *piece = (const unsigned char *)s + pos;
        size_t len = end - pos;
        if (len == 1) {
            w->sym[0] = t->byte_sym[piece[0]];
            w->next[0] = -1;
        } else if (bpe_run(t, w, piece, len) != 0) {
            return pd_fail(err, "tokenizer: out of memory");
        }
        for (int32_t p = 0; p >= 0; p = w->next[p]) {
            int id = t->sym_vocab[w->sym[p]];
            if (id < 0) id = t->unk;
            if (id < 0)
                return pd_fail(err, "tokenizer: a merge produced a token missing from vocab.json, "
                                    "and there is no unk token");
            out[(*n_out)++] = id;
        }
        pos = end;
    }
    return 0;
}

/* The added token that starts at s[i], longest first; -1 when none. */
static int match_added(const tokenizer *t, const char *s, size_t n, size_t i) {
    if (!t->added_first_byte[(unsigned char)s[i]]) return -1;
    for (int k = 0; k < t->n_added; k++) {
        const tok_added *a = &t->added[k];
        if (a->len <= n - i && memcmp(s + i, a->content, a->len) == 0) return k;
    }
    return -1;
}

int tokenizer_encode(const tokenizer *t, const char *text, size_t len, bool add_special,
                     int32_t **ids, int *n_ids, pd_err *err) {
    *ids = NULL;
    *n_ids = 0;
    size_t bad = tok_utf8_check((const unsigned char *)text, len);
    if (bad != len) return pd_fail(err, "input text is not valid UTF-8 (byte offset %zu)", bad);
    if (len > (size_t)INT32_MAX - 1) return pd_fail(err, "input text is too long (%zu bytes)", len);
    /* Every token covers at least one byte, so len + 1 ids always suffice. */
    int32_t *out = malloc((len + 1) * sizeof *out);
    bpe_work w = {0};
    if (!out || work_reserve(&w, 1) != 0) {
        free(out);
        work_free(&w);
        return pd_fail(err, "tokenizer: out of memory");
    }
    int n = 0;
    if (add_special && t->add_bos && t->bos >= 0) out[n++] = t->bos;
    size_t chunk = 0, i = 0;
    int rc = 0;
    while (i < len && rc == 0) {
        int k = match_added(t, text, len, i);
        if (k < 0) {
            i++;
            continue;
        }
        rc = encode_chunk(t, &w, text + chunk, i - chunk, out, &n, err);
        out[n++] = t->added[k].id;
        i += t->added[k].len;
        chunk = i;
    }
    if (rc == 0) rc = encode_chunk(t, &w, text + chunk, len - chunk, out, &n, err);
    work_free(&w);
    if (rc != 0) {
        free(out);
        return rc;
    }
    *ids = out;
    *n_ids = n;
    return 0;
}

/* ---- decode ------------------------------------------------------------------ */

static bool id_shown(const tokenizer *t, int32_t id, bool skip_special) {
    return id >= 0 && id < t->n_ids && t->id_off[id] >= 0 && !(skip_special && t->id_special[id]);
}

char *tokenizer_decode(const tokenizer *t, const int32_t *ids, int n, bool skip_special,
                       size_t *len_out) {
    size_t total = 0;
    for (int i = 0; i < n; i++)
        if (id_shown(t, ids[i], skip_special)) total += t->id_len[ids[i]];
    unsigned char *raw = malloc(total + 1);
    char *out = malloc(3 * total + 1);
    if (!raw || !out) {
        free(raw);
        free(out);
        return NULL;
    }
    size_t k = 0;
    for (int i = 0; i < n; i++) {
        if (!id_shown(t, ids[i], skip_special)) continue;
        memcpy(raw + k, t->id_bytes + t->id_off[ids[i]], t->id_len[ids[i]]);
        k += t->id_len[ids[i]];
    }
    size_t m = tok_utf8_repair(raw, k, out);
    out[m] = 0;
    free(raw);
    if (len_out) *len_out = m;
    return out;
}

/* ---- streaming detokenizer ---------------------------------------------------- */

struct detok_stream {
    const tokenizer *tok;
    bool skip_special;
    unsigned char *pending; /* bytes not yet emitted: an incomplete UTF-8 tail */
    size_t pending_len, pending_cap;
    char *out;
    size_t out_cap;
};

detok_stream *detok_stream_create(const tokenizer *tok, bool skip_special) {
    detok_stream *ds = calloc(1, sizeof *ds);
    if (!ds) return NULL;
    ds->tok = tok;
    ds->skip_special = skip_special;
    return ds;
}

static int grow(void **p, size_t *cap, size_t need) {
    if (need <= *cap) return 0;
    size_t c = *cap ? *cap : 64;
    while (c < need)
        c *= 2;
    void *q = realloc(*p, c);
    if (!q) return -1;
    *p = q;
    *cap = c;
    return 0;
}

const char *detok_stream_step(detok_stream *ds, int32_t id, size_t *len) {
    const tokenizer *t = ds->tok;
    *len = 0;
    if (id_shown(t, id, ds->skip_special)) {
        size_t n = t->id_len[id];
        if (grow((void **)&ds->pending, &ds->pending_cap, ds->pending_len + n) != 0) return NULL;
        memcpy(ds->pending + ds->pending_len, t->id_bytes + t->id_off[id], n);
        ds->pending_len += n;
    }
    /* Emit everything except a tail that could still become a character;
     * bytes that can no longer be completed are final and come out as U+FFFD. */
    size_t keep = tok_utf8_incomplete_tail(ds->pending, ds->pending_len);
    size_t ready = ds->pending_len - keep;
    if (grow((void **)&ds->out, &ds->out_cap, 3 * ready + 1) != 0) return NULL;
    size_t m = tok_utf8_repair(ds->pending, ready, ds->out);
    ds->out[m] = 0;
    if (keep) memmove(ds->pending, ds->pending + ready, keep); /* pending may be NULL */
    ds->pending_len = keep;
    *len = m;
    return ds->out;
}

void detok_stream_free(detok_stream *ds) {
    if (!ds) return;
    free(ds->pending);
    free(ds->out);
    free(ds);
}
