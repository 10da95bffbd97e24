/* Test driver for the reference-parity tests (tests/ref/test_*.py): loads a
 * model folder, runs one batch, and dumps what the Python side compares
 * against its PyTorch reference, as a safetensors file:
 *   loss_sum [1], n_tokens [1], logp [B, T]            (every mode)
 *   grad/<param name> for every trainable tensor        (--mode train)
 *   logits [steps, V]: KV-cache decode of row 0         (--mode decode)
 *   infer16 [1]: 1 when the inference forwards rounded the Linears' inputs to
 *     bf16 for the bf16 GEMM (model_internal.h m->infer16), else 0
 *
 * usage: qtune_ref_driver MODEL_DIR BATCH.json OUT.safetensors
 *          [--mode eval|train|decode] [--lora R ALPHA TARGETS(a,b,..)] [--rslora]
 *          [--adapter DIR] [--dropout P] [--recompute] [--grad-scale S]
 *          [--save-adapter DIR] [--steps K] [--dump-masks] [--compute f32|f16|bf16]
 * BATCH.json: {"B": B, "T": T, "inputs": [...], "targets": [...],
 *              "positions": [...], "doc_start": [...]} (B*T each).
 * --pref OBJECTIVE_JSON (with --mode train): the batch's rows are preference
 * pairs (rows 0..B/2-1 chosen, B/2.. rejected, train/objective.h); the
 * reference's log-probs come from a forward with the adapter off (unless the
 * objective needs none), the gradient is the objective's times --grad-scale,
 * and pref/... holds the row sums (policy, ref), the loss and the metric sums.
 * --steps K runs train (or eval) K times (gradients accumulate, dropout stream
 * advances); step_ms [K] holds each call's wall time in milliseconds. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"
#include "backend/backend.h"
#include "io/safetensors.h"
#include "model/lora_io.h"
#include "model/model.h"
#include "model/model_internal.h" /* qt_lora_dropout for --dump-masks */
#include "train/objective.h"

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

static int die(void) {
    fprintf(stderr, "qtune_ref_driver: %s [%s]\n", qt_error_message(), qt_error_where());
    return 1;
}

