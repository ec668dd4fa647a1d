/* pd_common: error messages, logging, file helpers. See pd_common.h. */
#include "common/pd_common.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static pd_log_level log_threshold = PD_LOG_INFO;

int pd_fail(pd_err *err, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return -1;
}

int pd_wrap(pd_err *err, const char *fmt, ...) {
    if (!err) return -1;
    char prefix[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    char old[sizeof err->msg];
    memcpy(old, err->msg, sizeof old);
    /* Truncation of very long messages is acceptable; build the result by hand so
     * the compiler's truncation warning does not apply. */
    size_t p = strlen(prefix), o = strnlen(old, sizeof old - 1), cap = sizeof err->msg - 1;
    if (p > cap) p = cap;
    memcpy(err->msg, prefix, p);
    size_t k = p;
    for (const char *sep = ": "; *sep && k < cap; sep++) err->msg[k++] = *sep;
    if (o > cap - k) o = cap - k;
    memcpy(err->msg + k, old, o);
    err->msg[k + o] = 0;
    return -1;
}

void pd_log_set_level(pd_log_level level) { log_threshold = level; }
pd_log_level pd_log_get_level(void) { return log_threshold; }

int pd_log_parse_level(const char *name, pd_log_level *out) {
    static const char *names[] = {"debug", "info", "warning", "error"};
    for (int i = 0; i < 4; i++) {
        if (strcmp(name, names[i]) == 0 || (i == 2 && strcmp(name, "warn") == 0)) {
            *out = (pd_log_level)i;
            return 0;
        }
    }
    return -1;
}

void pd_log(pd_log_level level, const char *fmt, ...) {
    if (level < log_threshold) return;
    static const char *tags[] = {"DEBUG", "INFO", "WARN", "ERROR"};
    char line[2048];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    int n = snprintf(line, sizeof line, "%02d:%02d:%02d.%03ld %-5s ", tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000000, tags[level]);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    /* One fputs per line keeps lines from different threads whole. */
    size_t len = strlen(line);
    if (len + 1 < sizeof line) {
        line[len] = '\n';
        line[len + 1] = 0;
    }
    fputs(line, stderr);
}

int pd_read_file(const char *path, char **data, size_t *len, pd_err *err) {
    *data = NULL;
    if (len) *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return pd_fail(err, "cannot open %s: %s", path, strerror(errno));
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap + 1);
    if (!buf) {
        fclose(f);
        return pd_fail(err, "out of memory reading %s", path);
    }
    for (;;) {
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (n < cap) break;
        cap *= 2;
        char *nb = realloc(buf, cap + 1);
        if (!nb) {
            free(buf);
            fclose(f);
            return pd_fail(err, "out of memory reading %s", path);
        }
        buf = nb;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        return pd_fail(err, "error reading %s", path);
    }
    buf[n] = 0;
    *data = buf;
    if (len) *len = n;
    return 0;
}

int pd_write_file(const char *path, const void *data, size_t len, pd_err *err) {
    FILE *f = fopen(path, "wb");
    if (!f) return pd_fail(err, "cannot create %s: %s", path, strerror(errno));
    size_t put = fwrite(data, 1, len, f);
    int closed = fclose(f);
    if (put != len || closed != 0) return pd_fail(err, "cannot write %s: %s", path, strerror(errno));
    return 0;
}

char *pd_path_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + b + 2);
    if (!p) return NULL;
    memcpy(p, dir, a);
    size_t k = a;
    if (a > 0 && dir[a - 1] != '/') p[k++] = '/';
    memcpy(p + k, name, b + 1);
    return p;
}

int pd_file_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

size_t pd_json_space(const char *p, size_t n) {
    size_t i = 0;
    while (i < n && (p[i] == ' ' || p[i] == '\t' || p[i] == '\n' || p[i] == '\r'))
        i++;
    return i;
}

int pd_dir_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

int pd_mkdirs(const char *path, pd_err *err) {
    char tmp[4096];
    size_t n = strlen(path);
    if (n == 0 || n >= sizeof tmp) return pd_fail(err, "bad directory path '%s'", path);
    memcpy(tmp, path, n + 1);
    for (size_t i = 1; i <= n; i++) {
        if (tmp[i] == '/' || tmp[i] == 0) {
            char c = tmp[i];
            tmp[i] = 0;
            if (mkdir(tmp, 0755) != 0 && errno != EEXIST)
                return pd_fail(err, "cannot create directory %s: %s", tmp, strerror(errno));
            tmp[i] = c;
        }
    }
    if (!pd_dir_exists(path)) return pd_fail(err, "%s exists and is not a directory", path);
    return 0;
}

double pd_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void pd_realtime_after_ms(struct timespec *ts, long ms) {
    clock_gettime(CLOCK_REALTIME, ts);
    ts->tv_sec += ms / 1000;
    ts->tv_nsec += (ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

int pd_num_cpus(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}
