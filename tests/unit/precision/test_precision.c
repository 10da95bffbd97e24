/* Mixed precision (docs/precision.md): rounding to the compute dtype, the
 * bf16 hardware rule, the memory plan's compute copy, and what the loaded
 * model really holds (LoRA base in the compute dtype, full fine-tuning's
 * compute copy refreshed by qt_model_weights_updated). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/cpu/op_precision.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/rng.h"
#include "io/hf_config.h"
#include "io/safetensors.h"
#include "model/memplan.h"
#include "model/model.h"
#include "model/model_internal.h" /* what the loaded model holds */
#include "model/precision.h"

static char dir[256];
static qt_config cfg;

/* A tiny f32 model folder (the "tiny" preset) with random weights. */
static int write_model(void **state) {
    (void)state;
    snprintf(dir, sizeof dir, "/tmp/qtune-test-precision-%d", (int)getpid());
    assert_int_equal(qt_mkdir_p(dir), QT_OK);
    assert_int_equal(qt_preset("tiny", &cfg), QT_OK);
    cfg.torch_dtype = QT_F32;
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    assert_int_equal(qt_config_write(&cfg, path), QT_OK);
    qt_model_opts o;
    qt_model_opts_default(&o);
    int n = qt_model_param_table(&cfg, &o, NULL, NULL);
    qt_param *p = calloc((size_t)n, sizeof *p);
    size_t numel;
    qt_model_param_table(&cfg, &o, p, &numel);
    float *w = malloc(numel * 4);
    qt_rng r;
    qt_rng_seed(&r, 11);
    for (size_t i = 0; i < numel; i++) w[i] = 0.1f * qt_rng_normal(&r);
    st_writer *sw;
    assert_int_equal(st_writer_new(&sw), QT_OK);
    for (int i = 0; i < n; i++)
        assert_int_equal(st_writer_add(sw, p[i].name, QT_F32, p[i].ndim, p[i].shape, w + p[i].offset, QT_F32), QT_OK);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    assert_int_equal(st_writer_write(sw, path), QT_OK);
    st_writer_free(sw);
    free(p), free(w);
    return 0;
}

static int remove_model(void **state) {
    (void)state;
    qt_rm_rf(dir);
    return 0;
}

static void test_round_f16_saturates(void **state) {
    (void)state;
    float x[19] = {65504.0f, 65519.0f, 65520.0f, 70000.0f, -1e6f, 1.0f + 1.0f / 1024, 1.0f + 1.0f / 4096,
                   1e-8f,    3.0e-8f,  1.0f,     -2.5f,   0.1f,  1e5f,  0.0f,  -0.0f, 6.1e-5f, 1e4f, 2e4f, 4e4f};
    float y[19];
    memcpy(y, x, sizeof x);
    op_round_to_dtype(y, 19, QT_F16);
    assert_true(y[0] == 65504.0f);              /* fp16's largest finite value */
    assert_true(y[1] == 65504.0f);              /* rounds down to it */
    assert_true(isinf(y[2]) && y[2] > 0);       /* a store to fp16 saturates to inf */
    assert_true(isinf(y[3]) && isinf(y[4]) && y[4] < 0);
    assert_true(y[5] == x[5]);                  /* representable */
    assert_true(y[6] == 1.0f);                  /* below half an ulp: to nearest even */
    assert_true(y[7] == 0.0f);                  /* under the smallest subnormal */
    assert_true(fabsf(y[8] - 5.9604645e-8f) < 1e-12f);
    assert_true(y[11] != x[11] && fabsf(y[11] - x[11]) < 1e-4f);
    assert_true(isinf(y[12]));
    /* the vector path (8 lanes) and the scalar tail agree */
    float big[4099];
    for (int i = 0; i < 4099; i++) big[i] = (float)i * 17.3f - 30000.0f;
    float ref[4099];
    for (int i = 0; i < 4099; i++) ref[i] = qt_f16_to_f32(qt_f32_to_f16(big[i]));
    op_round_to_dtype(big, 4099, QT_F16);
    assert_memory_equal(big, ref, sizeof big);
}

static void test_round_bf16_and_f32(void **state) {
    (void)state;
    float y[5] = {1.0f + 1.0f / 512, 1.0f + 3.0f / 512, 3e38f, NAN, 70000.0f};
    op_round_to_dtype(y, 5, QT_BF16);
    assert_true(y[0] == 1.0f);                 /* tie to even */
    assert_true(y[1] == 1.0f + 4.0f / 512);    /* tie to even, upwards */
    assert_true(isfinite(y[2]) && y[2] > 2.9e38f); /* bf16 keeps fp32's range: no overflow */
    assert_true(isnan(y[3]));
    assert_true(y[4] == 70144.0f);
    float z = 0.1f;
    op_round_to_dtype(&z, 1, QT_F32);
    assert_true(z == 0.1f);
}

