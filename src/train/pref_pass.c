/* Forward-only passes over preference pairs: log-probs, evaluation, the
 * reference cache (pref_pass.h). */
#include "train/pref_pass.h"

#include <dirent.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"
#include "data/source.h"

int qt_pref_logps(qt_model *m, const dl_pref_set *set, const int64_t *idx, int64_t P, int B, int T, int adapter,
                  qt_batch *b, float *logp, double *sum, int64_t *n) {
    double rs[2 * QT_PREF_MAX_PAIRS];
    int64_t rn[2 * QT_PREF_MAX_PAIRS];
    if (B > QT_PREF_MAX_PAIRS) return QT_ERR(QT_EINVAL, "%d pairs in one micro-batch; at most %d", B, QT_PREF_MAX_PAIRS);
    int rc = QT_OK;
    if (!adapter) qt_model_set_adapter(m, 0);
    for (int64_t j0 = 0; j0 < P && rc == QT_OK; j0 += B) {
        int p = P - j0 < B ? (int)(P - j0) : B;
        dl_pref_batch(set, idx + j0, p, T, b);
        rc = qt_model_forward(m, b, NULL, NULL, logp);
        if (rc != QT_OK) break;
        qt_pref_row_sums(logp, b->targets, 2 * p, T, rs, rn);
        for (int j = 0; j < p; j++) { /* rows: the p chosen sides, then the p rejected ones */
            sum[2 * (j0 + j)] = rs[j], sum[2 * (j0 + j) + 1] = rs[p + j];
            n[2 * (j0 + j)] = rn[j], n[2 * (j0 + j) + 1] = rn[p + j];
        }
    }
    if (!adapter) qt_model_set_adapter(m, 1);
    return rc;
}

void qt_pref_eval_add(const qt_objective *o, int64_t P, const double *pol, const int64_t *n, const double *ref,
                      qt_pref_sums *s, int64_t *chosen_tokens) {
    for (int64_t i = 0; i < P; i++) {
        double pc = pol[2 * i], pr = pol[2 * i + 1], rc = ref ? ref[2 * i] : 0, rr = ref ? ref[2 * i + 1] : 0, wc, wr;
        /* inv_chosen 0: the NLL term is added over the whole set in qt_pref_eval_loss */
        qt_objective_pairs(o, 1, &pc, &pr, ref ? &rc : NULL, ref ? &rr : NULL, &n[2 * i], &n[2 * i + 1], 1.0, 0.0,
                           &wc, &wr, s);
        *chosen_tokens += n[2 * i];
    }
}

static double nll_weight(const qt_objective *o) {
    return o->type == QT_OBJ_ORPO ? 1.0 : o->type == QT_OBJ_SIMPO ? o->cpo_alpha : 0.0;
}

double qt_pref_eval_loss(const qt_objective *o, const qt_pref_sums *s, int64_t chosen_tokens) {
    if (s->pairs == 0) return NAN;
    double l = s->loss / (double)s->pairs, a = nll_weight(o);
    if (a > 0 && chosen_tokens > 0) l += a * s->nll / (double)chosen_tokens;
    return l;
}

void qt_pref_metrics_json(const qt_objective *o, const char *prefix, double loss, const qt_pref_sums *s,
                          int64_t chosen_tokens, char *buf, size_t cap) {
    double P = s->pairs > 0 ? (double)s->pairs : 1;
    const char *x = prefix;
    int k = snprintf(buf, cap,
                     ", \"%sloss\": %.9g, \"%srewards/chosen\": %.9g, \"%srewards/rejected\": %.9g, "
                     "\"%srewards/accuracies\": %.9g, \"%srewards/margins\": %.9g, \"%slogps/chosen\": %.9g, "
                     "\"%slogps/rejected\": %.9g",
                     x, loss, x, s->rewards_chosen / P, x, s->rewards_rejected / P, x, s->accuracies / P, x,
                     s->margins / P, x, s->logps_chosen / P, x, s->logps_rejected / P);
    if (o->type != QT_OBJ_DPO && k > 0 && (size_t)k < cap)
        k += snprintf(buf + k, cap - (size_t)k, ", \"%snll_loss\": %.9g", x,
                      chosen_tokens ? s->nll / (double)chosen_tokens : 0.0);
    if (o->type == QT_OBJ_ORPO && k > 0 && (size_t)k < cap)
        snprintf(buf + k, cap - (size_t)k, ", \"%slog_odds_ratio\": %.9g, \"%slog_odds_chosen\": %.9g", x,
                 s->log_odds_ratio / P, x, s->log_odds_chosen / P);
}

