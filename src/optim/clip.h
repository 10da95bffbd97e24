/* Gradient clipping by global L2 norm, and the inf/NaN check, over the flat
 * fp32 gradient block or a shard of it.
 *
 * Sharded use (ZeRO, N ranks): each rank computes qt_grad_sumsq over its own
 * shard, the ranks all-reduce (sum) the doubles, and every rank then takes
 * norm = sqrt(total) * inv_loss_scale and coef = qt_clip_coef(norm, max_norm).
 * A non-finite partial sum means an inf/NaN element (a finite fp32 squared
 * cannot overflow a double), so the same all-reduce also answers "did any
 * rank overflow?" for the loss scaler.
 *
 * Clipping follows torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm +
 * 1e-6), applied only when coef < 1. max_norm <= 0 turns clipping off (as
 * DeepSpeed's gradient_clipping = 0). */
#ifndef QT_OPTIM_CLIP_H
#define QT_OPTIM_CLIP_H

#include <stddef.h>

#include "backend/backend.h"

/* Every buffer is device memory of be (backend/backend.h).
 * Sum of squares of g[0..n) in double: the backend's sum_squares, the same
 * bits whatever the thread count. */
double qt_grad_sumsq(qt_backend *be, const float *g, size_t n);

/* 1 if any of g[0..n) is inf or NaN, else 0 (the sum of squares is not finite). */
int qt_grad_has_nonfinite(qt_backend *be, const float *g, size_t n);

/* The factor to multiply gradients by: max_norm / (norm + 1e-6) when that is
 * < 1, else 1. Returns 1 when max_norm <= 0 (off) or norm is not finite (the
 * step is skipped as an overflow; nothing to clip). */
float qt_clip_coef(double norm, double max_norm);

/* g[i] *= s for i in [0, n). */
void qt_grad_scale(qt_backend *be, float *g, size_t n, float s);

/* Single-process convenience: norm = sqrt(sum g^2) * inv_scale (the unscaled
 * norm; pass inv_scale = 1/loss_scale, or 1). When the norm is finite, g is
 * multiplied by inv_scale * qt_clip_coef(norm, max_norm) (unscaled and clipped
 * in one pass); when it is not, g is left as it is. Returns the norm before
 * clipping. */
double qt_clip_grad_norm(qt_backend *be, float *g, size_t n, double max_norm, double inv_scale);

#endif
