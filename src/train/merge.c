/* qt_merge_adapter: W' = W + (B @ A) * scaling, streamed tensor by tensor.
 * The merged folder is written into a staging folder (OUT.tmp.PID beside a
 * new OUT, OUT/.qtune-merge.tmp.PID inside an existing one) and its files are
 * renamed into OUT only once all of them are complete, so an error or Ctrl-C
 * leaves OUT exactly as it was, and the parent folders made for a new OUT are
 * removed again. */
#include "train/merge.h"

#include "core/dtype.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "core/mem.h"
#include "core/progress.h"
#include "io/bnb4.h"
#include "io/hf_config.h"
#include "io/model_folder.h"
#include "io/peft.h"
#include "io/safetensors.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* the staging folder's name inside an existing OUT, before ".tmp.PID" */
#define MERGE_STAGE_IN ".qtune-merge"

/* One adapted weight: W (out, in), A (r, in), B (out, r); or a
 * modules_to_save weight: W replaced by the adapter's trained copy `full`. */
typedef struct {
    const st_tensor *w;
    const st_tensor *a, *b;
    const st_tensor *full;
    float *af;   /* (r, in) f32 */
    float *bf;   /* (out, r) f32 */
    float *tmp;  /* (in) one row of B @ A */
    float scaling;
    int r;
    int64_t rows, cols; /* W's shape: w's, or a 4-bit W's quant_state's */
    /* a bitsandbytes 4-bit base (io/bnb4.h): w holds W's packed codes, and W is its dequantization, read
     * into q4 at the first fill and freed after the last (one weight's 4-bit block held at a time) */
    int q4w;
    qt_dtype q4_dtype; /* what the 4-bit values dequantize to (quant_state.dtype) */
    st_file *st;
    const char *dir;
    qt_q4_weight *q4;
} merge_item;

/* Elements [off, off + n) of the base weight W as f32: as stored, or the
 * 4-bit weight dequantized as bitsandbytes' dequantize_4bit returns it. */
static int base_fill(merge_item *m, float *dst, size_t off, size_t n) {
    if (!m->q4w) {
        qt_convert_to_f32(dst, (const char *)m->w->data + off * qt_dtype_size(m->w->dtype), m->w->dtype, n);
        return QT_OK;
    }
    size_t bytes;
    if (!m->q4) QT_TRY(bnb4_read(m->st, m->dir, m->w, m->rows, m->cols, &m->q4, &bytes));
    qt_q4_dequantize(m->q4, off, off + n, dst);
    if (off + n == (size_t)m->rows * (size_t)m->cols) {
        qt_free(m->q4);
        m->q4 = NULL;
    }
    return QT_OK;
}

/* Fills merged elements [off, off + n) of W' in row-major order. */
static int merge_fill(void *ctx, float *dst, size_t off, size_t n) {
    merge_item *m = ctx;
    if (m->full) { /* modules_to_save: the trained copy as it is */
        qt_convert_to_f32(dst, (const char *)m->full->data + off * qt_dtype_size(m->full->dtype), m->full->dtype, n);
        return QT_OK;
    }
    const size_t in = (size_t)m->cols;
    QT_TRY(base_fill(m, dst, off, n));
    if (!m->a) return QT_OK; /* a 4-bit weight the adapter leaves alone: dequantized only */
    size_t e = off, end = off + n;
    while (e < end) {
        size_t i = e / in, j0 = e % in, j1 = in;
        if (end - e < j1 - j0) j1 = j0 + (end - e);
        float *row = m->tmp;
        memset(row + j0, 0, (j1 - j0) * sizeof(float));
        for (int k = 0; k < m->r; k++) {
            const float bik = m->bf[i * (size_t)m->r + (size_t)k];
            const float *ak = m->af + (size_t)k * in;
            for (size_t j = j0; j < j1; j++) row[j] += bik * ak[j];
        }
        float *d = dst + (e - off);
        for (size_t j = j0; j < j1; j++) d[j - j0] += row[j] * m->scaling;
        e += j1 - j0;
    }
    return QT_OK;
}

/* config.json: as it was, with its dtype keys set when the dtype changes.
 * transformers up to 4.55 writes "torch_dtype", later ones "dtype" (and read
 * either): each one present is set, and torch_dtype is added when neither is,
 * so no loader finds the input model's dtype in the merged folder. */
