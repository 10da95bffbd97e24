/* PEFT LoRA adapters as Hugging Face `peft` writes and reads them:
 *
 *   DIR/adapter_config.json        LoraConfig fields (peft_type "LORA", r,
 *                                  lora_alpha, lora_dropout, target_modules,
 *                                  use_rslora, bias "none", task_type
 *                                  "CAUSAL_LM", base_model_name_or_path, ...)
 *   DIR/adapter_model.safetensors  for each adapted Linear W (out, in):
 *     base_model.model.<W's module>.lora_A.weight   (r, in)
 *     base_model.model.<W's module>.lora_B.weight   (out, r)
 *
 * e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight adapts
 * model.layers.0.self_attn.q_proj.weight. The adapted forward is
 * y = W x + scaling * B (A x), scaling = lora_alpha / r (alpha / sqrt(r) with
 * use_rslora). */
#ifndef QT_IO_PEFT_H
#define QT_IO_PEFT_H

#include <stddef.h>

#include <cjson/cJSON.h>

#include "io/safetensors.h"

#define PEFT_MAX_TARGETS 16
#define PEFT_MAX_REGEX 1024
#define PEFT_MAX_SAVE 8        /* modules_to_save entries */
#define PEFT_MAX_LAYERS 1024   /* layers_to_transform entries */
#define PEFT_MAX_PATTERNS 8    /* layers_pattern entries */

typedef struct {
    int r;
    float lora_alpha;
    float lora_dropout;
    int use_rslora;
    int n_targets;
    char target_modules[PEFT_MAX_TARGETS][64]; /* "q_proj", "self_attn.q_proj", ...: a list */
    char target_regex[PEFT_MAX_REGEX];        /* target_modules as one string other than "all-linear":
                                                 a regex PEFT full-matches against each module name;
                                                 "" for a list */
    char base_model[1024];                     /* base_model_name_or_path ("" when unknown) */
    /* modules_to_save: names of modules trained fully beside the adapter (PEFT's
     * ModulesToSaveWrapper); their weights are in adapter_model.safetensors as
     * base_model.model.<module>.weight */
    int n_save;
    char modules_to_save[PEFT_MAX_SAVE][64];
    /* layers_to_transform: LoRA only in these layer indices (n_layers 0: every
     * layer); layers_int: it was one int, not a list (written back the same way) */
    int n_layers, layers_int;
    int layers_to_transform[PEFT_MAX_LAYERS];
    /* layers_pattern: the name(s) of the layers' ModuleList ("layers", "h"), a
     * regex each; n_patterns 0: null; patterns_list: given as a list */
    int n_patterns, patterns_list;
    char layers_pattern[PEFT_MAX_PATTERNS][64];
} peft_config;

/* The lora_alpha qtune accepts, in the job file and in adapter_config.json.
 * PEFT checks nothing; here alpha / r must stay a finite, normal float in
 * fp16 arithmetic too: NaN, infinity, 0, negatives and 1e300 (infinity once
 * cast to float) are refused by name. */
#define PEFT_ALPHA_MIN 1e-6
#define PEFT_ALPHA_MAX 1e6
int peft_alpha_ok(double alpha);

/* scaling = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora. */
float peft_scaling(const peft_config *c);

/* LoraConfig keys qtune reads at PEFT's default value only (inference_mode,
 * fan_in_fan_out false, init_lora_weights true, use_dora false, empty
 * rank_pattern, modules_to_save null, layers_to_transform null, ...):
 * peft_is_lora_key says whether key is one; peft_check_lora_defaults accepts
 * each at its default (or null) quietly and refuses another value with an
 * error "WHERE" + "key is VALUE, which qtune does not implement; ...". */
int peft_is_lora_key(const char *key);
/* The LoraConfig key (those above, and the NULL-terminated list also) nearest
 * to word, for "did you mean": qt_nearest_word's rule; NULL when none is near. */
const char *peft_nearest_lora_key(const char *word, const char *const *also);
int peft_check_lora_defaults(const cJSON *j, const char *where);

/* modules_to_save, layers_to_transform and layers_pattern of a LoraConfig
 * object j (a job's lora section or adapter_config.json) into c, with
 * LoraConfig's own checks: layers_pattern needs layers_to_transform, and
 * neither goes with target_modules given as a string. Errors start with
 * where ("FILE: " or "JOB: lora."). */
int peft_parse_extras(const cJSON *j, peft_config *c, const char *where);

/* The layer index PEFT reads from a module name for layers_to_transform:
 * the number after "." + a layers_pattern entry + "." (regex
 * `.*\.PATTERN\.(\d+)\.` from the start of the name), or without a pattern
 * the last "NAME.N." in it; -1 when nothing matches (PEFT then leaves the
 * module alone). */
int peft_layer_index(const peft_config *c, const char *module);
/* Whether layers_to_transform keeps layer (every layer without it). */
int peft_layer_listed(const peft_config *c, int layer);

/* Reads DIR/adapter_config.json; refuses anything but a plain LoRA adapter
 * (peft_type LORA, bias none, no rank/alpha patterns, no DoRA) by name. */
int peft_config_load(const char *dir, peft_config *c);
/* base_model_name_or_path for an adapter trained on the model folder
 * model_dir: its absolute path (PEFT's from_pretrained and qtune read it
 * from anywhere; a path relative to the job or the shell's folder would not
 * be found from elsewhere), or model_dir as given when it does not resolve. */
void peft_base_model_name(const char *model_dir, char *out, size_t cap);

/* Writes DIR/adapter_config.json (atomic). */
int peft_config_write(const peft_config *c, const char *dir);

/* Whether PEFT adapts the module named module ("model.layers.0.self_attn.q_proj"):
 * with a list, its name is an entry or ends in "." + an entry; with a string,
 * the string as a regex matches the whole name (PEFT's re.fullmatch, here
 * PCRE2); "all-linear" takes every module but lm_head. */
int peft_targets_module(const peft_config *c, const char *module);
/* The same for one list entry (a name, a dotted suffix or "all-linear"). */
int peft_target_entry_matches(const char *entry, const char *module);
/* target_modules as "q_proj, v_proj" or "regex '...'" ("none" when empty), for messages. */
void peft_targets_str(const peft_config *c, char *out, size_t cap);

/* Opens DIR/adapter_model.safetensors. */
int peft_open_weights(const char *dir, st_file **out);

/* For an adapter key "base_model.model.X.lora_A.weight" (or lora_B) writes the
 * base weight name "X.weight" into base (cap bytes) and sets *is_b. Returns 0
 * when the key is not a LoRA A/B weight. Accepts the adapter-named form
 * "X.lora_A.default.weight" too. */
int peft_base_name(const char *key, char *base, size_t cap, int *is_b);

/* Writes a whole adapter folder: config plus the named fp32 tensors
 * (names are the PEFT keys; shapes (r, in) for A and (out, r) for B). */
typedef struct {
    const char *name;
    int64_t shape[2];
    const float *data;  /* host fp32, or NULL with fill: */
    st_fill_fn fill;    /* a producer (safetensors.h), e.g. a download from device memory */
    void *ctx;
} peft_tensor;
int peft_save(const char *dir, const peft_config *c, const peft_tensor *t, int n);

#endif
