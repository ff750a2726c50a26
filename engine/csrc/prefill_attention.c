/* Causal attention of a prompt's queries over its keys (a prefill, or a chunk of one after `offset`
 * cached keys), flash-attention style on the panel micro-kernels (panel_tiles.h): query i sees keys
 * j <= i + offset. float32, or bfloat16 with float32 scores and sums (the probabilities rounded to
 * bfloat16 before they meet the values, as torch's flash attention rounds them).
 *
 * q[i][h] at q + i q_tok + h q_head (hd values), k[j][g] and v[j][g] likewise (hd and vd values);
 * out[i][h] at out + i o_tok + h o_head (vd values, the queries' dtype). Query heads share key/value
 * heads in groups of H / kvh (grouped-query attention: a key block is read once for the group).
 *
 * Two phases over the threads (torch's OpenMP threads where built with OpenMP):
 *   0. each key head's keys packed transposed in blocks of KB ([hd][KB]; bfloat16 [hd/2][KB][2]),
 *      bfloat16 values in pairs ([KB/2][vd][2]); float32 values are read where they lie;
 *   1. units (key head, QB query tokens), interleaved between threads (later units see more keys):
 *      per key block, scores S = q . K^T for the group's heads, then the online softmax (running max
 *      and sum per row, earlier output rescaled), then O += P . V; out = O / sum at the end. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_tiles.h"
#include "panel_tiles.h"
#include "parallel.h"

#define KB 64 /* keys per block */
#define QB 32 /* query tokens per unit */

#ifdef PD_VEC
typedef struct {
    const void *q, *k, *v;
    void *out;
    int64_t q_tok, q_head, k_tok, k_head, v_tok, v_head, o_tok, o_head;
    int n, nk, H, kvh, hd, vd, offset, bf16;
    float scale;
    char *kt, *vp;        /* packed keys (and bfloat16 values), per key head, block after block */
    float *scratch;       /* per thread: S, O (float32), P (bfloat16), running max and sum */
    int64_t per_thread;   /* floats of scratch per thread */
} attn_t;

static int64_t kt_block(const attn_t *a) { return (int64_t)a->hd * KB; }   /* values of one packed key block */
static int64_t vp_block(const attn_t *a) { return (int64_t)KB * a->vd; }   /* values of one packed value block */

/* c[rows][width] = x[rows][0 .. depth) . w[0 .. depth)[width], rows `xs`, w rows `ws`, c rows `cs`
 * apart (bfloat16: w in pairs, `ws` counts values of a pair row's width). `first`: c is overwritten. */
static void rows_times(const void *x, int64_t xs, const void *w, int ws, int depth, float *c, int cs, int rows,
                       int width, int bf16, int first) {
    for (int c0 = 0; c0 < width; c0 += NV * PD_VEC) {
        const int nv = (width - c0 < NV * PD_VEC ? width - c0 : NV * PD_VEC) / PD_VEC;
        for (int r0 = 0; r0 < rows; r0 += PD_MR) {
            const int mr = rows - r0 < PD_MR ? rows - r0 : PD_MR;
            if (bf16) {
#ifdef PD_BF16_PANELS
                tile_bf16_any((const uint16_t *)x + r0 * xs, xs, (const uint16_t *)w + c0 * 2, ws, 0, depth,
                              c + r0 * cs + c0, cs, mr, nv, first, NULL, 0);
#endif
            } else {
                tile_f32_any((const float *)x + r0 * xs, xs, (const float *)w + c0, ws, 0, depth, c + r0 * cs + c0,
                             cs, mr, nv, first, NULL, 0);
            }
        }
    }
}

/* Phase 0: key head g's block b packed (and its values, in bfloat16). */
static void pack_block(const attn_t *a, int g, int b) {
    const int kn = a->nk - b * KB < KB ? a->nk - b * KB : KB;
    const int64_t blocks = (a->nk + KB - 1) / KB, at = (int64_t)g * blocks + b;
    if (a->bf16) {
        uint16_t *kt = (uint16_t *)a->kt + at * kt_block(a), *vp = (uint16_t *)a->vp + at * vp_block(a);
        const uint16_t *k = (const uint16_t *)a->k + g * a->k_head, *v = (const uint16_t *)a->v + g * a->v_head;
        for (int d = 0; d < a->hd; d += 2)
            for (int j = 0; j < KB; j++)
                for (int e = 0; e < 2; e++)
                    kt[(d / 2) * KB * 2 + j * 2 + e] = j < kn ? k[(int64_t)(b * KB + j) * a->k_tok + d + e] : 0;
        for (int j = 0; j < KB; j += 2)
            for (int c = 0; c < a->vd; c++)
                for (int e = 0; e < 2; e++)
                    vp[(j / 2) * a->vd * 2 + c * 2 + e] = j + e < kn ? v[(int64_t)(b * KB + j + e) * a->v_tok + c] : 0;
    } else {
        float *kt = (float *)a->kt + at * kt_block(a);
        const float *k = (const float *)a->k + g * a->k_head;
        for (int d = 0; d < a->hd; d++)
            for (int j = 0; j < KB; j++) kt[d * KB + j] = j < kn ? k[(int64_t)(b * KB + j) * a->k_tok + d] : 0.0f;
    }
}

