/* Logging to stderr. Levels: error < warn < info < debug. QTUNE_LOG=debug
 * (environment) turns on the developer log, which includes file:line. The
 * level is read once by the CLI and passed in with qt_log_set_level. */
#ifndef QT_CORE_LOG_H
#define QT_CORE_LOG_H

enum { QT_LOG_ERROR = 0, QT_LOG_WARN = 1, QT_LOG_INFO = 2, QT_LOG_DEBUG = 3 };
/* or-ed into a level: a message about this rank alone (qt_warn_rank) */
#define QT_LOG_RANK_OWN 0x100

void qt_log_set_level(int level);
int qt_log_level(void);
/* Under MPI every rank but the main one is quiet: rank 0 says the warnings
 * and notes that every rank would repeat (they read the same job, model and
 * data), and another rank says only what concerns it alone (qt_warn_rank).
 * Set once by the CLI, as the level is. */
void qt_log_set_rank_quiet(int quiet);
void qt_log_at(int level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

#define qt_warn(...) qt_log_at(QT_LOG_WARN, __FILE__, __LINE__, __VA_ARGS__)
#define qt_info(...) qt_log_at(QT_LOG_INFO, __FILE__, __LINE__, __VA_ARGS__)
#define qt_warn_rank(...) qt_log_at(QT_LOG_WARN | QT_LOG_RANK_OWN, __FILE__, __LINE__, __VA_ARGS__)
#define qt_debug(...) qt_log_at(QT_LOG_DEBUG, __FILE__, __LINE__, __VA_ARGS__)

#endif
