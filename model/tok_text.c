/* tok_text: UTF-8 checking and repair, and the GPT-2 pre-tokenizer regex
 * written out by hand. See tok_text.h. */
#include "model/tok_text.h"

#include <utf8proc.h>

/* For a lead byte: how many bytes the sequence needs and the allowed range of
 * the second byte (the ranges exclude overlongs, surrogates and > U+10FFFF,
 * as in the Unicode standard's table of well-formed byte sequences). Returns 0
 * for a byte that can never start a multi-byte sequence. */
static int lead_info(unsigned char b, unsigned char *lo, unsigned char *hi) {
    *lo = 0x80;
    *hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) return 2;
    if (b >= 0xE0 && b <= 0xEF) {
        if (b == 0xE0) *lo = 0xA0;
        if (b == 0xED) *hi = 0x9F;
        return 3;
    }
    if (b >= 0xF0 && b <= 0xF4) {
        if (b == 0xF0) *lo = 0x90;
        if (b == 0xF4) *hi = 0x8F;
        return 4;
    }
    return 0;
}

/* How many bytes after the lead continue the sequence correctly (at most
 * need - 1, fewer when the input ends or a byte does not fit). */
static int good_continuations(const unsigned char *s, size_t n, int need, unsigned char lo,
                              unsigned char hi) {
    int k = 0;
    for (int i = 1; i < need && (size_t)i < n; i++) {
        unsigned char c = s[i];
        if (i == 1 ? (c < lo || c > hi) : (c < 0x80 || c > 0xBF)) break;
        k++;
    }
    return k;
}

int tok_utf8_seq_len(const unsigned char *s, size_t n) {
    if (n == 0) return 0;
    if (s[0] < 0x80) return 1;
    unsigned char lo, hi;
    int need = lead_info(s[0], &lo, &hi);
    if (need == 0) return 0;
    return good_continuations(s, n, need, lo, hi) == need - 1 ? need : 0;
}

size_t tok_utf8_check(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        if (s[i] < 0x80) {
            i++;
            continue;
        }
        int k = tok_utf8_seq_len(s + i, n - i);
        if (k == 0) return i;
        i += (size_t)k;
    }
    return n;
}

size_t tok_utf8_incomplete_tail(const unsigned char *s, size_t n) {
    /* Walk back over at most 3 continuation bytes to the byte that would lead
     * them; only a lead byte whose sequence is still short can be waiting. */
    for (size_t k = 1; k <= 3 && k <= n; k++) {
        unsigned char b = s[n - k];
        if ((b & 0xC0) == 0x80) continue;
        unsigned char lo, hi;
        int need = lead_info(b, &lo, &hi);
        if (need == 0 || (size_t)need <= k) return 0;
        return (size_t)good_continuations(s + n - k, k, need, lo, hi) == k - 1 ? k : 0;
    }
    return 0;
}

size_t tok_utf8_repair(const unsigned char *s, size_t n, char *out) {
    size_t i = 0, o = 0;
    while (i < n) {
        if (s[i] < 0x80) {
            out[o++] = (char)s[i++];
            continue;
        }
        unsigned char lo, hi;
        int need = lead_info(s[i], &lo, &hi);
        int good = need ? good_continuations(s + i, n - i, need, lo, hi) : 0;
        if (need && good == need - 1) {
            for (int k = 0; k < need; k++)
                out[o++] = (char)s[i + (size_t)k];
            i += (size_t)need;
            continue;
        }
        /* The maximal subpart: the lead plus the continuations that still fit
         * it. The whole subpart becomes one U+FFFD; the byte that broke it
         * starts the next attempt. */
        out[o++] = (char)0xEF;
        out[o++] = (char)0xBF;
        out[o++] = (char)0xBD;
        i += 1 + (size_t)good;
    }
    return o;
}

enum { CL_SPACE, CL_LETTER, CL_NUMBER, CL_OTHER };

/* \s as Python's regex module and HF use it: the Unicode White_Space property. */
static int is_white_space(uint32_t c) {
    return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
           c == 0x205F || c == 0x3000;
}

static int char_class(uint32_t c) {
    if (c < 0x80) {
        if ((c | 0x20) >= 'a' && (c | 0x20) <= 'z') return CL_LETTER;
        if (c >= '0' && c <= '9') return CL_NUMBER;
        return is_white_space(c) ? CL_SPACE : CL_OTHER;
    }
    if (is_white_space(c)) return CL_SPACE;
    switch (utf8proc_category((utf8proc_int32_t)c)) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
        return CL_LETTER;
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_NO:
        return CL_NUMBER;
    default:
        return CL_OTHER;
    }
}

/* Decode the code point at s[i] of text already known to be valid UTF-8;
 * *next gets the offset after it. */
static uint32_t decode_at(const char *text, size_t i, size_t *next) {
    const unsigned char *s = (const unsigned char *)text + i;
    if (s[0] < 0x80) {
        *next = i + 1;
        return s[0];
    }
    if (s[0] < 0xE0) {
        *next = i + 2;
        return ((uint32_t)(s[0] & 0x1F) << 6) | (s[1] & 0x3F);
    }
    if (s[0] < 0xF0) {
        *next = i + 3;
        return ((uint32_t)(s[0] & 0x0F) << 12) | ((uint32_t)(s[1] & 0x3F) << 6) | (s[2] & 0x3F);
    }
    *next = i + 4;
    return ((uint32_t)(s[0] & 0x07) << 18) | ((uint32_t)(s[1] & 0x3F) << 12) |
           ((uint32_t)(s[2] & 0x3F) << 6) | (s[3] & 0x3F);
}

/* End of the run of characters of class cl starting at pos. */
static size_t run_end(const char *s, size_t n, size_t pos, int cl) {
    while (pos < n) {
        size_t next;
        if (char_class(decode_at(s, pos, &next)) != cl) break;
        pos = next;
    }
    return pos;
}

size_t tok_pretok_next(const char *s, size_t n, size_t pos) {
    /* Alternatives 1-7 of the pattern, tried in order; the first that matches
     * wins, as in a backtracking regex engine. */
    if (s[pos] == '\'' && pos + 1 < n) {
        char c = s[pos + 1];
        if (c == 's' || c == 't' || c == 'm' || c == 'd') return pos + 2;
        if (pos + 2 < n) {
            char d = s[pos + 2];
            if ((c == 'r' && d == 'e') || (c == 'v' && d == 'e') || (c == 'l' && d == 'l'))
                return pos + 3;
        }
    }
    size_t next;
    int cl = char_class(decode_at(s, pos, &next));
    /* " ?\p{L}+", " ?\p{N}+", " ?[^\s\p{L}\p{N}]+": an optional plain space,
     * then a run of one class. Which of the three applies is decided by the
     * first character after the optional space. */
    if (s[pos] == ' ' && next < n) {
        size_t after;
        int cl2 = char_class(decode_at(s, next, &after));
        if (cl2 != CL_SPACE) return run_end(s, n, after, cl2);
    }
    if (cl != CL_SPACE) return run_end(s, n, next, cl);
    /* "\s+(?!\S)": the whole whitespace run when it reaches the end of text;
     * otherwise the run minus its last character (that one is then followed by
     * whitespace, so the lookahead holds) — possible only if the run has at
     * least two characters. Failing that, "\s+" takes the run (one char). */
    size_t last = pos, end = next;
    while (end < n) {
        size_t after;
        if (char_class(decode_at(s, end, &after)) != CL_SPACE) break;
        last = end;
        end = after;
    }
    if (end == n) return end;
    return last > pos ? last : end;
}
