/* A backend against the CPU backend, op by op: the same random inputs go up
 * to both, each op runs on both, the results come down and are compared by
 * relative error (the largest absolute difference over the largest magnitude
 * of the CPU's result). Forward and backward, fp32, bf16 and f16 weights,
 * odd shapes (C, T, V not multiples of any block), packing masks and GQA;
 * 4-bit weights (QT_Q4: NF4/FP4, double quantization, a row view).
 *
 * Tolerances: 2e-5 where only the summation order may differ (GEMMs,
 * attention, norms), 0 (exact) where both backends must compute the same
 * bits: dropout masks (one counter-based generator), dtype rounding, scale.
 *
 * Usage: test_backend_parity NAME [TEST ...] (NAME guard, cuda, npu; the
 * TESTs, when given, the only ones run: a backend that has some ops so far,
 * as npu). Exit 77 (ctest: skipped) when the backend cannot open here, e.g.
 * no GPU. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "core/error.h"
#include "core/mem.h"
#include "core/quant4.h"
#include "core/rng.h"

static qt_backend *cpu, *dev;
static const char *dev_name;
static qt_rng rng;
static int n_failed; /* comparisons over tolerance in the running test (check) */

#define TOL 2e-5

static float *host_randn(size_t n, float s) {
    float *x = qt_malloc((n ? n : 1) * sizeof(float), "test");
    for (size_t i = 0; i < n; i++) x[i] = s * qt_rng_normal(&rng);
    return x;
}
/* a pair of device buffers, one per backend, holding the same bytes */
typedef struct {
    void *c, *d;
    size_t bytes;
} pair;
static pair up(const void *host, size_t bytes) {
    pair p = {qt_be_alloc(cpu, QT_MEM_DEVICE, bytes, "test"), qt_be_alloc(dev, QT_MEM_DEVICE, bytes, "test"), bytes};
    assert_non_null(p.c);
    assert_non_null(p.d);
    if (host) {
        qt_be_upload(cpu, p.c, host, bytes);
        qt_be_upload(dev, p.d, host, bytes);
    } else {
        qt_be_zero(cpu, p.c, bytes);
        qt_be_zero(dev, p.d, bytes);
    }
    return p;
}
static pair up_randn(size_t n, float s) {
    float *h = host_randn(n, s);
    pair p = up(h, n * sizeof(float));
    qt_free(h);
    return p;
}
static pair up_zero(size_t n) { return up(NULL, n * sizeof(float)); }
static void drop(pair p) {
    qt_be_free(cpu, p.c);
    qt_be_free(dev, p.d);
}
/* bf16 / f16 copies of a float array, as the files store them */
static pair up_weight(size_t n, float s, qt_dtype dt) {
    float *h = host_randn(n, s);
    pair f = up(h, n * sizeof(float));
    qt_free(h);
    if (dt == QT_F32) return f;
    pair p = up(NULL, n * 2);
    qt_be_convert(cpu, p.c, dt, f.c, QT_F32, n);
    qt_be_download(cpu, h = qt_malloc(n * 2, "test"), p.c, n * 2);
    qt_be_upload(dev, p.d, h, n * 2); /* the same bits on both sides */
    qt_free(h);
    drop(f);
    return p;
}

/* both sides of p downloaded (a: the cpu's, b: the device's; qt_free both), and max |a| */
static double pull(pair p, size_t n, float **a, float **b) {
    *a = qt_malloc(n * sizeof(float), "test"), *b = qt_malloc(n * sizeof(float), "test");
    qt_be_download(cpu, *a, p.c, n * sizeof(float));
    qt_be_download(dev, *b, p.d, n * sizeof(float));
    double mx = 0;
    for (size_t i = 0; i < n; i++) mx = fmax(mx, fabs((*a)[i]));
    return mx;
}

/* max |a - b| / max |a| over the downloaded results; exact: bits equal */
static void check(const char *what, pair p, size_t n, double tol) {
    float *a, *b;
    const double mx = pull(p, n, &a, &b);
    double err = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - b[i]);
        if (isnan(a[i]) != isnan(b[i])) e = INFINITY;
        if (e > err) err = e;
    }
    double rel = err / fmax(mx, 1e-30);
    int bits = tol == 0.0 && memcmp(a, b, n * sizeof(float)) != 0, over = !(rel <= tol);
    printf("  %-40s rel err %.3g (tol %.0g)%s\n", what, rel, tol, bits || over ? "  FAILED" : "");
    /* a failed comparison is counted and the test goes on, so one run shows every op's error (a GPU's time is
     * short); the test function fails in its teardown (failed_checks) */
    if (bits) fprintf(stderr, "%s: %s differs from cpu bit for bit\n", what, dev_name), n_failed++;
    else if (over) fprintf(stderr, "%s: %s differs from cpu by %.3g relative (tolerance %.0g)\n", what, dev_name, rel, tol), n_failed++;
    qt_free(a), qt_free(b);
}
/* cmocka's teardown: the test fails when any of its comparisons did */
static int failed_checks(void **state) {
    (void)state;
    int n = n_failed;
    n_failed = 0;
    if (n) fprintf(stderr, "%d comparison%s failed\n", n, n == 1 ? "" : "s");
    return n ? -1 : 0;
}
static float *ws_of(qt_backend *be, size_t floats) {
    float *w = qt_be_alloc(be, QT_MEM_DEVICE, floats * sizeof(float), "ws");
    assert_non_null(w);
    return w;
}

static const qt_dtype dts[] = {QT_F32, QT_BF16, QT_F16};
static const char *dtn[] = {"f32", "bf16", "f16"};

