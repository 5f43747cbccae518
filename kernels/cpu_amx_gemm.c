/* fp32 GEMM over GGUF Q4_1 blocks on AMX's bf16 tiles: y = x W^T for many rows of x (prefill
 * chunks), with sixteen significant bits of x, not bf16's eight.
 *
 * A Q4_1 weight is d * q + m: q a 4-bit code, d and m the block's scales (fp16 in the file, so
 * 11 significant bits each). So for one block b of 32 inputs,
 *     sum_i x_i w_i = sum_i x_i (d q_i) + m * sum_i x_i,
 * and every factor splits into bf16 pieces (8 significant bits each):
 *   - d q_i has at most 15 significant bits: two pieces, hi + lo (hi its top 8 bits, cut by
 *     truncation), hold it exactly, |lo| < 2^-7 |d q_i|;
 *   - m: two pieces, exactly;
 *   - x_i (fp32, 24 bits): two pieces, xh + xm, each rounded to nearest (xh of x_i, xm of what
 *     xh left, exact in fp32): |x_i - xh - xm| <= 2^-16 |x_i|, |xm| <= 2^-8 |x_i|.
 * AMX's TDPBF16PS multiplies bf16 pairs exactly into fp32 and adds in fp32, so three products,
 * xh*hi + xm*hi + xh*lo, give each term x_i d q_i within 2^-16 + 2^-15 < 2^-14 of |x_i d q_i|
 * (what x lost, and the product left out, xm*lo). Both errors are unbiased (x's pieces are
 * rounded to nearest, xm's sign is the rounding's), so over K terms they grow as sqrt(K), not K.
 * The m terms are the same GEMM over extra K: the rows' block sums (fp32, two pieces) against
 * m (two pieces). The sums are fp32 throughout. Three tile products an fp32 multiply-add; the
 * fp32 matmul up to summation order took five (x in three pieces, every product but xl*lo),
 * and a 512-token prefill's GEMMs 1.3x as long (docs/benchmarks.md). The AVX-512 FMA kernels
 * (cpu_quant_gemm.c, `amx_prefill=False`) stay the exact path.
 *
 * Layouts, made once at load by kernels/cpu_amx_gemm.py (pack) from the held Q4_1 blocks, output
 * features padded to a multiple of 32 (two panels of 16, one tile's columns each):
 *   nib [panel][nb][16][16] uint8   a B tile's rows of codes: row i holds, for lane j = 2n + p,
 *                                   q[16 panel + n][32 b + 2 i + p]; byte j the lanes j (low
 *                                   nibble) and j + 16 (high nibble)
 *   dv  [panel][nb][32] fp32        d of lane j's feature
 *   mv  [panel][ne][16][32] fp32    the m rows: row i, lane j: m[16 panel + n] of block
 *                                   32 e + 2 i + p (0 past the last block); ne = ceil(nb / 32)
 *   x   [rows, in] fp32, row stride x_stride;  y [rows, out] fp32, row stride y_stride
 * kernel_isa() is 3 where it was built with AMX, else 0 and every entry refuses (-3).
 *
 * The same tiles in int8 screen the greedy rows' LM head (amx_screen, below): what
 * cpu_greedy_head.c does with `vpdpbusd`, at whole rows of K a tile product.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && \
    defined(__AVX512BF16__) && defined(__AVX512BW__)
#define AMX 1
#include <immintrin.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include "cpu_int8_scale.h"
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#else
#define AMX 0
#endif

int kernel_isa(void) { return AMX ? 3 : 0; }

#if AMX
#define QK 32
#define HUGE_PAGE (2 << 20)
#define PIECE_BYTES 1024 /* one tile: 16 rows of 32 bf16 */
#ifndef SUPER_BYTES
#define SUPER_BYTES (1536 * 1024)
#endif /* packed x of one row super-block: within L2 */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Every tile 16 rows of 64 bytes: 0-3 the 2 x 2 accumulators, 4-5 x, 6-7 the weights. GCC 12's
 * _tile_loadconfig declares an 8-byte read, so the compiler may drop the configuration's other
 * stores as dead; this asm names the whole struct. */
static void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

