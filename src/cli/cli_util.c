#include "cli/cli.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/log.h"
#include "core/quant4.h"

#include <fcntl.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/syscall.h>
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

int cli_value(cli_once_list *l, const char *cmd, const char *opt, const char *val) {
    if (!val) return cli_usage_error(cmd, "%s needs a value", opt);
    for (int k = 0; k < l->n; k++)
        if (!strcmp(l->opt[k], opt))
            return cli_usage_error(cmd, "%s given twice ('%.200s' and '%.200s'); give it once", opt, l->val[k], val);
    if (l->n < (int)(sizeof l->opt / sizeof l->opt[0])) {
        l->opt[l->n] = opt;
        l->val[l->n++] = val;
    }
    return QT_EXIT_OK;
}

int cli_wants_help(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return 1;
    return 0;
}

static volatile sig_atomic_t stop_flag = 0;
static volatile sig_atomic_t sigints = 0;
static const char *stop_msg = "";

static void say(const char *s) {
    ssize_t w = write(2, s, strlen(s));
    (void)w;
}

/* cli_remove_on_second_ctrl_c's folder; the handler reads it only once set */
static char doomed_dir[4096], doomed_top[4096];
static volatile sig_atomic_t doomed_set = 0;

void cli_remove_on_second_ctrl_c(const char *dir, const char *top) {
    doomed_set = 0;
    atomic_signal_fence(memory_order_seq_cst);
    if (!dir || strlen(dir) >= sizeof doomed_dir || strlen(top) >= sizeof doomed_top) return;
    memcpy(doomed_dir, dir, strlen(dir) + 1);
    memcpy(doomed_top, top, strlen(top) + 1);
    atomic_signal_fence(memory_order_seq_cst); /* the paths are whole before the handler may read them */
    doomed_set = 1;
}

/* Empties and removes the registered folder from the signal handler: the
 * entries come from getdents64 (readdir is not async-signal-safe), each is
 * unlinked, and a second pass catches any a removal made the listing skip. */
static void remove_doomed(void) {
    int fd = open(doomed_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        char buf[4096] __attribute__((aligned(8)));
        for (int pass = 0; pass < 2; pass++) {
            lseek(fd, 0, SEEK_SET);
            long n;
            while ((n = syscall(SYS_getdents64, fd, buf, sizeof buf)) > 0)
                for (long off = 0; off < n;) {
                    const char *name = buf + off + 19; /* struct linux_dirent64: ino 8, off 8, reclen 2, type 1 */
                    unsigned short reclen;
                    memcpy(&reclen, buf + off + 16, sizeof reclen);
                    if (strcmp(name, ".") && strcmp(name, "..")) unlinkat(fd, name, 0);
                    off += reclen;
                }
        }
        close(fd);
    }
    qt_rmdir_made(doomed_dir, doomed_top);
}

/* The first SIGINT or SIGTERM only sets the flag that the library polls
 * (between steps, and while the data loads). A second Ctrl-C (SIGINT) ends
 * the process at once, for a step that never returns (seen inside OpenBLAS
 * under `ulimit -v`): nothing more is saved, and the checkpoints already on
 * disk are whole (a checkpoint being written stays a .tmp folder the next
 * start removes); a folder registered with cli_remove_on_second_ctrl_c (a
 * merge's staging folder) is removed first. A repeated SIGTERM, as mpirun and
 * job schedulers send, changes nothing. Only async-signal-safe calls (write,
 * open, getdents64, unlinkat, rmdir, _exit) here. */
static void on_stop_signal(int sig) {
    if (sig == SIGINT && sigints++ > 0) {
        if (stop_msg) say("\nqtune: second Ctrl-C: exiting now; nothing was saved (files finished before, such as earlier "
                          "checkpoints, are whole)\n");
        if (doomed_set) remove_doomed();
        _exit(QT_EXIT_INTERRUPTED);
    }
    if (!stop_flag && stop_msg) { /* NULL: a rank other than the main one, which prints nothing */
        say("\nqtune: stop requested: ");
        say(stop_msg);
        say(sig == SIGINT ? " (Ctrl-C again to exit at once without saving)\n" : "\n");
    }
    stop_flag = 1;
}

volatile sig_atomic_t *cli_stop_on_signals(const char *msg) {
    stop_msg = msg;
    /* the library only polls the flag; the CLI owns the signal handlers */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_stop_signal;
    sa.sa_flags = SA_RESTART; /* a stop request must not fail a read or a wait with EINTR */
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

int cli_device(const char *cmd, const char *spec, qt_device *out) {
    if (spec && qt_device_check(spec, "--device") != QT_OK) {
        qt_error_clear();
        return cli_usage_error(cmd, "--device must be auto, cpu, cuda, cuda:N, npu or npu:N, not '%s'", spec);
    }
    if (qt_device_resolve(spec, "--device", out) != QT_OK) return cli_fail();
    if (spec && out->note[0]) qt_info("%s", out->note);
    if (!strcmp(out->backend, "cuda")) {
        char label[320];
        qt_device_label(out, 0, label, sizeof label);
        qt_info("device %s", label);
    }
    return QT_EXIT_OK;
}

int cli_quant_type(const char *cmd, const char *v, int *type) {
    if (!strcmp(v, "nf4")) *type = QT_Q4_NF4;
    else if (!strcmp(v, "fp4")) *type = QT_Q4_FP4;
    else if (!strcmp(v, "none")) *type = -1;
    else return cli_usage_error(cmd, "--quantization must be nf4, fp4 or none, not '%s'", v);
    return QT_EXIT_OK;
}