/* Phase 1: key head g, query tokens [q0, q1), every query head of g's group. */
static void unit(const attn_t *a, int g, int q0, int q1, float *scratch) {
    const int group = a->H / a->kvh, nq = q1 - q0, rows = group * QB, esize = a->bf16 ? 2 : 4;
    float *S = scratch, *O = S + (int64_t)rows * KB, *mx = O + (int64_t)rows * a->vd, *sum = mx + rows;
    uint16_t *P = (uint16_t *)(sum + rows);
    const int64_t blocks = (a->nk + KB - 1) / KB;
    const int kend = q1 + a->offset < a->nk ? q1 + a->offset : a->nk; /* keys any of these queries sees */
    for (int r = 0; r < rows; r++) mx[r] = -INFINITY, sum[r] = 0.0f;
    memset(O, 0, sizeof(float) * rows * a->vd);
    for (int b = 0; b * KB < kend; b++) {
        const int kn = a->nk - b * KB < KB ? a->nk - b * KB : KB;
        const char *kt = a->kt + ((int64_t)g * blocks + b) * kt_block(a) * esize;
        for (int h = 0; h < group; h++) {
            const char *q = (const char *)a->q + ((int64_t)q0 * a->q_tok + (int64_t)(g * group + h) * a->q_head) * esize;
            rows_times(q, a->q_tok, kt, KB, a->hd, S + (int64_t)h * QB * KB, KB, nq, KB, a->bf16, 1);
        }
        for (int h = 0; h < group; h++)
            for (int i = 0; i < nq; i++) {
                const int r = h * QB + i, last = q0 + i + a->offset - b * KB; /* the last key this row sees */
                const int seen = last + 1 < kn ? last + 1 : kn;
                float *s = S + (int64_t)r * KB;
                if (seen <= 0) { /* a later query's block: nothing for this row */
                    for (int j = 0; j < KB; j++) s[j] = 0.0f;
                    if (a->bf16) memset(P + (int64_t)r * KB, 0, KB * 2);
                    continue;
                }
                for (int j = seen; j < KB; j++) s[j] = -INFINITY; /* pd_vexp makes them exactly 0 */
                const vec_t scale = VSET1(a->scale);
                vec_t vm = VSET1(mx[r]);
                for (int j = 0; j < KB; j += PD_VEC) vm = VMAX(vm, VMUL(VLOAD(s + j), scale));
                const float m = VHMAX(vm), alpha = exp_f(mx[r] - m);
                const vec_t vmax = VSET1(m);
                vec_t total_v = VZERO();
                for (int j = 0; j < KB; j += PD_VEC) {
                    const vec_t p = pd_vexp(VSUB(VMUL(VLOAD(s + j), scale), vmax));
                    VSTORE(s + j, p);
                    total_v = VADD(total_v, p);
                }
                float total = VHSUM(total_v);
                if (a->bf16)
                    for (int j = 0; j < KB; j++) P[(int64_t)r * KB + j] = f2bf(s[j]);
                mx[r] = m;
                sum[r] = sum[r] * alpha + total;
                float *o = O + (int64_t)r * a->vd;
                if (alpha != 1.0f)
                    for (int c = 0; c < a->vd; c++) o[c] *= alpha;
            }
        for (int h = 0; h < group; h++) { /* O += P . V, each head's nq rows */
            float *o = O + (int64_t)h * QB * a->vd;
            if (a->bf16) {
                const char *vp = a->vp + ((int64_t)g * blocks + b) * vp_block(a) * 2;
                rows_times(P + (int64_t)h * QB * KB, KB, vp, a->vd, (kn + 1) / 2 * 2, o, a->vd, nq, a->vd, 1, 0);
            } else {
                const float *v = (const float *)a->v + (int64_t)b * KB * a->v_tok + (int64_t)g * a->v_head;
                rows_times(S + (int64_t)h * QB * KB, KB, v, (int)a->v_tok, kn, o, a->vd, nq, a->vd, 0, 0);
            }
        }
    }
    for (int h = 0; h < group; h++)
        for (int i = 0; i < nq; i++) {
            const int r = h * QB + i;
            const float inv = sum[r] > 0.0f ? 1.0f / sum[r] : 0.0f;
            const int64_t at = (int64_t)(q0 + i) * a->o_tok + (int64_t)(g * group + h) * a->o_head;
            const float *o = O + (int64_t)r * a->vd;
            if (a->bf16)
                for (int c = 0; c < a->vd; c++) ((uint16_t *)a->out)[at + c] = f2bf(o[c] * inv);
            else
                for (int c = 0; c < a->vd; c++) ((float *)a->out)[at + c] = o[c] * inv;
        }
}

