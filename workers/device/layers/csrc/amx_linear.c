/* y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]) with w exactly bfloat16, on the AMX tile units of
 * Intel Xeons since Sapphire Rapids, accurate to float32: the same layers as bf16_linear.c
 * (a bfloat16 checkpoint served in float32), where the CPU has AMX.
 *
 * Why: the AVX-512 FMA units top out at the float32 matmul peak, and a decode step of a few
 * dozen rows, or a prefill step, is bound by them. AMX multiplies bfloat16 pairs and sums
 * them in float32 (TDPBF16PS): one tile product (16 x 16 x 32 multiply-adds) issues every
 * 5.5-6.5 ns on this machine's cores with random data (faster on zeros), ~2.5-3 TFLOP/s a
 * core against ~0.19 for the float32 FMA units. But its inputs are bfloat16. The
 * weights are (exactly). x is not, so each row is cut into three bfloat16 pieces whose sum is
 * x exactly: x1 = x with its low 16 bits cleared, x2 = the same of x - x1, x3 = x - x1 - x2
 * (each subtraction is exact, and a float's 24 significant bits leave at most 8 for x3).
 * A product of two bfloat16s is exact in float32, so x.w = x1.w + x2.w + x3.w is three dot
 * products of exact products summed in float32 (round to nearest even): a float32 GEMM's
 * accuracy, in another summation order, as between any two GEMMs (measured against float64:
 * a third of the BLAS's error on the same values). Inputs below ~1e-33, whose third piece is
 * a bfloat16 subnormal, lose that piece (AMX reads subnormals as zero).
 *
 * Layout (workers/layers/cpu_kernels.py pack_bf16_weight with amx=True): w zero-padded to a
 * multiple of 32 in both N and K, cut into panels of 32 output features; a panel is K / 32
 * chunks of two 1 KiB B tiles (features 0-15, then 16-31), each [16 pairs of k][16 features]
 * [2], the pairing TDPBF16PS takes. A panel is contiguous, so a step streams it. Threads split
 * the panels; each writes x's pieces for itself once per block of rows (stacked for small
 * steps, see stacked_panel; else each piece zero-padded to 16-row tiles).
 *
 * Builds without AMX (or a kernel that refuses the tile state) keep bf16_linear.c:
 * kvray_amx_enable says which (cpu_kernels.amx).
 */
#define _GNU_SOURCE /* syscall() */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__linux__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define PANEL 32   /* output features per panel: two 16-feature B tiles */
#define CHUNK 32   /* k per B tile: 16 pairs */
#define TROWS 16   /* rows per tile */
#define MC 64      /* rows per block of x's pieces: they and a panel stay in L2 */
#define STACK 10   /* steps of up to this many rows stack x's pieces as rows (3 x 10 <= 32) */
#define PF 8       /* chunks (2 KiB each) the first tile pass of a panel prefetches ahead */

/* 1 when this process may use the AMX tiles (Linux grants the tile state per process, on
 * request: ARCH_REQ_XCOMP_PERM), 0 when the build or the kernel has none. Idempotent. */
int kvray_amx_enable(void) {
#ifdef HAVE_AMX
    const long arch_req_xcomp_perm = 0x1023, xfeature_xtiledata = 18;
    return syscall(SYS_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0;
#else
    return 0;
#endif
}

#ifdef HAVE_AMX
/* The chunk PF ahead into L2, as an asm statement with the address in a register (see
 * bf16_linear.c): tile registers are not renamed, so a tile load that misses stalls every
 * tile product behind it. Measured over the 100M checkpoint's weights, their tile loads
 * alone streamed them in 8.8 ms without it, 8.0 with it. */
static inline void prefetch_chunk(const uint16_t *b) {
    for (int line = 0; line < 2 * TROWS * 64; line += 64)
        __asm__("prefetcht1 (%0)" : : "r"((const char *)b + line));
}

/* The tile configuration (palette 1): tiles 0-3 accumulate (C), 4-5 hold the weights (B),
 * 6-7 the pieces of x (A); 64 bytes a row. B tiles have 16 rows (pairs of k). A and C tiles
 * have only the rows a step has, up to 16: tiles 0, 1 and 6 `first` (a pair's first row
 * tile, or the one tile), 2, 3 and 7 `second` (a pair's second). So a step of 12 rows loads
 * 12 rows of each piece, not 16 with 4 of padding (padded, steps of 1-8 rows had run 40 %
 * slower than bf16_linear.c), one of 24 rows 16 + 8, and a stacked one of 3 rows 9. */
struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static void configure(int first, int second) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t == 4 || t == 5 ? TROWS : t == 2 || t == 3 || t == 7 ? second : first;
    }
    _tile_loadconfig(&cfg);
}

