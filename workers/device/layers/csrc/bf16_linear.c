/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) in float32, with w kept as bfloat16: the linear
 * layers on CPU of checkpoints whose weights are bfloat16 (most published ones) served in
 * float32 -- decode and mixed steps always, and every step once the float32 weight is freed
 * (within 5-15 % of the BLAS on large prefill steps).
 *
 * Why: a decode step reads every weight once for a few dozen rows at most, so its linear
 * layers are bound by memory traffic, not FLOPs. A bfloat16 weight widened to float32 is
 * exact (its 16 bits become the float's upper half), so keeping those weights in bfloat16
 * halves the bytes a step streams without changing a single value: the products and sums
 * are float32, as with the float32 copy (only the summation order differs, as between any
 * two GEMMs). Measured with the 100M checkpoint's weights against torch's linear on the
 * float32 copy: 2-4x from 1 to 16 rows, ~2x at 32, 1.5x at 64 (README).
 *
 * Layout (made by workers/layers/cpu_kernels.py pack_bf16_weight): w is cut into panels of
 * NB = 32 output features; for each k a panel stores 16 32-bit words, word j holding feature
 * j in its low half and feature 16 + j in its high half ([panel][K][16], the last panel
 * zero-padded). One 64-byte load per k then widens to two float vectors with a shift and a
 * mask. A register tile of up to MR = 12 input rows x 32 features (24 vector accumulators)
 * takes outer products: per k, 12 broadcasts of x, no horizontal sums. Each block of x rows
 * is first copied as [K][rows] so its broadcasts come from one cache line per k.
 * Threads split the panels; a panel stays in L1/L2 while every row tile passes over it.
 *
 * GCC vector extensions, not intrinsics: the same source builds for whatever the compiler
 * targets (-march=native). The tiles are sized per vector width: AVX-512 as above; with
 * AVX2's 32-byte vectors and 16 registers, a line is two vectors of words and a tile of 6
 * rows takes one of them at a time (16 features, 12 accumulators), which measured 1.3-2.2x
 * torch's (AVX2) linear on the float32 weights from 1 to 32 rows and 0.86x at 1,024-2,048;
 * the same 64-byte code lowered to AVX2 had measured 10-100x slower than torch. Builds
 * with narrower vectors compile but are not called (csrc/vector_width.c).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_width.h"

/* Register tile: MR rows x two vector accumulators (one vector of a line's words: its low
 * and high halves) a pass: 12 rows x 32 features with AVX-512; 6 rows x 16 features with
 * AVX2, where a line is two vectors of words, one per pass. */
#define MR (NACC / 2) /* input rows per register tile */
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));
#define WORDS 16        /* 32-bit words per k of a panel: one 64-byte line */
#define RV (WORDS / LANES) /* vectors of words per line */
#define NB 32           /* output features per panel */
#define MC 192  /* input rows per block: a block of copied x stays in L2 */
#define PF 128  /* k steps (64-byte lines) the first row tile prefetches ahead: 8 KiB */

/* A prefetch into L2 as an asm statement that takes its address in a register: with
 * __builtin_prefetch, or with a memory operand, GCC stored the 24 accumulators to memory on
 * every k (the compiler must assume the prefetch reads them), which halved the tile's speed.
 * Other CPUs go without. */
#if defined(__x86_64__)
#define PREFETCH(p) __asm__("prefetcht1 (%0)" : : "r"(p))
#else
#define PREFETCH(p) ((void)(p))
#endif

static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* R rows of copied x (xp: [K][R]) against one panel's vectors of words [v0, v0 + NV) (all of
 * them: NV = RV; one: NV = 1), writing their features of y[R, n0 : n0 + nvalid]. Always
 * inlined with constant R and NV so the accumulators live in registers. The first row tile
 * of a panel streams it from memory and prefetches 8 KiB ahead into L2, so that its bytes
 * arrive while the tile computes: measured over the 100M checkpoint's weights, 8 rows went
 * from 14.5 to 9 ms and 32 rows from 34 to 23 ms per forward. Later tiles find the panel in
 * cache. */
