/* The fp16 loss scaler, with DeepSpeed's rules (DynamicLossScaler in
 * deepspeed/runtime/fp16/loss_scaler.py and the "fp16" config section).
 *
 * Use per optimizer step: multiply the loss (grad_scale) by qt_loss_scaler_scale;
 * check every gradient element on every rank for inf/NaN (clip.h); call
 * qt_loss_scaler_update with the result. On an overflow the step is skipped:
 * no parameter update and no scheduler advance; the gradients are dropped.
 *
 * Dynamic rules (loss_scale = 0), state: scale, cur_iter, last_overflow_iter
 * (starts -1), cur_hysteresis (starts at `hysteresis`):
 *   overflow:  if hysteresis == 1 or cur_hysteresis == 1:
 *                  scale at min_loss_scale already -> error QT_ENUMERIC
 *                  (QT_MSG_LOSS_SCALE_FLOOR_FMT), else scale = max(scale/2, min)
 *              else cur_hysteresis -= 1 (scale kept)
 *              last_overflow_iter = cur_iter
 *   clean:     if consecutive_hysteresis: cur_hysteresis = hysteresis
 *              if (cur_iter - last_overflow_iter) % loss_scale_window == 0:
 *                  cur_hysteresis = hysteresis (unless consecutive_hysteresis,
 *                  where it was just reset); scale *= 2
 *   then cur_iter += 1.
 * So the scale doubles after every loss_scale_window clean steps in a row;
 * cur_hysteresis is NOT restored by a halving, only by a growth (or by any
 * clean step with consecutive_hysteresis), so once `hysteresis` overflows
 * have been spent, each further overflow halves the scale until it grows again.
 *
 * Static (loss_scale > 0): the scale never changes; an overflow still skips
 * the step (as DeepSpeed's fp16 optimizer does) and is never an error. */
#ifndef QT_OPTIM_LOSS_SCALER_H
#define QT_OPTIM_LOSS_SCALER_H

#include <stdint.h>

/* The error raised when the scale is at its floor and gradients still
 * overflow; `qtune doctor` lists this text. args: double min_loss_scale. */
#define QT_MSG_LOSS_SCALE_FLOOR_FMT                                                                \
    "fp16 gradients still overflow (inf/NaN) at the minimum loss scale %g (fp16.min_loss_scale); " \
    "lower the learning rate, use bf16 where the hardware has it, or check the data for broken "   \
    "or extreme examples"

typedef struct {
    double loss_scale;           /* > 0: static scale; 0: dynamic (default) */
    int initial_scale_power;     /* dynamic start: 2^this (default 16) */
    int64_t loss_scale_window;   /* clean steps in a row that double the scale (1000) */
    int hysteresis;              /* overflows absorbed before the scale halves (2) */
    int consecutive_hysteresis;  /* restore hysteresis on every clean step (false) */
    double min_loss_scale;       /* floor (1) */
} qt_loss_scaler_cfg;

typedef struct {
    qt_loss_scaler_cfg cfg;
    int dynamic;
    double scale;
    int64_t cur_iter;
    int64_t last_overflow_iter;
    int cur_hysteresis;
    int64_t n_overflows;         /* steps skipped so far (for metrics) */
} qt_loss_scaler;

/* DeepSpeed's fp16 defaults (dynamic, 2^16, window 1000, hysteresis 2,
 * consecutive_hysteresis false, min 1). */
void qt_loss_scaler_cfg_default(qt_loss_scaler_cfg *c);
int qt_loss_scaler_cfg_check(const qt_loss_scaler_cfg *c, const char *where);

/* Starts a scaler. A scaler for fp32/bf16 training: cfg.loss_scale = 1. */
int qt_loss_scaler_init(qt_loss_scaler *s, const qt_loss_scaler_cfg *c);

static inline double qt_loss_scaler_scale(const qt_loss_scaler *s) { return s->scale; }

/* Advances the state by one optimizer step. overflow: any rank saw inf/NaN.
 * Returns QT_OK, or QT_ENUMERIC with QT_MSG_LOSS_SCALE_FLOOR_FMT when the
 * scale is already at min_loss_scale and must drop again (the state is left
 * as it was). The caller skips the update whenever overflow is set. */
int qt_loss_scaler_update(qt_loss_scaler *s, int overflow);

/* The one checkpoint format of the scaler's state, the "loss_scaler" object
 * of trainer_state.json: {"scale", "cur_iter", "last_overflow_iter",
 * "cur_hysteresis", "n_overflows"}. _json: NULL when out of memory. _parse
 * checks every field (QT_EFORMAT naming `where` and the field) into *out
 * without touching a scaler; _apply then restores it: the counters always, the
 * scale only when dynamic (a static scale stays what the config says). */
typedef struct {
    double scale;
    int64_t cur_iter, last_overflow_iter, cur_hysteresis, n_overflows;
} qt_loss_scaler_state;
struct cJSON;
struct cJSON *qt_loss_scaler_state_json(const qt_loss_scaler *s);
int qt_loss_scaler_state_parse(const struct cJSON *o, const char *where, qt_loss_scaler_state *out);
void qt_loss_scaler_state_apply(qt_loss_scaler *s, const qt_loss_scaler_state *st);

#endif
