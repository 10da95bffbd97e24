/* train/ds_config: DeepSpeed's batch identity (derive the third of three,
 * agree when all are given, "auto"), defaults, the optimizer's AdamW mode,
 * schedules, fp16, ZeRO, and that every unimplemented key is named. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "train/ds_config.h"

/* Parses JSON text for `world` ranks; returns the status. */
static int parse_text(const char *text, int world, qt_ds_config *c) {
    cJSON *j = cJSON_Parse(text);
    assert_non_null(j);
    int rc = qt_ds_config_parse(j, "ds.json", world, c);
    cJSON_Delete(j);
    return rc;
}

static int has_ignored(const qt_ds_config *c, const char *key) {
    for (int i = 0; i < c->n_ignored; i++)
        if (strcmp(c->ignored[i], key) == 0) return 1;
    return 0;
}

static void expect_batch(const char *text, int world, long long tb, long long mb, long long ga) {
    qt_ds_config c;
    int rc = parse_text(text, world, &c);
    if (rc != QT_OK) fail_msg("%s (world %d): %s", text, world, qt_error_message());
    if (c.train_batch_size != tb || c.micro_batch != mb || c.grad_accum != ga)
        fail_msg("%s (world %d): got %lld/%lld/%lld, want %lld/%lld/%lld", text, world, (long long)c.train_batch_size,
                 (long long)c.micro_batch, (long long)c.grad_accum, tb, mb, ga);
}

static void test_batch_identity(void **state) {
    (void)state;
    /* the four-rank ZeRO-2 example from DESIGN.md */
    expect_batch("{\"train_batch_size\":32,\"gradient_accumulation_steps\":4}", 4, 32, 2, 4);
    expect_batch("{\"train_batch_size\":32,\"train_micro_batch_size_per_gpu\":2}", 4, 32, 2, 4);
    expect_batch("{\"train_micro_batch_size_per_gpu\":2,\"gradient_accumulation_steps\":4}", 4, 32, 2, 4);
    expect_batch("{\"train_batch_size\":32,\"train_micro_batch_size_per_gpu\":2,\"gradient_accumulation_steps\":4}", 4,
                 32, 2, 4);
    /* one given: accumulation 1 */
    expect_batch("{\"train_batch_size\":8}", 2, 8, 4, 1);
    expect_batch("{\"train_micro_batch_size_per_gpu\":3}", 2, 6, 3, 1);
    /* "auto" counts as not given */
    expect_batch("{\"train_batch_size\":\"auto\",\"train_micro_batch_size_per_gpu\":2,"
                 "\"gradient_accumulation_steps\":\"auto\"}",
                 1, 2, 2, 1);
    expect_batch("{\"train_batch_size\":\"auto\",\"train_micro_batch_size_per_gpu\":\"auto\","
                 "\"gradient_accumulation_steps\":\"auto\"}",
                 3, 3, 1, 1);
    expect_batch("{\"train_batch_size\":\"auto\",\"train_micro_batch_size_per_gpu\":\"auto\","
                 "\"gradient_accumulation_steps\":8}",
                 2, 16, 1, 8);
}

static const char *resolved(const qt_ds_config *c, const char *key) {
    for (int i = 0; i < c->n_resolved; i++)
        if (strncmp(c->resolved[i], key, strlen(key)) == 0 && c->resolved[i][strlen(key)] == ' ') return c->resolved[i];
    return NULL;
}

/* Every "auto" is said with its value and reason; train_batch_size 32 with
 * the rest "auto" is micro-batch 1 x accumulation 32 (HF fills the micro-batch
 * from its per-device batch; qtune's is 1), never a micro-batch of 32. */
