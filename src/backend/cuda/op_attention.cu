/* Causal grouped-query attention with packing masks on the GPU, flash-style:
 * no T x T matrix exists, keys are visited in tiles of ATT_TILE with a running
 * max and sum (forward), and the backward recomputes the probabilities from
 * the saved log-sum-exp, as backend/cpu/op_attention.c does.
 *
 * Layout: q, out, dout (B, T, H, D); k, v (B, T, KV, D); lse (B, H, T) of
 * the scaled scores. Query head h reads kv head h / (H / KV). Query t of row
 * b attends to keys [doc_start[b*T+t], t] (doc_start NULL: [0, t]).
 *
 * Three kernels, one block (ATT_TILE threads) per row of work:
 *  - forward: a block per (query, head, batch row);
 *  - dQ: a block per (query, head, row), walking its keys;
 *  - dK, dV: a block per (key, kv head, row), walking the queries that see
 *    that key, for each query head of the group. dK and dV are therefore
 *    summed by one block in a fixed order: no atomics, the same bits each run.
 * Each score is a thread's dot product over D (D <= ATT_MAX_D). This is the
 * simple correct form, not a tuned one: it matches the CPU on an H200 (docs/backends.md), and its
 * speed is to be measured before tiling it on the tensor cores. */
#include "backend/cuda/cuda_internal.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define BE qt_backend *be
#define STREAM (qt_cuda_of(be)->stream)
#define ATT_TILE 128
#define ATT_MAX_D 256
#define DPT (ATT_MAX_D / ATT_TILE) /* head-dim elements a thread accumulates */

__device__ float att_block_reduce(float v, float *sh, int is_max) {
    for (int o = 16; o > 0; o >>= 1) {
        float u = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, u) : v + u;
    }
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
    __syncthreads();
    if (l == 0) sh[w] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float r = sh[0];
        for (int i = 1; i < (int)blockDim.x / 32; i++) r = is_max ? fmaxf(r, sh[i]) : r + sh[i];
        sh[0] = r;
    }
    __syncthreads();
    return sh[0];
}

__device__ __forceinline__ float dot_d(const float *a, const float *b, int D) {
    float s = 0.0f;
    for (int d = 0; d < D; d++) s += a[d] * b[d];
    return s;
}

/* One query row: out (D) and lse of q against keys [lo, hi] of kb/vb (rows
 * ks apart). Shared by the training forward and the cached decode. */
__device__ void att_row_forward(float *out, float *lse, const float *q, const float *kb, const float *vb, size_t ks,
                                int lo, int hi, int D, float scale) {
    __shared__ float qs[ATT_MAX_D], p[ATT_TILE], red[32];
    for (int d = threadIdx.x; d < D; d += blockDim.x) qs[d] = q[d];
    __syncthreads();
    float m = -INFINITY, l = 0.0f, acc[DPT];
    for (int r = 0; r < DPT; r++) acc[r] = 0.0f;
    for (int j0 = lo; j0 <= hi; j0 += ATT_TILE) {
        int j = j0 + (int)threadIdx.x;
        float s = j <= hi ? scale * dot_d(qs, kb + (size_t)j * ks, D) : -INFINITY;
        float mt = att_block_reduce(s, red, 1);
        float mn = fmaxf(m, mt);
        float e = j <= hi ? expf(s - mn) : 0.0f;
        p[threadIdx.x] = e;
        float lt = att_block_reduce(e, red, 0); /* also orders the p[] stores before the reads below */
        float corr = expf(m - mn);               /* 0 on the first tile (m = -inf) */
        l = l * corr + lt;
        int nj = hi - j0 + 1 < ATT_TILE ? hi - j0 + 1 : ATT_TILE;
        for (int r = 0; r < DPT; r++) {
            int d = threadIdx.x + r * ATT_TILE;
            if (d >= D) break;
            float a = acc[r] * corr;
            for (int jj = 0; jj < nj; jj++) a += p[jj] * vb[(size_t)(j0 + jj) * ks + d];
            acc[r] = a;
        }
        m = mn;
        __syncthreads(); /* p[] is rewritten by the next tile */
    }
    for (int r = 0; r < DPT; r++) {
        int d = threadIdx.x + r * ATT_TILE;
        if (d < D) out[d] = acc[r] / l;
    }
    if (lse && threadIdx.x == 0) *lse = m + logf(l);
}

