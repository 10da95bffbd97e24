/* The job file: parse, override, validate, resolve paths. Every error names
 * the job file and the field ("job.json: train.max_steps must be ..."). */
#include "train/job.h"

#include "backend/device.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/json_range.h"
#include "core/log.h"
#include "core/mem.h"
#include "core/quant4.h"
#include "core/words.h"
#include "data/format.h"
#include "data/loader.h"
#include "io/peft.h"
#include "model/model.h"
#include "train/ds_config.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define JOB_MAX_BYTES (16u << 20) /* a job or DeepSpeed file is a few KiB; refuse anything huge */

/* ---------------------------------------------------------------------------
 * --set key.path=value */

/* Finds (creating objects along the way when create) the parent object of the
 * last path component; *leaf gets that component. */
static cJSON *set_walk(cJSON *root, char *path, char **leaf, const char *set) {
    cJSON *obj = root;
    char *p = path;
    for (;;) {
        char *dot = strchr(p, '.');
        if (!dot) break;
        *dot = 0;
        if (!*p) { QT_ERR(QT_EINVAL, "--set %.200s: empty key component", set); return NULL; }
        cJSON *child = cJSON_GetObjectItemCaseSensitive(obj, p);
        if (!child) {
            child = cJSON_AddObjectToObject(obj, p);
            if (!child) { QT_ERR(QT_ENOMEM, "--set %.200s: out of memory", set); return NULL; }
        } else if (!cJSON_IsObject(child)) {
            QT_ERR(QT_EINVAL, "--set %.200s: '%s' is not an object in the job, so it has no field '%s'", set, p, dot + 1);
            return NULL;
        }
        obj = child;
        p = dot + 1;
    }
    if (!*p) { QT_ERR(QT_EINVAL, "--set %.200s: empty key component", set); return NULL; }
    *leaf = p;
    return obj;
}

/* A number as JSON writes it (not strtod's "0x10", "inf" or "nan"), and one
 * a double holds. */
static int set_number(const char *v, const char *set, double *out) {
    cJSON *j = cJSON_ParseWithOpts(v, NULL, 1);
    int is_num = cJSON_IsNumber(j);
    cJSON_Delete(j);
    if (!is_num) return QT_ERR(QT_EINVAL, "--set %.200s: this field is a number and '%.200s' is not one", set, v);
    errno = 0;
    *out = strtod(v, NULL);
    if (errno == ERANGE && *out != 0.0 && fabs(*out) >= 1.0)
        return QT_ERR(QT_EINVAL, "--set %.200s: %.40s is larger than any number can be (1.8e308), so it would read "
                      "as infinity; write a finite value", set, v);
    if (errno == ERANGE)
        return QT_ERR(QT_EINVAL, "--set %.200s: %.40s is smaller in magnitude than any normal number (2.2e-308), so "
                      "it would read as %g; write 0 or a value of at least 2.2e-308", set, v, *out);
    return QT_OK;
}

static cJSON *set_value(const cJSON *old, const char *v, const char *set) {
    if (!strcmp(v, "null")) return cJSON_CreateNull();
    /* a DeepSpeed number or flag may be given as "auto" (the config reader
     * says where it is accepted and what it becomes) */
    if (old && (cJSON_IsNumber(old) || cJSON_IsBool(old)) && !strncmp(set, "deepspeed.", 10) && !strcmp(v, "auto"))
        return cJSON_CreateString(v);
    if (old && cJSON_IsNumber(old)) {
        double d;
        return set_number(v, set, &d) == QT_OK ? cJSON_CreateNumber(d) : NULL;
    }
    if (old && cJSON_IsBool(old)) {
        if (!strcmp(v, "true") || !strcmp(v, "1")) return cJSON_CreateTrue();
        if (!strcmp(v, "false") || !strcmp(v, "0")) return cJSON_CreateFalse();
        QT_ERR(QT_EINVAL, "--set %.200s: this field is true/false and '%.200s' is neither", set, v);
        return NULL;
    }
    /* a string field takes the text as is, except DeepSpeed's "auto", which
     * stands for a number: it takes JSON when the text parses as JSON */
    if (old && cJSON_IsString(old) && strcmp(old->valuestring, "auto")) return cJSON_CreateString(v);
    /* PEFT's one string value of a list field */
    if (old && cJSON_IsArray(old) && !strcmp(v, "all-linear")) return cJSON_CreateString(v);
    if (old && cJSON_IsArray(old) && v[0] != '[') {
        /* "q_proj,v_proj" -> ["q_proj", "v_proj"]; a list of numbers
         * (betas) takes numbers: "0.9,0.95" -> [0.9, 0.95] */
        const int numbers = cJSON_IsNumber(old->child);
        cJSON *arr = cJSON_CreateArray();
        const char *p = v;
        while (arr && *p) {
            const char *c = strchr(p, ',');
            size_t n = c ? (size_t)(c - p) : strlen(p);
            char item[256];
            if (n >= sizeof item) n = sizeof item - 1;
            memcpy(item, p, n);
            item[n] = 0;
            double d;
            if (n && numbers && set_number(item, set, &d) != QT_OK) {
                cJSON_Delete(arr);
                return NULL;
            }
            if (n) cJSON_AddItemToArray(arr, numbers ? cJSON_CreateNumber(d) : cJSON_CreateString(item));
            p += c ? n + 1 : n;
        }
        return arr;
    }
    /* null, array, object or a new key: JSON if it parses (all of the text:
     * "5x" is a string, not 5), otherwise a string */
    cJSON *j = cJSON_ParseWithOpts(v, NULL, 1);
    char where[256];
    snprintf(where, sizeof where, "--set %.200s", set);
    if (j && (qt_json_check_range(v, strlen(v), where) != QT_OK || qt_json_check_duplicate_keys(j, where) != QT_OK)) {
        cJSON_Delete(j);
        return NULL;
    }
    if (j) return j;
    return cJSON_CreateString(v);
}

int qt_job_apply_set(cJSON *root, const char *set) {
    const char *eq = strchr(set, '=');
    if (!eq || eq == set)
        return QT_ERR(QT_EINVAL, "--set %.200s: write it as key.path=value (for example train.max_steps=100)", set);
    size_t klen = (size_t)(eq - set);
    char *key = qt_malloc(klen + 1, "a --set key");
    if (!key) return QT_ENOMEM;
    memcpy(key, set, klen);
    key[klen] = 0;
    char *leaf;
    cJSON *parent = set_walk(root, key, &leaf, set);
    int rc = QT_OK;
    if (!parent) {
        rc = qt_error_code();
    } else {
        cJSON *old = cJSON_GetObjectItemCaseSensitive(parent, leaf);
        cJSON *nv = set_value(old, eq + 1, set);
        if (!nv) rc = qt_error_code() ? qt_error_code() : QT_ERR(QT_ENOMEM, "--set %.200s: out of memory", set);
        else if (old) cJSON_ReplaceItemInObjectCaseSensitive(parent, leaf, nv);
        else cJSON_AddItemToObject(parent, leaf, nv);
    }
    qt_free(key);
    return rc;
}

