/* PEFT LoRA adapter folders: adapter_config.json + adapter_model.safetensors. */
#include "io/peft.h"

#include "core/error.h"
#include "core/fs.h"
#include "core/json_range.h"
#include "core/log.h"
#include "core/mem.h"
#include "core/words.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <cjson/cJSON.h>
#include <math.h>
#include <pcre2.h>
#include <stdlib.h>
#include <string.h>

#define PEFT_CONFIG_MAX_BYTES (1u << 20)

int peft_alpha_ok(double alpha) { return alpha >= PEFT_ALPHA_MIN && alpha <= PEFT_ALPHA_MAX; }

float peft_scaling(const peft_config *c) {
    return c->use_rslora ? c->lora_alpha / sqrtf((float)c->r) : c->lora_alpha / (float)c->r;
}

/* target_modules given as a regex: compiled for a full match of a module
 * name (PEFT: re.fullmatch). NULL with an error naming path when PCRE2
 * refuses it. */
static pcre2_code *regex_compile(const char *re, const char *path) {
    int err;
    PCRE2_SIZE off;
    pcre2_code *code = pcre2_compile((PCRE2_SPTR)re, PCRE2_ZERO_TERMINATED, PCRE2_ANCHORED | PCRE2_ENDANCHORED | PCRE2_UTF,
                                     &err, &off, NULL);
    if (!code) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        QT_ERR(QT_EFORMAT, "%s: target_modules is the regex '%s', which does not compile at offset %zu (%s); fix it",
               path, re, (size_t)off, (const char *)msg);
    }
    return code;
}

static int regex_full_match(const char *re, const char *name) {
    pcre2_code *code = regex_compile(re, "target_modules");
    if (!code) return 0;
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(code, NULL);
    /* a module name is under 100 characters: a legitimate pattern needs far
     * fewer steps, a hostile one ("(a+)+b") stops here as "no match" */
    pcre2_match_context *mc = pcre2_match_context_create(NULL);
    if (mc) pcre2_set_match_limit(mc, 100000);
    int rc = md && mc ? pcre2_match(code, (PCRE2_SPTR)name, PCRE2_ZERO_TERMINATED, 0, 0, md, mc) : -1;
    pcre2_match_context_free(mc);
    pcre2_match_data_free(md);
    pcre2_code_free(code);
    return rc >= 0;
}

/* A pattern dict (rank_pattern, alpha_pattern) is fine only when empty. */
static int empty_or_null(const cJSON *j) { return !j || cJSON_IsNull(j) || (cJSON_IsObject(j) && !j->child); }

/* LoraConfig's fields that qtune implements only at PEFT's default value.
 * A key at its default (or null) is accepted quietly: PEFT writes them all
 * into every adapter_config.json. kind: what the default is. meaning: for the
 * keys that change what a saved adapter's weights mean, what a set value
 * does (saved_adapter_meaning refuses it there; NULL: not such a key). */
typedef enum { DEF_NULL, DEF_FALSE, DEF_TRUE_OR_NULL, DEF_EMPTY_OBJ, DEF_ANY_BOOL, DEF_ANY_STRING, DEF_ANY } def_kind;