__global__ void k_att_fwd(float *out, float *lse, const float *q, const float *k, const float *v,
                          const int32_t *doc_start, int T, int H, int KV, int D, float scale) {
    int t = blockIdx.x, h = blockIdx.y, b = blockIdx.z, kvh = h / (H / KV);
    size_t qs = (size_t)H * D, ks = (size_t)KV * D, row = (size_t)b * T + t;
    int lo = doc_start ? doc_start[row] : 0;
    att_row_forward(out + row * qs + (size_t)h * D, lse ? lse + ((size_t)b * H + h) * T + t : NULL,
                    q + row * qs + (size_t)h * D, k + (size_t)b * T * ks + (size_t)kvh * D,
                    v + (size_t)b * T * ks + (size_t)kvh * D, ks, lo, t, D, scale);
}

__global__ void k_att_fwd_cached(float *out, const float *q, const float *kc, const float *vc, int pos0, int H,
                                 int KV, int D, float scale) {
    int i = blockIdx.x, h = blockIdx.y, kvh = h / (H / KV);
    size_t qs = (size_t)H * D, ks = (size_t)KV * D;
    att_row_forward(out + (size_t)i * qs + (size_t)h * D, NULL, q + (size_t)i * qs + (size_t)h * D,
                    kc + (size_t)kvh * D, vc + (size_t)kvh * D, ks, 0, pos0 + i, D, scale);
}

/* delta (B, H, T) = rowsum(dout o out) of each query head, once for both
 * backward kernels: a warp per (query, head, row) */
__global__ void k_att_delta(float *delta, const float *dout, const float *out, int T, int H, int D) {
    int t = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    size_t qo = ((size_t)b * T + t) * H * D + (size_t)h * D;
    float s = 0.0f;
    for (int d = threadIdx.x; d < D; d += 32) s += dout[qo + d] * out[qo + d];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (threadIdx.x == 0) delta[((size_t)b * H + h) * T + t] = s;
}

/* dQ of one (query, head, row): dS = P o (dP - delta) * scale, dQ += dS K */
__global__ void k_att_bwd_dq(float *dq, const float *dout, const float *delta_, const float *lse, const float *q,
                             const float *k, const float *v, const int32_t *doc_start, int T, int H, int KV, int D,
                             float scale) {
    __shared__ float qs_[ATT_MAX_D], dos[ATT_MAX_D], ds[ATT_TILE];
    int t = blockIdx.x, h = blockIdx.y, b = blockIdx.z, kvh = h / (H / KV);
    size_t qs = (size_t)H * D, ks = (size_t)KV * D, row = (size_t)b * T + t, qo = row * qs + (size_t)h * D;
    const float *kb = k + (size_t)b * T * ks + (size_t)kvh * D, *vb = v + (size_t)b * T * ks + (size_t)kvh * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        qs_[d] = q[qo + d];
        dos[d] = dout[qo + d];
    }
    __syncthreads();
    float delta = delta_[((size_t)b * H + h) * T + t];
    float L = lse[((size_t)b * H + h) * T + t];
    int lo = doc_start ? doc_start[row] : 0;
    float acc[DPT];
    for (int r = 0; r < DPT; r++) acc[r] = 0.0f;
    for (int j0 = lo; j0 <= t; j0 += ATT_TILE) {
        int j = j0 + (int)threadIdx.x;
        float g = 0.0f;
        if (j <= t) {
            float p = expf(scale * dot_d(qs_, kb + (size_t)j * ks, D) - L);
            g = p * (dot_d(dos, vb + (size_t)j * ks, D) - delta) * scale;
        }
        ds[threadIdx.x] = g;
        __syncthreads();
        int nj = t - j0 + 1 < ATT_TILE ? t - j0 + 1 : ATT_TILE;
        for (int r = 0; r < DPT; r++) {
            int d = threadIdx.x + r * ATT_TILE;
            if (d >= D) break;
            float a = acc[r];
            for (int jj = 0; jj < nj; jj++) a += ds[jj] * kb[(size_t)(j0 + jj) * ks + d];
            acc[r] = a;
        }
        __syncthreads();
    }
    for (int r = 0; r < DPT; r++) {
        int d = threadIdx.x + r * ATT_TILE;
        if (d < D) dq[qo + d] += acc[r];
    }
}

