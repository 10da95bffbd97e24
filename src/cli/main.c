/* qtune: the command-line front end. Each command lives in its own file
 * (cmd_NAME.c) as `int cmd_NAME(int argc, char **argv)` returning the process
 * exit status; this file only dispatches. The CLI is the one place that
 * prints errors and exits. */
#define _GNU_SOURCE /* sched_setaffinity, CPU_SET */
#include "cli/cli.h"
#include "core/log.h"
#include "qtune_config.h"

#include <cblas.h>
#include <omp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

static const struct {
    const char *name;
    int (*run)(int, char **);
    const char *summary;
} commands[] = {
    {"init", cmd_init, "write a randomly initialised model folder from a preset or config"},
    {"train", cmd_train, "fine-tune a model as a job file says (LoRA or full)"},
    {"eval", cmd_eval, "mean loss and perplexity of a model on a dataset"},
    {"generate", cmd_generate, "generate text from a model, optionally with an adapter"},
    {"tokenize", cmd_tokenize, "encode text to token ids or decode ids to text"},
    {"merge", cmd_merge, "merge a PEFT LoRA adapter into a model folder"},
    {"stop", cmd_stop, "ask a running train (MPI included) to save a checkpoint and exit"},
    {"export", cmd_export, "write a model or LoRA adapter as a GGUF file for llama.cpp"},
    {"plan", cmd_plan, "memory and hardware plan for a model, strategy and device count"},
    {"doctor", cmd_doctor, "check this machine and a job file; list known failures and fixes"},
};
#define NCOMMANDS (sizeof commands / sizeof commands[0])

/* OpenMP's idle threads spin briefly, then sleep: GOMP_SPINCOUNT=3000 (about
 * 150 microseconds) unless the environment sets OMP_WAIT_POLICY or
 * GOMP_SPINCOUNT. A 0.5B step opens about a thousand parallel regions.
 * - libgomp's default spins 300000 times (about 15 ms) after each region, so
 *   on a shared machine the idle thread holds a core another process needs.
 * - No spin at all (OMP_WAIT_POLICY=passive) puts the other thread to sleep
 *   at every region's end, and it mostly enters the next region tens of
 *   microseconds late.
 * - A short spin costs little when another process wants the cores, where
 *   longer ones lose more the longer they spin.
 * Figures: docs/performance.md, item 6, and bench/RESULTS.md. libgomp reads the variable once,
 * before main runs (and glibc resets the environment after an executable's
 * .preinit_array), so the process sets it and executes itself again, once:
 * the second time the variable is set. If the exec fails, qtune runs on with
 * libgomp's default. OpenBLAS's kernels (below) are chosen the same way. */
#define QT_GOMP_SPINCOUNT "3000"

/* OpenBLAS picks its kernels once, when it loads, from the CPU it recognises:
 * a DYNAMIC_ARCH build older than the CPU (Debian 12's 0.3.21 on a Sapphire
 * Rapids-class Xeon) does not know the model and falls back to its SSE3
 * "Prescott" kernels, about a quarter of the machine's fp32 GEMM rate
 * (bench/RESULTS.md, 2026-12-06: a 1024 sgemm, 28-29 against 124-133 GFLOP
 * per CPU-second). Where the CPU has AVX-512 (F, BW, VL, DQ) or AVX2 + FMA and
 * OpenBLAS chose a core without them, the process names the right one in
 * OPENBLAS_CORETYPE and executes itself again, as for GOMP_SPINCOUNT below;
 * QTUNE_BLAS_CORE_WAS keeps the core OpenBLAS had chosen, so `qtune doctor`
 * says what was changed. A user's own OPENBLAS_CORETYPE is never touched. */
static const char *blas_core_wanted(void) {
    if (getenv("OPENBLAS_CORETYPE")) return NULL;
    const char *have = openblas_get_corename();
    if (!have) return NULL;
    static const char *const avx512_cores[] = {"SkylakeX", "Cooperlake", "SapphireRapids"};
    static const char *const avx2_cores[] = {"Haswell", "Zen", "SkylakeX", "Cooperlake", "SapphireRapids"};
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
        for (size_t i = 0; i < sizeof avx512_cores / sizeof *avx512_cores; i++)
            if (!strcasecmp(have, avx512_cores[i])) return NULL;
        if (!strcasecmp(have, "Zen")) return NULL; /* AMD's AVX-512 parts: OpenBLAS's own choice */
        return __builtin_cpu_supports("avx512bf16") ? "Cooperlake" : "SkylakeX";
    }
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        for (size_t i = 0; i < sizeof avx2_cores / sizeof *avx2_cores; i++)
            if (!strcasecmp(have, avx2_cores[i])) return NULL;
        return "Haswell";
    }
    return NULL;
}

