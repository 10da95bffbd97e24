/* Embedding, RMSNorm, RoPE, SwiGLU, accumulation, dtype conversion and LoRA
 * dropout on the GPU: the arithmetic of backend/cpu's op files, one thread an
 * element (or a row, a column), on the backend's stream.
 *
 * Reductions into parameter gradients (the embedding table, the RMSNorm
 * weight) give each output column to one thread that walks the rows in
 * order: no atomics, so the bits are the same on every run. */
#include "backend/cuda/cuda_internal.h"

#include <string.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define BE qt_backend *be
#define STREAM (qt_cuda_of(be)->stream)
#define GRID_STRIDE(i, n) for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < (n); i += (size_t)gridDim.x * blockDim.x)

/* ---- dtype conversion (round to nearest even, as the CPU's F16C and bf16 code) */
__device__ __forceinline__ float load_as_f32(const void *p, qt_dtype dt, size_t i) {
    switch (dt) {
    case QT_BF16: return __bfloat162float(__ushort_as_bfloat16(((const unsigned short *)p)[i]));
    case QT_F16: return __half2float(__ushort_as_half(((const unsigned short *)p)[i]));
    default: return ((const float *)p)[i];
    }
}
__device__ __forceinline__ unsigned short f32_to_bits(float x, qt_dtype dt) {
    return dt == QT_BF16 ? __bfloat16_as_ushort(__float2bfloat16_rn(x)) : __half_as_ushort(__float2half_rn(x));
}
__device__ __forceinline__ float round_f32(float x, qt_dtype dt) {
    if (dt == QT_F32) return x;
    return dt == QT_BF16 ? __bfloat162float(__float2bfloat16_rn(x)) : __half2float(__float2half_rn(x));
}

__global__ void k_convert(void *dst, qt_dtype ddt, const void *src, qt_dtype sdt, size_t n) {
    GRID_STRIDE(i, n) {
        float x = load_as_f32(src, sdt, i);
        if (ddt == QT_F32) ((float *)dst)[i] = x;
        else ((unsigned short *)dst)[i] = f32_to_bits(x, ddt);
    }
}
void qt_cuda_convert(BE, void *dst, qt_dtype ddt, const void *src, qt_dtype sdt, size_t n) {
    if (!n) return;
    k_convert<<<qt_cuda_blocks(n), 256, 0, STREAM>>>(dst, ddt, src, sdt, n);
    QT_CUDA_LAUNCHED();
}

extern "C" const float *qt_cuda_weight_f32(qt_backend *be, const void *src, qt_dtype dt, size_t rows, size_t cols,
                                           float *ws) {
    if (dt == QT_F32) return (const float *)src;
    qt_cuda_convert(be, ws, QT_F32, src, dt, rows * cols);
    return ws;
}

__global__ void k_round(float *x, unsigned short *dst, size_t n, qt_dtype dt) {
    GRID_STRIDE(i, n) {
        float r = round_f32(x[i], dt);
        x[i] = r;
        if (dst) dst[i] = f32_to_bits(r, dt);
    }
}
void qt_cuda_round_to_dtype(BE, float *x, size_t n, qt_dtype dt) {
    if (!n || dt == QT_F32) return;
    k_round<<<qt_cuda_blocks(n), 256, 0, STREAM>>>(x, NULL, n, dt);
    QT_CUDA_LAUNCHED();
}
void qt_cuda_round_store(BE, float *x, uint16_t *dst, size_t n, qt_dtype dt) {
    if (!n) return;
    k_round<<<qt_cuda_blocks(n), 256, 0, STREAM>>>(x, (unsigned short *)dst, n, dt);
    QT_CUDA_LAUNCHED();
}

/* ---- embedding ------------------------------------------------------------ */
__global__ void k_embedding_fwd(float *out, const int32_t *ids, const void *wte, qt_dtype wdt, int N, int C) {
    size_t n_all = (size_t)N * C;
    GRID_STRIDE(i, n_all) {
        size_t n = i / C, c = i % C;
        out[i] = load_as_f32(wte, wdt, (size_t)ids[n] * C + c);
    }
}
void qt_cuda_embedding_forward(BE, float *out, const int32_t *ids, const void *wte, qt_dtype wdt, int N, int C) {
    k_embedding_fwd<<<qt_cuda_blocks((size_t)N * C), 256, 0, STREAM>>>(out, ids, wte, wdt, N, C);
    QT_CUDA_LAUNCHED();
}
/* a thread per column, rows in order: two rows may share a token id */
__global__ void k_embedding_bwd(float *dwte, const float *dout, const int32_t *ids, int N, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    for (int n = 0; n < N; n++) dwte[(size_t)ids[n] * C + c] += dout[(size_t)n * C + c];
}
void qt_cuda_embedding_backward(BE, float *dwte, const float *dout, const int32_t *ids, int N, int C) {
    k_embedding_bwd<<<(C + 255) / 256, 256, 0, STREAM>>>(dwte, dout, ids, N, C);
    QT_CUDA_LAUNCHED();
}

