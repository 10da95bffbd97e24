/* The process group: MPI start-up, scalar collectives, and the deadline that
 * turns a dead or hung rank into a message naming it (see dist.h).
 *
 * Why every collective is non-blocking + polled: a blocking MPI_Allreduce
 * whose peer died or hangs never returns, and OpenMPI only ends the job when
 * a process EXITS. Polling MPI_Test with a deadline lets a surviving rank
 * notice a peer that is alive but stuck, ask every rank whether it is still
 * answering (a tiny message on a separate communicator that ranks answer while
 * they poll), name the silent ones, and MPI_Abort the whole job. */
#define _GNU_SOURCE
#include "dist/dist_internal.h"
#include "core/clock.h"

#include "core/error.h"
#include "core/messages.h"
#include "core/log.h"
#include "core/mem.h"

#include <errno.h>
#include <math.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Reads an integer rank count from the launcher's environment, 0 if absent. */
static int launcher_world(void) {
    const char *names[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "PMI_SIZE", "SLURM_NTASKS"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        const char *v = getenv(names[i]);
        if (v && *v) {
            long n = strtol(v, NULL, 10);
            if (n > 0 && n < (1L << 24)) return (int)n;
        }
    }
    return 0;
}

static int launched_by_mpirun(void) {
    return getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK") || getenv("PMI_RANK");
}

static int read_timeout(double *out) {
    *out = DIST_DEFAULT_TIMEOUT_S;
    const char *v = getenv("QTUNE_DIST_TIMEOUT");
    if (!v || !*v) return QT_OK;
    char *end = NULL;
    errno = 0;
    double t = strtod(v, &end);
    if (errno || end == v || *end || !(t > 0) || !isfinite(t))
        return QT_ERR(QT_EINVAL, "QTUNE_DIST_TIMEOUT='%s' is not a positive number of seconds; set it to "
                                 "e.g. 600, or unset it for the default of %.0f s", v, DIST_DEFAULT_TIMEOUT_S);
    *out = t;
    return QT_OK;
}

int dist_built_with_mpi(void) { return QT_DIST_MPI; }

#if QT_DIST_MPI
/* ------------------------------------------------------------------------- */
/* The surviving side of a dead rank. When a process of the job dies, mpirun
 * prints which one and sends SIGTERM to the others (SIGKILL a second later);
 * without a word from them a user sees only "Terminated". A program with no
 * SIGTERM handler of its own gets one here at dist_init that says where this
 * rank was (async-signal-safe writes only) and then takes the default action.
 * A program with its own handler (qtune train: stop after the step and save)
 * keeps it: dist never swaps handlers (a swap around every wait would leave
 * a window where a SIGTERM finds the default action and kills a rank that
 * was asked to save). Such a
 * program hands dist its stop flag (dist_set_stop_flag), and a wait that
 * goes on after the flag was set says where the rank waits, from ordinary
 * code. The one piece of process-wide state here: a signal handler has no
 * other way to find the context. */
static dist_ctx *sig_ctx;
static struct sigaction sig_init_prev;
static volatile sig_atomic_t sig_noted;

static void put_str(char *buf, size_t cap, size_t *len, const char *s) {
    while (*s && *len + 1 < cap) buf[(*len)++] = *s++;
}

static void put_int(char *buf, size_t cap, size_t *len, long v) {
    char tmp[24];
    int n = 0;
    if (v < 0) { put_str(buf, cap, len, "-"); v = -v; }
    do { tmp[n++] = (char)('0' + v % 10); v /= 10; } while (v && n < 23);
    while (n && *len + 1 < cap) buf[(*len)++] = tmp[--n];
}

