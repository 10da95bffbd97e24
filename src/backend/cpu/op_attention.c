/* Causal grouped-query attention on 64 x 64 GEMM blocks, as FlashAttention-2
 * does it: queries in blocks of ATT_BR rows, keys in blocks of ATT_BC; per
 * (query block, key block) pair the scores S = Q K^T * scale and the update
 * O += P V are cblas_sgemm calls, the softmax keeps a running row max m and
 * sum l (online softmax), so no T x T score matrix is ever held. The forward
 * saves lse = m + log(l) per (b, h, t); the backward recomputes P = exp(S -
 * lse) block by block from it.
 *
 * Query head h reads kv head h / (H / KV) (GQA). Query t of row b attends to
 * keys [doc_start[b*T+t], t]: packed examples never see each other. Key
 * blocks wholly above the diagonal or before the block's earliest doc_start
 * are skipped; blocks that cut the diagonal or a document boundary are
 * masked entry by entry (-inf before the exp), and a block pair's products
 * take only the query rows that see at least one of its keys.
 *
 * Threading: OpenBLAS runs single-threaded (op_blas_init) and OpenMP splits
 * the work, one sgemm per thread at a time (see op_matmul.c). Scratch is two
 * ATT_BR x ATT_BC blocks on each thread's stack: nothing is allocated.
 *
 * Most of the time is spent in the sgemm calls, which run several times the
 * rate of the one-query-row-at-a-time form with vector dot products that
 * this replaced (bench/RESULTS.md, "Attention on GEMM blocks"). */
#include "backend/cpu/ops.h"
#include "backend/cpu/op_simd.h"

#include <cblas.h>
#include <float.h>
#include <math.h>
#include <omp.h>
#include <string.h>

#define ATT_BR 64 /* query rows per block */
#define ATT_BC 64 /* keys per block */

/* Sizes and strides: q/out/dout rows are H*D apart, k/v rows KV*D. Query
 * row t sits at key position t + pos0 (pos0 > 0 only when decoding against
 * a cache that already holds pos0 earlier keys). */
typedef struct {
    int T, H, KV, D, G, pos0;
    size_t qs, ks;
    float scale;
} att_dims;

static att_dims att_dims_of(int T, int H, int KV, int D, int pos0) {
    att_dims a = {T, H, KV, D, H / KV, pos0, (size_t)H * D, (size_t)KV * D, 1.0f / sqrtf((float)D)};
    return a;
}

/* Range of doc_start over query rows [i0, i1) (doc NULL: 0). */
static void doc_range(const int32_t *doc, int i0, int i1, int *lo, int *hi) {
    if (!doc) {
        *lo = *hi = 0;
        return;
    }
    int a = doc[i0], b = doc[i0];
    for (int t = i0 + 1; t < i1; t++) a = doc[t] < a ? doc[t] : a, b = doc[t] > b ? doc[t] : b;
    *lo = a, *hi = b;
}

/* The rows [i0 + *r0, i0 + *r1) of query block [i0, i0+mi) that see at
 * least one key of [j0, j0+nj) (row t sees [doc[t], t + pos0]); returns 0
 * when none does. Only those rows enter the block pair's products: with
 * packed documents a query block that straddles a document start has rows
 * that see none of the earlier document's key blocks. */
static int att_rows_seeing(const int32_t *doc, int i0, int mi, int j0, int nj, int pos0, int *r0, int *r1) {
    int first = mi, last = -1;
    for (int r = 0; r < mi; r++) {
        int t = i0 + r, lo = doc && doc[t] > j0 ? doc[t] : j0, hi = t + pos0 < j0 + nj - 1 ? t + pos0 : j0 + nj - 1;
        if (lo <= hi) first = r < first ? r : first, last = r;
    }
    *r0 = first, *r1 = last + 1;
    return last >= first;
}

/* s (mi, nj) = scale * Q[i0 .. i0+mi) K[j0 .. j0+nj)^T, then -inf where key
 * j0+c is outside [doc[i0+r], i0+r+pos0]. q, k point at row 0 of the head. */
