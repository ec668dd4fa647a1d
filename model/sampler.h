/* sampler: turns one row of logits into a token id, with the sampling
 * parameters of vLLM/OpenAI: greedy (temperature 0), temperature, top-k,
 * top-p, min-p, repetition / presence / frequency penalties, and a per-request
 * seed that makes a request's output reproducible whatever else is running. */
#ifndef PD_MODEL_SAMPLER_H
#define PD_MODEL_SAMPLER_H

#include <stdbool.h>
#include <stdint.h>

#include "common/pd_common.h"

typedef struct sampling_params {
    float temperature;        /* 0 = greedy */
    float top_p;              /* 1 = off */
    int top_k;                /* 0 or -1 = off */
    float min_p;              /* 0 = off */
    float repetition_penalty; /* 1 = off; applies to prompt and output tokens */
    float presence_penalty;   /* 0 = off; output tokens only */
    float frequency_penalty;  /* 0 = off; output tokens only */
    bool has_seed;
    uint64_t seed;
} sampling_params;

void sampling_params_default(sampling_params *p);
/* Check ranges (as vLLM does); an error names the bad field and value. */
int sampling_params_validate(const sampling_params *p, pd_err *err);

/* Per-request sampler state: its RNG and the token history the penalties use. */
typedef struct sampler sampler;
/* fallback_seed is used when the params carry no seed (e.g. from --seed and a request counter). */
sampler *sampler_create(const sampling_params *p, int vocab_size, uint64_t fallback_seed);
void sampler_free(sampler *s);
/* Tell the sampler about prompt tokens (for repetition_penalty). */
void sampler_add_prompt(sampler *s, const int32_t *ids, int n);
/* Sample from logits (modified in place: penalties, temperature). Records the
 * chosen token as output history. Returns the token id. */
int32_t sampler_sample(sampler *s, float *logits);
/* Log-probability of each token under the final distribution of the last
 * sample is not needed yet; issue 3 adds logprobs. */

#endif
