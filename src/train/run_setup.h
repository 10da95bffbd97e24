/* The job's meaning in one place: a job, its DeepSpeed section, the world
 * size and the rank resolved into what a run needs (the DeepSpeed settings,
 * the train config, the LoRA selection, the model options with their ZeRO
 * partitioning) and what `qtune plan` plans for. The trainer, the plan and
 * the doctor read this; none of them translates the job itself, so a new job
 * key is one edit here.
 *
 * The order a run takes:
 *   qt_run_setup_open     DeepSpeed parsed for world ranks, "auto" buckets
 *                         from the model's config.json; the train config
 *   qt_run_setup_lora     lora.target_modules, modules_to_save and
 *                         layers_to_transform against the model's layout
 *   qt_run_setup_model_opts   what the model is loaded with
 *   qt_run_setup_finalize once max_steps is known ("auto" schedule lengths)
 * `qtune plan` and the doctor take the first two and qt_run_setup_plan_opts. */
#ifndef QT_TRAIN_RUN_SETUP_H
#define QT_TRAIN_RUN_SETUP_H

#include "model/model.h"
#include "train/ds_config.h"
#include "train/job.h"
#include "train/plan_report.h"
#include "train/trainer.h"

typedef struct {
    const qt_job *job;      /* borrowed */
    int world, rank;
    int pref;               /* a preference objective: a micro-batch of B pairs is 2B rows */
    qt_ds_config ds;        /* parsed for world ranks; model-dependent "auto"s resolved; finalized by
                               qt_run_setup_finalize */
    qt_train_cfg cfg;       /* from ds (provisional until qt_run_setup_finalize) */
    unsigned lora_targets;  /* QT_LORA_* mask of lora.target_modules in the model's layout */
    qt_model_opts lora_sel; /* the same with modules_to_save and layers_to_transform resolved (lora, lora_save,
                               lora_layers_set, lora_layers; the run's selection) */
} qt_run_setup;

/* The job's DeepSpeed section parsed for `world` ranks (none: DeepSpeed's
 * defaults), with what needs the model resolved from its config.json
 * (qt_train_ds_resolve_model). Errors name the DeepSpeed file, or the job's
 * "deepspeed" key when it is inline. */
int qt_run_setup_ds(const qt_job *job, int world, qt_ds_config *ds);

/* Fills s for job on rank `rank` of `world`: the DeepSpeed settings and the
 * train config. Reads no more of the model folder than config.json's
 * hidden_size (for an "auto" bucket). When the DeepSpeed section is refused
 * (the batch arithmetic for `world` ranks), s still holds the job, world and
 * rank, so qt_run_setup_lora can check the LoRA selection too (the doctor
 * names both). */
int qt_run_setup_open(qt_run_setup *s, const qt_job *job, int world, int rank);

/* The LoRA selection against the model's layout (config.json): the targets
 * in the layout's names, modules_to_save and layers_to_transform resolved as
 * PEFT would (a name or layer the run cannot take is refused here). strict
 * (the run): a folder without a readable config.json is an error; not strict
 * (the plan, the doctor): the selection then stays as the job wrote it, and
 * the caller reports the folder. */
int qt_run_setup_lora(qt_run_setup *s, int strict);

/* The schedule's "auto" lengths from max_steps; the train config again. */
int qt_run_setup_finalize(qt_run_setup *s, long max_steps);

/* What the model is loaded with for this job on this rank: precision, LoRA
 * (after qt_run_setup_lora), quantization, gradient checkpointing, the
 * largest micro-batch (2 rows a pair for preference objectives), seed and the
 * ZeRO partitioning (qt_run_model_zero). The backend, device and progress
 * are the caller's. Refuses what the model cannot run: a 4-bit compute dtype
 * other than the run's, ZeRO-3 with LoRA (the job parser refuses a 4-bit
 * base under full fine-tuning). */
int qt_run_setup_model_opts(const qt_run_setup *s, qt_model_opts *o);

/* The ZeRO stage's meaning for the model, `world` ranks, `rank`'s shard: the
 * gradient windows and their buckets (stage 2), the sharded fp32 master
 * (stages 1-3, the model decides whether it applies), the partitioned
 * weights (stage 3, full fine-tuning). o->compute and o->lora are read. The
 * one rule for the trainer and the plan. */
void qt_run_model_zero(const zero_opts *z, int world, int rank, qt_model_opts *o);

/* What the ZeRO plan takes from the model o describes, at ZeRO-2 over
 * several ranks (o->grad_windows): the gradient window's elements
 * (window_elems, qt_model_grad_window_elems) and, where the embedding is
 * trained, the most rows one micro-batch sends (max_B x max_T: two rows a
 * pair for preference objectives) of `hidden` floats. Nothing otherwise. The
 * one rule for the trainer (zero_plan_create) and the plan (zero_memory). */
void qt_run_zero_from_model(const qt_model_opts *o, int hidden, size_t window_elems, zero_opts *z);

/* What `qtune plan JOB.json` plans for, from the setup (after
 * qt_run_setup_lora): LoRA or full fine-tuning, r, targets and
 * modules_to_save, the ZeRO stage, offloads, precision, micro-batch, seq_len,
 * checkpointing, buckets and overlap, quantization. o's other fields (the
 * card, the backend) are left as they are. */
void qt_run_setup_plan_opts(const qt_run_setup *s, qt_plan_opts *o);

#endif
