/* Loading a Qwen2/Llama model folder into the blocks the memory plan sizes:
 *  - full fine-tuning: every weight is read (any file dtype) into the flat
 *    fp32 master block, in the order of the parameter table (HF names); in
 *    f16/bf16 a 2-byte compute copy of it is what the matmuls read;
 *  - LoRA / inference: the base stays in the safetensors mapping in its file
 *    dtype (matrices and the embedding), except that LoRA training in
 *    f16/bf16 converts it once to the compute dtype; only norm weights and biases are
 *    converted to a small f32 block. The LoRA A/B matrices are the master
 *    block: A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming_uniform(a=sqrt(5))),
 *    B = 0.
 * Every block is the backend's device memory (m->be): file contents reach it
 * through a small host staging buffer and upload, or import_mapped for the
 * frozen base; this file never writes a device buffer itself. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "backend/backend.h"
#include "core/error.h"
#include "core/log.h"
#include "core/mem.h"
#include "core/rng.h"
#include "core/quant4.h"
#include "io/bnb4.h"
#include "model/model_internal.h"
#include "model/params_io.h"
#include "model/precision.h"

#define LORA_INIT_SALT 0x4c6f5241ull /* "LoRA": the A-init stream, apart from dropout's */

void qt_model_opts_default(qt_model_opts *o) {
    memset(o, 0, sizeof *o);
    o->compute = QT_F32;
    o->lora_r = 8;
    o->lora_alpha = 8.0f;
    o->lora_targets = QT_LORA_Q | QT_LORA_V;
    o->max_B = 1;
    o->max_T = 512;
    o->seed = 42;
    o->device_index = -1;
    o->param_reuse_distance = 1e9;
}

static int check_config(const qt_config *c, const char *dir) {
    if (c->vocab_size < 1 || c->hidden_size < 1 || c->intermediate_size < 1 || c->num_hidden_layers < 1 ||
        c->num_attention_heads < 1 || c->num_key_value_heads < 1 || c->head_dim < 2)
        return QT_ERR(QT_EFORMAT, "%s/config.json: a model size field is zero or negative; fix config.json", dir);
    if (c->num_attention_heads % c->num_key_value_heads)
        return QT_ERR(QT_EFORMAT,
                      "%s/config.json: num_attention_heads (%d) is not a multiple of num_key_value_heads (%d)", dir,
                      c->num_attention_heads, c->num_key_value_heads);
    if (c->head_dim % 2 || c->head_dim > 1024)
        return QT_ERR(QT_EUNSUPPORTED, "%s/config.json: head_dim %d must be even and at most 1024", dir, c->head_dim);
    return QT_OK;
}

static int check_opts(const qt_model_opts *o) {
    if (!o->infer) QT_TRY(qt_precision_check(o->compute, o->backend));
    if (o->max_B < 1 || o->max_T < 1)
        return QT_ERR(QT_EINVAL, "model options: max_B and max_T must be at least 1 (got %d, %d)", o->max_B, o->max_T);
    if (o->decode_seqs < 0 || (size_t)o->decode_seqs > (size_t)o->max_B * (size_t)o->max_T)
        return QT_ERR(QT_EINVAL, "model options: decode_seqs %d is outside [0, max_B * max_T = %lld]; raise max_B",
                      o->decode_seqs, (long long)o->max_B * o->max_T);
    if (o->lora) {
        if (o->lora_r < 1) return QT_ERR(QT_EINVAL, "lora.r must be at least 1 (got %d)", o->lora_r);
        if (!(o->lora_targets & 0x7f))
            return QT_ERR(QT_EINVAL, "lora.target_modules names none of q_proj, k_proj, v_proj, o_proj, gate_proj, "
                                     "up_proj, down_proj");
        if (!(o->lora_dropout >= 0.0f && o->lora_dropout < 1.0f))
            return QT_ERR(QT_EINVAL, "lora.lora_dropout must be in [0, 1) (got %g)", o->lora_dropout);
    } else if (o->lora_save || o->lora_layers_set) {
        return QT_ERR(QT_EINVAL, "model options: modules_to_save and layers_to_transform need LoRA (opts.lora = 1)");
    }
    if (o->quant4 && !o->infer && !o->lora)
        return QT_ERR(QT_EINVAL, "a 4-bit base is frozen: full fine-tuning cannot update it; add a \"lora\" section "
                                 "(QLoRA) or drop \"quantization\"");
    if (o->quant4 && o->quant4_type != QT_Q4_NF4 && o->quant4_type != QT_Q4_FP4)
        return QT_ERR(QT_EINVAL, "model options: quant4_type %d is neither nf4 nor fp4", o->quant4_type);
    return QT_OK;
}

/* 1 when layer linear j is quantized at load. */
static int lin_quantized(const qt_model *m, int j) {
    return m->opts.quant4 && !(m->opts.quant4_skip & qt_lin_flag[j]);
}


static float *find_param(qt_model *m, float *block, const char *name) {
    if (!block) return NULL;
    for (int i = 0; i < m->n_params; i++)
        if (!strcmp(m->params[i].name, name)) return block + m->params[i].offset;
    return NULL;
}

/* A trainable tensor's gradient: in the gradient block, or with gradient
 * windows in its bucket's window (grad_windows.c), the final norm's window,
 * or for the embedding and lm_head a non-NULL mark (the backward hands them
 * over as rows and slices, see qwen2.c). */
static float *grad_param(qt_model *m, const char *name) {
    const qt_grad_win_state *w = &m->grad_win;
    if (!w->block) return find_param(m, m->grads, name);
    for (int i = 0; i < m->n_params; i++) {
        const qt_param *p = &m->params[i];
        if (strcmp(p->name, name)) continue;
        if (p->layer >= 0) return w->grad_at[i];
        char norm[160];
        snprintf(norm, sizeof norm, "%s.weight", qt_config_layout(&m->cfg)->final_norm);
        if (!strcmp(name, norm)) return w->at.norm; /* model.norm, or the original Qwen's transformer.ln_f */
        return w->slice[0];
    }
    return NULL;
}

/* The mapping's pages of a tensor that was copied are not read again: hand
 * them back so the resident size holds only the copy (the mapping is a
 * read-only file mapping, so a later read would fault them back in). */
static void drop_mapped_pages(const void *p, size_t n) {
    const uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE), a = ((uintptr_t)p + pg - 1) & ~(pg - 1),
                    e = ((uintptr_t)p + n) & ~(pg - 1);
    if (e > a) madvise((void *)a, e - a, MADV_DONTNEED);
}

static int own(qt_model *m, void *p) {
    void **owned = qt_realloc(m->owned, sizeof(void *) * (size_t)(m->n_owned + 1), "model: copied tensor list");
    if (!owned) return QT_ENOMEM;
    m->owned = owned;
    m->owned[m->n_owned++] = p;
    return QT_OK;
}

static int import(qt_model *m, const st_tensor *t, const void **dev, const char *name) {
    const void **imp = qt_realloc(m->imported, sizeof(void *) * (size_t)(m->n_imported + 1), "model: tensor list");
    if (!imp) return QT_ENOMEM;
    m->imported = imp;
    QT_TRY(qt_be_import_mapped(m->be, t->data, t->nbytes, dev, name));
    m->imported[m->n_imported++] = *dev;
    return QT_OK;
}

