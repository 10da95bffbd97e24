/* dist in an MPI build started without mpirun: rank 0 of 1 through the same
 * code the ranks use (the multi-rank behaviour is tested under real mpirun by
 * tests/dist/test_dist.py). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/mem.h"
#include "dist/dist.h"

static dist_ctx *solo(void) {
    unsetenv("OMPI_COMM_WORLD_SIZE");
    unsetenv("PMIX_RANK");
    unsetenv("PMI_RANK");
    dist_ctx *d = NULL;
    assert_int_equal(dist_init(NULL, NULL, &d), QT_OK);
    return d;
}

static void test_solo_rank(void **state) {
    (void)state;
    dist_ctx *d = solo();
    assert_int_equal(dist_world(d), 1);
    assert_true(dist_is_main(d));
    int64_t t[2] = {5, 7};
    assert_int_equal(dist_allreduce_i64(d, t, 2, DIST_MAX, "tokens"), QT_OK);
    assert_true(t[0] == 5 && t[1] == 7);
    char buf[4] = "abc";
    assert_int_equal(dist_bcast(d, buf, 4, 0, "bytes"), QT_OK);
    assert_int_equal(dist_bcast(d, buf, 4, 1, "bytes"), QT_EINVAL);
    assert_int_equal(dist_barrier(d, "b"), QT_OK);
    double many[65];
    assert_int_equal(dist_allreduce_f64(d, many, 65, DIST_SUM, "too many"), QT_EINVAL);
    dist_finalize(d);
}

static void test_plan_ranges(void **state) {
    (void)state;
    dist_ctx *d = solo();
    zero_plan *p;
    zero_opts o = {.stage = 4};
    assert_int_equal(zero_plan_create(d, 100, &o, &p), QT_EUNSUPPORTED);
    assert_non_null(strstr(qt_error_message(), "stage 4"));
    o = (zero_opts){.stage = 2, .bucket_elems = 30};
    assert_int_equal(zero_plan_create(d, 100, &o, &p), QT_OK);
    assert_int_equal(zero_n_buckets(p), 4);
    size_t lo, hi;
    zero_bucket_range(p, 3, &lo, &hi);
    assert_true(lo == 90 && hi == 100);
    zero_shard_of(p, 0, &lo, &hi);
    assert_true(lo == 0 && hi == 100);
    zero_opt_range(p, &lo, &hi);
    assert_true(lo == 0 && hi == 100);
    /* device placement is counted apart from host placement */
    zero_state st;
    assert_int_equal(zero_state_alloc(p, 3, &st), QT_OK);
    assert_int_equal(zero_state_bytes_device(p), 3 * 100 * 4);
    assert_int_equal(zero_state_bytes_host(p), 0);
    assert_int_equal(st.on_host, 0);
    for (int s = 0; s < 3; s++)
        for (int i = 0; i < 100; i++) assert_true(st.slot[s][i] == 0.0f);
    assert_int_equal(zero_state_gather(p, &st, 3, NULL), QT_EINVAL);
    /* checkpoint parts: one rank writes the one part, its whole state */
    int index, count;
    zero_ckpt_part(p, &index, &count, &lo, &hi);
    assert_true(index == 0 && count == 1 && lo == 0 && hi == 100);
    float *view = NULL;
    assert_int_equal(zero_state_view(p, &st, 2, &view), QT_OK);
    assert_ptr_equal(view, st.slot[2]);
    assert_int_equal(zero_state_view(p, &st, 3, &view), QT_EINVAL);
    assert_null(view);
    /* ranges: scatter 10 values into [40, 50) of slot 1, read them back */
    float in[10], out[10];
    for (int i = 0; i < 10; i++) in[i] = (float)i + 0.5f;
    assert_int_equal(zero_state_scatter_range(p, &st, 1, 40, 50, in), QT_OK);
    assert_true(st.slot[1][40] == 0.5f && st.slot[1][49] == 9.5f && st.slot[1][39] == 0.0f);
    assert_int_equal(zero_state_gather_range(p, &st, 1, 40, 50, out), QT_OK);
    assert_memory_equal(in, out, sizeof in);
    assert_int_equal(zero_state_gather_range(p, &st, 1, 95, 101, out), QT_EINVAL);
    assert_int_equal(zero_state_gather_range(p, &st, 1, 60, 50, out), QT_EINVAL);
    zero_state_free(p, &st);
    assert_int_equal(zero_state_bytes_device(p), 0);
    double v = 2;
    assert_int_equal(zero_reduce_partial(p, &v, 1, DIST_SUM, "x"), QT_OK);
    assert_true(v == 2);
    zero_plan_free(p);
    /* an empty block is legal (LoRA with no targets matched is caught elsewhere) */
    assert_int_equal(zero_plan_create(d, 0, &o, &p), QT_OK);
    assert_int_equal(zero_n_buckets(p), 0);
    zero_plan_free(p);
    dist_finalize(d);
}

static void test_overflow_flag(void **state) {
    (void)state;
    dist_ctx *d = solo();
    zero_plan *p;
    zero_opts o = {.stage = 2, .offload = 1};
    assert_int_equal(zero_plan_create(d, 8, &o, &p), QT_OK);
    float g[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    double sq;
    int of;
    assert_int_equal(dist_step_gradients(d, p, g, &sq, &of), QT_OK);
    assert_true(sq == 204.0 && of == 0);
    g[5] = 1.0f / 0.0f;
    assert_int_equal(dist_step_gradients(d, p, g, &sq, &of), QT_OK);
    assert_int_equal(of, 1);
    zero_plan_free(p);
    dist_finalize(d);
}

/* A gradient block large enough for the parallel sum of squares: the same
 * bits at 1, 2 and 3 threads, equal to a long-double sum to rounding, and
 * an inf deep inside one piece still flags the overflow. */
static void test_grad_norm_threads(void **state) {
    (void)state;
    dist_ctx *d = solo();
    const size_t n = ((size_t)3 << 20) + 77;
    zero_plan *p;
    zero_opts o = {.stage = 0};
    assert_int_equal(zero_plan_create(d, n, &o, &p), QT_OK);
    float *g = qt_alloc_aligned(n * sizeof *g, "test gradients");
    assert_non_null(g);
    long double want = 0;
    for (size_t i = 0; i < n; i++) {
        g[i] = (float)((i * 2654435761u) % 2001) * 1e-3f - 1.0f;
        want += (long double)g[i] * g[i];
    }
    double sq[3];
    int of;
    const int threads = omp_get_max_threads();
    for (int t = 1; t <= 3; t++) {
        omp_set_num_threads(t);
        assert_int_equal(dist_step_gradients(d, p, g, &sq[t - 1], &of), QT_OK);
        assert_int_equal(of, 0);
    }
    omp_set_num_threads(threads);
    assert_true(sq[0] == sq[1] && sq[1] == sq[2]);
    assert_true(fabs(sq[0] - (double)want) <= 1e-12 * (double)want);
    g[n / 2 + 3] = 1.0f / 0.0f;
    assert_int_equal(dist_step_gradients(d, p, g, &sq[0], &of), QT_OK);
    assert_int_equal(of, 1);
    qt_free(g);
    zero_plan_free(p);
    dist_finalize(d);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_solo_rank),
        cmocka_unit_test(test_plan_ranges),
        cmocka_unit_test(test_overflow_flag),
        cmocka_unit_test(test_grad_norm_threads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
