/* device_options: --device / --dtype and the backend they select. See device_options.h. */
#include "server/device_options.h"

#include <stdio.h>
#include <string.h>

#ifdef PDSERVE_HAVE_CUDA
#include "model/cuda/cuda_backend.h"
#endif

int device_flags_check(const char *device, const char *dtype, char *device_out, size_t cap,
                       pd_err *err) {
    pd_dtype t;
    if (!dtype || (strcmp(dtype, "auto") != 0 && pd_dtype_parse(dtype, &t) != 0))
        return pd_fail(
            err, "--dtype: expected auto, half, float16, bfloat16, float or float32, got '%s'",
            dtype ? dtype : "");
    const char *dev = device ? device : "cpu";
    if (!strcmp(dev, "auto")) {
#ifdef PDSERVE_HAVE_CUDA
        dev = pd_cuda_device_count() > 0 ? "cuda" : "cpu";
#else
        dev = "cpu";
#endif
    }
    bool cpu = !strcmp(dev, "cpu");
    if (!cpu) {
        /* cuda or cuda:N with N a plain number (the backend checks that it exists). */
        bool ok = !strncmp(dev, "cuda", 4) && (dev[4] == 0 || dev[4] == ':') && strlen(dev) <= 16;
        if (ok && dev[4] == ':') {
            ok = dev[5] != 0;
            for (const char *p = dev + 5; *p; p++)
                ok = ok && *p >= '0' && *p <= '9';
        }
        if (!ok)
            return pd_fail(err, "--device: expected auto, cpu, cuda or cuda:N, got '%s'", device);
    }
    if ((size_t)snprintf(device_out, cap, "%s", dev) >= cap)
        return pd_fail(err, "--device: '%s' is too long", device);
    return 0;
}

bool device_is_cpu(const char *device) {
    return !device || !strcmp(device, "cpu");
}

pd_dtype device_resolve_dtype(const char *device, const char *dtype, pd_dtype checkpoint) {
    if (device_is_cpu(device)) return PD_F32;
    pd_dtype t;
    if (dtype && strcmp(dtype, "auto") != 0 && pd_dtype_parse(dtype, &t) == 0) return t;
    /* vLLM's auto: keep bf16 checkpoints in bf16; run fp32 ones in fp16 (a
     * float32 GPU pass doubles memory and traffic for no serving gain). */
    return checkpoint == PD_BF16 ? PD_BF16 : PD_F16;
}

int device_backend_name(const char *device, pd_dtype compute, char *out, size_t cap, pd_err *err) {
    if (device_is_cpu(device)) {
        snprintf(out, cap, "cpu");
        return 0;
    }
    if (strncmp(device, "cuda", 4) != 0)
        return pd_fail(err, "--device: expected auto, cpu, cuda or cuda:N, got '%s'", device);
    const char *suffix = compute == PD_F16 ? "-fp16" : compute == PD_BF16 ? "-bf16" : "";
    if ((size_t)snprintf(out, cap, "cuda%s%s", suffix, device + 4) >= cap)
        return pd_fail(err, "--device: '%s' is too long", device);
    return 0;
}

int device_select_backend(const char *device, const char *dtype, pd_dtype checkpoint, char *out,
                          size_t cap, pd_err *err) {
    pd_dtype compute = device_resolve_dtype(device, dtype, checkpoint);
    if (device_backend_name(device, compute, out, cap, err) != 0) return -1;
    const char *asked = dtype ? dtype : "auto";
    pd_dtype wanted;
    bool cpu_overrides = device_is_cpu(device) && strcmp(asked, "auto") != 0 &&
                         pd_dtype_parse(asked, &wanted) == 0 && wanted != PD_F32;
    bool note = device_is_cpu(device) && (cpu_overrides || checkpoint != PD_F32);
    pd_log(cpu_overrides ? PD_LOG_WARN : PD_LOG_INFO, "dtype %s -> %s (checkpoint %s%s)", asked,
           pd_dtype_name(compute), pd_dtype_name(checkpoint),
           note ? "; the CPU backend computes in float32" : "");
    return 0;
}

/* Whether the option called name is in the set mask of cli_parse. */
static bool flag_given(const cli_option *opts, int n_opts, uint64_t given, const char *name) {
    for (int i = 0; i < n_opts && i < 64; i++)
        if (!strcmp(opts[i].name, name)) return (given >> i) & 1;
    return false;
}

int device_flags_for_command(const cli_option *opts, int n_opts, uint64_t given,
                             const char *backend, const char *device, const char *dtype,
                             char *device_out, size_t cap, pd_err *err) {
    if (backend &&
        (flag_given(opts, n_opts, given, "device") || flag_given(opts, n_opts, given, "dtype")))
        return pd_fail(err, "--backend %s: give either --backend or --device/--dtype, not both",
                       backend);
    return device_flags_check(device, dtype, device_out, cap, err);
}

int device_backend_for_model(const char *backend, const char *device, const char *dtype,
                             const char *model_dir, char *out, size_t cap, pd_err *err) {
    if (backend) {
        if ((size_t)snprintf(out, cap, "%s", backend) >= cap)
            return pd_fail(err, "--backend: '%s' is too long", backend);
        return 0;
    }
    opt_config mc;
    if (opt_config_load(model_dir, &mc, err) != 0) return -1;
    return device_select_backend(device, dtype, mc.torch_dtype, out, cap, err);
}
