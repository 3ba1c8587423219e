/* A mixture-of-experts layer's experts for fp32 CPU tensors, in one call:
 *
 *   out[t] = sum_j weights[t, j] * down[e] relu2(up[e] x[t])    e = experts[t, j],
 *                                                               ascending e
 *          + shared_down relu2(shared_up x[t])                  (shared_inter > 0)
 *
 * with relu2(s) = relu(s) * relu(s), up [E, I, H], down [E, H, I], shared_up
 * [S, H] and shared_down [H, S], all row-major and contiguous. Steps:
 *
 *   1. the T * top_k (token, j) pairs sorted by expert (a counting sort,
 *      stable: within an expert the pairs stay in token order), so each
 *      expert's pairs are one segment of the sorted list;
 *   2. the up products, hidden[p] = relu2(up[e] x[token of p]) for every
 *      sorted pair p, and the shared expert's over every token;
 *   3. the down products, pair_out[pair of p] = weight * down[e] hidden[p],
 *      and the shared expert's;
 *   4. out[t] = 0 + the pair outputs of t in ascending expert order + the
 *      shared output: the order in which the reference loop adds them.
 *
 *   sorted pairs    up [E, I, H]        hidden           pair_out (t, j order)
 *   +-----------+   +--------+ e = 0    +-------+        +-------+
 *   | pairs of 0|-->| [I, H] |-------->  | [., I]|--down->| [., H]|--> out[t]
 *   +-----------+   +--------+ e = 1    +-------+        +-------+
 *   |  (none)   |   | unread |
 *   +-----------+   +--------+ ...
 *
 * An expert no pair chose is skipped: its weights are never read. At decode
 * sizes a segment holds a few rows, so the products stream the chosen
 * experts' weights from memory with little arithmetic per byte. Every
 * weight row is read once for all rows of its segment: the rows go in
 * groups of at most GROUP_ROWS against a few weight rows at a time (their
 * accumulators stay in registers; the widths were measured, see
 * benchmarks/README.md), within blocks of BLOCK_ROWS weight rows that the
 * groups after the first read from the cache.
 *
 * Steps 2 and 3 are one parallel region each: their work items, (expert,
 * chunk of `chunk` output rows) of the routed experts and then of the
 * shared expert, are claimed by `threads` threads from one counter
 * (parallel.h). Step 4 splits the tokens.
 *
 * Every output is summed in the same order whatever the segment's size and
 * the tile: lane-wise over k in whole vectors with one fused multiply-add
 * each, the k tail as one more zero-padded vector, the lanes through
 * `reduce_all` (lane_sums.h). A token's output does not depend on which
 * tokens share its step.
 *
 * Returns 1 for bad sizes or an expert id out of range, 2 when a thread
 * failed, 3 when out of memory.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "lane_sums.h"
#include "parallel.h"
#include "simd.h"

#define GROUP_ROWS 4
#define MAX_TOP_K 64
/* Weight rows of a block: a multiple of every bulk tile's width. */
#define BLOCK_ROWS 24

/* One product step: y[row p] = scale[p] * act(w[e] x[row p]) for the rows p
 * of every chosen expert's segment. */
typedef struct {
    const float *w; /* [experts, n, k] */
    int64_t n, k;
    const int64_t *offsets; /* segment bounds, experts + 1 */
    const int64_t *chosen;  /* the experts with rows */
    const float *x;
    int64_t x_stride;
    const int64_t *x_rows; /* the input row of p (NULL: p) */
    float *y;
    int64_t y_stride;
    const int64_t *y_rows; /* the output row of p (NULL: p) */
    const float *scale;    /* per p (NULL: 1) */
    int relu2;
    int64_t chunk, chunks_per_expert, items;
} Product;

ALWAYS_INLINE float activate(const Product *job, float s) {
    if (!job->relu2) return s;
    const float r = s > 0.0f ? s : 0.0f;
    return r * r;
}

