/* Mixed precision (docs/precision.md): rounding to the compute dtype, the
 * bf16 hardware rule, the memory plan's compute copy, and what the loaded
 * model really holds (LoRA base in the compute dtype, full fine-tuning's
 * compute copy refreshed by qt_model_weights_updated, activations stored in
 * 2 bytes). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/cpu/op_dnnl.h"
#include "backend/cpu/op_precision.h"
#include "backend/cpu/ops.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/quant4.h"
#include "core/rng.h"
#include "data/batch.h"
#include "io/hf_config.h"
#include "io/safetensors.h"
#include "model/memplan.h"
#include "model/model.h"
#include "model/model_internal.h" /* what the loaded model holds */
#include "model/precision.h"
#include "../model/tiny_model.h"

static char dir[256];
static qt_config cfg;

/* A tiny f32 model folder (the "tiny" preset) with random weights. */
static int write_model(void **state) {
    (void)state;
    tiny_model_write(dir, sizeof dir, "precision", 11, &cfg);
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
    assert_int_equal(qt_precision_check(QT_F32, NULL), QT_OK);
    assert_int_equal(qt_precision_check(QT_F16, NULL), QT_OK);
    unsetenv("QTUNE_BF16_EMULATE");
    /* a GPU's bf16 does not depend on the host CPU ("device": "cuda" on a host without AVX512_BF16) */
    assert_int_equal(qt_precision_check(QT_BF16, "cuda"), QT_OK);
    assert_int_equal(qt_precision_bf16_emulated("cuda"), 0);
    if (op_cpu_has_bf16()) {
        assert_int_equal(qt_precision_check(QT_BF16, "cpu"), QT_OK);
        return;
    }
    assert_int_equal(qt_precision_check(QT_BF16, "cpu"), QT_EUNSUPPORTED);
    assert_int_equal(qt_precision_bf16_emulated("cpu"), 1);
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
    assert_int_equal(qt_precision_check(QT_BF16, NULL), QT_OK);
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

/* op_round_store leaves x exactly as op_round_to_dtype does and writes the
 * same values' 2-byte patterns; op_convert gives them back exactly. Both
 * the serial path and the OpenMP one (n >= 2^15), 8 lanes and the tail. */
static void test_round_store_and_load(void **state) {
    (void)state;
    const size_t ns[2] = {4099, 40003};
    const qt_dtype dts[2] = {QT_F16, QT_BF16};
    const float special[12] = {65504.0f, 65520.0f, -70000.0f, INFINITY, -INFINITY, NAN, 3.4e38f, 1e-40f,
                               1.0f + 1.0f / 512, 1.0f + 3.0f / 512, -0.0f, 5.9604645e-8f};
    for (int d = 0; d < 2; d++)
        for (int k = 0; k < 2; k++) {
            size_t n = ns[k];
            float *x = malloc(n * 4), *y = malloc(n * 4), *z = malloc(n * 4);
            uint16_t *h = malloc(n * 2);
            qt_rng r;
            qt_rng_seed(&r, 5 + (uint64_t)k);
            for (size_t i = 0; i < n; i++) x[i] = (i % 97 < 12) ? special[i % 97] : 300.0f * qt_rng_normal(&r);
            memcpy(y, x, n * 4);
            op_round_to_dtype(y, n, dts[d]);
            op_round_store(x, h, n, dts[d]);
            assert_memory_equal(x, y, n * 4);
            for (size_t i = 0; i < n; i++)
                assert_int_equal(h[i], dts[d] == QT_F16 ? qt_f32_to_f16(y[i]) : qt_f32_to_bf16(y[i]));
            op_convert(z, QT_F32, h, dts[d], n);
            assert_memory_equal(z, y, n * 4);
            free(x), free(y), free(z), free(h);
        }
}

/* The plan: in f16/bf16 training the saved activations take about half the
 * bytes of f32 (each layer's values in 2 bytes, plus one fp32 working layer
 * and the small fp32 rstd/lse); inference and the gradient scratch do not
 * change. */
static void test_memplan_activations_2byte(void **state) {
    (void)state;
    qt_config c = cfg;
    c.num_hidden_layers = 24;
    qt_model_opts o;
    qt_model_opts_default(&o);
    o.max_B = 2, o.max_T = 64;
    qt_mem_breakdown f32, f16, bf16;
    for (int lora = 0; lora < 2; lora++)
        for (int ckpt = 0; ckpt < 2; ckpt++) {
            o.lora = lora, o.lora_dropout = 0.1f, o.grad_checkpointing = ckpt;
            o.compute = QT_F32;
            qt_model_memory(&c, &o, &f32);
            o.compute = QT_F16;
            qt_model_memory(&c, &o, &f16);
            o.compute = QT_BF16;
            qt_model_memory(&c, &o, &bf16);
            double ratio = (double)f16.activations / (double)f32.activations;
            printf("activations, 24 layers, lora %d, checkpointing %d: f32 %zu B, f16 %zu B (%.3f)\n", lora, ckpt,
                   f32.activations, f16.activations, ratio);
            assert_int_equal(f16.activations, bf16.activations);
            assert_int_equal(f16.act_grads, f32.act_grads);
            /* checkpointing keeps only the layer inputs (halved) plus one fp32 layer: a smaller gain */
            if (!ckpt) assert_true(ratio > 0.5 && ratio < 0.56);
            else assert_true(ratio < 0.9);
        }
    o.infer = 1, o.lora = 0, o.grad_checkpointing = 0;
    o.compute = QT_F32;
    qt_model_memory(&c, &o, &f32);
    o.compute = QT_F16;
    qt_model_memory(&c, &o, &f16);
    assert_int_equal(f16.activations, f32.activations);
}

/* A 2 x 16 batch of random tokens, one document per row; every `skip`-th
 * target ignored. The arrays live in the caller's struct. */
typedef struct {
    int32_t in[32], tg[32], pos[32], ds[32];
} batch_2x16;

static qt_batch random_batch(batch_2x16 *a, uint64_t seed, int skip) {
    const int B = 2, T = 16;
    qt_rng r;
    qt_rng_seed(&r, seed);
    for (int i = 0; i < B * T; i++) {
        a->in[i] = (int32_t)(qt_rng_uniform(&r) * (float)cfg.vocab_size) % cfg.vocab_size;
        a->tg[i] = i % skip == 0 ? QT_IGNORE_INDEX
                                 : (int32_t)(qt_rng_uniform(&r) * (float)cfg.vocab_size) % cfg.vocab_size;
        a->pos[i] = i % T, a->ds[i] = 0;
    }
    return (qt_batch){.B = B, .T = T, .inputs = a->in, .targets = a->tg, .positions = a->pos, .doc_start = a->ds};
}

/* One forward/backward in f16 with 2-byte activations (every layer's slots)
 * and with checkpointing (only the layer inputs in 2 bytes, the layer
 * recomputed from them) gives bit-identical gradients and loss: the backward
 * reads exactly what the forward stored. LoRA with dropout and full. */
static void test_f16_acts_checkpointing_agree(void **state) {
    (void)state;
    const int B = 2, T = 16;
    batch_2x16 arrays;
    qt_batch b = random_batch(&arrays, 3, 5);
    for (int lora = 0; lora < 2; lora++) {
        qt_model_opts o;
        qt_model_opts_default(&o);
        o.max_B = B, o.max_T = T, o.compute = QT_F16, o.lora = lora;
        o.lora_dropout = 0.1f, o.lora_targets = QT_LORA_Q | QT_LORA_V | QT_LORA_DOWN;
        qt_model *m[2];
        double loss[2];
        for (int ck = 0; ck < 2; ck++) {
            o.grad_checkpointing = ck;
            assert_int_equal(qt_model_load(dir, &o, &m[ck]), QT_OK);
            assert_non_null(m[ck]->acts.x16);
            if (ck) assert_null(m[ck]->acts.layer16);
            else assert_non_null(m[ck]->acts.layer16);
            if (lora) { /* B starts at 0: give it values so every gradient path carries signal */
                float *w = qt_model_master(m[ck]);
                for (size_t i = 0; i < qt_model_numel(m[ck]); i++) w[i] += 0.01f * (float)((i * 7) % 13) - 0.06f;
            }
            assert_int_equal(qt_model_forward_backward(m[ck], &b, 64.0f, &loss[ck], NULL), QT_OK);
        }
        assert_true(isfinite(loss[0]) && loss[0] == loss[1]);
        size_t n = qt_model_numel(m[0]);
        float nrm = 0.0f;
        for (size_t i = 0; i < n; i++) nrm += fabsf(qt_model_grads(m[0])[i]);
        assert_true(nrm > 0.0f && isfinite(nrm));
        assert_memory_equal(qt_model_grads(m[0]), qt_model_grads(m[1]), n * 4);
        qt_model_free(m[0]), qt_model_free(m[1]);
    }
}

/* oneDNN bf16 GEMM (op_dnnl.h): where it cannot run (no oneDNN, no
 * AVX512_BF16: this development machine) it refuses with QT_EUNSUPPORTED,
 * leaves out untouched, and a bf16 model does not select it; where it runs,
 * it matches an fp64 product of the same bf16 values. */
static void test_dnnl_bf16_dispatch(void **state) {
    (void)state;
    enum { N = 6, IN = 40, OUT = 24 };
    uint16_t a[N * IN], w[OUT * IN];
    float bias[OUT], out[N * OUT], sentinel[N * OUT];
    for (int i = 0; i < N * IN; i++) a[i] = qt_f32_to_bf16(sinf((float)i));
    for (int i = 0; i < OUT * IN; i++) w[i] = qt_f32_to_bf16(cosf(3.0f * (float)i));
    for (int i = 0; i < OUT; i++) bias[i] = 0.25f * (float)i;
    for (int i = 0; i < N * OUT; i++) out[i] = sentinel[i] = -7.0f;
    /* oneDNN scales the bias with alpha: refused, whatever the CPU */
    assert_int_equal(op_dnnl_bf16_matmul(out, a, w, bias, N, IN, OUT, 0.5f), QT_EUNSUPPORTED);
    assert_memory_equal(out, sentinel, sizeof out);
    int avail = op_dnnl_bf16_available();
    printf("oneDNN native bf16 matmul available: %d (AVX512_BF16: %d)\n", avail, op_cpu_has_bf16());
    if (!avail) {
        assert_int_equal(op_dnnl_bf16_matmul(out, a, w, bias, N, IN, OUT, 1.0f), QT_EUNSUPPORTED);
        assert_memory_equal(out, sentinel, sizeof out);
    } else {
        assert_int_equal(op_dnnl_bf16_matmul(out, a, w, bias, N, IN, OUT, 1.0f), QT_OK);
        for (int n = 0; n < N; n++)
            for (int o = 0; o < OUT; o++) {
                double ref = bias[o], mag = 0;
                for (int i = 0; i < IN; i++) {
                    double p = (double)qt_bf16_to_f32(a[n * IN + i]) * qt_bf16_to_f32(w[o * IN + i]);
                    ref += p, mag += fabs(p);
                }
                assert_true(fabs(out[n * OUT + o] - ref) <= 1e-5 * (mag + fabs(bias[o])) + 1e-6);
            }
    }
    qt_model_opts o;
    qt_model_opts_default(&o);
    o.max_B = 1, o.max_T = 8, o.compute = QT_F16;
    qt_model *m;
    /* f16 on the cpu backend: no f16 GEMM there, so fp32 sgemm (the guard's stand-in GEMM covers the f16 path) */
    assert_int_equal(qt_model_load(dir, &o, &m), QT_OK);
    assert_int_equal(m->native16, 0);
    qt_model_free(m);
    if (op_cpu_has_bf16()) return;
    /* the model only selects it on bf16 hardware: emulated bf16 keeps fp32 sgemm */
    setenv("QTUNE_BF16_EMULATE", "1", 1);
    o.compute = QT_BF16;
    assert_int_equal(qt_model_load(dir, &o, &m), QT_OK);
    assert_int_equal(m->native16, 0);
    qt_model_free(m);
    unsetenv("QTUNE_BF16_EMULATE");
}

/* The general bf16 GEMM (op_dnnl_bf16_gemm): each of the four layouts the
 * model uses or could use (A and B stored plain or transposed), with and
 * without accumulation into C and with a scale, against an fp64 product of
 * the same bf16 values plus C's previous value. Where it cannot run it
 * refuses and leaves C untouched. */
static void test_dnnl_bf16_gemm_layouts(void **state) {
    (void)state;
    enum { M = 7, N = 33, K = 45 };
    uint16_t a[M * K], b[K * N];
    float c[M * N], c0[M * N];
    for (int i = 0; i < M * K; i++) a[i] = qt_f32_to_bf16(sinf(0.7f * (float)i));
    for (int i = 0; i < K * N; i++) b[i] = qt_f32_to_bf16(cosf(1.3f * (float)i));
    int avail = op_dnnl_bf16_available();
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++)
            for (int acc = 0; acc < 2; acc++) {
                float alpha = acc ? 0.5f : 1.0f;
                for (int i = 0; i < M * N; i++) c[i] = c0[i] = 0.125f * (float)(i % 11) - 0.5f;
                int rc = op_dnnl_bf16_gemm(c, a, ta, b, tb, NULL, M, N, K, alpha, acc);
                if (!avail) {
                    assert_int_equal(rc, QT_EUNSUPPORTED);
                    assert_memory_equal(c, c0, sizeof c);
                    continue;
                }
                assert_int_equal(rc, QT_OK);
                for (int m = 0; m < M; m++)
                    for (int n = 0; n < N; n++) {
                        double ref = 0, mag = 0;
                        for (int k = 0; k < K; k++) {
                            float x = qt_bf16_to_f32(ta ? a[k * M + m] : a[m * K + k]);
                            float y = qt_bf16_to_f32(tb ? b[n * K + k] : b[k * N + n]);
                            ref += (double)x * y, mag += fabs((double)x * y);
                        }
                        ref = alpha * ref + (acc ? c0[m * N + n] : 0.0);
                        assert_true(fabs(c[m * N + n] - ref) <= 1e-5 * (mag + 1.0));
                    }
            }
    /* a bias with accumulation is refused on every CPU, C untouched */
    float bias[N] = {0};
    for (int i = 0; i < M * N; i++) c[i] = c0[i];
    assert_int_equal(op_dnnl_bf16_gemm(c, a, 0, b, 0, bias, M, N, K, 1.0f, 1), QT_EUNSUPPORTED);
    assert_memory_equal(c, c0, sizeof c);
}

