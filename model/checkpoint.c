/* checkpoint: open the weight files of a model directory (see checkpoint.h).
 *
 * Every file is mmap'd read-only and parsed into a tensor table whose data
 * pointers point into the mapping; safetensors files are parsed here
 * (safetensors.c), torch zip files by ckpt_torch.c. A sharded index names the
 * files; each is opened once. All tensors of all files are then sorted by
 * name so lookups are a binary search and duplicates are caught. */
#include "model/checkpoint.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model/ckpt_torch.h"
#include "model/safetensors.h"

typedef enum { FILE_SAFETENSORS, FILE_TORCH } file_kind;

typedef struct ckpt_file {
    char *path;
    void *map;
    size_t size;
    ckpt_tensor *tensors;
    int n;
} ckpt_file;

struct checkpoint {
    const char *format;
    ckpt_file *files;
    int n_files;
    const ckpt_tensor **order;  /* file order, then order within the file */
    const ckpt_tensor **sorted; /* by name, for checkpoint_find */
    int n;
};

static int map_file(const char *path, void **map, size_t *size, pd_err *err) {
    *map = NULL;
    *size = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return pd_fail(err, "cannot open %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return pd_fail(err, "cannot stat %s: %s", path, strerror(e));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return pd_fail(err, "%s is not a regular file", path);
    }
    if (st.st_size == 0) { /* mmap of length 0 fails; the parsers report "too small" */
        close(fd);
        return 0;
    }
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (p == MAP_FAILED) return pd_fail(err, "cannot mmap %s: %s", path, strerror(e));
    *map = p;
    *size = (size_t)st.st_size;
    return 0;
}

static void file_release(ckpt_file *f) {
    ckpt_tensors_free(f->tensors, f->n);
    if (f->map) munmap(f->map, f->size);
    free(f->path);
    memset(f, 0, sizeof *f);
}

static int file_load(ckpt_file *f, const char *path, file_kind kind, pd_err *err) {
    memset(f, 0, sizeof *f);
    f->path = strdup(path);
    if (!f->path) return pd_fail(err, "out of memory");
    if (map_file(path, &f->map, &f->size, err)) return -1;
    static const char zip_magic[4] = {'P', 'K', 3, 4};
    static const char empty[1] = {0};
    const void *bytes = f->map ? f->map : empty;
    if (kind == FILE_SAFETENSORS)
        return safetensors_parse(bytes, f->size, path, &f->tensors, &f->n, err);
    if (f->size < 4 || memcmp(bytes, zip_magic, 4) != 0)
        return pd_fail(err, "%s: not a torch zip archive (legacy torch format unsupported)", path);
    return torch_zip_read(bytes, f->size, path, &f->tensors, &f->n, err);
}

void checkpoint_close(checkpoint *c) {
    if (!c) return;
    for (int i = 0; i < c->n_files; i++)
        file_release(&c->files[i]);
    free(c->files);
    free(c->order);
    free(c->sorted);
    free(c);
}

static int name_cmp(const void *a, const void *b) {
    const ckpt_tensor *x = *(const ckpt_tensor *const *)a, *y = *(const ckpt_tensor *const *)b;
    return strcmp(x->name, y->name);
}

