/* qt_merge_adapter: W' = W + (B @ A) * scaling, streamed tensor by tensor. */
#include "train/merge.h"

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "core/mem.h"
#include "io/model_folder.h"
#include "io/peft.h"
#include "io/safetensors.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

/* One adapted weight: W (out, in), A (r, in), B (out, r). */
typedef struct {
    const st_tensor *w;
    const st_tensor *a, *b;
    float *af;   /* (r, in) f32 */
    float *bf;   /* (out, r) f32 */
    float *tmp;  /* (in) one row of B @ A */
    float scaling;
    int r;
} merge_item;

/* Fills merged elements [off, off + n) of W' in row-major order. */
static int merge_fill(void *ctx, float *dst, size_t off, size_t n) {
    merge_item *m = ctx;
    const size_t in = (size_t)m->w->shape[1], es = qt_dtype_size(m->w->dtype);
    qt_convert_to_f32(dst, (const char *)m->w->data + off * es, m->w->dtype, n);
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

static int copy_side_files(const char *src, const char *dst, int out_dtype) {
    QT_TRY(qt_model_copy_side_files(src, dst));
    char s[4096], d[4096];
    /* config.json: as it was, with torch_dtype set when the dtype changes */
    QT_TRY(qt_path_join(s, sizeof s, src, "config.json"));
    QT_TRY(qt_path_join(d, sizeof d, dst, "config.json"));
    if (out_dtype < 0) return qt_copy_file(s, d);
    char *text;
    QT_TRY(qt_read_file(s, 1 << 24, &text, NULL));
    cJSON *j = cJSON_Parse(text);
    qt_free(text);
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        return QT_ERR(QT_EFORMAT, "%s is not a JSON object", s);
    }
    static const char *const names[] = {"float32", "float16", "bfloat16"};
    cJSON *dt = cJSON_CreateString(names[out_dtype]);
    if (cJSON_GetObjectItemCaseSensitive(j, "torch_dtype")) cJSON_ReplaceItemInObjectCaseSensitive(j, "torch_dtype", dt);
    else cJSON_AddItemToObject(j, "torch_dtype", dt);
    char *out = cJSON_Print(j);
    cJSON_Delete(j);
    if (!out) return QT_ERR(QT_ENOMEM, "out of memory writing %s", d);
    int rc = qt_write_file_atomic(d, out, strlen(out));
    free(out);
    return rc;
}

int qt_merge_adapter(const char *model_dir, const char *adapter_dir, const char *out_dir, int out_dtype) {
    char rm[4096], ro[4096];
    if (realpath(model_dir, rm) && realpath(out_dir, ro) && !strcmp(rm, ro))
        return QT_ERR(QT_EINVAL, "--out %s is the model folder itself; name a new folder for the merged model", out_dir);
    peft_config pc;
    QT_TRY(peft_config_load(adapter_dir, &pc));
    const float scaling = peft_scaling(&pc);
    st_file *base = NULL, *ad = NULL;
    QT_TRY(st_open(model_dir, &base));
    int rc = peft_open_weights(adapter_dir, &ad);
    if (rc != QT_OK) { st_close(base); return rc; }

    int na = st_count(ad), n_items = 0;
    merge_item *items = qt_calloc((size_t)(na > 0 ? na : 1), sizeof *items, "merge list");
    if (!items) rc = QT_ENOMEM;
    /* pair each adapter A/B with its base weight, checking every shape */
    for (int i = 0; i < na && rc == QT_OK; i++) {
        const st_tensor *t = st_at(ad, i);
        char wname[512];
        int is_b;
        if (!peft_base_name(t->name, wname, sizeof wname, &is_b)) {
            rc = QT_ERR(QT_EUNSUPPORTED, "%s: tensor %s is not a LoRA A/B weight; qtune merges plain LoRA adapters",
                        adapter_dir, t->name);
            break;
        }
        const st_tensor *w = st_find(base, wname);
        if (!w) {
            rc = QT_ERR(QT_EINVAL, "%s: %s adapts %s, which %s does not have; is this the adapter's base model?",
                        adapter_dir, t->name, wname, model_dir);
            break;
        }
        int k = 0;
        while (k < n_items && items[k].w != w) k++;
        if (k == n_items) { items[k].w = w; n_items++; }
        if (is_b) items[k].b = t;
        else items[k].a = t;
    }
    for (int k = 0; k < n_items && rc == QT_OK; k++) {
        merge_item *m = &items[k];
        const st_tensor *w = m->w;
        if (!m->a || !m->b) {
            rc = QT_ERR(QT_EFORMAT, "%s: %s has a lora_%s but no lora_%s", adapter_dir, w->name, m->a ? "A" : "B",
                        m->a ? "B" : "A");
            break;
        }
        if (w->ndim != 2 || m->a->ndim != 2 || m->b->ndim != 2 || m->a->shape[0] != pc.r || m->b->shape[1] != pc.r ||
            m->a->shape[1] != w->shape[1] || m->b->shape[0] != w->shape[0]) {
            rc = QT_ERR(QT_EFORMAT,
                        "%s: the LoRA of %s has A [%lld, %lld] and B [%lld, %lld], which do not fit the weight "
                        "[%lld, %lld] with r = %d",
                        adapter_dir, w->name, (long long)m->a->shape[0], (long long)m->a->shape[1],
                        (long long)m->b->shape[0], (long long)m->b->shape[1], (long long)w->shape[0],
                        (long long)(w->ndim > 1 ? w->shape[1] : 0), pc.r);
            break;
        }
        m->r = pc.r;
        m->scaling = scaling;
        m->af = qt_malloc(m->a->numel * sizeof(float), "LoRA A");
        m->bf = qt_malloc(m->b->numel * sizeof(float), "LoRA B");
        m->tmp = qt_malloc((size_t)w->shape[1] * sizeof(float), "merge row");
        if (!m->af || !m->bf || !m->tmp) { rc = QT_ENOMEM; break; }
        rc = st_read_f32(m->a, m->af);
        if (rc == QT_OK) rc = st_read_f32(m->b, m->bf);
    }

    st_writer *wr = NULL;
    if (rc == QT_OK) rc = qt_mkdir_p(out_dir);
    if (rc == QT_OK) rc = st_writer_new(&wr);
    for (int i = 0; rc == QT_OK && i < st_count(base); i++) {
        const st_tensor *t = st_at(base, i);
        qt_dtype dt = out_dtype < 0 ? t->dtype : (qt_dtype)out_dtype;
        int k = 0;
        while (k < n_items && items[k].w != t) k++;
        if (k < n_items) rc = st_writer_add_fn(wr, t->name, dt, t->ndim, t->shape, merge_fill, &items[k]);
        else rc = st_writer_add(wr, t->name, dt, t->ndim, t->shape, t->data, t->dtype);
    }
    char path[4096];
    if (rc == QT_OK) rc = st_writer_set_metadata(wr, "format", "pt");
    if (rc == QT_OK) rc = qt_path_join(path, sizeof path, out_dir, "model.safetensors");
    if (rc == QT_OK) rc = st_writer_write(wr, path);
    if (rc == QT_OK) rc = copy_side_files(model_dir, out_dir, out_dtype);
    if (rc == QT_OK) qt_info("merged %d LoRA weights (scaling %g) into %s", n_items, (double)scaling, out_dir);
    st_writer_free(wr);
    for (int k = 0; k < n_items; k++) {
        qt_free(items[k].af);
        qt_free(items[k].bf);
        qt_free(items[k].tmp);
    }
    qt_free(items);
    st_close(ad);
    st_close(base);
    return rc;
}