/* One tile product of known operands: 1 when its sums are right. */
static int tile_product_right(void) {
#ifdef BRIGADE_TRAP_IN_PROBE /* the tests' stand-in for a CPU that lists AMX and traps on it */
    __builtin_trap();
#endif
    static uint16_t a[16 * 32], b[16 * 32];
    static float c[16 * 16];
    for (int i = 0; i < 16 * 32; ++i) {
        a[i] = 0x3f80;                              /* 1.0 */
        b[i] = (uint16_t)(0x4000 + (i & 1) * 0x40); /* 2.0, 3.0 */
    }
    configure_tiles();
    _tile_zero(0);
    _tile_loadd(4, a, 64);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_stored(0, c, 64);
    _tile_release();
    for (int i = 0; i < 16 * 16; ++i)
        if (c[i] != 80.0f) return 0; /* 16 pairs of 1 * 2 + 1 * 3 */
    static int8_t ai[16 * 64], bi[16 * 64];
    static int32_t ci[16 * 16];
    for (int i = 0; i < 16 * 64; ++i) {
        ai[i] = -3;
        bi[i] = (int8_t)(i & 1 ? 127 : -128);
    }
    configure_tiles();
    _tile_zero(1);
    _tile_loadd(5, ai, 64);
    _tile_loadd(7, bi, 64);
    _tile_dpbssd(1, 5, 7);
    _tile_stored(1, ci, 64);
    _tile_release();
    for (int i = 0; i < 16 * 16; ++i)
        if (ci[i] != 32 * 3) return 0; /* 32 pairs of -3 * 127 + -3 * -128 */
    return 1;
}

/* Linux hands out AMX's tile state only on request (ARCH_REQ_XCOMP_PERM for XTILEDATA), once per
 * process. 1: granted, and one tile product gave the right sums, first in a child process (a CPU
 * or VM that lists AMX and traps on it kills the child, not the caller), then here. */
int amx_ready(void) {
    if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return 0;
    const pid_t child = fork();
    if (child == 0) _exit(tile_product_right() ? 0 : 1); /* the permission is inherited */
    if (child < 0) return 0;
    int status = 0;
    while (waitpid(child, &status, 0) < 0)
        if (errno != EINTR) return 0;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return 0;
    return tile_product_right();
}

/* The tiles' peak: `iters` rounds of four independent TDPBF16PS on each of `threads` threads,
 * operands in registers -> the bf16 flops done (2 x 16 x 16 x 32 an instruction). */
double amx_tile_flops(int64_t iters, int threads) {
    if (threads < 1) threads = 1;
#ifndef _OPENMP
    threads = 1;
#endif
#pragma omp parallel num_threads(threads)
    {
        static __thread uint16_t zeros[16 * 32] __attribute__((aligned(64)));
        configure_tiles();
        _tile_loadd(4, zeros, 64);
        _tile_loadd(5, zeros, 64);
        _tile_loadd(6, zeros, 64);
        _tile_loadd(7, zeros, 64);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t i = 0; i < iters; ++i) {
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        _tile_release();
    }
    return (double)threads * (double)iters * 4.0 * 2.0 * 16 * 16 * 32;
}

/* The weights' pieces are cut by truncation: a value's top 8 significant bits (its fp32 bits
 * with the low 16 cleared, a bf16 exactly), then what is left, exact in fp32 and a bf16 too. */
#define HIGH_BITS 0xffff0000u

static inline __m512 truncated(__m512 v) {
    return _mm512_castsi512_ps(
        _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)HIGH_BITS)));
}

/* v rounded to its nearest bf16 (ties to even), as fp32: x's pieces. Finite v only (a value
 * within half a bf16 step of FLT_MAX would round to infinity; activations are far below). */
static inline __m512 rounded(__m512 v) {
    const __m512i b = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32((int)HIGH_BITS)));
}

/* 32 fp32 whose low 16 bits are zero (lo: lanes 0..15, hi: 16..31) -> the 32 bf16, in order. */
static inline void store_bf16(uint16_t *dst, __m512 lo, __m512 hi) {
    const __m512i odd_words = _mm512_set_epi16(
        63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
        31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);  /* clang-format: keep */
    _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(_mm512_castps_si512(lo), odd_words,
                                                       _mm512_castps_si512(hi)));
}

