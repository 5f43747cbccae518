/* The greedy rows' tokens through a Q8_0 LM head, screened in int8 (cpu_greedy_head.py).
 *
 * A greedy row needs only the argmax of its fp32 logits x W^T. The head's weights are int8
 * already (Q8_0: w = d * q, q in [-127, 127], d fp16 per block of 32), so with each block of 32
 * of x rounded to int8 too (its own step dx = max |x| / 127), `vpdpbusd` sums 64 products an
 * instruction where fp32 FMAs sum 16. Each logit's approximation errs by at most
 *   e[v] = sum over blocks b of  (dx_b / 2) * d_vb * sum_i |q_vbi|      (A[v, b] = d_vb sum|q|)
 * and the fp32 GEMV's own rounding adds less than 1 % of it (< 576 u * sum |x w| <= 576 u *
 * 254 e). With the bound widened by BOUND_MARGIN, no token whose upper bound (approximation + e)
 * is below the row's highest lower bound can hold the argmax; screen_rows lists the others,
 * whose exact fp32 logits the caller recomputes with the same GEMV to decide.
 *
 * Layouts (fp32 unless named):
 *   blocks  [V, nb * 34] uint8     GGUF Q8_0: fp16 d, then 32 int8 codes, a block
 *   wpack   [VG, nb, 8, 16, 4] u8  q + 128 of vocab rows 16 g .. 16 g + 15, four codes a lane
 *   dpack   [VG, nb, 16]           d of each lane's block;  apack [VG, nb, 16]: A
 *   x       [rows, nb * 32]        the final norm's output
 *   hi      [rows, VG * 16]        scratch: each token's upper bound
 *   cand    [rows, max_cand] int32 each row's candidate tokens, ascending; count in ncand
 * VG = ceil(V / 16); lanes past V are zero weights and are never listed.
 *
 * Levels: AVX-512 VNNI (with the GEMV's AVX-512 level: F, BW, VL, FMA, F16C) or plain C, from the
 * flags cpu_greedy_head.py compiles it with (the CPU's features at run time); kernel_isa() says
 * which (2 or 0). */
#define _POSIX_C_SOURCE 200809L
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include "cpu_int8_scale.h"
#include "cpu_quant_blocks.h" /* ISA_LEVEL, kernel_isa(), QK, Q8_0_BYTES, half_to_float */
#ifdef _OPENMP
#include <omp.h>
#endif
#if ISA_LEVEL == 2 && defined(__AVX512VNNI__)
#define SCREEN_VNNI 1
#else
#define SCREEN_VNNI 0
#endif

#define LANES 16
#define ROWS_A_PASS 4   /* rows through a vocab group at once: 4 sums and 4 bounds in registers */
#define BOUND_MARGIN 1.0625f /* the fp32 roundings of both sides are < 1 % of the bound */

/* blocks -> the screen's layout; 0, or -1 when a block's scale is not finite */
int screen_pack_q8_0(const uint8_t *blocks, int64_t V, int64_t nb, uint8_t *wpack, float *dpack,
                     float *apack) {
    const int64_t VG = (V + LANES - 1) / LANES;
    memset(wpack, 128, (size_t)(VG * nb * QK * LANES)); /* zero weights in the pad lanes */
    memset(dpack, 0, sizeof(float) * (size_t)(VG * nb * LANES));
    memset(apack, 0, sizeof(float) * (size_t)(VG * nb * LANES));
    for (int64_t v = 0; v < V; ++v) {
        const int64_t g = v / LANES, lane = v % LANES;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = blocks + (v * nb + b) * Q8_0_BYTES;
            uint16_t h;
            memcpy(&h, blk, 2);
            if ((h & 0x7c00u) == 0x7c00u) return -1; /* inf or NaN, on the bits (-ffast-math) */
            const float d = half_to_float(blk);
            const int8_t *q = (const int8_t *)(blk + 2);
            float s = 0.0f;
            for (int i = 0; i < QK; ++i) {
                s += (float)abs(q[i]);
                wpack[(((g * nb + b) * 8 + i / 4) * LANES + lane) * 4 + i % 4] =
                    (uint8_t)(q[i] + 128);
            }
            dpack[(g * nb + b) * LANES + lane] = d;
            apack[(g * nb + b) * LANES + lane] = fabsf(d) * s;
        }
    }
    return 0;
}

