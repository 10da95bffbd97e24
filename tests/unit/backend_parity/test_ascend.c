/* The Ascend backend's own rules, through the CPU stand-in of CANN's API
 * (acl_standin.c): what test_backend_parity does not hold (it compares the
 * ops with the CPU's): "npu" without CANN says so, device values, converts
 * and the 16-bit rounding bit for bit, the refusals (4-bit weights;
 * bfloat16 and the fused attention on a card without them), the fp16 cube
 * path of a card without fp32 KEEP_DTYPE, and the stand-in's attention
 * rules called directly. Refusals end the process, so each runs in a child. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend/ascend/ascend_internal.h"
#include "backend/ascend/backend_ascend.h"
#include "backend/backend.h"
#include "backend/backend_impl.h"
#include "backend/device.h"
#include "core/error.h"

static qt_backend *open_npu(const char *soc) {
    setenv("QTUNE_ASCEND_LIB", QT_ACL_STANDIN, 1);
    setenv("QTUNE_ACL_STANDIN_SOC", soc, 1);
    qt_backend *be = NULL;
    if (qt_backend_open("npu", &be) != QT_OK) fail_msg("npu does not open on the stand-in: %s", qt_error_message());
    return be;
}

/* without CANN (and no stand-in named), opening "npu" fails with a sentence
 * naming the library and what to do; this runs first, before any load */
static void test_absent_library(void **state) {
    (void)state;
    unsetenv("QTUNE_ASCEND_LIB");
    qt_backend *be = NULL;
    int rc = qt_backend_open("npu", &be);
    if (rc == QT_OK) skip(); /* a machine with CANN installed */
    assert_int_equal(rc, QT_EUNSUPPORTED);
    assert_null(be);
    assert_non_null(strstr(qt_error_message(), "libascendcl.so"));
    assert_non_null(strstr(qt_error_message(), "set_env.sh"));
    qt_device d; /* and before a run starts, naming what asked */
    assert_int_equal(qt_device_resolve("npu", "job.json: \"device\":", &d), QT_EUNSUPPORTED);
    assert_non_null(strstr(qt_error_message(), "job.json: \"device\": \"npu\": the Ascend backend"));
    setenv("QTUNE_ASCEND_LIB", "/nonexistent/libacl.so", 1);
    assert_int_equal(qt_backend_open("npu", &be), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "QTUNE_ASCEND_LIB"));
    qt_error_clear();
}

/* every slot filled (the refusals are slots too) */
static void test_table_is_complete(void **state) {
    (void)state;
    const char *hole = qt_backend_empty_slot(&qt_backend_ascend_i);
    if (hole) fail_msg("backend npu: slot %s is empty", hole);
}

static void test_device_values(void **state) {
    (void)state;
    unsetenv("QTUNE_BACKEND");
    setenv("QTUNE_ASCEND_LIB", QT_ACL_STANDIN, 1);
    qt_device d;
    assert_int_equal(qt_device_resolve("npu", "--device", &d), QT_OK);
    assert_string_equal(d.backend, "npu");
    assert_int_equal(qt_device_resolve("npu:1", "--device", &d), QT_OK);
    assert_string_equal(d.backend, "npu");
    assert_int_equal(d.index, 1);
    assert_string_equal(qt_device_desc_name("npu:0"), "npu");
    assert_int_equal(qt_device_check("npu:", "--device"), QT_EINVAL);
    assert_int_equal(qt_device_check("npu:x", "--device"), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "\"npu:N\""));
    qt_error_clear();
    /* an NPU number beyond the cards is the open's error */
    qt_backend *be = NULL;
    assert_int_equal(qt_backend_open_index("npu", 3, &be), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "1 NPU is visible"));
    qt_error_clear();
}

/* f32 -> f16 -> f32 as the CPU converts (round to nearest even, inf beyond
 * fp16), bit for bit; and bf16 where the card has it */
