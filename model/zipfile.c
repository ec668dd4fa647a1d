/* zipfile: index a ZIP archive held in memory (see zipfile.h).
 *
 * Layout, read from the end: the End Of Central Directory record (EOCD, 22
 * bytes + comment) says where the central directory is; when the archive is
 * ZIP64 a locator just before the EOCD points at a 64-bit EOCD record that
 * carries the real counts and offsets. Each central directory entry names a
 * file and the offset of its local header; the data starts after that local
 * header's own name and extra field, whose lengths can differ from the
 * central entry's (torch pads the local extra field to align data). */
#include "model/zipfile.h"

#include <stdlib.h>
#include <string.h>

enum {
    SIG_LOCAL = 0x04034b50,
    SIG_CENTRAL = 0x02014b50,
    SIG_EOCD = 0x06054b50,
    SIG_EOCD64 = 0x06064b50,
    SIG_EOCD64_LOCATOR = 0x07064b50,
    LOCAL_LEN = 30,
    CENTRAL_LEN = 46,
    EOCD_LEN = 22,
    EOCD64_LEN = 56,
    LOCATOR_LEN = 20,
    MAX_COMMENT = 65535,
    ZIP64_EXTRA_ID = 0x0001,
};

static uint16_t rd16(const uint8_t *p) {
    return (uint16_t)(p[0] | (p[1] << 8));
}
static uint32_t rd32(const uint8_t *p) {
    return (uint32_t)rd16(p) | ((uint32_t)rd16(p + 2) << 16);
}
static uint64_t rd64(const uint8_t *p) {
    return (uint64_t)rd32(p) | ((uint64_t)rd32(p + 4) << 32);
}

/* Does [off, off+len) lie within [0, limit)? Written so it cannot overflow. */
static int in_bounds(uint64_t off, uint64_t len, uint64_t limit) {
    return off <= limit && len <= limit - off;
}

typedef struct {
    uint64_t n_entries, cd_off, cd_size;
} cd_location;

/* Find the EOCD (searching backwards over at most a maximal comment) and, if
 * present, the ZIP64 record that supersedes its fields. */
static int find_central_dir(const uint8_t *b, size_t size, const char *path, cd_location *loc,
                            pd_err *err) {
    if (size < EOCD_LEN)
        return pd_fail(err, "%s: %zu bytes is too small to be a zip archive", path, size);
    size_t lowest = size - EOCD_LEN > MAX_COMMENT ? size - EOCD_LEN - MAX_COMMENT : 0;
    size_t pos = size - EOCD_LEN;
    for (;;) {
        if (rd32(b + pos) == SIG_EOCD && pos + EOCD_LEN + rd16(b + pos + 20) <= size) break;
        if (pos == lowest)
            return pd_fail(
                err, "%s: no end-of-central-directory record: not a zip archive, or truncated",
                path);
        pos--;
    }
    const uint8_t *e = b + pos;
    uint32_t disk = rd16(e + 4), cd_disk = rd16(e + 6);
    loc->n_entries = rd16(e + 10);
    loc->cd_size = rd32(e + 12);
    loc->cd_off = rd32(e + 16);

    if (pos >= LOCATOR_LEN && rd32(e - LOCATOR_LEN) == SIG_EOCD64_LOCATOR) {
        uint64_t off64 = rd64(e - LOCATOR_LEN + 8);
        if (!in_bounds(off64, EOCD64_LEN, pos - LOCATOR_LEN) || rd32(b + off64) != SIG_EOCD64)
            return pd_fail(
                err, "%s: ZIP64 locator points at offset %llu, where there is no ZIP64 record",
                path, (unsigned long long)off64);
        const uint8_t *r = b + off64;
        disk = rd32(r + 16);
        cd_disk = rd32(r + 20);
        loc->n_entries = rd64(r + 32);
        loc->cd_size = rd64(r + 40);
        loc->cd_off = rd64(r + 48);
    }
    if (disk != 0 || cd_disk != 0)
        return pd_fail(err, "%s: multi-disk zip archives are not supported", path);
    if (!in_bounds(loc->cd_off, loc->cd_size, size))
        return pd_fail(
            err,
            "%s: central directory (%llu bytes at offset %llu) lies outside the file (%zu bytes)",
            path, (unsigned long long)loc->cd_size, (unsigned long long)loc->cd_off, size);
    if (loc->n_entries > loc->cd_size / CENTRAL_LEN)
        return pd_fail(
            err, "%s: zip claims %llu entries but its central directory has room for %llu", path,
            (unsigned long long)loc->n_entries, (unsigned long long)(loc->cd_size / CENTRAL_LEN));
    return 0;
}

/* Replace saturated 32-bit fields (0xFFFFFFFF) with their values from the
 * ZIP64 extra field, which holds exactly the saturated ones, in this order. */
