/* fp32 GEMM over GGUF-quantized weights, read in their block layout: y = x W^T for many rows
 * of x (batched decode, prefill chunks), W [out, in] held as Q4_1 or Q8_0 blocks
 * (cpu_quant_blocks.h: Q8_0 as GGUF stores it, Q4_1 with its scales widened to fp32).
 *
 * A panel of NR output features is dequantized once into an fp32 scratch [NR][in] (each weight
 * exactly the value the `gguf` package gives it: Q4_1 fma(d, q, m), Q8_0 d * q, as in
 * cpu_quant_gemv.c), then reused by every row of x. x is packed transposed in chunks of CH rows,
 * [chunk][in][CH], so the inner step is an outer product: for each input k, the CH values of
 * column k (MV vectors) times each of the NR weights (a broadcast), NR * MV vector FMAs into
 * registers. Rows are blocked into super-blocks whose packed x fits in L2; each super-block
 * dequantizes its panels again (cheap against the FMAs of its rows).
 *
 * Every y value is one fp32 chain of FMAs over k = 0 .. in - 1 in order, computed by one thread,
 * so a row's result does not depend on the number of rows, on where it sits among them, or on the
 * thread count. It equals an fp32 matmul with the dequantized weights up to summation order.
 *
 * Three instruction-set levels, chosen by the flags it is compiled with (kernels/cpu_quant_gemm.py
 * picks them from the CPU it runs on) and reported by kernel_isa():
 *   2  AVX-512: 16 rows a vector, panels of 8 features, up to 3 vectors (48 rows) a step
 *   1  AVX2 + FMA + F16C: 8 rows a vector, panels of 6, up to 2 vectors (16 rows)
 *   0  plain C: loops over 16 rows that the compiler vectorizes for whatever the target has
 *
 * Layouts (row-major, strides in elements):
 *   w  [out, in / 32 * block_bytes] uint8   one row of blocks per output feature
 *   x  [rows, in] fp32, row stride x_stride; rows >= 1
 *   y  [rows, out] fp32, row stride y_stride
 */
#include <stdlib.h>
#include "cpu_quant_blocks.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#if ISA_LEVEL == 2
#define VL 16
#define NR 8
#define MVMAX 3
typedef __m512 vec;
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_load_ps(p)
#define vstore(p, v) _mm512_store_ps(p, v)
#define vset1(s) _mm512_set1_ps(s)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#elif ISA_LEVEL == 1
#define VL 8
#define NR 6
#define MVMAX 2
typedef __m256 vec;
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_load_ps(p)
#define vstore(p, v) _mm256_store_ps(p, v)
#define vset1(s) _mm256_set1_ps(s)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
#else
#define VL 16
#define NR 4
#define MVMAX 1
#endif
#define CH (VL * MVMAX) /* rows of x in one packed chunk */
#define SUPER_BYTES (256 * 1024) /* packed x of one row super-block: about L2 */

/* One output feature's row of nb blocks -> its nb * 32 fp32 weights. */
static inline void dequantize_row(const int Q8, const uint8_t *w, int nb, float *out) {
    const int block_bytes = Q8 ? Q8_0_BYTES : Q4_1_BYTES;
    for (int b = 0; b < nb; ++b) {
        const uint8_t *blk = w + (int64_t)b * block_bytes;
        float *o = out + (int64_t)b * QK;
#if ISA_LEVEL == 2
        __m512 wv[2];
        rebuild_block16(Q8, 0, blk, wv);
        _mm512_storeu_ps(o, wv[0]);
        _mm512_storeu_ps(o + 16, wv[1]);
#elif ISA_LEVEL == 1
        __m256 wv[4];
        rebuild_block8(Q8, blk, wv);
        for (int k = 0; k < 4; ++k) _mm256_storeu_ps(o + 8 * k, wv[k]);
#else
        if (Q8) {
            const float d = half_to_float(blk);
            for (int i = 0; i < QK; ++i) o[i] = d * (float)(int8_t)blk[2 + i];
        } else {
            const float d = load_f32(blk), m = load_f32(blk + 4);
            const uint8_t *qs = blk + Q4_1_CODES;
            for (int i = 0; i < QK / 2; ++i) {
                o[i] = d * (float)(qs[i] & 0x0f) + m; /* d * q is exact: one rounding */
                o[i + QK / 2] = d * (float)(qs[i] >> 4) + m;
            }
        }
#endif
    }
}

/* rows r0 .. r0 + n - 1 of x -> the packed chunk [in][CH], rows past n zero. */
static void pack_chunk(const float *x, int64_t x_stride, int64_t r0, int n, int64_t in,
                       float *xp) {
    for (int64_t k = 0; k < in; ++k) {
        float *dst = xp + k * CH;
        for (int r = 0; r < n; ++r) dst[r] = x[(r0 + r) * x_stride + k];
        for (int r = n; r < CH; ++r) dst[r] = 0.0f;
    }
}

/* The NR features of panel `wp` [NR][in] against one packed chunk `xp` [in][CH] -> tile [NR][CH].
 * Inlined with a constant MV (vectors of rows), so the accumulators live in registers. */
