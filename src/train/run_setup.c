/* The job's meaning in one place (run_setup.h): the trainer, `qtune plan`
 * and `qtune doctor` read what is resolved here. */
#include "train/run_setup.h"

#include "core/error.h"
#include "core/mem.h"
#include "io/hf_config.h"
#include "model/lora_io.h"

#include <stdio.h>
#include <string.h>

int qt_run_setup_ds(const qt_job *job, int world, qt_ds_config *ds) {
    if (job->deepspeed) {
        char where[4200];
        if (job->deepspeed_path) snprintf(where, sizeof where, "%s", job->deepspeed_path);
        else snprintf(where, sizeof where, "%s: deepspeed", job->path);
        QT_TRY(qt_ds_config_parse(job->deepspeed, where, world, ds));
    } else {
        qt_ds_config_default(ds, world);
    }
    /* a reduce_bucket_size of "auto" is the model's hidden_size squared: it sizes the gradient buckets the
     * model is asked for, so it is resolved from config.json before anything is loaded */
    qt_train_ds_resolve_model(ds, job->model);
    return QT_OK;
}

int qt_run_setup_open(qt_run_setup *s, const qt_job *job, int world, int rank) {
    memset(s, 0, sizeof *s);
    s->job = job;
    s->world = world;
    s->rank = rank;
    s->pref = job->objective.type != QT_OBJ_SFT;
    s->lora_targets = job->lora.targets;
    s->lora_sel.lora = job->lora.enabled;
    QT_TRY(qt_run_setup_ds(job, world, &s->ds));
    /* provisional (B, A, dtype for the model and loaders); final once max_steps is known */
    qt_train_cfg_from_ds(&s->ds, &s->cfg);
    return QT_OK;
}

/* modules_to_save and layers_to_transform as PEFT resolves them, the targets in the layout's own names */
static int resolve_selection(qt_run_setup *s, const qt_config *cfg) {
    const qt_job_lora *l = &s->job->lora;
    peft_config *pc = qt_calloc(1, sizeof *pc, "LoRA selection");
    if (!pc) return QT_ENOMEM;
    char names[8][64], where[4200];
    int n = qt_lora_target_names(cfg, s->lora_targets, names, 8);
    for (int i = 0; i < n; i++) memcpy(pc->target_modules[pc->n_targets++], names[i], sizeof names[i]);
    pc->n_save = l->extras.n_save;
    memcpy(pc->modules_to_save, l->extras.modules_to_save, sizeof pc->modules_to_save);
    pc->n_layers = l->extras.n_layers;
    memcpy(pc->layers_to_transform, l->extras.layers_to_transform, sizeof pc->layers_to_transform);
    pc->n_patterns = l->extras.n_patterns;
    memcpy(pc->layers_pattern, l->extras.layers_pattern, sizeof pc->layers_pattern);
    snprintf(where, sizeof where, "%s: lora", s->job->path);
    int rc = qt_lora_resolve(cfg, pc, &s->lora_sel, where);
    qt_free(pc);
    return rc;
}

int qt_run_setup_lora(qt_run_setup *s, int strict) {
    const qt_job_lora *l = &s->job->lora;
    s->lora_targets = l->targets;
    memset(&s->lora_sel, 0, sizeof s->lora_sel);
    s->lora_sel.lora = l->enabled;
    if (!l->enabled) return QT_OK;
    qt_config cfg;
    if (strict) {
        QT_TRY(qt_config_load(s->job->model, &cfg));
    } else if (qt_config_load(s->job->model, &cfg) != QT_OK) {
        qt_error_clear(); /* the model folder's own error is the plan's to report */
        return QT_OK;
    }
    /* the names against the model's layout, as the run resolves them (the original Qwen: c_attn); Qwen2
     * names on an original Qwen model (QT_MSG_QWEN1_TARGETS_FMT) stop the run before anything is loaded */
    QT_TRY(qt_job_lora_targets_resolve(s->job, &cfg, &s->lora_targets));
    return resolve_selection(s, &cfg);
}

int qt_run_setup_finalize(qt_run_setup *s, long max_steps) {
    QT_TRY(qt_ds_config_finalize(&s->ds, max_steps));
    qt_train_cfg_from_ds(&s->ds, &s->cfg);
    return QT_OK;
}

void qt_run_model_zero(const zero_opts *z, int world, int rank, qt_model_opts *o) {
    /* ZeRO-2 over several ranks: no gradient block, the backward hands each unit over */
    o->grad_windows = zero_partitions_grads(z->stage, world);
    o->grad_bucket_elems = z->bucket_elems; /* its buckets are reduce_bucket_size's */
    o->grad_overlap = z->overlap;
    /* ZeRO 1/2: each rank keeps its shard of the fp32 master (on the host with offload), as DeepSpeed does;
     * the model ignores it where the master is the compute weights (f32) or the adapter (LoRA) */
    if (zero_partitions_master(z->stage, world)) {
        o->master_shards = world;
        o->master_rank = rank;
        o->master_on_host = z->offload;
    }
    /* ZeRO-3: the weights the graph reads are partitioned too, gathered layer by layer at use (in f32 the
     * master shard is that partition, on the host where either offload puts it). LoRA: the frozen base is
     * what is partitioned; the adapter stays whole on every rank and takes stage 2's path (gradients
     * reduce-scattered, optimizer state sharded, the update all-gathered) */
    if (zero_partitions_params(z->stage, world)) {
        o->param_shards = world;
        o->param_on_host = z->offload_param;
        o->param_reuse_distance = z->reuse_distance;
        if (o->compute == QT_F32 && z->offload_param) o->master_on_host = 1;
    }
}

