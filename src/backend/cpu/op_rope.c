/* Rotary position embedding, HF rotate-half convention (Qwen2, Llama):
 *   inv_freq[i] = 1 / theta^(2i/D)  (fp32, as HF computes it)
 *   angle = pos * inv_freq[i]       (fp32 product)
 *   x[i]     <- x[i] cos - x[i+D/2] sin
 *   x[i+D/2] <- x[i+D/2] cos + x[i] sin
 * The backward applies the transposed rotation (angle -> -angle).
 * rope_scaling (linear, dynamic, yarn, llama3) changes inv_freq and, for
 * yarn, scales cos and sin (io/hf_config.h: qt_rope_inv_freq). */
#include "backend/cpu/ops.h"

#include <math.h>

#define ROPE_MAX_HALF 512

/* transformers' modeling_rope_utils, per rope type */

void op_rope_inv_freq(const qt_config *c, int32_t max_pos_seen, float *inv, float *attention_factor) {
    const qt_rope_scaling *r = &c->rope_scaling;
    const int D = c->head_dim, half = D / 2;
    double base = c->rope_theta, factor = r->factor;
    const int orig = r->original_max_position_embeddings ? r->original_max_position_embeddings
                                                         : c->max_position_embeddings;
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
        if (!(factor > 0)) factor = (double)c->max_position_embeddings / orig;
        const double ms = factor <= 1 ? 1.0 : 0.1 * log(factor) + 1.0;
        if (r->attention_factor > 0) *attention_factor = r->attention_factor;
        else if (r->mscale > 0 && r->mscale_all_dim > 0)
            *attention_factor = (float)((factor <= 1 ? 1.0 : 0.1 * r->mscale * log(factor) + 1.0) /
                                        (factor <= 1 ? 1.0 : 0.1 * r->mscale_all_dim * log(factor) + 1.0));
        else *attention_factor = (float)ms;
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


/* scale: cos and sin are multiplied by it (YaRN's attention factor, else 1). */
static void rope_apply(float *x, const int32_t *pos, int N, int NH, int D, const float *inv, float scale, float sign) {
    int half = D / 2;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        float cs[ROPE_MAX_HALF], sn[ROPE_MAX_HALF];
        for (int i = 0; i < half; i++) {
            float a = (float)pos[n] * inv[i];
            cs[i] = (float)cos((double)a) * scale;
            sn[i] = sign * (float)sin((double)a) * scale;
        }
        for (int h = 0; h < NH; h++) {
            float *v = x + ((size_t)n * NH + h) * D;
            for (int i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * cs[i] - b * sn[i];
                v[i + half] = b * cs[i] + a * sn[i];
            }
        }
    }
}

/* The frequencies of this call: the config's rope_scaling, with dynamic
 * scaling looking at the largest position (as transformers does per forward). */
static void rope_run(float *x, const int32_t *pos, int N, int NH, int D, const qt_config *c, float sign) {
    float inv[ROPE_MAX_HALF], scale;
    int32_t mx = 0;
    for (int n = 0; n < N; n++) mx = pos[n] > mx ? pos[n] : mx;
    qt_config cc = *c;
    cc.head_dim = D;
    op_rope_inv_freq(&cc, mx, inv, &scale);
    rope_apply(x, pos, N, NH, D, inv, scale, sign);
}

void op_rope_forward(float *x, const int32_t *pos, int N, int NH, int D, const qt_config *c) {
    rope_run(x, pos, N, NH, D, c, 1.0f);
}

void op_rope_backward(float *dx, const int32_t *pos, int N, int NH, int D, const qt_config *c) {
    rope_run(dx, pos, N, NH, D, c, -1.0f);
}
