/* Decode attention straight from the paged KV cache: one query token per sequence, keys and
 * values read in place through the block table (no gathered copy), online softmax per block.
 *
 * Layout (engine/attention.py): a layer's cache is kv[2][num_blocks][block_size][kvh][hd];
 * token t of sequence i lives at block tables[i * max_blocks + t / block_size], offset
 * t % block_size; row i attends to its tokens [starts[i], ctx[i]) (starts NULL: from 0; with a
 * sliding window they start later, and the blocks before the start are never read). q is
 * [b][H][hd] with sequence i's heads from q + i * q_stride (H * hd when contiguous), out
 * [b][H][vd], H = kvh * group; a value row is the first vd of the hd values at its place in v
 * (vd = hd for K/V heads; for a latent cache (engine/models/mla.py) k and v are the same rows,
 * [latent, rope], and the value is the latent). Work is split over units of (sequence, slice of kv
 * heads, slice of each head's query rows) across `threads` threads; a unit reads each token row of
 * its slice once, in order, and keeps its query rows, running max, running sum and accumulators on
 * its stack. Built with OpenMP, the threads are torch's own (see the end); else POSIX threads.
 * Built by engine/native.py with the host compiler; float32 and bfloat16 caches, and quantized
 * pages (engine/kv_quant.py): each cache row `width` bytes, hd one-byte values (int8, fp8 e4m3 or
 * e5m2) then the row's float32 scale, dequantized as the row is read (the cache's bytes are what
 * is read: a quarter of float32's, half of bfloat16's).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "kernels.h"
#include "panel_tiles.h"
#include "parallel.h"

#define MAX_HD 576 /* DeepSeek's latent + rope */
#define MAX_BS 64
#define MAX_ROWS 32 /* query rows one unit holds at once (a unit with more heads loops) */

/* The cache's formats: the queries' own (float32 / bfloat16), or quantized pages. */
enum { KV_PLAIN = 0, KV_INT8 = 1, KV_E4M3 = 2, KV_E5M2 = 3 };

typedef struct {
    const void *q, *k, *v;
    const int64_t *tables, *ctx, *starts;
    float *out;
    int64_t q_stride;
    int b, kvh, group, hd, vd, bs, max_blocks, is_bf16, kv_format, width, thread, threads, splits, row_splits;
    float scale;
} job_t;

/* Each format's 256 byte values as floats (int8: the integer; fp8: e4m3fn / e5m2 decoded). */
static float byte_values[4][256];
static pthread_once_t byte_values_once = PTHREAD_ONCE_INIT;

static float fp8_value(unsigned b, int mant_bits, int bias, int e4m3) {
    const int exp_bits = 7 - mant_bits, e = (int)(b >> mant_bits) & ((1 << exp_bits) - 1);
    const int m = (int)b & ((1 << mant_bits) - 1);
    const float sign = (b & 0x80) ? -1.f : 1.f;
    if (e4m3 && e == 15 && m == 7) return NAN;
    if (!e4m3 && e == 31) return m ? NAN : sign * INFINITY;
    if (e == 0) return sign * ldexpf((float)m, 1 - bias - mant_bits);
    return sign * ldexpf((float)((1 << mant_bits) + m), e - bias - mant_bits);
}

static void fill_byte_values(void) {
    for (unsigned b = 0; b < 256; b++) {
        byte_values[KV_INT8][b] = (float)(int8_t)b;
        byte_values[KV_E4M3][b] = fp8_value(b, 3, 7, 1);
        byte_values[KV_E5M2][b] = fp8_value(b, 2, 15, 0);
    }
}

static inline float load(const void *base, int64_t i, int is_bf16) {
    if (is_bf16) {
        uint32_t bits = (uint32_t)((const uint16_t *)base)[i] << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    return ((const float *)base)[i];
}

/* Eight independent partial sums: the compiler turns them into one vector register (no
 * reassociation needed), instead of a chain of dependent scalar adds. */
static inline float dot(const float *a, const float *b, int n) {
    float part[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int d = 0;
    for (; d + 8 <= n; d += 8)
        for (int u = 0; u < 8; u++) part[u] += a[d + u] * b[d + u];
    float tail = 0.f;
    for (; d < n; d++) tail += a[d] * b[d];
    return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7])) + tail;
}

/* s[t] = e^(s[t] - mx) for t < n; returns their sum. */
static inline float exp_shifted(float *s, int n, float mx) {
    int t = 0;
    float sum = 0.f;
#ifdef PD_VEC
    vec_t acc = VZERO();
    const vec_t m = VSET1(mx);
    for (; t + PD_VEC <= n; t += PD_VEC) {
        const vec_t e = pd_vexp(VSUB(VLOAD(s + t), m));
        VSTORE(s + t, e);
        acc = VADD(acc, e);
    }
    sum = VHSUM(acc);
#endif
    for (; t < n; t++) {
        s[t] = expf(s[t] - mx);
        sum += s[t];
    }
    return sum;
}

