/* Shared by dist.c and zero.c only: the process-group struct and the
 * deadline-checked wait every collective goes through. */
#ifndef QT_DIST_INTERNAL_H
#define QT_DIST_INTERNAL_H

#include "dist/dist.h"

#include <signal.h>

#include "dist/transport.h"
#include "qtune_config.h"

/* A build can be forced to the single-process path (tests of that path). */
#if QTUNE_HAVE_MPI && !defined(QT_DIST_FORCE_NO_MPI)
#define QT_DIST_MPI 1
#include <mpi.h>
#else
#define QT_DIST_MPI 0
#endif

struct dist_ctx {
    int rank, world;
    int mpi_on;            /* MPI is in use for this run */
    int owns_mpi;          /* dist_init called MPI_Init (so dist_finalize ends it) */
    double timeout_s;      /* collective deadline */
    double user_timeout_s; /* QTUNE_DIST_TIMEOUT or the default: phases add to it */
    double comm_s;         /* seconds spent waiting in collectives */
    int64_t seq;           /* collectives this rank has entered (for the timeout report) */
    const char *volatile cur_what; /* the collective being waited on, or NULL */
    volatile int aborting; /* this rank is ending the job and has said why */
    int own_sigterm;       /* dist_init installed its SIGTERM handler (none was there) */
    volatile sig_atomic_t *stop_flag; /* the program's stop flag (dist_set_stop_flag) or NULL */
    int stop_noted;        /* a wait after a stop request was reported (once) */
    tp_stats tp;           /* transport counters (transport_mpi.c) */
    struct qt_backend *stage_be; /* dist_set_backend: a backend whose device memory the host cannot
                                    read, so each collective goes through host copies; NULL: none */
    struct dist_hccl *hccl; /* the device collectives over HCCL (npu ranks), or NULL: MPI */
#if QT_DIST_MPI
    MPI_Comm comm;         /* collectives */
    MPI_Comm ctl;          /* liveness queries when a deadline passes */
#endif
};

#if QT_DIST_MPI
/* One wait with a deadline: start, tick in the polling loop, end. A tick
 * answers other ranks' liveness queries and, past the deadline, reports which
 * ranks stopped responding and aborts the job (it does not return then). */
typedef struct {
    double t0, deadline;
    long ticks;
    const char *what;
    double stop_seen_s; /* when this wait first saw the stop flag set; 0 before */
} dist_waiter;
void dist_waiter_start(dist_ctx *d, dist_waiter *w, const char *what);
void dist_waiter_tick(dist_ctx *d, dist_waiter *w);
void dist_waiter_end(dist_ctx *d, dist_waiter *w);
/* Waits for all n requests with the deadline. */
int dist_wait_all(dist_ctx *d, MPI_Request *reqs, int n, const char *what);
/* Turns an MPI error code into QT_EDIST with a sentence naming the call. */
int dist_mpi_fail(dist_ctx *d, int mpi_rc, const char *call, const char *what);
#define DIST_MPI_CHECK(d, call, what)                                  \
    do {                                                               \
        int dist_rc_ = (call);                                         \
        if (dist_rc_ != MPI_SUCCESS) return dist_mpi_fail((d), dist_rc_, #call, (what)); \
    } while (0)
#endif

#if QT_DIST_MPI
/* MPI start-up's deadline (startup.c): begin before MPI_Init starts a
 * watchdog that, past timeout_s, names the ranks that never arrived and ends
 * the process; end after the last blocking start-up call stops it. */
struct dist_startup;
int dist_startup_begin(double timeout_s, struct dist_startup **out);
void dist_startup_end(struct dist_startup *s);
#endif

/* transport_hccl.c: transport.h's device collectives over HCCL (backend
 * "npu", world > 1), which transport_mpi.c hands them to once open. Each
 * queues its collective and gives its number on HCCL's stream (*seq) and,
 * where it made one, a device buffer to free when it completes (*tmp);
 * dist_hccl_test says when the stream has finished that number. */
int dist_hccl_open(dist_ctx *d, struct qt_backend *be);
void dist_hccl_close(dist_ctx *d);
int dist_hccl_allreduce(dist_ctx *d, float *buf, size_t count, int64_t *seq, const char *what);
int dist_hccl_reduce(dist_ctx *d, const float *send, float *recv, size_t count, int root, void **tmp, int64_t *seq,
                     const char *what);
int dist_hccl_reduce_scatter(dist_ctx *d, const float *send, float *recv, size_t count, int64_t *seq,
                             const char *what);
int dist_hccl_allgather(dist_ctx *d, const float *send, float *recv, size_t count, void **tmp, int64_t *seq,
                        const char *what);
int dist_hccl_bcast(dist_ctx *d, void *buf, size_t bytes, int root, int64_t *seq, const char *what);
int dist_hccl_test(dist_ctx *d, int64_t seq, int *done);

/* All-reduce of a few doubles with a per-value op, bitwise identical on every
 * rank (values are all-gathered and combined in rank order). */
int dist_allreduce_ops(dist_ctx *d, double *vals, const dist_op *ops, int n, const char *what);

#endif