/* ---------------------------------------------------------------------------
 * typed getters: each names the field in its error */

typedef struct {
    const char *where; /* job file name */
    const char *dir;
    int strict;        /* --strict: an unknown key is an error, not a warning */
} job_ctx;

static int get_num(const job_ctx *c, const cJSON *obj, const char *sect, const char *key, double def, double *out,
                   int *present) {
    const cJSON *it = obj ? cJSON_GetObjectItemCaseSensitive(obj, key) : NULL;
    if (present) *present = it && !cJSON_IsNull(it);
    if (!it || cJSON_IsNull(it)) { *out = def; return QT_OK; }
    if (!cJSON_IsNumber(it) || !isfinite(it->valuedouble))
        return QT_ERR(QT_EINVAL, "%s: %s%s%s must be a number", c->where, sect, sect[0] ? "." : "", key);
    *out = it->valuedouble;
    return QT_OK;
}

static int get_long(const job_ctx *c, const cJSON *obj, const char *sect, const char *key, long def, long lo,
                    long *out) {
    double d = 0;
    QT_TRY(get_num(c, obj, sect, key, (double)def, &d, NULL));
    if (d != floor(d) || d < (double)lo || d > 1e15)
        return QT_ERR(QT_EINVAL, "%s: %s.%s must be a whole number from %ld to 10^15 (got %.17g)", c->where, sect, key,
                      lo, d);
    *out = (long)d;
    return QT_OK;
}

static int get_int(const job_ctx *c, const cJSON *obj, const char *sect, const char *key, int def, int lo, int *out) {
    long v = 0;
    QT_TRY(get_long(c, obj, sect, key, def, lo, &v));
    if (v > INT_MAX) return QT_ERR(QT_EINVAL, "%s: %s.%s is too large (%ld)", c->where, sect, key, v);
    *out = (int)v;
    return QT_OK;
}

static int get_bool(const job_ctx *c, const cJSON *obj, const char *sect, const char *key, int def, int *out) {
    const cJSON *it = obj ? cJSON_GetObjectItemCaseSensitive(obj, key) : NULL;
    if (!it || cJSON_IsNull(it)) { *out = def; return QT_OK; }
    if (!cJSON_IsBool(it)) return QT_ERR(QT_EINVAL, "%s: %s.%s must be true or false", c->where, sect, key);
    *out = cJSON_IsTrue(it);
    return QT_OK;
}

/* A string field; NULL stays NULL unless def is given. */
static int get_str(const job_ctx *c, const cJSON *obj, const char *sect, const char *key, const char *def, char **out) {
    const cJSON *it = obj ? cJSON_GetObjectItemCaseSensitive(obj, key) : NULL;
    *out = NULL;
    const char *v = def;
    if (it && !cJSON_IsNull(it)) {
        if (!cJSON_IsString(it) || !it->valuestring[0])
            return QT_ERR(QT_EINVAL, "%s: %s%s%s must be a non-empty string", c->where, sect, sect[0] ? "." : "", key);
        v = it->valuestring;
    }
    if (!v) return QT_OK;
    *out = qt_strdup(v);
    return *out ? QT_OK : QT_ENOMEM;
}

/* A path relative to the job file's folder. */
static int resolve(const job_ctx *c, char **p) {
    if (!*p || (*p)[0] == '/') return QT_OK;
    size_t n = strlen(c->dir) + strlen(*p) + 2;
    char *full = qt_malloc(n, "a path");
    if (!full) return QT_ENOMEM;
    if (!strcmp(c->dir, ".")) snprintf(full, n, "%s", *p);
    else snprintf(full, n, "%s/%s", c->dir, *p);
    qt_free(*p);
    *p = full;
    return QT_OK;
}

/* An unknown key: a warning naming the nearest known key, or with --strict
 * the same sentence as an error. */
static int unknown_key(const job_ctx *c, const char *sect, const char *key, const char *near) {
    char msg[1024];
    if (near)
        snprintf(msg, sizeof msg, "%s: unknown key '%s%s%s' is ignored; did you mean '%s%s%s'?", c->where, sect,
                 sect[0] ? "." : "", key, sect, sect[0] ? "." : "", near);
    else
        snprintf(msg, sizeof msg, "%s: unknown key '%s%s%s' is ignored; check its spelling (docs/job-file.md lists "
                 "the keys)", c->where, sect, sect[0] ? "." : "", key);
    if (c->strict) return QT_ERR(QT_EINVAL, "%s (--strict makes every unknown key an error)", msg);
    qt_warn("%s", msg);
    return QT_OK;
}

static int warn_unknown(const job_ctx *c, const cJSON *obj, const char *sect, const char *const *known) {
    if (!cJSON_IsObject(obj)) return QT_OK;
    for (const cJSON *it = obj->child; it; it = it->next) {
        int ok = 0;
        for (int i = 0; known[i] && !ok; i++) ok = !strcmp(it->string, known[i]);
        if (!ok) QT_TRY(unknown_key(c, sect, it->string, qt_nearest_word(it->string, known)));
    }
    return QT_OK;
}

static int section(const job_ctx *c, const cJSON *root, const char *name, const cJSON **out) {
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(root, name);
    *out = NULL;
    if (!s || cJSON_IsNull(s)) return QT_OK;
    if (!cJSON_IsObject(s)) return QT_ERR(QT_EINVAL, "%s: '%s' must be an object {...}", c->where, name);
    *out = s;
    return QT_OK;
}

/* ---------------------------------------------------------------------------
 * sections */

int qt_job_lora_targets(const cJSON *arr, unsigned *mask, const char *where) {
    static const struct { const char *name; unsigned bit; } names[] = {
        {"q_proj", QT_LORA_Q}, {"k_proj", QT_LORA_K}, {"v_proj", QT_LORA_V}, {"o_proj", QT_LORA_O},
        {"gate_proj", QT_LORA_GATE}, {"up_proj", QT_LORA_UP}, {"down_proj", QT_LORA_DOWN},
        /* the original Qwen's (QWenLMHeadModel) modules; which names fit the model is checked against its
         * config.json when the run starts (model/lora_io.h qt_lora_targets_from_names) */
        {"c_attn", QT_LORA_Q | QT_LORA_K | QT_LORA_V}, {"c_proj", QT_LORA_O | QT_LORA_DOWN},
        {"attn.c_proj", QT_LORA_O}, {"mlp.c_proj", QT_LORA_DOWN}, {"w1", QT_LORA_UP}, {"w2", QT_LORA_GATE},
    };
    *mask = 0;
    if (cJSON_IsString(arr) && !strcmp(arr->valuestring, "all-linear")) {
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) *mask |= names[i].bit;
        return QT_OK;
    }
    if (cJSON_IsString(arr))
        return QT_ERR(QT_EINVAL,
                      "%s: lora.target_modules is the string '%s'; as a job's lora section (inline or the "
                      "adapter_config.json it names) it takes no regex: write the module names as a list such as "
                      "[\"q_proj\", \"v_proj\"], or \"all-linear\"",
                      where, arr->valuestring);
    if (!cJSON_IsArray(arr) || cJSON_GetArraySize(arr) == 0)
        return QT_ERR(QT_EINVAL, "%s: lora.target_modules must be a non-empty list such as [\"q_proj\", \"v_proj\"]",
                      where);
    const cJSON *it;
    cJSON_ArrayForEach(it, arr) {
        if (!cJSON_IsString(it)) return QT_ERR(QT_EINVAL, "%s: lora.target_modules must hold strings", where);
        unsigned bit = 0;
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
            if (!strcmp(it->valuestring, names[i].name) || !strcmp(it->valuestring, "all-linear"))
                bit |= names[i].bit;
        if (!bit)
            return QT_ERR(QT_EUNSUPPORTED,
                          "%s: lora.target_modules names '%s'; qtune adapts q_proj, k_proj, v_proj, o_proj, gate_proj, "
                          "up_proj and down_proj (the original Qwen: c_attn, c_proj, w1 and w2)",
                          where, it->valuestring);
        *mask |= bit;
    }
    return QT_OK;
}

