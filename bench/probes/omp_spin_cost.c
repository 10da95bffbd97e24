/* How long libgomp's spin lasts: 500 two-thread regions in which thread 0
 * sleeps 2 ms and thread 1 returns at once and waits at the region's end;
 * the process's CPU time per region is that wait (spinning costs CPU,
 * sleeping does not) plus the fork/join's own cost. Not built by CMake:
 *   gcc -O2 -fopenmp bench/probes/omp_spin_cost.c -o /tmp/spin_cost
 *   for s in 0 1000 3000 10000 30000; do GOMP_SPINCOUNT=$s /tmp/spin_cost; done
 * Result on the development machine: docs/performance.md, item 6. */
#include <omp.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

int main(void) {
    struct timespec a, b;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &a);
    for (int r = 0; r < 500; r++) {
#pragma omp parallel num_threads(2)
        {
            if (omp_get_thread_num() == 0) usleep(2000);
        }
    }
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &b);
    printf("CPU per region %.1f us\n", ((b.tv_sec - a.tv_sec) * 1e6 + (b.tv_nsec - a.tv_nsec) / 1e3) / 500);
    return 0;
}
