/* MXFP4 matrix-vector products and dequantisation for gptoss-lite (docs/mxfp4.md).
 *
 * A weight matrix W (R, K) in MXFP4 is `blocks` (R, G, 16) uint8 + `scales` (R, G) uint8, G = K / 32:
 * each byte holds two 4-bit E2M1 codes, the LOW nibble the even element, and each block of 32 shares
 * the power of two 2^(scale - 127). A code's value is read from a table of twice the E2M1 values
 * (small integers, so the table is int8) and the block's factor is 0.5 * 2^(scale - 127), so every
 * weight is the exact value the dequantising reference builds. Products and sums are fp32: this
 * code and the reference differ only in the order of the additions.
 *
 * Built on first use by gptoss_lite/kernels/build.py with the machine's C compiler (-O3
 * -march=native -fopenmp) and called through ctypes. OpenMP here is the runtime PyTorch already
 * loaded (the same libgomp.so.1), so the thread count is torch's.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "vec.h" /* GL_AVX2, GL_AVX512, bf16 rounding and the experts' activation (gated16) */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define GL_AVX512BF16 1
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512F__)
#define GL_AVX512VNNI 1
#endif

static const int8_t TWICE_E2M1[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static float HALF_POW2[256]; /* 0.5 * 2^(e - 127): exact in fp32, subnormal only for e < 2 */
static float POW2[256];      /* 2^(e - 127), the bf16 path's factor, read straight into a broadcast */
/* TWICE_E2M1 as bf16 (exact: at most 3 significant bits), its low and high bytes, for the AVX2 pairs */
static uint8_t TWICE_E2M1_BF16_LO[16], TWICE_E2M1_BF16_HI[16];
static int READY = 0;

static void init_tables(void) {
    if (READY) return;
    for (int e = 0; e < 256; e++) HALF_POW2[e] = ldexpf(0.5f, e - 127), POW2[e] = ldexpf(1.0f, e - 127);
    for (int i = 0; i < 16; i++) {
        float v = (float)TWICE_E2M1[i]; /* +0 for both zero codes, as the other paths */
        uint32_t bits;
        memcpy(&bits, &v, 4);
        TWICE_E2M1_BF16_LO[i] = (uint8_t)(bits >> 16), TWICE_E2M1_BF16_HI[i] = (uint8_t)(bits >> 24);
    }
    READY = 1;
}

int gl_has_avx2(void) {
#ifdef GL_AVX2
    return 1;
#else
    return 0;
#endif
}

/* Whether gl_mxfp4_matvec takes bf16 inputs (x_bf16 != 0) with AVX-512 BF16 dot products. */
int gl_has_bf16_dot(void) {
#ifdef GL_AVX512BF16
    return 1;
#else
    return 0;
#endif
}

#define MAX_ROWS 4 /* input rows that share one decoded weight block */

/* Codes are prefetched this many bytes ahead of the block being decoded (past the row's end too: the next
 * row of the tile). The decode loop leaves the hardware prefetcher too few loads in flight on its own:
 * one thread read 13.4 GB/s of codes from memory without it, 14.6 with it (Zen 4, 2 KB; 3 KB: 13.5). On
 * Zen 5 (2 threads, benchmarks/mxfp4_matvec_ab.py, three runs of 120 calls), 4 KB read a decode token's
 * gate|up and down codes 1.03-1.05x faster than 2 KB; 6-16 KB were no faster than 4 KB. */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 4096
#endif

#ifdef GL_AVX2
/* The 32 weights of one block, times the block's factor, as four vectors of 8. */
static inline void decode_block(const uint8_t *b, float factor, __m128i lut, __m256 w[4]) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    __m128i q = _mm_loadu_si128((const __m128i *)b);
    __m128i even = _mm_shuffle_epi8(lut, _mm_and_si128(q, low4));
    __m128i odd = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(q, 4), low4));
    __m128i first = _mm_unpacklo_epi8(even, odd); /* elements 0..15 */
    __m128i second = _mm_unpackhi_epi8(even, odd); /* elements 16..31 */
    __m256 s = _mm256_set1_ps(factor);
    w[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(first)), s);
    w[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(first, 8))), s);
    w[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(second)), s);
    w[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(second, 8))), s);
}

/* row_dots' AVX2 loop reads a pair of blocks (32 code bytes: block g in the low 128 bits, g + 1 in the
 * high) as eight vectors of 8 fp32 weights, unscaled (twice E2M1, exact). Each nibble's bf16 comes from
 * two byte tables (vpshufb), bytes pair into words, and a word becomes its fp32 by a shift or a mask
 * (vec.h's bf16_even8, bf16_odd8):
 * two shuffles per 16 weights, where decode_block spends five and a conversion per 8. In each 128-bit
 * lane, lane d of vector v holds element PAIR_BASE[v] + 4d of that lane's block (layout_pairs lays x
 * out so). */
static const int PAIR_BASE[8] = {0, 2, 16, 18, 1, 3, 17, 19};

/* blocks g and g + 1 of a row: each code's bf16 low and high bytes, the even elements' (low nibbles:
 * el, eh) and the odd ones' (ol, oh), and the two blocks' factors (four lanes each) */
static inline void pair_bytes(const uint8_t *blocks, const uint8_t *scales, int64_t g, __m256i lut_lo, __m256i lut_hi,
                              __m256i *el, __m256i *eh, __m256i *ol, __m256i *oh, __m256 *f) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    _mm_prefetch((const char *)(blocks + 16 * g + PREFETCH_AHEAD), _MM_HINT_T0);
    const __m256i c = _mm256_loadu_si256((const __m256i *)(blocks + 16 * g));
    const __m256i even = _mm256_and_si256(c, low4), odd = _mm256_and_si256(_mm256_srli_epi16(c, 4), low4);
    *el = _mm256_shuffle_epi8(lut_lo, even), *eh = _mm256_shuffle_epi8(lut_hi, even);
    *ol = _mm256_shuffle_epi8(lut_lo, odd), *oh = _mm256_shuffle_epi8(lut_hi, odd);
    *f = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(HALF_POW2[scales[g]])),
                              _mm_set1_ps(HALF_POW2[scales[g + 1]]), 1);
}

