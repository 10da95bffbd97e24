/* bench_attention: CPU time of op_attention_forward / op_attention_backward
 * alone, on the shapes of the models qtune trains.
 *
 *   bench_attention [--threads N] [--reps R] [--min-cpu S] [--shape B T H KV D] [--docs L]
 *
 * Without --shape it runs qwen2.5-0.5b (B=1, H=14, KV=2, D=64) at T=256 and
 * T=1024 and bench-tiny (B=4, T=256, H=4, KV=2, D=64). --docs L packs each
 * row with documents of L tokens (doc_start restarts every L positions).
 *
 * FLOPs counted (causal, so half of the full T x T products):
 *   forward  = 2 * B * H * T^2 * D     (Q K^T and P V: 2 * 2*T*T*D each, halved)
 *   backward = 2.5 * forward           (Q K^T recomputed, dO V^T, P^T dO, dS K, dS^T Q)
 * The same nominal count for every implementation and mask, so GFLOP/s
 * compare implementations; documents skip work the count still includes.
 *
 * With B = 1 it also times op_attention_forward_cached (decoding): the T
 * tokens as one prompt, and one token at position T-1 against T keys.
 *
 * Each op runs once to warm up, then at least R timed calls and at least
 * S CPU-seconds' worth (0.5 by default; short shapes are otherwise lost in the noise of a
 * shared machine); reported: CPU ms per call
 * (process CPU time, all threads: steadier than the wall clock on a shared
 * machine), wall ms per call, and nominal GFLOP per CPU-second. */
#define _GNU_SOURCE
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend/cpu/ops.h"
#include "core/mem.h"

static double min_cpu_s = 0.5; /* --min-cpu */

