/* The memory and hardware plan: model bytes (from the model's own sizing),
 * then the strategy on top: ZeRO sharding, host offload, communication
 * buffers, host memory, disk, device count and power. See plan_report.h for
 * the accounting rules and docs/plan.md for the assumptions. */
#include "train/plan_report.h"
#include "train/plan_card.h"

#include "backend/backend.h"
#include "core/error.h"
#include "core/mem.h"
#include "core/quant4.h"
#include "model/lora_io.h"
#include "model/memplan.h"
#include "model/model.h"
#include "dist/dist.h"
#include "dist/transport.h"
#include "train/run_setup.h"
#include "train/trainer.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <omp.h>
#include <string.h>

#define GIB (1024.0 * 1024.0 * 1024.0)
#define MAX_DEVICES 4096
/* Process runtime per rank: code, BLAS/OpenMP buffers, allocator slack. */
#define HOST_RUNTIME_PER_RANK ((uint64_t)1 << 30)

void qt_plan_opts_default(qt_plan_opts *o) {
    memset(o, 0, sizeof *o);
    o->lora = 0;
    o->lora_r = 8;
    o->lora_targets = QT_LORA_Q | QT_LORA_V;
    o->lora_dropout = 0.1f; /* PEFT's usual setting, where no job says */
    o->zero = 0;
    o->devices = 1;
    o->offload = 0;
    o->precision = QT_F32;
    o->micro_batch = 1;
    o->seq_len = 512;
    o->checkpointing = 0;
    o->device_gib = 32.0;
    o->card_watts = 300.0;
    o->host_watts = 500.0;
    o->cards_per_host = 0;
    o->dataset_bytes = (uint64_t)1 << 30;
    o->reuse_distance = 1e9;
}

/* ---- model side: what the model allocates for (config, opts) ---------------- */

typedef struct {
    int64_t n_params, n_trainable;
    uint64_t weights;     /* frozen base + compute copy of the trainable block (f16/bf16) or the f32 block itself */
    uint64_t activations; /* saved for backward */
    uint64_t workspace;   /* backward scratch */
    uint64_t grads;       /* the model's gradient block, or its gradient windows (ZeRO-2, N > 1) */
    uint64_t master;      /* f16/bf16: the fp32 master on the card (whole, or this rank's shard) */
    uint64_t master_host; /* a sharded master offloaded: its shard in pinned host memory; ZeRO-3 with
                             offload_param: the compute-weight shard too */
    size_t persist;       /* ZeRO-3: elements of the 1-D tensors kept whole on every rank */
    uint64_t allocated;   /* everything the model allocates (memplan total) */
    uint64_t mapped_base; /* LoRA: the frozen base the model reads from the mapping */
    int rows, dim;        /* ZeRO-2 with a trainable embedding: rows per micro-batch, C */
    size_t unit;          /* ZeRO-2: the gradient window's elements */
    int overlap;
    int outer_mode;       /* ZeRO-3: memplan.h qt_model_outer_mode, and its bytes: the V x C buffer, one lm_head */
    uint64_t outer, head_slice; /* slice (QT_OUTER_SLICED) */
} plan_model;

/* The model's own memory plan (model/memplan.h) sizes everything the model
 * allocates; here it is sorted into the plan's categories. Two rules of the
 * strategy layer apply on top: a frozen LoRA base is held in the compute
 * dtype (the memplan counts it in the file's dtype, as it maps it), and in
 * f16/bf16 full fine-tuning a 2-byte compute copy of the trainable block sits
 * on the card beside the fp32 master (counted under "master"; under ZeRO 1/2
 * over N > 1 ranks only the rank's shard of it, on the host with offload, and
 * an f32 copy of the norm weights and biases is counted under "weights"). In
 * f32 the master block is the compute copy; LoRA has no compute copy (its
 * fp32 master is read directly, in f16/bf16 too: measured as the guard
 * backend's device peak, tests/tools/test_plan.py). rank: whose shard. */
void qt_plan_model_opts(const qt_config *c, const qt_plan_opts *o, int N, int rank, qt_model_opts *mo) {
    qt_model_opts_default(mo);
    mo->compute = o->precision;
    mo->adapter = o->adapter; /* lora_dropout > 0: the dropout input buffer is counted */
    if (!o->lora) mo->lora_save = 0, mo->lora_layers_set = 0;
    mo->quant4 = o->lora && (o->quant4 || c->prequant4); /* a bitsandbytes folder is 4-bit as it is */
    mo->quant4_type = QT_Q4_NF4;                          /* nf4 and fp4 take the same bytes */
    mo->quant4_nested = c->prequant4 ? c->prequant4_nested : o->quant4_nested;
    mo->grad_checkpointing = o->checkpointing;
    mo->max_B = o->micro_batch;
    mo->max_T = o->seq_len;
    mo->backend = o->backend;
    const zero_opts z = {.stage = o->zero, .offload = o->offload, .bucket_elems = o->reduce_bucket,
                         .overlap = o->overlap, .offload_param = o->offload_param,
                         .reuse_distance = o->reuse_distance};
    qt_run_model_zero(&z, N, rank, mo); /* the run's rule (run_setup.h) */
}

