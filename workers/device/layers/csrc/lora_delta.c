/* A step's LoRA deltas for one projection on CPU, float32: for each row under an adapter,
 * y[row] += B_s (A_s x[row]) with its own adapter s (workers/lora/layers.py holds the slots).
 *
 * Why: torch's ops compute the deltas of a batch of several adapters either masked (every row
 * times every adapter's columns, then a mask: the arithmetic grows with the adapters in the
 * batch, and a fused projection's block-diagonal B multiplies zeros too) or one adapter at a
 * time (~6 ops each, gathers and copies of the rows). Here a row multiplies only its own
 * adapter's A and each fused part's own block of B, with no gathers: one call per projection
 * whatever the mix, and arithmetic proportional to the rows' own ranks.
 *
 * Layout (LoraSlots): a [slots, width, in] (each slot's parts' A stacked, ranks packed at the
 * front), b_t [slots, width, out] (B transposed and pre-scaled, part p's columns at its own
 * offset), ranks [slots, parts], out_sizes [parts]. `rows` are the step's rows under an
 * adapter sorted by slot, `slots` theirs: runs of up to TILE rows of one slot share each A and
 * B row while it is in cache. The tiles do not depend on the thread count and each output row
 * is written by one thread: neither do the results.
 *
 * Plain loops with `omp simd`: the compiler vectorises them for whatever it targets.
 */
#include <stdint.h>
#include <stdlib.h>

#define TILE 4       /* rows of one slot per tile */
#define MAX_RANK 512 /* a part's rank at most (layers.py: LORA_KERNEL_MAX_RANK) */

/* Rows rows[0..n) (n <= TILE, one slot) against each part's A and B. Inlined with a constant
 * n so that the n rows' sums share each load of A and B: shrink s[i][r] = x_i . A_r over the
 * part's rank, then expand y_i[j] += sum_r s[i][r] B_r[j], each y element read and written
 * once per part. */
static inline __attribute__((always_inline)) void tile(
    const float *restrict x, int64_t ldx, float *restrict y, int64_t ldy, const int64_t *rows,
    const int64_t n, const float *a, const float *b_t, const int64_t *ranks,
    const int64_t *out_sizes, int64_t parts, int64_t in, int64_t out) {
    const float *xs[TILE];
    float *ys[TILE];
    for (int64_t i = 0; i < n; i++) {
        xs[i] = x + rows[i] * ldx;
        ys[i] = y + rows[i] * ldy;
    }
    float s[TILE][MAX_RANK];
    int64_t col = 0, off = 0;
    for (int64_t p = 0; p < parts; p++) {
        const int64_t rank = ranks[p], size = out_sizes[p];
        /* Shrink, two ranks per pass: each load of x serves both, each load of A the n rows,
         * and the eight sums are independent chains of multiply-adds. */
        for (int64_t r = 0; r < rank; r += 2) {
            const float *a0 = a + (col + r) * in, *a1 = r + 1 < rank ? a0 + in : a0;
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
            float t0 = 0.0f, t1 = 0.0f, t2 = 0.0f, t3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3, t0, t1, t2, t3)
            for (int64_t k = 0; k < in; k++) {
                const float w = a0[k], v = a1[k];
                s0 += xs[0][k] * w, t0 += xs[0][k] * v;
                if (n > 1) s1 += xs[1][k] * w, t1 += xs[1][k] * v;
                if (n > 2) s2 += xs[2][k] * w, t2 += xs[2][k] * v;
                if (n > 3) s3 += xs[3][k] * w, t3 += xs[3][k] * v;
            }
            s[0][r] = s0, s[1][r] = s1, s[2][r] = s2, s[3][r] = s3;
            if (r + 1 < rank) s[0][r + 1] = t0, s[1][r + 1] = t1, s[2][r + 1] = t2, s[3][r + 1] = t3;
        }
        /* Expand, four ranks per pass and every row of the tile in the same loop: each load
         * of B serves the n rows, each y element is loaded and stored once per pass. */
        const float *b = b_t + col * out + off;
        float *restrict y0 = ys[0] + off, *restrict y1 = ys[n > 1 ? 1 : 0] + off,
                        *restrict y2 = ys[n > 2 ? 2 : 0] + off,
                        *restrict y3 = ys[n > 3 ? 3 : 0] + off;
        for (int64_t r = 0; r < rank; r += 4) {
            const int64_t m = rank - r < 4 ? rank - r : 4;
            float c[TILE][4] = {{0}};
            for (int64_t i = 0; i < n; i++)
                for (int64_t q = 0; q < m; q++) c[i][q] = s[i][r + q];
            /* Past the part's rank (m < 4) the pass reads B's row r again, times zero. */
            const float *b0 = b + r * out;
            const float *b1 = m > 1 ? b0 + out : b0, *b2 = m > 2 ? b0 + 2 * out : b0,
                        *b3 = m > 3 ? b0 + 3 * out : b0;
#pragma omp simd
            for (int64_t j = 0; j < size; j++) {
                const float w0 = b0[j], w1 = b1[j], w2 = b2[j], w3 = b3[j];
                y0[j] += c[0][0] * w0 + c[0][1] * w1 + c[0][2] * w2 + c[0][3] * w3;
                if (n > 1) y1[j] += c[1][0] * w0 + c[1][1] * w1 + c[1][2] * w2 + c[1][3] * w3;
                if (n > 2) y2[j] += c[2][0] * w0 + c[2][1] * w1 + c[2][2] * w2 + c[2][3] * w3;
                if (n > 3) y3[j] += c[3][0] * w0 + c[3][1] * w1 + c[3][2] * w2 + c[3][3] * w3;
            }
        }
        col += rank;
        off += size;
    }
}

/* Returns 0, or -1 when out of memory (nothing written). */
int lora_delta(const float *x, int64_t ldx, float *y, int64_t ldy, const int64_t *rows,
               const int64_t *slots, int64_t num_rows, const float *a, const float *b_t,
               const int64_t *ranks, const int64_t *out_sizes, int64_t parts, int64_t in,
               int64_t out, int64_t width, int64_t threads) {
    if (num_rows <= 0) return 0;
    int64_t *starts = malloc((size_t)(num_rows + 1) * sizeof *starts);
    if (!starts) return -1;
    int64_t tiles = 0;
    for (int64_t t = 0; t < num_rows;) {
        int64_t e = t + 1;
        while (e < num_rows && e - t < TILE && slots[e] == slots[t]) e++;
        starts[tiles++] = t;
        t = e;
    }
    starts[tiles] = num_rows;
#pragma omp parallel for schedule(dynamic) num_threads(threads) if (threads > 1 && tiles > 1)
    for (int64_t i = 0; i < tiles; i++) {
        const int64_t t = starts[i], s = slots[t];
        const float *as = a + s * width * in, *bs = b_t + s * width * out;
        const int64_t *rk = ranks + s * parts, *r = rows + t;
        switch (starts[i + 1] - t) {
        case 1: tile(x, ldx, y, ldy, r, 1, as, bs, rk, out_sizes, parts, in, out); break;
        case 2: tile(x, ldx, y, ldy, r, 2, as, bs, rk, out_sizes, parts, in, out); break;
        case 3: tile(x, ldx, y, ldy, r, 3, as, bs, rk, out_sizes, parts, in, out); break;
        default: tile(x, ldx, y, ldy, r, 4, as, bs, rk, out_sizes, parts, in, out); break;
        }
    }
    free(starts);
    return 0;
}
