/* One-token decoding (matrix-vector products, backend/cpu/op_matvec.c) against
 * the batched forward (sgemm over the same weights): greedy decoding from a
 * prompt, one token at a time; at every position the batched forward of the
 * whole sequence so far gives the same logits (max-normalised error <= 2e-6)
 * and the same greedy id. For f32, f16 and bf16 weights, with and without a
 * LoRA adapter on every module. And several sequences decoding together
 * (qt_model_decode_rows, generate --batch): prompts of different lengths,
 * sequences leaving the step, each row's logits the bits of that sequence
 * decoded alone, and its greedy ids the batched forward's. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <string.h>

#include "core/error.h"
#include "core/fs.h"
#include "core/rng.h"
#include "model/memplan.h"
#include "model/model.h"
#include "model/model_internal.h"
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

/* SEQS sequences with prompts of 1, 2, 3, 5 and 6 tokens: each decoded alone
 * (qt_model_decode_seq, one token at a time) gives the reference logits;
 * then all of them are prefilled into their own slots and stepped together
 * with qt_model_decode_rows, rows in a shuffled slot order, sequence k
 * leaving the step after STEPS - k tokens (so steps of 5, 4, ... 1 rows).
 * Every row's logits must equal the alone run's bit for bit, and the greedy
 * ids must be the batched forward's argmax over the whole sequence. */
#define SEQS 5
#define STEPS 8
static void check_rows_case(qt_dtype dt, int lora) {
    char dir[256];
    qt_config cfg;
    tiny_model_write_dtype(dir, sizeof dir, "decrows", 12, &cfg, dt);
    qt_model_opts o;
    qt_model_opts_default(&o);
    o.infer = 1, o.max_B = 1, o.max_T = T_MAX, o.decode_seqs = SEQS;
    if (lora) o.lora = 1, o.lora_r = 4, o.lora_alpha = 8, o.lora_targets = 0x7f, o.lora_dropout = 0;
    qt_model *m;
    assert_int_equal(qt_model_load(dir, &o, &m), QT_OK);
    qt_rng r;
    qt_rng_seed(&r, 77);
    if (lora)
        for (size_t i = 0; i < qt_model_numel(m); i++) qt_model_master(m)[i] = 0.1f * qt_rng_normal(&r);
    const int V = cfg.vocab_size, plen[SEQS] = {3, 1, 6, 2, 5}, slot[SEQS] = {2, 4, 0, 3, 1};
    int32_t ids[SEQS][T_MAX];
    float *alone = malloc(sizeof(float) * SEQS * STEPS * V), *step = malloc(sizeof(float) * SEQS * V);
    float *bat = malloc(sizeof(float) * V);
    for (int k = 0; k < SEQS; k++) {
        const int len = STEPS - k; /* greedy tokens this sequence gets */
        for (int i = 0; i < plen[k]; i++) ids[k][i] = (int32_t)qt_rng_below(&r, (uint64_t)V);
        float *a = alone + (size_t)k * STEPS * V;
        assert_int_equal(qt_model_decode_seq(m, 0, ids[k], plen[k], 0, a), QT_OK);
        for (int t = 1; t < len; t++) {
            ids[k][plen[k] + t - 1] = argmax(a + (size_t)(t - 1) * V, V);
            assert_int_equal(qt_model_decode_seq(m, 0, &ids[k][plen[k] + t - 1], 1, plen[k] + t - 1, a + (size_t)t * V),
                             QT_OK);
        }
    }
    /* together: prefill each into its slot, then steps of the sequences still going */
    qt_model_decode_reset(m);
    for (int k = 0; k < SEQS; k++) {
        assert_int_equal(qt_model_decode_seq(m, slot[k], ids[k], plen[k], 0, step), QT_OK);
        assert_memory_equal(step, alone + (size_t)k * STEPS * V, sizeof(float) * V);
    }
    for (int t = 1; t < STEPS; t++) {
        int seqs[SEQS], who[SEQS], n = 0;
        int32_t tok[SEQS], pos[SEQS];
        for (int k = SEQS - 1; k >= 0; k--) /* reversed, so row order is not slot or prompt order */
            if (t < STEPS - k) {
                who[n] = k, seqs[n] = slot[k], pos[n] = plen[k] + t - 1, tok[n] = ids[k][plen[k] + t - 1];
                n++;
            }
        assert_int_equal(qt_model_decode_rows(m, n, seqs, tok, pos, step), QT_OK);
        for (int i = 0; i < n; i++)
            if (memcmp(step + (size_t)i * V, alone + ((size_t)who[i] * STEPS + t) * V, sizeof(float) * V))
                fail_msg("%s%s sequence %d step %d (row %d of %d): logits are not those of its own run",
                         qt_dtype_name(dt), lora ? " + LoRA" : "", who[i], t, i, n);
    }
    /* the greedy ids against the batched forward of each whole sequence */
    for (int k = 0; k < SEQS; k++) {
        const int total = plen[k] + STEPS - k - 1;
        qt_model_decode_reset(m);
        assert_int_equal(qt_model_decode_seq(m, 0, ids[k], total - 1, 0, bat), QT_OK);
        assert_int_equal(argmax(bat, V), ids[k][total - 1]);
    }
    /* what a step refuses: a sequence twice, a position past its cache, a slot outside it */
    qt_model_decode_reset(m);
    int two[2] = {1, 1}, far[1] = {SEQS};
    int32_t tk[2] = {1, 2}, p0[2] = {0, 0}, p3[1] = {3};
    assert_int_equal(qt_model_decode_rows(m, 2, two, tk, p0, step), QT_EINVAL);
    assert_int_equal(qt_model_decode_rows(m, 1, two, tk, p3, step), QT_EINVAL);
    assert_int_equal(qt_model_decode_rows(m, 1, far, tk, p0, step), QT_EINVAL);
    qt_error_clear();
    free(alone), free(step), free(bat);
    qt_model_free(m);
    qt_rm_rf(dir);
}

static void test_decode_rows_f32(void **s) { (void)s, check_rows_case(QT_F32, 0), check_rows_case(QT_F32, 1); }
static void test_decode_rows_f16(void **s) { (void)s, check_rows_case(QT_F16, 0), check_rows_case(QT_F16, 1); }
static void test_decode_rows_bf16(void **s) { (void)s, check_rows_case(QT_BF16, 0), check_rows_case(QT_BF16, 1); }

/* generate's weight copy is made only where it fits beside the rest (1 GiB
 * margin) in the memory the machine has available, else the decode reads the
 * file mapping (qwen2_load.c) */
static void test_stream_fits(void **s) {
    (void)s;
    const size_t gib = (size_t)1 << 30;
    const long long gib_kib = 1 << 20;
    assert_true(qt_model_stream_fits(gib, 3 * gib_kib));
    assert_true(qt_model_stream_fits(2 * gib, 3 * gib_kib));
    assert_false(qt_model_stream_fits(2 * gib + 1, 3 * gib_kib));
    assert_false(qt_model_stream_fits(28 * gib, 24 * gib_kib)); /* a 14B bf16 model on a 24 GiB machine */
    assert_true(qt_model_stream_fits(28 * gib, -1));              /* unknown: copy, as before */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stream_fits),
        cmocka_unit_test(test_decode_f32),
        cmocka_unit_test(test_decode_f16),
        cmocka_unit_test(test_decode_bf16),
        cmocka_unit_test(test_decode_rows_f32),
        cmocka_unit_test(test_decode_rows_f16),
        cmocka_unit_test(test_decode_rows_bf16),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
