/* A run that cannot make progress ends with the reason (stall.h).
 *
 * Seen under `ulimit -v` (which clusters set from a job's memory request)
 * that was almost enough: OpenBLAS maps a 128 MiB buffer for each thread that
 * calls it, the first time it does, and when the address-space limit refuses
 * the mapping it retries inside cblas_sgemm forever, at 100% CPU; SIGTERM
 * only sets the stop flag the loop polls between steps, so nothing ended it.
 * Two guards: before the first step (and the first evaluation) the run checks
 * that the buffers the backend's BLAS still has to map fit under RLIMIT_AS
 * (qt_backend_desc.blas_thread_vm, which the plan counts too); and a watchdog
 * thread ends a step (or evaluation) that makes no progress: after 30 s when
 * a thread's BLAS buffer is still unmapped and the address space left cannot
 * hold it (the cause above), or after QTUNE_STEP_TIMEOUT seconds when that is
 * set. A stop request alone never ends a step: a long step that is computing
 * still saves after it, as the stop promises. */
#define _GNU_SOURCE
#include "train/stall.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "core/clock.h"
#include "core/error.h"
#include "core/log.h"

#define MIB (1024.0 * 1024.0)
#define STALL_EXPLAINED_S 30.0 /* no progress this long with a cause in sight ends the run */

/* Calls fn on each line of a /proc file, read with read(2) into the stack:
 * the watchdog thread must not malloc (a thread's first malloc reserves a
 * 64 MiB arena, which is what runs short here). */
static void each_line(const char *path, void (*fn)(const char *line, void *ctx), void *ctx) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    char buf[4096 + 1];
    size_t have = 0;
    for (;;) {
        ssize_t n = read(fd, buf + have, sizeof buf - 1 - have);
        if (n <= 0) break;
        have += (size_t)n;
        buf[have] = 0;
        char *start = buf, *nl;
        while ((nl = strchr(start, '\n'))) {
            *nl = 0;
            fn(start, ctx);
            start = nl + 1;
        }
        have = (size_t)(buf + have - start);
        memmove(buf, start, have);
        if (have == sizeof buf - 1) have = 0; /* a line longer than the buffer: dropped */
    }
    close(fd);
}

static void vm_line(const char *line, void *ctx) {
    size_t kb;
    if (sscanf(line, "VmSize: %zu kB", &kb) == 1) *(size_t *)ctx = kb * 1024;
}

/* bytes of address space this process maps (VmSize), 0 when unknown */
static size_t vm_size(void) {
    size_t bytes = 0;
    each_line("/proc/self/status", vm_line, &bytes);
    return bytes;
}

/* RLIMIT_AS in bytes, 0 when unlimited */
static size_t as_limit(void) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_AS, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return 0;
    return (size_t)rl.rlim_cur;
}

typedef struct {
    size_t bytes;
    int n;
} size_count;

static void map_line(const char *line, void *ctx) {
    size_count *c = ctx;
    unsigned long lo, hi;
    if (sscanf(line, "%lx-%lx", &lo, &hi) == 2 && hi - lo == c->bytes) c->n++;
}

/* Mappings of exactly `bytes` (the BLAS buffers already mapped: nothing else
 * here is that size). */
static int maps_of_size(size_t bytes) {
    size_count c = {bytes, 0};
    each_line("/proc/self/maps", map_line, &c);
    return c.n;
}

void qt_stall_make_threads(int threads) {
    if (threads < 1) return;
#pragma omp parallel num_threads(threads)
    free(malloc(64));
}

int qt_stall_check_address_space(const qt_backend_desc *d, int threads, const char *what) {
    size_t limit = as_limit(), per = d->blas_thread_vm;
    if (!per || threads < 1) return QT_OK;
    qt_stall_make_threads(threads); /* counted: the caller may have made them already */
    int held = maps_of_size(per);
    int missing = threads > held ? threads - held : 0;
    /* thread stacks, malloc arenas and the step's small allocations beside the planned blocks */
    const size_t slack = (size_t)16 << 20;
    size_t vm = vm_size(), need = vm + (size_t)missing * per + slack;
    qt_debug("address space: %.0f MiB mapped, %d of %d BLAS buffers of %.0f MiB mapped, limit %.0f MiB%s",
             (double)vm / MIB, held, threads, (double)per / MIB, (double)limit / MIB, limit ? "" : " (none)");
    if (!limit || !vm || need <= limit) return QT_OK;
    double want_mib = (double)need / MIB;
    size_t room = limit > vm + slack ? limit - vm - slack : 0;
    int fit = (int)(room / per) + held;
    char fewer[160] = "";
    if (fit >= 1)
        snprintf(fewer, sizeof fewer, ", or run with OMP_NUM_THREADS=%d (the buffers of %d thread%s fit)", fit, fit,
                 fit == 1 ? "" : "s");
    return QT_ERR(QT_ENOMEM,
                  "%s needs %.0f MiB of address space but the limit (ulimit -v, RLIMIT_AS) is %.0f MiB: this run "
                  "maps %.0f MiB, and OpenBLAS maps a %.0f MiB buffer for each of its %d calling thread%s (%d still "
                  "to map; address space only, not memory in use), which it retries forever when the limit "
                  "refuses; raise the limit to at least %.0f MiB (ulimit -v %.0f)%s",
                  what, want_mib, (double)limit / MIB, (double)vm / MIB, (double)per / MIB, threads,
                  threads == 1 ? "" : "s", missing, want_mib, want_mib * 1024, fewer);
}