static void on_sigterm(int sig) {
    char msg[512];
    size_t n = 0;
    dist_ctx *d = sig_ctx;
    if (d && !d->aborting && !sig_noted) {
        sig_noted = 1;
        const char *what = d->cur_what;
        put_str(msg, sizeof msg, &n, "qtune: rank ");
        put_int(msg, sizeof msg, &n, d->rank);
        put_str(msg, sizeof msg, &n, ": SIGTERM from the MPI launcher");
        if (what) {
            put_str(msg, sizeof msg, &n, " while waiting in collective ");
            put_str(msg, sizeof msg, &n, what);
        }
        put_str(msg, sizeof msg, &n, "; mpirun sends it to every rank when it is interrupted or when one rank "
                                     "dies or fails, and then its message (\"process rank R ... exited\") or "
                                     "that rank's error names the rank\n");
        ssize_t w = write(STDERR_FILENO, msg, n);
        (void)w;
    }
    signal(sig, SIG_DFL);
    raise(sig);
}

/* Installs on_sigterm when SIGTERM has the default action; 1 when it did. */
static int sigterm_hook(void) {
    struct sigaction cur;
    if (sigaction(SIGTERM, NULL, &cur) != 0 || (cur.sa_flags & SA_SIGINFO) || cur.sa_handler != SIG_DFL) return 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigterm;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    return sigaction(SIGTERM, &sa, &sig_init_prev) == 0;
}

/* The program's stop flag was set (a signal it handles itself) and this
 * wait goes on: said once, 2 s after the wait saw the flag, since the ranks
 * normally agree to stop after the step within that time. Not during a phase
 * with its own deadline (dist_phase_timeout: a save or a load), where the
 * others wait for rank 0's disk. */
static void note_stop_while_waiting(dist_ctx *d, dist_waiter *w) {
    if (!d->stop_flag || !*d->stop_flag || d->stop_noted || d->aborting || d->timeout_s > d->user_timeout_s) return;
    double now = qt_now_s();
    if (w->stop_seen_s == 0) w->stop_seen_s = now;
    if (now - w->stop_seen_s < 2.0) return;
    d->stop_noted = 1;
    fprintf(stderr, "qtune: rank %d: asked to stop, and still waiting in collective %s %.0f s later; the ranks stop "
                    "together after the current step, so another rank has not reached it: if one died, mpirun "
                    "names it; one that hangs is named after QTUNE_DIST_TIMEOUT (%g s)\n",
            d->rank, w->what, now - w->stop_seen_s, d->timeout_s);
    fflush(stderr);
}

int dist_mpi_fail(dist_ctx *d, int mpi_rc, const char *call, const char *what) {
    char s[MPI_MAX_ERROR_STRING] = "";
    int len = 0;
    MPI_Error_string(mpi_rc, s, &len);
    (void)call;
    return QT_ERR(QT_EDIST, "rank %d: MPI failed in collective %s (%s); check that every rank runs the same "
                            "qtune and job file, and that the launcher's network settings work "
                            "(docs/distributed.md)", d->rank, what ? what : "?", s);
}

/* Liveness queries: while a rank polls a collective it answers "what is your
 * collective count" on d->ctl, so a rank whose deadline passed can tell the
 * ranks still polling (they answer) from the dead or stuck ones (silent). */
enum { TAG_QUERY = 7101, TAG_REPLY = 7102 };

static void answer_queries(dist_ctx *d) {
    for (int guard = 0; guard < 64; guard++) {
        int flag = 0;
        MPI_Status st;
        if (MPI_Iprobe(MPI_ANY_SOURCE, TAG_QUERY, d->ctl, &flag, &st) != MPI_SUCCESS || !flag) return;
        int64_t theirs = 0, mine = d->seq;
        MPI_Recv(&theirs, 1, MPI_INT64_T, st.MPI_SOURCE, TAG_QUERY, d->ctl, MPI_STATUS_IGNORE);
        /* 8 bytes go eagerly: this send does not wait for the asker */
        MPI_Send(&mine, 1, MPI_INT64_T, st.MPI_SOURCE, TAG_REPLY, d->ctl);
    }
}

/* Appends "1, 3" style rank lists. */
static void append_rank(char *buf, size_t cap, int r, int *count) {
    size_t len = strlen(buf);
    if (len + 16 >= cap) return;
    snprintf(buf + len, cap - len, "%s%d", *count ? ", " : "", r);
    (*count)++;
}

