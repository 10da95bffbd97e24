/* The lm_head matmul fused with softmax cross-entropy, walked over chunks of
 * OP_CE_CHUNK vocabulary rows so the (N, V) logits never exist at once (for
 * Qwen's V = 151936 they would be 600 KB per token). Forward keeps a running
 * max and sum per row (online log-sum-exp) and picks out the target's logit;
 * backward recomputes each chunk's logits, turns them into
 *   dlogits = dscale * (softmax - onehot(target))
 * in place, and accumulates dx += dlogits @ Wc and dW[chunk] += dlogits^T @ x.
 * Rows whose target is QT_IGNORE_INDEX carry no loss and no gradient.
 *
 * A trainable lm_head whose logits fit the plan (full fine-tuning, see
 * qt_model_keeps_logits) keeps them instead: forward_keep writes each chunk's
 * exp(l - m) to a (N, V) buffer, backward_kept scales it to dlogits in place
 * and runs only the dx and dW products (3 (N, V, C) products a step, not 4).
 *
 * Threading as in op_matmul.c: one OpenMP region per chunk; each thread
 * converts and multiplies its own slice of the chunk with a single-threaded
 * sgemm, then the rows are shared out for the softmax. */
#include "backend/cpu/ops.h"
#include "backend/cpu/op_simd.h"

#include <cblas.h>
#include <float.h>
#include <math.h>
#include <omp.h>
#include <string.h>

#include "backend/cpu/op_dnnl.h"
#include "core/error.h"

size_t op_lmhead_ce_ws_floats(int N, int C) {
    /* logits chunk, weight chunk, sum (double) / max / target logit, and for
     * the fused forward + dx: the dx accumulator (N, C) and the rescale (N) */
    return (size_t)N * OP_CE_CHUNK + (size_t)OP_CE_CHUNK * C + 4 * (size_t)N + (size_t)N * C + (size_t)N;
}

/* Inside a parallel region: the chunk's f32 weight rows W[v0:v0+cv], the
 * table itself in f32, else converted into wbuf, each thread its slice
 * [*a, *b) of the rows (complete for all threads after the next barrier). */
static const float *chunk_weights(float *wbuf, const void *w, qt_dtype wdt, int v0, int cv, int C, int *a, int *b) {
    op_split(cv, omp_get_num_threads(), omp_get_thread_num(), 16, a, b);
    if (wdt == QT_F32) return (const float *)w + (size_t)v0 * C;
    if (*b > *a) op_convert_rows_serial(wbuf + (size_t)*a * C, w, wdt, (size_t)(v0 + *a), (size_t)(v0 + *b), (size_t)C);
    return wbuf;
}

/* Inside a parallel region: this thread's slice of the chunk's logits
 * (N, cv) = x @ W[v0:v0+cv]^T. Returns the chunk's f32 weight rows. */
static const float *chunk_logits(float *logits, float *wbuf, const float *x, const void *w, qt_dtype wdt, int v0,
                                 int cv, int N, int C) {
    int a, b;
    const float *wc = chunk_weights(wbuf, w, wdt, v0, cv, C, &a, &b);
    if (b > a)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, b - a, C, 1.0f, x, C, wc + (size_t)a * C, C, 0.0f,
                    logits + a, cv);
#pragma omp barrier
    return wc;
}

/* chunk_logits with x also as bf16 (x16) and a bf16 table: each thread's
 * slice on oneDNN's bf16 GEMM (single-threaded inside the region), or where
 * that is refused, on sgemm over the converted rows as chunk_logits does.
 * keep_rows: the chunk's rows are wanted in f32 in wbuf afterwards (forward_dx's
 * dx product), so each thread converts its slice whichever GEMM runs. Returns
 * wbuf (its rows valid after the barrier where keep_rows). */
