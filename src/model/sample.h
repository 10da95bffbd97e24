/* Choosing the next token from a row of logits, as Hugging Face's generate
 * does: temperature, then top-k, then top-p (nucleus), then one draw from the
 * renormalised distribution with a seeded qt_rng. Temperature 0 is greedy
 * (argmax; the lowest id wins a tie, as torch.argmax). */
#ifndef QT_MODEL_SAMPLE_H
#define QT_MODEL_SAMPLE_H

#include <stdint.h>

#include "core/rng.h"

typedef struct {
    float temperature; /* 0 (or below about 2.9e-39, where 1 / t overflows): greedy */
    int top_k;         /* 0: off */
    float top_p;       /* 1: off; keep the smallest set of tokens whose probability reaches top_p */
} qt_sample_opts;

typedef struct {
    int V;          /* vocabulary size */
    float *prob;    /* (V) candidate probabilities */
    int32_t *idx;   /* (V) candidate ids, sorted by probability when top-k/top-p is on */
} qt_sampler;

int qt_sampler_init(qt_sampler *s, int V);
void qt_sampler_free(qt_sampler *s);
/* QT_EINVAL naming the option when temperature < 0, top_k < 0 or top_p not in (0, 1]. */
int qt_sample_opts_check(const qt_sample_opts *o);

/* Index of the largest of V logits (first one on a tie; -0 ties +0; NaN is
 * never the largest unless every logit is NaN, then 0). */
int32_t qt_argmax(const float *logits, int V);
/* The next token id for one row of V logits (not modified). */
int32_t qt_sample(qt_sampler *s, const float *logits, const qt_sample_opts *o, qt_rng *rng);

#endif
