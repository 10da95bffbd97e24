/* model_folder: the init weights read back through the safetensors reader
 * with the names/shapes/values transformers would build, and the tokenizer
 * files' checks on a small synthetic tokenizer.json. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"
#include "io/hf_config.h"
#include "io/model_folder.h"
#include "io/safetensors.h"

static char g_dir[64];

static int setup(void **state) {
    (void)state;
    strcpy(g_dir, "/tmp/qtune_mf_XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    return qt_rm_rf(g_dir) == QT_OK ? 0 : -1;
}

static void check_init(const char *preset, qt_dtype dtype, int want_count) {
    qt_config c;
    assert_int_equal(qt_preset(preset, &c), QT_OK);
    assert_int_equal(qt_weight_count(&c), want_count);
    char path[256];
    snprintf(path, sizeof path, "%s/model.safetensors", g_dir);
    assert_int_equal(qt_init_weights_write(&c, dtype, 3, path), QT_OK);
    st_file *f;
    assert_int_equal(st_open(path, &f), QT_OK);
    assert_int_equal(st_count(f), want_count);
    int64_t total = 0;
    for (int i = 0; i < want_count; i++) {
        qt_weight_spec w;
        const st_tensor *t;
        assert_int_equal(qt_weight_spec_at(&c, i, &w), QT_OK);
        assert_int_equal(st_expect(f, w.name, w.ndim, w.shape, &t), QT_OK);
        assert_int_equal(t->dtype, dtype);
        total += (int64_t)t->numel;
        float *v = qt_malloc(t->numel * sizeof(float) + 1, "test");
        assert_int_equal(st_read_f32(t, v), QT_OK);
        double s = 0, s2 = 0;
        for (size_t k = 0; k < t->numel; k++) {
            s += v[k];
            s2 += (double)v[k] * v[k];
        }
        double mean = s / (double)t->numel, sd = sqrt(s2 / (double)t->numel - mean * mean);
        if (w.init == QT_INIT_ONES) assert_true(mean == 1.0 && sd < 1e-6);
        else if (w.init == QT_INIT_ZEROS) assert_true(s2 == 0.0);
        else if (t->numel >= 4096) assert_true(fabs(sd - 0.02) < 0.002 && fabs(mean) < 0.002);
        qt_free(v);
    }
    assert_int_equal(total, qt_config_param_count(&c));
    qt_weight_spec w;
    assert_int_equal(qt_weight_spec_at(&c, want_count, &w), QT_EINVAL);
    st_close(f);
}

static void test_init_weights(void **state) {
    (void)state;
    /* Qwen2, tied: embed + 2 layers x 12 + norm */
    check_init("tiny", QT_F32, 1 + 2 * 12 + 1);
    /* Llama, untied, no biases: embed + 2 x 9 + norm + lm_head */
    check_init("tiny-llama", QT_BF16, 1 + 2 * 9 + 2);
    qt_config c;
    qt_weight_spec w;
    assert_int_equal(qt_preset("tiny", &c), QT_OK);
    assert_int_equal(qt_weight_spec_at(&c, 2, &w), QT_OK);
    assert_string_equal(w.name, "model.layers.0.self_attn.q_proj.weight");
    assert_int_equal(w.shape[0], 64);
    assert_int_equal(w.shape[1], 64);
    assert_int_equal(qt_weight_spec_at(&c, 5, &w), QT_OK);
    assert_string_equal(w.name, "model.layers.0.self_attn.k_proj.bias");
    assert_int_equal(w.shape[0], 32);
}

/* A tokenizer.json with n_vocab plain tokens, then <|endoftext|>, <|im_start|>
 * and (optionally) <|im_end|> as added special tokens. */
