/* include/qtune.h over the modules. */
#include "qtune.h"

#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"
#include "data/loader.h"
#include "dist/dist.h"
#include "model/decode.h"
#include "model/lora_io.h"
#include "model/model.h"
#include "qtune_config.h"
#include "text/tokenizer.h"
#include "train/job.h"
#include "train/merge.h"
#include "train/trainer.h"

#include <string.h>

struct qtune_model {
    qt_model *m;
    bpe_tokenizer *tok;
    int seq_len, batch;
    char *dir; /* the model folder (its eos ids, messages) */
};

const char *qtune_version(void) { return QTUNE_VERSION; }
const char *qtune_last_error(void) { return qt_error_message(); }

int qtune_model_load(const char *model_dir, const char *adapter_dir, int seq_len, int batch, qtune_model **out) {
    *out = NULL;
    if (seq_len < 2 || batch < 1) return QT_ERR(QT_EINVAL, "qtune_model_load: seq_len must be >= 2 and batch >= 1");
    qtune_model *q = qt_calloc(1, sizeof *q, "model handle");
    if (!q) return QT_ENOMEM;
    q->seq_len = seq_len;
    q->batch = batch;
    q->dir = qt_strdup(model_dir);
    if (!q->dir) {
        qt_free(q);
        return QT_ENOMEM;
    }
    qt_model_opts o;
    qt_model_opts_default(&o);
    o.infer = 1;
    o.max_B = batch;
    o.max_T = seq_len;
    qt_config cfg;
    int rc = adapter_dir ? qt_config_load(model_dir, &cfg) : QT_OK;
    if (rc == QT_OK && adapter_dir) rc = qt_lora_opts_from_adapter(adapter_dir, &cfg, &o);
    if (rc == QT_OK) rc = qt_model_load(model_dir, &o, &q->m);
    if (rc == QT_OK && adapter_dir) rc = qt_lora_load(q->m, adapter_dir);
    char tokpath[4096];
    if (rc == QT_OK && bpe_folder_file(model_dir, tokpath, sizeof tokpath)) rc = qt_error_oom_advice(bpe_load(tokpath, &q->tok), QT_TOKENIZER_OOM_ADVICE);
    if (rc != QT_OK) {
        qtune_model_free(q);
        return rc;
    }
    *out = q;
    return QT_OK;
}

void qtune_model_free(qtune_model *q) {
    if (!q) return;
    qt_model_free(q->m);
    bpe_free(q->tok);
    qt_free(q->dir);
    qt_free(q);
}

int qtune_generate(qtune_model *q, const int32_t *ids, int n, int max_new, float temperature, uint64_t seed,
                   int32_t *out, int *n_out) {
    *n_out = 0;
    if (max_new < 1) return QT_ERR(QT_EINVAL, "qtune_generate: max_new is %d; ask for at least 1 token", max_new);
    if (n >= q->seq_len)
        return QT_ERR(QT_EINVAL, "qtune_generate: the prompt (%d tokens) leaves no room for a new token in the "
                      "seq_len of %d the model was loaded with; load it with a larger seq_len or shorten the prompt",
                      n, q->seq_len);
    qt_sample_opts so = {temperature, 0, 1.0f};
    QT_TRY(qt_sample_opts_check(&so));
    int32_t eos[QT_DECODE_MAX_STOP];
    int n_eos = 0;
    QT_TRY(qt_eos_ids_load(q->dir, eos, QT_DECODE_MAX_STOP, &n_eos));
    /* ids past the tokenizer (a padded embedding) are never sampled, as in qtune generate */
    int v_sample = qt_model_config(q->m)->vocab_size;
    if (q->tok && bpe_vocab_size(q->tok) < v_sample) v_sample = bpe_vocab_size(q->tok);
    qt_decoder d;
    int rc = qt_decoder_init(&d, q->m, q->seq_len, q->seq_len, max_new, v_sample);
    d.so = so;
    d.seed = seed;
    qt_rng_seed(&d.rng, seed);
    d.model_dir = q->dir;
    qt_decoder_add_stop(&d, q->tok ? bpe_token_id(q->tok, "<|im_end|>") : -1);
    qt_decoder_add_stop(&d, q->tok ? bpe_token_id(q->tok, "<|endoftext|>") : -1);
    for (int k = 0; k < n_eos; k++) qt_decoder_add_stop(&d, eos[k]);
    qt_model_decode_reset(q->m); /* a new sequence from position 0 */
    qt_decode_result r = {0};
    if (rc == QT_OK) rc = qt_decode_reply(&d, ids, n, NULL, NULL, &r);
    if (rc == QT_OK) {
        memcpy(out, r.out, (size_t)r.n_out * sizeof *out);
        *n_out = r.n_out;
    }
    qt_decode_result_free(&r);
    qt_decoder_free(&d);
    return rc;
}

int qtune_eval(qtune_model *q, const char *data_path, const char *format, double *loss, int64_t *tokens) {
    dl_config c;
    dl_config_default(&c);
    c.path = data_path;
    QT_TRY(dl_format_parse(format ? format : "auto", &c.format));
    c.seq_len = q->seq_len;
    c.micro_batch = q->batch;
    c.packing = 0;
    c.shuffle = 0;
    c.mask_prompt = 1;
    c.no_cache = 1;
    c.num_workers = 1;
    c.eval = 1;
    c.vocab_size = qt_model_config(q->m)->vocab_size;
    dl_loader *l;
    QT_TRY(dl_open(&c, q->tok, &l));
    qt_batch b;
    int rc = dl_batch_alloc(l, &b);
    if (rc != QT_OK) { dl_close(l); return rc; }
    double sum = 0;
    int64_t n = 0;
    for (;;) {
        rc = dl_next(l, &b);
        if (rc == DL_END) { rc = QT_OK; break; }
        if (rc != QT_OK) break;
        double s;
        int64_t k;
        rc = qt_model_forward(q->m, &b, &s, &k, NULL);
        if (rc != QT_OK) break;
        sum += s;
        n += k;
    }
    dl_batch_free(&b);
    dl_close(l);
    QT_TRY(rc);
    if (!n) return QT_ERR(QT_EINVAL, "%s: no token carries a label; nothing to evaluate", data_path);
    *loss = sum / (double)n;
    if (tokens) *tokens = n;
    return QT_OK;
}

int qtune_train(const char *job_path, const char *const *sets, int n_sets, volatile sig_atomic_t *stop,
                char *final_dir, int cap) {
    qt_job job;
    QT_TRY(qt_job_load(job_path, sets, n_sets, &job));
    dist_ctx *d = NULL;
    int rc = dist_init(NULL, NULL, &d);
    qt_train_hooks hooks = {.stop = stop, .progress = NULL, .tty = 0};
    qt_train_result res;
    if (rc == QT_OK) rc = qt_train_run(&job, d, &hooks, &res);
    if (rc == QT_OK && final_dir && cap > 0) snprintf(final_dir, (size_t)cap, "%s", res.final_dir);
    dist_finalize(d);
    qt_job_free(&job);
    return rc;
}

int qtune_merge(const char *model_dir, const char *adapter_dir, const char *out_dir, const char *dtype) {
    int dt = -1;
    if (dtype) {
        qt_dtype t;
        if (qt_dtype_parse(dtype, &t) != QT_OK)
            return QT_ERR(QT_EINVAL, "qtune_merge: dtype '%s' is not f32, bf16 or f16", dtype);
        dt = (int)t;
    }
    return qt_merge_adapter(model_dir, adapter_dir, out_dir, dt, NULL);
}
