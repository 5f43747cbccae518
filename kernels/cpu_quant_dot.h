/* The block GEMV's inner loops, shared by the GEMV (cpu_quant_gemv.c) and the fused decode
 * forward (cpu_decode.c): one output feature's dot products against up to MAX_ROWS rows of x
 * (dot_row), and a tile of output features' sums and their store (tile_sums, tile_store: the
 * GEMV's tiles and the fused forward's items). Include "cpu_quant_blocks.h" first.
 *
 * Each y value is one thread's sum, so a row's result does not depend on the thread count or on
 * the other rows. Rows go in groups of MAX_ROWS through each tile of output features (its blocks
 * stay in cache across the groups), or at AVX2, from PANEL_MIN_ROWS rows on, in panels
 * (tile_sums_rows), and a row's sums are computed the same way whatever the size of its group.
 * At AVX-512, from OUTER_MIN_ROWS rows, tile_sums_outer takes the rows as vector lanes: faster,
 * and a row's sums still do not depend on the others, but they are summed in another order than
 * the panels': the fused decode forward's (cpu_decode.c), never the GEMV's.
 */
#ifndef BRIGADE_CPU_QUANT_DOT_H
#define BRIGADE_CPU_QUANT_DOT_H
#include <stdlib.h>
#define MAX_ROWS 8
/* How far past the next pair's blocks a one-row pair prefetches. A step reads its weights from
 * DRAM, and the next pair alone (a row or two of blocks, ~1 KiB) is less than a core keeps in
 * flight: the loads of the pair's second row stalled 41 % of a step's GEMV time (perf). 4 KiB
 * ahead, one stream's engine decode, alternated with the next pair alone: AVX-512 1.4-1.6x, the
 * AVX2 level on the same CPU 1.3-1.4x; 2 to 16 KiB within the noise of each other
 * (docs/benchmarks.md). Prefetches past the end of the weights are harmless. */
#define PAIR_PREFETCH_AHEAD 4096
#define TABLE_ROWS 4 /* AVX-512: Q4_1 weights looked up from the block's 16 values up to this many rows */

#if ISA_LEVEL == 2
static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

/* Two output features (rows of blocks w and w + row_bytes) against one row of x -> sums[2]:
 * each feature's sum exactly dot_row's at R = 1 (two accumulators, the same weights and FMAs
 * in the same order), the two interleaved so four FMA chains run, not two (one row's are
 * latency-bound). */
