/* The DeepSpeed section as the training loop uses it. */
#include "core/error.h"
#include "io/hf_config.h"
#include "model/lora_io.h"
#include "train/trainer.h"

#include <string.h>

void qt_train_cfg_from_ds(const qt_ds_config *ds, qt_train_cfg *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->micro_batch = (int)ds->micro_batch;
    cfg->grad_accum = (int)ds->grad_accum;
    cfg->world = ds->world;
    cfg->clip = ds->gradient_clipping;
    cfg->adam = ds->adam;
    cfg->sched = ds->sched;
    cfg->fp16 = ds->fp16;
    cfg->compute = ds->fp16 ? QT_F16 : ds->bf16 ? QT_BF16 : QT_F32;
    cfg->scaler = ds->scaler;
    cfg->zero.stage = ds->zero.stage;
    cfg->zero.offload = ds->zero.offload_optimizer;
    /* DeepSpeed's bucket sizes as given (default 5e8 elements each); a
     * bucket larger than the block is the block (dist.h zero_memory) */
    cfg->zero.bucket_elems = ds->zero.reduce_bucket_size >= 1 ? (size_t)ds->zero.reduce_bucket_size : 0;
    cfg->zero.allgather_bucket_elems = ds->zero.allgather_bucket_size >= 1 ? (size_t)ds->zero.allgather_bucket_size : 0;
    cfg->zero.overlap = ds->zero.overlap_comm;
    cfg->zero.offload_param = ds->zero.offload_param;
    cfg->zero.prefetch = ds->zero.prefetch_bucket_size > 0; /* stage 3: the next layer gathered ahead */
    cfg->zero.reuse_distance = ds->zero.max_reuse_distance;
    cfg->steps_per_print = ds->steps_per_print > 0 ? ds->steps_per_print : 10;
}

void qt_train_ds_resolve_model(qt_ds_config *ds, const char *model) {
    if (!ds->zero.reduce_bucket_auto && !ds->zero.stage3_auto) return;
    qt_config cfg;
    int64_t hidden = 0;
    if (model && qt_config_load(model, &cfg) == QT_OK) hidden = cfg.hidden_size;
    else qt_error_clear(); /* the model folder's own error is the caller's to report */
    qt_ds_config_resolve_model(ds, hidden);
}

static void precision_text(const qt_ds_config *ds, char *buf, size_t cap) {
    if (ds->fp16) snprintf(buf, cap, "fp16 (%s loss scaling)", ds->scaler.loss_scale > 0 ? "static" : "dynamic");
    else if (ds->bf16) snprintf(buf, cap, "bf16");
    else if (ds->precision_auto_off[0])
        snprintf(buf, cap, "fp32 (WARNING: %s.enabled \"auto\" -> false; set it to true for %s)",
                 ds->precision_auto_off, ds->precision_auto_off);
    else snprintf(buf, cap, "fp32");
}

static void sched_text(const qt_ds_config *ds, char *buf, size_t cap) {
    const qt_sched *s = &ds->sched;
    const int64_t w = s->warmup_num_steps < 2 ? 2 : s->warmup_num_steps; /* DeepSpeed's max(2, n) */
    char total[48];
    if (ds->total_num_steps_auto) snprintf(total, sizeof total, "train.max_steps");
    else snprintf(total, sizeof total, "%lld", (long long)s->total_num_steps);
    switch (s->type) {
    case QT_SCHED_CONSTANT: snprintf(buf, cap, "constant"); break;
    case QT_SCHED_WARMUP_LR:
        snprintf(buf, cap, "WarmupLR %g -> %g over %lld steps", s->warmup_min_lr, s->warmup_max_lr, (long long)w);
        break;
    case QT_SCHED_WARMUP_DECAY_LR:
        snprintf(buf, cap, "WarmupDecayLR %g -> %g over %lld steps, to 0 at step %s", s->warmup_min_lr,
                 s->warmup_max_lr, (long long)w, total);
        break;
    case QT_SCHED_WARMUP_COSINE_LR:
        snprintf(buf, cap, "WarmupCosineLR, warmup %lld steps, cosine to %g x lr at step %s", (long long)w,
                 s->cos_min_ratio, total);
        break;
    }
}

/* Weight decay, when there is any, with how it is applied: DeepSpeed's
 * "Adam" decays as AdamW unless adam_w_mode is false, which a torch user
 * would not guess from the name. */
