/* bench_gemm: the machine's measured GEMM peak, the yardstick that qtune's
 * achieved FLOP/s is divided by in bench/run.
 *
 *   bench_gemm [--threads N] [--reps R] [--size S]        square fp32 sgemm, S = 1024 and 2048 by default
 *   bench_gemm --shape M N K [tA tB] [--threads N]         one fp32 sgemm shape (as qtune calls it; tA/tB: n|t)
 *   bench_gemm --bf16 [--force] [--threads N]              bf16 x bf16 -> f32 matmul through oneDNN
 *   bench_gemm --onednn [...]                              the sgemm modes above on oneDNN's dnnl_sgemm
 *                                                          (qtune's input-gradient products run on it)
 *   bench_gemm --triad [--threads N] [--reps R]            memory bandwidth: STREAM's triad a = b + s c
 *                                                          over three 256 MiB arrays, GB/s
 *
 * FLOPs of one C(M,N) = A(M,K) B(K,N) are 2*M*N*K. Each configuration runs
 * once to warm caches and threads, then R timed repetitions; the BEST rate is
 * reported (other engineers share this machine, so the best run is the one
 * least disturbed by them, which is what "peak" means here). Output: one JSON
 * object per line, so bench/run can read it.
 *
 * oneDNN 2.6 has no dnnl_gemm_bf16bf16f32 in its C API (only dnnl_sgemm and the
 * int8 gemms), so bf16 GEMM goes through the matmul primitive with bf16
 * source/weights and an f32 destination. Without AVX512_BF16 (or AMX) oneDNN
 * has no fast bf16 kernel, so the bf16 peak is reported as not available
 * unless --force asks to time whatever implementation oneDNN picks. */
#define _GNU_SOURCE
#include <cblas.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/error.h"
#include "core/mem.h"
#include "qtune_config.h"

#if QTUNE_HAVE_DNNL
#include <oneapi/dnnl/dnnl.h>
#endif

/* OpenBLAS's own thread control (its pthread build ignores OMP_NUM_THREADS
 * once loaded); declared here so the program needs no OpenBLAS-only header. */
void openblas_set_num_threads(int n);
char *openblas_get_config(void);

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* CPU seconds of the whole process (all threads): on a shared machine the
 * wall clock also counts the time other processes held our cores, the CPU
 * clock does not (idle-spinning BLAS threads do count). */
static double cpu_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void fill(float *x, size_t n, uint32_t seed) {
    uint32_t s = seed * 2654435761u + 1u;
    for (size_t i = 0; i < n; i++) {
        s = s * 1664525u + 1013904223u;
        x[i] = (float)((s >> 8) & 0xffff) / 65536.0f - 0.5f;
    }
}

/* One sgemm, row-major, on OpenBLAS or (onednn) oneDNN's dnnl_sgemm. */
static void sgemm(int onednn, char ta, char tb, int M, int N, int K, const float *a, int lda, const float *b, int ldb,
                  float *c) {
#if QTUNE_HAVE_DNNL
    if (onednn) {
        dnnl_sgemm(ta == 't' ? 'T' : 'N', tb == 't' ? 'T' : 'N', M, N, K, 1.0f, a, lda, b, ldb, 0.0f, c, N);
        return;
    }
#else
    (void)onednn;
#endif
    cblas_sgemm(CblasRowMajor, ta == 't' ? CblasTrans : CblasNoTrans, tb == 't' ? CblasTrans : CblasNoTrans, M, N, K,
                1.0f, a, lda, b, ldb, 0.0f, c, N);
}

/* The largest of reps rates and their median (sorts rates; reps is small,
 * so by insertion). */
static void best_and_median(double *rates, int reps, double *best, double *median) {
    for (int i = 1; i < reps; i++)
        for (int j = i; j > 0 && rates[j - 1] > rates[j]; j--) {
            double t = rates[j];
            rates[j] = rates[j - 1];
            rates[j - 1] = t;
        }
    *best = rates[reps - 1];
    *median = reps % 2 ? rates[reps / 2] : 0.5 * (rates[reps / 2 - 1] + rates[reps / 2]);
}

/* Best GFLOP/s of R timed sgemm calls, C = A op(B) with the row-major layout
 * qtune uses (op_matmul: A (M,K); B (N,K) when tB = 't', (K,N) when 'n'). */