static const struct {
    const char *key;
    def_kind kind;
    const char *why; /* what to do instead, for the error */
    const char *meaning;
} lora_defaults[] = {
    {"inference_mode", DEF_ANY_BOOL, NULL, NULL},
    {"base_model_name_or_path", DEF_ANY_STRING, NULL, NULL},
    {"revision", DEF_ANY_STRING, NULL, NULL},
    {"auto_mapping", DEF_ANY, NULL, NULL},
    {"megatron_core", DEF_ANY_STRING, NULL, NULL},
    {"fan_in_fan_out", DEF_FALSE, "Qwen's Linear layers store (out, in) weights and never need it", NULL},
    {"init_lora_weights", DEF_TRUE_OR_NULL,
     "qtune initializes A as PEFT's default (Kaiming-uniform) and B as zeros; set true", NULL},
    {"use_dora", DEF_FALSE, "qtune trains plain LoRA; set false", NULL},
    {"lora_bias", DEF_FALSE, "qtune trains no LoRA bias; set false", NULL},
    {"layers_to_transform", DEF_ANY, NULL, NULL}, /* read by peft_parse_extras */
    {"layers_pattern", DEF_ANY, NULL, NULL},
    {"rank_pattern", DEF_EMPTY_OBJ, "qtune uses one r for every module; remove it", NULL},
    {"alpha_pattern", DEF_EMPTY_OBJ, "qtune uses one lora_alpha for every module; remove it", NULL},
    {"modules_to_save", DEF_ANY, NULL, NULL},
    {"ensure_weight_tying", DEF_FALSE,
     "qtune trains each listed module of a tied model as its own copy, as PEFT does by default; set false", NULL},
    {"megatron_config", DEF_NULL, "remove it", NULL},
    {"loftq_config", DEF_EMPTY_OBJ, "qtune does not implement LoftQ; remove it", NULL},
    {"eva_config", DEF_NULL, "qtune does not implement EVA initialization; remove it", NULL},
    {"corda_config", DEF_NULL, "qtune does not implement CorDA initialization; remove it", NULL},
    {"layer_replication", DEF_NULL, "remove it", "repeats base layers to build a deeper model"},
    {"exclude_modules", DEF_NULL, "list the modules to adapt in target_modules instead",
     "removes modules from target_modules, which qtune reads alone; write the modules to adapt in target_modules "
     "(a list or one regex)"},
    {"trainable_token_indices", DEF_NULL, "remove it", NULL},
    {"target_parameters", DEF_NULL, "remove it", "adapts parameters that are not Linear layers"},
    {"use_qalora", DEF_FALSE, "remove it", "pools each input before the adapter (QA-LoRA)"},
    {"qalora_group_size", DEF_ANY, NULL, NULL},
    {"runtime_config", DEF_ANY, NULL, NULL},
    {"lora_ga_config", DEF_NULL, "remove it", NULL},
    {"alora_invocation_tokens", DEF_NULL, "remove it",
     "applies the adapter only after its invocation tokens (activated LoRA)"},
    {"arrow_config", DEF_NULL, "remove it", "routes between several adapters (Arrow)"},
};

int peft_is_lora_key(const char *key) {
    for (size_t i = 0; i < sizeof lora_defaults / sizeof lora_defaults[0]; i++)
        if (!strcmp(key, lora_defaults[i].key)) return 1;
    return 0;
}

const char *peft_nearest_lora_key(const char *word, const char *const *also) {
    enum { N = sizeof lora_defaults / sizeof lora_defaults[0] };
    const char *all[N + 64];
    size_t n = 0;
    for (size_t i = 0; i < N; i++) all[n++] = lora_defaults[i].key;
    for (; also && *also && n < N + 63; also++) all[n++] = *also;
    all[n] = NULL;
    return qt_nearest_word(word, all);
}

int peft_check_lora_defaults(const cJSON *j, const char *where) {
    for (size_t i = 0; i < sizeof lora_defaults / sizeof lora_defaults[0]; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, lora_defaults[i].key);
        if (!v || cJSON_IsNull(v)) continue;
        int ok;
        switch (lora_defaults[i].kind) {
        case DEF_NULL: ok = 0; break;
        case DEF_FALSE: ok = cJSON_IsFalse(v); break;
        case DEF_TRUE_OR_NULL: ok = cJSON_IsTrue(v); break;
        case DEF_EMPTY_OBJ: ok = cJSON_IsObject(v) && !v->child; break;
        case DEF_ANY_BOOL: ok = cJSON_IsBool(v); break;
        case DEF_ANY_STRING: ok = cJSON_IsString(v); break;
        default: ok = 1; break;
        }
        if (ok) continue;
        char *val = cJSON_PrintUnformatted(v);
        int rc = QT_ERR(QT_EUNSUPPORTED, "%s%s is %.60s%s, which qtune does not implement; %s", where,
                        lora_defaults[i].key, val ? val : "set", val && strlen(val) > 60 ? "..." : "",
                        lora_defaults[i].why ? lora_defaults[i].why : "remove it");
        free(val);
        return rc;
    }
    return QT_OK;
}

/* A JSON number that is a whole number in [lo, hi]. */
static int whole(const cJSON *v, double lo, double hi) {
    return cJSON_IsNumber(v) && v->valuedouble >= lo && v->valuedouble <= hi && v->valuedouble == floor(v->valuedouble);
}