static void test_auto_is_said(void **state) {
    (void)state;
    qt_ds_config c;
    const char *hf = "{\"train_batch_size\":32,\"train_micro_batch_size_per_gpu\":\"auto\","
                     "\"gradient_accumulation_steps\":\"auto\",\"gradient_clipping\":\"auto\","
                     "\"fp16\":{\"enabled\":\"auto\"},\"bf16\":{\"enabled\":\"auto\"},"
                     "\"optimizer\":{\"type\":\"AdamW\",\"params\":{\"lr\":\"auto\",\"betas\":\"auto\","
                     "\"eps\":\"auto\",\"weight_decay\":\"auto\"}},"
                     "\"scheduler\":{\"type\":\"WarmupDecayLR\",\"params\":{\"warmup_min_lr\":\"auto\","
                     "\"warmup_max_lr\":\"auto\",\"warmup_num_steps\":\"auto\",\"total_num_steps\":\"auto\"}},"
                     "\"zero_optimization\":{\"stage\":2,\"overlap_comm\":\"auto\"}}";
    assert_int_equal(parse_text(hf, 1, &c), QT_OK);
    assert_int_equal(c.micro_batch, 1);
    assert_int_equal(c.grad_accum, 32);
    assert_int_equal(c.train_batch_size, 32);
    const char *m = resolved(&c, "train_micro_batch_size_per_gpu");
    assert_non_null(m);
    assert_non_null(strstr(m, "\"auto\" -> 1 ("));
    assert_non_null(strstr(m, "per_device_train_batch_size"));
    m = resolved(&c, "gradient_accumulation_steps");
    assert_non_null(m);
    assert_non_null(strstr(m, "-> 32 (train_batch_size 32 / micro-batch 1 / 1 rank(s))"));
    m = resolved(&c, "fp16.enabled");
    assert_non_null(m);
    assert_non_null(strstr(m, "-> false ("));
    assert_non_null(strstr(m, "set true to train in fp16"));
    assert_non_null(resolved(&c, "bf16.enabled"));
    /* a precision section present with enabled "auto" is fp32, which the run line and doctor flag */
    assert_string_equal(c.precision_auto_off, "fp16");
    assert_int_equal(c.fp16, 0);
    assert_non_null(strstr(resolved(&c, "optimizer.params.lr"), "-> 5e-05 (the HF Trainer's learning_rate default)"));
    assert_non_null(strstr(resolved(&c, "optimizer.params.betas"), "-> [0.9, 0.999]"));
    assert_non_null(resolved(&c, "optimizer.params.eps"));
    assert_non_null(resolved(&c, "optimizer.params.weight_decay"));
    assert_non_null(strstr(resolved(&c, "gradient_clipping"), "-> 1 ("));
    assert_non_null(resolved(&c, "scheduler.params.warmup_min_lr"));
    assert_non_null(strstr(resolved(&c, "scheduler.params.warmup_max_lr"), "-> 5e-05 (the optimizer's lr)"));
    assert_non_null(resolved(&c, "scheduler.params.warmup_num_steps"));
    assert_non_null(resolved(&c, "zero_optimization.overlap_comm"));
    assert_null(resolved(&c, "train_batch_size"));          /* a number: nothing to say */
    assert_null(resolved(&c, "scheduler.params.total_num_steps")); /* known only at finalize */
    int n = c.n_resolved;
    assert_int_equal(qt_ds_config_finalize(&c, 77), QT_OK);
    assert_int_equal(c.n_resolved, n + 1);
    assert_non_null(strstr(resolved(&c, "scheduler.params.total_num_steps"), "-> 77 (train.max_steps)"));
    /* 4 ranks: 32 = 1 x 8 x 4 */
    assert_int_equal(parse_text(hf, 4, &c), QT_OK);
    assert_int_equal(c.micro_batch, 1);
    assert_int_equal(c.grad_accum, 8);
    /* numbers fix the micro-batch: said with the arithmetic */
    assert_int_equal(parse_text("{\"train_batch_size\":32,\"train_micro_batch_size_per_gpu\":\"auto\","
                                "\"gradient_accumulation_steps\":4}",
                                2, &c),
                     QT_OK);
    assert_int_equal(c.micro_batch, 4);
    assert_non_null(strstr(resolved(&c, "train_micro_batch_size_per_gpu"),
                           "-> 4 (train_batch_size 32 / gradient_accumulation_steps 4 / 2 rank(s))"));
    /* train_batch_size "auto" is the product, said */
    assert_int_equal(parse_text("{\"train_batch_size\":\"auto\",\"train_micro_batch_size_per_gpu\":2}", 3, &c),
                     QT_OK);
    assert_int_equal(c.train_batch_size, 6);
    assert_non_null(strstr(resolved(&c, "train_batch_size"), "-> 6 (micro-batch 2 x accumulation 1 x 3 rank(s))"));
    /* no "auto": nothing resolved */
    assert_int_equal(parse_text("{\"train_batch_size\":32}", 1, &c), QT_OK);
    assert_int_equal(c.n_resolved, 0);
    assert_int_equal(c.micro_batch, 32); /* DeepSpeed's own rule for a lone train_batch_size */
}

/* reduce_bucket_size "auto" is the model's hidden_size squared, as the HF
 * Trainer fills it (transformers' trainer_config_finalize): known only once
 * config.json is read, so qt_ds_config_resolve_model sets and says it; 5e8
 * until then, and when config.json could not be read. allgather_bucket_size
 * "auto" (which HF does not fill) stays 5e8 at parse. */
static void test_reduce_bucket_auto_from_hidden_size(void **state) {
    (void)state;
    qt_ds_config c;
    const char *both = "{\"train_batch_size\":1,\"zero_optimization\":{\"stage\":2,\"reduce_bucket_size\":\"auto\","
                       "\"allgather_bucket_size\":\"auto\"}}";
    assert_int_equal(parse_text(both, 1, &c), QT_OK);
    assert_true(c.zero.reduce_bucket_auto && c.zero.reduce_bucket_size == 5e8);
    assert_null(resolved(&c, "zero_optimization.reduce_bucket_size")); /* known only with the model */
    assert_non_null(strstr(resolved(&c, "zero_optimization.allgather_bucket_size"),
                           "\"auto\" -> 5e8 elements (DeepSpeed's default; the HF Trainer does not fill this key)"));
    int n = c.n_resolved;
    qt_ds_config_resolve_model(&c, 5120);
    assert_int_equal(c.n_resolved, n + 1);
    assert_true(c.zero.reduce_bucket_size == 26214400.0 && !c.zero.reduce_bucket_auto);
    assert_true(c.zero.allgather_bucket_size == 5e8);
    assert_string_equal(resolved(&c, "zero_optimization.reduce_bucket_size"),
                        "zero_optimization.reduce_bucket_size \"auto\" -> 26214400 (hidden_size 5120 squared, as "
                        "Hugging Face's Trainer fills it)");
    qt_ds_config_resolve_model(&c, 64); /* once resolved, a second call changes and says nothing */
    assert_int_equal(c.n_resolved, n + 1);
    assert_true(c.zero.reduce_bucket_size == 26214400.0);
    /* config.json unreadable: DeepSpeed's 5e8, said with why */
    assert_int_equal(parse_text(both, 1, &c), QT_OK);
    qt_ds_config_resolve_model(&c, 0);
    assert_true(c.zero.reduce_bucket_size == 5e8 && !c.zero.reduce_bucket_auto);
    const char *m = resolved(&c, "zero_optimization.reduce_bucket_size");
    assert_non_null(m);
    assert_non_null(strstr(m, "\"auto\" -> 5e8 elements (DeepSpeed's default: the model's config.json could not "
                              "be read"));
    /* a number is kept whatever the model; no DeepSpeed section has nothing to resolve */
    assert_int_equal(
        parse_text("{\"train_batch_size\":1,\"zero_optimization\":{\"stage\":2,\"reduce_bucket_size\":2e8}}", 1, &c),
        QT_OK);
    n = c.n_resolved;
    qt_ds_config_resolve_model(&c, 5120);
    assert_true(c.zero.reduce_bucket_size == 2e8 && c.n_resolved == n);
    qt_ds_config_default(&c, 2);
    qt_ds_config_resolve_model(&c, 5120);
    assert_true(c.zero.reduce_bucket_size == 5e8 && c.n_resolved == 0);
}

