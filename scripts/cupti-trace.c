/* cupti-trace: a kernel timeline of any CUDA program, without Nsight (the
 * GPU machine has no Nsight Systems). Build it as a CUDA injection library
 * and point CUDA_INJECTION64_PATH at it; every kernel (graph replays
 * included, one record per node) and every copy is written at exit to
 * PDSERVE_TRACE_OUT (default cupti-trace.csv) as
 *     start_ns,duration_ns,name
 * with copies named "[memcpy HtoD]" and the like. scripts/trace-steps.py
 * turns that into a per-kernel table of a decode step.
 *
 * The CUDA build makes it (build/model/cuda/libcupti-trace.so) where CUPTI
 * is installed, and scripts/pack-gpu packs it with the CUPTI it loads:
 *   CUDA_INJECTION64_PATH=$PWD/.devpack/bin/libcupti-trace.so \
 *     PDSERVE_TRACE_OUT=/tmp/t.csv pdserve bench-cpu ...
 *
 * A development tool, not part of pdserve: CUPTI's own cost (a record per
 * kernel) makes every figure a little larger than without it. */
#include <cupti.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct trace_rec {
    uint64_t start, end;
    char name[96];
} trace_rec;

/* The records collected so far. CUPTI hands over full buffers on a thread
 * of its own and the exit flush runs on the program's, so the records are
 * taken under a lock. */
typedef struct trace_state {
    pthread_mutex_t lock;
    trace_rec *recs;
    size_t n, cap;
} trace_state;

/* An injection library has no other place for it. */
static trace_state g_trace = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void trace_add(uint64_t start, uint64_t end, const char *name) {
    if (g_trace.n == g_trace.cap) {
        size_t cap = g_trace.cap ? 2 * g_trace.cap : 65536;
        trace_rec *r = realloc(g_trace.recs, cap * sizeof *r);
        if (!r) return; /* out of memory: drop the record */
        g_trace.recs = r;
        g_trace.cap = cap;
    }
    trace_rec *r = &g_trace.recs[g_trace.n++];
    r->start = start;
    r->end = end;
    snprintf(r->name, sizeof r->name, "%s", name ? name : "?");
}

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    *size = (size_t)8 << 20;
    *buffer = aligned_alloc(8, *size);
    *max_records = 0;
}

static const char *copy_name(uint8_t kind) {
    switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD:
        return "[memcpy HtoD]";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH:
        return "[memcpy DtoH]";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD:
        return "[memcpy DtoD]";
    default:
        return "[memcpy other]";
    }
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
                                      size_t valid) {
    (void)ctx;
    (void)stream;
    (void)size;
    CUpti_Activity *rec = NULL;
    pthread_mutex_lock(&g_trace.lock);
    while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
        if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
            const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)rec;
            trace_add(k->start, k->end, k->name);
        } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
            const CUpti_ActivityMemcpy6 *m = (const CUpti_ActivityMemcpy6 *)rec;
            trace_add(m->start, m->end, copy_name(m->copyKind));
        }
    }
    pthread_mutex_unlock(&g_trace.lock);
    free(buffer);
}

static void trace_write(void) {
    cuptiActivityFlushAll(1);
    pthread_mutex_lock(&g_trace.lock);
    const char *path = getenv("PDSERVE_TRACE_OUT");
    FILE *f = fopen(path && *path ? path : "cupti-trace.csv", "w");
    if (!f) {
        fprintf(stderr, "cupti-trace: cannot write %s\n", path ? path : "cupti-trace.csv");
        pthread_mutex_unlock(&g_trace.lock);
        return;
    }
    fprintf(f, "start_ns,duration_ns,name\n");
    for (size_t i = 0; i < g_trace.n; i++)
        fprintf(f, "%llu,%llu,%s\n", (unsigned long long)g_trace.recs[i].start,
                (unsigned long long)(g_trace.recs[i].end - g_trace.recs[i].start),
                g_trace.recs[i].name);
    fclose(f);
    fprintf(stderr, "cupti-trace: %zu records\n", g_trace.n);
    free(g_trace.recs);
    g_trace.recs = NULL;
    g_trace.n = g_trace.cap = 0;
    pthread_mutex_unlock(&g_trace.lock);
}

/* Called by the CUDA driver when it loads this library (CUDA_INJECTION64_PATH). */
int InitializeInjection(void) {
    if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS ||
        cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY) != CUPTI_SUCCESS) {
        fprintf(stderr, "cupti-trace: could not enable activity tracing\n");
        return 0;
    }
    atexit(trace_write);
    return 1;
}
