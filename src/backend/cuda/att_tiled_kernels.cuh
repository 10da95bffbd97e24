/* The tiled attention kernels (op_attention_tiled.cu says how they work),
 * kept apart from their launches so that tests/unit/backend_parity/
 * emu_attention.cpp can run this very source on the CPU, with each block's
 * 256 threads as host threads (cuda_emu.h): the kernels' logic is tested in
 * every ctest run, on machines without a GPU. Needs TB, TTH, SP and the
 * CUDA names (or cuda_emu.h's stand-ins) in scope. */
#ifndef QT_ATT_TILED_KERNELS_CUH
#define QT_ATT_TILED_KERNELS_CUH

#define TB 64  /* rows of a tile (queries or keys) */
#define TTH 256 /* threads of a block: 16 x 16 */
#define SP (TB + 1) /* pitch of a score tile */
#ifndef QT_DYN_SMEM
#define QT_DYN_SMEM(type, name) extern __shared__ type name[]
#endif

/* dst [TB][D + 1] = rows r0.. of src (rows rstride apart, D contiguous), 0 past T */
__device__ __forceinline__ void load_tile(float *dst, const float *src, size_t rstride, int r0, int T, int D) {
    const int pitch = D + 1;
    for (int e = threadIdx.x; e < TB * D; e += TTH) {
        int r = e / D, d = e - r * D, row = r0 + r;
        dst[r * pitch + d] = row < T ? src[(size_t)row * rstride + d] : 0.0f;
    }
}