static void test_batch_errors(void **state) {
    (void)state;
    qt_ds_config c;
    /* all three given and disagreeing: names the three and the world size */
    assert_int_equal(parse_text("{\"train_batch_size\":32,\"train_micro_batch_size_per_gpu\":2,"
                                "\"gradient_accumulation_steps\":4}",
                                2, &c),
                     QT_EINVAL);
    const char *m = qt_error_message();
    assert_non_null(strstr(m, "ds.json"));
    assert_non_null(strstr(m, "train_batch_size 32"));
    assert_non_null(strstr(m, "train_micro_batch_size_per_gpu 2"));
    assert_non_null(strstr(m, "gradient_accumulation_steps 4"));
    assert_non_null(strstr(m, "world size 2"));
    /* not divisible: 30 / 4 ranks / micro 2 = 3 (floored), 2*3*4 = 24 != 30 */
    assert_int_equal(parse_text("{\"train_batch_size\":30,\"train_micro_batch_size_per_gpu\":2}", 4, &c), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "train_batch_size 30"));
    /* micro-batch larger than the batch per rank: accumulation would be 0 */
    assert_int_equal(parse_text("{\"train_batch_size\":4,\"train_micro_batch_size_per_gpu\":8}", 1, &c), QT_EINVAL);
    /* neither batch size */
    assert_int_equal(parse_text("{\"gradient_accumulation_steps\":4}", 1, &c), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "train_micro_batch_size_per_gpu"));
    /* wrong types and values */
    assert_int_equal(parse_text("{\"train_batch_size\":2.5}", 1, &c), QT_EINVAL);
    assert_int_equal(parse_text("{\"train_batch_size\":0}", 1, &c), QT_EINVAL);
    assert_int_equal(parse_text("{\"train_batch_size\":\"32\"}", 1, &c), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "\"train_batch_size\" must be a number"));
    assert_int_equal(parse_text("[1,2]", 1, &c), QT_EINVAL);
    assert_int_equal(parse_text("{\"train_batch_size\":8}", 0, &c), QT_EINVAL);
}

static void test_defaults_and_sections(void **state) {
    (void)state;
    qt_ds_config c;
    assert_int_equal(parse_text("{\"train_micro_batch_size_per_gpu\":1}", 1, &c), QT_OK);
    assert_true(c.gradient_clipping == 0.0);
    assert_int_equal(c.steps_per_print, 10);
    assert_false(c.fp16);
    assert_false(c.bf16);
    assert_int_equal(c.zero.stage, 0);
    assert_string_equal(c.optimizer_type, "AdamW");
    assert_true(c.adam.lr == 5e-5 && c.adam.decoupled && c.adam.weight_decay == 0.0);
    assert_int_equal(c.sched.type, QT_SCHED_CONSTANT);
    assert_int_equal(c.n_ignored, 0);

    const char *full =
        "{\"train_batch_size\":32,\"gradient_accumulation_steps\":4,\"gradient_clipping\":1.0,"
        "\"steps_per_print\":5,\"wall_clock_breakdown\":true,"
        "\"optimizer\":{\"type\":\"AdamW\",\"params\":{\"lr\":6e-5,\"betas\":[0.9,0.95],\"eps\":1e-6,"
        "\"weight_decay\":0.1}},"
        "\"scheduler\":{\"type\":\"WarmupDecayLR\",\"params\":{\"warmup_min_lr\":0,\"warmup_max_lr\":6e-5,"
        "\"warmup_num_steps\":10,\"total_num_steps\":100,\"warmup_type\":\"linear\"}},"
        "\"fp16\":{\"enabled\":true,\"loss_scale\":0,\"initial_scale_power\":12,\"loss_scale_window\":500,"
        "\"hysteresis\":3,\"consecutive_hysteresis\":true,\"min_loss_scale\":2},"
        "\"zero_optimization\":{\"stage\":2,\"offload_optimizer\":{\"device\":\"cpu\",\"pin_memory\":true},"
        "\"reduce_bucket_size\":2e8,\"allgather_bucket_size\":3e8,\"overlap_comm\":true,"
        "\"contiguous_gradients\":false,\"reduce_scatter\":true,\"allgather_partitions\":true}}";
    assert_int_equal(parse_text(full, 4, &c), QT_OK);
    assert_int_equal(c.n_ignored, 0);
    assert_int_equal(c.micro_batch, 2);
    assert_true(c.gradient_clipping == 1.0);
    assert_int_equal(c.steps_per_print, 5);
    assert_true(c.wall_clock_breakdown);
    assert_true(c.adam.lr == 6e-5 && c.adam.beta1 == 0.9 && c.adam.beta2 == 0.95 && c.adam.eps == 1e-6 &&
                c.adam.weight_decay == 0.1 && c.adam.decoupled);
    assert_int_equal(c.sched.type, QT_SCHED_WARMUP_DECAY_LR);
    assert_int_equal(c.sched.warmup_type, QT_WARMUP_LINEAR);
    assert_int_equal(c.sched.total_num_steps, 100);
    assert_true(c.sched.warmup_max_lr == 6e-5);
    assert_true(c.fp16);
    assert_true(c.scaler.loss_scale == 0 && c.scaler.initial_scale_power == 12 && c.scaler.loss_scale_window == 500 &&
                c.scaler.hysteresis == 3 && c.scaler.consecutive_hysteresis && c.scaler.min_loss_scale == 2);
    assert_int_equal(c.zero.stage, 2);
    assert_true(c.zero.offload_optimizer && c.zero.pin_memory && c.zero.overlap_comm);
    assert_false(c.zero.contiguous_gradients);
    assert_true(c.zero.reduce_bucket_size == 2e8 && c.zero.allgather_bucket_size == 3e8);
    assert_int_equal(qt_ds_config_finalize(&c, 1000), QT_OK);
    assert_int_equal(c.sched.total_num_steps, 100); /* a number is kept */
}

