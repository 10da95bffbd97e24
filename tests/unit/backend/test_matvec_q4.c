/* op_matvec on a 4-bit weight (QT_Q4, op_matvec.c rows_q4: the codes
 * looked up and dotted in registers, each block's absmax applied after the
 * block's sum) against dequantize-then-dot in fp64, for NF4 and FP4, with and
 * without double quantization, weights rounding to f32 and to bf16, on every
 * SIMD path compiled in (qt_q4_set_simd: AVX-512, AVX2, scalar), with IN a
 * multiple of 64 but not of 512, OUT not a multiple of the 2-row tile or the
 * thread split, N = 1..5 (one input group, a full one, one and a remainder);
 * each row bit-identical alone or in a batch and at 1 or 2 threads; the
 * scalar path equal bit for bit to the summation order op_matvec.c states;
 * a row view (the original Qwen's k and v) equal to the rows it views; and
 * rows whose blocks straddle rows (IN not a multiple of 64) through the row
 * buffer. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/cpu/ops.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/quant4.h"
#include "core/rng.h"

static qt_rng rng;

/* a (OUT, IN) weight quantized from normal values */
static qt_q4_weight *make_q4(qt_q4_type t, int nested, qt_dtype dt, int IN, int OUT) {
    const size_t n = (size_t)IN * OUT, bytes = qt_q4_bytes((uint64_t)OUT, (uint64_t)IN, QT_Q4_BLOCK, nested);
    float *src = malloc(n * sizeof *src);
    for (size_t i = 0; i < n; i++) src[i] = 0.02f * qt_rng_normal(&rng);
    qt_q4_weight *q = aligned_alloc(64, (bytes + 63) / 64 * 64);
    assert_non_null(src), assert_non_null(q);
    qt_q4_init(q, t, dt, (uint64_t)OUT, (uint64_t)IN, QT_Q4_BLOCK, nested);
    assert_int_equal(qt_q4_quantize_weight(q, src, QT_F32), QT_OK);
    free(src);
    return q;
}

/* code x absmax of value e, exactly (fp64), and its dequantized value (rounded to the weight's dtype) */
static double exact_of(const qt_q4_weight *q, size_t e) {
    const uint8_t byte = qt_q4_packed(q)[e / 2];
    return (double)q->code[(e & 1) ? byte & 15 : byte >> 4] * qt_q4_block_absmax(q, e / 64);
}

/* the stated order (op_matvec.c): per block of 64 an fmaf sum of code x x in value order, then fmaf(block, absmax) */
static float stated_order(const qt_q4_weight *q, int row, const float *x, int IN) {
    float acc = 0.0f;
    for (int k = 0; k < IN / 64; k++) {
        float b = 0.0f;
        for (int i = 0; i < 64; i++) {
            const size_t e = (size_t)row * IN + 64 * k + i;
            const uint8_t byte = qt_q4_packed(q)[e / 2];
            b = fmaf(q->code[(e & 1) ? byte & 15 : byte >> 4], x[64 * k + i], b);
        }
        acc = fmaf(b, qt_q4_block_absmax(q, (size_t)row * IN / 64 + k), acc);
    }
    return acc;
}

static const char *path_name(int level) { return level == 2 ? "AVX-512" : level == 1 ? "AVX2" : "scalar"; }