static void att_scores(float *s, const float *q, const float *k, const int32_t *doc, int i0, int mi, int j0, int nj,
                       const att_dims *a) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, mi, nj, a->D, a->scale, q + (size_t)i0 * a->qs, (int)a->qs,
                k + (size_t)j0 * a->ks, (int)a->ks, 0.0f, s, ATT_BC);
    int dlo, dhi;
    doc_range(doc, i0, i0 + mi, &dlo, &dhi);
    if (j0 + nj - 1 <= i0 + a->pos0 && j0 >= dhi) return; /* every (row, key) pair visible */
    for (int r = 0; r < mi; r++) {
        int t = i0 + r, lo = (doc ? doc[t] : 0) - j0, hi = t + a->pos0 - j0; /* visible columns [lo, hi] */
        float *sr = s + (size_t)r * ATT_BC;
        for (int c = 0; c < nj; c++)
            if (c < lo || c > hi) sr[c] = -INFINITY;
    }
}

/* One query block [i0, i0+mi) of head h of batch row b against all the keys
 * it sees: out rows and lse (when not NULL) written. q, k, v, out, doc at
 * batch row b (k, v at the kv head's column). */
static void att_fwd_block(float *out, float *lse, const float *q, const float *k, const float *v,
                          const int32_t *doc, int i0, int mi, const att_dims *a) {
    float s[ATT_BR * ATT_BC];
    float m[ATT_BR], l[ATT_BR];
    int D = a->D, dlo, dhi;
    for (int r = 0; r < mi; r++) {
        m[r] = -FLT_MAX, l[r] = 0.0f;
        memset(out + (size_t)(i0 + r) * a->qs, 0, sizeof(float) * (size_t)D);
    }
    doc_range(doc, i0, i0 + mi, &dlo, &dhi);
    int jend = i0 + mi + a->pos0; /* one past the last key a row of the block sees */
    for (int j0 = dlo / ATT_BC * ATT_BC; j0 < jend; j0 += ATT_BC) {
        int nj = jend - j0 < ATT_BC ? jend - j0 : ATT_BC, r0, r1;
        if (!att_rows_seeing(doc, i0, mi, j0, nj, a->pos0, &r0, &r1)) continue;
        int ri = i0 + r0, rm = r1 - r0; /* rows [ri, ri+rm) take part */
        att_scores(s, q, k, doc, ri, rm, j0, nj, a);
        for (int r = 0; r < rm; r++) {
            float *sr = s + (size_t)r * ATT_BC, *orow = out + (size_t)(ri + r) * a->qs, *mr = m + r0 + r;
            float mn = op_row_max(sr, nj, *mr);
            float corr = expf(*mr - mn);
            l[r0 + r] = l[r0 + r] * corr + (float)op_row_exp(sr, nj, mn, 1.0f); /* sr = p */
            if (corr != 1.0f)
                for (int d = 0; d < D; d++) orow[d] *= corr;
            *mr = mn;
        }
        /* out (rm, D) += P (rm, nj) V (nj, D) */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rm, D, nj, 1.0f, s, ATT_BC, v + (size_t)j0 * a->ks,
                    (int)a->ks, 1.0f, out + (size_t)ri * a->qs, (int)a->qs);
    }
    for (int r = 0; r < mi; r++) {
        float inv = 1.0f / l[r], *orow = out + (size_t)(i0 + r) * a->qs;
        for (int d = 0; d < D; d++) orow[d] *= inv;
        if (lse) lse[i0 + r] = m[r] + logf(l[r]);
    }
}

void op_attention_forward(float *out, float *lse, const float *q, const float *k, const float *v,
                          const int32_t *doc_start, int B, int T, int H, int KV, int D) {
    op_blas_init();
    att_dims a = att_dims_of(T, H, KV, D, 0);
    int NB = (T + ATT_BR - 1) / ATT_BR;
    /* the last query blocks see the most keys: hand them out first */
#pragma omp parallel for collapse(3) schedule(dynamic, 1)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int ib = NB - 1; ib >= 0; ib--) {
                size_t qo = (size_t)b * T * a.qs + (size_t)h * D, ko = (size_t)b * T * a.ks + (size_t)(h / a.G) * D;
                int i0 = ib * ATT_BR, mi = T - i0 < ATT_BR ? T - i0 : ATT_BR;
                att_fwd_block(out + qo, lse + ((size_t)b * H + h) * T, q + qo, k + ko, v + ko,
                              doc_start ? doc_start + (size_t)b * T : NULL, i0, mi, &a);
            }
}

