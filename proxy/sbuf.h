/* sbuf: a growable byte buffer for building bodies and metrics text. An
 * allocation failure sets oom and turns later appends into no-ops, so
 * callers check once at the end. */
#ifndef PD_PROXY_SBUF_H
#define PD_PROXY_SBUF_H

#include <stdbool.h>
#include <stddef.h>

typedef struct sbuf {
    char *data; /* NUL-terminated while not oom */
    size_t len, cap;
    bool oom;
} sbuf;

void sb_init(sbuf *b);
void sb_free(sbuf *b);
void sb_raw(sbuf *b, const void *p, size_t n);
void sb_puts(sbuf *b, const char *s);
void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Append s as a JSON string literal (with quotes). */
void sb_json_str(sbuf *b, const char *s);
/* Hand the data to the caller (NULL when oom); the buffer is reset. */
char *sb_take(sbuf *b, size_t *len);

#endif
