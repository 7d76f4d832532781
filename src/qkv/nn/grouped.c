/* int8g's x W^T for a few fp32 rows (qkv.nn.grouped.native_product): W_ij = s_ig q_ij + m_ig by groups g of
   16 or 32 inputs, as a GGUF file's 5-, 6- and 8-bit blocks hold them (qkv.formats.gguf.blocks).

       y_mi = sum_g s_ig (sum_{j in g} q_ij x_mj) + sum_g m_ig (sum_{j in g} x_mj)

   q (G, N, g) int8 with strides (stride_g, stride_n, 1), s^T (G, N) fp32 with strides (scale_g, scale_n), m (N, G)
   fp32 with strides (low_n, low_g) or NULL, xsum (M, G) each row's sum over each group, x (M, K) and y (M, N)
   fp32 contiguous.
   Everything is summed in fp32: each group's sum of products, then the groups' sums weighed by their scales.

   With AVX2 and FMA (groups of a multiple of 8), each output row's groups are summed in eight lanes: a group's
   codes widened to fp32 eight at a time and multiplied into the row, the group's eight partial sums weighed by
   its scale into the output row's eight, added across lanes once at the end. The output rows are read one
   after another, all their groups (one run of memory where the codes are held row after row, qkv.nn.grouped.
   grouped_layout, the scales likewise); one input row sums the groups by turns into two accumulators and asks
   for the codes ahead of reading them (bound by memory: Gemma 3's 262,144 x 640 head 21 -> 12 ms, 2026-12-07,
   the AVX2-only EPYC, the memory read at 18-24 GB/s); several input rows take MB at a time, each group's codes
   widened once for all of them, the count a constant in each copy of the loop so that the rows' sums stay in
   registers (Gemma 3's gate/up 4,096 x 640 at 6 rows 931 -> 315 us; a count known only at run time kept them
   in memory). Elsewhere, plain loops. The output rows are shared among `threads` OpenMP threads.

   `narrow` (AVX2, groups of a multiple of 16): each input row's groups rounded to int16 first, a group's codes
   multiplied into them as integers (pairs of products summed by _mm256_madd_epi16, exact in int32), each
   group's integer sum weighed by s_ig t_mg in fp32:

       x_mj ~ t_mg r_mj,   r_mj = round(x_mj / t_mg) in [-32767, 32767],   t_mg = max_{j in g} |x_mj| / 32767

   so |x_mj - t_mg r_mj| <= t_mg / 2 and |y_mi - y^_mi| <= sum_g |s_ig| t_mg / 2 sum_{j in g} |q_ij| (plus
   fp32's rounding of the weighed sums): 1.5-3e-5 of the largest output in the tests, where the widened loops' fp32
   rounding is about 1e-7. Half the instructions a group (one widening to int16 and one multiply-add per 16
   codes, against two widenings to fp32 and two FMAs per 16): at one row on 2 threads (2026-12-07, the AVX2-only
   EPYC, the fastest of 40 passes each) Gemma 3's 2,048 x 640 in groups of 32 51 -> 35 us, 640 x 2,048 in groups
   of 16 59 -> 42 us; its 262,144 x 640 head, read from memory, 7.7 -> 7.2 ms (qkv.nn.quant takes it for a
   prompt's rows where measured the faster, qkv.nn.grouped.narrow_rows). A group holding a value
   not finite gives NaN; one whose largest |x| is below 1e-30 counts as zeros. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define MB 3  /* input rows a pass of int8g's loops (their sums in AVX2's 16 registers) */
#define MB4 4  /* and of int4's */
#define PREFETCH 1024  /* bytes ahead of the codes being read that one input row asks for */

#ifdef __AVX2__
static inline __m256 widen8(const int8_t *q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}

static inline float lanes_sum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* one group's codes (g of them at qg) widened once into `rows` input rows' sums acc, each in group_sum's order:
   even eights in one chain, odd eights in another, added, weighed by the scale */
