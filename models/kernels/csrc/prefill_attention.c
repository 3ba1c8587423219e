/* Paged causal attention for CPU tensors: prompt chunks of several query
 * tokens per sequence, over keys already written to the cache.
 *
 *   q          token t, head h at q + t * q_stride + h * dim      (dim contiguous)
 *   key/value  [blocks, block_size, kv_heads, dim], any strides, dim contiguous
 *   tables     [S, max_blocks] int64, row stride `table_stride`
 *   starts     [S] int64: first query token (row of q / out) of each sequence
 *   lens       [S] int64: its query tokens, the last ones of the sequence
 *   seq_lens   [S] int64: its keys in the cache, this step's included
 *   out        token t, head h at out + t * out_stride + h * dim, q's dtype
 *
 * Query token j of sequence s sits at position seq_lens[s] - lens[s] + j and
 * sees the keys at positions up to its own (the last `window` of them when
 * `window` > 0). Scores and the softmax are fp32, as the plain-torch
 * reference computes them.
 *
 * Where `decode_attention.c` serves one query row per pass over the keys,
 * this kernel serves a tile: up to LANES consecutive tokens of one sequence
 * with every query head of one kv head, R rows in all (48 for 16 tokens of 3
 * heads). One work item is a (sequence, tile, kv head); items are taken from
 * a shared atomic counter, longest key range first.
 *
 *   queries  the tile's rows, scaled, transposed to qt[d][row] (rows padded
 *            to whole vectors), once per item;
 *   scores   st[key][row] = sum_d k[key][d] * qt[d][row]: each key value is
 *            broadcast against a vector of rows, 4 keys x 3 row vectors of
 *            accumulators in registers, no horizontal sums; keys after a
 *            row's position (or before its window) become -inf;
 *   softmax  per row, vectorized across rows: max, exp, sum down the keys;
 *   values   out[row][d] = sum_key st[key][row] * v[key][d] / sum[row], 6 rows
 *            x 4 vectors of accumulators, each value vector loaded once per
 *            6 rows; a block of rows stops at its last row's position.
 *
 * fp32 rows are read in place through the block table; bf16 rows are widened
 * to fp32 scratch once per item. Head dims must be a multiple of LANES (and at
 * most MAX_DIM): other shapes return 1 and callers use another path.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "parallel.h"
#include "simd.h"

#define MAX_GROUP 64
#define MAX_DIM 256
/* Rows of a tile at most (tokens x query heads of one kv head). */
#define MAX_ROWS 128

typedef struct {
    int64_t seq, tile, keys; /* keys: the tile's key range, for the ordering */
} Tile;

typedef struct {
    int is_bf16;
    const void *q, *key, *value;
    int64_t q_stride, out_stride;
    int64_t s_block, s_offset, s_head;
    const int64_t *tables;
    int64_t table_stride;
    const int64_t *starts, *lens, *seq_lens;
    void *out;
    int heads, kv_heads, dim, block_size, window;
    float scale;
    int group, tile_tokens, rpad; /* rpad: rows of a tile rounded up to LANES */
    int64_t max_keys;
    const Tile *tiles;
    int64_t items; /* tiles x kv heads */
    int64_t next;  /* work counter, atomic */
} Job;

/* One thread's buffers (64-byte aligned):
 *   qt    [dim][rpad]       scaled queries, transposed
 *   st    [max_keys][rpad]  scores, then exp(score - max)
 *   pos   [rpad]            each row's position (pad rows repeat the last)
 *   total [rpad]            each row's sum of exps
 *   krow, vrow [max_keys]   pointers to the key / value rows (fp32)
 *   wide  [2][max_keys][dim] bf16 rows widened to fp32 */
typedef struct {
    float *qt, *st, *total, *wide;
    int32_t *pos;
    const float **krow, **vrow;
} Scratch;

/* Points rows[0:count] at the rows of positions first..first+count of a
 * sequence's kv head; bf16 rows are widened into `wide` first. */
static void gather_rows(const Job *job, const void *base, int64_t seq, int64_t first, int64_t count,
                        int kv_head, const float **rows, float *wide) {
    const int64_t *table = job->tables + seq * job->table_stride + first / job->block_size;
    const int64_t elem = job->is_bf16 ? 2 : 4;
    const char *head = (const char *)base + (int64_t)kv_head * job->s_head * elem;
    int64_t offset = first % job->block_size;
    for (int64_t t = 0; t < count; t++, offset++) {
        if (offset == job->block_size) {
            offset = 0;
            table++;
        }
        const char *row = head + (*table * job->s_block + offset * job->s_offset) * elem;
        if (job->is_bf16) {
            float *dst = wide + t * job->dim;
            for (int d = 0; d < job->dim; d++) dst[d] = bf16_to_f32(((const uint16_t *)row)[d]);
            rows[t] = dst;
        } else {
            rows[t] = (const float *)row;
        }
    }
}

