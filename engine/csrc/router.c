/* A softmax router's choice (Mixtral, Qwen3-MoE) in one pass (its logits too, for a few tokens), as
 * engine/models/moe.py's Router computes it with torch: softmax over the experts in float32, the top
 * k, renormalised to sum to one if the config says, and (Qwen3-MoE) rounded to bfloat16 as its
 * weights are handed on in the activations' dtype. Softmax is monotonic, so the top k of the
 * probabilities are the top k of the logits (ties: the lower expert); the k chosen are written in
 * descending order, as torch.topk writes them. Separate products and sums, as torch's separate ops
 * round them. DeepSeek-V3's grouped sigmoid router: pd_route_grouped, below. */
#pragma GCC optimize("fp-contract=off")
#pragma STDC FP_CONTRACT OFF

#include <math.h>
#include <stdint.h>

#include "bf16_tiles.h"
#include "kernels.h"

#define MAX_EXPERTS 1024

#define LANES 16

static inline float value(const void *p, int64_t i, int dtype) {
    return dtype == 1 ? bf2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* x[H] . w[H] in float32 over LANES partial sums (so it vectorizes). */
static float dot(const void *x, const void *w, int64_t xi, int64_t wi, int H, int dtype) {
    float acc[LANES] = {0};
    int h = 0;
    for (; h + LANES <= H; h += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += value(x, xi + h + j, dtype) * value(w, wi + h + j, dtype);
    for (; h < H; h++) acc[0] += value(x, xi + h, dtype) * value(w, wi + h, dtype);
    float s = 0.0f;
    for (int j = 0; j < LANES; j++) s += acc[j];
    return s;
}

/* The k best of v[0, n) among those with keep[i] (NULL: all), descending, ties to the lower index;
 * returns how many were found (fewer than k only when fewer are kept). */
static int top_k(const float *v, const uint8_t *keep, int n, int k, int *idx) {
    float best[MAX_EXPERTS];
    int m = 0;
    for (int i = 0; i < n; i++) {
        if ((keep != NULL && !keep[i]) || (m == k && !(v[i] > best[k - 1]))) continue;
        int j = m < k ? m++ : k - 1;
        for (; j > 0 && v[i] > best[j - 1]; j--) best[j] = best[j - 1], idx[j] = idx[j - 1];
        best[j] = v[i], idx[j] = i;
    }
    return m;
}

/* The logits are logits[T][E], or with logits NULL x[T][H] times the router's weight w[E][H] (dtype 0
 * float32, 1 bfloat16; rounded to the dtype, as a linear layer's output is) -> ids[T][k],
 * weights[T][k] (float32). Returns 0, or -1 when k or E is out of range. */
int pd_route_softmax(const void *logits, const void *x, const void *w, int H, int dtype, int T, int E, int k,
                     int renorm, int round_weights, int64_t *ids, float *weights) {
    if (E <= 0 || E > MAX_EXPERTS || k <= 0 || k > E || (logits == NULL && (x == NULL || w == NULL))) return -1;
    float p[MAX_EXPERTS];
    int idx[MAX_EXPERTS];
    for (int t = 0; t < T; t++) {
        float mx = -INFINITY;
        for (int e = 0; e < E; e++) {
            if (logits != NULL) {
                p[e] = value(logits, (int64_t)t * E + e, dtype);
            } else {
                const float l = dot(x, w, (int64_t)t * H, (int64_t)e * H, H, dtype);
                p[e] = dtype == 1 ? round_bf(l) : l;
            }
            mx = p[e] > mx ? p[e] : mx;
        }
        float sum = 0.0f;
        for (int e = 0; e < E; e++) {
            p[e] = expf(p[e] - mx);
            sum += p[e];
        }
        top_k(p, NULL, E, k, idx);
        float *wt = weights + (int64_t)t * k, chosen = 0.0f;
        for (int j = 0; j < k; j++) {
            ids[(int64_t)t * k + j] = idx[j];
            wt[j] = p[idx[j]] / sum;
            chosen += wt[j];
        }
        for (int j = 0; j < k; j++) {
            if (renorm) wt[j] = wt[j] / chosen;
            if (round_weights) wt[j] = round_bf(wt[j]);
        }
    }
    return 0;
}

/* DeepSeek-V3's router (engine/models/moe.py, "deepseek_v3"): sigmoid scores of float32 logits; the
 * choice adds the correction bias and keeps the `topk_group` of `groups` groups whose two best
 * biased scores sum highest; the weights are the unbiased scores of the k chosen, renormalised if
 * `renorm`, times `scaling`. Logits as pd_route_softmax's, but always float32, never rounded (dtype:
 * x's and w's; bias float32). Returns 0, or -1 for shapes out of range. */
int pd_route_grouped(const float *logits, const void *x, const void *w, const float *bias, int H, int dtype, int T,
                     int E, int k, int groups, int topk_group, int renorm, float scaling, int64_t *ids,
                     float *weights) {
    if (E <= 0 || E > MAX_EXPERTS || groups <= 0 || E % groups || k <= 0 || k > E || topk_group <= 0 ||
        topk_group > groups || E / groups < 2 || (logits == NULL && (x == NULL || w == NULL)))
        return -1;
    const int per = E / groups;
    float score[MAX_EXPERTS], choice[MAX_EXPERTS], group_score[MAX_EXPERTS];
    uint8_t keep[MAX_EXPERTS];
    int idx[MAX_EXPERTS];
    for (int t = 0; t < T; t++) {
        for (int e = 0; e < E; e++) {
            const float l =
                logits != NULL ? logits[(int64_t)t * E + e] : dot(x, w, (int64_t)t * H, (int64_t)e * H, H, dtype);
            score[e] = 1.0f / (1.0f + expf(-l));
            choice[e] = score[e] + bias[e];
        }
        for (int g = 0; g < groups; g++) {
            int two[2];
            top_k(choice + g * per, NULL, per, 2, two);
            group_score[g] = choice[g * per + two[0]] + choice[g * per + two[1]];
        }
        const int kept = top_k(group_score, NULL, groups, topk_group, idx);
        for (int e = 0; e < E; e++) keep[e] = 0;
        for (int i = 0; i < kept; i++) for (int e = idx[i] * per; e < (idx[i] + 1) * per; e++) keep[e] = 1;
        const int n = top_k(choice, keep, E, k, idx);
        float *wt = weights + (int64_t)t * k, sum = 0.0f;
        for (int j = 0; j < k; j++) {
            ids[(int64_t)t * k + j] = j < n ? idx[j] : idx[0];
            wt[j] = j < n ? score[idx[j]] : 0.0f;
            sum += wt[j];
        }
        for (int j = 0; j < k; j++) wt[j] = (renorm ? wt[j] / (sum + 1e-20f) : wt[j]) * scaling;
    }
    return 0;
}
