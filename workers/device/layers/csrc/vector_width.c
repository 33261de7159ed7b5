/* The width in bytes of the widest vectors this build targets: 64 (AVX-512), 32 (AVX2), or
 * 16 (anything else; AVX without AVX2 too, which lacks the 256-bit integer shifts the
 * bfloat16 tiles widen with).
 *
 * Why: the GEMM kernels (skinny_gemm.c, bf16_linear.c) and the prefill-attention kernel are
 * written with GCC vectors in register tiles, and GCC lowers vectors wider than the hardware's
 * badly: their 64-byte code built with -march=haswell (AVX2) ran 10-100x slower than the torch
 * ops they replace. The bfloat16 GEMM and the prefill kernel have tiles for 32-byte (AVX2) and
 * 64-byte (AVX-512) vectors; the skinny GEMM only for 64-byte ones (with 32 it did not beat
 * torch). The Python side (workers/layers/cpu_kernels.py `tiled_kernels`, `wide_vectors`)
 * routes to each only on builds it has tiles for; the other kernels (decode attention, norms,
 * rotary, SiLU-and-mul) are plain loops the compiler vectorises at any width.
 */
#include "vector_width.h"

int kvray_vector_bytes(void) { return LANES * 4; }
