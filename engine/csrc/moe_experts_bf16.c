/* A mixture-of-experts layer's routed experts in one call, bfloat16 weights and activations,
 * float32 accumulation: Intel AMX tiles where the CPU has them (one 16x32 by 32x16 tile product
 * per instruction), else the same arithmetic in portable C.
 *
 * Weights are prepacked once at load (engine/models/moe_packed.py) in the tiles' layout: a weight
 * W[N][K] (out = x W^T) becomes W'[N/16][K/32][16][16][2] with
 *   W'[nb][kb][kk][n][j] = W[nb*16 + n][kb*32 + 2*kk + j],
 * so each 16-column, 32-deep block is one 1 KiB tile, read in order. gate_up[E] is (2I, H): gate
 * rows, then up rows; down[E] is (H, I). Requires H % 32 == 0 and I % 32 == 0.
 *
 * The (token, expert) pairs are grouped by expert (moe_pairs.c); each chosen expert's tokens are
 * gathered into rows padded to a multiple of 16 (the padding is zero), and an expert no token chose
 * is never read. Three phases, each split over `threads` threads:
 *   0. gather: x rows into each expert's padded row block;
 *   1. units (expert, 32 intermediate columns): gate and up for 16 rows at a time, then
 *      silu(gate) * up, rounded to bfloat16 at each step as torch's bfloat16 ops round;
 *   2. units (64 output columns): for each expert in ascending order, act . down^T, times each
 *      pair's router weight, summed into a float32 row per token, rounded to bfloat16 at the end.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_tiles.h"
#include "kernels.h"
#include "moe_pairs.h"
#include "parallel.h"

typedef struct {
    const uint16_t *x, *gate_up, *down;
    const pd_pairs_t *p;
    const int32_t *row0;  /* expert -> its first padded row; row0[E] = all padded rows */
    int T, H, I, amx;
    uint16_t *xs, *act;   /* padded rows: gathered x (rows x H), activations (rows x I) */
    float *acc;           /* T x H */
    uint16_t *out;
} moe_t;

/* Portable: c[r][n] += a[r] . W[n] over one 32-deep block, for the first `rows` rows, reading the
 * packed tile `b` as an AMX tile product would. */
static void tile_dot(float c[TILE][TILE], const uint16_t *a, int lda, const uint16_t *b, int rows) {
    for (int r = 0; r < rows; r++) {
        const uint16_t *ar = a + (int64_t)r * lda;
        for (int kk = 0; kk < DEPTH / 2; kk++) {
            const float a0 = bf2f(ar[2 * kk]), a1 = bf2f(ar[2 * kk + 1]);
            const uint16_t *bk = b + kk * 2 * TILE;
            for (int n = 0; n < TILE; n++) c[r][n] += a0 * bf2f(bk[2 * n]) + a1 * bf2f(bk[2 * n + 1]);
        }
    }
}

/* The packed tile (nb, kb) of an expert's weight with K columns. */
static inline const uint16_t *tile_at(const uint16_t *w, int nb, int kb, int K) {
    return w + ((int64_t)nb * (K / DEPTH) + kb) * (DEPTH * TILE);
}

/* c[t] = a . W[nbs[t]]^T over K for the nt <= 4 column tiles nbs of a packed weight w, `rows` real
 * rows of a (16 read: the padding is zero); the tiles' products, or the same in portable C. */
static void tile_products(const moe_t *m, float c[4][TILE][TILE], const uint16_t *a, const uint16_t *w,
                          const int nbs[4], int nt, int K, int rows) {
    const int kbs = K / DEPTH;
#ifdef PD_AMX
    if (m->amx) {
        pd_tiles_zero4();
        for (int kb = 0; kb < kbs; kb++) { /* A in tile 4, weights through 5-7, sums in 0-3 */
            const uint16_t *b[4] = {tile_at(w, nbs[0], kb, K), tile_at(w, nbs[1], kb, K), tile_at(w, nbs[2], kb, K),
                                    tile_at(w, nbs[3], kb, K)};
            pd_tiles_dp4(a + kb * DEPTH, K * 2, b, nt);
        }
        pd_tiles_store4(c);
        return;
    }
#else
    (void)m;
#endif
    memset(c, 0, sizeof(float) * 4 * TILE * TILE);
    for (int kb = 0; kb < kbs; kb++)
        for (int t = 0; t < nt; t++) tile_dot(c[t], a + kb * DEPTH, K, tile_at(w, nbs[t], kb, K), rows);
}

/* Phase 1, unit (slot, jb): intermediate columns [32 jb, 32 jb + 32) of one expert, all its rows. */
static void gate_up_unit(const moe_t *m, int slot, int jb) {
    const int H = m->H, I = m->I, e = m->p->active[slot];
    const uint16_t *w = m->gate_up + (int64_t)e * 2 * I * H;
    const int nbs[4] = {2 * jb, 2 * jb + 1, I / TILE + 2 * jb, I / TILE + 2 * jb + 1}; /* gate, gate, up, up */
    const int real = m->p->start[e + 1] - m->p->start[e];
    float c[4][TILE][TILE];
    for (int r0 = 0; r0 < real; r0 += TILE) {
        const int rows = real - r0 < TILE ? real - r0 : TILE;
        tile_products(m, c, m->xs + (int64_t)(m->row0[e] + r0) * H, w, nbs, 4, H, rows);
        for (int r = 0; r < rows; r++) {
            uint16_t *o = m->act + (int64_t)(m->row0[e] + r0 + r) * I + jb * 2 * TILE;
            float g[2 * TILE], u[2 * TILE], y[2 * TILE];
            for (int n = 0; n < TILE; n++) {
                g[n] = round_bf(c[0][r][n]), g[TILE + n] = round_bf(c[1][r][n]);
                u[n] = round_bf(c[2][r][n]), u[TILE + n] = round_bf(c[3][r][n]);
            }
            for (int n = 0; n < 2 * TILE; n++) y[n] = round_bf(round_bf(g[n] / (1.f + exp_f(-g[n]))) * u[n]);
            for (int n = 0; n < 2 * TILE; n++) o[n] = f2bf(y[n]);
        }
    }
}

