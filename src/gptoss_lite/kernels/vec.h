/* Vector building blocks shared by the kernels (included, not built alone; kernels/build.py hashes
 * a source together with the local headers it includes).
 *
 * Register tiles of products of a few input rows by an out-major weight, for rows.c (a few rows by
 * one weight) and moe.c (rows grouped by expert):
 * tile(x, w, bias, ld, n, R, out, add, nr, nm): out[j * R + i] (+)= x[j] . w[i] (+ bias[i]) over n
 * columns, for i < nr weight rows and j < nm input rows, x and w rows ld elements apart; TILES[nr - 1]
 * [nm - 1] is the same with nr and nm constant. NR x NM is the largest tile of the path: AVX-512F/VL
 * (4 x 4 sums of 16 lanes), AVX2 + FMA (4 x 2 sums of 8 lanes), plain C. With AVX-512 BF16,
 * BF16_TILES is the same over bf16 rows and weights (32 pairs a dot-product instruction).
 *
 * Also, on every path: one bf16 value widened (`widen`) and one fp32 value rounded to bf16
 * (`to_bf16`), for moe.c and norm.c; with AVX2, 16 bf16 values widened as their even and odd halves
 * (`bf16_even8`, `bf16_odd8`) and an 8-lane sum (`hsum256`), for bf16.c and mxfp4.c.
 */
#ifndef GL_VEC_H
#define GL_VEC_H
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define GL_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512VL__)
#define GL_AVX512 1
#endif
/* The vector level a build has, as the kernels' gl_*_isa() report it: 2 AVX-512 (F and VL), 1 AVX2 + FMA,
 * 0 plain C. */
#if defined(GL_AVX512)
#define GL_VECTOR_LEVEL 2
#elif defined(GL_AVX2)
#define GL_VECTOR_LEVEL 1
#else
#define GL_VECTOR_LEVEL 0
#endif

#define INLINE static inline __attribute__((always_inline))

/* One bf16 value (its 16 bits) widened to fp32, exactly. */
static inline float widen(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* x rounded to the nearest bf16 (ties to even; no NaN comes here), as its 16 bits */
static inline uint16_t to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

#if defined(GL_AVX2)
/* 16 bf16 values as 8 32-bit words (element 2i in word i's low half, 2i + 1 in its high half): a shift
 * gives the even elements as 8 fp32, a mask the odd ones, exactly. For bf16.c's and mxfp4.c's AVX2 loops. */
INLINE __m256 bf16_even8(__m256i words) { return _mm256_castsi256_ps(_mm256_slli_epi32(words, 16)); }
INLINE __m256 bf16_odd8(__m256i words) {
    return _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* the sum of v's 8 lanes */
INLINE float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}
#endif

/* A tile: out[j * R + i] (+)= x[j] · w[i] (+ bias[i]) over n columns, for i < nr, j < nm; x and w rows
 * are ld floats apart. With `add` the sums go onto what out holds (a later chunk of K; bias is NULL).
 *
 * Each tile's sums are named variables, not an array: GCC keeps an array of sixteen vectors in memory
 * (it scalarises smaller aggregates only), a store per FMA. `a<j><i>` sums input row j times weight row
 * i; with i >= nr or j >= nm it stays zero and the compiler drops it. The empty asm statements pin
 * each loaded vector to a register: otherwise GCC folds the loads into the FMAs as memory operands,
 * and each vector is loaded nr (or nm) times. */
#if defined(GL_AVX512)
#define NR 4
#define NM 4
/* [a0+a2, b0+b2, a1+a3, b1+b3] in each 128-bit chunk */
INLINE __m512 fold1(__m512 a, __m512 b) { return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); }
/* from fold1(a, b) and fold1(c, d): each chunk's sums of a, b, c, d */
INLINE __m512 fold2(__m512 ab, __m512 cd) {
    __m512d p = _mm512_castps_pd(ab), q = _mm512_castps_pd(cd);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p, q)), _mm512_castpd_ps(_mm512_unpackhi_pd(p, q)));
}
/* chunks [p0+p1, p2+p3, q0+q1, q2+q3] */
INLINE __m512 fold3(__m512 p, __m512 q) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(p, q, 0x88), _mm512_shuffle_f32x4(p, q, 0xDD));
}
/* lane 4j + i of the result: the sum of the 16 lanes of a<j><i> */
INLINE __m512 sum16(__m512 a00, __m512 a01, __m512 a02, __m512 a03, __m512 a10, __m512 a11, __m512 a12,
                    __m512 a13, __m512 a20, __m512 a21, __m512 a22, __m512 a23, __m512 a30, __m512 a31,
                    __m512 a32, __m512 a33) {
    __m512 t0 = fold2(fold1(a00, a01), fold1(a02, a03)), t1 = fold2(fold1(a10, a11), fold1(a12, a13));
    __m512 t2 = fold2(fold1(a20, a21), fold1(a22, a23)), t3 = fold2(fold1(a30, a31), fold1(a32, a33));
    return fold3(fold3(t0, t1), fold3(t2, t3));
}