/* A frozen layer matrix quantized to 4 bits from the file's mapping: the
 * block built on the host (one tensor at a time; the 16-bit tensor is only
 * ever the mapping, and its pages are handed back), then uploaded. Its
 * dequantized values round to the dtype the 16-bit path would hold: the
 * compute dtype when training in f16/bf16, else the file's. */
static int quant_matrix(qt_model *m, const st_tensor *t, int64_t d0, int64_t d1, qt_wref *w, const char *name) {
    qt_backend *be = m->be;
    if (strcmp(qt_be_desc(be)->name, "cpu") && strcmp(qt_be_desc(be)->name, "guard") && strcmp(qt_be_desc(be)->name, "cuda"))
        return QT_ERR(QT_EUNSUPPORTED, "a 4-bit base runs on the cpu and cuda backends only so far (not %s); use "
                                       "\"device\": \"cpu\" or drop \"quantization\"", qt_be_desc(be)->name);
    const qt_dtype cd = m->opts.compute;
    const qt_dtype dt = !m->infer && cd != QT_F32 ? cd : t->dtype;
    const size_t bytes = qt_q4_bytes((uint64_t)d0, (uint64_t)d1, QT_Q4_BLOCK, m->opts.quant4_nested);
    qt_q4_weight *host = qt_malloc(bytes, "model: 4-bit staging");
    if (!host) return QT_ENOMEM;
    qt_q4_init(host, (qt_q4_type)m->opts.quant4_type, dt, (uint64_t)d0, (uint64_t)d1, QT_Q4_BLOCK,
               m->opts.quant4_nested);
    int rc = qt_q4_quantize_weight(host, t->data, t->dtype);
    void *dev = rc == QT_OK ? qt_be_alloc(be, QT_MEM_DEVICE, bytes, name) : NULL;
    if (rc == QT_OK && !dev) rc = QT_ENOMEM;
    if (rc == QT_OK) rc = own(m, dev);
    if (rc == QT_OK) {
        qt_be_upload(be, dev, host, bytes);
        drop_mapped_pages(t->data, t->nbytes);
        m->quant_bytes += bytes;
        m->quant_src_bytes += t->nbytes;
        qt_progress_set(&m->quant_prog, ++m->quant_done);
        w->p = dev;
        w->dt = QT_Q4;
    }
    qt_free(host);
    return rc;
}

/* A layer matrix stored 4-bit as transformers saves bitsandbytes' Linear4bit
 * (io/bnb4.h): every size checked against its quant_state and the model's
 * shape, the parts copied into one block as quant_matrix builds it. */
static int prequant_matrix(qt_model *m, const st_tensor *t, const char *name, int64_t d0, int64_t d1, qt_wref *w) {
    qt_q4_weight *stage;
    size_t bytes;
    (void)name;
    QT_TRY(bnb4_read(m->st, m->dir, t, d0, d1, &stage, &bytes));
    /* dequantized values round to the weight's own dtype (quant_state.dtype); training in f16/bf16 they would
     * then be rounded again to the compute dtype, which qtune does not do: refused where the two differ */
    const qt_dtype cd = m->opts.compute, sdt = (qt_dtype)stage->dtype;
    int rc = QT_OK;
    if (!m->infer && cd != QT_F32 && sdt != cd)
        rc = QT_ERR(QT_EUNSUPPORTED, "%s: its 4-bit weights dequantize to %s (quant_state dtype) but the run computes "
                                     "in %s; set the DeepSpeed config's precision to %s", m->dir, qt_dtype_name(sdt),
                    qt_dtype_name(cd), qt_dtype_name(sdt));
    qt_backend *be = m->be;
    void *dev = rc == QT_OK ? qt_be_alloc(be, QT_MEM_DEVICE, bytes, t->name) : NULL;
    if (rc == QT_OK) rc = dev ? own(m, dev) : QT_ENOMEM;
    if (rc == QT_OK) {
        qt_be_upload(be, dev, stage, bytes);
        m->quant_bytes += bytes;
        m->quant_src_bytes += (size_t)d0 * (size_t)d1 * qt_dtype_size(sdt);
        qt_progress_set(&m->quant_prog, ++m->quant_done);
        w->p = dev;
        w->dt = QT_Q4;
    }
    qt_free(stage);
    return rc;
}

/* 1 when w's values are bf16 values: a bf16 weight, or a 4-bit one that
 * dequantizes to bf16. */
static int bf16_valued(qt_model *m, const qt_wref *w) {
    if (w->dt != QT_Q4) return w->dt == QT_BF16;
    qt_q4_weight hdr;
    qt_be_download(m->be, &hdr, w->p, sizeof hdr);
    return hdr.dtype == QT_BF16;
}

/* Rows [r0, r0 + rows) of a 4-bit matrix (the original Qwen's k and v in
 * its fused c_attn): a view header of its own in device memory. */
static int quant_rows(qt_model *m, const qt_wref *f, size_t r0, int rows, qt_wref *w) {
    qt_backend *be = m->be;
    qt_q4_weight hdr, view;
    qt_be_download(be, &hdr, f->p, sizeof hdr);
    void *dev = qt_be_alloc(be, QT_MEM_DEVICE, sizeof view, "model: 4-bit row view");
    if (!dev) return QT_ENOMEM;
    QT_TRY(own(m, dev));
    qt_q4_view(&hdr, f->p, dev, r0, (uint64_t)rows, &view);
    qt_be_upload(be, dev, &view, sizeof view);
    w->p = dev;
    w->dt = QT_Q4;
    return QT_OK;
}

/* Inference: a decode step reads every layer matrix and the lm_head whole,
 * once a token, so its speed is the speed of that read, and a read from the
 * file mapping's 4 KiB page-cache pages ran about 10% below the same read
 * from a copy in one block of anonymous memory on transparent huge pages
 * (docs/generate.md). So these matrices are copied into one block,
 * sized here, and their mapped pages handed back: the resident size stays one
 * copy, and loading costs one read of the file. An untied embedding is read
 * one row a token and stays mapped. The lm_head role's base matrix is named
 * by stream_vocab_name, which load_vocab_mats follows too. */
#define STREAM_ALIGN 64
static size_t stream_span(const st_tensor *t) { return (t->nbytes + STREAM_ALIGN - 1) / STREAM_ALIGN * STREAM_ALIGN; }
static const char *stream_vocab_name(const qt_model *m, const char *emb) {
    const unsigned sv = m->opts.lora ? m->opts.lora_save : 0;
    if (sv & QT_SAVE_LM_HEAD) return NULL; /* the lm_head is the trained copy */
    return m->cfg.tie_word_embeddings ? emb : "lm_head.weight";
}

static size_t stream_bytes(const qt_model *m, const char *emb) {
    const qt_config *c = &m->cfg;
    const qt_layout *ly = qt_config_layout(c);
    char name[160];
    size_t total = 0;
    const char *v = stream_vocab_name(m, emb);
    const st_tensor *t = v ? st_find(m->st, v) : NULL;
    if (t) total += stream_span(t);
    for (int l = 0; l < c->num_hidden_layers; l++)
        for (int j = 0; j < LIN_COUNT; j++) {
            if (!qt_lin_owns(c, j)) continue;
            snprintf(name, sizeof name, "%s.%d.%s.weight", ly->layers, l, ly->lin[j]);
            if (!lin_quantized(m, j) && (t = st_find(m->st, name))) total += stream_span(t);
        }
    return total;
}

