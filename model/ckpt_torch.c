/* ckpt_torch: the tensor table of a torch.save() zip file (see ckpt_torch.h).
 *
 * Three steps: index the zip (zipfile.c), unpickle <prefix>/data.pkl with the
 * restricted unpickler (pickle.c) into a dict of tensor descriptions, then
 * turn each description into a ckpt_tensor whose data points at its storage
 * entry <prefix>/data/<key> + storage_offset. Views are honoured: a tensor
 * whose strides are not C order (a transpose, an expand) is copied into C
 * order; a contiguous one, including one sharing a storage with another
 * (tied weights), points straight into the file. */
#include "model/ckpt_torch.h"

#include <stdlib.h>
#include <string.h>

#include "model/pickle.h"
#include "model/zipfile.h"

/* Non-contiguous tensors are copied; cap the total so that a hostile file of
 * huge stride-0 "expanded" tensors cannot make us allocate without bound. */
#define COPY_SLACK_BYTES ((uint64_t)256 << 20)

static size_t elem_size(ckpt_dtype t) {
    switch (t) {
    case CKPT_F64:
    case CKPT_I64:
        return 8;
    case CKPT_F32:
    case CKPT_I32:
        return 4;
    case CKPT_F16:
    case CKPT_BF16:
    case CKPT_I16:
        return 2;
    case CKPT_I8:
    case CKPT_U8:
    case CKPT_BOOL:
        return 1;
    default:
        return 0;
    }
}

/* PyTorch's rule: dims of size 1 may have any stride; an empty tensor is contiguous. */
static int is_contiguous(const pk_value *t, int64_t count) {
    if (count == 0) return 1;
    int64_t expect = 1;
    for (int d = t->u.tensor.ndim - 1; d >= 0; d--) {
        if (t->u.tensor.size[d] == 1) continue;
        if (t->u.tensor.stride[d] != expect) return 0;
        expect *= t->u.tensor.size[d];
    }
    return 1;
}

/* Gather a strided view into C order. Bounds were checked by the caller. */
static void copy_strided(const pk_value *t, const uint8_t *src, size_t es, int64_t count,
                         uint8_t *dst) {
    int nd = t->u.tensor.ndim;
    int64_t idx[CKPT_MAX_DIMS] = {0};
    for (int64_t e = 0; e < count; e++) {
        int64_t at = t->u.tensor.offset;
        for (int d = 0; d < nd; d++)
            at += idx[d] * t->u.tensor.stride[d];
        memcpy(dst + (size_t)e * es, src + (size_t)at * es, es);
        for (int d = nd - 1; d >= 0; d--) {
            if (++idx[d] < t->u.tensor.size[d]) break;
            idx[d] = 0;
        }
    }
}

typedef struct {
    const zip_archive *zip;
    const char *prefix; /* archive prefix including the trailing '/' (may be "") */
    size_t prefix_len;
    const char *path;
    uint64_t copy_budget;
} reader;

