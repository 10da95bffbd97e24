/* The lm_head fused with cross-entropy, over vocabulary chunks of
 * desc->ce_chunk rows: logits (N, cv) of one chunk exist at a time (cuBLAS
 * SGEMM into the workspace), an online log-sum-exp runs over the chunks, and
 * the backward recomputes each chunk's logits, turns them into dlogits in
 * place and runs the dx and dW products. Rows whose target is QT_IGNORE_INDEX carry no
 * loss and no gradient.
 *
 * Workspace (floats, within the descriptor's formula): logits (N, chunk),
 * the chunk's weight widened to fp32 (chunk, C) when it is stored in 2 bytes,
 * then per row the running max, sum and target logit.
 *
 * The "kept" forms keep each chunk's logits in the caller's (N, V) buffer
 * (the memory plan gives one when it fits), so the backward skips one GEMM
 * of the four; the bits are the recomputed ones (cuBLAS gives the same
 * result for the same product).
 *
 * The logits on the tensor cores: in 16-bit training x (the final norm's
 * output) holds values rounded to the compute dtype and the weight is stored
 * in it (docs/precision.md), so each logit is a sum of exact products of
 * 16-bit values. Each call checks that on the GPU (ce_x16: every x equal to
 * its rounding to the weight's dtype, one flag read back) and then runs the
 * logits GEMM as cublasGemmEx on the 16-bit x and weight, fp32 accumulation
 * and output: the same values as SGEMM, in another summation order. Where
 * any x is not exact (fp32 training over a bf16 base, eval) or the weight is
 * fp32, SGEMM as before.
 *
 * The dx and dW products on the tensor cores too, where the logits are
 * (x16), with QTUNE_CUDA_LMHEAD=all: dlogits (backward) and the softmax
 * numerators p (forward_dx) are rounded to the weight's dtype, a block of
 * rows at a time, into the weight chunk's workspace (which the 16-bit path
 * does not need for a widened weight), and multiplied with the 16-bit weight
 * rows (dx) and x16 (dW), fp32 accumulation into the fp32 dx and dW. This is
 * what PyTorch's autocast does: the lm_head's gradient reaches its matmul in
 * the compute dtype. It is the one rounding in this file that fp32 SGEMM
 * does not have (each dlogit within 2^-8 relative in bf16); the 1.5B profile
 * on the H200 had these two fp32 products at a third of the step. Opt-in
 * until it has run on a GPU (scripts/gpu-check with
 * GPU_CHECK_AB_ENV=QTUNE_CUDA_LMHEAD=all: the parity test's
 * check_lmhead_dl16, the training tests, the A/B benchmark); by default dx
 * and dW stay SGEMM on fp32 dlogits. QTUNE_CUDA_LMHEAD=fp32 keeps every
 * product of the lm_head on SGEMM. */
#include "backend/cuda/cuda_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define BE qt_backend *be
#define STREAM (qt_cuda_of(be)->stream)
#define BLAS (qt_cuda_of(be)->blas)

typedef struct {
    float *logits, *wf, *m, *l, *tl, *fac, *dxacc;
    int chunk;
} ce_ws;

/* within backend.h's qt_be_lmhead_ce_ws_floats: logits (N, chunk), weight
 * chunk (chunk, C), four per-row values, the dx accumulator (N, C) */
static ce_ws ce_ws_of(qt_backend *be, float *ws, int N, int C) {
    ce_ws w;
    w.chunk = be->desc->ce_chunk;
    w.logits = ws;
    w.wf = ws + (size_t)N * w.chunk;
    w.m = w.wf + (size_t)w.chunk * C;
    w.l = w.m + N;
    w.tl = w.l + N;
    w.fac = w.tl + N;
    w.dxacc = w.fac + N;
    return w;
}

/* the chunk's weight rows [c0, c0+cv) as fp32 (widened into w->wf when stored in 2 bytes) */
static const float *chunk_weight(qt_backend *be, const ce_ws *w, const void *wt, qt_dtype wdt, int c0, int cv, int C) {
    const char *src = (const char *)wt + (size_t)c0 * C * qt_cuda_dtype_size(wdt);
    return qt_cuda_weight_f32(be, src, wdt, (size_t)cv, (size_t)C, w->wf);
}
/* x (N, C) as 16-bit values of dt in the backend's scratch when every x is
 * one exactly, else NULL (module comment; ce_x16 below) */
