/* report.html: the training dashboard in the output folder. One file that
 * holds everything it shows (style, script and the run's metrics.jsonl lines;
 * it loads nothing from anywhere), rewritten atomically at every log and eval
 * line; while the run is live the page reloads itself every refresh_s
 * seconds. The page (src/train/report.html, compiled in) draws train and
 * eval loss, learning rate, gradient norm, loss scale and skipped steps,
 * tokens/s, memory against the plan and the ETA from the embedded lines. */
#ifndef QT_TRAIN_REPORT_H
#define QT_TRAIN_REPORT_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    const char *title;          /* the page's heading */
    const char *status;         /* "running", "finished", "stopped" or "failed" */
    const char *device;         /* "cpu (16 threads)", "cuda:0 (NVIDIA H200)"; NULL: not shown */
    long max_steps;             /* the run's last step (progress and ETA); 0: unknown */
    int refresh_s;              /* seconds between reloads while running */
    uint64_t plan_rank_bytes;   /* the plan's rank-0 process (qt_plan.cpu_rank_bytes): against mem_peak_bytes */
    uint64_t plan_device_bytes; /* the plan's card (qt_plan.dev.total): against device_peak_bytes; 0: no plan */
    long rows_total;            /* metrics.jsonl lines in all */
    long stride;                /* every stride-th train line embedded (evals and skipped steps all) */
} qt_report_info;

/* Writes the page to path (atomic). rows: metrics.jsonl objects joined by
 * commas, with every '<' written as \u003c (so no "</script>" can end the
 * data early). */
int qt_report_html_write(const char *path, const qt_report_info *info, const char *rows, size_t rows_len);

#endif
