/* The routed experts of a batched decode step, grouped by expert (docs/model.md#moe-and-the-training-forward).
 *
 * For B rows x (B, C), each row's A experts idx (B, A) and their routing weights wts (B, A):
 *
 *   out[b] = sum_a wts[b, a] * expert(idx[b, a], x[b])
 *   expert(e, v) = round(down_e . round(act(round(gate_up_e . v + bias))) + bias)
 *
 * gate_up (E, 2I, C) holds each expert's gate rows then its up rows (`Experts.pack_for_decode`'s
 * out-major buffer), down (E, C, I); biases (E, 2I) and (E, C) or none; x, weights and biases all fp32
 * or all bf16. act is SwiGLU or gpt-oss's clamped variant, in fp32. `round` rounds to bf16 for a bf16
 * model (nothing for fp32): the rounding points of `MoE.decode_step`, whose gathered reduction this
 * replaces in the compiled step. Products are fp32 sums (bf16 products are exact in fp32), in another
 * order than PyTorch's; the weighted sum over a is in order, in fp32.
 *
 * Why: the reduction reads each selected expert's weights once per row, so 16 rows with 2 experts
 * each read the 8 experts 4 times over. Here the rows are sorted by expert and each expert's weights
 * are read once, by register tiles of 4 weight rows by 4 input rows (vec.h). One task is a block of
 * an expert's output rows; threads take tasks in turn (experts hold unequal numbers of rows).
 *
 * Built where vec.h has AVX-512 tiles (gl_moe_isa: 2 fp32 and bf16 with AVX-512 BF16, 1 fp32 only,
 * 0 none); elsewhere the caller keeps the reduction.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include "vec.h"

#define TASK_ROWS 32     /* output rows of one task: a multiple of 4 */
#define PREFETCH_TILES 2 /* how far ahead of its tiles a task's first pass fetches the weight */

int gl_moe_isa(void) {
#if defined(GL_AVX512) && defined(GL_BF16_TILES)
    return 2;
#elif defined(GL_AVX512)
    return 1;
#else
    return 0;
#endif
}

#if defined(GL_AVX512)
/* rows [p0, p1) x columns [c0, c1) of a (P, R) fp32 matrix rounded to bf16 in place */
static void round_block(float *m, int64_t R, int64_t p0, int64_t p1, int64_t c0, int64_t c1) {
    for (int64_t p = p0; p < p1; p++) {
        float *row = m + p * R;
        int64_t c = c0;
        for (; c + 16 <= c1; c += 16) _mm512_storeu_ps(row + c, round16(_mm512_loadu_ps(row + c)));
        for (; c < c1; c++) row[c] = widen(to_bf16(row[c]));
    }
}

/* out (P, R) rows [p0, p0 + n) = in rows [p0, p0 + n) (ld = K) . W (R, K) rows [r0, r1)^T + bias */
static void product(const void *in, const void *w, const float *bias, int bf16, int64_t K, int64_t R, int64_t p0,
                    int64_t n, int64_t r0, int64_t r1, float *out) {
    (void)bf16; /* read only where the build has bf16 tiles */
    const int64_t es = bf16 ? 2 : 4, tile_bytes = 4 * K * es;
    const char *end = (const char *)w + R * K * es;
    for (int64_t m0 = 0; m0 < n; m0 += 4) {
        const int nm = (int)(n - m0 < 4 ? n - m0 : 4);
        for (int64_t r = r0; r < r1; r += 4) {
            const int nr = (int)(r1 - r < 4 ? r1 - r : 4);
            if (m0 == 0) { /* the first pass reads the weight from memory: fetch PREFETCH_TILES tiles ahead */
                const char *ahead = (const char *)w + (r + 4 * PREFETCH_TILES) * K * es;
                for (int64_t off = 0; off < tile_bytes && ahead + off < end; off += 64) __builtin_prefetch(ahead + off);
            }
            float *o = out + (p0 + m0) * R + r;
            const float *b = bias ? bias + r : NULL;
#if defined(GL_BF16_TILES)
            if (bf16) {
                BF16_TILES[nr - 1][nm - 1]((const uint16_t *)in + (p0 + m0) * K, (const uint16_t *)w + r * K, b, K, K,
                                           R, o);
                continue;
            }
#endif
            TILES[nr - 1][nm - 1]((const float *)in + (p0 + m0) * K, (const float *)w + r * K, b, K, K, R, o, 0);
        }
    }
}

