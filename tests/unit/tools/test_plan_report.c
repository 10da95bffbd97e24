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
    const uint64_t S = (P / 4 + 15) / 16 * 16; /* rank 0's shard: P/4 rounded up to 16 elements */
    assert_int_equal(p1.dev.master, S * 4);    /* each rank keeps its shard of the fp32 master, as DeepSpeed */
    assert_true(p1.dev.weights > P * 2 && p1.dev.weights < P * 2 + P / 1000); /* + the f32 norms and biases */
    assert_int_equal(p1.dev.optim, P * 8 / 4);
    assert_int_equal(p1.dev.grads, P * 4);
    /* ZeRO 2 on 4 devices: the fp32 shard (P/4 rounded to 16 elements) + the model's gradient window;
     * DeepSpeed's default bucket (5e8) holds all 24 layers' gradients (357.9M), so one bucket */
    qt_model_opts mo;
    qt_model_opts_default(&mo);
    mo.compute = QT_F16;
    mo.max_T = 512;
    mo.grad_windows = 1;
    qt_grad_windows gw;
    qt_model_grad_windows(&c, &mo, &gw);
    assert_int_equal(gw.nbuckets, 1);
    assert_int_equal(gw.bucket, 24 * gw.layer);
    assert_int_equal(gw.nwin, 1);
    assert_int_equal(p2.dev.grads, (P / 4 + 15) / 16 * 16 * 4 + gw.total * 4);
    /* offloaded: the master shard and the gradient shard are in pinned host memory, 4 ranks' on one host */
    assert_int_equal(p2o.dev.master, 0);
    assert_int_equal(p2o.dev.grads, gw.total * 4);
    assert_int_equal(p2o.host_pinned, 4 * (S * 4 + S * 4));
    assert_int_equal(p2o.dev.optim, 0);
    assert_true(p2o.host_offload >= P * 8 && p2o.host_offload < P * 9); /* 4 ranks on one host: every m, v shard */
    /* with buckets of one layer ZeRO 2 holds less than ZeRO 1 (at 5e8 the bucket is most of the block) */
    o.reduce_bucket = gw.layer;
    o.offload = 0;
    assert_int_equal(qt_plan_compute(&c, &o, &p2), QT_OK);
    o.offload = 1;
    assert_int_equal(qt_plan_compute(&c, &o, &p2o), QT_OK);
    assert_true(p0.dev.total > p1.dev.total && p1.dev.total > p2.dev.total && p2.dev.total > p2o.dev.total);
    /* activations do not depend on the strategy */
    assert_int_equal(p0.dev.activations, p2o.dev.activations);
    assert_true(p0.dev.comm > 0);
    /* ZeRO 0 never fits by adding cards: min_devices is 1 or none */
    assert_true(p0.min_devices == -1 || p0.min_devices == 1);
}

/* The layers' gradient buckets follow reduce_bucket_size (memplan.h qt_grad_pack): finer than a layer
 * (whole modules, a module larger than the bucket on its own), exactly a layer, or spanning layers. */
