/* The job file's "device" (docs/job-file.md): "auto" by default, checked for
 * spelling when the job is read (what the machine has is asked when the run
 * starts), reachable with --set, and outside the fingerprint, so a run may
 * resume on another device. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "core/error.h"
#include "train/job.h"

static int parse(const char *device_json, const char *const *sets, int n, qt_job *j) {
    char json[512];
    snprintf(json, sizeof json, "{\"model\": \"m\", \"output_dir\": \"o\", \"data\": {\"train\": \"t.jsonl\"}%s%s}",
             device_json ? ", \"device\": " : "", device_json ? device_json : "");
    return qt_job_parse(json, ".", "job.json", sets, n, j);
}

static void test_default_and_values(void **state) {
    (void)state;
    qt_job j;
    assert_int_equal(parse(NULL, NULL, 0, &j), QT_OK);
    assert_string_equal(j.device, "auto");
    qt_job_free(&j);
    const char *ok[] = {"\"auto\"", "\"cpu\"", "\"cuda\"", "\"cuda:3\"", "null"};
    const char *want[] = {"auto", "cpu", "cuda", "cuda:3", "auto"};
    for (int i = 0; i < 5; i++) {
        assert_int_equal(parse(ok[i], NULL, 0, &j), QT_OK);
        assert_string_equal(j.device, want[i]);
        qt_job_free(&j);
    }
    assert_int_equal(parse("\"gpu\"", NULL, 0, &j), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "job.json: \"device\": \"gpu\" is not a device"));
    assert_int_equal(parse("0", NULL, 0, &j), QT_EINVAL);
    assert_non_null(strstr(qt_error_message(), "job.json: device must be a non-empty string"));
    const char *set[] = {"device=cuda:1"};
    assert_int_equal(parse(NULL, set, 1, &j), QT_OK);
    assert_string_equal(j.device, "cuda:1");
    qt_job_free(&j);
    const char *bad[] = {"device=tpu"};
    assert_int_equal(parse("\"cpu\"", bad, 1, &j), QT_EINVAL);
}

static void test_not_in_the_fingerprint(void **state) {
    (void)state;
    qt_job a, b;
    assert_int_equal(parse(NULL, NULL, 0, &a), QT_OK);
    assert_int_equal(parse("\"cuda:1\"", NULL, 0, &b), QT_OK);
    assert_true(a.fingerprint == b.fingerprint);
    char diff[256];
    assert_int_equal(qt_job_describe_difference(a.root, b.root, diff, sizeof diff), 0);
    qt_job_free(&a);
    qt_job_free(&b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_default_and_values),
        cmocka_unit_test(test_not_in_the_fingerprint),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
