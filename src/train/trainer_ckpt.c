/* Checkpoints, resume and final outputs of the trainer.
 *
 * checkpoint-STEP/ holds:
 *   adapter_model.safetensors + adapter_config.json   (LoRA: a PEFT adapter)
 *   model.safetensors + config.json                   (full: fp32 master weights)
 *   optimizer.safetensors   exp_avg, exp_avg_sq: (n) fp32 each, the whole block
 *                           (gathered from the ZeRO shards, so any world size
 *                           or stage can resume it)
 *   trainer_state.json      step, applied updates (the scheduler's position),
 *                           loss-scaler state, each rank's data position, the
 *                           seed, elapsed time, the job fingerprint; written
 *                           last. */
#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "core/mem.h"
#include "io/checkpoint.h"
#include "io/model_folder.h"
#include "io/peft.h"
#include "io/safetensors.h"
#include "train/trainer_internal.h"

#include <cjson/cJSON.h>
#include <inttypes.h>
#include <math.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define STATE_MAX_BYTES (1u << 24)

/* ---------------------------------------------------------------------------
 * trainable weights by parameter name */

static void fill_peft_config(const qt_trainer *t, peft_config *c) {
    memset(c, 0, sizeof *c);
    const qt_job_lora *l = &t->job->lora;
    c->r = l->r;
    c->lora_alpha = l->lora_alpha;
    c->lora_dropout = l->lora_dropout;
    c->use_rslora = l->use_rslora;
    for (int i = 0; i < l->n_target_names && i < PEFT_MAX_TARGETS; i++)
        snprintf(c->target_modules[c->n_targets++], sizeof c->target_modules[0], "%s", l->target_names[i]);
    snprintf(c->base_model, sizeof c->base_model, "%s", t->job->model);
}

static int save_adapter(const qt_trainer *t, const char *dir) {
    peft_tensor *pt = qt_calloc((size_t)t->n_params, sizeof *pt, "adapter tensor list");
    if (!pt) return QT_ENOMEM;
    for (int i = 0; i < t->n_params; i++) {
        const qt_param *p = &t->params[i];
        pt[i].name = p->name;
        pt[i].shape[0] = p->shape[0];
        pt[i].shape[1] = p->ndim == 2 ? p->shape[1] : 1;
        pt[i].data = t->master + p->offset;
    }
    peft_config c;
    fill_peft_config(t, &c);
    int rc = peft_save(dir, &c, pt, t->n_params);
    qt_free(pt);
    return rc;
}

/* The master block as a model.safetensors in dtype, by Hugging Face names. */
static int save_model_weights(const qt_trainer *t, const char *path, qt_dtype dtype) {
    st_writer *w;
    QT_TRY(st_writer_new(&w));
    int rc = QT_OK;
    for (int i = 0; i < t->n_params && rc == QT_OK; i++) {
        const qt_param *p = &t->params[i];
        rc = st_writer_add(w, p->name, dtype, p->ndim, p->shape, t->master + p->offset, QT_F32);
    }
    if (rc == QT_OK) rc = st_writer_set_metadata(w, "format", "pt");
    if (rc == QT_OK) rc = st_writer_write(w, path);
    st_writer_free(w);
    return rc;
}

/* Reads every trainable tensor by name from a safetensors file or folder. */
static int load_params(qt_trainer *t, const char *path) {
    st_file *f;
    QT_TRY(st_open(path, &f));
    int rc = QT_OK;
    for (int i = 0; i < t->n_params && rc == QT_OK; i++) {
        const qt_param *p = &t->params[i];
        const st_tensor *st;
        rc = st_expect(f, p->name, p->ndim, p->shape, &st);
        if (rc == QT_OK) rc = st_read_f32(st, t->master + p->offset);
    }
    st_close(f);
    if (rc == QT_OK) qt_model_weights_updated(t->model);
    return rc;
}

