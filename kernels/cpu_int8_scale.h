/* A run of fp32 values' int8 scale, for the screens (cpu_greedy_head.c per block of 32,
 * cpu_amx_gemm.c per row): its largest |x|, checked finite on the bits (under -ffast-math,
 * which the screen's level builds with, isfinite() is folded away), and the step max|x| / 127
 * with its inverse, both 0 where max|x| is too small to divide by (the run is then left out). */
#ifndef CPU_INT8_SCALE_H
#define CPU_INT8_SCALE_H
#include <math.h>
#include <stdint.h>
#include <string.h>

/* 0, or -1 for a value that is not finite */
static inline int int8_scale(const float *x, int64_t n, float *amax, float *step, float *inv) {
    float m = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        if ((u & 0x7f800000u) == 0x7f800000u) return -1; /* inf or NaN */
        const float a = fabsf(x[i]);
        m = a > m ? a : m;
    }
    const int tiny = m < 1e-30f; /* 127 / m would overflow */
    *amax = m;
    *step = tiny ? 0.0f : m / 127.0f;
    *inv = tiny ? 0.0f : 127.0f / m;
    return 0;
}
#endif
