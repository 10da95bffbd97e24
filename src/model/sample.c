/* Token sampling (see sample.h). The order of the warpers is Hugging Face's:
 * temperature scales the logits, top-k keeps the k largest, top-p keeps the
 * most probable tokens until their mass reaches p (always at least one), and
 * the draw is inverse-CDF over the kept set with one uniform from qt_rng. */
#define _GNU_SOURCE /* qsort_r */
#include "model/sample.h"

#include "core/error.h"
#include "core/mem.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int qt_sampler_init(qt_sampler *s, int V) {
    s->V = V;
    s->prob = qt_malloc((size_t)V * sizeof *s->prob, "sampling probabilities");
    s->idx = qt_malloc((size_t)V * sizeof *s->idx, "sampling candidates");
    if (!s->prob || !s->idx) {
        qt_sampler_free(s);
        return QT_ENOMEM;
    }
    return QT_OK;
}

void qt_sampler_free(qt_sampler *s) {
    qt_free(s->prob);
    qt_free(s->idx);
    s->prob = NULL;
    s->idx = NULL;
}

int qt_sample_opts_check(const qt_sample_opts *o) {
    if (!(o->temperature >= 0) || !isfinite(o->temperature))
        return QT_ERR(QT_EINVAL, "--temperature must be 0 (greedy) or positive, not %g", o->temperature);
    if (o->top_k < 0) return QT_ERR(QT_EINVAL, "--top-k must be 0 (off) or positive, not %d", o->top_k);
    if (!(o->top_p > 0 && o->top_p <= 1))
        return QT_ERR(QT_EINVAL, "--top-p must be in (0, 1] (1 is off), not %g", o->top_p);
    return QT_OK;
}

/* An integer that orders floats as their values: the magnitude bits,
 * negated for a negative float (so -0 and +0 are both 0), and NaN the lowest
 * key there is. Integer selects only, so the passes below vectorise (a
 * float compare-and-select there kept GCC to one element at a time). */
static inline int32_t order_key(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const int32_t m = (int32_t)(u & 0x7FFFFFFFu), k = (int32_t)u < 0 ? -m : m;
    const int32_t nan = -(int32_t)(m > 0x7F800000); /* all ones for a NaN */
    return (k & ~nan) | (INT32_MIN & nan);
}

/* Two passes the compiler vectorises, the largest key (an integer max) and
 * then the first index holding it, where a compare chain is one element at a
 * time (151936 logits: 100-127 us). The second pass tests a block at a time
 * (a vectorised count) and looks for the index only in the block that has
 * it: an early exit keeps a loop scalar, and one element at a time up to the
 * argmax took 74 / 140 us with the largest logit in the middle / at the end
 * (0.4% of a 0.5B decode step's samples), 13 / 19 us this way, 7 us when it
 * comes first. */
int32_t qt_argmax(const float *x, int V) {
    int32_t top = INT32_MIN;
    for (int i = 0; i < V; i++) {
        const int32_t k = order_key(x[i]);
        top = k > top ? k : top;
    }
    enum { BLOCK = 256 };
    for (int b = 0; b < V; b += BLOCK) {
        const int e = V - b < BLOCK ? V : b + BLOCK;
        int hits = 0;
        for (int i = b; i < e; i++) hits += order_key(x[i]) == top;
        if (hits)
            for (int i = b; i < e; i++)
                if (order_key(x[i]) == top) return i;
    }
    return 0;
}

/* Candidates sorted by probability, largest first; equal ones by id. */
static int by_prob_desc(const void *a, const void *b, void *ctx) {
    const float *p = ctx;
    int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    if (p[i] != p[j]) return p[i] > p[j] ? -1 : 1;
    return i < j ? -1 : i > j;
}

int32_t qt_sample(qt_sampler *s, const float *logits, const qt_sample_opts *o, qt_rng *rng) {
    const int V = s->V;
    /* 1 / T past FLT_MAX (T below about 2.9e-39) is inf, and (max - max) * inf
     * a NaN that made every draw the last id; greedy is the limit T -> 0 */
    const float inv_t = 1.0f / o->temperature;
    if (o->temperature == 0 || isinf(inv_t)) return qt_argmax(logits, V);
    /* softmax(logits / T) over the whole vocabulary, max-subtracted */
    const float mx = logits[qt_argmax(logits, V)];
    double sum = 0;
    for (int i = 0; i < V; i++) {
        s->prob[i] = expf((logits[i] - mx) * inv_t);
        sum += s->prob[i];
        s->idx[i] = i;
    }
    int n = V;
    if ((o->top_k > 0 && o->top_k < V) || o->top_p < 1) {
        /* most of the time goes here with a large vocabulary; a full sort is
         * ~10 ms for 150k ids, small next to a decode step */
        qsort_r(s->idx, (size_t)V, sizeof *s->idx, by_prob_desc, s->prob);
        if (o->top_k > 0 && o->top_k < n) n = o->top_k;
        double kept = 0;
        for (int i = 0; i < n; i++) kept += s->prob[s->idx[i]];
        if (o->top_p < 1) {
            /* HF's TopPLogitsWarper: drop the tail whose mass is <= 1 - p */
            double c = 0;
            int m = 0;
            while (m < n) {
                c += s->prob[s->idx[m]] / kept;
                m++;
                if (c >= o->top_p) break;
            }
            n = m;
            kept = 0;
            for (int i = 0; i < n; i++) kept += s->prob[s->idx[i]];
        }
        sum = kept;
    }
    const double u = (double)qt_rng_uniform(rng) * sum;
    double c = 0;
    for (int i = 0; i < n; i++) {
        c += s->prob[s->idx[i]];
        if (u < c) return s->idx[i];
    }
    return s->idx[n - 1]; /* rounding left u at the very top */
}