int peft_parse_extras(const cJSON *j, peft_config *c, const char *where) {
    const cJSON *ms = cJSON_GetObjectItemCaseSensitive(j, "modules_to_save");
    const cJSON *lt = cJSON_GetObjectItemCaseSensitive(j, "layers_to_transform");
    const cJSON *lp = cJSON_GetObjectItemCaseSensitive(j, "layers_pattern");
    const cJSON *tm = cJSON_GetObjectItemCaseSensitive(j, "target_modules");
    c->n_save = c->n_layers = c->layers_int = c->n_patterns = c->patterns_list = 0;
    if (ms && !cJSON_IsNull(ms)) {
        if (!cJSON_IsArray(ms))
            return QT_ERR(QT_EFORMAT, "%smodules_to_save must be a list of module names such as [\"embed_tokens\", "
                          "\"lm_head\"] or null", where);
        const cJSON *it;
        cJSON_ArrayForEach(it, ms) {
            if (!cJSON_IsString(it) || !it->valuestring[0] || strlen(it->valuestring) >= sizeof c->modules_to_save[0] ||
                c->n_save >= PEFT_MAX_SAVE)
                return QT_ERR(QT_EFORMAT, "%smodules_to_save must list at most %d module names of under %zu "
                              "characters, such as [\"embed_tokens\", \"lm_head\"]", where, PEFT_MAX_SAVE,
                              sizeof c->modules_to_save[0]);
            snprintf(c->modules_to_save[c->n_save++], sizeof c->modules_to_save[0], "%s", it->valuestring);
        }
    }
    if (lt && !cJSON_IsNull(lt)) {
        if (cJSON_IsString(tm))
            return QT_ERR(QT_EINVAL, "%slayers_to_transform cannot be used when target_modules is a string (\"%.60s\"), "
                          "as PEFT's LoraConfig says; list the module names instead", where, tm->valuestring);
        if (whole(lt, 0, 1e9)) {
            c->layers_to_transform[c->n_layers++] = (int)lt->valuedouble;
            c->layers_int = 1;
        } else if (cJSON_IsArray(lt) && lt->child) {
            const cJSON *it;
            cJSON_ArrayForEach(it, lt) {
                if (!whole(it, 0, 1e9) || c->n_layers >= PEFT_MAX_LAYERS)
                    return QT_ERR(QT_EFORMAT, "%slayers_to_transform must be a layer index or a list of at most %d "
                                  "layer indices (whole numbers from 0)", where, PEFT_MAX_LAYERS);
                c->layers_to_transform[c->n_layers++] = (int)it->valuedouble;
            }
        } else {
            return QT_ERR(QT_EFORMAT, "%slayers_to_transform must be a layer index or a non-empty list of layer "
                          "indices, such as [0, 1, 2], or null", where);
        }
    }
    if (lp && !cJSON_IsNull(lp)) {
        if (!c->n_layers)
            return QT_ERR(QT_EINVAL, "%slayers_pattern is set but layers_to_transform is not; PEFT's LoraConfig "
                          "needs both (layers_pattern only names where the layer index is)", where);
        const cJSON *one = cJSON_IsString(lp) ? lp : NULL;
        c->patterns_list = cJSON_IsArray(lp);
        if (!one && !(c->patterns_list && lp->child))
            return QT_ERR(QT_EFORMAT, "%slayers_pattern must be a name such as \"layers\" (or a list of names) or "
                          "null", where);
        for (const cJSON *it = one ? one : lp->child; it; it = one ? NULL : it->next) {
            if (!cJSON_IsString(it) || !it->valuestring[0] || strlen(it->valuestring) >= sizeof c->layers_pattern[0] ||
                c->n_patterns >= PEFT_MAX_PATTERNS)
                return QT_ERR(QT_EFORMAT, "%slayers_pattern must be a name such as \"layers\" of under %zu "
                              "characters, or a list of at most %d", where, sizeof c->layers_pattern[0],
                              PEFT_MAX_PATTERNS);
            char re[128];
            snprintf(re, sizeof re, ".*\\.%s\\.(\\d+)\\.", it->valuestring);
            int err;
            PCRE2_SIZE off;
            pcre2_code *code = pcre2_compile((PCRE2_SPTR)re, PCRE2_ZERO_TERMINATED, PCRE2_ANCHORED | PCRE2_UTF, &err,
                                             &off, NULL);
            if (!code)
                return QT_ERR(QT_EFORMAT, "%slayers_pattern '%s' is not a regex PEFT can use; write the name of the "
                              "model's layer list, such as \"layers\"", where, it->valuestring);
            pcre2_code_free(code);
            snprintf(c->layers_pattern[c->n_patterns++], sizeof c->layers_pattern[0], "%s", it->valuestring);
        }
    }
    return QT_OK;
}