#endif

#ifdef GL_AVX2
/* x (K = 32 G floats) for row_dots: each pair of blocks' 64 elements in the AVX2 loop's order (vector v,
 * then the pair's two blocks, then lane d: PAIR_BASE), a last unpaired block as it is */
static void layout_pairs(const float *x, int64_t G, float *out) {
    int64_t g = 0;
    for (; g + 1 < G; g += 2)
        for (int v = 0; v < 8; v++)
            for (int h = 0; h < 2; h++)
                for (int d = 0; d < 4; d++) out[32 * g + 8 * v + 4 * h + d] = x[32 * (g + h) + PAIR_BASE[v] + 4 * d];
    if (g < G) memcpy(out + 32 * g, x + 32 * g, 32 * sizeof(float));
}
#endif

/* dot products of one weight row (G blocks) with n <= MAX_ROWS input rows xs[j] (K floats each; with
 * AVX2 laid out by layout_pairs). Each pair of blocks' products are summed unscaled and then scaled once
 * by the two blocks' factors (powers of two: exact), so only the order of the fp32 additions differs
 * from the reference's. */
static void row_dots(const uint8_t *blocks, const uint8_t *scales, int64_t G, const float *const *xs, int n,
                     float *dots) {
#ifdef GL_AVX2
    const __m256i lut_lo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)TWICE_E2M1_BF16_LO));
    const __m256i lut_hi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)TWICE_E2M1_BF16_HI));
    __m256 acc[MAX_ROWS];
    for (int j = 0; j < n; j++) acc[j] = _mm256_setzero_ps();
    int64_t g = 0;
    if (n == 1) { /* decode: each vector of weights used as soon as it is made, the sum in a register */
        const float *x = xs[0];
        __m256 a = _mm256_setzero_ps();
        for (; g + 1 < G; g += 2) {
            __m256i el, eh, ol, oh;
            __m256 f;
            pair_bytes(blocks, scales, g, lut_lo, lut_hi, &el, &eh, &ol, &oh, &f);
            const float *xp = x + 32 * g;
            __m256i words = _mm256_unpacklo_epi8(el, eh);
            __m256 t0 = _mm256_mul_ps(bf16_even8(words), _mm256_loadu_ps(xp));
            __m256 t1 = _mm256_mul_ps(bf16_odd8(words), _mm256_loadu_ps(xp + 8));
            words = _mm256_unpackhi_epi8(el, eh);
            t0 = _mm256_fmadd_ps(bf16_even8(words), _mm256_loadu_ps(xp + 16), t0);
            t1 = _mm256_fmadd_ps(bf16_odd8(words), _mm256_loadu_ps(xp + 24), t1);
            words = _mm256_unpacklo_epi8(ol, oh);
            t0 = _mm256_fmadd_ps(bf16_even8(words), _mm256_loadu_ps(xp + 32), t0);
            t1 = _mm256_fmadd_ps(bf16_odd8(words), _mm256_loadu_ps(xp + 40), t1);
            words = _mm256_unpackhi_epi8(ol, oh);
            t0 = _mm256_fmadd_ps(bf16_even8(words), _mm256_loadu_ps(xp + 48), t0);
            t1 = _mm256_fmadd_ps(bf16_odd8(words), _mm256_loadu_ps(xp + 56), t1);
            a = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), f, a);
        }
        acc[0] = a;
    } else
        for (; g + 1 < G; g += 2) {
            __m256i el, eh, ol, oh;
            __m256 f, w[8];
            pair_bytes(blocks, scales, g, lut_lo, lut_hi, &el, &eh, &ol, &oh, &f);
            const __m256i words[4] = {_mm256_unpacklo_epi8(el, eh), _mm256_unpackhi_epi8(el, eh),
                                      _mm256_unpacklo_epi8(ol, oh), _mm256_unpackhi_epi8(ol, oh)};
            for (int k = 0; k < 4; k++) w[2 * k] = bf16_even8(words[k]), w[2 * k + 1] = bf16_odd8(words[k]);
            for (int j = 0; j < n; j++) {
                const float *xp = xs[j] + 32 * g;
                __m256 t0 = _mm256_mul_ps(w[0], _mm256_loadu_ps(xp));
                __m256 t1 = _mm256_mul_ps(w[1], _mm256_loadu_ps(xp + 8));
                for (int v = 2; v < 8; v += 2) {
                    t0 = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(xp + 8 * v), t0);
                    t1 = _mm256_fmadd_ps(w[v + 1], _mm256_loadu_ps(xp + 8 * v + 8), t1);
                }
                acc[j] = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), f, acc[j]);
            }
        }
    if (g < G) { /* the unpaired last block, x as it is */
        const __m128i lut = _mm_loadu_si128((const __m128i *)TWICE_E2M1);
        __m256 w[4];
        decode_block(blocks + 16 * g, HALF_POW2[scales[g]], lut, w);
        for (int j = 0; j < n; j++)
            for (int k = 0; k < 4; k++) acc[j] = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(xs[j] + 32 * g + 8 * k), acc[j]);
    }
    for (int j = 0; j < n; j++) dots[j] = hsum256(acc[j]);
#else
    for (int j = 0; j < n; j++) dots[j] = 0.0f;
    for (int64_t g = 0; g < G; g++) {
        float factor = HALF_POW2[scales[g]];
        for (int i = 0; i < 16; i++) {
            uint8_t byte = blocks[16 * g + i];
            float w0 = TWICE_E2M1[byte & 15] * factor, w1 = TWICE_E2M1[byte >> 4] * factor;
            for (int j = 0; j < n; j++) dots[j] += w0 * xs[j][32 * g + 2 * i] + w1 * xs[j][32 * g + 2 * i + 1];
        }
    }
#endif
}

