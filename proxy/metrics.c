/* metrics: proxy-level Prometheus series. See metrics.h. */
#include "proxy/metrics.h"

#include <stddef.h>
#include <string.h>

/* Upper bounds in seconds, from sub-millisecond proxy overhead to long
 * generations; the last bucket is +Inf. */
static const double bounds[PXH_BUCKETS - 1] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                               0.05,   0.1,   0.25,   0.5,   1,    2.5,
                                               5,      10,    30,     60,    120,  300};

void pxhist_observe(pxhist *h, double s) {
    int i = 0;
    while (i < PXH_BUCKETS - 1 && s > bounds[i])
        i++;
    h->counts[i]++;
    h->n++;
    h->sum += s;
}

void pxhist_render(pd_buf *b, const char *name, const char *labels, const pxhist *h) {
    const char *sep = labels && labels[0] ? "," : "";
    const char *lab = labels ? labels : "";
    uint64_t cum = 0;
    for (int i = 0; i < PXH_BUCKETS; i++) {
        cum += h->counts[i];
        if (i < PXH_BUCKETS - 1)
            pd_buf_printf(b, "%s_bucket{%s%sle=\"%g\"} %llu\n", name, lab, sep, bounds[i],
                          (unsigned long long)cum);
        else
            pd_buf_printf(b, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", name, lab, sep,
                          (unsigned long long)cum);
    }
    if (lab[0]) {
        pd_buf_printf(b, "%s_sum{%s} %.6f\n", name, lab, h->sum);
        pd_buf_printf(b, "%s_count{%s} %llu\n", name, lab, (unsigned long long)h->n);
    } else {
        pd_buf_printf(b, "%s_sum %.6f\n%s_count %llu\n", name, h->sum, name,
                      (unsigned long long)h->n);
    }
}

void pxm_init(proxy_metrics *m) {
    memset(m, 0, sizeof *m);
    pthread_mutex_init(&m->mu, NULL);
}

void pxm_destroy(proxy_metrics *m) {
    pthread_mutex_destroy(&m->mu);
}

void pxm_begin(proxy_metrics *m) {
    pthread_mutex_lock(&m->mu);
    m->in_flight++;
    pthread_mutex_unlock(&m->mu);
}

void pxm_end(proxy_metrics *m, int status, double total, double ttft, double prefill,
             double overhead, int retries) {
    pthread_mutex_lock(&m->mu);
    if (m->in_flight) m->in_flight--;
    if (status < 0 || status >= PXM_MAX_STATUS) status = 0;
    m->by_status[status]++;
    m->retries += (uint64_t)retries;
    pxhist_observe(&m->total, total);
    if (ttft >= 0) pxhist_observe(&m->ttft, ttft);
    if (prefill >= 0) pxhist_observe(&m->prefill, prefill);
    if (overhead >= 0) pxhist_observe(&m->overhead, overhead);
    pthread_mutex_unlock(&m->mu);
}

void pxm_refused(proxy_metrics *m, int status) {
    pthread_mutex_lock(&m->mu);
    if (status < 0 || status >= PXM_MAX_STATUS) status = 0;
    m->by_status[status]++;
    pthread_mutex_unlock(&m->mu);
}

void pxm_render(proxy_metrics *m, pd_buf *b) {
    pthread_mutex_lock(&m->mu);
    pd_buf_puts(b, "# HELP pdproxy_requests_total Client requests by final status "
                   "(499: the client went away; a stream that failed midway counts its error "
                   "code).\n# TYPE pdproxy_requests_total counter\n");
    for (int s = 0; s < PXM_MAX_STATUS; s++)
        if (m->by_status[s])
            pd_buf_printf(b, "pdproxy_requests_total{status=\"%d\"} %llu\n", s,
                          (unsigned long long)m->by_status[s]);
    pd_buf_printf(b,
                  "# HELP pdproxy_requests_in_flight Client requests being served.\n"
                  "# TYPE pdproxy_requests_in_flight gauge\npdproxy_requests_in_flight %llu\n",
                  (unsigned long long)m->in_flight);
    pd_buf_printf(b,
                  "# HELP pdproxy_prefill_retries_total Prefill requests retried on another "
                  "instance.\n# TYPE pdproxy_prefill_retries_total counter\n"
                  "pdproxy_prefill_retries_total %llu\n",
                  (unsigned long long)m->retries);
    static const struct {
        const char *name, *help;
        size_t off;
    } hs[] = {
        {"pdproxy_request_duration_seconds", "Client request time, arrival to last byte.",
         offsetof(proxy_metrics, total)},
        {"pdproxy_time_to_first_byte_seconds",
         "Arrival to the first byte of the decode answer (TTFT as the client sees it).",
         offsetof(proxy_metrics, ttft)},
        {"pdproxy_prefill_seconds", "Time in the prefill hop, retries included.",
         offsetof(proxy_metrics, prefill)},
        {"pdproxy_overhead_seconds",
         "Latency the proxy adds: request time minus the time spent waiting on instances.",
         offsetof(proxy_metrics, overhead)},
    };
    for (size_t i = 0; i < sizeof hs / sizeof hs[0]; i++) {
        pd_buf_printf(b, "# HELP %s %s\n# TYPE %s histogram\n", hs[i].name, hs[i].help, hs[i].name);
        pxhist_render(b, hs[i].name, NULL, (const pxhist *)((const char *)m + hs[i].off));
    }
    pthread_mutex_unlock(&m->mu);
}

uint64_t pxm_in_flight(proxy_metrics *m) {
    pthread_mutex_lock(&m->mu);
    uint64_t n = m->in_flight;
    pthread_mutex_unlock(&m->mu);
    return n;
}