/* PEFT's re.match(rf".*\.{pattern}\.(\d+)\.", key): the layer number, or -1. */
static int layer_match(const char *re, const char *module) {
    int err;
    PCRE2_SIZE off;
    pcre2_code *code = pcre2_compile((PCRE2_SPTR)re, PCRE2_ZERO_TERMINATED, PCRE2_ANCHORED | PCRE2_UTF, &err, &off,
                                     NULL);
    if (!code) return -1;
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(code, NULL);
    pcre2_match_context *mc = pcre2_match_context_create(NULL);
    if (mc) pcre2_set_match_limit(mc, 100000);
    int rc = md && mc ? pcre2_match(code, (PCRE2_SPTR)module, PCRE2_ZERO_TERMINATED, 0, 0, md, mc) : -1;
    long idx = -1;
    if (rc >= 2) {
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        char num[16];
        size_t n = ov[3] - ov[2];
        if (n < sizeof num) {
            memcpy(num, module + ov[2], n);
            num[n] = 0;
            idx = strtol(num, NULL, 10);
        }
    }
    pcre2_match_context_free(mc);
    pcre2_match_data_free(md);
    pcre2_code_free(code);
    return idx > 1000000000 ? -1 : (int)idx;
}

int peft_layer_index(const peft_config *c, const char *module) {
    if (!c->n_patterns) return layer_match(".*\\.[^.]*\\.(\\d+)\\.", module);
    for (int i = 0; i < c->n_patterns; i++) {
        char re[128];
        snprintf(re, sizeof re, ".*\\.%s\\.(\\d+)\\.", c->layers_pattern[i]);
        int idx = layer_match(re, module);
        if (idx >= 0) return idx;
    }
    return -1;
}

/* Keys of a saved adapter_config.json beyond the LoraConfig defaults above:
 * PeftConfig's own and the ones peft_config_load reads. Any other key is
 * ignored, aloud. */
static const char *const saved_keys[] = {"peft_type", "task_type", "peft_version", "r", "lora_alpha", "lora_dropout",
                                         "target_modules", "use_rslora", "bias", NULL};

/* A value that is absent, null, false, or an empty string, list or object. */
static int unset(const cJSON *v) {
    return !v || cJSON_IsNull(v) || cJSON_IsFalse(v) || (cJSON_IsString(v) && !v->valuestring[0]) ||
           ((cJSON_IsArray(v) || cJSON_IsObject(v)) && !v->child);
}

/* What a saved adapter's other keys say about the meaning of its weights.
 * init_lora_weights only chose where training started, except for the forms
 * that also changed the base model's weights (PiSSA, OLoRA, CorDA, LoftQ): such
 * an adapter belongs to that changed base, not to the model folder's weights.
 * Keys that change the forward pass are refused; unknown keys are ignored with
 * a warning. path: the adapter_config.json. */
