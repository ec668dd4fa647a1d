/* test_ckpt_torch: the torch.save reader (model/ckpt_torch.c, zipfile.c, pickle.c).
 *
 * Positive tests compare every tensor with an expected.json written by an
 * independent program: scripts/make-torch-like-fixture.py (plain Python,
 * committed output) and, when present, scripts/make-torch-fixtures.py (real
 * torch + transformers). Negative tests build bad archives and pickles in
 * memory and require a clean error; truncation and byte-flip sweeps exist
 * for the sanitizer build, which turns any out-of-bounds read into a failure. */
#include <cjson/cJSON.h>
#include <dirent.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "model/ckpt_torch.h"
#include "tests/common/testlib.h"

/* ---------- independent element decoding ---------- */

static double half_to_double(uint16_t h) {
    int sign = h >> 15, ex = (h >> 10) & 31, man = h & 1023;
    double v = ex == 0    ? ldexp(man, -24)
               : ex == 31 ? (man ? NAN : INFINITY)
                          : ldexp(man + 1024, ex - 25);
    return sign ? -v : v;
}

static double elem(const ckpt_tensor *t, size_t i) {
    const uint8_t *p = (const uint8_t *)t->data;
    uint8_t b[8];
    switch (t->dtype) {
    case CKPT_F16:
        memcpy(b, p + 2 * i, 2);
        return half_to_double((uint16_t)(b[0] | b[1] << 8));
    case CKPT_BF16: {
        uint32_t bits = (uint32_t)(p[2 * i] | p[2 * i + 1] << 8) << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    case CKPT_F32: {
        float f;
        memcpy(&f, p + 4 * i, 4);
        return f;
    }
    case CKPT_F64: {
        double d;
        memcpy(&d, p + 8 * i, 8);
        return d;
    }
    case CKPT_I64: {
        int64_t v;
        memcpy(&v, p + 8 * i, 8);
        return (double)v;
    }
    case CKPT_I32: {
        int32_t v;
        memcpy(&v, p + 4 * i, 4);
        return v;
    }
    case CKPT_I16: {
        int16_t v;
        memcpy(&v, p + 2 * i, 2);
        return v;
    }
    case CKPT_I8:
        return (int8_t)p[i];
    case CKPT_U8:
        return p[i];
    case CKPT_BOOL:
        return p[i] != 0;
    default:
        return NAN;
    }
}

static const struct {
    const char *name;
    ckpt_dtype t;
    size_t size;
} dtypes[] = {
    {"F16", CKPT_F16, 2}, {"BF16", CKPT_BF16, 2}, {"F32", CKPT_F32, 4}, {"F64", CKPT_F64, 8},
    {"I64", CKPT_I64, 8}, {"I32", CKPT_I32, 4},   {"I16", CKPT_I16, 2}, {"I8", CKPT_I8, 1},
    {"U8", CKPT_U8, 1},   {"BOOL", CKPT_BOOL, 1},
};

static int dtype_lookup(const char *name, ckpt_dtype *t, size_t *size) {
    for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++)
        if (strcmp(dtypes[i].name, name) == 0) {
            *t = dtypes[i].t;
            *size = dtypes[i].size;
            return 0;
        }
    return -1;
}

static float fget(const void *p, size_t i) {
    float f;
    memcpy(&f, (const uint8_t *)p + 4 * i, 4);
    return f;
}

static const ckpt_tensor *find(const ckpt_tensor *ts, int n, const char *name) {
    for (int i = 0; i < n; i++)
        if (strcmp(ts[i].name, name) == 0) return &ts[i];
    return NULL;
}

static uint8_t *load(const char *path, size_t *len) {
    char *data;
    pd_err err;
    if (pd_read_file(path, &data, len, &err) != 0) {
        fprintf(stderr, "%s\n", err.msg);
        return NULL;
    }
    return (uint8_t *)data;
}

/* ---------- checking a file against expected.json entries ---------- */

/* Check the tensors read from `file` against the expected entries (those for
 * only_file, when given): every entry present and equal, and nothing extra. */