/* 32 fp32 -> two bf16 rows of 32, xh + xm within 2^-16 of the values: xh each value rounded to
 * nearest, xm what it left (exact in fp32) rounded to nearest. */
static inline void split_x(__m512 lo, __m512 hi, uint16_t *h, uint16_t *m) {
    const __m512 hl = rounded(lo), hh = rounded(hi);
    store_bf16(h, hl, hh);
    store_bf16(m, rounded(_mm512_sub_ps(lo, hl)), rounded(_mm512_sub_ps(hi, hh)));
}

/* 32 fp32 of at most 16 significant bits (d * q, or m) -> two bf16 rows, hi + lo = them. */
static inline void split2(__m512 lo, __m512 hi, uint16_t *h, uint16_t *l) {
    const __m512 hl = truncated(lo), hh = truncated(hi);
    store_bf16(h, hl, hh);
    store_bf16(l, _mm512_sub_ps(lo, hl), _mm512_sub_ps(hi, hh));
}

/* Rows r0 .. r0 + 15 of x (those < rows; the rest zero) -> their A tiles:
 * xa [kbt][2][16][32] bf16, nb blocks of x, then ne blocks of the rows' block sums. */
static void pack_rows(const float *x, int64_t x_stride, int64_t rows, int64_t r0, int nb, int ne,
                      uint16_t *xa, float *sums /* [16][ne * 32] */) {
    memset(sums, 0, sizeof(float) * 16 * ne * QK);
    for (int r = 0; r < 16; ++r) {
        const int live = r0 + r < rows;
        const float *xr = x + (r0 + r) * x_stride;
        for (int b = 0; b < nb; ++b) {
            uint16_t *t = xa + (int64_t)b * 2 * (PIECE_BYTES / 2) + r * QK;
            __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
            if (live) {
                lo = _mm512_loadu_ps(xr + b * QK);
                hi = _mm512_loadu_ps(xr + b * QK + 16);
                sums[r * ne * QK + b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
            }
            split_x(lo, hi, t, t + PIECE_BYTES / 2);
        }
    }
    for (int e = 0; e < ne; ++e)
        for (int r = 0; r < 16; ++r) {
            uint16_t *t = xa + (int64_t)(nb + e) * 2 * (PIECE_BYTES / 2) + r * QK;
            const float *s = sums + r * ne * QK + e * QK;
            split_x(_mm512_loadu_ps(s), _mm512_loadu_ps(s + 16), t, t + PIECE_BYTES / 2);
        }
}

/* Panels 2 pp and 2 pp + 1 -> their B tiles: wb [kbt][2 pieces][2 panels][16][32] bf16. */
static void unpack_panels(const uint8_t *nib, const float *dv, const float *mv, int64_t pp,
                          int nb, int ne, uint16_t *wb) {
    const __m512i low4 = _mm512_set1_epi32(0x0f);
    for (int s = 0; s < 2; ++s) {
        const int64_t panel = 2 * pp + s;
        for (int b = 0; b < nb; ++b) {
            const uint8_t *codes = nib + (panel * nb + b) * 256;
            const __m512 dlo = _mm512_loadu_ps(dv + (panel * nb + b) * QK);
            const __m512 dhi = _mm512_loadu_ps(dv + (panel * nb + b) * QK + 16);
            uint16_t *hi_t = wb + ((int64_t)b * 4 + s) * (PIECE_BYTES / 2);
            uint16_t *lo_t = hi_t + 2 * (PIECE_BYTES / 2);
            for (int i = 0; i < 16; ++i) {
                const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16 * i)));
                const __m512 wlo = _mm512_mul_ps(dlo, _mm512_cvtepi32_ps(_mm512_and_si512(q, low4)));
                const __m512 whi = _mm512_mul_ps(dhi, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)));
                split2(wlo, whi, hi_t + i * QK, lo_t + i * QK); /* d * q: exact in fp32 */
            }
        }
        for (int e = 0; e < ne; ++e) {
            const float *m = mv + ((panel * ne + e) * 16) * QK;
            uint16_t *hi_t = wb + ((int64_t)(nb + e) * 4 + s) * (PIECE_BYTES / 2);
            uint16_t *lo_t = hi_t + 2 * (PIECE_BYTES / 2);
            for (int i = 0; i < 16; ++i)
                split2(_mm512_loadu_ps(m + i * QK), _mm512_loadu_ps(m + i * QK + 16),
                       hi_t + i * QK, lo_t + i * QK);
        }
    }
}