void qt_run_zero_from_model(const qt_model_opts *o, int hidden, size_t window_elems, zero_opts *z) {
    if (!o->grad_windows) return;
    z->unit_elems = window_elems;
    if (qt_opts_trains_embed(o)) { /* full fine-tuning, or modules_to_save's embedding */
        z->emb_rows = o->max_B * o->max_T;
        z->emb_dim = hidden;
    }
}

/* The job's "lora" and "quantization" with the selection resolved (after qt_run_setup_lora): the one filler
 * of the model's and the plan's adapter group. Without a "lora" section the LoRA fields keep what a holds
 * (the model's or the plan's defaults: the plan's "LoRA instead" alternative sizes those). */
static void setup_adapter(const qt_run_setup *s, qt_adapter_opts *a) {
    const qt_job *job = s->job;
    a->lora = job->lora.enabled;
    if (a->lora) {
        a->lora_r = job->lora.r;
        a->lora_alpha = job->lora.lora_alpha;
        a->lora_dropout = job->lora.lora_dropout;
        a->lora_targets = s->lora_targets;
        a->use_rslora = job->lora.use_rslora;
        a->lora_save = s->lora_sel.lora_save;
        a->lora_layers_set = s->lora_sel.lora_layers_set;
        memcpy(a->lora_layers, s->lora_sel.lora_layers, sizeof a->lora_layers);
    }
    a->quant4 = job->quant.load_in_4bit;
    a->quant4_type = job->quant.type;
    a->quant4_nested = job->quant.double_quant;
    a->quant4_skip = job->quant.skip;
}

int qt_run_setup_model_opts(const qt_run_setup *s, qt_model_opts *o) {
    const qt_job *job = s->job;
    qt_model_opts_default(o);
    o->compute = s->cfg.compute;
    setup_adapter(s, &o->adapter);
    if (o->quant4 && job->quant.compute_set && (qt_dtype)job->quant.compute != o->compute)
        return QT_ERR(QT_EINVAL, "%s: quantization.bnb_4bit_compute_dtype is %s but the run computes in %s (the "
                                 "DeepSpeed config's bf16/fp16); make them agree", job->path,
                      qt_dtype_name((qt_dtype)job->quant.compute), qt_dtype_name(o->compute));
    o->grad_checkpointing = job->train.gradient_checkpointing;
    o->max_B = s->cfg.micro_batch * (s->pref ? 2 : 1); /* preference: a chosen and a rejected row per pair */
    o->max_T = job->data.seq_len;
    o->seed = job->train.seed;
    qt_run_model_zero(&s->cfg.zero, s->world, s->rank, o);
    return QT_OK;
}

void qt_run_setup_plan_opts(const qt_run_setup *s, qt_plan_opts *o) {
    const qt_job *job = s->job;
    const qt_ds_config *ds = &s->ds;
    setup_adapter(s, &o->adapter);
    o->zero = ds->zero.stage;
    o->offload = ds->zero.offload_optimizer;
    o->offload_param = ds->zero.offload_param;
    o->reuse_distance = ds->zero.max_reuse_distance;
    o->devices = s->world;
    o->precision = s->cfg.compute;
    o->micro_batch = s->cfg.micro_batch;
    /* preference objectives: a micro-batch of B pairs is 2B rows (a chosen and a rejected one each); the
     * reference's forward (adapter off) reuses the same activations, so it adds time, not memory */
    if (s->pref) o->micro_batch *= 2;
    o->seq_len = job->data.seq_len;
    o->checkpointing = job->train.gradient_checkpointing;
    /* the buckets (a reduce_bucket_size of "auto" resolved from the model's hidden_size, as the run does) and
     * overlap the run uses: they size the gradient windows and the communication buffers */
    o->reduce_bucket = s->cfg.zero.bucket_elems;
    o->allgather_bucket = s->cfg.zero.allgather_bucket_elems;
    o->overlap = s->cfg.zero.overlap;
}

/* trainer.h's two readers of a whole job, each the setup's steps in order: the train config once max_steps is
 * known, and what `qtune plan JOB.json` plans for */
int qt_train_cfg_from_job(const qt_job *job, int world, long max_steps, qt_train_cfg *cfg) {
    qt_run_setup s;
    QT_TRY(qt_run_setup_open(&s, job, world, 0));
    QT_TRY(qt_run_setup_finalize(&s, max_steps));
    *cfg = s.cfg;
    return QT_OK;
}

int qt_plan_opts_from_job(const qt_job *job, int ranks, qt_plan_opts *o) {
    qt_run_setup s;
    QT_TRY(qt_run_setup_open(&s, job, ranks, 0));
    QT_TRY(qt_run_setup_lora(&s, 0));
    qt_run_setup_plan_opts(&s, o);
    return QT_OK;
}
