/* The CUDA module's entries, one per slot of backend.h's table, each named
 * qt_cuda_<slot>: defined one op family a file (memory.cu, op_*.cu,
 * backend_cuda.cu's close), gathered into the one table in table.c. Plain C
 * declarations, so table.c is C and the .cu files define them extern "C". */
#ifndef QT_BACKEND_CUDA_OPS_H
#define QT_BACKEND_CUDA_OPS_H

#ifdef __cplusplus
extern "C" {
#endif
#include "backend/backend.h"

/* memory.cu */
void *qt_cuda_alloc(qt_backend *be, qt_mem_place place, size_t bytes, const char *what);
void qt_cuda_free(qt_backend *be, void *p);
int qt_cuda_import_mapped(qt_backend *be, const void *host, size_t bytes, const void **dev, const char *what);
void qt_cuda_release_mapped(qt_backend *be, const void *dev);
void qt_cuda_upload(qt_backend *be, void *dev, const void *host, size_t bytes);
void qt_cuda_download(qt_backend *be, void *host, const void *dev, size_t bytes);
void qt_cuda_copy(qt_backend *be, void *dst, const void *src, size_t bytes);
void qt_cuda_zero(qt_backend *be, void *dev, size_t bytes);
void qt_cuda_sync(qt_backend *be);
qt_event *qt_cuda_event_record(qt_backend *be);
void qt_cuda_event_wait(qt_backend *be, qt_event *e);
void qt_cuda_event_free(qt_backend *be, qt_event *e);
size_t qt_cuda_runtime_bytes(qt_backend *be);
size_t qt_cuda_device_peak_bytes(qt_backend *be);
int qt_cuda_hold_threads(qt_backend *be, int (*fn)(void *arg), void *arg);
/* op_elementwise.cu */
void qt_cuda_embedding_forward(qt_backend *be, float *out, const int32_t *ids, const void *wte, qt_dtype wdt, int N,
    int C);
void qt_cuda_embedding_backward(qt_backend *be, float *dwte, const float *dout, const int32_t *ids, int N, int C);
void qt_cuda_rmsnorm_forward(qt_backend *be, float *out, float *rstd, const float *inp, const float *weight, int N,
    int C, float eps);
void qt_cuda_rmsnorm_backward(qt_backend *be, float *dinp, float *dweight, const float *dout, const float *inp,
    const float *weight, const float *rstd, int N, int C);
void qt_cuda_rope_forward(qt_backend *be, float *x, const int32_t *pos, int N, int NH, int D, const float *inv_freq,
    float scale);
void qt_cuda_rope_backward(qt_backend *be, float *dx, const int32_t *pos, int N, int NH, int D, const float *inv_freq,
    float scale);
void qt_cuda_swiglu_forward(qt_backend *be, float *out, const float *gate, const float *up, int N, int I);
void qt_cuda_swiglu_backward(qt_backend *be, float *dgate, float *dup, const float *dout, const float *gate,
    const float *up, int N, int I);
void qt_cuda_acc(qt_backend *be, float *out, const float *a, size_t n);
void qt_cuda_scale(qt_backend *be, float *x, size_t n, float s);
void qt_cuda_dropout(qt_backend *be, float *dst, const float *src, size_t n, const qt_dropout_key *key,
    uint32_t threshold, float keep_scale);
void qt_cuda_round_to_dtype(qt_backend *be, float *x, size_t n, qt_dtype dt);
void qt_cuda_round_store(qt_backend *be, float *x, uint16_t *dst, size_t n, qt_dtype dt);
void qt_cuda_convert(qt_backend *be, void *dst, qt_dtype ddt, const void *src, qt_dtype sdt, size_t n);
/* op_matmul.cu */
void qt_cuda_matmul_forward(qt_backend *be, float *out, const float *inp, const void *w, qt_dtype wdt,
    const float *bias, int N, int IN, int OUT, float alpha, int accumulate, float *ws);
void qt_cuda_matmul_backward(qt_backend *be, float *dinp, float *dweight, float *dbias, const float *dout,
    const float *inp, const void *w, qt_dtype wdt, int N, int IN, int OUT, float alpha, float *ws);
void qt_cuda_matvec(qt_backend *be, float *out, const float *x, const void *w, qt_dtype wdt, const float *bias, int N,
    int IN, int OUT, float alpha, int accumulate);
void qt_cuda_matvec_many(qt_backend *be, const float *x, int N, int IN, int count, const qt_matvec_out *o);
int qt_cuda_half_available(qt_backend *be, qt_dtype dt);
int qt_cuda_half_matmul(qt_backend *be, qt_dtype dt, float *out, const uint16_t *inp, const uint16_t *w,
    const float *bias, int N, int IN, int OUT, float alpha);
int qt_cuda_half_gemm(qt_backend *be, qt_dtype dt, float *C, const uint16_t *A, int ta, const uint16_t *B, int tb,
    const float *bias, int M, int N, int K, float alpha, int acc);
/* op_attention.cu */
void qt_cuda_attention_forward(qt_backend *be, float *out, float *lse, const float *q, const float *k, const float *v,
    const int32_t *doc_start, int B, int T, int H, int KV, int D);
void qt_cuda_attention_backward(qt_backend *be, float *dq, float *dk, float *dv, const float *dout, const float *out,
    const float *lse, const float *q, const float *k, const float *v, const int32_t *doc_start, int B, int T, int H,
    int KV, int D);
void qt_cuda_attention_forward_cached(qt_backend *be, float *out, const float *q, const float *kc, const float *vc,
    int n, int pos0, int H, int KV, int D);
/* op_lmhead_ce.cu */
void qt_cuda_lmhead_ce_forward(qt_backend *be, float *loss, float *lse, const float *x, const void *w, qt_dtype wdt,
    const int32_t *targets, int N, int C, int V, float *ws);
void qt_cuda_lmhead_ce_backward(qt_backend *be, float *dx, float *dw, const float *x, const void *w, qt_dtype wdt,
    const int32_t *targets, const float *lse, float dscale, int N, int C, int V, float *ws);
void qt_cuda_lmhead_ce_forward_keep(qt_backend *be, float *loss, float *lse, float *kept, const float *x,
    const void *w, qt_dtype wdt, const int32_t *targets, int N, int C, int V, float *ws);
void qt_cuda_lmhead_ce_backward_kept(qt_backend *be, float *dx, float *dw, float *kept, const float *x, const void *w,
    qt_dtype wdt, const int32_t *targets, const float *lse, float dscale, int N, int C, int V, float *ws);
void qt_cuda_lmhead_ce_forward_dx(qt_backend *be, float *loss, float *lse, float *dx, const float *x, const void *w,
    qt_dtype wdt, const int32_t *targets, float dscale, int N, int C, int V, float *ws);
/* op_optim.cu */
int qt_cuda_adam(qt_backend *be, const qt_adam_scalars *k, float *p, const float *g, float *m, float *v, size_t n);
double qt_cuda_sum_squares(qt_backend *be, const float *x, size_t n);
/* backend_cuda.cu */
void qt_cuda_close(qt_backend *be);

/* The table (table.c): every slot but desc, which the host hands the module
 * at open (desc.c's descriptor, readable without the module). Exported, so a
 * test walks it with dlsym on a machine without a GPU. */
extern const qt_backend qt_cuda_backend_i;

#ifdef __cplusplus
}
#endif
#endif
