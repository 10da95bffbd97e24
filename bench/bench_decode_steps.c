/* Decode steps against the memory bandwidth of the same moment: one-token
 * greedy decode steps of a model, each between two passes of STREAM's triad
 * in the same process, so every step has a bandwidth figure from a few
 * milliseconds before and after it.
 *
 *   bench_decode_steps --model DIR --bytes B [--steps N] [--prompt P] [--triad-mib M] [--seed S]
 *
 * B is the bytes of weights one step reads (bench_decode.py's bytes_per_token).
 * On this project's shared machines the triad read 41-76 GB/s at 2 threads
 * within one minute (bench/RESULTS-decode.md, session 16), and a run of 64
 * steps (1-4 s) between triads measured seconds apart is compared with a
 * bandwidth it may not have had. Here each step's read rate (B / the step's
 * time, sampling included, as generate's decode tokens/s) is divided by the
 * mean of the two single triad passes around it; the figure is the median of
 * those ratios over the steps. A triad pass over three arrays of M MiB
 * (default 128: 384 MiB a pass, far past the L3) counts 3 x 4 bytes an
 * element as STREAM does, one pass each, not the best of several. The passes
 * evict the KV cache and the activations from the caches, which a step then
 * reads from memory (at a 100-token context, a few MB against the weights'
 * hundreds): the figure leans, slightly, against the decode.
 *
 * Output: one JSON object: steps, median step ms, median triad GB/s, median
 * step GB/s, the median of the per-step ratios (pct_of_triad_median) and its
 * quartiles, the prompt's ids (seeded, in the vocabulary) and the greedy ids
 * the steps took (tests/bench/test_bench_tools.py holds them against qtune
 * generate's). OMP_NUM_THREADS sets the threads, as for qtune. */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/clock.h"
#include "core/error.h"
#include "core/mem.h"
#include "core/rng.h"
#include "model/model.h"
#include "model/sample.h"

static int cmp_d(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* q-quantile of v[0..n-1] (sorts v) */
static double quantile(double *v, int n, double q) {
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return v[(int)(q * (n - 1) + 0.5)];
}

/* one triad pass a = b + 3 c over n floats on every thread: GB/s counting 12 bytes an element */
static double triad(float *a, const float *b, const float *c, size_t n) {
    const double t0 = qt_now_s();
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) a[i] = b[i] + 3.0f * c[i];
    return 12.0 * (double)n / (qt_now_s() - t0) / 1e9;
}

int main(int argc, char **argv) {
    const char *model = NULL;
    double bytes = 0;
    int steps = 64, prompt = 16, mib = 128;
    uint64_t seed = 5;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--model") && i + 1 < argc) model = argv[++i];
        else if (!strcmp(argv[i], "--bytes") && i + 1 < argc) bytes = atof(argv[++i]);
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--prompt") && i + 1 < argc) prompt = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--triad-mib") && i + 1 < argc) mib = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc) seed = strtoull(argv[++i], NULL, 10);
        else {
            fprintf(stderr, "usage: bench_decode_steps --model DIR --bytes B [--steps N] [--prompt P] [--triad-mib M] "
                            "[--seed S]\n");
            return 2;
        }
    }
    if (!model || bytes <= 0 || steps < 1 || prompt < 1 || mib < 1) {
        fprintf(stderr, "bench_decode_steps: --model and a positive --bytes are needed (and positive --steps, "
                        "--prompt, --triad-mib)\n");
        return 2;
    }
    qt_model_opts mo;
    qt_model_opts_default(&mo);
    mo.infer = 1;
    mo.max_T = prompt + steps + 1;
    qt_model *m = NULL;
    if (qt_model_load(model, &mo, &m) != QT_OK) {
        fprintf(stderr, "bench_decode_steps: %s\n", qt_error_message());
        return 1;
    }
    const int V = qt_model_config(m)->vocab_size;
    const size_t n = (size_t)mib << 18; /* floats in M MiB */
    float *logits = malloc(sizeof(float) * (size_t)V), *a = qt_alloc_aligned(n * 4, "triad a"),
          *b = qt_alloc_aligned(n * 4, "triad b"), *c = qt_alloc_aligned(n * 4, "triad c");
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)prompt), *out = malloc(sizeof(int32_t) * (size_t)(steps + 1));
    double *tri = malloc(sizeof(double) * (size_t)(steps + 1)), *step = malloc(sizeof(double) * (size_t)steps),
           *ratio = malloc(sizeof(double) * (size_t)steps);
    if (!logits || !a || !b || !c || !ids || !out || !tri || !step || !ratio) {
        fprintf(stderr, "bench_decode_steps: out of memory\n");
        return 1;
    }
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) a[i] = 0.0f, b[i] = 1.0f, c[i] = 2.0f; /* first touch by the thread that reads */
    qt_rng rng;
    qt_rng_seed(&rng, seed);
    for (int i = 0; i < prompt; i++) ids[i] = (int32_t)(qt_rng_u64(&rng) % (uint64_t)V);
    if (qt_model_decode(m, ids, prompt, 0, logits) != QT_OK) {
        fprintf(stderr, "bench_decode_steps: %s\n", qt_error_message());
        return 1;
    }
    int32_t next = out[0] = qt_argmax(logits, V);
    triad(a, b, c, n), triad(a, b, c, n); /* warm-up */
    tri[0] = triad(a, b, c, n);
    for (int s = 0; s < steps; s++) {
        const double t0 = qt_now_s();
        if (qt_model_decode(m, &next, 1, prompt + s, logits) != QT_OK) {
            fprintf(stderr, "bench_decode_steps: %s\n", qt_error_message());
            return 1;
        }
        next = out[s + 1] = qt_argmax(logits, V);
        step[s] = qt_now_s() - t0;
        tri[s + 1] = triad(a, b, c, n);
        ratio[s] = bytes / step[s] / 1e9 / ((tri[s] + tri[s + 1]) / 2);
    }
    double *gbs = malloc(sizeof(double) * (size_t)steps);
    if (!gbs) return 1;
    for (int s = 0; s < steps; s++) gbs[s] = bytes / step[s] / 1e9;
    const double step_ms = 1e3 * quantile(step, steps, 0.5), tri_med = quantile(tri, steps + 1, 0.5),
                 gbs_med = quantile(gbs, steps, 0.5), q1 = quantile(ratio, steps, 0.25),
                 med = quantile(ratio, steps, 0.5), q3 = quantile(ratio, steps, 0.75);
    printf("{\"threads\": %d, \"steps\": %d, \"bytes_per_token\": %.0f, \"step_ms_median\": %.3f, "
           "\"step_gbs_median\": %.2f, \"triad_gbs_median\": %.2f, \"pct_of_triad_median\": %.1f, "
           "\"pct_of_triad_q1\": %.1f, \"pct_of_triad_q3\": %.1f, \"prompt_ids\": [",
           omp_get_max_threads(), steps, bytes, step_ms, gbs_med, tri_med, 100 * med, 100 * q1, 100 * q3);
    for (int i = 0; i < prompt; i++) printf("%s%d", i ? ", " : "", ids[i]);
    printf("], \"ids\": [");
    for (int i = 0; i <= steps; i++) printf("%s%d", i ? ", " : "", out[i]);
    printf("]}\n");
    qt_model_free(m);
    qt_free(a), qt_free(b), qt_free(c);
    free(logits), free(ids), free(out), free(tri), free(step), free(ratio), free(gbs);
    return 0;
}
