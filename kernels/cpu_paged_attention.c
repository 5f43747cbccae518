/* Paged attention for the CPU: each query token against its sequence's cached K/V up to its own
 * position, read in place from the block pool (no gather, no copy). A query is a decode row or
 * one token of a prefill chunk (whose K/V the caller has already written to the cache).
 *
 * Work items are (query, KV head) pairs, shared by the OpenMP threads. Each item loads the
 * GQA group's queries once, scores every cached key (pass 1, over K), then accumulates V with
 * the softmax weights (pass 2, over V): each key and value row is read exactly once. All maths is
 * fp32; the result is rounded to the cache dtype once. An item's result depends only on its own
 * query and keys, so a token's output is the same whatever else shares the step and however its
 * prompt was chunked.
 *
 * Three instruction-set levels, chosen by the flags it is compiled with (kernels/cpu_attention.py
 * picks them from the CPU it runs on) and reported by kernel_isa():
 *   2  AVX512-BF16: the scores' bf16 products come from vdpbf16ps, straight from the cache (D = 64)
 *   1  AVX2 + FMA:  keys widened 8 at a time to fp32 and scored with vfmadd (D a multiple of 8)
 *   0  plain C:     loops the compiler vectorizes for whatever the target has
 * Shapes a level has no special code for take the plain loops at that level.
 *
 * Layouts (row-major, strides in elements; bf16 stored as uint16):
 *   q      [T, H, D]           rows[i] is query i's row; it attends seq_lens[i] keys
 *   cache  [NB, BS, KVH, D]    k_cache and v_cache
 *   tables [S, W] int32        block ids; seq_idx[i] is query i's sequence (row of tables)
 *   out    [T, H, D]
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define ISA_LEVEL 2
#elif defined(__AVX2__) && defined(__FMA__)
#define ISA_LEVEL 1
#else
#define ISA_LEVEL 0
#endif
#if ISA_LEVEL > 0
#include <immintrin.h>
#endif

#define MAX_GROUP 16   /* query heads per KV head */
#define MAX_HEAD_DIM 256

static inline float bf16_to_f32(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u); /* NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* The block after the one at t0 is elsewhere in the pool: start fetching its rows of this head
 * (two cache lines each at D = 64 bf16) while the current block is computed. */
static inline void prefetch_block(const uint16_t *cache, const int32_t *table, int t0,
                                  int block_size, int64_t block_stride, int64_t token_stride,
                                  int D) {
    const uint16_t *next = cache + table[t0 / block_size + 1] * block_stride;
    for (int t = 0; t < block_size; ++t) {
        __builtin_prefetch(next + t * token_stride);
        __builtin_prefetch(next + t * token_stride + D - 1);
    }
}

/* One (query, KV head) item. Inlined with constant D and G for the common shapes, so the
 * row, the queries and the accumulators live in vector registers. */
static inline __attribute__((always_inline)) void attend(
    const int D, const int G, const uint16_t *qrow, const uint16_t *k_cache,
    const uint16_t *v_cache, const int32_t *table, int len, int block_size, int64_t token_stride,
    int64_t block_stride, float scale, float *scores, uint16_t *orow) {
    float qf[G][D], acc[G][D], max_score[G], inv_sum[G], row[D];
    for (int g = 0; g < G; ++g) {
        for (int d = 0; d < D; ++d) qf[g][d] = bf16_to_f32(qrow[g * D + d]) * scale;
        max_score[g] = -FLT_MAX;
    }
#if ISA_LEVEL == 2
    if (D == 64) { /* bf16 pair dot products straight from the cache, no conversion */
        __m512bh qv[G][2];
        for (int g = 0; g < G; ++g)
            for (int c = 0; c < 2; ++c)
                qv[g][c] = (__m512bh)_mm512_loadu_si512((const void *)(qrow + g * 64 + c * 32));
        for (int t0 = 0; t0 < len; t0 += block_size) {
            const uint16_t *kb = k_cache + table[t0 / block_size] * block_stride;
            const int m = len - t0 < block_size ? len - t0 : block_size;
            if (t0 + block_size < len)
                prefetch_block(k_cache, table, t0, block_size, block_stride, token_stride, D);
            for (int t = 0; t < m; ++t) {
                const uint16_t *krow = kb + t * token_stride;
                const __m512bh k0 = (__m512bh)_mm512_loadu_si512((const void *)krow);
                const __m512bh k1 = (__m512bh)_mm512_loadu_si512((const void *)(krow + 32));
                for (int g = 0; g < G; ++g) {
                    __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], k0);
                    acc = _mm512_dpbf16_ps(acc, qv[g][1], k1);
                    const float s = _mm512_reduce_add_ps(acc) * scale;
                    scores[(int64_t)g * len + t0 + t] = s;
                    if (s > max_score[g]) max_score[g] = s;
                }
            }
        }
    } else
