/* cli: table-driven option parsing. See cli.h. */
#include "server/cli.h"

#include <errno.h>
#include <stdbool.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int set_value(const cli_option *o, void *dst, const char *text, pd_err *err) {
    char *field = (char *)dst + o->offset;
    char *end = NULL;
    errno = 0;
    switch (o->type) {
    case CLI_STR:
        *(const char **)field = text;
        return 0;
    case CLI_BOOL:
        if (!strcmp(text, "true") || !strcmp(text, "1")) *(int *)field = 1;
        else if (!strcmp(text, "false") || !strcmp(text, "0")) *(int *)field = 0;
        else return pd_fail(err, "--%s: expected true or false, got '%s'", o->name, text);
        return 0;
    case CLI_INT: {
        long v = strtol(text, &end, 10);
        if (errno || end == text || *end)
            return pd_fail(err, "--%s: expected an integer, got '%s'", o->name, text);
        if (o->min <= o->max && (v < o->min || v > o->max))
            return pd_fail(err, "--%s: %ld is out of range [%g, %g]", o->name, v, o->min, o->max);
        *(int *)field = (int)v;
        return 0;
    }
    case CLI_U64: {
        if (text[0] == '-') return pd_fail(err, "--%s: expected a non-negative integer, got '%s'", o->name, text);
        unsigned long long v = strtoull(text, &end, 10);
        if (errno || end == text || *end)
            return pd_fail(err, "--%s: expected a non-negative integer, got '%s'", o->name, text);
        *(uint64_t *)field = (uint64_t)v;
        return 0;
    }
    case CLI_FLOAT: {
        double v = strtod(text, &end);
        if (errno || end == text || *end || !isfinite(v))
            return pd_fail(err, "--%s: expected a number, got '%s'", o->name, text);
        if (o->min <= o->max && (v < o->min || v > o->max))
            return pd_fail(err, "--%s: %g is out of range [%g, %g]", o->name, v, o->min, o->max);
        *(float *)field = (float)v;
        return 0;
    }
    }
    return pd_fail(err, "--%s: bad option type", o->name);
}

/* Whether given (len chars) begins declared, '_' and '-' alike. */
static int name_begins(const char *given, size_t len, const char *declared) {
    size_t i = 0;
    for (; i < len && declared[i]; i++) {
        char a = given[i] == '_' ? '-' : given[i];
        if (a != declared[i]) return 0;
    }
    return i == len;
}

/* Compare a flag name from the command line with a declared name, treating
 * '_' and '-' as the same character. */
static int name_matches(const char *given, size_t len, const char *declared) {
    return name_begins(given, len, declared) && declared[len] == 0;
}

/* The option an argument "--name[=value]" or "--no-name" names, or -1.
 * Like Python's argparse (which vLLM's flags go through), an unambiguous
 * beginning of a name also names it: vLLM's own examples write
 * --disable-log-request for --disable-log-requests. -2: the beginning fits
 * several, *other then being a second one. */
static int find_option(const cli_option *opts, int n_opts, const char *arg, int *negated,
                       int *other) {
    *negated = 0;
    *other = -1;
    if (strncmp(arg, "--", 2) != 0 || arg[2] == 0) return -1;
    const char *name = arg + 2;
    const char *eq = strchr(name, '=');
    size_t len = eq ? (size_t)(eq - name) : strlen(name);
    for (int i = 0; i < n_opts; i++) {
        if (name_matches(name, len, opts[i].name)) return i;
        if (opts[i].type == CLI_BOOL && len > 3 && !strncmp(name, "no-", 3) &&
            name_matches(name + 3, len - 3, opts[i].name)) {
            *negated = 1;
            return i;
        }
    }
    int found = -1;
    for (int i = 0; i < n_opts; i++) {
        if (!name_begins(name, len, opts[i].name)) continue;
        if (found >= 0) {
            *other = i;
            return -2;
        }
        found = i;
    }
    return found;
}

