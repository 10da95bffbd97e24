/* Messages and special files (issue 24 items 13 and 16): long words in an
 * error are elided, the out-of-memory advice can be replaced where it does
 * not fit, and qt_open_regular refuses FIFOs and devices without blocking. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"

static void test_long_path_is_elided(void **state) {
    (void)state;
    char path[5100];
    strcpy(path, "/tmp/");
    while (strlen(path) < 5000) strcat(path, "abcdefghij/");
    strcat(path, "train.jsonl");
    assert_int_equal(QT_ERR(QT_EIO, "cannot open the data file %s: File name too long", path), QT_EIO);
    const char *m = qt_error_message();
    assert_true(strlen(m) < 300); /* was 2,047: the whole buffer, cut */
    assert_non_null(strstr(m, "cannot open the data file /tmp/abcdefghij/"));
    assert_non_null(strstr(m, "...")); /* the middle */
    assert_non_null(strstr(m, "/train.jsonl: File name too long")); /* the end and the reason survive */
    /* the context is elided too, and short words are left as they are */
    qt_error_context(QT_EIO, "%s: data.train", path);
    m = qt_error_message();
    assert_true(strlen(m) < 600);
    assert_non_null(strstr(m, "/train.jsonl: data.train: cannot open the data file /tmp/"));
    QT_ERR(QT_EINVAL, "job.json: data.seq_len must be a whole number");
    assert_string_equal(qt_error_message(), "job.json: data.seq_len must be a whole number");
    qt_error_clear();
}

static void test_oom_advice_is_replaced(void **state) {
    (void)state;
    assert_null(qt_calloc(SIZE_MAX, 2, "the tokenizer's vocabulary")); /* overflow: no allocation is tried */
    assert_int_equal(qt_error_code(), QT_ENOMEM);
    assert_non_null(strstr(qt_error_message(), "gradient_checkpointing")); /* the training advice */
    assert_int_equal(qt_error_oom_advice(QT_ENOMEM, QT_TOKENIZER_OOM_ADVICE), QT_ENOMEM);
    const char *m = qt_error_message();
    assert_non_null(strstr(m, "for the tokenizer's vocabulary; loading a tokenizer needs memory"));
    assert_null(strstr(m, "gradient_checkpointing"));
    assert_null(strstr(m, "micro-batch"));
    /* other errors pass unchanged */
    QT_ERR(QT_EFORMAT, "tok.json: not valid JSON; fix it");
    assert_int_equal(qt_error_oom_advice(QT_EFORMAT, QT_TOKENIZER_OOM_ADVICE), QT_EFORMAT);
    assert_string_equal(qt_error_message(), "tok.json: not valid JSON; fix it");
    qt_error_clear();
}

static void expect_refused(const char *path, const char *kind) {
    int fd = 123;
    assert_int_equal(qt_open_regular(path, "the data file", &fd), QT_EINVAL);
    assert_int_equal(fd, -1);
    assert_non_null(strstr(qt_error_message(), path));
    assert_non_null(strstr(qt_error_message(), kind));
    assert_non_null(strstr(qt_error_message(), "not a regular file"));
    char *text = NULL;
    assert_int_not_equal(qt_read_file(path, 1 << 20, &text, NULL), QT_OK);
    assert_null(text);
    qt_error_clear();
}

static void test_special_files_are_refused(void **state) {
    (void)state;
    char dir[] = "/tmp/qt_special_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char fifo[64], reg[64];
    snprintf(fifo, sizeof fifo, "%s/fifo", dir);
    snprintf(reg, sizeof reg, "%s/reg.json", dir);
    assert_int_equal(mkfifo(fifo, 0600), 0);
    expect_refused(fifo, "FIFO"); /* without O_NONBLOCK, open() waits for a writer forever */
    expect_refused("/dev/zero", "character device");
    expect_refused(dir, "a folder");
    FILE *f = fopen(reg, "w");
    fputs("{}", f);
    fclose(f);
    int fd = -1;
    assert_int_equal(qt_open_regular(reg, "the job file", &fd), QT_OK);
    assert_true(fd >= 0);
    assert_false(fcntl(fd, F_GETFL) & O_NONBLOCK);
    close(fd);
    unlink(reg);
    unlink(fifo);
    rmdir(dir);
}

static void test_cancel_watch(void **state) {
    (void)state;
    volatile sig_atomic_t flag = 0;
    assert_false(qt_cancel_requested());
    qt_cancel_watch(&flag);
    assert_false(qt_cancel_requested());
    flag = 1;
    assert_true(qt_cancel_requested());
    qt_cancel_watch(NULL);
    assert_false(qt_cancel_requested());
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_long_path_is_elided),
        cmocka_unit_test(test_oom_advice_is_replaced),
        cmocka_unit_test(test_special_files_are_refused),
        cmocka_unit_test(test_cancel_watch),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