int trainer_init_from_adapter(qt_trainer *t, const char *dir) {
    peft_config c;
    int rc = peft_config_load(dir, &c);
    if (rc != QT_OK) return qt_error_context(rc, "%s: lora.init_from", t->job->path);
    if (c.r != t->job->lora.r)
        return QT_ERR(QT_EINVAL, "%s: lora.r is %d but the adapter in lora.init_from (%s) has r = %d; make them equal",
                      t->job->path, t->job->lora.r, dir, c.r);
    if (c.lora_alpha != t->job->lora.lora_alpha || c.use_rslora != t->job->lora.use_rslora)
        qt_warn("lora.init_from %s was trained with lora_alpha %g%s; this job uses lora_alpha %g%s", dir,
                (double)c.lora_alpha, c.use_rslora ? " (rslora)" : "", (double)t->job->lora.lora_alpha,
                t->job->lora.use_rslora ? " (rslora)" : "");
    char path[4096];
    QT_TRY(qt_path_join(path, sizeof path, dir, "adapter_model.safetensors"));
    rc = load_params(t, path);
    if (rc != QT_OK) return qt_error_context(rc, "%s: lora.init_from", t->job->path);
    if (t->main) qt_info("LoRA weights start from the adapter in %s", dir);
    return QT_OK;
}

/* ---------------------------------------------------------------------------
 * trainer_state.json */

static char *state_json(const qt_trainer *t, const int64_t *data_pos) {
    cJSON *j = cJSON_CreateObject();
    if (!j) return NULL;
    char hex[32];
    snprintf(hex, sizeof hex, "%016" PRIx64, t->job->fingerprint);
    cJSON_AddNumberToObject(j, "format_version", 1);
    cJSON_AddNumberToObject(j, "step", (double)t->step);
    cJSON_AddNumberToObject(j, "max_steps", (double)t->max_steps);
    cJSON_AddNumberToObject(j, "applied_updates", (double)t->applied);
    cJSON_AddNumberToObject(j, "numel", (double)t->n);
    cJSON_AddBoolToObject(j, "lora", t->job->lora.enabled);
    cJSON_AddStringToObject(j, "fingerprint", hex);
    /* the job itself, so a later qtune recomputes the fingerprint its own way */
    cJSON_AddItemToObject(j, "job", cJSON_Duplicate(t->job->root, 1));
    cJSON_AddNumberToObject(j, "seed", (double)t->job->train.seed);
    /* the dropout-mask stream: masks are seeded from (seed, micro-step) */
    cJSON_AddNumberToObject(j, "rng_micro_step", (double)qt_model_micro_step(t->model));
    cJSON_AddNumberToObject(j, "elapsed_s", trainer_elapsed(t));
    cJSON_AddNumberToObject(j, "tokens_seen", (double)t->tokens_seen);
    cJSON_AddNumberToObject(j, "world", t->world);
    cJSON *sc = cJSON_AddObjectToObject(j, "loss_scaler");
    cJSON_AddNumberToObject(sc, "scale", t->scaler.scale);
    cJSON_AddNumberToObject(sc, "cur_iter", (double)t->scaler.cur_iter);
    cJSON_AddNumberToObject(sc, "last_overflow_iter", (double)t->scaler.last_overflow_iter);
    cJSON_AddNumberToObject(sc, "cur_hysteresis", t->scaler.cur_hysteresis);
    cJSON_AddNumberToObject(sc, "n_overflows", (double)t->scaler.n_overflows);
    cJSON *data = cJSON_AddArrayToObject(j, "data_position"); /* per rank: [epoch, index] */
    for (int r = 0; r < t->world; r++) {
        cJSON *p = cJSON_CreateArray();
        cJSON_AddItemToArray(p, cJSON_CreateNumber((double)data_pos[2 * r]));
        cJSON_AddItemToArray(p, cJSON_CreateNumber((double)data_pos[2 * r + 1]));
        cJSON_AddItemToArray(data, p);
    }
    char *s = cJSON_Print(j);
    cJSON_Delete(j);
    return s;
}

/* A whole number from the state file, range-checked. */
static int state_i64(const cJSON *o, const char *key, int64_t lo, int64_t *out, const char *path) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(it) || it->valuedouble != floor(it->valuedouble) || it->valuedouble < (double)lo ||
        it->valuedouble > 9e15)
        return QT_ERR(QT_EFORMAT, "%s: \"%s\" is missing or not a whole number >= %lld; the checkpoint is damaged",
                      path, key, (long long)lo);
    *out = (int64_t)it->valuedouble;
    return QT_OK;
}

/* ---------------------------------------------------------------------------
 * save */

