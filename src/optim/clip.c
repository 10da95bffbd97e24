/* Global-norm clipping and the overflow check. */
#include "optim/clip.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* The sum of squares is taken in blocks of CLIP_BLOCK elements; blocks are
 * summed into a fixed-size array in parallel and then added in order, so the
 * result does not depend on the thread count (OpenMP reductions combine in
 * whatever order threads finish). CLIP_GROUP blocks are in flight at once,
 * which bounds the stack array. */
#define CLIP_BLOCK 16384
#define CLIP_GROUP 1024

static double block_sumsq(const float *g, size_t n) {
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (size_t i = 0; i < n; i++) s += (double)g[i] * (double)g[i];
    return s;
}

double qt_grad_sumsq(const float *g, size_t n) {
    double total = 0.0;
    double part[CLIP_GROUP];
    size_t nblocks = (n + CLIP_BLOCK - 1) / CLIP_BLOCK;
    for (size_t b0 = 0; b0 < nblocks; b0 += CLIP_GROUP) {
        size_t nb = nblocks - b0 < CLIP_GROUP ? nblocks - b0 : CLIP_GROUP;
#pragma omp parallel for schedule(static) if (nb > 1)
        for (size_t b = 0; b < nb; b++) {
            size_t lo = (b0 + b) * CLIP_BLOCK;
            size_t len = n - lo < CLIP_BLOCK ? n - lo : CLIP_BLOCK;
            part[b] = block_sumsq(g + lo, len);
        }
        for (size_t b = 0; b < nb; b++) total += part[b];
    }
    return total;
}

int qt_grad_has_nonfinite(const float *g, size_t n) {
    /* inf and NaN are exactly the floats whose exponent bits are all ones. */
    uint32_t bad = 0;
#pragma omp parallel for simd reduction(| : bad) schedule(static) if (n >= 65536)
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &g[i], 4);
        bad |= (uint32_t)((u & 0x7f800000u) == 0x7f800000u);
    }
    return bad != 0;
}

float qt_clip_coef(double norm, double max_norm) {
    if (!(max_norm > 0.0) || !isfinite(norm)) return 1.0f;
    /* torch: clip_coef = max_norm / (total_norm + 1e-6), clamped to 1, in fp32. */
    float coef = (float)max_norm / ((float)norm + 1e-6f);
    return coef < 1.0f ? coef : 1.0f;
}

void qt_grad_scale(float *g, size_t n, float s) {
    if (s == 1.0f) return;
#pragma omp parallel for simd schedule(static) if (n >= 65536)
    for (size_t i = 0; i < n; i++) g[i] *= s;
}

double qt_clip_grad_norm(float *g, size_t n, double max_norm, double inv_scale) {
    double norm = sqrt(qt_grad_sumsq(g, n)) * inv_scale;
    if (!isfinite(norm)) return norm;
    float mult = (float)inv_scale * qt_clip_coef(norm, max_norm);
    qt_grad_scale(g, n, mult);
    return norm;
}
