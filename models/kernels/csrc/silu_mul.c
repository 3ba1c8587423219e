/* SwiGLU's activation for CPU tensors, in fp32 or bf16, over the output of
 * the fused gate/up product:
 *
 *   in row r    [ gate: n values | up: n values ]   at in + r * in_stride
 *   out row r   silu(gate) * up: n values           at out + r * out_stride
 *
 * torch computes this as `F.silu(gate).mul_(up)`: two passes and a buffer
 * between them; here it is one pass per row. silu(g) = g * sigmoid(g), with
 * the sigmoid from exp(-|g|), which never overflows:
 *
 *   e = exp(-|g|)    sigmoid(g) = 1 / (1 + e) for g >= 0,  e / (1 + e) below
 *
 * Values agree with torch's to about an ulp (its silu is g / (1 + exp(-g))).
 * bf16 rounds as torch does: silu's result to bf16, then the product.
 *
 * Rows are independent; large inputs are split over `threads` threads (see
 * parallel.h). Row strides are in elements; each row is contiguous.
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "parallel.h"
#include "simd.h"

#define ROWS_PER_CHUNK 8

typedef struct {
    int is_bf16;
    const void *in;
    void *out;
    int64_t rows, width, in_stride, out_stride;
    int64_t next; /* first row of the next chunk, atomic */
} Job;

ALWAYS_INLINE vf silu(vf g) {
    const vi negative = g < 0.0f;
    const vf e = vexp_nonpositive((vf)((vi)g | (vi)splat(-0.0f)));
    const vf numerator = (vf)((negative & (vi)e) | (~negative & (vi)splat(1.0f)));
    return g * (numerator / (1.0f + e));
}

/* `count` <= LANES values: widened into zero-padded vectors, then narrowed. */
static void silu_mul_f32(const float *gate, const float *up, float *out, int64_t count) {
    if (count == LANES) {
        vstore(out, silu(vload(gate)) * vload(up));
        return;
    }
    float g[LANES] = {0}, u[LANES] = {0}, y[LANES];
    memcpy(g, gate, count * sizeof(float));
    memcpy(u, up, count * sizeof(float));
    vstore(y, silu(vload(g)) * vload(u));
    memcpy(out, y, count * sizeof(float));
}

static void silu_mul_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *out,
                          int64_t count) {
    float g[LANES] = {0}, s[LANES];
    for (int64_t i = 0; i < count; i++) g[i] = bf16_to_f32(gate[i]);
    vstore(s, silu(vload(g)));
    for (int64_t i = 0; i < count; i++) {
        const float rounded = bf16_to_f32(f32_to_bf16(s[i]));
        out[i] = f32_to_bf16(rounded * bf16_to_f32(up[i]));
    }
}

static void silu_mul_row(const Job *job, int64_t r) {
    const int64_t n = job->width;
    for (int64_t i = 0; i < n; i += LANES) {
        const int64_t count = n - i < LANES ? n - i : LANES;
        if (job->is_bf16) {
            const uint16_t *row = (const uint16_t *)job->in + r * job->in_stride;
            uint16_t *out = (uint16_t *)job->out + r * job->out_stride;
            silu_mul_bf16(row + i, row + n + i, out + i, count);
        } else {
            const float *row = (const float *)job->in + r * job->in_stride;
            float *out = (float *)job->out + r * job->out_stride;
            silu_mul_f32(row + i, row + n + i, out + i, count);
        }
    }
}

static void *run_rows(void *arg) {
    Job *job = (Job *)arg;
    int64_t first, last;
    while (claim_chunk(&job->next, job->rows, ROWS_PER_CHUNK, &first, &last))
        for (int64_t r = first; r < last; r++) silu_mul_row(job, r);
    return NULL;
}

/* out[r] = silu(in[r][:width]) * in[r][width:2 * width]; returns 0. */
int silu_mul(int is_bf16, const void *in, int64_t in_stride, void *out, int64_t out_stride,
              int64_t rows, int64_t width, int threads) {
    Job job = {is_bf16, in, out, rows, width, in_stride, out_stride, 0};
    const int64_t chunks = (rows + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK;
    return run_on_threads(run_rows, &job, threads < chunks ? threads : (int)chunks);
}