/* st[t][rv vectors] for keys t0..t0+KB and row vectors rv0..rv0+RV, masked. */
ALWAYS_INLINE void score_block(const Job *job, const Scratch *s, int64_t t0, int64_t key0,
                               int rv0, const int KB, const int RV) {
    vf acc[4][3];
    for (int k = 0; k < KB; k++)
        for (int j = 0; j < RV; j++) acc[k][j] = splat(0.0f);
    const int rpad = job->rpad;
    const float *qt = s->qt + rv0 * LANES;
    const float *rows[4];
    for (int k = 0; k < KB; k++) rows[k] = s->krow[t0 + k];
    for (int d = 0; d < job->dim; d++) {
        vf qv[3];
        for (int j = 0; j < RV; j++) qv[j] = vload(qt + (int64_t)d * rpad + j * LANES);
        for (int k = 0; k < KB; k++) {
            const vf kd = splat(rows[k][d]);
            for (int j = 0; j < RV; j++) acc[k][j] += kd * qv[j];
        }
    }
    const vf neg_inf = splat(-INFINITY);
    for (int j = 0; j < RV; j++) {
        vi pos;
        memcpy(&pos, s->pos + (rv0 + j) * LANES, sizeof pos);
        for (int k = 0; k < KB; k++) {
            const int32_t kpos = (int32_t)(key0 + t0 + k);
            vi visible = (vi){0} + kpos <= pos;
            if (job->window > 0) visible &= (vi){0} + kpos > pos - job->window;
            const vf v = (vf)(((vi)acc[k][j] & visible) | ((vi)neg_inf & ~visible));
            vstore(s->st + (t0 + k) * rpad + (rv0 + j) * LANES, v);
        }
    }
}

#define SCORE_CASE(kb, rv)                                                                     \
    case kb * 4 + rv:                                                                          \
        score_block(job, s, t, key0, rv0, kb, rv);                                             \
        break;

static void scores(const Job *job, const Scratch *s, int64_t n, int64_t key0) {
    const int vectors = job->rpad / LANES;
    for (int64_t t = 0; t < n;) {
        const int kb = n - t >= 4 ? 4 : (int)(n - t);
        for (int rv0 = 0; rv0 < vectors;) {
            const int rv = vectors - rv0 >= 3 ? 3 : vectors - rv0;
            switch (kb * 4 + rv) { /* constant block shapes: registers, unrolled */
                SCORE_CASE(4, 3)
                SCORE_CASE(4, 2)
                SCORE_CASE(4, 1)
                SCORE_CASE(3, 3)
                SCORE_CASE(3, 2)
                SCORE_CASE(3, 1)
                SCORE_CASE(2, 3)
                SCORE_CASE(2, 2)
                SCORE_CASE(2, 1)
                SCORE_CASE(1, 3)
                SCORE_CASE(1, 2)
                SCORE_CASE(1, 1)
            }
            rv0 += rv;
        }
        t += kb;
    }
}

/* Down the keys, per row (vectorized across rows): st <- exp(st - max), and
 * total <- the sum. Every row sees at least its own key, so the max is finite. */
static void softmax_columns(const Job *job, const Scratch *s, int64_t n) {
    const int rpad = job->rpad;
    for (int rv = 0; rv < rpad; rv += LANES) {
        vf peak = splat(-INFINITY), total = splat(0.0f);
        for (int64_t t = 0; t < n; t++) peak = vmax(peak, vload(s->st + t * rpad + rv));
        for (int64_t t = 0; t < n; t++) {
            float *p = s->st + t * rpad + rv;
            const vf e = vexp_nonpositive(vload(p) - peak);
            vstore(p, e);
            total += e;
        }
        vstore(s->total + rv, total);
    }
}

/* Rows r0..r0+RB, vectors c0..c0+DB of the head dim: the weighted sum of the
 * value rows of keys 0..n, divided by the row's total, stored to `out`. */