static void test_optimizer_modes(void **state) {
    (void)state;
    qt_ds_config c;
    /* DeepSpeed "Adam": adam_w_mode defaults to true -> decoupled; FusedAdam defaults */
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"optimizer\":{\"type\":\"Adam\",\"params\":{}}}", 1, &c),
                     QT_OK);
    assert_string_equal(c.optimizer_type, "Adam");
    assert_true(c.adam.decoupled);
    assert_true(c.adam.lr == 1e-3 && c.adam.beta1 == 0.9 && c.adam.beta2 == 0.999 && c.adam.eps == 1e-8);
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"optimizer\":{\"type\":\"Adam\",\"params\":"
                                "{\"adam_w_mode\":false,\"weight_decay\":0.01}}}",
                                1, &c),
                     QT_OK);
    assert_false(c.adam.decoupled); /* L2 Adam */
    /* "AdamW" is decoupled whatever adam_w_mode says */
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"optimizer\":{\"type\":\"adamw\",\"params\":"
                                "{\"adam_w_mode\":false}}}",
                                1, &c),
                     QT_OK);
    assert_true(c.adam.decoupled);
    /* "auto" -> the HF Trainer's defaults */
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"gradient_clipping\":\"auto\",\"optimizer\":{\"type\":"
                                "\"AdamW\",\"params\":{\"lr\":\"auto\",\"betas\":\"auto\",\"eps\":\"auto\","
                                "\"weight_decay\":\"auto\"}}}",
                                1, &c),
                     QT_OK);
    assert_true(c.adam.lr == 5e-5 && c.adam.beta2 == 0.999 && c.adam.eps == 1e-8 && c.adam.weight_decay == 0.0);
    assert_true(c.gradient_clipping == 1.0);
    /* max_grad_norm inside the optimizer: DeepSpeed raises; so does qtune, pointing at gradient_clipping */
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"optimizer\":{\"type\":\"AdamW\",\"params\":"
                                "{\"max_grad_norm\":1.0}}}",
                                1, &c),
                     QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "gradient_clipping"));
    /* unknown type, amsgrad, bad betas */
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"optimizer\":{\"type\":\"Lamb\"}}", 1, &c), QT_EUNSUPPORTED);
    assert_non_null(strstr(qt_error_message(), "\"Lamb\""));
    assert_int_equal(
        parse_text("{\"train_batch_size\":1,\"optimizer\":{\"type\":\"Adam\",\"params\":{\"amsgrad\":true}}}", 1, &c),
        QT_EUNSUPPORTED);
    assert_int_equal(
        parse_text("{\"train_batch_size\":1,\"optimizer\":{\"type\":\"Adam\",\"params\":{\"betas\":[0.9]}}}", 1, &c),
        QT_EINVAL);
    assert_int_equal(
        parse_text("{\"train_batch_size\":1,\"optimizer\":{\"type\":\"Adam\",\"params\":{\"betas\":[0.9,1.5]}}}", 1,
                   &c),
        QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "betas"));
}

static void test_schedulers(void **state) {
    (void)state;
    qt_ds_config c;
    /* WarmupLR: warmup_max_lr defaults to the optimizer's lr */
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"optimizer\":{\"type\":\"AdamW\",\"params\":{\"lr\":0.02}},"
                                "\"scheduler\":{\"type\":\"WarmupLR\",\"params\":{\"warmup_num_steps\":5}}}",
                                1, &c),
                     QT_OK);
    assert_true(c.sched.warmup_max_lr == 0.02 && c.sched.warmup_min_lr == 0.0);
    assert_int_equal(c.sched.warmup_num_steps, 5);
    assert_int_equal(c.sched.warmup_type, QT_WARMUP_LOG);
    assert_true(qt_sched_lr(&c.sched, 100) == 0.02);
    /* WarmupCosineLR with total_num_steps "auto": resolved from max_steps */
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"scheduler\":{\"type\":\"WarmupCosineLR\",\"params\":"
                                "{\"total_num_steps\":\"auto\",\"warmup_num_steps\":\"auto\"}}}",
                                1, &c),
                     QT_OK);
    assert_true(c.total_num_steps_auto);
    assert_true(c.sched.cos_min_ratio == 0.0001 && c.sched.warmup_min_ratio == 0.0);
    assert_int_equal(qt_ds_config_finalize(&c, -1), QT_EINVAL);
    assert_int_equal(qt_ds_config_finalize(&c, 50), QT_OK);
    assert_int_equal(c.sched.total_num_steps, 50);
    assert_true(c.sched.base_lr == 5e-5);
    /* decaying schedules need total_num_steps */
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"scheduler\":{\"type\":\"WarmupDecayLR\",\"params\":{}}}",
                                1, &c),
                     QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "total_num_steps"));
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"scheduler\":{\"type\":\"OneCycle\"}}", 1, &c),
                     QT_EUNSUPPORTED);
    assert_non_null(strstr(qt_error_message(), "OneCycle"));
    /* a key of another schedule is named, not dropped */
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"scheduler\":{\"type\":\"WarmupLR\",\"params\":"
                                "{\"cos_min_ratio\":0.1}}}",
                                1, &c),
                     QT_OK);
    assert_true(has_ignored(&c, "scheduler.params.cos_min_ratio"));
}