static inline __attribute__((always_inline)) void group_rows(const float *x, int rows, int K, const int8_t *qg,
                                                              int g, float scale, __m256 *acc) {
    __m256 t0[MB], t1[MB];
    for (int m = 0; m < MB; m++) t0[m] = t1[m] = _mm256_setzero_ps();
    int j = 0;
    for (; j + 16 <= g; j += 16) {
        __m256 c0 = widen8(qg + j), c1 = widen8(qg + j + 8);
        for (int m = 0; m < rows; m++) {
            t0[m] = _mm256_fmadd_ps(c0, _mm256_loadu_ps(x + (size_t)m * K + j), t0[m]);
            t1[m] = _mm256_fmadd_ps(c1, _mm256_loadu_ps(x + (size_t)m * K + j + 8), t1[m]);
        }
    }
    if (j < g) {
        __m256 c0 = widen8(qg + j);
        for (int m = 0; m < rows; m++) t0[m] = _mm256_fmadd_ps(c0, _mm256_loadu_ps(x + (size_t)m * K + j), t0[m]);
    }
    __m256 s = _mm256_set1_ps(scale);
    for (int m = 0; m < rows; m++) acc[m] = _mm256_fmadd_ps(g == 8 ? t0[m] : _mm256_add_ps(t0[m], t1[m]), s, acc[m]);
}

/* output row n for `rows` (<= MB) input rows x (rows, K): y[m * N], each summed in the order output_row_one
   sums a row (the groups by turns into two accumulators), so that a row's result does not depend on the rows
   beside it */
static inline __attribute__((always_inline)) void output_row(const float *x, int rows, int K, const int8_t *q,
                                                              long stride_g, int G, int g, const float *scale,
                                                              long scale_g, float *y, long N) {
    __m256 a0[MB], a1[MB];
    for (int m = 0; m < MB; m++) a0[m] = a1[m] = _mm256_setzero_ps();
    int group = 0;
    for (; group + 2 <= G; group += 2) {
        group_rows(x + (size_t)group * g, rows, K, q + group * stride_g, g, scale[group * scale_g], a0);
        group_rows(x + (size_t)(group + 1) * g, rows, K, q + (group + 1) * stride_g, g, scale[(group + 1) * scale_g],
                   a1);
    }
    if (group < G) group_rows(x + (size_t)group * g, rows, K, q + group * stride_g, g, scale[group * scale_g], a0);
    for (int m = 0; m < rows; m++) y[(size_t)m * N] = lanes_sum(_mm256_add_ps(a0[m], a1[m]));
}

/* one group's sum of products in eight lanes, in two chains (g a multiple of 8) */
static inline __m256 group_sum(const int8_t *q, const float *x, int g) {
    __m256 t0 = _mm256_mul_ps(widen8(q), _mm256_loadu_ps(x));
    if (g == 8) return t0;
    __m256 t1 = _mm256_mul_ps(widen8(q + 8), _mm256_loadu_ps(x + 8));
    int j = 16;
    for (; j + 16 <= g; j += 16) {
        t0 = _mm256_fmadd_ps(widen8(q + j), _mm256_loadu_ps(x + j), t0);
        t1 = _mm256_fmadd_ps(widen8(q + j + 8), _mm256_loadu_ps(x + j + 8), t1);
    }
    if (j < g) t0 = _mm256_fmadd_ps(widen8(q + j), _mm256_loadu_ps(x + j), t0);
    return _mm256_add_ps(t0, t1);
}

/* one input row: the groups weighed into two accumulators by turns, so that no chain of dependent sums sets
   the pace; the codes a row ahead asked for before they are read (the loop is bound by memory, not by sums) */
static void output_row_one(const float *x, const int8_t *q, long stride_g, int G, int g, const float *scale,
                           long scale_g, float *y) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int group = 0;
    for (; group + 2 <= G; group += 2) {
        _mm_prefetch((const char *)(q + group * stride_g) + PREFETCH, _MM_HINT_T0);
        a0 = _mm256_fmadd_ps(group_sum(q + group * stride_g, x + (size_t)group * g, g),
                             _mm256_set1_ps(scale[group * scale_g]), a0);
        a1 = _mm256_fmadd_ps(group_sum(q + (group + 1) * stride_g, x + (size_t)(group + 1) * g, g),
                             _mm256_set1_ps(scale[(group + 1) * scale_g]), a1);
    }
    if (group < G)
        a0 = _mm256_fmadd_ps(group_sum(q + group * stride_g, x + (size_t)group * g, g),
                             _mm256_set1_ps(scale[group * scale_g]), a0);
    *y = lanes_sum(_mm256_add_ps(a0, a1));
}
#endif

#define LEVELS 32767.f  /* narrow rows: a group's largest |x| becomes 32,767 */

