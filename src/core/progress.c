#include "core/progress.h"

#include <stdlib.h>
#include <string.h>

#include "core/clock.h"

void qt_format_duration(char *buf, size_t cap, double s) {
    if (!(s >= 0) || s > 1e8) {
        snprintf(buf, cap, "?");
        return;
    }
    long x = (long)(s + 0.5);
    if (x >= 3600) snprintf(buf, cap, "%ldh%02ldm", x / 3600, (x / 60) % 60);
    else if (x >= 60) snprintf(buf, cap, "%ldm%02lds", x / 60, x % 60);
    else snprintf(buf, cap, "%lds", x);
}

void qt_progress_start(qt_progress *p, FILE *f, int tty, const char *what, double total, const char *unit) {
    memset(p, 0, sizeof *p);
    p->f = f;
    p->tty = tty;
    snprintf(p->what, sizeof p->what, "%s", what);
    snprintf(p->unit, sizeof p->unit, "%s", unit ? unit : "");
    p->total = total;
    p->t0 = p->last = qt_now_s();
    const char *e = getenv("QTUNE_PROGRESS_S");
    p->every_s = e && atof(e) > 0 ? atof(e) : QT_PROGRESS_EVERY_S;
}

static void show(qt_progress *p, double now) {
    const double el = now - p->t0;
    char eta[48] = "", elapsed[32];
    qt_format_duration(elapsed, sizeof elapsed, el);
    if (p->total > 0 && p->done > 0 && p->done < p->total) {
        char d[32];
        qt_format_duration(d, sizeof d, el / p->done * (p->total - p->done));
        snprintf(eta, sizeof eta, ", ETA %s", d);
    }
    char amount[96];
    if (p->total > 0)
        snprintf(amount, sizeof amount, "%.0f/%.0f %s (%.0f%%)", p->done, p->total, p->unit, 100.0 * p->done / p->total);
    else snprintf(amount, sizeof amount, "%.0f %s", p->done, p->unit);
    if (p->tty) fprintf(p->f, "\r\033[Kqtune: %s: %s, %s%s", p->what, amount, elapsed, eta);
    else fprintf(p->f, "qtune: %s: %s after %s%s\n", p->what, amount, elapsed, eta);
    fflush(p->f);
    p->shown = 1;
    p->last = now;
}

void qt_progress_set(qt_progress *p, double done) {
    if (!p || !p->f) return;
    p->done = done;
    const double now = qt_now_s();
    if (now - p->last >= (p->tty ? 0.2 : p->every_s)) show(p, now);
}

void qt_progress_end(qt_progress *p) {
    if (!p || !p->f || !p->shown) return;
    const double now = qt_now_s();
    if (p->tty) {
        show(p, now);
        fputc('\n', p->f);
    } else {
        char el[32];
        qt_format_duration(el, sizeof el, now - p->t0);
        fprintf(p->f, "qtune: %s: done, %.0f %s in %s\n", p->what, p->done, p->unit, el);
    }
    fflush(p->f);
}
