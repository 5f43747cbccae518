/* What the quantized kernels share (cpu_quant_gemv.c, cpu_quant_gemm.c): the instruction-set
 * level they are compiled for, the GGUF block layouts and the exact fp16 -> fp32 conversion. */
#ifndef BRIGADE_CPU_QUANT_BLOCKS_H
#define BRIGADE_CPU_QUANT_BLOCKS_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__) && defined(__FMA__)
#define ISA_LEVEL 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ISA_LEVEL 1
#else
#define ISA_LEVEL 0
#endif
#if ISA_LEVEL > 0
#include <immintrin.h>
#endif

#define QK 32 /* weights per block */
#define Q4_1_BYTES 20 /* fp16 d, fp16 m, 16 bytes of nibbles: q[i] low, q[i + 16] high */
#define Q8_0_BYTES 34 /* fp16 d, 32 int8 */

int kernel_isa(void) { return ISA_LEVEL; }

static inline float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if ISA_LEVEL > 0
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu;
    const uint32_t man = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exp == 0) { /* zero or subnormal: man * 2^-24, exact in fp32 */
        v.f = (float)man * 5.9604644775390625e-8f;
        v.u |= sign;
    } else if (exp == 0x1f) {
        v.u = sign | 0x7f800000u | (man << 13);
    } else {
        v.u = sign | ((exp + 112u) << 23) | (man << 13);
    }
    return v.f;
#endif
}

#if ISA_LEVEL == 1
/* One block's 32 weights -> 4 vectors of 8, each widened straight from memory (vpmovzxbd /
 * vpmovsxbd with a load: no shuffles to split the 16 bytes first); Q8_0 d * q,
 * Q4_1 fma(d, q, m), q[i] the low nibble of byte i and q[i + 16] its high nibble. */
static inline __attribute__((always_inline)) void rebuild_block8(const int Q8, const uint8_t *blk,
                                                                 __m256 wv[4]) {
    const __m256 d = _mm256_set1_ps(half_to_float(blk));
    if (Q8) {
        for (int k = 0; k < 4; ++k)
            wv[k] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                         _mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * k)))));
    } else {
        const __m256 m = _mm256_set1_ps(half_to_float(blk + 2));
        const __m256i low4 = _mm256_set1_epi32(0x0f);
        const __m256i e0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 4)));
        const __m256i e1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 12)));
        const __m256i q[4] = {_mm256_and_si256(e0, low4), _mm256_and_si256(e1, low4),
                              _mm256_srli_epi32(e0, 4), _mm256_srli_epi32(e1, 4)};
        for (int k = 0; k < 4; ++k) wv[k] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q[k]), m);
    }
}
#endif

#endif