/* ---- decoding against a cache --------------------------------------------
 * A few new queries (one per generated token) go one row at a time with
 * vector dot products: an sgemm per 64 keys for a single row costs more in
 * call and packing overhead than it computes. A prompt (n >= ATT_ROWS_MAX)
 * goes through the same blocks as training, as one batch row of T = n
 * whose row i sits at key position pos0 + i. */
#define ATT_ROWS_MAX 16

/* s[0..7] = the 8 sums in a[0..7] (each over its 8 lanes) * scale: horizontal
 * adds and a lane exchange, not one reduction per key. */
static inline void sums8(float *s, const __m256 *a, float scale) {
    /* hadd(x, y) = [x0+x1, x2+x3, y0+y1, y2+y3 | x4+x5, x6+x7, y4+y5, y6+y7] */
    __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    __m256 lo4 = _mm256_hadd_ps(h01, h23), hi4 = _mm256_hadd_ps(h45, h67); /* keys 0-3 / 4-7, each lane half a sum */
    __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(lo4, hi4, 0x20), _mm256_permute2f128_ps(lo4, hi4, 0x31));
    _mm256_storeu_ps(s, _mm256_mul_ps(sum, _mm256_set1_ps(scale)));
}

/* q_h . k_j * scale for 8 keys k_0..k_7 (row stride ks) and NH (1 or 2)
 * heads q_0, q_1 into s_h[0..7], D a multiple of 8: one accumulator per (head,
 * key) over D, each key's line loaded once for both heads, then sums8. A
 * head's operations are the same with NH 1 or 2. */
static inline __attribute__((always_inline)) void dots8(float *s0, float *s1, const float *q0, const float *q1,
                                                        const float *k, size_t ks, int D, float scale, int NH) {
    __m256 a[8], b[8];
    for (int j = 0; j < 8; j++) a[j] = b[j] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
        const __m256 qa = _mm256_loadu_ps(q0 + d), qb = NH == 2 ? _mm256_loadu_ps(q1 + d) : qa;
        for (int j = 0; j < 8; j++) {
            __m256 kv = _mm256_loadu_ps(k + (size_t)j * ks + d);
            if (NH == 2) IN_REGISTER(kv);
            a[j] = _mm256_fmadd_ps(qa, kv, a[j]);
            if (NH == 2) b[j] = _mm256_fmadd_ps(qb, kv, b[j]);
        }
    }
    sums8(s0, a, scale);
    if (NH == 2) sums8(s1, b, scale);
}

/* ac_h[c .. c + 8 NV) = ac_h * corr_h + p_h[0] v_0 + p_h[1] v_1 + ... over n
 * keys (row stride ks), one key after another (an FMA per key), for NH heads:
 * the columns stay in registers for the whole block and each value line is
 * loaded once for both heads. (Loaded and stored again every 4 keys, the
 * accumulator's chain through memory bounded the update.) NV x NH <= 8. */
static inline __attribute__((always_inline)) void values_cols(float *ac0, float *ac1, float corr0, float corr1,
                                                              const float *p0, const float *p1, const float *v,
                                                              size_t ks, int n, int c, int NV, int NH) {
    __m256 a[8], b[4];
    const __m256 k0 = _mm256_set1_ps(corr0), k1 = _mm256_set1_ps(corr1);
    for (int u = 0; u < NV; u++) {
        a[u] = _mm256_mul_ps(_mm256_loadu_ps(ac0 + c + 8 * u), k0);
        if (NH == 2) b[u] = _mm256_mul_ps(_mm256_loadu_ps(ac1 + c + 8 * u), k1);
    }
    for (int j = 0; j < n; j++) {
        const float *vj = v + (size_t)j * ks + c;
        const __m256 pa = _mm256_broadcast_ss(p0 + j), pb = NH == 2 ? _mm256_broadcast_ss(p1 + j) : pa;
        for (int u = 0; u < NV; u++) {
            __m256 x = _mm256_loadu_ps(vj + 8 * u);
            if (NH == 2) IN_REGISTER(x);
            a[u] = _mm256_fmadd_ps(pa, x, a[u]);
            if (NH == 2) b[u] = _mm256_fmadd_ps(pb, x, b[u]);
        }
    }
    for (int u = 0; u < NV; u++) {
        _mm256_storeu_ps(ac0 + c + 8 * u, a[u]);
        if (NH == 2) _mm256_storeu_ps(ac1 + c + 8 * u, b[u]);
    }
}

