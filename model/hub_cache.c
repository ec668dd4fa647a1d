/* hub_cache: resolve a model argument to a directory (model_path_resolve in
 * checkpoint.h). An existing directory is used as is; "org/name" is looked up
 * offline in the Hugging Face hub cache, whose layout is
 *   <cache>/models--org--name/refs/main          (text: a revision hash)
 *   <cache>/models--org--name/snapshots/<rev>/   (the files, usually symlinks)
 * Cache roots are tried in huggingface_hub's order of precedence. */
#include <dirent.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/checkpoint.h"

/* A new formatted string, or NULL when out of memory. */
static char *str_fmt(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *str_fmt(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char *s = NULL;
    if (vasprintf(&s, fmt, ap) < 0) s = NULL;
    va_end(ap);
    return s;
}

#define MAX_ROOTS 5

/* Candidate cache roots, most specific first, without duplicates. Returns the
 * count; entries are malloc'd (NULL when out of memory). */
static int cache_roots(char *roots[MAX_ROOTS]) {
    int n = 0;
    const char *v;
    char *cand[MAX_ROOTS] = {0};
    int k = 0;
    if ((v = getenv("HF_HUB_CACHE")) && *v) cand[k++] = str_fmt("%s", v);
    if ((v = getenv("HUGGINGFACE_HUB_CACHE")) && *v) cand[k++] = str_fmt("%s", v);
    if ((v = getenv("HF_HOME")) && *v) cand[k++] = str_fmt("%s/hub", v);
    if ((v = getenv("XDG_CACHE_HOME")) && *v) cand[k++] = str_fmt("%s/huggingface/hub", v);
    if ((v = getenv("HOME")) && *v) cand[k++] = str_fmt("%s/.cache/huggingface/hub", v);
    for (int i = 0; i < k; i++) {
        int dup = !cand[i];
        for (int j = 0; j < n && !dup; j++)
            dup = strcmp(roots[j], cand[i]) == 0;
        if (dup)
            free(cand[i]);
        else
            roots[n++] = cand[i];
    }
    return n;
}

static int has_config(const char *dir) {
    char *p = str_fmt("%s/config.json", dir);
    int ok = p && pd_file_exists(p);
    free(p);
    return ok;
}

/* The snapshot that refs/main names, else the first (by name) with config.json. */
static char *pick_snapshot(const char *repo_dir) {
    char *ref = str_fmt("%s/refs/main", repo_dir);
    char *rev = NULL;
    size_t len = 0;
    pd_err ignored;
    if (ref && pd_read_file(ref, &rev, &len, &ignored) == 0) {
        while (len > 0 && (rev[len - 1] == '\n' || rev[len - 1] == '\r' || rev[len - 1] == ' '))
            rev[--len] = 0;
        char *snap =
            len > 0 && !strchr(rev, '/') ? str_fmt("%s/snapshots/%s", repo_dir, rev) : NULL;
        free(rev);
        if (snap && has_config(snap)) {
            free(ref);
            return snap;
        }
        free(snap);
    }
    free(ref);
    char *dir = str_fmt("%s/snapshots", repo_dir);
    if (!dir) return NULL;
    struct dirent **names = NULL;
    int n = scandir(dir, &names, NULL, alphasort);
    char *found = NULL;
    for (int i = 0; i < n; i++) {
        const char *d = names[i]->d_name;
        if (!found && d[0] != '.') {
            char *snap = str_fmt("%s/%s", dir, d);
            if (snap && has_config(snap))
                found = snap;
            else
                free(snap);
        }
        free(names[i]);
    }
    free(names);
    free(dir);
    return found;
}

/* "org/name": one slash, both parts non-empty, nothing path-like. */
static int looks_like_repo_id(const char *m) {
    const char *slash = strchr(m, '/');
    if (!slash || slash == m || !slash[1] || strchr(slash + 1, '/')) return 0;
    if (m[0] == '.' || strstr(m, "..")) return 0;
    return 1;
}

int model_path_resolve(const char *model, char **dir_out, pd_err *err) {
    *dir_out = NULL;
    if (pd_dir_exists(model)) {
        *dir_out = strdup(model);
        return *dir_out ? 0 : pd_fail(err, "out of memory");
    }
    if (!looks_like_repo_id(model))
        return pd_fail(err, "model %s: no such directory (and not an org/name hub id)", model);
    const char *slash = strchr(model, '/');
    char *roots[MAX_ROOTS] = {0};
    int nr = cache_roots(roots);
    char looked[400] = "";
    size_t lk = 0;
    int rc = -1;
    for (int i = 0; i < nr && rc != 0; i++) {
        /* models--org--name */
        char *repo_dir =
            str_fmt("%s/models--%.*s--%s", roots[i], (int)(slash - model), model, slash + 1);
        if (!repo_dir) break;
        char *snap = pd_dir_exists(repo_dir) ? pick_snapshot(repo_dir) : NULL;
        if (snap) {
            *dir_out = snap;
            rc = 0;
        } else if (lk < sizeof looked) {
            int k = snprintf(looked + lk, sizeof looked - lk, "%s%s", i ? ", " : "", repo_dir);
            lk += k > 0 ? (size_t)k : 0;
        }
        free(repo_dir);
    }
    for (int i = 0; i < nr; i++)
        free(roots[i]);
    if (rc == 0) return 0;
    if (nr == 0) snprintf(looked, sizeof looked, "nowhere: HF_HOME and HOME are unset");
    return pd_fail(err,
                   "model %s: not a directory and no snapshot with config.json in the Hugging "
                   "Face cache (looked in %s)",
                   model, looked);
}
