/* train: the job file (defaults, paths, --set typing, errors by field), the
 * checkpoint folder mechanics, PEFT key names, loss.svg, and the public API
 * (train two steps, eval, merge) on a tiny model. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"
#include "io/checkpoint.h"
#include "io/hf_config.h"
#include "io/model_folder.h"
#include "io/peft.h"
#include "model/lora_io.h"
#include "model/model.h"
#include "model/sample.h"
#include "qtune.h"
#include "train/job.h"
#include "train/metrics.h"

static char *tmpdir(void) {
    char *d = strdup("/tmp/qtune_train_XXXXXX");
    assert_non_null(mkdtemp(d));
    return d;
}

static void write_text(const char *dir, const char *name, const char *text) {
    char p[4096];
    assert_int_equal(qt_path_join(p, sizeof p, dir, name), QT_OK);
    assert_int_equal(qt_write_file_atomic(p, text, strlen(text)), QT_OK);
}

static void test_job_defaults_and_paths(void **state) {
    (void)state;
    qt_job j;
    const char *json = "{\"model\": \"m\", \"output_dir\": \"/abs/out\", \"data\": {\"train\": \"t.jsonl\"},"
                       " \"lora\": {\"r\": 16, \"target_modules\": [\"q_proj\", \"down_proj\"]}}";
    assert_int_equal(qt_job_parse(json, "/jobs", "/jobs/j.json", NULL, 0, &j), QT_OK);
    assert_string_equal(j.model, "/jobs/m");
    assert_string_equal(j.output_dir, "/abs/out");
    assert_string_equal(j.data.train, "/jobs/t.jsonl");
    assert_null(j.data.eval);
    assert_int_equal(j.data.seq_len, 512);
    assert_true(j.data.packing && j.data.shuffle && j.data.mask_prompt);
    assert_true(j.lora.enabled);
    assert_int_equal(j.lora.r, 16);
    assert_int_equal(j.lora.targets, QT_LORA_Q | QT_LORA_DOWN);
    assert_int_equal(j.train.max_steps, -1);
    assert_true(j.train.epochs == 1);
    assert_int_equal(j.train.seed, 42);
    assert_string_equal(j.train.resume, "auto");
    assert_null(j.deepspeed);
    uint64_t fp = j.fingerprint;
    qt_job_free(&j);
    /* changing only how often we log/save keeps the fingerprint; the data does not */
    const char *sets1[] = {"train.save_steps=5", "train.max_steps=7"};
    assert_int_equal(qt_job_parse(json, "/jobs", "/jobs/j.json", sets1, 2, &j), QT_OK);
    assert_int_equal(j.train.max_steps, 7);
    assert_true(j.fingerprint == fp);
    qt_job_free(&j);
    /* the same job with its keys in another order */
    const char *json_r = "{\"lora\": {\"target_modules\": [\"q_proj\", \"down_proj\"], \"r\": 16},"
                         " \"data\": {\"train\": \"t.jsonl\"}, \"output_dir\": \"/abs/out\", \"model\": \"m\"}";
    assert_int_equal(qt_job_parse(json_r, "/jobs", "/jobs/j.json", NULL, 0, &j), QT_OK);
    assert_true(j.fingerprint == fp);
    qt_job_free(&j);
    const char *sets2[] = {"data.seq_len=64"};
    assert_int_equal(qt_job_parse(json, "/jobs", "/jobs/j.json", sets2, 1, &j), QT_OK);
    assert_int_equal(j.data.seq_len, 64);
    assert_true(j.fingerprint != fp);
    qt_job_free(&j);
}

