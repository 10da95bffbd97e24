/* DeepSpeed JSON config -> qt_ds_config. Each section has a list of the keys
 * qtune honours; every other key is named in a warning and recorded. */
#include "train/ds_config.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "core/error.h"
#include "core/fs.h"
#include "core/json_range.h"
#include "core/log.h"
#include "core/mem.h"
#include "core/words.h"

/* Hugging Face Trainer's TrainingArguments defaults: what "auto" means for
 * the optimizer (HF fills "auto" from these when it launches DeepSpeed). */
#define HF_LR 5e-5
#define HF_BETA1 0.9
#define HF_BETA2 0.999
#define HF_EPS 1e-8
#define HF_WEIGHT_DECAY 0.0
#define HF_MAX_GRAD_NORM 1.0
#define HF_PER_DEVICE_BATCH_NOTE                                                                                       \
    "qtune's micro-batch when none is given; the HF Trainer fills per_device_train_batch_size here"
#define DS_DEFAULT "DeepSpeed's default"

/* Parsing context: the config's name in messages and the output (for the
 * ignored-key list). check_only: qt_ds_config_check, which (quiet) says nothing and
 * leaves out the batch-size arithmetic. */
typedef struct {
    const char *where;
    qt_ds_config *out;
    int check_only;
    int quiet;              /* no warning or note on stderr (the checks, the doctor's collecting parse) */
    int strict;             /* qt_ds_config_check_strict: an ignored key is an error */
    char strict_msg[512];   /* the first such key's sentence ("" = none) */
    qt_ds_problem_fn sink;  /* qt_ds_config_problems: each section's problem goes here and the parse goes on */
    void *sink_ctx;
    int n_problems;
} ds_ctx;

/* A section's problem: with a sink it is handed over and the parse goes on with the next section (0 returned);
 * without one the parse stops with rc. */
static int section_problem(ds_ctx *x, int rc) {
    if (!x->sink || rc == QT_ENOMEM) return rc;
    x->sink(x->sink_ctx, qt_error_message());
    qt_error_clear();
    x->n_problems++;
    return QT_OK;
}

#define SECTION(call)                                                                                                  \
    do {                                                                                                               \
        int rc_ = (call);                                                                                              \
        if (rc_ != QT_OK) QT_TRY(section_problem(x, rc_));                                                             \
    } while (0)

/* A warning, unless only checking (the run's own parse says it once) */
#define ds_warn(x, ...)                                                                                                \
    do {                                                                                                               \
        if (!(x)->quiet) qt_warn(__VA_ARGS__);                                                                         \
    } while (0)

static void record_ignored(qt_ds_config *c, const char *path) {
    if (c->n_ignored < QT_DS_MAX_IGNORED) {
        snprintf(c->ignored[c->n_ignored], sizeof c->ignored[0], "%s", path);
        c->n_ignored++;
    }
}

/* honoured: the section's keys, for a near spelling. */
static void ignore_key(ds_ctx *x, const char *section, const char *key, const char *const *honoured) {
    char path[96], msg[512];
    if (section) snprintf(path, sizeof path, "%s.%s", section, key);
    else snprintf(path, sizeof path, "%s", key);
    const char *near = honoured ? qt_nearest_word(key, honoured) : NULL;
    if (!section && (!strcmp(key, "activation_checkpointing") || !strcmp(key, "gradient_checkpointing")))
        snprintf(msg, sizeof msg, "%s: DeepSpeed key \"%s\" has no effect in qtune and is ignored; set the job's "
                 "train.gradient_checkpointing to true to recompute activations",
                 x->where, path);
    else if (near)
        snprintf(msg, sizeof msg, "%s: DeepSpeed key \"%s\" has no effect in qtune and is ignored; did you mean "
                 "\"%s%s%s\"?", x->where, path, section ? section : "", section ? "." : "", near);
    else snprintf(msg, sizeof msg, "%s: DeepSpeed key \"%s\" has no effect in qtune and is ignored", x->where, path);
    if (x->strict && !x->strict_msg[0]) snprintf(x->strict_msg, sizeof x->strict_msg, "%s", msg);
    ds_warn(x, "%s", msg);
    record_ignored(x->out, path);
}

static void record_resolved(qt_ds_config *c, const char *line) {
    if (c->n_resolved < QT_DS_MAX_RESOLVED) snprintf(c->resolved[c->n_resolved++], sizeof c->resolved[0], "%s", line);
}

/* Records (and says, at info level) what an "auto" became and why: the HF
 * Trainer fills these from its own arguments, and qtune has no such
 * arguments, so the value chosen must be visible. */
