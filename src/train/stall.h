/* A run that cannot make progress ends with the reason (stall.c): the
 * address space the backend's BLAS still has to map is checked before the
 * first step, and a watchdog thread ends a step stuck where it cannot go on. */
#ifndef QT_TRAIN_STALL_H
#define QT_TRAIN_STALL_H

#include "backend/backend.h"

/* QT_OK when the BLAS buffers of `threads` calling threads that are not
 * mapped yet (d->blas_thread_vm each) fit under RLIMIT_AS beside what the
 * process maps now; else QT_ENOMEM with a sentence that names the limit, the
 * need and what to set. `what` starts the sentence ("training"). */
/* The OpenMP team's threads and their malloc arenas (64 MiB of address space
 * each), made now: they exist by the first step anyway, and made first they
 * are mapped before the step's own allocations, whatever op first starts the
 * team (small products run on the calling thread and start none). */
void qt_stall_make_threads(int threads);
int qt_stall_check_address_space(const qt_backend_desc *d, int threads, const char *what);

typedef struct qt_stall qt_stall;
/* Starts the watchdog (reads QTUNE_STEP_TIMEOUT). */
int qt_stall_start(const qt_backend_desc *d, int threads, qt_stall **out);
/* Progress: `what` ("step 12", "evaluation at step 10") starts now; NULL:
 * nothing is running that the watchdog should time. */
void qt_stall_enter(qt_stall *s, const char *what);
void qt_stall_stop(qt_stall *s);

#endif
