/* Where OpenMP threads wait: an LD_PRELOAD wrapper of libgomp's
 * GOMP_parallel that timestamps each thread's entry to and exit from every
 * parallel region (2 threads). Not built by CMake; used for
 * docs/performance.md ("The 2-thread gap") and the spin default in
 * src/cli/main.c:
 *   gcc -O2 -shared -fPIC -fopenmp bench/probes/gomp_region_wait.c -o /tmp/gomp_wait.so -ldl
 *   GW_OUT=/tmp/wait.txt LD_PRELOAD=/tmp/gomp_wait.so OMP_NUM_THREADS=2 qtune train JOB.json
 * Writes: the region count, the second thread's late entries (sum, maximum,
 * histogram), the sum of |end of thread 0 - end of thread 1|, and per region
 * function (file and offset; addr2line -f -e FILE OFFSET names it) each
 * thread's busy time, the end imbalance, the calling thread's time outside
 * any region before it (serial work, and regions of one thread), and the
 * fork (call to the calling thread's start) and join (last end to return). Counts cover the whole process
 * (load and save too, few regions there). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef void (*region_fn)(void *);
static void (*real_parallel)(region_fn, void *, unsigned, unsigned);

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

struct call {
    region_fn fn;
    void *data;
    double t0, start[2], end[2];
};

static void trampoline(void *p) {
    struct call *c = p;
    int id = omp_get_thread_num();
    if (id < 2) c->start[id] = now();
    c->fn(c->data);
    if (id < 2) c->end[id] = now();
}

#define MAXF 256
static struct {
    void *fn;
    long n;
    double busy[2], imbalance, gap, fork, join;
} tab[MAXF];
static double last_exit;
static int nf;
static long regions, hist[6];
static double late_sum, late_max, imbalance_sum;

void GOMP_parallel(region_fn fn, void *data, unsigned nt, unsigned flags) {
    if (!real_parallel) real_parallel = (void (*)(region_fn, void *, unsigned, unsigned))dlsym(RTLD_NEXT, "GOMP_parallel");
    struct call c = {fn, data, now(), {0, 0}, {0, 0}};
    real_parallel(trampoline, &c, nt, flags);
    double tx = now(), gap = last_exit > 0 ? c.t0 - last_exit : 0; last_exit = tx;
    if (c.start[1] <= 0) return; /* one thread ran it */
    double late = c.start[1] - c.t0, imb = c.end[0] > c.end[1] ? c.end[0] - c.end[1] : c.end[1] - c.end[0];
    regions++, late_sum += late, imbalance_sum += imb;
    late_max = late > late_max ? late : late_max;
    hist[late < 5e-6 ? 0 : late < 20e-6 ? 1 : late < 50e-6 ? 2 : late < 100e-6 ? 3 : late < 500e-6 ? 4 : 5]++;
    int i = 0;
    while (i < nf && tab[i].fn != (void *)fn) i++;
    if (i == nf && nf < MAXF) tab[nf++].fn = (void *)fn;
    if (i < MAXF) {
        tab[i].n++;
        for (int k = 0; k < 2; k++) tab[i].busy[k] += c.end[k] - c.start[k];
        tab[i].imbalance += imb; tab[i].gap += gap; tab[i].fork += c.start[0] - c.t0; tab[i].join += tx - (c.end[0] > c.end[1] ? c.end[0] : c.end[1]);
    }
}

__attribute__((destructor)) static void dump(void) {
    FILE *f = fopen(getenv("GW_OUT") ? getenv("GW_OUT") : "/tmp/gomp_wait.txt", "w");
    if (!f) return;
    fprintf(f, "regions %ld, second thread late by %.3f s in all (max %.1f us), end imbalance %.3f s in all\n",
            regions, late_sum, late_max * 1e6, imbalance_sum);
    fprintf(f, "late by <5us %ld, 5-20 %ld, 20-50 %ld, 50-100 %ld, 100-500 %ld, >=500 %ld\n", hist[0], hist[1],
            hist[2], hist[3], hist[4], hist[5]);
    for (int i = 0; i < nf; i++) {
        Dl_info d = {0};
        dladdr(tab[i].fn, &d);
        fprintf(f, "%6ld regions, busy %.3f / %.3f s, imbalance %.3f s, gap before %.3f s, fork %.3f join %.3f: %s 0x%lx\n", tab[i].n, tab[i].busy[0],
                tab[i].busy[1], tab[i].imbalance, tab[i].gap, tab[i].fork, tab[i].join, d.dli_fname ? d.dli_fname : "?",
                (unsigned long)((char *)tab[i].fn - (char *)d.dli_fbase));
    }
    fclose(f);
}