static void note_auto(ds_ctx *x, const char *section, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void note_auto(ds_ctx *x, const char *section, const char *key, const char *fmt, ...) {
    char what[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    qt_ds_config *c = x->out;
    char line[sizeof c->resolved[0]];
    snprintf(line, sizeof line, "%s%s%s \"auto\" -> %s", section ? section : "", section ? "." : "", key, what);
    record_resolved(c, line);
    if (!x->quiet) qt_info("%s: %s", x->where, line);
}

static int in_list(const char *key, const char *const *list) {
    for (; *list; list++)
        if (strcmp(key, *list) == 0) return 1;
    return 0;
}

/* Warns about every key of obj not in honoured. */
static void warn_unknown(ds_ctx *x, const cJSON *obj, const char *section, const char *const *honoured) {
    for (const cJSON *it = obj ? obj->child : NULL; it; it = it->next)
        if (!it->string || !in_list(it->string, honoured))
            ignore_key(x, section, it->string ? it->string : "?", honoured);
}

static int is_auto(const cJSON *v) { return cJSON_IsString(v) && strcmp(v->valuestring, "auto") == 0; }

static void key_path(char *buf, size_t cap, const char *section, const char *key) {
    if (section) snprintf(buf, cap, "%s.%s", section, key);
    else snprintf(buf, cap, "%s", key);
}

/* Value getters. Each returns QT_OK and leaves *out alone when the key is
 * missing; *was_auto (when not NULL) reports "auto", which also leaves *out
 * alone; anything but the right type is an error naming the key. */
static int get_number(ds_ctx *x, const cJSON *obj, const char *section, const char *key, double *out, int *was_auto) {
    if (was_auto) *was_auto = 0;
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!v || cJSON_IsNull(v)) return QT_OK;
    char p[96];
    key_path(p, sizeof p, section, key);
    if (is_auto(v)) {
        if (!was_auto) return QT_ERR(QT_EINVAL, "%s: \"%s\" cannot be \"auto\"; give a number", x->where, p);
        *was_auto = 1;
        return QT_OK;
    }
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
        return QT_ERR(QT_EINVAL, "%s: \"%s\" must be a number%s", x->where, p, was_auto ? " or \"auto\"" : "");
    *out = v->valuedouble;
    return QT_OK;
}

static int get_int(ds_ctx *x, const cJSON *obj, const char *section, const char *key, int64_t lo, int64_t hi,
                   int64_t *out, int *was_auto, int *present) {
    if (present) *present = 0;
    double d = NAN;
    QT_TRY(get_number(x, obj, section, key, &d, was_auto));
    if (isnan(d)) return QT_OK;
    char p[96];
    key_path(p, sizeof p, section, key);
    if (d != floor(d) || d < (double)lo || d > (double)hi)
        return QT_ERR(QT_EINVAL, "%s: \"%s\" is %g; it must be a whole number in [%lld, %lld]", x->where, p, d,
                      (long long)lo, (long long)hi);
    *out = (int64_t)d;
    if (present) *present = 1;
    return QT_OK;
}

/* auto_why: NULL when "auto" is not accepted, else why the default stands
 * (said with the value when "auto" is given). */
static int get_bool(ds_ctx *x, const cJSON *obj, const char *section, const char *key, int *out, const char *auto_why) {
    const int allow_auto = auto_why != NULL;
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!v || cJSON_IsNull(v)) return QT_OK;
    if (allow_auto && is_auto(v)) {
        note_auto(x, section, key, "%s (%s)", *out ? "true" : "false", auto_why);
        return QT_OK;
    }
    char p[96];
    key_path(p, sizeof p, section, key);
    /* 0 and 1 as well, as DeepSpeed's own config classes (pydantic bools)
     * take them: `--set deepspeed.fp16.enabled=1` over an "auto" gives 1 */
    if (cJSON_IsNumber(v) && (v->valuedouble == 0 || v->valuedouble == 1)) {
        *out = v->valuedouble == 1;
        return QT_OK;
    }
    if (!cJSON_IsBool(v))
        return QT_ERR(QT_EINVAL, "%s: \"%s\" must be true or false (or 1 or 0%s)", x->where, p,
                      allow_auto ? ", or \"auto\"" : "");
    *out = cJSON_IsTrue(v);
    return QT_OK;
}

/* A section that must be an object when present. */
static int get_section(ds_ctx *x, const cJSON *obj, const char *section, const char *key, const cJSON **out) {
    *out = NULL;
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!v || cJSON_IsNull(v)) return QT_OK;
    char p[96];
    key_path(p, sizeof p, section, key);
    if (!cJSON_IsObject(v)) return QT_ERR(QT_EINVAL, "%s: \"%s\" must be a JSON object", x->where, p);
    *out = v;
    return QT_OK;
}

void qt_ds_config_default(qt_ds_config *c, int world) {
    memset(c, 0, sizeof *c);
    c->world = world;
    c->micro_batch = 1;
    c->grad_accum = 1;
    c->train_batch_size = world;
    c->gradient_clipping = 0.0;
    c->steps_per_print = 10;
    snprintf(c->optimizer_type, sizeof c->optimizer_type, "AdamW");
    qt_adam_cfg_default(&c->adam);
    c->adam.lr = HF_LR;
    c->adam.weight_decay = HF_WEIGHT_DECAY;
    qt_sched_default(&c->sched, QT_SCHED_CONSTANT, c->adam.lr);
    qt_loss_scaler_cfg_default(&c->scaler);
    c->zero.reduce_bucket_size = 5e8;
    c->zero.allgather_bucket_size = 5e8;
    c->zero.contiguous_gradients = 1;
    c->zero.reduce_scatter = 1;
    c->zero.allgather_partitions = 1;
    c->zero.prefetch_bucket_size = 5e7; /* DeepSpeed's stage-3 defaults */
    c->zero.param_persistence_threshold = 1e5;
    c->zero.max_live_parameters = 1e9;
    c->zero.max_reuse_distance = 1e9;
}

/* ---- batch sizes ------------------------------------------------------- */

