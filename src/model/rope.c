/* RoPE's inverse frequencies and attention factor for a config's
 * rope_scaling (linear, dynamic, yarn, llama3), as transformers'
 * modeling_rope_utils computes them. The model computes the table on the host
 * once per forward (from the batch's largest position: dynamic NTK depends on
 * it) and hands it to qt_be_rope_forward / _backward; the backends only
 * apply it. */
#include "model/model_internal.h"

#include <math.h>

void qt_rope_inv_freq(const qt_config *c, int D, int32_t max_pos_seen, float *inv, float *attention_factor) {
    const qt_rope_scaling *r = &c->rope_scaling;
    const int half = D / 2;
    double base = c->rope_theta, factor = r->factor;
    const int orig = qt_rope_original_length(c);
    *attention_factor = 1.0f;
    if (r->type == QT_ROPE_DYNAMIC) {
        /* NTK: a larger base once the sequence outgrows the trained length */
        const double seq = (double)max_pos_seen + 1.0;
        if (seq > orig) base = base * pow(factor * seq / orig - (factor - 1.0), (double)D / (D - 2));
    }
    for (int i = 0; i < half; i++) inv[i] = (float)(1.0 / pow(base, (double)(2 * i) / D));
    if (r->type == QT_ROPE_LINEAR) {
        for (int i = 0; i < half; i++) inv[i] = (float)(inv[i] / factor);
    } else if (r->type == QT_ROPE_LLAMA3) {
        const double lo_wl = orig / r->low_freq_factor, hi_wl = orig / r->high_freq_factor;
        for (int i = 0; i < half; i++) {
            const double f = inv[i], wl = 2.0 * M_PI / f;
            double g = wl > lo_wl ? f / factor : f;
            if (!(wl < hi_wl) && !(wl > lo_wl)) {
                const double s = (orig / wl - r->low_freq_factor) / (r->high_freq_factor - r->low_freq_factor);
                g = (1.0 - s) * g / factor + s * g;
            }
            inv[i] = (float)g;
        }
    } else if (r->type == QT_ROPE_YARN) {
        factor = qt_rope_factor(c);
        *attention_factor = (float)qt_rope_yarn_attention(c);
        /* the dimensions that turn fewer than beta_slow times over the trained
         * length are interpolated, more than beta_fast extrapolated, a linear
         * ramp between */
        double lo = D * log(orig / (r->beta_fast * 2 * M_PI)) / (2 * log(base));
        double hi = D * log(orig / (r->beta_slow * 2 * M_PI)) / (2 * log(base));
        if (r->truncate) lo = floor(lo), hi = ceil(hi);
        if (lo < 0) lo = 0;
        if (hi > D - 1) hi = D - 1;
        if (lo == hi) hi += 0.001;
        for (int i = 0; i < half; i++) {
            const double pf = pow(base, (double)(2 * i) / D);
            double ramp = (i - lo) / (hi - lo);
            ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
            const double extra = 1.0 - ramp;
            inv[i] = (float)(1.0 / (factor * pf) * (1.0 - extra) + 1.0 / pf * extra);
        }
    }
}

void qt_model_rope_table(qt_model *m, int32_t max_pos) {
    qt_rope_inv_freq(&m->cfg, m->cfg.head_dim, max_pos, m->rope_inv, &m->rope_scale);
}
