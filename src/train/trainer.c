/* The training loop (see trainer.h for the step, docs/training.md for the
 * outputs). Reads top to bottom: set up -> resume -> loop of steps (with eval,
 * logging, checkpoints, the stop flag) -> final outputs. */
#include "train/trainer.h"
#include "core/clock.h"

#include "core/error.h"
#include "core/fault.h"
#include "core/messages.h"
#include "core/fs.h"
#include "core/log.h"
#include "core/mem.h"
#include "core/progress.h"
#include "core/rng.h"
#include "data/preview.h"
#include "io/checkpoint.h"
#include "model/lora_io.h"
#include "model/memplan.h"
#include "optim/clip.h"
#include "text/chat_template.h"
#include "train/decay.h"
#include "train/plan_report.h"
#include "train/pref_pass.h"
#include "train/stall.h"
#include "train/trainer_state.h"

#include <dirent.h>
#include <math.h>
#include <omp.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* ---------------------------------------------------------------------------
 * set up */

/* A run whose data has no labelled token left (prompt masking, truncation to
 * seq_len) would run every step as a skipped one and fail at the end: it
 * stops here, before step 1, with the numbers. */
static int check_labels(qt_trainer *t) {
    dl_stats st;
    dl_get_stats(t->train_dl, &st);
    if (st.n_targets > 0) return QT_OK;
    const qt_job_data *d = &t->job->data;
    char more[32] = "";
    if (d->n_train > 1) snprintf(more, sizeof more, " and %d more", d->n_train - 1);
    return QT_ERR(QT_EINVAL,
                  "%s: no token of data.train (%s%s) carries a label%s: %lld examples, %lld tokens, %lld of them "
                  "truncated to data.seq_len %d (%lld tokens dropped); nothing would be learned. %s",
                  t->job->path, d->train, more, st.n_truncated ? " after truncation" : "", (long long)st.n_examples,
                  (long long)st.n_tokens, (long long)st.n_truncated, d->seq_len, (long long)st.n_tokens_dropped,
                  st.n_truncated ? "Raise data.seq_len so the answers fit, or shorten the prompts"
                                 : "Each example needs at least 2 tokens and, with data.mask_prompt on, assistant or "
                                   "output text (only those tokens are trained)");
}

/* Preference objectives: the pairs of data.train in memory (data/pref.h);
 * each micro-batch of B pairs is 2B rows. */
static int pref_batch_alloc(qt_batch *b, int rows, int T) {
    size_t n = (size_t)rows * (size_t)T;
    memset(b, 0, sizeof *b);
    b->inputs = qt_malloc(4 * n * sizeof(int32_t), "a preference batch"); /* one block, as dl_batch_free frees */
    if (!b->inputs) return QT_ENOMEM;
    b->targets = b->inputs + n, b->positions = b->inputs + 2 * n, b->doc_start = b->inputs + 3 * n;
    b->B = rows, b->T = T;
    return QT_OK;
}

/* The loader's stats and position, or for preference pairs what the step says. */
static void train_stats(const qt_trainer *t, dl_stats *st) {
    if (t->train_dl) {
        dl_get_stats(t->train_dl, st);
        return;
    }
    memset(st, 0, sizeof *st);
    st->n_examples_rank = t->pref_train.n_pairs / t->world;
}

static int open_pref(qt_trainer *t) {
    const qt_job *job = t->job;
    if (job->data.n_train > 1 || job->data.n_eval > 1)
        return QT_ERR(QT_EINVAL, "%s: a preference objective reads one data.train and at most one data.eval file; "
                                 "concatenate the pair files into one", job->path);
    int rc = dl_pref_load(job->data.train, t->tok, job->data.seq_len, &t->pref_train);
    if (rc != QT_OK) return qt_error_context(rc, "%s: data.train", job->path);
    if (t->main && t->pref_train.n_truncated)
        qt_warn("%lld of the %lld answers in %s are longer than data.seq_len %d and were cut to it",
                (long long)t->pref_train.n_truncated, (long long)(2 * t->pref_train.n_pairs), job->data.train,
                job->data.seq_len);
    if (job->data.eval) { /* held-out pairs: TRL's eval_ metrics */
        rc = dl_pref_load(job->data.eval, t->tok, job->data.seq_len, &t->pref_eval);
        if (rc != QT_OK) return qt_error_context(rc, "%s: data.eval", job->path);
    }
    t->pref_perm = qt_malloc(sizeof(uint64_t) * (size_t)t->pref_train.n_pairs, "the pairs' order");
    t->mb = qt_calloc((size_t)t->cfg.grad_accum, sizeof *t->mb, "micro-batch buffers");
    if (!t->pref_perm || !t->mb) return QT_ENOMEM;
    t->pref_epoch = -1;
    for (int a = 0; a < t->cfg.grad_accum; a++)
        QT_TRY(pref_batch_alloc(&t->mb[a], 2 * t->cfg.micro_batch, job->data.seq_len));
    return QT_OK;
}

/* a double's bits as an int64 and back: the pass's sums travel in dist_allgather_i64 unchanged */
static int64_t bits_of(double v) {
    int64_t b;
    memcpy(&b, &v, sizeof b);
    return b;
}
static double double_of(int64_t b) {
    double v;
    memcpy(&v, &b, sizeof v);
    return v;
}

/* Every pair of set through the model (adapter 0: with the LoRA adapter off):
 * rank r takes pairs r, r + world, ..., each rank the same number of
 * micro-batches (a short rank repeats pair 0 and drops it: ZeRO-3's
 * forwards gather collectively), and the sums are all-reduced, so every rank
 * ends with all of them. n_limit > 0 takes the first n_limit pairs only. */
static int pref_pass(qt_trainer *t, const dl_pref_set *set, int64_t n_limit, int adapter, double *sum, int64_t *n) {
    const int B = t->cfg.micro_batch, T = t->job->data.seq_len, W = t->world;
    int64_t N = n_limit > 0 && n_limit < set->n_pairs ? n_limit : set->n_pairs, M = (N + W - 1) / W;
    int64_t *idx = qt_malloc(sizeof(int64_t) * (size_t)(M ? M : 1), "pair indices");
    double *s = qt_malloc(sizeof(double) * (size_t)(2 * M + 1), "sequence log-probs");
    int64_t *k = qt_malloc(sizeof(int64_t) * (size_t)(2 * M + 1), "sequence log-probs");
    float *logp = qt_malloc(sizeof(float) * (size_t)2 * B * T, "sequence log-probs");
    int rc = idx && s && k && logp ? QT_OK : QT_ENOMEM;
    for (int64_t j = 0; j < M; j++) idx[j] = t->rank + j * W < N ? t->rank + j * W : 0;
    if (rc == QT_OK) rc = qt_pref_logps(t->model, set, idx, M, B, T, adapter, &t->mb[0], logp, s, k);
    /* every rank's 2M sums (as bits) and counts, rank-major: rank q's j-th pair is q + j W */
    int64_t *all = rc == QT_OK ? qt_malloc(sizeof(int64_t) * (size_t)(4 * M * W + 1), "sequence log-probs") : NULL;
    if (rc == QT_OK && !all) rc = QT_ENOMEM;
    if (rc == QT_OK) {
        int64_t *mine = qt_malloc(sizeof(int64_t) * (size_t)(4 * M + 1), "sequence log-probs");
        if (!mine) rc = QT_ENOMEM;
        for (int64_t j = 0; mine && j < 2 * M; j++) mine[j] = bits_of(s[j]), mine[2 * M + j] = k[j];
        if (rc == QT_OK) rc = dist_allgather_i64(t->d, mine, (int)(4 * M), all, "sequence log-probs");
        qt_free(mine);
    }
    for (int q = 0; rc == QT_OK && q < W; q++)
        for (int64_t j = 0; j < M; j++) {
            int64_t i = q + j * W;
            if (i >= N) continue;
            const int64_t *r = all + (size_t)q * 4 * M;
            for (int side = 0; side < 2; side++) {
                sum[2 * i + side] = double_of(r[2 * j + side]);
                n[2 * i + side] = r[2 * M + 2 * j + side];
            }
        }
    qt_free(all);
    qt_free(idx), qt_free(s), qt_free(k), qt_free(logp);
    return rc;
}

/* precompute_ref_log_probs (TRL's name): the reference's log-probs of every
 * pair, from the weights the run starts with (the model folder; the adapter
 * off for LoRA), before any checkpoint or init_from adapter is loaded, so a
 * resumed run gets the same ones. Cached beside the token cache, keyed by the
 * model folder and the tokens; a resume or a rerun reads them back. */