/* the whole row of D (a multiple of 8) in pieces of 64 / NH columns: eight
 * accumulator chains, enough to keep the FMA units busy */
static inline __attribute__((always_inline)) void values(float *ac0, float *ac1, float corr0, float corr1,
                                                         const float *p0, const float *p1, const float *v, size_t ks,
                                                         int n, int D, int NH) {
    const int W = 64 / NH;
    int c = 0;
    for (; c + W <= D; c += W) values_cols(ac0, ac1, corr0, corr1, p0, p1, v, ks, n, c, W / 8, NH);
    for (; c < D; c += 8) values_cols(ac0, ac1, corr0, corr1, p0, p1, v, ks, n, c, 1, NH);
}

/* scores of NH heads (h, h + 1) for the nk keys of a block (row stride ks)
 * into s + h * ATT_BC */
static inline __attribute__((always_inline)) void heads_scores(float *s, const float *q, const float *k, size_t ks,
                                                               int nk, int D, int h, float scale, int NH) {
    float *s0 = s + (size_t)h * ATT_BC, *s1 = s0 + ATT_BC;
    const float *q0 = q + (size_t)h * D, *q1 = q0 + D;
    int j = 0;
    if (D % 8 == 0)
        for (; j + 8 <= nk; j += 8) dots8(s0 + j, s1 + j, q0, q1, k + (size_t)j * ks, ks, D, scale, NH);
    for (; j < nk; j++) {
        const float *kj = k + (size_t)j * ks;
        for (int e = 0; e < NH; e++) {
            const float *qv = e ? q1 : q0;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < D; d++) dot += qv[d] * kj[d];
            (e ? s1 : s0)[j] = dot * scale;
        }
    }
}

/* the value update of NH heads (h, h + 1) for a block's nk keys, weights p
 * in s + h * ATT_BC, accumulators scaled by corr first */
static inline __attribute__((always_inline)) void heads_values(float *acc, const float *s, const float *corr,
                                                               const float *v, size_t ks, int nk, int D, int h,
                                                               int NH) {
    float *a0 = acc + (size_t)h * D, *a1 = a0 + D;
    const float *p0 = s + (size_t)h * ATT_BC, *p1 = p0 + ATT_BC;
    if (D % 8 == 0) {
        values(a0, a1, corr[h], NH == 2 ? corr[h + 1] : 1.0f, p0, p1, v, ks, nk, D, NH);
        return;
    }
    for (int e = 0; e < NH; e++) {
        float *ac = e ? a1 : a0;
        const float *p = e ? p1 : p0;
        for (int d = 0; d < D; d++) ac[d] *= corr[h + e];
        for (int t = 0; t < nk; t++)
            for (int d = 0; d < D; d++) ac[d] = fmaf(p[t], v[(size_t)t * ks + d], ac[d]);
    }
}

/* a group's accumulators on the stack; head_dim is at most 1024 (qwen2_load.c), so one head always fits */
#define ATT_MAX_G 64
#define ATT_MAX_GD 8192
/* a block's keys (then its values) are copied to consecutive rows where at least ATT_COPY_MIN_G heads read them,
 * the rows are at least ATT_COPY_MIN_STRIDE bytes apart and at most ATT_COPY_MAX_D long */
#define ATT_COPY_MIN_G 4
#define ATT_COPY_MIN_STRIDE 4096
#define ATT_COPY_MAX_D 128
/* rows [0, nk) of src (row stride ks, D floats each) copied to consecutive rows of buf: returns buf and sets *bs
 * to D when copy, else returns src with *bs = ks */
static const float *block_rows(float *buf, const float *src, int nk, int D, size_t ks, int copy, size_t *bs) {
    *bs = ks;
    if (!copy) return src;
    for (int j = 0; j < nk; j++) memcpy(buf + (size_t)j * D, src + (size_t)j * ks, sizeof(float) * (size_t)D);
    *bs = (size_t)D;
    return buf;
}