#ifdef __AVX2__
/* narrow rows: x (M, K) by groups of g as int16 r (M, K) and their steps t (M, G), as the header says */
static void narrow_rows(const float *x, long count, int g, int16_t *r, float *t) {
    for (long i = 0; i < count; i++) {
        const float *xg = x + i * g;
        float top = 0.f, probe = 0.f;
        for (int j = 0; j < g; j++) {
            float a = xg[j] < 0.f ? -xg[j] : xg[j];
            top = a > top ? a : top;
            probe += xg[j] * 0.f;  /* NaN where a value is NaN or infinite */
        }
        int kept = probe == 0.f && top >= 1e-30f;  /* (smaller groups count as zeros) */
        t[i] = probe == 0.f ? (kept ? top / LEVELS : 0.f) : probe;
        float inverse = kept ? LEVELS / top : 0.f;
        for (int j = 0; j < g; j++) r[i * g + j] = (int16_t)_mm_cvt_ss2si(_mm_set_ss(xg[j] * inverse));
    }
}

/* one group's codes widened to int16 once, times `rows` narrow rows r (stride K) by pairs: the sums in int32 */
static inline __attribute__((always_inline)) void group_rows16(const int16_t *r, int rows, int K, const int8_t *qg,
                                                                int g, __m256i *sum) {
    for (int m = 0; m < MB; m++) sum[m] = _mm256_setzero_si256();
    for (int j = 0; j < g; j += 16) {
        __m256i c = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(qg + j)));
        for (int m = 0; m < rows; m++)
            sum[m] = _mm256_add_epi32(sum[m],
                                      _mm256_madd_epi16(c, _mm256_loadu_si256((const __m256i *)(r + (size_t)m * K + j))));
    }
}

/* output row n for `rows` (<= MB) narrow rows: each group's integer sums weighed by s_ig t_mg into two
   accumulators by turns; a row's result the same whatever rows beside it */
static inline __attribute__((always_inline)) void output_row16(const int16_t *r, const float *t, int rows, int K,
                                                                int G, const int8_t *q, long stride_g, int g,
                                                                const float *scale, long scale_g, float *y, long N) {
    __m256 a0[MB], a1[MB];
    __m256i i0[MB], i1[MB];
    for (int m = 0; m < MB; m++) a0[m] = a1[m] = _mm256_setzero_ps();
    int group = 0;
    for (; group + 2 <= G; group += 2) {
        if (rows == 1) _mm_prefetch((const char *)(q + group * stride_g) + PREFETCH, _MM_HINT_T0);
        group_rows16(r + (size_t)group * g, rows, K, q + group * stride_g, g, i0);
        group_rows16(r + (size_t)(group + 1) * g, rows, K, q + (group + 1) * stride_g, g, i1);
        float s0 = scale[group * scale_g], s1 = scale[(group + 1) * scale_g];
        for (int m = 0; m < rows; m++) {
            const float *tm = t + (size_t)m * G + group;
            a0[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0[m]), _mm256_set1_ps(s0 * tm[0]), a0[m]);
            a1[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1[m]), _mm256_set1_ps(s1 * tm[1]), a1[m]);
        }
    }
    if (group < G) {
        group_rows16(r + (size_t)group * g, rows, K, q + group * stride_g, g, i0);
        float s0 = scale[group * scale_g];
        for (int m = 0; m < rows; m++)
            a0[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0[m]), _mm256_set1_ps(s0 * t[(size_t)m * G + group]), a0[m]);
    }
    for (int m = 0; m < rows; m++) y[(size_t)m * N] = lanes_sum(_mm256_add_ps(a0[m], a1[m]));
}

/* output_row16, a copy for each row count and for groups of 32 and 16 (constants: the sums in registers, the
   groups' loops unrolled: 2,048 x 640 at one row 54 -> 37 us with 32 a constant) */
static void narrow_output(const int16_t *r, const float *t, int rows, int K, int G, const int8_t *q, long stride_g,
                          int g, const float *scale, long scale_g, float *y, long N) {
#define COPY(R, W) output_row16(r, t, R, K, G, q, stride_g, W, scale, scale_g, y, N)
    if (g == 32) {
        if (rows == 1) COPY(1, 32); else if (rows == 2) COPY(2, 32); else COPY(MB, 32);
    } else if (g == 16) {
        if (rows == 1) COPY(1, 16); else if (rows == 2) COPY(2, 16); else COPY(MB, 16);
    } else {
        if (rows == 1) COPY(1, g); else if (rows == 2) COPY(2, g); else COPY(MB, g);
    }
#undef COPY
}
#endif