static inline __attribute__((always_inline)) void dot_pair(const int Q8, const uint8_t *w,
                                                           int64_t row_bytes, int nb,
                                                           const float *x, float *sums) {
    const int block_bytes = Q8 ? Q8_0_BYTES : Q4_1_BYTES;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    for (int b = 0; b < nb; ++b) {
        __m512 wa[2], wb[2];
        /* the blocks PAIR_PREFETCH_AHEAD past the next pair's: see the AVX2 level's */
        const uint8_t *ahead = w + 2 * row_bytes + (int64_t)b * block_bytes + PAIR_PREFETCH_AHEAD;
        __builtin_prefetch(ahead);
        __builtin_prefetch(ahead + row_bytes);
        rebuild_block16(Q8, 1, w + (int64_t)b * block_bytes, wa);
        rebuild_block16(Q8, 1, w + row_bytes + (int64_t)b * block_bytes, wb);
        const float *xb = x + (int64_t)b * QK;
        const __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
        a0 = _mm512_fmadd_ps(wa[0], x0, a0);
        b0 = _mm512_fmadd_ps(wb[0], x0, b0);
        a1 = _mm512_fmadd_ps(wa[1], x1, a1);
        b1 = _mm512_fmadd_ps(wb[1], x1, b1);
    }
    sums[0] = hsum(_mm512_add_ps(a0, a1));
    sums[1] = hsum(_mm512_add_ps(b0, b1));
}
#elif ISA_LEVEL == 1
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Two output features (rows of blocks w and w + row_bytes) against one row of x -> sums[2]:
 * each feature's sum exactly dot_row's at R = 1 (two accumulators, the same FMAs in the same
 * order), the two interleaved so four FMA chains run, not two (one row's are latency-bound). */
static inline __attribute__((always_inline)) void dot_pair(const int Q8, const uint8_t *w,
                                                           int64_t row_bytes, int nb,
                                                           const float *x, float *sums) {
    const int block_bytes = Q8 ? Q8_0_BYTES : Q4_1_BYTES;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    for (int b = 0; b < nb; ++b) {
        __m256 wa[4], wb[4];
        /* the blocks PAIR_PREFETCH_AHEAD past the next pair's: the two interleaved streams are
         * not the one sequential stream the hardware prefetcher follows (the LM head, from DRAM,
         * took 2.8x without), and the next pair alone is too short a distance for DRAM */
        const uint8_t *ahead = w + 2 * row_bytes + (int64_t)b * block_bytes + PAIR_PREFETCH_AHEAD;
        __builtin_prefetch(ahead);
        __builtin_prefetch(ahead + row_bytes);
        rebuild_block8(Q8, w + (int64_t)b * block_bytes, wa);
        rebuild_block8(Q8, w + row_bytes + (int64_t)b * block_bytes, wb);
        const float *xb = x + (int64_t)b * QK;
        for (int k = 0; k < 4; k += 2) {
            const __m256 x0 = _mm256_loadu_ps(xb + 8 * k), x1 = _mm256_loadu_ps(xb + 8 * k + 8);
            a0 = _mm256_fmadd_ps(wa[k], x0, a0);
            b0 = _mm256_fmadd_ps(wb[k], x0, b0);
            a1 = _mm256_fmadd_ps(wa[k + 1], x1, a1);
            b1 = _mm256_fmadd_ps(wb[k + 1], x1, b1);
        }
    }
    sums[0] = hsum(_mm256_add_ps(a0, a1));
    sums[1] = hsum(_mm256_add_ps(b0, b1));
}
#endif

/* One output feature: its row of blocks `w` against R rows of x -> sums[R]. Inlined with a
 * constant R, so the accumulators live in vector registers. Q8 selects the block kind. */
static inline __attribute__((always_inline)) void dot_row(
    const int R, const int Q8, const uint8_t *w, int nb, const float *x, int64_t x_stride,
    float *sums) {
    const int block_bytes = Q8 ? Q8_0_BYTES : Q4_1_BYTES;
#if ISA_LEVEL == 2
    __m512 acc0[MAX_ROWS], acc1[MAX_ROWS];
    for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        __m512 wv[2]; /* weights 0..15 and 16..31 of the block */
        /* past one row, the next feature's row, as far ahead: a row is a few cache lines, too
         * short a stream for the hardware prefetcher, and a step's weights come from DRAM (8
         * streams 1.12-1.19x); one row goes in pairs (dot_pair), which prefetch their own */
        if (R > 1) __builtin_prefetch(w + (int64_t)(nb + b) * block_bytes);
        rebuild_block16(Q8, R <= TABLE_ROWS, w + (int64_t)b * block_bytes, wv);
        const __m512 w0 = wv[0], w1 = wv[1];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const float *xb = x + r * x_stride + (int64_t)b * QK;
            acc0[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xb), acc0[r]);
            acc1[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), acc1[r]);
        }
    }
    for (int r = 0; r < R; ++r) sums[r] = hsum(_mm512_add_ps(acc0[r], acc1[r]));
