/* Shared by the command files: the command entry points and the helpers every
 * command uses to report errors the same way. */
#ifndef QT_CLI_H
#define QT_CLI_H

#include <signal.h>
#include <stdio.h>

#include "backend/device.h"

int cmd_init(int argc, char **argv);
int cmd_train(int argc, char **argv);
int cmd_eval(int argc, char **argv);
int cmd_generate(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_merge(int argc, char **argv);
int cmd_export(int argc, char **argv);
int cmd_plan(int argc, char **argv);
int cmd_doctor(int argc, char **argv);
int cmd_stop(int argc, char **argv);

/* Exit statuses (documented in README.md, "Commands"). */
enum {
    QT_EXIT_OK = 0,
    QT_EXIT_FAIL = 1,        /* the command failed; the message says why */
    QT_EXIT_USAGE = 2,       /* bad command line */
    QT_EXIT_INTERRUPTED = 130, /* SIGINT/SIGTERM: state saved, stopped cleanly */
};

/* Prints "qtune: error: <last error message>" (plus file:line with
 * QTUNE_LOG=debug) and returns QT_EXIT_FAIL (or QT_EXIT_INTERRUPTED). */
int cli_fail(void);
/* Prints "qtune CMD: <msg>; see `qtune CMD --help`" and returns QT_EXIT_USAGE. */
int cli_usage_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The single-value options a command's parser has taken, so that one given
 * twice is refused instead of its last value winning in silence. */
typedef struct {
    const char *opt[64];
    const char *val[64];
    int n;
} cli_once_list;
/* Takes val (the next argument, NULL when there is none) as the value of
 * option opt of command cmd, and records it. Returns QT_EXIT_OK, or a usage
 * error (QT_EXIT_USAGE): "--model needs a value" when val is NULL, "--model
 * given twice ('a' and 'b'); give it once" when opt was given before. Options
 * meant to repeat (--set) and flags without a value do not call it. */
int cli_value(cli_once_list *l, const char *cmd, const char *opt, const char *val);
/* The same in an option loop whose index is i: on success steps i past the
 * value, else returns the usage error from the calling function. */
#define CLI_NEED_VALUE(l, cmd, opt, val, i) \
    do { \
        if (cli_value(l, cmd, opt, val)) return QT_EXIT_USAGE; \
        (i)++; \
    } while (0)
/* True if argv has --help or -h; commands print their help and return 0. */
int cli_wants_help(int argc, char **argv);
/* Installs the SIGINT/SIGTERM handlers of a long command (train, merge): the
 * first signal writes "\nqtune: stop requested: MSG\n" to stderr, every
 * signal sets the returned flag, which the library polls. MSG must outlive
 * the command (a string literal). */
/* --adapter DIR that is not an adapter but a training output_dir: an error
 * that names DIR/final (QT_EINVAL); QT_OK otherwise. */
int cli_check_adapter(const char *dir);

/* --device D of eval, generate and merge (backend/device.h; NULL: auto),
 * resolved on this machine. Says on stderr which GPU is used, and what auto
 * became (or that QTUNE_BACKEND overrides) when D was given. Returns
 * QT_EXIT_OK, QT_EXIT_USAGE for a value that is not a device, QT_EXIT_FAIL
 * (with the error said) when this machine cannot give it. */
int cli_device(const char *cmd, const char *spec, qt_device *out);
/* --quantization nf4|fp4|none (QLoRA's 4-bit base, as the job's "quantization" key) into *type
 * (-1: none, else qt_q4_type); QT_EXIT_OK or the usage error's exit code. */
int cli_quant_type(const char *cmd, const char *v, int *type);

/* msg NULL: the flag is set silently (an MPI rank other than 0). */
volatile sig_atomic_t *cli_stop_on_signals(const char *msg);
/* What a second Ctrl-C removes before it ends the process: the files of the
 * folder dir (a staging folder of plain files), dir itself, and the folders
 * above it up to top that the command made (qt_rmdir_made: only while
 * empty). NULL dir: nothing (after the command's own cleanup or commit). */
void cli_remove_on_second_ctrl_c(const char *dir, const char *top);

#endif
