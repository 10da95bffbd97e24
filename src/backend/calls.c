/* The calls of backend.h: each forwards to its slot of the backend's table (backend_impl.h), so the
 * callers see the interface and never the table. */
#include "backend/backend.h"
#include "backend/backend_impl.h"

const qt_backend_desc *qt_be_desc(const qt_backend *be) { return be->desc; }

void *qt_be_alloc(qt_backend *be, qt_mem_place place, size_t bytes, const char *what) {
    return be->alloc(be, place, bytes, what);
}

void qt_be_free(qt_backend *be, void *p) {
    be->free(be, p);
}

int qt_be_import_mapped(qt_backend *be, const void *host, size_t bytes, const void **dev, const char *what) {
    return be->import_mapped(be, host, bytes, dev, what);
}

void qt_be_release_mapped(qt_backend *be, const void *dev) {
    be->release_mapped(be, dev);
}

void qt_be_upload(qt_backend *be, void *dev, const void *host, size_t bytes) {
    be->upload(be, dev, host, bytes);
}

void qt_be_download(qt_backend *be, void *host, const void *dev, size_t bytes) {
    be->download(be, host, dev, bytes);
}

void qt_be_copy(qt_backend *be, void *dst, const void *src, size_t bytes) {
    be->copy(be, dst, src, bytes);
}

void qt_be_zero(qt_backend *be, void *dev, size_t bytes) {
    be->zero(be, dev, bytes);
}

void qt_be_sync(qt_backend *be) {
    be->sync(be);
}

qt_event *qt_be_event_record(qt_backend *be) {
    return be->event_record(be);
}

void qt_be_event_wait(qt_backend *be, qt_event *e) {
    be->event_wait(be, e);
}

void qt_be_event_free(qt_backend *be, qt_event *e) {
    be->event_free(be, e);
}

void qt_be_embedding_forward(qt_backend *be, float *out, const int32_t *ids, const void *wte, qt_dtype wdt, int N,
                             int C) {
    be->embedding_forward(be, out, ids, wte, wdt, N, C);
}

void qt_be_embedding_backward(qt_backend *be, float *dwte, const float *dout, const int32_t *ids, int N, int C) {
    be->embedding_backward(be, dwte, dout, ids, N, C);
}

void qt_be_rmsnorm_forward(qt_backend *be, float *out, float *rstd, const float *inp, const float *weight, int N, int C,
                           float eps) {
    be->rmsnorm_forward(be, out, rstd, inp, weight, N, C, eps);
}

void qt_be_rmsnorm_backward(qt_backend *be, float *dinp, float *dweight, const float *dout, const float *inp,
                            const float *weight, const float *rstd, int N, int C) {
    be->rmsnorm_backward(be, dinp, dweight, dout, inp, weight, rstd, N, C);
}

void qt_be_matmul_forward(qt_backend *be, float *out, const float *inp, const void *w, qt_dtype wdt, const float *bias,
                          int N, int IN, int OUT, float alpha, int accumulate, float *ws) {
    be->matmul_forward(be, out, inp, w, wdt, bias, N, IN, OUT, alpha, accumulate, ws);
}

void qt_be_matmul_backward(qt_backend *be, float *dinp, float *dweight, float *dbias, const float *dout,
                           const float *inp, const void *w, qt_dtype wdt, int N, int IN, int OUT, float alpha,
                           float *ws) {
    be->matmul_backward(be, dinp, dweight, dbias, dout, inp, w, wdt, N, IN, OUT, alpha, ws);
}

void qt_be_matvec(qt_backend *be, float *out, const float *x, const void *w, qt_dtype wdt, const float *bias, int N,
                  int IN, int OUT, float alpha, int accumulate) {
    be->matvec(be, out, x, w, wdt, bias, N, IN, OUT, alpha, accumulate);
}

void qt_be_matvec_many(qt_backend *be, const float *x, int N, int IN, int count, const qt_matvec_out *o) {
    be->matvec_many(be, x, N, IN, count, o);
}

void qt_be_rope_forward(qt_backend *be, float *x, const int32_t *pos, int N, int NH, int D, const float *inv_freq,
                        float scale) {
    be->rope_forward(be, x, pos, N, NH, D, inv_freq, scale);
}

void qt_be_rope_backward(qt_backend *be, float *dx, const int32_t *pos, int N, int NH, int D, const float *inv_freq,
                         float scale) {
    be->rope_backward(be, dx, pos, N, NH, D, inv_freq, scale);
}

void qt_be_attention_forward(qt_backend *be, float *out, float *lse, const float *q, const float *k, const float *v,
                             const int32_t *doc_start, int B, int T, int H, int KV, int D) {
    be->attention_forward(be, out, lse, q, k, v, doc_start, B, T, H, KV, D);
}

void qt_be_attention_backward(qt_backend *be, float *dq, float *dk, float *dv, const float *dout, const float *out,
                              const float *lse, const float *q, const float *k, const float *v,
                              const int32_t *doc_start, int B, int T, int H, int KV, int D) {
    be->attention_backward(be, dq, dk, dv, dout, out, lse, q, k, v, doc_start, B, T, H, KV, D);
}