static void check_tensors(const char *label, const uint8_t *file, size_t size,
                          const ckpt_tensor *ts, int n, cJSON *expect_list, const char *only_file) {
    int expected = 0;
    cJSON *e;
    cJSON_ArrayForEach(e, expect_list) {
        cJSON *jfile = cJSON_GetObjectItem(e, "file");
        if (only_file && jfile && strcmp(cJSON_GetStringValue(jfile), only_file) != 0) continue;
        expected++;
        const char *name = cJSON_GetStringValue(cJSON_GetObjectItem(e, "name"));
        const ckpt_tensor *t = name ? find(ts, n, name) : NULL;
        CHECKF(t != NULL, "%s: tensor %s missing", label, name ? name : "?");
        if (!t) continue;
        ckpt_dtype dt;
        size_t es;
        const char *dname = cJSON_GetStringValue(cJSON_GetObjectItem(e, "dtype"));
        CHECKF(dname && dtype_lookup(dname, &dt, &es) == 0, "%s: %s: unknown expected dtype", label,
               name);
        if (!dname || dtype_lookup(dname, &dt, &es) != 0) continue;
        CHECKF(t->dtype == dt, "%s: %s: dtype %d, expected %s", label, name, (int)t->dtype, dname);
        cJSON *shape = cJSON_GetObjectItem(e, "shape");
        int nd = cJSON_GetArraySize(shape);
        CHECKF(t->ndim == nd, "%s: %s: ndim %d, expected %d", label, name, t->ndim, nd);
        size_t count = 1;
        for (int d = 0; d < nd && d < t->ndim; d++) {
            int64_t want = (int64_t)cJSON_GetArrayItem(shape, d)->valuedouble;
            CHECKF(t->shape[d] == want, "%s: %s: dim %d is %lld, expected %lld", label, name, d,
                   (long long)t->shape[d], (long long)want);
            count *= (size_t)want;
        }
        CHECKF(t->nbytes == count * es, "%s: %s: nbytes %zu, expected %zu", label, name, t->nbytes,
               count * es);
        if (t->dtype != dt || t->nbytes != count * es) continue;

        /* Where the data lives: inside the file when contiguous, else an owned copy. */
        cJSON *contig = cJSON_GetObjectItem(e, "contiguous");
        if (contig) {
            int want_copy = !cJSON_IsTrue(contig);
            CHECKF((t->owned != NULL) == want_copy, "%s: %s: owned=%p but contiguous=%d", label,
                   name, t->owned, !want_copy);
        }
        if (!t->owned)
            CHECKF((const uint8_t *)t->data >= file &&
                       (const uint8_t *)t->data + t->nbytes <= file + size,
                   "%s: %s: data does not point into the file", label, name);
        else
            CHECK(t->data == t->owned);
        cJSON *alias = cJSON_GetObjectItem(e, "alias_of");
        if (alias) {
            const ckpt_tensor *o = find(ts, n, cJSON_GetStringValue(alias));
            CHECKF(o && o->data == t->data, "%s: %s: should share data with %s", label, name,
                   cJSON_GetStringValue(alias));
        }

        double sum = 0, abs_sum = 0;
        for (size_t i = 0; i < count; i++) {
            double v = elem(t, i);
            sum += v;
            abs_sum += fabs(v);
        }
        double want_sum = cJSON_GetObjectItem(e, "sum")->valuedouble;
        CHECKF(fabs(sum - want_sum) <= 1e-9 * abs_sum + 1e-12, "%s: %s: sum %.17g, expected %.17g",
               label, name, sum, want_sum);
        cJSON *first = cJSON_GetObjectItem(e, "first");
        int nf = cJSON_GetArraySize(first);
        CHECKF((size_t)nf == (count < 4 ? count : 4), "%s: %s: expected.json lists %d first values",
               label, name, nf);
        for (int i = 0; i < nf && (size_t)i < count; i++) {
            double want = cJSON_GetArrayItem(first, i)->valuedouble, got = elem(t, (size_t)i);
            CHECKF(got == want, "%s: %s: element %d is %.17g, expected %.17g", label, name, i, got,
                   want);
        }
    }
    CHECKF(n == expected, "%s: %d tensors in the file, %d expected", label, n, expected);
}

static cJSON *load_json(const char *path) {
    size_t len;
    uint8_t *text = load(path, &len);
    cJSON *j = text ? cJSON_Parse((const char *)text) : NULL;
    free(text);
    CHECKF(j != NULL, "cannot read or parse %s", path);
    return j;
}

static void check_file(const char *path, const char *label, cJSON *tensors, const char *only_file) {
    size_t size;
    uint8_t *file = load(path, &size);
    CHECKF(file != NULL, "cannot read %s", path);
    if (!file) return;
    ckpt_tensor *ts = NULL;
    int n = 0;
    pd_err err = {{0}};
    int rc = torch_zip_read(file, size, path, &ts, &n, &err);
    CHECKF(rc == 0, "%s: %s", label, err.msg);
    if (rc == 0) check_tensors(label, file, size, ts, n, tensors, only_file);
    ckpt_tensors_free(ts, n);
    free(file);
}

/* ---------- the synthetic fixtures ---------- */