static int make_tensor(reader *r, const char *name, const pk_value *t, ckpt_tensor *out,
                       pd_err *err) {
    const pk_value *st = t->u.tensor.storage;
    size_t es = elem_size(st->u.storage.dtype);
    const char *key = st->u.storage.key;

    size_t klen = strlen(key);
    char *entry_name = malloc(r->prefix_len + 5 + klen + 1);
    if (!entry_name) return pd_fail(err, "%s: out of memory", r->path);
    memcpy(entry_name, r->prefix, r->prefix_len);
    memcpy(entry_name + r->prefix_len, "data/", 5);
    memcpy(entry_name + r->prefix_len + 5, key, klen + 1);
    const zip_entry *e = zip_find(r->zip, entry_name, r->prefix_len + 5 + klen);
    if (!e) {
        pd_fail(err, "%s: tensor '%s': storage entry '%s' is not in the archive", r->path, name,
                entry_name);
        free(entry_name);
        return -1;
    }
    free(entry_name);

    int64_t numel = st->u.storage.numel;
    if ((uint64_t)numel > e->size / es)
        return pd_fail(err,
                       "%s: tensor '%s': storage data/%s holds %llu bytes, too few for %lld "
                       "elements of %zu bytes",
                       r->path, name, key, (unsigned long long)e->size, (long long)numel, es);

    /* Element count, and the highest storage index the view touches. */
    int64_t count = 1, last = t->u.tensor.offset;
    for (int d = 0; d < t->u.tensor.ndim; d++) {
        int64_t sz = t->u.tensor.size[d], stride = t->u.tensor.stride[d];
        if (sz != 0 && count > INT64_MAX / sz)
            return pd_fail(err, "%s: tensor '%s': shape overflows", r->path, name);
        count *= sz;
        if (sz > 0 && stride > 0) {
            if (sz - 1 > (INT64_MAX - last) / stride)
                return pd_fail(err, "%s: tensor '%s': strides overflow", r->path, name);
            last += (sz - 1) * stride;
        }
    }
    if (count > 0 && last >= numel)
        return pd_fail(err,
                       "%s: tensor '%s': its view reaches element %lld of storage data/%s, which "
                       "has %lld elements",
                       r->path, name, (long long)last, key, (long long)numel);
    if ((uint64_t)count > (uint64_t)SIZE_MAX / es || (uint64_t)count > UINT64_MAX / es)
        return pd_fail(err, "%s: tensor '%s': too large", r->path, name);

    memset(out, 0, sizeof *out);
    out->dtype = st->u.storage.dtype;
    out->ndim = t->u.tensor.ndim;
    memcpy(out->shape, t->u.tensor.size, sizeof out->shape);
    out->nbytes = (size_t)count * es;
    if (is_contiguous(t, count)) {
        out->data = count ? e->data + (size_t)t->u.tensor.offset * es : e->data;
    } else {
        if (out->nbytes > r->copy_budget)
            return pd_fail(
                err, "%s: tensor '%s': a %zu-byte strided copy exceeds the limit for this file",
                r->path, name, out->nbytes);
        r->copy_budget -= out->nbytes;
        out->owned = malloc(out->nbytes);
        if (!out->owned)
            return pd_fail(err, "%s: tensor '%s': out of memory for a %zu-byte copy", r->path, name,
                           out->nbytes);
        copy_strided(t, e->data, es, count, out->owned);
        out->data = out->owned;
    }
    out->name = strdup(name);
    if (!out->name) {
        free(out->owned);
        out->owned = NULL;
        return pd_fail(err, "%s: out of memory", r->path);
    }
    return 0;
}

static int cmp_names(const void *a, const void *b) {
    return strcmp((*(const ckpt_tensor *const *)a)->name, (*(const ckpt_tensor *const *)b)->name);
}

static int check_unique(const ckpt_tensor *ts, int n, const char *path, pd_err *err) {
    if (n < 2) return 0;
    const ckpt_tensor **sorted = malloc((size_t)n * sizeof *sorted);
    if (!sorted) return pd_fail(err, "%s: out of memory", path);
    for (int i = 0; i < n; i++)
        sorted[i] = &ts[i];
    qsort(sorted, (size_t)n, sizeof *sorted, cmp_names);
    int rc = 0;
    for (int i = 1; i < n && rc == 0; i++)
        if (strcmp(sorted[i - 1]->name, sorted[i]->name) == 0)
            rc = pd_fail(err, "%s: tensor name '%s' appears twice", path, sorted[i]->name);
    free(sorted);
    return rc;
}

/* The state dict: the top-level dict, or the dict under a lone "state_dict" /
 * "model" key (training scripts often save {"state_dict": ...}). */
static const pk_value *find_state_dict(const pk_value *top, const char *path, pd_err *err) {
    if (!top || top->kind != PK_DICT) {
        pd_fail(err, "%s: the pickled object is a %s, not a state dict", path,
                top ? pk_kind_name(top->kind) : "?");
        return NULL;
    }
    if (top->u.seq.n == 2) { /* one pair */
        const pk_value *k = top->u.seq.items[0], *v = top->u.seq.items[1];
        if (k->kind == PK_STR && v->kind == PK_DICT &&
            (strcmp(k->u.str.s, "state_dict") == 0 || strcmp(k->u.str.s, "model") == 0))
            return v;
    }
    return top;
}