void qt_be_attention_forward_cached(qt_backend *be, float *out, const float *q, const float *kc, const float *vc, int n,
                                    int pos0, int H, int KV, int D) {
    be->attention_forward_cached(be, out, q, kc, vc, n, pos0, H, KV, D);
}

void qt_be_swiglu_forward(qt_backend *be, float *out, const float *gate, const float *up, int N, int I) {
    be->swiglu_forward(be, out, gate, up, N, I);
}

void qt_be_swiglu_backward(qt_backend *be, float *dgate, float *dup, const float *dout, const float *gate,
                           const float *up, int N, int I) {
    be->swiglu_backward(be, dgate, dup, dout, gate, up, N, I);
}

void qt_be_lmhead_ce_forward(qt_backend *be, float *loss, float *lse, const float *x, const void *w, qt_dtype wdt,
                             const int32_t *targets, int N, int C, int V, float *ws) {
    be->lmhead_ce_forward(be, loss, lse, x, w, wdt, targets, N, C, V, ws);
}

void qt_be_lmhead_ce_backward(qt_backend *be, float *dx, float *dw, const float *x, const void *w, qt_dtype wdt,
                              const int32_t *targets, const float *lse, float dscale, int N, int C, int V, float *ws) {
    be->lmhead_ce_backward(be, dx, dw, x, w, wdt, targets, lse, dscale, N, C, V, ws);
}

void qt_be_lmhead_ce_forward_keep(qt_backend *be, float *loss, float *lse, float *kept, const float *x, const void *w,
                                  qt_dtype wdt, const int32_t *targets, int N, int C, int V, float *ws) {
    be->lmhead_ce_forward_keep(be, loss, lse, kept, x, w, wdt, targets, N, C, V, ws);
}

void qt_be_lmhead_ce_backward_kept(qt_backend *be, float *dx, float *dw, float *kept, const float *x, const void *w,
                                   qt_dtype wdt, const int32_t *targets, const float *lse, float dscale, int N, int C,
                                   int V, float *ws) {
    be->lmhead_ce_backward_kept(be, dx, dw, kept, x, w, wdt, targets, lse, dscale, N, C, V, ws);
}

void qt_be_lmhead_ce_forward_dx(qt_backend *be, float *loss, float *lse, float *dx, const float *x, const void *w,
                                qt_dtype wdt, const int32_t *targets, float dscale, int N, int C, int V, float *ws) {
    be->lmhead_ce_forward_dx(be, loss, lse, dx, x, w, wdt, targets, dscale, N, C, V, ws);
}

void qt_be_acc(qt_backend *be, float *out, const float *a, size_t n) {
    be->acc(be, out, a, n);
}

int qt_be_hold_threads(qt_backend *be, int (*fn)(void *arg), void *arg) {
    return be->hold_threads(be, fn, arg);
}

void qt_be_round_to_dtype(qt_backend *be, float *x, size_t n, qt_dtype dt) {
    be->round_to_dtype(be, x, n, dt);
}

void qt_be_round_store(qt_backend *be, float *x, uint16_t *dst, size_t n, qt_dtype dt) {
    be->round_store(be, x, dst, n, dt);
}

void qt_be_convert(qt_backend *be, void *dst, qt_dtype ddt, const void *src, qt_dtype sdt, size_t n) {
    be->convert(be, dst, ddt, src, sdt, n);
}

int qt_be_half_available(qt_backend *be, qt_dtype dt) {
    return be->half_available(be, dt);
}

int qt_be_half_matmul(qt_backend *be, qt_dtype dt, float *out, const uint16_t *inp, const uint16_t *w,
                      const float *bias, int N, int IN, int OUT, float alpha) {
    return be->half_matmul(be, dt, out, inp, w, bias, N, IN, OUT, alpha);
}

int qt_be_half_gemm(qt_backend *be, qt_dtype dt, float *C, const uint16_t *A, int ta, const uint16_t *B, int tb,
                    const float *bias, int M, int N, int K, float alpha, int acc) {
    return be->half_gemm(be, dt, C, A, ta, B, tb, bias, M, N, K, alpha, acc);
}

void qt_be_dropout(qt_backend *be, float *dst, const float *src, size_t n, const qt_dropout_key *key,
                   uint32_t threshold, float keep_scale) {
    be->dropout(be, dst, src, n, key, threshold, keep_scale);
}

int qt_be_adam(qt_backend *be, const qt_adam_scalars *k, float *p, const float *g, float *m, float *v, size_t n) {
    return be->adam(be, k, p, g, m, v, n);
}

double qt_be_sum_squares(qt_backend *be, const float *x, size_t n) {
    return be->sum_squares(be, x, n);
}

void qt_be_scale(qt_backend *be, float *x, size_t n, float s) {
    be->scale(be, x, n, s);
}

size_t qt_be_runtime_bytes(qt_backend *be) {
    return be->runtime_bytes(be);
}

size_t qt_be_device_peak_bytes(qt_backend *be) {
    return be->device_peak_bytes(be);
}

void qt_be_close(qt_backend *be) {
    be->close(be);
}
