/* The job file meets users' own files (issue 22): "lora" as a PEFT
 * adapter_config.json (a file or its folder), PEFT's keys at their defaults
 * accepted quietly and other values refused by key, and
 * --set lora.target_modules=all-linear as in the file; modules_to_save,
 * layers_to_transform and layers_pattern read as PEFT's LoraConfig has them. */
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
#include "core/log.h"
#include "model/model.h"
#include "train/job.h"

/* What peft 0.13's LoraConfig(...).save_pretrained writes, r 16, alpha 32. */
static const char PEFT_CONFIG[] =
    "{\"alpha_pattern\": {}, \"auto_mapping\": null, \"base_model_name_or_path\": \"Qwen/Qwen2.5-0.5B\", "
    "\"bias\": \"none\", \"fan_in_fan_out\": false, \"inference_mode\": true, \"init_lora_weights\": true, "
    "\"layer_replication\": null, \"layers_pattern\": null, \"layers_to_transform\": null, \"loftq_config\": {}, "
    "\"lora_alpha\": 32, \"lora_dropout\": 0.05, \"megatron_config\": null, \"megatron_core\": \"megatron.core\", "
    "\"modules_to_save\": null, \"peft_type\": \"LORA\", \"r\": 16, \"rank_pattern\": {}, \"revision\": null, "
    "\"target_modules\": [\"q_proj\", \"v_proj\", \"o_proj\"], \"task_type\": \"CAUSAL_LM\", \"use_dora\": false, "
    "\"use_rslora\": false}";

static char dir[64];

static void write_file(const char *name, const char *text) {
    char p[256];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    assert_int_equal(qt_write_file_atomic(p, text, strlen(text)), QT_OK);
}

static int load(const char *lora_json, const char *const *sets, int n_sets, qt_job *j) {
    char job[4096], p[256];
    snprintf(job, sizeof job, "{\"model\": \"m\", \"output_dir\": \"o\", \"data\": {\"train\": \"t\"}, \"lora\": %s}",
             lora_json);
    write_file("job.json", job);
    snprintf(p, sizeof p, "%s/job.json", dir);
    return qt_job_load(p, sets, n_sets, j);
}

static int setup(void **state) {
    (void)state;
    qt_log_set_level(QT_LOG_ERROR);
    snprintf(dir, sizeof dir, "/tmp/qtune_jobu_XXXXXX");
    assert_non_null(mkdtemp(dir));
    char sub[128];
    snprintf(sub, sizeof sub, "%s/adapter", dir);
    assert_int_equal(qt_mkdir_p(sub), QT_OK);
    write_file("adapter_config.json", PEFT_CONFIG);
    write_file("adapter/adapter_config.json", PEFT_CONFIG);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    qt_rm_rf(dir);
    return 0;
}

static void test_lora_is_a_peft_config_file(void **state) {
    (void)state;
    qt_job j;
    assert_int_equal(load("\"adapter_config.json\"", NULL, 0, &j), QT_OK);
    assert_true(j.lora.enabled);
    assert_int_equal(j.lora.r, 16);
    assert_true(j.lora.lora_alpha == 32.0f);
    assert_true(fabsf(j.lora.lora_dropout - 0.05f) < 1e-7f);
    assert_int_equal(j.lora.targets, QT_LORA_Q | QT_LORA_V | QT_LORA_O);
    assert_non_null(strstr(j.lora_path, "adapter_config.json"));
    uint64_t fp = j.fingerprint;
    qt_job_free(&j);
    /* the folder means its adapter_config.json; --set reaches inside */
    const char *sets[] = {"lora.r=4"};
    assert_int_equal(load("\"adapter\"", sets, 1, &j), QT_OK);
    assert_int_equal(j.lora.r, 4);
    assert_non_null(strstr(j.lora_path, "adapter/adapter_config.json"));
    assert_true(j.fingerprint != fp); /* the file's content is in the fingerprint */
    qt_job_free(&j);
    /* inline, the same keys */
    assert_int_equal(load(PEFT_CONFIG, NULL, 0, &j), QT_OK);
    assert_int_equal(j.fingerprint, fp);
    qt_job_free(&j);
    /* a missing file names the job and key */
    assert_int_equal(load("\"nope.json\"", NULL, 0, &j) < 0, 1);
    assert_non_null(strstr(qt_error_message(), "job.json: \"lora\" names "));
    assert_non_null(strstr(qt_error_message(), "nope.json, which does not exist"));
    /* a bad value in the file names that file (it named only the job, where no lora_alpha is written) */
    char bad[sizeof PEFT_CONFIG + 8];
    snprintf(bad, sizeof bad, "%s", PEFT_CONFIG);
    char *alpha = strstr(bad, "\"lora_alpha\": 32");
    assert_non_null(alpha);
    memcpy(alpha, "\"lora_alpha\": []", strlen("\"lora_alpha\": []"));
    write_file("bad_alpha.json", bad);
    assert_int_equal(load("\"bad_alpha.json\"", NULL, 0, &j), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "bad_alpha.json ("));
    assert_non_null(strstr(qt_error_message(), "job.json's \"lora\"): lora.lora_alpha must be a number"));
}