static inline __attribute__((always_inline)) void tile(
    const float *restrict xp, const uint32_t *restrict panel, const float *restrict bias,
    float *restrict y, int64_t K, int64_t N, const int64_t R, int64_t n0, int64_t nvalid,
    int64_t v0, const int64_t NV, const int prefetch) {
    vf acc[R][2 * NV]; /* [i][2v], [i][2v + 1]: features (v0 + v) * LANES, and 16 onwards */
    for (int64_t i = 0; i < R; i++)
        for (int64_t a = 0; a < 2 * NV; a++) acc[i][a] = (vf){0};
    const vu high = (vu){0} + 0xFFFF0000u;
    for (int64_t k = 0; k < K; k++) {
        if (prefetch) PREFETCH(panel + (k + PF) * WORDS);
        for (int64_t v = 0; v < NV; v++) {
            vu raw;
            memcpy(&raw, panel + k * WORDS + (v0 + v) * LANES, sizeof raw);
            const vf w0 = (vf)(raw << 16), w1 = (vf)(raw & high);
            for (int64_t i = 0; i < R; i++) {
                const float xv = xp[k * R + i];
                acc[i][2 * v] += xv * w0;
                acc[i][2 * v + 1] += xv * w1;
            }
        }
    }
    float b[NB] = {0};
    if (bias) memcpy(b, bias + n0, nvalid * sizeof(float));
    for (int64_t i = 0; i < R; i++) {
        float tmp[NB]; /* the last, partial panel: only its valid features are written */
        float *out = nvalid == NB ? y + i * N + n0 : tmp;
        for (int64_t a = 0; a < 2 * NV; a++) {
            const int64_t f = (a & 1) * 16 + (v0 + a / 2) * LANES;
            vf bv;
            memcpy(&bv, b + f, sizeof bv);
            store(out + f, acc[i][a] + bv);
            if (out == tmp && f < nvalid)
                memcpy(y + i * N + n0 + f, tmp + f,
                       (nvalid - f < LANES ? nvalid - f : LANES) * sizeof(float));
        }
    }
}

/* A tile of r rows over the whole panel: with RV > 1 (narrow vectors), one pass per vector
 * of words -- 2 accumulators per row leave room for MR rows -- except for 1 or 2 rows, whose
 * steps are bound by memory: one pass over the line keeps the panel streaming. */
#define PASS(r, v0, nv, pf)                                                                  \
    tile(xp + m * K, panel, bias, y + m * N, K, N, r, n0, nvalid, v0, nv, pf)
#define TILE(r)                                                                              \
    do {                                                                                     \
        if ((r) <= 2) {                                                                      \
            if (m == 0)                                                                      \
                PASS(r, 0, RV, 1);                                                           \
            else                                                                             \
                PASS(r, 0, RV, 0);                                                           \
        } else {                                                                             \
            for (int64_t h = 0; h < RV; h++) {                                               \
                if (m == 0 && h == 0) /* a literal flag: no test in the k loop */            \
                    PASS(r, h, 1, 1);                                                        \
                else                                                                         \
                    PASS(r, h, 1, 0);                                                        \
            }                                                                                \
        }                                                                                    \
    } while (0)

/* Rows [0, M) of a block (xp: its row tiles copied) against one panel. */
static void rows(const float *xp, const uint32_t *panel, const float *bias, float *y,
                 int64_t M, int64_t K, int64_t N, int64_t n0, int64_t nvalid) {
    int64_t m = 0;
    for (; m + MR <= M; m += MR) TILE(MR);
    switch (M - m) { /* the last tile: its own constant row count */
    case 11: TILE(11); break;
    case 10: TILE(10); break;
    case 9: TILE(9); break;
    case 8: TILE(8); break;
    case 7: TILE(7); break;
    case 6: TILE(6); break;
    case 5: TILE(5); break;
    case 4: TILE(4); break;
    case 3: TILE(3); break;
    case 2: TILE(2); break;
    case 1: TILE(1); break;
    }
}

/* x: [M, K] and y: [M, N] contiguous float32, wp: the packed bfloat16 weight (see above),
 * bias: [N] or NULL. Returns 0, or -1 when the scratch for x cannot be allocated. */
int bf16_linear(const float *x, const uint32_t *wp, const float *bias, float *y, int64_t M,
                int64_t K, int64_t N, int64_t threads) {
    if (M <= 0) return 0; /* malloc(0) may return NULL */
    const int64_t panels = (N + NB - 1) / NB;
    float *xp = malloc((M < MC ? M : MC) * K * sizeof(float));
    if (!xp) return -1;
    for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const int64_t mc = M - m0 < MC ? M - m0 : MC;
#pragma omp parallel num_threads(threads)
        {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < (mc + MR - 1) / MR; t++) {
                const int64_t r0 = t * MR, r = mc - r0 < MR ? mc - r0 : MR;
                const float *src = x + (m0 + r0) * K;
                float *dst = xp + r0 * K;
                for (int64_t k = 0; k < K; k++)
                    for (int64_t i = 0; i < r; i++) dst[k * r + i] = src[i * K + k];
            }
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) {
                const int64_t n0 = p * NB;
                const int64_t nvalid = N - n0 < NB ? N - n0 : NB;
                rows(xp, wp + p * K * WORDS, bias, y + m0 * N, mc, K, N, n0, nvalid);
            }
        }
    }
    free(xp);
    return 0;
}