static void plan_model_bytes(const qt_config *c, const qt_plan_opts *o, int N, int rank, plan_model *pm) {
    qt_model_opts mo;
    qt_plan_model_opts(c, o, N, rank, &mo);
    qt_mem_breakdown b;
    qt_model_memory(c, &mo, &b);
    qt_model_opts full = mo;
    full.lora = 0;
    const int64_t n_base = (int64_t)qt_model_trainable_numel(c, &full);
    const int64_t n_train = (int64_t)qt_model_trainable_numel(c, &mo);
    const uint64_t ws = qt_dtype_size(o->precision);
    pm->n_params = o->lora ? n_base + n_train : n_base;
    pm->n_trainable = n_train;
    if (o->lora) {
        const uint64_t file_bytes = qt_dtype_size(c->torch_dtype);
        /* LoRA trains its fp32 master directly, in f16/bf16 too (the adapters and modules_to_save's copies
         * have no 2-byte compute copy): the master is "weights" in f32, "master" otherwise */
        pm->weights = b.base / file_bytes * ws + b.quant4 + b.base_f32 + (o->precision == QT_F32 ? b.master : 0);
        /* ZeRO-3: the rank's shard of the base matrices and the three gather buffers, in the dtype they are
         * gathered in (memplan.h qt_model_base_block_dtype); nothing of the base stays mapped */
        if (qt_model_opts_base_sharded(&mo)) pm->weights += b.compute_copy + b.param_gather;
    } else if (mo.param_shards > 1) {
        /* ZeRO-3: the rank's shard of the compute weights (in f32 the master shard), the three gather
         * buffers and the 1-D tensors whole */
        pm->weights = (o->precision == QT_F32 ? b.master : b.compute_copy) + b.param_gather + b.base_f32;
    } else {
        pm->weights = o->precision == QT_F32 ? b.master : (uint64_t)n_train * ws + b.base_f32;
    }
    pm->master = o->precision == QT_F32 ? 0 : b.master;
    pm->master_host = b.master_host + b.compute_host;
    /* ZeRO-3's all-gather after the update: the 1-D tensors (full), the whole adapter (LoRA, as at stage 2) */
    pm->persist = mo.param_shards > 1 ? (o->lora ? (size_t)n_train : b.base_f32 / 4) : 0;
    pm->activations = b.activations;
    pm->workspace = b.act_grads + b.workspace;
    pm->grads = b.grads;
    pm->allocated = b.total;
    pm->mapped_base = o->lora ? b.base : 0;
    qt_grad_windows gw;
    qt_model_grad_windows(c, &mo, &gw);
    zero_opts zm = {0};
    qt_run_zero_from_model(&mo, c->hidden_size, gw.each, &zm); /* the run's rule (run_setup.h) */
    pm->rows = zm.emb_rows;
    pm->dim = zm.emb_dim;
    pm->unit = zm.unit_elems;
    pm->overlap = o->overlap;
    pm->outer_mode = b.outer_mode;
    pm->outer = b.outer_gather;
    pm->head_slice = b.head_slice;
}

/* glibc's malloc maps a block above its mmap threshold on its own and unmaps it at free; the threshold rises
 * to the size of each such block freed, up to 32 MiB (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit), so a block of
 * that size or less, freed, may stay in the heap for the next allocation. */
#define PLAN_MMAP_CEILING ((uint64_t)32 << 20)

/* ZeRO-3 with stage3_max_reuse_distance 0 (memplan.h QT_OUTER_SLICED): the V x C buffer is held at the lookup
 * and the lm_head's forward, when no reduction is in flight (the embedding's rows, last in each backward, wait
 * for all of them); the lm_head's backward holds one slice of it with the reductions' temporaries. Where both
 * the buffer and each temporary (a reduction piece; up to 3 in flight) are above the mmap ceiling they leave
 * the process at free, and the peak is the larger moment; the slice is counted as staying. The model's and
 * ZeRO's sums count both moments at once: returns the bytes they never hold together (0 where the
 * temporaries or the buffer may stay in the heap). */
static uint64_t outer_apart(const plan_model *pm, const zero_mem *zm, const zero_opts *z, int N) {
    if (pm->outer_mode != QT_OUTER_SLICED || !pm->head_slice || !zm->reduce_parts) return 0;
    const size_t piece = zero_reduce_piece((size_t)pm->n_trainable, N, z);
    const uint64_t vc = pm->outer, sl = pm->head_slice, rp = zm->reduce_parts;
    if (vc <= PLAN_MMAP_CEILING || (uint64_t)piece * 4 <= PLAN_MMAP_CEILING) return 0;
    const uint64_t sum = (vc > sl ? vc : sl) + rp, peak = sl + (vc > rp ? vc : rp);
    return sum > peak ? sum - peak : 0;
}

/* The ZeRO options the trainer would pass for this plan. */
static zero_opts plan_zero_opts(const qt_plan_opts *o, const plan_model *pm) {
    zero_opts z = {.stage = o->zero, .offload = o->offload, .bucket_elems = o->reduce_bucket,
                   .allgather_bucket_elems = o->allgather_bucket, .emb_rows = pm->rows, .emb_dim = pm->dim,
                   .unit_elems = pm->unit, .overlap = pm->overlap, .persist_elems = pm->persist,
                   .offload_param = o->offload_param};
    return z;
}

/* ---- strategy side -------------------------------------------------------- */

static uint64_t shard(uint64_t bytes, int n) { return (bytes + (uint64_t)n - 1) / (uint64_t)n; }

/* Rank 0's device (the largest shard). Gradients and communication buffers
 * are what the model and zero_plan_create allocate (memplan's gradient
 * windows at ZeRO-2 over several ranks; dist.h zero_memory): the same
 * functions size them here and there. */
static void plan_device(const qt_config *c, const qt_plan_opts *o, int N, qt_plan_device *d) {
    plan_model pm;
    plan_model_bytes(c, o, N, 0, &pm);
    const uint64_t Pt = (uint64_t)pm.n_trainable;
    memset(d, 0, sizeof *d);
    zero_opts z = plan_zero_opts(o, &pm);
    zero_mem zm;
    zero_memory((size_t)Pt, N, 0, &z, 2, &zm);
    d->weights = pm.weights - outer_apart(&pm, &zm, &z, N);
    /* ZeRO-2's fp32 gradient shard: on the host with offload (pinned, beside the master shard) */
    d->grads = pm.grads + (o->offload ? 0 : zm.grad_shard);
    /* f16/bf16 full fine-tuning under ZeRO 1/2: the rank's shard of the fp32 master, 0 with offload (as
     * DeepSpeed partitions and offloads it); LoRA's master (the adapter) is whole on every rank */
    d->master = pm.master;
    d->optim = o->offload ? 0 : zm.opt_state;
    d->activations = pm.activations;
    d->workspace = pm.workspace;
    d->comm = zm.reduce_parts + zm.gather_stage + zm.rows;
    d->total = d->weights + d->grads + d->master + d->optim + d->activations + d->workspace + d->comm;
}

/* One process's loaded tokenizer: measured from the model folder, else Qwen's on its vocabulary. */
static uint64_t plan_tokenizer(const qt_config *c, const qt_plan_opts *o) {
    if (o->tokenizer_bytes) return o->tokenizer_bytes;
    return c->vocab_size >= 151643 ? QT_PLAN_QWEN_TOKENIZER_BYTES : 0;
}