/* ---- RMSNorm: a block per row, a fixed-shape tree for the row's sums ------- */
__device__ float block_sum(float v, float *sh) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
    __syncthreads(); /* sh may still be read by a previous call */
    if (l == 0) sh[w] = v;
    __syncthreads();
    int nw = blockDim.x / 32;
    v = threadIdx.x < nw ? sh[threadIdx.x] : 0.0f;
    if (w == 0)
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x == 0) sh[0] = v;
    __syncthreads();
    return sh[0];
}

__global__ void k_rmsnorm_fwd(float *out, float *rstd, const float *inp, const float *w, int C, float eps) {
    __shared__ float sh[32];
    const float *x = inp + (size_t)blockIdx.x * C;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) ss += x[c] * x[c];
    ss = block_sum(ss, sh);
    float r = 1.0f / sqrtf(ss / (float)C + eps);
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
    float *o = out + (size_t)blockIdx.x * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) o[c] = w[c] * (x[c] * r);
}
void qt_cuda_rmsnorm_forward(BE, float *out, float *rstd, const float *inp, const float *w, int N, int C, float eps) {
    if (N <= 0) return;
    k_rmsnorm_fwd<<<N, 256, 0, STREAM>>>(out, rstd, inp, w, C, eps);
    QT_CUDA_LAUNCHED();
}
__global__ void k_rmsnorm_bwd_dx(float *dinp, const float *dout, const float *inp, const float *w, const float *rstd,
                                 int C) {
    __shared__ float sh[32];
    size_t o = (size_t)blockIdx.x * C;
    const float *x = inp + o, *g = dout + o;
    float r = rstd[blockIdx.x], dot = 0.0f;
    for (int c = threadIdx.x; c < C; c += blockDim.x) dot += w[c] * g[c] * x[c];
    dot = block_sum(dot, sh);
    float k = r * r * r * dot / (float)C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) dinp[o + c] += r * w[c] * g[c] - k * x[c];
}
/* pass 1 of dw: column c of run k, rows [k*per, (k+1)*per) in order */
__global__ void k_rmsnorm_bwd_dw(float *part, const float *dout, const float *inp, const float *rstd, int N, int C,
                                 int per) {
    int c = blockIdx.x * blockDim.x + threadIdx.x, k = blockIdx.y;
    if (c >= C) return;
    int n0 = k * per, n1 = n0 + per < N ? n0 + per : N;
    float acc = 0.0f;
    for (int n = n0; n < n1; n++) acc += dout[(size_t)n * C + c] * inp[(size_t)n * C + c] * rstd[n];
    part[(size_t)k * C + c] = acc;
}
void qt_cuda_rmsnorm_backward(BE, float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                               const float *rstd, int N, int C) {
    if (N <= 0) return;
    if (dinp) {
        k_rmsnorm_bwd_dx<<<N, 256, 0, STREAM>>>(dinp, dout, inp, w, rstd, C);
        QT_CUDA_LAUNCHED();
    }
    if (dw) {
        int per = QT_CUDA_ROWS_PER(N), nch = (N + per - 1) / per;
        float *part = qt_cuda_scratch(be, (size_t)nch * C);
        k_rmsnorm_bwd_dw<<<dim3((unsigned)(C + 255) / 256, (unsigned)nch), 256, 0, STREAM>>>(part, dout, inp, rstd,
                                                                                          N, C, per);
        QT_CUDA_LAUNCHED();
        qt_cuda_colsum_finish(be, dw, part, nch, C, 1.0f);
    }
}

/* ---- RoPE: the CPU's formula to the bit where the libm allows (the model's
 * fp32 inv_freq table, the angle an fp32 product, cos/sin in double, times
 * scale). The table (host memory) travels by value as a kernel parameter
 * (QT_ROPE_MAX_HALF floats, 2 KiB: under the 4 KiB parameter limit). ---- */
