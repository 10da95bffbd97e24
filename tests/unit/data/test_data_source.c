/* data: pre-tokenized parsing, format detection, malformed lines (each named
 * file:line), the bounded line reader, and the token cache (reuse,
 * invalidation, corruption). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <sys/stat.h>
#include <sys/wait.h>

#include "core/error.h"
#include "core/log.h"
#include "core/mem.h"
#include "data/format.h"
#include "data/lines.h"
#include "data/source.h"
#include "test_data_common.h"

static int setup(void **state) { (void)state; make_tmpdir(); qt_log_set_level(QT_LOG_ERROR); return 0; }
static int teardown(void **state) { (void)state; remove_tmpdir(); return 0; }

static dl_source_opts opts_for(const char *path) {
    dl_source_opts o = {.path = path, .format = DL_FORMAT_AUTO, .no_cache = 1};
    return o;
}

static void test_format_names_and_detect(void **state) {
    (void)state;
    dl_format f;
    assert_int_equal(dl_format_parse("auto", &f), QT_OK); assert_int_equal(f, DL_FORMAT_AUTO);
    assert_int_equal(dl_format_parse("input_ids", &f), QT_OK); assert_int_equal(f, DL_FORMAT_TOKENS);
    assert_int_equal(dl_format_parse("chat", &f), QT_OK); assert_int_equal(f, DL_FORMAT_MESSAGES);
    assert_int_equal(dl_format_parse("sharegpt", &f), QT_OK); assert_int_equal(f, DL_FORMAT_SHAREGPT);
    assert_int_equal(dl_format_parse("prompt_completion", &f), QT_OK);
    assert_int_equal(f, DL_FORMAT_PROMPT_COMPLETION);
    assert_int_equal(dl_format_parse("vicuna", &f), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "sharegpt"));
    static const struct { const char *json; dl_format want; } cases[] = {
        {"{\"text\": \"hi\"}", DL_FORMAT_TEXT},
        {"{\"messages\": []}", DL_FORMAT_MESSAGES},
        {"{\"instruction\": \"a\", \"input\": \"\", \"output\": \"b\"}", DL_FORMAT_ALPACA},
        {"{\"instruction\": \"a\", \"text\": \"b\"}", DL_FORMAT_TEXT},
        {"{\"conversations\": []}", DL_FORMAT_SHAREGPT},
        {"{\"prompt\": \"a\", \"completion\": \"b\"}", DL_FORMAT_PROMPT_COMPLETION},
        {"{\"input_ids\": [1], \"text\": \"b\"}", DL_FORMAT_TOKENS},
        {"{\"prompt\": \"a\"}", DL_FORMAT_AUTO},
        {"[1, 2]", DL_FORMAT_AUTO},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        cJSON *o = cJSON_Parse(cases[i].json);
        assert_non_null(o);
        assert_int_equal(dl_format_detect(o), cases[i].want);
        cJSON_Delete(o);
    }
}

static void test_tokens_and_labels(void **state) {
    (void)state;
    const char *p = write_tmp("tok.jsonl",
                              "{\"input_ids\": [1, 2, 3], \"labels\": [-100, 2, 3]}\n"
                              "\n"
                              "{\"input_ids\": [4, 5], \"labels\": null}\r\n"
                              "{\"input_ids\": [6]}"); /* no final newline */
    dl_source_opts o = opts_for(p);
    dl_source s;
    assert_int_equal(dl_source_open(&o, &s), QT_OK);
    assert_int_equal(s.format, DL_FORMAT_TOKENS);
    assert_int_equal(s.n_examples, 3);
    assert_int_equal(s.n_tokens, 6);
    static const int32_t ids[] = {1, 2, 3, 4, 5, 6};
    static const uint8_t mask[] = {0, 1, 1, 1, 1, 1};
    static const uint64_t off[] = {0, 3, 5, 6};
    assert_memory_equal(s.ids, ids, sizeof ids);
    assert_memory_equal(s.mask, mask, sizeof mask);
    assert_memory_equal(s.offsets, off, sizeof off);
    assert_int_equal(s.cache_hit, 0);
    dl_source_close(&s);
}