__global__ void k_x16_exact(uint16_t *x16, int *inexact, const float *x, size_t n, qt_dtype dt) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float v = x[i], back;
        unsigned short h;
        if (dt == QT_BF16) {
            __nv_bfloat16 b = __float2bfloat16_rn(v);
            h = __bfloat16_as_ushort(b), back = __bfloat162float(b);
        } else {
            __half b = __float2half_rn(v);
            h = __half_as_ushort(b), back = __half2float(b);
        }
        x16[i] = h;
        if (!(back == v)) *inexact = 1; /* NaN too; any writer writes 1 */
    }
}
/* QTUNE_CUDA_LMHEAD, read once by each op call (a few per step, so one
 * process, the parity test, can compare the forms): LM_LOGITS unset (the
 * logits on the tensor cores where x16 holds), LM_ALL "all" (dx and dW
 * too), LM_FP32 "fp32" (none) */
enum { LM_LOGITS, LM_ALL, LM_FP32 };
static int lmhead_mode(void) {
    const char *e = getenv("QTUNE_CUDA_LMHEAD");
    return e && !strcmp(e, "fp32") ? LM_FP32 : e && !strcmp(e, "all") ? LM_ALL : LM_LOGITS;
}
static const uint16_t *ce_x16(qt_backend *be, const float *x, qt_dtype wdt, int N, int C, int mode) {
    if ((wdt != QT_BF16 && wdt != QT_F16) || mode == LM_FP32 || !be->half_available(be, wdt)) return NULL;
    size_t n = (size_t)N * C, halves = (n + 1) / 2;
    float *s = qt_cuda_scratch(be, halves + 1);
    uint16_t *x16 = (uint16_t *)s;
    int *flag = (int *)(s + halves), inexact = 1;
    QT_CUDA(cudaMemsetAsync(flag, 0, sizeof(int), STREAM));
    k_x16_exact<<<qt_cuda_blocks(n), 256, 0, STREAM>>>(x16, flag, x, n, wdt);
    QT_CUDA_LAUNCHED();
    QT_CUDA(cudaMemcpyAsync(&inexact, flag, sizeof(int), cudaMemcpyDeviceToHost, STREAM));
    QT_CUDA(cudaStreamSynchronize(STREAM));
    return inexact ? NULL : x16;
}

/* logits of chunk [c0, c0+cv) into dst (N, cv): on the tensor cores from x16
 * (ce_x16) and the 16-bit weight rows, else SGEMM on the widened chunk.
 * *wc_out: the chunk's weight as fp32 for the dx products when want_wc (else
 * it may be left NULL). */
static void chunk_logits(qt_backend *be, const ce_ws *w, const float *x, const uint16_t *x16, const void *wt,
                         qt_dtype wdt, int c0, int cv, int N, int C, const float **wc_out, int want_wc, float *dst) {
    const float one = 1.0f, zero = 0.0f;
    *wc_out = NULL;
    if (x16) { /* dst = x16 @ W_chunk^T: the 16-bit linear layers' product (op_matmul.cu) */
        const uint16_t *src = (const uint16_t *)wt + (size_t)c0 * C;
        be->half_matmul(be, wdt, dst, x16, src, NULL, N, C, cv, 1.0f);
        if (want_wc) *wc_out = chunk_weight(be, w, wt, wdt, c0, cv, C);
        return;
    }
    const float *Wc = chunk_weight(be, w, wt, wdt, c0, cv, C);
    QT_CUBLAS(cublasSgemm(BLAS, CUBLAS_OP_T, CUBLAS_OP_N, cv, N, C, &one, Wc, C, x, C, &zero, dst, cv));
    *wc_out = Wc;
}

/* dx (N, C) += g (N, cv) @ W16 rows [c0, c0+cv) and, with dw, dw rows
 * [c0, c0+cv) += g^T @ x16, with g rounded to wdt (module comment): a block
 * of rows of g at a time, as 16-bit values in the weight chunk's workspace
 * (chunk x C floats: at least 2 C rows of g per block). */
