/* QTUNE_PROFILE=1: where a run's time goes, op by op, on any backend.
 *
 * qt_backend_open wraps the backend it opened in this table: every entry
 * synchronises the backend, reads the host clock, calls the real entry,
 * synchronises again and adds the time to that entry's row. At close the rows
 * go to stderr, largest first, with the run's wall time between open and
 * close beside them (what is not in any op is host work: data, the loss
 * scaler's decisions, checkpoints). The synchronisation serialises the host
 * with a GPU's stream, so a profiled run is slower than a plain one; each
 * row is the time that op's work really takes, launch included. */
#define _GNU_SOURCE /* qsort_r */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/backend.h"
#include "backend/backend_impl.h"
#include "core/error.h"
#include "core/mem.h"

enum {
#define OP(name) P_##name,
#include "backend/profile_ops.h"
#undef OP
    P_COUNT
};
static const char *const op_names[P_COUNT] = {
#define OP(name) #name,
#include "backend/profile_ops.h"
#undef OP
};

typedef struct {
    qt_backend *in;
    double t_open;
    double sec[P_COUNT];
    long calls[P_COUNT];
} prof;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
static prof *P(qt_backend *be) { return be->impl; }
static double t_begin(qt_backend *be) {
    qt_backend *in = P(be)->in;
    in->sync(in);
    return now();
}
static void t_end(qt_backend *be, int op, double t0) {
    qt_backend *in = P(be)->in;
    in->sync(in);
    P(be)->sec[op] += now() - t0;
    P(be)->calls[op]++;
}

#define BE qt_backend *be
#define IN (P(be)->in)
/* an entry that returns nothing */
#define WRAP(name, params, args)                 \
    static void w_##name params {                \
        double t0 = t_begin(be);                 \
        IN->name args;                           \
        t_end(be, P_##name, t0);                 \
    }
/* an entry that returns a value of type ty */
#define WRAPR(ty, name, params, args)            \
    static ty w_##name params {                  \
        double t0 = t_begin(be);                 \
        ty r_ = IN->name args;                   \
        t_end(be, P_##name, t0);                 \
        return r_;                               \
    }

/* memory entries pass straight through (no clock): their time is the host's */
static void *w_alloc(BE, qt_mem_place place, size_t bytes, const char *what) {
    return IN->alloc(IN, place, bytes, what);
}
static void w_free(BE, void *p) { IN->free(IN, p); }
static int w_import_mapped(BE, const void *host, size_t bytes, const void **dev, const char *what) {
    return IN->import_mapped(IN, host, bytes, dev, what);
}
static void w_release_mapped(BE, const void *dev) { IN->release_mapped(IN, dev); }
static void w_sync(BE) { IN->sync(IN); }
static qt_event *w_event_record(BE) { return IN->event_record(IN); }
static void w_event_wait(BE, qt_event *e) { IN->event_wait(IN, e); }
static void w_event_free(BE, qt_event *e) { IN->event_free(IN, e); }
static int w_half_available(BE, qt_dtype dt) { return IN->half_available(IN, dt); }
static size_t w_runtime_bytes(BE) { return IN->runtime_bytes(IN); }
static size_t w_device_peak_bytes(BE) { return IN->device_peak_bytes(IN); }
/* the ops fn calls are timed each; the hold itself is not an op */
static int w_hold_threads(BE, int (*fn)(void *arg), void *arg) { return IN->hold_threads(IN, fn, arg); }

WRAP(upload, (BE, void *dev, const void *host, size_t bytes), (IN, dev, host, bytes))
WRAP(download, (BE, void *host, const void *dev, size_t bytes), (IN, host, dev, bytes))
WRAP(copy, (BE, void *dst, const void *src, size_t bytes), (IN, dst, src, bytes))
WRAP(zero, (BE, void *dev, size_t bytes), (IN, dev, bytes))
WRAP(embedding_forward, (BE, float *out, const int32_t *ids, const void *wte, qt_dtype wdt, int N, int C),
     (IN, out, ids, wte, wdt, N, C))
WRAP(embedding_backward, (BE, float *dwte, const float *dout, const int32_t *ids, int N, int C),
     (IN, dwte, dout, ids, N, C))
WRAP(rmsnorm_forward, (BE, float *out, float *rstd, const float *inp, const float *w, int N, int C, float eps),
     (IN, out, rstd, inp, w, N, C, eps))
WRAP(rmsnorm_backward,
     (BE, float *dinp, float *dw, const float *dout, const float *inp, const float *w, const float *rstd, int N,
      int C),
     (IN, dinp, dw, dout, inp, w, rstd, N, C))
