/* The vector width and register budget every tiled kernel (bf16_linear.c,
 * paged_prefill_attention.c) sizes its tiles by, chosen once per build. 32 vector registers
 * (AVX-512) hold 24 accumulators, 16 (AVX2) hold 12. Anything narrower than AVX2 (AVX alone
 * lacks the 256-bit integer shifts the bfloat16 tiles widen with) builds with 16-byte vectors,
 * which the engine does not call the tiled kernels with (vector_width.c reports the width).
 */
#ifndef KVRAY_VECTOR_WIDTH_H
#define KVRAY_VECTOR_WIDTH_H

#if defined(__AVX512F__)
#define LANES 16
#define NACC 24
#elif defined(__AVX2__)
#define LANES 8
#define NACC 12
#else
#define LANES 4
#define NACC 12
#endif

#endif
