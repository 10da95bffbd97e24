/* backend/cpu ops: each forward against a naive double-precision loop, each
 * backward against central finite differences of the op's own forward
 * (loss = sum(out * r) for a fixed random r). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/ops.h"
#include "backend/cpu/op_dnnl.h"
#include "backend/cpu/op_simd.h"
#include "core/mem.h"
#include "core/rng.h"
#include "data/batch.h"

static qt_rng rng;

static float *randv(size_t n, float s) {
    float *x = qt_malloc(n * sizeof(float), "test");
    for (size_t i = 0; i < n; i++) x[i] = s * qt_rng_normal(&rng);
    return x;
}
static float *zeros(size_t n) { return qt_calloc(n, sizeof(float), "test"); }
static double dotd(const float *a, const float *b, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += (double)a[i] * b[i];
    return s;
}
static void expect_close(const char *what, const float *got, const double *want, size_t n, double tol) {
    double mx = 0;
    for (size_t i = 0; i < n; i++) mx = fmax(mx, fabs(want[i]));
    for (size_t i = 0; i < n; i++) {
        double e = fabs(got[i] - want[i]) / fmax(mx, 1e-30);
        if (e > tol) fail_msg("%s[%zu]: got %.8g want %.8g (rel err %.3g)", what, i, got[i], want[i], e);
    }
}

/* Central differences of loss_fn over up to 48 entries of p, against g. */
typedef double (*loss_fn)(void);
static void check_grad(const char *what, float *p, const float *g, size_t n, loss_fn f, float eps, double tol) {
    double gmax = 0;
    for (size_t i = 0; i < n; i++) gmax = fmax(gmax, fabs(g[i]));
    assert_true(gmax > 0);
    size_t step = n > 48 ? n / 48 : 1;
    for (size_t i = 0; i < n; i += step) {
        float o = p[i];
        p[i] = o + eps;
        double lp = f();
        p[i] = o - eps;
        double lm = f();
        p[i] = o;
        double num = (lp - lm) / (2.0 * eps);
        if (fabs(num - g[i]) > tol * gmax)
            fail_msg("%s grad[%zu]: analytic %.6g numeric %.6g (max |g| %.3g)", what, i, g[i], num, gmax);
    }
}

/* ---- rmsnorm ---- */
enum { RN = 5, RC = 16 };
static float *rn_x, *rn_w, *rn_r, rn_out[RN * RC], rn_rstd[RN];
static double rn_loss(void) {
    op_rmsnorm_forward(rn_out, rn_rstd, rn_x, rn_w, RN, RC, 1e-6f);
    return dotd(rn_out, rn_r, RN * RC);
}
static void test_rmsnorm(void **state) {
    (void)state;
    rn_x = randv(RN * RC, 1.0f), rn_w = randv(RC, 1.0f), rn_r = randv(RN * RC, 1.0f);
    rn_loss();
    double want[RN * RC];
    for (int n = 0; n < RN; n++) {
        double ss = 0;
        for (int c = 0; c < RC; c++) ss += (double)rn_x[n * RC + c] * rn_x[n * RC + c];
        double r = 1.0 / sqrt(ss / RC + 1e-6);
        for (int c = 0; c < RC; c++) want[n * RC + c] = rn_w[c] * rn_x[n * RC + c] * r;
    }
    expect_close("rmsnorm out", rn_out, want, RN * RC, 1e-6);
    float *dx = zeros(RN * RC), *dw = zeros(RC);
    op_rmsnorm_backward(dx, dw, rn_r, rn_x, rn_w, rn_rstd, RN, RC);
    check_grad("rmsnorm dinp", rn_x, dx, RN * RC, rn_loss, 1e-3f, 1e-2);
    check_grad("rmsnorm dweight", rn_w, dw, RC, rn_loss, 1e-3f, 1e-2);
    /* gradients accumulate */
    float dw0 = dw[3];
    op_rmsnorm_backward(dx, dw, rn_r, rn_x, rn_w, rn_rstd, RN, RC);
    assert_true(fabsf(dw[3] - 2 * dw0) <= 1e-5f * fabsf(dw0) + 1e-7f);
    qt_free(rn_x), qt_free(rn_w), qt_free(rn_r), qt_free(dx), qt_free(dw);
}

/* ---- matmul ---- */
enum { MN = 4, MI = 24, MO = 40 };
static float *mm_x, *mm_w, *mm_b, *mm_r, mm_out[MN * MO];
static double mm_loss(void) {
    op_matmul_forward(mm_out, mm_x, mm_w, QT_F32, mm_b, MN, MI, MO, 1.0f, 0, NULL);
    return dotd(mm_out, mm_r, MN * MO);
}
static void test_matmul(void **state) {
    (void)state;
    mm_x = randv(MN * MI, 1.0f), mm_w = randv(MO * MI, 0.2f), mm_b = randv(MO, 1.0f), mm_r = randv(MN * MO, 1.0f);
    mm_loss();
    double want[MN * MO];
    for (int n = 0; n < MN; n++)
        for (int o = 0; o < MO; o++) {
            double s = mm_b[o];
            for (int i = 0; i < MI; i++) s += (double)mm_x[n * MI + i] * mm_w[o * MI + i];
            want[n * MO + o] = s;
        }
    expect_close("matmul out", mm_out, want, MN * MO, 1e-6);
    float *dx = zeros(MN * MI), *dw = zeros(MO * MI), *db = zeros(MO);
    op_matmul_backward(dx, dw, db, mm_r, mm_x, mm_w, QT_F32, MN, MI, MO, 1.0f, NULL);
    check_grad("matmul dinp", mm_x, dx, MN * MI, mm_loss, 1e-2f, 1e-2);
    check_grad("matmul dweight", mm_w, dw, MO * MI, mm_loss, 1e-2f, 1e-2);
    check_grad("matmul dbias", mm_b, db, MO, mm_loss, 1e-2f, 1e-2);
    /* alpha and accumulate */
    mm_loss();
    float out2[MN * MO];
    memcpy(out2, mm_out, sizeof out2);
    op_matmul_forward(out2, mm_x, mm_w, QT_F32, NULL, MN, MI, MO, 0.5f, 1, NULL);
    for (int i = 0; i < MN * MO; i++)
        assert_true(fabsf(out2[i] - (mm_out[i] + 0.5f * (mm_out[i] - mm_b[i % MO]))) <= 1e-4f);
    qt_free(mm_x), qt_free(mm_w), qt_free(mm_b), qt_free(mm_r), qt_free(dx), qt_free(dw), qt_free(db);
}

