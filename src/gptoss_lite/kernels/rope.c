/* The rotary embedding of a prompt's queries or keys in one pass (docs/model.md), for
 * `model.rope.apply_rotary_tables` eagerly:
 *
 *   out[b, h, t, :] = x[b, h, t, :] * cos[t, :] + swap_halves(x[b, h, t, :]) * sin[t, :]
 *
 * with the full-width tables of `rope.rotary_tables` (cos | cos, -sin | sin), x (B, H, T, D) at any
 * strides with unit stride along D, fp32 or bf16 (widened exactly), tables (T, D) fp32, out (B, H, T, D)
 * contiguous in x's dtype. Each value is two fp32 products and their sum, rounded as PyTorch's three
 * ops round them (the build does not fuse them: -std=c11 keeps floating-point contraction off), and a
 * bf16 result rounded once to nearest even: bit-identical to `apply_rotary_tables`, which reads x four
 * times and writes three temporaries where this reads it once. Plain C that compilers vectorise: built
 * for every CPU.
 */
#include <stdint.h>
#include <string.h>
#include <omp.h>
#include "vec.h"

#define MAX_D 1024

/* Returns 0, or -1 for an odd or too wide D (nothing written). */
int gl_rotary(const void *x, int bf16, int64_t B, int64_t H, int64_t T, int64_t D, int64_t sb, int64_t sh,
              int64_t st, const float *cos_full, const float *sin_signed, void *out) {
    if (D % 2 || D <= 0 || D > MAX_D) return -1;
    const int64_t half = D / 2;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t bh = 0; bh < B * H; bh++) {
        for (int64_t t = 0; t < T; t++) {
            const int64_t at = (bh / H) * sb + (bh % H) * sh + t * st;
            float v[MAX_D], r[MAX_D];
            if (bf16)
                for (int64_t d = 0; d < D; d++) v[d] = widen(((const uint16_t *)x)[at + d]);
            else
                memcpy(v, (const float *)x + at, (size_t)D * sizeof(float));
            const float *c = cos_full + t * D, *s = sin_signed + t * D;
            for (int64_t d = 0; d < half; d++) {
                const float a = v[d] * c[d], b = v[d + half] * s[d];
                r[d] = a + b;
            }
            for (int64_t d = half; d < D; d++) {
                const float a = v[d] * c[d], b = v[d - half] * s[d];
                r[d] = a + b;
            }
            const int64_t o = (bh * T + t) * D;
            if (bf16)
                for (int64_t d = 0; d < D; d++) ((uint16_t *)out)[o + d] = to_bf16(r[d]);
            else
                memcpy((float *)out + o, r, (size_t)D * sizeof(float));
        }
    }
    return 0;
}
