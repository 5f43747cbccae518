/* What the quantized kernels share (cpu_quant_gemv.c, cpu_quant_gemm.c, cpu_decode.c): the
 * instruction-set level they are compiled for, the block layouts as Brigade holds them and the
 * exact fp16 -> fp32 conversion. */
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
/* Q4_1 as held: fp32 d, fp32 m, then GGUF's 16 bytes of nibbles (q[i] low, q[i + 16] high). GGUF
 * stores d and m as fp16 in 20 bytes; they are widened once at load (kernels/cpu_quant_gemv.py
 * from_gguf), to exactly the values the fp16 -> fp32 conversion gives, so every weight is the same
 * fp32 value. A block then costs two broadcast loads where it cost two fp16 conversions and
 * broadcasts on the vector ports; a decode step's one row ran 1.1-1.3x faster for 20 % more bytes
 * (docs/benchmarks.md). */
#define Q4_1_BYTES 24
#define Q4_1_CODES 8 /* the nibbles' offset in a block */
#define Q8_0_BYTES 34 /* fp16 d, 32 int8: GGUF's own layout */

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

static inline float load_f32(const uint8_t *p) {
    float f;
    memcpy(&f, p, 4);
    return f;
}

#if ISA_LEVEL == 2
/* One block's 32 weights -> 2 vectors of 16 (weights 0..15 and 16..31); Q8_0 d * q, Q4_1
 * fma(d, q, m). TABLE (Q4_1): the block's 16 values fma(d, q, m) once, then each weight looked
 * up by its code: the same fp32 value as unpacking every code and its fma, in 5 instructions not
 * 9 (a permute reads the low 4 bits of its index: the low nibble as it is); with many rows of x
 * the permutes' port is the busier one, and the codes are unpacked instead. */
static inline __attribute__((always_inline)) void rebuild_block16(const int Q8, const int TABLE,
                                                                  const uint8_t *blk,
                                                                  __m512 wv[2]) {
    const __m512 d = _mm512_set1_ps(Q8 ? half_to_float(blk) : load_f32(blk));
    if (Q8) {
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + 2));
        const __m128i q1 = _mm_loadu_si128((const __m128i *)(blk + 18));
        wv[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
        wv[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
    } else if (TABLE) {
        const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 table = _mm512_fmadd_ps(d, iota, _mm512_set1_ps(load_f32(blk + 4)));
        const __m512i q =
            _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(blk + Q4_1_CODES)));
        wv[0] = _mm512_permutexvar_ps(q, table);
        wv[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table);
    } else {
        const __m512 m = _mm512_set1_ps(load_f32(blk + 4));
        const __m128i low4 = _mm_set1_epi8(0x0f);
        const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + Q4_1_CODES));
        const __m128i lo = _mm_and_si128(qs, low4);
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low4);
        wv[0] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), m);
        wv[1] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), m);
    }
}
#elif ISA_LEVEL == 1
/* One block's 32 weights -> 4 vectors of 8, each widened straight from memory (vpmovzxbd /
 * vpmovsxbd with a load: no shuffles to split the 16 bytes first); Q8_0 d * q,
 * Q4_1 fma(d, q, m), q[i] the low nibble of byte i and q[i + 16] its high nibble. */
static inline __attribute__((always_inline)) void rebuild_block8(const int Q8, const uint8_t *blk,
                                                                 __m256 wv[4]) {
    const __m256 d = _mm256_set1_ps(Q8 ? half_to_float(blk) : load_f32(blk));
    if (Q8) {
        for (int k = 0; k < 4; ++k)
            wv[k] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                         _mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * k)))));
    } else {
        const __m256 m = _mm256_set1_ps(load_f32(blk + 4));
        const __m256i low4 = _mm256_set1_epi32(0x0f);
        const uint8_t *qs = blk + Q4_1_CODES;
        const __m256i e0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));
        const __m256i e1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8)));
        const __m256i q[4] = {_mm256_and_si256(e0, low4), _mm256_and_si256(e1, low4),
                              _mm256_srli_epi32(e0, 4), _mm256_srli_epi32(e1, 4)};
        for (int k = 0; k < 4; ++k) wv[k] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(q[k]), m);
    }
}
#endif

#endif