#ifdef GL_AVX512BF16
/* The E2M1 values as bf16 bits, twice over (vpermw reads 32 entries). */
static const uint16_t E2M1_BF16[32] = {
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,
};

/* The 32 codes of one block as bf16 values (exact), in element order: the low nibble of byte i is
 * element 2i, the high nibble element 2i + 1, so each byte widens to one dword holding both words. */
static inline __m512i decode_block_bf16(const uint8_t *b, __m512i table) {
    /* vpermw reads the low 5 bits of each word: word 2i needs byte i's low nibble (bits 0-3, bit 4
     * clear) and word 2i+1 its high nibble, which d << 12 puts at bits 16-19 with bit 20 clear. */
    __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
    __m512i idx = _mm512_ternarylogic_epi32(_mm512_set1_epi32(0x0F), d, _mm512_slli_epi32(d, 12), 0xCA);
    return _mm512_permutexvar_epi16(idx, table);
}

/* x rows for row_dots_bf16: in each pair of blocks (64 elements, the first block even), the 32 even
 * elements, then the 32 odd ones; a last unpaired block as it is. A code byte holds elements 2i and
 * 2i + 1, so its low nibbles widen to the even elements of the pair and its high nibbles to the odd
 * ones: permuting x once per call spares re-ordering every weight block. */
static void split_pairs(const uint16_t *x, int64_t G, uint16_t *out) {
    __m512i even, odd;
    uint16_t ie[32], io[32];
    for (int j = 0; j < 32; j++) ie[j] = (uint16_t)(2 * j), io[j] = (uint16_t)(2 * j + 1);
    even = _mm512_loadu_si512((const void *)ie);
    odd = _mm512_loadu_si512((const void *)io);
    int64_t g = 0;
    for (; g + 1 < G; g += 2) {
        __m512i a = _mm512_loadu_si512((const void *)(x + 32 * g)), b = _mm512_loadu_si512((const void *)(x + 32 * g + 32));
        _mm512_storeu_si512((void *)(out + 32 * g), _mm512_permutex2var_epi16(a, even, b));
        _mm512_storeu_si512((void *)(out + 32 * g + 32), _mm512_permutex2var_epi16(a, odd, b));
    }
    if (g < G) memcpy(out + 32 * g, x + 32 * g, 32 * sizeof(uint16_t));
}


/* x rows for row_dots_bf16 with quads: in each quad of blocks (128 elements, the first block's index a
 * multiple of 4) the elements 4k, then 4k + 1, 4k + 2 and 4k + 3 (k < 32); the blocks after the last quad
 * as split_pairs lays them out. Two rounds of even/odd permutes: evens of evens are the 4k. */
static void split_quads(const uint16_t *x, int64_t G, uint16_t *out) {
    uint16_t ie[32], io[32];
    for (int j = 0; j < 32; j++) ie[j] = (uint16_t)(2 * j), io[j] = (uint16_t)(2 * j + 1);
    const __m512i even = _mm512_loadu_si512((const void *)ie), odd = _mm512_loadu_si512((const void *)io);
    int64_t g = 0;
    for (; g + 3 < G; g += 4) {
        const uint16_t *q = x + 32 * g;
        __m512i a = _mm512_loadu_si512((const void *)q), b = _mm512_loadu_si512((const void *)(q + 32));
        __m512i c = _mm512_loadu_si512((const void *)(q + 64)), d = _mm512_loadu_si512((const void *)(q + 96));
        __m512i e1 = _mm512_permutex2var_epi16(a, even, b), o1 = _mm512_permutex2var_epi16(a, odd, b);
        __m512i e2 = _mm512_permutex2var_epi16(c, even, d), o2 = _mm512_permutex2var_epi16(c, odd, d);
        _mm512_storeu_si512((void *)(out + 32 * g), _mm512_permutex2var_epi16(e1, even, e2));      /* 4k */
        _mm512_storeu_si512((void *)(out + 32 * g + 32), _mm512_permutex2var_epi16(o1, even, o2)); /* 4k + 1 */
        _mm512_storeu_si512((void *)(out + 32 * g + 64), _mm512_permutex2var_epi16(e1, odd, e2));  /* 4k + 2 */
        _mm512_storeu_si512((void *)(out + 32 * g + 96), _mm512_permutex2var_epi16(o1, odd, o2));  /* 4k + 3 */
    }
    split_pairs(x + 32 * g, G - g, out + 32 * g);
}

/* 2^(e - 127) for the four scale bytes s[0..3], each in four lanes (lanes 4i..4i+3 hold s[i]'s): the
 * exponent field e << 23, and for e = 0 the subnormal 2^-127 (POW2's values, without a table). */
static inline __m512 quad_factors(const uint8_t *s) {
    uint32_t four;
    memcpy(&four, s, 4);
    const __m512i shifts = _mm512_set_epi32(24, 24, 24, 24, 16, 16, 16, 16, 8, 8, 8, 8, 0, 0, 0, 0);
    __m512i e = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((int)four), shifts), _mm512_set1_epi32(0xFF));
    __m512i bits = _mm512_slli_epi32(e, 23);
    bits = _mm512_mask_mov_epi32(bits, _mm512_testn_epi32_mask(e, e), _mm512_set1_epi32(0x00400000));
    return _mm512_castsi512_ps(bits);
}

/* The blocks of a row from g on (after its quads: fewer than four), laid out by split_pairs, added into
 * acc. A pair of blocks is 32 code bytes: widened to words, the low nibbles index the E2M1 table
 * directly (vpermw reads 5 bits and the table repeats) and the high nibbles after one shift; two bf16
 * dot-product instructions (bf16 times bf16 is exact in fp32) leave lanes 0-7 holding block g's partial
 * sums and lanes 8-15 block g + 1's, which are scaled by their blocks' 2^(scale - 127) into fp32 sums. A
 * last unpaired block is decoded alone. */
