/* sbuf: growable byte buffer. See sbuf.h. */
#include "proxy/sbuf.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void sb_init(sbuf *b) {
    memset(b, 0, sizeof *b);
}

void sb_free(sbuf *b) {
    free(b->data);
    sb_init(b);
}

static bool sb_reserve(sbuf *b, size_t extra) {
    if (b->oom) return false;
    if (b->len + extra + 1 <= b->cap) return true;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra + 1)
        cap *= 2;
    char *p = realloc(b->data, cap);
    if (!p) {
        b->oom = true;
        return false;
    }
    b->data = p;
    b->cap = cap;
    return true;
}

void sb_raw(sbuf *b, const void *p, size_t n) {
    if (!sb_reserve(b, n)) return;
    if (n) memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = 0;
}

void sb_puts(sbuf *b, const char *s) {
    sb_raw(b, s, strlen(s));
}

void sb_printf(sbuf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char small[256];
    int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sizeof small) return sb_raw(b, small, (size_t)n);
    if (!sb_reserve(b, (size_t)n)) return;
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

void sb_json_str(sbuf *b, const char *s) {
    sb_raw(b, "\"", 1);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') {
            char e[2] = {'\\', (char)*p};
            sb_raw(b, e, 2);
        } else if (*p < 0x20) {
            sb_printf(b, "\\u%04x", *p);
        } else {
            sb_raw(b, p, 1);
        }
    }
    sb_raw(b, "\"", 1);
}

char *sb_take(sbuf *b, size_t *len) {
    if (b->oom) {
        sb_free(b);
        return NULL;
    }
    if (!b->data) sb_reserve(b, 0);
    char *d = b->data;
    if (len) *len = b->len;
    if (d) d[b->len] = 0;
    sb_init(b);
    return d;
}