static int copy_side_files(const char *src, const char *dst, int out_dtype, int untie, int dequant) {
    QT_TRY(qt_model_copy_side_files(src, dst));
    char s[4096], d[4096];
    QT_TRY(qt_path_join(s, sizeof s, src, "config.json"));
    QT_TRY(qt_path_join(d, sizeof d, dst, "config.json"));
    if (out_dtype < 0 && !untie && !dequant) return qt_copy_file(s, d);
    char *text;
    QT_TRY(qt_read_file(s, 1 << 24, &text, NULL));
    cJSON *j = cJSON_Parse(text);
    qt_free(text);
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        return QT_ERR(QT_EFORMAT, "%s is not a JSON object", s);
    }
    static const char *const names[] = {"float32", "float16", "bfloat16"};
    static const char *const keys[] = {"torch_dtype", "dtype"};
    int set = 0;
    for (int k = 0; k < 2 && out_dtype >= 0; k++) {
        if (!cJSON_GetObjectItemCaseSensitive(j, keys[k])) continue;
        cJSON_ReplaceItemInObjectCaseSensitive(j, keys[k], cJSON_CreateString(names[out_dtype]));
        set = 1;
    }
    if (!set && out_dtype >= 0) cJSON_AddItemToObject(j, "torch_dtype", cJSON_CreateString(names[out_dtype]));
    /* modules_to_save trained on a tied model: the embedding and lm_head now differ (merge.h) */
    if (untie && cJSON_GetObjectItemCaseSensitive(j, "tie_word_embeddings"))
        cJSON_ReplaceItemInObjectCaseSensitive(j, "tie_word_embeddings", cJSON_CreateFalse());
    else if (untie)
        cJSON_AddFalseToObject(j, "tie_word_embeddings");
    /* the 4-bit weights were written dequantized: no loader may read them as bitsandbytes' */
    if (dequant) cJSON_DeleteItemFromObjectCaseSensitive(j, "quantization_config");
    char *out = cJSON_Print(j);
    cJSON_Delete(j);
    if (!out) return QT_ERR(QT_ENOMEM, "out of memory writing %s", d);
    int rc = qt_write_file_atomic(d, out, strlen(out));
    free(out);
    return rc;
}

/* The model folder is checked before the adapter is read, so a wrong --model
 * is reported as such and not as whatever the adapter check meets first. */
int qt_merge_open_model(const char *model_dir, st_file **base) {
    char cfg[4096];
    if (!qt_path_exists(model_dir))
        return QT_ERR(QT_EIO, "--model %s does not exist; name the base model folder (config.json and "
                              "model.safetensors) the adapter was trained on", model_dir);
    if (!qt_is_dir(model_dir))
        return QT_ERR(QT_EINVAL, "--model %s is not a folder; name the base model folder (config.json and "
                                 "model.safetensors) the adapter was trained on", model_dir);
    QT_TRY(qt_path_join(cfg, sizeof cfg, model_dir, "config.json"));
    if (!qt_path_exists(cfg))
        return QT_ERR(QT_EIO, "--model %s has no config.json; name the Hugging Face model folder the adapter was "
                              "trained on", model_dir);
    return st_open(model_dir, base);
}

/* Pairs each adapter A/B with its base weight, checking every name against
 * target_modules and every shape; reads A and B as f32. */
/* A modules_to_save tensor of the adapter: "base_model.model.X.weight" with
 * X listed in modules_to_save (PEFT's name rule) and X.weight in the base, or
 * the lm_head of a tied base (which has none). Returns the item, or NULL
 * (*rc set) when t is not one. */
static int saved_item(const char *model_dir, const char *adapter_dir, const peft_config *pc, st_file *base,
                      const st_tensor *t, int tied, merge_item *item, int *lm_head_new) {
    static const char prefix[] = "base_model.model.";
    size_t pl = sizeof prefix - 1, n = strlen(t->name);
    char module[512];
    if (strncmp(t->name, prefix, pl) || n < pl + 8 || strcmp(t->name + n - 7, ".weight") || n - pl - 7 >= sizeof module)
        return 0;
    snprintf(module, sizeof module, "%.*s", (int)(n - pl - 7), t->name + pl);
    int listed = 0;
    for (int e = 0; e < pc->n_save; e++) listed |= peft_target_entry_matches(pc->modules_to_save[e], module);
    if (!listed) return 0;
    const st_tensor *w = st_find(base, t->name + pl);
    *lm_head_new = !w && tied && !strcmp(module, "lm_head");
    if (!w && !*lm_head_new) return 0;
    if (w && (w->ndim != t->ndim || w->shape[0] != t->shape[0] || (t->ndim > 1 && w->shape[1] != t->shape[1])))
        return QT_ERR(QT_EFORMAT, "%s: %s has shape [%lld, %lld], but %s/%s is [%lld, %lld]; is this the adapter's "
                      "base model?", adapter_dir, t->name, (long long)t->shape[0],
                      (long long)(t->ndim > 1 ? t->shape[1] : 0), model_dir, w->name, (long long)w->shape[0],
                      (long long)(w->ndim > 1 ? w->shape[1] : 0)), -1;
    item->w = w;
    item->full = t;
    return 1;
}

/* The shape of item m's weight: as stored, or for a 4-bit weight of a
 * bitsandbytes folder its quant_state's (the whole block read once here, so
 * a folder that lies is refused before anything is written). */
static int item_shape(const char *model_dir, st_file *base, merge_item *m) {
    const st_tensor *w = m->w;
    m->rows = w->shape[0], m->cols = w->ndim > 1 ? w->shape[1] : 1;
    if (!bnb4_is_weight(base, w)) return QT_OK;
    qt_q4_weight *q4;
    size_t bytes;
    QT_TRY(bnb4_read(base, model_dir, w, -1, -1, &q4, &bytes));
    m->q4w = 1;
    m->rows = (int64_t)q4->rows, m->cols = (int64_t)q4->cols, m->q4_dtype = (qt_dtype)q4->dtype;
    m->st = base, m->dir = model_dir;
    qt_free(q4);
    return QT_OK;
}