/* Opens path (format f, vocab limit v) and expects a failure whose message holds each needle. */
static void expect_error(const char *path, dl_format f, int32_t vocab, const char *n1, const char *n2) {
    dl_source_opts o = opts_for(path);
    o.format = f;
    o.enc.vocab_limit = vocab;
    dl_source s;
    int rc = dl_source_open(&o, &s);
    assert_true(rc < 0);
    const char *msg = qt_error_message();
    if (!strstr(msg, n1) || (n2 && !strstr(msg, n2))) fail_msg("message '%s' lacks '%s' / '%s'", msg, n1, n2 ? n2 : "");
}

static void test_malformed_lines_name_file_and_line(void **state) {
    (void)state;
    const char *p;
    p = write_tmp("bad_json.jsonl", "{\"input_ids\": [1]}\n{\"input_ids\": [1,\n");
    expect_error(p, DL_FORMAT_AUTO, 0, "bad_json.jsonl:2:", "not valid JSON");
    p = write_tmp("trailing.jsonl", "{\"input_ids\": [1]} {\"input_ids\": [2]}\n");
    expect_error(p, DL_FORMAT_AUTO, 0, "trailing.jsonl:1:", "after the JSON object");
    p = write_tmp("nul.jsonl", "{\"input_ids\": [1]}\n{\"input_ids\": [2]}  \n");
    FILE *nf = fopen(p, "r+b"); /* a NUL among the trailing spaces of line 2 */
    assert_non_null(nf);
    assert_int_equal(fseek(nf, 38, SEEK_SET), 0);
    assert_int_equal(fputc(0, nf), 0);
    fclose(nf);
    expect_error(p, DL_FORMAT_AUTO, 0, "nul.jsonl:2:", "NUL byte");
    p = write_tmp("type.jsonl", "{\"input_ids\": [1]}\n\n{\"input_ids\": \"1 2 3\"}\n");
    expect_error(p, DL_FORMAT_AUTO, 0, "type.jsonl:3:", "must be an array");
    p = write_tmp("elem.jsonl", "{\"input_ids\": [1, \"2\"]}\n");
    expect_error(p, DL_FORMAT_AUTO, 0, "elem.jsonl:1:", "input_ids[1] is not a number");
    p = write_tmp("frac.jsonl", "{\"input_ids\": [1, 2.5]}\n");
    expect_error(p, DL_FORMAT_AUTO, 0, "frac.jsonl:1:", "not an integer");
    p = write_tmp("keys.jsonl", "{\"question\": \"a\", \"answer\": \"b\"}\n");
    expect_error(p, DL_FORMAT_AUTO, 0, "keys.jsonl:1:", "cannot tell the data format");
    p = write_tmp("missing.jsonl", "{\"input_ids\": [1]}\n{\"labels\": [1]}\n");
    expect_error(p, DL_FORMAT_TOKENS, 0, "missing.jsonl:2:", "input_ids");
    p = write_tmp("range.jsonl", "{\"input_ids\": [1, 2]}\n{\"input_ids\": [3, 12]}\n");
    expect_error(p, DL_FORMAT_AUTO, 10, "range.jsonl:2:", "input_ids[1] = 12 is out of range [0, 10)");
    p = write_tmp("neg.jsonl", "{\"input_ids\": [-1]}\n");
    expect_error(p, DL_FORMAT_AUTO, 0, "neg.jsonl:1:", "out of range");
    p = write_tmp("lablen.jsonl", "{\"input_ids\": [1, 2], \"labels\": [1]}\n");
    expect_error(p, DL_FORMAT_AUTO, 0, "lablen.jsonl:1:", "must match");
    p = write_tmp("labval.jsonl", "{\"input_ids\": [1, 2], \"labels\": [1, 7]}\n");
    expect_error(p, DL_FORMAT_AUTO, 0, "labval.jsonl:1:", "labels[1] = 7");
    p = write_tmp("emptyids.jsonl", "{\"input_ids\": []}\n");
    expect_error(p, DL_FORMAT_AUTO, 0, "emptyids.jsonl:1:", "empty");
    p = write_tmp("array.jsonl", "[1, 2, 3]\n");
    expect_error(p, DL_FORMAT_AUTO, 0, "array.jsonl:1:", "not a JSON object");
    p = write_tmp("empty.jsonl", "");
    expect_error(p, DL_FORMAT_AUTO, 0, "empty.jsonl", "no examples");
    p = write_tmp("blank.jsonl", "\n  \n\n");
    expect_error(p, DL_FORMAT_AUTO, 0, "blank.jsonl", "no examples");
    p = write_tmp("notext.jsonl", "{\"text\": \"hello\"}\n");
    expect_error(p, DL_FORMAT_AUTO, 0, "notext.jsonl:1:", "needs a tokenizer");
    expect_error("/nonexistent/qtune/x.jsonl", DL_FORMAT_AUTO, 0, "/nonexistent/qtune/x.jsonl", NULL);
}