/* One query row's G heads of each of NKV kv heads (G query heads share a kv
 * head: GQA; G = 1 for one head), q and o NKV x G x D consecutive, k and v
 * the first kv head's columns, against keys [0, j1] with row stride ks,
 * online softmax over blocks of ATT_BC keys. The kv heads go through each
 * block one after another, so a thread reads a stretch of NKV x D floats of
 * every cache row, not D floats of it for one head over the whole context
 * and then the next head's: faster at every head layout measured
 * (bench/RESULTS-decode.md). Per block: the scores of every
 * head (two heads at a time, each key line loaded once for both, 8 keys at a
 * time: dots8), the softmax, then the values of every head (two at a time,
 * each head's accumulator held in registers through the block). Every
 * head's operations are the same whatever its partner, G or the work split,
 * and the same as the one-head-at-a-time form this replaced (its outputs
 * were compared bit for bit on 8 head layouts, 9 contexts, 1 and 2 threads).
 *
 * Each phase reads one block (16 KiB at D = 64) G / 2 times, from L1 where
 * its rows spread over L1's sets. The cache's rows are KV x D floats apart:
 * at 8 kv heads of 128 that is 4 KiB, every row of a head falls in the same
 * 8 sets, and the block is first copied to consecutive rows; at 512 bytes
 * (the 0.5B) the copy costs more than it saves. Where the cache comes from
 * memory (long contexts on several threads: the weights' stream evicts it)
 * the reads, not the arithmetic, bound the call (bench/RESULTS-decode.md). */
static void attn_rows(float *o, const float *q, const float *k, const float *v, size_t ks, int j1, int D, int G,
                      float scale, int NKV) {
    float acc[ATT_MAX_GD];
    float s[ATT_MAX_G * ATT_BC], m[ATT_MAX_G], l[ATT_MAX_G], corr[ATT_MAX_G];
    float buf[ATT_BC * ATT_COPY_MAX_D];
    const int copy = G >= ATT_COPY_MIN_G && D <= ATT_COPY_MAX_D && ks * sizeof(float) >= ATT_COPY_MIN_STRIDE;
    for (int i = 0; i < NKV * G * D; i++) acc[i] = 0.0f;
    for (int g = 0; g < NKV * G; g++) m[g] = -FLT_MAX, l[g] = 0.0f;
    for (int b0 = 0; b0 <= j1; b0 += ATT_BC) {
        const int nk = (b0 + ATT_BC - 1 < j1 ? b0 + ATT_BC - 1 : j1) - b0 + 1;
        for (int e = 0; e < NKV; e++) { /* kv head e: its G query heads' q, m, l and accumulators */
            const float *qe = q + (size_t)e * G * D;
            float *me = m + e * G, *le = l + e * G, *ae = acc + (size_t)e * G * D;
            size_t bs;
            const float *kb = block_rows(buf, k + (size_t)e * D + (size_t)b0 * ks, nk, D, ks, copy, &bs);
            int g = 0;
            for (; g + 2 <= G; g += 2) heads_scores(s, qe, kb, bs, nk, D, g, scale, 2);
            if (g < G) heads_scores(s, qe, kb, bs, nk, D, g, scale, 1);
            for (g = 0; g < G; g++) {
                float *sg = s + (size_t)g * ATT_BC;
                const float mn = op_row_max(sg, nk, me[g]);
                corr[g] = expf(me[g] - mn);
                le[g] *= corr[g];
                le[g] += (float)op_row_exp(sg, nk, mn, 1.0f);
                me[g] = mn;
            }
            const float *vb = block_rows(buf, v + (size_t)e * D + (size_t)b0 * ks, nk, D, ks, copy, &bs);
            for (g = 0; g + 2 <= G; g += 2) heads_values(ae, s, corr, vb, bs, nk, D, g, 2);
            if (g < G) heads_values(ae, s, corr, vb, bs, nk, D, g, 1);
        }
    }
    for (int g = 0; g < NKV * G; g++) {
        const float inv = 1.0f / l[g];
        for (int d = 0; d < D; d++) o[(size_t)g * D + d] = acc[(size_t)g * D + d] * inv;
    }
}

