/* RMSNorm for CPU tensors, optionally after a residual add, in fp32 or bf16,
 * with the reference models' rounding. Over a row x of n values:
 *
 *   y   = x * 1/sqrt(mean(x^2) + eps)     fp32, rounded once to the dtype
 *   out = weight * y                      fp32 product, rounded to the dtype
 *
 * which is what `weight * (x.float() * rsqrt(...)).to(dtype)` computes in
 * torch. The fused form first stores `residual = x + residual` (rounded to
 * the dtype, as a torch add is) and normalizes that sum, so a decoder layer's
 * residual add and the next norm read the row once.
 *
 * Rows are independent; large inputs are split over `threads` threads (see parallel.h).
 * Row strides are in elements; each row is contiguous.
 */
#include <math.h>
#include "bf16.h"
#include "parallel.h"
#include "simd.h"
#include <stdint.h>

#define MAX_WIDTH 16384
#define ROWS_PER_CHUNK 8

typedef struct {
    int is_bf16;
    const void *x, *weight;
    void *residual, *out;
    int64_t rows, width, x_stride, residual_stride, out_stride;
    float eps;
    int64_t next; /* first row of the next chunk, atomic */
} Job;

static void norm_row_f32(const Job *job, int64_t r) {
    const int64_t n = job->width;
    const float *x = (const float *)job->x + r * job->x_stride;
    const float *w = (const float *)job->weight;
    float *out = (float *)job->out + r * job->out_stride;
    float row[MAX_WIDTH], sum = 0.0f;
    if (job->residual != NULL) {
        float *res = (float *)job->residual + r * job->residual_stride;
        for (int64_t i = 0; i < n; i++) {
            res[i] += x[i];
            row[i] = res[i];
        }
    } else {
        for (int64_t i = 0; i < n; i++) row[i] = x[i];
    }
    for (int64_t i = 0; i < n; i++) sum += row[i] * row[i];
    const float inv = 1.0f / sqrtf(sum / (float)n + job->eps);
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (row[i] * inv);
}

static void norm_row_bf16(const Job *job, int64_t r) {
    const int64_t n = job->width;
    const uint16_t *x = (const uint16_t *)job->x + r * job->x_stride;
    const uint16_t *w = (const uint16_t *)job->weight;
    uint16_t *out = (uint16_t *)job->out + r * job->out_stride;
    float row[MAX_WIDTH], sum = 0.0f;
    if (job->residual != NULL) {
        uint16_t *res = (uint16_t *)job->residual + r * job->residual_stride;
        for (int64_t i = 0; i < n; i++) {
            res[i] = f32_to_bf16(bf16_to_f32(res[i]) + bf16_to_f32(x[i]));
            row[i] = bf16_to_f32(res[i]);
        }
    } else {
        for (int64_t i = 0; i < n; i++) row[i] = bf16_to_f32(x[i]);
    }
    for (int64_t i = 0; i < n; i++) sum += row[i] * row[i];
    const float inv = 1.0f / sqrtf(sum / (float)n + job->eps);
    for (int64_t i = 0; i < n; i++) {
        const float y = bf16_to_f32(f32_to_bf16(row[i] * inv));
        out[i] = f32_to_bf16(bf16_to_f32(w[i]) * y);
    }
}

static void *run_rows(void *arg) {
    Job *job = (Job *)arg;
    int64_t first, last;
    while (claim_chunk(&job->next, job->rows, ROWS_PER_CHUNK, &first, &last)) {
        for (int64_t r = first; r < last; r++) {
            if (job->is_bf16)
                norm_row_bf16(job, r);
            else
                norm_row_f32(job, r);
        }
    }
    return NULL;
}

/* out[r] = RMSNorm(x[r]); with residual != NULL, first residual[r] += x[r]
 * and normalize residual[r]. Returns 1 when rows are wider than MAX_WIDTH. */