/* A line far over the cap is refused by the reader without being stored. */
static void test_huge_line_refused(void **state) {
    (void)state;
    char path[512];
    snprintf(path, sizeof path, "%s/huge.jsonl", tdir);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    fputs("{\"input_ids\": [1, 2]}\n{\"input_ids\": [", f);
    for (int i = 0; i < 1 << 20; i++) fputs("7,", f); /* a 2 MiB line */
    fputs("7]}\n{\"input_ids\": [3]}\n", f);
    fclose(f);
    dl_source_opts o = opts_for(path);
    o.max_line_bytes = 1 << 20;
    dl_source s;
    assert_int_equal(dl_source_open(&o, &s), QT_EFORMAT);
    assert_non_null(strstr(qt_error_message(), "huge.jsonl:2:"));
    assert_non_null(strstr(qt_error_message(), "max_line_bytes"));

    /* the reader itself: over-cap line reported, then reading goes on */
    dl_lines r;
    assert_int_equal(dl_lines_open(&r, path, 1 << 20), QT_OK);
    char *line;
    size_t len;
    assert_int_equal(dl_lines_next(&r, &line, &len), 1);
    assert_int_equal(dl_lines_next(&r, &line, &len), QT_EFORMAT);
    assert_true(r.line_cap <= (1u << 20) + 1); /* never grew past the cap */
    assert_int_equal(dl_lines_next(&r, &line, &len), 1);
    assert_string_equal(line, "{\"input_ids\": [3]}");
    assert_int_equal(r.line_no, 3);
    assert_int_equal(dl_lines_next(&r, &line, &len), 0);
    dl_lines_close(&r);

    /* skip_bad_lines: the huge line and a bad one are skipped and counted */
    o.skip_bad_lines = 1;
    assert_int_equal(dl_source_open(&o, &s), QT_OK);
    assert_int_equal(s.n_examples, 2);
    assert_int_equal(s.n_bad_lines, 1);
    dl_source_close(&s);
}

static void test_skip_bad_lines_counts(void **state) {
    (void)state;
    const char *p = write_tmp("mixed.jsonl",
                              "not json\n{\"input_ids\": [1, 2]}\n{\"input_ids\": [99]}\n{\"x\": 1}\n{\"input_ids\": [3]}\n");
    dl_source_opts o = opts_for(p);
    o.enc.vocab_limit = 50;
    dl_source s;
    assert_int_equal(dl_source_open(&o, &s), QT_EFORMAT); /* stops at line 1 by default */
    assert_non_null(strstr(qt_error_message(), "mixed.jsonl:1:"));
    o.skip_bad_lines = 1;
    assert_int_equal(dl_source_open(&o, &s), QT_OK);
    assert_int_equal(s.format, DL_FORMAT_TOKENS); /* detected from the first valid line, line 2 */
    assert_int_equal(s.n_examples, 2);
    assert_int_equal(s.n_bad_lines, 3);
    dl_source_close(&s);
    p = write_tmp("allbad.jsonl", "nope\n[1]\n");
    o.path = p;
    assert_int_equal(dl_source_open(&o, &s), QT_EFORMAT);
    assert_non_null(strstr(qt_error_message(), "no examples"));
}

