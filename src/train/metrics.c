/* metrics.jsonl, loss.svg, report.html's rows and the TensorBoard scalars. */
#include "train/metrics.h"

#include "train/report.h"

#include "core/clock.h"
#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <string.h>
#include <sys/resource.h>

#define METRICS_MAX_BYTES ((size_t)1 << 30)
#define SVG_MAX_POINTS 2000
#define REPORT_MAX_ROWS 4000
#define REPORT_REFRESH_S 15
#define REPORT_MIN_INTERVAL_S 2.0 /* a run logging many steps a second rewrites the page this often at most */

/* The process's peak resident memory: Linux's VmHWM, the high-water mark of
 * this program's own address space. Not getrusage's ru_maxrss, which Linux
 * carries across execve: a qtune started by a large parent (a Python process
 * holding 900 MiB, a shell under a fat launcher) would report the parent's
 * size before the exec as its own peak. ru_maxrss only where /proc is absent. */
int64_t qt_peak_rss_bytes(void) {
    FILE *f = fopen("/proc/self/status", "r");
    if (f) {
        char line[256];
        long long kib = -1;
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "VmHWM: %lld kB", &kib) == 1) break;
        fclose(f);
        if (kib >= 0) return (int64_t)kib * 1024;
    }
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
    return (int64_t)ru.ru_maxrss * 1024; /* Linux reports KiB */
}

static int push_point(qt_metrics_point **a, size_t *n, size_t *cap, long step, double x, int skipped) {
    if (*n == *cap) {
        size_t nc = *cap ? *cap * 2 : 256;
        qt_metrics_point *na = qt_realloc(*a, nc * sizeof **a, "loss curve points");
        if (!na) return QT_ENOMEM;
        *a = na;
        *cap = nc;
    }
    (*a)[(*n)++] = (qt_metrics_point){step, x, skipped};
    return QT_OK;
}

static int push(qt_metrics_point **a, size_t *n, size_t *cap, long step, double x) {
    return push_point(a, n, cap, step, x, 0);
}

/* A metrics.jsonl line kept for report.html, each '<' as \u003c (only a
 * JSON string can hold one, where the escape reads the same). */
static int row_push(qt_metrics *m, const char *line, int keep) {
    if (m->n_row == m->cap_row) {
        size_t nc = m->cap_row ? m->cap_row * 2 : 256;
        qt_metrics_row *nr = qt_realloc(m->row, nc * sizeof *nr, "report.html rows");
        if (!nr) return QT_ENOMEM;
        m->row = nr;
        m->cap_row = nc;
    }
    size_t off = m->rows.n;
    for (const char *p = line; *p;) {
        size_t k = strcspn(p, "<");
        QT_TRY(qt_strbuf_put(&m->rows, p, k));
        p += k;
        if (*p) {
            QT_TRY(qt_strbuf_put(&m->rows, "\\u003c", 6));
            p++;
        }
    }
    m->row[m->n_row++] = (qt_metrics_row){off, m->rows.n - off, keep};
    return QT_OK;
}