/* A row's blocks to int8: xq, its step dx, hx the most a value moved (half the step; the block's
 * max |x| where that is too small to divide by, and the block is left out) and 128 * sum(xq)
 * (what q + 128 adds back); 0, or -1 for a value that is not finite */
static int quantize_row(const float *x, int64_t nb, int8_t *xq, float *dx, float *hx,
                        int32_t *sx128) {
    for (int64_t b = 0; b < nb; ++b) {
        const float *xb = x + b * QK;
        float amax, d, inv;
        if (int8_scale(xb, QK, &amax, &d, &inv)) return -1;
        const int tiny = d == 0.0f;
        int32_t s = 0;
        for (int i = 0; i < QK; ++i) {
            float r = nearbyintf(xb[i] * inv);
            r = r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r;
            xq[b * QK + i] = (int8_t)r;
            s += (int32_t)r;
        }
        dx[b] = d;
        hx[b] = tiny ? amax : 0.5f * d;
        sx128[b] = 128 * s;
    }
    return 0;
}

/* the sums and bounds of ROWS_A_PASS rows (r0.., the last pass's beyond nr zeros) over vocab
 * group g: hi = approx + bound, and the rows' greatest lower bound so far in lo_max */
static void screen_group(int64_t g, int64_t r0, int nr, int64_t V, int64_t nb,
                         const uint8_t *wpack, const float *dpack, const float *apack,
                         const int8_t *xq, const float *dx, const float *hx,
                         const int32_t *sx128, float *hi, int64_t ldh, float *lo_max) {
    const int valid = V - g * LANES < LANES ? (int)(V - g * LANES) : LANES; /* not the pad */
#if SCREEN_VNNI
    __m512 o[ROWS_A_PASS], e[ROWS_A_PASS];
    for (int r = 0; r < ROWS_A_PASS; ++r) o[r] = e[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *wb = wpack + (g * nb + b) * QK * LANES;
        __m512i w[8];
        for (int k = 0; k < 8; ++k) w[k] = _mm512_loadu_si512(wb + 64 * k);
        const __m512 d = _mm512_loadu_ps(dpack + (g * nb + b) * LANES);
        const __m512 a = _mm512_loadu_ps(apack + (g * nb + b) * LANES);
#pragma GCC unroll 4
        for (int r = 0; r < ROWS_A_PASS; ++r) {
            const int64_t rb = (r0 + r) * nb + b;
            const float *x4 = (const float *)(xq + rb * QK); /* four codes as one 32-bit lane */
            __m512i acc = _mm512_set1_epi32(-sx128[rb]);
            for (int k = 0; k < 8; ++k)
                acc = _mm512_dpbusd_epi32(acc, w[k], _mm512_castps_si512(_mm512_set1_ps(x4[k])));
            o[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(d, _mm512_set1_ps(dx[rb])),
                                   o[r]);
            e[r] = _mm512_fmadd_ps(a, _mm512_set1_ps(hx[rb]), e[r]);
        }
    }
    const __m512 margin = _mm512_set1_ps(BOUND_MARGIN);
    for (int r = 0; r < nr; ++r) {
        const __m512 bound = _mm512_mul_ps(e[r], margin);
        _mm512_storeu_ps(hi + (r0 + r) * ldh + g * LANES, _mm512_add_ps(o[r], bound));
        const float m = _mm512_mask_reduce_max_ps((__mmask16)((1u << valid) - 1u),
                                                  _mm512_sub_ps(o[r], bound));
        lo_max[r0 + r] = m > lo_max[r0 + r] ? m : lo_max[r0 + r];
    }
#else
    for (int r = 0; r < nr; ++r)
        for (int lane = 0; lane < LANES; ++lane) {
            float o = 0.0f, e = 0.0f;
            for (int64_t b = 0; b < nb; ++b) {
                const int64_t rb = (r0 + r) * nb + b;
                const uint8_t *wb = wpack + (g * nb + b) * QK * LANES;
                int32_t acc = -sx128[rb];
                for (int i = 0; i < QK; ++i)
                    acc += (int32_t)wb[((i / 4) * LANES + lane) * 4 + i % 4] * xq[rb * QK + i];
                o += (float)acc * (dpack[(g * nb + b) * LANES + lane] * dx[rb]);
                e += apack[(g * nb + b) * LANES + lane] * hx[rb];
            }
            const float bound = e * BOUND_MARGIN;
            hi[(r0 + r) * ldh + g * LANES + lane] = o + bound;
            if (lane < valid && o - bound > lo_max[r0 + r]) lo_max[r0 + r] = o - bound;
        }
#endif
}

