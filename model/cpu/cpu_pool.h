/* cpu_pool: a persistent pool of worker threads with a blocking parallel-for.
 *
 * The pool has n_threads participants: the calling thread plus n_threads - 1
 * workers created once in cpu_pool_create and joined in cpu_pool_destroy.
 * cpu_pool_run hands out task indices 0..n_tasks-1 dynamically (an atomic
 * counter) and returns when every task has finished. Idle workers spin
 * briefly before sleeping on a condition variable, because a decode step
 * issues many short parallel loops back to back. */
#ifndef PD_CPU_POOL_H
#define PD_CPU_POOL_H

#include "common/pd_common.h"

typedef struct cpu_pool cpu_pool;

/* fn(arg, task): one unit of work. Tasks of one run must be independent. */
typedef void (*cpu_task_fn)(void *arg, int task);

int cpu_pool_create(int n_threads, cpu_pool **out, pd_err *err);
void cpu_pool_destroy(cpu_pool *pool);
int cpu_pool_threads(const cpu_pool *pool);
/* Run fn for every task index; not reentrant (one run at a time). */
void cpu_pool_run(cpu_pool *pool, int n_tasks, cpu_task_fn fn, void *arg);

#endif
