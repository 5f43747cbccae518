/* The fused fp32 decode forward: every decoder layer of a Llama-family model for a step of a few
 * tokens (decode rows, speculative drafts, short prefill chunks), in one call and one OpenMP
 * region, over weights kept as GGUF Q4_1 / Q8_0 blocks and an fp32 paged KV cache.
 *
 * Per layer, each phase shared by the threads and ended by the region's barrier:
 *   1  h = rms_norm(x) * input_norm                      (rows)
 *   2  qkv = h Wqkv^T                                    (tiles of output features)
 *   3  RoPE on q and k, k and v written to their slots   (token, head) pairs
 *   4  o = softmax(q k^T * scale) v per query head       (token, KV head) pairs, GQA groups;
 *                                                        (token, head) pairs for a few tokens
 *   5  x += o Wo^T                                       (tiles)
 *   6  h = rms_norm(x) * post_attention_norm             (rows)
 *   7  [g, u] = h Wgate_up^T                             (tiles)
 *   8  a = silu(g) * u                                   (rows)
 *   9  x += a Wdown^T                                    (tiles)
 * It is the torch path of engine/model.py with the block GEMV (cpu_quant_dot.h) for every linear,
 * computed without the ~300 small tensor ops, casts and allocations that path spends per step:
 * the linears' sums are the GEMV's own, bit for bit; the norms, RoPE, softmax and the attention's
 * sums are fp32 in another order than torch's, so the result is the torch path's up to summation
 * order (tests/kernels/test_cpu_decode.py holds it to that, and the quality set to fp32's KL).
 *
 * Instruction-set levels as cpu_quant_blocks.h (AVX-512, AVX2 + FMA + F16C, plain C), chosen by
 * the flags kernels/cpu_decode.py compiles it with from the CPU's features at run time.
 *
 * Layouts (row-major, fp32 unless named):
 *   x        [T, hidden]              the residual stream: the embeddings in, the last layer's out
 *   layers   [L, 8] int64 pointers    qkv, o, gate_up, down blocks; input_norm, post_norm; K, V cache
 *   kinds    [L, 4] int32             each linear's blocks: 1 Q8_0, 0 Q4_1
 *   blocks   [out, in / 32 * bytes] uint8; qkv's rows q, k, v; gate_up's rows gate, then up
 *   cache    [NB, BS, KVH, D]         one K and one V per layer
 *   cos, sin [max_pos, D]             RoPE tables, the sign of sin's first half folded in
 *   positions, slots [T] int64; tables [S, W] int32; seq_idx, ctx_len [T] int32
 *   work     [T, hidden + qkv + H * D + 2 * ffn]
 */
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include "cpu_quant_blocks.h"
#include "cpu_quant_dot.h"

#ifdef _OPENMP
#include <omp.h>
static inline int omp_threads(void) { return omp_get_num_threads(); }
#else
static inline int omp_threads(void) { return 1; }
#endif

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16

/* out = x / sqrt(mean(x^2) + eps) * w, as torch's rms_norm in fp32 */
static void rms_norm_row(const float *x, const float *w, int n, float eps, float *out) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < n; ++i) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (int i = 0; i < n; ++i) out[i] = x[i] * inv * w[i];
}

/* RoPE, rotate-half form, in place on one head: v * cos + cat(v2, v1) * sin */
static void rope_head(float *v, const float *cos, const float *sin, int D) {
    const int half = D / 2;
    float r[MAX_HEAD_DIM];
#pragma omp simd
    for (int d = 0; d < half; ++d) {
        r[d] = v[d] * cos[d] + v[d + half] * sin[d];
        r[d + half] = v[d + half] * cos[d + half] + v[d] * sin[d + half];
    }
    memcpy(v, r, sizeof(float) * D);
}

/* The weighted sum of V for one head, o = inv * sum_t p[t] v[t], 64 dims at a time held in
 * registers over all keys (D a multiple of 64; AVX2 or AVX-512). */