int cli_parse(const cli_option *opts, int n_opts, void *dst, int argc, char **argv,
              char **positional, int max_pos, int *n_pos, uint64_t *set_mask, pd_err *err) {
    *n_pos = 0;
    if (set_mask) *set_mask = 0;
    for (int i = 0; i < n_opts; i++) {
        if (opts[i].type == CLI_STR) *(const char **)((char *)dst + opts[i].offset) = opts[i].def;
        else if (opts[i].def && set_value(&opts[i], dst, opts[i].def, err) != 0) return -1;
    }
    for (int a = 0; a < argc; a++) {
        const char *arg = argv[a];
        if (arg[0] == '-' && arg[1] && arg[1] != '-' && !(arg[1] >= '0' && arg[1] <= '9')) {
            /* Short flags: only -h, as --help; others (vLLM's -tp, ...) would
             * otherwise be read as the model or prompt. */
            if (!strcmp(arg, "-h"))
                arg = "--help";
            else
                return pd_fail(
                    err, "unknown flag %s: only long flags (--name) are taken (see --help)", arg);
        }
        if (strncmp(arg, "--", 2) != 0 || arg[2] == 0) {
            if (*n_pos >= max_pos) return pd_fail(err, "unexpected argument '%s'", arg);
            positional[(*n_pos)++] = argv[a];
            continue;
        }
        const char *name = arg + 2;
        const char *eq = strchr(name, '=');
        size_t len = eq ? (size_t)(eq - name) : strlen(name);
        int negated = 0, other = -1;
        int found = find_option(opts, n_opts, arg, &negated, &other);
        if (found == -2) {
            int ignored, first = find_option(opts, other, arg, &negated, &ignored); /* before it */
            return pd_fail(err, "ambiguous flag --%.*s: --%s or --%s (and maybe more)", (int)len,
                           name, opts[first].name, opts[other].name);
        }
        if (found < 0) return pd_fail(err, "unknown flag --%.*s (see --help)", (int)len, name);
        const cli_option *o = &opts[found];
        const char *value;
        if (o->type == CLI_BOOL && !eq) {
            value = negated ? "false" : "true";
        } else if (negated) {
            return pd_fail(err, "--no-%s takes no value", o->name);
        } else if (eq) {
            value = eq + 1;
        } else {
            if (a + 1 >= argc) return pd_fail(err, "--%s needs a value", o->name);
            value = argv[++a];
        }
        if (set_value(o, dst, value, err) != 0) return -1;
        if (set_mask && found < 64) *set_mask |= (uint64_t)1 << found;
    }
    return 0;
}

void cli_split(const cli_option *opts, int n_opts, int argc, char **argv, char **mine,
               int *n_mine, char **rest, int *n_rest) {
    *n_mine = *n_rest = 0;
    for (int a = 0; a < argc; a++) {
        int negated, other;
        int i = find_option(opts, n_opts, argv[a], &negated, &other);
        if (i < 0) {
            rest[(*n_rest)++] = argv[a];
            continue;
        }
        mine[(*n_mine)++] = argv[a];
        bool has_value = strchr(argv[a], '=') != NULL || opts[i].type == CLI_BOOL;
        if (!has_value && a + 1 < argc) mine[(*n_mine)++] = argv[++a];
    }
}

void cli_print_help(const char *usage, const cli_option *opts, int n_opts) {
    printf("usage: %s\n\noptions:\n", usage);
    cli_print_options(opts, n_opts);
}

void cli_print_options(const cli_option *opts, int n_opts) {
    static const char *type_names[] = {"INT", "NUM", "TEXT", "", "INT"};
    for (int i = 0; i < n_opts; i++) {
        char left[64];
        snprintf(left, sizeof left, "--%s %s", opts[i].name, type_names[opts[i].type]);
        printf("  %-28s %s", left, opts[i].help);
        if (opts[i].def && opts[i].def[0]) printf(" (default: %s)", opts[i].def);
        printf("\n");
    }
}
