/* config.json: Qwen2 and Llama configs with transformers' defaults, every
 * refusal naming its field, the writer round-tripping every preset. */
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
#include "core/mem.h"
#include "io/hf_config.h"

/* Qwen2.5-0.5B's config.json as published. */
static const char *QWEN25_05B =
    "{\"architectures\":[\"Qwen2ForCausalLM\"],\"attention_dropout\":0.0,\"bos_token_id\":151643,"
    "\"eos_token_id\":151643,\"hidden_act\":\"silu\",\"hidden_size\":896,\"initializer_range\":0.02,"
    "\"intermediate_size\":4864,\"max_position_embeddings\":32768,\"max_window_layers\":24,\"model_type\":\"qwen2\","
    "\"num_attention_heads\":14,\"num_hidden_layers\":24,\"num_key_value_heads\":2,\"rms_norm_eps\":1e-06,"
    "\"rope_theta\":1000000.0,\"sliding_window\":32768,\"tie_word_embeddings\":true,\"torch_dtype\":\"bfloat16\","
    "\"transformers_version\":\"4.40.1\",\"use_cache\":true,\"use_sliding_window\":false,\"vocab_size\":151936}";

static void expect_refused(const char *json, int code, const char *want) {
    qt_config c;
    qt_error_clear();
    int rc = qt_config_parse(json, "cfg.json", &c);
    if (rc != code || !strstr(qt_error_message(), want) || !strstr(qt_error_message(), "cfg.json"))
        fail_msg("rc %d (want %d), message '%s' (want '%s')", rc, code, qt_error_message(), want);
}

/* Replaces the first occurrence of from in QWEN25_05B with to. */
static char *qwen_with(const char *from, const char *to) {
    static char buf[4096];
    const char *p = strstr(QWEN25_05B, from);
    assert_non_null(p);
    snprintf(buf, sizeof buf, "%.*s%s%s", (int)(p - QWEN25_05B), QWEN25_05B, to, p + strlen(from));
    return buf;
}

static void test_qwen2(void **state) {
    (void)state;
    qt_config c;
    assert_int_equal(qt_config_parse(QWEN25_05B, "q.json", &c), QT_OK);
    assert_int_equal(c.arch, QT_ARCH_QWEN2);
    assert_int_equal(c.vocab_size, 151936);
    assert_int_equal(c.hidden_size, 896);
    assert_int_equal(c.intermediate_size, 4864);
    assert_int_equal(c.num_hidden_layers, 24);
    assert_int_equal(c.num_attention_heads, 14);
    assert_int_equal(c.num_key_value_heads, 2);
    assert_int_equal(c.head_dim, 64);
    assert_true(c.rms_norm_eps == 1e-6f);
    assert_true(c.rope_theta == 1e6f);
    assert_int_equal(c.max_position_embeddings, 32768);
    assert_int_equal(c.tie_word_embeddings, 1);
    assert_int_equal(c.attention_bias, 1);
    assert_int_equal(c.torch_dtype, QT_BF16);
    assert_int_equal(c.bos_token_id, 151643);
    assert_int_equal(c.eos_token_id, 151643);
    /* The sum of the tensor sizes this shape implies (counted separately in Python). */
    assert_int_equal(qt_config_param_count(&c), 494032768);

    /* model_type alone identifies it; null rope_scaling is fine; sliding
     * window on but covering no layer (max_window_layers >= layers) is fine. */
    assert_int_equal(qt_config_parse("{\"model_type\":\"qwen2\",\"vocab_size\":10,\"hidden_size\":8,"
                                     "\"intermediate_size\":16,\"num_hidden_layers\":2,\"num_attention_heads\":2,"
                                     "\"rope_scaling\":null,\"use_sliding_window\":true,\"max_window_layers\":2}",
                                     "m.json", &c),
                     QT_OK);
    assert_int_equal(c.num_key_value_heads, 2); /* defaults to heads */
    assert_int_equal(c.tie_word_embeddings, 0); /* Qwen2Config default */
    assert_true(c.rope_theta == 10000.0f);
    assert_int_equal(c.torch_dtype, QT_F32);
    assert_int_equal(c.bos_token_id, -1);
}

