/* Regression tests for the crashes and hostile-input bugs found by fuzzing and
 * the hostile battery (docs/fuzzing.md, docs/robustness.md lists each one).
 * Every test feeds the exact input that misbehaved and checks for one clear
 * error instead. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"
#include "data/format.h"
#include "io/hf_config.h"
#include "io/model_folder.h"
#include "model/model.h"
#include "text/jinja.h"
#include "text/tokenizer.h"
#include "train/ds_config.h"
#include "train/job.h"

static char tmpdir[256];

static int setup(void **state) {
    (void)state;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/qtune-hostile-unit-XXXXXX"); /* a new folder, not one named by a reused PID */
    return mkdtemp(tmpdir) ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    qt_rm_rf(tmpdir);
    return 0;
}

static int ds_parse(const char *json, int world, qt_ds_config *c) {
    cJSON *j = cJSON_Parse(json);
    assert_non_null(j);
    int rc = qt_ds_config_parse(j, "ds.json", world, c);
    cJSON_Delete(j);
    return rc;
}

/* train_micro_batch_size_per_gpu 2^40 was accepted and truncated to an int 0
 * ("max_B and max_T must be at least 1 (got 0, 8)"); with accumulation 2^40
 * too, mb * ga * world overflowed int64 (undefined behaviour). */
static void test_ds_batch_sizes_past_int(void **state) {
    (void)state;
    qt_ds_config c;
    assert_int_equal(ds_parse("{\"train_micro_batch_size_per_gpu\": 1099511627776}", 1, &c), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "train_micro_batch_size_per_gpu"));
    assert_int_equal(ds_parse("{\"train_micro_batch_size_per_gpu\": 1099511627776, "
                              "\"gradient_accumulation_steps\": 1099511627776}", 8, &c), QT_EINVAL);
    /* a derived accumulation past the bound is named too */
    assert_int_equal(ds_parse("{\"train_batch_size\": 1099511627776, \"train_micro_batch_size_per_gpu\": 1}", 1, &c),
                     QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "gradient_accumulation_steps"));
    /* the largest accepted values still work */
    assert_int_equal(ds_parse("{\"train_micro_batch_size_per_gpu\": 1048576, \"gradient_accumulation_steps\": 1048576}",
                              4, &c), QT_OK);
    assert_int_equal(c.train_batch_size, (int64_t)1 << 42);
}

/* A --set value of 10,000 '[' was echoed twice into the error: a 20 kB line. */
static void test_set_error_is_short(void **state) {
    (void)state;
    cJSON *root = cJSON_Parse("{\"data\": {\"seq_len\": 8}}");
    char *set = qt_malloc(10100, "set");
    strcpy(set, "data.seq_len=");
    memset(set + 13, '[', 10000);
    set[10013] = 0;
    assert_int_not_equal(qt_job_apply_set(root, set), QT_OK);
    assert_true(strlen(qt_error_message()) < 600);
    assert_non_null(strstr(qt_error_message(), "--set data.seq_len="));
    qt_free(set);
    cJSON_Delete(root);
}

/* A sequence length past max_position_embeddings trained and evaluated
 * silently; now qt_model_load refuses it naming config.json. */
static void test_seq_len_past_max_positions(void **state) {
    (void)state;
    qt_config cfg;
    assert_int_equal(qt_preset("tiny", &cfg), QT_OK);
    cfg.max_position_embeddings = 32;
    char dir[300], path[400];
    snprintf(dir, sizeof dir, "%s/model", tmpdir);
    assert_int_equal(qt_mkdir_p(dir), QT_OK);
    snprintf(path, sizeof path, "%s/config.json", dir);
    assert_int_equal(qt_config_write(&cfg, path), QT_OK);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    assert_int_equal(qt_init_weights_write(&cfg, QT_F32, 1, path), QT_OK);
    qt_model_opts o;
    qt_model_opts_default(&o);
    o.max_B = 1;
    o.max_T = 33;
    qt_model *m = NULL;
    assert_int_equal(qt_model_load(dir, &o, &m), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "max_position_embeddings"));
    assert_non_null(strstr(qt_error_message(), "config.json"));
    o.max_T = 32;
    assert_int_equal(qt_model_load(dir, &o, &m), QT_OK);
    qt_model_free(m);
}

/* Resume/output-folder errors said only "a different job"; they now name the
 * fields. Volatile fields (run length, save cadence, output_dir) are no
 * difference. */
