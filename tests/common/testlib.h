/* testlib: tiny assertion helpers shared by the C tests. A test binary calls
 * the CHECK macros, then returns test_finish() from main: it prints
 * "N passed, N failed" and exits non-zero when anything failed. */
#ifndef PD_TESTLIB_H
#define PD_TESTLIB_H

#include <stdio.h>

extern int test_passed, test_failed;

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (cond) {                                                                                \
            test_passed++;                                                                         \
        } else {                                                                                   \
            test_failed++;                                                                         \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);               \
        }                                                                                          \
    } while (0)

#define CHECKF(cond, ...)                                                                          \
    do {                                                                                           \
        if (cond) {                                                                                \
            test_passed++;                                                                         \
        } else {                                                                                   \
            test_failed++;                                                                         \
            fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond);               \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
        }                                                                                          \
    } while (0)

int test_finish(void);
/* Path inside the source tree (from $PDSERVE_SRC); static buffer, copy if kept. */
const char *test_src_path(const char *rel);
/* A fresh empty temporary directory for this test (static buffer). */
const char *test_tmpdir(void);

#endif
