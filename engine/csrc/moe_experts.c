/* A mixture-of-experts layer's routed experts in one call: every (token, expert) pair a router
 * chose, SwiGLU experts, float32.
 *
 * Layout (engine/models/moe.py): x[T][H]; gate_up[E][2I][H] (gate rows, then up rows);
 * down[E][H][I]; ids[T][k] and weights[T][k] (float32) as the router returns them; out[T][H] is
 * overwritten. The pairs are counting-sorted by expert (stable: token order within an expert), so
 * each expert's weights are read once for all its tokens, and an expert no token chose is never
 * read. Two phases, each split over `threads` threads (torch's OpenMP threads where built with it):
 *   1. units (expert, i): rows i of gate and up against each of the expert's tokens, then
 *      silu(gate) * up into act[pair][i];
 *   2. units: output columns h; for each expert in ascending order, each of its tokens'
 *      out[token][h] += weight * (act[pair] . down[e][h]). Summed in expert order, as
 *      transformers sums the experts.
 * Dot products run four token rows against one or two weight rows at once (AVX2 + FMA where
 * built with them), so a weight row is loaded once per four tokens.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moe_pairs.h"

#include "parallel.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif


typedef struct {
    const float *x, *gate_up, *down;
    const int32_t *tok;   /* pair -> token, pairs grouped by expert */
    const float *wt;      /* pair -> router weight */
    const int32_t *start; /* expert -> its first pair; start[E] = pairs */
    const int32_t *active;/* the experts with pairs, ascending */
    int n_active, H, I;
    float *act, *out;
} moe_t;

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* Scalar tail of rows[r] . w over [d, n). */
static inline float tail_dot(const float *row, const float *w, int d, int n) {
    float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (; d + 8 <= n; d += 8)
        for (int u = 0; u < 8; u++) part[u] += row[d + u] * w[d + u];
    float tail = 0.f;
    for (; d < n; d++) tail += row[d] * w[d];
    return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7])) + tail;
}

#if defined(__AVX2__) && defined(__FMA__)
/* NR rows against one weight row, one chain of multiply-adds per row, the weight loaded once per
 * eight values for all of them. */
#define DOT_ROWS(NR)                                                                                     \
    static void dot_rows##NR(const float *w, const float *const *rows, int n, float *res) {            \
        __m256 a[NR];                                                                                  \
        for (int r = 0; r < NR; r++) a[r] = _mm256_setzero_ps();                                       \
        int d = 0;                                                                                     \
        for (; d + 8 <= n; d += 8) {                                                                   \
            const __m256 wv = _mm256_loadu_ps(w + d);                                                  \
            for (int r = 0; r < NR; r++) a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(rows[r] + d), wv, a[r]); \
        }                                                                                              \
        for (int r = 0; r < NR; r++) res[r] = hsum(a[r]) + tail_dot(rows[r], w, d, n);                 \
    }
DOT_ROWS(2)
DOT_ROWS(3)
DOT_ROWS(4)

/* One row: four independent chains (one chain would wait on each add's latency). */
static void dot_rows1(const float *w, const float *const *rows, int n, float *res) {
    const float *r0 = rows[0];
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int d = 0;
    for (; d + 32 <= n; d += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(r0 + d), _mm256_loadu_ps(w + d), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(r0 + d + 8), _mm256_loadu_ps(w + d + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(r0 + d + 16), _mm256_loadu_ps(w + d + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(r0 + d + 24), _mm256_loadu_ps(w + d + 24), a3);
    }
    res[0] = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))) + tail_dot(r0, w, d, n);
}
#endif

/* res[r] = rows[r] . w over n values, for nr <= 4 rows. */
static void dot_rows(const float *w, const float *const *rows, int nr, int n, float *res) {
#if defined(__AVX2__) && defined(__FMA__)
    switch (nr) {
    case 1: dot_rows1(w, rows, n, res); return;
    case 2: dot_rows2(w, rows, n, res); return;
    case 3: dot_rows3(w, rows, n, res); return;
    default: dot_rows4(w, rows, n, res); return;
    }
#else
    for (int r = 0; r < nr; r++) res[r] = tail_dot(rows[r], w, 0, n);
#endif
}

