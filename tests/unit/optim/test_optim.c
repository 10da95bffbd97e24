/* optim: Adam/AdamW (hand values, decay ranges, shards), clipping and the
 * overflow check, DeepSpeed schedules at their boundaries, and the loss
 * scaler's state machine step by step against a table worked out by hand from
 * DeepSpeed's DynamicLossScaler rules. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/log.h"
#include "core/mem.h"
#include "core/rng.h"
#include "optim/adam.h"

/* the cpu backend: these buffers are host memory, which is its device memory */
static qt_backend *be;
#include "optim/clip.h"
#include "optim/loss_scaler.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"

static void fill_normal(float *x, size_t n, uint64_t seed) {
    qt_rng r;
    qt_rng_seed(&r, seed);
    for (size_t i = 0; i < n; i++) x[i] = qt_rng_normal(&r);
}

/* Step 1 from zero state: m = (1-b1) g, v = (1-b2) g^2, the bias corrections
 * cancel them, so p moves by lr * g / (|g| + eps) -- about lr * sign(g). */
static void test_adam_first_step(void **state) {
    (void)state;
    qt_adam_cfg c;
    qt_adam_cfg_default(&c);
    float p[3] = {1.0f, -2.0f, 0.5f}, g[3] = {0.25f, -4.0f, 0.0f}, m[3] = {0}, v[3] = {0};
    assert_int_equal(qt_adam_step(be, &c, 1, 0.01, 1.0f, p, g, m, v, 3, 0, NULL, 0, NULL), QT_OK);
    assert_float_equal(p[0], 1.0f - 0.01f, 1e-6);
    assert_float_equal(p[1], -2.0f + 0.01f, 1e-6);
    assert_float_equal(p[2], 0.5f, 0.0f); /* zero grad: m = 0, no move */
    assert_float_equal(m[1], -0.4f, 1e-6);
    assert_float_equal(v[1], 0.016f, 1e-6);
    assert_int_equal(qt_adam_step(be, &c, 0, 0.01, 1.0f, p, g, m, v, 3, 0, NULL, 0, NULL), QT_EINVAL);
}

/* AdamW decays only elements in the decay ranges, by p *= (1 - lr*wd) before
 * the update; Adam adds wd*p to the gradient instead. */
static void test_adam_decay_ranges(void **state) {
    (void)state;
    qt_adam_cfg c;
    qt_adam_cfg_default(&c);
    c.weight_decay = 0.5;
    const double lr = 0.1;
    float p[6] = {1, 1, 1, 1, 1, 1}, g[6] = {0}, m[6] = {0}, v[6] = {0};
    qt_range decay[2] = {{1, 3}, {5, 6}};
    assert_int_equal(qt_adam_step(be, &c, 1, lr, 1.0f, p, g, m, v, 6, 0, decay, 2, NULL), QT_OK);
    const float expect_w[6] = {1, 0.95f, 0.95f, 1, 1, 0.95f}; /* zero grads: only decay moves p */
    for (int i = 0; i < 6; i++) assert_float_equal(p[i], expect_w[i], 1e-7);

    /* Adam (L2): with g = 0 the gradient becomes wd*p = 0.5, and the first
     * step moves p by about lr (sign of the L2 gradient). */
    c.decoupled = 0;
    float q[6] = {1, 1, 1, 1, 1, 1}, m2[6] = {0}, v2[6] = {0};
    assert_int_equal(qt_adam_step(be, &c, 1, lr, 1.0f, q, g, m2, v2, 6, 0, decay, 2, NULL), QT_OK);
    for (int i = 0; i < 6; i++) {
        int d = (i >= 1 && i < 3) || i == 5;
        assert_float_equal(q[i], d ? 0.9f : 1.0f, 1e-6);
    }
}

/* A ZeRO shard runs the same arithmetic: two shards with their base offsets
 * give the bits of one whole-block call, decay ranges crossing the cut. */