static int time_sgemm(int onednn, int M, int N, int K, char ta, char tb, int reps, double *best_gflops,
                      double *median_gflops, double *best_cpu_gflops) {
    float *a = qt_alloc_aligned(sizeof(float) * (size_t)M * K, "bench_gemm A");
    float *b = qt_alloc_aligned(sizeof(float) * (size_t)K * N, "bench_gemm B");
    float *c = qt_alloc_aligned(sizeof(float) * (size_t)M * N, "bench_gemm C");
    double *rates = qt_malloc(sizeof(double) * (size_t)reps, "bench_gemm rates");
    if (!a || !b || !c || !rates) {
        qt_free(a), qt_free(b), qt_free(c), free(rates);
        return QT_ENOMEM;
    }
    fill(a, (size_t)M * K, 1);
    fill(b, (size_t)K * N, 2);
    memset(c, 0, sizeof(float) * (size_t)M * N);
    int lda = ta == 't' ? M : K, ldb = tb == 't' ? K : N;
    double flops = 2.0 * M * N * K;
    /* Small shapes finish in microseconds: repeat each timed sample until it
     * lasts >= 20 ms so the clock's resolution does not matter. */
    int inner = 1;
    double t0 = now_s();
    sgemm(onednn, ta, tb, M, N, K, a, lda, b, ldb, c); /* warm-up */
    double t1 = now_s() - t0;
    if (t1 < 0.02) inner = (int)(0.02 / (t1 > 1e-7 ? t1 : 1e-7)) + 1;
    double best_cpu = 0;
    for (int r = 0; r < reps; r++) {
        t0 = now_s();
        double c0 = cpu_s();
        for (int i = 0; i < inner; i++) sgemm(onednn, ta, tb, M, N, K, a, lda, b, ldb, c);
        rates[r] = flops * inner / (now_s() - t0) / 1e9;
        double g = flops * inner / (cpu_s() - c0) / 1e9;
        best_cpu = g > best_cpu ? g : best_cpu;
    }
    *best_cpu_gflops = best_cpu;
    best_and_median(rates, reps, best_gflops, median_gflops);
    qt_free(a), qt_free(b), qt_free(c), free(rates);
    return QT_OK;
}

/* STREAM's triad over three arrays of n floats, each thread on its static
 * share (first touched by the same thread, so its pages are local): best and
 * median GB/s of R passes, counting 3 * n * 4 bytes a pass as STREAM does
 * (the write-allocate read of a is not counted). bench/run times it beside
 * each case: the training step streams its weights and activations through
 * memory, which a square sgemm living in cache does not. */
static int time_triad(size_t n, int reps, double *best_gbs, double *median_gbs) {
    float *a = qt_alloc_aligned(sizeof(float) * n, "bench_gemm triad a");
    float *b = qt_alloc_aligned(sizeof(float) * n, "bench_gemm triad b");
    float *c = qt_alloc_aligned(sizeof(float) * n, "bench_gemm triad c");
    double *rates = qt_malloc(sizeof(double) * (size_t)reps, "bench_gemm rates");
    if (!a || !b || !c || !rates) {
        qt_free(a), qt_free(b), qt_free(c), free(rates);
        return QT_ENOMEM;
    }
    const float k = 3.0f;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) a[i] = 0.0f, b[i] = 1.0f, c[i] = 2.0f;
    for (int r = -1; r < reps; r++) { /* r = -1: warm-up */
        double t0 = now_s();
#pragma omp parallel for simd schedule(static)
        for (size_t i = 0; i < n; i++) a[i] = b[i] + k * c[i];
        double dt = now_s() - t0;
        if (r >= 0) rates[r] = 3.0 * sizeof(float) * (double)n / dt / 1e9;
    }
    best_and_median(rates, reps, best_gbs, median_gbs);
    int ok = a[n - 1] == 7.0f; /* 1 + 3 * 2: the loop ran */
    qt_free(a), qt_free(b), qt_free(c), free(rates);
    return ok ? QT_OK : QT_EINVAL;
}

