/* Paged decode attention for CPU: one query token per sequence, K/V read in place from the
 * block pool (no gather copy), softmax in float32, grouped-query heads share each K/V load.
 *
 * q:       [D, H, Dh]            float32, contiguous
 * k, v:    [num_blocks, bs, KH, Dh]
 * tables:  [D, max_blocks]       int64 block ids
 * lens:    [D]                   int64 tokens to attend to (the query's own position included)
 * out:     [D, H, Dh]
 * scratch: [D, KH, H/KH, max_len] float32 scores (caller-owned, so no allocation here)
 */
#include <math.h>
#include <stdint.h>

void paged_decode_attention(const float *q, const float *k, const float *v,
                            const int64_t *tables, const int64_t *lens, float *out,
                            float *scratch, int64_t D, int64_t H, int64_t KH, int64_t Dh,
                            int64_t bs, int64_t max_blocks, int64_t max_len, float scale) {
    const int64_t G = H / KH;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t d = 0; d < D; d++) {
        for (int64_t kh = 0; kh < KH; kh++) {
            const int64_t n = lens[d];
            const int64_t *table = tables + d * max_blocks;
            const float *qd = q + (d * H + kh * G) * Dh;
            float *s = scratch + (d * KH + kh) * G * max_len;
            /* Pass 1: scores. */
            for (int64_t t = 0; t < n; t++) {
                const float *kt = k + ((table[t / bs] * bs + t % bs) * KH + kh) * Dh;
                for (int64_t g = 0; g < G; g++) {
                    const float *qg = qd + g * Dh;
                    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
                    for (int64_t i = 0; i < Dh; i++) acc += qg[i] * kt[i];
                    s[g * max_len + t] = acc * scale;
                }
            }
            /* Softmax per query head. */
            for (int64_t g = 0; g < G; g++) {
                float *sg = s + g * max_len;
                float mx = -INFINITY;
                for (int64_t t = 0; t < n; t++) mx = sg[t] > mx ? sg[t] : mx;
                float sum = 0.f;
                for (int64_t t = 0; t < n; t++) {
                    sg[t] = expf(sg[t] - mx);
                    sum += sg[t];
                }
                const float inv = 1.f / sum;
                for (int64_t t = 0; t < n; t++) sg[t] *= inv;
            }
            /* Pass 2: weighted sum of V. */
            float *od = out + (d * H + kh * G) * Dh;
            for (int64_t i = 0; i < G * Dh; i++) od[i] = 0.f;
            for (int64_t t = 0; t < n; t++) {
                const float *vt = v + ((table[t / bs] * bs + t % bs) * KH + kh) * Dh;
                for (int64_t g = 0; g < G; g++) {
                    const float p = s[g * max_len + t];
                    float *og = od + g * Dh;
#pragma omp simd
                    for (int64_t i = 0; i < Dh; i++) og[i] += p * vt[i];
                }
            }
        }
    }
}