/* While rank 0 writes (minutes for a large model), the other ranks wait in a
 * collective: its deadline is raised for the save so that a slow disk is not
 * taken for a dead rank. */
#define SAVE_TIMEOUT_S (4.0 * 3600.0)

static int save_checkpoint(qt_trainer *t);

int trainer_save_checkpoint(qt_trainer *t) {
    double to = dist_timeout(t->d);
    if (to < SAVE_TIMEOUT_S) dist_set_timeout(t->d, SAVE_TIMEOUT_S);
    int rc = save_checkpoint(t);
    dist_set_timeout(t->d, to);
    return rc;
}

static int save_checkpoint(qt_trainer *t) {
    /* collective parts first: every rank takes part */
    int64_t *pos = qt_calloc((size_t)t->world * 2, sizeof(int64_t), "data positions");
    if (!pos) return QT_ENOMEM;
    dl_state ds = dl_state_get(t->train_dl);
    const int64_t mine[2] = {ds.epoch, ds.index};
    int rc = dist_allgather_i64(t->d, mine, 2, pos, "data positions");
    float *m = NULL, *v = NULL;
    if (rc == QT_OK && t->main) {
        m = qt_alloc_aligned((t->n ? t->n : 1) * sizeof(float), "Adam m for the checkpoint");
        v = qt_alloc_aligned((t->n ? t->n : 1) * sizeof(float), "Adam v for the checkpoint");
        if (!m || !v) rc = QT_ENOMEM;
    }
    int64_t ok = rc == QT_OK;
    if (t->world > 1) {
        int r2 = dist_allreduce_i64(t->d, &ok, 1, DIST_MIN, "checkpoint allocation");
        if (rc == QT_OK) rc = r2;
    }
    if (rc == QT_OK && !ok) rc = QT_ERR(QT_ENOMEM, "rank 0 could not allocate the checkpoint buffers");
    if (rc == QT_OK) rc = zero_state_gather(t->zp, &t->zs, 0, m);
    if (rc == QT_OK) rc = zero_state_gather(t->zp, &t->zs, 1, v);

    if (rc == QT_OK && t->main) {
        ckpt_writer w;
        rc = ckpt_begin(&w, t->job->output_dir, t->step);
        char path[4096];
        if (rc == QT_OK) {
            if (t->job->lora.enabled) {
                rc = save_adapter(t, w.dir);
            } else {
                rc = qt_path_join(path, sizeof path, w.dir, "model.safetensors");
                if (rc == QT_OK) rc = save_model_weights(t, path, QT_F32);
                char src[4096], dst[4096];
                if (rc == QT_OK) rc = qt_path_join(src, sizeof src, t->job->model, "config.json");
                if (rc == QT_OK) rc = qt_path_join(dst, sizeof dst, w.dir, "config.json");
                if (rc == QT_OK && qt_path_exists(src)) rc = qt_copy_file(src, dst);
            }
        }
        if (rc == QT_OK) rc = qt_path_join(path, sizeof path, w.dir, "optimizer.safetensors");
        if (rc == QT_OK) {
            st_writer *sw;
            rc = st_writer_new(&sw);
            int64_t shape[1] = {(int64_t)t->n};
            if (rc == QT_OK) rc = st_writer_add(sw, "exp_avg", QT_F32, 1, shape, m, QT_F32);
            if (rc == QT_OK) rc = st_writer_add(sw, "exp_avg_sq", QT_F32, 1, shape, v, QT_F32);
            if (rc == QT_OK) rc = st_writer_write(sw, path);
            st_writer_free(sw);
        }
        if (rc == QT_OK) {
            char *s = state_json(t, pos);
            if (!s) rc = QT_ERR(QT_ENOMEM, "out of memory writing %s", CKPT_STATE_FILE);
            if (rc == QT_OK) rc = qt_path_join(path, sizeof path, w.dir, CKPT_STATE_FILE);
            if (rc == QT_OK) rc = qt_write_file_atomic(path, s, strlen(s));
            free(s);
        }
        if (rc == QT_OK) rc = ckpt_commit(&w);
        else ckpt_abort(&w);
        if (rc == QT_OK) {
            snprintf(t->last_ckpt, sizeof t->last_ckpt, "%s", w.final);
            rc = ckpt_prune(t->job->output_dir, t->job->train.save_total_limit, t->step);
        }
    }
    qt_free(m);
    qt_free(v);
    qt_free(pos);
    /* every rank learns whether rank 0 succeeded */
    int64_t good = rc == QT_OK;
    if (t->world > 1) {
        int r2 = dist_allreduce_i64(t->d, &good, 1, DIST_MIN, "checkpoint written");
        if (rc == QT_OK && r2 != QT_OK) rc = r2;
        if (rc == QT_OK && !good) rc = QT_ERR(QT_EIO, "rank 0 could not write the checkpoint of step %ld", t->step);
        if (rc == QT_OK) {
            char name[64];
            snprintf(name, sizeof name, "checkpoint-%ld", t->step);
            qt_path_join(t->last_ckpt, sizeof t->last_ckpt, t->job->output_dir, name);
        }
    }
    if (rc == QT_OK && t->main) qt_debug("saved %s", t->last_ckpt);
    return rc;
}