static int cpu_has_flag(const char *flag) {
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return 0;
    char line[8192];
    int found = 0;
    size_t n = strlen(flag);
    while (!found && fgets(line, sizeof line, f)) {
        if (strncmp(line, "flags", 5)) continue;
        for (char *p = strstr(line, flag); p; p = strstr(p + 1, flag))
            if ((p == line || p[-1] == ' ' || p[-1] == '\t') && (p[n] == ' ' || p[n] == '\n' || p[n] == '\0')) {
                found = 1;
                break;
            }
    }
    fclose(f);
    return found;
}

#if QTUNE_HAVE_DNNL
static uint16_t f32_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#define DNNL_CHECK(call, what)                                                                                        \
    do {                                                                                                              \
        dnnl_status_t st_ = (call);                                                                                   \
        if (st_ != dnnl_success) {                                                                                    \
            rc = QT_ERR(QT_EINVAL, "oneDNN %s failed with status %d; bf16 matmul is not available on this build/CPU", \
                        what, (int)st_);                                                                              \
            goto done;                                                                                                \
        }                                                                                                             \
    } while (0)

/* Best GFLOP/s of dst (M,N) f32 = src (M,K) bf16 @ wei (K,N) bf16 through the
 * oneDNN matmul primitive; *impl gets the implementation oneDNN chose. */
static int time_dnnl_bf16(int M, int N, int K, int reps, double *best_gflops, char *impl, size_t impl_len) {
    int rc = QT_OK;
    dnnl_engine_t eng = NULL;
    dnnl_stream_t stream = NULL;
    dnnl_primitive_desc_t pd = NULL;
    dnnl_primitive_t prim = NULL;
    dnnl_memory_t msrc = NULL, mwei = NULL, mdst = NULL;
    uint16_t *a = qt_alloc_aligned(sizeof(uint16_t) * (size_t)M * K, "bench_gemm bf16 A");
    uint16_t *b = qt_alloc_aligned(sizeof(uint16_t) * (size_t)K * N, "bench_gemm bf16 B");
    float *c = qt_alloc_aligned(sizeof(float) * (size_t)M * N, "bench_gemm f32 C");
    float *tmp = qt_malloc(sizeof(float) * (size_t)(M > N ? M : N) * K, "bench_gemm fill");
    if (!a || !b || !c || !tmp) {
        rc = QT_ENOMEM;
        goto done;
    }
    fill(tmp, (size_t)M * K, 1);
    for (size_t i = 0; i < (size_t)M * K; i++) a[i] = f32_to_bf16(tmp[i]);
    fill(tmp, (size_t)K * N, 2);
    for (size_t i = 0; i < (size_t)K * N; i++) b[i] = f32_to_bf16(tmp[i]);

    dnnl_memory_desc_t src_md, wei_md, dst_md;
    dnnl_dims_t sd = {M, K}, wd = {K, N}, dd = {M, N};
    DNNL_CHECK(dnnl_engine_create(&eng, dnnl_cpu, 0), "engine_create");
    DNNL_CHECK(dnnl_stream_create(&stream, eng, dnnl_stream_default_flags), "stream_create");
    DNNL_CHECK(dnnl_memory_desc_init_by_tag(&src_md, 2, sd, dnnl_bf16, dnnl_ab), "memory_desc src");
    DNNL_CHECK(dnnl_memory_desc_init_by_tag(&wei_md, 2, wd, dnnl_bf16, dnnl_ab), "memory_desc weights");
    DNNL_CHECK(dnnl_memory_desc_init_by_tag(&dst_md, 2, dd, dnnl_f32, dnnl_ab), "memory_desc dst");
    dnnl_matmul_desc_t desc;
    DNNL_CHECK(dnnl_matmul_desc_init(&desc, &src_md, &wei_md, NULL, &dst_md), "matmul_desc_init");
    DNNL_CHECK(dnnl_primitive_desc_create(&pd, &desc, NULL, eng, NULL), "primitive_desc_create (bf16 matmul)");
    const char *name = NULL;
    DNNL_CHECK(dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &name), "impl query");
    snprintf(impl, impl_len, "%s", name ? name : "?");
    DNNL_CHECK(dnnl_primitive_create(&prim, pd), "primitive_create");
    DNNL_CHECK(dnnl_memory_create(&msrc, &src_md, eng, a), "memory src");
    DNNL_CHECK(dnnl_memory_create(&mwei, &wei_md, eng, b), "memory weights");
    DNNL_CHECK(dnnl_memory_create(&mdst, &dst_md, eng, c), "memory dst");
    dnnl_exec_arg_t args[3] = {{DNNL_ARG_SRC, msrc}, {DNNL_ARG_WEIGHTS, mwei}, {DNNL_ARG_DST, mdst}};
    DNNL_CHECK(dnnl_primitive_execute(prim, stream, 3, args), "execute");
    DNNL_CHECK(dnnl_stream_wait(stream), "stream_wait");
    double best = 0, flops = 2.0 * M * N * K;
    for (int r = 0; r < reps; r++) {
        double t0 = now_s();
        DNNL_CHECK(dnnl_primitive_execute(prim, stream, 3, args), "execute");
        DNNL_CHECK(dnnl_stream_wait(stream), "stream_wait");
        double g = flops / (now_s() - t0) / 1e9;
        best = g > best ? g : best;
    }
    /* spot check one element against an f32 dot product of the bf16 inputs */
    double ref = 0;
    for (int k = 0; k < K; k++) {
        uint32_t ua = (uint32_t)a[k] << 16, ub = (uint32_t)b[(size_t)k * N] << 16;
        float fa, fb;
        memcpy(&fa, &ua, 4);
        memcpy(&fb, &ub, 4);
        ref += (double)fa * fb;
    }
    if (!(c[0] - ref < 1e-2 + 1e-3 * (ref < 0 ? -ref : ref) && ref - c[0] < 1e-2 + 1e-3 * (ref < 0 ? -ref : ref)))
        rc = QT_ERR(QT_EINVAL, "oneDNN bf16 matmul gave C[0,0] = %g, expected %g", c[0], ref);
    *best_gflops = best;