static void test_convert(void **state) {
    (void)state;
    qt_backend *cpu = NULL, *npu = open_npu("Ascend910B1");
    assert_int_equal(qt_backend_open("cpu", &cpu), QT_OK);
    enum { n = 1000 };
    float h[n], a[n], b[n];
    for (int i = 0; i < n; i++) h[i] = ldexpf((float)(i * 7919 % 1000) - 500.0f, i % 40 - 24) / 3.0f;
    h[0] = 70000.0f, h[1] = -65519.0f, h[2] = 1e-9f;
    for (int k = 0; k < 2; k++) {
        qt_dtype dt = k ? QT_BF16 : QT_F16;
        float *xc = qt_be_alloc(cpu, QT_MEM_DEVICE, sizeof h, "x"), *xn = qt_be_alloc(npu, QT_MEM_DEVICE, sizeof h, "x");
        void *hc = qt_be_alloc(cpu, QT_MEM_DEVICE, n * 2, "h"), *hn = qt_be_alloc(npu, QT_MEM_DEVICE, n * 2, "h");
        qt_be_upload(cpu, xc, h, sizeof h), qt_be_upload(npu, xn, h, sizeof h);
        qt_be_convert(cpu, hc, dt, xc, QT_F32, n), qt_be_convert(npu, hn, dt, xn, QT_F32, n);
        qt_be_convert(cpu, xc, QT_F32, hc, dt, n), qt_be_convert(npu, xn, QT_F32, hn, dt, n);
        qt_be_download(cpu, a, xc, sizeof a), qt_be_download(npu, b, xn, sizeof b);
        assert_memory_equal(a, b, sizeof a);
        assert_true(isinf(b[0]) || k); /* 70000 beyond fp16: inf */
        qt_be_free(cpu, xc), qt_be_free(cpu, hc), qt_be_free(npu, xn), qt_be_free(npu, hn);
    }
    qt_backend_close(npu), qt_backend_close(cpu);
}

/* rows of the table, f32 / f16 / bf16, the same bits as the CPU's (the
 * backward is test_backend_parity's test_embedding) */
static void test_embedding_forward(void **state) {
    (void)state;
    qt_backend *cpu = NULL, *npu = open_npu("Ascend910B1");
    assert_int_equal(qt_backend_open("cpu", &cpu), QT_OK);
    enum { V = 61, C = 37, N = 23 };
    int32_t ids[N];
    for (int i = 0; i < N; i++) ids[i] = (i * 7) % V;
    ids[0] = V - 1; /* the last row */
    static float w[V * C], a[N * C], b[N * C];
    for (int i = 0; i < V * C; i++) w[i] = cosf((float)i) * 3.0f;
    const qt_dtype dts[] = {QT_F32, QT_F16, QT_BF16};
    for (int k = 0; k < 3; k++) {
        size_t wb = (size_t)V * C * qt_dtype_size(dts[k]);
        void *wc = qt_be_alloc(cpu, QT_MEM_DEVICE, wb, "w"), *wn = qt_be_alloc(npu, QT_MEM_DEVICE, wb, "w");
        float *f = qt_be_alloc(cpu, QT_MEM_DEVICE, sizeof w, "f");
        qt_be_upload(cpu, f, w, sizeof w);
        qt_be_convert(cpu, wc, dts[k], f, QT_F32, (size_t)V * C);
        void *h = malloc(wb);
        qt_be_download(cpu, h, wc, wb), qt_be_upload(npu, wn, h, wb); /* the same bits on both */
        int32_t *ic = qt_be_alloc(cpu, QT_MEM_DEVICE, sizeof ids, "i");
        int32_t *in = qt_be_alloc(npu, QT_MEM_DEVICE, sizeof ids, "i");
        qt_be_upload(cpu, ic, ids, sizeof ids), qt_be_upload(npu, in, ids, sizeof ids);
        float *oc = qt_be_alloc(cpu, QT_MEM_DEVICE, sizeof a, "o"), *on = qt_be_alloc(npu, QT_MEM_DEVICE, sizeof b, "o");
        qt_be_embedding_forward(cpu, oc, ic, wc, dts[k], N, C), qt_be_embedding_forward(npu, on, in, wn, dts[k], N, C);
        qt_be_download(cpu, a, oc, sizeof a), qt_be_download(npu, b, on, sizeof b);
        assert_memory_equal(a, b, sizeof a);
        free(h);
        qt_be_free(cpu, wc), qt_be_free(cpu, f), qt_be_free(cpu, ic), qt_be_free(cpu, oc);
        qt_be_free(npu, wn), qt_be_free(npu, in), qt_be_free(npu, on);
    }
    qt_backend_close(npu), qt_backend_close(cpu);
}