static void decay_text(const qt_ds_config *ds, char *buf, size_t cap) {
    const qt_adam_cfg *a = &ds->adam;
    const int adam = strcmp(ds->optimizer_type, "AdamW") != 0;
    if (a->weight_decay == 0.0) buf[0] = 0;
    else if (!a->decoupled) snprintf(buf, cap, ", weight decay %g as L2 in the gradient (adam_w_mode false)", a->weight_decay);
    else snprintf(buf, cap, ", weight decay %g decoupled%s", a->weight_decay,
                  adam ? " as in AdamW (adam_w_mode true, DeepSpeed's default)" : "");
}

void qt_train_describe(const qt_job *job, const qt_ds_config *ds, const char *device, char *buf, size_t cap) {
    char what[160], sched[160], decay[128], prec[128];
    if (job->lora.enabled)
        snprintf(what, sizeof what, "LoRA r %d alpha %g on %d module kind(s)", job->lora.r, job->lora.lora_alpha,
                 job->lora.n_target_names);
    else snprintf(what, sizeof what, "full fine-tuning");
    sched_text(ds, sched, sizeof sched);
    decay_text(ds, decay, sizeof decay);
    precision_text(ds, prec, sizeof prec);
    const char *lr_note = ds->sched.type == QT_SCHED_CONSTANT || ds->sched.type == QT_SCHED_WARMUP_COSINE_LR
                              ? ""
                              : " (the schedule sets it)";
    snprintf(buf, cap,
             "run: %s | %s | ZeRO stage %d%s | %s lr %g%s%s, %s | gradient checkpointing %s | micro-batch %lld x "
             "accumulation %lld x %d rank(s) = %lld rows of %d tokens | device %s",
             what, prec, ds->zero.stage,
             ds->zero.offload_param ? ", optimizer and parameters offloaded to host"
             : ds->zero.offload_optimizer ? ", optimizer offloaded to host" : ", no offload",
             ds->optimizer_type, ds->adam.lr, lr_note, decay, sched, job->train.gradient_checkpointing ? "on" : "off",
             (long long)ds->micro_batch, (long long)ds->grad_accum, ds->world, (long long)ds->train_batch_size,
             job->data.seq_len, device);
    if (job->objective.type != QT_OBJ_SFT) { /* the objective and, for DPO, what the reference model is */
        char obj[160];
        size_t k = strlen(buf);
        qt_objective_describe(&job->objective, obj, sizeof obj);
        const int pre = qt_objective_precomputes_ref(&job->objective, job->lora.enabled);
        const char *ref = !qt_objective_needs_ref(&job->objective) ? "no reference model"
                          : pre && job->lora.enabled
                              ? "reference: the base model with the adapter off, its log-probs computed once before "
                                "training (precompute_ref_log_probs) and cached beside the token cache"
                          : pre ? "reference: the starting weights, their log-probs computed once before training "
                                  "(precompute_ref_log_probs) and cached beside the token cache"
                                : "reference: the base model with the adapter off";
        /* TRL with a PEFT model and no ref_model: disable_adapter(), so an init_from adapter is not in it */
        snprintf(buf + k, cap > k ? cap - k : 0, " | objective %s on pairs (each row count above is pairs: a "
                 "chosen and a rejected row each), %s%s", obj, ref,
                 qt_objective_needs_ref(&job->objective) && job->lora.init_from ? " (without the init_from adapter)"
                                                                                 : "");
    }
}

int qt_job_lora_targets_resolve(const qt_job *job, const qt_config *cfg, unsigned *mask) {
    const qt_job_lora *l = &job->lora;
    *mask = l->targets;
    if (l->targets_default && qt_config_layout(cfg)->fused_qkv) { /* PEFT's default for model_type qwen */
        const char *c_attn = "c_attn";
        return qt_lora_targets_from_names(cfg, &c_attn, 1, mask, job->path);
    }
    if (l->targets_default || l->targets_all_linear) return QT_OK; /* q_proj/v_proj for Qwen2 layouts; every linear */
    char where[4200];
    snprintf(where, sizeof where, "%s: lora", job->path);
    return qt_lora_targets_from_names(cfg, (const char *const *)l->target_names, l->n_target_names, mask, where);
}