static int pair_items(const char *model_dir, const char *adapter_dir, const peft_config *pc, st_file *base,
                      st_file *ad, merge_item *items, int *n_items, int tied, const st_tensor **lm_head_new) {
    const int na = st_count(ad);
    for (int i = 0; i < na; i++) {
        const st_tensor *t = st_at(ad, i);
        char wname[512];
        int is_b, fresh = 0;
        if (!peft_base_name(t->name, wname, sizeof wname, &is_b)) {
            int k = saved_item(model_dir, adapter_dir, pc, base, t, tied, &items[*n_items], &fresh);
            if (k < 0) return qt_error_code();
            if (k && fresh) { /* a tied base has no lm_head.weight: written as a new tensor (write_stage) */
                *lm_head_new = t;
                continue;
            }
            if (k) {
                (*n_items)++;
                continue;
            }
            return QT_ERR(QT_EUNSUPPORTED, "%s: tensor %s is neither a LoRA A/B weight nor a module that "
                          "adapter_config.json's modules_to_save lists; qtune merges LoRA adapters with "
                          "modules_to_save", adapter_dir, t->name);
        }
        /* PEFT never loads a LoRA weight for a module outside target_modules:
         * merging it would change the model where the adapter says it does not */
        char module[512];
        snprintf(module, sizeof module, "%.*s", (int)(strlen(wname) - strlen(".weight")), wname);
        if (!peft_targets_module(pc, module)) {
            char tm[PEFT_MAX_TARGETS * 66 + PEFT_MAX_REGEX]; /* a list of names, or a regex */
            peft_targets_str(pc, tm, sizeof tm);
            return QT_ERR(QT_EFORMAT,
                          "%s/adapter_model.safetensors holds %s, but adapter_config.json's target_modules (%s) do "
                          "not include %s; fix target_modules or remove that tensor",
                          adapter_dir, t->name, tm, module);
        }
        const st_tensor *w = st_find(base, wname);
        if (!w)
            return QT_ERR(QT_EINVAL, "%s: %s adapts %s, which %s does not have; is this the adapter's base model?",
                          adapter_dir, t->name, wname, model_dir);
        int k = 0;
        while (k < *n_items && items[k].w != w) k++;
        if (k == *n_items) { items[k].w = w; (*n_items)++; }
        if (is_b) items[k].b = t;
        else items[k].a = t;
    }
    for (int k = 0; k < *n_items; k++) {
        merge_item *m = &items[k];
        const st_tensor *w = m->w;
        if (m->full) continue;
        if (!m->a || !m->b)
            return QT_ERR(QT_EFORMAT, "%s: %s has a lora_%s but no lora_%s", adapter_dir, w->name, m->a ? "A" : "B",
                          m->a ? "B" : "A");
        QT_TRY(item_shape(model_dir, base, m));
        if (w->ndim != 2 || m->a->ndim != 2 || m->b->ndim != 2 || m->a->shape[0] != pc->r || m->b->shape[1] != pc->r ||
            m->a->shape[1] != m->cols || m->b->shape[0] != m->rows)
            return QT_ERR(QT_EFORMAT,
                          "%s: the LoRA of %s has A [%lld, %lld] and B [%lld, %lld], which do not fit the weight "
                          "[%lld, %lld] with r = %d",
                          adapter_dir, w->name, (long long)m->a->shape[0], (long long)m->a->shape[1],
                          (long long)m->b->shape[0], (long long)m->b->shape[1], (long long)m->rows,
                          (long long)m->cols, pc->r);
        m->r = pc->r;
        m->scaling = peft_scaling(pc);
        m->af = qt_malloc(m->a->numel * sizeof(float), "LoRA A");
        m->bf = qt_malloc(m->b->numel * sizeof(float), "LoRA B");
        m->tmp = qt_malloc((size_t)m->cols * sizeof(float), "merge row");
        if (!m->af || !m->bf || !m->tmp) return QT_ENOMEM;
        QT_TRY(st_read_f32(m->a, m->af));
        QT_TRY(st_read_f32(m->b, m->bf));
        /* named here: in the merged weight the NaN would point at the base */
        int nan;
        const st_tensor *ab[2] = {m->a, m->b};
        const float *abf[2] = {m->af, m->bf};
        for (int h = 0; h < 2; h++) {
            size_t at = qt_find_nonfinite(abf[h], QT_F32, ab[h]->numel, &nan);
            if (at < ab[h]->numel)
                return QT_ERR(QT_ENUMERIC, "%s/adapter_model.safetensors: tensor %s holds %s at element %zu; the adapter "
                              "is damaged (training diverged, or the file was changed): use an earlier checkpoint's "
                              "adapter", adapter_dir, ab[h]->name, nan ? "NaN" : "an infinite value", at);
        }
    }
    return QT_OK;
}

/* Targeted modules of the base that the adapter holds no LoRA for: PEFT loads
 * such an adapter with a warning and leaves those modules at B = 0, as the
 * merge does by passing them over; said here, with the first one named, so it
 * is not silent. Layers that layers_to_transform leaves out are not counted.
 * embed: the embedding's module name. */