/* ops.h, "ops too small to share out": the tiny preset's products (1024 rows
 * of 64, MLP 176) run on the calling thread whatever the thread count, so 2
 * threads give the bits of 1 (one OpenBLAS call each); shared out as two
 * half-width calls they did not. A product above the bound is still shared. */
static void small_product(int threads, int N, int IN, int OUT, const float *x, const float *w, const float *d,
                          float *out, float *dx, float *dw) {
    int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    op_matmul_forward(out, x, w, QT_F32, NULL, N, IN, OUT, 1.0f, 0, NULL);
    /* a LoRA up-projection's form: out += scaling * (x A^T) B^T, with beta 1 and alpha 2 */
    op_matmul_forward(out, x, w, QT_F32, NULL, N, IN, OUT, 2.0f, 1, NULL);
    op_matmul_backward(dx, dw, NULL, d, x, w, QT_F32, N, IN, OUT, 2.0f, NULL);
    omp_set_num_threads(saved);
}
static void test_small_products_one_thread(void **state) {
    (void)state;
    static const int shapes[][3] = {{1024, 64, 64}, {1024, 64, 176}, {1024, 176, 64}, {1024, 64, 32}, {32, 64, 64},
                                    {32, 64, 176}, {32, 176, 64}, {64, 64, 128}, {32, 8, 64}, {1024, 8, 64}, {1024, 8, 32}, {32, 64, 32}, {30, 64, 32}, {28, 176, 64}};
    for (size_t k = 0; k < sizeof shapes / sizeof *shapes; k++) {
        const int N = shapes[k][0], IN = shapes[k][1], OUT = shapes[k][2];
        assert_int_equal(op_product_team(N, IN, OUT, 2), 1);
        float *x = randv((size_t)N * IN, 1.0f), *w = randv((size_t)OUT * IN, 0.2f), *d = randv((size_t)N * OUT, 1.0f);
        float *o1 = zeros((size_t)N * OUT), *o2 = zeros((size_t)N * OUT), *dx1 = zeros((size_t)N * IN);
        float *dx2 = zeros((size_t)N * IN), *dw1 = zeros((size_t)OUT * IN), *dw2 = zeros((size_t)OUT * IN);
        small_product(1, N, IN, OUT, x, w, d, o1, dx1, dw1);
        small_product(2, N, IN, OUT, x, w, d, o2, dx2, dw2);
        if (memcmp(o1, o2, sizeof(float) * (size_t)N * OUT) || memcmp(dx1, dx2, sizeof(float) * (size_t)N * IN) ||
            memcmp(dw1, dw2, sizeof(float) * (size_t)OUT * IN))
            fail_msg("product %d x %d x %d: 2 threads gave other bits than 1 (shared out?)", N, IN, OUT);
        qt_free(x), qt_free(w), qt_free(d), qt_free(o1), qt_free(o2), qt_free(dx1), qt_free(dx2), qt_free(dw1);
        qt_free(dw2);
    }
    /* the bench-tiny and 0.5B shapes' products stay shared */
    assert_int_equal(op_product_team(1024, 256, 256, 2), 2);
    assert_int_equal(op_product_team(256, 896, 128, 2), 2);
}

/* f16/bf16 weights, several conversion panels: same result as f32 sgemm on
 * the rounded weights. */
static void test_matmul_half_panels(void **state) {
    (void)state;
    const int N = 3, IN = 4096, OUT = 700;
    float *x = randv((size_t)N * IN, 1.0f), *w = randv((size_t)OUT * IN, 0.05f), *dy = randv((size_t)N * OUT, 1.0f);
    uint16_t *wh = qt_malloc((size_t)OUT * IN * 2, "test");
    float *wr = zeros((size_t)OUT * IN), *ws = zeros(op_matmul_ws_floats(IN, OUT));
    float *y1 = zeros((size_t)N * OUT), *y2 = zeros((size_t)N * OUT);
    float *dx1 = zeros((size_t)N * IN), *dx2 = zeros((size_t)N * IN);
    assert_true(op_matmul_ws_floats(IN, OUT) < (size_t)OUT * IN); /* really uses panels */
    qt_dtype dts[2] = {QT_BF16, QT_F16};
    for (int k = 0; k < 2; k++) {
        qt_convert_from_f32(wh, dts[k], w, (size_t)OUT * IN);
        qt_convert_to_f32(wr, wh, dts[k], (size_t)OUT * IN);
        op_matmul_forward(y1, x, wh, dts[k], NULL, N, IN, OUT, 1.0f, 0, ws);
        op_matmul_forward(y2, x, wr, QT_F32, NULL, N, IN, OUT, 1.0f, 0, NULL);
        for (int i = 0; i < N * OUT; i++) assert_true(fabsf(y1[i] - y2[i]) <= 1e-5f * (1 + fabsf(y2[i])));
        memset(dx1, 0, (size_t)N * IN * 4), memset(dx2, 0, (size_t)N * IN * 4);
        op_matmul_backward(dx1, NULL, NULL, dy, x, wh, dts[k], N, IN, OUT, 1.0f, ws);
        op_matmul_backward(dx2, NULL, NULL, dy, x, wr, QT_F32, N, IN, OUT, 1.0f, NULL);
        for (int i = 0; i < N * IN; i++) assert_true(fabsf(dx1[i] - dx2[i]) <= 1e-5f * (1 + fabsf(dx2[i])));
    }
    qt_free(x), qt_free(w), qt_free(dy), qt_free(wh), qt_free(wr), qt_free(ws);
    qt_free(y1), qt_free(y2), qt_free(dx1), qt_free(dx2);
}

/* op_sgemm_nn on each engine (oneDNN where it loads, OpenBLAS) against an
 * fp64 product, with leading dimensions wider than the operands, alpha and
 * beta; then a layer's input gradient on each engine inside OpenMP threads,
 * the two agreeing to fp32 rounding. Shapes above the size under which
 * OpenBLAS is used either way. */