/* The bf16 GEMMs of the lm_head's logits for N rows: one per thread's slice
 * of each vocabulary chunk; LoRA's forward + dx walk (fused) has x as bf16
 * in its first ceil(N / 2) rows (16 at a time) of the chunk's weights. */
static long lmhead_gemms(int N, int fused) {
    const int chunk = fused ? OP_CE_CHUNK - ((N + 1) / 2 + 15) / 16 * 16 : OP_CE_CHUNK, nt = omp_get_max_threads();
    long n = 0;
    for (int v0 = 0; v0 < cfg.vocab_size; v0 += chunk) {
        int cv = cfg.vocab_size - v0 < chunk ? cfg.vocab_size - v0 : chunk;
        for (int id = 0, a, e; id < nt; id++) op_split(cv, nt, id, 16, &a, &e), n += e > a;
    }
    return n;
}

/* Native bf16 (AVX512_BF16 and oneDNN): the layers' forward, input-gradient
 * and (full fine-tuning) weight-gradient products run on oneDNN's bf16 GEMM,
 * exactly as many as the graph has (counted), and the loss and gradients
 * agree with emulated bf16 (QTUNE_BF16_EMULATE=1: the same bf16 values
 * through fp32 sgemm), which runs none. Only the summation order differs,
 * so the agreement is to fp32 rounding where a bf16 rounding does not flip;
 * the bound leaves room for a few such flips. Skipped without the hardware
 * (there the emulated path is all there is). */