static void test_adam_shards_match_whole(void **state) {
    (void)state;
    enum { N = 1000, CUT = 377 };
    qt_adam_cfg c;
    qt_adam_cfg_default(&c);
    c.weight_decay = 0.1;
    float *p1 = qt_calloc(N, 4, "p1"), *p2 = qt_calloc(N, 4, "p2"), *g = qt_calloc(N, 4, "g");
    float *m1 = qt_calloc(N, 4, "m1"), *v1 = qt_calloc(N, 4, "v1");
    float *m2 = qt_calloc(N, 4, "m2"), *v2 = qt_calloc(N, 4, "v2");
    fill_normal(p1, N, 1);
    memcpy(p2, p1, N * 4);
    qt_range decay[3] = {{0, 100}, {300, 500}, {900, 1000}};
    for (int step = 1; step <= 3; step++) {
        fill_normal(g, N, 100 + step);
        assert_int_equal(qt_adam_step(be, &c, step, 1e-3, 0.5f, p1, g, m1, v1, N, 0, decay, 3, NULL), QT_OK);
        assert_int_equal(qt_adam_step(be, &c, step, 1e-3, 0.5f, p2, g, m2, v2, CUT, 0, decay, 3, NULL), QT_OK);
        assert_int_equal(qt_adam_step(be, &c, step, 1e-3, 0.5f, p2 + CUT, g + CUT, m2 + CUT, v2 + CUT, N - CUT, CUT,
                                      decay, 3, NULL),
                         QT_OK);
    }
    assert_memory_equal(p1, p2, N * 4);
    assert_memory_equal(m1, m2, N * 4);
    assert_memory_equal(v1, v2, N * 4);
    qt_free(p1), qt_free(p2), qt_free(g), qt_free(m1), qt_free(v1), qt_free(m2), qt_free(v2);
}

static void test_clip(void **state) {
    (void)state;
    float g[4] = {3, 0, 4, 0};
    assert_true(qt_grad_sumsq(be, g, 4) == 25.0);
    /* norm 5 > max 1: coef = 1 / (5 + 1e-6) */
    double norm = qt_clip_grad_norm(be, g, 4, 1.0, 1.0);
    assert_true(norm == 5.0);
    assert_float_equal(g[0], 3.0f / 5.000001f, 1e-7);
    assert_float_equal(g[2], 4.0f / 5.000001f, 1e-7);
    /* below max: unchanged; clipping off: unchanged */
    float h[2] = {0.3f, 0.4f};
    assert_float_equal(qt_clip_grad_norm(be, h, 2, 1.0, 1.0), 0.5, 1e-7);
    assert_float_equal(h[1], 0.4f, 0.0f);
    assert_true(qt_clip_coef(100.0, 0.0) == 1.0f);
    /* scaled grads: the norm is reported unscaled and g comes back unscaled */
    float s[2] = {300.0f, 400.0f};
    assert_float_equal(qt_clip_grad_norm(be, s, 2, 0.0, 1.0 / 100.0), 5.0, 1e-9);
    assert_float_equal(s[0], 3.0f, 1e-6);
    /* non-finite: reported, coefficient 1, g untouched */
    float bad[3] = {1.0f, INFINITY, 2.0f};
    assert_false(isfinite(qt_clip_grad_norm(be, bad, 3, 1.0, 1.0)));
    assert_float_equal(bad[0], 1.0f, 0.0f);
    assert_true(qt_clip_coef(NAN, 1.0) == 1.0f);
}