#if ISA_LEVEL > 0
static void weigh_values_64(const float *p, const float *v_cache, const int64_t *offs, int len,
                            int D, float inv, float *o) {
#if ISA_LEVEL == 2
    for (int d0 = 0; d0 < D; d0 += 64) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int t = 0; t < len; ++t) {
            const float *v = v_cache + offs[t] + d0;
            const __m512 pt = _mm512_set1_ps(p[t]);
            a0 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v), a0);
            a1 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + 16), a1);
            a2 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + 32), a2);
            a3 = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + 48), a3);
        }
        const __m512 s = _mm512_set1_ps(inv);
        _mm512_storeu_ps(o + d0, _mm512_mul_ps(a0, s));
        _mm512_storeu_ps(o + d0 + 16, _mm512_mul_ps(a1, s));
        _mm512_storeu_ps(o + d0 + 32, _mm512_mul_ps(a2, s));
        _mm512_storeu_ps(o + d0 + 48, _mm512_mul_ps(a3, s));
    }
#else
    for (int d0 = 0; d0 < D; d0 += 64) {
        __m256 a[8];
        for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
        for (int t = 0; t < len; ++t) {
            const float *v = v_cache + offs[t] + d0;
            const __m256 pt = _mm256_set1_ps(p[t]);
            for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v + 8 * i), a[i]);
        }
        for (int i = 0; i < 8; ++i)
            _mm256_storeu_ps(o + d0 + 8 * i, _mm256_mul_ps(a[i], _mm256_set1_ps(inv)));
    }
#endif
}
#endif

#if ISA_LEVEL > 0
/* Eight keys' lane-wise products a[0..7] -> their 8 dot products, times scale, stored to out;
 * the running max of the group's scores updated. One transposing sum (hadd tree). */
static inline void store_scores8(const __m256 a[8], float scale, float *out, float *mx) {
    const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 h0 = _mm256_hadd_ps(h01, h23), h1 = _mm256_hadd_ps(h45, h67);
    const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20),
                                      _mm256_permute2f128_ps(h0, h1, 0x31));
    _mm256_storeu_ps(out, _mm256_mul_ps(sums, _mm256_set1_ps(scale)));
    for (int i = 0; i < 8; ++i) *mx = out[i] > *mx ? out[i] : *mx;
}
#endif

/* One token's G query heads (q, G * D) against the keys of its sequence up to `len`, into o.
 * `offs` [len]: scratch for each key's offset in the cache; `scores` [G, len]. */
static void attend(const float *q, const float *k_cache, const float *v_cache,
                   const int32_t *table, int len, int block_size, int64_t token_stride, int D,
                   int G, float scale, float *scores, int64_t *offs, float *o) {
    float mx[MAX_GROUP];
    for (int t0 = 0, b = 0; t0 < len; t0 += block_size, ++b) /* each key's row in the pool */
        for (int t = t0; t < len && t < t0 + block_size; ++t)
            offs[t] = ((int64_t)table[b] * block_size + (t - t0)) * token_stride;
    for (int g = 0; g < G; ++g) mx[g] = -FLT_MAX;
    int t = 0;
#if ISA_LEVEL == 2
    if (D % 16 == 0) { /* 8 keys at a time: 8 lane-wise dot products, then one transposing sum */
        for (; t + 8 <= len; t += 8) {
            for (int g = 0; g < G; ++g) {
                const float *qg = q + g * D;
                __m512 a[8];
                for (int i = 0; i < 8; ++i) a[i] = _mm512_setzero_ps();
                for (int d = 0; d < D; d += 16) {
                    const __m512 qv = _mm512_loadu_ps(qg + d);
                    for (int i = 0; i < 8; ++i)
                        a[i] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k_cache + offs[t + i] + d), a[i]);
                }
                __m256 h[8]; /* each key's 16 lanes folded to 8 */
                for (int i = 0; i < 8; ++i)
                    h[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]),
                                         _mm256_castpd_ps(_mm512_extractf64x4_pd(
                                             _mm512_castps_pd(a[i]), 1)));
                store_scores8(h, scale, scores + (int64_t)g * len + t, &mx[g]);
            }
        }
    }
#elif ISA_LEVEL == 1
    if (D % 8 == 0) { /* the same, 8 lanes a vector */
        for (; t + 8 <= len; t += 8) {
            for (int g = 0; g < G; ++g) {
                const float *qg = q + g * D;
                __m256 a[8];
                for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
                for (int d = 0; d < D; d += 8) {
                    const __m256 qv = _mm256_loadu_ps(qg + d);
                    for (int i = 0; i < 8; ++i)
                        a[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k_cache + offs[t + i] + d), a[i]);
                }
                store_scores8(a, scale, scores + (int64_t)g * len + t, &mx[g]);
            }
        }
    }
