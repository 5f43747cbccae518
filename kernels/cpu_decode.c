/* The fused fp32 decode forward: every decoder layer of a Llama-family model for a step of a few
 * tokens (decode rows, speculative drafts, short prefill chunks), in one call and one OpenMP
 * region, over weights kept as Q4_1 / Q8_0 blocks (cpu_quant_blocks.h) and a paged KV cache of
 * fp32 or fp16 (`kv_half`: each K and V rounded to fp16 as it is stored, as torch's .to(float16)
 * rounds it, and widened to fp32 as attention reads it; every sum stays fp32).
 *
 * Per layer, each phase's items shared by the threads (exactly once each, see "work items"):
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
 * the linears' sums are the GEMV's own, bit for bit, below OUTER_MIN_ROWS rows (from there at
 * AVX-512 in the input order, cpu_quant_dot.h tile_sums_outer); the norms, RoPE, softmax and
 * the attention's sums are fp32 in another order than torch's, so the result is the torch path's
 * up to summation order (tests/kernels/test_cpu_decode.py holds it to that, and the quality set
 * to fp32's KL).
 *
 * Instruction-set levels as cpu_quant_blocks.h (AVX-512, AVX2 + FMA + F16C, plain C), chosen by
 * the flags kernels/cpu_decode.py compiles it with from the CPU's features at run time.
 *
 * Layouts (row-major, fp32 unless named):
 *   x        [T, hidden]              the residual stream: the embeddings in, the last layer's out
 *   layers   [L, 8] int64 pointers    qkv, o, gate_up, down blocks; input_norm, post_norm; K, V cache
 *   kinds    [L, 4] int32             each linear's blocks: 1 Q8_0, 0 Q4_1
 *   blocks   [out, in / 32 * bytes] uint8; qkv's rows q, k, v; gate_up's rows gate, then up
 *   cache    [NB, BS, KVH, D]         one K and one V per layer, fp32 or (kv_half) fp16
 *   cos, sin [max_pos, D]             RoPE tables, the sign of sin's first half folded in
 *   positions, slots [T] int64; tables [S, W] int32; seq_idx, ctx_len [T] int32
 *   work     [T, hidden + qkv + H * D + 2 * ffn]
 */
#define _POSIX_C_SOURCE 200809L
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <time.h>
#include "cpu_quant_blocks.h"
#include "cpu_quant_dot.h"

#ifdef _OPENMP
#include <omp.h>
static inline int omp_threads(void) { return omp_get_num_threads(); }
static inline int omp_thread(void) { return omp_get_thread_num(); }
#else
static inline int omp_threads(void) { return 1; }
static inline int omp_thread(void) { return 0; }
#endif

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define INLINE static inline __attribute__((always_inline))

/* Element i of a K or V cache, widened to fp32: `half` is a constant at every call site (each
 * caller is inlined into one fp32 and one fp16 copy), so the branch folds away. */
INLINE float kv_at(const void *c, int64_t i, int half) {
    return half ? (float)((const _Float16 *)c)[i] : ((const float *)c)[i];
}
#if ISA_LEVEL == 2
INLINE __m512 kv_load16(const void *c, int64_t i, int half) {
    return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)c + i)))
                : _mm512_loadu_ps((const float *)c + i);
}
#endif
#if ISA_LEVEL > 0
INLINE __m256 kv_load8(const void *c, int64_t i, int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)c + i)))
                : _mm256_loadu_ps((const float *)c + i);
}
#endif

/* Keys and values are read one head's D elements a token, strided by the token's row, from
 * blocks the table scatters: too irregular for the hardware's prefetchers, so attention asks
 * for each key's lines PREFETCH_KEYS keys ahead of the one it computes. */
#define PREFETCH_KEYS 32
INLINE void kv_prefetch(const void *c, int64_t i, int D, int half) {
    const char *p = (const char *)c + i * (half ? 2 : 4);
    for (int b = 0; b < D * (half ? 2 : 4); b += 64) __builtin_prefetch(p + b);
}