static int saved_adapter_meaning(const cJSON *j, const char *path) {
    const cJSON *init = cJSON_GetObjectItemCaseSensitive(j, "init_lora_weights");
    static const char *const base_changing[] = {"pissa", "olora", "corda", "loftq"};
    for (size_t i = 0; cJSON_IsString(init) && i < sizeof base_changing / sizeof base_changing[0]; i++)
        if (!strncmp(init->valuestring, base_changing[i], strlen(base_changing[i])))
            return QT_ERR(QT_EUNSUPPORTED, "%s: init_lora_weights is \"%.40s\": PEFT changed the base model's weights "
                          "when it made this adapter, so the adapter does not apply to the original model; save it "
                          "again with save_pretrained(..., path_initial_model_for_weight_conversion=...), which "
                          "turns it into a plain LoRA", path, init->valuestring);
    for (size_t i = 0; i < sizeof lora_defaults / sizeof lora_defaults[0]; i++)
        if (lora_defaults[i].meaning && !unset(cJSON_GetObjectItemCaseSensitive(j, lora_defaults[i].key)))
            return QT_ERR(QT_EUNSUPPORTED, "%s: %s is set, which %s; qtune reads plain LoRA adapters only", path,
                          lora_defaults[i].key, lora_defaults[i].meaning);
    /* a command reads the same adapter_config.json more than once: its unknown keys are named once */
    static char warned[4096];
    if (!strcmp(warned, path)) return QT_OK;
    snprintf(warned, sizeof warned, "%s", path);
    for (const cJSON *it = j->child; it; it = it->next) {
        int known = peft_is_lora_key(it->string);
        for (int i = 0; saved_keys[i] && !known; i++) known = !strcmp(it->string, saved_keys[i]);
        const char *near = known ? NULL : peft_nearest_lora_key(it->string, saved_keys);
        if (near)
            qt_warn("%s: key \"%s\" is not a LoRA setting qtune knows and is ignored; did you mean \"%s\"?", path,
                    it->string, near);
        else if (!known)
            qt_warn("%s: key \"%s\" is not a LoRA setting qtune knows and is ignored; check that the adapter is a "
                    "plain PEFT LoRA", path, it->string);
    }
    return QT_OK;
}

int peft_layer_listed(const peft_config *c, int layer) {
    if (!c->n_layers) return 1;
    for (int i = 0; i < c->n_layers; i++)
        if (c->layers_to_transform[i] == layer) return 1;
    return 0;
}