/* Keeps lines with step <= keep_until; reloads the curve from them. */
static int metrics_trim(qt_metrics *m, long keep_until) {
    if (!qt_path_exists(m->path)) return QT_OK;
    char *text;
    size_t len;
    QT_TRY(qt_read_file(m->path, METRICS_MAX_BYTES, &text, &len));
    char *out = qt_malloc(len + 1, "metrics.jsonl");
    if (!out) { qt_free(text); return QT_ENOMEM; }
    size_t on = 0;
    int rc = QT_OK;
    for (char *line = text; rc == QT_OK && *line;) {
        char *nl = strchr(line, '\n');
        size_t ll = nl ? (size_t)(nl - line) : strlen(line);
        char save = line[ll];
        line[ll] = 0;
        cJSON *j = cJSON_Parse(line);
        const cJSON *st = cJSON_GetObjectItemCaseSensitive(j, "step");
        if (cJSON_IsNumber(st) && st->valuedouble <= (double)keep_until) {
            memcpy(out + on, line, ll);
            on += ll;
            out[on++] = '\n';
            const cJSON *el = cJSON_GetObjectItemCaseSensitive(j, "eval_loss");
            const cJSON *lo = cJSON_GetObjectItemCaseSensitive(j, "loss");
            if (cJSON_IsNumber(el)) rc = push(&m->eval, &m->n_eval, &m->cap_eval, (long)st->valuedouble, el->valuedouble);
            else if (cJSON_IsNumber(lo) || cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(j, "skipped")))
                rc = push_point(&m->train, &m->n_train, &m->cap_train, (long)st->valuedouble,
                                cJSON_IsNumber(lo) ? lo->valuedouble : NAN,
                                cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(j, "skipped")));
            /* the line as cJSON reads it (a line with text after its object is cut there) */
            char *row = rc == QT_OK ? cJSON_PrintUnformatted(j) : NULL;
            if (rc == QT_OK && !row) rc = QT_ENOMEM;
            if (rc == QT_OK)
                rc = row_push(m, row, el != NULL || cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(j, "skipped")));
            cJSON_free(row);
        }
        cJSON_Delete(j);
        line[ll] = save;
        line += nl ? ll + 1 : ll;
    }
    if (rc == QT_OK) rc = qt_write_file_atomic(m->path, out, on);
    qt_free(out);
    qt_free(text);
    return rc;
}

int qt_metrics_open(qt_metrics *m, const char *output_dir, long keep_until, const char *title) {
    memset(m, 0, sizeof *m);
    QT_TRY(qt_path_join(m->path, sizeof m->path, output_dir, "metrics.jsonl"));
    QT_TRY(qt_path_join(m->svg_path, sizeof m->svg_path, output_dir, "loss.svg"));
    QT_TRY(qt_path_join(m->html_path, sizeof m->html_path, output_dir, "report.html"));
    snprintf(m->title, sizeof m->title, "%s", title ? title : "loss");
    int rc = keep_until >= 0 ? metrics_trim(m, keep_until) : QT_OK;
    if (rc == QT_OK) {
        m->f = fopen(m->path, keep_until >= 0 ? "ab" : "wb");
        if (!m->f) rc = QT_ERR(QT_EIO, "cannot open %s: %s", m->path, strerror(errno));
    }
    if (rc != QT_OK) qt_metrics_close(m);
    return rc;
}

/* JSON number, or null for NaN/inf (JSON has no spelling for them) */
static void jnum(char *buf, size_t cap, double x) {
    if (isfinite(x)) snprintf(buf, cap, "%.9g", x);
    else snprintf(buf, cap, "null");
}

static int metrics_line(qt_metrics *m, const char *line) {
    if (fputs(line, m->f) < 0 || fputc('\n', m->f) < 0 || fflush(m->f) != 0)
        return QT_ERR(QT_EIO, "cannot write %s: %s; check free disk space", m->path, strerror(errno));
    return QT_OK;
}