WRAP(matmul_forward,
     (BE, float *out, const float *inp, const void *w, qt_dtype wdt, const float *bias, int N, int IN_, int OUT,
      float alpha, int accumulate, float *ws),
     (IN, out, inp, w, wdt, bias, N, IN_, OUT, alpha, accumulate, ws))
WRAP(matmul_backward,
     (BE, float *dinp, float *dw, float *db, const float *dout, const float *inp, const void *w, qt_dtype wdt, int N,
      int IN_, int OUT, float alpha, float *ws),
     (IN, dinp, dw, db, dout, inp, w, wdt, N, IN_, OUT, alpha, ws))
WRAP(matvec,
     (BE, float *out, const float *x, const void *w, qt_dtype wdt, const float *bias, int N, int IN_, int OUT,
      float alpha, int accumulate),
     (IN, out, x, w, wdt, bias, N, IN_, OUT, alpha, accumulate))
WRAP(matvec_many, (BE, const float *x, int N, int IN_, int count, const qt_matvec_out *o), (IN, x, N, IN_, count, o))
WRAP(rope_forward, (BE, float *x, const int32_t *pos, int N, int NH, int D, const float *inv, float scale),
     (IN, x, pos, N, NH, D, inv, scale))
WRAP(rope_backward, (BE, float *dx, const int32_t *pos, int N, int NH, int D, const float *inv, float scale),
     (IN, dx, pos, N, NH, D, inv, scale))
WRAP(attention_forward,
     (BE, float *out, float *lse, const float *q, const float *k, const float *v, const int32_t *doc_start, int B,
      int T, int H, int KV, int D),
     (IN, out, lse, q, k, v, doc_start, B, T, H, KV, D))
WRAP(attention_backward,
     (BE, float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse, const float *q,
      const float *k, const float *v, const int32_t *doc_start, int B, int T, int H, int KV, int D),
     (IN, dq, dk, dv, dout, out, lse, q, k, v, doc_start, B, T, H, KV, D))
WRAP(attention_forward_cached,
     (BE, float *out, const float *q, const float *kc, const float *vc, int n, int pos0, int H, int KV, int D),
     (IN, out, q, kc, vc, n, pos0, H, KV, D))
WRAP(swiglu_forward, (BE, float *out, const float *gate, const float *up, int N, int I), (IN, out, gate, up, N, I))
WRAP(swiglu_backward,
     (BE, float *dgate, float *dup, const float *dout, const float *gate, const float *up, int N, int I),
     (IN, dgate, dup, dout, gate, up, N, I))
WRAP(lmhead_ce_forward,
     (BE, float *loss, float *lse, const float *x, const void *w, qt_dtype wdt, const int32_t *targets, int N, int C,
      int V, float *ws),
     (IN, loss, lse, x, w, wdt, targets, N, C, V, ws))
WRAP(lmhead_ce_backward,
     (BE, float *dx, float *dw, const float *x, const void *w, qt_dtype wdt, const int32_t *targets,
      const float *lse, float dscale, int N, int C, int V, float *ws),
     (IN, dx, dw, x, w, wdt, targets, lse, dscale, N, C, V, ws))
WRAP(lmhead_ce_forward_keep,
     (BE, float *loss, float *lse, float *kept, const float *x, const void *w, qt_dtype wdt, const int32_t *targets,
      int N, int C, int V, float *ws),
     (IN, loss, lse, kept, x, w, wdt, targets, N, C, V, ws))
WRAP(lmhead_ce_backward_kept,
     (BE, float *dx, float *dw, float *kept, const float *x, const void *w, qt_dtype wdt, const int32_t *targets,
      const float *lse, float dscale, int N, int C, int V, float *ws),
     (IN, dx, dw, kept, x, w, wdt, targets, lse, dscale, N, C, V, ws))
WRAP(lmhead_ce_forward_dx,
     (BE, float *loss, float *lse, float *dx, const float *x, const void *w, qt_dtype wdt, const int32_t *targets,
      float dscale, int N, int C, int V, float *ws),
     (IN, loss, lse, dx, x, w, wdt, targets, dscale, N, C, V, ws))