/* 32 rows (two A row tiles at xa0, xa1) x 32 features (wb) over kbt blocks -> tmp [32][32]. */
static void tile_2x2(const uint16_t *xa0, const uint16_t *xa1, const uint16_t *wb, int kbt,
                     float *tmp) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
/* x's piece at OFF in both row tiles against the weights' piece in tiles 6 and 7, into the
 * 2 x 2 accumulators (tile numbers are immediates: a macro, not a loop) */
#define FOUR_PRODUCTS(OFF)                      \
    do {                                        \
        _tile_loadd(4, a0 + (OFF), 64);         \
        _tile_loadd(5, a1 + (OFF), 64);         \
        _tile_dpbf16ps(0, 4, 6);                \
        _tile_dpbf16ps(1, 4, 7);                \
        _tile_dpbf16ps(2, 5, 6);                \
        _tile_dpbf16ps(3, 5, 7);                \
    } while (0)
    for (int b = 0; b < kbt; ++b) {
        const uint16_t *a0 = xa0 + (int64_t)b * 2 * (PIECE_BYTES / 2);
        const uint16_t *a1 = xa1 + (int64_t)b * 2 * (PIECE_BYTES / 2);
        const uint16_t *w = wb + (int64_t)b * 4 * (PIECE_BYTES / 2);
        /* the weights' hi piece against x's two */
        _tile_loadd(6, w, 64);
        _tile_loadd(7, w + PIECE_BYTES / 2, 64);
        FOUR_PRODUCTS(0);
        FOUR_PRODUCTS(PIECE_BYTES / 2);
        /* the lo piece against xh */
        _tile_loadd(6, w + PIECE_BYTES, 64);
        _tile_loadd(7, w + 3 * (PIECE_BYTES / 2), 64);
        FOUR_PRODUCTS(0);
    }
#undef FOUR_PRODUCTS
    _tile_stored(0, tmp, 128);
    _tile_stored(1, tmp + 16, 128);
    _tile_stored(2, tmp + 16 * 32, 128);
    _tile_stored(3, tmp + 16 * 32 + 16, 128);
}

/* The calling thread's scratch, kept between calls and grown as needed (a fresh allocation of
 * this size is mapped anew each call, and its page faults cost as much as packing the rows), in
 * 2 MB pages where the kernel gives them: the tiles' loads walk megabytes of packed rows, and
 * with 4 KB pages their TLB misses doubled a layer's GEMMs (9.2 -> 19 ms) once a second buffer
 * of that size was in use between calls. */
