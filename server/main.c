/* pdserve command line (being built: see README). */
#include <stdio.h>

int main(int argc, char **argv) {
    (void)argv;
    if (argc < 2) fprintf(stderr, "usage: pdserve COMMAND ...\n");
    return 2;
}
