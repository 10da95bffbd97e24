/* qtune train JOB.json [--set key.path=value ...]: fine-tune as the job file
 * says (docs/job-file.md, docs/training.md). SIGINT/SIGTERM finish the current
 * step, write a checkpoint and exit with status 130. */
#include "cli/cli.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/log.h"
#include "core/mem.h"
#include "dist/dist.h"
#include "train/job.h"
#include "train/trainer.h"

#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static void help(void) {
    printf("usage: qtune train JOB.json [--set key.path=value ...] [--strict]\n\n"
           "Fine-tunes the model the job file names (LoRA when it has a \"lora\" section, else full\n"
           "fine-tuning) with the DeepSpeed settings it names, and writes to its output_dir:\n"
           "  metrics.jsonl     one line per optimizer step (loss, lr, grad_norm, tokens/s, ...)\n"
           "  loss.svg          the train and eval loss curves\n"
           "  report.html       a dashboard of the run (loss, lr, grad norm, loss scale, tokens/s,\n"
           "                    memory against the plan, ETA); one file, reloads itself while it runs\n"
           "  runs/             TensorBoard event files, with train.report_to \"tensorboard\"\n"
           "  checkpoint-STEP/  everything needed to resume exactly (train.resume \"auto\" does)\n"
           "  final/            a PEFT adapter (LoRA) or a model folder (full fine-tuning)\n\n"
           "options:\n"
           "  --set key.path=value   override a job field, e.g. --set train.max_steps=100,\n"
           "                         --set deepspeed.optimizer.params.lr=1e-4,\n"
           "                         --set train.overwrite_output_dir=true (replace another run's outputs)\n"
           "  --strict               stop on an unknown key (in the job, its lora section or its DeepSpeed\n"
           "                         config) instead of warning and ignoring it\n\n"
           "Paths in the job file are relative to its folder. Ctrl-C (or SIGTERM) finishes the step,\n"
           "saves a checkpoint and exits with status 130; run the same command to continue.\n"
           "Under mpirun every rank runs this command: mpirun -np 4 qtune train JOB.json; stop such\n"
           "a job with `qtune stop OUTPUT_DIR` (Ctrl-C on mpirun kills the ranks before they save).\n"
           "See docs/job-file.md for every key.\n");
}

/* An error that stops this rank. Rank 0 says it. Another rank waits a moment
 * first: when rank 0 stops too (a bad job or model fails every rank alike)
 * its MPI_Abort reaches this rank as SIGTERM, and the error has been said
 * once; only an error of this rank alone (its memory, its disk) is said
 * here, with the rank. */