static void test_job_sets_are_typed(void **state) {
    (void)state;
    qt_job j;
    const char *json = "{\"model\": \"m\", \"output_dir\": \"o\", \"data\": {\"train\": \"t\"},"
                       " \"lora\": {\"r\": 8, \"target_modules\": [\"q_proj\"]},"
                       " \"deepspeed\": {\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-4}}}}";
    const char *sets[] = {"lora.target_modules=q_proj,v_proj", "deepspeed.optimizer.params.lr=3e-5",
                          "train.gradient_checkpointing=true", "lora.init_from=ad", "data.eval=e.jsonl"};
    assert_int_equal(qt_job_parse(json, ".", "j.json", sets, 5, &j), QT_OK);
    assert_int_equal(j.lora.targets, QT_LORA_Q | QT_LORA_V);
    assert_int_equal(j.lora.n_target_names, 2);
    assert_true(j.train.gradient_checkpointing);
    assert_string_equal(j.lora.init_from, "ad");
    assert_string_equal(j.data.eval, "e.jsonl");
    cJSON *lr = cJSON_GetObjectItem(cJSON_GetObjectItem(cJSON_GetObjectItem(j.deepspeed, "optimizer"), "params"), "lr");
    assert_true(fabs(lr->valuedouble - 3e-5) < 1e-12);
    qt_job_free(&j);
    /* DeepSpeed's "auto" stands for a number: an override gives it one */
    const char *json2 = "{\"model\": \"m\", \"output_dir\": \"o\", \"data\": {\"train\": \"t\"},"
                        " \"deepspeed\": {\"scheduler\": {\"params\": {\"total_num_steps\": \"auto\"}}}}";
    const char *sets2[] = {"deepspeed.scheduler.params.total_num_steps=40", "data.format=text"};
    assert_int_equal(qt_job_parse(json2, ".", "j.json", sets2, 2, &j), QT_OK);
    cJSON *tn = cJSON_GetObjectItem(cJSON_GetObjectItem(cJSON_GetObjectItem(j.deepspeed, "scheduler"), "params"),
                                    "total_num_steps");
    assert_true(cJSON_IsNumber(tn) && tn->valuedouble == 40);
    assert_string_equal(j.data.format, "text");
    qt_job_free(&j);
    /* a number field refuses a word, a bool field refuses a number word */
    const char *bad1[] = {"lora.r=eight"};
    assert_int_equal(qt_job_parse(json, ".", "j.json", bad1, 1, &j), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "lora.r=eight"));
    const char *bad2[] = {"lora.r.x=1"};
    assert_int_equal(qt_job_parse(json, ".", "j.json", bad2, 1, &j), QT_EINVAL);
    const char *bad3[] = {"noequals"};
    assert_int_equal(qt_job_parse(json, ".", "j.json", bad3, 1, &j), QT_EINVAL);
    /* a list of numbers takes numbers ("0.9,0.95" was two strings, which betas refuses); a DeepSpeed
     * number or flag takes "auto" (the config reader says what it becomes) */
    const char *json3 = "{\"model\": \"m\", \"output_dir\": \"o\", \"data\": {\"train\": \"t\"},"
                        " \"train\": {\"max_steps\": 3},"
                        " \"deepspeed\": {\"train_batch_size\": 8, \"fp16\": {\"enabled\": true},"
                        " \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"betas\": [0.9, 0.999]}}}}";
    const char *sets3[] = {"deepspeed.optimizer.params.betas=0.9,0.95", "deepspeed.train_batch_size=auto",
                           "deepspeed.fp16.enabled=auto"};
    assert_int_equal(qt_job_parse(json3, ".", "j.json", sets3, 3, &j), QT_OK);
    cJSON *betas = cJSON_GetObjectItem(cJSON_GetObjectItem(cJSON_GetObjectItem(j.deepspeed, "optimizer"), "params"),
                                       "betas");
    assert_int_equal(cJSON_GetArraySize(betas), 2);
    assert_true(cJSON_IsNumber(cJSON_GetArrayItem(betas, 1)) && cJSON_GetArrayItem(betas, 1)->valuedouble == 0.95);
    assert_string_equal(cJSON_GetObjectItem(j.deepspeed, "train_batch_size")->valuestring, "auto");
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(j.deepspeed, "fp16"), "enabled")->valuestring, "auto");
    qt_job_free(&j);
    /* a number is written as JSON writes one: strtod's hex, inf and nan are not numbers; "auto" only in deepspeed */
    static const char *const not_numbers[] = {"train.max_steps=0x10", "train.max_steps=inf", "train.max_steps=nan",
                                              "train.max_steps=5x", "train.max_steps=auto",
                                              "deepspeed.optimizer.params.betas=0.9,x"};
    for (size_t i = 0; i < sizeof not_numbers / sizeof not_numbers[0]; i++) {
        const char *one[] = {not_numbers[i]};
        if (qt_job_parse(json3, ".", "j.json", one, 1, &j) == QT_OK) {
            qt_job_free(&j);
            fail_msg("--set %s was accepted", not_numbers[i]);
        }
        assert_non_null(strstr(qt_error_message(), "is not one"));
    }
}

