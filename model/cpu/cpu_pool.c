/* cpu_pool: persistent worker threads and a parallel-for (see cpu_pool.h).
 *
 * A job is published as one 64-bit word, (n_tasks << 32) | next_index.
 * Any thread claims a task with a compare-and-swap that advances the index,
 * and only while index < n_tasks. The caller takes tasks too and waits only
 * for tasks to *finish*, never for workers to wake up: if a worker is
 * descheduled (other programs share the cores) the caller simply runs its
 * share. A claim that succeeds always names an unfinished task of the job
 * that is current, so the job's fn/arg, written before the word, are
 * stable while it runs. */
#include "model/cpu/cpu_pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

/* Polls of an idle thread before it sleeps. Short parallel loops come back
 * to back within a step, and a condition-variable wake-up costs more than
 * one of them. */
#define POOL_SPIN 4000

struct cpu_pool {
    int n_threads;
    pthread_t *workers; /* n_threads - 1 */
    int n_started;

    pthread_mutex_t mu;
    pthread_cond_t wake; /* wake_gen moved, or stop */
    pthread_cond_t done; /* n_done reached the job's n_tasks */

    cpu_task_fn fn; /* the current job */
    void *arg;
    atomic_uint_fast64_t word; /* (n_tasks << 32) | next task index */
    atomic_int n_done;
    atomic_uint wake_gen; /* bumped per job so sleeping workers look */
    atomic_bool stop;
};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Claim and run tasks of the current job until none is left unclaimed. */
static void pool_drain(cpu_pool *p) {
    uint_fast64_t w = atomic_load_explicit(&p->word, memory_order_acquire);
    for (;;) {
        const uint32_t n = (uint32_t)(w >> 32), i = (uint32_t)w;
        if (i >= n) return;
        if (!atomic_compare_exchange_weak_explicit(&p->word, &w, w + 1, memory_order_acq_rel,
                                                   memory_order_acquire))
            continue; /* w now holds the fresh value */
        p->fn(p->arg, (int)i);
        if (atomic_fetch_add_explicit(&p->n_done, 1, memory_order_acq_rel) + 1 == (int)n) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
        w = atomic_load_explicit(&p->word, memory_order_acquire);
    }
}

static void *pool_worker(void *arg) {
    cpu_pool *p = arg;
    unsigned seen = 0;
    for (;;) {
        unsigned g = atomic_load_explicit(&p->wake_gen, memory_order_acquire);
        for (int i = 0; g == seen && i < POOL_SPIN; i++) {
            cpu_relax();
            g = atomic_load_explicit(&p->wake_gen, memory_order_acquire);
        }
        if (g == seen) {
            pthread_mutex_lock(&p->mu);
            while ((g = atomic_load_explicit(&p->wake_gen, memory_order_acquire)) == seen)
                pthread_cond_wait(&p->wake, &p->mu);
            pthread_mutex_unlock(&p->mu);
        }
        seen = g;
        if (atomic_load(&p->stop)) return NULL;
        pool_drain(p);
    }
}

static void pool_wake(cpu_pool *p) {
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add_explicit(&p->wake_gen, 1, memory_order_acq_rel);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
}

int cpu_pool_create(int n_threads, cpu_pool **out, pd_err *err) {
    *out = NULL;
    if (n_threads < 1) return pd_fail(err, "cpu pool: n_threads must be >= 1 (got %d)", n_threads);
    cpu_pool *p = calloc(1, sizeof *p);
    if (!p) return pd_fail(err, "cpu pool: out of memory");
    p->n_threads = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    atomic_init(&p->word, 0);
    atomic_init(&p->n_done, 0);
    atomic_init(&p->wake_gen, 0);
    atomic_init(&p->stop, false);
    if (n_threads > 1) {
        p->workers = calloc((size_t)n_threads - 1, sizeof *p->workers);
        if (!p->workers) {
            cpu_pool_destroy(p);
            return pd_fail(err, "cpu pool: out of memory");
        }
    }
    for (int i = 0; i < n_threads - 1; i++) {
        if (pthread_create(&p->workers[i], NULL, pool_worker, p) != 0) {
            cpu_pool_destroy(p);
            return pd_fail(err, "cpu pool: cannot start worker thread %d of %d", i + 1,
                           n_threads - 1);
        }
        p->n_started++;
    }
    *out = p;
    return 0;
}

void cpu_pool_destroy(cpu_pool *p) {
    if (!p) return;
    atomic_store(&p->stop, true);
    pool_wake(p);
    for (int i = 0; i < p->n_started; i++)
        pthread_join(p->workers[i], NULL);
    free(p->workers);
    pthread_cond_destroy(&p->done);
    pthread_cond_destroy(&p->wake);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

int cpu_pool_threads(const cpu_pool *p) {
    return p->n_threads;
}

void cpu_pool_run(cpu_pool *p, int n_tasks, cpu_task_fn fn, void *arg) {
    if (n_tasks <= 0) return;
    if (p->n_threads == 1 || n_tasks == 1) {
        for (int t = 0; t < n_tasks; t++)
            fn(arg, t);
        return;
    }
    /* Every task of the previous job has finished, so nobody reads these. */
    p->fn = fn;
    p->arg = arg;
    atomic_store_explicit(&p->n_done, 0, memory_order_relaxed);
    atomic_store_explicit(&p->word, (uint_fast64_t)(uint32_t)n_tasks << 32, memory_order_release);
    pool_wake(p);
    pool_drain(p);
    for (int i = 0; atomic_load_explicit(&p->n_done, memory_order_acquire) < n_tasks; i++) {
        if (i < POOL_SPIN) {
            cpu_relax();
            continue;
        }
        pthread_mutex_lock(&p->mu);
        while (atomic_load_explicit(&p->n_done, memory_order_acquire) < n_tasks)
            pthread_cond_wait(&p->done, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
}