static int parse_batch(ds_ctx *x, const cJSON *j) {
    qt_ds_config *c = x->out;
    const int64_t big = (int64_t)1 << 40;
    int64_t tb = 0, mb = 0, ga = 0;
    int has_tb, has_mb, has_ga, auto_tb, auto_mb, auto_ga;
    QT_TRY(get_int(x, j, NULL, "train_batch_size", 1, big, &tb, &auto_tb, &has_tb));
    /* the loop holds micro-batch and accumulation in ints; these bounds also
     * keep mb * ga * world below int64's range */
    const int64_t small = (int64_t)1 << 20;
    QT_TRY(get_int(x, j, NULL, "train_micro_batch_size_per_gpu", 1, small, &mb, &auto_mb, &has_mb));
    QT_TRY(get_int(x, j, NULL, "gradient_accumulation_steps", 1, small, &ga, &auto_ga, &has_ga));
    if (x->check_only) return QT_OK; /* what follows depends on the world size */
    const int64_t w = c->world;
    /* "auto" first, as the HF Trainer fills it before DeepSpeed sees the
     * config. The HF Trainer would put its per_device_train_batch_size into
     * an "auto" micro-batch; qtune has none and takes 1 (the batch size a
     * large model fits), unless train_batch_size and the accumulation are
     * both numbers, which fix it. An "auto" accumulation is then what makes
     * up a given train_batch_size, so {"train_batch_size": 32} with the rest
     * "auto" is 1 x 32 x ranks, never a micro-batch of 32. */
    if (auto_mb) {
        if (has_tb && has_ga) {
            mb = tb / w / ga;
            note_auto(x, NULL, "train_micro_batch_size_per_gpu",
                      "%lld (train_batch_size %lld / gradient_accumulation_steps %lld / %lld rank(s))", (long long)mb,
                      (long long)tb, (long long)ga, (long long)w);
        } else {
            mb = 1;
            note_auto(x, NULL, "train_micro_batch_size_per_gpu", "1 (%s)", HF_PER_DEVICE_BATCH_NOTE);
        }
        has_mb = 1;
    }
    if (auto_ga) {
        if (has_tb && !has_mb) {
            ga = 1;
            note_auto(x, NULL, "gradient_accumulation_steps",
                      "1 (the HF Trainer's default; with train_micro_batch_size_per_gpu not given, DeepSpeed makes "
                      "the micro-batch train_batch_size / ranks)");
        } else if (has_tb) {
            ga = tb / mb / w;
            note_auto(x, NULL, "gradient_accumulation_steps",
                      "%lld (train_batch_size %lld / micro-batch %lld / %lld rank(s))", (long long)ga, (long long)tb,
                      (long long)mb, (long long)w);
        } else {
            ga = 1;
            note_auto(x, NULL, "gradient_accumulation_steps", "1 (the HF Trainer's default)");
        }
        has_ga = 1;
    }
    if (auto_tb && has_mb) {
        if (!has_ga) {
            ga = 1;
            has_ga = 1;
        }
        tb = mb * ga * w;
        has_tb = 1;
        note_auto(x, NULL, "train_batch_size", "%lld (micro-batch %lld x accumulation %lld x %lld rank(s))",
                  (long long)tb, (long long)mb, (long long)ga, (long long)w);
    }
    /* DeepSpeed's _set_batch_related_parameters, case by case. */
    if (has_tb && has_mb && has_ga) {
    } else if (has_tb && has_mb) {
        ga = tb / mb / w;
    } else if (has_tb && has_ga) {
        mb = tb / w / ga;
    } else if (has_mb && has_ga) {
        tb = mb * ga * w;
    } else if (has_tb) {
        ga = 1;
        mb = tb / w;
    } else if (has_mb) {
        ga = 1;
        tb = mb * w;
    } else if (auto_tb) {
        /* train_batch_size "auto" with neither of the others given */
        mb = 1;
        if (!has_ga) ga = 1;
        tb = mb * ga * w;
        note_auto(x, NULL, "train_batch_size", "%lld (micro-batch 1 x accumulation %lld x %lld rank(s); %s)",
                  (long long)tb, (long long)ga, (long long)w, HF_PER_DEVICE_BATCH_NOTE);
    } else {
        return QT_ERR(QT_EINVAL,
                      "%s: neither train_batch_size nor train_micro_batch_size_per_gpu is set; set one of them "
                      "(batch = micro-batch x gradient_accumulation_steps x %lld ranks)",
                      x->where, (long long)w);
    }
    if (mb > small || ga > small)
        return QT_ERR(QT_EINVAL,
                      "%s: train_batch_size %lld gives train_micro_batch_size_per_gpu %lld and "
                      "gradient_accumulation_steps %lld; each must be at most %lld, so lower train_batch_size",
                      x->where, (long long)tb, (long long)mb, (long long)ga, (long long)small);
    if (mb < 1 || ga < 1 || tb != mb * ga * w)
        return QT_ERR(QT_EINVAL,
                      "%s: train_batch_size %lld is not train_micro_batch_size_per_gpu %lld x "
                      "gradient_accumulation_steps %lld x world size %lld (= %lld); change them so that "
                      "batch = micro-batch x accumulation x ranks",
                      x->where, (long long)(has_tb ? tb : mb * ga * w), (long long)mb, (long long)ga, (long long)w,
                      (long long)(mb * ga * w));
    c->train_batch_size = tb;
    c->micro_batch = mb;
    c->grad_accum = ga;
    return QT_OK;
}

/* ---- optimizer ---------------------------------------------------------- */

