/* metrics: the proxy's Prometheus counters and histograms. Per-instance
 * series live in the registry (registry.h) and use the histogram type from
 * here; this module holds the per-request ones: requests by final status,
 * end-to-end latency, time to first decode byte, prefill time, the latency
 * the proxy itself adds, and prefill retries. */
#ifndef PD_PROXY_METRICS_H
#define PD_PROXY_METRICS_H

#include <pthread.h>
#include <stdint.h>

#include "common/pd_buf.h"

#define PXH_BUCKETS 19

typedef struct pxhist {
    uint64_t counts[PXH_BUCKETS]; /* non-cumulative; the last is +Inf */
    uint64_t n;
    double sum;
} pxhist;

void pxhist_observe(pxhist *h, double seconds);
/* Write NAME_bucket{LABELS,le=...}, NAME_sum and NAME_count lines. */
void pxhist_render(pd_buf *b, const char *name, const char *labels, const pxhist *h);

#define PXM_MAX_STATUS 600

typedef struct proxy_metrics {
    pthread_mutex_t mu;
    uint64_t by_status[PXM_MAX_STATUS]; /* index: HTTP status (499: client gone) */
    uint64_t retries, in_flight;
    pxhist total, ttft, prefill, overhead;
} proxy_metrics;

void pxm_init(proxy_metrics *m);
void pxm_destroy(proxy_metrics *m);
void pxm_begin(proxy_metrics *m);
/* One finished request. ttft/prefill < 0: not reached. */
void pxm_end(proxy_metrics *m, int status, double total, double ttft, double prefill,
             double overhead, int retries);
/* A request refused before it was served (401, 413, ...): counted by
 * status only, so the latency histograms describe served requests. */
void pxm_refused(proxy_metrics *m, int status);
void pxm_render(proxy_metrics *m, pd_buf *b);
uint64_t pxm_in_flight(proxy_metrics *m);

#endif