ALWAYS_INLINE void value_block(const Job *job, const Scratch *s, int64_t n, int r0, int c0,
                               const int64_t *out_rows, const int RB, const int DB) {
    vf acc[6][4];
    for (int r = 0; r < RB; r++)
        for (int c = 0; c < DB; c++) acc[r][c] = splat(0.0f);
    const int rpad = job->rpad;
    for (int64_t t = 0; t < n; t++) {
        const float *row = s->vrow[t] + c0 * LANES;
        const float *p = s->st + t * rpad + r0;
        vf v[4];
        for (int c = 0; c < DB; c++) v[c] = vload(row + c * LANES);
        for (int r = 0; r < RB; r++) {
            const vf w = splat(p[r]);
            for (int c = 0; c < DB; c++) acc[r][c] += w * v[c];
        }
    }
    for (int r = 0; r < RB; r++) {
        const float inv = 1.0f / s->total[r0 + r];
        const int64_t base = out_rows[r0 + r] + c0 * LANES;
        if (job->is_bf16) {
            uint16_t *dst = (uint16_t *)job->out + base;
            for (int c = 0; c < DB; c++) {
                const vf x = acc[r][c] * inv;
                for (int i = 0; i < LANES; i++) dst[c * LANES + i] = f32_to_bf16(x[i]);
            }
        } else {
            float *dst = (float *)job->out + base;
            for (int c = 0; c < DB; c++) vstore(dst + c * LANES, acc[r][c] * inv);
        }
    }
}

#define VALUE_CASE(rb, db)                                                                     \
    case rb * 8 + db:                                                                          \
        value_block(job, s, keys, r0, c0, out_rows, rb, db);                                   \
        break;

static void values(const Job *job, const Scratch *s, int rows, int64_t key0,
                   const int64_t *out_rows) {
    const int vectors = job->dim / LANES;
    for (int r0 = 0; r0 < rows;) {
        const int rb = rows - r0 >= 6 ? 6 : rows - r0;
        /* Keys after the block's last row are masked for all of its rows. */
        const int64_t keys = s->pos[r0 + rb - 1] - key0 + 1;
        for (int c0 = 0; c0 < vectors;) {
            const int db = vectors - c0 >= 4 ? 4 : vectors - c0 >= 2 ? 2 : 1;
            switch (rb * 8 + db) {
                VALUE_CASE(6, 4)
                VALUE_CASE(5, 4)
                VALUE_CASE(4, 4)
                VALUE_CASE(3, 4)
                VALUE_CASE(2, 4)
                VALUE_CASE(1, 4)
                VALUE_CASE(6, 2)
                VALUE_CASE(5, 2)
                VALUE_CASE(4, 2)
                VALUE_CASE(3, 2)
                VALUE_CASE(2, 2)
                VALUE_CASE(1, 2)
                VALUE_CASE(6, 1)
                VALUE_CASE(5, 1)
                VALUE_CASE(4, 1)
                VALUE_CASE(3, 1)
                VALUE_CASE(2, 1)
                VALUE_CASE(1, 1)
            }
            c0 += db;
        }
        r0 += rb;
    }
}

static void run_item(const Job *job, int64_t item, Scratch *s) {
    const Tile *tile = &job->tiles[item / job->kv_heads];
    const int kv_head = (int)(item % job->kv_heads);
    const int64_t seq = tile->seq, len = job->lens[seq];
    const int64_t first_token = tile->tile * job->tile_tokens;
    const int64_t tokens = len - first_token < job->tile_tokens ? len - first_token : job->tile_tokens;
    const int64_t first_pos = job->seq_lens[seq] - len + first_token;
    const int64_t last_pos = first_pos + tokens - 1;
    const int64_t key0 =
        job->window > 0 && first_pos + 1 - job->window > 0 ? first_pos + 1 - job->window : 0;
    const int64_t n = last_pos + 1 - key0;
    const int group = job->group, rows = (int)tokens * group, rpad = job->rpad, dim = job->dim;
    int64_t out_rows[MAX_ROWS];

    /* Rows in (token, head) order; pad rows repeat the last row's position
     * and have zero queries (finite scores, never stored). */
    memset(s->qt, 0, sizeof(float) * (size_t)dim * (size_t)rpad);
    for (int r = 0; r < rpad; r++) {
        const int64_t token = r < rows ? r / group : tokens - 1;
        s->pos[r] = (int32_t)(first_pos + token);
        if (r >= rows) continue;
        const int head = kv_head * group + r % group;
        const int64_t t = job->starts[seq] + first_token + token;
        const int64_t q_at = t * job->q_stride + (int64_t)head * dim;
        out_rows[r] = t * job->out_stride + (int64_t)head * dim;
        for (int d = 0; d < dim; d++) {
            const float x = job->is_bf16 ? bf16_to_f32(((const uint16_t *)job->q)[q_at + d])
                                         : ((const float *)job->q)[q_at + d];
            s->qt[(int64_t)d * rpad + r] = x * job->scale;
        }
    }
    gather_rows(job, job->key, seq, key0, n, kv_head, s->krow, s->wide);
    scores(job, s, n, key0);
    softmax_columns(job, s, n);
    gather_rows(job, job->value, seq, key0, n, kv_head, s->vrow, s->wide + job->max_keys * dim);
    values(job, s, rows, key0, out_rows);
}

static void *aligned_buffer(size_t bytes) {
    void *p = NULL;
    return posix_memalign(&p, 64, bytes > 0 ? bytes : 64) == 0 ? p : NULL;
}

