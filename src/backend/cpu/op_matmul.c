/* Matmul with bias, out (N, OUT) = inp (N, IN) @ W^T + bias, W (OUT, IN) as
 * nn.Linear stores it. f32 weights go straight to sgemm; f16/bf16 weights
 * (a frozen base kept in its file dtype) are converted a panel of rows at a
 * time into the workspace, so sgemm always sees f32 and no full f32 copy of
 * the base is ever made. Most of a step's time is spent in these sgemm calls. */
#include "backend/cpu/ops.h"

#include <cblas.h>

/* Panels hold about 1M floats (4 MiB): big enough that sgemm runs near peak,
 * small enough to stay in L2/L3 with the activations. */
#define MATMUL_PANEL_FLOATS (1u << 20)

static int panel_rows(int IN, int OUT) {
    int p = (int)(MATMUL_PANEL_FLOATS / (unsigned)(IN > 0 ? IN : 1));
    if (p < 1) p = 1;
    return p < OUT ? p : OUT;
}

size_t op_matmul_ws_floats(int IN, int OUT) {
    size_t p = (size_t)panel_rows(IN, OUT);
    return p * (size_t)IN;
}

static void add_bias(float *out, const float *bias, int N, int OUT) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OUT; o++) out[(size_t)n * OUT + o] += bias[o];
}

void op_matmul_forward(float *out, const float *inp, const void *w, qt_dtype wdt, const float *bias, int N, int IN,
                       int OUT, float alpha, int accumulate, float *ws) {
    float beta = accumulate ? 1.0f : 0.0f;
    if (wdt == QT_F32) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OUT, IN, alpha, inp, IN, (const float *)w, IN, beta,
                    out, OUT);
    } else {
        int P = panel_rows(IN, OUT);
        for (int o0 = 0; o0 < OUT; o0 += P) {
            int p = OUT - o0 < P ? OUT - o0 : P;
            op_convert_rows(ws, w, wdt, (size_t)o0, (size_t)(o0 + p), (size_t)IN);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, p, IN, alpha, inp, IN, ws, IN, beta, out + o0,
                        OUT);
        }
    }
    if (bias) add_bias(out, bias, N, OUT);
}

void op_matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp, const void *w,
                        qt_dtype wdt, int N, int IN, int OUT, float alpha, float *ws) {
    if (dinp) {
        if (wdt == QT_F32) {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, IN, OUT, alpha, dout, OUT, (const float *)w, IN,
                        1.0f, dinp, IN);
        } else {
            int P = panel_rows(IN, OUT);
            for (int o0 = 0; o0 < OUT; o0 += P) {
                int p = OUT - o0 < P ? OUT - o0 : P;
                op_convert_rows(ws, w, wdt, (size_t)o0, (size_t)(o0 + p), (size_t)IN);
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, IN, p, alpha, dout + o0, OUT, ws, IN, 1.0f,
                            dinp, IN);
            }
        }
    }
    if (dweight)
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OUT, IN, N, alpha, dout, OUT, inp, IN, 1.0f, dweight, IN);
    if (dbias) {
#pragma omp parallel for schedule(static)
        for (int o = 0; o < OUT; o++) {
            float acc = 0.0f;
            for (int n = 0; n < N; n++) acc += dout[(size_t)n * OUT + o];
            dbias[o] += alpha * acc;
        }
    }
}