#elif ISA_LEVEL == 1
    /* two accumulators a row (halves of the block), at every R: a row's sum is the same
     * whatever rows share the call (past R = 4 some live on the stack) */
    __m256 acc[MAX_ROWS][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
        __m256 wv[4]; /* weights 0..7, 8..15, 16..23, 24..31 of the block */
        if (R > 1) __builtin_prefetch(w + (int64_t)(nb + b) * block_bytes); /* as at AVX-512 */
        rebuild_block8(Q8, w + (int64_t)b * block_bytes, wv);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const float *xb = x + r * x_stride + (int64_t)b * QK;
            for (int k = 0; k < 4; ++k)
                acc[r][k & 1] = _mm256_fmadd_ps(wv[k], _mm256_loadu_ps(xb + 8 * k), acc[r][k & 1]);
        }
    }
    for (int r = 0; r < R; ++r) sums[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
#else
    float acc[MAX_ROWS][QK];
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < QK; ++i) acc[r][i] = 0.0f;
    for (int b = 0; b < nb; ++b) {
        const uint8_t *blk = w + (int64_t)b * block_bytes;
        float wv[QK];
        if (Q8) {
            const float d = half_to_float(blk);
            for (int i = 0; i < QK; ++i) wv[i] = d * (float)(int8_t)blk[2 + i];
        } else {
            const float d = load_f32(blk), m = load_f32(blk + 4);
            const uint8_t *qs = blk + Q4_1_CODES;
            for (int i = 0; i < QK / 2; ++i) {
                wv[i] = d * (float)(qs[i] & 0x0f) + m;
                wv[i + QK / 2] = d * (float)(qs[i] >> 4) + m;
            }
        }
        for (int r = 0; r < R; ++r) {
            const float *xb = x + r * x_stride + (int64_t)b * QK;
            for (int i = 0; i < QK; ++i) acc[r][i] += wv[i] * xb[i];
        }
    }
    for (int r = 0; r < R; ++r) {
        float s = 0.0f;
        for (int i = 0; i < QK; ++i) s += acc[r][i];
        sums[r] = s;
    }
#endif
}

#define ROWS_CASE(R)                                                          \
    case R:                                                                   \
        dot_row(R, Q8, w + (o0 + j) * row_bytes, nb, xg, x_stride, sums);     \
        break;

/* Output features go in tiles of TILE, each tile's sums stored row by row as one run: storing
 * each feature's R sums straight to y hits rows that are a multiple of 4 KiB apart (49152 fp32
 * logits), and the stores alias (8 rows of the LM head took 3x as long). */
#define TILE 64
/* Up to SMALL_OUT features, tiles of half that: a 576-feature projection is 18 tiles, not 9, so
 * two threads share it evenly. A feature's sums are the same whatever its tile. */
#define SMALL_OUT 2048

static inline int64_t tile_size_of(int64_t out_features) {
    return out_features <= SMALL_OUT ? TILE / 2 : TILE;
}

static inline int64_t num_tiles_of(int64_t out_features) {
    const int64_t size = tile_size_of(out_features);
    return (out_features + size - 1) / size;
}

/* Tile t's features against `group` <= MAX_ROWS rows of x (xg) -> tile[r][j]; its width. */
static inline __attribute__((always_inline)) int tile_sums(
    const int Q8, const uint8_t *w, int64_t out_features, int64_t in_features, const float *xg,
    int64_t x_stride, int group, int64_t t, float (*tile)[TILE]) {
    const int nb = (int)(in_features / QK);
    const int64_t row_bytes = (int64_t)nb * (Q8 ? Q8_0_BYTES : Q4_1_BYTES);
    const int64_t tile_size = tile_size_of(out_features), o0 = t * tile_size;
    const int n = out_features - o0 < tile_size ? (int)(out_features - o0) : (int)tile_size;
    int j = 0;
#if ISA_LEVEL > 0
    if (group == 1) /* a decode step's one row: features in pairs */
        for (; j + 1 < n; j += 2) {
            float sums[2];
            dot_pair(Q8, w + (o0 + j) * row_bytes, row_bytes, nb, xg, sums);
            tile[0][j] = sums[0], tile[0][j + 1] = sums[1];
        }
#endif
    for (; j < n; ++j) {
        float sums[MAX_ROWS];
        switch (group) {
            ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4)
            ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7) ROWS_CASE(8)
        }
        for (int r = 0; r < group; ++r) tile[r][j] = sums[r];
    }
    return n;
}

/* Up to ROWS_MAX rows through tile t at once -> tile[r][j] (ROWS_MAX rows of TILE); its width.
 * With vectors, a step of PANEL_MIN_ROWS or more rows goes in panels (below); otherwise, and
 * without, the rows go through tile_sums in groups of MAX_ROWS, each group rebuilding the
 * tile's blocks again. Either way each sum is dot_row's, bit for bit. */