int peft_config_load(const char *dir, peft_config *c) {
    memset(c, 0, sizeof *c);
    char path[4096];
    QT_TRY(qt_path_join(path, sizeof path, dir, "adapter_config.json"));
    char *text;
    QT_TRY(qt_read_file(path, PEFT_CONFIG_MAX_BYTES, &text, NULL));
    const char *end = NULL;
    cJSON *j = cJSON_ParseWithOpts(text, &end, 1); /* 1: nothing but whitespace after the object */
    int rc = QT_OK;
    if (!j) {
        rc = qt_json_parse_error(text, end, path, "fix it or save the adapter again");
        qt_free(text);
        return rc;
    }
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        qt_free(text);
        return QT_ERR(QT_EFORMAT, "%s is not a JSON object; is it a PEFT adapter folder?", path);
    }
    rc = qt_json_check_range(text, end ? (size_t)(end - text) : strlen(text), path);
    qt_free(text);
    if (rc != QT_OK) {
        cJSON_Delete(j);
        return rc;
    }
    const cJSON *pt = cJSON_GetObjectItemCaseSensitive(j, "peft_type");
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(j, "r");
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(j, "lora_alpha");
    const cJSON *d = cJSON_GetObjectItemCaseSensitive(j, "lora_dropout");
    const cJSON *tm = cJSON_GetObjectItemCaseSensitive(j, "target_modules");
    const cJSON *rs = cJSON_GetObjectItemCaseSensitive(j, "use_rslora");
    const cJSON *bias = cJSON_GetObjectItemCaseSensitive(j, "bias");
    const cJSON *dora = cJSON_GetObjectItemCaseSensitive(j, "use_dora");
    const cJSON *ffo = cJSON_GetObjectItemCaseSensitive(j, "fan_in_fan_out");
    const cJSON *base = cJSON_GetObjectItemCaseSensitive(j, "base_model_name_or_path");
    if (pt && !(cJSON_IsString(pt) && !strcmp(pt->valuestring, "LORA")))
        rc = QT_ERR(QT_EUNSUPPORTED, "%s: peft_type must be \"LORA\"; qtune reads LoRA adapters only", path);
    else if (!cJSON_IsNumber(r) || r->valuedouble < 1 || r->valuedouble > 65536 || r->valuedouble != floor(r->valuedouble))
        rc = QT_ERR(QT_EFORMAT, "%s: \"r\" must be a whole number >= 1", path);
    else if (a && !cJSON_IsNull(a) && !cJSON_IsNumber(a))
        rc = QT_ERR(QT_EFORMAT, "%s: \"lora_alpha\" must be a number", path);
    else if (cJSON_IsNumber(a) && !peft_alpha_ok(a->valuedouble))
        rc = QT_ERR(QT_EFORMAT, "%s: \"lora_alpha\" is %g; it must be a number from %g to %g", path, a->valuedouble,
                    PEFT_ALPHA_MIN, PEFT_ALPHA_MAX);
    else if (d && !cJSON_IsNull(d) && !(cJSON_IsNumber(d) && d->valuedouble >= 0 && d->valuedouble < 1))
        rc = QT_ERR(QT_EFORMAT, "%s: \"lora_dropout\" must be a number in [0, 1)", path);
    /* PEFT takes any truthy value ("true", 1) as rsLoRA: read as false it would scale by alpha / r silently */
    else if (rs && !cJSON_IsNull(rs) && !cJSON_IsBool(rs))
        rc = QT_ERR(QT_EFORMAT, "%s: \"use_rslora\" must be true or false (not a string or number); fix it", path);
    else if (bias && !cJSON_IsNull(bias) && !(cJSON_IsString(bias) && !strcmp(bias->valuestring, "none")))
        rc = QT_ERR(QT_EUNSUPPORTED, "%s: bias is \"%s\"; qtune handles adapters with bias \"none\" only", path,
                    cJSON_IsString(bias) ? bias->valuestring : "?");
    else if (cJSON_IsTrue(dora))
        rc = QT_ERR(QT_EUNSUPPORTED, "%s: use_dora is true; qtune handles plain LoRA adapters only", path);
    else if (cJSON_IsTrue(ffo))
        rc = QT_ERR(QT_EUNSUPPORTED, "%s: fan_in_fan_out is true, which Qwen's Linear layers never need", path);
    else if (!empty_or_null(cJSON_GetObjectItemCaseSensitive(j, "rank_pattern")) ||
             !empty_or_null(cJSON_GetObjectItemCaseSensitive(j, "alpha_pattern")))
        rc = QT_ERR(QT_EUNSUPPORTED, "%s: rank_pattern/alpha_pattern are set; qtune handles one r and alpha for all layers",
                    path);
    else if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(j, "ensure_weight_tying")))
        rc = QT_ERR(QT_EUNSUPPORTED, "%s: ensure_weight_tying is true; qtune reads adapters whose modules_to_save "
                    "are trained as separate copies (PEFT's default, false)", path);
    if (rc == QT_OK) rc = saved_adapter_meaning(j, path);
    if (rc == QT_OK) {
        char where[4200];
        snprintf(where, sizeof where, "%s: ", path);
        rc = peft_parse_extras(j, c, where);
    }
    if (rc == QT_OK) {
        c->r = (int)r->valuedouble;
        c->lora_alpha = cJSON_IsNumber(a) ? (float)a->valuedouble : 8.0f;
        c->lora_dropout = cJSON_IsNumber(d) ? (float)d->valuedouble : 0.0f;
        c->use_rslora = cJSON_IsTrue(rs);
        if (cJSON_IsString(base)) snprintf(c->base_model, sizeof c->base_model, "%s", base->valuestring);
        if (cJSON_IsArray(tm)) {
            const cJSON *it;
            cJSON_ArrayForEach(it, tm) {
                if (!cJSON_IsString(it) || strlen(it->valuestring) >= sizeof c->target_modules[0] ||
                    c->n_targets >= PEFT_MAX_TARGETS) {
                    rc = QT_ERR(QT_EFORMAT, "%s: target_modules must be a list of at most %d module names of under %zu "
                                            "characters each, or one regex string", path, PEFT_MAX_TARGETS,
                                sizeof c->target_modules[0]);
                    break;
                }
                snprintf(c->target_modules[c->n_targets++], sizeof c->target_modules[0], "%s", it->valuestring);
            }
        } else if (cJSON_IsString(tm) && !strcmp(tm->valuestring, "all-linear")) {
            snprintf(c->target_modules[c->n_targets++], sizeof c->target_modules[0], "all-linear");
        } else if (cJSON_IsString(tm)) {
            pcre2_code *code = NULL;
            if (strlen(tm->valuestring) >= sizeof c->target_regex)
                rc = QT_ERR(QT_EFORMAT, "%s: target_modules is a regex of %zu characters; qtune reads up to %d", path,
                            strlen(tm->valuestring), PEFT_MAX_REGEX - 1);
            else if (!(code = regex_compile(tm->valuestring, path)))
                rc = qt_error_code();
            else
                snprintf(c->target_regex, sizeof c->target_regex, "%s", tm->valuestring);
            pcre2_code_free(code);
        } else if (tm && !cJSON_IsNull(tm)) {
            rc = QT_ERR(QT_EFORMAT, "%s: target_modules must be a list of module names or a regex string", path);
        }
    }
    cJSON_Delete(j);
    return rc;
}

