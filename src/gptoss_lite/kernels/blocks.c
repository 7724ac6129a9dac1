/* Decode attention over paged K/V, read in place from the block storage (docs/paged.md).
 *
 * The storage of one layer is (K, N, bs, D): K heads, N blocks of bs slots, D values a slot, fp32 or
 * bf16, contiguous. A group r reads the nb blocks table[r, :], so its slot j is block
 * table[r, j / bs], slot j % bs, for j < S = nb * bs. Each group has M query rows per head.
 *
 * gl_block_attention is masked_decode (gptoss_lite/model/attention/decode.py) over such a read: the
 * same products, mask, sink, softmax and rounding points, with fp32 sums (a bf16 value widens
 * exactly) in another order, and an exp good to about 2 ulp. The engine's compiled decode step calls
 * it where it would otherwise gather a copy of every group's blocks. Built on first use by
 * kernels/build.py, called through ctypes; OpenMP is the runtime PyTorch loaded, so the thread count
 * is torch's.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define GL_AVX2 1
#endif

static inline float widen_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* one stored slot's D values as fp32 in buf (a pointer into the storage itself when it is fp32) */
static inline const float *slot_f32(const void *base, int bf16, int64_t index, int64_t D, float *buf) {
    if (!bf16) return (const float *)base + index * D;
    const uint16_t *h = (const uint16_t *)base + index * D;
#ifdef GL_AVX2
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + d)));
        _mm256_storeu_ps(buf + d, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
    for (; d < D; d++) buf[d] = widen_bf16(h[d]);
#else
    for (int64_t d = 0; d < D; d++) buf[d] = widen_bf16(h[d]);
#endif
    return buf;
}

#ifdef GL_AVX2
/* the eight sums of the lanes of a[0..7], in order */
static inline __m256 sum8(const __m256 a[8]) {
    __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    /* s0123 = [0a 1a 2a 3a | 0b 1b 2b 3b], s4567 the same for 4..7: add the 128-bit halves */
    __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20), hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
    return _mm256_add_ps(lo, hi);
}
#endif

#define MAX_D 1024 /* widest slot; the Python side checks */

/* x rounded to the nearest bf16 (ties to even) and widened back: what a bf16 tensor would hold */
static inline float round_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&x, &bits, sizeof x);
    return x;
}

#ifdef GL_AVX2
/* e^x for x <= 0, to about 2 ulp: x = n ln 2 + f with |f| <= ln(2) / 2, e^f by its degree-6 minimax
 * polynomial, times 2^n built in the exponent bits; below -87 (where fp32 runs out) it is 0. */
