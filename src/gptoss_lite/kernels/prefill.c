/* Prefill attention for gptoss-lite: many queries over dense keys, with sinks, a causal rule, an
 * optional sliding window and grouped KV heads (docs/model.md#attention-with-sinks).
 *
 * out[b, t, h, :] = sum_j p_j v[b, h / G, j, :], where p is the softmax over the keys query t sees
 * (key j <= q_offset + t and, with a window W, q_offset + t - j < W) and, when sinks are given, one
 * more logit per head that takes probability but carries no value. Scores are q . k * scale in fp32;
 * inputs are fp32 or bf16 (widened exactly), sums fp32, out fp32 (B, T, H, D).
 *
 * Why a kernel of its own: at the head sizes of this model family (D = 32 or 64) PyTorch's fused CPU
 * kernel multiplies blocks with a 32-deep inner product through a general GEMM, and with grouped heads
 * its causal mode needs the keys repeated per head. Here one task is one KV head and 32 queries of
 * all of its G query heads. Each 64-key tile is widened to fp32 and transposed for the scores once
 * and used by all G * 32 rows: without a window once per call, in tiles every task shares (a causal
 * tile serves every later query block); with a window once per task, from the task's first key. The
 * scores of 8 (D = 32) or 4 (D = 64) rows at a time stay in registers, and tiles that no query of a
 * row group sees are skipped, and so are the vectors of 16 keys it does not see in the tiles on its
 * edges (a window's lower edge, the causal diagonal; benchmarks/prefill_attention_ab.py measured 1.10x
 * on a 128-token window's layer and 1.005-1.04x on a causal one, Zen 5, 512-8,192 tokens). The softmax
 * is online per row (running max, sum and values), the sink being the starting state (max = sink
 * logit, sum = 1).
 *
 * Built only for CPUs with AVX-512 (gl_has_prefill_attention says whether); elsewhere the caller
 * keeps PyTorch's kernel.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "vec.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#define GL_AVX512 1
#endif

#define KT 64 /* keys per tile */
#define QT 32 /* queries per task, per head */
#define MAX_G 8
#define MAX_D 64
#ifndef SHARED_MAX /* a test builds it with 0, so that every task fills its own tiles */
#define SHARED_MAX ((size_t)256 << 20) /* bytes of shared key tiles, at most */
#endif

int gl_has_prefill_attention(void) {
#ifdef GL_AVX512
    return 1;
#else
    return 0;
#endif
}

#ifdef GL_AVX512
/* One row of D values, fp32 or bf16, into fp32 (times `scale`). */
static inline void load_row(const void *base, int bf16, int64_t at, int D, float scale, float *dst) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)base + at;
        for (int d = 0; d < D; d++) {
            uint32_t bits = (uint32_t)src[d] << 16;
            float f;
            memcpy(&f, &bits, 4);
            dst[d] = f * scale;
        }
    } else {
        const float *src = (const float *)base + at;
        for (int d = 0; d < D; d++) dst[d] = src[d] * scale;
    }
}

/* Lanes of keys kb .. kb+15 that a query at key index qp sees, within the tile's n_end keys. */
static inline __mmask16 lanes(int64_t qp, int64_t kb, int64_t window, int64_t end) {
    int64_t hi = qp + 1 < end ? qp + 1 : end; /* keys < hi */
    int64_t c_hi = hi - kb, c_lo = window > 0 ? qp - window + 1 - kb : 0;
    c_hi = c_hi < 0 ? 0 : (c_hi > 16 ? 16 : c_hi);
    c_lo = c_lo < 0 ? 0 : (c_lo > 16 ? 16 : c_lo);
    uint32_t m = ((1u << c_hi) - 1u) & ~((1u << c_lo) - 1u);
    return (__mmask16)m;
}

/* e^x for a score minus its row's running max: x <= 0 in every lane the row sees, so `exp512`'s clamps
 * go (below -87 the result underflows to 0 through vscalefps; a lane the row does not see may
 * overflow or be NaN, and is masked to 0 by the caller). */
static inline __m512 exp_scores(__m512 x) {
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    /* e^r, |r| <= ln 2 / 2, by a degree-5 polynomial fitted for relative error (Lawson's iteration
     * over Chebyshev nodes): max 2.2e-7 evaluated in fp32, where exp512's degree-6 Taylor gives 2.4e-7 */
    __m512 p = _mm512_set1_ps(8.297654793e-03f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.191538198e-02f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.666757473e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.999889485e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.999996920e-01f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.000000072e+00f));
    return _mm512_scalef_ps(p, n);
}