static int read_tensors(reader *r, const pk_value *dict, ckpt_tensor **tensors, int *n,
                        pd_err *err) {
    size_t count = dict->u.seq.n / 2;
    if (count > (size_t)INT32_MAX) return pd_fail(err, "%s: too many tensors", r->path);
    ckpt_tensor *ts = calloc(count ? count : 1, sizeof *ts);
    if (!ts) return pd_fail(err, "%s: out of memory", r->path);
    int made = 0;
    for (size_t i = 0; i < count; i++) {
        const pk_value *k = dict->u.seq.items[2 * i], *v = dict->u.seq.items[2 * i + 1];
        if (k->kind != PK_STR || strlen(k->u.str.s) != k->u.str.len) {
            pd_fail(err, "%s: state dict key %zu is a %s, not a tensor name", r->path, i,
                    pk_kind_name(k->kind));
            goto fail;
        }
        if (v->kind != PK_TENSOR) {
            pd_fail(err,
                    "%s: state dict entry '%s' has type %s, not tensor (only plain state dicts are "
                    "supported)",
                    r->path, k->u.str.s, pk_kind_name(v->kind));
            goto fail;
        }
        if (make_tensor(r, k->u.str.s, v, &ts[made], err) != 0) goto fail;
        made++;
    }
    if (check_unique(ts, made, r->path, err) != 0) goto fail;
    *tensors = ts;
    *n = made;
    return 0;
fail:
    ckpt_tensors_free(ts, made);
    return -1;
}

/* The entry "<prefix>/data.pkl" names the archive prefix. */
static const zip_entry *find_pickle(const zip_archive *z) {
    for (size_t i = 0; i < z->n; i++) {
        const zip_entry *e = &z->entries[i];
        if (e->name_len == 8 && memcmp(e->name, "data.pkl", 8) == 0) return e;
        if (e->name_len > 9 && memcmp(e->name + e->name_len - 9, "/data.pkl", 9) == 0) return e;
    }
    return NULL;
}

int torch_zip_read(const void *file, size_t size, const char *path, ckpt_tensor **tensors, int *n,
                   pd_err *err) {
    const uint8_t *b = file;
    *tensors = NULL;
    *n = 0;
    if (size >= 2 && b[0] == 0x80 && b[1] <= 5)
        return pd_fail(
            err,
            "%s: this is a legacy (pre-1.6) torch.save file, which is not supported; re-save it "
            "with a current torch, or convert it to safetensors",
            path);
    if (size < 4 || memcmp(b, "PK\x03\x04", 4) != 0)
        return pd_fail(err, "%s: not a torch.save file (no zip signature at the start)", path);

    zip_archive zip;
    if (zip_open(&zip, file, size, path, err) != 0) return -1;
    int rc = -1;
    pk_arena arena = {0};
    const zip_entry *pkl = find_pickle(&zip);
    if (!pkl) {
        pd_fail(err, "%s: zip archive has no <prefix>/data.pkl entry: not a torch.save file", path);
        goto out;
    }
    size_t prefix_len = pkl->name_len - 8;
    char *prefix = strndup(pkl->name, prefix_len);
    if (!prefix) {
        pd_fail(err, "%s: out of memory", path);
        goto out;
    }
    if (strlen(prefix) != prefix_len) {
        pd_fail(err, "%s: archive prefix contains a NUL byte", path);
        free(prefix);
        goto out;
    }

    /* Storages are raw little-endian bytes; a big-endian writer says so here. */
    char bo_name[512];
    if (prefix_len + 10 <= sizeof bo_name) {
        memcpy(bo_name, prefix, prefix_len);
        memcpy(bo_name + prefix_len, "byteorder", 10);
        const zip_entry *bo = zip_find(&zip, bo_name, prefix_len + 9);
        if (bo && !(bo->size == 6 && memcmp(bo->data, "little", 6) == 0)) {
            pd_fail(err, "%s: storages are not little-endian (byteorder record '%.*s')", path,
                    bo->size > 16 ? 16 : (int)bo->size, (const char *)bo->data);
            free(prefix);
            goto out;
        }
    }

    pk_value *top;
    if (pk_load(pkl->data, pkl->size, &arena, &top, err) != 0) {
        pd_wrap(err, "%s: %.*s", path, (int)(pkl->name_len > 200 ? 200 : pkl->name_len), pkl->name);
        free(prefix);
        goto out;
    }
    const pk_value *dict = find_state_dict(top, path, err);
    if (dict) {
        reader r = {.zip = &zip,
                    .prefix = prefix,
                    .prefix_len = prefix_len,
                    .path = path,
                    .copy_budget = (uint64_t)size + COPY_SLACK_BYTES};
        rc = read_tensors(&r, dict, tensors, n, err);
    }
    free(prefix);
out:
    pk_arena_free(&arena);
    zip_close(&zip);
    return rc;
}

void ckpt_tensors_free(ckpt_tensor *tensors, int n) {
    if (!tensors) return;
    for (int i = 0; i < n; i++) {
        free(tensors[i].name);
        free(tensors[i].owned);
    }
    free(tensors);
}
