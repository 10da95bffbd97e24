/* Global-norm clipping and the overflow check. */
#include "optim/clip.h"

#include <math.h>

/* One sum of squares: the backend's (backend.h sum_squares, the same bits
 * for any thread count), used for the norm, the overflow check and ZeRO's
 * shards alike. */
double qt_grad_sumsq(qt_backend *be, const float *g, size_t n) { return qt_be_sum_squares(be, g, n); }

/* A float squared cannot overflow a double, so the sum is finite iff every
 * element is. */
int qt_grad_has_nonfinite(qt_backend *be, const float *g, size_t n) { return !isfinite(qt_be_sum_squares(be, g, n)); }

float qt_clip_coef(double norm, double max_norm) {
    if (!(max_norm > 0.0) || !isfinite(norm)) return 1.0f;
    /* torch: clip_coef = max_norm / (total_norm + 1e-6), clamped to 1, in fp32. */
    float coef = (float)max_norm / ((float)norm + 1e-6f);
    return coef < 1.0f ? coef : 1.0f;
}

void qt_grad_scale(qt_backend *be, float *g, size_t n, float s) {
    if (s != 1.0f) qt_be_scale(be, g, n, s);
}

double qt_clip_grad_norm(qt_backend *be, float *g, size_t n, double max_norm, double inv_scale) {
    double norm = sqrt(qt_grad_sumsq(be, g, n)) * inv_scale;
    if (!isfinite(norm)) return norm;
    float mult = (float)inv_scale * qt_clip_coef(norm, max_norm);
    qt_grad_scale(be, g, n, mult);
    return norm;
}
