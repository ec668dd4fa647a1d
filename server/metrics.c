/* metrics: Prometheus exposition for /metrics. See metrics.h. */
#include "server/metrics.h"

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/api_json.h"

/* vLLM's bucket boundaries (vllm/v1/metrics/loggers.py). */
static const double ttft_buckets[] = {0.001, 0.005, 0.01, 0.02,  0.04,  0.06,  0.08, 0.1,
                                      0.25,  0.5,   0.75, 1.0,   2.5,   5.0,   7.5,  10.0,
                                      20.0,  40.0,  80.0, 160.0, 640.0, 2560.0};
static const double itl_buckets[] = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
                                     0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
static const double latency_buckets[] = {0.3,  0.5,   0.8,   1.0,   1.5,   2.0,    2.5,
                                         5.0,  10.0,  15.0,  20.0,  30.0,  40.0,   50.0,
                                         60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
#define N_OF(a) ((int)(sizeof(a) / sizeof((a)[0])))
#define MAX_BUCKETS 40

typedef struct histogram {
    const char *name, *help;
    const double *bounds;
    int n_bounds;
    uint64_t counts[MAX_BUCKETS + 1]; /* per bucket, not cumulative; last is +Inf */
    double sum;
    uint64_t count;
} histogram;

enum { H_TTFT, H_ITL, H_TPOT, H_E2E, H_QUEUE, H_PROMPT, H_GEN, H_COUNT };
#define N_REASONS 4 /* stop, length, abort, error */

struct metrics {
    pthread_mutex_t mu;
    char *labels; /* model_name="...",engine="0" */
    double token_buckets[MAX_BUCKETS];
    histogram h[H_COUNT];
    unsigned long long success[N_REASONS];
};

static const char *reason_names[N_REASONS] = {"stop", "length", "abort", "error"};

static int reason_index(finish_reason r) {
    switch (r) {
    case FINISH_STOP:
        return 0;
    case FINISH_LENGTH:
        return 1;
    case FINISH_ABORT:
        return 2;
    default:
        return 3;
    }
}

/* 1, 2, 5, 10, 20, 50, ... up to max (vLLM's build_1_2_5_buckets). */
static int build_1_2_5(double *out, int cap, int max) {
    int n = 0;
    for (double mag = 1; n < cap; mag *= 10) {
        const double steps[3] = {1, 2, 5};
        for (int i = 0; i < 3 && n < cap; i++) {
            if (steps[i] * mag > max) return n;
            out[n++] = steps[i] * mag;
        }
    }
    return n;
}

static void hist_init(histogram *h, const char *name, const char *help, const double *bounds,
                      int n) {
    memset(h, 0, sizeof *h);
    h->name = name;
    h->help = help;
    h->bounds = bounds;
    h->n_bounds = n;
}

static void hist_observe(histogram *h, double v) {
    int i = 0;
    while (i < h->n_bounds && v > h->bounds[i])
        i++;
    h->counts[i]++;
    h->sum += v;
    h->count++;
}

metrics *metrics_create(const char *model_name, int max_model_len) {
    metrics *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    pd_buf b;
    pd_buf_init(&b);
    pd_buf_puts(&b, "model_name=\"");
    for (const char *p = model_name; *p; p++) { /* label value escaping */
        if (*p == '\\' || *p == '"') pd_buf_append(&b, "\\", 1);
        if (*p == '\n')
            pd_buf_puts(&b, "\\n");
        else
            pd_buf_append(&b, p, 1);
    }
    pd_buf_puts(&b, "\",engine=\"0\"");
    m->labels = pd_buf_take(&b, NULL);
    if (!m->labels) {
        free(m);
        return NULL;
    }
    pthread_mutex_init(&m->mu, NULL);
    int nt = build_1_2_5(m->token_buckets, MAX_BUCKETS, max_model_len > 0 ? max_model_len : 1);
    hist_init(&m->h[H_TTFT], "vllm:time_to_first_token_seconds",
              "Histogram of time to first token in seconds.", ttft_buckets, N_OF(ttft_buckets));
    hist_init(&m->h[H_ITL], "vllm:inter_token_latency_seconds",
              "Histogram of inter-token latency in seconds.", itl_buckets, N_OF(itl_buckets));
    hist_init(&m->h[H_TPOT], "vllm:request_time_per_output_token_seconds",
              "Histogram of time_per_output_token_seconds per request.", itl_buckets,
              N_OF(itl_buckets));
    hist_init(&m->h[H_E2E], "vllm:e2e_request_latency_seconds",
              "Histogram of e2e request latency in seconds.", latency_buckets,
              N_OF(latency_buckets));
    hist_init(&m->h[H_QUEUE], "vllm:request_queue_time_seconds",
              "Histogram of time spent in WAITING phase for request.", latency_buckets,
              N_OF(latency_buckets));
    hist_init(&m->h[H_PROMPT], "vllm:request_prompt_tokens", "Number of prefill tokens processed.",
              m->token_buckets, nt);
    hist_init(&m->h[H_GEN], "vllm:request_generation_tokens",
              "Number of generation tokens processed.", m->token_buckets, nt);
    return m;
}

void metrics_free(metrics *m) {
    if (!m) return;
    pthread_mutex_destroy(&m->mu);
    free(m->labels);
    free(m);
}

void metrics_observe(metrics *m, const metrics_request *r) {
    pthread_mutex_lock(&m->mu);
    m->success[reason_index(r->reason)]++;
    hist_observe(&m->h[H_PROMPT], r->prompt_tokens);
    hist_observe(&m->h[H_GEN], r->generation_tokens);
    if (r->queue_time >= 0) hist_observe(&m->h[H_QUEUE], r->queue_time);
    if (r->ttft >= 0) hist_observe(&m->h[H_TTFT], r->ttft);
    if (r->e2e >= 0) hist_observe(&m->h[H_E2E], r->e2e);
    if (r->tpot >= 0) hist_observe(&m->h[H_TPOT], r->tpot);
    for (int i = 0; i < r->n_itl; i++)
        hist_observe(&m->h[H_ITL], r->itl[i]);
    pthread_mutex_unlock(&m->mu);
}

unsigned long long metrics_finished(metrics *m, finish_reason r) {
    pthread_mutex_lock(&m->mu);
    unsigned long long v = m->success[reason_index(r)];
    pthread_mutex_unlock(&m->mu);
    return v;
}

/* Numbers as prometheus_client prints them: floats with a decimal point. */
static void prom_num(pd_buf *b, double v) {
    if (isinf(v))
        pd_buf_puts(b, v > 0 ? "+Inf" : "-Inf");
    else if (isnan(v))
        pd_buf_puts(b, "NaN");
    else if (v == floor(v) && fabs(v) < 1e15)
        pd_buf_printf(b, "%.1f", v);
    else
        pd_buf_printf(b, "%.17g", v);
}

static void head(pd_buf *b, const char *name, const char *type, const char *help) {
    pd_buf_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void sample(pd_buf *b, const metrics *m, const char *name, const char *type,
                   const char *help, double v) {
    head(b, name, type, help);
    pd_buf_printf(b, "%s{%s} ", name, m->labels);
    prom_num(b, v);
    pd_buf_puts(b, "\n");
}

static void hist_write(pd_buf *b, const metrics *m, const histogram *h) {
    head(b, h->name, "histogram", h->help);
    uint64_t cum = 0;
    for (int i = 0; i <= h->n_bounds; i++) {
        cum += h->counts[i];
        pd_buf_printf(b, "%s_bucket{%s,le=\"", h->name, m->labels);
        prom_num(b, i < h->n_bounds ? h->bounds[i] : INFINITY);
        pd_buf_puts(b, "\"} ");
        prom_num(b, (double)cum);
        pd_buf_puts(b, "\n");
    }
    pd_buf_printf(b, "%s_count{%s} ", h->name, m->labels);
    prom_num(b, (double)h->count);
    pd_buf_printf(b, "\n%s_sum{%s} ", h->name, m->labels);
    prom_num(b, h->sum);
    pd_buf_puts(b, "\n");
}

/* A counter with a result="ok"/"failed" label pair. */
static void ok_failed(pd_buf *b, const metrics *m, const char *name, const char *help, uint64_t ok,
                      uint64_t failed) {
    head(b, name, "counter", help);
    pd_buf_printf(b, "%s{%s,result=\"ok\"} ", name, m->labels);
    prom_num(b, (double)ok);
    pd_buf_printf(b, "\n%s{%s,result=\"failed\"} ", name, m->labels);
    prom_num(b, (double)failed);
    pd_buf_puts(b, "\n");
}

/* KV transfer (disaggregation) counters of a prefill or decode instance. */
static void kv_metrics(pd_buf *b, const metrics *m, const kv_connector_stats *kv) {
    ok_failed(b, m, "pdserve:kv_saves_total", "Requests whose prompt KV was handed to the transfer engine (producer).",
              kv->saves_ok, kv->saves_failed);
    ok_failed(b, m, "pdserve:kv_loads_total", "Requests whose prompt KV was received and written into the cache (consumer).",
              kv->loads_ok, kv->loads_failed);
    ok_failed(b, m, "pdserve:kv_sends_total", "Tensors delivered to (or pulled by) a peer.", kv->sends_ok, kv->sends_failed);
    ok_failed(b, m, "pdserve:kv_receives_total", "Tensors received from a peer.", kv->recvs_ok, kv->recvs_failed);
    /* The connector's plain counters and gauges, one row each. */
    const struct {
        const char *name, *type, *help;
        double value;
    } rows[] = {
        {"pdserve:kv_bytes_sent_total", "counter", "KV bytes sent to peers.",
         (double)kv->bytes_sent},
        {"pdserve:kv_bytes_received_total", "counter", "KV bytes received from peers.",
         (double)kv->bytes_received},
        {"pdserve:kv_send_retries_total", "counter", "PUT retries after a peer had no room.",
         (double)kv->retries},
        {"pdserve:kv_aborts_total", "counter", "Transfers given up by the consumer (ABORT).",
         (double)kv->aborts},
        {"pdserve:kv_buffered_bytes", "gauge",
         "Bytes of KV held by the transfer engine: received and not yet written, or waiting to be "
         "sent/pulled.",
         (double)kv->buffered_bytes},
        {"pdserve:kv_peer_connections", "gauge",
         "Open connections this instance made to KV peers (tcp_streams per peer at most; idle ones "
         "close).",
         (double)kv->connections},
        {"pdserve:kv_nccl_comm_resets_total", "counter",
         "NCCL communicators with KV peers torn down (a failed or broken transfer); each loses "
         "the transfers in flight on it.",
         (double)kv->comm_resets},
        {"pdserve:kv_host_pool_pinned_bytes", "gauge",
         "Page-locked host memory held by the connector's tcp buffer pool, idle or in use (at most "
         "mem_pool_size_gb).",
         (double)kv->host_pool_pinned_bytes},
        {"pdserve:kv_host_pool_pageable_bytes", "gauge",
         "Ordinary host memory held by the connector's tcp buffer pool, idle or in use.",
         (double)kv->host_pool_pageable_bytes},
        {"pdserve:kv_save_seconds_total", "counter",
         "Time spent gathering and handing over KV (producer).", kv->save_seconds},
        {"pdserve:kv_load_seconds_total", "counter",
         "Time from a request's arrival to its remote KV being in the cache (consumer).",
         kv->load_seconds},
        {"pdserve:kv_layers_written_total", "counter",
         "Layers of received KV written into the cache (consumer; one per model layer per "
         "request).",
         (double)kv->layers_written},
        {"pdserve:kv_layers_written_on_arrival_total", "counter",
         "Of those, layers written as they arrived, while the request waited for the rest (its "
         "blocks were free).",
         (double)kv->layers_written_on_arrival},
        {"pdserve:kv_layers_written_from_pinned_total", "counter",
         "Of those, layers copied to the device from page-locked memory by a queued copy "
         "(recv_into_pinned).",
         (double)kv->layers_written_from_pinned},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
        sample(b, m, rows[i].name, rows[i].type, rows[i].help, rows[i].value);
}

char *metrics_render(metrics *m, const engine_stats *st, size_t *len) {
    pd_buf b;
    pd_buf_init(&b);
    if (st) {
        sample(&b, m, "vllm:num_requests_running", "gauge",
               "Number of requests in model execution batches.", st->running);
        sample(&b, m, "vllm:num_requests_waiting", "gauge",
               "Number of requests waiting to be processed.", st->waiting);
        sample(&b, m, "vllm:kv_cache_usage_perc", "gauge",
               "KV-cache usage. 1 means 100 percent usage.", st->kv_usage);
        sample(&b, m, "vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
               (double)st->prompt_tokens);
        sample(&b, m, "vllm:generation_tokens_total", "counter",
               "Number of generation tokens processed.", (double)st->generation_tokens);
        sample(&b, m, "vllm:prefix_cache_queries_total", "counter",
               "Prefix cache queries, in terms of number of queried tokens.",
               (double)st->prefix_queries);
        sample(&b, m, "vllm:prefix_cache_hits_total", "counter",
               "Prefix cache hits, in terms of number of cached tokens.", (double)st->prefix_hits);
        sample(&b, m, "vllm:num_preemptions_total", "counter",
               "Cumulative number of preemption from the engine.", (double)st->preemptions);
        sample(&b, m, "pdserve:prompt_tokens_computed_total", "counter",
               "Prompt tokens run through the model (not from the prefix cache or a remote "
               "prefill).",
               (double)st->prompt_tokens_computed);
        sample(&b, m, "pdserve:engine_steps_total", "counter", "Engine steps (forward passes).",
               (double)st->steps);
        sample(&b, m, "pdserve:engine_step_tokens_total", "counter",
               "Tokens run through the model in all engine steps.", (double)st->step_tokens);
        sample(&b, m, "pdserve:engine_steps_ahead_total", "counter",
               "Steps queued while the step before was still running (--async-scheduling).",
               (double)st->steps_ahead);
        sample(&b, m, "pdserve:engine_steps_chained_on_device_total", "counter",
               "Steps queued ahead whose tokens the device read from the step before, so the host "
               "never waited between them.",
               (double)st->steps_chained);
        sample(&b, m, "pdserve:kv_cache_free_blocks", "gauge", "KV-cache blocks not in use.",
               st->free_blocks);
        sample(&b, m, "pdserve:kv_cache_total_blocks", "gauge", "KV-cache blocks in all.",
               st->total_blocks);
        if (st->has_connector) {
            kv_metrics(&b, m, &st->kv);
            sample(
                &b, m, "pdserve:kv_reservations_returned_total", "counter",
                "Times blocks held for remote KV that had not arrived went to a running sequence "
                "instead of preempting one (consumer).",
                (double)st->reservations_returned);
        }
    }
    pthread_mutex_lock(&m->mu);
    head(&b, "vllm:request_success_total", "counter", "Count of successfully processed requests.");
    for (int i = 0; i < N_REASONS; i++) {
        pd_buf_printf(&b, "vllm:request_success_total{%s,finished_reason=\"%s\"} ", m->labels,
                      reason_names[i]);
        prom_num(&b, (double)m->success[i]);
        pd_buf_puts(&b, "\n");
    }
    for (int i = 0; i < H_COUNT; i++)
        hist_write(&b, m, &m->h[i]);
    pthread_mutex_unlock(&m->mu);
    return pd_buf_take(&b, len);
}