static void append(const char *path, const char *text) {
    FILE *f = fopen(path, "ab");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

/* Opens with the cache in tdir/cache and returns whether it was a hit. */
static int open_cached(dl_source_opts *o, dl_source *s) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/cache", tdir);
    o->cache_dir = dir;
    o->no_cache = 0;
    assert_int_equal(dl_source_open(o, s), QT_OK);
    return s->cache_hit;
}

static void test_cache_reuse_and_invalidation(void **state) {
    (void)state;
    const char *p = write_tmp("c.jsonl", "{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [4, 5], \"labels\": [-100, 5]}\n");
    dl_source_opts o = opts_for(p);
    dl_source s, t;
    assert_int_equal(open_cached(&o, &s), 0);
    assert_int_equal(s.cache_written, 1);
    assert_true(qt_path_exists(s.cache_path));
    assert_int_equal(open_cached(&o, &t), 1); /* second open: a hit, same content */
    assert_int_equal(t.cache_written, 0);
    assert_int_equal(t.n_examples, s.n_examples);
    assert_int_equal(t.n_tokens, s.n_tokens);
    assert_memory_equal(t.ids, s.ids, s.n_tokens * 4);
    assert_memory_equal(t.mask, s.mask, s.n_tokens);
    assert_memory_equal(t.offsets, s.offsets, (s.n_examples + 1) * 8);
    assert_int_equal(t.format, DL_FORMAT_TOKENS);
    dl_source_close(&t);
    dl_source_close(&s);

    /* each thing the cache depends on forces a rebuild, then it is reused again */
    o.tokenizer_hash = 1234;
    assert_int_equal(open_cached(&o, &s), 0); dl_source_close(&s);
    assert_int_equal(open_cached(&o, &s), 1); dl_source_close(&s);
    o.enc.mask_prompt = 1;
    assert_int_equal(open_cached(&o, &s), 0); dl_source_close(&s);
    o.format = DL_FORMAT_TOKENS;
    assert_int_equal(open_cached(&o, &s), 0); dl_source_close(&s);
    o.enc.vocab_limit = 100;
    assert_int_equal(open_cached(&o, &s), 0); dl_source_close(&s);
    o.skip_bad_lines = 1;
    assert_int_equal(open_cached(&o, &s), 0); dl_source_close(&s);
    assert_int_equal(open_cached(&o, &s), 1); dl_source_close(&s);
    append(p, "{\"input_ids\": [9]}\n"); /* the source changed */
    assert_int_equal(open_cached(&o, &s), 0);
    assert_int_equal(s.n_examples, 3);
    dl_source_close(&s);
    assert_int_equal(open_cached(&o, &s), 1);
    assert_int_equal(s.n_examples, 3);
    dl_source_close(&s);
    /* same size, different bytes */
    p = write_tmp("c.jsonl", "{\"input_ids\": [1, 2, 4]}\n{\"input_ids\": [4, 5], \"labels\": [-100, 5]}\n{\"input_ids\": [9]}\n");
    assert_int_equal(open_cached(&o, &s), 0);
    assert_int_equal(s.ids[2], 4);
    dl_source_close(&s);
}

static void corrupt_at(const char *path, long off, int truncate_to) {
    if (truncate_to >= 0) { assert_int_equal(truncate(path, truncate_to), 0); return; }
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    fseek(f, off, off < 0 ? SEEK_END : SEEK_SET);
    int c = fgetc(f);
    fseek(f, -1, SEEK_CUR);
    fputc(c ^ 0x5a, f);
    fclose(f);
}

