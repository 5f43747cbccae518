/* The CPU's fp32 FMA throughput: every OpenMP thread runs `iters` rounds of ACC independent
 * fused multiply-adds on vector registers (enough chains to hide the FMA's latency), so the
 * time is the FMA units' issue rate and nothing else: no loads, no stores. The widest vectors
 * the flags allow (cpu_quant_blocks.h's levels: 2 AVX-512, 1 AVX2 + FMA + F16C, 0 plain C).
 * Returns the fp32 flops done (2 per lane per FMA); the caller times the call
 * (kernels/cpu_fma_peak.py). */
#include "cpu_quant_blocks.h" /* the ISA level (the GEMV's flags) and kernel_isa() */

#define ACC 12

double fma_flops(int64_t iters, int32_t num_threads, float *sink) {
    double lanes = 0.0; /* vector lanes over all threads */
    float kept = 0.0f;  /* the sums, so that no FMA is optimized away */
    (void)num_threads;
#pragma omp parallel num_threads(num_threads) reduction(+ : lanes, kept)
    {
#if ISA_LEVEL == 2
        __m512 acc[ACC];
        const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
        for (int i = 0; i < ACC; ++i) acc[i] = _mm512_set1_ps((float)i);
        for (int64_t n = 0; n < iters; ++n)
            for (int i = 0; i < ACC; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
        __m512 s = acc[0];
        for (int i = 1; i < ACC; ++i) s = _mm512_add_ps(s, acc[i]);
        kept += _mm512_reduce_add_ps(s);
        lanes += 16.0;
#elif ISA_LEVEL == 1
        __m256 acc[ACC];
        const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
        for (int i = 0; i < ACC; ++i) acc[i] = _mm256_set1_ps((float)i);
        for (int64_t n = 0; n < iters; ++n)
            for (int i = 0; i < ACC; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
        float out[8];
        __m256 s = acc[0];
        for (int i = 1; i < ACC; ++i) s = _mm256_add_ps(s, acc[i]);
        _mm256_storeu_ps(out, s);
        kept += out[0];
        lanes += 8.0;
#else
        float acc[ACC][8];
        for (int i = 0; i < ACC; ++i)
            for (int l = 0; l < 8; ++l) acc[i][l] = (float)i;
        for (int64_t n = 0; n < iters; ++n)
            for (int i = 0; i < ACC; ++i)
#pragma omp simd
                for (int l = 0; l < 8; ++l) acc[i][l] = acc[i][l] * 0.999999f + 1e-7f;
        kept += acc[0][0];
        lanes += 8.0;
#endif
    }
    sink[0] = kept;
    return 2.0 * lanes * (double)ACC * (double)iters;
}