static _Noreturn void deadline_passed(dist_ctx *d, dist_waiter *w) {
    int N = d->world;
    int64_t mine = d->seq;
    d->aborting = 1; /* our SIGTERM handler stays quiet: this rank says why below */
    int64_t *theirs = calloc((size_t)N, sizeof *theirs);
    int64_t *query = calloc((size_t)N, sizeof *query);
    MPI_Request *rq = calloc((size_t)N * 2, sizeof *rq);
    int *answered = calloc((size_t)N, sizeof *answered);
    char silent[512] = "", behind[512] = "";
    int n_silent = 0, n_behind = 0;
    if (theirs && query && rq && answered) {
        for (int r = 0; r < N; r++) {
            rq[2 * r] = rq[2 * r + 1] = MPI_REQUEST_NULL;
            if (r == d->rank) continue;
            query[r] = mine;
            MPI_Isend(&query[r], 1, MPI_INT64_T, r, TAG_QUERY, d->ctl, &rq[2 * r]);
            MPI_Irecv(&theirs[r], 1, MPI_INT64_T, r, TAG_REPLY, d->ctl, &rq[2 * r + 1]);
        }
        /* ranks polling a collective answer within milliseconds; give them a
         * few seconds in case they are just as slow as this one */
        double grace = fmin(10.0, fmax(2.0, d->timeout_s / 10));
        double end = qt_now_s() + grace;
        int pending = N - 1;
        while (pending > 0 && qt_now_s() < end) {
            for (int r = 0; r < N; r++) {
                if (r == d->rank || answered[r]) continue;
                int flag = 0;
                MPI_Test(&rq[2 * r + 1], &flag, MPI_STATUS_IGNORE);
                if (flag) { answered[r] = 1; pending--; }
            }
            answer_queries(d);
            usleep(1000);
        }
        for (int r = 0; r < N; r++) {
            if (r == d->rank) continue;
            if (!answered[r]) append_rank(silent, sizeof silent, r, &n_silent);
            else if (theirs[r] < mine) append_rank(behind, sizeof behind, r, &n_behind);
        }
    }
    char who[1100];
    if (n_silent && n_behind)
        snprintf(who, sizeof who, "rank(s) %s stopped responding, rank(s) %s wait in an earlier collective", silent, behind);
    else if (n_silent)
        snprintf(who, sizeof who, "rank(s) %s stopped responding", silent);
    else if (n_behind)
        snprintf(who, sizeof who, "rank(s) %s stopped responding (they answer but are stuck in an earlier collective)", behind);
    else
        snprintf(who, sizeof who, "every rank still answers, so the network or MPI itself stalled");
    if (d->timeout_s > d->user_timeout_s) {
        size_t k = strlen(who);
        snprintf(who + k, sizeof who - k, " (this phase's deadline: QTUNE_DIST_TIMEOUT %g s plus %.0f s for the "
                 "bytes it reads or writes at a slow disk's rate)", d->user_timeout_s, d->timeout_s - d->user_timeout_s);
    }
    /* a phase's deadline is a sum of seconds and bytes/rate: said to 0.1 s */
    fprintf(stderr, "qtune: error: " QT_MSG_DIST_TIMEOUT_FMT "\n", d->rank, w->what, floor(d->timeout_s * 10 + 0.5) / 10,
            who);
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    _exit(1); /* MPI_Abort does not return; this keeps the compiler sure of it */
}

void dist_waiter_start(dist_ctx *d, dist_waiter *w, const char *what) {
    w->t0 = qt_now_s();
    w->deadline = w->t0 + d->timeout_s;
    w->ticks = 0;
    w->what = what;
    w->stop_seen_s = 0;
    d->seq++;
    d->cur_what = what;
}

/* Back-off: spin briefly (a collective on shared memory finishes in
 * microseconds), then yield, then sleep, so oversubscribed ranks do not steal
 * the cores their peers compute on. */
