#include "core/error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static _Thread_local char err_msg[2048];
static _Thread_local char err_where[256];
static _Thread_local int err_code;

/* Messages name files, and a path can be thousands of characters long: a
 * word (a run without spaces) longer than ELIDE_MAX keeps its first
 * ELIDE_HEAD and last ELIDE_TAIL characters around "...", so a 5,000-character
 * path costs about 150 and the sentence stays readable. */
#define ELIDE_MAX 200
#define ELIDE_HEAD 60
#define ELIDE_TAIL 80
#define FORMAT_CAP 16384

static void elide_into(char *dst, size_t cap, const char *src) {
    size_t n = 0;
    while (*src && n + 1 < cap) {
        size_t w = strcspn(src, " ");
        if (w > ELIDE_MAX) {
            int k = snprintf(dst + n, cap - n, "%.*s...%.*s", ELIDE_HEAD, src, ELIDE_TAIL, src + w - ELIDE_TAIL);
            n += k > 0 ? (size_t)k : 0;
            if (n >= cap) n = cap - 1;
            src += w;
            continue;
        }
        size_t take = w + (src[w] == ' ');
        if (take == 0) take = 1;
        if (take > cap - 1 - n) take = cap - 1 - n;
        memcpy(dst + n, src, take);
        n += take;
        src += take;
    }
    dst[n] = 0;
}

static _Thread_local char fmt_buf[FORMAT_CAP];

int qt_error_at(int code, const char *file, int line, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(fmt_buf, sizeof fmt_buf, fmt, ap);
    va_end(ap);
    elide_into(err_msg, sizeof err_msg, fmt_buf);
    const char *base = strrchr(file, '/');
    snprintf(err_where, sizeof err_where, "%s:%d", base ? base + 1 : file, line);
    err_code = code;
    return code;
}

int qt_error_context(int code, const char *fmt, ...) {
    char prefix[1024], old[sizeof err_msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(fmt_buf, sizeof fmt_buf, fmt, ap);
    va_end(ap);
    elide_into(prefix, sizeof prefix, fmt_buf);
    memcpy(old, err_msg, sizeof old);
    /* truncation is fine: a long context is still the same sentence, cut */
    size_t n = strlen(prefix);
    if (n > sizeof err_msg - 3) n = sizeof err_msg - 3;
    memcpy(err_msg, prefix, n);
    memcpy(err_msg + n, ": ", 2);
    size_t rest = sizeof err_msg - n - 3;
    size_t m = strlen(old);
    if (m > rest) m = rest;
    memcpy(err_msg + n + 2, old, m);
    err_msg[n + 2 + m] = 0;
    if (err_code == QT_OK) err_code = code;
    return code;
}

int qt_error_oom_advice(int code, const char *advice) {
    static const char head[] = "could not allocate ";
    if (code != QT_ENOMEM || strncmp(err_msg, head, sizeof head - 1)) return code;
    char *cut = strstr(err_msg, "; ");
    if (!cut) return code;
    snprintf(cut, sizeof err_msg - (size_t)(cut - err_msg), "; %s", advice);
    return code;
}

const char *qt_error_message(void) { return err_msg; }
const char *qt_error_where(void) { return err_where; }
int qt_error_code(void) { return err_code; }

void qt_error_clear(void) {
    err_msg[0] = 0;
    err_where[0] = 0;
    err_code = QT_OK;
}

static volatile sig_atomic_t *cancel_flag;

void qt_cancel_watch(volatile sig_atomic_t *flag) { cancel_flag = flag; }
int qt_cancel_requested(void) { return cancel_flag && *cancel_flag; }