#define LOAD(p) _mm512_maskz_loadu_ps(lanes, p)
#define FMA(J, I)                                                                                    \
    if (nr > I) a##J##I = _mm512_fmadd_ps(w##I, xv, a##J##I)
#define ROW(J)                                                                                       \
    if (nm > J) {                                                                                    \
        __m512 xv = LOAD(x + J * ld + k);                                                            \
        __asm__("" : "+v"(xv));                                                                      \
        FMA(J, 0);                                                                                   \
        FMA(J, 1);                                                                                   \
        FMA(J, 2);                                                                                   \
        FMA(J, 3);                                                                                   \
    }
#define STEP                                                                                         \
    {                                                                                                \
        __m512 w0 = LOAD(w + k), w1 = nr > 1 ? LOAD(w + ld + k) : z;                                 \
        __m512 w2 = nr > 2 ? LOAD(w + 2 * ld + k) : z, w3 = nr > 3 ? LOAD(w + 3 * ld + k) : z;       \
        __asm__("" : "+v"(w0), "+v"(w1), "+v"(w2), "+v"(w3));                                        \
        ROW(0)                                                                                       \
        ROW(1)                                                                                       \
        ROW(2)                                                                                       \
        ROW(3)                                                                                       \
    }

INLINE void tile(const float *x, const float *w, const float *bias, int64_t ld, int64_t n, int64_t R, float *out,
                 int add, int nr, int nm) {
    const __m512 z = _mm512_setzero_ps();
    __m512 a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z;
    __m512 a20 = z, a21 = z, a22 = z, a23 = z, a30 = z, a31 = z, a32 = z, a33 = z;
    int64_t k = 0;
    for (; k + 16 <= n; k += 16) {
        const __mmask16 lanes = 0xFFFF;
        STEP
    }
    if (k < n) { /* masked-off lanes are not read, and load as zeros */
        const __mmask16 lanes = (__mmask16)((1u << (n - k)) - 1u);
        STEP
    }
    const __m512 sums = sum16(a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33);
    const __mmask8 cols = (__mmask8)((1u << nr) - 1u);
    const __m128 b = bias ? _mm_maskz_loadu_ps(cols, bias) : _mm_setzero_ps();
    /* row j of the tile is 128-bit chunk j of the sums; a full row is a plain store */
#define PUT(J, V)                                                                                    \
    if (nm > J) {                                                                                    \
        __m128 v = _mm_add_ps(V, b);                                                                 \
        float *o = out + J * R;                                                                      \
        if (nr == 4) _mm_storeu_ps(o, add ? _mm_add_ps(v, _mm_loadu_ps(o)) : v);                     \
        else _mm_mask_storeu_ps(o, cols, add ? _mm_add_ps(v, _mm_maskz_loadu_ps(cols, o)) : v);      \
    }
    PUT(0, _mm512_castps512_ps128(sums))
    PUT(1, _mm512_extractf32x4_ps(sums, 1))
    PUT(2, _mm512_extractf32x4_ps(sums, 2))
    PUT(3, _mm512_extractf32x4_ps(sums, 3))
}

