/* safetensors: parse/validate one file and render headers (see safetensors.h).
 *
 * The checks follow the reference reader (huggingface/safetensors): header
 * length bounds, UTF-8 JSON, known dtypes, data_offsets that tile the data
 * buffer exactly (sorted by offset: contiguous from 0, no gaps, no overlaps),
 * each span equal to numel * element size (overflow-checked), and the last
 * span ending exactly at end of file. */
#include "model/safetensors.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/pd_buf.h"
#include "model/ckpt_torch.h"

static const struct {
    const char *name;
    ckpt_dtype t;
    size_t size;
} dtype_table[] = {
    {"F32", CKPT_F32, 4},   {"F16", CKPT_F16, 2},       {"BF16", CKPT_BF16, 2},
    {"F64", CKPT_F64, 8},   {"I64", CKPT_I64, 8},       {"I32", CKPT_I32, 4},
    {"I16", CKPT_I16, 2},   {"I8", CKPT_I8, 1},         {"U8", CKPT_U8, 1},
    {"BOOL", CKPT_BOOL, 1}, {"U16", CKPT_OTHER, 2},     {"U32", CKPT_OTHER, 4},
    {"U64", CKPT_OTHER, 8}, {"F8_E5M2", CKPT_OTHER, 1}, {"F8_E4M3", CKPT_OTHER, 1},
};
#define N_DTYPES (sizeof dtype_table / sizeof dtype_table[0])

const char *ckpt_dtype_name(ckpt_dtype t) {
    for (size_t i = 0; i < N_DTYPES; i++)
        if (dtype_table[i].t == t && t != CKPT_OTHER) return dtype_table[i].name;
    return "OTHER";
}

size_t ckpt_dtype_size(ckpt_dtype t) {
    for (size_t i = 0; i < N_DTYPES; i++)
        if (dtype_table[i].t == t && t != CKPT_OTHER) return dtype_table[i].size;
    return 0;
}

size_t safetensors_dtype_lookup(const char *name, ckpt_dtype *t) {
    for (size_t i = 0; i < N_DTYPES; i++) {
        if (strcmp(dtype_table[i].name, name) == 0) {
            *t = dtype_table[i].t;
            return dtype_table[i].size;
        }
    }
    return 0;
}

/* Strict UTF-8 (no overlongs, no surrogates, nothing past U+10FFFF). */
static int utf8_valid(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        size_t len;
        unsigned min, cp;
        if (c < 0x80) {
            i++;
            continue;
        } else if ((c & 0xE0) == 0xC0) {
            len = 2, min = 0x80, cp = c & 0x1F;
        } else if ((c & 0xF0) == 0xE0) {
            len = 3, min = 0x800, cp = c & 0x0F;
        } else if ((c & 0xF8) == 0xF0) {
            len = 4, min = 0x10000, cp = c & 0x07;
        } else {
            return 0;
        }
        if (n - i < len) return 0;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return 0;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
        i += len;
    }
    return 1;
}

/* A JSON number that is an exact non-negative integer (doubles hold 2^53 exactly). */
static int json_u64(const cJSON *v, uint64_t *out) {
    if (!cJSON_IsNumber(v)) return -1;
    double d = v->valuedouble;
    if (!(d >= 0) || d != floor(d) || d > 9007199254740992.0) return -1;
    *out = (uint64_t)d;
    return 0;
}

typedef struct {
    uint64_t begin, end;
    int idx;
} span;

