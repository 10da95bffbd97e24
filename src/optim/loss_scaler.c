/* DeepSpeed's dynamic loss scaler; the rules are spelled out in loss_scaler.h. */
#include "optim/loss_scaler.h"

#include <math.h>

#include <cjson/cJSON.h>

#include "core/error.h"
#include "core/log.h"

void qt_loss_scaler_cfg_default(qt_loss_scaler_cfg *c) {
    c->loss_scale = 0.0;
    c->initial_scale_power = 16;
    c->loss_scale_window = 1000;
    c->hysteresis = 2;
    c->consecutive_hysteresis = 0;
    c->min_loss_scale = 1.0;
}

int qt_loss_scaler_cfg_check(const qt_loss_scaler_cfg *c, const char *where) {
    if (!(c->loss_scale >= 0.0) || !isfinite(c->loss_scale))
        return QT_ERR(QT_EINVAL, "%s: loss_scale %g must be 0 (dynamic) or a positive number (static)", where,
                      c->loss_scale);
    if (c->loss_scale > 0.0) return QT_OK;
    if (c->initial_scale_power < 0 || c->initial_scale_power > 64)
        return QT_ERR(QT_EINVAL, "%s: initial_scale_power %d must be in [0, 64]; 16 is DeepSpeed's default", where,
                      c->initial_scale_power);
    if (c->loss_scale_window < 1)
        return QT_ERR(QT_EINVAL, "%s: loss_scale_window %lld must be >= 1; 1000 is DeepSpeed's default", where,
                      (long long)c->loss_scale_window);
    if (c->hysteresis < 1)
        return QT_ERR(QT_EINVAL, "%s: hysteresis %d must be >= 1; 2 is DeepSpeed's default", where, c->hysteresis);
    if (!(c->min_loss_scale > 0.0) || !isfinite(c->min_loss_scale))
        return QT_ERR(QT_EINVAL, "%s: min_loss_scale %g must be a positive number; 1 is DeepSpeed's default", where,
                      c->min_loss_scale);
    return QT_OK;
}

int qt_loss_scaler_init(qt_loss_scaler *s, const qt_loss_scaler_cfg *c) {
    QT_TRY(qt_loss_scaler_cfg_check(c, "fp16"));
    s->cfg = *c;
    s->dynamic = c->loss_scale == 0.0;
    s->scale = s->dynamic ? ldexp(1.0, c->initial_scale_power) : c->loss_scale;
    s->cur_iter = 0;
    s->last_overflow_iter = -1;
    s->cur_hysteresis = c->hysteresis;
    s->n_overflows = 0;
    return QT_OK;
}

int qt_loss_scaler_update(qt_loss_scaler *s, int overflow) {
    if (!s->dynamic) {
        s->n_overflows += overflow != 0;
        s->cur_iter++;
        return QT_OK;
    }
    const qt_loss_scaler_cfg *c = &s->cfg;
    if (overflow) {
        if (c->hysteresis == 1 || s->cur_hysteresis == 1) {
            if (s->scale == c->min_loss_scale) return QT_ERR(QT_ENUMERIC, QT_MSG_LOSS_SCALE_FLOOR_FMT, c->min_loss_scale);
            double next = s->scale / 2.0;
            if (next < c->min_loss_scale) next = c->min_loss_scale;
            qt_info("fp16 overflow: skipping step, loss scale %g -> %g", s->scale, next);
            s->scale = next;
        } else {
            qt_info("fp16 overflow: skipping step, loss scale %g kept (hysteresis %d -> %d)", s->scale,
                    s->cur_hysteresis, s->cur_hysteresis - 1);
            s->cur_hysteresis--;
        }
        s->last_overflow_iter = s->cur_iter;
        s->n_overflows++;
    } else {
        if (c->consecutive_hysteresis) s->cur_hysteresis = c->hysteresis;
        if ((s->cur_iter - s->last_overflow_iter) % c->loss_scale_window == 0) {
            s->cur_hysteresis = c->hysteresis;
            s->scale *= 2.0;
        }
    }
    s->cur_iter++;
    return QT_OK;
}

cJSON *qt_loss_scaler_state_json(const qt_loss_scaler *s) {
    cJSON *j = cJSON_CreateObject();
    if (!j) return NULL;
    int ok = cJSON_AddNumberToObject(j, "scale", s->scale) &&
             cJSON_AddNumberToObject(j, "cur_iter", (double)s->cur_iter) &&
             cJSON_AddNumberToObject(j, "last_overflow_iter", (double)s->last_overflow_iter) &&
             cJSON_AddNumberToObject(j, "cur_hysteresis", s->cur_hysteresis) &&
             cJSON_AddNumberToObject(j, "n_overflows", (double)s->n_overflows);
    if (!ok) {
        cJSON_Delete(j);
        return NULL;
    }
    return j;
}

static int whole(const cJSON *o, const char *key, int64_t lo, int64_t hi, int64_t *out, const char *where) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(it) || it->valuedouble != floor(it->valuedouble) || it->valuedouble < (double)lo ||
        it->valuedouble > (double)hi)
        return QT_ERR(QT_EFORMAT, "%s: \"%s\" is missing or not a whole number >= %lld; the checkpoint is damaged",
                      where, key, (long long)lo);
    *out = (int64_t)it->valuedouble;
    return QT_OK;
}

int qt_loss_scaler_state_parse(const cJSON *o, const char *where, qt_loss_scaler_state *out) {
    QT_TRY(whole(o, "cur_iter", 0, (int64_t)9e15, &out->cur_iter, where));
    QT_TRY(whole(o, "last_overflow_iter", -1, (int64_t)9e15, &out->last_overflow_iter, where));
    QT_TRY(whole(o, "cur_hysteresis", 0, (int64_t)1e9, &out->cur_hysteresis, where));
    QT_TRY(whole(o, "n_overflows", 0, (int64_t)9e15, &out->n_overflows, where));
    const cJSON *scale = cJSON_GetObjectItemCaseSensitive(o, "scale");
    if (!(cJSON_IsNumber(scale) && scale->valuedouble > 0 && isfinite(scale->valuedouble)))
        return QT_ERR(QT_EFORMAT, "%s: loss_scaler.scale must be a positive number; the checkpoint is damaged", where);
    out->scale = scale->valuedouble;
    return QT_OK;
}

void qt_loss_scaler_state_apply(qt_loss_scaler *s, const qt_loss_scaler_state *st) {
    if (s->dynamic) s->scale = st->scale;
    s->cur_iter = st->cur_iter;
    s->last_overflow_iter = st->last_overflow_iter;
    s->cur_hysteresis = (int)st->cur_hysteresis;
    s->n_overflows = st->n_overflows;
}
