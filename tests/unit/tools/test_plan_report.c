/* plan_report: parameter counts against published totals, and the ZeRO /
 * offload / precision / LoRA accounting rules of plan_report.h. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "core/error.h"
#include "core/mem.h"
#include "model/model.h"
#include "model/memplan.h"
#include "train/plan_report.h"

#include <string.h>

/* Qwen2.5-0.5B's config.json */
static qt_config qwen05(void) {
    qt_config c;
    memset(&c, 0, sizeof c);
    c.arch = QT_ARCH_QWEN2;
    c.vocab_size = 151936, c.hidden_size = 896, c.intermediate_size = 4864, c.num_hidden_layers = 24;
    c.num_attention_heads = 14, c.num_key_value_heads = 2, c.head_dim = 64;
    c.tie_word_embeddings = 1, c.attention_bias = 1;
    return c;
}

static void test_param_count(void **state) {
    (void)state;
    qt_config c = qwen05();
    qt_plan_opts o;
    qt_plan_opts_default(&o);
    qt_plan p;
    assert_int_equal(qt_plan_compute(&c, &o, &p), QT_OK);
    /* transformers reports 494,032,768 parameters for Qwen2.5-0.5B */
    assert_int_equal(p.n_params, 494032768);
    assert_int_equal(p.n_trainable, 494032768);
    /* f32 full: weights are the master block, no second copy */
    assert_int_equal(p.dev.weights, 494032768ull * 4);
    assert_int_equal(p.dev.master, 0);
    assert_int_equal(p.dev.grads, 494032768ull * 4);
    assert_int_equal(p.dev.optim, 494032768ull * 8);
    assert_int_equal(p.dev.comm, 0);
}

static void test_zero_stages(void **state) {
    (void)state;
    qt_config c = qwen05();
    qt_plan_opts o;
    qt_plan_opts_default(&o);
    o.precision = QT_F16;
    o.devices = 4;
    qt_plan p0, p1, p2, p2o;
    o.zero = 0;
    assert_int_equal(qt_plan_compute(&c, &o, &p0), QT_OK);
    o.zero = 1;
    assert_int_equal(qt_plan_compute(&c, &o, &p1), QT_OK);
    o.zero = 2;
    assert_int_equal(qt_plan_compute(&c, &o, &p2), QT_OK);
    o.offload = 1;
    assert_int_equal(qt_plan_compute(&c, &o, &p2o), QT_OK);
    const uint64_t P = 494032768ull;
    assert_int_equal(p0.dev.weights, P * 2);
    assert_int_equal(p0.dev.master, P * 4);
    assert_int_equal(p0.dev.optim, P * 8);
    assert_int_equal(p0.dev.grads, P * 4);
    assert_int_equal(p1.dev.master, P * 4 / 4);
    assert_int_equal(p1.dev.optim, P * 8 / 4);
    assert_int_equal(p1.dev.grads, P * 4);
    /* ZeRO 2 on 4 devices: the fp32 shard (P/4 rounded to 16 elements) + the model's gradient windows */
    qt_model_opts mo;
    qt_model_opts_default(&mo);
    mo.compute = QT_F16;
    mo.max_T = 512;
    mo.grad_windows = 1;
    qt_grad_windows gw;
    qt_model_grad_windows(&c, &mo, &gw);
    assert_true(gw.total > 2 * gw.layer && gw.total < P / 10);
    assert_int_equal(p2.dev.grads, (P / 4 + 15) / 16 * 16 * 4 + gw.total * 4);
    assert_int_equal(p2o.dev.master, 0);
    assert_int_equal(p2o.dev.optim, 0);
    assert_true(p2o.host_offload >= P * 12); /* 4 ranks on one host hold every shard */
    assert_true(p0.dev.total > p1.dev.total && p1.dev.total > p2.dev.total && p2.dev.total > p2o.dev.total);
    /* activations do not depend on the strategy */
    assert_int_equal(p0.dev.activations, p2o.dev.activations);
    assert_true(p0.dev.comm > 0);
    /* ZeRO 0 never fits by adding cards: min_devices is 1 or none */
    assert_true(p0.min_devices == -1 || p0.min_devices == 1);
}