void dist_waiter_tick(dist_ctx *d, dist_waiter *w) {
    w->ticks++;
    if (w->ticks < 64) return;
    if ((w->ticks & 15) == 0) {
        answer_queries(d);
        note_stop_while_waiting(d, w);
        if (qt_now_s() > w->deadline) deadline_passed(d, w);
    }
    if (w->ticks < 1024) sched_yield();
    else usleep(w->ticks < 4096 ? 50 : 500);
}

void dist_waiter_end(dist_ctx *d, dist_waiter *w) {
    d->comm_s += qt_now_s() - w->t0;
    d->cur_what = NULL;
}

int dist_wait_all(dist_ctx *d, MPI_Request *reqs, int n, const char *what) {
    dist_waiter w;
    dist_waiter_start(d, &w, what);
    for (;;) {
        int flag = 0;
        int mrc = MPI_Testall(n, reqs, &flag, MPI_STATUSES_IGNORE);
        if (mrc != MPI_SUCCESS) {
            dist_waiter_end(d, &w);
            return dist_mpi_fail(d, mrc, "MPI_Testall", what);
        }
        if (flag) break;
        dist_waiter_tick(d, &w);
    }
    dist_waiter_end(d, &w);
    return QT_OK;
}
#endif /* QT_DIST_MPI */

/* ------------------------------------------------------------------------- */

int dist_init(int *argc, char ***argv, dist_ctx **out) {
    *out = NULL;
    double timeout;
    QT_TRY(read_timeout(&timeout));
    int launched = launched_by_mpirun();
#if !QT_DIST_MPI
    (void)argc;
    (void)argv;
    int want = launcher_world();
    if (launched && want > 1)
        return QT_ERR(QT_EDIST, "this qtune was built without MPI, so it cannot run as one of %d ranks under "
                                "mpirun; install libopenmpi-dev and rebuild (cmake -DQTUNE_WITH_MPI=ON), or "
                                "run it as a single process without mpirun", want);
#endif
    dist_ctx *d = qt_calloc(1, sizeof *d, "the distributed context");
    if (!d) return QT_ENOMEM;
    d->world = 1;
    d->timeout_s = d->user_timeout_s = timeout;
#if QT_DIST_MPI
    if (launched) {
        int inited = 0;
        MPI_Initialized(&inited);
        /* MPI_Init and MPI_Comm_dup wait for every rank, with no deadline of
         * their own: a watchdog gives them the collectives' one */
        struct dist_startup *watch = NULL;
        int rc = dist_startup_begin(timeout, &watch);
        if (rc != QT_OK) {
            qt_free(d);
            return rc;
        }
        if (!inited && MPI_Init(argc, argv) != MPI_SUCCESS) {
            dist_startup_end(watch);
            qt_free(d);
            return QT_ERR(QT_EDIST, "MPI_Init failed; run `mpirun --version` and check the launcher's settings "
                                    "(docs/distributed.md lists the ones that work in containers)");
        }
        MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
        MPI_Comm_dup(MPI_COMM_WORLD, &d->comm);
        MPI_Comm_dup(MPI_COMM_WORLD, &d->ctl);
        dist_startup_end(watch);
        MPI_Comm_set_errhandler(d->comm, MPI_ERRORS_RETURN);
        MPI_Comm_set_errhandler(d->ctl, MPI_ERRORS_RETURN);
        MPI_Comm_rank(d->comm, &d->rank);
        MPI_Comm_size(d->comm, &d->world);
        d->mpi_on = 1;
        d->owns_mpi = !inited;
        int want = launcher_world();
        if (want > 1 && d->world != want) {
            int world = d->world;
            dist_finalize(d);
            return QT_ERR(QT_EDIST, "the launcher started %d ranks but MPI reports a world of %d: this qtune is "
                                    "linked against a different MPI than the mpirun that started it; use the "
                                    "mpirun of the MPI qtune was built with (`mpirun --version`)", want, world);
        }
        sig_ctx = d;
        d->own_sigterm = sigterm_hook();
    }
#endif
    qt_debug("dist: rank %d of %d (MPI %s), collective timeout %g s", d->rank, d->world,
             d->mpi_on ? "on" : "off", d->timeout_s);
    *out = d;
    return QT_OK;
}

