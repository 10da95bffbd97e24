/* The training loop: one job file in, an output folder out (docs/training.md).
 *
 * One optimizer step, on every rank (N ranks, A micro-batches each):
 *   1. take A micro-batches; all-reduce the labelled-token count -> Ntok (global)
 *   2. for each micro-batch: forward_backward(grad_scale = S / Ntok) into grads
 *      (S: the fp16 loss scale, 1 otherwise), so grads = S * d(sum of token
 *      losses / Ntok): the token-weighted mean over the whole global batch,
 *      the Hugging Face Trainer's gradient-accumulation fix
 *   3. reduce gradients (ZeRO reduce-scatter or all-reduce), global sum of
 *      squares and inf/NaN flag over the optimizer range
 *   4. fp16: the loss scaler decides (an overflow skips 5-6 and the scheduler)
 *   5. norm = sqrt(sumsq) / S (reported as grad_norm); coef = clip(norm)
 *   6. AdamW on the rank's range with grads * coef / S; all-gather; refresh
 *      the model's compute copy
 * Every rank runs the same loop; rank 0 alone writes files and prints. */
#ifndef QT_TRAIN_TRAINER_H
#define QT_TRAIN_TRAINER_H

#include <signal.h>
#include <stdint.h>
#include <stdio.h>

#include "core/dtype.h"
#include "dist/dist.h"
#include "optim/adam.h"
#include "optim/loss_scaler.h"
#include "optim/schedule.h"
#include "train/ds_config.h"
#include "train/job.h"
#include "train/plan_report.h"

/* What the DeepSpeed section resolves to, for this world size. */
typedef struct {
    int micro_batch;         /* B: train_micro_batch_size_per_gpu */
    int grad_accum;          /* A: gradient_accumulation_steps */
    int world;               /* N ranks */
    double clip;             /* gradient_clipping; 0: off */
    qt_adam_cfg adam;
    qt_sched sched;
    qt_dtype compute;        /* f32, f16 (fp16.enabled) or bf16 (bf16.enabled) */
    int fp16;                /* the loss scaler is active */
    qt_loss_scaler_cfg scaler;
    zero_opts zero;
    long steps_per_print;    /* plain log lines when stderr is not a terminal */
} qt_train_cfg;

/* Fills cfg from the job's DeepSpeed section (none: qt_ds_config_default),
 * resolved for `world` ranks and the job's model (qt_train_ds_resolve_model);
 * max_steps resolves "auto" schedule lengths. The run's setup
 * (train/run_setup.h) read for its train config alone. */
int qt_train_cfg_from_job(const qt_job *job, int world, long max_steps, qt_train_cfg *cfg);
/* The same from an already parsed (and finalized) DeepSpeed config. */
void qt_train_cfg_from_ds(const qt_ds_config *ds, qt_train_cfg *cfg);
/* What in the DeepSpeed config needs the model (qt_ds_config_resolve_model):
 * a reduce_bucket_size of "auto" becomes the hidden_size squared from the
 * config.json in the folder `model`, or 5e8 when that cannot be read (the run
 * reports the folder's error when it loads the model). Reads nothing when
 * there is no such "auto". */
void qt_train_ds_resolve_model(qt_ds_config *ds, const char *model);
/* The job's lora.target_modules against the model's layout (cfg), as a run
 * resolves them: absent, PEFT's default for the model type (q_proj, v_proj;
 * the original Qwen's c_attn); "all-linear", every linear; names, resolved by
 * qt_lora_targets_from_names, which refuses Qwen2 names on an original Qwen
 * model with the list to write. */
int qt_job_lora_targets_resolve(const qt_job *job, const qt_config *cfg, unsigned *mask);
/* What `qtune plan JOB.json` plans for, read from the run's own setup
 * (train/run_setup.h qt_run_setup_plan_opts) for `ranks` ranks: LoRA or full
 * fine-tuning with the run's LoRA selection and dropout, ZeRO stage,
 * offloads, precision, micro-batch, buckets, seq_len, checkpointing,
 * quantization. */
int qt_plan_opts_from_job(const qt_job *job, int ranks, qt_plan_opts *o);

/* The one line a run starts with: what is trained, precision, ZeRO stage and
 * offload, optimizer, lr and schedule, gradient checkpointing, micro-batch x
 * accumulation x ranks and the device (backend/device.h qt_device_label:
 * "cpu (16 threads)", "cuda:0 (NVIDIA H200)"). */
void qt_train_describe(const qt_job *job, const qt_ds_config *ds, const char *device, char *buf, size_t cap);

