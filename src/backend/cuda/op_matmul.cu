/* The linear layers on cuBLAS. Row-major (N, IN) activations and (OUT, IN)
 * weights are read by cuBLAS as the column-major transposes they are, so
 * every product below is the CPU's (op_matmul.c) with the operands swapped:
 *   out (N, OUT)   = inp @ W^T    ->  out^T  = W'^T(IN, OUT) ... cublas(T, N)
 *   dinp (N, IN)  += dout @ W     ->  dinp^T = W' dout^T     ... cublas(N, N)
 *   dW (OUT, IN)  += dout^T @ inp ->  dW^T   = inp^T dout    ... cublas(N, T)
 * fp32 weights and activations run as fp32 SGEMM (no TF32: the reference
 * path); a bf16/f16 frozen weight is widened to fp32 in the workspace first,
 * and a 4-bit one (QT_Q4, QLoRA's frozen base) dequantized there by
 * quant4_kernels.cuh: the CPU's values bit for bit, then the same SGEMM.
 * The 16-bit forms (half_matmul, half_gemm: bf16 or f16 operands) run on the
 * tensor cores with fp32 accumulation (cublasGemmEx, CUBLAS_COMPUTE_32F). */
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/quant4_kernels.cuh"


#define BE qt_backend *be
#define STREAM (qt_cuda_of(be)->stream)
#define BLAS (qt_cuda_of(be)->blas)

/* out (N, OUT) += bias, each row */
__global__ void k_add_bias(float *out, const float *bias, int N, int OUT) {
    size_t n_all = (size_t)N * OUT;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_all; i += (size_t)gridDim.x * blockDim.x)
        out[i] += bias[i % OUT];
}
static void add_bias(BE, float *out, const float *bias, int N, int OUT) {
    k_add_bias<<<qt_cuda_blocks((size_t)N * OUT), 256, 0, STREAM>>>(out, bias, N, OUT);
    QT_CUDA_LAUNCHED();
}
/* dbias (OUT) += alpha * column sums of dout (N, OUT), pass 1: column c of
 * run k (cuda_internal.h's two-pass column sums; no atomics) */
__global__ void k_colsum(float *part, const float *dout, int N, int OUT, int per) {
    int c = blockIdx.x * blockDim.x + threadIdx.x, k = blockIdx.y;
    if (c >= OUT) return;
    int n0 = k * per, n1 = n0 + per < N ? n0 + per : N;
    float acc = 0.0f;
    for (int n = n0; n < n1; n++) acc += dout[(size_t)n * OUT + c];
    part[(size_t)k * OUT + c] = acc;
}

/* W (rows, cols) as f32: itself, widened, or dequantized into ws (the
 * workspace holds a whole weight on this backend: desc.c's matmul_ws_cap) */
static const float *weight_f32(BE, const void *w, qt_dtype wdt, size_t rows, size_t cols, float *ws) {
    if (wdt != QT_Q4) return qt_cuda_weight_f32(be, w, wdt, rows, cols, ws);
    const size_t n = rows * cols;
    k_q4_dequantize<<<qt_cuda_blocks(n), 256, 0, STREAM>>>(ws, (const qt_q4_weight *)w, n);
    QT_CUDA_LAUNCHED();
    return ws;
}

void qt_cuda_matmul_forward(BE, float *out, const float *inp, const void *w, qt_dtype wdt, const float *bias, int N,
                             int IN, int OUT, float alpha, int accumulate, float *ws) {
    if (N <= 0) return;
    const float *W = weight_f32(be, w, wdt, (size_t)OUT, (size_t)IN, ws);
    float beta = accumulate ? 1.0f : 0.0f;
    QT_CUBLAS(cublasSgemm(BLAS, CUBLAS_OP_T, CUBLAS_OP_N, OUT, N, IN, &alpha, W, IN, inp, IN, &beta, out, OUT));
    if (bias) add_bias(be, out, bias, N, OUT);
}

void qt_cuda_matmul_backward(BE, float *dinp, float *dw, float *db, const float *dout, const float *inp,
                              const void *w, qt_dtype wdt, int N, int IN, int OUT, float alpha, float *ws) {
    if (N <= 0) return;
    const float one = 1.0f;
    if (dinp) {
        const float *W = weight_f32(be, w, wdt, (size_t)OUT, (size_t)IN, ws);
        QT_CUBLAS(cublasSgemm(BLAS, CUBLAS_OP_N, CUBLAS_OP_N, IN, N, OUT, &alpha, W, IN, dout, OUT, &one, dinp, IN));
    }
    if (dw)
        QT_CUBLAS(cublasSgemm(BLAS, CUBLAS_OP_N, CUBLAS_OP_T, IN, OUT, N, &alpha, inp, IN, dout, OUT, &one, dw, IN));
    if (db) {
        int per = QT_CUDA_ROWS_PER(N), nch = (N + per - 1) / per;
        float *part = qt_cuda_scratch(be, (size_t)nch * OUT);
        k_colsum<<<dim3((unsigned)(OUT + 255) / 256, (unsigned)nch), 256, 0, STREAM>>>(part, dout, N, OUT, per);
        QT_CUDA_LAUNCHED();
        qt_cuda_colsum_finish(be, db, part, nch, OUT, alpha);
    }
}

/* bf16 GEMMs need compute capability 8.0 (Ampere) or newer, f16 ones 7.0 (Volta) */
int qt_cuda_half_available(BE, qt_dtype dt) {
    int major = 0; /* one attribute, not cudaGetDeviceProperties: the lm_head asks at every call */
    if (dt != QT_BF16 && dt != QT_F16) return 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, qt_cuda_of(be)->device) != cudaSuccess)
        return 0;
    return major >= (dt == QT_BF16 ? 8 : 7);
}

