/* Parameters by name (params_io.h). */
#include "model/params_io.h"

#include "backend/backend.h"
#include "core/error.h"
#include "core/mem.h"
#include "model/model_internal.h"

float *qt_model_small_of(const qt_model *m, size_t offset) {
    for (int k = 0; k < m->n_small_runs; k++)
        if (m->small_runs[k].flat == offset) return m->small + m->small_runs[k].at;
    return NULL;
}

/* Host staging for reads: at most STAGE_FLOATS at a time. */
#define STAGE_FLOATS ((size_t)1 << 20)

int qt_model_read_to_device(qt_model *m, const st_tensor *t, float *dev) {
    size_t n = (size_t)t->numel, chunk = n < STAGE_FLOATS ? n : STAGE_FLOATS;
    float *stage = qt_malloc(sizeof(float) * (chunk ? chunk : 1), "model: staging buffer");
    if (!stage) return QT_ENOMEM;
    int rc = QT_OK;
    for (size_t off = 0; off < n && rc == QT_OK; off += chunk) {
        size_t k = n - off < chunk ? n - off : chunk;
        rc = st_read_f32_range(t, off, k, stage);
        if (rc == QT_OK) qt_be_upload(m->be, dev + off, stage, sizeof(float) * k);
    }
    qt_free(stage);
    return rc;
}

/* Sharded master: every rank reads the whole tensor, a chunk at a time
 * through a device staging buffer, into the compute copy (rounded by the
 * backend, as qt_model_weights_updated rounds), its own range of the master
 * and, for a 1-D tensor, the f32 copy. */
static int read_param_sharded(qt_model *m, int i, const st_tensor *t) {
    const qt_param *p = &m->params[i];
    qt_backend *be = m->be;
    float *small = qt_model_small_of(m, p->offset); /* NULL: not a 1-D tensor */
    size_t n = p->numel, chunk = n < STAGE_FLOATS ? n : STAGE_FLOATS;
    float *stage = qt_malloc(sizeof(float) * (chunk ? chunk : 1), "model: staging buffer");
    float *dev = qt_be_alloc(be, QT_MEM_DEVICE, sizeof(float) * (chunk ? chunk : 1), "model: staging buffer");
    int rc = stage && dev ? QT_OK : QT_ENOMEM;
    for (size_t off = 0; off < n && rc == QT_OK; off += chunk) {
        size_t k = n - off < chunk ? n - off : chunk, f = p->offset + off;
        rc = st_read_f32_range(t, off, k, stage);
        if (rc != QT_OK) break;
        qt_be_upload(be, dev, stage, sizeof(float) * k);
        size_t a = f > m->mlo ? f : m->mlo, e = f + k < m->mhi ? f + k : m->mhi;
        if (!m->pshard) qt_be_convert(be, m->wcopy + f, m->opts.compute, dev, QT_F32, k);
        else if (m->wcopy && e > a) /* ZeRO-3: only this rank's shard of the compute copy */
            qt_be_convert(be, m->wcopy + (a - m->mlo), m->opts.compute, dev + (a - f), QT_F32, e - a);
        if (e > a) qt_be_copy(be, m->master + (a - m->mlo), dev + (a - f), sizeof(float) * (e - a));
        if (small) qt_be_copy(be, small + off, dev, sizeof(float) * k);
    }
    qt_free(stage);
    qt_be_free(be, dev);
    return rc;
}

int qt_model_read_param(qt_model *m, int i, const st_tensor *t) {
    if (m->sharded) return read_param_sharded(m, i, t);
    return qt_model_read_to_device(m, t, m->master + m->params[i].offset);
}

static int fill_param(void *ctx, float *dst, size_t offset, size_t n) {
    const qt_param_src *s = ctx;
    if (s->m->sharded) {
        if (!s->m->gather)
            return QT_ERR(QT_EINVAL, "model: the master is sharded and no gather is set to write it (a bug)");
        return s->m->gather(s->m->gather_user, dst, s->offset + offset, n);
    }
    qt_be_download(s->m->be, dst, s->m->master + s->offset + offset, sizeof(float) * n);
    return QT_OK;
}

void qt_model_param_source(const qt_model *m, int i, st_fill_fn *fill, void **ctx) {
    *fill = fill_param;
    *ctx = &m->param_src[i];
}

int qt_model_write_params(const qt_model *m, st_writer *w, qt_dtype dtype) {
    for (int i = 0; i < m->n_params; i++) {
        const qt_param *p = &m->params[i];
        QT_TRY(st_writer_add_fn(w, p->name, dtype, p->ndim, p->shape, fill_param, &m->param_src[i]));
    }
    return QT_OK;
}

void qt_model_peft_tensors(const qt_model *m, peft_tensor *out) {
    for (int i = 0; i < m->n_params; i++) {
        const qt_param *p = &m->params[i];
        out[i] = (peft_tensor){.name = p->name, .shape = {p->shape[0], p->ndim == 2 ? p->shape[1] : 1}};
        qt_model_param_source(m, i, &out[i].fill, &out[i].ctx);
    }
}
