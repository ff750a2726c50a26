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
 *   1. units (expert, 16 or 32 intermediate columns): gate and up for its rows, then
 *      silu(gate) * up, rounded to bfloat16 at each step as torch's bfloat16 ops round; the
 *      threads' shares are split by rows, not units (a prefill's experts get from 0 to 6x the
 *      mean of its tokens);
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
    int tiles;            /* column tiles of a unit: 2 (32 rows at a time), or 4 (16 rows) for decode */
    uint16_t *xs, *act;   /* padded rows: gathered x (rows x H), activations (rows x I) */
    float *acc;           /* T x H */
    uint16_t *out;
    int64_t split[PD_MAX_THREADS + 1]; /* phase 1: thread t runs units [split[t], split[t + 1]) */
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

/* One block of sums and where it goes: c[2 h + t] holds row tile h by column tile t of `rows` rows
 * from row r0 of expert e's block; col: the first column tile (phase 1: the gate tile). A thread
 * keeps two: the tiles compute one while the vector units finish the other (pipeline_t). */
typedef struct {
    float c[4][TILE][TILE];
    int e, r0, rows, col;
} block_t;

typedef struct {
    block_t b[2];
    int n; /* blocks issued; block n - 1 (b[(n - 1) & 1]) is the one still to finish */
} pipeline_t;

typedef void (*finish_fn)(const moe_t *, const block_t *, int, int);

/* c[2 h + t] = rows [16 h, 16 h + 16) of a times W[nbs[t]]^T over K, for the packed weight w's
 * column tiles nbs[0, nt), `rows` real rows of a (the rest of their 16 or 32 is zero padding) K
 * apart; and, between the tiles' products, `finish` of the block `prev` (when not NULL) a few rows
 * at a time: the vector units work while the tiles compute (all of it after the products would
 * only overlap as far as the reorder buffer reaches). On the tiles the sums stay in the tile
 * registers (tile_finish stores them); in portable C they are computed here. Two shapes of four
 * sums: up to 16 rows by up to four column tiles (each row tile loaded once for four products), or
 * up to 32 rows by up to two (each weight tile loaded once for two: with many rows the weight tiles
 * are what the loads wait for). */
static inline __attribute__((always_inline)) void tile_issue(const moe_t *m, float c[4][TILE][TILE],
                                                             const uint16_t *a, const uint16_t *w, const int nbs[4],
                                                             int nt, int K, int rows, finish_fn finish,
                                                             const block_t *prev) {
    const int kbs = K / DEPTH;
#ifdef PD_AMX
    if (m->amx) {
        const int slice = prev ? (prev->rows + kbs - 1) / kbs : 0;
        pd_tiles_zero4();
        for (int kb = 0; kb < kbs; kb++) {
            if (rows > TILE) {
                pd_tiles_dp22(a + kb * DEPTH, a + (int64_t)TILE * K + kb * DEPTH, K * 2, tile_at(w, nbs[0], kb, K),
                              nt > 1 ? tile_at(w, nbs[1], kb, K) : NULL);
            } else {
                const uint16_t *b[4] = {tile_at(w, nbs[0], kb, K), tile_at(w, nbs[1 % nt], kb, K),
                                        tile_at(w, nbs[2 % nt], kb, K), tile_at(w, nbs[3 % nt], kb, K)};
                pd_tiles_dp4(a + kb * DEPTH, K * 2, b, nt);
            }
            if (prev && kb * slice < prev->rows)
                finish(m, prev, kb * slice, (kb + 1) * slice < prev->rows ? (kb + 1) * slice : prev->rows);
        }
        return;
    }
#endif
    memset(c, 0, sizeof(float) * 4 * TILE * TILE);
    for (int kb = 0; kb < kbs; kb++)
        for (int h = 0; h * TILE < rows; h++)
            for (int t = 0; t < nt; t++)
                tile_dot(c[2 * h + t], a + (int64_t)h * TILE * K + kb * DEPTH, K, tile_at(w, nbs[t], kb, K),
                         rows - h * TILE < TILE ? rows - h * TILE : TILE);
    if (prev) finish(m, prev, 0, prev->rows);
}

static void tile_finish(const moe_t *m, float c[4][TILE][TILE]) {
#ifdef PD_AMX
    if (m->amx) pd_tiles_store4(c);
#else
    (void)m, (void)c;
#endif
}

/* Phase 1's vector half of a block's rows [lo, hi): silu(gate) * up, rounded to bfloat16 at each step as torch's
 * bfloat16 ops round, into the activations. */
