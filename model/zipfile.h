/* zipfile: a read-only index of a ZIP archive that is already in memory (an
 * mmap'd torch.save file). Only what torch.save writes is supported: one
 * disk, STORED (uncompressed) entries, optional ZIP64 records. Entry data is
 * never copied; every offset and length is checked against the buffer size,
 * so a truncated or hostile file gives an error, never an out-of-bounds read.
 * CRCs are not verified (that would mean reading every weight at load). */
#ifndef PD_MODEL_ZIPFILE_H
#define PD_MODEL_ZIPFILE_H

#include <stddef.h>
#include <stdint.h>

#include "common/pd_common.h"

typedef struct zip_entry {
    const char *name; /* points into the central directory, NOT NUL-terminated */
    size_t name_len;
    const uint8_t *data; /* first byte of the stored data, inside the buffer */
    uint64_t size;       /* bytes of data; data + size never passes the buffer end */
} zip_entry;

typedef struct zip_archive {
    zip_entry *entries;
    size_t n;
} zip_archive;

/* Index the archive in file[0..size). path is only used in error messages.
 * On failure *z is left empty (safe to pass to zip_close). */
int zip_open(zip_archive *z, const void *file, size_t size, const char *path, pd_err *err);
void zip_close(zip_archive *z);

/* The first entry whose name is exactly name[0..len), or NULL. */
const zip_entry *zip_find(const zip_archive *z, const char *name, size_t len);

#endif