static inline uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Row r of the block: its three bfloat16 pieces into xs[0..2][r][0, Kp) (zeros past K). */
static void split_row(const float *x, uint16_t *xs, int64_t K, int64_t Kp, int64_t plane) {
    for (int64_t k = 0; k < K; k++) {
        const uint32_t b1 = bits(x[k]) & 0xFFFF0000u;
        const float r1 = x[k] - from_bits(b1);
        const uint32_t b2 = bits(r1) & 0xFFFF0000u;
        const float r2 = r1 - from_bits(b2);
        xs[k] = (uint16_t)(b1 >> 16);
        xs[plane + k] = (uint16_t)(b2 >> 16);
        xs[2 * plane + k] = (uint16_t)(bits(r2) >> 16);
    }
    for (int64_t k = K; k < Kp; k++) xs[k] = xs[plane + k] = xs[2 * plane + k] = 0;
}

/* Accumulator tiles c0 (features 0-15) and c1 (16-31) of 16 rows into y's first `rows` rows
 * and `nvalid` features from n0, plus bias: stored straight into y when whole, through `tmp`
 * for the last, partial ones. Macros: a tile's number must be a constant. */
#define STORE_TILE(c0, c1, yt, rows)                                                          \
    do {                                                                                      \
        if ((rows) == TROWS && nvalid == PANEL) {                                             \
            _tile_stored(c0, (yt) + n0, N * 4);                                               \
            _tile_stored(c1, (yt) + n0 + 16, N * 4);                                          \
            if (bias) add_bias((yt) + n0, bias + n0, TROWS, N);                               \
        } else {                                                                              \
            _tile_stored(c0, tmp, PANEL * 4);                                                 \
            _tile_stored(c1, tmp + 16, PANEL * 4);                                            \
            copy_partial(tmp, bias, (yt), (rows), N, n0, nvalid);                             \
        }                                                                                     \
    } while (0)

static void add_bias(float *y, const float *bias, int64_t rows, int64_t N) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < PANEL; j++) y[i * N + j] += bias[j];
}

static void copy_partial(const float *tmp, const float *bias, float *y, int64_t rows, int64_t N,
                         int64_t n0, int64_t nvalid) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < nvalid; j++)
            y[i * N + n0 + j] = tmp[i * PANEL + j] + (bias ? bias[n0 + j] : 0.f);
}

/* Chunk c of a panel's weights, prefetching the chunk PF ahead when this pass streams the
 * panel from memory (a panel's first pass; the others find it in L2). */
static inline const uint16_t *chunk_weights(const uint16_t *w, int64_t c, int64_t chunks,
                                            int prefetch) {
    const uint16_t *b = w + c * 2 * TROWS * 32;
    if (prefetch && c + PF < chunks) prefetch_chunk(b + PF * 2 * TROWS * 32);
    return b;
}

/* A panel's first chunk of weights into B tiles 4 (features 0-15) and 5 (16-31); the loops
 * load each next chunk's themselves, between the products (see panel()). */
static inline __attribute__((always_inline)) void load_first_weights(const uint16_t *w,
                                                                     int64_t chunks,
                                                                     int prefetch) {
    const uint16_t *b = chunk_weights(w, 0, chunks, prefetch);
    _tile_loadd(4, b, 64);
    _tile_loadd(5, b + TROWS * 32, 64);
}

