#include "tests/common/testlib.h"

#include <stdlib.h>
#include <string.h>

int test_passed, test_failed;

int test_finish(void) {
    printf("%d passed, %d failed\n", test_passed, test_failed);
    return test_failed ? 1 : 0;
}

const char *test_src_path(const char *rel) {
    static char buf[4096];
    const char *src = getenv("PDSERVE_SRC");
    snprintf(buf, sizeof buf, "%s/%s", src ? src : ".", rel);
    return buf;
}

const char *test_tmpdir(void) {
    static char buf[256];
    if (buf[0]) return buf;
    snprintf(buf, sizeof buf, "/tmp/pdtest.XXXXXX");
    if (!mkdtemp(buf)) {
        perror("mkdtemp");
        buf[0] = 0;
    }
    return buf;
}