static void warn_unadapted(const char *adapter_dir, const peft_config *pc, st_file *base, const merge_item *items,
                           int n_items, const char *embed) {
    int missing = 0;
    char first[512] = "";
    for (int i = 0; i < st_count(base); i++) {
        const st_tensor *w = st_at(base, i);
        const size_t n = strlen(w->name);
        if (w->ndim != 2 || n <= 7 || strcmp(w->name + n - 7, ".weight")) continue;
        char module[512];
        snprintf(module, sizeof module, "%.*s", (int)(n - 7), w->name);
        /* "all-linear" matches every name but lm_head; the embedding is no Linear layer */
        if (!strcmp(module, embed) || !peft_targets_module(pc, module)) continue;
        if (pc->n_layers && !peft_layer_listed(pc, peft_layer_index(pc, module))) continue;
        int held = 0;
        for (int k = 0; k < n_items && !held; k++) held = items[k].w == w;
        if (!held && !missing++) snprintf(first, sizeof first, "%s", module);
    }
    if (missing)
        qt_warn("%s: target_modules selects %d module%s of the model that the adapter holds no LoRA weights for "
                "(the first: %s); %s left as the base model has %s, as PEFT leaves them", adapter_dir, missing,
                missing == 1 ? "" : "s", first, missing == 1 ? "it is" : "they are", missing == 1 ? "it" : "them");
}

struct qt_merge_set {
    st_file *ad;
    merge_item *items;
    int n_items;
    float scaling;
    /* modules_to_save on a tied model: the merged model unties (merge.h); lm_head.weight, which the
     * tied base does not hold, comes from lm_head_src (the adapter's, or the base embedding) */
    int untie;
    merge_item lm_head;
    qt_dtype lm_head_dtype; /* the tied embedding's: a new lm_head is stored as the model stores it */
    /* a bitsandbytes 4-bit base: every 4-bit weight is an item (dequantized, with its LoRA when it has one),
     * written as dq_dtype unless told otherwise; the first one's quant type says what the base was */
    int dequant, dq_count;
    qt_dtype dq_dtype;
    int dq_type, dq_nested;
};

/* A bitsandbytes 4-bit base: each 4-bit weight the adapter leaves alone
 * becomes an item too (dequantized only), so the writers see a 16-bit model. */
static int dequant_items(const char *model_dir, st_file *base, qt_merge_set *s) {
    s->dequant = 1;
    for (int i = 0; i < st_count(base); i++) {
        const st_tensor *t = st_at(base, i);
        if (!bnb4_is_weight(base, t)) continue;
        int k = 0;
        while (k < s->n_items && s->items[k].w != t) k++;
        merge_item *m = &s->items[k];
        if (k == s->n_items) {
            m->w = t;
            s->n_items++;
            QT_TRY(item_shape(model_dir, base, m));
        }
        qt_q4_weight *q4;
        size_t bytes;
        if (!s->dq_count++) { /* the first one's header says what the base is */
            QT_TRY(bnb4_read(base, model_dir, t, m->rows, m->cols, &q4, &bytes));
            s->dq_dtype = (qt_dtype)q4->dtype, s->dq_type = (int)q4->type, s->dq_nested = (int)q4->nested;
            qt_free(q4);
        }
    }
    return QT_OK;
}

/* 1 when the adapter holds a trained copy of the tied embedding or lm_head
 * (modules_to_save): only then do the two differ. A saved module elsewhere
 * (a norm) leaves the model tied, as PEFT's merge_and_unload does. */
static int saves_embedding(const qt_merge_set *s, const st_tensor *emb, const st_tensor *lm_head,
                           const st_tensor *lm_new) {
    int saved = lm_new != NULL;
    for (int k = 0; k < s->n_items; k++)
        if (s->items[k].full && s->items[k].w && (s->items[k].w == emb || s->items[k].w == lm_head)) saved = 1;
    return saved;
}

void qt_merge_set_free(qt_merge_set *s) {
    if (!s) return;
    for (int k = 0; s->items && k < s->n_items; k++) {
        qt_free(s->items[k].af);
        qt_free(s->items[k].bf);
        qt_free(s->items[k].tmp);
        qt_free(s->items[k].q4);
    }
    qt_free(s->items);
    st_close(s->ad);
    qt_free(s);
}

