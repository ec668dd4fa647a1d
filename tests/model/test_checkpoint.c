/* test_checkpoint: safetensors reading (hand-built files, so the reader is not
 * checked only against our own writer), the writer's round trip and padding,
 * sharded indexes, format dispatch, name lookup with and without "model.",
 * malformed files that must fail naming the problem, and hub-cache lookup. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model/checkpoint.h"
#include "tests/common/testlib.h"

static char *tmp_path(const char *sub) {
    char *p = malloc(1024);
    snprintf(p, 1024, "%s/%s", test_tmpdir(), sub);
    return p;
}

/* A fresh empty model directory. */
static char *fresh_dir(const char *name) {
    char *d = tmp_path(name);
    pd_err e;
    pd_mkdirs(d, &e);
    return d;
}

static void put_file(const char *dir, const char *name, const void *data, size_t len) {
    char *p = pd_path_join(dir, name);
    pd_err e;
    if (pd_write_file(p, data, len, &e)) fprintf(stderr, "%s\n", e.msg);
    free(p);
}

/* u64 length + header + data, laid out by hand. */
static size_t build_st(unsigned char *out, const char *header, const void *data, size_t dlen) {
    uint64_t n = strlen(header);
    for (int i = 0; i < 8; i++)
        out[i] = (unsigned char)(n >> (8 * i));
    memcpy(out + 8, header, n);
    memcpy(out + 8 + n, data, dlen);
    return 8 + n + dlen;
}

static int open_dir(const char *dir, checkpoint **ck, pd_err *e) {
    memset(e, 0, sizeof *e);
    return checkpoint_open(dir, ck, e);
}

static void test_hand_built(void) {
    /* Offsets deliberately not in header order; the header length (odd) leaves
     * the data unaligned; no __metadata__. */
    const char *hdr = "{\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[6,14]},"
                      "\"a\":{\"dtype\":\"F16\",\"shape\":[1,3],\"data_offsets\":[0,6]},"
                      "\"s\":{\"dtype\":\"I32\",\"shape\":[],\"data_offsets\":[14,18]},"
                      "\"z\":{\"dtype\":\"BF16\",\"shape\":[0,5],\"data_offsets\":[18,18]}}";
    unsigned char data[18];
    for (int i = 0; i < 18; i++)
        data[i] = (unsigned char)(i * 7 + 1);
    unsigned char file[1024];
    size_t len = build_st(file, hdr, data, sizeof data);
    char *dir = fresh_dir("hand");
    put_file(dir, "model.safetensors", file, len);
    checkpoint *ck;
    pd_err e;
    CHECKF(open_dir(dir, &ck, &e) == 0, "%s", e.msg);
    if (!ck) return;
    CHECK(strcmp(checkpoint_format(ck), "safetensors") == 0);
    CHECK(checkpoint_count(ck) == 4);
    CHECK(strcmp(checkpoint_get(ck, 0)->name, "b") == 0); /* header order */
    const ckpt_tensor *a = checkpoint_find(ck, "a"), *b = checkpoint_find(ck, "b");
    const ckpt_tensor *s = checkpoint_find(ck, "s"), *z = checkpoint_find(ck, "z");
    CHECK(a && a->dtype == CKPT_F16 && a->ndim == 2 && a->shape[0] == 1 && a->shape[1] == 3);
    CHECK(a && a->nbytes == 6 && memcmp(a->data, data, 6) == 0);
    CHECK(b && b->dtype == CKPT_F32 && b->nbytes == 8 && memcmp(b->data, data + 6, 8) == 0);
    CHECK(s && s->ndim == 0 && s->nbytes == 4 && memcmp(s->data, data + 14, 4) == 0);
    CHECK(z && z->nbytes == 0 && z->dtype == CKPT_BF16);
    CHECK(checkpoint_find(ck, "c") == NULL);
    checkpoint_close(ck);
    free(dir);
}

