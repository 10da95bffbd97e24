/* qtune stop OUTPUT_DIR [--wait]: asks the `qtune train` that holds
 * OUTPUT_DIR (MPI included) to save a checkpoint and exit after its current
 * step, through a stop file every rank agrees on (see train/stop.c). */
#include "cli/cli.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "train/trainer.h"

#include <stdio.h>
#include <string.h>
#include <unistd.h>

static void help(void) {
    printf("usage: qtune stop OUTPUT_DIR [--wait]\n\n"
           "Asks the `qtune train` running with this output_dir to stop safely: after its current step\n"
           "every rank agrees to stop, a checkpoint is written and the job exits with status 130;\n"
           "run the same train command again to continue from it. Works for MPI jobs, where Ctrl-C on\n"
           "mpirun does not: mpirun forwards SIGTERM to the ranks and kills them one second later,\n"
           "before the checkpoint is written (docs/robustness.md).\n\n"
           "It writes OUTPUT_DIR/" QT_STOP_FILE ", which the job's rank 0 looks for between steps and removes\n"
           "when it stops. Nothing is written when no qtune train holds OUTPUT_DIR (exit 1).\n\n"
           "options:\n"
           "  --wait    return only when the job has exited, and name its newest checkpoint\n");
}

int cmd_stop(int argc, char **argv) {
    if (cli_wants_help(argc, argv)) { help(); return QT_EXIT_OK; }
    const char *dir = NULL;
    int wait = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--wait")) wait = 1;
        else if (argv[i][0] == '-' && argv[i][1]) return cli_usage_error("stop", "unknown option '%s'", argv[i]);
        else if (!dir) dir = argv[i];
        else return cli_usage_error("stop", "one output folder only (got '%s' and '%s')", dir, argv[i]);
    }
    if (!dir) return cli_usage_error("stop", "name the job's output folder: qtune stop OUTPUT_DIR");
    char holder[512];
    if (qt_stop_request(dir, holder, sizeof holder) != QT_OK) return cli_fail();
    fprintf(stderr, "qtune: asked the job in %s%s%s%s to stop: it saves a checkpoint after its current step and "
                    "exits with status 130\n", dir, holder[0] ? " (" : "", holder, holder[0] ? ")" : "");
    if (!wait) return QT_EXIT_OK;
    while (qt_output_dir_held(dir) == 1) usleep(200 * 1000);
    char ck[4096];
    long step = -1;
    if (ckpt_latest(dir, ck, sizeof ck, &step) == QT_OK && ck[0])
        printf("stopped; newest checkpoint: %s\n", ck);
    else
        printf("stopped\n");
    return QT_EXIT_OK;
}
