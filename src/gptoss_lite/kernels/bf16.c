/* bf16 matrix-vector products for gptoss-lite's one-token steps (docs/mxfp4.md#dense-weights).
 *
 * out[m, r] = sum_k W[r, k] * x[m, k] (+ bias[r]) for a few rows x (M, K) and an out-major weight W
 * (R, K), both bf16, out fp32. A bf16 product is exact in fp32 and the sums are fp32, which is what a
 * bf16 GEMM with fp32 accumulation computes: only the order of the additions differs. Two paths
 * (gl_has_bf16_gemv says whether either is built):
 * - AVX-512 BF16: dot-product instructions, 32 pairs each. There oneDNN's bf16 GEMV reads 14-16 GB/s
 *   where this reads at the memory's rate.
 * - AVX2 + FMA (AVX2-only CPUs, and AVX-512 ones without BF16): each 32-bit lane of 16 weights holds two
 *   of them, its low bits shifted up and its high bits masked are their fp32 values (a bf16 is the top
 *   half of an fp32), multiplied by x's even and odd columns, widened and split once a call. Where
 *   this path is not built, the product is torch's (on AVX2, the compiled step's reductions read ~29
 *   GB/s of bf16 weight on Zen 5).
 */
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>
#include "vec.h"
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>
#define GL_AVX512BF16 1
#elif defined(GL_AVX2)
#define GL_AVX2_GEMV 1
#endif

#define MAX_ROWS 4
/* The weight is prefetched this many bytes ahead of the pair of vectors being read (past a row's end
 * too: the rows of a thread's tiles follow each other), more loads in flight than the hardware
 * prefetcher keeps alone. Zen 5, 2 threads, benchmarks/bf16_gemv_ab.py: gpt-oss-20b's per-layer
 * projections (1 x 5120 x 2880, 1 x 2880 x 4096) 1.04-1.08x faster at 2-8 KB ahead, 1.00x at 1 KB; its
 * 1.16 GB head 0.98-1.04x. */
#ifndef GEMV_AHEAD
#define GEMV_AHEAD 4096
#endif

/* 2: the AVX-512 BF16 path, 1: the AVX2 one, 0: neither (the op is not bound) */
int gl_has_bf16_gemv(void) {
#if defined(GL_AVX512BF16)
    return 2;
#elif defined(GL_AVX2_GEMV)
    return 1;
#else
    return 0;
#endif
}

#if defined(GL_AVX2_GEMV)
/* Each 16 columns of x's rows (K of them; the last K % 16 as they are) widened to fp32 as 8 even ones
 * then 8 odd ones: the order in which `dots` widens a weight's 16 bf16 values. */
static void split_columns(const uint16_t *x, int64_t M, int64_t K, float *xs) {
    const int64_t full = K / 16;
    for (int64_t m = 0; m < M; m++) {
        const uint16_t *src = x + m * K;
        float *dst = xs + m * K;
        for (int64_t c = 0; c < full; c++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(src + 16 * c));
            _mm256_storeu_ps(dst + 16 * c, bf16_even8(v));
            _mm256_storeu_ps(dst + 16 * c + 8, bf16_odd8(v));
        }
        for (int64_t k = 16 * full; k < K; k++) dst[k] = widen(src[k]);
    }
}

/* out[j] = row . x_j over K columns for n (constant once inlined) rows of split x, K / 16 16-column
 * steps. Four sums a row for one or two rows (a single sum would wait on each FMA's latency), two for
 * more: every sum stays in a register (16 of them on this path). */
