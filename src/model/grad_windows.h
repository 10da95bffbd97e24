/* ZeRO-2's gradient windows (opts.grad_windows, model.h qt_grad_hook): the
 * backward writes the trainable gradients into one or two windows instead of
 * a whole gradient block, and hands each bucket over (hook.ready) as soon as
 * its last backward step is done, so the reduction runs while the backward
 * goes on. The layers' gradients go in buckets (memplan.h qt_grad_pack):
 * bucket b is written in win[b % nwin], its tensors packed in flat order, and
 * each layer's gradient pointers point there; the final norm's gradient goes
 * in its own window (norm); the lm_head's backward runs per vocabulary slice
 * into slice[k % nwin], with the slice's shifted targets in `targets`.
 *
 * The block is sized by the memory plan (memplan.c qt_model_grad_windows)
 * and carved by the same function (qt_model_carve_windows). Inside
 * src/model/ only. */
#ifndef QT_MODEL_GRAD_WINDOWS_H
#define QT_MODEL_GRAD_WINDOWS_H

#include <stddef.h>
#include <stdint.h>

#include "backend/backend.h"
#include "model/memplan.h"
#include "model/model.h"

/* One contiguous flat range of a gradient bucket: elements [lo, hi) of the
 * trainable block, at window offset woff. */
typedef struct {
    size_t lo, hi, woff;
} qt_grad_run;

typedef struct {
    qt_backend *be;        /* the model's backend: the windows are its device memory */
    qt_grad_windows plan;  /* the sizes (memplan.h) */
    float *block;          /* every window in one device block; NULL: no windows (the model has a gradient block) */
    qt_grad_window_ptrs at; /* its pieces: win[nwin], norm, targets (memplan.h) */
    float *slice[2];       /* the lm_head slices' windows: win[0], win[nwin - 1] */
    int *unit_bucket;      /* (L * QT_GU_COUNT) each unit's bucket, -1 when it has no tensors */
    int *close_at;         /* (L * QT_GU_COUNT) the bucket handed over after that step, else -1 */
    qt_grad_run *runs;     /* each bucket's contiguous flat ranges, bucket after bucket */
    int *run0;             /* (nbuckets + 1) bucket b's runs: runs[run0[b] .. run0[b + 1]) */
    size_t *bucket_fill;   /* (nbuckets) elements in each bucket's window */
    float **grad_at;       /* (n_params) each layer tensor's gradient in its window */
    int open;              /* the last bucket opened in the running backward */
    qt_grad_hook hook;
} qt_grad_win_state;

/* Sizes, allocates (zeroed) and carves the windows for (c, o) on be, and
 * lays out the buckets over the parameter table P (n entries, flat order). */
int qt_grad_win_init(qt_grad_win_state *w, qt_backend *be, const qt_config *c, const qt_model_opts *o,
                     const qt_param *P, int n);
void qt_grad_win_free(qt_grad_win_state *w);

/* The model is about to zero and write g[0, n) of a window: hook.window
 * waits for whatever still reads it, then the window is zeroed. */
int qt_grad_win_open(qt_grad_win_state *w, float *g, size_t n);
/* g[0, hi - lo) holds the gradient of flat [lo, hi): hand it over. */
int qt_grad_win_ready(const qt_grad_win_state *w, size_t lo, size_t hi, const float *g);

/* A new backward: no bucket is open yet. */
void qt_grad_win_start(qt_grad_win_state *w);
/* Before step `unit` of layer l writes its gradients: the bucket the unit
 * starts is opened (once: a bucket already open stays as it is, so a unit
 * whose step runs in two calls, as q under Qwen3's q_norm, may open it
 * twice). After the step: the bucket it completes is handed over, one
 * ready() per contiguous flat range, the last range first. Without windows
 * both do nothing. */
int qt_grad_win_begin(qt_grad_win_state *w, int l, int unit);
int qt_grad_win_end(const qt_grad_win_state *w, int l, int unit);

#endif
