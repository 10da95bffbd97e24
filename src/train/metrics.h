/* The output folder's running record: metrics.jsonl (one JSON object per
 * optimizer step, eval lines carrying "eval_loss"), loss.svg (the train and
 * eval loss curves, a self-contained SVG rewritten atomically at each log),
 * report.html (the dashboard, train/report.h, rewritten with it) and, when
 * the job's report_to names "tensorboard", TensorBoard event files
 * (io/tb_events.h) under the HF Trainer's tag names. */
#ifndef QT_TRAIN_METRICS_H
#define QT_TRAIN_METRICS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "core/strbuf.h"
#include "io/tb_events.h"

typedef struct {
    long step;            /* 1-based optimizer step just finished */
    double loss;          /* token-weighted mean loss over the global batch, before the update */
    double lr;            /* learning rate the update used */
    double grad_norm;     /* global L2 norm of the unscaled gradient, before clipping */
    double loss_scale;    /* fp16 loss scale used by this step (1 without fp16) */
    int skipped;          /* 1: overflow, no update */
    int64_t tokens;       /* input positions processed in this step, all ranks */
    int64_t target_tokens;/* labelled positions (the loss's N) in this step, all ranks */
    double tokens_per_s;  /* tokens / this step's wall time */
    double elapsed_s;     /* since the run (or the resumed run) started, plus time before resume */
    int64_t mem_peak_bytes; /* peak resident set size of this process (getrusage) */
    int64_t device_peak_bytes; /* rank 0's device memory peak (backend.h device_peak_bytes); 0 (not written)
                                  where device memory is host memory (cpu) */
    double epoch;         /* fractional epoch */
    int64_t opt_state_bytes; /* optimizer state rank 0 holds (its ZeRO shard), device + host */
    double comm_s;        /* seconds rank 0 spent inside collectives during this step */
    /* several ranks: every rank's peak RSS (n_ranks entries), and rank 0's
     * collectives of this step through dist/transport.h (gradient reductions,
     * embedding rows, parameter all-gather): their lifetime (busy) and the
     * part the step waited for (wait); busy - wait was hidden */
    const int64_t *mem_peak_ranks;
    int n_ranks;
    double comm_busy_s, comm_wait_s;
    const char *extra;    /* NULL, or more fields as JSON text (", \"rewards/chosen\": 0.1, ..."): preference
                             objectives' TRL metrics */
} qt_step_metrics;

typedef struct {
    long step;
    double x;             /* NaN: not drawn (a skipped step whose loss was not finite) */
    int skipped;          /* a train step that applied no update: marked on the step axis */
} qt_metrics_point;

typedef struct {
    size_t off, len; /* in qt_metrics.rows */
    int keep;        /* an eval line or a skipped step: embedded in report.html however long the run */
} qt_metrics_row;

typedef struct {
    FILE *f;
    char path[4096];
    char svg_path[4096];
    char html_path[4096];
    char title[256];
    qt_metrics_point *train, *eval;
    size_t n_train, cap_train, n_eval, cap_eval;
    /* report.html: every metrics.jsonl line so far ('<' escaped), and what the page says beside them */
    qt_strbuf rows;
    qt_metrics_row *row;
    size_t n_row, cap_row;
    char device[320];
    long max_steps;
    uint64_t plan_rank_bytes, plan_device_bytes;
    double report_written_s; /* qt_now_s() of the last rewrite */
    qt_tb_writer *tb; /* NULL: no TensorBoard files */
} qt_metrics;

/* Opens output_dir/metrics.jsonl for appending. keep_until >= 0 (a resume)
 * first drops lines whose step is > keep_until, so the file lists each step
 * once, and reloads the curve; keep_until < 0 starts a new file. */
int qt_metrics_open(qt_metrics *m, const char *output_dir, long keep_until, const char *title);
int qt_metrics_log_step(qt_metrics *m, const qt_step_metrics *s);
int qt_metrics_log_eval(qt_metrics *m, long step, double eval_loss, int64_t tokens, double elapsed_s);
/* A preference objective's eval line: fields is ", \"eval_loss\": ..., \"eval_rewards/chosen\": ..." (TRL's
 * names; it must hold eval_loss), over that many held-out pairs. */
int qt_metrics_log_eval_fields(qt_metrics *m, long step, double eval_loss, const char *fields, int64_t pairs,
                               double elapsed_s);
/* Rewrites loss.svg from the points logged so far (atomic). */
int qt_metrics_write_svg(const qt_metrics *m);
/* What report.html says beside the lines: the device, the last step, and the
 * plan's bytes for rank 0's process and card (0: no plan). */
void qt_metrics_set_report(qt_metrics *m, const char *device, long max_steps, uint64_t plan_rank_bytes,
                           uint64_t plan_device_bytes);
/* Rewrites report.html (atomic); status "running" (the page reloads itself;
 * skipped when the last rewrite is under 2 s old, so a run logging many
 * steps a second does not spend its time writing the page), "finished",
 * "stopped" or "failed" (always written). A long run's page holds about
 * REPORT_MAX_ROWS train lines (every k-th, and the newest), with every eval
 * line and skipped step. */
int qt_metrics_write_report(qt_metrics *m, const char *status);
/* From here on each logged line also goes to a new TensorBoard event file in
 * logdir (created): train/loss, train/learning_rate, train/grad_norm,
 * train/epoch, train/loss_scale, train/skipped, train/tokens_per_s per step,
 * eval/loss and eval/ppl per evaluation. */
int qt_metrics_open_tensorboard(qt_metrics *m, const char *logdir);
void qt_metrics_close(qt_metrics *m);

/* Writes the SVG for the given series to path (atomic). */
int qt_loss_svg_write(const char *path, const char *title, const qt_metrics_point *train, size_t n_train,
                      const qt_metrics_point *eval, size_t n_eval);

/* Peak resident set size of this process in bytes (getrusage), 0 if unknown. */
int64_t qt_peak_rss_bytes(void);

#endif