uint64_t qt_plan_cpu_rank(const qt_config *c, const qt_plan_opts *o, int rank, uint64_t mapped) {
    plan_model pm;
    plan_model_bytes(c, o, o->devices, rank, &pm);
    zero_opts z = plan_zero_opts(o, &pm);
    zero_mem zm;
    if (zero_memory((size_t)pm.n_trainable, o->devices, rank, &z, 2, &zm)) return 0;
    /* LoRA's frozen base is read from the file mapping (its pages in RSS) in f32, and in f16/bf16
     * when the file is already in the compute dtype; otherwise the model's converted copy is in its
     * own total. An untied embedding table is read a row a token, not whole: count the rows of one
     * micro-batch, each with the pages around it that a fault maps (Linux's fault_around_bytes,
     * 64 KiB), at most the table: a small table ends up resident whole, Qwen-14B's keeps ~5 MiB */
    uint64_t base = 0;
    if (o->lora && (o->precision == QT_F32 || o->precision == c->torch_dtype)) {
        base = pm.mapped_base;
        const uint64_t row = (uint64_t)c->hidden_size * qt_dtype_size(c->torch_dtype);
        const uint64_t V = (uint64_t)c->vocab_size, rows = (uint64_t)o->micro_batch * (uint64_t)o->seq_len;
        if (!c->tie_word_embeddings && !(o->lora_save & QT_SAVE_EMBED) && base >= V * row) {
            const uint64_t touched = (rows < V ? rows : V) * ((row + 4095) / 4096 * 4096 + 65536);
            base -= V * row - (touched < V * row ? touched : V * row);
        }
    }
    return pm.allocated - outer_apart(&pm, &zm, &z, o->devices) + pm.master_host + base + zm.total + mapped +
           qt_model_cpu_runtime_bytes() + tp_runtime_bytes(o->devices) + plan_tokenizer(c, o);
}

static int plan_check(const qt_config *c, const qt_plan_opts *o) {
    if (c->vocab_size <= 0 || c->hidden_size <= 0 || c->num_hidden_layers <= 0 || c->num_attention_heads <= 0 ||
        c->num_key_value_heads <= 0 || c->head_dim <= 0 || c->intermediate_size <= 0)
        return QT_ERR(QT_EINVAL, "the model config has a zero or negative size; check config.json");
    if (o->zero < 0 || o->zero > 3) return QT_ERR(QT_EINVAL, "--zero must be 0, 1, 2 or 3, not %d", o->zero);
    if (o->zero == 3 && o->lora && o->devices > 1 && (o->quant4 || c->prequant4))
        return QT_ERR(QT_EINVAL, "ZeRO stage 3 does not partition a 4-bit (QLoRA) base; plan QLoRA with --zero 2");
    if (o->offload_param && o->zero != 3)
        return QT_ERR(QT_EINVAL, "--offload-param cpu needs --zero 3 (only stage 3 partitions the weights)");
    if (o->devices < 1 || o->devices > MAX_DEVICES)
        return QT_ERR(QT_EINVAL, "--devices must be between 1 and %d, not %d", MAX_DEVICES, o->devices);
    if (o->offload && o->zero < 1)
        return QT_ERR(QT_EINVAL, "--offload cpu moves the sharded optimizer state to the host, so it needs "
                                 "--zero 1, 2 or 3 (as DeepSpeed's offload_optimizer does)");
    if (o->micro_batch < 1 || o->seq_len < 1 || o->micro_batch > (1 << 20) || o->seq_len > (1 << 22))
        return QT_ERR(QT_EINVAL, "--micro-batch and --seq-len must be positive (got %d and %d)", o->micro_batch,
                      o->seq_len);
    if (o->lora && (o->lora_r < 1 || o->lora_r > 65536 || !o->lora_targets))
        return QT_ERR(QT_EINVAL, "LoRA needs --lora-r >= 1 and at least one target module");
    if (!(o->device_gib > 0)) return QT_ERR(QT_EINVAL, "--device-memory must be a positive number of GiB");
    return QT_OK;
}

/* the backend whose descriptor sizes the workspaces (memplan.c's rule: unknown plans as the cpu) */
static const char *plan_desc_name(const qt_plan_opts *o) {
    const qt_backend_desc *d = qt_backend_desc_of(o->backend);
    return d ? d->name : "cpu";
}

/* The settings that shrink the per-card total, cheapest to the training
 * first, each only where it is not already on. */
enum { FIX_CKPT, FIX_REDUCE, FIX_GATHER, FIX_OVERLAP, FIX_MICRO, FIX_OFFLOAD, FIX_ZERO2, FIX_ZERO3, FIX_OFFLOAD_PARAM,
       FIX_LORA, FIX_COUNT };

/* o with setting k applied; 0 when it is already on or does not apply. */
static int fix_apply(const qt_config *c, const qt_plan_opts *o, int k, qt_plan_opts *f, char *say, size_t cap) {
    const size_t c2 = (size_t)c->hidden_size * (size_t)c->hidden_size, dflt = 500000000;
    const size_t reduce = o->reduce_bucket ? o->reduce_bucket : dflt, gather = o->allgather_bucket ? o->allgather_bucket : dflt;
    const int sharded = o->zero >= 1 && o->devices > 1;
    *f = *o;
    switch (k) {
    case FIX_CKPT:
        if (o->checkpointing) return 0;
        f->checkpointing = 1;
        snprintf(say, cap, "train.gradient_checkpointing true (--checkpointing)");
        return 1;
    case FIX_REDUCE:
        if (o->zero != 2 || o->devices < 2 || reduce <= c2) return 0;
        f->reduce_bucket = c2;
        snprintf(say, cap, "zero_optimization.reduce_bucket_size \"auto\" (= hidden_size^2 = %zu; --reduce-bucket-size %zu)",
                 c2, c2);
        return 1;
    case FIX_GATHER:
        if (!sharded || gather <= c2) return 0;
        f->allgather_bucket = c2;
        snprintf(say, cap, "zero_optimization.allgather_bucket_size %zu (hidden_size^2; --allgather-bucket-size %zu)", c2,
                 c2);
        return 1;
    case FIX_OVERLAP:
        if (!o->overlap) return 0;
        f->overlap = 0;
        snprintf(say, cap, "zero_optimization.overlap_comm false (drop --overlap-comm)");
        return 1;
    case FIX_MICRO:
        if (o->micro_batch < 2) return 0;
        f->micro_batch = o->micro_batch / 2;
        snprintf(say, cap, "train_micro_batch_size_per_gpu %d with gradient_accumulation_steps doubled (--micro-batch %d)",
                 f->micro_batch, f->micro_batch);
        return 1;
    case FIX_OFFLOAD:
        if (o->offload || o->zero < 1) return 0;
        f->offload = 1;
        snprintf(say, cap, "zero_optimization.offload_optimizer.device cpu (--offload cpu)");
        return 1;
    case FIX_ZERO2:
        if (o->zero >= 2 || o->devices < 2) return 0;
        f->zero = 2;
        snprintf(say, cap, "zero_optimization.stage 2 (--zero 2)");
        return 1;
    case FIX_ZERO3: /* QLoRA at stage 3 is refused */
        if (o->zero >= 3 || o->devices < 2 || (o->lora && (o->quant4 || c->prequant4))) return 0;
        f->zero = 3;
        snprintf(say, cap, "zero_optimization.stage 3 (--zero 3)");
        return 1;
    case FIX_OFFLOAD_PARAM:
        if (o->zero != 3 || o->devices < 2 || o->offload_param) return 0;
        f->offload_param = 1;
        snprintf(say, cap, "zero_optimization.offload_param.device cpu (--offload-param cpu)");
        return 1;
    case FIX_LORA:
        if (o->lora) return 0;
        f->lora = 1;
        snprintf(say, cap, "a \"lora\" section: LoRA instead of full fine-tuning (--mode lora)");
        return 1;
    }
    return 0;
}

