/* Linear layers on the CPU's vector units: out[T][N] = x[T][K] . W^T (+ bias), float32, or
 * bfloat16 with float32 sums rounded once (as torch's bfloat16 linear rounds).
 *
 * W is prepacked at load into panels of 64 output columns (engine/linear_panels.py): panel p holds
 * columns [64p, 64p + w) with w = min(64, N16 - 64p), N16 = N rounded up to 16 (the pad columns
 * are zeros), laid out k by k: float32 [K][w]; bfloat16 [K/2][w][2], two k values of a column side
 * by side (the operand of AVX-512 BF16's pair dot product). Panel p starts at 64 p K values.
 *
 * A panel is streamed once per block of MR rows of x, in chunks of KC values of k so a chunk read
 * by the first row block is still in the core's caches for the others: for a decode batch (T up to
 * MR) the weight is read from memory exactly once, at the speed the multiply-adds allow (a
 * broadcast of one x value against four vectors of the panel's row, MR x 4 accumulators). Panels
 * are split between threads (torch's OpenMP threads where built with OpenMP), contiguous ranges.
 *
 * Served: AVX-512F (float32), AVX-512 BF16 (bfloat16), AVX2 + FMA (float32). Elsewhere the entry
 * points return -1 and the caller keeps oneDNN. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_tiles.h"
#include "panel_tiles.h"
#include "parallel.h"

#define KC 256 /* values of k per chunk */

#ifdef PD_VEC
typedef struct {
    const void *x, *w, *bias;
    void *out;
    float *scratch; /* T x PANEL float32 sums per thread */
    int64_t x_stride;
    int T, K, N, bf16;
    int swiglu; /* panels of 32 gate then 32 up columns; out holds silu(gate) * up, N/2 columns */
} panels_t;

/* Rows [r0, r0 + rows) of columns [col, col + cols) from the float32 sums (PANEL apart) into out. */
static void finish(const panels_t *l, const float *c, int r0, int rows, int col, int cols) {
    for (int r = 0; r < rows; r++) {
        const float *cr = c + r * PANEL;
        if (l->bf16) {
            uint16_t *o = (uint16_t *)l->out + (int64_t)(r0 + r) * l->N + col;
            const uint16_t *bias = l->bias != NULL ? (const uint16_t *)l->bias + col : NULL;
            for (int n = 0; n < cols; n++) o[n] = f2bf(cr[n] + (bias != NULL ? bf2f(bias[n]) : 0.0f));
        } else {
            float *o = (float *)l->out + (int64_t)(r0 + r) * l->N + col;
            const float *bias = l->bias != NULL ? (const float *)l->bias + col : NULL;
            for (int n = 0; n < cols; n++) o[n] = cr[n] + (bias != NULL ? bias[n] : 0.0f);
        }
    }
}

/* SwiGLU from a panel of 32 gate columns then the same 32 up columns: out[r][col/2 + j] =
 * silu(gate) * up, rounded as torch rounds its three steps in bfloat16 (the linear's output, silu's,
 * the product's). out is T x N/2. */
static void finish_swiglu(const panels_t *l, const float *c, int col) {
    const int half = PANEL / 2;
    for (int r = 0; r < l->T; r++) {
        const float *cr = c + r * PANEL;
        if (l->bf16) {
            uint16_t *o = (uint16_t *)l->out + (int64_t)r * (l->N / 2) + col / 2;
            for (int n = 0; n < half; n++) {
                const float g = round_bf(cr[n]), u = round_bf(cr[half + n]);
                o[n] = f2bf(round_bf(g / (1.0f + exp_f(-g))) * u);
            }
        } else {
            float *o = (float *)l->out + (int64_t)r * (l->N / 2) + col / 2;
            for (int n = 0; n < half; n++) o[n] = cr[n] / (1.0f + exp_f(-cr[n])) * cr[half + n];
        }
    }
}