static void test_sgemm_nn_engines(void **state) {
    (void)state;
    const int M = 37, N = 300, K = 260, lda = K + 3, ldb = N + 5, ldc = N + 7;
    float *A = randv((size_t)M * lda, 1.0f), *B = randv((size_t)K * ldb, 1.0f), *C0 = randv((size_t)M * ldc, 1.0f);
    float *C = zeros((size_t)M * ldc);
    double *want = qt_malloc(sizeof(double) * (size_t)M * N, "test"), mx = 0;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double s = 0;
            for (int k = 0; k < K; k++) s += (double)A[m * lda + k] * B[k * ldb + n];
            want[m * N + n] = 0.5 * s + C0[m * ldc + n];
            mx = fmax(mx, fabs(want[m * N + n]));
        }
    int have = op_dnnl_sgemm_available();
    for (int e = 0; e < 2; e++) {
        op_sgemm_use_onednn(e);
        assert_int_equal(op_sgemm_onednn(), e && have);
        long runs = op_dnnl_sgemm_runs();
        memcpy(C, C0, sizeof(float) * (size_t)M * ldc);
        op_sgemm_nn(M, N, K, 0.5f, A, lda, B, ldb, 1.0f, C, ldc);
        assert_int_equal(op_dnnl_sgemm_runs() - runs, e && have ? 1 : 0);
        for (int m = 0; m < M; m++) {
            for (int n = 0; n < N; n++)
                if (fabs(C[m * ldc + n] - want[m * N + n]) > 1e-5 * mx)
                    fail_msg("engine %d C[%d,%d] = %.8g, want %.8g", e, m, n, C[m * ldc + n], want[m * N + n]);
            for (int n = N; n < ldc; n++) assert_true(C[m * ldc + n] == C0[m * ldc + n]); /* padding untouched */
        }
    }
    /* op_sgemm_tn: C (M, N) = 0.5 * At^T @ B + C with At stored (K, M) */
    float *At = randv((size_t)K * (M + 2), 1.0f);
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            double acc = 0;
            for (int k = 0; k < K; k++) acc += (double)At[k * (M + 2) + m] * B[k * ldb + n];
            want[m * N + n] = 0.5 * acc + C0[m * ldc + n];
        }
    for (int e = 0; e < 2; e++) {
        op_sgemm_use_onednn(e);
        long runs = op_dnnl_sgemm_runs();
        memcpy(C, C0, sizeof(float) * (size_t)M * ldc);
        op_sgemm_tn(M, N, K, 0.5f, At, M + 2, B, ldb, 1.0f, C, ldc);
        assert_int_equal(op_dnnl_sgemm_runs() - runs, 0); /* M = 37: small, OpenBLAS either way */
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++)
                if (fabs(C[m * ldc + n] - want[m * N + n]) > 1e-5 * mx * 4)
                    fail_msg("tn engine %d C[%d,%d] = %.8g, want %.8g", e, m, n, C[m * ldc + n], want[m * N + n]);
    }
    qt_free(At);
    if (!have) print_message("oneDNN not loadable here: only the OpenBLAS engine was checked\n");
    /* a layer's dinp (f32 and bf16 weights) inside the OpenMP split */
    const int LN = 64, IN = 384, OUT = 1000;
    float *dy = randv((size_t)LN * OUT, 1.0f), *w = randv((size_t)OUT * IN, 0.05f), *x = randv((size_t)LN * IN, 1.0f);
    float *dx[2] = {zeros((size_t)LN * IN), zeros((size_t)LN * IN)}, *ws = zeros(op_matmul_ws_floats(IN, OUT));
    uint16_t *wh = qt_malloc(sizeof(uint16_t) * (size_t)OUT * IN, "test");
    qt_convert_from_f32(wh, QT_BF16, w, (size_t)OUT * IN);
    for (int k = 0; k < 2; k++) {
        for (int e = 0; e < 2; e++) {
            op_sgemm_use_onednn(e);
            memset(dx[e], 0, sizeof(float) * (size_t)LN * IN);
            op_matmul_backward(dx[e], NULL, NULL, dy, x, k ? (const void *)wh : w, k ? QT_BF16 : QT_F32, LN, IN, OUT,
                               1.0f, ws);
        }
        for (int i = 0; i < LN * IN; i++) assert_true(fabsf(dx[0][i] - dx[1][i]) <= 1e-5f * (1.0f + fabsf(dx[0][i])));
    }
    /* the weight gradient (op_sgemm_tn inside the OpenMP split), accumulated onto a start value */
    float *dw[2] = {randv((size_t)OUT * IN, 1.0f), zeros((size_t)OUT * IN)};
    memcpy(dw[1], dw[0], sizeof(float) * (size_t)OUT * IN);
    for (int e = 0; e < 2; e++) {
        op_sgemm_use_onednn(e);
        long runs = op_dnnl_sgemm_runs();
        op_matmul_backward(NULL, dw[e], NULL, dy, x, w, QT_F32, LN, IN, OUT, 1.0f, NULL);
        if (e && have) assert_true(op_dnnl_sgemm_runs() > runs);
    }
    for (size_t i = 0; i < (size_t)OUT * IN; i++) assert_true(fabsf(dw[0][i] - dw[1][i]) <= 1e-5f * (1.0f + fabsf(dw[0][i])));
    qt_free(dw[0]), qt_free(dw[1]);
    op_sgemm_use_onednn(1);
    qt_free(A), qt_free(B), qt_free(C0), qt_free(C), qt_free(want);
    qt_free(dy), qt_free(w), qt_free(x), qt_free(dx[0]), qt_free(dx[1]), qt_free(ws), qt_free(wh);
}

/* ---- rope ---- */
enum { PN = 3, PH = 2, PD = 8 };
static float *rp_x, *rp_r, rp_out[PN * PH * PD];
static int32_t rp_pos[PN] = {0, 5, 1234};
static float rp_inv[PD / 2]; /* plain RoPE: 1 / 10000^(2i/D), as the model's table holds it */
static double rp_loss(void) {
    memcpy(rp_out, rp_x, sizeof rp_out);
    op_rope_forward(rp_out, rp_pos, PN, PH, PD, rp_inv, 1.0f);
    return dotd(rp_out, rp_r, PN * PH * PD);
}
static void test_rope(void **state) {
    (void)state;
    for (int i = 0; i < PD / 2; i++) rp_inv[i] = (float)(1.0 / pow(10000.0, (double)(2 * i) / PD));
    rp_x = randv(PN * PH * PD, 1.0f), rp_r = randv(PN * PH * PD, 1.0f);
    rp_loss();
    double want[PN * PH * PD];
    for (int n = 0; n < PN; n++)
        for (int h = 0; h < PH; h++)
            for (int i = 0; i < PD / 2; i++) {
                double a = rp_pos[n] * pow(10000.0, -2.0 * i / PD);
                const float *v = rp_x + (n * PH + h) * PD;
                want[(n * PH + h) * PD + i] = v[i] * cos(a) - v[i + PD / 2] * sin(a);
                want[(n * PH + h) * PD + i + PD / 2] = v[i + PD / 2] * cos(a) + v[i] * sin(a);
            }
    expect_close("rope out", rp_out, want, PN * PH * PD, 1e-4); /* angle 1234 rad rounds in fp32, as in HF */
    float dx[PN * PH * PD];
    memcpy(dx, rp_r, sizeof dx);
    op_rope_backward(dx, rp_pos, PN, PH, PD, rp_inv, 1.0f);
    check_grad("rope dinp", rp_x, dx, PN * PH * PD, rp_loss, 1e-2f, 1e-3);
    qt_free(rp_x), qt_free(rp_r);
}

