/* Adam/AdamW over a range of the flat parameter block, and the deterministic
 * sum of squares (the gradient norm and the fp16 overflow check).
 *
 * Adam's element rule is optim/adam.h's, operation by operation as
 * torch.optim's single-tensor path (the CPU's op_adam has the same lines).
 * The sum of squares is in double, cut into QT_CUDA_SQ_BLOCKS ranges by
 * length alone, each summed by one block's fixed tree, the partials added on
 * the host in range order: the same bits on every run for a given n. A float
 * squared cannot overflow a double, so the sum is finite iff every element is. */
#include "backend/cuda/cuda_internal.h"

#define BE qt_backend *be
#define STREAM (qt_cuda_of(be)->stream)

__global__ void k_adam(qt_adam_scalars k, float *p, const float *g, float *m, float *v, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float pi = p[i];
        float gi = g[i] * k.gs;
        pi = pi * k.wd_mul;
        gi = gi + k.wd_l2 * pi;
        float mi = m[i] + k.omb1 * (gi - m[i]);
        float vi = v[i] * k.b2 + k.omb2 * gi * gi;
        float denom = sqrtf(vi) / k.bc2_sqrt + k.eps;
        p[i] = pi - k.step_size * (mi / denom);
        m[i] = mi;
        v[i] = vi;
    }
}
/* -1: the kernel does not look at what it wrote (the trainer then checks the
 * weights with a sum of squares) */
int qt_cuda_adam(BE, const qt_adam_scalars *k, float *p, const float *g, float *m, float *v, size_t n) {
    if (!n) return -1;
    k_adam<<<qt_cuda_blocks(n), 256, 0, STREAM>>>(*k, p, g, m, v, n);
    QT_CUDA_LAUNCHED();
    return -1;
}

__global__ void k_sum_squares(double *part, const float *x, size_t n, size_t per) {
    __shared__ double sh[256];
    size_t a = (size_t)blockIdx.x * per, b = a + per < n ? a + per : n;
    double s = 0.0;
    for (size_t i = a + threadIdx.x; i < b; i += blockDim.x) s += (double)x[i] * (double)x[i];
    sh[threadIdx.x] = s;
    __syncthreads();
    for (int o = blockDim.x / 2; o > 0; o >>= 1) {
        if ((int)threadIdx.x < o) sh[threadIdx.x] += sh[threadIdx.x + o];
        __syncthreads();
    }
    if (threadIdx.x == 0) part[blockIdx.x] = sh[0];
}
double qt_cuda_sum_squares(BE, const float *x, size_t n) {
    if (!n) return 0.0;
    qt_cuda *c = qt_cuda_of(be);
    size_t per = (n + QT_CUDA_SQ_BLOCKS - 1) / QT_CUDA_SQ_BLOCKS;
    unsigned blocks = (unsigned)((n + per - 1) / per);
    k_sum_squares<<<blocks, 256, 0, c->stream>>>(c->sq_part, x, n, per);
    QT_CUDA_LAUNCHED();
    QT_CUDA(cudaMemcpyAsync(c->sq_host, c->sq_part, blocks * sizeof(double), cudaMemcpyDeviceToHost, c->stream));
    QT_CUDA(cudaStreamSynchronize(c->stream));
    double s = 0.0;
    for (unsigned i = 0; i < blocks; i++) s += c->sq_host[i];
    return s;
}