/* act over the (gate, up) halves of one row of gate_up sums, into dst (bf16 bits or fp32) */
static void activate_row(const float *gu, int64_t I, int swiglu, float limit, int bf16, void *dst) {
    for (int64_t i = 0; i < I; i += 16) {
        const __mmask16 lanes = I - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (I - i)) - 1u);
        __m512 a = gated16(_mm512_maskz_loadu_ps(lanes, gu + i), _mm512_maskz_loadu_ps(lanes, gu + I + i), swiglu, limit);
        if (bf16) {
            __m512i bits = _mm512_castps_si512(round16(a));
            _mm256_mask_storeu_epi16((uint16_t *)dst + i, lanes, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
        } else {
            _mm512_mask_storeu_ps((float *)dst + i, lanes, a);
        }
    }
}

static float *widened(const void *bias, int bf16, int64_t n) {
    if (!bias) return NULL;
    float *f = (float *)malloc((size_t)n * sizeof(float));
    if (f)
        for (int64_t i = 0; i < n; i++) f[i] = bf16 ? widen(((const uint16_t *)bias)[i]) : ((const float *)bias)[i];
    return f;
}
#endif

/* See the top of the file. Returns 0, -1 for an expert id outside [0, E) or a build without the path
 * (nothing is written then), -2 when out of memory. */
