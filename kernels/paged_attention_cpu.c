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

/* Attention of one query token per sequence over its paged cache, float32.
 *
 * q, out: [num_seqs, num_heads, head_dim], contiguous.
 * page_table: [num_seqs, table_stride] int32; seq_lens: [num_seqs] int32 (>= 1).
 * sinks: NULL, or [num_heads] logits that join each head's softmax
 * denominator with no value of their own. window: 0, or the number of most
 * recent tokens each query sees (pages before them are not read).
 * The query heads that share a kv head are handled together, so each key and
 * value is read from the cache once per sequence and kv head, in place: no
 * gathered copy of the cache is made. Returns 0, or -1 when out of memory.
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
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(|| : failed)
    for (int64_t item = 0; item < items; ++item) {
        const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
        const int64_t seq_len = seq_lens[seq];
        const int64_t first = (window > 0 && seq_len > window) ? seq_len - window : 0;
        const int64_t len = seq_len - first;
        const int32_t *pages = page_table + seq * table_stride;
        const float *q_group = q + (seq * num_heads + kv_head * group) * head_dim;
        float *out_group = out + (seq * num_heads + kv_head * group) * head_dim;
        /* scores[g * len + t]: query head g of the group against token t; then its softmax weight. */
        float *scores = (float *)malloc(sizeof(float) * (size_t)(group * len + group));
        if (scores == NULL) {
            failed = 1;
            continue;
        }
        float *maxima = scores + group * len;
        for (int64_t g = 0; g < group; ++g) maxima[g] = sinks ? sinks[kv_head * group + g] : -INFINITY;
        for (int64_t t = 0; t < len; ++t) {
            const int64_t pos = first + t;
            const float *key = k_cache + pages[pos / page_size] * page_stride + (pos % page_size) * token_stride +
                               kv_head * head_stride;
            for (int64_t g = 0; g < group; ++g) {
                const float *qg = q_group + g * head_dim;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * key[d];
                dot *= scale;
                scores[g * len + t] = dot;
                if (dot > maxima[g]) maxima[g] = dot;
            }
        }
        for (int64_t g = 0; g < group; ++g) {
            float *weights = scores + g * len;
            float total = sinks ? expf(sinks[kv_head * group + g] - maxima[g]) : 0.f;
            for (int64_t t = 0; t < len; ++t) {
                weights[t] = expf(weights[t] - maxima[g]);
                total += weights[t];
            }
            const float inverse = 1.f / total;
            for (int64_t t = 0; t < len; ++t) weights[t] *= inverse;
            float *og = out_group + g * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) og[d] = 0.f;
        }
        for (int64_t t = 0; t < len; ++t) {
            const int64_t pos = first + t;
            const float *value = v_cache + pages[pos / page_size] * page_stride + (pos % page_size) * token_stride +
                                 kv_head * head_stride;
            for (int64_t g = 0; g < group; ++g) {
                const float weight = scores[g * len + t];
                float *og = out_group + g * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) og[d] += weight * value[d];
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
