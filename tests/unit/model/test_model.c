/* model: the memory plan's arithmetic, the parameter table, and the checks a
 * bad batch or a misuse meets (errors, never a crash). Numerical parity with
 * PyTorch lives in tests/ref/. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"
#include "core/rng.h"
#include "io/hf_config.h"
#include "io/safetensors.h"
#include "model/lora_io.h"
#include "backend/cpu/ops.h"
#include "model/memplan.h"
#include "model/model_internal.h"
#include "model/model.h"
#include "tiny_model.h"

static char dir[256];
static qt_config cfg;

/* A random "tiny" preset model folder (f32). */
static int write_model(void **state) {
    (void)state;
    tiny_model_write(dir, sizeof dir, "model", 7, &cfg);
    return 0;
}

static int remove_model(void **state) {
    (void)state;
    qt_rm_rf(dir);
    return 0;
}

static void test_memplan(void **state) {
    (void)state;
    qt_model_opts o;
    qt_model_opts_default(&o);
    o.max_B = 2, o.max_T = 32;
    qt_mem_breakdown full, ckpt, lora, inf;
    qt_model_memory(&cfg, &o, &full);
    assert_int_equal(full.master, (size_t)qt_config_param_count(&cfg) * 4);
    assert_int_equal(full.grads, full.master);
    assert_int_equal(full.base, 0);
    o.grad_checkpointing = 1;
    qt_model_memory(&cfg, &o, &ckpt);
    assert_true(ckpt.activations < full.activations);
    o.grad_checkpointing = 0;
    o.lora = 1, o.lora_r = 4, o.lora_targets = QT_LORA_Q | QT_LORA_V;
    qt_model_memory(&cfg, &o, &lora);
    int HD = cfg.num_attention_heads * cfg.head_dim, KVD = cfg.num_key_value_heads * cfg.head_dim;
    size_t want = (size_t)cfg.num_hidden_layers * 4 * ((cfg.hidden_size + HD) + (cfg.hidden_size + KVD));
    assert_int_equal(lora.master, want * 4);
    assert_int_equal(lora.grads, want * 4);
    assert_true(lora.base > 0 && lora.base_f32 > 0);
    o.lora = 0, o.infer = 1;
    qt_model_memory(&cfg, &o, &inf);
    assert_int_equal(inf.master + inf.grads + inf.act_grads, 0);
    assert_int_equal(inf.kv_cache, (size_t)2 * cfg.num_hidden_layers * 32 * KVD * 4);
    assert_true(inf.total == inf.base_f32 + inf.activations + inf.workspace + inf.kv_cache);
}

/* Full fine-tuning keeps the lm_head logits while they take no more than the
 * trainable state (16 B a parameter), in the workspace after the chunk
 * scratch; LoRA and inference never do. */
static void test_kept_logits_rule(void **state) {
    (void)state;
    qt_model_opts o;
    qt_model_opts_default(&o);
    o.max_B = 2, o.max_T = 32;
    size_t numel = qt_model_trainable_numel(&cfg, &o), V = (size_t)cfg.vocab_size;
    assert_true(qt_model_keeps_logits(&cfg, &o));
    qt_mem_breakdown b;
    qt_model_memory(&cfg, &o, &b);
    assert_int_equal(b.workspace, (qt_model_kept_logits_offset(&cfg, &o) + op_lmhead_ce_kept_floats(64, (int)V)) * 4);
    /* the largest max_T that still fits, and one more */
    size_t chunks = (V + OP_CE_CHUNK - 1) / OP_CE_CHUNK, per_tok = (V + chunks) * 4;
    o.max_B = 1, o.max_T = (int)(numel * 16 / per_tok);
    assert_true(qt_model_keeps_logits(&cfg, &o));
    o.max_T++;
    assert_false(qt_model_keeps_logits(&cfg, &o));
    qt_model_memory(&cfg, &o, &b);
    /* recomputing: the workspace has no room for the kept buffer */
    assert_true(b.workspace < (qt_model_kept_logits_offset(&cfg, &o) + op_lmhead_ce_kept_floats(o.max_T, (int)V)) * 4);
    o.max_T = 32;
    o.lora = 1, o.lora_r = 4, o.lora_targets = QT_LORA_Q;
    assert_false(qt_model_keeps_logits(&cfg, &o));
    o.lora = 0, o.infer = 1;
    assert_false(qt_model_keeps_logits(&cfg, &o));
}

static void test_param_table_and_load(void **state) {
    (void)state;
    qt_model_opts o;
    qt_model_opts_default(&o);
    o.max_B = 1, o.max_T = 8;
    qt_model *m;
    assert_int_equal(qt_model_load(dir, &o, &m), QT_OK);
    int n;
    const qt_param *p = qt_model_params(m, &n);
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        assert_int_equal(p[i].offset, off);
        assert_int_equal(p[i].decay, p[i].ndim == 2);
        off += p[i].numel;
    }
    assert_int_equal(off, qt_model_numel(m));
    assert_string_equal(p[0].name, "model.embed_tokens.weight");
    qt_model_free(m);
}

