/* Preference objectives with TRL's formulas (objective.h); everything in
 * double, as the losses of a few hundred pairs are summed from sequence
 * log-probs of hundreds of nats. */
#include "train/objective.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core/error.h"
#include "data/batch.h"
#include "core/words.h"

void qt_objective_default(qt_objective *o) {
    memset(o, 0, sizeof *o);
    o->type = QT_OBJ_SFT;
    o->loss_type = QT_DPO_SIGMOID;
    o->beta = 0.1;
    o->simpo_gamma = 0.5;
    o->precompute_ref = -1;
}

static const char *const type_names[] = {"sft", "dpo", "orpo", "simpo", NULL};
static const char *const loss_names[] = {"sigmoid", "ipo", "hinge", "robust", NULL};

static int name_index(const char *s, const char *const *names) {
    for (int i = 0; names[i]; i++)
        if (!strcmp(s, names[i])) return i;
    return -1;
}

/* the keys each type reads ("type" everywhere) */
static int key_allowed(qt_obj_type t, const char *k) {
    if (!strcmp(k, "type")) return 1;
    if (t == QT_OBJ_DPO)
        return !strcmp(k, "beta") || !strcmp(k, "loss_type") || !strcmp(k, "label_smoothing") ||
               !strcmp(k, "reference_free") || !strcmp(k, "precompute_ref_log_probs");
    if (t == QT_OBJ_ORPO) return !strcmp(k, "beta");
    if (t == QT_OBJ_SIMPO)
        return !strcmp(k, "beta") || !strcmp(k, "simpo_gamma") || !strcmp(k, "gamma") ||
               !strcmp(k, "label_smoothing") || !strcmp(k, "cpo_alpha");
    return 0;
}

static int get_number(const cJSON *obj, const char *key, const char *where, double *v) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!it) return QT_OK;
    if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble))
        return QT_ERR(QT_EINVAL, "%s: objective.%s must be a number", where, key);
    *v = it->valuedouble;
    return QT_OK;
}