static void test_bf16_native_matches_emulated(void **state) {
    (void)state;
    if (!op_cpu_has_bf16() || !op_dnnl_bf16_available()) {
        printf("no native bf16 GEMM on this CPU: nothing to compare\n");
        return;
    }
    const int B = 2, T = 16, L = cfg.num_hidden_layers;
    batch_2x16 arrays;
    qt_batch b = random_batch(&arrays, 5, 7);
    for (int lora = 0; lora < 2; lora++) {
        qt_model_opts o;
        qt_model_opts_default(&o);
        o.max_B = B, o.max_T = T, o.compute = QT_BF16, o.lora = lora;
        o.lora_targets = QT_LORA_Q | QT_LORA_V | QT_LORA_DOWN;
        qt_model *m[2];
        double loss[2];
        long runs[2];
        for (int emu = 0; emu < 2; emu++) {
            if (emu) setenv("QTUNE_BF16_EMULATE", "1", 1);
            else unsetenv("QTUNE_BF16_EMULATE");
            assert_int_equal(qt_model_load(dir, &o, &m[emu]), QT_OK);
            if (lora) {
                float *w = qt_model_master(m[emu]);
                for (size_t i = 0; i < qt_model_numel(m[emu]); i++) w[i] += 0.01f * (float)((i * 7) % 13) - 0.06f;
                qt_model_weights_updated(m[emu]);
            }
            long before = op_dnnl_bf16_runs();
            assert_int_equal(qt_model_forward_backward(m[emu], &b, 64.0f, &loss[emu], NULL), QT_OK);
            runs[emu] = op_dnnl_bf16_runs() - before;
        }
        unsetenv("QTUNE_BF16_EMULATE");
        /* full: forward, dx and dW of 7 linears a layer, and the lm_head's logits (its forward keeps them,
         * op_lmhead_ce_forward_keep): one GEMM per thread's slice of each vocabulary chunk; LoRA: forward
         * and dx, but layer 0's q/k/v need no dx, and the logits of the lm_head's forward fused with dx */
        assert_int_equal(runs[0],
                         lora ? (long)L * 14 - 3 + lmhead_gemms(B * T, 1) : (long)L * 21 + lmhead_gemms(B * T, 0));
        assert_int_equal(runs[1], 0);
        assert_true(isfinite(loss[0]) && fabs(loss[0] - loss[1]) <= 1e-5 * fabs(loss[1]));
        size_t n = qt_model_numel(m[0]);
        double d2 = 0, g2 = 0;
        for (size_t i = 0; i < n; i++) {
            double d = (double)qt_model_grads(m[0])[i] - qt_model_grads(m[1])[i];
            d2 += d * d, g2 += (double)qt_model_grads(m[1])[i] * qt_model_grads(m[1])[i];
        }
        printf("bf16 native vs emulated (%s): loss %.9g / %.9g, gradient rel diff %.3g\n", lora ? "lora" : "full",
               loss[0], loss[1], sqrt(d2 / g2));
        assert_true(g2 > 0 && sqrt(d2 / g2) <= 1e-3);
        qt_model_free(m[0]), qt_model_free(m[1]);
    }
}