void peft_base_model_name(const char *model_dir, char *out, size_t cap) {
    char *abs = realpath(model_dir, NULL);
    snprintf(out, cap, "%s", abs ? abs : model_dir);
    free(abs);
}

int peft_config_write(const peft_config *c, const char *dir) {
    cJSON *j = cJSON_CreateObject();
    if (!j) return QT_ERR(QT_ENOMEM, "out of memory writing adapter_config.json");
    /* LoraConfig's fields as peft's save_pretrained writes them, limited to the
     * ones peft 0.7 already had (use_rslora, loftq_config): older peft builds
     * the config with LoraConfig(**json) and fails on a key it does not know,
     * newer ones fill in the keys that are missing */
    cJSON_AddItemToObject(j, "alpha_pattern", cJSON_CreateObject());
    cJSON_AddNullToObject(j, "auto_mapping");
    cJSON_AddStringToObject(j, "base_model_name_or_path", c->base_model);
    cJSON_AddStringToObject(j, "bias", "none");
    cJSON_AddFalseToObject(j, "fan_in_fan_out");
    cJSON_AddTrueToObject(j, "inference_mode");
    cJSON_AddTrueToObject(j, "init_lora_weights");
    if (!c->n_patterns) {
        cJSON_AddNullToObject(j, "layers_pattern");
    } else if (!c->patterns_list) {
        cJSON_AddStringToObject(j, "layers_pattern", c->layers_pattern[0]);
    } else {
        cJSON *lp = cJSON_AddArrayToObject(j, "layers_pattern");
        for (int i = 0; lp && i < c->n_patterns; i++) cJSON_AddItemToArray(lp, cJSON_CreateString(c->layers_pattern[i]));
    }
    if (!c->n_layers) {
        cJSON_AddNullToObject(j, "layers_to_transform");
    } else if (c->layers_int) {
        cJSON_AddNumberToObject(j, "layers_to_transform", c->layers_to_transform[0]);
    } else {
        cJSON *lt = cJSON_AddArrayToObject(j, "layers_to_transform");
        for (int i = 0; lt && i < c->n_layers; i++) cJSON_AddItemToArray(lt, cJSON_CreateNumber(c->layers_to_transform[i]));
    }
    cJSON_AddItemToObject(j, "loftq_config", cJSON_CreateObject());
    cJSON_AddNumberToObject(j, "lora_alpha", c->lora_alpha);
    /* dropout as the decimal the user wrote (0.1, not 0.10000000149) */
    char buf[32];
    snprintf(buf, sizeof buf, "%.6g", (double)c->lora_dropout);
    cJSON_AddNumberToObject(j, "lora_dropout", strtod(buf, NULL));
    cJSON_AddNullToObject(j, "megatron_config");
    cJSON_AddStringToObject(j, "megatron_core", "megatron.core");
    if (!c->n_save) {
        cJSON_AddNullToObject(j, "modules_to_save");
    } else {
        cJSON *ms = cJSON_AddArrayToObject(j, "modules_to_save");
        for (int i = 0; ms && i < c->n_save; i++) cJSON_AddItemToArray(ms, cJSON_CreateString(c->modules_to_save[i]));
    }
    cJSON_AddStringToObject(j, "peft_type", "LORA");
    cJSON_AddNumberToObject(j, "r", c->r);
    cJSON_AddItemToObject(j, "rank_pattern", cJSON_CreateObject());
    cJSON_AddNullToObject(j, "revision");
    if (c->target_regex[0]) {
        cJSON_AddStringToObject(j, "target_modules", c->target_regex);
    } else {
        cJSON *tm = cJSON_AddArrayToObject(j, "target_modules");
        for (int i = 0; tm && i < c->n_targets; i++)
            cJSON_AddItemToArray(tm, cJSON_CreateString(c->target_modules[i]));
    }
    cJSON_AddStringToObject(j, "task_type", "CAUSAL_LM");
    cJSON_AddBoolToObject(j, "use_rslora", c->use_rslora ? 1 : 0);
    char *s = cJSON_Print(j);
    cJSON_Delete(j);
    if (!s) return QT_ERR(QT_ENOMEM, "out of memory writing adapter_config.json");
    char path[4096];
    int rc = qt_path_join(path, sizeof path, dir, "adapter_config.json");
    if (rc == QT_OK) rc = qt_write_file_atomic(path, s, strlen(s));
    free(s);
    return rc;
}

