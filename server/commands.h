/* commands: the pdserve subcommands. Each takes the arguments after its name
 * and returns the process exit status (0 ok, 1 runtime failure, 2 usage). */
#ifndef PD_SERVER_COMMANDS_H
#define PD_SERVER_COMMANDS_H

#include "common/pd_common.h"

int cmd_make_model(int argc, char **argv);
int cmd_generate(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_detokenize(int argc, char **argv);
int cmd_bench_cpu(int argc, char **argv);
int cmd_bench_kv(int argc, char **argv);
int cmd_bench_throughput(int argc, char **argv);
int cmd_score(int argc, char **argv);
int cmd_serve(int argc, char **argv);

/* Resolve the MODEL argument: NULL means the built-in default model, which is
 * generated on first use under $PDSERVE_HOME (default ~/.cache/pdserve).
 * Returns a new string (caller frees). */
int resolve_model_arg(const char *model, char **dir_out, pd_err *err);

#endif
