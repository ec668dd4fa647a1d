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
/* The params must pass sampling_params_validate; returns NULL if they do not,
 * if vocab_size < 1, or when out of memory. */
sampler *sampler_create(const sampling_params *p, int vocab_size, uint64_t fallback_seed);
void sampler_free(sampler *s);
/* Tell the sampler about prompt tokens (for repetition_penalty). */
void sampler_add_prompt(sampler *s, const int32_t *ids, int n);
/* Sample from logits (modified in place: penalties, temperature). Records the
 * chosen token as output history. Returns the token id. */
int32_t sampler_sample(sampler *s, float *logits);
/* Like sampler_sample, and also reports logprobs the way vLLM V1 does by
 * default ("raw_logprobs"): log-softmax of the logits as the model produced
 * them, before penalties and temperature. *token_logprob gets the chosen
 * token's; top_ids/top_logprobs (n_top entries, may be NULL when n_top is 0)
 * get the n_top most likely tokens, most likely first, ties by lower id.
 * Returns the token id, or -1 (nothing sampled or recorded) when out of memory. */
int32_t sampler_sample_logprobs(sampler *s, float *logits, int n_top, float *token_logprob,
                                int32_t *top_ids, float *top_logprobs);
/* The distribution sampler_sample would draw from for these logits, written
 * into probs[vocab_size] (zeros for filtered tokens; one-hot when greedy).
 * Applies penalties and temperature to logits in place like sampler_sample,
 * but draws nothing and records nothing. Returns 0, or -1 when out of memory. */
int sampler_probs(sampler *s, float *logits, float *probs);

/* Greedy with no penalty: the pick is the logits' argmax, which a GPU can
 * make itself (the caller then reports it with sampler_record). */
bool sampler_is_plain_greedy(const sampler *s);
/* Repetition, presence or frequency penalty set (they need the host). */
bool sampler_has_penalties(const sampler *s);
/* The five floats of the device sample op (model/backend.h): temperature
 * (0 when greedy), top_p, min_p, top_k (0: off) and u, drawn here from the
 * request's RNG exactly as a host draw would be. For samplers without
 * penalties; the caller reports the device's token with sampler_record. */
void sampler_device_params(sampler *s, float out[5]);
/* Record a token chosen outside the sampler as output history. */
void sampler_record(sampler *s, int32_t id);

/* Raw log-softmax helpers (they read logits only). */
double sampler_logsumexp(const float *logits, int n);
/* The min(k, n) largest log-probabilities, most likely first, ties by lower id.
 * Returns how many were written. */
int sampler_top_logprobs(const float *logits, int n, int k, int32_t *ids, float *logprobs);

#endif
