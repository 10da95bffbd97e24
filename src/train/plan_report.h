/* The memory and hardware plan behind `qtune plan`: per-device bytes by
 * category for a model shape, a training strategy (LoRA or full, ZeRO stage,
 * host offload, precision) and a device count; host memory; checkpoint size;
 * the smallest device count that fits; and a power/host recommendation.
 *
 * The model-side numbers (weights, trainable block, activations, workspace)
 * are what the model allocates for (config, opts) — see plan_model_bytes in
 * plan_report.c; this file adds the strategy on top of them:
 *   ZeRO 0  every rank holds full gradients, master weights and Adam m, v
 *   ZeRO 1  Adam m, v are sharded 1/N across ranks
 *   ZeRO 2  gradients are sharded 1/N as well
 *   ZeRO 3  the compute weights too (1/N, on the host with offload_param), plus
 *           two layer gather buffers and a V x C one; the weights file is not kept mapped
 *   offload Adam m, v live in host memory, not on the card
 * The fp32 master block stays whole on every rank's card at every stage
 * (each rank updates its shard and all-gathers the rest; DeepSpeed shards it).
 * Precision f16/bf16: compute weights 2 bytes/param, fp32 master 4, Adam 8.
 * Precision f32: the master block is the compute copy (no second copy).
 * LoRA: the frozen base is in the compute dtype; only A/B are trainable. */
#ifndef QT_TRAIN_PLAN_REPORT_H
#define QT_TRAIN_PLAN_REPORT_H

#include <stdint.h>
#include <stdio.h>

#include "core/dtype.h"
#include "io/hf_config.h"
#include "model/model.h"

typedef struct {
    QT_ADAPTER_GROUP;      /* LoRA and quantization, the model's own fields (model/model.h); lora_dropout > 0:
                              the dropout input buffer is counted (default 0.1, PEFT's usual setting); alpha,
                              rsLoRA and the 4-bit type change no byte */
    int zero;              /* ZeRO stage 0, 1, 2 or 3 (3: the weights partitioned, gathered a layer at a time) */
    int offload_param;     /* ZeRO-3: the rank's parameter shard in host memory */
    double reuse_distance; /* ZeRO-3: stage3_max_reuse_distance (default 1e9; memplan.h qt_model_outer_mode) */
    int devices;           /* data-parallel ranks N */
    int offload;           /* 1: Adam m, v in host memory */
    qt_dtype precision;    /* compute dtype */
    int micro_batch;       /* B */
    int seq_len;           /* T */
    int checkpointing;     /* activation recomputation */
    double device_gib;     /* memory of one card, GiB */
    double card_watts;     /* TDP of one card, W */
    double host_watts;     /* CPUs, RAM, disks, fans of one host, W */
    int cards_per_host;    /* 0: min(devices, 8) */
    uint64_t dataset_bytes; /* token cache / dataset held in host memory */
    uint64_t weights_file_bytes; /* the model's *.safetensors; 0: parameters x config torch_dtype */
    uint64_t tokenizer_bytes;    /* one process's loaded tokenizer; 0: QT_PLAN_QWEN_TOKENIZER_BYTES on Qwen's
                                    vocabulary (V >= 151643), else none */
    const char *backend;   /* whose descriptor sizes the workspaces (backend/backend.h); NULL: QTUNE_BACKEND, else cpu */
    int backend_auto;      /* 1: the descriptor is what "auto" found on this machine, not one the job or user named
                              (the plan then says what a CUDA card adds) */
    size_t reduce_bucket;    /* DeepSpeed reduce_bucket_size, elements; 0: 5e8 */
    size_t allgather_bucket; /* DeepSpeed allgather_bucket_size, elements; 0: 5e8 */
    int overlap;             /* DeepSpeed overlap_comm (ZeRO 2: reductions in flight during the backward) */
} qt_plan_opts;

/* Defaults: LoRA off, r 8 on q,v in every layer, dropout 0.1, ZeRO 0, 1 device, no offload, f32, B 1,
 * T 512, no checkpointing, 32 GiB cards at 300 W, 500 W per host, 1 GiB data. */
void qt_plan_opts_default(qt_plan_opts *o);

/* The model options a plan sizes for: what rank `rank` of N loads for o on the model c, as the run loads it
 * (its ZeRO rule, run_setup.h qt_run_model_zero). The adapter group is o's; a 4-bit base is counted only
 * under LoRA (also a bitsandbytes folder, c->prequant4), in nf4's bytes (fp4's are the same). */
void qt_plan_model_opts(const qt_config *c, const qt_plan_opts *o, int N, int rank, qt_model_opts *mo);

/* One line per category, bytes on each card. */
typedef struct {
    uint64_t weights;     /* compute-dtype weights (frozen base + trainable copy) */
    uint64_t grads;       /* the fp32 gradient block; ZeRO 2 on several devices: the rank's
                             gradient shard + the model's two gradient windows */
    uint64_t master;      /* fp32 master weights beyond the compute copy (whole on every rank) */
    uint64_t optim;       /* Adam m and v, fp32 (sharded in ZeRO 1/2) */
    uint64_t activations; /* saved for backward, sized for B x T */
    uint64_t workspace;   /* backward scratch, logits, attention scores */
    uint64_t comm;        /* collective buffers: the all-reduce temporary (ZeRO 0/1), the
                             parameter all-gather bucket (ZeRO 1/2), the embedding rows (ZeRO 2) */
    uint64_t total;
} qt_plan_device;