static int pref_reference_one(qt_trainer *t, const char *path, const dl_pref_set *set, double **out) {
    const int64_t n = 2 * set->n_pairs;
    *out = qt_malloc(sizeof(double) * (size_t)n, "reference log-probs");
    int64_t *cnt = qt_malloc(sizeof(int64_t) * (size_t)n, "reference log-probs");
    if (!*out || !cnt) {
        qt_free(cnt);
        return QT_ENOMEM;
    }
    char cache[4096];
    const int use_cache = qt_pref_ref_cache_path(path, t->job->data.cache_dir, cache, sizeof cache) == QT_OK;
    qt_error_clear();
    uint64_t key = qt_pref_ref_key(t->job->model, set, qt_dtype_name(t->cfg.compute), qt_be_desc(t->be)->name);
    int64_t hit = use_cache && qt_pref_ref_cache_read(cache, key, n, *out);
    if (t->world > 1) {
        int rc = dist_allreduce_i64(t->d, &hit, 1, DIST_MIN, "reference cache");
        if (rc != QT_OK) {
            qt_free(cnt);
            return rc;
        }
    }
    int rc = QT_OK;
    if (hit) {
        if (t->main) qt_info("reference log-probs of the %lld pairs of %s: read from %s", (long long)set->n_pairs, path,
                             cache);
    } else {
        double t0 = qt_now_s();
        rc = pref_pass(t, set, 0, 0, *out, cnt);
        if (rc == QT_OK && t->main) {
            qt_info("reference log-probs of the %lld pairs of %s: one pass with the starting weights%s, %.1f s%s%s",
                    (long long)set->n_pairs, path, t->job->lora.enabled ? " (the adapter off)" : "",
                    qt_now_s() - t0, use_cache ? "; cached in " : "", use_cache ? cache : "");
            if (use_cache && qt_pref_ref_cache_write(cache, key, n, *out) != QT_OK) {
                qt_warn("could not write the reference cache %s (%s); the next run computes it again", cache,
                        qt_error_message());
                qt_error_clear();
            }
        }
    }
    qt_free(cnt);
    return rc;
}

static int pref_reference_pass(qt_trainer *t) {
    if (!t->ref_pre) return QT_OK;
    QT_TRY(pref_reference_one(t, t->job->data.train, &t->pref_train, &t->ref_train));
    if (t->pref_eval.n_pairs) QT_TRY(pref_reference_one(t, t->job->data.eval, &t->pref_eval, &t->ref_eval));
    return QT_OK;
}

static int open_loaders(qt_trainer *t) {
    const qt_job *job = t->job;
    char tokpath[4096];
    if (bpe_folder_file(job->model, tokpath, sizeof tokpath)) QT_TRY(qt_error_oom_advice(bpe_load(tokpath, &t->tok), QT_TOKENIZER_OOM_ADVICE));
    else qt_info("%s has no tokenizer.json (nor qwen.tiktoken): only pre-tokenized data ({\"input_ids\": ...}) can be read", job->model);
    if (t->tok && t->main) { /* which template renders the chats, and the first example as it is trained on */
        char desc[512], *ex = NULL;
        chat_template_describe(t->tok, desc, sizeof desc);
        qt_info("chat template: %s", desc);
        if (dl_preview_first(t->tok, job->data.train, job->data.format, job->data.mask_prompt, 4000, &ex) == QT_OK)
            qt_info("first training example (labelled text between [[ and ]]):\n%s", ex);
        qt_free(ex);
        qt_error_clear(); /* a first line that does not encode is the loader's to report, with its line */
    }

    if (t->pref) return open_pref(t);
    dl_config c;
    dl_config_default(&c);
    c.paths = (const char *const *)job->data.train_files;
    c.n_paths = job->data.n_train;
    QT_TRY(dl_mix_parse(job->data.mix_strategy, &c.mix));
    c.mix_weights = job->data.train_weights;
    c.skip_bad_lines = job->data.skip_bad_lines;
    QT_TRY(dl_format_parse(job->data.format, &c.format));
    c.seq_len = job->data.seq_len;
    c.micro_batch = t->cfg.micro_batch;
    c.packing = job->data.packing;
    c.shuffle = job->data.shuffle;
    c.mask_prompt = job->data.mask_prompt;
    c.cache_dir = job->data.cache_dir;
    c.num_workers = job->data.num_workers;
    c.prefetch = job->data.prefetch;
    c.max_line_bytes = job->data.max_line_bytes;
    c.seed = job->train.seed;
    c.rank = t->rank;
    c.world = t->world;
    c.vocab_size = qt_model_config(t->model)->vocab_size;
    int rc = dl_open(&c, t->tok, &t->train_dl);
    if (rc != QT_OK) return qt_error_context(rc, "%s: data.train", job->path);
    QT_TRY(check_labels(t));
    if (job->data.eval) {
        c.paths = (const char *const *)job->data.eval_files;
        c.n_paths = job->data.n_eval;
        c.mix = DL_MIX_CONCAT; /* one pass over every eval example */
        c.mix_weights = NULL;
        c.eval = 1;
        c.shuffle = 0;
        c.num_workers = 1;
        rc = dl_open(&c, t->tok, &t->eval_dl);
        if (rc != QT_OK) return qt_error_context(rc, "%s: data.eval", job->path);
        QT_TRY(dl_batch_alloc(t->eval_dl, &t->eval_b));
    }
    t->mb = qt_calloc((size_t)t->cfg.grad_accum, sizeof *t->mb, "micro-batch buffers");
    if (!t->mb) return QT_ENOMEM;
    for (int a = 0; a < t->cfg.grad_accum; a++) QT_TRY(dl_batch_alloc(t->train_dl, &t->mb[a]));
    return QT_OK;
}

static int load_model(qt_trainer *t) {
    const qt_job *job = t->job;
    qt_model_opts o;
    QT_TRY(qt_run_setup_model_opts(&t->setup, &o));
    o.progress = t->main ? t->hooks->progress : NULL;
    o.backend = t->dev.backend;
    o.device_index = t->dev.index;
    int rc = qt_model_load(job->model, &o, &t->model);
    if (rc != QT_OK) return qt_error_context(rc, "%s: model", job->path);
    if (o.param_shards > 1 && t->main) {
        /* the gathers hold two layers and the embedding / lm_head at once: that is the floor here */
        size_t layer, outer;
        qt_model_gather_sizes(qt_model_config(t->model), &o, &layer, &outer);
        double live = (double)(2 * layer + outer);
        if (live > t->setup.ds.zero.max_live_parameters)
            qt_warn("%s: zero_optimization.stage3_max_live_parameters %.0f is below what ZeRO-3 keeps gathered at "
                    "once here, two layers and the embedding (%.0f elements); qtune keeps those (`qtune plan "
                    "--zero 3` counts them)", job->path, t->setup.ds.zero.max_live_parameters, live);
        /* what stage3_max_reuse_distance made of the V x C buffer, in the plan's words */
        qt_plan_opts po;
        qt_plan_opts_default(&po);
        qt_run_setup_plan_opts(&t->setup, &po);
        po.backend = t->dev.backend;
        char note[600];
        if (qt_plan_outer_note(qt_model_config(t->model), &po, note, sizeof note)) qt_info("zero: %s", note);
    }
    t->n = qt_model_numel(t->model);
    t->master = qt_model_master(t->model);
    t->sharded = qt_model_sharded(t->model, &t->shard);
    t->base_n = qt_model_base_sharded(t->model);
    t->grads = qt_model_grads(t->model);
    t->params = qt_model_params(t->model, &t->n_params);
    t->be = qt_model_backend(t->model);
    return QT_OK;
}

/* ZeRO-3's gathers for the model (model.h qt_param_fetch): the broadcasts of
 * a buffer's range start in start() and are waited for in wait(). */
static int fetch_start(void *u, int slot, const void *mine, size_t esize, size_t lo, size_t hi, void *dst) {
    qt_trainer *t = u;
    size_t n = t->base_n ? t->base_n : t->n; /* LoRA: the frozen base block */
    int need = zero_gather_slots(t->zp, n, lo, hi, esize);
    if (need > t->gcap[slot]) {
        tp_req **r = qt_realloc(t->greq[slot], (size_t)need * sizeof *r, "ZeRO-3 gather requests");
        if (!r) return QT_ENOMEM;
        t->greq[slot] = r;
        t->gcap[slot] = need;
    }
    memset(t->greq[slot], 0, (size_t)need * sizeof *t->greq[slot]);
    t->gn[slot] = need;
    return zero_gather_params(t->zp, n, mine, esize, lo, hi, dst, t->greq[slot]);
}
static int fetch_wait(void *u, int slot) {
    qt_trainer *t = u;
    int n = t->gn[slot];
    t->gn[slot] = 0;
    return zero_gather_wait(t->zp, t->greq[slot], n);
}