#endif
    for (; t < len; ++t) { /* scores, over K (the keys left) */
        const float *k = k_cache + offs[t];
        for (int g = 0; g < G; ++g) {
            const float *qg = q + g * D;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int d = 0; d < D; ++d) s += qg[d] * k[d];
            s *= scale;
            scores[(int64_t)g * len + t] = s;
            if (s > mx[g]) mx[g] = s;
        }
    }
    for (int g = 0; g < G; ++g) { /* softmax numerators and their sums, then the V sums */
        float *sg = scores + (int64_t)g * len, sum = 0.0f;
        const float m = mx[g];
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < len; ++t) {
            const float e = expf(sg[t] - m);
            sg[t] = e;
            sum += e;
        }
        float *og = o + g * D;
#if ISA_LEVEL > 0
        if (D % 64 == 0) {
            weigh_values_64(sg, v_cache, offs, len, D, 1.0f / sum, og);
            continue;
        }
#endif
        {
            memset(og, 0, sizeof(float) * D);
            for (int t = 0; t < len; ++t) {
                const float *v = v_cache + offs[t], pt = sg[t];
#pragma omp simd
                for (int d = 0; d < D; ++d) og[d] += pt * v[d];
            }
            for (int d = 0; d < D; ++d) og[d] *= 1.0f / sum;
        }
    }
}

/* 1 when every index the step reads or writes is inside its array: positions in the RoPE
 * tables, slots in the pool, each token's sequence in the tables, and every block its keys span. */
static int indices_in_range(int32_t T, const int64_t *positions, int32_t max_pos,
                            const int64_t *slots, int64_t num_blocks, int32_t block_size,
                            const int32_t *tables, int32_t num_seqs, int64_t table_stride,
                            const int32_t *seq_idx, const int32_t *ctx_len) {
    for (int r = 0; r < T; ++r) {
        if (positions[r] < 0 || positions[r] >= max_pos) return 0;
        if (slots[r] < 0 || slots[r] >= num_blocks * block_size) return 0;
        if (seq_idx[r] < 0 || seq_idx[r] >= num_seqs) return 0;
        if (ctx_len[r] < 1 || (int64_t)(ctx_len[r] - 1) / block_size >= table_stride) return 0;
        const int32_t *table = tables + (int64_t)seq_idx[r] * table_stride;
        for (int b = 0; b <= (ctx_len[r] - 1) / block_size; ++b)
            if (table[b] < 0 || table[b] >= num_blocks) return 0;
    }
    return 1;
}

/* 0 on success; -1 a shape it does not take (head_dim > 256 or odd, more than 16 query heads a KV
 * head, a width not a multiple of 32); -2 no memory for the scores; -3 an index out of range
 * (nothing written). */