static void test_job_errors_name_the_field(void **state) {
    (void)state;
    qt_job j;
    assert_int_equal(qt_job_parse("{\"model\": 1}", ".", "x.json", NULL, 0, &j), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "x.json"));
    assert_non_null(strstr(qt_error_message(), "model"));
    assert_int_equal(qt_job_parse("{\n\"model\": \"m\",\n oops}", ".", "x.json", NULL, 0, &j), QT_EFORMAT);
    assert_non_null(strstr(qt_error_message(), "line 3"));
    assert_int_equal(qt_job_parse("{\"model\": \"m\", \"output_dir\": \"o\"}", ".", "x.json", NULL, 0, &j), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "data"));
    assert_int_equal(qt_job_parse("{\"model\": \"m\", \"output_dir\": \"o\", \"data\": {\"train\": \"t\"},"
                                  " \"train\": {\"max_steps\": 2.5}}", ".", "x.json", NULL, 0, &j), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "train.max_steps"));
    assert_int_equal(qt_job_parse("{\"model\": \"m\", \"output_dir\": \"o\", \"data\": {\"train\": \"t\"},"
                                  " \"lora\": {\"lora_dropout\": 1.5}}", ".", "x.json", NULL, 0, &j), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "lora.lora_dropout"));
    assert_int_equal(qt_job_parse("{\"model\": \"m\", \"output_dir\": \"o\", \"data\": {\"train\": \"t\"},"
                                  " \"deepspeed\": \"missing_ds.json\"}", "/nonexistent", "x.json", NULL, 0, &j), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "x.json: \"deepspeed\" names /nonexistent/missing_ds.json, which does "
                                               "not exist; check the path"));
    /* an empty path said as such (it was "cannot open the file : No such file or directory") */
    assert_int_equal(qt_job_parse("{\"model\": \"m\", \"output_dir\": \"o\", \"data\": {\"train\": \"t\"},"
                                  " \"deepspeed\": \"\"}", ".", "x.json", NULL, 0, &j), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "x.json: \"deepspeed\" is an empty path"));
    /* valid JSON that is not an object is said as such, not as "not valid JSON" */
    char *d = tmpdir();
    write_text(d, "list_ds.json", "[{\"train_batch_size\": 8}]");
    assert_int_equal(qt_job_parse("{\"model\": \"m\", \"output_dir\": \"o\", \"data\": {\"train\": \"t\"},"
                                  " \"deepspeed\": \"list_ds.json\"}", d, "x.json", NULL, 0, &j), QT_EFORMAT);
    assert_non_null(strstr(qt_error_message(), "list_ds.json: the DeepSpeed config named by x.json's \"deepspeed\" "
                                               "is JSON but not an object"));
    qt_rm_rf(d);
    free(d);
}

/* Numbers out of a double's range, lora_alpha out of its range and a huge
 * data.prefetch are refused by name (file and key), wherever they are written. */
#define JOB_HEAD "{\"model\": \"m\", \"output_dir\": \"o\", \"data\": {\"train\": \"t\"}, "
static void expect_job_error(const char *json, const char *const *sets, int n_sets, const char *must1,
                             const char *must2) {
    qt_job j;
    int rc = qt_job_parse(json, ".", "x.json", sets, n_sets, &j);
    if (rc == QT_OK) {
        qt_job_free(&j);
        fail_msg("accepted: %s", json);
    }
    assert_int_equal(rc, QT_EINVAL);
    if (!strstr(qt_error_message(), must1) || !strstr(qt_error_message(), must2))
        fail_msg("'%s' and '%s' not both in: %s", must1, must2, qt_error_message());
}

static void test_job_numbers_in_range(void **state) {
    (void)state;
    expect_job_error(JOB_HEAD "\"deepspeed\": {\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-400}}}}",
                     NULL, 0, "x.json", "deepspeed.optimizer.params.lr is 1e-400");
    expect_job_error(JOB_HEAD "\"deepspeed\": {\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 1e400}}}}",
                     NULL, 0, "x.json", "deepspeed.optimizer.params.lr is 1e400");
    expect_job_error(JOB_HEAD "\"deepspeed\": {\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"eps\": 1e-320}}}}",
                     NULL, 0, "x.json", "deepspeed.optimizer.params.eps");
    expect_job_error(JOB_HEAD "\"lora\": {\"lora_alpha\": 1e-400}}", NULL, 0, "x.json", "lora.lora_alpha");
    /* a key --set adds is read as JSON: its numbers are checked too */
    const char *set[] = {"data.extra={\"v\": 1e-999}"};
    expect_job_error(JOB_HEAD "\"train\": {}}", set, 1, "--set", "v is 1e-999");
    /* and a number field's value the same way */
    const char *big[] = {"train.max_steps=1e400"}, *tiny[] = {"deepspeed.optimizer.params.lr=1e-310"};
    expect_job_error(JOB_HEAD "\"train\": {\"max_steps\": 3}}", big, 1, "--set train.max_steps=1e400",
                     "larger than any number can be");
    expect_job_error(JOB_HEAD "\"deepspeed\": {\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-4}}}}",
                     tiny, 1, "--set deepspeed.optimizer.params.lr=1e-310", "smaller in magnitude than any normal");
    /* in a DeepSpeed file, the error names that file */
    char *d = tmpdir();
    write_text(d, "ds.json", "{\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 3e-500}}}");
    write_text(d, "job.json", JOB_HEAD "\"deepspeed\": \"ds.json\"}");
    char p[4096];
    qt_path_join(p, sizeof p, d, "job.json");
    qt_job j;
    assert_int_equal(qt_job_load(p, NULL, 0, &j), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "ds.json: optimizer.params.lr is 3e-500"));
    qt_rm_rf(d);
    free(d);
    /* the smallest normal double and exact zeros are fine */
    assert_int_equal(qt_job_parse(JOB_HEAD "\"deepspeed\": {\"optimizer\": {\"type\": \"AdamW\", \"params\": "
                                  "{\"lr\": 2.3e-308, \"weight_decay\": 0e-400}}}}",
                                  ".", "x.json", NULL, 0, &j),
                     QT_OK);
    qt_job_free(&j);
}

