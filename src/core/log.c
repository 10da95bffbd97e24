#include "core/log.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* The process-wide settings outside the CLI: set once at start-up, read-only after. */
static int log_level = QT_LOG_INFO;
static int rank_quiet = 0;

void qt_log_set_level(int level) { log_level = level; }
int qt_log_level(void) { return log_level; }
void qt_log_set_rank_quiet(int quiet) { rank_quiet = quiet; }

void qt_log_at(int level, const char *file, int line, const char *fmt, ...) {
    const int own = level & QT_LOG_RANK_OWN;
    level &= ~QT_LOG_RANK_OWN;
    if (level > log_level) return;
    if (rank_quiet && !own && level >= QT_LOG_WARN) return;
    static const char *names[] = {"error", "warning", "info", "debug"};
    char buf[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    if (log_level >= QT_LOG_DEBUG) {
        const char *base = strrchr(file, '/');
        fprintf(stderr, "qtune: %s: %s [%s:%d]\n", names[level], buf, base ? base + 1 : file, line);
    } else if (level == QT_LOG_INFO) {
        fprintf(stderr, "qtune: %s\n", buf);
    } else {
        fprintf(stderr, "qtune: %s: %s\n", names[level], buf);
    }
}