int rms_norm(int is_bf16, const void *x, int64_t x_stride, void *residual,
             int64_t residual_stride, const void *weight, void *out, int64_t out_stride,
             int64_t rows, int64_t width, float eps, int threads) {
    if (width > MAX_WIDTH) return 1;
    Job job = {is_bf16, x, weight, residual, out, rows, width, x_stride, residual_stride,
               out_stride, eps, 0};
    const int64_t chunks = (rows + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK;
    run_on_threads(run_rows, &job, threads < chunks ? threads : (int)chunks);
    return 0;
}

/* Mamba2's gated grouped RMSNorm (transformers' `norm_before_gate=False`):
 * over each group of `group` channels of a row,
 *
 *   h   = x * silu(z)                         fp32 (x is the fp32 scan output)
 *   out = weight * (h / sqrt(mean(h^2) + eps))  fp32, rounded once to out's dtype
 *
 * where z, weight and out are bf16 (x stays fp32): the norm runs on the fp32
 * scan output and only its result is rounded. z rows may be strided
 * (in_proj's columns). */
typedef struct {
    int is_bf16;
    const float *x;
    const void *z, *weight;
    void *out;
    int64_t rows, width, group, x_stride, z_stride, out_stride;
    float eps;
    int64_t next;
} GatedJob;

static void gated_row(const GatedJob *job, int64_t r) {
    const int64_t n = job->width, G = job->group;
    const float *x = job->x + r * job->x_stride;
    float h[MAX_WIDTH];
    const float *z = (const float *)job->z + r * job->z_stride;
    if (job->is_bf16) { /* the gate row in fp32 first, in h (overwritten in place below) */
        const uint16_t *zb = (const uint16_t *)job->z + r * job->z_stride;
        for (int64_t i = 0; i < n; i++) h[i] = bf16_to_f32(zb[i]);
        z = h;
    }
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) vstore(h + i, vload(x + i) * vsilu(vload(z + i)));
    for (; i < n; i++) h[i] = x[i] * silu1(z[i]);
    for (int64_t g0 = 0; g0 < n; g0 += G) {
        float sum = 0.0f;
        for (int64_t i = g0; i < g0 + G; i++) sum += h[i] * h[i];
        const float inv = 1.0f / sqrtf(sum / (float)G + job->eps);
        if (job->is_bf16) {
            const uint16_t *w = (const uint16_t *)job->weight;
            uint16_t *out = (uint16_t *)job->out + r * job->out_stride;
            for (int64_t i = g0; i < g0 + G; i++)
                out[i] = f32_to_bf16(bf16_to_f32(w[i]) * (h[i] * inv));
        } else {
            const float *w = (const float *)job->weight;
            float *out = (float *)job->out + r * job->out_stride;
            for (int64_t i = g0; i < g0 + G; i++) out[i] = w[i] * (h[i] * inv);
        }
    }
}

static void *run_gated_rows(void *arg) {
    GatedJob *job = (GatedJob *)arg;
    int64_t first, last;
    while (claim_chunk(&job->next, job->rows, ROWS_PER_CHUNK, &first, &last))
        for (int64_t r = first; r < last; r++) gated_row(job, r);
    return NULL;
}

/* out[r] = the gated grouped RMSNorm of x[r] and z[r] (above). Returns 1
 * when rows are wider than MAX_WIDTH or the group does not divide them. */
int gated_rms_norm(int is_bf16, const float *x, int64_t x_stride, const void *z,
                   int64_t z_stride, const void *weight, void *out, int64_t out_stride,
                   int64_t rows, int64_t width, int64_t group, float eps, int threads) {
    if (width > MAX_WIDTH || group < 1 || width % group) return 1;
    GatedJob job = {is_bf16, x, z, weight, out, rows, width, group, x_stride, z_stride,
                    out_stride, eps, 0};
    const int64_t chunks = (rows + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK;
    run_on_threads(run_gated_rows, &job, threads < chunks ? threads : (int)chunks);
    return 0;
}
