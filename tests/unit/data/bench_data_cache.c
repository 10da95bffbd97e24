/* Benchmark (not a test): token cache build time, cache load time and batch
 * throughput for one JSONL file. Results go in docs/data.md.
 *   bench_data_cache TOKENIZER.json DATA.jsonl CACHE_DIR [seq_len] [micro_batch] [num_workers] */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "core/error.h"
#include "core/fs.h"
#include "data/loader.h"
#include "text/tokenizer.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int fail(const char *what) {
    fprintf(stderr, "%s: %s\n", what, qt_error_message());
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s TOKENIZER.json DATA.jsonl CACHE_DIR [seq_len] [micro_batch] [num_workers]\n", argv[0]);
        return 2;
    }
    bpe_tokenizer *tok;
    if (bpe_load(argv[1], &tok) != QT_OK) return fail("bpe_load");
    dl_config c;
    dl_config_default(&c);
    c.path = argv[2];
    c.cache_dir = argv[3];
    c.seq_len = argc > 4 ? atoi(argv[4]) : 2048;
    c.micro_batch = argc > 5 ? atoi(argv[5]) : 4;
    c.num_workers = argc > 6 ? atoi(argv[6]) : 0;
    qt_rm_rf(argv[3]);
    dl_loader *l;
    double t0 = now_s();
    if (dl_open(&c, tok, &l) != QT_OK) return fail("dl_open (build)");
    double build_s = now_s() - t0;
    dl_stats st;
    dl_get_stats(l, &st);
    dl_close(l);
    t0 = now_s();
    if (dl_open(&c, tok, &l) != QT_OK) return fail("dl_open (cached)");
    double load_s = now_s() - t0;
    dl_stats st2;
    dl_get_stats(l, &st2);
    qt_batch b;
    if (dl_batch_alloc(l, &b) != QT_OK) return fail("dl_batch_alloc");
    int n_batches = 2000;
    t0 = now_s();
    for (int i = 0; i < n_batches; i++)
        if (dl_next(l, &b) != QT_OK) return fail("dl_next");
    double next_s = now_s() - t0;
    dl_get_stats(l, &st2);
    double fill = 1.0 - (double)st2.n_pad / ((double)n_batches * c.micro_batch * c.seq_len);
    printf("{\"examples\": %lld, \"tokens\": %lld, \"cache_written\": %d, \"build_s\": %.3f, "
           "\"cache_hit\": %d, \"load_s\": %.3f, \"batches\": %d, \"B\": %d, \"T\": %d, \"workers\": %d, "
           "\"batches_per_s\": %.0f, \"tokens_per_s_loader\": %.3g, \"non_pad_fraction\": %.4f}\n",
           (long long)st.n_examples, (long long)st.n_tokens, st.n_cache_written, build_s, st2.n_cache_hits, load_s,
           n_batches, c.micro_batch, c.seq_len, st2.num_workers, n_batches / next_s,
           (double)n_batches * c.micro_batch * c.seq_len / next_s, fill);
    dl_batch_free(&b);
    dl_close(l);
    bpe_free(tok);
    return 0;
}