static void test_job_difference_names_fields(void **state) {
    (void)state;
    cJSON *a = cJSON_Parse("{\"model\": \"m\", \"output_dir\": \"o1\", \"lora\": {\"r\": 4, \"target_modules\": [\"q_proj\"]},"
                           " \"train\": {\"max_steps\": 5, \"seed\": 1}, \"deepspeed\": {\"optimizer\": {\"params\": {\"lr\": 0.001}}}}");
    cJSON *b = cJSON_Parse("{\"model\": \"m\", \"output_dir\": \"o2\", \"lora\": {\"r\": 8, \"target_modules\": [\"q_proj\"]},"
                           " \"train\": {\"max_steps\": 9, \"seed\": 1}, \"deepspeed\": {\"optimizer\": {\"params\": {\"lr\": 0.002}}}}");
    char out[512];
    assert_int_equal(qt_job_describe_difference(a, b, out, sizeof out), 2);
    assert_non_null(strstr(out, "lora.r (4 there, 8 here)"));
    assert_non_null(strstr(out, "deepspeed.optimizer.params.lr"));
    assert_null(strstr(out, "max_steps"));
    assert_null(strstr(out, "output_dir"));
    assert_int_equal(qt_job_describe_difference(a, a, out, sizeof out), 0);
    assert_string_equal(out, "");
    /* a tiny buffer is never overrun */
    char small[8];
    assert_int_equal(qt_job_describe_difference(a, b, small, sizeof small), 2);
    assert_true(strlen(small) < sizeof small);
    cJSON_Delete(a);
    cJSON_Delete(b);
}

/* Found by fuzz_jsonl (UBSan): an example whose text encodes to no token, as
 * the first one into an empty buffer, did memset(NULL + 0, ..., 0) on the
 * label mask. */
static void test_empty_text_into_empty_buffer(void **state) {
    (void)state;
    const char *src = getenv("QTUNE_SOURCE_DIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/fuzz/corpus/tokenizer/tiny.json", src ? src : ".");
    bpe_tokenizer *tok = NULL;
    assert_int_equal(bpe_load(path, &tok), QT_OK);
    dl_encode_ctx ctx = {.tok = tok, .mask_prompt = 1, .vocab_limit = bpe_vocab_size(tok)};
    static const char *const lines[] = {
        "{\"text\": \"\"}",
        "{\"instruction\": \"\", \"input\": \"\", \"output\": \"\"}",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"\"}, {\"role\": \"assistant\", \"content\": \"\"}]}",
    };
    static const dl_format fmts[] = {DL_FORMAT_TEXT, DL_FORMAT_ALPACA, DL_FORMAT_MESSAGES};
    for (int i = 0; i < 3; i++) {
        dl_tokbuf b = {0};
        cJSON *j = cJSON_Parse(lines[i]);
        assert_non_null(j);
        int rc = dl_encode_example(&ctx, fmts[i], j, &b);
        assert_true(rc == QT_OK || rc == QT_EFORMAT);
        for (size_t k = 0; k < b.n; k++) assert_true(b.mask[k] <= 1);
        dl_tokbuf_free(&b);
        cJSON_Delete(j);
    }
    bpe_free(tok);
}

/* fuzz_jinja: a number at the very end of a template that is not
 * NUL-terminated was read past the end (strtoll), and a comment left open
 * leaked the token list. Both now parse within the bytes given, or fail with
 * one sentence (under ASan, the bytes end at a guard). */
static void test_jinja_template_ends_inside_a_token(void **state) {
    (void)state;
    static const char *const srcs[] = {"{{ 12", "{{ 1.5e", "{{ x }}{# open", "{% if 1 %}"};
    static const char *const msgs[] = {"not closed", "not closed", "comment is not closed", "not closed"};
    for (int i = 0; i < 4; i++) {
        size_t n = strlen(srcs[i]);
        char *exact = qt_malloc(n, "template"); /* no NUL after the bytes */
        assert_non_null(exact);
        memcpy(exact, srcs[i], n);
        jinja_template *t = NULL;
        assert_int_equal(jinja_parse(exact, n, &t), QT_EFORMAT);
        assert_non_null(strstr(qt_error_message(), msgs[i]));
        qt_error_clear();
        qt_free(exact);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_jinja_template_ends_inside_a_token),
        cmocka_unit_test(test_ds_batch_sizes_past_int),
        cmocka_unit_test(test_set_error_is_short),
        cmocka_unit_test(test_seq_len_past_max_positions),
        cmocka_unit_test(test_job_difference_names_fields),
        cmocka_unit_test(test_empty_text_into_empty_buffer),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
