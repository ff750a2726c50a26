/* The micro-kernels of the panel kernels (linear_panels.c, prefill_attention.c): c[r][0 .. nv*VEC)
 * (+)= x[r][k0 .. k1) . w[k0 .. k1][0 .. nv*VEC), r < mr, one broadcast of an x value against up to
 * four vectors of a row of w, mr x 4 accumulators in registers. x rows are `xs` values apart, w rows
 * `ws`, c rows `cs`. bfloat16: k runs in pairs, w rows are [width][2] pairs (AVX-512 BF16's pair dot
 * product), sums in float32. `pf`, `pf_lines`: cache lines to prefetch (into L2) per step of k.
 * Vector units served: AVX-512F (PD_MR 6 rows), AVX2 + FMA (3 rows); bfloat16 with AVX-512 BF16. */
#ifndef PD_PANEL_TILES_H
#define PD_PANEL_TILES_H
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define PD_VEC 16
#define PD_MR 6
typedef __m512 vec_t;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VBCAST(p) _mm512_set1_ps(*(p))
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSET1(f) _mm512_set1_ps(f)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VSUB(a, b) _mm512_sub_ps(a, b)
#define VMAX(a, b) _mm512_max_ps(a, b)
#define VMIN(a, b) _mm512_min_ps(a, b)
#define VRINT(a) _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VPOW2I(n) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23))
#define VHMAX(a) _mm512_reduce_max_ps(a)
#define VLOAD_BF16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define VLOAD_I8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define VHSUM(a) _mm512_reduce_add_ps(a)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PD_VEC 8
#define PD_MR 3
typedef __m256 vec_t;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VBCAST(p) _mm256_broadcast_ss(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VSET1(f) _mm256_set1_ps(f)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VSUB(a, b) _mm256_sub_ps(a, b)
#define VMAX(a, b) _mm256_max_ps(a, b)
#define VMIN(a, b) _mm256_min_ps(a, b)
#define VRINT(a) _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VPOW2I(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23))
static inline float pd_hmax8(__m256 a) {
    float v[8], m;
    _mm256_storeu_ps(v, a);
    m = v[0];
    for (int i = 1; i < 8; i++) m = v[i] > m ? v[i] : m;
    return m;
}
static inline float pd_hsum8(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define VHMAX(a) pd_hmax8(a)
#define VLOAD_BF16(p) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define VLOAD_I8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define VHSUM(a) pd_hsum8(a)
#endif

#ifdef PD_VEC
/* exp(x) lane by lane: bf16_tiles.h's exp_f (Cephes' range reduction and polynomial, within 2 ulp of
 * expf) in vectors; below -87.3 (expf: a denormal or 0) and for -inf it is exactly 0, so masked
 * scores (-inf) and underflows drop out of a softmax's sum. */
static inline vec_t pd_vexp(vec_t x) {
    const vec_t lo = VSET1(-87.3f);
    const vec_t c = VMIN(VMAX(x, lo), VSET1(88.7f));
    const vec_t n = VRINT(VMUL(c, VSET1(1.44269504088896341f)));
    const vec_t r = VFMA(n, VSET1(2.12194440e-4f), VFMA(n, VSET1(-0.693359375f), c));
    vec_t p = VSET1(1.9875691500e-4f);
    p = VFMA(p, r, VSET1(1.3981999507e-3f));
    p = VFMA(p, r, VSET1(8.3334519073e-3f));
    p = VFMA(p, r, VSET1(4.1665795894e-2f));
    p = VFMA(p, r, VSET1(1.6666665459e-1f));
    p = VFMA(p, r, VSET1(5.0000001201e-1f));
    p = VADD(VFMA(VMUL(p, r), r, r), VSET1(1.0f));
    const vec_t e = VMUL(p, VPOW2I(n));
#if PD_VEC == 16
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_NLT_UQ), e);
#else
    return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), e);
#endif
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PD_BF16_PANELS 1
#endif

#define PANEL 64 /* output columns of a panel */
#define NV 4     /* vectors of columns a micro-kernel call covers */

#ifdef PD_VEC
#define ALWAYS_INLINE __attribute__((always_inline)) inline

/* c[r][0 .. nv*PD_VEC) (+)= x[r][k0 .. k1) . panel columns, for r < mr; `ws`: the panel's width. */
static ALWAYS_INLINE void tile_f32(const float *x, int64_t xs, const float *w, int ws, int k0, int k1, float *c,
                                   int cs, int mr, int nv, int first, const char *pf, int pf_lines) {
    vec_t acc[PD_MR][NV];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) acc[r][v] = first ? VZERO() : VLOAD(c + r * cs + v * PD_VEC);
    for (int k = k0; k < k1; k++) {
        const float *wk = w + (int64_t)k * ws;
        for (int i = 0; i < pf_lines; i++, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
        vec_t b[NV];
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) b[v] = VLOAD(wk + v * PD_VEC);
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            const vec_t a = VBCAST(x + r * xs + k);
#pragma GCC unroll 4
            for (int v = 0; v < nv; v++) acc[r][v] = VFMA(a, b[v], acc[r][v]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) VSTORE(c + r * cs + v * PD_VEC, acc[r][v]);
}