#define ROWS_MAX 32
#if ISA_LEVEL > 0
/* Many rows. dot_row keeps 2 accumulators a row and its rebuilt weight vectors: at AVX2 past 6
 * rows that is more than its 16 registers, and every spill is a load and a store beside each
 * row's 4 loads of x a block, so 8 rows ran at ~40 % of the FMA peak; at both levels each group
 * of 8 rows rebuilt the tile's blocks again (a 32-row step four times). Here a panel of PANEL_F
 * features is rebuilt once into an L1 buffer of fp32 weights, then every PANEL_R rows of the step
 * go over it with PANEL_F x PANEL_R x 2 accumulators: each x vector loaded serves PANEL_F
 * features and each weight vector PANEL_R rows. AVX2: 12 accumulators, 2 x and 1 weight vector
 * in 15 registers (10 loads for 12 FMAs where dot_row's 8 rows spent 8 loads of x and the
 * spills' for 8); AVX-512: 24 accumulators, 3 x and 1 weight vector of its 32 (7 loads for 12
 * FMAs). The accumulators take the chunks of a block alternately, as dot_row's do (chunk c of a
 * feature into acc[c & 1]), with the same FMAs in the same order: the same sums, bit for bit.
 * 30 layers' linears from DRAM, 2 threads, AVX2: 1.23-1.34x at 8 to 32 rows, a tie at 6;
 * AVX-512: docs/benchmarks.md. */
#if ISA_LEVEL == 2
typedef __m512 vec_t;
#define VW 16 /* floats a vector */
#define PANEL_F 4
#define PANEL_R 3
#define vec_zero _mm512_setzero_ps
#define vec_loadu _mm512_loadu_ps
#define vec_load _mm512_load_ps
#define vec_store _mm512_store_ps
#define vec_fmadd _mm512_fmadd_ps
#define vec_add _mm512_add_ps
#define REBUILD(Q8, blk, wv) rebuild_block16(Q8, 0, blk, wv)
#else
typedef __m256 vec_t;
#define VW 8
#define PANEL_F 3
#define PANEL_R 2
#define vec_zero _mm256_setzero_ps
#define vec_loadu _mm256_loadu_ps
#define vec_load _mm256_load_ps
#define vec_store _mm256_store_ps
#define vec_fmadd _mm256_fmadd_ps
#define vec_add _mm256_add_ps
#define REBUILD(Q8, blk, wv) rebuild_block8(Q8, blk, wv)
#endif
#define PANEL_MIN_ROWS 7
/* the buffer, PANEL_F rows of fp32 weights, on the stack: 48 KiB */
#define PANEL_MAX_IN (12288 / PANEL_F)

static inline __attribute__((always_inline)) void panel_dot(const int F, const int R,
                                                            const float *wb, int64_t in,
                                                            const float *x, int64_t x_stride,
                                                            float *sums) {
    vec_t acc[PANEL_F][PANEL_R][2];
    for (int f = 0; f < F; ++f)
        for (int r = 0; r < R; ++r) acc[f][r][0] = acc[f][r][1] = vec_zero();
    for (int64_t k = 0; k < in; k += 2 * VW) {
        for (int h = 0; h < 2; ++h) {
            vec_t xv[PANEL_R];
            for (int r = 0; r < R; ++r) {
                xv[r] = vec_loadu(x + r * x_stride + k + VW * h);
                /* in a register: folded into each FMA it would be loaded F times */
                __asm__("" : "+v"(xv[r]));
            }
            for (int f = 0; f < F; ++f) {
                vec_t wv = vec_load(wb + f * in + k + VW * h);
                __asm__("" : "+v"(wv));
                for (int r = 0; r < R; ++r) acc[f][r][h] = vec_fmadd(wv, xv[r], acc[f][r][h]);
            }
        }
    }
    for (int f = 0; f < F; ++f)
        for (int r = 0; r < R; ++r) sums[f * R + r] = hsum(vec_add(acc[f][r][0], acc[f][r][1]));
}

#define PANEL_CASE(F, R)                                                          \
    case (F) * 8 + (R):                                                           \
        panel_dot(F, R, wb, in_features, x + r0 * x_stride, x_stride, sums);      \
        break;