static void test_precision_and_zero(void **state) {
    (void)state;
    qt_ds_config c;
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"fp16\":{\"enabled\":true},\"bf16\":{\"enabled\":true}}", 1,
                                &c),
                     QT_EINVAL);
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"bf16\":{\"enabled\":\"auto\"},\"fp16\":{\"enabled\":"
                                "\"auto\"}}",
                                1, &c),
                     QT_OK);
    assert_false(c.fp16 || c.bf16);
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"bfloat16\":{\"enabled\":true}}", 1, &c), QT_OK);
    assert_true(c.bf16);
    /* both names: DeepSpeed reads "bf16" and ignores the old one, which is named, whatever the key order */
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"bf16\":{\"enabled\":false},\"bfloat16\":{\"enabled\":true}}",
                                1, &c),
                     QT_OK);
    assert_false(c.bf16);
    assert_true(has_ignored(&c, "bfloat16"));
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"bfloat16\":{\"enabled\":false},\"bf16\":{\"enabled\":true}}",
                                1, &c),
                     QT_OK);
    assert_true(c.bf16);
    assert_true(has_ignored(&c, "bfloat16"));
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"fp16\":{\"enabled\":true,\"loss_scale\":128}}", 1, &c),
                     QT_OK);
    assert_true(c.scaler.loss_scale == 128 && c.scaler.initial_scale_power == 16 && c.scaler.hysteresis == 2);
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"fp16\":{\"enabled\":true,\"min_loss_scale\":0}}", 1, &c),
                     QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "min_loss_scale"));
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"fp16\":{\"enabled\":false,\"min_loss_scale\":0}}", 1, &c),
                     QT_OK);
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"fp16\":{\"enabled\":true,\"hysteresis\":0}}", 1, &c),
                     QT_EINVAL);
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"zero_optimization\":{\"stage\":4}}", 1, &c),
                     QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "stage"));
    /* stage 3 with DeepSpeed's defaults for its keys, and "auto" filled from hidden_size as the HF Trainer does */
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"zero_optimization\":{\"stage\":3}}", 1, &c), QT_OK);
    assert_true(c.zero.stage == 3 && !c.zero.offload_param && c.zero.prefetch_bucket_size == 5e7 &&
                c.zero.param_persistence_threshold == 1e5 && c.zero.max_live_parameters == 1e9 &&
                c.zero.max_reuse_distance == 1e9);
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"zero_optimization\":{\"stage\":3,\"offload_param\":"
                                "{\"device\":\"cpu\"},\"stage3_prefetch_bucket_size\":\"auto\","
                                "\"stage3_param_persistence_threshold\":\"auto\"}}",
                                1, &c),
                     QT_OK);
    assert_true(c.zero.offload_param == 1);
    qt_ds_config_resolve_model(&c, 64);
    assert_true(c.zero.prefetch_bucket_size == 0.9 * 64 * 64 && c.zero.param_persistence_threshold == 640);
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"zero_optimization\":{\"stage\":3,\"offload_param\":"
                                "{\"device\":\"nvme\"}}}",
                                1, &c),
                     QT_EUNSUPPORTED);
    assert_non_null(strstr(qt_error_message(), "offload_param.device"));
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"zero_optimization\":{\"stage\":3,"
                                "\"stage3_max_live_parameters\":-1}}",
                                1, &c),
                     QT_EINVAL);
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"zero_optimization\":{\"stage\":2,\"offload_optimizer\":"
                                "{\"device\":\"nvme\"}}}",
                                1, &c),
                     QT_EUNSUPPORTED);
    assert_non_null(strstr(qt_error_message(), "nvme"));
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"zero_optimization\":{\"stage\":1,\"reduce_bucket_size\":"
                                "\"auto\"}}",
                                1, &c),
                     QT_OK);
    assert_true(c.zero.reduce_bucket_size == 5e8 && c.zero.contiguous_gradients && !c.zero.offload_optimizer);
    assert_int_equal(parse_text("{\"train_batch_size\":1,\"zero_optimization\":{\"stage\":\"2\"}}", 1, &c), QT_EINVAL);
}