static void write_tok(const char *path, int n_vocab, int with_im_end) {
    char buf[16384];
    size_t k = (size_t)snprintf(buf, sizeof buf, "{\"model\":{\"type\":\"BPE\",\"vocab\":{");
    for (int i = 0; i < n_vocab; i++) k += (size_t)snprintf(buf + k, sizeof buf - k, "%s\"t%d\":%d", i ? "," : "", i, i);
    k += (size_t)snprintf(buf + k, sizeof buf - k,
                          "},\"merges\":[]},\"added_tokens\":["
                          "{\"id\":%d,\"content\":\"<|endoftext|>\",\"special\":true},"
                          "{\"id\":%d,\"content\":\"<|im_start|>\",\"special\":true}",
                          n_vocab, n_vocab + 1);
    if (with_im_end)
        k += (size_t)snprintf(buf + k, sizeof buf - k, ",{\"id\":%d,\"content\":\"<|im_end|>\",\"special\":true}", n_vocab + 2);
    k += (size_t)snprintf(buf + k, sizeof buf - k, "]}");
    assert_true(k < sizeof buf);
    assert_int_equal(qt_write_file_atomic(path, buf, k), QT_OK);
}

static void test_tokenizer_files(void **state) {
    (void)state;
    char tok[256], out[256], p[300];
    snprintf(tok, sizeof tok, "%s/src-tokenizer.json", g_dir);
    snprintf(out, sizeof out, "%s/model", g_dir);
    assert_int_equal(qt_mkdir_p(out), QT_OK);
    qt_config c;
    assert_int_equal(qt_preset("tiny", &c), QT_OK); /* vocab 512 */

    write_tok(tok, 100, 1);
    qt_tokenizer_ids ids;
    assert_int_equal(qt_tokenizer_ids_read(tok, &ids), QT_OK);
    assert_int_equal(ids.endoftext, 100);
    assert_int_equal(ids.im_start, 101);
    assert_int_equal(ids.im_end, 102);
    assert_int_equal(ids.max_id, 102);
    assert_int_equal(qt_tokenizer_files_write(&c, tok, out), QT_OK);
    snprintf(p, sizeof p, "%s/tokenizer_config.json", out);
    char *txt;
    assert_int_equal(qt_read_file(p, 1 << 20, &txt, NULL), QT_OK);
    cJSON *j = cJSON_Parse(txt);
    qt_free(txt);
    assert_non_null(j);
    assert_string_equal(cJSON_GetObjectItem(j, "eos_token")->valuestring, "<|im_end|>");
    assert_string_equal(cJSON_GetObjectItem(j, "pad_token")->valuestring, "<|endoftext|>");
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(j, "bos_token")));
    assert_string_equal(cJSON_GetObjectItem(j, "chat_template")->valuestring, qt_qwen25_chat_template);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(j, "additional_special_tokens")), 2);
    cJSON_Delete(j);
    snprintf(p, sizeof p, "%s/tokenizer.json", out);
    assert_true(qt_path_exists(p));

    write_tok(tok, 600, 1); /* ids past vocab_size 512 */
    assert_int_equal(qt_tokenizer_files_write(&c, tok, out), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "vocab_size is 512"));
    write_tok(tok, 10, 0); /* no <|im_end|> */
    assert_int_equal(qt_tokenizer_files_write(&c, tok, out), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "<|im_end|>"));
    assert_int_equal(qt_write_file_atomic(tok, "{\"model\":{}}", 12), QT_OK);
    assert_int_equal(qt_tokenizer_ids_read(tok, &ids), QT_EFORMAT);
    assert_non_null(strstr(qt_error_message(), "model.vocab"));
    assert_int_equal(qt_write_file_atomic(tok, "nope", 4), QT_OK);
    assert_int_equal(qt_tokenizer_ids_read(tok, &ids), QT_EFORMAT);

    /* generation_config.json: ids present, nulls omitted */
    c.bos_token_id = 100;
    c.eos_token_id = 102;
    assert_int_equal(qt_generation_config_write(&c, out), QT_OK);
    snprintf(p, sizeof p, "%s/generation_config.json", out);
    assert_int_equal(qt_read_file(p, 1 << 16, &txt, NULL), QT_OK);
    j = cJSON_Parse(txt);
    qt_free(txt);
    assert_int_equal(cJSON_GetObjectItem(j, "eos_token_id")->valueint, 102);
    assert_int_equal(cJSON_GetObjectItem(j, "pad_token_id")->valueint, 100);
    assert_true(cJSON_IsFalse(cJSON_GetObjectItem(j, "do_sample")));
    cJSON_Delete(j);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_init_weights, setup, teardown),
        cmocka_unit_test_setup_teardown(test_tokenizer_files, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