static void free_scratch(Scratch *s) {
    free(s->qt);
    free(s->st);
    free(s->total);
    free(s->pos);
    free(s->wide);
    free((void *)s->krow);
    free((void *)s->vrow);
}

static int alloc_scratch(const Job *job, Scratch *s) {
    const size_t rpad = (size_t)job->rpad, keys = (size_t)job->max_keys, dim = (size_t)job->dim;
    s->qt = aligned_buffer(sizeof(float) * dim * rpad);
    s->st = aligned_buffer(sizeof(float) * keys * rpad);
    s->total = aligned_buffer(sizeof(float) * rpad);
    s->pos = aligned_buffer(sizeof(int32_t) * rpad);
    s->wide = job->is_bf16 ? aligned_buffer(sizeof(float) * 2 * keys * dim) : NULL;
    s->krow = aligned_buffer(sizeof(float *) * keys);
    s->vrow = aligned_buffer(sizeof(float *) * keys);
    const int ok = s->qt && s->st && s->total && s->pos && s->krow && s->vrow &&
                   (!job->is_bf16 || s->wide);
    if (!ok) free_scratch(s);
    return ok;
}

static void *run_items(void *arg) {
    Job *job = (Job *)arg;
    Scratch s;
    if (!alloc_scratch(job, &s)) return (void *)1;
    for (;;) {
        const int64_t item = __atomic_fetch_add(&job->next, 1, __ATOMIC_RELAXED);
        if (item >= job->items) break;
        run_item(job, item, &s);
    }
    free_scratch(&s);
    return NULL;
}

static int by_keys_descending(const void *a, const void *b) {
    const int64_t x = ((const Tile *)a)->keys, y = ((const Tile *)b)->keys;
    return (x < y) - (x > y);
}

/* Returns 0 on success; 1 when the shapes are outside what this kernel
 * serves (head dim not a multiple of LANES or above MAX_DIM, group above
 * MAX_GROUP, a position beyond int32); 2 when memory or threads ran out. */
int paged_prefill_attention(int is_bf16, const void *q, int64_t q_stride, const void *key,
                            const void *value, int64_t s_block, int64_t s_offset, int64_t s_head,
                            const int64_t *tables, int64_t table_stride, const int64_t *starts,
                            const int64_t *lens, const int64_t *seq_lens, void *out,
                            int64_t out_stride, int num_seqs, int heads, int kv_heads, int dim,
                            int block_size, int window, float scale, int threads) {
    if (kv_heads <= 0 || heads % kv_heads != 0 || heads / kv_heads > MAX_GROUP || dim <= 0 ||
        dim % LANES != 0 || dim > MAX_DIM)
        return 1;
    Job job = {0};
    job.is_bf16 = is_bf16;
    job.q = q, job.key = key, job.value = value, job.out = out;
    job.q_stride = q_stride, job.out_stride = out_stride;
    job.s_block = s_block, job.s_offset = s_offset, job.s_head = s_head;
    job.tables = tables, job.table_stride = table_stride;
    job.starts = starts, job.lens = lens, job.seq_lens = seq_lens;
    job.heads = heads, job.kv_heads = kv_heads, job.dim = dim;
    job.block_size = block_size, job.window = window, job.scale = scale;
    job.group = heads / kv_heads;
    job.tile_tokens = MAX_ROWS / job.group < LANES ? MAX_ROWS / job.group : LANES;
    job.rpad = (job.tile_tokens * job.group + LANES - 1) / LANES * LANES;
    int64_t count = 0;
    for (int s = 0; s < num_seqs; s++) {
        if (seq_lens[s] > INT32_MAX || lens[s] > seq_lens[s]) return 1;
        job.max_keys = seq_lens[s] > job.max_keys ? seq_lens[s] : job.max_keys;
        count += (lens[s] + job.tile_tokens - 1) / job.tile_tokens;
    }
    if (count == 0) return 0;
    Tile *tiles = malloc(sizeof(Tile) * (size_t)count);
    if (tiles == NULL) return 2;
    int64_t i = 0;
    for (int s = 0; s < num_seqs; s++) {
        for (int64_t t = 0; t * job.tile_tokens < lens[s]; t++) {
            const int64_t last = seq_lens[s] - lens[s] + (t + 1) * job.tile_tokens;
            tiles[i++] = (Tile){s, t, last < seq_lens[s] ? last : seq_lens[s]};
        }
    }
    qsort(tiles, (size_t)count, sizeof(Tile), by_keys_descending);
    job.tiles = tiles;
    job.items = count * kv_heads;
    const int failed = run_on_threads(run_items, &job, threads < job.items ? threads : (int)job.items);
    free(tiles);
    return failed ? 2 : 0;
}
