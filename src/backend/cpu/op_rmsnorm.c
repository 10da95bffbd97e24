/* RMSNorm as HF's Qwen2RMSNorm computes it in fp32:
 *   out = w * x * rstd,  rstd = 1 / sqrt(mean(x^2) + eps).
 * Backward (per row, g = w * dout):
 *   dx = rstd * g - rstd^3 / C * x * sum(g * x),   dw += dout * x * rstd. */
#include "backend/cpu/ops.h"

#include <math.h>

static void rmsnorm_row(float *o, float *rstd, const float *x, const float *weight, int C, float eps) {
    float ss = 0.0f;
    for (int c = 0; c < C; c++) ss += x[c] * x[c];
    float r = 1.0f / sqrtf(ss / (float)C + eps);
    for (int c = 0; c < C; c++) o[c] = weight[c] * (x[c] * r);
    *rstd = r;
}

void op_rmsnorm_forward(float *out, float *rstd, const float *inp, const float *weight, int N, int C, float eps) {
    /* a decode step's few rows run on the calling thread, outside any region: waking the team would cost more
     * than the rows, and even a region of one thread (an if clause that is false) costs 1.2-1.5 us, 2.3-2.8
     * inside a held team's region (docs/performance.md) */
    if ((size_t)N * (size_t)C < 32768) {
        for (int n = 0; n < N; n++)
            rmsnorm_row(out + (size_t)n * C, rstd + n, inp + (size_t)n * C, weight, C, eps);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) rmsnorm_row(out + (size_t)n * C, rstd + n, inp + (size_t)n * C, weight, C, eps);
}

void op_rmsnorm_backward(float *dinp, float *dweight, const float *dout, const float *inp, const float *weight,
                         const float *rstd, int N, int C) {
    const int par = (size_t)N * (size_t)C >= OP_SERIAL_ELEMS; /* ops.h: a tiny shape's rows on one thread */
#pragma omp parallel for schedule(static) if (par)
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C, *g = dout + (size_t)n * C;
        float *dx = dinp + (size_t)n * C;
        float r = rstd[n], dot = 0.0f;
        for (int c = 0; c < C; c++) dot += weight[c] * g[c] * x[c];
        float k = r * r * r * dot / (float)C;
        for (int c = 0; c < C; c++) dx[c] += r * weight[c] * g[c] - k * x[c];
    }
    if (!dweight) return;
    /* the weight gradient reduces over rows: parallel over columns instead */
#pragma omp parallel for schedule(static) if (par)
    for (int c = 0; c < C; c++) {
        float acc = 0.0f;
        for (int n = 0; n < N; n++) acc += dout[(size_t)n * C + c] * inp[(size_t)n * C + c] * rstd[n];
        dweight[c] += acc;
    }
}