static void check(qt_q4_type t, int nested, qt_dtype dt, int IN, int OUT, int level) {
    const int N_MAX = 5;
    qt_q4_weight *q = make_q4(t, nested, dt, IN, OUT);
    const size_t nw = (size_t)IN * OUT;
    double *we = malloc(nw * sizeof *we);
    float *deq = malloc(nw * sizeof *deq), *x = malloc((size_t)N_MAX * IN * sizeof *x);
    float *bias = malloc((size_t)OUT * sizeof *bias), *out = malloc((size_t)N_MAX * OUT * sizeof *out);
    float *one = malloc((size_t)OUT * sizeof *one), *two = malloc((size_t)OUT * sizeof *two);
    assert_non_null(deq), assert_non_null(x), assert_non_null(bias), assert_non_null(out), assert_non_null(one);
    assert_non_null(two);
    assert_non_null(we);
    qt_q4_dequantize(q, 0, nw, deq);
    for (size_t e = 0; e < nw; e++) we[e] = exact_of(q, e);
    for (size_t i = 0; i < (size_t)N_MAX * IN; i++) x[i] = qt_rng_normal(&rng);
    for (int o = 0; o < OUT; o++) bias[o] = qt_rng_normal(&rng);
    const float alpha = 0.75f;
    for (int N = 1; N <= N_MAX; N++) {
        for (size_t i = 0; i < (size_t)N * OUT; i++) out[i] = 0.25f * (float)(i % 7);
        omp_set_num_threads(2);
        op_matvec(out, x, q, QT_Q4, bias, N, IN, OUT, alpha, 1);
        for (int n = 0; n < N; n++) {
            const float *xn = x + (size_t)n * IN;
            for (int o = 0; o < OUT; o++) {
                double s = 0, sd = 0, mag = 0;
                for (int i = 0; i < IN; i++) {
                    const double w = we[(size_t)o * IN + i];
                    s += w * xn[i], sd += (double)deq[(size_t)o * IN + i] * xn[i], mag += fabs(w * xn[i]);
                }
                const double c0 = 0.25 * (double)(((size_t)n * OUT + o) % 7), got = out[(size_t)n * OUT + o];
                const double want = c0 + alpha * s + bias[o], want_deq = c0 + alpha * sd + bias[o];
                /* fp32 sums: a few ulp of the magnitudes per level of the sum, one more level for the block scale */
                const double tol = 4e-7 * (alpha * mag + fabs(bias[o]) + c0) * (2 + log2(IN));
                if (fabs(got - want) > tol)
                    fail_msg("%s%s %s %s IN %d OUT %d N %d row %d col %d: got %.9g, fp64 %.9g (tol %.3g)",
                             qt_q4_type_name(t), nested ? "+dq" : "", qt_dtype_name(dt), path_name(level), IN, OUT, N,
                             n, o, got, want, tol);
                /* against the dequantized values: exact for f32 weights; bf16's rounding of each value is
                 * skipped (at most 2^-9 of it), so within 2^-9 of the magnitudes more */
                const double tol_deq = tol + (dt == QT_BF16 ? alpha * mag / 512 : 0);
                if (fabs(got - want_deq) > tol_deq)
                    fail_msg("%s %s IN %d OUT %d row %d: got %.9g, dequantize-then-dot %.9g", qt_dtype_name(dt),
                             path_name(level), IN, OUT, o, got, want_deq);
            }
            /* the row alone, 1 thread: the same bits */
            for (int o = 0; o < OUT; o++) one[o] = 0.25f * (float)(((size_t)n * OUT + o) % 7);
            omp_set_num_threads(1);
            op_matvec(one, xn, q, QT_Q4, bias, 1, IN, OUT, alpha, 1);
            if (memcmp(one, out + (size_t)n * OUT, (size_t)OUT * sizeof *one))
                fail_msg("%s IN %d OUT %d N %d row %d: not the bits of the one-row product at 1 thread",
                         path_name(level), IN, OUT, N, n);
            if (level == 0 && N == 1) { /* the scalar path is the stated order, bit for bit */
                op_matvec(one, xn, q, QT_Q4, NULL, 1, IN, OUT, 1.0f, 0);
                for (int o = 0; o < OUT; o++)
                    if (one[o] != stated_order(q, o, xn, IN))
                        fail_msg("scalar IN %d OUT %d row %d: %.9g, the stated order %.9g", IN, OUT, o, one[o],
                                 stated_order(q, o, xn, IN));
            }
        }
    }
    /* rows [1, OUT) through a view of their own: the bits of those rows of the whole weight */
    if (OUT > 1) {
        qt_q4_weight view;
        qt_q4_view(q, q, &view, 1, (uint64_t)OUT - 1, &view);
        omp_set_num_threads(2);
        op_matvec(one, x, q, QT_Q4, NULL, 1, IN, OUT, 1.0f, 0);
        op_matvec(two, x, &view, QT_Q4, NULL, 1, IN, OUT - 1, 1.0f, 0);
        assert_memory_equal(one + 1, two, (size_t)(OUT - 1) * sizeof *one);
    }
    omp_set_num_threads(2);
    free(two), free(one), free(out), free(bias), free(x), free(deq), free(we), free(q);
}

static void test_matvec_q4_against_fp64(void **state) {
    (void)state;
    /* IN a multiple of 64 but not of 512; OUT odd; 576 x 1001 is past the threaded split (512 Ki values) */
    static const int shapes[][2] = {{64, 1}, {192, 37}, {320, 130}, {576, 1001}};
    const int top = qt_q4_set_simd(2), have = qt_q4_simd();
    qt_q4_set_simd(top);
    for (int level = have; level >= 0; level--) {
        const int was = qt_q4_set_simd(level);
        assert_int_equal(qt_q4_simd(), level);
        for (int t = 0; t < 2; t++)
            for (int nested = 0; nested < 2; nested++)
                for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
                    check(t ? QT_Q4_FP4 : QT_Q4_NF4, nested, t == nested ? QT_BF16 : QT_F32, shapes[s][0],
                          shapes[s][1], level);
        qt_q4_set_simd(was);
    }
    printf("4-bit matvec: paths up to %s checked\n", path_name(have));
}

/* IN not a multiple of 64: a row's blocks straddle rows, the row buffer (qt_q4_dequantize's values) */
static void test_matvec_q4_straddling_blocks(void **state) {
    (void)state;
    const int IN = 100, OUT = 7;
    qt_q4_weight *q = make_q4(QT_Q4_NF4, 1, QT_F32, IN, OUT);
    float deq[700], x[100], out[7];
    qt_q4_dequantize(q, 0, (size_t)IN * OUT, deq);
    for (int i = 0; i < IN; i++) x[i] = qt_rng_normal(&rng);
    op_matvec(out, x, q, QT_Q4, NULL, 1, IN, OUT, 1.0f, 0);
    for (int o = 0; o < OUT; o++) {
        double s = 0, mag = 0;
        for (int i = 0; i < IN; i++) s += (double)deq[o * IN + i] * x[i], mag += fabs((double)deq[o * IN + i] * x[i]);
        assert_true(fabs(out[o] - s) <= 4e-7 * mag * (1 + log2(IN)));
    }
    free(q);
}

int main(void) {
    qt_rng_seed(&rng, 4321);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matvec_q4_against_fp64),
        cmocka_unit_test(test_matvec_q4_straddling_blocks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