static int apply_zip64_extra(const uint8_t *extra, size_t extra_len, uint64_t *usize,
                             uint64_t *csize, uint64_t *local_off) {
    uint64_t *fields[3] = {usize, csize, local_off};
    size_t at = 0;
    while (at + 4 <= extra_len) {
        uint16_t id = rd16(extra + at), len = rd16(extra + at + 2);
        at += 4;
        if (len > extra_len - at) return -1;
        if (id == ZIP64_EXTRA_ID) {
            size_t used = 0;
            for (int i = 0; i < 3; i++) {
                if (*fields[i] != 0xFFFFFFFFu) continue;
                if (used + 8 > len) return -1;
                *fields[i] = rd64(extra + at + used);
                used += 8;
            }
            return 0;
        }
        at += len;
    }
    return (*usize == 0xFFFFFFFFu || *csize == 0xFFFFFFFFu || *local_off == 0xFFFFFFFFu) ? -1 : 0;
}

static int read_entry(const uint8_t *b, size_t size, const char *path, uint64_t *p, uint64_t cd_end,
                      zip_entry *out, pd_err *err) {
    if (!in_bounds(*p, CENTRAL_LEN, cd_end) || rd32(b + *p) != SIG_CENTRAL)
        return pd_fail(err, "%s: bad central directory entry at offset %llu", path,
                       (unsigned long long)*p);
    const uint8_t *c = b + *p;
    uint16_t flags = rd16(c + 8), method = rd16(c + 10);
    uint64_t csize = rd32(c + 20), usize = rd32(c + 24), local_off = rd32(c + 42);
    size_t name_len = rd16(c + 28), extra_len = rd16(c + 30), comment_len = rd16(c + 32);
    if (!in_bounds(*p + CENTRAL_LEN, (uint64_t)name_len + extra_len + comment_len, cd_end))
        return pd_fail(err, "%s: central directory entry at offset %llu runs past the directory",
                       path, (unsigned long long)*p);
    const char *name = (const char *)c + CENTRAL_LEN;
    int shown = name_len > 200 ? 200 : (int)name_len;
    if (apply_zip64_extra(c + CENTRAL_LEN + name_len, extra_len, &usize, &csize, &local_off) != 0)
        return pd_fail(err, "%s: zip entry '%.*s' has a missing or short ZIP64 extra field", path,
                       shown, name);
    if (flags & 1) return pd_fail(err, "%s: zip entry '%.*s' is encrypted", path, shown, name);
    if (method != 0)
        return pd_fail(
            err,
            "%s: zip entry '%.*s' is compressed (method %u); only STORED entries are supported, "
            "as torch.save writes them",
            path, shown, name, method);
    if (csize != usize)
        return pd_fail(err, "%s: STORED zip entry '%.*s' has compressed size %llu != size %llu",
                       path, shown, name, (unsigned long long)csize, (unsigned long long)usize);
    if (!in_bounds(local_off, LOCAL_LEN, size) || rd32(b + local_off) != SIG_LOCAL)
        return pd_fail(err, "%s: zip entry '%.*s': no local header at offset %llu", path, shown,
                       name, (unsigned long long)local_off);
    uint64_t data_off = local_off + LOCAL_LEN + rd16(b + local_off + 26) + rd16(b + local_off + 28);
    if (!in_bounds(data_off, usize, size))
        return pd_fail(
            err,
            "%s: zip entry '%.*s' (%llu bytes at offset %llu) runs past the end of the file "
            "(%zu bytes): truncated?",
            path, shown, name, (unsigned long long)usize, (unsigned long long)data_off, size);
    out->name = name;
    out->name_len = name_len;
    out->data = b + data_off;
    out->size = usize;
    *p += CENTRAL_LEN + name_len + extra_len + comment_len;
    return 0;
}

int zip_open(zip_archive *z, const void *file, size_t size, const char *path, pd_err *err) {
    const uint8_t *b = file;
    z->entries = NULL;
    z->n = 0;
    cd_location loc = {0};
    if (find_central_dir(b, size, path, &loc, err) != 0) return -1;
    zip_entry *entries = calloc(loc.n_entries ? loc.n_entries : 1, sizeof *entries);
    if (!entries)
        return pd_fail(err, "%s: out of memory for %llu zip entries", path,
                       (unsigned long long)loc.n_entries);
    uint64_t p = loc.cd_off, cd_end = loc.cd_off + loc.cd_size;
    for (uint64_t i = 0; i < loc.n_entries; i++) {
        if (read_entry(b, size, path, &p, cd_end, &entries[i], err) != 0) {
            free(entries);
            return -1;
        }
    }
    z->entries = entries;
    z->n = loc.n_entries;
    return 0;
}

void zip_close(zip_archive *z) {
    free(z->entries);
    z->entries = NULL;
    z->n = 0;
}

const zip_entry *zip_find(const zip_archive *z, const char *name, size_t len) {
    for (size_t i = 0; i < z->n; i++)
        if (z->entries[i].name_len == len && memcmp(z->entries[i].name, name, len) == 0)
            return &z->entries[i];
    return NULL;
}