static void run(const void *ctx, int phase, int t, int threads) {
    const attn_t *a = (const attn_t *)ctx;
    const int blocks = (a->nk + KB - 1) / KB, qblocks = (a->n + QB - 1) / QB;
    if (phase == 0) {
        const int units = a->kvh * blocks;
        for (int u = (int)((int64_t)units * t / threads); u < (int)((int64_t)units * (t + 1) / threads); u++)
            pack_block(a, u / blocks, u % blocks);
        return;
    }
    float *scratch = a->scratch + (int64_t)t * a->per_thread;
    for (int u = t; u < a->kvh * qblocks; u += threads) { /* interleaved: each thread gets early and late rows */
        const int qb = qblocks - 1 - u / a->kvh, q0 = qb * QB, q1 = q0 + QB < a->n ? q0 + QB : a->n;
        unit(a, u % a->kvh, q0, q1, scratch);
    }
}
#endif

/* Returns 0; -1 where not served (no vector units for the dtype, hd odd in bfloat16, vd not a
 * multiple of the vector width, H not a multiple of kvh); -2 when out of memory. */
int pd_prefill_attention(const void *q, int64_t q_tok, int64_t q_head, const void *k, int64_t k_tok, int64_t k_head,
                         const void *v, int64_t v_tok, int64_t v_head, void *out, int64_t o_tok, int64_t o_head, int n,
                         int nk, int H, int kvh, int hd, int vd, int offset, float scale, int bf16, int threads) {
#ifdef PD_VEC
#ifndef PD_BF16_PANELS
    if (bf16) return -1;
#endif
    if (n < 0 || nk < 0 || H <= 0 || kvh <= 0 || H % kvh || hd <= 0 || vd <= 0 || vd % PD_VEC || (bf16 && hd % 2) ||
        threads < 1 || offset < 0 || n + offset > nk)
        return -1;
    if (n == 0) return 0;
    const int esize = bf16 ? 2 : 4, blocks = (nk + KB - 1) / KB, rows = H / kvh * QB;
    if (threads > PD_MAX_THREADS) threads = PD_MAX_THREADS;
    attn_t a = {q, k, v, out, q_tok, q_head, k_tok, k_head, v_tok, v_head, o_tok, o_head, n, nk, H, kvh, hd, vd, offset,
                bf16, scale, NULL, NULL, NULL, 0};
    a.per_thread = (int64_t)rows * (KB + vd + 2) + ((int64_t)rows * KB + 1) / 2 + 16;
    a.kt = malloc((size_t)kvh * blocks * kt_block(&a) * esize);
    a.vp = bf16 ? malloc((size_t)kvh * blocks * vp_block(&a) * esize) : NULL;
    a.scratch = malloc((size_t)threads * a.per_thread * sizeof(float));
    int rc = -2;
    if (a.kt != NULL && (a.vp != NULL || !bf16) && a.scratch != NULL) {
        pd_parallel_phase(run, &a, 0, threads);
        pd_parallel_phase(run, &a, 1, threads);
        rc = 0;
    }
    free(a.kt), free(a.vp), free(a.scratch);
    return rc;
#else
    (void)q, (void)q_tok, (void)q_head, (void)k, (void)k_tok, (void)k_head, (void)v, (void)v_tok, (void)v_head;
    (void)out, (void)o_tok, (void)o_head, (void)n, (void)nk, (void)H, (void)kvh, (void)hd, (void)vd, (void)offset;
    (void)scale, (void)bf16, (void)threads;
    return -1;
#endif
}