static void output_row_plain(const float *x, int rows, int K, const int8_t *q, long stride_g, int G, int g,
                             const float *scale, long scale_g, float *y, long N) {
    for (int m = 0; m < rows; m++) {
        float total = 0.f;
        for (int group = 0; group < G; group++) {
            const int8_t *qg = q + group * stride_g;
            const float *xg = x + (size_t)m * K + (size_t)group * g;
            float t = 0.f;
            for (int j = 0; j < g; j++) t += (float)qg[j] * xg[j];
            total += scale[group * scale_g] * t;
        }
        y[(size_t)m * N] = total;
    }
}

void qkv_grouped_rows(const float *x, const float *xsum, int M, int K, const int8_t *q, long stride_g,
                      long stride_n, int G, int N, int g, const float *scale, long scale_g, long scale_n,
                      const float *low, long low_n, long low_g, float *y, int narrow, int threads) {
    int16_t *r = NULL;  /* narrow rows (AVX2, g a multiple of 16): x as int16 by groups, t their steps */
    float *t = NULL;
#ifdef __AVX2__
    if (narrow && g % 16 == 0) {
        r = malloc(sizeof(int16_t) * (size_t)M * K);
        t = malloc(sizeof(float) * (size_t)M * G);
        if (r && t) narrow_rows(x, (long)M * G, g, r, t);
        else { free(r); free(t); r = NULL; t = NULL; }  /* (no memory for them: the widened loops) */
    }
#endif
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int n = 0; n < N; n++) {
        const int8_t *qn = q + n * stride_n;
        const float *sn = scale + n * scale_n;
        for (int m0 = 0; m0 < M; m0 += MB) {
            int rows = M - m0 < MB ? M - m0 : MB;
            const float *xm = x + (size_t)m0 * K;
            float *ym = y + (size_t)m0 * N + n;
#ifdef __AVX2__
            if (r)
                narrow_output(r + (size_t)m0 * K, t + (size_t)m0 * G, rows, K, G, qn, stride_g, g, sn, scale_g, ym, N);
            else if (g % 8 == 0 && rows == 1)
                output_row_one(xm, qn, stride_g, G, g, sn, scale_g, ym);
            else if (g % 8 == 0 && rows == 2)  /* (a constant count: the rows' sums held in registers) */
                output_row(xm, 2, K, qn, stride_g, G, g, sn, scale_g, ym, N);
            else if (g % 8 == 0)
                output_row(xm, MB, K, qn, stride_g, G, g, sn, scale_g, ym, N);
            else
#endif
            output_row_plain(xm, rows, K, qn, stride_g, G, g, sn, scale_g, ym, N);
            if (low)
                for (int m = 0; m < rows; m++) {
                    const float *xs = xsum + (size_t)(m0 + m) * G;
                    float total = 0.f;
                    for (int group = 0; group < G; group++) total += low[n * low_n + group * low_g] * xs[group];
                    ym[(size_t)m * N] += total;
                }
        }
    }
    free(r);
    free(t);
}

/* int4's x W^T (qkv.nn.grouped.native_int4_product): codes c in 0..15 packed two a byte (N, K / 2), column 2j
   in the low four bits and 2j + 1 in the high (qkv.nn.quant.pack_nibbles), by groups of 32 (16 bytes) with a
   scale s and a minimum m each (N, G) fp32 row after row: W_ij = s_ig c_ij + m_ig, as GGUF's 4-bit blocks and
   --quant int4 hold them.

       y_mi = sum_g s_ig (sum_{j in g} c_ij x_mj) + sum_g m_ig (sum_{j in g} x_mj)

   x (M, K) and y (M, N) fp32 contiguous; the rows' sums over each group are made here. Eight codes are four
   bytes: the word broadcast to eight lanes, shifted right by 0, 4, .., 28 bits and masked, puts columns
   8i .. 8i + 7 in order in the lanes (no shuffle; 1,536 x 576 at one row 80 us a thread against 104 for
   splitting the bytes into low and high halves, 2026-12-07, the AVX2-only EPYC). A group's codes are widened once for all the input rows (MB4 at a time); each row is
   summed in one order whatever rows are beside it (two chains a group, the groups by turns into two
   accumulators, the minima's terms after), so a row's result is the same alone or batched. */
#ifdef __AVX2__
static inline __m256 nibbles8(const uint8_t *b, __m256i shifts, __m256i mask) {
    int32_t word;
    memcpy(&word, b, 4);
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), mask));
}
#endif