int qt_objective_parse(const cJSON *obj, const char *where, qt_objective *o) {
    qt_objective_default(o);
    if (!obj || cJSON_IsNull(obj)) return QT_OK;
    if (!cJSON_IsObject(obj))
        return QT_ERR(QT_EINVAL, "%s: \"objective\" must be an object such as {\"type\": \"dpo\", \"beta\": 0.1}",
                      where);
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(obj, "type");
    int ti = cJSON_IsString(t) ? name_index(t->valuestring, type_names) : -1;
    if (ti < 0)
        return QT_ERR(QT_EINVAL, "%s: objective.type must be \"sft\", \"dpo\", \"orpo\" or \"simpo\"%s%s%s", where,
                      cJSON_IsString(t) ? " (not \"" : "", cJSON_IsString(t) ? t->valuestring : "",
                      cJSON_IsString(t) ? "\")" : "");
    o->type = (qt_obj_type)ti;
    for (const cJSON *it = obj->child; it; it = it->next) {
        if (key_allowed(o->type, it->string)) continue;
        if (!strcmp(it->string, "gamma_beta_ratio"))
            return QT_ERR(QT_EINVAL, "%s: objective.gamma_beta_ratio is the SimPO repository's name; qtune takes "
                                     "TRL's simpo_gamma (the margin itself): write simpo_gamma = gamma_beta_ratio * beta",
                          where);
        static const char *const all[] = {"type", "beta", "loss_type", "label_smoothing", "reference_free",
                                          "simpo_gamma", "gamma", "cpo_alpha", "precompute_ref_log_probs",
                                          NULL};
        const char *near = qt_nearest_word(it->string, all);
        if (near && strcmp(near, it->string))
            return QT_ERR(QT_EINVAL, "%s: objective.%s is not a key of the objective; did you mean '%s'?", where,
                          it->string, near);
        return QT_ERR(QT_EINVAL, "%s: objective.%s does not apply to type \"%s\"; %s", where, it->string,
                      type_names[ti],
                      o->type == QT_OBJ_DPO     ? "dpo reads beta, loss_type, label_smoothing, reference_free, "
                                                          "precompute_ref_log_probs"
                      : o->type == QT_OBJ_ORPO  ? "orpo reads beta"
                      : o->type == QT_OBJ_SIMPO ? "simpo reads beta, simpo_gamma, label_smoothing, cpo_alpha"
                                                : "sft reads no other key");
    }
    QT_TRY(get_number(obj, "beta", where, &o->beta));
    QT_TRY(get_number(obj, "label_smoothing", where, &o->label_smoothing));
    QT_TRY(get_number(obj, "gamma", where, &o->simpo_gamma));
    QT_TRY(get_number(obj, "simpo_gamma", where, &o->simpo_gamma));
    QT_TRY(get_number(obj, "cpo_alpha", where, &o->cpo_alpha));
    const cJSON *lt = cJSON_GetObjectItemCaseSensitive(obj, "loss_type");
    if (lt) {
        int li = cJSON_IsString(lt) ? name_index(lt->valuestring, loss_names) : -1;
        if (li < 0)
            return QT_ERR(QT_EINVAL, "%s: objective.loss_type must be \"sigmoid\", \"ipo\", \"hinge\" or \"robust\" "
                                     "(TRL's DPOConfig names)", where);
        o->loss_type = (qt_dpo_loss)li;
    }
    const cJSON *rf = cJSON_GetObjectItemCaseSensitive(obj, "reference_free");
    if (rf) {
        if (!cJSON_IsBool(rf)) return QT_ERR(QT_EINVAL, "%s: objective.reference_free must be true or false", where);
        o->reference_free = cJSON_IsTrue(rf);
    }
    const cJSON *pc = cJSON_GetObjectItemCaseSensitive(obj, "precompute_ref_log_probs");
    if (pc) {
        if (!cJSON_IsBool(pc))
            return QT_ERR(QT_EINVAL, "%s: objective.precompute_ref_log_probs must be true or false", where);
        o->precompute_ref = cJSON_IsTrue(pc) ? 1 : 0;
    }
    if (!(o->beta > 0))
        return QT_ERR(QT_EINVAL, "%s: objective.beta must be above 0 (TRL's default is 0.1)", where);
    if (o->label_smoothing < 0 || o->label_smoothing >= 0.5)
        return QT_ERR(QT_EINVAL, "%s: objective.label_smoothing must be in [0, 0.5) (the probability that a "
                                 "pair's labels are flipped)", where);
    if (o->label_smoothing > 0 && o->type == QT_OBJ_DPO &&
        (o->loss_type == QT_DPO_HINGE || o->loss_type == QT_DPO_IPO))
        return QT_ERR(QT_EINVAL, "%s: objective.label_smoothing applies to loss_type \"sigmoid\" and \"robust\" only",
                      where);
    if (o->cpo_alpha < 0) return QT_ERR(QT_EINVAL, "%s: objective.cpo_alpha must be 0 or more", where);
    return QT_OK;
}

void qt_objective_describe(const qt_objective *o, char *buf, size_t cap) {
    switch (o->type) {
    case QT_OBJ_SFT: snprintf(buf, cap, "sft"); break;
    case QT_OBJ_DPO:
        snprintf(buf, cap, "dpo (%s, beta %g%s%s)", loss_names[o->loss_type], o->beta,
                 o->label_smoothing > 0 ? ", label smoothing" : "", o->reference_free ? ", reference-free" : "");
        break;
    case QT_OBJ_ORPO: snprintf(buf, cap, "orpo (beta %g)", o->beta); break;
    case QT_OBJ_SIMPO:
        snprintf(buf, cap, "simpo (beta %g, gamma %g%s)", o->beta, o->simpo_gamma, o->cpo_alpha > 0 ? ", + NLL" : "");
        break;
    }
}

