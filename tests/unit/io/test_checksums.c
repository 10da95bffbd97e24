/* io/checkpoint's checksums (checksums.sha256 in sha256sum's format: known
 * SHA-256 answers, every file listed, a changed byte, a missing file, a
 * damaged line, none at all, files the list leaves out, CRLF, special files,
 * a stop request) and ckpt_previous; io/safetensors'
 * st_first_unused (the tensors no reader asked for). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"

static char g_dir[64];

static int setup(void **state) {
    (void)state;
    strcpy(g_dir, "/tmp/qtune_sums_XXXXXX");
    return mkdtemp(g_dir) ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    return qt_rm_rf(g_dir) == QT_OK ? 0 : -1;
}

static void put(const char *name, const char *text) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    assert_int_equal(qt_write_file_atomic(path, text, strlen(text)), QT_OK);
}

static char *sums_text(void) {
    char path[512], *text;
    snprintf(path, sizeof path, "%s/%s", g_dir, CKPT_SUMS_FILE);
    assert_int_equal(qt_read_file(path, 1 << 20, &text, NULL), QT_OK);
    return text;
}

static void expect_verify_fails(const char *want) {
    int present = 0;
    char unlisted[256];
    qt_error_clear();
    int rc = ckpt_verify_checksums(g_dir, &present, unlisted, sizeof unlisted);
    if (rc != QT_EFORMAT || !strstr(qt_error_message(), want))
        fail_msg("verify: rc %d, message '%s' (want '%s')", rc, qt_error_message(), want);
    assert_int_equal(present, 1);
}

static void test_known_answers_and_format(void **state) {
    (void)state;
    put("b.txt", "abc");
    put("a.txt", "");
    put(".hidden", "not listed");
    assert_int_equal(ckpt_write_checksums(g_dir), QT_OK);
    char *text = sums_text();
    /* FIPS 180-2's "abc" and the empty message, sorted by name, two spaces */
    assert_string_equal(text, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855  a.txt\n"
                              "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad  b.txt\n");
    qt_free(text);
    int present = 0;
    char unlisted[256];
    assert_int_equal(ckpt_verify_checksums(g_dir, &present, unlisted, sizeof unlisted), QT_OK);
    assert_int_equal(present, 1);
    /* written again: the old checksums file is not listed in the new one */
    assert_int_equal(ckpt_write_checksums(g_dir), QT_OK);
    text = sums_text();
    assert_null(strstr(text, CKPT_SUMS_FILE));
    qt_free(text);
}

