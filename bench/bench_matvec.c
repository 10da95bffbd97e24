/* The decode step's matrix-vector products alone (op_matvec), on a model
 * shape's matrices in one dtype: per "token", every decoder layer's q, k, v,
 * o, gate, up, down and the lm_head, for N input rows (a --batch N step), in
 * the order a decode step runs them. Reports ms per step, the weight bytes
 * read per step over that time (GB/s) and the steps/s times N (tokens/s). The
 * matrices are filled with random values and touched once before timing.
 * --dtype q4: every matrix (the lm_head too) a 4-bit NF4 block as QLoRA's
 * base holds it (--nested 1: double quantization), its bytes (packed codes,
 * absmax, header) the bytes read; --simd 1 forces the AVX2 path, 0 the
 * scalar one (qt_q4_set_simd).
 *   bench_matvec [--dtype f32|bf16|f16|q4 [--nested 0|1] [--simd 0|1|2]] [--rows N] [--threads T] [--reps R]
 *                [--shape C I L Q KV V]     (default qwen2.5-0.5b: 896 4864 24 896 128 151936)
 *                [--file PATH [--advise none|huge|collapse]] [--hold 0|1] [--group 0|1]
 * --file: the weights are written to PATH and read through a read-only file
 * mapping, as qtune reads a model's safetensors (4 KiB page-cache pages
 * unless the advice gets huge ones), instead of an anonymous buffer with
 * transparent huge pages. --hold 1 (the default) runs each step with the
 * threads held between its products, as a decode step does (team.h); 0
 * opens a parallel region per product, as decode steps did before. --group 1
 * (the default) runs each layer's q/k/v and its gate/up as one
 * op_matvec_many job each, as a decode step does since session 15; 0 a job
 * per product.
 * Output: one JSON object per line. Best and median of R steps, and "ms_sum_best":
 * each product's best time over the R steps, summed (on a machine shared with
 * other jobs a whole step is rarely left alone, a single product often is). */
#define _GNU_SOURCE
#include <fcntl.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/mman.h>
#include <unistd.h>
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25 /* Linux 6.1 (asm-generic/mman-common.h); older glibc headers lack it */
#endif
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/cpu/ops.h"
#include "core/dtype.h"
#include "core/mem.h"
#include "core/quant4.h"

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* one step's products in order, each product's time kept where it beats pbest[k] (NULL: not kept) */
typedef struct {
    const int (*lin)[2];
    int L, C, V, N;
    qt_dtype dt;
    size_t es;
    const char *w;
    const float *x;
    float *out;
    double *pbest;
    int group, nested;
} step_args;

/* bytes of one (OUT, IN) matrix as stored */
static size_t mat_bytes(qt_dtype dt, int nested, int in, int out) {
    if (dt == QT_Q4) return qt_q4_bytes((uint64_t)out, (uint64_t)in, QT_Q4_BLOCK, nested);
    return (size_t)in * out * qt_dtype_size(dt);
}

static int step(op_team *team, void *arg) {
    const step_args *a = arg;
    const char *p = a->w;
    double tp = now_s();
    for (int k = 0; k < 7 * a->L + 1; k++) {
        const int in = k < 7 * a->L ? a->lin[k % 7][0] : a->C, o = k < 7 * a->L ? a->lin[k % 7][1] : a->V;
        const int k0 = k, many = a->group && k < 7 * a->L && (k % 7 == 0 || k % 7 == 4) ? (k % 7 == 0 ? 3 : 2) : 1;
        if (many > 1) { /* q/k/v or gate/up as one job, timed as the first of them */
            qt_matvec_out mo[3];
            float *out = a->out;
            for (int g = 0; g < many; g++) {
                const int og = a->lin[k % 7 + g][1];
                mo[g] = (qt_matvec_out){.out = out, .w = p, .wdt = a->dt, .OUT = og};
                out += (size_t)a->N * og;
                p += mat_bytes(a->dt, a->nested, in, og);
            }
            op_matvec_many(team, a->x, a->N, in, many, mo);
            if (a->pbest)
                for (int g = 1; g < many; g++) a->pbest[k + g] = 0;
            k += many - 1; /* the loop's k++ goes on after the group */
        } else {
            op_matvec_team(team, a->out, a->x, p, a->dt, NULL, a->N, in, o, 1.0f, 0);
            p += mat_bytes(a->dt, a->nested, in, o);
        }
        const double tn = now_s();
        if (a->pbest && tn - tp < a->pbest[k0]) a->pbest[k0] = tn - tp;
        tp = tn;
    }
    return 0;
}