int qt_metrics_log_step(qt_metrics *m, const qt_step_metrics *s) {
    char loss[40], lr[40], gn[40], ls[40], tps[40], el[40], ep[40], cs[40], line[4096];
    jnum(loss, sizeof loss, s->loss);
    jnum(lr, sizeof lr, s->lr);
    jnum(gn, sizeof gn, s->grad_norm);
    jnum(ls, sizeof ls, s->loss_scale);
    jnum(tps, sizeof tps, s->tokens_per_s);
    jnum(el, sizeof el, s->elapsed_s);
    jnum(ep, sizeof ep, s->epoch);
    jnum(cs, sizeof cs, s->comm_s);
    /* the fixed fields, then the optional ones, then the closing brace */
    size_t len = (size_t)snprintf(
        line, sizeof line,
        "{\"step\": %ld, \"loss\": %s, \"lr\": %s, \"grad_norm\": %s, \"loss_scale\": %s, \"skipped\": %s, "
        "\"tokens\": %lld, \"target_tokens\": %lld, \"tokens_per_s\": %s, \"elapsed_s\": %s, "
        "\"mem_peak_bytes\": %lld, \"epoch\": %s, \"opt_state_bytes\": %lld, \"comm_s\": %s",
        s->step, loss, lr, gn, ls, s->skipped ? "true" : "false", (long long)s->tokens, (long long)s->target_tokens,
        tps, el, (long long)s->mem_peak_bytes, ep, (long long)s->opt_state_bytes, cs);
    if (s->device_peak_bytes > 0) /* a GPU's (or the guard's) own memory, beside the host's RSS */
        len += (size_t)snprintf(line + len, sizeof line - len, ", \"device_peak_bytes\": %lld",
                                (long long)s->device_peak_bytes);
    if (s->n_ranks > 1) { /* the per-rank figures */
        char busy[40], wait[40];
        jnum(busy, sizeof busy, s->comm_busy_s);
        jnum(wait, sizeof wait, s->comm_wait_s);
        len += (size_t)snprintf(line + len, sizeof line - len, ", \"comm_busy_s\": %s, \"comm_wait_s\": %s, "
                                "\"mem_peak_bytes_ranks\": [", busy, wait);
        for (int r = 0; r < s->n_ranks && len < sizeof line - 32; r++)
            len += (size_t)snprintf(line + len, sizeof line - len, "%s%lld", r ? ", " : "",
                                    (long long)s->mem_peak_ranks[r]);
        len += (size_t)snprintf(line + len, sizeof line - len, "]");
    }
    if (s->extra && len < sizeof line) len += (size_t)snprintf(line + len, sizeof line - len, "%s", s->extra);
    if (len >= sizeof line - 2) len = sizeof line - 2; /* cut short rather than unterminated */
    snprintf(line + len, sizeof line - len, "}");
    QT_TRY(metrics_line(m, line));
    QT_TRY(row_push(m, line, s->skipped));
    if (isfinite(s->loss) || s->skipped)
        QT_TRY(push_point(&m->train, &m->n_train, &m->cap_train, s->step, isfinite(s->loss) ? s->loss : NAN,
                          s->skipped));
    if (m->tb) {
        /* the HF Trainer's names: its logs' keys under "train/" (rewrite_logs) */
        const struct { const char *tag; double x; } sc[] = {
            {"train/loss", s->loss}, {"train/learning_rate", s->lr}, {"train/grad_norm", s->grad_norm},
            {"train/epoch", s->epoch}, {"train/loss_scale", s->loss_scale}, {"train/skipped", s->skipped},
            {"train/tokens_per_s", s->tokens_per_s}};
        for (size_t i = 0; i < sizeof sc / sizeof sc[0]; i++)
            if (isfinite(sc[i].x)) QT_TRY(qt_tb_scalar(m->tb, sc[i].tag, s->step, 0, (float)sc[i].x));
    }
    return QT_OK;
}

int qt_metrics_log_eval(qt_metrics *m, long step, double eval_loss, int64_t tokens, double elapsed_s) {
    char l[40], p[40], el[40], line[512];
    jnum(l, sizeof l, eval_loss);
    jnum(p, sizeof p, exp(eval_loss));
    jnum(el, sizeof el, elapsed_s);
    snprintf(line, sizeof line, "{\"step\": %ld, \"eval_loss\": %s, \"eval_ppl\": %s, \"eval_tokens\": %lld, \"elapsed_s\": %s}",
             step, l, p, (long long)tokens, el);
    QT_TRY(metrics_line(m, line));
    QT_TRY(row_push(m, line, 1));
    if (isfinite(eval_loss)) QT_TRY(push(&m->eval, &m->n_eval, &m->cap_eval, step, eval_loss));
    if (m->tb && isfinite(eval_loss)) { /* eval_loss is the Trainer's eval/loss */
        QT_TRY(qt_tb_scalar(m->tb, "eval/loss", step, 0, (float)eval_loss));
        if (isfinite(exp(eval_loss))) QT_TRY(qt_tb_scalar(m->tb, "eval/ppl", step, 0, (float)exp(eval_loss)));
    }
    return QT_OK;
}