static void test_nonfinite_and_determinism(void **state) {
    (void)state;
    const size_t n = 200000; /* several sum blocks, and above the OpenMP threshold */
    float *g = qt_malloc(n * 4, "grads");
    fill_normal(g, n, 7);
    assert_int_equal(qt_grad_has_nonfinite(be, g, n), 0);
    assert_true(isfinite(qt_grad_sumsq(be, g, n)));
    g[n - 1] = INFINITY;
    assert_int_equal(qt_grad_has_nonfinite(be, g, n), 1);
    assert_false(isfinite(qt_grad_sumsq(be, g, n)));
    g[n - 1] = NAN;
    assert_int_equal(qt_grad_has_nonfinite(be, g, n), 1);
    assert_false(isfinite(qt_grad_sumsq(be, g, n)));
    g[n - 1] = -INFINITY;
    assert_int_equal(qt_grad_has_nonfinite(be, g, n), 1);
    g[n - 1] = 3.4e38f; /* largest floats are finite, and so is their square in double */
    assert_int_equal(qt_grad_has_nonfinite(be, g, n), 0);
    assert_true(isfinite(qt_grad_sumsq(be, g, n)));
    /* The same bits whatever the thread count. */
    int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    double a = qt_grad_sumsq(be, g, n);
    omp_set_num_threads(3);
    double b = qt_grad_sumsq(be, g, n);
    omp_set_num_threads(saved);
    assert_memory_equal(&a, &b, sizeof a);
    /* sharded partial sums add up to the whole (to rounding) */
    double parts = qt_grad_sumsq(be, g, 12345) + qt_grad_sumsq(be, g + 12345, n - 12345);
    assert_true(fabs(parts - a) <= 1e-12 * a);
    qt_free(g);
}

static void test_schedules(void **state) {
    (void)state;
    qt_sched s;
    qt_sched_default(&s, QT_SCHED_WARMUP_LR, 0.01);
    assert_true(s.warmup_max_lr == 0.01 && s.warmup_num_steps == 1000 && s.warmup_type == QT_WARMUP_LOG);
    s.warmup_min_lr = 0.001;
    s.warmup_num_steps = 10;
    s.warmup_type = QT_WARMUP_LINEAR;
    assert_float_equal(qt_sched_lr(&s, -1), 0.001, 1e-15);
    assert_float_equal(qt_sched_lr(&s, 0), 0.001, 1e-15);
    assert_float_equal(qt_sched_lr(&s, 5), 0.001 + 0.009 * 0.5, 1e-15);
    assert_float_equal(qt_sched_lr(&s, 9), 0.001 + 0.009 * 0.9, 1e-15);
    assert_float_equal(qt_sched_lr(&s, 10), 0.01, 1e-15);
    assert_float_equal(qt_sched_lr(&s, 100000), 0.01, 1e-15);
    assert_float_equal(qt_sched_lr_for_update(&s, 0), 0.001, 1e-15);
    assert_float_equal(qt_sched_lr_for_update(&s, 6), qt_sched_lr(&s, 5), 0);
    s.warmup_type = QT_WARMUP_LOG;
    assert_float_equal(qt_sched_lr(&s, 4), 0.001 + 0.009 * log(5.0) / log(10.0), 1e-15);
    s.warmup_num_steps = 0; /* DeepSpeed clamps to 2 */
    assert_float_equal(qt_sched_lr(&s, 1), 0.001 + 0.009 * log(2.0) / log(2.0), 1e-15);

    qt_sched_default(&s, QT_SCHED_WARMUP_DECAY_LR, 0.5);
    assert_true(s.warmup_max_lr == 0.001); /* WarmupDecayLR's own default */
    assert_int_equal(qt_sched_check(&s, "t"), QT_EINVAL); /* total_num_steps required */
    s.warmup_num_steps = 10;
    s.total_num_steps = 30;
    s.warmup_type = QT_WARMUP_LINEAR;
    assert_int_equal(qt_sched_check(&s, "t"), QT_OK);
    assert_float_equal(qt_sched_lr(&s, 10), 0.001, 1e-15);
    assert_float_equal(qt_sched_lr(&s, 20), 0.0005, 1e-15);
    assert_float_equal(qt_sched_lr(&s, 30), 0.0, 1e-15);
    assert_float_equal(qt_sched_lr(&s, 40), 0.0, 1e-15);

    qt_sched_default(&s, QT_SCHED_WARMUP_COSINE_LR, 0.1);
    s.warmup_num_steps = 10;
    s.total_num_steps = 10;
    assert_int_equal(qt_sched_check(&s, "t"), QT_EINVAL); /* divides by total - warmup */
    s.total_num_steps = 110;
    s.warmup_min_ratio = 0.2;
    assert_float_equal(qt_sched_lr(&s, -1), 0.0, 0);
    assert_float_equal(qt_sched_lr(&s, 0), 0.1 * 0.2, 1e-15);
    /* first decay step: (it - W + 1) = 1 of 100 */
    assert_float_equal(qt_sched_lr(&s, 10), 0.1 * (1e-4 + (1 - 1e-4) * (1 + cos(M_PI / 100)) / 2), 1e-15);
    assert_float_equal(qt_sched_lr(&s, 59), 0.1 * (1e-4 + (1 - 1e-4) * 0.5), 1e-15);
    assert_float_equal(qt_sched_lr(&s, 109), 0.1 * 1e-4, 1e-15);
}

