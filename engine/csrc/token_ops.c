/* A layer's per-token steps in one pass each, where torch runs a chain of small ops: RMSNorm
 * (optionally after the residual add) and RoPE on query and key heads (optionally after their
 * per-head RMSNorm, as Qwen3 does). At decode a chain of eight torch ops on a few rows costs tens
 * of microseconds in dispatch alone; in prefill each op of the chain is another pass over memory.
 *
 * Numerics follow transformers' torch code op by op: float32 arithmetic, rounded to bfloat16 where
 * torch's op would round (bfloat16 activations), and no fused multiply-adds (each product rounds
 * on its own, as torch's separate ops do; hence the pragmas). The one difference from torch is the
 * order in which a row's squares are summed.
 *
 * dtype: 0 float32, 1 bfloat16, for every tensor of a call (activations, weights, cos/sin). */
#pragma GCC optimize("fp-contract=off")
#pragma STDC FP_CONTRACT OFF

#include <math.h>
#include <stdint.h>

#include "bf16_tiles.h"
#include "kernels.h"
#include "parallel.h"

/* Rows smaller than this many values in all run on the calling thread: waking the pool costs more. */
#define PARALLEL_MIN_VALUES 65536

static inline float load(const void *p, long i, int bf) {
    return bf ? bf2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, long i, float v, int bf) {
    if (bf)
        ((uint16_t *)p)[i] = f2bf(v);
    else
        ((float *)p)[i] = v;
}

/* v (n values) rounded as the dtype rounds: bfloat16's nearest, float32 unchanged. */
static inline float rnd(float v, int bf) { return bf ? round_bf(v) : v; }

/* Functions taking the dtype flag `bf` are inlined where it is a constant (0 or 1, see the
 * dispatchers below), so each dtype's loops are straight-line vector code. */
#define SPECIALIZED static inline __attribute__((always_inline))

/* The sum of v[i]^2, in 16 interleaved partial sums (vector lanes: a single running sum would wait
 * on each add's latency, ~4x slower than the loads), then added pairwise. */