static void test_embedding(void **state) {
    (void)state;
    const int V = 61, C = 37, N = 23;
    int32_t ids[23];
    for (int i = 0; i < N; i++) ids[i] = (i * 7) % V;
    ids[5] = ids[6] = ids[7]; /* repeated ids: the backward must add them all */
    pair pid = up(ids, sizeof ids);
    for (int k = 0; k < 3; k++) {
        pair w = up_weight((size_t)V * C, 1.0f, dts[k]), out = up_zero((size_t)N * C);
        qt_be_embedding_forward(cpu, out.c, pid.c, w.c, dts[k], N, C);
        qt_be_embedding_forward(dev, out.d, pid.d, w.d, dts[k], N, C);
        char what[64];
        snprintf(what, sizeof what, "embedding_forward %s", dtn[k]);
        check(what, out, (size_t)N * C, 0.0);
        drop(w), drop(out);
    }
    pair dout = up_randn((size_t)N * C, 1.0f), dw = up_randn((size_t)V * C, 1.0f);
    qt_be_embedding_backward(cpu, dw.c, dout.c, pid.c, N, C);
    qt_be_embedding_backward(dev, dw.d, dout.d, pid.d, N, C);
    check("embedding_backward (+=, repeated ids)", dw, (size_t)V * C, TOL);
    drop(dout), drop(dw), drop(pid);
}

static void test_rmsnorm(void **state) {
    (void)state;
    const int N = 9, C = 133;
    pair x = up_randn((size_t)N * C, 2.0f), w = up_randn(C, 1.0f), out = up_zero((size_t)N * C), rstd = up_zero(N);
    qt_be_rmsnorm_forward(cpu, out.c, rstd.c, x.c, w.c, N, C, 1e-6f);
    qt_be_rmsnorm_forward(dev, out.d, rstd.d, x.d, w.d, N, C, 1e-6f);
    check("rmsnorm_forward out", out, (size_t)N * C, TOL);
    check("rmsnorm_forward rstd", rstd, N, TOL);
    pair dout = up_randn((size_t)N * C, 1.0f), dx = up_randn((size_t)N * C, 1.0f), dw = up_randn(C, 1.0f);
    qt_be_rmsnorm_backward(cpu, dx.c, dw.c, dout.c, x.c, w.c, rstd.c, N, C);
    qt_be_rmsnorm_backward(dev, dx.d, dw.d, dout.d, x.d, w.d, rstd.d, N, C);
    check("rmsnorm_backward dinp (+=)", dx, (size_t)N * C, TOL);
    check("rmsnorm_backward dweight (+=)", dw, C, TOL);
    drop(x), drop(w), drop(out), drop(rstd), drop(dout), drop(dx), drop(dw);
}

static void test_matmul(void **state) {
    (void)state;
    const int N = 19, IN = 75, OUT = 43;
    for (int k = 0; k < 3; k++)
        for (int acc = 0; acc < 2; acc++) {
            pair x = up_randn((size_t)N * IN, 1.0f), w = up_weight((size_t)OUT * IN, 0.2f, dts[k]);
            pair b = up_randn(OUT, 1.0f), out = up_randn((size_t)N * OUT, 1.0f);
            float *wc = ws_of(cpu, qt_be_matmul_ws_floats(qt_be_desc(cpu), IN, OUT));
            float *wd = ws_of(dev, qt_be_matmul_ws_floats(qt_be_desc(dev), IN, OUT));
            qt_be_matmul_forward(cpu, out.c, x.c, w.c, dts[k], b.c, N, IN, OUT, 0.5f, acc, wc);
            qt_be_matmul_forward(dev, out.d, x.d, w.d, dts[k], b.d, N, IN, OUT, 0.5f, acc, wd);
            char what[64];
            snprintf(what, sizeof what, "matmul_forward %s%s", dtn[k], acc ? " accumulate" : "");
            check(what, out, (size_t)N * OUT, TOL);
            pair dout = up_randn((size_t)N * OUT, 1.0f), dx = up_randn((size_t)N * IN, 1.0f);
            pair dw = up_randn((size_t)OUT * IN, 1.0f), db = up_randn(OUT, 1.0f);
            int f32 = dts[k] == QT_F32; /* weight gradients exist for f32 masters only */
            qt_be_matmul_backward(cpu, dx.c, f32 ? dw.c : NULL, db.c, dout.c, x.c, w.c, dts[k], N, IN, OUT, 0.5f, wc);
            qt_be_matmul_backward(dev, dx.d, f32 ? dw.d : NULL, db.d, dout.d, x.d, w.d, dts[k], N, IN, OUT, 0.5f, wd);
            snprintf(what, sizeof what, "matmul_backward %s dinp", dtn[k]);
            check(what, dx, (size_t)N * IN, TOL);
            if (f32) check("matmul_backward f32 dweight", dw, (size_t)OUT * IN, TOL);
            check("matmul_backward dbias", db, OUT, TOL);
            qt_be_free(cpu, wc), qt_be_free(dev, wd);
            drop(x), drop(w), drop(b), drop(out), drop(dout), drop(dx), drop(dw), drop(db);
        }
}

static void test_matvec(void **state) {
    (void)state;
    const int IN = 301, OUT = 97;
    const int rows[] = {1, 3, 11}; /* one sequence; a batch within one input group (CUDA: 8); two groups */
    for (int k = 0; k < 3; k++)
        for (int q = 0; q < 3; q++) {
            const int N = rows[q];
            pair x = up_randn((size_t)N * IN, 1.0f), w = up_weight((size_t)OUT * IN, 0.2f, dts[k]);
            pair b = up_randn(OUT, 1.0f), out = up_randn((size_t)N * OUT, 1.0f);
            qt_be_matvec(cpu, out.c, x.c, w.c, dts[k], b.c, N, IN, OUT, 0.5f, 1);
            qt_be_matvec(dev, out.d, x.d, w.d, dts[k], b.d, N, IN, OUT, 0.5f, 1);
            char what[64];
            snprintf(what, sizeof what, "matvec %s N %d (+bias, accumulate)", dtn[k], N);
            check(what, out, (size_t)N * OUT, TOL);
            drop(x), drop(w), drop(b), drop(out);
        }
}