static void row_dots_bf16_pairs(const uint8_t *blocks, const uint8_t *scales, int64_t g, int64_t G,
                                const uint16_t *const *xs, int n, __m512 *acc) {
    const __m512i table = _mm512_loadu_si512((const void *)E2M1_BF16);
    const __m512 zero = _mm512_setzero_ps();
    for (; g + 1 < G; g += 2) {
        __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(blocks + 16 * g)));
        __m512i lo = _mm512_permutexvar_epi16(q, table);
        __m512i hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(q, 4), table);
        __m512 f = _mm512_mask_blend_ps((__mmask16)0xFF00, _mm512_set1_ps(POW2[scales[g]]),
                                        _mm512_set1_ps(POW2[scales[g + 1]]));
        for (int j = 0; j < n; j++) {
            __m512 p = _mm512_dpbf16_ps(zero, (__m512bh)lo, (__m512bh)_mm512_loadu_si512(xs[j] + 32 * g));
            p = _mm512_dpbf16_ps(p, (__m512bh)hi, (__m512bh)_mm512_loadu_si512(xs[j] + 32 * g + 32));
            acc[j] = _mm512_fmadd_ps(p, f, acc[j]);
        }
    }
    if (g < G) { /* the unpaired last block: x as it is */
        __m512i w = decode_block_bf16(blocks + 16 * g, table);
        __m512 f = _mm512_set1_ps(POW2[scales[g]]);
        for (int j = 0; j < n; j++) {
            __m512 p = _mm512_dpbf16_ps(zero, (__m512bh)w, (__m512bh)_mm512_loadu_si512(xs[j] + 32 * g));
            acc[j] = _mm512_fmadd_ps(p, f, acc[j]);
        }
    }
}

/* row_dots for bf16 inputs laid out by split_quads. A quad of blocks is 64 code bytes, read as 32 words
 * of four nibbles: vpermw reads the low 5 bits of each word (the table repeats, so bit 4 does not
 * matter), and shifts by 4, 8 and 12 bring the other three nibbles there: the weights 4k, 4k + 1, 4k + 2
 * and 4k + 3, no widening. Four bf16 dot-product instructions leave lanes 4i..4i+3 holding block g + i's
 * partial sums, scaled by quad_factors in one FMA. Blocks after the last quad take row_dots_bf16_pairs. */
static void row_dots_bf16(const uint8_t *blocks, const uint8_t *scales, int64_t G, const uint16_t *const *xs, int n,
                          float *dots) {
    const __m512i table = _mm512_loadu_si512((const void *)E2M1_BF16);
    const __m512 zero = _mm512_setzero_ps();
    __m512 acc[MAX_ROWS];
    for (int j = 0; j < n; j++) acc[j] = zero;
    int64_t g = 0;
    for (; g + 3 < G; g += 4) {
        _mm_prefetch((const char *)(blocks + 16 * g + PREFETCH_AHEAD), _MM_HINT_T0);
        const __m512i c = _mm512_loadu_si512((const void *)(blocks + 16 * g));
        const __m512i wa = _mm512_permutexvar_epi16(c, table);
        const __m512i wb = _mm512_permutexvar_epi16(_mm512_srli_epi16(c, 4), table);
        const __m512i wc = _mm512_permutexvar_epi16(_mm512_srli_epi16(c, 8), table);
        const __m512i wd = _mm512_permutexvar_epi16(_mm512_srli_epi16(c, 12), table);
        const __m512 f = quad_factors(scales + g);
        for (int j = 0; j < n; j++) {
            const uint16_t *x = xs[j] + 32 * g;
            __m512 p = _mm512_dpbf16_ps(zero, (__m512bh)wa, (__m512bh)_mm512_loadu_si512(x));
            __m512 p2 = _mm512_dpbf16_ps(zero, (__m512bh)wc, (__m512bh)_mm512_loadu_si512(x + 64));
            p = _mm512_dpbf16_ps(p, (__m512bh)wb, (__m512bh)_mm512_loadu_si512(x + 32));
            p2 = _mm512_dpbf16_ps(p2, (__m512bh)wd, (__m512bh)_mm512_loadu_si512(x + 96));
            acc[j] = _mm512_fmadd_ps(_mm512_add_ps(p, p2), f, acc[j]);
        }
    }
    row_dots_bf16_pairs(blocks, scales, g, G, xs, n, acc);
    for (int j = 0; j < n; j++) dots[j] = _mm512_reduce_add_ps(acc[j]);
}

#endif

/* ---- the opt-in int8-activation path (docs/mxfp4.md, "int8 activations") ------------------------------
 *
 * Each block of 32 inputs x is quantised to int8 codes q with one fp32 step d = max|x| / 127 (q = x * (127 /
 * max|x|) rounded to nearest even), as llama.cpp does with its Q8 activations: this CHANGES results, by
 * the rounding of x, and is never the default. The products are then integers: a weight code's twice-E2M1
 * value w (-12..12, as u = w + 12 in 0..24 so that it is the unsigned operand) times q, summed exactly in
 * int32, less 12 * sum(q) for the offset; each block's sum times its 0.5 * 2^(scale - 127) * d in fp32.
 *
 * The inputs are laid out once per call in groups of Q8_W blocks, each group Q8_W * 16 even elements then
 * Q8_W * 16 odd ones, so that the low nibbles of a group's codes meet the even elements lane by lane (a
 * 16-byte lane per block). Per set of Q8_SET blocks come the offsets -12 * sum(q) and the steps 0.5 * d
 * (int32 and fp32), one per block, in the order the kernel's sums come out (`q8_slot`). */
#if defined(GL_AVX512VNNI)
#define Q8_W 4
#define Q8_SET 16
#elif defined(GL_AVX2)
#define Q8_W 2
#define Q8_SET 2
#else
#define Q8_W 4
#define Q8_SET 4
#endif

/* twice the E2M1 values plus 12 (0..24: an unsigned byte), four times over (a 16-byte table per lane, or
 * one 64-byte table that vpermb indexes with 6 bits) */
static const uint8_t U_E2M1[64] = {
    12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0, 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
    12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0, 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
};