#elif defined(GL_AVX2)
#define NR 4
#define NM 2
/* lane 4j + i of the result: the sum of the 8 lanes of a<j><i> */
INLINE __m256 sum8(__m256 a00, __m256 a01, __m256 a02, __m256 a03, __m256 a10, __m256 a11, __m256 a12,
                   __m256 a13) {
    /* per 128-bit half: that half's sums of a0i, and of a1i */
    __m256 p = _mm256_hadd_ps(_mm256_hadd_ps(a00, a01), _mm256_hadd_ps(a02, a03));
    __m256 q = _mm256_hadd_ps(_mm256_hadd_ps(a10, a11), _mm256_hadd_ps(a12, a13));
    return _mm256_add_ps(_mm256_permute2f128_ps(p, q, 0x20), _mm256_permute2f128_ps(p, q, 0x31));
}

/* a window of it, read from LANES + 8 - n, has n leading -1s: the mask of the first n lanes */
static const int32_t LANES[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

#define LOAD(p) (full ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, lanes))
#define FMA(J, I)                                                                                    \
    if (nr > I) a##J##I = _mm256_fmadd_ps(w##I, xv, a##J##I)
#define ROW(J)                                                                                       \
    if (nm > J) {                                                                                    \
        __m256 xv = LOAD(x + J * ld + k);                                                            \
        __asm__("" : "+x"(xv));                                                                      \
        FMA(J, 0);                                                                                   \
        FMA(J, 1);                                                                                   \
        FMA(J, 2);                                                                                   \
        FMA(J, 3);                                                                                   \
    }
#define STEP                                                                                         \
    {                                                                                                \
        __m256 w0 = LOAD(w + k), w1 = nr > 1 ? LOAD(w + ld + k) : z;                                 \
        __m256 w2 = nr > 2 ? LOAD(w + 2 * ld + k) : z, w3 = nr > 3 ? LOAD(w + 3 * ld + k) : z;       \
        __asm__("" : "+x"(w0), "+x"(w1), "+x"(w2), "+x"(w3));                                        \
        ROW(0)                                                                                       \
        ROW(1)                                                                                       \
    }

INLINE void tile(const float *x, const float *w, const float *bias, int64_t ld, int64_t n, int64_t R, float *out,
                 int add, int nr, int nm) {
    const __m256 z = _mm256_setzero_ps();
    __m256 a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z;
    int64_t k = 0;
    for (; k + 8 <= n; k += 8) {
        const int full = 1;
        const __m256i lanes = _mm256_setzero_si256();
        (void)lanes;
        STEP
    }
    if (k < n) { /* masked-off lanes are not read, and load as zeros */
        const int full = 0;
        const __m256i lanes = _mm256_loadu_si256((const __m256i *)(LANES + 8 - (n - k)));
        STEP
    }
    const __m256 sums = sum8(a00, a01, a02, a03, a10, a11, a12, a13);
    const __m128i cols = _mm_loadu_si128((const __m128i *)(LANES + 8 - nr));
    const __m128 b = bias ? _mm_maskload_ps(bias, cols) : _mm_setzero_ps();
    /* row j of the tile is 128-bit half j of the sums; a full row is a plain store (vmaskmovps stores
     * are slow on several CPUs) */
#define PUT(J, V)                                                                                    \
    if (nm > J) {                                                                                    \
        __m128 v = _mm_add_ps(V, b);                                                                 \
        float *o = out + J * R;                                                                      \
        if (nr == 4) _mm_storeu_ps(o, add ? _mm_add_ps(v, _mm_loadu_ps(o)) : v);                     \
        else _mm_maskstore_ps(o, cols, add ? _mm_add_ps(v, _mm_maskload_ps(o, cols)) : v);          \
    }
    PUT(0, _mm256_castps256_ps128(sums))
    PUT(1, _mm256_extractf128_ps(sums, 1))
}

#else
#define NR 4
#define NM 4
INLINE void tile(const float *x, const float *w, const float *bias, int64_t ld, int64_t n, int64_t R, float *out,
                 int add, int nr, int nm) {
    for (int j = 0; j < nm; j++)
        for (int i = 0; i < nr; i++) {
            float s = 0.0f;
            for (int64_t k = 0; k < n; k++) s += x[j * ld + k] * w[i * ld + k];
            s += bias ? bias[i] : 0.0f;
            out[j * R + i] = add ? out[j * R + i] + s : s;
        }
}
#endif

/* One function per tile shape, so that every test of nr and nm is on a constant: the unused sums
 * and loads vanish and the rest stay in registers. */
typedef void (*tile_fn)(const float *, const float *, const float *, int64_t, int64_t, int64_t, float *, int);
#define TILE_FN(I, J)                                                                                \
    static __attribute__((unused)) void tile_##I##_##J(const float *x, const float *w, const float *b, int64_t ld, int64_t n, \
                               int64_t R, float *out, int add) {                                     \
        tile(x, w, b, ld, n, R, out, add, I, J);                                                     \
    }