static inline void zero_accumulators(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

#define ASTRIDE (Kp * 2) /* bytes from one row of a piece to the next */

/* One panel against `rows` rows of the block (their pieces at xs), two 16-row tiles at a time
 * so that each B tile loaded serves six products. Tile registers are not renamed, so a load
 * into a tile waits for every product reading it: each load is issued right after the last
 * product that reads the tile's old contents (software pipelining), not at the top of its
 * piece or chunk, so that it overlaps the products still queued. */
static void panel(const uint16_t *xs, const uint16_t *w, const float *bias, float *y,
                  int64_t rows, int64_t Kp, int64_t plane, int64_t N, int64_t n0, int64_t nvalid) {
    float tmp[TROWS * PANEL];
    const int64_t chunks = Kp / CHUNK;
    int64_t m = 0;
    for (; m + TROWS < rows; m += 2 * TROWS) { /* more than one tile left: a pair */
        zero_accumulators();
        const uint16_t *a = xs + m * Kp, *a2 = a + TROWS * Kp;
        load_first_weights(w, chunks, m == 0);
        _tile_loadd(6, a, ASTRIDE);
        _tile_loadd(7, a2, ASTRIDE);
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t next = c + 1 < chunks ? c + 1 : c; /* the last chunk reloads itself */
            const uint16_t *b = chunk_weights(w, next, chunks, m == 0);
            /* x1 */
            _tile_dpbf16ps(0, 6, 4);
            _tile_dpbf16ps(2, 7, 4);
            _tile_dpbf16ps(1, 6, 5);
            _tile_loadd(6, a + plane + c * CHUNK, ASTRIDE);
            _tile_dpbf16ps(3, 7, 5);
            _tile_loadd(7, a2 + plane + c * CHUNK, ASTRIDE);
            /* x2 */
            _tile_dpbf16ps(0, 6, 4);
            _tile_dpbf16ps(2, 7, 4);
            _tile_dpbf16ps(1, 6, 5);
            _tile_loadd(6, a + 2 * plane + c * CHUNK, ASTRIDE);
            _tile_dpbf16ps(3, 7, 5);
            _tile_loadd(7, a2 + 2 * plane + c * CHUNK, ASTRIDE);
            /* x3, then the next chunk's weights and x1 */
            _tile_dpbf16ps(0, 6, 4);
            _tile_dpbf16ps(2, 7, 4);
            _tile_loadd(4, b, 64);
            _tile_dpbf16ps(1, 6, 5);
            _tile_loadd(6, a + next * CHUNK, ASTRIDE);
            _tile_dpbf16ps(3, 7, 5);
            _tile_loadd(5, b + TROWS * 32, 64);
            _tile_loadd(7, a2 + next * CHUNK, ASTRIDE);
        }
        STORE_TILE(0, 1, y + m * N, TROWS);
        const int64_t rest = rows - m - TROWS < TROWS ? rows - m - TROWS : TROWS;
        STORE_TILE(2, 3, y + (m + TROWS) * N, rest);
    }
    if (m < rows) { /* one 16-row tile left: x1 into tiles 0-1, x2 and x3 into 2-3, so that
                     * four chains of dependent TDPBF16PS overlap, not two */
        zero_accumulators();
        const uint16_t *a = xs + m * Kp;
        load_first_weights(w, chunks, m == 0);
        _tile_loadd(6, a, ASTRIDE);
        _tile_loadd(7, a + plane, ASTRIDE);
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t next = c + 1 < chunks ? c + 1 : c;
            const uint16_t *b = chunk_weights(w, next, chunks, m == 0);
            _tile_dpbf16ps(0, 6, 4); /* x1 */
            _tile_dpbf16ps(2, 7, 4); /* x2 */
            _tile_dpbf16ps(1, 6, 5);
            _tile_loadd(6, a + 2 * plane + c * CHUNK, ASTRIDE); /* x3 */
            _tile_dpbf16ps(3, 7, 5);
            _tile_loadd(7, a + plane + next * CHUNK, ASTRIDE);
            _tile_dpbf16ps(2, 6, 4);
            _tile_loadd(4, b, 64);
            _tile_dpbf16ps(3, 6, 5);
            _tile_loadd(5, b + TROWS * 32, 64);
            _tile_loadd(6, a + next * CHUNK, ASTRIDE);
        }
        /* x2.w + x3.w (tiny against x1.w) joins x1.w once, at the end */
        float part[TROWS * PANEL];
        _tile_stored(2, part, PANEL * 4);
        _tile_stored(3, part + 16, PANEL * 4);
        _tile_stored(0, tmp, PANEL * 4);
        _tile_stored(1, tmp + 16, PANEL * 4);
        for (int64_t i = 0; i < (rows - m) * PANEL; i++) tmp[i] += part[i];
        copy_partial(tmp, bias, y + m * N, rows - m, N, n0, nvalid);
    }
}

/* Steps of at most STACK rows (decode steps of a few sequences): x's pieces stacked as the
 * 3M rows of one A tile, or two (TWO), since a TDPBF16PS of 1 row costs as much as one of
 * 16: per chunk 2 or 4 of them instead of 6, and no chain of dependent ones. Row i of y is
 * the sum of stacked rows i, M + i and 2M + i. Loads pipelined as in panel(). */
static inline __attribute__((always_inline)) void stacked_panel(
    const uint16_t *xs, const uint16_t *w, const float *bias, float *y, int64_t M, int64_t Kp,
    int64_t N, int64_t n0, int64_t nvalid, const int TWO) {
    float tmp[2 * TROWS * PANEL];
    const int64_t chunks = Kp / CHUNK;
    _tile_zero(0);
    _tile_zero(1);
    if (TWO) {
        _tile_zero(2);
        _tile_zero(3);
    }
    load_first_weights(w, chunks, 1);
    _tile_loadd(6, xs, ASTRIDE);
    if (TWO) _tile_loadd(7, xs + TROWS * Kp, ASTRIDE);
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t next = c + 1 < chunks ? c + 1 : c;
        const uint16_t *b = chunk_weights(w, next, chunks, 1);
        _tile_dpbf16ps(0, 6, 4);
        if (TWO) _tile_dpbf16ps(2, 7, 4);
        _tile_loadd(4, b, 64);
        _tile_dpbf16ps(1, 6, 5);
        _tile_loadd(6, xs + next * CHUNK, ASTRIDE);
        if (TWO) {
            _tile_dpbf16ps(3, 7, 5);
            _tile_loadd(7, xs + TROWS * Kp + next * CHUNK, ASTRIDE);
        }
        _tile_loadd(5, b + TROWS * 32, 64);
    }
    _tile_stored(0, tmp, PANEL * 4);
    _tile_stored(1, tmp + 16, PANEL * 4);
    if (TWO) {
        _tile_stored(2, tmp + TROWS * PANEL, PANEL * 4);
        _tile_stored(3, tmp + TROWS * PANEL + 16, PANEL * 4);
    }
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < nvalid; j++)
            y[i * N + n0 + j] = tmp[i * PANEL + j] + tmp[(M + i) * PANEL + j] +
                                tmp[(2 * M + i) * PANEL + j] + (bias ? bias[n0 + j] : 0.f);
}
#endif