/* Where block b of a set lands in the kernel's vector of sums: the AVX-512 kernel's sums of groups k = b / 4
 * come out with block 4k + i at dword 4i + k (see row_dots_q8). */
static inline int q8_slot(int b) {
#if defined(GL_AVX512VNNI)
    return 4 * (b % 4) + b / 4;
#else
    return b;
#endif
}

/* One block of 32 inputs to int8 codes q and the step d (0 and all-zero codes for an all-zero block). */
static void quantize_block_q8(const float *x, int8_t q[32], float *d) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[i]));
    float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < 32; i++) q[i] = (int8_t)rintf(x[i] * inv); /* |x * inv| <= 127 rounded: in range */
    *d = amax / 127.0f;
}

static void block_floats(const void *x, int x_bf16, int64_t at, float out[32]) {
    if (!x_bf16) {
        memcpy(out, (const float *)x + at, 32 * sizeof(float));
        return;
    }
    const uint16_t *h = (const uint16_t *)x + at;
    for (int i = 0; i < 32; i++) {
        uint32_t bits = (uint32_t)h[i] << 16;
        memcpy(out + i, &bits, 4);
    }
}

/* x (M, 32 G) fp32 or bf16 -> q (M, 32 G) int8 and d (M, G) fp32, in element order: what the kernel
 * multiplies with, for tests against the PyTorch reference of the same rounding. */
void gl_q8_quantize(const void *x, int x_bf16, int64_t M, int64_t G, int8_t *q, float *d) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < G; g++) {
            float f[32];
            block_floats(x, x_bf16, (m * G + g) * 32, f);
            quantize_block_q8(f, q + (m * G + g) * 32, d + m * G + g);
        }
}

typedef struct {
    const int8_t *q;     /* (sets * Q8_SET / Q8_W, 2, Q8_W * 16): a group's even elements, then its odd ones */
    const int32_t *init; /* (sets, Q8_SET) */
    const float *step;   /* (sets, Q8_SET) */
} Q8Row;

static inline int64_t q8_sets(int64_t G) { return (G + Q8_SET - 1) / Q8_SET; }

/* One input row laid out for the kernels; the last set is padded with zeros (q = 0, offset 0, step 0). */
static void layout_q8(const void *x, int x_bf16, int64_t m, int64_t G, int8_t *q, int32_t *init, float *step) {
    int64_t sets = q8_sets(G);
    memset(q, 0, (size_t)sets * Q8_SET * 32);
    memset(init, 0, sizeof(int32_t) * sets * Q8_SET);
    memset(step, 0, sizeof(float) * sets * Q8_SET);
    for (int64_t g = 0; g < G; g++) {
        float f[32], d;
        int8_t b[32];
        block_floats(x, x_bf16, (m * G + g) * 32, f);
        quantize_block_q8(f, b, &d);
        int64_t grp = g / Q8_W, lane = g % Q8_W;
        int8_t *even = q + grp * Q8_W * 32 + lane * 16, *odd = even + Q8_W * 16;
        int32_t sum = 0;
        for (int i = 0; i < 16; i++) even[i] = b[2 * i], odd[i] = b[2 * i + 1], sum += b[2 * i] + b[2 * i + 1];
        int64_t at = (g / Q8_SET) * Q8_SET + q8_slot((int)(g % Q8_SET));
        init[at] = -12 * sum;
        step[at] = 0.5f * d;
    }
}

#if defined(GL_AVX512VNNI)
/* The unsigned weights of a group's low nibbles (lo) and high nibbles (hi): vpermb reads 6 bits of each
 * byte and the table repeats every 16, so no mask is needed; without VBMI, a mask and vpshufb. */
static inline void q8_weights(__m512i c, __m512i table, __m512i *lo, __m512i *hi) {
#if defined(__AVX512VBMI__)
    *lo = _mm512_permutexvar_epi8(c, table);
    *hi = _mm512_permutexvar_epi8(_mm512_srli_epi16(c, 4), table);
#else
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    *lo = _mm512_shuffle_epi8(table, _mm512_and_si512(c, low4));
    *hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(c, 4), low4));
#endif
}

/* The sum of the four dwords of each 16-byte lane of a, b, c, d: lane i of the result holds a's, b's, c's
 * and d's lane-i sums in dwords 4i, 4i + 1, 4i + 2, 4i + 3. */
static inline __m512i lane_sums(__m512i a, __m512i b, __m512i c, __m512i d) {
    __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
}

/* row_dots for int8 inputs, a set of 16 blocks (256 code bytes) a step. In each group of four blocks (64
 * bytes) the low and high nibbles become unsigned weights (q8_weights) and two vpdpbusd sum their products
 * with the even and odd inputs into lane i's dwords (block i of the group). The four groups' lanes are
 * summed into one vector (block 4k + i of the set at dword 4i + k), the offsets added, and the 16 blocks
 * scaled at once by the steps, then by 2^(scale - 127) (scale << 23 is that float for scale >= 1; scale
 * 0, 2^-127, is the subnormal 0x00400000). */
