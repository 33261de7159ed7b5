/* Paged causal attention of prefill chunks for CPU, K/V read in place from the block pool.
 *
 * q, out:  [R, H, Dh]            float32, contiguous; a chunk's query tokens are rows
 *                                [row0, row0 + n) of them
 * k, v:    [num_blocks, bs, KH, Dh]
 * chunks:  [C, 3]                int64 (row0, n, pos0): the chunk's first row, its length and
 *                                the position of its first token; token i of the chunk
 *                                attends to positions 0 .. pos0 + i of its sequence
 * tables:  [R, max_blocks]       int64 block ids; a chunk reads the row of its first token
 *
 * Why: one row per query token (paged_decode_attention.c) reads the whole context once per
 * query token and reduces every dot product across lanes; a prefill chunk's tokens share
 * that context. Here a task takes a block of the chunk's query tokens for one KV head (about
 * ROWS query rows: token x query head of the group) and walks the context in tiles of BK
 * keys, flash-attention style: scores as a small matrix product of the tile's keys and the
 * queries transposed (no horizontal sums, and the softmax runs across whole vectors of query
 * rows), an online softmax, then the probabilities times the tile's values. Each K/V row is
 * read once per task instead of once per query row.
 *
 * Built with -ffast-math; masked scores are a large negative finite value, not -inf, which
 * -ffast-math assumes away. The register tiles are sized per vector width (AVX-512 or AVX2;
 * the 64-byte code lowered to AVX2 had measured 20x slower than SDPA); builds with narrower
 * vectors compile but are not called (csrc/vector_width.c).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_width.h"

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));
#define ROWS 64 /* query rows (token x head of the group) a task aims for */
#define BK 32   /* keys per tile */
#define JN (NACC / 2) /* keys per register tile of the scores (x 2 vectors of query rows) */
#define MAX_DV (256 / LANES) /* head dim up to 256 */
#define RT 6    /* most query rows per register tile of the weighted values */
#define MASKED -1e30f

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* Lane-wise select (C has no ?: on vectors): where `c` is set, a; elsewhere b. */
static inline vf select(vi c, vf a, vf b) { return (vf)(((vi)a & c) | ((vi)b & ~c)); }

static inline vf vmax(vf a, vf b) { return select(a > b, a, b); }

/* exp(x) for x <= 0, 16 lanes inline: 2^n * e^r with n the nearest integer to x / ln 2,
 * r = x - n ln 2 (|r| <= ln 2 / 2) and e^r from its Taylor series to degree 7 (truncation
 * error 5e-9, relative); 0 below -87, where expf underflows too. Inline because the softmax
 * calls it for every score: a libm vector call per 16 scores took 40 % of the kernel. */
static inline vf vexp(vf x) {
    const vi normal = x >= -87.f;
    x = vmax(x, (vf){0} - 87.f); /* keeps 2^n a normal float; those lanes are zeroed below */
    const vi n = __builtin_convertvector(x * 1.44269504f - 0.5f, vi); /* x <= 0: nearest */
    const vf r = x - __builtin_convertvector(n, vf) * 0.693147181f;
    vf p = (vf){0} + 1.f / 5040;
    p = p * r + 1.f / 720;
    p = p * r + 1.f / 120;
    p = p * r + 1.f / 24;
    p = p * r + 1.f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    return p * (vf)(normal & ((n + 127) << 23)); /* 2^n from its exponent bits */
}

/* st[j][r] = sum_d kt[j][d] qt[d][r] for keys [j0, j0 + J), query rows [r0, r0 + 2 LANES): the
 * scores transposed, so the softmax over keys runs across whole vectors of query rows. */
static inline __attribute__((always_inline)) void scores(
    const float *restrict kt, const float *restrict qt, float *restrict st, int64_t j0,
    const int64_t J, int64_t r0, int64_t rp, const int64_t DH) {
    vf acc[JN][2]; /* fixed sizes, not J: a variable-length array would live in memory */
    for (int64_t j = 0; j < J; j++) acc[j][0] = acc[j][1] = (vf){0};
    for (int64_t d = 0; d < DH; d++) {
        const vf q0 = load(qt + d * rp + r0), q1 = load(qt + d * rp + r0 + LANES);
        for (int64_t j = 0; j < J; j++) {
            const float x = kt[(j0 + j) * DH + d];
            acc[j][0] += x * q0;
            acc[j][1] += x * q1;
        }
    }
    for (int64_t j = 0; j < J; j++) {
        store(st + (j0 + j) * rp + r0, acc[j][0]);
        store(st + (j0 + j) * rp + r0 + LANES, acc[j][1]);
    }
}