static const float *chunk_logits16(float *logits, float *wbuf, const float *x, const uint16_t *x16, const void *w,
                                   int v0, int cv, int N, int C, int keep_rows) {
    int a, b;
    op_split(cv, omp_get_num_threads(), omp_get_thread_num(), 16, &a, &b);
    const int rows = b > a && keep_rows;
    if (rows) op_convert_rows_serial(wbuf + (size_t)a * C, w, QT_BF16, (size_t)(v0 + a), (size_t)(v0 + b), (size_t)C);
    if (b > a && op_dnnl_bf16_gemm_ld(logits + a, cv, x16, C, 0, (const uint16_t *)w + (size_t)(v0 + a) * C, C, 1,
                                      NULL, N, b - a, C, 1.0f, 0) != QT_OK) {
        if (!rows)
            op_convert_rows_serial(wbuf + (size_t)a * C, w, QT_BF16, (size_t)(v0 + a), (size_t)(v0 + b), (size_t)C);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, b - a, C, 1.0f, x, C, wbuf + (size_t)a * C, C, 0.0f,
                    logits + a, cv);
    }
#pragma omp barrier
    return wbuf;
}

/* The per-row running statistics of a forward walk, after the logits and
 * weight chunks in ws (the doubles first: N * CHUNK + CHUNK * C is even, so
 * they stay 8-byte aligned), reset: sum 0, max -FLT_MAX, target logit 0.
 * Returns the float after them. */
static float *ce_stats(float *ws, int N, int C, double **sum, float **mx, float **tl) {
    *sum = (double *)(ws + (size_t)N * OP_CE_CHUNK + (size_t)OP_CE_CHUNK * C);
    *mx = (float *)(*sum + N), *tl = *mx + N;
    for (int n = 0; n < N; n++) {
        (*mx)[n] = -FLT_MAX;
        (*sum)[n] = 0.0;
        (*tl)[n] = 0.0f;
    }
    return *tl + N;
}

size_t op_lmhead_ce_kept_floats(int N, int V) {
    size_t chunks = ((size_t)V + OP_CE_CHUNK - 1) / OP_CE_CHUNK;
    return (size_t)N * (size_t)V + (size_t)N * chunks;
}

/* kept == NULL: the chunk's logits go to the workspace and are dropped;
 * else to kept's block for the chunk, as exp(l - m), with m in kept's maxima. */
static void ce_forward(float *loss, float *lse, float *kept, const float *x, const void *w, qt_dtype wdt,
                       const int32_t *targets, int N, int C, int V, float *ws) {
    op_blas_init();
    float *logits = ws, *wbuf = ws + (size_t)N * OP_CE_CHUNK, *mx, *tl;
    double *sum;
    /* a bf16 table and a bf16-exact x (bf16 training's keep(), inference's rounding): the logits on the bf16
     * GEMM, x as bf16 in the (N, C) floats after the statistics that only the fused dx form uses */
    uint16_t *x16 = (uint16_t *)ce_stats(ws, N, C, &sum, &mx, &tl);
    if (wdt != QT_BF16 || !op_bf16_operand(x, (size_t)N * C, x16)) x16 = NULL;
#pragma omp parallel
    for (int v0 = 0; v0 < V; v0 += OP_CE_CHUNK) {
        int cv = V - v0 < OP_CE_CHUNK ? V - v0 : OP_CE_CHUNK;
        float *lc = kept ? kept + (size_t)N * v0 : logits;
        float *mc = kept ? kept + (size_t)N * V + (size_t)N * (size_t)(v0 / OP_CE_CHUNK) : NULL;
        if (x16) chunk_logits16(lc, wbuf, x, x16, w, v0, cv, N, C, 0);
        else chunk_logits(lc, wbuf, x, w, wdt, v0, cv, N, C);
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            float *l = lc + (size_t)n * cv;
            float m = op_row_max(l, cv, mx[n]);
            int t = targets[n];
            if (t >= v0 && t < v0 + cv) tl[n] = l[t - v0];
            sum[n] = sum[n] * exp((double)mx[n] - (double)m) + op_row_exp(l, cv, m, 1.0f); /* l = exp(l - m) */
            mx[n] = m;
            if (mc) mc[n] = m;
        } /* implicit barrier: the next chunk may overwrite logits */
    }
    for (int n = 0; n < N; n++) {
        lse[n] = mx[n] + (float)log(sum[n]);
        loss[n] = targets[n] == QT_IGNORE_INDEX ? 0.0f : lse[n] - tl[n];
    }
}

void op_lmhead_ce_forward(float *loss, float *lse, const float *x, const void *w, qt_dtype wdt,
                          const int32_t *targets, int N, int C, int V, float *ws) {
    ce_forward(loss, lse, NULL, x, w, wdt, targets, N, C, V, ws);
}