static inline __attribute__((always_inline)) int tile_sums_panel(
    const int Q8, const uint8_t *w, int64_t out_features, int64_t in_features, const float *x,
    int64_t x_stride, int rows, int64_t t, float (*tile)[TILE]) {
    const int nb = (int)(in_features / QK), block_bytes = Q8 ? Q8_0_BYTES : Q4_1_BYTES;
    const int64_t row_bytes = (int64_t)nb * block_bytes;
    const int64_t tile_size = tile_size_of(out_features), o0 = t * tile_size;
    const int n = out_features - o0 < tile_size ? (int)(out_features - o0) : (int)tile_size;
    float wb[PANEL_F * PANEL_MAX_IN] __attribute__((aligned(64)));
    for (int j = 0; j < n; j += PANEL_F) {
        const int nf = n - j < PANEL_F ? n - j : PANEL_F;
        for (int f = 0; f < nf; ++f) {
            const uint8_t *wr = w + (o0 + j + f) * row_bytes;
            for (int b = 0; b < nb; ++b) {
                vec_t wv[QK / VW];
                /* the next panel's row, as far ahead (a step's weights come from DRAM) */
                __builtin_prefetch(wr + PANEL_F * row_bytes + (int64_t)b * block_bytes);
                REBUILD(Q8, wr + (int64_t)b * block_bytes, wv);
                for (int k = 0; k < QK / VW; ++k)
                    vec_store(wb + f * in_features + (int64_t)b * QK + VW * k, wv[k]);
            }
        }
        for (int r0 = 0; r0 < rows; r0 += PANEL_R) {
            const int nr = rows - r0 < PANEL_R ? rows - r0 : PANEL_R;
            float sums[PANEL_F * PANEL_R];
            switch (nf * 8 + nr) {
                PANEL_CASE(1, 1) PANEL_CASE(1, 2) PANEL_CASE(2, 1)
                PANEL_CASE(2, 2) PANEL_CASE(3, 1) PANEL_CASE(3, 2)
#if PANEL_F > 3 || PANEL_R > 2
                PANEL_CASE(1, 3) PANEL_CASE(2, 3) PANEL_CASE(3, 3)
                PANEL_CASE(4, 1) PANEL_CASE(4, 2) PANEL_CASE(4, 3)
#endif
            }
            for (int f = 0; f < nf; ++f)
                for (int r = 0; r < nr; ++r) tile[r0 + r][j + f] = sums[f * nr + r];
        }
    }
    return n;
}
#endif

static inline __attribute__((always_inline)) int tile_sums_rows(
    const int Q8, const uint8_t *w, int64_t out_features, int64_t in_features, const float *x,
    int64_t x_stride, int rows, int64_t t, float (*tile)[TILE]) {
#if ISA_LEVEL > 0
    if (rows >= PANEL_MIN_ROWS && in_features <= PANEL_MAX_IN)
        return tile_sums_panel(Q8, w, out_features, in_features, x, x_stride, rows, t, tile);
#endif
    int n = 0;
    for (int g0 = 0; g0 < rows; g0 += MAX_ROWS) {
        const int group = rows - g0 < MAX_ROWS ? rows - g0 : MAX_ROWS;
        n = tile_sums(Q8, w, out_features, in_features, x + (int64_t)g0 * x_stride, x_stride,
                      group, t, tile + g0);
    }
    return n;
}

#if ISA_LEVEL == 2
/* Many rows at AVX-512, the weights broadcast. The panels above take a dot product along the
 * inputs per (feature, row): at 32 rows a 576-input projection spent ~15 % of
 * its time on the horizontal sums that close each one and ~14 % scattering the sums into the
 * tile, with the FMA loop at ~60 % (perf, docs/benchmarks.md). Here the step's rows are the
 * vector lanes instead: x is transposed once a phase on each thread (xt [in][32], the rows past
 * T zero), and OUTER_F features of the tile, rebuilt into an fp32 buffer, go over it with
 * OUTER_F x 2 accumulators, each holding one feature's sums for 16 rows: per input, 2 loads of xt
 * and OUTER_F broadcasts of a weight for 2 OUTER_F FMAs, no horizontal sum, and each feature's
 * 32 sums leave in two vector stores. A sum runs over the inputs in order, one FMA each: not
 * the panels' order, so a row's sums here differ from the one-row path's in the last bits. Only
 * the fused decode forward takes it (off in the batch-invariant mode; the GEMV keeps the panels:
 * its LM head at 32 rows measured the same either way, docs/benchmarks.md). A row's sums do not
 * depend on how many rows share the step, nor on the threads.
 * Its cost is 32 rows' whatever the rows; the panels' grows with them. Engine alone, fresh
 * processes alternated against the panels: 32 streams 1.05-1.12x, 26 a tie, 20 0.85x, 16 0.75x. */
