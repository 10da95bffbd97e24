/* The backend interface (src/backend/backend.h): the registry, the
 * descriptor's workspace formulas against the CPU kernels' own, LoRA dropout's
 * counter-based masks, and the guard backend (device memory the host cannot
 * touch; its ops give the cpu's bits). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <omp.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backend/backend.h"
#include "backend/cpu/ops.h"
#include "core/error.h"
#include "core/rng.h"

static void test_registry(void **state) {
    (void)state;
    qt_backend *be;
    assert_int_equal(qt_backend_open("cpu", &be), QT_OK);
    assert_string_equal(qt_be_desc(be)->name, "cpu");
    assert_int_equal(qt_be_desc(be)->host_reads_device, 1);
    qt_backend_close(be);
    assert_int_equal(qt_backend_open("guard", &be), QT_OK);
    assert_string_equal(qt_be_desc(be)->name, "guard");
    assert_int_equal(qt_be_desc(be)->host_reads_device, 0);
    qt_backend_close(be);
    assert_int_equal(qt_backend_open("tpu", &be), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "\"tpu\" is not compiled in"));
    assert_null(qt_backend_desc_of("tpu"));
    setenv("QTUNE_BACKEND", "guard", 1);
    assert_string_equal(qt_backend_default_name(), "guard");
    assert_string_equal(qt_backend_desc_of(NULL)->name, "guard");
    unsetenv("QTUNE_BACKEND");
    assert_string_equal(qt_backend_default_name(), "cpu");
}

/* The plan sizes workspaces from the descriptor alone: its formulas must be
 * the kernels' own, for every shape the model uses. */
static void test_descriptor_formulas(void **state) {
    (void)state;
    const qt_backend_desc *d = qt_backend_desc_of("cpu");
    const int sizes[] = {1, 7, 64, 896, 4864, 151936};
    for (int a = 0; a < 6; a++)
        for (int b = 0; b < 6; b++) {
            assert_int_equal(qt_be_matmul_ws_floats(d, sizes[a], sizes[b]), op_matmul_ws_floats(sizes[a], sizes[b]));
            assert_int_equal(qt_be_lmhead_ce_ws_floats(d, sizes[a], sizes[b]),
                             op_lmhead_ce_ws_floats(sizes[a], sizes[b]));
            assert_int_equal(qt_be_lmhead_ce_kept_floats(d, sizes[a], sizes[b]),
                             op_lmhead_ce_kept_floats(sizes[a], sizes[b]));
        }
}

/* The mask of an element is a pure function of (seed, micro step, layer,
 * module, index): the same whatever n and thread count, different across
 * streams, dropping a fraction p, scaling the kept by 1/(1-p). */
static void test_dropout_masks(void **state) {
    (void)state;
    qt_backend *be;
    assert_int_equal(qt_backend_open("cpu", &be), QT_OK);
    const size_t n = 1 << 20;
    float *one = malloc(n * 4), *a = malloc(n * 4), *b = malloc(n * 4);
    for (size_t i = 0; i < n; i++) one[i] = 1.0f;
    const float p = 0.1f, ks = 1.0f / (1.0f - p);
    qt_dropout_key k = {42, 7, 3, 2};
    int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    qt_be_dropout(be, a, one, n, &k, qt_dropout_threshold(p), ks);
    omp_set_num_threads(3);
    qt_be_dropout(be, b, one, 1000, &k, qt_dropout_threshold(p), ks); /* a prefix, other threads */
    omp_set_num_threads(saved);
    assert_memory_equal(a, b, 1000 * 4);
    size_t dropped = 0;
    for (size_t i = 0; i < n; i++) {
        assert_true(a[i] == 0.0f || a[i] == ks);
        dropped += a[i] == 0.0f;
        assert_true((a[i] == 0.0f) == (qt_dropout_u24(&k, i) < qt_dropout_threshold(p)));
    }
    /* binomial: sd = sqrt(p (1-p) / n) = 2.9e-4 */
    assert_true(fabs((double)dropped / n - p) < 2e-3);
    /* each field of the key changes the mask (agreement ~ 1 - 2p(1-p) = 0.82, never all) */
    qt_dropout_key other[4] = {{43, 7, 3, 2}, {42, 8, 3, 2}, {42, 7, 4, 2}, {42, 7, 3, 3}};
    for (int o = 0; o < 4; o++) {
        qt_be_dropout(be, b, one, n, &other[o], qt_dropout_threshold(p), ks);
        size_t same = 0;
        for (size_t i = 0; i < n; i++) same += (a[i] == 0.0f) == (b[i] == 0.0f);
        assert_true(fabs((double)same / n - 0.82) < 5e-3);
    }
    /* the thresholds: p = 0 keeps all, u24 / 2^24 < p exactly as a uniform draw */
    assert_int_equal(qt_dropout_threshold(0.0f), 0);
    assert_int_equal(qt_dropout_threshold(0.5f), 1u << 23);
    assert_int_equal(qt_dropout_threshold(0.1f), 1677722); /* ceil(0.1f * 2^24) */
    free(one), free(a), free(b);
    qt_backend_close(be);
}