/* Every lane of the result holds the largest lane of x. */
static inline __m512 all_max(__m512 x) {
    x = _mm512_max_ps(x, _mm512_shuffle_f32x4(x, x, 0x4E));
    x = _mm512_max_ps(x, _mm512_shuffle_f32x4(x, x, 0xB1));
    x = _mm512_max_ps(x, _mm512_permute_ps(x, 0x4E));
    return _mm512_max_ps(x, _mm512_permute_ps(x, 0xB1));
}

/* The rows r0 .. r0+RG-1 of a task (consecutive queries of one head) against one tile: scores in
 * registers, the online-softmax update, and the values. Q (rows, D) pre-scaled, Kt the tile's keys
 * transposed (D rows, ldk apart), V (n, D), n keys in the tile from key index ks; qp0 the key index of
 * row r0's query; `full` when every row sees every key of the tile; only the vectors of 16 keys jlo ..
 * jhi-1 hold a key some row sees (a window's lower edge, the causal diagonal, a short last tile), and
 * the others are neither scored nor weighed. A row's running max m and sum l stay vectors (16 lanes
 * each; the max's lanes equal, the sum's added up at the end), so the update needs no scalar
 * exponential and no horizontal sum per tile. */
static inline __attribute__((always_inline)) void rows_tile(
    const float *Q, const float *Kt, int64_t ldk, const float *V, float *acc, float *m, float *l, int r0, int RG,
    int D, int n, int64_t ks, int64_t qp0, int64_t window, int full, int jlo, int jhi) {
    __m512 s[8][KT / 16];
    for (int jv = 0; jv < KT / 16; jv++) {
        for (int r = 0; r < RG; r++) s[r][jv] = _mm512_setzero_ps();
        if (jv < jlo || jv >= jhi) continue;
        for (int d = 0; d < D; d++) {
            __m512 kv = _mm512_load_ps(Kt + d * ldk + 16 * jv);
            for (int r = 0; r < RG; r++)
                s[r][jv] = _mm512_fmadd_ps(_mm512_set1_ps(Q[(r0 + r) * D + d]), kv, s[r][jv]);
        }
    }
    float p[8][KT] __attribute__((aligned(64)));
    __m512 corr[8];
    int grew[8];
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (int r = 0; r < RG; r++) {
        __mmask16 mk[KT / 16];
        __m512 mx = ninf;
        for (int jv = 0; jv < KT / 16; jv++) {
            mk[jv] = full ? (__mmask16)0xFFFF : jv < jlo || jv >= jhi ? 0 : lanes(qp0 + r, ks + 16 * jv, window, ks + n);
            mx = _mm512_mask_max_ps(mx, mk[jv], mx, s[r][jv]);
        }
        float *mr = m + (r0 + r) * 16, *lr = l + (r0 + r) * 16;
        __m512 m_old = _mm512_load_ps(mr);
        __m512 m_new = _mm512_max_ps(all_max(mx), m_old), sum = _mm512_setzero_ps();
        for (int jv = 0; jv < KT / 16; jv++) {
            if (jv < jlo || jv >= jhi) continue;
            __m512 e = _mm512_maskz_mov_ps(mk[jv], exp_scores(_mm512_sub_ps(s[r][jv], m_new)));
            sum = _mm512_add_ps(sum, e);
            _mm512_store_ps(p[r] + 16 * jv, e);
        }
        /* the running max rarely grows after the first tiles: then nothing is rescaled (the lanes are
         * equal, so one compare tells) */
        grew[r] = _mm512_cmp_ps_mask(m_new, m_old, _CMP_GT_OQ) != 0;
        if (grew[r]) {
            corr[r] = exp512(_mm512_sub_ps(m_old, m_new)); /* below e^-87 from the -1e30 start: l, acc are 0 */
            _mm512_store_ps(lr, _mm512_fmadd_ps(_mm512_load_ps(lr), corr[r], sum));
            _mm512_store_ps(mr, m_new);
        } else {
            _mm512_store_ps(lr, _mm512_add_ps(_mm512_load_ps(lr), sum));
        }
    }
    __m512 o[8][MAX_D / 16];
    for (int r = 0; r < RG; r++)
        for (int dv = 0; dv < D / 16; dv++) {
            __m512 a = _mm512_load_ps(acc + (r0 + r) * D + 16 * dv);
            o[r][dv] = grew[r] ? _mm512_mul_ps(a, corr[r]) : a;
        }
    const int j_end = 16 * jhi < n ? 16 * jhi : n;
    for (int j = 16 * jlo; j < j_end; j++) {
        for (int dv = 0; dv < D / 16; dv++) {
            __m512 vv = _mm512_load_ps(V + j * D + 16 * dv);
            for (int r = 0; r < RG; r++) o[r][dv] = _mm512_fmadd_ps(_mm512_set1_ps(p[r][j]), vv, o[r][dv]);
        }
    }
    for (int r = 0; r < RG; r++)
        for (int dv = 0; dv < D / 16; dv++) _mm512_store_ps(acc + (r0 + r) * D + 16 * dv, o[r][dv]);
}

