/* model/sample: greedy, temperature, top-k and top-p against the
 * distributions they define, drawn with a seeded qt_rng. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "core/error.h"
#include "core/rng.h"
#include "model/sample.h"

#include <math.h>
#include <string.h>

static void test_argmax_ties_pick_lowest(void **state) {
    (void)state;
    float x[5] = {1, 3, 2, 3, -1};
    assert_int_equal(qt_argmax(x, 5), 1);
    qt_sampler s;
    assert_int_equal(qt_sampler_init(&s, 5), QT_OK);
    qt_sample_opts o = {0, 0, 1};
    qt_rng r;
    qt_rng_seed(&r, 1);
    assert_int_equal(qt_sample(&s, x, &o, &r), 1);
    qt_sampler_free(&s);
    /* negative values, -0 against +0 (a tie: the first), infinities, NaN never the largest */
    float n[4] = {-3, -1, -2, -1};
    assert_int_equal(qt_argmax(n, 4), 1);
    float z[3] = {-1, -0.0f, 0.0f};
    assert_int_equal(qt_argmax(z, 3), 1);
    float inf[4] = {-INFINITY, 5, INFINITY, 7};
    assert_int_equal(qt_argmax(inf, 4), 2);
    float all_neg_inf[2] = {-INFINITY, -INFINITY};
    assert_int_equal(qt_argmax(all_neg_inf, 2), 0);
    float nan1[4] = {NAN, -5, 2, NAN};
    assert_int_equal(qt_argmax(nan1, 4), 2);
    float nans[2] = {NAN, NAN};
    assert_int_equal(qt_argmax(nans, 2), 0);
    /* a long row (the vectorised passes and their tails): the largest near the end, then a tie before it */
    float big[1003];
    for (int i = 0; i < 1003; i++) big[i] = -1000.0f + (float)(i % 97);
    big[1001] = 500.0f;
    assert_int_equal(qt_argmax(big, 1003), 1001);
    big[17] = 500.0f;
    assert_int_equal(qt_argmax(big, 1003), 17);
    /* the index pass goes a block of 256 at a time: the first of a tie across a block's edge, the last element
     * of a short last block, and a -0 / +0 tie in a later block */
    big[17] = 0.0f, big[1001] = 0.0f;
    big[255] = 600.0f, big[256] = 600.0f;
    assert_int_equal(qt_argmax(big, 1003), 255);
    big[1002] = 700.0f;
    assert_int_equal(qt_argmax(big, 1003), 1002);
    for (int i = 0; i < 1003; i++) big[i] = -1.0f;
    big[700] = -0.0f, big[900] = 0.0f;
    assert_int_equal(qt_argmax(big, 1003), 700);
}

/* frequencies of n draws against softmax(x / t) restricted as the options say */
static void check_freq(const float *x, int V, qt_sample_opts o, const double *want, int n) {
    qt_sampler s;
    assert_int_equal(qt_sampler_init(&s, V), QT_OK);
    qt_rng r;
    qt_rng_seed(&r, 1234);
    int count[16] = {0};
    for (int i = 0; i < n; i++) count[qt_sample(&s, x, &o, &r)]++;
    for (int v = 0; v < V; v++) {
        double f = (double)count[v] / n, sd = sqrt(want[v] * (1 - want[v]) / n);
        if (want[v] == 0) assert_int_equal(count[v], 0);
        else assert_true(fabs(f - want[v]) < 5 * sd + 1e-9);
    }
    qt_sampler_free(&s);
}

static void test_temperature_top_k_top_p(void **state) {
    (void)state;
    const float x[4] = {2.0f, 1.0f, 0.0f, -1.0f};
    double p[4], z = 0;
    /* temperature 2: softmax(x / 2) */
    for (int i = 0; i < 4; i++) z += exp(x[i] / 2);
    for (int i = 0; i < 4; i++) p[i] = exp(x[i] / 2) / z;
    check_freq(x, 4, (qt_sample_opts){2.0f, 0, 1.0f}, p, 200000);
    /* top-k 2 at temperature 1: the two largest, renormalised */
    double k2[4] = {exp(2) / (exp(2) + exp(1)), exp(1) / (exp(2) + exp(1)), 0, 0};
    check_freq(x, 4, (qt_sample_opts){1.0f, 2, 1.0f}, k2, 200000);
    /* top-p: probabilities at t=1 are .644 .237 .087 .032; p = 0.85 keeps the
     * first two (.644 < .85 <= .881), p = 0.5 keeps only the first */
    check_freq(x, 4, (qt_sample_opts){1.0f, 0, 0.85f}, k2, 200000);
    double one[4] = {1, 0, 0, 0};
    check_freq(x, 4, (qt_sample_opts){1.0f, 0, 0.5f}, one, 1000);
}

static void test_seeded(void **state) {
    (void)state;
    float x[8];
    for (int i = 0; i < 8; i++) x[i] = (float)(i % 3);
    qt_sampler s;
    assert_int_equal(qt_sampler_init(&s, 8), QT_OK);
    qt_sample_opts o = {1.0f, 0, 1.0f};
    qt_rng a, b;
    qt_rng_seed(&a, 9);
    qt_rng_seed(&b, 9);
    for (int i = 0; i < 100; i++) assert_int_equal(qt_sample(&s, x, &o, &a), qt_sample(&s, x, &o, &b));
    qt_sampler_free(&s);
}

static void test_opts_check(void **state) {
    (void)state;
    assert_int_equal(qt_sample_opts_check(&(qt_sample_opts){0, 0, 1}), QT_OK);
    assert_int_equal(qt_sample_opts_check(&(qt_sample_opts){-1, 0, 1}), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "--temperature"));
    assert_int_equal(qt_sample_opts_check(&(qt_sample_opts){1, -1, 1}), QT_EINVAL);
    assert_int_equal(qt_sample_opts_check(&(qt_sample_opts){1, 0, 0}), QT_EINVAL);
    assert_int_equal(qt_sample_opts_check(&(qt_sample_opts){1, 0, 1.5f}), QT_EINVAL);
    assert_int_equal(qt_sample_opts_check(&(qt_sample_opts){NAN, 0, 1}), QT_EINVAL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_argmax_ties_pick_lowest), cmocka_unit_test(test_temperature_top_k_top_p),
        cmocka_unit_test(test_seeded), cmocka_unit_test(test_opts_check),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