#if NM == 4
#define TILE_ROW(I) TILE_FN(I, 1) TILE_FN(I, 2) TILE_FN(I, 3) TILE_FN(I, 4)
#define TILE_NAMES(I) {tile_##I##_1, tile_##I##_2, tile_##I##_3, tile_##I##_4}
#else
#define TILE_ROW(I) TILE_FN(I, 1) TILE_FN(I, 2)
#define TILE_NAMES(I) {tile_##I##_1, tile_##I##_2}
#endif
TILE_ROW(1)
TILE_ROW(2)
TILE_ROW(3)
TILE_ROW(4)
static const tile_fn TILES[NR][NM] __attribute__((unused)) = {TILE_NAMES(1), TILE_NAMES(2), TILE_NAMES(3), TILE_NAMES(4)};

#if defined(GL_AVX512) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define GL_BF16_TILES 1
/* `tile` over bf16 rows and weights (uint16 bits, ld elements apart), no `add`: each dot-product
 * instruction multiplies 32 pairs exactly into fp32 and adds them onto 16 sums, so the result is the
 * fp32 sums of the exact products, in another order than a widening GEMM's. */
#define B16_LOAD(p) _mm512_maskz_loadu_epi16(lanes, p)
#define B16_DOT(J, I)                                                                                \
    if (nr > I) a##J##I = _mm512_dpbf16_ps(a##J##I, (__m512bh)w##I, (__m512bh)xv)
#define B16_ROW(J)                                                                                   \
    if (nm > J) {                                                                                    \
        __m512i xv = B16_LOAD(x + J * ld + k);                                                       \
        __asm__("" : "+v"(xv));                                                                      \
        B16_DOT(J, 0);                                                                               \
        B16_DOT(J, 1);                                                                               \
        B16_DOT(J, 2);                                                                               \
        B16_DOT(J, 3);                                                                               \
    }
#define B16_STEP                                                                                     \
    {                                                                                                \
        __m512i w0 = B16_LOAD(w + k), w1 = nr > 1 ? B16_LOAD(w + ld + k) : zi;                       \
        __m512i w2 = nr > 2 ? B16_LOAD(w + 2 * ld + k) : zi, w3 = nr > 3 ? B16_LOAD(w + 3 * ld + k) : zi; \
        __asm__("" : "+v"(w0), "+v"(w1), "+v"(w2), "+v"(w3));                                        \
        B16_ROW(0)                                                                                   \
        B16_ROW(1)                                                                                   \
        B16_ROW(2)                                                                                   \
        B16_ROW(3)                                                                                   \
    }