static void test_synthetic(void) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", test_src_path("tests/model/data/torch"));
    char jpath[4200];
    snprintf(jpath, sizeof jpath, "%s/synthetic.expected.json", dir);
    cJSON *j = load_json(jpath);
    if (!j) return;
    cJSON *files = cJSON_GetObjectItem(j, "files"), *f;
    CHECK(cJSON_GetArraySize(files) == 3);
    cJSON_ArrayForEach(f, files) {
        char path[4200];
        snprintf(path, sizeof path, "%s/%s", dir, cJSON_GetStringValue(f));
        check_file(path, cJSON_GetStringValue(f), cJSON_GetObjectItem(j, "tensors"), NULL);
    }
    cJSON_Delete(j);
}

/* Directories written by scripts/make-torch-fixtures.py (real torch). Each
 * must hold an expected.json whose entries name their file. */
static void test_real_torch_fixtures(void) {
    const char *root = test_src_path("tests/model/data/torch");
    char rootbuf[4096];
    snprintf(rootbuf, sizeof rootbuf, "%s", root);
    DIR *d = opendir(rootbuf);
    CHECK(d != NULL);
    if (!d) return;
    int found = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        char sub[4400], jpath[4600];
        struct stat st;
        snprintf(sub, sizeof sub, "%s/%s", rootbuf, de->d_name);
        if (stat(sub, &st) != 0 || !S_ISDIR(st.st_mode)) continue;
        found++;
        snprintf(jpath, sizeof jpath, "%s/expected.json", sub);
        cJSON *j = load_json(jpath);
        if (!j) continue;
        cJSON *tensors = cJSON_GetObjectItem(j, "tensors"), *e;
        CHECKF(cJSON_GetArraySize(tensors) > 0, "%s lists no tensors", jpath);
        /* Each distinct file once. */
        cJSON *seen = cJSON_CreateObject();
        cJSON_ArrayForEach(e, tensors) {
            const char *file = cJSON_GetStringValue(cJSON_GetObjectItem(e, "file"));
            CHECKF(file != NULL, "%s: an entry has no \"file\"", jpath);
            if (!file || cJSON_GetObjectItem(seen, file)) continue;
            cJSON_AddTrueToObject(seen, file);
            char path[4800], label[600];
            snprintf(path, sizeof path, "%s/%s", sub, file);
            snprintf(label, sizeof label, "%s/%s", de->d_name, file);
            check_file(path, label, tensors, file);
        }
        printf("real-torch fixture %s: %d file(s) checked\n", de->d_name, cJSON_GetArraySize(seen));
        cJSON_Delete(seen);
        cJSON_Delete(j);
    }
    closedir(d);
    if (!found)
        printf("real-torch fixtures not present (run scripts/make-torch-fixtures.py where torch "
               "is)\n");
}

/* ---------- building archives and pickles in memory ---------- */

typedef struct {
    uint8_t *b;
    size_t n, cap;
} buf;

static void put(buf *b, const void *p, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->b = realloc(b->b, b->cap);
    }
    memcpy(b->b + b->n, p, n);
    b->n += n;
}
static void put8(buf *b, unsigned v) {
    uint8_t c = (uint8_t)v;
    put(b, &c, 1);
}
static void put16(buf *b, unsigned v) {
    put8(b, v & 255);
    put8(b, (v >> 8) & 255);
}
static void put32(buf *b, uint32_t v) {
    put16(b, v & 0xffff);
    put16(b, v >> 16);
}
static void puts_(buf *b, const char *s) {
    put(b, s, strlen(s));
}

typedef struct {
    const char *name;
    const void *data;
    size_t len;
} zrec;

/* A minimal STORED zip (CRC left 0: the reader does not check it). */
static buf zip_build(const zrec *recs, int n, unsigned method) {
    buf z = {0}, cd = {0};
    for (int i = 0; i < n; i++) {
        uint32_t off = (uint32_t)z.n;
        size_t nl = strlen(recs[i].name);
        put32(&z, 0x04034b50);
        put16(&z, 20);
        put16(&z, 0);
        put16(&z, method);
        put32(&z, 0);
        put32(&z, 0);
        put32(&z, (uint32_t)recs[i].len);
        put32(&z, (uint32_t)recs[i].len);
        put16(&z, (unsigned)nl);
        put16(&z, 0);
        put(&z, recs[i].name, nl);
        put(&z, recs[i].data, recs[i].len);
        put32(&cd, 0x02014b50);
        put16(&cd, 20);
        put16(&cd, 20);
        put16(&cd, 0);
        put16(&cd, method);
        put32(&cd, 0);
        put32(&cd, 0);
        put32(&cd, (uint32_t)recs[i].len);
        put32(&cd, (uint32_t)recs[i].len);
        put16(&cd, (unsigned)nl);
        put16(&cd, 0);
        put16(&cd, 0);
        put16(&cd, 0);
        put16(&cd, 0);
        put32(&cd, 0);
        put32(&cd, off);
        put(&cd, recs[i].name, nl);
    }
    uint32_t cd_off = (uint32_t)z.n;
    put(&z, cd.b, cd.n);
    put32(&z, 0x06054b50);
    put16(&z, 0);
    put16(&z, 0);
    put16(&z, (unsigned)n);
    put16(&z, (unsigned)n);
    put32(&z, (uint32_t)cd.n);
    put32(&z, cd_off);
    put16(&z, 0);
    free(cd.b);
    return z;
}