/* Phase 2, unit u: output columns [64 u, 64 u + 64) (fewer at the end), every expert in order. */
static void down_unit(const moe_t *m, int u) {
    const int H = m->H, I = m->I, nb0 = 4 * u;
    const int nt = H / TILE - nb0 < 4 ? H / TILE - nb0 : 4;
    const int nbs[4] = {nb0, nb0 + 1, nb0 + 2, nb0 + 3};
    float c[4][TILE][TILE];
    for (int s = 0; s < m->p->n_active; s++) {
        const int e = m->p->active[s], first = m->p->start[e], real = m->p->start[e + 1] - first;
        for (int r0 = 0; r0 < real; r0 += TILE) {
            const int rows = real - r0 < TILE ? real - r0 : TILE;
            tile_products(m, c, m->act + (int64_t)(m->row0[e] + r0) * I, m->down + (int64_t)e * H * I, nbs, nt, I, rows);
            for (int r = 0; r < rows; r++) {
                const int pair = first + r0 + r;
                const float wt = m->p->wt[pair];
                float *acc = m->acc + (int64_t)m->p->tok[pair] * H + nb0 * TILE;
                for (int t = 0; t < nt; t++)
                    for (int n = 0; n < TILE; n++) acc[t * TILE + n] += round_bf(c[t][r][n]) * wt;
            }
        }
    }
    for (int tok = 0; tok < m->T; tok++)
        for (int col = nb0 * TILE; col < (nb0 + nt) * TILE; col++)
            m->out[(int64_t)tok * H + col] = f2bf(m->acc[(int64_t)tok * H + col]);
}

static void gather_unit(const moe_t *m, int slot) {
    const int e = m->p->active[slot], H = m->H, first = m->p->start[e], real = m->p->start[e + 1] - first;
    const int padded = (real + TILE - 1) / TILE * TILE;
    for (int r = 0; r < padded; r++) {
        uint16_t *dst = m->xs + (int64_t)(m->row0[e] + r) * H;
        if (r < real)
            memcpy(dst, m->x + (int64_t)m->p->tok[first + r] * H, sizeof(uint16_t) * (size_t)H);
        else
            memset(dst, 0, sizeof(uint16_t) * (size_t)H);
    }
}

/* Phase `phase`'s share of thread t of `threads`. */
static void run(const void *ctx, int phase, int t, int threads) {
    const moe_t *m = (const moe_t *)ctx;
    const int64_t n = phase == 0 ? m->p->n_active
                      : phase == 1 ? (int64_t)m->p->n_active * (m->I / DEPTH)
                                   : (m->H / TILE + 3) / 4;
    const int64_t lo = n * t / threads, hi = n * (t + 1) / threads;
#ifdef PD_AMX
    if (m->amx && phase > 0) pd_tiles_on();
#endif
    for (int64_t u = lo; u < hi; u++) {
        if (phase == 0)
            gather_unit(m, (int)u);
        else if (phase == 1)
            gate_up_unit(m, (int)(u / (m->I / DEPTH)), (int)(u % (m->I / DEPTH)));
        else
            down_unit(m, (int)u);
    }
#ifdef PD_AMX
    if (m->amx && phase > 0) _tile_release();
#endif
}

/* x[T][H], out[T][H] bfloat16; ids/weights as moe_experts (float32 weights; experts outside
 * [0, E) are another rank's and skipped). `amx`: use the tiles (only where pd_amx_ready()).
 * Returns 0, -1 for shapes the layout cannot hold, -2 when out of memory. */
int moe_experts_bf16(const uint16_t *x, const uint16_t *gate_up, const uint16_t *down, const int64_t *ids,
                     const float *weights, uint16_t *out, int T, int k, int E, int H, int I, int threads, int amx) {
    if (H % DEPTH || I % DEPTH || H <= 0 || I <= 0) return -1;
    if (amx && !pd_amx_ready()) return -1;
    pd_pairs_t p;
    if (pd_pairs_sort(ids, weights, T, k, E, &p) != 0) return -2;
    int32_t *row0 = malloc(sizeof(int32_t) * ((size_t)E + 1));
    if (!row0) {
        pd_pairs_free(&p);
        return -2;
    }
    row0[0] = 0;
    for (int e = 0; e < E; e++) row0[e + 1] = row0[e] + (p.start[e + 1] - p.start[e] + TILE - 1) / TILE * TILE;
    const size_t rows = row0[E] ? (size_t)row0[E] : 1;
    uint16_t *xs = malloc(sizeof(uint16_t) * rows * (size_t)H), *act = malloc(sizeof(uint16_t) * rows * (size_t)I);
    float *acc = calloc((size_t)T * (size_t)H + 1, sizeof(float));
    int rc = 0;
    if (!xs || !act || !acc) {
        rc = -2;
        goto done;
    }
    moe_t m = {x, gate_up, down, &p, row0, T, H, I, amx, xs, act, acc, out};
    for (int phase = 0; phase < 3; phase++) pd_parallel_phase(run, &m, phase, threads);
done:
    free(xs), free(act), free(acc), free(row0);
    pd_pairs_free(&p);
    return rc;
}