/* n fp32 values into a cache at element i, rounded to nearest-even fp16 when `half` */
static void kv_store(void *c, int64_t i, const float *src, int n, int half) {
    if (!half) {
        memcpy((float *)c + i, src, sizeof(float) * n);
        return;
    }
    _Float16 *dst = (_Float16 *)c + i;
    for (int d = 0; d < n; ++d) dst[d] = (_Float16)src[d];
}

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

/* out = silu(g) * u, as torch's fp32 silu times up */
static void silu_mul(const float *g, const float *u, int n, float *out) {
#pragma omp simd
    for (int j = 0; j < n; ++j) out[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
}

/* The weighted sum of V for one head, o = inv * sum_t p[t] v[t], 64 dims at a time held in
 * registers over all keys (D a multiple of 64; AVX2: 8 accumulator chains a head). */
#if ISA_LEVEL == 1
INLINE void weigh_values_64(const float *p, const void *v_cache, const int64_t *offs, int len,
                            int D, float inv, float *o, int half) {
    for (int d0 = 0; d0 < D; d0 += 64) {
        __m256 a[8];
        for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
        for (int t = 0; t < len; ++t) {
            const int64_t v = offs[t] + d0;
            if (t + PREFETCH_KEYS < len) kv_prefetch(v_cache, offs[t + PREFETCH_KEYS] + d0, 64, half);
            const __m256 pt = _mm256_set1_ps(p[t]);
            for (int i = 0; i < 8; ++i)
                a[i] = _mm256_fmadd_ps(pt, kv_load8(v_cache, v + 8 * i, half), a[i]);
        }
        for (int i = 0; i < 8; ++i)
            _mm256_storeu_ps(o + d0 + 8 * i, _mm256_mul_ps(a[i], _mm256_set1_ps(inv)));
    }
}
#endif

#if ISA_LEVEL == 2
/* The weighted sums of V for N heads of a group at once, o[g] = inv[g] * sum_t p[g, t] v[t], 64
 * dims at a time held in registers over all keys (D a multiple of 64): each token's V loaded once
 * for the N heads, and 4 N accumulator chains, where one head at a time (4 chains) left the FMA
 * pipes waiting on their latency and read V once a head (32 streams: docs/benchmarks.md). A
 * head's sums are the same FMAs in the same order as one head at a time. */
#define HEADS_AT_ONCE 3 /* a group's query heads per pass over its values (AVX-512) */
INLINE void weigh_values_heads(const int N, const float *p, int len, const void *v_cache,
                               const int64_t *offs, int D, const float *inv, float *o, int half) {
    for (int d0 = 0; d0 < D; d0 += 64) {
        __m512 a[HEADS_AT_ONCE][4];
        for (int g = 0; g < N; ++g) a[g][0] = a[g][1] = a[g][2] = a[g][3] = _mm512_setzero_ps();
        for (int t = 0; t < len; ++t) {
            const int64_t v = offs[t] + d0;
            if (t + PREFETCH_KEYS < len) kv_prefetch(v_cache, offs[t + PREFETCH_KEYS] + d0, 64, half);
            const __m512 v0 = kv_load16(v_cache, v, half), v1 = kv_load16(v_cache, v + 16, half);
            const __m512 v2 = kv_load16(v_cache, v + 32, half), v3 = kv_load16(v_cache, v + 48, half);
            for (int g = 0; g < N; ++g) {
                const __m512 pt = _mm512_set1_ps(p[(int64_t)g * len + t]);
                a[g][0] = _mm512_fmadd_ps(pt, v0, a[g][0]);
                a[g][1] = _mm512_fmadd_ps(pt, v1, a[g][1]);
                a[g][2] = _mm512_fmadd_ps(pt, v2, a[g][2]);
                a[g][3] = _mm512_fmadd_ps(pt, v3, a[g][3]);
            }
        }
        for (int g = 0; g < N; ++g) {
            const __m512 s = _mm512_set1_ps(inv[g]);
            float *og = o + (int64_t)g * D + d0;
            for (int i = 0; i < 4; ++i) _mm512_storeu_ps(og + 16 * i, _mm512_mul_ps(a[g][i], s));
        }
    }
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
 * `offs` [len]: scratch for each key's offset (in elements) in the cache; `scores` [G, len];
 * the caches fp16 when `half`. */
INLINE void attend(const float *q, const void *k_cache, const void *v_cache, const int32_t *table,
                   int len, int block_size, int64_t token_stride, int D, int G, float scale,
                   float *scores, int64_t *offs, float *o, int half) {
    float mx[MAX_GROUP];
    for (int t0 = 0, b = 0; t0 < len; t0 += block_size, ++b) /* each key's row in the pool */
        for (int t = t0; t < len && t < t0 + block_size; ++t)
            offs[t] = ((int64_t)table[b] * block_size + (t - t0)) * token_stride;
    for (int g = 0; g < G; ++g) mx[g] = -FLT_MAX;
    int t = 0;
#if ISA_LEVEL == 2
    if (D % 16 == 0) { /* 8 keys at a time: 8 lane-wise dot products, then one transposing sum */
        for (; t + 8 <= len; t += 8) {
            for (int i = PREFETCH_KEYS; i < PREFETCH_KEYS + 8 && t + i < len; ++i)
                kv_prefetch(k_cache, offs[t + i], D, half);
            for (int g = 0; g < G; ++g) {
                const float *qg = q + g * D;
                __m512 a[8];
                for (int i = 0; i < 8; ++i) a[i] = _mm512_setzero_ps();
                for (int d = 0; d < D; d += 16) {
                    const __m512 qv = _mm512_loadu_ps(qg + d);
                    for (int i = 0; i < 8; ++i)
                        a[i] = _mm512_fmadd_ps(qv, kv_load16(k_cache, offs[t + i] + d, half), a[i]);
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
            for (int i = PREFETCH_KEYS; i < PREFETCH_KEYS + 8 && t + i < len; ++i)
                kv_prefetch(k_cache, offs[t + i], D, half);
            for (int g = 0; g < G; ++g) {
                const float *qg = q + g * D;
                __m256 a[8];
                for (int i = 0; i < 8; ++i) a[i] = _mm256_setzero_ps();
                for (int d = 0; d < D; d += 8) {
                    const __m256 qv = _mm256_loadu_ps(qg + d);
                    for (int i = 0; i < 8; ++i)
                        a[i] = _mm256_fmadd_ps(qv, kv_load8(k_cache, offs[t + i] + d, half), a[i]);
                }
                store_scores8(a, scale, scores + (int64_t)g * len + t, &mx[g]);
            }
        }
    }
#endif
    for (; t < len; ++t) { /* scores, over K (the keys left) */
        const int64_t k = offs[t];
        for (int g = 0; g < G; ++g) {
            const float *qg = q + g * D;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int d = 0; d < D; ++d) s += qg[d] * kv_at(k_cache, k + d, half);
            s *= scale;
            scores[(int64_t)g * len + t] = s;
            if (s > mx[g]) mx[g] = s;
        }
    }
    float inv[MAX_GROUP];
    for (int g = 0; g < G; ++g) { /* softmax numerators and their sums */
        float *sg = scores + (int64_t)g * len, sum = 0.0f;
        const float m = mx[g];
#pragma omp simd reduction(+ : sum)
        for (int t = 0; t < len; ++t) {
            const float e = expf(sg[t] - m);
            sg[t] = e;
            sum += e;
        }
        inv[g] = 1.0f / sum;
    }
#if ISA_LEVEL == 2
    if (D % 64 == 0) { /* the V sums, the group's heads HEADS_AT_ONCE at a time */
        for (int g0 = 0; g0 < G; g0 += HEADS_AT_ONCE) {
            const int n = G - g0 < HEADS_AT_ONCE ? G - g0 : HEADS_AT_ONCE;
            const float *pg = scores + (int64_t)g0 * len;
            float *og = o + g0 * D;
            if (n == 1) weigh_values_heads(1, pg, len, v_cache, offs, D, inv + g0, og, half);
            else if (n == 2) weigh_values_heads(2, pg, len, v_cache, offs, D, inv + g0, og, half);
            else weigh_values_heads(3, pg, len, v_cache, offs, D, inv + g0, og, half);
        }
        return;
    }
#endif
    for (int g = 0; g < G; ++g) { /* the V sums */
        const float *sg = scores + (int64_t)g * len;
        float *og = o + g * D;
#if ISA_LEVEL == 1
        if (D % 64 == 0) {
            weigh_values_64(sg, v_cache, offs, len, D, inv[g], og, half);
            continue;
        }
#endif
        memset(og, 0, sizeof(float) * D);
        for (int t = 0; t < len; ++t) {
            const int64_t v = offs[t];
            const float pt = sg[t];
#pragma omp simd
            for (int d = 0; d < D; ++d) og[d] += pt * kv_at(v_cache, v + d, half);
        }
        for (int d = 0; d < D; ++d) og[d] *= inv[g];
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

/* ---- the step's work items, each stored exactly once, by whichever thread gets there first ----
 *
 * Every phase of every layer is a set of items (rows, (token, head) pairs, GEMV tiles), and every
 * thread goes through the phases in order. An item is computed into the thread's own buffer and
 * stored only by the thread that claims its store first (state 0 -> 2, stored, -> 3), so each
 * store happens once and a late thread's copy is dropped. A thread that has taken every item of a
 * phase and has waited `redo_after_ns` for the rest computes those itself: the items a preempted
 * thread holds are redone instead of waited for. The step's threads run below the stages (two
 * cores shared with them), so a stage that wakes preempts one of them; with a barrier after each
 * phase the other stood still until the stage was done, and the stage's time was lost on both
 * cores. Now only the region's end waits for every thread, once a step.
 *
 * Items are taken as the GEMV's tiles were: thread k's contiguous run of each phase first (the
 * prefetchers follow one thread's blocks), then what is left of the others' runs. An item's
 * values do not depend on who computes it, so the result is the same bit for bit whatever the
 * threads do (tests/kernels/test_cpu_decode.py: any thread count, every item raced for). */
#define PHASES_PER_LAYER 9
#define DECODE_MAX_ROWS 32 /* a step's tokens (kernels/cpu_decode.py MAX_ROWS) */
_Static_assert(DECODE_MAX_ROWS <= ROWS_MAX, "a step's rows go through a tile in one call");
#define LINE 8 /* int64s a cache line: each thread's counters on a line of their own */
typedef struct {
    int nt;          /* the region's threads */
    int64_t stride;  /* counters a phase: a line for each of up to nt_max threads */
    int64_t *next;   /* [phase][thread][LINE]: items taken of each thread's run */
    int64_t *done;   /* [phase][thread][LINE]: items each thread has stored */
    int64_t *first;  /* [phase]: its first item's index in state */
    int64_t *count;  /* [phase]: its items */
    uint8_t *state;  /* [every item]: 0 not stored, 2 being stored, 3 stored */
} Items;

static inline long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* the next item of phase p for thread me (its own run first), or -1 when all are taken */
static inline int64_t take(Items *it, int64_t p, int me) {
    const int nt = it->nt;
    const int64_t n = it->count[p];
    for (int k = 0; k < nt; ++k) {
        const int owner = (me + k) % nt;
        const int64_t start = n * owner / nt, end = n * (owner + 1) / nt;
        int64_t *next = &it->next[p * it->stride + owner * LINE];
        if (start + __atomic_load_n(next, __ATOMIC_RELAXED) >= end) continue;
        const int64_t t = start + __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
        if (t < end) return t;
    }
    return -1;
}

/* What the items cost beyond the work itself, per thread, summed into COUNTERS at the region's
 * end: the items computed whose store another thread had claimed (work done twice), the phases
 * this thread waited on, and the time it waited (spinning, or redoing open items) */
typedef struct {
    int64_t dropped, waits, wait_ns;
} Waste;
static __thread Waste waste;
enum { C_REGIONS, C_THREAD_REGIONS, C_DROPPED, C_WAITS, C_WAIT_NS, C_COUNT };
static int64_t COUNTERS[C_COUNT];

/* 1: this thread stores item t of phase p, then calls stored(); 0: another thread does */
static inline int claim_store(Items *it, int64_t p, int64_t t) {
    uint8_t *s = &it->state[it->first[p] + t];
    uint8_t cur = __atomic_load_n(s, __ATOMIC_ACQUIRE);
    while (cur < 2)
        if (__atomic_compare_exchange_n(s, &cur, 2, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
            return 1;
    ++waste.dropped;
    return 0;
}

static inline void stored(Items *it, int64_t p, int64_t t, int me) {
    __atomic_store_n(&it->state[it->first[p] + t], 3, __ATOMIC_RELEASE);
    int64_t *done = &it->done[p * it->stride + me * LINE];
    __atomic_store_n(done, *done + 1, __ATOMIC_RELEASE); /* only this thread writes it */
}

static inline int phase_done(Items *it, int64_t p) {
    int64_t n = 0;
    for (int k = 0; k < it->nt; ++k)
        n += __atomic_load_n(&it->done[p * it->stride + k * LINE], __ATOMIC_ACQUIRE);
    return n >= it->count[p];
}

static inline int item_open(Items *it, int64_t p, int64_t t) {
    return __atomic_load_n(&it->state[it->first[p] + t], __ATOMIC_ACQUIRE) < 2;
}

/* Phase p on this thread: take items and do them (DO(t) computes item t and stores it if it
 * claims the store), then wait for the phase's last stores, redoing what is still open after
 * redo_after_ns. Uses `items`, `me` and `redo_after_ns` of the region. */
#define RUN_PHASE(p, DO)                                                          \
    do {                                                                          \
        for (int64_t t_; (t_ = take(&items, (p), me)) >= 0;) DO(t_);              \
        long since_ = 0, first_ = 0;                                              \
        for (int spins_ = 0; !phase_done(&items, (p));) {                         \
            cpu_relax();                                                          \
            if (++spins_ % 32) continue;                                          \
            const long now_ = now_ns();                                           \
            if (since_ == 0) since_ = first_ = now_;                              \
            if (now_ - since_ < redo_after_ns) continue;                          \
            for (int64_t t_ = 0; t_ < items.count[(p)]; ++t_)                     \
                if (item_open(&items, (p), t_)) DO(t_);                           \
            since_ = now_ns();                                                    \
        }                                                                         \
        if (since_) {                                                             \
            ++waste.waits;                                                        \
            waste.wait_ns += now_ns() - first_;                                   \
        }                                                                         \
    } while (0)

/* Tile t of y = x W^T (ADD: y += x W^T) over T <= DECODE_MAX_ROWS rows, as an item of phase p:
 * the tile's sums for every row (tile_sums_rows, the GEMV's own; at AVX-512 from OUTER_MIN_ROWS
 * rows tile_sums_outer, over x as this thread transposed it for the phase), then the store if
 * this thread claims it. */
static inline __attribute__((always_inline)) void gemv_item(
    const int Q8, const int ADD, const uint8_t *w, int64_t out_features, int64_t in_features,
    const float *x, int64_t x_stride, int rows, float *y, int64_t y_stride, Items *it,
    int64_t p, int64_t t, int me, Outer *o) {
    float tile[ROWS_MAX][TILE];
    int n;
#if ISA_LEVEL == 2
    if (rows >= OUTER_MIN_ROWS && outer_reserve(o, in_features)) { /* in: a multiple of QK */
        if (o->phase != p) {
            outer_transpose(x, x_stride, rows, in_features, o->buf);
            o->phase = p;
        }
        n = tile_sums_outer(Q8, w, out_features, in_features, o, rows, t, tile);
    } else
#endif
        n = tile_sums_rows(Q8, w, out_features, in_features, x, x_stride, rows, t, tile);
    (void)o;
    if (!claim_store(it, p, t)) return;
    tile_store(ADD, out_features, tile, rows, n, y, y_stride, t);
    stored(it, p, t, me);
}

static void gemv_item_kind(int q8, int add, const uint8_t *w, int64_t out_features,
                           int64_t in_features, const float *x, int64_t x_stride, int rows,
                           float *y, int64_t y_stride, Items *it, int64_t p, int64_t t, int me,
                           Outer *o) {
    if (q8 && add) gemv_item(1, 1, w, out_features, in_features, x, x_stride, rows, y, y_stride, it, p, t, me, o);
    else if (q8) gemv_item(1, 0, w, out_features, in_features, x, x_stride, rows, y, y_stride, it, p, t, me, o);
    else if (add) gemv_item(0, 1, w, out_features, in_features, x, x_stride, rows, y, y_stride, it, p, t, me, o);
    else gemv_item(0, 0, w, out_features, in_features, x, x_stride, rows, y, y_stride, it, p, t, me, o);
}

/* a `count`-float item computed into `local`, stored to `dst` if this thread claims it */
static inline void store_item(Items *it, int64_t p, int64_t t, const float *local, float *dst,
                              int64_t count, int me) {
    if (!claim_store(it, p, t)) return;
    memcpy(dst, local, sizeof(float) * (size_t)count);
    stored(it, p, t, me);
}

/* 0 on success; -1 a shape it does not take (head_dim > 256 or odd, more than 16 query heads a KV
 * head, a width not a multiple of 32, more than DECODE_MAX_ROWS tokens); -2 no memory for the
 * scores or the items' bookkeeping; -3 an index out of range (nothing written). `kv_half`: every
 * layer's K and V caches are fp16, else fp32. `redo_after_ns`:
 * how long a thread that has taken a phase's last item waits before it redoes the open ones. */
int decode_forward_f32(int32_t num_layers, const int64_t *layers, const int32_t *kinds,
                       int32_t hidden, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
                       int32_t ffn, float eps, float *x, int32_t T, const float *cos,
                       const float *sin, int32_t max_pos, const int64_t *positions,
                       const int64_t *slots, int64_t num_blocks, int32_t block_size,
                       int32_t kv_half, const int32_t *tables, int32_t num_seqs, int64_t table_stride,
                       const int32_t *seq_idx, const int32_t *ctx_len, float scale, float *work,
                       int32_t num_threads, int64_t redo_after_ns) {
    const int D = head_dim, H = num_heads, KVH = num_kv_heads, G = H / KVH;
    if (D > MAX_HEAD_DIM || D % 2 || G > MAX_GROUP || G * KVH != H || hidden % QK ||
        (H * D) % QK || ffn % QK || T < 1 || T > DECODE_MAX_ROWS)
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
    int nt_max = num_threads;
#ifdef _OPENMP
    if (nt_max < 1) nt_max = omp_get_max_threads();
#endif
    if (nt_max < 1) nt_max = 1;
    /* the items' bookkeeping (for up to nt_max threads) in one allocation, and their states */
    const int64_t num_phases = (int64_t)num_layers * PHASES_PER_LAYER;
    const int64_t stride = (int64_t)nt_max * LINE, n_next = num_phases * stride;
    const int64_t n_done = n_next;
    const size_t book_bytes = sizeof(int64_t) * (size_t)(n_next + n_done + 2 * num_phases);
    int64_t *book = aligned_alloc(64, (book_bytes + 63) / 64 * 64);
    if (book == NULL) return -2;
    Items items = {.nt = 1, .stride = stride, .next = book, .done = book + n_next,
                   .first = book + n_next + n_done, .count = book + n_next + n_done + num_phases,
                   .state = NULL};
#pragma omp parallel num_threads(num_threads)
    {
        const int me = omp_thread(), nt = omp_threads();
        /* (token, KV head) items share each key across the GQA group; with too few of them to
         * keep the threads even, (token, query head) items read each key once per head */
        const int per_head = T * KVH < 4 * nt;
        const int heads = per_head ? H : KVH, group = per_head ? 1 : G;
#pragma omp single
        {
            const int64_t per_layer[PHASES_PER_LAYER] = {
                T,                                 /* input norm: rows */
                num_tiles_of(qkv_size),            /* q, k, v */
                (int64_t)T * (H + KVH),            /* RoPE; K and V to their slots */
                (int64_t)T * heads,                /* attention */
                num_tiles_of(hidden),              /* o, added to x */
                T,                                 /* post-attention norm */
                num_tiles_of(2 * (int64_t)ffn),    /* gate and up */
                T,                                 /* silu(gate) * up */
                num_tiles_of(hidden),              /* down, added to x */
            };
            memset(book, 0, book_bytes);
            int64_t total = 0;
            for (int64_t q = 0; q < num_phases; ++q) {
                items.first[q] = total;
                items.count[q] = per_layer[q % PHASES_PER_LAYER];
                total += items.count[q];
            }
            items.nt = nt;
            items.state = calloc((size_t)total, 1);
            if (items.state == NULL) failed = 1;
        } /* (single's barrier: every thread sees the bookkeeping) */
        /* per thread: an item's scores [G, len], its keys' offsets [len], a row of x or act */
        const int row_len = ffn > hidden ? ffn : hidden;
        float *scores = (float *)malloc((sizeof(float) * G + sizeof(int64_t)) * (size_t)max_len +
                                        8 + sizeof(float) * (size_t)row_len);
        int64_t *offs = (int64_t *)(scores + (size_t)max_len * G + (max_len * G) % 2);
        float *row = (float *)(offs + max_len);
        float local[MAX_GROUP * MAX_HEAD_DIM]; /* a head's or a GQA group's values */
        static __thread Outer outer = {NULL, 0, -1}; /* kept across calls: the pool's threads stay */
        outer.phase = -1;
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
            void *k_cache = (void *)p[6], *v_cache = (void *)p[7];
            const int64_t kv_bytes = kv_half ? 2 : 4; /* an element of the caches */
            const int64_t ph = (int64_t)l * PHASES_PER_LAYER;
#define IN_NORM(r)                                                                \
    do {                                                                          \
        rms_norm_row(x + (r) * hidden, in_norm, hidden, eps, row);                \
        store_item(&items, ph, (r), row, h + (r) * hidden, hidden, me);           \
    } while (0)
            RUN_PHASE(ph, IN_NORM);
#define QKV(t) gemv_item_kind(kind[0], 0, w_qkv, qkv_size, hidden, h, hidden, T, qkv, qkv_size, \
                              &items, ph + 1, (t), me, &outer)
            RUN_PHASE(ph + 1, QKV);
#define ROPE(item)                                                                \
    do {                                                                          \
        const int r = (int)((item) / (H + KVH)), hd = (int)((item) % (H + KVH));  \
        float *qkv_row = qkv + (int64_t)r * qkv_size, *head = qkv_row + hd * D;   \
        memcpy(local, head, sizeof(float) * D);                                   \
        rope_head(local, cos + positions[r] * D, sin + positions[r] * D, D);      \
        if (claim_store(&items, ph + 2, (item))) {                                \
            memcpy(head, local, sizeof(float) * D);                               \
            if (hd >= H) {                                                        \
                const int kh = hd - H;                                            \
                const int64_t slot = slots[r] * kv_size + kh * D;                 \
                kv_store(k_cache, slot, local, D, kv_half);                       \
                kv_store(v_cache, slot, qkv_row + q_size + kv_size + kh * D, D, kv_half); \
            }                                                                     \
            stored(&items, ph + 2, (item), me);                                   \
        }                                                                         \
    } while (0)
            RUN_PHASE(ph + 2, ROPE);
#define ATTEND(item)                                                              \
    do {                                                                          \
        const int r = (int)((item) / heads), hq = (int)((item) % heads) * group;  \
        const int kh = hq / G;                                                    \
        const float *qh = qkv + (int64_t)r * qkv_size + hq * D;                  \
        const void *kc = (const char *)k_cache + kh * D * kv_bytes;               \
        const void *vc = (const char *)v_cache + kh * D * kv_bytes;               \
        const int32_t *table = tables + (int64_t)seq_idx[r] * table_stride;       \
        if (kv_half)                                                              \
            attend(qh, kc, vc, table, ctx_len[r], block_size, kv_size, D, group, scale, \
                   scores, offs, local, 1);                                       \
        else                                                                      \
            attend(qh, kc, vc, table, ctx_len[r], block_size, kv_size, D, group, scale, \
                   scores, offs, local, 0);                                       \
        store_item(&items, ph + 3, (item), local, att + (int64_t)r * q_size + hq * D, \
                   (int64_t)group * D, me);                                       \
    } while (0)
            RUN_PHASE(ph + 3, ATTEND);
#define O_PROJ(t) gemv_item_kind(kind[1], 1, w_o, hidden, q_size, att, q_size, T, x, hidden, \
                                 &items, ph + 4, (t), me, &outer)
            RUN_PHASE(ph + 4, O_PROJ);
#define POST_NORM(r)                                                              \
    do {                                                                          \
        rms_norm_row(x + (r) * hidden, post_norm, hidden, eps, row);              \
        store_item(&items, ph + 5, (r), row, h + (r) * hidden, hidden, me);       \
    } while (0)
            RUN_PHASE(ph + 5, POST_NORM);
#define GATE_UP(t) gemv_item_kind(kind[2], 0, w_gu, 2 * (int64_t)ffn, hidden, h, hidden, T, act, \
                                  2 * ffn, &items, ph + 6, (t), me, &outer)
            RUN_PHASE(ph + 6, GATE_UP);
#define SILU(r)                                                                   \
    do {                                                                          \
        float *a = act + (r) * 2 * ffn; /* into gate's half of the row */         \
        silu_mul(a, a + ffn, ffn, row);                                           \
        store_item(&items, ph + 7, (r), row, a, ffn, me);                         \
    } while (0)
            RUN_PHASE(ph + 7, SILU);
#define DOWN(t) gemv_item_kind(kind[3], 1, w_down, hidden, ffn, act, 2 * ffn, T, x, hidden, \
                               &items, ph + 8, (t), me, &outer)
            RUN_PHASE(ph + 8, DOWN);
        }
        free(scores);
        __atomic_add_fetch(&COUNTERS[C_THREAD_REGIONS], 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&COUNTERS[C_DROPPED], waste.dropped, __ATOMIC_RELAXED);
        __atomic_add_fetch(&COUNTERS[C_WAITS], waste.waits, __ATOMIC_RELAXED);
        __atomic_add_fetch(&COUNTERS[C_WAIT_NS], waste.wait_ns, __ATOMIC_RELAXED);
        waste = (Waste){0, 0, 0};
    }
    __atomic_add_fetch(&COUNTERS[C_REGIONS], 1, __ATOMIC_RELAXED);
    free(items.state);
    free(book);
    return failed ? -2 : 0;
}

/* The counters since the library loaded, into out[C_COUNT]: regions (calls), threads' regions,
 * items computed and dropped (another thread stored them first), phases waited on (past 32
 * pauses), and the nanoseconds those waits took. */
void decode_counters(int64_t *out) {
    for (int c = 0; c < C_COUNT; ++c) out[c] = __atomic_load_n(&COUNTERS[c], __ATOMIC_RELAXED);
}