/* LoRA at ZeRO-3: the next matrix of the base block (memplan.h
 * qt_model_base_block, in its order): this rank keeps the part that lies in
 * its shard, in the block's dtype, and the file's pages leave its memory; the
 * graph reads the matrix from the gather buffer of its layer (m->blayer, -1:
 * the V x C buffer). */
static int shard_matrix(qt_model *m, const st_tensor *t, int64_t d0, int64_t d1, qt_wref *w) {
    qt_backend *be = m->be;
    const size_t n = (size_t)d0 * (size_t)d1, off = m->bcur, es = qt_dtype_size(m->bdt);
    m->bcur += n;
    if (m->bcur > m->bn)
        return QT_ERR(QT_EINVAL, "model: the base block is larger than planned (%zu > %zu elements; a bug)", m->bcur,
                      m->bn);
    size_t a = off > m->blo ? off : m->blo, e = off + n < m->bhi ? off + n : m->bhi;
    if (e > a) {
        const size_t fs = qt_dtype_size(t->dtype);
        const void *src;
        QT_TRY(qt_be_import_mapped(be, (const char *)t->data + (a - off) * fs, (e - a) * fs, &src, t->name));
        char *dst = (char *)m->pbase + (a - m->blo) * es;
        if (t->dtype == m->bdt) qt_be_copy(be, dst, src, (e - a) * es);
        else qt_be_convert(be, dst, m->bdt, src, t->dtype, e - a);
        qt_be_release_mapped(be, src);
    }
    drop_mapped_pages(t->data, t->nbytes);
    if (m->blayer >= 0) w->p = (char *)m->gbuf[m->blayer & 1] + (off - m->glo[m->blayer]) * es;
    else w->p = m->gbuf[2];
    w->dt = m->bdt;
    return QT_OK;
}

/* A frozen base matrix, left in the mapping in its file dtype (imported: the
 * mapping itself on the cpu backend), copied into the stream block
 * (inference, streamed), or, training in f16/bf16, converted to the compute
 * dtype. */
static int base_matrix(qt_model *m, const char *name, int64_t d0, int64_t d1, qt_wref *w, int streamed, int quant) {
    const st_tensor *t;
    int64_t shape[2] = {d0, d1};
    if (m->cfg.prequant4 && (t = st_find(m->st, name)) && t->dtype == QT_U8) return prequant_matrix(m, t, name, d0, d1, w);
    QT_TRY(st_expect(m->st, name, 2, shape, &t));
    if (m->pbase) return shard_matrix(m, t, d0, d1, w);
    if (quant && !m->cfg.prequant4) return quant_matrix(m, t, d0, d1, w, name);
    qt_backend *be = m->be;
    w->dt = t->dtype;
    if (streamed && m->stream_block && m->stream_size - m->stream_used >= t->nbytes) {
        void *p = m->stream_block + m->stream_used;
        m->stream_used += stream_span(t);
        qt_be_upload(be, p, t->data, t->nbytes);
        drop_mapped_pages(t->data, t->nbytes);
        w->p = p;
        return QT_OK;
    }
    qt_dtype cd = m->opts.compute;
    if (!m->infer && cd != QT_F32 && t->dtype != cd) {
        /* training in f16/bf16 holds the frozen base in the compute dtype (the memory plan's compute_copy) */
        size_t n = (size_t)d0 * (size_t)d1;
        void *copy = qt_be_alloc(be, QT_MEM_DEVICE, n * qt_dtype_size(cd), name);
        if (!copy) return QT_ENOMEM;
        QT_TRY(own(m, copy));
        const void *src;
        QT_TRY(qt_be_import_mapped(be, t->data, t->nbytes, &src, name));
        qt_be_convert(be, copy, cd, src, t->dtype, n);
        qt_be_release_mapped(be, src);
        drop_mapped_pages(t->data, t->nbytes);
        w->p = copy;
        w->dt = cd;
        return QT_OK;
    }
    if (t->dtype == QT_F32 && ((uintptr_t)t->data & 3)) {
        /* sgemm wants aligned floats; a hand-written file may not give them */
        void *copy = qt_be_alloc(be, QT_MEM_DEVICE, t->nbytes, name);
        if (!copy) return QT_ENOMEM;
        QT_TRY(own(m, copy));
        qt_be_upload(be, copy, t->data, t->nbytes);
        w->p = copy;
        return QT_OK;
    }
    return import(m, t, &w->p, name);
}

static int base_vector(qt_model *m, const char *name, int64_t n, float *dst) {
    const st_tensor *t;
    QT_TRY(st_expect(m->st, name, 1, &n, &t));
    return qt_model_read_to_device(m, t, dst);
}

static int param_index(const qt_model *m, const char *name) {
    for (int i = 0; i < m->n_params; i++)
        if (!strcmp(m->params[i].name, name)) return i;
    return -1;
}

/* A trainable matrix as the matmuls read it: the master (f32) or its compute copy. */
static qt_wref compute_ref(qt_model *m, const char *name) {
    int i = param_index(m, name);
    if (i < 0) return (qt_wref){NULL, QT_F32};
    if (m->pshard) { /* ZeRO-3: in its gather buffer, wherever that layer's range starts */
        const qt_param *p = &m->params[i];
        size_t es = qt_dtype_size(m->opts.compute);
        char *b = p->layer >= 0 ? (char *)m->gbuf[p->layer & 1] + (p->offset - m->glo[p->layer]) * es : m->gbuf[2];
        return (qt_wref){b, m->opts.compute};
    }
    if (!m->wcopy) return (qt_wref){m->master + m->params[i].offset, QT_F32};
    return (qt_wref){m->wcopy + m->params[i].offset, m->opts.compute};
}

/* A trainable 1-D tensor (norm weight, bias) as the graph reads it, in f32:
 * the master, or with a sharded master its whole copy in small. */
static float *f32_param(qt_model *m, const char *name) {
    int i = param_index(m, name);
    if (i < 0) return NULL;
    return m->sharded ? qt_model_small_of(m, m->params[i].offset) : m->master + m->params[i].offset;
}

/* Sharded: the f32 copy of the 1-D tensors, one run each, in flat order. */
static int alloc_small(qt_model *m) {
    int k = 0;
    for (int i = 0; i < m->n_params; i++) k += m->params[i].ndim == 1;
    m->small_runs = qt_calloc((size_t)k + 1, sizeof *m->small_runs, "model: 1-D tensor table");
    if (!m->small_runs) return QT_ENOMEM;
    for (int i = 0; i < m->n_params; i++) {
        const qt_param *p = &m->params[i];
        if (p->ndim != 1) continue;
        m->small_runs[m->n_small_runs++] = (qt_flat_run){p->offset, p->numel, m->n_small};
        m->n_small += p->numel;
    }
    m->small = qt_be_alloc(m->be, QT_MEM_DEVICE, (m->n_small ? m->n_small : 1) * 4, "model: norm weights and biases (f32)");
    return m->small ? QT_OK : QT_ENOMEM;
}

/* ZeRO-3: each layer's flat range and the three gather buffers (memplan.c
 * qt_model_gather_sizes); the shard of the compute copy (f16/bf16) where
 * offload_param says. */