/* ---------------------------------------------------------------------------
 * the reference cache: a header (magic, key, count) and the sums as doubles */

#define REF_MAGIC 0x3166657265727471ull /* "qtreref1" */

static uint64_t hash_file_stat(uint64_t h, const char *dir, const char *name) {
    char p[4096];
    struct stat st;
    if (qt_path_join(p, sizeof p, dir, name) != QT_OK || stat(p, &st) != 0) return h;
    int64_t v[3] = {(int64_t)st.st_size, (int64_t)st.st_mtim.tv_sec, (int64_t)st.st_mtim.tv_nsec};
    h = qt_hash64(name, strlen(name), h);
    return qt_hash64(v, sizeof v, h);
}

uint64_t qt_pref_ref_key(const char *model_dir, const dl_pref_set *set, const char *dtype, const char *backend) {
    uint64_t h = 0x7072656672656631ull;
    char p[4096], *cfg = NULL;
    size_t len = 0;
    if (qt_path_join(p, sizeof p, model_dir, "config.json") == QT_OK && qt_read_file(p, 1 << 20, &cfg, &len) == QT_OK)
        h = qt_hash64(cfg, len, h);
    qt_free(cfg);
    qt_error_clear();
    /* the weights by name, size and modification time: rehashing gigabytes at every start would cost more
     * than the pass it saves. Sorted, so the folder's listing order does not matter. */
    DIR *d = opendir(model_dir);
    char names[256][256];
    int nn = 0;
    for (struct dirent *e; d && (e = readdir(d)) && nn < 256;) {
        size_t l = strlen(e->d_name);
        if (l > 12 && l < 256 && !strcmp(e->d_name + l - 12, ".safetensors")) snprintf(names[nn++], 256, "%s", e->d_name);
    }
    if (d) closedir(d);
    qsort(names, (size_t)nn, sizeof names[0], (int (*)(const void *, const void *))strcmp);
    for (int i = 0; i < nn; i++) h = hash_file_stat(h, model_dir, names[i]);
    int64_t n = set->start[2 * set->n_pairs];
    h = qt_hash64(set->start, sizeof(int64_t) * (size_t)(2 * set->n_pairs + 1), h);
    h = qt_hash64(set->ids, sizeof(int32_t) * (size_t)n, h);
    h = qt_hash64(set->mask, (size_t)n, h);
    h = qt_hash64(dtype, strlen(dtype), h);
    return qt_hash64(backend, strlen(backend), h);
}

int qt_pref_ref_cache_path(const char *data_path, const char *cache_dir, char *out, size_t cap) {
    return dl_cache_path_ext(data_path, cache_dir, "qref", out, cap);
}

int qt_pref_ref_cache_read(const char *path, uint64_t key, int64_t n, double *sum) {
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    uint64_t h[3];
    int ok = fread(h, sizeof h, 1, f) == 1 && h[0] == REF_MAGIC && h[1] == key && h[2] == (uint64_t)n &&
             fread(sum, sizeof(double), (size_t)n, f) == (size_t)n;
    fclose(f);
    for (int64_t i = 0; ok && i < n; i++) ok = isfinite(sum[i]) && sum[i] <= 0;
    return ok;
}

int qt_pref_ref_cache_write(const char *path, uint64_t key, int64_t n, const double *sum) {
    char dir[4096];
    qt_path_dirname(dir, sizeof dir, path);
    QT_TRY(qt_mkdir_p(dir));
    qt_atomic_file af;
    QT_TRY(qt_atomic_open(&af, path));
    uint64_t h[3] = {REF_MAGIC, key, (uint64_t)n};
    int rc = qt_atomic_write(&af, h, sizeof h);
    if (rc == QT_OK) rc = qt_atomic_write(&af, sum, sizeof(double) * (size_t)n);
    if (rc != QT_OK) {
        qt_atomic_abort(&af);
        return rc;
    }
    return qt_atomic_commit(&af);
}