void dist_finalize(dist_ctx *d) {
    if (!d) return;
    dist_hccl_close(d);
#if QT_DIST_MPI
    if (d->mpi_on) {
        if (sig_ctx == d) {
            struct sigaction cur;
            sigaction(SIGTERM, NULL, &cur);
            if (d->own_sigterm && cur.sa_handler == on_sigterm) sigaction(SIGTERM, &sig_init_prev, NULL);
            sig_ctx = NULL;
        }
        MPI_Comm_free(&d->ctl);
        MPI_Comm_free(&d->comm);
        int fin = 0;
        MPI_Finalized(&fin);
        if (!fin && d->owns_mpi) MPI_Finalize(); /* an embedding program that started MPI ends it */
    }
#endif
    qt_free(d);
}

int dist_rank(const dist_ctx *d) { return d ? d->rank : 0; }
int dist_world(const dist_ctx *d) { return d ? d->world : 1; }
int dist_is_main(const dist_ctx *d) { return dist_rank(d) == 0; }
int dist_uses_mpi(const dist_ctx *d) { return d ? d->mpi_on : 0; }
double dist_timeout(const dist_ctx *d) { return d->timeout_s; }
void dist_set_timeout(dist_ctx *d, double seconds) {
    if (seconds > 0) d->timeout_s = seconds;
}
double dist_comm_seconds(const dist_ctx *d) { return d ? d->comm_s : 0; }
void dist_set_stop_flag(dist_ctx *d, volatile sig_atomic_t *flag) {
    if (d) d->stop_flag = flag;
}

double dist_phase_timeout(const dist_ctx *d, double bytes, double bytes_per_s) {
    double extra = bytes > 0 && bytes_per_s > 0 ? bytes / bytes_per_s : 0;
    return d->user_timeout_s + (isfinite(extra) ? extra : 0);
}

_Noreturn void dist_abort(dist_ctx *d, int code) {
    if (d) d->aborting = 1;
    fflush(stdout);
    fflush(stderr);
#if QT_DIST_MPI
    if (d && d->mpi_on && d->world > 1) MPI_Abort(MPI_COMM_WORLD, code ? code : 1);
#endif
    (void)d;
    exit(code);
}

/* ------------------------------------------------------------------------- */
/* Scalars. Gathered, then combined locally in rank order, so every rank gets
 * bitwise the same answer (an MPI reduction tree may round differently per
 * rank, and replicated weights must not drift apart). */

#if QT_DIST_MPI
static double combine(double a, double b, dist_op op) {
    switch (op) {
    case DIST_MAX: return a > b || isnan(a) ? a : b;
    case DIST_MIN: return a < b || isnan(a) ? a : b;
    default: return a + b;
    }
}
#endif


#if QT_DIST_MPI
/* Every rank's n values of elem bytes, rank-major into all (world * n): the
 * one collective behind the scalar all-reduces and dist_allgather_i64. */
static int gather_values(dist_ctx *d, const void *vals, int n, MPI_Datatype type, void *all, const char *what) {
    MPI_Request rq;
    int rc = MPI_Iallgather(vals, n, type, all, n, type, d->comm, &rq);
    if (rc != MPI_SUCCESS) return dist_mpi_fail(d, rc, "MPI_Iallgather", what);
    return dist_wait_all(d, &rq, 1, what);
}
#endif

static int check_scalar_count(int n, const char *what) {
    if (n < 0 || n > DIST_MAX_SCALARS)
        return QT_ERR(QT_EINVAL, "dist: %d scalars in one all-reduce (%s); at most %d", n, what, DIST_MAX_SCALARS);
    return QT_OK;
}