/* ---- attention ---- */
enum { AB = 2, AT = 7, AH = 4, AKV = 2, AD = 8 };
static float *at_q, *at_k, *at_v, *at_r, at_out[AB * AT * AH * AD], at_lse[AB * AH * AT];
static int32_t at_doc[AB * AT] = {0, 0, 0, 3, 3, 3, 6, 0, 0, 0, 0, 0, 0, 0};
static double at_loss(void) {
    op_attention_forward(at_out, at_lse, at_q, at_k, at_v, at_doc, AB, AT, AH, AKV, AD);
    return dotd(at_out, at_r, AB * AT * AH * AD);
}
static void naive_attention(double *out, const float *q, const float *k, const float *v, const int32_t *doc, int B,
                            int T, int H, int KV, int D) {
    double *s = malloc(sizeof(double) * T);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) {
                int kh = h / (H / KV), j0 = doc ? doc[b * T + t] : 0;
                double m = -1e300, l = 0;
                for (int j = j0; j <= t; j++) {
                    double d = 0;
                    for (int e = 0; e < D; e++)
                        d += (double)q[((b * T + t) * H + h) * D + e] * k[((b * T + j) * KV + kh) * D + e];
                    s[j] = d / sqrt((double)D);
                    m = fmax(m, s[j]);
                }
                for (int j = j0; j <= t; j++) l += exp(s[j] - m);
                for (int e = 0; e < D; e++) {
                    double acc = 0;
                    for (int j = j0; j <= t; j++) acc += exp(s[j] - m) / l * v[((b * T + j) * KV + kh) * D + e];
                    out[((b * T + t) * H + h) * D + e] = acc;
                }
            }
    free(s);
}
static void test_attention(void **state) {
    (void)state;
    size_t nq = AB * AT * AH * AD, nk = AB * AT * AKV * AD;
    at_q = randv(nq, 1.0f), at_k = randv(nk, 1.0f), at_v = randv(nk, 1.0f), at_r = randv(nq, 1.0f);
    at_loss();
    double want[AB * AT * AH * AD];
    naive_attention(want, at_q, at_k, at_v, at_doc, AB, AT, AH, AKV, AD);
    expect_close("attention out", at_out, want, nq, 1e-5);
    float *dq = zeros(nq), *dk = zeros(nk), *dv = zeros(nk);
    op_attention_backward(dq, dk, dv, at_r, at_out, at_lse, at_q, at_k, at_v, at_doc, AB, AT, AH, AKV, AD);
    check_grad("attention dq", at_q, dq, nq, at_loss, 1e-2f, 1e-2);
    check_grad("attention dk", at_k, dk, nk, at_loss, 1e-2f, 1e-2);
    check_grad("attention dv", at_v, dv, nk, at_loss, 1e-2f, 1e-2);
    qt_free(at_q), qt_free(at_k), qt_free(at_v), qt_free(at_r), qt_free(dq), qt_free(dk), qt_free(dv);
}

/* More keys than one block (online rescaling across blocks), GQA ratio 7,
 * and the cached decode path agreeing with the batched one: one prompt of
 * 100 rows, single rows (per query head with 2 threads and one kv head; as
 * one group of 7 heads with 1 thread), and 80 rows after 70 cached ones. */
static void test_attention_blocks_and_cache(void **state) {
    (void)state;
    const int T = 150, H = 7, KV = 1, D = 16;
    size_t nq = (size_t)T * H * D, nk = (size_t)T * KV * D;
    float *q = randv(nq, 2.0f), *k = randv(nk, 1.0f), *v = randv(nk, 1.0f);
    float *out = zeros(nq), *lse = zeros((size_t)H * T), *out2 = zeros(nq);
    double *want = malloc(sizeof(double) * nq);
    op_attention_forward(out, lse, q, k, v, NULL, 1, T, H, KV, D);
    naive_attention(want, q, k, v, NULL, 1, T, H, KV, D);
    expect_close("attention(T=150) out", out, want, nq, 1e-5);
    /* decode: first 100 positions at once, then the rest one at a time */
    op_attention_forward_cached(out2, q, k, v, 100, 0, H, KV, D);
    const int saved = omp_get_max_threads();
    for (int threads = 1; threads <= 2; threads++) {
        omp_set_num_threads(threads);
        for (int t = 100; t < T; t++)
            op_attention_forward_cached(out2 + (size_t)t * H * D, q + (size_t)t * H * D, k, v, 1, t, H, KV, D);
        expect_close(threads == 1 ? "cached attention out (a group of 7 heads)" : "cached attention out (per head)",
                     out2, want, nq, 1e-5);
    }
    omp_set_num_threads(saved);
    /* a prompt after a cached prefix: rows 70..149 at once (the block path, offset 70) */
    memset(out2, 0, nq * sizeof(float));
    op_attention_forward_cached(out2 + (size_t)70 * H * D, q + (size_t)70 * H * D, k, v, T - 70, 70, H, KV, D);
    expect_close("cached attention out (pos0 70)", out2 + (size_t)70 * H * D, want + (size_t)70 * H * D,
                 (size_t)(T - 70) * H * D, 1e-5);
    qt_free(q), qt_free(k), qt_free(v), qt_free(out), qt_free(lse), qt_free(out2), free(want);
}

/* The one-row decode against a cache on the model shapes' head layouts:
 * groups of 7 (two heads at a time and one alone), 5 with the block copied
 * to consecutive rows (8 kv heads of 128: rows 4 KiB apart), one head per
 * kv head (MHA, D 40: value columns in pieces of 8), D 36 (no 8-wide path),
 * against double precision at every position of 150 (three key blocks), at
 * 1 and 2 threads. 1 thread runs a row's kv heads as one run and 2 threads
 * half of them each (with one kv head: the 7 heads as a group against one
 * head per work item): a head's operations must not depend on its partners
 * or on the run, so the two agree to the bit. */