static double now_s(clockid_t c) {
    struct timespec ts;
    clock_gettime(c, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static float *filled(size_t n, uint32_t seed, float s) {
    float *x = qt_malloc(n * sizeof(float), "bench_attention");
    uint32_t r = seed * 2654435761u + 1u;
    for (size_t i = 0; i < n; i++) {
        r = r * 1664525u + 1013904223u;
        x[i] = s * ((float)((r >> 8) & 0xffff) / 65536.0f - 0.5f);
    }
    return x;
}

static void run_shape(const char *name, int B, int T, int H, int KV, int D, int docs, int reps) {
    size_t nq = (size_t)B * T * H * D, nk = (size_t)B * T * KV * D;
    float *q = filled(nq, 1, 4.0f), *k = filled(nk, 2, 4.0f), *v = filled(nk, 3, 2.0f), *dout = filled(nq, 4, 1.0f);
    float *out = qt_calloc(nq, sizeof(float), "bench_attention"), *lse = qt_calloc((size_t)B * H * T, sizeof(float), "b");
    float *dq = qt_calloc(nq, sizeof(float), "b"), *dk = qt_calloc(nk, sizeof(float), "b");
    float *dv = qt_calloc(nk, sizeof(float), "b");
    int32_t *doc = NULL;
    if (docs > 0) {
        doc = qt_malloc((size_t)B * T * sizeof(int32_t), "bench_attention");
        for (int b = 0; b < B; b++)
            for (int t = 0; t < T; t++) doc[(size_t)b * T + t] = t / docs * docs;
    }
    double fwd_flop = 2.0 * B * H * (double)T * T * D, bwd_flop = 2.5 * fwd_flop;
    double c0, w0, fc, fw, bc, bw;
    int n;
    op_attention_forward(out, lse, q, k, v, doc, B, T, H, KV, D);
    c0 = now_s(CLOCK_PROCESS_CPUTIME_ID), w0 = now_s(CLOCK_MONOTONIC);
    for (n = 0; n < reps || now_s(CLOCK_PROCESS_CPUTIME_ID) - c0 < min_cpu_s; n++)
        op_attention_forward(out, lse, q, k, v, doc, B, T, H, KV, D);
    fc = (now_s(CLOCK_PROCESS_CPUTIME_ID) - c0) / n, fw = (now_s(CLOCK_MONOTONIC) - w0) / n;
    op_attention_backward(dq, dk, dv, dout, out, lse, q, k, v, doc, B, T, H, KV, D);
    c0 = now_s(CLOCK_PROCESS_CPUTIME_ID), w0 = now_s(CLOCK_MONOTONIC);
    for (n = 0; n < reps || now_s(CLOCK_PROCESS_CPUTIME_ID) - c0 < min_cpu_s; n++)
        op_attention_backward(dq, dk, dv, dout, out, lse, q, k, v, doc, B, T, H, KV, D);
    bc = (now_s(CLOCK_PROCESS_CPUTIME_ID) - c0) / n, bw = (now_s(CLOCK_MONOTONIC) - w0) / n;
    printf("%-14s B=%d T=%-4d H=%-2d KV=%d D=%-3d docs=%-4d threads=%d | fwd %8.2f CPU ms %8.2f wall ms %6.1f GFLOP/CPU-s "
           "| bwd %8.2f CPU ms %8.2f wall ms %6.1f GFLOP/CPU-s\n",
           name, B, T, H, KV, D, docs, omp_get_max_threads(), 1e3 * fc, 1e3 * fw, fwd_flop / fc * 1e-9, 1e3 * bc,
           1e3 * bw, bwd_flop / bc * 1e-9);
    if (B == 1) {
        /* decoding (qtune generate): the T-token prompt at once, then one token at position T-1 */
        double pc, dc;
        op_attention_forward_cached(out, q, k, v, T, 0, H, KV, D);
        c0 = now_s(CLOCK_PROCESS_CPUTIME_ID);
        for (n = 0; n < reps || now_s(CLOCK_PROCESS_CPUTIME_ID) - c0 < min_cpu_s; n++)
            op_attention_forward_cached(out, q, k, v, T, 0, H, KV, D);
        pc = (now_s(CLOCK_PROCESS_CPUTIME_ID) - c0) / n;
        c0 = now_s(CLOCK_PROCESS_CPUTIME_ID);
        for (n = 0; n < reps || now_s(CLOCK_PROCESS_CPUTIME_ID) - c0 < min_cpu_s; n++)
            op_attention_forward_cached(out, q + (size_t)(T - 1) * H * D, k, v, 1, T - 1, H, KV, D);
        dc = (now_s(CLOCK_PROCESS_CPUTIME_ID) - c0) / n;
        printf("%-14s cached: prompt of %d %8.2f CPU ms %6.1f GFLOP/CPU-s | one token at %d %8.3f CPU ms\n", name, T,
               1e3 * pc, fwd_flop / pc * 1e-9, T - 1, 1e3 * dc);
    }
    fflush(stdout);
    qt_free(q), qt_free(k), qt_free(v), qt_free(dout), qt_free(out), qt_free(lse);
    qt_free(dq), qt_free(dk), qt_free(dv), qt_free(doc);
}

int main(int argc, char **argv) {
    int reps = 5, docs = 0, shape[5] = {0};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            omp_set_num_threads(atoi(argv[++i]));
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--min-cpu") && i + 1 < argc)
            min_cpu_s = atof(argv[++i]);
        else if (!strcmp(argv[i], "--docs") && i + 1 < argc)
            docs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--shape") && i + 5 < argc)
            for (int j = 0; j < 5; j++) shape[j] = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: %s [--threads N] [--reps R] [--min-cpu S] [--shape B T H KV D] [--docs L]\n", argv[0]);
            return 2;
        }
    }
    if (reps < 1) reps = 1;
    if (shape[0] > 0) {
        run_shape("custom", shape[0], shape[1], shape[2], shape[3], shape[4], docs, reps);
        return 0;
    }
    run_shape("qwen2.5-0.5b", 1, 256, 14, 2, 64, docs, reps);
    run_shape("qwen2.5-0.5b", 1, 1024, 14, 2, 64, docs, reps);
    run_shape("bench-tiny", 4, 256, 4, 2, 64, docs, reps);
    return 0;
}