/* the few-row call's work items, in equal runs per thread (a static schedule) */
typedef struct {
    float *out;
    const float *q, *kc, *vc;
    const att_dims *a;
    int n, pos0, D, per, nkv, items, KV; /* an item: nkv kv heads of per query heads each (a row has items) */
} cached_job;

static void cached_items(void *arg, int tid, int nth) {
    const cached_job *j = arg;
    const int total = j->n * j->items, lo = (int)((long)total * tid / nth), hi = (int)((long)total * (tid + 1) / nth);
    for (int w = lo; w < hi; w++) {
        const int i = w / j->items, h = w % j->items * j->per * j->nkv, kv = h / j->a->G;
        const int nkv = kv + j->nkv > j->KV ? j->KV - kv : j->nkv; /* a row's last run may be shorter */
        size_t ko = (size_t)kv * j->D, qo = (size_t)i * j->a->qs + (size_t)h * j->D;
        attn_rows(j->out + qo, j->q + qo, j->kc + ko, j->vc + ko, j->a->ks, j->pos0 + i, j->D, j->per, j->a->scale,
                  nkv);
    }
}

void op_attention_forward_cached(float *out, const float *q, const float *kc, const float *vc, int n, int pos0,
                                 int H, int KV, int D) {
    op_attention_forward_cached_team(NULL, out, q, kc, vc, n, pos0, H, KV, D);
}

void op_attention_forward_cached_team(op_team *team, float *out, const float *q, const float *kc, const float *vc,
                                      int n, int pos0, int H, int KV, int D) {
    att_dims a = att_dims_of(n, H, KV, D, pos0);
    if (n < ATT_ROWS_MAX) {
        /* a work item per (row, run of kv heads) with their query heads, where that gives every thread one;
         * else per (row, query head) */
        const int nth = op_team_size(team);
        const int grouped = n * KV >= nth && a.G <= ATT_MAX_G && a.G * D <= ATT_MAX_GD;
        const int per = grouped ? a.G : 1;
        /* grouped: a row's kv heads in parts, one part per thread where the rows do not share out evenly, each
         * part's kv heads read together block by block (whole stretches of each cache row, not one head's D
         * floats of it at a time), as many as the accumulators hold */
        int parts = 1;
        if (grouped) {
            parts = n % nth ? (KV < nth ? KV : nth) : 1;
            while ((KV + parts - 1) / parts * a.G * D > ATT_MAX_GD || (KV + parts - 1) / parts * a.G > ATT_MAX_G)
                parts++;
        }
        const int nkv = grouped ? (KV + parts - 1) / parts : 1, items = grouped ? (KV + nkv - 1) / nkv : H;
        cached_job j = {out, q, kc, vc, &a, n, pos0, D, per, nkv, items, KV};
        if (!team && omp_in_parallel()) cached_items(&j, 0, 1);
        else op_team_run(team, cached_items, &j);
        return;
    }
    op_blas_init();
    int NB = (n + ATT_BR - 1) / ATT_BR;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int h = 0; h < H; h++)
        for (int ib = NB - 1; ib >= 0; ib--) {
            size_t ko = (size_t)(h / a.G) * D;
            int i0 = ib * ATT_BR, mi = n - i0 < ATT_BR ? n - i0 : ATT_BR;
            att_fwd_block(out + (size_t)h * D, NULL, q + (size_t)h * D, kc + ko, vc + ko, NULL, i0, mi, &a);
        }
}

/* ---- backward (FlashAttention-2) -------------------------------------------
 * Per (query block i, key block j) of one head, with delta_t = dO_t . O_t:
 *   S = Q_i K_j^T * scale,  P = exp(S - lse_i)           (recomputed)
 *   dV_j += P^T dO_i,  dP = dO_i V_j^T,  dS = P o (dP - delta_i) * scale,
 *   dQ_i += dS K_j,    dK_j += dS^T Q_i                  (five sgemm)
 * Threads own what they write, so there are no atomics. With at least as many
 * (b, kv head) pairs as threads, each thread takes whole pairs and does all
 * five products in one pass. Otherwise (B*KV small, many threads) pass 1
 * splits by (b, kv head, key block) and writes dK/dV only, pass 2 by (b, head,
 * query block) and writes dQ only, recomputing S and dP (seven sgemm instead
 * of five, but every thread busy). */

