/* Rotary position embedding, HF rotate-half convention (Qwen2, Llama):
 *   inv_freq[i]: the model's table (model/rope.c, qt_rope_inv_freq)
 *   angle = pos * inv_freq[i]       (fp32 product)
 *   x[i]     <- x[i] cos - x[i+D/2] sin
 *   x[i+D/2] <- x[i+D/2] cos + x[i] sin
 * The backward applies the transposed rotation (angle -> -angle).
 * rope_scaling (linear, dynamic, yarn, llama3) changes inv_freq and, for
 * yarn, scales cos and sin (scale); both come from the model side. */
#include "backend/cpu/ops.h"

#include <math.h>

#define ROPE_MAX_HALF QT_ROPE_MAX_HALF

/* scale: cos and sin are multiplied by it (YaRN's attention factor, else 1). */
static void rope_row(float *x, int32_t pos, int NH, int D, const float *inv, float scale, float sign) {
    const int half = D / 2;
    float cs[ROPE_MAX_HALF], sn[ROPE_MAX_HALF];
    for (int i = 0; i < half; i++) {
        float a = (float)pos * inv[i];
        cs[i] = (float)cos((double)a) * scale;
        sn[i] = sign * (float)sin((double)a) * scale;
    }
    for (int h = 0; h < NH; h++) {
        float *v = x + (size_t)h * D;
        for (int i = 0; i < half; i++) {
            float a = v[i], b = v[i + half];
            v[i] = a * cs[i] - b * sn[i];
            v[i + half] = b * cs[i] + a * sn[i];
        }
    }
}

/* scale: cos and sin are multiplied by it (YaRN's attention factor, else 1). */
static void rope_apply(float *x, const int32_t *pos, int N, int NH, int D, const float *inv, float scale, float sign) {
    /* a decode step's few rows run on the calling thread, outside any region (op_rmsnorm.c says why) */
    if (N < 16) {
        for (int n = 0; n < N; n++) rope_row(x + (size_t)n * NH * D, pos[n], NH, D, inv, scale, sign);
        return;
    }
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) rope_row(x + (size_t)n * NH * D, pos[n], NH, D, inv, scale, sign);
}

void op_rope_forward(float *x, const int32_t *pos, int N, int NH, int D, const float *inv, float scale) {
    rope_apply(x, pos, N, NH, D, inv, scale, 1.0f);
}

void op_rope_backward(float *dx, const int32_t *pos, int N, int NH, int D, const float *inv, float scale) {
    rope_apply(dx, pos, N, NH, D, inv, scale, -1.0f);
}
