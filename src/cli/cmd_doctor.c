/* qtune doctor: this machine and build, a job file checked for every
 * problem, and the table of known failures (src/train/doctor.h). */
#include "cli/cli.h"
#include "train/doctor.h"

#include <stdlib.h>
#include <string.h>

static void doctor_help(void) {
    printf("usage: qtune doctor [JOB.json [--set key.path=value ...] [--strict]] [--ranks N] [--no-table]\n\n"
           "Reports CPU features (AVX2, AVX-512F, AVX512_BF16, F16C), the BLAS library and its threads,\n"
           "OpenMP threads against cores, MPI and CUDA of this build, memory and disk. With a job file it\n"
           "names every problem found in it (paths, DeepSpeed batch identity, ZeRO/offload/precision\n"
           "settings, memory and disk against `qtune plan` for the job) and exits 1 if there is any.\n"
           "Ends with the table of known failures: symptom, cause, fix and the exact message.\n\n"
           "It checks what `qtune train` would stop on: every weight shard the index lists opens, every\n"
           "data line reads (the first bad one named FILE:LINE), the output folder takes a file and has\n"
           "room for two checkpoints and final/; it says ok only then.\n\n"
           "  --set k=v     override a job field as `qtune train --set` does\n"
           "  --ranks N     data-parallel ranks that will run on this host, 1 to 4096 (default: the ranks\n"
           "                mpirun starts on this host, OMPI_COMM_WORLD_LOCAL_SIZE, else 1)\n"
           "  --strict      an unknown key in the job, its lora section or its DeepSpeed config is a\n"
           "                problem (as `qtune train --strict` stops on it), not a warning\n"
           "  --no-table    leave out the table of known failures\n");
}

int cmd_doctor(int argc, char **argv) {
    if (cli_wants_help(argc, argv)) {
        doctor_help();
        return QT_EXIT_OK;
    }
    const char *job = NULL;
    int ranks = 0, table = 1, n_sets = 0, strict = 0;
    const char **sets = calloc((size_t)argc + 1, sizeof *sets);
    if (!sets) return QT_EXIT_FAIL;
    cli_once_list once = {0};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--set")) {
            if (i + 1 >= argc) {
                free(sets);
                return cli_usage_error("doctor", "--set needs key.path=value");
            }
            sets[n_sets++] = argv[++i];
        } else if (!strncmp(argv[i], "--set=", 6)) {
            sets[n_sets++] = argv[i] + 6;
        } else if (!strcmp(argv[i], "--ranks")) {
            if (i + 1 < argc && cli_value(&once, "doctor", argv[i], argv[i + 1])) {
                free(sets);
                return QT_EXIT_USAGE;
            }
            char *end;
            long v = i + 1 < argc ? strtol(argv[i + 1], &end, 10) : 0;
            if (i + 1 >= argc || *end || v < 1 || v > 4096)
                {
                free(sets);
                return cli_usage_error("doctor", "--ranks needs a whole number from 1 to 4096");
            }
            ranks = (int)v;
            i++;
        } else if (!strcmp(argv[i], "--no-table")) {
            table = 0;
        } else if (!strcmp(argv[i], "--strict")) {
            strict = 1;
        } else if (argv[i][0] == '-') {
            {
                free(sets);
                return cli_usage_error("doctor", "unknown option '%s'", argv[i]);
            }
        } else if (!job) {
            job = argv[i];
        } else {
            {
                free(sets);
                return cli_usage_error("doctor", "give at most one job file (got '%s' and '%s')", job, argv[i]);
            }
        }
    }
    if (n_sets && !job) {
        free(sets);
        return cli_usage_error("doctor", "--set needs a job file: qtune doctor JOB.json --set ...");
    }
    if (!ranks) {
        const char *w = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
        ranks = w && atoi(w) > 0 ? atoi(w) : 1;
    }
    qt_doctor_environment(stdout, ranks);
    int problems = 0;
    if (job) {
        printf("\n");
        problems = qt_doctor_check_job(stdout, job, sets, n_sets, ranks, strict);
    }
    free(sets);
    if (table) {
        printf("\n");
        qt_doctor_print_failures(stdout);
    }
    fflush(stdout);
    if (problems) {
        fprintf(stderr, "qtune: error: %s has %d problem%s (listed above); fix them before `qtune train`\n", job,
                problems, problems == 1 ? "" : "s");
        return QT_EXIT_FAIL;
    }
    return QT_EXIT_OK;
}