static void test_corrupt_cache_rebuilds(void **state) {
    (void)state;
    const char *p = write_tmp("k.jsonl", "{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [4, 5]}\n");
    dl_source_opts o = opts_for(p);
    dl_source s;
    assert_int_equal(open_cached(&o, &s), 0);
    char cache[4096];
    strcpy(cache, s.cache_path);
    dl_source_close(&s);
    struct { long off; int trunc; } cases[] = {
        {-1, -1},  /* last mask byte */
        {-9, -1},  /* an id */
        {130, -1}, /* the example table */
        {40, -1},  /* a header field */
        {0, -1},   /* the magic */
        {0, 100},  /* truncated inside the header */
        {0, 140},  /* truncated inside the data */
        {0, 0},    /* empty */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        corrupt_at(cache, cases[i].off, cases[i].trunc);
        assert_int_equal(open_cached(&o, &s), 0);
        assert_int_equal(s.cache_written, 1);
        assert_int_equal(s.n_tokens, 5);
        assert_int_equal(s.ids[4], 5);
        dl_source_close(&s);
        assert_int_equal(open_cached(&o, &s), 1);
        dl_source_close(&s);
    }
    /* a cache folder that cannot be written: still works, in memory */
    char ro[512];
    snprintf(ro, sizeof ro, "%s/notadir", tdir);
    write_tmp("notadir", "x");
    o.cache_dir = ro;
    o.no_cache = 0;
    assert_int_equal(dl_source_open(&o, &s), QT_OK);
    assert_int_equal(s.cache_written, 0);
    assert_int_equal(s.n_examples, 2);
    dl_source_close(&s);
}

/* Every single-byte change and every truncation of a cache is detected. */
static void test_every_cache_byte_checked(void **state) {
    (void)state;
    const char *p = write_tmp("every.jsonl", "{\"input_ids\": [1, 2, 3], \"labels\": [-100, 2, 3]}\n{\"input_ids\": [4, 5]}\n");
    dl_source_opts o = opts_for(p);
    dl_source s;
    assert_int_equal(open_cached(&o, &s), 0);
    char cache[4096];
    strcpy(cache, s.cache_path);
    dl_source_close(&s);
    char *good;
    size_t n;
    assert_int_equal(qt_read_file(cache, 1 << 20, &good, &n), QT_OK);
    assert_int_equal(n, 120 + 8 * 3 + 4 * 5 + 5);
    for (size_t i = 0; i <= n; i++) {
        for (int trunc = 0; trunc <= 1; trunc++) {
            if (!trunc && i == n) continue;
            char *bad = qt_malloc(n, "a damaged cache");
            memcpy(bad, good, n);
            if (!trunc) bad[i] ^= 0x01;
            FILE *f = fopen(cache, "wb"); /* no fsync: thrown away at the end */
            assert_non_null(f);
            assert_int_equal(fwrite(bad, 1, trunc ? i : n, f), trunc ? i : n);
            fclose(f);
            qt_free(bad);
            if (trunc && i == n) {
                assert_int_equal(open_cached(&o, &s), 1); /* intact */
            } else {
                if (open_cached(&o, &s) != 0) fail_msg("a change at byte %zu (truncated: %d) went unnoticed", i, trunc);
                assert_int_equal(s.n_tokens, 5);
                assert_int_equal(s.mask[0], 0);
            }
            dl_source_close(&s);
        }
    }
    qt_free(good);
}

/* The hashes of a one-example, three-token cache in buf, as source.c computes
 * them (docs/data.md: data hash over offsets, ids, mask; header hash over
 * bytes 0..111), into *h (a copy of buf's header). */
static void rehash(const char *buf, dl_cache_header *h) {
    memcpy(h, buf, sizeof *h);
    uint64_t dh = dl_hash_bytes(buf + 120, 16, 0x64617461ull);
    dh = dl_hash_bytes(buf + 136, 12, dh);
    h->data_hash = dl_hash_bytes(buf + 148, 3, dh);
    h->header_hash = dl_hash_bytes(h, 112, 0x686561646572ull);
}

/* A cache whose hashes match but whose ids are out of range (a crafted file)
 * is still refused: ids index the embedding table. */