static void test_attention_decode_shapes(void **state) {
    (void)state;
    static const int shapes[][3] = {{14, 2, 64}, {40, 8, 128}, {8, 8, 40}, {6, 2, 36}, {7, 1, 64}};
    const int T = 150, saved = omp_get_max_threads();
    for (size_t c = 0; c < sizeof shapes / sizeof shapes[0]; c++) {
        const int H = shapes[c][0], KV = shapes[c][1], D = shapes[c][2];
        size_t nq = (size_t)T * H * D, nk = (size_t)T * KV * D;
        float *q = randv(nq, 2.0f), *k = randv(nk, 1.0f), *v = randv(nk, 1.0f);
        float *out[2] = {zeros(nq), zeros(nq)};
        double *want = malloc(sizeof(double) * nq);
        naive_attention(want, q, k, v, NULL, 1, T, H, KV, D);
        for (int threads = 1; threads <= 2; threads++) {
            omp_set_num_threads(threads);
            float *o = out[threads - 1];
            for (int t = 0; t < T; t++)
                op_attention_forward_cached(o + (size_t)t * H * D, q + (size_t)t * H * D, k, v, 1, t, H, KV, D);
            char what[96];
            snprintf(what, sizeof what, "decode attention H %d KV %d D %d, %d thread(s)", H, KV, D, threads);
            expect_close(what, o, want, nq, 1e-5);
        }
        if (memcmp(out[0], out[1], nq * sizeof(float)))
            fail_msg("decode attention H %d KV %d D %d: 1 and 2 threads (other work items) differ", H, KV, D);
        qt_free(q), qt_free(k), qt_free(v), qt_free(out[0]), qt_free(out[1]), free(want);
    }
    omp_set_num_threads(saved);
}

/* Naive double-precision backward of the same attention: dq, dk, dv (set,
 * not added) of sum(out * dout). */
static void naive_attention_backward(double *dq, double *dk, double *dv, double *lse, const float *dout,
                                     const float *q, const float *k, const float *v, const int32_t *doc, int B, int T,
                                     int H, int KV, int D) {
    size_t nq = (size_t)B * T * H * D, nk = (size_t)B * T * KV * D;
    memset(dq, 0, sizeof(double) * nq), memset(dk, 0, sizeof(double) * nk), memset(dv, 0, sizeof(double) * nk);
    double *p = malloc(sizeof(double) * T), *dp = malloc(sizeof(double) * T), sc = 1.0 / sqrt((double)D);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) {
                int kh = h / (H / KV), j0 = doc ? doc[b * T + t] : 0;
                const float *qt = q + (((size_t)b * T + t) * H + h) * D, *gt = dout + (((size_t)b * T + t) * H + h) * D;
                double m = -1e300, l = 0, delta = 0;
                for (int j = j0; j <= t; j++) {
                    const float *kj = k + (((size_t)b * T + j) * KV + kh) * D, *vj = v + (((size_t)b * T + j) * KV + kh) * D;
                    double s = 0, g = 0;
                    for (int e = 0; e < D; e++) s += (double)qt[e] * kj[e], g += (double)gt[e] * vj[e];
                    p[j] = s * sc, dp[j] = g;
                    m = fmax(m, p[j]);
                }
                for (int j = j0; j <= t; j++) l += exp(p[j] - m);
                for (int j = j0; j <= t; j++) p[j] = exp(p[j] - m) / l, delta += p[j] * dp[j];
                lse[((size_t)b * H + h) * T + t] = m + log(l);
                for (int j = j0; j <= t; j++) {
                    size_t ko = (((size_t)b * T + j) * KV + kh) * D, qo = (((size_t)b * T + t) * H + h) * D;
                    double ds = p[j] * (dp[j] - delta) * sc;
                    for (int e = 0; e < D; e++) {
                        dq[qo + e] += ds * k[ko + e];
                        dk[ko + e] += ds * q[qo + e];
                        dv[ko + e] += p[j] * dout[qo + e];
                    }
                }
            }
    free(p), free(dp);
}

/* Forward, lse and all three gradients against the double-precision loops on
 * shapes that stress the 64 x 64 blocking: T not a multiple of 64, T below
 * one block, documents restarting mid-block, GQA groups 1/2/7, D 8..128. Each
 * runs with one thread (one pass over (b, kv head)) and with more threads than
 * (b, kv head) pairs (the two-pass backward: dK/dV by key block, dQ by query
 * block). dq/dk/dv start non-zero to check the backward adds. */
typedef struct {
    int B, T, H, KV, D, doc_len; /* doc_len > 0: row 0 packs documents of doc_len tokens, row 1 starts one at 3 */
} att_case;
static void check_attention_case(const att_case *c, int threads) {
    int B = c->B, T = c->T, H = c->H, KV = c->KV, D = c->D;
    size_t nq = (size_t)B * T * H * D, nk = (size_t)B * T * KV * D, nl = (size_t)B * H * T;
    float *q = randv(nq, 2.0f), *k = randv(nk, 1.0f), *v = randv(nk, 1.0f), *r = randv(nq, 1.0f);
    float *out = zeros(nq), *lse = zeros(nl), *dq = randv(nq, 1.0f), *dk = randv(nk, 1.0f), *dv = randv(nk, 1.0f);
    float *dq0 = qt_malloc(nq * sizeof(float), "test"), *dk0 = qt_malloc(nk * sizeof(float), "test");
    float *dv0 = qt_malloc(nk * sizeof(float), "test");
    memcpy(dq0, dq, nq * sizeof(float)), memcpy(dk0, dk, nk * sizeof(float)), memcpy(dv0, dv, nk * sizeof(float));
    int32_t *doc = NULL;
    if (c->doc_len > 0) {
        doc = malloc(sizeof(int32_t) * (size_t)B * T);
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++) doc[b * T + t] = b == 0 ? t / c->doc_len * c->doc_len : (t < 3 ? 0 : 3);
    }
    double *want = malloc(sizeof(double) * nq), *wq = malloc(sizeof(double) * nq), *wk = malloc(sizeof(double) * nk);
    double *wv = malloc(sizeof(double) * nk), *wl = malloc(sizeof(double) * nl);
    naive_attention(want, q, k, v, doc, B, T, H, KV, D);
    naive_attention_backward(wq, wk, wv, wl, r, q, k, v, doc, B, T, H, KV, D);
    int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    op_attention_forward(out, lse, q, k, v, doc, B, T, H, KV, D);
    op_attention_backward(dq, dk, dv, r, out, lse, q, k, v, doc, B, T, H, KV, D);
    omp_set_num_threads(saved);
    for (size_t i = 0; i < nq; i++) dq[i] -= dq0[i];
    for (size_t i = 0; i < nk; i++) dk[i] -= dk0[i], dv[i] -= dv0[i];
    char what[128];
    snprintf(what, sizeof what, "attention B%d T%d H%d KV%d D%d doc%d threads%d", B, T, H, KV, D, c->doc_len, threads);
    print_message("%s\n", what);
    expect_close(what, out, want, nq, 1e-5);
    expect_close(what, lse, wl, nl, 1e-5);
    expect_close(what, dq, wq, nq, 1e-5); /* measured at most 1.2e-6 (D 128) */
    expect_close(what, dk, wk, nk, 1e-5);
    expect_close(what, dv, wv, nk, 1e-5);
    qt_free(q), qt_free(k), qt_free(v), qt_free(r), qt_free(out), qt_free(lse), qt_free(dq), qt_free(dk), qt_free(dv);
    qt_free(dq0), qt_free(dk0), qt_free(dv0);
    free(doc), free(want), free(wq), free(wk), free(wv), free(wl);
}
static void test_attention_gemm_blocks(void **state) {
    (void)state;
    static const att_case cases[] = {
        {2, 100, 4, 2, 8, 37},  /* T % 64 != 0; documents restart mid-block and across blocks */
        {1, 5, 2, 2, 16, 0},    /* T below one block, GQA group 1 */
        {1, 200, 7, 1, 64, 70}, /* GQA 7 (Qwen2.5-7B's ratio), D 64, four key blocks */
        {2, 130, 4, 2, 128, 0}, /* D 128, one query row in the last block */
        {1, 65, 2, 1, 32, 64},  /* a document starting at the last row's block */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        check_attention_case(&cases[i], 1);
        check_attention_case(&cases[i], cases[i].B * cases[i].KV + 1);
    }
}