static void test_writer_round_trip(void) {
    float f[6] = {1.5f, -2, 3, 4, 5, 6.25f};
    uint16_t h[3] = {0x3c00, 0xc000, 0x7bff};
    int32_t iv[2] = {-7, 123456};
    ckpt_tensor ts[3] = {
        {.name = "model.decoder.w",
         .dtype = CKPT_F32,
         .ndim = 2,
         .shape = {2, 3},
         .data = f,
         .nbytes = 24},
        {.name = "x.h", .dtype = CKPT_F16, .ndim = 1, .shape = {3}, .data = h, .nbytes = 6},
        {.name = "x.i", .dtype = CKPT_I32, .ndim = 1, .shape = {2}, .data = iv, .nbytes = 8},
    };
    char *dir = fresh_dir("rt");
    char *path = pd_path_join(dir, "model.safetensors");
    pd_err e = {{0}};
    CHECKF(safetensors_write(path, ts, 3, &e) == 0, "%s", e.msg);
    char *raw;
    size_t rlen;
    CHECK(pd_read_file(path, &raw, &rlen, &e) == 0);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = (n << 8) | (unsigned char)raw[i];
    CHECK((8 + n) % 8 == 0);
    CHECK(rlen == 8 + n + 24 + 6 + 8);
    CHECK(raw[8] == '{' && (raw[8 + n - 1] == ' ' || raw[8 + n - 1] == '}'));
    free(raw);
    checkpoint *ck;
    CHECKF(open_dir(dir, &ck, &e) == 0, "%s", e.msg);
    if (ck) {
        const ckpt_tensor *w = checkpoint_find(ck, "decoder.w"); /* "model." added */
        CHECK(w && w->nbytes == 24 && memcmp(w->data, f, 24) == 0 && w->shape[1] == 3);
        const ckpt_tensor *hh = checkpoint_find(ck, "x.h"), *ii = checkpoint_find(ck, "x.i");
        CHECK(hh && hh->dtype == CKPT_F16 && memcmp(hh->data, h, 6) == 0);
        CHECK(ii && ii->dtype == CKPT_I32 && memcmp(ii->data, iv, 8) == 0);
        CHECK(checkpoint_find(ck, "model.x.h") == hh); /* "model." removed */
        checkpoint_close(ck);
    }
    free(path);
    free(dir);
}

/* Expect checkpoint_open on DIR to fail with a message containing needle. */
static void expect_fail(const char *what, const char *dir, const char *needle) {
    checkpoint *ck = NULL;
    pd_err e;
    int rc = open_dir(dir, &ck, &e);
    CHECKF(rc == -1 && ck == NULL, "%s: opened", what);
    if (rc == 0) checkpoint_close(ck);
    CHECKF(strstr(e.msg, needle) != NULL, "%s: message \"%s\" lacks \"%s\"", what, e.msg, needle);
}

static void expect_bad_st(const char *what, const void *file, size_t len, const char *needle) {
    char *dir = fresh_dir("bad");
    put_file(dir, "model.safetensors", file, len);
    expect_fail(what, dir, needle);
    free(dir);
}