static void test_cache_ids_checked_even_with_matching_hashes(void **state) {
    (void)state;
    const char *p = write_tmp("crafted.jsonl", "{\"input_ids\": [1, 2, 3]}\n");
    dl_source_opts o = opts_for(p);
    o.enc.vocab_limit = 100;
    dl_source s;
    assert_int_equal(open_cached(&o, &s), 0);
    char cache[4096];
    strcpy(cache, s.cache_path);
    dl_source_close(&s);
    char *buf;
    size_t n;
    assert_int_equal(qt_read_file(cache, 1 << 20, &buf, &n), QT_OK);
    dl_cache_header h, again;
    memcpy(&h, buf, sizeof h);
    assert_int_equal(n, 120 + 16 + 12 + 3);
    rehash(buf, &again);
    assert_true(again.data_hash == h.data_hash && again.header_hash == h.header_hash); /* the test hashes as source.c does */
    int32_t bad = 1000000;
    memcpy(buf + 120 + 16 + 4, &bad, 4); /* ids[1] */
    rehash(buf, &h);
    memcpy(buf, &h, sizeof h);
    FILE *f = fopen(cache, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(buf, 1, n, f), n);
    fclose(f);
    assert_int_equal(open_cached(&o, &s), 0); /* refused, rebuilt */
    assert_int_equal(s.ids[1], 2);
    dl_source_close(&s);
    qt_free(buf);
}

static void test_default_cache_dir(void **state) {
    (void)state;
    char out[4096];
    assert_int_equal(dl_cache_path("/data/sets/train.jsonl", NULL, out, sizeof out), QT_OK);
    assert_true(!strncmp(out, "/data/sets/.qtune-cache/train.jsonl.", 36));
    assert_int_equal(dl_cache_path("/data/sets/train.jsonl", "/scratch/c", out, sizeof out), QT_OK);
    assert_true(!strncmp(out, "/scratch/c/train.jsonl.", 23));
    char other[4096];
    assert_int_equal(dl_cache_path("/data/other/train.jsonl", "/scratch/c", other, sizeof other), QT_OK);
    assert_string_not_equal(out, other);
}

/* Ranges cut at any byte partition the lines: each line read exactly once. */
static void test_line_ranges_partition(void **state) {
    (void)state;
    const char *text = "a\n\nbcd\r\nefgh\nij\n\n\nklmno\np";
    const char *p = write_tmp("ranges.txt", text);
    const char *want[] = {"a", "", "bcd", "efgh", "ij", "", "", "klmno", "p"};
    size_t size = strlen(text);
    for (size_t cut = 0; cut <= size; cut++) {
        int k = 0;
        for (int part = 0; part < 2; part++) {
            dl_lines r;
            assert_int_equal(dl_lines_open_range(&r, p, 64, part ? cut : 0, part ? UINT64_MAX : cut), QT_OK);
            char *line;
            size_t len;
            int got;
            while ((got = dl_lines_next(&r, &line, &len)) == 1) {
                assert_true(k < 9);
                assert_string_equal(line, want[k]);
                k++;
            }
            assert_int_equal(got, 0);
            dl_lines_close(&r);
        }
        assert_int_equal(k, 9);
    }
}

/* n lines of varied length; line `bad` (1-based, 0 = none) is not JSON. */
static const char *write_many(const char *name, int n, int bad) {
    size_t cap = (size_t)n * 200 + 1;
    char *buf = malloc(cap), *w = buf;
    for (int i = 1; i <= n; i++) {
        if (i == bad) { w += sprintf(w, "{\"input_ids\": [1, 2\n"); continue; }
        if (i % 17 == 0) { w += sprintf(w, "\n"); continue; } /* blank */
        w += sprintf(w, "{\"input_ids\": [");
        for (int j = 0; j < 1 + (i * 13) % 29; j++) w += sprintf(w, "%s%d", j ? ", " : "", (i * 31 + j) % 1000);
        w += sprintf(w, "]%s}\n", i % 3 ? "" : ", \"labels\": null");
    }
    const char *p = write_tmp(name, buf);
    free(buf);
    return p;
}

