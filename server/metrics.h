/* metrics: the Prometheus text (format 0.0.4) behind GET /metrics, with
 * vLLM's metric names, labels (model_name, engine="0") and histogram
 * buckets. Engine-side counters and gauges come from an engine_stats
 * snapshot; the per-request histograms (TTFT, inter-token latency, TPOT,
 * end-to-end latency, queue time, prompt/generation tokens) and
 * request_success by finished_reason are recorded here by the HTTP layer as
 * each engine sequence finishes. Thread-safe. */
#ifndef PD_SERVER_METRICS_H
#define PD_SERVER_METRICS_H

#include <stddef.h>

#include "server/engine.h"

typedef struct metrics metrics;

metrics *metrics_create(const char *model_name, int max_model_len);
void metrics_free(metrics *m);

/* What one finished engine sequence contributes. Times in seconds; a
 * negative value means "not reached" and is not observed. */
typedef struct metrics_request {
    finish_reason reason;
    int prompt_tokens, generation_tokens;
    double queue_time, ttft, e2e, tpot;
    const double *itl; /* gaps between consecutive tokens */
    int n_itl;
} metrics_request;

void metrics_observe(metrics *m, const metrics_request *r);
/* Count of finished requests with this reason (for tests and the shutdown log). */
unsigned long long metrics_finished(metrics *m, finish_reason r);

/* Render everything; st may be NULL (engine metrics omitted). Caller frees. */
char *metrics_render(metrics *m, const engine_stats *st, size_t *len);

#endif