int qt_objective_needs_ref(const qt_objective *o) { return o->type == QT_OBJ_DPO && !o->reference_free; }

int qt_objective_precomputes_ref(const qt_objective *o, int lora) {
    return qt_objective_needs_ref(o) && (o->precompute_ref > 0 || (!lora && o->precompute_ref < 0));
}

void qt_objective_plan_note(const qt_objective *o, int lora, char *buf, size_t cap) {
    char d[160];
    buf[0] = 0;
    if (o->type == QT_OBJ_SFT) return;
    qt_objective_describe(o, d, sizeof d);
    const char *ref =
        !qt_objective_needs_ref(o) ? "no reference model"
        : qt_objective_precomputes_ref(o, lora)
            ? "reference: one forward pass over every training and eval pair before step 1 (about a third of the "
              "compute of an epoch of steps; 16 bytes a pair kept, and cached beside the token cache), no frozen "
              "copy in memory"
            : "reference: a forward of the same rows with the adapter off before each micro-batch's forward and "
              "backward (no memory beyond the activations above; about a third more compute a step)";
    snprintf(buf, cap, "objective %s: a micro-batch of B pairs is 2B rows (a chosen and a rejected one; counted "
                       "above); %s", d, ref);
}

int qt_objective_averages(const qt_objective *o) {
    return o->type == QT_OBJ_ORPO || o->type == QT_OBJ_SIMPO || (o->type == QT_OBJ_DPO && o->loss_type == QT_DPO_IPO);
}

static double log_sigmoid(double x) { return x >= 0 ? -log1p(exp(-x)) : x - log1p(exp(x)); }
static double sigmoid(double x) { return x >= 0 ? 1 / (1 + exp(-x)) : exp(x) / (1 + exp(x)); }

/* The sigmoid family at u = beta z with label smoothing ls: loss and d loss / d u. */
static double sigmoid_loss(double u, double ls, int robust, double *dl_du) {
    if (robust) {
        *dl_du = (-(1 - ls) * sigmoid(-u) - ls * sigmoid(u)) / (1 - 2 * ls);
        return (-(1 - ls) * log_sigmoid(u) + ls * log_sigmoid(-u)) / (1 - 2 * ls);
    }
    *dl_du = -(1 - ls) * sigmoid(-u) + ls * sigmoid(u);
    return -(1 - ls) * log_sigmoid(u) - ls * log_sigmoid(-u);
}