/* fp64 reference of out (N, OUT) = alpha * x (N, IN) @ wf^T (+ bias) (+ c0 when acc), wf the weight's f32 values;
 * every element within 1e-5 of the magnitude sum (fp32 rounding, any summation order). */
static void check_forward(const float *out, const float *x, const float *wf, const float *bias, const float *c0, int N,
                          int IN, int OUT, float alpha, int acc) {
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OUT; o++) {
            double ref = 0, mag = 0;
            for (int i = 0; i < IN; i++) {
                double p = (double)x[(size_t)n * IN + i] * wf[(size_t)o * IN + i];
                ref += p, mag += fabs(p);
            }
            ref = alpha * ref + (bias ? bias[o] : 0.0) + (acc ? c0[(size_t)n * OUT + o] : 0.0);
            assert_true(fabs(out[(size_t)n * OUT + o] - ref) <= 1e-5 * (fabs(alpha) * mag + 1.0));
        }
}

/* dinp (N, IN) = c0 + alpha * dout (N, OUT) @ wf, likewise */
static void check_dinp(const float *dinp, const float *dout, const float *wf, const float *c0, int N, int IN, int OUT,
                       float alpha) {
    for (int n = 0; n < N; n++)
        for (int i = 0; i < IN; i++) {
            double ref = 0, mag = 0;
            for (int o = 0; o < OUT; o++) {
                double p = (double)dout[(size_t)n * OUT + o] * wf[(size_t)o * IN + i];
                ref += p, mag += fabs(p);
            }
            ref = alpha * ref + c0[(size_t)n * IN + i];
            assert_true(fabs(dinp[(size_t)n * IN + i] - ref) <= 1e-5 * (fabs(alpha) * mag + 1.0));
        }
}