static void test_llama(void **state) {
    (void)state;
    qt_config c;
    const char *j = "{\"architectures\":[\"LlamaForCausalLM\"],\"model_type\":\"llama\",\"vocab_size\":32000,"
                    "\"hidden_size\":64,\"intermediate_size\":176,\"num_hidden_layers\":2,\"num_attention_heads\":4,"
                    "\"rms_norm_eps\":1e-05,\"bos_token_id\":1,\"eos_token_id\":[2,3],\"torch_dtype\":\"float16\","
                    "\"pretraining_tp\":1,\"mlp_bias\":false}";
    assert_int_equal(qt_config_parse(j, "l.json", &c), QT_OK);
    assert_int_equal(c.arch, QT_ARCH_LLAMA);
    assert_int_equal(c.num_key_value_heads, 4);
    assert_int_equal(c.head_dim, 16);
    assert_int_equal(c.attention_bias, 0);
    assert_int_equal(c.tie_word_embeddings, 0);
    assert_int_equal(c.max_position_embeddings, 2048); /* LlamaConfig default */
    assert_true(c.rms_norm_eps == 1e-5f);
    assert_int_equal(c.eos_token_id, 2);
    assert_int_equal(c.torch_dtype, QT_F16);
    /* An explicit head_dim overrides hidden / heads, and needs no divisibility. */
    const char *hd = "{\"model_type\":\"llama\",\"vocab_size\":10,\"hidden_size\":60,\"intermediate_size\":16,"
                     "\"num_hidden_layers\":1,\"num_attention_heads\":8,\"num_key_value_heads\":2,\"head_dim\":16}";
    assert_int_equal(qt_config_parse(hd, "h.json", &c), QT_OK);
    assert_int_equal(c.head_dim, 16);
    expect_refused("{\"model_type\":\"llama\",\"vocab_size\":10,\"hidden_size\":8,\"intermediate_size\":16,"
                   "\"num_hidden_layers\":1,\"num_attention_heads\":2,\"attention_bias\":true}",
                   QT_EUNSUPPORTED, "attention_bias");
    expect_refused("{\"model_type\":\"llama\",\"vocab_size\":10,\"hidden_size\":8,\"intermediate_size\":16,"
                   "\"num_hidden_layers\":1,\"num_attention_heads\":2,\"mlp_bias\":true}",
                   QT_EUNSUPPORTED, "mlp_bias");
    expect_refused("{\"model_type\":\"llama\",\"vocab_size\":10,\"hidden_size\":8,\"intermediate_size\":16,"
                   "\"num_hidden_layers\":1,\"num_attention_heads\":2,"
                   "\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8.0}}",
                   QT_EFORMAT, "rope_scaling llama3 needs low_freq_factor < high_freq_factor");
}

