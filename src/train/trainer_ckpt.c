/* Checkpoints, resume and final outputs of the trainer.
 *
 * checkpoint-STEP/ holds:
 *   adapter_model.safetensors + adapter_config.json   (LoRA: a PEFT adapter)
 *   model.safetensors + config.json                   (full: fp32 master weights)
 *   optimizer-IIIII-of-CCCCC.safetensors
 *                           exp_avg, exp_avg_sq: (hi - lo) fp32 each, elements
 *                           [lo, hi) of the flat block; written by rank I
 *                           itself (its ZeRO shard; at stage 0 rank 0 writes
 *                           the one part), so no rank ever holds the whole
 *                           state. Any world size or stage resumes it: each
 *                           rank reads the slices of its own range. Before
 *                           format 2 one optimizer.safetensors held the whole
 *                           block; such checkpoints still resume.
 *   trainer_state.json      step, applied updates (the scheduler's position),
 *                           loss-scaler state, each rank's data position, the
 *                           seed, elapsed time, the job fingerprint, the world
 *                           size and the optimizer parts with their ranges;
 *                           written last, by rank 0, once every rank wrote
 *                           its part. */
#include "core/fault.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "core/mem.h"
#include "io/checkpoint.h"
#include "io/model_folder.h"
#include "io/peft.h"
#include "io/safetensors.h"
#include "model/params_io.h"
#include "model/lora_io.h"
#include "train/trainer_state.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define STATE_MAX_BYTES (1u << 24)

/* optimizer state: one file per writing rank (see save_opt_part), or the
 * gathered single file of checkpoints written before that (format_version 1) */
#define OPT_PART_FMT "optimizer-%05d-of-%05d.safetensors"
#define OPT_LEGACY_FILE "optimizer.safetensors"
#define OPT_MAX_PARTS 65536
/* trainer_state.json's format_version: the one written, and the oldest read
 * (1: the gathered optimizer.safetensors, before the sharded parts of 2) */
#define CKPT_FORMAT_VERSION 2
#define CKPT_FORMAT_OLDEST 1
static const char *const opt_meta_keys[5] = {"part", "parts", "range_lo", "range_hi", "numel"};

/* ---------------------------------------------------------------------------
 * trainable weights by parameter name */

static void fill_peft_config(const qt_trainer *t, peft_config *c) {
    memset(c, 0, sizeof *c);
    const qt_job_lora *l = &t->job->lora;
    c->r = l->r;
    c->lora_alpha = l->lora_alpha;
    c->lora_dropout = l->lora_dropout;
    c->use_rslora = l->use_rslora;
    if (l->targets_default || l->targets_all_linear) { /* as resolved: c_attn on the original Qwen, its own names */
        char names[8][64];
        int n = qt_lora_target_names(qt_model_config(t->model), t->setup.lora_targets, names, 8);
        for (int i = 0; i < n; i++) memcpy(c->target_modules[c->n_targets++], names[i], sizeof names[i]);
    }
    for (int i = 0; i < l->n_target_names && i < PEFT_MAX_TARGETS && !l->targets_default && !l->targets_all_linear; i++)
        snprintf(c->target_modules[c->n_targets++], sizeof c->target_modules[0], "%s", l->target_names[i]);
    peft_base_model_name(t->job->model, c->base_model, sizeof c->base_model);
    /* modules_to_save, layers_to_transform and layers_pattern as the job wrote them */
    const peft_config *x = &l->extras;
    c->n_save = x->n_save;
    memcpy(c->modules_to_save, x->modules_to_save, sizeof c->modules_to_save);
    c->n_layers = x->n_layers;
    c->layers_int = x->layers_int;
    memcpy(c->layers_to_transform, x->layers_to_transform, sizeof c->layers_to_transform);
    c->n_patterns = x->n_patterns;
    c->patterns_list = x->patterns_list;
    memcpy(c->layers_pattern, x->layers_pattern, sizeof c->layers_pattern);
}

static int save_adapter(const qt_trainer *t, const char *dir) {
    peft_tensor *pt = qt_calloc((size_t)t->n_params, sizeof *pt, "adapter tensor list");
    if (!pt) return QT_ENOMEM;
    qt_model_peft_tensors(t->model, pt);
    peft_config c;
    fill_peft_config(t, &c);
    int rc = peft_save(dir, &c, pt, t->n_params);
    qt_free(pt);
    return rc;
}

/* ---------------------------------------------------------------------------
 * a sharded master, written by rank 0: the writer's reads of other ranks'
 * elements are gathers every rank takes part in. Rank 0 announces each range
 * (its lo and length), and an empty range when it is done, whatever happened;
 * the other ranks serve announced ranges until then. */

static int announce(qt_trainer *t, size_t lo, size_t n) {
    uint64_t req[2] = {lo, n};
    return dist_bcast(t->d, req, sizeof req, 0, "sharded weights write");
}

int trainer_gather_master(void *user, float *dst, size_t lo, size_t n) {
    qt_trainer *t = user;
    qt_fault_point("announce", t->rank);
    QT_TRY(announce(t, lo, n));
    qt_fault_point("gather", t->rank);
    return zero_gather_range(t->zp, t->master, lo, lo + n, dst);
}

static int gathers_done(qt_trainer *t) {
    if (!t->sharded || !t->main) return QT_OK;
    qt_fault_point("gathers-done", t->rank);
    return announce(t, 0, 0);
}

static int serve_gathers(qt_trainer *t) {
    if (!t->sharded || t->main) return QT_OK;
    for (;;) {
        uint64_t req[2];
        qt_fault_point("serve-wait", t->rank);
        QT_TRY(dist_bcast(t->d, req, sizeof req, 0, "sharded weights write"));
        if (req[1] == 0) return QT_OK;
        qt_fault_point("serve", t->rank);
        if (req[0] > t->n || req[1] > t->n - req[0])
            return QT_ERR(QT_EINVAL, "rank %d: rank 0 asked for elements [%llu, +%llu) of a block of %zu (a bug)",
                          t->rank, (unsigned long long)req[0], (unsigned long long)req[1], t->n);
        QT_TRY(zero_gather_range(t->zp, t->master, req[0], req[0] + req[1], NULL));
    }
}