/* data.train / data.eval: one file, or a list of files (LLaMA-Factory's
 * "dataset: a,b" as a list), each resolved against the job's folder. */
static int get_files(const job_ctx *c, const cJSON *s, const char *key, char ***files, int *n) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(s, key);
    *files = NULL;
    *n = 0;
    if (!it || cJSON_IsNull(it)) return QT_OK;
    const int count = cJSON_IsArray(it) ? cJSON_GetArraySize(it) : 1;
    if (!cJSON_IsArray(it) && !(cJSON_IsString(it) && it->valuestring[0]))
        return QT_ERR(QT_EINVAL, "%s: data.%s must be a file name or a list of file names", c->where, key);
    if (count == 0)
        return QT_ERR(QT_EINVAL, "%s: data.%s is an empty list; name at least one file", c->where, key);
    *files = qt_calloc((size_t)count, sizeof **files, "the data file list");
    if (!*files) return QT_ENOMEM;
    const cJSON *el = cJSON_IsArray(it) ? it->child : it;
    for (int i = 0; i < count; i++, el = el->next) {
        if (!cJSON_IsString(el) || !el->valuestring[0])
            return QT_ERR(QT_EINVAL, "%s: data.%s[%d] must be a non-empty file name", c->where, key, i);
        (*files)[i] = qt_strdup(el->valuestring);
        if (!(*files)[i]) return QT_ENOMEM;
        (*n)++;
        QT_TRY(resolve(c, &(*files)[i]));
    }
    return QT_OK;
}

/* data.mix_strategy and data.interleave_probs, LLaMA-Factory's names and
 * meanings (data/loader.h dl_mix). */
static int parse_mix(const job_ctx *c, const cJSON *s, qt_job_data *d) {
    QT_TRY(get_str(c, s, "data", "mix_strategy", "concat", &d->mix_strategy));
    dl_mix mix;
    if (dl_mix_parse(d->mix_strategy, &mix) != QT_OK)
        return QT_ERR(QT_EINVAL, "%s: data.mix_strategy is '%s'; use concat, interleave_under or interleave_over",
                      c->where, d->mix_strategy);
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(s, "interleave_probs");
    if (!p || cJSON_IsNull(p)) return QT_OK;
    if (mix == DL_MIX_CONCAT)
        return QT_ERR(QT_EINVAL, "%s: data.interleave_probs is set but data.mix_strategy is concat, which reads every "
                      "example once; set mix_strategy to interleave_under or interleave_over, or drop the weights",
                      c->where);
    if (!cJSON_IsArray(p) || cJSON_GetArraySize(p) != d->n_train)
        return QT_ERR(QT_EINVAL, "%s: data.interleave_probs must be a list of %d number%s, one per data.train file",
                      c->where, d->n_train, d->n_train == 1 ? "" : "s");
    d->train_weights = qt_calloc((size_t)d->n_train, sizeof *d->train_weights, "the mixing weights");
    if (!d->train_weights) return QT_ENOMEM;
    int i = 0;
    for (const cJSON *w = p->child; w; w = w->next, i++) {
        if (!cJSON_IsNumber(w) || !(w->valuedouble > 0) || w->valuedouble > 1e12)
            return QT_ERR(QT_EINVAL, "%s: data.interleave_probs[%d] must be a number above 0 (the weights are "
                          "normalised to sum 1)", c->where, i);
        d->train_weights[i] = w->valuedouble;
    }
    return QT_OK;
}

static int parse_data(const job_ctx *c, const cJSON *root, qt_job_data *d) {
    static const char *const known[] = {"train", "eval", "format", "seq_len", "packing", "shuffle", "mask_prompt",
                                        "cache_dir", "num_workers", "prefetch", "max_line_bytes", "skip_bad_lines",
                                        "mix_strategy", "interleave_probs", NULL};
    const cJSON *s;
    QT_TRY(section(c, root, "data", &s));
    if (!s) return QT_ERR(QT_EINVAL, "%s: the 'data' section is missing; it needs at least \"train\": \"file.jsonl\"",
                          c->where);
    QT_TRY(warn_unknown(c, s, "data", known));
    QT_TRY(get_files(c, s, "train", &d->train_files, &d->n_train));
    if (!d->n_train)
        return QT_ERR(QT_EINVAL, "%s: data.train is missing; name the training file (JSONL or a JSON array), or a list "
                      "of them", c->where);
    d->train = d->train_files[0];
    QT_TRY(get_files(c, s, "eval", &d->eval_files, &d->n_eval));
    d->eval = d->n_eval ? d->eval_files[0] : NULL;
    QT_TRY(parse_mix(c, s, d));
    QT_TRY(get_bool(c, s, "data", "skip_bad_lines", 0, &d->skip_bad_lines));
    QT_TRY(get_str(c, s, "data", "format", "auto", &d->format));
    dl_format fmt;
    if (dl_format_parse(d->format, &fmt) != QT_OK)
        return QT_ERR(QT_EINVAL, "%s: data.format is '%s'; use auto, text, messages, sharegpt, alpaca, prompt_completion or tokens", c->where,
                      d->format);
    QT_TRY(get_int(c, s, "data", "seq_len", 512, 2, &d->seq_len));
    QT_TRY(get_bool(c, s, "data", "packing", 1, &d->packing));
    QT_TRY(get_bool(c, s, "data", "shuffle", 1, &d->shuffle));
    QT_TRY(get_bool(c, s, "data", "mask_prompt", 1, &d->mask_prompt));
    QT_TRY(get_str(c, s, "data", "cache_dir", NULL, &d->cache_dir));
    QT_TRY(resolve(c, &d->cache_dir));
    const cJSON *nw = cJSON_GetObjectItemCaseSensitive(s, "num_workers");
    if (nw && cJSON_IsString(nw) && !strcmp(nw->valuestring, "auto")) d->num_workers = 0;
    else QT_TRY(get_int(c, s, "data", "num_workers", 0, 0, &d->num_workers));
    QT_TRY(get_int(c, s, "data", "prefetch", 4, 0, &d->prefetch));
    long mlb = 0;
    QT_TRY(get_long(c, s, "data", "max_line_bytes", 64l << 20, 1, &mlb));
    if (mlb > (4l << 30))
        return QT_ERR(QT_EINVAL, "%s: data.max_line_bytes is %ld; it must be from 1 to 4294967296 (4 GiB; the default "
                      "is 67108864, 64 MiB)", c->where, mlb);
    d->max_line_bytes = (size_t)mlb;
    if (d->prefetch > DL_PREFETCH_MAX)
        return QT_ERR(QT_EINVAL, "%s: data.prefetch is %d; it must be a whole number from 0 to %d (0 = the default, 4)",
                      c->where, d->prefetch, DL_PREFETCH_MAX);
    return QT_OK;
}