/* three products of one input (with a bias, without, an empty one) as one matvec_many call, each out
 * against the CPU's */
static void test_matvec_many(void **state) {
    (void)state;
    const int IN = 301, OUT[3] = {97, 40, 0};
    for (int k = 0; k < 3; k++)
        for (int N = 1; N <= 9; N += 4) {
            pair x = up_randn((size_t)N * IN, 1.0f), b = up_randn(OUT[0], 1.0f), w[3], out[3];
            qt_matvec_out oc[3], od[3];
            for (int i = 0; i < 3; i++) {
                w[i] = up_weight((size_t)OUT[i] * IN, 0.2f, dts[k]);
                out[i] = up_randn((size_t)N * OUT[i], 1.0f); /* overwritten */
                oc[i] = (qt_matvec_out){.out = out[i].c, .w = w[i].c, .wdt = dts[k], .bias = i ? NULL : b.c,
                                        .OUT = OUT[i]};
                od[i] = (qt_matvec_out){.out = out[i].d, .w = w[i].d, .wdt = dts[k], .bias = i ? NULL : b.d,
                                        .OUT = OUT[i]};
            }
            qt_be_matvec_many(cpu, x.c, N, IN, 3, oc);
            qt_be_matvec_many(dev, x.d, N, IN, 3, od);
            for (int i = 0; i < 2; i++) {
                char what[64];
                snprintf(what, sizeof what, "matvec_many %s N %d product %d", dtn[k], N, i);
                check(what, out[i], (size_t)N * OUT[i], TOL);
            }
            for (int i = 0; i < 3; i++) drop(w[i]), drop(out[i]);
            drop(x), drop(b);
        }
}

/* A 4-bit weight (QT_Q4, QLoRA's frozen base) quantized on the host and uploaded to both as one block (its
 * header's offsets count from itself), with a row view of each (the original Qwen's k and v in c_attn): every
 * op that takes one (matmul forward, backward dinp, matvec, matvec_many) against the CPU. The dequantized
 * values are the same bits on both (emu_quant4 holds the CUDA kernel's to the CPU's), so only the GEMM's
 * summation order differs: TOL. */
static pair up_q4(qt_q4_type t, int nested, qt_dtype dt, int rows, int cols) {
    float *x = host_randn((size_t)rows * cols, 0.2f);
    const size_t bytes = qt_q4_bytes((uint64_t)rows, (uint64_t)cols, QT_Q4_BLOCK, nested);
    qt_q4_weight *w = qt_malloc(bytes, "test");
    qt_q4_init(w, t, dt, (uint64_t)rows, (uint64_t)cols, QT_Q4_BLOCK, nested);
    assert_int_equal(qt_q4_quantize_weight(w, x, QT_F32), QT_OK);
    pair p = up(w, bytes);
    qt_free(w), qt_free(x);
    return p;
}
/* rows [r0, r0 + rows) of q as a view header on each side, pointing into that side's block */
static pair up_q4_view(pair q, int r0, int rows) {
    qt_q4_weight hdr, vc, vd;
    qt_be_download(cpu, &hdr, q.c, sizeof hdr);
    pair v = up(NULL, sizeof hdr);
    qt_q4_view(&hdr, q.c, v.c, (uint64_t)r0, (uint64_t)rows, &vc);
    qt_q4_view(&hdr, q.d, v.d, (uint64_t)r0, (uint64_t)rows, &vd);
    qt_be_upload(cpu, v.c, &vc, sizeof vc);
    qt_be_upload(dev, v.d, &vd, sizeof vd);
    return v;
}
static void test_q4(void **state) {
    (void)state;
    const int N = 19, IN = 75, OUT = 43, VR0 = 10, VR = 21;
    const struct { qt_q4_type t; int nested; qt_dtype dt; const char *name; } cases[] = {
        {QT_Q4_NF4, 1, QT_BF16, "nf4 nested bf16"}, {QT_Q4_FP4, 0, QT_F32, "fp4 f32"}, {QT_Q4_NF4, 0, QT_F16, "nf4 f16"}};
    for (int k = 0; k < 3; k++) {
        pair full = up_q4(cases[k].t, cases[k].nested, cases[k].dt, OUT, IN), view = up_q4_view(full, VR0, VR);
        for (int v = 0; v < 2; v++) {
            const int O = v ? VR : OUT;
            pair w = v ? view : full;
            char what[96];
            float *wc = ws_of(cpu, qt_be_matmul_ws_floats(qt_be_desc(cpu), IN, O));
            float *wd = ws_of(dev, qt_be_matmul_ws_floats(qt_be_desc(dev), IN, O));
            for (int acc = 0; acc < 2; acc++) {
                pair x = up_randn((size_t)N * IN, 1.0f), b = up_randn(O, 1.0f), out = up_randn((size_t)N * O, 1.0f);
                qt_be_matmul_forward(cpu, out.c, x.c, w.c, QT_Q4, b.c, N, IN, O, 0.5f, acc, wc);
                qt_be_matmul_forward(dev, out.d, x.d, w.d, QT_Q4, b.d, N, IN, O, 0.5f, acc, wd);
                snprintf(what, sizeof what, "q4 %s%s matmul_forward%s", cases[k].name, v ? " view" : "",
                         acc ? " accumulate" : "");
                check(what, out, (size_t)N * O, TOL);
                drop(x), drop(b), drop(out);
            }
            pair x = up_randn((size_t)N * IN, 1.0f), dout = up_randn((size_t)N * O, 1.0f);
            pair dx = up_randn((size_t)N * IN, 1.0f), db = up_randn(O, 1.0f);
            qt_be_matmul_backward(cpu, dx.c, NULL, db.c, dout.c, x.c, w.c, QT_Q4, N, IN, O, 0.5f, wc);
            qt_be_matmul_backward(dev, dx.d, NULL, db.d, dout.d, x.d, w.d, QT_Q4, N, IN, O, 0.5f, wd);
            snprintf(what, sizeof what, "q4 %s%s matmul_backward dinp", cases[k].name, v ? " view" : "");
            check(what, dx, (size_t)N * IN, TOL);
            check("q4 matmul_backward dbias", db, O, TOL);
            for (int n = 1; n <= 11; n += 10) { /* decode reads the 4-bit weight as stored */
                pair out = up_randn((size_t)n * O, 1.0f), bb = up_randn(O, 1.0f);
                qt_be_matvec(cpu, out.c, x.c, w.c, QT_Q4, bb.c, n, IN, O, 0.5f, 1);
                qt_be_matvec(dev, out.d, x.d, w.d, QT_Q4, bb.d, n, IN, O, 0.5f, 1);
                snprintf(what, sizeof what, "q4 %s%s matvec N %d", cases[k].name, v ? " view" : "", n);
                check(what, out, (size_t)n * O, TOL);
                qt_matvec_out oc = {.out = out.c, .w = w.c, .wdt = QT_Q4, .bias = NULL, .OUT = O};
                qt_matvec_out od = {.out = out.d, .w = w.d, .wdt = QT_Q4, .bias = NULL, .OUT = O};
                qt_be_matvec_many(cpu, x.c, n, IN, 1, &oc);
                qt_be_matvec_many(dev, x.d, n, IN, 1, &od);
                snprintf(what, sizeof what, "q4 %s%s matvec_many N %d", cases[k].name, v ? " view" : "", n);
                check(what, out, (size_t)n * O, TOL);
                drop(out), drop(bb);
            }
            qt_be_free(cpu, wc), qt_be_free(dev, wd);
            drop(x), drop(dout), drop(dx), drop(db);
        }
        drop(view), drop(full);
    }
}

