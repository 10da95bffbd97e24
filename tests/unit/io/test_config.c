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

/* Qwen3-0.6B's config.json as published (Qwen/Qwen3-0.6B). */
static const char *QWEN3_06B =
    "{\"architectures\":[\"Qwen3ForCausalLM\"],\"attention_bias\":false,\"attention_dropout\":0.0,"
    "\"bos_token_id\":151643,\"eos_token_id\":151645,\"head_dim\":128,\"hidden_act\":\"silu\",\"hidden_size\":1024,"
    "\"initializer_range\":0.02,\"intermediate_size\":3072,\"max_position_embeddings\":40960,"
    "\"max_window_layers\":28,\"model_type\":\"qwen3\",\"num_attention_heads\":16,\"num_hidden_layers\":28,"
    "\"num_key_value_heads\":8,\"rms_norm_eps\":1e-06,\"rope_scaling\":null,\"rope_theta\":1000000,"
    "\"sliding_window\":null,\"tie_word_embeddings\":true,\"torch_dtype\":\"bfloat16\","
    "\"transformers_version\":\"4.51.0\",\"use_cache\":true,\"use_sliding_window\":false,\"vocab_size\":151936}";

/* Qwen-14B's config.json as published (Qwen/Qwen-14B, QWenLMHeadModel). */
static const char *QWEN1_14B =
    "{\"architectures\":[\"QWenLMHeadModel\"],\"auto_map\":{\"AutoConfig\":\"configuration_qwen.QWenConfig\","
    "\"AutoModelForCausalLM\":\"modeling_qwen.QWenLMHeadModel\"},\"attn_dropout_prob\":0.0,\"bf16\":false,"
    "\"emb_dropout_prob\":0.0,\"fp16\":false,\"fp32\":false,\"hidden_size\":5120,\"initializer_range\":0.02,"
    "\"intermediate_size\":27392,\"kv_channels\":128,\"layer_norm_epsilon\":1e-06,\"max_position_embeddings\":8192,"
    "\"model_type\":\"qwen\",\"no_bias\":true,\"num_attention_heads\":40,\"num_hidden_layers\":40,"
    "\"onnx_safe\":null,\"rotary_emb_base\":10000,\"rotary_pct\":1.0,\"scale_attn_weights\":true,"
    "\"seq_length\":2048,\"tie_word_embeddings\":false,\"tokenizer_class\":\"QWenTokenizer\","
    "\"transformers_version\":\"4.32.0\",\"use_cache\":true,\"use_dynamic_ntk\":true,\"use_flash_attn\":\"auto\","
    "\"use_logn_attn\":true,\"vocab_size\":152064}";

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

/* Replaces the first occurrence of from in base with to. */
static char *json_with(const char *base, const char *from, const char *to) {
    static char buf[4096];
    const char *p = strstr(base, from);
    assert_non_null(p);
    snprintf(buf, sizeof buf, "%.*s%s%s", (int)(p - base), base, to, p + strlen(from));
    return buf;
}

static void test_qwen3(void **state) {
    (void)state;
    qt_config c;
    assert_int_equal(qt_config_parse(QWEN3_06B, "q3.json", &c), QT_OK);
    assert_int_equal(c.arch, QT_ARCH_QWEN3);
    assert_int_equal(c.qk_norm, 1);
    assert_int_equal(c.attention_bias, 0);
    assert_int_equal(c.head_dim, 128); /* given on its own: 16 heads x 128 = 2048 != hidden 1024 */
    assert_int_equal(c.num_key_value_heads, 8);
    assert_int_equal(c.tie_word_embeddings, 1);
    assert_int_equal(c.max_position_embeddings, 40960);
    assert_int_equal(c.eos_token_id, 151645);
    /* 596,049,920: the published count (q_norm/k_norm included) */
    assert_int_equal(qt_config_param_count(&c), 596049920);
    assert_string_equal(qt_config_layout(&c)->q_norm, "self_attn.q_norm");
    /* attention_bias is read for Qwen3; without head_dim transformers' Qwen3Config default 128 applies */
    assert_int_equal(qt_config_parse(json_with(QWEN3_06B, "\"attention_bias\":false", "\"attention_bias\":true"),
                                     "q3.json", &c), QT_OK);
    assert_int_equal(c.attention_bias, 1);
    assert_int_equal(qt_config_parse(json_with(QWEN3_06B, "\"head_dim\":128,", ""), "q3.json", &c), QT_OK);
    assert_int_equal(c.head_dim, 128);
    /* the MoE variants are named in the refusal */
    expect_refused(json_with(QWEN3_06B, "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"), QT_EUNSUPPORTED, "Qwen3-MoE");
    assert_int_equal(qt_config_parse(json_with(QWEN3_06B, "\"architectures\":[\"Qwen3ForCausalLM\"],", ""), "q3.json", &c),
                     QT_OK); /* model_type qwen3 alone */
    assert_int_equal(c.arch, QT_ARCH_QWEN3);
}

