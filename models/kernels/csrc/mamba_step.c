/* Mamba2 layer steps for CPU tensors in fp32: the causal conv1d shift, SiLU,
 * and the selective state update, for every sequence of the step in one call
 * (torch runs about twenty ops for a decode step, several of them passes over
 * the whole `[b, H, P, N]` state, and a prefill chunk as a chunked scan of
 * many more).
 *
 * Sequence b's tokens are the rows [row_begin[b], row_end[b]) of xbc, dt_raw
 * and y (NULL arrays: row b alone, a decode step); they run one after another,
 * the recurrence itself, each token reading the state the previous one wrote.
 * Per token row r, with slot s = slots[b] for the first token and
 * o = out_slots[b] (written by every token, read by the later ones):
 *
 *   xbc row r   [ x: H * P | B: G * N | C: G * N ]   the in_proj columns
 *   conv        u[c] = silu(bias[c] + sum_k<K-1 w[c,k] conv[s,c,k] + w[c,K-1] xbc[r,c])
 *               conv[o, c, :] = (conv[s, c, 1:], xbc[r, c])
 *   per head h of group g = h / (H / G):
 *               dt  = clamp(softplus(dt_raw[r,h] + dt_bias[h]), dt_min, dt_max)
 *               S   = ssm[s, h] * exp(dt A[h]) + dt u_x[h, :, None] u_B[g, None, :]
 *               ssm[o, h] = S
 *               y[r, h, :] = S @ u_C[g] + D[h] u_x[h, :]
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
#include <stdlib.h>

#include "lane_sums.h"
#include "parallel.h"

#define MAX_ITEM_CHANNELS 16384
#define MAX_KERNEL 8
/* Tokens of a prompt chunk buffered at a time, and the widest state row
 * (in vectors) the chunk path holds in registers. */
#define SCAN_TILE 32
#define MAX_STATE_VECS 16

typedef struct {
    const float *xbc, *dt_raw, *conv_w, *conv_b, *dt_bias, *A, *D;
    float *conv, *ssm, *y;
    const int64_t *slots, *out_slots, *row_begin, *row_end;
    int64_t xbc_stride, dt_stride;
    int64_t conv_s0, conv_s1, conv_s2;
    int64_t ssm_s0, ssm_s1, ssm_s2;
    int64_t batch, heads, head_dim, groups, dstate, kernel;
    float dt_min, dt_max;
    int64_t next; /* next work item, atomic */
} Job;

/* silu over u[0 .. count), LANES at a time (`vsilu`). */
static void silu_all(float *u, int64_t count) {
    int64_t i = 0;
    for (; i + LANES <= count; i += LANES) vstore(u + i, vsilu(vload(u + i)));
    for (; i < count; i++) u[i] = silu1(u[i]);
}

/* Conv of `count` channels from `first` of row r into u (before SiLU),
 * reading slot `in_slot`; K passed as a constant where it is the usual 4, so
 * the tap loops unroll. */
ALWAYS_INLINE void conv_channels_k(const Job *job, int64_t b, int64_t r, int64_t in_slot,
                                   int64_t first, int64_t count, float *u, const int64_t K) {
    const float *x = job->xbc + r * job->xbc_stride;
    const float *in = job->conv + in_slot * job->conv_s0;
    float *out = job->conv + job->out_slots[b] * job->conv_s0;
    const int64_t s1 = job->conv_s1, s2 = job->conv_s2;
    for (int64_t i = 0; i < count; i++) {
        const int64_t c = first + i;
        const float *w = job->conv_w + c * K;
        const float *st = in + c * s1;
        float window[MAX_KERNEL];
        for (int64_t k = 0; k < K - 1; k++) window[k] = st[k * s2];
        window[K - 1] = x[c];
        float acc = job->conv_b ? job->conv_b[c] : 0.0f;
        for (int64_t k = 0; k < K; k++) acc += w[k] * window[k];
        float *dst = out + c * s1;
        for (int64_t k = 0; k < K - 1; k++) dst[k * s2] = window[k + 1];
        u[i] = acc; /* activated by the caller (silu_all) */
    }
}