static inline __m256 exp_nonpositive(__m256 x) {
    const __m256 ln2_hi = _mm256_set1_ps(0.693359375f), ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
    __m256 zero = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_fnmadd_ps(n, ln2_hi, x);
    f = _mm256_fnmadd_ps(n, ln2_lo, f);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(f, f), _mm256_add_ps(f, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(zero, y);
}
#endif

/* Attention of each group's M query rows over its blocks, masked by distance, with a sink: the whole
 * of masked_decode (gptoss_lite/model/attention/decode.py) for a block read, in one pass per row.
 *
 *   rows (R, K, M, D) fp32, rotated queries; row m of a group is draft row t = m / G, head g = m % G
 *   keys, values: block storage (K, N, bs, D), fp32 or bf16; table (R, nb) int64
 *   distance (Rd, T, nb * bs) int64, Rd = 1 or R: query position minus slot position; a slot is seen
 *       when 0 <= distance (< window, if window >= 0)
 *   sinks (K, G) fp32 sink logits; scale the score factor (D^-0.5)
 *   round16: round where eager bf16 matmuls round (the raw scores, the weights, the weighted sum)
 *   out (R, K, M, D) fp32 (holding bf16 values when round16)
 * Returns 0, or -1 when a block id lies outside [0, N) (nothing is read then). */
int gl_block_attention(const float *rows, int64_t R, int64_t K, int64_t M, int64_t D, const void *keys,
                       const void *values, int bf16, int64_t N, int64_t bs, const int64_t *table, int64_t nb,
                       const int64_t *distance, int64_t Rd, int64_t T, int64_t window, const float *sinks,
                       int64_t G, float scale, int round16, float *out) {
    for (int64_t i = 0; i < R * nb; i++)
        if (table[i] < 0 || table[i] >= N) return -1;
    if (D > MAX_D || M % G != 0 || M / G != T) return -1;
    const int64_t S = nb * bs;
    int failed = 0;
#pragma omp parallel
    {
        float *sc = (float *)malloc((size_t)(M * S) * sizeof(float));
        const float **kp = (const float **)malloc((size_t)(S > 0 ? S : 1) * sizeof(float *));
        float *kbuf = bf16 ? (float *)malloc((size_t)(S * D) * sizeof(float)) : NULL;
        float *vbuf = bf16 ? (float *)malloc((size_t)(S * D) * sizeof(float)) : NULL;
        const float **vp = (const float **)malloc((size_t)(S > 0 ? S : 1) * sizeof(float *));
        const int ok = sc && kp && vp && (!bf16 || (kbuf && vbuf));
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        { /* every thread meets the loop (a worksharing loop must be), one without buffers skips its part */
#pragma omp for collapse(2) schedule(static)
            for (int64_t r = 0; r < R; r++) {
                for (int64_t k = 0; k < K; k++) {
                    if (!ok) continue;
                    /* the group's slots, widened once when bf16 */
                    for (int64_t j = 0; j < S; j++) {
                        int64_t slot = (k * N + table[r * nb + j / bs]) * bs + j % bs;
                        kp[j] = slot_f32(keys, bf16, slot, D, bf16 ? kbuf + j * D : NULL);
                        vp[j] = slot_f32(values, bf16, slot, D, bf16 ? vbuf + j * D : NULL);
                    }
                    const float *q = rows + (r * K + k) * M * D;
                    const int64_t *dist0 = distance + (Rd == 1 ? 0 : r) * T * S;
                    for (int64_t m = 0; m < M; m++) {
                        const float *qm = q + m * D;
                        const int64_t *dist = dist0 + (m / G) * S;
                        float *s = sc + m * S;
                        int64_t j = 0;
#ifdef GL_AVX2
                        if (D % 8 == 0) {
                            for (; j + 8 <= S; j += 8) {
                                __m256 acc[8];
                                for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
                                for (int64_t d = 0; d < D; d += 8) {
                                    __m256 x = _mm256_loadu_ps(qm + d);
                                    for (int i = 0; i < 8; i++)
                                        acc[i] = _mm256_fmadd_ps(x, _mm256_loadu_ps(kp[j + i] + d), acc[i]);
                                }
                                _mm256_storeu_ps(s + j, sum8(acc));
                            }
                        }
#endif
                        for (; j < S; j++) {
                            float a = 0.0f;
                            for (int64_t d = 0; d < D; d++) a += qm[d] * kp[j][d];
                            s[j] = a;
                        }
                        /* mask, scale, and the running maximum (the sink counts as one more key) */
                        const float sink = sinks[k * G + m % G];
                        float mx = sink;
                        for (j = 0; j < S; j++) {
                            int64_t dj = dist[j];
                            if (dj < 0 || (window >= 0 && dj >= window)) {
                                s[j] = -INFINITY;
                                continue;
                            }
                            float v = (round16 ? round_bf16(s[j]) : s[j]) * scale;
                            s[j] = v;
                            if (v > mx) mx = v;
                        }
                        float denom = 0.0f;
                        j = 0;
#ifdef GL_AVX2
                        __m256 vm = _mm256_set1_ps(mx), vsum = _mm256_setzero_ps();
                        for (; j + 8 <= S; j += 8) {
                            __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
                            vsum = _mm256_add_ps(vsum, e);
                            _mm256_storeu_ps(s + j, e);
                        }
                        {
                            float lanes[8];
                            _mm256_storeu_ps(lanes, vsum);
                            for (int i = 0; i < 8; i++) denom += lanes[i];
                        }
#endif
                        for (; j < S; j++) {
                            float e = expf(s[j] - mx);
                            denom += e;
                            s[j] = e;
                        }
                        denom += expf(sink - mx);
                        /* the weighted sum of the values of the slots with a weight (rounded first when
                         * round16), 32 channels at a time in registers */
                        if (round16)
                            for (j = 0; j < S; j++) s[j] = round_bf16(s[j]);
                        float *o = out + ((r * K + k) * M + m) * D;
                        int64_t d0 = 0;
#ifdef GL_AVX2
                        if (D % 8 == 0) {
                            for (; d0 < D; d0 += 32) {
                                const int nv = D - d0 >= 32 ? 4 : (int)((D - d0) / 8);
                                __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                                                 _mm256_setzero_ps()};
                                for (j = 0; j < S; j++) {
                                    if (s[j] == 0.0f) continue;
                                    __m256 wv = _mm256_set1_ps(s[j]);
                                    const float *v = vp[j] + d0;
                                    for (int i = 0; i < nv; i++) acc[i] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + 8 * i), acc[i]);
                                }
                                for (int i = 0; i < nv; i++) _mm256_storeu_ps(o + d0 + 8 * i, acc[i]);
                            }
                        }
#endif
                        if (d0 < D) {
                            for (int64_t d = d0; d < D; d++) o[d] = 0.0f;
                            for (j = 0; j < S; j++) {
                                float w = s[j];
                                if (w == 0.0f) continue;
                                const float *v = vp[j];
                                for (int64_t d = d0; d < D; d++) o[d] += w * v[d];
                            }
                        }
                        for (int64_t d = 0; d < D; d++)
                            o[d] = round16 ? round_bf16(round_bf16(o[d]) / denom) : o[d] / denom;
                    }
                }
            }
        }
        free(sc);
        free(kp);
        free(vp);
        free(kbuf);
        free(vbuf);
    }
    return failed ? -2 : 0;
}
