/* api_json: JSON text building. See api_json.h. */
#include "server/api_json.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

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

void jb_str(pd_buf *b, const char *s, size_t n) {
    const unsigned char *p = (const unsigned char *)s;
    if (!pd_buf_reserve(b, n + 2)) return;
    pd_buf_append(b, "\"", 1);
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
        if (run) pd_buf_append(b, s + i - run, run);
        run = 0;
        pd_buf_puts(b, esc);
        i += sl ? sl : 1;
    }
    if (run) pd_buf_append(b, s + n - run, run);
    pd_buf_append(b, "\"", 1);
}

void jb_cstr(pd_buf *b, const char *s) {
    if (s)
        jb_str(b, s, strlen(s));
    else
        pd_buf_puts(b, "null");
}

void jb_int(pd_buf *b, long long v) {
    pd_buf_printf(b, "%lld", v);
}

void jb_num(pd_buf *b, double v) {
    if (!isfinite(v)) {
        pd_buf_puts(b, "null");
        return;
    }
    char tmp[40];
    snprintf(tmp, sizeof tmp, "%.9g", v);
    /* Keep it a JSON float (as Python prints one) when it came out integral. */
    if (!strpbrk(tmp, ".eEn")) strcat(tmp, ".0");
    pd_buf_puts(b, tmp);
}

void jb_key(pd_buf *b, const char *key) {
    jb_cstr(b, key);
    pd_buf_append(b, ":", 1);
}