/* ZeRO's optimizer state is the backend's device memory too */
static void *state_alloc(size_t bytes, const char *what, void *user) {
    qt_backend *be = user;
    return qt_be_alloc(be, QT_MEM_DEVICE, bytes, what);
}
static void state_free(void *p, void *user) {
    qt_backend *be = user;
    qt_be_free(be, p);
}

/* The model's gradient hook, at ZeRO-2: straight into the plan. */
static int hook_window(void *u, const float *g, size_t n) { return zero_grads_window(u, g, n); }
static int hook_ready(void *u, size_t lo, size_t hi, const float *g) { return zero_grads_ready(u, lo, hi, g); }
static int hook_rows(void *u, size_t lo, int C, const int32_t *ids, const float *d, int n) {
    return zero_grads_rows(u, lo, C, ids, d, n);
}

static int setup_optimizer(qt_trainer *t) {
    /* gradient windows: the embedding's rows come as one message per micro-batch */
    qt_model_opts mo;
    QT_TRY(qt_run_setup_model_opts(&t->setup, &mo));
    qt_run_zero_from_model(&mo, qt_model_config(t->model)->hidden_size,
                           mo.grad_windows ? qt_model_grad_window_elems(t->model) : 0, &t->cfg.zero);
    t->cfg.zero.be = t->be;
    if (t->sharded) /* ZeRO-3: the norm weights and biases all-gathered after each update size its bucket */
        for (int k = 0; k < t->shard.n_runs; k++) t->cfg.zero.persist_elems += t->shard.runs[k].n;
    if (t->base_n) t->cfg.zero.persist_elems = t->n; /* LoRA: the whole adapter, all-gathered as at stage 2 */
    QT_TRY(zero_plan_create(t->d, t->n, &t->cfg.zero, &t->zp));
    zero_set_device_allocator(t->zp, state_alloc, state_free, t->be);
    if (!t->grads) {
        qt_grad_hook h = {hook_window, hook_ready, hook_rows, t->zp};
        qt_model_set_grad_hook(t->model, &h);
    }
    QT_TRY(zero_state_alloc(t->zp, 2, &t->zs));
    zero_opt_range(t->zp, &t->lo, &t->hi);
    if (t->sharded && (t->shard.lo != t->lo || t->shard.hi != t->hi)) /* one formula, core/shard.h */
        return QT_ERR(QT_EINVAL, "rank %d: the model's master shard [%zu, %zu) is not its optimizer range [%zu, %zu) "
                      "(a bug)", t->rank, t->shard.lo, t->shard.hi, t->lo, t->hi);
    if (t->sharded) qt_model_set_param_gather(t->model, trainer_gather_master, t);
    if (t->shard.params_sharded || t->base_n) {
        qt_param_fetch f = {fetch_start, fetch_wait, t, t->cfg.zero.prefetch};
        qt_model_set_param_fetch(t->model, &f);
    }
    QT_TRY(qt_decay_ranges_from_params(t->params, t->n_params, &t->decay, &t->n_decay));
    /* fp32/bf16: a static scale of 1 */
    return qt_optimizer_init(&t->opt, &t->cfg.adam, &t->cfg.sched, t->cfg.clip, t->cfg.fp16 ? &t->cfg.scaler : NULL);
}

/* max_steps from epochs when the job gives none: optimizer steps that cover
 * `epochs` passes over this rank's share (packed rows are estimated from the
 * token count). */
static long steps_from_epochs(const qt_trainer *t) {
    double B = t->cfg.micro_batch, A = t->cfg.grad_accum, T = t->job->data.seq_len;
    double rows;
    if (t->pref) rows = (double)t->pref_train.n_pairs / t->world; /* pairs: never packed */
    else if (t->job->data.packing) rows = (double)dl_tokens_per_epoch(t->train_dl) / t->world / T;
    else rows = (double)dl_num_examples(t->train_dl) / t->world;
    double steps = ceil(t->job->train.epochs * ceil(rows / B) / A);
    return steps < 1 ? 1 : (long)steps;
}

/* ---------------------------------------------------------------------------
 * evaluation: token-weighted mean loss over the eval set (all ranks) */

static int evaluate(qt_trainer *t, double *loss, int64_t *ntok) {
    *loss = NAN;
    *ntok = 0;
    if (!t->eval_dl) return QT_OK;
    QT_TRY(dl_state_set(t->eval_dl, (dl_state){0, 0}));
    double sum = 0;
    int64_t n = 0;
    /* batches of this rank, for the progress line (rank 0's) */
    double batches = ceil((double)dl_num_examples(t->eval_dl) / t->world / t->cfg.micro_batch);
    if (t->job->train.eval_batches && batches > (double)t->job->train.eval_batches)
        batches = (double)t->job->train.eval_batches;
    char what[64];
    snprintf(what, sizeof what, "eval at step %ld", t->step);
    qt_progress prog;
    qt_progress_start(&prog, t->main ? t->hooks->progress : NULL, t->hooks->tty, what, batches, "batches");
    for (long i = 0; !t->job->train.eval_batches || i < t->job->train.eval_batches; i++) {
        qt_progress_set(&prog, (double)i);
        int rc = dl_next(t->eval_dl, &t->eval_b);
        if (rc != DL_END) QT_TRY(rc);
        if (t->shard.params_sharded || t->base_n) {
            /* ZeRO-3: the forward's gathers are collective, so the ranks go on together while any has a
             * batch; one that has none takes part in the gathers only */
            int64_t any = rc != DL_END;
            QT_TRY(dist_allreduce_i64(t->d, &any, 1, DIST_MAX, "eval batches left"));
            if (!any) break;
            if (rc == DL_END) {
                QT_TRY(qt_model_forward_idle(t->model));
                continue;
            }
        } else if (rc == DL_END) {
            break;
        }
        double s;
        int64_t k;
        QT_TRY(qt_model_forward(t->model, &t->eval_b, &s, &k, NULL));
        sum += s;
        n += k;
        prog.done = (double)(i + 1);
    }
    qt_progress_end(&prog);
    QT_TRY(dist_allreduce_f64(t->d, &sum, 1, DIST_SUM, "eval loss sum"));
    QT_TRY(dist_allreduce_i64(t->d, &n, 1, DIST_SUM, "eval token count"));
    *loss = n ? sum / (double)n : NAN;
    *ntok = n;
    return QT_OK;
}

/* What report.html draws memory against: the plan for this job on this
 * device (qtune plan JOB.json), rank 0's process and its card. 0 and 0 when
 * there is none (the model folder's config could not be planned). */
static void report_plan(const qt_trainer *t, uint64_t *rank_bytes, uint64_t *device_bytes) {
    qt_plan_opts o;
    qt_plan p;
    *rank_bytes = *device_bytes = 0;
    qt_plan_opts_default(&o);
    o.backend = t->dev.backend;
    qt_run_setup_plan_opts(&t->setup, &o); /* the job as this run resolved it, for the model it loaded */
    if (qt_plan_compute(qt_model_config(t->model), &o, &p) == QT_OK) {
        *rank_bytes = p.cpu_rank_bytes;
        *device_bytes = p.dev.total;
    }
    qt_error_clear(); /* no plan: the page says so; the run goes on */
}

/* TensorBoard files when report_to asks: in logging_dir, else where the HF
 * Trainer puts them, OUTPUT/runs/MonDD_HH-MM-SS_HOST (a new folder, a new run
 * in TensorBoard, each time the job starts or resumes) */
static int open_tensorboard(qt_trainer *t) {
    char dir[4096], name[512], host[256] = "localhost";
    if (t->job->train.logging_dir) return qt_metrics_open_tensorboard(&t->metrics, t->job->train.logging_dir);
    time_t now = time(NULL);
    struct tm tm;
    localtime_r(&now, &tm);
    if (gethostname(host, sizeof host - 1) != 0) snprintf(host, sizeof host, "localhost");
    size_t k = strftime(name, sizeof name, "runs/%b%d_%H-%M-%S_", &tm);
    snprintf(name + k, sizeof name - k, "%s", host);
    QT_TRY(qt_path_join(dir, sizeof dir, t->job->output_dir, name));
    return qt_metrics_open_tensorboard(&t->metrics, dir);
}

/* Held-out pairs (data.eval with a preference objective): the policy's and
 * the reference's log-probs of every pair (the first eval_batches micro-batches
 * of each rank), and TRL's eval_ metrics over them, as JSON fields in extra. */
