/* The CPU backend: backend.h's table over the op_* kernels of this folder.
 * Device memory is host memory (64-byte aligned), so upload, download and
 * copy are memcpy and a mapped file is read where it lies. */
#include "backend/cpu/backend_cpu.h"

#include <stdlib.h>
#include <string.h>

#include "backend/backend_impl.h"
#include "backend/cpu/op_dnnl.h"
#include "backend/cpu/op_precision.h"
#include "backend/cpu/ops.h"
#include "core/error.h"
#include "core/mem.h"

/* runtime_bytes: the peak RSS of qtune train less its planned blocks, with
 * every product on OpenBLAS; runtime_extra: what oneDNN's pages and JIT
 * kernels add while op_sgemm_nn runs on it (measured on the shapes of
 * tests/tools/test_plan.py, which holds the plan to the measured peak; the
 * figures are in bench/RESULTS.md). */
const qt_backend_desc qt_cpu_desc = {
    .name = "cpu",
    .alignment = 64,
    .native_dtypes = QT_BE_DT(QT_F32),
    .ce_chunk = OP_CE_CHUNK,
    .matmul_ws_cap = OP_MATMUL_WS_CAP,
    .runtime_bytes = (size_t)6 << 20,
    .runtime_extra = (size_t)10 << 20,
    .blas_thread_vm = QT_CPU_BLAS_THREAD_VM,
    .host_reads_device = 1,
};

static void *c_alloc(qt_backend *be, qt_mem_place place, size_t bytes, const char *what) {
    (void)be;
    if (place == QT_MEM_DEVICE_SPARSE) return qt_alloc_sparse(bytes ? bytes : 64, what);
    return qt_alloc_aligned(bytes ? bytes : 64, what);
}
static void c_free(qt_backend *be, void *p) { (void)be, qt_free(p); }
static int c_import_mapped(qt_backend *be, const void *host, size_t bytes, const void **dev, const char *what) {
    (void)be, (void)bytes, (void)what;
    *dev = host;
    return QT_OK;
}
static void c_release_mapped(qt_backend *be, const void *dev) { (void)be, (void)dev; }
static void c_copy(qt_backend *be, void *dst, const void *src, size_t bytes) {
    (void)be;
    if (bytes) memmove(dst, src, bytes);
}
static void c_zero(qt_backend *be, void *dst, size_t bytes) {
    (void)be;
    if (bytes % sizeof(float) == 0) qt_zero_floats(dst, bytes / sizeof(float)); /* in parallel when large */
    else memset(dst, 0, bytes);
}
static void c_sync(qt_backend *be) { (void)be; }
/* every call has finished when it returns: an event is a token */
static qt_event *c_event_record(qt_backend *be) { return (qt_event *)be; }
static void c_event_wait(qt_backend *be, qt_event *e) { (void)be, (void)e; }
static void c_event_free(qt_backend *be, qt_event *e) { (void)be, (void)e; }