static void test_grad_buckets(void **state) {
    (void)state;
    qt_config c = qwen05();
    qt_model_opts mo;
    qt_model_opts_default(&mo);
    mo.grad_windows = 1;
    const size_t layer = 14912384, mlp = 896 * 4864; /* one layer; gate, up and down each */
    qt_grad_windows gw;
    int ub[24 * QT_GU_COUNT];
    /* 1e6: down, gate, up alone (4.36M each, larger than the bucket), {ln2, o}, {q, k}, {v, ln1} */
    mo.grad_bucket_elems = 1000000;
    qt_model_grad_windows(&c, &mo, &gw);
    assert_int_equal(gw.layer, layer);
    assert_int_equal(gw.nbuckets, 24 * 6);
    assert_int_equal(gw.bucket, mlp);
    assert_int_equal(gw.each, gw.slice > mlp ? gw.slice : mlp);
    assert_int_equal(qt_grad_pack(&c, &mo, ub, NULL), 24 * 6);
    const int *l23 = ub + 23 * QT_GU_COUNT; /* the last layer: the first buckets */
    assert_int_equal(l23[QT_GU_DOWN], 0);
    assert_int_equal(l23[QT_GU_GATE], 1);
    assert_int_equal(l23[QT_GU_UP], 2);
    assert_int_equal(l23[QT_GU_LN2], 3);
    assert_int_equal(l23[QT_GU_O], 3);
    assert_int_equal(l23[QT_GU_Q], 4);
    assert_int_equal(l23[QT_GU_K], 4);
    assert_int_equal(l23[QT_GU_V], 5);
    assert_int_equal(l23[QT_GU_LN1], 5);
    assert_int_equal(ub[QT_GU_LN1], 24 * 6 - 1);
    /* one layer's elements: every bucket is one layer (the layout of a window per layer) */
    mo.grad_bucket_elems = layer;
    qt_model_grad_windows(&c, &mo, &gw);
    assert_int_equal(gw.nbuckets, 24);
    assert_int_equal(gw.bucket, layer);
    qt_grad_pack(&c, &mo, ub, NULL);
    for (int l = 0; l < 24; l++)
        for (int k = 0; k < QT_GU_COUNT; k++) assert_int_equal(ub[l * QT_GU_COUNT + k], 23 - l);
    /* 1.5 layers: buckets span layers: layer 23 and layer 22's down (4.36M); the next from its gate to
     * layer 21's gate; the largest is layer 21 from up to layer 20's ln1 (21.1M) */
    mo.grad_bucket_elems = layer + layer / 2;
    qt_model_grad_windows(&c, &mo, &gw);
    assert_true(gw.bucket > layer && gw.bucket <= layer + layer / 2);
    qt_grad_pack(&c, &mo, ub, NULL);
    assert_int_equal(ub[23 * QT_GU_COUNT + QT_GU_LN1], 0);
    assert_int_equal(ub[22 * QT_GU_COUNT + QT_GU_DOWN], 0);
    assert_int_equal(ub[22 * QT_GU_COUNT + QT_GU_GATE], 1);
    assert_int_equal(ub[21 * QT_GU_COUNT + QT_GU_GATE], 1);
    assert_int_equal(ub[21 * QT_GU_COUNT + QT_GU_UP], 2);
    /* overlap_comm: two windows; without, one */
    mo.grad_overlap = 1;
    qt_grad_windows g2;
    qt_model_grad_windows(&c, &mo, &g2);
    assert_int_equal(g2.nwin, 2);
    assert_int_equal(g2.total - gw.total, (gw.each + 15) / 16 * 16);
}

/* LoRA at ZeRO-2 with layers_to_transform and modules_to_save: the buckets hold the adapted layers'
 * A/B only (a layer LoRA leaves out is in no bucket), the saved embedding comes first in the flat
 * block and the saved lm_head is handed over in vocabulary slices, as in full fine-tuning. */
