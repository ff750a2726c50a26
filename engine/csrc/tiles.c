/* See bf16_tiles.h. */
#include "bf16_tiles.h"

#include <math.h>

void pd_pack_values(uint16_t *vals, const uint16_t *const *rows, int64_t L, int64_t Lp, int vd) {
    static const uint16_t zeros[TILE] = {0};
    const int nbs = vd / TILE;
    for (int64_t t = 0; t < Lp; t += 2) { /* a pair of tokens: one 64-byte row of each 16-dim tile */
        const uint16_t *v0 = t < L ? rows[t] : NULL, *v1 = t + 1 < L ? rows[t + 1] : NULL;
        uint32_t *row = (uint32_t *)(vals + ((t / 32) * nbs * (DEPTH / 2) + (t % 32) / 2) * 2 * TILE);
        for (int nb = 0; nb < nbs; nb++, row += DEPTH * TILE / 2) {
            const uint16_t *a = v0 ? v0 + nb * TILE : zeros, *b = v1 ? v1 + nb * TILE : zeros;
            for (int col = 0; col < TILE; col++) row[col] = (uint32_t)a[col] | (uint32_t)b[col] << 16;
        }
    }
}

/* Sixteen running maxima and sums (one per lane), so the loops vectorize: a single running sum
 * waits on the previous add at every element. */
#define LANES 16

float pd_softmax_row(const float *s, uint16_t *p, int64_t upto, int64_t Lp) {
    float mxl[LANES], acc[LANES] = {0};
    for (int j = 0; j < LANES; j++) mxl[j] = -INFINITY;
    int64_t t = 0;
    for (; t + LANES <= upto; t += LANES)
        for (int j = 0; j < LANES; j++) mxl[j] = s[t + j] > mxl[j] ? s[t + j] : mxl[j];
    float mx = -INFINITY;
    for (; t < upto; t++) mx = s[t] > mx ? s[t] : mx;
    for (int j = 0; j < LANES; j++) mx = mxl[j] > mx ? mxl[j] : mx;
    for (t = 0; t + LANES <= upto; t += LANES)
        for (int j = 0; j < LANES; j++) {
            const float e = round_bf(exp_f(s[t + j] - mx));
            acc[j] += e;
            p[t + j] = f2bf(e);
        }
    float total = 0.f;
    for (; t < upto; t++) {
        const float e = round_bf(exp_f(s[t] - mx));
        total += e;
        p[t] = f2bf(e);
    }
    for (int j = 0; j < LANES; j++) total += acc[j];
    memset(p + upto, 0, sizeof(uint16_t) * (size_t)(Lp - upto));
    return total;
}

#ifdef PD_AMX
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg_t;

void pd_values_product(const uint16_t *p, int64_t Lp, const uint16_t *vals, int vd, int rows, const float *sum,
                       float *out, int64_t out_stride) {
    const int nbs = vd / TILE;
    float c[4][TILE][TILE];
    for (int nb0 = 0; nb0 < nbs; nb0 += 4) {
        const int nt = nbs - nb0 < 4 ? nbs - nb0 : 4;
        pd_tiles_zero4();
        for (int64_t ch = 0; ch < Lp / 32; ch++) {
            const uint16_t *vt = vals + (ch * nbs + nb0) * (DEPTH * TILE);
            const uint16_t *b[4] = {vt, vt + DEPTH * TILE, vt + 2 * DEPTH * TILE, vt + 3 * DEPTH * TILE};
            pd_tiles_dp4(p + ch * 32, (int)(Lp * 2), b, nt);
        }
        pd_tiles_store4(c);
        for (int r = 0; r < rows; r++) {
            float *o = out + r * out_stride + nb0 * TILE;
            const float inv = 1.f / sum[r];
            for (int t = 0; t < nt; t++)
                for (int col = 0; col < TILE; col++) o[t * TILE + col] = c[t][r][col] * inv;
        }
    }
}

void pd_tiles_on(void) {
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = TILE;
    /* GCC 12 does not count ldtilecfg as reading its operand and drops the stores above: the
     * address escapes here, so they happen */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}
#else
void pd_tiles_on(void) {}
#endif

int pd_amx_ready(void) {
#ifdef PD_AMX
    static int ready = -1;
    if (ready < 0) ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ready;
#else
    return 0;
#endif
}
