/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) for few rows M, float32: nn.Linear of a decode step.
 *
 * Why: with 2-32 rows the BLAS runs far below both the FLOP peak and the memory bandwidth
 * (measured with the 100M checkpoint's weights: 8 rows 58 GFLOP/s, 16 rows 121, against
 * 19 GFLOP/s for one row, which streams the weights at ~40 GB/s), while a decode step's
 * linear layers must read every weight once anyway. This kernel reads each weight row once
 * per step and multiplies it with all M inputs while it is in L1: a 4 x 4 register tile of
 * (input row, weight row) dot products, 16 lanes of K at a time, reduced at the end.
 *
 * GCC vector extensions, not intrinsics: the same source builds for whatever the compiler
 * targets (-march=native), but it is fast only with 64-byte vectors (AVX-512): GCC lowers
 * them badly to AVX2, where this measured 10-100x slower than torch, so the engine does not
 * call it there (csrc/vector_width.c).
 */
#include <stdint.h>
#include <string.h>

typedef float vf __attribute__((vector_size(64)));
#define LANES 16
#define NR 4 /* weight rows per tile */

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

typedef int32_t vi __attribute__((vector_size(64)));

/* Sum of the 16 lanes by halving (4 shuffles and adds), not lane by lane. */
static inline float hsum(vf v) {
    v += __builtin_shuffle(v, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    v += __builtin_shuffle(v, (vi){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
    v += __builtin_shuffle(v, (vi){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
    v += __builtin_shuffle(v, (vi){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0});
    return v[0];
}

/* Rows [m0, m0 + MR) of x against weight rows [n0, n0 + nr), nr <= NR. Always inlined with
 * constant MR and nr so the accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(
    const float *restrict x, const float *restrict w, const float *restrict bias,
    float *restrict y, int64_t K, int64_t N, int64_t m0, const int64_t MR, int64_t n0,
    const int64_t nr) {
    vf acc[MR][NR];
    for (int64_t i = 0; i < MR; i++)
        for (int64_t j = 0; j < nr; j++) acc[i][j] = (vf){0};
    const int64_t kv = K - K % LANES;
    for (int64_t k = 0; k < kv; k += LANES) {
        vf wv[NR];
        for (int64_t j = 0; j < nr; j++) wv[j] = load(w + (n0 + j) * K + k);
        for (int64_t i = 0; i < MR; i++) {
            const vf xv = load(x + (m0 + i) * K + k);
            for (int64_t j = 0; j < nr; j++) acc[i][j] += xv * wv[j];
        }
    }
    for (int64_t i = 0; i < MR; i++) {
        for (int64_t j = 0; j < nr; j++) {
            float s = hsum(acc[i][j]);
            const float *xr = x + (m0 + i) * K, *wr = w + (n0 + j) * K;
            for (int64_t k = kv; k < K; k++) s += xr[k] * wr[k];
            y[(m0 + i) * N + n0 + j] = bias ? s + bias[n0 + j] : s;
        }
    }
}

static inline __attribute__((always_inline)) void columns(
    const float *restrict x, const float *restrict w, const float *restrict bias,
    float *restrict y, int64_t M, int64_t K, int64_t N, int64_t n0, const int64_t nr) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) tile(x, w, bias, y, K, N, m, 4, n0, nr);
    switch (M - m) {
    case 3: tile(x, w, bias, y, K, N, m, 3, n0, nr); break;
    case 2: tile(x, w, bias, y, K, N, m, 2, n0, nr); break;
    case 1: tile(x, w, bias, y, K, N, m, 1, n0, nr); break;
    }
}

/* x: [M, K], w: [N, K], bias: [N] or NULL, y: [M, N]; all contiguous float32. */
void skinny_gemm(const float *x, const float *w, const float *bias, float *y, int64_t M,
                 int64_t K, int64_t N) {
    const int64_t tiles = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t n0 = t * NR;
        if (n0 + NR <= N)
            columns(x, w, bias, y, M, K, N, n0, NR);
        else
            for (int64_t n = n0; n < N; n++) columns(x, w, bias, y, M, K, N, n, 1);
    }
}