static int parse_lora(const job_ctx *c, const cJSON *root, qt_job_lora *l) {
    static const char *const known[] = {"r", "lora_alpha", "lora_dropout", "target_modules", "use_rslora",
                                        "init_from", "bias", "task_type", "peft_type", NULL};
    const cJSON *s;
    QT_TRY(section(c, root, "lora", &s));
    if (!s) return QT_OK;
    l->enabled = 1;
    /* PEFT's LoraConfig keys: quiet at their defaults, an error naming the
     * key otherwise; anything else is unknown */
    for (const cJSON *it = s->child; it; it = it->next) {
        int ok = peft_is_lora_key(it->string);
        for (int i = 0; known[i] && !ok; i++) ok = !strcmp(it->string, known[i]);
        if (!ok) QT_TRY(unknown_key(c, "lora", it->string, peft_nearest_lora_key(it->string, known)));
    }
    char where[4200];
    snprintf(where, sizeof where, "%s: lora.", c->where);
    QT_TRY(peft_check_lora_defaults(s, where));
    QT_TRY(get_int(c, s, "lora", "r", 8, 1, &l->r));
    double a = 0, dr = 0;
    QT_TRY(get_num(c, s, "lora", "lora_alpha", 8, &a, NULL));
    if (!peft_alpha_ok(a))
        return QT_ERR(QT_EINVAL, "%s: lora.lora_alpha is %g; it must be a number from %g to %g", c->where, a,
                      PEFT_ALPHA_MIN, PEFT_ALPHA_MAX);
    QT_TRY(get_num(c, s, "lora", "lora_dropout", 0, &dr, NULL));
    if (dr < 0 || dr >= 1) return QT_ERR(QT_EINVAL, "%s: lora.lora_dropout must be in [0, 1) (got %g)", c->where, dr);
    l->lora_alpha = (float)a;
    l->lora_dropout = (float)dr;
    const cJSON *tm = cJSON_GetObjectItemCaseSensitive(s, "target_modules");
    if (!tm || cJSON_IsNull(tm)) {
        l->targets = QT_LORA_Q | QT_LORA_V; /* PEFT's default for Qwen2 (for the original Qwen: c_attn) */
        l->targets_default = 1;
        l->target_names = qt_calloc(2, sizeof(char *), "lora target names");
        if (!l->target_names) return QT_ENOMEM;
        l->n_target_names = 2;
        l->target_names[0] = qt_strdup("q_proj");
        l->target_names[1] = qt_strdup("v_proj");
    } else {
        QT_TRY(qt_job_lora_targets(tm, &l->targets, c->where));
        int all = cJSON_IsString(tm);
        for (const cJSON *e = cJSON_IsArray(tm) ? tm->child : NULL; e; e = e->next)
            all |= cJSON_IsString(e) && !strcmp(e->valuestring, "all-linear");
        if (all) {
            l->targets_all_linear = 1;
            static const char *const all[] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"};
            l->target_names = qt_calloc(7, sizeof(char *), "lora target names");
            if (!l->target_names) return QT_ENOMEM;
            l->n_target_names = 7;
            for (int i = 0; i < 7; i++) l->target_names[i] = qt_strdup(all[i]);
        } else {
            int n = cJSON_GetArraySize(tm), i = 0;
            l->target_names = qt_calloc((size_t)n, sizeof(char *), "lora target names");
            if (!l->target_names) return QT_ENOMEM;
            l->n_target_names = n;
            const cJSON *it;
            cJSON_ArrayForEach(it, tm) l->target_names[i++] = qt_strdup(it->valuestring);
        }
    }
    for (int i = 0; i < l->n_target_names; i++)
        if (!l->target_names[i]) return QT_ENOMEM;
    QT_TRY(peft_parse_extras(s, &l->extras, where));
    QT_TRY(get_bool(c, s, "lora", "use_rslora", 0, &l->use_rslora));
    QT_TRY(get_str(c, s, "lora", "init_from", NULL, &l->init_from));
    QT_TRY(resolve(c, &l->init_from));
    const cJSON *bias = cJSON_GetObjectItemCaseSensitive(s, "bias");
    const cJSON *pt = cJSON_GetObjectItemCaseSensitive(s, "peft_type");
    if (pt && !cJSON_IsNull(pt) && !(cJSON_IsString(pt) && !strcmp(pt->valuestring, "LORA")))
        return QT_ERR(QT_EUNSUPPORTED, "%s: lora.peft_type is %s; qtune trains LoRA (\"LORA\") only", c->where,
                      cJSON_IsString(pt) ? pt->valuestring : "not a string");
    if (bias && !cJSON_IsNull(bias) && !(cJSON_IsString(bias) && !strcmp(bias->valuestring, "none")))
        return QT_ERR(QT_EUNSUPPORTED, "%s: lora.bias must be \"none\"; qtune does not train biases with LoRA", c->where);
    return QT_OK;
}

/* train.report_to, the HF Trainer's key: "none", "all", "tensorboard", or a
 * list of them. qtune writes TensorBoard event files and nothing that needs a
 * network, so "all" is TensorBoard, and another integration is refused by
 * name rather than dropped in silence. */
static int parse_report_to(const job_ctx *c, const cJSON *it, int *tensorboard) {
    *tensorboard = 0;
    if (!it || cJSON_IsNull(it)) return QT_OK;
    if (!cJSON_IsString(it) && !cJSON_IsArray(it))
        return QT_ERR(QT_EINVAL, "%s: train.report_to must be \"none\", \"all\", \"tensorboard\" or a list of "
                      "them", c->where);
    const cJSON *e = cJSON_IsArray(it) ? it->child : it;
    for (; e; e = cJSON_IsArray(it) ? e->next : NULL) {
        const char *v = cJSON_IsString(e) ? e->valuestring : NULL;
        if (v && (!strcmp(v, "tensorboard") || !strcmp(v, "all"))) *tensorboard = 1;
        else if (!v || strcmp(v, "none"))
            return QT_ERR(QT_EUNSUPPORTED, "%s: train.report_to names %s; qtune writes TensorBoard event files "
                          "(\"tensorboard\", or \"all\") and report.html in the output folder, and reports "
                          "to nothing else; use \"tensorboard\" or \"none\"", c->where,
                          v ? v : "something that is not a string");
    }
    return QT_OK;
}