static inline void activate(const moe_t *m, const block_t *b, int lo, int hi) {
    const int I = m->I, half = m->tiles / 2;
    for (int r = lo; r < hi; r++)
        for (int q = 0; q < half; q++) {
            const float *gc = b->c[2 * (r / TILE + q)][r % TILE], *uc = b->c[2 * (r / TILE + q) + 1][r % TILE];
            uint16_t *o = m->act + (int64_t)(m->row0[b->e] + b->r0 + r) * I + (b->col + q) * TILE;
            for (int n = 0; n < TILE; n++) {
                const float g = round_bf(gc[n]), u = round_bf(uc[n]);
                o[n] = bf_bits(round_bf(round_bf(g / (1.f + exp_f(-g))) * u));
            }
        }
}

/* Phase 2's vector half of a block's rows [lo, hi): each row's products, rounded to bfloat16, times its pair's
 * router weight, added to its token's float32 sums. */
static inline void accumulate(const moe_t *m, const block_t *b, int lo, int hi) {
    const int H = m->H, nt = H / TILE - b->col < 4 ? H / TILE - b->col : 4, first = m->p->start[b->e];
    for (int r = lo; r < hi; r++) {
        const int pair = first + b->r0 + r;
        const float wt = m->p->wt[pair];
        float *acc = m->acc + (int64_t)m->p->tok[pair] * H + b->col * TILE;
        for (int t = 0; t < nt; t++)
            for (int n = 0; n < TILE; n++) acc[t * TILE + n] += round_bf(b->c[2 * (r / TILE) + t][r % TILE][n]) * wt;
    }
}

/* The next block through the pipeline: its products issued, the block before it (maybe another
 * unit's) finished meanwhile, its sums stored. */
static inline __attribute__((always_inline)) void pipeline_push(const moe_t *m, pipeline_t *pl, finish_fn finish,
                                                                const uint16_t *a, const uint16_t *w,
                                                                const int nbs[4], int nt, int K, int e, int r0,
                                                                int rows, int col) {
    block_t *cur = &pl->b[pl->n & 1];
    tile_issue(m, cur->c, a, w, nbs, nt, K, rows, finish, pl->n > 0 ? &pl->b[(pl->n - 1) & 1] : NULL);
    tile_finish(m, cur->c);
    cur->e = e, cur->r0 = r0, cur->rows = rows, cur->col = col;
    pl->n++;
}

/* The last block's vector half; the pipeline is then empty. */
static void pipeline_drain(const moe_t *m, pipeline_t *pl, finish_fn finish) {
    if (pl->n > 0) finish(m, &pl->b[(pl->n - 1) & 1], 0, pl->b[(pl->n - 1) & 1].rows);
    pl->n = 0;
}

/* Phase 1, unit (slot, jb): `m->tiles` / 2 tiles of intermediate columns from that many times jb,
 * of one expert, all its rows: with many rows (a prefill) one tile of gate and up columns, 32 rows
 * at a time, so the unit's weight tiles (2 x H/32 KiB: 40 KiB at H = 640) stay in the first-level
 * cache while the rows stream past them; when no expert has more than 16 rows (a decode step), two
 * tiles of each, 16 rows. */
static void gate_up_unit(const moe_t *m, pipeline_t *pl, int slot, int jb) {
    const int H = m->H, I = m->I, e = m->p->active[slot], step = 64 / m->tiles;
    const int g0 = jb * (m->tiles / 2), u0 = I / TILE + g0; /* first gate and up column tiles */
    const int nbs[4] = {g0, u0, g0 + 1, u0 + 1};  /* gate and up tile pairs: c[2 (h + q)], c[2 (h + q) + 1] */
    const int real = m->p->start[e + 1] - m->p->start[e];
    for (int r0 = 0; r0 < real; r0 += step)
        pipeline_push(m, pl, activate, m->xs + (int64_t)(m->row0[e] + r0) * H, m->gate_up + (int64_t)e * 2 * I * H,
                      nbs, m->tiles, H, e, r0, real - r0 < step ? real - r0 : step, g0);
}

/* Phase 2, unit u: output columns [64 u, 64 u + 64) (fewer at the end), every expert in order, 16
 * rows at a time. Here the activations are what streams (every unit reads all of them) and an
 * expert's weight tiles for the unit (32 KiB at I = 256) stay put: four column tiles a row tile
 * beat two by two row tiles (a prefill layer of moe-400m: 4.3 against 5.2 ms). */
static void down_unit(const moe_t *m, pipeline_t *pl, int u) {
    const int H = m->H, I = m->I, nb0 = 4 * u;
    const int nt = H / TILE - nb0 < 4 ? H / TILE - nb0 : 4;
    const int nbs[4] = {nb0, nb0 + 1, nb0 + 2, nb0 + 3};
    for (int tok = 0; tok < m->T; tok++) memset(m->acc + (int64_t)tok * H + nb0 * TILE, 0, sizeof(float) * nt * TILE);
    for (int s = 0; s < m->p->n_active; s++) {
        const int e = m->p->active[s], real = m->p->start[e + 1] - m->p->start[e];
        for (int r0 = 0; r0 < real; r0 += TILE)
            pipeline_push(m, pl, accumulate, m->act + (int64_t)(m->row0[e] + r0) * I, m->down + (int64_t)e * H * I,
                          nbs, nt, I, e, r0, real - r0 < TILE ? real - r0 : TILE, nb0);
    }
    pipeline_drain(m, pl, accumulate); /* every sum of the unit's columns in before they are rounded */
    for (int tok = 0; tok < m->T; tok++)
        for (int col = nb0 * TILE; col < (nb0 + nt) * TILE; col++)
            m->out[(int64_t)tok * H + col] = f2bf(m->acc[(int64_t)tok * H + col]);
}