int qt_metrics_log_eval_fields(qt_metrics *m, long step, double eval_loss, const char *fields, int64_t pairs,
                               double elapsed_s) {
    char el[40], line[1536];
    jnum(el, sizeof el, elapsed_s);
    /* fields starts with ", ": the first of them takes the step's place after the brace */
    snprintf(line, sizeof line, "{\"step\": %ld%s, \"eval_pairs\": %lld, \"elapsed_s\": %s}", step, fields,
             (long long)pairs, el);
    QT_TRY(metrics_line(m, line));
    QT_TRY(row_push(m, line, 1));
    if (isfinite(eval_loss)) QT_TRY(push(&m->eval, &m->n_eval, &m->cap_eval, step, eval_loss));
    if (m->tb && isfinite(eval_loss)) QT_TRY(qt_tb_scalar(m->tb, "eval/loss", step, 0, (float)eval_loss));
    return QT_OK;
}

int qt_metrics_write_svg(const qt_metrics *m) {
    return qt_loss_svg_write(m->svg_path, m->title, m->train, m->n_train, m->eval, m->n_eval);
}

void qt_metrics_set_report(qt_metrics *m, const char *device, long max_steps, uint64_t plan_rank_bytes,
                           uint64_t plan_device_bytes) {
    snprintf(m->device, sizeof m->device, "%s", device ? device : "");
    m->max_steps = max_steps;
    m->plan_rank_bytes = plan_rank_bytes;
    m->plan_device_bytes = plan_device_bytes;
}

int qt_metrics_write_report(qt_metrics *m, const char *status) {
    double now = qt_now_s();
    if (!strcmp(status, "running") && m->report_written_s > 0 && now - m->report_written_s < REPORT_MIN_INTERVAL_S)
        return QT_OK;
    m->report_written_s = now;
    /* a long run: every stride-th train line (and the last), so the page
     * rewritten at every log line stays a few MB; evals and skipped steps all */
    size_t n_train = 0, last_train = 0;
    for (size_t i = 0; i < m->n_row; i++)
        if (!m->row[i].keep) n_train++, last_train = i;
    size_t stride = n_train > REPORT_MAX_ROWS ? (n_train + REPORT_MAX_ROWS - 1) / REPORT_MAX_ROWS : 1;
    qt_strbuf b = {0};
    int rc = QT_OK;
    for (size_t i = 0, k = 0; rc == QT_OK && i < m->n_row; i++) {
        const qt_metrics_row *r = &m->row[i];
        int take = r->keep || k++ % stride == 0 || i == last_train;
        if (!take) continue;
        if (b.n) rc = qt_strbuf_put(&b, ",", 1);
        if (rc == QT_OK) rc = qt_strbuf_put(&b, m->rows.p + r->off, r->len);
    }
    qt_report_info info = {
        .title = m->title, .status = status, .device = m->device[0] ? m->device : NULL, .max_steps = m->max_steps,
        .refresh_s = REPORT_REFRESH_S, .plan_rank_bytes = m->plan_rank_bytes, .plan_device_bytes = m->plan_device_bytes,
        .rows_total = (long)m->n_row, .stride = (long)stride,
    };
    if (rc == QT_OK) rc = qt_report_html_write(m->html_path, &info, b.p ? b.p : "", b.n);
    qt_free(b.p);
    return rc;
}

int qt_metrics_open_tensorboard(qt_metrics *m, const char *logdir) {
    QT_TRY(qt_tb_open(&m->tb, logdir));
    return QT_OK;
}

void qt_metrics_close(qt_metrics *m) {
    if (m->f) fclose(m->f);
    qt_tb_close(m->tb);
    qt_free(m->rows.p);
    qt_free(m->row);
    qt_free(m->train);
    qt_free(m->eval);
    memset(m, 0, sizeof *m);
}

/* ---------------------------------------------------------------------------
 * loss.svg: a plain line chart, no scripts, no external references */

typedef struct {
    char *buf;
    size_t n, cap;
    int oom;
} sbuf;