WRAP(acc, (BE, float *out, const float *a, size_t n), (IN, out, a, n))
WRAP(round_to_dtype, (BE, float *x, size_t n, qt_dtype dt), (IN, x, n, dt))
WRAP(round_store, (BE, float *x, uint16_t *dst, size_t n, qt_dtype dt), (IN, x, dst, n, dt))
WRAP(convert, (BE, void *dst, qt_dtype ddt, const void *src, qt_dtype sdt, size_t n), (IN, dst, ddt, src, sdt, n))
WRAPR(int, half_matmul,
      (BE, qt_dtype dt, float *out, const uint16_t *inp, const uint16_t *w, const float *bias, int N, int IN_,
       int OUT, float alpha),
      (IN, dt, out, inp, w, bias, N, IN_, OUT, alpha))
WRAPR(int, half_gemm,
      (BE, qt_dtype dt, float *C, const uint16_t *A, int ta, const uint16_t *B, int tb, const float *bias, int M,
       int N, int K, float alpha, int acc),
      (IN, dt, C, A, ta, B, tb, bias, M, N, K, alpha, acc))
WRAP(dropout,
     (BE, float *dst, const float *src, size_t n, const qt_dropout_key *key, uint32_t threshold, float keep_scale),
     (IN, dst, src, n, key, threshold, keep_scale))
WRAPR(int, adam, (BE, const qt_adam_scalars *k, float *p, const float *g, float *m, float *v, size_t n),
     (IN, k, p, g, m, v, n))
WRAPR(double, sum_squares, (BE, const float *x, size_t n), (IN, x, n))
WRAP(scale, (BE, float *x, size_t n, float s), (IN, x, n, s))

static int by_time_desc(const void *a, const void *b, void *ctx) {
    const double *s = ctx;
    double x = s[*(const int *)a], y = s[*(const int *)b];
    return (x < y) - (x > y);
}

static void w_close(BE) {
    prof *p = P(be);
    double wall = now() - p->t_open, in_ops = 0;
    int order[P_COUNT];
    for (int i = 0; i < P_COUNT; i++) order[i] = i, in_ops += p->sec[i];
    long used = 0;
    for (int i = 0; i < P_COUNT; i++) used += p->calls[i];
    if (!used) goto done; /* a backend opened for a probe: no table */
    qsort_r(order, P_COUNT, sizeof order[0], by_time_desc, p->sec);
    fprintf(stderr, "qtune: profile of the %s backend (QTUNE_PROFILE): %.3f s from open to close, %.3f s in ops "
                    "(each op synchronised)\n", p->in->desc->name, wall, in_ops);
    fprintf(stderr, "  %-26s %9s %11s %10s %7s\n", "op", "calls", "total ms", "ms/call", "share");
    for (int k = 0; k < P_COUNT; k++) {
        int i = order[k];
        if (!p->calls[i]) continue;
        fprintf(stderr, "  %-26s %9ld %11.2f %10.4f %6.1f%%\n", op_names[i], p->calls[i], 1e3 * p->sec[i],
                1e3 * p->sec[i] / (double)p->calls[i], wall > 0 ? 100.0 * p->sec[i] / wall : 0.0);
    }
    fprintf(stderr, "  %-26s %9s %11.2f %10s %6.1f%%\n", "(outside the ops)", "", 1e3 * (wall - in_ops), "",
            wall > 0 ? 100.0 * (wall - in_ops) / wall : 0.0);
done:
    p->in->close(p->in);
    qt_free(p);
    qt_free(be);
}
#undef BE

/* The decorator's table; an instance's desc is the wrapped backend's. The
 * memory entries and the facts pass straight through, the ops are timed
 * (profile_ops.h lists them). */
static const qt_backend profile_i = {
    .alloc = w_alloc,
    .free = w_free,
    .import_mapped = w_import_mapped,
    .release_mapped = w_release_mapped,
    .sync = w_sync,
    .event_record = w_event_record,
    .event_wait = w_event_wait,
    .event_free = w_event_free,
    .half_available = w_half_available,
    .runtime_bytes = w_runtime_bytes,
    .device_peak_bytes = w_device_peak_bytes,
    .hold_threads = w_hold_threads,
#define OP(name) .name = w_##name,
#include "backend/profile_ops.h"
#undef OP
    .close = w_close,
};

int qt_backend_profile_wrap(qt_backend *in, qt_backend **out) {
    *out = NULL;
    qt_backend *be = qt_malloc(sizeof *be, "profiling backend");
    prof *p = qt_calloc(1, sizeof *p, "profiling backend");
    if (!be || !p) {
        qt_free(be), qt_free(p);
        return QT_ENOMEM;
    }
    p->in = in;
    p->t_open = now();
    *be = profile_i;
    be->desc = in->desc;
    be->impl = p;
    *out = be;
    return QT_OK;
}
