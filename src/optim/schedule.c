/* DeepSpeed's learning-rate schedules; formulas in schedule.h. Every
 * expression is written as DeepSpeed writes it (in double), so the values
 * agree to the last bit or nearly. */
#include "optim/schedule.h"

#include <math.h>

#include "core/error.h"
#include "core/log.h"

void qt_sched_default(qt_sched *s, qt_sched_type type, double base_lr) {
    s->type = type;
    s->base_lr = base_lr;
    s->warmup_min_lr = 0.0;
    /* WarmupLR's warmup_max_lr defaults to the optimizer's lr (None in
     * DeepSpeed); WarmupDecayLR passes its own default 0.001. */
    s->warmup_max_lr = type == QT_SCHED_WARMUP_DECAY_LR ? 0.001 : base_lr;
    s->warmup_num_steps = 1000;
    s->warmup_type = QT_WARMUP_LOG;
    s->total_num_steps = -1;
    s->warmup_min_ratio = 0.0;
    s->cos_min_ratio = 0.0001;
}

const char *qt_sched_name(qt_sched_type t) {
    switch (t) {
    case QT_SCHED_WARMUP_LR: return "WarmupLR";
    case QT_SCHED_WARMUP_DECAY_LR: return "WarmupDecayLR";
    case QT_SCHED_WARMUP_COSINE_LR: return "WarmupCosineLR";
    default: return "constant";
    }
}

static int64_t warmup_steps(const qt_sched *s) { return s->warmup_num_steps < 2 ? 2 : s->warmup_num_steps; }

int qt_sched_check(const qt_sched *s, const char *where) {
    if (s->type == QT_SCHED_CONSTANT) return QT_OK;
    const char *name = qt_sched_name(s->type);
    /* a negative lr climbs the loss: refused wherever it would come from */
    if (s->type != QT_SCHED_WARMUP_COSINE_LR) {
        if (!(s->warmup_min_lr >= 0.0) || !isfinite(s->warmup_min_lr))
            return QT_ERR(QT_EINVAL,
                          "%s: %s scheduler.params.warmup_min_lr %g must be a finite number >= 0 (a negative "
                          "learning rate climbs the loss)",
                          where, name, s->warmup_min_lr);
        if (!(s->warmup_max_lr >= 0.0) || !isfinite(s->warmup_max_lr))
            return QT_ERR(QT_EINVAL,
                          "%s: %s scheduler.params.warmup_max_lr %g must be a finite number >= 0 (a negative "
                          "learning rate climbs the loss)",
                          where, name, s->warmup_max_lr);
    } else {
        if (!(s->warmup_min_ratio >= 0.0 && s->warmup_min_ratio <= 1.0))
            return QT_ERR(QT_EINVAL, "%s: WarmupCosineLR scheduler.params.warmup_min_ratio %g must be in [0, 1]", where,
                          s->warmup_min_ratio);
        if (!(s->cos_min_ratio >= 0.0 && s->cos_min_ratio <= 1.0))
            return QT_ERR(QT_EINVAL, "%s: WarmupCosineLR scheduler.params.cos_min_ratio %g must be in [0, 1]", where,
                          s->cos_min_ratio);
    }
    if (s->warmup_num_steps < 0)
        return QT_ERR(QT_EINVAL, "%s: %s warmup_num_steps %lld must be >= 0", where, name,
                      (long long)s->warmup_num_steps);
    if (s->type == QT_SCHED_WARMUP_LR) return QT_OK;
    if (s->total_num_steps < 0)
        return QT_ERR(QT_EINVAL,
                      "%s: %s needs scheduler.params.total_num_steps; set it, or set train.max_steps when it is "
                      "\"auto\"",
                      where, name);
    int64_t w = warmup_steps(s);
    if (s->type == QT_SCHED_WARMUP_COSINE_LR && s->total_num_steps == w)
        return QT_ERR(QT_EINVAL,
                      "%s: WarmupCosineLR total_num_steps %lld equals its warmup steps (max(2, warmup_num_steps) = "
                      "%lld), which leaves no steps to decay over; raise total_num_steps",
                      where, (long long)s->total_num_steps, (long long)w);
    return QT_OK;
}

void qt_sched_warn(const qt_sched *s, const char *where) {
    if (s->type != QT_SCHED_WARMUP_DECAY_LR && s->type != QT_SCHED_WARMUP_COSINE_LR) return;
    const int64_t w = warmup_steps(s);
    if (s->total_num_steps >= 0 && s->total_num_steps < w)
        qt_warn("%s: %s total_num_steps %lld is less than its warmup steps (max(2, warmup_num_steps) = %lld), so the "
                "learning rate never leaves the warmup; lower warmup_num_steps (the warmup is at least 2 steps) or raise "
                "total_num_steps",
                where, qt_sched_name(s->type), (long long)s->total_num_steps, (long long)w);
}

/* The warmup fraction in [0, 1) for it < W. */
static double warmup_gamma(const qt_sched *s, int64_t it, int64_t w) {
    if (s->warmup_type == QT_WARMUP_LINEAR) return (double)it / (double)w;
    return (1.0 / log((double)w)) * log((double)it + 1.0);
}

double qt_sched_lr(const qt_sched *s, int64_t it) {
    const int64_t w = warmup_steps(s);
    switch (s->type) {
    case QT_SCHED_CONSTANT: return s->base_lr;
    case QT_SCHED_WARMUP_LR:
    case QT_SCHED_WARMUP_DECAY_LR: {
        if (it < 0) return s->warmup_min_lr;
        double delta = s->warmup_max_lr - s->warmup_min_lr, gamma;
        if (it < w) gamma = warmup_gamma(s, it, w);
        else if (s->type == QT_SCHED_WARMUP_LR) gamma = 1.0;
        else {
            double denom = (double)(s->total_num_steps - w);
            if (denom < 1.0) denom = 1.0;
            gamma = (double)(s->total_num_steps - it) / denom;
            if (gamma < 0.0) gamma = 0.0;
        }
        return s->warmup_min_lr + delta * gamma;
    }
    case QT_SCHED_WARMUP_COSINE_LR: {
        if (it < 0) return 0.0;
        double ratio;
        if (it < w) {
            ratio = warmup_gamma(s, it, w);
            ratio = s->warmup_min_ratio + ratio * (1.0 - s->warmup_min_ratio);
        } else {
            double real_last = (double)(it - w + 1), real_total = (double)(s->total_num_steps - w);
            ratio = (1.0 + cos(M_PI * real_last / real_total)) / 2.0;
            ratio = s->cos_min_ratio + (1.0 - s->cos_min_ratio) * ratio;
            if (ratio < 0.0) ratio = 0.0;
        }
        return s->base_lr * ratio;
    }
    }
    return s->base_lr;
}

double qt_sched_lr_for_update(const qt_sched *s, int64_t k) { return qt_sched_lr(s, k - 1); }