static int parse_train(const job_ctx *c, const cJSON *root, qt_job_train *t) {
    static const char *const known[] = {"max_steps", "epochs", "save_steps", "save_total_limit", "eval_steps",
                                        "log_steps", "seed", "gradient_checkpointing", "resume",
                                        "overwrite_output_dir", "eval_batches", "report_to", "logging_dir", NULL};
    const cJSON *s;
    QT_TRY(section(c, root, "train", &s));
    QT_TRY(warn_unknown(c, s, "train", known));
    int has_steps = 0, has_epochs = 0;
    double ms = 0, ep = 0;
    QT_TRY(get_num(c, s, "train", "max_steps", -1, &ms, &has_steps));
    QT_TRY(get_num(c, s, "train", "epochs", -1, &ep, &has_epochs));
    if (has_steps && (ms != floor(ms) || ms < 1 || ms > 1e12))
        return QT_ERR(QT_EINVAL, "%s: train.max_steps must be a whole number from 1 to 10^12 (got %.17g)", c->where,
                      ms);
    if (has_epochs && !(ep > 0 && ep < 1e6))
        return QT_ERR(QT_EINVAL, "%s: train.epochs must be a positive number (got %g)", c->where, ep);
    t->max_steps = has_steps ? (long)ms : -1;
    t->epochs = has_epochs ? ep : (has_steps ? -1 : 1);
    QT_TRY(get_long(c, s, "train", "save_steps", 0, 0, &t->save_steps));
    QT_TRY(get_int(c, s, "train", "save_total_limit", 0, 0, &t->save_total_limit));
    QT_TRY(get_long(c, s, "train", "eval_steps", 0, 0, &t->eval_steps));
    QT_TRY(get_long(c, s, "train", "log_steps", 1, 1, &t->log_steps));
    QT_TRY(get_long(c, s, "train", "eval_batches", 0, 0, &t->eval_batches));
    double seed = 0;
    QT_TRY(get_num(c, s, "train", "seed", 42, &seed, NULL));
    if (seed < 0 || seed != floor(seed) || seed > 9007199254740992.0)
        return QT_ERR(QT_EINVAL, "%s: train.seed must be a whole number from 0 to 2^53 (got %.17g)", c->where, seed);
    t->seed = (uint64_t)seed;
    QT_TRY(get_bool(c, s, "train", "gradient_checkpointing", 0, &t->gradient_checkpointing));
    QT_TRY(get_bool(c, s, "train", "overwrite_output_dir", 0, &t->overwrite_output_dir));
    QT_TRY(parse_report_to(c, s ? cJSON_GetObjectItemCaseSensitive(s, "report_to") : NULL, &t->report_tensorboard));
    QT_TRY(get_str(c, s, "train", "logging_dir", NULL, &t->logging_dir));
    QT_TRY(resolve(c, &t->logging_dir));
    const cJSON *r = s ? cJSON_GetObjectItemCaseSensitive(s, "resume") : NULL;
    if (r && cJSON_IsBool(r)) {
        t->resume = qt_strdup(cJSON_IsTrue(r) ? "auto" : "never");
        return t->resume ? QT_OK : QT_ENOMEM;
    }
    QT_TRY(get_str(c, s, "train", "resume", "auto", &t->resume));
    if (strcmp(t->resume, "auto") && strcmp(t->resume, "never")) QT_TRY(resolve(c, &t->resume));
    return QT_OK;
}

/* "quantization": BitsAndBytesConfig's names. The 4-bit ones are read; the
 * 8-bit ones refused (LLM.int8 is not implemented); those that change nothing
 * here are named as ignored. */
static int parse_quant(const job_ctx *c, const cJSON *root, qt_job_quant *q) {
    static const char *const known[] = {"load_in_4bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant",
                                        "bnb_4bit_compute_dtype", "llm_int8_skip_modules", "quant_method",
                                        "load_in_8bit", "bnb_4bit_quant_storage", "llm_int8_threshold",
                                        "llm_int8_has_fp16_weight", "llm_int8_enable_fp32_cpu_offload", NULL};
    const cJSON *s;
    memset(q, 0, sizeof *q);
    q->type = QT_Q4_FP4; /* BitsAndBytesConfig's default */
    QT_TRY(section(c, root, "quantization", &s));
    if (!s) return QT_OK;
    warn_unknown(c, s, "quantization", known);
    int l8 = 0;
    QT_TRY(get_bool(c, s, "quantization", "load_in_8bit", 0, &l8));
    if (l8)
        return QT_ERR(QT_EINVAL, "%s: quantization.load_in_8bit: 8-bit (LLM.int8) bases are not supported; use "
                                 "\"load_in_4bit\": true (QLoRA)", c->where);
    QT_TRY(get_bool(c, s, "quantization", "load_in_4bit", 0, &q->load_in_4bit));
    char *v = NULL;
    QT_TRY(get_str(c, s, "quantization", "quant_method", "bitsandbytes", &v));
    int bad = strcmp(v, "bitsandbytes") != 0;
    qt_free(v);
    if (bad)
        return QT_ERR(QT_EINVAL, "%s: quantization.quant_method must be \"bitsandbytes\" (the only one qtune reads)",
                      c->where);
    QT_TRY(get_str(c, s, "quantization", "bnb_4bit_quant_type", "fp4", &v));
    if (!strcmp(v, "nf4")) q->type = QT_Q4_NF4;
    else if (strcmp(v, "fp4")) bad = 1;
    qt_free(v);
    if (bad) return QT_ERR(QT_EINVAL, "%s: quantization.bnb_4bit_quant_type must be \"nf4\" or \"fp4\"", c->where);
    QT_TRY(get_bool(c, s, "quantization", "bnb_4bit_use_double_quant", 0, &q->double_quant));
    QT_TRY(get_str(c, s, "quantization", "bnb_4bit_compute_dtype", NULL, &v));
    if (v) {
        qt_dtype d;
        int rc = qt_dtype_parse(v, &d);
        qt_free(v);
        if (rc != QT_OK) return QT_ERR(QT_EINVAL, "%s: quantization.bnb_4bit_compute_dtype: use float32, bfloat16 "
                                                  "or float16", c->where);
        q->compute_set = 1, q->compute = (int)d;
    }
    QT_TRY(get_str(c, s, "quantization", "bnb_4bit_quant_storage", "uint8", &v));
    bad = strcmp(v, "uint8") != 0;
    qt_free(v);
    if (bad)
        return QT_ERR(QT_EINVAL, "%s: quantization.bnb_4bit_quant_storage: only uint8 (the default) is supported",
                      c->where);
    static const char *const ignored[] = {"llm_int8_threshold", "llm_int8_has_fp16_weight",
                                          "llm_int8_enable_fp32_cpu_offload", NULL};
    for (int i = 0; ignored[i]; i++)
        if (cJSON_GetObjectItemCaseSensitive(s, ignored[i]))
            qt_warn("%s: quantization.%s is ignored (it concerns 8-bit bases or offloading)", c->where, ignored[i]);
    const cJSON *sk = cJSON_GetObjectItemCaseSensitive(s, "llm_int8_skip_modules");
    if (sk && !cJSON_IsNull(sk)) {
        if (!cJSON_IsArray(sk))
            return QT_ERR(QT_EINVAL, "%s: quantization.llm_int8_skip_modules must be a list of module names", c->where);
        for (const cJSON *e = sk->child; e; e = e->next) {
            if (!cJSON_IsString(e))
                return QT_ERR(QT_EINVAL, "%s: quantization.llm_int8_skip_modules must list names", c->where);
            const char *n = strrchr(e->valuestring, '.') ? strrchr(e->valuestring, '.') + 1 : e->valuestring;
            if (!strcmp(n, "lm_head") || !strcmp(n, "embed_tokens") || !strcmp(n, "wte")) continue; /* 16-bit anyway */
            static const char *const linears[] = {"q_proj", "k_proj",  "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj", "c_attn", "c_proj", "w1",     "w2",        NULL};
            int known_linear = 0;
            for (int i = 0; linears[i]; i++) known_linear |= !strcmp(n, linears[i]);
            if (!known_linear) /* said here: qt_job_lora_targets' sentence would name lora.target_modules */
                return QT_ERR(QT_EINVAL, "%s: quantization.llm_int8_skip_modules names '%.200s', which is not a layer "
                                         "linear qtune quantizes: name q_proj, k_proj, v_proj, o_proj, gate_proj, "
                                         "up_proj or down_proj (the original Qwen: c_attn, c_proj, w1 or w2)",
                              c->where, e->valuestring);
            cJSON *one = cJSON_CreateArray();
            if (!one) return QT_ENOMEM;
            cJSON_AddItemToArray(one, cJSON_CreateString(n));
            unsigned m = 0;
            char w[4300];
            snprintf(w, sizeof w, "%s: quantization.llm_int8_skip_modules", c->where);
            int rc = qt_job_lora_targets(one, &m, w);
            cJSON_Delete(one);
            QT_TRY(rc);
            q->skip |= m;
        }
    }
    if (!q->load_in_4bit)
        qt_warn("%s: \"quantization\" without \"load_in_4bit\": true changes nothing; the base stays 16-bit",
                c->where);
    return QT_OK;
}