static void fill_batch(qt_batch *b, int32_t *buf, int B, int T) {
    b->B = B, b->T = T;
    b->inputs = buf, b->targets = buf + B * T, b->positions = buf + 2 * B * T, b->doc_start = buf + 3 * B * T;
    b->n_target = (int64_t)B * T; /* every field set: no stack garbage reaches the model */
    for (int i = 0; i < B * T; i++) {
        b->inputs[i] = (i * 7) % 100;
        b->targets[i] = (i * 11) % 100;
        b->positions[i] = i % T;
        b->doc_start[i] = 0;
    }
}

static void test_bad_batches(void **state) {
    (void)state;
    qt_model_opts o;
    qt_model_opts_default(&o);
    o.max_B = 1, o.max_T = 8;
    qt_model *m;
    assert_int_equal(qt_model_load(dir, &o, &m), QT_OK);
    int32_t buf[4 * 16];
    qt_batch b;
    double loss;
    int64_t n;
    fill_batch(&b, buf, 1, 8);
    assert_int_equal(qt_model_forward(m, &b, &loss, &n, NULL), QT_OK);
    assert_true(isfinite(loss) && n == 8);
    b.inputs[3] = cfg.vocab_size;
    assert_int_equal(qt_model_forward(m, &b, &loss, &n, NULL), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "token id"));
    fill_batch(&b, buf, 1, 8);
    b.targets[2] = -5;
    assert_int_equal(qt_model_forward_backward(m, &b, 1.0f, &loss, &n), QT_EINVAL);
    fill_batch(&b, buf, 1, 8);
    b.doc_start[2] = 3;
    assert_int_equal(qt_model_forward(m, &b, &loss, &n, NULL), QT_EINVAL);
    fill_batch(&b, buf, 2, 8); /* more rows than the plan */
    assert_int_equal(qt_model_forward(m, &b, &loss, &n, NULL), QT_EINVAL);
    float logits[512];
    assert_int_equal(qt_model_decode(m, b.inputs, 1, 0, logits), QT_EINVAL); /* not an inference model */
    qt_model_free(m);

    o.infer = 1;
    assert_int_equal(qt_model_load(dir, &o, &m), QT_OK);
    fill_batch(&b, buf, 1, 8);
    assert_int_equal(qt_model_forward_backward(m, &b, 1.0f, &loss, &n), QT_EINVAL);
    assert_int_equal(qt_model_decode(m, b.inputs, 4, 0, logits), QT_OK);
    assert_int_equal(qt_model_decode(m, b.inputs, 1, 5, logits), QT_EINVAL); /* skips position 4 */
    assert_int_equal(qt_model_decode(m, b.inputs, 5, 4, logits), QT_EINVAL); /* past max_T */
    assert_int_equal(qt_model_decode(m, b.inputs, 4, 4, logits), QT_OK);
    qt_model_free(m);
}

/* LoRA at init (B = 0) computes the base model exactly; a wrong adapter is
 * refused by name. */
static void test_lora_identity_at_init(void **state) {
    (void)state;
    qt_model_opts o;
    qt_model_opts_default(&o);
    o.max_B = 1, o.max_T = 8;
    int32_t buf[4 * 8];
    qt_batch b;
    fill_batch(&b, buf, 1, 8);
    double l0, l1;
    int64_t n;
    qt_model *m;
    assert_int_equal(qt_model_load(dir, &o, &m), QT_OK);
    assert_int_equal(qt_model_forward(m, &b, &l0, &n, NULL), QT_OK);
    qt_model_free(m);
    o.lora = 1, o.lora_r = 2, o.lora_alpha = 4, o.lora_targets = 0x7f, o.lora_dropout = 0.1f;
    assert_int_equal(qt_model_load(dir, &o, &m), QT_OK);
    assert_int_equal(qt_model_forward(m, &b, &l1, &n, NULL), QT_OK);
    assert_true(fabs(l0 - l1) <= 1e-6 * fabs(l0));
    assert_int_equal(qt_model_forward_backward(m, &b, 1.0f, &l1, &n), QT_OK);
    assert_int_equal(qt_model_micro_step(m), 1);
    char ad[300];
    snprintf(ad, sizeof ad, "%s/adapter", dir);
    assert_int_equal(qt_lora_save(m, ad, "tiny"), QT_OK);
    qt_model_free(m);
    o.lora_targets = QT_LORA_Q; /* the adapter holds more modules than this model adapts */
    assert_int_equal(qt_model_load(dir, &o, &m), QT_OK);
    assert_int_not_equal(qt_lora_load(m, ad), QT_OK);
    qt_model_free(m);
    qt_model_opts o2;
    qt_model_opts_default(&o2);
    qt_config cfg;
    assert_int_equal(qt_config_load(dir, &cfg), QT_OK);
    assert_int_equal(qt_lora_opts_from_adapter(ad, &cfg, &o2), QT_OK);
    assert_int_equal(o2.lora_targets, 0x7f);
    assert_int_equal(o2.lora_r, 2);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_memplan),
        cmocka_unit_test(test_kept_logits_rule),
        cmocka_unit_test(test_param_table_and_load),
        cmocka_unit_test(test_bad_batches),
        cmocka_unit_test(test_lora_identity_at_init),
    };
    return cmocka_run_group_tests(tests, write_model, remove_model);
}