/* x: [M, K] and y: [M, N] contiguous float32, wp: the packed weight (see above), bias: [N] or
 * NULL. Returns 0; -1 when the scratch for x's pieces cannot be allocated; -2 on a build
 * without AMX. The caller has had kvray_amx_enable() return 1 in this process. */
int amx_linear(const float *x, const uint16_t *wp, const float *bias, float *y, int64_t M,
               int64_t K, int64_t N, int64_t threads) {
#ifdef HAVE_AMX
    if (M <= 0) return 0;
    const int64_t Kp = (K + CHUNK - 1) / CHUNK * CHUNK;
    const int64_t panels = (N + PANEL - 1) / PANEL;
    const int64_t block = M < MC ? M : MC;
    const int64_t plane = M <= STACK ? M * Kp : (block + TROWS - 1) / TROWS * TROWS * Kp;
    if (threads > panels) threads = panels;
    if (threads < 1) threads = 1;
    /* One piece's rows: padded to whole tiles, or stacked right after the previous piece's.
     * Each thread writes all of a block's pieces into its own scratch: splitting x is cheap
     * next to the products, while pieces written by one core and read by the other (and a
     * barrier per block) had cost a quarter of a 2,048-row step's time. */
    uint16_t *scratch = malloc(threads * 3 * plane * sizeof(uint16_t));
    if (!scratch) return -1;
#pragma omp parallel num_threads(threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        uint16_t *xs = scratch + t * 3 * plane;
        const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt; /* this thread's */
        int configured = -1; /* the block size the tiles are configured for */
        for (int64_t m0 = 0; m0 < M; m0 += MC) {
            const int64_t mc = M - m0 < MC ? M - m0 : MC;
            const int64_t mp = M <= STACK ? mc : (mc + TROWS - 1) / TROWS * TROWS; /* padded */
            for (int64_t r = 0; r < mp; r++) {
                if (r < mc)
                    split_row(x + (m0 + r) * K, xs + r * Kp, K, Kp, plane);
                else /* padding rows of the last tile: zeros */
                    for (int64_t p = 0; p < 3; p++) memset(xs + p * plane + r * Kp, 0, Kp * 2);
            }
            /* The tile state is a thread's. A block of at most 32 rows is one pair (or one
             * tile): its tiles take its rows; larger blocks pad their last tiles. */
            const int stacked = (int)(3 * mc); /* M <= STACK: the rows of x's stacked pieces */
            if (configured != (int)mc) {
                if (M <= STACK)
                    configure(stacked < TROWS ? stacked : TROWS,
                              stacked > TROWS ? stacked - TROWS : TROWS);
                else if (mc <= TROWS)
                    configure((int)mc, (int)mc);
                else
                    configure(TROWS, mc <= 2 * TROWS ? (int)(mc - TROWS) : TROWS);
                configured = (int)mc;
            }
            for (int64_t p = p0; p < p1; p++) {
                const int64_t n0 = p * PANEL;
                const int64_t nvalid = N - n0 < PANEL ? N - n0 : PANEL;
                const uint16_t *w = wp + p * (Kp / CHUNK) * 2 * TROWS * 32;
                if (M <= STACK && stacked > TROWS)
                    stacked_panel(xs, w, bias, y, M, Kp, N, n0, nvalid, 1);
                else if (M <= STACK)
                    stacked_panel(xs, w, bias, y, M, Kp, N, n0, nvalid, 0);
                else
                    panel(xs, w, bias, y + m0 * N, mc, Kp, plane, N, n0, nvalid);
            }
        }
        _tile_release(); /* a thread's tile state would otherwise ride every context switch */
    }
    free(scratch);
    return 0;
#else
    (void)x, (void)wp, (void)bias, (void)y, (void)M, (void)K, (void)N, (void)threads;
    return -2;
#endif
}
