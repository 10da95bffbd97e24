/* The training objective: supervised fine-tuning (the token-weighted mean of
 * the cross-entropy, trainer.h), or preference tuning on (prompt, chosen,
 * rejected) pairs with TRL's formulas and names (docs/preference.md):
 *
 *   dpo    DPOConfig: beta, loss_type sigmoid | ipo | hinge | robust,
 *          label_smoothing, reference_free. With
 *            z = (pc - pr) - (rc - rr)     (rc = rr = 0 when reference_free)
 *          sigmoid  -(1-ls) logsig(beta z) - ls logsig(-beta z)
 *          robust   (-(1-ls) logsig(beta z) + ls logsig(-beta z)) / (1 - 2 ls)
 *          hinge    relu(1 - beta z)
 *          ipo      (z - 1/(2 beta))^2, on per-token mean log-probs
 *          rewards  beta (pc - rc), beta (pr - rr)
 *   orpo   ORPOConfig: beta. NLL of the chosen answer (token mean) minus
 *          beta logsig(log_odds), log_odds = (pc - pr) - (log(1-e^pc) - log(1-e^pr))
 *          on per-token mean log-probs; rewards beta pc, beta pr.
 *   simpo  CPOConfig(loss_type="simpo"): beta, simpo_gamma, label_smoothing,
 *          cpo_alpha (0 here: SimPO as its paper and LLaMA-Factory define it;
 *          TRL's CPOConfig defaults to 1). z = pc - pr - simpo_gamma / beta on
 *          per-token mean log-probs, the sigmoid loss above, + cpo_alpha NLL.
 *
 * pc, pr (rc, rr) are the policy's (reference's) log-probabilities of the
 * chosen and rejected answers: summed over the answer's tokens (the prompt
 * carries no label), divided by their count where noted. The loss is the
 * mean over the pairs of the global batch, so its gradient with respect to
 * each answer token's log-prob is one weight per sequence. */
#ifndef QT_TRAIN_OBJECTIVE_H
#define QT_TRAIN_OBJECTIVE_H

#include <stdint.h>

#include <cjson/cJSON.h>

#define QT_PREF_MAX_PAIRS 1024 /* pairs in one micro-batch */

typedef enum { QT_OBJ_SFT = 0, QT_OBJ_DPO, QT_OBJ_ORPO, QT_OBJ_SIMPO } qt_obj_type;
typedef enum { QT_DPO_SIGMOID = 0, QT_DPO_IPO, QT_DPO_HINGE, QT_DPO_ROBUST } qt_dpo_loss;

typedef struct {
    qt_obj_type type;
    qt_dpo_loss loss_type;   /* dpo */
    double beta;             /* 0.1 (TRL's default for all three) */
    double label_smoothing;  /* dpo sigmoid/robust, simpo; 0 */
    int reference_free;      /* dpo; 0 */
    double simpo_gamma;      /* simpo; 0.5 (CPOConfig) */
    double cpo_alpha;        /* simpo: weight of the chosen answer's NLL; 0 */
    int precompute_ref;      /* dpo: precompute_ref_log_probs, -1 unset (then on for full fine-tuning, where
                                it is the only reference qtune keeps; off for LoRA, whose reference is the
                                adapter-off forward of each step) */
} qt_objective;

void qt_objective_default(qt_objective *o);
/* The job's "objective" object (NULL or absent: sft). Unknown keys, a key
 * that does not belong to the type, and values out of range are refused
 * with a sentence that names them; where names the job file. */
int qt_objective_parse(const cJSON *obj, const char *where, qt_objective *o);
/* "sft", "dpo (sigmoid, beta 0.1)", ... for the run line. */
void qt_objective_describe(const qt_objective *o, char *buf, size_t cap);
/* 1 when the objective needs the reference model's log-probs (dpo, unless reference_free). */
int qt_objective_needs_ref(const qt_objective *o);
/* 1 when the reference's log-probs come from one pass over the data before
 * training (precompute_ref_log_probs) rather than an adapter-off forward per
 * step: full fine-tuning always, LoRA when the job asks. */
int qt_objective_precomputes_ref(const qt_objective *o, int lora);
/* What `qtune plan` says of the objective: the rows of a pair and what the
 * reference costs ("" for sft). */
void qt_objective_plan_note(const qt_objective *o, int lora, char *buf, size_t cap);
/* 1 when the log-probs enter as per-token means (ipo, orpo, simpo). */
int qt_objective_averages(const qt_objective *o);

/* What a batch of pairs adds up to (sums over pairs; divide by the pair
 * count for TRL's means). */
typedef struct {
    double loss;             /* the batch's contribution to the step loss */
    double rewards_chosen, rewards_rejected, accuracies, margins;
    double logps_chosen, logps_rejected; /* as the loss sees them (per-token means for ipo/orpo/simpo) */
    double nll;              /* orpo, simpo with cpo_alpha: the chosen answers' summed NLL */
    double log_odds_ratio, log_odds_chosen; /* orpo */
    int64_t pairs;
} qt_pref_sums;

/* P pairs: policy log-prob sums pc[i], pr[i] over nc[i], nr[i] answer tokens,
 * the reference's rc, rr (NULL when not needed). inv_pairs = 1 / (pairs in
 * the global batch), inv_chosen = 1 / (chosen answer tokens in the global
 * batch, for the NLL terms). Writes wc[i], wr[i] = d loss / d (log-prob of
 * each answer token) of the chosen and rejected sequence and adds into s. */
void qt_objective_pairs(const qt_objective *o, int P, const double *pc, const double *pr, const double *rc,
                        const double *rr, const int64_t *nc, const int64_t *nr, double inv_pairs, double inv_chosen,
                        double *wc, double *wr, qt_pref_sums *s);

/* A micro-batch of P pairs holds 2P rows: rows 0 .. P-1 the chosen answers
 * (after their prompts), rows P .. 2P-1 the rejected ones in the same order
 * (TRL's concatenated batch). sum[r], n[r]: row r's summed log-prob of its
 * labelled targets and their count. */
void qt_pref_row_sums(const float *logp, const int32_t *targets, int B, int T, double *sum, int64_t *n);

/* The model's row-weight callback (model.h qt_row_weights_fn) for one
 * micro-batch: fill o, targets (the host batch's), ref_sum (B floats: the
 * reference's row sums, or NULL when the objective needs none), inv_pairs,
 * inv_chosen and scale (the fp16 loss scale S, else 1); sums accumulates. */
typedef struct {
    const qt_objective *o;
    const int32_t *targets;
    const double *ref_sum;
    double inv_pairs, inv_chosen, scale;
    qt_pref_sums sums;
} qt_pref_step;
int qt_pref_row_weights(void *user, const float *logp, int B, int T, float *row_scale);

#endif