/* "deepspeed" or "lora" given as a path (relative to the job): the file is
 * read into an object in its place. A "lora" folder means its
 * adapter_config.json (the LoraConfig PEFT writes). */
static int load_section_file(const job_ctx *c, cJSON *root, const char *key, char **path_out) {
    cJSON *ds = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!ds || !cJSON_IsString(ds)) return QT_OK;
    if (!ds->valuestring[0])
        return QT_ERR(QT_EINVAL, "%s: \"%s\" is an empty path; name the %s file (relative to the job), write the "
                      "settings inline as an object, or remove the key", c->where, key,
                      !strcmp(key, "lora") ? "adapter_config.json" : "DeepSpeed config");
    char *p = qt_strdup(ds->valuestring);
    if (!p) return QT_ENOMEM;
    int rc = resolve(c, &p);
    if (rc == QT_OK && !strcmp(key, "lora") && qt_is_dir(p)) {
        char cfg[4096];
        rc = qt_path_join(cfg, sizeof cfg, p, "adapter_config.json");
        char *q = rc == QT_OK ? qt_strdup(cfg) : NULL;
        if (rc == QT_OK && !q) rc = QT_ENOMEM;
        if (q) { qt_free(p); p = q; }
    }
    if (rc == QT_OK && !qt_path_exists(p))
        rc = QT_ERR(QT_EINVAL, "%s: \"%s\" names %s, which does not exist; check the path (relative to the job "
                    "file)", c->where, key, p);
    if (rc != QT_OK) { qt_free(p); return rc; }
    char *text;
    rc = qt_read_file(p, JOB_MAX_BYTES, &text, NULL);
    if (rc != QT_OK) {
        qt_free(p);
        return qt_error_context(rc, "%s: %s", c->where, key);
    }
    const char *errp = NULL;
    cJSON *obj = cJSON_ParseWithOpts(text, &errp, 1);
    if (obj && !cJSON_IsObject(obj)) {
        cJSON_Delete(obj);
        qt_free(text);
        rc = QT_ERR(QT_EFORMAT, "%s: the %s config named by %s's \"%s\" is JSON but not an object; write its settings "
                    "as one object {...}", p, !strcmp(key, "lora") ? "LoRA" : "DeepSpeed", c->where, key);
        qt_free(p);
        return rc;
    }
    if (!obj) {
        char hint[4200];
        snprintf(hint, sizeof hint, "it is the %s config named by %s's \"%s\"", !strcmp(key, "lora") ? "LoRA" : "DeepSpeed",
                 c->where, key);
        rc = qt_json_parse_error(text, errp, p, hint);
        qt_free(text);
        qt_free(p);
        return rc;
    }
    rc = qt_json_check_range(text, strlen(text), p);
    if (rc == QT_OK) rc = qt_json_check_duplicate_keys(obj, p);
    qt_free(text);
    if (rc != QT_OK) {
        cJSON_Delete(obj);
        qt_free(p);
        return rc;
    }
    cJSON_ReplaceItemInObjectCaseSensitive(root, key, obj);
    qt_free(*path_out);
    *path_out = p;
    return QT_OK;
}

static int load_deepspeed(const job_ctx *c, cJSON *root, char **ds_path) {
    return load_section_file(c, root, "deepspeed", ds_path);
}

/* The DeepSpeed section of root, checked as the run will read it
 * (qt_ds_config_check); where names it in an error, which is kept. */
static int ds_check(const cJSON *root, const char *where) {
    const cJSON *ds = cJSON_GetObjectItemCaseSensitive(root, "deepspeed");
    return cJSON_IsObject(ds) ? qt_ds_config_check(ds, where) : QT_OK;
}

/* After `--set deepspeed.X=...` on a DeepSpeed config that read well: one
 * that reads no more is refused naming the override (the run's parse would
 * name the DeepSpeed file, which never held that value). A config that was
 * unreadable before keeps its own error, said by the run's parse. */
static int ds_check_set(const cJSON *root, const char *set) {
    char where[256];
    snprintf(where, sizeof where, "--set %.200s", set);
    return ds_check(root, where);
}

/* What changes the trained result: everything but where outputs go, how often
 * they are written and how the run is resumed. */
