/* The fp32 product of a few rows with a row-major weight, for CPU tensors:
 *
 *   y[r, n] = sum_k x[r, k] * w[n, k]  (+ bias[n])     r < rows <= MAX_ROWS
 *
 * A decode step of a few sequences multiplies each weight of the model by
 * a few rows once: the product streams the weight from memory and does
 * little arithmetic per byte. Here every weight row is read once for all
 * `rows` inputs, and each output is one dot product kept in a vector
 * accumulator over k. How many weight rows a pass reads side by side
 * (`tile`) was measured: 8 at 1 and 2 input rows, 1 at 3 and 4 (on an AMD
 * EPYC Zen 4, SmolLM2-135M's products, one thread: 31.5, 35.5, 36.8 and
 * 37.4 ms a pass at 1 to 4 rows against 45 and 50 with 2 weight rows at 1
 * and 2, 50.8 and 55 with 4 at 3 and 4).
 *
 * From 5 rows on, a product does more arithmetic per weight byte, and the
 * rows no longer fit one tile's registers. Two weight rows at a time are
 * multiplied by the input rows in groups of at most GROUP_ROWS (2 x 6
 * accumulators, 15 of AVX2's 16 vector registers): the first group reads
 * the pair from memory, the others from the L1 cache. While the first group
 * runs, the next pair is prefetched, so its load from memory overlaps the
 * arithmetic of the groups instead of following it. On an AMD EPYC Zen 2,
 * one thread, one pass over SmolLM2-135M's products (weights streamed from
 * memory), oneDNN's blocked copy took 80-96 / 109-123 / 120-139 / 134-155
 * / 166-178 ms at 8 / 16 / 20 / 24 / 32 rows and this 56-64 / 87-92 /
 * 109-120 / 119-128 / 158-166; without the prefetch 80 / 107 / 131 / 136 /
 * 176 (`models.layers.small_products` measures which path wins per CPU).
 *
 * Every output is summed in the same order whatever `rows` and the tile
 * are: lane-wise over k in whole vectors, the k tail as one more vector
 * padded with zeros, the vector's lanes through one reduction
 * (`reduce_all`), then the bias. So a sequence's outputs do not depend on
 * which others share its step. That order is spelled out, not left to the
 * compiler: each multiply-add is one `vfma`, and the tail is a vector, not
 * a scalar loop. Written `acc += x * w` with a scalar tail, GCC tuned for
 * AMD Zen 2 fused the products in some tiles and not in others, and a row
 * alone and the same row beside three others differed in the last bits.
 *
 * Output rows are split over `threads` threads in chunks of `chunk` (see
 * parallel.h). Strides are in elements; rows of x, w and y are contiguous.
 * Returns 1 for a row count beyond MAX_ROWS, 2 when a thread failed.
 */
#include <stdint.h>
#include <string.h>

#include "lane_sums.h"
#include "parallel.h"
#include "simd.h"

#define MAX_ROWS 32
/* Past FEW_ROWS input rows, the most rows of one group (see the top). */
#define FEW_ROWS 4
#define GROUP_ROWS 6
#define GROUP_WIDTH 2
/* Floats of a cache line: the prefetch stride. */
#define LINE_FLOATS 16

typedef struct {
    const float *x, *w, *bias;
    float *y;
    int64_t rows, n, k, x_stride, w_stride, y_stride, chunk;
    int64_t next; /* first output row of the next chunk, atomic */
} Job;

/* Outputs n0 .. n0 + G - 1 of input rows r0 .. r0 + R - 1: R x G
 * accumulators, one pass over G weight rows. R and G are constants, so the
 * loops unroll and the accumulators stay in registers. With `ahead`, the G
 * weight rows at `ahead` are prefetched along, one cache line per row at a
 * time, for the tile that follows. */
#define DEFINE_TILE(R, G)                                                                   \
    static void tile_##R##_##G(const Job *job, int64_t r0, int64_t n0, const float *ahead) { \
        const int64_t k = job->k, xs = job->x_stride, ws = job->w_stride;                   \
        const float *x = job->x + r0 * xs, *w = job->w + n0 * ws;                           \
        vf acc[R][G];                                                                       \
        for (int r = 0; r < R; r++)                                                         \
            for (int g = 0; g < G; g++) acc[r][g] = (vf){0};                                \
        int64_t i = 0;                                                                      \
        for (; i + LANES <= k; i += LANES) {                                                \
            vf wv[G];                                                                       \
            for (int g = 0; g < G; g++) wv[g] = vload(w + g * ws + i);                      \
            if (ahead && i % LINE_FLOATS == 0)                                              \
                for (int g = 0; g < G; g++) __builtin_prefetch(ahead + g * ws + i, 0, 3);   \
            for (int r = 0; r < R; r++) {                                                   \
                const vf xv = vload(x + r * xs + i);                                        \
                for (int g = 0; g < G; g++) acc[r][g] = vfma(xv, wv[g], acc[r][g]);         \
            }                                                                               \
        }                                                                                   \
        if (i < k) {                                                                        \
            vf wv[G];                                                                       \
            for (int g = 0; g < G; g++) wv[g] = vload_head(w + g * ws + i, k - i);          \
            for (int r = 0; r < R; r++) {                                                   \
                const vf xv = vload_head(x + r * xs + i, k - i);                            \
                for (int g = 0; g < G; g++) acc[r][g] = vfma(xv, wv[g], acc[r][g]);         \
            }                                                                               \
        }                                                                                   \
        float sums[R][G];                                                                   \
        reduce_all(&acc[0][0], &sums[0][0], R * G);                                         \
        float *y = job->y + r0 * job->y_stride;                                             \
        for (int r = 0; r < R; r++)                                                         \
            for (int g = 0; g < G; g++) {                                                   \
                float s = sums[r][g];                                                       \
                if (job->bias) s += job->bias[n0 + g];                                      \
                y[r * job->y_stride + n0 + g] = s;                                          \
            }                                                                               \
    }

