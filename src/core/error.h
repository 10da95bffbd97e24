/* Errors: every library function returns a status (QT_OK or a negative code)
 * and records one plain sentence for the user plus the __FILE__/__LINE__ where
 * it was raised, for the developer log. Only the CLI decides to exit.
 *
 * The message lives in a thread-local buffer, like errno: the last error raised
 * on this thread. Raise it where the problem is understood best (the parser
 * that knows the file and the field), and let callers pass the code upward. */
#ifndef QT_CORE_ERROR_H
#define QT_CORE_ERROR_H

#include <signal.h>
#include <stddef.h>

enum {
    QT_OK = 0,
    QT_EINVAL = -1,       /* bad argument or bad input data */
    QT_EIO = -2,          /* a read, write, open, rename or mmap failed */
    QT_ENOMEM = -3,       /* an allocation failed */
    QT_EFORMAT = -4,      /* a file is malformed */
    QT_EUNSUPPORTED = -5, /* valid, but a feature qtune does not implement */
    QT_EINTERRUPTED = -6, /* SIGINT/SIGTERM asked us to stop */
    QT_ENUMERIC = -7,     /* NaN/inf, loss-scale floor */
    QT_EDIST = -8,        /* a rank died, stalled, or a collective failed */
};

/* Records the message (printf-style) and where it was raised; returns code so
 * callers can write `return QT_ERR(QT_EINVAL, "...")`. */
int qt_error_at(int code, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
#define QT_ERR(code, ...) qt_error_at((code), __FILE__, __LINE__, __VA_ARGS__)

/* Prefixes context to the current message: "reading X: <old message>". */
int qt_error_context(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

const char *qt_error_message(void); /* "" when none */
const char *qt_error_where(void);   /* "file.c:123" */
int qt_error_code(void);
void qt_error_clear(void);

/* An out-of-memory error's advice (after "could not allocate N MiB for X; ")
 * replaced with one that fits where it happened, e.g. while a tokenizer loads,
 * where batch or ZeRO settings change nothing. Other errors pass unchanged.
 * Returns code. */
int qt_error_oom_advice(int code, const char *advice);
#define QT_TOKENIZER_OOM_ADVICE                                                                    \
    "loading a tokenizer needs memory for its vocabulary and merges only: free memory, or raise "    \
    "the process's memory limit (ulimit -v); the batch, seq_len and ZeRO settings do not change it"

/* Cancelling long loads: the CLI's signal handler sets a flag, the trainer
 * lends it here while it loads (NULL: none), and loops that may run for
 * minutes (hashing and tokenizing the data) poll qt_cancel_requested() and
 * return QT_EINTERRUPTED. Process-wide; reads only. */
void qt_cancel_watch(volatile sig_atomic_t *flag);
int qt_cancel_requested(void);

/* Propagate a non-OK status. */
#define QT_TRY(expr) do { int qt_try_rc_ = (expr); if (qt_try_rc_ != QT_OK) return qt_try_rc_; } while (0)

#endif