/* The master block as a model.safetensors in dtype, by Hugging Face names. */
static int save_model_weights(const qt_trainer *t, const char *path, qt_dtype dtype) {
    st_writer *w;
    QT_TRY(st_writer_new(&w));
    int rc = qt_model_write_params(t->model, w, dtype);
    if (rc == QT_OK) rc = st_writer_set_metadata(w, "format", "pt");
    if (rc == QT_OK) rc = st_writer_write(w, path);
    st_writer_free(w);
    return rc;
}

/* Reads every trainable tensor by name from a safetensors file or folder.
 * saved_optional (lora.init_from): a modules_to_save weight the adapter does
 * not hold keeps the base model's value, as PEFT's wrapper starts from it. */
static int load_params(qt_trainer *t, const char *path, int saved_optional) {
    st_file *f = NULL;
    int rc = st_open(path, &f);
    for (int i = 0; i < t->n_params && rc == QT_OK; i++) {
        const qt_param *p = &t->params[i];
        const st_tensor *st_t;
        if (saved_optional && !st_find(f, p->name) && !strstr(p->name, ".lora_")) {
            if (t->main) qt_info("%s has no %s; it starts from the base model's weight", path, p->name);
            continue;
        }
        rc = st_expect(f, p->name, p->ndim, p->shape, &st_t);
        if (rc == QT_OK) rc = qt_model_read_param(t->model, i, st_t);
    }
    /* NaN or inf weights would train on in silence until the loss turns NaN. Sharded, each rank checks its
     * own range and all learn the first bad element, so every rank names the tensor (every rank takes part
     * in that collective, whatever happened above) */
    size_t at = 0;
    int64_t bad = (int64_t)t->n;
    if (rc == QT_OK && trainer_find_bad(t, t->master, t->sharded ? t->hi - t->lo : t->n, 0, &at))
        bad = (int64_t)(trainer_master_lo(t) + at);
    if (t->sharded) {
        int r2 = dist_allreduce_i64(t->d, &bad, 1, DIST_MIN, "checkpoint weights check");
        if (rc == QT_OK) rc = r2;
    }
    if (rc == QT_OK && bad < (int64_t)t->n)
        rc = QT_ERR(QT_EFORMAT, "%s: tensor %s holds NaN or infinite values; the file is damaged", path,
                    trainer_param_at(t, (size_t)bad));
    /* a tensor this model has no parameter for would be dropped in silence */
    const st_tensor *extra = rc == QT_OK ? st_first_unused(f) : NULL;
    if (extra)
        rc = QT_ERR(QT_EFORMAT, "%s holds the tensor %s, which this job's model does not have; the file belongs to "
                    "another model or LoRA setting", path, extra->name);
    if (f) st_close(f);
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
    rc = load_params(t, path, 1);
    if (rc != QT_OK) return qt_error_context(rc, "%s: lora.init_from", t->job->path);
    if (t->main) qt_info("LoRA weights start from the adapter in %s", dir);
    return QT_OK;
}

/* ---------------------------------------------------------------------------
 * trainer_state.json */

/* Element range of part i of count (zero_ckpt_part's layout). */
static void opt_part_range(const qt_trainer *t, int i, int count, size_t *lo, size_t *hi) {
    if (count == 1) {
        *lo = 0;
        *hi = t->n;
    } else {
        zero_shard_of(t->zp, i, lo, hi);
    }
}