/* dS = scale * P o (dP - delta) for one block pair, P left in s, dS in dp. */
static void att_bwd_pair(float *s, float *dp, const float *q, const float *k, const float *v, const float *dout,
                        const float *lse, const float *delta, const int32_t *doc, int i0, int mi, int j0, int nj,
                        const att_dims *a) {
    att_scores(s, q, k, doc, i0, mi, j0, nj, a);
    /* dP (mi, nj) = dO_i (mi, D) V_j^T */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, mi, nj, a->D, 1.0f, dout + (size_t)i0 * a->qs, (int)a->qs,
                v + (size_t)j0 * a->ks, (int)a->ks, 0.0f, dp, ATT_BC);
    for (int r = 0; r < mi; r++) {
        float *sr = s + (size_t)r * ATT_BC, *dr = dp + (size_t)r * ATT_BC;
        float dl = delta[r], sc = a->scale;
        op_row_exp(sr, nj, lse[i0 + r], 1.0f);
        for (int c = 0; c < nj; c++) dr[c] = sr[c] * (dr[c] - dl) * sc;
    }
}

/* delta[r] = dO_t . O_t for rows t in [i0, i0+mi) of one head. */
static void att_delta(float *delta, const float *dout, const float *out, int i0, int mi, const att_dims *a) {
    for (int r = 0; r < mi; r++) {
        const float *x = dout + (size_t)(i0 + r) * a->qs, *y = out + (size_t)(i0 + r) * a->qs;
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int d = 0; d < a->D; d++) acc += x[d] * y[d];
        delta[r] = acc;
    }
}

/* Key block [j0, j0+nj) of kv head slice (k, v, dk, dv) against every query
 * block of the G heads reading it: dK_j, dV_j += (and dQ += when dq is not
 * NULL: only when this thread owns all of the (b, kv head) slice). q, dq,
 * dout, out at head kh*G of batch row b; lse at (b, kh*G). */
static void att_bwd_keys(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                         const float *q, const float *k, const float *v, const int32_t *doc, int j0, int nj,
                         const att_dims *a) {
    float s[ATT_BR * ATT_BC], dp[ATT_BR * ATT_BC], delta[ATT_BR];
    int D = a->D;
    for (int g = 0; g < a->G; g++) {
        size_t ho = (size_t)g * D;
        const float *lg = lse + (size_t)g * a->T;
        for (int b0 = j0 / ATT_BR * ATT_BR; b0 < a->T; b0 += ATT_BR) {
            int r0, r1;
            if (!att_rows_seeing(doc, b0, a->T - b0 < ATT_BR ? a->T - b0 : ATT_BR, j0, nj, 0, &r0, &r1)) continue;
            int i0 = b0 + r0, mi = r1 - r0; /* the query rows that see this key block */
            att_delta(delta, dout + ho, out + ho, i0, mi, a);
            att_bwd_pair(s, dp, q + ho, k, v, dout + ho, lg, delta, doc, i0, mi, j0, nj, a);
            /* dV_j (nj, D) += P^T (nj, mi) dO_i (mi, D) */
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nj, D, mi, 1.0f, s, ATT_BC,
                        dout + ho + (size_t)i0 * a->qs, (int)a->qs, 1.0f, dv + (size_t)j0 * a->ks, (int)a->ks);
            /* dK_j (nj, D) += dS^T (nj, mi) Q_i (mi, D) */
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, nj, D, mi, 1.0f, dp, ATT_BC,
                        q + ho + (size_t)i0 * a->qs, (int)a->qs, 1.0f, dk + (size_t)j0 * a->ks, (int)a->ks);
            /* dQ_i (mi, D) += dS (mi, nj) K_j (nj, D) */
            if (dq)
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, mi, D, nj, 1.0f, dp, ATT_BC,
                            k + (size_t)j0 * a->ks, (int)a->ks, 1.0f, dq + ho + (size_t)i0 * a->qs, (int)a->qs);
        }
    }
}