static int alloc_param_shard(qt_model *m) {
    const qt_config *c = &m->cfg;
    const int L = c->num_hidden_layers;
    const size_t es = qt_dtype_size(m->opts.compute);
    m->glo = qt_calloc((size_t)L + 1, sizeof *m->glo, "model: layer ranges");
    m->ghi = qt_calloc((size_t)L + 1, sizeof *m->ghi, "model: layer ranges");
    if (!m->glo || !m->ghi) return QT_ENOMEM;
    for (int l = 0; l < L; l++) m->glo[l] = (size_t)-1;
    for (int i = 0; i < m->n_params; i++) {
        const qt_param *p = &m->params[i];
        if (p->layer < 0) continue;
        if (p->offset < m->glo[p->layer]) m->glo[p->layer] = p->offset;
        if (p->offset + p->numel > m->ghi[p->layer]) m->ghi[p->layer] = p->offset + p->numel;
    }
    size_t layer, outer;
    qt_model_gather_sizes(c, &m->opts, &layer, &outer);
    for (int k = 0; k < 3; k++) {
        size_t n = (k < 2 ? layer : outer) * es;
        m->gbuf[k] = qt_be_alloc(m->be, QT_MEM_DEVICE, n ? n : 64, "model: ZeRO-3 gather buffer");
        if (!m->gbuf[k]) return QT_ENOMEM;
        m->gkey[k] = -1;
    }
    m->gmode = qt_model_outer_mode(c, &m->opts, NULL);
    if (m->opts.compute != QT_F32) {
        size_t n = (m->mhi - m->mlo) * es;
        m->wcopy = qt_be_alloc(m->be, m->opts.param_on_host ? QT_MEM_PINNED : QT_MEM_DEVICE, n ? n : 64,
                                "model: this rank's shard of the compute weights");
        if (!m->wcopy) return QT_ENOMEM;
    }
    return QT_OK;
}

/* LoRA at ZeRO-3: this rank's shard of the base block (on the host with
 * offload_param), each layer's range and the three gather buffers, in the
 * block's dtype (memplan.c counts the same). */
static int alloc_base_shard(qt_model *m) {
    const qt_config *c = &m->cfg;
    const int L = c->num_hidden_layers;
    size_t layer, outer;
    m->bn = qt_model_base_block(c, &m->opts, &layer, &outer);
    m->bdt = qt_model_base_block_dtype(c, &m->opts);
    qt_shard_range(m->bn, m->opts.param_shards, m->opts.master_rank, &m->blo, &m->bhi);
    const size_t es = qt_dtype_size(m->bdt), nb = (m->bhi - m->blo) * es;
    m->pbase = qt_be_alloc(m->be, m->opts.param_on_host ? QT_MEM_PINNED : QT_MEM_DEVICE, nb ? nb : 64,
                            "model: this rank's shard of the frozen base");
    m->glo = qt_calloc((size_t)L + 1, sizeof *m->glo, "model: layer ranges");
    m->ghi = qt_calloc((size_t)L + 1, sizeof *m->ghi, "model: layer ranges");
    if (!m->pbase || !m->glo || !m->ghi) return QT_ENOMEM;
    for (int k = 0; k < 3; k++) {
        size_t n = (k < 2 ? layer : outer) * es;
        m->gbuf[k] = qt_be_alloc(m->be, QT_MEM_DEVICE, n ? n : 64, "model: ZeRO-3 gather buffer");
        if (!m->gbuf[k]) return QT_ENOMEM;
        m->gkey[k] = -1;
    }
    m->gmode = qt_model_outer_mode(c, &m->opts, NULL);
    m->pshard = 1;
    m->blayer = -1;
    return QT_OK;
}

static int load_full(qt_model *m) {
    /* f16/bf16: matmuls, the embedding and the lm_head read a 2-byte compute
     * copy of the master block; norm weights and biases stay f32 (the master,
     * or sharded their own copy) */
    const qt_dtype cd = m->opts.compute;
    if (m->pshard) QT_TRY(alloc_param_shard(m));
    else if (cd != QT_F32) {
        m->wcopy = qt_be_alloc(m->be, QT_MEM_DEVICE, m->numel * qt_dtype_size(cd), "model: compute copy of the weights");
        if (!m->wcopy) return QT_ENOMEM;
    }
    if (m->sharded) QT_TRY(alloc_small(m));
    for (int i = 0; i < m->n_params; i++) {
        const qt_param *p = &m->params[i];
        const st_tensor *t;
        QT_TRY(st_expect(m->st, p->name, p->ndim, p->shape, &t));
        QT_TRY(qt_model_read_param(m, i, t)); /* sharded: the copies too */
        /* ZeRO-3: this rank keeps 1/N of the weights, so the file's pages leave its memory as they are read */
        if (m->pshard) drop_mapped_pages(t->data, t->nbytes);
    }
    if (cd != QT_F32 && !m->sharded) qt_model_weights_updated(m);
    const qt_config *c = &m->cfg;
    const qt_layout *ly = qt_config_layout(c);
    char name[160];
    snprintf(name, sizeof name, "%s.weight", ly->embed);
    int ie = param_index(m, name);
    m->emb_off = ie >= 0 ? m->params[ie].offset : 0;
    m->wte = compute_ref(m, name);
    m->dwte = grad_param(m, name);
    snprintf(name, sizeof name, "%s.weight", ly->final_norm);
    m->lnf_w = f32_param(m, name);
    m->dlnf_w = grad_param(m, name);
    if (c->tie_word_embeddings) {
        m->lm_head = m->wte;
        m->dlm_head = m->dwte;
        m->lm_head_off = 0; /* the embedding, first in the block */
    } else {
        m->lm_head = compute_ref(m, "lm_head.weight");
        m->dlm_head = grad_param(m, "lm_head.weight");
        m->lm_head_off = m->numel - (size_t)c->vocab_size * (size_t)c->hidden_size; /* the last tensor */
    }
    m->gout[0] = m->emb_off, m->gout[1] = m->lm_head_off;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        qt_layer *L = &m->layers[l];
        snprintf(name, sizeof name, "%s.%d.%s.weight", ly->layers, l, ly->ln1);
        L->ln1 = f32_param(m, name);
        L->dln1 = grad_param(m, name);
        snprintf(name, sizeof name, "%s.%d.%s.weight", ly->layers, l, ly->ln2);
        L->ln2 = f32_param(m, name);
        L->dln2 = grad_param(m, name);
        if (ly->q_norm) {
            snprintf(name, sizeof name, "%s.%d.%s.weight", ly->layers, l, ly->q_norm);
            L->qn = f32_param(m, name);
            L->dqn = grad_param(m, name);
            snprintf(name, sizeof name, "%s.%d.%s.weight", ly->layers, l, ly->k_norm);
            L->kn = f32_param(m, name);
            L->dkn = grad_param(m, name);
        }
        for (int j = 0; j < LIN_COUNT; j++) {
            qt_linear *q = &L->lin[j];
            /* a fused q/k/v: rows row0.. of the one tensor, weight, bias and their gradients alike */
            size_t r0 = (size_t)qt_lin_row0(c, j), w0 = r0 * (size_t)q->in;
            snprintf(name, sizeof name, "%s.%d.%s.weight", ly->layers, l, ly->lin[j]);
            q->w = compute_ref(m, name);
            q->w.p = (const char *)q->w.p + w0 * qt_dtype_size(q->w.dt);
            q->dw = grad_param(m, name);
            if (q->dw) q->dw += w0;
            snprintf(name, sizeof name, "%s.%d.%s.bias", ly->layers, l, ly->lin[j]);
            q->b = f32_param(m, name);
            q->db = grad_param(m, name);
            if (q->b) q->b += r0;
            if (q->db) q->db += r0;
        }
    }
    return QT_OK;
}

