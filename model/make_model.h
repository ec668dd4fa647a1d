/* make_model: write a complete OPT model directory with deterministic random
 * weights — config.json, model.safetensors (Hugging Face OPTForCausalLM
 * names), generation_config.json and the built-in GPT-2 tokenizer files — so
 * the server, tests and benchmarks have a model without downloading one.
 *
 * Presets: "tiny" (pre-LN), "tiny-postln" (post-LN with project_in/out, like
 * opt-350m), and the real shapes "opt-125m", "opt-350m", "opt-1.3b". The
 * weights depend only on (preset, seed, dtype): the same inputs give
 * byte-identical files on any machine and compiler. */
#ifndef PD_MODEL_MAKE_MODEL_H
#define PD_MODEL_MAKE_MODEL_H

#include <stdint.h>

#include "model/config.h"

/* The config of a preset (token ids 50256, dtype float32; callers may change
 * torch_dtype). Unknown names are an error listing the presets. */
int opt_preset_config(const char *preset, opt_config *out, pd_err *err);
/* "tiny, tiny-postln, opt-125m, opt-350m, opt-1.3b" (for help texts). */
const char *opt_preset_names(void);

/* Write the model directory (created if needed; existing files replaced).
 * Tensors are generated and streamed to disk one chunk at a time, so memory
 * stays small even for multi-GB presets. */
int opt_make_model(const char *dir, const char *preset, uint64_t seed, pd_dtype dtype, pd_err *err);

#endif
