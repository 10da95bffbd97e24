/* Rotary position embedding, HF rotate-half convention (Qwen2, Llama):
 *   inv_freq[i] = 1 / theta^(2i/D)  (fp32, as HF computes it)
 *   angle = pos * inv_freq[i]       (fp32 product)
 *   x[i]     <- x[i] cos - x[i+D/2] sin
 *   x[i+D/2] <- x[i+D/2] cos + x[i] sin
 * The backward applies the transposed rotation (angle -> -angle). */
#include "backend/cpu/ops.h"

#include <math.h>

#define ROPE_MAX_HALF 512

static void rope_apply(float *x, const int32_t *pos, int N, int NH, int D, float theta, float sign) {
    int half = D / 2;
    float inv[ROPE_MAX_HALF];
    for (int i = 0; i < half && i < ROPE_MAX_HALF; i++) inv[i] = 1.0f / powf(theta, (float)(2 * i) / (float)D);
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        float cs[ROPE_MAX_HALF], sn[ROPE_MAX_HALF];
        for (int i = 0; i < half; i++) {
            float a = (float)pos[n] * inv[i];
            cs[i] = (float)cos((double)a);
            sn[i] = sign * (float)sin((double)a);
        }
        for (int h = 0; h < NH; h++) {
            float *v = x + ((size_t)n * NH + h) * D;
            for (int i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * cs[i] - b * sn[i];
                v[i + half] = b * cs[i] + a * sn[i];
            }
        }
    }
}

void op_rope_forward(float *x, const int32_t *pos, int N, int NH, int D, float theta) {
    rope_apply(x, pos, N, NH, D, theta, 1.0f);
}

void op_rope_backward(float *dx, const int32_t *pos, int N, int NH, int D, float theta) {
    rope_apply(dx, pos, N, NH, D, theta, -1.0f);
}