/* Row groups of one head against one tile; skips a group no row of which sees a key of the tile. */
static inline __attribute__((always_inline)) void head_tile(
    const float *Q, const float *Kt, int64_t ldk, const float *V, float *acc, float *m, float *l, int g, int nt,
    int D, int n, int64_t ks, int64_t first_q, int64_t window) {
    const int RG = D == 32 ? 8 : 4;
    for (int tt = 0; tt < nt; tt += RG) {
        int64_t qa = first_q + tt, qb = qa + RG - 1;
        if (ks > qb || (window > 0 && qa - (ks + n - 1) >= window)) continue;
        int full = n == KT && ks + n - 1 <= qa && (window <= 0 || qb - ks < window);
        /* the keys some row of the group sees: from the window's edge for its first row to its last
         * row's query, within the tile */
        int64_t k_lo = window > 0 && qa - window + 1 > ks ? qa - window + 1 : ks;
        int64_t k_hi = qb < ks + n - 1 ? qb : ks + n - 1;
        int jlo = (int)((k_lo - ks) / 16), jhi = (int)((k_hi - ks) / 16 + 1);
        /* each call inlined with what is constant in it: a full tile's range is the whole tile */
        if (D == 32 && full)
            rows_tile(Q, Kt, ldk, V, acc, m, l, g * QT + tt, 8, 32, KT, ks, qa, window, 1, 0, KT / 16);
        else if (D == 32)
            rows_tile(Q, Kt, ldk, V, acc, m, l, g * QT + tt, 8, 32, n, ks, qa, window, 0, jlo, jhi);
        else if (full)
            rows_tile(Q, Kt, ldk, V, acc, m, l, g * QT + tt, 4, 64, KT, ks, qa, window, 1, 0, KT / 16);
        else
            rows_tile(Q, Kt, ldk, V, acc, m, l, g * QT + tt, 4, 64, n, ks, qa, window, 0, jlo, jhi);
    }
}

/* Keys ks .. ks+n-1 of KV head kh of batch b into a tile: Kt (D rows of KT, keys transposed) and V
 * (KT rows of D), both fp32, zero past n. */
static void fill_tile(const void *k, const void *v, int bf16, int64_t D, int64_t kat, int64_t kss, int64_t vat,
                      int64_t vss, int64_t ks, int64_t n, float *Kt, float *V) {
    for (int j = 0; j < KT; j++) {
        float kr[MAX_D];
        if (j < n) {
            load_row(k, bf16, kat + (ks + j) * kss, (int)D, 1.0f, kr);
            load_row(v, bf16, vat + (ks + j) * vss, (int)D, 1.0f, V + j * D);
        } else {
            memset(kr, 0, sizeof(kr));
            memset(V + j * D, 0, (size_t)D * sizeof(float));
        }
        for (int d = 0; d < D; d++) Kt[d * KT + j] = kr[d];
    }
}
#endif

