/* bfloat16 <-> fp32 for the CPU kernels, one value at a time (the vector
 * forms live with the kernels that need them). */
#ifndef DISAGG_BF16_H
#define DISAGG_BF16_H

#include <stdint.h>

static inline float bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } x;
    x.u = ((uint32_t)v) << 16;
    return x.f;
}

/* Round to nearest even, as torch rounds float -> bfloat16 (NaN stays NaN);
 * branch-free so loops over it vectorize. */
static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } x;
    x.f = f;
    const uint32_t rounded = (x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16;
    const uint32_t quiet = (x.u >> 16) | 0x40u;
    return (uint16_t)((x.u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

#endif
