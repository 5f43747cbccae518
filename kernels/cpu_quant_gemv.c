/* fp32 GEMV over GGUF-quantized weights, read in their block layout: y = x W^T for a few rows of
 * x (the decode rows of a step), W [out, in] held as Q4_1 or Q8_0 blocks (cpu_quant_blocks.h:
 * Q8_0 as GGUF stores it, Q4_1 with its fp16 scales widened to fp32 at load).
 *
 * Every weight is rebuilt in registers to exactly the fp32 value the `gguf` package dequantizes
 * it to: Q4_1 w = d * q + m (d, m per block of 32, fp16 values; q in 0..15; d * q is exact in
 * fp32, so fma(d, q, m) is the same single rounding as numpy's d * q + m), Q8_0 w = d * q (fp16
 * d, int8 q, exact). Activations and accumulation are fp32, so the result equals an fp32 matmul
 * with the dequantized weights up to summation order, while reading 0.75 (Q4_1) or 1.0625 (Q8_0)
 * bytes per weight instead of 4.
 *
 * Three instruction-set levels, chosen by the flags it is compiled with (kernels/cpu_quant_gemv.py
 * picks them from the CPU it runs on) and reported by kernel_isa():
 *   2  AVX-512: 16 weights a vector (nibbles widened with vpmovzxbd, one vfmadd to dequantize)
 *   1  AVX2 + FMA + F16C: the same, 8 weights a vector
 *   0  plain C: loops the compiler vectorizes for whatever the target has
 *
 * Layouts (row-major, strides in elements):
 *   w  [out, in / 32 * block_bytes] uint8   one row of blocks per output feature
 *   x  [rows, in] fp32, row stride x_stride; rows >= 1
 *   y  [rows, out] fp32, row stride y_stride
 * The loops are in cpu_quant_dot.h (shared with the fused decode forward, cpu_decode.c): output
 * features are shared by the OpenMP threads, each y value is one thread's sum, and a row's sums
 * are computed the same way whatever rows share the call, so the batch-invariant mode runs every
 * step, prefill included, through this kernel (engine/gguf_linear.py).
 */
#include "cpu_quant_blocks.h"
#include "cpu_quant_dot.h"

/* y = x W^T for blocks of kind q8 (1: Q8_0, 0: Q4_1), by the threads of a running OpenMP
 * region: tiles in static runs, up to ROWS_MAX rows at once through each tile (tile_sums_rows). */
static inline void gemv_tiles(int q8, const uint8_t *w, int64_t out_features, int64_t in_features,
                              const float *x, int64_t x_stride, int rows, float *y,
                              int64_t y_stride) {
    const int64_t num_tiles = num_tiles_of(out_features);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tiles; ++t) {
        float tile[ROWS_MAX][TILE];
        for (int g0 = 0; g0 < rows; g0 += ROWS_MAX) {
            const int group = rows - g0 < ROWS_MAX ? rows - g0 : ROWS_MAX;
            const float *xg = x + (int64_t)g0 * x_stride;
            const int n = q8 ? tile_sums_rows(1, w, out_features, in_features, xg, x_stride, group, t, tile)
                             : tile_sums_rows(0, w, out_features, in_features, xg, x_stride, group, t, tile);
            tile_store(0, out_features, tile, group, n, y + (int64_t)g0 * y_stride, y_stride, t);
        }
    }
}

static inline void gemv(const int q8, const uint8_t *w, int64_t out_features,
                        int64_t in_features, const float *x, int64_t x_stride, int rows, float *y,
                        int64_t y_stride, int num_threads) {
    (void)num_threads;
#pragma omp parallel num_threads(num_threads) if (out_features >= 64)
    gemv_tiles(q8, w, out_features, in_features, x, x_stride, rows, y, y_stride);
}

/* 0 on success, -1 for a shape the kernel does not take (in not a multiple of 32, no rows); the
 * wrapper checks these first. */
int gemv_q4_1(const uint8_t *w, int64_t out_features, int64_t in_features, const float *x,
              int64_t x_stride, int rows, float *y, int64_t y_stride, int num_threads) {
    if (in_features % QK || rows < 1) return -1;
    gemv(0, w, out_features, in_features, x, x_stride, rows, y, y_stride, num_threads);
    return 0;
}

int gemv_q8_0(const uint8_t *w, int64_t out_features, int64_t in_features, const float *x,
              int64_t x_stride, int rows, float *y, int64_t y_stride, int num_threads) {
    if (in_features % QK || rows < 1) return -1;
    gemv(1, w, out_features, in_features, x, x_stride, rows, y, y_stride, num_threads);
    return 0;
}