#define BE qt_backend *be
static void c_embedding_forward(BE, float *out, const int32_t *ids, const void *wte, qt_dtype wdt, int N, int C) {
    op_embedding_forward(out, ids, wte, wdt, N, C);
}
static void c_embedding_backward(BE, float *dwte, const float *dout, const int32_t *ids, int N, int C) {
    op_embedding_backward(dwte, dout, ids, N, C);
}
static void c_rmsnorm_forward(BE, float *out, float *rstd, const float *inp, const float *w, int N, int C, float eps) {
    op_rmsnorm_forward(out, rstd, inp, w, N, C, eps);
}
static void c_rmsnorm_backward(BE, float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                               const float *rstd, int N, int C) {
    op_rmsnorm_backward(dinp, dw, dout, inp, w, rstd, N, C);
}
static void c_matvec(BE, float *out, const float *x, const void *w, qt_dtype wdt, const float *bias, int N, int IN,
                     int OUT, float alpha, int accumulate) {
    op_matvec_team(be->impl, out, x, w, wdt, bias, N, IN, OUT, alpha, accumulate);
}
static void c_matvec_many(BE, const float *x, int N, int IN, int count, const qt_matvec_out *o) {
    op_matvec_many(be->impl, x, N, IN, count, o);
}
static void c_matmul_forward(BE, float *out, const float *inp, const void *w, qt_dtype wdt, const float *bias, int N,
                             int IN, int OUT, float alpha, int accumulate, float *ws) {
    op_matmul_forward(out, inp, w, wdt, bias, N, IN, OUT, alpha, accumulate, ws);
}
static void c_matmul_backward(BE, float *dinp, float *dw, float *db, const float *dout, const float *inp,
                              const void *w, qt_dtype wdt, int N, int IN, int OUT, float alpha, float *ws) {
    op_matmul_backward(dinp, dw, db, dout, inp, w, wdt, N, IN, OUT, alpha, ws);
}
static void c_rope_forward(BE, float *x, const int32_t *pos, int N, int NH, int D, const float *inv, float scale) {
    op_rope_forward(x, pos, N, NH, D, inv, scale);
}
static void c_rope_backward(BE, float *dx, const int32_t *pos, int N, int NH, int D, const float *inv, float scale) {
    op_rope_backward(dx, pos, N, NH, D, inv, scale);
}
static void c_attention_forward(BE, float *out, float *lse, const float *q, const float *k, const float *v,
                                const int32_t *doc_start, int B, int T, int H, int KV, int D) {
    op_attention_forward(out, lse, q, k, v, doc_start, B, T, H, KV, D);
}
static void c_attention_backward(BE, float *dq, float *dk, float *dv, const float *dout, const float *out,
                                 const float *lse, const float *q, const float *k, const float *v,
                                 const int32_t *doc_start, int B, int T, int H, int KV, int D) {
    op_attention_backward(dq, dk, dv, dout, out, lse, q, k, v, doc_start, B, T, H, KV, D);
}
static void c_attention_forward_cached(BE, float *out, const float *q, const float *kc, const float *vc, int n,
                                       int pos0, int H, int KV, int D) {
    op_attention_forward_cached_team(be->impl, out, q, kc, vc, n, pos0, H, KV, D);
}
static void c_swiglu_forward(BE, float *out, const float *gate, const float *up, int N, int I) {
    op_swiglu_forward(out, gate, up, N, I);
}
static void c_swiglu_backward(BE, float *dgate, float *dup, const float *dout, const float *gate, const float *up,
                              int N, int I) {
    op_swiglu_backward(dgate, dup, dout, gate, up, N, I);
}
static void c_lmhead_ce_forward(BE, float *loss, float *lse, const float *x, const void *w, qt_dtype wdt,
                                const int32_t *targets, int N, int C, int V, float *ws) {
    op_lmhead_ce_forward(loss, lse, x, w, wdt, targets, N, C, V, ws);
}
static void c_lmhead_ce_backward(BE, float *dx, float *dw, const float *x, const void *w, qt_dtype wdt,
                                 const int32_t *targets, const float *lse, float dscale, int N, int C, int V,
                                 float *ws) {
    op_lmhead_ce_backward(dx, dw, x, w, wdt, targets, lse, dscale, N, C, V, ws);
}
static void c_lmhead_ce_forward_keep(BE, float *loss, float *lse, float *kept, const float *x, const void *w,
                                     qt_dtype wdt, const int32_t *targets, int N, int C, int V, float *ws) {
    op_lmhead_ce_forward_keep(loss, lse, kept, x, w, wdt, targets, N, C, V, ws);
}
static void c_lmhead_ce_backward_kept(BE, float *dx, float *dw, float *kept, const float *x, const void *w,
                                      qt_dtype wdt, const int32_t *targets, const float *lse, float dscale, int N,
                                      int C, int V, float *ws) {
    op_lmhead_ce_backward_kept(dx, dw, kept, x, w, wdt, targets, lse, dscale, N, C, V, ws);
}
static void c_lmhead_ce_forward_dx(BE, float *loss, float *lse, float *dx, const float *x, const void *w,
                                   qt_dtype wdt, const int32_t *targets, float dscale, int N, int C, int V,
                                   float *ws) {
    op_lmhead_ce_forward_dx(loss, lse, dx, x, w, wdt, targets, dscale, N, C, V, ws);
}
static void c_acc(BE, float *out, const float *a, size_t n) { op_acc(out, a, n); }
/* be->impl is the held team while fn runs (NULL otherwise): the ops that use it read it there */
typedef struct {
    qt_backend *be;
    int (*fn)(void *arg);
    void *arg;
} held_call;
static int c_held(op_team *team, void *p) {
    held_call *h = p;
    h->be->impl = team;
    int rc = h->fn(h->arg);
    h->be->impl = NULL;
    return rc;
}
static int c_hold_threads(BE, int (*fn)(void *arg), void *arg) {
    if (be->impl) return fn(arg); /* already held */
    held_call h = {be, fn, arg};
    return op_team_hold(c_held, &h);
}
static void c_round_to_dtype(BE, float *x, size_t n, qt_dtype dt) { op_round_to_dtype(x, n, dt); }
static void c_round_store(BE, float *x, uint16_t *dst, size_t n, qt_dtype dt) { op_round_store(x, dst, n, dt); }
static void c_convert(BE, void *dst, qt_dtype ddt, const void *src, qt_dtype sdt, size_t n) {
    op_convert(dst, ddt, src, sdt, n);
}
static int c_half_available(BE, qt_dtype dt) { return dt == QT_BF16 && op_dnnl_bf16_available(); }
static int c_half_matmul(BE, qt_dtype dt, float *out, const uint16_t *inp, const uint16_t *w, const float *bias, int N,
                         int IN, int OUT, float alpha) {
    if (dt != QT_BF16) return QT_EUNSUPPORTED; /* no f16 GEMM on these CPUs (oneDNN wants AVX512-FP16) */
    return op_dnnl_bf16_matmul(out, inp, w, bias, N, IN, OUT, alpha);
}
static int c_half_gemm(BE, qt_dtype dt, float *C, const uint16_t *A, int ta, const uint16_t *B, int tb,
                       const float *bias, int M, int N, int K, float alpha, int acc) {
    if (dt != QT_BF16) return QT_EUNSUPPORTED;
    return op_dnnl_bf16_gemm(C, A, ta, B, tb, bias, M, N, K, alpha, acc);
}
static void c_dropout(BE, float *dst, const float *src, size_t n, const qt_dropout_key *key, uint32_t threshold,
                      float keep_scale) {
    op_dropout(dst, src, n, key, threshold, keep_scale);
}
static int c_adam(BE, const qt_adam_scalars *k, float *p, const float *g, float *m, float *v, size_t n) {
    return op_adam(k, p, g, m, v, n);
}
static double c_sum_squares(BE, const float *x, size_t n) { return op_sum_squares(x, n); }
static void c_scale(BE, float *x, size_t n, float s) { op_scale(x, n, s); }
static size_t c_device_peak_bytes(BE) {
    (void)be;
    return 0;
}
size_t qt_cpu_runtime_bytes(void) {
    return qt_cpu_desc.runtime_bytes + (op_sgemm_onednn() ? qt_cpu_desc.runtime_extra : 0);
}
static size_t c_runtime_bytes(BE) {
    (void)be;
    return qt_cpu_runtime_bytes();
}
static void c_close(BE) { qt_free(be); } /* the instance qt_backend_open allocated */
#undef BE