/* A modules_to_save module (QT_SAVE_EMBED / QT_SAVE_LM_HEAD): its trained
 * copy in the master block starts as the file's tensor `file` (the embedding
 * for a tied lm_head, as PEFT's wrapper copies the tied module); the graph
 * reads it in f32 and its gradient goes where grad_param says. */
static int saved_module(qt_model *m, unsigned which, const char *file, int drop, qt_wref *w, float **dw,
                        size_t *off) {
    char name[160];
    qt_saved_module_name(&m->cfg, which, name, sizeof name);
    for (int i = 0; i < m->n_params; i++) {
        const qt_param *p = &m->params[i];
        if (strcmp(p->name, name)) continue;
        const st_tensor *t;
        QT_TRY(st_expect(m->st, file, 2, p->shape, &t));
        QT_TRY(qt_model_read_param(m, i, t));
        if (drop) drop_mapped_pages(t->data, t->nbytes); /* the base copy is not read again */
        *w = (qt_wref){m->master + p->offset, QT_F32};
        *dw = grad_param(m, name);
        if (off) *off = p->offset;
        return QT_OK;
    }
    return QT_ERR(QT_EINVAL, "model: %s is not in the parameter table", name); /* cannot happen: memplan lists it */
}

/* The embedding and the lm_head of a frozen (LoRA, inference) model: the
 * base's, or the trained copies of modules_to_save. Tied and only one of the
 * two saved, the other keeps reading the base embedding (PEFT unties them). */
static int load_vocab_mats(qt_model *m) {
    const qt_config *c = &m->cfg;
    const int C = c->hidden_size, V = c->vocab_size, tied = c->tie_word_embeddings;
    const unsigned sv = m->opts.lora ? m->opts.lora_save : 0;
    char emb[160];
    snprintf(emb, sizeof emb, "%s.weight", qt_config_layout(c)->embed);
    qt_wref base = {0};
    const int base_used = !(sv & QT_SAVE_EMBED) || (tied && !(sv & QT_SAVE_LM_HEAD));
    const char *streamed = stream_vocab_name(m, emb);
    /* LoRA at ZeRO-3: the base block's offsets of what the embedding and the lm_head read (-1: a saved copy) */
    size_t at = m->bcur;
    m->gout[0] = m->gout[1] = (size_t)-1;
    if (base_used) QT_TRY(base_matrix(m, emb, V, C, &base, streamed == emb, 0));
    if (sv & QT_SAVE_EMBED) QT_TRY(saved_module(m, QT_SAVE_EMBED, emb, !base_used && !tied, &m->wte, &m->dwte, NULL));
    else m->wte = base, m->gout[0] = at;
    if (sv & QT_SAVE_LM_HEAD)
        return saved_module(m, QT_SAVE_LM_HEAD, tied ? emb : "lm_head.weight", !base_used, &m->lm_head, &m->dlm_head,
                            &m->lm_head_off);
    if (tied) m->lm_head = base, m->gout[1] = at;
    else {
        m->gout[1] = m->bcur;
        QT_TRY(base_matrix(m, "lm_head.weight", V, C, &m->lm_head, 1, 0));
    }
    return QT_OK;
}

int qt_model_stream_fits(size_t bytes, long long avail_kib) {
    const size_t margin = (size_t)1 << 30; /* the rest of the process: KV cache, activations, logits, code */
    return avail_kib < 0 || (double)bytes + (double)margin <= (double)avail_kib * 1024.0;
}

static int load_frozen_layers(qt_model *m);

static int load_frozen(qt_model *m, const char *dir) {
    const qt_config *c = &m->cfg;
    const qt_layout *ly = qt_config_layout(c);
    if (m->infer && !m->opts.keep_mapped) {
        char emb[160];
        snprintf(emb, sizeof emb, "%s.weight", ly->embed);
        m->stream_size = stream_bytes(m, emb);
        /* on the cpu backend the copy is anonymous memory: where it would not fit beside what the machine has
         * available (the model file's cached pages count as available; the copy hands them back as it goes),
         * the decode reads the weights from the mapping instead, as eval does, rather than the kernel killing
         * the process half way */
        const long long avail = qt_be_desc(m->be)->host_reads_device ? qt_meminfo_kib("MemAvailable") : -1;
        if (m->stream_size && !qt_model_stream_fits(m->stream_size, avail)) {
            qt_warn("%s: the weights stay in the file mapping (decoding reads them there, slower): a %.1f GiB copy "
                    "would not fit in the %.1f GiB of memory available", dir, (double)m->stream_size / (1 << 30),
                    (double)avail / (1 << 20));
            m->stream_size = 0;
        }
        if (m->stream_size) {
            m->stream_block = qt_be_alloc(m->be, QT_MEM_DEVICE, m->stream_size, "model: frozen matrices");
            if (!m->stream_block) return QT_ENOMEM;
            QT_TRY(own(m, m->stream_block));
        }
    }
    QT_TRY(load_vocab_mats(m));
    if (m->opts.quant4) {
        int n = 0;
        for (int j = 0; j < LIN_COUNT; j++) n += qt_lin_owns(c, j) && lin_quantized(m, j);
        char what[96];
        snprintf(what, sizeof what, "%s the base to %s%s", m->cfg.prequant4 ? "reading 4-bit" : "quantizing", qt_q4_type_name((qt_q4_type)m->opts.quant4_type),
                 m->opts.quant4_nested ? " (double quantization)" : "");
        qt_progress_start(&m->quant_prog, m->opts.progress, m->opts.progress ? isatty(fileno(m->opts.progress)) : 0,
                          what, (double)n * c->num_hidden_layers, "matrices");
    }
    QT_TRY(load_frozen_layers(m));
    if (m->opts.quant4) {
        qt_progress_end(&m->quant_prog);
        qt_info("4-bit base: %d matrices, %.1f MiB (%.1f MiB in the file's dtype)", m->quant_done,
                (double)m->quant_bytes / (1 << 20), (double)m->quant_src_bytes / (1 << 20));
    }
    return QT_OK;
}

