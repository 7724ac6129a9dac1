/* RMSNorm of many rows in one pass over each (docs/model.md), for `model.transformer.RMSNorm` on a
 * prompt's rows:
 *
 *   out[r, :] = x[r, :] * (1 / sqrt(mean(x[r, :]^2) + eps)) * weight
 *
 * x (rows, C) contiguous, fp32 or bf16 (widened exactly); weight (C,) fp32; out in x's dtype, a bf16
 * result rounded once to nearest even. The sum of squares is fp32 in 16 running partial sums (so the
 * compiler vectorises it without reordering anything it was not told to), added up in a fixed order:
 * PyTorch's `F.rms_norm` sums in another order, so results differ from it by float rounding. Where
 * PyTorch's CPU rms_norm makes six passes over the rows (and a bf16 model two more for the casts), this
 * reads each row twice from cache and writes it once. Plain C that compilers vectorise: built for every
 * CPU.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#include "vec.h"

#define PART 16 /* partial sums, and the block the rows are read in */
#define MAX_C 8192

/* Returns 0, or -1 for a row wider than MAX_C (nothing written). */
int gl_rms_norm(const void *x, int bf16, int64_t rows, int64_t C, const float *weight, float eps, void *out) {
    if (C > MAX_C || C % PART) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float row[MAX_C];
        const float *v = row;
        if (bf16)
            for (int64_t i = 0; i < C; i++) row[i] = widen(((const uint16_t *)x)[r * C + i]);
        else
            v = (const float *)x + r * C;
        float part[PART] = {0};
        for (int64_t i = 0; i < C; i += PART)
            for (int j = 0; j < PART; j++) part[j] += v[i + j] * v[i + j];
        float ss = 0.0f;
        for (int j = 0; j < PART; j++) ss += part[j];
        const float inv = 1.0f / sqrtf(ss / (float)C + eps);
        if (bf16) {
            uint16_t *o = (uint16_t *)out + r * C;
            for (int64_t i = 0; i < C; i++) o[i] = to_bf16(v[i] * inv * weight[i]);
        } else {
            float *o = (float *)out + r * C;
            for (int64_t i = 0; i < C; i++) o[i] = v[i] * inv * weight[i];
        }
    }
    return 0;
}