static void test_job_lora_alpha_and_prefetch_ranges(void **state) {
    (void)state;
    static const char *const bad_alpha[] = {"1e300", "1e7", "0", "-4", "1e-9"};
    for (size_t i = 0; i < sizeof bad_alpha / sizeof bad_alpha[0]; i++) {
        char json[512];
        snprintf(json, sizeof json, JOB_HEAD "\"lora\": {\"r\": 4, \"lora_alpha\": %s}}", bad_alpha[i]);
        expect_job_error(json, NULL, 0, "x.json", "lora.lora_alpha");
    }
    const char *set_alpha[] = {"lora.lora_alpha=1e300"};
    expect_job_error(JOB_HEAD "\"lora\": {\"lora_alpha\": 8}}", set_alpha, 1, "x.json", "lora.lora_alpha");
    qt_job j;
    assert_int_equal(qt_job_parse(JOB_HEAD "\"lora\": {\"lora_alpha\": 1e6}}", ".", "x.json", NULL, 0, &j), QT_OK);
    assert_true(j.lora.lora_alpha == 1e6f);
    qt_job_free(&j);

    expect_job_error(JOB_HEAD "\"train\": {}}", (const char *[]){"data.prefetch=1025"}, 1, "data.prefetch",
                     "0 to 1024");
    expect_job_error("{\"model\": \"m\", \"output_dir\": \"o\", \"data\": {\"train\": \"t\", \"prefetch\": 1000000000}}",
                     NULL, 0, "x.json", "data.prefetch");
    assert_int_equal(qt_job_parse("{\"model\": \"m\", \"output_dir\": \"o\", \"data\": {\"train\": \"t\", "
                                  "\"prefetch\": 1024}}", ".", "x.json", NULL, 0, &j),
                     QT_OK);
    assert_int_equal(j.data.prefetch, 1024);
    qt_job_free(&j);
}

static void test_job_reads_deepspeed_file(void **state) {
    (void)state;
    char *d = tmpdir();
    write_text(d, "ds.json", "{\"train_micro_batch_size_per_gpu\": 4}");
    write_text(d, "job.json", "{\"model\": \"m\", \"output_dir\": \"o\", \"data\": {\"train\": \"t\"}, \"deepspeed\": \"ds.json\"}");
    char p[4096];
    qt_path_join(p, sizeof p, d, "job.json");
    qt_job j;
    const char *sets[] = {"deepspeed.gradient_accumulation_steps=2"};
    assert_int_equal(qt_job_load(p, sets, 1, &j), QT_OK);
    assert_non_null(j.deepspeed);
    assert_int_equal(cJSON_GetObjectItem(j.deepspeed, "train_micro_batch_size_per_gpu")->valueint, 4);
    assert_int_equal(cJSON_GetObjectItem(j.deepspeed, "gradient_accumulation_steps")->valueint, 2);
    assert_non_null(strstr(j.deepspeed_path, "ds.json"));
    qt_job_free(&j);
    qt_rm_rf(d);
    free(d);
}

