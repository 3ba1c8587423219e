/* SwiGLU's activation for CPU tensors, in fp32 or bf16, over the output of
 * the fused gate/up product:
 *
 *   in row r    [ gate: n values | up: n values ]   at in + r * in_stride
 *   out row r   silu(gate) * up: n values           at out + r * out_stride
 *
 * torch computes this as `F.silu(gate).mul_(up)`: two passes and a buffer
 * between them; here it is one pass per row. silu(g) = g * sigmoid(g), with
 * the sigmoid from exp(-|g|), which never overflows (`vsilu` in simd.h):
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

static void silu_mul_row_f32(const Job *job, int64_t r) {
    const int64_t n = job->width;
    const float *gate = (const float *)job->in + r * job->in_stride, *up = gate + n;
    float *out = (float *)job->out + r * job->out_stride;
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) vstore(out + i, vsilu(vload(gate + i)) * vload(up + i));
    if (i == n) return;
    /* The last n - i < LANES values, through zero-padded vectors. */
    float g[LANES] = {0}, u[LANES] = {0}, y[LANES];
    memcpy(g, gate + i, (n - i) * sizeof(float));
    memcpy(u, up + i, (n - i) * sizeof(float));
    vstore(y, vsilu(vload(g)) * vload(u));
    memcpy(out + i, y, (n - i) * sizeof(float));
}

static void silu_mul_row_bf16(const Job *job, int64_t r) {
    const int64_t n = job->width;
    const uint16_t *gate = (const uint16_t *)job->in + r * job->in_stride, *up = gate + n;
    uint16_t *out = (uint16_t *)job->out + r * job->out_stride;
    for (int64_t i = 0; i < n; i += LANES) {
        const int64_t count = n - i < LANES ? n - i : LANES;
        float g[LANES] = {0}, s[LANES];
        for (int64_t j = 0; j < count; j++) g[j] = bf16_to_f32(gate[i + j]);
        vstore(s, vsilu(vload(g)));
        for (int64_t j = 0; j < count; j++) {
            const float rounded = bf16_to_f32(f32_to_bf16(s[j]));
            out[i + j] = f32_to_bf16(rounded * bf16_to_f32(up[i + j]));
        }
    }
}

static void *run_rows(void *arg) {
    Job *job = (Job *)arg;
    int64_t first, last;
    while (claim_chunk(&job->next, job->rows, ROWS_PER_CHUNK, &first, &last))
        for (int64_t r = first; r < last; r++) {
            if (job->is_bf16)
                silu_mul_row_bf16(job, r);
            else
                silu_mul_row_f32(job, r);
        }
    return NULL;
}

/* out[r] = silu(in[r][:width]) * in[r][width:2 * width]; returns 0. */
int silu_mul(int is_bf16, const void *in, int64_t in_stride, void *out, int64_t out_stride,
             int64_t rows, int64_t width, int threads) {
    Job job = {is_bf16, in, out, rows, width, in_stride, out_stride, 0};
    const int64_t chunks = (rows + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK;
    return run_on_threads(run_rows, &job, threads < chunks ? threads : (int)chunks);
}
