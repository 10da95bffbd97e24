/* train: report.html as qt_metrics writes it: the embedded metrics.jsonl
 * lines (a long run's thinned to about REPORT_MAX_ROWS, evals and skipped
 * steps all kept), and a line that carries "</script>" kept as data. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"
#include "train/metrics.h"

#define OPEN_TAG "<script id=\"qtune-data\" type=\"application/json\">"

static char *tmpdir(void) {
    char *d = strdup("/tmp/qtune_report_XXXXXX");
    assert_non_null(mkdtemp(d));
    return d;
}

/* the page's embedded object, parsed; *page gets the whole file */
static cJSON *page_data(const char *dir, char **page) {
    char p[4096];
    size_t n;
    assert_int_equal(qt_path_join(p, sizeof p, dir, "report.html"), QT_OK);
    assert_int_equal(qt_read_file(p, 1 << 26, page, &n), QT_OK);
    char *a = strstr(*page, OPEN_TAG);
    assert_non_null(a);
    a += strlen(OPEN_TAG);
    char *b = strstr(a, "</script>"); /* the data's own end: none inside it */
    assert_non_null(b);
    char *text = strndup(a, (size_t)(b - a));
    cJSON *j = cJSON_Parse(text);
    free(text);
    assert_non_null(j);
    return j;
}

static int count(const char *s, const char *what) {
    int n = 0;
    for (const char *p = s; (p = strstr(p, what)); p++) n++;
    return n;
}

static void test_long_run_is_thinned_keeping_evals_and_skips(void **state) {
    (void)state;
    char *d = tmpdir();
    qt_metrics m;
    assert_int_equal(qt_metrics_open(&m, d, -1, "qtune: a </script> title"), QT_OK);
    qt_metrics_set_report(&m, "cpu (2 threads)", 10000, 3 << 20, 2 << 20);
    enum { N = 10000 };
    for (long s = 1; s <= N; s++) {
        qt_step_metrics sm = {.step = s, .loss = 3.0 - s * 1e-4, .lr = 1e-4, .grad_norm = 1, .loss_scale = 1,
                              .skipped = s % 1000 == 7, .tokens = 64, .tokens_per_s = 1000, .elapsed_s = s};
        assert_int_equal(qt_metrics_log_step(&m, &sm), QT_OK);
        if (s % 2000 == 0) assert_int_equal(qt_metrics_log_eval(&m, s, 2.0, 100, s), QT_OK);
    }
    assert_int_equal(qt_metrics_write_report(&m, "running"), QT_OK);
    char *page;
    cJSON *j = page_data(d, &page);
    assert_string_equal(cJSON_GetObjectItem(j, "title")->valuestring, "qtune: a </script> title");
    assert_string_equal(cJSON_GetObjectItem(j, "status")->valuestring, "running");
    assert_int_equal(cJSON_GetObjectItem(j, "rows_total")->valueint, N + 5);
    assert_int_equal(cJSON_GetObjectItem(j, "stride")->valueint, 3); /* 9990 plain lines / 4000, rounded up */
    assert_int_equal(cJSON_GetObjectItem(j, "max_steps")->valueint, N);
    assert_int_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "plan"), "rank_bytes")->valueint, 3 << 20);
    const cJSON *rows = cJSON_GetObjectItem(j, "rows"), *r;
    int n = 0, evals = 0, skips = 0;
    long last = 0;
    cJSON_ArrayForEach(r, rows) {
        n++;
        evals += cJSON_GetObjectItem(r, "eval_loss") != NULL;
        skips += cJSON_IsTrue(cJSON_GetObjectItem(r, "skipped"));
        last = (long)cJSON_GetObjectItem(r, "step")->valuedouble;
    }
    assert_int_equal(evals, 5);
    assert_int_equal(skips, 10);
    assert_int_equal(last, N); /* the newest line is always there */
    assert_int_equal(n, 3330 + 1 + 10 + 5);
    /* the page's own two scripts end; the title's "</script>" does not end one */
    assert_int_equal(count(page, "</script>"), 2);
    cJSON_Delete(j);
    qt_free(page);
    qt_metrics_close(&m);
    qt_rm_rf(d);
    free(d);
}

static void test_resumed_lines_are_data(void **state) {
    (void)state;
    char *d = tmpdir(), p[4096];
    assert_int_equal(qt_path_join(p, sizeof p, d, "metrics.jsonl"), QT_OK);
    const char *old = "{\"step\": 1, \"loss\": 2.5, \"note\": \"</script><script>alert(1)</script>\"}\n"
                      "{\"step\": 2, \"loss\": 2.25, \"skipped\": true} <b>after the object</b>\n"
                      "{\"step\": 2, \"eval_loss\": 2.0}\n"
                      "{\"step\": 3, \"loss\": 2.0}\n";
    assert_int_equal(qt_write_file_atomic(p, old, strlen(old)), QT_OK);
    qt_metrics m;
    assert_int_equal(qt_metrics_open(&m, d, 2, "t"), QT_OK); /* a resume at step 2: step 3 goes */
    assert_int_equal(qt_metrics_write_report(&m, "stopped"), QT_OK);
    char *page;
    cJSON *j = page_data(d, &page);
    const cJSON *rows = cJSON_GetObjectItem(j, "rows");
    assert_int_equal(cJSON_GetArraySize(rows), 3);
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetArrayItem(rows, 0), "note")->valuestring,
                        "</script><script>alert(1)</script>");
    assert_true(cJSON_IsTrue(cJSON_GetObjectItem(cJSON_GetArrayItem(rows, 1), "skipped")));
    assert_string_equal(cJSON_GetObjectItem(j, "status")->valuestring, "stopped");
    assert_null(strstr(page, "<b>"));
    assert_int_equal(count(page, "</script>"), 2);
    cJSON_Delete(j);
    qt_free(page);
    qt_metrics_close(&m);
    qt_rm_rf(d);
    free(d);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_long_run_is_thinned_keeping_evals_and_skips),
        cmocka_unit_test(test_resumed_lines_are_data),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
