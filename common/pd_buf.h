/* pd_buf: a growable byte buffer for building response bodies, metrics text
 * and file headers. The content is kept NUL-terminated so it can be used as a
 * C string. An allocation failure sets oom and turns every later append into a
 * no-op, so a caller writes everything and checks once at the end. */
#ifndef PD_BUF_H
#define PD_BUF_H

#include <stdbool.h>
#include <stddef.h>

typedef struct pd_buf {
    char *data; /* NUL-terminated when non-NULL */
    size_t len, cap;
    bool oom; /* an allocation failed; the content is incomplete */
} pd_buf;

void pd_buf_init(pd_buf *b);
void pd_buf_free(pd_buf *b);
/* Make room for extra more bytes (plus the NUL); false when oom. */
bool pd_buf_reserve(pd_buf *b, size_t extra);
void pd_buf_append(pd_buf *b, const void *p, size_t n);
void pd_buf_puts(pd_buf *b, const char *s);
void pd_buf_printf(pd_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A JSON string literal (with quotes) from a C string, escaping only what JSON
 * requires: quote, backslash and control bytes (as \u00XX). Other bytes are
 * copied as they are; server/api_json has the UTF-8-checking writer. */
void pd_buf_json_str(pd_buf *b, const char *s);
/* Hand the content to the caller, who frees it: an empty string when nothing
 * was written, NULL when oom. The buffer is left empty either way. */
char *pd_buf_take(pd_buf *b, size_t *len);

#endif