/* o[r][:] += sum_j pt[j][r] vt[j][:] for rows [r0, r0 + R), head dim DV vectors. */
static inline __attribute__((always_inline)) void weighted_values(
    const float *restrict pt, const float *restrict vt, float *restrict o, int64_t nk,
    int64_t r0, int64_t rp, const int64_t R, const int64_t DV) {
    const int64_t dh = DV * LANES;
    vf acc[RT][MAX_DV]; /* fixed sizes, not R x DV: a variable-length array lives in memory */
    for (int64_t r = 0; r < R; r++)
        for (int64_t v = 0; v < DV; v++) acc[r][v] = load(o + (r0 + r) * dh + v * LANES);
    for (int64_t j = 0; j < nk; j++) {
        vf vv[MAX_DV];
        for (int64_t v = 0; v < DV; v++) vv[v] = load(vt + j * dh + v * LANES);
        for (int64_t r = 0; r < R; r++) {
            const float p = pt[j * rp + r0 + r];
            for (int64_t v = 0; v < DV; v++) acc[r][v] += p * vv[v];
        }
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t v = 0; v < DV; v++) store(o + (r0 + r) * dh + v * LANES, acc[r][v]);
}

/* One task: query tokens [t0, t0 + nq) of a chunk, KV head kh; R = nq * G rows (row r: token
 * t0 + r / G, head kh * G + r % G), padded to a multiple of 2 LANES, at most rp. Scratch:
 * qt [Dh][rp], o [rp][Dh], st [BK][rp], kt and vt [BK][Dh], m, l and rpos [rp]. Positions
 * are compared as floats (exact below 2^24 tokens). */