/* Phase 1's units per expert (column tiles of gate and up, m->tiles / 2 of each a unit). */
static inline int units_per_expert(const moe_t *m) { return m->I / TILE / (m->tiles / 2); }

/* m->split for phase 1: contiguous runs of units of about equal cost, a unit costing its 32-row
 * blocks plus one (its weight tiles' first reads). */
static void split_units(moe_t *m, int threads) {
    const int per = units_per_expert(m);
    int64_t total = 0, done = 0;
    for (int s = 0; s < m->p->n_active; s++) {
        const int e = m->p->active[s];
        total += (int64_t)per * ((m->row0[e + 1] - m->row0[e]) / (2 * TILE) + 1);
    }
    int t = 1;
    m->split[0] = 0;
    for (int s = 0; s < m->p->n_active && t < threads; s++) {
        const int e = m->p->active[s];
        const int64_t cost = (m->row0[e + 1] - m->row0[e]) / (2 * TILE) + 1;
        for (int j = 0; j < per && t < threads; j++) {
            done += cost;
            while (t < threads && done * threads >= total * t) m->split[t++] = (int64_t)s * per + j + 1;
        }
    }
    for (; t <= threads; t++) m->split[t] = (int64_t)m->p->n_active * per;
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
    const int per = units_per_expert(m);
    const int64_t n = phase == 0 ? m->p->n_active : phase == 1 ? (int64_t)m->p->n_active * per : (m->H / TILE + 3) / 4;
    const int64_t lo = phase == 1 ? m->split[t] : n * t / threads;
    const int64_t hi = phase == 1 ? m->split[t + 1] : n * (t + 1) / threads;
    pipeline_t pl;
    pl.n = 0;
#ifdef PD_AMX
    if (m->amx && phase > 0) pd_tiles_on();
#endif
    for (int64_t u = lo; u < hi; u++) {
        if (phase == 0)
            gather_unit(m, (int)u);
        else if (phase == 1)
            gate_up_unit(m, &pl, (int)(u / per), (int)(u % per));
        else
            down_unit(m, &pl, (int)u);
    }
    if (phase == 1) pipeline_drain(m, &pl, activate);
#ifdef PD_AMX
    if (m->amx && phase > 0) _tile_release();
#endif
}

/* The calling thread's scratch memory of at least `bytes`, kept from call to call (NULL when out of
 * memory). A prefill's gathered rows are tens of megabytes: allocated afresh, their pages were
 * faulted in again on every call (up to half the layer's time). Kept, they cost that much memory
 * for as long as the thread lives. */
static void *scratch(size_t bytes) {
    static __thread void *mem;
    static __thread size_t held;
    if (bytes > held) {
        free(mem);
        held = (bytes + ((size_t)1 << 20) - 1) & ~(((size_t)1 << 20) - 1);
        mem = aligned_alloc(64, held);
        if (!mem) held = 0;
    }
    return mem;
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
    const size_t xs_bytes = (sizeof(uint16_t) * rows * (size_t)H + 63) / 64 * 64;
    const size_t act_bytes = (sizeof(uint16_t) * rows * (size_t)I + 63) / 64 * 64;
    char *ws = scratch(xs_bytes + act_bytes + sizeof(float) * ((size_t)T * (size_t)H + 1));
    if (!ws) {
        free(row0);
        pd_pairs_free(&p);
        return -2;
    }
    uint16_t *xs = (uint16_t *)ws, *act = (uint16_t *)(ws + xs_bytes);
    float *acc = (float *)(ws + xs_bytes + act_bytes);
    if (threads < 1) threads = 1;
    if (threads > PD_MAX_THREADS) threads = PD_MAX_THREADS;
    int most = 0; /* the most rows an expert has */
    for (int e = 0; e < E; e++) most = row0[e + 1] - row0[e] > most ? row0[e + 1] - row0[e] : most;
    moe_t m = {x, gate_up, down, &p, row0, T, H, I, amx, most > TILE ? 2 : 4, xs, act, acc, out, {0}};
    split_units(&m, threads);
    for (int phase = 0; phase < 3; phase++) pd_parallel_phase(run, &m, phase, threads);
    free(row0);
    pd_pairs_free(&p);
    return 0;
}