/* ---------------------------------------------------------------------------
 * resume */

static int load_state(qt_trainer *t, const char *dir, int64_t *data_pos) {
    char path[4096];
    QT_TRY(qt_path_join(path, sizeof path, dir, CKPT_STATE_FILE));
    char *text;
    QT_TRY(qt_read_file(path, STATE_MAX_BYTES, &text, NULL));
    cJSON *j = cJSON_Parse(text);
    qt_free(text);
    int rc = QT_OK;
    int64_t step = 0, applied = 0, numel = 0, tokens = 0, world = 1, micro = 0;
    if (!cJSON_IsObject(j)) rc = QT_ERR(QT_EFORMAT, "%s is not a JSON object; the checkpoint is damaged", path);
    if (rc == QT_OK) rc = state_i64(j, "step", 0, &step, path);
    if (rc == QT_OK) rc = state_i64(j, "applied_updates", 0, &applied, path);
    if (rc == QT_OK) rc = state_i64(j, "numel", 0, &numel, path);
    if (rc == QT_OK) rc = state_i64(j, "tokens_seen", 0, &tokens, path);
    if (rc == QT_OK) rc = state_i64(j, "world", 1, &world, path);
    if (rc == QT_OK) rc = state_i64(j, "rng_micro_step", 0, &micro, path);
    /* the run that wrote the checkpoint recorded its job beside it: name what differs */
    char diff[1024] = "", parent[4096];
    qt_path_dirname(parent, sizeof parent, dir);
    if (rc == QT_OK) qt_output_dir_job_difference(parent, t->job, diff, sizeof diff);
    if (rc == QT_OK && (size_t)numel != t->n)
        rc = QT_ERR(QT_EINVAL, "%s holds %lld trainable values but this job's model has %zu; it is another run's checkpoint%s%s%s",
                    path, (long long)numel, t->n, diff[0] ? " (its job differs in " : "", diff, diff[0] ? ")" : "");
    const cJSON *fp = cJSON_GetObjectItemCaseSensitive(j, "fingerprint");
    char hex[32];
    snprintf(hex, sizeof hex, "%016" PRIx64, t->job->fingerprint);
    const cJSON *sjob = cJSON_GetObjectItemCaseSensitive(j, "job");
    int same = cJSON_IsObject(sjob) ? qt_job_fingerprint_of(sjob) == t->job->fingerprint
                                    : cJSON_IsString(fp) && !strcmp(fp->valuestring, hex);
    if (rc == QT_OK && !same)
        rc = QT_ERR(QT_EINVAL,
                    "%s was written by a different job (%s%s); resume it with the job that wrote it, or set "
                    "train.resume to \"never\"",
                    dir, diff[0] ? "it differs in " : "model, data, LoRA or DeepSpeed settings differ", diff);
    const cJSON *sc = cJSON_GetObjectItemCaseSensitive(j, "loss_scaler");
    int64_t cur_iter = 0, last_ovf = -1, hyst = 0, novf = 0;
    if (rc == QT_OK) rc = state_i64(sc, "cur_iter", 0, &cur_iter, path);
    if (rc == QT_OK) rc = state_i64(sc, "last_overflow_iter", -1, &last_ovf, path);
    if (rc == QT_OK) rc = state_i64(sc, "cur_hysteresis", 0, &hyst, path);
    if (rc == QT_OK) rc = state_i64(sc, "n_overflows", 0, &novf, path);
    const cJSON *scale = cJSON_GetObjectItemCaseSensitive(sc, "scale");
    if (rc == QT_OK && !(cJSON_IsNumber(scale) && scale->valuedouble > 0 && isfinite(scale->valuedouble)))
        rc = QT_ERR(QT_EFORMAT, "%s: loss_scaler.scale must be a positive number; the checkpoint is damaged", path);
    const cJSON *el = cJSON_GetObjectItemCaseSensitive(j, "elapsed_s");
    const cJSON *dp = cJSON_GetObjectItemCaseSensitive(j, "data_position");
    if (rc == QT_OK && !(cJSON_IsArray(dp) && cJSON_GetArraySize(dp) == (int)world))
        rc = QT_ERR(QT_EFORMAT, "%s: data_position must list one [epoch, index] per rank", path);
    if (rc == QT_OK) {
        if (world != t->world)
            qt_warn("%s was written by %lld rank(s) and this run has %d: weights and optimizer state resume exactly, "
                    "the data order restarts from the same epoch position of rank 0",
                    dir, (long long)world, t->world);
        int r = world == t->world ? t->rank : 0;
        const cJSON *p = cJSON_GetArrayItem(dp, r);
        const cJSON *e = cJSON_GetArrayItem(p, 0), *ix = cJSON_GetArrayItem(p, 1);
        if (!cJSON_IsNumber(e) || !cJSON_IsNumber(ix) || !(e->valuedouble >= 0 && e->valuedouble < 9e15) ||
            !(ix->valuedouble >= 0 && ix->valuedouble < 9e15) || e->valuedouble != floor(e->valuedouble) ||
            ix->valuedouble != floor(ix->valuedouble))
            rc = QT_ERR(QT_EFORMAT, "%s: data_position[%d] must be [epoch, index]", path, r);
        else {
            data_pos[0] = (int64_t)e->valuedouble;
            data_pos[1] = world == t->world ? (int64_t)ix->valuedouble : 0;
        }
    }
    if (rc == QT_OK) {
        t->step = (long)step;
        t->applied = applied;
        t->tokens_seen = tokens;
        t->elapsed_before = cJSON_IsNumber(el) ? el->valuedouble : 0;
        qt_model_set_micro_step(t->model, (uint64_t)micro);
        if (t->cfg.fp16) {
            t->scaler.scale = scale->valuedouble;
            t->scaler.cur_iter = cur_iter;
            t->scaler.last_overflow_iter = last_ovf;
            t->scaler.cur_hysteresis = (int)hyst;
            t->scaler.n_overflows = novf;
        }
    }
    cJSON_Delete(j);
    return rc;
}