INLINE void dots(const uint16_t *row, const float *xs, int64_t K, int n, float *out) {
    const __m256 z = _mm256_setzero_ps();
    __m256 s0[MAX_ROWS] = {z, z, z, z}, s1[MAX_ROWS] = {z, z, z, z};
    __m256 s2[MAX_ROWS] = {z, z, z, z}, s3[MAX_ROWS] = {z, z, z, z};
    const int64_t full = K / 16;
    int64_t c = 0;
    for (; c + 1 < full; c += 2) {
        _mm_prefetch((const char *)(row + 16 * c) + GEMV_AHEAD, _MM_HINT_T0);
        __m256i w0 = _mm256_loadu_si256((const __m256i *)(row + 16 * c));
        __m256i w1 = _mm256_loadu_si256((const __m256i *)(row + 16 * c + 16));
        __m256 e0 = bf16_even8(w0), o0 = bf16_odd8(w0), e1 = bf16_even8(w1), o1 = bf16_odd8(w1);
        for (int j = 0; j < n; j++) {
            const float *xj = xs + j * K + 16 * c;
            s0[j] = _mm256_fmadd_ps(e0, _mm256_loadu_ps(xj), s0[j]);
            s1[j] = _mm256_fmadd_ps(o0, _mm256_loadu_ps(xj + 8), s1[j]);
            if (n <= 2) {
                s2[j] = _mm256_fmadd_ps(e1, _mm256_loadu_ps(xj + 16), s2[j]);
                s3[j] = _mm256_fmadd_ps(o1, _mm256_loadu_ps(xj + 24), s3[j]);
            } else {
                s0[j] = _mm256_fmadd_ps(e1, _mm256_loadu_ps(xj + 16), s0[j]);
                s1[j] = _mm256_fmadd_ps(o1, _mm256_loadu_ps(xj + 24), s1[j]);
            }
        }
    }
    if (c < full) {
        __m256i w0 = _mm256_loadu_si256((const __m256i *)(row + 16 * c));
        __m256 e0 = bf16_even8(w0), o0 = bf16_odd8(w0);
        for (int j = 0; j < n; j++) {
            s0[j] = _mm256_fmadd_ps(e0, _mm256_loadu_ps(xs + j * K + 16 * c), s0[j]);
            s1[j] = _mm256_fmadd_ps(o0, _mm256_loadu_ps(xs + j * K + 16 * c + 8), s1[j]);
        }
    }
    for (int j = 0; j < n; j++) {
        float sum = hsum256(_mm256_add_ps(_mm256_add_ps(s0[j], s1[j]), _mm256_add_ps(s2[j], s3[j])));
        for (int64_t k = 16 * full; k < K; k++) sum += widen(row[k]) * xs[j * K + k];
        out[j] = sum;
    }
}
#endif

