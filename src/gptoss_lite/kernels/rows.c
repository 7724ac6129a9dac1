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
#include "vec.h"

/* Below this many multiply-adds a product runs on the calling thread: waking the others costs more. */
#define PARALLEL_MIN (1 << 17)
#define PIECE_BYTES (16 * 1024) /* a piece of W: rb rows x kc columns */
#define KC_MAX 256              /* columns per piece; K is cut into chunks of at most this */
#define RB_MAX 256

/* Which path this build takes: 2 AVX-512, 1 AVX2, 0 plain C. */
int gl_rows_isa(void) { return GL_VECTOR_LEVEL; }

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

/* gl_rows_argmax's vectors (GCC's vector extensions: one AVX-512 register, two AVX2 ones, or plain C). */
typedef float gl_vf __attribute__((vector_size(64)));
typedef int32_t gl_vi __attribute__((vector_size(64)));
#define ARGMAX_LANES 16
/* v = the 16 floats at p (a macro: a vector argument or result of a function would change the calling
 * convention between the AVX-512, AVX2 and plain-C builds) */
#define LOAD_VF(v, p) __builtin_memcpy(&(v), (p), sizeof(gl_vf))

/* out[m] = the index of the largest of x[m, 0..V) (rows ld elements apart, V >= 1): the first of
 * equals, or the first NaN where a row holds one; torch.argmax's answer. One vector pass per row: each
 * of 16 lanes keeps its largest value, the index where it first met it, and whether it met a NaN;
 * torch's CPU argmax compares one element at a time (16 rows of 12,288: ~80 µs on two Zen 4 cores, ~19 µs here). */
void gl_rows_argmax(const float *x, int64_t M, int64_t V, int64_t ld, int64_t *out) {
#pragma omp parallel for schedule(static) if (M > 1 && M * V >= PARALLEL_MIN)
    for (int64_t m = 0; m < M; m++) {
        const float *row = x + m * ld;
        const int64_t body = V / ARGMAX_LANES * ARGMAX_LANES;
        float best = row[0];
        int64_t at = 0;
        int nan = 0;
        if (body) {
            gl_vf lane, v;
            LOAD_VF(lane, row);
            gl_vi index, step = {0}, nans = lane != lane;
            for (int j = 0; j < ARGMAX_LANES; j++) index[j] = j;
            gl_vi where = index;
            for (int64_t i = ARGMAX_LANES; i < body; i += ARGMAX_LANES) {
                LOAD_VF(v, row + i);
                step += ARGMAX_LANES;
                const gl_vi gt = v > lane;
                lane = (gl_vf)((gt & (gl_vi)v) | (~gt & (gl_vi)lane));
                where = (gt & (index + step)) | (~gt & where);
                nans |= v != v;
            }
            int32_t any = 0;
            for (int j = 0; j < ARGMAX_LANES; j++) {
                any |= nans[j];
                if (lane[j] > best || (lane[j] == best && where[j] < at)) best = lane[j], at = where[j];
            }
            nan = any != 0;
        }
        for (int64_t i = body; i < V; i++) {
            if (row[i] > best) best = row[i], at = i;
            nan |= row[i] != row[i];
        }
        if (nan) {
            at = 0;
            while (row[at] == row[at]) at++;
        }
        out[m] = at;
    }
}