static int span_cmp(const void *a, const void *b) {
    const span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

static int check_metadata(const cJSON *m, const char *path, pd_err *err) {
    if (!cJSON_IsObject(m)) return pd_fail(err, "%s: __metadata__ is not a JSON object", path);
    for (const cJSON *e = m->child; e; e = e->next)
        if (!cJSON_IsString(e))
            return pd_fail(err, "%s: __metadata__ value \"%s\" is not a string", path, e->string);
    return 0;
}

/* Parse one header entry into t (name not yet set) and its span. */
static int parse_entry(const cJSON *e, const char *path, ckpt_tensor *t, span *sp, pd_err *err) {
    const char *name = e->string;
    if (!cJSON_IsObject(e))
        return pd_fail(err, "%s: tensor %s: entry is not an object", path, name);
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const cJSON *off = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    if (!cJSON_IsString(dt))
        return pd_fail(err, "%s: tensor %s: missing or non-string dtype", path, name);
    size_t esize = safetensors_dtype_lookup(dt->valuestring, &t->dtype);
    if (esize == 0)
        return pd_fail(err, "%s: tensor %s: unknown dtype \"%s\"", path, name, dt->valuestring);
    if (!cJSON_IsArray(sh))
        return pd_fail(err, "%s: tensor %s: missing or non-array shape", path, name);
    int ndim = cJSON_GetArraySize(sh);
    if (ndim > CKPT_MAX_DIMS)
        return pd_fail(err, "%s: tensor %s: %d dimensions (at most %d supported)", path, name, ndim,
                       CKPT_MAX_DIMS);
    t->ndim = ndim;
    uint64_t numel = 1;
    int overflow = 0;
    for (int i = 0; i < ndim; i++) {
        uint64_t d;
        if (json_u64(cJSON_GetArrayItem(sh, i), &d))
            return pd_fail(err, "%s: tensor %s: shape entries must be non-negative integers", path,
                           name);
        t->shape[i] = (int64_t)d;
        if (d != 0 && numel > UINT64_MAX / d) overflow = 1;
        numel *= d;
    }
    if (!cJSON_IsArray(off) || cJSON_GetArraySize(off) != 2)
        return pd_fail(err, "%s: tensor %s: data_offsets must be [begin, end]", path, name);
    if (json_u64(cJSON_GetArrayItem(off, 0), &sp->begin) ||
        json_u64(cJSON_GetArrayItem(off, 1), &sp->end))
        return pd_fail(err, "%s: tensor %s: data_offsets must be non-negative integers", path,
                       name);
    if (sp->end < sp->begin)
        return pd_fail(err, "%s: tensor %s: data_offsets end %llu is before begin %llu", path, name,
                       (unsigned long long)sp->end, (unsigned long long)sp->begin);
    /* An all-zero shape has numel 0 whatever else overflowed. */
    for (int i = 0; i < ndim; i++)
        if (t->shape[i] == 0) overflow = 0, numel = 0;
    if (overflow || (numel != 0 && numel > UINT64_MAX / esize))
        return pd_fail(err, "%s: tensor %s: shape size overflows", path, name);
    uint64_t need = numel * esize;
    if (sp->end - sp->begin != need)
        return pd_fail(err,
                       "%s: tensor %s: data size mismatch: data_offsets span %llu bytes, dtype %s "
                       "and shape need %llu",
                       path, name, (unsigned long long)(sp->end - sp->begin), dt->valuestring,
                       (unsigned long long)need);
    t->nbytes = (size_t)need;
    return 0;
}

static int parse_header(const cJSON *root, const unsigned char *data, uint64_t data_size,
                        const char *path, ckpt_tensor *ts, span *spans, int *count, pd_err *err) {
    int n = 0;
    for (const cJSON *e = root->child; e; e = e->next) {
        if (strcmp(e->string, "__metadata__") == 0) {
            if (check_metadata(e, path, err)) return -1;
            continue;
        }
        ckpt_tensor *t = &ts[n];
        if (parse_entry(e, path, t, &spans[n], err)) return -1;
        t->name = strdup(e->string);
        if (!t->name) return pd_fail(err, "out of memory");
        spans[n].idx = n;
        n++;
        *count = n; /* so the caller frees the names made so far */
    }
    qsort(spans, (size_t)n, sizeof *spans, span_cmp);
    uint64_t pos = 0;
    for (int i = 0; i < n; i++) {
        const char *name = ts[spans[i].idx].name;
        if (spans[i].begin < pos)
            return pd_fail(
                err, "%s: tensor %s: data_offsets [%llu, %llu] overlap the previous tensor", path,
                name, (unsigned long long)spans[i].begin, (unsigned long long)spans[i].end);
        if (spans[i].begin > pos)
            return pd_fail(err,
                           "%s: tensor %s: gap in data_offsets (begins at %llu, expected %llu)",
                           path, name, (unsigned long long)spans[i].begin, (unsigned long long)pos);
        pos = spans[i].end;
    }
    if (pos != data_size)
        return pd_fail(err,
                       "%s: tensor data ends at offset %llu but the file holds %llu data bytes "
                       "(truncated or trailing bytes)",
                       path, (unsigned long long)pos, (unsigned long long)data_size);
    for (int i = 0; i < n; i++)
        ts[spans[i].idx].data = data + spans[i].begin;
    return 0;
}

int safetensors_parse(const void *file, size_t size, const char *path, ckpt_tensor **tensors,
                      int *n, pd_err *err) {
    *tensors = NULL;
    *n = 0;
    const unsigned char *b = file;
    if (size < 8) return pd_fail(err, "%s: header too small: file is %zu bytes", path, size);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | b[i];
    if (hlen > SAFETENSORS_MAX_HEADER)
        return pd_fail(err, "%s: header too large: length %llu exceeds %u", path,
                       (unsigned long long)hlen, SAFETENSORS_MAX_HEADER);
    if (hlen > size - 8)
        return pd_fail(err, "%s: header length %llu runs past end of file (%zu bytes)", path,
                       (unsigned long long)hlen, size);
    if (!utf8_valid(b + 8, (size_t)hlen))
        return pd_fail(err, "%s: header is not valid UTF-8", path);
    cJSON *root = cJSON_ParseWithLength((const char *)b + 8, (size_t)hlen);
    if (!root) return pd_fail(err, "%s: header is not valid JSON", path);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return pd_fail(err, "%s: header is not a JSON object", path);
    }
    int cap = cJSON_GetArraySize(root);
    ckpt_tensor *ts = calloc((size_t)(cap > 0 ? cap : 1), sizeof *ts);
    span *spans = calloc((size_t)(cap > 0 ? cap : 1), sizeof *spans);
    int count = 0, rc;
    if (!ts || !spans) {
        rc = pd_fail(err, "out of memory");
    } else {
        rc = parse_header(root, b + 8 + hlen, size - 8 - hlen, path, ts, spans, &count, err);
    }
    cJSON_Delete(root);
    free(spans);
    if (rc) {
        if (ts) ckpt_tensors_free(ts, count);
        return -1;
    }
    *tensors = ts;
    *n = count;
    return 0;
}