static void test_checkpoint_folders(void **state) {
    (void)state;
    char *d = tmpdir();
    for (long s = 1; s <= 4; s++) {
        ckpt_writer w;
        assert_int_equal(ckpt_begin(&w, d, s * 10), QT_OK);
        char p[4200];
        snprintf(p, sizeof p, "%s/%s", w.dir, CKPT_STATE_FILE);
        assert_int_equal(qt_write_file_atomic(p, "{}", 2), QT_OK);
        float x[3] = {1, 2, (float)s};
        snprintf(p, sizeof p, "%s/x.safetensors", w.dir);
        assert_int_equal(ckpt_write_f32(p, "x", x, 3), QT_OK);
        assert_int_equal(ckpt_commit(&w), QT_OK);
    }
    /* an unfinished write is not a checkpoint */
    ckpt_writer w;
    assert_int_equal(ckpt_begin(&w, d, 50), QT_OK);
    char path[4096];
    long step;
    assert_int_equal(ckpt_latest(d, path, sizeof path, &step), QT_OK);
    assert_int_equal(step, 40);
    assert_non_null(strstr(path, "checkpoint-40"));
    float y[3];
    char p[4200];
    snprintf(p, sizeof p, "%s/x.safetensors", path);
    assert_int_equal(ckpt_read_f32(p, "x", y, 3), QT_OK);
    assert_true(y[2] == 4.0f);
    assert_int_equal(ckpt_read_f32(p, "x", y, 2), QT_EFORMAT); /* wrong length named */
    assert_int_equal(ckpt_prune(d, 2, -1), QT_OK);
    snprintf(p, sizeof p, "%s/checkpoint-20", d);
    assert_false(qt_path_exists(p));
    snprintf(p, sizeof p, "%s/checkpoint-30", d);
    assert_true(qt_path_exists(p));
    assert_false(qt_path_exists(w.dir)); /* the stale .tmp is gone */
    assert_int_equal(ckpt_step_of("checkpoint-123"), 123);
    assert_int_equal(ckpt_step_of("checkpoint-12a"), -1);
    assert_int_equal(ckpt_step_of("checkpoint-"), -1);
    qt_rm_rf(d);
    free(d);
}

static void test_peft_names_and_config(void **state) {
    (void)state;
    char base[256];
    int is_b = -1;
    assert_true(peft_base_name("base_model.model.model.layers.3.mlp.up_proj.lora_B.weight", base, sizeof base, &is_b));
    assert_string_equal(base, "model.layers.3.mlp.up_proj.weight");
    assert_int_equal(is_b, 1);
    assert_true(peft_base_name("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", base,
                               sizeof base, &is_b));
    assert_string_equal(base, "model.layers.0.self_attn.q_proj.weight");
    assert_int_equal(is_b, 0);
    assert_false(peft_base_name("model.layers.0.self_attn.q_proj.weight", base, sizeof base, &is_b));
    assert_false(peft_base_name("base_model.model.lm_head.weight", base, sizeof base, &is_b));

    char *d = tmpdir();
    peft_config c = {.r = 8, .lora_alpha = 32, .lora_dropout = 0.1f, .use_rslora = 1, .n_targets = 2};
    strcpy(c.target_modules[0], "q_proj");
    strcpy(c.target_modules[1], "v_proj");
    strcpy(c.base_model, "Qwen/Qwen2.5-0.5B");
    assert_int_equal(peft_config_write(&c, d), QT_OK);
    peft_config r;
    assert_int_equal(peft_config_load(d, &r), QT_OK);
    assert_int_equal(r.r, 8);
    assert_true(r.lora_alpha == 32 && r.use_rslora && r.n_targets == 2);
    assert_string_equal(r.target_modules[1], "v_proj");
    assert_true(fabsf(peft_scaling(&r) - 32.0f / sqrtf(8)) < 1e-6f);
    write_text(d, "adapter_config.json", "{\"peft_type\": \"LORA\", \"r\": 4, \"use_dora\": true}");
    assert_int_equal(peft_config_load(d, &r), QT_EUNSUPPORTED);
    assert_non_null(strstr(qt_error_message(), "use_dora"));
    write_text(d, "adapter_config.json", "{\"peft_type\": \"LORA\", \"r\": -4}");
    assert_int_equal(peft_config_load(d, &r), QT_EFORMAT);
    /* lora_alpha must be finite and in range: inf (1e400), 0 (1e-400), 1e300
     * (inf as a float), 0 and negatives are refused by name */
    static const char *const bad_alpha[] = {"1e400", "1e-400", "1e300", "0", "-8", "1e-7"};
    for (size_t i = 0; i < sizeof bad_alpha / sizeof bad_alpha[0]; i++) {
        char text[256];
        snprintf(text, sizeof text, "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": %s}", bad_alpha[i]);
        write_text(d, "adapter_config.json", text);
        assert_int_not_equal(peft_config_load(d, &r), QT_OK);
        if (!strstr(qt_error_message(), "adapter_config.json") || !strstr(qt_error_message(), "lora_alpha"))
            fail_msg("lora_alpha %s: %s", bad_alpha[i], qt_error_message());
    }
    write_text(d, "adapter_config.json", "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_dropout\": 1e400}");
    assert_int_not_equal(peft_config_load(d, &r), QT_OK);
    assert_non_null(strstr(qt_error_message(), "lora_dropout"));
    write_text(d, "adapter_config.json", "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_dropout\": 2}");
    assert_int_equal(peft_config_load(d, &r), QT_EFORMAT);
    assert_non_null(strstr(qt_error_message(), "lora_dropout"));
    write_text(d, "adapter_config.json", "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 0.5}");
    assert_int_equal(peft_config_load(d, &r), QT_OK);
    assert_true(r.lora_alpha == 0.5f);
    qt_rm_rf(d);
    free(d);
}