static char *state_json(const qt_trainer *t, const int64_t *data_pos, int opt_parts) {
    cJSON *j = cJSON_CreateObject();
    if (!j) return NULL;
    char hex[32];
    snprintf(hex, sizeof hex, "%016" PRIx64, t->job->fingerprint);
    cJSON_AddNumberToObject(j, "format_version", CKPT_FORMAT_VERSION);
    cJSON_AddNumberToObject(j, "step", (double)t->step);
    cJSON_AddNumberToObject(j, "max_steps", (double)t->max_steps);
    cJSON_AddNumberToObject(j, "applied_updates", (double)t->opt.n_updates);
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
    cJSON_AddItemToObject(j, "loss_scaler", qt_loss_scaler_state_json(&t->opt.scaler)); /* optim's one format */
    cJSON *data = cJSON_AddArrayToObject(j, "data_position"); /* per rank: [epoch, index] */
    for (int r = 0; r < t->world; r++) {
        cJSON *p = cJSON_CreateArray();
        cJSON_AddItemToArray(p, cJSON_CreateNumber((double)data_pos[2 * r]));
        cJSON_AddItemToArray(p, cJSON_CreateNumber((double)data_pos[2 * r + 1]));
        cJSON_AddItemToArray(data, p);
    }
    /* the optimizer state's files: part i holds elements [lo, hi) of the block */
    cJSON *opt = cJSON_AddObjectToObject(j, "optimizer");
    cJSON_AddNumberToObject(opt, "numel", (double)t->n);
    cJSON *files = cJSON_AddArrayToObject(opt, "parts");
    for (int i = 0; i < opt_parts; i++) {
        size_t lo, hi;
        opt_part_range(t, i, opt_parts, &lo, &hi);
        char name[64];
        snprintf(name, sizeof name, OPT_PART_FMT, i, opt_parts);
        cJSON *f = cJSON_CreateObject();
        cJSON_AddStringToObject(f, "file", name);
        cJSON_AddNumberToObject(f, "lo", (double)lo);
        cJSON_AddNumberToObject(f, "hi", (double)hi);
        cJSON_AddItemToArray(files, f);
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

/* The checkpoint's format_version, before anything else is read: another
 * format's fields may mean other things. A version newer than this qtune's
 * (written by a later qtune), or a missing, non-integer or out-of-range one,
 * is refused with the value found, so nothing is read from the folder and
 * nothing is written to it. */
static int state_format(const cJSON *j, const char *path, int *version) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(j, "format_version");
    char found[64];
    if (!it) snprintf(found, sizeof found, "missing");
    else if (cJSON_IsNumber(it)) {
        snprintf(found, sizeof found, "%.15g", it->valuedouble); /* 1e+300, not 1.0000000000000001e+300 */
        if (strtod(found, NULL) != it->valuedouble) snprintf(found, sizeof found, "%.17g", it->valuedouble);
    } else if (cJSON_IsString(it)) {
        /* a short, printable prefix of a string: it comes from the file */
        size_t k = 0;
        found[k++] = '"';
        for (const char *c = it->valuestring; *c && k < 34; c++)
            found[k++] = (unsigned char)*c >= 0x20 && (unsigned char)*c < 0x7f ? *c : '?';
        snprintf(found + k, sizeof found - k, "%s\" (a string)", strlen(it->valuestring) > 33 ? "..." : "");
    } else snprintf(found, sizeof found, "not a number");
    const int whole = cJSON_IsNumber(it) && it->valuedouble == floor(it->valuedouble);
    if (whole && it->valuedouble > CKPT_FORMAT_VERSION && it->valuedouble <= INT_MAX)
        return QT_ERR(QT_EUNSUPPORTED,
                      "%s has checkpoint format_version %s, written by a newer qtune, but this qtune reads formats %d "
                      "to %d; resume it with the qtune that wrote it, or set train.resume to \"never\" to start over "
                      "(the checkpoint is left as it is)",
                      path, found, CKPT_FORMAT_OLDEST, CKPT_FORMAT_VERSION);
    if (!whole || it->valuedouble < CKPT_FORMAT_OLDEST || it->valuedouble > CKPT_FORMAT_VERSION)
        return QT_ERR(QT_EFORMAT,
                      "%s: \"format_version\" is %s, but this qtune reads checkpoint formats %d to %d (whole numbers); "
                      "the checkpoint is damaged or not qtune's: resume from another checkpoint, or set train.resume "
                      "to \"never\" to start over (the checkpoint is left as it is)",
                      path, found, CKPT_FORMAT_OLDEST, CKPT_FORMAT_VERSION);
    *version = (int)it->valuedouble;
    return QT_OK;
}

/* ---------------------------------------------------------------------------
 * save */

/* While rank 0 writes (minutes for a large model), the other ranks wait in a
 * collective: the deadline of a save, a load or final/ is the user's timeout
 * plus the bytes the busiest rank moves at a slow disk's rate (rank 0: the
 * fp32 weights and its part of m and v; 16 MiB for trainer_state.json and
 * the model's side files), so a slow disk is not taken for a dead rank and a
 * stalled one is still named. */
static double io_timeout(const qt_trainer *t) {
    int index, count;
    size_t lo, hi, s0 = 0, s1 = t->n;
    zero_ckpt_part(t->zp, &index, &count, &lo, &hi);
    if (count > 1) zero_shard_of(t->zp, 0, &s0, &s1);
    double bytes = 4.0 * (double)t->n + 8.0 * (double)(s1 - s0) + 16.0 * (1 << 20);
    return dist_phase_timeout(t->d, bytes, DIST_DISK_FLOOR_BPS);
}

static int save_checkpoint(qt_trainer *t);

int trainer_save_checkpoint(qt_trainer *t) {
    double to = dist_timeout(t->d);
    dist_set_timeout(t->d, io_timeout(t));
    int rc = save_checkpoint(t);
    dist_set_timeout(t->d, to);
    return rc;
}

/* Adam's m and v are the backend's device memory: written through producers
 * that download a chunk at a time as the writer streams, read through a host
 * staging buffer and upload. */
typedef struct {
    qt_backend *be;
    const float *dev;
} dev_source;

static int fill_from_device(void *ctx, float *dst, size_t offset, size_t n) {
    const dev_source *s = ctx;
    qt_be_download(s->be, dst, s->dev + offset, sizeof(float) * n);
    return QT_OK;
}

#define STAGE_FLOATS ((size_t)1 << 20)
static int read_range_to_device(qt_backend *be, const st_tensor *t, size_t off, size_t n, float *dev) {
    size_t chunk = n < STAGE_FLOATS ? n : STAGE_FLOATS;
    float *stage = qt_malloc(sizeof(float) * (chunk ? chunk : 1), "checkpoint staging buffer");
    if (!stage) return QT_ENOMEM;
    int rc = QT_OK;
    for (size_t k = 0; k < n && rc == QT_OK; k += chunk) {
        size_t c = n - k < chunk ? n - k : chunk;
        rc = st_read_f32_range(t, off + k, c, stage);
        if (rc == QT_OK) qt_be_upload(be, dev + k, stage, sizeof(float) * c);
    }
    qt_free(stage);
    return rc;
}

/* This rank's part of Adam's m and v as optimizer-IIIII-of-CCCCC.safetensors
 * in dir: exp_avg and exp_avg_sq of shape (hi - lo), written straight from the
 * rank's own state (no copy, no collective). The metadata records the part and
 * its range so that a reader can check the file on its own. */
static int save_opt_part(qt_trainer *t, const char *dir, int index, int count, size_t lo, size_t hi) {
    float *m, *v;
    QT_TRY(zero_state_view(t->zp, &t->zs, 0, &m));
    QT_TRY(zero_state_view(t->zp, &t->zs, 1, &v));
    /* the rank's state covers zero_opt_range; the part may be a sub-range of
     * it (stage 0: [0, n) on every rank, only rank 0 writes) */
    m += lo - t->zs.lo;
    v += lo - t->zs.lo;
    char name[64], path[4096];
    snprintf(name, sizeof name, OPT_PART_FMT, index, count);
    QT_TRY(qt_path_join(path, sizeof path, dir, name));
    st_writer *sw;
    QT_TRY(st_writer_new(&sw));
    int64_t shape[1] = {(int64_t)(hi - lo)};
    char num[5][32];
    snprintf(num[0], sizeof num[0], "%d", index);
    snprintf(num[1], sizeof num[1], "%d", count);
    snprintf(num[2], sizeof num[2], "%zu", lo);
    snprintf(num[3], sizeof num[3], "%zu", hi);
    snprintf(num[4], sizeof num[4], "%zu", t->n);
    dev_source src[2] = {{t->be, m}, {t->be, v}};
    int rc = st_writer_add_fn(sw, "exp_avg", QT_F32, 1, shape, fill_from_device, &src[0]);
    if (rc == QT_OK) rc = st_writer_add_fn(sw, "exp_avg_sq", QT_F32, 1, shape, fill_from_device, &src[1]);
    for (int i = 0; i < 5 && rc == QT_OK; i++) rc = st_writer_set_metadata(sw, opt_meta_keys[i], num[i]);
    if (rc == QT_OK) rc = st_writer_write(sw, path);
    st_writer_free(sw);
    return rc;
}

static int copy_model_files(const char *src_dir, const char *dst_dir);

/* Rank 0's share: the weights (adapter, or model + config.json and the
 * model's tokenizer and generation files, so that eval and generate run on a
 * checkpoint as on final/, as HF Trainer's checkpoints do). */
static int save_weights(qt_trainer *t, const char *dir) {
    if (t->job->lora.enabled) return save_adapter(t, dir);
    char path[4096];
    QT_TRY(qt_path_join(path, sizeof path, dir, "model.safetensors"));
    QT_TRY(save_model_weights(t, path, QT_F32));
    return copy_model_files(t->job->model, dir);
}

/* Every rank says whether its part went well; all learn the first rank that
 * failed (-1: none). One collective, so a failure on any rank stops all. */
static int agree(qt_trainer *t, int rc, const char *what, int *bad_rank) {
    *bad_rank = rc == QT_OK ? -1 : t->rank;
    if (t->world == 1) return QT_OK;
    int64_t *all = qt_calloc((size_t)t->world, sizeof(int64_t), "checkpoint flags");
    if (!all) return QT_ENOMEM;
    const int64_t mine = rc == QT_OK;
    int r2 = dist_allgather_i64(t->d, &mine, 1, all, what);
    for (int r = 0; r < t->world && r2 == QT_OK && *bad_rank < 0; r++)
        if (!all[r]) *bad_rank = r;
    qt_free(all);
    return r2;
}

/* Every rank writes its own part of the optimizer state into the checkpoint's
 * .tmp folder (its name follows from output_dir and step, so all ranks agree
 * on it without a message); rank 0 also writes the weights, and only when
 * every rank reported success writes trainer_state.json and renames the
 * folder. No rank holds more than its own part at any time: a gathered m and
 * v would cost rank 0 2 x n x 4 bytes (113 GB for Qwen-14B). */
static int save_checkpoint(qt_trainer *t) {
    /* collective parts first: every rank takes part */
    int64_t *pos = qt_calloc((size_t)t->world * 2, sizeof(int64_t), "data positions");
    if (!pos) return QT_ENOMEM;
    dl_state ds = trainer_data_position(t);
    const int64_t mine[2] = {ds.epoch, ds.index};
    qt_fault_point("ckpt-positions", t->rank);
    int rc = dist_allgather_i64(t->d, mine, 2, pos, "data positions");
    if (rc != QT_OK) {
        qt_free(pos);
        return rc;
    }
    ckpt_writer w;
    int bad = -1;
    /* rank 0 makes the .tmp folder (removing a stale one) before anyone writes into it */
    rc = t->main ? ckpt_begin(&w, t->job->output_dir, t->step) : ckpt_names(&w, t->job->output_dir, t->step);
    qt_fault_point("ckpt-folder", t->rank);
    int r2 = agree(t, rc, "checkpoint folder", &bad);
    if (rc == QT_OK && r2 != QT_OK) rc = r2;
    if (rc == QT_OK && bad >= 0)
        rc = QT_ERR(QT_EIO, "rank %d could not prepare the checkpoint folder %s", bad, w.dir);

    int index, count;
    size_t lo, hi;
    zero_ckpt_part(t->zp, &index, &count, &lo, &hi);
    int wrc = rc;
    qt_fault_point("ckpt-opt-part", t->rank);
    if (wrc == QT_OK && index >= 0) wrc = save_opt_part(t, w.dir, index, count, lo, hi);
    if (wrc == QT_OK && t->main) wrc = save_weights(t, w.dir);
    /* a sharded master: rank 0 wrote with the others' help, and ends that whatever happened */
    int grc = t->main ? gathers_done(t) : serve_gathers(t);
    if (wrc == QT_OK) wrc = grc;
    /* said now: once rank 0 learns of the failure it aborts every rank, which
     * may come before this rank's CLI prints its error */
    if (wrc != QT_OK && !t->main && t->world > 1) qt_warn_rank("rank %d: %s", t->rank, qt_error_message());
    if (rc == QT_OK) {
        qt_fault_point("ckpt-parts-agree", t->rank);
        r2 = agree(t, wrc, "checkpoint parts written", &bad);
        rc = wrc != QT_OK ? wrc : r2;
        if (rc == QT_OK && bad >= 0)
            rc = QT_ERR(QT_EIO, "rank %d could not write its part of the checkpoint of step %ld (its own message "
                                "says why)", bad, t->step);
    }

    if (t->main) {
        /* a rank that wrote into another folder of the same name (an output_dir
         * that is not shared across hosts) reports success too: commit only
         * the parts rank 0 itself sees, else the checkpoint is unresumable and
         * the prune below deletes the older good ones */
        for (int i = 0; i < count && rc == QT_OK; i++) {
            char name[64], path[4096];
            snprintf(name, sizeof name, OPT_PART_FMT, i, count);
            rc = qt_path_join(path, sizeof path, w.dir, name);
            if (rc == QT_OK && !qt_path_exists(path))
                rc = QT_ERR(QT_EIO, "%s is missing although rank %d wrote its part: every rank must see the same "
                            "output_dir (across hosts, a shared filesystem)", path, i);
        }
        if (rc == QT_OK) {
            char path[4096];
            char *s = state_json(t, pos, count);
            if (!s) rc = QT_ERR(QT_ENOMEM, "out of memory writing %s", CKPT_STATE_FILE);
            if (rc == QT_OK) rc = qt_path_join(path, sizeof path, w.dir, CKPT_STATE_FILE);
            if (rc == QT_OK) rc = qt_write_file_atomic(path, s, strlen(s));
            free(s);
        }
        /* last: the SHA-256 of every file, checked when the run resumes from it */
        if (rc == QT_OK) rc = ckpt_write_checksums(w.dir);
        qt_fault_point("ckpt-commit", t->rank);
        if (rc == QT_OK) rc = ckpt_commit(&w);
        else if (w.dir[0]) ckpt_abort(&w);
        if (rc == QT_OK) rc = ckpt_prune(t->job->output_dir, t->job->train.save_total_limit, t->step);
    }
    qt_free(pos);
    /* every rank learns whether rank 0 committed */
    int64_t good = rc == QT_OK;
    qt_fault_point("ckpt-written", t->rank);
    if (t->world > 1) {
        r2 = dist_allreduce_i64(t->d, &good, 1, DIST_MIN, "checkpoint written");
        if (rc == QT_OK && r2 != QT_OK) rc = r2;
        if (rc == QT_OK && !good) rc = QT_ERR(QT_EIO, "rank 0 could not write the checkpoint of step %ld", t->step);
    }
    if (rc == QT_OK) snprintf(t->last_ckpt, sizeof t->last_ckpt, "%s", w.final);
    if (rc == QT_OK && t->main) qt_debug("saved %s", t->last_ckpt);
    return rc;
}

/* ---------------------------------------------------------------------------
 * resume */

typedef struct {
    char file[64]; /* a name inside the checkpoint folder */
    size_t lo, hi; /* its element range */
    int checked;   /* 1: the file's metadata names its part and range (sharded format) */
} opt_part;

/* The optimizer files a checkpoint lists: parts that tile [0, n) in order,
 * each named as save_opt_part names it. A format-1 checkpoint has no list and
 * holds the whole state in one optimizer.safetensors. */
static int state_opt_parts(const cJSON *j, const char *path, int version, size_t n, opt_part **out, int *count) {
    *out = NULL;
    *count = 0;
    const cJSON *opt = cJSON_GetObjectItemCaseSensitive(j, "optimizer");
    if (version >= 2 && !cJSON_IsObject(opt))
        return QT_ERR(QT_EFORMAT, "%s: format_version %d lists its optimizer files in \"optimizer\", which is "
                      "missing or not an object; the checkpoint is damaged", path, version);
    if (version < 2) {
        opt_part *p = qt_calloc(1, sizeof *p, "the optimizer file list");
        if (!p) return QT_ENOMEM;
        snprintf(p->file, sizeof p->file, "%s", OPT_LEGACY_FILE);
        p->hi = n;
        *out = p;
        *count = 1;
        return QT_OK;
    }
    const cJSON *parts = cJSON_GetObjectItemCaseSensitive(opt, "parts");
    int k = cJSON_IsArray(parts) ? cJSON_GetArraySize(parts) : 0;
    if (k < 1 || k > OPT_MAX_PARTS)
        return QT_ERR(QT_EFORMAT, "%s: \"optimizer\".\"parts\" must list 1 to %d files; the checkpoint is damaged", path,
                      OPT_MAX_PARTS);
    opt_part *p = qt_calloc((size_t)k, sizeof *p, "the optimizer file list");
    if (!p) return QT_ENOMEM;
    int rc = QT_OK;
    size_t next = 0;
    for (int i = 0; i < k && rc == QT_OK; i++) {
        const cJSON *e = cJSON_GetArrayItem(parts, i);
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(e, "file");
        int64_t lo = 0, hi = 0;
        char want[64];
        snprintf(want, sizeof want, OPT_PART_FMT, i, k);
        rc = state_i64(e, "lo", 0, &lo, path);
        if (rc == QT_OK) rc = state_i64(e, "hi", 0, &hi, path);
        if (rc == QT_OK && !(cJSON_IsString(f) && !strcmp(f->valuestring, want)))
            rc = QT_ERR(QT_EFORMAT, "%s: optimizer part %d must be the file %s; the checkpoint is damaged", path, i, want);
        /* the parts must tile the block in order, so every element has exactly one source */
        if (rc == QT_OK && ((size_t)lo != next || hi < lo || (size_t)hi > n))
            rc = QT_ERR(QT_EFORMAT, "%s: optimizer part %d covers [%lld, %lld) but must start at %zu and end by %zu; "
                        "the checkpoint is damaged", path, i, (long long)lo, (long long)hi, next, n);
        if (rc == QT_OK) {
            snprintf(p[i].file, sizeof p[i].file, "%s", want);
            p[i].lo = (size_t)lo;
            p[i].hi = (size_t)hi;
            p[i].checked = 1;
            next = (size_t)hi;
        }
    }
    if (rc == QT_OK && next != n)
        rc = QT_ERR(QT_EFORMAT, "%s: the optimizer parts cover %zu of %zu values; the checkpoint is damaged", path, next, n);
    if (rc != QT_OK) {
        qt_free(p);
        return rc;
    }
    *out = p;
    *count = k;
    return QT_OK;
}

/* Data position of this rank when the checkpoint was written by another
 * number of ranks. Without packing a row is one example and rank r of N takes
 * epoch positions r, r + N, ...; when the writing ranks had taken exactly the
 * first G positions of the same epoch, this rank's next row is the number of
 * those G positions that fall to it now, and training continues as if
 * uninterrupted. Otherwise (packing, or ranks in different epochs) the epoch
 * of rank 0 restarts. Returns 1 when exact. */
static int remap_data_position(const qt_trainer *t, const int64_t *pos, int64_t world, int64_t *out) {
    int64_t g = 0;
    int exact = !t->job->data.packing;
    /* the positions come from a file: a sum past INT64_MAX cannot be G rows
     * of one epoch, and ceil((G - r) / N) is (G - r - 1) / N + 1 so that no
     * step overflows */
    for (int64_t r = 0; r < world && exact; r++) {
        if (pos[2 * r] != pos[0] || pos[2 * r + 1] > INT64_MAX - g) exact = 0;
        else g += pos[2 * r + 1];
    }
    for (int64_t r = 0; r < world && exact; r++)
        if (pos[2 * r + 1] != (g > r ? (g - r - 1) / world + 1 : 0)) exact = 0;
    out[0] = pos[0];
    out[1] = exact && g > t->rank ? (g - t->rank - 1) / t->world + 1 : 0;
    return exact;
}

/* The step a folder's name says (checkpoint-STEP, a trailing '/' allowed), -1 if none. */
static long dir_step(const char *dir) {
    char b[4096];
    snprintf(b, sizeof b, "%s", dir);
    for (size_t n = strlen(b); n > 1 && b[n - 1] == '/'; n--) b[n - 1] = 0;
    const char *slash = strrchr(b, '/');
    return ckpt_step_of(slash ? slash + 1 : b);
}

static int load_state(qt_trainer *t, const char *dir, int64_t *data_pos, opt_part **parts, int *nparts) {
    char path[4096];
    QT_TRY(qt_path_join(path, sizeof path, dir, CKPT_STATE_FILE));
    char *text;
    QT_TRY(qt_read_file(path, STATE_MAX_BYTES, &text, NULL));
    cJSON *j = cJSON_Parse(text);
    qt_free(text);
    int rc = QT_OK;
    int64_t step = 0, applied = 0, numel = 0, tokens = 0, world = 1, micro = 0;
    int version = 0;
    if (!cJSON_IsObject(j)) rc = QT_ERR(QT_EFORMAT, "%s is not a JSON object; the checkpoint is damaged", path);
    if (rc == QT_OK) rc = state_format(j, path, &version);
    if (rc == QT_OK) rc = state_i64(j, "step", 0, &step, path);
    if (rc == QT_OK) rc = state_i64(j, "applied_updates", 0, &applied, path);
    if (rc == QT_OK) rc = state_i64(j, "numel", 0, &numel, path);
    if (rc == QT_OK) rc = state_i64(j, "tokens_seen", 0, &tokens, path);
    if (rc == QT_OK) rc = state_i64(j, "world", 1, &world, path);
    if (rc == QT_OK) rc = state_i64(j, "rng_micro_step", 0, &micro, path);
    /* fields that must agree with each other and with the folder's name */
    const long named = dir_step(dir);
    if (rc == QT_OK && named >= 0 && named != step)
        rc = QT_ERR(QT_EFORMAT, "%s says step %lld but its folder is checkpoint-%ld; the checkpoint is damaged or was "
                    "renamed", path, (long long)step, named);
    if (rc == QT_OK && applied > step)
        rc = QT_ERR(QT_EFORMAT, "%s: applied_updates %lld is more than its step %lld (every update is a step); the "
                    "checkpoint is damaged", path, (long long)applied, (long long)step);
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
    qt_loss_scaler_state sc;
    if (rc == QT_OK) rc = qt_loss_scaler_state_parse(cJSON_GetObjectItemCaseSensitive(j, "loss_scaler"), path, &sc);
    const cJSON *el = cJSON_GetObjectItemCaseSensitive(j, "elapsed_s");
    const cJSON *dp = cJSON_GetObjectItemCaseSensitive(j, "data_position");
    if (rc == QT_OK && !(cJSON_IsArray(dp) && (int64_t)cJSON_GetArraySize(dp) == world))
        rc = QT_ERR(QT_EFORMAT, "%s: data_position must list one [epoch, index] per rank", path);
    int64_t *all = NULL;
    if (rc == QT_OK) {
        all = qt_calloc((size_t)world * 2, sizeof(int64_t), "data positions");
        if (!all) rc = QT_ENOMEM;
    }
    for (int r = 0; r < world && rc == QT_OK; r++) {
        const cJSON *p = cJSON_GetArrayItem(dp, r);
        const cJSON *e = cJSON_GetArrayItem(p, 0), *ix = cJSON_GetArrayItem(p, 1);
        if (!cJSON_IsNumber(e) || !cJSON_IsNumber(ix) || !(e->valuedouble >= 0 && e->valuedouble < 9e15) ||
            !(ix->valuedouble >= 0 && ix->valuedouble < 9e15) || e->valuedouble != floor(e->valuedouble) ||
            ix->valuedouble != floor(ix->valuedouble))
            rc = QT_ERR(QT_EFORMAT, "%s: data_position[%d] must be [epoch, index]", path, r);
        else {
            all[2 * r] = (int64_t)e->valuedouble;
            all[2 * r + 1] = (int64_t)ix->valuedouble;
        }
    }
    if (rc == QT_OK && world == t->world) {
        data_pos[0] = all[2 * t->rank];
        data_pos[1] = all[2 * t->rank + 1];
    } else if (rc == QT_OK) {
        if (remap_data_position(t, all, world, data_pos)) {
            if (t->main)
                qt_info("%s was written by %lld rank(s) and this run has %d: the data continues where those ranks "
                        "stopped", dir, (long long)world, t->world);
        } else {
            qt_warn("%s was written by %lld rank(s) and this run has %d: weights and optimizer state resume exactly, "
                    "the data order restarts from the same epoch position of rank 0",
                    dir, (long long)world, t->world);
        }
    }
    qt_free(all);
    if (rc == QT_OK) rc = state_opt_parts(j, path, version, t->n, parts, nparts);
    if (rc == QT_OK) {
        t->step = (long)step;
        t->opt.n_updates = applied;
        t->tokens_seen = tokens;
        t->elapsed_before = cJSON_IsNumber(el) ? el->valuedouble : 0;
        qt_model_set_micro_step(t->model, (uint64_t)micro);
        if (t->cfg.fp16) {
            qt_loss_scaler_state_apply(&t->opt.scaler, &sc);
            t->opt.n_skipped = sc.n_overflows; /* the optimizer's count of overflow skips goes on from there */
        }
    }
    cJSON_Delete(j);
    return rc;
}

static int load_checkpoint(qt_trainer *t, const char *dir);

int trainer_load_checkpoint(qt_trainer *t, const char *dir) {
    double to = dist_timeout(t->d);
    dist_set_timeout(t->d, io_timeout(t)); /* rank 0 reads while the others wait */
    int rc = load_checkpoint(t, dir);
    dist_set_timeout(t->d, to);
    return rc;
}

/* Checks one optimizer file against the part the state lists: its metadata
 * (part, range, block size; the format-1 file has none) and both tensors
 * (F32, shape (hi - lo)). The file's size was checked by st_open. */
static int check_opt_file(const qt_trainer *t, const st_file *f, const char *path, const opt_part *p, int index,
                          int count, const st_tensor **a, const st_tensor **b) {
    if (p->checked) {
        size_t want[5] = {(size_t)index, (size_t)count, p->lo, p->hi, t->n};
        for (int i = 0; i < 5; i++) {
            const char *v = st_metadata(f, opt_meta_keys[i]);
            char *end = NULL;
            unsigned long long x = v ? strtoull(v, &end, 10) : 0;
            if (!v || !*v || *end || x != want[i])
                return QT_ERR(QT_EFORMAT, "%s: metadata \"%s\" is %s%s%s but the checkpoint's %s expects %zu; the file "
                              "belongs to another checkpoint or is damaged", path, opt_meta_keys[i], v ? "\"" : "missing",
                              v ? v : "", v ? "\"" : "", CKPT_STATE_FILE, want[i]);
        }
    }
    int64_t shape[1] = {(int64_t)(p->hi - p->lo)};
    const st_tensor *ts[2];
    const char *names[2] = {"exp_avg", "exp_avg_sq"};
    for (int i = 0; i < 2; i++) {
        QT_TRY(st_expect(f, names[i], 1, shape, &ts[i]));
        if (ts[i]->dtype != QT_F32)
            return QT_ERR(QT_EFORMAT, "%s: tensor %s must be F32 in a checkpoint; the file is damaged", path, names[i]);
    }
    *a = ts[0];
    *b = ts[1];
    return QT_OK;
}

/* Adam's m must be finite and v finite and >= 0 (m, v: n floats of device memory). */
static int check_opt_values(qt_trainer *t, const char *path, const float *m, const float *v, size_t lo, size_t n) {
    for (int which = 0; which < 2; which++) {
        size_t at;
        if (trainer_find_bad(t, which ? v : m, n, which, &at))
            return QT_ERR(QT_EFORMAT, "%s: %s holds %s (element %zu of the block, in %s); the file is damaged: resume "
                          "from an earlier checkpoint, or set train.resume to \"never\"", path,
                          which ? "exp_avg_sq" : "exp_avg",
                          which ? "NaN, infinite or negative values" : "NaN or infinite values", lo + at,
                          trainer_param_at(t, lo + at));
    }
    return QT_OK;
}

/* Adam m and v over this rank's range, from the parts that overlap it: each
 * file is mapped and only the slice this rank needs is read (no full-size
 * buffer on any rank). Every rank checks every file's header (cheap: the
 * data stays unread), so a bad file gets the same one-sentence error on all
 * ranks, whichever rank would have read it. */
static int load_opt_state(qt_trainer *t, const char *dir, const opt_part *parts, int count) {
    float *m, *v;
    QT_TRY(zero_state_view(t->zp, &t->zs, 0, &m));
    QT_TRY(zero_state_view(t->zp, &t->zs, 1, &v));
    const size_t mlo = t->zs.lo, mhi = t->zs.hi;
    int rc = QT_OK;
    for (int i = 0; i < count && rc == QT_OK; i++) {
        char path[4096];
        rc = qt_path_join(path, sizeof path, dir, parts[i].file);
        if (rc == QT_OK && !qt_path_exists(path))
            rc = QT_ERR(QT_EIO, "%s is missing: the checkpoint lists it in %s; it is incomplete, resume from an "
                        "earlier one", path, CKPT_STATE_FILE);
        st_file *f = NULL;
        if (rc == QT_OK) rc = st_open(path, &f);
        const st_tensor *a = NULL, *b = NULL;
        if (rc == QT_OK) rc = check_opt_file(t, f, path, &parts[i], i, count, &a, &b);
        size_t lo = parts[i].lo > mlo ? parts[i].lo : mlo, hi = parts[i].hi < mhi ? parts[i].hi : mhi;
        if (rc == QT_OK && hi > lo) rc = read_range_to_device(t->be, a, lo - parts[i].lo, hi - lo, m + (lo - mlo));
        if (rc == QT_OK && hi > lo) rc = read_range_to_device(t->be, b, lo - parts[i].lo, hi - lo, v + (lo - mlo));
        if (rc == QT_OK && hi > lo) rc = check_opt_values(t, path, m + (lo - mlo), v + (lo - mlo), lo, hi - lo);
        st_close(f);
    }
    return rc;
}

/* A damaged checkpoint's error ends with what to resume from instead: the
 * newest complete checkpoint before it, named, or a fresh start. */
static int damaged(const char *dir, int rc) {
    char msg[2048], prev[4096] = "", parent[4096];
    snprintf(msg, sizeof msg, "%s", qt_error_message());
    long ps = -1, step = dir_step(dir);
    qt_path_dirname(parent, sizeof parent, dir);
    if (step >= 0 && ckpt_previous(parent, step, prev, sizeof prev, &ps) != QT_OK) ps = -1;
    if (ps >= 0)
        return QT_ERR(rc, "%s; resume from the previous checkpoint %s (set train.resume to it), or set train.resume to "
                      "\"never\"", msg, prev);
    return QT_ERR(rc, "%s; no earlier checkpoint (train.resume \"never\" starts over)", msg);
}

/* Rank 0 checks every file against the checksums written with it (the other
 * ranks wait in the collective after loading); a stop request ends the
 * reading, which takes minutes for a large model. A checkpoint written before
 * qtune recorded checksums resumes with a warning, and so do files the list
 * leaves out (an emptied or edited list), named. */
static int verify_checkpoint(const qt_trainer *t, const char *dir) {
    if (!t->main) return QT_OK;
    int present = 0;
    char unlisted[1024];
    qt_cancel_watch(t->hooks->stop);
    int rc = ckpt_verify_checksums(dir, &present, unlisted, sizeof unlisted);
    qt_cancel_watch(NULL);
    QT_TRY(rc);
    if (!present)
        qt_warn("%s has no %s (written by an older qtune): its files are resumed without being checked", dir,
                CKPT_SUMS_FILE);
    else if (unlisted[0])
        qt_warn("%s/%s does not list %s (the list was cut short or edited): %s resumed without being checked",
                dir, CKPT_SUMS_FILE, unlisted, strchr(unlisted, ',') || strstr(unlisted, " more") ? "they are" : "it is");
    return QT_OK;
}

static int load_checkpoint(qt_trainer *t, const char *dir) {
    int64_t pos[2] = {0, 0};
    opt_part *parts = NULL;
    int nparts = 0;
    int rc = load_state(t, dir, pos, &parts, &nparts);
    char path[4096];
    if (rc == QT_OK)
        rc = qt_path_join(path, sizeof path, dir, t->job->lora.enabled ? "adapter_model.safetensors" : "model.safetensors");
    if (rc == QT_OK) rc = load_params(t, path, 0);
    if (rc == QT_OK) rc = load_opt_state(t, dir, parts, nparts);
    /* after the structural checks above, whose messages say more when they fail */
    if (rc == QT_OK) rc = verify_checkpoint(t, dir);
    qt_free(parts);
    /* all ranks go on, or none: 2 loaded, 1 stopped by a stop request, 0 failed */
    int64_t ok = rc == QT_OK ? 2 : rc == QT_EINTERRUPTED ? 1 : 0;
    if (t->world > 1) {
        int r2 = dist_allreduce_i64(t->d, &ok, 1, DIST_MIN, "checkpoint load");
        if (r2 != QT_OK && rc == QT_OK) rc = r2;
        if (rc == QT_OK && ok == 1)
            rc = QT_ERR(QT_EINTERRUPTED, "stopped while rank 0 checked the checkpoint %s; nothing new to save", dir);
        if (rc == QT_OK && ok == 0) rc = QT_ERR(QT_EIO, "another rank could not read the checkpoint %s", dir);
    }
    if (rc == QT_OK && t->train_dl) rc = dl_state_set(t->train_dl, (dl_state){pos[0], pos[1]});
    /* a damaged file: its message names it (and so the checkpoint), the hint what to resume from instead */
    if (rc == QT_EFORMAT) return damaged(dir, rc);
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

/* Full fine-tuning ends with a checkpoint of the last step, whose
 * model.safetensors (fp32) holds exactly the bytes final/ would get when the
 * model's dtype is fp32 too (same writer, same tensors, same metadata). Then
 * final/model.safetensors becomes a hard link to it instead of a second copy
 * (2 GB for Qwen2.5-0.5B, 56 GB for 14B). The link stays right because no
 * file is ever rewritten in place: st_writer_write and qt_write_file_atomic
 * write a new inode and rename it over the name, qt_dir_replace and
 * ckpt_prune rename and unlink names, so deleting or replacing the checkpoint
 * leaves final/'s inode as it was. Returns 1 when linked; 0 (write instead)
 * when the rule (qt_train_final_links_checkpoint, which the plan's disk
 * estimate uses too) says no, there is no such checkpoint or link(2) fails
 * (EXDEV, EPERM, EMLINK...). */
int qt_train_final_links_checkpoint(int lora, qt_dtype model_dtype) { return !lora && model_dtype == QT_F32; }

static int link_checkpoint_model(const qt_trainer *t, qt_dtype dtype, const char *dst) {
    ckpt_writer w; /* for the name of this step's checkpoint */
    if (!qt_train_final_links_checkpoint(t->job->lora.enabled, dtype) ||
        ckpt_names(&w, t->job->output_dir, t->step) != QT_OK)
        return 0;
    /* only this run's checkpoint of this very step: the weights have not moved since */
    if (strcmp(t->last_ckpt, w.final)) return 0;
    char src[4300];
    if (snprintf(src, sizeof src, "%s/model.safetensors", t->last_ckpt) >= (int)sizeof src) return 0;
    if (link(src, dst) != 0) {
        qt_debug("final/: could not link %s (%s); writing the model instead", src, strerror(errno));
        return 0;
    }
    qt_debug("final/model.safetensors is a hard link to %s", src);
    return 1;
}

int trainer_write_final(qt_trainer *t, char *final_dir, size_t cap) {
    double to = dist_timeout(t->d);
    dist_set_timeout(t->d, io_timeout(t));
    int rc = write_final(t, final_dir, cap);
    int grc = t->main ? gathers_done(t) : serve_gathers(t); /* a sharded master (save_checkpoint) */
    if (rc == QT_OK) rc = grc;
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
        qt_dtype dtype = qt_model_config(t->model)->torch_dtype;
        if (rc == QT_OK && !link_checkpoint_model(t, dtype, path))
            rc = save_model_weights(t, path, dtype);
    }
    /* same as checkpoints: checksums, and a complete final/ at every instant */
    if (rc == QT_OK) rc = ckpt_write_checksums(tmp);
    if (rc == QT_OK) rc = qt_fsync_dir(tmp);
    if (rc == QT_OK) rc = qt_dir_replace(tmp, fin);
    if (rc != QT_OK) qt_rm_rf(tmp);
    if (rc == QT_OK) {
        snprintf(final_dir, cap, "%s", fin);
        qt_info("wrote %s (%s)", fin, t->job->lora.enabled ? "PEFT adapter" : "model folder");
    }
    return rc;
}