int safetensors_header(const ckpt_tensor *tensors, int n, char **out, size_t *len, pd_err *err) {
    *out = NULL;
    *len = 0;
    pd_buf s;
    pd_buf_init(&s);
    pd_buf_append(&s, "\0\0\0\0\0\0\0\0", 8); /* length, filled in below */
    /* transformers checks for format "pt" when loading. */
    pd_buf_puts(&s, "{\"__metadata__\":{\"format\":\"pt\"}");
    uint64_t pos = 0;
    for (int i = 0; i < n; i++) {
        const ckpt_tensor *t = &tensors[i];
        size_t es = ckpt_dtype_size(t->dtype);
        if (es == 0) {
            pd_buf_free(&s);
            return pd_fail(err, "safetensors write: tensor %s has an unsupported dtype", t->name);
        }
        if (t->ndim < 0 || t->ndim > CKPT_MAX_DIMS) {
            pd_buf_free(&s);
            return pd_fail(err, "safetensors write: tensor %s has %d dimensions", t->name, t->ndim);
        }
        uint64_t numel = 1;
        for (int d = 0; d < t->ndim; d++)
            numel *= (uint64_t)t->shape[d];
        if (numel * es != t->nbytes) {
            pd_buf_free(&s);
            return pd_fail(err, "safetensors write: tensor %s: nbytes %zu does not match its shape",
                           t->name, t->nbytes);
        }
        pd_buf_append(&s, ",", 1);
        pd_buf_json_str(&s, t->name);
        pd_buf_puts(&s, ":{\"dtype\":\"");
        pd_buf_puts(&s, ckpt_dtype_name(t->dtype));
        pd_buf_puts(&s, "\",\"shape\":[");
        for (int d = 0; d < t->ndim; d++) {
            if (d) pd_buf_append(&s, ",", 1);
            pd_buf_printf(&s, "%llu", (unsigned long long)t->shape[d]);
        }
        pd_buf_puts(&s, "],\"data_offsets\":[");
        pd_buf_printf(&s, "%llu", (unsigned long long)pos);
        pd_buf_append(&s, ",", 1);
        pos += t->nbytes;
        pd_buf_printf(&s, "%llu", (unsigned long long)pos);
        pd_buf_puts(&s, "]}");
    }
    pd_buf_append(&s, "}", 1);
    /* Pad with spaces so the data buffer starts 8-byte aligned. */
    while (!s.oom && s.len % 8 != 0)
        pd_buf_append(&s, " ", 1);
    if (s.oom) {
        pd_buf_free(&s);
        return pd_fail(err, "out of memory");
    }
    uint64_t hlen = s.len - 8;
    for (int i = 0; i < 8; i++)
        s.data[i] = (char)((hlen >> (8 * i)) & 0xff);
    *out = s.data;
    *len = s.len;
    return 0;
}

int safetensors_write(const char *path, const ckpt_tensor *tensors, int n, pd_err *err) {
    char *hdr;
    size_t hlen;
    if (safetensors_header(tensors, n, &hdr, &hlen, err)) return pd_wrap(err, "%s", path);
    FILE *f = fopen(path, "wb");
    if (!f) {
        free(hdr);
        return pd_fail(err, "cannot create %s", path);
    }
    int bad = fwrite(hdr, 1, hlen, f) != hlen;
    free(hdr);
    for (int i = 0; i < n && !bad; i++)
        if (tensors[i].nbytes &&
            fwrite(tensors[i].data, 1, tensors[i].nbytes, f) != tensors[i].nbytes)
            bad = 1;
    if (fclose(f) != 0) bad = 1;
    if (bad) return pd_fail(err, "cannot write %s", path);
    return 0;
}