static inline __attribute__((always_inline)) void micro(const int MV, const float *wp,
                                                       int64_t in, const float *xp, float *tile) {
#if ISA_LEVEL > 0
    vec acc[NR][MVMAX];
    for (int j = 0; j < NR; ++j)
        for (int v = 0; v < MV; ++v) acc[j][v] = vzero();
    for (int64_t k = 0; k < in; ++k) {
        vec xv[MVMAX];
        for (int v = 0; v < MV; ++v) xv[v] = vload(xp + k * CH + v * VL);
#pragma GCC unroll 8
        for (int j = 0; j < NR; ++j) {
            const vec wb = vset1(wp[j * in + k]);
            for (int v = 0; v < MV; ++v) acc[j][v] = vfma(wb, xv[v], acc[j][v]);
        }
    }
    for (int j = 0; j < NR; ++j)
        for (int v = 0; v < MV; ++v) vstore(tile + j * CH + v * VL, acc[j][v]);
#else
    (void)MV;
    float acc[NR][CH];
    for (int j = 0; j < NR; ++j)
        for (int r = 0; r < CH; ++r) acc[j][r] = 0.0f;
    for (int64_t k = 0; k < in; ++k) {
        const float *xk = xp + k * CH;
        for (int j = 0; j < NR; ++j) {
            const float wv = wp[j * in + k];
            for (int r = 0; r < CH; ++r) acc[j][r] += wv * xk[r];
        }
    }
    for (int j = 0; j < NR; ++j) memcpy(tile + j * CH, acc[j], sizeof(acc[j]));
#endif
}

static inline __attribute__((always_inline)) int gemm(
    const int Q8, const uint8_t *w, int64_t out_features, int64_t in_features, const float *x,
    int64_t x_stride, int64_t rows, float *y, int64_t y_stride, int num_threads) {
    const int nb = (int)(in_features / QK);
    const int64_t row_bytes = (int64_t)nb * (Q8 ? Q8_0_BYTES : Q4_1_BYTES);
    const int64_t num_chunks = (rows + CH - 1) / CH;
    const int64_t num_panels = (out_features + NR - 1) / NR;
    int64_t chunks_per_super = SUPER_BYTES / (in_features * CH * (int64_t)sizeof(float));
    if (chunks_per_super < 1) chunks_per_super = 1;
    if (num_threads < 1) num_threads = 1;
#ifndef _OPENMP
    num_threads = 1;
#endif
    /* one allocation: packed x [chunk][in][CH], then each thread's panel [NR][in] */
    const int64_t xp_floats = num_chunks * CH * in_features, wp_floats = NR * in_features;
    const size_t bytes = (size_t)(xp_floats + num_threads * wp_floats) * sizeof(float);
    float *xp = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (xp == NULL) return -2;
#pragma omp parallel num_threads(num_threads) if (out_features * rows >= 4096)
    {
#pragma omp for schedule(static)
        for (int64_t c = 0; c < num_chunks; ++c) {
            const int64_t r0 = c * CH;
            const int n = rows - r0 < CH ? (int)(rows - r0) : CH;
            pack_chunk(x, x_stride, r0, n, in_features, xp + c * in_features * CH);
        }
#ifdef _OPENMP
        float *wp = xp + xp_floats + omp_get_thread_num() * wp_floats;
#else
        float *wp = xp + xp_floats;
#endif
        float tile[NR * CH] __attribute__((aligned(64)));
        for (int64_t c0 = 0; c0 < num_chunks; c0 += chunks_per_super) {
            const int64_t c1 = c0 + chunks_per_super < num_chunks ? c0 + chunks_per_super
                                                                  : num_chunks;
            /* the same panels for each thread in every super-block, so no barrier is needed */
#pragma omp for schedule(static) nowait
            for (int64_t p = 0; p < num_panels; ++p) {
                const int64_t o0 = p * NR;
                const int nr = out_features - o0 < NR ? (int)(out_features - o0) : NR;
                for (int j = 0; j < nr; ++j)
                    dequantize_row(Q8, w + (o0 + j) * row_bytes, nb, wp + j * in_features);
                if (nr < NR) memset(wp + nr * in_features, 0, (NR - nr) * in_features * 4);
                for (int64_t c = c0; c < c1; ++c) {
                    const int64_t r0 = c * CH;
                    const int n = rows - r0 < CH ? (int)(rows - r0) : CH;
                    const float *xc = xp + c * in_features * CH;
                    switch ((n + VL - 1) / VL) {
                    case 1: micro(1, wp, in_features, xc, tile); break;
#if MVMAX >= 2
                    case 2: micro(2, wp, in_features, xc, tile); break;
#endif
#if MVMAX >= 3
                    case 3: micro(3, wp, in_features, xc, tile); break;
#endif
                    }
                    for (int r = 0; r < n; ++r) {
                        float *yr = y + (r0 + r) * y_stride + o0;
                        for (int j = 0; j < nr; ++j) yr[j] = tile[j * CH + r];
                    }
                }
            }
        }
    }
    free(xp);
    return 0;
}

/* 0 on success; -1 for a shape the kernel does not take (in not a multiple of 32, no rows),
 * which the wrapper checks first; -2 when the scratch for packed x cannot be allocated. */
int gemm_q4_1(const uint8_t *w, int64_t out_features, int64_t in_features, const float *x,
              int64_t x_stride, int64_t rows, float *y, int64_t y_stride, int num_threads) {
    if (in_features % QK || in_features < QK || rows < 1) return -1;
    return gemm(0, w, out_features, in_features, x, x_stride, rows, y, y_stride, num_threads);
}

int gemm_q8_0(const uint8_t *w, int64_t out_features, int64_t in_features, const float *x,
              int64_t x_stride, int64_t rows, float *y, int64_t y_stride, int num_threads) {
    if (in_features % QK || in_features < QK || rows < 1) return -1;
    return gemm(1, w, out_features, in_features, x, x_stride, rows, y, y_stride, num_threads);
}
