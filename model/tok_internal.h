/* tok_internal: the tokenizer struct, shared by model/tokenizer.c (loading
 * vocab.json, merges.txt and the special-token configuration) and
 * model/tok_bpe.c (encode, decode, streaming detokenizer). Not a public API. */
#ifndef PD_MODEL_TOK_INTERNAL_H
#define PD_MODEL_TOK_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* One merge rule, keyed by the two symbols it joins. */
typedef struct {
    uint64_t key; /* (left << 32) | right; TOK_EMPTY_KEY marks a free slot */
    int32_t rank; /* line number among the merges: lower merges first */
    int32_t merged;
} tok_pair_slot;

#define TOK_EMPTY_KEY UINT64_MAX

/* A string that is cut out of the text before pre-tokenization. */
typedef struct {
    char *content; /* UTF-8, NUL-terminated */
    size_t len;
    int id;
} tok_added;

/* BPE works on "symbols": every vocab.json string is one, plus any string that
 * merges.txt mentions but the vocabulary lacks (a well-formed pair of files
 * has none; if one is produced anyway it encodes as the unk token, as HF). */
struct tokenizer {
    int n_vocab; /* entries in vocab.json */
    int n_ids;   /* 1 + the largest id known */
    int ids_cap; /* allocated entries in the id tables */

    /* id -> the raw bytes the token stands for (off -1: no such id). */
    int64_t *id_off;
    uint32_t *id_len;
    char *id_bytes;
    bool *id_special;

    int n_sym;
    int32_t *sym_vocab;    /* symbol -> vocab id, or -1 */
    int32_t byte_sym[256]; /* the 1-byte symbols BPE starts from */

    tok_pair_slot *pairs;
    size_t pair_mask; /* table size - 1 (a power of two) */

    tok_added *added; /* longest first, so the first match is the longest */
    int n_added;
    bool added_first_byte[256];

    int bos, eos, unk, pad;
    bool add_bos;
};

/* Find the merge rule for (left, right); NULL when the pair never merges. */
static inline const tok_pair_slot *tok_pair_find(const struct tokenizer *t, int32_t left,
                                                 int32_t right) {
    uint64_t key = ((uint64_t)(uint32_t)left << 32) | (uint32_t)right;
    size_t h = (size_t)((key * 0x9E3779B97F4A7C15ull) >> 32) & t->pair_mask;
    for (;;) {
        const tok_pair_slot *s = &t->pairs[h];
        if (s->key == key) return s;
        if (s->key == TOK_EMPTY_KEY) return NULL;
        h = (h + 1) & t->pair_mask;
    }
}

#endif
