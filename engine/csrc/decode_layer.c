/* A Llama-family layer's decode step in two native calls (engine/models/decode_block.py), bfloat16
 * on AMX tiles: the attention half (the residual add, RMSNorm, q/k/v, Qwen3's q/k norms and RoPE,
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

/* x (T, D): the residual stream, `delta` (T, D) the previous layer's MLP output or NULL. On return
 * x_out = x (+ delta) + attention(...) and h_out = post_norm(x_out), both (T, D). The query heads
 * attend over the cache through `tables` / `ctx` / `starts` (engine/attention.py NativeDecode) after
 * the new K/V are written at `slots`. qk_w / kk_w: Qwen3's per-head norms or NULL; qkv_b / o_b:
 * biases or NULL. `amx_attention`: the tile attention kernel first (else the vector one).
 * Returns 0, -1 for what the kernels refuse, -2 when out of memory. */
int pd_attention_block_bf16(const uint16_t *x, const uint16_t *delta, const uint16_t *in_w, const uint16_t *qkv_w,
                            const uint16_t *qkv_b, const uint16_t *q_w, const uint16_t *k_w, const uint16_t *cos,
                            const uint16_t *sin, uint16_t *k_cache, uint16_t *v_cache, const int64_t *slots,
                            const int64_t *tables, const int64_t *ctx, const int64_t *starts, const uint16_t *o_w,
                            const uint16_t *o_b, const uint16_t *post_w, uint16_t *x_out, uint16_t *h_out, int T,
                            int D, int heads, int kv_heads, int hd, int bs, int max_blocks, float eps, float scale,
                            int amx_attention, int threads) {
    const int qk = (heads + kv_heads) * hd, nqkv = qk + kv_heads * hd, qd = heads * hd;
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)T * D), *qkv = malloc(sizeof(uint16_t) * (size_t)T * nqkv);
    uint16_t *rot = malloc(sizeof(uint16_t) * (size_t)T * qk), *att = malloc(sizeof(uint16_t) * (size_t)T * qd);
    uint16_t *o = malloc(sizeof(uint16_t) * (size_t)T * D);
    float *att32 = malloc(sizeof(float) * (size_t)T * qd);
    int rc = 0;
    if (!h || !qkv || !rot || !att || !o || !att32) {
        rc = -2;
        goto done;
    }
    /* the residual add and the input norm: x_out holds the stream from here on */
    pd_rms_norm(x, D, delta, delta != NULL ? x_out : NULL, in_w, h, T, D, eps, BF16, threads);
    if (delta == NULL) memcpy(x_out, x, sizeof(uint16_t) * (size_t)T * D);
    if ((rc = pd_linear_bf16(h, D, qkv_w, qkv_b, qkv, T, D, nqkv, threads)) != 0) goto done;
    rc = pd_rope(qkv, nqkv, hd, cos, sin, q_w, k_w, rot, qk, hd, T, heads + kv_heads, heads, hd, eps, BF16, threads);
    if (rc != 0) goto done;
    for (int t = 0; t < T; t++) { /* the new keys (rotated) and values at their slots */
        const int64_t row = slots[t] * kv_heads * hd;
        memcpy(k_cache + row, rot + (int64_t)t * qk + qd, sizeof(uint16_t) * (size_t)kv_heads * hd);
        memcpy(v_cache + row, qkv + (int64_t)t * nqkv + qk, sizeof(uint16_t) * (size_t)kv_heads * hd);
    }
    rc = amx_attention ? decode_attention_amx(rot, qk, k_cache, v_cache, tables, ctx, starts, att32, T, kv_heads,
                                              heads / kv_heads, hd, hd, bs, max_blocks, scale, threads)
                       : -1;
    if (rc == -1)
        rc = paged_decode_attention(rot, qk, k_cache, v_cache, tables, ctx, starts, att32, T, kv_heads,
                                    heads / kv_heads, hd, hd, bs, max_blocks, scale, BF16, 0, threads);
    if (rc != 0) goto done;
    for (int64_t i = 0; i < (int64_t)T * qd; i++) att[i] = f2bf(att32[i]);
    if ((rc = pd_linear_bf16(att, qd, o_w, o_b, o, T, qd, D, threads)) != 0) goto done;
    pd_rms_norm(x_out, D, o, x_out, post_w, h_out, T, D, eps, BF16, threads); /* in place: row by row */
done:
    free(h), free(qkv), free(rot), free(att), free(o), free(att32);
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
