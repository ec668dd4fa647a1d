/* cuda_backend: the CUDA implementation of the backend ops table (backend.h).
 *
 * Only model/backend.c and the GPU tests include this header; everything else
 * reaches the backend through pd_backend_create("cuda...", ...).
 *
 * Names: "cuda" (fp32 storage and compute: exactly comparable with the CPU
 * backend), "cuda-fp16" and "cuda-bf16" (weights, activations and KV stored in
 * 16 bits, every reduction and GEMM accumulation in fp32). Each may end in
 * ":N" to pick CUDA device N (after CUDA_VISIBLE_DEVICES); without it the
 * device is $PDSERVE_DEVICE, else 0. */
#ifndef PD_MODEL_CUDA_BACKEND_H
#define PD_MODEL_CUDA_BACKEND_H

#ifdef __cplusplus
extern "C" {
#endif

#include "model/backend.h"

int pd_backend_cuda_create(const char *name, pd_backend **out, pd_err *err);
/* CUDA devices visible to this process; 0 when there is no driver or device. */
int pd_cuda_device_count(void);

#ifdef __cplusplus
}
#endif

#endif
