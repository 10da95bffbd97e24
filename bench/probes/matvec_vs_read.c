/* One 1 GiB bf16 product (rows of IN) through op_matvec against a plain
 * two-stream read of the same buffer in 1 MiB chunks (each thread its half),
 * alternating, 4 pairs (bench/RESULTS-decode.md, session 15).
 *   gcc -O3 -march=native -fopenmp -DMVSRC='"backend/cpu/op_matvec.c"' -Isrc \
 *       bench/probes/matvec_vs_read.c src/backend/cpu/team.c -o /tmp/matvec_vs_read -Lbuild/src/core -lqt_core -lm
 *   OMP_NUM_THREADS=2 /tmp/matvec_vs_read IN */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <immintrin.h>
#include MVSRC
static double now_s(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc, char **argv) {
    int IN = argc > 1 ? atoi(argv[1]) : 896; size_t bytes = (size_t)1 << 30; int OUT = (int)(bytes / 2 / IN) / 16 * 16;
    bytes = (size_t)OUT * IN * 2;
    char *w = mmap(0, bytes + (4 << 21), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    w = (char *)(((size_t)w + (1 << 21) - 1) & ~((size_t)(1 << 21) - 1)); madvise(w, bytes, MADV_HUGEPAGE);
#pragma omp parallel for
    for (size_t i = 0; i < bytes / 2; i++) ((uint16_t *)w)[i] = (uint16_t)(0x3c00 + (i * 2654435761u >> 24));
    float *x = aligned_alloc(64, 4 * 65536), *out = aligned_alloc(64, 4 * (size_t)OUT);
    for (int i = 0; i < 65536; i++) x[i] = (i % 13) * 0.1f - 0.6f;
    for (int r = 0; r < 4; r++) {
        double t0 = now_s(); op_matvec(out, x, w, QT_BF16, NULL, 1, IN, OUT, 1.0f, 0); double t1 = now_s() - t0;
        t0 = now_s(); float z = 0;
#pragma omp parallel reduction(+:z)
        { int t = omp_get_thread_num(), T = omp_get_num_threads(); size_t per = bytes / T, b = t * per, cf = 1 << 20, ps = cf / 2;
          __m512 s0 = _mm512_setzero_ps(), s1 = s0;
          for (size_t c0 = 0; c0 + cf <= per; c0 += cf) { const char *p = w + b + c0;
            for (size_t i = 0; i < ps; i += 64) { s0 = _mm512_add_ps(s0, _mm512_load_ps((const float *)(p + i))); s1 = _mm512_add_ps(s1, _mm512_load_ps((const float *)(p + ps + i))); } }
          z += _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)); }
        double t2 = now_s() - t0;
        printf("IN %d: matvec %.1f GB/s   plain read %.1f GB/s%s\n", IN, bytes / t1 / 1e9, bytes / t2 / 1e9, z < 0 ? " " : "");
    }
}