static void test_rope(void **state) {
    (void)state;
    const int N = 13, NH = 3, D = 64;
    int32_t pos[13];
    for (int i = 0; i < N; i++) pos[i] = i * 37 + 5;
    pair pp = up(pos, sizeof pos), x = up_randn((size_t)N * NH * D, 1.0f);
    /* a host table, as the model hands it (theta 1e6); scale as YaRN's attention factor would */
    float inv[D / 2];
    for (int i = 0; i < D / 2; i++) inv[i] = (float)(1.0 / pow(1e6, (double)(2 * i) / D));
    qt_be_rope_forward(cpu, x.c, pp.c, N, NH, D, inv, 1.0f);
    qt_be_rope_forward(dev, x.d, pp.d, N, NH, D, inv, 1.0f);
    check("rope_forward", x, (size_t)N * NH * D, TOL);
    qt_be_rope_backward(cpu, x.c, pp.c, N, NH, D, inv, 1.0f);
    qt_be_rope_backward(dev, x.d, pp.d, N, NH, D, inv, 1.0f);
    check("rope_backward", x, (size_t)N * NH * D, TOL);
    qt_be_rope_forward(cpu, x.c, pp.c, N, NH, D, inv, 1.1386f);
    qt_be_rope_forward(dev, x.d, pp.d, N, NH, D, inv, 1.1386f);
    check("rope_forward (scale)", x, (size_t)N * NH * D, TOL);
    drop(pp), drop(x);
}

static void test_swiglu(void **state) {
    (void)state;
    const int N = 13, I = 101;
    pair g = up_randn((size_t)N * I, 3.0f), u = up_randn((size_t)N * I, 1.0f), o = up_zero((size_t)N * I);
    qt_be_swiglu_forward(cpu, o.c, g.c, u.c, N, I);
    qt_be_swiglu_forward(dev, o.d, g.d, u.d, N, I);
    check("swiglu_forward", o, (size_t)N * I, TOL);
    pair dg = up_randn((size_t)N * I, 1.0f), du = up_randn((size_t)N * I, 1.0f);
    qt_be_swiglu_backward(cpu, dg.c, du.c, o.c, g.c, u.c, N, I);
    qt_be_swiglu_backward(dev, dg.d, du.d, o.d, g.d, u.d, N, I);
    check("swiglu_backward dgate", dg, (size_t)N * I, TOL);
    check("swiglu_backward dup", du, (size_t)N * I, TOL);
    drop(g), drop(u), drop(o), drop(dg), drop(du);
}

static void attention_case(int B, int T, int H, int KV, int D, int packed) {
    size_t nq = (size_t)B * T * H * D, nk = (size_t)B * T * KV * D;
    int32_t *ds = qt_malloc((size_t)B * T * sizeof(int32_t), "test");
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) ds[b * T + t] = packed ? (t < T / 3 ? 0 : t < T / 2 ? T / 3 : T / 2) : 0;
    pair pds = up(ds, (size_t)B * T * sizeof(int32_t));
    pair q = up_randn(nq, 1.0f), k = up_randn(nk, 1.0f), v = up_randn(nk, 1.0f);
    pair out = up_zero(nq), lse = up_zero((size_t)B * H * T);
    const int32_t *dc = packed ? pds.c : NULL, *dd = packed ? pds.d : NULL;
    qt_be_attention_forward(cpu, out.c, lse.c, q.c, k.c, v.c, dc, B, T, H, KV, D);
    qt_be_attention_forward(dev, out.d, lse.d, q.d, k.d, v.d, dd, B, T, H, KV, D);
    char what[96];
    snprintf(what, sizeof what, "attention_forward B%d T%d H%d KV%d D%d%s", B, T, H, KV, D, packed ? " packed" : "");
    check(what, out, nq, TOL);
    check("attention_forward lse", lse, (size_t)B * H * T, TOL);
    pair dout = up_randn(nq, 1.0f), dq = up_randn(nq, 1.0f), dk = up_randn(nk, 1.0f), dv = up_randn(nk, 1.0f);
    qt_be_attention_backward(cpu, dq.c, dk.c, dv.c, dout.c, out.c, lse.c, q.c, k.c, v.c, dc, B, T, H, KV, D);
    qt_be_attention_backward(dev, dq.d, dk.d, dv.d, dout.d, out.d, lse.d, q.d, k.d, v.d, dd, B, T, H, KV, D);
    check("attention_backward dq (+=)", dq, nq, TOL);
    check("attention_backward dk (+=)", dk, nk, TOL);
    check("attention_backward dv (+=)", dv, nk, TOL);
    drop(pds), drop(q), drop(k), drop(v), drop(out), drop(lse), drop(dout), drop(dq), drop(dk), drop(dv);
    qt_free(ds);
}