/* op_matmul_forward / op_matmul_backward's dinp on a bf16 weight and on a
 * 4-bit one that dequantizes to bf16 (op_matmul.c): an operand whose values
 * are all bf16 runs on oneDNN's bf16 GEMM where the CPU has it (counted by
 * op_dnnl_bf16_runs) and equals an fp64 product of the same values to fp32
 * rounding, with and without bias, scale and accumulation; shapes that take
 * several row blocks (N past the workspace) and several 4-bit panels (a
 * weight past OP_MATMUL_WS_CAP). An operand that is not bf16-exact, and any
 * operand under QTUNE_BF16_GEMM=off, takes the fp32 path (no bf16 GEMM run)
 * with the same result bound. Without the hardware only the fp32 path runs. */
static void test_matmul_bf16_gemm_path(void **state) {
    (void)state;
    const int avail = op_dnnl_bf16_available();
    printf("bf16 GEMM available: %d\n", avail);
    const struct { int N, IN, OUT; qt_dtype dt; } cases[] = {
        {70, 64, 16, QT_BF16}, {70, 64, 16, QT_Q4}, {5, 1024, 4100, QT_Q4}, {3, 96, 40, QT_BF16}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int N = cases[c].N, IN = cases[c].IN, OUT = cases[c].OUT;
        const qt_dtype dt = cases[c].dt;
        const size_t nw = (size_t)OUT * IN;
        float *src = malloc(sizeof(float) * nw), *wf = malloc(sizeof(float) * nw);
        uint16_t *w16 = malloc(2 * nw);
        assert_non_null(src), assert_non_null(wf), assert_non_null(w16);
        for (size_t i = 0; i < nw; i++) src[i] = 0.05f * sinf(0.37f * (float)i + 0.1f * (float)(i % 7));
        void *w = w16;
        qt_q4_weight *q = NULL;
        if (dt == QT_Q4) {
            size_t bytes = qt_q4_bytes((uint64_t)OUT, (uint64_t)IN, QT_Q4_BLOCK, 1);
            q = malloc(bytes);
            assert_non_null(q);
            qt_q4_init(q, QT_Q4_NF4, QT_BF16, (uint64_t)OUT, (uint64_t)IN, QT_Q4_BLOCK, 1);
            assert_int_equal(qt_q4_quantize_weight(q, src, QT_F32), QT_OK);
            qt_q4_dequantize(q, 0, nw, wf);
            w = q;
        } else {
            for (size_t i = 0; i < nw; i++) w16[i] = qt_f32_to_bf16(src[i]), wf[i] = qt_bf16_to_f32(w16[i]);
        }
        const size_t nx = (size_t)N * (IN > OUT ? IN : OUT);
        float *x = malloc(sizeof(float) * nx), *out = malloc(sizeof(float) * nx), *c0 = malloc(sizeof(float) * nx);
        float *bias = malloc(sizeof(float) * OUT), *ws = malloc(sizeof(float) * op_matmul_ws_floats(IN, OUT));
        assert_non_null(x), assert_non_null(out), assert_non_null(c0), assert_non_null(bias), assert_non_null(ws);
        for (int o = 0; o < OUT; o++) bias[o] = 0.01f * (float)(o % 9);
        for (int exact = 1; exact >= 0; exact--)
            for (int off = 0; off < 2; off++) {
                if (off) setenv("QTUNE_BF16_GEMM", "off", 1);
                for (size_t i = 0; i < nx; i++) {
                    float v = cosf(0.11f * (float)i) + 0.25f;
                    x[i] = exact ? qt_bf16_to_f32(qt_f32_to_bf16(v)) : v;
                    c0[i] = 0.5f * sinf((float)i);
                }
                const int want = exact && !off && avail;
                for (int acc = 0; acc < 2; acc++) {
                    float alpha = acc ? 0.5f : 1.0f;
                    long before = op_dnnl_bf16_runs();
                    memcpy(out, c0, sizeof(float) * (size_t)N * OUT);
                    op_matmul_forward(out, x, w, dt, bias, N, IN, OUT, alpha, acc, ws);
                    check_forward(out, x, wf, bias, c0, N, IN, OUT, alpha, acc);
                    assert_int_equal(op_dnnl_bf16_runs() > before, want);
                    /* dinp += alpha * dout @ W, dout (N, OUT) taken from x */
                    before = op_dnnl_bf16_runs();
                    memcpy(out, c0, sizeof(float) * (size_t)N * IN);
                    op_matmul_backward(out, NULL, NULL, x, NULL, w, dt, N, IN, OUT, alpha, ws);
                    check_dinp(out, x, wf, c0, N, IN, OUT, alpha);
                    assert_int_equal(op_dnnl_bf16_runs() > before, want);
                }
                unsetenv("QTUNE_BF16_GEMM");
            }
        free(src), free(wf), free(w16), free(q), free(x), free(out), free(c0), free(bias), free(ws);
    }
}

