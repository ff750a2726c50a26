/* Run `threads` jobs at once: jobs[t] (each `size` bytes) handed to `run`. Built with OpenMP, on
 * torch's own OpenMP runtime (libgomp.so.1, already loaded by torch): its worker threads, which spin
 * for a while after every torch op, take these jobs at once instead of competing with new threads
 * for the cores. Without OpenMP, POSIX threads; jobs whose thread could not be started run on this one. */
#include "parallel.h"

#include <pthread.h>

void pd_parallel(void *(*run)(void *), void *jobs, size_t size, int threads) {
    char *base = (char *)jobs;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int t = 0; t < threads; t++) run(base + (size_t)t * size);
#else
    pthread_t tids[PD_MAX_THREADS];
    int spawned = 0;
    for (int t = 1; t < threads && t < PD_MAX_THREADS; t++) {
        if (pthread_create(&tids[t], NULL, run, base + (size_t)t * size) != 0) break;
        spawned = t;
    }
    for (int t = spawned + 1; t < threads; t++) run(base + (size_t)t * size);
    run(base);
    for (int t = 1; t <= spawned; t++) pthread_join(tids[t], NULL);
#endif
}

typedef struct {
    void (*fn)(const void *, int, int, int);
    const void *ctx;
    int phase, t, threads;
} phase_job_t;

static void *run_phase_job(void *arg) {
    const phase_job_t *j = (const phase_job_t *)arg;
    j->fn(j->ctx, j->phase, j->t, j->threads);
    return NULL;
}

void pd_parallel_phase(void (*fn)(const void *ctx, int phase, int t, int threads), const void *ctx, int phase,
                       int threads) {
    phase_job_t jobs[PD_MAX_THREADS];
    if (threads < 1) threads = 1;
    if (threads > PD_MAX_THREADS) threads = PD_MAX_THREADS;
    for (int t = 0; t < threads; t++) jobs[t] = (phase_job_t){fn, ctx, phase, t, threads};
    pd_parallel(run_phase_job, jobs, sizeof(phase_job_t), threads);
}