/* p->fix: the first setting that brings the total under the card with the
 * plan's margin (else the first that fits at all); p->advice: every setting
 * not already on, by its option. */
static void plan_advice(const qt_config *c, const qt_plan_opts *o, qt_plan *p) {
    static const char *const flag[FIX_COUNT] = {"--checkpointing", "--reduce-bucket-size (hidden_size^2)",
                                                "--allgather-bucket-size (hidden_size^2)", "no --overlap-comm",
                                                "a smaller --micro-batch", "--offload cpu", "--zero 2", "--zero 3",
                                                "--offload-param cpu", "--mode lora"};
    const double cap = o->device_gib * GIB;
    char said[FIX_COUNT][sizeof p->fix];
    p->fix[0] = p->advice[0] = 0;
    int fit_any = -1;
    uint64_t fit_any_total = 0;
    for (int k = 0; k < FIX_COUNT; k++) {
        qt_plan_opts f;
        if (!fix_apply(c, o, k, &f, said[k], sizeof said[k])) continue;
        size_t n = strlen(p->advice);
        snprintf(p->advice + n, sizeof p->advice - n, "%s%s", n ? ", " : "", flag[k]);
        if (p->fix[0] || (p->fits && !p->borderline)) continue;
        /* stage 3 and its parameter offload trade step time for memory: named as the fix only when no
         * cheaper setting fits at all */
        if ((k == FIX_ZERO3 || k == FIX_OFFLOAD_PARAM) && fit_any >= 0) continue;
        qt_plan_device d;
        plan_device(c, &f, o->devices, &d);
        if ((double)d.total <= cap * (1 - QT_PLAN_ERROR)) {
            memcpy(p->fix, said[k], sizeof p->fix);
            p->fix_total = (double)d.total;
        } else if ((double)d.total <= cap && fit_any < 0) {
            fit_any = k;
            fit_any_total = d.total;
        }
    }
    if (o->devices == 1 && o->zero < 2 && !o->lora) { /* sharding needs ranks to shard over */
        size_t n = strlen(p->advice);
        snprintf(p->advice + n, sizeof p->advice - n, "%s--zero 2 over more --devices", n ? ", " : "");
    }
    if (!p->fix[0] && fit_any >= 0 && !p->fits) {
        memcpy(p->fix, said[fit_any], sizeof p->fix);
        p->fix_total = (double)fit_any_total;
    }
}

size_t qt_plan_outer_note(const qt_config *c, const qt_plan_opts *o, char *buf, size_t cap) {
    buf[0] = 0;
    if (!zero_partitions_params(o->zero, o->devices)) return 0;
    plan_model pm;
    plan_model_bytes(c, o, o->devices, 0, &pm);
    if (!pm.outer) return 0;
    qt_model_opts mo;
    qt_plan_model_opts(c, o, o->devices, 0, &mo);
    size_t between;
    qt_model_outer_mode(c, &mo, &between);
    zero_opts z = plan_zero_opts(o, &pm);
    zero_mem zm;
    zero_memory((size_t)pm.n_trainable, o->devices, 0, &z, 2, &zm);
    const double mib = 1024.0 * 1024.0;
    int k = snprintf(buf, cap, "stage3_max_reuse_distance %g: the embedding/lm_head gather buffer (V x C, %.1f MiB) ",
                     o->reuse_distance, (double)pm.outer / mib);
    if (k < 0 || (size_t)k >= cap) return strlen(buf);
    char *t = buf + k;
    size_t left = cap - (size_t)k;
    if (pm.outer_mode == QT_OUTER_KEPT)
        snprintf(t, left, "stays gathered between its uses: the layers read %.3g parameters between them, fewer than "
                 "the key", (double)between);
    else if (pm.outer_mode == QT_OUTER_FREED)
        snprintf(t, left, "is freed after the lookup and after the lm_head's backward and gathered again at each "
                 "use (the layers read %.3g parameters between them); it stays from the lm_head's forward through "
                 "its backward, where the peak still holds it (0 frees it there too)", (double)between);
    else if (pm.head_slice && outer_apart(&pm, &zm, &z, o->devices))
        snprintf(t, left, "is freed after every use and gathered again; the lm_head's backward gathers it one "
                 "vocabulary slice (%.1f MiB) at a time, so it is never held with the reductions' temporaries "
                 "(%.1f MiB less at the peak)", (double)pm.head_slice / mib,
                 (double)outer_apart(&pm, &zm, &z, o->devices) / mib);
    else if (pm.head_slice)
        snprintf(t, left, "is freed after every use and gathered again; the lm_head's backward gathers it one "
                 "vocabulary slice (%.1f MiB) at a time (the plan keeps their sum: below glibc's 32 MiB mmap "
                 "ceiling a freed block may stay in the heap)", (double)pm.head_slice / mib);
    else
        snprintf(t, left, "is freed after every use and gathered again at the next");
    return strlen(buf);
}

