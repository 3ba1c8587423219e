/* One decode step of a Mamba2 layer for CPU tensors in fp32: the causal
 * conv1d shift, SiLU, and the selective state update, for every sequence of
 * the step in one call (torch runs about twenty ops for it, several of them
 * passes over the whole `[b, H, P, N]` state).
 *
 * Per sequence b (one new token), with slot s = slots[b], o = out_slots[b]:
 *
 *   xbc row b   [ x: H * P | B: G * N | C: G * N ]   the in_proj columns
 *   conv        u[c] = silu(bias[c] + sum_k<K-1 w[c,k] conv[s,c,k] + w[c,K-1] xbc[b,c])
 *               conv[o, c, :] = (conv[s, c, 1:], xbc[b, c])
 *   per head h of group g = h / (H / G):
 *               dt  = clamp(softplus(dt_raw[b,h] + dt_bias[h]), dt_min, dt_max)
 *               S   = ssm[s, h] * exp(dt A[h]) + dt u_x[h, :, None] u_B[g, None, :]
 *               ssm[o, h] = S
 *               y[b, h, :] = S @ u_C[g] + D[h] u_x[h, :]
 *
 * Work items are (sequence, group) pairs: the conv channels of a group's
 * heads and its B and C rows belong to no other item, so items share
 * nothing and run on `threads` threads (see parallel.h). With o == s the
 * rows are updated in place; o != s (a speculative verify) leaves row s as
 * it was. Pools are strided views (conv `[slots, C, K - 1]`, ssm
 * `[slots, H, P, N]` with unit stride along N); strides are in elements.
 */
#include <math.h>
#include <stdint.h>

#include "parallel.h"

#define MAX_ITEM_CHANNELS 16384
#define MAX_KERNEL 8

typedef struct {
    const float *xbc, *dt_raw, *conv_w, *conv_b, *dt_bias, *A, *D;
    float *conv, *ssm, *y;
    const int64_t *slots, *out_slots;
    int64_t xbc_stride, dt_stride;
    int64_t conv_s0, conv_s1, conv_s2;
    int64_t ssm_s0, ssm_s1, ssm_s2;
    int64_t batch, heads, head_dim, groups, dstate, kernel;
    float dt_min, dt_max;
    int64_t next; /* next work item, atomic */
} Job;

static float silu(float v) { return v / (1.0f + expf(-v)); }

/* Conv of `count` channels from `first` into u. */
static void conv_channels(const Job *job, int64_t b, int64_t first, int64_t count, float *u) {
    const int64_t K = job->kernel;
    const float *x = job->xbc + b * job->xbc_stride;
    const float *in = job->conv + job->slots[b] * job->conv_s0;
    float *out = job->conv + job->out_slots[b] * job->conv_s0;
    for (int64_t i = 0; i < count; i++) {
        const int64_t c = first + i;
        const float *w = job->conv_w + c * K;
        const float *st = in + c * job->conv_s1;
        float window[MAX_KERNEL];
        for (int64_t k = 0; k < K - 1; k++) window[k] = st[k * job->conv_s2];
        window[K - 1] = x[c];
        float acc = job->conv_b ? job->conv_b[c] : 0.0f;
        for (int64_t k = 0; k < K; k++) acc += w[k] * window[k];
        float *dst = out + c * job->conv_s1;
        for (int64_t k = 0; k < K - 1; k++) dst[k * job->conv_s2] = window[k + 1];
        u[i] = silu(acc);
    }
}

static void ssm_head(const Job *job, int64_t b, int64_t h, const float *ux, const float *uB,
                     const float *uC) {
    const int64_t P = job->head_dim, N = job->dstate;
    float dt = job->dt_raw[b * job->dt_stride + h] + job->dt_bias[h];
    if (dt <= 20.0f) dt = log1pf(expf(dt)); /* torch's softplus threshold */
    dt = fminf(fmaxf(dt, job->dt_min), job->dt_max);
    const float decay = expf(dt * job->A[h]), d = job->D[h];
    const float *in = job->ssm + job->slots[b] * job->ssm_s0 + h * job->ssm_s1;
    float *out = job->ssm + job->out_slots[b] * job->ssm_s0 + h * job->ssm_s1;
    float *y = job->y + (b * job->heads + h) * P;
    for (int64_t p = 0; p < P; p++) {
        const float *s = in + p * job->ssm_s2;
        float *o = out + p * job->ssm_s2;
        const float dx = dt * ux[p];
        float acc = 0.0f;
        for (int64_t n = 0; n < N; n++) {
            const float v = s[n] * decay + dx * uB[n];
            o[n] = v;
            acc += v * uC[n];
        }
        y[p] = acc + d * ux[p];
    }
}

static void run_item(const Job *job, int64_t item) {
    const int64_t b = item / job->groups, g = item % job->groups;
    const int64_t per_group = job->heads / job->groups, P = job->head_dim, N = job->dstate;
    const int64_t x_width = job->heads * P, bc = job->groups * N;
    float u[MAX_ITEM_CHANNELS];
    float *ux = u, *uB = u + per_group * P, *uC = uB + N;
    conv_channels(job, b, g * per_group * P, per_group * P, ux);
    conv_channels(job, b, x_width + g * N, N, uB);
    conv_channels(job, b, x_width + bc + g * N, N, uC);
    for (int64_t i = 0; i < per_group; i++)
        ssm_head(job, b, g * per_group + i, ux + i * P, uB, uC);
}

static void *run_items(void *arg) {
    Job *job = (Job *)arg;
    int64_t first, last;
    const int64_t items = job->batch * job->groups;
    while (claim_chunk(&job->next, items, 1, &first, &last))
        for (int64_t item = first; item < last; item++) run_item(job, item);
    return NULL;
}

/* The step above for `batch` sequences; returns 0, or -1 when a group's
 * channels or the conv kernel exceed this file's limits (nothing written). */
int mamba_step(const float *xbc, int64_t xbc_stride, const float *dt_raw, int64_t dt_stride,
               float *conv, int64_t conv_s0, int64_t conv_s1, int64_t conv_s2,
               const float *conv_w, const float *conv_b, float *ssm, int64_t ssm_s0,
               int64_t ssm_s1, int64_t ssm_s2, const int64_t *slots, const int64_t *out_slots,
               const float *dt_bias, const float *A, const float *D, float dt_min, float dt_max,
               float *y, int64_t batch, int64_t heads, int64_t head_dim, int64_t groups,
               int64_t dstate, int64_t kernel, int threads) {
    if (kernel < 2 || kernel > MAX_KERNEL || groups < 1 || heads % groups)
        return -1;
    if ((heads / groups) * head_dim + 2 * dstate > MAX_ITEM_CHANNELS) return -1;
    Job job = {xbc,     dt_raw,  conv_w,  conv_b,     dt_bias,   A,        D,
               conv,    ssm,     y,       slots,      out_slots, xbc_stride, dt_stride,
               conv_s0, conv_s1, conv_s2, ssm_s0,     ssm_s1,    ssm_s2,   batch,
               heads,   head_dim, groups, dstate,     kernel,    dt_min,   dt_max,
               0};
    const int64_t items = batch * groups;
    return run_on_threads(run_items, &job, threads < items ? threads : (int)items) ? -1 : 0;
}