static void chunk_products16(qt_backend *be, const ce_ws *w, const float *g, const uint16_t *x16, const void *wt,
                             qt_dtype wdt, int c0, int cv, int N, int C, float *dx, float *dw) {
    const uint16_t *w16 = (const uint16_t *)wt + (size_t)c0 * C;
    uint16_t *g16 = (uint16_t *)w->wf;
    int rows = (int)((2 * (size_t)w->chunk * C) / (size_t)cv);
    if (rows > N) rows = N;
    for (int n0 = 0; n0 < N; n0 += rows) {
        int nb = N - n0 < rows ? N - n0 : rows;
        be->convert(be, g16, wdt, g + (size_t)n0 * cv, QT_F32, (size_t)nb * cv);
        if (dx && be->half_gemm(be, wdt, dx + (size_t)n0 * C, g16, 0, w16, 0, NULL, nb, C, cv, 1.0f, 1) != QT_OK)
            qt_cuda_fail("the lm_head's 16-bit dx product", "unsupported dtype", __FILE__, __LINE__);
        if (dw && be->half_gemm(be, wdt, dw + (size_t)c0 * C, g16, 1, x16 + (size_t)n0 * C, 0, NULL, cv, C, nb, 1.0f,
                                1) != QT_OK)
            qt_cuda_fail("the lm_head's 16-bit dW product", "unsupported dtype", __FILE__, __LINE__);
    }
}

__global__ void k_ce_init(float *m, float *l, float *tl, int N) {
    int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n < N) m[n] = -INFINITY, l[n] = 0.0f, tl[n] = 0.0f;
}

/* a block per row: fold one chunk of logits into the row's running max m
 * and sum l, and keep the target's raw logit in tl. KEEP_P (forward_dx in one
 * pass) also turns the chunk into p = exp(logit - m) in place against the new
 * max and writes fac = exp(m_old - m_new), the factor that rescales the
 * row's accumulator (k_scale_rows). */
template <bool KEEP_P>
__global__ void k_ce_chunk(float *logits, int cv, int c0, const int32_t *targets, float *m, float *l, float *tl,
                           float *fac) {
    __shared__ float red[32];
    __shared__ float bc;
    int n = blockIdx.x, t = targets[n];
    float *r = logits + (size_t)n * cv;
    float mx = -INFINITY;
    for (int j = threadIdx.x; j < cv; j += blockDim.x) {
        mx = fmaxf(mx, r[j]);
        if (c0 + j == t) tl[n] = r[j]; /* the raw logit, before KEEP_P makes it p below */
    }
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = mx;
    __syncthreads();
    if (threadIdx.x == 0) {
        float v = red[0];
        for (int i = 1; i < (int)blockDim.x / 32; i++) v = fmaxf(v, red[i]);
        bc = fmaxf(m[n], v);
    }
    __syncthreads();
    float mn = bc, s = 0.0f;
    for (int j = threadIdx.x; j < cv; j += blockDim.x) {
        float p = expf(r[j] - mn);
        if (KEEP_P) r[j] = p;
        s += p;
    }
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    __syncthreads();
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        float v = red[0];
        for (int i = 1; i < (int)blockDim.x / 32; i++) v += red[i];
        float f = expf(m[n] - mn); /* 0 on the first chunk (m = -inf) */
        if (KEEP_P) fac[n] = f;
        l[n] = l[n] * f + v;
        m[n] = mn;
    }
}

__global__ void k_ce_finish(float *loss, float *lse, const float *m, const float *l, const float *tl,
                            const int32_t *targets, int N) {
    int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    float L = m[n] + logf(l[n]);
    lse[n] = L;
    loss[n] = targets[n] != QT_IGNORE_INDEX ? L - tl[n] : 0.0f;
}

/* dlogits in place: dscale * (softmax - onehot) on labelled rows, else 0 */
__global__ void k_ce_grad(float *logits, int N, int cv, int c0, const int32_t *targets, const float *lse,
                          float dscale) {
    size_t n_all = (size_t)N * cv;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_all; i += (size_t)gridDim.x * blockDim.x) {
        int n = (int)(i / cv), j = (int)(i % cv), t = targets[n];
        logits[i] = t == QT_IGNORE_INDEX ? 0.0f : dscale * (expf(logits[i] - lse[n]) - (c0 + j == t ? 1.0f : 0.0f));
    }
}

/* kept (N * V floats, or NULL): each chunk's logits stay there, (N, cv) at
 * N * c0, for backward_kept to use instead of recomputing them */
