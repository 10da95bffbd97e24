/* A team of OpenMP threads held for a decode step (team.h says why). The
 * calling thread publishes a job and bumps a generation count; the other
 * threads spin on the count, run the job and count themselves out; the
 * caller runs its own part, then waits for the count to reach zero. One
 * cache line each for the count and the pending number, so the spinning
 * threads do not pull the job's fields back and forth. */
#include "backend/cpu/team.h"

#include <omp.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <strings.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
static inline void relax(void) { _mm_pause(); } /* eases the spin on the core and on its sibling */
#else
static inline void relax(void) {}
#endif

struct op_team {
    _Alignas(64) atomic_uint gen; /* bumped for every job, and once more at the end */
    _Alignas(64) atomic_int pending; /* threads other than the caller still in the current job */
    _Alignas(64) op_team_job job;
    void *arg;
    int nth;
    int done; /* set before the last bump: leave */
};

static void serve(op_team *t) {
    unsigned seen = 0;
    const int tid = omp_get_thread_num();
    for (;;) {
        unsigned g;
        while ((g = atomic_load_explicit(&t->gen, memory_order_acquire)) == seen) relax();
        seen = g;
        if (t->done) return;
        t->job(t->arg, tid, t->nth);
        atomic_fetch_sub_explicit(&t->pending, 1, memory_order_release);
    }
}

/* The user asked OpenMP's idle threads not to spin (OMP_WAIT_POLICY=passive,
 * GOMP_SPINCOUNT=0): a held team would spin through the whole step. */
static int spin_refused(void) {
    const char *wp = getenv("OMP_WAIT_POLICY"), *sc = getenv("GOMP_SPINCOUNT");
    /* a count that reads as 0 and starts with '0': "infinite", libgomp's other word, also reads as 0 */
    return (wp && !strcasecmp(wp, "passive")) || (sc && sc[0] == '0' && strtoll(sc, NULL, 10) == 0);
}

int op_team_hold(int (*fn)(op_team *team, void *arg), void *arg) {
    const int nth = omp_get_max_threads();
    if (nth < 2 || omp_in_parallel() || nth > omp_get_num_procs() || spin_refused()) return fn(NULL, arg);
    op_team t = {.nth = 1};
    atomic_init(&t.gen, 0u);
    atomic_init(&t.pending, 0);
    int rc = 0;
#pragma omp parallel num_threads(nth)
    {
        if (omp_get_thread_num() == 0) {
            /* the region may have fewer threads than asked (OMP_DYNAMIC, a thread limit); the others read
             * nth only in a job, after the bump that publishes it */
            t.nth = omp_get_num_threads();
            rc = fn(&t, arg);
            t.done = 1;
            atomic_fetch_add_explicit(&t.gen, 1u, memory_order_release);
        } else {
            serve(&t);
        }
    }
    return rc;
}

void op_team_run(op_team *t, op_team_job job, void *arg) {
    if (!t && omp_get_max_threads() == 1) { /* not even a one-thread region (1.2-1.5 us) */
        job(arg, 0, 1);
        return;
    }
    if (!t) {
#pragma omp parallel
        job(arg, omp_get_thread_num(), omp_get_num_threads());
        return;
    }
    if (t->nth == 1) {
        job(arg, 0, 1);
        return;
    }
    t->job = job;
    t->arg = arg;
    atomic_store_explicit(&t->pending, t->nth - 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&t->gen, 1u, memory_order_release);
    job(arg, 0, t->nth);
    while (atomic_load_explicit(&t->pending, memory_order_acquire) > 0) relax();
}

int op_team_size(const op_team *t) { return t ? t->nth : omp_get_max_threads(); }