struct rope_table {
    float inv[QT_ROPE_MAX_HALF];
};
__global__ void k_rope(float *x, const int32_t *pos, int N, int NH, int D, const rope_table t, float scale,
                       float sign) {
    int half = D / 2;
    size_t n_all = (size_t)N * NH * half;
    GRID_STRIDE(idx, n_all) {
        int i = (int)(idx % half);
        size_t nh = idx / half;
        int n = (int)(nh / NH);
        float a = (float)pos[n] * t.inv[i];
        float cs = (float)cos((double)a) * scale, sn = sign * (float)sin((double)a) * scale;
        float *v = x + nh * D;
        float p = v[i], q = v[i + half];
        v[i] = p * cs - q * sn;
        v[i + half] = q * cs + p * sn;
    }
}
static void rope_launch(BE, float *x, const int32_t *pos, int N, int NH, int D, const float *inv, float scale,
                        float sign) {
    rope_table t;
    memset(&t, 0, sizeof t);
    memcpy(t.inv, inv, sizeof(float) * (size_t)(D / 2)); /* host to host: the launch carries it */
    k_rope<<<qt_cuda_blocks((size_t)N * NH * (D / 2)), 256, 0, STREAM>>>(x, pos, N, NH, D, t, scale, sign);
    QT_CUDA_LAUNCHED();
}
void qt_cuda_rope_forward(BE, float *x, const int32_t *pos, int N, int NH, int D, const float *inv, float scale) {
    rope_launch(be, x, pos, N, NH, D, inv, scale, 1.0f);
}
void qt_cuda_rope_backward(BE, float *dx, const int32_t *pos, int N, int NH, int D, const float *inv, float scale) {
    rope_launch(be, dx, pos, N, NH, D, inv, scale, -1.0f);
}

/* ---- SwiGLU (sigmoid 0 below -88.72, where the CPU's saturating exp stops) */
__device__ __forceinline__ float sigmoid_f(float g) {
    return g < -88.72283172607421875f ? 0.0f : 1.0f / (1.0f + expf(-g));
}
__global__ void k_swiglu_fwd(float *out, const float *gate, const float *up, size_t n) {
    GRID_STRIDE(i, n) {
        float g = gate[i];
        out[i] = g * sigmoid_f(g) * up[i];
    }
}
__global__ void k_swiglu_bwd(float *dgate, float *dup, const float *dout, const float *gate, const float *up,
                             size_t n) {
    GRID_STRIDE(i, n) {
        float g = gate[i], d = dout[i], s = sigmoid_f(g);
        dgate[i] += d * up[i] * s * (1.0f + g * (1.0f - s));
        dup[i] += d * g * s;
    }
}
void qt_cuda_swiglu_forward(BE, float *out, const float *gate, const float *up, int N, int I) {
    size_t n = (size_t)N * I;
    k_swiglu_fwd<<<qt_cuda_blocks(n), 256, 0, STREAM>>>(out, gate, up, n);
    QT_CUDA_LAUNCHED();
}
void qt_cuda_swiglu_backward(BE, float *dgate, float *dup, const float *dout, const float *gate, const float *up,
                              int N, int I) {
    size_t n = (size_t)N * I;
    k_swiglu_bwd<<<qt_cuda_blocks(n), 256, 0, STREAM>>>(dgate, dup, dout, gate, up, n);
    QT_CUDA_LAUNCHED();
}

/* ---- small passes ---------------------------------------------------------- */
__global__ void k_acc(float *out, const float *a, size_t n) {
    GRID_STRIDE(i, n) out[i] += a[i];
}
void qt_cuda_acc(BE, float *out, const float *a, size_t n) {
    if (!n) return;
    k_acc<<<qt_cuda_blocks(n), 256, 0, STREAM>>>(out, a, n);
    QT_CUDA_LAUNCHED();
}
__global__ void k_scale(float *x, size_t n, float s) {
    GRID_STRIDE(i, n) x[i] *= s;
}
void qt_cuda_scale(BE, float *x, size_t n, float s) {
    if (!n || s == 1.0f) return;
    k_scale<<<qt_cuda_blocks(n), 256, 0, STREAM>>>(x, n, s);
    QT_CUDA_LAUNCHED();
}
/* the mask is backend.h's qt_dropout_u24, the same function the CPU calls */
__global__ void k_dropout(float *dst, const float *src, size_t n, qt_dropout_key key, uint32_t threshold,
                          float keep_scale) {
    GRID_STRIDE(i, n) dst[i] = qt_dropout_u24(&key, i) < threshold ? 0.0f : src[i] * keep_scale;
}
void qt_cuda_dropout(BE, float *dst, const float *src, size_t n, const qt_dropout_key *key, uint32_t threshold,
                      float keep_scale) {
    if (!n) return;
    k_dropout<<<qt_cuda_blocks(n), 256, 0, STREAM>>>(dst, src, n, *key, threshold, keep_scale);
    QT_CUDA_LAUNCHED();
}
