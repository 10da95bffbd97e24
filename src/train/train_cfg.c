/* The DeepSpeed section as the training loop uses it. */
#include "core/error.h"
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
    cfg->steps_per_print = ds->steps_per_print > 0 ? ds->steps_per_print : 10;
}

int qt_train_cfg_from_job(const qt_job *job, int world, long max_steps, qt_train_cfg *cfg) {
    qt_ds_config ds;
    if (job->deepspeed) {
        char where[4200];
        if (job->deepspeed_path) snprintf(where, sizeof where, "%s", job->deepspeed_path);
        else snprintf(where, sizeof where, "%s: deepspeed", job->path);
        QT_TRY(qt_ds_config_parse(job->deepspeed, where, world, &ds));
    } else {
        qt_ds_config_default(&ds, world);
    }
    QT_TRY(qt_ds_config_finalize(&ds, max_steps));
    qt_train_cfg_from_ds(&ds, cfg);
    return QT_OK;
}
