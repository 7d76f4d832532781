/* int8g's x W^T for a few fp32 rows (qkv.nn.grouped.native_product): W_ij = s_ig q_ij + m_ig by groups g of
   16 or 32 inputs, as a GGUF file's 5-, 6- and 8-bit blocks hold them (qkv.formats.gguf.blocks).

       y_mi = sum_g s_ig (sum_{j in g} q_ij x_mj) + sum_g m_ig (sum_{j in g} x_mj)

   q (G, N, g) int8 with strides (stride_g, stride_n, 1), s^T (G, N) fp32 contiguous, m (N, G) fp32 with strides
   (low_n, low_g) or NULL, xsum (M, G) each row's sum over each group, x (M, K) and y (M, N) fp32 contiguous.
   Everything is summed in fp32: each group's sum of products, then the groups' sums weighed by their scales.

   With AVX2 and FMA (groups of a multiple of 8), each output row's groups are summed in eight lanes: a group's
   codes widened to fp32 eight at a time and multiplied into the row, the group's eight partial sums weighed by
   its scale into the output row's eight, added across lanes once at the end. The output rows are read one
   after another, all their groups (one run of memory where the codes are held row after row, qkv.nn.grouped.
   grouped_layout); several input rows take MB at a time, each group's codes widened once for all of them.
   Elsewhere, plain loops. The output rows are shared among `threads` OpenMP threads. */
#include <stddef.h>
#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define MB 4  /* input rows a pass */

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

/* output row n for `rows` (<= MB) input rows x (rows, K): y[m * N] */
static void output_row(const float *x, int rows, int K, const int8_t *q, long stride_g, int G, int N, int g,
                       const float *scale_t, int n, float *y) {
    __m256 acc[MB];
    for (int m = 0; m < MB; m++) acc[m] = _mm256_setzero_ps();
    for (int group = 0; group < G; group++) {
        const int8_t *qg = q + group * stride_g;
        const float *xg = x + (size_t)group * g;
        __m256 t[MB];
        for (int m = 0; m < MB; m++) t[m] = _mm256_setzero_ps();
        for (int j = 0; j < g; j += 8) {
            __m256 codes = widen8(qg + j);
            for (int m = 0; m < rows; m++) t[m] = _mm256_fmadd_ps(codes, _mm256_loadu_ps(xg + (size_t)m * K + j), t[m]);
        }
        __m256 s = _mm256_set1_ps(scale_t[(size_t)group * N + n]);
        for (int m = 0; m < rows; m++) acc[m] = _mm256_fmadd_ps(t[m], s, acc[m]);
    }
    for (int m = 0; m < rows; m++) y[(size_t)m * N] = lanes_sum(acc[m]);
}

/* one input row: its output row's eight sums held in a register across the groups */
static void output_row_one(const float *x, const int8_t *q, long stride_g, int G, int N, int g,
                           const float *scale_t, int n, float *y) {
    __m256 acc = _mm256_setzero_ps();
    for (int group = 0; group < G; group++) {
        const int8_t *qg = q + group * stride_g;
        const float *xg = x + (size_t)group * g;
        __m256 t = _mm256_mul_ps(widen8(qg), _mm256_loadu_ps(xg));
        for (int j = 8; j < g; j += 8) t = _mm256_fmadd_ps(widen8(qg + j), _mm256_loadu_ps(xg + j), t);
        acc = _mm256_fmadd_ps(t, _mm256_set1_ps(scale_t[(size_t)group * N + n]), acc);
    }
    *y = lanes_sum(acc);
}
#endif

static void output_row_plain(const float *x, int rows, int K, const int8_t *q, long stride_g, int G, int N, int g,
                             const float *scale_t, int n, float *y) {
    for (int m = 0; m < rows; m++) {
        float total = 0.f;
        for (int group = 0; group < G; group++) {
            const int8_t *qg = q + group * stride_g;
            const float *xg = x + (size_t)m * K + (size_t)group * g;
            float t = 0.f;
            for (int j = 0; j < g; j++) t += (float)qg[j] * xg[j];
            total += scale_t[(size_t)group * N + n] * t;
        }
        y[(size_t)m * N] = total;
    }
}

void qkv_grouped_rows(const float *x, const float *xsum, int M, int K, const int8_t *q, long stride_g,
                      long stride_n, int G, int N, int g, const float *scale_t, const float *low, long low_n,
                      long low_g, float *y, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int n = 0; n < N; n++) {
        const int8_t *qn = q + n * stride_n;
        for (int m0 = 0; m0 < M; m0 += MB) {
            int rows = M - m0 < MB ? M - m0 : MB;
            const float *xm = x + (size_t)m0 * K;
            float *ym = y + (size_t)m0 * N + n;
#ifdef __AVX2__
            if (g % 8 == 0 && rows == 1)
                output_row_one(xm, qn, stride_g, G, N, g, scale_t, n, ym);
            else if (g % 8 == 0)
                output_row(xm, rows, K, qn, stride_g, G, N, g, scale_t, n, ym);
            else
#endif
            output_row_plain(xm, rows, K, qn, stride_g, G, N, g, scale_t, n, ym);
            if (low)
                for (int m = 0; m < rows; m++) {
                    const float *xs = xsum + (size_t)(m0 + m) * G;
                    float t = 0.f;
                    for (int group = 0; group < G; group++) t += low[n * low_n + group * low_g] * xs[group];
                    ym[(size_t)m * N] += t;
                }
        }
    }
}
