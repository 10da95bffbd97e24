/* What an OpenMP region costs when it does nothing useful: a `parallel for`
 * whose if clause is false (one thread), at the top level and nested inside
 * another region (as inside a decode step's held team, backend/cpu/team.h),
 * and an empty region on the whole team. Not built by CMake:
 *   gcc -O2 -fopenmp bench/probes/omp_if_cost.c -o /tmp/omp_if_cost
 *   OMP_NUM_THREADS=2 /tmp/omp_if_cost
 * Result on the development machine: docs/performance.md, item 6. */
#include <omp.h>
#include <stdio.h>
#include <time.h>

#define CALLS 100000

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static volatile int sink;

__attribute__((noinline)) static void small_loop(int n) {
#pragma omp parallel for if (n > 100000)
    for (int i = 0; i < n; i++) sink += i;
}

int main(void) {
    double t0 = now();
    for (int r = 0; r < CALLS; r++) small_loop(8);
    printf("if(false) region, top level: %.2f us\n", (now() - t0) / CALLS * 1e6);
#pragma omp parallel num_threads(2)
    {
        if (omp_get_thread_num() == 0) {
            double t1 = now();
            for (int r = 0; r < CALLS; r++) small_loop(8);
            printf("if(false) region, nested: %.2f us\n", (now() - t1) / CALLS * 1e6);
        }
    }
    t0 = now();
    for (int r = 0; r < CALLS / 10; r++) {
#pragma omp parallel
        {
#pragma omp atomic
            sink++;
        }
    }
    printf("empty region on %d threads: %.2f us\n", omp_get_max_threads(), (now() - t0) / (CALLS / 10) * 1e6);
    return 0;
}
