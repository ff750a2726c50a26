/* Run `threads` jobs at once: jobs[t] (each `size` bytes) handed to `run`. Built with OpenMP, on
 * torch's own OpenMP runtime (libgomp.so.1, already loaded by torch): its worker threads, which spin
 * for a while after every torch op, take these jobs at once instead of competing with new threads
 * for the cores. Without OpenMP, POSIX threads; jobs whose thread could not be started run on this one. */
#include <pthread.h>
#include <stddef.h>

#define PD_MAX_THREADS 64

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
