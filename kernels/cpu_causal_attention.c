/* fp32 causal self-attention of one prefill chunk with nothing cached before it: token i of the
 * chunk attends tokens 0..i. GQA: the G query heads of a KV head share its keys and values.
 *
 * Work item: one KV head and QB consecutive query positions, so QB * G query rows (48 at G = 3)
 * share every key and value row they load, where attending each query alone reloads them per
 * query. Per item, in fp32 throughout:
 *   scores  S[r][t] = scale * q_r . k_t, over the keys the item's last query sees, in tiles of
 *           16 keys (one vector across keys, K transposed once per call) times RB query rows;
 *           keys past a row's own position are -inf;
 *   softmax each row's max, exp (vectorized expf), sum;
 *   values  O[r] = sum_t p[r][t] v_t / sum, RB rows at a time, the head dimension in vectors.
 * The sums run in another order than torch's SDPA (its flash kernel tiles keys by 512 and keeps
 * a running max); both are fp32.
 *
 * Layouts (strides in floats): q [T][H][D] rows q_stride apart, heads D apart; k, v [T][KVH][D]
 * rows k_stride / v_stride apart; o [T][H][D] contiguous. H = KVH * G, query head h uses KV
 * head h / G. D a multiple of 16 (AVX-512) or anything (plain C).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#define ISA_LEVEL 2
#else
#define ISA_LEVEL 0
#endif

int kernel_isa(void) { return ISA_LEVEL; }

#define QB 16 /* query positions an item */
#define RB 6  /* query rows a register block */
#define MAX_ROWS (QB * 8) /* QB * G, G <= 8 */

/* One item: KV head g, positions p0 .. p0 + np - 1. kt [D][T] (this head's keys, transposed),
 * s: scratch [MAX_ROWS][T]. */
static void item(const float *q, int64_t q_stride, const float *kt, const float *v,
                 int64_t v_stride, float *o, int T, int G, int D, int KVH, int g, int p0, int np,
                 float scale, float *s) {
    const int H = KVH * G, rows = np * G, L = p0 + np; /* keys the last position sees */
    const float *qrow[MAX_ROWS];
    int pos[MAX_ROWS];
    float *orow[MAX_ROWS];
    for (int i = 0; i < np; ++i)
        for (int j = 0; j < G; ++j) {
            const int r = i * G + j, h = g * G + j;
            qrow[r] = q + (int64_t)(p0 + i) * q_stride + (int64_t)h * D;
            orow[r] = o + ((int64_t)(p0 + i) * H + h) * D;
            pos[r] = p0 + i;
        }
    /* scores */
    for (int r0 = 0; r0 < rows; r0 += RB) {
        const int nr = rows - r0 < RB ? rows - r0 : RB;
        int t = 0;
#if ISA_LEVEL == 2
        const float *qr[RB]; /* a short block repeats its last row, stored once */
        for (int r = 0; r < RB; ++r) qr[r] = qrow[r0 + (r < nr ? r : nr - 1)];
        for (; t + 32 <= L; t += 32) { /* two vectors of keys: 12 FMAs to 8 loads */
            __m512 a0[RB], a1[RB];
            for (int r = 0; r < RB; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
            for (int d = 0; d < D; ++d) {
                const __m512 k0 = _mm512_loadu_ps(kt + (int64_t)d * T + t);
                const __m512 k1 = _mm512_loadu_ps(kt + (int64_t)d * T + t + 16);
#pragma GCC unroll 6
                for (int r = 0; r < RB; ++r) {
                    const __m512 qd = _mm512_set1_ps(qr[r][d]);
                    a0[r] = _mm512_fmadd_ps(qd, k0, a0[r]);
                    a1[r] = _mm512_fmadd_ps(qd, k1, a1[r]);
                }
            }
            for (int r = 0; r < nr; ++r) {
                float *sr = s + (int64_t)(r0 + r) * T + t;
                _mm512_storeu_ps(sr, _mm512_mul_ps(a0[r], _mm512_set1_ps(scale)));
                _mm512_storeu_ps(sr + 16, _mm512_mul_ps(a1[r], _mm512_set1_ps(scale)));
            }
        }
        for (; t + 16 <= L; t += 16) {
            __m512 acc[RB];
            for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
            for (int d = 0; d < D; ++d) {
                const __m512 kv = _mm512_loadu_ps(kt + (int64_t)d * T + t);
#pragma GCC unroll 6
                for (int r = 0; r < RB; ++r)
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[r][d]), kv, acc[r]);
            }
            for (int r = 0; r < nr; ++r)
                _mm512_storeu_ps(s + (int64_t)(r0 + r) * T + t,
                                 _mm512_mul_ps(acc[r], _mm512_set1_ps(scale)));
        }
#endif
        for (; t < L; ++t)
            for (int r = 0; r < nr; ++r) {
                float a = 0.0f;
                for (int d = 0; d < D; ++d) a += qrow[r0 + r][d] * kt[(int64_t)d * T + t];
                s[(int64_t)(r0 + r) * T + t] = a * scale;
            }
    }
    /* softmax numerators, each row over the keys its position sees */
    float inv[MAX_ROWS];
    for (int r = 0; r < rows; ++r) {
        float *sr = s + (int64_t)r * T, m = -INFINITY, sum = 0.0f;
        const int n = pos[r] + 1;
        for (int t = 0; t < n; ++t) m = sr[t] > m ? sr[t] : m;
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < n; ++t) {
            const float e = expf(sr[t] - m);
            sr[t] = e;
            sum += e;
        }
        for (int t = n; t < L; ++t) sr[t] = 0.0f;
        inv[r] = 1.0f / sum;
    }
    /* values */
    for (int r0 = 0; r0 < rows; r0 += RB) {
        const int nr = rows - r0 < RB ? rows - r0 : RB;
        const int n = pos[r0 + nr - 1] + 1; /* the block's last row sees the most keys */
#if ISA_LEVEL == 2
        if (D == 64) {
            __m512 acc[RB][4];
            for (int r = 0; r < RB; ++r)
                for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
            const float *pr[RB]; /* a short block repeats its last row, stored once */
            for (int r = 0; r < RB; ++r) pr[r] = s + (int64_t)(r0 + (r < nr ? r : nr - 1)) * T;
            for (int t = 0; t < n; ++t) {
                const float *vt = v + (int64_t)t * v_stride;
                const __m512 v0 = _mm512_loadu_ps(vt), v1 = _mm512_loadu_ps(vt + 16);
                const __m512 v2 = _mm512_loadu_ps(vt + 32), v3 = _mm512_loadu_ps(vt + 48);
#pragma GCC unroll 6
                for (int r = 0; r < RB; ++r) {
                    const __m512 p = _mm512_set1_ps(pr[r][t]);
                    acc[r][0] = _mm512_fmadd_ps(p, v0, acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(p, v1, acc[r][1]);
                    acc[r][2] = _mm512_fmadd_ps(p, v2, acc[r][2]);
                    acc[r][3] = _mm512_fmadd_ps(p, v3, acc[r][3]);
                }
            }
            for (int r = 0; r < nr; ++r) {
                const __m512 w = _mm512_set1_ps(inv[r0 + r]);
                for (int c = 0; c < 4; ++c)
                    _mm512_storeu_ps(orow[r0 + r] + 16 * c, _mm512_mul_ps(acc[r][c], w));
            }
            continue;
        }
#endif
        for (int r = 0; r < nr; ++r) {
            float *out = orow[r0 + r];
            const float *sr = s + (int64_t)(r0 + r) * T;
            memset(out, 0, sizeof(float) * D);
            for (int t = 0; t < n; ++t) {
                const float *vt = v + (int64_t)t * v_stride;
                for (int d = 0; d < D; ++d) out[d] += sr[t] * vt[d];
            }
            for (int d = 0; d < D; ++d) out[d] *= inv[r0 + r];
        }
    }
}