static void test_refusals(void **state) {
    (void)state;
    /* rope_scaling: linear, dynamic, yarn, llama3 are read (tests/ref/test_ref_rope.py holds their
     * numbers); another type is refused without telling the user to delete the field */
    qt_config c;
    assert_int_equal(qt_config_parse(qwen_with("\"rope_theta\"", "\"rope_scaling\":{\"type\":\"yarn\",\"factor\":4.0,"
                                                                 "\"original_max_position_embeddings\":32768},\"rope_theta\""),
                                     "cfg.json", &c),
                     QT_OK);
    assert_int_equal(c.rope_scaling.type, QT_ROPE_YARN);
    assert_true(c.rope_scaling.factor == 4.0f && c.rope_scaling.original_max_position_embeddings == 32768);
    assert_true(c.rope_scaling.beta_fast == 32.0f && c.rope_scaling.beta_slow == 1.0f && c.rope_scaling.truncate);
    {   /* written configs keep it (init, merge, final/): it round-trips */
        char dir[] = "/tmp/qtune_rope_XXXXXX";
        assert_non_null(mkdtemp(dir));
        char path[256];
        snprintf(path, sizeof path, "%s/config.json", dir);
        qt_config d;
        c.rope_scaling.attention_factor = 1.25f;
        assert_int_equal(qt_config_write(&c, path), QT_OK);
        assert_int_equal(qt_config_load(dir, &d), QT_OK);
        assert_memory_equal(&c.rope_scaling, &d.rope_scaling, sizeof c.rope_scaling);
        assert_int_equal(qt_config_parse(qwen_with("\"rope_theta\"", "\"rope_scaling\":{\"rope_type\":\"llama3\","
                                                   "\"factor\":8,\"low_freq_factor\":1,\"high_freq_factor\":4,"
                                                   "\"original_max_position_embeddings\":8192},\"rope_theta\""),
                                         "cfg.json", &c),
                         QT_OK);
        assert_int_equal(qt_config_write(&c, path), QT_OK);
        assert_int_equal(qt_config_load(dir, &d), QT_OK);
        assert_memory_equal(&c.rope_scaling, &d.rope_scaling, sizeof c.rope_scaling);
        unlink(path);
        rmdir(dir);
    }
    expect_refused(qwen_with("\"rope_theta\"", "\"rope_scaling\":{\"rope_type\":\"longrope\",\"factor\":4.0},\"rope_theta\""),
                   QT_EUNSUPPORTED, "rope_scaling type 'longrope' is not supported yet");
    assert_null(strstr(qt_error_message(), "null"));
    expect_refused(qwen_with("\"rope_theta\"", "\"rope_scaling\":{\"rope_type\":\"linear\"},\"rope_theta\""),
                   QT_EFORMAT, "needs a positive 'factor'");
    expect_refused(qwen_with("\"rope_theta\"", "\"rope_scaling\":1.0,\"rope_theta\""), QT_EFORMAT, "rope_scaling");
    /* Qwen2.5-Instruct ships max_window_layers 21 of 24: with the window on,
     * layers 21..23 would use it. */
    char sw[4096];
    snprintf(sw, sizeof sw, "%s", qwen_with("\"use_sliding_window\":false", "\"use_sliding_window\":true"));
    char *mw = strstr(sw, "\"max_window_layers\":24");
    assert_non_null(mw);
    memcpy(mw, "\"max_window_layers\":21", 22);
    expect_refused(sw, QT_EUNSUPPORTED, "use_sliding_window");
    expect_refused(qwen_with("\"max_window_layers\":24", "\"layer_types\":[\"full_attention\",\"sliding_attention\"]"),
                   QT_EUNSUPPORTED, "layer_types");
    expect_refused(qwen_with("\"silu\"", "\"gelu\""), QT_EUNSUPPORTED, "hidden_act");
    expect_refused(qwen_with("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"), QT_EUNSUPPORTED, "Qwen2MoeForCausalLM");
    expect_refused(qwen_with("Qwen2ForCausalLM", "QWenLMHeadModel"), QT_EUNSUPPORTED, "QWenLMHeadModel");
    expect_refused("{\"model_type\":\"gpt2\"}", QT_EUNSUPPORTED, "gpt2");
    expect_refused("{\"vocab_size\":10}", QT_EFORMAT, "architectures");
    /* broken JSON */
    expect_refused("{\"architectures\":[\"Qwen2ForCausalLM\"], \"hidden_size\": ", QT_EFORMAT, "not valid JSON");
    expect_refused("[1,2]", QT_EFORMAT, "not valid JSON");
    expect_refused("", QT_EFORMAT, "not valid JSON");
    /* missing and bad fields */
    expect_refused(qwen_with("\"hidden_size\":896,", ""), QT_EFORMAT, "'hidden_size' is missing");
    expect_refused(qwen_with("\"vocab_size\":151936", "\"vocab_sizes\":151936"), QT_EFORMAT, "'vocab_size' is missing");
    expect_refused(qwen_with("\"num_hidden_layers\":24", "\"num_hidden_layers\":0"), QT_EFORMAT, "num_hidden_layers");
    expect_refused(qwen_with("\"intermediate_size\":4864", "\"intermediate_size\":-5"), QT_EFORMAT, "intermediate_size");
    expect_refused(qwen_with("\"hidden_size\":896", "\"hidden_size\":\"896\""), QT_EFORMAT, "hidden_size");
    expect_refused(qwen_with("\"hidden_size\":896", "\"hidden_size\":896.5"), QT_EFORMAT, "hidden_size");
    expect_refused(qwen_with("\"hidden_size\":896", "\"hidden_size\":1e300"), QT_EFORMAT, "hidden_size");
    expect_refused(qwen_with("\"rms_norm_eps\":1e-06", "\"rms_norm_eps\":-1"), QT_EFORMAT, "rms_norm_eps");
    expect_refused(qwen_with("\"tie_word_embeddings\":true", "\"tie_word_embeddings\":1"), QT_EFORMAT,
                   "tie_word_embeddings");
    /* divisibility */
    expect_refused(qwen_with("\"hidden_size\":896", "\"hidden_size\":900"), QT_EFORMAT, "not divisible by num_attention_heads");
    expect_refused(qwen_with("\"num_key_value_heads\":2", "\"num_key_value_heads\":3"), QT_EFORMAT,
                   "not divisible by num_key_value_heads");
    expect_refused(qwen_with("\"num_key_value_heads\":2", "\"num_key_value_heads\":0"), QT_EFORMAT, "num_key_value_heads");
    expect_refused(qwen_with("\"eos_token_id\":151643", "\"eos_token_id\":\"x\""), QT_EFORMAT, "eos_token_id");
}

