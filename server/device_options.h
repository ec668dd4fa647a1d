/* device_options: the --device and --dtype flags, shared by `pdserve serve`,
 * `generate`, `bench-cpu` and `bench-throughput`, and the backend name they
 * select (pd_backend_create: "cpu", "cuda", "cuda-fp16", "cuda-bf16", with
 * the device's ":N" kept).
 *
 * The choice is made in two steps because `--dtype auto` depends on the
 * checkpoint: the flags are checked (and `--device auto` resolved) before
 * anything is loaded, so a bad flag is a usage error; the backend name is
 * settled once config.json has been read and its torch_dtype is known. */
#ifndef PD_SERVER_DEVICE_OPTIONS_H
#define PD_SERVER_DEVICE_OPTIONS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/pd_common.h"
#include "model/config.h"
#include "server/cli.h"

/* Check --dtype (auto, half, float16, fp16, bfloat16, bf16, float, float32,
 * fp32) and --device (cpu, cuda, cuda:N, auto); write the device with auto
 * resolved ("cpu", "cuda" or "cuda:N") into device_out. */
int device_flags_check(const char *device, const char *dtype, char *device_out, size_t cap,
                       pd_err *err);

/* True when a resolved device names the CPU. */
bool device_is_cpu(const char *device);

/* The compute dtype for a resolved device, a checked --dtype and the
 * checkpoint's torch_dtype. The CPU backend computes in float32 whatever
 * is asked. On CUDA, auto follows vLLM: the checkpoint's dtype when it is
 * bfloat16, else float16 (float32 and float16 checkpoints both run in
 * float16); an explicit dtype is taken as given. */
pd_dtype device_resolve_dtype(const char *device, const char *dtype, pd_dtype checkpoint);

/* The backend name for a resolved device and compute dtype. */
int device_backend_name(const char *device, pd_dtype compute, char *out, size_t cap, pd_err *err);

/* Both steps after config.json is read, with the decision logged once:
 * "dtype auto -> float16 (checkpoint float32)" (a warning when the CPU
 * overrides an explicit 16-bit --dtype). */
int device_select_backend(const char *device, const char *dtype, pd_dtype checkpoint, char *out,
                          size_t cap, pd_err *err);

/* For commands that also take --backend NAME (generate, bench-cpu): after
 * cli_parse with set mask `given`, an error when --backend was given beside
 * --device or --dtype; else check --device/--dtype as device_flags_check. */
int device_flags_for_command(const cli_option *opts, int n_opts, uint64_t given,
                             const char *backend, const char *device, const char *dtype,
                             char *device_out, size_t cap, pd_err *err);
/* The backend for such a command once its model directory is known: the
 * --backend name when given, else device_select_backend with the
 * checkpoint's torch_dtype from model_dir/config.json. */
int device_backend_for_model(const char *backend, const char *device, const char *dtype,
                             const char *model_dir, char *out, size_t cap, pd_err *err);

#endif
