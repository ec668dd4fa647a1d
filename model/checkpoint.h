/* checkpoint: read-only access to the tensors of a Hugging Face checkpoint
 * directory — `model.safetensors`, sharded safetensors
 * (`model.safetensors.index.json`), or `pytorch_model.bin` (torch zip +
 * pickle, read with a restricted unpickler; sharded via
 * `pytorch_model.bin.index.json`). Files are mmap'd; tensor data pointers
 * point into the mapping (or into an owned copy when a torch tensor is not
 * contiguous). Also: a safetensors writer, and Hugging Face hub-cache lookup. */
#ifndef PD_MODEL_CHECKPOINT_H
#define PD_MODEL_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "common/pd_common.h"

typedef enum {
    CKPT_F32, CKPT_F16, CKPT_BF16, CKPT_F64, CKPT_I64, CKPT_I32, CKPT_I16, CKPT_I8, CKPT_U8,
    CKPT_BOOL, CKPT_OTHER
} ckpt_dtype;

const char *ckpt_dtype_name(ckpt_dtype t); /* safetensors spelling: "F32", "F16", ... */
size_t ckpt_dtype_size(ckpt_dtype t);

#define CKPT_MAX_DIMS 8

typedef struct ckpt_tensor {
    char *name; /* as stored in the file (owned by the checkpoint) */
    ckpt_dtype dtype;
    int ndim;
    int64_t shape[CKPT_MAX_DIMS];
    const void *data; /* little-endian, C order, contiguous */
    size_t nbytes;
    void *owned; /* non-NULL when data had to be copied (non-contiguous torch tensor); freed on close */
} ckpt_tensor;

typedef struct checkpoint checkpoint;

/* Open the weights in a model directory. Picks, in this order, sharded
 * safetensors index, model.safetensors, pytorch_model.bin.index.json,
 * pytorch_model.bin. Every file is validated (header bounds, offsets, sizes,
 * dtypes); a truncated or malformed file is an error naming the file. */
int checkpoint_open(const char *model_dir, checkpoint **out, pd_err *err);
void checkpoint_close(checkpoint *ckpt);

int checkpoint_count(const checkpoint *ckpt);
const ckpt_tensor *checkpoint_get(const checkpoint *ckpt, int i);
/* Find a tensor by name, trying the name as given and with a leading
 * "model." added or removed, so callers can ask for "decoder.layers.0.fc1.weight". */
const ckpt_tensor *checkpoint_find(const checkpoint *ckpt, const char *name);
/* Which format was opened: "safetensors", "safetensors-sharded", "pytorch", "pytorch-sharded". */
const char *checkpoint_format(const checkpoint *ckpt);

/* Write tensors as one safetensors file (header padded to 8 bytes, tensors in
 * the given order). Only name/dtype/ndim/shape/data/nbytes are read. */
int safetensors_write(const char *path, const ckpt_tensor *tensors, int n, pd_err *err);

/* Resolve MODEL: an existing directory is returned as is; "org/name" is
 * looked up offline in $HF_HOME/hub (or $HUGGINGFACE_HUB_CACHE, or
 * ~/.cache/huggingface/hub) as models--org--name/snapshots/<rev>/ (the rev named
 * in refs/main if present, else any snapshot with config.json). A miss is an
 * error that lists where it looked. Result is a new string (caller frees). */
int model_path_resolve(const char *model, char **dir_out, pd_err *err);

#endif