/* 0 on success; -1 a shape it does not take (G > 8, D < 1); -2 no memory. */
int causal_attention(const float *q, int64_t q_stride, const float *k, int64_t k_stride,
                     const float *v, int64_t v_stride, float *o, int T, int H, int KVH, int D,
                     float scale, int num_threads) {
    if (T < 1 || KVH < 1 || H % KVH || H / KVH > 8 || D < 1) return -1;
    const int G = H / KVH, num_blocks = (T + QB - 1) / QB;
    if (num_threads < 1) num_threads = 1;
#ifndef _OPENMP
    num_threads = 1;
#endif
    /* each KV head's keys transposed [D][T], then each thread's scores [MAX_ROWS][T] */
    const size_t kt_floats = (size_t)KVH * D * T, s_floats = (size_t)QB * G * T;
    float *kt = malloc(sizeof(float) * (kt_floats + (size_t)num_threads * s_floats));
    if (kt == NULL) return -2;
#pragma omp parallel num_threads(num_threads)
    {
#ifdef _OPENMP
        float *s = kt + kt_floats + (size_t)omp_get_thread_num() * s_floats;
#else
        float *s = kt + kt_floats;
#endif
#pragma omp for schedule(static)
        for (int g = 0; g < KVH; ++g)
            for (int t = 0; t < T; ++t)
                for (int d = 0; d < D; ++d)
                    kt[((size_t)g * D + d) * T + t] = k[(int64_t)t * k_stride + (int64_t)g * D + d];
        /* longest items first: the last query blocks see the most keys */
#pragma omp for schedule(dynamic, 1)
        for (int w = 0; w < KVH * num_blocks; ++w) {
            const int b = num_blocks - 1 - w / KVH, g = w % KVH;
            const int p0 = b * QB, np = T - p0 < QB ? T - p0 : QB;
            item(q, q_stride, kt + (size_t)g * D * T, v + (int64_t)g * D, v_stride, o, T, G, D,
                 KVH, g, p0, np, scale, s);
        }
    }
    free(kt);
    return 0;
}