/* The plan's stated error: the largest gap measured between a plan and the
 * peak it predicts is 4.5% (docs/plan.md); a total within this fraction of
 * the card's size either way is "borderline". */
#define QT_PLAN_ERROR 0.05
/* The Qwen tokenizer (tokenizer.json of Qwen2.5/Qwen3: 151,643 tokens, 151,387
 * merges) as one process holds it once loaded, measured (cmd_plan.c
 * tokenizer_bytes): what a --preset on Qwen's vocabulary counts. */
#define QT_PLAN_QWEN_TOKENIZER_BYTES ((uint64_t)33079920)

typedef struct {
    int64_t n_params;      /* all parameters of the model */
    int64_t n_trainable;   /* full: n_params; LoRA: A and B only */
    qt_plan_device dev;    /* per card */
    /* host memory, bytes for one host (cards_per_host ranks) */
    uint64_t host_offload; /* Adam m, v shards of this host's ranks (offload only) */
    uint64_t host_pinned;  /* offload: this host's ranks' pinned fp32 shards (ZeRO-2's gradient shard; the
                              master's in f16/bf16 full fine-tuning) */
    uint64_t host_dataset;
    uint64_t host_runtime; /* per-process runtime, model loading */
    uint64_t host_tokenizer; /* each rank's loaded tokenizer */
    uint64_t host_mapped;  /* full fine-tuning: the weights file stays memory-mapped after its
                              values are copied into the master block (page cache, in the RSS) */
    uint64_t host_total;   /* sum of the above */
    uint64_t host_recommend; /* host_total + 20%, rounded up to a whole GiB */
    uint64_t cpu_rank_bytes; /* one rank's process on the CPU backend, where the "device" is host
                                memory: dev.total + its offloaded shards + host_mapped +
                                cpu_runtime (what metrics.jsonl's mem_peak_bytes measures) */
    uint64_t cpu_runtime;    /* that process's code and library buffers (qt_model_cpu_runtime_bytes) */
    uint64_t cpu_blas_vm;    /* address space (not memory in use) the CPU's BLAS maps beside it: a buffer per
                                calling thread (qt_backend_desc.blas_thread_vm x this machine's OpenMP threads);
                                ulimit -v must hold cpu_rank_bytes + this (src/train/stall.c checks it) */
    int cpu_threads;         /* the OpenMP threads cpu_blas_vm counts */
    uint64_t ckpt_bytes;   /* one checkpoint-STEP folder on disk */
    uint64_t final_bytes;  /* final/ (adapter or model folder) */
    int final_linked;      /* final/model.safetensors is a hard link to the last checkpoint's (full, fp32) */
    int cards_per_host;
    int fits;              /* dev.total <= device memory */
    int borderline;        /* dev.total within QT_PLAN_ERROR of the device memory, either side */
    char fix[200];         /* not fitting, or borderline: the one setting (not already on) that makes it fit with
                              the margin (or at least fit), as the job / options write it; "" when none does */
    double fix_total;      /* dev.total with that setting, bytes */
    char advice[200];      /* settings not already on that shrink the per-card total, for "try ..." */
    int gpu_note;          /* backend_auto found the CPU: the CUDA descriptor's figures follow */
    uint64_t gpu_total;    /* dev.total sized with the CUDA descriptor */
    int gpu_fits, gpu_borderline;
    char gpu_fix[200];     /* fix, for the CUDA card */
    double gpu_fix_total;
    int min_devices;       /* smallest N that fits with this strategy, -1 if none up to 4096 */
    double power_w;        /* cards * card_watts + hosts * host_watts */
    double power_recommend_w; /* power_w + 20% */
    int hosts;
} qt_plan;

/* One rank's process on the CPU backend, as qtune train allocates it: the
 * model's blocks (memplan), the ZeRO buffers and optimizer state of that
 * rank (dist.h zero_memory), the mapped weights file and the runtime. */
uint64_t qt_plan_cpu_rank(const qt_config *cfg, const qt_plan_opts *o, int rank, uint64_t mapped);

/* ZeRO-3 over several ranks: one sentence (into buf, at most cap bytes) on what o->reuse_distance
 * (stage3_max_reuse_distance) makes of the V x C gather buffer (memplan.h qt_model_outer_mode), for the
 * plan and the run to say; "" (returns 0) otherwise. */
size_t qt_plan_outer_note(const qt_config *c, const qt_plan_opts *o, char *buf, size_t cap);

/* Computes the plan. QT_EINVAL names the bad option. */
int qt_plan_compute(const qt_config *cfg, const qt_plan_opts *o, qt_plan *out);

/* Human-readable report (assumptions stated) and the same as one JSON object. */
void qt_plan_print(FILE *f, const char *model_name, const qt_config *cfg, const qt_plan_opts *o, const qt_plan *p);
/* JSON text (qt_free it), or NULL with the error set. */
char *qt_plan_json(const char *model_name, const qt_config *cfg, const qt_plan_opts *o, const qt_plan *p);

/* The field report's three strategies for a shape (its figures were for
 * Qwen-14B on 32 GB cards): full fp16 on 4 cards (ZeRO 0), ZeRO-2 with
 * offload on 4 cards, LoRA r=8 q,v on one card. B, T and checkpointing come
 * from base. */
void qt_plan_print_strategies(FILE *f, const char *model_name, const qt_config *cfg, const qt_plan_opts *base);

#endif
