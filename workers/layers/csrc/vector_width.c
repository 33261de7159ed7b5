/* The width in bytes of the widest vectors this build targets.
 *
 * Why: the GEMM kernels (skinny_gemm.c, bf16_linear.c) and the prefill-attention kernel are
 * written with 64-byte GCC vectors and register tiles sized for 32 of them (AVX-512). GCC
 * lowers such vectors badly to narrower hardware: built with -march=haswell (AVX2) on this
 * machine's CPU, the three ran 10-100x slower than the torch ops they replace. The Python side
 * (workers/layers/cpu_kernels.py `wide_vectors`) routes nothing to them on such builds; the
 * other kernels (decode attention, norms, rotary, SiLU-and-mul) are written as plain loops
 * the compiler vectorises at any width.
 */
int kvray_vector_bytes(void) {
#if defined(__AVX512F__)
    return 64;
#elif defined(__AVX__)
    return 32;
#else
    return 16;
#endif
}