/* QLoRA in bf16 (issue 39's CPU path): the 4-bit base's products, forward
 * and input gradient, run on the bf16 GEMM where the CPU has it (their
 * operands are keep()-rounded, so bf16-exact; the panels dequantize to bf16):
 * as many GEMMs as the graph has, with and without gradient checkpointing,
 * and the loss and LoRA gradients agree with QTUNE_BF16_GEMM=off (the fp32
 * path, no GEMM run) to the bound test_bf16_native_matches_emulated uses.
 * Skipped without the hardware. */
static void test_qlora_bf16_on_the_gemm(void **state) {
    (void)state;
    if (!op_cpu_has_bf16() || !op_dnnl_bf16_available()) {
        printf("no native bf16 GEMM on this CPU: nothing to compare\n");
        return;
    }
    const int L = cfg.num_hidden_layers;
    batch_2x16 arrays;
    qt_batch b = random_batch(&arrays, 5, 7);
    for (int ckpt = 0; ckpt < 2; ckpt++) {
        qt_model_opts o;
        qt_model_opts_default(&o);
        o.max_B = 2, o.max_T = 16, o.compute = QT_BF16, o.lora = 1, o.grad_checkpointing = ckpt;
        o.lora_targets = QT_LORA_Q | QT_LORA_V | QT_LORA_DOWN;
        o.quant4 = 1, o.quant4_type = QT_Q4_NF4;
        qt_model *m[2];
        double loss[2];
        long runs[2];
        for (int off = 0; off < 2; off++) {
            if (off) setenv("QTUNE_BF16_GEMM", "off", 1);
            assert_int_equal(qt_model_load(dir, &o, &m[off]), QT_OK);
            float *w = qt_model_master(m[off]); /* B non-zero, so dx reaches the layers below */
            for (size_t i = 0; i < qt_model_numel(m[off]); i++) w[i] += 0.01f * (float)((i * 7) % 13) - 0.06f;
            qt_model_weights_updated(m[off]);
            long before = op_dnnl_bf16_runs();
            assert_int_equal(qt_model_forward_backward(m[off], &b, 64.0f, &loss[off], NULL), QT_OK);
            runs[off] = op_dnnl_bf16_runs() - before;
            unsetenv("QTUNE_BF16_GEMM");
        }
        /* forward 7 a layer (twice with checkpointing: the recompute), dx 7 a layer less layer 0's q/k/v, the
         * lm_head's logits */
        assert_int_equal(runs[0], (long)L * 7 * (ckpt ? 2 : 1) + (long)L * 7 - 3 + lmhead_gemms(2 * 16, 1));
        assert_int_equal(runs[1], 0);
        assert_true(isfinite(loss[0]) && fabs(loss[0] - loss[1]) <= 1e-5 * fabs(loss[1]));
        size_t n = qt_model_numel(m[0]);
        double d2 = 0, g2 = 0;
        for (size_t i = 0; i < n; i++) {
            double d = (double)qt_model_grads(m[0])[i] - qt_model_grads(m[1])[i];
            d2 += d * d, g2 += (double)qt_model_grads(m[1])[i] * qt_model_grads(m[1])[i];
        }
        printf("qlora bf16 GEMM vs fp32 path (checkpointing %d): loss %.9g / %.9g, gradient rel diff %.3g\n", ckpt,
               loss[0], loss[1], sqrt(d2 / g2));
        assert_true(g2 > 0 && sqrt(d2 / g2) <= 1e-3);
        qt_model_free(m[0]), qt_model_free(m[1]);
    }
}