static int load_frozen_layers(qt_model *m) {
    const qt_config *c = &m->cfg;
    const qt_layout *ly = qt_config_layout(c);
    int C = c->hidden_size, D = c->head_dim;
    char name[160];
    float *small = m->base_f32;
    snprintf(name, sizeof name, "%s.weight", ly->final_norm);
    QT_TRY(base_vector(m, name, C, small));
    m->lnf_w = small;
    small += C;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        qt_layer *L = &m->layers[l];
        if (m->pbase) m->blayer = l, m->glo[l] = m->bcur; /* LoRA at ZeRO-3: the layer's range of the base block */
        snprintf(name, sizeof name, "%s.%d.%s.weight", ly->layers, l, ly->ln1);
        QT_TRY(base_vector(m, name, C, small));
        L->ln1 = small, small += C;
        snprintf(name, sizeof name, "%s.%d.%s.weight", ly->layers, l, ly->ln2);
        QT_TRY(base_vector(m, name, C, small));
        L->ln2 = small, small += C;
        if (ly->q_norm) {
            snprintf(name, sizeof name, "%s.%d.%s.weight", ly->layers, l, ly->q_norm);
            QT_TRY(base_vector(m, name, D, small));
            L->qn = small, small += D;
            snprintf(name, sizeof name, "%s.%d.%s.weight", ly->layers, l, ly->k_norm);
            QT_TRY(base_vector(m, name, D, small));
            L->kn = small, small += D;
        }
        for (int j = 0; j < LIN_COUNT; j++) {
            qt_linear *q = &L->lin[j];
            if (!qt_lin_owns(c, j)) { /* k and v of a fused c_attn: row slices of q's tensor, no copy */
                const qt_linear *f = &L->lin[LIN_Q];
                size_t r0 = (size_t)qt_lin_row0(c, j);
                if (f->w.dt == QT_Q4) QT_TRY(quant_rows(m, &f->w, r0, q->out, &q->w));
                else q->w.p = (const char *)f->w.p + r0 * (size_t)q->in * qt_dtype_size(f->w.dt), q->w.dt = f->w.dt;
                q->b = f->b ? f->b + r0 : NULL;
                continue;
            }
            int rows = ly->fused_qkv && j == LIN_Q ? qt_lin_fused_rows(c) : q->out;
            snprintf(name, sizeof name, "%s.%d.%s.weight", ly->layers, l, ly->lin[j]);
            QT_TRY(base_matrix(m, name, rows, q->in, &q->w, 1, lin_quantized(m, j)));
            if (qt_lin_has_bias(c, j)) {
                snprintf(name, sizeof name, "%s.%d.%s.bias", ly->layers, l, ly->lin[j]);
                QT_TRY(base_vector(m, name, rows, small));
                q->b = small, small += rows;
            }
        }
        if (m->pbase) m->ghi[l] = m->bcur;
    }
    return QT_OK;
}

/* LoRA A/B in the master block. A fused q/k/v is one adapted module: q, k
 * and v share its A (initialised once) and take row slices of its B. A is
 * drawn on the host and uploaded through a staging buffer. */
static int wire_lora(qt_model *m) {
    const qt_config *c = &m->cfg;
    const qt_layout *ly = qt_config_layout(c);
    char name[200];
    size_t most = 0;
    for (int j = 0; j < LIN_COUNT; j++) {
        size_t n = (size_t)m->opts.lora_r * m->layers[0].lin[j].in;
        if (n > most) most = n;
    }
    float *stage = qt_malloc(sizeof(float) * (most ? most : 1), "model: staging buffer");
    if (!stage) return QT_ENOMEM;
    for (int l = 0; l < c->num_hidden_layers; l++)
        for (int j = 0; j < LIN_COUNT; j++) {
            qt_linear *q = &m->layers[l].lin[j];
            q->lora_id = qt_lin_owns(c, j) ? j : LIN_Q;
            snprintf(name, sizeof name, "base_model.model.%s.%d.%s.lora_A.weight", ly->layers, l, ly->lin[j]);
            q->la = find_param(m, m->master, name);
            q->dla = grad_param(m, name);
            snprintf(name, sizeof name, "base_model.model.%s.%d.%s.lora_B.weight", ly->layers, l, ly->lin[j]);
            q->lb = find_param(m, m->master, name);
            q->dlb = grad_param(m, name);
            if (!q->la) continue;
            size_t b0 = (size_t)qt_lin_row0(c, j) * (size_t)m->opts.lora_r;
            q->lb += b0;
            if (q->dlb) q->dlb += b0;
            if (!qt_lin_owns(c, j)) continue;
            /* A ~ U(-1/sqrt(in), 1/sqrt(in)), one stream per (layer, module); B stays 0 */
            qt_rng r;
            qt_rng_derive(&r, m->opts.seed ^ LORA_INIT_SALT, (uint64_t)l, (uint64_t)j);
            float bound = 1.0f / sqrtf((float)q->in);
            size_t n = (size_t)m->opts.lora_r * q->in;
            for (size_t i = 0; i < n; i++) stage[i] = (2.0f * qt_rng_uniform(&r) - 1.0f) * bound;
            qt_be_upload(m->be, q->la, stage, sizeof(float) * n);
        }
    qt_free(stage);
    return QT_OK;
}

static void *alloc_floats(qt_model *m, size_t bytes, const char *what) {
    if (!bytes) return NULL;
    return qt_be_alloc(m->be, QT_MEM_DEVICE, bytes, what);
}

/* Every tensor of the folder must be one the loaded architecture consumed
 * (looked up while loading): a tensor of another architecture (Qwen3's
 * q_norm in a folder labelled Llama) would be ignored in silence. HF itself
 * drops rotary_emb.inv_freq (a buffer it recomputes) and, with tied
 * embeddings, lm_head.weight. */
static int check_all_consumed(const qt_model *m, const char *dir) {
    for (const st_tensor *t; (t = st_first_unused(m->st));) {
        size_t n = strlen(t->name), k = strlen(".rotary_emb.inv_freq");
        int hf_ignores = (n > k && !strcmp(t->name + n - k, ".rotary_emb.inv_freq")) ||
                         (m->cfg.tie_word_embeddings && !strcmp(t->name, "lm_head.weight"));
        if (!hf_ignores)
            return QT_ERR(QT_EFORMAT,
                          "%s holds the tensor %s, which the architecture in its config.json does not use; the "
                          "weights and config.json disagree (check \"architectures\" and \"model_type\")",
                          dir, t->name);
        st_find(m->st, t->name); /* marked: look past it */
    }
    return QT_OK;
}

