/* qtune plan: placeholder until its issue lands; replaced by the real command. */
#include "cli/cli.h"

int cmd_plan(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "qtune plan: this command is still under construction in this build\n");
    return QT_EXIT_FAIL;
}