static int pref_evaluate(qt_trainer *t, double *loss, int64_t *pairs, char *extra, size_t cap, double am[2]) {
    const qt_objective *o = &t->job->objective;
    int64_t N = t->pref_eval.n_pairs, lim = (int64_t)t->job->train.eval_batches * t->cfg.micro_batch * t->world;
    if (lim > 0 && lim < N) N = lim;
    double *pol = qt_malloc(sizeof(double) * (size_t)(4 * N), "eval log-probs"), *ref = pol ? pol + 2 * N : NULL;
    int64_t *n = qt_malloc(sizeof(int64_t) * (size_t)(2 * N), "eval log-probs");
    int rc = pol && n ? QT_OK : QT_ENOMEM;
    if (rc == QT_OK) rc = pref_pass(t, &t->pref_eval, N, 1, pol, n);
    const double *r = NULL;
    if (rc == QT_OK && t->ref_pre) {
        r = t->ref_eval;
    } else if (rc == QT_OK && qt_objective_needs_ref(o)) {
        int64_t *n2 = qt_malloc(sizeof(int64_t) * (size_t)(2 * N), "eval log-probs");
        rc = n2 ? pref_pass(t, &t->pref_eval, N, 0, ref, n2) : QT_ENOMEM;
        qt_free(n2);
        r = ref;
    }
    qt_pref_sums sums = {0};
    int64_t chosen = 0;
    if (rc == QT_OK) {
        qt_pref_eval_add(o, N, pol, n, r, &sums, &chosen);
        *loss = qt_pref_eval_loss(o, &sums, chosen);
        *pairs = N;
        qt_pref_metrics_json(o, "eval_", *loss, &sums, chosen, extra, cap);
        am[0] = sums.accuracies / (double)(N ? N : 1), am[1] = sums.margins / (double)(N ? N : 1);
    }
    qt_free(pol);
    qt_free(n);
    return rc;
}

static int eval_and_log(qt_trainer *t, double *out) {
    double l;
    int64_t n;
    char what[64], extra[1024] = "";
    double am[2] = {NAN, NAN}; /* preference: eval_rewards/accuracies and margins for the progress line */
    snprintf(what, sizeof what, "the evaluation at step %ld", t->step);
    qt_stall_enter(t->stall, what);
    int rc = t->pref ? pref_evaluate(t, &l, &n, extra, sizeof extra, am) : evaluate(t, &l, &n);
    qt_stall_enter(t->stall, NULL);
    QT_TRY(rc);
    *out = l;
    if (t->pref) {
        if (!t->main) return QT_OK;
        QT_TRY(qt_metrics_log_eval_fields(&t->metrics, t->step, l, extra, n, trainer_elapsed(t)));
        QT_TRY(qt_metrics_write_svg(&t->metrics));
        QT_TRY(qt_metrics_write_report(&t->metrics, "running"));
        if (t->hooks->progress) {
            if (t->hooks->tty) fputs("\r\033[K", t->hooks->progress);
            fprintf(t->hooks->progress, "qtune: step %ld/%ld: eval_loss %.4f, eval_rewards/accuracies %.4g, "
                    "eval_rewards/margins %.4g over %lld held-out pairs\n", t->step, t->max_steps, l,
                    am[0], am[1], (long long)n);
            fflush(t->hooks->progress);
        }
        return QT_OK;
    }
    if (!t->eval_dl) return QT_OK;
    if (t->main) {
        QT_TRY(qt_metrics_log_eval(&t->metrics, t->step, l, n, trainer_elapsed(t)));
        QT_TRY(qt_metrics_write_svg(&t->metrics));
        QT_TRY(qt_metrics_write_report(&t->metrics, "running"));
        if (t->hooks->progress) {
            if (t->hooks->tty) fputs("\r\033[K", t->hooks->progress);
            fprintf(t->hooks->progress, "qtune: step %ld/%ld: eval_loss %.4f (ppl %.2f) over %lld tokens\n", t->step,
                    t->max_steps, l, exp(l), (long long)n);
            fflush(t->hooks->progress);
        }
    }
    return QT_OK;
}

/* ---------------------------------------------------------------------------
 * one optimizer step */

static const char *last_good(const qt_trainer *t) {
    return t->last_ckpt[0] ? t->last_ckpt : "none (no checkpoint was written yet)";
}

/* After the update: this rank's updated range [lo, hi) must be finite, and
 * every rank learns whether all are. A non-finite weight (eps 0 dividing 0 by
 * 0, a learning rate whose step overflows fp32) is a failed step: the run
 * stops before anything is saved, so every checkpoint keeps finite weights.
 * finite: the update's own answer (qt_step_info.update_finite); only where it
 * is not 1 is the range read again (to find the element, or because the
 * backend's adam did not look). */
static int check_update(qt_trainer *t, double lr, int finite) {
    size_t at = t->hi;
    int64_t bad = finite == 1 ? 0 : trainer_find_bad(t, t->master + (t->lo - trainer_master_lo(t)), t->hi - t->lo, 0, &at);
    if (bad) at += t->lo;
    if (t->world > 1) QT_TRY(dist_allreduce_i64(t->d, &bad, 1, DIST_MAX, "update check"));
    if (!bad) return QT_OK;
    return QT_ERR(QT_ENUMERIC,
                  "step %ld: the update made weights non-finite (%s%s, learning rate %g); training stopped and "
                  "nothing of this step was saved. Lower the learning rate or check optimizer.params (eps > 0); "
                  "the last good checkpoint is %s",
                  t->step + 1, at < t->hi ? "first: " : "on another rank", at < t->hi ? trainer_param_at(t, at) : "",
                  lr, last_good(t));
}

typedef struct {
    double loss;       /* mean over the global batch's labelled tokens */
    double grad_norm;  /* unscaled, before clipping */
    double lr;
    double loss_scale;
    int skipped;
    int64_t tokens, target_tokens;
    char pref[512];    /* preference objectives: TRL's metrics as JSON fields, else "" */
    double accuracy, margin; /* and two of them for the progress line */
} step_out;

static int trainer_publish_weights(qt_trainer *t);

/* The pair the global counter k stands for: epoch k / n (each epoch's order a
 * permutation seeded from (seed, epoch) when shuffling), so every rank finds
 * its pairs from the step alone and a resumed run sees the same ones. */
static int64_t pref_pair(qt_trainer *t, int64_t k) {
    int64_t n = t->pref_train.n_pairs, e = k / n;
    if (e != t->pref_epoch) {
        for (int64_t i = 0; i < n; i++) t->pref_perm[i] = (uint64_t)i;
        if (t->job->data.shuffle) {
            qt_rng r;
            qt_rng_derive(&r, t->job->train.seed, 0x70726566u, (uint64_t)e);
            for (int64_t i = n - 1; i > 0; i--) {
                int64_t j = (int64_t)qt_rng_below(&r, (uint64_t)i + 1);
                uint64_t x = t->pref_perm[i];
                t->pref_perm[i] = t->pref_perm[j], t->pref_perm[j] = x;
            }
        }
        t->pref_epoch = e;
    }
    return (int64_t)t->pref_perm[k % n];
}

/* Steps 1-2 for a preference objective: A micro-batches of B pairs (rank r
 * takes pairs r, r + world, ... of the global order), the reference's
 * log-probs (a forward with the adapter off) where the objective needs them,
 * then the policy's forward and backward with one weight per sequence. The
 * loss is the mean over the global batch's pairs (train/objective.h). */