/* AdamW and Adam (L2) over a range, 3 steps: the CPU's loop, operator by
 * operator, within 1e-6 relative (test_backend_parity's bound) */
static void test_adam(void **state) {
    (void)state;
    qt_backend *cpu = NULL, *npu = open_npu("Ascend910B1");
    assert_int_equal(qt_backend_open("cpu", &cpu), QT_OK);
    enum { n = 4099 };
    static float h[4][n], a[n], b[n];
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < n; i++) h[j][i] = sinf((float)(i * (j + 3))) * (j >= 2 ? 0.1f : 1.0f);
    for (int i = 0; i < n; i++) h[3][i] = fabsf(h[3][i]); /* v >= 0 */
    for (int l2 = 0; l2 < 2; l2++) {
        float *c[4], *d[4];
        for (int j = 0; j < 4; j++) {
            c[j] = qt_be_alloc(cpu, QT_MEM_DEVICE, sizeof h[j], "t"), d[j] = qt_be_alloc(npu, QT_MEM_DEVICE, sizeof h[j], "t");
            qt_be_upload(cpu, c[j], h[j], sizeof h[j]), qt_be_upload(npu, d[j], h[j], sizeof h[j]);
        }
        qt_adam_scalars k = {0.1f, 0.999f, 0.001f, 6e-5f / 0.1f, sqrtf(0.001f), 1e-8f, 0.5f,
                             l2 ? 1.0f : 1.0f - 6e-5f * 0.01f, l2 ? 0.01f : 0.0f};
        for (int s = 0; s < 3; s++) {
            qt_be_adam(cpu, &k, c[0], c[1], c[2], c[3], n);
            qt_be_adam(npu, &k, d[0], d[1], d[2], d[3], n);
        }
        for (int j = 0; j < 4; j++) {
            if (j == 1) continue; /* the gradient is read only */
            qt_be_download(cpu, a, c[j], sizeof a), qt_be_download(npu, b, d[j], sizeof b);
            double err = 0, mx = 0;
            for (int i = 0; i < n; i++) err = fmax(err, fabs((double)a[i] - b[i])), mx = fmax(mx, fabs(a[i]));
            if (!(err <= 1e-6 * mx)) fail_msg("adam%s tensor %d: rel err %g", l2 ? " (L2)" : "W", j, err / mx);
        }
        for (int j = 0; j < 4; j++) qt_be_free(cpu, c[j]), qt_be_free(npu, d[j]);
    }
    qt_backend_close(npu), qt_backend_close(cpu);
}