void gl_prefill_attention(const void *q, const void *k, const void *v, int bf16, int64_t B, int64_t K,
                          int64_t G, int64_t T, int64_t S, int64_t D, int64_t qsb, int64_t qsh, int64_t qst,
                          int64_t ksb, int64_t ksh, int64_t kss, int64_t vsb, int64_t vsh, int64_t vss,
                          int64_t q_offset, int64_t window, const float *sinks, float scale, float *out) {
#ifdef GL_AVX512
    const int64_t nq = (T + QT - 1) / QT, tasks = B * K * nq, H = K * G;
    const int64_t rows = G * QT;
    /* Without a window, the keys some query sees, in tiles aligned to KT: each tile's keys transposed
     * and its values widened once per call, into one buffer every task reads (a causal tile is seen by
     * every later query block, T / 64 of them on average at T queries). With a window a tile serves a
     * few query blocks, and aligned tiles would cover more keys than a block's own (measured 0.93x at a
     * 128-token window): each task fills its tiles from its first key. The shared tiles hold the
     * call's keys in fp32 again, so past SHARED_MAX bytes (a long context's global layer) or when that
     * allocation fails, every task fills its own. */
    int shared = window <= 0;
    const int64_t k_hi = q_offset + T < S ? q_offset + T : S; /* keys 0 .. k_hi - 1 are seen */
    const size_t tile_floats = (size_t)(2 * KT * D);
    int64_t n_tiles = shared && k_hi > 0 ? (k_hi + KT - 1) / KT : 0;
    size_t tile_bytes = ((size_t)(B * K * n_tiles) * tile_floats * sizeof(float) + 63) / 64 * 64;
    float *tiles = NULL;
    if (n_tiles > 0 && tile_bytes <= SHARED_MAX) tiles = (float *)aligned_alloc(64, tile_bytes);
    if (!tiles) shared = 0, n_tiles = 0;
    const size_t floats = (size_t)(2 * rows * D + 2 * rows * 16) + tile_floats;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < B * K * n_tiles; i++) {
            int64_t tile = i % n_tiles, kh = (i / n_tiles) % K, b = i / (n_tiles * K);
            int64_t ks = tile * KT, n = k_hi - ks < KT ? k_hi - ks : KT;
            float *Kt = tiles + (size_t)i * tile_floats;
            fill_tile(k, v, bf16, D, b * ksb + kh * ksh, kss, b * vsb + kh * vsh, vss, ks, n, Kt, Kt + KT * D);
        }
        float *buf = (float *)aligned_alloc(64, ((floats * sizeof(float) + 63) / 64) * 64);
        float *Q = buf, *acc = Q + rows * D, *m = acc + rows * D, *l = m + rows * 16, *own = l + rows * 16;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            /* the last query blocks first: they see the most keys */
            int64_t qi = nq - 1 - task % nq, kh = (task / nq) % K, b = task / (nq * K);
            int64_t t0 = qi * QT, nt = T - t0 < QT ? T - t0 : QT;
            int64_t first_q = q_offset + t0, last_q = first_q + nt - 1;
            for (int64_t g = 0; g < G; g++) {
                int64_t h = kh * G + g;
                for (int64_t tt = 0; tt < QT; tt++) {
                    float *row = Q + (g * QT + tt) * D;
                    if (tt < nt)
                        load_row(q, bf16, b * qsb + h * qsh + (t0 + tt) * qst, (int)D, scale, row);
                    else
                        memset(row, 0, (size_t)D * sizeof(float));
                    _mm512_store_ps(m + (g * QT + tt) * 16, _mm512_set1_ps(sinks ? sinks[h] : -1e30f));
                    _mm512_store_ps(l + (g * QT + tt) * 16, _mm512_maskz_mov_ps(1, _mm512_set1_ps(sinks ? 1.0f : 0.0f)));
                }
            }
            memset(acc, 0, (size_t)(rows * D) * sizeof(float));
            int64_t lo = window > 0 && first_q - window + 1 > 0 ? first_q - window + 1 : 0;
            int64_t hi = last_q + 1 < S ? last_q + 1 : S;
            for (int64_t ks = lo; ks < hi; ks += KT) { /* lo is 0 where tiles are shared */
                int n = (int)(hi - ks < KT ? hi - ks : KT);
                const float *Kt = own;
                if (shared)
                    Kt = tiles + (size_t)((b * K + kh) * n_tiles + ks / KT) * tile_floats;
                else
                    fill_tile(k, v, bf16, D, b * ksb + kh * ksh, kss, b * vsb + kh * vsh, vss, ks, n, own, own + KT * D);
                for (int64_t g = 0; g < G; g++)
                    head_tile(Q, Kt, KT, Kt + KT * D, acc, m, l, (int)g, (int)nt, (int)D, n, ks, first_q, window);
            }
            for (int64_t g = 0; g < G; g++) {
                int64_t h = kh * G + g;
                for (int64_t tt = 0; tt < nt; tt++) {
                    int64_t r = g * QT + tt;
                    float sum = _mm512_reduce_add_ps(_mm512_load_ps(l + r * 16));
                    float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
                    float *dst = out + ((b * T + t0 + tt) * H + h) * D;
                    for (int64_t d = 0; d < D; d++) dst[d] = acc[r * D + d] * inv;
                }
            }
        }
        free(buf);
    }
    free(tiles);
#else
    (void)q, (void)k, (void)v, (void)bf16, (void)B, (void)K, (void)G, (void)T, (void)S, (void)D;
    (void)qsb, (void)qsh, (void)qst, (void)ksb, (void)ksh, (void)kss, (void)vsb, (void)vsh, (void)vss;
    (void)q_offset, (void)window, (void)sinks, (void)scale, (void)out;
#endif
}
