/* The CUDA backend's tiled attention kernels (src/backend/cuda/
 * att_tiled_kernels.cuh), run on the CPU by cuda_emu.h, against the CPU
 * backend's attention (op_attention.c): forward (out, lse) and backward (dq,
 * dk, dv accumulated into random contents), odd T (not a multiple of the 64-
 * row tile), packed rows (doc_start), GQA, head dims that are and are not
 * multiples of 16. The same source the GPU compiles: its indexing, masks,
 * online softmax and barriers are checked on every machine, the GPU's
 * arithmetic speed only where one is. Tolerance 2e-5 relative (only the
 * summation order differs), as test_backend_parity's. */
#include "cuda_emu.h"

#include <cstdio>
#include <random>

extern "C" {
#include "backend/cpu/ops.h"
}
#include "backend/cuda/att_tiled_kernels.cuh"

static std::mt19937 rng(7);
static std::vector<float> randn(size_t n, float s = 1.0f) {
    std::normal_distribution<float> d(0.0f, s);
    std::vector<float> v(n);
    for (auto &x : v) x = d(rng);
    return v;
}
static int failures;
static void check(const char *what, const std::vector<float> &ref, const std::vector<float> &got, double tol = 2e-5) {
    double mx = 0, err = 0;
    for (size_t i = 0; i < ref.size(); i++) {
        mx = std::max(mx, (double)std::fabs(ref[i]));
        double e = std::isnan(got[i]) ? INFINITY : std::fabs((double)ref[i] - got[i]);
        err = std::max(err, e);
    }
    double rel = err / std::max(mx, 1e-30);
    int bad = !(rel <= tol);
    printf("  %-34s rel err %.3g (tol %.0g)%s\n", what, rel, tol, bad ? "  FAILED" : "");
    failures += bad;
}

template <int DC> static void run_case(int B, int T, int H, int KV, int D, int packed) {
    printf("B%d T%d H%d KV%d D%d%s\n", B, T, H, KV, D, packed ? " packed" : "");
    size_t nq = (size_t)B * T * H * D, nk = (size_t)B * T * KV * D;
    auto q = randn(nq), k = randn(nk), v = randn(nk), dout = randn(nq);
    std::vector<int32_t> doc((size_t)B * T);
    for (int b = 0; b < B; b++) {
        int start = 0;
        for (int t = 0; t < T; t++) {
            if (packed && t > 0 && (t * 7 + b * 3) % 29 == 0) start = t; /* documents of varying length */
            doc[(size_t)b * T + t] = start;
        }
    }
    const int32_t *ds = doc.data();
    float scale = 1.0f / std::sqrt((float)D);
    /* forward */
    std::vector<float> out_c(nq), lse_c((size_t)B * H * T), out_e(nq, NAN), lse_e((size_t)B * H * T, NAN);
    op_attention_forward(out_c.data(), lse_c.data(), q.data(), k.data(), v.data(), ds, B, T, H, KV, D);
    {
        qt_emu_dim3 grid{(unsigned)((T + TB - 1) / TB), (unsigned)H, (unsigned)B};
        size_t sm = sizeof(float) * (3 * (size_t)TB * (D + 1) + (size_t)TB * SP);
        qt_emu_launch(grid, TTH, sm, [&] {
            k_att_fwd_tiled<DC>(out_e.data(), lse_e.data(), q.data(), k.data(), v.data(), ds, T, H, KV, D, scale);
        });
    }
    check("forward out", out_c, out_e);
    check("forward lse", lse_c, lse_e);
    /* backward from the CPU's out and lse, into random contents (+=) */
    auto dq_c = randn(nq, 0.1f), dk_c = randn(nk, 0.1f), dv_c = randn(nk, 0.1f);
    auto dq_e = dq_c, dk_e = dk_c, dv_e = dv_c;
    op_attention_backward(dq_c.data(), dk_c.data(), dv_c.data(), dout.data(), out_c.data(), lse_c.data(), q.data(),
                          k.data(), v.data(), ds, B, T, H, KV, D);
    std::vector<float> delta((size_t)B * H * T);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < H; h++) {
                float s = 0;
                for (int d = 0; d < D; d++) {
                    size_t i = (((size_t)b * T + t) * H + h) * D + d;
                    s += dout[i] * out_c[i];
                }
                delta[((size_t)b * H + h) * T + t] = s;
            }
    qt_emu_dim3 grid{(unsigned)((T + TB - 1) / TB), (unsigned)H, (unsigned)B};
    qt_emu_launch(grid, TTH, sizeof(float) * (4 * (size_t)TB * (D + 1) + (size_t)TB * SP), [&] {
        k_att_dq_tiled<DC>(dq_e.data(), dout.data(), delta.data(), lse_c.data(), q.data(), k.data(), v.data(), ds, T,
                           H, KV, D, scale);
    });
    int G = H / KV;
    std::vector<float> pdk((size_t)G * nk, NAN), pdv((size_t)G * nk, NAN);
    qt_emu_launch(grid, TTH, sizeof(float) * (4 * (size_t)TB * (D + 1) + 2 * (size_t)TB * SP), [&] {
        k_att_dkdv_tiled<DC>(pdk.data(), pdv.data(), dout.data(), delta.data(), lse_c.data(), q.data(), k.data(),
                             v.data(), ds, B, T, H, KV, D, scale);
    });
    for (size_t i = 0; i < nk; i++) { /* k_att_group_sum: the partials in head order */
        float a = 0, c = 0;
        for (int g = 0; g < G; g++) a += pdk[(size_t)g * nk + i], c += pdv[(size_t)g * nk + i];
        dk_e[i] += a;
        dv_e[i] += c;
    }
    check("backward dq (+=)", dq_c, dq_e);
    check("backward dk (+=)", dk_c, dk_e);
    check("backward dv (+=)", dv_c, dv_e);
}

int main() {
    run_case<1>(2, 37, 4, 2, 16, 0);
    run_case<1>(2, 37, 4, 2, 16, 1);
    run_case<4>(1, 150, 2, 1, 64, 1); /* three query tiles, GQA 2 */
    run_case<3>(1, 70, 3, 3, 40, 1);  /* D not a multiple of 16 */
    run_case<8>(1, 33, 2, 2, 128, 0); /* Qwen2.5's head dim at its largest */
    if (failures) printf("%d comparison%s FAILED\n", failures, failures == 1 ? "" : "s");
    else printf("all comparisons within tolerance\n");
    return failures ? 1 : 0;
}