void gl_bf16_gemv(const uint16_t *x, const uint16_t *w, const float *bias, int64_t M, int64_t R, int64_t K,
                  float *out) {
#ifdef GL_AVX512BF16
    const int64_t TILE = 32;
    const int64_t ntiles = (R + TILE - 1) / TILE;
    const int64_t full = K / 32, rest = K % 32;
    const __mmask32 tail = rest ? (__mmask32)((1u << rest) - 1u) : 0;
    /* a tile of TILE weight rows (TILE * K * 2 bytes: in L1 or L2) serves every MAX_ROWS rows of x in
     * turn, so the weight is read from memory once whatever M (a pass over the weight per MAX_ROWS
     * rows of x had read it M / MAX_ROWS times) */
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < ntiles; t++) {
        const int64_t r1 = (t + 1) * TILE < R ? (t + 1) * TILE : R;
        for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
            const int n = (int)(M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS);
            int64_t r = t * TILE;
#if defined(GL_BF16_TILES)
            /* more than MAX_ROWS rows (compute, not the weight's stream, bounds the time): 4 weight rows
             * by n rows of x in registers, one fold of their 16 sums (vec.h), where a row each spends a
             * fold per output (at K = 256, more than its products). Up to MAX_ROWS rows the row-by-row
             * loop below streams the weight faster (2-4 rows by 12,288 x 256: 0.82-0.86x in tiles) */
            if (M > MAX_ROWS && n > 1)
                for (; r < r1; r += 4) {
                    const int nr = (int)(r1 - r < 4 ? r1 - r : 4);
                    BF16_TILES[nr - 1][n - 1](x + m0 * K, w + r * K, bias ? bias + r : NULL, K, K, R, out + m0 * R + r);
                }
#endif
            for (; r < r1; r++) {
                const uint16_t *row = w + r * K;
                __m512 acc[MAX_ROWS][2];
                for (int j = 0; j < n; j++) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
                int64_t c = 0;
                for (; c + 1 < full; c += 2) {
                    _mm_prefetch((const char *)(row + 32 * c) + GEMV_AHEAD, _MM_HINT_T0);
                    _mm_prefetch((const char *)(row + 32 * c) + GEMV_AHEAD + 64, _MM_HINT_T0);
                    __m512i w0 = _mm512_loadu_si512((const void *)(row + 32 * c));
                    __m512i w1 = _mm512_loadu_si512((const void *)(row + 32 * c + 32));
                    for (int j = 0; j < n; j++) {
                        const uint16_t *xj = x + (m0 + j) * K + 32 * c;
                        acc[j][0] = _mm512_dpbf16_ps(acc[j][0], (__m512bh)w0, (__m512bh)_mm512_loadu_si512((const void *)xj));
                        acc[j][1] = _mm512_dpbf16_ps(acc[j][1], (__m512bh)w1, (__m512bh)_mm512_loadu_si512((const void *)(xj + 32)));
                    }
                }
                for (; c < full; c++) {
                    __m512i w0 = _mm512_loadu_si512((const void *)(row + 32 * c));
                    for (int j = 0; j < n; j++)
                        acc[j][0] = _mm512_dpbf16_ps(acc[j][0], (__m512bh)w0,
                                                     (__m512bh)_mm512_loadu_si512((const void *)(x + (m0 + j) * K + 32 * c)));
                }
                if (rest) {
                    __m512i w0 = _mm512_maskz_loadu_epi16(tail, row + 32 * full);
                    for (int j = 0; j < n; j++)
                        acc[j][0] = _mm512_dpbf16_ps(acc[j][0], (__m512bh)w0,
                                                     (__m512bh)_mm512_maskz_loadu_epi16(tail, x + (m0 + j) * K + 32 * full));
                }
                float b = bias ? bias[r] : 0.0f;
                for (int j = 0; j < n; j++)
                    out[(m0 + j) * R + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[j][0], acc[j][1])) + b;
            }
        }
    }
#elif defined(GL_AVX2_GEMV)
    const int64_t TILE = 32;
    const int64_t ntiles = (R + TILE - 1) / TILE;
    float *xs = malloc((size_t)(M * K) * sizeof(float));
    if (!xs) { /* no room for x in fp32 (M * K floats): the same sums, one product at a time */
        for (int64_t m = 0; m < M; m++)
            for (int64_t r = 0; r < R; r++) {
                float sum = bias ? bias[r] : 0.0f;
                for (int64_t k = 0; k < K; k++) sum += widen(w[r * K + k]) * widen(x[m * K + k]);
                out[m * R + r] = sum;
            }
        return;
    }
    split_columns(x, M, K, xs);
    /* as above: a tile of weight rows in L1 or L2 serves every MAX_ROWS rows of x in turn */
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < ntiles; t++) {
        const int64_t r1 = (t + 1) * TILE < R ? (t + 1) * TILE : R;
        for (int64_t m0 = 0; m0 < M; m0 += MAX_ROWS) {
            const int n = (int)(M - m0 < MAX_ROWS ? M - m0 : MAX_ROWS);
            const float *xm = xs + m0 * K;
            for (int64_t r = t * TILE; r < r1; r++) {
                float sums[MAX_ROWS];
                switch (n) { /* n constant in each: the loops over rows unroll, the sums stay in registers */
                case 1: dots(w + r * K, xm, K, 1, sums); break;
                case 2: dots(w + r * K, xm, K, 2, sums); break;
                case 3: dots(w + r * K, xm, K, 3, sums); break;
                default: dots(w + r * K, xm, K, 4, sums); break;
                }
                float b = bias ? bias[r] : 0.0f;
                for (int j = 0; j < n; j++) out[(m0 + j) * R + r] = sums[j] + b;
            }
        }
    }
    free(xs);
#else
    (void)x, (void)w, (void)bias, (void)M, (void)R, (void)K, (void)out;
#endif
}