/* target_modules as PEFT matches it: a list (names or dotted suffixes), a
 * regex string (full match against every module name, PCRE2), "all-linear";
 * refused by name: a module in some layers only, lm_head or the embedding, an
 * entry naming no linear layer, nothing selected, a regex PCRE2 cannot
 * compile or longer than qtune keeps. */
static unsigned targets_of(const char *config_json, int n_layers, int want_rc, const char *want_msg) {
    char *d = tmpdir();
    write_text(d, "adapter_config.json", config_json);
    peft_config pc;
    unsigned mask = 0;
    int rc = peft_config_load(d, &pc);
    if (rc == QT_OK) rc = qt_lora_targets_from_peft(&pc, n_layers, &mask, "adapter_config.json");
    if (rc != want_rc || (want_msg && !strstr(qt_error_message(), want_msg)))
        fail_msg("%s: rc %d (want %d), message: %s", config_json, rc, want_rc, rc ? qt_error_message() : "-");
    qt_rm_rf(d);
    free(d);
    return mask;
}

static void test_peft_target_modules(void **state) {
    (void)state;
#define CFG(tm) "{\"peft_type\": \"LORA\", \"r\": 4, \"target_modules\": " tm "}"
    assert_int_equal(targets_of(CFG("[\"q_proj\", \"v_proj\"]"), 3, QT_OK, NULL), QT_LORA_Q | QT_LORA_V);
    assert_int_equal(targets_of(CFG("[\"self_attn.q_proj\", \"mlp.down_proj\"]"), 3, QT_OK, NULL),
                     QT_LORA_Q | QT_LORA_DOWN);
    assert_int_equal(targets_of(CFG("\".*\\\\.(q_proj|v_proj)\""), 3, QT_OK, NULL), QT_LORA_Q | QT_LORA_V);
    assert_int_equal(targets_of(CFG("\"model\\\\.layers\\\\.\\\\d+\\\\.mlp\\\\..*\""), 3, QT_OK, NULL),
                     QT_LORA_GATE | QT_LORA_UP | QT_LORA_DOWN);
    assert_int_equal(targets_of(CFG("\"all-linear\""), 3, QT_OK, NULL), 0x7f);
    /* a regex matches whole names: "q_proj" alone matches no module name */
    targets_of(CFG("\"q_proj\""), 3, QT_EFORMAT, "selects none");
    targets_of(CFG("\".*layers\\\\.[01]\\\\..*q_proj\""), 3, QT_EUNSUPPORTED, "q_proj in 2 of the model's 3 layers");
    targets_of(CFG("\".*\""), 3, QT_EUNSUPPORTED, "lm_head");
    targets_of(CFG("[\"q_proj\", \"embed_tokens\"]"), 3, QT_EUNSUPPORTED, "model.embed_tokens");
    targets_of(CFG("[\"q_proj\", \"qproj\"]"), 3, QT_EUNSUPPORTED, "'qproj' names none");
    targets_of(CFG("\"(q_proj\""), 3, QT_EFORMAT, "does not compile");
    targets_of(CFG("7"), 3, QT_EFORMAT, "list of module names or a regex");
    char big[1200] = CFG("\"");
    size_t n = strlen(big);
    memset(big + n, 'a', 1100);
    strcpy(big + n + 1100, "\"}");
    targets_of(big, 3, QT_EFORMAT, "qtune reads up to 1023");
#undef CFG
    /* the job file keeps lists and "all-linear"; a regex string is refused with a pointer to the list form */
    cJSON *js = cJSON_CreateString(".*q_proj");
    unsigned jm = 0;
    assert_int_equal(qt_job_lora_targets(js, &jm, "job.json"), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "write the module names as a list"));
    cJSON_Delete(js);
    /* written back as a string */
    char *d = tmpdir();
    peft_config c = {.r = 2, .lora_alpha = 4};
    strcpy(c.target_regex, ".*(q|v)_proj");
    assert_int_equal(peft_config_write(&c, d), QT_OK);
    peft_config r;
    assert_int_equal(peft_config_load(d, &r), QT_OK);
    assert_string_equal(r.target_regex, ".*(q|v)_proj");
    assert_true(peft_targets_module(&r, "model.layers.7.self_attn.v_proj"));
    assert_false(peft_targets_module(&r, "model.layers.7.self_attn.v_proj_extra"));
    char tm[64];
    peft_targets_str(&r, tm, sizeof tm);
    assert_string_equal(tm, "regex '.*(q|v)_proj'");
    qt_rm_rf(d);
    free(d);
}