static int parse_optimizer(ds_ctx *x, const cJSON *opt) {
    qt_ds_config *c = x->out;
    static const char *const keys[] = {"type", "params", NULL};
    static const char *const pkeys[] = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "bias_correction",
                                        "torch_adam", "amsgrad", NULL};
    warn_unknown(x, opt, "optimizer", keys);
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(opt, "type");
    if (!cJSON_IsString(type))
        return QT_ERR(QT_EINVAL, "%s: optimizer.type must be a string, \"Adam\" or \"AdamW\"", x->where);
    int adamw;
    if (strcasecmp(type->valuestring, "adamw") == 0) adamw = 1;
    else if (strcasecmp(type->valuestring, "adam") == 0) adamw = 0;
    else
        return QT_ERR(QT_EUNSUPPORTED,
                      "%s: optimizer.type \"%s\" is not supported; qtune implements \"Adam\" and \"AdamW\"", x->where,
                      type->valuestring);
    snprintf(c->optimizer_type, sizeof c->optimizer_type, "%s", adamw ? "AdamW" : "Adam");
    /* With an optimizer section DeepSpeed's FusedAdam defaults apply (lr 1e-3);
     * "auto" takes the HF Trainer's values. */
    qt_adam_cfg_default(&c->adam);
    const cJSON *p;
    QT_TRY(get_section(x, opt, "optimizer", "params", &p));
    if (!p) return QT_OK;
    if (cJSON_GetObjectItemCaseSensitive(p, "max_grad_norm"))
        return QT_ERR(QT_EINVAL,
                      "%s: optimizer.params.max_grad_norm is not an optimizer parameter (DeepSpeed refuses it too); "
                      "move the value to the top-level \"gradient_clipping\"",
                      x->where);
    warn_unknown(x, p, "optimizer.params", pkeys);
    int a;
    QT_TRY(get_number(x, p, "optimizer.params", "lr", &c->adam.lr, &a));
    if (a) {
        c->adam.lr = HF_LR;
        note_auto(x, "optimizer.params", "lr", "%g (the HF Trainer's learning_rate default)", HF_LR);
    }
    QT_TRY(get_number(x, p, "optimizer.params", "eps", &c->adam.eps, &a));
    if (a) {
        c->adam.eps = HF_EPS;
        note_auto(x, "optimizer.params", "eps", "%g (the HF Trainer's adam_epsilon default)", HF_EPS);
    }
    QT_TRY(get_number(x, p, "optimizer.params", "weight_decay", &c->adam.weight_decay, &a));
    if (a) {
        c->adam.weight_decay = HF_WEIGHT_DECAY;
        note_auto(x, "optimizer.params", "weight_decay", "%g (the HF Trainer's weight_decay default)", HF_WEIGHT_DECAY);
    }
    const cJSON *betas = cJSON_GetObjectItemCaseSensitive(p, "betas");
    if (is_auto(betas)) {
        c->adam.beta1 = HF_BETA1;
        c->adam.beta2 = HF_BETA2;
        note_auto(x, "optimizer.params", "betas", "[%g, %g] (the HF Trainer's adam_beta1/adam_beta2 defaults)",
                  HF_BETA1, HF_BETA2);
    } else if (betas && !cJSON_IsNull(betas)) {
        if (!cJSON_IsArray(betas) || cJSON_GetArraySize(betas) != 2 || !cJSON_IsNumber(cJSON_GetArrayItem(betas, 0)) ||
            !cJSON_IsNumber(cJSON_GetArrayItem(betas, 1)))
            return QT_ERR(QT_EINVAL, "%s: optimizer.params.betas must be two numbers, e.g. [0.9, 0.999], or \"auto\"",
                          x->where);
        c->adam.beta1 = cJSON_GetArrayItem(betas, 0)->valuedouble;
        c->adam.beta2 = cJSON_GetArrayItem(betas, 1)->valuedouble;
    }
    /* DeepSpeed: effective adam_w_mode = (type is AdamW) or adam_w_mode,
     * which defaults to true. */
    int w_mode = 1;
    QT_TRY(get_bool(x, p, "optimizer.params", "adam_w_mode", &w_mode, NULL));
    c->adam.decoupled = adamw || w_mode;
    QT_TRY(get_bool(x, p, "optimizer.params", "bias_correction", &c->adam.bias_correction, NULL));
    int flag = 0;
    QT_TRY(get_bool(x, p, "optimizer.params", "torch_adam", &flag, NULL)); /* same arithmetic either way */
    flag = 0;
    QT_TRY(get_bool(x, p, "optimizer.params", "amsgrad", &flag, NULL));
    if (flag)
        return QT_ERR(QT_EUNSUPPORTED, "%s: optimizer.params.amsgrad true is not supported; remove it or set false",
                      x->where);
    char where[600];
    snprintf(where, sizeof where, "%.500s: optimizer.params", x->where); /* the errors name the key */
    return qt_adam_cfg_check(&c->adam, where);
}

/* ---- scheduler ---------------------------------------------------------- */