static void test_lora(void **state) {
    (void)state;
    qt_config c = qwen05();
    qt_plan_opts o;
    qt_plan_opts_default(&o);
    o.lora = 1;
    o.lora_r = 8;
    o.lora_targets = QT_LORA_Q | QT_LORA_V;
    o.precision = QT_BF16;
    qt_plan p;
    assert_int_equal(qt_plan_compute(&c, &o, &p), QT_OK);
    /* q: r*(C + H*D), v: r*(C + KV*D), per layer; PEFT reports 540,672 */
    const int64_t lora = 24 * (8 * (896 + 896) + 8 * (896 + 128));
    assert_int_equal(lora, 540672);
    assert_int_equal(p.n_trainable, lora);
    assert_int_equal(p.dev.grads, (uint64_t)lora * 4);
    assert_int_equal(p.dev.optim, (uint64_t)lora * 8);
    assert_int_equal(p.dev.master, (uint64_t)lora * 4);
    /* frozen base in the compute dtype, except norm weights and q/k/v biases
     * (C*(2L+1) + L*(H+2KV)*D = 71,552 values) which the model keeps in fp32;
     * the LoRA compute copy in bf16 */
    const uint64_t small = 896 * 49 + 24 * (14 + 4) * 64;
    assert_int_equal(small, 71552);
    assert_int_equal(p.dev.weights, (494032768ull - small) * 2 + small * 4 + (uint64_t)lora * 2);
    assert_int_equal(p.ckpt_bytes, (uint64_t)lora * 12);
}

static void test_checkpointing_and_min_devices(void **state) {
    (void)state;
    qt_config c = qwen05();
    qt_plan_opts o;
    qt_plan_opts_default(&o);
    o.micro_batch = 4;
    o.seq_len = 1024;
    qt_plan a, b;
    assert_int_equal(qt_plan_compute(&c, &o, &a), QT_OK);
    o.checkpointing = 1;
    assert_int_equal(qt_plan_compute(&c, &o, &b), QT_OK);
    assert_true(b.dev.activations < a.dev.activations / 4);
    /* a card too small for everything but the sharded state: ZeRO 2 finds N */
    o.zero = 2;
    o.precision = QT_F16;
    o.device_gib = (double)(494032768ull * 2 + b.dev.activations + b.dev.workspace) / (1024.0 * 1024 * 1024) + 2.5;
    qt_plan z;
    assert_int_equal(qt_plan_compute(&c, &o, &z), QT_OK);
    assert_true(z.min_devices > 1);
    o.devices = z.min_devices;
    assert_int_equal(qt_plan_compute(&c, &o, &z), QT_OK);
    assert_true(z.fits);
    o.devices = z.min_devices - 1;
    assert_int_equal(qt_plan_compute(&c, &o, &z), QT_OK);
    assert_false(z.fits);
}

static void test_bad_options(void **state) {
    (void)state;
    qt_config c = qwen05();
    qt_plan_opts o;
    qt_plan_opts_default(&o);
    qt_plan p;
    o.offload = 1; /* offload with ZeRO 0 */
    assert_int_equal(qt_plan_compute(&c, &o, &p), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "--zero"));
    qt_plan_opts_default(&o);
    o.zero = 3;
    assert_int_equal(qt_plan_compute(&c, &o, &p), QT_EINVAL);
    qt_plan_opts_default(&o);
    c.hidden_size = 0;
    assert_int_equal(qt_plan_compute(&c, &o, &p), QT_EINVAL);
}

static void test_json(void **state) {
    (void)state;
    qt_config c = qwen05();
    qt_plan_opts o;
    qt_plan_opts_default(&o);
    qt_plan p;
    assert_int_equal(qt_plan_compute(&c, &o, &p), QT_OK);
    char *s = qt_plan_json("qwen2.5-0.5b", &c, &o, &p);
    assert_non_null(s);
    assert_non_null(strstr(s, "\"per_device_bytes\""));
    assert_non_null(strstr(s, "\"n_params\":494032768"));
    qt_free(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_param_count), cmocka_unit_test(test_zero_stages), cmocka_unit_test(test_lora),
        cmocka_unit_test(test_checkpointing_and_min_devices), cmocka_unit_test(test_bad_options),
        cmocka_unit_test(test_json),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
