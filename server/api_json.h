/* api_json: a growable text buffer with JSON writers. The HTTP layer builds
 * every response body with it (instead of a cJSON tree) so that field order
 * and nulls match vLLM's output and text with any bytes — including NUL —
 * is escaped correctly. */
#ifndef PD_SERVER_API_JSON_H
#define PD_SERVER_API_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct jbuf {
    char *data; /* always NUL-terminated when non-NULL */
    size_t len, cap;
    bool oom; /* an allocation failed; the content is incomplete */
} jbuf;

void jb_init(jbuf *b);
void jb_free(jbuf *b);
/* Hand the text to the caller (who frees it); the buffer is left empty. NULL on OOM. */
char *jb_take(jbuf *b, size_t *len);

void jb_raw(jbuf *b, const char *s, size_t n);
void jb_puts(jbuf *b, const char *s);
void jb_printf(jbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A JSON string literal (with quotes) from n bytes; invalid UTF-8 bytes are
 * replaced by U+FFFD so the output is always valid JSON. */
void jb_str(jbuf *b, const char *s, size_t n);
void jb_cstr(jbuf *b, const char *s); /* NULL writes null */
void jb_int(jbuf *b, long long v);
/* A finite double with enough digits to round-trip; NaN/inf write null. */
void jb_num(jbuf *b, double v);
/* `"key":` */
void jb_key(jbuf *b, const char *key);

#endif
