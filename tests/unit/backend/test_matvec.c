/* op_matvec (one-token decoding) against a double-precision loop over the
 * weights as stored (f32, f16, bf16), on shapes whose row length is not a
 * multiple of the vector width and whose row count is not a multiple of the
 * 4-row block or the thread split; with bias, alpha, accumulation; equal to
 * itself bit for bit at 1, 2 and 3 threads; and against op_matmul_forward
 * (the batched path) on the same weights. Several input rows at once (the
 * --batch decode): each row bit-identical to the one-row product of that row,
 * whatever N and the thread count. op_matvec_many (a decode step's q/k/v and
 * gate/up as one job): each product the bits of its own op_matvec call, at 1,
 * 2 and 3 threads and on a held team, where chunks span two products. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/ops.h"
#include "core/dtype.h"
#include "core/mem.h"
#include "core/rng.h"

static qt_rng rng;

/* W (OUT, IN) in dt, with its values as double (what the stored bits mean) */
static void *make_w(qt_dtype dt, int IN, int OUT, double **wd) {
    size_t n = (size_t)IN * OUT;
    float *f = malloc(n * sizeof *f);
    for (size_t i = 0; i < n; i++) f[i] = qt_rng_normal(&rng);
    void *w = malloc(n * qt_dtype_size(dt));
    qt_convert_from_f32(w, dt, f, n);
    qt_convert_to_f32(f, w, dt, n);
    *wd = malloc(n * sizeof **wd);
    for (size_t i = 0; i < n; i++) (*wd)[i] = f[i];
    free(f);
    return w;
}

static void check_shape(qt_dtype dt, int IN, int OUT) {
    double *wd;
    void *w = make_w(dt, IN, OUT, &wd);
    float *x = malloc((size_t)IN * sizeof *x), *bias = malloc((size_t)OUT * sizeof *bias);
    float *out = malloc((size_t)OUT * sizeof *out), *ref1 = malloc((size_t)OUT * sizeof *ref1);
    float *mm = malloc((size_t)OUT * sizeof *mm);
    for (int i = 0; i < IN; i++) x[i] = qt_rng_normal(&rng);
    for (int o = 0; o < OUT; o++) bias[o] = qt_rng_normal(&rng), out[o] = 0.5f * o;
    const float alpha = 0.75f;
    double *want = malloc((size_t)OUT * sizeof *want), *tol = malloc((size_t)OUT * sizeof *tol);
    for (int o = 0; o < OUT; o++) {
        double s = 0, mag = 0;
        for (int i = 0; i < IN; i++) s += wd[(size_t)o * IN + i] * x[i], mag += fabs(wd[(size_t)o * IN + i] * x[i]);
        want[o] = alpha * s + bias[o];
        /* f32 accumulation of IN products: within a few ulp of the sum of magnitudes per level of the sum */
        tol[o] = 4e-7 * (alpha * mag + fabs(bias[o]) + 0.5 * o) * (1 + log2(IN));
    }
    /* out = 0.5 o + alpha W x + bias (accumulate) */
    op_matvec(out, x, w, dt, bias, 1, IN, OUT, alpha, 1);
    for (int o = 0; o < OUT; o++)
        if (fabs(out[o] - (0.5 * o + want[o])) > tol[o])
            fail_msg("%s IN %d OUT %d row %d: got %.9g want %.9g", qt_dtype_name(dt), IN, OUT, o, out[o],
                     0.5 * o + want[o]);
    /* the same numbers at every thread count (threads own rows; a row's sum order is fixed) */
    omp_set_num_threads(1);
    op_matvec(ref1, x, w, dt, bias, 1, IN, OUT, alpha, 0);
    for (int t = 2; t <= 3; t++) {
        omp_set_num_threads(t);
        op_matvec(out, x, w, dt, bias, 1, IN, OUT, alpha, 0);
        assert_memory_equal(out, ref1, (size_t)OUT * sizeof *out);
    }
    omp_set_num_threads(2);
    /* and the batched path (sgemm over converted panels) on the same weights: both within the bound */
    float *ws = malloc(op_matmul_ws_floats(IN, OUT) * sizeof(float) * 2);
    op_matmul_forward(mm, x, w, dt, bias, 1, IN, OUT, alpha, 0, ws);
    for (int o = 0; o < OUT; o++) {
        if (fabs(ref1[o] - want[o]) > tol[o] || fabs(mm[o] - want[o]) > tol[o])
            fail_msg("%s IN %d OUT %d row %d: matvec %.9g, matmul %.9g, want %.9g", qt_dtype_name(dt), IN, OUT, o,
                     ref1[o], mm[o], want[o]);
    }
    free(want), free(tol);
    free(ws), free(mm), free(ref1), free(out), free(bias), free(x), free(wd), free(w);
}

