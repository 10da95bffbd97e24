/* SwiGLU (Qwen2MLP's act_fn(gate) * up with act_fn = SiLU):
 *   out = silu(g) * u,  silu(g) = g * sigmoid(g)
 *   dg += dout * u * s * (1 + g * (1 - s)),  du += dout * silu(g). */
#include "backend/cpu/ops.h"

#include <math.h>

void op_swiglu_forward(float *out, const float *gate, const float *up, int N, int I) {
    size_t n = (size_t)N * I;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

void op_swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate, const float *up, int N,
                        int I) {
    size_t n = (size_t)N * I;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        float g = gate[i], s = 1.0f / (1.0f + expf(-g));
        dgate[i] += dout[i] * up[i] * s * (1.0f + g * (1.0f - s));
        dup[i] += dout[i] * g * s;
    }
}
