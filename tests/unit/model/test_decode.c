/* One-token decoding (matrix-vector products, backend/cpu/op_matvec.c) against
 * the batched forward (sgemm over the same weights): greedy decoding from a
 * prompt, one token at a time; at every position the batched forward of the
 * whole sequence so far gives the same logits (max-normalised error <= 2e-6)
 * and the same greedy id. For f32, f16 and bf16 weights, with and without a
 * LoRA adapter on every module. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <string.h>

#include "core/fs.h"
#include "core/rng.h"
#include "model/memplan.h"
#include "model/model.h"
#include "tiny_model.h"

#define T_MAX 24
#define PROMPT 4

static int argmax(const float *l, int V) {
    int b = 0;
    for (int i = 1; i < V; i++)
        if (l[i] > l[b]) b = i;
    return b;
}

static void check_case(qt_dtype dt, int lora) {
    char dir[256];
    qt_config cfg;
    tiny_model_write_dtype(dir, sizeof dir, "decode", 11, &cfg, dt);
    qt_model_opts o;
    qt_model_opts_default(&o);
    o.infer = 1, o.max_B = 1, o.max_T = T_MAX;
    if (lora) o.lora = 1, o.lora_r = 4, o.lora_alpha = 8, o.lora_targets = 0x7f, o.lora_dropout = 0;
    qt_model *m;
    assert_int_equal(qt_model_load(dir, &o, &m), QT_OK);
    qt_rng r;
    qt_rng_seed(&r, 99);
    if (lora) /* a trained-looking adapter: A and B both non-zero */
        for (size_t i = 0; i < qt_model_numel(m); i++) qt_model_master(m)[i] = 0.1f * qt_rng_normal(&r);
    const int V = cfg.vocab_size;
    float *inc = malloc(sizeof(float) * (size_t)T_MAX * V), *bat = malloc(sizeof(float) * V);
    int32_t ids[T_MAX];
    for (int i = 0; i < PROMPT; i++) ids[i] = (int32_t)qt_rng_below(&r, (uint64_t)V);
    /* the decode path: the prompt at once, then one token at a time (the matvec path), greedy */
    assert_int_equal(qt_model_decode(m, ids, PROMPT, 0, inc + (size_t)(PROMPT - 1) * V), QT_OK);
    for (int t = PROMPT; t < T_MAX; t++) {
        ids[t] = argmax(inc + (size_t)(t - 1) * V, V);
        assert_int_equal(qt_model_decode(m, ids + t, 1, t, inc + (size_t)t * V), QT_OK);
    }
    /* the batched forward of the sequence up to each position */
    for (int t = PROMPT; t < T_MAX; t++) {
        qt_model_decode_reset(m);
        assert_int_equal(qt_model_decode(m, ids, t + 1, 0, bat), QT_OK);
        const float *got = inc + (size_t)t * V;
        double mx = 0, err = 0;
        for (int v = 0; v < V; v++) mx = fmax(mx, fabs(bat[v]));
        for (int v = 0; v < V; v++) err = fmax(err, fabs(got[v] - bat[v]) / mx);
        if (err > 2e-6) fail_msg("%s%s position %d: logits differ by %.3g of the largest", qt_dtype_name(dt),
                                 lora ? " + LoRA" : "", t, err);
        if (t + 1 < T_MAX) assert_int_equal(argmax(bat, V), ids[t + 1]);
    }
    /* the adapter changes the model (so the LoRA products ran) */
    if (lora) {
        qt_model *b;
        o.lora = 0;
        assert_int_equal(qt_model_load(dir, &o, &b), QT_OK);
        assert_int_equal(qt_model_decode(b, ids, T_MAX, 0, bat), QT_OK);
        double d = 0;
        for (int v = 0; v < V; v++) d = fmax(d, fabs(bat[v] - inc[(size_t)(T_MAX - 1) * V + v]));
        assert_true(d > 1e-3);
        qt_model_free(b);
    }
    free(inc), free(bat);
    qt_model_free(m);
    qt_rm_rf(dir);
}

static void test_decode_f32(void **s) { (void)s, check_case(QT_F32, 0), check_case(QT_F32, 1); }
static void test_decode_f16(void **s) { (void)s, check_case(QT_F16, 0), check_case(QT_F16, 1); }
static void test_decode_bf16(void **s) { (void)s, check_case(QT_BF16, 0), check_case(QT_BF16, 1); }

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_decode_f32),
        cmocka_unit_test(test_decode_f16),
        cmocka_unit_test(test_decode_bf16),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
