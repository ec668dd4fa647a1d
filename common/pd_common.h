/* pd_common: the few things every part of pdserve shares — error reporting,
 * logging, whole-file reading, and small string helpers.
 *
 * Error convention (used everywhere): a function that can fail returns 0 on
 * success and -1 on failure, and writes a one-line, human-readable reason into
 * the caller's pd_err. The caller decides whether to print it, wrap it or turn
 * it into an HTTP error. Library code never calls exit() or abort(). */
#ifndef PD_COMMON_H
#define PD_COMMON_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

typedef struct pd_err {
    char msg[512];
} pd_err;

/* Set err->msg from a printf-style format; always returns -1 so callers can
 * write `return pd_fail(err, "...", ...);`. err may be NULL. */
int pd_fail(pd_err *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Prefix an existing message: "context: previous message". Returns -1. */
int pd_wrap(pd_err *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

typedef enum { PD_LOG_DEBUG = 0, PD_LOG_INFO = 1, PD_LOG_WARN = 2, PD_LOG_ERROR = 3 } pd_log_level;

/* One logging function for the whole program (stderr, one line per call,
 * timestamped). The level threshold is process-wide by design: it is set once
 * from --log-level at startup. */
void pd_log_set_level(pd_log_level level);
pd_log_level pd_log_get_level(void);
int pd_log_parse_level(const char *name, pd_log_level *out);
void pd_log(pd_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Read a whole file into a new NUL-terminated buffer (caller frees). */
int pd_read_file(const char *path, char **data, size_t *len, pd_err *err);
/* Write a buffer to a file (created or truncated). */
int pd_write_file(const char *path, const void *data, size_t len, pd_err *err);

/* Join a directory and a file name into a new string (caller frees). */
char *pd_path_join(const char *dir, const char *name);
int pd_file_exists(const char *path);
int pd_dir_exists(const char *path);
/* mkdir -p */
int pd_mkdirs(const char *path, pd_err *err);

/* How many of the n bytes at p are JSON whitespace (space, tab, CR, LF)
 * before anything else: after cJSON stops at the end of the first value,
 * anything past that run is data trailing the value. */
size_t pd_json_space(const char *p, size_t n);

/* Monotonic clock in seconds. */
double pd_now(void);

struct timespec;
/* *ts = the wall clock (CLOCK_REALTIME) ms milliseconds from now: the
 * absolute deadline pthread_cond_timedwait takes. */
void pd_realtime_after_ms(struct timespec *ts, long ms);

/* Number of online CPU cores (at least 1). */
int pd_num_cpus(void);

#endif