static inline __attribute__((always_inline)) void task(
    const float *restrict q, const float *restrict k, const float *restrict v,
    const int64_t *restrict table, float *restrict out, int64_t row0, int64_t pos0, int64_t t0,
    int64_t nq, int64_t kh, int64_t H, int64_t KH, int64_t G, const int64_t DH, int64_t bs,
    float scale, int64_t rp, float *restrict qt, float *restrict o, float *restrict st,
    float *restrict kt, float *restrict vt, float *restrict m, float *restrict l,
    float *restrict rpos) {
    const int64_t R = nq * G;
    rp = (R + 2 * LANES - 1) / (2 * LANES) * (2 * LANES); /* this task's rows, padded */
    for (int64_t d = 0; d < DH; d++) memset(qt + d * rp + R, 0, (rp - R) * sizeof(float));
    for (int64_t r = 0; r < R; r++) {
        const float *src = q + ((row0 + t0 + r / G) * H + kh * G + r % G) * DH;
        for (int64_t d = 0; d < DH; d++) qt[d * rp + r] = src[d] * scale;
    }
    memset(o, 0, R * DH * sizeof(float));
    const int64_t first = pos0 + t0, last = first + nq - 1; /* positions of the task's queries */
    for (int64_t r = 0; r < rp; r++) {
        m[r] = MASKED, l[r] = 0.f;
        rpos[r] = (float)(r < R ? first + r / G : last); /* padded rows: like the last */
    }
    const int64_t row = KH * DH;
    for (int64_t kb = 0; kb <= last; kb += BK) {
        const int64_t nk = last + 1 - kb < BK ? last + 1 - kb : BK;
        for (int64_t j = 0; j < nk; j++) {
            const int64_t t = kb + j;
            const int64_t off = (table[t / bs] * bs + t % bs) * row + kh * DH;
            memcpy(kt + j * DH, k + off, DH * sizeof(float));
            memcpy(vt + j * DH, v + off, DH * sizeof(float));
        }
        if (nk < BK) memset(kt + nk * DH, 0, (BK - nk) * DH * sizeof(float));
        for (int64_t r0 = 0; r0 < rp; r0 += 2 * LANES) {
            for (int64_t j0 = 0; j0 + JN <= BK; j0 += JN) scores(kt, qt, st, j0, JN, r0, rp, DH);
            if (BK % JN) scores(kt, qt, st, BK - BK % JN, BK % JN, r0, rp, DH);
        }
        /* Causal mask (and keys past nk) where the tile reaches past the first query, then
         * the online softmax, a vector of query rows at a time: new max, rescaled sums. */
        const int mask = kb + BK - 1 > first;
        for (int64_t r0 = 0; r0 < rp; r0 += LANES) {
            const vf pos = load(rpos + r0);
            vf mx = load(m + r0);
            for (int64_t j = 0; j < BK; j++) {
                vf s = load(st + j * rp + r0);
                if (mask) {
                    const vi hide = (vf){0} + (float)(kb + j) > pos;
                    s = select(hide, (vf){0} + MASKED, s);
                    store(st + j * rp + r0, s);
                }
                mx = vmax(mx, s);
            }
            vf sum = {0};
            for (int64_t j = 0; j < BK; j++) {
                const vf e = vexp(load(st + j * rp + r0) - mx);
                store(st + j * rp + r0, e);
                sum += e;
            }
            float alpha[LANES];
            store(alpha, vexp(load(m + r0) - mx));
            store(l + r0, load(l + r0) * load(alpha) + sum);
            store(m + r0, mx);
            for (int64_t i = 0; i < LANES && r0 + i < R; i++)
                if (alpha[i] != 1.f)
                    for (int64_t d = 0; d < DH; d++) o[(r0 + i) * DH + d] *= alpha[i];
        }
        const int64_t DV = DH / LANES;
        const int64_t rt = NACC / DV >= RT ? RT : NACC / DV >= 3 ? 3 : 1;
        int64_t r = 0;
        for (; r + rt <= R; r += rt) weighted_values(st, vt, o, nk, r, rp, rt, DV);
        switch (R - r) { /* the rest, as one tile of constant height */
        case 5: weighted_values(st, vt, o, nk, r, rp, 5, DV); break;
        case 4: weighted_values(st, vt, o, nk, r, rp, 4, DV); break;
        case 3: weighted_values(st, vt, o, nk, r, rp, 3, DV); break;
        case 2: weighted_values(st, vt, o, nk, r, rp, 2, DV); break;
        case 1: weighted_values(st, vt, o, nk, r, rp, 1, DV); break;
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const float inv = 1.f / l[r];
        float *dst = out + ((row0 + t0 + r / G) * H + kh * G + r % G) * DH;
        for (int64_t d = 0; d < DH; d++) dst[d] = o[r * DH + d] * inv;
    }
}

/* Returns 0, or -1 if Dh is not a multiple of 16 up to 256 or the scratch cannot be
 * allocated. */
int paged_prefill_attention(const float *q, const float *k, const float *v,
                            const int64_t *tables, const int64_t *chunks, float *out,
                            int64_t C, int64_t H, int64_t KH, int64_t Dh, int64_t bs,
                            int64_t max_blocks, int64_t threads, float scale) {
    if (Dh % 16 || Dh > 256) return -1; /* on every build: the engine checks the same */
    const int64_t G = H / KH;
    const int64_t bq = G >= ROWS ? 1 : ROWS / G; /* query tokens per task */
    const int64_t rp = (bq * G + 2 * LANES - 1) / (2 * LANES) * (2 * LANES);
    /* Tasks: (chunk, query block, KV head), the chunks' blocks numbered in one sequence. */
    int64_t *first_task = malloc((C + 1) * sizeof(int64_t));
    if (!first_task) return -1;
    first_task[0] = 0;
    for (int64_t c = 0; c < C; c++)
        first_task[c + 1] = first_task[c] + (chunks[c * 3 + 1] + bq - 1) / bq * KH;
    const int64_t tasks = first_task[C];
    const int64_t floats = 2 * rp * Dh + BK * rp + 2 * BK * Dh + 3 * rp;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *buf = malloc(floats * sizeof(float));
        failed = buf == NULL;
        /* Later tasks first: a chunk's last blocks see the most context (dynamic balance). */
#pragma omp for schedule(dynamic, 1)
        for (int64_t n = 0; n < tasks; n++) {
            if (!buf) continue;
            const int64_t id = tasks - 1 - n;
            int64_t c = 0;
            while (first_task[c + 1] <= id) c++;
            const int64_t local = id - first_task[c];
            const int64_t qb = local / KH, kh = local % KH;
            const int64_t row0 = chunks[c * 3], len = chunks[c * 3 + 1];
            const int64_t pos0 = chunks[c * 3 + 2];
            const int64_t t0 = qb * bq, nq = len - t0 < bq ? len - t0 : bq;
            const int64_t *table = tables + row0 * max_blocks;
            float *qt = buf, *o = qt + Dh * rp, *st = o + rp * Dh, *kt = st + BK * rp;
            float *vt = kt + BK * Dh, *m = vt + BK * Dh, *l = m + rp, *rpos = l + rp;
#define TASK(DH)                                                                           \
    task(q, k, v, table, out, row0, pos0, t0, nq, kh, H, KH, G, DH, bs, scale, rp, qt, o, st, \
         kt, vt, m, l, rpos)
            if (Dh == 64)
                TASK(64);
            else if (Dh == 128)
                TASK(128);
            else
                TASK(Dh);
        }
        free(buf);
    }
    free(first_task);
    return failed ? -1 : 0;
}
