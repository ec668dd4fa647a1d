/* api_json: JSON writers on a pd_buf (common/pd_buf.h). The HTTP layer builds
 * every response body with them (instead of a cJSON tree) so that field order
 * and nulls match vLLM's output and text with any bytes — including NUL —
 * is escaped correctly. */
#ifndef PD_SERVER_API_JSON_H
#define PD_SERVER_API_JSON_H

#include <stddef.h>

#include "common/pd_buf.h"

/* A JSON string literal (with quotes) from n bytes; invalid UTF-8 bytes are
 * replaced by U+FFFD so the output is always valid JSON. */
void jb_str(pd_buf *b, const char *s, size_t n);
void jb_cstr(pd_buf *b, const char *s); /* NULL writes null */
void jb_int(pd_buf *b, long long v);
/* A finite double with enough digits to round-trip; NaN/inf write null. */
void jb_num(pd_buf *b, double v);
/* `"key":` */
void jb_key(pd_buf *b, const char *key);

#endif