int qt_plan_compute(const qt_config *c, const qt_plan_opts *o, qt_plan *p) {
    QT_TRY(plan_check(c, o));
    memset(p, 0, sizeof *p);
    plan_model pm;
    const int N = o->devices;
    plan_model_bytes(c, o, N, 0, &pm);
    p->n_params = pm.n_params;
    p->n_trainable = pm.n_trainable;
    plan_device(c, o, N, &p->dev);

    const uint64_t cap = (uint64_t)(o->device_gib * GIB);
    p->fits = p->dev.total <= cap;
    p->borderline = fabs((double)p->dev.total - (double)cap) <= QT_PLAN_ERROR * (double)cap;
    plan_advice(c, o, p);
    if (o->backend_auto && !strcmp(plan_desc_name(o), "cpu")) {
        qt_plan_opts g = *o;
        g.backend = "cuda";
        qt_plan_device d;
        if (qt_backend_desc_of("cuda")) {
            plan_device(c, &g, N, &d);
            qt_plan gp = {.fits = d.total <= cap,
                          .borderline = fabs((double)d.total - (double)cap) <= QT_PLAN_ERROR * (double)cap};
            plan_advice(c, &g, &gp); /* the one setting for the card */
            p->gpu_note = 1;
            p->gpu_total = d.total;
            p->gpu_fits = gp.fits;
            p->gpu_borderline = gp.borderline;
            memcpy(p->gpu_fix, gp.fix, sizeof p->gpu_fix);
            p->gpu_fix_total = gp.fix_total;
        }
    }
    p->min_devices = -1;
    for (int n = 1; n <= MAX_DEVICES; n++) {
        qt_plan_device d;
        plan_device(c, o, n, &d);
        if (d.total <= cap) {
            p->min_devices = n;
            break;
        }
        if (o->zero == 0 && n > 1) break; /* nothing is sharded: more cards never help */
    }

    const int K = o->cards_per_host > 0 ? (o->cards_per_host < N ? o->cards_per_host : N) : (N < 8 ? N : 8);
    const uint64_t Pt = (uint64_t)pm.n_trainable;
    p->cards_per_host = K;
    p->hosts = (N + K - 1) / K;
    if (o->offload || o->offload_param) {
        /* Adam's m and v shards; pinned: ZeRO-2's fp32 gradient shards and in f16/bf16 full fine-tuning
         * the fp32 master shards (the optimizer reads them in place) */
        zero_opts z = plan_zero_opts(o, &pm);
        zero_mem zm;
        zero_memory((size_t)Pt, N, 0, &z, 2, &zm);
        p->host_offload = o->offload ? (uint64_t)K * shard(Pt * 8, N) : 0;
        p->host_pinned = (uint64_t)K * (pm.master_host + (o->offload ? zm.grad_shard : 0));
    }
    p->host_dataset = o->dataset_bytes;
    p->host_runtime = (uint64_t)K * HOST_RUNTIME_PER_RANK;
    /* LoRA's mapped base is its frozen weights, already counted on the device; ZeRO-3 over several ranks
     * drops each tensor's pages from the mapping once read (a rank keeps 1/N of the weights) */
    if (!o->lora && !zero_partitions_params(o->zero, N))
        p->host_mapped = o->weights_file_bytes ? o->weights_file_bytes
                                               : (uint64_t)pm.n_params * qt_dtype_size(c->torch_dtype);
    p->host_tokenizer = (uint64_t)K * plan_tokenizer(c, o);
    p->host_total =
        p->host_offload + p->host_pinned + p->host_dataset + p->host_runtime + p->host_mapped + p->host_tokenizer;
    p->cpu_runtime = qt_model_cpu_runtime_bytes();
    p->cpu_rank_bytes = qt_plan_cpu_rank(c, o, 0, p->host_mapped);
    {
        const qt_backend_desc *bd = qt_backend_desc_of("cpu");
        p->cpu_threads = omp_get_max_threads();
        p->cpu_blas_vm = bd ? (uint64_t)p->cpu_threads * bd->blas_thread_vm : 0;
    }
    p->host_recommend = (uint64_t)ceil((double)p->host_total * 1.2 / GIB) * (uint64_t)GIB;

    /* A checkpoint holds the fp32 trainable block and Adam m, v (all shards
     * together); final/ is the adapter in fp32 or the model in its own
     * torch_dtype (write_final in trainer_ckpt.c), whatever the compute dtype. */
    p->ckpt_bytes = Pt * 12;
    p->final_bytes = o->lora ? Pt * 4 : (uint64_t)pm.n_params * qt_dtype_size(c->torch_dtype);
    /* final/model.safetensors as a hard link to the last checkpoint's file:
     * no second copy on disk (the trainer's own rule) */
    p->final_linked = qt_train_final_links_checkpoint(o->lora, c->torch_dtype);

    p->power_w = N * o->card_watts + p->hosts * o->host_watts;
    p->power_recommend_w = p->power_w * 1.2;
    return QT_OK;
}

/* ---- output ---------------------------------------------------------------- */

static double gib(uint64_t b) { return (double)b / GIB; }

/* The adapted modules in the layout's own names (the original Qwen's c_attn, not q_proj,v_proj). */
static const char *targets_str(const qt_config *c, unsigned t, char *buf, size_t cap) {
    char names[8][64];
    const int n = qt_lora_target_names(c, t, names, 8);
    buf[0] = 0;
    for (int i = 0; i < n; i++) {
        size_t k = strlen(buf);
        snprintf(buf + k, cap - k, "%s%s", k ? "," : "", names[i]);
    }
    return buf;
}

/* modules_to_save as the plan names them: "embed_tokens,lm_head", "" for none. */
static const char *saved_str(unsigned save) {
    return save == (QT_SAVE_EMBED | QT_SAVE_LM_HEAD) ? "embed_tokens,lm_head"
           : save == QT_SAVE_EMBED                 ? "embed_tokens"
           : save == QT_SAVE_LM_HEAD               ? "lm_head"
                                                   : "";
}

/* The layers LoRA adapts (layers_to_transform; all without it). */
static int plan_lora_layers(const qt_config *c, const qt_plan_opts *o) {
    int n = 0;
    for (int l = 0; l < c->num_hidden_layers; l++)
        n += !o->lora_layers_set || (l < QT_LORA_MAX_LAYERS && (o->lora_layers[l / 64] >> (l % 64) & 1));
    return n;
}

static void strategy_line(const qt_config *c, const qt_plan_opts *o, char *buf, size_t cap) {
    char t[600], sv[64] = "";
    if (o->lora && o->lora_save) snprintf(sv, sizeof sv, " + %s trained", saved_str(o->lora_save));
    if (o->lora && o->lora_layers_set) { /* layers_to_transform */
        size_t k = strlen(sv);
        snprintf(sv + k, sizeof sv - k, " in %d of %d layers", plan_lora_layers(c, o), c->num_hidden_layers);
    }
    if (o->lora)
        snprintf(buf, cap, "LoRA r=%d on %s%s, %s, ZeRO %d, %d device%s%s, B=%d T=%d%s", o->lora_r,
                 targets_str(c, o->lora_targets, t, sizeof t), sv, qt_dtype_name(o->precision), o->zero, o->devices,
                 o->devices > 1 ? "s" : "", o->offload ? ", optimizer offloaded to host" : "", o->micro_batch,
                 o->seq_len, o->checkpointing ? ", recomputation" : "");
    else
        snprintf(buf, cap, "full fine-tuning, %s, ZeRO %d, %d device%s%s, B=%d T=%d%s", qt_dtype_name(o->precision),
                 o->zero, o->devices, o->devices > 1 ? "s" : "", o->offload ? ", optimizer offloaded to host" : "",
                 o->micro_batch, o->seq_len, o->checkpointing ? ", recomputation" : "");
}