static void ce_forward(BE, float *loss, float *lse, float *kept, const float *x, const void *w, qt_dtype wdt,
                       const int32_t *targets, int N, int C, int V, float *ws) {
    if (N <= 0) return;
    ce_ws s = ce_ws_of(be, ws, N, C);
    const uint16_t *x16 = ce_x16(be, x, wdt, N, C, lmhead_mode());
    k_ce_init<<<(N + 255) / 256, 256, 0, STREAM>>>(s.m, s.l, s.tl, N);
    QT_CUDA_LAUNCHED();
    for (int c0 = 0; c0 < V; c0 += s.chunk) {
        int cv = V - c0 < s.chunk ? V - c0 : s.chunk;
        const float *Wc;
        float *lg = kept ? kept + (size_t)N * c0 : s.logits;
        chunk_logits(be, &s, x, x16, w, wdt, c0, cv, N, C, &Wc, 0, lg);
        k_ce_chunk<false><<<N, 256, 0, STREAM>>>(lg, cv, c0, targets, s.m, s.l, s.tl, NULL);
        QT_CUDA_LAUNCHED();
    }
    k_ce_finish<<<(N + 255) / 256, 256, 0, STREAM>>>(loss, lse, s.m, s.l, s.tl, targets, N);
    QT_CUDA_LAUNCHED();
}

/* kept (or NULL): the forward's logits, turned into dlogits in place; else
 * each chunk's logits are recomputed into the workspace */
static void ce_backward(BE, float *dx, float *dw, float *kept, const float *x, const void *w, qt_dtype wdt,
                        const int32_t *targets, const float *lse, float dscale, int N, int C, int V, float *ws) {
    if (N <= 0) return;
    ce_ws s = ce_ws_of(be, ws, N, C);
    const float one = 1.0f;
    /* x16 for the logits when they are recomputed, and for the 16-bit dx and dW products (prod16) */
    const int mode = lmhead_mode();
    const uint16_t *x16 = kept && mode != LM_ALL ? NULL : ce_x16(be, x, wdt, N, C, mode);
    const int prod16 = x16 && mode == LM_ALL;
    for (int c0 = 0; c0 < V; c0 += s.chunk) {
        int cv = V - c0 < s.chunk ? V - c0 : s.chunk;
        const float *Wc = NULL;
        float *lg = kept ? kept + (size_t)N * c0 : s.logits;
        if (kept) {
            if (dx && !prod16) Wc = chunk_weight(be, &s, w, wdt, c0, cv, C);
        } else {
            chunk_logits(be, &s, x, x16, w, wdt, c0, cv, N, C, &Wc, dx != NULL && !prod16, lg);
        }
        k_ce_grad<<<qt_cuda_blocks((size_t)N * cv), 256, 0, STREAM>>>(lg, N, cv, c0, targets, lse, dscale);
        QT_CUDA_LAUNCHED();
        if (prod16) {
            chunk_products16(be, &s, lg, x16, w, wdt, c0, cv, N, C, dx, dw);
            continue;
        }
        if (dx) QT_CUBLAS(cublasSgemm(BLAS, CUBLAS_OP_N, CUBLAS_OP_N, C, N, cv, &one, Wc, C, lg, cv, &one, dx, C));
        if (dw)
            QT_CUBLAS(cublasSgemm(BLAS, CUBLAS_OP_N, CUBLAS_OP_T, C, cv, N, &one, x, C, lg, cv, &one,
                                  dw + (size_t)c0 * C, C));
    }
}
void qt_cuda_lmhead_ce_forward(BE, float *loss, float *lse, const float *x, const void *w, qt_dtype wdt,
                         const int32_t *targets, int N, int C, int V, float *ws) {
    ce_forward(be, loss, lse, NULL, x, w, wdt, targets, N, C, V, ws);
}
void qt_cuda_lmhead_ce_backward(BE, float *dx, float *dw, const float *x, const void *w, qt_dtype wdt,
                          const int32_t *targets, const float *lse, float dscale, int N, int C, int V, float *ws) {
    ce_backward(be, dx, dw, NULL, x, w, wdt, targets, lse, dscale, N, C, V, ws);
}