/* Outputs n0 .. n0 + G - 1 of the segment rows rows[0 .. R - 1] against the
 * weight rows at w: R x G accumulators, one pass over G weight rows. */
#define DEFINE_TILE(R, G)                                                                    \
    static void tile_##R##_##G(const Product *job, const float *w, const int64_t *rows,     \
                               int64_t n0) {                                                 \
        const int64_t k = job->k;                                                            \
        const float *x[R];                                                                   \
        for (int r = 0; r < R; r++)                                                          \
            x[r] = job->x + (job->x_rows ? job->x_rows[rows[r]] : rows[r]) * job->x_stride;  \
        w += n0 * k;                                                                         \
        vf acc[R][G];                                                                        \
        for (int r = 0; r < R; r++)                                                          \
            for (int g = 0; g < G; g++) acc[r][g] = (vf){0};                                 \
        int64_t i = 0;                                                                       \
        for (; i + LANES <= k; i += LANES) {                                                 \
            vf wv[G];                                                                        \
            for (int g = 0; g < G; g++) wv[g] = vload(w + g * k + i);                        \
            for (int r = 0; r < R; r++) {                                                    \
                const vf xv = vload(x[r] + i);                                               \
                for (int g = 0; g < G; g++) acc[r][g] = vfma(xv, wv[g], acc[r][g]);          \
            }                                                                                \
        }                                                                                    \
        if (i < k) {                                                                         \
            vf wv[G];                                                                        \
            for (int g = 0; g < G; g++) wv[g] = vload_head(w + g * k + i, k - i);            \
            for (int r = 0; r < R; r++) {                                                    \
                const vf xv = vload_head(x[r] + i, k - i);                                   \
                for (int g = 0; g < G; g++) acc[r][g] = vfma(xv, wv[g], acc[r][g]);          \
            }                                                                                \
        }                                                                                    \
        float sums[R][G];                                                                    \
        reduce_all(&acc[0][0], &sums[0][0], R * G);                                          \
        for (int r = 0; r < R; r++) {                                                        \
            const int64_t p = rows[r];                                                       \
            float *y = job->y + (job->y_rows ? job->y_rows[p] : p) * job->y_stride + n0;     \
            const float scale = job->scale ? job->scale[p] : 1.0f;                           \
            for (int g = 0; g < G; g++) y[g] = scale * activate(job, sums[r][g]);            \
        }                                                                                    \
    }

DEFINE_TILE(1, 8)
DEFINE_TILE(2, 6)
DEFINE_TILE(3, 4)
DEFINE_TILE(4, 3)
DEFINE_TILE(1, 1)
DEFINE_TILE(2, 1)
DEFINE_TILE(3, 1)
DEFINE_TILE(4, 1)

typedef void (*TileFn)(const Product *, const float *, const int64_t *, int64_t);
/* Per group size: the tile of the bulk, its weight rows, and the one-row tile. */
static const TileFn BULK[GROUP_ROWS + 1] = {0, tile_1_8, tile_2_6, tile_3_4, tile_4_3};
static const int BULK_WIDTH[GROUP_ROWS + 1] = {0, 8, 6, 4, 3};
static const TileFn SINGLE[GROUP_ROWS + 1] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1};

/* Weight rows [first, last) of one expert for its segment's rows [p_first,
 * p_last): each block of weight rows against each group of rows in turn. */
static void expert_chunk(const Product *job, const float *w, int64_t p_first, int64_t p_last,
                         int64_t first, int64_t last) {
    int64_t rows[GROUP_ROWS];
    for (int64_t n0 = first; n0 < last; n0 += BLOCK_ROWS) {
        const int64_t end = n0 + BLOCK_ROWS < last ? n0 + BLOCK_ROWS : last;
        for (int64_t p0 = p_first; p0 < p_last; p0 += GROUP_ROWS) {
            const int count = p_last - p0 < GROUP_ROWS ? (int)(p_last - p0) : GROUP_ROWS;
            for (int r = 0; r < count; r++) rows[r] = p0 + r;
            const int width = BULK_WIDTH[count];
            int64_t n = n0;
            for (; n + width <= end; n += width) BULK[count](job, w, rows, n);
            for (; n < end; n++) SINGLE[count](job, w, rows, n);
        }
    }
}

