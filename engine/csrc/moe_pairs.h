/* A mixture-of-experts layer's (token, expert) pairs grouped by expert: shared by the experts
 * kernels (moe_experts.c, float32; moe_experts_bf16.c, bfloat16 tiles). */
#ifndef PD_MOE_PAIRS_H
#define PD_MOE_PAIRS_H
#include <stdint.h>

typedef struct {
    int32_t *start;  /* expert -> its first pair; start[E] = the pairs kept */
    int32_t *active; /* the experts with pairs, ascending */
    int32_t *tok;    /* pair -> token, grouped by expert, token order within an expert */
    float *wt;       /* pair -> router weight */
    int n_active;
} pd_pairs_t;

/* Counting sort of ids[T][k] (weights[T][k]) by expert; pairs whose expert is outside [0, E) are
 * another rank's (expert parallelism) and dropped. Returns 0, or -2 when out of memory (nothing
 * left allocated). */
int pd_pairs_sort(const int64_t *ids, const float *weights, int T, int k, int E, pd_pairs_t *p);
void pd_pairs_free(pd_pairs_t *p);
#endif