static void *scratch(size_t bytes) {
    static __thread void *buf = NULL;
    static __thread size_t cap = 0;
    if (bytes > cap) {
        free(buf);
        cap = (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
        buf = aligned_alloc(HUGE_PAGE, cap);
        if (buf == NULL) cap = 0;
#ifdef MADV_HUGEPAGE
        else madvise(buf, cap, MADV_HUGEPAGE);
#endif
    }
    return buf;
}

/* 0 on success; -1 for a shape it does not take (the wrapper checks first); -2 no memory for
 * the packed rows; -3 not built with AMX. amx_ready() must have returned 1 in this process. */
int amx_gemm_q4_1(const uint8_t *nib, const float *dv, const float *mv, int64_t out_features,
                  int64_t in_features, const float *x, int64_t x_stride, int64_t rows, float *y,
                  int64_t y_stride, int num_threads) {
    if (in_features % QK || in_features < QK || rows < 1 || out_features < 1) return -1;
    const int nb = (int)(in_features / QK), ne = (nb + QK - 1) / QK, kbt = nb + ne;
    const int64_t num_pairs = (out_features + 31) / 32;
    const int64_t row_tiles = (rows + 31) / 32 * 2; /* in pairs: rows padded to 32 */
    const int64_t tile_elems = (int64_t)kbt * 2 * (PIECE_BYTES / 2); /* one row tile's A */
    const int64_t wb_elems = (int64_t)kbt * 4 * (PIECE_BYTES / 2);
    int64_t pairs_per_super = SUPER_BYTES / (2 * tile_elems * 2);
    if (pairs_per_super < 1) pairs_per_super = 1;
    if (num_threads < 1) num_threads = 1;
#ifndef _OPENMP
    num_threads = 1;
#endif
    const size_t bytes = (size_t)(row_tiles * tile_elems + num_threads * wb_elems) * 2 +
                         (size_t)num_threads * (16 * ne * QK + 32 * 32) * sizeof(float);
    uint16_t *xa = scratch(bytes);
    if (xa == NULL) return -2;
    uint16_t *wb_all = xa + row_tiles * tile_elems;
    float *f32_all = (float *)(wb_all + num_threads * wb_elems);
#pragma omp parallel num_threads(num_threads) if (out_features * rows >= 4096)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num();
#else
        const int t = 0;
#endif
        uint16_t *wb = wb_all + t * wb_elems;
        float *sums = f32_all + t * (16 * ne * QK + 32 * 32), *tmp = sums + 16 * ne * QK;
#pragma omp for schedule(static)
        for (int64_t rt = 0; rt < row_tiles; ++rt)
            pack_rows(x, x_stride, rows, rt * 16, nb, ne, xa + rt * tile_elems, sums);
        configure_tiles();
        const int64_t num_row_pairs = row_tiles / 2;
        for (int64_t s0 = 0; s0 < num_row_pairs; s0 += pairs_per_super) {
            const int64_t s1 = s0 + pairs_per_super < num_row_pairs ? s0 + pairs_per_super
                                                                     : num_row_pairs;
            /* the same panel pairs for each thread in every super-block: no barrier needed */
#pragma omp for schedule(static) nowait
            for (int64_t pp = 0; pp < num_pairs; ++pp) {
                unpack_panels(nib, dv, mv, pp, nb, ne, wb);
                const int64_t o0 = pp * 32;
                const int nc = out_features - o0 < 32 ? (int)(out_features - o0) : 32;
                for (int64_t rp = s0; rp < s1; ++rp) {
                    tile_2x2(xa + 2 * rp * tile_elems, xa + (2 * rp + 1) * tile_elems, wb, kbt,
                             tmp);
                    const int64_t r0 = rp * 32;
                    const int nr = rows - r0 < 32 ? (int)(rows - r0) : 32;
                    for (int r = 0; r < nr; ++r)
                        memcpy(y + (r0 + r) * y_stride + o0, tmp + r * 32, nc * sizeof(float));
                }
            }
        }
        _tile_release();
    }
    return 0;
}

/* ---- The greedy rows' LM head, screened on int8 tiles (kernels/cpu_greedy_head.py) ----
 *
 * Where cpu_greedy_head.c rounds x per block of 32 and sums per block (Q8_0's d is per block),
 * this rounds once per row and sums whole rows of K in the tile: the head is held a second way,
 * each vocabulary row v rounded to int8 on its own scale s_v = max |w_v| / 127 (w' = round(w /
 * s_v)), and each row of x cut into two int8 pieces on its scale dx = max |x| / 127: xh =
 * round(x / dx), xl = round(254 (x / dx - xh)), so x^ = dx (xh + xl / 254) is within dx / 508 of
 * x. The sums sh = xh . w', sl = xl . w' are exact in int32 (TDPBSSD), and
 *     approx = dx s_v (sh + sl / 254) = x^ . w^   (w^ = s_v w'), up to fp32's rounding;
 *     |x . w - x^ . w^| <= max|x - x^| sum|w| + sum|x^| max|w - w^|   (tx A_v + l1 ew_v).
 * The fp32 GEMV that decides differs from x . w by at most ~K u sum|x w| <= K u |x|_2 |w|_2, and
 * approx's own rounding by a few u of the same; the bound takes (2 K + 16) u |x|_2 |w|_2 for both,
 * and the sum is widened by SCREEN_MARGIN. Candidates are then listed as cpu_greedy_head.c does.
 *
 * Layouts (made once at load by kernels/cpu_greedy_head.py, vocabulary padded to a multiple of
 * 32 with zero rows, K to a multiple of 64 with zeros):
 *   wq [VG][KT][16][64] int8   B tiles: for vocab group g (16 rows) and K tile t, row i holds
 *                              w'[16 g + n][64 t + 4 i + j] at byte 4 n + j
 *   wv [4][VG * 16] fp32       s_v, A_v = sum|w_v|, ew_v = max|w_v - w^_v|, |w_v|_2 (rounded up)
 *   x  [rows, K] fp32 (K the unpadded width), hi [rows, VG * 16], lo_max [rows]: each row's
 *   greatest lower bound */
