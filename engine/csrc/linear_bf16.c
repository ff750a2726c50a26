/* A bfloat16 linear layer for decode-sized batches on AMX tiles: out[T][N] = x[T][K] . W^T (+ bias),
 * float32 sums rounded once to bfloat16, as torch's bfloat16 linear rounds. W is prepacked at load in
 * the experts' tile layout (engine/models/moe_packed.py: (N/16, K/32, 16, 16, 2), each 16x32 block
 * one contiguous 1 KiB tile). A decode step reads each weight once from memory: the tiles stream it
 * at the bandwidth the experts kernel reaches, where oneDNN's small-batch matmul on weights the
 * previous layer's traffic pushed out of the caches reads at well under half of it.
 *
 * Work: units of 64 output columns (four tiles), split across threads; each unit runs every 16-row
 * block of x against its columns. Rows past T read a zero-padded copy. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_tiles.h"
#include "kernels.h"
#include "parallel.h"

typedef struct {
    const uint16_t *x, *w, *bias;
    uint16_t *out;
    int T, Tp, K, N;
    int64_t out_stride;           /* values from one row of out to the next */
    int heads;                    /* pd_linear_heads_bf16: one weight per head, units over heads too */
    int64_t x_head, w_head, out_head; /* values from one head's x / packed weight / out to the next */
} lin_t;

#ifdef PD_AMX
static void unit(const lin_t *l, int hu) {
    const int per_head = (l->N / TILE + 3) / 4, h = hu / per_head, u = hu % per_head;
    const int K = l->K, kbs = K / DEPTH, nb0 = 4 * u, nt = l->N / TILE - nb0 < 4 ? l->N / TILE - nb0 : 4;
    const uint16_t *x = l->x + h * l->x_head, *w = l->w + h * l->w_head;
    uint16_t *out = l->out + h * l->out_head;
    float c[4][TILE][TILE];
    for (int r0 = 0; r0 < l->Tp; r0 += TILE) {
        pd_tiles_zero4();
        for (int kb = 0; kb < kbs; kb++) {
            const uint16_t *b[4];
            for (int t = 0; t < 4; t++) b[t] = w + ((int64_t)(nb0 + (t < nt ? t : 0)) * kbs + kb) * (DEPTH * TILE);
            pd_tiles_dp4(x + (int64_t)r0 * K + kb * DEPTH, K * 2, b, nt);
        }
        pd_tiles_store4(c);
        const int rows = l->T - r0 < TILE ? l->T - r0 : TILE;
        for (int r = 0; r < rows; r++) {
            uint16_t *o = out + (int64_t)(r0 + r) * l->out_stride + nb0 * TILE;
            for (int t = 0; t < nt; t++)
                for (int n = 0; n < TILE; n++) {
                    const float bias = l->bias != NULL ? bf2f(l->bias[(nb0 + t) * TILE + n]) : 0.0f;
                    o[t * TILE + n] = f2bf(c[t][r][n] + bias);
                }
        }
    }
}

static void run(const void *ctx, int phase, int t, int threads) {
    (void)phase;
    const lin_t *l = (const lin_t *)ctx;
    const int units = (l->N / TILE + 3) / 4 * l->heads;
    pd_tiles_on();
    for (int u = (int)((int64_t)units * t / threads); u < (int)((int64_t)units * (t + 1) / threads); u++) unit(l, u);
    _tile_release();
}
#endif

/* x: T rows of K bfloat16 values, `x_stride` values apart; w packed as above; bias N values or
 * NULL; out: T x N, contiguous. Returns 0, -1 where the tiles do not serve (no AMX, K % 32, N % 16),
 * -2 when out of memory. */
int pd_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias, uint16_t *out, int T,
                   int K, int N, int threads) {
#ifdef PD_AMX
    if (!pd_amx_ready() || K % DEPTH || N % TILE || K <= 0 || N <= 0 || T < 0 || threads < 1) return -1;
    if (T == 0) return 0;
    const int Tp = (T + TILE - 1) / TILE * TILE;
    uint16_t *padded = NULL;
    if (Tp != T || x_stride != K) { /* the tiles read 16 rows of K values, back to back */
        padded = calloc((size_t)Tp * (size_t)K, sizeof(uint16_t));
        if (padded == NULL) return -2;
        for (int r = 0; r < T; r++) memcpy(padded + (int64_t)r * K, x + (int64_t)r * x_stride, (size_t)K * 2);
    }
    const lin_t l = {padded != NULL ? padded : x, w, bias, out, T, Tp, K, N, N, 1, 0, 0, 0};
    const int units = (N / TILE + 3) / 4;
    pd_parallel_phase(run, &l, 0, threads < units ? threads : units);
    free(padded);
    return 0;
#else
    (void)x, (void)x_stride, (void)w, (void)bias, (void)out, (void)T, (void)K, (void)N, (void)threads;
    return -1;
#endif
}

/* One linear per head (attention's per-head projections, as a batched matmul): for each of `heads`
 * heads, out[t][h] (N values) = x[t][h] (K values) . W_h^T, no bias. x[t][h] starts at
 * x + t * x_stride + h * x_head, out[t][h] at out + t * out_stride + h * out_head; the packed weights
 * lie head after head (N * K values each). Units are (head, 64 output columns). Returns as
 * pd_linear_bf16. */
int pd_linear_heads_bf16(const uint16_t *x, int64_t x_stride, int64_t x_head, const uint16_t *w, uint16_t *out,
                         int64_t out_stride, int64_t out_head, int T, int K, int N, int heads, int threads) {
#ifdef PD_AMX
    if (!pd_amx_ready() || K % DEPTH || N % TILE || K <= 0 || N <= 0 || T < 0 || heads <= 0 || threads < 1) return -1;
    if (T == 0) return 0;
    const int Tp = (T + TILE - 1) / TILE * TILE;
    /* each head's rows back to back, zero-padded to 16: [head][Tp][K] */
    uint16_t *packed_x = calloc((size_t)heads * (size_t)Tp * (size_t)K, sizeof(uint16_t));
    if (packed_x == NULL) return -2;
    for (int h = 0; h < heads; h++)
        for (int r = 0; r < T; r++)
            memcpy(packed_x + ((int64_t)h * Tp + r) * K, x + (int64_t)r * x_stride + (int64_t)h * x_head,
                   (size_t)K * 2);
    const lin_t l = {packed_x, w, NULL, out, T, Tp, K, N, out_stride, heads, (int64_t)Tp * K, (int64_t)N * K,
                     out_head};
    const int units = (N / TILE + 3) / 4 * heads;
    pd_parallel_phase(run, &l, 0, threads < units ? threads : units);
    free(packed_x);
    return 0;
#else
    (void)x, (void)x_stride, (void)x_head, (void)w, (void)out, (void)out_stride, (void)out_head, (void)T, (void)K;
    (void)N, (void)heads, (void)threads;
    return -1;
#endif
}