typedef struct {
    volatile sig_atomic_t *stop; /* set by the CLI's SIGINT/SIGTERM handler; NULL: never */
    FILE *progress;              /* where progress goes (rank 0), NULL: nowhere */
    int tty;                     /* progress is a live line (\r) rather than log lines */
} qt_train_hooks;

typedef struct {
    long step;                   /* optimizer steps done (including before a resume) */
    long max_steps;
    long resumed_from;           /* step of the checkpoint resumed from, -1 if none */
    double last_loss;            /* mean train loss of the last step */
    double eval_loss_first;      /* first evaluation of this run (NaN if none) */
    double eval_loss_last;       /* last evaluation (NaN if none) */
    int interrupted;             /* stopped by the stop flag; a checkpoint was written */
    long skipped;                /* steps that applied no update (fp16 overflow, no label), whole run */
    int64_t tokens;              /* input positions this run's steps processed, all ranks */
    double train_s;              /* wall seconds of this run's steps (evaluations and saves included) */
    char last_checkpoint[4096];  /* "" if none */
    char final_dir[4096];        /* "" if not reached */
} qt_train_result;

/* Runs the job to max_steps (or until *hooks->stop): resumes, trains,
 * evaluates, checkpoints, writes final/. Returns QT_OK, QT_EINTERRUPTED after
 * a clean stop (checkpoint written), or an error. */
int qt_train_run(const qt_job *job, dist_ctx *d, const qt_train_hooks *hooks, qt_train_result *res);

/* Whether final/model.safetensors may be a hard link to the last checkpoint's
 * model.safetensors rather than a second copy: full fine-tuning (whose
 * checkpoints hold the fp32 master weights as model.safetensors) of a model
 * whose torch_dtype, the dtype final/ is written in, is float32, so both files
 * would hold the same bytes. The one rule for the trainer, which links when
 * in addition this run wrote the last step's checkpoint and link(2) succeeds,
 * and for the plan, which then counts final/ as no extra disk. */
int qt_train_final_links_checkpoint(int lora, qt_dtype model_dtype);

/* The output-folder guard: output_dir/qtune_run.json records the job's
 * fingerprint. A folder holding another run's outputs (or anything without
 * that file; temporaries an interrupted write left count as nothing) is
 * refused unless overwrite (then qtune's own outputs in it are removed).
 * Two calls, so that nothing is written before the job has been checked:
 *
 * qt_output_dir_check, before the model and data are loaded, only reads: when
 * the folder exists it takes an exclusive flock on it (*lock_fd; -2 where the
 * filesystem has no locks) and refuses a folder another qtune process holds,
 * naming that process, or that holds another run. A missing folder stays
 * missing (*lock_fd -1).
 *
 * qt_output_dir_claim, when the first step is about to start, creates the
 * folder, locks it when *lock_fd is -1, checks again, removes the previous
 * run's outputs when overwrite (any run) or restart (resume "never", the same
 * run) says so, removes the temporaries an interrupted run left
 * (checkpoint-N.tmp, loss.svg.tmp.PID, ...; an X.old whose X is missing is
 * put back) and writes qtune_run.json.
 *
 * The caller closes *lock_fd (when >= 0) when the run ends; on an error it is
 * closed and -1. */
int qt_output_dir_check(const char *output_dir, const qt_job *job, int overwrite, int *lock_fd);
int qt_output_dir_claim(const char *output_dir, const qt_job *job, int overwrite, int restart, int *lock_fd);
/* What differs between the job recorded in output_dir/qtune_run.json and this
 * one (see qt_job_describe_difference); 0 and "" when there is no record. */
int qt_output_dir_job_difference(const char *output_dir, const qt_job *job, char *out, size_t cap);

/* `qtune stop OUTPUT_DIR`: a stop file in the output folder. The main rank of
 * the run that holds the folder checks for it between steps (every rank then
 * agrees, as for a signal), saves a checkpoint and returns QT_EINTERRUPTED;
 * the file is removed when the run takes the folder and when it stops. */
#define QT_STOP_FILE "qtune_stop"
/* Writes the stop file when a qtune run holds output_dir (its flock, see
 * qt_output_dir_claim); fails with a sentence naming the folder when none
 * does (nothing is written then). *holder gets "process N on HOST" from the
 * run's qtune_run.json when it says. */
int qt_stop_request(const char *output_dir, char *holder, size_t cap);
/* 1 while a qtune run holds output_dir's lock, 0 when none does, -1 when
 * the filesystem has no locks or the folder cannot be opened. */
int qt_output_dir_held(const char *output_dir);
/* 1 when output_dir has a stop file. */
int qt_stop_requested_file(const char *output_dir);
/* Removes the stop file (no error when there is none). */
void qt_stop_file_clear(const char *output_dir);

#endif