/* ---- swiglu ---- */
enum { SN = 3, SI = 10 };
static float *sw_g, *sw_u, *sw_r, sw_out[SN * SI];
static double sw_loss(void) {
    op_swiglu_forward(sw_out, sw_g, sw_u, SN, SI);
    return dotd(sw_out, sw_r, SN * SI);
}
static void test_swiglu(void **state) {
    (void)state;
    sw_g = randv(SN * SI, 2.0f), sw_u = randv(SN * SI, 1.0f), sw_r = randv(SN * SI, 1.0f);
    sw_loss();
    double want[SN * SI];
    for (int i = 0; i < SN * SI; i++) want[i] = sw_g[i] / (1 + exp(-(double)sw_g[i])) * sw_u[i];
    expect_close("swiglu out", sw_out, want, SN * SI, 1e-6);
    float *dg = zeros(SN * SI), *du = zeros(SN * SI);
    op_swiglu_backward(dg, du, sw_r, sw_g, sw_u, SN, SI);
    check_grad("swiglu dgate", sw_g, dg, SN * SI, sw_loss, 1e-3f, 1e-2);
    check_grad("swiglu dup", sw_u, du, SN * SI, sw_loss, 1e-3f, 1e-2);
    qt_free(sw_g), qt_free(sw_u), qt_free(sw_r), qt_free(dg), qt_free(du);
}

/* The 8-lane path and the tail against double formulas, element by element,
 * over the whole range of the gate (saturating and underflowing exps). */
static void test_swiglu_lanes(void **state) {
    (void)state;
    enum { N = 43 };
    static const float ends[] = {-100.0f, -88.5f, -87.0f, -30.0f, -5.5f, -1.0f, -1e-3f, 0.0f,
                                 1e-3f,   1.0f,   5.5f,   30.0f,  87.0f, 88.5f, 100.0f};
    float g[N], u[N], d[N], out[N], dg[N], du[N];
    float *r = randv(3 * N, 1.0f);
    for (int i = 0; i < N; i++) {
        g[i] = i < 15 ? ends[i] : 8.0f * r[i];
        u[i] = r[N + i], d[i] = r[2 * N + i];
        dg[i] = 0.25f, du[i] = -0.5f; /* the backward accumulates */
    }
    op_swiglu_forward(out, g, u, 1, N);
    op_swiglu_backward(dg, du, d, g, u, 1, N);
    for (int i = 0; i < N; i++) {
        double s = 1.0 / (1.0 + exp(-(double)g[i]));
        double want[3] = {g[i] * s * u[i], 0.25 + d[i] * u[i] * s * (1.0 + g[i] * (1.0 - s)), -0.5 + d[i] * g[i] * s};
        const float got[3] = {out[i], dg[i], du[i]};
        const double init[3] = {0.0, 0.25, 0.5}; /* adding to it rounds at its ulp, whatever the term */
        for (int k = 0; k < 3; k++)
            if (fabs(got[k] - want[k]) > 2e-6 * fmax(fabs(want[k]), 1e-6) + 1.2e-7 * init[k])
                fail_msg("swiglu %s[%d] (g = %g): got %.9g want %.9g", k == 0 ? "out" : k == 1 ? "dgate" : "dup", i,
                         g[i], got[k], want[k]);
    }
    qt_free(r);
}

/* The eight-lane path against the scalar tail at gates where expf(-g)
 * overflows (g < -88.7228...: the scalar sigmoid is exactly 0, silu(g) = -0)
 * and at the infinities and NaN: op_exp8 saturates at exp(88.72) instead of
 * returning inf, which must not leak into the result (silu(-1e30) came out
 * -2.9e-9 and silu(-FLT_MAX) -1.0, below silu's minimum of -0.2785). */
static void test_swiglu_lanes_extreme(void **state) {
    (void)state;
    static const float ends[] = {-INFINITY, -FLT_MAX, -3e38f, -1e30f, -1e10f, -200.0f, -88.72284f, -88.72283f,
                                 -88.5f,    -87.0f,   0.0f,   88.8f,  1e30f,  FLT_MAX, INFINITY,  NAN};
    enum { M = sizeof ends / sizeof ends[0] };
    for (int i = 0; i < M; i++) {
        float g[8], u[8], d[8], out[8], dg[8], du[8];
        for (int k = 0; k < 8; k++) g[k] = ends[i], u[k] = 0.75f, d[k] = -0.5f, dg[k] = 0.25f, du[k] = -0.5f;
        op_swiglu_forward(out, g, u, 1, 8); /* eight lanes */
        op_swiglu_backward(dg, du, d, g, u, 1, 8);
        float o1, dg1 = 0.25f, du1 = -0.5f; /* one element: the tail (the forward's masked lanes, the backward's expf) */
        op_swiglu_forward(&o1, g, u, 1, 1);
        op_swiglu_backward(&dg1, &du1, d, g, u, 1, 1);
        const float want[3] = {o1, dg1, du1};
        for (int k = 0; k < 8; k++) {
            const float got[3] = {out[k], dg[k], du[k]};
            for (int j = 0; j < 3; j++) {
                int same = isnan(want[j]) ? isnan(got[j])
                                          : !isnan(got[j]) && (got[j] == want[j] || fabsf(got[j] - want[j]) <=
                                                                                        2e-6f * fabsf(want[j]) + 1e-30f);
                if (!same)
                    fail_msg("swiglu %s lane %d (g = %g): eight lanes give %.9g, the scalar formula %.9g",
                             j == 0 ? "out" : j == 1 ? "dgate" : "dup", k, (double)ends[i], got[j], want[j]);
            }
        }
    }
}