static void test_attention(void **state) {
    (void)state;
    attention_case(2, 37, 4, 2, 16, 0);
    attention_case(2, 37, 4, 2, 16, 1);
    attention_case(1, 150, 2, 1, 64, 1);  /* more keys than one tile */
    attention_case(1, 33, 2, 2, 128, 0);  /* Qwen2.5's head dim */
    /* decoding against a cache: 3 new queries at positions 20..22 */
    const int S = 23, n = 3, H = 4, KV = 2, D = 32, pos0 = 20;
    pair q = up_randn((size_t)n * H * D, 1.0f), kc = up_randn((size_t)S * KV * D, 1.0f);
    pair vc = up_randn((size_t)S * KV * D, 1.0f), out = up_zero((size_t)n * H * D);
    qt_be_attention_forward_cached(cpu, out.c, q.c, kc.c, vc.c, n, pos0, H, KV, D);
    qt_be_attention_forward_cached(dev, out.d, q.d, kc.d, vc.d, n, pos0, H, KV, D);
    check("attention_forward_cached", out, (size_t)n * H * D, TOL);
    drop(q), drop(kc), drop(vc), drop(out);
}

/* |dev - cpu| within bound[i] + TOL * max |cpu| at every element (the
 * products on 16-bit dlogits, below) */
static void check_bound(const char *what, pair p, size_t n, const double *bound) {
    float *a, *b;
    const double mx = pull(p, n, &a, &b);
    double worst = 0;
    size_t over = 0;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - b[i]), lim = bound[i] + TOL * mx;
        if (!(e <= lim)) over++;
        if (e / lim > worst) worst = e / lim;
    }
    printf("  %-40s worst %.3g of its bound%s\n", what, worst, over ? "  FAILED" : "");
    if (over) fprintf(stderr, "%s: %zu of %zu values beyond the 16-bit rounding bound\n", what, over, n), n_failed++;
    qt_free(a), qt_free(b);
}

/* The lm_head's dx and dW products with dlogits (backward) and softmax
 * numerators (forward_dx) rounded to the table's 16-bit dtype, as the CUDA
 * backend runs them on its tensor cores with QTUNE_CUDA_LMHEAD=all
 * (op_lmhead_ce.cu; set here for these calls): each rounded value g' is within u |g|
 * of g (u = 2^-8 for bf16, 2^-11 for f16; f16 values below its normal range
 * within 2^-25), so a result sum_v g'_v a_v is within u sum |g_v a_v| (+
 * 2^-25 sum |a_v|) of the fp32 one. Those sums are computed here in double
 * from the same inputs (x, W, the CPU's lse), and every element must lie
 * within its bound plus the usual summation-order tolerance. The CPU
 * backend keeps fp32 dlogits, so this compares the device with it. */