static void test_malformed_safetensors(void) {
    unsigned char good[512], buf[512];
    const char *hdr = "{\"__metadata__\":{\"format\":\"pt\"},"
                      "\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]},"
                      "\"b\":{\"dtype\":\"F16\",\"shape\":[4],\"data_offsets\":[16,24]}}";
    unsigned char data[24] = {0};
    size_t glen = build_st(good, hdr, data, sizeof data);
    size_t hlen = strlen(hdr);

    /* Sanity: the untruncated file opens. */
    char *dir = fresh_dir("good");
    put_file(dir, "model.safetensors", good, glen);
    checkpoint *ck;
    pd_err e;
    CHECKF(open_dir(dir, &ck, &e) == 0, "%s", e.msg);
    if (ck) checkpoint_close(ck);
    free(dir);

    /* Truncated at several points. */
    expect_bad_st("empty file", good, 0, "header too small");
    expect_bad_st("cut at 5", good, 5, "header too small");
    expect_bad_st("cut at 8", good, 8, "past end of file");
    expect_bad_st("cut mid-header", good, 8 + hlen / 2, "past end of file");
    expect_bad_st("cut after header", good, 8 + hlen, "ends at offset 24 but the file holds 0");
    expect_bad_st("cut mid-data", good, 8 + hlen + 10, "holds 10 data bytes");
    expect_bad_st("last byte missing", good, glen - 1, "truncated");
    memcpy(buf, good, glen);
    buf[glen] = 0;
    expect_bad_st("trailing byte", buf, glen + 1, "holds 25 data bytes");

    /* Header length past EOF / too large. */
    memcpy(buf, good, glen);
    buf[0] = 0xff, buf[1] = 0x0f;
    expect_bad_st("length past EOF", buf, glen, "runs past end of file");
    memset(buf, 0, 8);
    buf[4] = 1; /* 2^32 */
    expect_bad_st("length too large", buf, glen, "header too large");

    size_t n;
    n = build_st(buf, "{\"a\":{\"dtype\":\"F32\",", data, 0);
    expect_bad_st("header not JSON", buf, n, "not valid JSON");
    n = build_st(buf, "[1,2,3]", data, 0);
    expect_bad_st("header not object", buf, n, "not a JSON object");
    n = build_st(buf, "{\"\xff\":1}", data, 0);
    expect_bad_st("header not UTF-8", buf, n, "not valid UTF-8");

    n = build_st(buf,
                 "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                 "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
                 data, 12);
    expect_bad_st("overlapping offsets", buf, n, "overlap");
    n = build_st(buf,
                 "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                 "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}",
                 data, 20);
    expect_bad_st("gap in offsets", buf, n, "gap in data_offsets");
    n = build_st(buf, "{\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", data,
                 12);
    expect_bad_st("not starting at 0", buf, n, "gap in data_offsets (begins at 4, expected 0)");
    n = build_st(buf, "{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", data, 8);
    expect_bad_st("data size mismatch", buf, n, "data size mismatch");
    n = build_st(buf, "{\"a\":{\"dtype\":\"Q4\",\"shape\":[2],\"data_offsets\":[0,8]}}", data, 8);
    expect_bad_st("unknown dtype", buf, n, "unknown dtype \"Q4\"");
    n = build_st(buf,
                 "{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4294967296],"
                 "\"data_offsets\":[0,8]}}",
                 data, 8);
    expect_bad_st("shape overflow", buf, n, "overflows");
    n = build_st(buf, "{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", data, 8);
    expect_bad_st("negative dim", buf, n, "non-negative integers");
    n = build_st(buf, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", data, 8);
    expect_bad_st("end before begin", buf, n, "before begin");
    n = build_st(buf, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", data, 8);
    expect_bad_st("no offsets", buf, n, "data_offsets must be [begin, end]");
    n = build_st(buf, "{\"__metadata__\":{\"format\":1}}", data, 0);
    expect_bad_st("bad metadata", buf, n, "__metadata__ value \"format\" is not a string");
    n = build_st(buf,
                 "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                 "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
                 data, 8);
    expect_bad_st("duplicate name", buf, n, "duplicate tensor a");

    /* The error names the file. */
    char *d = fresh_dir("bad");
    char *p = pd_path_join(d, "model.safetensors");
    n = build_st(buf, "nope", data, 0);
    put_file(d, "model.safetensors", buf, n);
    expect_fail("names file", d, p);
    free(p);
    free(d);
}

/* One single-tensor shard of n floats starting at value v0. */
static void write_shard(const char *dir, const char *file, const char *name, int n, float v0) {
    float vals[8];
    for (int i = 0; i < n; i++)
        vals[i] = v0 + (float)i;
    ckpt_tensor t = {.name = (char *)name,
                     .dtype = CKPT_F32,
                     .ndim = 1,
                     .shape = {n},
                     .data = vals,
                     .nbytes = (size_t)n * 4};
    char *p = pd_path_join(dir, file);
    pd_err e;
    if (safetensors_write(p, &t, 1, &e)) fprintf(stderr, "%s\n", e.msg);
    free(p);
}

static void put_text(const char *dir, const char *file, const char *text) {
    put_file(dir, file, text, strlen(text));
}

static void test_sharded(void) {
    char *dir = fresh_dir("shard");
    write_shard(dir, "model-00001-of-00002.safetensors", "decoder.a", 3, 10);
    write_shard(dir, "model-00002-of-00002.safetensors", "decoder.b", 2, 20);
    put_text(dir, "model.safetensors.index.json",
             "{\"metadata\":{\"total_size\":20},\"weight_map\":{"
             "\"decoder.a\":\"model-00001-of-00002.safetensors\","
             "\"decoder.b\":\"model-00002-of-00002.safetensors\"}}");
    /* A stale single file must not be picked over the index. */
    write_shard(dir, "model.safetensors", "stale", 1, 0);
    checkpoint *ck;
    pd_err e;
    CHECKF(open_dir(dir, &ck, &e) == 0, "%s", e.msg);
    if (ck) {
        CHECK(strcmp(checkpoint_format(ck), "safetensors-sharded") == 0);
        CHECK(checkpoint_count(ck) == 2);
        const ckpt_tensor *a = checkpoint_find(ck, "model.decoder.a");
        const ckpt_tensor *b = checkpoint_find(ck, "decoder.b");
        CHECK(a && ((const float *)a->data)[2] == 12.0f);
        CHECK(b && ((const float *)b->data)[1] == 21.0f);
        CHECK(checkpoint_find(ck, "stale") == NULL);
        checkpoint_close(ck);
    }

    put_text(dir, "model.safetensors.index.json",
             "{\"weight_map\":{\"decoder.a\":\"model-00001-of-00002.safetensors\","
             "\"decoder.b\":\"model-00009-of-00009.safetensors\"}}");
    expect_fail("missing shard", dir, "model-00009-of-00009.safetensors, which does not exist");
    /* There, but not a file (a folder here; /dev/zero is the same case). */
    char *folder = pd_path_join(dir, "model-00008-of-00009.safetensors");
    CHECK(folder && mkdir(folder, 0755) == 0);
    put_text(dir, "model.safetensors.index.json",
             "{\"weight_map\":{\"decoder.a\":\"model-00001-of-00002.safetensors\","
             "\"decoder.b\":\"model-00008-of-00009.safetensors\"}}");
    expect_fail("shard not a file", dir, "model-00008-of-00009.safetensors is not a regular file");
    if (folder) rmdir(folder);
    free(folder);
    put_text(dir, "model.safetensors.index.json",
             "{\"weight_map\":{\"decoder.a\":\"model-00001-of-00002.safetensors\","
             "\"decoder.c\":\"model-00002-of-00002.safetensors\"}}");
    expect_fail("tensor not in its shard", dir,
                "tensor decoder.c is missing from shard model-00002-of-00002.safetensors");
    put_text(dir, "model.safetensors.index.json",
             "{\"weight_map\":{\"decoder.a\":\"../x.safetensors\"}}");
    expect_fail("shard outside dir", dir, "outside the model directory");
    put_text(dir, "model.safetensors.index.json", "{\"metadata\":{}}");
    expect_fail("no weight_map", dir, "weight_map");
    put_text(dir, "model.safetensors.index.json", "{\"weight_map\":");
    expect_fail("index not JSON", dir, "not valid JSON");

    /* The same tensor in two shards. */
    write_shard(dir, "model-00003.safetensors", "decoder.a", 1, 0);
    put_text(dir, "model.safetensors.index.json",
             "{\"weight_map\":{\"decoder.a\":\"model-00001-of-00002.safetensors\","
             "\"decoder.b\":\"model-00002-of-00002.safetensors\","
             "\"decoder.x\":\"model-00003.safetensors\"}}");
    expect_fail("duplicate across shards", dir, "duplicate tensor decoder.a");
    free(dir);
}

static void test_dispatch(void) {
    char *dir = fresh_dir("empty");
    expect_fail("no weights", dir, "no weights in");
    free(dir);
    char *missing = tmp_path("does-not-exist");
    expect_fail("no dir", missing, "does not exist");
    free(missing);

    /* A .bin that is not a zip: the legacy format is refused by name. */
    dir = fresh_dir("legacy");
    put_text(dir, "pytorch_model.bin", "\x80\x02\x8a\x0alegacy pickle");
    expect_fail("legacy bin", dir, "not a torch zip archive (legacy torch format unsupported)");
    /* safetensors wins over .bin. */
    write_shard(dir, "model.safetensors", "decoder.a", 2, 1);
    checkpoint *ck;
    pd_err e;
    CHECKF(open_dir(dir, &ck, &e) == 0 && strcmp(checkpoint_format(ck), "safetensors") == 0, "%s",
           e.msg);
    if (ck) checkpoint_close(ck);
    free(dir);

    dir = fresh_dir("binshard");
    put_text(dir, "pytorch_model-00001-of-00001.bin", "not a zip");
    put_text(dir, "pytorch_model.bin.index.json",
             "{\"weight_map\":{\"decoder.a\":\"pytorch_model-00001-of-00001.bin\"}}");
    expect_fail("bin shard not zip", dir, "pytorch_model-00001-of-00001.bin: not a torch zip");
    put_text(dir, "pytorch_model.bin.index.json",
             "{\"weight_map\":{\"decoder.a\":\"pytorch_model-00002-of-00002.bin\"}}");
    expect_fail("bin shard missing", dir, "which does not exist");
    free(dir);

    /* A zip-looking .bin goes to the torch reader; garbage inside must fail
     * cleanly (whatever the reader's message). */
    dir = fresh_dir("zipjunk");
    put_file(dir, "pytorch_model.bin", "PK\x03\x04garbage-garbage-garbage", 27);
    ck = NULL;
    CHECK(open_dir(dir, &ck, &e) == -1 && ck == NULL && e.msg[0] != 0);
    free(dir);
}

static void mk(const char *path) {
    pd_err e;
    pd_mkdirs(path, &e);
}

static void test_hub_lookup(void) {
    char *home = tmp_path("hf");
    char snap[1024], p[1200];
    /* A cache with two snapshots; refs/main names the second. */
    snprintf(snap, sizeof snap, "%s/hub/models--facebook--opt-125m/snapshots/aaa", home);
    mk(snap);
    snprintf(p, sizeof p, "%s/config.json", snap);
    put_text(snap, "config.json", "{}");
    snprintf(snap, sizeof snap, "%s/hub/models--facebook--opt-125m/snapshots/bbb", home);
    mk(snap);
    put_text(snap, "config.json", "{}");
    snprintf(p, sizeof p, "%s/hub/models--facebook--opt-125m/refs", home);
    mk(p);
    put_text(p, "main", "bbb\n");

    setenv("HF_HOME", home, 1);
    unsetenv("HF_HUB_CACHE");
    unsetenv("HUGGINGFACE_HUB_CACHE");
    unsetenv("XDG_CACHE_HOME");
    setenv("HOME", "/nonexistent-home", 1);
    char *dir = NULL;
    pd_err e = {{0}};
    CHECKF(model_path_resolve("facebook/opt-125m", &dir, &e) == 0, "%s", e.msg);
    CHECKF(dir && strcmp(dir, snap) == 0, "got %s", dir ? dir : "(null)");
    free(dir);

    /* refs/main naming a missing snapshot: fall back to the first with config.json. */
    put_text(p, "main", "ccc");
    dir = NULL;
    CHECKF(model_path_resolve("facebook/opt-125m", &dir, &e) == 0, "%s", e.msg);
    CHECKF(dir && strstr(dir, "/snapshots/aaa"), "got %s", dir ? dir : "(null)");
    free(dir);

    /* HUGGINGFACE_HUB_CACHE takes precedence over HF_HOME. */
    char *other = tmp_path("hubcache");
    snprintf(snap, sizeof snap, "%s/models--facebook--opt-125m/snapshots/zzz", other);
    mk(snap);
    put_text(snap, "config.json", "{}");
    setenv("HUGGINGFACE_HUB_CACHE", other, 1);
    dir = NULL;
    CHECKF(model_path_resolve("facebook/opt-125m", &dir, &e) == 0, "%s", e.msg);
    CHECKF(dir && strcmp(dir, snap) == 0, "got %s", dir ? dir : "(null)");
    free(dir);

    /* A miss lists where it looked. */
    dir = NULL;
    CHECK(model_path_resolve("facebook/opt-999b", &dir, &e) == -1 && dir == NULL);
    CHECKF(strstr(e.msg, "models--facebook--opt-999b") && strstr(e.msg, other) &&
               strstr(e.msg, home),
           "%s", e.msg);

    /* An existing directory is returned as is; a missing path is an error. */
    dir = NULL;
    CHECK(model_path_resolve(home, &dir, &e) == 0 && dir && strcmp(dir, home) == 0);
    free(dir);
    dir = NULL;
    CHECK(model_path_resolve("/no/such/model/dir", &dir, &e) == -1);
    CHECKF(strstr(e.msg, "/no/such/model/dir"), "%s", e.msg);
    unsetenv("HUGGINGFACE_HUB_CACHE");
    free(other);
    free(home);
}

int main(void) {
    test_hand_built();
    test_writer_round_trip();
    test_malformed_safetensors();
    test_sharded();
    test_dispatch();
    test_hub_lookup();
    return test_finish();
}
