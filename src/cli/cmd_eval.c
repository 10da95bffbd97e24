/* qtune eval: mean next-token cross-entropy of a model (optionally with a
 * PEFT adapter) over a JSONL dataset. One example per row, cut to --seq-len,
 * rows padded; labels in HF's unshifted sense (the label of token t is
 * predicted from tokens < t). The last stdout line is
 *   {"loss": L, "ppl": P, "tokens": N}
 * --per-token writes one JSON line per example: {"index": i, "logprobs": [...]}
 * aligned with its tokens, entry t = log p(token t | tokens < t) for labelled
 * t >= 1, null elsewhere. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "core/mem.h"
#include "core/progress.h"
#include "data/batch.h"
#include "data/format.h"
#include "data/lines.h"
#include "model/lora_io.h"
#include "model/model.h"
#include "text/tokenizer.h"
#include "data/pref.h"
#include "train/objective.h"
#include "train/pref_pass.h"

static void eval_help(void) {
    printf("usage: qtune eval --model DIR [--adapter DIR] [--tokenizer PATH] --data FILE [--format F] [--seq-len T]\n"
           "                  [--batch B] [--per-token OUT.jsonl] [--device D] [--quantization nf4|fp4]\n"
           "       qtune eval --model DIR [--adapter DIR | --ref-model DIR] --data PAIRS.jsonl --objective OBJ ...\n\n"
           "Mean next-token cross-entropy (nats) and perplexity over the tokens that carry labels.\n"
           "  --model DIR        Hugging Face model folder (config.json, *.safetensors[, tokenizer.json])\n"
           "  --adapter DIR      PEFT LoRA adapter folder (adapter_config.json, adapter_model.safetensors)\n"
           "  --tokenizer PATH   tokenizer.json (or a folder holding one) when --model has none\n"
           "  --data FILE        JSONL, one example a line\n"
           "  --format F         auto (default), text, messages, sharegpt, alpaca, prompt_completion,\n"
           "                     tokens ({\"input_ids\", \"labels\"?})\n"
           "  --seq-len T        tokens per example; longer examples are cut\n"
           "                     (default min(1024, the model's max_position_embeddings))\n"
           "  --batch B          examples per forward pass (default 1)\n"
           "  --per-token OUT    write each example's per-token log-probabilities as JSONL\n"
           "  --quantization nf4|fp4  the base's layer linears in 4 bits (QLoRA; as the job's \"quantization\")\n"
           "  --double-quant     with --quantization: bnb_4bit_use_double_quant\n"
           "  --device D         auto (default: a GPU, else an Ascend NPU, else the CPU), cpu, cuda,\n"
           "                     cuda:N (GPU N), npu, npu:N; QTUNE_BACKEND, when set, wins\n"
           "  --objective OBJ    held-out preference pairs (prompt, chosen, rejected; docs/preference.md):\n"
           "                     dpo, orpo, simpo, or the job's object as JSON ('{\"type\": \"dpo\", \"beta\": 0.1}');\n"
           "                     prints TRL's eval_ metrics (eval_loss, eval_rewards/accuracies, ...)\n"
           "  --ref-model DIR    dpo's reference when there is no --adapter (a full fine-tuning's start)\n"
           "The last line of standard output is {\"loss\": L, \"ppl\": P, \"tokens\": N}\n"
           "(with --objective: {\"pairs\": N, \"eval_loss\": L, \"eval_rewards/chosen\": ..., ...}).\n");
}

typedef struct {
    dl_tokbuf tb;
    size_t *start;  /* (n + 1) offsets of each example in tb */
    int64_t *line;  /* (n) the file line of each example, for messages */
    size_t n, cap;
} eval_data;

/* Reads the file line by line through the data module's bounded reader: a
 * line longer than DL_DEFAULT_MAX_LINE_BYTES is refused without being stored,
 * so a huge or hostile file costs no more memory than its examples. */