static void test_qwen1(void **state) {
    (void)state;
    qt_config c;
    assert_int_equal(qt_config_parse(QWEN1_14B, "q1.json", &c), QT_OK);
    assert_int_equal(c.arch, QT_ARCH_QWEN);
    assert_int_equal(c.hidden_size, 5120);
    assert_int_equal(c.intermediate_size, 13696); /* 27392 / 2: w1 and w2 are each half of it */
    assert_int_equal(c.head_dim, 128);            /* kv_channels */
    assert_int_equal(c.num_key_value_heads, 40);
    assert_int_equal(c.attention_bias, 1);        /* c_attn's bias */
    assert_int_equal(c.tie_word_embeddings, 0);
    assert_int_equal(c.seq_length, 2048);
    assert_int_equal(c.max_position_embeddings, 8192);
    assert_int_equal(c.long_context, 1);
    assert_true(c.rope_theta == 10000.0f);
    assert_true(c.rms_norm_eps == 1e-6f);
    assert_int_equal(qt_config_param_count(&c), 14167290880LL);
    const qt_layout *ly = qt_config_layout(&c);
    assert_int_equal(ly->fused_qkv, 1);
    assert_string_equal(ly->lin[4], "mlp.w2"); /* gate: c_proj(w1(x) * silu(w2(x))) */
    assert_string_equal(ly->lin[5], "mlp.w1");
    assert_int_equal(qt_config_parse(json_with(QWEN1_14B, "\"bf16\":false", "\"bf16\":true"), "q1.json", &c), QT_OK);
    assert_int_equal(c.torch_dtype, QT_BF16);
    expect_refused(json_with(QWEN1_14B, "\"rotary_pct\":1.0", "\"rotary_pct\":0.5"), QT_EUNSUPPORTED, "rotary_pct");
    expect_refused(json_with(QWEN1_14B, "\"no_bias\":true", "\"no_bias\":false"), QT_EUNSUPPORTED, "no_bias");
    expect_refused(json_with(QWEN1_14B, "\"kv_channels\":128", "\"kv_channels\":64"), QT_EUNSUPPORTED, "kv_channels");
    expect_refused(json_with(QWEN1_14B, "\"intermediate_size\":27392", "\"intermediate_size\":27391"), QT_EFORMAT,
                   "intermediate_size");
    expect_refused(json_with(QWEN1_14B, "\"kv_channels\":128,", ""), QT_EFORMAT, "kv_channels");
    char two[4096];
    snprintf(two, sizeof two, "%s", json_with(QWEN1_14B, "\"fp16\":false", "\"fp16\":true"));
    memcpy(strstr(two, "\"bf16\":false"), "\"bf16\":true ", 12);
    expect_refused(two, QT_EFORMAT, "'bf16', 'fp16'");
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
    expect_refused(qwen_with("Qwen2ForCausalLM", "Qwen2MoeForCausalLM"), QT_EUNSUPPORTED, "mixture-of-experts");
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
        /* Qwen3: the counts the Hub shows for each repository's safetensors (1.7B's file also stores the
         * tied lm_head, so its 2.03B is not the count of distinct weights and is left out) */
        {"qwen3-0.6b", 596049920},
        {"qwen3-4b", 4022468096},
        {"qwen3-8b", 8190735360},
        {"qwen3-14b", 14768307200},
        {"qwen3-32b", 32762123264},
        {"qwen-14b", 14167290880}, /* Qwen-14B: the same count in either layout */
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
        cmocka_unit_test(test_qwen3),
        cmocka_unit_test(test_qwen1),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_write_round_trip),
        cmocka_unit_test(test_preset_shapes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
