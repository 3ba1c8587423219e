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

#include "parallel.h"
#include "simd.h"

#define MAX_ROWS 4

typedef struct {
    const float *x, *w, *bias;
    float *y;
    int64_t rows, n, k, x_stride, w_stride, y_stride, chunk;
    int64_t next; /* first output row of the next chunk, atomic */
} Job;

/* The lane sums of four vectors into s[0..3], all four in one vector: the
 * two halves of each vector added, then the halves of those, down to one
 * lane each (the same shuffles and adds at every vector width). */
ALWAYS_INLINE void reduce4(vf a0, vf a1, vf a2, vf a3, float *s) {
#if LANES == 16
    const vf p01 = SHUFFLE(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                   SHUFFLE(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const vf p23 = SHUFFLE(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                   SHUFFLE(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const vf q = SHUFFLE(p01, p23, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                 SHUFFLE(p01, p23, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const vf h = q + SHUFFLE(q, q, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    const vf t = h + SHUFFLE(h, h, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    s[0] = t[0];
    s[1] = t[4];
    s[2] = t[8];
    s[3] = t[12];
#elif LANES == 8
    const vf p01 =
        SHUFFLE(a0, a1, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(a0, a1, 4, 5, 6, 7, 12, 13, 14, 15);
    const vf p23 =
        SHUFFLE(a2, a3, 0, 1, 2, 3, 8, 9, 10, 11) + SHUFFLE(a2, a3, 4, 5, 6, 7, 12, 13, 14, 15);
    const vf q =
        SHUFFLE(p01, p23, 0, 1, 4, 5, 8, 9, 12, 13) + SHUFFLE(p01, p23, 2, 3, 6, 7, 10, 11, 14, 15);
    const vf t = q + SHUFFLE(q, q, 1, 0, 3, 2, 5, 4, 7, 6);
    s[0] = t[0];
    s[1] = t[2];
    s[2] = t[4];
    s[3] = t[6];
#else
    const vf p01 = SHUFFLE(a0, a1, 0, 1, 4, 5) + SHUFFLE(a0, a1, 2, 3, 6, 7);
    const vf p23 = SHUFFLE(a2, a3, 0, 1, 4, 5) + SHUFFLE(a2, a3, 2, 3, 6, 7);
    const vf t = SHUFFLE(p01, p23, 0, 2, 4, 6) + SHUFFLE(p01, p23, 1, 3, 5, 7);
    s[0] = t[0];
    s[1] = t[1];
    s[2] = t[2];
    s[3] = t[3];
#endif
}

/* The lane sums of `count` accumulators into sums[0 .. count - 1], four at a
 * time through reduce4 (the last group padded with zero vectors): every
 * output of every tile is summed by the same code, so the compiler's
 * reassociation (-fassociative-math) cannot make two tiles disagree. */
ALWAYS_INLINE void reduce_all(const vf *acc, float *sums, int count) {
    const vf zero = (vf){0};
    for (int i = 0; i < count; i += 4) {
        float s[4];
        reduce4(acc[i], i + 1 < count ? acc[i + 1] : zero, i + 2 < count ? acc[i + 2] : zero,
                i + 3 < count ? acc[i + 3] : zero, s);
        for (int j = 0; j < 4 && i + j < count; j++) sums[i + j] = s[j];
    }
}

/* Outputs n0 .. n0 + G - 1 of every input row: R x G accumulators, one
 * pass over G weight rows. R and G are constants, so the loops unroll and
 * the accumulators stay in registers. */
#define DEFINE_TILE(R, G)                                                                   \
    static void tile_##R##_##G(const Job *job, int64_t n0) {                                \
        const float *x = job->x, *w = job->w + n0 * job->w_stride;                          \
        const int64_t k = job->k, xs = job->x_stride, ws = job->w_stride;                   \
        vf acc[R][G];                                                                       \
        for (int r = 0; r < R; r++)                                                         \
            for (int g = 0; g < G; g++) acc[r][g] = (vf){0};                                \
        int64_t i = 0;                                                                      \
        for (; i + LANES <= k; i += LANES) {                                                \
            vf wv[G];                                                                       \
            for (int g = 0; g < G; g++) wv[g] = vload(w + g * ws + i);                      \
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
        for (int r = 0; r < R; r++)                                                         \
            for (int g = 0; g < G; g++) {                                                   \
                float s = sums[r][g];                                                       \
                if (job->bias) s += job->bias[n0 + g];                                      \
                job->y[r * job->y_stride + n0 + g] = s;                                     \
            }                                                                               \
    }

DEFINE_TILE(1, 8)
DEFINE_TILE(2, 8)
DEFINE_TILE(1, 1)
DEFINE_TILE(2, 1)
DEFINE_TILE(3, 1)
DEFINE_TILE(4, 1)

typedef void (*TileFn)(const Job *, int64_t);
/* Per row count: the tile of the bulk, its weight rows, and the one-row
 * tile of a chunk's remainder. */
static const TileFn BULK[MAX_ROWS + 1] = {0, tile_1_8, tile_2_8, tile_3_1, tile_4_1};
static const int BULK_WIDTH[MAX_ROWS + 1] = {0, 8, 8, 1, 1};
static const TileFn SINGLE[MAX_ROWS + 1] = {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1};

static void *work(void *arg) {
    Job *job = arg;
    const TileFn bulk = BULK[job->rows], single = SINGLE[job->rows];
    const int width = BULK_WIDTH[job->rows];
    int64_t first, last;
    while (claim_chunk(&job->next, job->n, job->chunk, &first, &last)) {
        int64_t n0 = first;
        for (; n0 + width <= last; n0 += width) bulk(job, n0);
        for (; n0 < last; n0++) single(job, n0);
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