static void test_matvec_dtypes_and_shapes(void **state) {
    (void)state;
    static const int shapes[][2] = {{1, 1}, {7, 3}, {16, 5}, {33, 17}, {64, 64}, {100, 257}, {896, 128},
                                    {256, 1031}, {4864, 37}};
    static const qt_dtype dts[] = {QT_F32, QT_F16, QT_BF16};
    for (size_t d = 0; d < 3; d++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) check_shape(dts[d], shapes[s][0], shapes[s][1]);
}

/* A product large enough for the threaded split (OUT rows over the team),
 * with no bias and no accumulation: out is overwritten, whatever it held. */
static void test_matvec_threaded_overwrites(void **state) {
    (void)state;
    const int IN = 512, OUT = 3001;
    double *wd;
    void *w = make_w(QT_BF16, IN, OUT, &wd);
    float *x = malloc(IN * sizeof *x), *out = malloc(OUT * sizeof *out);
    for (int i = 0; i < IN; i++) x[i] = qt_rng_normal(&rng);
    for (int o = 0; o < OUT; o++) out[o] = NAN;
    omp_set_num_threads(2);
    op_matvec(out, x, w, QT_BF16, NULL, 1, IN, OUT, 1.0f, 0);
    for (int o = 0; o < OUT; o++) {
        double s = 0, mag = 0;
        for (int i = 0; i < IN; i++) s += wd[(size_t)o * IN + i] * x[i], mag += fabs(wd[(size_t)o * IN + i] * x[i]);
        assert_true(fabs(out[o] - s) <= 4e-7 * mag * 10);
    }
    free(out), free(x), free(wd), free(w);
}

/* N input rows in one call: row n of the result is the one-row product of
 * x row n, bit for bit (the tile and its input groups never change a row's
 * sum order), at 1 and 2 threads, with accumulation and bias; N covers one
 * partial input group, whole groups and a group plus a remainder, and OUT
 * both the serial and the chunked threaded paths. */
static void test_matvec_rows_equal_single_rows(void **state) {
    (void)state;
    static const int shapes[][2] = {{33, 17}, {896, 130}, {301, 3001}};
    static const qt_dtype dts[] = {QT_F32, QT_F16, QT_BF16};
    for (size_t d = 0; d < 3; d++)
        for (size_t s = 0; s < 3; s++)
            for (int N = 1; N <= 9; N++) {
                const int IN = shapes[s][0], OUT = shapes[s][1];
                double *wd;
                void *w = make_w(dts[d], IN, OUT, &wd);
                float *x = malloc((size_t)N * IN * sizeof *x), *bias = malloc((size_t)OUT * sizeof *bias);
                float *out = malloc((size_t)N * OUT * sizeof *out), *one = malloc((size_t)OUT * sizeof *one);
                for (size_t i = 0; i < (size_t)N * IN; i++) x[i] = qt_rng_normal(&rng);
                for (int o = 0; o < OUT; o++) bias[o] = qt_rng_normal(&rng);
                for (int t = 1; t <= 2; t++) {
                    omp_set_num_threads(t);
                    for (size_t i = 0; i < (size_t)N * OUT; i++) out[i] = 0.25f * (float)(i % 7);
                    op_matvec(out, x, w, dts[d], bias, N, IN, OUT, 0.5f, 1);
                    for (int n = 0; n < N; n++) {
                        for (int o = 0; o < OUT; o++) one[o] = 0.25f * (float)(((size_t)n * OUT + o) % 7);
                        omp_set_num_threads(1);
                        op_matvec(one, x + (size_t)n * IN, w, dts[d], bias, 1, IN, OUT, 0.5f, 1);
                        omp_set_num_threads(t);
                        if (memcmp(one, out + (size_t)n * OUT, (size_t)OUT * sizeof *one))
                            fail_msg("%s IN %d OUT %d N %d row %d, %d threads: not the one-row product's bits",
                                     qt_dtype_name(dts[d]), IN, OUT, N, n, t);
                    }
                }
                free(one), free(out), free(bias), free(x), free(wd), free(w);
            }
    omp_set_num_threads(2);
}

