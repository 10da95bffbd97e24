/* Matmul with bias, out (N, OUT) = inp (N, IN) @ W^T + bias, W (OUT, IN) as
 * nn.Linear stores it. Most of a step's time is spent here.
 *
 * Threading: OpenBLAS runs single-threaded (op_blas_init) and OpenMP splits
 * each product into independent blocks, one sgemm per thread. With OpenBLAS's
 * own pool and OpenMP's both spinning on the same cores, every switch between
 * a BLAS call and an OpenMP loop cost milliseconds (measured: a forward 1.8x
 * slower, 2.5x with bf16 weights); one pool avoids that.
 *
 * f16/bf16 and 4-bit weights (a frozen base kept in its file dtype, or
 * quantized: QT_Q4, dequantized here) are converted to f32
 * a panel of rows at a time into the workspace, each thread converting only
 * the rows (or, in the backward, the columns) it multiplies, so no fp32 copy
 * of the base is ever made.
 *
 * The input-gradient products (dout @ W, no operand transposed) go through
 * op_sgemm_nn and the weight gradients (dout^T @ inp) through op_sgemm_tn:
 * oneDNN's sgemm where it loads, which ran them faster than OpenBLAS on
 * AVX-512 (bench/RESULTS.md); the forward's products stay on OpenBLAS, which
 * was as fast or faster there. */
#include "backend/cpu/ops.h"

#include <cblas.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/op_dnnl.h"
#include "core/quant4.h"
#include "core/error.h"
#include "core/log.h"

/* The workspace holds up to 2M floats (8 MiB) of converted weights; each
 * thread gets at least 16 rows' worth, which caps the team for wide inputs. */
#define MATMUL_WS_FLOATS OP_MATMUL_WS_CAP
#define MATMUL_MIN_ROWS 16

/* Which library op_sgemm_nn / op_sgemm_tn use: -1 not chosen yet, 0 OpenBLAS, 1 oneDNN. */
static int use_onednn = -1;

void op_blas_init(void) {
    static int done;
    if (!done) openblas_set_num_threads(1), done = 1;
    if (use_onednn < 0) {
        const char *e = getenv("QTUNE_SGEMM");
        int want = 1;
        if (e && !strcmp(e, "openblas"))
            want = 0;
        else if (e && *e && strcmp(e, "auto") && strcmp(e, "onednn"))
            qt_warn("QTUNE_SGEMM=%s is not one of auto, onednn, openblas; using auto", e);
        use_onednn = want && op_dnnl_sgemm_available();
    }
}

void op_sgemm_use_onednn(int on) {
    op_blas_init();
    use_onednn = on && op_dnnl_sgemm_available();
}

int op_sgemm_onednn(void) {
    op_blas_init();
    return use_onednn;
}

/* Below these sizes (LoRA's rank-8 products, attention's 64-wide blocks)
 * OpenBLAS's small-matrix kernels are used either way. */
#define ONEDNN_MIN_DIM 128

/* op(A) @ B with op(A) = A (ta 0) or A^T (ta 1): on oneDNN when it is in use
 * and the product is wide enough (big), else, or if oneDNN refuses, OpenBLAS. */
static void sgemm_xn(int ta, int big, int M, int N, int K, float alpha, const float *A, int lda, const float *B,
                     int ldb, float beta, float *C, int ldc) {
    if (use_onednn > 0 && big &&
        op_dnnl_sgemm(ta ? 'T' : 'N', 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc) == QT_OK)
        return;
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, CblasNoTrans, M, N, K, alpha, A, lda, B, ldb, beta, C,
                ldc);
}

