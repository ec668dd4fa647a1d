/* pd_buf: growable byte buffer. See pd_buf.h. */
#include "common/pd_buf.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void pd_buf_init(pd_buf *b) {
    memset(b, 0, sizeof *b);
}

void pd_buf_free(pd_buf *b) {
    free(b->data);
    pd_buf_init(b);
}

bool pd_buf_reserve(pd_buf *b, size_t extra) {
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

void pd_buf_append(pd_buf *b, const void *p, size_t n) {
    if (!pd_buf_reserve(b, n)) return;
    if (n) memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = 0;
}

void pd_buf_puts(pd_buf *b, const char *s) {
    pd_buf_append(b, s, strlen(s));
}

void pd_buf_printf(pd_buf *b, const char *fmt, ...) {
    /* Most pieces are short: format into the stack first, and only when the
     * text does not fit grow the buffer and format again in place. */
    va_list ap;
    va_start(ap, fmt);
    char small[256];
    int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sizeof small) {
        pd_buf_append(b, small, (size_t)n);
        return;
    }
    if (!pd_buf_reserve(b, (size_t)n)) return;
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

void pd_buf_json_str(pd_buf *b, const char *s) {
    pd_buf_append(b, "\"", 1);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') {
            char e[2] = {'\\', (char)*p};
            pd_buf_append(b, e, 2);
        } else if (*p < 0x20) {
            pd_buf_printf(b, "\\u%04x", *p);
        } else {
            pd_buf_append(b, p, 1);
        }
    }
    pd_buf_append(b, "\"", 1);
}

char *pd_buf_take(pd_buf *b, size_t *len) {
    if (!b->data && pd_buf_reserve(b, 0)) b->data[0] = 0; /* nothing written: "" */
    char *out = b->oom ? NULL : b->data;
    if (b->oom) free(b->data);
    if (len) *len = out ? b->len : 0;
    pd_buf_init(b);
    return out;
}