/* Query block [i0, i0+mi) of one head against the keys it sees: dQ_i +=. */
static void att_bwd_queries(float *dq, const float *dout, const float *out, const float *lse, const float *q,
                            const float *k, const float *v, const int32_t *doc, int i0, int mi, const att_dims *a) {
    float s[ATT_BR * ATT_BC], dp[ATT_BR * ATT_BC], delta[ATT_BR];
    int dlo, dhi;
    doc_range(doc, i0, i0 + mi, &dlo, &dhi);
    att_delta(delta, dout, out, i0, mi, a);
    for (int j0 = dlo / ATT_BC * ATT_BC; j0 < i0 + mi; j0 += ATT_BC) {
        int nj = a->T - j0 < ATT_BC ? a->T - j0 : ATT_BC, r0, r1;
        if (!att_rows_seeing(doc, i0, mi, j0, nj, 0, &r0, &r1)) continue;
        att_bwd_pair(s, dp, q, k, v, dout, lse, delta + r0, doc, i0 + r0, r1 - r0, j0, nj, a);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r1 - r0, a->D, nj, 1.0f, dp, ATT_BC,
                    k + (size_t)j0 * a->ks, (int)a->ks, 1.0f, dq + (size_t)(i0 + r0) * a->qs, (int)a->qs);
    }
}

void op_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                           const float *q, const float *k, const float *v, const int32_t *doc_start, int B, int T,
                           int H, int KV, int D) {
    op_blas_init();
    att_dims a = att_dims_of(T, H, KV, D, 0);
    int G = a.G, NB = (T + ATT_BC - 1) / ATT_BC;
    if (B * KV >= omp_get_max_threads()) {
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
        for (int b = 0; b < B; b++)
            for (int kh = 0; kh < KV; kh++) {
                size_t qo = (size_t)b * T * a.qs + (size_t)kh * G * D, ko = (size_t)b * T * a.ks + (size_t)kh * D;
                for (int j0 = 0; j0 < T; j0 += ATT_BC)
                    att_bwd_keys(dq + qo, dk + ko, dv + ko, dout + qo, out + qo, lse + ((size_t)b * H + kh * G) * T,
                                 q + qo, k + ko, v + ko, doc_start ? doc_start + (size_t)b * T : NULL, j0,
                                 T - j0 < ATT_BC ? T - j0 : ATT_BC, &a);
            }
        return;
    }
#pragma omp parallel
    {
        /* pass 1: dK, dV by key block; the first key blocks see the most
         * queries. Pass 2 writes only dQ and both only read the inputs, so a
         * thread done with pass 1 moves on without waiting (nowait). */
#pragma omp for collapse(3) schedule(dynamic, 1) nowait
        for (int b = 0; b < B; b++)
            for (int kh = 0; kh < KV; kh++)
                for (int jb = 0; jb < NB; jb++) {
                    size_t qo = (size_t)b * T * a.qs + (size_t)kh * G * D, ko = (size_t)b * T * a.ks + (size_t)kh * D;
                    int j0 = jb * ATT_BC;
                    att_bwd_keys(NULL, dk + ko, dv + ko, dout + qo, out + qo, lse + ((size_t)b * H + kh * G) * T,
                                 q + qo, k + ko, v + ko, doc_start ? doc_start + (size_t)b * T : NULL, j0,
                                 T - j0 < ATT_BC ? T - j0 : ATT_BC, &a);
                }
        /* pass 2: dQ by query block; the last query blocks see the most keys */
#pragma omp for collapse(3) schedule(dynamic, 1)
        for (int b = 0; b < B; b++)
            for (int h = 0; h < H; h++)
                for (int ib = NB - 1; ib >= 0; ib--) {
                    size_t qo = (size_t)b * T * a.qs + (size_t)h * D, ko = (size_t)b * T * a.ks + (size_t)(h / G) * D;
                    int i0 = ib * ATT_BR;
                    att_bwd_queries(dq + qo, dout + qo, out + qo, lse + ((size_t)b * H + h) * T, q + qo, k + ko,
                                    v + ko, doc_start ? doc_start + (size_t)b * T : NULL, i0,
                                    T - i0 < ATT_BR ? T - i0 : ATT_BR, &a);
                }
    }
}