done:
    if (mdst) dnnl_memory_destroy(mdst);
    if (mwei) dnnl_memory_destroy(mwei);
    if (msrc) dnnl_memory_destroy(msrc);
    if (prim) dnnl_primitive_destroy(prim);
    if (pd) dnnl_primitive_desc_destroy(pd);
    if (stream) dnnl_stream_destroy(stream);
    if (eng) dnnl_engine_destroy(eng);
    qt_free(a), qt_free(b), qt_free(c), free(tmp);
    return rc;
}
#endif

static void usage(void) {
    fprintf(stderr, "usage: bench_gemm [--threads N] [--reps R] [--size S]\n"
                    "       bench_gemm --shape M N K [n|t n|t] [--threads N] [--reps R]\n"
                    "       bench_gemm --bf16 [--force] [--size S] [--threads N] [--reps R]\n"
                    "       bench_gemm --triad [--threads N] [--reps R]\n"
                    "       --onednn: the sgemm forms on oneDNN's dnnl_sgemm instead of OpenBLAS\n");
}

int main(int argc, char **argv) {
    int threads = 1, reps = 5, bf16 = 0, force = 0, onednn = 0, triad = 0, nsizes = 0, shape[3] = {0, 0, 0};
    int sizes[8];
    char ta = 'n', tb = 't';
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--size") && i + 1 < argc && nsizes < 8) sizes[nsizes++] = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--bf16")) bf16 = 1;
        else if (!strcmp(argv[i], "--force")) force = 1;
        else if (!strcmp(argv[i], "--onednn")) onednn = 1;
        else if (!strcmp(argv[i], "--triad")) triad = 1;
        else if (!strcmp(argv[i], "--shape") && i + 3 < argc) {
            for (int k = 0; k < 3; k++) shape[k] = atoi(argv[++i]);
            if (i + 2 < argc && (argv[i + 1][0] == 'n' || argv[i + 1][0] == 't') && argv[i + 1][1] == '\0') {
                ta = argv[++i][0];
                tb = argv[++i][0];
            }
        } else {
            usage();
            return 2;
        }
    }
    if (threads < 1 || threads > 1024 || reps < 1 || reps > 1000) {
        fprintf(stderr, "bench_gemm: --threads must be in [1, 1024] and --reps in [1, 1000]\n");
        return 2;
    }
    for (int k = 0; k < 3; k++)
        if (shape[k] < 0 || shape[k] > 65536) {
            fprintf(stderr, "bench_gemm: --shape dimensions must be in [1, 65536]\n");
            return 2;
        }
    for (int k = 0; k < nsizes; k++)
        if (sizes[k] < 1 || sizes[k] > 16384) {
            fprintf(stderr, "bench_gemm: --size must be in [1, 16384]\n");
            return 2;
        }
    openblas_set_num_threads(threads);
    omp_set_num_threads(threads);
    if (triad) {
        double best, med;
        if (time_triad((size_t)64 << 20, reps, &best, &med) != QT_OK) {
            fprintf(stderr, "bench_gemm: the triad failed (out of memory, or a wrong result)\n");
            return 1;
        }
        printf("{\"kind\": \"triad\", \"threads\": %d, \"bytes_per_pass\": %zu, \"gbs\": %.2f, "
               "\"median_gbs\": %.2f}\n",
               threads, (size_t)3 * sizeof(float) * ((size_t)64 << 20), best, med);
        return 0;
    }