static void row_dots_q8(const uint8_t *blocks, const uint8_t *scales, int64_t G, const Q8Row *xs, int n, float *dots) {
    const __m512i table = _mm512_loadu_si512((const void *)U_E2M1), tiny = _mm512_set1_epi32(0x00400000);
    /* the set's 16 scale bytes in the sums' order: byte 4i + k <- byte 4k + i */
    const __m128i order = _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const int64_t sets = q8_sets(G);
    __m512 acc[MAX_ROWS];
    for (int j = 0; j < n; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t t = 0; t < sets; t++) {
        const int64_t g0 = 16 * t;
        __m512i lo[4], hi[4];
        __m128i sc;
        if (g0 + 16 <= G) {
            for (int k = 0; k < 4; k++) q8_weights(_mm512_loadu_si512((const void *)(blocks + 16 * (g0 + 4 * k))), table, &lo[k], &hi[k]);
            sc = _mm_loadu_si128((const __m128i *)(scales + g0));
        } else { /* the last 1-15 blocks: masked loads read nothing past the row */
            int64_t rem = G - g0;
            for (int k = 0; k < 4; k++) {
                int64_t have = rem - 4 * k < 0 ? 0 : (rem - 4 * k > 4 ? 4 : rem - 4 * k);
                __mmask64 mask = have == 4 ? ~0ULL : (1ULL << (16 * have)) - 1;
                q8_weights(_mm512_maskz_loadu_epi8(mask, blocks + 16 * (g0 + 4 * k)), table, &lo[k], &hi[k]);
            }
            sc = _mm_maskz_loadu_epi8((__mmask16)((1u << rem) - 1), scales + g0);
        }
        _mm_prefetch((const char *)(blocks + 16 * g0 + PREFETCH_AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char *)(blocks + 16 * g0 + PREFETCH_AHEAD + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(blocks + 16 * g0 + PREFETCH_AHEAD + 128), _MM_HINT_T0);
        _mm_prefetch((const char *)(blocks + 16 * g0 + PREFETCH_AHEAD + 192), _MM_HINT_T0);
        __m512i e = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(sc, order));
        __m512 factor = _mm512_castsi512_ps(_mm512_max_epi32(_mm512_slli_epi32(e, 23), tiny));
        for (int j = 0; j < n; j++) {
            const int8_t *xq = xs[j].q + 512 * t;
            __m512i s[4];
            for (int k = 0; k < 4; k++) {
                s[k] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[k], _mm512_loadu_si512((const void *)(xq + 128 * k)));
                s[k] = _mm512_dpbusd_epi32(s[k], hi[k], _mm512_loadu_si512((const void *)(xq + 128 * k + 64)));
            }
            __m512i sum = _mm512_add_epi32(lane_sums(s[0], s[1], s[2], s[3]), _mm512_loadu_si512((const void *)(xs[j].init + 16 * t)));
            /* the step first, so that a subnormal factor (scale 0) multiplies a sum of ordinary size */
            __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_loadu_ps(xs[j].step + 16 * t));
            acc[j] = _mm512_fmadd_ps(v, factor, acc[j]);
        }
    }
    for (int j = 0; j < n; j++) dots[j] = _mm512_reduce_add_ps(acc[j]);
}
#elif defined(GL_AVX2)
/* row_dots for int8 inputs on AVX2, two blocks (32 code bytes) a step: byte shuffles give the unsigned
 * weights, vpmaddubsw their products with the inputs in int16 pairs (at most 2 * 24 * 127, no
 * saturation), vpmaddwd sums those into lane i's dwords (block i). */
static void row_dots_q8(const uint8_t *blocks, const uint8_t *scales, int64_t G, const Q8Row *xs, int n, float *dots) {
    const __m256i table = _mm256_loadu_si256((const __m256i *)U_E2M1), low4 = _mm256_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t groups = (G + 1) / 2;
    __m256 acc[MAX_ROWS];
    for (int j = 0; j < n; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t t = 0; t < groups; t++) {
        const int64_t g = 2 * t;
        __m256i c;
        __m256 factor;
        if (g + 2 <= G) {
            c = _mm256_loadu_si256((const __m256i *)(blocks + 16 * g));
            factor = _mm256_setr_m128(_mm_set1_ps(POW2[scales[g]]), _mm_set1_ps(POW2[scales[g + 1]]));
        } else { /* one last block: the second lane reads nothing */
            c = _mm256_maskload_epi32((const int *)(blocks + 16 * g), _mm256_setr_epi32(-1, -1, -1, -1, 0, 0, 0, 0));
            factor = _mm256_setr_m128(_mm_set1_ps(POW2[scales[g]]), _mm_setzero_ps());
        }
        __m256i lo = _mm256_shuffle_epi8(table, _mm256_and_si256(c, low4));
        __m256i hi = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(c, 4), low4));
        for (int j = 0; j < n; j++) {
            __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(xs[j].q + 64 * t))),
                                             _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xs[j].q + 64 * t + 32))));
            __m256i init = _mm256_setr_m128i(_mm_cvtsi32_si128(xs[j].init[2 * t]), _mm_cvtsi32_si128(xs[j].init[2 * t + 1]));
            __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(pairs, ones), init);
            /* each block's four partial sums added into its first dword, exactly, before any rounding:
             * the partials are large (the codes' +12 offset, less 12 * sum(q) in one of them), and
             * rounded one by one they would bury a block's small total, or a tiny scale's product */
            sum = _mm256_hadd_epi32(sum, sum);
            sum = _mm256_blend_epi32(_mm256_setzero_si256(), _mm256_hadd_epi32(sum, sum), 0x11);
            __m256 step = _mm256_setr_m128(_mm_set1_ps(xs[j].step[2 * t]), _mm_set1_ps(xs[j].step[2 * t + 1]));
            acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sum), step), factor, acc[j]);
        }
    }
    for (int j = 0; j < n; j++) dots[j] = hsum256(acc[j]);
}
#else
static void row_dots_q8(const uint8_t *blocks, const uint8_t *scales, int64_t G, const Q8Row *xs, int n, float *dots) {
    for (int j = 0; j < n; j++) dots[j] = 0.0f;
    for (int64_t g = 0; g < G; g++) {
        int64_t t = g / Q8_W, lane = g % Q8_W;
        for (int j = 0; j < n; j++) {
            const int8_t *even = xs[j].q + t * Q8_W * 32 + lane * 16, *odd = even + Q8_W * 16;
            int32_t sum = xs[j].init[g];
            for (int i = 0; i < 16; i++) {
                uint8_t byte = blocks[16 * g + i];
                sum += U_E2M1[byte & 15] * even[i] + U_E2M1[byte >> 4] * odd[i];
            }
            dots[j] += ((float)sum * xs[j].step[g]) * POW2[scales[g]];
        }
    }
}
#endif

/* What follows a row's sums: `bias` (E, R) fp32, or bf16 bits with bias_bf16, or NULL; and with `act`
 * the gate|up epilogue of gpt-oss's experts (gl_mxfp4_gate_up_act). */