static void check_lmhead_dl16(pair x, pair w, qt_dtype dt, pair ptg, const int32_t *tg, pair lse, int N, int C,
                              int V) {
    const double u = dt == QT_BF16 ? 1.0 / 256 : 1.0 / 2048, sub = dt == QT_F16 ? ldexp(1.0, -25) : 0.0;
    float *hx = qt_malloc(sizeof(float) * (size_t)N * C, "test"), *hw = qt_malloc(sizeof(float) * (size_t)V * C, "test");
    float *hl = qt_malloc(sizeof(float) * (size_t)N, "test");
    qt_be_download(cpu, hx, x.c, sizeof(float) * (size_t)N * C);
    pair wf = up_zero((size_t)V * C);
    qt_be_convert(cpu, wf.c, QT_F32, w.c, dt, (size_t)V * C);
    qt_be_download(cpu, hw, wf.c, sizeof(float) * (size_t)V * C);
    drop(wf);
    qt_be_download(cpu, hl, lse.c, sizeof(float) * (size_t)N);
    const float dscale = 0.25f, dscale_fx = 0.5f;
    double *bx = calloc((size_t)N * C, sizeof(double)), *bw = calloc((size_t)V * C, sizeof(double));
    double *bf = calloc((size_t)N * C, sizeof(double));
    for (int n = 0; n < N; n++) {
        if (tg[n] == -100) continue;
        for (int v = 0; v < V; v++) {
            double z = 0;
            for (int c = 0; c < C; c++) z += (double)hx[(size_t)n * C + c] * hw[(size_t)v * C + c];
            double pv = exp(z - hl[n]), g = fabs(dscale * (pv - (v == tg[n] ? 1.0 : 0.0)));
            for (int c = 0; c < C; c++) {
                double a = fabs((double)hw[(size_t)v * C + c]), b = fabs((double)hx[(size_t)n * C + c]);
                bx[(size_t)n * C + c] += u * g * a + sub * a;
                bw[(size_t)v * C + c] += u * g * b + sub * b;
                bf[(size_t)n * C + c] += dscale_fx * (u * pv * a + sub * a);
            }
        }
    }
    pair dx = up_randn((size_t)N * C, 0.1f), dw = up_randn((size_t)V * C, 0.1f);
    float *wc = ws_of(cpu, qt_be_lmhead_ce_ws_floats(qt_be_desc(cpu), N, C));
    float *wd = ws_of(dev, qt_be_lmhead_ce_ws_floats(qt_be_desc(dev), N, C));
    char what[64];
    qt_be_lmhead_ce_backward(cpu, dx.c, dw.c, x.c, w.c, dt, ptg.c, lse.c, dscale, N, C, V, wc);
    qt_be_lmhead_ce_backward(dev, dx.d, dw.d, x.d, w.d, dt, ptg.d, lse.d, dscale, N, C, V, wd);
    snprintf(what, sizeof what, "lmhead_ce_backward %s 16-bit dl: dx", dt == QT_BF16 ? "bf16" : "f16");
    check_bound(what, dx, (size_t)N * C, bx);
    check_bound("  and dw", dw, (size_t)V * C, bw);
    /* the kept pair: dx and dw accumulate a second time, so the bounds double */
    pair kept = up(NULL, qt_be_lmhead_ce_kept_floats(qt_be_desc(cpu), N, V) * sizeof(float)), loss = up_zero(N);
    float *kd = ws_of(dev, qt_be_lmhead_ce_kept_floats(qt_be_desc(dev), N, V));
    qt_be_lmhead_ce_forward_keep(cpu, loss.c, lse.c, kept.c, x.c, w.c, dt, ptg.c, N, C, V, wc);
    qt_be_lmhead_ce_forward_keep(dev, loss.d, lse.d, kd, x.d, w.d, dt, ptg.d, N, C, V, wd);
    qt_be_lmhead_ce_backward_kept(cpu, dx.c, dw.c, kept.c, x.c, w.c, dt, ptg.c, lse.c, dscale, N, C, V, wc);
    qt_be_lmhead_ce_backward_kept(dev, dx.d, dw.d, kd, x.d, w.d, dt, ptg.d, lse.d, dscale, N, C, V, wd);
    for (size_t i = 0; i < (size_t)N * C; i++) bx[i] *= 2;
    for (size_t i = 0; i < (size_t)V * C; i++) bw[i] *= 2;
    check_bound("lmhead_ce_backward_kept (twice): dx", dx, (size_t)N * C, bx);
    check_bound("  and dw", dw, (size_t)V * C, bw);
    /* forward_dx, on top of the twice-accumulated dx */
    for (size_t i = 0; i < (size_t)N * C; i++) bf[i] += bx[i];
    qt_be_lmhead_ce_forward_dx(cpu, loss.c, lse.c, dx.c, x.c, w.c, dt, ptg.c, dscale_fx, N, C, V, wc);
    qt_be_lmhead_ce_forward_dx(dev, loss.d, lse.d, dx.d, x.d, w.d, dt, ptg.d, dscale_fx, N, C, V, wd);
    check_bound("lmhead_ce_forward_dx (+ the above): dx", dx, (size_t)N * C, bf);
    qt_be_free(cpu, wc), qt_be_free(dev, wd), qt_be_free(dev, kd);
    drop(kept), drop(loss), drop(dx), drop(dw);
    free(bx), free(bw), free(bf);
    qt_free(hx), qt_free(hw), qt_free(hl);
}

static void test_lmhead_ce(void **state) {
    (void)state;
    const int N = 11, C = 40, V = 9001; /* spans several chunks on every backend */
    int32_t tg[11];
    for (int i = 0; i < N; i++) tg[i] = (i * 977) % V;
    tg[3] = -100, tg[8] = V - 1;
    pair ptg = up(tg, sizeof tg);
    /* cases: f32 table; bf16 table and fp32 x; then x rounded to the table's dtype, as 16-bit training's final
     * norm leaves it: bf16 and f16 (the logits GEMM on a GPU's tensor cores, op_lmhead_ce.cu) */
    const int kd[] = {0, 1, 1, 2}, kround[] = {0, 0, 1, 1};
    for (int kk = 0; kk < 4; kk++) {
        const int k = kd[kk];
        pair x = up_randn((size_t)N * C, 1.0f), w = up_weight((size_t)V * C, 0.3f, dts[k]);
        /* the cases with 16-bit x first in the default form (dlogits stay fp32, so the usual tolerance), then with
         * the dx and dW products on 16-bit dlogits (QTUNE_CUDA_LMHEAD=all, check_lmhead_dl16) */
        if (kround[kk]) { /* round on the cpu, then the same bits on both sides */
            float *h = qt_malloc(sizeof(float) * (size_t)N * C, "test");
            qt_be_round_to_dtype(cpu, x.c, (size_t)N * C, dts[k]);
            qt_be_download(cpu, h, x.c, sizeof(float) * (size_t)N * C);
            qt_be_upload(dev, x.d, h, sizeof(float) * (size_t)N * C);
            qt_free(h);
        }
        pair loss = up_zero(N), lse = up_zero(N), dx = up_randn((size_t)N * C, 0.1f);
        pair dw = up_randn((size_t)V * C, 0.1f);
        float *wc = ws_of(cpu, qt_be_lmhead_ce_ws_floats(qt_be_desc(cpu), N, C));
        float *wd = ws_of(dev, qt_be_lmhead_ce_ws_floats(qt_be_desc(dev), N, C));
        qt_be_lmhead_ce_forward(cpu, loss.c, lse.c, x.c, w.c, dts[k], ptg.c, N, C, V, wc);
        qt_be_lmhead_ce_forward(dev, loss.d, lse.d, x.d, w.d, dts[k], ptg.d, N, C, V, wd);
        char what[64];
        snprintf(what, sizeof what, "lmhead_ce_forward %s%s loss", dtn[k], kround[kk] ? " (x 16-bit)" : "");
        check(what, loss, N, TOL);
        check("lmhead_ce_forward lse", lse, N, TOL);
        int f32 = dts[k] == QT_F32;
        qt_be_lmhead_ce_backward(cpu, dx.c, f32 ? dw.c : NULL, x.c, w.c, dts[k], ptg.c, lse.c, 0.25f, N, C, V, wc);
        qt_be_lmhead_ce_backward(dev, dx.d, f32 ? dw.d : NULL, x.d, w.d, dts[k], ptg.d, lse.d, 0.25f, N, C, V, wd);
        check("lmhead_ce_backward dx (+=)", dx, (size_t)N * C, TOL);
        if (f32) check("lmhead_ce_backward dw (+=)", dw, (size_t)V * C, TOL);
        /* the kept-logits pair and the forward-with-dx form */
        pair kept = up(NULL, qt_be_lmhead_ce_kept_floats(qt_be_desc(cpu), N, V) * sizeof(float));
        float *kd = ws_of(dev, qt_be_lmhead_ce_kept_floats(qt_be_desc(dev), N, V));
        qt_be_lmhead_ce_forward_keep(cpu, loss.c, lse.c, kept.c, x.c, w.c, dts[k], ptg.c, N, C, V, wc);
        qt_be_lmhead_ce_forward_keep(dev, loss.d, lse.d, kd, x.d, w.d, dts[k], ptg.d, N, C, V, wd);
        check("lmhead_ce_forward_keep loss", loss, N, TOL);
        qt_be_lmhead_ce_backward_kept(cpu, dx.c, f32 ? dw.c : NULL, kept.c, x.c, w.c, dts[k], ptg.c, lse.c, 0.25f, N,
                                     C, V, wc);
        qt_be_lmhead_ce_backward_kept(dev, dx.d, f32 ? dw.d : NULL, kd, x.d, w.d, dts[k], ptg.d, lse.d, 0.25f, N, C,
                                     V, wd);
        check("lmhead_ce_backward_kept dx", dx, (size_t)N * C, TOL);
        qt_be_lmhead_ce_forward_dx(cpu, loss.c, lse.c, dx.c, x.c, w.c, dts[k], ptg.c, 0.5f, N, C, V, wc);
        qt_be_lmhead_ce_forward_dx(dev, loss.d, lse.d, dx.d, x.d, w.d, dts[k], ptg.d, 0.5f, N, C, V, wd);
        check("lmhead_ce_forward_dx dx", dx, (size_t)N * C, TOL);
        qt_be_free(cpu, wc), qt_be_free(dev, wd), qt_be_free(dev, kd);
        if (kround[kk]) {
            setenv("QTUNE_CUDA_LMHEAD", "all", 1);
            check_lmhead_dl16(x, w, dts[k], ptg, tg, lse, N, C, V);
            unsetenv("QTUNE_CUDA_LMHEAD");
        }
        drop(kept), drop(x), drop(w), drop(loss), drop(lse), drop(dx), drop(dw);
    }
    drop(ptg);
}