static int rank_failed(dist_ctx *d, volatile sig_atomic_t *stop) {
    if (dist_world(d) <= 1 || dist_is_main(d)) return cli_fail();
    const int st = qt_error_code() == QT_EINTERRUPTED ? QT_EXIT_INTERRUPTED : QT_EXIT_FAIL;
    for (int i = 0; i < 30 && !*stop; i++) {
        struct timespec ts = {0, 100 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (!*stop) fprintf(stderr, "qtune: error: rank %d: %s\n", dist_rank(d), qt_error_message());
    return st;
}

static void fmt_wall(char *buf, size_t cap, double s) {
    const long x = (long)(s + 0.5);
    if (x >= 3600) snprintf(buf, cap, "%ldh%02ldm%02lds", x / 3600, (x / 60) % 60, x % 60);
    else if (x >= 60) snprintf(buf, cap, "%ldm%02lds", x / 60, x % 60);
    else snprintf(buf, cap, "%.1fs", s);
}

/* The run's closing lines: how long it took, how fast it went, where its record is. */
static void print_summary(const qt_job *job, const qt_train_result *res, double wall_s) {
    char wall[32];
    fmt_wall(wall, sizeof wall, wall_s);
    printf("wall time %s", wall);
    if (res->tokens > 0 && res->train_s > 0)
    {
        const double tps = (double)res->tokens / res->train_s; /* below 10 with decimals: a 14B run on a CPU is 0.11 */
        printf("; %.*f tokens/s mean over this run's steps (%lld tokens in %.1f s)", tps < 10 ? 2 : 0, tps,
               (long long)res->tokens, res->train_s);
    }
    printf("\nloss curve: %s/loss.svg\nmetrics: %s/metrics.jsonl\n", job->output_dir, job->output_dir);
}

int cmd_train(int argc, char **argv) {
    if (cli_wants_help(argc, argv)) { help(); return QT_EXIT_OK; }
    const char *job_path = NULL;
    const char **sets = calloc((size_t)argc + 1, sizeof *sets);
    int n_sets = 0, strict = 0;
    if (!sets) return cli_fail();
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--strict")) {
            strict = 1;
        } else if (!strcmp(argv[i], "--set")) {
            if (i + 1 >= argc) { free(sets); return cli_usage_error("train", "--set needs key.path=value"); }
            sets[n_sets++] = argv[++i];
        } else if (!strncmp(argv[i], "--set=", 6)) {
            sets[n_sets++] = argv[i] + 6;
        } else if (argv[i][0] == '-' && argv[i][1]) {
            free(sets);
            return cli_usage_error("train", "unknown option '%s'", argv[i]);
        } else if (!job_path) {
            job_path = argv[i];
        } else {
            free(sets);
            return cli_usage_error("train", "one job file only (got '%s' and '%s')", job_path, argv[i]);
        }
    }
    if (!job_path) { free(sets); return cli_usage_error("train", "name the job file: qtune train JOB.json"); }
    /* the shape of an override is the command line's: exit 2, as the README says */
    for (int i = 0; i < n_sets; i++) {
        const char *eq = strchr(sets[i], '=');
        if (!eq || eq == sets[i]) {
            int st = cli_usage_error("train", "--set %.200s: write it as key.path=value (for example "
                                     "train.max_steps=100)", sets[i]);
            free(sets);
            return st;
        }
    }

    /* before dist_init, so that SIGTERM never finds the default action once
     * MPI runs (dist then leaves this handler alone and polls the flag) */
    volatile sig_atomic_t *stop = cli_stop_on_signals("finishing this step and saving a checkpoint");
    dist_ctx *d = NULL;
    if (dist_init(&argc, &argv, &d) != QT_OK) { free(sets); return cli_fail(); }
    dist_set_stop_flag(d, stop);
    /* rank 0 speaks: every rank reads the same job, model and data, so the other ranks' warnings would
     * repeat rank 0's once per rank; what concerns one rank alone is said by qt_warn_rank and rank_failed
     * (QTUNE_LOG=debug keeps every rank's words) */
    if (!dist_is_main(d) && qt_log_level() <= QT_LOG_INFO) qt_log_set_rank_quiet(1);

    /* only rank 0 says it: mpirun passes a Ctrl-C to every rank, and an
     * MPI_Abort reaches the others as SIGTERM (same handler and flag, no message) */
    if (!dist_is_main(d)) cli_stop_on_signals(NULL);
    qt_job job;
    int rc = qt_job_load_ex(job_path, sets, n_sets, strict, &job);
    free(sets);
    if (rc != QT_OK) {
        int st = rank_failed(d, stop);
        /* from here a stop has nothing to save: the SIGTERM of another rank's MPI_Abort, which can arrive while
         * this rank's own abort is under way, says nothing (it said "saving a checkpoint" under load) */
        cli_stop_on_signals(NULL);
        if (dist_world(d) > 1) dist_abort(d, st);
        dist_finalize(d);
        return st;
    }

    /* Ctrl-C on mpirun reaches rank 0 as a signal, and mpirun kills every rank about a second later: say
     * at once that this stop will likely not be saved, and what does save */
    static char mpi_stop_msg[4400];
    if (dist_uses_mpi(d) && dist_is_main(d)) {
        snprintf(mpi_stop_msg, sizeof mpi_stop_msg,
                 "mpirun will not wait for it: it kills every rank about a second after Ctrl-C, and a checkpoint "
                 "not written by then is lost. To stop an MPI job and keep its progress run `qtune stop %s` instead",
                 job.output_dir);
        cli_stop_on_signals(mpi_stop_msg);
    }
    if (dist_uses_mpi(d) && dist_is_main(d))
        fprintf(stderr, "qtune: to stop this MPI job and keep its progress run `qtune stop %s` (it saves a "
                        "checkpoint after the current step); Ctrl-C on mpirun kills the ranks one second after "
                        "passing SIGTERM on, often before a checkpoint is written (docs/robustness.md: the mpirun "
                        "setting that waits longer)\n", job.output_dir);

    const double t_start = qt_now_s();
    qt_train_hooks hooks = {.stop = stop, .progress = stderr, .tty = isatty(fileno(stderr))};
    qt_train_result res;
    rc = qt_train_run(&job, d, &hooks, &res);
    int status = QT_EXIT_OK;
    if (rc != QT_OK) {
        if (rc == QT_EINTERRUPTED) {
            if (dist_is_main(d)) fprintf(stderr, "qtune: %s\n", qt_error_message());
            /* mpirun reports any non-zero exit with a banner of its own; 130 is kept so that a script or a
             * scheduler can tell a stopped job from a finished one (docs/robustness.md) */
            if (dist_is_main(d) && dist_uses_mpi(d))
                fprintf(stderr, "qtune: every rank exits with status 130 (stopped, resumable); mpirun reports that "
                                "below as processes that \"exited with non-zero status\": nothing failed\n");
            status = QT_EXIT_INTERRUPTED;
        } else {
            status = rank_failed(d, stop);
            cli_stop_on_signals(NULL); /* as above: a failed rank has nothing to save */
            if (dist_world(d) > 1) { qt_job_free(&job); dist_abort(d, status); }
        }
    } else if (dist_is_main(d)) {
        printf("trained %ld steps", res.step);
        if (res.skipped > 0) printf(" (%ld skipped: no update)", res.skipped);
        if (!isnan(res.last_loss)) printf("; last train loss %.4f", res.last_loss);
        if (!isnan(res.eval_loss_first)) printf("; eval loss %.4f -> %.4f", res.eval_loss_first, res.eval_loss_last);
        else if (!isnan(res.eval_loss_last)) printf("; eval loss %.4f", res.eval_loss_last);
        printf("\n%s: %s\n", job.lora.enabled ? "adapter" : "model", res.final_dir);
        print_summary(&job, &res, qt_now_s() - t_start);
    }
    qt_job_free(&job);
    dist_finalize(d);
    return status;
}