static int model_load(qt_model *m, const char *dir, const qt_model_opts *opts) {
    QT_TRY(check_opts(opts));
    QT_TRY(qt_backend_open_index(opts->backend, opts->device_index, &m->be));
    m->own_be = 1;
    QT_TRY(qt_config_load(dir, &m->cfg));
    QT_TRY(check_config(&m->cfg, dir));
    if (m->cfg.long_context && opts->max_T > m->cfg.seq_length)
        return QT_ERR(QT_EUNSUPPORTED,
                      "sequences of %d tokens are longer than seq_length (%d) in %s/config.json, and past it the "
                      "original Qwen switches on dynamic NTK and logn attention (use_dynamic_ntk / use_logn_attn), "
                      "which qtune does not implement; use a sequence length (data.seq_len, --seq-len) of at most %d",
                      opts->max_T, m->cfg.seq_length, dir, m->cfg.seq_length);
    if (qt_config_layout(&m->cfg)->fused_qkv && opts->lora) {
        unsigned qkv = opts->lora_targets & (QT_LORA_Q | QT_LORA_K | QT_LORA_V);
        if (qkv && qkv != (QT_LORA_Q | QT_LORA_K | QT_LORA_V))
            return QT_ERR(QT_EUNSUPPORTED, "%s is an original Qwen model: q, k and v are one fused attn.c_attn, so "
                                           "LoRA adapts all three or none; target c_attn", dir);
    }
    if (m->cfg.max_position_embeddings > 0 && opts->max_T > m->cfg.max_position_embeddings)
        return QT_ERR(QT_EINVAL,
                      "sequences of %d tokens are longer than max_position_embeddings (%d) in %s/config.json; use a "
                      "sequence length (data.seq_len, --seq-len) of at most %d",
                      opts->max_T, m->cfg.max_position_embeddings, dir, m->cfg.max_position_embeddings);
    if (opts->lora && opts->lora_layers_set) {
        int any = 0;
        for (int l = 0; l < m->cfg.num_hidden_layers && !any; l++) any = qt_lora_layer_on(opts, l);
        if (!any)
            return QT_ERR(QT_EINVAL, "layers_to_transform names none of the %d layers (0 to %d) of %s; list layer "
                          "indices of this model", m->cfg.num_hidden_layers, m->cfg.num_hidden_layers - 1, dir);
    }
    m->opts = *opts;
    if (!m->opts.lora) m->opts.lora_targets = 0;
    m->infer = opts->infer;
    m->dir = dir;
    if (m->cfg.prequant4) { /* a bitsandbytes 4-bit folder: its layer linears are read as stored */
        if (!opts->infer && !opts->lora)
            return QT_ERR(QT_EINVAL, "%s holds a 4-bit base (quantization_config: bitsandbytes): frozen, so full "
                                     "fine-tuning cannot update it; add a \"lora\" section (QLoRA)", dir);
        if (opts->quant4) qt_warn("%s is already 4-bit (quantization_config); the job's \"quantization\" is not "
                                  "applied again", dir);
        m->opts.quant4 = 1, m->opts.quant4_type = m->cfg.prequant4_type, m->opts.quant4_nested = m->cfg.prequant4_nested;
        m->opts.quant4_skip = 0;
    }
    if (m->opts.quant4 && qt_model_opts_base_sharded(&m->opts))
        return QT_ERR(QT_EUNSUPPORTED, "%s: ZeRO stage 3 does not partition a 4-bit (QLoRA) base; use "
                                       "zero_optimization.stage 2, where each rank keeps the 4-bit base whole (a "
                                       "quarter of its 16-bit size) and the adapter's gradients and optimizer state "
                                       "are still partitioned", dir);
    const qt_config *c = &m->cfg;
    QT_TRY(st_open(dir, &m->st));
    qt_model_memory(c, &m->opts, &m->mem);

    m->n_params = qt_model_param_table(c, &m->opts, NULL, &m->numel);
    if (m->infer && !m->opts.lora) m->n_params = 0, m->numel = 0; /* inference: nothing trainable */
    if (m->n_params) {
        m->params = qt_calloc((size_t)m->n_params, sizeof(qt_param), "model: parameter table");
        if (!m->params) return QT_ENOMEM;
        qt_model_param_table(c, &m->opts, m->params, NULL);
        m->param_src = qt_calloc((size_t)m->n_params, sizeof(qt_param_src), "model: parameter table");
        if (!m->param_src) return QT_ENOMEM;
        for (int i = 0; i < m->n_params; i++) m->param_src[i] = (qt_param_src){m, m->params[i].offset};
    }
    if (m->numel) {
        /* ZeRO 1/2 in f16/bf16: only this rank's shard of the master (the graph reads the compute copy) */
        m->mlo = 0, m->mhi = m->numel;
        m->sharded = qt_model_opts_sharded(&m->opts);
        if (m->sharded) qt_shard_range(m->numel, opts->master_shards, opts->master_rank, &m->mlo, &m->mhi);
        m->pshard = m->sharded && opts->param_shards > 1;
        const size_t nm = m->mhi - m->mlo;
        m->master = qt_be_alloc(m->be, m->sharded && opts->master_on_host ? QT_MEM_PINNED : QT_MEM_DEVICE,
                                 (nm ? nm : 1) * 4, "model: fp32 master weights");
        if (!m->master) return QT_ENOMEM;
        qt_be_zero(m->be, m->master, nm * 4);
        if (!m->infer && m->opts.grad_windows) {
            QT_TRY(qt_grad_win_init(&m->grad_win, m->be, c, &m->opts, m->params, m->n_params));
        } else if (!m->infer) {
            m->grads = alloc_floats(m, m->numel * 4, "model: fp32 gradients");
            if (!m->grads) return QT_ENOMEM;
            qt_be_zero(m->be, m->grads, m->numel * 4);
        }
    }
    m->layers = qt_calloc((size_t)c->num_hidden_layers, sizeof(qt_layer), "model: layer table");
    if (!m->layers) return QT_ENOMEM;
    for (int l = 0; l < c->num_hidden_layers; l++)
        for (int j = 0; j < LIN_COUNT; j++) qt_lin_shape(c, j, &m->layers[l].lin[j].in, &m->layers[l].lin[j].out);

    if (m->opts.lora || m->infer) {
        if (qt_model_opts_base_sharded(&m->opts)) QT_TRY(alloc_base_shard(m));
        if (m->mem.base_f32) {
            m->base_f32 = alloc_floats(m, m->mem.base_f32, "model: frozen norm weights and biases");
            if (!m->base_f32) return QT_ENOMEM;
        }
        QT_TRY(load_frozen(m, dir));
    } else {
        QT_TRY(load_full(m));
    }
    QT_TRY(check_all_consumed(m, dir));
    if (m->opts.lora) {
        m->lora_scaling = m->opts.use_rslora ? m->opts.lora_alpha / sqrtf((float)m->opts.lora_r)
                                             : m->opts.lora_alpha / (float)m->opts.lora_r;
        QT_TRY(wire_lora(m));
    }

    m->acts.x = qt_calloc((size_t)c->num_hidden_layers + 1, sizeof(float *), "model: activation table");
    m->acts.layer = qt_calloc((size_t)c->num_hidden_layers, sizeof(qt_acts), "model: activation table");
    if (!m->acts.x || !m->acts.layer) return QT_ENOMEM;
    if (qt_model_acts_2byte(&m->opts)) {
        m->acts.x16 = qt_calloc((size_t)c->num_hidden_layers, sizeof(uint16_t *), "model: activation table");
        if (!m->acts.x16) return QT_ENOMEM;
        if (!m->opts.grad_checkpointing) {
            m->acts.layer16 = qt_calloc((size_t)c->num_hidden_layers, sizeof(qt_acts16), "model: activation table");
            if (!m->acts.layer16) return QT_ENOMEM;
        }
    }
    m->act_block = alloc_floats(m, m->mem.activations, "model: activations");
    if (!m->act_block) return QT_ENOMEM;
    qt_model_carve_acts(c, &m->opts, m->act_block, &m->acts);
    if (m->mem.act_grads) {
        m->grad_block = alloc_floats(m, m->mem.act_grads, "model: activation gradients");
        if (!m->grad_block) return QT_ENOMEM;
        qt_model_carve_grads(c, &m->opts, m->grad_block, &m->gs);
    }
    m->ws = alloc_floats(m, m->mem.workspace, "model: matmul workspace");
    if (!m->ws) return QT_ENOMEM;
    if (m->mem.kv_cache) {
        /* sparse: a cache of --ctx positions per sequence, of which a reply writes a few */
        m->kv_block = qt_be_alloc(m->be, QT_MEM_DEVICE_SPARSE, m->mem.kv_cache, "model: KV cache");
        if (!m->kv_block) return QT_ENOMEM;
        qt_model_carve_kv(c, &m->opts, m->kv_block, &m->kcache, &m->vcache);
    }
    /* 16-bit training with the backend's GEMM for that dtype (bf16: not under QTUNE_BF16_EMULATE=1): the
     * layers' matmuls read the saved 2-byte inputs (docs/precision.md); probed only where it can run */
    const qt_dtype cdt = m->opts.compute;
    m->native16 = m->acts.layer16 && (cdt == QT_F16 || (cdt == QT_BF16 && !qt_precision_bf16_emulated(m->opts.backend))) &&
                  m->gs.dout16 && qt_be_half_available(m->be, cdt);
    if (m->native16) qt_debug("model %s: %s layer matmuls on the backend's 16-bit GEMM", dir, qt_dtype_name(cdt));
    /* inference: bf16-valued layer weights (docs/precision.md, "Inference on bf16 weights"); the cpu backend's
     * matmul (and the guard's, which runs it) takes bf16-exact operands onto the bf16 GEMM, cuda's does not */
    const int exact_ops = !strcmp(qt_be_desc(m->be)->name, "cpu") || !strcmp(qt_be_desc(m->be)->name, "guard");
    m->infer16 = m->infer && cdt == QT_F32 && exact_ops && c->num_hidden_layers > 0 &&
                 bf16_valued(m, &m->layers[0].lin[LIN_Q].w) && !qt_precision_bf16_emulated(m->opts.backend) &&
                 qt_be_half_available(m->be, QT_BF16);
    if (m->infer16) qt_debug("model %s: batched forwards round the Linears' inputs to bf16 (the bf16 GEMM)", dir);
    const size_t maxn = (size_t)opts->max_B * (size_t)opts->max_T;
    m->pos_buf = qt_malloc(sizeof(int32_t) * maxn, "model: positions");
    m->loss_host = qt_malloc(sizeof(float) * maxn, "model: token losses");
    m->ids_block = alloc_floats(m, sizeof(float) * qt_model_carve_ids(&m->opts, NULL, NULL), "model: batch ids");
    if (!m->pos_buf || !m->loss_host || !m->ids_block) return QT_ENOMEM;
    qt_model_carve_ids(&m->opts, m->ids_block, &m->ids);
    if (m->infer) {
        m->decode_seqs = opts->decode_seqs > 1 ? opts->decode_seqs : 1;
        m->logits = alloc_floats(m, sizeof(float) * (size_t)m->decode_seqs * (size_t)c->vocab_size,
                                 "model: decode logits");
        m->kv_len = qt_calloc((size_t)m->decode_seqs, sizeof *m->kv_len, "model: cached positions");
        if (!m->logits || !m->kv_len) return QT_ENOMEM;
    }
    qt_debug("model %s: %zu trainable, %.1f MiB allocated", dir, m->numel, (double)m->mem.total / (1 << 20));
    return QT_OK;
}

