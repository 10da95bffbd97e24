/* Causal grouped-query attention, computed blockwise as FlashAttention does:
 * for each query row the keys are visited in blocks of ATT_BLOCK, keeping a
 * running max m, a running sum l and an unnormalised output accumulator, so
 * no T x T score matrix is ever held. The forward saves lse = m + log(l) per
 * (b, h, t); the backward recomputes p = exp(s - lse) from it.
 *
 * Query head h reads kv head h / (H / KV) (GQA). Query t of row b attends to
 * keys [doc_start[b*T+t], t]: packed examples never see each other. */
#include "backend/cpu/ops.h"
#include "backend/cpu/op_simd.h"

#include <float.h>
#include <math.h>
#include <string.h>

#define ATT_BLOCK 64
#define ATT_MAX_D 1024

/* One query row against keys [j0, j1] (inclusive) of k/v with row stride ks. */
static float attn_row(float *o, const float *qv, const float *k, const float *v, size_t ks, int j0, int j1, int D,
                      float scale) {
    float acc[ATT_MAX_D];
    float s[ATT_BLOCK];
    float m = -FLT_MAX, l = 0.0f;
    for (int d = 0; d < D; d++) acc[d] = 0.0f;
    for (int b0 = j0; b0 <= j1; b0 += ATT_BLOCK) {
        int b1 = b0 + ATT_BLOCK - 1 < j1 ? b0 + ATT_BLOCK - 1 : j1;
        float bm = -FLT_MAX;
        for (int j = b0; j <= b1; j++) {
            const float *kj = k + (size_t)j * ks;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < D; d++) dot += qv[d] * kj[d];
            s[j - b0] = dot * scale;
            if (s[j - b0] > bm) bm = s[j - b0];
        }
        float mn = bm > m ? bm : m;
        float corr = expf(m - mn);
        l *= corr;
        for (int d = 0; d < D; d++) acc[d] *= corr;
        l += (float)op_row_exp(s, b1 - b0 + 1, mn, 1.0f);
        for (int j = b0; j <= b1; j++) {
            float p = s[j - b0];
            const float *vj = v + (size_t)j * ks;
            for (int d = 0; d < D; d++) acc[d] += p * vj[d];
        }
        m = mn;
    }
    float inv = 1.0f / l;
    for (int d = 0; d < D; d++) o[d] = acc[d] * inv;
    return m + logf(l);
}

void op_attention_forward(float *out, float *lse, const float *q, const float *k, const float *v,
                          const int32_t *doc_start, int B, int T, int H, int KV, int D) {
    int G = H / KV;
    float scale = 1.0f / sqrtf((float)D);
    size_t ks = (size_t)KV * D;
#pragma omp parallel for collapse(3) schedule(dynamic, 16)
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) {
                size_t row = (size_t)b * T + t;
                int j0 = doc_start ? doc_start[row] : 0;
                const float *kb = k + (size_t)b * T * ks + (size_t)(h / G) * D;
                const float *vb = v + (size_t)b * T * ks + (size_t)(h / G) * D;
                lse[((size_t)b * H + h) * T + t] =
                    attn_row(out + (row * H + h) * D, q + (row * H + h) * D, kb, vb, ks, j0, t, D, scale);
            }
}

void op_attention_forward_cached(float *out, const float *q, const float *kc, const float *vc, int n, int pos0,
                                 int H, int KV, int D) {
    int G = H / KV;
    float scale = 1.0f / sqrtf((float)D);
    size_t ks = (size_t)KV * D;
#pragma omp parallel for collapse(2) schedule(static)
    for (int i = 0; i < n; i++)
        for (int h = 0; h < H; h++) {
            const float *kb = kc + (size_t)(h / G) * D, *vb = vc + (size_t)(h / G) * D;
            attn_row(out + ((size_t)i * H + h) * D, q + ((size_t)i * H + h) * D, kb, vb, ks, 0, pos0 + i, D, scale);
        }
}

/* Backward, per row t of head h:
 *   p_j = exp(s_j - lse_t),  dp_j = dO_t . v_j,  delta_t = dO_t . O_t,
 *   ds_j = p_j (dp_j - delta_t),
 *   dq_t += scale * sum_j ds_j k_j,  dk_j += scale * ds_j q_t,  dv_j += p_j dO_t.
 * Work is split by (b, kv head), so the dk/dv rows a thread adds into belong
 * to it alone: no atomics. */
void op_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                           const float *q, const float *k, const float *v, const int32_t *doc_start, int B, int T,
                           int H, int KV, int D) {
    int G = H / KV;
    float scale = 1.0f / sqrtf((float)D);
    size_t ks = (size_t)KV * D, qs = (size_t)H * D;
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int b = 0; b < B; b++)
        for (int kh = 0; kh < KV; kh++) {
            size_t koff = (size_t)b * T * ks + (size_t)kh * D;
            for (int h = kh * G; h < (kh + 1) * G; h++)
                for (int t = 0; t < T; t++) {
                    size_t row = (size_t)b * T + t;
                    const float *qt = q + row * qs + (size_t)h * D, *dot_ = dout + row * qs + (size_t)h * D;
                    const float *ot = out + row * qs + (size_t)h * D;
                    float *dqt = dq + row * qs + (size_t)h * D;
                    float L = lse[((size_t)b * H + h) * T + t];
                    float delta = 0.0f;
#pragma omp simd reduction(+ : delta)
                    for (int d = 0; d < D; d++) delta += dot_[d] * ot[d];
                    int j0 = doc_start ? doc_start[row] : 0;
                    /* keys in blocks: scores and dO.v first, then one vector exp per block */
                    float sb[ATT_BLOCK], dpb[ATT_BLOCK];
                    for (int b0 = j0; b0 <= t; b0 += ATT_BLOCK) {
                        int nb = t - b0 + 1 < ATT_BLOCK ? t - b0 + 1 : ATT_BLOCK;
                        for (int i = 0; i < nb; i++) {
                            const float *kj = k + koff + (size_t)(b0 + i) * ks, *vj = v + koff + (size_t)(b0 + i) * ks;
                            float s = 0.0f, dp = 0.0f;
#pragma omp simd reduction(+ : s, dp)
                            for (int d = 0; d < D; d++) {
                                s += qt[d] * kj[d];
                                dp += dot_[d] * vj[d];
                            }
                            sb[i] = s * scale;
                            dpb[i] = dp;
                        }
                        op_row_exp(sb, nb, L, 1.0f); /* sb = p */
                        for (int i = 0; i < nb; i++) {
                            size_t jo = koff + (size_t)(b0 + i) * ks;
                            const float *kj = k + jo;
                            float *dkj = dk + jo, *dvj = dv + jo;
                            float p = sb[i], ds = p * (dpb[i] - delta) * scale;
#pragma omp simd
                            for (int d = 0; d < D; d++) {
                                dqt[d] += ds * kj[d];
                                dkj[d] += ds * qt[d];
                                dvj[d] += p * dot_[d];
                            }
                        }
                    }
                }
        }
}
