/* Forward-only passes over preference pairs (docs/preference.md), shared by
 * the trainer and `qtune eval`:
 *   - the sequence log-probs of a list of pairs (the policy's, or the
 *     reference's: the adapter off, or the starting weights);
 *   - a held-out evaluation: TRL's eval_ metrics from the policy's and the
 *     reference's log-probs;
 *   - the cache of precomputed reference log-probs (precompute_ref_log_probs),
 *     beside the token cache, keyed by the model folder and the tokens. */
#ifndef QT_TRAIN_PREF_PASS_H
#define QT_TRAIN_PREF_PASS_H

#include <stdint.h>

#include "data/pref.h"
#include "model/model.h"
#include "train/objective.h"

/* The summed log-probs of the labelled tokens of pairs idx[0..P): sum[2j] of
 * pair idx[j]'s chosen side, sum[2j+1] of its rejected side, n[..] their
 * token counts. Micro-batches of up to B pairs (2B rows of T; b holds them,
 * logp 2B*T floats); adapter 0 runs with the LoRA adapter switched off. */
int qt_pref_logps(qt_model *m, const dl_pref_set *set, const int64_t *idx, int64_t P, int B, int T, int adapter,
                  qt_batch *b, float *logp, double *sum, int64_t *n);

/* TRL's evaluation metrics over P pairs from the policy's sums (pol, n as
 * qt_pref_logps writes them) and the reference's (ref, NULL when the
 * objective needs none); adds into s and *chosen_tokens. */
void qt_pref_eval_add(const qt_objective *o, int64_t P, const double *pol, const int64_t *n, const double *ref,
                      qt_pref_sums *s, int64_t *chosen_tokens);
/* The eval loss from the sums: the mean of the pairs' losses, plus the NLL
 * term (token mean over the chosen answers) for orpo and simpo's cpo_alpha. */
double qt_pref_eval_loss(const qt_objective *o, const qt_pref_sums *s, int64_t chosen_tokens);
/* TRL's names with prefix ("eval_" or ""), as JSON fields: ", \"eval_loss\": ...". */
void qt_pref_metrics_json(const qt_objective *o, const char *prefix, double loss, const qt_pref_sums *s,
                          int64_t chosen_tokens, char *buf, size_t cap);

/* The key of a reference cache: the model folder (config.json's bytes, each
 * weights file's name, size and modification time), the tokens of every
 * side, the compute dtype and the backend. */
uint64_t qt_pref_ref_key(const char *model_dir, const dl_pref_set *set, const char *dtype, const char *backend);
/* Where the reference log-probs of data_path are cached: beside its token
 * cache (data.cache_dir, else <its folder>/.qtune-cache), "<name>.<hash>.qref". */
int qt_pref_ref_cache_path(const char *data_path, const char *cache_dir, char *out, size_t cap);
/* 1 when path holds n (2 n_pairs) sums under key (read into sum), else 0. */
int qt_pref_ref_cache_read(const char *path, uint64_t key, int64_t n, double *sum);
/* Writes them atomically (the folder is made when missing). */
int qt_pref_ref_cache_write(const char *path, uint64_t key, int64_t n, const double *sum);

#endif