#define SCREEN_MARGIN 1.0625f
#define XL_SCALE 254.0f

typedef struct {
    float dx, tx, l1, n2;
} screen_row;

/* x's rows -> their two pieces (zero rows past `rows` up to a multiple of 16) and their terms;
 * -1 for a value that is not finite */
static int screen_pieces(const float *x, int64_t rows, int64_t K, int64_t KP, int8_t *xh,
                         int8_t *xl, screen_row *info) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * K;
        float amax, dx, inv; /* dx 0: the row is left out (its whole |x| goes into tx) */
        if (int8_scale(xr, K, &amax, &dx, &inv)) return -1;
        double tx = 0.0, l1 = 0.0, n2 = 0.0;
        for (int64_t k = 0; k < K; ++k) {
            const float t = xr[k] * inv;
            float h = nearbyintf(t);
            h = h > 127.0f ? 127.0f : h < -127.0f ? -127.0f : h;
            float l = nearbyintf((t - h) * XL_SCALE);
            l = l > 127.0f ? 127.0f : l < -127.0f ? -127.0f : l;
            xh[r * KP + k] = (int8_t)h;
            xl[r * KP + k] = (int8_t)l;
            const double xhat = (double)dx * ((double)h + (double)l / XL_SCALE);
            const double e = fabs((double)xr[k] - xhat);
            tx = e > tx ? e : tx;
            l1 += fabs(xhat);
            n2 += (double)xr[k] * (double)xr[k];
        }
        info[r] = (screen_row){dx, (float)(tx * (1.0 + 1e-6)), (float)(l1 * (1.0 + 1e-6)),
                               (float)(sqrt(n2) * (1.0 + 1e-6))};
    }
    return 0;
}

/* One pair of vocab groups (32 rows of the head) against 16 rows of x: the four sums, then each
 * row's approximations, upper bounds into hi and lower bounds into lo. */
static void screen_pair(const int8_t *wq, const float *wv, int64_t pair, int64_t KT, int64_t KP,
                        const int8_t *xh, const int8_t *xl, const screen_row *info, int64_t r0,
                        int nr, int64_t V, float coef, float *hi, int64_t ldh, float *lo,
                        int32_t *c) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const int8_t *w0 = wq + (2 * pair) * KT * 1024, *w1 = w0 + KT * 1024;
    for (int64_t t = 0; t < KT; ++t) {
        _tile_loadd(4, xh + r0 * KP + 64 * t, KP);
        _tile_loadd(5, xl + r0 * KP + 64 * t, KP);
        _tile_loadd(6, w0 + t * 1024, 64);
        _tile_loadd(7, w1 + t * 1024, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 5, 6);
        _tile_dpbssd(2, 4, 7);
        _tile_dpbssd(3, 5, 7);
    }
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
    const __m512 margin = _mm512_set1_ps(SCREEN_MARGIN), inv_xl = _mm512_set1_ps(1.0f / XL_SCALE);
    for (int g = 0; g < 2; ++g) {
        const int64_t v0 = (2 * pair + g) * 16;
        const int valid = V - v0 >= 16 ? 16 : V - v0 > 0 ? (int)(V - v0) : 0; /* not the pad */
        const __m512 s = _mm512_loadu_ps(wv + v0), a = _mm512_loadu_ps(wv + ldh + v0);
        const __m512 ew = _mm512_loadu_ps(wv + 2 * ldh + v0);
        const __m512 nw = _mm512_loadu_ps(wv + 3 * ldh + v0);
        for (int r = 0; r < nr; ++r) {
            const screen_row in = info[r0 + r];
            const __m512 sh = _mm512_cvtepi32_ps(_mm512_loadu_si512(c + g * 512 + r * 16));
            const __m512 sl = _mm512_cvtepi32_ps(_mm512_loadu_si512(c + g * 512 + 256 + r * 16));
            const __m512 approx = _mm512_mul_ps(_mm512_fmadd_ps(sl, inv_xl, sh),
                                                _mm512_mul_ps(s, _mm512_set1_ps(in.dx)));
            __m512 bound = _mm512_mul_ps(a, _mm512_set1_ps(in.tx));
            bound = _mm512_fmadd_ps(ew, _mm512_set1_ps(in.l1), bound);
            bound = _mm512_fmadd_ps(nw, _mm512_set1_ps(coef * in.n2), bound);
            bound = _mm512_mul_ps(bound, margin);
            _mm512_storeu_ps(hi + (r0 + r) * ldh + v0, _mm512_add_ps(approx, bound));
            if (valid) {
                const float m = _mm512_mask_reduce_max_ps((__mmask16)((1u << valid) - 1u),
                                                          _mm512_sub_ps(approx, bound));
                lo[r0 + r] = m > lo[r0 + r] ? m : lo[r0 + r];
            }
        }
    }
}

