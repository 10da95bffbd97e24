/* report.html: the compiled-in page with the run's data put in its place. */
#include "train/report.h"

#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"
#include "core/strbuf.h"

#include <cjson/cJSON.h>
#include <string.h>
#include <time.h>

/* src/train/report.html, compiled in by src/train/CMakeLists.txt */
extern const unsigned char qt_report_page[];
extern const size_t qt_report_page_len;

#define DATA_MARK "QTUNE_DATA</script>"

/* the header object as JSON text without its closing brace, '<' escaped */
static int header_json(const qt_report_info *in, qt_strbuf *b) {
    cJSON *j = cJSON_CreateObject();
    int ok = j && cJSON_AddStringToObject(j, "title", in->title ? in->title : "qtune") &&
             cJSON_AddStringToObject(j, "status", in->status ? in->status : "running") &&
             (!in->device || cJSON_AddStringToObject(j, "device", in->device)) &&
             cJSON_AddNumberToObject(j, "written", (double)time(NULL)) &&
             cJSON_AddNumberToObject(j, "refresh_s", in->refresh_s) &&
             cJSON_AddNumberToObject(j, "max_steps", (double)in->max_steps) &&
             cJSON_AddNumberToObject(j, "rows_total", (double)in->rows_total) &&
             cJSON_AddNumberToObject(j, "stride", (double)(in->stride > 0 ? in->stride : 1));
    if (ok && in->plan_device_bytes) {
        cJSON *p = cJSON_AddObjectToObject(j, "plan");
        ok = p && cJSON_AddNumberToObject(p, "rank_bytes", (double)in->plan_rank_bytes) &&
             cJSON_AddNumberToObject(p, "device_bytes", (double)in->plan_device_bytes);
    }
    char *s = ok ? cJSON_PrintUnformatted(j) : NULL;
    cJSON_Delete(j);
    if (!s) return QT_ERR(QT_ENOMEM, "out of memory writing report.html");
    int rc = QT_OK;
    size_t n = strlen(s) - 1; /* without the closing brace */
    for (size_t i = 0, k = 0; rc == QT_OK && i <= n; i++)
        if (i == n || s[i] == '<') {
            rc = qt_strbuf_put(b, s + k, i - k);
            if (rc == QT_OK && i < n) rc = qt_strbuf_put(b, "\\u003c", 6);
            k = i + 1;
        }
    cJSON_free(s);
    return rc;
}

int qt_report_html_write(const char *path, const qt_report_info *info, const char *rows, size_t rows_len) {
    const char *page = (const char *)qt_report_page, *mark = strstr(page, DATA_MARK);
    if (!mark) return QT_ERR(QT_EINVAL, "report.html's page has no data mark (a build error)");
    qt_strbuf b = {0};
    int rc = qt_strbuf_put(&b, page, (size_t)(mark - page));
    if (rc == QT_OK) rc = header_json(info, &b);
    if (rc == QT_OK) rc = qt_strbuf_put(&b, ",\"rows\":[", 9);
    if (rc == QT_OK && rows_len) rc = qt_strbuf_put(&b, rows, rows_len);
    if (rc == QT_OK) rc = qt_strbuf_put(&b, "]}", 2);
    mark += strlen("QTUNE_DATA");
    if (rc == QT_OK) rc = qt_strbuf_put(&b, mark, qt_report_page_len - (size_t)(mark - page));
    if (rc == QT_OK) rc = qt_write_file_atomic(path, b.p, b.n);
    qt_free(b.p);
    return rc;
}