static void test_loss_svg(void **state) {
    (void)state;
    char *d = tmpdir();
    char p[4096];
    qt_path_join(p, sizeof p, d, "loss.svg");
    qt_metrics_point tr[3] = {{1, 2.5, 0}, {2, 2.0, 0}, {3, 1.5, 0}}, ev[1] = {{3, 1.7, 0}};
    assert_int_equal(qt_loss_svg_write(p, "a <title> & more", tr, 3, ev, 1), QT_OK);
    char *s;
    size_t n;
    assert_int_equal(qt_read_file(p, 1 << 20, &s, &n), QT_OK);
    assert_non_null(strstr(s, "<svg"));
    assert_non_null(strstr(s, "</svg>"));
    assert_non_null(strstr(s, "&lt;title&gt; &amp;"));
    assert_non_null(strstr(s, "polyline"));
    assert_null(strstr(s, "skipped")); /* no step was skipped: no mark, no legend */
    qt_free(s);
    /* steps that applied no update (fp16 overflows) are marked on the step axis, one whose loss was not
     * finite too, and the curve leaves that point out rather than drawing NaN */
    qt_metrics_point sk[4] = {{1, NAN, 1}, {2, 9.0, 1}, {3, 2.0, 0}, {4, 1.5, 0}};
    assert_int_equal(qt_loss_svg_write(p, "skips", sk, 4, NULL, 0), QT_OK);
    assert_int_equal(qt_read_file(p, 1 << 20, &s, &n), QT_OK);
    assert_non_null(strstr(s, "<title>step 1 skipped</title>"));
    assert_non_null(strstr(s, "<title>step 2 skipped</title>"));
    assert_null(strstr(s, "<title>step 3 skipped"));
    assert_non_null(strstr(s, "2 skipped steps (no update)"));
    assert_null(strstr(s, "nan"));
    qt_free(s);
    assert_int_equal(qt_loss_svg_write(p, NULL, NULL, 0, NULL, 0), QT_OK); /* empty curve is fine */
    /* a long run's curve stays a small file */
    enum { N = 100000 };
    qt_metrics_point *many = malloc(N * sizeof *many);
    for (int i = 0; i < N; i++) many[i] = (qt_metrics_point){i + 1, 3.0 - i * 1e-5, 0};
    assert_int_equal(qt_loss_svg_write(p, "long", many, N, ev, 1), QT_OK);
    struct stat sb;
    assert_int_equal(stat(p, &sb), 0);
    assert_true(sb.st_size < 100000);
    free(many);
    qt_rm_rf(d);
    free(d);
}

/* The public API end to end: a tiny random model, two LoRA steps, eval with
 * the adapter equals eval of the merged model. */
