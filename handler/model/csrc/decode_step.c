/* A whole decode step of a Llama-family model on the CPU, for 1-64 rows: one call instead of ~9,000 torch
 * ops (about a third of a step at one row was host overhead: op dispatch, views, small temporaries).
 *
 * Per row b (token t_b at position p_b, context c_b = p_b + 1, block table T_b, adapter (pool, slot) or
 * none) and layer l, in float32:
 *
 *     x    = embed[t_b]                                              (layer 0; else x += d)
 *     h    = rmsnorm(x) * in_norm;  qkv = h W_qkv^T (+ b) + lora_qkv(h)
 *     q, k = rope(q, p_b), rope(k, p_b);  K[l][slot_b] = k; V[l][slot_b] = v
 *     a_h  = softmax(q_h K_g[T_b][:c_b]^T / sqrt(D)) V_g[T_b][:c_b]    (g = h / (H / KVH): GQA)
 *     o    = a W_o^T (+ b) + lora_o(a);  x += o
 *     h    = rmsnorm(x) * post_norm;  gu = h W_gu^T (+ b) + lora_gu(h)
 *     m    = silu(gate) * up;  d = m W_down^T (+ b) + lora_down(m)
 *     logits = (rmsnorm(x + d) * norm) W_head^T
 *
 * with lora_G(x)[off_j : off_j + d_j] = (x A_p[slot][j r_p : (j + 1) r_p]^T) B_p[j][slot] for module j of
 * group G (the stacks of handler/model/lora.py `MultiLoRALinear`: A [S + 1, n r_p, k], B [S + 1, r_p, d_j],
 * scale folded into B).
 *
 * Every row is computed on its own (the products through small_gemm.c's kernel, whose row bits do not
 * depend on the other rows; attention, norms and LoRA per row): a row's logits are the same bits whatever
 * else shares the step. The weights are read once per step for all rows.
 */
#include "small_gemm.c"

#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* handler/model/lora.py GROUPS, in that order (each group's modules in the order of the ABI table below) */
enum { G_QKV, G_O, G_GATE_UP, G_DOWN, GROUPS };
#define MAX_MODULES 3
#define MAX_ROWS 64 /* handler/model/decode_step.py MAX_ROWS */

/* Mirrored by handler/model/decode_step.py `_Model` (ctypes): the ABI table at the end of this file
 * (lf_decode_step_abi) reports its size and every field's offset, and the Python side refuses a library
 * whose table differs from its own definitions. A field added here goes into that table too. */
typedef struct {
    long hidden, heads, kv_heads, head_dim, inter, vocab, layers, block_size;
    float eps;
    /* per layer (biases may be NULL) */
    const float *const *in_norm, *const *post_norm, *const *qkv, *const *qkv_b, *const *o, *const *o_b;
    const float *const *gate_up, *const *gate_up_b, *const *down, *const *down_b;
    float *k_cache, *v_cache; /* [layers, blocks, block_size, kv_heads, head_dim] */
    long cache_layer_stride;  /* floats per layer */
    const float *embed, *norm, *lm_head, *cos, *sin; /* cos/sin [positions, head_dim] */
    /* LoRA: pools of rank rank[p]; a[(l * GROUPS + g) * pools + p] the A stack of group g,
       b[((l * GROUPS + g) * pools + p) * MAX_MODULES + j] the B stack of its module j */
    long pools;
    const long *rank;
    const float *const *lora_a, *const *lora_b;
} Model;

typedef struct {
    long k, n;              /* input width, modules */
    long d[MAX_MODULES];    /* output width of each module */
    long off[MAX_MODULES];  /* its offset in the group's fused output */
} Group;

/* y[M, D] = x[M, K] w[D, K]^T (+ b): threads only for a product of at least par_min multiply-adds */
static void linear(const float *x, const float *w, const float *b, float *y, long M, long K, long D,
                   int threads, long par_min) {
    lf_small_m_linear(x, w, y, M, K, D, M * K * D >= par_min ? threads : 1);
    if (b)
        for (long m = 0; m < M; m++)
            for (long j = 0; j < D; j++) y[m * D + j] += b[j];
}

