/* The DeepSpeed JSON config (the job's `deepspeed` key: a file or the same
 * object inline), read with DeepSpeed's meanings and defaults. docs/deepspeed.md
 * lists every key: which are honoured, what "auto" resolves to, what warns.
 *
 * Rules that matter most:
 *  - batch identity: train_batch_size = train_micro_batch_size_per_gpu x
 *    gradient_accumulation_steps x world; given any two the third is derived
 *    (integer division, as DeepSpeed), all three must agree, and a mismatch is
 *    an error naming the three values and the world size. "auto" counts as not
 *    given; with neither batch size given but one "auto", the micro-batch is 1.
 *  - a key qtune does not implement is named in a warning (qt_warn) and listed
 *    in `ignored`, never silently dropped;
 *  - ZeRO stage 3, NVMe offload, or an optimizer/scheduler type other than
 *    Adam/AdamW and WarmupLR/WarmupDecayLR/WarmupCosineLR is an error. */
#ifndef QT_TRAIN_DS_CONFIG_H
#define QT_TRAIN_DS_CONFIG_H

#include <stdint.h>

#include <cjson/cJSON.h>

#include "optim/adam.h"
#include "optim/loss_scaler.h"
#include "optim/schedule.h"

#define QT_DS_MAX_IGNORED 64
#define QT_DS_MAX_RESOLVED 32

typedef struct {
    int stage;                  /* 0, 1, 2 or 3 */
    int offload_optimizer;      /* offload_optimizer.device == "cpu" */
    int offload_param;          /* stage 3: offload_param.device == "cpu" (the parameter shard in host memory) */
    int pin_memory;             /* offload_optimizer.pin_memory */
    double reduce_bucket_size;  /* elements; 5e8 */
    int reduce_bucket_auto;     /* reduce_bucket_size was "auto": 5e8 until qt_ds_config_resolve_model gives it
                                   the model's hidden_size squared */
    double allgather_bucket_size; /* elements; 5e8 */
    int overlap_comm;           /* false */
    int contiguous_gradients;   /* true */
    int reduce_scatter;         /* true */
    int allgather_partitions;   /* true */
    /* stage 3 (docs/distributed.md says what each means here) */
    double prefetch_bucket_size;    /* stage3_prefetch_bucket_size: 5e7; 0 turns the prefetch off */
    double param_persistence_threshold; /* stage3_param_persistence_threshold: 1e5 */
    double max_live_parameters;     /* stage3_max_live_parameters: 1e9 */
    double max_reuse_distance;      /* stage3_max_reuse_distance: 1e9 */
    int gather_16bit_on_save;       /* stage3_gather_16bit_weights_on_model_save: false (final/ is always gathered) */
    int stage3_auto;                /* bit 0: prefetch_bucket_size, bit 1: param_persistence_threshold were "auto",
                                       resolved from hidden_size by qt_ds_config_resolve_model */
} qt_ds_zero;

typedef struct {
    int world;                  /* data-parallel ranks it was resolved for */
    int64_t train_batch_size;
    int64_t micro_batch;        /* train_micro_batch_size_per_gpu */
    int64_t grad_accum;         /* gradient_accumulation_steps */
    double gradient_clipping;   /* max global norm; 0 = off */
    int steps_per_print;        /* 10 */
    int wall_clock_breakdown;   /* false */

    char optimizer_type[16];    /* "Adam" or "AdamW" */
    qt_adam_cfg adam;           /* decoupled = AdamW or Adam with adam_w_mode (default true) */
    qt_sched sched;             /* QT_SCHED_CONSTANT when there is no scheduler; base_lr = adam.lr */
    int total_num_steps_auto;   /* scheduler total_num_steps was "auto": qt_ds_config_finalize sets it */

    int fp16;                   /* fp16.enabled */
    qt_loss_scaler_cfg scaler;  /* the fp16 section (defaults when fp16 is off) */
    int bf16;                   /* bf16.enabled (or the old "bfloat16") */
    char precision_auto_off[12];/* "fp16" or "bf16" when that section is present with enabled "auto", which
                                   resolves to false (fp32, warned); "" otherwise */
    qt_ds_zero zero;

    int n_ignored;              /* keys named in a warning, as "section.key" */
    char ignored[QT_DS_MAX_IGNORED][96];
    int n_resolved;             /* each "auto" and what it became, e.g. 'fp16.enabled "auto" -> false (...)';
                                   also said at info level as it is read */
    char resolved[QT_DS_MAX_RESOLVED][224];
} qt_ds_config;

/* What a job without a `deepspeed` key gets: micro-batch 1, accumulation 1,
 * batch = world, no clipping, AdamW with the Hugging Face Trainer's defaults
 * (lr 5e-5, betas (0.9, 0.999), eps 1e-8, weight_decay 0), constant lr, fp32,
 * ZeRO stage 0. */
void qt_ds_config_default(qt_ds_config *c, int world);

/* Reads a DeepSpeed config object. where names it in messages (the file path,
 * or "JOB.json: deepspeed"). world: the number of data-parallel ranks. */
int qt_ds_config_parse(const cJSON *json, const char *where, int world, qt_ds_config *out);

/* qt_ds_config_parse for `qtune doctor`, which names every problem at once:
 * each section's first problem (the batch sizes, gradient_clipping, optimizer,
 * scheduler, fp16, bf16 and their pairing, zero_optimization) is handed to fn
 * as the parser's sentence and the parse goes on with the next section. out
 * holds what was read, DeepSpeed's defaults in a section with a problem.
 * Says nothing on stderr (the run's parse gives the warnings and "auto"
 * notes). Returns the number of problems (0: out is what qt_ds_config_parse
 * gives). */
typedef void (*qt_ds_problem_fn)(void *ctx, const char *sentence);
int qt_ds_config_problems(const cJSON *json, const char *where, int world, qt_ds_config *out, qt_ds_problem_fn fn,
                          void *ctx);

/* Checks a DeepSpeed config object as qt_ds_config_parse reads it, without a
 * word on stderr and without the batch-size arithmetic (which needs the run's
 * world size). The job loader checks before and after each `--set
 * deepspeed.X=...`, so that an override which makes a readable config
 * unreadable is named in the error, where the run's parse names the file. */
int qt_ds_config_check(const cJSON *json, const char *where);

/* qt_ds_config_check, and a key qtune does not implement (which the run
 * warns about and ignores) is an error too, with the warning's sentence and
 * its nearest known key: `--strict`. */
int qt_ds_config_check_strict(const cJSON *json, const char *where);

/* Reads a DeepSpeed JSON file (at most 16 MiB). */
int qt_ds_config_load(const char *path, int world, qt_ds_config *out);

/* Resolves what needs the run's length: a scheduler total_num_steps given as
 * "auto" becomes max_steps (HF Trainer's meaning), and the resolved schedule
 * is checked (a number given in the file was checked by the parser). Call once
 * max_steps is known; max_steps < 0 when unknown (an error only if needed). */
int qt_ds_config_finalize(qt_ds_config *c, int64_t max_steps);

/* Resolves what needs the model's config.json, as the HF Trainer's
 * trainer_config_finalize does: a zero_optimization.reduce_bucket_size given
 * as "auto" becomes hidden_size * hidden_size. hidden_size <= 0 (config.json
 * could not be read) leaves it at 5e8, DeepSpeed's default. Either way the
 * value and why is recorded in `resolved` and said at info level. Call before
 * the bucket size is used (the model's gradient buckets are sized at load);
 * a second call does nothing. */
void qt_ds_config_resolve_model(qt_ds_config *c, int64_t hidden_size);

#endif
