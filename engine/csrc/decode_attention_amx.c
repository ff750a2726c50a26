/* Decode attention from a bfloat16 paged cache on Intel AMX tiles: a sequence's query rows of one
 * KV head (up to 16 at a time, the rows of a tile) against all its keys as tile products, scores
 * and softmax in float32, probabilities rounded to bfloat16 for the value product, sums in float32.
 * It serves what paged_decode_attention.c serves (same arguments: K/V heads, or a latent cache
 * whose value is each key row's first vd values), where the tiles and the shapes allow it (head
 * width a multiple of 32, value width of 16); the caller keeps the other kernel for the rest.
 *
 * Per unit (sequence i, KV head h, up to 16 of its query rows: fewer when there would be fewer
 * units than threads), tokens [start, n):
 *   1. the key rows gathered from the blocks into rows of a buffer, zero-padded to 32 tokens;
 *      the query rows packed once as the tile product's second operand (pairs of dims
 *      interleaved), so each 16-token tile of keys times them gives 16 x 16 scores;
 *   2. softmax over each query row's scores (exact: the maximum over all of them first);
 *   3. the value rows packed in pairs of tokens, 16 dims a tile; 32 tokens of probabilities times
 *      them, summed over the tokens in four output tiles (64 dims) at a time.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_tiles.h"
#include "kernels.h"
#include "parallel.h"

typedef struct {
    const uint16_t *q, *k, *v;
    const int64_t *tables, *ctx, *starts;
    float *out;
    int64_t q_stride; /* values from one sequence's query heads to the next's */
    int b, kvh, group, hd, vd, bs, max_blocks, row_groups;
    float scale;
    int *failed; /* set when a unit could not allocate its buffers */
} att_t;

#ifdef PD_AMX
/* The cache row of token t of sequence i, head h (hd values apart per head, kvh heads per token). */
static inline const uint16_t *cache_row(const att_t *a, const uint16_t *base, int i, int64_t t, int h) {
    const int64_t block = a->tables[(int64_t)i * a->max_blocks + t / a->bs];
    return base + ((block * a->bs + t % a->bs) * a->kvh + h) * a->hd;
}

/* Returns 0, or -2 when out of memory. */
static int one_unit(const att_t *a, int i, int h, int g0, int rows) {
    const int hd = a->hd, vd = a->vd, H = a->kvh * a->group;
    const int64_t n = a->ctx[i], first = a->starts ? a->starts[i] : 0, L = n - first, Lp = (L + 31) / 32 * 32;
    uint16_t *keys = calloc((size_t)Lp * hd, 2), *vals = malloc((size_t)Lp * vd * 2);
    uint16_t *qt = calloc((size_t)hd * TILE, 2), *p = calloc((size_t)TILE * Lp, 2);
    float *s = malloc(sizeof(float) * TILE * (size_t)Lp);
    const uint16_t **vrows = malloc(sizeof(uint16_t *) * (size_t)(L ? L : 1));
    int rc = 0;
    if (!keys || !vals || !qt || !p || !s || !vrows) {
        rc = -2;
        goto done;
    }
    for (int64_t t = 0; t < L; t++) memcpy(keys + t * hd, cache_row(a, a->k, i, first + t, h), (size_t)hd * 2);
    /* queries: qt[kb][kk][r][j] = q[r][32 kb + 2 kk + j] */
    for (int r = 0; r < rows; r++) {
        const uint16_t *qr = a->q + (int64_t)i * a->q_stride + ((int64_t)h * a->group + g0 + r) * hd;
        for (int d = 0; d < hd; d++) qt[((d / DEPTH) * (DEPTH / 2) + (d % DEPTH) / 2) * 2 * TILE + r * 2 + d % 2] = qr[d];
    }
    /* 1. scores, 16 tokens at a time */
    float c[4][TILE][TILE];
    for (int64_t t0 = 0; t0 < Lp; t0 += TILE) {
        _tile_zero(0);
        for (int kb = 0; kb < hd / DEPTH; kb++) {
            _tile_loadd(4, keys + t0 * hd + kb * DEPTH, hd * 2);
            _tile_loadd(5, qt + (int64_t)kb * DEPTH * TILE, 64);
            _tile_dpbf16ps(0, 4, 5);
        }
        _tile_stored(0, c[0], 64);
        for (int tt = 0; tt < TILE; tt++)
            for (int r = 0; r < TILE; r++) s[(int64_t)r * Lp + t0 + tt] = c[0][tt][r] * a->scale;
    }
    /* 2. softmax per query row over its L scores; the padding keeps probability 0 */
    float sum[TILE];
    for (int r = 0; r < rows; r++) sum[r] = pd_softmax_row(s + (int64_t)r * Lp, p + (int64_t)r * Lp, L, Lp);
    /* 3. values in pairs of tokens, then the probabilities times them */
    for (int64_t t = 0; t < L; t++) /* a latent cache's value is its key row's start: already gathered */
        vrows[t] = a->v == a->k ? keys + t * hd : cache_row(a, a->v, i, first + t, h);
    pd_pack_values(vals, vrows, L, Lp, vd);
    pd_values_product(p, Lp, vals, vd, rows, sum, a->out + ((int64_t)i * H + (int64_t)h * a->group + g0) * vd, vd);
done:
    free(keys), free(vals), free(qt), free(p), free(s), free(vrows);
    return rc;
}

