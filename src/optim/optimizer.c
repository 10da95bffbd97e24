/* The step sequence of optimizer.h. */
#include "optim/optimizer.h"

#include <math.h>

#include "core/error.h"
#include "optim/clip.h"

int qt_optimizer_init(qt_optimizer *o, const qt_adam_cfg *adam, const qt_sched *sched, double max_grad_norm,
                      const qt_loss_scaler_cfg *scaler) {
    QT_TRY(qt_adam_cfg_check(adam, "optimizer"));
    QT_TRY(qt_sched_check(sched, "scheduler"));
    if (!(max_grad_norm >= 0.0))
        return QT_ERR(QT_EINVAL, "gradient_clipping %g must be >= 0 (0 turns clipping off)", max_grad_norm);
    o->adam = *adam;
    o->sched = *sched;
    o->max_grad_norm = max_grad_norm;
    qt_loss_scaler_cfg off;
    if (!scaler) {
        qt_loss_scaler_cfg_default(&off);
        off.loss_scale = 1.0;
        scaler = &off;
    }
    QT_TRY(qt_loss_scaler_init(&o->scaler, scaler));
    o->n_updates = 0;
    o->n_skipped = 0;
    return QT_OK;
}

int qt_optimizer_apply(qt_optimizer *o, qt_backend *be, double global_sumsq, int overflow, float *params,
                       const float *grads, float *m, float *v, size_t n, size_t base, const qt_range *decay, int n_decay,
                       qt_step_info *info) {
    const double scale = o->scaler.scale;
    overflow = overflow || !isfinite(global_sumsq);
    qt_step_info si = {
        .grad_norm = sqrt(global_sumsq) / scale, /* inf or NaN when the gradients overflowed */
        .lr = qt_sched_lr_for_update(&o->sched, o->n_updates),
        .loss_scale = scale,
        .clip_coef = 1.0f,
        .skipped = overflow,
        .update_finite = -1,
    };
    if (info) *info = si;
    QT_TRY(qt_loss_scaler_update(&o->scaler, overflow));
    if (overflow) {
        o->n_skipped++;
        return QT_OK;
    }
    si.clip_coef = qt_clip_coef(si.grad_norm, o->max_grad_norm);
    if (info) info->clip_coef = si.clip_coef;
    /* unscale and clip fused into the update's read of the gradient (coef / scale in double, rounded once) */
    float gs = (float)((double)si.clip_coef / scale);
    int finite;
    QT_TRY(qt_adam_step(be, &o->adam, o->n_updates + 1, si.lr, gs, params, grads, m, v, n, base, decay, n_decay,
                        &finite));
    if (info) info->update_finite = finite;
    o->n_updates++;
    return QT_OK;
}

cJSON *qt_optimizer_state_json(const qt_optimizer *o) {
    cJSON *j = cJSON_CreateObject(), *sc = qt_loss_scaler_state_json(&o->scaler);
    if (!j || !sc || !cJSON_AddNumberToObject(j, "n_updates", (double)o->n_updates) ||
        !cJSON_AddNumberToObject(j, "n_skipped", (double)o->n_skipped) || !cJSON_AddItemToObject(j, "loss_scaler", sc)) {
        cJSON_Delete(j);
        cJSON_Delete(sc);
        return NULL;
    }
    return j;
}

static int get_whole(const cJSON *j, const char *key, const char *where, double lo, double *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || v->valuedouble < lo || v->valuedouble > 9.0e15 ||
        v->valuedouble != floor(v->valuedouble))
        return QT_ERR(QT_EFORMAT, "%s: optimizer state \"%s\" is missing or not a whole number >= %g; the checkpoint "
                      "is damaged, resume from another one",
                      where, key, lo);
    *out = v->valuedouble;
    return QT_OK;
}

int qt_optimizer_state_load(qt_optimizer *o, const cJSON *state, const char *where) {
    double nu = 0, ns = 0;
    QT_TRY(get_whole(state, "n_updates", where, 0, &nu));
    QT_TRY(get_whole(state, "n_skipped", where, 0, &ns));
    qt_loss_scaler_state st;
    QT_TRY(qt_loss_scaler_state_parse(cJSON_GetObjectItemCaseSensitive(state, "loss_scaler"), where, &st));
    o->n_updates = (int64_t)nu;
    o->n_skipped = (int64_t)ns;
    qt_loss_scaler_state_apply(&o->scaler, &st);
    return QT_OK;
}