static int read_data(const char *path, dl_format fmt, const bpe_tokenizer *tok, int32_t V, eval_data *d) {
    dl_lines r;
    QT_TRY(dl_lines_open(&r, path, 0));
    dl_encode_ctx ctx = {.tok = tok, .mask_prompt = 1, .vocab_limit = V};
    int rc = dl_seen_keys_new(path, &ctx.seen);
    if (rc != QT_OK) {
        dl_lines_close(&r);
        return rc;
    }
    for (;;) {
        char *s;
        size_t len;
        int got = dl_lines_next(&r, &s, &len);
        if (got == 0) break;
        if (got < 0) { rc = got; break; }
        const long long line = (long long)r.line_no;
        if (dl_line_blank(s, len)) continue;
        dl_format f = fmt; /* AUTO: detected line by line, so a file may mix formats */
        rc = dl_encode_line_in_place(&ctx, path, line, s, len, &f, &d->tb);
        if (rc != QT_OK) break;
        if (d->n + 2 > d->cap) {
            size_t cap = d->cap ? 2 * d->cap : 256;
            size_t *ns = qt_realloc(d->start, cap * sizeof(size_t), "eval: example offsets");
            if (ns) d->start = ns;
            int64_t *nl = ns ? qt_realloc(d->line, cap * sizeof(int64_t), "eval: example lines") : NULL;
            if (!nl) {
                rc = QT_ENOMEM;
                break;
            }
            d->line = nl, d->cap = cap;
        }
        if (d->n == 0) d->start[0] = 0;
        d->line[d->n] = line;
        d->start[++d->n] = d->tb.n;
    }
    dl_seen_keys_free(ctx.seen);
    dl_lines_close(&r);
    if (rc == QT_OK && d->n == 0) rc = QT_ERR(QT_EINVAL, "%s holds no examples", path);
    return rc;
}

static void write_per_token(FILE *f, size_t index, const eval_data *d, size_t ex, const float *logp, int T) {
    size_t n = d->start[ex + 1] - d->start[ex];
    if (n > (size_t)T) n = (size_t)T;
    fprintf(f, "{\"index\": %zu, \"logprobs\": [", index);
    for (size_t t = 0; t < n; t++) {
        if (t) fputs(", ", f);
        if (t >= 1 && d->tb.mask[d->start[ex] + t]) fprintf(f, "%.9g", logp[t - 1]);
        else fputs("null", f);
    }
    fputs("]}\n", f);
}

/* The error for a batch whose loss is not a finite number, naming the line of
 * the first example with a non-finite log-probability (logp: rows x Tb). */
static int nonfinite_loss(const char *data, const char *model_dir, const char *adapter, const eval_data *d,
                          size_t e0, int rows, int Tb, const float *logp, double loss_sum) {
    int bad = -1;
    for (int r = 0; r < rows && bad < 0; r++)
        for (int t = 0; t < Tb && bad < 0; t++)
            if (!isfinite(logp[(size_t)r * Tb + t])) bad = r;
    if (bad < 0) bad = 0; /* none found in logp: name the batch's first example */
    return QT_ERR(QT_EINVAL,
                  "%s line %lld: the loss is %s, not a finite number: the model in %s%s%s gives non-finite "
                  "log-probabilities there; check its weights for NaN or inf values",
                  data, (long long)d->line[e0 + (size_t)bad], isnan(loss_sum) ? "NaN" : "infinite", model_dir,
                  adapter ? " with the adapter in " : "", adapter ? adapter : "");
}

/* T == 0: min(1024, the model's max_position_embeddings), so a small model
 * evaluates without a --seq-len. */
