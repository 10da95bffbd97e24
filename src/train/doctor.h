/* `qtune doctor`: what this machine and build offer (CPU features, BLAS and
 * its threading, OpenMP, MPI, CUDA, memory, disk), a job file checked for
 * every problem that would stop or slow a run, and the table of known
 * failures with the exact text qtune prints for each (core/messages.h and
 * the owners' constants, so the table and the code share one string). */
#ifndef QT_TRAIN_DOCTOR_H
#define QT_TRAIN_DOCTOR_H

#include <stdio.h>

typedef struct {
    const char *symptom; /* what the user sees */
    const char *cause;
    const char *fix;
    const char *message; /* the printf format qtune prints, from its constant */
    const char *constant; /* the constant's name, for grepping */
} qt_known_failure;

/* The table; *n gets its length. */
const qt_known_failure *qt_doctor_known_failures(int *n);
/* Prints the table, message formats rendered with <number>/<text> placeholders. */
void qt_doctor_print_failures(FILE *f);
/* Renders a printf format for display: each conversion becomes <number> or
 * <text>, "%%" becomes "%". Writes at most cap bytes (NUL-terminated). */
void qt_doctor_render_format(const char *fmt, char *out, size_t cap);

/* Prints the environment report; returns the number of warnings (things
 * that will not stop a run but make it slow or fragile). ranks: the
 * data-parallel ranks that will share this host (for thread accounting). */
int qt_doctor_environment(FILE *f, int ranks);

/* Checks a job file and prints one line per problem, each naming the file,
 * the field and what to do; also the memory and disk it needs against what
 * this host has. Returns the number of problems (0: the job should start). */
int qt_doctor_check_job(FILE *f, const char *job_path, const char *const *sets, int n_sets, int ranks, int strict);

#endif