static const char *desc_name(const qt_plan_opts *o) { return plan_desc_name(o); }

/* "fits", "does NOT fit", with "(borderline)" inside the plan's error */
static const char *verdict(int fits, int borderline) {
    return fits ? (borderline ? "fits (borderline)" : "fits") : (borderline ? "does NOT fit (borderline)" : "does NOT fit");
}

/* text after a label of 11 columns, wrapped at 100 */
static void print_wrapped(FILE *f, const char *label, const char *text) {
    fprintf(f, "%-11s", label);
    int col = 11;
    for (const char *w = text; *w;) {
        size_t n = strcspn(w, " ");
        if (col > 11 && col + 1 + (int)n > 100) fprintf(f, "\n%11s", ""), col = 11;
        else if (col > 11) fputc(' ', f), col++;
        fprintf(f, "%.*s", (int)n, w);
        col += (int)n;
        w += n;
        while (*w == ' ') w++;
    }
    fputc('\n', f);
}

void qt_plan_print(FILE *f, const char *name, const qt_config *c, const qt_plan_opts *o, const qt_plan *p) {
    char s[400];
    strategy_line(c, o, s, sizeof s);
    /* one unit for the whole report: GiB, or MiB for small shapes */
    const double unit = p->dev.total >= GIB ? GIB : 1024.0 * 1024.0;
    const char *un = unit == GIB ? "GiB" : "MiB";
#define U(b) ((double)(b) / unit)
    fprintf(f, "model      %s: %.3f %s parameters (L=%d C=%d I=%d H=%d KV=%d D=%d V=%d)\n", name,
            p->n_params >= 1000000000 ? (double)p->n_params / 1e9 : (double)p->n_params / 1e6,
            p->n_params >= 1000000000 ? "B" : "M", c->num_hidden_layers, c->hidden_size, c->intermediate_size,
            c->num_attention_heads, c->num_key_value_heads, c->head_dim, c->vocab_size);
    fprintf(f, "strategy   %s\n", s);
    fprintf(f, "device     %s (its descriptor sizes the workspaces; the device need not be on this machine)\n",
            desc_name(o));
    const qt_plan_card *card = qt_plan_card_of(desc_name(o));
    if (card)
        fprintf(f, "card       %s: %.0f GiB HBM, %.0f TFLOP/s fp16, %s (%s)\n", card->name, card->hbm_gib,
                card->fp16_tflops, card->bf16 ? "bf16" : "no bf16", card->source);
    char note[600];
    if (qt_plan_outer_note(c, o, note, sizeof note)) print_wrapped(f, "stage 3", note);
    fprintf(f, "trainable  %.3f M parameters\n\n", (double)p->n_trainable / 1e6);
    fprintf(f, "per device                 %s\n", un);
    fprintf(f, "  weights            %9.3f\n", U(p->dev.weights));
    fprintf(f, "  gradients          %9.3f\n", U(p->dev.grads));
    fprintf(f, "  master weights     %9.3f\n", U(p->dev.master));
    fprintf(f, "  optimizer state    %9.3f\n", U(p->dev.optim));
    fprintf(f, "  activations        %9.3f\n", U(p->dev.activations));
    fprintf(f, "  workspace          %9.3f\n", U(p->dev.workspace));
    fprintf(f, "  communication      %9.3f\n", U(p->dev.comm));
    fprintf(f, "  total              %9.3f %s of %.1f GiB: %s\n", U(p->dev.total), un, o->device_gib,
            verdict(p->fits, p->borderline));
    if (p->borderline)
        fprintf(f, "borderline within the plan's %.0f%% error of the card's %.1f GiB (docs/plan.md)%s\n",
                QT_PLAN_ERROR * 100, o->device_gib, p->fix[0] ? ";" : "; no one setting gives it that margin");
    if (p->fix[0])
        fprintf(f, "%s %s: %.2f GiB a card\n", p->fits ? "for margin, set" : "to fit, set", p->fix, p->fix_total / GIB);
    if (p->gpu_note) {
        fprintf(f, "\nNOTE: these figures use the CPU backend's descriptor (device \"auto\" found no GPU here).\n"
                   "On a CUDA card the workspaces (cuBLAS, 8192-row lm_head chunks, 256-byte alignment) add\n"
                   "%.2f GiB: %.2f GiB of %.1f GiB a card: %s.\n",
                gib(p->gpu_total > p->dev.total ? p->gpu_total - p->dev.total : 0), gib(p->gpu_total), o->device_gib,
                verdict(p->gpu_fits, p->gpu_borderline));
        if (p->gpu_fix[0])
            fprintf(f, "On the card, %s %s: %.2f GiB a card.\n", p->gpu_fits ? "for margin, set" : "to fit, set",
                    p->gpu_fix, p->gpu_fix_total / GIB);
        fprintf(f, "Plan for the card with --device cuda, or set the job's \"device\": \"cuda\".\n");
    }
    fprintf(f, "\n");
    if (p->min_devices > 0)
        fprintf(f, "smallest device count that fits with this strategy: %d\n", p->min_devices);
    else if (p->advice[0])
        fprintf(f, "no device count fits with this strategy; try %s\n", p->advice);
    else
        fprintf(f, "no device count fits with this strategy, and every setting the plan knows to shrink it is\n"
                   "already on (the weights alone are %.1f GiB a card)\n", gib(p->dev.weights));
    fprintf(f, "\nhost memory (one host, %d card%s)   %s\n", p->cards_per_host, p->cards_per_host > 1 ? "s" : "", un);
    fprintf(f, "  offloaded Adam m, v          %9.3f\n", U(p->host_offload));
    fprintf(f, "  pinned master, grad shards   %9.3f\n", U(p->host_pinned));
    fprintf(f, "  dataset                      %9.3f\n", U(p->host_dataset));
    fprintf(f, "  mapped weights file          %9.3f\n", U(p->host_mapped));
    fprintf(f, "  tokenizer (loaded, per rank) %9.3f\n", U(p->host_tokenizer));
    fprintf(f, "  runtime (1 GiB per rank)     %9.3f\n", U(p->host_runtime));
    fprintf(f, "  total                        %9.3f %s -> recommend %.0f GiB (+20%%)\n\n", U(p->host_total), un,
            gib(p->host_recommend));
    fprintf(f, "cpu run    one rank's process on the CPU backend: %.3f %s (device total + its offloaded\n"
               "           shards + mapped weights file + tokenizer + %.0f MiB process runtime)\n",
            U(p->cpu_rank_bytes), un, (double)p->cpu_runtime / (1 << 20));
    if (p->cpu_blas_vm)
        fprintf(f, "           address space (ulimit -v) %.3f %s more: OpenBLAS maps a %.0f MiB buffer for each of %d\n"
                   "           thread%s (OMP_NUM_THREADS) at its first call; virtual, not memory in use\n",
                U(p->cpu_blas_vm), un, (double)p->cpu_blas_vm / p->cpu_threads / (1 << 20), p->cpu_threads,
                p->cpu_threads == 1 ? "" : "s");
    fprintf(f, "disk       checkpoint %.3f %s each (fp32 trainable + Adam m, v); final %.3f %s%s\n",
            U(p->ckpt_bytes), un, U(p->final_bytes), un,
            p->final_linked ? " (a hard link to the last checkpoint's model: no extra space)" : "");
    fprintf(f, "power      %d card%s x %.0f W + %d host%s x %.0f W = %.0f W -> provision %.0f W (+20%%)\n",
            o->devices, o->devices > 1 ? "s" : "", o->card_watts, p->hosts, p->hosts > 1 ? "s" : "", o->host_watts,
            p->power_w, p->power_recommend_w);
    fprintf(f, "\nassumptions: gradients and optimizer state fp32 (Adam m, v = 8 B/param); f16/bf16 keep a 2 B\n"
               "compute copy plus a 4 B fp32 master (full fine-tuning under ZeRO 1/2: 1/N a rank; offload puts it,\n"
               "Adam m, v and ZeRO-2's gradient shard on the host); activations in the compute dtype (one fp32\n"
               "working layer), sized for one micro-batch B x T, attention not materialised (log-sum-exp\n"
               "kept); collectives reduce into one fp32 gradient shard per rank; card TDP %.0f W (--card-watts), host %.0f W\n"
               "(--host-watts), dataset %.2f GiB (--dataset-gib).\n",
            o->card_watts, o->host_watts, gib(o->dataset_bytes));
#undef U
}

