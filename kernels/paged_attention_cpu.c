/* Native CPU kernels for rayturn's "cpu" backend (kernels/cpu_backend.py).
 *
 * Built once per host by kernels/native.py with the system C compiler and
 * loaded with ctypes; no Python or PyTorch headers are needed. Parallel loops
 * use OpenMP; inside a process that has imported PyTorch they run on
 * PyTorch's own OpenMP runtime (same soname), so the two share one pool of
 * threads.
 *
 * KV cache views follow kernels/backend.py: keys (or values) of one layer are
 * [num_pages, page_size, num_kv_heads, head_dim] with arbitrary page, token
 * and head strides and a unit stride along head_dim.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Sixteen floats as one value: one AVX-512 register, two AVX ones, four SSE or NEON ones. The
 * compiler lowers the arithmetic to whatever vector width the host has (-march=native). */
#define LANES 16
/* How many tokens ahead the value loop asks for the next row, and the score loop for the next block. */
#define PREFETCH_AHEAD 8
/* AVX without AVX-512 (AVX2 hosts): a sixteen-float vector is two registers there.
 * SUM_LANES: the lanes of the running sums of weighted_sum and prefill_rows, one register each. As
 * sixteen-float sums, GCC builds each scalar-times-vector product through the stack; eight-float sums
 * broadcast the scalar in a register instead. Lane for lane the same arithmetic, so the same result.
 * SUM_VECTORS: how many sixteen-float running sums weighted_sum keeps (more heads per pass over the
 * values, fewer passes): half the 32 zmm with AVX-512; with AVX all 16 ymm, two per sum (on Zen 1 faster
 * than half of them: a few operand spills cost less than another pass). Elsewhere (SSE, NEON; not
 * measured) as many as with AVX-512, as before AVX2 hosts were measured. */
#if defined(__AVX__) && !defined(__AVX512F__)
#define SUM_LANES 8
#define SUM_VECTORS 8
#else
#define SUM_LANES LANES
#define SUM_VECTORS 16
#endif
typedef float vf __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline vf load(const float *p)
{
    vf v;
    memcpy(&v, p, sizeof v); /* an unaligned vector load */
    return v;
}

/* Lane i holds i: compared with a count, it masks the lanes past a row's end. */
static const vi LANE_INDEX = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