/* One row: the overflow flag fed in, then the expected scale and cur_hysteresis. */
typedef struct {
    int overflow;
    double scale;
    int hyst;
} scaler_row;

/* initial 2^4 = 16, window 3, hysteresis 2, min 2 -- worked out by hand from
 * the rules in loss_scaler.h. */
static const scaler_row scaler_table[] = {
    {0, 16, 2}, /* iter 0: (0 - -1) % 3 = 1 */
    {0, 16, 2}, /* iter 1: 2 % 3 */
    {0, 32, 2}, /* iter 2: 3 clean in a row: grow */
    {1, 32, 1}, /* iter 3: overflow spends one hysteresis, scale kept */
    {1, 16, 1}, /* iter 4: hysteresis spent: halve */
    {0, 16, 1}, /* iter 5: halving does not restore hysteresis */
    {1, 8, 1},  /* iter 6: so the next overflow halves at once */
    {0, 8, 1},  /* iter 7 */
    {0, 8, 1},  /* iter 8 */
    {0, 16, 2}, /* iter 9: 3 clean since iter 6: grow, hysteresis restored */
    {1, 16, 1}, /* iter 10 */
    {1, 8, 1},  /* iter 11 */
    {1, 4, 1},  /* iter 12 */
    {1, 2, 1},  /* iter 13: reaches the floor */
};

static void test_loss_scaler_table(void **state) {
    (void)state;
    qt_loss_scaler_cfg c;
    qt_loss_scaler_cfg_default(&c);
    assert_true(c.loss_scale == 0 && c.initial_scale_power == 16 && c.loss_scale_window == 1000 &&
                c.hysteresis == 2 && c.min_loss_scale == 1 && !c.consecutive_hysteresis);
    c.initial_scale_power = 4;
    c.loss_scale_window = 3;
    c.min_loss_scale = 2;
    qt_loss_scaler s;
    assert_int_equal(qt_loss_scaler_init(&s, &c), QT_OK);
    assert_true(qt_loss_scaler_scale(&s) == 16.0);
    for (size_t i = 0; i < sizeof scaler_table / sizeof scaler_table[0]; i++) {
        assert_int_equal(qt_loss_scaler_update(&s, scaler_table[i].overflow), QT_OK);
        assert_true(s.scale == scaler_table[i].scale);
        assert_int_equal(s.cur_hysteresis, scaler_table[i].hyst);
    }
    /* iter 14: at the floor and overflowing again: the error doctor lists */
    assert_int_equal(qt_loss_scaler_update(&s, 1), QT_ENUMERIC);
    assert_non_null(strstr(qt_error_message(), "lower the learning rate"));
    assert_non_null(strstr(qt_error_message(), "bf16"));
    assert_non_null(strstr(qt_error_message(), "check the data"));
    assert_true(s.scale == 2.0);
    assert_int_equal(s.n_overflows, 7); /* the failing update leaves the state as it was */
}