int qt_model_load(const char *dir, const qt_model_opts *opts, qt_model **out) {
    *out = NULL;
    qt_model *m = qt_calloc(1, sizeof *m, "model");
    if (!m) return QT_ENOMEM;
    int rc = model_load(m, dir, opts);
    m->dir = NULL;
    if (rc != QT_OK) {
        qt_model_free(m);
        return rc;
    }
    *out = m;
    return QT_OK;
}

void qt_model_free(qt_model *m) {
    if (!m) return;
    qt_backend *be = m->be;
    if (be) {
        for (int i = 0; i < m->n_owned; i++) qt_be_free(be, m->owned[i]);
        for (int i = 0; i < m->n_imported; i++) qt_be_release_mapped(be, m->imported[i]);
        qt_be_free(be, m->master);
        qt_be_free(be, m->grads);
        qt_be_free(be, m->base_f32);
        qt_be_free(be, m->small);
        qt_be_free(be, m->wcopy);
        qt_be_free(be, m->pbase);
        for (int k = 0; k < 3; k++) qt_be_free(be, m->gbuf[k]);
        qt_be_free(be, m->gslice);
        qt_be_free(be, m->act_block);
        qt_be_free(be, m->grad_block);
        qt_be_free(be, m->ws);
        qt_be_free(be, m->kv_block);
        qt_be_free(be, m->ids_block);
        qt_be_free(be, m->logits);
    }
    qt_free(m->owned);
    qt_free(m->imported);
    qt_grad_win_free(&m->grad_win);
    qt_free(m->small_runs);
    qt_free(m->glo);
    qt_free(m->ghi);
    qt_free(m->params);
    qt_free(m->param_src);
    qt_free(m->layers);
    qt_free(m->acts.x);
    qt_free(m->acts.layer);
    qt_free(m->acts.x16);
    qt_free(m->acts.layer16);
    qt_free(m->pos_buf);
    qt_free(m->kv_len);
    qt_free(m->loss_host);
    st_close(m->st);
    if (m->own_be) qt_backend_close(be);
    qt_free(m);
}

const qt_config *qt_model_config(const qt_model *m) { return &m->cfg; }
size_t qt_model_numel(const qt_model *m) { return m->numel; }
float *qt_model_master(qt_model *m) { return m->master; }
float *qt_model_grads(qt_model *m) { return m->grads; }
size_t qt_model_grad_window_elems(const qt_model *m) { return m->grad_win.block ? m->grad_win.plan.each : 0; }
void qt_model_set_grad_hook(qt_model *m, const qt_grad_hook *h) {
    if (h) m->grad_win.hook = *h;
    else memset(&m->grad_win.hook, 0, sizeof m->grad_win.hook);
}
const qt_param *qt_model_params(const qt_model *m, int *n) {
    *n = m->n_params;
    return m->params;
}
/* In f32 the graph reads the master block itself; in f16/bf16 full
 * fine-tuning it reads the 2-byte compute copy, rounded here from the master
 * (round to nearest even; fp16 saturates to inf beyond 65504). */
void qt_model_weights_updated(qt_model *m) {
    if (m->pbase) return; /* LoRA at ZeRO-3: the gathered base is frozen; the graph reads the adapter itself */
    for (int k = 0; k < 3; k++) m->gkey[k] = -1; /* ZeRO-3: what the buffers hold is stale */
    if (!m->wcopy && !m->pshard) return;
    if (!m->sharded) {
        qt_be_convert(m->be, m->wcopy, m->opts.compute, m->master, QT_F32, m->numel);
        return;
    }
    /* this rank's range; the caller all-gathers the others' (qt_model_sharded; ZeRO-3 gathers the
     * compute weights at use and only the 1-D tensors here) */
    if (m->wcopy) qt_be_convert(m->be, m->wcopy + (m->pshard ? 0 : m->mlo), m->opts.compute, m->master, QT_F32,
                                 m->mhi - m->mlo);
    for (int k = 0; k < m->n_small_runs; k++) {
        const qt_flat_run *r = &m->small_runs[k];
        size_t a = r->flat > m->mlo ? r->flat : m->mlo, e = r->flat + r->n < m->mhi ? r->flat + r->n : m->mhi;
        if (e > a) qt_be_copy(m->be, m->small + r->at + (a - r->flat), m->master + (a - m->mlo), (e - a) * 4);
    }
}

int qt_model_sharded(const qt_model *m, qt_model_shard *out) {
    if (!m->sharded) return 0;
    *out = (qt_model_shard){m->mlo, m->mhi, m->pshard && !m->wcopy ? (void *)m->master : m->wcopy,
                            qt_dtype_size(m->opts.compute), m->small, m->small_runs, m->n_small_runs, m->pshard};
    return 1;
}

size_t qt_model_base_sharded(const qt_model *m) { return m->pbase ? m->bn : 0; }

void qt_model_set_param_fetch(qt_model *m, const qt_param_fetch *f) {
    if (f) m->pf = *f;
    else memset(&m->pf, 0, sizeof m->pf);
}

void qt_model_set_param_gather(qt_model *m, qt_param_gather_fn gather, void *user) {
    m->gather = gather;
    m->gather_user = user;
}
void qt_model_set_micro_step(qt_model *m, uint64_t step) { m->micro_step = step; }
uint64_t qt_model_micro_step(const qt_model *m) { return m->micro_step; }
qt_backend *qt_model_backend(const qt_model *m) { return m->be; }