/* x *= s, and its sum of squares: the same bits as the CPU's */
static void test_scale(void **state) {
    (void)state;
    qt_backend *cpu = NULL, *npu = open_npu("Ascend910B1");
    assert_int_equal(qt_backend_open("cpu", &cpu), QT_OK);
    enum { n = 333 };
    float h[n], a[n], b[n];
    for (int i = 0; i < n; i++) h[i] = sinf((float)i) * 1e3f;
    float *xc = qt_be_alloc(cpu, QT_MEM_DEVICE, sizeof h, "x"), *xn = qt_be_alloc(npu, QT_MEM_DEVICE, sizeof h, "x");
    qt_be_upload(cpu, xc, h, sizeof h), qt_be_upload(npu, xn, h, sizeof h);
    qt_be_scale(cpu, xc, n, 0.37f), qt_be_scale(npu, xn, n, 0.37f);
    qt_be_download(cpu, a, xc, sizeof a), qt_be_download(npu, b, xn, sizeof b);
    assert_memory_equal(a, b, sizeof a);
    double sc = qt_be_sum_squares(cpu, xc, n), sd = qt_be_sum_squares(npu, xn, n);
    assert_memory_equal(&sc, &sd, sizeof sc); /* the gradient norm's sum: the same bits */
    qt_be_free(cpu, xc), qt_be_free(npu, xn);
    qt_backend_close(npu), qt_backend_close(cpu);
}

/* round_store f16 (values beyond fp16 become inf: the loss scaler's
 * overflow) and round_to_dtype f16 / bf16: the CPU's bits, through two
 * aclnnCast calls (the stand-in's cast rounds to nearest even and makes
 * |x| >= 65520 inf, as the contract asks; a card's saturation mode is
 * scripts/npu-check's to check) */
static void test_round(void **state) {
    (void)state;
    qt_backend *cpu = NULL, *npu = open_npu("Ascend910B1");
    assert_int_equal(qt_backend_open("cpu", &cpu), QT_OK);
    enum { n = 2000 };
    static float h[n], a[n], b[n];
    static uint16_t ha[n], hb[n];
    for (int i = 0; i < n; i++) h[i] = ldexpf(sinf((float)i * 1.37f), i % 48 - 28) * 3.0f;
    h[0] = 65520.0f, h[1] = -1e6f, h[2] = 65519.0f, h[3] = NAN;
    for (int k = 0; k < 3; k++) {
        qt_dtype dt = k == 2 ? QT_BF16 : QT_F16;
        float *xc = qt_be_alloc(cpu, QT_MEM_DEVICE, sizeof h, "x"), *xn = qt_be_alloc(npu, QT_MEM_DEVICE, sizeof h, "x");
        uint16_t *dc = qt_be_alloc(cpu, QT_MEM_DEVICE, sizeof ha, "d");
        uint16_t *dn = qt_be_alloc(npu, QT_MEM_DEVICE, sizeof hb, "d");
        qt_be_upload(cpu, xc, h, sizeof h), qt_be_upload(npu, xn, h, sizeof h);
        if (k == 0) {
            qt_be_round_store(cpu, xc, dc, n, dt), qt_be_round_store(npu, xn, dn, n, dt);
            qt_be_download(cpu, ha, dc, sizeof ha), qt_be_download(npu, hb, dn, sizeof hb);
            assert_memory_equal(ha, hb, sizeof ha);
        } else {
            qt_be_round_to_dtype(cpu, xc, n, dt), qt_be_round_to_dtype(npu, xn, n, dt);
        }
        qt_be_download(cpu, a, xc, sizeof a), qt_be_download(npu, b, xn, sizeof b);
        assert_memory_equal(a, b, sizeof a);
        if (dt == QT_F16) assert_true(isinf(b[0]) && isinf(b[1]) && !isinf(b[2]));
        qt_be_free(cpu, xc), qt_be_free(cpu, dc), qt_be_free(npu, xn), qt_be_free(npu, dn);
    }
    qt_backend_close(npu), qt_backend_close(cpu);
}