static int parse_scheduler(ds_ctx *x, const cJSON *sch) {
    qt_ds_config *c = x->out;
    static const char *const keys[] = {"type", "params", NULL};
    static const char *const warmup_keys[] = {"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                                              "last_batch_iteration", NULL};
    static const char *const decay_keys[] = {"warmup_min_lr",        "warmup_max_lr", "warmup_num_steps",
                                             "warmup_type",          "total_num_steps",
                                             "last_batch_iteration", NULL};
    static const char *const cosine_keys[] = {"total_num_steps", "warmup_min_ratio",     "warmup_num_steps",
                                              "cos_min_ratio",   "warmup_type",          "last_batch_iteration",
                                              NULL};
    warn_unknown(x, sch, "scheduler", keys);
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(sch, "type");
    if (!cJSON_IsString(type))
        return QT_ERR(QT_EINVAL, "%s: scheduler.type must be a string: WarmupLR, WarmupDecayLR or WarmupCosineLR",
                      x->where);
    qt_sched_type t;
    const char *const *pk;
    if (strcasecmp(type->valuestring, "WarmupLR") == 0) t = QT_SCHED_WARMUP_LR, pk = warmup_keys;
    else if (strcasecmp(type->valuestring, "WarmupDecayLR") == 0) t = QT_SCHED_WARMUP_DECAY_LR, pk = decay_keys;
    else if (strcasecmp(type->valuestring, "WarmupCosineLR") == 0) t = QT_SCHED_WARMUP_COSINE_LR, pk = cosine_keys;
    else
        return QT_ERR(QT_EUNSUPPORTED,
                      "%s: scheduler.type \"%s\" is not supported; use WarmupLR, WarmupDecayLR or WarmupCosineLR",
                      x->where, type->valuestring);
    qt_sched *s = &c->sched;
    qt_sched_default(s, t, c->adam.lr);
    const cJSON *p;
    QT_TRY(get_section(x, sch, "scheduler", "params", &p));
    if (p) warn_unknown(x, p, "scheduler.params", pk);
    const char *sec = "scheduler.params";
    int a, present;
    if (t != QT_SCHED_WARMUP_COSINE_LR) {
        QT_TRY(get_number(x, p, sec, "warmup_min_lr", &s->warmup_min_lr, &a));
        if (a) {
            s->warmup_min_lr = 0.0;
            note_auto(x, sec, "warmup_min_lr", "0 (the HF Trainer's choice)");
        }
        QT_TRY(get_number(x, p, sec, "warmup_max_lr", &s->warmup_max_lr, &a));
        if (a) {
            s->warmup_max_lr = c->adam.lr;
            note_auto(x, sec, "warmup_max_lr", "%g (the optimizer's lr)", c->adam.lr);
        }
    } else {
        QT_TRY(get_number(x, p, sec, "warmup_min_ratio", &s->warmup_min_ratio, NULL));
        QT_TRY(get_number(x, p, sec, "cos_min_ratio", &s->cos_min_ratio, NULL));
    }
    QT_TRY(get_int(x, p, sec, "warmup_num_steps", 0, (int64_t)1 << 50, &s->warmup_num_steps, &a, NULL));
    if (a) { /* HF warmup_steps default; DeepSpeed then uses 2 */
        s->warmup_num_steps = 0;
        note_auto(x, sec, "warmup_num_steps",
                  "0 (the HF Trainer's warmup_steps default; the schedule warms up over 2 "
                  "steps, DeepSpeed's minimum)");
    }
    int64_t lbi = -1;
    QT_TRY(get_int(x, p, sec, "last_batch_iteration", -1, (int64_t)1 << 50, &lbi, NULL, NULL));
    if (lbi != -1)
        ds_warn(x, "%s: scheduler.params.last_batch_iteration %lld is ignored; qtune resumes the schedule from its "
                "checkpoints",
                x->where, (long long)lbi);
    const cJSON *wt = p ? cJSON_GetObjectItemCaseSensitive(p, "warmup_type") : NULL;
    if (wt && !cJSON_IsNull(wt)) {
        if (cJSON_IsString(wt) && strcmp(wt->valuestring, "linear") == 0) s->warmup_type = QT_WARMUP_LINEAR;
        else if (cJSON_IsString(wt) && strcmp(wt->valuestring, "log") == 0) s->warmup_type = QT_WARMUP_LOG;
        else {
            /* DeepSpeed warns and falls back to log. */
            ds_warn(x, "%s: scheduler.params.warmup_type is not \"log\" or \"linear\"; using \"log\" as DeepSpeed does",
                    x->where);
            s->warmup_type = QT_WARMUP_LOG;
        }
    }
    if (t != QT_SCHED_WARMUP_LR) {
        QT_TRY(get_int(x, p, sec, "total_num_steps", 0, (int64_t)1 << 50, &s->total_num_steps, &a, &present));
        if (a) c->total_num_steps_auto = 1;
        else if (!present)
            return QT_ERR(QT_EINVAL,
                          "%s: scheduler %s needs params.total_num_steps (a number, or \"auto\" for train.max_steps)",
                          x->where, qt_sched_name(t));
        else {
            QT_TRY(qt_sched_check(s, x->where));
            if (!x->quiet) qt_sched_warn(s, x->where);
        }
    } else {
        QT_TRY(qt_sched_check(s, x->where));
    }
    return QT_OK;
}

/* ---- fp16 / bf16 -------------------------------------------------------- */

/* An fp16 (or bf16) section whose "enabled" is "auto": the HF Trainer fills
 * it from its --fp16 (--bf16) flag, off by default, and qtune has no such
 * flag, so the run is fp32. Someone who wrote the section meant half
 * precision more often than not: a warning, not a quiet note, and the run
 * line and `qtune doctor` say it again (qt_ds_config.precision_auto_off). */
static void precision_auto_off(ds_ctx *x, const char *section) {
    qt_ds_config *c = x->out;
    char line[sizeof c->resolved[0]];
    const char *p = !strcmp(section, "fp16") ? "fp16" : "bf16";
    snprintf(line, sizeof line, "%s.enabled \"auto\" -> false (the HF Trainer's --%s is off by default and qtune "
             "has no such flag; set true to train in %s)", section, p, p);
    record_resolved(c, line);
    if (!c->precision_auto_off[0]) snprintf(c->precision_auto_off, sizeof c->precision_auto_off, "%s", section);
    ds_warn(x, "%s: %s.enabled \"auto\" -> false: this run trains in fp32, not %s (the HF Trainer fills \"auto\" "
            "from its --%s flag, off by default; qtune has no such flag); set %s.enabled to true to train in %s, or "
            "to false to keep fp32 without this warning",
            x->where, section, p, p, section, p);
}

static int parse_fp16(ds_ctx *x, const cJSON *f) {
    qt_ds_config *c = x->out;
    static const char *const keys[] = {"enabled",   "loss_scale",             "initial_scale_power",
                                       "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                                       "min_loss_scale", NULL};
    warn_unknown(x, f, "fp16", keys);
    const char *sec = "fp16";
    if (is_auto(cJSON_GetObjectItemCaseSensitive(f, "enabled"))) precision_auto_off(x, "fp16");
    else QT_TRY(get_bool(x, f, sec, "enabled", &c->fp16, "precision_auto_off says it")); /* "auto" allowed */
    qt_loss_scaler_cfg *s = &c->scaler;
    int a;
    QT_TRY(get_number(x, f, sec, "loss_scale", &s->loss_scale, &a));
    if (a) {
        s->loss_scale = 0.0;
        note_auto(x, sec, "loss_scale", "0 (dynamic loss scaling, %s)", DS_DEFAULT);
    }
    int64_t v = s->initial_scale_power;
    QT_TRY(get_int(x, f, sec, "initial_scale_power", 0, 64, &v, &a, NULL));
    s->initial_scale_power = a ? 16 : (int)v;
    if (a) note_auto(x, sec, "initial_scale_power", "16 (%s)", DS_DEFAULT);
    QT_TRY(get_int(x, f, sec, "loss_scale_window", 1, (int64_t)1 << 50, &s->loss_scale_window, &a, NULL));
    if (a) {
        s->loss_scale_window = 1000;
        note_auto(x, sec, "loss_scale_window", "1000 (%s)", DS_DEFAULT);
    }
    v = s->hysteresis;
    QT_TRY(get_int(x, f, sec, "hysteresis", 1, 1 << 30, &v, &a, NULL));
    s->hysteresis = a ? 2 : (int)v;
    if (a) note_auto(x, sec, "hysteresis", "2 (%s)", DS_DEFAULT);
    QT_TRY(get_bool(x, f, sec, "consecutive_hysteresis", &s->consecutive_hysteresis, DS_DEFAULT));
    QT_TRY(get_number(x, f, sec, "min_loss_scale", &s->min_loss_scale, &a));
    if (a) {
        s->min_loss_scale = 1.0;
        note_auto(x, sec, "min_loss_scale", "1 (%s)", DS_DEFAULT);
    }
    /* values of a disabled section are read but cannot stop the run */
    return c->fp16 ? qt_loss_scaler_cfg_check(s, x->where) : QT_OK;
}

static int parse_bf16(ds_ctx *x, const cJSON *b, const char *name) {
    static const char *const keys[] = {"enabled", NULL};
    warn_unknown(x, b, name, keys);
    if (is_auto(cJSON_GetObjectItemCaseSensitive(b, "enabled"))) {
        precision_auto_off(x, name);
        return QT_OK;
    }
    return get_bool(x, b, name, "enabled", &x->out->bf16, "precision_auto_off says it"); /* "auto" allowed */
}

/* ---- ZeRO --------------------------------------------------------------- */

/* offload_param and the stage3_* keys. DeepSpeed reads them only at stage 3;
 * so does qtune (a warning says so below). "auto" for the prefetch bucket
 * and the persistence threshold is filled by the HF Trainer from hidden_size
 * (0.9 * hidden^2 and 10 * hidden): resolved by qt_ds_config_resolve_model. */
static int parse_stage3(ds_ctx *x, const cJSON *z) {
    qt_ds_zero *zc = &x->out->zero;
    static const char *const okeys[] = {"device", "pin_memory", "buffer_count", "buffer_size", "max_in_cpu", NULL};
    const char *sec = "zero_optimization";
    if (zc->stage != 3) { /* DeepSpeed reads these at stage 3 only */
        static const char *const s3[] = {"offload_param", "stage3_prefetch_bucket_size",
                                         "stage3_param_persistence_threshold", "stage3_max_live_parameters",
                                         "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
                                         "stage3_gather_fp16_weights_on_model_save", NULL};
        for (int i = 0; s3[i]; i++) {
            if (!cJSON_GetObjectItemCaseSensitive(z, s3[i])) continue;
            char path[96];
            snprintf(path, sizeof path, "%s.%s", sec, s3[i]);
            ds_warn(x, "%s: \"%s\" applies to ZeRO stage 3 only and is ignored at stage %d", x->where, path,
                    zc->stage);
            record_ignored(x->out, path);
        }
        return QT_OK;
    }
    const cJSON *off;
    QT_TRY(get_section(x, z, sec, "offload_param", &off));
    if (off) {
        warn_unknown(x, off, "zero_optimization.offload_param", okeys);
        const cJSON *dev = cJSON_GetObjectItemCaseSensitive(off, "device");
        if (dev && !cJSON_IsNull(dev)) {
            if (!cJSON_IsString(dev))
                return QT_ERR(QT_EINVAL, "%s: zero_optimization.offload_param.device must be \"cpu\" or \"none\"",
                              x->where);
            if (strcmp(dev->valuestring, "cpu") == 0) zc->offload_param = 1;
            else if (strcmp(dev->valuestring, "none") == 0) zc->offload_param = 0;
            else
                return QT_ERR(QT_EUNSUPPORTED,
                              "%s: zero_optimization.offload_param.device \"%s\" is not supported; use \"cpu\" or "
                              "\"none\"",
                              x->where, dev->valuestring);
        }
    }
    int a;
    QT_TRY(get_number(x, z, sec, "stage3_prefetch_bucket_size", &zc->prefetch_bucket_size, &a));
    if (a) zc->stage3_auto |= 1, zc->prefetch_bucket_size = 5e7;
    QT_TRY(get_number(x, z, sec, "stage3_param_persistence_threshold", &zc->param_persistence_threshold, &a));
    if (a) zc->stage3_auto |= 2, zc->param_persistence_threshold = 1e5;
    QT_TRY(get_number(x, z, sec, "stage3_max_live_parameters", &zc->max_live_parameters, &a));
    if (a) {
        zc->max_live_parameters = 1e9;
        note_auto(x, sec, "stage3_max_live_parameters", "1e9 (%s; the HF Trainer does not fill this key)", DS_DEFAULT);
    }
    QT_TRY(get_number(x, z, sec, "stage3_max_reuse_distance", &zc->max_reuse_distance, &a));
    if (a) {
        zc->max_reuse_distance = 1e9;
        note_auto(x, sec, "stage3_max_reuse_distance", "1e9 (%s; the HF Trainer does not fill this key)", DS_DEFAULT);
    }
    int g16 = 0, gf16 = 0;
    QT_TRY(get_bool(x, z, sec, "stage3_gather_16bit_weights_on_model_save", &g16, DS_DEFAULT));
    QT_TRY(get_bool(x, z, sec, "stage3_gather_fp16_weights_on_model_save", &gf16, DS_DEFAULT));
    zc->gather_16bit_on_save = g16 || gf16;
    if (zc->prefetch_bucket_size < 0 || zc->param_persistence_threshold < 0 || zc->max_live_parameters < 0 ||
        zc->max_reuse_distance < 0)
        return QT_ERR(QT_EINVAL, "%s: zero_optimization.stage3_* sizes must be >= 0 elements", x->where);
    return QT_OK;
}

static int parse_zero(ds_ctx *x, const cJSON *z) {
    qt_ds_zero *zc = &x->out->zero;
    static const char *const keys[] = {"stage",          "offload_optimizer",    "reduce_bucket_size",
                                       "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
                                       "reduce_scatter", "allgather_partitions", "offload_param",
                                       "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                                       "stage3_max_live_parameters", "stage3_max_reuse_distance",
                                       "stage3_gather_16bit_weights_on_model_save",
                                       "stage3_gather_fp16_weights_on_model_save", NULL};
    static const char *const okeys[] = {"device", "pin_memory", NULL};
    const char *sec = "zero_optimization";
    warn_unknown(x, z, sec, keys);
    int64_t stage = 0;
    const cJSON *sv = cJSON_GetObjectItemCaseSensitive(z, "stage");
    (void)sv;
    QT_TRY(get_int(x, z, sec, "stage", 0, 3, &stage, NULL, NULL));
    zc->stage = (int)stage;
    const cJSON *off;
    QT_TRY(get_section(x, z, sec, "offload_optimizer", &off));
    if (off) {
        warn_unknown(x, off, "zero_optimization.offload_optimizer", okeys);
        const cJSON *dev = cJSON_GetObjectItemCaseSensitive(off, "device");
        if (dev && !cJSON_IsNull(dev)) {
            if (!cJSON_IsString(dev))
                return QT_ERR(QT_EINVAL, "%s: zero_optimization.offload_optimizer.device must be \"cpu\" or \"none\"",
                              x->where);
            if (strcmp(dev->valuestring, "cpu") == 0) zc->offload_optimizer = 1;
            else if (strcmp(dev->valuestring, "none") == 0) zc->offload_optimizer = 0;
            else
                return QT_ERR(QT_EUNSUPPORTED,
                              "%s: zero_optimization.offload_optimizer.device \"%s\" is not supported; use \"cpu\" or "
                              "\"none\"",
                              x->where, dev->valuestring);
        }
        QT_TRY(get_bool(x, off, "zero_optimization.offload_optimizer", "pin_memory", &zc->pin_memory, NULL));
    }
    if (zc->offload_optimizer && zc->stage == 0) {
        ds_warn(x, "%s: zero_optimization.offload_optimizer needs ZeRO stage 1 or 2 and is ignored at stage 0", x->where);
        zc->offload_optimizer = 0;
    }
    int a;
    QT_TRY(get_number(x, z, sec, "reduce_bucket_size", &zc->reduce_bucket_size, &a));
    /* the HF Trainer fills it from the model's hidden_size: qt_ds_config_resolve_model, once config.json is read */
    zc->reduce_bucket_auto = a;
    if (a) zc->reduce_bucket_size = 5e8;
    QT_TRY(get_number(x, z, sec, "allgather_bucket_size", &zc->allgather_bucket_size, &a));
    if (a) {
        zc->allgather_bucket_size = 5e8;
        note_auto(x, sec, "allgather_bucket_size", "5e8 elements (%s; the HF Trainer does not fill this key)",
                  DS_DEFAULT);
    }
    if (zc->reduce_bucket_size < 1 || zc->allgather_bucket_size < 1)
        return QT_ERR(QT_EINVAL, "%s: zero_optimization bucket sizes must be >= 1 element", x->where);
    QT_TRY(get_bool(x, z, sec, "overlap_comm", &zc->overlap_comm, DS_DEFAULT));
    QT_TRY(get_bool(x, z, sec, "contiguous_gradients", &zc->contiguous_gradients, DS_DEFAULT));
    QT_TRY(get_bool(x, z, sec, "reduce_scatter", &zc->reduce_scatter, DS_DEFAULT));
    QT_TRY(get_bool(x, z, sec, "allgather_partitions", &zc->allgather_partitions, DS_DEFAULT));
    return parse_stage3(x, z);
}

/* ---- the whole object --------------------------------------------------- */

static int parse_clipping(ds_ctx *x, const cJSON *j) {
    qt_ds_config *c = x->out;
    int a;
    QT_TRY(get_number(x, j, NULL, "gradient_clipping", &c->gradient_clipping, &a));
    if (a) {
        c->gradient_clipping = HF_MAX_GRAD_NORM;
        note_auto(x, NULL, "gradient_clipping", "%g (the HF Trainer's max_grad_norm default)", HF_MAX_GRAD_NORM);
    }
    if (c->gradient_clipping < 0)
        return QT_ERR(QT_EINVAL, "%s: gradient_clipping %g must be >= 0 (0 turns clipping off)", x->where,
                      c->gradient_clipping);
    return QT_OK;
}

static int parse(ds_ctx *x, const cJSON *j) {
    qt_ds_config *c = x->out;
    static const char *const keys[] = {"train_batch_size", "train_micro_batch_size_per_gpu",
                                       "gradient_accumulation_steps", "gradient_clipping",
                                       "optimizer", "scheduler", "fp16", "bf16", "bfloat16",
                                       "zero_optimization", "steps_per_print", "wall_clock_breakdown", NULL};
    if (!cJSON_IsObject(j)) return QT_ERR(QT_EINVAL, "%s: a DeepSpeed config must be a JSON object", x->where);
    warn_unknown(x, j, NULL, keys);
    SECTION(parse_batch(x, j));
    SECTION(parse_clipping(x, j));
    int64_t spp = c->steps_per_print;
    SECTION(get_int(x, j, NULL, "steps_per_print", 1, 1 << 30, &spp, NULL, NULL));
    c->steps_per_print = (int)spp;
    SECTION(get_bool(x, j, NULL, "wall_clock_breakdown", &c->wall_clock_breakdown, NULL));

    const cJSON *sec;
    SECTION(get_section(x, j, NULL, "optimizer", &sec));
    if (sec) SECTION(parse_optimizer(x, sec));
    SECTION(get_section(x, j, NULL, "scheduler", &sec));
    if (sec) SECTION(parse_scheduler(x, sec));
    else qt_sched_default(&c->sched, QT_SCHED_CONSTANT, c->adam.lr);
    SECTION(get_section(x, j, NULL, "fp16", &sec));
    if (sec) SECTION(parse_fp16(x, sec));
    /* DeepSpeed reads "bf16", and the old name "bfloat16" only without it */
    const cJSON *old_bf16;
    SECTION(get_section(x, j, NULL, "bfloat16", &old_bf16));
    SECTION(get_section(x, j, NULL, "bf16", &sec));
    if (sec) SECTION(parse_bf16(x, sec, "bf16"));
    if (sec && old_bf16) {
        ds_warn(x, "%s: DeepSpeed key \"bfloat16\" (the old name of \"bf16\") is ignored because \"bf16\" is given, "
                "as DeepSpeed does; keep one of them",
                x->where);
        record_ignored(c, "bfloat16");
    } else if (old_bf16) SECTION(parse_bf16(x, old_bf16, "bfloat16"));
    if (c->fp16 && c->bf16)
        SECTION(QT_ERR(QT_EINVAL, "%s: fp16.enabled and bf16.enabled are both true; enable one of them", x->where));
    SECTION(get_section(x, j, NULL, "zero_optimization", &sec));
    if (sec) SECTION(parse_zero(x, sec));
    return x->n_problems ? QT_EINVAL : QT_OK;
}

int qt_ds_config_parse(const cJSON *json, const char *where, int world, qt_ds_config *out) {
    if (world < 1) return QT_ERR(QT_EINVAL, "%s: world size %d must be >= 1", where, world);
    qt_ds_config_default(out, world);
    ds_ctx x = {.where = where, .out = out};
    int rc = parse(&x, json);
    if (rc != QT_OK) {
        int n = out->n_ignored;
        char keep[QT_DS_MAX_IGNORED][96];
        memcpy(keep, out->ignored, sizeof keep);
        qt_ds_config_default(out, world);
        out->n_ignored = n;
        memcpy(out->ignored, keep, sizeof keep);
    }
    return rc;
}

int qt_ds_config_problems(const cJSON *json, const char *where, int world, qt_ds_config *out, qt_ds_problem_fn fn,
                          void *ctx) {
    qt_ds_config_default(out, world > 0 ? world : 1);
    ds_ctx x = {.where = where, .out = out, .quiet = 1, .sink = fn, .sink_ctx = ctx};
    int rc = world < 1 ? QT_ERR(QT_EINVAL, "%s: world size %d must be >= 1", where, world) : parse(&x, json);
    if (rc != QT_OK && !x.n_problems) { /* out of memory, or not an object */
        fn(ctx, qt_error_message());
        qt_error_clear();
        return 1;
    }
    return x.n_problems;
}

int qt_ds_config_check(const cJSON *json, const char *where) {
    qt_ds_config *c = qt_malloc(sizeof *c, "a DeepSpeed config check");
    if (!c) return QT_ENOMEM;
    qt_ds_config_default(c, 1);
    ds_ctx x = {.where = where, .out = c, .check_only = 1, .quiet = 1};
    int rc = parse(&x, json);
    qt_free(c);
    return rc;
}

int qt_ds_config_check_strict(const cJSON *json, const char *where) {
    qt_ds_config *c = qt_malloc(sizeof *c, "a DeepSpeed config check");
    if (!c) return QT_ENOMEM;
    qt_ds_config_default(c, 1);
    ds_ctx x = {.where = where, .out = c, .check_only = 1, .quiet = 1, .strict = 1};
    int rc = parse(&x, json);
    qt_free(c);
    if (rc == QT_OK && x.strict_msg[0])
        rc = QT_ERR(QT_EINVAL, "%s (--strict makes every unknown key an error)", x.strict_msg);
    return rc;
}

int qt_ds_config_load(const char *path, int world, qt_ds_config *out) {
    char *text;
    size_t len;
    QT_TRY(qt_read_file(path, (size_t)16 << 20, &text, &len));
    cJSON *j = cJSON_ParseWithLength(text, len);
    if (!j) {
        /* the line of the first syntax error, and the key of a NaN or Infinity */
        const char *at = cJSON_GetErrorPtr();
        int rc = qt_json_parse_error(text, at && at >= text && at <= text + len ? at : NULL, path,
                                     "fix the syntax there");
        qt_free(text);
        return rc;
    }
    qt_free(text);
    int rc = qt_json_check_duplicate_keys(j, path);
    if (rc == QT_OK) rc = qt_ds_config_parse(j, path, world, out);
    cJSON_Delete(j);
    return rc;
}

/* Records (and says, at info level) an "auto" resolved after parsing, when
 * the file's name is no longer at hand. */
static void note_late(qt_ds_config *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void note_late(qt_ds_config *c, const char *fmt, ...) {
    char line[sizeof c->resolved[0]];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (c->n_resolved < QT_DS_MAX_RESOLVED) memcpy(c->resolved[c->n_resolved++], line, sizeof line);
    qt_info("deepspeed: %s", line);
}

int qt_ds_config_finalize(qt_ds_config *c, int64_t max_steps) {
    if (c->total_num_steps_auto) {
        if (max_steps < 0)
            return QT_ERR(QT_EINVAL,
                          "deepspeed: scheduler.params.total_num_steps is \"auto\" but train.max_steps is not known; "
                          "set train.max_steps or give total_num_steps a number");
        c->sched.total_num_steps = max_steps;
        c->total_num_steps_auto = 0;
        note_late(c, "scheduler.params.total_num_steps \"auto\" -> %lld (train.max_steps)", (long long)max_steps);
        c->sched.base_lr = c->adam.lr;
        /* a number given in the file was checked when it was parsed */
        const char *where = "deepspeed: scheduler.params.total_num_steps \"auto\" (train.max_steps)";
        QT_TRY(qt_sched_check(&c->sched, where));
        qt_sched_warn(&c->sched, where);
        return QT_OK;
    }
    c->sched.base_lr = c->adam.lr;
    return QT_OK;
}

/* transformers' trainer_config_finalize at stage 3: fill_only("stage3_prefetch_bucket_size",
 * 0.9 * hidden_size * hidden_size) and ("stage3_param_persistence_threshold", 10 * hidden_size). */
static void resolve_stage3(qt_ds_config *c, int64_t hidden_size) {
    qt_ds_zero *z = &c->zero;
    double h = (double)hidden_size;
    if (z->stage3_auto & 1) {
        if (hidden_size > 0) z->prefetch_bucket_size = 0.9 * h * h;
        note_late(c, "zero_optimization.stage3_prefetch_bucket_size \"auto\" -> %.0f (%s)", z->prefetch_bucket_size,
                  hidden_size > 0 ? "0.9 x hidden_size squared, as Hugging Face's Trainer fills it"
                                  : "DeepSpeed's default: config.json could not be read");
    }
    if (z->stage3_auto & 2) {
        if (hidden_size > 0) z->param_persistence_threshold = 10 * h;
        note_late(c, "zero_optimization.stage3_param_persistence_threshold \"auto\" -> %.0f (%s)",
                  z->param_persistence_threshold,
                  hidden_size > 0 ? "10 x hidden_size, as Hugging Face's Trainer fills it"
                                  : "DeepSpeed's default: config.json could not be read");
    }
    z->stage3_auto = 0;
}

void qt_ds_config_resolve_model(qt_ds_config *c, int64_t hidden_size) {
    qt_ds_zero *z = &c->zero;
    if (z->stage3_auto) resolve_stage3(c, hidden_size);
    if (!z->reduce_bucket_auto) return;
    z->reduce_bucket_auto = 0;
    if (hidden_size <= 0) {
        z->reduce_bucket_size = 5e8;
        note_late(c, "zero_optimization.reduce_bucket_size \"auto\" -> 5e8 elements (%s: the model's config.json "
                     "could not be read for the hidden_size the HF Trainer squares)",
                  DS_DEFAULT);
        return;
    }
    /* transformers' trainer_config_finalize:
     * fill_only("zero_optimization.reduce_bucket_size", hidden_size * hidden_size), at any ZeRO stage */
    z->reduce_bucket_size = (double)hidden_size * (double)hidden_size;
    note_late(c, "zero_optimization.reduce_bucket_size \"auto\" -> %lld (hidden_size %lld squared, as Hugging Face's "
                 "Trainer fills it)",
              (long long)hidden_size * (long long)hidden_size, (long long)hidden_size);
}