static void test_loss_scaler_variants(void **state) {
    (void)state;
    qt_loss_scaler_cfg c;
    qt_loss_scaler s;
    /* consecutive_hysteresis: any clean step restores it, so overflows that
     * alternate with clean steps never halve the scale. */
    qt_loss_scaler_cfg_default(&c);
    c.consecutive_hysteresis = 1;
    assert_int_equal(qt_loss_scaler_init(&s, &c), QT_OK);
    for (int i = 0; i < 20; i++) assert_int_equal(qt_loss_scaler_update(&s, i % 2 == 0), QT_OK);
    assert_true(s.scale == 65536.0);
    assert_int_equal(qt_loss_scaler_update(&s, 1), QT_OK);
    assert_int_equal(qt_loss_scaler_update(&s, 1), QT_OK);
    assert_true(s.scale == 32768.0);

    /* hysteresis 1: every overflow halves; the floor never goes below min */
    qt_loss_scaler_cfg_default(&c);
    c.hysteresis = 1;
    c.initial_scale_power = 2;
    c.min_loss_scale = 3; /* 4 / 2 = 2 < 3: clamped to 3 */
    assert_int_equal(qt_loss_scaler_init(&s, &c), QT_OK);
    assert_int_equal(qt_loss_scaler_update(&s, 1), QT_OK);
    assert_true(s.scale == 3.0);
    assert_int_equal(qt_loss_scaler_update(&s, 1), QT_ENUMERIC);

    /* default window: exactly 1000 clean steps double it */
    qt_loss_scaler_cfg_default(&c);
    assert_int_equal(qt_loss_scaler_init(&s, &c), QT_OK);
    for (int i = 0; i < 999; i++) qt_loss_scaler_update(&s, 0);
    assert_true(s.scale == 65536.0);
    qt_loss_scaler_update(&s, 0);
    assert_true(s.scale == 131072.0);

    /* static: fixed, overflow counted (the step is skipped) but never an error */
    qt_loss_scaler_cfg_default(&c);
    c.loss_scale = 128;
    c.hysteresis = 0; /* ignored for a static scale */
    assert_int_equal(qt_loss_scaler_init(&s, &c), QT_OK);
    for (int i = 0; i < 2000; i++) assert_int_equal(qt_loss_scaler_update(&s, i % 7 == 0), QT_OK);
    assert_true(s.scale == 128.0);
    assert_false(s.dynamic);

    qt_loss_scaler_cfg_default(&c);
    c.hysteresis = 0;
    assert_int_equal(qt_loss_scaler_init(&s, &c), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "hysteresis"));
}


/* The whole step: an overflow skips the update and does not advance the
 * schedule or Adam's step count; the loss scale is taken off the gradients;
 * clipping uses the unscaled norm; two shards with a shared global sum give
 * the bits of one whole-block step; the scalar state survives a JSON round trip. */