static void sb_printf(sbuf *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *s, const char *fmt, ...) {
    if (s->oom) return;
    for (;;) {
        va_list ap;
        va_start(ap, fmt);
        int k = vsnprintf(s->buf ? s->buf + s->n : NULL, s->cap - s->n, fmt, ap); /* NULL + 0 is UB */
        va_end(ap);
        if (k < 0) { s->oom = 1; return; }
        if ((size_t)k < s->cap - s->n) { s->n += (size_t)k; return; }
        size_t nc = (s->cap + (size_t)k + 1) * 2;
        char *nb = qt_realloc(s->buf, nc, "loss.svg");
        if (!nb) { s->oom = 1; return; }
        s->buf = nb;
        s->cap = nc;
    }
}

/* A "nice" tick step (1, 2 or 5 times a power of ten) for about n ticks. */
static double nice_step(double range, int n) {
    if (!(range > 0)) return 1;
    double raw = range / n, p = pow(10, floor(log10(raw))), f = raw / p;
    return (f < 1.5 ? 1 : f < 3.5 ? 2 : f < 7.5 ? 5 : 10) * p;
}

static void xml_escape(sbuf *s, const char *t) {
    for (; *t; t++) {
        if (*t == '<') sb_printf(s, "&lt;");
        else if (*t == '>') sb_printf(s, "&gt;");
        else if (*t == '&') sb_printf(s, "&amp;");
        else if (*t == '"') sb_printf(s, "&quot;");
        else sb_printf(s, "%c", *t);
    }
}