static void test_parallel_build_matches_serial(void **state) {
    (void)state;
    const char *p = write_many("many.jsonl", 400, 0);
    dl_source_opts o = opts_for(p);
    dl_source a, b;
    assert_int_equal(dl_source_open(&o, &a), QT_OK);
    o.n_threads = 5;
    o.chunk_bytes = 1000; /* about 30 ranges' worth: capped at 5 threads */
    assert_int_equal(dl_source_open(&o, &b), QT_OK);
    assert_int_equal(a.build_threads, 1);
    assert_int_equal(b.build_threads, 5);
    assert_int_equal(a.n_examples, b.n_examples);
    assert_int_equal(a.n_tokens, b.n_tokens);
    assert_int_equal(b.format, DL_FORMAT_TOKENS);
    assert_memory_equal(a.ids, b.ids, a.n_tokens * 4);
    assert_memory_equal(a.mask, b.mask, a.n_tokens);
    assert_memory_equal(a.offsets, b.offsets, (a.n_examples + 1) * 8);
    dl_source_close(&a);
    dl_source_close(&b);

    /* a bad line late in the file is named with its file-wide line number */
    p = write_many("many_bad.jsonl", 400, 333);
    for (int threads = 1; threads <= 4; threads += 3) {
        o = opts_for(p);
        o.n_threads = threads;
        o.chunk_bytes = 1000;
        assert_int_equal(dl_source_open(&o, &a), QT_EFORMAT);
        if (!strstr(qt_error_message(), "many_bad.jsonl:333: not valid JSON"))
            fail_msg("%d threads: %s", threads, qt_error_message());
        o.skip_bad_lines = 1;
        assert_int_equal(dl_source_open(&o, &a), QT_OK);
        assert_int_equal(a.n_bad_lines, 1);
        assert_int_equal(a.build_threads, threads);
        assert_int_equal(a.n_examples, 400 - 400 / 17 - 1);
        dl_source_close(&a);
    }
}

/* Processes that open one file at once (the ranks of a job on one host):
 * one builds the cache, the others wait for it and map it. */
static void test_concurrent_builders_build_once(void **state) {
    (void)state;
    const char *p = write_many("shared.jsonl", 20000, 0);
    char dir[512];
    snprintf(dir, sizeof dir, "%s/shared-cache", tdir);
    int go[2];
    assert_int_equal(pipe(go), 0);
    enum { N = 3 };
    pid_t pid[N];
    for (int k = 0; k < N; k++) {
        pid[k] = fork();
        assert_true(pid[k] >= 0);
        if (pid[k] == 0) {
            char c;
            close(go[1]);
            if (read(go[0], &c, 1) != 0) _exit(100); /* wait until the parent closes the pipe */
            dl_source_opts o = opts_for(p);
            o.cache_dir = dir;
            o.no_cache = 0;
            dl_source s;
            if (dl_source_open(&o, &s) != QT_OK || s.n_examples != 20000 - 20000 / 17) _exit(101);
            int code = s.cache_written + 2 * s.cache_hit;
            dl_source_close(&s);
            _exit(code);
        }
    }
    close(go[0]);
    close(go[1]); /* all children start together */
    int written = 0, hits = 0;
    for (int k = 0; k < N; k++) {
        int st;
        assert_int_equal(waitpid(pid[k], &st, 0), pid[k]);
        assert_true(WIFEXITED(st));
        int code = WEXITSTATUS(st);
        assert_true(code == 1 || code == 2);
        written += code == 1;
        hits += code == 2;
    }
    assert_int_equal(written, 1);
    assert_int_equal(hits, N - 1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_format_names_and_detect),
        cmocka_unit_test(test_tokens_and_labels),
        cmocka_unit_test(test_malformed_lines_name_file_and_line),
        cmocka_unit_test(test_huge_line_refused),
        cmocka_unit_test(test_skip_bad_lines_counts),
        cmocka_unit_test(test_cache_reuse_and_invalidation),
        cmocka_unit_test(test_corrupt_cache_rebuilds),
        cmocka_unit_test(test_every_cache_byte_checked),
        cmocka_unit_test(test_concurrent_builders_build_once),
        cmocka_unit_test(test_cache_ids_checked_even_with_matching_hashes),
        cmocka_unit_test(test_default_cache_dir),
        cmocka_unit_test(test_line_ranges_partition),
        cmocka_unit_test(test_parallel_build_matches_serial),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