static void test_write_round_trip(void **state) {
    (void)state;
    char dir[] = "/tmp/qtune_cfg_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path[256];
    snprintf(path, sizeof path, "%s/config.json", dir);
    assert_true(qt_preset_count() >= 12);
    for (int i = 0; i < qt_preset_count(); i++) {
        qt_config a, b;
        assert_int_equal(qt_preset(qt_preset_name(i), &a), QT_OK);
        assert_non_null(qt_preset_summary(i));
        assert_int_equal(qt_config_write(&a, path), QT_OK);
        assert_int_equal(qt_config_load(dir, &b), QT_OK); /* folder form */
        assert_memory_equal(&a, &b, sizeof a);
    }
    /* Case-insensitive, and an unknown name lists the real ones. */
    qt_config c;
    assert_int_equal(qt_preset("Qwen2.5-7B", &c), QT_OK);
    assert_int_equal(c.hidden_size, 3584);
    assert_int_equal(qt_preset("qwen9-1b", &c), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "qwen2.5-0.5b"));
    /* The written text carries what transformers needs. */
    assert_int_equal(qt_preset("qwen2.5-0.5b", &c), QT_OK);
    assert_int_equal(qt_config_write(&c, path), QT_OK);
    char *txt;
    assert_int_equal(qt_read_file(path, 1 << 16, &txt, NULL), QT_OK);
    const char *want[] = {"\"Qwen2ForCausalLM\"", "\"model_type\": \"qwen2\"", "\"rms_norm_eps\": 1e-06",
                          "\"rope_theta\": 1000000.0", "\"rope_scaling\": null", "\"use_sliding_window\": false",
                          "\"hidden_act\": \"silu\"", "\"initializer_range\": 0.02", "\"torch_dtype\": \"bfloat16\"",
                          "\"transformers_version\"", "\"tie_word_embeddings\": true", "\"max_window_layers\": 24",
                          "\"bos_token_id\": 151643"};
    for (size_t k = 0; k < sizeof want / sizeof want[0]; k++)
        if (!strstr(txt, want[k])) fail_msg("config.json lacks %s:\n%s", want[k], txt);
    assert_null(strstr(txt, "head_dim")); /* Qwen2Config before 4.48 has none */
    qt_free(txt);
    assert_int_equal(qt_config_load("/nonexistent/config.json", &c), QT_EIO);
    assert_int_equal(qt_rm_rf(dir), QT_OK);
}

/* Parameter counts of the preset shapes: sums of tensor sizes computed
 * independently (Python, from the same shapes); they round to the sizes the
 * model names carry (0.49B, 1.54B, 3.09B, 7.62B, 14.8B, 32.8B, 72.7B). */
static void test_preset_shapes(void **state) {
    (void)state;
    struct { const char *name; int64_t params; } known[] = {
        {"qwen2.5-0.5b", 494032768},
        {"qwen2.5-1.5b", 1543714304},
        {"qwen2.5-3b", 3085938688},
        {"qwen2.5-7b", 7615616512},
        {"qwen2.5-14b", 14770033664},
        {"qwen2.5-32b", 32763876352},
        {"qwen2.5-72b", 72706203648},
    };
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++) {
        qt_config c;
        assert_int_equal(qt_preset(known[i].name, &c), QT_OK);
        int64_t n = qt_config_param_count(&c);
        if (n != known[i].params) fail_msg("%s: %lld params, want %lld", known[i].name, (long long)n, (long long)known[i].params);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_qwen2),
        cmocka_unit_test(test_llama),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_write_round_trip),
        cmocka_unit_test(test_preset_shapes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
