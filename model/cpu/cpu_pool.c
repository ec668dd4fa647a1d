/* cpu_pool: persistent worker threads and a parallel-for (see cpu_pool.h). */
#include "model/cpu/cpu_pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>

/* How long an idle thread polls before it sleeps. Short parallel loops come
 * back to back within a step, and a condition-variable wake-up costs more
 * than one of them. */
#define POOL_SPIN 20000

struct cpu_pool {
    int n_threads;
    pthread_t *workers; /* n_threads - 1 */
    int n_started;

    pthread_mutex_t mu;
    pthread_cond_t wake; /* a new job (generation) or stop */
    pthread_cond_t done; /* busy reached 0 */

    /* The current job. Written by the caller before gen is bumped
     * (release), read by workers after they see the new gen (acquire). */
    cpu_task_fn fn;
    void *arg;
    int n_tasks;
    atomic_int next; /* next task index to hand out */
    atomic_int busy; /* workers that have not finished the current job */
    atomic_uint gen; /* job counter */
    atomic_bool stop;
};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void pool_drain(cpu_pool *p) {
    for (;;) {
        int t = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
        if (t >= p->n_tasks) return;
        p->fn(p->arg, t);
    }
}

static void *pool_worker(void *arg) {
    cpu_pool *p = arg;
    unsigned seen = 0;
    for (;;) {
        unsigned g = atomic_load_explicit(&p->gen, memory_order_acquire);
        for (int i = 0; g == seen && i < POOL_SPIN; i++) {
            cpu_relax();
            g = atomic_load_explicit(&p->gen, memory_order_acquire);
        }
        if (g == seen) {
            pthread_mutex_lock(&p->mu);
            while ((g = atomic_load_explicit(&p->gen, memory_order_acquire)) == seen)
                pthread_cond_wait(&p->wake, &p->mu);
            pthread_mutex_unlock(&p->mu);
        }
        seen = g;
        if (atomic_load(&p->stop)) return NULL;
        pool_drain(p);
        if (atomic_fetch_sub_explicit(&p->busy, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->done);
            pthread_mutex_unlock(&p->mu);
        }
    }
}

/* Bump the generation so every worker wakes up for the job set up before. */
static void pool_publish(cpu_pool *p) {
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add_explicit(&p->gen, 1, memory_order_acq_rel);
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
    atomic_init(&p->next, 0);
    atomic_init(&p->busy, 0);
    atomic_init(&p->gen, 0);
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
    pool_publish(p);
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
    p->fn = fn;
    p->arg = arg;
    p->n_tasks = n_tasks;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    atomic_store_explicit(&p->busy, p->n_threads - 1, memory_order_relaxed);
    pool_publish(p);
    pool_drain(p);
    for (int i = 0; atomic_load_explicit(&p->busy, memory_order_acquire) > 0 && i < POOL_SPIN; i++)
        cpu_relax();
    if (atomic_load_explicit(&p->busy, memory_order_acquire) > 0) {
        pthread_mutex_lock(&p->mu);
        while (atomic_load_explicit(&p->busy, memory_order_acquire) > 0)
            pthread_cond_wait(&p->done, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
}