int qt_loss_svg_write(const char *path, const char *title, const qt_metrics_point *train, size_t n_train,
                      const qt_metrics_point *eval, size_t n_eval) {
    const double W = 800, H = 450, L = 70, R = 20, T = 40, B = 50; /* canvas and margins */
    double x0 = 1e300, x1 = -1e300, y0 = 1e300, y1 = -1e300;
    size_t n_skip = 0;
    for (size_t i = 0; i < n_train; i++) {
        x0 = fmin(x0, (double)train[i].step); x1 = fmax(x1, (double)train[i].step);
        n_skip += train[i].skipped != 0;
        if (isnan(train[i].x)) continue;
        y0 = fmin(y0, train[i].x); y1 = fmax(y1, train[i].x);
    }
    for (size_t i = 0; i < n_eval; i++) {
        x0 = fmin(x0, (double)eval[i].step); x1 = fmax(x1, (double)eval[i].step);
        y0 = fmin(y0, eval[i].x); y1 = fmax(y1, eval[i].x);
    }
    if (x0 > x1) { x0 = 0; x1 = 1; }
    if (y0 > y1) { y0 = 0; y1 = 1; }
    if (x1 - x0 < 1) x1 = x0 + 1;
    if (y1 - y0 < 1e-6) { y0 -= 0.5; y1 += 0.5; }
    double ys = nice_step(y1 - y0, 6), xs = nice_step(x1 - x0, 8);
    y0 = floor(y0 / ys) * ys;
    y1 = ceil(y1 / ys) * ys;
#define PX(v) (L + ((v) - x0) / (x1 - x0) * (W - L - R))
#define PY(v) (H - B - ((v) - y0) / (y1 - y0) * (H - T - B))
    sbuf s = {0};
    sb_printf(&s, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
                  "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%g\" height=\"%g\" viewBox=\"0 0 %g %g\" "
                  "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
              W, H, W, H);
    sb_printf(&s, "<text x=\"%g\" y=\"24\" font-size=\"15\">", L);
    xml_escape(&s, title ? title : "loss");
    sb_printf(&s, "</text>\n");
    for (double y = y0; y <= y1 + ys * 1e-6; y += ys)
        sb_printf(&s, "<line x1=\"%g\" y1=\"%.1f\" x2=\"%g\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                      "<text x=\"%g\" y=\"%.1f\" text-anchor=\"end\">%.4g</text>\n",
                  L, PY(y), W - R, PY(y), L - 6, PY(y) + 4, y);
    for (double x = ceil(x0 / xs) * xs; x <= x1 + xs * 1e-6; x += xs)
        sb_printf(&s, "<line x1=\"%.1f\" y1=\"%g\" x2=\"%.1f\" y2=\"%g\" stroke=\"#eee\"/>"
                      "<text x=\"%.1f\" y=\"%g\" text-anchor=\"middle\">%.0f</text>\n",
                  PX(x), T, PX(x), H - B, PX(x), H - B + 16, x);
    sb_printf(&s, "<rect x=\"%g\" y=\"%g\" width=\"%g\" height=\"%g\" fill=\"none\" stroke=\"#444\"/>\n", L, T,
              W - L - R, H - T - B);
    sb_printf(&s, "<text x=\"%g\" y=\"%g\" text-anchor=\"middle\">optimizer step</text>\n", (L + W - R) / 2, H - 12);
    sb_printf(&s, "<text x=\"16\" y=\"%g\" text-anchor=\"middle\" transform=\"rotate(-90 16 %g)\">loss (nats/token)</text>\n",
              (T + H - B) / 2, (T + H - B) / 2);
    if (n_train) {
        /* at most SVG_MAX_POINTS points: a long run's curve is drawn from bucket
         * means, so the file (rewritten at every log line) stays small */
        size_t per = (n_train + SVG_MAX_POINTS - 1) / SVG_MAX_POINTS;
        sb_printf(&s, "<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" points=\"");
        for (size_t i = 0; i < n_train; i += per) {
            size_t e = i + per < n_train ? i + per : n_train;
            double sx = 0, sy = 0;
            size_t k_n = 0;
            for (size_t k = i; k < e; k++)
                if (!isnan(train[k].x)) sx += (double)train[k].step, sy += train[k].x, k_n++;
            if (k_n) sb_printf(&s, "%.1f,%.1f ", PX(sx / (double)k_n), PY(sy / (double)k_n));
        }
        sb_printf(&s, "\"/>\n");
    }
    /* steps that applied no update (an fp16 overflow, a batch without labels): a red tick on the step axis */
    for (size_t i = 0; i < n_train; i++)
        if (train[i].skipped)
            sb_printf(&s, "<line class=\"skipped\" x1=\"%.1f\" y1=\"%g\" x2=\"%.1f\" y2=\"%g\" stroke=\"#d62728\" "
                          "stroke-width=\"2\"><title>step %ld skipped</title></line>\n",
                      PX((double)train[i].step), H - B - 10, PX((double)train[i].step), H - B, train[i].step);
    if (n_skip)
        sb_printf(&s, "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"#d62728\" stroke-width=\"2\"/>"
                      "<text x=\"%g\" y=\"%g\">%zu skipped step%s (no update)</text>\n",
                  L + 10, T + 10, L + 10, T + 20, L + 16, T + 18, n_skip, n_skip == 1 ? "" : "s");
    if (n_eval) {
        sb_printf(&s, "<polyline fill=\"none\" stroke=\"#ff7f0e\" stroke-width=\"2\" points=\"");
        for (size_t i = 0; i < n_eval; i++) sb_printf(&s, "%.1f,%.1f ", PX((double)eval[i].step), PY(eval[i].x));
        sb_printf(&s, "\"/>\n");
        for (size_t i = 0; i < n_eval; i++)
            sb_printf(&s, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"#ff7f0e\"/>\n", PX((double)eval[i].step),
                      PY(eval[i].x));
    }
    sb_printf(&s, "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"#1f77b4\" stroke-width=\"2\"/>"
                  "<text x=\"%g\" y=\"%g\">train loss</text>\n",
              W - R - 190, T + 14, W - R - 170, T + 14, W - R - 165, T + 18);
    sb_printf(&s, "<line x1=\"%g\" y1=\"%g\" x2=\"%g\" y2=\"%g\" stroke=\"#ff7f0e\" stroke-width=\"2\"/>"
                  "<text x=\"%g\" y=\"%g\">eval loss</text>\n",
              W - R - 90, T + 14, W - R - 70, T + 14, W - R - 65, T + 18);
    sb_printf(&s, "</svg>\n");
#undef PX
#undef PY
    if (s.oom) { qt_free(s.buf); return QT_ERR(QT_ENOMEM, "out of memory drawing %s", path); }
    int rc = qt_write_file_atomic(path, s.buf, s.n);
    qt_free(s.buf);
    return rc;
}