/* One step's products (the routed experts', then the shared expert's), their
 * work items claimed from one counter: one parallel region a step. */
typedef struct {
    Product *products[2];
    int count;
    int64_t items, next;
} Step;

static void *step_work(void *arg) {
    Step *step = arg;
    int64_t first, last;
    while (claim_chunk(&step->next, step->items, 1, &first, &last)) {
        Product *job = step->products[0];
        if (first >= job->items) {
            first -= job->items;
            job = step->products[1];
        }
        const int64_t expert = job->chosen[first / job->chunks_per_expert];
        const int64_t row0 = (first % job->chunks_per_expert) * job->chunk;
        const int64_t row1 = row0 + job->chunk < job->n ? row0 + job->chunk : job->n;
        const float *w = job->w + expert * job->n * job->k;
        expert_chunk(job, w, job->offsets[expert], job->offsets[expert + 1], row0, row1);
    }
    return NULL;
}

/* Runs `routed` over its `chosen` experts and, when not NULL, `shared`. */
static int run_step(Product *routed, int64_t chosen, Product *shared, int64_t chunk,
                    int threads) {
    Step step = {.products = {routed, shared}, .count = shared ? 2 : 1, .next = 0};
    for (int i = 0; i < step.count; i++) {
        Product *job = step.products[i];
        job->chunk = chunk;
        job->chunks_per_expert = (job->n + chunk - 1) / chunk;
        job->items = (i == 0 ? chosen : 1) * job->chunks_per_expert;
        step.items += job->items;
    }
    return step.items ? run_on_threads(step_work, &step, threads) : 0;
}

/* Step 4: out[t] = 0 + pair outputs in ascending expert order + shared. */
typedef struct {
    const float *pair_out, *shared_out; /* [T * top_k, H], [T, H] or NULL */
    const int64_t *experts;
    float *out;
    int64_t top_k, hidden, out_stride, tokens;
    int64_t next;
} Combine;

static void *combine_work(void *arg) {
    Combine *job = arg;
    int64_t first, last;
    int64_t order[MAX_TOP_K];
    while (claim_chunk(&job->next, job->tokens, 1, &first, &last)) {
        const int64_t t = first, k = job->top_k, h = job->hidden;
        /* The token's pairs by ascending expert (insertion sort of top_k). */
        for (int64_t j = 0; j < k; j++) {
            int64_t at = j;
            while (at > 0 && job->experts[t * k + order[at - 1]] > job->experts[t * k + j]) {
                order[at] = order[at - 1];
                at--;
            }
            order[at] = j;
        }
        float *out = job->out + t * job->out_stride;
        int64_t i = 0;
        for (; i + LANES <= h; i += LANES) {
            vf acc = (vf){0};
            for (int64_t j = 0; j < k; j++)
                acc += vload(job->pair_out + (t * k + order[j]) * h + i);
            if (job->shared_out) acc += vload(job->shared_out + t * h + i);
            vstore(out + i, acc);
        }
        for (; i < h; i++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < k; j++) acc += job->pair_out[(t * k + order[j]) * h + i];
            if (job->shared_out) acc += job->shared_out[t * h + i];
            out[i] = acc;
        }
    }
    return NULL;
}