static int run_eval(const char *model_dir, const char *tok_path, const char *adapter, const char *data, dl_format fmt,
                    int T, int B, const char *per_token, const qt_device *dev, int q4_type, int q4_nested) {
    int rc;
    qt_config cfg;
    QT_TRY(qt_config_load(model_dir, &cfg));
    const int max_pos = qt_config_max_positions(&cfg); /* seq_length for an original Qwen with NTK/logn on */
    if (T == 0) T = max_pos < 1024 ? max_pos : 1024; /* config: >= 1 */
    qt_model_opts o;
    qt_model_opts_default(&o);
    o.infer = 1;
    o.keep_mapped = 1; /* no decoding: the batched forward packs panels of the mapped base */
    o.max_B = B;
    o.max_T = T;
    o.backend = dev->backend;
    o.device_index = dev->index;
    o.quant4 = q4_type >= 0, o.quant4_type = q4_type, o.quant4_nested = q4_nested;
    o.progress = stderr;
    if (adapter) QT_TRY(qt_lora_opts_from_adapter(adapter, &cfg, &o));

    bpe_tokenizer *tok = NULL;
    char tpath[4096];
    if (tok_path) QT_TRY(qt_error_oom_advice(bpe_load(tok_path, &tok), QT_TOKENIZER_OOM_ADVICE)); /* --tokenizer: a file or a folder */
    else if (bpe_folder_file(model_dir, tpath, sizeof tpath) && fmt != DL_FORMAT_TOKENS)
        QT_TRY(qt_error_oom_advice(bpe_load(tpath, &tok), QT_TOKENIZER_OOM_ADVICE));
    eval_data d;
    memset(&d, 0, sizeof d);
    rc = read_data(data, fmt, tok, cfg.vocab_size, &d);
    bpe_free(tok);

    qt_model *m = NULL;
    if (rc == QT_OK) rc = qt_model_load(model_dir, &o, &m);
    if (rc == QT_OK && adapter) rc = qt_lora_load(m, adapter);

    qt_batch b;
    memset(&b, 0, sizeof b);
    size_t NT = (size_t)B * T;
    b.inputs = qt_malloc(NT * 4, "eval batch");
    b.targets = qt_malloc(NT * 4, "eval batch");
    b.positions = qt_malloc(NT * 4, "eval batch");
    b.doc_start = qt_calloc(NT, 4, "eval batch");
    float *logp = qt_malloc(NT * 4, "eval log-probabilities");
    if (!b.inputs || !b.targets || !b.positions || !b.doc_start || !logp) rc = rc ? rc : QT_ENOMEM;

    FILE *pt = NULL;
    qt_atomic_file af = {0};
    if (rc == QT_OK && per_token) {
        rc = qt_atomic_open(&af, per_token);
        pt = af.f;
    }
    double total = 0;
    int64_t ntok = 0, ncut = 0;
    qt_progress prog;
    qt_progress_start(&prog, stderr, isatty(2), "eval", (double)d.n, "examples");
    for (size_t e0 = 0; rc == QT_OK && e0 < d.n; e0 += (size_t)B) {
        qt_progress_set(&prog, (double)e0);
        int rows = d.n - e0 < (size_t)B ? (int)(d.n - e0) : B;
        /* rows of the longest example in this batch (at least 1) */
        int Tb = 1;
        for (int r = 0; r < rows; r++) {
            size_t n = d.start[e0 + r + 1] - d.start[e0 + r];
            if (n > (size_t)T) n = (size_t)T, ncut++;
            if ((int)n > Tb) Tb = (int)n;
        }
        b.B = rows, b.T = Tb;
        for (int r = 0; r < rows; r++) {
            size_t s = d.start[e0 + r], n = d.start[e0 + r + 1] - s;
            if (n > (size_t)Tb) n = (size_t)Tb;
            for (int t = 0; t < Tb; t++) {
                size_t i = (size_t)r * Tb + t;
                b.inputs[i] = (size_t)t < n ? d.tb.ids[s + t] : 0;
                b.targets[i] = ((size_t)t + 1 < n && d.tb.mask[s + t + 1]) ? d.tb.ids[s + t + 1] : QT_IGNORE_INDEX;
                b.positions[i] = t;
                b.doc_start[i] = 0;
            }
        }
        double ls;
        int64_t nt;
        rc = qt_model_forward(m, &b, &ls, &nt, logp);
        if (rc == QT_OK && !isfinite(ls)) rc = nonfinite_loss(data, model_dir, adapter, &d, e0, rows, Tb, logp, ls);
        if (rc != QT_OK) break;
        total += ls, ntok += nt;
        if (pt)
            for (int r = 0; r < rows; r++) write_per_token(pt, e0 + r, &d, e0 + r, logp + (size_t)r * Tb, Tb);
    }
    if (rc == QT_OK) prog.done = (double)d.n;
    qt_progress_end(&prog);
    if (pt) rc = rc == QT_OK ? qt_atomic_commit(&af) : (qt_atomic_abort(&af), rc);
    if (rc == QT_OK) {
        if (ncut) qt_warn("eval: %lld examples were longer than --seq-len %d and were cut", (long long)ncut, T);
        if (ntok == 0) {
            /* one-token examples (or --seq-len 1) are the usual cause: token 0 is never predicted */
            rc = QT_ERR(QT_EINVAL, "%s: no token carries a label, so there is no loss to report; each token is "
                        "scored from the ones before it, so give examples of 2 or more tokens (within --seq-len "
                        "%d) whose tokens after the first are labelled", data, T);
        } else {
            /* exp overflows a double past a loss of ~709.78 nats; JSON has no
             * infinity (printf's "inf" would break the line), so ppl is null */
            const double loss = total / (double)ntok, ppl = exp(loss);
            char p[32] = "null";
            if (isfinite(ppl)) snprintf(p, sizeof p, "%.9g", ppl);
            printf("{\"loss\": %.9g, \"ppl\": %s, \"tokens\": %lld}\n", loss, p, (long long)ntok);
        }
    }
    qt_free(b.inputs), qt_free(b.targets), qt_free(b.positions), qt_free(b.doc_start), qt_free(logp);
    qt_model_free(m);
    dl_tokbuf_free(&d.tb);
    qt_free(d.start);
    qt_free(d.line);
    return rc;
}

