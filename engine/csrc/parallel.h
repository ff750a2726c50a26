/* The kernels' one parallel runner (parallel.c). */
#ifndef PD_PARALLEL_H
#define PD_PARALLEL_H
#include <stddef.h>

#define PD_MAX_THREADS 64

/* Run `threads` jobs at once: jobs[t] (each `size` bytes) handed to `run`. */
void pd_parallel(void *(*run)(void *), void *jobs, size_t size, int threads);

/* fn(ctx, phase, t, threads) for t in [0, threads) at once (threads clamped to [1, PD_MAX_THREADS]);
 * each call does its share of the phase's units. */
void pd_parallel_phase(void (*fn)(const void *ctx, int phase, int t, int threads), const void *ctx, int phase,
                       int threads);
#endif
