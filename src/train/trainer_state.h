/* The trainer's state, shared by trainer.c (the loop) and trainer_ckpt.c
 * (checkpoints, resume, final outputs), and the small questions both ask of
 * it (trainer_state.c). Not a public interface. */
#ifndef QT_TRAIN_TRAINER_STATE_H
#define QT_TRAIN_TRAINER_STATE_H

#include "backend/device.h"
#include "data/loader.h"
#include "data/pref.h"
#include "dist/dist.h"
#include "dist/transport.h"
#include "model/model.h"
#include "optim/optimizer.h"
#include "text/tokenizer.h"
#include "train/metrics.h"
#include "train/run_setup.h"
#include "train/trainer.h"

typedef struct {
    const qt_job *job;
    dist_ctx *d;
    const qt_train_hooks *hooks;
    qt_run_setup setup;        /* the job resolved (run_setup.h): DeepSpeed, LoRA selection, model options */
    qt_train_cfg cfg;          /* setup.cfg, with the ZeRO fields the model and the plan add */
    int rank, world, main;     /* main: rank 0 writes files and prints */

    bpe_tokenizer *tok;        /* NULL for pre-tokenized data without tokenizer.json */
    dl_loader *train_dl, *eval_dl;
    qt_batch *mb;              /* (A) micro-batches of one accumulation window */
    qt_batch eval_b;
    int pref;                  /* a preference objective: pairs from pref_train instead of train_dl (NULL) */
    dl_pref_set pref_train;
    uint64_t *pref_perm;       /* (n_pairs) the order of epoch pref_epoch */
    int64_t pref_epoch;
    dl_pref_set pref_eval;     /* data.eval's pairs (n_pairs 0 when none) */
    int ref_pre;               /* the reference log-probs come from ref_train / ref_eval (precompute_ref_log_probs) */
    double *ref_train, *ref_eval; /* (2 n_pairs) the reference's sums: [2i] pair i's chosen side, [2i+1] rejected */

    qt_model *model;
    size_t n;                  /* elements in the trainable block */
    float *master;             /* fp32 master weights: the whole block, or sharded
                                  (qt_model_sharded) only this rank's [lo, hi) (trainer_master_lo) */
    int sharded;               /* ZeRO 1/2 over 2+ ranks in f16/bf16 full fine-tuning */
    qt_model_shard shard;      /* when sharded: the copies to all-gather after an update */
    size_t base_n;             /* LoRA at ZeRO-3: the partitioned frozen base block's elements, which the
                                  gathers run over (qt_model_base_sharded); 0 otherwise */
    float *grads;              /* (n) fp32 gradients; NULL at ZeRO-2 over several ranks (the
                                  model hands them to the plan: zero_grad_shard) */
    const qt_param *params;
    int n_params;

    zero_plan *zp;
    tp_req **greq[3];          /* ZeRO-3: the broadcasts of each gather buffer's fetch in flight */
    int gn[3], gcap[3];
    zero_state zs;             /* slot 0: Adam m, slot 1: Adam v, over [lo, hi) */
    size_t lo, hi;             /* this rank's optimizer range */
    qt_range *decay;
    int n_decay;
    qt_optimizer opt;          /* Adam, schedule, clipping, loss scaler; opt.n_updates: updates applied (the
                                  scheduler's k) */
    qt_backend *be;            /* the model's backend: every buffer above is its device memory */
    qt_device dev;             /* the job's "device" as resolved on this machine and rank */

    long step;                 /* optimizer steps done (skipped ones count) */
    long max_steps;
    int64_t tokens_seen;       /* input positions, all ranks */
    double elapsed_before;     /* seconds spent before the resumed checkpoint */
    double t_start;            /* monotonic clock at this process's start of training */
    long resumed_from;

    qt_metrics metrics;
    int64_t *peaks;            /* (world) every rank's peak RSS, gathered on logged steps */
    char last_ckpt[4096];
    int outdir_lock;           /* the output folder's flock (main rank), -1 when none */
    struct qt_stall *stall;    /* the step watchdog (stall.h), NULL before the first step */
    int stop_file_seen;        /* the main rank saw `qtune stop`'s file (said once) */
} qt_trainer;

/* trainer_state.c */
double trainer_elapsed(const qt_trainer *t);
/* Bytes of a file, or of the regular files directly in a folder (0 when
 * unreadable): what a phase moves, for its deadline (dist_phase_timeout). */
double trainer_path_bytes(const char *path);
/* The name of the trainable parameter that holds element i of the block. */
const char *trainer_param_at(const qt_trainer *t, size_t i);
/* 1 when dev (n floats, device memory) holds a NaN or inf (with nonneg, or a
 * negative value); *at its first. */
int trainer_find_bad(qt_trainer *t, const float *dev, size_t n, int nonneg, size_t *at);
/* The flat element the master's first one is: 0, or this rank's lo when sharded. */
static inline size_t trainer_master_lo(const qt_trainer *t) { return t->sharded ? t->shard.lo : 0; }
/* A sharded master's gather for the model's writer (qt_model_set_param_gather; trainer_ckpt.c). */
int trainer_gather_master(void *user, float *dst, size_t lo, size_t n);

/* trainer_ckpt.c */
int trainer_save_checkpoint(qt_trainer *t);
/* Loads weights, optimizer state, scheduler/scaler/data position from dir. */
int trainer_load_checkpoint(qt_trainer *t, const char *dir);
/* Loads a PEFT adapter's A/B into the master block (lora.init_from). */
int trainer_init_from_adapter(qt_trainer *t, const char *dir);
/* final/: PEFT adapter (LoRA) or model folder (full fine-tuning). */
int trainer_write_final(qt_trainer *t, char *final_dir, size_t cap);

/* Where the training data stands after the last step (checkpoints save it):
 * the loader's position, or for preference pairs the one the step implies. */
dl_state trainer_data_position(const qt_trainer *t);

#endif