static int load_checkpoint(qt_trainer *t, const char *dir);

int trainer_load_checkpoint(qt_trainer *t, const char *dir) {
    double to = dist_timeout(t->d);
    if (to < SAVE_TIMEOUT_S) dist_set_timeout(t->d, SAVE_TIMEOUT_S); /* rank 0 reads while the others wait */
    int rc = load_checkpoint(t, dir);
    dist_set_timeout(t->d, to);
    return rc;
}

static int load_checkpoint(qt_trainer *t, const char *dir) {
    int64_t pos[2] = {0, 0};
    int rc = load_state(t, dir, pos);
    char path[4096];
    if (rc == QT_OK)
        rc = qt_path_join(path, sizeof path, dir, t->job->lora.enabled ? "adapter_model.safetensors" : "model.safetensors");
    if (rc == QT_OK) rc = load_params(t, path);
    float *m = NULL, *v = NULL;
    if (rc == QT_OK && t->main) {
        m = qt_alloc_aligned((t->n ? t->n : 1) * sizeof(float), "Adam m from the checkpoint");
        v = qt_alloc_aligned((t->n ? t->n : 1) * sizeof(float), "Adam v from the checkpoint");
        if (!m || !v) rc = QT_ENOMEM;
        if (rc == QT_OK) rc = qt_path_join(path, sizeof path, dir, "optimizer.safetensors");
        if (rc == QT_OK) {
            st_file *f;
            rc = st_open(path, &f);
            int64_t shape[1] = {(int64_t)t->n};
            const st_tensor *a = NULL, *b = NULL;
            if (rc == QT_OK) {
                rc = st_expect(f, "exp_avg", 1, shape, &a);
                if (rc == QT_OK) rc = st_expect(f, "exp_avg_sq", 1, shape, &b);
                if (rc == QT_OK) rc = st_read_f32(a, m);
                if (rc == QT_OK) rc = st_read_f32(b, v);
                st_close(f);
            }
        }
    }
    /* every rank must agree before the collective scatter */
    int64_t ok = rc == QT_OK;
    if (t->world > 1) {
        int r2 = dist_allreduce_i64(t->d, &ok, 1, DIST_MIN, "checkpoint load");
        if (r2 != QT_OK && rc == QT_OK) rc = r2;
        if (rc == QT_OK && !ok) rc = QT_ERR(QT_EIO, "another rank could not read the checkpoint %s", dir);
    }
    if (rc == QT_OK) rc = zero_state_scatter(t->zp, &t->zs, 0, m);
    if (rc == QT_OK) rc = zero_state_scatter(t->zp, &t->zs, 1, v);
    qt_free(m);
    qt_free(v);
    if (rc == QT_OK) rc = dl_state_set(t->train_dl, (dl_state){pos[0], pos[1]});
    if (rc != QT_OK) return qt_error_context(rc, "resuming from %s", dir);
    return QT_OK;
}