static void test_precision_and_passes(void **state) {
    (void)state;
    const size_t n = 100003;
    pair x = up_randn(n, 300.0f); /* some beyond fp16's range: they must become inf on both */
    pair h = up(NULL, n * 2);
    qt_be_round_store(cpu, x.c, h.c, n, QT_F16);
    qt_be_round_store(dev, x.d, h.d, n, QT_F16);
    check("round_store f16 (values)", x, n, 0.0);
    pair y = up_randn(n, 1.0f);
    qt_be_round_to_dtype(cpu, y.c, n, QT_BF16);
    qt_be_round_to_dtype(dev, y.d, n, QT_BF16);
    check("round_to_dtype bf16", y, n, 0.0);
    pair back = up_zero(n);
    qt_be_convert(cpu, back.c, QT_F32, h.c, QT_F16, n);
    qt_be_convert(dev, back.d, QT_F32, h.d, QT_F16, n);
    check("convert f16 -> f32", back, n, 0.0);
    qt_be_scale(cpu, y.c, n, 0.125f);
    qt_be_scale(dev, y.d, n, 0.125f);
    check("scale", y, n, 0.0);
    pair z = up_randn(n, 1.0f);
    qt_be_acc(cpu, z.c, y.c, n);
    qt_be_acc(dev, z.d, y.d, n);
    check("acc", z, n, 0.0);
    /* dropout: the same mask element for element */
    qt_dropout_key key = {1234, 7, 3, 2};
    uint32_t th = qt_dropout_threshold(0.1f);
    qt_be_dropout(cpu, z.c, z.c, n, &key, th, 1.0f / 0.9f);
    qt_be_dropout(dev, z.d, z.d, n, &key, th, 1.0f / 0.9f);
    check("dropout (same mask)", z, n, 0.0);
    /* sum of squares in double */
    double sc = qt_be_sum_squares(cpu, z.c, n), sd = qt_be_sum_squares(dev, z.d, n);
    int sq_bad = !(fabs(sc - sd) <= 1e-12 * sc);
    printf("  %-40s rel err %.3g (tol 1e-12)%s\n", "sum_squares", fabs(sc - sd) / sc, sq_bad ? "  FAILED" : "");
    n_failed += sq_bad;
    /* Adam over a range */
    pair p = up_randn(n, 1.0f), g = up_randn(n, 1.0f), m = up_randn(n, 0.1f), v = up_randn(n, 0.1f);
    qt_be_scale(cpu, v.c, n, 0.0f), qt_be_scale(dev, v.d, n, 0.0f); /* v >= 0 */
    qt_adam_scalars k = {0.1f, 0.999f, 0.001f, 6e-5f / 0.1f, sqrtf(0.001f), 1e-8f, 0.5f, 1.0f - 6e-5f * 0.01f, 0.0f};
    for (int s = 0; s < 3; s++) {
        qt_be_adam(cpu, &k, p.c, g.c, m.c, v.c, n);
        qt_be_adam(dev, &k, p.d, g.d, m.d, v.d, n);
    }
    check("adam (3 steps) params", p, n, 1e-6);
    check("adam exp_avg", m, n, 1e-6);
    check("adam exp_avg_sq", v, n, 1e-6);
    drop(x), drop(h), drop(y), drop(back), drop(z), drop(p), drop(g), drop(m), drop(v);
}