struct qt_stall {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int quit;
    long beats;          /* progress marks (qt_stall_beat) */
    const char *what;    /* what is running now: "step 12", "evaluation" */
    char what_buf[64];
    double user_s;       /* QTUNE_STEP_TIMEOUT, 0 when unset */
    size_t blas_vm;      /* the backend's per-thread BLAS mapping (0: none) */
    int threads;         /* the threads that call BLAS */
};

static _Noreturn void give_up(struct qt_stall *s, double idle, const char *why) {
    fprintf(stderr, "qtune: error: %s made no progress for %.0f s: %s\n", s->what_buf, idle, why);
    fflush(stderr);
    _exit(1); /* the step is stuck in a library call that never returns: nothing to unwind */
}

static void *watch(void *arg) {
    struct qt_stall *s = arg;
    long seen = -1;
    double since = qt_now_s();
    pthread_mutex_lock(&s->mu);
    while (!s->quit) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += 1;
        pthread_cond_timedwait(&s->cv, &s->mu, &until);
        if (s->quit) break;
        double now = qt_now_s();
        if (s->beats != seen) seen = s->beats, since = now;
        if (!s->what) { since = now; continue; } /* between steps: nothing to watch */
        double idle = now - since;
        size_t limit = as_limit(), vm = limit && s->blas_vm && idle > STALL_EXPLAINED_S ? vm_size() : 0;
        char why[512];
        if (vm && vm + s->blas_vm > limit && maps_of_size(s->blas_vm) < s->threads) {
            snprintf(why, sizeof why, "the address space is used up (%.0f of %.0f MiB under ulimit -v), so OpenBLAS "
                     "cannot map the %.0f MiB buffer a thread needs and retries forever; raise ulimit -v by at least "
                     "%.0f MiB or use fewer threads (OMP_NUM_THREADS)", (double)vm / MIB, (double)limit / MIB,
                     (double)s->blas_vm / MIB, (double)s->blas_vm / MIB);
            give_up(s, idle, why);
        }
        if (s->user_s > 0 && idle > s->user_s) {
            snprintf(why, sizeof why, "past QTUNE_STEP_TIMEOUT (%g s); raise it if steps are just slow, or unset it",
                     s->user_s);
            give_up(s, idle, why);
        }
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

int qt_stall_start(const qt_backend_desc *d, int threads, qt_stall **out) {
    *out = NULL;
    const char *e = getenv("QTUNE_STEP_TIMEOUT");
    double user = 0;
    if (e && *e) {
        char *end;
        errno = 0;
        user = strtod(e, &end);
        if (errno || end == e || *end || !(user > 0))
            return QT_ERR(QT_EINVAL, "QTUNE_STEP_TIMEOUT='%s' is not a positive number of seconds; set it to e.g. "
                          "3600, or unset it (a step is then ended only when it cannot progress)", e);
    }
    qt_stall *s = calloc(1, sizeof *s);
    if (!s) return QT_ERR(QT_ENOMEM, "out of memory starting the step watchdog");
    s->user_s = user;
    s->blas_vm = d ? d->blas_thread_vm : 0;
    s->threads = threads;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    if (pthread_create(&s->thread, NULL, watch, s) != 0) {
        free(s);
        return QT_ERR(QT_ENOMEM, "could not start the step watchdog thread (out of memory or threads)");
    }
    *out = s;
    return QT_OK;
}

void qt_stall_enter(qt_stall *s, const char *what) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    if (what) snprintf(s->what_buf, sizeof s->what_buf, "%s", what);
    s->what = what ? s->what_buf : NULL;
    s->beats++;
    pthread_mutex_unlock(&s->mu);
}

void qt_stall_stop(qt_stall *s) {
    if (!s) return;
    pthread_mutex_lock(&s->mu);
    s->quit = 1;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->thread, NULL);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    free(s);
}
