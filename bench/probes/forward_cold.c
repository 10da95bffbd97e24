/* A forward pass's gate/up products alone: 24 layers of C (256, 4864) =
 * X (256, 896) W_l^T, each W_l and C_l its own buffer (cold, as in a step)
 * or one shared buffer (warm), split over 2 OpenMP threads by output
 * columns as op_matmul_forward splits them, on OpenBLAS or oneDNN's
 * dnnl_sgemm; a 64 MiB pass evicts the caches before each of 5 rounds;
 * prints the best GFLOP/s. Not built by CMake:
 *   gcc -O2 -fopenmp bench/probes/forward_cold.c -o /tmp/fwd -lopenblas -ldnnl
 *   /tmp/fwd LIB COLD_W COLD_C [K OUT]     LIB 0 OpenBLAS, 1 oneDNN
 * Result on the development machine: docs/performance.md, "The 2-thread gap". */
#include <cblas.h>
#include <dnnl.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

#define LAYERS 24

void openblas_set_num_threads(int n);

static float *alloc_filled(size_t n) {
    size_t bytes = ((n * 4 + (1u << 21) - 1) >> 21) << 21;
    float *p = aligned_alloc(1u << 21, bytes);
    if (!p) exit(1);
    madvise(p, bytes, MADV_HUGEPAGE);
    for (size_t i = 0; i < n; i++) p[i] = (float)((i * 7919) % 1000) * 1e-3f;
    return p;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s LIB(0 openblas, 1 onednn) COLD_W COLD_C [K OUT]\n", argv[0]);
        return 2;
    }
    int N = 256, K = argc > 4 ? atoi(argv[4]) : 896, OUT = argc > 5 ? atoi(argv[5]) : 4864;
    int lib = atoi(argv[1]), cold_w = atoi(argv[2]), cold_c = atoi(argv[3]);
    openblas_set_num_threads(1);
    float *x = alloc_filled((size_t)N * K), *w[LAYERS], *c[LAYERS];
    for (int l = 0; l < LAYERS; l++) {
        w[l] = cold_w || l == 0 ? alloc_filled((size_t)OUT * K) : w[0];
        c[l] = cold_c || l == 0 ? alloc_filled((size_t)N * OUT) : c[0];
    }
    float *flush = alloc_filled((size_t)16 << 20);
    double best = 0;
    for (int r = 0; r < 5; r++) {
        for (size_t i = 0; i < ((size_t)16 << 20); i += 16) flush[i] += 1.0f;
        double t0 = omp_get_wtime();
        for (int l = 0; l < LAYERS; l++) {
#pragma omp parallel num_threads(2)
            {
                int half = OUT / 2, o0 = omp_get_thread_num() * half;
                if (lib == 0)
                    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, half, K, 1.0f, x, K, w[l] + (size_t)o0 * K,
                                K, 0.0f, c[l] + o0, OUT);
                else
                    dnnl_sgemm('N', 'T', N, half, K, 1.0f, x, K, w[l] + (size_t)o0 * K, K, 0.0f, c[l] + o0, OUT);
            }
        }
        double g = 2.0 * N * K * OUT * LAYERS / (omp_get_wtime() - t0) / 1e9;
        best = g > best ? g : best;
    }
    printf("%s cold_w=%d cold_c=%d K=%d OUT=%d: %.1f GFLOP/s (2 threads)\n", lib ? "onednn" : "openblas", cold_w, cold_c,
           K, OUT, best);
    return 0;
}