static int pref_forward_backward(qt_trainer *t, step_out *o, int64_t cnt[2]) {
    const int A = t->cfg.grad_accum, B = t->cfg.micro_batch, T = t->job->data.seq_len;
    const qt_objective *obj = &t->job->objective;
    int64_t idx[QT_PREF_MAX_PAIRS];
    int64_t chosen = 0; /* the chosen answers' tokens: the NLL's token mean */
    for (int a = 0; a < A; a++) {
        for (int j = 0; j < B; j++) {
            int64_t k = (((int64_t)t->step * A + a) * B + j) * t->world + t->rank;
            idx[j] = pref_pair(t, k);
        }
        dl_pref_batch(&t->pref_train, idx, B, T, &t->mb[a]);
        cnt[0] += t->mb[a].n_target;
        cnt[1] += (int64_t)t->mb[a].B * T;
        for (size_t i = 0; i < (size_t)B * T; i++) chosen += t->mb[a].targets[i] != QT_IGNORE_INDEX;
    }
    int64_t c3[3] = {cnt[0], cnt[1], chosen};
    QT_TRY(dist_allreduce_i64(t->d, c3, 3, DIST_SUM, "token count"));
    cnt[0] = c3[0], cnt[1] = c3[1], chosen = c3[2];
    o->target_tokens = cnt[0];
    o->tokens = cnt[1];
    const double S = qt_optimizer_loss_scale(&t->opt);
    o->loss_scale = S;
    if (t->grads) qt_be_zero(t->be, t->grads, t->n * sizeof(float));
    else QT_TRY(zero_grads_begin(t->zp));
    qt_pref_sums sums = {0};
    float *logp = qt_malloc(sizeof(float) * (size_t)2 * B * T, "reference log-probs");
    double *ref = qt_malloc(sizeof(double) * (size_t)2 * B, "reference log-probs");
    int64_t *rn = qt_malloc(sizeof(int64_t) * (size_t)2 * B, "reference log-probs");
    int rc = logp && ref && rn ? QT_OK : QT_ENOMEM;
    for (int a = 0; a < A && rc == QT_OK; a++) {
        qt_pref_step ps = {.o = obj, .targets = t->mb[a].targets, .scale = S,
                           .inv_pairs = 1.0 / ((double)B * A * t->world), .inv_chosen = chosen ? 1.0 / (double)chosen : 0};
        if (t->ref_pre) { /* precompute_ref_log_probs: the pass before training */
            for (int j = 0; j < B; j++) {
                int64_t i = pref_pair(t, (((int64_t)t->step * A + a) * B + j) * t->world + t->rank);
                ref[j] = t->ref_train[2 * i], ref[B + j] = t->ref_train[2 * i + 1];
            }
            ps.ref_sum = ref;
        } else if (qt_objective_needs_ref(obj)) {
            qt_model_set_adapter(t->model, 0);
            rc = qt_model_forward(t->model, &t->mb[a], NULL, NULL, logp);
            qt_model_set_adapter(t->model, 1);
            if (rc != QT_OK) break;
            qt_pref_row_sums(logp, t->mb[a].targets, 2 * B, T, ref, rn);
            ps.ref_sum = ref;
        }
        double ls;
        int64_t k;
        rc = qt_model_forward_backward_rows(t->model, &t->mb[a], qt_pref_row_weights, &ps, &ls, &k);
        sums.loss += ps.sums.loss, sums.rewards_chosen += ps.sums.rewards_chosen;
        sums.rewards_rejected += ps.sums.rewards_rejected, sums.accuracies += ps.sums.accuracies;
        sums.margins += ps.sums.margins, sums.logps_chosen += ps.sums.logps_chosen;
        sums.logps_rejected += ps.sums.logps_rejected, sums.nll += ps.sums.nll;
        sums.log_odds_ratio += ps.sums.log_odds_ratio, sums.log_odds_chosen += ps.sums.log_odds_chosen;
        sums.pairs += ps.sums.pairs;
    }
    qt_free(logp);
    qt_free(ref);
    qt_free(rn);
    QT_TRY(rc);
    double v[11] = {sums.loss, sums.rewards_chosen, sums.rewards_rejected, sums.accuracies, sums.margins,
                    sums.logps_chosen, sums.logps_rejected, sums.nll, sums.log_odds_ratio, sums.log_odds_chosen,
                    (double)sums.pairs};
    QT_TRY(dist_allreduce_f64(t->d, v, 11, DIST_SUM, "preference metrics"));
    o->loss = v[0];
    double P = v[10] > 0 ? v[10] : 1;
    /* TRL's names: means over the step's pairs */
    int n = snprintf(o->pref, sizeof o->pref,
                     ", \"rewards/chosen\": %.9g, \"rewards/rejected\": %.9g, \"rewards/accuracies\": %.9g, "
                     "\"rewards/margins\": %.9g, \"logps/chosen\": %.9g, \"logps/rejected\": %.9g",
                     v[1] / P, v[2] / P, v[3] / P, v[4] / P, v[5] / P, v[6] / P);
    if (obj->type != QT_OBJ_DPO && n > 0 && (size_t)n < sizeof o->pref)
        n += snprintf(o->pref + n, sizeof o->pref - (size_t)n, ", \"nll_loss\": %.9g",
                      chosen ? v[7] / (double)chosen : 0.0);
    if (obj->type == QT_OBJ_ORPO && n > 0 && (size_t)n < sizeof o->pref)
        snprintf(o->pref + n, sizeof o->pref - (size_t)n, ", \"log_odds_ratio\": %.9g, \"log_odds_chosen\": %.9g",
                 v[8] / P, v[9] / P);
    o->accuracy = v[3] / P;
    o->margin = v[4] / P;
    return QT_OK;
}

static int train_step(qt_trainer *t, step_out *o) {
    const int A = t->cfg.grad_accum;
    memset(o, 0, sizeof *o);
    int64_t cnt[2] = {0, 0}; /* labelled, positions */
    double S;
    if (t->pref) {
        QT_TRY(pref_forward_backward(t, o, cnt));
        S = o->loss_scale;
    } else {
        /* 1. the window's micro-batches and the global labelled-token count */
        for (int a = 0; a < A; a++) {
            QT_TRY(dl_next(t->train_dl, &t->mb[a]));
            cnt[0] += t->mb[a].n_target;
            cnt[1] += (int64_t)t->mb[a].B * t->mb[a].T;
        }
        QT_TRY(dist_allreduce_i64(t->d, cnt, 2, DIST_SUM, "token count"));
        o->target_tokens = cnt[0];
        o->tokens = cnt[1];
        S = qt_optimizer_loss_scale(&t->opt);
        o->loss_scale = S;

        /* 2. forward/backward: grads = S * d(sum of token losses)/Ntok (ZeRO-2:
         * handed over layer by layer into the rank's gradient shard) */
        if (t->grads) qt_be_zero(t->be, t->grads, t->n * sizeof(float));
        else QT_TRY(zero_grads_begin(t->zp));
        double loss_sum = 0;
        const float gs = cnt[0] > 0 ? (float)(S / (double)cnt[0]) : 0.0f;
        for (int a = 0; a < A; a++) {
            double ls;
            int64_t k;
            QT_TRY(qt_model_forward_backward(t->model, &t->mb[a], gs, &ls, &k));
            loss_sum += ls;
        }
        QT_TRY(dist_allreduce_f64(t->d, &loss_sum, 1, DIST_SUM, "loss sum"));
        o->loss = cnt[0] > 0 ? loss_sum / (double)cnt[0] : NAN;
    }

    /* 3. reduce gradients; global sum of squares and overflow flag */
    double sumsq = 0;
    int overflow = 0;
    QT_TRY(dist_step_gradients(t->d, t->zp, t->grads, &sumsq, &overflow));
    o->grad_norm = sqrt(sumsq) / S;

    if (cnt[0] == 0) {
        qt_warn("step %ld: no token in this batch carries a label (all -100); the update is skipped", t->step + 1);
        o->skipped = 1;
        o->lr = qt_sched_lr_for_update(&t->opt.sched, t->opt.n_updates);
        return QT_OK;
    }
    /* 4. overflow: fp16 skips the step and backs the scale off; elsewhere it is fatal.
     * A non-finite loss counts as an overflow too (every rank sees the same sum). */
    if (!isfinite(o->loss)) overflow = 1;
    if (!t->cfg.fp16 && (overflow || !isfinite(o->loss))) {
        return QT_ERR(QT_ENUMERIC,
                      "step %ld, rank %d of %d: the %s is not finite (loss %g, grad_norm %g); training stopped. "
                      "Lower the learning rate or check the data; the last good checkpoint is %s",
                      t->step + 1, t->rank, t->world, isfinite(o->loss) ? "gradient" : "loss", o->loss, o->grad_norm,
                      last_good(t));
    }
    /* 5-6. src/optim's step: the loss scaler, the schedule, unscale and clip fused into Adam */
    qt_step_info si;
    const float *g = t->grads ? t->grads + t->lo : zero_grad_shard(t->zp); /* [lo, hi), summed over ranks */
    int rc = qt_optimizer_apply(&t->opt, t->be, sumsq, overflow, t->master + (t->lo - trainer_master_lo(t)), g, t->zs.slot[0],
                                t->zs.slot[1], t->hi - t->lo, t->lo, t->decay, t->n_decay, &si);
    if (rc != QT_OK)
        return qt_error_context(rc, "step %ld (the last good checkpoint is %s)", t->step + 1,
                                t->last_ckpt[0] ? t->last_ckpt : "none: no checkpoint was written yet");
    o->lr = si.lr;
    if (!(si.lr >= 0) || !isfinite(si.lr)) /* the config checks make this unreachable; a guard for what they miss */
        return QT_ERR(QT_EINVAL, "step %ld: the learning rate is %g; it must be a finite number >= 0 (check "
                      "optimizer.params.lr and the scheduler's params)", t->step + 1, si.lr);
    if (si.skipped) {
        o->skipped = 1;
        return QT_OK;
    }
    QT_TRY(check_update(t, si.lr, si.update_finite));
    return trainer_publish_weights(t);
}

/* After an update every rank reads the whole new weights. A whole master is
 * all-gathered in fp32 and then rounded to the compute copy; a sharded one is
 * rounded shard by shard and the 2-byte copy all-gathered (half the bytes),
 * with the norm weights and biases gathered in f32 beside it. Both give every
 * rank the same bits. */