static void test_changes_are_refused(void **state) {
    (void)state;
    put("w.bin", "0123456789");
    put("s.json", "{}");
    assert_int_equal(ckpt_write_checksums(g_dir), QT_OK);
    put("w.bin", "0123456788"); /* one byte */
    expect_verify_fails("w.bin does not match its SHA-256");
    put("w.bin", "0123456789");
    char path[512];
    snprintf(path, sizeof path, "%s/s.json", g_dir);
    assert_int_equal(unlink(path), 0);
    expect_verify_fails("s.json is missing");
    put(CKPT_SUMS_FILE, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855  ../outside\n");
    expect_verify_fails("line 1");
    put(CKPT_SUMS_FILE, "E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855  w.bin\n");
    expect_verify_fails("line 1");
    put(CKPT_SUMS_FILE, "zz\n");
    expect_verify_fails("line 1");
    /* no checksums file: present 0, not an error (checkpoints of an older qtune) */
    snprintf(path, sizeof path, "%s/%s", g_dir, CKPT_SUMS_FILE);
    assert_int_equal(unlink(path), 0);
    int present = 1;
    char unlisted[256];
    assert_int_equal(ckpt_verify_checksums(g_dir, &present, unlisted, sizeof unlisted), QT_OK);
    assert_int_equal(present, 0);
}

/* A list that leaves files out (emptied, cut short, edited) names them: they
 * are not checked; CRLF line ends read as LF. */
static void test_unlisted_files_are_named(void **state) {
    (void)state;
    put("w.bin", "0123456789");
    put("s.json", "{}");
    assert_int_equal(ckpt_write_checksums(g_dir), QT_OK);
    char crlf[1024] = "", unlisted[256], sums[512], *text;
    snprintf(sums, sizeof sums, "%s/%s", g_dir, CKPT_SUMS_FILE);
    assert_int_equal(qt_read_file(sums, 1 << 20, &text, NULL), QT_OK);
    for (char *p = text, *nl; (nl = strchr(p, '\n')); p = nl + 1)
        snprintf(crlf + strlen(crlf), sizeof crlf - strlen(crlf), "%.*s\r\n", (int)(nl - p), p);
    put(CKPT_SUMS_FILE, crlf);
    int present = 0;
    assert_int_equal(ckpt_verify_checksums(g_dir, &present, unlisted, sizeof unlisted), QT_OK);
    assert_string_equal(unlisted, "");
    char second[256]; /* w.bin's line (sorted after s.json) */
    snprintf(second, sizeof second, "%s", strchr(text, '\n') + 1);
    put(CKPT_SUMS_FILE, second);
    assert_int_equal(ckpt_verify_checksums(g_dir, &present, unlisted, sizeof unlisted), QT_OK);
    assert_string_equal(unlisted, "s.json");
    put(CKPT_SUMS_FILE, "");
    assert_int_equal(ckpt_verify_checksums(g_dir, &present, unlisted, sizeof unlisted), QT_OK);
    assert_int_equal(present, 1);
    assert_non_null(strstr(unlisted, "w.bin"));
    assert_non_null(strstr(unlisted, "s.json"));
    qt_free(text);
}

/* A listed name that is a FIFO or a link to /dev/zero is refused at once
 * (it used to block in open(), or hash forever); a stop request ends the
 * reading of a regular file. */
static void test_special_files_and_stop(void **state) {
    (void)state;
    char path[512], unlisted[256];
    int present;
    static const char zero_line[] = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855  config.json\n";
    snprintf(path, sizeof path, "%s/config.json", g_dir);
    assert_int_equal(mkfifo(path, 0600), 0);
    put(CKPT_SUMS_FILE, zero_line);
    expect_verify_fails("is a FIFO (named pipe), not a regular file");
    assert_int_equal(unlink(path), 0);
    assert_int_equal(symlink("/dev/zero", path), 0);
    expect_verify_fails("is a character device");
    assert_int_equal(unlink(path), 0);
    put("config.json", "");
    volatile sig_atomic_t stop = 1;
    qt_cancel_watch(&stop);
    int rc = ckpt_verify_checksums(g_dir, &present, unlisted, sizeof unlisted);
    qt_cancel_watch(NULL);
    assert_int_equal(rc, QT_EINTERRUPTED);
    assert_int_equal(ckpt_verify_checksums(g_dir, &present, unlisted, sizeof unlisted), QT_OK);
}

static void test_previous_checkpoint(void **state) {
    (void)state;
    const char *names[] = {"checkpoint-2", "checkpoint-5", "checkpoint-9", "checkpoint-7.tmp"};
    for (int i = 0; i < 4; i++) {
        char d[512], f[600];
        snprintf(d, sizeof d, "%s/%s", g_dir, names[i]);
        assert_int_equal(qt_mkdir_p(d), QT_OK);
        snprintf(f, sizeof f, "%s/%s", d, CKPT_STATE_FILE);
        assert_int_equal(qt_write_file_atomic(f, "{}", 2), QT_OK);
    }
    char path[4096];
    long s;
    assert_int_equal(ckpt_previous(g_dir, 9, path, sizeof path, &s), QT_OK);
    assert_int_equal(s, 5);
    assert_non_null(strstr(path, "/checkpoint-5"));
    assert_int_equal(ckpt_previous(g_dir, 5, path, sizeof path, &s), QT_OK);
    assert_int_equal(s, 2);
    assert_int_equal(ckpt_previous(g_dir, 2, path, sizeof path, &s), QT_OK);
    assert_int_equal(s, -1);
    assert_int_equal(ckpt_latest(g_dir, path, sizeof path, &s), QT_OK);
    assert_int_equal(s, 9);
}

static void test_first_unused(void **state) {
    (void)state;
    float a[2] = {1, 2}, b[3] = {3, 4, 5};
    int64_t sa[1] = {2}, sb[1] = {3};
    st_writer *w;
    assert_int_equal(st_writer_new(&w), QT_OK);
    assert_int_equal(st_writer_add(w, "a", QT_F32, 1, sa, a, QT_F32), QT_OK);
    assert_int_equal(st_writer_add(w, "b", QT_F32, 1, sb, b, QT_F32), QT_OK);
    char path[512];
    snprintf(path, sizeof path, "%s/t.safetensors", g_dir);
    assert_int_equal(st_writer_write(w, path), QT_OK);
    st_writer_free(w);
    st_file *f;
    assert_int_equal(st_open(path, &f), QT_OK);
    assert_string_equal(st_first_unused(f)->name, "a");
    const st_tensor *t;
    assert_int_equal(st_expect(f, "a", 1, sa, &t), QT_OK);
    assert_string_equal(st_first_unused(f)->name, "b");
    assert_null(st_find(f, "c"));
    assert_non_null(st_find(f, "b"));
    assert_null(st_first_unused(f));
    st_close(f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_known_answers_and_format, setup, teardown),
        cmocka_unit_test_setup_teardown(test_changes_are_refused, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unlisted_files_are_named, setup, teardown),
        cmocka_unit_test_setup_teardown(test_special_files_and_stop, setup, teardown),
        cmocka_unit_test_setup_teardown(test_previous_checkpoint, setup, teardown),
        cmocka_unit_test_setup_teardown(test_first_unused, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
