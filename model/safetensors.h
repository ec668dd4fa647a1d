/* safetensors: internal to the checkpoint module. Parses and validates one
 * safetensors file held in memory, and renders a header for a writer that
 * streams tensor data after it (make-model writes multi-GB files that way).
 *
 * Layout: u64 little-endian header length N, N bytes of JSON, then the data
 * buffer; each tensor's data_offsets are relative to the start of that buffer. */
#ifndef PD_MODEL_SAFETENSORS_H
#define PD_MODEL_SAFETENSORS_H

#include "model/checkpoint.h"

/* Upper bound on the header length, as in the reference reader. */
#define SAFETENSORS_MAX_HEADER 100000000u

/* file: the whole file (caller keeps it alive). On success *tensors is a new
 * array of *n entries (names malloc'd, data pointing into file), freed with
 * ckpt_tensors_free. Errors start with path. */
int safetensors_parse(const void *file, size_t size, const char *path, ckpt_tensor **tensors,
                      int *n, pd_err *err);

/* The bytes that precede the data: 8-byte length + JSON header padded with
 * spaces to a multiple of 8, tensors laid out contiguously in the given order
 * (name/dtype/ndim/shape/nbytes are read; nbytes must match the shape).
 * *out is malloc'd. */
int safetensors_header(const ckpt_tensor *tensors, int n, char **out, size_t *len, pd_err *err);

/* Element size of a safetensors dtype string; 0 when unknown. Sets *t
 * (CKPT_OTHER for known types the model has no enum value for). */
size_t safetensors_dtype_lookup(const char *name, ckpt_dtype *t);

#endif
