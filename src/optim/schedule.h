/* Learning-rate schedules with DeepSpeed's names, defaults and formulas
 * (deepspeed/runtime/lr_schedules.py: WarmupLR, WarmupDecayLR, WarmupCosineLR).
 *
 * qt_sched_lr(s, it) is DeepSpeed's get_lr() when last_batch_iteration = it.
 * DeepSpeed's engine builds the scheduler with last_batch_iteration = -1 (which
 * puts lr(-1) into the optimizer), runs each optimizer step with the lr that
 * is in the optimizer, and then calls scheduler.step() (it += 1) only when the
 * step was applied (an fp16 overflow skips both). So the k-th applied update
 * (k = 0, 1, ...) runs with lr(k - 1): qt_sched_lr_for_update(s, k).
 *
 * W = max(2, warmup_num_steps) (DeepSpeed clamps it), it >= 0:
 *   warmup gamma(it) = log(it + 1) / log(W)   ("log")
 *                    = it / W                  ("linear")       for it < W
 *   WarmupLR:        lr = min_lr + (max_lr - min_lr) * (it < W ? gamma : 1)
 *   WarmupDecayLR:   as WarmupLR for it < W, then
 *                    lr = min_lr + (max_lr - min_lr) * max(0, (total - it) / max(1, total - W))
 *   WarmupCosineLR:  ratio = warmup_min_ratio + (1 - warmup_min_ratio) * gamma   for it < W
 *                    ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) *
 *                            (1 + cos(pi * (it - W + 1) / (total - W))) / 2)   otherwise
 *                    lr = base_lr * ratio (base_lr: the optimizer's lr)
 *   it < 0: WarmupLR/WarmupDecayLR give min_lr, WarmupCosineLR gives 0, as DeepSpeed does. */
#ifndef QT_OPTIM_SCHEDULE_H
#define QT_OPTIM_SCHEDULE_H

#include <stdint.h>

typedef enum {
    QT_SCHED_CONSTANT = 0,      /* no scheduler: the optimizer's lr every step */
    QT_SCHED_WARMUP_LR = 1,
    QT_SCHED_WARMUP_DECAY_LR = 2,
    QT_SCHED_WARMUP_COSINE_LR = 3,
} qt_sched_type;

typedef enum { QT_WARMUP_LOG = 0, QT_WARMUP_LINEAR = 1 } qt_warmup_type;

typedef struct {
    qt_sched_type type;
    double base_lr;            /* the optimizer's lr: CONSTANT's lr, WarmupCosineLR's org_lr */
    double warmup_min_lr;      /* WarmupLR/WarmupDecayLR; default 0 */
    double warmup_max_lr;      /* default: the optimizer's lr (WarmupLR), 0.001 (WarmupDecayLR) */
    int64_t warmup_num_steps;  /* default 1000; the formulas use max(2, this) */
    qt_warmup_type warmup_type; /* default log */
    int64_t total_num_steps;   /* WarmupDecayLR/WarmupCosineLR; required */
    double warmup_min_ratio;   /* WarmupCosineLR; default 0 */
    double cos_min_ratio;      /* WarmupCosineLR; default 0.0001 */
} qt_sched;

/* DeepSpeed's defaults for that type; base_lr is the optimizer's lr.
 * total_num_steps is left at -1 (must be set for the decaying schedules). */
void qt_sched_default(qt_sched *s, qt_sched_type type, double base_lr);

/* Checks the values: total_num_steps set where needed, WarmupCosineLR's
 * total_num_steps != warmup steps (its formula divides by the difference).
 * Says nothing: it also guards qt_optimizer_init, after the config was read. */
int qt_sched_check(const qt_sched *s, const char *where);

/* Warns (as DeepSpeed does) when total_num_steps < the warmup steps
 * (max(2, warmup_num_steps)); the config reader calls it once. */
void qt_sched_warn(const qt_sched *s, const char *where);

/* DeepSpeed's get_lr() at last_batch_iteration = it. */
double qt_sched_lr(const qt_sched *s, int64_t it);

/* The lr DeepSpeed's engine uses for the k-th applied update (k >= 0):
 * qt_sched_lr(s, k - 1). Skipped (overflowed) steps do not count in k. */
double qt_sched_lr_for_update(const qt_sched *s, int64_t k);

const char *qt_sched_name(qt_sched_type t); /* "WarmupLR", ...; "constant" */

#endif