static int trainer_publish_weights(qt_trainer *t) {
    if (!t->sharded) {
        QT_TRY(dist_allgather_params(t->d, t->zp, t->master));
        qt_model_weights_updated(t->model);
        return QT_OK;
    }
    qt_model_weights_updated(t->model); /* this rank's range of both copies */
    /* ZeRO-3: the compute weights stay partitioned; each layer's are gathered when the next pass reads them */
    if (!t->shard.params_sharded) QT_TRY(zero_allgather_block(t->zp, t->shard.wcopy, t->shard.esize));
    return zero_allgather_runs(t->zp, t->shard.small, t->shard.runs, t->shard.n_runs);
}

/* ---------------------------------------------------------------------------
 * progress */

static void fmt_dur(char *buf, size_t cap, double s) {
    if (!(s >= 0) || s > 1e8) { snprintf(buf, cap, "?"); return; }
    long x = (long)(s + 0.5);
    if (x >= 3600) snprintf(buf, cap, "%ldh%02ldm", x / 3600, (x / 60) % 60);
    else if (x >= 60) snprintf(buf, cap, "%ldm%02lds", x / 60, x % 60);
    else snprintf(buf, cap, "%lds", x);
}

static void progress(qt_trainer *t, const step_out *o, double tok_s, long first_step, double t_loop) {
    FILE *f = t->hooks->progress;
    if (!f || !t->main) return;
    double done = (double)(t->step - first_step), per = done > 0 ? (qt_now_s() - t_loop) / done : NAN;
    char eta[32];
    fmt_dur(eta, sizeof eta, per * (double)(t->max_steps - t->step));
    if (t->hooks->tty) {
        fprintf(f, "\r\033[Kstep %ld/%ld  loss %.4f", t->step, t->max_steps, o->loss);
        if (t->pref) fprintf(f, "  rewards/accuracies %.2f  rewards/margins %.4f", o->accuracy, o->margin);
        fprintf(f, "  lr %.3g  %.*f tok/s  ETA %s%s", o->lr, tok_s < 10 ? 2 : 0, tok_s, eta,
                o->skipped ? "  (overflow: skipped)" : "");
        fflush(f);
    } else if (t->step % t->cfg.steps_per_print == 0 || t->step == t->max_steps || t->step == first_step + 1) {
        fprintf(f, "qtune: step %ld/%ld: loss %.4f, ", t->step, t->max_steps, o->loss);
        if (t->pref) fprintf(f, "rewards/accuracies %.4g, rewards/margins %.4g, ", o->accuracy, o->margin);
        fprintf(f, "lr %.4g, grad_norm %.4g, loss_scale %g, %.*f tokens/s, ETA %s%s\n", o->lr, o->grad_norm,
                o->loss_scale, tok_s < 10 ? 2 : 0, tok_s, eta, o->skipped ? " (overflow: step skipped)" : "");
        fflush(f);
    }
}

/* ---------------------------------------------------------------------------
 * the run */

static void trainer_free(qt_trainer *t) {
    qt_stall_stop(t->stall);
    if (t->main) qt_metrics_close(&t->metrics);
    if (t->zp) {
        zero_state_free(t->zp, &t->zs);
        zero_plan_free(t->zp);
    }
    qt_free(t->decay);
    qt_free(t->peaks);
    for (int k = 0; k < 3; k++) qt_free(t->greq[k]);
    if (t->mb)
        for (int a = 0; a < t->cfg.grad_accum; a++) dl_batch_free(&t->mb[a]);
    qt_free(t->mb);
    if (t->eval_dl) dl_batch_free(&t->eval_b);
    dl_close(t->train_dl);
    dl_pref_free(&t->pref_train);
    dl_pref_free(&t->pref_eval);
    qt_free(t->pref_perm);
    qt_free(t->ref_train);
    qt_free(t->ref_eval);
    dl_close(t->eval_dl);
    if (t->d) dist_set_backend(t->d, NULL); /* HCCL ends while its card is still open */
    qt_model_free(t->model);
    bpe_free(t->tok);
    if (t->outdir_lock >= 0) close(t->outdir_lock); /* last: after every write of this run */
}

/* Agrees across ranks whether to stop: a signal may reach only some, and
 * the stop file of `qtune stop` is looked for by the main rank alone (one
 * stat per step), so every rank stops after the same step. */
static int stop_requested(qt_trainer *t, int *stop) {
    int64_t s = t->hooks->stop && *t->hooks->stop ? 1 : 0;
    if (t->main && !s && qt_stop_requested_file(t->job->output_dir)) {
        s = 1;
        if (!t->stop_file_seen)
            qt_info("stop requested by `qtune stop` (%s/%s): finishing this step and saving a checkpoint",
                    t->job->output_dir, QT_STOP_FILE);
        t->stop_file_seen = 1;
    }
    if (t->world > 1) QT_TRY(dist_allreduce_i64(t->d, &s, 1, DIST_MAX, "stop flag"));
    *stop = s != 0;
    return QT_OK;
}

/* *need 1 when metrics.jsonl holds no eval of this step (rank 0 reads it;
 * every rank learns the answer), else 0 and *loss the recorded value. */
static int final_eval_missing(qt_trainer *t, int *need, double *loss) {
    int64_t missing = 0;
    if (t->main) {
        missing = 1;
        for (size_t i = 0; i < t->metrics.n_eval; i++)
            if (t->metrics.eval[i].step == t->step) missing = 0, *loss = t->metrics.eval[i].x;
    }
    if (t->world > 1) QT_TRY(dist_allreduce_i64(t->d, &missing, 1, DIST_MAX, "final eval on record"));
    *need = missing != 0;
    return QT_OK;
}

static int find_resume(qt_trainer *t, char *dir, size_t cap) {
    const char *r = t->job->train.resume;
    dir[0] = 0;
    if (!strcmp(r, "never")) return QT_OK;
    if (!strcmp(r, "auto")) {
        /* overwrite_output_dir: the folder's checkpoints are about to go */
        if (t->job->train.overwrite_output_dir) return QT_OK;
        long s;
        return ckpt_latest(t->job->output_dir, dir, cap, &s);
    }
    char state[4096];
    QT_TRY(qt_path_join(state, sizeof state, r, CKPT_STATE_FILE));
    if (!qt_path_exists(state))
        return QT_ERR(QT_EINVAL, "%s: train.resume names %s, which is not a complete qtune checkpoint (no %s)",
                      t->job->path, r, CKPT_STATE_FILE);
    snprintf(dir, cap, "%s", r);
    return QT_OK;
}

/* Steps that applied no update (fp16 overflows, batches without a label),
 * over the whole run: reported at the end; a run in which every step was
 * skipped learned nothing and fails instead of writing final/. */
static int check_skipped(qt_trainer *t, qt_train_result *res) {
    res->skipped = t->step - (long)t->opt.n_updates;
    if (res->skipped <= 0) return QT_OK;
    /* the scaler's count, which a checkpoint carries across a resume */
    const long ovf = t->cfg.fp16 ? (long)t->opt.scaler.n_overflows : 0;
    const long nolabel = res->skipped - ovf > 0 ? res->skipped - ovf : 0;
    char why[160];
    snprintf(why, sizeof why, "%ld fp16 overflow%s, %ld without a labelled token", ovf, ovf == 1 ? "" : "s", nolabel);
    if (t->opt.n_updates == 0 && ovf && t->opt.scaler.dynamic) {
        /* every step overflowed while the dynamic scale was still backing off from its start: the cause is
         * the initial scale (a halving per overflow once hysteresis is spent), not the data */
        const qt_loss_scaler_cfg *c = &t->opt.scaler.cfg;
        return QT_ERR(QT_ENUMERIC,
                      "every one of the %ld steps was skipped (%s): the fp16 loss scale started at 2^%d = %g "
                      "(fp16.initial_scale_power %d) and halves only once per overflow after %d in a row "
                      "(fp16.hysteresis), so it was still %g at the end and nothing was learned; final/ is not "
                      "written. Lower fp16.initial_scale_power (DeepSpeed's default is 16; each 1 less halves the "
                      "start) or train more steps so the scale can fall to where the gradients fit",
                      t->step, why, c->initial_scale_power, ldexp(1.0, c->initial_scale_power),
                      c->initial_scale_power, c->hysteresis, t->opt.scaler.scale);
    }
    if (t->opt.n_updates == 0)
        return QT_ERR(QT_ENUMERIC,
                      "every one of the %ld steps was skipped (%s): nothing was learned, so final/ is not written. "
                      "%s%s%s%s",
                      t->step, why,
                      ovf ? "With fp16, a static fp16.loss_scale overflows at every step: set it to 0 (dynamic) or "
                            "to a smaller scale"
                          : "Check that data.train has tokens with labels",
                      ovf ? "" : " (", ovf ? "" : t->job->data.train, ovf ? "" : ")");
    if (t->main) qt_warn("%ld of %ld steps were skipped (%s) and applied no update", res->skipped, t->step, why);
    return QT_OK;
}