/* The 16-bit GEMMs (half_gemm), bf16 and f16, each of the four operand
 * layouts with accumulation: the device's result against an fp64 product of
 * the same 16-bit values (the CPU's own half_gemm where it has that dtype,
 * bf16 on AVX512_BF16, is held to the same reference). A backend that
 * answers QT_EUNSUPPORTED must leave C untouched; the cuda backend must run
 * every form. */
static void test_half_gemm(void **state) {
    (void)state;
    const qt_dtype hdt[] = {QT_BF16, QT_F16};
    const int M = 21, N = 34, K = 57;
    for (int k = 0; k < 2; k++) {
        const qt_dtype dt = hdt[k];
        const char *name = dt == QT_BF16 ? "bf16" : "f16";
        if (!qt_be_half_available(dev, dt)) {
            printf("  half_gemm %s: not run (%s has no native %s GEMM here)\n", name, dev_name, name);
            continue;
        }
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                pair a = up_weight((size_t)M * K, 1.0f, dt), b = up_weight((size_t)K * N, 1.0f, dt);
                pair c = up_randn((size_t)M * N, 1.0f);
                uint16_t *ha = qt_malloc((size_t)M * K * 2, "test"), *hb = qt_malloc((size_t)K * N * 2, "test");
                float *hc = qt_malloc(sizeof(float) * (size_t)M * N, "test"),
                      *hd = qt_malloc(sizeof(float) * (size_t)M * N, "test");
                qt_be_download(cpu, ha, a.c, (size_t)M * K * 2);
                qt_be_download(cpu, hb, b.c, (size_t)K * N * 2);
                qt_be_download(cpu, hc, c.c, sizeof(float) * (size_t)M * N);
                int rc = qt_be_half_gemm(dev, dt, c.d, a.d, ta, b.d, tb, NULL, M, N, K, 0.5f, 1);
                char what[64];
                snprintf(what, sizeof what, "half_gemm %s ta%d tb%d acc", name, ta, tb);
                if (rc == QT_EUNSUPPORTED) {
                    assert_string_not_equal(dev_name, "cuda");
                    qt_be_download(dev, hd, c.d, sizeof(float) * (size_t)M * N);
                    assert_memory_equal(hd, hc, sizeof(float) * (size_t)M * N);
                    printf("  %-40s not supported by %s: C untouched\n", what, dev_name);
                } else {
                    assert_int_equal(rc, QT_OK);
                    /* the reference, in double, into the cpu side of c (or checked against the CPU's own) */
                    for (int m = 0; m < M; m++)
                        for (int n = 0; n < N; n++) {
                            double acc = 0;
                            for (int q = 0; q < K; q++) {
                                uint16_t x = ta ? ha[(size_t)q * M + m] : ha[(size_t)m * K + q];
                                uint16_t y = tb ? hb[(size_t)n * K + q] : hb[(size_t)q * N + n];
                                acc += dt == QT_BF16 ? (double)qt_bf16_to_f32(x) * qt_bf16_to_f32(y)
                                                     : (double)qt_f16_to_f32(x) * qt_f16_to_f32(y);
                            }
                            hd[(size_t)m * N + n] = (float)(hc[(size_t)m * N + n] + 0.5 * acc);
                        }
                    if (qt_be_half_available(cpu, dt)) {
                        assert_int_equal(qt_be_half_gemm(cpu, dt, c.c, a.c, ta, b.c, tb, NULL, M, N, K, 0.5f, 1), QT_OK);
                        qt_be_download(cpu, hc, c.c, sizeof(float) * (size_t)M * N);
                        double err = 0, mx = 0;
                        for (size_t i = 0; i < (size_t)M * N; i++)
                            err = fmax(err, fabs((double)hc[i] - hd[i])), mx = fmax(mx, fabs(hd[i]));
                        assert_true(err <= TOL * mx);
                    }
                    qt_be_upload(cpu, c.c, hd, sizeof(float) * (size_t)M * N);
                    check(what, c, (size_t)M * N, TOL);
                }
                qt_free(ha), qt_free(hb), qt_free(hc), qt_free(hd);
                drop(a), drop(b), drop(c);
            }
    }
}

int main(int argc, char **argv) {
    dev_name = argc > 1 ? argv[1] : "guard";
    qt_rng_seed(&rng, 42);
    if (qt_backend_open("cpu", &cpu) != QT_OK) {
        fprintf(stderr, "cannot open the cpu backend: %s\n", qt_error_message());
        return 1;
    }
    if (qt_backend_open(dev_name, &dev) != QT_OK) {
        printf("SKIP: backend %s cannot open here: %s\n", dev_name, qt_error_message());
        qt_backend_close(cpu);
        return 77;
    }
    printf("backend %s against cpu\n", dev_name);
    const struct CMUnitTest tests[] = {
#define T_(f) cmocka_unit_test_teardown(f, failed_checks)
        T_(test_embedding),   T_(test_rmsnorm),   T_(test_matmul),    T_(test_matvec),
        T_(test_rope),        T_(test_swiglu),    T_(test_attention), T_(test_lmhead_ce), T_(test_precision_and_passes),
        T_(test_half_gemm),   T_(test_matvec_many), T_(test_q4),
#undef T_
    };
    struct CMUnitTest chosen[sizeof tests / sizeof tests[0]];
    size_t n = 0;
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++) {
        int take = argc <= 2;
        for (int a = 2; a < argc; a++) take |= !strcmp(argv[a], tests[i].name);
        if (take) chosen[n++] = tests[i];
    }
    int rc = n ? _cmocka_run_group_tests(dev_name, chosen, n, NULL, NULL) : 1;
    qt_backend_close(dev);
    qt_backend_close(cpu);
    return rc;
}