static void exec_with_defaults(char **argv) {
    const int spin = !getenv("OMP_WAIT_POLICY") && !getenv("GOMP_SPINCOUNT");
    const char *core = blas_core_wanted();
    if (!spin && !core) return;
    if (spin && setenv("GOMP_SPINCOUNT", QT_GOMP_SPINCOUNT, 0) != 0) return;
    if (core && (setenv("QTUNE_BLAS_CORE_WAS", openblas_get_corename(), 1) != 0 ||
                 setenv("OPENBLAS_CORETYPE", core, 0) != 0))
        return;
    /* With OMP_PROC_BIND set, libgomp has already pinned this thread to its
     * first place, and exec keeps that mask: the second process would see
     * one CPU and put every thread on it (about half the speed at 2
     * threads). Give it back the CPUs of all the places, which is the
     * mask libgomp started from (or the user's own OMP_PLACES). */
    cpu_set_t all;
    CPU_ZERO(&all);
    int n = 0;
    for (int p = 0; p < omp_get_num_places(); p++) {
        int k = omp_get_place_num_procs(p), ids[CPU_SETSIZE];
        if (k < 1 || k > CPU_SETSIZE) continue;
        omp_get_place_proc_ids(p, ids);
        for (int i = 0; i < k; i++)
            if (ids[i] >= 0 && ids[i] < CPU_SETSIZE) CPU_SET(ids[i], &all), n++;
    }
    if (n) sched_setaffinity(0, sizeof all, &all);
    execv("/proc/self/exe", argv);
}

/* libgomp puts the start data of a region's threads on the caller's stack:
 * OMP_NUM_THREADS=70000 overflowed it and crashed inside GOMP_parallel
 * (SIGSEGV), 40000 ended in libgomp's "Thread creation failed" abort. More
 * threads than this bound are refused before any work starts. */
#define QT_MAX_THREADS 4096
static int threads_ok(void) {
    const int n = omp_get_max_threads();
    if (n <= QT_MAX_THREADS) return 1;
    fprintf(stderr, "qtune: error: OMP_NUM_THREADS asks for %d threads, more than qtune runs (%d); this machine has "
                    "%ld CPUs: set OMP_NUM_THREADS to that many or fewer\n", n, QT_MAX_THREADS,
            sysconf(_SC_NPROCESSORS_ONLN));
    return 0;
}

static void usage(FILE *out) {
    fprintf(out, "qtune %s: fine-tune Qwen-family language models\n\n"
                 "usage: qtune COMMAND [options]   (qtune COMMAND --help for details)\n\ncommands:\n",
            QTUNE_VERSION);
    for (size_t i = 0; i < NCOMMANDS; i++) fprintf(out, "  %-9s %s\n", commands[i].name, commands[i].summary);
    fprintf(out, "\nenvironment: QTUNE_LOG=debug adds file:line to messages, QTUNE_LOG=quiet keeps only warnings\n"
                 "and errors; OMP_NUM_THREADS sets threads (at most 4096);\n"
                 "idle OpenMP threads spin briefly (GOMP_SPINCOUNT=" QT_GOMP_SPINCOUNT
                 "; OMP_WAIT_POLICY=passive: no spin, kinder to\n"
                 "other busy processes; active: a long spin);\n"
                 "QTUNE_SGEMM=openblas keeps every fp32 product on OpenBLAS (default: oneDNN for the gradients);\n"
                 "QTUNE_PROFILE=1 times every backend op and prints a table at exit (docs/performance.md);\n"
                 "QTUNE_BACKEND=cpu|guard|cuda overrides the job's \"device\" and --device; QTUNE_CUDA_DEVICE=N is\n"
                 "the GPU a plain \"cuda\" takes (default: the local rank under mpirun, else 0) (docs/backends.md).\n");
}

int main(int argc, char **argv) {
    exec_with_defaults(argv);
    const char *lvl = getenv("QTUNE_LOG");
    if (lvl && !strcasecmp(lvl, "debug")) qt_log_set_level(QT_LOG_DEBUG);
    else if (lvl && !strcasecmp(lvl, "quiet")) qt_log_set_level(QT_LOG_WARN);
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "--version")) {
        printf("qtune %s\n", QTUNE_VERSION);
        return 0;
    }
    if (!threads_ok()) return 2;
    for (size_t i = 0; i < NCOMMANDS; i++)
        if (!strcmp(argv[1], commands[i].name)) return commands[i].run(argc - 1, argv + 1);
    fprintf(stderr, "qtune: error: unknown command '%s'; run `qtune --help` for the list\n", argv[1]);
    return 2;
}