#define OUTER_MIN_ROWS 28
#define OUTER_F 8
#define OUTER_LANES 32

typedef struct { /* a thread's buffers: xt [in][OUTER_LANES], then OUTER_F rebuilt rows */
    float *buf;
    int64_t cap, phase; /* floats held; the phase whose x xt holds (-1 none) */
} Outer;

static int outer_reserve(Outer *o, int64_t in) {
    const int64_t need = in * (OUTER_LANES + OUTER_F);
    if (need <= o->cap) return 1;
    free(o->buf);
    o->buf = aligned_alloc(64, (size_t)need * sizeof(float));
    o->cap = o->buf == NULL ? 0 : need;
    o->phase = -1;
    return o->buf != NULL;
}

/* x [rows, in] (x_stride) -> xt [in][32]: lane r of input k is x[r][k], zero past `rows`; in
 * 16 x 16 blocks through the registers (gathers took ~13 % of the projections' time) */
static void outer_transpose(const float *x, int64_t x_stride, int rows, int64_t in, float *xt) {
    for (int rv = 0; rv < OUTER_LANES / 16; ++rv) {
        const int r0 = 16 * rv;
        for (int64_t k0 = 0; k0 < in; k0 += 16) {
            __m512 r[16], t[16], u[16];
            for (int i = 0; i < 16; ++i)
                r[i] = r0 + i < rows ? _mm512_loadu_ps(x + (int64_t)(r0 + i) * x_stride + k0)
                                     : _mm512_setzero_ps();
            for (int i = 0; i < 16; i += 2) { /* lane L: rows i, i+1 of columns 4L .. 4L+3 */
                t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
                t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
            }
            for (int g = 0; g < 4; ++g) { /* u[4g + c], lane L: rows 4g .. 4g+3 of column 4L + c */
                const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 2]);
                const __m512d c = _mm512_castps_pd(t[4 * g + 1]), d = _mm512_castps_pd(t[4 * g + 3]);
                u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
                u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
                u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
                u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
            }
            for (int c = 0; c < 4; ++c) { /* column 4L + c: lane g from u[4g + c]'s lane L */
                const __m512 a0 = _mm512_shuffle_f32x4(u[c], u[4 + c], _MM_SHUFFLE(1, 0, 1, 0));
                const __m512 a1 = _mm512_shuffle_f32x4(u[c], u[4 + c], _MM_SHUFFLE(3, 2, 3, 2));
                const __m512 b0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(1, 0, 1, 0));
                const __m512 b1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(3, 2, 3, 2));
                float *o = xt + (k0 + c) * OUTER_LANES + r0;
                _mm512_store_ps(o, _mm512_shuffle_f32x4(a0, b0, _MM_SHUFFLE(2, 0, 2, 0)));
                _mm512_store_ps(o + 4 * OUTER_LANES, _mm512_shuffle_f32x4(a0, b0, _MM_SHUFFLE(3, 1, 3, 1)));
                _mm512_store_ps(o + 8 * OUTER_LANES, _mm512_shuffle_f32x4(a1, b1, _MM_SHUFFLE(2, 0, 2, 0)));
                _mm512_store_ps(o + 12 * OUTER_LANES, _mm512_shuffle_f32x4(a1, b1, _MM_SHUFFLE(3, 1, 3, 1)));
            }
        }
    }
}

/* wb: the F features' weights block by block, [in / QK][F][QK]: the broadcasts of one input are
 * F constant offsets from one pointer (with a pointer per feature the registers ran out) */