/* Columns of one panel against every row of x: row blocks of PD_MR within each chunk of k. */
static void panel(const panels_t *l, int p, float *c) {
    const int n16 = (l->N + 15) / 16 * 16, ws = n16 - PANEL * p < PANEL ? n16 - PANEL * p : PANEL;
    const int cols = l->N - PANEL * p < PANEL ? l->N - PANEL * p : PANEL;
    const int esize = l->bf16 ? 2 : 4;
    const char *w = (const char *)l->w + (int64_t)PANEL * p * l->K * esize;
    for (int v0 = 0; v0 < ws; v0 += NV * PD_VEC) { /* AVX2: two halves of 32 columns */
        const int nv = (ws - v0 < NV * PD_VEC ? ws - v0 : NV * PD_VEC) / PD_VEC;
        for (int k0 = 0; k0 < l->K; k0 += KC) {
            const int k1 = l->K - k0 < KC ? l->K : k0 + KC;
            /* every row block brings in a share of the next KC rows of the weight (this panel's next
             * chunk, or the next panel) while it computes on this chunk: the row blocks after the
             * first read the chunk from the caches, and the memory stream overlaps their work */
            const int blocks = (l->T + PD_MR - 1) / PD_MR;
            const char *pf = w + (int64_t)k1 * ws * esize;
            const int steps = (k1 - k0) / (l->bf16 ? 2 : 1); /* of a tile's k loop */
            const int pf_lines = v0 == 0 ? (KC * ws * esize / 64 + blocks * steps - 1) / (blocks * steps) : 0;
            for (int b = 0; b < blocks; b++) { /* rows split evenly: 16 rows are 6 + 5 + 5 */
                const int r0 = l->T * b / blocks, mr = l->T * (b + 1) / blocks - r0;
                const int lines = pf_lines;
                float *cr = c + r0 * PANEL + v0;
                if (l->bf16) {
#ifdef PD_BF16_PANELS
                    tile_bf16_any((const uint16_t *)l->x + r0 * l->x_stride, l->x_stride,
                                  (const uint16_t *)w + v0 * 2, ws, k0, k1, cr, PANEL, mr, nv, k0 == 0, pf, lines);
#endif
                } else {
                    tile_f32_any((const float *)l->x + r0 * l->x_stride, l->x_stride, (const float *)w + v0, ws, k0,
                                 k1, cr, PANEL, mr, nv, k0 == 0, pf, lines);
                }
                if (lines) pf += (int64_t)lines * 64 * steps;
            }
        }
    }
    if (l->swiglu)
        finish_swiglu(l, c, PANEL * p);
    else
        finish(l, c, 0, l->T, PANEL * p, cols);
}

static void run(const void *ctx, int phase, int t, int threads) {
    (void)phase;
    const panels_t *l = (const panels_t *)ctx;
    const int panels = (l->N + PANEL - 1) / PANEL;
    float *c = l->scratch + (int64_t)t * l->T * PANEL;
    for (int p = (int)((int64_t)panels * t / threads); p < (int)((int64_t)panels * (t + 1) / threads); p++)
        panel(l, p, c);
}
#endif

/* x: T rows of K values (float32, or bfloat16 when `bf16`), `x_stride` values apart; w packed as
 * above; bias N values or NULL; out: T x N, contiguous. `swiglu`: the panels pair 32 gate columns
 * with 32 up columns (N a multiple of 64, no bias) and out, T x N/2, gets silu(gate) * up. Returns
 * 0; -1 where this CPU or dtype is not served (or K is odd in bfloat16); -2 when out of memory. */
int pd_linear_panels(const void *x, int64_t x_stride, const void *w, const void *bias, void *out, int T, int K, int N,
                     int bf16, int swiglu, int threads) {
#ifdef PD_VEC
#ifndef PD_BF16_PANELS
    if (bf16) return -1;
#endif
    if (K <= 0 || N <= 0 || T < 0 || threads < 1 || (bf16 && K % 2) || (swiglu && (N % PANEL || bias))) return -1;
    if (T == 0) return 0;
    const int panels = (N + PANEL - 1) / PANEL;
    if (threads > panels) threads = panels;
    if (threads > PD_MAX_THREADS) threads = PD_MAX_THREADS;
    float *scratch = aligned_alloc(64, (size_t)threads * T * PANEL * sizeof(float));
    if (scratch == NULL) return -2;
    const panels_t l = {x, w, bias, out, scratch, x_stride, T, K, N, bf16, swiglu};
    pd_parallel_phase(run, &l, 0, threads);
    free(scratch);
    return 0;
#else
    (void)x, (void)x_stride, (void)w, (void)bias, (void)out, (void)T, (void)K, (void)N, (void)bf16, (void)swiglu;
    (void)threads;
    return -1;
#endif
}

/* What pd_linear_panels serves on this build: bit 0 float32, bit 1 bfloat16. */
int pd_linear_panels_dtypes(void) {
#if defined(PD_VEC) && defined(PD_BF16_PANELS)
    return 3;
#elif defined(PD_VEC)
    return 1;
#else
    return 0;
#endif
}