/* Lane i of the result is the sum of the lanes of x[i]: sixteen horizontal sums in 15 adds. */
static inline vf sum_lanes16(const vf x[LANES])
{
    vf h[8], q[4], e[2];
    for (int i = 0; i < 8; ++i) /* [x lanes 0-7 + 8-15 | y lanes 0-7 + 8-15] */
        h[i] = SHUFFLE(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SHUFFLE(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; ++i) /* four items of four partial sums */
        q[i] = SHUFFLE(h[2 * i], h[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               SHUFFLE(h[2 * i], h[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; ++i) /* eight items of two */
        e[i] = SHUFFLE(q[2 * i], q[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               SHUFFLE(q[2 * i], q[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUFFLE(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUFFLE(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* The larger (smaller) of a and b, lane by lane; b where either is NaN. One instruction on AVX-512, a compare
 * and a blend elsewhere (DEFINE_MINMAX: for a float vector type V and the int vector type VI of its lanes). */
#define DEFINE_MINMAX(MAX, MIN, V, VI)                                                                         \
    static inline V MAX(V a, V b)                                                                              \
    {                                                                                                          \
        const VI greater = a > b;                                                                              \
        return (V)(((VI)a & greater) | ((VI)b & ~greater));                                                    \
    }                                                                                                          \
    static inline V MIN(V a, V b)                                                                              \
    {                                                                                                          \
        const VI less = a < b;                                                                                 \
        return (V)(((VI)a & less) | ((VI)b & ~less));                                                          \
    }
#if defined(__AVX512F__)
#include <immintrin.h>
static inline vf vmax(vf a, vf b) { return (vf)_mm512_max_ps((__m512)a, (__m512)b); }
static inline vf vmin(vf a, vf b) { return (vf)_mm512_min_ps((__m512)a, (__m512)b); }
#else
DEFINE_MINMAX(vmax, vmin, vf, vi)
#endif

/* exp(x) lane by lane, float32, within 2 ulp: Cephes' expf (x = n ln2 + r, |r| <= ln2 / 2, a degree-6
 * polynomial in r) in vector arithmetic. Below -87 it gives exp(-87) (1.6e-38), not a denormal or zero:
 * a softmax weight that small is lost against the row's largest, which is 1. Defined for a float vector
 * type V (int vector type VI of the same lanes) given its lane-wise MAX and MIN. */
#define DEFINE_VEXP(NAME, V, VI, MAX, MIN)                                                                    \
    static inline V NAME(V x)                                                                                  \
    {                                                                                                          \
        x = MIN(MAX(x, (V){0} - 87.0f), (V){0} + 88.0f);                                                       \
        /* n = round(x / ln2): adding and taking away 1.5 * 2^23 rounds to the nearest integer. */             \
        const V n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;                                   \
        const V r = x - n * 0.693359375f + n * 2.12194440e-4f;                                                \
        V p = r * 1.9875691500e-4f + 1.3981999507e-3f;                                                        \
        p = p * r + 8.3334519073e-3f;                                                                          \
        p = p * r + 4.1665795894e-2f;                                                                          \
        p = p * r + 1.6666665459e-1f;                                                                          \
        p = p * r + 5.0000001201e-1f;                                                                          \
        p = p * r * r + r + 1.0f;                                                                              \
        return TIMES_POW2(p, n);                                                                               \
    }
/* p * 2^n for whole n in [-126, 127]: the power of two built in the exponent bits (TIMES_POW2_BITS: for a
 * float vector type V and the int vector type VI of its lanes), or AVX-512's scalef, one instruction for the
 * same product. */
#define TIMES_POW2_BITS(NAME, V, VI)                                                                           \
    static inline V NAME(V p, V n)                                                                             \
    {                                                                                                          \
        const VI exponent = (__builtin_convertvector(n, VI) + 127) << 23;                                     \
        return p * (V)exponent;                                                                                \
    }
#if defined(__AVX512F__)
static inline vf times_pow2(vf p, vf n) { return (vf)_mm512_scalef_ps((__m512)p, (__m512)n); }
#else
TIMES_POW2_BITS(times_pow2, vf, vi)
#endif
#define TIMES_POW2 times_pow2
DEFINE_VEXP(vexp, vf, vi, vmax, vmin)
#undef TIMES_POW2

/* The largest and the sum of a vector's lanes, halving it four times. */
static inline float lane_max(vf v)
{
    vf w = SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    vi greater = w > v;
    v = (vf)(((vi)w & greater) | ((vi)v & ~greater));
    w = SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    greater = w > v;
    v = (vf)(((vi)w & greater) | ((vi)v & ~greater));
    w = SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    greater = w > v;
    v = (vf)(((vi)w & greater) | ((vi)v & ~greater));
    w = SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    greater = w > v;
    v = (vf)(((vi)w & greater) | ((vi)v & ~greater));
    return v[0];
}

static inline float lane_sum(vf v)
{
    v += SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return v[0];
}

/* The softmax numerators of a row in place, rows padded to whole vectors (padding lanes end as 0);
 * ``maximum`` is at least the row's largest. Returns the sum of the row's numerators. */
static inline float exp_row(float *row, int64_t len, float maximum)
{
    vf total = {0};
    for (int64_t t = 0; t < len; t += LANES) {
        vf e = vexp(load(row + t) - maximum);
        if (len - t < LANES) e = (vf)((vi)e & (LANE_INDEX < (int32_t)(len - t)));
        memcpy(row + t, &e, sizeof e);
        total += e;
    }
    return lane_sum(total);
}

/* Lane i: the dot product of x with y[i], both vectors * LANES long (a query row against LANES key rows,
 * an input row against LANES weight rows). Inlined with a constant ``vectors`` so x stays in registers. */
static inline __attribute__((always_inline)) vf dots16(const float *x, const float *const *y, int vectors)
{
    vf dots[LANES];
#if defined(__AVX512F__) || !defined(__AVX__)
    for (int i = 0; i < LANES; ++i) {
        vf acc = load(x) * load(y[i]);
        for (int b = 1; b < vectors; ++b) acc += load(x + b * LANES) * load(y[i] + b * LANES);
        dots[i] = acc;
    }
#else
    /* AVX without AVX-512: a sixteen-lane sum lives in two registers, but as one value GCC keeps it on the
     * stack through the loop (a store and reload per step). Two eight-lane halves stay in registers and
     * add up lane for lane as the sixteen-lane sum does, so the result is the same. */
    typedef float vh __attribute__((vector_size(LANES / 2 * sizeof(float))));
    for (int i = 0; i < LANES; ++i) {
        const float *row = y[i];
        vh lo, hi, a, b2;
        memcpy(&a, x, sizeof a);
        memcpy(&b2, row, sizeof b2);
        lo = a * b2;
        memcpy(&a, x + LANES / 2, sizeof a);
        memcpy(&b2, row + LANES / 2, sizeof b2);
        hi = a * b2;
        for (int b = 1; b < vectors; ++b) {
            memcpy(&a, x + b * LANES, sizeof a);
            memcpy(&b2, row + b * LANES, sizeof b2);
            lo += a * b2;
            memcpy(&a, x + b * LANES + LANES / 2, sizeof a);
            memcpy(&b2, row + b * LANES + LANES / 2, sizeof b2);
            hi += a * b2;
        }
        memcpy(&dots[i], &lo, sizeof lo);
        memcpy((char *)&dots[i] + sizeof lo, &hi, sizeof hi);
    }
#endif
    return sum_lanes16(dots);
}

/* SUM_LANES-float vectors (see SUM_LANES) and their lane-wise max and exp. */
typedef float vs __attribute__((vector_size(SUM_LANES * sizeof(float))));
typedef int32_t vsi __attribute__((vector_size(SUM_LANES * sizeof(int32_t))));
#if SUM_LANES == LANES
#define vmax_s vmax
#define vexp_s vexp
#else
DEFINE_MINMAX(vmax_s, vmin_s, vs, vsi)
TIMES_POW2_BITS(times_pow2_s, vs, vsi)
#define TIMES_POW2 times_pow2_s
DEFINE_VEXP(vexp_s, vs, vsi, vmax_s, vmin_s)
#undef TIMES_POW2
#endif
/* weight * v, the weight read from memory into every lane. With AVX (no AVX-512), GCC would load eight
 * weights as one vector and build each lane's broadcast with two shuffles, both on the one shuffle port of
 * many cores; a broadcast load takes a load port instead. The same product either way. */
#if SUM_LANES == 8 && defined(__AVX__)
#include <immintrin.h>
static inline vs splat_times(const float *weight, vs v) { return (vs)_mm256_broadcast_ss(weight) * v; }
#else
static inline vs splat_times(const float *weight, vs v) { return *weight * v; }
#endif

/* For ``heads`` query heads at once (rows of out and of weights, head_dim and weights_stride apart):
 * out_row[h] = scale[h] * sum over t of weights[h][t] * values(t), values(t) = v_cache + offsets[t].
 * Each value row is read once for all the heads; inlined with constant ``heads`` and ``vectors`` so the
 * heads * vectors sums stay in registers. */
static inline __attribute__((always_inline)) void weighted_sum(
    float *out, int64_t head_dim, const float *weights, int64_t weights_stride, const float *scale,
    const float *v_cache, const int64_t *offsets, int64_t len, int heads, int vectors)
{
    enum { PARTS = LANES / SUM_LANES };
    const int parts = vectors * PARTS;
    vs acc[4][8 * PARTS];
    for (int h = 0; h < heads; ++h)
        for (int b = 0; b < parts; ++b) acc[h][b] = (vs){0};
    for (int64_t t = 0; t < len; ++t) {
        const float *value = v_cache + offsets[t];
        if (t + PREFETCH_AHEAD < len)
            for (int b = 0; b < vectors; ++b) /* LANES floats are one 64-byte cache line */
                __builtin_prefetch(v_cache + offsets[t + PREFETCH_AHEAD] + b * LANES);
        for (int b = 0; b < parts; ++b) {
            vs v;
            memcpy(&v, value + b * SUM_LANES, sizeof v);
            for (int h = 0; h < heads; ++h) acc[h][b] += weights[h * weights_stride + t] * v;
        }
    }
    for (int h = 0; h < heads; ++h)
        for (int b = 0; b < parts; ++b) {
            const vs scaled = acc[h][b] * scale[h];
            memcpy(out + h * head_dim + b * SUM_LANES, &scaled, sizeof scaled);
        }
}

/* One (sequence, kv head) item, head_dim = vectors * LANES (vectors 1-8): the group's scores sixteen
 * tokens at a time, a softmax per query head, then the weighted values. offsets[t]: where token t's
 * key (and value) row starts; scores: group rows of len floats rounded up to whole vectors. */
static inline __attribute__((always_inline)) void attend_vectorised(
    const float *q_group, const float *k_cache, const float *v_cache, const int64_t *offsets, int64_t len,
    const float *sinks, int64_t group, float scale, float *scores, float *out_group, int vectors)
{
    const int64_t head_dim = (int64_t)vectors * LANES;
    const int64_t stride = (len + LANES - 1) / LANES * LANES; /* scores of one head: whole vectors */
    float *inverses = scores + group * stride;
    for (int64_t t0 = 0; t0 < len; t0 += LANES) {
        const int64_t n = len - t0 < LANES ? len - t0 : LANES;
        const float *keys[LANES];
        for (int64_t i = 0; i < LANES; ++i) keys[i] = k_cache + offsets[t0 + (i < n ? i : 0)];
        for (int64_t i = t0 + LANES; i < t0 + 2 * LANES && i < len; ++i)
            for (int b = 0; b < vectors; ++b) __builtin_prefetch(k_cache + offsets[i] + b * LANES);
        /* All sixteen lanes are stored: past the row's end they repeat a real score, so the maximum holds. */
        for (int64_t g = 0; g < group; ++g) {
            const vf s = dots16(q_group + g * head_dim, keys, vectors) * scale;
            memcpy(scores + g * stride + t0, &s, sizeof s);
        }
    }
    for (int64_t g = 0; g < group; ++g) {
        float *weights = scores + g * stride;
        vf maxima = load(weights);
        for (int64_t t = LANES; t < stride; t += LANES) {
            const vf row = load(weights + t);
            const vi greater = row > maxima;
            maxima = (vf)(((vi)row & greater) | ((vi)maxima & ~greater));
        }
        float maximum = lane_max(maxima);
        if (sinks && sinks[g] > maximum) maximum = sinks[g];
        float total = exp_row(weights, len, maximum);
        if (sinks) total += expf(sinks[g] - maximum);
        inverses[g] = 1.f / total;
    }
    /* As many heads per pass over the values as their sums fit in registers (SUM_VECTORS): each value row
     * is then read once per pass. */
    const int per_pass = 4 * vectors <= SUM_VECTORS ? 4 : 2 * vectors <= SUM_VECTORS ? 2 : 1;
    int64_t g = 0;
    for (; per_pass > 1 && g + per_pass <= group; g += per_pass) {
        if (per_pass == 4)
            weighted_sum(out_group + g * head_dim, head_dim, scores + g * stride, stride, inverses + g, v_cache,
                         offsets, len, 4, vectors);
        else
            weighted_sum(out_group + g * head_dim, head_dim, scores + g * stride, stride, inverses + g, v_cache,
                         offsets, len, 2, vectors);
    }
    for (; g < group; ++g)
        weighted_sum(out_group + g * head_dim, head_dim, scores + g * stride, stride, inverses + g, v_cache, offsets,
                     len, 1, vectors);
}

/* Any head_dim: one dot product per (query head, token), the scalar way. */
static void attend_generic(
    const float *q_group, const float *k_cache, const float *v_cache, const int64_t *offsets, int64_t len,
    const float *sinks, int64_t group, int64_t head_dim, float scale, float *scores, float *out_group)
{
    for (int64_t g = 0; g < group; ++g) {
        const float *qg = q_group + g * head_dim;
        float *weights = scores + g * len;
        float maximum = sinks ? sinks[g] : -INFINITY;
        for (int64_t t = 0; t < len; ++t) {
            const float *key = k_cache + offsets[t];
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * key[d];
            weights[t] = dot * scale;
            maximum = weights[t] > maximum ? weights[t] : maximum;
        }
        float total = sinks ? expf(sinks[g] - maximum) : 0.f;
        for (int64_t t = 0; t < len; ++t) {
            weights[t] = expf(weights[t] - maximum);
            total += weights[t];
        }
        const float inverse = 1.f / total;
        float *og = out_group + g * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) og[d] = 0.f;
        for (int64_t t = 0; t < len; ++t) {
            const float *value = v_cache + offsets[t];
            const float weight = weights[t] * inverse;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) og[d] += weight * value[d];
        }
    }
}

/* The vector width this library was built for, in bits (-march=native): 512 with AVX-512, 256 with AVX or
 * AVX2, else 128. The prefill kernel's tiles of sixteen query rows are made for AVX-512's 32 registers: with
 * 16 AVX2 registers they spill, and PyTorch's flash kernel is faster there (kernels/cpu_backend.py). */
int native_vector_bits(void)
{
#if defined(__AVX512F__)
    return 512;
#elif defined(__AVX__)
    return 256;
#else
    return 128;
#endif
}

/* Attention of one query token per sequence over its paged cache, float32.
 *
 * q, out: [num_seqs, num_heads, head_dim], contiguous.
 * page_table: [num_seqs, table_stride] int32; seq_lens: [num_seqs] int32 (>= 1).
 * sinks: NULL, or [num_heads] logits that join each head's softmax
 * denominator with no value of their own. window: 0, or the number of most
 * recent tokens each query sees (pages before them are not read).
 * The query heads that share a kv head are handled together, so each key and
 * value is read from the cache once per sequence and kv head, in place: no
 * gathered copy of the cache is made. Head dims that are a multiple of 16 up
 * to 128 take the vectorised path (sixteen dot products reduced at once, a
 * vectorised exp); others the scalar one. Returns 0, or -1 when out of memory.
 */
int paged_decode_attention_f32(
    const float *q, const float *k_cache, const float *v_cache,
    int64_t page_stride, int64_t token_stride, int64_t head_stride,
    const int32_t *page_table, int64_t table_stride, const int32_t *seq_lens,
    const float *sinks, int64_t window,
    float *out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t page_size, float scale, int num_threads)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t items = num_seqs * num_kv_heads;
    const int vectors = head_dim % LANES == 0 && head_dim <= 8 * LANES ? (int)(head_dim / LANES) : 0;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(|| : failed)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
        const int64_t seq_len = seq_lens[seq];
        const int64_t first = (window > 0 && seq_len > window) ? seq_len - window : 0;
        const int64_t len = seq_len - first;
        const int32_t *pages = page_table + seq * table_stride;
        /* scores[g * len + t]: query head g of the group against token t; then its softmax weight. */
        const int64_t padded = (len + LANES - 1) / LANES * LANES;
        int64_t *offsets =
            (int64_t *)malloc(sizeof(int64_t) * (size_t)len + sizeof(float) * (size_t)(group * padded + group));
        if (offsets == NULL) {
            failed = 1;
            continue;
        }
        float *scores = (float *)(offsets + len);
        for (int64_t t = 0, page = first / page_size, slot = first % page_size; t < len; ++t) {
            offsets[t] = pages[page] * page_stride + slot * token_stride + kv_head * head_stride;
            if (++slot == page_size) {
                slot = 0;
                ++page;
            }
        }
        const float *q_group = q + (seq * num_heads + kv_head * group) * head_dim;
        float *out_group = out + (seq * num_heads + kv_head * group) * head_dim;
        const float *group_sinks = sinks ? sinks + kv_head * group : NULL;
        switch (vectors) {
        case 1:
            attend_vectorised(q_group, k_cache, v_cache, offsets, len, group_sinks, group, scale, scores, out_group, 1);
            break;
        case 2:
            attend_vectorised(q_group, k_cache, v_cache, offsets, len, group_sinks, group, scale, scores, out_group, 2);
            break;
        case 4:
            attend_vectorised(q_group, k_cache, v_cache, offsets, len, group_sinks, group, scale, scores, out_group, 4);
            break;
        case 8:
            attend_vectorised(q_group, k_cache, v_cache, offsets, len, group_sinks, group, scale, scores, out_group, 8);
            break;
        case 0:
            attend_generic(q_group, k_cache, v_cache, offsets, len, group_sinks, group, head_dim, scale, scores,
                           out_group);
            break;
        default:
            attend_vectorised(q_group, k_cache, v_cache, offsets, len, group_sinks, group, scale, scores, out_group,
                              vectors);
        }
        free(offsets);
    }
    return failed ? -1 : 0;
}

/* Causal prefill attention of ROWS query rows (the heads of a GQA group at a few positions) over the
 * same kv head: keys copied key-major and padded to whole blocks (kc[key * head_dim + d]), values in place
 * (v_cache + offsets[key]). Row r is query q[r] and sees keys 0 .. visible[r] - 1. Online softmax over blocks
 * of ROWS keys, with the scores kept transposed: s[j] holds key k0 + j's score for every row (lane r: row r),
 * so a block's maxima, corrections and sums are lane-wise operations with no horizontal reduction, and the
 * scaled queries (transposed once into qt[d], lane r: row r) are read from one local array. Every key
 * block's loads serve all the rows. ROWS is the lanes of one register (SUM_LANES: sixteen with AVX-512,
 * eight with AVX), so a block's scores are ROWS registers. Inlined with constant ``vectors`` (head_dim /
 * LANES).
 *
 * One call runs the key blocks from k_begin (a multiple of ROWS) up to k_end or the last visible key. A call
 * that reaches the last writes out[r] (and *lse[r] where lse[r] is not NULL); one that stops short saves the
 * rows' running state in acc (ROWS rows of head_dim floats: the weighted values, then ROWS maxima and ROWS
 * totals) for the call that goes on from k_end. So a row's keys can be taken in chunks, each call doing the
 * same arithmetic in the same order as one call over them all. */
#define ROWS SUM_LANES
static inline __attribute__((always_inline)) void prefill_rows(
    const float *const *q, const int64_t *visible, const float *kc, const float *v_cache, const int64_t *offsets,
    float scale, int64_t k_begin, int64_t k_end, float *acc, float *const *out, float *const *lse, int vectors)
{
    enum { PARTS = LANES / SUM_LANES };
    const int64_t head_dim = (int64_t)vectors * LANES;
    const int parts = vectors * PARTS; /* registers per row of head_dim floats */
    float qt[8 * LANES * ROWS] __attribute__((aligned(64)));
    float weights[ROWS][ROWS] __attribute__((aligned(64)));
    float corrections[ROWS] __attribute__((aligned(64)));
    int32_t visible_lanes[ROWS];
    int64_t last = 0, first_partial = INT64_MAX;
    for (int r = 0; r < ROWS; ++r) {
        for (int64_t d = 0; d < head_dim; ++d) qt[d * ROWS + r] = q[r][d] * scale;
        visible_lanes[r] = (int32_t)visible[r];
        last = visible[r] > last ? visible[r] : last;
        first_partial = visible[r] < first_partial ? visible[r] : first_partial;
    }
    vsi seen_before;
    memcpy(&seen_before, visible_lanes, sizeof seen_before);
    const vs unseen = (vs){0} - INFINITY;
    vs maxima = unseen, totals = {0};
    vs sums_of[ROWS][8 * PARTS]; /* the weighted values */
    if (k_begin == 0)
        memset(sums_of, 0, sizeof sums_of);
    else {
        for (int r = 0; r < ROWS; ++r) memcpy(sums_of[r], acc + r * head_dim, sizeof(float) * (size_t)head_dim);
        memcpy(&maxima, acc + ROWS * head_dim, sizeof maxima);
        memcpy(&totals, acc + ROWS * head_dim + ROWS, sizeof totals);
    }
    const int64_t end = k_end < last ? k_end : last;
    for (int64_t k0 = k_begin; k0 < end; k0 += ROWS) {
        vs s[ROWS];
        for (int j = 0; j < ROWS; ++j) s[j] = (vs){0};
        const float *block = kc + k0 * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) {
            vs qd;
            memcpy(&qd, qt + d * ROWS, sizeof qd);
#pragma GCC unroll 16
            for (int j = 0; j < ROWS; ++j) s[j] += qd * block[j * head_dim + d];
        }
        /* Blocks that reach past some row's last visible key (the diagonal, the padding) are masked. */
        const int partial = k0 + ROWS > first_partial;
        if (partial)
            for (int j = 0; j < ROWS; ++j) {
                const vsi seen = ((vsi){0} + (int32_t)(k0 + j)) < seen_before;
                s[j] = (vs)(((vsi)s[j] & seen) | ((vsi)unseen & ~seen));
            }
        /* The block's maxima as a tree (log2(ROWS) dependent steps, not ROWS - 1). */
        vs halves[ROWS / 2];
        for (int j = 0; j < ROWS / 2; ++j) halves[j] = vmax_s(s[j], s[j + ROWS / 2]);
        for (int width = ROWS / 4; width > 0; width /= 2)
            for (int j = 0; j < width; ++j) halves[j] = vmax_s(halves[j], halves[j + width]);
        const vs block_max = halves[0];
        /* Every row sees key 0, so after the first block every maximum is finite; before it the
         * correction is vexp(-inf), ~1e-38, times sums of zero. */
        const vs current = vmax_s(maxima, block_max);
        /* Once a row's maximum stops growing (most blocks), its correction is exactly 1: skipped when no
         * row's maximum moved, with the same result (a NaN differs from everything, so it takes the path). */
        const vsi moved_lanes = current != maxima;
        int moved = 0;
        for (int r = 0; r < ROWS; ++r) moved |= moved_lanes[r];
        const vs correction = moved ? vexp_s(maxima - current) : (vs){0};
        maxima = current;
        vs sum = {0};
        for (int j = 0; j < ROWS; ++j) {
            vs e = vexp_s(s[j] - current);
            if (partial) e = (vs)((vsi)e & (((vsi){0} + (int32_t)(k0 + j)) < seen_before));
            sum += e;
            memcpy(weights[j], &e, sizeof e);
        }
        totals = moved ? totals * correction + sum : totals + sum;
        memcpy(corrections, &correction, sizeof correction);
        const int64_t keys = last - k0 < ROWS ? last - k0 : ROWS;
        for (int b = 0; b < parts; ++b) {
            vs sums[ROWS];
            if (moved)
                for (int r = 0; r < ROWS; ++r) sums[r] = sums_of[r][b] * corrections[r];
            else
                for (int r = 0; r < ROWS; ++r) sums[r] = sums_of[r][b];
            for (int64_t j = 0; j < keys; ++j) {
                vs v;
                memcpy(&v, v_cache + offsets[k0 + j] + b * SUM_LANES, sizeof v);
                for (int r = 0; r < ROWS; ++r) sums[r] += splat_times(&weights[j][r], v);
            }
            for (int r = 0; r < ROWS; ++r) sums_of[r][b] = sums[r];
        }
    }
    if (end < last) {
        for (int r = 0; r < ROWS; ++r) memcpy(acc + r * head_dim, sums_of[r], sizeof(float) * (size_t)head_dim);
        memcpy(acc + ROWS * head_dim, &maxima, sizeof maxima);
        memcpy(acc + ROWS * head_dim + ROWS, &totals, sizeof totals);
        return;
    }
    float row_totals[ROWS], row_maxima[ROWS];
    memcpy(row_totals, &totals, sizeof totals);
    memcpy(row_maxima, &maxima, sizeof maxima);
    for (int r = 0; r < ROWS; ++r) {
        const float inverse = 1.f / row_totals[r];
        for (int b = 0; b < parts; ++b) {
            const vs scaled = sums_of[r][b] * inverse;
            memcpy(out[r] + b * SUM_LANES, &scaled, sizeof scaled);
        }
        if (lse[r]) *lse[r] = row_maxima[r] + logf(row_totals[r]);
    }
}

/* prefill_rows with a constant ``vectors`` for each head_dim it takes. */
static inline __attribute__((always_inline)) void prefill_chunk(
    const float *const *q, const int64_t *visible, const float *kc, const float *v_cache, const int64_t *offsets,
    float scale, int64_t k_begin, int64_t k_end, float *acc, float *const *out, float *const *lse, int vectors)
{
    switch (vectors) {
    case 1:
        prefill_rows(q, visible, kc, v_cache, offsets, scale, k_begin, k_end, acc, out, lse, 1);
        break;
    case 2:
        prefill_rows(q, visible, kc, v_cache, offsets, scale, k_begin, k_end, acc, out, lse, 2);
        break;
    case 4:
        prefill_rows(q, visible, kc, v_cache, offsets, scale, k_begin, k_end, acc, out, lse, 4);
        break;
    case 8:
        prefill_rows(q, visible, kc, v_cache, offsets, scale, k_begin, k_end, acc, out, lse, 8);
        break;
    default:
        prefill_rows(q, visible, kc, v_cache, offsets, scale, k_begin, k_end, acc, out, lse, vectors);
    }
}

/* The keys and values of one kv head per chunk of the prefill kernel, in bytes: every work item of a wave
 * (below) runs over one chunk of its kv head's keys before any goes on to the next, so the chunk stays in the
 * core's L2 cache while the wave's query rows read it (1,024 keys at head_dim 64). */
#define PREFILL_CHUNK_BYTES (512 * 1024)
/* Work items per thread in one wave of the prefill kernel: the items go through the chunks a wave at a time,
 * so the running state kept between chunks is a wave's (not every item's of a long prompt), while each chunk
 * still serves this many items per thread once in cache. */
#define PREFILL_WAVE_ITEMS_PER_THREAD 32

/* Causal attention of one sequence's chunk of query_len queries after context_len cached keys, float32,
 * keys and values read from the paged cache (the chunk's own already written there).
 *
 * q, out: [query_len, num_heads, head_dim], contiguous; pages: the sequence's page ids (int32).
 * lse: NULL, or [num_heads, query_len]: each row's log-sum-exp of its scaled scores.
 * head_dim must be a multiple of 16 up to 128 (returns -2 otherwise). The keys are first copied
 * per kv head into one contiguous block of rows, so a block of sixteen keys' scores for sixteen query
 * rows is head_dim vector multiply-adds with the keys' elements broadcast; the query heads of a GQA group
 * at consecutive positions share those loads and the value rows, which are read in place. chunk_keys: about
 * how many keys per chunk (0: as many as PREFILL_CHUNK_BYTES hold); the result is the same for every chunk
 * size. Returns 0, -1 when out of memory, -2 for a head_dim it does not take. */
int paged_prefill_attention_f32(
    const float *q, const float *k_cache, const float *v_cache,
    int64_t page_stride, int64_t token_stride, int64_t head_stride,
    const int32_t *pages, int64_t context_len, int64_t query_len,
    float *out, float *lse, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t page_size, float scale, int64_t chunk_keys, int num_threads)
{
    if (head_dim % LANES != 0 || head_dim > 8 * LANES) return -2;
    const int vectors = (int)(head_dim / LANES);
    const int64_t group = num_heads / num_kv_heads;
    const int64_t num_keys = context_len + query_len;
    /* Whole blocks of LANES keys: a block's loads never leave the buffer (the padding keys are zeros). */
    const int64_t kc_rows = (num_keys + LANES - 1) / LANES * LANES;
    /* A work item: ROWS rows, the group's heads (up to four) at ROWS / heads consecutive positions. */
    const int64_t heads = group < 4 ? group : 4;
    const int64_t positions = ROWS / heads;
    const int64_t position_blocks = (query_len + positions - 1) / positions;
    const int64_t head_blocks = (group + heads - 1) / heads;
    const int64_t items = num_kv_heads * head_blocks * position_blocks;
    if (chunk_keys <= 0) chunk_keys = PREFILL_CHUNK_BYTES / (int64_t)(2 * sizeof(float) * (size_t)head_dim);
    /* The nearest whole number of chunks of about chunk_keys, equal, in whole blocks: a sequence a little
     * longer than one chunk is one, and no chunk is a short tail (each chunk costs a barrier per wave and a
     * save of each item's state). */
    const int64_t chunks = num_keys / chunk_keys + (num_keys % chunk_keys >= (chunk_keys + 1) / 2);
    chunk_keys = chunks > 1 ? ((num_keys + chunks - 1) / chunks + ROWS - 1) / ROWS * ROWS : num_keys;
    float *kc = (float *)malloc(sizeof(float) * (size_t)(num_kv_heads * kc_rows * head_dim));
    int64_t *offsets = (int64_t *)malloc(sizeof(int64_t) * (size_t)(num_kv_heads * num_keys));
    /* The running state of a wave's items between chunks (ROWS rows of head_dim sums, ROWS maxima, ROWS
     * totals each), where there is more than one chunk. */
    const int64_t wave = PREFILL_WAVE_ITEMS_PER_THREAD * (num_threads > 1 ? num_threads : 1);
    const int64_t state_floats = ROWS * (head_dim + 2);
    const int64_t states = items < wave ? items : wave;
    float *acc = num_keys > chunk_keys ? (float *)malloc(sizeof(float) * (size_t)(states * state_floats)) : NULL;
    if (kc == NULL || offsets == NULL || (acc == NULL && num_keys > chunk_keys)) {
        free(kc);
        free(offsets);
        free(acc);
        return -1;
    }
#pragma omp parallel for schedule(static) num_threads(num_threads) collapse(2)
    for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head)
        for (int64_t key = 0; key < num_keys; ++key) {
            const int64_t offset =
                pages[key / page_size] * page_stride + (key % page_size) * token_stride + kv_head * head_stride;
            offsets[kv_head * num_keys + key] = offset;
            memcpy(kc + (kv_head * kc_rows + key) * head_dim, k_cache + offset, sizeof(float) * (size_t)head_dim);
        }
    for (int64_t kv_head = 0; kv_head < num_kv_heads; ++kv_head) /* the padding keys: zeros (the rest is copied) */
        memset(kc + (kv_head * kc_rows + num_keys) * head_dim, 0,
               sizeof(float) * (size_t)((kc_rows - num_keys) * head_dim));
    const int64_t per_block = num_kv_heads * head_blocks; /* items per block of positions */
#pragma omp parallel num_threads(num_threads)
    {
        /* Wave by wave, chunk by chunk, a barrier between them; the items of the later positions (more keys)
         * first. A wave's first item holds its latest positions, so its last key is the wave's: later chunks
         * are not visited. An item whose rows see no key of a chunk has finished in an earlier one. */
        for (int64_t first = 0; first < items; first += wave) {
            const int64_t wave_end = first + wave < items ? first + wave : items;
            const int64_t block_end = (position_blocks - first / per_block) * positions;
            const int64_t wave_keys = context_len + (block_end < query_len ? block_end : query_len);
            for (int64_t k_begin = 0; k_begin < wave_keys; k_begin += chunk_keys) {
#pragma omp for schedule(dynamic, 1)
                for (int64_t item = first; item < wave_end; ++item) {
                    const int64_t kv_item = item % per_block, kv_head = kv_item / head_blocks;
                    const int64_t first_head = kv_head * group + kv_item % head_blocks * heads;
                    const int64_t first_position = (position_blocks - 1 - item / per_block) * positions;
                    const float *q_rows[ROWS];
                    float *out_rows[ROWS], *lse_rows[ROWS], spare[ROWS][8 * LANES], spare_lse[ROWS];
                    int64_t visible[ROWS], last = 0;
                    for (int r = 0; r < ROWS; ++r) {
                        /* Rows past the chunk's end or the group's last head repeat a real row into spare space. */
                        int64_t position = first_position + r / heads, head = first_head + r % heads;
                        const int real = r < positions * heads && position < query_len && head < (kv_head + 1) * group;
                        if (!real) {
                            position = first_position;
                            head = first_head;
                        }
                        q_rows[r] = q + (position * num_heads + head) * head_dim;
                        out_rows[r] = real ? out + (position * num_heads + head) * head_dim : spare[r];
                        lse_rows[r] = !real ? spare_lse + r : (lse ? lse + head * query_len + position : NULL);
                        visible[r] = context_len + position + 1;
                        last = visible[r] > last ? visible[r] : last;
                    }
                    if (k_begin >= last) continue;
                    const float *kc_head = kc + kv_head * kc_rows * head_dim;
                    const int64_t *head_offsets = offsets + kv_head * num_keys;
                    float *state = acc ? acc + (item - first) * state_floats : NULL;
                    prefill_chunk(q_rows, visible, kc_head, v_cache, head_offsets, scale, k_begin,
                                  k_begin + chunk_keys, state, out_rows, lse_rows, vectors);
                }
            }
        }
    }
    free(kc);
    free(offsets);
    free(acc);
    return 0;
}

/* out[r] = rows[r] @ weight[e]^T for each expert e's rows (group_ends[e - 1] .. group_ends[e] - 1), float32.
 *
 * rows: [num_rows, in_features]; weight: [num_experts, out_features, in_features]; out: [num_rows,
 * out_features]; all contiguous, in_features a multiple of 16 (returns -2 otherwise). Made for the few
 * rows per expert of a decode step: an expert with no rows is not read, and one with a handful reads its
 * weight once, sixteen outputs at a time (sixteen dot products reduced together), the work split over
 * (expert, block of outputs). Returns 0. */
int grouped_matmul_f32(const float *rows, const float *weight, const int64_t *group_ends, float *out,
                       int64_t num_experts, int64_t out_features, int64_t in_features, int num_threads)
{
    if (in_features % LANES != 0) return -2;
    const int vectors = (int)(in_features / LANES);
    const int64_t per_item = 4 * LANES; /* outputs per work item */
    const int64_t blocks = (out_features + per_item - 1) / per_item;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) collapse(2)
    for (int64_t expert = 0; expert < num_experts; ++expert)
        for (int64_t block = 0; block < blocks; ++block) {
            const int64_t first_row = expert ? group_ends[expert - 1] : 0, end_row = group_ends[expert];
            if (first_row == end_row) continue;
            const float *w = weight + expert * out_features * in_features;
            const int64_t first = block * per_item;
            const int64_t end = first + per_item < out_features ? first + per_item : out_features;
            for (int64_t o0 = first; o0 < end; o0 += LANES) {
                const int64_t n = end - o0 < LANES ? end - o0 : LANES;
                const float *w_rows[LANES];
                for (int64_t i = 0; i < LANES; ++i) w_rows[i] = w + (o0 + (i < n ? i : 0)) * in_features;
                for (int64_t r = first_row; r < end_row; ++r) {
                    const vf sums = dots16(rows + r * in_features, w_rows, vectors);
                    memcpy(out + r * out_features + o0, &sums, sizeof(float) * (size_t)n);
                }
            }
        }
    return 0;
}

/* Neox-style rotary embedding (rotate halves) of one tensor into a new contiguous one, float32:
 * out[t, h, i] = x1 * cos - x2 * sin and out[t, h, i + half] = x2 * cos + x1 * sin, with x1 = x[t, h, i],
 * x2 = x[t, h, i + half], cos = cos_sin[p, i], sin = cos_sin[p, half + i], p = positions[t].
 * x: [num_tokens, num_heads, head_dim] with the given token and head strides and a unit stride along
 * head_dim; cos_sin: [max_positions, head_dim] contiguous. Returns 0, or -1 for a position outside
 * 0 .. max_positions - 1 (nothing is read from it). */
int rotary_neox_f32(const float *x, int64_t token_stride, int64_t head_stride, float *out, const int64_t *positions,
                    const float *cos_sin, int64_t max_positions, int64_t num_tokens, int64_t num_heads,
                    int64_t head_dim, int num_threads)
{
    const int64_t half = head_dim / 2;
    int failed = 0;
#pragma omp parallel for schedule(static) num_threads(num_threads) reduction(|| : failed)
    for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t position = positions[t];
        if (position < 0 || position >= max_positions) {
            failed = 1;
            continue;
        }
        const float *cos_row = cos_sin + position * head_dim, *sin_row = cos_row + half;
        for (int64_t h = 0; h < num_heads; ++h) {
            const float *row = x + t * token_stride + h * head_stride;
            float *dst = out + (t * num_heads + h) * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = row[i], x2 = row[half + i];
                dst[i] = x1 * cos_row[i] - x2 * sin_row[i];
                dst[half + i] = x2 * cos_row[i] + x1 * sin_row[i];
            }
        }
    }
    return failed ? -1 : 0;
}

/* Functions marked EXACT round each product on its own, as PyTorch does, where -ffp-contract=fast would fuse a
 * product into the add that follows it: their results are bit for bit PyTorch's. */
#if defined(__clang__)
#define EXACT
#define EXACT_BODY _Pragma("clang fp contract(off)")
#else
#define EXACT __attribute__((optimize("fp-contract=off")))
#define EXACT_BODY
#endif

/* sum(x[i] * x[i]) in the order of PyTorch's float32 sum over a contiguous row (ATen's cascade sum), for
 * PyTorch's vector width of `lanes` floats: the row is read as `lanes`-float vectors, vector i * 4 + k
 * joining running sum k; every 16 steps the running sums move up one of four levels (a cascade: only sums
 * of like size meet), the levels join at the end, then the vectors past a multiple of four, then running
 * sums 1-3 join sum 0; the floats past the last whole vector are summed from zero, and sum 0's lanes join
 * them in order. */
static inline __attribute__((always_inline)) EXACT float torch_sum_of_squares(const float *x, int64_t dim,
                                                                              const int lanes)
{
    EXACT_BODY
    enum { LEVELS = 4, ILP = 4, MAX_WIDTH = ILP * 16 };
    /* Four running sums of `lanes` floats side by side: one step adds a group of four consecutive vectors. */
    const int width = ILP * lanes;
    float acc[LEVELS][MAX_WIDTH];
    for (int m = 0; m < width; ++m) acc[0][m] = 0.0f;
    int levels = 1; /* levels in use; the others are zero, and adding zero to these non-negative sums is exact */
    const int64_t vectors = dim / lanes, groups = vectors / ILP;
    int level_power = 4;
    if (groups > 2) {
        int bits = 0;
        for (int64_t n = groups - 1; n; n >>= 1) ++bits; /* ceil(log2(groups)) */
        if (bits / LEVELS > level_power) level_power = bits / LEVELS;
    }
    const int64_t step = (int64_t)1 << level_power, mask = step - 1;
    int64_t i = 0;
    while (i + step <= groups) {
        for (int64_t j = 0; j < step; ++j, ++i) {
            const float *v = x + i * width;
            for (int m = 0; m < width; ++m) acc[0][m] += v[m] * v[m];
        }
        for (int j = 1; j < LEVELS; ++j) {
            if (j == levels) {
                for (int m = 0; m < width; ++m) acc[j][m] = 0.0f;
                ++levels;
            }
            for (int m = 0; m < width; ++m) {
                acc[j][m] += acc[j - 1][m];
                acc[j - 1][m] = 0.0f;
            }
            if (i & (mask << (j * level_power))) break;
        }
    }
    for (; i < groups; ++i) {
        const float *v = x + i * width;
        for (int m = 0; m < width; ++m) acc[0][m] += v[m] * v[m];
    }
    for (int j = 1; j < levels; ++j)
        for (int m = 0; m < width; ++m) acc[0][m] += acc[j][m];
    for (int64_t v = groups * ILP; v < vectors; ++v)
        for (int l = 0; l < lanes; ++l) acc[0][l] += x[v * lanes + l] * x[v * lanes + l];
    for (int k = 1; k < ILP; ++k)
        for (int l = 0; l < lanes; ++l) acc[0][l] += acc[0][k * lanes + l];
    float total = 0.0f;
    for (int64_t e = vectors * lanes; e < dim; ++e) total += x[e] * x[e];
    for (int l = 0; l < lanes; ++l) total += acc[0][l];
    return total;
}

static inline __attribute__((always_inline)) EXACT void rms_norm_row(const float *x, const float *weight, float *out,
                                                                     int64_t dim, float eps, const int lanes)
{
    EXACT_BODY
    const float inverse = 1.0f / sqrtf(torch_sum_of_squares(x, dim, lanes) / (float)dim + eps);
    for (int64_t i = 0; i < dim; ++i) out[i] = (x[i] * inverse) * weight[i];
}

/* RMS norm of float32 rows, bit for bit PyTorch's rms_norm for PyTorch's vector width of `lanes` floats (8 with
 * AVX2, and on AVX-512 hosts, where PyTorch's sum runs its AVX2 build; 16 for an AVX-512 sum):
 * out[r] = x[r] * (1 / sqrt(mean(x[r]^2) + eps)) * weight, the mean summed as torch_sum_of_squares does.
 * x: num_rows rows of dim floats (a unit stride), in groups of group_rows rows (a token's heads), row_stride
 * apart within a group and group_stride between groups; out contiguous. Returns 0, or -1 for lanes other than
 * 4, 8 or 16. */
EXACT int rms_norm_f32(const float *x, int64_t group_stride, int64_t group_rows, int64_t row_stride,
                       const float *weight, float *out, int64_t num_rows, int64_t dim, float eps, int lanes,
                       int num_threads)
{
    if (lanes != 4 && lanes != 8 && lanes != 16) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < num_rows; ++r) {
        const float *row = x + (r / group_rows) * group_stride + (r % group_rows) * row_stride;
        float *dst = out + r * dim;
        if (lanes == 8)
            rms_norm_row(row, weight, dst, dim, eps, 8);
        else if (lanes == 16)
            rms_norm_row(row, weight, dst, dim, eps, 16);
        else
            rms_norm_row(row, weight, dst, dim, eps, 4);
    }
    return 0;
}

/* Mixture-of-experts token permutation: the flat (token, slot) choices of expert_ids ([num_tokens, top_k])
 * grouped by expert, token order kept within each (a stable counting sort), and row r of `rows` a copy of the
 * hidden state of the token that choice r came from (x: num_tokens rows of hidden floats, x_stride apart).
 * Writes group_sizes[num_experts] and slot_index[num_tokens * top_k] (the flat choice behind each row).
 * Returns 0, -1 for an expert id outside 0 .. num_experts - 1, -2 when out of memory. */
int moe_permute_f32(const float *x, int64_t x_stride, const int64_t *expert_ids, int64_t num_tokens, int64_t top_k,
                    int64_t num_experts, int64_t hidden, int64_t *group_sizes, int64_t *slot_index, float *rows,
                    int num_threads)
{
    const int64_t choices = num_tokens * top_k;
    memset(group_sizes, 0, sizeof(int64_t) * (size_t)num_experts);
    for (int64_t f = 0; f < choices; ++f) {
        if (expert_ids[f] < 0 || expert_ids[f] >= num_experts) return -1;
        ++group_sizes[expert_ids[f]];
    }
    int64_t *next = malloc(sizeof(int64_t) * (size_t)(num_experts ? num_experts : 1));
    if (!next) return -2;
    for (int64_t e = 0, start = 0; e < num_experts; start += group_sizes[e++]) next[e] = start;
    for (int64_t f = 0; f < choices; ++f) slot_index[next[expert_ids[f]]++] = f;
    free(next);
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t r = 0; r < choices; ++r)
        memcpy(rows + r * hidden, x + (slot_index[r] / top_k) * x_stride, sizeof(float) * (size_t)hidden);
    return 0;
}