int gl_moe_experts(const void *x, int bf16, const int64_t *idx, const float *wts, int64_t B, int64_t A,
                   const void *gate_up, const void *gate_up_bias, const void *down, const void *down_bias, int64_t E,
                   int64_t C, int64_t I, int swiglu, float limit, float *out) {
#if defined(GL_AVX512)
#if !defined(GL_BF16_TILES)
    if (bf16) return -1;
#endif
    const int64_t P = B * A, es = bf16 ? 2 : 4;
    for (int64_t p = 0; p < P; p++)
        if (idx[p] < 0 || idx[p] >= E) return -1;
    if (P == 0) return 0;
    int64_t *start = (int64_t *)calloc((size_t)E + 1, sizeof(int64_t));
    int64_t *at = (int64_t *)malloc((size_t)P * sizeof(int64_t)); /* (b, a) -> its place in expert order */
    int64_t *task_e = (int64_t *)malloc((size_t)(E * ((2 * I + C) / TASK_ROWS + 2)) * sizeof(int64_t));
    int64_t *task_r = (int64_t *)malloc((size_t)(E * ((2 * I + C) / TASK_ROWS + 2)) * sizeof(int64_t));
    char *xs = (char *)malloc((size_t)(P * C * es));
    float *gu = (float *)malloc((size_t)(P * 2 * I) * sizeof(float));
    char *act = (char *)malloc((size_t)(P * I * es));
    float *od = (float *)malloc((size_t)(P * C) * sizeof(float));
    float *bgu = widened(gate_up_bias, bf16, E * 2 * I), *bd = widened(down_bias, bf16, E * C);
    int code = 0;
    if (!start || !at || !task_e || !task_r || !xs || !gu || !act || !od || (gate_up_bias && !bgu) ||
        (down_bias && !bd)) {
        code = -2;
        goto done;
    }
    /* the (row, slot) pairs in expert order, stable; each pair's input row copied to its place */
    for (int64_t p = 0; p < P; p++) start[idx[p] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    {
        int64_t *fill = (int64_t *)malloc((size_t)E * sizeof(int64_t));
        if (!fill) {
            code = -2;
            goto done;
        }
        memcpy(fill, start, (size_t)E * sizeof(int64_t));
        for (int64_t p = 0; p < P; p++) {
            at[p] = fill[idx[p]]++;
            memcpy(xs + at[p] * C * es, (const char *)x + (p / A) * C * es, (size_t)(C * es));
        }
        free(fill);
    }
    /* tasks: blocks of TASK_ROWS output rows of each expert that has rows (gate_up's, then down's) */
    int64_t n1 = 0, n2 = 0;
    for (int64_t e = 0; e < E; e++)
        for (int64_t r = 0; r < 2 * I && start[e + 1] > start[e]; r += TASK_ROWS) task_e[n1] = e, task_r[n1++] = r;
    for (int64_t e = 0; e < E; e++)
        for (int64_t r = 0; r < C && start[e + 1] > start[e]; r += TASK_ROWS)
            task_e[n1 + n2] = e, task_r[n1 + n2++] = r;
#pragma omp parallel
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < n1; t++) {
            const int64_t e = task_e[t], r0 = task_r[t], r1 = r0 + TASK_ROWS < 2 * I ? r0 + TASK_ROWS : 2 * I;
            const int64_t p0 = start[e], n = start[e + 1] - p0;
            product(xs, (const char *)gate_up + e * 2 * I * C * es, bgu ? bgu + e * 2 * I : NULL, bf16, C, 2 * I, p0,
                    n, r0, r1, gu);
            if (bf16) round_block(gu, 2 * I, p0, p0 + n, r0, r1);
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < P; p++) activate_row(gu + p * 2 * I, I, swiglu, limit, bf16, act + p * I * es);
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = n1; t < n1 + n2; t++) {
            const int64_t e = task_e[t], r0 = task_r[t], r1 = r0 + TASK_ROWS < C ? r0 + TASK_ROWS : C;
            const int64_t p0 = start[e], n = start[e + 1] - p0;
            product(act, (const char *)down + e * C * I * es, bd ? bd + e * C : NULL, bf16, I, C, p0, n, r0, r1, od);
            if (bf16) round_block(od, C, p0, p0 + n, r0, r1);
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            float *o = out + b * C;
            for (int64_t c = 0; c < C; c++) o[c] = 0.0f;
            for (int64_t a = 0; a < A; a++) {
                const float w = wts[b * A + a], *v = od + at[b * A + a] * C;
                for (int64_t c = 0; c < C; c++) o[c] += v[c] * w;
            }
        }
    }
done:
    free(start), free(at), free(task_e), free(task_r), free(xs), free(gu), free(act), free(od), free(bgu), free(bd);
    return code;
#else
    (void)x, (void)bf16, (void)idx, (void)wts, (void)B, (void)A, (void)gate_up, (void)gate_up_bias, (void)down;
    (void)down_bias, (void)E, (void)C, (void)I, (void)swiglu, (void)limit, (void)out;
    return -1;
#endif
}

/* Prefill's share (`MoE.forward` over many tokens, whose products are PyTorch's GEMMs): the two passes
 * between and after them, each one pass over its rows.
 *
 * gl_moe_activate: act (n, I) = act(gate, up) of gate_up (n, 2I), each row its gate half then its up
 * half (one GEMM's output over `Experts`' packed buffer), fp32 or bf16 in and out; act in fp32 and,
 * for bf16, rounded once. Returns 0, or -1 in a build without the path (nothing written). */
int gl_moe_activate(const void *gate_up, int bf16, int64_t n, int64_t I, int swiglu, float limit, void *out) {
#if defined(GL_AVX512)
    const int64_t es = bf16 ? 2 : 4;
    int failed = 0;
#pragma omp parallel
    {
        float *row = bf16 ? (float *)malloc((size_t)(2 * I) * sizeof(float)) : NULL;
        if (bf16 && !row) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < n; p++) {
            const float *gu = (const float *)gate_up + p * 2 * I;
            if (bf16) {
                if (!row) continue;
                const uint16_t *src = (const uint16_t *)gate_up + p * 2 * I;
                for (int64_t c = 0; c < 2 * I; c++) row[c] = widen(src[c]);
                gu = row;
            }
            activate_row(gu, I, swiglu, limit, bf16, (char *)out + p * I * es);
        }
        free(row);
    }
    return failed ? -2 : 0;
