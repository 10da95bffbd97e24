/* dist without MPI: a single process that behaves as rank 0 of 1, and a
 * clear refusal when launched as one of several ranks. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "dist/dist.h"

static void test_single_process(void **state) {
    (void)state;
    unsetenv("OMPI_COMM_WORLD_SIZE");
    dist_ctx *d = NULL;
    assert_int_equal(dist_init(NULL, NULL, &d), QT_OK);
    assert_int_equal(dist_world(d), 1);
    assert_int_equal(dist_rank(d), 0);
    assert_true(dist_is_main(d));
    assert_int_equal(dist_uses_mpi(d), 0);
    assert_int_equal(dist_built_with_mpi(), 0);
    double v[2] = {1.5, -2};
    assert_int_equal(dist_allreduce_f64(d, v, 2, DIST_SUM, "x"), QT_OK);
    assert_true(v[0] == 1.5 && v[1] == -2);
    zero_plan *p;
    zero_opts o = {.stage = 2, .offload = 1, .bucket_elems = 7};
    assert_int_equal(zero_plan_create(d, 50, &o, &p), QT_OK);
    size_t lo, hi;
    zero_opt_range(p, &lo, &hi);
    assert_true(lo == 0 && hi == 50);
    float g[50], w[50];
    for (int i = 0; i < 50; i++) g[i] = w[i] = (float)i;
    double sq;
    int of;
    assert_int_equal(dist_step_gradients(d, p, g, &sq, &of), QT_OK);
    assert_true(g[49] == 49.0f && of == 0);
    assert_true(sq == 40425.0); /* sum of i^2, i < 50 */
    assert_int_equal(dist_allgather_params(d, p, w), QT_OK);
    zero_state st;
    assert_int_equal(zero_state_alloc(p, 2, &st), QT_OK);
    assert_int_equal(zero_state_bytes_host(p), 2 * 50 * 4);
    float full[50];
    assert_int_equal(zero_state_scatter(p, &st, 1, g), QT_OK);
    assert_int_equal(zero_state_gather(p, &st, 1, full), QT_OK);
    assert_memory_equal(full, g, sizeof full);
    zero_state_free(p, &st);
    assert_int_equal(zero_state_bytes_host(p), 0);
    zero_plan_free(p);
    dist_finalize(d);
}

static void test_refuses_ranks(void **state) {
    (void)state;
    setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
    dist_ctx *d = NULL;
    assert_int_equal(dist_init(NULL, NULL, &d), QT_EDIST);
    assert_null(d);
    assert_non_null(strstr(qt_error_message(), "built without MPI"));
    assert_non_null(strstr(qt_error_message(), "4 ranks"));
    unsetenv("OMPI_COMM_WORLD_SIZE");
}

static void test_bad_timeout(void **state) {
    (void)state;
    setenv("QTUNE_DIST_TIMEOUT", "soon", 1);
    dist_ctx *d = NULL;
    assert_int_equal(dist_init(NULL, NULL, &d), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "QTUNE_DIST_TIMEOUT"));
    setenv("QTUNE_DIST_TIMEOUT", "2.5", 1);
    assert_int_equal(dist_init(NULL, NULL, &d), QT_OK);
    assert_true(dist_timeout(d) == 2.5);
    dist_finalize(d);
    unsetenv("QTUNE_DIST_TIMEOUT");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_single_process),
        cmocka_unit_test(test_refuses_ranks),
        cmocka_unit_test(test_bad_timeout),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