static void test_unknown_keys_warn(void **state) {
    (void)state;
    qt_ds_config c;
    const char *text =
        "{\"train_batch_size\":1,\"prescale_gradients\":false,\"tensorboard\":{\"enabled\":true},"
        "\"fp16\":{\"enabled\":true,\"auto_cast\":false},"
        "\"optimizer\":{\"type\":\"AdamW\",\"params\":{\"lr\":1e-4,\"foo\":1}},"
        "\"zero_optimization\":{\"stage\":2,\"round_robin_gradients\":true,\"offload_param\":{\"device\":\"cpu\"},"
        "\"offload_optimizer\":{\"device\":\"cpu\",\"buffer_count\":4}}}";
    assert_int_equal(parse_text(text, 1, &c), QT_OK);
    assert_true(has_ignored(&c, "prescale_gradients"));
    assert_true(has_ignored(&c, "tensorboard"));
    assert_true(has_ignored(&c, "fp16.auto_cast"));
    assert_true(has_ignored(&c, "optimizer.params.foo"));
    assert_true(has_ignored(&c, "zero_optimization.round_robin_gradients"));
    assert_true(has_ignored(&c, "zero_optimization.offload_param"));
    assert_true(has_ignored(&c, "zero_optimization.offload_optimizer.buffer_count"));
    assert_int_equal(c.n_ignored, 7);
    assert_true(c.adam.lr == 1e-4); /* the rest is still read */
}

static void test_load_file(void **state) {
    (void)state;
    char dir[] = "/tmp/qtune_ds_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path[256];
    assert_int_equal(qt_path_join(path, sizeof path, dir, "ds_config.json"), QT_OK);
    const char *good = "{\n  \"train_micro_batch_size_per_gpu\": 2,\n  \"gradient_accumulation_steps\": 4\n}\n";
    assert_int_equal(qt_write_file_atomic(path, good, strlen(good)), QT_OK);
    qt_ds_config c;
    assert_int_equal(qt_ds_config_load(path, 4, &c), QT_OK);
    assert_int_equal(c.train_batch_size, 32);
    const char *bad = "{\n  \"train_batch_size\": 2,\n  \"fp16\": {enabled: true}\n}\n";
    assert_int_equal(qt_write_file_atomic(path, bad, strlen(bad)), QT_OK);
    assert_int_equal(qt_ds_config_load(path, 1, &c), QT_EFORMAT);
    assert_non_null(strstr(qt_error_message(), "ds_config.json: line 3"));
    assert_int_equal(qt_rm_rf(dir), QT_OK);
    assert_int_equal(qt_ds_config_load("/nonexistent/ds.json", 1, &c), QT_EIO);
}

/* issue 24: values that used to train wrongly in silence are refused naming the key */
static void test_silent_values_refused(void **state) {
    (void)state;
    static const struct {
        const char *json, *must;
    } cases[] = {
        {"{\"optimizer\":{\"type\":\"AdamW\",\"params\":{\"eps\":0}}}", "optimizer.params: eps 0"},
        {"{\"optimizer\":{\"type\":\"AdamW\",\"params\":{\"eps\":-1e-8}}}", "eps -1e-08"},
        {"{\"scheduler\":{\"type\":\"WarmupLR\",\"params\":{\"warmup_max_lr\":-1}}}",
         "scheduler.params.warmup_max_lr -1"},
        {"{\"scheduler\":{\"type\":\"WarmupLR\",\"params\":{\"warmup_min_lr\":-0.5}}}",
         "scheduler.params.warmup_min_lr -0.5"},
        {"{\"scheduler\":{\"type\":\"WarmupDecayLR\",\"params\":{\"warmup_max_lr\":-1,\"total_num_steps\":9}}}",
         "warmup_max_lr -1"},
        {"{\"scheduler\":{\"type\":\"WarmupCosineLR\",\"params\":{\"cos_min_ratio\":-1,\"total_num_steps\":9}}}",
         "cos_min_ratio -1"},
        {"{\"scheduler\":{\"type\":\"WarmupCosineLR\",\"params\":{\"warmup_min_ratio\":2,\"total_num_steps\":9}}}",
         "warmup_min_ratio 2"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char text[512];
        snprintf(text, sizeof text, "{\"train_micro_batch_size_per_gpu\":1,%s", cases[i].json + 1);
        qt_ds_config c;
        assert_int_equal(parse_text(text, 1, &c), QT_EINVAL);
        if (!strstr(qt_error_message(), cases[i].must)) fail_msg("%s: %s", cases[i].json, qt_error_message());
    }
    /* "auto" total_num_steps is checked when max_steps is known */
    qt_ds_config c;
    assert_int_equal(parse_text("{\"train_micro_batch_size_per_gpu\":1,\"scheduler\":{\"type\":\"WarmupDecayLR\",\"params\":{\"warmup_max_lr\":-1,"
                                "\"total_num_steps\":\"auto\"}}}",
                                1, &c),
                     QT_OK);
    assert_int_equal(qt_ds_config_finalize(&c, 10), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "warmup_max_lr -1"));
    /* a key twice in a DeepSpeed file: cJSON would keep the first, Python's json the last */
    char dir[] = "/tmp/qtune_ds_XXXXXX", path[256];
    assert_non_null(mkdtemp(dir));
    assert_int_equal(qt_path_join(path, sizeof path, dir, "ds.json"), QT_OK);
    const char *dup = "{\"train_micro_batch_size_per_gpu\": 1, \"zero_optimization\": {\"stage\": 1, \"stage\": 2}}";
    assert_int_equal(qt_write_file_atomic(path, dup, strlen(dup)), QT_OK);
    assert_int_equal(qt_ds_config_load(path, 1, &c), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "\"zero_optimization.stage\" appears more than once"));
    assert_non_null(strstr(qt_error_message(), "ds.json"));
    assert_int_equal(qt_rm_rf(dir), QT_OK);
}

/* Random configs built from the real key names with values of every JSON
 * type: parsing never crashes (ASan/UBSan in CI), fails only with an input
 * error, and whatever it accepts satisfies the batch identity. */