static void test_grad_buckets_peft(void **state) {
    (void)state;
    qt_config c = qwen05();
    qt_model_opts mo;
    qt_model_opts_default(&mo);
    mo.grad_windows = 1;
    mo.lora = 1;
    mo.lora_r = 8;
    mo.lora_targets = QT_LORA_Q | QT_LORA_V;
    mo.lora_layers_set = 1;
    const int on[] = {3, 10, 20};
    for (int i = 0; i < 3; i++) mo.lora_layers[on[i] / 64] |= (uint64_t)1 << (on[i] % 64);
    const size_t q = 8 * (896 + 896), v = 8 * (896 + 128), VC = (size_t)151936 * 896;
    qt_grad_windows gw;
    int ub[24 * QT_GU_COUNT];
    /* DeepSpeed's default bucket: the three adapted layers in one */
    qt_model_grad_windows(&c, &mo, &gw);
    assert_int_equal(gw.layer, q + v);
    assert_int_equal(gw.nbuckets, 1);
    assert_int_equal(gw.bucket, 3 * (q + v));
    assert_int_equal(gw.layer0, 0);
    assert_int_equal(gw.norm, 0);
    assert_int_equal(gw.slice_rows, 0); /* lm_head frozen */
    /* a bucket of one q: q and v apart, in layers 20, 10, 3 only */
    mo.grad_bucket_elems = q;
    qt_model_grad_windows(&c, &mo, &gw);
    assert_int_equal(gw.nbuckets, 6);
    assert_int_equal(qt_grad_pack(&c, &mo, ub, NULL), 6);
    for (int l = 0; l < 24; l++) {
        const int k = l == 20 ? 0 : l == 10 ? 1 : l == 3 ? 2 : -1;
        assert_int_equal(qt_model_layer_unit(&mo, l), k < 0 ? -1 : 2 - k);
        for (int u = 0; u < QT_GU_COUNT; u++) {
            int want = -1;
            if (k >= 0 && u == QT_GU_Q) want = 2 * k;
            if (k >= 0 && u == QT_GU_V) want = 2 * k + 1;
            assert_int_equal(ub[l * QT_GU_COUNT + u], want);
        }
    }
    /* modules_to_save: the embedding first (layer0 past it), the lm_head last, in slices; the final norm
     * stays frozen; the layers' tensors are those the buckets hold */
    mo.lora_save = QT_SAVE_EMBED | QT_SAVE_LM_HEAD;
    qt_model_grad_windows(&c, &mo, &gw);
    assert_int_equal(gw.nbuckets, 6);
    assert_int_equal(gw.layer0, VC);
    assert_int_equal(gw.norm, 0);
    assert_true(gw.slice_rows > 0 && gw.slice == (size_t)gw.slice_rows * 896);
    assert_int_equal(gw.targets, (size_t)mo.max_B * mo.max_T);
    size_t numel;
    int n = qt_model_param_table(&c, &mo, NULL, &numel);
    qt_param *t = test_calloc((size_t)n, sizeof *t);
    qt_model_param_table(&c, &mo, t, NULL);
    assert_int_equal(n, 2 + 3 * 4);
    assert_int_equal(t[0].layer, -1);
    assert_int_equal(t[0].offset, 0);
    assert_int_equal(t[1].offset, gw.layer0);
    assert_int_equal(t[n - 1].layer, -1);
    assert_int_equal(t[n - 1].offset, numel - VC);
    size_t in_layers = 0;
    for (int i = 0; i < n; i++)
        if (t[i].layer >= 0) {
            assert_true(t[i].layer == 3 || t[i].layer == 10 || t[i].layer == 20);
            assert_int_equal(ub[t[i].layer * QT_GU_COUNT + t[i].unit] >= 0, 1);
            in_layers += t[i].numel;
        }
    assert_int_equal(in_layers, 3 * gw.layer);
    test_free(t);
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
     * no 2-byte copy of the adapters: LoRA reads its fp32 master (dev.master) */
    const uint64_t small = 896 * 49 + 24 * (14 + 4) * 64;
    assert_int_equal(small, 71552);
    assert_int_equal(p.dev.weights, (494032768ull - small) * 2 + small * 4);
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
    o.reduce_bucket = 14912384; /* one layer: at 5e8 one bucket holds every layer's gradients */
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
    o.zero = 4;
    assert_int_equal(qt_plan_compute(&c, &o, &p), QT_EINVAL);
    qt_plan_opts_default(&o);
    o.zero = 2, o.offload_param = 1; /* only stage 3 partitions the weights */
    assert_int_equal(qt_plan_compute(&c, &o, &p), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "--zero 3"));
    qt_plan_opts_default(&o);
    o.zero = 3, o.lora = 1, o.devices = 2; /* LoRA at stage 3 plans; QLoRA there is refused */
    assert_int_equal(qt_plan_compute(&c, &o, &p), QT_OK);
    o.quant4 = 1;
    assert_int_equal(qt_plan_compute(&c, &o, &p), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "--zero 2"));
    /* stage 3 on 4 devices: the weights line is the rank's quarter of the 2-byte copy, two layers, the V x C
     * buffer and the 1-D tensors in f32; stage 2 keeps the whole copy */
    qt_plan_opts_default(&o);
    o.precision = QT_F16, o.devices = 4, o.zero = 2;
    qt_plan p2, p3;
    assert_int_equal(qt_plan_compute(&c, &o, &p2), QT_OK);
    o.zero = 3;
    assert_int_equal(qt_plan_compute(&c, &o, &p3), QT_OK);
    assert_true(p3.dev.weights < p2.dev.weights * 2 / 3); /* 0.5B: its tied V x C buffer is 28% of the copy */
    assert_true(p3.dev.grads == p2.dev.grads && p3.dev.optim == p2.dev.optim);
    o.offload_param = 1;
    assert_int_equal(qt_plan_compute(&c, &o, &p), QT_OK);
    assert_true(p.dev.weights < p3.dev.weights && p.host_pinned > p3.host_pinned);
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
        cmocka_unit_test(test_param_count), cmocka_unit_test(test_zero_stages), cmocka_unit_test(test_grad_buckets),
        cmocka_unit_test(test_grad_buckets_peft),
        cmocka_unit_test(test_lora),
        cmocka_unit_test(test_checkpointing_and_min_devices), cmocka_unit_test(test_bad_options),
        cmocka_unit_test(test_json),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