void op_lmhead_ce_forward_keep(float *loss, float *lse, float *kept, const float *x, const void *w, qt_dtype wdt,
                               const int32_t *targets, int N, int C, int V, float *ws) {
    ce_forward(loss, lse, kept, x, w, wdt, targets, N, C, V, ws);
}

/* Inside a parallel region: dx += dl @ Wc on this thread's columns of dx,
 * dw[chunk] += dl^T @ x on its rows of the chunk. */
static void chunk_grads(float *dx, float *dw, const float *dl, const float *wc, const float *x, int v0, int cv, int N,
                        int C) {
    int nt = omp_get_num_threads(), id = omp_get_thread_num(), a, b;
    if (dx) {
        op_split(C, nt, id, 16, &a, &b);
        if (b > a)
            op_sgemm_nn(N, b - a, cv, 1.0f, dl, cv, wc + a, C, 1.0f, dx + a, C);
    }
    if (dw) {
        op_split(cv, nt, id, 16, &a, &b);
        if (b > a) /* OpenBLAS, not op_sgemm_tn: oneDNN ran this shape at 60% of OpenBLAS's rate */
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, b - a, C, N, 1.0f, dl + a, cv, x, C, 1.0f,
                        dw + (size_t)(v0 + a) * C, C);
    }
}

void op_lmhead_ce_backward_kept(float *dx, float *dw, float *kept, const float *x, const void *w, qt_dtype wdt,
                                const int32_t *targets, const float *lse, float dscale, int N, int C, int V,
                                float *ws) {
    op_blas_init();
    float *wbuf = ws + (size_t)N * OP_CE_CHUNK;
#pragma omp parallel
    for (int v0 = 0; v0 < V; v0 += OP_CE_CHUNK) {
        int cv = V - v0 < OP_CE_CHUNK ? V - v0 : OP_CE_CHUNK;
        float *lc = kept + (size_t)N * v0;
        const float *mc = kept + (size_t)N * V + (size_t)N * (size_t)(v0 / OP_CE_CHUNK);
        int a, b;
        const float *wc = chunk_weights(wbuf, w, wdt, v0, cv, C, &a, &b); /* the barrier below completes it */
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            float *l = lc + (size_t)n * cv;
            int t = targets[n];
            if (t == QT_IGNORE_INDEX) {
                memset(l, 0, sizeof(float) * (size_t)cv);
                continue;
            }
            /* exp(l - m) * dscale * exp(m - lse) = dscale * softmax */
            float s = dscale * (float)exp((double)mc[n] - (double)lse[n]);
            for (int j = 0; j < cv; j++) l[j] *= s;
            if (t >= v0 && t < v0 + cv) l[t - v0] -= dscale;
        } /* implicit barrier: dlogits (and the converted chunk) complete */
        chunk_grads(dx, dw, lc, wc, x, v0, cv, N, C);
#pragma omp barrier /* the next chunk overwrites wbuf */
    }
}

void op_lmhead_ce_backward(float *dx, float *dw, const float *x, const void *w, qt_dtype wdt, const int32_t *targets,
                           const float *lse, float dscale, int N, int C, int V, float *ws) {
    op_blas_init();
    float *logits = ws, *wbuf = ws + (size_t)N * OP_CE_CHUNK;
#pragma omp parallel
    for (int v0 = 0; v0 < V; v0 += OP_CE_CHUNK) {
        int cv = V - v0 < OP_CE_CHUNK ? V - v0 : OP_CE_CHUNK;
        const float *wc = chunk_logits(logits, wbuf, x, w, wdt, v0, cv, N, C);
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            float *l = logits + (size_t)n * cv;
            int t = targets[n];
            if (t == QT_IGNORE_INDEX) {
                for (int j = 0; j < cv; j++) l[j] = 0.0f;
                continue;
            }
            op_row_exp(l, cv, lse[n], dscale);
            if (t >= v0 && t < v0 + cv) l[t - v0] -= dscale;
        } /* implicit barrier: dlogits complete */
        chunk_grads(dx, dw, logits, wc, x, v0, cv, N, C);
#pragma omp barrier /* the next chunk overwrites logits and wbuf */
    }
}