static void test_optimizer_step_sequence(void **state) {
    (void)state;
    enum { N = 300, CUT = 123 };
    qt_adam_cfg a;
    qt_adam_cfg_default(&a);
    a.weight_decay = 0.01;
    qt_sched s;
    qt_sched_default(&s, QT_SCHED_WARMUP_LR, 1e-3);
    s.warmup_num_steps = 4;
    s.warmup_type = QT_WARMUP_LINEAR;
    qt_loss_scaler_cfg lc;
    qt_loss_scaler_cfg_default(&lc);
    lc.initial_scale_power = 10;
    lc.hysteresis = 1;
    qt_optimizer o1, o2, ref;
    assert_int_equal(qt_optimizer_init(&o1, &a, &s, 1.0, &lc), QT_OK);
    assert_int_equal(qt_optimizer_init(&o2, &a, &s, 1.0, &lc), QT_OK);
    assert_int_equal(qt_optimizer_init(&ref, &a, &s, 1.0, NULL), QT_OK); /* fp32: scale 1 */
    assert_true(qt_optimizer_loss_scale(&ref) == 1.0);
    float *p1 = qt_calloc(N, 4, "p1"), *p2 = qt_calloc(N, 4, "p2"), *p3 = qt_calloc(N, 4, "p3");
    float *m[3], *v[3];
    for (int i = 0; i < 3; i++) m[i] = qt_calloc(N, 4, "m"), v[i] = qt_calloc(N, 4, "v");
    float *g = qt_calloc(N, 4, "g"), *gs = qt_calloc(N, 4, "g scaled");
    fill_normal(p1, N, 5);
    memcpy(p2, p1, N * 4);
    memcpy(p3, p1, N * 4);
    qt_range decay[1] = {{50, 250}};
    const int overflow_at = 2;
    for (int step = 0; step < 5; step++) {
        fill_normal(g, N, 50 + step);
        double scale = qt_optimizer_loss_scale(&o1);
        for (int i = 0; i < N; i++) gs[i] = g[i] * (float)scale;
        if (step == overflow_at) gs[7] = INFINITY;
        float before[N];
        memcpy(before, p1, sizeof before);
        double sum = qt_grad_sumsq(be, gs, N);
        qt_step_info info;
        assert_int_equal(qt_optimizer_apply(&o1, be, sum, 0, p1, gs, m[0], v[0], N, 0, decay, 1, &info), QT_OK);
        double sum_parts = qt_grad_sumsq(be, gs, CUT) + qt_grad_sumsq(be, gs + CUT, N - CUT);
        qt_optimizer o2b = o2; /* both shards see the state before the step */
        assert_int_equal(qt_optimizer_apply(&o2, be, sum_parts, 0, p2, gs, m[1], v[1], CUT, 0, decay, 1, NULL), QT_OK);
        assert_int_equal(qt_optimizer_apply(&o2b, be, sum_parts, 0, p2 + CUT, gs + CUT, m[1] + CUT, v[1] + CUT, N - CUT, CUT,
                                            decay, 1, NULL),
                         QT_OK);
        assert_true(info.loss_scale == scale);
        if (step == overflow_at) {
            assert_true(info.skipped);
            assert_false(isfinite(info.grad_norm));
            assert_memory_equal(before, p1, sizeof before);
            assert_true(qt_optimizer_loss_scale(&o1) == scale / 2);
            continue; /* the fp32 reference never saw this step */
        }
        assert_false(info.skipped);
        qt_step_info rinfo;
        assert_int_equal(qt_optimizer_apply(&ref, be, qt_grad_sumsq(be, g, N), 0, p3, g, m[2], v[2], N, 0, decay, 1, &rinfo),
                         QT_OK);
        /* the same lr (the schedule did not advance on the skip), the same
         * unscaled norm, and clipping active (norm ~ 17 > 1) */
        assert_true(info.lr == rinfo.lr);
        assert_float_equal(info.grad_norm, rinfo.grad_norm, 1e-9 * rinfo.grad_norm);
        assert_true(info.clip_coef < 1.0f);
        for (int i = 0; i < N; i++) assert_float_equal(p1[i], p3[i], 1e-6);
    }
    assert_int_equal(o1.n_updates, 4);
    assert_int_equal(o1.n_skipped, 1);
    assert_memory_equal(p1, p2, N * 4); /* shards == whole, bit for bit */
    assert_true(qt_sched_lr_for_update(&s, 3) == 1e-3 * 2 / 4);

    cJSON *js = qt_optimizer_state_json(&o1);
    assert_non_null(js);
    qt_optimizer back;
    assert_int_equal(qt_optimizer_init(&back, &a, &s, 1.0, &lc), QT_OK);
    assert_int_equal(qt_optimizer_state_load(&back, js, "ckpt"), QT_OK);
    assert_int_equal(back.n_updates, 4);
    assert_true(back.scaler.scale == o1.scaler.scale && back.scaler.cur_iter == o1.scaler.cur_iter &&
                back.scaler.last_overflow_iter == o1.scaler.last_overflow_iter);
    /* the one scaler format: trainer_state.json's "loss_scaler" object */
    const cJSON *ls = cJSON_GetObjectItemCaseSensitive(js, "loss_scaler");
    const char *keys[5] = {"scale", "cur_iter", "last_overflow_iter", "cur_hysteresis", "n_overflows"};
    for (int k = 0; k < 5; k++) assert_true(cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(ls, keys[k])));
    assert_int_equal(cJSON_GetArraySize(ls), 5);
    qt_loss_scaler_state sst;
    assert_int_equal(qt_loss_scaler_state_parse(ls, "trainer_state.json", &sst), QT_OK);
    assert_true(sst.scale == o1.scaler.scale && sst.n_overflows == 1);
    cJSON_ReplaceItemInObject((cJSON *)ls, "cur_iter", cJSON_CreateNumber(-2));
    assert_int_equal(qt_optimizer_state_load(&back, js, "ckpt"), QT_EFORMAT);
    assert_non_null(strstr(qt_error_message(), "\"cur_iter\""));
    cJSON_ReplaceItemInObject(js, "n_updates", cJSON_CreateString("x"));
    assert_int_equal(qt_optimizer_state_load(&back, js, "ckpt"), QT_EFORMAT);
    assert_non_null(strstr(qt_error_message(), "n_updates"));
    cJSON_Delete(js);
    qt_free(p1), qt_free(p2), qt_free(p3), qt_free(g), qt_free(gs);
    for (int i = 0; i < 3; i++) qt_free(m[i]), qt_free(v[i]);
}