int decode_forward_f32(int32_t num_layers, const int64_t *layers, const int32_t *kinds,
                       int32_t hidden, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
                       int32_t ffn, float eps, float *x, int32_t T, const float *cos,
                       const float *sin, int32_t max_pos, const int64_t *positions,
                       const int64_t *slots, int64_t num_blocks, int32_t block_size,
                       const int32_t *tables, int32_t num_seqs, int64_t table_stride,
                       const int32_t *seq_idx, const int32_t *ctx_len, float scale, float *work,
                       int32_t num_threads) {
    const int D = head_dim, H = num_heads, KVH = num_kv_heads, G = H / KVH;
    if (D > MAX_HEAD_DIM || D % 2 || G > MAX_GROUP || G * KVH != H || hidden % QK ||
        (H * D) % QK || ffn % QK || T < 1)
        return -1;
    if (!indices_in_range(T, positions, max_pos, slots, num_blocks, block_size, tables, num_seqs,
                          table_stride, seq_idx, ctx_len))
        return -3;
    const int q_size = H * D, kv_size = KVH * D, qkv_size = q_size + 2 * kv_size;
    float *h = work;                                   /* [T, hidden] */
    float *qkv = h + (int64_t)T * hidden;              /* [T, qkv_size] */
    float *att = qkv + (int64_t)T * qkv_size;          /* [T, q_size] */
    float *act = att + (int64_t)T * q_size;            /* [T, 2 * ffn]: gate, up */
    int max_len = 1;
    for (int i = 0; i < T; ++i) max_len = ctx_len[i] > max_len ? ctx_len[i] : max_len;
    int failed = 0;
    (void)num_threads;
    /* the GEMVs' counters for their tiles' stealing (cpu_quant_dot.h); NULL: static runs */
    Steal *steal = aligned_alloc(64, sizeof(Steal));
    if (steal != NULL) memset(steal, 0, sizeof(Steal));
#pragma omp parallel num_threads(num_threads)
    {
        int64_t calls = 0; /* this thread's GEMV calls: the same count on every thread */
        /* per thread: an item's scores [G, len], then its keys' offsets [len] */
        float *scores = (float *)malloc((sizeof(float) * G + sizeof(int64_t)) * (size_t)max_len + 8);
        int64_t *offs = (int64_t *)(scores + (size_t)max_len * G + (max_len * G) % 2);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        for (int l = 0; l < num_layers && !failed; ++l) {
            const int64_t *p = layers + (int64_t)l * 8;
            const int32_t *kind = kinds + (int64_t)l * 4;
            const uint8_t *w_qkv = (const uint8_t *)p[0], *w_o = (const uint8_t *)p[1];
            const uint8_t *w_gu = (const uint8_t *)p[2], *w_down = (const uint8_t *)p[3];
            const float *in_norm = (const float *)p[4], *post_norm = (const float *)p[5];
            float *k_cache = (float *)p[6], *v_cache = (float *)p[7];
#pragma omp for schedule(static)
            for (int r = 0; r < T; ++r)
                rms_norm_row(x + (int64_t)r * hidden, in_norm, hidden, eps, h + (int64_t)r * hidden);
            gemv_tiles(kind[0], 0, w_qkv, qkv_size, hidden, h, hidden, T, qkv, qkv_size, steal,
                       calls++);
#pragma omp for schedule(static)
            for (int item = 0; item < T * (H + KVH); ++item) { /* RoPE; K and V to their slots */
                const int r = item / (H + KVH), hd = item % (H + KVH);
                float *row = qkv + (int64_t)r * qkv_size;
                const float *c = cos + positions[r] * D, *s = sin + positions[r] * D;
                rope_head(row + hd * D, c, s, D);
                if (hd >= H) {
                    const int kh = hd - H;
                    const int64_t slot = slots[r] * kv_size + kh * D;
                    memcpy(k_cache + slot, row + hd * D, sizeof(float) * D);
                    memcpy(v_cache + slot, row + q_size + kv_size + kh * D, sizeof(float) * D);
                }
            }
            /* (token, KV head) items share each key across the GQA group; with too few of them
             * to keep the threads even, (token, query head) items read each key once per head */
            const int per_head = T * KVH < 4 * omp_threads();
            const int heads = per_head ? H : KVH, group = per_head ? 1 : G;
#pragma omp for schedule(dynamic, 1)
            for (int item = 0; item < T * heads; ++item) {
                const int r = item / heads, hq = (item % heads) * group, kh = hq / G;
                const int32_t *table = tables + (int64_t)seq_idx[r] * table_stride;
                attend(qkv + (int64_t)r * qkv_size + hq * D, k_cache + kh * D, v_cache + kh * D,
                       table, ctx_len[r], block_size, kv_size, D, group, scale, scores, offs,
                       att + (int64_t)r * q_size + hq * D);
            }
            gemv_tiles(kind[1], 1, w_o, hidden, q_size, att, q_size, T, x, hidden, steal, calls++);
#pragma omp for schedule(static)
            for (int r = 0; r < T; ++r)
                rms_norm_row(x + (int64_t)r * hidden, post_norm, hidden, eps,
                             h + (int64_t)r * hidden);
            gemv_tiles(kind[2], 0, w_gu, 2 * (int64_t)ffn, hidden, h, hidden, T, act, 2 * ffn,
                       steal, calls++);
#pragma omp for schedule(static)
            for (int r = 0; r < T; ++r) { /* silu(gate) * up, into gate's half of the row */
                float *a = act + (int64_t)r * 2 * ffn;
#pragma omp simd
                for (int j = 0; j < ffn; ++j) a[j] = a[j] / (1.0f + expf(-a[j])) * a[ffn + j];
            }
            gemv_tiles(kind[3], 1, w_down, hidden, ffn, act, 2 * ffn, T, x, hidden, steal,
                       calls++);
        }
        free(scores);
    }
    free(steal);
    return failed ? -2 : 0;
}