static void run(const void *ctx, int phase, int t, int threads) {
    const att_t *a = (const att_t *)ctx;
    (void)phase;
    const int per_seq = a->kvh * a->row_groups, units = a->b * per_seq;
    pd_tiles_on();
    for (int u = t; u < units; u += threads) {
        const int i = u / per_seq, h = (u % per_seq) / a->row_groups, rg = u % a->row_groups;
        const int per = (a->group + a->row_groups - 1) / a->row_groups; /* query rows of a unit, <= 16 */
        const int g0 = rg * per, rows = a->group - g0 < per ? a->group - g0 : per;
        if (a->ctx[i] > (a->starts ? a->starts[i] : 0) && one_unit(a, i, h, g0, rows) != 0) *a->failed = 1;
    }
    _tile_release();
}
#endif

/* Arguments as paged_decode_attention's (q_stride included), bfloat16 q and cache. Returns 0, -1
 * when the tiles or the shapes do not serve this call (no AMX, hd % 32, vd % 16), -2 when out of
 * memory. */
int decode_attention_amx(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int64_t *tables, const int64_t *ctx, const int64_t *starts, float *out, int b, int kvh,
                         int group, int hd, int vd, int bs, int max_blocks, float scale, int threads) {
#ifdef PD_AMX
    if (!pd_amx_ready() || hd % DEPTH || vd % TILE || vd > hd || vd < 1 || hd < 1 || threads < 1) return -1;
    int failed = 0, row_groups = (group + TILE - 1) / TILE;
    /* fewer units than threads (one sequence of a latent cache: one KV head): its query rows split
     * further, each unit reading the same keys */
    while (b * kvh * row_groups < threads && row_groups < group) row_groups++;
    att_t a = {q, k_cache, v_cache, tables, ctx, starts, out, q_stride, b, kvh, group, hd, vd, bs, max_blocks,
               row_groups, scale, &failed};
    const int units = b * kvh * a.row_groups;
    pd_parallel_phase(run, &a, 0, threads < units ? threads : units);
    return failed ? -2 : 0;
#else
    (void)q, (void)k_cache, (void)v_cache, (void)tables, (void)ctx, (void)starts, (void)out, (void)b, (void)kvh;
    (void)group, (void)hd, (void)vd, (void)bs, (void)max_blocks, (void)scale, (void)threads;
    return -1;
#endif
}
