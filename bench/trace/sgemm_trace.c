/* sgemm_trace: an LD_PRELOAD library that times every cblas_sgemm call of a
 * process by shape and prints a table at exit, so a training step's GEMM time
 * can be split by call site without touching the model code:
 *
 *   QTUNE_SGEMM_TRACE=out.tsv LD_PRELOAD=build/bench/libqt_sgemm_trace.so qtune train job.json
 *
 * Each line of out.tsv: order M N K transA transB calls seconds GFLOP/s, one
 * line per distinct shape, in first-call order. The wrapper adds two
 * clock_gettime calls per sgemm (tens of ns), nothing else. Calls made from
 * several threads at once are summed under a mutex (qtune calls sgemm from
 * one thread; OpenBLAS threads inside it are not seen here). */
#define _GNU_SOURCE
#include <cblas.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef void (*sgemm_fn)(const enum CBLAS_ORDER, const enum CBLAS_TRANSPOSE, const enum CBLAS_TRANSPOSE,
                         const blasint, const blasint, const blasint, const float, const float *, const blasint,
                         const float *, const blasint, const float, float *, const blasint);

#define TRACE_MAX_SHAPES 512

typedef struct {
    int order, ta, tb;
    long m, n, k;
    long calls;
    double seconds;
} trace_row;

static trace_row rows[TRACE_MAX_SHAPES];
static int nrows, dropped;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static sgemm_fn real_sgemm;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void record(int order, int ta, int tb, long m, long n, long k, double s) {
    pthread_mutex_lock(&lock);
    int i;
    for (i = 0; i < nrows; i++)
        if (rows[i].m == m && rows[i].n == n && rows[i].k == k && rows[i].ta == ta && rows[i].tb == tb &&
            rows[i].order == order)
            break;
    if (i == nrows) {
        if (nrows == TRACE_MAX_SHAPES) {
            dropped++;
            pthread_mutex_unlock(&lock);
            return;
        }
        rows[nrows++] = (trace_row){order, ta, tb, m, n, k, 0, 0.0};
    }
    rows[i].calls++;
    rows[i].seconds += s;
    pthread_mutex_unlock(&lock);
}

void cblas_sgemm(const enum CBLAS_ORDER order, const enum CBLAS_TRANSPOSE ta, const enum CBLAS_TRANSPOSE tb,
                 const blasint m, const blasint n, const blasint k, const float alpha, const float *a,
                 const blasint lda, const float *b, const blasint ldb, const float beta, float *c,
                 const blasint ldc) {
    if (!real_sgemm) {
        real_sgemm = (sgemm_fn)dlsym(RTLD_NEXT, "cblas_sgemm");
        if (!real_sgemm) {
            fprintf(stderr, "sgemm_trace: cblas_sgemm not found behind the preload; is the program linked to a "
                            "CBLAS library?\n");
            abort();
        }
    }
    double t0 = now_s();
    real_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    record(order, ta, tb, m, n, k, now_s() - t0);
}

__attribute__((destructor)) static void trace_dump(void) {
    const char *path = getenv("QTUNE_SGEMM_TRACE");
    if (!path || !*path || !nrows) return;
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "sgemm_trace: cannot write %s\n", path);
        return;
    }
    fprintf(f, "order\tM\tN\tK\ttransA\ttransB\tcalls\tseconds\tgflops\n");
    for (int i = 0; i < nrows; i++) {
        const trace_row *r = &rows[i];
        double fl = 2.0 * (double)r->m * (double)r->n * (double)r->k * (double)r->calls;
        fprintf(f, "%s\t%ld\t%ld\t%ld\t%c\t%c\t%ld\t%.6f\t%.2f\n", r->order == CblasRowMajor ? "row" : "col", r->m,
                r->n, r->k, r->ta == CblasTrans ? 't' : 'n', r->tb == CblasTrans ? 't' : 'n', r->calls, r->seconds,
                r->seconds > 0 ? fl / r->seconds / 1e9 : 0.0);
    }
    if (dropped) fprintf(f, "# %d calls of further shapes were not recorded\n", dropped);
    fclose(f);
}
