/* Rotary position embedding (rotate-half layout), float32, in place on q and k.
 *
 * Why: torch runs it as about a dozen small ops per layer (two table lookups, and per
 * tensor a slice, negation, concatenation, two products and a sum); this is one pass.
 *
 * x is [T, heads, dim] with strides (q and k may be views into the fused qkv projection);
 * the last dimension must be contiguous. cos and sin are [max_pos, dim] tables whose two
 * halves are equal; positions is [T].
 */
#include <stdint.h>

static void rotate(float *x, int64_t T, int64_t heads, int64_t stride_t, int64_t stride_h,
                   int64_t dim, const float *cos, const float *sin, const int64_t *positions) {
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) if (T * heads * dim >= (1 << 16))
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + positions[t] * dim, *s = sin + positions[t] * dim;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + t * stride_t + h * stride_h, *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

void rotary(float *q, int64_t q_heads, int64_t q_stride_t, int64_t q_stride_h, float *k,
            int64_t k_heads, int64_t k_stride_t, int64_t k_stride_h, int64_t T, int64_t dim,
            const float *cos, const float *sin, const int64_t *positions) {
    rotate(q, T, q_heads, q_stride_t, q_stride_h, dim, cos, sin, positions);
    rotate(k, T, k_heads, k_stride_t, k_stride_h, dim, cos, sin, positions);
}
