/* Causal GQA attention with packing masks on 64 x 64 tiles in shared memory,
 * FlashAttention-2's blocking in fp32 on the CUDA cores (the reference path:
 * no TF32), for head dims up to 128. op_attention.cu dispatches here and
 * keeps the simple kernels for larger head dims and as a fallback
 * (QTUNE_CUDA_ATTENTION=simple).
 *
 * A block is 256 threads, 16 x 16: thread (ty, tx) owns rows ty + 16a
 * (a < 4) of a 64-row tile and, of a 64 x 64 score tile, columns tx + 16c
 * (c < 4); of a 64 x D output tile, columns tx + 16c (c < ceil(D / 16)).
 * Operand tiles sit in shared memory as [64][D + 1] (the padding makes both
 * a row walk and a column walk free of bank conflicts), score tiles as
 * [64][65]. A row's max and sum across its 16 threads are shuffles inside a
 * half-warp.
 *
 * Three kernels and a sum, none with atomics, so every run gives the same
 * bits:
 *  - forward: a block per (query tile, head, row); key tiles up to the
 *    diagonal with an online softmax; writes out and lse (of the scaled
 *    scores, (B, H, T), as the CPU);
 *  - dQ: a block per (query tile, head, row), walking its key tiles;
 *  - dK, dV: a block per (key tile, query head, row), walking the query
 *    tiles that see it, into a per-head partial; k_att_group_sum adds the
 *    G = H / KV partials of a kv head in head order.
 * Masks as the CPU's: query t of row b sees keys [doc_start[b*T+t], t]. */
#include "backend/cuda/cuda_internal.h"

#include <limits.h>
#include <math.h>

#include "backend/cuda/att_tiled_kernels.cuh"

/* ---- launches: the kernel instantiated for ceil(D / 16) columns a thread */
static size_t fwd_smem(int D) { return sizeof(float) * (3 * (size_t)TB * (D + 1) + (size_t)TB * SP); }
static size_t dq_smem(int D) { return sizeof(float) * (4 * (size_t)TB * (D + 1) + (size_t)TB * SP); }
static size_t dkdv_smem(int D) { return sizeof(float) * (4 * (size_t)TB * (D + 1) + 2 * (size_t)TB * SP); }

/* shared memory beyond 48 KiB must be asked for, once per kernel */
template <typename K> static void allow_smem(K kernel, size_t bytes) {
    QT_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
}

#define QT_ATT_DISPATCH(DCV, CALL) \
    switch (DCV) {                  \
    case 1: CALL(1); break;         \
    case 2: CALL(2); break;         \
    case 3: CALL(3); break;         \
    case 4: CALL(4); break;         \
    case 5: CALL(5); break;         \
    case 6: CALL(6); break;         \
    case 7: CALL(7); break;         \
    default: CALL(8); break;        \
    }

extern "C" int qt_cuda_att_tiled_ok(int D) { return D > 0 && D <= 128; }

extern "C" void qt_cuda_att_fwd_tiled(qt_backend *be, float *out, float *lse, const float *q, const float *k,
                                      const float *v, const int32_t *doc_start, int B, int T, int H, int KV, int D,
                                      float scale) {
    dim3 grid((unsigned)((T + TB - 1) / TB), (unsigned)H, (unsigned)B);
    size_t sm = fwd_smem(D);
    cudaStream_t st = qt_cuda_of(be)->stream;
#define L_(N)                                                                                          \
    allow_smem(k_att_fwd_tiled<N>, sm);                                                                \
    k_att_fwd_tiled<N><<<grid, TTH, sm, st>>>(out, lse, q, k, v, doc_start, T, H, KV, D, scale)
    QT_ATT_DISPATCH((D + 15) / 16, L_)
#undef L_
    QT_CUDA_LAUNCHED();
}

/* delta (B, H, T) as op_attention.cu computed it; scratch holds the G
 * partials of dK and dV (2 * H * B * T * D floats) */
extern "C" void qt_cuda_att_bwd_tiled(qt_backend *be, float *dq, float *dk, float *dv, const float *dout,
                                      const float *delta, const float *lse, const float *q, const float *k,
                                      const float *v, const int32_t *doc_start, int B, int T, int H, int KV, int D,
                                      float scale, float *pdk, float *pdv) {
    dim3 grid((unsigned)((T + TB - 1) / TB), (unsigned)H, (unsigned)B);
    cudaStream_t st = qt_cuda_of(be)->stream;
    size_t sq = dq_smem(D), skv = dkdv_smem(D);
#define L_(N)                                                                                               \
    allow_smem(k_att_dq_tiled<N>, sq);                                                                      \
    k_att_dq_tiled<N><<<grid, TTH, sq, st>>>(dq, dout, delta, lse, q, k, v, doc_start, T, H, KV, D, scale); \
    QT_CUDA_LAUNCHED();                                                                                     \
    allow_smem(k_att_dkdv_tiled<N>, skv);                                                                   \
    k_att_dkdv_tiled<N><<<grid, TTH, skv, st>>>(pdk, pdv, dout, delta, lse, q, k, v, doc_start, B, T, H, KV, D, scale)
    QT_ATT_DISPATCH((D + 15) / 16, L_)
#undef L_
    QT_CUDA_LAUNCHED();
    size_t n = (size_t)B * T * KV * D;
    k_att_group_sum<<<qt_cuda_blocks(n), 256, 0, st>>>(dk, dv, pdk, pdv, n, H / KV);
    QT_CUDA_LAUNCHED();
}
