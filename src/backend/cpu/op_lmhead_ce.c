/* The lm_head matmul fused with softmax cross-entropy, walked over chunks of
 * OP_CE_CHUNK vocabulary rows so the (N, V) logits never exist at once (for
 * Qwen's V = 151936 they would be 600 KB per token). Forward keeps a running
 * max and sum per row (online log-sum-exp) and picks out the target's logit;
 * backward recomputes each chunk's logits, turns them into
 *   dlogits = dscale * (softmax - onehot(target))
 * in place, and accumulates dx += dlogits @ Wc and dW[chunk] += dlogits^T @ x.
 * Rows whose target is -100 carry no loss and no gradient. */
#include "backend/cpu/ops.h"

#include <cblas.h>
#include <float.h>
#include <math.h>

#include "data/batch.h"

size_t op_lmhead_ce_ws_floats(int N, int C) {
    return (size_t)N * OP_CE_CHUNK + (size_t)OP_CE_CHUNK * C + 4 * (size_t)N;
}

/* logits (N, cv) = x @ W[v0:v0+cv]^T; returns the f32 weight rows used. */
static const float *chunk_logits(float *logits, float *wbuf, const float *x, const void *w, qt_dtype wdt, int v0,
                                 int cv, int N, int C) {
    const float *wc;
    if (wdt == QT_F32) {
        wc = (const float *)w + (size_t)v0 * C;
    } else {
        op_convert_rows(wbuf, w, wdt, (size_t)v0, (size_t)v0 + cv, (size_t)C);
        wc = wbuf;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, cv, C, 1.0f, x, C, wc, C, 0.0f, logits, cv);
    return wc;
}

void op_lmhead_ce_forward(float *loss, float *lse, const float *x, const void *w, qt_dtype wdt,
                          const int32_t *targets, int N, int C, int V, float *ws) {
    float *logits = ws, *wbuf = ws + (size_t)N * OP_CE_CHUNK;
    /* the doubles first: N * CHUNK + CHUNK * C is even, so they stay 8-byte aligned */
    double *sum = (double *)(wbuf + (size_t)OP_CE_CHUNK * C);
    float *mx = (float *)(sum + N), *tl = mx + N;
    for (int n = 0; n < N; n++) {
        mx[n] = -FLT_MAX;
        sum[n] = 0.0;
        tl[n] = 0.0f;
    }
    for (int v0 = 0; v0 < V; v0 += OP_CE_CHUNK) {
        int cv = V - v0 < OP_CE_CHUNK ? V - v0 : OP_CE_CHUNK;
        chunk_logits(logits, wbuf, x, w, wdt, v0, cv, N, C);
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) {
            const float *l = logits + (size_t)n * cv;
            float m = mx[n];
            for (int j = 0; j < cv; j++) m = l[j] > m ? l[j] : m;
            double s = sum[n] * exp((double)mx[n] - (double)m);
            for (int j = 0; j < cv; j++) s += expf(l[j] - m);
            mx[n] = m;
            sum[n] = s;
            int t = targets[n];
            if (t >= v0 && t < v0 + cv) tl[n] = l[t - v0];
        }
    }
    for (int n = 0; n < N; n++) {
        lse[n] = mx[n] + (float)log(sum[n]);
        loss[n] = targets[n] == QT_IGNORE_INDEX ? 0.0f : lse[n] - tl[n];
    }
}

void op_lmhead_ce_backward(float *dx, float *dw, const float *x, const void *w, qt_dtype wdt, const int32_t *targets,
                           const float *lse, float dscale, int N, int C, int V, float *ws) {
    float *logits = ws, *wbuf = ws + (size_t)N * OP_CE_CHUNK;
    for (int v0 = 0; v0 < V; v0 += OP_CE_CHUNK) {
        int cv = V - v0 < OP_CE_CHUNK ? V - v0 : OP_CE_CHUNK;
        const float *wc = chunk_logits(logits, wbuf, x, w, wdt, v0, cv, N, C);
#pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++) {
            float *l = logits + (size_t)n * cv;
            int t = targets[n];
            if (t == QT_IGNORE_INDEX) {
                for (int j = 0; j < cv; j++) l[j] = 0.0f;
                continue;
            }
            for (int j = 0; j < cv; j++) l[j] = dscale * expf(l[j] - lse[n]);
            if (t >= v0 && t < v0 + cv) l[t - v0] -= dscale;
        }
        if (dx)
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, cv, 1.0f, logits, cv, wc, C, 1.0f, dx, C);
        if (dw)
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, cv, C, N, 1.0f, logits, cv, x, C, 1.0f,
                        dw + (size_t)v0 * C, C);
    }
}