static cJSON *fingerprint_view(const cJSON *root) {
    cJSON *cp = cJSON_Duplicate(root, 1);
    if (!cp) return NULL;
    cJSON_DeleteItemFromObjectCaseSensitive(cp, "output_dir");
    /* where it runs: the backends agree within rounding (docs/backends.md), and a
     * run started on a GPU may resume on the CPU and back */
    cJSON_DeleteItemFromObjectCaseSensitive(cp, "device");
    cJSON *t = cJSON_GetObjectItemCaseSensitive(cp, "train");
    static const char *const volatile_train[] = {"max_steps", "save_steps", "save_total_limit", "eval_steps",
                                                 "log_steps", "resume", "overwrite_output_dir", "eval_batches",
                                                 "report_to", "logging_dir"};
    if (cJSON_IsObject(t))
        for (size_t i = 0; i < sizeof volatile_train / sizeof volatile_train[0]; i++)
            cJSON_DeleteItemFromObjectCaseSensitive(t, volatile_train[i]);
    cJSON *d = cJSON_GetObjectItemCaseSensitive(cp, "data");
    if (cJSON_IsObject(d)) {
        cJSON_DeleteItemFromObjectCaseSensitive(d, "num_workers");
        cJSON_DeleteItemFromObjectCaseSensitive(d, "prefetch");
        cJSON_DeleteItemFromObjectCaseSensitive(d, "cache_dir");
        cJSON_DeleteItemFromObjectCaseSensitive(d, "max_line_bytes"); /* only says which lines are refused */
    }
    cJSON *ds = cJSON_GetObjectItemCaseSensitive(cp, "deepspeed");
    if (cJSON_IsObject(ds)) {
        cJSON_DeleteItemFromObjectCaseSensitive(ds, "steps_per_print");
        cJSON_DeleteItemFromObjectCaseSensitive(ds, "wall_clock_breakdown");
        /* A fixed train_batch_size is what defines the training; its split
         * into micro-batch x accumulation x ranks follows the rank count, so
         * a checkpoint resumes on other ranks with the accumulation that
         * keeps the batch (the batch itself still counts). */
        if (cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(ds, "train_batch_size"))) {
            cJSON_DeleteItemFromObjectCaseSensitive(ds, "train_micro_batch_size_per_gpu");
            cJSON_DeleteItemFromObjectCaseSensitive(ds, "gradient_accumulation_steps");
        }
    }
    /* a section that only held volatile keys (or that --set created) is no difference */
    static const char *const sections[] = {"train", "data", "deepspeed"}; /* not lora: {} means LoRA */
    for (size_t i = 0; i < sizeof sections / sizeof sections[0]; i++) {
        cJSON *sct = cJSON_GetObjectItemCaseSensitive(cp, sections[i]);
        if (cJSON_IsObject(sct) && !sct->child) cJSON_DeleteItemFromObjectCaseSensitive(cp, sections[i]);
    }
    return cp;
}

static int cmp_key(const void *a, const void *b) {
    return strcmp((*(cJSON *const *)a)->string, (*(cJSON *const *)b)->string);
}

/* Objects' keys in sorted order, recursively: reordering a job file's keys is
 * no difference. */
static void sort_keys(cJSON *j, int depth) {
    if (depth > 64 || !j) return;
    for (cJSON *c = j->child; c; c = c->next) sort_keys(c, depth + 1);
    if (!cJSON_IsObject(j) || !j->child) return;
    int n = cJSON_GetArraySize(j), k = 0;
    cJSON **items = qt_malloc((size_t)n * sizeof *items, "job keys");
    if (!items) return; /* unsorted: the fingerprint is still a fingerprint */
    while (j->child) {
        cJSON *c = cJSON_DetachItemViaPointer(j, j->child);
        if (!c->string) { cJSON_Delete(c); continue; }
        items[k++] = c;
    }
    qsort(items, (size_t)k, sizeof *items, cmp_key);
    for (int i = 0; i < k; i++) cJSON_AddItemToObject(j, items[i]->string, items[i]);
    qt_free(items);
}

uint64_t qt_job_fingerprint_of(const cJSON *root) {
    cJSON *cp = fingerprint_view(root);
    if (!cp) return 0;
    sort_keys(cp, 0);
    char *s = cJSON_PrintUnformatted(cp);
    cJSON_Delete(cp);
    if (!s) return 0;
    uint64_t h = qt_hash64(s, strlen(s), 0x716a6f62u);
    free(s);
    return h;
}

/* ---- what differs between two jobs (for the resume and output-folder errors) ---- */

#define JOB_DIFF_MAX 4

typedef struct {
    char *out;
    size_t cap, len;
    int n;
} diff_acc;

static void diff_value(char *buf, size_t cap, const cJSON *v) {
    if (!v) { snprintf(buf, cap, "absent"); return; }
    char *s = cJSON_PrintUnformatted(v);
    if (!s) { snprintf(buf, cap, "?"); return; }
    if (strlen(s) > 40) snprintf(buf, cap, "%.37s...", s);
    else snprintf(buf, cap, "%s", s);
    free(s);
}

static void diff_add(diff_acc *a, const char *path, const cJSON *was, const cJSON *now) {
    if (a->n++ >= JOB_DIFF_MAX) return;
    char vw[48], vn[48];
    diff_value(vw, sizeof vw, was);
    diff_value(vn, sizeof vn, now);
    int k = snprintf(a->out + a->len, a->cap - a->len, "%s%s (%s there, %s here)", a->len ? ", " : "", path, vw, vn);
    if (k > 0) a->len = a->len + (size_t)k < a->cap ? a->len + (size_t)k : a->cap - 1;
}

static void diff_walk(diff_acc *a, const char *path, const cJSON *was, const cJSON *now, int depth) {
    if (was && now && cJSON_Compare(was, now, 1)) return;
    if (depth < 8 && cJSON_IsObject(was) && cJSON_IsObject(now)) {
        char sub[256];
        for (const cJSON *e = was->child; e; e = e->next) {
            snprintf(sub, sizeof sub, "%s%s%s", path, path[0] ? "." : "", e->string ? e->string : "?");
            diff_walk(a, sub, e, cJSON_GetObjectItemCaseSensitive(now, e->string), depth + 1);
        }
        for (const cJSON *e = now->child; e; e = e->next) {
            if (cJSON_GetObjectItemCaseSensitive(was, e->string)) continue;
            snprintf(sub, sizeof sub, "%s%s%s", path, path[0] ? "." : "", e->string ? e->string : "?");
            diff_walk(a, sub, NULL, e, depth + 1);
        }
        return;
    }
    diff_add(a, path, was, now);
}

int qt_job_describe_difference(const cJSON *was, const cJSON *now, char *out, size_t cap) {
    if (!cap) return 0;
    out[0] = 0;
    cJSON *a = fingerprint_view(was), *b = fingerprint_view(now);
    diff_acc acc = {out, cap, 0, 0};
    if (a && b) diff_walk(&acc, "", a, b, 0);
    if (acc.n > JOB_DIFF_MAX && acc.len + 16 < cap) snprintf(out + acc.len, cap - acc.len, " and %d more", acc.n - JOB_DIFF_MAX);
    cJSON_Delete(a);
    cJSON_Delete(b);
    return acc.n;
}

int qt_job_parse(const char *json, const char *dir, const char *where, const char *const *sets, int n_sets,
                 qt_job *job) {
    return qt_job_parse_ex(json, dir, where, sets, n_sets, 0, job);
}

