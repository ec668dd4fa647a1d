/* tok_text: the text-level pieces of the tokenizer that know nothing about
 * vocabularies — strict UTF-8 checking, U+FFFD repair with the "maximal
 * subpart" rule, and the GPT-2 pre-tokenization regex written out by hand.
 * Internal to model/tokenizer.c (and its tests through the public API). */
#ifndef PD_MODEL_TOK_TEXT_H
#define PD_MODEL_TOK_TEXT_H

#include <stddef.h>
#include <stdint.h>

/* Length (1-4) of the well-formed UTF-8 sequence at s[0..n), or 0 when the
 * bytes there do not start one (bad lead, bad continuation, overlong,
 * surrogate, > U+10FFFF, or cut short). */
int tok_utf8_seq_len(const unsigned char *s, size_t n);

/* Offset of the first byte that is not part of well-formed UTF-8, or n. */
size_t tok_utf8_check(const unsigned char *s, size_t n);

/* Length of a trailing sequence of s[0..n) that is a proper prefix of some
 * well-formed sequence (it could still complete with more bytes), or 0. */
size_t tok_utf8_incomplete_tail(const unsigned char *s, size_t n);

/* Append s[0..n) to out, replacing each maximal ill-formed subpart with
 * U+FFFD (Python's errors="replace"). out must have room for 3 * n bytes
 * (each bad byte may grow to 3). Returns the bytes written. */
size_t tok_utf8_repair(const unsigned char *s, size_t n, char *out);

/* The end offset of the pre-token that starts at pos in the valid UTF-8 text
 * s[0..n) (pos < n). Calling it repeatedly from 0 splits the text exactly as
 * 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
 * does with Unicode \p{L}, \p{N} and \s = White_Space. */
size_t tok_pretok_next(const char *s, size_t n, size_t pos);

#endif