#else
    (void)gate_up, (void)bf16, (void)n, (void)I, (void)swiglu, (void)limit, (void)out;
    return -1;
#endif
}

/* gl_moe_combine: y[t] = sum_a wts[t, a] * row(at[t, a]) for N tokens of A experts each. The rows are
 * every expert's output in expert order, P of them, held in E pieces: piece e (a contiguous block of
 * rows of C values, fp32 or bf16, at address bases[e]) holds rows starts[e] .. starts[e+1]-1, starts[0] = 0,
 * starts[E] = P (so the down-projection's results are read where they were written, not copied into one
 * buffer first). at (N, A) each (token, slot)'s row; wts (N, A) fp32. Summed in fp32 in slot order, y
 * (N, C) in the rows' dtype (rounded once). Returns 0, or -1 for a row outside [0, P), pieces out of order,
 * or a build without the path (nothing written then). */
int gl_moe_combine(const int64_t *bases, const int64_t *starts, int64_t E, int bf16, const int64_t *at,
                   const float *wts, int64_t N, int64_t A, int64_t C, void *y) {
#if defined(GL_AVX512)
    if (E < 1 || starts[0] != 0) return -1;
    for (int64_t e = 0; e < E; e++)
        if (starts[e + 1] < starts[e]) return -1;
    const int64_t P = starts[E], esz = bf16 ? 2 : 4;
    for (int64_t i = 0; i < N * A; i++)
        if (at[i] < 0 || at[i] >= P) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < N; t++) {
        const char *src[A > 0 ? A : 1]; /* each slot's row */
        for (int64_t a = 0; a < A; a++) {
            const int64_t p = at[t * A + a];
            int64_t lo = 0, hi = E - 1; /* the piece holding row p: the last e with starts[e] <= p */
            while (lo < hi) {
                const int64_t mid = (lo + hi + 1) / 2;
                if (starts[mid] <= p) lo = mid;
                else hi = mid - 1;
            }
            src[a] = (const char *)(intptr_t)bases[lo] + (p - starts[lo]) * C * esz;
        }
        for (int64_t c0 = 0; c0 < C; c0 += 16) {
            const __mmask16 lanes = C - c0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (C - c0)) - 1u);
            __m512 s = _mm512_setzero_ps();
            for (int64_t a = 0; a < A; a++) {
                __m512 v;
                if (bf16)
                    v = _mm512_castsi512_ps(_mm512_slli_epi32(
                        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, (const uint16_t *)src[a] + c0)), 16));
                else
                    v = _mm512_maskz_loadu_ps(lanes, (const float *)src[a] + c0);
                s = _mm512_add_ps(s, _mm512_mul_ps(v, _mm512_set1_ps(wts[t * A + a]))); /* as PyTorch: product, then sum */
            }
            if (bf16) {
                __m512i bits = _mm512_castps_si512(round16(s));
                _mm256_mask_storeu_epi16((uint16_t *)y + t * C + c0, lanes, _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
            } else {
                _mm512_mask_storeu_ps((float *)y + t * C + c0, lanes, s);
            }
        }
    }
    return 0;
#else
    (void)bases, (void)starts, (void)E, (void)bf16, (void)at, (void)wts, (void)N, (void)A, (void)C, (void)y;
    return -1;
#endif
}