static void add_u64(cJSON *o, const char *k, uint64_t v) { cJSON_AddNumberToObject(o, k, (double)v); }

char *qt_plan_json(const char *name, const qt_config *c, const qt_plan_opts *o, const qt_plan *p) {
    cJSON *r = cJSON_CreateObject();
    if (!r) {
        QT_ERR(QT_ENOMEM, "could not build the plan's JSON");
        return NULL;
    }
    char t[600];
    cJSON_AddStringToObject(r, "model", name);
    cJSON_AddStringToObject(r, "mode", o->lora ? "lora" : "full");
    if (o->lora) {
        cJSON_AddNumberToObject(r, "lora_r", o->lora_r);
        cJSON_AddStringToObject(r, "lora_targets", targets_str(c, o->lora_targets, t, sizeof t));
        const int q4 = o->quant4 || c->prequant4, nested = c->prequant4 ? c->prequant4_nested : o->quant4_nested;
        cJSON_AddStringToObject(r, "base", !q4 ? "16-bit" : nested ? "4-bit, double-quantized" : "4-bit");
        cJSON_AddStringToObject(r, "modules_to_save", saved_str(o->lora_save));
        cJSON_AddNumberToObject(r, "lora_layers", plan_lora_layers(c, o));
        cJSON_AddNumberToObject(r, "lora_dropout", round((double)o->lora_dropout * 1e6) / 1e6); /* 0.1, not float's 0.10000000149 */
    }
    cJSON_AddStringToObject(r, "backend", desc_name(o));
    const qt_plan_card *card = qt_plan_card_of(desc_name(o));
    cJSON *cj = card ? cJSON_AddObjectToObject(r, "card") : NULL;
    if (cj) {
        cJSON_AddStringToObject(cj, "name", card->name);
        cJSON_AddNumberToObject(cj, "hbm_gib", card->hbm_gib);
        cJSON_AddNumberToObject(cj, "fp16_tflops", card->fp16_tflops);
        cJSON_AddBoolToObject(cj, "bf16", card->bf16);
        cJSON_AddStringToObject(cj, "source", card->source);
    }
    cJSON_AddNumberToObject(r, "zero", o->zero);
    cJSON_AddNumberToObject(r, "devices", o->devices);
    cJSON_AddStringToObject(r, "offload", o->offload ? "cpu" : "none");
    cJSON_AddStringToObject(r, "precision", qt_dtype_name(o->precision));
    cJSON_AddNumberToObject(r, "micro_batch", o->micro_batch);
    cJSON_AddNumberToObject(r, "seq_len", o->seq_len);
    cJSON_AddBoolToObject(r, "checkpointing", o->checkpointing);
    add_u64(r, "n_params", (uint64_t)p->n_params);
    add_u64(r, "n_trainable", (uint64_t)p->n_trainable);
    char note[600];
    if (qt_plan_outer_note(c, o, note, sizeof note)) cJSON_AddStringToObject(r, "stage3_reuse", note);
    cJSON *d = cJSON_AddObjectToObject(r, "per_device_bytes");
    if (d) {
        add_u64(d, "weights", p->dev.weights);
        add_u64(d, "gradients", p->dev.grads);
        add_u64(d, "master_weights", p->dev.master);
        add_u64(d, "optimizer_state", p->dev.optim);
        add_u64(d, "activations", p->dev.activations);
        add_u64(d, "workspace", p->dev.workspace);
        add_u64(d, "communication", p->dev.comm);
        add_u64(d, "total", p->dev.total);
    }
    add_u64(r, "device_memory_bytes", (uint64_t)(o->device_gib * GIB));
    cJSON_AddBoolToObject(r, "fits", p->fits);
    cJSON_AddBoolToObject(r, "borderline", p->borderline);
    cJSON_AddNumberToObject(r, "plan_error", QT_PLAN_ERROR);
    if (p->fix[0]) {
        cJSON_AddStringToObject(r, "fix", p->fix);
        add_u64(r, "fix_total_bytes", (uint64_t)p->fix_total);
    }
    cJSON_AddStringToObject(r, "advice", p->advice);
    if (p->gpu_note) {
        cJSON *g = cJSON_AddObjectToObject(r, "cuda");
        if (g) {
            add_u64(g, "total_bytes", p->gpu_total);
            cJSON_AddBoolToObject(g, "fits", p->gpu_fits);
            cJSON_AddBoolToObject(g, "borderline", p->gpu_borderline);
            if (p->gpu_fix[0]) {
                cJSON_AddStringToObject(g, "fix", p->gpu_fix);
                add_u64(g, "fix_total_bytes", (uint64_t)p->gpu_fix_total);
            }
        }
    }
    cJSON_AddNumberToObject(r, "min_devices", p->min_devices);
    cJSON *h = cJSON_AddObjectToObject(r, "host_bytes");
    if (h) {
        cJSON_AddNumberToObject(h, "cards_per_host", p->cards_per_host);
        add_u64(h, "offload", p->host_offload);
        add_u64(h, "pinned_shards", p->host_pinned);
        add_u64(h, "dataset", p->host_dataset);
        add_u64(h, "runtime", p->host_runtime);
        add_u64(h, "mapped_weights", p->host_mapped);
        add_u64(h, "tokenizer", p->host_tokenizer);
        add_u64(h, "total", p->host_total);
        add_u64(h, "recommend", p->host_recommend);
    }
    add_u64(r, "cpu_rank_bytes", p->cpu_rank_bytes);
    if (o->devices <= 64) {
        cJSON *a = cJSON_AddArrayToObject(r, "cpu_rank_bytes_per_rank");
        for (int k = 0; a && k < o->devices; k++)
            cJSON_AddItemToArray(a, cJSON_CreateNumber((double)qt_plan_cpu_rank(c, o, k, p->host_mapped)));
    }
    add_u64(r, "cpu_runtime_bytes", p->cpu_runtime);
    add_u64(r, "cpu_blas_address_space_bytes", p->cpu_blas_vm);
    cJSON_AddNumberToObject(r, "cpu_threads", p->cpu_threads);
    add_u64(r, "checkpoint_bytes", p->ckpt_bytes);
    add_u64(r, "final_bytes", p->final_bytes);
    cJSON_AddBoolToObject(r, "final_linked", p->final_linked);
    cJSON *w = cJSON_AddObjectToObject(r, "power");
    if (w) {
        cJSON_AddNumberToObject(w, "hosts", p->hosts);
        cJSON_AddNumberToObject(w, "card_watts", o->card_watts);
        cJSON_AddNumberToObject(w, "host_watts", o->host_watts);
        cJSON_AddNumberToObject(w, "total_watts", p->power_w);
        cJSON_AddNumberToObject(w, "recommend_watts", p->power_recommend_w);
    }
    char *s = cJSON_PrintUnformatted(r);
    cJSON_Delete(r);
    if (!s) {
        QT_ERR(QT_ENOMEM, "could not print the plan's JSON");
        return NULL;
    }
    char *out = qt_strdup(s);
    cJSON_free(s);
    return out;
}

