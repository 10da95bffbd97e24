/* bench_tokenize: how fast qtune's tokenizer loads and encodes, on one core.
 *
 *   bench_tokenize TOKENIZER FILE [RUNS]
 *
 * Wall-clock figures and CPU-time figures (this thread's CPU seconds, which
 * leave out time spent waiting for a core on a busy machine) are both given.
 *
 * Each run loads the tokenizer afresh (so the word cache starts cold) and
 * encodes the whole file once, in one bpe_encode call. Prints one JSON line:
 * the best and median load seconds and encode MB/s over RUNS (default 3),
 * the bytes and the id count. bench/tokenize_bench.sh runs it beside the JS
 * reference on the same text.
 *
 *   bench_tokenize --check-split TOKENIZER FILE
 *
 * compares the hand-written split matcher (src/text/bpe_split.c) with PCRE2
 * at every character of FILE (invalid UTF-8 replaced first) and exits 1 at
 * the first difference. */
#include "core/error.h"
#include "core/fs.h"
#include "core/mem.h"
#include "text/bpe_impl.h"
#include "text/tokenizer.h"
#include "text/utf8.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double clock_s(clockid_t c) {
    struct timespec ts;
    clock_gettime(c, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
static double now(void) { return clock_s(CLOCK_MONOTONIC); }
/* CPU time of this thread: on a shared machine, the time the encoder really
 * ran, not the time it waited for a core. Both are reported. */
static double cpu(void) { return clock_s(CLOCK_THREAD_CPUTIME_ID); }

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int check_split(const char *tok, const char *file) {
    char *text, *clean = NULL;
    size_t len, clen;
    bpe_tokenizer *t;
    if (qt_read_file(file, (size_t)1 << 32, &text, &len) != QT_OK || bpe_load(tok, &t) != QT_OK ||
        utf8_sanitize(text, len, &clean, &clen) != QT_OK) {
        fprintf(stderr, "bench_tokenize: %s\n", qt_error_message());
        return 1;
    }
    size_t checked = 0;
    int rc = bpe_split_check(t, clean, clen, &checked);
    if (rc != QT_OK) fprintf(stderr, "bench_tokenize: %s\n", qt_error_message());
    printf("{\"bytes\": %zu, \"fast_path\": %d, \"offsets_checked\": %zu, \"agree\": %s}\n", clen, t->cp_class != NULL,
           checked, rc == QT_OK ? "true" : "false");
    qt_free(clean);
    qt_free(text);
    bpe_free(t);
    return rc == QT_OK ? 0 : 1;
}

int main(int argc, char **argv) {
    if (argc == 4 && !strcmp(argv[1], "--check-split")) return check_split(argv[2], argv[3]);
    if (argc < 3) {
        fprintf(stderr, "usage: bench_tokenize TOKENIZER FILE [RUNS]\n");
        return 2;
    }
    int runs = argc > 3 ? atoi(argv[3]) : 3;
    if (runs < 1 || runs > 100) runs = 3;
    char *text;
    size_t len;
    if (qt_read_file(argv[2], (size_t)1 << 32, &text, &len) != QT_OK) {
        fprintf(stderr, "bench_tokenize: %s\n", qt_error_message());
        return 1;
    }
    double load_s[100], mbps[100], load_cpu[100], mbps_cpu[100];
    size_t n = 0;
    for (int r = 0; r < runs; r++) {
        double c0 = cpu(), t0 = now();
        bpe_tokenizer *t;
        if (bpe_load(argv[1], &t) != QT_OK) {
            fprintf(stderr, "bench_tokenize: %s\n", qt_error_message());
            return 1;
        }
        double t1 = now(), c1 = cpu();
        int32_t *ids = NULL;
        size_t cap = 0;
        n = 0;
        if (bpe_encode(t, text, len, &ids, &n, &cap) != QT_OK) {
            fprintf(stderr, "bench_tokenize: %s\n", qt_error_message());
            return 1;
        }
        double t2 = now(), c2 = cpu();
        load_s[r] = t1 - t0;
        mbps[r] = (double)len / (t2 - t1) / 1e6;
        load_cpu[r] = c1 - c0;
        mbps_cpu[r] = (double)len / (c2 - c1) / 1e6;
        qt_free(ids);
        bpe_free(t);
    }
    qsort(load_s, (size_t)runs, sizeof *load_s, cmp_double);
    qsort(mbps, (size_t)runs, sizeof *mbps, cmp_double);
    qsort(load_cpu, (size_t)runs, sizeof *load_cpu, cmp_double);
    qsort(mbps_cpu, (size_t)runs, sizeof *mbps_cpu, cmp_double);
    printf("{\"bytes\": %zu, \"ids\": %zu, \"runs\": %d, \"load_s_best\": %.3f, \"load_s_median\": %.3f, "
           "\"encode_mb_per_s_best\": %.2f, \"encode_mb_per_s_median\": %.2f, \"load_cpu_s_median\": %.3f, "
           "\"encode_cpu_mb_per_s_median\": %.2f}\n",
           len, n, runs, load_s[0], load_s[runs / 2], mbps[runs - 1], mbps[runs / 2], load_cpu[runs / 2], mbps_cpu[runs / 2]);
    qt_free(text);
    return 0;
}