#if !QTUNE_HAVE_DNNL
    if (onednn) {
        printf("{\"kind\": \"sgemm\", \"lib\": \"onednn\", \"threads\": %d, \"gflops\": null, "
               "\"note\": \"n/a: built without oneDNN\"}\n",
               threads);
        return 0;
    }
#endif
    const char *lib = onednn ? "onednn" : "openblas";

    if (bf16) {
        int have = cpu_has_flag("avx512_bf16") || cpu_has_flag("amx_bf16");
        if (!have && !force) {
            printf("{\"kind\": \"bf16\", \"threads\": %d, \"gflops\": null, \"note\": \"n/a: no AVX512_BF16\"}\n",
                   threads);
            return 0;
        }
#if QTUNE_HAVE_DNNL
        int S = nsizes ? sizes[0] : 2048;
        double best = 0;
        char impl[128] = "";
        if (time_dnnl_bf16(S, S, S, reps, &best, impl, sizeof impl) != QT_OK) {
            fprintf(stderr, "bench_gemm: %s\n", qt_error_message());
            return 1;
        }
        printf("{\"kind\": \"bf16\", \"threads\": %d, \"M\": %d, \"N\": %d, \"K\": %d, \"gflops\": %.2f, "
               "\"impl\": \"%s\", \"cpu_bf16\": %s}\n",
               threads, S, S, S, best, impl, have ? "true" : "false");
        return 0;
#else
        printf("{\"kind\": \"bf16\", \"threads\": %d, \"gflops\": null, \"note\": \"n/a: built without oneDNN\"}\n",
               threads);
        return 0;
#endif
    }

    if (shape[0]) {
        double best, med, cpu;
        if (time_sgemm(onednn, shape[0], shape[1], shape[2], ta, tb, reps, &best, &med, &cpu) != QT_OK) {
            fprintf(stderr, "bench_gemm: %s\n", qt_error_message());
            return 1;
        }
        printf("{\"kind\": \"sgemm\", \"lib\": \"%s\", \"threads\": %d, \"M\": %d, \"N\": %d, \"K\": %d, \"ta\": "
               "\"%c\", \"tb\": \"%c\", \"gflops\": %.2f, \"median_gflops\": %.2f, \"cpu_gflops\": %.2f}\n",
               lib, threads, shape[0], shape[1], shape[2], ta, tb, best, med, cpu);
        return 0;
    }

    if (!nsizes) {
        sizes[nsizes++] = 1024;
        sizes[nsizes++] = 2048;
    }
    for (int k = 0; k < nsizes; k++) {
        int S = sizes[k];
        double best, med, cpu;
        if (time_sgemm(onednn, S, S, S, 'n', 't', reps, &best, &med, &cpu) != QT_OK) {
            fprintf(stderr, "bench_gemm: %s\n", qt_error_message());
            return 1;
        }
        printf("{\"kind\": \"sgemm\", \"lib\": \"%s\", \"threads\": %d, \"M\": %d, \"N\": %d, \"K\": %d, \"ta\": "
               "\"n\", \"tb\": \"t\", \"gflops\": %.2f, \"median_gflops\": %.2f, \"cpu_gflops\": %.2f, \"openblas\": "
               "\"%s\"}\n",
               lib, threads, S, S, S, best, med, cpu, openblas_get_config());
    }
    return 0;
}