SPECIALIZED float sum_squares(const float *v, int n) {
    float acc[16] = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += v[i + j] * v[i + j];
    for (int j = 0; i < n; i++, j++) acc[j] += v[i] * v[i];
    for (int w = 8; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return acc[0];
}

/* transformers' RMSNorm of v[0..n) in place: v * rsqrt(mean(v^2) + eps), rounded to the dtype,
 * times the weight, rounded again. */
SPECIALIZED void norm_row(float *v, int n, const void *w, float eps, int bf) {
    const float r = 1.0f / sqrtf(sum_squares(v, n) / (float)n + eps);
    for (int i = 0; i < n; i++) v[i] = rnd(load(w, i, bf) * rnd(v[i] * r, bf), bf);
}

/* ---------------------------------------------------------------------------------------------- RMSNorm */
typedef struct {
    const void *x, *delta, *w;
    void *sum, *out;
    long x_stride;
    int rows, dim, bf;
    float eps;
} norm_args_t;

SPECIALIZED void norm_rows_of(const norm_args_t *a, int first, int last, int bf) {
    float v[a->dim];
    for (int r = first; r < last; r++) {
        const long xi = (long)r * a->x_stride, oi = (long)r * a->dim;
        for (int i = 0; i < a->dim; i++) {
            float s = load(a->x, xi + i, bf);
            if (a->delta != NULL) s = rnd(s + load(a->delta, oi + i, bf), bf);
            v[i] = s;
        }
        if (a->sum != NULL)
            for (int i = 0; i < a->dim; i++) store(a->sum, oi + i, v[i], bf);
        norm_row(v, a->dim, a->w, a->eps, bf);
        for (int i = 0; i < a->dim; i++) store(a->out, oi + i, v[i], bf);
    }
}

static void norm_rows(const norm_args_t *a, int first, int last) {
    if (a->bf)
        norm_rows_of(a, first, last, 1);
    else
        norm_rows_of(a, first, last, 0);
}

static void norm_phase(const void *ctx, int phase, int t, int threads) {
    (void)phase;
    const norm_args_t *a = (const norm_args_t *)ctx;
    norm_rows(a, (int)((long)a->rows * t / threads), (int)((long)a->rows * (t + 1) / threads));
}

/* out = RMSNorm(s) * w for rows of `dim` values, where s = x (row stride `x_stride`), or with
 * `delta` (contiguous) s = x + delta rounded to the dtype, written to `sum` when it is not NULL
 * (the residual stream's next value). `out` and `sum` are contiguous. Returns 0. */
int pd_rms_norm(const void *x, long x_stride, const void *delta, void *sum, const void *w, void *out, int rows,
                int dim, float eps, int dtype, int threads) {
    const norm_args_t a = {x, delta, w, sum, out, x_stride, rows, dim, dtype == 1, eps};
    if ((long)rows * dim < PARALLEL_MIN_VALUES || threads <= 1 || rows < 2)
        norm_rows(&a, 0, rows);
    else
        pd_parallel_phase(norm_phase, &a, 0, threads < rows ? threads : rows);
    return 0;
}

/* ---------------------------------------------------------------------------------------------- RoPE */
typedef struct {
    const void *src, *cos, *sin, *qw, *kw;
    void *out;
    long token_stride, head_stride, out_token_stride, out_head_stride;
    int tokens, heads, q_heads, hd, bf;
    float eps;
} rope_args_t;

SPECIALIZED void rope_tokens_of(const rope_args_t *a, int first, int last, int bf) {
    const int hd = a->hd, half = hd / 2;
    float v[hd];
    for (int t = first; t < last; t++) {
        for (int h = 0; h < a->heads; h++) {
            const long si = (long)t * a->token_stride + (long)h * a->head_stride;
            for (int i = 0; i < hd; i++) v[i] = load(a->src, si + i, bf);
            const void *w = h < a->q_heads ? a->qw : a->kw;
            if (w != NULL) norm_row(v, hd, w, a->eps, bf);
            const long oi = (long)t * a->out_token_stride + (long)h * a->out_head_stride, ci = (long)t * hd;
            for (int i = 0; i < half; i++) {
                const float c = load(a->cos, ci + i, bf), s = load(a->sin, ci + i, bf);
                const float x1 = v[i], x2 = v[i + half];
                store(a->out, oi + i, rnd(x1 * c, bf) - rnd(x2 * s, bf), bf);
                store(a->out, oi + i + half, rnd(x2 * c, bf) + rnd(x1 * s, bf), bf);
            }
        }
    }
}

static void rope_tokens(const rope_args_t *a, int first, int last) {
    if (a->bf)
        rope_tokens_of(a, first, last, 1);
    else
        rope_tokens_of(a, first, last, 0);
}

static void rope_phase(const void *ctx, int phase, int t, int threads) {
    (void)phase;
    const rope_args_t *a = (const rope_args_t *)ctx;
    rope_tokens(a, (int)((long)a->tokens * t / threads), (int)((long)a->tokens * (t + 1) / threads));
}

/* RoPE as engine/rope.py's apply_rope computes it, on `heads` heads of `hd` values per token: head h
 * of token t starts at src + t * token_stride + h * head_stride (in values); cos / sin are (tokens,
 * hd) tables with equal halves. With `qw` / `kw` (each hd weights, or NULL for no norm) the first
 * `q_heads` heads are RMSNorm'd with qw and the rest with kw first. The result's head h of token t
 * goes to out + t * out_token_stride + h * out_head_stride. Returns 0, or -1 for an odd head width. */
int pd_rope(const void *src, long token_stride, long head_stride, const void *cos, const void *sin, const void *qw,
            const void *kw, void *out, long out_token_stride, long out_head_stride, int tokens, int heads,
            int q_heads, int hd, float eps, int dtype, int threads) {
    if (hd % 2 != 0) return -1;
    const rope_args_t a = {src, cos, sin, qw, kw, out, token_stride, head_stride, out_token_stride, out_head_stride,
                           tokens, heads, q_heads, hd, dtype == 1, eps};
    if ((long)tokens * heads * hd < PARALLEL_MIN_VALUES || threads <= 1 || tokens < 2)
        rope_tokens(&a, 0, tokens);
    else
        pd_parallel_phase(rope_phase, &a, 0, threads < tokens ? threads : tokens);
    return 0;
}