#ifdef PD_BF16_PANELS
/* As tile_f32 for bfloat16 x and panel: k advances in pairs ([K/2][ws][2] panel). */
static ALWAYS_INLINE void tile_bf16(const uint16_t *x, int64_t xs, const uint16_t *w, int ws, int k0, int k1,
                                    float *c, int cs, int mr, int nv, int first, const char *pf, int pf_lines) {
    __m512 acc[PD_MR][NV];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) acc[r][v] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * cs + v * 16);
    for (int k = k0; k < k1; k += 2) {
        const uint16_t *wk = w + (int64_t)k * ws;
        for (int i = 0; i < pf_lines; i++, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
        __m512bh b[NV];
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) b[v] = (__m512bh)_mm512_loadu_si512(wk + v * 32);
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            int32_t pair;
            memcpy(&pair, x + r * xs + k, 4);
            const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
            for (int v = 0; v < nv; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int v = 0; v < nv; v++) _mm512_storeu_ps(c + r * cs + v * 16, acc[r][v]);
}
#endif

/* One specialised copy per (rows, vectors): the accumulators stay in registers. */
#define TILE_CASES(FN, T)                                                                                   \
    switch (mr * 8 + nv) {                                                                                \
    case 8 + 1: FN(x, xs, w, ws, k0, k1, c, cs, 1, 1, first, pf, pf_lines); break;                                          \
    case 8 + 2: FN(x, xs, w, ws, k0, k1, c, cs, 1, 2, first, pf, pf_lines); break;                                          \
    case 8 + 3: FN(x, xs, w, ws, k0, k1, c, cs, 1, 3, first, pf, pf_lines); break;                                          \
    case 8 + 4: FN(x, xs, w, ws, k0, k1, c, cs, 1, 4, first, pf, pf_lines); break;                                          \
    case 16 + 1: FN(x, xs, w, ws, k0, k1, c, cs, 2, 1, first, pf, pf_lines); break;                                         \
    case 16 + 2: FN(x, xs, w, ws, k0, k1, c, cs, 2, 2, first, pf, pf_lines); break;                                         \
    case 16 + 3: FN(x, xs, w, ws, k0, k1, c, cs, 2, 3, first, pf, pf_lines); break;                                         \
    case 16 + 4: FN(x, xs, w, ws, k0, k1, c, cs, 2, 4, first, pf, pf_lines); break;                                         \
    case 24 + 1: FN(x, xs, w, ws, k0, k1, c, cs, 3, 1, first, pf, pf_lines); break;                                         \
    case 24 + 2: FN(x, xs, w, ws, k0, k1, c, cs, 3, 2, first, pf, pf_lines); break;                                         \
    case 24 + 3: FN(x, xs, w, ws, k0, k1, c, cs, 3, 3, first, pf, pf_lines); break;                                         \
    case 24 + 4: FN(x, xs, w, ws, k0, k1, c, cs, 3, 4, first, pf, pf_lines); break;                                         \
    T                                                                                                     \
    }

#if PD_MR == 6
#define WIDE_CASES(FN)                                                                                    \
    case 32 + 1: FN(x, xs, w, ws, k0, k1, c, cs, 4, 1, first, pf, pf_lines); break;                                         \
    case 32 + 2: FN(x, xs, w, ws, k0, k1, c, cs, 4, 2, first, pf, pf_lines); break;                                         \
    case 32 + 3: FN(x, xs, w, ws, k0, k1, c, cs, 4, 3, first, pf, pf_lines); break;                                         \
    case 32 + 4: FN(x, xs, w, ws, k0, k1, c, cs, 4, 4, first, pf, pf_lines); break;                                         \
    case 40 + 1: FN(x, xs, w, ws, k0, k1, c, cs, 5, 1, first, pf, pf_lines); break;                                         \
    case 40 + 2: FN(x, xs, w, ws, k0, k1, c, cs, 5, 2, first, pf, pf_lines); break;                                         \
    case 40 + 3: FN(x, xs, w, ws, k0, k1, c, cs, 5, 3, first, pf, pf_lines); break;                                         \
    case 40 + 4: FN(x, xs, w, ws, k0, k1, c, cs, 5, 4, first, pf, pf_lines); break;                                         \
    case 48 + 1: FN(x, xs, w, ws, k0, k1, c, cs, 6, 1, first, pf, pf_lines); break;                                         \
    case 48 + 2: FN(x, xs, w, ws, k0, k1, c, cs, 6, 2, first, pf, pf_lines); break;                                         \
    case 48 + 3: FN(x, xs, w, ws, k0, k1, c, cs, 6, 3, first, pf, pf_lines); break;                                         \
    case 48 + 4: FN(x, xs, w, ws, k0, k1, c, cs, 6, 4, first, pf, pf_lines); break;
#else
#define WIDE_CASES(FN)
#endif

static void tile_f32_any(const float *x, int64_t xs, const float *w, int ws, int k0, int k1, float *c, int cs, int mr,
                         int nv, int first, const char *pf, int pf_lines) {
    TILE_CASES(tile_f32, WIDE_CASES(tile_f32))
}

#ifdef PD_BF16_PANELS
static void tile_bf16_any(const uint16_t *x, int64_t xs, const uint16_t *w, int ws, int k0, int k1, float *c,
                          int cs, int mr, int nv, int first, const char *pf, int pf_lines) {
    TILE_CASES(tile_bf16, WIDE_CASES(tile_bf16))
}
#endif
#endif
#endif