int main(int argc, char **argv) {
    int C = 896, I = 4864, L = 24, Q = 896, KV = 128, V = 151936, N = 1, threads = 1, reps = 10, hold = 1, group = 1,
        nested = 0;
    qt_dtype dt = QT_BF16;
    const char *file = NULL, *advise = "none";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--dtype") && i + 1 < argc) {
            const char *d = argv[++i];
            dt = !strcmp(d, "f32") ? QT_F32 : !strcmp(d, "f16") ? QT_F16 : !strcmp(d, "q4") ? QT_Q4 : QT_BF16;
        } else if (!strcmp(argv[i], "--rows") && i + 1 < argc) N = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc) threads = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--file") && i + 1 < argc) file = argv[++i];
        else if (!strcmp(argv[i], "--advise") && i + 1 < argc) advise = argv[++i];
        else if (!strcmp(argv[i], "--hold") && i + 1 < argc) hold = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--group") && i + 1 < argc) group = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--nested") && i + 1 < argc) nested = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--simd") && i + 1 < argc) qt_q4_set_simd(atoi(argv[++i]));
        else if (!strcmp(argv[i], "--shape") && i + 6 < argc) {
            C = atoi(argv[++i]), I = atoi(argv[++i]), L = atoi(argv[++i]);
            Q = atoi(argv[++i]), KV = atoi(argv[++i]), V = atoi(argv[++i]);
        } else {
            fprintf(stderr, "usage: bench_matvec [--dtype f32|bf16|f16|q4 [--nested 0|1] [--simd 0|1|2]] [--rows N] "
                            "[--threads T] [--reps R] [--shape C I L Q KV V] "
                            "[--file PATH [--advise none|huge|collapse]] [--hold 0|1] [--group 0|1]\n");
            return 2;
        }
    }
    if (N < 1 || N > 64 || threads < 1 || reps < 1 || C < 1 || I < 1 || L < 1 || Q < 1 || KV < 1 || V < 1) {
        fprintf(stderr, "bench_matvec: --rows in [1, 64], the rest positive\n");
        return 2;
    }
    omp_set_num_threads(threads);
    /* one layer's seven products: {IN, OUT} */
    const int lin[7][2] = {{C, Q}, {C, KV}, {C, KV}, {Q, C}, {C, I}, {C, I}, {I, C}};
    const size_t es = qt_dtype_size(dt);
    size_t per_layer = 0;
    for (int j = 0; j < 7; j++) per_layer += (size_t)lin[j][0] * lin[j][1];
    const size_t total = per_layer * L + (size_t)V * C;
    size_t wbytes = mat_bytes(dt, nested, C, V); /* every product's, the lm_head's too */
    for (int j = 0; j < 7; j++) wbytes += mat_bytes(dt, nested, lin[j][0], lin[j][1]) * L;
    char *w = qt_alloc_aligned(wbytes, "bench_matvec weights");
    int widest = V; /* the longest input or output row of any product */
    const int dims[4] = {C, I, Q, KV};
    for (int k = 0; k < 4; k++) widest = dims[k] > widest ? dims[k] : widest;
    /* aligned as the model's activations are (a vector load of an unaligned x splits across two lines) */
    float *x = qt_alloc_aligned(sizeof(float) * (size_t)N * widest, "bench_matvec x");
    float *out = qt_alloc_aligned(sizeof(float) * (size_t)N * widest * 3, "bench_matvec out"); /* --group: 3 outs */
    if (!w || !x || !out) return 1;
    /* random-ish weights, written in parallel (pages spread as a loaded model's are touched) */
    if (dt == QT_Q4) { /* each product's block quantized in step order, products spread over the threads */
        const int n_mat = 7 * L + 1;
        size_t *at = malloc(sizeof(size_t) * (size_t)(n_mat + 1));
        at[0] = 0;
        for (int k = 0; k < n_mat; k++)
            at[k + 1] = at[k] + (k < 7 * L ? mat_bytes(dt, nested, lin[k % 7][0], lin[k % 7][1])
                                           : mat_bytes(dt, nested, C, V));
#pragma omp parallel for schedule(dynamic)
        for (int k = 0; k < n_mat; k++) {
            const int in = k < 7 * L ? lin[k % 7][0] : C, o = k < 7 * L ? lin[k % 7][1] : V;
            float *f = malloc(sizeof(float) * (size_t)in * o);
            if (!f) abort();
            for (size_t i = 0; i < (size_t)in * o; i++) {
                uint32_t h = (uint32_t)((i + at[k]) * 2654435761u);
                f[i] = ((h >> 8) & 0xffff) / 65536.0f - 0.5f;
            }
            qt_q4_weight *q = (qt_q4_weight *)(w + at[k]);
            qt_q4_init(q, QT_Q4_NF4, QT_BF16, (uint64_t)o, (uint64_t)in, QT_Q4_BLOCK, nested);
            if (qt_q4_quantize_weight(q, f, QT_F32)) abort();
            free(f);
        }
        free(at);
    } else {
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < total; i++) {
            uint32_t h = (uint32_t)(i * 2654435761u);
            float f = ((h >> 8) & 0xffff) / 65536.0f - 0.5f;
            uint32_t u;
            memcpy(&u, &f, 4);
            if (dt == QT_F32) ((float *)w)[i] = f;
            else if (dt == QT_BF16) ((uint16_t *)w)[i] = (uint16_t)(u >> 16);
            else ((uint16_t *)w)[i] = _cvtss_sh(f, 0);
        }
    }
    for (size_t i = 0; i < (size_t)N * widest; i++) x[i] = (float)(i % 13) * 0.1f - 0.6f;
    char *anon = w;
    if (file) { /* through a file mapping instead */
        int fd = open(file, O_RDWR | O_CREAT | O_TRUNC, 0644);
        if (fd < 0 || write(fd, w, wbytes) != (ssize_t)(wbytes)) {
            fprintf(stderr, "bench_matvec: cannot write %s\n", file);
            return 1;
        }
        close(fd);
        fd = open(file, O_RDONLY);
        w = mmap(NULL, wbytes, PROT_READ, MAP_PRIVATE, fd, 0);
        close(fd);
        if (w == MAP_FAILED) return 1;
        int rc = 0;
        if (!strcmp(advise, "huge") || !strcmp(advise, "collapse")) rc = madvise(w, wbytes, MADV_HUGEPAGE);
        if (!rc && !strcmp(advise, "collapse")) rc = madvise(w, wbytes, MADV_COLLAPSE);
        if (rc) perror("bench_matvec: madvise");
    }
    double *t = malloc(sizeof(double) * (size_t)reps);
    const int n_prod = 7 * L + 1;
    double *pbest = malloc(sizeof(double) * (size_t)n_prod);
    for (int k = 0; k < n_prod; k++) pbest[k] = 1e30;
    for (int r = -1; r < reps; r++) { /* r = -1: warm-up */
        const double t0 = now_s();
        step_args a = {lin, L, C, V, N, dt, es, w, x, out, r >= 0 ? pbest : NULL, group, nested};
        if (hold) op_team_hold(step, &a);
        else step(NULL, &a);
        if (r >= 0) t[r] = now_s() - t0;
    }
    double sum_best = 0;
    for (int k = 0; k < n_prod; k++) sum_best += pbest[k];
    free(pbest);
    qsort(t, (size_t)reps, sizeof *t, cmp_d);
    const double best = t[0], med = t[reps / 2], gb = (double)(wbytes) / 1e9;
    printf("{\"dtype\": \"%s\", \"rows\": %d, \"threads\": %d, \"hold\": %d, \"group\": %d, \"memory\": \"%s\", "
           "\"q4_simd\": %d, \"gb_per_step\": %.4f, \"ms_best\": %.3f, \"ms_median\": %.3f, \"gbs_best\": %.2f, "
           "\"gbs_median\": %.2f, \"tok_s_median\": %.2f, \"ms_sum_best\": %.3f, \"gbs_sum_best\": %.2f}\n",
           qt_dtype_name(dt), N, threads, hold, group, file ? advise : "anonymous", qt_q4_simd(), gb, best * 1e3,
           med * 1e3, gb / best, gb / med, N / med, sum_best * 1e3, gb / sum_best);
    if (file) munmap(w, wbytes), unlink(file);
    free(t), qt_free(x), qt_free(out), qt_free(anon);
    return 0;
}