static void pk_str(buf *p, const char *s) {
    put8(p, 'X');
    put32(p, (uint32_t)strlen(s));
    puts_(p, s);
}
static void pk_int(buf *p, int32_t v) {
    put8(p, 'J');
    put32(p, (uint32_t)v);
}

/* One tensor: _rebuild_tensor_v2(('storage', torch.<type>, key, 'cpu', numel), offset, size,
 * stride, False, {}) */
static void pk_tensor(buf *p, const char *storage_type, const char *key, int numel, int offset,
                      int ndim, const int *size, const int *stride) {
    puts_(p, "ctorch._utils\n_rebuild_tensor_v2\n(");
    put8(p, '(');
    pk_str(p, "storage");
    puts_(p, "ctorch\n");
    puts_(p, storage_type);
    put8(p, '\n');
    pk_str(p, key);
    pk_str(p, "cpu");
    pk_int(p, numel);
    puts_(p, "tQ");
    pk_int(p, offset);
    put8(p, '(');
    for (int d = 0; d < ndim; d++)
        pk_int(p, size[d]);
    put8(p, 't');
    put8(p, '(');
    for (int d = 0; d < ndim; d++)
        pk_int(p, stride[d]);
    put8(p, 't');
    puts_(p, "\x89}tR");
}

/* The last crafted archive stays alive until the next one, because the
 * tensors read from it point into it. */
static uint8_t *crafted_file;

/* Read an archive holding `pkl` as archive/data.pkl plus up to two storages. */
static int read_crafted(const buf *pkl, const char *key0, const void *d0, size_t l0,
                        const char *key1, const void *d1, size_t l1, ckpt_tensor **ts, int *n,
                        pd_err *err) {
    char n0[64], n1[64];
    snprintf(n0, sizeof n0, "archive/data/%s", key0 ? key0 : "");
    snprintf(n1, sizeof n1, "archive/data/%s", key1 ? key1 : "");
    zrec recs[3] = {{"archive/data.pkl", pkl->b, pkl->n}, {n0, d0, l0}, {n1, d1, l1}};
    buf z = zip_build(recs, 1 + (key0 != NULL) + (key1 != NULL), 0);
    /* Exact-size copy so ASan catches any read past the end. */
    free(crafted_file);
    uint8_t *exact = crafted_file = malloc(z.n);
    memcpy(exact, z.b, z.n);
    int rc = torch_zip_read(exact, z.n, "crafted.bin", ts, n, err);
    if (rc == 0) {
        /* Data that is not an owned copy must point into the archive. */
        for (int i = 0; i < *n; i++)
            if (!(*ts)[i].owned)
                CHECK((const uint8_t *)(*ts)[i].data >= exact &&
                      (const uint8_t *)(*ts)[i].data + (*ts)[i].nbytes <= exact + z.n);
    }
    free(z.b);
    return rc;
}

/* Expect failure with `want` in the message. */
static void expect_error(int rc, const pd_err *err, const char *want, const char *what) {
    CHECKF(rc == -1, "%s: expected an error", what);
    CHECKF(rc == -1 && strstr(err->msg, want), "%s: message '%s' lacks '%s'", what, err->msg, want);
}

/* A state dict {name: tensor} in protocol 2. */
static buf pk_one_tensor(const char *name, const char *stype, const char *key, int numel,
                         int offset, int ndim, const int *size, const int *stride) {
    buf p = {0};
    puts_(&p, "\x80\x02}(");
    pk_str(&p, name);
    pk_tensor(&p, stype, key, numel, offset, ndim, size, stride);
    puts_(&p, "u.");
    return p;
}

