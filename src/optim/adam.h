/* Adam and AdamW on flat fp32 arrays, exactly as torch.optim defines them.
 *
 * The optimizer never sees tensors: it updates a run of elements of the flat
 * trainable block (see model/model.h). Under ZeRO each rank passes only its
 * shard [lo, hi): the pointers point at the shard's first element and `base`
 * is lo, the shard's element offset in the whole block, which is only used to
 * find which elements get weight decay.
 *
 * Per element, with g = grads[i] * grad_scale and t = step (1-based):
 *   AdamW (decoupled):  p = p * (1 - lr*wd)                 (decay elements only)
 *   Adam  (L2):         g = g + wd*p                         (decay elements only)
 *   m = m + (1-b1)*(g - m)
 *   v = v*b2 + (1-b2)*g*g
 *   p = p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
 * With bias_correction = 0 both corrections are 1 (DeepSpeed FusedAdam's flag).
 *
 * Weight decay applies only to elements inside the decay ranges: the 2-D
 * weight matrices, as the Hugging Face Trainer groups parameters (biases and
 * norm weights get none). The optimizer sees the ranges only:
 * train/decay.h builds them from the model's parameter table. */
#ifndef QT_OPTIM_ADAM_H
#define QT_OPTIM_ADAM_H

#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"

typedef struct {
    double lr;           /* base learning rate (a scheduler may override it per step) */
    double beta1, beta2; /* (0.9, 0.999) */
    double eps;          /* 1e-8 */
    double weight_decay; /* 0 */
    int decoupled;       /* 1: AdamW (decay p directly); 0: Adam (L2: wd*p added to the grad) */
    int bias_correction; /* 1: torch's bias correction; 0: none */
} qt_adam_cfg;

/* An element range [lo, hi) of the flat block. */
typedef struct {
    size_t lo, hi;
} qt_range;

/* DeepSpeed FusedAdam's defaults: lr 1e-3, betas (0.9, 0.999), eps 1e-8,
 * weight_decay 0, decoupled (adam_w_mode true), bias correction on. */
void qt_adam_cfg_default(qt_adam_cfg *c);

/* Checks ranges of the hyperparameters (as torch.optim does); the error names
 * `where` (e.g. "ds_config.json: optimizer.params"). */
int qt_adam_cfg_check(const qt_adam_cfg *c, const char *where);

/* One optimizer step over n elements that start at element `base` of the
 * block. params, m, v are updated in place; grads is read and multiplied by
 * grad_scale on the fly (pass 1/loss_scale * clip_coef to fuse the unscale
 * and the clipping into this pass). step is the 1-based number of this update
 * (torch's state["step"] after its increment); lr is this step's learning rate.
 * decay: n_decay sorted, non-overlapping absolute ranges that get weight decay.
 * m and v start at zero. The element loop is the backend's adam (params,
 * grads, m, v are its device memory), once per piece between decay bounds.
 * finite (may be NULL): 1 when every updated param is finite, 0 when one is
 * not, -1 when the backend did not look (qt_be_adam). */
int qt_adam_step(qt_backend *be, const qt_adam_cfg *c, int64_t step, double lr, float grad_scale, float *params,
                 const float *grads, float *m, float *v, size_t n, size_t base, const qt_range *decay,
                 int n_decay, int *finite);

#endif
