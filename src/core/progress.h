/* Progress with an ETA for long silent work (eval, the step-0 eval, init of a
 * large model, merge): on a terminal one line redrawn in place (at most 5
 * times a second), otherwise a plain line every few seconds, so a log shows
 * the run is alive. The caller owns the FILE (stderr in the CLI); a NULL
 * FILE makes every call a no-op, so library code can take one unconditionally. */
#ifndef QT_CORE_PROGRESS_H
#define QT_CORE_PROGRESS_H

#include <stdio.h>

#define QT_PROGRESS_EVERY_S 5.0 /* seconds between plain lines off a terminal; the environment's
                                   QTUNE_PROGRESS_S (a number of seconds) replaces it, for tests */

typedef struct {
    FILE *f;        /* NULL: silent */
    int tty;        /* redraw one line (\r) instead of printing lines */
    char what[96];  /* "eval", "merging LoRA into model.safetensors" */
    char unit[16];  /* "batches", "MB", ... */
    double total;   /* units of work; <= 0 unknown (no percentage, no ETA) */
    double done;
    double t0, last;
    double every_s; /* off a terminal: seconds between lines */
    int shown;      /* something was printed (a tty line then needs its newline) */
} qt_progress;

void qt_progress_start(qt_progress *p, FILE *f, int tty, const char *what, double total, const char *unit);
/* done units so far (not an increment); prints when due */
void qt_progress_set(qt_progress *p, double done);
/* Ends the line on a terminal; off one, says the total time when a line was printed. */
void qt_progress_end(qt_progress *p);

/* "1h02m", "3m05s", "12s"; "?" when unknown. */
void qt_format_duration(char *buf, size_t cap, double s);

#endif
