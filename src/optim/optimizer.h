/* One optimizer step in the order DeepSpeed runs it, over the flat block or
 * a ZeRO shard of it: overflow check -> loss-scale update (skip on overflow,
 * scheduler not advanced) -> unscale -> clip by global norm -> Adam/AdamW with
 * this step's scheduled lr.
 *
 * Sharded use: every rank computes qt_grad_sumsq over its gradient shard
 * (clip.h), the ranks all-reduce (sum) it, and every rank calls
 * qt_optimizer_apply with the same global sum, so the scaler, the schedule and
 * the update count stay identical on all ranks without more communication.
 * Single process: the shard is the whole block and the sum is its own.
 *
 * The step's gradients are expected to carry the loss scale that was in force
 * when they were computed, i.e. qt_optimizer_loss_scale() read before the
 * micro-batches of this step. */
#ifndef QT_OPTIM_OPTIMIZER_H
#define QT_OPTIM_OPTIMIZER_H

#include <stddef.h>
#include <stdint.h>

#include <cjson/cJSON.h>

#include "optim/adam.h"
#include "optim/loss_scaler.h"
#include "optim/schedule.h"

typedef struct {
    qt_adam_cfg adam;
    qt_sched sched;
    double max_grad_norm;    /* DeepSpeed gradient_clipping; 0 = off */
    qt_loss_scaler scaler;   /* scale 1, static, for fp32/bf16 */
    int64_t n_updates;       /* applied updates so far (Adam's step count; the schedule's k) */
    int64_t n_skipped;       /* steps skipped for overflow */
} qt_optimizer;

/* What one step did, for metrics.jsonl. */
typedef struct {
    double grad_norm;   /* global L2 norm of the unscaled gradients, before clipping (inf/NaN on overflow) */
    double lr;          /* the lr this step used (the one it would have used, when skipped) */
    double loss_scale;  /* the scale the gradients carried */
    float clip_coef;    /* 1 when not clipped */
    int skipped;        /* 1: overflow, no update */
    int update_finite;  /* after an update: 1 every updated weight finite, 0 one is not, -1 not known (qt_be_adam) */
} qt_step_info;

/* scaler: NULL for fp32/bf16 (a static scale of 1). */
int qt_optimizer_init(qt_optimizer *o, const qt_adam_cfg *adam, const qt_sched *sched, double max_grad_norm,
                      const qt_loss_scaler_cfg *scaler);

static inline double qt_optimizer_loss_scale(const qt_optimizer *o) { return o->scaler.scale; }

/* One step over a shard of n elements starting at element `base` of the
 * block (params/grads/m/v point at the shard's first element, device memory
 * of be). global_sumsq: the sum over ALL ranks of qt_grad_sumsq of the
 * (scaled) gradients; overflow: another reason to skip the step that every
 * rank agrees on (a non-finite loss), on top of a non-finite sum. On an
 * overflow nothing is updated and info->skipped = 1; QT_ENUMERIC when the
 * loss scale is already at its floor (QT_MSG_LOSS_SCALE_FLOOR_FMT). grads
 * are read, not modified. */
int qt_optimizer_apply(qt_optimizer *o, qt_backend *be, double global_sumsq, int overflow, float *params,
                       const float *grads, float *m, float *v, size_t n, size_t base, const qt_range *decay, int n_decay,
                       qt_step_info *info);

/* The scalar state a checkpoint needs besides m and v (update count, skips,
 * loss-scaler state), as a JSON object; NULL when out of memory. */
cJSON *qt_optimizer_state_json(const qt_optimizer *o);
/* Restores what qt_optimizer_state_json wrote; where names the file. */
int qt_optimizer_state_load(qt_optimizer *o, const cJSON *state, const char *where);

#endif
