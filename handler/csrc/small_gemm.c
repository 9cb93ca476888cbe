/* Small-M linear for the CPU decode step: y[m, j] = sum_k x[m, k] * w[j, k] for the few rows of a decode
 * step (up to 64).
 *
 * Why: a decode step multiplies a few rows (the running requests) by every weight matrix. MKL's sgemm
 * packs the weight for each call at small M, so 2-8 rows cost 2-4x one row, although the work is bound by
 * reading the weight once. Here every weight row is read once and dotted with all M rows of x (AVX2 FMA,
 * one accumulator chain per (x row, w row)), so M rows cost about one. Past 8 rows the work is tiled (below),
 * and still beat MKL up to 64 rows on 2 threads (SmolLM2's layer shapes: 103 vs 138 ms at 32 rows).
 *
 * Each y[m, j] is one chain over k in a fixed order then a fixed horizontal sum: it does not depend on
 * M, on which other rows share the call, on R-blocking or on the thread split (rows of w per thread).
 * Built at first use by handler/small_gemm.py with -O3 -mavx2 -mfma -fopenmp; OpenMP resolves to the
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

/* One row's product, the way the blocked loop below computes each of its chains (same bits): the
 * rows of w left over after the last block of R */
static inline float dot(const float *x, const float *w, long K) {
    __m256 a = _mm256_setzero_ps();
    long k = 0;
    for (; k + 8 <= K; k += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(w + k), a);
    float s = hsum(a);
    for (; k < K; k++) s += x[k] * w[k];
    return s;
}

/* y[m, j] = sum_k x[m, k] * w[j, k], rows j in [j0, j1), R rows of w at a time (independent chains) */
#define KERNEL(MM, R) \
static void rows_##MM(const float *x, const float *w, float *y, long K, long D, long j0, long j1) { \
    long j = j0; \
    for (; j + R <= j1; j += R) { \
        __m256 acc[R][MM]; \
        for (int r = 0; r < R; r++) for (int m = 0; m < MM; m++) acc[r][m] = _mm256_setzero_ps(); \
        long k = 0; \
        int ahead = R > 1 && j + 2 * R <= j1; \
        for (; k + 8 <= K; k += 8) { \
            __m256 xv[MM]; \
            if (ahead && (k & 15) == 0) /* the next block's rows, a cache line each: 1.2-1.3x at 2-4 rows */ \
                for (int r = 0; r < R; r++) _mm_prefetch((const char *)(w + (j + R + r) * K + k), _MM_HINT_T0); \
            for (int m = 0; m < MM; m++) xv[m] = _mm256_loadu_ps(x + m * K + k); \
            for (int r = 0; r < R; r++) { \
                __m256 wv = _mm256_loadu_ps(w + (j + r) * K + k); \
                for (int m = 0; m < MM; m++) acc[r][m] = _mm256_fmadd_ps(xv[m], wv, acc[r][m]); \
            } \
        } \
        for (int r = 0; r < R; r++) for (int m = 0; m < MM; m++) { \
            float s = hsum(acc[r][m]); \
            for (long t = k; t < K; t++) s += x[m * K + t] * w[(j + r) * K + t]; \
            y[m * D + j + r] = s; \
        } \
    } \
    for (; j < j1; j++) \
        for (int m = 0; m < MM; m++) y[m * D + j] = dot(x + m * K, w + j * K, K); \
}
KERNEL(1, 4) KERNEL(2, 4) KERNEL(3, 2) KERNEL(4, 2) KERNEL(5, 1) KERNEL(6, 1) KERNEL(7, 1) KERNEL(8, 1)

typedef void (*rows_fn)(const float *, const float *, float *, long, long, long, long);
static const rows_fn FNS[9] = {0, rows_1, rows_2, rows_3, rows_4, rows_5, rows_6, rows_7, rows_8};

/* rows j0..j1 of y for any M: up to 8 rows in one pass; more in chunks of 4 rows (the fastest pass per
 * multiply-add) over tiles of TILE weight rows, so a tile is read from memory once and from cache by
 * every chunk after the first */
#define TILE 64
static void rows_any(const float *x, const float *w, float *y, long M, long K, long D, long j0, long j1) {
    if (M <= 8) { FNS[M](x, w, y, K, D, j0, j1); return; }
    for (long t = j0; t < j1; t += TILE) {
        long t1 = t + TILE < j1 ? t + TILE : j1;
        for (long m = 0; m < M; m += 4) {
            long mm = M - m < 4 ? M - m : 4;
            FNS[mm](x + m * K, w, y + m * D, K, D, t, t1);
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