/* one op_matvec_many call on a held team (team.h) */
typedef struct {
    const float *x;
    int N, IN, count;
    const qt_matvec_out *o;
} many_args;
static int many_on_team(op_team *team, void *arg) {
    const many_args *a = arg;
    op_matvec_many(team, a->x, a->N, a->IN, a->count, a->o);
    return 0;
}

/* Groups of products of one input: the 0.5B's q/k/v (2 MiB of bf16, the
 * threaded split, a chunk across q's end and k's start) and gate/up, and a
 * group of mixed dtypes with an empty product, biases on some and row counts
 * that are not multiples of 16. Each out is overwritten (filled with NaN
 * first) with the bits of that product's own op_matvec at 1 thread. */
static void test_matvec_many_equals_separate(void **state) {
    (void)state;
    enum { G = 4 };
    static const struct {
        int IN, count, OUT[G];
        qt_dtype dt[G];
        int bias[G];
    } groups[] = {
        {896, 3, {896, 128, 128}, {QT_BF16, QT_BF16, QT_BF16}, {1, 1, 1}},
        {896, 2, {4864, 4864}, {QT_BF16, QT_BF16}, {0, 0}},
        {300, 4, {37, 2001, 0, 1001}, {QT_F32, QT_BF16, QT_F16, QT_F16}, {1, 0, 1, 0}},
    };
    for (size_t g = 0; g < sizeof groups / sizeof groups[0]; g++)
        for (int N = 1; N <= 5; N += 2) {
            const int IN = groups[g].IN, count = groups[g].count;
            void *w[G];
            double *wd[G];
            float *bias[G], *want[G], *got[G];
            qt_matvec_out o[G];
            float *x = malloc((size_t)N * IN * sizeof *x);
            for (size_t i = 0; i < (size_t)N * IN; i++) x[i] = qt_rng_normal(&rng);
            omp_set_num_threads(1);
            for (int k = 0; k < count; k++) {
                const int OUT = groups[g].OUT[k];
                w[k] = make_w(groups[g].dt[k], IN, OUT, &wd[k]);
                bias[k] = NULL;
                if (groups[g].bias[k]) {
                    bias[k] = malloc((size_t)(OUT ? OUT : 1) * sizeof(float));
                    for (int r = 0; r < OUT; r++) bias[k][r] = qt_rng_normal(&rng);
                }
                want[k] = malloc(((size_t)N * OUT + 1) * sizeof(float));
                got[k] = malloc(((size_t)N * OUT + 1) * sizeof(float));
                op_matvec(want[k], x, w[k], groups[g].dt[k], bias[k], N, IN, OUT, 1.0f, 0);
                o[k] = (qt_matvec_out){.out = got[k], .w = w[k], .wdt = groups[g].dt[k], .bias = bias[k], .OUT = OUT};
            }
            for (int t = 1; t <= 4; t++) { /* 4: 2 threads on a held team */
                omp_set_num_threads(t == 4 ? 2 : t);
                for (int k = 0; k < count; k++)
                    for (size_t i = 0; i < (size_t)N * groups[g].OUT[k]; i++) got[k][i] = NAN;
                if (t == 4) {
                    many_args a = {x, N, IN, count, o};
                    op_team_hold(many_on_team, &a);
                } else {
                    op_matvec_many(NULL, x, N, IN, count, o);
                }
                for (int k = 0; k < count; k++)
                    if (memcmp(got[k], want[k], (size_t)N * groups[g].OUT[k] * sizeof(float)))
                        fail_msg("group %zu N %d product %d, %s: not the bits of its own op_matvec", g, N, k,
                                 t == 4 ? "held team" : t == 1 ? "1 thread" : t == 2 ? "2 threads" : "3 threads");
            }
            for (int k = 0; k < count; k++) free(w[k]), free(wd[k]), free(bias[k]), free(want[k]), free(got[k]);
            free(x);
        }
    omp_set_num_threads(2);
}

int main(void) {
    qt_rng_seed(&rng, 1234);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matvec_dtypes_and_shapes),
        cmocka_unit_test(test_matvec_threaded_overwrites),
        cmocka_unit_test(test_matvec_rows_equal_single_rows),
        cmocka_unit_test(test_matvec_many_equals_separate),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