static void rmsnorm(const float *x, const float *w, float *out, long n, float eps) {
    __m256 acc = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum(acc);
    for (; i < n; i++) ss += x[i] * x[i];
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (i = 0; i < n; i++) out[i] = w[i] * (x[i] * inv);
}

static inline void axpy(float a, const float *x, float *y, long n) {
    __m256 av = _mm256_set1_ps(a);
    long i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

/* y (one row, the group's fused output) += this row's adapter delta */
static void lora_row(const Model *md, long layer, int g, const Group *G, long pool, long slot, const float *x,
                     float *y, float *h) {
    long r = md->rank[pool], nr = G->n * r;
    long idx = (layer * GROUPS + g) * md->pools + pool;
    const float *A = md->lora_a[idx] + slot * nr * G->k;
    for (long j = 0; j < nr; j++) h[j] = dot(x, A + j * G->k, G->k);
    for (long j = 0; j < G->n; j++) {
        const float *B = md->lora_b[idx * MAX_MODULES + j] + slot * r * G->d[j];
        for (long t = 0; t < r; t++) axpy(h[j * r + t], B + t * G->d[j], y + G->off[j], G->d[j]);
    }
}

/* every row's delta; rows split over threads (each its own scratch h) when the work is at least par_min
 * multiply-adds: a row's bits do not depend on the split */
static void lora(const Model *md, long layer, int g, const Group *G, long M, const long *pool, const long *slot,
                 const float *x, float *y, long ldy, float *h, long h_stride, int threads, long par_min) {
    if (!md->pools) return;
    long rows = 0, macs = 0;
    for (long m = 0; m < M; m++)
        if (pool[m] >= 0) {
            rows++;
            macs += md->rank[pool[m]] * (G->n * G->k + G->off[G->n - 1] + G->d[G->n - 1]);
        }
    int par = threads > 1 && rows > 1 && macs >= par_min;
    #pragma omp parallel for num_threads(threads) if (par) schedule(static)
    for (long m = 0; m < M; m++)
        if (pool[m] >= 0)
            lora_row(md, layer, g, G, pool[m], slot[m], x + m * G->k, y + m * ldy, h + omp_get_thread_num() * h_stride);
}

/* e^x, 8 lanes (Cephes' polynomial, as in avx_mathfun; within 2 ulp of expf over the clamped range) */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* m[i] = silu(gate[i]) * up[i] */
static void silu_mul(const float *gate, const float *up, float *m, long n) {
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 sg = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
        _mm256_storeu_ps(m + i, _mm256_mul_ps(sg, _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) m[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

static void rope(float *v, const float *cos, const float *sin, long heads, long D) {
    long half = D / 2;
    for (long h = 0; h < heads; h++, v += D)
        for (long i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * cos[i] - b * sin[i];
            v[i + half] = b * cos[i + half] + a * sin[i + half];
        }
}

/* out[H * D] for one row: every head over the row's c cached positions (blocks in table order) */
static void attend_row(const Model *md, const float *kc, const float *vc, const float *q, const long *table, long c,
                       float *out, float *s) {
    long H = md->heads, KVH = md->kv_heads, D = md->head_dim, bs = md->block_size, per = H / KVH;
    float scale = 1.0f / sqrtf((float)D);
    for (long h = 0; h < H; h++) {
        long g = h / per;
        const float *qh = q + h * D;
        float mx = -INFINITY;
        for (long t = 0; t < c; t++) {
            const float *kt = kc + ((table[t / bs] * bs + t % bs) * KVH + g) * D;
            s[t] = dot(qh, kt, D) * scale;
            if (s[t] > mx) mx = s[t];
        }
        float sum = 0.0f;
        for (long t = 0; t < c; t++) {
            s[t] = expf(s[t] - mx);
            sum += s[t];
        }
        float *oh = out + h * D;
        memset(oh, 0, D * sizeof(float));
        for (long t = 0; t < c; t++)
            axpy(s[t] / sum, vc + ((table[t / bs] * bs + t % bs) * KVH + g) * D, oh, D);
    }
}

/* One decode step of M rows (1-MAX_ROWS). tables [M, nb]; lora_pool[m] < 0: no adapter. logits [M, vocab].
 * threads: for products of at least par_min multiply-adds (the LM head always). Returns 0, or -1 for
 * bad arguments, -2 when out of memory. */
int lf_decode_step(const Model *md, long M, const long *tokens, const long *positions, const long *cache_slots,
                   const long *tables, long nb, const long *lora_pool, const long *lora_slot, float *logits,
                   int threads, long par_min) {
    if (M < 1 || M > MAX_ROWS) return -1;
    long E = md->hidden, H = md->heads, KVH = md->kv_heads, D = md->head_dim, I = md->inter;
    long qd = H * D, kvd = KVH * D, QKV = qd + 2 * kvd;
    Group G[GROUPS] = {
        [G_QKV] = {E, 3, {qd, kvd, kvd}, {0, qd, qd + kvd}}, /* q, k, v */
        [G_O] = {qd, 1, {E}, {0}},
        [G_GATE_UP] = {E, 2, {I, I}, {0, I}}, /* gate, up */
        [G_DOWN] = {I, 1, {E}, {0}},
    };
    long max_r = 0;
    for (long p = 0; p < md->pools; p++) max_r = md->rank[p] > max_r ? md->rank[p] : max_r;
    long ctx_max = nb * md->block_size;
    long lh_stride = MAX_MODULES * max_r, nthreads = threads > 1 ? threads : 1;
    size_t floats = (size_t)M * (3 * E + QKV + qd + 2 * I + I) + nthreads * (lh_stride + ctx_max);
    float *buf = malloc(floats * sizeof(float));
    if (!buf) return -2;
    float *x = buf, *h = x + M * E, *d = h + M * E, *qkv = d + M * E, *att = qkv + M * QKV;
    float *gu = att + M * qd, *mm = gu + M * 2 * I, *lh = mm + M * I, *sc = lh + nthreads * lh_stride;
    float *o = d; /* o and d are never live together */
    /* the per-row work (norms, rope, attention, SiLU) split by rows: with the products' rule, from 16 rows
       (or always under par_min 0); a row's bits do not depend on the split */
    int rt = threads > 1 && M > 1 && (par_min == 0 || M >= 16) ? threads : 1;

    for (long m = 0; m < M; m++) memcpy(x + m * E, md->embed + tokens[m] * E, E * sizeof(float));
    for (long l = 0; l < md->layers; l++) {
        float *kc = md->k_cache + l * md->cache_layer_stride, *vc = md->v_cache + l * md->cache_layer_stride;
        #pragma omp parallel for num_threads(rt) if (rt > 1) schedule(dynamic, 1)
        for (long m = 0; m < M; m++) {
            if (l) for (long i = 0; i < E; i++) x[m * E + i] += d[m * E + i];
            rmsnorm(x + m * E, md->in_norm[l], h + m * E, E, md->eps);
        }
        linear(h, md->qkv[l], md->qkv_b[l], qkv, M, E, QKV, threads, par_min);
        lora(md, l, G_QKV, &G[G_QKV], M, lora_pool, lora_slot, h, qkv, QKV, lh, lh_stride, threads, par_min);
        /* every row's K/V is written before any row attends: rows of one sequence at consecutive positions
           (a speculative step's draft tokens) each read the K/V the rows before them write in this layer */
        for (long m = 0; m < M; m++) {
            float *q = qkv + m * QKV, *k = q + qd, *v = k + kvd;
            const float *cs = md->cos + positions[m] * D, *sn = md->sin + positions[m] * D;
            rope(q, cs, sn, H, D);
            rope(k, cs, sn, KVH, D);
            memcpy(kc + cache_slots[m] * kvd, k, kvd * sizeof(float));
            memcpy(vc + cache_slots[m] * kvd, v, kvd * sizeof(float));
        }
        #pragma omp parallel for num_threads(rt) if (rt > 1) schedule(dynamic, 1)
        for (long m = 0; m < M; m++)
            attend_row(md, kc, vc, qkv + m * QKV, tables + m * nb, positions[m] + 1, att + m * qd,
                       sc + omp_get_thread_num() * ctx_max);
        linear(att, md->o[l], md->o_b[l], o, M, qd, E, threads, par_min);
        lora(md, l, G_O, &G[G_O], M, lora_pool, lora_slot, att, o, E, lh, lh_stride, threads, par_min);
        #pragma omp parallel for num_threads(rt) if (rt > 1) schedule(dynamic, 1)
        for (long m = 0; m < M; m++) {
            for (long i = 0; i < E; i++) x[m * E + i] += o[m * E + i];
            rmsnorm(x + m * E, md->post_norm[l], h + m * E, E, md->eps);
        }
        linear(h, md->gate_up[l], md->gate_up_b[l], gu, M, E, 2 * I, threads, par_min);
        lora(md, l, G_GATE_UP, &G[G_GATE_UP], M, lora_pool, lora_slot, h, gu, 2 * I, lh, lh_stride, threads, par_min);
        #pragma omp parallel for num_threads(rt) if (rt > 1) schedule(dynamic, 1)
        for (long m = 0; m < M; m++) silu_mul(gu + m * 2 * I, gu + m * 2 * I + I, mm + m * I, I);
        linear(mm, md->down[l], md->down_b[l], d, M, I, E, threads, par_min);
        lora(md, l, G_DOWN, &G[G_DOWN], M, lora_pool, lora_slot, mm, d, E, lh, lh_stride, threads, par_min);
    }
    for (long m = 0; m < M; m++) {
        for (long i = 0; i < E; i++) x[m * E + i] += d[m * E + i];
        rmsnorm(x + m * E, md->norm, h + m * E, E, md->eps);
    }
    linear(h, md->lm_head, NULL, logits, M, E, md->vocab, threads, 0);
    free(buf);
    return 0;
}

/* The ABI handler/model/decode_step.py mirrors by hand, as (name, value) pairs: the constants, the size of
 * `long` (the index arrays are int64 tensors), the layout of `Model`, and the LoRA groups in their order
 * with each group's modules in the order of G above. decode_step.py compares it with its ctypes
 * definitions when the library is loaded and refuses a library whose table differs, naming the items. */
typedef struct {
    const char *name;
    long value;
} AbiItem;

#define FIELD(f) {"Model." #f, (long)offsetof(Model, f)}
static const AbiItem ABI[] = {
    {"MAX_ROWS", MAX_ROWS},
    {"MAX_MODULES", MAX_MODULES},
    {"GROUPS", GROUPS},
    {"sizeof(long)", (long)sizeof(long)},
    {"sizeof(Model)", (long)sizeof(Model)},
    FIELD(hidden), FIELD(heads), FIELD(kv_heads), FIELD(head_dim), FIELD(inter), FIELD(vocab), FIELD(layers),
    FIELD(block_size), FIELD(eps),
    FIELD(in_norm), FIELD(post_norm), FIELD(qkv), FIELD(qkv_b), FIELD(o), FIELD(o_b), FIELD(gate_up),
    FIELD(gate_up_b), FIELD(down), FIELD(down_b),
    FIELD(k_cache), FIELD(v_cache), FIELD(cache_layer_stride),
    FIELD(embed), FIELD(norm), FIELD(lm_head), FIELD(cos), FIELD(sin),
    FIELD(pools), FIELD(rank), FIELD(lora_a), FIELD(lora_b),
    {"group.qkv", G_QKV}, {"group.qkv.q_proj", 0}, {"group.qkv.k_proj", 1}, {"group.qkv.v_proj", 2},
    {"group.o", G_O}, {"group.o.o_proj", 0},
    {"group.gate_up", G_GATE_UP}, {"group.gate_up.gate_proj", 0}, {"group.gate_up.up_proj", 1},
    {"group.down", G_DOWN}, {"group.down.down_proj", 0},
};
#undef FIELD

/* *items = the table; returns its length */
long lf_decode_step_abi(const AbiItem **items) {
    *items = ABI;
    return (long)(sizeof ABI / sizeof ABI[0]);
}