static inline float silu(float g) { return g / (1.f + expf(-g)); }

/* Phase 1 for units [lo, hi) of the n_active * I units (expert slot, intermediate row). */
static void gate_up_units(const moe_t *m, int64_t lo, int64_t hi) {
    const int H = m->H, I = m->I;
    for (int64_t u = lo; u < hi; u++) {
        const int slot = (int)(u / I), i = (int)(u % I), e = m->active[slot];
        const float *g = m->gate_up + ((int64_t)e * 2 * I + i) * H, *up = g + (int64_t)I * H;
        for (int p = m->start[e]; p < m->start[e + 1]; p += 4) {
            const int nr = m->start[e + 1] - p < 4 ? m->start[e + 1] - p : 4;
            const float *rows[4];
            float gv[4], uv[4];
            for (int r = 0; r < nr; r++) rows[r] = m->x + (int64_t)m->tok[p + r] * H;
            dot_rows(g, rows, nr, H, gv);
            dot_rows(up, rows, nr, H, uv);
            for (int r = 0; r < nr; r++) m->act[(int64_t)(p + r) * I + i] = silu(gv[r]) * uv[r];
        }
    }
}

/* Phase 2 for output columns [lo, hi). */
static void down_units(const moe_t *m, int64_t lo, int64_t hi) {
    const int H = m->H, I = m->I;
    for (int64_t h = lo; h < hi; h++) {
        for (int slot = 0; slot < m->n_active; slot++) {
            const int e = m->active[slot];
            const float *w = m->down + ((int64_t)e * H + h) * I;
            for (int p = m->start[e]; p < m->start[e + 1]; p += 4) {
                const int nr = m->start[e + 1] - p < 4 ? m->start[e + 1] - p : 4;
                const float *rows[4];
                float y[4];
                for (int r = 0; r < nr; r++) rows[r] = m->act + (int64_t)(p + r) * I;
                dot_rows(w, rows, nr, I, y);
                for (int r = 0; r < nr; r++) {
                    float *o = m->out + (int64_t)m->tok[p + r] * H + h;
                    const float contrib = y[r] * m->wt[p + r];
                    *o = *o + contrib;
                }
            }
        }
    }
}

/* Phase `phase`'s share of thread t of `threads`. */
static void run(const void *ctx, int phase, int t, int threads) {
    const moe_t *m = (const moe_t *)ctx;
    const int64_t n = phase == 1 ? (int64_t)m->n_active * m->I : m->H;
    const int64_t lo = n * t / threads, hi = n * (t + 1) / threads;
    if (phase == 1)
        gate_up_units(m, lo, hi);
    else
        down_units(m, lo, hi);
}

/* Returns 0 on success, -2 when out of memory. Pairs whose expert is outside [0, E) are another
 * rank's (expert parallelism: the caller numbers its own experts from 0) and are skipped. */
int moe_experts(const float *x, const float *gate_up, const float *down, const int64_t *ids, const float *weights,
                float *out, int T, int k, int E, int H, int I, int threads) {
    pd_pairs_t pairs;
    if (pd_pairs_sort(ids, weights, T, k, E, &pairs) != 0) return -2;
    const int32_t kept = pairs.start[E];
    float *act = malloc(sizeof(float) * (size_t)(kept ? kept : 1) * (size_t)I);
    if (!act) {
        pd_pairs_free(&pairs);
        return -2;
    }
    memset(out, 0, sizeof(float) * (size_t)T * (size_t)H);
    moe_t m = {x, gate_up, down, pairs.tok, pairs.wt, pairs.start, pairs.active, pairs.n_active, H, I, act, out};
    pd_parallel_phase(run, &m, 1, threads);
    pd_parallel_phase(run, &m, 2, threads);
    free(act);
    pd_pairs_free(&pairs);
    return 0;
}
