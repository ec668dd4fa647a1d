/* backend: pick a backend implementation by name (see backend.h). */
#include "model/backend.h"

#include <string.h>

#include "model/cpu/cpu_internal.h"
#ifdef PDSERVE_HAVE_CUDA
#include "model/cuda/cuda_backend.h"
#endif

int pd_backend_create(const char *name, int n_threads, pd_backend **out, pd_err *err) {
    *out = NULL;
    if (n_threads < 0) return pd_fail(err, "backend: n_threads must be >= 0 (got %d)", n_threads);
    if (!name || strcmp(name, "cpu") == 0) return cpu_backend_create(n_threads, false, out, err);
    /* The CPU backend with its portable SSE2 kernels only, for testing them. */
    if (strcmp(name, "cpu-baseline") == 0) return cpu_backend_create(n_threads, true, out, err);
    /* "cuda", "cuda-fp16", "cuda-bf16", optionally ":DEVICE" (see cuda_backend.h). */
    if (strncmp(name, "cuda", 4) == 0) {
#ifdef PDSERVE_HAVE_CUDA
        return pd_backend_cuda_create(name, out, err);
#else
        return pd_fail(err, "backend '%s': pdserve was built without the CUDA backend", name);
#endif
    }
    return pd_fail(err, "backend: unknown backend '%s' (available: cpu, cpu-baseline, cuda)", name);
}

void pd_backend_destroy(pd_backend *be) {
    if (be) be->destroy(be);
}