/* The cache row at element `off` (bytes for quantized pages) as n floats. */
static inline const float *row_f32(const job_t *j, const void *base, int64_t off, float *buf, int n) {
    if (j->kv_format != KV_PLAIN) {
        const uint8_t *r = (const uint8_t *)base + off;
        float scale;
        memcpy(&scale, r + j->hd, 4);
        if (j->kv_format == KV_INT8) { /* converted in registers: vectorizes */
            const int8_t *v = (const int8_t *)r;
            for (int d = 0; d < n; d++) buf[d] = (float)v[d] * scale;
        } else { /* fp8: through the format's table */
            const float *values = byte_values[j->kv_format];
            for (int d = 0; d < n; d++) buf[d] = values[r[d]] * scale;
        }
        return buf;
    }
    if (!j->is_bf16) return (const float *)base + off;
    for (int d = 0; d < n; d++) buf[d] = load(base, off + d, 1);
    return buf;
}

#ifdef PD_VEC
/* Rows read in vectors (widths whole vectors), converted in registers, no copy of the row: float32,
 * bfloat16, or int8 pages (offsets in bytes; the row's scale, after its hd values, is applied once
 * by the caller: to the dot product, and to the probability the values are weighed by). */
enum { VEC_F32 = 0, VEC_BF16 = 1, VEC_INT8 = 2, VEC_NONE = -1 };

static inline vec_t row_vec(const void *base, int64_t i, int kind) {
    if (kind == VEC_INT8) return VLOAD_I8((const uint8_t *)base + i);
    return kind == VEC_BF16 ? VLOAD_BF16((const uint16_t *)base + i) : VLOAD((const float *)base + i);
}

static inline float dot_vec(const float *q, const void *base, int64_t off, int n, int kind) {
    vec_t a0 = VZERO(), a1 = VZERO();
    int d = 0;
    for (; d + 2 * PD_VEC <= n; d += 2 * PD_VEC) {
        a0 = VFMA(VLOAD(q + d), row_vec(base, off + d, kind), a0);
        a1 = VFMA(VLOAD(q + d + PD_VEC), row_vec(base, off + d + PD_VEC, kind), a1);
    }
    if (d < n) a0 = VFMA(VLOAD(q + d), row_vec(base, off + d, kind), a0);
    return VHSUM(VADD(a0, a1));
}

static inline void axpy_vec(float *acc, float p, const void *base, int64_t off, int n, int kind) {
    const vec_t pv = VSET1(p);
    for (int d = 0; d < n; d += PD_VEC) VSTORE(acc + d, VFMA(pv, row_vec(base, off + d, kind), VLOAD(acc + d)));
}

/* The scale of the int8 row at byte `off` (1 for plain rows). */
static inline float row_scale(const job_t *j, const void *base, int64_t off, int kind) {
    float scale = 1.0f;
    if (kind == VEC_INT8) memcpy(&scale, (const uint8_t *)base + off + j->hd, 4);
    return scale;
}
#endif

/* Sequence i, kv heads [h0, h1), query rows [g0, g1) of each: every token row of a block is read
 * once, in order. */