/* Forward and dx in one walk over the vocabulary (frozen lm_head: LoRA, eval
 * of gradients w.r.t. x only). With a running max m and sum s per row,
 *   acc = sum_j exp(l_j - m) W_j
 * is rescaled by exp(m_old - m_new) whenever the max grows, like the output
 * of blockwise attention; at the end
 *   dx += dscale * (acc / s - W_target).
 * Per chunk: one sgemm for the logits and one for acc += p @ Wc, so a LoRA
 * step runs the (N, V) product twice instead of three times. */
void op_lmhead_ce_forward_dx(float *loss, float *lse, float *dx, const float *x, const void *w, qt_dtype wdt,
                             const int32_t *targets, float dscale, int N, int C, int V, float *ws) {
    op_blas_init();
    float *logits = ws, *wbuf = ws + (size_t)N * OP_CE_CHUNK, *mx, *tl;
    double *sum;
    float *acc = ce_stats(ws, N, C, &sum, &mx, &tl), *corr = acc + (size_t)N * C;
    memset(acc, 0, sizeof(float) * (size_t)N * C);
    /* A bf16 table and a bf16-exact x (bf16 LoRA training's rounded final norm): the logits on the bf16 GEMM, as
     * ce_forward does; the dx product stays fp32 (p is not bf16) and still needs the chunk's rows in f32. x as
     * bf16 takes the first rows (16 at a time) of the weight chunk's floats, which then holds that many fewer
     * vocabulary rows; where fewer than 512 would be left (N above ~3000), the fp32 path. */
    int chunk = OP_CE_CHUNK;
    uint16_t *x16 = NULL;
    const int x16_rows = ((N + 1) / 2 + 15) / 16 * 16; /* N * C bf16 values = N / 2 rows of C floats */
    if (wdt == QT_BF16 && OP_CE_CHUNK - x16_rows >= 512 && op_bf16_operand(x, (size_t)N * C, (uint16_t *)wbuf)) {
        x16 = (uint16_t *)wbuf;
        wbuf += (size_t)x16_rows * C;
        chunk = OP_CE_CHUNK - x16_rows;
    }
#pragma omp parallel
    {
        int nt = omp_get_num_threads(), id = omp_get_thread_num(), a, b;
        op_split(C, nt, id, 16, &a, &b);
        for (int v0 = 0; v0 < V; v0 += chunk) {
            int cv = V - v0 < chunk ? V - v0 : chunk;
            const float *wc = x16 ? chunk_logits16(logits, wbuf, x, x16, w, v0, cv, N, C, 1)
                                  : chunk_logits(logits, wbuf, x, w, wdt, v0, cv, N, C);
#pragma omp for schedule(static)
            for (int n = 0; n < N; n++) {
                float *l = logits + (size_t)n * cv;
                float m = op_row_max(l, cv, mx[n]);
                float c = expf(mx[n] - m); /* 0 on the first chunk */
                int t = targets[n];
                if (t >= v0 && t < v0 + cv) tl[n] = l[t - v0];
                sum[n] = sum[n] * (double)c + op_row_exp(l, cv, m, 1.0f);
                mx[n] = m;
                corr[n] = c;
                if (t == QT_IGNORE_INDEX) memset(l, 0, sizeof(float) * (size_t)cv);
            } /* implicit barrier: p and corr complete */
            if (b > a) {
                for (int n = 0; n < N; n++) {
                    float c = corr[n], *r = acc + (size_t)n * C;
                    if (c != 1.0f)
                        for (int i = a; i < b; i++) r[i] *= c;
                }
                op_sgemm_nn(N, b - a, cv, 1.0f, logits, cv, wc + a, C, 1.0f, acc + a, C);
            }
#pragma omp barrier /* the next chunk overwrites logits and wbuf */
        }
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            lse[n] = mx[n] + (float)log(sum[n]);
            int t = targets[n];
            loss[n] = t == QT_IGNORE_INDEX ? 0.0f : lse[n] - tl[n];
            if (t == QT_IGNORE_INDEX) continue;
            float *row = wbuf + (size_t)id * C; /* the weight chunk is free now (team <= its rows) */
            qt_convert_to_f32(row, (const char *)w + (size_t)t * C * qt_dtype_size(wdt), wdt, (size_t)C);
            float inv = (float)(1.0 / sum[n]);
            const float *r = acc + (size_t)n * C;
            float *d = dx + (size_t)n * C;
            for (int i = 0; i < C; i++) d[i] += dscale * (r[i] * inv - row[i]);
        }
    }
}
