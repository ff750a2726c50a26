/* y[M][N] = x[M][K] . w[N][K]^T (+ bias[N]) for the few rows of a decode step, float32.
 *
 * oneDNN's and MKL's fp32 kernels run far below this CPU's FMA rate and memory bandwidth at
 * 1-16 rows (measured on an AVX2 EPYC: 4-10 GB/s of weights). Here each weight is read from
 * memory once: blocks of 4 weight rows stay in L1 while every pair of input rows passes over
 * them, 8 accumulators in vector registers (dot-product form, K in steps of 8). N is split
 * over POSIX threads. Needs AVX2 + FMA (built with -march=native); otherwise the entry point
 * returns -1 and the caller keeps oneDNN.
 */
#include <pthread.h>
#include <stdint.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

typedef struct {
    const float *x, *w, *bias;
    float *y;
    int M, N, K, n0, n1;
} gemm_job_t;

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

static void block(const gemm_job_t *j, int n, int nb, int m, int mb) {
    const int K = j->K, N = j->N;
    __m256 acc[2][4];
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 4; b++) acc[a][b] = _mm256_setzero_ps();
    const float *w0 = j->w + (int64_t)n * K;
    const float *x0 = j->x + (int64_t)m * K;
    if (nb == 4 && mb == 2) {
        for (int k = 0; k < K; k += 8) {
            const __m256 wa = _mm256_loadu_ps(w0 + k), wb = _mm256_loadu_ps(w0 + K + k);
            const __m256 wc = _mm256_loadu_ps(w0 + 2 * K + k), wd = _mm256_loadu_ps(w0 + 3 * K + k);
            const __m256 xa = _mm256_loadu_ps(x0 + k), xb = _mm256_loadu_ps(x0 + K + k);
            acc[0][0] = _mm256_fmadd_ps(xa, wa, acc[0][0]);
            acc[0][1] = _mm256_fmadd_ps(xa, wb, acc[0][1]);
            acc[0][2] = _mm256_fmadd_ps(xa, wc, acc[0][2]);
            acc[0][3] = _mm256_fmadd_ps(xa, wd, acc[0][3]);
            acc[1][0] = _mm256_fmadd_ps(xb, wa, acc[1][0]);
            acc[1][1] = _mm256_fmadd_ps(xb, wb, acc[1][1]);
            acc[1][2] = _mm256_fmadd_ps(xb, wc, acc[1][2]);
            acc[1][3] = _mm256_fmadd_ps(xb, wd, acc[1][3]);
        }
    } else {  /* edges: fewer rows of x or of w */
        for (int k = 0; k < K; k += 8) {
            for (int a = 0; a < mb; a++) {
                const __m256 xv = _mm256_loadu_ps(x0 + (int64_t)a * K + k);
                for (int b = 0; b < nb; b++)
                    acc[a][b] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w0 + (int64_t)b * K + k), acc[a][b]);
            }
        }
    }
    for (int a = 0; a < mb; a++)
        for (int b = 0; b < nb; b++)
            j->y[(int64_t)(m + a) * N + n + b] = hsum(acc[a][b]) + (j->bias ? j->bias[n + b] : 0.f);
}

static void *run(void *arg) {
    const gemm_job_t *j = (const gemm_job_t *)arg;
    for (int n = j->n0; n < j->n1; n += 4) {
        const int nb = j->n1 - n < 4 ? j->n1 - n : 4;
        for (int m = 0; m < j->M; m += 2) block(j, n, nb, m, j->M - m < 2 ? j->M - m : 2);
    }
    return 0;
}

int small_gemm_f32(const float *x, const float *w, const float *bias, float *y, int M, int N, int K, int threads) {
    if (K % 8 != 0 || M < 1 || N < 1 || threads < 1) return -1;
    if (threads > 64) threads = 64;
    if (threads > (N + 3) / 4) threads = (N + 3) / 4;
    gemm_job_t jobs[64];
    pthread_t tids[64];
    const int per = ((N + threads - 1) / threads + 3) / 4 * 4;  /* a multiple of 4 weight rows each */
    for (int t = 0; t < threads; t++) {
        const int n0 = t * per < N ? t * per : N, n1 = (t + 1) * per < N ? (t + 1) * per : N;
        jobs[t] = (gemm_job_t){x, w, bias, y, M, N, K, n0, n1};
    }
    int spawned = 0;
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&tids[t], 0, run, &jobs[t]) != 0) break;
        spawned = t;
    }
    for (int t = spawned + 1; t < threads; t++) run(&jobs[t]);
    run(&jobs[0]);
    for (int t = 1; t <= spawned; t++) pthread_join(tids[t], 0);
    return 0;
}
#else
int small_gemm_f32(const float *x, const float *w, const float *bias, float *y, int M, int N, int K, int threads) {
    (void)x; (void)w; (void)bias; (void)y; (void)M; (void)N; (void)K; (void)threads;
    return -1;
}
#endif
