#include "cli/cli.h"
#include "core/error.h"
#include "core/log.h"

#include <stdarg.h>
#include <string.h>

int cli_fail(void) {
    if (qt_log_level() >= QT_LOG_DEBUG)
        fprintf(stderr, "qtune: error: %s [%s]\n", qt_error_message(), qt_error_where());
    else
        fprintf(stderr, "qtune: error: %s\n", qt_error_message());
    return qt_error_code() == QT_EINTERRUPTED ? QT_EXIT_INTERRUPTED : QT_EXIT_FAIL;
}

int cli_usage_error(const char *cmd, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "qtune %s: %s; see `qtune %s --help`\n", cmd, buf, cmd);
    return QT_EXIT_USAGE;
}

int cli_wants_help(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return 1;
    return 0;
}
