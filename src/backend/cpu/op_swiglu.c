/* SwiGLU (Qwen2MLP's act_fn(gate) * up with act_fn = SiLU):
 *   out = silu(g) * u,  silu(g) = g * sigmoid(g)
 *   dg += dout * u * s * (1 + g * (1 - s)),  du += dout * silu(g).
 *
 * Eight lanes at a time with op_exp8 (glibc's expf is one lane at a time and
 * was most of these loops' cost). The forward's tail of fewer than eight
 * goes through the same lanes, masked, so an element's value never depends
 * on where it sits (a decode step of N rows gives each row the bits of its
 * one-row call); the backward's tail uses expf. */
#include "backend/cpu/ops.h"
#include "backend/cpu/op_simd.h"

#include <math.h>

/* sigmoid(g) of eight lanes. op_exp8 saturates at exp(88.72) where expf
 * overflows to inf, so below g = -88.72283 (where the scalar sigmoid is
 * exactly 0) the lane is set to 0: else g * s grows with |g| (silu(-1e30)
 * was -2.9e-9, silu(-FLT_MAX) -1.0) and silu(-inf) was -inf, not NaN. */
static inline __m256 sigmoid8(__m256 g) {
    const __m256 one = _mm256_set1_ps(1.0f);
    __m256 s = _mm256_div_ps(one, _mm256_add_ps(one, op_exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    return _mm256_andnot_ps(_mm256_cmp_ps(g, _mm256_set1_ps(-88.72283172607421875f), _CMP_LT_OQ), s);
}

/* lanes [0, k) set, k < 8 */
static inline __m256i tail_mask(size_t k) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline void swiglu8(float *out, const float *gate, const float *up, size_t b) {
    __m256 g = _mm256_loadu_ps(gate + 8 * b);
    __m256 s = sigmoid8(g);
    _mm256_storeu_ps(out + 8 * b, _mm256_mul_ps(_mm256_mul_ps(g, s), _mm256_loadu_ps(up + 8 * b)));
}

void op_swiglu_forward(float *out, const float *gate, const float *up, int N, int I) {
    size_t n = (size_t)N * I, n8 = n / 8;
    /* a decode step's few rows on the calling thread, outside any region (op_rmsnorm.c says why) */
    if (n < 65536) {
        for (size_t b = 0; b < n8; b++) swiglu8(out, gate, up, b);
    } else {
#pragma omp parallel for schedule(static)
        for (size_t b = 0; b < n8; b++) swiglu8(out, gate, up, b);
    }
    if (n > 8 * n8) {
        const size_t i = 8 * n8;
        const __m256i mask = tail_mask(n - i);
        __m256 g = _mm256_maskload_ps(gate + i, mask);
        __m256 o = _mm256_mul_ps(_mm256_mul_ps(g, sigmoid8(g)), _mm256_maskload_ps(up + i, mask));
        _mm256_maskstore_ps(out + i, mask, o);
    }
}

void op_swiglu_backward(float *dgate, float *dup, const float *dout, const float *gate, const float *up, int N,
                        int I) {
    size_t n = (size_t)N * I, n8 = n / 8;
#pragma omp parallel for schedule(static) if (n >= 65536)
    for (size_t b = 0; b < n8; b++) {
        const __m256 one = _mm256_set1_ps(1.0f);
        __m256 g = _mm256_loadu_ps(gate + 8 * b), d = _mm256_loadu_ps(dout + 8 * b);
        __m256 s = sigmoid8(g);
        /* dg += d * u * s * (1 + g * (1 - s)) */
        __m256 t = _mm256_fmadd_ps(g, _mm256_sub_ps(one, s), one);
        __m256 dg = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(d, _mm256_loadu_ps(up + 8 * b)), s), t);
        _mm256_storeu_ps(dgate + 8 * b, _mm256_add_ps(_mm256_loadu_ps(dgate + 8 * b), dg));
        /* du += d * g * s */
        __m256 du = _mm256_mul_ps(_mm256_mul_ps(d, g), s);
        _mm256_storeu_ps(dup + 8 * b, _mm256_add_ps(_mm256_loadu_ps(dup + 8 * b), du));
    }
    for (size_t i = 8 * n8; i < n; i++) {
        float g = gate[i], s = 1.0f / (1.0f + expf(-g));
        dgate[i] += dout[i] * up[i] * s * (1.0f + g * (1.0f - s));
        dup[i] += dout[i] * g * s;
    }
}
