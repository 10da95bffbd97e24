/* Token embedding: a row gather forward, a scatter-add backward. */
#include "backend/cpu/ops.h"
#include "core/quant4.h"

#include <string.h>

void op_embedding_forward(float *out, const int32_t *ids, const void *wte, qt_dtype wdt, int N, int C) {
    size_t es = qt_dtype_size(wdt);
    /* a decode step's few rows on the calling thread, outside any region (op_rmsnorm.c says why) */
    if ((size_t)N * (size_t)C < 65536) {
        for (int n = 0; n < N; n++)
            qt_convert_to_f32(out + (size_t)n * C, (const char *)wte + (size_t)ids[n] * C * es, wdt, (size_t)C);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
        qt_convert_to_f32(out + (size_t)n * C, (const char *)wte + (size_t)ids[n] * C * es, wdt, (size_t)C);
}

void op_embedding_backward(float *dwte, const float *dout, const int32_t *ids, int N, int C) {
    /* serial over rows: two rows may share a token id; the inner loop vectorises */
    for (int n = 0; n < N; n++) {
        float *d = dwte + (size_t)ids[n] * C;
        const float *g = dout + (size_t)n * C;
        for (int c = 0; c < C; c++) d[c] += g[c];
    }
}

void op_add(float *out, const float *a, const float *b, size_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

void op_acc(float *out, const float *a, size_t n) {
    if (n <= 65536) { /* a decode step's residual: outside any region (op_rmsnorm.c says why) */
        for (size_t i = 0; i < n; i++) out[i] += a[i];
        return;
    }
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) out[i] += a[i];
}

void op_convert_rows(float *dst, const void *src, qt_dtype dt, size_t r0, size_t r1, size_t cols) {
    size_t es = qt_dtype_size(dt);
    long nr = (long)(r1 - r0);
    if (dt == QT_Q4) {
#pragma omp parallel for schedule(static) if (nr * (long)cols > 65536)
        for (long r = 0; r < nr; r++)
            qt_q4_dequantize(src, (r0 + (size_t)r) * cols, (r0 + (size_t)r + 1) * cols, dst + (size_t)r * cols);
        return;
    }
#pragma omp parallel for schedule(static) if (nr * (long)cols > 65536)
    for (long r = 0; r < nr; r++)
        qt_convert_to_f32(dst + (size_t)r * cols, (const char *)src + (r0 + (size_t)r) * cols * es, dt, cols);
}

void op_convert_rows_serial(float *dst, const void *src, qt_dtype dt, size_t r0, size_t r1, size_t cols) {
    if (dt == QT_Q4) { /* the 4-bit base: dequantized a panel at a time, never whole */
        qt_q4_dequantize(src, r0 * cols, r1 * cols, dst);
        return;
    }
    size_t es = qt_dtype_size(dt);
    for (size_t r = r0; r < r1; r++)
        qt_convert_to_f32(dst + (r - r0) * cols, (const char *)src + r * cols * es, dt, cols);
}