/* Every row's upper bounds into hi [rows, VG * 16] and greatest lower bound into lo_max [rows]:
 * 0; -1 for a value of x not finite; -3 without memory. */
int amx_screen(const int8_t *wq, const float *wv, int64_t V, int64_t K, const float *x,
               int64_t rows, float *hi, float *lo_max, int num_threads) {
    const int64_t VG = (V + 31) / 32 * 2, ldh = VG * 16, KT = (K + 63) / 64, KP = KT * 64;
    const int64_t padded = (rows + 15) / 16 * 16;
    int nt = num_threads > 0 ? num_threads : 1;
#ifndef _OPENMP
    nt = 1;
#endif
    int8_t *xh = calloc((size_t)(2 * padded * KP), 1);
    screen_row *info = calloc((size_t)padded, sizeof(screen_row));
    float *lo = malloc(sizeof(float) * (size_t)(padded * nt));
    int status = xh && info && lo ? 0 : -3;
    if (status == 0) status = screen_pieces(x, rows, K, KP, xh, xh + padded * KP, info);
    if (status == 0) {
        const float u = FLT_EPSILON / 2, coef = (float)(2 * KP + 16) * u;
        for (int64_t i = 0; i < padded * nt; ++i) lo[i] = -FLT_MAX;
#pragma omp parallel num_threads(nt)
        {
#ifdef _OPENMP
            const int me = omp_get_thread_num();
#else
            const int me = 0;
#endif
            int32_t c[4 * 256] __attribute__((aligned(64)));
            configure_tiles();
#pragma omp for schedule(static)
            for (int64_t pair = 0; pair < VG / 2; ++pair)
                for (int64_t r0 = 0; r0 < rows; r0 += 16) {
                    const int nr = rows - r0 < 16 ? (int)(rows - r0) : 16;
                    screen_pair(wq, wv, pair, KT, KP, xh, xh + padded * KP, info, r0, nr, V, coef,
                                hi, ldh, lo + me * padded, c);
                }
            _tile_release();
        }
        for (int64_t r = 0; r < rows; ++r) {
            float m = -FLT_MAX;
            for (int k = 0; k < nt; ++k) m = lo[k * padded + r] > m ? lo[k * padded + r] : m;
            lo_max[r] = m;
        }
    }
    free(xh);
    free(info);
    free(lo);
    return status;
}
#else
int amx_ready(void) { return 0; }

double amx_tile_flops(int64_t iters, int threads) {
    (void)iters, (void)threads;
    return 0.0;
}

int amx_gemm_q4_1(const uint8_t *nib, const float *dv, const float *mv, int64_t out_features,
                  int64_t in_features, const float *x, int64_t x_stride, int64_t rows, float *y,
                  int64_t y_stride, int num_threads) {
    (void)nib, (void)dv, (void)mv, (void)out_features, (void)in_features, (void)x;
    (void)x_stride, (void)rows, (void)y, (void)y_stride, (void)num_threads;
    return -3;
}

int amx_screen(const int8_t *wq, const float *wv, int64_t V, int64_t K, const float *x,
               int64_t rows, float *hi, float *lo_max, int num_threads) {
    (void)wq, (void)wv, (void)V, (void)K, (void)x, (void)rows, (void)hi, (void)lo_max;
    (void)num_threads;
    return -3;
}
#endif