static int read_ints(cJSON *root, const char *key, int32_t *dst, size_t n) {
    cJSON *a = cJSON_GetObjectItem(root, key);
    if (!cJSON_IsArray(a) || (size_t)cJSON_GetArraySize(a) != n)
        return QT_ERR(QT_EFORMAT, "batch: '%s' must be an array of B*T = %zu ints", key, n);
    size_t i = 0;
    cJSON *e;
    cJSON_ArrayForEach(e, a) dst[i++] = (int32_t)e->valuedouble;
    return QT_OK;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: qtune_ref_driver MODEL_DIR BATCH.json OUT.safetensors [options]\n");
        return 2;
    }
    const char *model_dir = argv[1], *batch_path = argv[2], *out_path = argv[3];
    const char *mode = "eval", *adapter = NULL, *save_adapter = NULL, *pref = NULL;
    int dump_masks = 0;
    float grad_scale = 1.0f;
    int steps = 1;
    float dropout = -1.0f;
    qt_model_opts o;
    qt_model_opts_default(&o);
    for (int i = 4; i < argc; i++) {
        if (!strcmp(argv[i], "--mode")) mode = argv[++i];
        else if (!strcmp(argv[i], "--lora")) {
            o.lora = 1;
            o.lora_r = atoi(argv[++i]);
            o.lora_alpha = (float)atof(argv[++i]);
            char names[256], *save;
            snprintf(names, sizeof names, "%s", argv[++i]);
            const char *list[16];
            int n = 0;
            for (char *t = strtok_r(names, ",", &save); t && n < 16; t = strtok_r(NULL, ",", &save)) list[n++] = t;
            qt_config lcfg; /* names resolved in the model's layout (c_attn, c_proj, w1, w2 on the original Qwen) */
            if (qt_config_load(model_dir, &lcfg) != QT_OK ||
                qt_lora_targets_from_names(&lcfg, list, n, &o.lora_targets, "--lora") != QT_OK)
                return die();
        } else if (!strcmp(argv[i], "--rslora")) o.use_rslora = 1;
        else if (!strcmp(argv[i], "--pref")) pref = argv[++i];
        else if (!strcmp(argv[i], "--adapter")) adapter = argv[++i];
        else if (!strcmp(argv[i], "--dropout")) dropout = (float)atof(argv[++i]);
        else if (!strcmp(argv[i], "--recompute")) o.grad_checkpointing = 1;
        else if (!strcmp(argv[i], "--grad-scale")) grad_scale = (float)atof(argv[++i]);
        else if (!strcmp(argv[i], "--save-adapter")) save_adapter = argv[++i];
        else if (!strcmp(argv[i], "--steps")) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--dump-masks")) dump_masks = 1;
        else if (!strcmp(argv[i], "--compute")) { /* f32|f16|bf16 (bf16 needs QTUNE_BF16_EMULATE=1 without AVX512_BF16) */
            if (qt_dtype_parse(argv[++i], &o.compute) != QT_OK) return fprintf(stderr, "bad --compute\n"), 2;
        }
        else {
            fprintf(stderr, "qtune_ref_driver: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    qt_config acfg;
    if (adapter && !o.lora &&
        (qt_config_load(model_dir, &acfg) != QT_OK || qt_lora_opts_from_adapter(adapter, &acfg, &o) != QT_OK))
        return die();
    if (dropout >= 0) o.lora_dropout = dropout; /* after the adapter's config, which sets its own */

    char *text;
    size_t len;
    if (qt_read_file(batch_path, 1 << 28, &text, &len) != QT_OK) return die();
    cJSON *root = cJSON_Parse(text);
    qt_free(text);
    if (!root) return fprintf(stderr, "bad batch json\n"), 1;
    qt_batch b;
    b.B = cJSON_GetObjectItem(root, "B")->valueint;
    b.T = cJSON_GetObjectItem(root, "T")->valueint;
    size_t N = (size_t)b.B * b.T;
    b.inputs = malloc(N * 4), b.targets = malloc(N * 4), b.positions = malloc(N * 4), b.doc_start = malloc(N * 4);
    if (read_ints(root, "inputs", b.inputs, N) || read_ints(root, "targets", b.targets, N) ||
        read_ints(root, "positions", b.positions, N) || read_ints(root, "doc_start", b.doc_start, N))
        return die();
    cJSON_Delete(root);

    int decode = !strcmp(mode, "decode"), train = !strcmp(mode, "train");
    o.max_B = b.B;
    o.max_T = b.T;
    o.infer = !train;
    qt_model *m;
    if (qt_model_load(model_dir, &o, &m) != QT_OK) return die();
    if (adapter && qt_lora_load(m, adapter) != QT_OK) return die();
    if (save_adapter && qt_lora_save(m, save_adapter, model_dir) != QT_OK) return die();

    st_writer *w;
    if (st_writer_new(&w) != QT_OK) return die();
    double loss_sum = 0;
    int64_t ntok = 0;
    float *logp = calloc(N, 4), scal[2];
    float *logits = NULL;
    int V = qt_model_config(m)->vocab_size;
    float *ms = calloc((size_t)steps, sizeof(float)); /* wall time of each call: the benchmark reads it */
    float *masks = NULL, *grads = NULL;
    if (dump_masks) {
        /* mask/(1-p) of every adapted module for the first forward_backward: mask/L.PATH [B*T, in], PATH the
         * layout's module path (self_attn.q_proj, attn.c_attn: one mask for a fused q/k/v) */
        const qt_config *c = qt_model_config(m);
        size_t per = 0;
        for (int j = 0; j < LIN_COUNT; j++) {
            int in, ou;
            qt_lin_shape(c, j, &in, &ou);
            per += N * (size_t)in;
        }
        masks = malloc(sizeof(float) * per * (size_t)c->num_hidden_layers);
        float *p = masks;
        for (int l = 0; l < c->num_hidden_layers; l++)
            for (int j = 0; j < LIN_COUNT; j++) {
                if (!(o.lora_targets & qt_lin_flag[j]) || !qt_lin_owns(c, j)) continue;
                int in, ou;
                qt_lin_shape(c, j, &in, &ou);
                /* ones go up, the backend's dropout scales them in place, the mask comes down */
                size_t cnt = N * (size_t)in;
                for (size_t i = 0; i < cnt; i++) p[i] = 1.0f;
                qt_backend *be = qt_model_backend(m);
                float *d = qt_be_alloc(be, QT_MEM_DEVICE, sizeof(float) * cnt, "mask");
                if (!d) return die();
                qt_be_upload(be, d, p, sizeof(float) * cnt);
                qt_lora_dropout(m, l, j, d, d, cnt);
                qt_be_download(be, p, d, sizeof(float) * cnt);
                qt_be_free(be, d);
                char name[96];
                snprintf(name, sizeof name, "mask/%d.%s", l, qt_lin_name(c, j));
                int64_t shape[2] = {(int64_t)N, in};
                if (st_writer_add(w, name, QT_F32, 2, shape, p, QT_F32) != QT_OK) return die();
                p += N * (size_t)in;
            }
    }
    if (train && pref) {
        qt_objective obj;
        cJSON *oj = cJSON_Parse(pref);
        if (qt_objective_parse(oj, "--pref", &obj) != QT_OK) return die();
        cJSON_Delete(oj);
        double *rsum = calloc((size_t)b.B, sizeof(double)), *psum = calloc((size_t)b.B, sizeof(double));
        int64_t *rn = calloc((size_t)b.B, sizeof(int64_t));
        qt_pref_step ps = {.o = &obj, .targets = b.targets, .scale = grad_scale, .inv_pairs = 2.0 / b.B};
        if (qt_objective_needs_ref(&obj)) {
            qt_model_set_adapter(m, 0);
            if (qt_model_forward(m, &b, &loss_sum, &ntok, logp) != QT_OK) return die();
            qt_model_set_adapter(m, 1);
            qt_pref_row_sums(logp, b.targets, b.B, b.T, rsum, rn);
            ps.ref_sum = rsum;
        }
        int64_t nchosen = 0; /* answer tokens of the chosen rows: the NLL's token mean */
        for (int r = 0; r < b.B / 2; r++)
            for (int t = 0; t < b.T; t++) nchosen += b.targets[(size_t)r * b.T + t] != QT_IGNORE_INDEX;
        ps.inv_chosen = nchosen ? 1.0 / (double)nchosen : 0;
        if (qt_model_forward_backward_rows(m, &b, qt_pref_row_weights, &ps, &loss_sum, &ntok) != QT_OK) return die();
        /* the policy's row sums, from a forward of the same weights (no dropout in these tests) */
        if (qt_model_forward(m, &b, NULL, NULL, logp) != QT_OK) return die();
        qt_pref_row_sums(logp, b.targets, b.B, b.T, psum, rn);
        static float f[64], mf[10]; /* the writer keeps pointers until it writes */
        int64_t nb = b.B, nm = 10;
        for (int r = 0; r < b.B && r < 32; r++) f[r] = (float)psum[r], f[32 + r] = (float)rsum[r];
        double mv[10] = {ps.sums.loss, ps.sums.rewards_chosen, ps.sums.rewards_rejected, ps.sums.accuracies,
                         ps.sums.margins, ps.sums.logps_chosen, ps.sums.logps_rejected, ps.sums.nll,
                         ps.sums.log_odds_ratio, ps.sums.log_odds_chosen};

        for (int i = 0; i < 10; i++) mf[i] = (float)mv[i];
        if (st_writer_add(w, "pref/policy", QT_F32, 1, &nb, f, QT_F32) != QT_OK ||
            st_writer_add(w, "pref/ref", QT_F32, 1, &nb, f + 32, QT_F32) != QT_OK ||
            st_writer_add(w, "pref/sums", QT_F32, 1, &nm, mf, QT_F32) != QT_OK)
            return die();
        free(rsum), free(psum), free(rn);
    } else if (train) {
        for (int s = 0; s < steps; s++) {
            double t0 = now_ms();
            if (qt_model_forward_backward(m, &b, grad_scale, &loss_sum, &ntok) != QT_OK) return die();
            ms[s] = (float)(now_ms() - t0);
        }
    }
    if (train) {
        /* the gradients live in the backend's memory (a GPU's, with QTUNE_BACKEND=cuda): one download */
        int np;
        const qt_param *p = qt_model_params(m, &np);
        size_t ng = 0;
        for (int i = 0; i < np; i++) {
            size_t n = 1;
            for (int d = 0; d < p[i].ndim; d++) n *= (size_t)p[i].shape[d];
            if (p[i].offset + n > ng) ng = p[i].offset + n;
        }
        grads = malloc(sizeof(float) * (ng ? ng : 1));
        qt_backend *be = qt_model_backend(m);
        qt_be_download(be, grads, qt_model_grads(m), sizeof(float) * ng);
        char name[200];
        for (int i = 0; i < np; i++) {
            snprintf(name, sizeof name, "grad/%s", p[i].name);
            if (st_writer_add(w, name, QT_F32, p[i].ndim, p[i].shape, grads + p[i].offset, QT_F32) != QT_OK)
                return die();
        }
    } else if (decode) {
        /* row 0: prefill the first half at once, then one token at a time */
        int T = b.T, P = T / 2 > 0 ? T / 2 : 1, nsteps = T - P + 1;
        logits = malloc(sizeof(float) * (size_t)nsteps * V);
        if (qt_model_decode(m, b.inputs, P, 0, logits) != QT_OK) return die();
        for (int t = P; t < T; t++)
            if (qt_model_decode(m, b.inputs + t, 1, t, logits + (size_t)(t - P + 1) * V) != QT_OK) return die();
        int64_t shape[2] = {nsteps, V};
        if (st_writer_add(w, "logits", QT_F32, 2, shape, logits, QT_F32) != QT_OK) return die();
    } else {
        for (int s = 0; s < steps; s++) {
            double t0 = now_ms();
            if (qt_model_forward(m, &b, &loss_sum, &ntok, logp) != QT_OK) return die();
            ms[s] = (float)(now_ms() - t0);
        }
    }
    int64_t nsteps = steps;
    if (st_writer_add(w, "step_ms", QT_F32, 1, &nsteps, ms, QT_F32) != QT_OK) return die();
    scal[0] = (float)loss_sum;
    scal[1] = (float)ntok;
    int64_t one = 1, bt[2] = {b.B, b.T};
    float infer16 = (float)m->infer16;
    if (st_writer_add(w, "infer16", QT_F32, 1, &one, &infer16, QT_F32) != QT_OK ||
        st_writer_add(w, "loss_sum", QT_F32, 1, &one, &scal[0], QT_F32) != QT_OK ||
        st_writer_add(w, "n_tokens", QT_F32, 1, &one, &scal[1], QT_F32) != QT_OK ||
        st_writer_add(w, "logp", QT_F32, 2, bt, logp, QT_F32) != QT_OK || st_writer_write(w, out_path) != QT_OK)
        return die();
    st_writer_free(w);
    qt_model_free(m);
    free(b.inputs), free(b.targets), free(b.positions), free(b.doc_start), free(logp), free(logits), free(ms), free(masks), free(grads);
    return 0;
}