/* What a preference objective cannot run with, said before anything is loaded. */
static int check_pref(const qt_trainer *t) {
    const qt_job *job = t->job;
    if (!t->pref) return QT_OK;
    if (qt_objective_needs_ref(&job->objective) && !job->lora.enabled && job->objective.precompute_ref == 0)
        return QT_ERR(QT_EINVAL, "%s: objective dpo with full fine-tuning needs a reference model: qtune keeps no "
                                 "frozen copy, it precomputes the reference's log-probs before training; remove "
                                 "objective.precompute_ref_log_probs (or set it to true), or set "
                                 "objective.reference_free to true", job->path);
    if (qt_objective_needs_ref(&job->objective) && t->setup.lora_sel.lora_save && !t->ref_pre)
        return QT_ERR(QT_EINVAL, "%s: objective dpo with lora.modules_to_save: the reference (the adapter off) would "
                                 "still use the trained embedding/lm_head copies; remove modules_to_save, set "
                                 "objective.precompute_ref_log_probs to true (one pass before training, when the "
                                 "copies are still the base's) or objective.reference_free to true", job->path);
    if (t->cfg.micro_batch > QT_PREF_MAX_PAIRS)
        return QT_ERR(QT_EINVAL, "%s: a micro-batch of %d pairs; preference objectives take at most %d "
                                 "(train_micro_batch_size_per_gpu)", job->path, t->cfg.micro_batch, QT_PREF_MAX_PAIRS);
    return QT_OK;
}

static int run(qt_trainer *t, qt_train_result *res) {
    const qt_job *job = t->job;
    /* lora.target_modules against the model's layout, from its config.json alone: Qwen2 names on an original
     * Qwen model (QT_MSG_QWEN1_TARGETS_FMT) stop the run before anything is claimed or loaded */
    QT_TRY(qt_run_setup_lora(&t->setup, 1));
    QT_TRY(check_pref(t));
    /* A folder of another run (or in use) is refused before minutes of
     * loading; nothing is written to it until everything the job names has
     * been read and checked (the claim below). */
    if (t->main) QT_TRY(qt_output_dir_check(job->output_dir, job, job->train.overwrite_output_dir, &t->outdir_lock));
    QT_TRY(dist_barrier(t->d, "output folder check"));
    QT_TRY(load_model(t));
    /* the collectives' buffers are its memory (staged where not host-readable; NPU ranks start HCCL here) */
    QT_TRY(dist_set_backend(t->d, t->be));
    QT_TRY(open_loaders(t));
    /* ranks finish loading (a token cache may be built first) at different
     * times: this wait's deadline adds the time of reading the model folder
     * and tokenizing the data at slow rates to the user's timeout */
    double to = dist_timeout(t->d);
    double text = 0;
    for (int i = 0; i < job->data.n_train; i++) text += trainer_path_bytes(job->data.train_files[i]);
    for (int i = 0; i < job->data.n_eval; i++) text += trainer_path_bytes(job->data.eval_files[i]);
    dist_set_timeout(t->d, dist_phase_timeout(t->d, trainer_path_bytes(job->model) +
                                                        text * (DIST_DISK_FLOOR_BPS / DIST_TOKENIZE_FLOOR_BPS),
                                              DIST_DISK_FLOOR_BPS));
    int rc = dist_barrier(t->d, "model and data loading");
    dist_set_timeout(t->d, to);
    qt_cancel_watch(NULL); /* from here the loop polls the stop flag itself */
    QT_TRY(rc);
    t->max_steps = job->train.max_steps > 0 ? job->train.max_steps : steps_from_epochs(t);
    QT_TRY(qt_run_setup_finalize(&t->setup, t->max_steps));
    t->cfg = t->setup.cfg;
    QT_TRY(setup_optimizer(t));
    QT_TRY(pref_reference_pass(t)); /* the starting weights: before a checkpoint or init_from replaces them */

    char resume[4096];
    QT_TRY(find_resume(t, resume, sizeof resume));
    t->resumed_from = -1;
    if (resume[0]) {
        QT_TRY(trainer_load_checkpoint(t, resume));
        t->resumed_from = t->step;
        snprintf(t->last_ckpt, sizeof t->last_ckpt, "%s", resume);
        if (t->main && t->step >= t->max_steps)
            qt_warn("%s is at step %ld, not before train.max_steps %ld: nothing to train; final/ is rewritten "
                    "from it (raise train.max_steps to train on)",
                    resume, t->step, t->max_steps);
        else if (t->main)
            qt_info("resuming from %s (step %ld of %ld)", resume, t->step, t->max_steps);
    } else if (job->lora.enabled && job->lora.init_from) {
        QT_TRY(trainer_init_from_adapter(t, job->lora.init_from));
    }
    /* The job, its DeepSpeed settings, the hardware, the model, the data and
     * the checkpoint are checked: now the folder is claimed (the previous
     * run's outputs go when overwrite_output_dir or resume "never" says so,
     * an interrupted run's temporaries always) and the job recorded. */
    if (t->main)
        QT_TRY(qt_output_dir_claim(job->output_dir, job, job->train.overwrite_output_dir,
                                   !strcmp(job->train.resume, "never"), &t->outdir_lock));
    /* a stop file left by a run that ended before it saw it asks nothing of this one */
    if (t->main) qt_stop_file_clear(job->output_dir);
    QT_TRY(dist_barrier(t->d, "output folder claim"));
    if (t->main) {
        char title[512];
        snprintf(title, sizeof title, "qtune: %s", job->output_dir);
        QT_TRY(qt_metrics_open(&t->metrics, job->output_dir, resume[0] ? t->step : -1, title));
        char dev[320];
        uint64_t plan_rank, plan_dev;
        qt_device_label(&t->dev, omp_get_max_threads(), dev, sizeof dev);
        report_plan(t, &plan_rank, &plan_dev);
        qt_metrics_set_report(&t->metrics, dev, t->max_steps, plan_rank, plan_dev);
        QT_TRY(qt_metrics_write_report(&t->metrics, "running"));
        if (job->train.report_tensorboard) QT_TRY(open_tensorboard(t));
        qt_info("training %s: %zu trainable parameters (%s), %ld steps of %d x %d x %d rank(s) rows of %d tokens%s%s",
                job->model, t->n, job->lora.enabled ? "LoRA" : "full", t->max_steps, t->cfg.micro_batch,
                t->cfg.grad_accum, t->world, job->data.seq_len, t->world > 1 ? ", collectives over " : "",
                t->world > 1 ? dist_transport_name(t->d) : "");
    }
    t->t_start = qt_now_s();
    res->resumed_from = t->resumed_from;
    res->max_steps = t->max_steps;
    res->eval_loss_first = res->eval_loss_last = NAN;
    res->last_loss = NAN;

    /* the BLAS maps a buffer per thread at its first call, which retries
     * forever when ulimit -v refuses it: checked before any step or eval */
    if (t->step < t->max_steps) {
        (void)qt_be_runtime_bytes(t->be); /* loads the GEMM libraries first: their mappings count too */
        qt_stall_make_threads(omp_get_max_threads());
        if (!qt_fault_point("address-space-check", t->rank)) /* tests skip it to reach the watchdog */
            QT_TRY(qt_stall_check_address_space(qt_be_desc(t->be), omp_get_max_threads(), "training"));
        QT_TRY(qt_stall_start(qt_be_desc(t->be), omp_get_max_threads(), &t->stall));
    }
    const int has_eval = t->eval_dl || t->pref_eval.n_pairs;
    if (t->step < t->max_steps && has_eval && !resume[0]) {
        QT_TRY(eval_and_log(t, &res->eval_loss_first));
        res->eval_loss_last = res->eval_loss_first;
    }
    const long first_step = t->step;
    const double t_loop = qt_now_s();
    const int64_t tokens0 = t->tokens_seen;
    int stop = 0;
    /* a stop during loading or the first evaluation: nothing new to save */
    QT_TRY(stop_requested(t, &stop));
    if (stop) {
        res->interrupted = 1;
        res->step = t->step;
        if (t->main) qt_stop_file_clear(job->output_dir);
        return QT_ERR(QT_EINTERRUPTED, "stopped before step %ld; nothing new to save%s%s", t->step + 1,
                      t->last_ckpt[0] ? "; the newest checkpoint is " : "", t->last_ckpt);
    }
    /* Loader starvation: over each window of steps, the share of wall time the
     * step spent waiting in dl_next. Prefetch threads should keep it near 0. */
    enum { STARVE_WINDOW = 20 };
    const double starve_share = 0.2;
    double win_t0 = qt_now_s(), win_wait0;
    long win_steps = 0;
    {
        dl_stats st0;
        train_stats(t, &st0);
        win_wait0 = st0.wait_s;
    }
    t->peaks = qt_calloc((size_t)t->world, sizeof *t->peaks, "per-rank peaks");
    if (!t->peaks) return QT_ENOMEM;
    while (t->step < t->max_steps && !stop) {
        double ts = qt_now_s(), cs = dist_comm_seconds(t->d);
        tp_stats tp0, tp1;
        tp_get_stats(t->d, &tp0);
        step_out o;
        char what[48];
        snprintf(what, sizeof what, "step %ld", t->step + 1);
        qt_stall_enter(t->stall, what);
        int src = train_step(t, &o);
        qt_fault_point("step-done", t->rank); /* tests: sleepMS makes a slow step */
        qt_stall_enter(t->stall, NULL);
        QT_TRY(src);
        tp_get_stats(t->d, &tp1);
        /* every rank's peak, on the steps rank 0 logs (the same steps on every rank) */
        int log_now = t->step + 1 == t->max_steps || (t->step + 1) % job->train.log_steps == 0;
        if (log_now && t->world > 1) {
            int64_t mine = qt_peak_rss_bytes();
            QT_TRY(dist_allgather_i64(t->d, &mine, 1, t->peaks, "peak memory"));
        }
        t->step++;
        t->tokens_seen += o.tokens;
        res->last_loss = o.loss;
        double dt = qt_now_s() - ts, tok_s = dt > 0 ? (double)o.tokens / dt : 0;
        if (t->main && (t->step % job->train.log_steps == 0 || t->step == t->max_steps)) {
            dl_state ds = trainer_data_position(t);
            dl_stats st;
            train_stats(t, &st);
            qt_step_metrics m = {
                .step = t->step, .loss = o.loss, .lr = o.lr, .grad_norm = o.grad_norm, .loss_scale = o.loss_scale,
                .skipped = o.skipped, .tokens = o.tokens, .target_tokens = o.target_tokens, .tokens_per_s = tok_s,
                .elapsed_s = trainer_elapsed(t), .mem_peak_bytes = qt_peak_rss_bytes(),
                .device_peak_bytes = (int64_t)qt_be_device_peak_bytes(t->be),
                .epoch = (double)ds.epoch + (st.n_examples_rank ? (double)ds.index / (double)st.n_examples_rank : 0),
                .opt_state_bytes = (int64_t)(zero_state_bytes_device(t->zp) + zero_state_bytes_host(t->zp)),
                .comm_s = dist_comm_seconds(t->d) - cs,
                .mem_peak_ranks = t->peaks, .n_ranks = t->world,
                .comm_busy_s = tp1.busy_s - tp0.busy_s, .comm_wait_s = tp1.wait_s - tp0.wait_s,
                .extra = o.pref[0] ? o.pref : NULL,
            };
            QT_TRY(qt_metrics_log_step(&t->metrics, &m));
            QT_TRY(qt_metrics_write_svg(&t->metrics));
            QT_TRY(qt_metrics_write_report(&t->metrics, "running"));
        }
        if (++win_steps == STARVE_WINDOW) {
            dl_stats st;
            train_stats(t, &st);
            double wall = qt_now_s() - win_t0, waited = st.wait_s - win_wait0;
            if (t->main && wall > 0 && waited / wall > starve_share)
                qt_warn(QT_MSG_LOADER_STARVED_FMT, 100.0 * waited / wall, (int)win_steps);
            win_t0 = qt_now_s();
            win_wait0 = st.wait_s;
            win_steps = 0;
        }
        progress(t, &o, tok_s, first_step, t_loop);
        QT_TRY(stop_requested(t, &stop));
        if (job->train.eval_steps && t->step % job->train.eval_steps == 0 && t->step < t->max_steps && !stop)
            QT_TRY(eval_and_log(t, &res->eval_loss_last));
        if (stop || (job->train.save_steps && t->step % job->train.save_steps == 0) || t->step == t->max_steps)
            QT_TRY(trainer_save_checkpoint(t));
    }
    if (t->main && t->hooks->progress && t->hooks->tty) fputc('\n', t->hooks->progress);
    res->step = t->step;
    res->tokens = t->tokens_seen - tokens0;
    res->train_s = qt_now_s() - t_loop;
    snprintf(res->last_checkpoint, sizeof res->last_checkpoint, "%s", t->last_ckpt);
    if (stop && t->main) qt_stop_file_clear(job->output_dir); /* honoured: the next run starts clean */
    if (stop && t->step < t->max_steps) {
        res->interrupted = 1;
        return QT_ERR(QT_EINTERRUPTED, "stopped at step %ld of %ld; the state is saved in %s; run the same command "
                                       "again to continue",
                      t->step, t->max_steps, t->last_ckpt);
    }
    QT_TRY(check_skipped(t, res));
    /* What a run stopped right after its last checkpoint had left undone is
     * done now: the final eval (unless this step's is on record, as when a
     * finished run is started again), the pruning, final/. */
    if (has_eval) {
        int need = t->step > first_step;
        if (!need) QT_TRY(final_eval_missing(t, &need, &res->eval_loss_last));
        if (need) QT_TRY(eval_and_log(t, &res->eval_loss_last));
    }
    if (t->main) QT_TRY(ckpt_prune(job->output_dir, job->train.save_total_limit, t->step));
    QT_TRY(trainer_write_final(t, res->final_dir, sizeof res->final_dir));
    return QT_OK;
}