/* C (M, N) = alpha * op(A) (M, K) @ op(B) (K, N) [+ C] [+ bias], row-major C,
 * A and B bf16 or f16 (dt). Column-major: C^T (N, M) = op(B)^T @ op(A)^T, B
 * first. */
int qt_cuda_half_gemm(BE, qt_dtype dt, float *C, const uint16_t *A, int ta, const uint16_t *B, int tb,
                       const float *bias, int M, int N, int K, float alpha, int acc) {
    if (dt != QT_BF16 && dt != QT_F16) return QT_EUNSUPPORTED;
    if (M <= 0 || N <= 0) return QT_OK;
    float beta = acc ? 1.0f : 0.0f;
    cudaDataType_t t = dt == QT_BF16 ? CUDA_R_16BF : CUDA_R_16F;
    cublasOperation_t opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N, opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    int ldb = tb ? K : N, lda = ta ? M : K;
    QT_CUBLAS(cublasGemmEx(BLAS, opb, opa, N, M, K, &alpha, B, t, ldb, A, t, lda, &beta, C, CUDA_R_32F, N,
                           CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    if (bias) add_bias(be, C, bias, M, N);
    return QT_OK;
}
int qt_cuda_half_matmul(BE, qt_dtype dt, float *out, const uint16_t *inp, const uint16_t *w, const float *bias,
                         int N, int IN, int OUT, float alpha) {
    return qt_cuda_half_gemm(be, dt, out, inp, 0, w, 1, bias, N, OUT, IN, alpha, 0);
}

/* Decoding, one token for each of N sequences: out (N, OUT) = alpha * x (N,
 * IN) @ W^T + bias [+ out]. A warp per output row reads the row once in its
 * stored dtype (2-byte weights widened in registers), lanes striding over IN,
 * and multiplies each weight into up to MV_NB input rows at once (more rows
 * re-read the row from cache, not from memory); a shuffle tree for each sum.
 * A row's result does not depend on N. Decode is bound by reading the
 * weights. */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define MV_NB 8
/* a 4-bit weight is read as stored, half a byte a value (its block's absmax
 * from cache): decode reads a quarter of the bytes of a bf16 base */
__device__ __forceinline__ float mv_w(const void *w, qt_dtype wdt, size_t i) {
    if (wdt == QT_Q4) return q4_value((const qt_q4_weight *)w, i);
    if (wdt == QT_BF16) return __bfloat162float(__ushort_as_bfloat16(((const unsigned short *)w)[i]));
    if (wdt == QT_F16) return __half2float(__ushort_as_half(((const unsigned short *)w)[i]));
    return ((const float *)w)[i];
}
/* NB: the input rows a warp carries at once. N == 1 takes the one-row
 * instance, the loop of the first one-row kernel, which ran a single row
 * several times faster than the 8-row form (bench/RESULTS.md). A row's
 * arithmetic (lane stride, shuffle tree) is the same in both, so its bits do
 * not depend on how many rows decode together. */
template <int NB>
__global__ void k_matvec(float *out, const float *x, const void *w, qt_dtype wdt, const float *bias, int N, int IN,
                         int OUT, float alpha, int accumulate) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= OUT) return;
    size_t o = (size_t)row * IN;
    for (int n0 = 0; n0 < N; n0 += NB) {
        const int nb = N - n0 < NB ? N - n0 : NB;
        const float *xs = x + (size_t)n0 * IN;
        float s[NB];
#pragma unroll
        for (int n = 0; n < NB; n++) s[n] = 0.0f;
        for (int i = lane; i < IN; i += 32) {
            const float wv = mv_w(w, wdt, o + i);
#pragma unroll
            for (int n = 0; n < NB; n++)
                if (n < nb) s[n] += wv * xs[(size_t)n * IN + i];
        }
#pragma unroll
        for (int n = 0; n < NB; n++) {
            if (n >= nb) break; /* the same for the whole warp */
            float v = s[n];
            for (int k = 16; k > 0; k >>= 1) v += __shfl_xor_sync(0xffffffffu, v, k);
            if (lane == 0) {
                float *po = out + (size_t)(n0 + n) * OUT + row;
                float r = alpha * v + (bias ? bias[row] : 0.0f);
                *po = accumulate ? *po + r : r;
            }
        }
    }
}
void qt_cuda_matvec(BE, float *out, const float *x, const void *w, qt_dtype wdt, const float *bias, int N, int IN,
                     int OUT, float alpha, int accumulate) {
    if (OUT <= 0 || N <= 0) return;
    if (N == 1)
        k_matvec<1><<<(OUT + 7) / 8, 256, 0, STREAM>>>(out, x, w, wdt, bias, N, IN, OUT, alpha, accumulate);
    else
        k_matvec<MV_NB><<<(OUT + 7) / 8, 256, 0, STREAM>>>(out, x, w, wdt, bias, N, IN, OUT, alpha, accumulate);
    QT_CUDA_LAUNCHED();
}

/* one launch a product, in order on the stream: a GPU's products are not held up by a barrier between them */
void qt_cuda_matvec_many(BE, const float *x, int N, int IN, int count, const qt_matvec_out *o) {
    for (int k = 0; k < count; k++) qt_cuda_matvec(be, o[k].out, x, o[k].w, o[k].wdt, o[k].bias, N, IN, o[k].OUT, 1.0f, 0);
}