void qt_objective_pairs(const qt_objective *o, int P, const double *pc, const double *pr, const double *rc,
                        const double *rr, const int64_t *nc, const int64_t *nr, double inv_pairs, double inv_chosen,
                        double *wc, double *wr, qt_pref_sums *s) {
    const int avg = qt_objective_averages(o), ref = qt_objective_needs_ref(o);
    const double beta = o->beta, ls = o->label_smoothing;
    for (int i = 0; i < P; i++) {
        /* an answer with no token (cut off by seq_len) counts as log-prob 0 and gets no gradient */
        double kc = avg && nc[i] > 0 ? 1.0 / (double)nc[i] : 1.0, kr = avg && nr[i] > 0 ? 1.0 / (double)nr[i] : 1.0;
        double c = pc[i] * kc, r = pr[i] * kr;
        double L, dc, dr; /* the pair's loss and its derivatives w.r.t. c and r */
        double rew_c, rew_r;
        if (o->type == QT_OBJ_DPO) {
            double c0 = ref ? rc[i] * kc : 0, r0 = ref ? rr[i] * kr : 0;
            double z = (c - r) - (c0 - r0), dz;
            if (o->loss_type == QT_DPO_IPO) {
                double e = z - 1 / (2 * beta);
                L = e * e;
                dz = 2 * e;
            } else if (o->loss_type == QT_DPO_HINGE) {
                L = 1 - beta * z > 0 ? 1 - beta * z : 0;
                dz = 1 - beta * z > 0 ? -beta : 0;
            } else {
                double du;
                L = sigmoid_loss(beta * z, ls, o->loss_type == QT_DPO_ROBUST, &du);
                dz = beta * du;
            }
            dc = dz, dr = -dz;
            rew_c = beta * (c - c0), rew_r = beta * (r - r0);
        } else if (o->type == QT_OBJ_ORPO) {
            /* log(1 - e^x) = log(-expm1(x)); d/dx of log_odds in c is 1 / (1 - e^c) */
            double lo = (c - r) - (log(-expm1(c)) - log(-expm1(r)));
            double ratio = log_sigmoid(lo);
            L = -beta * ratio;
            double dlo = -beta * sigmoid(-lo);
            dc = dlo / -expm1(c);
            dr = -dlo / -expm1(r);
            rew_c = beta * c, rew_r = beta * r;
            s->log_odds_ratio += ratio;
            s->log_odds_chosen += lo;
        } else { /* simpo */
            double du;
            L = sigmoid_loss(beta * (c - r - o->simpo_gamma / beta), ls, 0, &du);
            dc = beta * du, dr = -beta * du;
            rew_c = beta * c, rew_r = beta * r;
        }
        s->loss += L * inv_pairs;
        wc[i] = dc * kc * inv_pairs;
        wr[i] = dr * kr * inv_pairs;
        /* the NLL of the chosen answer: token mean over the global batch's chosen tokens */
        double alpha = o->type == QT_OBJ_ORPO ? 1.0 : o->type == QT_OBJ_SIMPO ? o->cpo_alpha : 0.0;
        if (o->type == QT_OBJ_ORPO || o->type == QT_OBJ_SIMPO) s->nll += -pc[i];
        if (alpha > 0) {
            s->loss += alpha * -pc[i] * inv_chosen;
            wc[i] += -alpha * inv_chosen;
        }
        s->rewards_chosen += rew_c;
        s->rewards_rejected += rew_r;
        s->accuracies += rew_c > rew_r;
        s->margins += rew_c - rew_r;
        s->logps_chosen += c;
        s->logps_rejected += r;
        s->pairs++;
    }
}

void qt_pref_row_sums(const float *logp, const int32_t *targets, int B, int T, double *sum, int64_t *n) {
    for (int r = 0; r < B; r++) {
        double acc = 0;
        int64_t k = 0;
        for (int t = 0; t < T; t++) {
            size_t i = (size_t)r * T + t;
            if (targets[i] == QT_IGNORE_INDEX) continue;
            acc += logp[i];
            k++;
        }
        sum[r] = acc;
        n[r] = k;
    }
}

int qt_pref_row_weights(void *user, const float *logp, int B, int T, float *row_scale) {
    qt_pref_step *st = user;
    if (B % 2)
        return QT_ERR(QT_EINVAL, "a preference micro-batch holds chosen and rejected rows in pairs; got %d rows (a bug)",
                      B);
    int P = B / 2;
    double sum[2 * QT_PREF_MAX_PAIRS], w[2 * QT_PREF_MAX_PAIRS];
    int64_t n[2 * QT_PREF_MAX_PAIRS];
    if (P > QT_PREF_MAX_PAIRS)
        return QT_ERR(QT_EINVAL, "%d pairs in one micro-batch; at most %d (lower the micro-batch size)", P,
                      QT_PREF_MAX_PAIRS);
    qt_pref_row_sums(logp, st->targets, B, T, sum, n);
    const double *ref = st->ref_sum;
    qt_objective_pairs(st->o, P, sum, sum + P, ref, ref ? ref + P : NULL, n, n + P, st->inv_pairs, st->inv_chosen, w,
                       w + P, &st->sums);
    /* the lm_head's backward scales d(token loss) = -d(log-prob) */
    for (int r = 0; r < B; r++) row_scale[r] = (float)(-st->scale * w[r]);
    return QT_OK;
}