/* dK, dV of one (key, kv head, row): every query head of the group, every
 * query that sees the key, in order */
__global__ void k_att_bwd_dkdv(float *dk, float *dv, const float *dout, const float *delta_, const float *lse,
                               const float *q, const float *k, const float *v, const int32_t *doc_start, int T,
                               int H, int KV, int D, float scale) {
    __shared__ float kj[ATT_MAX_D], vj[ATT_MAX_D], p[ATT_TILE], ds[ATT_TILE];
    int j = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z, G = H / KV;
    size_t qs = (size_t)H * D, ks = (size_t)KV * D, ko = ((size_t)b * T + j) * ks + (size_t)kvh * D;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        kj[d] = k[ko + d];
        vj[d] = v[ko + d];
    }
    __syncthreads();
    float ak[DPT], av[DPT];
    for (int r = 0; r < DPT; r++) ak[r] = av[r] = 0.0f;
    for (int g = 0; g < G; g++) {
        int h = kvh * G + g;
        for (int t0 = j; t0 < T; t0 += ATT_TILE) {
            int t = t0 + (int)threadIdx.x;
            float pp = 0.0f, gg = 0.0f;
            if (t < T && (!doc_start || doc_start[(size_t)b * T + t] <= j)) {
                size_t qo = ((size_t)b * T + t) * qs + (size_t)h * D;
                float L = lse[((size_t)b * H + h) * T + t];
                pp = expf(scale * dot_d(q + qo, kj, D) - L);
                float delta = delta_[((size_t)b * H + h) * T + t];
                gg = pp * (dot_d(dout + qo, vj, D) - delta) * scale;
            }
            p[threadIdx.x] = pp;
            ds[threadIdx.x] = gg;
            __syncthreads();
            int nt = T - t0 < ATT_TILE ? T - t0 : ATT_TILE;
            for (int r = 0; r < DPT; r++) {
                int d = threadIdx.x + r * ATT_TILE;
                if (d >= D) break;
                float a_k = ak[r], a_v = av[r];
                for (int ii = 0; ii < nt; ii++) {
                    if (p[ii] == 0.0f && ds[ii] == 0.0f) continue; /* masked query */
                    size_t qo = ((size_t)b * T + t0 + ii) * qs + (size_t)h * D;
                    a_v += p[ii] * dout[qo + d];
                    a_k += ds[ii] * q[qo + d];
                }
                ak[r] = a_k, av[r] = a_v;
            }
            __syncthreads();
        }
    }
    for (int r = 0; r < DPT; r++) {
        int d = threadIdx.x + r * ATT_TILE;
        if (d < D) {
            dk[ko + d] += ak[r];
            dv[ko + d] += av[r];
        }
    }
}

static int dims_ok(int H, int KV, int D) { return D > 0 && D <= ATT_MAX_D && KV > 0 && H % KV == 0; }

/* op_attention_tiled.cu: the 64 x 64 shared-memory tiles, for D <= 128 */
extern "C" int qt_cuda_att_tiled_ok(int D);
extern "C" void qt_cuda_att_fwd_tiled(qt_backend *be, float *out, float *lse, const float *q, const float *k,
                                      const float *v, const int32_t *doc_start, int B, int T, int H, int KV, int D,
                                      float scale);
extern "C" void qt_cuda_att_bwd_tiled(qt_backend *be, float *dq, float *dk, float *dv, const float *dout,
                                      const float *delta, const float *lse, const float *q, const float *k,
                                      const float *v, const int32_t *doc_start, int B, int T, int H, int KV, int D,
                                      float scale, float *pdk, float *pdv);