/* status of fn(be) run in a child, its stderr in err */
static int in_child(const char *soc, void (*fn)(qt_backend *), char *err, size_t cap) {
    int p[2];
    assert_int_equal(pipe(p), 0);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(p[1], 2);
        close(p[0]);
        fn(open_npu(soc));
        _exit(0);
    }
    close(p[1]);
    ssize_t got = read(p[0], err, cap - 1), more;
    char sink[256];
    while ((more = read(p[0], sink, sizeof sink)) > 0) {}
    err[got > 0 ? got : 0] = 0;
    close(p[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}
static void call_q4(qt_backend *be) {
    float *p = qt_be_alloc(be, QT_MEM_DEVICE, 256, "p");
    qt_be_zero(be, p, 256);
    qt_be_matmul_forward(be, p, p, p, QT_Q4, NULL, 1, 4, 4, 1.0f, 0, p);
}
static void call_bf16(qt_backend *be) {
    float *x = qt_be_alloc(be, QT_MEM_DEVICE, 64, "x");
    qt_be_zero(be, x, 64);
    qt_be_convert(be, x + 8, QT_BF16, x, QT_F32, 4);
}
static void call_round_bf16(qt_backend *be) {
    float *x = qt_be_alloc(be, QT_MEM_DEVICE, 64, "x");
    qt_be_zero(be, x, 64);
    qt_be_round_to_dtype(be, x, 16, QT_BF16);
}
static void call_attention(qt_backend *be) {
    float *x = qt_be_alloc(be, QT_MEM_DEVICE, 4096, "x");
    qt_be_zero(be, x, 4096);
    qt_be_attention_forward(be, x + 512, x + 768, x, x + 128, x + 256, NULL, 1, 2, 2, 1, 16);
}
static void test_refusals(void **state) {
    (void)state;
    char err[1024];
    assert_int_equal(in_child("Ascend910A", call_attention, err, sizeof err), 1);
    assert_non_null(strstr(err, "attention runs through aclnnFlashAttentionScore, which CANN documents for Atlas A2"));
    assert_non_null(strstr(err, "this NPU is Ascend910A"));
    assert_int_equal(in_child("Ascend910A", call_round_bf16, err, sizeof err), 1);
    assert_non_null(strstr(err, "(Ascend910A) has no bfloat16"));
    assert_int_equal(in_child("Ascend910B1", call_q4, err, sizeof err), 1);
    assert_non_null(strstr(err, "has no matmul on quantized weights yet"));
    assert_int_equal(in_child("Ascend910A", call_bf16, err, sizeof err), 1);
    assert_non_null(strstr(err, "(Ascend910A) has no bfloat16"));
    assert_int_equal(in_child("Ascend910B1", call_bf16, err, sizeof err), 0); /* the 910B has it */
}

/* a card without fp32 KEEP_DTYPE (the stand-in refuses it there): the
 * backend asks for ALLOW_FP32_DOWN_PRECISION, the inputs become fp16 */
static void test_fp16_cube(void **state) {
    (void)state;
    qt_backend *cpu = NULL, *npu = open_npu("Ascend910A");
    assert_int_equal(qt_backend_open("cpu", &cpu), QT_OK);
    enum { N = 3, IN = 5, OUT = 2 };
    float x[N * IN], w[OUT * IN], o[N * OUT];
    for (int i = 0; i < N * IN; i++) x[i] = 1.0f + (float)i / 4096.0f; /* not fp16 values: 1 + i/4096 */
    for (int i = 0; i < OUT * IN; i++) w[i] = 1.0f;
    float *xd = qt_be_alloc(npu, QT_MEM_DEVICE, sizeof x, "x"), *wd = qt_be_alloc(npu, QT_MEM_DEVICE, sizeof w, "w");
    float *od = qt_be_alloc(npu, QT_MEM_DEVICE, sizeof o, "o"), *ws = qt_be_alloc(npu, QT_MEM_DEVICE, sizeof w, "ws");
    qt_be_upload(npu, xd, x, sizeof x), qt_be_upload(npu, wd, w, sizeof w);
    qt_be_matmul_forward(npu, od, xd, wd, QT_F32, NULL, N, IN, OUT, 1.0f, 0, ws);
    qt_be_download(npu, o, od, sizeof o);
    for (int r = 0; r < N; r++) {
        float want = 0.0f; /* each x rounded to fp16 (11 bits: steps of 1/1024 near 1) */
        for (int i = 0; i < IN; i++) want += rintf(x[r * IN + i] * 1024.0f) / 1024.0f;
        assert_float_equal(o[r * OUT], want, 1e-6);
    }
    qt_backend_close(npu), qt_backend_close(cpu);
}

/* The stand-in's fused attention keeps the documents' rules, so the backend
 * is held to them: called directly (not through the backend), a correct call
 * is taken; a causal mode without its mask, a head count that is not the
 * query's, statistics not (B, N, Sq, 8), softmaxIn not null, or a card
 * outside Atlas A2 are refused; a compressed mask that is not the
 * triangle gives NaN outputs. */
static void test_standin_attention_rules(void **state) {
    (void)state;
    qt_backend *npu = open_npu("Ascend910B1"); /* aclInit and the device */
    const qt_acl_api *acl = qt_acl_load();
    assert_non_null(acl);
    enum { B = 1, S = 4, N = 2, D = 8, M = 2048 };
    float *q, *k, *v, *o, *mx, *sm;
    uint8_t *mask;
    const size_t nq = (size_t)B * S * N * D, ns = (size_t)B * N * S * 8;
    void **bufs[] = {(void **)&q, (void **)&k, (void **)&v, (void **)&o, (void **)&mx, (void **)&sm};
    size_t sizes[] = {nq, nq, nq, nq, ns, ns};
    for (int i = 0; i < 6; i++) {
        assert_int_equal(acl->aclrtMalloc(bufs[i], sizes[i] * sizeof(float), ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
        float *h = calloc(sizes[i], sizeof(float));
        for (size_t j = 0; j < sizes[i]; j++) h[j] = sinf((float)(j + 7 * i));
        assert_int_equal(acl->aclrtMemcpy(*bufs[i], sizes[i] * sizeof(float), h, sizes[i] * sizeof(float),
                                          ACL_MEMCPY_HOST_TO_DEVICE), ACL_SUCCESS);
        free(h);
    }
    assert_int_equal(acl->aclrtMalloc((void **)&mask, (size_t)M * M, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
    uint8_t *tri = malloc((size_t)M * M);
    for (size_t i = 0; i < M; i++)
        for (size_t j = 0; j < M; j++) tri[i * M + j] = j > i;
    assert_int_equal(acl->aclrtMemcpy(mask, (size_t)M * M, tri, (size_t)M * M, ACL_MEMCPY_HOST_TO_DEVICE), ACL_SUCCESS);
    int64_t dq[4] = {B, S, N, D}, dst[4] = {B, N, S, 8}, bad[4] = {B, N, S, 1}, dm[2] = {M, M};
    int64_t sq[4] = {S * N * D, N * D, D, 1}, sst[4] = {N * S * 8, S * 8, 8, 1}, sb[4] = {N * S, S, 1, 1};
    int64_t smk[2] = {M, 1};
    int64_t nqe = (int64_t)nq, nse = (int64_t)ns, nme = (int64_t)M * M;
#define T4(p, dims, st, n) acl->aclCreateTensor(dims, 4, ACL_FLOAT, st, 0, ACL_FORMAT_ND, &n, 1, p)
    aclTensor *Q = T4(q, dq, sq, nqe), *K = T4(k, dq, sq, nqe), *V = T4(v, dq, sq, nqe), *O = T4(o, dq, sq, nqe);
    aclTensor *MX = T4(mx, dst, sst, nse), *SM = T4(sm, dst, sst, nse), *BAD = T4(mx, bad, sb, nse);
    aclTensor *MK = acl->aclCreateTensor(dm, 2, ACL_UINT8, smk, 0, ACL_FORMAT_ND, &nme, 1, mask);
#undef T4
    char layout[] = "BSND";
    uint64_t ws = 0;
    aclOpExecutor *ex = NULL;
#define FA(mask_, heads, mode, mxt)                                                                                  \
    acl->aclnnFlashAttentionScoreGetWorkspaceSize(Q, K, V, NULL, NULL, NULL, mask_, NULL, 0.35, 1.0, 2147483647,   \
                                                  2147483647, heads, layout, 0, mode, mxt, SM, NULL, O, &ws, &ex)
    assert_int_equal(FA(NULL, N, 3, MX), ACLNN_ERR_PARAM_INVALID); /* a causal mode without its mask */
    assert_int_equal(FA(MK, 3, 3, MX), ACLNN_ERR_PARAM_INVALID);   /* headNum not the query's N */
    assert_int_equal(FA(MK, N, 3, BAD), ACLNN_ERR_PARAM_INVALID);  /* softmaxMax not (B, N, Sq, 8) */
    assert_int_equal(acl->aclnnFlashAttentionScoreGradGetWorkspaceSize(
                         Q, K, V, O, NULL, NULL, NULL, MK, MX, SM, O /* softmaxIn */, O, NULL, 0.35, 1.0, 2147483647,
                         2147483647, N, layout, 0, 3, Q, K, V, NULL, &ws, &ex),
                     ACLNN_ERR_PARAM_INVALID);
    setenv("QTUNE_ACL_STANDIN_SOC", "Ascend910A", 1);
    assert_int_equal(FA(MK, N, 3, MX), ACLNN_ERR_PARAM_INVALID); /* not an Atlas A2 card */
    setenv("QTUNE_ACL_STANDIN_SOC", "Ascend910B1", 1);
    aclrtStream st = NULL;
    assert_int_equal(acl->aclrtCreateStream(&st), ACL_SUCCESS);
    void *w = NULL;
    float out[2][B * S * N * D];
    for (int wrong = 0; wrong < 2; wrong++) { /* the triangle, then a mask that is not it */
        if (wrong) {
            tri[5] = 1 - tri[5];
            assert_int_equal(acl->aclrtMemcpy(mask, (size_t)M * M, tri, (size_t)M * M, ACL_MEMCPY_HOST_TO_DEVICE),
                             ACL_SUCCESS);
        }
        assert_int_equal(FA(MK, N, 3, MX), ACLNN_SUCCESS);
        if (!w) assert_int_equal(acl->aclrtMalloc(&w, ws, ACL_MEM_MALLOC_HUGE_FIRST), ACL_SUCCESS);
        assert_int_equal(acl->aclnnFlashAttentionScore(w, ws, ex, st), ACLNN_SUCCESS);
        assert_int_equal(acl->aclrtSynchronizeStream(st), ACL_SUCCESS);
        assert_int_equal(
            acl->aclrtMemcpy(out[wrong], sizeof out[wrong], o, sizeof out[wrong], ACL_MEMCPY_DEVICE_TO_HOST), ACL_SUCCESS);
    }
#undef FA
    assert_false(isnan(out[0][0]));
    for (int d = 0; d < D; d++) assert_float_equal(out[0][d], sinf((float)(d + 14)), 1e-6); /* query 0: v's row 0 */
    assert_true(isnan(out[1][0]));
    aclTensor *tt[] = {Q, K, V, O, MX, SM, BAD, MK};
    for (size_t i = 0; i < sizeof tt / sizeof tt[0]; i++) acl->aclDestroyTensor(tt[i]);
    acl->aclrtDestroyStream(st);
    void *all[] = {q, k, v, o, mx, sm, mask, w};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) acl->aclrtFree(all[i]);
    free(tri);
    qt_backend_close(npu);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_absent_library), cmocka_unit_test(test_table_is_complete),
        cmocka_unit_test(test_device_values),  cmocka_unit_test(test_convert), cmocka_unit_test(test_scale),
        cmocka_unit_test(test_embedding_forward), cmocka_unit_test(test_adam), cmocka_unit_test(test_round),
        cmocka_unit_test(test_refusals),       cmocka_unit_test(test_fp16_cube),
        cmocka_unit_test(test_standin_attention_rules),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