/* Each row's tokens whose upper bound reaches its greatest lower bound, ascending, into cand /
 * ncand: 0, or -2 when a row has more than max_cand (ncand still counts them). Also for the
 * bounds the AMX screen makes (cpu_amx_gemm.c amx_screen). */
int list_candidates(const float *hi, int64_t rows, int64_t V, int64_t ldh, const float *lo_max,
                    int32_t *cand, int32_t *ncand, int32_t max_cand, int32_t num_threads) {
    int nt = num_threads > 0 ? num_threads : 1;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < rows; ++r) {
        const float m = lo_max[r], *h = hi + r * ldh;
        int32_t n = 0, *c = cand + r * max_cand;
        int64_t v = 0;
#if ISA_LEVEL == 2
        /* 16 bounds a compare: candidates are few, so most masks are empty */
        const __m512 mv = _mm512_set1_ps(m);
        for (; v + LANES <= V; v += LANES) {
            uint32_t mask = _mm512_cmp_ps_mask(_mm512_loadu_ps(h + v), mv, _CMP_GE_OQ);
            while (mask) {
                const int lane = __builtin_ctz(mask);
                mask &= mask - 1;
                if (n < max_cand) c[n] = (int32_t)(v + lane);
                ++n;
            }
        }
#endif
        for (; v < V; ++v)
            if (h[v] >= m) {
                if (n < max_cand) c[n] = (int32_t)v;
                ++n;
            }
        ncand[r] = n;
    }
    for (int64_t r = 0; r < rows; ++r)
        if (ncand[r] > max_cand) return -2;
    return 0;
}

/* Each row's tokens that may hold its argmax, ascending, into cand / ncand. Returns 0; -1 when
 * x holds a value that is not finite, -2 when a row has more than max_cand (ncand still counts
 * them), -3 without memory. The caller then computes the whole head. */
int screen_rows(const float *x, int64_t rows, int64_t V, int64_t nb, const uint8_t *wpack,
                const float *dpack, const float *apack, float *hi, int32_t *cand, int32_t *ncand,
                int32_t max_cand, int32_t num_threads) {
    const int64_t VG = (V + LANES - 1) / LANES, ldh = VG * LANES;
    const int64_t padded = (rows + ROWS_A_PASS - 1) / ROWS_A_PASS * ROWS_A_PASS; /* zero rows */
    int8_t *xq = calloc((size_t)(padded * nb * QK), 1);
    float *dx = calloc((size_t)(padded * nb), sizeof(float));
    float *hx = calloc((size_t)(padded * nb), sizeof(float));
    int32_t *sx128 = calloc((size_t)(padded * nb), sizeof(int32_t));
    int nt = num_threads > 0 ? num_threads : 1;
    float *lo_max = malloc(sizeof(float) * (size_t)(rows * nt));
    int status = 0;
    if (!xq || !dx || !hx || !sx128 || !lo_max) status = -3;
    for (int64_t r = 0; r < rows && status == 0; ++r)
        if (quantize_row(x + r * nb * QK, nb, xq + r * nb * QK, dx + r * nb, hx + r * nb,
                         sx128 + r * nb))
            status = -1;
    if (status == 0) {
        for (int64_t i = 0; i < rows * nt; ++i) lo_max[i] = -FLT_MAX;
#pragma omp parallel num_threads(nt)
        {
#ifdef _OPENMP
            const int me = omp_get_thread_num();
#else
            const int me = 0;
#endif
            float *mine = lo_max + (int64_t)me * rows;
#pragma omp for schedule(static)
            for (int64_t g = 0; g < VG; ++g)
                for (int64_t r0 = 0; r0 < rows; r0 += ROWS_A_PASS) {
                    const int nr = rows - r0 < ROWS_A_PASS ? (int)(rows - r0) : ROWS_A_PASS;
                    screen_group(g, r0, nr, V, nb, wpack, dpack, apack, xq, dx, hx, sx128, hi, ldh,
                                 mine);
                }
        }
        for (int64_t r = 0; r < rows; ++r)
            for (int k = 1; k < nt; ++k)
                lo_max[r] = lo_max[k * rows + r] > lo_max[r] ? lo_max[k * rows + r] : lo_max[r];
        status = list_candidates(hi, rows, V, ldh, lo_max, cand, ncand, max_cand, nt);
    }
    free(xq);
    free(dx);
    free(hx);
    free(sx128);
    free(lo_max);
    return status;
}
