/* fp32 products of a few rows by an out-major weight, for gptoss-lite's batched decode step.
 *
 * out[m, r] = sum_k x[m, k] * W[r, k] (+ bias[r]) for x (M, K), W (R, K), both fp32 and contiguous,
 * bias (R,) or NULL, out (M, R): F.linear(x, W, bias), the same fp32 products summed in another order.
 * M is the number of sequences in the step (2..64, often 16). There MKL's sgemm runs the toy model's
 * output head (12,288 x 256) at 30-70 GFLOP/s on two Zen 4 cores, a third of what they can do.
 *
 * Both operands run along K, so a tile of NR weight rows by NM input rows keeps NR * NM vector sums:
 * each vector load of W feeds NM FMAs, each load of x NR. At the end of its K a tile's sums are reduced
 * all together by a transposing tree, about three shuffles or adds per sum, and stored (or added, for
 * a later chunk of K) as NM short rows of out.
 *
 * The weight is cut into pieces of `rb` rows by `kc` columns (about 16 KB, so a piece stays in L1):
 * every input row passes over a piece while it is hot, and the next piece is prefetched meanwhile,
 * its lines spread over the current piece's tiles. Threads take contiguous runs of row blocks, so each
 * reads its part of W once, in order; x is small and stays in L1/L2.
 *
 * Paths: AVX-512F/VL (tiles of 4 x 4 sums of 16 lanes), AVX2 + FMA (4 x 2 sums of 8 lanes), plain C.
 * Built on first use by gptoss_lite/kernels/build.py with -O3 -march=native -fopenmp; OpenMP here is
 * the runtime PyTorch already loaded, so the thread count is torch's.
 */
#include <stdint.h>
#include <stddef.h>
#include <omp.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define GL_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512VL__)
#define GL_AVX512 1
#endif

#define INLINE static inline __attribute__((always_inline))
/* Below this many multiply-adds a product runs on the calling thread: waking the others costs more. */
#define PARALLEL_MIN (1 << 17)
#define PIECE_BYTES (16 * 1024) /* a piece of W: rb rows x kc columns */
#define KC_MAX 256              /* columns per piece; K is cut into chunks of at most this */
#define RB_MAX 256

/* Which path this build takes: 2 AVX-512, 1 AVX2, 0 plain C. */
int gl_rows_isa(void) {
#if defined(GL_AVX512)
    return 2;
#elif defined(GL_AVX2)
    return 1;
#else
    return 0;
#endif
}

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
    static void tile_##I##_##J(const float *x, const float *w, const float *b, int64_t ld, int64_t n, \
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
static const tile_fn TILES[NR][NM] = {TILE_NAMES(1), TILE_NAMES(2), TILE_NAMES(3), TILE_NAMES(4)};

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* out (M, R) = x (M, K) · W (R, K)ᵀ (+ bias (R,)), all fp32 and contiguous; bias may be NULL. */
void gl_rows_mm(const float *x, const float *w, const float *bias, int64_t M, int64_t R, int64_t K, float *out) {
    if (M <= 0 || R <= 0) return;
    /* K in chunks of kc (a multiple of 16, so only the last has a tail), rows in blocks of rb */
    const int64_t nk = (K + KC_MAX - 1) / KC_MAX;
    const int64_t kc = K <= KC_MAX ? (K > 0 ? K : 1) : ((K + nk - 1) / nk + 15) / 16 * 16;
    int64_t rb = PIECE_BYTES / (4 * kc) / NR * NR;
    rb = rb < NR ? NR : rb > RB_MAX ? RB_MAX : rb;
    const int64_t nblocks = (R + rb - 1) / rb;
    const int64_t mtiles = (M + NM - 1) / NM;
    const int parallel = M * R * K >= PARALLEL_MIN;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t blk = 0; blk < nblocks; blk++) {
        const int64_t rb0 = blk * rb, rb1 = min64(rb0 + rb, R);
        const int64_t calls = mtiles * ((rb1 - rb0 + NR - 1) / NR);
        int64_t k0 = 0;
        do { /* K == 0 still writes out: zeros, or the bias */
            const int64_t kn = min64(kc, K - k0);
            /* the piece read next: the next chunk of K in these rows, else the next block's first
             * (contiguous when K is one chunk); its lines are prefetched, a share before each tile */
            const int more = k0 + kc < K;
            const int64_t pk0 = more ? k0 + kc : 0, prow = more ? rb0 : rb1;
            const int64_t prows = more ? rb1 - rb0 : min64(rb, R - rb1);
            /* rows of a chunk are prefetched one by one (they need not start on a line: +1 line) */
            const int64_t row_bytes = kc < K ? 4 * min64(kc, K - pk0) + 64 : 4 * prows * K;
            const int64_t nrows = kc < K ? prows : 1, row_lines = (row_bytes + 63) / 64;
            const int64_t per = (nrows * row_lines + calls - 1) / calls;
            const char *row = (const char *)(w + prow * K + pk0), *pf = row, *row_end = row + 64 * row_lines;
            int64_t rows_left = prows > 0 ? nrows : 0;
            for (int64_t m0 = 0; m0 < M; m0 += NM) {
                const int nm = (int)min64(NM, M - m0);
                for (int64_t r0 = rb0; r0 < rb1; r0 += NR) {
                    const int nr = (int)min64(NR, rb1 - r0);
                    for (int64_t n = rows_left ? per : 0; n > 0; n--) {
                        __builtin_prefetch(pf);
                        pf += 64;
                        if (pf == row_end && --rows_left == 0) break;
                        if (pf == row_end) row += 4 * K, pf = row, row_end = row + 64 * row_lines;
                    }
                    TILES[nr - 1][nm - 1](x + m0 * K + k0, w + r0 * K + k0, k0 == 0 && bias ? bias + r0 : NULL, K,
                                          kn, R, out + m0 * R + r0, k0 > 0);
                }
            }
            k0 += kc;
        } while (k0 < K);
    }
}
