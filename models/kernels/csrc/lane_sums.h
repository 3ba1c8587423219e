/* Lane sums of accumulator vectors in one fixed order, for the CPU kernels
 * whose outputs must not depend on the tile that computed them: the same
 * shuffles and adds sum every accumulator, so the compiler's reassociation
 * (-fassociative-math) cannot make two tiles disagree.
 */
#ifndef DISAGG_LANE_SUMS_H
#define DISAGG_LANE_SUMS_H

#include "simd.h"

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

#endif