/* Strided views against an in-test reference: element idx = storage[offset + sum(idx*stride)]. */
static void test_strided_views(void) {
    float storage[24];
    for (int i = 0; i < 24; i++)
        storage[i] = (float)(i * 1.5 - 7);
    struct {
        int ndim, offset, size[3], stride[3];
    } cases[] = {
        {2, 0, {3, 2}, {1, 3}},        /* transpose of a 2x3 */
        {3, 1, {2, 3, 2}, {1, 4, 2}},  /* a permuted 3-D view with an offset */
        {2, 2, {2, 3}, {8, 2}},        /* every other element of two rows */
        {2, 5, {4, 3}, {0, 1}},        /* broadcast row (stride 0) */
        {3, 0, {2, 1, 3}, {3, 99, 1}}, /* size-1 dim with an odd stride is still contiguous */
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        buf p = pk_one_tensor("w", "FloatStorage", "0", 24, cases[c].offset, cases[c].ndim,
                              cases[c].size, cases[c].stride);
        ckpt_tensor *ts = NULL;
        int n = 0;
        pd_err err = {{0}};
        int rc = read_crafted(&p, "0", storage, sizeof storage, NULL, NULL, 0, &ts, &n, &err);
        CHECKF(rc == 0 && n == 1, "case %zu: %s", c, err.msg);
        if (rc == 0 && n == 1) {
            int idx[3] = {0}, total = 1, nd = cases[c].ndim;
            for (int d = 0; d < nd; d++)
                total *= cases[c].size[d];
            CHECK(ts[0].nbytes == (size_t)total * 4);
            CHECK((ts[0].owned == NULL) == (c == 4));
            for (int e = 0; e < total; e++) {
                int at = cases[c].offset;
                for (int d = 0; d < nd; d++)
                    at += idx[d] * cases[c].stride[d];
                float got = fget(ts[0].data, (size_t)e);
                CHECKF(got == storage[at], "case %zu element %d: %g != %g", c, e, got, storage[at]);
                for (int d = nd - 1; d >= 0; d--) {
                    if (++idx[d] < cases[c].size[d]) break;
                    idx[d] = 0;
                }
            }
        }
        ckpt_tensors_free(ts, n);
        free(p.b);
    }
}

static void test_bad_tensors(void) {
    float storage[6] = {1, 2, 3, 4, 5, 6};
    ckpt_tensor *ts;
    int n;
    pd_err err;
    int sz24[2] = {2, 4}, st41[2] = {4, 1}, sz1[1] = {1}, st1[1] = {1}, sz23[2] = {2, 3},
        st31[2] = {3, 1};

    buf p = pk_one_tensor("a.weight", "FloatStorage", "9", 6, 0, 2, sz23, st31);
    expect_error(read_crafted(&p, "0", storage, sizeof storage, NULL, NULL, 0, &ts, &n, &err), &err,
                 "archive/data/9", "storage key missing");
    free(p.b);

    p = pk_one_tensor("a.weight", "FloatStorage", "0", 6, 0, 2, sz24, st41);
    expect_error(read_crafted(&p, "0", storage, sizeof storage, NULL, NULL, 0, &ts, &n, &err), &err,
                 "reaches element 7", "extent past storage end");
    free(p.b);

    p = pk_one_tensor("a.weight", "FloatStorage", "0", 6, 6, 1, sz1, st1);
    expect_error(read_crafted(&p, "0", storage, sizeof storage, NULL, NULL, 0, &ts, &n, &err), &err,
                 "reaches element 6", "offset past storage end");
    free(p.b);

    p = pk_one_tensor("a.weight", "FloatStorage", "0", 7, 0, 2, sz23, st31);
    expect_error(read_crafted(&p, "0", storage, sizeof storage, NULL, NULL, 0, &ts, &n, &err), &err,
                 "too few", "storage entry shorter than its numel");
    free(p.b);

    p = pk_one_tensor("a.weight", "UntypedStorage", "0", 6, 0, 2, sz23, st31);
    expect_error(read_crafted(&p, "0", storage, sizeof storage, NULL, NULL, 0, &ts, &n, &err), &err,
                 "torch.UntypedStorage", "untyped storage");
    free(p.b);

    /* Two tensors with one name. */
    p = (buf){0};
    puts_(&p, "\x80\x02}(");
    pk_str(&p, "x");
    pk_tensor(&p, "FloatStorage", "0", 6, 0, 2, sz23, st31);
    pk_str(&p, "x");
    pk_tensor(&p, "FloatStorage", "0", 6, 0, 1, sz1, st1);
    puts_(&p, "u.");
    expect_error(read_crafted(&p, "0", storage, sizeof storage, NULL, NULL, 0, &ts, &n, &err), &err,
                 "appears twice", "duplicate names");
    free(p.b);

    /* {"state_dict": {...}} is unwrapped; tensors share one storage at different offsets. */
    p = (buf){0};
    puts_(&p, "\x80\x02}");
    pk_str(&p, "state_dict");
    puts_(&p, "}(");
    pk_str(&p, "x");
    pk_tensor(&p, "FloatStorage", "0", 6, 0, 2, sz23, st31);
    pk_str(&p, "y");
    pk_tensor(&p, "FloatStorage", "0", 6, 5, 1, sz1, st1);
    puts_(&p, "us.");
    int rc = read_crafted(&p, "0", storage, sizeof storage, NULL, NULL, 0, &ts, &n, &err);
    CHECKF(rc == 0 && n == 2, "state_dict wrapper: %s", err.msg);
    if (rc == 0 && n == 2) {
        CHECK(strcmp(ts[0].name, "x") == 0 && ts[0].ndim == 2 && ts[0].shape[1] == 3);
        CHECK(fget(ts[1].data, 0) == 6.0f);
        CHECK((const uint8_t *)ts[1].data == (const uint8_t *)ts[0].data + 5 * 4);
        ckpt_tensors_free(ts, n);
    }
    free(p.b);

    /* A state dict holding a non-tensor value. */
    p = (buf){0};
    puts_(&p, "\x80\x02}");
    pk_str(&p, "epoch");
    puts_(&p, "K\x03s.");
    expect_error(read_crafted(&p, NULL, NULL, 0, NULL, NULL, 0, &ts, &n, &err), &err,
                 "'epoch' has type int", "non-tensor entry");
    free(p.b);

    /* Big-endian storages are refused. */
    p = pk_one_tensor("a", "FloatStorage", "0", 6, 0, 2, sz23, st31);
    {
        zrec recs[3] = {{"archive/data.pkl", p.b, p.n},
                        {"archive/data/0", storage, sizeof storage},
                        {"archive/byteorder", "big", 3}};
        buf z = zip_build(recs, 3, 0);
        expect_error(torch_zip_read(z.b, z.n, "be.bin", &ts, &n, &err), &err, "little-endian",
                     "byteorder big");
        free(z.b);
    }
    free(p.b);
}

