/* train/run_setup: the job's "lora" and "quantization" reach the model the
 * run loads and the model the plan sizes through one filler (the adapter
 * group of model/model.h), so a LoRA or quantization key cannot reach one and
 * not the other; the plan's own rules on top (a 4-bit base counted only under
 * LoRA, in nf4's bytes) are the only differences. */
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
#include "core/quant4.h"
#include "io/hf_config.h"
#include "model/model.h"
#include "train/job.h"
#include "train/plan_report.h"
#include "train/run_setup.h"

static char dir[64];

static void write_file(const char *name, const char *text) {
    char p[256];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    assert_int_equal(qt_write_file_atomic(p, text, strlen(text)), QT_OK);
}

static int setup(void **state) {
    (void)state;
    qt_log_set_level(QT_LOG_ERROR);
    snprintf(dir, sizeof dir, "/tmp/qtune_setup_XXXXXX");
    assert_non_null(mkdtemp(dir));
    char sub[128];
    snprintf(sub, sizeof sub, "%s/m", dir);
    assert_int_equal(qt_mkdir_p(sub), QT_OK);
    write_file("m/config.json",
               "{\"architectures\": [\"Qwen2ForCausalLM\"], \"model_type\": \"qwen2\", \"vocab_size\": 512, "
               "\"hidden_size\": 64, \"intermediate_size\": 176, \"num_hidden_layers\": 3, "
               "\"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"max_position_embeddings\": 256, "
               "\"rms_norm_eps\": 1e-6, \"rope_theta\": 10000.0, \"tie_word_embeddings\": true, "
               "\"torch_dtype\": \"float32\"}");
    return 0;
}

static int teardown(void **state) {
    (void)state;
    qt_rm_rf(dir);
    return 0;
}

static void load_job(const char *lora, const char *quant, const char *ds, qt_job *j) {
    char text[4096], p[256];
    snprintf(text, sizeof text,
             "{\"model\": \"m\", \"output_dir\": \"o\", \"data\": {\"train\": \"t\", \"seq_len\": 16}%s%s%s%s%s%s}",
             lora ? ", \"lora\": " : "", lora ? lora : "", quant ? ", \"quantization\": " : "", quant ? quant : "",
             ds ? ", \"deepspeed\": " : "", ds ? ds : "");
    write_file("job.json", text);
    snprintf(p, sizeof p, "%s/job.json", dir);
    if (qt_job_load(p, NULL, 0, j) != QT_OK) fail_msg("%s", qt_error_message());
}

/* The model the run loads and the one the plan sizes, for the same job and rank. */
static void both(const qt_job *job, int world, qt_model_opts *run, qt_model_opts *plan) {
    qt_run_setup s;
    assert_int_equal(qt_run_setup_open(&s, job, world, 0), QT_OK);
    assert_int_equal(qt_run_setup_lora(&s, 1), QT_OK);
    assert_int_equal(qt_run_setup_model_opts(&s, run), QT_OK);
    qt_plan_opts po;
    qt_plan_opts_default(&po);
    qt_run_setup_plan_opts(&s, &po);
    qt_config cfg;
    char m[128];
    snprintf(m, sizeof m, "%s/m", dir);
    assert_int_equal(qt_config_load(m, &cfg), QT_OK);
    qt_plan_model_opts(&cfg, &po, world, 0, plan);
}

static void test_every_adapter_key_reaches_the_plan(void **state) {
    (void)state;
    qt_job job;
    load_job("{\"r\": 16, \"lora_alpha\": 32, \"lora_dropout\": 0.05, \"use_rslora\": true, "
             "\"target_modules\": [\"q_proj\", \"v_proj\", \"o_proj\", \"up_proj\"], \"modules_to_save\": [\"lm_head\"], "
             "\"layers_to_transform\": [0, 2]}",
             "{\"load_in_4bit\": true, \"bnb_4bit_quant_type\": \"fp4\", \"bnb_4bit_use_double_quant\": true, "
             "\"llm_int8_skip_modules\": [\"v_proj\"]}",
             "{\"train_micro_batch_size_per_gpu\": 2, \"zero_optimization\": {\"stage\": 2}}", &job);
    qt_model_opts run, plan;
    both(&job, 2, &run, &plan);
    /* what the job says, in the run's model */
    assert_int_equal(run.lora, 1);
    assert_int_equal(run.lora_r, 16);
    assert_true(run.lora_alpha == 32.0f && run.lora_dropout == 0.05f && run.use_rslora);
    assert_int_equal(run.lora_targets, QT_LORA_Q | QT_LORA_V | QT_LORA_O | QT_LORA_UP);
    assert_int_equal(run.lora_save, QT_SAVE_LM_HEAD);
    assert_true(run.lora_layers_set && run.lora_layers[0] == 5);
    assert_true(run.quant4 && run.quant4_nested && run.quant4_type == QT_Q4_FP4);
    assert_int_equal(run.quant4_skip, QT_LORA_V);
    /* the plan's model: the same group but the 4-bit type (nf4 and fp4 take the same bytes) */
    assert_int_equal(plan.quant4_type, QT_Q4_NF4);
    plan.quant4_type = run.quant4_type;
    assert_memory_equal(&plan.adapter, &run.adapter, sizeof run.adapter);
    /* and the rest of what sizes memory, by the run's rules */
    assert_int_equal(plan.max_B, run.max_B);
    assert_int_equal(plan.max_T, run.max_T);
    assert_int_equal(plan.grad_windows, run.grad_windows);
    assert_int_equal(plan.master_shards, run.master_shards);
    qt_job_free(&job);
}

static void test_full_fine_tuning_plans_no_adapter(void **state) {
    (void)state;
    qt_job job;
    load_job(NULL, NULL, NULL, &job);
    qt_model_opts run, plan;
    both(&job, 1, &run, &plan);
    assert_int_equal(run.lora, 0);
    assert_int_equal(plan.lora, 0);
    assert_int_equal(plan.quant4, 0);
    assert_int_equal(plan.lora_save, 0);
    assert_int_equal(plan.lora_layers_set, 0);
    /* the plan's own LoRA defaults stay for its "LoRA instead" alternative (r 8 on q, v, dropout 0.1), not the
     * empty "lora" of a job without one */
    qt_run_setup s;
    assert_int_equal(qt_run_setup_open(&s, &job, 1, 0), QT_OK);
    assert_int_equal(qt_run_setup_lora(&s, 1), QT_OK);
    qt_plan_opts po;
    qt_plan_opts_default(&po);
    qt_run_setup_plan_opts(&s, &po);
    assert_int_equal(po.lora, 0);
    assert_int_equal(po.lora_r, 8);
    assert_int_equal(po.lora_targets, QT_LORA_Q | QT_LORA_V);
    assert_true(po.lora_dropout == 0.1f);
    qt_job_free(&job);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_adapter_key_reaches_the_plan),
        cmocka_unit_test(test_full_fine_tuning_plans_no_adapter),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