typedef struct {
    const void *bias;
    int bias_bf16, act, swiglu, out_bf16;
    float limit;
} Epilogue;

#define TILE 16 /* output rows of one task: even, so a task holds whole (gate, up) pairs */

#ifdef GL_AVX512
/* The act epilogue of one task: sums (bias added) t[j][0 .. r1 - r0) of interleaved (gate, up) rows
 * r0 .. r1 for its n input rows -> out[rows[j], r0/2 .. r1/2) of (M, R/2), fp32 or bf16 bits. With
 * out_bf16 the sums are rounded to bf16 first, as the bf16 model holds its gate|up product. */
static void gate_up_act(float t[MAX_ROWS][TILE], int n, const int64_t *rows, int64_t r0, int64_t r1, int64_t R,
                        const Epilogue *ep, void *out) {
    const int64_t I = R / 2, i0 = r0 / 2, np = (r1 - r0) / 2;
    const __mmask16 sums = (__mmask16)((1u << (r1 - r0)) - 1u), pairs = (__mmask16)((1u << np) - 1u);
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int j = 0; j < n; j++) {
        __m512 v = _mm512_maskz_loadu_ps(sums, t[j]);
        if (ep->out_bf16) v = round16(v);
        __m512 a = gated16(_mm512_permutexvar_ps(even, v), _mm512_permutexvar_ps(odd, v), ep->swiglu, ep->limit);
        if (ep->out_bf16) {
            __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(round16(a)), 16);
            _mm256_mask_storeu_epi16((uint16_t *)out + rows[j] * I + i0, pairs, _mm512_cvtepi32_epi16(bits));
        } else {
            _mm512_mask_storeu_ps((float *)out + rows[j] * I + i0, pairs, a);
        }
    }
}
#endif

/* out[m, r] = sum_k W[experts[m], r, k] * x[m, k] (+ bias[experts[m], r]), for m < M.
 * x (M, K) fp32, or bf16 bits when x_bf16; blocks (E, R, G, 16); scales (E, R, G); experts (M,) int64 in
 * [0, E) (the caller checks); out (M, R) fp32, or with ep->act (M, R/2) as gl_mxfp4_gate_up_act says.
 * Rows that use the same expert share each decoded weight block, MAX_ROWS at a time. Work is split over
 * (group of rows, tile of R). int8: x quantised per block of 32 (the opt-in path above), else the exact
 * products (bf16 inputs take the bf16 dot products only where gl_has_bf16_dot()). */
static void matvec(const void *x, int x_bf16, int int8, const uint8_t *blocks, const uint8_t *scales,
                   const int64_t *experts, const Epilogue *ep, int64_t M, int64_t E, int64_t R, int64_t G, void *out) {
    init_tables();
    const int64_t K = 32 * G;
    /* rows grouped by expert, MAX_ROWS per group: a counting sort keeps them in order */
    int64_t *order = malloc(sizeof(int64_t) * (M + 2 * E + 2 * M + 2));
    int64_t *count = order + M, *gstart = count + E + 1, ngroups = 0;
    memset(count, 0, sizeof(int64_t) * (E + 1));
    for (int64_t m = 0; m < M; m++) count[experts[m] + 1]++;
    for (int64_t e = 0; e < E; e++) count[e + 1] += count[e];
    for (int64_t m = 0; m < M; m++) order[count[experts[m]]++] = m; /* count[e] ends at e's end */
    for (int64_t m = 0; m < M;) {
        int64_t e = experts[order[m]], n = 0;
        gstart[ngroups++] = m;
        while (m < M && n < MAX_ROWS && experts[order[m]] == e) m++, n++;
    }
    gstart[ngroups] = M;
    const int64_t ntiles = (R + TILE - 1) / TILE;
    uint16_t *split = NULL; /* bf16 rows in row_dots_bf16's order (split_quads) */
    /* int8 rows in row_dots_q8's layout: per row, `slots` blocks (G padded to whole sets) */
    const int64_t slots = q8_sets(G) * Q8_SET;
    int8_t *q8 = NULL;
    int32_t *q8_init = NULL;
    float *q8_step = NULL;
    if (int8) { /* one allocation: steps and offsets (4 bytes each), then the codes */
        q8_step = malloc((size_t)M * slots * (2 * sizeof(float) + 32) + 64);
        q8_init = (int32_t *)(q8_step + M * slots);
        q8 = (int8_t *)(q8_init + M * slots);
        for (int64_t m = 0; m < M; m++)
            layout_q8(x, x_bf16, m, G, q8 + m * slots * 32, q8_init + m * slots, q8_step + m * slots);
    }
#ifdef GL_AVX512BF16
    else if (x_bf16) {
        split = malloc(sizeof(uint16_t) * (M * K + 1));
        for (int64_t m = 0; m < M; m++) split_quads((const uint16_t *)x + m * K, G, split + m * K);
    }
#endif
    float *pairs = NULL; /* fp32 rows in row_dots' AVX2 order (layout_pairs) */
#ifdef GL_AVX2
    if (!int8 && !split) {
        pairs = malloc(sizeof(float) * (M * K + 1));
        for (int64_t m = 0; m < M; m++) layout_pairs((const float *)x + m * K, G, pairs + m * K);
    }
#endif
#pragma omp parallel for schedule(dynamic, 4)
    for (int64_t u = 0; u < ngroups * ntiles; u++) {
        int64_t grp = u / ntiles, r0 = (u % ntiles) * TILE, r1 = r0 + TILE < R ? r0 + TILE : R;
        int n = (int)(gstart[grp + 1] - gstart[grp]);
        const int64_t *rows = order + gstart[grp];
        int64_t e = experts[rows[0]];
        const float *xs[MAX_ROWS];
        const uint16_t *xh[MAX_ROWS];
        Q8Row xq[MAX_ROWS];
        float dots[MAX_ROWS], sums[MAX_ROWS][TILE];
        for (int j = 0; j < n; j++) {
            xs[j] = (pairs ? pairs : (const float *)x) + rows[j] * K;
            xh[j] = split ? split + rows[j] * K : NULL;
            if (int8) {
                xq[j].q = q8 + rows[j] * slots * 32;
                xq[j].init = q8_init + rows[j] * slots;
                xq[j].step = q8_step + rows[j] * slots;
            }
        }
        for (int64_t r = r0; r < r1; r++) {
            int64_t wr = e * R + r;
            if (int8)
                row_dots_q8(blocks + wr * G * 16, scales + wr * G, G, xq, n, dots);
#ifdef GL_AVX512BF16
            else if (x_bf16)
                row_dots_bf16(blocks + wr * G * 16, scales + wr * G, G, xh, n, dots);
#endif
            else
                row_dots(blocks + wr * G * 16, scales + wr * G, G, xs, n, dots);
            const float b = !ep->bias       ? 0.0f
                            : ep->bias_bf16 ? widen(((const uint16_t *)ep->bias)[wr])
                                            : ((const float *)ep->bias)[wr];
            for (int j = 0; j < n; j++) {
                if (ep->act)
                    sums[j][r - r0] = dots[j] + b;
                else
                    ((float *)out)[rows[j] * R + r] = dots[j] + b;
            }
        }
#ifdef GL_AVX512
        if (ep->act) gate_up_act(sums, n, rows, r0, r1, R, ep, out);
#else
        (void)sums; /* ep->act is never set without AVX-512 */
#endif
    }
    free(q8_step);
    free(split);
    free(pairs);
    free(order);
}

