/* cli: declare a command's options once (name, type, default, range, help)
 * and get parsing, validation and --help from that one table. Accepts
 * `--name value`, `--name=value`, `--name_with_underscores` (as vLLM does) and
 * `--no-name` for booleans. Unknown flags and bad values are errors naming
 * the flag. */
#ifndef PD_SERVER_CLI_H
#define PD_SERVER_CLI_H

#include <stddef.h>
#include <stdint.h>

#include "common/pd_common.h"

typedef enum { CLI_INT, CLI_FLOAT, CLI_STR, CLI_BOOL, CLI_U64 } cli_type;

typedef struct cli_option {
    const char *name;  /* without the leading "--" */
    cli_type type;
    size_t offset;     /* where the value lives in the command's options struct */
    const char *def;   /* default, as command-line text (NULL: none / empty) */
    double min, max;   /* inclusive range for numbers (min > max: unchecked) */
    const char *help;
} cli_option;

/* Field types by cli_type: int, float, char * (points into argv or the
 * default string; not owned), int (0/1), uint64_t. Also sets `*set_mask`
 * bit i when option i was given explicitly (may be NULL). Positional
 * arguments are collected into positional[] (at most max_pos). */
int cli_parse(const cli_option *opts, int n_opts, void *dst, int argc, char **argv,
              char **positional, int max_pos, int *n_pos, uint64_t *set_mask, pd_err *err);

void cli_print_help(const char *usage, const cli_option *opts, int n_opts);
/* The option lines of cli_print_help alone (for a second table). */
void cli_print_options(const cli_option *opts, int n_opts);

/* Split argv into the arguments that name an option of opts (each with its
 * value when it takes one: `--name value` or `--name=value`) and the rest,
 * both in their original order. mine and rest need room for argc entries.
 * Lets one command parse part of its flags with another table. */
void cli_split(const cli_option *opts, int n_opts, int argc, char **argv, char **mine,
               int *n_mine, char **rest, int *n_rest);

#endif