int qt_job_parse_ex(const char *json, const char *dir, const char *where, const char *const *sets, int n_sets,
                    int strict, qt_job *job) {
    memset(job, 0, sizeof *job);
    job_ctx c = {where, dir, strict};
    const char *errp = NULL;
    cJSON *root = cJSON_ParseWithOpts(json, &errp, 1);
    if (!root) return qt_json_parse_error(json, errp, where, "the job file must be one JSON object");
    if (!cJSON_IsObject(root)) {
        long off = errp ? (long)(errp - json) : 0;
        int line = 1;
        for (long i = 0; i < off && json[i]; i++) line += json[i] == '\n';
        cJSON_Delete(root);
        return QT_ERR(QT_EFORMAT, "%s: line %d is not valid JSON; the job file must be one JSON object", where, line);
    }
    job->root = root;
    int rc = qt_json_check_range(json, strlen(json), where);
    if (rc == QT_OK) rc = qt_json_check_duplicate_keys(root, where);
    if (rc != QT_OK) { qt_job_free(job); return rc; }
    for (int i = 0; i < n_sets && rc == QT_OK; i++) {
        /* an override inside the DeepSpeed or LoRA config needs its file read first */
        const int ds_set = !strncmp(sets[i], "deepspeed.", 10);
        if (ds_set) rc = load_deepspeed(&c, root, &job->deepspeed_path);
        if (!strncmp(sets[i], "lora.", 5)) rc = load_section_file(&c, root, "lora", &job->lora_path);
        int ds_was_ok = 0;
        if (ds_set && rc == QT_OK && !(ds_was_ok = ds_check(root, "") == QT_OK)) qt_error_clear();
        if (rc == QT_OK) rc = qt_job_apply_set(root, sets[i]);
        if (rc == QT_OK && ds_was_ok) rc = ds_check_set(root, sets[i]);
    }
    if (rc == QT_OK) rc = load_deepspeed(&c, root, &job->deepspeed_path);
    if (rc == QT_OK) rc = load_section_file(&c, root, "lora", &job->lora_path);
    if (rc != QT_OK) { qt_job_free(job); return rc; }

    static const char *const known[] = {"model",     "output_dir", "data",         "lora", "train",
                                        "deepspeed", "device",     "quantization", "objective", NULL};
    rc = warn_unknown(&c, root, "", known);
    if (rc != QT_OK) { qt_job_free(job); return rc; }
    job->dir = qt_strdup(dir);
    job->path = qt_strdup(where);
    if (!job->dir || !job->path) rc = QT_ENOMEM;
    if (rc == QT_OK) rc = get_str(&c, root, "", "model", NULL, &job->model);
    if (rc == QT_OK && !job->model)
        rc = QT_ERR(QT_EINVAL, "%s: \"model\" is missing; name a Hugging Face model folder", where);
    if (rc == QT_OK) rc = resolve(&c, &job->model);
    if (rc == QT_OK) rc = get_str(&c, root, "", "output_dir", NULL, &job->output_dir);
    if (rc == QT_OK && !job->output_dir)
        rc = QT_ERR(QT_EINVAL, "%s: \"output_dir\" is missing; name the folder for checkpoints and results", where);
    if (rc == QT_OK) rc = resolve(&c, &job->output_dir);
    if (rc == QT_OK) rc = get_str(&c, root, "", "device", "auto", &job->device);
    if (rc == QT_OK) {
        char w[4200];
        snprintf(w, sizeof w, "%s: \"device\":", where);
        rc = qt_device_check(job->device, w); /* what the machine has is asked when the run starts */
    }
    if (rc == QT_OK) rc = parse_data(&c, root, &job->data);
    /* a lora section read from a file: its errors name that file */
    char lora_where[4400];
    job_ctx lc = c;
    if (job->lora_path) {
        snprintf(lora_where, sizeof lora_where, "%s (%s's \"lora\")", job->lora_path, where);
        lc.where = lora_where;
    }
    if (rc == QT_OK) rc = parse_lora(&lc, root, &job->lora);
    if (rc == QT_OK) rc = parse_train(&c, root, &job->train);
    if (rc == QT_OK) rc = parse_quant(&c, root, &job->quant);
    if (rc == QT_OK && job->quant.load_in_4bit && !job->lora.enabled)
        rc = QT_ERR(QT_EINVAL, "%s: a 4-bit base (quantization.load_in_4bit) is frozen, so full fine-tuning cannot "
                               "update it; add a \"lora\" section (QLoRA) or drop \"quantization\"", where);
    if (rc == QT_OK) rc = qt_objective_parse(cJSON_GetObjectItemCaseSensitive(root, "objective"), where, &job->objective);
    if (rc == QT_OK) {
        cJSON *ds = cJSON_GetObjectItemCaseSensitive(root, "deepspeed");
        if (ds && !cJSON_IsNull(ds) && !cJSON_IsObject(ds))
            rc = QT_ERR(QT_EINVAL, "%s: \"deepspeed\" must be a path to a DeepSpeed JSON file or an object", where);
        else if (ds && cJSON_IsObject(ds)) {
            job->deepspeed = cJSON_Duplicate(ds, 1);
            if (!job->deepspeed) rc = QT_ERR(QT_ENOMEM, "out of memory copying the DeepSpeed config");
        }
    }
    if (rc == QT_OK && strict && job->deepspeed) {
        char dsw[4200];
        if (job->deepspeed_path) snprintf(dsw, sizeof dsw, "%s", job->deepspeed_path);
        else snprintf(dsw, sizeof dsw, "%s: deepspeed", where);
        rc = qt_ds_config_check_strict(job->deepspeed, dsw);
    }
    if (rc != QT_OK) { qt_job_free(job); return rc; }
    job->fingerprint = qt_job_fingerprint_of(root);
    return QT_OK;
}

int qt_job_load(const char *path, const char *const *sets, int n_sets, qt_job *job) {
    return qt_job_load_ex(path, sets, n_sets, 0, job);
}

int qt_job_load_ex(const char *path, const char *const *sets, int n_sets, int strict, qt_job *job) {
    memset(job, 0, sizeof *job);
    char *text;
    QT_TRY(qt_read_file(path, JOB_MAX_BYTES, &text, NULL));
    char dir[4096];
    qt_path_dirname(dir, sizeof dir, path);
    int rc = qt_job_parse_ex(text, dir, path, sets, n_sets, strict, job);
    qt_free(text);
    return rc;
}

void qt_job_free(qt_job *job) {
    if (!job) return;
    qt_free(job->path);
    qt_free(job->dir);
    qt_free(job->model);
    qt_free(job->output_dir);
    qt_free(job->device);
    for (int i = 0; i < job->data.n_train; i++) qt_free(job->data.train_files[i]);
    for (int i = 0; i < job->data.n_eval; i++) qt_free(job->data.eval_files[i]);
    qt_free(job->data.train_files);
    qt_free(job->data.eval_files);
    qt_free(job->data.train_weights);
    qt_free(job->data.mix_strategy);
    qt_free(job->data.format);
    qt_free(job->data.cache_dir);
    for (int i = 0; i < job->lora.n_target_names; i++) qt_free(job->lora.target_names[i]);
    qt_free(job->lora.target_names);
    qt_free(job->lora.init_from);
    qt_free(job->train.resume);
    qt_free(job->train.logging_dir);
    qt_free(job->deepspeed_path);
    qt_free(job->lora_path);
    cJSON_Delete(job->deepspeed);
    cJSON_Delete(job->root);
    memset(job, 0, sizeof *job);
}
