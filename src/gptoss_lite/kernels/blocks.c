/* Decode attention over paged K/V, read in place from the block storage (docs/paged.md).
 *
 * The storage of one layer is (K, N, bs, D): K heads, N blocks of bs slots, D values a slot, fp32 or
 * bf16, contiguous. A group r reads the nb blocks table[r, :], so its slot j is block
 * table[r, j / bs], slot j % bs, for j < S = nb * bs. Each group has M query rows per head.
 *
 * gl_block_attention_quant reads quantised blocks instead (kv/paged_quant.py): per block, K and V codes
 * (int8, int4 packed two to a byte, or float8 e4m3), float16 scales and zero points (keys one per
 * channel per block, values one per token per group of channels), each slot dequantised as
 * value(code) * scale + zero and rounded to the model's dtype, as the store's own dequantise does; then
 * one full-precision tail block per group (the block still being filled).
 *
 * Both are masked_decode (gptoss_lite/model/attention/decode.py) over such a read: the
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
#include "vec.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define GL_AVX2 1
#elif defined(__F16C__)
#include <immintrin.h>
#endif

/* Which path this build takes: 2 AVX-512 (plain blocks of head size 32 or 64; AVX2 for the rest), 1 AVX2,
 * 0 plain C. */
int gl_blocks_isa(void) { return GL_VECTOR_LEVEL; }

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

/* Blocks are prefetched this many ahead of the one being scored: a group's blocks lie scattered over
 * the storage, a block is 1-2 KB, and the hardware prefetcher stops at the end of each, so without a hint
 * every block starts with a miss to memory. Keys and values both, into L1: the values are read right after
 * the scores (not prefetching them lost most of the gain). benchmarks/block_attention_ab.py on a Zen 5,
 * 2 threads: cold calls 1.2-2.1x faster (the AVX2 build 1.06-1.5x), the engine's batch of 16 1.075x
 * (fp32) and 1.089x (bf16); one or four blocks ahead measured the same as two, and the next group's
 * first blocks too, prefetched while this one is scored, gained nothing more. */
#define PREFETCH_BLOCKS 2

/* the bytes [p, p + n) into L1 */
static inline void prefetch_range(const void *p, int64_t n) {
    for (int64_t o = 0; o < n; o += 64) __builtin_prefetch((const char *)p + o, 0, 3);
}