/* --objective: held-out preference pairs (docs/preference.md). The
 * reference is the base with the adapter off (--adapter), or --ref-model's
 * weights (a full fine-tuning's starting model); its log-probs are computed
 * first, so only one model is in memory at a time. */
static int load_for_eval(const char *dir, const char *adapter, int B, int T, const qt_device *dev, int q4_type,
                         int q4_nested, qt_model **m) {
    qt_config cfg;
    QT_TRY(qt_config_load(dir, &cfg));
    qt_model_opts o;
    qt_model_opts_default(&o);
    o.infer = 1;
    o.keep_mapped = 1;
    o.max_B = 2 * B; /* a chosen and a rejected row per pair */
    o.max_T = T;
    o.backend = dev->backend;
    o.device_index = dev->index;
    o.quant4 = q4_type >= 0, o.quant4_type = q4_type, o.quant4_nested = q4_nested;
    o.progress = stderr;
    if (adapter) QT_TRY(qt_lora_opts_from_adapter(adapter, &cfg, &o));
    QT_TRY(qt_model_load(dir, &o, m));
    if (adapter && qt_lora_load(*m, adapter) != QT_OK) {
        qt_model_free(*m);
        *m = NULL;
        return QT_EINVAL;
    }
    return QT_OK;
}

static int run_pref_eval(const char *model_dir, const char *tok_path, const char *adapter, const char *ref_model,
                         const char *data, const qt_objective *obj, int T, int B, const qt_device *dev, int q4_type,
                         int q4_nested) {
    qt_config cfg;
    QT_TRY(qt_config_load(model_dir, &cfg));
    const int max_pos = qt_config_max_positions(&cfg);
    if (T == 0) T = max_pos < 1024 ? max_pos : 1024;
    if (qt_objective_needs_ref(obj) && !adapter && !ref_model)
        return QT_ERR(QT_EINVAL, "eval: objective dpo compares with a reference model: give --adapter (the reference "
                                 "is the base with the adapter off), --ref-model DIR (the model a full fine-tuning "
                                 "started from), or set reference_free in --objective");
    bpe_tokenizer *tok = NULL;
    char tpath[4096];
    if (tok_path) QT_TRY(qt_error_oom_advice(bpe_load(tok_path, &tok), QT_TOKENIZER_OOM_ADVICE));
    else if (bpe_folder_file(model_dir, tpath, sizeof tpath))
        QT_TRY(qt_error_oom_advice(bpe_load(tpath, &tok), QT_TOKENIZER_OOM_ADVICE));
    else return QT_ERR(QT_EINVAL, "eval: %s has no tokenizer.json; give --tokenizer PATH (preference pairs are text)",
                       model_dir);
    dl_pref_set set;
    memset(&set, 0, sizeof set);
    int rc = dl_pref_load(data, tok, T, &set);
    bpe_free(tok);
    QT_TRY(rc);
    if (set.n_truncated)
        qt_warn("eval: %lld of the %lld answers in %s are longer than --seq-len %d and were cut to it",
                (long long)set.n_truncated, (long long)(2 * set.n_pairs), data, T);
    int Tb = 1; /* rows as long as the longest side, not --seq-len */
    for (int64_t s = 0; s < 2 * set.n_pairs; s++)
        if (set.start[s + 1] - set.start[s] > Tb) Tb = (int)(set.start[s + 1] - set.start[s]);
    const int64_t N = set.n_pairs;
    qt_batch b;
    memset(&b, 0, sizeof b);
    size_t NT = (size_t)2 * B * Tb;
    b.inputs = qt_malloc(NT * 4 * 4, "eval batch");
    float *logp = qt_malloc(NT * 4, "eval log-probabilities");
    double *pol = qt_malloc(sizeof(double) * (size_t)(4 * N), "eval log-probs"), *ref = pol ? pol + 2 * N : NULL;
    int64_t *n = qt_malloc(sizeof(int64_t) * (size_t)(4 * N), "eval log-probs");
    int64_t *idx = qt_malloc(sizeof(int64_t) * (size_t)N, "eval pairs");
    rc = b.inputs && logp && pol && n && idx ? QT_OK : QT_ENOMEM;
    if (rc == QT_OK) b.targets = b.inputs + NT, b.positions = b.inputs + 2 * NT, b.doc_start = b.inputs + 3 * NT;
    for (int64_t i = 0; i < N && idx; i++) idx[i] = i;
    qt_model *m = NULL;
    const int needs_ref = qt_objective_needs_ref(obj);
    if (rc == QT_OK && needs_ref && ref_model) {
        rc = load_for_eval(ref_model, NULL, B, Tb, dev, q4_type, q4_nested, &m);
        if (rc == QT_OK) rc = qt_pref_logps(m, &set, idx, N, B, Tb, 1, &b, logp, ref, n + 2 * N);
        if (rc != QT_OK) rc = qt_error_context(rc, "eval: --ref-model %s", ref_model);
        qt_model_free(m);
        m = NULL;
    }
    if (rc == QT_OK) rc = load_for_eval(model_dir, adapter, B, Tb, dev, q4_type, q4_nested, &m);
    if (rc == QT_OK && needs_ref && !ref_model) rc = qt_pref_logps(m, &set, idx, N, B, Tb, 0, &b, logp, ref, n + 2 * N);
    if (rc == QT_OK) rc = qt_pref_logps(m, &set, idx, N, B, Tb, 1, &b, logp, pol, n);
    if (rc == QT_OK) {
        qt_pref_sums s = {0};
        int64_t chosen = 0;
        char fields[1024];
        qt_pref_eval_add(obj, N, pol, n, needs_ref ? ref : NULL, &s, &chosen);
        double loss = qt_pref_eval_loss(obj, &s, chosen);
        if (!isfinite(loss))
            rc = QT_ERR(QT_EINVAL, "%s: the loss is not a finite number: the model in %s%s%s gives non-finite "
                        "log-probabilities; check its weights for NaN or inf values", data, model_dir,
                        adapter ? " with the adapter in " : "", adapter ? adapter : "");
        else {
            qt_pref_metrics_json(obj, "eval_", loss, &s, chosen, fields, sizeof fields);
            printf("{\"pairs\": %lld%s}\n", (long long)N, fields);
        }
    }
    qt_model_free(m);
    qt_free(b.inputs), qt_free(logp), qt_free(pol), qt_free(n), qt_free(idx);
    dl_pref_free(&set);
    return rc;
}

