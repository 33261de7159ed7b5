/* RMSNorm over the last dimension, float32: y = w * (x / sqrt(mean(x^2) + eps)).
 *
 * Why: torch runs it as seven small ops (pow, mean, add, rsqrt, mul, cast, mul), each a
 * dispatch and a pass over the rows; a decode step of the demo model calls it 17 times, and
 * those ops were about a tenth of the step. One pass per row here, threads only for large
 * steps (waking them costs more than a few rows take).
 *
 * x is read as [outer, inner, dim] with strides (the q and k heads are views into the fused
 * qkv projection, not contiguous); the last dimension must be contiguous. y is contiguous.
 */
#include <math.h>
#include <stdint.h>

/* Threads only from this many elements: waking them costs more than a few rows take. */
#define THREADED (1 << 16)

static inline void norm_row(const float *xr, const float *w, float *yr, int64_t dim, float eps) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < dim; i++) ss += xr[i] * xr[i];
    const float inv = 1.f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
    for (int64_t i = 0; i < dim; i++) yr[i] = w[i] * (xr[i] * inv);
}

void rms_norm(const float *x, const float *w, float *y, int64_t outer, int64_t inner,
              int64_t stride_outer, int64_t stride_inner, int64_t dim, float eps) {
    const int64_t rows = outer * inner;
#pragma omp parallel for schedule(static) if (rows * dim >= THREADED)
    for (int64_t r = 0; r < rows; r++)
        norm_row(x + (r / inner) * stride_outer + (r % inner) * stride_inner, w, y + r * dim, dim,
                 eps);
}

/* The residual stream's step between two sublayers: x += delta (in place), then y = the
 * RMSNorm of the new x; x, delta and y contiguous [rows, dim]. One pass over x instead of a
 * torch add and a second read (the add's result is the same float, and the norm the same
 * code as rms_norm's, so y is bit for bit what the two calls give). */
void add_rms_norm(float *x, const float *delta, const float *w, float *y, int64_t rows,
                  int64_t dim, float eps) {
#pragma omp parallel for schedule(static) if (rows * dim >= THREADED)
    for (int64_t r = 0; r < rows; r++) {
        float *xr = x + r * dim;
        const float *dr = delta + r * dim;
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) xr[i] += dr[i];
        norm_row(xr, w, y + r * dim, dim, eps);
    }
}
