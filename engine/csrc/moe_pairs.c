/* See moe_pairs.h. */
#include "moe_pairs.h"

#include <stdlib.h>
#include <string.h>

void pd_pairs_free(pd_pairs_t *p) {
    free(p->start), free(p->active), free(p->tok), free(p->wt);
    memset(p, 0, sizeof(*p));
}

int pd_pairs_sort(const int64_t *ids, const float *weights, int T, int k, int E, pd_pairs_t *p) {
    const int pairs = T * k;
    memset(p, 0, sizeof(*p));
    p->start = calloc((size_t)E + 1, sizeof(int32_t));
    p->active = malloc(sizeof(int32_t) * (size_t)(E ? E : 1));
    p->tok = malloc(sizeof(int32_t) * (size_t)(pairs ? pairs : 1));
    p->wt = malloc(sizeof(float) * (size_t)(pairs ? pairs : 1));
    int32_t *cursor = malloc(sizeof(int32_t) * (size_t)(E ? E : 1));
    if (!p->start || !p->active || !p->tok || !p->wt || !cursor) {
        free(cursor);
        pd_pairs_free(p);
        return -2;
    }
    for (int i = 0; i < pairs; i++)
        if (ids[i] >= 0 && ids[i] < E) p->start[ids[i] + 1]++;
    for (int e = 0; e < E; e++) {
        if (p->start[e + 1]) p->active[p->n_active++] = e;
        p->start[e + 1] += p->start[e];
    }
    memcpy(cursor, p->start, sizeof(int32_t) * (size_t)E);
    for (int i = 0; i < pairs; i++) { /* stable: pairs keep token order within an expert */
        if (ids[i] < 0 || ids[i] >= E) continue;
        const int c = cursor[ids[i]]++;
        p->tok[c] = i / k;
        p->wt[c] = weights[i];
    }
    free(cursor);
    return 0;
}