/* A host touch of guard device memory kills the process with SIGSEGV. */
static int touch_dies(qt_backend *be, float *dev, int write) {
    pid_t pid = fork();
    if (pid == 0) {
        volatile float *v = dev;
        if (write) v[3] = 1.0f;
        else (void)v[3];
        _exit(0);
    }
    int st;
    waitpid(pid, &st, 0);
    (void)be;
    return WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV;
}

static void test_guard_memory(void **state) {
    (void)state;
    qt_backend *g;
    assert_int_equal(qt_backend_open("guard", &g), QT_OK);
    enum { N = 5000 };
    float host[N], back[N];
    for (int i = 0; i < N; i++) host[i] = (float)i * 0.5f;
    float *d = qt_be_alloc(g, QT_MEM_DEVICE, sizeof host, "test");
    assert_non_null(d);
    qt_be_upload(g, d, host, sizeof host);
    qt_be_scale(g, d, N, 2.0f); /* an op reaches it */
    qt_be_download(g, back, d, sizeof back);
    for (int i = 0; i < N; i++) assert_true(back[i] == (float)i);
    assert_true(touch_dies(g, d, 0));
    assert_true(touch_dies(g, d, 1));
    /* host placements stay host memory */
    float *h = qt_be_alloc(g, QT_MEM_PINNED, 64, "pinned");
    h[0] = 1.0f;
    qt_be_free(g, h);
    qt_be_free(g, d);
    assert_true(touch_dies(g, d, 0)); /* after free too */
    qt_backend_close(g);
}

/* The guard runs the cpu's kernels: the same bits. */
static void test_guard_matches_cpu(void **state) {
    (void)state;
    qt_backend *c, *g;
    assert_int_equal(qt_backend_open("cpu", &c), QT_OK);
    assert_int_equal(qt_backend_open("guard", &g), QT_OK);
    enum { NR = 6, IN = 40, OUT = 24 };
    float x[NR * IN], w[OUT * IN], yc[NR * OUT], yg[NR * OUT];
    qt_rng r;
    qt_rng_seed(&r, 5);
    for (int i = 0; i < NR * IN; i++) x[i] = qt_rng_normal(&r);
    for (int i = 0; i < OUT * IN; i++) w[i] = qt_rng_normal(&r);
    float *dx = qt_be_alloc(g, QT_MEM_DEVICE, sizeof x, "x"), *dw = qt_be_alloc(g, QT_MEM_DEVICE, sizeof w, "w"),
          *dy = qt_be_alloc(g, QT_MEM_DEVICE, sizeof yg, "y");
    qt_be_upload(g, dx, x, sizeof x);
    qt_be_upload(g, dw, w, sizeof w);
    qt_be_matmul_forward(c, yc, x, w, QT_F32, NULL, NR, IN, OUT, 1.0f, 0, NULL);
    qt_be_matmul_forward(g, dy, dx, dw, QT_F32, NULL, NR, IN, OUT, 1.0f, 0, NULL);
    qt_be_download(g, yg, dy, sizeof yg);
    assert_memory_equal(yc, yg, sizeof yc);
    double sc = qt_be_sum_squares(c, x, NR * IN), sg = qt_be_sum_squares(g, dx, NR * IN);
    assert_memory_equal(&sc, &sg, sizeof sc);
    qt_be_free(g, dx), qt_be_free(g, dw), qt_be_free(g, dy);
    qt_backend_close(c);
    qt_backend_close(g);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_registry),         cmocka_unit_test(test_descriptor_formulas),
        cmocka_unit_test(test_dropout_masks),    cmocka_unit_test(test_guard_memory),
        cmocka_unit_test(test_guard_matches_cpu),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