/* The lm_head + cross-entropy forward (op_lmhead_ce_forward, _keep) and
 * LoRA's forward + dx walk (op_lmhead_ce_forward_dx) on a bf16 table with a
 * bf16-exact x: their logits on the bf16 GEMM where the CPU has it
 * (counted), loss, lse and dx equal to the fp32 path's (QTUNE_BF16_GEMM=off)
 * to fp32 rounding; a non-exact x takes the fp32 path. Several vocabulary
 * chunks, a last one partial. */
static void test_lmhead_bf16_gemm_path(void **state) {
    (void)state;
    enum { N = 12, C = 64, V = 2 * OP_CE_CHUNK + 37 };
    const int avail = op_dnnl_bf16_available();
    uint16_t *w = malloc(2 * (size_t)V * C);
    float *x = malloc(sizeof(float) * N * C), *ws = malloc(sizeof(float) * op_lmhead_ce_ws_floats(N, C));
    assert_non_null(w), assert_non_null(x), assert_non_null(ws);
    for (size_t i = 0; i < (size_t)V * C; i++) w[i] = qt_f32_to_bf16(0.3f * sinf(0.13f * (float)i));
    int32_t targets[N];
    for (int n = 0; n < N; n++) targets[n] = n == 3 ? -100 : (n * 1543) % V;
    for (int exact = 1; exact >= 0; exact--) {
        for (int i = 0; i < N * C; i++) {
            float v = cosf(0.7f * (float)i);
            x[i] = exact ? qt_bf16_to_f32(qt_f32_to_bf16(v)) : v;
        }
        float loss[2][N], lse[2][N];
        long runs[2];
        for (int off = 0; off < 2; off++) {
            if (off) setenv("QTUNE_BF16_GEMM", "off", 1);
            long before = op_dnnl_bf16_runs();
            op_lmhead_ce_forward(loss[off], lse[off], x, w, QT_BF16, targets, N, C, V, ws);
            runs[off] = op_dnnl_bf16_runs() - before;
            unsetenv("QTUNE_BF16_GEMM");
        }
        assert_int_equal(runs[0] > 0, exact && avail);
        assert_int_equal(runs[1], 0);
        for (int n = 0; n < N; n++) {
            assert_true(fabsf(lse[0][n] - lse[1][n]) <= 1e-5f * (fabsf(lse[1][n]) + 1.0f));
            assert_true(fabsf(loss[0][n] - loss[1][n]) <= 1e-5f * (fabsf(lse[1][n]) + 1.0f));
        }
        assert_true(loss[0][3] == 0.0f);
        /* forward_dx: the same loss and lse, and dx += 0.5 * (softmax - onehot) @ W */
        float *dx = calloc(2 * (size_t)N * C, sizeof(float));
        assert_non_null(dx);
        for (int off = 0; off < 2; off++) {
            if (off) setenv("QTUNE_BF16_GEMM", "off", 1);
            long before = op_dnnl_bf16_runs();
            op_lmhead_ce_forward_dx(loss[off], lse[off], dx + (size_t)off * N * C, x, w, QT_BF16, targets, 0.5f, N, C,
                                    V, ws);
            runs[off] = op_dnnl_bf16_runs() - before;
            unsetenv("QTUNE_BF16_GEMM");
        }
        assert_int_equal(runs[0] > 0, exact && avail);
        assert_int_equal(runs[1], 0);
        for (int n = 0; n < N; n++) {
            assert_true(fabsf(lse[0][n] - lse[1][n]) <= 1e-5f * (fabsf(lse[1][n]) + 1.0f));
            assert_true(fabsf(loss[0][n] - loss[1][n]) <= 1e-5f * (fabsf(lse[1][n]) + 1.0f));
        }
        for (int i = 0; i < N * C; i++)
            assert_true(fabsf(dx[i] - dx[N * C + i]) <= 1e-5f * (fabsf(dx[N * C + i]) + 1.0f));
        for (int i = 3 * C; i < 4 * C; i++) assert_true(dx[i] == 0.0f); /* the ignored row */
        free(dx);
    }
    free(w), free(x), free(ws);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_f16_saturates),    cmocka_unit_test(test_round_bf16_and_f32),
        cmocka_unit_test(test_bf16_rule),              cmocka_unit_test(test_memplan_compute_copy),
        cmocka_unit_test(test_lora_base_held_in_f16),  cmocka_unit_test(test_full_compute_copy_refreshed),
        cmocka_unit_test(test_round_store_and_load),   cmocka_unit_test(test_memplan_activations_2byte),
        cmocka_unit_test(test_f16_acts_checkpointing_agree), cmocka_unit_test(test_dnnl_bf16_dispatch),
        cmocka_unit_test(test_dnnl_bf16_gemm_layouts),     cmocka_unit_test(test_matmul_bf16_gemm_path),
        cmocka_unit_test(test_lmhead_bf16_gemm_path),
        cmocka_unit_test(test_bf16_native_matches_emulated), cmocka_unit_test(test_qlora_bf16_on_the_gemm),
    };
    return cmocka_run_group_tests(tests, write_model, remove_model);
}
