/* Test tool (not a test): opens a loader from command-line options and prints
 * batches as JSON lines, for the Python tests in tests/data/.
 *   dl_dump --data F [--data F2] [--seq-len T] [--batch B] [--packing 0|1] [--shuffle 0|1]
 *           [--seed S] [--rank r] [--world w] [--eval] [--batches n] [--tokenizer J]
 *           [--format F] [--mask-prompt 0|1] [--split] [--cache-dir D] [--no-cache]
 *           [--workers n] [--prefetch n] [--vocab V] [--skip-bad-lines] [--state E,I] [--pack-window W]
 *           [--mix concat|interleave_under|interleave_over] [--weight w (one per --data, in order)]
 * The last line is {"stats": {...}}. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/error.h"
#include "data/loader.h"
#include "text/tokenizer.h"

static void print_array(const char *name, const int32_t *a, int n) {
    printf("\"%s\": [", name);
    for (int i = 0; i < n; i++) printf(i ? ",%d" : "%d", a[i]);
    printf("]");
}

int main(int argc, char **argv) {
    dl_config c;
    dl_config_default(&c);
    c.shuffle = 0;
    c.num_workers = 1;
    const char *paths[16];
    double weights[16];
    int n_paths = 0, n_weights = 0, batches = -1;
    const char *tok_path = NULL;
    dl_state start = {-1, -1};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int used = 1;
        if (!strcmp(a, "--data") && v && n_paths < 16) paths[n_paths++] = v;
        else if (!strcmp(a, "--seq-len") && v) c.seq_len = atoi(v);
        else if (!strcmp(a, "--batch") && v) c.micro_batch = atoi(v);
        else if (!strcmp(a, "--packing") && v) c.packing = atoi(v);
        else if (!strcmp(a, "--shuffle") && v) c.shuffle = atoi(v);
        else if (!strcmp(a, "--seed") && v) c.seed = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--rank") && v) c.rank = atoi(v);
        else if (!strcmp(a, "--world") && v) c.world = atoi(v);
        else if (!strcmp(a, "--batches") && v) batches = atoi(v);
        else if (!strcmp(a, "--tokenizer") && v) tok_path = v;
        else if (!strcmp(a, "--mask-prompt") && v) c.mask_prompt = atoi(v);
        else if (!strcmp(a, "--cache-dir") && v) c.cache_dir = v;
        else if (!strcmp(a, "--workers") && v) c.num_workers = atoi(v);
        else if (!strcmp(a, "--prefetch") && v) c.prefetch = atoi(v);
        else if (!strcmp(a, "--vocab") && v) c.vocab_size = atoi(v);
        else if (!strcmp(a, "--pack-window") && v) c.pack_window = atoi(v);
        else if (!strcmp(a, "--weight") && v && n_weights < 16) weights[n_weights++] = atof(v);
        else if (!strcmp(a, "--mix") && v) {
            if (dl_mix_parse(v, &c.mix) != QT_OK) { fprintf(stderr, "dl_dump: unknown mix %s\n", v); return 2; }
        }
        else if (!strcmp(a, "--state") && v) {
            long long e, x;
            if (sscanf(v, "%lld,%lld", &e, &x) == 2) start = (dl_state){e, x};
        } else if (!strcmp(a, "--format") && v) {
            if (dl_format_parse(v, &c.format) != QT_OK) { fprintf(stderr, "%s\n", qt_error_message()); return 2; }
        } else {
            used = 0;
            if (!strcmp(a, "--eval")) c.eval = 1;
            else if (!strcmp(a, "--split")) c.overlong = DL_OVERLONG_SPLIT;
            else if (!strcmp(a, "--no-cache")) c.no_cache = 1;
            else if (!strcmp(a, "--skip-bad-lines")) c.skip_bad_lines = 1;
            else { fprintf(stderr, "dl_dump: unknown option %s\n", a); return 2; }
        }
        i += used;
    }
    c.paths = paths;
    c.n_paths = n_paths;
    if (n_weights) c.mix_weights = weights;
    bpe_tokenizer *tok = NULL;
    if (tok_path && bpe_load(tok_path, &tok) != QT_OK) { fprintf(stderr, "%s\n", qt_error_message()); return 1; }
    dl_loader *l;
    if (dl_open(&c, tok, &l) != QT_OK) { fprintf(stderr, "%s\n", qt_error_message()); bpe_free(tok); return 1; }
    if (start.epoch >= 0 && dl_state_set(l, start) != QT_OK) { fprintf(stderr, "%s\n", qt_error_message()); return 1; }
    qt_batch b;
    if (dl_batch_alloc(l, &b) != QT_OK) return 1;
    int BT = b.B * b.T, rc = QT_OK;
    for (int k = 0; batches < 0 || k < batches; k++) {
        rc = dl_next(l, &b);
        if (rc != QT_OK) break;
        dl_state s = dl_state_get(l);
        printf("{");
        print_array("inputs", b.inputs, BT); printf(", ");
        print_array("targets", b.targets, BT); printf(", ");
        print_array("positions", b.positions, BT); printf(", ");
        print_array("doc_start", b.doc_start, BT);
        printf(", \"n_target\": %lld, \"state\": [%lld, %lld]}\n", (long long)b.n_target, (long long)s.epoch, (long long)s.index);
    }
    if (rc < 0) { fprintf(stderr, "%s\n", qt_error_message()); return 1; }
    dl_stats st;
    dl_get_stats(l, &st);
    printf("{\"stats\": {\"n_examples\": %lld, \"n_examples_rank\": %lld, \"n_tokens\": %lld, \"n_labels\": %lld, "
           "\"n_lines_skipped\": %lld, \"n_truncated\": %lld, \"n_split\": %lld, \"n_cache_hits\": %d, "
           "\"n_cache_written\": %d, \"n_mix_dropped\": %lld, \"n_mix_repeated\": %lld, \"B\": %d, \"T\": %d}}\n",
           (long long)st.n_examples, (long long)st.n_examples_rank, (long long)st.n_tokens, (long long)st.n_labels,
           (long long)st.n_lines_skipped, (long long)st.n_truncated, (long long)st.n_split, st.n_cache_hits,
           st.n_cache_written, (long long)st.n_mix_dropped, (long long)st.n_mix_repeated, b.B, b.T);
    dl_batch_free(&b);
    dl_close(l);
    bpe_free(tok);
    return 0;
}