static int ends_with_part(const char *name, const char *part) {
    size_t n = strlen(name), k = strlen(part);
    return n == k ? !strcmp(name, part) : n > k && name[n - k - 1] == '.' && !strcmp(name + n - k, part);
}

int peft_target_entry_matches(const char *entry, const char *module) {
    return !strcmp(entry, "all-linear") ? !ends_with_part(module, "lm_head") : ends_with_part(module, entry);
}

int peft_targets_module(const peft_config *c, const char *module) {
    if (c->target_regex[0]) return regex_full_match(c->target_regex, module);
    for (int i = 0; i < c->n_targets; i++)
        if (peft_target_entry_matches(c->target_modules[i], module)) return 1;
    return 0;
}

void peft_targets_str(const peft_config *c, char *out, size_t cap) {
    size_t n = 0;
    out[0] = 0;
    if (c->target_regex[0]) {
        snprintf(out, cap, "regex '%s'", c->target_regex);
        return;
    }
    for (int i = 0; i < c->n_targets && n < cap; i++) {
        int w = snprintf(out + n, cap - n, "%s%s", i ? ", " : "", c->target_modules[i]);
        if (w < 0) break;
        n += (size_t)w;
    }
    if (!c->n_targets) snprintf(out, cap, "none");
}

int peft_open_weights(const char *dir, st_file **out) {
    char path[4096];
    QT_TRY(qt_path_join(path, sizeof path, dir, "adapter_model.safetensors"));
    if (!qt_path_exists(path)) {
        char bin[4096];
        QT_TRY(qt_path_join(bin, sizeof bin, dir, "adapter_model.bin"));
        if (qt_path_exists(bin))
            return QT_ERR(QT_EUNSUPPORTED,
                          "%s holds adapter_model.bin (a pickle); save the adapter with safe_serialization=True "
                          "to get adapter_model.safetensors",
                          dir);
        return QT_ERR(QT_EIO, "%s has no adapter_model.safetensors; is it a PEFT adapter folder?", dir);
    }
    return st_open(path, out);
}

int peft_base_name(const char *key, char *base, size_t cap, int *is_b) {
    static const char prefix[] = "base_model.model.";
    static const char *const sufs[] = {".lora_A.weight", ".lora_B.weight", ".lora_A.default.weight",
                                       ".lora_B.default.weight"};
    size_t pl = sizeof prefix - 1, kl = strlen(key);
    if (kl <= pl || strncmp(key, prefix, pl)) return 0;
    for (int i = 0; i < 4; i++) {
        size_t sl = strlen(sufs[i]);
        if (kl > pl + sl && !strcmp(key + kl - sl, sufs[i])) {
            size_t n = kl - pl - sl;
            if (n + sizeof ".weight" > cap) return 0;
            memcpy(base, key + pl, n);
            memcpy(base + n, ".weight", sizeof ".weight");
            *is_b = (i & 1);
            return 1;
        }
    }
    return 0;
}

int peft_save(const char *dir, const peft_config *c, const peft_tensor *t, int n) {
    QT_TRY(qt_mkdir_p(dir));
    st_writer *w;
    QT_TRY(st_writer_new(&w));
    int rc = QT_OK;
    for (int i = 0; i < n && rc == QT_OK; i++)
        rc = t[i].fill ? st_writer_add_fn(w, t[i].name, QT_F32, 2, t[i].shape, t[i].fill, t[i].ctx)
                       : st_writer_add(w, t[i].name, QT_F32, 2, t[i].shape, t[i].data, QT_F32);
    if (rc == QT_OK) rc = st_writer_set_metadata(w, "format", "pt");
    char path[4096];
    if (rc == QT_OK) rc = qt_path_join(path, sizeof path, dir, "adapter_model.safetensors");
    if (rc == QT_OK) rc = st_writer_write(w, path);
    st_writer_free(w);
    if (rc == QT_OK) rc = peft_config_write(c, dir);
    return rc;
}
