/* ckpt_torch: internal to the checkpoint module. Reads the tensor table of a
 * torch.save() file (zip archive of STORED entries: <prefix>/data.pkl, a
 * pickled state dict, and <prefix>/data/<key> raw storages) with a restricted
 * unpickler that accepts only the globals a state dict needs. Never executes
 * anything. */
#ifndef PD_MODEL_CKPT_TORCH_H
#define PD_MODEL_CKPT_TORCH_H

#include "model/checkpoint.h"

/* file: the whole file's bytes (mmap'd by the caller, kept alive by it).
 * path: for error messages. On success *tensors is a new array of *n entries
 * whose names are malloc'd, whose data points into `file` (or into `owned`
 * for non-contiguous tensors). Free with ckpt_tensors_free. */
int torch_zip_read(const void *file, size_t size, const char *path, ckpt_tensor **tensors, int *n,
                   pd_err *err);
void ckpt_tensors_free(ckpt_tensor *tensors, int n);

#endif