/* report.html's last word: the run finished, was stopped, or failed (then
 * the run's own error is the one reported, whatever happens here). */
static int report_final(qt_trainer *t, int rc) {
    const char *status = rc == QT_OK ? "finished" : rc == QT_EINTERRUPTED ? "stopped" : "failed";
    if (rc == QT_OK) return qt_metrics_write_report(&t->metrics, status);
    char msg[2048];
    snprintf(msg, sizeof msg, "%s", qt_error_message());
    if (qt_metrics_write_report(&t->metrics, status) != QT_OK) qt_error_at(rc, __FILE__, __LINE__, "%s", msg);
    return rc;
}

int qt_train_run(const qt_job *job, dist_ctx *d, const qt_train_hooks *hooks, qt_train_result *res) {
    static const qt_train_hooks no_hooks = {0};
    qt_trainer t;
    memset(&t, 0, sizeof t);
    memset(res, 0, sizeof *res);
    t.job = job;
    t.outdir_lock = -1;
    t.d = d;
    t.hooks = hooks ? hooks : &no_hooks;
    t.rank = dist_rank(d);
    t.world = dist_world(d);
    t.main = dist_is_main(d);
    t.pref = job->objective.type != QT_OBJ_SFT;
    t.ref_pre = qt_objective_precomputes_ref(&job->objective, job->lora.enabled);
    int rc = QT_OK;
    /* the job's key, not a file inside the folder, names what is wrong */
    if (!qt_is_dir(job->model))
        rc = QT_ERR(QT_EINVAL, "%s: \"model\" names %s, which %s; give the path of a Hugging Face model folder "
                    "(a relative path starts at the job file's folder)",
                    job->path, job->model, qt_path_exists(job->model) ? "is not a folder" : "does not exist");
    if (rc == QT_OK) rc = qt_run_setup_open(&t.setup, job, t.world, t.rank);
    if (rc == QT_OK) t.cfg = t.setup.cfg;
    /* one process: a stop while the data is tokenized ends the load at once
     * (under MPI loading finishes, then every rank agrees to stop) */
    if (t.world == 1) qt_cancel_watch(t.hooks->stop);
    /* the device before anything is read or written: a "cuda" with no GPU
     * here fails now, with the output folder untouched */
    if (rc == QT_OK) {
        char where[4200];
        snprintf(where, sizeof where, "%s: \"device\":", job->path);
        rc = qt_device_resolve(job->device, where, &t.dev);
    }
    if (rc == QT_OK && t.main) {
        char line[1024], dev[320];
        qt_device_label(&t.dev, omp_get_max_threads(), dev, sizeof dev);
        qt_train_describe(job, &t.setup.ds, dev, line, sizeof line);
        qt_info("%s", line);
        if (t.dev.note[0]) qt_info("%s", t.dev.note);
    }
    if (rc == QT_OK) rc = run(&t, res);
    if (t.main && t.metrics.f) rc = report_final(&t, rc);
    qt_cancel_watch(NULL);
    trainer_free(&t);
    return rc;
}
