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
 * query heads, so each key and value row is read once per pass over it.
 * Scores and the softmax are fp32 (two passes: scores, then max/exp/sum, then
 * the weighted sum of values), as the plain-torch reference computes them.
 *
 * A sliding window (`window` > 0) keeps the last `window` keys; a sequence
 * with no keys writes zeros. Work items are split over `threads` threads
 * (the caller's included, see parallel.h) by a shared atomic counter.
 *
 * How an item runs. Rows are fp32 vectors of LANES floats (GCC/clang vector
 * extensions: 16 lanes with AVX-512, 8 with AVX, 4 otherwise), read two
 * vectors at a time, and the head dim is padded to `dpad`, a multiple of
 * 2 * LANES. Rows are read in place from the cache when the dim is such a
 * multiple (fp32 as is, bf16 widened in registers, see row_pair); otherwise
 * a chunk of keys at a time is copied to per-thread fp32 scratch, padded.
 *
 *   scores  two query heads per pass over the keys: each key's products q * k
 *           are summed into a vector, and a transpose-reduce tree folds LANES
 *           such vectors into one vector of LANES scores (no horizontal sum
 *           per key); with AVX512-BF16, bf16 pairs use its dot product;
 *   softmax vectorized max / exp / sum over the score row (padded with -inf);
 *   values  acc[g][d-chunk] += p[g][t] * v[t][d-chunk] with a tile of up to
 *           4 heads x 4 d-chunks of accumulators in registers, each value
 *           vector loaded once per tile; the 1/sum is applied at the end.
 *
 * Everything here is plain C with vector extensions except the AVX512-BF16
 * dot product, which has the plain path as its fallback.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "parallel.h"
#include "simd.h"

#define MAX_GROUP 64
#define MAX_DIM 512
/* Floats of copied rows per chunk (32 KiB, what L1 holds next to the rest);
 * also sizes the chunks of rows read in place. */
#define CHUNK_FLOATS 8192

/* With AVX512-BF16, bf16 scores use the pair dot product instruction. */
#if defined(__AVX512BF16__) && LANES == 16
#include <immintrin.h>
#define DOT_BF16_PAIRS 1
#else
#define DOT_BF16_PAIRS 0
#endif

/* Transpose-reduce: lane i of the result is the sum of part[i]'s lanes. Each
 * level folds pairs of vectors holding 2h partial sums per row into one
 * holding h per row, rows kept in order. */
#if LANES == 16
#define FOLD8(x, y)                                                                          \
    (SHUFFLE(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +                 \
     SHUFFLE(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
#define FOLD4(x, y)                                                                          \
    (SHUFFLE(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +               \
     SHUFFLE(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31))
#define FOLD2(x, y)                                                                          \
    (SHUFFLE(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +               \
     SHUFFLE(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31))
#define FOLD1(x, y)                                                                          \
    (SHUFFLE(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +              \
     SHUFFLE(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31))
#elif LANES == 8
#define FOLD4(x, y)                                                                          \
    (SHUFFLE(x, y, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(x, y, 4, 5, 6, 7, 12, 13, 14, 15))
#define FOLD2(x, y)                                                                          \
    (SHUFFLE(x, y, 0, 1, 4, 5, 8, 9, 12, 13) + SHUFFLE(x, y, 2, 3, 6, 7, 10, 11, 14, 15))
#define FOLD1(x, y)                                                                          \
    (SHUFFLE(x, y, 0, 2, 4, 6, 8, 10, 12, 14) + SHUFFLE(x, y, 1, 3, 5, 7, 9, 11, 13, 15))
#else
#define FOLD2(x, y) (SHUFFLE(x, y, 0, 1, 4, 5) + SHUFFLE(x, y, 2, 3, 6, 7))
#define FOLD1(x, y) (SHUFFLE(x, y, 0, 2, 4, 6) + SHUFFLE(x, y, 1, 3, 5, 7))
#endif

/* f32_to_bf16 on every lane, the result in the low 16 bits. */
ALWAYS_INLINE vu vf_to_bf16(vf f) {
    const vu u = (vu)f;
    const vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
    const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (rounded & ~nan) | (((u >> 16) | 0x40u) & nan);
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
    int dpad;    /* dim rounded up to 2 * LANES */
    int chunk;   /* keys per chunk, a multiple of LANES */
    int widened; /* dim % (2 * LANES) != 0: rows are copied to fp32 scratch, zero-padded */
    int paired;  /* bf16 rows read in place, in the (even, odd) lane order below */
    int64_t next; /* work counter, atomic */
} Job;

/* One thread's buffers (64-byte aligned):
 *   query  [group][dpad]            scaled query rows, zero-padded
 *   acc    [group][dpad]            weighted sums of values
 *   scores [group][round_up(n)]     scores, then exp(score - max)
 *   rows   [chunk + LANES] pointers to the chunk's rows (in the cache, or in wide)
 *   wide   [chunk][dpad]            fp32 rows when `widened` */
typedef struct {
    float *query, *acc, *scores, *wide;
    const void **rows;
} Scratch;

/* Vectors c and c + 1 (c even) of a row. bf16 rows are read 2 * LANES values
 * at a time as LANES 32-bit lanes, each holding an (even, odd) pair:
 *
 *   lane j = odd << 16 | even    ->   lo = lane << 16          (the even values)
 *                                     hi = lane & 0xffff0000   (the odd values)
 *
 * two integer ops per 2 * LANES values, no permute and no fp32 copy. The query
 * and accumulator rows of such a job are kept in the same (evens, odds) order
 * per block of 2 * LANES values, undone when the output is stored. */
ALWAYS_INLINE void row_pair(const void *row, int c, const int bf16, vf *lo, vf *hi) {
    if (bf16) {
        vu pairs;
        memcpy(&pairs, (const uint16_t *)row + c * LANES, sizeof pairs);
        *lo = (vf)(pairs << 16);
        *hi = (vf)(pairs & 0xffff0000u);
    } else {
        *lo = vload((const float *)row + c * LANES);
        *hi = vload((const float *)row + (c + 1) * LANES);
    }
}

/* Row `index` (elements from `base`) as fp32 in dst[0:dpad], zero-padded and
 * scaled, in the order the job's kernels read (see row_pair). */
static void load_row(const Job *job, const void *base, int64_t index, float *dst, float scale) {
    if (job->paired) {
        for (int c = 0; c < job->dpad / LANES; c += 2) {
            vf lo, hi;
            row_pair((const uint16_t *)base + index, c, 1, &lo, &hi);
            vstore(dst + c * LANES, lo * scale);
            vstore(dst + (c + 1) * LANES, hi * scale);
        }
        return;
    }
    for (int d = 0; d < job->dim; d++)
        dst[d] = scale * (job->is_bf16 ? bf16_to_f32(((const uint16_t *)base)[index + d])
                                       : ((const float *)base)[index + d]);
    for (int d = job->dim; d < job->dpad; d++) dst[d] = 0.0f;
}

/* out[index:index + dim] = src * factor in q's dtype, src in load_row's order. */
static void store_row(const Job *job, int64_t index, const float *src, float factor) {
    if (job->paired) {
        uint16_t *dst = (uint16_t *)job->out + index;
        for (int c = 0; c < job->dpad / LANES; c += 2) {
            const vu lo = vf_to_bf16(vload(src + c * LANES) * factor);
            const vu hi = vf_to_bf16(vload(src + (c + 1) * LANES) * factor);
            const vu pairs = lo | (hi << 16);
            memcpy(dst + c * LANES, &pairs, sizeof pairs);
        }
    } else if (job->is_bf16) {
        uint16_t *dst = (uint16_t *)job->out + index;
        for (int d = 0; d < job->dim; d++) dst[d] = f32_to_bf16(src[d] * factor);
    } else {
        float *dst = (float *)job->out + index;
        for (int d = 0; d < job->dim; d++) dst[d] = src[d] * factor;
    }
}

/* Points scratch->rows[0:count] at the rows of positions pos..pos+count and
 * the padding up to a multiple of LANES at row 0 (finite, its scores are
 * dropped). The block table is walked block by block: no division per row. */
static void gather_rows(const Job *job, Scratch *scratch, const void *base, int64_t seq,
                        int64_t pos, int count, int kv_head) {
    /* Locals, not job / scratch fields: a stored pointer may alias them. */
    const void **rows = scratch->rows;
    const int64_t *table = job->tables + seq * job->table_stride + pos / job->block_size;
    const int64_t block_size = job->block_size, s_block = job->s_block, s_offset = job->s_offset;
    const char *head = (const char *)base + (int64_t)kv_head * job->s_head * (job->is_bf16 ? 2 : 4);
    const int64_t elem = job->is_bf16 ? 2 : 4;
    int64_t offset = pos % block_size;
    for (int t = 0; t < count; t++, offset++) {
        if (offset == block_size) {
            offset = 0;
            table++;
        }
        rows[t] = head + (*table * s_block + offset * s_offset) * elem;
    }
    if (job->widened) {
        for (int t = 0; t < count; t++) {
            float *row = scratch->wide + (int64_t)t * job->dpad;
            load_row(job, rows[t], 0, row, 1.0f);
            rows[t] = row;
        }
    }
    for (int t = count; t % LANES != 0; t++) rows[t] = rows[0];
}

/* Scores of `heads` query heads against key rows: key k's products with
 * head h are summed into a vector (tree0), and a post-order transpose-reduce
 * tree folds LANES such vectors into one vector of LANES scores, holding one
 * pending vector per level and head in registers. Each key row is loaded
 * once for the heads of the pass. */
typedef struct {
    const void *const *rows;
    const float *q; /* [heads][dpad], scaled */
    int dpad;
    const uint16_t *q16; /* [heads][dim], bf16 as given, for DOT_BF16_PAIRS */
    int dim;
    float scale;
} ScoreArgs;

ALWAYS_INLINE void tree0(const ScoreArgs *a, int k, vf *r, const int heads, const int chunks,
                         const int bf16) {
    const void *row = a->rows[k];
    for (int h = 0; h < heads; h++) r[h] = splat(0.0f);
#if DOT_BF16_PAIRS
    if (bf16) { /* products of bf16 pairs are exact in fp32: the same sums, half the ops */
        for (int c = 0; c < chunks; c += 2) {
            const __m512i keys = _mm512_loadu_si512((const uint16_t *)row + c * LANES);
            for (int h = 0; h < heads; h++) {
                const __m512i q = _mm512_loadu_si512(a->q16 + h * a->dim + c * LANES);
                r[h] = (vf)_mm512_dpbf16_ps((__m512)r[h], (__m512bh)q, (__m512bh)keys);
            }
        }
        return;
    }
#endif
    for (int c = 0; c < chunks; c += 2) {
        vf lo, hi;
        row_pair(row, c, bf16, &lo, &hi);
        for (int h = 0; h < heads; h++) {
            const float *q = a->q + h * a->dpad + c * LANES;
            r[h] += vload(q) * lo + vload(q + LANES) * hi;
        }
    }
}

#define TREE_LEVEL(name, below, span, FOLD)                                                    \
    ALWAYS_INLINE void name(const ScoreArgs *a, int k, vf *r, const int heads,                \
                            const int chunks, const int bf16) {                               \
        vf x[2], y[2];                                                                         \
        below(a, k, x, heads, chunks, bf16);                                                   \
        below(a, k + span, y, heads, chunks, bf16);                                            \
        for (int h = 0; h < heads; h++) r[h] = FOLD(x[h], y[h]);                               \
    }
#if LANES == 16
TREE_LEVEL(tree1, tree0, 1, FOLD8)
TREE_LEVEL(tree2, tree1, 2, FOLD4)
TREE_LEVEL(tree3, tree2, 4, FOLD2)
TREE_LEVEL(tree_top, tree3, 8, FOLD1)
#elif LANES == 8
TREE_LEVEL(tree1, tree0, 1, FOLD4)
TREE_LEVEL(tree2, tree1, 2, FOLD2)
TREE_LEVEL(tree_top, tree2, 4, FOLD1)
#else
TREE_LEVEL(tree1, tree0, 1, FOLD2)
TREE_LEVEL(tree_top, tree1, 2, FOLD1)
#endif

/* out[h * out_stride + t] = q_h . rows[t] for t < tiles * LANES. */
ALWAYS_INLINE void score_tiles(const ScoreArgs *a, int tiles, float *out, int64_t out_stride,
                               const int heads, const int chunks, const int bf16) {
    for (int tile = 0; tile < tiles; tile++) {
        vf r[2];
        tree_top(a, tile * LANES, r, heads, chunks, bf16);
        if (DOT_BF16_PAIRS && bf16) /* the bf16 query was not scaled */
            for (int h = 0; h < heads; h++) r[h] *= a->scale;
        for (int h = 0; h < heads; h++) vstore(out + h * out_stride + tile * LANES, r[h]);
    }
}

#define SCORE_CASE(n)                                                                          \
    case n:                                                                                    \
        if (bf16) score_tiles(&a, tiles, out, out_stride, heads, n, 1);                        \
        else score_tiles(&a, tiles, out, out_stride, heads, n, 0);                             \
        break;

/* Head dims of 4 and 8 vectors (64 and 128 at 16 lanes) get unrolled code with
 * constant trip counts; each such case adds ~0.7 s to the build. */
static void score_heads(const ScoreArgs a, int tiles, float *out, int64_t out_stride,
                        const int heads, int chunks, int bf16) {
    switch (chunks) {
        SCORE_CASE(4)
        SCORE_CASE(8)
        default:
            if (bf16) score_tiles(&a, tiles, out, out_stride, heads, chunks, 1);
            else score_tiles(&a, tiles, out, out_stride, heads, chunks, 0);
    }
}

/* Scores of every head of the group, two heads per pass over the keys (four
 * would spill the pending vectors out of the 32 registers). */
static void score_chunk(const Job *job, const Scratch *scratch, int64_t q_base, int count,
                        float *out, int64_t out_stride) {
    const int group = job->heads / job->kv_heads, chunks = job->dpad / LANES;
    const int tiles = (count + LANES - 1) / LANES;
    for (int g = 0; g < group; g += 2) {
        const ScoreArgs a = {scratch->rows, scratch->query + g * job->dpad, job->dpad,
                             (const uint16_t *)job->q + q_base + (int64_t)g * job->dim, job->dim,
                             job->scale};
        const int heads = group - g >= 2 ? 2 : 1;
        if (heads == 2) score_heads(a, tiles, out + g * out_stride, out_stride, 2, chunks, job->paired);
        else score_heads(a, tiles, out + g * out_stride, out_stride, 1, chunks, job->paired);
    }
}

/* Turns a score row (length a multiple of LANES, padded with -inf) into
 * exp(score - max) and returns the sum of the exps. */
static float softmax_row(float *s, int64_t len) {
    vf peak = splat(-INFINITY), total = splat(0.0f);
    for (int64_t t = 0; t < len; t += LANES) peak = vmax(peak, vload(s + t));
    const float top = hmax(peak);
    for (int64_t t = 0; t < len; t += LANES) {
        const vf e = vexp_nonpositive(vload(s + t) - top);
        vstore(s + t, e);
        total += e;
    }
    return hsum(total);
}

/* acc[g][(c0 + c) * LANES...] += sum_t p[g * p_stride + t] * rows[t][(c0 + c) * LANES...]
 * for g < heads, c < chunks: heads * chunks accumulators kept in registers. */
ALWAYS_INLINE void value_tile(const float *restrict p, int64_t p_stride, const void *const *rows,
                              int count, float *restrict acc, int acc_stride, int c0,
                              const int heads, const int chunks, const int bf16) {
    vf sum[4][4];
    for (int g = 0; g < heads; g++)
        for (int c = 0; c < chunks; c++) sum[g][c] = vload(acc + g * acc_stride + (c0 + c) * LANES);
    for (int t = 0; t < count; t++) {
        for (int c = 0; c < chunks; c += 2) {
            vf lo, hi;
            row_pair(rows[t], c0 + c, bf16, &lo, &hi);
            for (int g = 0; g < heads; g++) {
                sum[g][c] += p[g * p_stride + t] * lo;
                sum[g][c + 1] += p[g * p_stride + t] * hi;
            }
        }
    }
    for (int g = 0; g < heads; g++)
        for (int c = 0; c < chunks; c++) vstore(acc + g * acc_stride + (c0 + c) * LANES, sum[g][c]);
}

#define VALUE_CASE(h, w)                                                                       \
    case h * 8 + w:                                                                            \
        if (bf16) value_tile(pg, p_stride, rows, count, ag, dpad, c, h, w, 1);                 \
        else value_tile(pg, p_stride, rows, count, ag, dpad, c, h, w, 0);                      \
        break;

/* Tiles of up to 4 heads x 4 vectors: each value vector loaded once per tile. */
static void value_chunk(const float *p, int64_t p_stride, const void *const *rows, int count,
                        float *acc, int group, int dpad, int bf16) {
    const int chunks = dpad / LANES;
    for (int g = 0; g < group;) {
        const int heads = group - g >= 4 ? 4 : group - g >= 2 ? 2 : 1;
        const float *pg = p + g * p_stride;
        float *ag = acc + g * dpad;
        for (int c = 0; c < chunks;) {
            const int width = chunks - c >= 4 ? 4 : 2;
            switch (heads * 8 + width) { /* constant tile shapes: registers, unrolled */
                VALUE_CASE(4, 4)
                VALUE_CASE(2, 4)
                VALUE_CASE(1, 4)
                VALUE_CASE(4, 2)
                VALUE_CASE(2, 2)
                VALUE_CASE(1, 2)
            }
            c += width;
        }
        g += heads;
    }
}

static void run_item(const Job *job, int64_t item, Scratch *scratch) {
    const int group = job->heads / job->kv_heads, dpad = job->dpad;
    const int64_t seq = item / job->kv_heads;
    const int kv_head = (int)(item % job->kv_heads);
    const int64_t len = job->seq_lens[seq];
    const int64_t start = (job->window > 0 && len > job->window) ? len - job->window : 0;
    const int64_t n = len > start ? len - start : 0;
    const int64_t stride = (n + LANES - 1) / LANES * LANES; /* of a score row */
    const int64_t q_base = (seq * job->heads + (int64_t)kv_head * group) * job->dim;
    float totals[MAX_GROUP];

    for (int g = 0; g < group; g++)
        load_row(job, job->q, q_base + (int64_t)g * job->dim, scratch->query + g * dpad,
                 job->scale);
    memset(scratch->acc, 0, sizeof(float) * (size_t)(group * dpad));
    for (int64_t c0 = 0; c0 < n; c0 += job->chunk) {
        const int count = (int)(n - c0 < job->chunk ? n - c0 : job->chunk);
        gather_rows(job, scratch, job->key, seq, start + c0, count, kv_head);
        score_chunk(job, scratch, q_base, count, scratch->scores + c0, stride);
    }
    for (int g = 0; g < group; g++) {
        float *s = scratch->scores + g * stride;
        for (int64_t t = n; t < stride; t++) s[t] = -INFINITY;
        totals[g] = n > 0 ? softmax_row(s, stride) : 1.0f;
    }
    for (int64_t c0 = 0; c0 < n; c0 += job->chunk) {
        const int count = (int)(n - c0 < job->chunk ? n - c0 : job->chunk);
        gather_rows(job, scratch, job->value, seq, start + c0, count, kv_head);
        value_chunk(scratch->scores + c0, stride, scratch->rows, count, scratch->acc, group, dpad,
                    job->paired);
    }
    for (int g = 0; g < group; g++)
        store_row(job, q_base + (int64_t)g * job->dim, scratch->acc + g * dpad, 1.0f / totals[g]);
}

static void *aligned_buffer(size_t bytes) {
    void *p = NULL;
    return posix_memalign(&p, 64, bytes > 0 ? bytes : 64) == 0 ? p : NULL;
}

static void free_scratch(Scratch *scratch) {
    free(scratch->query);
    free(scratch->acc);
    free(scratch->scores);
    free(scratch->wide);
    free((void *)scratch->rows);
}

static int alloc_scratch(const Job *job, Scratch *scratch) {
    const size_t group = (size_t)(job->heads / job->kv_heads), dpad = (size_t)job->dpad;
    const size_t stride = (size_t)((job->max_len + LANES - 1) / LANES * LANES);
    scratch->query = aligned_buffer(sizeof(float) * group * dpad);
    scratch->acc = aligned_buffer(sizeof(float) * group * dpad);
    scratch->scores = aligned_buffer(sizeof(float) * group * stride);
    scratch->wide = !job->widened ? NULL : aligned_buffer(sizeof(float) * (size_t)job->chunk * dpad);
    scratch->rows = aligned_buffer(sizeof(void *) * (size_t)(job->chunk + LANES));
    const int ok = scratch->query && scratch->acc && scratch->scores && scratch->rows &&
                   (!job->widened || scratch->wide);
    if (!ok) free_scratch(scratch);
    return ok;
}

static void *run_items(void *arg) {
    Job *job = (Job *)arg;
    const int64_t items = (int64_t)job->batch * job->kv_heads;
    Scratch scratch;
    if (!alloc_scratch(job, &scratch)) return (void *)1;
    for (;;) {
        int64_t item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (item >= items) break;
        run_item(job, item, &scratch);
    }
    free_scratch(&scratch);
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
    if (batch <= 0 || dim <= 0) return 0;
    Job job = {is_bf16, q, key, value, s_block, s_offset, s_head, tables, table_stride,
               seq_lens, out, batch, heads, kv_heads, dim, block_size, window, scale, 0,
               0, 0, 0, 0, 0};
    for (int b = 0; b < batch; b++) job.max_len = seq_lens[b] > job.max_len ? seq_lens[b] : job.max_len;
    job.dpad = (dim + 2 * LANES - 1) / (2 * LANES) * (2 * LANES);
    job.chunk = CHUNK_FLOATS / (job.dpad > 0 ? job.dpad : 1) / LANES * LANES;
    if (job.chunk < LANES) job.chunk = LANES;
    /* The (even, odd) pair reading of bf16 rows assumes little-endian lanes. */
    job.widened = dim % (2 * LANES) != 0 ||
                  (is_bf16 && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__);
    job.paired = is_bf16 && !job.widened;
    const int64_t items = (int64_t)batch * kv_heads;
    const int failed = run_on_threads(run_items, &job, threads < items ? threads : (int)items);
    return failed ? 2 : 0;
}