DEFINE_TILE(1, 8)
DEFINE_TILE(2, 8)
DEFINE_TILE(1, 1)
DEFINE_TILE(2, 1)
DEFINE_TILE(3, 1)
DEFINE_TILE(4, 1)
DEFINE_TILE(5, 1)
DEFINE_TILE(6, 1)
DEFINE_TILE(1, 2)
DEFINE_TILE(2, 2)
DEFINE_TILE(3, 2)
DEFINE_TILE(4, 2)
DEFINE_TILE(5, 2)
DEFINE_TILE(6, 2)

typedef void (*TileFn)(const Job *, int64_t, int64_t, const float *);
/* Up to FEW_ROWS rows, per row count: the tile of the bulk, its weight
 * rows, and the one-row tile of a chunk's remainder. */
static const TileFn BULK[FEW_ROWS + 1] = {0, tile_1_8, tile_2_8, tile_3_1, tile_4_1};
static const int BULK_WIDTH[FEW_ROWS + 1] = {0, 8, 8, 1, 1};
static const TileFn SINGLE[FEW_ROWS + 1] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1};
/* Past FEW_ROWS rows, per group size: the tile of a weight pair, and of one weight row. */
static const TileFn PAIR[GROUP_ROWS + 1] = {0,        tile_1_2, tile_2_2, tile_3_2,
                                            tile_4_2, tile_5_2, tile_6_2};
static const TileFn ONE[GROUP_ROWS + 1] = {0,        tile_1_1, tile_2_1, tile_3_1,
                                           tile_4_1, tile_5_1, tile_6_1};

/* Weight rows [first, last) for every input row: up to FEW_ROWS rows in one tile. */
static void few_rows(const Job *job, int64_t first, int64_t last) {
    const TileFn bulk = BULK[job->rows], single = SINGLE[job->rows];
    const int width = BULK_WIDTH[job->rows];
    int64_t n0 = first;
    for (; n0 + width <= last; n0 += width) bulk(job, 0, n0, NULL);
    for (; n0 < last; n0++) single(job, 0, n0, NULL);
}

/* Weight rows n0 .. n0 + width - 1 (the width of `tiles`) for every input
 * row, in groups of GROUP_ROWS and one last smaller group; the first group
 * prefetches `ahead` (NULL: nothing). */
ALWAYS_INLINE void by_groups(const Job *job, const TileFn *tiles, int64_t n0, const float *ahead) {
    for (int64_t r0 = 0; r0 < job->rows; r0 += GROUP_ROWS) {
        const int64_t group = job->rows - r0 < GROUP_ROWS ? job->rows - r0 : GROUP_ROWS;
        tiles[group](job, r0, n0, r0 == 0 ? ahead : NULL);
    }
}

/* Weight rows [first, last) for every input row, past FEW_ROWS rows: a
 * pair of weight rows at a time, prefetching the next pair, then one row. */
static void many_rows(const Job *job, int64_t first, int64_t last) {
    int64_t n0 = first;
    for (; n0 + GROUP_WIDTH <= last; n0 += GROUP_WIDTH) {
        const int64_t next = n0 + GROUP_WIDTH;
        const float *ahead = next + GROUP_WIDTH <= job->n ? job->w + next * job->w_stride : NULL;
        by_groups(job, PAIR, n0, ahead);
    }
    for (; n0 < last; n0++) by_groups(job, ONE, n0, NULL);
}

static void *work(void *arg) {
    Job *job = arg;
    int64_t first, last;
    while (claim_chunk(&job->next, job->n, job->chunk, &first, &last)) {
        if (job->rows <= FEW_ROWS)
            few_rows(job, first, last);
        else
            many_rows(job, first, last);
    }
    return NULL;
}

int skinny_gemm(const float *x, int64_t x_stride, const float *w, int64_t w_stride,
                const float *bias, float *y, int64_t y_stride, int64_t rows, int64_t n, int64_t k,
                int64_t chunk, int threads) {
    if (rows < 1 || rows > MAX_ROWS || chunk < 1) return 1;
    Job job = {x, w, bias, y, rows, n, k, x_stride, w_stride, y_stride, chunk, 0};
    return run_on_threads(work, &job, threads) ? 2 : 0;
}