int qt_merge_set_open(const char *model_dir, const char *adapter_dir, st_file *base, qt_merge_set **out) {
    *out = NULL;
    qt_merge_set *s = qt_calloc(1, sizeof *s, "merge list");
    if (!s) return QT_ENOMEM;
    peft_config pc;
    memset(&pc, 0, sizeof pc);
    int rc = adapter_dir ? peft_config_load(adapter_dir, &pc) : QT_OK; /* NULL: a 4-bit base dequantized alone */
    if (rc == QT_OK && adapter_dir) rc = peft_open_weights(adapter_dir, &s->ad);
    if (rc == QT_OK) {
        s->items = qt_calloc((size_t)(s->ad ? st_count(s->ad) : 0) + (size_t)st_count(base) + 1, sizeof *s->items,
                             "merge list");
        if (!s->items) rc = QT_ENOMEM;
    }
    qt_config cfg;
    if (rc == QT_OK) rc = qt_config_load(model_dir, &cfg);
    const st_tensor *lm_new = NULL;
    if (rc == QT_OK && s->ad)
        rc = pair_items(model_dir, adapter_dir, &pc, base, s->ad, s->items, &s->n_items, cfg.tie_word_embeddings,
                        &lm_new);
    if (rc == QT_OK && s->ad) warn_unadapted(adapter_dir, &pc, base, s->items, s->n_items, qt_config_layout(&cfg)->embed);
    if (rc == QT_OK && cfg.prequant4) rc = dequant_items(model_dir, base, s);
    char emb[160];
    const st_tensor *emb_w = NULL, *lm_w = st_find(base, "lm_head.weight"); /* a tied file may hold one */
    if (rc == QT_OK && cfg.tie_word_embeddings) {
        snprintf(emb, sizeof emb, "%s.weight", qt_config_layout(&cfg)->embed);
        emb_w = st_find(base, emb);
    }
    if (rc == QT_OK && cfg.tie_word_embeddings && saves_embedding(s, emb_w, lm_w, lm_new)) {
        /* PEFT trains a listed module of a tied model as its own copy: the embedding and lm_head differ */
        s->untie = 1;
        s->lm_head.full = lm_new ? lm_new : emb_w;
        s->lm_head.w = lm_w; /* then it is replaced */
        if (!emb_w) rc = QT_ERR(QT_EFORMAT, "%s has no %s", model_dir, emb);
        else s->lm_head_dtype = emb_w->dtype;
        for (int k = 0; rc == QT_OK && k < s->n_items && s->lm_head.w; k++)
            if (s->items[k].w == s->lm_head.w) s->lm_head.w = NULL; /* the adapter's lm_head replaces it already */
    }
    if (rc != QT_OK) {
        qt_merge_set_free(s);
        return rc;
    }
    s->scaling = adapter_dir ? peft_scaling(&pc) : 0.0f;
    *out = s;
    return QT_OK;
}

void qt_merge_set_lookup(qt_merge_set *s, const char *name, st_fill_fn *fill, void **ctx) {
    *fill = NULL;
    *ctx = NULL;
    for (int k = 0; k < s->n_items; k++)
        if (s->items[k].w && !strcmp(s->items[k].w->name, name)) {
            *fill = merge_fill;
            *ctx = &s->items[k];
        }
    if (s->untie && s->lm_head.w && !strcmp(name, "lm_head.weight")) {
        *fill = merge_fill;
        *ctx = &s->lm_head;
    }
}

int qt_merge_set_unties(const qt_merge_set *s) { return s->untie; }
int qt_merge_set_dequantizes(const qt_merge_set *s) { return s->dequant ? s->dq_count : 0; }

int qt_merge_set_count(const qt_merge_set *s) {
    int n = 0;
    for (int k = 0; k < s->n_items; k++) n += s->items[k].a || s->items[k].full;
    return n;
}
float qt_merge_set_scaling(const qt_merge_set *s) { return s->scaling; }

/* Writes the whole merged folder into stage. */
static int write_stage(const char *model_dir, const char *stage, st_file *base, qt_merge_set *set, int out_dtype,
                       volatile sig_atomic_t *stop, qt_progress *prog) {
    st_writer *wr = NULL;
    qt_rm_rf(stage); /* a left-over of a killed merge that had this pid */
    QT_TRY(qt_mkdir_p(stage)); /* with the parents of a new OUT (qt_merge_stage_path's top) */
    QT_TRY(st_writer_new(&wr));
    st_writer_set_stop(wr, stop);
    st_writer_refuse_nonfinite(wr); /* what generate, eval and train refuse to load */
    int rc = QT_OK;
    for (int i = 0; rc == QT_OK && i < st_count(base); i++) {
        const st_tensor *t = st_at(base, i);
        qt_dtype dt = out_dtype < 0 ? t->dtype : (qt_dtype)out_dtype;
        st_fill_fn fill;
        void *ctx;
        if (set->dequant && bnb4_is_part(t->name)) continue; /* absmax, quant_map, ...: the weight is 16-bit now */
        qt_merge_set_lookup(set, t->name, &fill, &ctx);
        const merge_item *m = ctx;
        if (fill && m->q4w) { /* a 4-bit weight: written in its own shape, as the dtype it dequantizes to */
            const int64_t shape[2] = {m->rows, m->cols};
            rc = st_writer_add_fn(wr, t->name, out_dtype < 0 ? m->q4_dtype : (qt_dtype)out_dtype, 2, shape, fill, ctx);
        } else if (fill) rc = st_writer_add_fn(wr, t->name, dt, t->ndim, t->shape, fill, ctx);
        else rc = st_writer_add(wr, t->name, dt, t->ndim, t->shape, t->data, t->dtype);
    }
    /* untied from a tied base that held no lm_head.weight: it is written now */
    if (rc == QT_OK && set->untie && !st_find(base, "lm_head.weight")) {
        const st_tensor *src = set->lm_head.full;
        rc = st_writer_add_fn(wr, "lm_head.weight", out_dtype < 0 ? set->lm_head_dtype : (qt_dtype)out_dtype, src->ndim,
                              src->shape, merge_fill, &set->lm_head);
    }
    char path[4096];
    if (rc == QT_OK) rc = st_writer_set_metadata(wr, "format", "pt");
    if (rc == QT_OK) rc = qt_path_join(path, sizeof path, stage, "model.safetensors");
    if (rc == QT_OK && prog) {
        prog->total = st_writer_bytes(wr) / 1e6;
        st_writer_set_progress(wr, prog);
    }
    if (rc == QT_OK) rc = st_writer_write(wr, path);
    qt_progress_end(prog);
    st_writer_free(wr);
    if (rc == QT_OK)
        rc = copy_side_files(model_dir, stage, out_dtype < 0 && set->dequant ? (int)set->dq_dtype : out_dtype, set->untie,
                             set->dequant);
    return rc;
}

