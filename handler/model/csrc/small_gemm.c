/* Small-M linear for the CPU decode step: y[m, j] = sum_k x[m, k] * w[j, k] for the few rows of a decode
 * step (up to 64).
 *
 * Why: a decode step multiplies a few rows (the running requests) by every weight matrix. MKL's sgemm
 * packs the weight for each call at small M, so 2-8 rows cost 2-4x one row, although the work is bound by
 * reading the weight once. Here every weight row is read once, in order, and dotted with up to 3 rows of x
 * (AVX2 FMA, four partial sums per product); more rows go in chunks over tiles of the weights that stay in
 * cache. All of SmolLM2-135M's products (538 MB) at 2 threads on the 2-core dev box: 15.8 ms at 1 row (the
 * old kernel, four weight rows interleaved: 23.9), 17.5 at 2 (23.5), 35 at 8 (46.7), within 5% of it from 16
 * rows on.
 *
 * Each y[m, j] is the same chain whatever M, the rows sharing the call, the chunking or the thread split
 * (rows of w per thread): partial q sums the 8-float blocks b = q, q + 4, ... of k in order, the partials
 * are added as (p0 + p1) + (p2 + p3), then across lanes, then the K % 8 tail in order.
 * Built at first use by handler/model/small_gemm.py with -O3 -mavx2 -mfma -fopenmp; OpenMP resolves to the
 * libgomp torch already loaded (same soname), so torch's thread pool is shared, not duplicated.
 */
#include <immintrin.h>
#include <omp.h>

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    return _mm_cvtss_f32(_mm_add_ss(s, sh));
}

/* One weight row dotted with MM rows of x: y[m * D] = sum_k x[m * K + k] * w[k]. The row is read once, in
 * order (one stream: what the prefetchers follow best; four rows interleaved, the old way, ran at half the
 * memory bandwidth on one row of x). Each product keeps four partial sums, block b of 8 floats going to
 * partial b % 4, added as (p0 + p1) + (p2 + p3), then across lanes, then the K % 8 tail in order: the same
 * chain for every MM, so a row's bits do not depend on how many rows share the call. */
#define DOTS(MM) \
static inline void dots_##MM(const float *x, long K, const float *w, float *y, long D) { \
    __m256 a[MM][4]; \
    for (int m = 0; m < MM; m++) for (int q = 0; q < 4; q++) a[m][q] = _mm256_setzero_ps(); \
    long k = 0; \
    for (; k + 32 <= K; k += 32) \
        for (int q = 0; q < 4; q++) { \
            __m256 wv = _mm256_loadu_ps(w + k + 8 * q); \
            for (int m = 0; m < MM; m++) a[m][q] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8 * q), wv, a[m][q]); \
        } \
    for (int q = 0; k + 8 <= K; k += 8, q++) { \
        __m256 wv = _mm256_loadu_ps(w + k); \
        for (int m = 0; m < MM; m++) a[m][q] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), wv, a[m][q]); \
    } \
    for (int m = 0; m < MM; m++) { \
        float s = hsum(_mm256_add_ps(_mm256_add_ps(a[m][0], a[m][1]), _mm256_add_ps(a[m][2], a[m][3]))); \
        for (long t = k; t < K; t++) s += x[m * K + t] * w[t]; \
        y[m * D] = s; \
    } \
}
DOTS(1) DOTS(2) DOTS(3)

/* One row's product (LoRA and attention use it too): dots_1's chain */
static inline float dot(const float *x, const float *w, long K) {
    float y;
    dots_1(x, K, w, &y, 1);
    return y;
}

/* rows j0..j1 of y = x w^T for any M: up to 3 rows of x per pass over each weight row (12 partial sums in
 * registers); more in chunks of 3 over tiles of TILE weight rows, so a tile is read from memory once and
 * from cache by every chunk after the first */
#define TILE 64
static void rows_any(const float *x, const float *w, float *y, long M, long K, long D, long j0, long j1) {
    for (long t = j0; t < j1; t += TILE) {
        long t1 = t + TILE < j1 ? t + TILE : j1;
        for (long m = 0; m < M; m += 3) {
            long mm = M - m < 3 ? M - m : 3;
            const float *xm = x + m * K;
            float *ym = y + m * D;
            if (mm == 3) for (long j = t; j < t1; j++) dots_3(xm, K, w + j * K, ym + j, D);
            else if (mm == 2) for (long j = t; j < t1; j++) dots_2(xm, K, w + j * K, ym + j, D);
            else for (long j = t; j < t1; j++) dots_1(xm, K, w + j * K, ym + j, D);
        }
    }
}

/* Threads take CHUNK weight rows at a time from a shared counter (dynamic), not a fixed half each: the
 * replica's event loop, the router and the client share these cores, and a thread they preempt would
 * otherwise hold the other at the region's end for the rest of its half (the step took 34-45 ms in
 * serving against 26-33 alone; an A/B of this change alone in serving was within the noise) */
#define CHUNK 32
int lf_small_m_linear(const float *x, const float *w, float *y, long M, long K, long D, int threads) {
    if (M < 1) return -1;
    if (threads <= 1 || D < 2 * CHUNK) { rows_any(x, w, y, M, K, D, 0, D); return 0; }
    long chunks = (D + CHUNK - 1) / CHUNK;
    #pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (long c = 0; c < chunks; c++) {
        long a = c * CHUNK, b = a + CHUNK < D ? a + CHUNK : D;
        rows_any(x, w, y, M, K, D, a, b);
    }
    return 0;
}