#elif ISA_LEVEL == 1
    if (D % 8 == 0) { /* fp32 FMA over keys widened from bf16, 8 lanes at a time */
        for (int t0 = 0; t0 < len; t0 += block_size) {
            const uint16_t *kb = k_cache + table[t0 / block_size] * block_stride;
            const int m = len - t0 < block_size ? len - t0 : block_size;
            if (t0 + block_size < len)
                prefetch_block(k_cache, table, t0, block_size, block_stride, token_stride, D);
            for (int t = 0; t < m; ++t) {
                const uint16_t *krow = kb + t * token_stride;
                __m256 sums[G];
                for (int g = 0; g < G; ++g) sums[g] = _mm256_setzero_ps();
                for (int d = 0; d < D; d += 8) {
                    const __m128i raw = _mm_loadu_si128((const __m128i *)(krow + d));
                    const __m256 k8 = _mm256_castsi256_ps(
                        _mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
                    for (int g = 0; g < G; ++g)
                        sums[g] = _mm256_fmadd_ps(_mm256_loadu_ps(&qf[g][d]), k8, sums[g]);
                }
                for (int g = 0; g < G; ++g) {
                    const __m128 four = _mm_add_ps(_mm256_castps256_ps128(sums[g]),
                                                   _mm256_extractf128_ps(sums[g], 1));
                    const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
                    const float s = _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
                    scores[(int64_t)g * len + t0 + t] = s;
                    if (s > max_score[g]) max_score[g] = s;
                }
            }
        }
    } else
#endif
    for (int t0 = 0; t0 < len; t0 += block_size) { /* pass 1: scores, over K */
        const uint16_t *kb = k_cache + table[t0 / block_size] * block_stride;
        const int m = len - t0 < block_size ? len - t0 : block_size;
        if (t0 + block_size < len)
            prefetch_block(k_cache, table, t0, block_size, block_stride, token_stride, D);
        for (int t = 0; t < m; ++t) {
            const uint16_t *krow = kb + t * token_stride;
            #pragma omp simd
            for (int d = 0; d < D; ++d) row[d] = bf16_to_f32(krow[d]);
            for (int g = 0; g < G; ++g) {
                float s = 0.0f;
                #pragma omp simd reduction(+ : s)
                for (int d = 0; d < D; ++d) s += qf[g][d] * row[d];
                scores[(int64_t)g * len + t0 + t] = s;
                if (s > max_score[g]) max_score[g] = s;
            }
        }
    }
    for (int g = 0; g < G; ++g) { /* softmax numerators and their sums */
        float *sg = scores + (int64_t)g * len, mx = max_score[g], sum = 0.0f;
        #pragma omp simd reduction(+ : sum)
        for (int t = 0; t < len; ++t) {
            const float e = expf(sg[t] - mx);
            sg[t] = e;
            sum += e;
        }
        inv_sum[g] = 1.0f / sum;
        for (int d = 0; d < D; ++d) acc[g][d] = 0.0f;
    }
    for (int t0 = 0; t0 < len; t0 += block_size) { /* pass 2: weighted sum, over V */
        const uint16_t *vb = v_cache + table[t0 / block_size] * block_stride;
        const int m = len - t0 < block_size ? len - t0 : block_size;
        if (t0 + block_size < len)
            prefetch_block(v_cache, table, t0, block_size, block_stride, token_stride, D);
        for (int t = 0; t < m; ++t) {
            const uint16_t *vrow = vb + t * token_stride;
            #pragma omp simd
            for (int d = 0; d < D; ++d) row[d] = bf16_to_f32(vrow[d]);
            for (int g = 0; g < G; ++g) {
                const float p = scores[(int64_t)g * len + t0 + t];
                #pragma omp simd
                for (int d = 0; d < D; ++d) acc[g][d] += p * row[d];
            }
        }
    }
    for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) orow[g * D + d] = f32_to_bf16(acc[g][d] * inv_sum[g]);
}

/* The instruction-set level this library was compiled for (see the top of the file). */
int kernel_isa(void) { return ISA_LEVEL; }

int paged_attention_bf16(const uint16_t *q, int64_t q_row_stride, const uint16_t *k_cache,
                                 const uint16_t *v_cache, const int32_t *tables,
                                 int64_t table_stride, const int32_t *seq_idx, const int32_t *rows,
                                 const int32_t *seq_lens, int32_t n, int32_t num_heads,
                                 int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
                                 float scale, uint16_t *out, int64_t out_row_stride,
                                 int32_t num_threads) {
    const int group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || group * num_kv_heads != num_heads)
        return -1;
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    const int64_t block_stride = token_stride * block_size;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        float *scores = NULL; /* [group, len] of the current item */
        int64_t capacity = 0;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < (int64_t)n * num_kv_heads; ++item) {
            const int i = (int)(item / num_kv_heads), h = (int)(item % num_kv_heads);
            const int len = seq_lens[i];
            if ((int64_t)len * group > capacity) {
                free(scores);
                capacity = (int64_t)len * group * 2;
                scores = (float *)malloc(sizeof(float) * capacity);
                if (scores == NULL) { capacity = 0; failed = 1; continue; }
            }
            const int32_t *table = tables + (int64_t)seq_idx[i] * table_stride;
            const int64_t head = (int64_t)h * group * head_dim;
            const uint16_t *qrow = q + (int64_t)rows[i] * q_row_stride + head;
            uint16_t *orow = out + (int64_t)rows[i] * out_row_stride + head;
            const uint16_t *kc = k_cache + h * head_dim, *vc = v_cache + h * head_dim;
#define ATTEND(D, G) attend(D, G, qrow, kc, vc, table, len, block_size, token_stride, \
                            block_stride, scale, scores, orow)
            if (head_dim == 64 && group == 3) ATTEND(64, 3);
            else if (head_dim == 64 && group == 4) ATTEND(64, 4);
            else if (head_dim == 64 && group == 8) ATTEND(64, 8);
            else if (head_dim == 128 && group == 4) ATTEND(128, 4);
            else if (head_dim == 128 && group == 8) ATTEND(128, 8);
            else ATTEND(head_dim, group);
#undef ATTEND
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