void op_sgemm_nn(int M, int N, int K, float alpha, const float *A, int lda, const float *B, int ldb, float beta,
                 float *C, int ldc) {
    sgemm_xn(0, N >= ONEDNN_MIN_DIM && K >= ONEDNN_MIN_DIM, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void op_sgemm_tn(int M, int N, int K, float alpha, const float *A, int lda, const float *B, int ldb, float beta,
                 float *C, int ldc) {
    sgemm_xn(1, M >= ONEDNN_MIN_DIM && N >= ONEDNN_MIN_DIM, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

size_t op_matmul_ws_floats(int IN, int OUT) {
    size_t full = (size_t)IN * (size_t)OUT, ws = full < MATMUL_WS_FLOATS ? full : MATMUL_WS_FLOATS;
    return ws > (size_t)IN ? ws : (size_t)IN;
}

/* Threads that may share the workspace of a converted (IN, OUT) weight. */
static int half_team(int IN, int OUT) {
    size_t t = op_matmul_ws_floats(IN, OUT) / ((size_t)MATMUL_MIN_ROWS * (size_t)IN);
    size_t mx = (size_t)omp_get_max_threads();
    return (int)(t < 1 ? 1 : t > mx ? mx : t);
}

void op_split(int n, int parts, int id, int align, int *a, int *b) {
    int per = (n + parts - 1) / parts;
    per = (per + align - 1) / align * align;
    *a = id * per < n ? id * per : n;
    *b = *a + per < n ? *a + per : n;
}

void op_matmul_forward(float *out, const float *inp, const void *w, qt_dtype wdt, const float *bias, int N, int IN,
                       int OUT, float alpha, int accumulate, float *ws) {
    op_blas_init();
    float beta = accumulate ? 1.0f : 0.0f;
    int team = wdt == QT_F32 ? omp_get_max_threads() : half_team(IN, OUT);
    size_t share = wdt == QT_F32 ? 0 : op_matmul_ws_floats(IN, OUT) / (size_t)team;
#pragma omp parallel num_threads(team)
    {
        int nt = omp_get_num_threads(), id = omp_get_thread_num(), o0, o1;
        op_split(OUT, nt, id, MATMUL_MIN_ROWS, &o0, &o1);
        if (o1 > o0 && wdt == QT_F32) {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, o1 - o0, IN, alpha, inp, IN,
                        (const float *)w + (size_t)o0 * IN, IN, beta, out + o0, OUT);
        } else if (o1 > o0) {
            float *my = ws + (size_t)id * share;
            int P = (int)(share / (size_t)IN);
            for (int o = o0; o < o1; o += P) {
                int p = o1 - o < P ? o1 - o : P;
                op_convert_rows_serial(my, w, wdt, (size_t)o, (size_t)(o + p), (size_t)IN);
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, p, IN, alpha, inp, IN, my, IN, beta, out + o,
                            OUT);
            }
        }
        if (bias)
            for (int n = 0; n < N; n++)
                for (int o = o0; o < o1; o++) out[(size_t)n * OUT + o] += bias[o];
    }
}

void op_matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp, const void *w,
                        qt_dtype wdt, int N, int IN, int OUT, float alpha, float *ws) {
    op_blas_init();
    if (dinp) {
        /* dinp (N, IN) += alpha * dout (N, OUT) @ W (OUT, IN): threads own column blocks of dinp */
        int team = wdt == QT_F32 ? omp_get_max_threads() : half_team(IN, OUT);
        size_t share = wdt == QT_F32 ? 0 : op_matmul_ws_floats(IN, OUT) / (size_t)team;
#pragma omp parallel num_threads(team)
        {
            int nt = omp_get_num_threads(), id = omp_get_thread_num(), i0, i1;
            op_split(IN, nt, id, MATMUL_MIN_ROWS, &i0, &i1);
            int ib = i1 - i0;
            if (ib > 0 && wdt == QT_F32) {
                op_sgemm_nn(N, ib, OUT, alpha, dout, OUT, (const float *)w + i0, IN, 1.0f, dinp + i0, IN);
            } else if (ib > 0) {
                float *my = ws + (size_t)id * share;
                int P = (int)(share / (size_t)ib);
                size_t es = qt_dtype_size(wdt);
                for (int o = 0; o < OUT; o += P) {
                    int p = OUT - o < P ? OUT - o : P;
                    for (int r = 0; r < p; r++) {
                        const size_t e = (size_t)(o + r) * IN + i0;
                        if (wdt == QT_Q4) qt_q4_dequantize(w, e, e + (size_t)ib, my + (size_t)r * ib);
                        else qt_convert_to_f32(my + (size_t)r * ib, (const char *)w + e * es, wdt, (size_t)ib);
                    }
                    op_sgemm_nn(N, ib, p, alpha, dout + o, OUT, my, ib, 1.0f, dinp + i0, IN);
                }
            }
        }
    }
    if (dweight || dbias) {
        /* dweight (OUT, IN) += alpha * dout^T @ inp; dbias += alpha * column sums: threads own rows of W */
#pragma omp parallel
        {
            int nt = omp_get_num_threads(), id = omp_get_thread_num(), o0, o1;
            op_split(OUT, nt, id, MATMUL_MIN_ROWS, &o0, &o1);
            if (o1 > o0 && dweight)
                op_sgemm_tn(o1 - o0, IN, N, alpha, dout + o0, OUT, inp, IN, 1.0f, dweight + (size_t)o0 * IN, IN);
            if (dbias)
                for (int o = o0; o < o1; o++) {
                    float acc = 0.0f;
                    for (int n = 0; n < N; n++) acc += dout[(size_t)n * OUT + o];
                    dbias[o] += alpha * acc;
                }
        }
    }
}