/* ---------------------------------------------------------------------------
 * final/ */

/* the source model's config.json as it is, then its tokenizer files */
static int copy_model_files(const char *src_dir, const char *dst_dir) {
    char s[4096], d[4096];
    QT_TRY(qt_path_join(s, sizeof s, src_dir, "config.json"));
    QT_TRY(qt_path_join(d, sizeof d, dst_dir, "config.json"));
    if (qt_path_exists(s)) QT_TRY(qt_copy_file(s, d));
    return qt_model_copy_side_files(src_dir, dst_dir);
}

static int write_final(qt_trainer *t, char *final_dir, size_t cap);

int trainer_write_final(qt_trainer *t, char *final_dir, size_t cap) {
    double to = dist_timeout(t->d);
    if (to < SAVE_TIMEOUT_S) dist_set_timeout(t->d, SAVE_TIMEOUT_S);
    int rc = write_final(t, final_dir, cap);
    /* the other ranks wait here while rank 0 writes */
    int64_t ok = rc == QT_OK;
    if (t->world > 1) {
        int r2 = dist_allreduce_i64(t->d, &ok, 1, DIST_MIN, "final outputs");
        if (rc == QT_OK && r2 != QT_OK) rc = r2;
        if (rc == QT_OK && !ok) rc = QT_ERR(QT_EIO, "rank 0 could not write final/");
    }
    dist_set_timeout(t->d, to);
    return rc;
}

static int write_final(qt_trainer *t, char *final_dir, size_t cap) {
    final_dir[0] = 0;
    if (!t->main) return QT_OK;
    char fin[4096], tmp[4200];
    QT_TRY(qt_path_join(fin, sizeof fin, t->job->output_dir, "final"));
    snprintf(tmp, sizeof tmp, "%s.tmp", fin);
    QT_TRY(qt_rm_rf(tmp));
    QT_TRY(qt_mkdir_p(tmp));
    int rc;
    if (t->job->lora.enabled) {
        rc = save_adapter(t, tmp);
    } else {
        rc = copy_model_files(t->job->model, tmp);
        char path[4300];
        snprintf(path, sizeof path, "%s/model.safetensors", tmp);
        if (rc == QT_OK) rc = save_model_weights(t, path, qt_model_config(t->model)->torch_dtype);
    }
    /* same as checkpoints: a complete final/ at every instant */
    if (rc == QT_OK) rc = qt_fsync_dir(tmp);
    if (rc == QT_OK) rc = qt_dir_replace(tmp, fin);
    if (rc != QT_OK) qt_rm_rf(tmp);
    if (rc == QT_OK) {
        snprintf(final_dir, cap, "%s", fin);
        qt_info("wrote %s (%s)", fin, t->job->lora.enabled ? "PEFT adapter" : "model folder");
    }
    return rc;
}
