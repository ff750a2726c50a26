/* The kernels' entry points (engine/native.py loads them with ctypes); the composite decode steps
 * (decode_layer.c) call them directly. */
#ifndef PD_KERNELS_H
#define PD_KERNELS_H
#include <stdint.h>

int pd_rms_norm(const void *x, long x_stride, const void *delta, void *sum, const void *w, void *out, int rows,
                int dim, float eps, int dtype, int threads);
int pd_rope(const void *src, long token_stride, long head_stride, const void *cos, const void *sin, const void *qw,
            const void *kw, void *out, long out_token_stride, long out_head_stride, int tokens, int heads,
            int q_heads, int hd, float eps, int dtype, int threads);
int pd_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias, uint16_t *out, int T,
                   int K, int N, int threads);
int pd_linear_panels(const void *x, int64_t x_stride, const void *w, const void *bias, void *out, int T, int K, int N,
                     int bf16, int swiglu, int threads);
int pd_linear_heads_bf16(const uint16_t *x, int64_t x_stride, int64_t x_head, const uint16_t *w, uint16_t *out,
                         int64_t out_stride, int64_t out_head, int T, int K, int N, int heads, int threads);
int decode_attention_amx(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                         const int64_t *tables, const int64_t *ctx, const int64_t *starts, float *out, int b, int kvh,
                         int group, int hd, int vd, int bs, int max_blocks, float scale, int threads);
int paged_decode_attention(const void *q, int64_t q_stride, const void *k_cache, const void *v_cache,
                           const int64_t *tables, const int64_t *ctx, const int64_t *starts, float *out, int b, int kvh,
                           int group, int hd, int vd, int bs, int max_blocks, float scale, int is_bf16, int kv_format,
                           int threads);
int pd_route_softmax(const void *logits, const void *x, const void *w, int H, int dtype, int T, int E, int k,
                     int renorm, int round_weights, int64_t *ids, float *weights);
int moe_experts_bf16(const uint16_t *x, const uint16_t *gate_up, const uint16_t *down, const int64_t *ids,
                     const float *weights, uint16_t *out, int T, int k, int E, int H, int I, int threads, int amx);
#endif