/* Mixture-of-experts un-permutation: out[t] = the sum, over token t's rows of expert_out in their grouped
 * order, of weights[choice] * row, summed from zero with each product rounded first (bit for bit PyTorch's
 * index_add_ of the weighted rows). slot_index as moe_permute_f32 wrote it; weights: [num_tokens, top_k];
 * expert_out: [num_tokens * top_k, hidden]; out: [num_tokens, hidden]; all contiguous. Returns 0, -2 when out
 * of memory. */
EXACT int moe_unpermute_f32(const float *expert_out, const int64_t *slot_index, const float *weights,
                            int64_t num_tokens, int64_t top_k, int64_t hidden, float *out, int num_threads)
{
    EXACT_BODY
    const int64_t choices = num_tokens * top_k;
    int64_t *row_of = malloc(sizeof(int64_t) * (size_t)(choices ? choices : 1));
    if (!row_of) return -2;
    for (int64_t r = 0; r < choices; ++r) row_of[slot_index[r]] = r;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(|| : failed)
    {
        int64_t *order = malloc(sizeof(int64_t) * (size_t)(top_k ? top_k : 1));
        if (!order) failed = 1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tokens; ++t) {
            if (!order) continue;
            for (int64_t j = 0; j < top_k; ++j) { /* this token's rows, in grouped order (insertion sort) */
                int64_t i = j;
                for (; i > 0 && row_of[order[i - 1]] > row_of[t * top_k + j]; --i) order[i] = order[i - 1];
                order[i] = t * top_k + j;
            }
            float *dst = out + t * hidden;
            memset(dst, 0, sizeof(float) * (size_t)hidden);
            for (int64_t j = 0; j < top_k; ++j) {
                const float w = weights[order[j]];
                const float *row = expert_out + row_of[order[j]] * hidden;
                for (int64_t h = 0; h < hidden; ++h) dst[h] += row[h] * w;
            }
        }
        free(order);
    }
    free(row_of);
    return failed ? -2 : 0;
}