/* Pickles that must be refused before anything is built. */
static void test_bad_pickles(void) {
    static const struct {
        const char *bytes;
        size_t len;
        const char *want;
    } cases[] = {
        {"\x80\x02"
         "cos\nsystem\n"
         "X\x02\x00\x00\x00ls\x85R.",
         24, "refusing to unpickle global os.system"},
        {"\x80\x04\x8c\x08"
         "builtins\x8c\x04"
         "eval\x93N\x85R.",
         22, "refusing to unpickle global builtins.eval"},
        {"\x80\x02"
         "ctorch\nload\n.",
         14, "global torch.load"},
        {"\x80\x02"
         "ctorch._utils\n_rebuild_tensor\n.",
         33, "global torch._utils._rebuild_tensor"},
        {"\x80\x02"
         "ctorch\nHalfStorage\n)R.",
         23, "calling torch.HalfStorage"},
        {"\x80\x02"
         "ccollections\nOrderedDict\nN\x85R.",
         30, "OrderedDict() with arguments"},
        {"\x80\x02}\x81.", 5, "unsupported pickle opcode"},
        {"\x80\x02"
         "ccollections\nOrderedDict\n)\x81.",
         29, "opcode 0x81"},
        {"\x80\x02"
         "i__main__\nX\n.",
         14, "unsupported pickle opcode"},
        {"\x80\x02h\x05.", 5, "never stored"},
        {"\x80\x02N)R.", 6, "REDUCE on a None"},
        {"\x80\x02N.", 4, "is a None, not a state dict"},
        {"\x80\x02]2a.", 6, "is a list, not a state dict"}, /* a list containing itself */
        {"\x80\x02}", 3, "without STOP"},
        {"\x80\x02X\xff\xff\xff\x7f", 7, "runs past the end of the pickle"},
        {"\x80\x02T\xff\xff\xff\xff", 7, "negative string length"},
        {"\x80\x06.", 3, "protocol 6"},
        {"\x80\x02"
         "0.",
         4, "stack underflow"},
        {"\x80\x02N(s.", 6, "stack underflow"}, /* SETITEM may not reach below a MARK */
        {"\x80\x02t.", 4, "no MARK"},
        {"\x80\x02}(Nu.", 7, "odd number"},
        {"\x80\x02\x8a\x09"
         "123456789.",
         14, "does not fit in 64 bits"},
        {"\x80\x02"
         "cnoline",
         9, "not newline-terminated"},
        {"\x80\x02"
         "Nr\xff\xff\xff\x7f.",
         9, "implausibly large"},
        {"\x80\x02"
         "ctorch\nHalfStorage\nQ.",
         22, "persistent id is not"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        buf p = {0};
        put(&p, cases[i].bytes, cases[i].len);
        ckpt_tensor *ts;
        int n;
        pd_err err = {{0}};
        char what[64];
        snprintf(what, sizeof what, "bad pickle %zu", i);
        expect_error(read_crafted(&p, NULL, NULL, 0, NULL, NULL, 0, &ts, &n, &err), &err,
                     cases[i].want, what);
        free(p.b);
    }
}

/* Depth and size limits: no recursion, capped marks and stack. */
static void test_limits(void) {
    ckpt_tensor *ts;
    int n;
    pd_err err;
    buf p = {0};
    puts_(&p, "\x80\x02");
    for (int i = 0; i < 100000; i++)
        put8(&p, '(');
    put8(&p, '.');
    expect_error(read_crafted(&p, NULL, NULL, 0, NULL, NULL, 0, &ts, &n, &err), &err,
                 "MARKs nested deeper", "deep marks");
    free(p.b);

    /* A million nested 1-tuples: nothing recurses, so this is just "not a dict". */
    p = (buf){0};
    puts_(&p, "\x80\x02N");
    for (int i = 0; i < 1000000; i++)
        put8(&p, 0x85);
    put8(&p, '.');
    expect_error(read_crafted(&p, NULL, NULL, 0, NULL, NULL, 0, &ts, &n, &err), &err,
                 "is a tuple, not a state dict", "deep tuples");
    free(p.b);

    /* 200k lists that each contain themselves: cycles must not trouble freeing. */
    p = (buf){0};
    puts_(&p, "\x80\x02");
    for (int i = 0; i < 200000; i++)
        puts_(&p, "]2a");
    put8(&p, '.');
    expect_error(read_crafted(&p, NULL, NULL, 0, NULL, NULL, 0, &ts, &n, &err), &err,
                 "is a list, not a state dict", "self-referencing lists");
    free(p.b);

    p = (buf){0};
    puts_(&p, "\x80\x02");
    for (int i = 0; i < (1 << 20) + 1; i++)
        put8(&p, 'N');
    put8(&p, '.');
    expect_error(read_crafted(&p, NULL, NULL, 0, NULL, NULL, 0, &ts, &n, &err), &err,
                 "stack deeper", "stack overflow");
    free(p.b);
}

/* ---------- archive-level errors on the real synthetic file ---------- */

static int find_last(const uint8_t *b, size_t n, const char *sig) {
    for (size_t i = n - 4 + 1; i-- > 0;)
        if (memcmp(b + i, sig, 4) == 0) return (int)i;
    return -1;
}

static int read_buf(const uint8_t *src, size_t n, pd_err *err) {
    uint8_t *exact = malloc(n ? n : 1);
    memcpy(exact, src, n);
    ckpt_tensor *ts = NULL;
    int count = 0;
    int rc = torch_zip_read(exact, n, "mutant.bin", &ts, &count, err);
    if (rc == 0) {
        for (int i = 0; i < count; i++)
            if (!ts[i].owned && ts[i].nbytes)
                CHECK((const uint8_t *)ts[i].data >= exact &&
                      (const uint8_t *)ts[i].data + ts[i].nbytes <= exact + n);
        ckpt_tensors_free(ts, count);
    }
    free(exact);
    return rc;
}

static void test_bad_archives(void) {
    size_t size;
    uint8_t *orig = load(test_src_path("tests/model/data/torch/synthetic.bin"), &size);
    CHECK(orig != NULL);
    if (!orig) return;
    uint8_t *m = malloc(size);
    pd_err err;
    int eocd = find_last(orig, size, "PK\x05\x06");
    CHECK(eocd > 0);

    memcpy(m, orig, size);
    m[eocd] = 'X';
    expect_error(read_buf(m, size, &err), &err, "no end-of-central-directory",
                 "bad EOCD signature");

    memcpy(m, orig, size);
    m[eocd + 16 + 3] = 0x7f; /* central directory offset far past the end */
    expect_error(read_buf(m, size, &err), &err, "lies outside the file", "bad CD offset");

    memcpy(m, orig, size);
    m[eocd + 10] = 0xff, m[eocd + 11] = 0x7f; /* entry count */
    expect_error(read_buf(m, size, &err), &err, "has room for", "bad entry count");

    memcpy(m, orig, size);
    m[eocd + 4] = 1; /* disk number */
    expect_error(read_buf(m, size, &err), &err, "multi-disk", "multi-disk");

    int cd = find_last(orig, size, "PK\x01\x02"); /* the last central entry */
    memcpy(m, orig, size);
    m[cd + 42 + 3] = 0x40; /* its local header offset */
    expect_error(read_buf(m, size, &err), &err, "no local header", "bad local offset");

    memcpy(m, orig, size);
    m[cd + 8] |= 1;
    expect_error(read_buf(m, size, &err), &err, "encrypted", "encrypted flag");

    memcpy(m, orig, size);
    m[cd + 10] = 8; /* deflate */
    expect_error(read_buf(m, size, &err), &err, "compressed (method 8)", "method 8 in synthetic");

    expect_error(read_buf((const uint8_t *)"\x80\x02\x8a\x0al\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.",
                          16, &err),
                 &err, "legacy", "legacy format");
    expect_error(read_buf((const uint8_t *)"hello", 5, &err), &err, "no zip signature",
                 "not a zip");
    expect_error(read_buf((const uint8_t *)"PK\x03\x04", 4, &err), &err, "too small", "tiny zip");

    /* Built archives: a compressed entry, and no data.pkl. */
    zrec recs[2] = {{"archive/data.pkl", "\x80\x02}.", 4}, {"archive/data/0", "abcd", 4}};
    buf z = zip_build(recs, 2, 8);
    expect_error(read_buf(z.b, z.n, &err), &err, "compressed (method 8)", "method 8");
    free(z.b);
    z = zip_build(recs + 1, 1, 0);
    expect_error(read_buf(z.b, z.n, &err), &err, "data.pkl", "missing data.pkl");
    free(z.b);
    z = zip_build(recs, 2, 0); /* and the same archive, well-formed: an empty state dict */
    CHECKF(read_buf(z.b, z.n, &err) == 0, "empty state dict: %s", err.msg);
    free(z.b);

    /* ZIP64: a locator that points nowhere. */
    size_t size64;
    uint8_t *z64 = load(test_src_path("tests/model/data/torch/synthetic-zip64.bin"), &size64);
    CHECK(z64 != NULL);
    if (z64) {
        int loc = find_last(z64, size64, "PK\x06\x07");
        CHECK(loc > 0);
        if (loc > 0) {
            z64[loc + 8] ^= 0x10;
            expect_error(read_buf(z64, size64, &err), &err, "ZIP64 locator", "bad zip64 locator");
            z64[loc + 8] ^= 0x10;
            int c64 = find_last(z64, size64, "PK\x01\x02");
            z64[c64 + 30] = 8; /* central extra shrinks to 8 bytes: zip64 field cut short */
            CHECK(read_buf(z64, size64, &err) == -1);
        }
        free(z64);
    }
    free(m);
    free(orig);
}

/* Truncate at every 97th byte and flip random bytes: errors are fine, crashes
 * and out-of-bounds reads (caught by ASan) are not. */
static void test_truncation_and_flips(void) {
    const char *names[] = {"synthetic.bin", "synthetic-p4.bin", "synthetic-zip64.bin"};
    for (int f = 0; f < 3; f++) {
        char rel[128];
        snprintf(rel, sizeof rel, "tests/model/data/torch/%s", names[f]);
        size_t size;
        uint8_t *orig = load(test_src_path(rel), &size);
        CHECK(orig != NULL);
        if (!orig) continue;
        pd_err err;
        int errors = 0, cuts = 0;
        for (size_t cut = 0; cut < size; cut += 97, cuts++) {
            err.msg[0] = 0;
            int rc = read_buf(orig, cut, &err);
            if (rc == -1 && err.msg[0]) errors++;
        }
        /* The central directory is at the end, so every cut loses it. */
        CHECKF(errors == cuts, "%s: %d of %d truncations gave a clean error", names[f], errors,
               cuts);
        CHECK(read_buf(orig, size, &err) == 0);

        uint8_t *m = malloc(size);
        uint64_t rng = 0x9e3779b97f4a7c15ull + (uint64_t)f;
        int ok = 0;
        for (int iter = 0; iter < 3000; iter++) {
            memcpy(m, orig, size);
            int flips = 1 + iter % 4;
            for (int k = 0; k < flips; k++) {
                rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                size_t at = (size_t)(rng >> 33) % size;
                m[at] = (uint8_t)(rng >> 13);
            }
            if (read_buf(m, size, &err) == 0) ok++;
        }
        printf("%s: %d cuts, 3000 mutants (%d still read)\n", names[f], cuts, ok);
        free(m);
        free(orig);
    }
}

int main(void) {
    test_synthetic();
    test_real_torch_fixtures();
    test_strided_views();
    test_bad_tensors();
    test_bad_pickles();
    test_limits();
    test_bad_archives();
    test_truncation_and_flips();
    free(crafted_file);
    return test_finish();
}
