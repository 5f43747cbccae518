/* Each row's argmax over fp32 logits [rows, n] (row stride `ld`), as torch.argmax defines it:
 * the first index of the row's greatest value; a NaN counts as greater than every number, so a
 * row with one gives its first NaN. torch's CPU argmax compares an element at a time, ~35 us a
 * 49,152-wide row here, more than the whole greedy step besides; this reads a row twice at vector
 * width (its max, then the first index holding it): ~3 us. NaN is found on the bits (an exponent
 * of all ones and a nonzero mantissa), which -ffast-math cannot assume away. */
#include "cpu_quant_blocks.h" /* the ISA level and kernel_isa() */

static int64_t first_nan(const float *x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) return i;
    }
    return -1;
}

static int64_t row_argmax(const float *x, int64_t n) {
    int64_t i = 0;
    float m = x[0];
#if ISA_LEVEL == 2
    if (n >= 64) {
        const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
        __m512 mx[4] = {_mm512_loadu_ps(x), _mm512_loadu_ps(x + 16), _mm512_loadu_ps(x + 32),
                        _mm512_loadu_ps(x + 48)};
        __mmask16 nan = 0;
        for (; i + 64 <= n; i += 64)
            for (int j = 0; j < 4; ++j) {
                const __m512 v = _mm512_loadu_ps(x + i + 16 * j);
                nan |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), abs_mask),
                                               inf);
                mx[j] = _mm512_max_ps(mx[j], v);
            }
        if (nan) return first_nan(x, n);
        m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(mx[0], mx[1]),
                                               _mm512_max_ps(mx[2], mx[3])));
    }
#endif
    for (; i < n; ++i) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) return first_nan(x, n);
        if (x[i] > m) m = x[i];
    }
    i = 0;
#if ISA_LEVEL == 2
    const __m512 mv = _mm512_set1_ps(m);
    for (; i + 16 <= n; i += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), mv, _CMP_EQ_OQ);
        if (hit) return i + __builtin_ctz(hit);
    }
#endif
    for (; i < n; ++i)
        if (x[i] == m) return i;
    return 0; /* not reached: m is one of the row's values */
}

void argmax_rows(const float *x, int64_t rows, int64_t n, int64_t ld, int64_t *out,
                 int32_t num_threads) {
    (void)num_threads;
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; ++r) out[r] = row_argmax(x + r * ld, n);
}
