/* Paged attention for the CPU: each query token against its sequence's cached K/V up to its own
 * position, read in place from the block pool (no gather, no copy). A query is a decode row or
 * one token of a prefill chunk (whose K/V the caller has already written to the cache). The cache
 * and the queries are bf16 (paged_attention_bf16) or fp32 (paged_attention_f32: the fp32
 * batch-invariant mode's attention).
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
 * The fp32 kernel takes the plain loops at every level.
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

/* Element i of a bf16 (F32 = 0) or fp32 (F32 = 1) array, as fp32. */
static inline __attribute__((always_inline)) float load_elt(const void *p, int64_t i,
                                                            const int F32) {
    return F32 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

/* Element i of an array of the cache dtype, `offset` elements past `base`. */
static inline __attribute__((always_inline)) const void *at(const void *base, int64_t offset,
                                                            const int F32) {
    return (const char *)base + offset * (F32 ? 4 : 2);
}

/* The block after the one at t0 is elsewhere in the pool: start fetching its rows of this head
 * (two cache lines each at D = 64 bf16) while the current block is computed. */
static inline void prefetch_block(const void *cache, const int32_t *table, int t0,
                                  int block_size, int64_t block_stride, int64_t token_stride,
                                  int D, const int F32) {
    const void *next = at(cache, table[t0 / block_size + 1] * block_stride, F32);
    for (int t = 0; t < block_size; ++t) {
        __builtin_prefetch(at(next, t * token_stride, F32));
        __builtin_prefetch(at(next, t * token_stride + D - 1, F32));
    }
}

/* One (query, KV head) item. Inlined with constant D and G for the common shapes, so the
 * row, the queries and the accumulators live in vector registers. F32: the dtype. */
static inline __attribute__((always_inline)) void attend(
    const int F32, const int D, const int G, const void *q_row, const void *k_cache,
    const void *v_cache, const int32_t *table, int len, int block_size, int64_t token_stride,
    int64_t block_stride, float scale, float *scores, void *o_row) {
    float qf[G][D], acc[G][D], max_score[G], inv_sum[G], row[D];
    for (int g = 0; g < G; ++g) {
        for (int d = 0; d < D; ++d) qf[g][d] = load_elt(q_row, g * D + d, F32) * scale;
        max_score[g] = -FLT_MAX;
    }
#if ISA_LEVEL == 2
    if (!F32 && D == 64) { /* bf16 pair dot products straight from the cache, no conversion */
        const uint16_t *qrow = (const uint16_t *)q_row, *k_bf16 = (const uint16_t *)k_cache;
        __m512bh qv[G][2];
        for (int g = 0; g < G; ++g)
            for (int c = 0; c < 2; ++c)
                qv[g][c] = (__m512bh)_mm512_loadu_si512((const void *)(qrow + g * 64 + c * 32));
        for (int t0 = 0; t0 < len; t0 += block_size) {
            const uint16_t *kb = k_bf16 + table[t0 / block_size] * block_stride;
            const int m = len - t0 < block_size ? len - t0 : block_size;
            if (t0 + block_size < len)
                prefetch_block(k_cache, table, t0, block_size, block_stride, token_stride, D, 0);
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
    if (!F32 && D % 8 == 0) { /* fp32 FMA over keys widened from bf16, 8 lanes at a time */
        const uint16_t *k_bf16 = (const uint16_t *)k_cache;
        for (int t0 = 0; t0 < len; t0 += block_size) {
            const uint16_t *kb = k_bf16 + table[t0 / block_size] * block_stride;
            const int m = len - t0 < block_size ? len - t0 : block_size;
            if (t0 + block_size < len)
                prefetch_block(k_cache, table, t0, block_size, block_stride, token_stride, D, 0);
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
        const void *kb = at(k_cache, table[t0 / block_size] * block_stride, F32);
        const int m = len - t0 < block_size ? len - t0 : block_size;
        if (t0 + block_size < len)
            prefetch_block(k_cache, table, t0, block_size, block_stride, token_stride, D, F32);
        for (int t = 0; t < m; ++t) {
            const void *krow = at(kb, t * token_stride, F32);
            #pragma omp simd
            for (int d = 0; d < D; ++d) row[d] = load_elt(krow, d, F32);
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
        const void *vb = at(v_cache, table[t0 / block_size] * block_stride, F32);
        const int m = len - t0 < block_size ? len - t0 : block_size;
        if (t0 + block_size < len)
            prefetch_block(v_cache, table, t0, block_size, block_stride, token_stride, D, F32);
        for (int t = 0; t < m; ++t) {
            const void *vrow = at(vb, t * token_stride, F32);
            #pragma omp simd
            for (int d = 0; d < D; ++d) row[d] = load_elt(vrow, d, F32);
            for (int g = 0; g < G; ++g) {
                const float p = scores[(int64_t)g * len + t0 + t];
                #pragma omp simd
                for (int d = 0; d < D; ++d) acc[g][d] += p * row[d];
            }
        }
    }
    for (int g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) {
            const float o = acc[g][d] * inv_sum[g];
            if (F32) ((float *)o_row)[g * D + d] = o;
            else ((uint16_t *)o_row)[g * D + d] = f32_to_bf16(o);
        }
}

/* The instruction-set level this library was compiled for (see the top of the file). */
int kernel_isa(void) { return ISA_LEVEL; }

/* Every (query, KV head) item of the step; 0 on success, -1 for a shape the kernel does not
 * take, -2 when a score buffer cannot be allocated. */
static inline __attribute__((always_inline)) int paged_attention(
    const int F32, const void *q, int64_t q_row_stride, const void *k_cache, const void *v_cache,
    const int32_t *tables, int64_t table_stride, const int32_t *seq_idx, const int32_t *rows,
    const int32_t *seq_lens, int32_t n, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
    int32_t block_size, float scale, void *out, int64_t out_row_stride, int32_t num_threads) {
    const int group = num_heads / num_kv_heads;
    if (group > MAX_GROUP || head_dim > MAX_HEAD_DIM || group * num_kv_heads != num_heads)
        return -1;
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    const int64_t block_stride = token_stride * block_size;
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        float *scores = NULL; /* [group, len] of the current item; 64-byte aligned, so the
                                 vectorized softmax sums the same lanes wherever it lies */
        int64_t capacity = 0;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < (int64_t)n * num_kv_heads; ++item) {
            const int i = (int)(item / num_kv_heads), h = (int)(item % num_kv_heads);
            const int len = seq_lens[i];
            if ((int64_t)len * group > capacity) {
                free(scores);
                capacity = ((int64_t)len * group * 2 + 15) / 16 * 16;
                scores = (float *)aligned_alloc(64, sizeof(float) * capacity);
                if (scores == NULL) { capacity = 0; failed = 1; continue; }
            }
            const int32_t *table = tables + (int64_t)seq_idx[i] * table_stride;
            const int64_t head = (int64_t)h * group * head_dim;
            const void *qrow = at(q, (int64_t)rows[i] * q_row_stride + head, F32);
            void *orow = (void *)at(out, (int64_t)rows[i] * out_row_stride + head, F32);
            const void *kc = at(k_cache, h * head_dim, F32), *vc = at(v_cache, h * head_dim, F32);
#define ATTEND(D, G) attend(F32, D, G, qrow, kc, vc, table, len, block_size, token_stride, \
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

#define PAGED_ATTENTION_ARGS                                                                  \
    int64_t q_row_stride, const void *k_cache, const void *v_cache, const int32_t *tables,    \
        int64_t table_stride, const int32_t *seq_idx, const int32_t *rows,                    \
        const int32_t *seq_lens, int32_t n, int32_t num_heads, int32_t num_kv_heads,          \
        int32_t head_dim, int32_t block_size, float scale, void *out, int64_t out_row_stride, \
        int32_t num_threads
#define PAGED_ATTENTION_CALL                                                                  \
    q_row_stride, k_cache, v_cache, tables, table_stride, seq_idx, rows, seq_lens, n,         \
        num_heads, num_kv_heads, head_dim, block_size, scale, out, out_row_stride, num_threads

int paged_attention_bf16(const void *q, PAGED_ATTENTION_ARGS) {
    return paged_attention(0, q, PAGED_ATTENTION_CALL);
}

int paged_attention_f32(const void *q, PAGED_ATTENTION_ARGS) {
    return paged_attention(1, q, PAGED_ATTENTION_CALL);
}