int dist_allreduce_ops(dist_ctx *d, double *vals, const dist_op *ops, int n, const char *what) {
    QT_TRY(check_scalar_count(n, what));
    if (d->world == 1 || n == 0) return QT_OK;
#if QT_DIST_MPI
    double *all = qt_malloc((size_t)d->world * (size_t)n * sizeof *all, "an all-reduce of scalars");
    if (!all) return QT_ENOMEM;
    int rc = gather_values(d, vals, n, MPI_DOUBLE, all, what);
    if (rc == QT_OK) {
        for (int i = 0; i < n; i++) {
            double acc = all[i];
            for (int r = 1; r < d->world; r++) acc = combine(acc, all[(size_t)r * n + i], ops[i]);
            vals[i] = acc;
        }
    }
    qt_free(all);
    return rc;
#else
    return QT_OK;
#endif
}

int dist_allreduce_f64(dist_ctx *d, double *vals, int n, dist_op op, const char *what) {
    dist_op ops[DIST_MAX_SCALARS];
    QT_TRY(check_scalar_count(n, what));
    for (int i = 0; i < n; i++) ops[i] = op;
    return dist_allreduce_ops(d, vals, ops, n, what);
}

int dist_allgather_i64(dist_ctx *d, const int64_t *mine, int n, int64_t *all, const char *what) {
    if (n < 0) return QT_ERR(QT_EINVAL, "dist: %d values in an all-gather (%s)", n, what);
    if (d->world == 1 || n == 0) {
        memcpy(all, mine, (size_t)n * sizeof *all);
        return QT_OK;
    }
#if QT_DIST_MPI
    return gather_values(d, mine, n, MPI_INT64_T, all, what);
#else
    return QT_OK;
#endif
}

/* Integers go as int64 exactly (token counts above 2^53 are not a concern,
 * but exactness is free here). */
int dist_allreduce_i64(dist_ctx *d, int64_t *vals, int n, dist_op op, const char *what) {
    QT_TRY(check_scalar_count(n, what));
    if (d->world == 1 || n == 0) return QT_OK;
    int64_t *all = qt_malloc((size_t)d->world * (size_t)n * sizeof *all, "an all-reduce of integers");
    if (!all) return QT_ENOMEM;
    int rc = dist_allgather_i64(d, vals, n, all, what);
    if (rc == QT_OK) {
        for (int i = 0; i < n; i++) {
            int64_t acc = all[i];
            for (int r = 1; r < d->world; r++) {
                int64_t v = all[(size_t)r * n + i];
                if (op == DIST_MAX) acc = v > acc ? v : acc;
                else if (op == DIST_MIN) acc = v < acc ? v : acc;
                else acc += v;
            }
            vals[i] = acc;
        }
    }
    qt_free(all);
    return rc;
}

int dist_bcast(dist_ctx *d, void *buf, size_t bytes, int root, const char *what) {
    if (root < 0 || root >= d->world)
        return QT_ERR(QT_EINVAL, "dist: broadcast root %d is not a rank (world %d)", root, d->world);
    if (d->world == 1 || bytes == 0) return QT_OK;
#if QT_DIST_MPI
    const size_t chunk = (size_t)1 << 30;
    for (size_t off = 0; off < bytes; off += chunk) {
        size_t len = bytes - off < chunk ? bytes - off : chunk;
        MPI_Request rq;
        DIST_MPI_CHECK(d, MPI_Ibcast((char *)buf + off, (int)len, MPI_BYTE, root, d->comm, &rq), what);
        QT_TRY(dist_wait_all(d, &rq, 1, what));
    }
#endif
    (void)buf;
    return QT_OK;
}

int dist_barrier(dist_ctx *d, const char *what) {
    if (d->world == 1) return QT_OK;
#if QT_DIST_MPI
    MPI_Request rq;
    DIST_MPI_CHECK(d, MPI_Ibarrier(d->comm, &rq), what);
    return dist_wait_all(d, &rq, 1, what);
#else
    (void)what;
    return QT_OK;
#endif
}