/* --objective's value: a type name ("dpo") or the job's object as JSON. */
static int parse_objective(const char *v, qt_objective *o) {
    cJSON *j = v[0] == '{' ? cJSON_Parse(v) : cJSON_CreateObject();
    if (!j) return QT_ERR(QT_EINVAL, "--objective: '%s' is not a JSON object; write e.g. '{\"type\": \"dpo\", "
                                     "\"beta\": 0.1}' or just dpo", v);
    if (v[0] != '{') cJSON_AddStringToObject(j, "type", v);
    int rc = qt_objective_parse(j, "--objective", o);
    cJSON_Delete(j);
    if (rc == QT_OK && o->type == QT_OBJ_SFT)
        rc = QT_ERR(QT_EINVAL, "--objective sft is the default; leave --objective out for the cross-entropy");
    return rc;
}

int cmd_eval(int argc, char **argv) {
    if (cli_wants_help(argc, argv)) {
        eval_help();
        return QT_EXIT_OK;
    }
    const char *model = NULL, *adapter = NULL, *data = NULL, *per_token = NULL, *tok_path = NULL, *device = NULL;
    const char *objective = NULL, *ref_model = NULL;
    dl_format fmt = DL_FORMAT_AUTO;
    int T = 0, B = 1; /* T 0: the default, decided once the model's config is read */
    int q4_type = -1, q4_nested = 0;
    cli_once_list once = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        char *end;
#define NEED_VALUE() CLI_NEED_VALUE(&once, "eval", a, v, i)
        if (!strcmp(a, "--model")) { NEED_VALUE(); model = v; }
        else if (!strcmp(a, "--adapter")) { NEED_VALUE(); adapter = v; }
        else if (!strcmp(a, "--tokenizer")) { NEED_VALUE(); tok_path = v; }
        else if (!strcmp(a, "--data")) { NEED_VALUE(); data = v; }
        else if (!strcmp(a, "--format")) {
            NEED_VALUE();
            if (dl_format_parse(v, &fmt) != QT_OK) {
                qt_error_clear();
                return cli_usage_error("eval", "--format must be auto, text, messages, sharegpt, alpaca, prompt_completion or tokens, not '%s'", v);
            }
        }
        else if (!strcmp(a, "--per-token")) { NEED_VALUE(); per_token = v; }
        else if (!strcmp(a, "--objective")) { NEED_VALUE(); objective = v; }
        else if (!strcmp(a, "--ref-model")) { NEED_VALUE(); ref_model = v; }
        else if (!strcmp(a, "--device")) { NEED_VALUE(); device = v; }
        else if (!strcmp(a, "--double-quant")) q4_nested = 1;
        else if (!strcmp(a, "--quantization")) {
            NEED_VALUE();
            int st = cli_quant_type("eval", v, &q4_type);
            if (st != QT_EXIT_OK) return st;
        } else if (!strcmp(a, "--seq-len") || !strcmp(a, "--batch")) {
            NEED_VALUE();
            long x = strtol(v, &end, 10);
            if (*end || x < 1 || x > (1 << 20))
                return cli_usage_error("eval", "%s must be a whole number from 1 to %d, not '%s'", a, 1 << 20, v);
            if (a[2] == 's') T = (int)x;
            else B = (int)x;
        } else {
            return cli_usage_error("eval", "unknown option '%s'", a);
        }
#undef NEED_VALUE
    }
    if (!model || !data) return cli_usage_error("eval", "--model and --data are required");
    if (adapter && cli_check_adapter(adapter) != QT_OK) return cli_fail();
    qt_device dev;
    int st = cli_device("eval", device, &dev);
    if (st != QT_EXIT_OK) return st;
    if (objective) {
        qt_objective obj;
        if (parse_objective(objective, &obj) != QT_OK) return cli_usage_error("eval", "%s", qt_error_message());
        if (per_token || fmt != DL_FORMAT_AUTO)
            return cli_usage_error("eval", "--per-token and --format do not apply with --objective (the pairs' "
                                           "shape is detected line by line)");
        if (ref_model && !qt_objective_needs_ref(&obj))
            return cli_usage_error("eval", "--ref-model applies to objective dpo without reference_free only");
        if (run_pref_eval(model, tok_path, adapter, ref_model, data, &obj, T, B, &dev, q4_type, q4_nested) != QT_OK)
            return cli_fail();
        return QT_EXIT_OK;
    }
    if (ref_model) return cli_usage_error("eval", "--ref-model needs --objective dpo");
    if (run_eval(model, tok_path, adapter, data, fmt, T, B, per_token, &dev, q4_type, q4_nested) != QT_OK) return cli_fail();
    return QT_EXIT_OK;
}