static cJSON *random_value(unsigned *seed, int depth) {
    switch (rand_r(seed) % 9) {
    case 0: return cJSON_CreateNumber((double)(rand_r(seed) % 70) - 3);
    case 1: return cJSON_CreateNumber((double)rand_r(seed) / RAND_MAX * 4.0);
    case 2: return cJSON_CreateNumber(1e300);
    case 3: return cJSON_CreateString("auto");
    case 4: return cJSON_CreateString(rand_r(seed) % 2 ? "cpu" : "linear");
    case 5: return cJSON_CreateBool(rand_r(seed) % 2);
    case 6: return cJSON_CreateNull();
    case 7: {
        cJSON *a = cJSON_CreateArray();
        int n = rand_r(seed) % 4;
        for (int i = 0; i < n; i++) cJSON_AddItemToArray(a, cJSON_CreateNumber((double)rand_r(seed) / RAND_MAX));
        return a;
    }
    default: return depth > 0 ? cJSON_CreateObject() : cJSON_CreateNumber(2);
    }
}

static void test_random_configs(void **state) {
    (void)state;
    static const char *const top[] = {"train_batch_size", "train_micro_batch_size_per_gpu",
                                      "gradient_accumulation_steps", "gradient_clipping", "steps_per_print",
                                      "wall_clock_breakdown", "optimizer", "scheduler", "fp16", "bf16",
                                      "zero_optimization", "unknown_key"};
    static const char *const inner[] = {"type", "params", "enabled", "loss_scale", "initial_scale_power",
                                        "loss_scale_window", "hysteresis", "min_loss_scale", "stage",
                                        "offload_optimizer", "device", "lr", "betas", "eps", "weight_decay",
                                        "adam_w_mode", "warmup_num_steps", "total_num_steps", "warmup_type",
                                        "cos_min_ratio", "reduce_bucket_size", "pin_memory"};
    static const char *const types[] = {"Adam", "AdamW", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "Lamb"};
    unsigned seed = 12345;
    int ok = 0;
    for (int iter = 0; iter < 3000; iter++) {
        cJSON *root = cJSON_CreateObject();
        for (size_t k = 0; k < sizeof top / sizeof top[0]; k++) {
            if (rand_r(&seed) % 3 != 0) continue; /* mostly absent: more configs get through */
            cJSON *v = random_value(&seed, 1);
            if (cJSON_IsObject(v) || k >= 6) {
                if (!cJSON_IsObject(v)) {
                    cJSON_Delete(v);
                    v = cJSON_CreateObject();
                }
                for (size_t i = 0; i < sizeof inner / sizeof inner[0]; i++) {
                    if (rand_r(&seed) % 4) continue;
                    cJSON *iv;
                    if (strcmp(inner[i], "type") == 0) iv = cJSON_CreateString(types[rand_r(&seed) % 6]);
                    else if (strcmp(inner[i], "params") == 0 || strcmp(inner[i], "offload_optimizer") == 0) {
                        iv = cJSON_CreateObject();
                        for (size_t j = 0; j < sizeof inner / sizeof inner[0]; j++)
                            if (rand_r(&seed) % 5 == 0) cJSON_AddItemToObject(iv, inner[j], random_value(&seed, 0));
                    } else iv = random_value(&seed, 0);
                    cJSON_AddItemToObject(v, inner[i], iv);
                }
            }
            cJSON_AddItemToObject(root, top[k], v);
        }
        if (rand_r(&seed) % 2 && !cJSON_HasObjectItem(root, "train_micro_batch_size_per_gpu"))
            cJSON_AddNumberToObject(root, "train_micro_batch_size_per_gpu", 2);
        qt_ds_config c;
        int world = 1 + rand_r(&seed) % 4;
        int rc = qt_ds_config_parse(root, "fuzz.json", world, &c);
        if (rc != QT_OK && rc != QT_EINVAL && rc != QT_EUNSUPPORTED) {
            char *txt = cJSON_PrintUnformatted(root);
            fail_msg("rc %d for %s: %s", rc, txt, qt_error_message());
        }
        if (rc == QT_OK) {
            ok++;
            assert_true(c.micro_batch >= 1 && c.grad_accum >= 1);
            assert_true(c.train_batch_size == c.micro_batch * c.grad_accum * world);
            qt_ds_config_finalize(&c, rand_r(&seed) % 50);
        }
        cJSON_Delete(root);
    }
    print_message("%d of 3000 random configs accepted\n", ok);
    assert_true(ok > 10); /* some configs must get through, or the accepted path was never exercised */
}

/* Flags take 1 and 0 as DeepSpeed's pydantic bools do; qt_ds_config_check
 * reads the values without the batch arithmetic that needs a world size. */
static void test_flags_and_check(void **state) {
    (void)state;
    qt_ds_config c;
    assert_int_equal(parse_text("{\"train_micro_batch_size_per_gpu\": 1, \"fp16\": {\"enabled\": 1}}", 1, &c), QT_OK);
    assert_true(c.fp16);
    assert_int_equal(parse_text("{\"train_micro_batch_size_per_gpu\": 1, \"fp16\": {\"enabled\": 0}}", 1, &c), QT_OK);
    assert_false(c.fp16);
    assert_int_equal(parse_text("{\"train_micro_batch_size_per_gpu\": 1, \"fp16\": {\"enabled\": 2}}", 1, &c), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "\"fp16.enabled\" must be true or false"));
    /* 8 = 2 x 2 x 2 ranks: wrong for 1 rank, which check does not know */
    cJSON *j = cJSON_Parse("{\"train_batch_size\": 8, \"train_micro_batch_size_per_gpu\": 2, "
                           "\"gradient_accumulation_steps\": 2}");
    assert_int_equal(qt_ds_config_check(j, "x"), QT_OK);
    cJSON_Delete(j);
    j = cJSON_Parse("{\"train_micro_batch_size_per_gpu\": 2, \"gradient_clipping\": -1}");
    assert_int_equal(qt_ds_config_check(j, "--set deepspeed.gradient_clipping=-1"), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "--set deepspeed.gradient_clipping=-1: gradient_clipping -1"));
    cJSON_Delete(j);
}