void qt_cuda_lmhead_ce_forward_keep(BE, float *loss, float *lse, float *kept, const float *x, const void *w, qt_dtype wdt,
                              const int32_t *targets, int N, int C, int V, float *ws) {
    ce_forward(be, loss, lse, kept, x, w, wdt, targets, N, C, V, ws);
}
void qt_cuda_lmhead_ce_backward_kept(BE, float *dx, float *dw, float *kept, const float *x, const void *w, qt_dtype wdt,
                               const int32_t *targets, const float *lse, float dscale, int N, int C, int V,
                               float *ws) {
    ce_backward(be, dx, dw, kept, x, w, wdt, targets, lse, dscale, N, C, V, ws);
}
/* forward_dx in one pass over the vocabulary (as the CPU's): a chunk's
 * logits become p = exp(logit - m) in place against the row's running max m,
 * the accumulator dxacc = sum of p W rows is rescaled by exp(m_old - m_new)
 * whenever m grows, and at the end dx += dscale (dxacc / l - W[target]). One
 * GEMM fewer than forward then backward, and no second widening of the
 * chunk's weight. Its kernels: k_ce_chunk<true> above, k_scale_rows and
 * those below. */
__global__ void k_scale_rows(float *x, const float *fac, int N, int C) {
    size_t n_all = (size_t)N * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_all; i += (size_t)gridDim.x * blockDim.x)
        x[i] *= fac[i / C];
}
__device__ __forceinline__ float ce_weight_at(const void *w, qt_dtype wdt, size_t i) {
    if (wdt == QT_BF16) return __bfloat162float(__ushort_as_bfloat16(((const unsigned short *)w)[i]));
    if (wdt == QT_F16) return __half2float(__ushort_as_half(((const unsigned short *)w)[i]));
    return ((const float *)w)[i];
}
__global__ void k_ce_dx_final(float *dx, const float *dxacc, const float *l, const void *w, qt_dtype wdt,
                              const int32_t *targets, float dscale, int N, int C) {
    size_t n_all = (size_t)N * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_all; i += (size_t)gridDim.x * blockDim.x) {
        int n = (int)(i / C), c = (int)(i % C), t = targets[n];
        if (t == QT_IGNORE_INDEX) continue;
        dx[i] += dscale * (dxacc[i] / l[n] - ce_weight_at(w, wdt, (size_t)t * C + c));
    }
}

void qt_cuda_lmhead_ce_forward_dx(BE, float *loss, float *lse, float *dx, const float *x, const void *w, qt_dtype wdt,
                            const int32_t *targets, float dscale, int N, int C, int V, float *ws) {
    if (N <= 0) return;
    ce_ws s = ce_ws_of(be, ws, N, C);
    const float one = 1.0f;
    const int mode = lmhead_mode();
    const uint16_t *x16 = ce_x16(be, x, wdt, N, C, mode);
    const int prod16 = x16 && mode == LM_ALL;
    k_ce_init<<<(N + 255) / 256, 256, 0, STREAM>>>(s.m, s.l, s.tl, N);
    QT_CUDA_LAUNCHED();
    QT_CUDA(cudaMemsetAsync(s.dxacc, 0, sizeof(float) * (size_t)N * C, STREAM));
    for (int c0 = 0; c0 < V; c0 += s.chunk) {
        int cv = V - c0 < s.chunk ? V - c0 : s.chunk;
        const float *Wc;
        chunk_logits(be, &s, x, x16, w, wdt, c0, cv, N, C, &Wc, !prod16, s.logits);
        k_ce_chunk<true><<<N, 256, 0, STREAM>>>(s.logits, cv, c0, targets, s.m, s.l, s.tl, s.fac);
        QT_CUDA_LAUNCHED();
        if (c0 > 0) {
            k_scale_rows<<<qt_cuda_blocks((size_t)N * C), 256, 0, STREAM>>>(s.dxacc, s.fac, N, C);
            QT_CUDA_LAUNCHED();
        }
        if (prod16) { /* p rounded to 16 bits: dxacc += p16 @ W16 */
            chunk_products16(be, &s, s.logits, x16, w, wdt, c0, cv, N, C, s.dxacc, NULL);
            continue;
        }
        QT_CUBLAS(cublasSgemm(BLAS, CUBLAS_OP_N, CUBLAS_OP_N, C, N, cv, &one, Wc, C, s.logits, cv, &one, s.dxacc, C));
    }
    k_ce_finish<<<(N + 255) / 256, 256, 0, STREAM>>>(loss, lse, s.m, s.l, s.tl, targets, N);
    QT_CUDA_LAUNCHED();
    k_ce_dx_final<<<qt_cuda_blocks((size_t)N * C), 256, 0, STREAM>>>(dx, s.dxacc, s.l, w, wdt, targets, dscale, N, C);
    QT_CUDA_LAUNCHED();
}