int moe_experts(const float *x, int64_t x_stride, int64_t tokens, int64_t hidden,
                const int64_t *experts, const float *weights, int64_t top_k, const float *up,
                const float *down, int64_t num_experts, int64_t inter, const float *shared_up,
                const float *shared_down, int64_t shared_inter, float *out, int64_t out_stride,
                int64_t chunk, int threads) {
    if (tokens < 1 || hidden < 1 || top_k < 1 || top_k > MAX_TOP_K || num_experts < 1 ||
        inter < 1 || shared_inter < 0 || chunk < 1)
        return 1;
    const int64_t pairs = tokens * top_k;
    for (int64_t p = 0; p < pairs; p++)
        if (experts[p] < 0 || experts[p] >= num_experts) return 1;
    /* One block for the bookkeeping and the intermediate rows. */
    const size_t ints = (size_t)(3 * (num_experts + 1) + 2 * pairs);
    const size_t floats = (size_t)(pairs + pairs * inter + pairs * hidden +
                                   tokens * (shared_inter + hidden));
    char *block = malloc(ints * sizeof(int64_t) + floats * sizeof(float));
    if (!block) return 3;
    int64_t *offsets = (int64_t *)block, *chosen = offsets + num_experts + 1;
    int64_t *fill = chosen + num_experts + 1, *pair_of = fill + num_experts + 1;
    int64_t *token_of = pair_of + pairs;
    float *scale = (float *)(token_of + pairs), *hidden_rows = scale + pairs;
    float *pair_out = hidden_rows + pairs * inter, *shared_hidden = pair_out + pairs * hidden;
    float *shared_out = shared_hidden + tokens * shared_inter;

    /* Step 1: counting sort of the pairs by expert. */
    memset(offsets, 0, (size_t)(num_experts + 1) * sizeof(int64_t));
    for (int64_t p = 0; p < pairs; p++) offsets[experts[p] + 1]++;
    int64_t chosen_count = 0;
    for (int64_t e = 0; e < num_experts; e++) {
        if (offsets[e + 1]) chosen[chosen_count++] = e;
        offsets[e + 1] += offsets[e];
    }
    memcpy(fill, offsets, (size_t)num_experts * sizeof(int64_t));
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t at = fill[experts[p]]++;
        pair_of[at] = p;
        token_of[at] = p / top_k;
        scale[at] = weights[p];
    }

    /* Steps 2 and 3, routed and shared. */
    const int64_t all_tokens[2] = {0, tokens}, only[1] = {0};
    Product routed_up = {.w = up, .n = inter, .k = hidden, .offsets = offsets,
                         .chosen = chosen, .x = x, .x_stride = x_stride, .x_rows = token_of,
                         .y = hidden_rows, .y_stride = inter, .relu2 = 1};
    Product routed_down = {.w = down, .n = hidden, .k = inter, .offsets = offsets,
                           .chosen = chosen, .x = hidden_rows, .x_stride = inter,
                           .y = pair_out, .y_stride = hidden, .y_rows = pair_of,
                           .scale = scale};
    Product shared_in = {.w = shared_up, .n = shared_inter, .k = hidden, .offsets = all_tokens,
                         .chosen = only, .x = x, .x_stride = x_stride, .y = shared_hidden,
                         .y_stride = shared_inter, .relu2 = 1};
    Product shared_back = {.w = shared_down, .n = hidden, .k = shared_inter,
                           .offsets = all_tokens, .chosen = only, .x = shared_hidden,
                           .x_stride = shared_inter, .y = shared_out, .y_stride = hidden};
    const int shared = shared_inter > 0;
    int failed = run_step(&routed_up, chosen_count, shared ? &shared_in : NULL, chunk, threads);
    failed |= run_step(&routed_down, chosen_count, shared ? &shared_back : NULL, chunk, threads);

    /* Step 4. */
    Combine combine = {.pair_out = pair_out, .shared_out = shared ? shared_out : NULL,
                       .experts = experts, .out = out, .top_k = top_k, .hidden = hidden,
                       .out_stride = out_stride, .tokens = tokens, .next = 0};
    failed |= run_on_threads(combine_work, &combine, tokens > 1 ? threads : 1);
    free(block);
    return failed ? 2 : 0;
}
