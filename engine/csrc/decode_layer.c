/* A Llama-family layer's decode step in two native calls (engine/models/decode_block.py): bfloat16
 * on AMX tiles, or float32 / bfloat16 on the panel kernel (then the MLP half is a SwiGLU MLP's two
 * linears): the attention half (the residual add, RMSNorm, q/k/v, Qwen3's q/k norms and RoPE,
 * the new K/V into the paged cache, attention, o_proj, the residual add and the next RMSNorm) and
 * a softmax-routed MoE half (router and experts). Each step is the kernel the torch path already
 * calls (kernels.h), in the same order on the same values, so the results are the same bits; what
 * goes is the Python between them: a dozen calls a layer, each paying for caches the weights just
 * streamed through. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_tiles.h"
#include "kernels.h"

#define BF16 1

typedef int (*linear_fn)(const void *x, const void *w, const void *bias, void *out, int T, int K, int N, int dtype,
                         int threads);

static int tiles_linear(const void *x, const void *w, const void *bias, void *out, int T, int K, int N, int dtype,
                        int threads) {
    (void)dtype;
    return pd_linear_bf16(x, K, w, bias, out, T, K, N, threads);
}

static int panels_linear(const void *x, const void *w, const void *bias, void *out, int T, int K, int N, int dtype,
                         int threads) {
    return pd_linear_panels(x, K, w, bias, out, T, K, N, dtype, 0, threads);
}

/* x (T, D): the residual stream, `delta` (T, D) the previous layer's MLP output or NULL. On return
 * x_out = x (+ delta) + attention(...) and h_out = post_norm(x_out), both (T, D). The query heads
 * attend over the cache through `tables` / `ctx` / `starts` (engine/attention.py NativeDecode) after
 * the new K/V are written at `slots`. qk_w / kk_w: Qwen3's per-head norms or NULL; qkv_b / o_b:
 * biases or NULL. `dtype`: 0 float32, 1 bfloat16; `linear`: the layers' kernel (AMX tiles or
 * panels); `amx_attention`: the tile attention kernel first (else the vector one). Returns 0, -1
 * for what the kernels refuse, -2 when out of memory. */
static int attention_block(const void *x, const void *delta, const void *in_w, const void *qkv_w, const void *qkv_b,
                           const void *q_w, const void *k_w, const void *cos, const void *sin, void *k_cache,
                           void *v_cache, const int64_t *slots, const int64_t *tables, const int64_t *ctx,
                           const int64_t *starts, const void *o_w, const void *o_b, const void *post_w, void *x_out,
                           void *h_out, int T, int D, int heads, int kv_heads, int hd, int bs, int max_blocks,
                           float eps, float scale, int dtype, linear_fn linear, int amx_attention, int threads) {
    const int qk = (heads + kv_heads) * hd, nqkv = qk + kv_heads * hd, qd = heads * hd;
    const size_t es = dtype == BF16 ? 2 : 4;
    char *h = malloc(es * (size_t)T * D), *qkv = malloc(es * (size_t)T * nqkv), *rot = malloc(es * (size_t)T * qk);
    char *att = dtype == BF16 ? malloc(es * (size_t)T * qd) : NULL, *o = malloc(es * (size_t)T * D);
    float *att32 = malloc(sizeof(float) * (size_t)T * qd);
    int rc = 0;
    if (!h || !qkv || !rot || (dtype == BF16 && !att) || !o || !att32) {
        rc = -2;
        goto done;
    }
    /* the residual add and the input norm: x_out holds the stream from here on */
    pd_rms_norm(x, D, delta, delta != NULL ? x_out : NULL, in_w, h, T, D, eps, dtype, threads);
    if (delta == NULL) memcpy(x_out, x, es * (size_t)T * D);
    if ((rc = linear(h, qkv_w, qkv_b, qkv, T, D, nqkv, dtype, threads)) != 0) goto done;
    rc = pd_rope(qkv, nqkv, hd, cos, sin, q_w, k_w, rot, qk, hd, T, heads + kv_heads, heads, hd, eps, dtype, threads);
    if (rc != 0) goto done;
    for (int t = 0; t < T; t++) { /* the new keys (rotated) and values at their slots */
        const int64_t row = slots[t] * kv_heads * hd;
        memcpy((char *)k_cache + row * es, rot + ((int64_t)t * qk + qd) * es, es * (size_t)kv_heads * hd);
        memcpy((char *)v_cache + row * es, qkv + ((int64_t)t * nqkv + qk) * es, es * (size_t)kv_heads * hd);
    }
    rc = amx_attention ? decode_attention_amx((const uint16_t *)rot, qk, k_cache, v_cache, tables, ctx, starts, att32,
                                              T, kv_heads, heads / kv_heads, hd, hd, bs, max_blocks, scale, threads)
                       : -1;
    if (rc == -1)
        rc = paged_decode_attention(rot, qk, k_cache, v_cache, tables, ctx, starts, att32, T, kv_heads,
                                    heads / kv_heads, hd, hd, bs, max_blocks, scale, dtype, 0, threads);
    if (rc != 0) goto done;
    if (dtype == BF16)
        for (int64_t i = 0; i < (int64_t)T * qd; i++) ((uint16_t *)att)[i] = f2bf(att32[i]);
    if ((rc = linear(dtype == BF16 ? (const void *)att : att32, o_w, o_b, o, T, qd, D, dtype, threads)) != 0) goto done;
    pd_rms_norm(x_out, D, o, x_out, post_w, h_out, T, D, eps, dtype, threads); /* in place: row by row */
done:
    free(h), free(qkv), free(rot), free(att), free(o), free(att32);
    return rc;
}