/* Rows of I = 13 (not a multiple of 8) in one call: each row's output has
 * the bits of that row alone, though the call's lanes straddle the rows (a
 * decode step of N sequences must give each the values of its own run). */
static void test_swiglu_rows_equal_one_row(void **state) {
    (void)state;
    enum { RN = 5, RI = 13 };
    float *g = randv(RN * RI, 4.0f), *u = randv(RN * RI, 1.0f), out[RN * RI], one[RI];
    op_swiglu_forward(out, g, u, RN, RI);
    for (int n = 0; n < RN; n++) {
        op_swiglu_forward(one, g + n * RI, u + n * RI, 1, RI);
        for (int i = 0; i < RI; i++)
            if (memcmp(&one[i], &out[n * RI + i], sizeof(float)))
                fail_msg("swiglu row %d element %d: %.9g in %d rows, %.9g alone", n, i, out[n * RI + i], RN, one[i]);
    }
    qt_free(g), qt_free(u);
}

/* ---- lm_head + cross-entropy ---- */
enum { CN = 5, CC = 8, CV = 2 * OP_CE_CHUNK + 37 };
static float *ce_x, *ce_w, *ce_ws, ce_loss_v[CN], ce_lse[CN];
static int32_t ce_t[CN] = {3, QT_IGNORE_INDEX, CV - 1, OP_CE_CHUNK, 17};
static double ce_loss(void) {
    op_lmhead_ce_forward(ce_loss_v, ce_lse, ce_x, ce_w, QT_F32, ce_t, CN, CC, CV, ce_ws);
    double s = 0;
    for (int n = 0; n < CN; n++) s += ce_loss_v[n];
    return s;
}
static void test_lmhead_ce(void **state) {
    (void)state;
    ce_x = randv(CN * CC, 1.0f), ce_w = randv((size_t)CV * CC, 1.0f);
    ce_ws = zeros(op_lmhead_ce_ws_floats(CN, CC));
    ce_loss();
    double want[CN];
    for (int n = 0; n < CN; n++) {
        double m = -1e300, l = 0, tl = 0;
        double *lg = malloc(sizeof(double) * CV);
        for (int v = 0; v < CV; v++) {
            lg[v] = dotd(ce_x + n * CC, ce_w + (size_t)v * CC, CC);
            m = fmax(m, lg[v]);
        }
        for (int v = 0; v < CV; v++) l += exp(lg[v] - m);
        if (ce_t[n] >= 0) tl = lg[ce_t[n]];
        want[n] = ce_t[n] >= 0 ? m + log(l) - tl : 0.0;
        free(lg);
    }
    expect_close("ce loss", ce_loss_v, want, CN, 1e-6);
    float *dx = zeros(CN * CC), *dw = zeros((size_t)CV * CC);
    op_lmhead_ce_backward(dx, dw, ce_x, ce_w, QT_F32, ce_t, ce_lse, 1.0f, CN, CC, CV, ce_ws);
    for (int c = 0; c < CC; c++) assert_true(dx[1 * CC + c] == 0.0f); /* ignored row */
    check_grad("ce dx", ce_x, dx, CN * CC, ce_loss, 1e-2f, 1e-2);
    check_grad("ce dw(target row)", ce_w + 3 * CC, dw + 3 * CC, CC, ce_loss, 1e-2f, 1e-2);
    check_grad("ce dw", ce_w, dw, (size_t)CV * CC, ce_loss, 1e-2f, 1e-2);
    qt_free(ce_x), qt_free(ce_w), qt_free(ce_ws), qt_free(dx), qt_free(dw);
}

/* The fused forward + dx (frozen lm_head) against forward then backward, in
 * f32 and with a bf16 table, with a loss scale and an ignored row. */
/* Inputs of the two lm_head comparisons: x, the table in f32 and in bf16,
 * and a workspace. */
typedef struct {
    float *x, *w, *ws;
    uint16_t *wh;
} ce_case;

static ce_case ce_case_new(void) {
    ce_case c = {randv(CN * CC, 2.0f), randv((size_t)CV * CC, 2.0f), zeros(op_lmhead_ce_ws_floats(CN, CC)), NULL};
    c.wh = qt_malloc(sizeof(uint16_t) * (size_t)CV * CC, "bf16 table");
    qt_convert_from_f32(c.wh, QT_BF16, c.w, (size_t)CV * CC);
    return c;
}

/* table k: 0 the f32 one, 1 the bf16 one */
static const void *ce_case_table(const ce_case *c, int k, qt_dtype *dt) {
    *dt = k ? QT_BF16 : QT_F32;
    return k ? (const void *)c->wh : (const void *)c->w;
}

static void ce_case_free(ce_case *c) { qt_free(c->x), qt_free(c->w), qt_free(c->ws), qt_free(c->wh); }

static void test_lmhead_ce_forward_dx(void **state) {
    (void)state;
    ce_case c = ce_case_new();
    float *x = c.x, *ws = c.ws;
    for (int k = 0; k < 2; k++) {
        qt_dtype dt;
        const void *wp = ce_case_table(&c, k, &dt);
        float l1[CN], s1[CN], l2[CN], s2[CN], *dx1 = randv(CN * CC, 1.0f), *dx2 = zeros(CN * CC);
        memcpy(dx2, dx1, sizeof(float) * CN * CC); /* both add into the same start */
        op_lmhead_ce_forward(l1, s1, x, wp, dt, ce_t, CN, CC, CV, ws);
        op_lmhead_ce_backward(dx1, NULL, x, wp, dt, ce_t, s1, 256.0f, CN, CC, CV, ws);
        op_lmhead_ce_forward_dx(l2, s2, dx2, x, wp, dt, ce_t, 256.0f, CN, CC, CV, ws);
        for (int n = 0; n < CN; n++) {
            assert_true(fabsf(l1[n] - l2[n]) <= 1e-5f * (1.0f + fabsf(l1[n])));
            assert_true(fabsf(s1[n] - s2[n]) <= 1e-5f * (1.0f + fabsf(s1[n])));
        }
        for (int i = 0; i < CN * CC; i++) assert_true(fabsf(dx1[i] - dx2[i]) <= 1e-3f * (1.0f + fabsf(dx1[i])));
        qt_free(dx1), qt_free(dx2);
    }
    ce_case_free(&c);
}

