/* bfloat16 helpers and Intel AMX tile setup shared by the bfloat16 kernels (moe_experts_bf16.c,
 * decode_attention_amx.c); tiles.c holds the setup. */
#ifndef PD_BF16_TILES_H
#define PD_BF16_TILES_H
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#define PD_AMX 1
#endif

#define TILE 16   /* rows of a tile, and output columns of one */
#define DEPTH 32  /* bfloat16 values of a row of a tile (64 bytes) */

static inline float bf2f(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* f rounded to the nearest bfloat16 (ties to even, as torch rounds), as a float; branch-free so
 * the loops below vectorize. */
static inline float round_bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
    const uint32_t r = nan ? (u | 0x00400000u) & 0xffff0000u : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    float o;
    memcpy(&o, &r, 4);
    return o;
}

/* The bfloat16 bits of r, a value already rounded to bfloat16 (round_bf's result). */
static inline uint16_t bf_bits(float r) {
    uint32_t u;
    memcpy(&u, &r, 4);
    return (uint16_t)(u >> 16);
}

static inline uint16_t f2bf(float f) {
    const float r = round_bf(f);
    uint32_t u;
    memcpy(&u, &r, 4);
    return (uint16_t)(u >> 16);
}

/* exp(x) in float (Cephes' range reduction and polynomial, within about 1 ulp: torch's own vector
 * exp is as close, and each use rounds to bfloat16 after); plain arithmetic, so it vectorizes. */
static inline float exp_f(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return p * scale;
}

#ifdef PD_AMX
/* Tiles 0-3 += A (tile 4: 16 rows of 32 bf16 values, `stride` bytes apart) times the nt <= 4
 * packed 16x32 tiles b[0..nt) (through tiles 5-7). */
static inline void pd_tiles_dp4(const void *a, int stride, const uint16_t *const b[4], int nt) {
    _tile_loadd(4, a, stride);
    _tile_loadd(5, b[0], 64);
    if (nt > 1) _tile_loadd(6, b[1], 64);
    _tile_dpbf16ps(0, 4, 5);
    if (nt > 2) _tile_loadd(7, b[2], 64);
    if (nt > 1) _tile_dpbf16ps(1, 4, 6);
    if (nt > 3) _tile_loadd(5, b[3], 64);
    if (nt > 2) _tile_dpbf16ps(2, 4, 7);
    if (nt > 3) _tile_dpbf16ps(3, 4, 5);
}

/* Tiles 0, 1 += A0 (tile 4) times b0, b1 (tiles 6, 7); tiles 2, 3 += A1 (tile 5) times the same:
 * two 16-row blocks of A, 32 values deep, `stride` bytes between rows; b1 NULL: b0 alone. */
static inline void pd_tiles_dp22(const void *a0, const void *a1, int stride, const uint16_t *b0, const uint16_t *b1) {
    _tile_loadd(4, a0, stride);
    _tile_loadd(6, b0, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, a1, stride);
    _tile_dpbf16ps(2, 5, 6);
    if (b1) {
        _tile_loadd(7, b1, 64);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
    }
}

static inline void pd_tiles_zero4(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

static inline void pd_tiles_store4(float c[4][TILE][TILE]) {
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
}
#endif

/* Value rows packed as a tile product's second operand, in pairs of tokens: vals[c][nb][kk][col][j] =
 * rows[32 c + 2 kk + j][16 nb + col], rows[t] NULL or t >= L: zero; Lp a multiple of 32. */
void pd_pack_values(uint16_t *vals, const uint16_t *const *rows, int64_t L, int64_t Lp, int vd);

/* One query row's probabilities from its scores s[0, upto) (scaled): exact softmax in float32,
 * each rounded to bfloat16 into p[0, upto), zeros in p[upto, Lp); returns their sum. */
float pd_softmax_row(const float *s, uint16_t *p, int64_t upto, int64_t Lp);

#ifdef PD_AMX
/* out[r * out_stride + d] = (p[r] . vals[:, d]) / sum[r] for the first `rows` of 16 probability
 * rows (p: 16 x Lp bf16) against packed values of width vd (vd % 16 == 0). Tiles configured. */
void pd_values_product(const uint16_t *p, int64_t Lp, const uint16_t *vals, int vd, int rows, const float *sum,
                       float *out, int64_t out_stride);
#endif

/* 1 when this build has AMX and the kernels may use its tile registers (Linux hands them out on
 * request, once per process); call once before a kernel that uses them. */
int pd_amx_ready(void);

/* This thread's tiles configured as 16 rows of 64 bytes each (call before using them on a thread;
 * _tile_release() after). */
void pd_tiles_on(void);
#endif