static void test_bf16_rule(void **state) {
    (void)state;
    assert_int_equal(qt_precision_check(QT_F32), QT_OK);
    assert_int_equal(qt_precision_check(QT_F16), QT_OK);
    unsetenv("QTUNE_BF16_EMULATE");
    if (op_cpu_has_bf16()) {
        assert_int_equal(qt_precision_check(QT_BF16), QT_OK);
        return;
    }
    assert_int_equal(qt_precision_check(QT_BF16), QT_EUNSUPPORTED);
    assert_non_null(strstr(qt_error_message(), "AVX512_BF16"));
    qt_model_opts o;
    qt_model_opts_default(&o);
    o.compute = QT_BF16;
    qt_model *m;
    assert_int_equal(qt_model_load(dir, &o, &m), QT_EUNSUPPORTED);
    o.infer = 1; /* eval/generate never compute in bf16: not refused */
    assert_int_equal(qt_model_load(dir, &o, &m), QT_OK);
    qt_model_free(m);
    setenv("QTUNE_BF16_EMULATE", "1", 1);
    assert_int_equal(qt_precision_check(QT_BF16), QT_OK);
    unsetenv("QTUNE_BF16_EMULATE");
}

/* The plan: LoRA's frozen base in f16 takes half the bytes of the same base
 * in f32; full fine-tuning adds a 2-byte copy of the trainable block. */
static void test_memplan_compute_copy(void **state) {
    (void)state;
    qt_model_opts o;
    qt_model_opts_default(&o);
    o.lora = 1, o.max_B = 2, o.max_T = 16;
    qt_mem_breakdown f32, f16, bf16;
    qt_model_memory(&cfg, &o, &f32);
    o.compute = QT_F16;
    qt_model_memory(&cfg, &o, &f16);
    o.compute = QT_BF16;
    qt_model_memory(&cfg, &o, &bf16);
    assert_int_equal(f32.compute_copy, 0); /* f32 reads the f32 file's mapping */
    assert_true(f32.base > 0);
    assert_int_equal(f16.compute_copy * 2, f32.base);
    assert_int_equal(bf16.compute_copy * 2, f32.base);
    assert_int_equal(f16.total, f32.total + f16.compute_copy);

    qt_config c16 = cfg;
    c16.torch_dtype = QT_F16; /* a file already in the compute dtype is read from the mapping */
    o.compute = QT_F16;
    qt_mem_breakdown m16;
    qt_model_memory(&c16, &o, &m16);
    assert_int_equal(m16.compute_copy, 0);
    assert_int_equal(m16.base * 2, f32.base);

    o.lora = 0;
    qt_model_memory(&cfg, &o, &f16);
    o.compute = QT_F32;
    qt_model_memory(&cfg, &o, &f32);
    assert_int_equal(f16.compute_copy, f16.master / 2);
    assert_int_equal(f32.compute_copy, 0);
}

static void test_lora_base_held_in_f16(void **state) {
    (void)state;
    qt_model_opts o;
    qt_model_opts_default(&o);
    o.lora = 1, o.max_B = 1, o.max_T = 8, o.compute = QT_F16;
    qt_model *m;
    assert_int_equal(qt_model_load(dir, &o, &m), QT_OK);
    st_file *sf;
    assert_int_equal(st_open(dir, &sf), QT_OK);
    for (int l = 0; l < cfg.num_hidden_layers; l++)
        for (int j = 0; j < LIN_COUNT; j++) {
            const qt_linear *q = &m->layers[l].lin[j];
            assert_int_equal(q->w.dt, QT_F16);
            char name[160];
            snprintf(name, sizeof name, "model.layers.%d.%s.weight", l, qt_lin_path[j]);
            const st_tensor *t = st_find(sf, name);
            assert_non_null(t);
            const float *src = t->data;
            const uint16_t *h = q->w.p;
            size_t n = (size_t)q->in * q->out;
            for (size_t i = 0; i < n; i += 97) assert_true(h[i] == qt_f32_to_f16(src[i]));
        }
    assert_int_equal(m->wte.dt, QT_F16);
    assert_int_equal(m->mem.compute_copy, m->mem.base / 2);
    st_close(sf);
    qt_model_free(m);
}

static void test_full_compute_copy_refreshed(void **state) {
    (void)state;
    qt_model_opts o;
    qt_model_opts_default(&o);
    o.max_B = 1, o.max_T = 8, o.compute = QT_F16;
    qt_model *m;
    assert_int_equal(qt_model_load(dir, &o, &m), QT_OK);
    assert_non_null(m->wcopy);
    const qt_linear *q = &m->layers[1].lin[LIN_DOWN];
    assert_int_equal(q->w.dt, QT_F16);
    float *master = qt_model_master(m);
    size_t off = (size_t)((const uint16_t *)q->w.p - m->wcopy);
    assert_true(m->wcopy[off] == qt_f32_to_f16(master[off]));
    master[off] = 1e5f; /* beyond fp16: the copy saturates */
    master[off + 1] = 0.25f;
    qt_model_weights_updated(m);
    assert_true(isinf(qt_f16_to_f32(m->wcopy[off])));
    assert_true(qt_f16_to_f32(m->wcopy[off + 1]) == 0.25f);
    qt_model_free(m);
    o.compute = QT_F32;
    assert_int_equal(qt_model_load(dir, &o, &m), QT_OK);
    assert_null(m->wcopy);
    assert_int_equal(m->layers[0].lin[0].w.dt, QT_F32);
    qt_model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_f16_saturates),    cmocka_unit_test(test_round_bf16_and_f32),
        cmocka_unit_test(test_bf16_rule),              cmocka_unit_test(test_memplan_compute_copy),
        cmocka_unit_test(test_lora_base_held_in_f16),  cmocka_unit_test(test_full_compute_copy_refreshed),
    };
    return cmocka_run_group_tests(tests, write_model, remove_model);
}
