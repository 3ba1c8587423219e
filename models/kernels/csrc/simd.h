/* Portable vector helpers for the CPU kernels (GCC/Clang vector extensions):
 * LANES floats per vector (16 with AVX-512, 8 with AVX, else 4), unaligned
 * loads and stores, fused multiply-add, lane-wise max, horizontal
 * reductions and a vectorized exp for non-positive arguments.
 */
#ifndef DISAGG_SIMD_H
#define DISAGG_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__FMA__) || defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__ARM_FEATURE_FMA) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#if defined(__AVX512F__)
#define LANES 16
#elif defined(__AVX__)
#define LANES 8
#else
#define LANES 4
#endif

typedef float vf __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));

#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#else
#define SHUFFLE(x, y, ...) __builtin_shuffle(x, y, (vi){__VA_ARGS__})
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Unaligned loads and stores: memcpy compiles to one vector move. */
ALWAYS_INLINE vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

ALWAYS_INLINE void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* The first `count` (< LANES) floats at p, the other lanes zero. */
ALWAYS_INLINE vf vload_head(const float *p, int64_t count) {
    vf v = {0};
    memcpy(&v, p, (size_t)count * sizeof(float));
    return v;
}

ALWAYS_INLINE vf splat(float f) { return (vf){0} + f; }

/* a * b + c, rounded once where the CPU has fused multiply-add. Written
 * `a * b + c`, whether the compiler fuses depends on the code around it
 * (GCC tuned for AMD Zen keeps the product of a loop-carried sum apart),
 * so the same sum may round differently in two functions; this one fuses
 * in every caller, or nowhere. */
ALWAYS_INLINE vf vfma(vf a, vf b, vf c) {
#if LANES == 16
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif LANES == 8 && defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif LANES == 4 && defined(__FMA__)
    return (vf)_mm_fmadd_ps((__m128)a, (__m128)b, (__m128)c);
#elif LANES == 4 && defined(__ARM_FEATURE_FMA) && defined(__ARM_NEON)
    return (vf)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#else
    return a * b + c;
#endif
}

ALWAYS_INLINE vf vmax(vf a, vf b) {
    const vi take_a = a > b;
    return (vf)((take_a & (vi)a) | (~take_a & (vi)b));
}

ALWAYS_INLINE float hsum(vf v) {
    float total = 0.0f;
    for (int i = 0; i < LANES; i++) total += v[i];
    return total;
}

ALWAYS_INLINE float hmax(vf v) {
    float peak = v[0];
    for (int i = 1; i < LANES; i++) peak = v[i] > peak ? v[i] : peak;
    return peak;
}

/* exp(x) for x <= 0 (Cephes expf: Cody-Waite reduction, degree-5 polynomial,
 * about 1 ulp); x below -87 (including -inf) gives 0. */
ALWAYS_INLINE vf vexp_nonpositive(vf x) {
    const vi underflow = x < -87.0f;
    x = vmax(x, splat(-87.0f));
    /* x <= 0, so truncating x * log2(e) - 0.5 rounds to nearest. */
    const vi n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, vi);
    const vf nf = __builtin_convertvector(n, vf);
    const vf r = x - nf * 0.693359375f + nf * 2.12194440e-4f;
    vf p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const vf e = (p * r * r + r + 1.0f) * (vf)((n + 127) << 23);
    return (vf)((vi)e & ~underflow);
}

/* v * sigmoid(v) of one value, for the tails of the vector loops below. */
ALWAYS_INLINE float silu1(float v) { return v / (1.0f + expf(-v)); }

/* v * sigmoid(v), the sigmoid from exp(-|v|) (a non-positive argument). */
ALWAYS_INLINE vf vsilu(vf v) {
    const vi negative = v < 0.0f;
    const vf magnitude = (vf)((vi)v & (vi)splat(-0.0f) ^ (vi)v);
    const vf e = vexp_nonpositive(-magnitude);
    const vf one = splat(1.0f);
    const vf up = one / (one + e), down = e / (one + e);
    return v * (vf)(((vi)down & negative) | ((vi)up & ~negative));
}

#endif
