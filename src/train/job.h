/* The job file (`qtune train JOB.json`): what to train, on what, and where
 * the outputs go. See docs/job-file.md for every key and its meaning.
 *
 * Loading goes: read JSON -> resolve a `deepspeed` path into its object when
 * an override reaches inside it -> apply `--set key.path=value` overrides
 * (typed by the value already there) -> warn about unknown keys by name ->
 * check and resolve paths relative to the job file's folder. */
#ifndef QT_TRAIN_JOB_H
#define QT_TRAIN_JOB_H

#include <stdint.h>

#include <cjson/cJSON.h>

#include "io/peft.h"
#include "train/objective.h"

typedef struct {
    char *train;        /* resolved path of the (first) training file: train_files[0] */
    char *eval;         /* resolved path of the (first) eval file, NULL when none: eval_files[0] */
    char **train_files; /* (n_train) data.train: one file or a list, resolved; JSONL or a JSON array */
    int n_train;
    double *train_weights; /* (n_train) data.interleave_probs, or NULL: equal */
    char **eval_files;  /* (n_eval) data.eval, concatenated */
    int n_eval;
    char *mix_strategy; /* "concat" (default), "interleave_under", "interleave_over" */
    int skip_bad_lines; /* skip and count malformed lines instead of stopping */
    char *format;       /* "auto", "text", "messages", "alpaca", "tokens" */
    int seq_len;        /* T */
    int packing;
    int shuffle;
    int mask_prompt;
    char *cache_dir;    /* NULL: next to the data */
    int num_workers;    /* 0 = auto */
    int prefetch;
    size_t max_line_bytes; /* longest JSONL line accepted (default 64 MiB) */
} qt_job_data;

typedef struct {
    int enabled;          /* 0: no lora section, full fine-tuning */
    int r;
    float lora_alpha;
    float lora_dropout;
    unsigned targets;     /* QT_LORA_* mask (model/model.h) */
    int n_target_names;
    char **target_names;  /* as written, e.g. {"q_proj", "v_proj"} */
    int targets_all_linear; /* target_modules "all-linear": every linear of the model's layout */
    int targets_default;  /* target_modules absent: PEFT's default for the model type (q_proj, v_proj;
                             c_attn for the original Qwen), resolved when the run starts */
    int use_rslora;
    char *init_from;      /* resolved path of a PEFT adapter folder, or NULL */
    peft_config extras;   /* modules_to_save, layers_to_transform, layers_pattern as written (the
                             n_save / n_layers / n_patterns fields; the rest unused) */
} qt_job_lora;

typedef struct {
    long max_steps;       /* -1: derive from epochs */
    double epochs;        /* -1: null */
    long save_steps;      /* 0: only at the end */
    int save_total_limit; /* 0: keep all */
    long eval_steps;      /* 0: only before and after */
    long log_steps;
    uint64_t seed;
    int gradient_checkpointing;
    char *resume;         /* "auto", "never", or a checkpoint folder path (resolved) */
    int overwrite_output_dir;
    long eval_batches;    /* micro-batches per evaluation; 0 = the whole eval set */
    int report_tensorboard; /* report_to names "tensorboard" (or "all"): TensorBoard event files */
    char *logging_dir;    /* where they go (resolved); NULL: OUTPUT/runs/MonDD_HH-MM-SS_HOST, as the HF Trainer */
} qt_job_train;

/* "quantization": transformers' BitsAndBytesConfig names (QLoRA). */
typedef struct {
    int load_in_4bit;     /* 1: the layers' linears quantized to 4 bits as they load */
    int type;             /* bnb_4bit_quant_type: QT_Q4_NF4 (default "fp4" as transformers) or QT_Q4_FP4 */
    int double_quant;     /* bnb_4bit_use_double_quant */
    int compute_set;      /* bnb_4bit_compute_dtype given */
    int compute;          /* its qt_dtype: must be the run's compute dtype */
    unsigned skip;        /* llm_int8_skip_modules as QT_LORA_* bits (lm_head/embeddings stay 16-bit anyway) */
} qt_job_quant;

typedef struct {
    char *path;           /* the job file as given */
    char *dir;            /* its folder: relative paths start here */
    char *model;          /* resolved model folder */
    char *output_dir;     /* resolved output folder */
    char *device;         /* "auto" (default), "cpu", "cuda", "cuda:N" as written; resolved when the run
                             starts (backend/device.h); not in the fingerprint */
    qt_job_data data;
    qt_job_lora lora;
    qt_job_train train;
    qt_job_quant quant;
    qt_objective objective; /* "objective": sft (default), dpo, orpo, simpo (train/objective.h) */
    cJSON *deepspeed;     /* the DeepSpeed object (read from its file when a path); owned */
    char *deepspeed_path; /* the file it came from, or NULL when inline */
    char *lora_path;      /* the LoRA config file ("lora": "adapter_config.json" or a folder), or NULL */
    cJSON *root;          /* the whole job after overrides; owned */
    uint64_t fingerprint; /* of everything that changes what is trained (see job.c) */
} qt_job;

/* Reads path, applies n_sets overrides "key.path=value", fills job.
 * On error job is left empty (nothing to free). */
int qt_job_load(const char *path, const char *const *sets, int n_sets, qt_job *job);
/* Same from JSON text; dir is where relative paths start, where names the job
 * in messages. */
int qt_job_parse(const char *json, const char *dir, const char *where, const char *const *sets, int n_sets,
                 qt_job *job);
/* The same, and strict (`--strict`): every unknown key, in the job file, its
 * lora section and its DeepSpeed config, is an error (with the nearest known
 * key) rather than a warning. */
int qt_job_load_ex(const char *path, const char *const *sets, int n_sets, int strict, qt_job *job);
int qt_job_parse_ex(const char *json, const char *dir, const char *where, const char *const *sets, int n_sets,
                    int strict, qt_job *job);
void qt_job_free(qt_job *job);

/* Applies one "key.path=value" override to a JSON tree. The value is typed by
 * the existing one (number, bool, string, null, array); a new key takes JSON
 * if the value parses as JSON, otherwise a string. */
int qt_job_apply_set(cJSON *root, const char *set);

/* LoRA target names (PEFT's) to a QT_LORA_* mask; "all-linear" is every one. */
int qt_job_lora_targets(const cJSON *arr, unsigned *mask, const char *where);

/* The fingerprint of a job tree (after overrides, DeepSpeed inlined), as
 * qt_job_parse computes it. */
uint64_t qt_job_fingerprint_of(const cJSON *root);

/* Names the fields (as key paths) where two job trees differ in what the
 * fingerprint covers, with both values: "lora.r (4 there, 8 here), ..." (at
 * most four, then "and N more"). `was` is typically the "job" recorded in an
 * output folder's qtune_run.json. Returns how many fields differ; "" and 0
 * when none is found. */
int qt_job_describe_difference(const cJSON *was, const cJSON *now, char *out, size_t cap);

#endif
