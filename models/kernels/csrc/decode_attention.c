/* Paged decode attention for CPU tensors: one query token per sequence.
 *
 * The contract is `models/kernels/paged_attention.py`'s, for fp32 and bf16:
 *
 *   q            [B, heads, dim]                  contiguous
 *   key/value    [blocks, block_size, kv_heads, dim], any strides, dim contiguous
 *   block_tables [B, max_blocks] int64, row stride `table_stride`
 *   seq_lens     [B] int64: keys to attend to, the current token included
 *   out          [B, heads, dim]                  contiguous, q's dtype
 *
 * Keys are read in place through the block table (no gather copy). One work
 * item is a (sequence, kv head) pair; it serves the kv head's whole group of
 * query heads, so each key and value row is loaded and widened to fp32 once.
 * Scores and the softmax are fp32 (two passes: scores, then max/exp/sum, then
 * the weighted sum of values), as the plain-torch reference computes them.
 *
 * A sliding window (`window` > 0) keeps the last `window` keys; a sequence
 * with no keys writes zeros. Work items are split over `threads` POSIX
 * threads (the caller's thread included) by a shared atomic counter.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 64
#define MAX_DIM 512

static inline float bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } x;
    x.u = ((uint32_t)v) << 16;
    return x.f;
}

static inline uint16_t f32_to_bf16(float f) {
    /* Round to nearest even, as torch rounds float -> bfloat16 (NaN stays NaN). */
    union { uint32_t u; float f; } x;
    x.f = f;
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40);
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

typedef struct {
    int is_bf16;
    const void *q, *key, *value;
    int64_t s_block, s_offset, s_head; /* cache strides, elements */
    const int64_t *tables;
    int64_t table_stride;
    const int64_t *seq_lens;
    void *out;
    int batch, heads, kv_heads, dim, block_size, window;
    float scale;
    int64_t max_len;
    int64_t next; /* work counter, atomic */
} Job;

static inline void load_row(const Job *job, const void *base, int64_t index, float *dst) {
    if (job->is_bf16) {
        const uint16_t *src = (const uint16_t *)base + index;
        for (int d = 0; d < job->dim; d++) dst[d] = bf16_to_f32(src[d]);
    } else {
        memcpy(dst, (const float *)base + index, sizeof(float) * (size_t)job->dim);
    }
}

static inline void store_row(const Job *job, int64_t index, const float *src) {
    if (job->is_bf16) {
        uint16_t *dst = (uint16_t *)job->out + index;
        for (int d = 0; d < job->dim; d++) dst[d] = f32_to_bf16(src[d]);
    } else {
        memcpy((float *)job->out + index, src, sizeof(float) * (size_t)job->dim);
    }
}

static inline int64_t cache_index(const Job *job, int64_t seq, int64_t pos, int kv_head) {
    int64_t block = job->tables[seq * job->table_stride + pos / job->block_size];
    return block * job->s_block + (pos % job->block_size) * job->s_offset + kv_head * job->s_head;
}

static void run_item(const Job *job, int64_t item, float *scores) {
    const int group = job->heads / job->kv_heads, dim = job->dim;
    const int64_t seq = item / job->kv_heads;
    const int kv_head = (int)(item % job->kv_heads);
    const int64_t len = job->seq_lens[seq];
    const int64_t start = (job->window > 0 && len > job->window) ? len - job->window : 0;
    const int64_t n = len > start ? len - start : 0;
    float query[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM], row[MAX_DIM];
    const int64_t q_base = (seq * job->heads + (int64_t)kv_head * group) * dim;

    for (int g = 0; g < group; g++) {
        load_row(job, job->q, q_base + (int64_t)g * dim, query[g]);
        for (int d = 0; d < dim; d++) acc[g][d] = 0.0f;
    }
    for (int64_t t = 0; t < n; t++) { /* scores[g * n + t] = scale * q_g . k_t */
        load_row(job, job->key, cache_index(job, seq, start + t, kv_head), row);
        for (int g = 0; g < group; g++) {
            float dot = 0.0f;
            for (int d = 0; d < dim; d++) dot += query[g][d] * row[d];
            scores[g * n + t] = dot * job->scale;
        }
    }
    for (int g = 0; g < group; g++) { /* softmax per query head */
        float *s = scores + g * n, peak = -INFINITY, total = 0.0f;
        for (int64_t t = 0; t < n; t++) peak = s[t] > peak ? s[t] : peak;
        for (int64_t t = 0; t < n; t++) {
            s[t] = expf(s[t] - peak);
            total += s[t];
        }
        const float inv = 1.0f / total;
        for (int64_t t = 0; t < n; t++) s[t] *= inv;
    }
    for (int64_t t = 0; t < n; t++) {
        load_row(job, job->value, cache_index(job, seq, start + t, kv_head), row);
        for (int g = 0; g < group; g++) {
            const float p = scores[g * n + t];
            for (int d = 0; d < dim; d++) acc[g][d] += p * row[d];
        }
    }
    for (int g = 0; g < group; g++) store_row(job, q_base + (int64_t)g * dim, acc[g]);
}

static void *run_items(void *arg) {
    Job *job = (Job *)arg;
    const int64_t items = (int64_t)job->batch * job->kv_heads;
    const int group = job->heads / job->kv_heads;
    float *scores = malloc(sizeof(float) * (size_t)(group * (job->max_len > 0 ? job->max_len : 1)));
    if (scores == NULL) return (void *)1;
    for (;;) {
        int64_t item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (item >= items) break;
        run_item(job, item, scores);
    }
    free(scores);
    return NULL;
}

/* Returns 0 on success; 1 when the shapes exceed the kernel's fixed limits
 * (group > MAX_GROUP or dim > MAX_DIM); 2 when memory or threads ran out. */
int paged_decode_attention(int is_bf16, const void *q, const void *key, const void *value,
                           int64_t s_block, int64_t s_offset, int64_t s_head,
                           const int64_t *tables, int64_t table_stride, const int64_t *seq_lens,
                           void *out, int batch, int heads, int kv_heads, int dim,
                           int block_size, int window, float scale, int threads) {
    if (kv_heads <= 0 || heads % kv_heads != 0 || heads / kv_heads > MAX_GROUP || dim > MAX_DIM)
        return 1;
    Job job = {is_bf16, q, key, value, s_block, s_offset, s_head, tables, table_stride,
               seq_lens, out, batch, heads, kv_heads, dim, block_size, window, scale, 0, 0};
    for (int b = 0; b < batch; b++) job.max_len = seq_lens[b] > job.max_len ? seq_lens[b] : job.max_len;
    const int64_t items = (int64_t)batch * kv_heads;
    int helpers = threads - 1;
    if (helpers > items - 1) helpers = (int)(items - 1);
    if (helpers > 63) helpers = 63;
    pthread_t pool[63];
    int started = 0, failed = 0;
    for (; started < helpers; started++)
        if (pthread_create(&pool[started], NULL, run_items, &job) != 0) break;
    if (run_items(&job) != NULL) failed = 1;
    for (int i = 0; i < started; i++) {
        void *status = NULL;
        pthread_join(pool[i], &status);
        if (status != NULL) failed = 1;
    }
    return failed ? 2 : 0;
}