/* The attention half with its linears on AMX tiles (engine/csrc/linear_bf16.c), bfloat16. */
int pd_attention_block_bf16(const uint16_t *x, const uint16_t *delta, const uint16_t *in_w, const uint16_t *qkv_w,
                            const uint16_t *qkv_b, const uint16_t *q_w, const uint16_t *k_w, const uint16_t *cos,
                            const uint16_t *sin, uint16_t *k_cache, uint16_t *v_cache, const int64_t *slots,
                            const int64_t *tables, const int64_t *ctx, const int64_t *starts, const uint16_t *o_w,
                            const uint16_t *o_b, const uint16_t *post_w, uint16_t *x_out, uint16_t *h_out, int T,
                            int D, int heads, int kv_heads, int hd, int bs, int max_blocks, float eps, float scale,
                            int amx_attention, int threads) {
    return attention_block(x, delta, in_w, qkv_w, qkv_b, q_w, k_w, cos, sin, k_cache, v_cache, slots, tables, ctx,
                           starts, o_w, o_b, post_w, x_out, h_out, T, D, heads, kv_heads, hd, bs, max_blocks, eps,
                           scale, BF16, tiles_linear, amx_attention, threads);
}

/* The attention half with its linears on the panel kernel (engine/csrc/linear_panels.c), float32
 * (dtype 0) or bfloat16 (1), the vector decode attention. */
int pd_attention_block_panels(const void *x, const void *delta, const void *in_w, const void *qkv_w, const void *qkv_b,
                              const void *q_w, const void *k_w, const void *cos, const void *sin, void *k_cache,
                              void *v_cache, const int64_t *slots, const int64_t *tables, const int64_t *ctx,
                              const int64_t *starts, const void *o_w, const void *o_b, const void *post_w, void *x_out,
                              void *h_out, int T, int D, int heads, int kv_heads, int hd, int bs, int max_blocks,
                              float eps, float scale, int dtype, int threads) {
    return attention_block(x, delta, in_w, qkv_w, qkv_b, q_w, k_w, cos, sin, k_cache, v_cache, slots, tables, ctx,
                           starts, o_w, o_b, post_w, x_out, h_out, T, D, heads, kv_heads, hd, bs, max_blocks, eps,
                           scale, dtype, panels_linear, 0, threads);
}

/* A SwiGLU MLP on the panel kernel: out (T, D) = down(silu(gate(h)) * up(h)), gate_up packed paired
 * (engine/linear_panels.py pair_gate_up), I the MLP's width. Returns as pd_linear_panels. */
int pd_mlp_panels(const void *h, const void *gate_up, const void *down, void *out, int T, int D, int I, int dtype,
                  int threads) {
    void *act = malloc((dtype == BF16 ? 2 : 4) * (size_t)T * I);
    if (act == NULL) return -2;
    int rc = pd_linear_panels(h, D, gate_up, NULL, act, T, D, 2 * I, dtype, 1, threads);
    if (rc == 0) rc = pd_linear_panels(act, I, down, NULL, out, T, I, D, dtype, 0, threads);
    free(act);
    return rc;
}

/* A softmax-routed MoE MLP on h (T, D): the router (weight router_w (E, D)) picks each token's k
 * experts, then the packed experts run (moe_experts_bf16). out (T, D). Returns as the experts. */
int pd_moe_block_bf16(const uint16_t *h, const uint16_t *router_w, const uint16_t *gate_up, const uint16_t *down,
                      uint16_t *out, int T, int D, int E, int k, int I, int renorm, int round_weights, int threads) {
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)T * k);
    float *weights = malloc(sizeof(float) * (size_t)T * k);
    int rc = -2;
    if (ids && weights) {
        rc = pd_route_softmax(NULL, h, router_w, D, BF16, T, E, k, renorm, round_weights, ids, weights);
        if (rc == 0) rc = moe_experts_bf16(h, gate_up, down, ids, weights, out, T, k, E, D, I, threads, 1);
    }
    free(ids), free(weights);
    return rc;
}