static const ckpt_tensor *find_exact(const checkpoint *c, const char *name) {
    size_t lo = 0, hi = (size_t)c->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int r = strcmp(c->sorted[mid]->name, name);
        if (r == 0) return c->sorted[mid];
        if (r < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

/* Where a tensor was found, for error messages about duplicates. */
static const char *file_of(const checkpoint *c, const ckpt_tensor *t) {
    for (int i = 0; i < c->n_files; i++) {
        const ckpt_file *f = &c->files[i];
        if (f->n > 0 && t >= f->tensors && t < f->tensors + f->n) return f->path;
    }
    return "?";
}

/* Build the order and sorted tables over all files; reject duplicate names. */
static int index_tensors(checkpoint *c, pd_err *err) {
    int n = 0;
    for (int i = 0; i < c->n_files; i++)
        n += c->files[i].n;
    c->order = calloc((size_t)(n > 0 ? n : 1), sizeof *c->order);
    c->sorted = calloc((size_t)(n > 0 ? n : 1), sizeof *c->sorted);
    if (!c->order || !c->sorted) return pd_fail(err, "out of memory");
    int k = 0;
    for (int i = 0; i < c->n_files; i++)
        for (int j = 0; j < c->files[i].n; j++)
            c->order[k++] = &c->files[i].tensors[j];
    memcpy(c->sorted, c->order, (size_t)n * sizeof *c->order);
    qsort(c->sorted, (size_t)n, sizeof *c->sorted, name_cmp);
    c->n = n;
    for (int i = 1; i < n; i++)
        if (strcmp(c->sorted[i - 1]->name, c->sorted[i]->name) == 0)
            return pd_fail(err, "duplicate tensor %s (in %s and %s)", c->sorted[i]->name,
                           file_of(c, c->sorted[i - 1]), file_of(c, c->sorted[i]));
    return 0;
}

/* A shard name from an index must stay inside the model directory. */
static int shard_name_ok(const char *s) {
    if (!*s || s[0] == '/') return 0;
    for (const char *p = s; *p;) {
        const char *slash = strchr(p, '/');
        size_t len = slash ? (size_t)(slash - p) : strlen(p);
        if (len == 2 && p[0] == '.' && p[1] == '.') return 0;
        if (!slash) break;
        p = slash + 1;
    }
    return 1;
}

/* True when path is ".../name" (or name itself). */
static int path_ends_with(const char *path, const char *name) {
    size_t a = strlen(path), b = strlen(name);
    return a >= b && strcmp(path + a - b, name) == 0 && (a == b || path[a - b - 1] == '/');
}

/* Open every file a sharded index names (each once), then check that each
 * weight_map entry is in the file it names. */
static int open_sharded(checkpoint *c, const char *dir, const char *index_path, file_kind kind,
                        pd_err *err) {
    char *text = NULL;
    size_t len = 0;
    if (pd_read_file(index_path, &text, &len, err)) return -1;
    cJSON *root = cJSON_ParseWithLength(text, len);
    free(text);
    if (!root) return pd_fail(err, "%s: not valid JSON", index_path);
    int rc = 0;
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(wm)) {
        rc = pd_fail(err, "%s: missing or non-object weight_map", index_path);
        goto out;
    }
    int cap = cJSON_GetArraySize(wm);
    if (cap == 0) {
        rc = pd_fail(err, "%s: weight_map is empty", index_path);
        goto out;
    }
    c->files = calloc((size_t)cap, sizeof *c->files);
    const char **names = calloc((size_t)cap, sizeof *names);
    if (!c->files || !names) {
        free(names);
        rc = pd_fail(err, "out of memory");
        goto out;
    }
    /* Distinct file names in first-seen order. */
    int nf = 0;
    for (const cJSON *e = wm->child; e && rc == 0; e = e->next) {
        if (!cJSON_IsString(e)) {
            rc = pd_fail(err, "%s: weight_map entry %s is not a file name", index_path, e->string);
            break;
        }
        if (!shard_name_ok(e->valuestring)) {
            rc = pd_fail(err, "%s: weight_map names a file outside the model directory: %s",
                         index_path, e->valuestring);
            break;
        }
        int seen = 0;
        for (int i = 0; i < nf && !seen; i++)
            seen = strcmp(names[i], e->valuestring) == 0;
        if (!seen) names[nf++] = e->valuestring;
    }
    for (int i = 0; i < nf && rc == 0; i++) {
        char *p = pd_path_join(dir, names[i]);
        if (!p) {
            rc = pd_fail(err, "out of memory");
            break;
        }
        if (access(p, F_OK) != 0) { /* anything else (a device, a folder) map_file names */
            rc = pd_fail(err, "%s names shard %s, which does not exist", index_path, p);
        } else {
            c->n_files++;
            rc = file_load(&c->files[i], p, kind, err);
        }
        free(p);
    }
    free(names);
    if (rc == 0) rc = index_tensors(c, err);
    for (const cJSON *e = wm->child; e && rc == 0; e = e->next) {
        const ckpt_tensor *t = find_exact(c, e->string);
        if (!t)
            rc = pd_fail(err, "%s: tensor %s is missing from shard %s", index_path, e->string,
                         e->valuestring);
        else if (!path_ends_with(file_of(c, t), e->valuestring))
            rc = pd_fail(err, "%s: tensor %s is listed in shard %s but stored in %s", index_path,
                         e->string, e->valuestring, file_of(c, t));
    }
out:
    cJSON_Delete(root);
    return rc;
}

static int open_single(checkpoint *c, const char *path, file_kind kind, pd_err *err) {
    c->files = calloc(1, sizeof *c->files);
    if (!c->files) return pd_fail(err, "out of memory");
    c->n_files = 1;
    if (file_load(&c->files[0], path, kind, err)) return -1;
    return index_tensors(c, err);
}

int checkpoint_open(const char *model_dir, checkpoint **out, pd_err *err) {
    *out = NULL;
    static const struct {
        const char *file, *format;
        file_kind kind;
        int sharded;
    } choices[] = {
        {"model.safetensors.index.json", "safetensors-sharded", FILE_SAFETENSORS, 1},
        {"model.safetensors", "safetensors", FILE_SAFETENSORS, 0},
        {"pytorch_model.bin.index.json", "pytorch-sharded", FILE_TORCH, 1},
        {"pytorch_model.bin", "pytorch", FILE_TORCH, 0},
    };
    if (!pd_dir_exists(model_dir))
        return pd_fail(err, "model directory %s does not exist", model_dir);
    for (size_t i = 0; i < sizeof choices / sizeof choices[0]; i++) {
        char *path = pd_path_join(model_dir, choices[i].file);
        if (!path) return pd_fail(err, "out of memory");
        if (!pd_file_exists(path)) {
            free(path);
            continue;
        }
        checkpoint *c = calloc(1, sizeof *c);
        if (!c) {
            free(path);
            return pd_fail(err, "out of memory");
        }
        c->format = choices[i].format;
        int rc = choices[i].sharded ? open_sharded(c, model_dir, path, choices[i].kind, err)
                                    : open_single(c, path, choices[i].kind, err);
        free(path);
        if (rc) {
            checkpoint_close(c);
            return -1;
        }
        *out = c;
        return 0;
    }
    return pd_fail(err,
                   "no weights in %s (looked for model.safetensors.index.json, model.safetensors, "
                   "pytorch_model.bin.index.json, pytorch_model.bin)",
                   model_dir);
}

int checkpoint_count(const checkpoint *c) {
    return c->n;
}

const ckpt_tensor *checkpoint_get(const checkpoint *c, int i) {
    return i >= 0 && i < c->n ? c->order[i] : NULL;
}

const char *checkpoint_format(const checkpoint *c) {
    return c->format;
}

const ckpt_tensor *checkpoint_find(const checkpoint *c, const char *name) {
    const ckpt_tensor *t = find_exact(c, name);
    if (t) return t;
    static const char prefix[] = "model.";
    size_t pl = sizeof prefix - 1;
    if (strncmp(name, prefix, pl) == 0) return find_exact(c, name + pl);
    size_t n = strlen(name);
    char stackbuf[256];
    char *full = n + pl + 1 <= sizeof stackbuf ? stackbuf : malloc(n + pl + 1);
    if (!full) return NULL;
    memcpy(full, prefix, pl);
    memcpy(full + pl, name, n + 1);
    t = find_exact(c, full);
    if (full != stackbuf) free(full);
    return t;
}
