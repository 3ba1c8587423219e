/* Running a kernel's work loop on several threads.
 *
 * `run_on_threads(fn, job, threads)` calls `fn(job)` on `threads` threads,
 * the caller's included; `fn` takes work items from a shared atomic counter
 * in `job` until none are left, so any number of threads finishes the job.
 * Returns nonzero when some call of `fn` returned non-NULL (it failed).
 *
 * Built with OpenMP, the threads are the OpenMP runtime's team. In a process
 * that has imported torch that runtime is torch's own libgomp (the loader
 * reuses the already loaded `libgomp.so.1`), so kernels and torch ops share
 * one warm pool of threads and a parallel call costs microseconds. Without
 * OpenMP, threads are started per call (tens of microseconds each).
 */
#ifndef DISAGG_PARALLEL_H
#define DISAGG_PARALLEL_H

#include <pthread.h>
#include <stdint.h>

#define MAX_THREADS 64

/* Claims the next `chunk` items of `count` from the shared counter `*next`
 * for the calling thread: sets [*first, *last) and returns 1, or 0 once
 * every item is taken. */
static inline int claim_chunk(int64_t *next, int64_t count, int64_t chunk, int64_t *first,
                              int64_t *last) {
    *first = __atomic_fetch_add(next, chunk, __ATOMIC_RELAXED);
    if (*first >= count) return 0;
    *last = *first + chunk < count ? *first + chunk : count;
    return 1;
}

static int run_on_threads(void *(*fn)(void *), void *job, int threads) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1) return fn(job) != NULL;
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(| : failed)
    failed |= fn(job) != NULL;
#else
    pthread_t pool[MAX_THREADS];
    int started = 0;
    for (; started < threads - 1; started++)
        if (pthread_create(&pool[started], NULL, fn, job) != 0) break;
    failed |= fn(job) != NULL;
    for (int i = 0; i < started; i++) {
        void *status = NULL;
        pthread_join(pool[i], &status);
        failed |= status != NULL;
    }
#endif
    return failed;
}

#endif