/* The exact products (x_bf16 only where gl_has_bf16_dot()); bias fp32 or NULL. */
void gl_mxfp4_matvec(const void *x, int x_bf16, const uint8_t *blocks, const uint8_t *scales, const int64_t *experts,
                     const float *bias, int64_t M, int64_t E, int64_t R, int64_t G, float *out) {
    const Epilogue ep = {.bias = bias}; /* sums plus bias, nothing after them */
    matvec(x, x_bf16, 0, blocks, scales, experts, &ep, M, E, R, G, out);
}

/* The opt-in int8-activation products; x fp32 or bf16 (x_bf16) on every build. */
void gl_mxfp4_matvec_q8(const void *x, int x_bf16, const uint8_t *blocks, const uint8_t *scales,
                        const int64_t *experts, const float *bias, int64_t M, int64_t E, int64_t R, int64_t G,
                        float *out) {
    const Epilogue ep = {.bias = bias}; /* sums plus bias, nothing after them */
    matvec(x, x_bf16, 1, blocks, scales, experts, &ep, M, E, R, G, out);
}

/* Whether gl_mxfp4_gate_up_act is built here (AVX-512; elsewhere the caller keeps its own passes). */
int gl_mxfp4_has_gate_up_act(void) {
#ifdef GL_AVX512
    return 1;
#else
    return 0;
#endif
}

/* One step of gpt-oss's experts up to the down projection, in one pass:
 *   out[m, i] = act(round(g), round(u)),  g, u = (W[experts[m]] . x[m] + bias[experts[m]])[2i, 2i + 1]
 * W's rows interleaved as the checkpoints store them (row 2i gate i, row 2i + 1 up i), R = 2I even; bias
 * (E, R) fp32, bf16 bits (bias_bf16) or NULL; act SwiGLU (swiglu) or the clamped variant at `limit`, in
 * fp32 (gated16); with out_bf16 `round` rounds to bf16 and out (M, I) holds bf16 bits, else nothing is
 * rounded and out is fp32. The sums are matvec's (exact, or int8 with `int8`), so this equals
 * gl_mxfp4_matvec followed by those passes up to e^x's last bits. Returns 0, or -1 in a build without it
 * (nothing written) or for an odd R. */
int gl_mxfp4_gate_up_act(const void *x, int x_bf16, int int8, const uint8_t *blocks, const uint8_t *scales,
                         const int64_t *experts, const void *bias, int bias_bf16, int64_t M, int64_t E, int64_t R,
                         int64_t G, int swiglu, float limit, int out_bf16, void *out) {
#ifdef GL_AVX512
    if (R % 2) return -1;
    const Epilogue ep = {
        .bias = bias, .bias_bf16 = bias_bf16, .act = 1, .swiglu = swiglu, .out_bf16 = out_bf16, .limit = limit};
    matvec(x, x_bf16, int8, blocks, scales, experts, &ep, M, E, R, G, out);
    return 0;
#else
    (void)x, (void)x_bf16, (void)int8, (void)blocks, (void)scales, (void)experts, (void)bias, (void)bias_bf16;
    (void)M, (void)E, (void)R, (void)G, (void)swiglu, (void)limit, (void)out_bf16, (void)out;
    return -1;
#endif
}

/* W (R, K) of one matrix as fp32 (out_bf16 == 0) or as bf16 bits (out_bf16 != 0); both exact. */
void gl_mxfp4_dequant(const uint8_t *blocks, const uint8_t *scales, int64_t R, int64_t G, void *out, int out_bf16) {
    init_tables();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < R; r++) {
        float row[32];
        for (int64_t g = 0; g < G; g++) {
            float factor = HALF_POW2[scales[r * G + g]];
            const uint8_t *b = blocks + (r * G + g) * 16;
            for (int i = 0; i < 16; i++) {
                row[2 * i] = TWICE_E2M1[b[i] & 15] * factor;
                row[2 * i + 1] = TWICE_E2M1[b[i] >> 4] * factor;
            }
            int64_t at = r * G * 32 + g * 32;
            if (out_bf16) {
                uint16_t *o = (uint16_t *)out + at;
                for (int i = 0; i < 32; i++) {
                    uint32_t bits;
                    memcpy(&bits, &row[i], 4);
                    o[i] = (uint16_t)(bits >> 16); /* exact: E2M1 times a power of two has 2 mantissa bits */
                }
            } else {
                memcpy((float *)out + at, row, sizeof row);
            }
        }
    }
}