/* gl_moe_group: N tokens' rows x (N, C) (es bytes a value) and their A experts each, idx (N, A) in
 * [0, E), grouped by expert for one GEMM per expert: the N * A (token, slot) assignments sorted by
 * expert, stably (a counting sort: within an expert, in token then slot order, as a stable argsort of
 * idx.reshape(-1) orders them). Writes counts[e] (the assignments of expert e), at (N, A) each
 * assignment's place in that order, and sorted (N * A, C) the token's row at each place. Plain C, for
 * every CPU. Returns 0, or -1 for an expert outside [0, E) (nothing written then). */
int gl_moe_group(const void *x, int64_t es, const int64_t *idx, int64_t N, int64_t A, int64_t C, int64_t E,
                 int64_t *counts, int64_t *at, void *sorted) {
    for (int64_t i = 0; i < N * A; i++)
        if (idx[i] < 0 || idx[i] >= E) return -1;
    int64_t *next = (int64_t *)calloc((size_t)(E > 0 ? E : 1), sizeof(int64_t));
    int64_t *token = (int64_t *)malloc((size_t)(N * A > 0 ? N * A : 1) * sizeof(int64_t));
    if (!next || !token) {
        free(next);
        free(token);
        return -2;
    }
    memset(counts, 0, (size_t)E * sizeof(int64_t));
    for (int64_t i = 0; i < N * A; i++) counts[idx[i]]++;
    for (int64_t e = 1; e < E; e++) next[e] = next[e - 1] + counts[e - 1];
    for (int64_t i = 0; i < N * A; i++) {
        const int64_t p = next[idx[i]]++;
        at[i] = p;
        token[p] = i / A;
    }
    const int64_t row = C * es;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < N * A; p++)
        memcpy((char *)sorted + p * row, (const char *)x + token[p] * row, (size_t)row);
    free(next);
    free(token);
    return 0;
}

/* gl_moe_topk: the A largest of each row's E router logits (N, E), fp32 or bf16, in descending order,
 * as torch.topk(A) gives them: vals (N, A) in the logits' dtype, idx (N, A). A row where torch.topk's
 * answer depends on how it breaks ties (two of the row's A + 1 largest equal, or a NaN) is marked in
 * tied[n] for the caller to ask torch.topk (which treats each row alone). Returns the number of such
 * rows, or -1 for A outside [1, E] or E above MAX_EXPERTS. Plain C. */
#define MAX_EXPERTS 1024
int64_t gl_moe_topk(const void *logits, int bf16, int64_t N, int64_t E, int64_t A, void *vals, int64_t *idx,
                    uint8_t *tied) {
    if (A < 1 || A > E || E > MAX_EXPERTS) return -1;
    const int64_t K = A < E ? A + 1 : A; /* the A + 1 largest tell a tie at the boundary */
    int64_t n_tied = 0;
#pragma omp parallel for schedule(static) reduction(+ : n_tied)
    for (int64_t n = 0; n < N; n++) {
        float best[MAX_EXPERTS + 1];
        int64_t at[MAX_EXPERTS + 1];
        int64_t have = 0;
        int tie = 0;
        for (int64_t e = 0; e < E; e++) {
            const float v = bf16 ? widen(((const uint16_t *)logits)[n * E + e]) : ((const float *)logits)[n * E + e];
            if (v != v) tie = 1; /* NaN: torch.topk's place for it is its own */
            int64_t j = have < K ? have++ : K; /* insert v, keeping the K largest in descending order */
            while (j > 0 && best[j - 1] < v) {
                if (j < K) best[j] = best[j - 1], at[j] = at[j - 1];
                j--;
            }
            if (j < K) best[j] = v, at[j] = e;
        }
        for (int64_t j = 1; j < have; j++)
            if (best[j] == best[j - 1]) tie = 1;
        tied[n] = (uint8_t)tie;
        n_tied += tie;
        for (int64_t j = 0; j < A && j < have; j++) {
            idx[n * A + j] = at[j];
            if (bf16)
                ((uint16_t *)vals)[n * A + j] = ((const uint16_t *)logits)[n * E + at[j]];
            else
                ((float *)vals)[n * A + j] = best[j];
        }
    }
    return n_tied;
}
