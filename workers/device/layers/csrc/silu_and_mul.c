/* SiLU-and-mul of the fused gate/up projection, float32: y = silu(gate) * up, one pass.
 *
 * gu is [T, 2 * I] (gate in the first I columns, up in the last I, as the fused projection
 * writes them); y is [T, I]. torch runs this as a split, a SiLU and a product, each a pass
 * over the step's rows. Threads only for large steps.
 */
#include <math.h>
#include <stdint.h>

void silu_and_mul(const float *gu, float *y, int64_t T, int64_t I) {
#pragma omp parallel for schedule(static) if (T * I >= (1 << 16))
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * 2 * I, *u = g + I;
        float *yt = y + t * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) yt[i] = g[i] / (1.f + expf(-g[i])) * u[i];
    }
}
