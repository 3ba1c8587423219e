/* Rotary embedding of Q and K, then K and V written into the paged cache, for
 * CPU tensors in fp32 or bf16: what a Llama-style attention layer does
 * between its QKV projection and attention, in one pass per token.
 *
 *   qkv    [T, heads + 2 * kv_heads, dim]   token stride `qkv_stride`, heads
 *                                           contiguous; rotated in place
 *   cos, sin [T, rot_dim]                   token stride `cs_stride`
 *   caches [blocks, block_size, kv_heads, dim], any strides, dim contiguous
 *   slots  [T] int64: block * block_size + offset (a negative slot is skipped)
 *
 * The first `rot_dim` values of each Q/K head rotate as the reference models
 * rotate them ("rotate half"):
 *
 *   out[:h] = x[:h] * cos[:h] - x[h:] * sin[:h]
 *   out[h:] = x[h:] * cos[h:] + x[:h] * sin[h:]        h = rot_dim / 2
 *
 * each product and the sum rounded to the dtype, as torch's separate ops
 * round them. Tokens are independent; many are split over `threads` threads (see parallel.h).
 */
#include "bf16.h"
#include "parallel.h"
#include <stdint.h>

#define TOKENS_PER_CHUNK 16

static inline float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

typedef struct {
    int is_bf16;
    void *qkv;
    int64_t qkv_stride;
    int tokens, heads, kv_heads, dim, rot_dim;
    const void *cos, *sin;
    int64_t cs_stride;
    void *key_cache, *value_cache;
    int64_t s_block, s_offset, s_head;
    const int64_t *slots;
    int block_size;
    int64_t next; /* first token of the next chunk, atomic */
} Job;

static void rotate_head_bf16(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int half) {
    float lo[512], hi[512];
    for (int i = 0; i < half; i++) {
        lo[i] = bf16_to_f32(x[i]);
        hi[i] = bf16_to_f32(x[i + half]);
    }
    for (int i = 0; i < half; i++) {
        const float a = round_bf16(lo[i] * bf16_to_f32(cos[i]));
        const float b = round_bf16(-hi[i] * bf16_to_f32(sin[i]));
        const float c = round_bf16(hi[i] * bf16_to_f32(cos[half + i]));
        const float d = round_bf16(lo[i] * bf16_to_f32(sin[half + i]));
        x[i] = f32_to_bf16(a + b);
        x[i + half] = f32_to_bf16(c + d);
    }
}

static void rotate_head_f32(float *x, const float *cos, const float *sin, int half) {
    float lo[512], hi[512];
    for (int i = 0; i < half; i++) {
        lo[i] = x[i];
        hi[i] = x[i + half];
    }
    for (int i = 0; i < half; i++) {
        x[i] = lo[i] * cos[i] + -hi[i] * sin[i];
        x[i + half] = hi[i] * cos[half + i] + lo[i] * sin[half + i];
    }
}

static void rotate_head(const Job *job, int64_t at, int64_t t) {
    const int half = job->rot_dim / 2;
    const int64_t cs = t * job->cs_stride;
    if (job->is_bf16)
        rotate_head_bf16((uint16_t *)job->qkv + at, (const uint16_t *)job->cos + cs,
                         (const uint16_t *)job->sin + cs, half);
    else
        rotate_head_f32((float *)job->qkv + at, (const float *)job->cos + cs,
                        (const float *)job->sin + cs, half);
}

static void copy_row(int is_bf16, const void *src, int64_t from, void *dst, int64_t to, int n) {
    if (is_bf16) {
        const uint16_t *s = (const uint16_t *)src + from;
        uint16_t *d = (uint16_t *)dst + to;
        for (int i = 0; i < n; i++) d[i] = s[i];
    } else {
        const float *s = (const float *)src + from;
        float *d = (float *)dst + to;
        for (int i = 0; i < n; i++) d[i] = s[i];
    }
}

static void run_token(const Job *job, int64_t t) {
    const int dim = job->dim, kv_heads = job->kv_heads, heads = job->heads;
    const int64_t row = t * job->qkv_stride;
    for (int h = 0; h < heads + kv_heads; h++) rotate_head(job, row + (int64_t)h * dim, t);
    const int64_t slot = job->slots[t];
    if (slot < 0) return;
    const int64_t base = (slot / job->block_size) * job->s_block + (slot % job->block_size) * job->s_offset;
    for (int h = 0; h < kv_heads; h++) {
        const int64_t k_at = row + (int64_t)(heads + h) * dim;
        const int64_t v_at = row + (int64_t)(heads + kv_heads + h) * dim;
        copy_row(job->is_bf16, job->qkv, k_at, job->key_cache, base + h * job->s_head, dim);
        copy_row(job->is_bf16, job->qkv, v_at, job->value_cache, base + h * job->s_head, dim);
    }
}

static void *run_tokens(void *arg) {
    Job *job = (Job *)arg;
    int64_t first, last;
    while (claim_chunk(&job->next, job->tokens, TOKENS_PER_CHUNK, &first, &last))
        for (int64_t t = first; t < last; t++) run_token(job, t);
    return NULL;
}

/* Returns 1 when rot_dim is odd, larger than dim or than 1024. */
int rope_and_cache(int is_bf16, void *qkv, int64_t qkv_stride, int tokens, int heads, int kv_heads,
                   int dim, int rot_dim, const void *cos, const void *sin, int64_t cs_stride,
                   void *key_cache, void *value_cache, int64_t s_block, int64_t s_offset,
                   int64_t s_head, const int64_t *slots, int block_size, int threads) {
    if (rot_dim % 2 || rot_dim > dim || rot_dim > 1024) return 1;
    Job job = {is_bf16, qkv, qkv_stride, tokens, heads, kv_heads, dim, rot_dim, cos, sin,
               cs_stride, key_cache, value_cache, s_block, s_offset, s_head, slots, block_size, 0};
    const int64_t chunks = ((int64_t)tokens + TOKENS_PER_CHUNK - 1) / TOKENS_PER_CHUNK;
    run_on_threads(run_tokens, &job, threads < chunks ? threads : (int)chunks);
    return 0;
}