static inline __attribute__((always_inline)) void outer_dot(const int F, const float *wb,
                                                            int64_t in, const float *xt,
                                                            float (*sums)[OUTER_LANES]) {
    __m512 acc[OUTER_F][2];
    for (int f = 0; f < F; ++f) acc[f][0] = acc[f][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < in / QK; ++b) {
        const float *wblk = wb + b * F * QK, *xblk = xt + b * QK * OUTER_LANES;
        for (int kk = 0; kk < QK; ++kk) {
            const __m512 x0 = _mm512_load_ps(xblk + kk * OUTER_LANES);
            const __m512 x1 = _mm512_load_ps(xblk + kk * OUTER_LANES + 16);
            for (int f = 0; f < F; ++f) {
                const __m512 wv = _mm512_set1_ps(wblk[f * QK + kk]);
                acc[f][0] = _mm512_fmadd_ps(wv, x0, acc[f][0]);
                acc[f][1] = _mm512_fmadd_ps(wv, x1, acc[f][1]);
            }
        }
    }
    for (int f = 0; f < F; ++f) {
        _mm512_store_ps(sums[f], acc[f][0]);
        _mm512_store_ps(sums[f] + 16, acc[f][1]);
    }
}

#define OUTER_CASE(F)                                           \
    case F:                                                     \
        outer_dot(F, wb, in_features, o->buf, sums);            \
        break;

/* Tile t's features against the rows in xt -> tile[r][j] for r < rows; its width. */
static inline __attribute__((always_inline)) int tile_sums_outer(
    const int Q8, const uint8_t *w, int64_t out_features, int64_t in_features, const Outer *o,
    int rows, int64_t t, float (*tile)[TILE]) {
    const int nb = (int)(in_features / QK), block_bytes = Q8 ? Q8_0_BYTES : Q4_1_BYTES;
    const int64_t row_bytes = (int64_t)nb * block_bytes;
    const int64_t tile_size = tile_size_of(out_features), o0 = t * tile_size;
    const int n = out_features - o0 < tile_size ? (int)(out_features - o0) : (int)tile_size;
    float *wb = o->buf + in_features * OUTER_LANES;
    float sums[OUTER_F][OUTER_LANES] __attribute__((aligned(64)));
    for (int j = 0; j < n; j += OUTER_F) {
        const int nf = n - j < OUTER_F ? n - j : OUTER_F;
        for (int f = 0; f < nf; ++f) {
            const uint8_t *wr = w + (o0 + j + f) * row_bytes;
            for (int b = 0; b < nb; ++b) {
                __m512 wv[2];
                __builtin_prefetch(wr + OUTER_F * row_bytes + (int64_t)b * block_bytes);
                rebuild_block16(Q8, 0, wr + (int64_t)b * block_bytes, wv);
                float *dst = wb + ((int64_t)b * nf + f) * QK;
                _mm512_store_ps(dst, wv[0]);
                _mm512_store_ps(dst + 16, wv[1]);
            }
        }
        switch (nf) {
            OUTER_CASE(1) OUTER_CASE(2) OUTER_CASE(3) OUTER_CASE(4)
            OUTER_CASE(5) OUTER_CASE(6) OUTER_CASE(7) OUTER_CASE(8)
        }
        for (int f = 0; f < nf; ++f)
            for (int r = 0; r < rows; ++r) tile[r][j + f] = sums[f][r];
    }
    return n;
}
#else
typedef struct { float *buf; int64_t cap, phase; } Outer; /* unused below AVX-512 */
#endif

/* rows of tile t's sums into y (ADD: added to y, the residual add of an output projection) */
static inline __attribute__((always_inline)) void tile_store(
    const int ADD, int64_t out_features, float (*tile)[TILE], int rows, int n, float *y,
    int64_t y_stride, int64_t t) {
    const int64_t o0 = t * tile_size_of(out_features);
    for (int r = 0; r < rows; ++r) {
        float *yr = y + (int64_t)r * y_stride + o0;
        if (ADD)
            for (int j = 0; j < n; ++j) yr[j] += tile[r][j];
        else
            memcpy(yr, tile[r], n * sizeof(float));
    }
}

#endif