#ifdef GL_AVX2
/* the eight sums of the lanes of a[0..7], in order */
static inline __m256 hsum8(const __m256 a[8]) {
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

/* Where a group's slots live, and how one is read as D fp32 values. */
typedef struct {
    int64_t N, bs, nb; /* blocks in the storage, slots a block, blocks a group reads */
    const int64_t *table; /* (R, nb) */
    /* plain blocks (fmt < 0): (K, N, bs, D) fp32 or bf16 */
    const void *keys, *values;
    int bf16;
    /* quantised blocks (fmt 0 int8, 1 int4, 2 fp8): codes (K, N, bs, Dc) uint8, key scales and zeros
     * (K, N, 1, D) and value scales and zeros (K, N, bs, D / vg) float16; then tail tails[r] of the
     * full-precision tails (K, NT, bs, D) */
    int fmt;
    const uint8_t *kq, *vq;
    const uint16_t *ks, *kz, *vs, *vz;
    int64_t vg, Dc;
    const void *tk, *tv;
    int tail_bf16;
    int64_t NT;
    const int64_t *tails;
    int round_kv; /* dequantised values rounded to bf16 (a bf16 model's store) */
} Source;

/* On reaching block c of group r, head k: the group's block PREFETCH_BLOCKS ahead into L1, and at its
 * first block every one up to it. Plain blocks: keys and values; quantised ones: codes, scales and zero
 * points. */
INLINE void prefetch_due(const Source *src, int64_t r, int64_t k, int64_t D, int64_t c) {
    const int64_t bs = src->bs;
    for (int64_t a = c ? c + PREFETCH_BLOCKS : 1; a <= c + PREFETCH_BLOCKS && a < src->nb; a++) {
        const int64_t at = k * src->N + src->table[r * src->nb + a]; /* the block's index in the storage */
        if (src->fmt < 0) {
            const int64_t bytes = bs * D * (src->bf16 ? 2 : 4);
            prefetch_range((const char *)src->keys + at * bytes, bytes);
            prefetch_range((const char *)src->values + at * bytes, bytes);
        } else {
            const int64_t ng = D / src->vg;
            prefetch_range(src->kq + at * bs * src->Dc, bs * src->Dc);
            prefetch_range(src->vq + at * bs * src->Dc, bs * src->Dc);
            prefetch_range(src->ks + at * D, D * 2);
            prefetch_range(src->kz + at * D, D * 2);
            prefetch_range(src->vs + at * bs * ng, bs * ng * 2);
            prefetch_range(src->vz + at * bs * ng, bs * ng * 2);
        }
    }
}

static inline float widen_half(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu, bits;
    if (e == 0x1F) {
        bits = sign | 0x7F800000u | (m << 13);
    } else if (e != 0) {
        bits = sign | ((e + 112) << 23) | (m << 13);
    } else if (m == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        e = 113;
        while (!(m & 0x400u)) {
            m <<= 1;
            e--;
        }
        bits = sign | (e << 23) | ((m & 0x3FFu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

static float fp8_value[256]; /* float8 e4m3fn byte -> value (NaN for 0x7F and 0xFF) */

__attribute__((constructor)) static void fill_fp8_table(void) {
    for (int c = 0; c < 256; c++) {
        int e = (c >> 3) & 15, m = c & 7;
        float v = e == 0 ? ldexpf((float)m / 8.0f, -6) : ldexpf(1.0f + (float)m / 8.0f, e - 7);
        if (e == 15 && m == 7) v = NAN;
        fp8_value[c] = (c & 0x80) ? -v : v;
    }
}

/* codes [d0, d1) of a row of stored codes as the values they stand for before scale and zero, into
 * out[d0, d1); one loop per format, so that each vectorises */
static inline void code_values(int fmt, const uint8_t *row, int64_t d0, int64_t d1, float *out) {
    if (fmt == 0) {
        for (int64_t d = d0; d < d1; d++) out[d] = (float)row[d];
    } else if (fmt == 1) { /* d0, d1 even: channel 2i in the low nibble of byte i, 2i + 1 in the high one */
        for (int64_t i = d0 / 2; i < d1 / 2; i++) {
            out[2 * i] = (float)(row[i] & 15);
            out[2 * i + 1] = (float)(row[i] >> 4);
        }
    } else {
        for (int64_t d = d0; d < d1; d++) out[d] = fp8_value[row[d]];
    }
}

/* out[d] = out[d] * scale[d] + zero[d] in two fp32 roundings, as the store's dequantise, then rounded
 * to bf16 when round_kv */
static inline void scale_shift(float *out, const float *scale, const float *zero, int64_t n, int round_kv) {
    for (int64_t d = 0; d < n; d++) {
        float x = out[d] * scale[d];
        out[d] = x + zero[d];
    }
    if (round_kv)
        for (int64_t d = 0; d < n; d++) out[d] = round_bf16(out[d]);
}

/* the same with one scale and zero for all n values (a value group) */
static inline void scale_shift1(float *out, float scale, float zero, int64_t n, int round_kv) {
    for (int64_t d = 0; d < n; d++) {
        float x = out[d] * scale;
        out[d] = x + zero;
    }
    if (round_kv)
        for (int64_t d = 0; d < n; d++) out[d] = round_bf16(out[d]);
}

/* kp[j], vp[j] for the S slots of group r, head k: pointers into the storage (fp32 blocks) or into
 * kbuf / vbuf (S * D each), where a slot is widened or dequantised */
static void load_slots(const Source *src, int64_t r, int64_t k, int64_t D, const float **kp, const float **vp,
                       float *kbuf, float *vbuf, float *kscale) { /* kscale: 2 * D floats of scratch */
    const int64_t bs = src->bs, nb = src->nb, N = src->N;
    if (src->fmt < 0) {
        for (int64_t j = 0; j < nb * bs; j++) {
            int64_t slot = (k * N + src->table[r * nb + j / bs]) * bs + j % bs;
            if (src->bf16 && j % bs == 0) prefetch_due(src, r, k, D, j / bs); /* fp32 blocks: `attend` does */
            kp[j] = slot_f32(src->keys, src->bf16, slot, D, src->bf16 ? kbuf + j * D : NULL);
            vp[j] = slot_f32(src->values, src->bf16, slot, D, src->bf16 ? vbuf + j * D : NULL);
        }
        return;
    }
    const int64_t Dc = src->Dc, ng = D / src->vg;
    float *kzero = kscale + D;
    for (int64_t c = 0; c < nb; c++) {
        const int64_t b = src->table[r * nb + c];
        prefetch_due(src, r, k, D, c);
        const uint16_t *ks = src->ks + (k * N + b) * D, *kz = src->kz + (k * N + b) * D;
        for (int64_t d = 0; d < D; d++) {
            kscale[d] = widen_half(ks[d]);
            kzero[d] = widen_half(kz[d]);
        }
        for (int64_t i = 0; i < bs; i++) {
            const int64_t j = c * bs + i, slot = (k * N + b) * bs + i;
            const uint8_t *kc = src->kq + slot * Dc, *vc = src->vq + slot * Dc;
            const uint16_t *vs = src->vs + slot * ng, *vz = src->vz + slot * ng;
            float *kd = kbuf + j * D, *vd = vbuf + j * D;
            code_values(src->fmt, kc, 0, D, kd);
            scale_shift(kd, kscale, kzero, D, src->round_kv);
            code_values(src->fmt, vc, 0, D, vd);
            for (int64_t g = 0; g < ng; g++) /* one scale and zero per group of vg channels */
                scale_shift1(vd + g * src->vg, widen_half(vs[g]), widen_half(vz[g]), src->vg, src->round_kv);
            kp[j] = kd;
            vp[j] = vd;
        }
    }
    const int64_t t = src->tails[r];
    for (int64_t i = 0; i < bs; i++) {
        const int64_t j = nb * bs + i, slot = (k * src->NT + t) * bs + i;
        kp[j] = slot_f32(src->tk, src->tail_bf16, slot, D, kbuf + j * D);
        vp[j] = slot_f32(src->tv, src->tail_bf16, slot, D, vbuf + j * D);
    }
}

/* Attention of each group's M query rows over its S slots (where `src` says they live), masked by
 * distance, with a sink: the whole of masked_decode for a block read, in one pass per row.
 *
 *   rows (R, K, M, D) fp32, rotated queries; row m of a group is draft row t = m / G, head g = m % G
 *   distance (Rd, T, S) int64, Rd = 1 or R: query position minus slot position; a slot is seen
 *       when 0 <= distance (< window, if window >= 0)
 *   sinks (K, G) fp32 sink logits; scale the score factor (D^-0.5)
 *   round16: round where eager bf16 matmuls round (the raw scores, the weights, the weighted sum)
 *   out (R, K, M, D) fp32 (holding bf16 values when round16)
 * Returns 0, or -2 when a thread found no memory for its buffers. */
static int attend(const Source *src, const float *rows, int64_t R, int64_t K, int64_t M, int64_t D, int64_t S,
                  const int64_t *distance, int64_t Rd, int64_t T, int64_t window, const float *sinks, int64_t G,
                  float scale, int round16, float *out) {
    const int buffered = src->fmt >= 0 || src->bf16;
    int failed = 0;
#pragma omp parallel
    {
        float *sc = (float *)malloc((size_t)(M * S) * sizeof(float));
        const float **kp = (const float **)malloc((size_t)(S > 0 ? S : 1) * sizeof(float *));
        float *kbuf = buffered ? (float *)malloc((size_t)(S * D) * sizeof(float)) : NULL;
        float *vbuf = buffered ? (float *)malloc((size_t)(S * D) * sizeof(float)) : NULL;
        float *kscale = (float *)malloc((size_t)(2 * D) * sizeof(float)); /* a block's key scales, zeros */
        const float **vp = (const float **)malloc((size_t)(S > 0 ? S : 1) * sizeof(float *));
        const int ok = sc && kp && vp && kscale && (!buffered || (kbuf && vbuf));
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        { /* every thread meets the loop (a worksharing loop must be), one without buffers skips its part */
#pragma omp for collapse(2) schedule(static)
            for (int64_t r = 0; r < R; r++) {
                for (int64_t k = 0; k < K; k++) {
                    if (!ok) continue;
                    /* the group's slots, widened or dequantised once */
                    load_slots(src, r, k, D, kp, vp, kbuf, vbuf, kscale);
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
                                if (m == 0 && !buffered && j % src->bs == 0) /* fp32 blocks, read in place */
                                    prefetch_due(src, r, k, D, j / src->bs);
                                __m256 acc[8];
                                for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
                                for (int64_t d = 0; d < D; d += 8) {
                                    __m256 x = _mm256_loadu_ps(qm + d);
                                    for (int i = 0; i < 8; i++)
                                        acc[i] = _mm256_fmadd_ps(x, _mm256_loadu_ps(kp[j + i] + d), acc[i]);
                                }
                                _mm256_storeu_ps(s + j, hsum8(acc));
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
        free(kscale);
    }
    return failed ? -2 : 0;
}

#if defined(GL_AVX512)
/* `attend` over plain blocks with AVX-512, for D a multiple of 16 up to 16 * MAX_DV: the query rows of a
 * group four at a time, so each slot's key and value are loaded once for four rows. Scores of 4 rows by
 * 4 keys are 16 vector sums folded into one vector (vec.h's sum16); the softmax runs 16 slots a vector;
 * the weighted sum keeps 4 rows of D values in registers. Same products, mask, sink, rounding points
 * and fp32 sums as `attend` (in another order). DV = D / 16 is a constant in each instance. */
#define MAX_DV 4
#define QR 4

/* slot j's D values as DV vectors of fp32 */
#define LOAD_SLOT(dst, base, index)                                                                  \
    for (int c = 0; c < DV; c++)                                                                     \
        dst[c] = bf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(                                       \
                            _mm512_cvtepu16_epi32(_mm256_loadu_si256(                                \
                                (const __m256i *)((const uint16_t *)(base) + (index) * D + 16 * c))), \
                            16))                                                                     \
                      : _mm512_loadu_ps((const float *)(base) + (index) * D + 16 * c)

INLINE void attend_rows512(const Source *src, int64_t r, int64_t k, const float *q, int nq, int64_t m0, int DV,
                           int64_t S, const int64_t *slot, const int64_t *dist0, int64_t G, int64_t window,
                           const float *sinks, float scale, int round, float *sc, float *out) {
    const int64_t D = 16 * DV;
    const int bf16 = src->bf16;
    __m512 qv[QR][MAX_DV];
    for (int i = 0; i < QR; i++)
        for (int c = 0; c < DV; c++) qv[i][c] = i < nq ? _mm512_loadu_ps(q + i * D + 16 * c) : _mm512_setzero_ps();
    /* raw scores, 4 keys at a time, the blocks PREFETCH_BLOCKS ahead on their way */
    int64_t j = 0;
    for (; j + 4 <= S; j += 4) {
        if (j % src->bs == 0) prefetch_due(src, r, k, D, j / src->bs);
        __m512 kv[4][MAX_DV];
        for (int i = 0; i < 4; i++) LOAD_SLOT(kv[i], src->keys, slot[j + i]);
        __m512 a[QR][4];
        for (int x = 0; x < QR; x++)
            for (int i = 0; i < 4; i++) {
                __m512 acc = _mm512_mul_ps(qv[x][0], kv[i][0]);
                for (int c = 1; c < DV; c++) acc = _mm512_fmadd_ps(qv[x][c], kv[i][c], acc);
                a[x][i] = acc;
            }
        const __m512 sums = sum16(a[0][0], a[0][1], a[0][2], a[0][3], a[1][0], a[1][1], a[1][2], a[1][3], a[2][0],
                                  a[2][1], a[2][2], a[2][3], a[3][0], a[3][1], a[3][2], a[3][3]);
        _mm_storeu_ps(sc + j, _mm512_castps512_ps128(sums));
        if (nq > 1) _mm_storeu_ps(sc + S + j, _mm512_extractf32x4_ps(sums, 1));
        if (nq > 2) _mm_storeu_ps(sc + 2 * S + j, _mm512_extractf32x4_ps(sums, 2));
        if (nq > 3) _mm_storeu_ps(sc + 3 * S + j, _mm512_extractf32x4_ps(sums, 3));
    }
    for (; j < S; j++) {
        __m512 kv[MAX_DV];
        LOAD_SLOT(kv, src->keys, slot[j]);
        for (int x = 0; x < nq; x++) {
            __m512 acc = _mm512_mul_ps(qv[x][0], kv[0]);
            for (int c = 1; c < DV; c++) acc = _mm512_fmadd_ps(qv[x][c], kv[c], acc);
            sc[x * S + j] = _mm512_reduce_add_ps(acc);
        }
    }
    /* per row: mask, scale, max with the sink, exp, sum; the weights rounded when `round` */
    float denom[QR];
    const __m512i zero = _mm512_setzero_si512(), win = _mm512_set1_epi64(window);
    for (int x = 0; x < nq; x++) {
        const int64_t m = m0 + x;
        const int64_t *dist = dist0 + (m / G) * S;
        float *s = sc + x * S;
        const float sink = sinks[k * G + m % G];
        __m512 mxv = _mm512_set1_ps(sink);
        for (j = 0; j < S; j += 16) {
            const int64_t n = S - j < 16 ? S - j : 16;
            const __mmask16 lanes = n == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
            const __m512i d0 = _mm512_maskz_loadu_epi64((__mmask8)lanes, dist + j);
            const __m512i d1 = _mm512_maskz_loadu_epi64((__mmask8)(lanes >> 8), dist + j + 8);
            __mmask8 v0 = _mm512_cmp_epi64_mask(d0, zero, _MM_CMPINT_NLT), v1 = _mm512_cmp_epi64_mask(d1, zero, _MM_CMPINT_NLT);
            if (window >= 0) {
                v0 &= _mm512_cmp_epi64_mask(d0, win, _MM_CMPINT_LT);
                v1 &= _mm512_cmp_epi64_mask(d1, win, _MM_CMPINT_LT);
            }
            const __mmask16 seen = lanes & (__mmask16)(v0 | ((unsigned)v1 << 8));
            __m512 v = _mm512_maskz_loadu_ps(lanes, s + j);
            if (round) v = round16(v);
            v = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), seen, _mm512_mul_ps(v, _mm512_set1_ps(scale)));
            _mm512_mask_storeu_ps(s + j, lanes, v);
            mxv = _mm512_max_ps(mxv, v);
        }
        const float mx = _mm512_reduce_max_ps(mxv);
        __m512 sum = _mm512_setzero_ps();
        for (j = 0; j < S; j += 16) {
            const int64_t n = S - j < 16 ? S - j : 16;
            const __mmask16 lanes = n == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
            const __m512 v = _mm512_maskz_loadu_ps(lanes, s + j);
            const __mmask16 seen = _mm512_mask_cmp_ps_mask(lanes, v, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
            const __m512 e = _mm512_maskz_mov_ps(seen, exp512(_mm512_sub_ps(v, _mm512_set1_ps(mx))));
            sum = _mm512_add_ps(sum, e);
            _mm512_mask_storeu_ps(s + j, lanes, round ? round16(e) : e);
        }
        denom[x] = _mm512_reduce_add_ps(sum) + expf(sink - mx);
    }
    /* the weighted sum of the values, 4 rows at once */
    __m512 acc[QR][MAX_DV];
    for (int x = 0; x < QR; x++)
        for (int c = 0; c < DV; c++) acc[x][c] = _mm512_setzero_ps();
    for (j = 0; j < S; j++) {
        float w[QR] = {0.0f, 0.0f, 0.0f, 0.0f};
        int any = 0;
        for (int x = 0; x < nq; x++) any |= (w[x] = sc[x * S + j]) != 0.0f;
        if (!any) continue;
        __m512 vv[MAX_DV];
        LOAD_SLOT(vv, src->values, slot[j]);
        for (int x = 0; x < QR; x++) {
            const __m512 wx = _mm512_set1_ps(w[x]);
            for (int c = 0; c < DV; c++) acc[x][c] = _mm512_fmadd_ps(wx, vv[c], acc[x][c]);
        }
    }
    for (int x = 0; x < nq; x++) {
        const __m512 dn = _mm512_set1_ps(denom[x]);
        for (int c = 0; c < DV; c++) {
            __m512 o = round ? round16(_mm512_div_ps(round16(acc[x][c]), dn)) : _mm512_div_ps(acc[x][c], dn);
            _mm512_storeu_ps(out + (m0 + x) * D + 16 * c, o);
        }
    }
}

static void attend_rows512_d32(const Source *src, int64_t r, int64_t k, const float *q, int nq, int64_t m0,
                               int64_t S, const int64_t *slot, const int64_t *dist0, int64_t G, int64_t window,
                               const float *sinks, float scale, int round, float *sc, float *out) {
    attend_rows512(src, r, k, q, nq, m0, 2, S, slot, dist0, G, window, sinks, scale, round, sc, out);
}
static void attend_rows512_d64(const Source *src, int64_t r, int64_t k, const float *q, int nq, int64_t m0,
                               int64_t S, const int64_t *slot, const int64_t *dist0, int64_t G, int64_t window,
                               const float *sinks, float scale, int round, float *sc, float *out) {
    attend_rows512(src, r, k, q, nq, m0, 4, S, slot, dist0, G, window, sinks, scale, round, sc, out);
}

/* `attend` over plain blocks for D = 32 or 64 (see attend_rows512) */
static int attend_plain512(const Source *src, const float *rows, int64_t R, int64_t K, int64_t M, int64_t D,
                           int64_t S, const int64_t *distance, int64_t Rd, int64_t T, int64_t window,
                           const float *sinks, int64_t G, float scale, int round, float *out) {
    int failed = 0;
#pragma omp parallel
    {
        float *sc = (float *)malloc((size_t)(QR * (S > 0 ? S : 1)) * sizeof(float));
        int64_t *slot = (int64_t *)malloc((size_t)(S > 0 ? S : 1) * sizeof(int64_t));
        const int ok = sc && slot;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for collapse(2) schedule(static)
        for (int64_t r = 0; r < R; r++) {
            for (int64_t k = 0; k < K; k++) {
                if (!ok) continue;
                for (int64_t c = 0, j = 0; c < src->nb; c++) {
                    const int64_t base = (k * src->N + src->table[r * src->nb + c]) * src->bs;
                    for (int64_t i = 0; i < src->bs; i++) slot[j++] = base + i;
                }
                const int64_t *dist0 = distance + (Rd == 1 ? 0 : r) * T * S;
                for (int64_t m0 = 0; m0 < M; m0 += QR) {
                    const int nq = (int)(M - m0 < QR ? M - m0 : QR);
                    const float *q = rows + ((r * K + k) * M + m0) * D;
                    float *o = out + (r * K + k) * M * D;
                    if (D == 32)
                        attend_rows512_d32(src, r, k, q, nq, m0, S, slot, dist0, G, window, sinks, scale, round, sc, o);
                    else
                        attend_rows512_d64(src, r, k, q, nq, m0, S, slot, dist0, G, window, sinks, scale, round, sc, o);
                }
            }
        }
        free(sc);
        free(slot);
    }
    return failed ? -2 : 0;
}
#endif

/* masked_decode over plain blocks: keys, values (K, N, bs, D) fp32 or bf16, table (R, nb) int64, S =
 * nb * bs slots (the rest as `attend`). Returns 0, -1 when a block id lies outside [0, N) or the head
 * size is too wide (nothing is read then), -2 when out of memory. */
int gl_block_attention(const float *rows, int64_t R, int64_t K, int64_t M, int64_t D, const void *keys,
                       const void *values, int bf16, int64_t N, int64_t bs, const int64_t *table, int64_t nb,
                       const int64_t *distance, int64_t Rd, int64_t T, int64_t window, const float *sinks,
                       int64_t G, float scale, int round16, float *out) {
    for (int64_t i = 0; i < R * nb; i++)
        if (table[i] < 0 || table[i] >= N) return -1;
    if (D > MAX_D || M % G != 0 || M / G != T) return -1;
    Source src = {0};
    src.N = N, src.bs = bs, src.nb = nb, src.table = table, src.keys = keys, src.values = values, src.bf16 = bf16;
    src.fmt = -1;
#if defined(GL_AVX512)
    if (D == 32 || D == 64)
        return attend_plain512(&src, rows, R, K, M, D, nb * bs, distance, Rd, T, window, sinks, G, scale, round16, out);
#endif
    return attend(&src, rows, R, K, M, D, nb * bs, distance, Rd, T, window, sinks, G, scale, round16, out);
}

/* masked_decode over quantised blocks (fmt 0 int8, 1 int4, 2 fp8; see Source) then one tail per
 * group: S = (nb + 1) * bs slots, slot nb * bs + i being slot i of tail tails[r]. Returns as
 * gl_block_attention, -1 also for a tail index outside [0, NT). */
int gl_block_attention_quant(const float *rows, int64_t R, int64_t K, int64_t M, int64_t D, int fmt,
                             const uint8_t *kq, const uint16_t *ks, const uint16_t *kz, const uint8_t *vq,
                             const uint16_t *vs, const uint16_t *vz, int64_t vg, int round_kv, int64_t N,
                             int64_t bs, const int64_t *table, int64_t nb, const void *tk, const void *tv,
                             int tail_bf16, int64_t NT, const int64_t *tails, const int64_t *distance, int64_t Rd,
                             int64_t T, int64_t window, const float *sinks, int64_t G, float scale, int round16,
                             float *out) {
    for (int64_t i = 0; i < R * nb; i++)
        if (table[i] < 0 || table[i] >= N) return -1;
    for (int64_t i = 0; i < R; i++)
        if (tails[i] < 0 || tails[i] >= NT) return -1;
    if (D > MAX_D || M % G != 0 || M / G != T || fmt < 0 || fmt > 2 || vg <= 0 || D % vg) return -1;
    Source src = {0};
    src.N = N, src.bs = bs, src.nb = nb, src.table = table, src.fmt = fmt;
    src.kq = kq, src.ks = ks, src.kz = kz, src.vq = vq, src.vs = vs, src.vz = vz, src.vg = vg;
    src.Dc = fmt == 1 ? D / 2 : D;
    src.tk = tk, src.tv = tv, src.tail_bf16 = tail_bf16, src.NT = NT, src.tails = tails, src.round_kv = round_kv;
    return attend(&src, rows, R, K, M, D, (nb + 1) * bs, distance, Rd, T, window, sinks, G, scale, round16, out);
}