__device__ __forceinline__ float half_warp_max(float v) {
    for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float half_warp_sum(float v) {
    for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* the first key tile any query of tile qt can see (its earliest doc_start) */
__device__ int first_key_tile(const int32_t *doc_start, int b, int T, int q0) {
    int lo = q0;
    if (doc_start)
        for (int r = 0; r < TB && q0 + r < T; r++) lo = min(lo, (int)doc_start[(size_t)b * T + q0 + r]);
    return lo / TB;
}

/* Two score tiles at once: s[a][c] = A row . X row and dp[a][c] = B row .
 * Y row over D, for this thread's rows ty + 16a of A, B and rows tx + 16c of
 * X, Y (the dQ kernel: Q, dO against K, V; the dK/dV kernel: K, V against
 * Q, dO) */
__device__ __forceinline__ void tile_dots2(float s[4][4], float dp[4][4], const float *A, const float *B,
                                           const float *X, const float *Y, int pitch, int D) {
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    for (int a = 0; a < 4; a++)
        for (int c = 0; c < 4; c++) s[a][c] = dp[a][c] = 0.0f;
    for (int d = 0; d < D; d++) {
        float xa[4], ya[4], xc[4], yc[4];
        for (int a = 0; a < 4; a++) xa[a] = A[(ty + 16 * a) * pitch + d], ya[a] = B[(ty + 16 * a) * pitch + d];
        for (int c = 0; c < 4; c++) xc[c] = X[(tx + 16 * c) * pitch + d], yc[c] = Y[(tx + 16 * c) * pitch + d];
        for (int a = 0; a < 4; a++)
            for (int c = 0; c < 4; c++) {
                s[a][c] += xa[a] * xc[c];
                dp[a][c] += ya[a] * yc[c];
            }
    }
}

/* acc[a][c] += P row . M column over the tile's TB keys: for this thread's
 * rows ty + 16a of the 64 x TB probabilities (or score gradients) P, pitch
 * SP, and columns tx + 16c of the TB x D tile M (the forward: P V; the dQ
 * kernel: dS K) */
template <int DC>
__device__ __forceinline__ void tile_acc(float acc[4][DC], const float *P, const float *M, int pitch, int D) {
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    for (int j = 0; j < TB; j++) {
        float mv[DC];
        for (int c = 0; c < DC; c++) {
            int d = tx + 16 * c;
            mv[c] = d < D ? M[j * pitch + d] : 0.0f;
        }
        for (int a = 0; a < 4; a++) {
            float p = P[(ty + 16 * a) * SP + j];
            for (int c = 0; c < DC; c++) acc[a][c] += p * mv[c];
        }
    }
}

template <int DC>
__global__ void __launch_bounds__(TTH) k_att_fwd_tiled(float *out, float *lse, const float *q, const float *k,
                                                       const float *v, const int32_t *doc_start, int T, int H,
                                                       int KV, int D, float scale) {
    QT_DYN_SMEM(float, sm);
    __shared__ int lo_tile;
    const int pitch = D + 1;
    float *Qs = sm, *Ks = Qs + TB * pitch, *Vs = Ks + TB * pitch, *Ps = Vs + TB * pitch;
    const int qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z, kvh = h / (H / KV);
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16, q0 = qt * TB;
    const size_t qs = (size_t)H * D, ks = (size_t)KV * D;
    const float *kb = k + (size_t)b * T * ks + (size_t)kvh * D, *vb = v + (size_t)b * T * ks + (size_t)kvh * D;
    load_tile(Qs, q + (size_t)b * T * qs + (size_t)h * D, qs, q0, T, D);
    if (threadIdx.x == 0) lo_tile = first_key_tile(doc_start, b, T, q0);
    int qi[4], dst[4];
    float m[4], l[4], o[4][DC];
    for (int a = 0; a < 4; a++) {
        qi[a] = q0 + ty + 16 * a;
        dst[a] = qi[a] < T ? (doc_start ? doc_start[(size_t)b * T + qi[a]] : 0) : INT_MAX;
        m[a] = -INFINITY, l[a] = 0.0f;
        for (int c = 0; c < DC; c++) o[a][c] = 0.0f;
    }
    __syncthreads();
    for (int kt = lo_tile; kt <= qt; kt++) {
        const int k0 = kt * TB;
        load_tile(Ks, kb, ks, k0, T, D);
        load_tile(Vs, vb, ks, k0, T, D);
        __syncthreads();
        float s[4][4];
        for (int a = 0; a < 4; a++)
            for (int c = 0; c < 4; c++) s[a][c] = 0.0f;
        for (int d = 0; d < D; d++) {
            float qa[4], kc[4];
            for (int a = 0; a < 4; a++) qa[a] = Qs[(ty + 16 * a) * pitch + d];
            for (int c = 0; c < 4; c++) kc[c] = Ks[(tx + 16 * c) * pitch + d];
            for (int a = 0; a < 4; a++)
                for (int c = 0; c < 4; c++) s[a][c] += qa[a] * kc[c];
        }
        for (int a = 0; a < 4; a++) {
            float mt = -INFINITY;
            for (int c = 0; c < 4; c++) {
                int kj = k0 + tx + 16 * c;
                s[a][c] = kj < T && kj <= qi[a] && kj >= dst[a] ? s[a][c] * scale : -INFINITY;
                mt = fmaxf(mt, s[a][c]);
            }
            mt = half_warp_max(mt);
            float mn = fmaxf(m[a], mt), mu = mn == -INFINITY ? 0.0f : mn; /* a row with no key yet: nothing to scale */
            float corr = expf(m[a] - mu), ls = 0.0f;
            for (int c = 0; c < 4; c++) {
                float p = expf(s[a][c] - mu);
                Ps[(ty + 16 * a) * SP + tx + 16 * c] = p;
                ls += p;
            }
            l[a] = l[a] * corr + half_warp_sum(ls);
            m[a] = mn;
            for (int c = 0; c < DC; c++) o[a][c] *= corr;
        }
        __syncthreads();
        tile_acc<DC>(o, Ps, Vs, pitch, D);
        __syncthreads(); /* Ks, Vs and Ps are rewritten by the next tile */
    }
    for (int a = 0; a < 4; a++) {
        if (qi[a] >= T) continue;
        float *orow = out + ((size_t)b * T + qi[a]) * qs + (size_t)h * D;
        for (int c = 0; c < DC; c++) {
            int d = tx + 16 * c;
            if (d < D) orow[d] = o[a][c] / l[a];
        }
        if (lse && tx == 0) lse[((size_t)b * H + h) * T + qi[a]] = m[a] + logf(l[a]);
    }
}

/* dQ += dS K over the key tiles of one query tile; dS = P o (dP - delta) * scale */
template <int DC>
__global__ void __launch_bounds__(TTH) k_att_dq_tiled(float *dq, const float *dout, const float *delta,
                                                      const float *lse, const float *q, const float *k,
                                                      const float *v, const int32_t *doc_start, int T, int H, int KV,
                                                      int D, float scale) {
    QT_DYN_SMEM(float, sm);
    __shared__ int lo_tile;
    const int pitch = D + 1;
    float *Qs = sm, *Os = Qs + TB * pitch, *Ks = Os + TB * pitch, *Vs = Ks + TB * pitch, *Ss = Vs + TB * pitch;
    const int qt = blockIdx.x, h = blockIdx.y, b = blockIdx.z, kvh = h / (H / KV);
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16, q0 = qt * TB;
    const size_t qs = (size_t)H * D, ks = (size_t)KV * D;
    const float *kb = k + (size_t)b * T * ks + (size_t)kvh * D, *vb = v + (size_t)b * T * ks + (size_t)kvh * D;
    load_tile(Qs, q + (size_t)b * T * qs + (size_t)h * D, qs, q0, T, D);
    load_tile(Os, dout + (size_t)b * T * qs + (size_t)h * D, qs, q0, T, D);
    if (threadIdx.x == 0) lo_tile = first_key_tile(doc_start, b, T, q0);
    int qi[4], dst[4];
    float L[4], dl[4], acc[4][DC];
    for (int a = 0; a < 4; a++) {
        qi[a] = q0 + ty + 16 * a;
        int ok = qi[a] < T;
        size_t r = ((size_t)b * H + h) * T + (ok ? qi[a] : 0);
        dst[a] = ok ? (doc_start ? doc_start[(size_t)b * T + qi[a]] : 0) : INT_MAX;
        L[a] = ok ? lse[r] : 0.0f;
        dl[a] = ok ? delta[r] : 0.0f;
        for (int c = 0; c < DC; c++) acc[a][c] = 0.0f;
    }
    __syncthreads();
    for (int kt = lo_tile; kt <= qt; kt++) {
        const int k0 = kt * TB;
        load_tile(Ks, kb, ks, k0, T, D);
        load_tile(Vs, vb, ks, k0, T, D);
        __syncthreads();
        float s[4][4], dp[4][4];
        tile_dots2(s, dp, Qs, Os, Ks, Vs, pitch, D);
        for (int a = 0; a < 4; a++)
            for (int c = 0; c < 4; c++) {
                int kj = k0 + tx + 16 * c;
                float p = kj < T && kj <= qi[a] && kj >= dst[a] ? expf(s[a][c] * scale - L[a]) : 0.0f;
                Ss[(ty + 16 * a) * SP + tx + 16 * c] = p * (dp[a][c] - dl[a]) * scale;
            }
        __syncthreads();
        tile_acc<DC>(acc, Ss, Ks, pitch, D);
        __syncthreads();
    }
    for (int a = 0; a < 4; a++) {
        if (qi[a] >= T) continue;
        float *row = dq + ((size_t)b * T + qi[a]) * qs + (size_t)h * D;
        for (int c = 0; c < DC; c++) {
            int d = tx + 16 * c;
            if (d < D) row[d] += acc[a][c];
        }
    }
}

/* dK, dV of one key tile from one query head: dV += P^T dO, dK += dS^T Q over
 * the query tiles at or after it, into that head's partial (pdk, pdv: G
 * slices of (B, T, KV, D), slice h % G) */
template <int DC>
__global__ void __launch_bounds__(TTH) k_att_dkdv_tiled(float *pdk, float *pdv, const float *dout,
                                                        const float *delta, const float *lse, const float *q,
                                                        const float *k, const float *v, const int32_t *doc_start,
                                                        int B, int T, int H, int KV, int D, float scale) {
    QT_DYN_SMEM(float, sm);
    __shared__ float Ls[TB], Dl[TB];
    __shared__ int Dst[TB];
    const int pitch = D + 1, G = H / KV;
    float *Ks = sm, *Vs = Ks + TB * pitch, *Qs = Vs + TB * pitch, *Os = Qs + TB * pitch, *Ps = Os + TB * pitch;
    float *Ss = Ps + TB * SP;
    const int kt = blockIdx.x, h = blockIdx.y, b = blockIdx.z, kvh = h / G, g = h % G;
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16, k0 = kt * TB;
    const size_t qs = (size_t)H * D, ks = (size_t)KV * D;
    load_tile(Ks, k + (size_t)b * T * ks + (size_t)kvh * D, ks, k0, T, D);
    load_tile(Vs, v + (size_t)b * T * ks + (size_t)kvh * D, ks, k0, T, D);
    int kj[4];
    float ak[4][DC], av[4][DC];
    for (int a = 0; a < 4; a++) {
        kj[a] = k0 + ty + 16 * a;
        for (int c = 0; c < DC; c++) ak[a][c] = av[a][c] = 0.0f;
    }
    const float *qb = q + (size_t)b * T * qs + (size_t)h * D, *ob = dout + (size_t)b * T * qs + (size_t)h * D;
    const int nqt = (T + TB - 1) / TB;
    for (int qt = kt; qt < nqt; qt++) {
        const int q0 = qt * TB;
        load_tile(Qs, qb, qs, q0, T, D);
        load_tile(Os, ob, qs, q0, T, D);
        for (int r = threadIdx.x; r < TB; r += TTH) {
            int qi = q0 + r, ok = qi < T;
            size_t at = ((size_t)b * H + h) * T + (ok ? qi : 0);
            Ls[r] = ok ? lse[at] : 0.0f;
            Dl[r] = ok ? delta[at] : 0.0f;
            Dst[r] = ok ? (doc_start ? doc_start[(size_t)b * T + qi] : 0) : INT_MAX;
        }
        __syncthreads();
        float s[4][4], dp[4][4];
        tile_dots2(s, dp, Ks, Vs, Qs, Os, pitch, D);
        for (int a = 0; a < 4; a++)
            for (int c = 0; c < 4; c++) {
                int i = tx + 16 * c, qi = q0 + i;
                int ok = kj[a] < T && kj[a] <= qi && kj[a] >= Dst[i]; /* Dst is INT_MAX past T */
                float p = ok ? expf(s[a][c] * scale - Ls[i]) : 0.0f;
                Ps[(ty + 16 * a) * SP + i] = p;
                Ss[(ty + 16 * a) * SP + i] = p * (dp[a][c] - Dl[i]) * scale;
            }
        __syncthreads();
        for (int i = 0; i < TB; i++) {
            float oc[DC], qc[DC];
            for (int c = 0; c < DC; c++) {
                int d = tx + 16 * c;
                oc[c] = d < D ? Os[i * pitch + d] : 0.0f;
                qc[c] = d < D ? Qs[i * pitch + d] : 0.0f;
            }
            for (int a = 0; a < 4; a++) {
                float p = Ps[(ty + 16 * a) * SP + i], gs = Ss[(ty + 16 * a) * SP + i];
                for (int c = 0; c < DC; c++) {
                    av[a][c] += p * oc[c];
                    ak[a][c] += gs * qc[c];
                }
            }
        }
        __syncthreads(); /* Qs, Os, Ps, Ss and the row facts are rewritten next */
    }
    for (int a = 0; a < 4; a++) {
        if (kj[a] >= T) continue;
        size_t base = ((((size_t)g * B + b) * T + kj[a]) * KV + kvh) * D;
        for (int c = 0; c < DC; c++) {
            int d = tx + 16 * c;
            if (d < D) pdk[base + d] = ak[a][c], pdv[base + d] = av[a][c];
        }
    }
}

/* dk += the G partials in head order, dv likewise (n = B * T * KV * D) */
__global__ void k_att_group_sum(float *dk, float *dv, const float *pdk, const float *pdv, size_t n, int G) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float a = 0.0f, c = 0.0f;
        for (int g = 0; g < G; g++) a += pdk[(size_t)g * n + i], c += pdv[(size_t)g * n + i];
        dk[i] += a;
        dv[i] += c;
    }
}

#endif
