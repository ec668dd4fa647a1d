/* api_json: JSON text building. See api_json.h. */
#include "server/api_json.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void jb_init(jbuf *b) {
    memset(b, 0, sizeof *b);
}

void jb_free(jbuf *b) {
    free(b->data);
    jb_init(b);
}

char *jb_take(jbuf *b, size_t *len) {
    char *out = b->oom ? NULL : b->data;
    if (b->oom) free(b->data);
    if (!out && !b->oom) out = calloc(1, 1); /* nothing written: an empty string */
    if (len) *len = out ? b->len : 0;
    jb_init(b);
    return out;
}

static bool jb_reserve(jbuf *b, size_t extra) {
    if (b->oom) return false;
    if (b->len + extra + 1 <= b->cap) return true;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra + 1)
        cap *= 2;
    char *d = realloc(b->data, cap);
    if (!d) {
        b->oom = true;
        return false;
    }
    b->data = d;
    b->cap = cap;
    return true;
}

void jb_raw(jbuf *b, const char *s, size_t n) {
    if (!jb_reserve(b, n)) return;
    memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = 0;
}

void jb_puts(jbuf *b, const char *s) {
    jb_raw(b, s, strlen(s));
}

void jb_printf(jbuf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char small[256];
    int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sizeof small) {
        jb_raw(b, small, (size_t)n);
        return;
    }
    if (!jb_reserve(b, (size_t)n)) return;
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

/* Length of the valid UTF-8 sequence at s (1..4), or 0 when the bytes there
 * are not one (overlong forms, surrogates and values past U+10FFFF included). */
static size_t utf8_seq_len(const unsigned char *s, size_t n) {
    unsigned c = s[0];
    size_t len;
    unsigned min;
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF)
        len = 2, min = 0x80;
    else if (c >= 0xE0 && c <= 0xEF)
        len = 3, min = 0x800;
    else if (c >= 0xF0 && c <= 0xF4)
        len = 4, min = 0x10000;
    else
        return 0;
    if (n < len) return 0;
    unsigned cp = c & (0x3F >> (len - 1));
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
    return len;
}

void jb_str(jbuf *b, const char *s, size_t n) {
    const unsigned char *p = (const unsigned char *)s;
    if (!jb_reserve(b, n + 2)) return;
    jb_raw(b, "\"", 1);
    size_t run = 0; /* bytes copied verbatim, flushed in one go */
    for (size_t i = 0; i < n;) {
        unsigned c = p[i];
        size_t sl = c >= 0x80 ? utf8_seq_len(p + i, n - i) : 1;
        const char *esc = NULL;
        char tmp[8];
        if (c == '"')
            esc = "\\\"";
        else if (c == '\\')
            esc = "\\\\";
        else if (c == '\n')
            esc = "\\n";
        else if (c == '\r')
            esc = "\\r";
        else if (c == '\t')
            esc = "\\t";
        else if (c < 0x20) {
            snprintf(tmp, sizeof tmp, "\\u%04x", c);
            esc = tmp;
        } else if (sl == 0) {
            esc = "\xEF\xBF\xBD";
            sl = 1;
        }
        if (!esc) {
            run += sl;
            i += sl;
            continue;
        }
        if (run) jb_raw(b, s + i - run, run);
        run = 0;
        jb_puts(b, esc);
        i += sl ? sl : 1;
    }
    if (run) jb_raw(b, s + n - run, run);
    jb_raw(b, "\"", 1);
}

void jb_cstr(jbuf *b, const char *s) {
    if (s)
        jb_str(b, s, strlen(s));
    else
        jb_puts(b, "null");
}

void jb_int(jbuf *b, long long v) {
    jb_printf(b, "%lld", v);
}

void jb_num(jbuf *b, double v) {
    if (!isfinite(v)) {
        jb_puts(b, "null");
        return;
    }
    char tmp[40];
    snprintf(tmp, sizeof tmp, "%.9g", v);
    /* Keep it a JSON float (as Python prints one) when it came out integral. */
    if (!strpbrk(tmp, ".eEn")) strcat(tmp, ".0");
    jb_puts(b, tmp);
}

void jb_key(jbuf *b, const char *key) {
    jb_cstr(b, key);
    jb_raw(b, ":", 1);
}