static inline float minima_term(const float *low, const float *xs, int G) {
    float total = 0.f;
    int group = 0;
#ifdef __AVX2__
    __m256 l = _mm256_setzero_ps();
    for (; group + 8 <= G; group += 8)
        l = _mm256_fmadd_ps(_mm256_loadu_ps(low + group), _mm256_loadu_ps(xs + group), l);
    total = lanes_sum(l);
#endif
    for (; group < G; group++) total += low[group] * xs[group];
    return total;
}

#ifdef __AVX2__
/* one group's 32 codes (16 bytes b) widened once, into `rows` input rows' accumulators acc */
static inline __attribute__((always_inline)) void int4_group(const float *x, int rows, int K, const uint8_t *b,
                                                              float scale, __m256 *acc) {
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), mask = _mm256_set1_epi32(15);
    __m256 c0 = nibbles8(b, shifts, mask), c1 = nibbles8(b + 4, shifts, mask);
    __m256 c2 = nibbles8(b + 8, shifts, mask), c3 = nibbles8(b + 12, shifts, mask);
    __m256 s = _mm256_set1_ps(scale);
    for (int m = 0; m < rows; m++) {
        const float *xg = x + (size_t)m * K;
        __m256 t0 = _mm256_mul_ps(c0, _mm256_loadu_ps(xg)), t1 = _mm256_mul_ps(c1, _mm256_loadu_ps(xg + 8));
        t0 = _mm256_fmadd_ps(c2, _mm256_loadu_ps(xg + 16), t0);
        t1 = _mm256_fmadd_ps(c3, _mm256_loadu_ps(xg + 24), t1);
        acc[m] = _mm256_fmadd_ps(_mm256_add_ps(t0, t1), s, acc[m]);
    }
}
#endif

static inline __attribute__((always_inline)) void int4_rows(const float *x, const float *xsum, int rows, int K,
                                                             const uint8_t *q, const float *scale, const float *low,
                                                             float *y, long N) {
    int G = K / 32;
#ifdef __AVX2__
    __m256 a0[MB4], a1[MB4];  /* the even groups' sums and the odd ones' */
    for (int m = 0; m < MB4; m++) a0[m] = a1[m] = _mm256_setzero_ps();
    int group = 0;
    for (; group + 2 <= G; group += 2) {
        int4_group(x + group * 32, rows, K, q + group * 16, scale[group], a0);
        int4_group(x + group * 32 + 32, rows, K, q + group * 16 + 16, scale[group + 1], a1);
    }
    if (group < G) int4_group(x + group * 32, rows, K, q + group * 16, scale[group], a0);
    for (int m = 0; m < rows; m++)
        y[(size_t)m * N] = lanes_sum(_mm256_add_ps(a0[m], a1[m])) + minima_term(low, xsum + (size_t)m * G, G);
#else
    for (int m = 0; m < rows; m++) {
        float total = 0.f;
        for (int group = 0; group < G; group++) {
            const float *xg = x + (size_t)m * K + (size_t)group * 32;
            float t = 0.f;
            for (int j = 0; j < 16; j++)
                t += (q[group * 16 + j] & 15) * xg[2 * j] + (q[group * 16 + j] >> 4) * xg[2 * j + 1];
            total += scale[group] * t;
        }
        y[(size_t)m * N] = total + minima_term(low, xsum + (size_t)m * G, G);
    }
#endif
}

void qkv_int4_rows(const float *x, int M, int K, const uint8_t *q, int N, const float *scale, const float *low,
                   float *y, int threads) {
    int G = K / 32;
    float *xsum = malloc(sizeof(float) * (size_t)M * G);  /* each row's sum over each group, in one order */
    if (!xsum) return;
    for (int i = 0; i < M * G; i++) {
        float total = 0.f;
        for (int j = 0; j < 32; j++) total += x[(size_t)i * 32 + j];
        xsum[i] = total;
    }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int n = 0; n < N; n++) {
        const uint8_t *qn = q + (size_t)n * (K / 2);
        for (int m0 = 0; m0 < M; m0 += MB4) {
            int rows = M - m0 < MB4 ? M - m0 : MB4;
            const float *xm = x + (size_t)m0 * K, *xs = xsum + (size_t)m0 * G;
            float *ym = y + (size_t)m0 * N + n;
            const float *sn = scale + (size_t)n * G, *ln = low + (size_t)n * G;
            if (rows == 1)  /* (its own copy of the loop) */
                int4_rows(xm, xs, 1, K, qn, sn, ln, ym, N);
            else
                int4_rows(xm, xs, rows, K, qn, sn, ln, ym, N);
        }
    }
    free(xsum);
}