/* Moves the complete staged folder into place: renamed as a whole when out
 * does not exist yet, else file by file (each rename atomic), so files of out
 * that merge does not write are kept; the emptied stage is removed. */
static int commit_stage(const char *stage, const char *out) {
    if (!qt_path_exists(out)) return qt_dir_replace(stage, out);
    DIR *d = opendir(stage);
    if (!d) return QT_ERR(QT_EIO, "cannot read %s: %s", stage, strerror(errno));
    int rc = QT_OK;
    for (struct dirent *e; rc == QT_OK && (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char from[4096], to[4096];
        rc = qt_path_join(from, sizeof from, stage, e->d_name);
        if (rc == QT_OK) rc = qt_path_join(to, sizeof to, out, e->d_name);
        if (rc == QT_OK && rename(from, to) != 0)
            rc = QT_ERR(QT_EIO, "cannot move %s into %s: %s", from, out, strerror(errno));
    }
    closedir(d);
    if (rc == QT_OK) rc = qt_fsync_dir(out);
    if (rc == QT_OK) rmdir(stage);
    return rc;
}

/* --out, checked before anything is staged: not the model folder; not a
 * folder holding an adapter (transformers and PEFT load a folder with
 * adapter_config.json as that adapter on its base, so the merged weights
 * there would not be what loads); and below a folder, not a file. */
static int check_out(const char *model_dir, const char *out) {
    char rm[4096], ro[4096], p[4096], up[4096];
    if (realpath(model_dir, rm) && realpath(out, ro) && !strcmp(rm, ro))
        return QT_ERR(QT_EINVAL, "--out %s is the model folder itself; name a new folder for the merged model", out);
    if (qt_path_exists(out) && !qt_is_dir(out))
        return QT_ERR(QT_EINVAL, "--out %s exists and is not a folder; name a folder for the merged model", out);
    if (qt_path_join(p, sizeof p, out, "adapter_config.json") == QT_OK && qt_path_exists(p))
        return QT_ERR(QT_EINVAL, "--out %s holds an adapter (adapter_config.json), and a folder with one loads as "
                      "that adapter, not as the merged model; name a new folder for the merged model", out);
    qt_error_clear();
    snprintf(p, sizeof p, "%s", out);
    for (;;) { /* the nearest existing ancestor must be a folder to create out in */
        qt_path_dirname(up, sizeof up, p);
        if (!strcmp(up, p)) break;
        snprintf(p, sizeof p, "%s", up);
        if (!qt_path_exists(p)) continue;
        if (!qt_is_dir(p))
            return QT_ERR(QT_EINVAL, "--out %s is inside %s, which is a file, not a folder; name a folder for the "
                          "merged model", out, p);
        break;
    }
    return QT_OK;
}

int qt_merge_stage_path(const char *out_dir, char *stage, size_t stage_cap, char *top, size_t top_cap) {
    char out[4096];
    size_t n = strlen(out_dir);
    while (n > 1 && out_dir[n - 1] == '/') n--;
    if (n >= sizeof out || !n) return QT_ERR(QT_EINVAL, "--out %.200s: path too long", out_dir);
    snprintf(out, sizeof out, "%.*s", (int)n, out_dir);
    /* the staging folder is on out's filesystem, so the renames are atomic:
     * inside an existing out (whose parent may not be writable), else beside
     * it, to be renamed as a whole */
    int w = qt_is_dir(out) ? snprintf(stage, stage_cap, "%s/" MERGE_STAGE_IN ".tmp.%ld", out, (long)getpid())
                           : snprintf(stage, stage_cap, "%s.tmp.%ld", out, (long)getpid());
    if (w < 0 || (size_t)w >= stage_cap) return QT_ERR(QT_EINVAL, "--out %.200s: path too long", out_dir);
    QT_TRY(qt_path_missing_top(stage, top, top_cap));
    if (!top[0]) snprintf(top, top_cap, "%s", stage); /* a left-over stage of this pid: it is removed first */
    return QT_OK;
}

int qt_merge_adapter(const char *model_dir, const char *adapter_dir, const char *out_dir, int out_dtype,
                     volatile sig_atomic_t *stop) {
    return qt_merge_adapter_progress(model_dir, NULL, adapter_dir, out_dir, out_dtype, stop, NULL);
}

#define ORIGIN_HINT "give the folder it was quantized from, or leave --base16 out to merge into its dequantized weights"

/* Whether dir16 is the 16-bit folder the bitsandbytes folder bnb_dir was
 * made from: each 4-bit weight's tensor there has its shape and quantizes
 * (bnb_dir's type and blocksize; bitsandbytes' own arithmetic, core/quant4.h)
 * to the same codes, but for at most 1 in 1000 (a value on a rounding
 * threshold that another copy of the weights, an f32 one, puts on the other
 * side); every other tensor of bnb_dir is there with its shape and, stored
 * in the same dtype, its bytes. *rel: ||W - dequant(W)|| / ||W|| over the
 * 4-bit weights, the difference between the model the adapter was trained
 * on and the one it is merged into; *mism: codes that differed. */
static int check_origin(const char *bnb_dir, st_file *bnb, const char *dir16, st_file *b16, double *rel,
                        size_t *mism) {
    double dd = 0.0, ww = 0.0;
    *mism = 0;
    for (int i = 0; i < st_count(bnb); i++) {
        const st_tensor *t = st_at(bnb, i), *u = st_find(b16, t->name);
        if (bnb4_is_part(t->name)) continue;
        const int q = bnb4_is_weight(bnb, t);
        qt_q4_weight *q4 = NULL;
        size_t bytes;
        if (q) QT_TRY(bnb4_read(bnb, bnb_dir, t, -1, -1, &q4, &bytes));
        const int64_t r = q ? (int64_t)q4->rows : t->shape[0], c = q ? (int64_t)q4->cols : t->ndim > 1 ? t->shape[1] : 1;
        int rc = QT_OK;
        if (!u)
            rc = QT_ERR(QT_EINVAL, "--base16 %s has no %s, which %s holds: it is not the 16-bit folder %s was made from; "
                        ORIGIN_HINT, dir16, t->name, bnb_dir, bnb_dir);
        else if ((q ? u->ndim != 2 : u->ndim != t->ndim) || u->shape[0] != r || (u->ndim > 1 ? u->shape[1] : 1) != c)
            rc = QT_ERR(QT_EINVAL, "--base16 %s: %s is [%lld, %lld] but %s's is [%lld, %lld]: it is not the 16-bit folder "
                        "%s was made from; " ORIGIN_HINT, dir16, t->name, (long long)u->shape[0],
                        (long long)(u->ndim > 1 ? u->shape[1] : 1), bnb_dir, (long long)r, (long long)c, bnb_dir);
        else if (!q && u->dtype == t->dtype && memcmp(u->data, t->data, t->nbytes))
            rc = QT_ERR(QT_EINVAL, "--base16 %s: %s holds other values than %s's (which 4-bit quantization leaves as "
                        "they are): it is not the 16-bit folder %s was made from; " ORIGIN_HINT, dir16, t->name,
                        bnb_dir, bnb_dir);
        if (rc != QT_OK || !q) {
            qt_free(q4);
            if (rc != QT_OK) return rc;
            continue;
        }
        const size_t n = (size_t)r * (size_t)c, nb = (n + q4->blocksize - 1) / q4->blocksize;
        float *x = qt_malloc(n * sizeof(float), "merge: a 16-bit weight"), *dq = qt_malloc(n * sizeof(float), "merge: a "
                                                                                            "dequantized weight");
        float *am = qt_malloc(nb * sizeof(float), "merge: absmax");
        uint8_t *codes = qt_malloc((n + 1) / 2, "merge: 4-bit codes");
        rc = x && dq && am && codes ? st_read_f32(u, x) : QT_ENOMEM;
        size_t bad = 0;
        if (rc == QT_OK) {
            qt_q4_quantize((qt_q4_type)q4->type, x, n, (int)q4->blocksize, codes, am);
            const uint8_t *theirs = qt_q4_packed(q4);
            for (size_t k = 0; k < (n + 1) / 2; k++) { /* two codes a byte; an odd n leaves the last low nibble */
                const uint8_t d = codes[k] ^ theirs[k];
                bad += (d & 0xf0) != 0;
                bad += 2 * k + 1 < n && (d & 0x0f) != 0;
            }
            qt_q4_dequantize(q4, 0, n, dq);
            for (size_t k = 0; k < n; k++) dd += ((double)x[k] - dq[k]) * ((double)x[k] - dq[k]), ww += (double)x[k] * x[k];
        }
        if (rc == QT_OK && bad * 1000 > n)
            rc = QT_ERR(QT_EINVAL, "--base16 %s: %s quantizes (%s, blocks of %u) to codes that differ from %s's in "
                        "%.1f%% of its values: it is not the 16-bit folder %s was made from; " ORIGIN_HINT, dir16,
                        t->name, qt_q4_type_name((qt_q4_type)q4->type), q4->blocksize, bnb_dir, 100.0 * (double)bad / (double)n,
                        bnb_dir);
        *mism += bad;
        qt_free(x);
        qt_free(dq);
        qt_free(am);
        qt_free(codes);
        qt_free(q4);
        if (rc != QT_OK) return rc;
    }
    *rel = ww > 0 ? sqrt(dd / ww) : 0.0;
    return QT_OK;
}

int qt_merge_adapter_progress(const char *model_dir, const char *base16, const char *adapter_dir, const char *out_dir,
                              int out_dtype, volatile sig_atomic_t *stop, qt_progress *prog) {
    st_file *base = NULL;
    qt_merge_set *set = NULL;
    double rel = 0.0;
    size_t mism = 0;
    char bnb_desc[64] = "";
    QT_TRY(qt_merge_open_model(model_dir, &base));
    if (base16) { /* checked against the 4-bit folder, then merged into as any 16-bit base */
        qt_config cfg;
        st_file *b16 = NULL;
        int rc = qt_config_load(model_dir, &cfg);
        if (rc == QT_OK && !cfg.prequant4)
            rc = QT_ERR(QT_EINVAL, "--base16 names the 16-bit origin of a bitsandbytes 4-bit --model, but %s is no "
                        "4-bit folder (no quantization_config); merge into it without --base16", model_dir);
        if (rc == QT_OK) rc = qt_merge_open_model(base16, &b16);
        if (rc == QT_OK) rc = check_origin(model_dir, base, base16, b16, &rel, &mism);
        if (rc == QT_OK)
            snprintf(bnb_desc, sizeof bnb_desc, "%s%s", cfg.prequant4_type ? "fp4" : "nf4",
                     cfg.prequant4_nested ? ", double-quantized" : "");
        st_close(base);
        base = b16;
        if (rc != QT_OK) {
            st_close(base);
            return rc;
        }
    }
    const char *bnb_dir = model_dir;
    if (base16) model_dir = base16;
    char out[4096], stage[4200], top[4200];
    int rc = QT_OK;
    size_t n = strlen(out_dir);
    while (n > 1 && out_dir[n - 1] == '/') n--;
    if (n >= sizeof out || !n) rc = QT_ERR(QT_EINVAL, "--out %.200s: path too long", out_dir);
    if (rc == QT_OK) {
        snprintf(out, sizeof out, "%.*s", (int)n, out_dir);
        rc = check_out(model_dir, out);
    }
    if (rc == QT_OK) rc = qt_merge_stage_path(out, stage, sizeof stage, top, sizeof top);
    if (rc == QT_OK) rc = qt_merge_set_open(model_dir, adapter_dir, base, &set);
    /* what a merge killed before its renames (kill -9) left: OUT.tmp.PID beside OUT, OUT/.qtune-merge.tmp.PID */
    char inside[4200];
    int removed = 0, removed_in = 0;
    if (rc == QT_OK) rc = qt_remove_dead_tmps(out, &removed);
    if (rc == QT_OK && qt_is_dir(out) && snprintf(inside, sizeof inside, "%s/" MERGE_STAGE_IN, out) < (int)sizeof inside)
        rc = qt_remove_dead_tmps(inside, &removed_in);
    if (removed + removed_in)
        qt_info("removed %d staging folder(s) that a killed merge into %s left", removed + removed_in, out);
    int staged = 0;
    if (rc == QT_OK) {
        staged = 1;
        rc = write_stage(model_dir, stage, base, set, out_dtype, stop, prog);
    }
    /* a last look at the flag: once the renames start, a signal no longer undoes the merge */
    if (rc == QT_OK && stop && *stop) rc = QT_EINTERRUPTED;
    if (rc == QT_OK) rc = commit_stage(stage, out);
    if (rc == QT_EINTERRUPTED)
        QT_ERR(QT_EINTERRUPTED, "merge interrupted; the partial output was removed and %s was left as it was", out);
    if (rc == QT_ENUMERIC && staged) { /* the writer named the tensor of the merged model */
        char what[512];
        snprintf(what, sizeof what, "%s", qt_error_message());
        QT_ERR(rc, "the merge of %s into %s: %s; qtune writes no NaN or infinite weights (generate, eval and train "
               "refuse them), so nothing was written and %s was left as it was", adapter_dir, model_dir, what, out);
    }
    if (rc != QT_OK && staged) {
        qt_rm_rf(stage);
        qt_rmdir_made(stage, top); /* the parent folders made for a new out, while empty */
    }
    if (rc == QT_OK)
        qt_info("merged %d LoRA weights (scaling %g) into %s%s", qt_merge_set_count(set),
                (double)qt_merge_set_scaling(set), out_dir,
                set->untie ? "; modules_to_save on a tied model: its embedding and lm_head are now separate "
                             "(tie_word_embeddings false)" : "");
    /* which weights the adapter went into, and how they differ from the ones it was trained on */
    if (rc == QT_OK && set->dequant)
        qt_info("merged into the dequantized 4-bit weights of %s (%s%s, %d weights written as %s): the weights the "
                "adapter was trained on, with their 4-bit rounding; to merge into the original 16-bit weights instead "
                "(they differ from these by that rounding, which it then measures), add --base16 and the folder %s "
                "was quantized from", bnb_dir, set->dq_type ? "fp4" : "nf4",
                set->dq_nested ? ", double-quantized" : "", set->dq_count,
                qt_dtype_name(out_dtype < 0 ? set->dq_dtype : (qt_dtype)out_dtype), bnb_dir);
    if (rc == QT_OK && base16)
        qt_info("merged into the original 16-bit weights of %s, checked to be what %s was quantized from (%s; %zu of "
                "the 4-bit codes differ); the adapter was trained on the 4-bit weights, which differ from these by "
                "%.3g%% of their norm (||W - dequant(W)|| / ||W||): the merged model is the original base plus the "
                "adapter, as PEFT's merge into the 16-bit base gives", base16, bnb_dir, bnb_desc, mism, 100.0 * rel);
    qt_merge_set_free(set);
    st_close(base);
    return rc;
}