/* --strict: a key the run would warn about and ignore is an error, with the warning's sentence and its
 * nearest known key; a config without one passes */
static void test_strict_check(void **state) {
    (void)state;
    cJSON *j = cJSON_Parse("{\"train_micro_batch_size_per_gpu\": 2, \"zero_optimization\": {\"stage\": 2, "
                           "\"overlap_com\": true}}");
    assert_int_equal(qt_ds_config_check(j, "ds.json"), QT_OK); /* a warning only */
    assert_int_equal(qt_ds_config_check_strict(j, "ds.json"), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "ds.json: DeepSpeed key \"zero_optimization.overlap_com\" has no "
                                               "effect in qtune and is ignored; did you mean "
                                               "\"zero_optimization.overlap_comm\"?"));
    assert_non_null(strstr(qt_error_message(), "--strict"));
    cJSON_Delete(j);
    j = cJSON_Parse("{\"train_micro_batch_size_per_gpu\": 2, \"zero_optimization\": {\"stage\": 2}}");
    assert_int_equal(qt_ds_config_check_strict(j, "ds.json"), QT_OK);
    cJSON_Delete(j);
}

/* qt_ds_config_problems (the doctor's parse): each section's first problem in the parser's own sentence, the
 * parse going on to the next section; what did parse is kept, and a good config is what qt_ds_config_parse
 * gives */
typedef struct {
    int n;
    char said[4][512];
} problems;

static void collect(void *ctx, const char *sentence) {
    problems *p = ctx;
    if (p->n < 4) snprintf(p->said[p->n], sizeof p->said[0], "%s", sentence);
    p->n++;
}

static void test_problems_all_at_once(void **state) {
    (void)state;
    cJSON *j = cJSON_Parse("{\"train_batch_size\": 6, \"train_micro_batch_size_per_gpu\": 2, "
                           "\"gradient_accumulation_steps\": 2, \"fp16\": {\"enabled\": true}, "
                           "\"bf16\": {\"enabled\": true}, \"optimizer\": {\"type\": \"AdamW\", "
                           "\"params\": {\"lr\": 0.01}}, \"zero_optimization\": {\"stage\": 2, "
                           "\"offload_optimizer\": {\"device\": \"nvme\"}}}");
    problems p = {0};
    qt_ds_config c, one;
    assert_int_equal(qt_ds_config_problems(j, "job.json: deepspeed", 1, &c, collect, &p), 3);
    assert_int_equal(p.n, 3);
    /* each is the sentence the run's parse stops with, in the file's order */
    assert_int_equal(qt_ds_config_parse(j, "job.json: deepspeed", 1, &one), QT_EINVAL);
    assert_string_equal(p.said[0], qt_error_message());
    assert_non_null(strstr(p.said[0], "train_batch_size 6 is not"));
    assert_non_null(strstr(p.said[1], "fp16.enabled and bf16.enabled are both true"));
    assert_non_null(strstr(p.said[2], "offload_optimizer.device \"nvme\" is not supported"));
    assert_int_equal(qt_error_code(), QT_EINVAL); /* the parse above; the collecting one cleared its own */
    qt_error_clear();
    assert_true(c.adam.lr == 0.01 && c.bf16 && c.zero.stage == 2); /* the sections that parsed */
    cJSON_Delete(j);
    /* a good config: no problem, the same values as the run's parse */
    j = cJSON_Parse("{\"train_batch_size\": 8, \"train_micro_batch_size_per_gpu\": 2, \"bf16\": {\"enabled\": true}, "
                    "\"zero_optimization\": {\"stage\": 1}}");
    p.n = 0;
    assert_int_equal(qt_ds_config_problems(j, "ds.json", 2, &c, collect, &p), 0);
    assert_int_equal(p.n, 0);
    assert_int_equal(qt_ds_config_parse(j, "ds.json", 2, &one), QT_OK);
    assert_int_equal(c.micro_batch, one.micro_batch);
    assert_int_equal(c.grad_accum, one.grad_accum);
    assert_int_equal(c.bf16, one.bf16);
    assert_int_equal(c.zero.stage, one.zero.stage);
    cJSON_Delete(j);
}

int main(void) {
    qt_log_set_level(QT_LOG_ERROR); /* the warnings are checked through `ignored` */
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_batch_identity),   cmocka_unit_test(test_batch_errors),
        cmocka_unit_test(test_auto_is_said),
        cmocka_unit_test(test_reduce_bucket_auto_from_hidden_size),
        cmocka_unit_test(test_defaults_and_sections), cmocka_unit_test(test_optimizer_modes),
        cmocka_unit_test(test_schedulers),       cmocka_unit_test(test_precision_and_zero),
        cmocka_unit_test(test_unknown_keys_warn), cmocka_unit_test(test_load_file), cmocka_unit_test(test_random_configs),
        cmocka_unit_test(test_silent_values_refused), cmocka_unit_test(test_flags_and_check),
        cmocka_unit_test(test_strict_check),     cmocka_unit_test(test_problems_all_at_once),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