static void one_unit(const job_t *j, int i, int h0, int h1, int g0, int g1) {
    const int hd = j->hd, vd = j->vd, G = j->group, bs = j->bs, kvh = j->kvh, H = kvh * G;
    const int g = g1 - g0;
    const int rows = (h1 - h0) * g;  /* query rows of this unit: rows g0..g1-1 of heads h0..h1-1 */
    float qv[MAX_ROWS][MAX_HD], acc[MAX_ROWS][MAX_HD], m[MAX_ROWS], l[MAX_ROWS], s[MAX_ROWS][MAX_BS];
    float buf[MAX_HD];
    for (int r = 0; r < rows; r++) {
        for (int d = 0; d < hd; d++) {
            qv[r][d] = load(j->q, (int64_t)i * j->q_stride + ((h0 + r / g) * G + g0 + r % g) * hd + d, j->is_bf16) *
                       j->scale;
            acc[r][d] = 0.f;
        }
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    const int64_t n = j->ctx[i], first = j->starts ? j->starts[i] : 0;
#ifdef PD_VEC
    const int vec_kind = hd % PD_VEC || vd % PD_VEC ? VEC_NONE
                         : j->kv_format == KV_PLAIN ? (j->is_bf16 ? VEC_BF16 : VEC_F32)
                         : j->kv_format == KV_INT8 ? VEC_INT8 : VEC_NONE;
#endif
    const int64_t row = (int64_t)kvh * j->width;  /* elements between consecutive tokens of a block */
    for (int64_t start = first - first % bs; start < n; start += bs) {
        const int64_t block = j->tables[(int64_t)i * j->max_blocks + start / bs];
        const int cnt = (int)((n - start) < bs ? (n - start) : bs);
        const int t0 = (int)(first > start ? first - start : 0);  /* tokens of this block before the window */
        const int64_t base = block * bs * row;
        float bmax[MAX_ROWS];
        for (int r = 0; r < rows; r++) bmax[r] = -INFINITY;
        for (int t = t0; t < cnt; t++) {
            for (int h = h0; h < h1; h++) {
                const int64_t off = base + t * row + (int64_t)h * j->width;
#ifdef PD_VEC
                if (vec_kind != VEC_NONE) {
                    const float scale = row_scale(j, j->k, off, vec_kind);
                    for (int r = (h - h0) * g; r < (h - h0 + 1) * g; r++) {
                        const float x = dot_vec(qv[r], j->k, off, hd, vec_kind) * scale;
                        s[r][t] = x;
                        if (x > bmax[r]) bmax[r] = x;
                    }
                    continue;
                }
#endif
                const float *kr = row_f32(j, j->k, off, buf, hd);
                for (int r = (h - h0) * g; r < (h - h0 + 1) * g; r++) {
                    const float x = dot(qv[r], kr, hd);
                    s[r][t] = x;
                    if (x > bmax[r]) bmax[r] = x;
                }
            }
        }
        for (int r = 0; r < rows; r++) {
            const float mnew = bmax[r] > m[r] ? bmax[r] : m[r];
            const float corr = expf(m[r] - mnew);  /* 0 on the first block (m = -inf) */
            l[r] *= corr;
            for (int d = 0; d < vd; d++) acc[r][d] *= corr;
            l[r] += exp_shifted(s[r] + t0, cnt - t0, mnew);
            m[r] = mnew;
        }
        for (int t = t0; t < cnt; t++) {
            for (int h = h0; h < h1; h++) {
#ifdef PD_VEC
                if (vec_kind != VEC_NONE) {
                    const int64_t off = base + t * row + (int64_t)h * j->width;
                    const float scale = row_scale(j, j->v, off, vec_kind);
                    for (int r = (h - h0) * g; r < (h - h0 + 1) * g; r++)
                        axpy_vec(acc[r], s[r][t] * scale, j->v, off, vd, vec_kind);
                    continue;
                }
#endif
                const float *vr = row_f32(j, j->v, base + t * row + (int64_t)h * j->width, buf, vd);
                for (int r = (h - h0) * g; r < (h - h0 + 1) * g; r++) {
                    const float p = s[r][t];
                    for (int d = 0; d < vd; d++) acc[r][d] += p * vr[d];
                }
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        float *o = j->out + ((int64_t)i * H + (h0 + r / g) * G + g0 + r % g) * vd;
        const float inv = 1.f / l[r];
        for (int d = 0; d < vd; d++) o[d] = acc[r][d] * inv;
    }
}

/* Units: (sequence, slice of kv heads, slice of query rows); `splits` head slices and
 * `row_splits` row slices per sequence, so that there are at least as many units as threads when
 * the batch is small (a latent cache has one kv head: its query rows are split). */
static void *run(void *arg) {
    const job_t *j = (const job_t *)arg;
    const int per_seq = j->splits * j->row_splits, units = j->b * per_seq;
    for (int u = j->thread; u < units; u += j->threads) {
        const int i = u / per_seq, part = (u % per_seq) / j->row_splits, rpart = u % j->row_splits;
        const int h0 = part * j->kvh / j->splits, h1 = (part + 1) * j->kvh / j->splits;
        const int g0 = rpart * j->group / j->row_splits, g1 = (rpart + 1) * j->group / j->row_splits;
        const int heads_at_once = MAX_ROWS / (g1 - g0);
        for (int h = h0; h < h1; h += heads_at_once) {
            const int hend = h + heads_at_once < h1 ? h + heads_at_once : h1;
            one_unit(j, i, h, hend, g0, g1);
        }
    }
    return NULL;
}

/* `kv_format`: KV_PLAIN (the cache in the queries' dtype, rows `hd` apart) or a quantized page
 * format (rows hd + 4 bytes apart). Returns 0 on success, -1 when a size is beyond the fixed
 * limits or the format is unknown (the caller falls back). */
int paged_decode_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                           const int64_t *tables, const int64_t *ctx, const int64_t *starts, float *out, int b, int kvh,
                           int group,
                           int hd, int vd, int bs, int max_blocks, float scale, int is_bf16, int kv_format, int threads) {
    if (hd > MAX_HD || vd > hd || vd < 1 || bs > MAX_BS || threads < 1) return -1;
    if (kv_format < KV_PLAIN || kv_format > KV_E5M2) return -1;
    if (kv_format != KV_PLAIN) pthread_once(&byte_values_once, fill_byte_values);
    const int width = kv_format == KV_PLAIN ? hd : hd + 4;
    if (threads > b * kvh * group) threads = b * kvh * group;
    if (threads > PD_MAX_THREADS) threads = PD_MAX_THREADS;
    int splits = 1, row_splits = (group + MAX_ROWS - 1) / MAX_ROWS; /* a unit holds <= MAX_ROWS query rows */
    while (b * splits < threads && splits < kvh) splits++;
    while (b * splits * row_splits < threads && row_splits < group) row_splits++;
    job_t jobs[PD_MAX_THREADS];
    for (int t = 0; t < threads; t++) {
        jobs[t] = (job_t){q, k_cache, v_cache, tables, ctx, starts, out, q_stride, b, kvh, group, hd, vd, bs,
                          max_blocks, is_bf16, kv_format, width, t, threads, splits, row_splits, scale};
    }
    pd_parallel(run, jobs, sizeof(job_t), threads);
    return 0;
}