static void conv_channels(const Job *job, int64_t b, int64_t r, int64_t in_slot, int64_t first,
                          int64_t count, float *u) {
    if (job->kernel == 4)
        conv_channels_k(job, b, r, in_slot, first, count, u, 4);
    else
        conv_channels_k(job, b, r, in_slot, first, count, u, job->kernel);
}

/* dt of head h at row r: softplus (torch's threshold), then the clamp. */
static float head_dt(const Job *job, int64_t r, int64_t h) {
    float dt = job->dt_raw[r * job->dt_stride + h] + job->dt_bias[h];
    if (dt <= 20.0f) dt = log1pf(expf(dt));
    return fminf(fmaxf(dt, job->dt_min), job->dt_max);
}

static void ssm_head(const Job *job, int64_t b, int64_t r, int64_t in_slot, int64_t h,
                     const float *ux, const float *uB, const float *uC) {
    const int64_t P = job->head_dim, N = job->dstate;
    const float dt = head_dt(job, r, h);
    const float decay = expf(dt * job->A[h]), d = job->D[h];
    const float *in = job->ssm + in_slot * job->ssm_s0 + h * job->ssm_s1;
    float *out = job->ssm + job->out_slots[b] * job->ssm_s0 + h * job->ssm_s1;
    float *y = job->y + (r * job->heads + h) * P;
    int64_t p = 0;
    if (N % LANES == 0) {
        /* Four rows of the state at a time, their y sums in fixed lane order. */
        const vf vdecay = splat(decay);
        for (; p + 4 <= P; p += 4) {
            vf acc[4] = {{0}, {0}, {0}, {0}};
            for (int j = 0; j < 4; j++) {
                const float *st = in + (p + j) * job->ssm_s2;
                float *o = out + (p + j) * job->ssm_s2;
                const vf dx = splat(dt * ux[p + j]);
                for (int64_t n = 0; n < N; n += LANES) {
                    const vf v = vfma(vload(st + n), vdecay, dx * vload(uB + n));
                    vstore(o + n, v);
                    acc[j] = vfma(v, vload(uC + n), acc[j]);
                }
            }
            float sums[4];
            reduce4(acc[0], acc[1], acc[2], acc[3], sums);
            for (int j = 0; j < 4; j++) y[p + j] = sums[j] + d * ux[p + j];
        }
    }
    for (; p < P; p++) {
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

typedef struct {
    const Job *job;
    const float *buf, *steps, *in;
    float *out;
    int64_t ch, per_group, k, h, t0, count, p;
    float d;
} ScanRows;

/* State rows p .. p + 3 of head h through a tile's tokens: four independent
 * sums per token (one reduce4), each token's B and C read once for all four. */
ALWAYS_INLINE void scan_rows4(const ScanRows *r, const int64_t vecs) {
    const Job *job = r->job;
    const int64_t P = job->head_dim, N = job->dstate, k = r->k, p = r->p;
    vf state[4][MAX_STATE_VECS];
    for (int q = 0; q < 4; q++)
        for (int64_t j = 0; j < vecs; j++)
            state[q][j] = vload(r->in + (p + q) * job->ssm_s2 + j * LANES);
    for (int64_t i = 0; i < r->count; i++) {
        const float *u = r->buf + i * r->ch;
        const float *uB = u + r->per_group * P, *uC = uB + N;
        const vf decay = splat(r->steps[(i * r->per_group + k) * 2 + 1]);
        const float dt = r->steps[(i * r->per_group + k) * 2];
        vf acc[4] = {{0}, {0}, {0}, {0}};
        vf dx[4];
        for (int q = 0; q < 4; q++) dx[q] = splat(dt * u[k * P + p + q]);
        for (int64_t j = 0; j < vecs; j++) {
            const vf vB = vload(uB + j * LANES), vC = vload(uC + j * LANES);
            for (int q = 0; q < 4; q++) {
                state[q][j] = vfma(state[q][j], decay, dx[q] * vB);
                acc[q] = vfma(state[q][j], vC, acc[q]);
            }
        }
        float sums[4];
        reduce4(acc[0], acc[1], acc[2], acc[3], sums);
        float *y = job->y + ((r->t0 + i) * job->heads + r->h) * P + p;
        for (int q = 0; q < 4; q++) y[q] = sums[q] + r->d * u[k * P + p + q];
    }
    for (int q = 0; q < 4; q++)
        for (int64_t j = 0; j < vecs; j++)
            vstore(r->out + (p + q) * job->ssm_s2 + j * LANES, state[q][j]);
}

/* A prompt chunk's conv, LANES channels at a time. An item's channels are
 * three contiguous runs of xbc's columns (its heads' x, its group's B and
 * C), laid end to end in the `ch` columns of its buffers. `taps` holds the
 * item's conv weights tap-major (`taps[k * ch + i]`), `hist` the K - 1 inputs
 * before the chunk's first row (`hist[m * ch + i]`, row begin - (K - 1) + m,
 * from the conv state), so every tap of a token is a vector load. */
typedef struct {
    const Job *job;
    const float *taps, *hist, *bias;
    int64_t ch, begin;
    int64_t first[3], count[3], offset[3];
} ChunkConv;

static ChunkConv chunk_conv(const Job *job, int64_t b, int64_t g, int64_t begin, float *taps,
                            float *hist, float *bias) {
    const int64_t per_group = job->heads / job->groups, P = job->head_dim, N = job->dstate;
    const int64_t x_width = job->heads * P, bc = job->groups * N, K = job->kernel;
    const int64_t ch = per_group * P + 2 * N;
    ChunkConv conv = {job, taps, hist, job->conv_b ? bias : NULL, ch, begin,
                      {g * per_group * P, x_width + g * N, x_width + bc + g * N},
                      {per_group * P, N, N},
                      {0, per_group * P, per_group * P + N}};
    const float *state = job->conv + job->slots[b] * job->conv_s0;
    for (int run = 0; run < 3; run++)
        for (int64_t i = 0; i < conv.count[run]; i++) {
            const int64_t c = conv.first[run] + i, at = conv.offset[run] + i;
            for (int64_t k = 0; k < K; k++) taps[k * ch + at] = job->conv_w[c * K + k];
            for (int64_t m = 0; m < K - 1; m++)
                hist[m * ch + at] = state[c * job->conv_s1 + m * job->conv_s2];
            if (job->conv_b) bias[at] = job->conv_b[c];
        }
    return conv;
}

/* The input of buffer column `at` (xbc column c) at row j of the chunk. */
ALWAYS_INLINE const float *conv_input(const ChunkConv *conv, int64_t j, int64_t c, int64_t at) {
    if (j >= conv->begin) return conv->job->xbc + j * conv->job->xbc_stride + c;
    return conv->hist + (j - conv->begin + conv->job->kernel - 1) * conv->ch + at;
}

/* Row r's conv (before SiLU) of every channel of the item into u. */
static void conv_row(const ChunkConv *conv, int64_t r, float *u) {
    const int64_t K = conv->job->kernel, ch = conv->ch;
    for (int run = 0; run < 3; run++) {
        const int64_t c0 = conv->first[run], n = conv->count[run], off = conv->offset[run];
        const float *src[MAX_KERNEL];
        for (int64_t k = 0; k < K; k++) src[k] = conv_input(conv, r - (K - 1) + k, c0, off);
        int64_t i = 0;
        for (; i + LANES <= n; i += LANES) {
            vf acc = conv->bias ? vload(conv->bias + off + i) : (vf){0};
            for (int64_t k = 0; k < K; k++)
                acc = vfma(vload(conv->taps + k * ch + off + i), vload(src[k] + i), acc);
            vstore(u + off + i, acc);
        }
        for (; i < n; i++) {
            float acc = conv->bias ? conv->bias[off + i] : 0.0f;
            for (int64_t k = 0; k < K; k++) acc = fmaf(conv->taps[k * ch + off + i], src[k][i], acc);
            u[off + i] = acc;
        }
    }
}

/* The conv state of `out_slot` after the chunk's last row `end - 1`: its
 * last K - 1 inputs. */
static void conv_state_out(const ChunkConv *conv, int64_t end, int64_t out_slot) {
    const Job *job = conv->job;
    const int64_t K = job->kernel;
    float *state = job->conv + out_slot * job->conv_s0;
    for (int run = 0; run < 3; run++)
        for (int64_t m = 0; m < K - 1; m++) {
            const int64_t j = end - (K - 1) + m;
            for (int64_t i = 0; i < conv->count[run]; i++) {
                const int64_t c = conv->first[run] + i;
                state[c * job->conv_s1 + m * job->conv_s2] =
                    *conv_input(conv, j, c, conv->offset[run] + i);
            }
        }
}

/* Several tokens of one (sequence, group) item, SCAN_TILE at a time: first
 * every token's conv (`conv_row`: from the chunk's xbc rows and the K - 1
 * inputs before them, the conv state written once after the last row),
 * SiLU, dt and decay into a buffer, then per state row the tile's tokens with the
 * row held in vectors, so a token reads its B and C from the buffer instead
 * of streaming the whole `[P, N]` state of each head through the cache.
 * The arithmetic per element is ssm_head's. Returns -1 (nothing done) when
 * the buffer cannot be had. */
static int scan_item(const Job *job, int64_t b, int64_t g, int64_t begin, int64_t end) {
    const int64_t per_group = job->heads / job->groups, P = job->head_dim, N = job->dstate;
    const int64_t ch = per_group * P + 2 * N, vecs = N / LANES;
    const int64_t K = job->kernel;
    const size_t floats = (size_t)SCAN_TILE * (size_t)(ch + 2 * per_group) + (size_t)(2 * K) * ch;
    float *buf = malloc(floats * sizeof(float));
    if (!buf) return -1;
    float *steps = buf + SCAN_TILE * ch; /* per token and head: dt, decay */
    float *taps = steps + SCAN_TILE * 2 * per_group, *hist = taps + K * ch;
    const ChunkConv conv = chunk_conv(job, b, g, begin, taps, hist, hist + (K - 1) * ch);
    const int64_t slot = job->slots[b], out_slot = job->out_slots[b];
    for (int64_t t0 = begin; t0 < end; t0 += SCAN_TILE) {
        const int64_t count = end - t0 < SCAN_TILE ? end - t0 : SCAN_TILE;
        for (int64_t i = 0; i < count; i++) {
            const int64_t r = t0 + i;
            float *u = buf + i * ch;
            conv_row(&conv, r, u);
            silu_all(u, ch);
            for (int64_t k = 0; k < per_group; k++) {
                const int64_t h = g * per_group + k;
                const float dt = head_dt(job, r, h);
                steps[(i * per_group + k) * 2] = dt;
                steps[(i * per_group + k) * 2 + 1] = expf(dt * job->A[h]);
            }
        }
        const int64_t read_slot = t0 == begin ? slot : out_slot;
        for (int64_t k = 0; k < per_group; k++) {
            const int64_t h = g * per_group + k;
            const float d = job->D[h];
            const float *in = job->ssm + read_slot * job->ssm_s0 + h * job->ssm_s1;
            float *out = job->ssm + out_slot * job->ssm_s0 + h * job->ssm_s1;
            int64_t p = 0;
            /* Four rows at a time (see scan_rows4); N = 8 or 16 vectors
             * inlined with their count known, so the rows stay in registers. */
            for (; p + 4 <= P; p += 4) {
                const ScanRows rows = {job, buf, steps, in, out, ch, per_group, k, h, t0, count, p, d};
                if (vecs == 8)
                    scan_rows4(&rows, 8);
                else if (vecs == 16)
                    scan_rows4(&rows, 16);
                else
                    scan_rows4(&rows, vecs);
            }
            for (; p < P; p++) {
                vf state[MAX_STATE_VECS];
                for (int64_t j = 0; j < vecs; j++) state[j] = vload(in + p * job->ssm_s2 + j * LANES);
                for (int64_t i = 0; i < count; i++) {
                    const float *u = buf + i * ch;
                    const float *uB = u + per_group * P, *uC = uB + N;
                    const float x = u[k * P + p];
                    const vf decay = splat(steps[(i * per_group + k) * 2 + 1]);
                    const vf dx = splat(steps[(i * per_group + k) * 2] * x);
                    vf acc = {0};
                    for (int64_t j = 0; j < vecs; j++) {
                        state[j] = vfma(state[j], decay, dx * vload(uB + j * LANES));
                        acc = vfma(state[j], vload(uC + j * LANES), acc);
                    }
                    job->y[((t0 + i) * job->heads + h) * P + p] = hsum(acc) + d * x;
                }
                for (int64_t j = 0; j < vecs; j++) vstore(out + p * job->ssm_s2 + j * LANES, state[j]);
            }
        }
    }
    conv_state_out(&conv, end, out_slot);
    free(buf);
    return 0;
}

static void run_item(const Job *job, int64_t item) {
    const int64_t b = item / job->groups, g = item % job->groups;
    const int64_t per_group = job->heads / job->groups, P = job->head_dim, N = job->dstate;
    const int64_t x_width = job->heads * P, bc = job->groups * N;
    float u[MAX_ITEM_CHANNELS];
    float *ux = u, *uB = u + per_group * P, *uC = uB + N;
    const int64_t begin = job->row_begin ? job->row_begin[b] : b;
    const int64_t end = job->row_end ? job->row_end[b] : b + 1;
    if (end - begin > 1 && N % LANES == 0 && N / LANES <= MAX_STATE_VECS &&
        scan_item(job, b, g, begin, end) == 0)
        return;
    for (int64_t r = begin; r < end; r++) {
        const int64_t in_slot = r == begin ? job->slots[b] : job->out_slots[b];
        conv_channels(job, b, r, in_slot, g * per_group * P, per_group * P, ux);
        conv_channels(job, b, r, in_slot, x_width + g * N, N, uB);
        conv_channels(job, b, r, in_slot, x_width + bc + g * N, N, uC);
        silu_all(u, per_group * P + 2 * N);
        for (int64_t i = 0; i < per_group; i++)
            ssm_head(job, b, r, in_slot, g * per_group + i, ux + i * P, uB, uC);
    }
}

static void *run_items(void *arg) {
    Job *job = (Job *)arg;
    int64_t first, last;
    const int64_t items = job->batch * job->groups;
    while (claim_chunk(&job->next, items, 1, &first, &last))
        for (int64_t item = first; item < last; item++) run_item(job, item);
    return NULL;
}

/* The steps above for `batch` sequences; returns 0, or -1 when a group's
 * channels or the conv kernel exceed this file's limits (nothing written). */
int mamba_step(const float *xbc, int64_t xbc_stride, const float *dt_raw, int64_t dt_stride,
               float *conv, int64_t conv_s0, int64_t conv_s1, int64_t conv_s2,
               const float *conv_w, const float *conv_b, float *ssm, int64_t ssm_s0,
               int64_t ssm_s1, int64_t ssm_s2, const int64_t *slots, const int64_t *out_slots,
               const int64_t *row_begin, const int64_t *row_end,
               const float *dt_bias, const float *A, const float *D, float dt_min, float dt_max,
               float *y, int64_t batch, int64_t heads, int64_t head_dim, int64_t groups,
               int64_t dstate, int64_t kernel, int threads) {
    if (kernel < 2 || kernel > MAX_KERNEL || groups < 1 || heads % groups)
        return -1;
    if ((heads / groups) * head_dim + 2 * dstate > MAX_ITEM_CHANNELS) return -1;
    Job job = {xbc,        dt_raw,    conv_w,     conv_b,   dt_bias,  A,        D,
               conv,       ssm,       y,          slots,    out_slots, row_begin, row_end,
               xbc_stride, dt_stride, conv_s0,    conv_s1,  conv_s2,  ssm_s0,   ssm_s1,
               ssm_s2,     batch,     heads,      head_dim, groups,   dstate,   kernel,
               dt_min,     dt_max,    0};
    const int64_t items = batch * groups;
    return run_on_threads(run_items, &job, threads < items ? threads : (int)items) ? -1 : 0;
}