/* the tiled kernels unless QTUNE_CUDA_ATTENTION=simple (the first kernels, kept to compare against) */
static int use_tiled(int D) {
    static int simple = -1;
    if (simple < 0) {
        const char *e = getenv("QTUNE_CUDA_ATTENTION");
        simple = e && !strcmp(e, "simple");
    }
    return !simple && qt_cuda_att_tiled_ok(D);
}

void qt_cuda_attention_forward(BE, float *out, float *lse, const float *q, const float *k, const float *v,
                                const int32_t *doc_start, int B, int T, int H, int KV, int D) {
    if (B <= 0 || T <= 0) return;
    if (!dims_ok(H, KV, D)) qt_cuda_fail("attention_forward", "head_dim over 256 or heads not a multiple of kv heads",
                                         __FILE__, __LINE__);
    if (use_tiled(D)) {
        qt_cuda_att_fwd_tiled(be, out, lse, q, k, v, doc_start, B, T, H, KV, D, 1.0f / sqrtf((float)D));
        return;
    }
    dim3 grid((unsigned)T, (unsigned)H, (unsigned)B);
    k_att_fwd<<<grid, ATT_TILE, 0, STREAM>>>(out, lse, q, k, v, doc_start, T, H, KV, D, 1.0f / sqrtf((float)D));
    QT_CUDA_LAUNCHED();
}

void qt_cuda_attention_backward(BE, float *dq, float *dk, float *dv, const float *dout, const float *out,
                                 const float *lse, const float *q, const float *k, const float *v,
                                 const int32_t *doc_start, int B, int T, int H, int KV, int D) {
    if (B <= 0 || T <= 0) return;
    if (!dims_ok(H, KV, D)) qt_cuda_fail("attention_backward", "head_dim over 256 or heads not a multiple of kv heads",
                                         __FILE__, __LINE__);
    float scale = 1.0f / sqrtf((float)D);
    int tiled = use_tiled(D);
    size_t nd = (size_t)B * H * T, np = (size_t)B * T * H * D; /* delta; each of the G-head dK, dV partials */
    float *delta = qt_cuda_scratch(be, nd + (tiled ? 2 * np : 0));
    k_att_delta<<<dim3((unsigned)T, (unsigned)H, (unsigned)B), 32, 0, STREAM>>>(delta, dout, out, T, H, D);
    QT_CUDA_LAUNCHED();
    if (tiled) {
        qt_cuda_att_bwd_tiled(be, dq, dk, dv, dout, delta, lse, q, k, v, doc_start, B, T, H, KV, D, scale, delta + nd,
                              delta + nd + np);
        return;
    }
    k_att_bwd_dq<<<dim3((unsigned)T, (unsigned)H, (unsigned)B), ATT_TILE, 0, STREAM>>>(dq, dout, delta, lse, q, k, v,
                                                                                       doc_start, T, H, KV, D, scale);
    QT_CUDA_LAUNCHED();
    k_att_bwd_dkdv<<<dim3((unsigned)T, (unsigned)KV, (unsigned)B), ATT_TILE, 0, STREAM>>>(
        dk, dv, dout, delta, lse, q, k, v, doc_start, T, H, KV, D, scale);
    QT_CUDA_LAUNCHED();
}

void qt_cuda_attention_forward_cached(BE, float *out, const float *q, const float *kc, const float *vc, int n,
                                       int pos0, int H, int KV, int D) {
    if (n <= 0) return;
    if (!dims_ok(H, KV, D)) qt_cuda_fail("attention_forward_cached", "head_dim over 256", __FILE__, __LINE__);
    k_att_fwd_cached<<<dim3((unsigned)n, (unsigned)H, 1), ATT_TILE, 0, STREAM>>>(out, q, kc, vc, pos0, H, KV, D,
                                                                                1.0f / sqrtf((float)D));
    QT_CUDA_LAUNCHED();
}
