/* Adam / AdamW over a run of the flat fp32 block. The arithmetic follows
 * torch.optim's single-tensor path operation by operation (scalars worked out
 * in double, then applied in fp32), so results agree with torch to fp32
 * rounding. */
#include "optim/adam.h"

#include <math.h>
#include <stdlib.h>

#include "core/error.h"
#include "core/mem.h"

void qt_adam_cfg_default(qt_adam_cfg *c) {
    c->lr = 1e-3;
    c->beta1 = 0.9;
    c->beta2 = 0.999;
    c->eps = 1e-8;
    c->weight_decay = 0.0;
    c->decoupled = 1;
    c->bias_correction = 1;
}

int qt_adam_cfg_check(const qt_adam_cfg *c, const char *where) {
    if (!(c->lr >= 0.0) || !isfinite(c->lr))
        return QT_ERR(QT_EINVAL, "%s: lr %g must be a finite number >= 0", where, c->lr);
    if (!(c->beta1 >= 0.0 && c->beta1 < 1.0) || !(c->beta2 >= 0.0 && c->beta2 < 1.0))
        return QT_ERR(QT_EINVAL, "%s: betas [%g, %g] must each be in [0, 1), e.g. [0.9, 0.999]", where,
                      c->beta1, c->beta2);
    /* eps 0 divides 0 by 0 wherever a gradient has been 0 so far (v = 0): NaN weights */
    if (!(c->eps > 0.0) || !isfinite(c->eps))
        return QT_ERR(QT_EINVAL,
                      "%s: eps %g must be a finite number > 0, e.g. 1e-8 (with 0, an element whose gradient has been "
                      "0 so far divides 0 by 0 and becomes NaN)",
                      where, c->eps);
    if (!(c->weight_decay >= 0.0) || !isfinite(c->weight_decay))
        return QT_ERR(QT_EINVAL, "%s: weight_decay %g must be a finite number >= 0", where, c->weight_decay);
    return QT_OK;
}

int qt_adam_step(qt_backend *be, const qt_adam_cfg *c, int64_t step, double lr, float grad_scale, float *params,
                 const float *grads, float *m, float *v, size_t n, size_t base, const qt_range *decay,
                 int n_decay, int *finite) {
    if (finite) *finite = 1; /* nothing updated yet: nothing non-finite */
    if (step < 1) return QT_ERR(QT_EINVAL, "adam: step %lld must be >= 1 (the 1-based update count)", (long long)step);
    if (n == 0) return QT_OK;
    if (!params || !grads || !m || !v) return QT_ERR(QT_EINVAL, "adam: a NULL buffer was passed for %zu elements", n);
    double bc1 = 1.0, bc2 = 1.0;
    if (c->bias_correction) {
        bc1 = 1.0 - pow(c->beta1, (double)step);
        bc2 = 1.0 - pow(c->beta2, (double)step);
    }
    /* the step's scalars, worked out once in double as torch does in Python */
    qt_adam_scalars k = {
        .omb1 = (float)(1.0 - c->beta1),
        .b2 = (float)c->beta2,
        .omb2 = (float)(1.0 - c->beta2),
        .step_size = (float)(lr / bc1),
        .bc2_sqrt = (float)sqrt(bc2),
        .eps = (float)c->eps,
        .gs = grad_scale,
    };
    const double wd = c->weight_decay;
    const float wd_mul = (wd != 0.0 && c->decoupled) ? (float)(1.0 - lr * wd) : 1.0f;
    const float wd_l2 = (wd != 0.0 && !c->decoupled) ? (float)wd : 0.0f;
    qt_adam_scalars kd = k; /* on decayed elements */
    k.wd_mul = 1.0f, k.wd_l2 = 0.0f;
    kd.wd_mul = wd_mul, kd.wd_l2 = wd_l2;

    /* Walk the run [base, base+n) as alternating pieces outside/inside the
     * decay ranges, calling the kernel once per piece. */
    size_t pos = base, end = base + n;
    int r = 0;
    while (r < n_decay && decay[r].hi <= pos) r++;
    while (pos < end) {
        size_t piece_end;
        int in_decay;
        if (r < n_decay && decay[r].lo <= pos) {
            in_decay = 1;
            piece_end = decay[r].hi < end ? decay[r].hi : end;
            r++;
        } else {
            in_decay = 0;
            piece_end = (r < n_decay && decay[r].lo < end) ? decay[r].lo : end;
        }
        size_t off = pos - base, len = piece_end - pos;
        int f = qt_be_adam(be, in_decay ? &kd : &k, params + off, grads + off, m + off, v + off, len);
        if (finite && *finite != 0 && f != 1) *finite = f; /* 0 wins over -1, -1 over 1 */
        pos = piece_end;
    }
    return QT_OK;
}