/* The update's own finiteness answer (the trainer's check rides on it): 1 for
 * a finite update; 0 where one element becomes NaN (eps 0 and a zero
 * gradient: 0/0) or inf (a learning rate that overflows), wherever it sits:
 * on the calling thread (short runs), in the OpenMP loop (long ones, any
 * thread count), in the second piece of a decay split; the bits of every
 * other element as without the answer. */
static void test_adam_reports_finite(void **state) {
    (void)state;
    enum { N = 200003 };
    qt_adam_cfg c;
    qt_adam_cfg_default(&c);
    c.weight_decay = 0.1;
    qt_range decay[1] = {{N / 2, N}};
    float *p = qt_calloc(N, 4, "p"), *g = qt_calloc(N, 4, "g"), *m = qt_calloc(N, 4, "m"), *v = qt_calloc(N, 4, "v");
    const size_t ns[2] = {5, N}, at[3] = {0, 3, N - 2};
    for (int a = 0; a < 2; a++) {
        size_t n = ns[a];
        int finite = -7;
        fill_normal(p, n, 1), fill_normal(g, n, 2);
        memset(m, 0, n * 4), memset(v, 0, n * 4);
        assert_int_equal(qt_adam_step(be, &c, 1, 1e-3, 1.0f, p, g, m, v, n, 0, decay, 1, &finite), QT_OK);
        assert_int_equal(finite, 1);
        for (int w = 0; w < 3; w++) {
            size_t i = at[w] % n;
            for (int kind = 0; kind < 2; kind++) {
                qt_adam_cfg cc = c;
                fill_normal(p, n, 3), fill_normal(g, n, 4);
                memset(m, 0, n * 4), memset(v, 0, n * 4);
                if (kind == 0) cc.eps = 0.0, g[i] = 0.0f; /* 0 / (0 + 0) */
                else p[i] = 3.4e38f, g[i] = -1.0f;         /* p + lr: beyond FLT_MAX */
                double lr = kind == 0 ? 1e-3 : 1e37;
                finite = -7;
                assert_int_equal(qt_adam_step(be, &cc, 1, lr, 1.0f, p, g, m, v, n, 0, decay, 1, &finite), QT_OK);
                assert_false(isfinite(p[i]));
                assert_int_equal(finite, 0);
            }
        }
    }
    /* NULL: not asked */
    assert_int_equal(qt_adam_step(be, &c, 1, 1e-3, 1.0f, p, g, m, v, 5, 0, NULL, 0, NULL), QT_OK);
    qt_free(p), qt_free(g), qt_free(m), qt_free(v);
}

int main(void) {
    if (qt_backend_open("cpu", &be) != QT_OK) return 1;
    qt_log_set_level(QT_LOG_WARN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_adam_first_step),
        cmocka_unit_test(test_adam_decay_ranges),
        cmocka_unit_test(test_adam_shards_match_whole),
        cmocka_unit_test(test_adam_reports_finite),
        cmocka_unit_test(test_clip),
        cmocka_unit_test(test_nonfinite_and_determinism),
        cmocka_unit_test(test_schedules),
        cmocka_unit_test(test_loss_scaler_table),
        cmocka_unit_test(test_loss_scaler_variants),
        cmocka_unit_test(test_optimizer_step_sequence),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