static void test_public_api(void **state) {
    (void)state;
    char *d = tmpdir();
    char p[4096], model[4096];
    qt_path_join(model, sizeof model, d, "model");
    assert_int_equal(qt_mkdir_p(model), QT_OK);
    qt_config cfg;
    assert_int_equal(qt_preset("tiny", &cfg), QT_OK);
    qt_path_join(p, sizeof p, model, "config.json");
    assert_int_equal(qt_config_write(&cfg, p), QT_OK);
    qt_path_join(p, sizeof p, model, "model.safetensors");
    assert_int_equal(qt_init_weights_write(&cfg, QT_F32, 1, p), QT_OK);
    char data[4096] = "";
    for (int i = 0; i < 8; i++) {
        char line[256];
        snprintf(line, sizeof line, "{\"input_ids\": [%d, %d, %d, %d, %d, %d, %d, %d]}\n", i + 1, i + 3, i + 5, i + 7,
                 i + 9, i + 11, i + 13, i + 15);
        strcat(data, line);
    }
    write_text(d, "train.jsonl", data);
    write_text(d, "job.json",
               "{\"model\": \"model\", \"output_dir\": \"out\", \"data\": {\"train\": \"train.jsonl\", \"seq_len\": 8},"
               " \"lora\": {\"r\": 2, \"lora_alpha\": 4, \"target_modules\": [\"q_proj\", \"v_proj\"]},"
               " \"train\": {\"max_steps\": 2}, \"deepspeed\": {\"train_micro_batch_size_per_gpu\": 2,"
               " \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.05}}}}");
    qt_path_join(p, sizeof p, d, "job.json");
    char fin[4096];
    int rc = qtune_train(p, NULL, 0, NULL, fin, sizeof fin);
    if (rc) fprintf(stderr, "%s\n", qtune_last_error());
    assert_int_equal(rc, 0);
    assert_non_null(strstr(fin, "final"));
    char merged[4096], tr[4096];
    qt_path_join(merged, sizeof merged, d, "merged");
    qt_path_join(tr, sizeof tr, d, "train.jsonl");
    assert_int_equal(qtune_merge(model, fin, merged, NULL), 0);
    qtune_model *a, *b;
    assert_int_equal(qtune_model_load(model, fin, 8, 2, &a), 0);
    assert_int_equal(qtune_model_load(merged, NULL, 8, 2, &b), 0);
    double la, lb;
    int64_t na, nb;
    assert_int_equal(qtune_eval(a, tr, NULL, &la, &na), 0);
    assert_int_equal(qtune_eval(b, tr, NULL, &lb, &nb), 0);
    assert_int_equal(na, 8 * 7);
    assert_int_equal(na, nb);
    assert_true(fabs(la - lb) < 1e-5 * la);
    /* qtune_generate, greedy: the tokens an argmax loop over qt_model_decode gives, up to an eos id, max_new
     * or the context (seq_len 8) */
    int32_t prompt[3] = {1, 2, 3}, got[8], want[8], eos[16];
    int n_got = -1, n_want = 0, n_eos = 0;
    assert_int_equal(qtune_generate(b, prompt, 3, 6, 0.0f, 1, got, &n_got), 0);
    assert_int_equal(qt_eos_ids_load(merged, eos, 16, &n_eos), QT_OK);
    qt_model_opts o;
    qt_model_opts_default(&o);
    o.infer = 1, o.max_B = 2, o.max_T = 8;
    qt_model *m;
    assert_int_equal(qt_model_load(merged, &o, &m), QT_OK);
    const int V = qt_model_config(m)->vocab_size;
    float *lg = malloc(sizeof(float) * (size_t)V);
    assert_int_equal(qt_model_decode(m, prompt, 3, 0, lg), QT_OK);
    for (int pos = 3; n_want < 6;) {
        int32_t t = qt_argmax(lg, V);
        int stop = 0;
        for (int k = 0; k < n_eos; k++) stop |= eos[k] == t;
        if (stop) break;
        want[n_want++] = t;
        if (pos + 1 >= 8) break;
        assert_int_equal(qt_model_decode(m, &t, 1, pos++, lg), QT_OK);
    }
    assert_true(n_want > 0);
    assert_int_equal(n_got, n_want);
    assert_memory_equal(got, want, sizeof(int32_t) * (size_t)n_want);
    free(lg);
    qt_model_free(m);
    /* a second call starts a new sequence: the same reply */
    int32_t again[8];
    int n_again = -1;
    assert_int_equal(qtune_generate(b, prompt, 3, 6, 0.0f, 1, again, &n_again), 0);
    assert_int_equal(n_again, n_got);
    assert_memory_equal(again, got, sizeof(int32_t) * (size_t)n_got);
    /* a prompt that fills seq_len is refused with a sentence that names it */
    int32_t full[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    assert_int_equal(qtune_generate(b, full, 8, 4, 0.0f, 1, got, &n_got), QT_EINVAL);
    assert_non_null(strstr(qtune_last_error(), "seq_len"));
    assert_int_equal(n_got, 0);
    qtune_model_free(a);
    qtune_model_free(b);
    assert_int_equal(qtune_merge(model, fin, merged, "f64"), QT_EINVAL);
    qt_rm_rf(d);
    free(d);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_job_defaults_and_paths), cmocka_unit_test(test_job_sets_are_typed),
        cmocka_unit_test(test_job_errors_name_the_field), cmocka_unit_test(test_job_reads_deepspeed_file),
        cmocka_unit_test(test_job_numbers_in_range), cmocka_unit_test(test_job_lora_alpha_and_prefetch_ranges),
        cmocka_unit_test(test_checkpoint_folders), cmocka_unit_test(test_peft_names_and_config),
        cmocka_unit_test(test_peft_target_modules),
        cmocka_unit_test(test_loss_svg), cmocka_unit_test(test_public_api),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