INLINE void bf16_tile(const uint16_t *x, const uint16_t *w, const float *bias, int64_t ld, int64_t n, int64_t R,
                      float *out, int nr, int nm) {
    const __m512 z = _mm512_setzero_ps();
    const __m512i zi = _mm512_setzero_si512();
    __m512 a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z;
    __m512 a20 = z, a21 = z, a22 = z, a23 = z, a30 = z, a31 = z, a32 = z, a33 = z;
    int64_t k = 0;
    for (; k + 32 <= n; k += 32) {
        const __mmask32 lanes = 0xFFFFFFFFu;
        B16_STEP
    }
    if (k < n) { /* masked-off lanes are not read, and load as zeros (+0 products) */
        const __mmask32 lanes = (__mmask32)((1u << (n - k)) - 1u);
        B16_STEP
    }
    const __m512 sums = sum16(a00, a01, a02, a03, a10, a11, a12, a13, a20, a21, a22, a23, a30, a31, a32, a33);
    const __mmask8 cols = (__mmask8)((1u << nr) - 1u);
    const __m128 b = bias ? _mm_maskz_loadu_ps(cols, bias) : _mm_setzero_ps();
    const __m128 rows[4] = {_mm512_castps512_ps128(sums), _mm512_extractf32x4_ps(sums, 1),
                            _mm512_extractf32x4_ps(sums, 2), _mm512_extractf32x4_ps(sums, 3)};
    for (int j = 0; j < nm; j++) _mm_mask_storeu_ps(out + j * R, cols, _mm_add_ps(rows[j], b));
}

typedef void (*bf16_tile_fn)(const uint16_t *, const uint16_t *, const float *, int64_t, int64_t, int64_t, float *);
#define B16_TILE_FN(I, J)                                                                            \
    static __attribute__((unused)) void bf16_tile_##I##_##J(const uint16_t *x, const uint16_t *w, const float *b, int64_t ld, \
                                    int64_t n, int64_t R, float *out) {                              \
        bf16_tile(x, w, b, ld, n, R, out, I, J);                                                     \
    }
#define B16_TILE_ROW(I) B16_TILE_FN(I, 1) B16_TILE_FN(I, 2) B16_TILE_FN(I, 3) B16_TILE_FN(I, 4)
#define B16_TILE_NAMES(I) {bf16_tile_##I##_1, bf16_tile_##I##_2, bf16_tile_##I##_3, bf16_tile_##I##_4}
B16_TILE_ROW(1)
B16_TILE_ROW(2)
B16_TILE_ROW(3)
B16_TILE_ROW(4)
static const bf16_tile_fn BF16_TILES[4][4] __attribute__((unused)) = {B16_TILE_NAMES(1), B16_TILE_NAMES(2), B16_TILE_NAMES(3),
                                              B16_TILE_NAMES(4)};
#endif

#if defined(__AVX512F__)
/* 16 lanes rounded to bf16 and widened back (ties to even; NaN is not expected) */
INLINE __m512 round16(__m512 v) {
    __m512i bits = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    bits = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
    return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* e^x in 16 lanes, x clamped to [-87, 88] (e^-87 ~ 1.6e-38; callers that need 0 below it mask the
 * lanes themselves): x = n ln 2 + r, |r| <= ln 2 / 2, e^r by its Taylor polynomial to r^6 (relative
 * error ~1e-7), times 2^n. */
INLINE __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* The experts' gated activation of 16 (gate, up) pairs, in fp32: SwiGLU, silu(g) * u, or gpt-oss's
 * clamped variant, (clamp(u, ±limit) + 1) * g' * sigmoid(1.702 g') with g' = min(g, limit); the same
 * operations in the same order as `model.moe.activate` (e^x by exp512). For moe.c and mxfp4.c. */
INLINE __m512 gated16(__m512 g, __m512 u, int swiglu, float limit) {
    const __m512 one = _mm512_set1_ps(1.0f);
    if (swiglu) /* silu(g) * u = g * (1 / (1 + e^-g)) * u */
        return _mm512_mul_ps(
            _mm512_mul_ps(g, _mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))))), u);
    g = _mm512_min_ps(g, _mm512_set1_ps(limit));
    u = _mm512_max_ps(_mm512_min_ps(u, _mm512_set1_ps(limit)), _mm512_set1_ps(-limit));
    __m512 sig = _mm512_div_ps(
        one, _mm512_add_ps(one, exp512(_mm512_mul_ps(_mm512_set1_ps(-1.0f), _mm512_mul_ps(g, _mm512_set1_ps(1.702f))))));
    return _mm512_mul_ps(_mm512_add_ps(u, one), _mm512_mul_ps(g, sig));
}
#endif

#endif /* GL_VEC_H */
