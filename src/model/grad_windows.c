/* ZeRO-2's gradient windows and their buckets (grad_windows.h): the layout
 * at load, and the hand-over the backward calls around each of its steps. */
#include "model/grad_windows.h"

#include <string.h>

#include "core/error.h"
#include "core/mem.h"

/* The layers' gradient buckets (memplan.h qt_grad_pack), for the backward:
 * each unit's bucket; the step after which each bucket is handed over (its
 * last unit's; a fused c_attn, unit q, is complete after the v step); each
 * tensor's place in its bucket's window, tensors packed in flat order; and
 * the runs of adjacent tensors, each one contiguous flat range. */
static int build_buckets(qt_grad_win_state *w, const qt_config *c, const qt_model_opts *o, const qt_param *P,
                         int n_params) {
    const size_t U = (size_t)c->num_hidden_layers * QT_GU_COUNT, nb = (size_t)w->plan.nbuckets;
    const int fused = qt_config_layout(c)->fused_qkv;
    w->unit_bucket = qt_malloc(U * sizeof(int), "model: gradient buckets");
    w->close_at = qt_malloc(U * sizeof(int), "model: gradient buckets");
    w->run0 = qt_calloc(nb + 1, sizeof(int), "model: gradient buckets");
    w->bucket_fill = qt_calloc(nb + 1, sizeof(size_t), "model: gradient buckets");
    w->grad_at = qt_calloc((size_t)n_params + 1, sizeof(float *), "model: gradient buckets");
    size_t *end = qt_calloc(nb + 1, sizeof(size_t), "model: gradient buckets");
    int *cur = qt_calloc(nb + 1, sizeof(int), "model: gradient buckets");
    int rc = QT_ENOMEM;
    if (!w->unit_bucket || !w->close_at || !w->run0 || !w->bucket_fill || !w->grad_at || !end || !cur) goto out;
    if (qt_grad_pack(c, o, w->unit_bucket, NULL) != (int)nb) {
        rc = QT_ERR(QT_EINVAL, "model: the gradient buckets disagree with the memory plan (internal error)");
        goto out;
    }
    /* completion order: bucket b is handed over after its last unit's step */
    for (size_t u = 0; u < U; u++) w->close_at[u] = -1;
    int prev = -1;
    size_t prev_at = 0;
    for (int l = c->num_hidden_layers - 1; l >= 0; l--)
        for (int k = 0; k < QT_GU_COUNT; k++) {
            int b = w->unit_bucket[(size_t)l * QT_GU_COUNT + (size_t)k];
            if (b < 0) continue;
            if (prev >= 0 && b != prev) w->close_at[prev_at] = prev;
            prev = b;
            prev_at = (size_t)l * QT_GU_COUNT + (size_t)(fused && k == QT_GU_Q ? QT_GU_V : k);
        }
    if (prev >= 0) w->close_at[prev_at] = prev;
    /* the table is in flat order: count each bucket's runs of adjacent tensors, then lay them out */
    for (int pass = 0; pass < 2; pass++) {
        memset(w->bucket_fill, 0, (nb + 1) * sizeof(size_t));
        for (int i = 0; i < n_params; i++) {
            if (P[i].layer < 0) continue;
            int b = w->unit_bucket[(size_t)P[i].layer * QT_GU_COUNT + (size_t)P[i].unit];
            int fresh = w->bucket_fill[b] == 0 || end[b] != P[i].offset;
            if (pass == 0) {
                w->run0[b + 1] += fresh;
            } else {
                if (fresh) w->runs[cur[b]++] = (qt_grad_run){P[i].offset, P[i].offset, w->bucket_fill[b]};
                w->runs[cur[b] - 1].hi = P[i].offset + P[i].numel;
                w->grad_at[i] = w->at.win[b % w->plan.nwin] + w->bucket_fill[b];
            }
            end[b] = P[i].offset + P[i].numel;
            w->bucket_fill[b] += P[i].numel;
        }
        if (pass == 0) {
            for (size_t b = 0; b < nb; b++) w->run0[b + 1] += w->run0[b];
            for (size_t b = 0; b < nb; b++) cur[b] = w->run0[b];
            w->runs = qt_calloc((size_t)w->run0[nb] + 1, sizeof(qt_grad_run), "model: gradient buckets");
            rc = QT_ENOMEM;
            if (!w->runs) goto out;
        }
    }
    rc = QT_OK;
out:
    qt_free(end);
    qt_free(cur);
    return rc;
}

int qt_grad_win_init(qt_grad_win_state *w, qt_backend *be, const qt_config *c, const qt_model_opts *o,
                     const qt_param *P, int n) {
    w->be = be;
    qt_model_grad_windows(c, o, &w->plan);
    const size_t bytes = w->plan.total * sizeof(float);
    w->block = qt_be_alloc(be, QT_MEM_DEVICE, bytes ? bytes : sizeof(float), "model: gradient windows");
    if (!w->block) return QT_ENOMEM;
    qt_be_zero(be, w->block, bytes);
    qt_model_carve_windows(&w->plan, w->block, &w->at);
    w->slice[0] = w->at.win[0];
    w->slice[1] = w->at.win[w->plan.nwin - 1];
    return build_buckets(w, c, o, P, n);
}

void qt_grad_win_free(qt_grad_win_state *w) {
    if (w->block) qt_be_free(w->be, w->block);
    qt_free(w->unit_bucket);
    qt_free(w->close_at);
    qt_free(w->runs);
    qt_free(w->run0);
    qt_free(w->bucket_fill);
    qt_free(w->grad_at);
    memset(w, 0, sizeof *w);
}

int qt_grad_win_open(qt_grad_win_state *w, float *g, size_t n) {
    if (w->hook.window) QT_TRY(w->hook.window(w->hook.user, g, n));
    qt_be_zero(w->be, g, n * sizeof(float));
    return QT_OK;
}

int qt_grad_win_ready(const qt_grad_win_state *w, size_t lo, size_t hi, const float *g) {
    return w->hook.ready(w->hook.user, lo, hi, g);
}

void qt_grad_win_start(qt_grad_win_state *w) { w->open = -1; }

int qt_grad_win_begin(qt_grad_win_state *w, int l, int unit) {
    if (!w->block) return QT_OK;
    int b = w->unit_bucket[(size_t)l * QT_GU_COUNT + (size_t)unit];
    if (b < 0 || b <= w->open) return QT_OK;
    w->open = b;
    return qt_grad_win_open(w, w->at.win[b % w->plan.nwin], w->bucket_fill[b]);
}

int qt_grad_win_end(const qt_grad_win_state *w, int l, int unit) {
    if (!w->block) return QT_OK;
    int b = w->close_at[(size_t)l * QT_GU_COUNT + (size_t)unit];
    if (b < 0) return QT_OK;
    const float *g = w->at.win[b % w->plan.nwin];
    for (int r = w->run0[b + 1] - 1; r >= w->run0[b]; r--)
        QT_TRY(qt_grad_win_ready(w, w->runs[r].lo, w->runs[r].hi, g + w->runs[r].woff));
    return QT_OK;
}