static void test_non_default_peft_keys_are_refused_by_name(void **state) {
    (void)state;
    /* a --set on the config file, or an inline section */
    static const struct { const char *set, *inline_lora, *needle; } cases[] = {
        {"lora.fan_in_fan_out=true", NULL, "lora.fan_in_fan_out is true, which qtune does not implement"},
        {NULL, "{\"init_lora_weights\": \"gaussian\"}", "lora.init_lora_weights is \"gaussian\""},
        {"lora.use_dora=true", NULL, "lora.use_dora is true"},
        {"lora.ensure_weight_tying=true", NULL, "lora.ensure_weight_tying is true"},
        /* modules_to_save / layers_to_transform / layers_pattern: read, with LoraConfig's own checks */
        {NULL, "{\"modules_to_save\": \"lm_head\"}", "lora.modules_to_save must be a list of module names"},
        {"lora.layers_pattern=layers", NULL, "lora.layers_pattern is set but layers_to_transform is not"},
        {NULL, "{\"layers_to_transform\": [0, -1]}", "lora.layers_to_transform must be a layer index or a list"},
        {NULL, "{\"target_modules\": \"all-linear\", \"layers_to_transform\": 1}",
         "lora.layers_to_transform cannot be used when target_modules is a string"},
        {"lora.rank_pattern={\"q_proj\":4}", NULL, "lora.rank_pattern is"},
        {"lora.peft_type=IA3", NULL, "lora.peft_type is IA3"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        qt_job j;
        const char *sets[] = {cases[i].set};
        int rc = cases[i].set ? load("\"adapter_config.json\"", sets, 1, &j) : load(cases[i].inline_lora, NULL, 0, &j);
        if (rc == QT_OK) fail_msg("case %zu was accepted", i);
        if (!strstr(qt_error_message(), cases[i].needle) || strstr(qt_error_message(), "spelling"))
            fail_msg("case %zu: '%s' lacks '%s'", i, qt_error_message(), cases[i].needle);
    }
}

/* PEFT's modules_to_save, layers_to_transform (an int or a list) and
 * layers_pattern (a name or a list), from the config file with --set or
 * inline; checked against the model's layout when the run starts. */
static void test_modules_to_save_and_layers(void **state) {
    (void)state;
    qt_job j;
    const char *sets[] = {"lora.modules_to_save=[\"embed_tokens\",\"lm_head\"]", "lora.layers_to_transform=[0,1]",
                          "lora.layers_pattern=layers"};
    assert_int_equal(load("\"adapter_config.json\"", sets, 3, &j), QT_OK);
    const peft_config *x = &j.lora.extras;
    assert_int_equal(x->n_save, 2);
    assert_string_equal(x->modules_to_save[1], "lm_head");
    assert_int_equal(x->n_layers, 2);
    assert_int_equal(x->layers_to_transform[1], 1);
    assert_false(x->layers_int);
    assert_int_equal(x->n_patterns, 1);
    assert_string_equal(x->layers_pattern[0], "layers");
    qt_job_free(&j);
    assert_int_equal(load("{\"layers_to_transform\": 3, \"layers_pattern\": [\"layers\", \"h\"]}", NULL, 0, &j),
                     QT_OK);
    assert_int_equal(j.lora.extras.n_layers, 1);
    assert_true(j.lora.extras.layers_int);
    assert_int_equal(j.lora.extras.n_patterns, 2);
    assert_true(j.lora.extras.patterns_list);
    /* PEFT's layer index: after the pattern, or without one the last NAME.N. */
    assert_int_equal(peft_layer_index(&j.lora.extras, "model.layers.12.self_attn.q_proj"), 12);
    assert_int_equal(peft_layer_index(&j.lora.extras, "transformer.h.3.attn.c_attn"), 3);
    peft_config none;
    memset(&none, 0, sizeof none);
    assert_int_equal(peft_layer_index(&none, "model.layers.7.mlp.down_proj"), 7);
    assert_int_equal(peft_layer_index(&none, "lm_head"), -1);
    qt_job_free(&j);
}

static void test_set_all_linear(void **state) {
    (void)state;
    const unsigned all = QT_LORA_Q | QT_LORA_K | QT_LORA_V | QT_LORA_O | QT_LORA_GATE | QT_LORA_UP | QT_LORA_DOWN;
    qt_job j;
    const char *sets[] = {"lora.target_modules=all-linear"};
    assert_int_equal(load("{\"r\": 4, \"target_modules\": [\"q_proj\"]}", sets, 1, &j), QT_OK);
    assert_int_equal(j.lora.targets, all);
    assert_int_equal(j.lora.n_target_names, 7);
    qt_job_free(&j);
    /* the list form PEFT users also write */
    assert_int_equal(load("{\"r\": 4, \"target_modules\": [\"all-linear\"]}", NULL, 0, &j), QT_OK);
    assert_int_equal(j.lora.targets, all);
    assert_int_equal(j.lora.n_target_names, 7);
    assert_string_equal(j.lora.target_names[6], "down_proj");
    qt_job_free(&j);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lora_is_a_peft_config_file),
        cmocka_unit_test(test_non_default_peft_keys_are_refused_by_name),
        cmocka_unit_test(test_set_all_linear),
        cmocka_unit_test(test_modules_to_save_and_layers),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