/* The table the registry copies into each instance it opens (backend_impl.h). */
const qt_backend qt_backend_cpu_i = {
    .desc = &qt_cpu_desc,
    .alloc = c_alloc,
    .free = c_free,
    .import_mapped = c_import_mapped,
    .release_mapped = c_release_mapped,
    .upload = c_copy,
    .download = c_copy,
    .copy = c_copy,
    .zero = c_zero,
    .sync = c_sync,
    .event_record = c_event_record,
    .event_wait = c_event_wait,
    .event_free = c_event_free,
    .embedding_forward = c_embedding_forward,
    .embedding_backward = c_embedding_backward,
    .rmsnorm_forward = c_rmsnorm_forward,
    .rmsnorm_backward = c_rmsnorm_backward,
    .matmul_forward = c_matmul_forward,
    .matmul_backward = c_matmul_backward,
    .matvec = c_matvec,
    .matvec_many = c_matvec_many,
    .rope_forward = c_rope_forward,
    .rope_backward = c_rope_backward,
    .attention_forward = c_attention_forward,
    .attention_backward = c_attention_backward,
    .attention_forward_cached = c_attention_forward_cached,
    .swiglu_forward = c_swiglu_forward,
    .swiglu_backward = c_swiglu_backward,
    .lmhead_ce_forward = c_lmhead_ce_forward,
    .lmhead_ce_backward = c_lmhead_ce_backward,
    .lmhead_ce_forward_keep = c_lmhead_ce_forward_keep,
    .lmhead_ce_backward_kept = c_lmhead_ce_backward_kept,
    .lmhead_ce_forward_dx = c_lmhead_ce_forward_dx,
    .acc = c_acc,
    .hold_threads = c_hold_threads,
    .round_to_dtype = c_round_to_dtype,
    .round_store = c_round_store,
    .convert = c_convert,
    .half_available = c_half_available,
    .half_matmul = c_half_matmul,
    .half_gemm = c_half_gemm,
    .dropout = c_dropout,
    .adam = c_adam,
    .sum_squares = c_sum_squares,
    .scale = c_scale,
    .runtime_bytes = c_runtime_bytes,
    .device_peak_bytes = c_device_peak_bytes,
    .close = c_close,
};
