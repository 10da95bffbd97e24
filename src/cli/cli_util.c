#include "cli/cli.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"

#include <stdarg.h>
#include <string.h>
#include <unistd.h>

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

static volatile sig_atomic_t stop_flag = 0;
static const char *stop_msg = "";

static void on_stop_signal(int sig) {
    (void)sig;
    if (!stop_flag && stop_msg) {
        /* write(2) is async-signal-safe; stdio is not */
        static const char head[] = "\nqtune: stop requested: ";
        ssize_t w = write(2, head, sizeof head - 1);
        w = write(2, stop_msg, strlen(stop_msg));
        w = write(2, "\n", 1);
        (void)w;
    }
    stop_flag = 1;
}

volatile sig_atomic_t *cli_stop_on_signals(const char *msg) {
    stop_msg = msg;
    /* the library only polls the flag; the CLI owns the signal handlers */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    return &stop_flag;
}

int cli_check_adapter(const char *dir) {
    char p[4096], q[4096];
    if (qt_path_join(p, sizeof p, dir, "adapter_config.json") != QT_OK || qt_path_exists(p)) return QT_OK;
    if (qt_path_join(q, sizeof q, dir, "final/adapter_config.json") == QT_OK && qt_path_exists(q))
        return QT_ERR(QT_EINVAL,
                      "--adapter %s is a training output folder; its adapter is in %s/final (or a checkpoint-STEP "
                      "folder beside it): give --adapter %s/final",
                      dir, dir, dir);
    if (qt_path_join(q, sizeof q, dir, "final/model.safetensors") == QT_OK && qt_path_exists(q))
        return QT_ERR(QT_EINVAL,
                      "--adapter %s is the output folder of a full fine-tuning run, which has no adapter; give "
                      "--model %s/final instead",
                      dir, dir);
    return QT_OK; /* the adapter loader names what is missing */
}