/* Kept logits (trainable lm_head): forward_keep then backward_kept against
 * forward then backward (recomputing), f32 and bf16 tables, a loss scale, an
 * ignored row and a last chunk shorter than OP_CE_CHUNK. */
static void test_lmhead_ce_kept(void **state) {
    (void)state;
    ce_case c = ce_case_new();
    float *x = c.x, *ws = c.ws, *kept = zeros(op_lmhead_ce_kept_floats(CN, CV));
    for (int k = 0; k < 2; k++) {
        qt_dtype dt;
        const void *wp = ce_case_table(&c, k, &dt);
        float l1[CN], s1[CN], l2[CN], s2[CN], *dx1 = randv(CN * CC, 1.0f), *dx2 = zeros(CN * CC);
        float *dw1 = randv((size_t)CV * CC, 1.0f), *dw2 = zeros((size_t)CV * CC);
        memcpy(dx2, dx1, sizeof(float) * CN * CC); /* both add into the same start */
        memcpy(dw2, dw1, sizeof(float) * (size_t)CV * CC);
        op_lmhead_ce_forward(l1, s1, x, wp, dt, ce_t, CN, CC, CV, ws);
        op_lmhead_ce_backward(dx1, dw1, x, wp, dt, ce_t, s1, 256.0f, CN, CC, CV, ws);
        op_lmhead_ce_forward_keep(l2, s2, kept, x, wp, dt, ce_t, CN, CC, CV, ws);
        for (int n = 0; n < CN; n++) { /* the same walk: bit-identical */
            assert_true(l1[n] == l2[n]);
            assert_true(s1[n] == s2[n]);
        }
        op_lmhead_ce_backward_kept(dx2, dw2, kept, x, wp, dt, ce_t, s2, 256.0f, CN, CC, CV, ws);
        for (int i = 0; i < CN * CC; i++) assert_true(fabsf(dx1[i] - dx2[i]) <= 1e-4f * (1.0f + fabsf(dx1[i])));
        for (size_t i = 0; i < (size_t)CV * CC; i++)
            assert_true(fabsf(dw1[i] - dw2[i]) <= 1e-4f * (1.0f + fabsf(dw1[i])));
        qt_free(dx1), qt_free(dx2), qt_free(dw1), qt_free(dw2);
    }
    qt_free(kept);
    ce_case_free(&c);
}

/* op_exp8 against expf over the range the softmax uses, plus underflow to 0 */
static void test_exp8(void **state) {
    (void)state;
    float x[8], y[8];
    double worst = 0;
    for (int i = 0; i < 200000; i++) {
        for (int k = 0; k < 8; k++) x[k] = -87.0f + 175.0f * (float)(i * 8 + k) / (200000.0f * 8.0f);
        _mm256_storeu_ps(y, op_exp8(_mm256_loadu_ps(x)));
        for (int k = 0; k < 8; k++) {
            double e = exp((double)x[k]), r = fabs(y[k] - e) / e;
            worst = r > worst ? r : worst;
        }
    }
    assert_true(worst < 4e-7); /* a few ulp */
    for (int k = 0; k < 8; k++) x[k] = -100.0f - (float)k * 1e30f;
    _mm256_storeu_ps(y, op_exp8(_mm256_loadu_ps(x)));
    for (int k = 0; k < 8; k++) assert_true(y[k] == 0.0f);
    /* a masked score (-inf) and the lanes just below the cut give 0 beside
     * kept lanes, which keep their values; NaN stays NaN */
    const float mix[8] = {-INFINITY, 0.5f, -87.34f, -87.0f, NAN, -INFINITY, 88.0f, -1e30f};
    _mm256_storeu_ps(y, op_exp8(_mm256_loadu_ps(mix)));
    for (int k = 0; k < 8; k++) {
        if (isnan(mix[k])) assert_true(isnan(y[k]));
        else if (mix[k] < -87.3365478515625f) assert_true(y[k] == 0.0f);
        else assert_true(fabs(y[k] - exp((double)mix[k])) <= 4e-7 * exp((double)mix[k]));
    }
    float row[13];
    for (int k = 0; k < 13; k++) row[k] = (float)k - 6.0f;
    double sum = op_row_exp(row, 13, 1.0f, 2.0f), want = 0;
    for (int k = 0; k < 13; k++) {
        want += exp((double)k - 7.0);
        assert_true(fabs(row[k] - 2.0 * exp((double)k - 7.0)) < 1e-6 * (1 + row[k]));
    }
    assert_true(fabs(sum - want) < 1e-6 * want);
    assert_true(op_row_max(row, 13, -FLT_MAX) == row[12]);
}

/* ---- embedding ---- */
static void test_embedding(void **state) {
    (void)state;
    const int V = 11, C = 6, N = 4;
    int32_t ids[4] = {3, 10, 3, 0};
    float *w = randv((size_t)V * C, 1.0f), *out = zeros((size_t)N * C), *dw = zeros((size_t)V * C);
    uint16_t wh[11 * 6];
    qt_convert_from_f32(wh, QT_BF16, w, (size_t)V * C);
    op_embedding_forward(out, ids, wh, QT_BF16, N, C);
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++) assert_true(out[n * C + c] == qt_bf16_to_f32(wh[ids[n] * C + c]));
    float *dout = randv((size_t)N * C, 1.0f);
    op_embedding_backward(dw, dout, ids, N, C);
    for (int c = 0; c < C; c++) {
        assert_true(fabsf(dw[3 * C + c] - (dout[c] + dout[2 * C + c])) < 1e-6f);
        assert_true(dw[1 * C + c] == 0.0f);
    }
    qt_free(w), qt_free(out), qt_free(dw), qt_free(dout);
}

int main(void) {
    qt_rng_seed(&rng, 1234);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rmsnorm),   cmocka_unit_test(test_matmul),
        cmocka_unit_test(test_matmul_half_panels), cmocka_unit_test(test_sgemm_nn_engines), cmocka_unit_test(test_rope),
        cmocka_unit_test(test_small_products_one_thread),
        cmocka_unit_test(test_attention), cmocka_unit_test(test_attention_blocks_and_cache),
        cmocka_unit_test(test_attention_decode_shapes),
        cmocka_unit_test(test_attention_gemm_blocks),
        cmocka_unit_test(test_swiglu),    cmocka_unit_test(test_swiglu_lanes), cmocka_unit_test(test_swiglu_rows_equal_one_row), cmocka_unit_test(test_swiglu_lanes_extreme),
        cmocka_unit_test(test_lmhead_ce),
        cmocka_unit_test(test_lmhead_ce_forward_dx), cmocka_unit_test(test_lmhead_ce_kept),
        cmocka_unit_test(test_exp8),
        cmocka_unit_test(test_embedding),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