void qt_plan_print_strategies(FILE *f, const char *name, const qt_config *c, const qt_plan_opts *base) {
    /* the report's three, and a fourth it implied: its "under 20 GB" LoRA needs the base in 4 bits (QLoRA) */
    enum { NS = 4 };
    qt_plan_opts s[NS];
    const char *title[NS] = {"full fp16, 4 cards, ZeRO 0", "full fp16, 4 cards, ZeRO 2 + offload",
                             "LoRA r=8 q,v fp16, 1 card", "QLoRA r=8 q,v fp16, NF4 base, 1 card"};
    for (int i = 0; i < NS; i++) {
        s[i] = *base;
        s[i].precision = QT_F16;
        s[i].lora = 0;
        s[i].offload = 0;
        s[i].quant4 = 0;
        s[i].lora_dropout = 0.1f; /* the field report's LoRA: every layer, PEFT's usual dropout */
        s[i].lora_layers_set = 0;
    }
    s[0].zero = 0, s[0].devices = 4;
    s[1].zero = 2, s[1].devices = 4, s[1].offload = 1;
    s[2].zero = 0, s[2].devices = 1, s[2].lora = 1, s[2].lora_r = 8, s[2].lora_targets = QT_LORA_Q | QT_LORA_V;
    s[3] = s[2];
    s[3].quant4 = 1, s[3].quant4_nested = 1, s[3].quant4_skip = 0;
    qt_plan p[NS];
    for (int i = 0; i < NS; i++)
        if (qt_plan_compute(c, &s[i], &p[i]) != QT_OK) {
            fprintf(f, "could not plan '%s': %s\n", title[i], qt_error_message());
            return;
        }
    fprintf(f, "the field report's three strategies for %s (%.2f B parameters), B=%d T=%d%s, %.0f GiB cards,\n"
               "and QLoRA (the base's layer linears in NF4, double-quantized)\n\n",
            name, (double)p[0].n_params / 1e9, base->micro_batch, base->seq_len,
            base->checkpointing ? ", recomputation" : "", base->device_gib);
    fprintf(f, "%-22s %14s %14s %14s %14s\n", "GiB per card", "full/ZeRO0", "ZeRO2+offload", "LoRA 1 card",
            "QLoRA 1 card");
#define ROW(label, field)                                                                                    \
    fprintf(f, "%-22s %14.2f %14.2f %14.2f %14.2f\n", label, gib(p[0].dev.field), gib(p[1].dev.field), \
            gib(p[2].dev.field), gib(p[3].dev.field))
    ROW("weights (fp16/4-bit)", weights);
    ROW("gradients (fp32)", grads);
    ROW("master weights (fp32)", master);
    ROW("Adam m, v (fp32)", optim);
    ROW("activations", activations);
    ROW("workspace", workspace);
    ROW("communication", comm);
    ROW("total", total);
#undef ROW
    fprintf(f, "%-22s %14s %14s %14s %14s\n", "fits", p[0].fits ? "yes" : "no", p[1].fits ? "yes" : "no",
            p[2].fits ? "yes" : "no", p[3].fits ? "yes" : "no");
    fprintf(f, "%-22s %14.2f %14.2f %14.2f %14.2f\n", "host RAM (GiB, +20%)", gib(p[0].host_recommend),
            gib(p[1].host_recommend), gib(p[2].host_recommend), gib(p[3].host_recommend));
    fprintf(f, "\nthe report said: ~56 GB (full fp16), ~35 GB (ZeRO-2 offload), under 20 GB (LoRA) per card;\n"
               "its LoRA figure is QLoRA's: with a 16-bit base LoRA holds the whole base on the card.\n"
               "See docs/plan.md for why these numbers differ (what each counts).\n");
    (void)title;
}
